//! Network partitions: real monitor and node processes, each in a network namespace of its
//! own on one bridge (`LocalOptions::netns`, `src/netns.rs`). Cutting a member's cable leaves
//! its process running, its connections open and hanging and its state in memory — what a
//! switch port or a cable failing does, which killing the process cannot show. Needs root and
//! iproute2 (`scripts/deps`); where no namespace can be made, each test says so and does
//! nothing (`scripts/test` prints whether they can run).

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{
    bytes, counter, put_objects, read_all, wait_recovered, wait_until, wait_up, Harness, WAIT,
};
use nvstore::cluster_cmd::LocalOptions;
use nvstore::config::{write_toml, ClientConfig, MonitorConfig};
use nvstore::monitor::StatusReport;
use nvstore::placement::{pg_of, Acting};
use nvstore::Client;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN): where one cannot be made,
/// say so instead of failing. `scripts/test` prints which case a run is in.
fn privileged() -> bool {
    // Once per process: the tests of this binary start together.
    static MADE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let made = *MADE.get_or_init(|| {
        let probe = format!("nvs-probe-{}", std::process::id());
        let made = std::process::Command::new("ip")
            .args(["netns", "add", &probe])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if made {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &probe])
                .status();
        }
        made
    });
    if !made {
        eprintln!("skipped: cannot make a network namespace here (needs root and iproute2)");
    }
    made
}

/// One test's cluster, and the lock that keeps the tests one at a time (dropped after the
/// cluster: fields drop in order).
struct Setup {
    h: Harness,
    _one: std::sync::MutexGuard<'static, ()>,
}

/// The cluster for one test; `None` (having said why) where no namespace can be made.
fn setup(nodes: u32, monitors: u32) -> Option<Setup> {
    setup_with(nodes, monitors, LocalOptions::default().out_grace_ms)
}

fn setup_with(nodes: u32, monitors: u32, out_grace_ms: u64) -> Option<Setup> {
    if !privileged() {
        return None;
    }
    let one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    Some(Setup {
        h: cluster(nodes, monitors, out_grace_ms),
        _one: one,
    })
}

fn cluster(nodes: u32, monitors: u32, out_grace_ms: u64) -> Harness {
    common::cluster(
        "nvstore-partition-test-",
        &LocalOptions {
            nodes,
            monitors,
            device_bytes: 256 << 20,
            down_grace_ms: 1500,
            out_grace_ms,
            heartbeat_ms: 200,
            op_threads: 4,
            netns: true,
            ..LocalOptions::default()
        },
    )
}

fn put(c: &Client, pool: u64, name: &str, seed: u64, len: usize) -> (String, Vec<u8>) {
    let d = bytes(seed, len);
    c.put(pool, name.as_bytes(), &d)
        .unwrap_or_else(|e| panic!("put {name}: {e}"));
    (name.to_string(), d)
}

/// An outage on 8 nodes: a 6 + 2 pool (every PG has every node, so every write while a node
/// is away misses its shard) holding `n` objects, every PG's first recovery pass done (the
/// members carry their marks); the victim is the primary of `before-1`.
struct Outage {
    pool: u64,
    objects: Vec<(String, Vec<u8>)>,
    victim: u32,
    member: String,
}

impl Outage {
    fn new(c: &Client, n: usize) -> Outage {
        let pool = c.create_pool("d", 6, 2, 4096, 16, None).unwrap();
        let objects = put_objects(c, pool, "before", 0, n);
        wait_recovered(c, |_| true);
        let map = c.map();
        let p = &map.pools[&pool];
        let victim = Acting::compute(&map, p, pg_of(p, b"before-1"))
            .primary
            .unwrap();
        Outage {
            pool,
            objects,
            victim,
            member: format!("node.{victim}"),
        }
    }

    /// With the victim away: `missed` new objects, then everything reads back.
    fn write_meanwhile(&mut self, h: &Harness, missed: u64) {
        let c = &h.client;
        for i in 0..missed {
            let name = format!("meanwhile-{i}");
            let len = 3000 + 7919 * i as usize;
            self.objects.push(put(c, self.pool, &name, 2000 + i, len));
        }
        read_all(c, self.pool, &self.objects);
        assert!(
            h.lc.is_running(&self.member),
            "{} exited while away",
            self.member
        );
    }

    /// The victim's network is back: it is marked up and caught up by delta from the PG
    /// logs (at least `caught_up` objects, no backfill, no failure) without a restart; then
    /// two other nodes die and every object reads back byte-exact — six nodes of eight with
    /// k = 6, so that needs the victim's shards. Returns the recovery status.
    fn caught_up_then_needed(&self, h: &Harness, caught_up: u64) -> StatusReport {
        let c = &h.client;
        wait_up(c, self.victim, true);
        let s = wait_recovered(c, |s| s.recovery.delta_objects >= caught_up);
        assert_eq!(s.recovery.backfill_objects, 0, "{:?}", s.recovery);
        assert_eq!(s.recovery.failures, 0, "{:?}", s.recovery);
        assert!(
            h.lc.is_running(&self.member),
            "{} restarted instead of rejoining",
            self.member
        );
        let others: Vec<u32> = (1..=8).filter(|&n| n != self.victim).take(2).collect();
        h.kill_nodes(&others);
        read_all(c, self.pool, &self.objects);
        s
    }
}

/// A primary whose network is cut (its process running on, its clients' and peers'
/// connections hanging) is marked down; a write to an object it led completes through the
/// next primary, new objects are written with its shard missing, and everything reads back
/// while it is away. Healed, it rejoins without a restart and is caught up from the PG logs
/// (exactly the objects it missed, no scan); then two other nodes die, and every object reads
/// back byte-exact — which needs the healed node's shards.
#[test]
fn a_partitioned_primary_is_replaced_then_caught_up_by_delta_when_healed() {
    let Some(t) = setup(8, 1) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    let mut o = Outage::new(c, 12);
    h.lc.set_connected(&o.member, false).unwrap();
    // The client's first try goes to the cut primary and hangs; it must end up at the next
    // one once the monitor marks the victim down.
    o.objects[1] = put(c, o.pool, "before-1", 1001, 70_000);
    assert!(
        !c.map().nodes[&o.victim].up,
        "the overwrite completed while {} was still up in the client's map",
        o.member
    );
    let missed = 10;
    o.write_meanwhile(h, missed);
    h.lc.set_connected(&o.member, true).unwrap();
    // The objects written meanwhile, and the overwrite: exactly those.
    let s = o.caught_up_then_needed(h, missed + 1);
    assert_eq!(s.recovery.delta_objects, missed + 1, "{:?}", s.recovery);
}

/// An asymmetric partition: a node loses its paths to every other node but still reaches the
/// monitor (and the client), so its heartbeats say it is fine. Its peers' failure reports
/// (pings unanswered for the down grace, from at least two of them) get it marked down
/// anyway — it, not the seven nodes it reports in turn — and writes go on without it. With
/// the paths back, the reports stop, it is marked up and caught up by delta.
#[test]
fn a_node_cut_off_from_its_peers_but_not_the_monitor_is_marked_down_on_their_reports() {
    let Some(t) = setup(8, 1) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    let mut o = Outage::new(c, 8);
    let others: Vec<u32> = (1..=8).filter(|&n| n != o.victim).collect();
    for n in &others {
        h.lc.set_link(&o.member, &format!("node.{n}"), false)
            .unwrap();
    }
    wait_up(c, o.victim, false);
    o.objects[1] = put(c, o.pool, "before-1", 1001, 70_000);
    let missed = 6;
    o.write_meanwhile(h, missed);
    let map = c.map();
    for n in &others {
        assert!(
            map.nodes[n].up,
            "node {n} was marked down on the cut-off node's reports"
        );
    }
    assert!(counter(c, others[0], "node", "peers_silent") >= 1);
    for n in &others {
        h.lc.set_link(&o.member, &format!("node.{n}"), true)
            .unwrap();
    }
    // The objects written meanwhile, and the overwrite.
    o.caught_up_then_needed(h, missed + 1);
}

/// One broken path between two nodes (each still reaches everyone else): each is reported by
/// one node only, so neither is marked down (Ceph's two-reporter rule likewise), but health
/// names the path while it is broken, and clears once it is back.
#[test]
fn a_single_broken_path_shows_in_health_and_marks_nobody_down() {
    let Some(t) = setup(4, 1) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    h.lc.set_link("node.1", "node.2", false).unwrap();
    let named = |s: &StatusReport| {
        s.health_detail
            .iter()
            .any(|l| l.contains("node 1 has had no answer from up node(s) [2]"))
            && s.health_detail
                .iter()
                .any(|l| l.contains("node 2 has had no answer from up node(s) [1]"))
    };
    wait_until("health to name the broken path", || {
        c.status().is_ok_and(|s| named(&s))
    });
    // Well past the grace (1.5 s): still nobody down.
    std::thread::sleep(Duration::from_secs(2));
    let s = c.status().unwrap();
    assert!(named(&s), "{:?}", s.health_detail);
    assert_eq!(s.nodes_up, 4, "{:?}", s.health_detail);
    h.lc.set_link("node.1", "node.2", true).unwrap();
    wait_until("the warning to clear", || {
        c.status().is_ok_and(|s| {
            !s.health_detail
                .iter()
                .any(|l| l.contains("has had no answer"))
        })
    });
}

/// The monitor leader's network is cut: the two others elect a leader and the map stays
/// served and writable (a new pool, a node marked down) for clients and nodes. Healed, the
/// old leader rejoins as a follower and serves the newest map, including what was decided
/// without it.
#[test]
fn a_partitioned_monitor_leader_is_replaced_and_catches_up_when_healed() {
    let Some(t) = setup(4, 3) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    let pool = c.create_pool("t", 2, 1, 64 << 10, 8, None).unwrap();
    c.put(pool, b"before", b"1").unwrap();
    let leader = c.status().unwrap().leader.expect("a leader");
    let member = format!("mon.{leader}");
    h.lc.set_connected(&member, false).unwrap();

    let t = Instant::now();
    loop {
        match c.status() {
            Ok(s) if s.leader.is_some_and(|l| l != leader) => break,
            _ => {
                assert!(
                    t.elapsed() < WAIT,
                    "no new leader while {member} is cut off"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    let p2 = c.create_pool("during", 2, 1, 64 << 10, 8, None).unwrap();
    c.put(p2, b"during", b"2").unwrap();
    // Nodes heartbeat to the new leader: a node that dies is still marked down.
    h.lc.stop_member("node.4", true).unwrap();
    wait_up(c, 4, false);
    let epoch = c.map().epoch;
    assert!(h.lc.is_running(&member), "{member} exited while cut off");

    h.lc.set_connected(&member, true).unwrap();
    // A client of the old leader alone sees the map made without it.
    let mon = MonitorConfig::load(&h.lc.dir.join(&member).join("monitor.toml")).unwrap();
    let conf = h.lc.dir.join("client-old-leader.toml");
    write_toml(
        &conf,
        &ClientConfig {
            monitors: vec![mon.monitors[leader as usize - 1]],
            key_file: h.lc.dir.join("cluster.key"),
            op_timeout_ms: 5000,
        },
    )
    .unwrap();
    let t = Instant::now();
    let old = loop {
        match Client::from_config(&conf) {
            Ok(o) if o.map().epoch >= epoch => break o,
            r => {
                assert!(
                    t.elapsed() < WAIT,
                    "{member} never served epoch {epoch} after healing: {:?}",
                    r.map(|o| o.map().epoch)
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    let m = old.map();
    assert!(m.pools.contains_key(&p2), "pool made without {member}");
    assert!(!m.nodes[&4].up, "node.4 marked down without {member}");
    assert_eq!(old.get(p2, b"during").unwrap(), b"2");
    assert_eq!(c.get(pool, b"before").unwrap(), b"1");
    assert_ne!(c.status().unwrap().leader, None);
}

/// The request a client sent to a primary just cut off sits in the client's TCP send queue;
/// when the cable is back, TCP delivers it to the healed node, which may still hold the old
/// map. By then the client has resent it to the next primary and written the object again
/// since. Whatever the healed node does with the late request, it must not undo the newer
/// write: the object reads the second write's bytes at its version throughout, after
/// recovery, and from the shards that include the healed node's.
#[test]
fn a_late_request_to_a_healed_primary_does_not_undo_a_newer_write() {
    let Some(t) = setup(8, 1) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    let pool = c.create_pool("d", 6, 2, 4096, 16, None).unwrap();
    let (_, first) = put(c, pool, "x", 1, 50_000);
    wait_recovered(c, |_| true);
    let map = c.map();
    let p = &map.pools[&pool];
    let victim = Acting::compute(&map, p, pg_of(p, b"x")).primary.unwrap();
    let member = format!("node.{victim}");
    let writes_before = write_ops(c, victim);
    h.lc.set_connected(&member, false).unwrap();
    // Sent to the cut primary, then (once it is marked down) to the next one.
    let (_, late) = put(c, pool, "x", 2, 60_000);
    let (_, newest) = put(c, pool, "x", 3, 70_000);
    let version = c.stat(pool, b"x").unwrap().version;
    let which = |got: &[u8]| match got {
        g if g == newest => "the newest write".to_string(),
        g if g == late => "the write the cut primary got late".to_string(),
        g if g == first => "the write before the cut".to_string(),
        g => format!("{} bytes of none of the writes", g.len()),
    };
    let check = |when: &str| {
        let got = c.get(pool, b"x").unwrap();
        let v = c.stat(pool, b"x").unwrap().version;
        assert!(
            got == newest && v == version,
            "{when}: x reads {} at version {v:#x}; the newest write is version {version:#x}",
            which(&got)
        );
    };
    h.lc.set_connected(&member, true).unwrap();
    wait_up(c, victim, true);
    // Long enough for TCP to retransmit the late request (its backoff after a few seconds
    // cut off is a few seconds) and for a write it started to give up (`write_wait_ms`).
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(15) {
        check("after healing");
        std::thread::sleep(Duration::from_millis(500));
    }
    wait_recovered(c, |_| true);
    // Which way the late request went depends on whether the healed node had the new map
    // when it arrived: refused as sent before the PG's interval, or run on the old map and
    // refused by members that had answered the newer primary.
    let fenced: u64 = (1..=8)
        .filter(|&n| n != victim)
        .map(|n| counter(c, n, "node", "stale_primary_refused"))
        .sum();
    eprintln!(
        "{member} after healing: {} write op(s) run as primary, {} stale op(s) refused; \
         shard ops from a superseded primary refused by the others: {fenced}",
        write_ops(c, victim) - writes_before,
        counter(c, victim, "node", "stale_ops_refused")
    );
    check("after recovery");
    let others: Vec<u32> = (1..=8).filter(|&n| n != victim).take(2).collect();
    h.kill_nodes(&others);
    check("from the healed node's shard and five others");
}

/// Client write ops node `id` has run as primary (its perf counters).
fn write_ops(c: &Client, id: u32) -> u64 {
    counter(c, id, "client", "write_ops")
}

/// Writers overwrite their objects without pause while one node after another is cut off
/// and healed (each healed node caught up before the next cut). Every write completes (the
/// client goes where the map points), and afterwards every object reads back exactly its
/// last acknowledged bytes — also from the shards left when two nodes then die.
#[test]
fn writes_under_rolling_partitions_all_complete_and_read_back() {
    let Some(t) = setup(8, 1) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    let pool = c.create_pool("d", 6, 2, 4096, 16, None).unwrap();
    const WRITERS: u64 = 4;
    const OBJECTS: u64 = 6;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let cut: Vec<u32> = vec![3, 6, 1];
    let (last, writes) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let stop = &stop;
                s.spawn(move || {
                    // Object → (seed, length) of its last acknowledged write.
                    let mut last = std::collections::BTreeMap::new();
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let o = n % OBJECTS;
                        let seed = (w << 32) | n;
                        let len = 1000 + (seed.wrapping_mul(2_654_435_761) % 60_000) as usize;
                        let name = format!("w{w}-o{o}");
                        c.put(pool, name.as_bytes(), &bytes(seed, len))
                            .unwrap_or_else(|e| panic!("put {name} (write {n}): {e}"));
                        last.insert(name, (seed, len));
                        n += 1;
                    }
                    (last, n)
                })
            })
            .collect();
        for &id in &cut {
            std::thread::sleep(Duration::from_millis(500));
            let member = format!("node.{id}");
            h.lc.set_connected(&member, false).unwrap();
            wait_up(c, id, false);
            std::thread::sleep(Duration::from_millis(500));
            h.lc.set_connected(&member, true).unwrap();
            wait_up(c, id, true);
            wait_recovered(c, |_| true);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut last = std::collections::BTreeMap::new();
        let mut writes = 0;
        for w in writers {
            let (l, n) = w.join().unwrap();
            last.extend(l);
            writes += n;
        }
        (last, writes)
    });
    eprintln!("{writes} writes over {} objects", last.len());
    let objects: Vec<(String, Vec<u8>)> = last
        .into_iter()
        .map(|(name, (seed, len))| (name, bytes(seed, len)))
        .collect();
    assert_eq!(objects.len() as u64, WRITERS * OBJECTS);
    wait_recovered(c, |_| true);
    read_all(c, pool, &objects);
    h.kill_nodes(&[2, 7]);
    read_all(c, pool, &objects);
    for id in cut {
        assert!(
            h.lc.is_running(&format!("node.{id}")),
            "node.{id} restarted"
        );
    }
}

/// A node cut off for longer than the out grace is marked out, and its PGs are rebuilt on
/// other nodes. When its network comes back (the process never stopped, so it does not boot
/// again), it is marked up *and back in* — the monitor marked it out, not an operator — and
/// its PGs return to it, caught up; every object reads back, also with two other nodes dead.
#[test]
fn a_node_cut_off_past_the_out_grace_is_marked_back_in_when_healed() {
    let Some(t) = setup_with(8, 1, 3000) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    // 4 + 2 on 8 nodes: a PG has somewhere to go while a node is out.
    let pool = c.create_pool("d", 4, 2, 4096, 16, None).unwrap();
    let mut objects = put_objects(c, pool, "before", 100, 16);
    wait_recovered(c, |_| true);
    let victim = 5;
    let member = format!("node.{victim}");
    h.lc.set_connected(&member, false).unwrap();
    wait_until(&format!("{member} marked out"), || {
        let _ = c.refresh_map();
        !c.map().nodes[&victim].r#in
    });
    for i in 0..8 {
        objects.push(put(
            c,
            pool,
            &format!("while-out-{i}"),
            200 + i,
            2000 + 4001 * i as usize,
        ));
    }
    wait_recovered(c, |_| true);
    read_all(c, pool, &objects);

    h.lc.set_connected(&member, true).unwrap();
    wait_until(&format!("{member} up and in again"), || {
        let _ = c.refresh_map();
        let n = &c.map().nodes[&victim];
        n.up && n.r#in
    });
    assert!(
        h.lc.is_running(&member),
        "{member} restarted instead of rejoining"
    );
    let s = wait_recovered(c, |_| true);
    assert_eq!(s.recovery.failures, 0, "{:?}", s.recovery);
    let map = c.map();
    let p = &map.pools[&pool];
    let led = (0..p.pg_num)
        .filter(|&pg| Acting::compute(&map, p, pg).members.contains(&Some(victim)))
        .count();
    assert!(led > 0, "no PG maps to {member} again");
    read_all(c, pool, &objects);
    h.kill_nodes(&[2, 7]);
    read_all(c, pool, &objects);
}

/// Two of three monitors cut off: no quorum, so the map cannot change. The data path does not
/// need the monitors: writes and reads go on against the last map (a node that died now would
/// not be marked down). Healed, the monitors have a leader again and the map moves again.
#[test]
fn without_a_monitor_quorum_the_data_path_goes_on_with_the_last_map() {
    let Some(t) = setup(4, 3) else {
        return;
    };
    let h = &t.h;
    let c = &h.client;
    let pool = c.create_pool("t", 2, 1, 4096, 8, None).unwrap();
    let before = put(c, pool, "before", 1, 30_000);
    let epoch = c.map().epoch;
    let cut = ["mon.2", "mon.3"];
    for m in cut {
        h.lc.set_connected(m, false).unwrap();
    }
    // Well past the nodes' down grace: were anything to depend on the monitors, it would show.
    std::thread::sleep(Duration::from_secs(3));
    let mut objects = vec![before];
    for i in 0..20 {
        objects.push(put(
            c,
            pool,
            &format!("during-{i}"),
            100 + i,
            500 + 997 * i as usize,
        ));
    }
    read_all(c, pool, &objects);
    assert_eq!(c.map().epoch, epoch, "the map moved without a quorum");
    for m in cut {
        assert!(h.lc.is_running(m), "{m} exited while cut off");
        h.lc.set_connected(m, true).unwrap();
    }
    // A leader again: a node that dies is marked down.
    h.kill_nodes(&[4]);
    assert!(c.map().epoch > epoch);
    read_all(c, pool, &objects);
}
