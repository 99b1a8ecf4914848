//! Hot objects on a real cluster (monitor and node processes of the built binary): many
//! clients reading one object get exact bytes and the primary's counters show the reads were
//! coalesced or cached; a writer among readers never lets a read go back in time or mix
//! versions; `nvstore status` names the hot object.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{bytes, Harness};
use nvstore::cluster_cmd::{render_status, LocalOptions};
use nvstore::monitor::{NodeStats, StatusReport};
use nvstore::placement::{pg_of, Acting};
use nvstore::Client;
use rand::{Rng, SeedableRng};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Independent client connections reading the hot object.
const READERS: usize = 24;
const READS_EACH: usize = 25;

fn cluster(o: LocalOptions) -> Harness {
    common::cluster(
        "nvstore-hot-test-",
        &LocalOptions {
            device_bytes: 512 << 20,
            ..o
        },
    )
}

fn primary_of(c: &Client, pool: u64, name: &[u8]) -> u32 {
    let map = c.map();
    let p = &map.pools[&pool];
    Acting::compute(&map, p, pg_of(p, name))
        .primary
        .expect("the PG has a primary")
}

/// Poll status until `done` holds (heartbeats are asynchronous).
fn status_until(c: &Client, what: &str, done: impl Fn(&StatusReport) -> bool) -> StatusReport {
    let t = Instant::now();
    loop {
        let s = c.status().unwrap();
        if done(&s) {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "status never showed {what}:\n{}",
            render_status(&s)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn node_stats(s: &StatusReport, node: u32) -> NodeStats {
    s.node_stats.get(&node).cloned().unwrap_or_default()
}

#[test]
fn concurrent_readers_are_coalesced_writes_are_never_missed_and_status_names_the_hot_object() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(LocalOptions {
        nodes: 8,
        heartbeat_ms: 250,
        ..LocalOptions::default()
    });
    let c = &h.client;
    let pool = c.create_pool("h", 6, 2, 64 << 10, 16, None).unwrap();
    let data = bytes(1, (1 << 20) + 3);
    c.put(pool, b"hot", &data).unwrap();
    let primary = primary_of(c, pool, b"hot");

    // Large reads of cold objects, one at a time, are never paced behind other replies (a
    // regression: pacing every large reply serialized a node's replies and stalled
    // sequential readers for seconds).
    let total =
        |s: &StatusReport, f: fn(&NodeStats) -> u64| -> u64 { s.node_stats.values().map(f).sum() };
    let s0 = c.status().unwrap();
    let cold = bytes(2, 300 << 10);
    for i in 0..8 {
        c.put(pool, format!("cold-{i}").as_bytes(), &cold).unwrap();
    }
    let ops0 = total(&c.status().unwrap(), |n| n.read_ops);
    for i in 0..8 {
        assert!(
            c.get_range(pool, format!("cold-{i}").as_bytes(), 0, 300 << 10)
                .unwrap()
                == cold
        );
    }
    let s1 = status_until(c, "the cold reads", |s| {
        total(s, |n| n.read_ops) >= ops0 + 8
    });
    assert_eq!(
        total(&s1, |n| n.paced_replies),
        total(&s0, |n| n.paced_replies),
        "a cold object's reply was paced"
    );
    // Each cold read is whole chunks on every member (a shard's last chunk ends where its
    // data does): the reply's CRC came from the members' chunk CRCs, no bytes summed. A range
    // that starts inside a stripe unit cuts a chunk: summed.
    assert_eq!(
        total(&s1, |n| n.crc_known_fetches),
        total(&s0, |n| n.crc_known_fetches) + 8,
        "whole-object reads of the cold objects"
    );
    let got = c.get_range(pool, b"cold-0", 1000, 200 << 10).unwrap();
    assert!(got == cold[1000..1000 + (200 << 10)]);
    let s2 = status_until(c, "the cut read", |s| total(s, |n| n.read_ops) >= ops0 + 9);
    assert_eq!(
        total(&s2, |n| n.crc_known_fetches),
        total(&s1, |n| n.crc_known_fetches),
        "a range that starts inside a chunk has no known crc"
    );
    let before = node_stats(&c.status().unwrap(), primary);

    // Many independent clients read the object at once: whole, in pieces, and via `get`
    // (a stat and a read in one op).
    let clients: Vec<Client> = (0..READERS)
        .map(|_| Client::from_config(&h.lc.client_config()).unwrap())
        .collect();
    let data_reads = AtomicU64::new(0);
    let ops = AtomicU64::new(0);
    std::thread::scope(|s| {
        for (t, rc) in clients.iter().enumerate() {
            let (data, data_reads, ops) = (&data, &data_reads, &ops);
            s.spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(t as u64);
                for i in 0..READS_EACH {
                    let (lo, hi) = match i % 5 {
                        0..=2 => (0, data.len()),
                        _ => {
                            let lo = rng.gen_range(0..data.len());
                            (lo, rng.gen_range(lo..=data.len()))
                        }
                    };
                    // `get` of an object this size is one op: a stat and a read together.
                    ops.fetch_add(1, SeqCst);
                    let got = if i % 5 == 2 {
                        rc.get(pool, b"hot").unwrap()
                    } else {
                        rc.get_range(pool, b"hot", lo as u64, (hi - lo) as u64)
                            .unwrap()
                    };
                    assert!(got == data[lo..hi], "reader {t} read {i}: [{lo}, {hi})");
                    if hi > lo {
                        data_reads.fetch_add(1, SeqCst);
                    }
                }
            });
        }
    });
    let reads = data_reads.load(SeqCst);
    // Every op's counters are final before its reply: a report counting all the ops has
    // all the fetches and absorbed reads.
    let ops_done = before.read_ops + ops.load(SeqCst);
    let s = status_until(c, "the readers' ops", |s| {
        node_stats(s, primary).read_ops >= ops_done
    });
    let after = node_stats(&s, primary);
    let fetches = after.read_fetches - before.read_fetches;
    let absorbed =
        (after.coalesced_reads - before.coalesced_reads) + (after.cache_hits - before.cache_hits);
    eprintln!(
        "{reads} data reads by {READERS} clients: {fetches} fetches, {} coalesced, {} cached, {} ops in batches",
        after.coalesced_reads - before.coalesced_reads,
        after.cache_hits - before.cache_hits,
        after.batched_ops - before.batched_ops
    );
    assert!(
        absorbed * 2 > reads && fetches * 2 < reads,
        "most of {reads} reads should share a fetch: {fetches} fetches, {absorbed} absorbed"
    );
    assert_eq!(
        fetches + absorbed,
        reads,
        "every data read is fetched or absorbed"
    );
    assert!(
        after.paced_replies > before.paced_replies,
        "the hot object's large replies are paced"
    );

    // Status names it while it is hot (within the detector's window).
    let s = status_until(c, "the hot object", |s| {
        s.hot_objects
            .iter()
            .any(|h| h.pool == pool && h.name == "hot")
    });
    let hot = s.hot_objects.iter().find(|h| h.name == "hot").unwrap();
    assert_eq!(hot.node, primary);
    assert!(hot.ops_s >= 5.0, "{hot:?}");
    assert!(
        (READERS as u32 / 2..=READERS as u32 * 2).contains(&hot.clients),
        "{READERS} clients estimated as {}",
        hot.clients
    );
    assert!(hot.coalesced_pct > 50.0, "{hot:?}");
    let text = render_status(&s);
    assert!(
        text.contains("hot objects:") && text.contains("h/hot: "),
        "{text}"
    );
    assert!(after.cpu_ns > 0 && after.msgr_iterations >= after.msgr_empty_iterations);
    assert!(after.msgr_iterations > 0, "{after:?}");

    // A writer among readers: each version is one byte pattern; a read returns one whole
    // version, never older than the last write acknowledged before the read was sent.
    const SIZE: usize = 200 << 10;
    const WRITES: u64 = 30;
    let pattern = |i: u64| -> Vec<u8> { i.to_le_bytes().repeat(SIZE / 8) };
    c.put(pool, b"mut", &pattern(0)).unwrap();
    let acked = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let checked = AtomicU64::new(0);
    let readers = &clients[..8];
    std::thread::scope(|s| {
        let (acked, done, checked) = (&acked, &done, &checked);
        s.spawn(move || {
            for i in 1..=WRITES {
                c.put(pool, b"mut", &pattern(i)).unwrap();
                acked.store(i, SeqCst);
            }
            done.store(true, SeqCst);
        });
        for (t, rc) in readers.iter().enumerate() {
            s.spawn(move || {
                let mut last = 0;
                loop {
                    let finished = done.load(SeqCst);
                    let floor = acked.load(SeqCst);
                    let got = rc.get_range(pool, b"mut", 0, SIZE as u64).unwrap();
                    assert_eq!(got.len(), SIZE, "reader {t}");
                    let v = u64::from_le_bytes(got[..8].try_into().unwrap());
                    assert!(
                        got == pattern(v),
                        "reader {t}: version {v} mixed with others"
                    );
                    assert!(
                        v >= floor,
                        "reader {t}: read {v} after {floor} was acknowledged"
                    );
                    assert!(v >= last, "reader {t}: went back from {last} to {v}");
                    last = v;
                    checked.fetch_add(1, SeqCst);
                    if finished {
                        break;
                    }
                }
            });
        }
    });
    assert!(
        checked.load(SeqCst) >= 8,
        "readers ran alongside the writer"
    );
    let end = c.get(pool, b"mut").unwrap();
    assert!(end == pattern(WRITES));

    // Reads of a cached object whose PG is idle are answered on the messenger worker that
    // received them (no op thread), and still see every acknowledged write at once.
    let p = primary_of(c, pool, b"mut");
    let inline = || {
        c.perf_dump(p).unwrap()["client"]["inline_reads"]
            .as_u64()
            .expect("perf dump has client.inline_reads")
    };
    let inline0 = inline();
    let mut cur = WRITES;
    for i in 0..40u64 {
        if i % 10 == 9 {
            cur += 1;
            c.put(pool, b"mut", &pattern(cur)).unwrap();
        }
        // A read sent the moment the previous reply arrives can find the op thread that
        // answered it still holding the PG (it lets go after replying): then it queues.
        std::thread::sleep(Duration::from_millis(2));
        let got = c.get_range(pool, b"mut", 0, SIZE as u64).unwrap();
        assert!(got == pattern(cur), "read {i} after write {cur}");
    }
    // All but the first read after each write (a fetch, on an op thread), give or take a
    // read that found the PG busy.
    let n = inline() - inline0;
    eprintln!("{n} of 40 sequential reads answered on the messenger worker");
    assert!((30..=40).contains(&n), "{n} of 40 reads answered inline");

    // A small object that is not hot: its bytes lie in the primary's own data shard, which
    // its store's read cache holds after the first read; later reads are answered on the
    // worker from there, and still see a write at once.
    let small = bytes(3, 4096);
    c.put(pool, b"small", &small).unwrap();
    let p = primary_of(c, pool, b"small");
    let inline0 = c.perf_dump(p).unwrap()["client"]["inline_reads"]
        .as_u64()
        .unwrap();
    for i in 0..10 {
        std::thread::sleep(Duration::from_millis(2));
        assert!(c.get(pool, b"small").unwrap() == small, "read {i}");
    }
    let small2 = bytes(4, 4096);
    c.put(pool, b"small", &small2).unwrap();
    assert!(
        c.get(pool, b"small").unwrap() == small2,
        "the write is seen"
    );
    let n = c.perf_dump(p).unwrap()["client"]["inline_reads"]
        .as_u64()
        .unwrap()
        - inline0;
    eprintln!("{n} of 11 reads of a small object answered on the messenger worker");
    assert!((7..=9).contains(&n), "{n} of 11 reads answered inline");
    eprintln!(
        "{} reads checked against {WRITES} writes",
        checked.load(SeqCst)
    );
}
