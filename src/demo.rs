//! `nvstore demo`: the whole system in one minute on this machine.
//!
//! Starts a monitor and 8 node processes on loopback with file devices in a temporary
//! directory, creates an EC 6+2 pool, writes objects of several sizes and reads them back,
//! kills two nodes (SIGKILL) and shows that every object still reads back byte-identical
//! (decoded from the surviving shards), shows that a write is refused rather than stored with
//! too little redundancy, restarts the nodes, waits for HEALTH_OK, verifies again and cleans
//! up. Exits non-zero on any mismatch.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};

use crate::cluster_cmd::{DownOnUnwind, LocalCluster, LocalOptions};
use crate::placement::{pg_of, Acting};
use crate::Client;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Cluster directory (default: a new temporary directory, removed afterwards)
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the cluster running and its directory afterwards
    #[arg(long)]
    pub keep: bool,
    /// Size of each node's device file (sparse)
    #[arg(long, default_value = "1G", value_parser = crate::storecli::parse_size)]
    pub device_size: u64,
}

const SIZES: [(&str, usize); 7] = [
    ("empty", 0),
    ("one-byte", 1),
    ("page-4k", 4096),
    ("odd-1m", (1 << 20) + 7),
    ("big-4m", (4 << 20) + 1),
    ("big-20m", 20 << 20),
    ("max-64m", 64 << 20),
];

fn content(i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand_chacha::ChaCha8Rng::seed_from_u64(0x6e76_0000 + i as u64).fill_bytes(&mut v);
    v
}

fn step(n: u32, what: &str) {
    println!("\n== {n}. {what}");
}

type DemoResult = Result<ExitCode, Box<dyn std::error::Error>>;

pub fn run(a: DemoArgs) -> DemoResult {
    let t0 = Instant::now();
    let (dir, _tmp) = match &a.dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = tempfile::Builder::new().prefix("nvstore-demo-").tempdir()?;
            (t.path().to_owned(), Some(t))
        }
    };
    let lc = LocalCluster::new(&dir, &std::env::current_exe()?);
    let _down = DownOnUnwind(&lc);
    let r = demo(&lc, &a);
    if a.keep {
        if let Some(t) = _tmp {
            let kept = t.keep();
            println!("\ncluster kept running in {}", kept.display());
        }
        println!("export NVSTORE_CONF={}", lc.client_config().display());
    } else {
        step(8, "clean up");
        let n = lc.down()?;
        println!("   stopped {n} processes; removing {}", dir.display());
        if a.dir.is_some() {
            std::fs::remove_dir_all(&dir)?;
        }
    }
    match r {
        Ok(0) => {
            println!(
                "\nOK: every read returned the bytes written ({:.1} s)",
                t0.elapsed().as_secs_f64()
            );
            Ok(ExitCode::SUCCESS)
        }
        Ok(bad) => {
            println!("\nFAILED: {bad} mismatch(es)");
            Ok(ExitCode::FAILURE)
        }
        Err(e) => {
            println!("\nFAILED: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}

fn verify(
    c: &Client,
    pool: u64,
    objs: &[(String, Vec<u8>)],
    down: &[u32],
) -> Result<usize, Box<dyn std::error::Error>> {
    let map = c.map();
    let p = &map.pools[&pool];
    let mut bad = 0;
    for (name, data) in objs {
        let t = Instant::now();
        let got = c.get(pool, name.as_bytes())?;
        let a = Acting::compute(&map, p, pg_of(p, name.as_bytes()));
        let lost: Vec<usize> = (0..p.size())
            .filter(|s| a.members[*s].is_some_and(|n| down.contains(&n)))
            .collect();
        let lost_data: Vec<usize> = lost.iter().copied().filter(|s| *s < p.k as usize).collect();
        let how = if lost.is_empty() {
            "all shards up".to_string()
        } else if data.is_empty() {
            format!("shards {lost:?} down (empty object: nothing to decode)")
        } else if lost_data.is_empty() {
            format!("shards {lost:?} down (parity only: no decode needed)")
        } else {
            format!("shards {lost:?} down: data shard(s) {lost_data:?} rebuilt from parity")
        };
        let ok = got == *data;
        if !ok {
            bad += 1;
        }
        println!(
            "   {} {:<9} {:>9} bytes  {:>6.1} ms  {how}",
            if ok { "ok " } else { "BAD" },
            name,
            got.len(),
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(bad)
}

fn demo(lc: &LocalCluster, a: &DemoArgs) -> Result<usize, Box<dyn std::error::Error>> {
    step(
        1,
        "start a monitor and 8 storage nodes (separate processes, loopback, file devices)",
    );
    println!("   directory {}", lc.dir.display());
    lc.create(&LocalOptions {
        nodes: 8,
        monitors: 1,
        device_bytes: a.device_size,
        down_grace_ms: 3000,
        write_wait_ms: 3000,
        ..LocalOptions::default()
    })?;
    let t = Instant::now();
    let c = lc.up()?;
    let pool = c.create_pool("demo", 6, 2, 64 << 10, 64, None)?;
    let m = c.map();
    println!(
        "   {} nodes up in {:.1} s, map epoch {}; pool 'demo': EC 6+2, 64 KiB stripe unit, 64 PGs, \
         min_size 7, one shard per host",
        m.nodes.len(),
        t.elapsed().as_secs_f64(),
        m.epoch
    );

    step(
        2,
        "write objects of several sizes, erasure coded across the 8 nodes",
    );
    let mut objs = Vec::new();
    for (i, (name, len)) in SIZES.iter().enumerate() {
        let data = content(i, *len);
        let t = Instant::now();
        let v = c.put(pool, name.as_bytes(), &data)?;
        println!(
            "   put {:<9} {:>9} bytes  {:>6.1} ms  version {v:#x}",
            name,
            len,
            t.elapsed().as_secs_f64() * 1e3
        );
        objs.push((name.to_string(), data));
    }
    println!("   read back:");
    let mut bad = verify(&c, pool, &objs, &[])?;

    step(3, "kill -9 two storage nodes");
    let victims = [3u32, 6];
    for v in victims {
        lc.stop_member(&format!("node.{v}"), true)?;
        println!("   killed node.{v}");
    }
    let t = Instant::now();
    let e0 = c.map().epoch;
    while victims.iter().any(|v| c.map().nodes[v].up) {
        c.wait_epoch(c.map().epoch + 1, Duration::from_millis(500));
        let _ = c.refresh_map();
        if t.elapsed() > Duration::from_secs(60) {
            return Err("the monitor did not mark the killed nodes down within 60 s".into());
        }
    }
    println!(
        "   the monitor marked them down after {:.1} s (no heartbeats; map epoch {e0} -> {})",
        t.elapsed().as_secs_f64(),
        c.map().epoch
    );
    let s = c.status()?;
    println!("   health: {} — {}", s.health, s.health_detail.join("; "));

    step(
        4,
        "read everything back degraded: missing data shards are decoded from the others",
    );
    bad += verify(&c, pool, &objs, &victims)?;

    step(
        5,
        "a write now has 6 of 8 shards, below min_size 7: it is refused, not stored thinly",
    );
    let t = Instant::now();
    match c.put(pool, b"refused", b"not enough redundancy") {
        Ok(v) => println!("   unexpected: write acknowledged at version {v}"),
        Err(e) => println!("   refused after {:.1} s: {e}", t.elapsed().as_secs_f64()),
    }

    step(6, "restart the two nodes");
    let t = Instant::now();
    for v in victims {
        lc.start_member(&format!("node.{v}"))?;
    }
    lc.wait_nodes_up(&c, 8, Instant::now() + Duration::from_secs(60))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let s = loop {
        let s = c.status()?;
        if s.health == "HEALTH_OK" || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    println!(
        "   all 8 nodes up again after {:.1} s; health: {} ({} pgs {})",
        t.elapsed().as_secs_f64(),
        s.health,
        s.pg_total,
        s.pg_states.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    if s.health != "HEALTH_OK" {
        bad += 1;
        println!(
            "   BAD: health is {} — {}",
            s.health,
            s.health_detail.join("; ")
        );
    }

    step(7, "verify every object once more, and write again");
    bad += verify(&c, pool, &objs, &[])?;
    let v = c.put(pool, b"after-heal", b"writes work again")?;
    let ok = c.get(pool, b"after-heal")? == b"writes work again";
    println!(
        "   put+get after-heal: version {v:#x} {}",
        if ok { "ok" } else { "BAD" }
    );
    if !ok {
        bad += 1;
    }
    Ok(bad)
}
