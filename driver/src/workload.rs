//! Block-level workloads for benchmarks (`cargo bench -p nvstore-driver`, `nvstore bench device`)
//! and, for comparison in the same run, the same workload through `fio`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::device::{BlockDevice, Completion, QueueHandle, Request};
use crate::error::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    RandRead,
    RandWrite,
    SeqRead,
    SeqWrite,
}

impl Pattern {
    fn fio_rw(self) -> &'static str {
        match self {
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::SeqRead => "read",
            Pattern::SeqWrite => "write",
        }
    }

    fn is_read(self) -> bool {
        matches!(self, Pattern::RandRead | Pattern::SeqRead)
    }

    fn is_random(self) -> bool {
        matches!(self, Pattern::RandRead | Pattern::RandWrite)
    }
}

/// One workload: `pattern` in `io_bytes` units at `depth`, over the first `span_bytes` of the
/// device, for `duration`.
#[derive(Debug, Clone)]
pub struct Spec {
    pub pattern: Pattern,
    pub io_bytes: u32,
    pub depth: u32,
    pub span_bytes: u64,
    pub duration: Duration,
    pub seed: u64,
}

impl Spec {
    pub fn label(&self) -> String {
        let size = if self.io_bytes >= 1024 {
            format!("{}k", self.io_bytes / 1024)
        } else {
            format!("{}b", self.io_bytes)
        };
        format!("{} {size} QD{}", self.pattern.fio_rw(), self.depth)
    }
}

/// What a run achieved.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub ios: u64,
    pub bytes: u64,
    pub elapsed: Duration,
    /// CPU time (user + system) the run consumed, per IO, in microseconds.
    pub cpu_us_per_io: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
}

impl Report {
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.elapsed.as_secs_f64()
    }

    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64() / 1e6
    }
}

/// CPU time of the calling thread (user + system).
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Run `spec` on one queue of `dev` from the calling thread. Buffers are allocated up front;
/// the loop itself does not allocate.
pub fn run<D: BlockDevice>(dev: &D, spec: &Spec) -> Result<Report> {
    let geo = dev.geometry();
    let bs = geo.block_size as u64;
    let blocks = (spec.io_bytes as u64 / bs) as u32;
    assert!(
        blocks > 0 && (spec.io_bytes as u64).is_multiple_of(bs),
        "io size must be whole blocks"
    );
    let slots = (spec.span_bytes.min(geo.capacity_bytes()) / spec.io_bytes as u64).max(1);
    let mut q = dev.open_queue()?;
    let depth = (spec.depth as usize).min(q.depth());
    let mut bufs = Vec::with_capacity(depth);
    let mut rng = Xorshift(spec.seed | 1);
    for _ in 0..depth {
        let mut b = dev.alloc_buf(spec.io_bytes as usize)?;
        let noise: Vec<u8> = (0..spec.io_bytes).map(|_| rng.next() as u8).collect();
        b.write_at(0, &noise);
        bufs.push(b);
    }
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut started: Vec<Instant> = vec![Instant::now(); depth];
    let mut out: Vec<Completion> = (0..depth).map(|_| Completion::default()).collect();
    let mut next_seq = 0u64;
    let mut report = Report::default();
    let cpu0 = thread_cpu_time();
    let t0 = Instant::now();
    let deadline = t0 + spec.duration;
    let mut submit = |q: &mut D::Queue, buf, slot: usize, started: &mut [Instant]| {
        let index = if spec.pattern.is_random() {
            rng.next() % slots
        } else {
            next_seq = (next_seq + 1) % slots;
            next_seq
        };
        let lba = index * blocks as u64;
        let req = if spec.pattern.is_read() {
            Request::read(lba, blocks, buf, 0, slot as u64)
        } else {
            Request::write(lba, blocks, buf, 0, false, slot as u64)
        };
        started[slot] = Instant::now();
        q.submit(req).map_err(|e| e.into_error(dev.name()))
    };
    for (slot, buf) in bufs.drain(..).enumerate() {
        submit(&mut q, buf, slot, &mut started)?;
    }
    while q.in_flight() > 0 {
        let n = q.wait(&mut out, 1, Duration::from_secs(30))?;
        let now = Instant::now();
        for c in &mut out[..n] {
            let c = std::mem::take(c);
            c.result?;
            let slot = c.tag as usize;
            hist.saturating_record(now.duration_since(started[slot]).as_nanos() as u64 / 1000);
            report.ios += 1;
            report.bytes += spec.io_bytes as u64;
            if now < deadline {
                submit(
                    &mut q,
                    c.buf.expect("data op returns its buffer"),
                    slot,
                    &mut started,
                )?;
                // Hand each request to the device at once, as fio does (one submission per
                // IO): with DEFER_TASKRUN the same enter also posts finished completions, so
                // the loop rarely sleeps. Handing the resubmissions over only with the next
                // wait measured 0.79–0.91x of fio's IOPS (one run 1.03x) against 0.95–1.05x
                // this way (random 4 KiB reads, QD32, alternating runs).
                q.kick()?;
            }
        }
    }
    report.elapsed = t0.elapsed();
    let cpu = thread_cpu_time() - cpu0;
    report.cpu_us_per_io = cpu.as_secs_f64() * 1e6 / report.ios.max(1) as f64;
    report.lat_p50_us = hist.value_at_quantile(0.5) as f64;
    report.lat_p99_us = hist.value_at_quantile(0.99) as f64;
    Ok(report)
}

/// Run the same workload with `fio` (io_uring engine, O_DIRECT) on `path`. Returns `Err` with
/// the reason when fio is missing or fails.
pub fn run_fio(path: &Path, spec: &Spec) -> std::result::Result<Report, String> {
    run_fio_with(path, spec, &[])
}

/// [`run_fio`] with extra fio arguments (e.g. `--fdatasync=32`).
pub fn run_fio_with(
    path: &Path,
    spec: &Spec,
    extra: &[&str],
) -> std::result::Result<Report, String> {
    let out = Command::new("fio")
        .args(extra)
        .args([
            "--name=nvstore-compare",
            &format!("--filename={}", path.display()),
            "--ioengine=io_uring",
            "--direct=1",
            "--registerfiles=1",
            "--norandommap",
            "--randrepeat=0",
            "--time_based",
            "--output-format=json",
            &format!("--rw={}", spec.pattern.fio_rw()),
            &format!("--bs={}", spec.io_bytes),
            &format!("--iodepth={}", spec.depth),
            &format!("--size={}", spec.span_bytes),
            &format!("--runtime={}ms", spec.duration.as_millis()),
        ])
        .output()
        .map_err(|e| format!("cannot run fio: {e} (install the fio package)"))?;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    parse_fio(&out.stdout, spec.pattern.is_read())
}

fn parse_fio(json: &[u8], read: bool) -> std::result::Result<Report, String> {
    // fio may print warnings before the JSON document.
    let start = json
        .iter()
        .position(|&b| b == b'{')
        .ok_or("fio printed no JSON")?;
    let v: serde_json::Value =
        serde_json::from_slice(&json[start..]).map_err(|e| format!("fio JSON: {e}"))?;
    let job = &v["jobs"][0];
    let dir = &job[if read { "read" } else { "write" }];
    let num = |x: &serde_json::Value| x.as_f64().unwrap_or(0.0);
    let ios = num(&dir["total_ios"]) as u64;
    let runtime_ms = num(&dir["runtime"]);
    let cpu_pct = num(&job["usr_cpu"]) + num(&job["sys_cpu"]);
    let elapsed = Duration::from_secs_f64(runtime_ms / 1000.0);
    let pct = &dir["clat_ns"]["percentile"];
    Ok(Report {
        ios,
        bytes: num(&dir["io_bytes"]) as u64,
        elapsed,
        cpu_us_per_io: cpu_pct / 100.0 * elapsed.as_secs_f64() * 1e6 / ios.max(1) as f64,
        lat_p50_us: num(&pct["50.000000"]) / 1000.0,
        lat_p99_us: num(&pct["99.000000"]) / 1000.0,
    })
}

/// The data extents of `path` as (offset, length), holes left out (SEEK_DATA / SEEK_HOLE).
/// A baseline that reads a sparse file must stay within what was written: the kernel answers
/// a read of a hole with zeros and no device IO, so a span over holes flatters it.
pub fn data_extents(path: &Path) -> std::io::Result<Vec<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    let size = f.metadata()?.len() as i64;
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut at = 0i64;
    while at < size {
        // SAFETY: lseek on a descriptor we own; it moves only that descriptor's offset.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data past `at`
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        out.push((data as u64, (hole - data) as u64));
        at = hole;
    }
    Ok(out)
}

/// Peak resident set size of this process (VmHWM), in KiB; 0 if unreadable.
pub fn peak_rss_kib() -> u64 {
    proc_status_kib("VmHWM:")
}

/// Start a new peak: VmHWM drops to the resident set size now (`/proc/self/clear_refs`, value
/// 5), so [`peak_rss_kib`] afterwards is the peak of what ran since. Returns whether the
/// kernel took it (Linux 4.0 and later; a read-only /proc does not).
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Give the C heap's free memory back to the kernel (glibc's `malloc_trim`): glibc keeps
/// what a phase freed mapped (a closed store with a million objects left ~220 MiB resident),
/// so the next phase's peak would count it. Elsewhere a no-op.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free pages of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Resident set size of this process now (VmRSS), in KiB; 0 if unreadable.
pub fn rss_kib() -> u64 {
    proc_status_kib("VmRSS:")
}

/// A `kB` field of /proc/self/status.
fn proc_status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// `/proc/diskstats` counters of one block device (sectors are 512 bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskCounters {
    pub reads: u64,
    pub read_sectors: u64,
    pub read_ms: u64,
    pub writes: u64,
    pub write_sectors: u64,
    pub write_ms: u64,
    /// Time-weighted milliseconds of requests in flight (the average queue depth × elapsed).
    pub weighted_ms: u64,
    /// Flush requests completed and the milliseconds they took (kernels since 5.5; 0 before).
    pub flushes: u64,
    pub flush_ms: u64,
}

/// The counters of device `major:minor` in a `/proc/diskstats` text.
pub fn parse_diskstats(text: &str, major: u64, minor: u64) -> Option<DiskCounters> {
    text.lines().find_map(|l| {
        let f: Vec<u64> = l
            .split_whitespace()
            .enumerate()
            .filter(|&(i, _)| i != 2)
            .map(|(_, v)| v.parse().ok())
            .collect::<Option<_>>()?;
        // major minor [name] reads merged sectors ms writes merged sectors ms inflight io_ms
        // weighted_ms, then (4.18) discards merged sectors ms, then (5.5) flushes flush_ms
        (f.len() >= 13 && f[0] == major && f[1] == minor).then(|| DiskCounters {
            reads: f[2],
            read_sectors: f[4],
            read_ms: f[5],
            writes: f[6],
            write_sectors: f[8],
            write_ms: f[9],
            weighted_ms: f[12],
            flushes: f.get(17).copied().unwrap_or(0),
            flush_ms: f.get(18).copied().unwrap_or(0),
        })
    })
}

/// What the disk under a file saw during a phase of a benchmark: request sizes, queue depth and
/// latency, from the kernel's own counters (so the same for our IO and fio's). Started with
/// [`DiskPhase::start`], read with [`DiskPhase::finish`].
#[derive(Debug, Clone, Copy)]
pub struct DiskPhase {
    dev: (u64, u64),
    start: DiskCounters,
    t0: Instant,
}

/// The difference of the counters over a phase and its length.
#[derive(Debug, Clone, Copy)]
pub struct DiskDelta {
    pub c: DiskCounters,
    pub secs: f64,
}

impl DiskPhase {
    /// `None` when the file is not on a block device listed in `/proc/diskstats` (tmpfs).
    pub fn start(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let d = std::fs::metadata(path).ok()?.dev();
        let dev = (u64::from(libc::major(d)), u64::from(libc::minor(d)));
        let start = parse_diskstats(
            &std::fs::read_to_string("/proc/diskstats").ok()?,
            dev.0,
            dev.1,
        )?;
        Some(DiskPhase {
            dev,
            start,
            t0: Instant::now(),
        })
    }

    pub fn finish(&self) -> Option<DiskDelta> {
        let now = std::fs::read_to_string("/proc/diskstats").ok()?;
        let e = parse_diskstats(&now, self.dev.0, self.dev.1)?;
        let s = &self.start;
        Some(DiskDelta {
            c: DiskCounters {
                reads: e.reads.saturating_sub(s.reads),
                read_sectors: e.read_sectors.saturating_sub(s.read_sectors),
                read_ms: e.read_ms.saturating_sub(s.read_ms),
                writes: e.writes.saturating_sub(s.writes),
                write_sectors: e.write_sectors.saturating_sub(s.write_sectors),
                write_ms: e.write_ms.saturating_sub(s.write_ms),
                weighted_ms: e.weighted_ms.saturating_sub(s.weighted_ms),
                flushes: e.flushes.saturating_sub(s.flushes),
                flush_ms: e.flush_ms.saturating_sub(s.flush_ms),
            },
            secs: self.t0.elapsed().as_secs_f64(),
        })
    }
}

impl std::fmt::Display for DiskDelta {
    /// `writes 2048 KiB/req, 23.1 in flight, 5.20 ms` (reads instead when they moved more),
    /// then `; 80 flushes/s of 1.20 ms` when the disk was flushed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.c;
        let (what, n, sectors, ms) = if c.read_sectors > c.write_sectors {
            ("reads", c.reads, c.read_sectors, c.read_ms)
        } else {
            ("writes", c.writes, c.write_sectors, c.write_ms)
        };
        write!(
            f,
            "{what} {:.0} KiB/req, {:.1} in flight, {:.2} ms",
            sectors as f64 / 2.0 / n.max(1) as f64,
            c.weighted_ms as f64 / 1e3 / self.secs.max(1e-9),
            ms as f64 / n.max(1) as f64
        )?;
        if c.flushes > 0 {
            write!(
                f,
                "; {:.0} flushes/s of {:.2} ms",
                c.flushes as f64 / self.secs.max(1e-9),
                c.flush_ms as f64 / c.flushes as f64
            )?;
        }
        Ok(())
    }
}

/// Median of a non-empty list: the middle value, or the mean of the two middle values of an
/// even count (the upper one alone flattered ten rounds of 0.80–0.92× as 0.90× for a median
/// of 0.8825×).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One workload's result: ours, and fio's (or why fio could not run).
pub type Row = (Spec, Report, std::result::Result<Report, String>);

/// The comparison table the driver benchmark prints: our FileDevice vs fio on the same file,
/// interleaved `rounds` times, medians reported.
pub fn compare_with_fio<D: BlockDevice>(
    dev: &D,
    path: &Path,
    specs: &[Spec],
    rounds: usize,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for spec in specs {
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for round in 0..rounds {
            // Alternate who goes first: the device (and the host cache under a VM disk) warms
            // up over a run, and the second runner would otherwise always get the warm device.
            let fio = if round % 2 == 1 {
                let f = run_fio(path, spec);
                ours.push(run(dev, spec)?);
                f
            } else {
                ours.push(run(dev, spec)?);
                run_fio(path, spec)
            };
            match fio {
                Ok(r) => theirs.push(r),
                Err(e) => {
                    theirs.clear();
                    rows.push((spec.clone(), pick_median(ours.clone()), Err(e)));
                    break;
                }
            }
        }
        if !theirs.is_empty() {
            rows.push((spec.clone(), pick_median(ours), Ok(pick_median(theirs))));
        }
    }
    Ok(rows)
}

/// The run with the median IOPS (keeps its latencies and CPU consistent with its rate); of an
/// even count, the upper of the two middle runs — for ours and fio's alike.
fn pick_median(mut runs: Vec<Report>) -> Report {
    runs.sort_by(|a, b| a.iops().partial_cmp(&b.iops()).unwrap());
    runs.swap_remove(runs.len() / 2)
}

/// Print the rows as a fixed-width table.
pub fn print_table(rows: &[Row]) {
    println!(
        "{:<22} {:>10} {:>9} {:>8} {:>8} {:>8} | {:>10} {:>9} {:>8} {:>8} {:>8} | {:>6}",
        "workload",
        "IOPS",
        "MB/s",
        "p50 µs",
        "p99 µs",
        "cpu µs",
        "fio IOPS",
        "fio MB/s",
        "p50 µs",
        "p99 µs",
        "cpu µs",
        "ratio"
    );
    for (spec, ours, fio) in rows {
        print!(
            "{:<22} {:>10.0} {:>9.1} {:>8.1} {:>8.1} {:>8.2} | ",
            spec.label(),
            ours.iops(),
            ours.mb_per_s(),
            ours.lat_p50_us,
            ours.lat_p99_us,
            ours.cpu_us_per_io
        );
        match fio {
            Ok(f) => println!(
                "{:>10.0} {:>9.1} {:>8.1} {:>8.1} {:>8.2} | {:>5.2}x",
                f.iops(),
                f.mb_per_s(),
                f.lat_p50_us,
                f.lat_p99_us,
                f.cpu_us_per_io,
                ours.iops() / f.iops()
            ),
            Err(e) => println!("fio unavailable: {e}"),
        }
    }
}

/// The workloads the Foundation issue names: 4 KiB random read and write at QD1 and QD32,
/// 128 KiB sequential write (QD8), over `span_bytes`.
pub fn standard_specs(span_bytes: u64, duration: Duration) -> Vec<Spec> {
    let spec = |pattern, io_bytes, depth| Spec {
        pattern,
        io_bytes,
        depth,
        span_bytes,
        duration,
        seed: 0x6e76_7374,
    };
    vec![
        spec(Pattern::RandRead, 4096, 1),
        spec(Pattern::RandRead, 4096, 32),
        spec(Pattern::RandWrite, 4096, 1),
        spec(Pattern::RandWrite, 4096, 32),
        spec(Pattern::SeqWrite, 128 * 1024, 8),
    ]
}

/// Write every byte of the first `span_bytes` (so reads hit allocated blocks, not holes that
/// the file system answers without touching the disk), then flush.
pub fn prefill<D: BlockDevice>(dev: &D, span_bytes: u64) -> Result<()> {
    let chunk = dev.geometry().max_transfer_bytes.min(1 << 20);
    let bs = dev.geometry().block_size as u64;
    let mut q = dev.open_queue()?;
    let mut buf = Some(dev.alloc_buf(chunk as usize)?);
    buf.as_mut().unwrap().fill(0, chunk as usize, 0x5a);
    let mut off = 0;
    while off < span_bytes {
        let req = Request::write(
            off / bs,
            (chunk as u64 / bs) as u32,
            buf.take().unwrap(),
            0,
            false,
            0,
        );
        let c = crate::io::execute(&mut q, req, Duration::from_secs(30));
        c.result?;
        buf = c.buf;
        off += chunk as u64;
    }
    crate::io::flush(&mut q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![0.9, 0.8, 0.86, 0.92]), 0.88);
        assert_eq!(median(vec![5.0]), 5.0);
    }

    #[test]
    fn a_reset_peak_forgets_a_freed_allocation() {
        // 256 MiB touched, then freed (returned to the kernel: glibc maps an allocation this
        // size on its own).
        let big = vec![1u8; 256 << 20];
        assert_eq!(
            big.iter().step_by(4096).map(|&b| b as u64).sum::<u64>(),
            65536
        );
        drop(big);
        trim_heap();
        let before = peak_rss_kib();
        assert!(
            before >= 256 << 10,
            "the peak holds the allocation: {before} KiB"
        );
        if !reset_peak_rss() {
            eprintln!("/proc/self/clear_refs not writable here: nothing to check");
            return;
        }
        let after = peak_rss_kib();
        assert!(
            after + (200 << 10) < before,
            "after the reset the peak is what is resident now: {after} KiB vs {before} KiB"
        );
    }

    #[test]
    fn diskstats_parse_and_phase_summary() {
        let text = "   7       0 loop0 10 0 80 1 0 0 0 0 0 1 1 0 0 0 0 0 0\n \
                    254       0 vda 100 5 800 30 200 7 819200 1000 3 900 2400 0 0 0 0 40 20\n \
                    254       1 vda1 1 0 8 1 2 0 16 1 0 1 2\n";
        let c = parse_diskstats(text, 254, 0).unwrap();
        assert_eq!((c.reads, c.read_sectors, c.read_ms), (100, 800, 30));
        assert_eq!((c.writes, c.write_sectors, c.write_ms), (200, 819200, 1000));
        assert_eq!(c.weighted_ms, 2400);
        assert_eq!((c.flushes, c.flush_ms), (40, 20));
        assert_eq!(parse_diskstats(text, 254, 1).unwrap().writes, 2);
        assert_eq!(parse_diskstats(text, 8, 0), None);
        let d = DiskDelta { c, secs: 2.0 };
        // 819200 sectors / 200 writes = 2048 KiB; 2.4 s of weighted time over 2 s; 5 ms each.
        // 40 flushes over 2 s, 20 ms in all.
        assert_eq!(
            d.to_string(),
            "writes 2048 KiB/req, 1.2 in flight, 5.00 ms; 20 flushes/s of 0.50 ms"
        );
        // A kernel without flush counters (before 5.5): the old line.
        let old = parse_diskstats("254 0 vda 1 0 8 1 2 0 16 4 0 1 2\n", 254, 0).unwrap();
        assert_eq!((old.writes, old.flushes), (2, 0));
    }

    #[test]
    fn parses_fio_json() {
        let json = br#"fio: warning
{"jobs":[{"usr_cpu":10.0,"sys_cpu":30.0,"read":{"total_ios":1000,"runtime":2000,
"io_bytes":4096000,"clat_ns":{"percentile":{"50.000000":12000,"99.000000":50000}}}}]}"#;
        let r = parse_fio(json, true).unwrap();
        assert_eq!(r.ios, 1000);
        assert_eq!(r.bytes, 4_096_000);
        assert!((r.iops() - 500.0).abs() < 1e-9);
        assert!((r.lat_p50_us - 12.0).abs() < 1e-9);
        // 40 % of 2 s = 0.8 s of CPU over 1000 IOs = 800 µs each
        assert!((r.cpu_us_per_io - 800.0).abs() < 1e-6);
    }
}
