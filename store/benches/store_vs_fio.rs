//! `cargo bench -p nvstore-store`: the store on a FileDevice over a local file, side by side
//! in the same run with fio on the same file:
//! * lone synchronous 4 KiB put latency vs the device's own write + flush latency;
//! * 4 MiB write_full MB/s (4 and 16 writers) vs fio sequential O_DIRECT write, 4 MiB
//!   blocks, QD4 and QD16, and the store's best against fio's best;
//! * 4 KiB durable puts/s (32 writers) vs fio 4 KiB randwrite QD32 with fdatasync every 32;
//! * 4 KiB reads/s (32 reader threads, and one thread with 32 in flight) vs fio 4 KiB
//!   randread QD32, with the driver's own loop on the same span as a third row, and fio's 32
//!   jobs and the bare driver's 32 threads of one read each — the 32-thread row's shape — as
//!   references (rounds of short windows, store and fio first in turn, medians of the
//!   per-round ratios);
//! * restart time at 100 k and 1 M objects, with checkpoints vs without (full replay);
//! * write amplification under churn (70 % full, random 64 KiB overwrites);
//! * index bytes per object, and peak RSS for each phase and for the run.
//!
//! Environment: `NVSTORE_BENCH_DIR` (default: the target directory), `NVSTORE_BENCH_SECS`
//! (default 10), `NVSTORE_BENCH_OBJECTS` (restart sizes, default "100000,1000000"),
//! `NVSTORE_BENCH_ONLY` (comma list of latency, writes, puts, reads, restart, churn),
//! `NVSTORE_BENCH_PAIRS` (alternating store/fio pairs for the 4 MiB writes, default 3),
//! `NVSTORE_READ_ROUNDS` and `NVSTORE_READ_SECS` (the 4 KiB reads' rounds, every phase once
//! per round, and each phase's window: default 10 rounds of 2 s),
//! `NVSTORE_BENCH_SPARSE` (set: the 4 MiB writes and the 4 KiB puts give each side a new
//! sparse file instead of one file written throughout), `NVSTORE_BENCH_WRITERS` (the 4 MiB
//! phase's store writer counts = fio queue depths, a comma list, default "4,16"),
//! `NVSTORE_READ_BATCH` (completions the one-thread reader waits for per poll, default 1).
//!
//! The write phases run on a file written throughout first (`FileDevice::allocate`, what
//! `nvstore mkfs --allocate` does to a device file; a block device's blocks are all there):
//! the store's `mkfs` and fio both write into it in place.
//!
//! `NVSTORE_BENCH_ONLY=read-knobs` (never part of a default run) compares the async reader's
//! poll settings in one process: one fill, then `NVSTORE_BENCH_ROUNDS` (default 10) rounds of
//! 2 s windows — the driver's own loop, each `batch:reap` setting of `NVSTORE_READ_KNOBS`
//! (default "4:4,1:4"; batch = completions a poll waits for, reap = most it takes; reverse
//! order in odd rounds) and 32 synchronous readers — each as a ratio to the round's driver
//! loop, then the medians. Single runs swing ±8 %: settings are compared round by round.
//! Without `--bench` (cargo test) it runs a tiny smoke version.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use driver::workload::{run_fio_with, DiskDelta, DiskPhase, Pattern, Report, Spec};
use driver::{BlockDevice, Completion, FileDevice, FileOptions, QueueHandle, Request};
use nvstore_store::bench::{drive, key};
use nvstore_store::{mkfs, MkfsOptions, Store, StoreConfig};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Options for the handles the bench opens beside the one `fresh` returns, which holds the
/// file's lock: a second bench on the same file is refused at `fresh` instead of writing
/// into this one's store.
fn beside() -> FileOptions {
    FileOptions {
        exclusive: false,
        ..FileOptions::default()
    }
}

fn fresh(path: &Path, size: u64, no_ckpt: bool) -> (Store<FileDevice>, FileDevice) {
    let dev = FileDevice::create(path, size, FileOptions::default()).expect("bench file");
    labelled(path, dev, no_ckpt)
}

/// A new store on the bench file as it is (written blocks stay written).
fn fresh_in_place(path: &Path) -> (Store<FileDevice>, FileDevice) {
    let dev = FileDevice::open(path, FileOptions::default()).expect("bench file");
    labelled(path, dev, false)
}

/// `mkfs` on `dev` (which holds the file's lock), then the store opened beside it.
fn labelled(path: &Path, dev: FileDevice, no_ckpt: bool) -> (Store<FileDevice>, FileDevice) {
    mkfs(
        &dev,
        &MkfsOptions {
            no_checkpoints: no_ckpt,
            ..MkfsOptions::default()
        },
    )
    .expect("mkfs");
    let reopen = FileDevice::open(path, beside()).unwrap();
    let (s, _) = Store::open(reopen, None, StoreConfig::default()).expect("open");
    (s, dev)
}

/// The bench file again, all holes, for a fio write baseline: the store wrote into a fresh
/// sparse file (every write allocates), so fio must too. Overwriting what the store left
/// allocated skips the file system's allocation and flattered fio.
fn sparse_again(path: &Path, size: u64) {
    let _ = std::fs::remove_file(path);
    std::fs::File::create(path)
        .and_then(|f| f.set_len(size))
        .expect("recreate the bench file");
}

fn pct(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64
}

fn fio(
    path: &Path,
    pattern: Pattern,
    bs: u32,
    depth: u32,
    span: u64,
    secs: f64,
    extra: &[&str],
) -> Option<Report> {
    let spec = Spec {
        pattern,
        io_bytes: bs,
        depth,
        span_bytes: span,
        duration: Duration::from_secs_f64(secs),
        seed: 1,
    };
    match run_fio_with(path, &spec, extra) {
        Ok(r) => Some(r),
        Err(e) => {
            println!("  fio unavailable: {e}");
            None
        }
    }
}

fn ratio(ours: f64, theirs: Option<f64>) -> String {
    theirs.map_or("-".into(), |t| format!("{:.2}x", ours / t))
}

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let dir = std::env::var_os("NVSTORE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let path = dir.join("store-bench.img");
    let secs = env_u64("NVSTORE_BENCH_SECS", if quick { 1 } else { 10 }) as f64;
    let size: u64 = if quick { 1 << 30 } else { 8 << 30 };
    // The host's disk throughput drifts between runs: large writes alternate store and fio
    // this many times and report the median ratio.
    let pairs = env_u64("NVSTORE_BENCH_PAIRS", if quick { 1 } else { 3 }) as usize;
    println!(
        "nvstore store vs fio on {} ({} GiB file), {secs} s per phase{}",
        path.display(),
        size >> 30,
        if quick {
            " (smoke run: figures not meaningful)"
        } else {
            ""
        }
    );
    // Figures differ between host CPUs (a cache flush that gained 2 % on one cost another
    // 40 %): every run names the one it ran on.
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!(
        "  CPU: {cpu}, {} threads",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // Peak RSS per phase as well as the run's: each phase starts a new peak.
    let per_phase = driver::workload::reset_peak_rss();
    let mut run_peak = 0u64;
    let mut start_rss = driver::workload::rss_kib();
    let mut phase_peak = |name: &str| {
        let kib = step_peak_kib().max(PHASE_PEAK_KIB.swap(0, Ordering::Relaxed));
        run_peak = run_peak.max(kib);
        if per_phase {
            println!(
                "  peak RSS of the {name} phase: {} MiB ({} MiB resident when it began)",
                kib >> 10,
                start_rss >> 10
            );
            // Its freed heap back to the kernel, so the next phase's peak is its own.
            driver::workload::trim_heap();
            start_rss = driver::workload::rss_kib();
        }
    };
    let only = std::env::var("NVSTORE_BENCH_ONLY").unwrap_or_default();
    let want = |name: &str| only.is_empty() || only.split(',').any(|o| o == name);
    if want("latency") {
        lone_put_latency(&path, size, quick);
        phase_peak("latency");
    }
    if want("writes") {
        let levels: Vec<usize> = std::env::var("NVSTORE_BENCH_WRITERS")
            .unwrap_or_else(|_| if quick { "4".into() } else { "4,16".into() })
            .split(',')
            .map(|w| {
                w.parse::<usize>()
                    .ok()
                    .filter(|&w| w > 0)
                    .expect("NVSTORE_BENCH_WRITERS is a list of writer counts, such as 4,16")
            })
            .collect();
        large_writes(&path, size, secs, pairs, &levels);
        phase_peak("4 MiB writes");
    }
    if want("puts") {
        small_puts(&path, size, secs);
        phase_peak("4 KiB puts");
    }
    if want("reads") {
        let rounds = env_u64("NVSTORE_READ_ROUNDS", if quick { 1 } else { 10 }) as usize;
        let window = env_u64("NVSTORE_READ_SECS", if quick { 1 } else { 2 }) as f64;
        small_reads(&path, size, window, rounds, quick);
        phase_peak("4 KiB reads");
    }
    // Not in the default set: named alone, it compares the reader's poll settings.
    if only.split(',').any(|o| o == "read-knobs") {
        read_knobs(&path, size, quick);
        phase_peak("read-knobs");
    }

    let sizes: Vec<u64> = std::env::var("NVSTORE_BENCH_OBJECTS")
        .unwrap_or_else(|_| {
            if quick {
                "2000,10000".into()
            } else {
                "100000,1000000".into()
            }
        })
        .split(',')
        .map(|s| {
            s.parse()
                .expect("NVSTORE_BENCH_OBJECTS is a list of numbers")
        })
        .collect();
    for n in sizes.into_iter().filter(|_| want("restart")) {
        restart(&path, size, n);
        phase_peak(&format!("restart ({n} objects)"));
    }
    if want("churn") {
        churn(
            &path,
            if quick { 256 << 20 } else { 2 << 30 },
            if quick { 2 } else { 3 },
        );
        phase_peak("churn");
    }
    println!(
        "peak RSS: {} MiB",
        run_peak.max(driver::workload::peak_rss_kib()) >> 10
    );
    let _ = std::fs::remove_file(&path);
}

/// A lone synchronous put vs the device's own write + flush (FUA write) latency.
fn lone_put_latency(path: &Path, size: u64, quick: bool) {
    let n = if quick { 50 } else { 500 };
    let (s, dev) = fresh(path, size, false);
    let data = vec![7u8; 4096];
    let mut ours = hdrhistogram::Histogram::<u64>::new(3).unwrap();
    for i in 0..n {
        let t = Instant::now();
        s.write_full(&key(i % 64), &data).unwrap();
        ours.record(t.elapsed().as_micros() as u64).unwrap();
    }
    drop(s);
    // The device alone: a 4 KiB write then a flush, and a 4 KiB FUA write, into the same file.
    let mut q = dev.open_queue().unwrap();
    let mut raw_flush = hdrhistogram::Histogram::<u64>::new(3).unwrap();
    let mut raw_fua = hdrhistogram::Histogram::<u64>::new(3).unwrap();
    let mut buf = Some(dev.alloc_buf(4096).unwrap());
    for fua in [false, true] {
        for i in 0..n {
            let base = dev.geometry().capacity_blocks - 16 * n - 16;
            let lba = base + i * 8 + if fua { 8 * n } else { 0 };
            let t = Instant::now();
            let req = Request::write(lba, 1, buf.take().unwrap(), 0, fua, 0);
            let c = driver::io::execute(&mut q, req, Duration::from_secs(30));
            c.result.expect("device write");
            buf = c.buf;
            if !fua {
                driver::io::flush(&mut q).unwrap();
            }
            let h = if fua { &mut raw_fua } else { &mut raw_flush };
            h.record(t.elapsed().as_micros() as u64).unwrap();
        }
    }
    println!("\n## lone synchronous 4 KiB put ({n} puts, one thread)");
    println!(
        "  store put         p50 {:>8.0} µs  p99 {:>8.0} µs",
        pct(&ours, 0.5),
        pct(&ours, 0.99)
    );
    println!(
        "  device write+flush p50 {:>7.0} µs  p99 {:>8.0} µs",
        pct(&raw_flush, 0.5),
        pct(&raw_flush, 0.99)
    );
    println!(
        "  device FUA write  p50 {:>8.0} µs  p99 {:>8.0} µs",
        pct(&raw_fua, 0.5),
        pct(&raw_fua, 0.99)
    );
    println!(
        "  store overhead over the device's FUA write: {:+.0} µs at p50 (goal < 1000 µs)",
        pct(&ours, 0.5) - pct(&raw_fua, 0.5)
    );
}

/// One concurrency level of the 4 MiB phase: per-pair figures.
#[derive(Default)]
struct Level {
    ours: Vec<f64>,
    fio: Vec<f64>,
    synced: Vec<f64>,
    ratios: Vec<f64>,
}

/// Whether the write phases run on a file written throughout (the default, as `mkfs
/// --allocate` leaves a device file and as a block device's blocks are): then the bench file
/// is made so now, and both sides write into it in place. With NVSTORE_BENCH_SPARSE set, each
/// side gets a new sparse file instead and every first write allocates.
fn allocated_file(path: &Path, size: u64) -> bool {
    if std::env::var_os("NVSTORE_BENCH_SPARSE").is_some() {
        println!("  on a sparse file, new for each side (NVSTORE_BENCH_SPARSE is set)");
        return false;
    }
    sparse_again(path, size);
    let dev = FileDevice::open(path, FileOptions::default()).expect("bench file");
    let t = Instant::now();
    let n = dev.allocate().expect("allocate the bench file");
    println!(
        "  on an allocated file (FileDevice::allocate wrote {} MiB in {:.1} s), both sides in \
         place; NVSTORE_BENCH_SPARSE=1 for sparse ones",
        n >> 20,
        t.elapsed().as_secs_f64()
    );
    true
}

/// 4 MiB write_full at each concurrency in `levels` (store writers = fio queue depth),
/// alternating store and fio runs `pairs` times. A durable write costs its write, a flush and
/// the writer's copy into DMA memory, while fio's writes only cost the write: with few writers
/// the flush is a visible share of every object's time, so the store is compared both at each
/// depth and at its best against fio's best (the device's sequential write bandwidth).
fn large_writes(path: &Path, size: u64, secs: f64, pairs: usize, levels: &[usize]) {
    println!(
        "\n## 4 MiB write_full (durable) vs fio sequential write bs=4M (O_DIRECT), store \
         writers = fio queue depth in {levels:?}"
    );
    println!(
        "  {pairs} pairs (the store on a fresh store, fio on the same file; store first in \
         odd pairs, fio first in even ones)"
    );
    let allocated = allocated_file(path, size);
    let data = vec![0x5au8; 4 << 20];
    let objects = (size / 2) / (4 << 20);
    let mut all: Vec<Level> = levels.iter().map(|_| Level::default()).collect();
    for p in 0..pairs {
        for (&writers, lv) in levels.iter().zip(all.iter_mut()) {
            let depth = writers as u32;
            let store_side = || {
                let (s, _dev) = if allocated {
                    fresh_in_place(path)
                } else {
                    fresh(path, size, false)
                };
                let disk = DiskPhase::start(path);
                let ops = drive(writers, secs, |t, i| {
                    s.write_full(&key((t as u64 * 1_000_000 + i) % objects), &data)
                        .unwrap();
                });
                let disk_ours = disk.and_then(|d| d.finish());
                let st = s.stats();
                drop(s);
                (ops * 4.0 * 1048576.0 / 1e6, st, disk_ours)
            };
            let fio_side = || {
                if !allocated {
                    sparse_again(path, size);
                }
                let disk = DiskPhase::start(path);
                let f = fio(path, Pattern::SeqWrite, 4 << 20, depth, size / 2, secs, &[]);
                let disk_fio = disk.and_then(|d| d.finish());
                // Context, not the goal's baseline: fio made about as durable as the store, a
                // flush after every two writes. On a virtual disk with a write-back cache the
                // flush is where the host writes the data out.
                if !allocated {
                    sparse_again(path, size);
                }
                let fs = fio(
                    path,
                    Pattern::SeqWrite,
                    4 << 20,
                    depth,
                    size / 2,
                    secs,
                    &["--fdatasync=2"],
                );
                (
                    f.as_ref().map(|r| r.mb_per_s()),
                    fs.as_ref().map(|r| r.mb_per_s()),
                    disk_fio,
                )
            };
            // Store first in even pairs, fio first in odd ones: what one side leaves in the
            // host's write-back cache falls on either side alike.
            let ((ours, st, disk_ours), (theirs, synced, disk_fio)) = if p % 2 == 0 {
                let st = store_side();
                (st, fio_side())
            } else {
                let fi = fio_side();
                (store_side(), fi)
            };
            println!(
                "  pair {} QD{writers:<2}: store {:>8.1} MB/s ({:.1} objects/round)   fio {:>8.1} \
                 MB/s   ratio {}   (fio with fdatasync every 2 writes {:>7.1} MB/s, ratio {})",
                p + 1,
                ours,
                st.txns_per_round(),
                theirs.unwrap_or(0.0),
                ratio(ours, theirs),
                synced.unwrap_or(0.0),
                ratio(ours, synced)
            );
            print_disk(&disk_ours, &disk_fio);
            lv.ours.push(ours);
            if let Some(t) = synced {
                lv.synced.push(t);
            }
            if let Some(t) = theirs {
                lv.fio.push(t);
                lv.ratios.push(ours / t);
            }
        }
    }
    for (&writers, lv) in levels.iter().zip(&all) {
        println!(
            "  median QD{writers:<2}: store {:>8.1} MB/s   fio {:>8.1} MB/s   ratio {}   (fio with \
             fdatasync every 2 writes {:>7.1} MB/s, ratio {})",
            median(&lv.ours),
            median(&lv.fio),
            if lv.ratios.is_empty() {
                "-".to_string()
            } else {
                format!("{:.2}x", median(&lv.ratios))
            },
            median(&lv.synced),
            ratio(
                median(&lv.ours),
                (!lv.synced.is_empty()).then(|| median(&lv.synced))
            )
        );
    }
    // Best against best: the store's highest median over fio's highest median.
    let best = |f: fn(&Level) -> &Vec<f64>| {
        levels
            .iter()
            .zip(&all)
            .map(|(&w, lv)| (w, median(f(lv))))
            .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a })
    };
    let (ow, ob) = best(|l| &l.ours);
    let (fw, fb) = best(|l| &l.fio);
    println!(
        "  best: store {ob:>8.1} MB/s (QD{ow})   fio {fb:>8.1} MB/s (QD{fw})   ratio {} (goal ≥ 0.9x)",
        ratio(ob, (fb > 0.0).then_some(fb))
    );
}

/// The highest peak RSS of the steps of the phase now running (KiB), for the phase's total.
static PHASE_PEAK_KIB: AtomicU64 = AtomicU64::new(0);

/// Peak RSS (KiB) since the last step ended, and a new peak from here; the phase's total
/// keeps it.
fn step_peak_kib() -> u64 {
    let kib = driver::workload::peak_rss_kib();
    PHASE_PEAK_KIB.fetch_max(kib, Ordering::Relaxed);
    driver::workload::reset_peak_rss();
    kib
}

/// The project's median (`driver::workload::median`), 0 for an empty list (fio unavailable).
fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        driver::workload::median(v.to_vec())
    }
}

fn small_puts(path: &Path, size: u64, secs: f64) {
    println!(
        "\n## 4 KiB durable puts, 32 writers vs fio randwrite 4K QD32 with fdatasync every 32"
    );
    let allocated = allocated_file(path, size);
    let (s, _dev) = if allocated {
        fresh_in_place(path)
    } else {
        fresh(path, size, false)
    };
    let data = vec![0x11u8; 4096];
    let ops = drive(32, secs, |t, i| {
        s.write_full(&key(t as u64 * 1_000_000 + i % 20_000), &data)
            .unwrap();
    });
    let st = s.stats();
    drop(s);
    if !allocated {
        sparse_again(path, size);
    }
    let f = fio(
        path,
        Pattern::RandWrite,
        4096,
        32,
        size / 2,
        secs,
        &["--fdatasync=32"],
    );
    println!(
        "  store {:>9.0} puts/s ({:.1} puts per flush, WA {:.2})   fio {:>9.0} IOPS   ratio {} (goal ≥ 1.0x)",
        ops,
        st.txns_per_round(),
        st.write_amplification(),
        f.as_ref().map_or(0.0, |r| r.iops()),
        ratio(ops, f.as_ref().map(|r| r.iops()))
    );
}

/// 4 KiB reads of 4 KiB objects: 32 synchronous reader threads, and one thread keeping 32
/// reads in flight through the async `Reader` (what a node's op worker does), vs fio randread
/// 4K QD32 on the span of the file the store wrote, with the driver's own loop on the same
/// span as a third row. Each row is held against fio running its own shape: the one-thread
/// reader (32 in flight) against fio QD32, the baseline; the 32 threads of one read
/// each against 32 fio jobs of one read each, with the driver alone in that shape beside it
/// (on the 44th stop's host fio's jobs ran 0.90–0.96× and the bare driver's threads
/// 0.87–0.96× of fio QD32: the shape costs the host).
///
/// The host's disk drifts by tens of percent within a minute (44th stop, 10 s phases in
/// three pairs: one store phase at 0.54× between two at 0.80×, and a whole run at 0.78× /
/// 0.72× minutes after one at 0.95× / 1.02×), so every phase runs in each of `rounds` short
/// windows of `secs` — the store first in rounds 1, 3, … (as printed), fio first in rounds
/// 2, 4, … — and the rows are the medians of the per-round ratios: drift slower than a round
/// (~12 s) cancels.
fn small_reads(path: &Path, size: u64, secs: f64, rounds: usize, quick: bool) {
    let (s, _dev) = fresh(path, size, false);
    let n = if quick { 5_000 } else { 200_000 };
    let data = vec![0x22u8; 4096];
    nvstore_store::bench::fill(&s, n, &data, 32);
    // fio reads the part of the file the store wrote. Past it are holes, which the kernel
    // answers with zeros and no device IO: a span of n × 8 KiB ran ~35 % past the data and
    // flattered fio by ~1.6x.
    let ext = driver::workload::data_extents(path).unwrap_or_default();
    let end = ext.iter().map(|(o, l)| o + l).max().unwrap_or(size);
    let span = end / 4096 * 4096;
    let data: u64 = ext
        .iter()
        .map(|(o, l)| (o + l).min(span) - o.min(&span))
        .sum();
    // Each poll of the one-thread reader waits for one completion, as fio does
    // (`iodepth_batch_complete_min=1`): against 4, `read-knobs` (below), 2 s windows
    // alternating with the driver's loop, 4 reaped at most in both: 0.910 vs 0.897 and 0.943
    // vs 0.887 of the driver loop (medians of 10 and 12 rounds), higher in 18 of 22 rounds.
    let batch: usize = std::env::var("NVSTORE_READ_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    // The driver loop opens the file beside the store (idle meanwhile).
    let raw = FileDevice::open(path, beside()).ok();
    println!("\n## 4 KiB reads of {n} objects, 32 readers vs fio randread 4K QD32");
    println!(
        "  fio span: the first {} MiB of the file, where the store's data is ({:.1} % holes); \
         {rounds} rounds of {secs} s per phase, store and fio first in turn",
        span >> 20,
        100.0 * (1.0 - data as f64 / span.max(1) as f64)
    );
    let (mut sync_r, mut one_r, mut raw_r) = (Vec::new(), Vec::new(), Vec::new());
    let (mut jobs_r, mut drv32_r) = (Vec::new(), Vec::new());
    let (mut jobs_f, mut drv32_f) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let store_side = |seed: u64| {
            let disk = DiskPhase::start(path);
            let sync = sync_readers(&s, n, secs, seed);
            let (one, cpu_per_read, busy) = reader_loop(&s, n, secs, seed, batch, 4);
            let cpu_note = format!(
                "{:.1} µs of CPU per read, {:.0} % of a core",
                cpu_per_read * 1e6,
                busy * 100.0
            );
            (sync, one, cpu_note, disk.and_then(|d| d.finish()))
        };
        let fio_side = || {
            let disk = DiskPhase::start(path);
            let f = fio(path, Pattern::RandRead, 4096, 32, span, secs, &[]).map(|r| r.iops());
            let disk = disk.and_then(|d| d.finish());
            // Where the gap lies: what the driver loop (one queue, 32 reads in flight, no
            // store) misses of fio is the device path's; what the store's reader misses of
            // it is the store's.
            let spec = qd32_reads(span, secs, 3 + round as u64);
            let drv = raw
                .as_ref()
                .and_then(|dev| driver::workload::run(dev, &spec).ok());
            // The 32-thread row's device path: the driver alone, 32 threads of one read each.
            let drv32 = raw
                .as_ref()
                .map(|dev| driver_sync_threads(dev, span, secs, 5 + round as u64));
            // What the host gives the 32-thread row's shape: 32 fio jobs, one read each in
            // flight (a reference, not the goal's baseline).
            let jobs = fio(
                path,
                Pattern::RandRead,
                4096,
                1,
                span,
                secs,
                &["--numjobs=32", "--group_reporting"],
            )
            .map(|r| r.iops());
            (f, disk, drv, jobs, drv32)
        };
        let ((sync, one, cpu_note, disk_ours), (f, disk_fio, drv, jobs, drv32)) = if round % 2 == 0
        {
            let st = store_side(round as u64);
            (st, fio_side())
        } else {
            let fi = fio_side();
            (store_side(round as u64), fi)
        };
        println!(
            "  round {:>2}: store 32 threads {sync:>7.0}/s ({})   1 thread {one:>7.0}/s ({}; {cpu_note})   \
             fio {:>7.0} IOPS   driver loop {:>7.0}/s ({}; {:.1} µs of CPU per read)",
            round + 1,
            ratio(sync, f),
            ratio(one, f),
            f.unwrap_or(0.0),
            drv.as_ref().map_or(0.0, |d| d.iops()),
            ratio(drv.as_ref().map_or(0.0, |d| d.iops()), f),
            drv.as_ref().map_or(0.0, |d| d.cpu_us_per_io),
        );
        println!(
            "      fio 32 jobs × QD1 {:>7.0} IOPS ({} of fio QD32); driver 32 threads × 1 {:>7.0}/s \
             ({} of fio QD32); store 32 threads {} of fio's jobs, {} of the driver's threads",
            jobs.unwrap_or(0.0),
            ratio(jobs.unwrap_or(0.0), f),
            drv32.unwrap_or(0.0),
            ratio(drv32.unwrap_or(0.0), f),
            ratio(sync, jobs),
            ratio(sync, drv32)
        );
        print_disk(&disk_ours, &disk_fio);
        if let Some(j) = jobs.filter(|&j| j > 0.0) {
            jobs_r.push(sync / j);
        }
        if let Some(d) = drv32.filter(|&d| d > 0.0) {
            drv32_r.push(sync / d);
        }
        if let Some(f) = f.filter(|&f| f > 0.0) {
            jobs_f.extend(jobs.map(|j| j / f));
            drv32_f.extend(drv32.map(|d| d / f));
            sync_r.push(sync / f);
            one_r.push(one / f);
            if let Some(d) = &drv {
                raw_r.push(d.iops() / f);
            }
        }
    }
    // Medians of the ratios ("-" when fio gave no figure).
    let med = |v: &[f64]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            format!("{:.2}x", median(v))
        }
    };
    println!(
        "  median store, 32 threads × 1          ratio {} (another shape than fio QD32's: see fio's own 32 jobs below)",
        med(&sync_r)
    );
    println!(
        "  median store, 1 thread, 32 in flight  ratio {} (goal ≥ 0.9x: fio QD32's shape)",
        med(&one_r)
    );
    println!(
        "  median driver loop, no store          ratio {}",
        med(&raw_r)
    );
    println!(
        "  median fio 32 jobs × QD1, vs fio QD32                ratio {}",
        med(&jobs_f)
    );
    println!(
        "  median driver 32 threads × 1, vs fio QD32            ratio {}",
        med(&drv32_f)
    );
    println!(
        "  median store, 32 threads × 1 vs fio 32 jobs × QD1  ratio {} (the same shape)",
        med(&jobs_r)
    );
    println!(
        "  median store, 32 threads × 1 vs the driver's 32 threads × 1  ratio {}",
        med(&drv32_r)
    );
}

/// Reads/s of 32 threads each keeping one random 4 KiB read of the first `span` bytes in
/// flight on its own queue of `dev` for `secs`: the driver alone, no store — the 32-thread
/// row's device path.
fn driver_sync_threads(dev: &FileDevice, span: u64, secs: f64, seed: u64) -> f64 {
    type Queue = <FileDevice as BlockDevice>::Queue;
    thread_local! {
        /// Each bench thread's queue and completion slot (the threads are fresh per call).
        static Q: RefCell<Option<(Queue, Vec<Completion>)>> = const { RefCell::new(None) };
    }
    let bs = dev.geometry().block_size as u64;
    let pages = (span / 4096).max(1);
    drive(32, secs, |t, i| {
        Q.with_borrow_mut(|q| {
            let (q, comps) = q.get_or_insert_with(|| {
                let mut comps = Vec::new();
                comps.resize_with(1, Completion::default);
                (dev.open_queue().expect("a queue per thread"), comps)
            });
            let page = (i.wrapping_mul(2_654_435_761) ^ (t as u64 * 97 + seed)) % pages;
            let buf = dev.alloc_read_buf(4096).expect("read buffer");
            q.submit(Request::read(
                page * 4096 / bs,
                (4096 / bs) as u32,
                buf,
                0,
                0,
            ))
            .map_err(|e| e.kind)
            .expect("submit a read");
            q.wait(comps, 1, Duration::from_secs(30))
                .expect("a read completes");
            std::mem::take(&mut comps[0]).result.expect("read");
        })
    })
}

/// The driver loop's workload beside the 4 KiB read phases: random 4 KiB reads at QD32 over
/// the first `span` bytes.
fn qd32_reads(span: u64, secs: f64, seed: u64) -> Spec {
    Spec {
        pattern: Pattern::RandRead,
        io_bytes: 4096,
        depth: 32,
        span_bytes: span,
        duration: Duration::from_secs_f64(secs),
        seed,
    }
}

/// Reads/s of 32 threads each reading one random 4 KiB object of `0..n` at a time
/// (`Store::read`) for `secs`.
fn sync_readers(s: &Store<FileDevice>, n: u64, secs: f64, seed: u64) -> f64 {
    drive(32, secs, |t, i| {
        let k = key((i.wrapping_mul(2_654_435_761) ^ (t as u64 * 97 + seed)) % n);
        assert_eq!(s.read(&k, 0, 4096).unwrap().len(), 4096);
    })
}

/// One thread keeping 32 random 4 KiB reads of `0..n` on the device through the async
/// `Reader` for `secs`, each poll waiting for `batch` completions and taking at most `reap`:
/// (reads/s, CPU seconds per read, share of a core busy).
fn reader_loop(
    s: &Store<FileDevice>,
    n: u64,
    secs: f64,
    seed: u64,
    batch: usize,
    reap: usize,
) -> (f64, f64, f64) {
    let mut r = s.reader().unwrap();
    r.set_reap_max(reap);
    let mut out = Vec::new();
    let (mut i, mut done) = (seed * 7_777_777, 0u64);
    let t0 = Instant::now();
    let cpu0 = driver::workload::thread_cpu_time();
    while t0.elapsed().as_secs_f64() < secs {
        while r.on_device() < 32 {
            r.submit(&key(i.wrapping_mul(2_654_435_761) % n), 0, 4096, i)
                .unwrap();
            i += 1;
        }
        r.poll_min(&mut out, batch).unwrap();
        for (_, res) in out.drain(..) {
            assert_eq!(res.unwrap().len(), 4096);
            done += 1;
        }
    }
    let cpu = (driver::workload::thread_cpu_time() - cpu0).as_secs_f64();
    let wall = t0.elapsed().as_secs_f64();
    (done as f64 / wall, cpu / done.max(1) as f64, cpu / wall)
}

/// `NVSTORE_BENCH_ONLY=read-knobs`: the async reader's poll settings compared in one process
/// (see the module docs).
fn read_knobs(path: &Path, size: u64, quick: bool) {
    let (s, _dev) = fresh(path, size, false);
    let n = if quick { 5_000 } else { 200_000 };
    nvstore_store::bench::fill(&s, n, &[0x22u8; 4096], 32);
    let ext = driver::workload::data_extents(path).unwrap_or_default();
    let span = ext.iter().map(|(o, l)| o + l).max().unwrap_or(size) / 4096 * 4096;
    let raw = FileDevice::open(path, beside()).expect("bench file");
    let knobs: Vec<(usize, usize)> = std::env::var("NVSTORE_READ_KNOBS")
        .unwrap_or_else(|_| "4:4,1:4".into())
        .split(',')
        .map(|k| {
            k.split_once(':')
                .and_then(|(b, r)| Some((b.parse().ok()?, r.parse().ok()?)))
                .expect("NVSTORE_READ_KNOBS is a list of batch:reap pairs, such as 4:4,1:4")
        })
        .collect();
    let rounds = env_u64("NVSTORE_BENCH_ROUNDS", if quick { 1 } else { 10 });
    let secs = if quick { 0.5 } else { 2.0 };
    println!(
        "\n## async reader poll settings (batch:reap) vs the driver's loop, {rounds} rounds of \
         {secs} s windows, 32 reads in flight"
    );
    // Ratios to each round's driver loop: one column per setting, then 32 synchronous readers.
    let mut cols: Vec<Vec<f64>> = vec![Vec::new(); knobs.len() + 1];
    for round in 0..rounds {
        let base = driver::workload::run(&raw, &qd32_reads(span, secs, 3 + round))
            .expect("driver loop")
            .iops();
        let mut line = format!("  round {round:>2}: driver {base:>7.0}/s");
        let mut order: Vec<usize> = (0..knobs.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for k in order {
            let (batch, reap) = knobs[k];
            let ratio = reader_loop(&s, n, secs, round, batch, reap).0 / base;
            cols[k].push(ratio);
            line += &format!("   {batch}:{reap} {ratio:.3}");
        }
        let sync = sync_readers(&s, n, secs, round) / base;
        cols[knobs.len()].push(sync);
        println!("{line}   32 threads {sync:.3}");
    }
    let mut line = String::from("  median of the ratios:");
    for (k, (batch, reap)) in knobs.iter().enumerate() {
        line += &format!("   {batch}:{reap} {:.3}", median(&cols[k]));
    }
    println!("{line}   32 threads {:.3}", median(&cols[knobs.len()]));
}

/// The disk's own view of a store phase and the fio phase it is compared with (request size,
/// requests in flight, latency per request: `/proc/diskstats`), under each 4 MiB pair and
/// the 4 KiB reads (the first 32-thread run); nothing when the file is not on a block device.
fn print_disk(ours: &Option<DiskDelta>, fio: &Option<DiskDelta>) {
    if let (Some(o), Some(f)) = (ours, fio) {
        println!("      disk: store {o}   fio {f}");
    }
}

fn restart(path: &Path, size: u64, n: u64) {
    let data = vec![0x33u8; 1024];
    let mut rows = Vec::new();
    for no_ckpt in [false, true] {
        step_peak_kib();
        let (s, _dev) = fresh(path, size, no_ckpt);
        nvstore_store::bench::fill(&s, n, &data, 32);
        let idx = s.index_bytes_per_object();
        let fill_peak = step_peak_kib();
        drop(s);
        // What the store freed, back to the kernel: what stays resident is what it leaked.
        driver::workload::trim_heap();
        let closed = driver::workload::rss_kib();
        step_peak_kib();
        let t = Instant::now();
        let (s, r) = Store::open(
            FileDevice::open(path, beside()).unwrap(),
            None,
            StoreConfig::default(),
        )
        .unwrap();
        let open = t.elapsed();
        let open_peak = step_peak_kib();
        let opened = driver::workload::rss_kib();
        assert_eq!(r.objects, n);
        // Closing frees the index (an allocation or two per object).
        let t = Instant::now();
        drop(s);
        let close = t.elapsed();
        let rss = [fill_peak, closed, open_peak, opened].map(|k| k >> 10);
        rows.push((no_ckpt, open, r, idx, close, rss));
    }
    println!("\n## restart with {n} objects (1 KiB each)");
    for (no_ckpt, open, r, idx, close, rss) in &rows {
        println!(
            "  {:<22} open {:>7.3} s: {} from checkpoint ({:.1} MiB), replayed {:.1} MiB of log; index {idx:.0} B/object; close {:.3} s",
            if *no_ckpt { "checkpoints off" } else { "with checkpoints" },
            open.as_secs_f64(),
            r.checkpoint_objects,
            r.checkpoint_bytes as f64 / 1048576.0,
            r.replayed_bytes as f64 / 1048576.0,
            close.as_secs_f64()
        );
        println!(
            "  {:<22} RSS (MiB): fill's peak {}, resident once closed {}, open's peak {}, \
             resident once open {}",
            "", rss[0], rss[1], rss[2], rss[3]
        );
    }
    println!(
        "  speed-up from checkpoints: {:.1}x (goal: ≤ 1 s at 1 M objects)",
        rows[1].1.as_secs_f64() / rows[0].1.as_secs_f64()
    );
}

fn churn(path: &Path, size: u64, times: u64) {
    let (s, _dev) = fresh(path, size, false);
    let obj = 64usize << 10;
    let count = s.space().usable_bytes() * 7 / 10 / obj as u64;
    let data = vec![0x44u8; obj];
    nvstore_store::bench::fill(&s, count, &data, 32);
    let before = s.stats();
    let t = Instant::now();
    let target = times * size / obj as u64;
    let next = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for th in 0..8u64 {
            let (s, next, data) = (&s, &next, &data);
            sc.spawn(move || {
                let mut x = th.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                while next.fetch_add(1, Ordering::Relaxed) < target {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    s.write_full(&key(x % count), data).unwrap();
                }
            });
        }
    });
    let st = s.stats();
    let user = st.user_bytes - before.user_bytes;
    let dev = st.device_bytes_written - before.device_bytes_written;
    println!("\n## churn: {count} objects of 64 KiB (70 % full), {target} random overwrites ({times}x the device), 8 writers");
    println!(
        "  write amplification {:.2} (device bytes / user bytes), {:.0} MB/s user, relocated {} MiB, {} segments cleaned, {} checkpoints",
        dev as f64 / user as f64,
        user as f64 / t.elapsed().as_secs_f64() / 1e6,
        (st.relocated_bytes - before.relocated_bytes) >> 20,
        st.cleaned_segments,
        st.checkpoints
    );
}
