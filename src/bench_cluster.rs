//! `nvstore bench write|seq|rand`: like `rados bench`, against a running cluster.
//!
//! `write` puts whole objects `bench-<size>-<i>` from `--concurrency` threads for `--seconds`
//! and leaves them (with a `bench-<size>-meta` object holding the count); `seq` reads them in
//! order, `rand` at random. Latencies go into an HDR histogram; results print with the Ceph
//! 16.2 reference figures from issue #7 measured on the same kind of machine (8 BlueStore OSDs
//! on sparse files, EC 6+2, `rados bench -t 16`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::{Rng, RngCore, SeedableRng};

use crate::Client;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Write,
    Seq,
    Rand,
    /// Whole-object puts over the objects a `write` run left, in order (each an overwrite).
    Overwrite,
}

#[derive(Debug, clap::Args)]
pub struct ClusterBenchArgs {
    #[arg(long)]
    pub pool: String,
    /// Object size (4M, 4K, ...)
    #[arg(long, default_value = "4M", value_parser = crate::storecli::parse_size)]
    pub size: u64,
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
    /// Print the result as JSON (after the progress bar, on stdout)
    #[arg(long)]
    pub json: bool,
    /// Encode objects of 1 MiB or more in the client and stage the shards on the members
    /// (`on`, the default), or send them whole to the primary (`off`)
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub client_ec: bool,
    #[arg(short = 'c', long = "conf", env = "NVSTORE_CONF")]
    pub conf: PathBuf,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, got {s:?}")),
    }
}

/// What one run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchResult {
    pub mode: String,
    pub object_bytes: u64,
    pub concurrency: usize,
    pub seconds: f64,
    pub ops: u64,
    pub errors: u64,
    pub iops: f64,
    pub mb_per_s: f64,
    pub lat_p50_ms: f64,
    pub lat_p99_ms: f64,
    pub lat_max_ms: f64,
    /// The Ceph reference for this mode and size, when the issue gives one.
    pub ceph_reference: Option<String>,
    /// Writes the client encoded itself (client-side EC), and those that fell back to
    /// sending the object to the primary.
    pub client_encoded: u64,
    pub client_ec_fallbacks: u64,
    /// Per encoded write, mean milliseconds encoding (and queueing the stages), then staging
    /// and the op until its reply.
    pub client_ec_stage_ms: [f64; 2],
    /// Ours over Ceph's (MB/s for 4 MiB, IOPS for 4 KiB).
    pub ratio_vs_ceph: Option<f64>,
    pub memory: Memory,
    /// The run stopped early: the cluster ran out of space (the first such error).
    pub stopped_full: Option<String>,
}

/// Peak resident memory after a run: every up node's (from its perf dump) and this client's.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Memory {
    /// The largest node peak RSS, MiB, and which node.
    pub node_peak_rss_max_mib: f64,
    pub node_peak_rss_max_node: u32,
    /// Sum of the nodes' peak RSS, MiB, over `nodes` nodes that answered.
    pub node_peak_rss_total_mib: f64,
    pub nodes: usize,
    pub client_peak_rss_mib: f64,
}

/// Ask every up node for its peak RSS (nodes that do not answer are left out).
pub fn memory(c: &Client) -> Memory {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut m = Memory {
        client_peak_rss_mib: mib(driver::workload::peak_rss_kib() << 10),
        ..Memory::default()
    };
    let map = c.map();
    for (id, n) in &map.nodes {
        if !n.up {
            continue;
        }
        let Ok(d) = c.perf_dump(*id) else { continue };
        let Some(peak) = d["process"]["peak_rss_bytes"].as_u64() else {
            continue;
        };
        let peak = mib(peak);
        if peak > m.node_peak_rss_max_mib {
            m.node_peak_rss_max_mib = peak;
            m.node_peak_rss_max_node = *id;
        }
        m.node_peak_rss_total_mib += peak;
        m.nodes += 1;
    }
    m
}

/// One line for a benchmark's text output.
pub fn memory_line(m: &Memory) -> String {
    format!(
        "memory: node peak RSS max {:.0} MiB (node {}), {:.0} MiB over {} node(s); this client {:.0} MiB",
        m.node_peak_rss_max_mib,
        m.node_peak_rss_max_node,
        m.node_peak_rss_total_mib,
        m.nodes,
        m.client_peak_rss_mib
    )
}

/// Ceph 16.2.15 reference (issue #7): (MB/s or IOPS, unit).
fn ceph_reference(mode: Mode, size: u64) -> Option<(f64, &'static str)> {
    match (mode, size) {
        (Mode::Write, s) if s == 4 << 20 => Some((370.0, "MB/s")),
        (Mode::Seq, s) if s == 4 << 20 => Some((420.0, "MB/s")),
        (Mode::Write, 4096) => Some((230.0, "IOPS")),
        (Mode::Rand, 4096) => Some((1700.0, "IOPS")),
        _ => None,
    }
}

fn obj_name(size: u64, i: u64) -> String {
    format!("bench-{size}-{i}")
}

/// Run one benchmark with an existing client.
pub fn bench(
    c: &Client,
    pool: u64,
    mode: Mode,
    size: u64,
    concurrency: usize,
    seconds: u64,
    progress: bool,
) -> crate::Result<BenchResult> {
    let meta = format!("bench-{size}-meta");
    let existing: u64 = c
        .get(pool, meta.as_bytes())
        .ok()
        .and_then(|b| String::from_utf8(b).ok()?.parse().ok())
        .unwrap_or(0);
    if mode != Mode::Write && existing == 0 {
        return Err(crate::Error::Config(format!(
            "no objects of {size} bytes to read or overwrite: run `nvstore bench write --size \
             {size}` first"
        )));
    }
    let next = Arc::new(AtomicU64::new(if mode == Mode::Write {
        existing
    } else {
        0
    }));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // The first "out of space": the run stops there (every later write would fail as fast).
    let full: Arc<std::sync::OnceLock<String>> = Arc::default();
    let mut payload = vec![0u8; size as usize];
    rand_chacha::ChaCha8Rng::seed_from_u64(size).fill_bytes(&mut payload);
    // Shared, not copied per put, as rados bench writes one bufferlist again and again.
    let payload: Arc<[u8]> = payload.into();
    let bar = progress.then(|| {
        let b = indicatif::ProgressBar::new(seconds);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {elapsed_precise} [{bar:30}] {pos}/{len} s  {msg}",
            )
            .expect("template"),
        );
        b
    });
    let (ec0, ect0) = (c.client_ec_stats(), c.client_ec_times());
    let t0 = Instant::now();
    let hists: Vec<Histogram<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..concurrency)
            .map(|t| {
                let (next, done, errors, stop, payload, full) = (
                    next.clone(),
                    done.clone(),
                    errors.clone(),
                    stop.clone(),
                    payload.clone(),
                    full.clone(),
                );
                spawn_named(s, format!("bench-client-{t}"), move || {
                    let mut h =
                        Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds");
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(t as u64);
                    while !stop.load(Relaxed) {
                        let i = match mode {
                            Mode::Write => next.fetch_add(1, Relaxed),
                            Mode::Seq | Mode::Overwrite => next.fetch_add(1, Relaxed) % existing,
                            Mode::Rand => rng.gen_range(0..existing),
                        };
                        let name = obj_name(size, i);
                        let t = Instant::now();
                        let r = match mode {
                            Mode::Write | Mode::Overwrite => c
                                .put_shared(pool, name.as_bytes(), payload.clone())
                                .map(|_| ()),
                            _ => c.read(pool, name.as_bytes(), 0, size).and_then(|d| {
                                if d.len() as u64 == size {
                                    Ok(())
                                } else {
                                    Err(crate::Error::Malformed(format!(
                                        "{name}: {} bytes",
                                        d.len()
                                    )))
                                }
                            }),
                        };
                        match r {
                            Ok(()) => {
                                let _ = h.record(t.elapsed().as_micros().max(1) as u64);
                                done.fetch_add(1, Relaxed);
                            }
                            Err(e) => {
                                if e.status() == crate::wire::Status::NoSpace {
                                    let _ = full.set(e.to_string());
                                    stop.store(true, Relaxed);
                                }
                                if errors.fetch_add(1, Relaxed) < 3 {
                                    eprintln!("bench: {name}: {e}");
                                }
                            }
                        }
                    }
                    h
                })
            })
            .collect();
        let deadline = t0 + Duration::from_secs(seconds);
        while Instant::now() < deadline && !stop.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(250));
            if let Some(b) = &bar {
                let el = t0.elapsed().as_secs_f64();
                let n = done.load(Relaxed);
                b.set_position(el as u64);
                b.set_message(format!(
                    "{n} ops, {:.0} op/s, {:.1} MB/s",
                    n as f64 / el,
                    n as f64 * size as f64 / el / 1e6
                ));
            }
        }
        stop.store(true, Relaxed);
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let full = full.get().cloned();
    if mode == Mode::Write {
        let written = next.load(Relaxed).max(existing);
        match c.put(pool, meta.as_bytes(), written.to_string().as_bytes()) {
            Err(e) if full.is_some() => eprintln!(
                "bench: the object count was not recorded ({e}): `bench seq|rand` on this pool \
                 will not find these objects"
            ),
            r => {
                r?;
            }
        }
    }
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds");
    for x in &hists {
        h.add(x).expect("same bounds");
    }
    let ops = done.load(Relaxed);
    let iops = ops as f64 / secs;
    let mb = iops * size as f64 / 1e6;
    let reference = ceph_reference(mode, size);
    Ok(BenchResult {
        mode: format!("{mode:?}").to_lowercase(),
        object_bytes: size,
        concurrency,
        seconds: secs,
        ops,
        errors: errors.load(Relaxed),
        iops,
        mb_per_s: mb,
        lat_p50_ms: h.value_at_quantile(0.5) as f64 / 1e3,
        lat_p99_ms: h.value_at_quantile(0.99) as f64 / 1e3,
        lat_max_ms: h.max() as f64 / 1e3,
        ceph_reference: reference.map(|(v, u)| format!("{v} {u}")),
        client_encoded: c.client_ec_stats().0 - ec0.0,
        client_ec_fallbacks: c.client_ec_stats().1 - ec0.1,
        client_ec_stage_ms: {
            let n = (c.client_ec_stats().0 - ec0.0).max(1) as f64;
            let (st, op) = c.client_ec_times();
            [(st - ect0.0) * 1e3 / n, (op - ect0.1) * 1e3 / n]
        },
        ratio_vs_ceph: reference.map(|(v, u)| if u == "MB/s" { mb / v } else { iops / v }),
        memory: memory(c),
        stopped_full: full,
    })
}

pub fn print(r: &BenchResult) {
    println!(
        "{:<5} {:>8} B x{:<3} {:>6.1} s  {:>8} ops  {:>9.1} IOPS  {:>8.1} MB/s  lat p50 {:>7.2} ms  p99 {:>7.2} ms  max {:>8.2} ms  errors {}",
        r.mode, r.object_bytes, r.concurrency, r.seconds, r.ops, r.iops, r.mb_per_s, r.lat_p50_ms, r.lat_p99_ms, r.lat_max_ms, r.errors
    );
    if let (Some(c), Some(x)) = (&r.ceph_reference, r.ratio_vs_ceph) {
        println!("      Ceph 16.2 reference (issue #7, rados bench -t 16): {c}  ->  ours / Ceph = {x:.2}x");
    }
    if r.client_encoded + r.client_ec_fallbacks > 0 {
        println!(
            "      client-side EC: {} writes encoded by the client ({:.1} ms encoding, then {:.1} ms staging and the op, means), {} sent to the primary after a failed stage",
            r.client_encoded, r.client_ec_stage_ms[0], r.client_ec_stage_ms[1], r.client_ec_fallbacks
        );
    }
    println!("      {}", memory_line(&r.memory));
    if let Some(e) = &r.stopped_full {
        println!(
            "      stopped after {:.1} s: the cluster is full ({e}); the figures cover the run until then. Use larger devices (`cluster up --device-size`) or fewer --seconds",
            r.seconds
        );
    }
}

pub fn run(mode: Mode, a: ClusterBenchArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let c = Client::from_config(&a.conf)?;
    c.set_client_ec(a.client_ec);
    let pool = c.pool_id(&a.pool)?;
    let r = bench(
        &c,
        pool,
        mode,
        a.size,
        a.concurrency.max(1),
        a.seconds.max(1),
        !a.json,
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print(&r);
    }
    Ok(if r.errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// A scoped thread named for `top -H`.
fn spawn_named<'s, T: Send + 's>(
    s: &'s std::thread::Scope<'s, '_>,
    name: String,
    f: impl FnOnce() -> T + Send + 's,
) -> std::thread::ScopedJoinHandle<'s, T> {
    std::thread::Builder::new()
        .name(name)
        .spawn_scoped(s, f)
        .expect("spawn a benchmark thread")
}
