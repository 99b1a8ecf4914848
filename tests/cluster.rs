//! Cluster integration tests: real monitor and node processes (the built `nvstore` binary) on
//! loopback with file devices. Tests take a lock so only one cluster runs at a time on a
//! 2-core CI machine.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{bytes, counter, Harness};
use messenger::{Identity, OutMessage};
use nvstore::cluster_cmd::{render_status, LocalOptions};
use nvstore::ops::{ClientOp, OpResult, ReadData, SubOp};
use nvstore::wire::{self, Status};
use nvstore::{Client, Error};
use rand::{Rng, SeedableRng};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn cluster(nodes: u32, monitors: u32, o: LocalOptions) -> Harness {
    common::cluster(
        "nvstore-test-",
        &LocalOptions {
            nodes,
            monitors,
            device_bytes: 1 << 30,
            ..o
        },
    )
}

fn status_of(e: &Error) -> Option<Status> {
    match e {
        Error::Remote { status, .. } => Some(*status),
        _ => None,
    }
}

fn wait_down(c: &Client, ids: &[u32]) {
    let t = Instant::now();
    while ids.iter().any(|i| c.map().nodes[i].up) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "nodes {ids:?} never marked down"
        );
        let _ = c.refresh_map();
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn objects_of_every_size_ranges_overwrites_xattrs_and_compound_ops() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(8, 1, LocalOptions::default());
    let c = &h.client;
    let pool = c.create_pool("t", 6, 2, 64 << 10, 32, None).unwrap();
    let sizes = [0usize, 1, 4096, (4 << 20) + 1, 64 << 20];
    for (i, &n) in sizes.iter().enumerate() {
        let name = format!("size-{n}");
        let data = bytes(i as u64, n);
        // Every other size goes by the shared-buffer put (the data as its own frame part).
        let v = if i % 2 == 1 {
            c.put_shared(pool, name.as_bytes(), data.clone().into())
        } else {
            c.put(pool, name.as_bytes(), &data)
        }
        .unwrap();
        let st = c.stat(pool, name.as_bytes()).unwrap();
        assert_eq!((st.size, st.version), (n as u64, v), "{name}");
        assert!(
            c.get(pool, name.as_bytes()).unwrap() == data,
            "{name} reads back"
        );
    }
    // Random range reads (seeded).
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    for (i, &n) in sizes.iter().enumerate().skip(3) {
        let name = format!("size-{n}");
        let data = bytes(i as u64, n);
        for _ in 0..12 {
            let off = rng.gen_range(0..n as u64 + 10);
            let len = rng.gen_range(0..(3 << 20));
            let got = c.get_range(pool, name.as_bytes(), off, len).unwrap();
            let lo = (off as usize).min(n);
            let hi = (off as usize + len as usize).min(n);
            assert!(got == data[lo..hi], "{name} [{off}, +{len})");
            // The same range without a copy: a view into the received reply.
            let view = c.read(pool, name.as_bytes(), off, len).unwrap();
            assert!(*view == data[lo..hi], "{name} [{off}, +{len}) read");
            if hi > lo {
                assert!(matches!(view, ReadData::Received(_)), "{name}: not copied");
            }
        }
    }
    // Larger than one message: assembled, still every byte.
    let whole = c.read(pool, b"size-67108864", 0, 64 << 20).unwrap();
    assert!(*whole == bytes(4, 64 << 20), "64 MiB read");
    // Overwrites at offsets, against a model.
    let name = b"overwrite";
    let mut model = bytes(99, (1 << 20) + 3);
    c.put(pool, name, &model).unwrap();
    let unit = 64 << 10;
    let writes: Vec<(usize, usize)> = vec![
        (0, 100),                      // one data shard: parity delta
        (12 * unit + unit + 10, 1000), // inside shard 1 of stripe 2: parity delta
        (6 * unit - 3, 10),            // across a stripe boundary
        (unit * 2 + 5, 3 * unit),      // several units
        (model.len() - 1, 5),          // grows the object
        (model.len() + 200_000, 17),   // leaves a zero gap
    ];
    for (k, (off, len)) in writes.into_iter().enumerate() {
        let d = bytes(1000 + k as u64, len);
        c.write(pool, name, off as u64, &d).unwrap();
        if model.len() < off + len {
            model.resize(off + len, 0);
        }
        model[off..off + len].copy_from_slice(&d);
        assert!(
            c.get(pool, name).unwrap() == model,
            "after overwrite {k} at {off}"
        );
    }
    c.append(pool, name, b"tail").unwrap();
    model.extend_from_slice(b"tail");
    assert!(c.get(pool, name).unwrap() == model);
    // A write at an offset creates a missing object.
    c.write(pool, b"sparse", 10, b"x").unwrap();
    assert_eq!(c.get(pool, b"sparse").unwrap(), b"\0\0\0\0\0\0\0\0\0\0x");
    // Xattrs.
    c.set_xattr(pool, name, "color", b"blue").unwrap();
    c.set_xattr(pool, name, "size", b"L").unwrap();
    assert_eq!(c.get_xattr(pool, name, "color").unwrap(), b"blue");
    c.rm_xattr(pool, name, "size").unwrap();
    assert_eq!(
        c.xattrs(pool, name).unwrap(),
        vec![("color".to_string(), b"blue".to_vec())]
    );
    let e = c.get_xattr(pool, name, "size").unwrap_err();
    assert_eq!(status_of(&e), Some(Status::NoXattr), "{e}");
    // Xattrs survive a write_full and data survives xattr updates.
    c.put(pool, name, b"new").unwrap();
    assert_eq!(c.get_xattr(pool, name, "color").unwrap(), b"blue");
    // Compound: assert-version + read + stat, atomically.
    let v = c.stat(pool, name).unwrap().version;
    let (v2, r) = c
        .op(
            pool,
            name,
            &[
                SubOp::AssertVersion(v),
                SubOp::Read { offset: 1, len: 2 },
                SubOp::Stat,
            ],
        )
        .unwrap();
    assert_eq!(v2, v);
    assert_eq!(r[0], OpResult::Data(b"ew".to_vec().into()));
    assert!(matches!(r[1], OpResult::Stat(s) if s.size == 3 && s.version == v));
    let e = c
        .op(
            pool,
            name,
            &[SubOp::AssertVersion(v + 1), SubOp::WriteFull(b"no")],
        )
        .unwrap_err();
    assert_eq!(status_of(&e), Some(Status::VersionMismatch), "{e}");
    assert_eq!(
        c.get(pool, name).unwrap(),
        b"new",
        "a failed compound op changes nothing"
    );
    let e = c
        .op(pool, b"absent", &[SubOp::AssertExists, SubOp::Stat])
        .unwrap_err();
    assert_eq!(status_of(&e), Some(Status::NotFound));
    // Remove, then list.
    c.remove(pool, b"sparse").unwrap();
    assert_eq!(
        status_of(&c.stat(pool, b"sparse").unwrap_err()),
        Some(Status::NotFound)
    );
    assert_eq!(
        status_of(&c.remove(pool, b"sparse").unwrap_err()),
        Some(Status::NotFound)
    );
    let names: Vec<String> = c
        .list(pool)
        .unwrap()
        .into_iter()
        .map(|(n, _)| String::from_utf8(n).unwrap())
        .collect();
    let mut want: Vec<String> = sizes.iter().map(|n| format!("size-{n}")).collect();
    want.push("overwrite".into());
    want.sort();
    assert_eq!(names, want);
}

#[test]
fn concurrent_writers_on_one_object_see_one_linear_history() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(8, 1, LocalOptions::default());
    let c = &h.client;
    let pool = c.create_pool("t", 6, 2, 64 << 10, 16, None).unwrap();
    c.put(pool, b"counter", b"0").unwrap();
    let threads = 6;
    let per = 15;
    let acked: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut done = 0;
                while done < per {
                    // Read-modify-write with compare-and-swap on the version.
                    let (v, r) = c
                        .op(pool, b"counter", &[SubOp::Read { offset: 0, len: 64 }])
                        .unwrap();
                    let OpResult::Data(d) = &r[0] else { panic!() };
                    let n: u64 = std::str::from_utf8(d).unwrap().parse().unwrap();
                    let next = (n + 1).to_string();
                    match c.op(
                        pool,
                        b"counter",
                        &[SubOp::AssertVersion(v), SubOp::WriteFull(next.as_bytes())],
                    ) {
                        Ok((nv, _)) => {
                            assert!(nv > v);
                            acked.lock().unwrap().push((nv, n + 1));
                            done += 1;
                        }
                        Err(e) => assert_eq!(status_of(&e), Some(Status::VersionMismatch), "{e}"),
                    }
                }
            });
        }
    });
    let mut acked = acked.into_inner().unwrap();
    acked.sort();
    // One linear history: versions strictly increase exactly as the counter does.
    for (i, (_, n)) in acked.iter().enumerate() {
        assert_eq!(*n, i as u64 + 1, "history {acked:?}");
    }
    let final_v: u64 = String::from_utf8(c.get(pool, b"counter").unwrap())
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(final_v, (threads * per) as u64);
    // Blind concurrent write_fulls: the last version's content wins.
    let results: Mutex<Vec<(u64, Vec<u8>)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let results = &results;
            s.spawn(move || {
                for i in 0..10 {
                    let d = bytes(t * 100 + i, 5000 + (t * 100 + i) as usize);
                    let v = c.put(pool, b"blind", &d).unwrap();
                    results.lock().unwrap().push((v, d));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|r| r.0);
    results
        .windows(2)
        .for_each(|w| assert!(w[0].0 < w[1].0, "versions are unique"));
    assert!(c.get(pool, b"blind").unwrap() == results.last().unwrap().1);
}

#[test]
fn kill_two_nodes_mid_workload_every_acknowledged_write_reads_back() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(
        8,
        1,
        LocalOptions {
            down_grace_ms: 2000,
            write_wait_ms: 2000,
            ..LocalOptions::default()
        },
    );
    let c = &h.client;
    let pool = c.create_pool("t", 6, 2, 64 << 10, 32, None).unwrap();
    let acked: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());
    let failed: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (acked, failed, stop) = (&acked, &failed, &stop);
            s.spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let seed = t * 1_000_000 + i;
                    let len = [4096usize, 70_000, 400_000, 1][(i % 4) as usize];
                    let name = format!("w{t}-{i}");
                    match c.put(pool, name.as_bytes(), &bytes(seed, len)) {
                        Ok(_) => acked.lock().unwrap().push((name, seed)),
                        Err(_) => failed.lock().unwrap().push((name, seed)),
                    }
                    i += 1;
                }
            });
        }
        std::thread::sleep(Duration::from_millis(1500));
        h.lc.stop_member("node.2", true).unwrap();
        h.lc.stop_member("node.5", true).unwrap();
        std::thread::sleep(Duration::from_millis(3000));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    wait_down(c, &[2, 5]);
    let acked = acked.into_inner().unwrap();
    let failed = failed.into_inner().unwrap();
    assert!(acked.len() > 20, "workload ran: {} acked", acked.len());
    let len_of = |name: &str| {
        let i: u64 = name.rsplit('-').next().unwrap().parse().unwrap();
        [4096usize, 70_000, 400_000, 1][(i % 4) as usize]
    };
    for (name, seed) in &acked {
        let got = c
            .get(pool, name.as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            got == bytes(*seed, len_of(name)),
            "{name} reads back intact (degraded)"
        );
    }
    let mut invisible = 0;
    for (name, seed) in &failed {
        match c.get(pool, name.as_bytes()) {
            Ok(got) => assert!(
                got == bytes(*seed, len_of(name)),
                "{name}: an unacknowledged write is all or nothing"
            ),
            Err(e) => {
                assert!(
                    matches!(status_of(&e), Some(Status::NotFound | Status::Unavailable)),
                    "{name}: {e}"
                );
                invisible += 1;
            }
        }
    }
    eprintln!(
        "{} acknowledged, {} failed ({invisible} invisible)",
        acked.len(),
        failed.len()
    );
    // The nodes come back; everything still reads.
    h.lc.start_member("node.2").unwrap();
    h.lc.start_member("node.5").unwrap();
    h.lc.wait_nodes_up(c, 8, Instant::now() + Duration::from_secs(60))
        .unwrap();
    for (name, seed) in acked.iter().step_by(5) {
        assert!(c.get(pool, name.as_bytes()).unwrap() == bytes(*seed, len_of(name)));
    }
}

#[test]
fn bad_input_gets_clear_errors_and_the_node_keeps_serving() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(8, 1, LocalOptions::default());
    let c = &h.client;
    let pool = c.create_pool("t", 6, 2, 64 << 10, 8, None).unwrap();
    let e = c.put(999, b"x", b"y").unwrap_err();
    assert_eq!(status_of(&e), Some(Status::NoSuchPool), "{e}");
    let e = c.put(pool, &vec![b'n'; 1001], b"y").unwrap_err();
    assert_eq!(status_of(&e), Some(Status::Invalid), "{e}");
    // Raw requests straight to a node, bypassing the client's checks.
    let m = h.raw_messenger(Identity::Client(4242));
    let map = c.map();
    let node = &map.nodes[&1];
    let conn = m.connect(node.addr, Identity::Node(1)).unwrap();
    let ask = |t: u16, payload: Vec<u8>| -> (Status, String) {
        let r = conn
            .request(OutMessage::new(t, payload), Duration::from_secs(10))
            .unwrap();
        match wire::parse_reply(&r.payload) {
            Ok(_) => (Status::Ok, String::new()),
            Err(Error::Remote { status, message }) => (status, message),
            Err(e) => panic!("{e}"),
        }
    };
    let long_name = vec![b'a'; 5000];
    let op = |name: &[u8], pool: u64| {
        ClientOp {
            epoch: map.epoch,
            pool,
            name,
            flags: 0,
            upload_id: 0,
            reqid: 0,
            ops: vec![SubOp::Stat],
        }
        .encode()
    };
    let (s, msg) = ask(wire::MSG_CLIENT_OP, op(&long_name, pool));
    assert!(
        matches!(s, Status::Invalid | Status::WrongPrimary),
        "{s}: {msg}"
    );
    let (s, msg) = ask(wire::MSG_CLIENT_OP, op(b"x", 12345));
    assert_eq!(s, Status::NoSuchPool, "{msg}");
    let (s, msg) = ask(wire::MSG_CLIENT_OP, vec![1, 2, 3]);
    assert_eq!(s, Status::Malformed, "{msg}");
    let mut bad = op(b"x", pool);
    bad.truncate(bad.len() - 1);
    let (s, msg) = ask(wire::MSG_CLIENT_OP, bad);
    assert!(
        matches!(s, Status::Malformed | Status::WrongPrimary),
        "{s}: {msg}"
    );
    let mut junk = op(b"x", pool);
    let at = junk.len() - 1;
    junk[at] = 250; // unknown sub-op code
    let (s, msg) = ask(wire::MSG_CLIENT_OP, junk);
    assert!(
        matches!(s, Status::Malformed | Status::WrongPrimary),
        "{s}: {msg}"
    );
    let (s, msg) = ask(wire::MSG_SHARD_WRITE, vec![0; 64]);
    assert_eq!(
        s,
        Status::Invalid,
        "shard ops are refused from clients: {msg}"
    );
    let (s, msg) = ask(777, vec![]);
    assert_eq!(s, Status::Malformed, "{msg}");
    // The node still serves.
    c.put(pool, b"still-here", b"yes").unwrap();
    assert_eq!(c.get(pool, b"still-here").unwrap(), b"yes");
    assert!(c.map().nodes.values().all(|n| n.up));
    m.shutdown();
}

#[test]
fn three_monitors_keep_the_map_served_and_writable_when_the_leader_dies() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(
        4,
        3,
        LocalOptions {
            down_grace_ms: 2000,
            out_grace_ms: 3000,
            ..LocalOptions::default()
        },
    );
    let c = &h.client;
    let pool = c.create_pool("t", 2, 1, 64 << 10, 8, None).unwrap();
    c.put(pool, b"before", b"1").unwrap();
    let leader = c.status().unwrap().leader.expect("a leader");
    h.lc.stop_member(&format!("mon.{leader}"), true).unwrap();
    // Served: status and the map from a surviving monitor; writable: a new pool, a node death.
    let t = Instant::now();
    let s = loop {
        match c.status() {
            Ok(s) if s.leader.is_some_and(|l| l != leader) => break s,
            _ if t.elapsed() > Duration::from_secs(30) => panic!("no new leader"),
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    assert_ne!(s.leader, Some(leader));
    let p2 = c.create_pool("after", 2, 1, 64 << 10, 8, None).unwrap();
    assert!(p2 > pool);
    c.put(p2, b"after", b"2").unwrap();
    assert_eq!(c.get(pool, b"before").unwrap(), b"1");
    h.lc.stop_member("node.4", true).unwrap();
    wait_down(c, &[4]);
    assert_eq!(c.get(p2, b"after").unwrap(), b"2");
    // Down long enough, it is marked out: its PGs remap to the three nodes left, objects
    // still read (from the shards that stayed) and writes go to the new members.
    let t = Instant::now();
    while c.map().nodes[&4].r#in {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "node.4 never marked out"
        );
        let _ = c.refresh_map();
        std::thread::sleep(Duration::from_millis(100));
    }
    let m = c.map();
    let p = &m.pools[&p2];
    let a = nvstore::placement::Acting::compute(&m, p, nvstore::placement::pg_of(p, b"after"));
    assert!(!a.members.contains(&Some(4)) && a.members.iter().all(|s| s.is_some()));
    assert_eq!(c.get(p2, b"after").unwrap(), b"2");
    c.put(p2, b"after-out", b"3").unwrap();
    assert_eq!(c.get(p2, b"after-out").unwrap(), b"3");
    c.write(p2, b"after", 1, b"+").unwrap();
    assert_eq!(c.get(p2, b"after").unwrap(), b"2+");
}

/// A mutation resent with the same request id (its reply lost, or the client gave up
/// waiting) is answered with the version it made, not applied again: an append resent lands
/// once. Without a request id, the same append sent twice lands twice.
#[test]
fn a_resent_append_with_the_same_request_id_is_applied_once() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(4, 1, LocalOptions::default());
    let c = &h.client;
    let pool = c.create_pool("t", 2, 1, 4096, 8, None).unwrap();
    c.put(pool, b"log", b"start;").unwrap();
    c.put(pool, b"log2", b"start;").unwrap();
    let m = h.raw_messenger(Identity::Client(4343));
    let append = |name: &[u8], reqid: u64| h.raw_append(&m, pool, name, reqid).1;
    let v1 = append(b"log", 77);
    let v2 = append(b"log", 77);
    assert_eq!(v1, v2, "the resend reports the version the first send made");
    assert_eq!(c.get(pool, b"log").unwrap(), b"start;entry;");
    assert_eq!(c.stat(pool, b"log").unwrap().version, v1);
    // A new request id is a new op.
    assert!(append(b"log", 78) > v1);
    assert_eq!(c.get(pool, b"log").unwrap(), b"start;entry;entry;");
    // No request id: no dedup.
    let w1 = append(b"log2", 0);
    let w2 = append(b"log2", 0);
    assert!(w2 > w1);
    assert_eq!(c.get(pool, b"log2").unwrap(), b"start;entry;entry;");
    // A resend after 300 more writes to its object and PG (past the object's history of 8
    // and past 256 per PG) but within the primary's time window: still answered, not applied.
    let v = append(b"log", 5_000);
    for r in 0..300u64 {
        append(b"log", 6_000 + r);
    }
    assert_eq!(append(b"log", 5_000), v);
    let want = format!("start;{}", "entry;".repeat(2 + 1 + 300));
    assert!(c.get(pool, b"log").unwrap() == want.as_bytes());
    m.shutdown();
}

/// `pool delete`: the pool's objects are gone for clients at once; every node removes its
/// keys of it — a node that was down meanwhile once it is back — and nothing else: another
/// pool's objects and keys stay; a later pool never gets the deleted pool's id, so nothing
/// left of it can be taken for the new pool's objects.
#[test]
fn a_deleted_pools_keys_go_from_every_node_and_its_id_is_never_reused() {
    use common::{counter, store_sum, wait_until};
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // k + m = 4 nodes: every node holds a shard of every object.
    let h = cluster(4, 1, LocalOptions::default());
    let c = &h.client;
    let clean = |s: &nvstore::monitor::StatusReport| {
        s.pg_states.keys().all(|k| k == "active+clean") && s.recovery.objects_left == 0
    };
    let kept = c.create_pool("kept", 2, 2, 4096, 8, None).unwrap();
    let keep = common::put_objects(c, kept, "k", 1, 12);
    common::wait_recovered(c, clean);
    let nodes = [1u32, 2, 3, 4];
    let keys = |n: u32| store_sum(c, n, "objects");
    let before: Vec<u64> = nodes.iter().map(|n| keys(*n)).collect();
    let gone = c.create_pool("gone", 2, 2, 4096, 8, None).unwrap();
    let objs = common::put_objects(c, gone, "g", 100, 30);
    common::wait_recovered(c, clean);
    let with: Vec<u64> = nodes.iter().map(|n| keys(*n)).collect();
    for i in 0..4 {
        // 30 shards, their PG log entries, the PGs' recovery marks.
        assert!(
            with[i] >= before[i] + 60,
            "node {}: {with:?} {before:?}",
            i + 1
        );
    }
    let victim = 4u32;
    h.kill_nodes(&[victim]);
    c.delete_pool("gone").unwrap();
    assert!(c.map().pool_by_name("gone").is_none());
    let e = c.get(gone, objs[0].0.as_bytes()).unwrap_err();
    assert_eq!(status_of(&e), Some(Status::NoSuchPool), "{e}");
    assert!(c.list(gone).is_err());
    let e = c.delete_pool("gone").unwrap_err();
    assert!(e.to_string().contains("no pool \"gone\""), "{e}");
    let up = &nodes[..3];
    wait_until(
        "the up nodes to remove their keys of the deleted pool",
        || {
            up.iter()
                .all(|n| counter(c, *n, "recovery", "deleted_pool_keys_removed") > 0)
                && up.iter().all(|n| keys(*n) == before[*n as usize - 1])
        },
    );
    for n in up {
        let i = *n as usize - 1;
        assert_eq!(
            counter(c, *n, "recovery", "deleted_pool_keys_removed"),
            with[i] - before[i],
            "node {n}: exactly its keys of the deleted pool"
        );
        assert_eq!(counter(c, *n, "recovery", "deleted_pools_left"), 0);
    }
    // `nvstore status` hears of it in the heartbeats: nothing left to remove, and the keys.
    let reported = |n: u32| {
        let s = c.status().unwrap();
        let st = &s.node_stats[&n];
        (st.deleting_pools.clone(), st.deleted_pool_keys)
    };
    wait_until("the heartbeats to report the removal", || {
        up.iter().all(|n| {
            let i = *n as usize - 1;
            reported(*n) == (vec![], with[i] - before[i])
        })
    });
    assert!(!render_status(&c.status().unwrap()).contains("delete:"));

    // The node that was down comes back with its keys of the deleted pool and removes them.
    h.lc.start_member(&format!("node.{victim}")).unwrap();
    common::wait_up(c, victim, true);
    wait_until(
        "the node back to remove its keys of the deleted pool",
        || keys(victim) == before[3],
    );
    assert_eq!(
        counter(c, victim, "recovery", "deleted_pool_keys_removed"),
        with[3] - before[3]
    );
    common::wait_recovered(c, clean);

    // A new pool of the same name is a new pool: a new id, none of the old objects.
    let again = c.create_pool("gone", 2, 2, 4096, 8, None).unwrap();
    assert_eq!(again, gone + 1);
    assert!(c.list(again).unwrap().is_empty());
    let e = c.get(again, objs[0].0.as_bytes()).unwrap_err();
    assert_eq!(status_of(&e), Some(Status::NotFound), "{e}");
    common::read_all(c, kept, &keep);
    assert_eq!(c.list(kept).unwrap().len(), keep.len());
}

/// Client-side EC: a whole object of 1 MiB or more is encoded by the client and its shards
/// staged on the members; the primary only names them. The shards must be what the primary
/// would have made — read back whole, and degraded with two data shards' nodes dead (the
/// client's parity decodes them) — and a write whose member lost its staged shard goes
/// through the primary instead, every byte intact.
#[test]
fn client_encoded_writes_read_back_whole_and_degraded_and_fall_back_when_a_shard_is_lost() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(8, 1, LocalOptions::default());
    let c = &h.client;
    let pool = c.create_pool("cec", 6, 2, 64 << 10, 16, None).unwrap();
    let sum =
        |group: &str, name: &str| -> u64 { (1..=8).map(|n| counter(c, n, group, name)).sum() };
    // Whole stripes, a short last stripe, one byte past a stripe, and larger than one message.
    let sizes = [
        1usize << 20,
        (4 << 20) + 1,
        (3 << 20) + 12_345,
        (17 << 20) + 7,
    ];
    let objs: Vec<(String, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (format!("cec-{i}"), bytes(500 + i as u64, n)))
        .collect();
    for (i, (name, d)) in objs.iter().enumerate() {
        let v = if i % 2 == 0 {
            c.put_shared(pool, name.as_bytes(), d.clone().into())
        } else {
            c.put(pool, name.as_bytes(), d)
        }
        .unwrap();
        assert_eq!(c.stat(pool, name.as_bytes()).unwrap().version, v);
    }
    assert_eq!(
        c.client_ec_stats(),
        (4, 0),
        "every put encoded by the client"
    );
    assert_eq!(sum("client", "writes_client_encoded"), 4);
    assert_eq!(sum("node", "staged_shards_taken"), 4 * 8);
    assert_eq!(sum("node", "staged_shards_missing"), 0);
    common::read_all(c, pool, &objs);

    // A member that lost the shard staged on it (as if it restarted in between): the write
    // waits there for the shard (it could still be on its way), fails, and the client sends
    // the data to the primary.
    let map = c.map();
    let info = &map.pools[&pool];
    let (name, data) = (b"lost-stage", bytes(77, (2 << 20) + 5));
    let members_of = |name: &[u8]| {
        nvstore::placement::pg_members(&map, info, nvstore::placement::pg_of(info, name))
    };
    let members = members_of(name);
    let victim = members[3].expect("every slot has a member");
    c.config(victim, Some(("inject_drop_staged", "true")))
        .unwrap();
    c.put(pool, name, &data).unwrap();
    assert_eq!(c.client_ec_stats(), (4, 1), "the put fell back");
    assert!(counter(c, victim, "node", "staged_shards_missing") >= 1);
    assert!(counter(c, victim, "node", "staged_shards_expired") >= 1);
    assert_eq!(
        counter(c, victim, "node", "staged_shard_wait_timeouts"),
        1,
        "the write waited for the shard the victim never heard of"
    );
    assert!(c.get(pool, name).unwrap() == data);
    c.config(victim, Some(("inject_drop_staged", "false")))
        .unwrap();
    // A member that refused the stage (the client over its staging budget there): the write
    // fails at once rather than waiting for a shard that will not come, and falls back.
    let (name, data) = (b"refused-stage", bytes(78, (3 << 20) + 9));
    let refuser = members_of(name)[5].expect("every slot has a member");
    let timeouts_before = counter(c, refuser, "node", "staged_shard_wait_timeouts");
    c.config(refuser, Some(("staged_bytes_max", "0"))).unwrap();
    c.put(pool, name, &data).unwrap();
    assert_eq!(c.client_ec_stats(), (4, 2), "the put fell back");
    assert_eq!(counter(c, refuser, "node", "staged_shards_refused"), 1);
    assert!(counter(c, refuser, "node", "staged_shards_missing") >= 1);
    assert_eq!(
        counter(c, refuser, "node", "staged_shard_wait_timeouts"),
        timeouts_before,
        "a refused shard is not waited for"
    );
    assert!(c.get(pool, name).unwrap() == data);
    let e = c
        .config(refuser, Some(("staged_bytes_max", "lots")))
        .unwrap_err();
    assert!(e.to_string().contains("expected bytes"), "{e}");
    c.config(refuser, Some(("staged_bytes_max", "268435456")))
        .unwrap();
    // Staged writes that do not add up: clear errors, nothing written.
    let staged = |size: u64, members: Vec<Option<u32>>| {
        let e = c
            .op(pool, b"bad-staged", &[SubOp::WriteStaged { size, members }])
            .unwrap_err();
        (status_of(&e), e.to_string())
    };
    let bad = members_of(b"bad-staged");
    let (st, e) = staged(5 << 20, vec![Some(1)]);
    assert_eq!(st, Some(Status::Invalid), "{e}");
    assert!(e.contains("lists 1 members"), "{e}");
    let (st, e) = staged(65 << 20, bad.clone());
    assert_eq!(st, Some(Status::TooLarge), "{e}");
    let (st, e) = staged(5 << 20, bad);
    assert_eq!(st, Some(Status::NotStaged), "never staged: {e}");
    let e = c.stat(pool, b"bad-staged").unwrap_err();
    assert_eq!(status_of(&e), Some(Status::NotFound), "{e}");
    assert_eq!(
        sum("client", "writes_client_encoded"),
        4,
        "the fallback was not counted as client-encoded"
    );

    // Degraded: kill the nodes of two data slots of cec-1; every object still reads (the
    // client's parity makes up for the missing data shards).
    let members = members_of(b"cec-1");
    let dead = [members[0].unwrap(), members[4].unwrap()];
    h.kill_nodes(&dead);
    common::read_all(c, pool, &objs);
    assert!(c.get(pool, name).unwrap() == data);
}

/// A cluster whose devices fill up refuses the write that does not fit with `NoSpace` and the
/// full device named — at once, not after waiting for min_size and then calling it degraded —
/// keeps serving everything it acknowledged (`bench write` stops there and says why), takes
/// removes of objects and writes in the space they free, and takes writes again once the full
/// pool is deleted.
#[test]
fn a_full_cluster_refuses_writes_with_no_space_keeps_serving_and_recovers_when_its_pool_goes() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = common::cluster(
        "nvstore-test-",
        &LocalOptions {
            device_bytes: 96 << 20,
            ..LocalOptions::default()
        },
    );
    let c = &h.client;
    let pool = c.create_pool("full", 6, 2, 64 << 10, 8, None).unwrap();
    // 8 devices of 96 MiB hold well under 600 MiB of 6+2 coded data.
    let mut kept: Vec<(String, Vec<u8>)> = Vec::new();
    let err = loop {
        let i = kept.len();
        assert!(i < 600, "600 MiB written and nothing filled");
        let name = format!("fill-{i}");
        let data = bytes(7000 + i as u64, 1 << 20);
        match c.put(pool, name.as_bytes(), &data) {
            Ok(_) => kept.push((name, data)),
            Err(e) => break e,
        }
    };
    assert_eq!(status_of(&err), Some(Status::NoSpace), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("out of space") && msg.contains("dev0.img"),
        "the error names the full device: {msg}"
    );
    assert!(kept.len() > 50, "filled after only {} MiB", kept.len());
    // Everything acknowledged reads back, and the nodes still answer.
    common::read_all(c, pool, &kept);
    let st = c.status().unwrap();
    assert_eq!(st.nodes_up, 8, "{}", render_status(&st));
    // `bench write` on the full pool stops at the first "out of space" and says so, instead
    // of failing writes as fast as it can for the rest of its 60 s.
    let r = nvstore::bench_cluster::bench(
        c,
        pool,
        nvstore::bench_cluster::Mode::Write,
        1 << 20,
        4,
        60,
        false,
    )
    .unwrap();
    let why = r.stopped_full.as_deref().unwrap_or_default();
    assert!(why.contains("out of space"), "{r:?}");
    assert!(r.seconds < 60.0 && r.errors > 0, "{r:?}");
    // The full cluster takes removes of objects (each member keeps a removed shard's bytes
    // under its tombstone, writing no copy of them, until the primary settles the remove and
    // they go), and the space a third of them frees takes writes again.
    let (gone, kept) = kept.split_at(kept.len() / 3);
    for (name, _) in gone {
        c.remove(pool, name.as_bytes())
            .unwrap_or_else(|e| panic!("remove of {name} on the full cluster: {e}"));
    }
    let data = bytes(9000, 1 << 20);
    common::wait_ok("a write that fits once objects are removed", || {
        c.put(pool, b"after-removes", &data)
    });
    assert!(c.get(pool, b"after-removes").unwrap() == data);
    for (name, _) in gone {
        let e = c.get(pool, name.as_bytes()).unwrap_err();
        assert_eq!(status_of(&e), Some(Status::NotFound), "{name}: {e}");
    }
    common::read_all(c, pool, kept);
    // Deleting the pool gives the space back (its keys' removes are taken even by a store
    // below the floor it keeps for writes): a new pool takes writes again.
    c.delete_pool("full").unwrap();
    let again = c.create_pool("again", 6, 2, 64 << 10, 8, None).unwrap();
    let data = bytes(8000, 1 << 20);
    common::wait_ok("a write that fits once the full pool is deleted", || {
        c.put(again, b"after", &data)
    });
    assert!(c.get(again, b"after").unwrap() == data);
}
