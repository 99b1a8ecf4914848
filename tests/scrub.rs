//! Scrub and repair with real node processes: bits flipped in shard data on several nodes'
//! device images (while the nodes run) are never returned to a reader, and a scrub pass finds
//! and repairs every one; a node whose un-checkpointed log rotted while it was down opens
//! (salvage) and gets its damaged shards repaired without waiting for a scheduled pass.

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::{bytes, Harness};
use nvstore::cluster_cmd::LocalOptions;
use nvstore::config::{write_toml, NodeConfig};
use nvstore::node::scrub::{locate_request, ScrubStats};
use nvstore::placement::{pg_of, Acting};
use nvstore::scrub_cmd::scrub_call;
use nvstore::{wire, Client};
use rand::{Rng, SeedableRng};

const NODES: u32 = 8;
const OBJECTS: usize = 24;
const K: u32 = 6;
const M: u32 = 2;
const UNIT: u32 = 4096;

/// One cluster at a time: the machine has few cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn cluster() -> Harness {
    common::cluster(
        "nvstore-scrub-",
        &LocalOptions {
            nodes: NODES,
            monitors: 1,
            device_bytes: 256 << 20,
            down_grace_ms: 1500,
            heartbeat_ms: 300,
            ..LocalOptions::default()
        },
    )
}

/// Flip one random bit inside the data of `name`'s shard `slot` on the node holding it.
/// Returns the node, or `None` when that slot has no member or its shard holds no data.
fn flip(c: &Client, pool: u64, name: &str, slot: usize, rng: &mut impl Rng) -> Option<u32> {
    let (node, device, extents) = locate(c, pool, name, slot)?;
    if extents.is_empty() {
        return None;
    }
    let (off, len) = extents[rng.gen_range(0..extents.len())];
    let at = off + rng.gen_range(0..len);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 1 << rng.gen_range(0..8);
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
    Some(node)
}

/// The ids of the nodes the map has up.
fn up_nodes(c: &Client) -> Vec<u32> {
    c.map()
        .nodes
        .values()
        .filter(|n| n.up)
        .map(|n| n.id)
        .collect()
}

/// Run one scrub pass on every up node; the pass counts summed over the nodes.
fn scrub_pass(h: &Harness) -> ScrubStats {
    let c = &h.client;
    let nodes = up_nodes(c);
    let before: Vec<u64> = nodes
        .iter()
        .map(|n| scrub_call(c, *n, 1).unwrap().totals.passes)
        .collect();
    let t = Instant::now();
    let mut sum = ScrubStats::default();
    for (n, b) in nodes.iter().zip(before) {
        loop {
            let s = scrub_call(c, *n, 0).unwrap();
            if s.totals.passes > b && s.cursor.is_none() {
                sum.add(&s.last_pass);
                break;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let log = std::fs::read_to_string(h.lc.dir.join(format!("node.{n}.log")));
                panic!(
                    "node {n}: no scrub pass finished: {s:?}\n{}",
                    log.unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    sum
}

/// One store sample (`perf dump`'s `store.by_device.<device>.<name>`) summed over every
/// device of every up node.
fn cache_total(c: &Client, name: &str) -> u64 {
    let mut sum = 0;
    for n in up_nodes(c) {
        let d = c.perf_dump(n).unwrap();
        let devs = d["store"]["by_device"]
            .as_object()
            .expect("store.by_device");
        for v in devs.values() {
            sum += v[name].as_u64().unwrap_or_else(|| panic!("{name} in {v}"));
        }
    }
    sum
}

fn totals(c: &Client) -> ScrubStats {
    let mut sum = ScrubStats::default();
    for n in up_nodes(c) {
        sum.add(&scrub_call(c, n, 0).unwrap().totals);
    }
    sum
}

#[test]
fn flipped_bits_are_never_read_and_scrub_repairs_them() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster();
    let c = &h.client;
    let pool = c.create_pool("s", K, M, UNIT, 8, None).unwrap();
    let seed = std::env::var("NVSTORE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("seed {seed}");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let objects: Vec<(String, Vec<u8>)> = (0..OBJECTS)
        .map(|i| {
            let len = rng.gen_range((K * UNIT) as usize..200_000);
            (format!("obj-{i}"), bytes(seed ^ i as u64, len))
        })
        .collect();
    for (name, data) in &objects {
        c.put(pool, name.as_bytes(), data).unwrap();
    }
    let clean = scrub_pass(&h);
    assert_eq!(clean.objects, OBJECTS as u64, "{clean:?}");
    assert_eq!(clean.crc_errors + clean.missing + clean.parity_errors, 0);
    // A pass interrupted by a crash resumes at its saved cursor. (Before any flips: a node
    // whose not yet checkpointed log holds a flipped bit reopens past it and asks for scrubs,
    // which would muddle this test's counts; `a_node_whose_log_rotted_...` tests that.)
    resume_after_crash(&h, pool);

    // Every shard read twice, so the members' read caches hold them: the scrub below must
    // still find the flips, which it can only by reading the devices.
    for _ in 0..2 {
        for (name, data) in &objects {
            assert!(c.get(pool, name.as_bytes()).unwrap() == *data, "{name}");
        }
    }
    let cache_hits = cache_total(c, "read_cache_hits");
    println!("read cache: {cache_hits} hits before the flips");
    assert!(cache_hits > 0, "the second reads came from the read caches");

    // Round 1: one bit in each of 10 distinct shards (data and parity, several nodes); the
    // scrub finds every one and rebuilds it.
    let mut hit = BTreeSet::new();
    let mut nodes_hit = BTreeSet::new();
    while hit.len() < 10 {
        let o = rng.gen_range(0..OBJECTS);
        let slot = rng.gen_range(0..(K + M) as usize);
        // At most m bad shards per object: more is beyond what the code can rebuild.
        if hit.contains(&(o, slot)) || hit.iter().filter(|(x, _)| *x == o).count() >= M as usize {
            continue;
        }
        if let Some(n) = flip(c, pool, &objects[o].0, slot, &mut rng) {
            hit.insert((o, slot));
            nodes_hit.insert(n);
        }
    }
    let pass = scrub_pass(&h);
    println!(
        "round 1: {} flips on nodes {nodes_hit:?}; scrub pass: {pass:?}",
        hit.len()
    );
    assert!(nodes_hit.len() >= 2);
    assert_eq!(pass.crc_errors, hit.len() as u64, "every flip detected");
    if pass.repaired != hit.len() as u64 {
        for n in 1..=NODES {
            let log = std::fs::read_to_string(h.lc.dir.join(format!("node.{n}.log")));
            for l in log
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("WARN"))
            {
                println!("node.{n}: {l}");
            }
        }
    }
    assert_eq!(pass.repaired, hit.len() as u64, "every flip repaired");
    assert_eq!(pass.unrepairable + pass.missing + pass.parity_errors, 0);
    // The counts ride the heartbeats into `nvstore status`.
    let t = Instant::now();
    let status = loop {
        let s = c.status().unwrap();
        if s.scrub.crc_errors >= hit.len() as u64 && s.scrub.passes >= 2 * NODES as u64 {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "status: {:?}",
            s.scrub
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = nvstore::cluster_cmd::render_status(&status);
    println!("{}", text.lines().find(|l| l.contains("scrub:")).unwrap());
    assert!(
        text.contains(&format!("{} crc errors", hit.len())),
        "{text}"
    );
    let again = scrub_pass(&h);
    assert_eq!(
        again.crc_errors + again.repaired + again.unrepairable,
        0,
        "{again:?}"
    );
    for (name, data) in &objects {
        assert!(c.get(pool, name.as_bytes()).unwrap() == *data, "{name}");
    }

    // Round 2: flips in data shards of 6 objects; reads return exact bytes (read around the
    // corrupt shard) and repair them after replying. The reads must reach the devices to meet
    // the flips: the read caches (which would serve the good bytes) are switched off.
    for n in 1..=NODES {
        let v = c.config(n, Some(("read_cache", "false"))).unwrap();
        assert_eq!(v["read_cache"], false, "{v}");
    }
    assert_eq!(
        cache_total(c, "read_cache_bytes"),
        0,
        "switched off = emptied"
    );
    let before = totals(c);
    let mut hit = BTreeSet::new();
    let mut nodes_hit = BTreeSet::new();
    while hit.len() < 6 {
        let o = rng.gen_range(0..OBJECTS);
        if hit.iter().any(|(x, _)| *x == o) {
            continue;
        }
        let slot = rng.gen_range(0..K as usize);
        if let Some(n) = flip(c, pool, &objects[o].0, slot, &mut rng) {
            hit.insert((o, slot));
            nodes_hit.insert(n);
        }
    }
    for (name, data) in &objects {
        assert!(
            c.get(pool, name.as_bytes()).unwrap() == *data,
            "{name} reads exact bytes"
        );
    }
    let t = Instant::now();
    let after = loop {
        let a = totals(c);
        if a.read_repaired - before.read_repaired >= hit.len() as u64 {
            break a;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "read repairs: {a:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    println!(
        "round 2: {} flips in data shards; reads met {} corrupt shards and repaired {}",
        hit.len(),
        after.read_corrupt - before.read_corrupt,
        after.read_repaired - before.read_repaired
    );
    assert_eq!(after.read_corrupt - before.read_corrupt, hit.len() as u64);
    let last = scrub_pass(&h);
    assert_eq!(
        last.crc_errors + last.missing + last.unrepairable,
        0,
        "{last:?}"
    );

    // Parity that disagrees with its data while every crc is fine (a bad write, say): the
    // scrub names the stripes and rewrites the parity from the data.
    let (name, _) = &objects[0];
    let stripes = zero_parity(&h, pool, name);
    let pass = scrub_pass(&h);
    println!("parity shard zeroed in {stripes} stripe(s) of {name}: scrub pass {pass:?}");
    assert_eq!(pass.parity_errors, stripes, "{pass:?}");
    assert_eq!(pass.repaired, 1, "{pass:?}");
    assert_eq!(pass.crc_errors + pass.unrepairable, 0, "{pass:?}");
    let again = scrub_pass(&h);
    assert_eq!(again.parity_errors + again.repaired, 0, "{again:?}");

    // A node whose device held flipped bits restarts (repairs checkpoint the store, so the
    // bad copies are not in the log it replays).
    let n = *nodes_hit.iter().next().unwrap();
    restart(&h, n);
    println!("node.{n} (had flipped bits) restarted");
    for (name, data) in &objects {
        assert!(c.get(pool, name.as_bytes()).unwrap() == *data, "{name}");
    }

    // With two nodes gone, every object still decodes to its exact bytes.
    h.lc.stop_member("node.2", true).unwrap();
    h.lc.stop_member("node.5", true).unwrap();
    let t = Instant::now();
    while [2, 5].iter().any(|i| c.map().nodes[i].up) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "nodes never marked down"
        );
        let _ = c.refresh_map();
        std::thread::sleep(Duration::from_millis(100));
    }
    for (name, data) in &objects {
        assert!(
            c.get(pool, name.as_bytes()).unwrap() == *data,
            "{name} with nodes 2 and 5 down"
        );
    }
}

/// Slow one node's scrub down, start a pass, kill the node once the pass saved a cursor past
/// its first object, restart it (fast again) and check that it resumed there and finished.
fn resume_after_crash(h: &Harness, pool: u64) {
    let c = &h.client;
    let map = c.map();
    let p = &map.pools[&pool];
    let mut led = std::collections::BTreeMap::<u32, u32>::new();
    for pg in 0..p.pg_num {
        *led.entry(Acting::compute(&map, p, pg).primary.unwrap())
            .or_default() += 1;
    }
    let node = *led.iter().max_by_key(|(_, n)| **n).unwrap().0;
    let member = format!("node.{node}");
    let conf = h.lc.dir.join(&member).join("node.toml");
    let set_rate = |bps: u64| {
        let mut cfg = NodeConfig::load(&conf).unwrap();
        cfg.scrub_bytes_per_sec = bps;
        write_toml(&conf, &cfg).unwrap();
    };
    let restart = || restart(h, node);
    set_rate(64 << 10);
    restart();
    let passes = scrub_call(c, node, 1).unwrap().totals.passes;
    let t = Instant::now();
    let saved = loop {
        let text = std::fs::read_to_string(h.lc.dir.join(&member).join("scrub.json"));
        let cursor = text
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["cursor"]["after_hex"].as_str().map(str::to_string))
            .filter(|a| !a.is_empty());
        if let Some(a) = cursor {
            break a;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no cursor saved");
        std::thread::sleep(Duration::from_millis(50));
    };
    set_rate(32 << 20);
    restart();
    let t = Instant::now();
    while scrub_call(c, node, 0).unwrap().totals.passes <= passes {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "resumed pass never ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = std::fs::read_to_string(h.lc.dir.join(format!("{member}.log"))).unwrap();
    println!("{member}: killed mid-pass with cursor after {saved:?}; restarted, resumed, done");
    assert!(
        log.contains(&format!("pass resumes from pool {pool} after {saved:?}")),
        "{member} did not resume after {saved:?}"
    );
}

/// Four nodes with 128 MiB devices, for the salvage tests (K = 2, M = 1 pools).
fn small_cluster(prefix: &str) -> Harness {
    common::cluster(
        prefix,
        &LocalOptions {
            nodes: 4,
            monitors: 1,
            device_bytes: 128 << 20,
            down_grace_ms: 1500,
            heartbeat_ms: 300,
            ..LocalOptions::default()
        },
    )
}

/// Kill a node and start it again; wait until the map shows it up at its new port.
fn restart(h: &Harness, node: u32) {
    h.lc.stop_member(&format!("node.{node}"), true).unwrap();
    start_again(h, node);
}

/// Start a stopped node; wait until the map shows it up at its new port.
fn start_again(h: &Harness, node: u32) {
    let c = &h.client;
    let member = format!("node.{node}");
    let old = c.map().nodes[&node].addr;
    h.lc.start_member(&member).unwrap();
    let t = Instant::now();
    while c.map().nodes[&node].addr == old || !c.map().nodes[&node].up {
        if t.elapsed() > Duration::from_secs(30) {
            let log = std::fs::read_to_string(h.lc.dir.join(format!("{member}.log")));
            let log = log.unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            panic!(
                "{member} did not come back: {:?}\n{}",
                c.map().nodes[&node],
                tail.join("\n")
            );
        }
        let _ = c.refresh_map();
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Replace the first parity shard of `name` by zeros, at its version, with a valid crc (a
/// raw `SHARD_REPAIR` as if from the primary). Returns the number of stripes it spans.
fn zero_parity(h: &Harness, pool: u64, name: &str) -> u64 {
    use messenger::{Identity, OutMessage};
    use nvstore::node::local::{ShardData, ShardMeta, ShardWrite, WriteKind, BASE_ANY};
    let c = &h.client;
    let map = c.map();
    let p = &map.pools[&pool];
    let a = Acting::compute(&map, p, pg_of(p, name.as_bytes()));
    let st = c.stat(pool, name.as_bytes()).unwrap();
    let (u, w) = (UNIT as u64, (K * UNIT) as u64);
    let len = st.size / w * u + (st.size % w).min(u);
    let zeros = vec![0u8; len as usize];
    let write = ShardWrite {
        pool,
        pg: a.pg,
        name: name.as_bytes(),
        shard: K as u8,
        kind: WriteKind::Full,
        base_version: BASE_ANY,
        meta: ShardMeta {
            version: st.version,
            size: st.size,
            mtime_unix_ns: st.mtime_unix_ns,
            deleted: false,
        },
        offset: 0,
        xattrs: vec![],
        reqs: Default::default(),
        data: ShardData::Flat(&zeros),
        chunk_crcs: Vec::new(),
        listed_crcs: Vec::new(),
    };
    let mut payload = write.encode_header(map.epoch);
    payload.extend_from_slice(&zeros);
    let primary = a.primary.unwrap();
    let m = h.raw_messenger(Identity::Node(primary));
    let target = a.members[K as usize].unwrap();
    let conn = m
        .connect(map.nodes[&target].addr, Identity::Node(target))
        .unwrap();
    let r = conn
        .request(
            OutMessage::new(wire::MSG_SHARD_REPAIR, payload),
            Duration::from_secs(10),
        )
        .unwrap();
    wire::parse_reply(&r.payload).unwrap();
    m.shutdown();
    len.div_ceil(u)
}

/// (node, device path, extents on it) of a shard.
type Located = (u32, String, Vec<(u64, u64)>);

/// `name`'s shard extents on the node holding `slot`: (node, device path, extents); `None`
/// when the slot has no member.
fn locate(c: &Client, pool: u64, name: &str, slot: usize) -> Option<Located> {
    let map = c.map();
    let p = &map.pools[&pool];
    let node = Acting::compute(&map, p, pg_of(p, name.as_bytes())).members[slot]?;
    let body = c
        .node_call(
            node,
            wire::MSG_NODE_LOCATE,
            &locate_request(pool, name.as_bytes(), slot as u8),
        )
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let extents = serde_json::from_value(v["extents"].clone()).unwrap();
    Some((node, v["device"].as_str().unwrap().to_string(), extents))
}

fn flip_at(device: &str, at: u64, bit: u8) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 1 << bit;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

/// The batch header in front of a data extent: the nearest block before it that starts with
/// the batch magic (docs/format.md "Batch").
fn batch_header_before(device: &str, data_at: u64) -> u64 {
    let f = std::fs::File::open(device).unwrap();
    let mut at = data_at - 4096;
    for _ in 0..64 {
        let mut m = [0u8; 4];
        f.read_exact_at(&mut m, at).unwrap();
        if &m == b"NVBT" {
            return at;
        }
        at -= 4096;
    }
    panic!("no batch header within 64 blocks before byte {data_at}");
}

/// A node is stopped, and in its not yet checkpointed log one shard's data chunk gets a
/// flipped bit and another shard write's batch header too (both acknowledged: later writes
/// followed). `store-tool fsck` reports both places and exits 1; the node then starts (a lone
/// store would refuse), and without any scrub being asked for, the primaries it asks scrub at
/// once and recovery backfills the PG whose mark it dropped: the corrupt shard and the lost
/// one are rebuilt, every object reads exact, and a further pass is clean.
#[test]
fn a_node_whose_log_rotted_while_down_opens_and_gets_repaired() {
    const K: u32 = 2;
    const M: u32 = 1;
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = small_cluster("nvstore-salvage-");
    let c = &h.client;
    let pool = c.create_pool("v", K, M, UNIT, 8, None).unwrap();
    let objects: Vec<(String, Vec<u8>)> = (0..12)
        .map(|i| {
            (
                format!("v-{i}"),
                bytes(500 + i, 30_000 + 7_000 * i as usize),
            )
        })
        .collect();
    for (name, data) in &objects {
        c.put(pool, name.as_bytes(), data).unwrap();
    }
    // The primary of v-1's PG loses its own shard of v-1 (created in the skipped batch: the
    // primary's scrub, which walks the names it holds, cannot see it; recovery backfills it
    // once the node has dropped its mark). Another object with a shard there gets the data
    // flip; later writes reach the node after both (so both batches were provably
    // acknowledged).
    let map = c.map();
    let p = &map.pools[&pool];
    let members = |name: &str| Acting::compute(&map, p, pg_of(p, name.as_bytes())).members;
    let (o2, s2) = (1, 0);
    let node = members(&objects[o2].0)[s2].unwrap();
    let slot_on = |name: &str| members(name).iter().position(|m| *m == Some(node));
    let (o1, s1) = (0..8)
        .filter(|i| *i != o2)
        .find_map(|i| Some((i, slot_on(&objects[i].0)?)))
        .expect("another early object on the node");
    assert!(
        objects[o1.max(o2) + 1..]
            .iter()
            .any(|(n, _)| slot_on(n).is_some()),
        "later writes on node {node}"
    );
    let (_, device, ext0) = locate(c, pool, &objects[o1].0, s1).unwrap();
    let (_, _, ext2) = locate(c, pool, &objects[o2].0, s2).unwrap();
    let member = format!("node.{node}");
    let before = totals(c);
    h.lc.stop_member(&member, true).unwrap();
    flip_at(&device, ext0[0].0 + 1000, 4);
    let header = batch_header_before(&device, ext2[0].0);
    flip_at(&device, header + 20, 2);

    // Offline: fsck names both places and fails.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["store-tool", "--device", &device, "fsck"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("fsck:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "fsck exits 1");
    assert!(
        text.contains(&format!("data-crc at byte offset {}", ext0[0].0)),
        "{text}"
    );
    assert!(
        text.contains(&format!("batch-header at byte offset {header}")),
        "{text}"
    );

    start_again(&h, node);
    // No scrub is requested here and the scheduled interval is a week: only the node's own
    // request after its salvage open gets the corrupt chunk rebuilt. The shard the skipped
    // batch held is rebuilt by that scrub ("missing") or by recovery, which the node's return
    // starts too (its PG log lost that entry with the batch) — whichever comes first.
    let shard_back = || {
        let req = locate_request(pool, objects[o2].0.as_bytes(), s2 as u8);
        c.node_call(node, wire::MSG_NODE_LOCATE, &req).is_ok()
    };
    let t = Instant::now();
    let after =
        loop {
            let a = totals(c);
            if a.repaired > before.repaired && shard_back() {
                break a;
            }
            if t.elapsed() > Duration::from_secs(30) {
                for n in 1..=4 {
                    let log = std::fs::read_to_string(h.lc.dir.join(format!("node.{n}.log")));
                    for l in log.unwrap_or_default().lines().filter(|l| {
                        l.contains("WARN") || l.contains("scrub") || l.contains("salvage")
                    }) {
                        println!("node.{n}: {l}");
                    }
                }
                panic!(
                    "no repair after the salvage open: {a:?}, shard back: {}",
                    shard_back()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
    println!("after the salvage open: {after:?}");
    assert!(
        after.crc_errors > before.crc_errors,
        "the corrupt chunk found"
    );
    assert_eq!(after.unrepairable, before.unrepairable);
    let log = std::fs::read_to_string(h.lc.dir.join(format!("{member}.log"))).unwrap();
    for want in [
        format!("data-crc at byte offset {}", ext0[0].0),
        format!("batch-header at byte offset {header}"),
        "asking nodes".to_string(),
        "dropped: it will be backfilled".to_string(),
    ] {
        assert!(log.contains(&want), "{member}.log lacks {want:?}");
    }
    for (name, data) in &objects {
        assert!(c.get(pool, name.as_bytes()).unwrap() == *data, "{name}");
    }
    let clean = scrub_pass(&h);
    assert_eq!(
        clean.crc_errors + clean.missing + clean.unrepairable,
        0,
        "{clean:?}"
    );
}

/// The newest valid superblock of a device file.
fn superblock_of(device: &str) -> store::format::Superblock {
    let dev =
        driver::FileDevice::open(std::path::Path::new(device), driver::FileOptions::default())
            .unwrap();
    store::read_label(&dev).expect("a valid superblock")
}

/// A small cluster with a k = 2, m = 1 pool of 12 objects, the first member of the first
/// object's PG, the (object, slot) pairs it holds, and the device and extents of its shard
/// of the first of them.
struct OnOneNode {
    h: Harness,
    pool: u64,
    objects: Vec<(String, Vec<u8>)>,
    node: u32,
    held: Vec<(usize, usize)>,
    device: String,
    extents: Vec<(u64, u64)>,
}

fn objects_on_one_node(prefix: &str, pool_name: &str, seed: u64) -> OnOneNode {
    let h = small_cluster(prefix);
    let c = &h.client;
    let pool = c.create_pool(pool_name, 2, 1, UNIT, 8, None).unwrap();
    let objects: Vec<(String, Vec<u8>)> = (0..12)
        .map(|i| {
            (
                format!("{pool_name}-{i}"),
                bytes(seed + i, 20_000 + 5_000 * i as usize),
            )
        })
        .collect();
    for (name, data) in &objects {
        c.put(pool, name.as_bytes(), data).unwrap();
    }
    let map = c.map();
    let p = &map.pools[&pool];
    let members = |name: &str| Acting::compute(&map, p, pg_of(p, name.as_bytes())).members;
    let node = members(&objects[0].0)[0].unwrap();
    let held: Vec<(usize, usize)> = objects
        .iter()
        .enumerate()
        .filter_map(|(i, (n, _))| Some((i, members(n).iter().position(|m| *m == Some(node))?)))
        .collect();
    let (_, device, extents) = locate(c, pool, &objects[held[0].0].0, held[0].1).unwrap();
    OnOneNode {
        h,
        pool,
        objects,
        node,
        held,
        device,
        extents,
    }
}

/// Wait for `status` to show the health line of a node that opened past one damaged place.
fn wait_salvage_health_line(c: &Client, node: u32) {
    let want = format!("node {node} opened its store past 1 damaged place(s)");
    let t = Instant::now();
    loop {
        let st = c.status().unwrap();
        if st.health_detail.iter().any(|d| d.contains(&want)) {
            assert_eq!(st.health, "HEALTH_WARN", "{:?}", st.health_detail);
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no health line {want:?}: {:?}",
            st.health_detail
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A node is stopped cleanly and its store checkpointed offline (`store-tool checkpoint`, so
/// the next open replays no log: every object state it holds is in the checkpoint). Then a
/// bit flips in the records of the checkpoint's first batch, which here holds all of them (a
/// lost last batch is reported as `checkpoint-chain`: nothing after it could be read).
/// `store-tool fsck` names the place and exits 1. The node still starts (a lone
/// store would refuse): it reports what it lost, asks the primaries of all its PGs to scrub
/// (the lost batch cannot name all its objects), and recovery backfills every shard it held.
/// Each of them is back on the node, every object reads exact, and a scrub pass is clean.
#[test]
fn a_node_whose_checkpoint_rotted_while_down_opens_and_gets_backfilled() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let OnOneNode {
        h,
        pool,
        objects,
        node,
        held,
        device,
        ..
    } = objects_on_one_node("nvstore-ckrot-", "ck", 700);
    let c = &h.client;
    assert!(held.len() >= 3, "node {node} holds shards of {held:?}");
    let member = format!("node.{node}");
    h.lc.stop_member(&member, false).unwrap();

    let tool = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvstore"))
            .args(["store-tool", "--device", &device])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        println!(
            "store-tool {args:?}:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let (code, text) = tool(&["checkpoint"]);
    assert_eq!(code, Some(0), "{text}");
    let sb = superblock_of(&device);
    assert_ne!(sb.ckpt_segment.get(), store::format::NO_SEGMENT);
    assert_eq!(
        sb.ckpt_batches.get(),
        1,
        "a small store: one checkpoint batch"
    );
    let batch1 = store::format::SEGMENTS_START_BYTES
        + sb.ckpt_segment.get() as u64 * sb.segment_bytes.get() as u64
        + sb.block_size.get() as u64;
    flip_at(&device, batch1 + 64 + 200, 3);
    let (code, text) = tool(&["fsck"]);
    assert_eq!(code, Some(1), "fsck exits 1");
    assert!(
        text.contains(&format!("checkpoint-chain at byte offset {batch1}")),
        "{text}"
    );
    // Everything the store held was in that batch: what comes back below was rebuilt.
    assert!(text.contains("checked 0 objects"), "{text}");

    start_again(&h, node);
    let back = |&(i, s): &(usize, usize)| {
        let req = locate_request(pool, objects[i].0.as_bytes(), s as u8);
        c.node_call(node, wire::MSG_NODE_LOCATE, &req).is_ok()
    };
    let t = Instant::now();
    while !held.iter().all(back) {
        if t.elapsed() > Duration::from_secs(60) {
            let log = std::fs::read_to_string(h.lc.dir.join(format!("{member}.log")));
            for l in log
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("recover") || l.contains("salvage"))
            {
                println!("{member}: {l}");
            }
            let missing: Vec<_> = held.iter().filter(|x| !back(x)).collect();
            panic!("shards not back on node {node}: {missing:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "node {node}: all {} shards it held are back after {:.1} s",
        held.len(),
        t.elapsed().as_secs_f64()
    );
    let log = std::fs::read_to_string(h.lc.dir.join(format!("{member}.log"))).unwrap();
    for want in [
        format!("checkpoint-chain at byte offset {batch1}"),
        "asking nodes".to_string(),
    ] {
        assert!(log.contains(&want), "{member}.log lacks {want:?}");
    }
    // The operator hears of it: a gauge, and a health line until the node restarts clean.
    let places = c.perf_dump(node).unwrap()["node"]["salvaged_places"].as_u64();
    assert_eq!(places, Some(1));
    wait_salvage_health_line(c, node);
    for (name, data) in &objects {
        assert!(c.get(pool, name.as_bytes()).unwrap() == *data, "{name}");
    }
    let clean = scrub_pass(&h);
    assert_eq!(
        clean.crc_errors + clean.missing + clean.unrepairable,
        0,
        "{clean:?}"
    );
}

/// A node is stopped cleanly and a bit flips in the header of a log segment holding one of
/// its shards. `store-tool fsck` is not run (its salvage open would repair it). The node still
/// starts: its store rebuilds the header from the batches behind it, writes it back and
/// reports it, and nothing was lost. So no scrub is asked for and no mark dropped; every
/// shard the node held is there at once, every object reads exact, and the operator sees the
/// gauge and the health line. A plain open of the device afterwards is clean.
#[test]
fn a_node_whose_log_segment_header_rotted_while_down_rebuilds_it_and_loses_nothing() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let OnOneNode {
        h,
        pool,
        objects,
        node,
        held,
        device,
        extents,
    } = objects_on_one_node("nvstore-segrot-", "sg", 800);
    let c = &h.client;
    let member = format!("node.{node}");
    h.lc.stop_member(&member, false).unwrap();

    let sb = superblock_of(&device);
    let seg_bytes = sb.segment_bytes.get() as u64;
    let start = store::format::SEGMENTS_START_BYTES;
    let base = start + (extents[0].0 - start) / seg_bytes * seg_bytes;
    flip_at(&device, base + 30, 2);

    start_again(&h, node);
    let back = |&(i, s): &(usize, usize)| {
        let req = locate_request(pool, objects[i].0.as_bytes(), s as u8);
        c.node_call(node, wire::MSG_NODE_LOCATE, &req).is_ok()
    };
    let missing: Vec<_> = held.iter().filter(|x| !back(x)).collect();
    assert!(missing.is_empty(), "lost on node {node}: {missing:?}");
    let log = std::fs::read_to_string(h.lc.dir.join(format!("{member}.log"))).unwrap();
    let want = format!("segment-header at byte offset {base}");
    assert!(log.contains(&want), "{member}.log lacks {want:?}");
    assert!(
        !log.contains("asking nodes"),
        "nothing lost: no scrub to ask for"
    );
    let places = c.perf_dump(node).unwrap()["node"]["salvaged_places"].as_u64();
    assert_eq!(places, Some(1));
    wait_salvage_health_line(c, node);
    for (name, data) in &objects {
        assert!(c.get(pool, name.as_bytes()).unwrap() == *data, "{name}");
    }
    // Written back: a plain open of the device (the node stopped) finds nothing to salvage.
    h.lc.stop_member(&member, false).unwrap();
    let dev = driver::FileDevice::open(
        std::path::Path::new(&device),
        driver::FileOptions::default(),
    )
    .unwrap();
    let (s, r) = store::Store::open(dev, None, store::StoreConfig::default()).unwrap();
    assert!(r.salvaged.is_empty(), "{:?}", r.salvaged);
    drop(s);
}
