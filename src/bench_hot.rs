//! `nvstore bench hot`: the seed incident as a benchmark. Many clients re-read one 4 MiB object
//! while a probe reads unrelated small objects (whose PGs have the same primary node) every
//! 200 ms. Reported: hot reads/s, probe latency idle (before the storm, same run) vs during it,
//! the hot object's primary's CPU and messenger empty-iteration share (from `status` deltas),
//! and how many reads coalescing and the cache absorbed. On its own cluster it runs once with
//! read coalescing on and once with it off (nodes restarted with `read_coalescing = false`).
//!
//! Each hot client is its own `Client` (its own connection and messenger) on its own thread.
//! For reference (issue 8), Ceph 16.2 on the same kind of machine went from 20 ms to 703 ms
//! probe p99 with only 20 such clients.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::{RngCore, SeedableRng};
use serde::Serialize;

use crate::cluster_cmd::{DownOnUnwind, LocalCluster, LocalOptions};
use crate::config::{write_toml, NodeConfig};
use crate::monitor::NodeStats;
use crate::placement::{pg_of, Acting};
use crate::Client;

/// Probe objects read in turn.
const PROBE_OBJECTS: usize = 8;
/// Names tried when looking for probe objects on the hot primary.
const PROBE_SEARCH_MAX: usize = 20_000;
/// Every this many hot reads a client compares all bytes (otherwise length and samples).
const FULL_CHECK_EVERY: u64 = 16;
const POOL: &str = "hotbench";
/// How long the set-up waits for restarted nodes to serve.
const SETUP_WAIT: Duration = Duration::from_secs(60);
const HOT_NAME: &[u8] = b"hot-object";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Coalesce {
    On,
    Off,
    Both,
}

#[derive(Debug, clap::Args)]
pub struct HotBenchArgs {
    /// Seconds of the storm
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Seconds of probing before the storm (the idle baseline)
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub idle_seconds: u64,
    /// Hot clients (each its own connection and thread)
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub clients: u64,
    /// Size of the hot object
    #[arg(long, default_value = "4M", value_parser = crate::storecli::parse_size)]
    pub size: u64,
    /// Size of each probe object
    #[arg(long, default_value = "4K", value_parser = crate::storecli::parse_size)]
    pub probe_size: u64,
    /// Milliseconds between probe reads
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub probe_ms: u64,
    /// Read coalescing on the bench's own cluster: on, off, or both (one run each)
    #[arg(long, value_enum, default_value_t = Coalesce::Both)]
    pub coalesce: Coalesce,
    /// Nodes of the bench's own cluster
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(3..=64))]
    pub nodes: u32,
    /// Use a running cluster (its nodes' read_coalescing as configured) instead of starting one
    #[arg(short = 'c', long = "conf")]
    pub conf: Option<PathBuf>,
    /// Run the hot clients (and their messenger threads) at this nice value, as if they were
    /// on other hosts: on a small machine they otherwise take the CPU the nodes and the probe
    /// need. 0 keeps them at the probe's priority; 20 means SCHED_IDLE (they run only on CPU
    /// nothing else wants — closest to "on other hosts").
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=20))]
    pub client_nice: i32,
    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

/// Latency summary in milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Lat {
    pub count: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Lat {
    fn of(h: &Histogram<u64>) -> Lat {
        Lat {
            count: h.len(),
            p50_ms: h.value_at_quantile(0.5) as f64 / 1e3,
            p99_ms: h.value_at_quantile(0.99) as f64 / 1e3,
            max_ms: h.max() as f64 / 1e3,
        }
    }
}

/// A node's figures between two status reports.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeDelta {
    pub seconds: f64,
    /// CPU time over wall time, in percent of one core.
    pub cpu_pct: f64,
    pub msgr_iterations: u64,
    /// Empty iterations over iterations, in percent.
    pub empty_iteration_pct: f64,
    pub read_fetches: u64,
    pub coalesced_reads: u64,
    pub cache_hits: u64,
    /// Read-only ops answered on the messenger worker from the caches.
    pub inline_reads: u64,
    pub read_ops: u64,
}

impl NodeDelta {
    fn between(a: &NodeStats, b: &NodeStats) -> NodeDelta {
        let secs = b.at_unix_ns.saturating_sub(a.at_unix_ns) as f64 / 1e9;
        let it = b.msgr_iterations.saturating_sub(a.msgr_iterations);
        let empty = b
            .msgr_empty_iterations
            .saturating_sub(a.msgr_empty_iterations);
        NodeDelta {
            seconds: secs,
            cpu_pct: if secs > 0.0 {
                b.cpu_ns.saturating_sub(a.cpu_ns) as f64 / 1e9 / secs * 100.0
            } else {
                0.0
            },
            msgr_iterations: it,
            empty_iteration_pct: if it > 0 {
                100.0 * empty as f64 / it as f64
            } else {
                0.0
            },
            read_fetches: b.read_fetches.saturating_sub(a.read_fetches),
            coalesced_reads: b.coalesced_reads.saturating_sub(a.coalesced_reads),
            cache_hits: b.cache_hits.saturating_sub(a.cache_hits),
            inline_reads: b.inline_reads.saturating_sub(a.inline_reads),
            read_ops: b.read_ops.saturating_sub(a.read_ops),
        }
    }
}

/// One run (one coalescing setting).
#[derive(Debug, Clone, Serialize)]
pub struct HotRun {
    /// "on", "off", or "as configured" (a cluster given with --conf).
    pub coalescing: String,
    pub clients: u64,
    pub object_bytes: u64,
    pub storm_seconds: f64,
    pub hot_reads: u64,
    pub hot_errors: u64,
    pub hot_reads_s: f64,
    pub hot_mb_s: f64,
    pub hot_lat: Lat,
    pub probe_idle: Lat,
    pub probe_storm: Lat,
    pub probe_errors: u64,
    /// Probe p99 during the storm over idle (goal ≤ 2).
    pub probe_p99_ratio: f64,
    pub client_nice: i32,
    pub primary_node: u32,
    pub primary_idle: NodeDelta,
    pub primary_storm: NodeDelta,
    /// CPU of all nodes together during the storm, in percent of one core.
    pub nodes_storm_cpu_pct: f64,
    pub memory: crate::bench_cluster::Memory,
}

#[derive(Debug, Clone, Serialize)]
pub struct HotBenchResult {
    pub runs: Vec<HotRun>,
    pub note: String,
}

fn hist() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds")
}

fn primary_of(c: &Client, pool: u64, name: &[u8]) -> crate::Result<(u32, u32)> {
    let map = c.map();
    let p = &map.pools[&pool];
    let pg = pg_of(p, name);
    let primary = Acting::compute(&map, p, pg)
        .primary
        .ok_or_else(|| crate::Error::Config(format!("pg {pool}.{pg:x} has no up member")))?;
    Ok((primary, pg))
}

/// Every up node's last reported stats.
fn stats_of(c: &Client) -> crate::Result<BTreeMap<u32, NodeStats>> {
    Ok(c.status()?.node_stats)
}

fn node_delta(a: &BTreeMap<u32, NodeStats>, b: &BTreeMap<u32, NodeStats>, n: u32) -> NodeDelta {
    let get = |m: &BTreeMap<u32, NodeStats>| m.get(&n).cloned().unwrap_or_default();
    NodeDelta::between(&get(a), &get(b))
}

/// CPU of all nodes together, in percent of one core.
fn cluster_cpu_pct(a: &BTreeMap<u32, NodeStats>, b: &BTreeMap<u32, NodeStats>) -> f64 {
    a.keys()
        .filter(|n| b.contains_key(n))
        .map(|n| node_delta(a, b, *n).cpu_pct)
        .sum()
}

/// Lower the calling thread's CPU priority: nice 1–19, or SCHED_IDLE for 20 (threads it
/// spawns inherit either).
fn lower_priority(nice: i32) {
    if nice >= 20 {
        let p = libc::sched_param { sched_priority: 0 };
        // SAFETY: sets the calling thread's (pid 0) policy from a live sched_param.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &p) };
    } else if nice > 0 {
        // SAFETY: setpriority on the calling thread (tid 0 = the caller); no memory is passed.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    }
}

/// The hot clients, connected from a thread at `nice` so their messenger threads inherit it.
fn hot_clients(conf: &Path, n: u64, nice: i32) -> crate::Result<Vec<Client>> {
    std::thread::scope(|s| {
        s.spawn(|| {
            lower_priority(nice);
            (0..n).map(|_| Client::from_config(conf)).collect()
        })
        .join()
        .expect("connect thread")
    })
}

/// Set up the objects (idempotent) and run idle probing, then the storm.
fn run_once(conf: &Path, a: &HotBenchArgs, label: &str) -> crate::Result<HotRun> {
    let c = Client::from_config(conf)?;
    let pool = match c.pool_id(POOL) {
        Ok(p) => p,
        Err(_) => {
            let nodes = c.map().nodes.len() as u32;
            let k = nodes.saturating_sub(2).clamp(1, 6);
            c.create_pool(POOL, k, 2, 64 << 10, crate::map::PG_NUM_DEFAULT, None)?
        }
    };
    let mut hot = vec![0u8; a.size as usize];
    rand_chacha::ChaCha8Rng::seed_from_u64(a.size).fill_bytes(&mut hot);
    // Nodes just restarted may still be marked up from before: retry until they answer.
    let t = Instant::now();
    while let Err(e) = c.put(pool, HOT_NAME, &hot) {
        if t.elapsed() > SETUP_WAIT {
            return Err(e);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let (primary, hot_pg) = primary_of(&c, pool, HOT_NAME)?;
    // Probe objects: other PGs led by the same node (the incident's victims).
    let mut probes = Vec::new();
    for i in 0..PROBE_SEARCH_MAX {
        let name = format!("probe-{i}");
        let (p, pg) = primary_of(&c, pool, name.as_bytes())?;
        if p == primary && pg != hot_pg {
            let mut d = vec![0u8; a.probe_size as usize];
            rand_chacha::ChaCha8Rng::seed_from_u64(i as u64).fill_bytes(&mut d);
            c.put(pool, name.as_bytes(), &d)?;
            probes.push((name, d));
            if probes.len() == PROBE_OBJECTS {
                break;
            }
        }
    }
    if probes.is_empty() {
        return Err(crate::Error::Config(format!(
            "no probe object name maps to another PG of node {primary}"
        )));
    }
    let clients = hot_clients(conf, a.clients, a.client_nice)?;
    let storm = AtomicBool::new(false);
    let stop_probe = AtomicBool::new(false);
    let stop_hot = AtomicBool::new(false);
    let probe_errors = AtomicU64::new(0);
    let hot_errors = AtomicU64::new(0);
    let hot_reads = AtomicU64::new(0);
    let probe_hists = Mutex::new((hist(), hist()));
    let mut out = None;
    std::thread::scope(|s| -> crate::Result<()> {
        s.spawn(|| {
            let period = Duration::from_millis(a.probe_ms);
            let mut next = Instant::now();
            let mut i = 0;
            while !stop_probe.load(Relaxed) {
                let (name, want) = &probes[i % probes.len()];
                i += 1;
                let during = storm.load(Relaxed);
                let t = Instant::now();
                match c.get_range(pool, name.as_bytes(), 0, a.probe_size) {
                    Ok(d) if d == *want => {
                        let us = t.elapsed().as_micros().max(1) as u64;
                        let mut h = probe_hists.lock().unwrap();
                        let _ = if during { &mut h.1 } else { &mut h.0 }.record(us);
                    }
                    Ok(_) => {
                        eprintln!("bench hot: probe {name} returned wrong bytes");
                        probe_errors.fetch_add(1, Relaxed);
                    }
                    Err(e) => {
                        eprintln!("bench hot: probe {name}: {e}");
                        probe_errors.fetch_add(1, Relaxed);
                    }
                }
                next += period;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
        });
        let idle0 = stats_of(&c)?;
        std::thread::sleep(Duration::from_secs(a.idle_seconds));
        let idle1 = stats_of(&c)?;
        storm.store(true, Relaxed);
        let t0 = Instant::now();
        let hot = &hot;
        let handles: Vec<_> = clients
            .iter()
            .map(|hc| {
                let (stop_hot, hot_reads, hot_errors) = (&stop_hot, &hot_reads, &hot_errors);
                s.spawn(move || {
                    lower_priority(a.client_nice);
                    let mut h = hist();
                    let mut n = 0u64;
                    while !stop_hot.load(Relaxed) {
                        let t = Instant::now();
                        match hc.get_range(pool, HOT_NAME, 0, a.size) {
                            Ok(d) => {
                                let us = t.elapsed().as_micros().max(1) as u64;
                                n += 1;
                                let ok = d.len() == hot.len()
                                    && (!n.is_multiple_of(FULL_CHECK_EVERY) || d == *hot)
                                    && d.iter().step_by(4093).eq(hot.iter().step_by(4093));
                                if ok {
                                    let _ = h.record(us);
                                    hot_reads.fetch_add(1, Relaxed);
                                } else if hot_errors.fetch_add(1, Relaxed) < 3 {
                                    eprintln!("bench hot: wrong bytes from the hot object");
                                }
                            }
                            Err(e) => {
                                if hot_errors.fetch_add(1, Relaxed) < 3 {
                                    eprintln!("bench hot: {e}");
                                }
                            }
                        }
                    }
                    h
                })
            })
            .collect();
        let storm0 = stats_of(&c)?;
        std::thread::sleep(Duration::from_secs(a.seconds));
        let storm1 = stats_of(&c)?;
        let reads = hot_reads.load(Relaxed);
        let secs = t0.elapsed().as_secs_f64();
        stop_hot.store(true, Relaxed);
        let mut hl = hist();
        for h in handles {
            hl.add(h.join().expect("hot client")).expect("same bounds");
        }
        stop_probe.store(true, Relaxed);
        let (pi, ps) = probe_hists.lock().unwrap().clone();
        let (idle, during) = (Lat::of(&pi), Lat::of(&ps));
        out = Some(HotRun {
            coalescing: label.into(),
            clients: a.clients,
            object_bytes: a.size,
            storm_seconds: secs,
            hot_reads: reads,
            hot_errors: hot_errors.load(Relaxed),
            hot_reads_s: reads as f64 / secs,
            hot_mb_s: reads as f64 * a.size as f64 / secs / 1e6,
            hot_lat: Lat::of(&hl),
            probe_p99_ratio: if idle.p99_ms > 0.0 {
                during.p99_ms / idle.p99_ms
            } else {
                0.0
            },
            probe_idle: idle,
            probe_storm: during,
            probe_errors: probe_errors.load(Relaxed),
            client_nice: a.client_nice,
            primary_node: primary,
            primary_idle: node_delta(&idle0, &idle1, primary),
            primary_storm: node_delta(&storm0, &storm1, primary),
            nodes_storm_cpu_pct: cluster_cpu_pct(&storm0, &storm1),
            memory: crate::bench_cluster::memory(&c),
        });
        Ok(())
    })?;
    Ok(out.expect("the run finished"))
}

/// Rewrite every node's `read_coalescing` (the cluster must be down).
fn set_coalescing(dir: &Path, on: bool) -> crate::Result<()> {
    for e in std::fs::read_dir(dir).map_err(|e| crate::Error::io(dir.display().to_string(), e))? {
        let p = e.map_err(|e| crate::Error::io("readdir", e))?.path();
        let f = p.join("node.toml");
        if f.exists() {
            let mut cfg = NodeConfig::load(&f)?;
            cfg.read_coalescing = on;
            write_toml(&f, &cfg)?;
        }
    }
    Ok(())
}

fn own_cluster(a: &HotBenchArgs) -> crate::Result<Vec<HotRun>> {
    let dir = tempfile::Builder::new()
        .prefix("nvstore-bench-hot-")
        .tempdir()
        .map_err(|e| crate::Error::io("temp dir", e))?;
    let exe = std::env::current_exe().map_err(|e| crate::Error::io("current exe", e))?;
    let lc = LocalCluster::new(dir.path(), &exe);
    let _down = DownOnUnwind(&lc);
    let modes: &[bool] = match a.coalesce {
        Coalesce::On => &[true],
        Coalesce::Off => &[false],
        Coalesce::Both => &[true, false],
    };
    lc.create(&LocalOptions {
        nodes: a.nodes,
        device_bytes: 1 << 30,
        read_coalescing: modes[0],
        ..LocalOptions::default()
    })?;
    let mut runs = Vec::new();
    let r = (|| {
        for &on in modes {
            set_coalescing(dir.path(), on)?;
            if !a.json {
                eprintln!(
                    "bench hot: {}-node cluster in {}, coalescing {}",
                    a.nodes,
                    dir.path().display(),
                    if on { "on" } else { "off" }
                );
            }
            drop(lc.up()?);
            runs.push(run_once(
                &lc.client_config(),
                a,
                if on { "on" } else { "off" },
            )?);
            lc.down()?;
        }
        Ok(())
    })();
    let _ = lc.down();
    r.map(|()| runs)
}

pub fn print(r: &HotBenchResult) {
    println!(
        "{:<10} {:>7} {:>9} {:>8} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7} {:>8} {:>9} {:>9}",
        "coalescing",
        "clients",
        "hot rd/s",
        "MB/s",
        "probe p50",
        "probe p99",
        "storm p50",
        "storm p99",
        "p99 x",
        "cpu %",
        "empty %",
        "fetches",
        "absorbed"
    );
    for x in &r.runs {
        println!(
            "{:<10} {:>7} {:>9.0} {:>8.0} {:>8.2}ms {:>8.2}ms {:>8.2}ms {:>8.2}ms {:>7.2} {:>7.0} {:>8.2} {:>9} {:>9}",
            x.coalescing,
            x.clients,
            x.hot_reads_s,
            x.hot_mb_s,
            x.probe_idle.p50_ms,
            x.probe_idle.p99_ms,
            x.probe_storm.p50_ms,
            x.probe_storm.p99_ms,
            x.probe_p99_ratio,
            x.primary_storm.cpu_pct,
            x.primary_storm.empty_iteration_pct,
            x.primary_storm.read_fetches,
            x.primary_storm.coalesced_reads + x.primary_storm.cache_hits
        );
    }
    for x in &r.runs {
        println!(
            "  {}: hot read p50 {:.1} ms p99 {:.1} ms; {} probe reads idle, {} in the storm; \
             errors hot {} probe {}; all nodes' cpu in the storm {:.0} %; primary node {}: \
             idle cpu {:.0} %, idle empty {:.2} %; reads answered on its messenger workers: \
             {} idle, {} in the storm",
            x.coalescing,
            x.hot_lat.p50_ms,
            x.hot_lat.p99_ms,
            x.probe_idle.count,
            x.probe_storm.count,
            x.hot_errors,
            x.probe_errors,
            x.nodes_storm_cpu_pct,
            x.primary_node,
            x.primary_idle.cpu_pct,
            x.primary_idle.empty_iteration_pct,
            x.primary_idle.inline_reads,
            x.primary_storm.inline_reads
        );
        println!(
            "  {}: {}",
            x.coalescing,
            crate::bench_cluster::memory_line(&x.memory)
        );
    }
    println!("{}", r.note);
}

pub fn run(a: HotBenchArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let runs = match &a.conf {
        Some(conf) => vec![run_once(conf, &a, "as configured")?],
        None => own_cluster(&a)?,
    };
    let r = HotBenchResult {
        runs,
        note: "goals: probe p99 storm/idle <= 2x, primary empty iterations <= 5 %. Ceph 16.2 \
               (issue 8): probe p99 20 ms -> 703 ms with 20 clients."
            .into(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print(&r);
    }
    let errors = r.runs.iter().any(|x| x.hot_errors + x.probe_errors > 0);
    Ok(if errors {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
