//! `nvstore bench recovery`: how fast a local cluster rebuilds a lost node, against the raw
//! bottleneck of the same machine measured in the same run, and what it costs clients.
//!
//! Steps: start a local cluster (`LocalCluster`, in `--dir`), create an EC pool, fill it with
//! `--size` bytes of `--object-size` objects; then
//! 1. **idle recovery**: kill the last node, wait until it is marked down, mark it out, and
//!    time the rebuild (shard bytes written by recovery, summed from the nodes' reports) until
//!    every node reports nothing left;
//! 2. **client baseline**: `--load-seconds` of 4 KiB random reads, `--load-depth` in flight,
//!    with nothing recovering;
//! 3. **recovery under load**: the same load while the next node is killed and marked out;
//!    client latencies from the moment it is marked out until recovery is done, and the
//!    rebuild rate;
//! 4. **raw bottleneck**: the same volume as step 1 through the simplest loop that does what
//!    a rebuild does: read k equal 1 MiB chunks from k surviving nodes' device files
//!    (O_DIRECT, like the nodes), `Codec::reconstruct` one missing shard, write it to a new
//!    file (O_DIRECT, fdatasync at the end), 8 threads; plus each resource alone (read,
//!    reconstruct, write) to name the bottleneck;
//! 5. **raw loop with the network moves**: the same loop with the bytes a rebuild moves
//!    between nodes sent over loopback TCP, as the cluster must: per pipeline a *source*
//!    thread reads k - 1 chunks (the remote survivors') and sends them over one connection,
//!    a *rebuilder* reads its own chunk, receives the k - 1, reconstructs and sends the result
//!    over a second connection, and a *sink* receives it and writes it (O_DIRECT); plus the
//!    network moves alone. No checksums, framing or placement: the floor under what the
//!    cluster does, on a machine where "the network" is the same two cores.
//!
//! All processes share the machine: the figures are medians/ratios of one run, not a spec.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ec::{Codec, Profile, Shard};
use hdrhistogram::Histogram;
use rand::{Rng, RngCore, SeedableRng};
use serde::Serialize;

use crate::cluster_cmd::{DownOnUnwind, LocalCluster, LocalOptions};
use crate::monitor::raft::MonCommand;
use crate::node::recovery::RecoveryStats;
use crate::Client;

/// How long one recovery may take before the benchmark gives up.
const RECOVERY_WAIT_MAX: Duration = Duration::from_secs(3600);
/// Status poll period while recovery runs.
const POLL: Duration = Duration::from_millis(250);
/// Chunk per shard in the raw loop.
const RAW_CHUNK_BYTES: usize = 1 << 20;
/// Threads of the raw loop (each one chunk at a time: `RAW_THREADS` chunks in flight).
const RAW_THREADS: usize = 8;
/// O_DIRECT buffer alignment.
const RAW_ALIGN_BYTES: usize = 4096;
/// Client errors printed per phase (all are counted).
const ERRORS_SHOWN_MAX: u64 = 5;
/// Object puts in flight while filling.
const FILL_THREADS: usize = 8;

#[derive(Debug, clap::Args)]
pub struct RecoveryBenchArgs {
    /// Bytes of objects to fill the cluster with (4G, 512M, ...)
    #[arg(long, default_value = "4G", value_parser = crate::storecli::parse_size)]
    pub size: u64,
    #[arg(long, default_value = "4M", value_parser = crate::storecli::parse_size)]
    pub object_size: u64,
    #[arg(long, default_value_t = 8)]
    pub nodes: u32,
    /// EC data shards (k + m must stay below the node count: a node goes out twice)
    #[arg(long, default_value_t = 4)]
    pub k: u32,
    #[arg(long, default_value_t = 2)]
    pub m: u32,
    /// Seconds of client load for the baseline
    #[arg(long, default_value_t = 10)]
    pub load_seconds: u64,
    /// Client reads in flight
    #[arg(long, default_value_t = 16)]
    pub load_depth: usize,
    /// Directory for the cluster (default: a new one under the temp dir, removed after)
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print the result as JSON on stdout
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Latency {
    pub ops: u64,
    pub errors: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct RawRates {
    /// Output (rebuilt shard) MB/s of the read + reconstruct + write loop.
    pub rebuild_mb_s: f64,
    /// Each resource alone, in output MB/s: reading k chunks per output chunk, reconstructing,
    /// writing.
    pub read_mb_s: f64,
    pub reconstruct_mb_s: f64,
    pub write_mb_s: f64,
    pub bottleneck: String,
    /// Output MB/s of the loop with the network moves (step 5).
    pub net_rebuild_mb_s: f64,
    /// The network moves alone: k chunks over loopback TCP per output chunk, in output MB/s.
    pub net_mb_s: f64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct RecoveryBenchResult {
    pub nodes: u32,
    pub k: u32,
    pub m: u32,
    pub fill_bytes: u64,
    pub object_bytes: u64,
    pub fill_mb_s: f64,
    /// Step 1: rebuild with no client load.
    pub idle_rebuilt_bytes: u64,
    pub idle_seconds: f64,
    pub idle_rebuild_mb_s: f64,
    pub raw: RawRates,
    /// idle_rebuild_mb_s / raw.rebuild_mb_s
    pub idle_vs_raw: f64,
    /// idle_rebuild_mb_s / raw.net_rebuild_mb_s
    pub idle_vs_raw_net: f64,
    /// Steps 2 and 3.
    pub client_baseline: Latency,
    pub client_during_recovery: Latency,
    /// client_during_recovery.p99 / client_baseline.p99
    pub p99_ratio: f64,
    pub loaded_rebuilt_bytes: u64,
    pub loaded_seconds: f64,
    pub loaded_rebuild_mb_s: f64,
    pub recovery_stats: RecoveryStats,
    pub memory: crate::bench_cluster::Memory,
}

fn mb(b: f64) -> f64 {
    b / 1e6
}

pub fn run(a: RecoveryBenchArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if a.k + a.m >= a.nodes {
        return Err(format!(
            "EC {}+{} needs more than {} nodes: two nodes go out and every PG must keep k + m \
             members",
            a.k, a.m, a.nodes
        )
        .into());
    }
    let tmp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new()
                .prefix("nvstore-bench-recovery-")
                .tempdir()?;
            tmp.path().to_owned()
        }
    };
    let lc = LocalCluster::new(&dir, &std::env::current_exe()?);
    let _down = DownOnUnwind(&lc);
    let per_node = a.size * (a.k + a.m) as u64 / a.k as u64 / (a.nodes - 2) as u64;
    lc.create(&LocalOptions {
        nodes: a.nodes,
        device_bytes: (per_node * 2).max(2 << 30),
        down_grace_ms: 1500,
        heartbeat_ms: 250,
        ..LocalOptions::default()
    })?;
    let r = (|| -> Result<RecoveryBenchResult, Box<dyn std::error::Error>> {
        let client = lc.up()?;
        bench(&a, &lc, &client)
    })();
    let _ = lc.down();
    let r = r?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_table(&r);
    }
    Ok(ExitCode::SUCCESS)
}

fn say(a: &RecoveryBenchArgs, m: impl AsRef<str>) {
    if !a.json {
        eprintln!("{}", m.as_ref());
    } else {
        eprintln!("# {}", m.as_ref());
    }
}

fn bench(
    a: &RecoveryBenchArgs,
    lc: &LocalCluster,
    c: &Client,
) -> Result<RecoveryBenchResult, Box<dyn std::error::Error>> {
    let pool = c.create_pool("recovery-bench", a.k, a.m, 64 << 10, 64, None)?;
    let objects = a.size.div_ceil(a.object_size).max(1);
    say(
        a,
        format!("filling {objects} objects of {} bytes…", a.object_size),
    );
    let t = Instant::now();
    fill(c, pool, objects, a.object_size)?;
    let fill_s = t.elapsed().as_secs_f64();
    wait_idle(c, |_| true)?;
    let mut out = RecoveryBenchResult {
        nodes: a.nodes,
        k: a.k,
        m: a.m,
        fill_bytes: objects * a.object_size,
        object_bytes: a.object_size,
        fill_mb_s: mb((objects * a.object_size) as f64) / fill_s,
        ..Default::default()
    };

    // 1. Idle recovery.
    let victim = a.nodes;
    say(a, format!("killing node {victim}, marking it out…"));
    let (bytes, secs, _) = lose_node(lc, c, victim)?;
    out.idle_rebuilt_bytes = bytes;
    out.idle_seconds = secs;
    out.idle_rebuild_mb_s = mb(bytes as f64) / secs;
    say(
        a,
        format!(
            "rebuilt {:.0} MB in {secs:.1} s: {:.1} MB/s",
            mb(bytes as f64),
            out.idle_rebuild_mb_s
        ),
    );

    // 4. Raw bottleneck (before the load phases, while the victim's volume is known).
    say(a, "raw loop: read k chunks + reconstruct + write…");
    let survivors: Vec<PathBuf> = (1..=a.k)
        .map(|i| lc.dir.join(format!("node.{i}")).join("dev0.img"))
        .collect();
    out.raw = raw_rates(
        &survivors,
        &lc.dir,
        a.k as usize,
        a.m as usize,
        bytes.max(64 << 20),
    )?;
    out.idle_vs_raw = out.idle_rebuild_mb_s / out.raw.rebuild_mb_s;
    out.idle_vs_raw_net = out.idle_rebuild_mb_s / out.raw.net_rebuild_mb_s;

    // 2. Client baseline.
    say(
        a,
        format!("client baseline: {} s of 4 KiB reads…", a.load_seconds),
    );
    let stop = AtomicBool::new(false);
    let recording = AtomicBool::new(true);
    // (completion time, µs) of each client read while recording.
    let hist: Mutex<Vec<(Instant, u64)>> = Mutex::new(Vec::new());
    let errors = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..a.load_depth {
            let (stop, recording, hist, errors) = (&stop, &recording, &hist, &errors);
            s.spawn(move || {
                load(
                    c,
                    pool,
                    objects,
                    a.object_size,
                    t as u64,
                    stop,
                    recording,
                    hist,
                    errors,
                )
            });
        }
        std::thread::sleep(Duration::from_secs(a.load_seconds));
        recording.store(false, Relaxed);
        out.client_baseline = take(&hist, &errors, None);

        // 3. Recovery under load: latencies from mark-out to done.
        let victim = a.nodes - 1;
        say(
            a,
            format!("killing node {victim} under load, marking it out…"),
        );
        let mut end = None;
        match lose_node_recording(lc, c, victim, &recording) {
            Ok((bytes, secs, t)) => {
                out.loaded_rebuilt_bytes = bytes;
                out.loaded_seconds = secs;
                out.loaded_rebuild_mb_s = mb(bytes as f64) / secs;
                end = Some(t + Duration::from_secs_f64(secs));
            }
            Err(e) => say(a, format!("recovery under load failed: {e}")),
        }
        recording.store(false, Relaxed);
        // Only reads that finished while the rebuild ran (not during the status poll's lag).
        out.client_during_recovery = take(&hist, &errors, end);
        stop.store(true, Relaxed);
    });
    out.p99_ratio = out.client_during_recovery.p99_ms / out.client_baseline.p99_ms;
    out.recovery_stats = c.status()?.recovery;
    out.memory = crate::bench_cluster::memory(c);
    Ok(out)
}

fn fill(c: &Client, pool: u64, objects: u64, size: u64) -> Result<(), Box<dyn std::error::Error>> {
    let next = std::sync::atomic::AtomicU64::new(0);
    let failed = Mutex::new(None);
    std::thread::scope(|s| {
        for t in 0..FILL_THREADS {
            let (next, failed) = (&next, &failed);
            s.spawn(move || {
                let mut data = vec![0u8; size as usize];
                let mut rng = rand::rngs::SmallRng::seed_from_u64(t as u64);
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    if i >= objects || failed.lock().unwrap().is_some() {
                        return;
                    }
                    rng.fill_bytes(&mut data[..64.min(size as usize)]);
                    if let Err(e) = c.put(pool, format!("obj-{i}").as_bytes(), &data) {
                        *failed.lock().unwrap() = Some(e.to_string());
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap() {
        Some(e) => Err(format!("fill: {e}").into()),
        None => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
fn load(
    c: &Client,
    pool: u64,
    objects: u64,
    size: u64,
    seed: u64,
    stop: &AtomicBool,
    recording: &AtomicBool,
    hist: &Mutex<Vec<(Instant, u64)>>,
    errors: &std::sync::atomic::AtomicU64,
) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0xbe7c);
    while !stop.load(Relaxed) {
        let i = rng.gen_range(0..objects);
        let off = rng.gen_range(0..size.saturating_sub(4096).max(1)) & !4095;
        let t = Instant::now();
        let r = c.get_range(pool, format!("obj-{i}").as_bytes(), off, 4096);
        let us = t.elapsed().as_micros() as u64;
        if recording.load(Relaxed) {
            match r {
                Ok(_) => {
                    hist.lock().unwrap().push((Instant::now(), us.max(1)));
                }
                Err(e) => {
                    if errors.fetch_add(1, Relaxed) < ERRORS_SHOWN_MAX {
                        eprintln!("client read error: obj-{i} at {off}: {e}");
                    }
                }
            }
        }
    }
}

/// The latencies recorded (those that completed by `until`, when given), then clear them.
fn take(
    samples: &Mutex<Vec<(Instant, u64)>>,
    errors: &std::sync::atomic::AtomicU64,
    until: Option<Instant>,
) -> Latency {
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds");
    for (at, us) in std::mem::take(&mut *samples.lock().unwrap()) {
        if until.is_none_or(|u| at <= u) {
            let _ = h.record(us);
        }
    }
    let l = Latency {
        ops: h.len(),
        errors: errors.swap(0, Relaxed),
        p50_ms: h.value_at_quantile(0.5) as f64 / 1000.0,
        p99_ms: h.value_at_quantile(0.99) as f64 / 1000.0,
        max_ms: h.max() as f64 / 1000.0,
    };
    h.reset();
    l
}

/// Recovery summed over the up nodes, once every up node has reported nothing left for a few
/// polls and `done` holds; and when the first of those polls was made.
fn wait_idle(
    c: &Client,
    done: impl Fn(&RecoveryStats) -> bool,
) -> Result<(RecoveryStats, Instant), Box<dyn std::error::Error>> {
    let t = Instant::now();
    let mut quiet = 0;
    let mut first_quiet = t;
    loop {
        let asked = Instant::now();
        let s = c.status()?.recovery;
        if !s.active() && done(&s) {
            if quiet == 0 {
                first_quiet = asked;
            }
            quiet += 1;
            if quiet >= 3 {
                return Ok((s, first_quiet));
            }
        } else {
            quiet = 0;
        }
        if t.elapsed() > RECOVERY_WAIT_MAX {
            return Err(format!("recovery not done after {RECOVERY_WAIT_MAX:?}: {s:?}").into());
        }
        std::thread::sleep(POLL);
    }
}

fn kill_and_mark_out(
    lc: &LocalCluster,
    c: &Client,
    victim: u32,
) -> Result<(RecoveryStats, Instant), Box<dyn std::error::Error>> {
    lc.stop_member(&format!("node.{victim}"), true)?;
    let t = Instant::now();
    while c.map().nodes.get(&victim).is_some_and(|n| n.up) {
        if t.elapsed() > Duration::from_secs(60) {
            return Err(format!("node {victim} never marked down").into());
        }
        let _ = c.refresh_map();
        std::thread::sleep(Duration::from_millis(100));
    }
    // The victim's counters leave the sums once it is down: take the base after that.
    std::thread::sleep(Duration::from_millis(600));
    let before = c.status()?.recovery;
    let r = c.command(&MonCommand::MarkOut(vec![victim]))?;
    if !r.ok {
        return Err(format!("mark out: {}", r.message).into());
    }
    Ok((before, Instant::now()))
}

/// Seconds from `t` (the mark-out) to the last object rebuild the nodes report; the status
/// poll's own time when they report none after `t`.
fn rebuild_secs(t: Instant, after: &RecoveryStats, polled: Instant) -> f64 {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let t_ms = now_ms.saturating_sub(t.elapsed().as_millis() as u64);
    let secs = if after.last_done_unix_ms > t_ms {
        (after.last_done_unix_ms - t_ms) as f64 / 1e3
    } else {
        polled.duration_since(t).as_secs_f64()
    };
    secs.max(1e-3)
}

/// Kill a node, mark it out, wait for the rebuild: (shard bytes rebuilt, seconds, stats).
fn lose_node(
    lc: &LocalCluster,
    c: &Client,
    victim: u32,
) -> Result<(u64, f64, RecoveryStats), Box<dyn std::error::Error>> {
    let (before, t) = kill_and_mark_out(lc, c, victim)?;
    let (after, end) = wait_idle(c, |s| s.backfill_bytes > before.backfill_bytes)?;
    let secs = rebuild_secs(t, &after, end);
    Ok((after.backfill_bytes - before.backfill_bytes, secs, after))
}

fn lose_node_recording(
    lc: &LocalCluster,
    c: &Client,
    victim: u32,
    recording: &AtomicBool,
) -> Result<(u64, f64, Instant), Box<dyn std::error::Error>> {
    let (before, t) = kill_and_mark_out(lc, c, victim)?;
    recording.store(true, Relaxed);
    let after = wait_idle(c, |s| s.backfill_bytes > before.backfill_bytes);
    recording.store(false, Relaxed);
    let (after, end) = after?;
    let secs = rebuild_secs(t, &after, end);
    Ok((after.backfill_bytes - before.backfill_bytes, secs, t))
}

/// A 4 KiB-aligned buffer for O_DIRECT IO.
struct Aligned {
    v: Vec<u8>,
    at: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let v = vec![0u8; len + RAW_ALIGN_BYTES];
        let at = v.as_ptr().align_offset(RAW_ALIGN_BYTES);
        Aligned { v, at }
    }
    fn get(&self) -> &[u8] {
        &self.v[self.at..self.at + RAW_CHUNK_BYTES]
    }
    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.at..self.at + RAW_CHUNK_BYTES]
    }
}

fn open_direct(path: &Path, write: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(!write)
        .write(write)
        .create(write)
        .truncate(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// What one raw pass does per chunk.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RawStep {
    All,
    Read,
    Reconstruct,
    Write,
    /// Step 5: `All` through source → rebuilder → sink pipelines over loopback TCP.
    NetAll,
    /// Step 5's TCP moves alone.
    Net,
}

impl RawStep {
    fn reads(self) -> bool {
        matches!(self, RawStep::All | RawStep::Read | RawStep::NetAll)
    }
    fn reconstructs(self) -> bool {
        matches!(self, RawStep::All | RawStep::Reconstruct | RawStep::NetAll)
    }
    fn writes(self) -> bool {
        matches!(self, RawStep::All | RawStep::Write | RawStep::NetAll)
    }
}

/// Rebuild one missing data shard from k - 1 data shards and one parity shard.
fn raw_reconstruct(codec: &Codec, k: usize, m: usize, ins: &[Aligned], out: &mut Aligned) {
    let mut slots: Vec<Shard> = Vec::with_capacity(k + m);
    slots.push(Shard::Wanted(out.get_mut()));
    for v in ins.iter().take(k - 1) {
        slots.push(Shard::Present(v.get()));
    }
    slots.push(Shard::Present(ins[k - 1].get()));
    for _ in 1..m {
        slots.push(Shard::Missing);
    }
    codec
        .reconstruct(&mut slots)
        .expect("k shards of equal length");
}

/// One raw pass over `chunks` chunks, `RAW_THREADS` chunks in flight; seconds taken.
fn raw_pass(
    step: RawStep,
    ins: &[File],
    out: &File,
    codec: &Codec,
    (k, m): (usize, usize),
    chunks: u64,
) -> std::io::Result<f64> {
    let t = Instant::now();
    std::thread::scope(|s| -> std::io::Result<()> {
        let mut hs = Vec::new();
        for t in 0..RAW_THREADS as u64 {
            let mine = move || (t..chunks).step_by(RAW_THREADS);
            if matches!(step, RawStep::NetAll | RawStep::Net) {
                let (to_rebuilder, from_source) = tcp_pair()?;
                let (to_sink, from_rebuilder) = tcp_pair()?;
                let (ins, out) = (&ins[..k], out);
                hs.push(s.spawn(move || raw_source(step, &ins[..k - 1], to_rebuilder, mine)));
                hs.push(s.spawn(move || {
                    raw_rebuilder(step, codec, (k, m), &ins[k - 1], from_source, to_sink, mine)
                }));
                hs.push(s.spawn(move || raw_sink(step, out, from_rebuilder, mine)));
                continue;
            }
            hs.push(s.spawn(move || -> std::io::Result<()> {
                let mut bufs: Vec<Aligned> =
                    (0..k).map(|_| Aligned::new(RAW_CHUNK_BYTES)).collect();
                let mut rebuilt = Aligned::new(RAW_CHUNK_BYTES);
                for i in mine() {
                    let at = i * RAW_CHUNK_BYTES as u64;
                    if step.reads() {
                        for (f, b) in ins.iter().zip(bufs.iter_mut()) {
                            f.read_exact_at(b.get_mut(), at)?;
                        }
                    }
                    if step.reconstructs() {
                        raw_reconstruct(codec, k, m, &bufs, &mut rebuilt);
                    }
                    if step.writes() {
                        out.write_all_at(rebuilt.get(), at)?;
                    }
                }
                Ok(())
            }));
        }
        for h in hs {
            h.join().expect("raw thread")?;
        }
        Ok(())
    })?;
    if step.writes() {
        out.sync_data()?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// A connected pair of loopback TCP streams (sender, receiver).
fn tcp_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
    let tx = TcpStream::connect(l.local_addr()?)?;
    let (rx, _) = l.accept()?;
    Ok((tx, rx))
}

/// Step 5's source: the remote survivors' chunks, read and sent to the rebuilder.
fn raw_source<I: Iterator<Item = u64>>(
    step: RawStep,
    remote: &[File],
    mut to_rebuilder: TcpStream,
    mine: impl Fn() -> I,
) -> std::io::Result<()> {
    let mut buf = Aligned::new(RAW_CHUNK_BYTES);
    for i in mine() {
        for f in remote {
            if step.reads() {
                f.read_exact_at(buf.get_mut(), i * RAW_CHUNK_BYTES as u64)?;
            }
            to_rebuilder.write_all(buf.get())?;
        }
    }
    Ok(())
}

/// Step 5's rebuilder: its own chunk from the device, the others from the network; the
/// rebuilt chunk goes to the sink.
fn raw_rebuilder<I: Iterator<Item = u64>>(
    step: RawStep,
    codec: &Codec,
    (k, m): (usize, usize),
    own: &File,
    mut from_source: TcpStream,
    mut to_sink: TcpStream,
    mine: impl Fn() -> I,
) -> std::io::Result<()> {
    let mut bufs: Vec<Aligned> = (0..k).map(|_| Aligned::new(RAW_CHUNK_BYTES)).collect();
    let mut rebuilt = Aligned::new(RAW_CHUNK_BYTES);
    for i in mine() {
        for b in &mut bufs[..k - 1] {
            from_source.read_exact(b.get_mut())?;
        }
        if step.reads() {
            own.read_exact_at(bufs[k - 1].get_mut(), i * RAW_CHUNK_BYTES as u64)?;
        }
        if step.reconstructs() {
            raw_reconstruct(codec, k, m, &bufs, &mut rebuilt);
        }
        to_sink.write_all(rebuilt.get())?;
    }
    Ok(())
}

/// Step 5's sink: the new member writes what it receives.
fn raw_sink<I: Iterator<Item = u64>>(
    step: RawStep,
    out: &File,
    mut from_rebuilder: TcpStream,
    mine: impl Fn() -> I,
) -> std::io::Result<()> {
    let mut buf = Aligned::new(RAW_CHUNK_BYTES);
    for i in mine() {
        from_rebuilder.read_exact(buf.get_mut())?;
        if step.writes() {
            out.write_all_at(buf.get(), i * RAW_CHUNK_BYTES as u64)?;
        }
    }
    Ok(())
}

/// The raw rates for `out_bytes` of rebuilt shard data (see the module doc): O_DIRECT reads
/// of 1 MiB chunks at the front of the surviving nodes' device files (where their stores
/// wrote), `RAW_THREADS` threads, into one new file written O_DIRECT.
fn raw_rates(
    survivors: &[PathBuf],
    dir: &Path,
    k: usize,
    m: usize,
    out_bytes: u64,
) -> Result<RawRates, Box<dyn std::error::Error>> {
    let ins: Vec<File> = survivors
        .iter()
        .map(|p| open_direct(p, false))
        .collect::<Result<_, _>>()?;
    let span = ins
        .iter()
        .map(|f| f.metadata().map(|m| m.len()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .min()
        .unwrap_or(0);
    let chunks = out_bytes
        .div_ceil(RAW_CHUNK_BYTES as u64)
        .min(span / RAW_CHUNK_BYTES as u64);
    if chunks == 0 {
        return Err("device files are too small for the raw loop".into());
    }
    let codec = Codec::new(Profile::new(k, m, RAW_CHUNK_BYTES)?);
    let out_path = dir.join("raw-rebuild.out");
    let out = open_direct(&out_path, true)?;
    let km = (k, m);
    let all = raw_pass(RawStep::All, &ins, &out, &codec, km, chunks)?;
    let read = raw_pass(RawStep::Read, &ins, &out, &codec, km, chunks)?;
    let ec = raw_pass(RawStep::Reconstruct, &ins, &out, &codec, km, chunks)?;
    let write = raw_pass(RawStep::Write, &ins, &out, &codec, km, chunks)?;
    let net_all = raw_pass(RawStep::NetAll, &ins, &out, &codec, km, chunks)?;
    let net = raw_pass(RawStep::Net, &ins, &out, &codec, km, chunks)?;
    drop(out);
    let _ = std::fs::remove_file(&out_path);
    let bytes = (chunks * RAW_CHUNK_BYTES as u64) as f64;
    let rates = [
        ("device reads", mb(bytes) / read),
        ("reconstruct (CPU)", mb(bytes) / ec),
        ("device writes", mb(bytes) / write),
    ];
    let bottleneck = rates
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|r| r.0.to_string())
        .unwrap_or_default();
    Ok(RawRates {
        rebuild_mb_s: mb(bytes) / all,
        read_mb_s: rates[0].1,
        reconstruct_mb_s: rates[1].1,
        write_mb_s: rates[2].1,
        bottleneck,
        net_rebuild_mb_s: mb(bytes) / net_all,
        net_mb_s: mb(bytes) / net,
    })
}

fn print_table(r: &RecoveryBenchResult) {
    println!(
        "recovery benchmark: {} nodes, EC {}+{}, {:.0} MB in {} KiB objects (filled at {:.0} MB/s); \
         the machine is shared with every node process",
        r.nodes,
        r.k,
        r.m,
        mb(r.fill_bytes as f64),
        r.object_bytes >> 10,
        r.fill_mb_s
    );
    println!("{:<44} {:>12}", "measure", "value");
    let row = |k: &str, v: String| println!("{k:<44} {v:>12}");
    row(
        "rebuilt, no client load (MB)",
        format!("{:.0}", mb(r.idle_rebuilt_bytes as f64)),
    );
    let rate_rows = |rows: &[(&str, f64)]| {
        for (k, v) in rows {
            row(k, format!("{v:.1}"));
        }
    };
    rate_rows(&[
        ("rebuild rate, no client load (MB/s)", r.idle_rebuild_mb_s),
        ("raw read+reconstruct+write loop (MB/s)", r.raw.rebuild_mb_s),
        ("  raw device reads alone (out MB/s)", r.raw.read_mb_s),
        ("  raw reconstruct alone (MB/s)", r.raw.reconstruct_mb_s),
        ("  raw device writes alone (MB/s)", r.raw.write_mb_s),
    ]);
    row("  raw bottleneck", r.raw.bottleneck.clone());
    row(
        "rebuild rate / raw loop",
        format!("{:.0} %", r.idle_vs_raw * 100.0),
    );
    rate_rows(&[
        (
            "raw loop + loopback TCP moves (MB/s)",
            r.raw.net_rebuild_mb_s,
        ),
        ("  loopback TCP moves alone (out MB/s)", r.raw.net_mb_s),
    ]);
    row(
        "rebuild rate / raw loop + TCP moves",
        format!("{:.0} %", r.idle_vs_raw_net * 100.0),
    );
    row(
        "client 4K read p50 / p99, no recovery (ms)",
        format!(
            "{:.2} / {:.2}",
            r.client_baseline.p50_ms, r.client_baseline.p99_ms
        ),
    );
    row(
        "client 4K read p50 / p99, recovering (ms)",
        format!(
            "{:.2} / {:.2}",
            r.client_during_recovery.p50_ms, r.client_during_recovery.p99_ms
        ),
    );
    row(
        "client p99 recovering / baseline",
        format!("{:.2}x", r.p99_ratio),
    );
    row(
        "client ops (baseline / recovering)",
        format!(
            "{} / {}",
            r.client_baseline.ops, r.client_during_recovery.ops
        ),
    );
    row(
        "client errors (baseline / recovering)",
        format!(
            "{} / {}",
            r.client_baseline.errors, r.client_during_recovery.errors
        ),
    );
    row(
        "rebuild rate under load (MB/s)",
        format!("{:.1}", r.loaded_rebuild_mb_s),
    );
    println!("{}", crate::bench_cluster::memory_line(&r.memory));
}
