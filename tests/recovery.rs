//! Recovery integration tests: real monitor and node processes (the built `nvstore` binary)
//! on loopback with small file devices. One cluster at a time (2-core CI).

mod common;

use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{
    bytes, counter, live_bytes, put_objects, read_all, size_of, store_sum, wait_recovered,
    wait_until, wait_up, Harness, WAIT,
};
use nvstore::cluster_cmd::{render_status, LocalOptions};
use nvstore::monitor::StatusReport;
use nvstore::placement::{pg_of, Acting};
use nvstore::Client;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn cluster(nodes: u32) -> Harness {
    cluster_keeping_tombstones(nodes, LocalOptions::default().tombstone_keep_s)
}

/// These tests' cluster options: `nodes` nodes keeping removed objects' tombstones `secs`
/// seconds, small devices, a quick down grace.
fn options(nodes: u32, secs: u64) -> LocalOptions {
    LocalOptions {
        nodes,
        monitors: 1,
        device_bytes: 256 << 20,
        down_grace_ms: 1500,
        heartbeat_ms: 200,
        op_threads: 4,
        tombstone_keep_s: secs,
        ..LocalOptions::default()
    }
}

/// [`cluster`] whose nodes keep removed objects' tombstones `secs` seconds.
fn cluster_keeping_tombstones(nodes: u32, secs: u64) -> Harness {
    common::cluster("nvstore-recovery-test-", &options(nodes, secs))
}

/// Kill a node and mark it out: its shards are rebuilt on the PGs' new members (backfill),
/// while objects are written; then two *other* nodes die and every object still reads back
/// byte-exact, which only k + m = 4 shards per object again can give.
#[test]
fn a_node_marked_out_is_rebuilt_on_new_members_and_redundancy_is_restored() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(5);
    let c = &h.client;
    let pool = c.create_pool("r", 2, 2, 4096, 8, None).unwrap();
    let mut objects = put_objects(c, pool, "obj", 0, 36);
    c.set_xattr(pool, b"obj-3", "color", b"green").unwrap();
    c.put(pool, b"gone", b"removed before the failure").unwrap();
    c.remove(pool, b"gone").unwrap();
    wait_recovered(c, |_| true);

    let victim = 3;
    let before = c.map();
    let info = before.pools[&pool].clone();
    let affected = objects
        .iter()
        .filter(|(n, _)| {
            Acting::compute(&before, &info, pg_of(&info, n.as_bytes()))
                .shard_of(victim)
                .is_some()
        })
        .count();
    assert!(affected > 0, "the victim holds shards");
    h.lc.stop_member(&format!("node.{victim}"), true).unwrap();
    wait_up(c, victim, false);
    mark_out(&h, victim);
    // Objects written while recovery runs: new ones, and whole and partial overwrites of
    // objects recovery may be rebuilding at that moment (they race on the PG).
    for i in 100..112 {
        let (n, d) = (format!("during-{i}"), bytes(i as u64, size_of(i)));
        c.put(pool, n.as_bytes(), &d).unwrap();
        objects.push((n, d));
    }
    let raced = [4usize, 10, 16, 22, 28, 34];
    for (j, &i) in raced.iter().enumerate() {
        if j % 2 == 0 {
            objects[i].1 = bytes(900 + i as u64, 70_000);
            c.put(pool, objects[i].0.as_bytes(), &objects[i].1).unwrap();
        } else {
            let patch = bytes(950 + i as u64, 3000);
            let at = objects[i].1.len() / 3;
            let end = at + patch.len();
            if objects[i].1.len() < end {
                objects[i].1.resize(end, 0);
            }
            objects[i].1[at..end].copy_from_slice(&patch);
            c.write(pool, objects[i].0.as_bytes(), at as u64, &patch)
                .unwrap();
        }
    }
    let low = (affected - raced.len()) as u64;
    let s = wait_recovered(c, |s| s.recovery.backfill_objects >= low);
    // An object a client rewrote whole before recovery reached it needs no rebuild.
    assert!(
        (low..=affected as u64).contains(&s.recovery.backfill_objects),
        "each object with a shard on the out node rebuilt at most once ({affected}): {:?}",
        s.recovery
    );
    assert_eq!(s.recovery.delta_objects, 0, "{:?}", s.recovery);
    assert!(s.recovery.bytes_done > 0);
    assert_eq!(s.recovery.objects_left, 0);
    let text = render_status(&s);
    assert!(
        text.contains("recovery: idle; done:") && text.contains("backfill"),
        "{text}"
    );
    assert!(
        s.pg_states.keys().all(|k| k == "active+clean"),
        "{:?}",
        s.pg_states
    );
    assert_eq!(c.get_xattr(pool, b"obj-3", "color").unwrap(), b"green");

    // Two more nodes die: k = 2 shards per object are left, all on rebuilt or kept members.
    let others: Vec<u32> = (1..=5).filter(|i| *i != victim).take(2).collect();
    h.kill_nodes(&others);
    read_all(c, pool, &objects);
    assert_eq!(c.get_xattr(pool, b"obj-3", "color").unwrap(), b"green");
    assert!(
        c.stat(pool, b"gone").is_err(),
        "a removed object stays removed"
    );
}

/// Mark `id` out through the CLI.
fn mark_out(h: &Harness, id: u32) {
    mark(h, id, "out");
}

/// `nvstore node in|out ID` through the CLI.
fn mark(h: &Harness, id: u32, how: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["node", how, &id.to_string(), "--conf"])
        .arg(h.lc.client_config())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "node {how}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("marked {how}")));
}

/// Shard bytes recovery wrote, summed over the nodes that are not `except`.
fn rebuilt_bytes(s: &StatusReport, except: &[u32]) -> u64 {
    s.node_stats
        .iter()
        .filter(|(id, _)| !except.contains(id))
        .map(|(_, n)| n.recovery.bytes_done)
        .sum()
}

/// Two nodes go out one after the other, on a pair for which the stateless draw would hand a
/// replacement of the first node's slot a different node at the second out (the nodes' slot
/// pins, `map.pins`, prevent that). The second rebuild writes exactly the second node's
/// shards — nothing for the first node's replacements — and every object reads exact.
#[test]
fn a_second_node_out_rebuilds_only_its_own_shards() {
    use nvstore::map::{Change, ClusterMap, Incremental};
    use nvstore::placement::pg_members;
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(7);
    let c = &h.client;
    let pool = c.create_pool("pins", 2, 2, 4096, 64, None).unwrap();
    let start = c.map();
    let info = start.pools[&pool].clone();
    let out = |m: &ClusterMap, id: u32| {
        let mut m = m.clone();
        m.apply(&Incremental {
            epoch: m.epoch + 1,
            changes: vec![Change::NodeOut(id)],
        })
        .unwrap();
        m
    };
    let objects: Vec<(String, Vec<u8>)> = (0..48)
        .map(|i| (format!("p-{i}"), bytes(500 + i as u64, 1 + size_of(i))))
        .collect();
    // Objects with a shard that would move at the second out without pins although it is
    // not on `y`.
    let collateral = |x: u32, y: u32| {
        let m1 = out(&start, x);
        let mut stateless = out(&m1, y);
        stateless.pins.clear();
        objects
            .iter()
            .filter(|(n, _)| {
                let pg = pg_of(&info, n.as_bytes());
                let (a, b) = (
                    pg_members(&m1, &info, pg),
                    pg_members(&stateless, &info, pg),
                );
                (0..a.len()).any(|s| a[s] != b[s] && a[s] != Some(y))
            })
            .count()
    };
    let (x, y) = (1..=7u32)
        .flat_map(|x| (1..=7u32).filter(move |y| *y != x).map(move |y| (x, y)))
        .max_by_key(|&(x, y)| collateral(x, y))
        .unwrap();
    assert!(
        collateral(x, y) > 0,
        "some pair of outs moves a replacement without pins"
    );
    for (n, d) in &objects {
        c.put(pool, n.as_bytes(), d).unwrap();
    }
    wait_recovered(c, |_| true);

    h.lc.stop_member(&format!("node.{x}"), true).unwrap();
    wait_up(c, x, false);
    mark_out(&h, x);
    let s1 = wait_recovered(c, |s| s.nodes_in == 6 && s.recovery.backfill_objects > 0);

    // What the second out must rebuild: each object's shard on `y`, clipped as stored.
    let before = c.map();
    assert!(!before.nodes[&x].r#in);
    let profile = info.profile();
    let expected: u64 = objects
        .iter()
        .filter_map(|(n, d)| {
            let a = Acting::compute(&before, &info, pg_of(&info, n.as_bytes()));
            let slot = a.shard_of(y)?;
            let data_slot = if slot >= info.k as usize { 0 } else { slot };
            Some(if d.is_empty() {
                0
            } else {
                profile.shard_data_len(d.len() as u64, data_slot)
            })
        })
        .sum();
    assert!(expected > 0, "node {y} holds shards");
    h.lc.stop_member(&format!("node.{y}"), true).unwrap();
    wait_up(c, y, false);
    mark_out(&h, y);
    let s2 = wait_recovered(c, |s| {
        s.nodes_in == 5 && rebuilt_bytes(s, &[x, y]) >= rebuilt_bytes(&s1, &[x, y]) + expected
    });
    assert!(
        !c.map().pins.is_empty(),
        "the second out pinned a replacement"
    );
    assert_eq!(
        rebuilt_bytes(&s2, &[x, y]) - rebuilt_bytes(&s1, &[x, y]),
        expected,
        "the second out ({y}, after {x}) rebuilt only its own shards"
    );
    read_all(c, pool, &objects);
}

/// Stop `victim`, write 10 objects (contents seeded from `seed`), start it again: exactly
/// those are rebuilt on it from the PG logs (delta), none by a full scan. Returns them.
fn outage_caught_up_by_delta(
    h: &Harness,
    pool: u64,
    victim: u32,
    seed: u64,
) -> Vec<(String, Vec<u8>)> {
    let c = &h.client;
    h.lc.stop_member(&format!("node.{victim}"), true).unwrap();
    wait_up(c, victim, false);
    let missed = 10;
    let objects: Vec<(String, Vec<u8>)> = (0..missed)
        .map(|i| {
            let (n, d) = (
                format!("meanwhile-{i}"),
                bytes(seed + i as u64, size_of(i + 1)),
            );
            c.put(pool, n.as_bytes(), &d).unwrap();
            (n, d)
        })
        .collect();
    h.lc.start_member(&format!("node.{victim}")).unwrap();
    wait_up(c, victim, true);
    let s = wait_recovered(c, |s| s.recovery.delta_objects >= missed as u64);
    assert_eq!(s.recovery.delta_objects, missed as u64, "{:?}", s.recovery);
    assert_eq!(s.recovery.backfill_objects, 0, "{:?}", s.recovery);
    assert_eq!(s.recovery.failures, 0, "{:?}", s.recovery);
    objects
}

/// A member that took overwrites and went down before the primary settled them (it sends
/// SHARD_SETTLE every 2 s) is sent the settle once it is back: the old bytes its rollback
/// records kept go, as on the members that stayed up, instead of staying until each object's
/// next write.
#[test]
fn a_member_down_when_its_writes_were_settled_drops_their_old_bytes_once_back() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // k + m = 4 nodes: every node holds a shard of every object, all of one size.
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("s", 2, 2, 4096, 8, None).unwrap();
    let (n, size) = (24u64, 256usize << 10);
    let name = |i: u64| format!("obj-{i}");
    for i in 0..n {
        c.put(pool, name(i).as_bytes(), &bytes(i, size)).unwrap();
    }
    wait_recovered(c, |_| true);
    // Overwrite them all, then kill a member at once: the settles of at least the last
    // overwrites cannot have reached it, and it stays down while they are sent again.
    for i in 0..n {
        c.put(pool, name(i).as_bytes(), &bytes(1000 + i, size))
            .unwrap();
    }
    let victim = 4u32;
    h.kill_nodes(&[victim]);
    // Down across more than one settle round.
    std::thread::sleep(Duration::from_secs(5));
    h.lc.start_member(&format!("node.{victim}")).unwrap();
    wait_up(c, victim, true);
    wait_recovered(c, |_| true);
    // Every member then holds the same: one shard of each object's new version (the old
    // versions' bytes settled), PG log entries and marks.
    let shard = size as u64 / 2;
    let mut last = Vec::new();
    let settled = (0..600).any(|_| {
        last = (1..=4).map(|id| live_bytes(c, id)).collect::<Vec<u64>>();
        let others = last[..3].iter().copied().max().unwrap();
        if last[3] <= others + shard && others <= n * shard * 3 / 2 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
        false
    });
    assert!(
        settled,
        "live bytes of nodes 1-4 {last:?} after 60 s: node {victim} kept old versions' bytes \
         (each shard {shard} B, {n} objects)"
    );
    for i in 0..n {
        assert!(c.get(pool, name(i).as_bytes()).unwrap() == bytes(1000 + i, size));
    }
}

/// A node stopped while objects are written and started again is caught up from the PG logs:
/// exactly the objects written meanwhile are rebuilt on it, none by a full scan; then two other
/// nodes die and everything reads back from the caught-up node and one other.
#[test]
fn a_node_back_within_the_log_window_is_caught_up_by_delta() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // k + m = 4 nodes: every PG has every node, so every object written meanwhile is missed.
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("d", 2, 2, 4096, 8, None).unwrap();
    let mut objects = put_objects(c, pool, "before", 0, 16);
    // Every PG's first pass has run (the members carry their marks).
    wait_recovered(c, |_| true);

    objects.extend(outage_caught_up_by_delta(&h, pool, 4, 500));

    // Only the caught-up node and node 1 remain: every object must come from them.
    h.kill_nodes(&[2, 3]);
    read_all(c, pool, &objects);
}

/// A write that took its PG's members while one was down, and is still in flight when that
/// member comes back, must reach the member: the recovery pass planned for its return asks
/// the members' logs, which cannot hold the write yet. The primary holds the write between
/// choosing its members (the member still down) and sending its shards
/// (`inject_write_delay_ms`) across the member's return; then two other members die, and the
/// object reads back only if the returned member has its newest version. Without bd0c2bd
/// (checked by reverting it) the pass finished without the write, the write's
/// acknowledgement moved the PG's marks past it — the returned member's too — and the read
/// failed: "version … is on 1 shard(s) (k = 2)".
#[test]
fn a_write_in_flight_when_a_member_returns_reaches_that_member() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let newest = bytes(2, 30_000);
    let c = &held_across_a_members_return(|c, pool, name| c.put(pool, name, &newest)).client;
    let got = c.get(1, HELD).unwrap();
    assert!(got == newest, "{} bytes read back wrong", got.len());
}

/// [`a_write_in_flight_when_a_member_returns_reaches_that_member`] for a remove: the
/// returned member must not keep the object (it had the version before the remove).
#[test]
fn a_remove_in_flight_when_a_member_returns_reaches_that_member() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let c = &held_across_a_members_return(|c, pool, name| c.remove(pool, name)).client;
    let e = c.stat(1, HELD).unwrap_err();
    assert!(e.to_string().contains("no object"), "{e}");
    assert!(c.list(1).unwrap().is_empty());
}

/// A primary that lost its PG while its write was held must not write its own shard either.
/// The member before it comes back and leads the PG again, with the first node still a member
/// at the same slot; the client's resend makes the new version on every member; then the old
/// primary's held write goes out. The members refuse its shards (`check_shard_sender`), and
/// its own shard — written locally, with no sender to check — must be refused too: it would
/// put the older version under the newer one on that slot, behind the marks' back. With two
/// other members dead the object reads back only from the two that held the PG.
#[test]
fn a_primary_that_lost_its_pg_while_a_write_was_held_leaves_its_own_shard_alone() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("overtaken", 2, 2, 4096, 4, None).unwrap();
    let name = b"overtaken";
    c.put(pool, name, &bytes(1, 20_000)).unwrap();
    wait_recovered(c, |_| true);
    let map = c.map();
    let info = &map.pools[&pool];
    let members: Vec<u32> = Acting::compute(&map, info, pg_of(info, name))
        .members
        .iter()
        .flatten()
        .copied()
        .collect();
    let (first, second) = (members[0], members[1]);
    h.kill_nodes(&[first]);
    let map = c.map();
    let a = Acting::compute(&map, &map.pools[&pool], pg_of(info, name));
    assert_eq!(a.primary, Some(second), "{a:?}");

    c.config(second, Some(("inject_write_delay_ms", "4000")))
        .unwrap();
    let newest = bytes(2, 30_000);
    std::thread::scope(|s| {
        let writer = s.spawn(|| c.put(pool, name, &newest));
        wait_until("the write to be held", || {
            counter(c, second, "node", "writes_delayed") == 1
        });
        h.lc.start_member(&format!("node.{first}")).unwrap();
        wait_up(c, first, true);
        writer.join().unwrap().unwrap();
    });
    wait_until("the held write to be sent", || {
        counter(c, second, "node", "writes_held") == 0
    });
    // Its own shard write was refused (the members' refusals count on the members).
    assert!(counter(c, second, "node", "stale_primary_refused") >= 1);
    c.config(second, Some(("inject_write_delay_ms", "0")))
        .unwrap();
    let s = wait_recovered(c, |s| s.pg_states.keys().all(|k| k == "active+clean"));
    assert_eq!(s.recovery.failures, 0, "{:?}", s.recovery);
    let map = c.map();
    let a = Acting::compute(&map, &map.pools[&pool], pg_of(info, name));
    assert_eq!(a.primary, Some(first), "{a:?}");

    h.kill_nodes(&members[2..]);
    let got = c.get(pool, name).unwrap();
    assert!(got == newest, "{} bytes read back wrong", got.len());
}

/// The object [`held_across_a_members_return`] holds a mutation of (pool id 1).
const HELD: &[u8] = b"held";

/// On 4 nodes (k = 2, m = 2: every PG has every node), object [`HELD`] is written, then a
/// member of its PG killed; the primary holds `mutate` between choosing its members and
/// sending its shards while the member is restarted and marked up; recovery finishes; the
/// two members other than the primary and the returned one are killed. Returns the cluster:
/// what is read now needs the returned member's shard.
fn held_across_a_members_return(
    mutate: impl Fn(&Client, u64, &[u8]) -> nvstore::Result<u64> + Sync,
) -> Harness {
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("inflight", 2, 2, 4096, 4, None).unwrap();
    assert_eq!(pool, 1);
    c.put(pool, HELD, &bytes(1, 20_000)).unwrap();
    wait_recovered(c, |_| true);
    let map = c.map();
    let info = &map.pools[&pool];
    let primary = Acting::compute(&map, info, pg_of(info, HELD))
        .primary
        .unwrap();
    let others: Vec<u32> = (1..=4).filter(|n| *n != primary).collect();
    let (returning, doomed) = (others[0], &others[1..]);
    h.kill_nodes(&[returning]);

    c.config(primary, Some(("inject_write_delay_ms", "6000")))
        .unwrap();
    std::thread::scope(|s| {
        let writer = s.spawn(|| mutate(c, pool, HELD));
        wait_until("the mutation to be held", || {
            counter(c, primary, "node", "writes_delayed") == 1
        });
        h.lc.start_member(&format!("node.{returning}")).unwrap();
        wait_up(c, returning, true);
        assert!(
            !writer.is_finished(),
            "the mutation must still be in flight when its member is back"
        );
        writer.join().unwrap().unwrap();
    });
    c.config(primary, Some(("inject_write_delay_ms", "0")))
        .unwrap();
    let s = wait_recovered(c, |s| s.pg_states.keys().all(|k| k == "active+clean"));
    assert_eq!(s.recovery.failures, 0, "{:?}", s.recovery);

    // The primary and the returned member are all that is left: k = 2 shards.
    h.kill_nodes(doomed);
    h
}

/// A write whose PG changes hands while its shards are on their way: the old primary holds an
/// append between choosing its members and sending its shards (`inject_write_delay_ms`) and
/// is marked out meanwhile. The client resends the append to the new primary on the new map;
/// the old primary's shards go out after that (the test waits for them) and the members, on
/// the newer map, refuse them (`check_shard_sender`). The object ends with the bytes appended
/// exactly once, on every member, as reads with two of them dead show.
#[test]
fn a_write_held_while_its_pg_changes_hands_lands_exactly_once() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 5 nodes, k + m = 4: the out node's slot goes to the fifth.
    let h = cluster(5);
    let c = &h.client;
    let pool = c.create_pool("handover", 2, 2, 4096, 4, None).unwrap();
    let name = b"journal";
    c.put(pool, name, b"first;").unwrap();
    wait_recovered(c, |_| true);
    let map = c.map();
    let info = &map.pools[&pool];
    let pg = pg_of(info, name);
    let old = Acting::compute(&map, info, pg).primary.unwrap();

    c.config(old, Some(("inject_write_delay_ms", "3000")))
        .unwrap();
    std::thread::scope(|s| {
        let writer = s.spawn(|| c.append(pool, name, b"second;"));
        wait_until("the append to be held", || {
            counter(c, old, "node", "writes_delayed") == 1
        });
        mark_out(&h, old);
        // The client sends the append again to the new primary on the new map.
        writer.join().unwrap().unwrap();
    });
    // The old primary's shards go out after it lost the PG.
    wait_until("the held append to be sent", || {
        counter(c, old, "node", "writes_held") == 0
    });
    c.config(old, Some(("inject_write_delay_ms", "0"))).unwrap();
    let map = c.map();
    let now = Acting::compute(&map, &map.pools[&pool], pg);
    assert!(!now.members.contains(&Some(old)), "{now:?}");
    assert_ne!(now.primary, Some(old));
    let s = wait_recovered(c, |s| s.pg_states.keys().all(|k| k == "active+clean"));
    assert_eq!(s.recovery.failures, 0, "{:?}", s.recovery);
    assert_eq!(c.get(pool, name).unwrap(), b"first;second;");

    // Any two members die, the old primary with them: the rest agree.
    let members: Vec<u32> = now.members.iter().flatten().copied().collect();
    h.kill_nodes(&[old, members[0], members[1]]);
    assert_eq!(c.get(pool, name).unwrap(), b"first;second;");
}

/// The delta window is the PG log (512 entries per PG), counted back from a member's mark. A
/// primary advances the marks of members that acknowledged everything (`refresh_marks`), so
/// after many more writes than the log holds, a node that goes down briefly is still caught up
/// by delta, not by a full scan of its PGs.
#[test]
fn a_node_down_after_a_long_busy_spell_is_still_caught_up_by_delta() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(4);
    let c = &h.client;
    // One PG: every write lands in the same log.
    let pool = c.create_pool("busy", 2, 2, 4096, 1, None).unwrap();
    wait_recovered(c, |_| true);
    let busy = nvstore::node::local::PG_LOG_ENTRIES_MAX + 88;
    for i in 0..busy {
        c.put(pool, format!("busy-{i}").as_bytes(), &[i as u8])
            .unwrap();
    }
    wait_until("the members' marks to cover every write", || {
        (1..=4).all(|n| c.perf_dump(n).unwrap()["recovery"]["marks_behind"].as_u64() == Some(0))
    });
    let refreshed: u64 = (1..=4)
        .map(|n| {
            c.perf_dump(n).unwrap()["recovery"]["marks_refreshed"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(refreshed > 0, "marks were advanced between passes");

    let victim = 3;
    let objects = outage_caught_up_by_delta(&h, pool, victim, 900);
    let others: Vec<u32> = [1, 2].into_iter().filter(|id| *id != victim).collect();
    h.kill_nodes(&others);
    read_all(c, pool, &objects);
    for i in (0..busy).step_by(97) {
        assert_eq!(
            c.get(pool, format!("busy-{i}").as_bytes()).unwrap(),
            vec![i as u8]
        );
    }
}

/// Send a raw node message and wait for its reply: (status, message) of the reply.
fn ask(conn: &messenger::Connection, t: u16, payload: Vec<u8>) -> (nvstore::wire::Status, String) {
    use nvstore::wire::{self, Status};
    let r = conn
        .request(
            messenger::OutMessage::new(t, payload),
            Duration::from_secs(30),
        )
        .unwrap();
    match wire::parse_reply(&r.payload) {
        Ok(_) => (Status::Ok, String::new()),
        Err(nvstore::Error::Remote { status, message }) => (status, message),
        Err(e) => panic!("{e}"),
    }
}

/// The payload of a raw `MSG_SHARD_WRITE` of a whole 4 KiB shard 1 of `name` at `epoch`, as
/// a primary sends it.
fn shard_write_payload(pool: u64, pg: u32, name: &[u8], epoch: u64, data: &[u8]) -> Vec<u8> {
    use nvstore::node::local::{ShardMeta, ShardWrite, WriteKind, BASE_ANY};
    let w = ShardWrite {
        pool,
        pg,
        name,
        shard: 1,
        kind: WriteKind::Full,
        base_version: BASE_ANY,
        meta: ShardMeta {
            version: (epoch << 32) | 1,
            size: data.len() as u64,
            mtime_unix_ns: 1,
            deleted: false,
        },
        offset: 0,
        xattrs: vec![],
        reqs: Default::default(),
        data: nvstore::node::local::ShardData::Flat(data),
        chunk_crcs: Vec::new(),
        listed_crcs: Vec::new(),
    };
    let mut payload = w.encode_header(epoch);
    payload.extend_from_slice(data);
    payload
}

/// The interval tests' setup: 8 nodes, a 6+2 pool with object "probe"; of probe's PG, its
/// primary, its second member (which the raw messages go to) and its third (which plays a
/// primary of a newer epoch).
struct IntervalProbe {
    h: Harness,
    pool: u64,
    map: std::sync::Arc<nvstore::map::ClusterMap>,
    acting: Acting,
    primary: u32,
    member: u32,
    newer: u32,
}

impl IntervalProbe {
    fn new(pool_name: &str) -> IntervalProbe {
        let h = cluster(8);
        let c = &h.client;
        let pool = c.create_pool(pool_name, 6, 2, 4096, 8, None).unwrap();
        c.put(pool, b"probe", b"first").unwrap();
        let map = c.map();
        let p = &map.pools[&pool];
        let acting = Acting::compute(&map, p, pg_of(p, b"probe"));
        let primary = acting.primary.unwrap();
        let member = acting.members[1].unwrap();
        let newer = acting.members[2].unwrap();
        assert!(primary != member && primary != newer && member != newer);
        IntervalProbe {
            h,
            pool,
            map,
            acting,
            primary,
            member,
            newer,
        }
    }

    /// A messenger posing as node `id`, connected to the member.
    fn as_node(&self, id: u32) -> (messenger::Messenger, messenger::Connection) {
        let me = messenger::Identity::Node(id);
        let m = self.h.raw_messenger(me);
        let member = messenger::Identity::Node(self.member);
        let conn = m
            .connect(self.map.nodes[&self.member].addr, member)
            .unwrap();
        (m, conn)
    }
}

/// The interval race: a new primary starts by asking each member for its PG log. A member
/// that answers before it has the new map must refuse the old primary's writes from then on,
/// or the old primary could complete a write the new one never heard of. Here node Q plays a
/// primary of a newer epoch than the member knows (the member waits for that map, in vain,
/// then answers); the real primary P, still on the old map, is refused afterwards.
#[test]
fn a_member_that_answered_a_newer_primary_refuses_the_old_one() {
    use nvstore::wire::{self, Enc, Status};

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let t = IntervalProbe::new("iv");
    let (c, pool, map, a) = (&t.h.client, t.pool, &t.map, &t.acting);
    let p = &map.pools[&pool];
    let (primary, member, newer) = (t.primary, t.member, t.newer);
    let as_node = |id: u32| t.as_node(id);
    let data = vec![7u8; 4096];
    let shard_write = || shard_write_payload(pool, a.pg, b"interval-probe", map.epoch, &data);
    let refused = |c: &Client| {
        c.perf_dump(member).unwrap()["node"]["stale_primary_refused"]
            .as_u64()
            .unwrap()
    };

    let (mp, from_primary) = as_node(primary);
    let (s, msg) = ask(&from_primary, wire::MSG_SHARD_WRITE, shard_write());
    assert_eq!(
        s,
        Status::Ok,
        "the primary's write before any newer one: {msg}"
    );
    assert_eq!(refused(c), 0);

    // A primary of epoch + 1 asks for the PG log; the member never gets that map.
    let (mq, from_newer) = as_node(newer);
    let mut e = Enc::new(map.epoch + 1);
    e.u64(pool).u32(a.pg);
    let (s, msg) = ask(&from_newer, wire::MSG_PG_LOG, e.finish());
    assert_eq!(s, Status::Ok, "{msg}");

    let (s, msg) = ask(&from_primary, wire::MSG_SHARD_WRITE, shard_write());
    assert_eq!(
        s,
        Status::StaleEpoch,
        "the old primary's write after the newer one: {msg}"
    );
    assert!(msg.contains(&format!("node.{newer}")), "{msg}");
    // P's own background ops for the PG (mark refreshes, scrub) are refused as well.
    assert!(refused(c) >= 1);
    // The newer primary's own ops of an older epoch are its to order: accepted.
    let mut e = Enc::new(map.epoch);
    e.u64(pool).u32(a.pg);
    let (s, msg) = ask(&from_newer, wire::MSG_PG_LOG, e.finish());
    assert_eq!(s, Status::Ok, "{msg}");
    // Other PGs are not affected.
    let other = (0..p.pg_num).find(|&g| g != a.pg).unwrap();
    let mut e = Enc::new(map.epoch);
    e.u64(pool).u32(other);
    let (s, _) = ask(&from_primary, wire::MSG_PG_LOG, e.finish());
    assert_ne!(s, Status::StaleEpoch);
    mp.shutdown();
    mq.shutdown();
}

/// The hand-over between two primaries at a member (src/node/interval.rs): a shard write of
/// the old primary that passed the member's check just before the new primary's first op
/// (its query of the PG log) must be applied before the member answers the new primary, or
/// the new primary's view of the PG misses a write that lands right after. The member here
/// holds every shard write between its check and its apply (`inject_shard_apply_delay_ms`);
/// node Q plays a primary of a newer epoch (as in the test above, the member waits for that
/// map in vain, then answers). The log query must wait for the held write, and its answer
/// must list it.
#[test]
fn a_member_answers_a_new_primary_only_after_the_old_ones_write_in_flight() {
    use nvstore::node::recovery::LogInfo;
    use nvstore::wire::{self, Dec, Enc};

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let t = IntervalProbe::new("drain");
    let (c, pool, map, a) = (&t.h.client, t.pool, &t.map, &t.acting);
    let (primary, member, newer) = (t.primary, t.member, t.newer);
    let as_node = |id: u32| t.as_node(id);
    // Longer than the member's wait for the newer primary's map (EPOCH_WAIT, 5 s), so the
    // write is still held when the log query gets past that wait.
    c.config(member, Some(("inject_shard_apply_delay_ms", "8000")))
        .unwrap();
    let (mp, from_primary) = as_node(primary);
    let (mq, from_newer) = as_node(newer);
    let name = b"in-flight-at-the-hand-over";
    let log = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let data = vec![9u8; 4096];
            ask(
                &from_primary,
                wire::MSG_SHARD_WRITE,
                shard_write_payload(pool, a.pg, name, map.epoch, &data),
            )
        });
        wait_until("the member to hold the old primary's write", || {
            counter(c, member, "node", "shard_writes_delayed") == 1
        });
        assert!(!writer.is_finished(), "the write must be in flight");
        let mut e = Enc::new(map.epoch + 1);
        e.u64(pool).u32(a.pg);
        let r = from_newer
            .request(
                messenger::OutMessage::new(wire::MSG_PG_LOG, e.finish()),
                Duration::from_secs(60),
            )
            .unwrap();
        let body = wire::parse_reply(&r.payload).unwrap().1.to_vec();
        let (s, msg) = writer.join().unwrap();
        assert_eq!(
            s,
            nvstore::wire::Status::Ok,
            "the old primary's write: {msg}"
        );
        LogInfo::decode(&mut Dec::new(&body)).unwrap()
    });
    assert!(
        log.entries.iter().any(|(_, n)| n == name),
        "the member answered the new primary's log query without the old primary's write \
         it had admitted and was still applying: {log:?}"
    );
    assert_eq!(counter(c, member, "node", "primary_change_waits"), 1);
    assert_eq!(counter(c, member, "node", "primary_change_timeouts"), 0);
    // The old primary is refused from now on.
    let (s, _) = ask(
        &from_primary,
        wire::MSG_SHARD_WRITE,
        shard_write_payload(pool, a.pg, b"after", map.epoch, &[1u8; 4096]),
    );
    assert_eq!(s, nvstore::wire::Status::StaleEpoch);
    c.config(member, Some(("inject_shard_apply_delay_ms", "0")))
        .unwrap();
    mp.shutdown();
    mq.shutdown();
}

/// The restart window (src/node/mod.rs `boot_gate`): a restarted node serves its messenger
/// before the monitor has answered its Boot, and its map may be older than what the cluster
/// has moved on to. A shard write that arrives then is refused (`StaleEpoch`, "is starting")
/// and counted (`node.boot_gate_refused`); once the Boot is answered and the node's map has
/// reached its boot epoch the node serves again. The window is held open by the fault-
/// injection knob `inject_boot_delay_ms`, on a fixed listen port so the test can reach the
/// node before it has registered its address.
#[test]
fn a_restarted_node_refuses_shard_ops_until_its_boot_is_answered() {
    use messenger::Identity;
    use nvstore::config::{write_toml, NodeConfig};
    use nvstore::wire::{self, Status};

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("gate", 2, 1, 4096, 8, None).unwrap();
    let objects = put_objects(c, pool, "g", 900, 6);
    let map = c.map();
    let p = &map.pools[&pool];
    let a = Acting::compute(&map, p, pg_of(p, b"gate-probe"));
    let primary = a.primary.unwrap();
    let member = a.members[1].unwrap();
    assert_ne!(primary, member);

    // Restart the member on a fixed port, with its Boot held back.
    let name = format!("node.{member}");
    let conf = h.lc.dir.join(&name).join("node.toml");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = NodeConfig::load(&conf).unwrap();
    cfg.listen = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    cfg.inject_boot_delay_ms = 4000;
    write_toml(&conf, &cfg).unwrap();
    h.lc.stop_member(&name, true).unwrap();
    h.lc.start_member(&name).unwrap();

    // As the PG's primary (still so in every map), write the member's shard.
    let m = h.raw_messenger(Identity::Node(primary));
    let data = vec![5u8; 4096];
    let shard_write = |epoch: u64| shard_write_payload(pool, a.pg, b"gate-probe", epoch, &data);
    let t = Instant::now();
    let conn = loop {
        match m.connect(cfg.listen, Identity::Node(member)) {
            Ok(conn) => break conn,
            Err(e) => {
                assert!(t.elapsed() < WAIT, "the restarted node never listened: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let (s, msg) = ask(&conn, wire::MSG_SHARD_WRITE, shard_write(c.map().epoch));
    let booted_meanwhile = c.map().nodes[&member].addr == cfg.listen;
    assert!(!booted_meanwhile, "the Boot was not held back");
    assert_eq!(
        s,
        Status::StaleEpoch,
        "a write before the Boot is answered: {msg}"
    );
    assert!(msg.contains("is starting"), "{msg}");

    // Once registered (its new address in the map) the node takes the primary's writes.
    wait_until("the member's Boot", || {
        let _ = c.refresh_map();
        let n = &c.map().nodes[&member];
        n.up && n.addr == cfg.listen
    });
    let (s, msg) = ask(&conn, wire::MSG_SHARD_WRITE, shard_write(c.map().epoch));
    assert_eq!(s, Status::Ok, "a write after the Boot: {msg}");
    let refused = c.perf_dump(member).unwrap()["node"]["boot_gate_refused"]
        .as_u64()
        .unwrap();
    assert!(refused >= 1, "boot_gate_refused = {refused}");
    let log = std::fs::read_to_string(h.lc.dir.join(format!("{name}.log"))).unwrap();
    assert!(log.contains("holding the Boot"), "the knob took effect");
    m.shutdown();
    // The cluster serves as before.
    read_all(c, pool, &objects);
}

/// The lagging-primary resolve (src/node/primary.rs `resolve`, eighth stop): a member that
/// has heard from a newer primary of the PG answers the old primary's shard stats with
/// `StaleEpoch`. Resolve used to count such members as silent, so a readable object was
/// reported unavailable; the old primary must hand the client `StaleEpoch` instead (the client
/// then refreshes its map and retries at the new primary). Here a node identity plays the
/// newer primary: it asks both other members of a k = 2, m = 1 PG for the PG log at epoch + 1
/// (as in the interval test). The real primary, restarted so it has nothing cached, then
/// resolves a stat for a client: only its own shard answers. Before the fix the reply was
/// `Unavailable`.
#[test]
fn a_superseded_primary_sends_the_client_on_instead_of_calling_the_object_unavailable() {
    use messenger::Identity;
    use nvstore::ops::{ClientOp, SubOp};
    use nvstore::wire::{self, Enc, Status};

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(8);
    let c = &h.client;
    let pool = c.create_pool("lag", 2, 1, 4096, 8, None).unwrap();
    c.put(pool, b"lagging", b"readable bytes").unwrap();
    let map = c.map();
    let p = &map.pools[&pool];
    let pg = pg_of(p, b"lagging");
    let primary = Acting::compute(&map, p, pg).primary.unwrap();
    h.lc.stop_member(&format!("node.{primary}"), true).unwrap();
    wait_up(c, primary, false);
    h.lc.start_member(&format!("node.{primary}")).unwrap();
    wait_up(c, primary, true);
    let map = c.map();
    let a = Acting::compute(&map, &map.pools[&pool], pg);
    assert_eq!(a.primary, Some(primary), "back up, it leads the PG again");
    let others: Vec<u32> = a
        .members
        .iter()
        .flatten()
        .copied()
        .filter(|m| *m != primary)
        .collect();
    assert_eq!(others.len(), 2);
    let newer = (1..=8).find(|n| !a.members.contains(&Some(*n))).unwrap();
    let q = h.raw_messenger(Identity::Node(newer));
    for m in &others {
        let conn = q.connect(map.nodes[m].addr, Identity::Node(*m)).unwrap();
        let mut e = Enc::new(map.epoch + 1);
        e.u64(pool).u32(pg);
        let (s, msg) = ask(&conn, wire::MSG_PG_LOG, e.finish());
        assert_eq!(s, Status::Ok, "member {m}: {msg}");
    }

    let me = h.raw_messenger(Identity::Client(4242));
    let conn = me
        .connect(map.nodes[&primary].addr, Identity::Node(primary))
        .unwrap();
    let stat = ClientOp {
        epoch: map.epoch,
        pool,
        name: b"lagging",
        flags: 0,
        upload_id: 0,
        reqid: 0,
        ops: vec![SubOp::Stat],
    }
    .encode();
    let (s, msg) = ask(&conn, wire::MSG_CLIENT_OP, stat);
    assert_eq!(s, Status::StaleEpoch, "{msg}");
    assert!(msg.contains(&format!("node.{newer}")), "{msg}");
    q.shutdown();
    me.shutdown();
}

/// A node marked down is not redialled: each survivor closes its kept connection to it
/// (`nvstore::peers`) instead of the messenger reconnecting every couple of seconds, logging
/// each refusal, for as long as the node stays down; once it is back, the survivors connect
/// to it afresh and every object reads back.
#[test]
fn survivors_stop_redialling_a_node_marked_down_and_reconnect_when_it_is_back() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // k + m = 4 nodes: every PG has every node, so a primary talks to all three others.
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("p", 2, 2, 4096, 16, None).unwrap();
    let mut objects = put_objects(c, pool, "obj", 0, 48);
    wait_recovered(c, |_| true);
    let node = |id: u32, k: &str| c.perf_dump(id).unwrap()["node"][k].as_u64().unwrap();
    let reconnects = |id: u32| {
        c.perf_dump(id).unwrap()["messenger"]["reconnects"]
            .as_u64()
            .unwrap()
    };
    let victim = 4;
    let survivors = [1, 2, 3];
    // The survivors that lead a PG hold a connection to every other node.
    let talking: Vec<u32> = survivors
        .into_iter()
        .filter(|&id| node(id, "peer_conns") == 3)
        .collect();
    assert!(
        !talking.is_empty(),
        "no survivor connected to all three others"
    );

    h.lc.stop_member(&format!("node.{victim}"), true).unwrap();
    wait_up(c, victim, false);
    wait_until(
        "the survivors to close their connections to the down node",
        || {
            talking
                .iter()
                .all(|&id| node(id, "peer_conns_closed") >= 1 && node(id, "peer_conns") == 2)
        },
    );
    // Nothing redials it: over 2.5 × the messenger's reconnect backoff cap (2 s), no
    // survivor counts a single reconnect (the monitor and the other survivors stay up).
    let before: Vec<u64> = survivors.iter().map(|&id| reconnects(id)).collect();
    std::thread::sleep(Duration::from_secs(5));
    let after: Vec<u64> = survivors.iter().map(|&id| reconnects(id)).collect();
    assert_eq!(
        before, after,
        "survivors {survivors:?} kept redialling node {victim} after the map marked it down"
    );

    // Objects written while it is down, then it comes back and is caught up.
    for i in 100..108 {
        let (n, d) = (format!("down-{i}"), bytes(i as u64, size_of(i)));
        c.put(pool, n.as_bytes(), &d).unwrap();
        objects.push((n, d));
    }
    h.lc.start_member(&format!("node.{victim}")).unwrap();
    wait_up(c, victim, true);
    wait_recovered(c, |_| true);
    wait_until(
        "the survivors to connect to the returned node again",
        || talking.iter().all(|&id| node(id, "peer_conns") == 3),
    );
    // The others gone, every object must come from the returned node and node 1.
    h.kill_nodes(&[2, 3]);
    read_all(c, pool, &objects);
}

/// Append request 77 ("entry;") to `log` = "start;" through its primary, run `between`
/// (other writes), kill that primary, and send request 77 again, to the new one: (harness,
/// pool, the raw messenger, the version the first send made, the version the resend got).
fn resend_after_the_primary_dies(
    pool_name: &str,
    between: impl Fn(&Client, u64),
) -> (Harness, u64, messenger::Messenger, u64, u64) {
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool(pool_name, 2, 2, 4096, 8, None).unwrap();
    c.put(pool, b"log", b"start;").unwrap();
    let m = h.raw_messenger(messenger::Identity::Client(4343));
    let (first, v1) = h.raw_append(&m, pool, b"log", 77);
    between(c, pool);
    h.kill_nodes(&[first]);
    wait_up(c, first, false);
    let (second, v2) = h.raw_append(&m, pool, b"log", 77);
    assert_ne!(second, first, "the PG has a new primary");
    (h, pool, m, v1, v2)
}

/// A resend that reaches a new primary — the first one died before its reply got out — is
/// recognised by the object: each shard keeps the request id of the write that made its
/// version, so the new primary answers with that version instead of applying it again. A new
/// request id is a new op.
#[test]
fn a_resend_to_a_new_primary_is_recognised_by_the_object() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (h, pool, m, v1, v2) = resend_after_the_primary_dies("resend", |_, _| {});
    let c = &h.client;
    assert_eq!(v2, v1, "the resend reports the version the first send made");
    assert_eq!(c.get(pool, b"log").unwrap(), b"start;entry;");
    assert_eq!(c.stat(pool, b"log").unwrap().version, v1);
    let (_, v3) = h.raw_append(&m, pool, b"log", 78);
    assert!(v3 > v1);
    assert_eq!(c.get(pool, b"log").unwrap(), b"start;entry;entry;");
    m.shutdown();
}

/// The same, when other writes changed the object between the first send and the resend
/// (another client's append, an xattr): the object's shards keep the request ids of its
/// last writes, so the new primary still answers the resend with the version it made.
#[test]
fn a_resend_to_a_new_primary_is_recognised_after_the_object_was_written_again() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (h, pool, m, v1, v2) = resend_after_the_primary_dies("resend2", |c, pool| {
        c.append(pool, b"log", b"other;").unwrap();
        c.set_xattr(pool, b"log", "k", b"v").unwrap();
    });
    let c = &h.client;
    assert!(c.stat(pool, b"log").unwrap().version > v1);
    assert_eq!(v2, v1, "the resend reports the version the first send made");
    assert_eq!(c.get(pool, b"log").unwrap(), b"start;entry;other;");
    m.shutdown();
}

/// A shard can carry the request id of a write that was never acknowledged: here only the
/// future primary took its shard before the old primary died. The new primary rolls that
/// write back when it resolves the object (its recovery pass, or the resend's own resolve),
/// which drops the request id with it, so a resend of the request is applied once — not
/// answered with the version of the write that was undone.
#[test]
fn a_resend_is_not_answered_for_a_write_that_was_rolled_back() {
    use nvstore::node::local::{
        ReqHistory, ReqId, ShardData, ShardMeta, ShardWrite, WriteKind, BASE_ANY,
    };

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("undone", 2, 2, 4096, 8, None).unwrap();
    c.put(pool, b"log", b"start;").unwrap();
    let put_version = c.stat(pool, b"log").unwrap().version;
    let map = c.map();
    let p = &map.pools[&pool];
    let a = Acting::compute(&map, p, pg_of(p, b"log"));
    let primary = a.primary.unwrap();
    // The member that leads the PG once the primary is down: the first other up member.
    let (slot, next) = a
        .members
        .iter()
        .enumerate()
        .find_map(|(s, m)| m.filter(|n| *n != primary).map(|n| (s, n)))
        .unwrap();
    let client = messenger::Identity::Client(4343);
    // The primary's shard write of an append with request id 99 that reached `next` only.
    let written = (map.epoch << 32) | 0xfff;
    let data = b"start;entry;".to_vec();
    let w = ShardWrite {
        pool,
        pg: a.pg,
        name: b"log",
        shard: slot as u8,
        kind: WriteKind::Full,
        base_version: BASE_ANY,
        meta: ShardMeta {
            version: written,
            size: data.len() as u64,
            mtime_unix_ns: 1,
            deleted: false,
        },
        offset: 0,
        xattrs: vec![],
        reqs: ReqHistory::default().after(
            Some(ReqId {
                who: client,
                id: 99,
            }),
            written,
        ),
        data: ShardData::Flat(&data),
        chunk_crcs: Vec::new(),
        listed_crcs: Vec::new(),
    };
    let mut payload = w.encode_header(map.epoch);
    payload.extend_from_slice(&data);
    let as_primary = h.raw_messenger(messenger::Identity::Node(primary));
    let conn = as_primary
        .connect(map.nodes[&next].addr, messenger::Identity::Node(next))
        .unwrap();
    let (status, message) = ask(&conn, nvstore::wire::MSG_SHARD_WRITE, payload);
    assert_eq!(status, nvstore::wire::Status::Ok, "{message}");
    as_primary.shutdown();

    h.kill_nodes(&[primary]);
    wait_up(c, primary, false);
    let m = h.raw_messenger(client);
    let (leader, v) = h.raw_append(&m, pool, b"log", 99);
    assert_eq!(leader, next);
    assert_ne!(
        v, written,
        "answered with the version of a write that was undone"
    );
    assert!(v > put_version);
    assert_eq!(c.get(pool, b"log").unwrap(), b"start;entry;");
    assert_eq!(c.stat(pool, b"log").unwrap().version, v);
    m.shutdown();
}

/// Appends from three clients to three shared objects while the primaries of their PGs are
/// killed (SIGKILL) and restarted, one at a time: the client resends an op whose reply did
/// not come to whichever node leads the PG next, with the same request id. Every
/// acknowledged append is in its object exactly once, every failed one at most once, and
/// each client's appends to an object are in the order it made them — whether the resend
/// was answered by the node that applied it, or by a new primary from the objects' request
/// history, or applied for the first time.
#[test]
fn appends_land_exactly_once_while_primaries_are_killed_and_restarted() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(5);
    let c = &h.client;
    let pool = c.create_pool("once", 2, 2, 4096, 8, None).unwrap();
    let logs: Vec<String> = (0..3).map(|i| format!("log{i}")).collect();
    for l in &logs {
        c.put(pool, l.as_bytes(), b"").unwrap();
    }
    // (client, seq) → (log, acknowledged)
    let sent: Mutex<HashMap<(u64, u64), (usize, bool)>> = Mutex::new(HashMap::new());
    let stop = AtomicBool::new(false);
    let mut killed = Vec::new();
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (sent, stop, logs) = (&sent, &stop, &logs);
            let conf = h.lc.dir.join("client.toml");
            s.spawn(move || {
                let c = Client::from_config(&conf).unwrap();
                let mut i = 0u64;
                while !stop.load(Relaxed) {
                    let log = ((t + i * 7 + i / 3) % 3) as usize;
                    let token = format!("{t}.{i};");
                    let ok = c
                        .append(pool, logs[log].as_bytes(), token.as_bytes())
                        .is_ok();
                    sent.lock().unwrap().insert((t, i), (log, ok));
                    i += 1;
                }
            });
        }
        for round in 0..3 {
            std::thread::sleep(Duration::from_millis(700));
            let _ = c.refresh_map();
            let map = c.map();
            let p = &map.pools[&pool];
            let name = logs[round % 3].as_bytes();
            let victim = Acting::compute(&map, p, pg_of(p, name)).primary.unwrap();
            h.kill_nodes(&[victim]);
            std::thread::sleep(Duration::from_millis(700));
            h.lc.start_member(&format!("node.{victim}")).unwrap();
            wait_up(c, victim, true);
            killed.push(victim);
        }
        std::thread::sleep(Duration::from_millis(700));
        stop.store(true, Relaxed);
    });
    let sent = sent.into_inner().unwrap();
    let acked = sent.values().filter(|(_, ok)| *ok).count();
    assert!(acked > 30, "the workload ran: {acked} acknowledged");
    let mut seen: HashMap<(u64, u64), usize> = HashMap::new();
    for (l, name) in logs.iter().enumerate() {
        let got = c.get(pool, name.as_bytes()).unwrap();
        let text = String::from_utf8(got).unwrap();
        let mut last: HashMap<u64, u64> = HashMap::new();
        for token in text.split(';').filter(|t| !t.is_empty()) {
            let (t, i) = token.split_once('.').unwrap();
            let key: (u64, u64) = (t.parse().unwrap(), i.parse().unwrap());
            let (log, _) = sent
                .get(&key)
                .unwrap_or_else(|| panic!("{name}: {token} was never sent"));
            assert_eq!(*log, l, "{token} landed in {name}");
            if let Some(prev) = last.insert(key.0, key.1) {
                assert_ne!(
                    prev, key.1,
                    "{name}: {token} twice in a row (applied twice)"
                );
                assert!(
                    prev < key.1,
                    "{name}: client {} out of order: {prev} before {}",
                    key.0,
                    key.1
                );
            }
            *seen.entry(key).or_default() += 1;
        }
    }
    let mut failed = 0;
    for (key, (_, ok)) in &sent {
        let n = seen.get(key).copied().unwrap_or(0);
        if *ok {
            assert_eq!(n, 1, "acknowledged append {key:?} is there exactly once");
        } else {
            failed += 1;
            assert!(n <= 1, "failed append {key:?} is there at most once ({n})");
        }
    }
    eprintln!(
        "{} appends, {acked} acknowledged, {failed} failed; killed and restarted {killed:?}",
        sent.len()
    );
}

/// An overwrite keeps the old bytes on each member for a rollback until its primary has seen
/// it acknowledged, and a remove keeps the whole old object that way; then the primary has
/// the members drop those records (SHARD_SETTLE). So the stores' live bytes come back to one
/// copy after overwrites, and to next to nothing after removes — they stayed at two copies,
/// and a removed object's bytes stayed live, before. Objects of 300 kB keep their old shard
/// bytes in an object of their own, 40 kB ones inline in the record; a 200 kB write in place
/// (~100 kB a shard) has its old bytes dropped too.
#[test]
fn overwrites_and_removes_give_back_the_space_of_the_old_bytes() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(4);
    let c = &h.client;
    let pool = c.create_pool("space", 2, 2, 4096, 8, None).unwrap();
    let live = || (1..=4).map(|n| live_bytes(c, n)).sum::<u64>();
    let dropped = || {
        (1..=4)
            .map(|n| counter(c, n, "recovery", "rollbacks_dropped"))
            .sum::<u64>()
    };
    let size = |i: usize| if i.is_multiple_of(2) { 300_000 } else { 40_000 };
    let names: Vec<String> = (0..12).map(|i| format!("big-{i}")).collect();
    let before = live();
    for (i, n) in names.iter().enumerate() {
        c.put(pool, n.as_bytes(), &bytes(i as u64, size(i)))
            .unwrap();
    }
    // Shards hold twice the data (k = 2, m = 2).
    let one_copy: u64 = (0..12).map(|i| 2 * size(i) as u64).sum();
    let put = live() - before;
    assert!(
        put >= one_copy && put < one_copy * 5 / 4,
        "{put} live after the puts"
    );
    for (i, n) in names.iter().enumerate() {
        c.put(pool, n.as_bytes(), &bytes(100 + i as u64, size(i)))
            .unwrap();
    }
    // Every overwrite replaced the bytes of all four slots.
    wait_until("the overwrites' rollback records to be dropped", || {
        dropped() >= 12 * 4
    });
    let over = live() - before;
    assert!(
        over < one_copy * 5 / 4,
        "{over} live after the overwrites ({one_copy} data)"
    );
    // 200 kB written in place at the start of each 300 kB object: ~100 kB on each of the
    // four shards, whose old bytes go too (a range under 64 KiB a shard would keep them).
    let mut want: Vec<Vec<u8>> = (0..12).map(|i| bytes(100 + i as u64, size(i))).collect();
    for (i, n) in names
        .iter()
        .enumerate()
        .filter(|(i, _)| size(*i) == 300_000)
    {
        let patch = bytes(200 + i as u64, 200_000);
        c.write(pool, n.as_bytes(), 0, &patch).unwrap();
        want[i][..200_000].copy_from_slice(&patch);
    }
    wait_until("the range writes' rollback records to be dropped", || {
        dropped() >= 12 * 4 + 6 * 4
    });
    let ranged = live() - before;
    assert!(
        ranged < one_copy * 5 / 4,
        "{ranged} live after the range writes ({one_copy} data)"
    );
    for (i, n) in names.iter().enumerate() {
        assert!(c.get(pool, n.as_bytes()).unwrap() == want[i]);
    }
    for n in &names {
        c.remove(pool, n.as_bytes()).unwrap();
    }
    wait_until("the removes' rollback records to be dropped", || {
        dropped() >= 2 * 12 * 4 + 6 * 4
    });
    let gone = live() - before;
    assert!(
        gone < one_copy / 10,
        "{gone} live after the removes ({one_copy} data)"
    );
    for n in &names {
        assert!(c.get(pool, n.as_bytes()).is_err(), "{n} is gone");
    }
}

/// Removed objects leave nothing behind: `tombstone_keep_s` after a remove, the members
/// forget its tombstone (the shards' index entries and records; before, every removed
/// object kept them for ever). A member down during the removes comes back with the old
/// shards of the removed objects — overwritten once, so no rollback record undoes them:
/// recovery finds them older than what the members complete past them know and drops them,
/// instead of bringing the objects back or failing on them. A removed name can be written
/// again.
#[test]
fn removed_objects_are_forgotten_and_a_returning_member_does_not_bring_them_back() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // k + m = 4 nodes: every node holds a shard of every object.
    let h = cluster_keeping_tombstones(4, 1);
    let c = &h.client;
    let pool = c.create_pool("forget", 2, 2, 4096, 8, None).unwrap();
    let names: Vec<String> = (0..24).map(|i| format!("f-{i}")).collect();
    let data = |round: u64, i: usize| bytes(round * 100 + i as u64, 50_000);
    for round in 0..2 {
        for (i, n) in names.iter().enumerate() {
            c.put(pool, n.as_bytes(), &data(round, i)).unwrap();
        }
    }
    wait_recovered(c, |_| true);
    let victim = 2;
    let up: Vec<u32> = (1..=4).filter(|n| *n != victim).collect();
    let sum = |name: &str| {
        up.iter()
            .map(|n| counter(c, *n, "recovery", name))
            .sum::<u64>()
    };
    let victim_live = live_bytes(c, victim);
    h.kill_nodes(&[victim]);
    let keys_before: Vec<u64> = up.iter().map(|n| store_sum(c, *n, "objects")).collect();
    let (removed, kept) = names.split_at(12);
    for n in removed {
        c.remove(pool, n.as_bytes()).unwrap();
    }
    // Each remove left a tombstone on the three up members.
    wait_until("the up members to forget the tombstones", || {
        sum("tombstones_forgotten") >= 12 * 3
    });
    assert_eq!(sum("tombstones_forgotten"), 12 * 3);
    // Not every slot has answered: the lists keep them for the member that is down.
    assert_eq!(sum("forgets_sent"), 0);
    // A remove replaced a shard by a tombstone and added a PG log entry; the tombstone is
    // gone, so each up member holds no more keys than before the removes.
    for (n, before) in up.iter().zip(&keys_before) {
        let now = store_sum(c, *n, "objects");
        assert!(
            now <= *before,
            "node {n}: {now} keys, {before} before the removes"
        );
    }
    for n in removed {
        let e = c.stat(pool, n.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("no object"), "{n}: {e}");
    }

    // The member that missed the removes comes back with their old shards.
    h.lc.start_member(&format!("node.{victim}")).unwrap();
    wait_up(c, victim, true);
    let s = wait_recovered(c, |s| {
        s.pg_states.keys().all(|k| k == "active+clean") && s.recovery.objects_left == 0
    });
    assert_eq!(s.recovery.failures, 0, "{:?}", s.recovery);
    assert_eq!(
        counter(c, victim, "recovery", "stale_shards_dropped"),
        12,
        "the returning member's shards of the removed objects"
    );
    let listed: Vec<String> = c
        .list(pool)
        .unwrap()
        .into_iter()
        .map(|(n, _)| String::from_utf8(n).unwrap())
        .collect();
    let mut want = kept.to_vec();
    want.sort();
    assert_eq!(listed, want);
    for n in removed {
        let e = c.stat(pool, n.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("no object"), "{n}: {e}");
    }
    let now = live_bytes(c, victim);
    assert!(
        now < victim_live * 6 / 10,
        "the returning member holds {now} live bytes, {victim_live} before the removes"
    );

    // A member that took removes but went down before their tombstones were due forgets
    // them once it is back. (Removes led by that member itself are in its lost list: the
    // next scrub's, below.)
    let other = 3;
    let map = c.map();
    let p = &map.pools[&pool];
    let (second, kept): (Vec<&String>, Vec<&String>) = kept
        .iter()
        .partition(|n| Acting::compute(&map, p, pg_of(p, n.as_bytes())).primary != Some(other));
    let second = &second[..second.len().min(6)];
    assert!(second.len() >= 3, "{second:?}");
    let rest: Vec<u32> = (1..=4).filter(|n| *n != other).collect();
    let forgotten = || {
        rest.iter()
            .map(|n| counter(c, *n, "recovery", "tombstones_forgotten"))
            .sum::<u64>()
    };
    let before = forgotten();
    for n in second {
        c.remove(pool, n.as_bytes()).unwrap();
    }
    h.lc.stop_member(&format!("node.{other}"), true).unwrap();
    wait_until("the other members to forget the new tombstones", || {
        forgotten() >= before + 3 * second.len() as u64
    });
    h.lc.start_member(&format!("node.{other}")).unwrap();
    wait_up(c, other, true);
    wait_until("the member back to forget its tombstones", || {
        counter(c, other, "recovery", "tombstones_forgotten") >= second.len() as u64
    });
    assert_eq!(
        counter(c, other, "recovery", "tombstones_forgotten"),
        second.len() as u64
    );
    wait_recovered(c, |s| {
        s.pg_states.keys().all(|k| k == "active+clean") && s.recovery.objects_left == 0
    });
    assert_eq!(c.list(pool).unwrap().len(), kept.len());
    // A removed name can be written again; everything reads back from the returning
    // member and one other.
    c.put(pool, removed[0].as_bytes(), &data(7, 0)).unwrap();
    h.kill_nodes(&[up[0], up[1]]);
    for (i, n) in names.iter().enumerate().filter(|(_, n)| kept.contains(n)) {
        assert!(c.get(pool, n.as_bytes()).unwrap() == data(1, i), "{n}");
    }
    assert!(c.get(pool, removed[0].as_bytes()).unwrap() == data(7, 0));
}

/// What the primaries' lists no longer hold — every node restarted right after removes and
/// overwrites — is found by the next scrub pass: the removed objects' tombstones are
/// forgotten and the overwritten objects' rollback records (their old bytes) dropped then.
#[test]
fn what_a_restart_left_behind_is_given_back_by_the_next_scrub() {
    use nvstore::scrub_cmd::scrub_call;

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster_keeping_tombstones(4, 3);
    let c = &h.client;
    let pool = c.create_pool("scrubbed", 2, 2, 4096, 8, None).unwrap();
    let names: Vec<String> = (0..10).map(|i| format!("t-{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        c.put(pool, n.as_bytes(), &bytes(i as u64, 20_000)).unwrap();
    }
    // 100 kB objects: 50 kB a shard, whose old bytes an overwrite spills to a key of their own.
    let big: Vec<String> = (0..10).map(|i| format!("o-{i}")).collect();
    for (i, n) in big.iter().enumerate() {
        c.put(pool, n.as_bytes(), &bytes(50 + i as u64, 100_000))
            .unwrap();
    }
    wait_recovered(c, |_| true);
    let live = || (1..=4).map(|n| live_bytes(c, n)).sum::<u64>();
    let before = live();
    for n in &names {
        c.remove(pool, n.as_bytes()).unwrap();
    }
    for (i, n) in big.iter().enumerate() {
        c.put(pool, n.as_bytes(), &bytes(80 + i as u64, 100_000))
            .unwrap();
    }
    // Every node restarts at once, before the lists are sent (every 2 s) and long before the
    // tombstones are due.
    for id in 1..=4 {
        h.lc.stop_member(&format!("node.{id}"), true).unwrap();
    }
    for id in 1..=4 {
        h.lc.start_member(&format!("node.{id}")).unwrap();
    }
    for id in 1..=4 {
        wait_up(c, id, true);
    }
    wait_recovered(c, |s| {
        s.pg_states.keys().all(|k| k == "active+clean") && s.recovery.objects_left == 0
    });
    let sum = |name: &str| {
        (1..=4)
            .map(|n| counter(c, n, "recovery", name))
            .sum::<u64>()
    };
    // Past `tombstone_keep_s`, and two rounds of the recovery loop: nothing names them.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(sum("tombstones_forgotten"), 0);
    assert_eq!(sum("rollbacks_dropped"), 0);
    // 10 × 100 kB × 2 (k = 2, m = 2) of old bytes kept.
    let old_bytes = 10 * 100_000 * 2;
    let kept = live();
    assert!(
        kept > before + old_bytes * 3 / 4,
        "{kept} live, {before} before"
    );
    for id in 1..=4 {
        scrub_call(c, id, 1).unwrap();
    }
    wait_until(
        "scrub to give back the tombstones and the old bytes",
        || sum("tombstones_forgotten") >= 10 * 4 && sum("rollbacks_dropped") >= 10 * 4,
    );
    assert_eq!(sum("tombstones_forgotten"), 10 * 4);
    let after = live();
    assert!(
        after < before + old_bytes / 4,
        "{after} live after the scrub, {before} before the overwrites"
    );
    for n in &names {
        let e = c.stat(pool, n.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("no object"), "{n}: {e}");
    }
    for (i, n) in big.iter().enumerate() {
        assert!(c.get(pool, n.as_bytes()).unwrap() == bytes(80 + i as u64, 100_000));
    }
}

/// A node marked out while it runs keeps shards of PGs it is no longer a member of; marked
/// in again, the nodes that stood in for it keep theirs. Each removes them once the PG is
/// clean on its members (the primary says so): the stores' live bytes come back to what
/// the data needs, and with two other nodes dead every object still reads back. Before,
/// those stray shards kept their space for ever.
#[test]
fn shards_of_pgs_a_node_left_are_removed_once_the_pg_is_clean() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(5);
    let c = &h.client;
    let pool = c.create_pool("strays", 2, 2, 4096, 8, None).unwrap();
    let objects = put_objects(c, pool, "s", 0, 30);
    wait_recovered(c, |_| true);
    let live_of = |n: u32| live_bytes(c, n);
    let removed = |n: u32| counter(c, n, "recovery", "stray_keys_removed");
    let total = || (1..=5).map(live_of).sum::<u64>();
    let before = total();
    let victim = 3;
    assert!(live_of(victim) > 0);
    mark_out(&h, victim);
    wait_recovered(c, |s| {
        s.pg_states.keys().all(|k| k == "active+clean") && s.recovery.objects_left == 0
    });
    // The node marked out gives back what it held once its PGs are clean elsewhere.
    wait_until("the out node to remove its stray shards", || {
        removed(victim) > 0 && live_of(victim) < before / 50
    });
    read_all(c, pool, &objects);
    mark(&h, victim, "in");
    wait_recovered(c, |s| {
        s.pg_states.keys().all(|k| k == "active+clean") && s.recovery.objects_left == 0
    });
    // The nodes that stood in for it give back theirs.
    wait_until("the stand-ins to remove their stray shards", || {
        total() < before + before / 20
    });
    assert!(
        (1..=5).filter(|n| *n != victim).any(|n| removed(n) > 0),
        "a stand-in removed keys"
    );
    assert!(live_of(victim) > 0, "the node is a member again");
    read_all(c, pool, &objects);
    let others: Vec<u32> = (1..=5).filter(|i| *i != victim).take(2).collect();
    h.kill_nodes(&others);
    read_all(c, pool, &objects);
}

/// Nodes 1..=`started` of a cluster created with `nodes` nodes (their configs and devices
/// made, the rest not started: they join when started later).
fn cluster_partly_started(nodes: u32, started: u32) -> Harness {
    let dir = tempfile::Builder::new()
        .prefix("nvstore-recovery-test-")
        .tempdir()
        .unwrap();
    let lc = nvstore::cluster_cmd::LocalCluster::new(
        dir.path(),
        std::path::Path::new(env!("CARGO_BIN_EXE_nvstore")),
    );
    lc.create(&options(nodes, LocalOptions::default().tombstone_keep_s))
        .unwrap();
    let start = || -> nvstore::Result<Client> {
        lc.start_member("mon.1")?;
        for n in 1..=started {
            lc.start_member(&format!("node.{n}"))?;
        }
        let t = Instant::now();
        loop {
            match Client::from_config(&lc.client_config()) {
                Ok(c) => return Ok(c),
                Err(e) if t.elapsed() > WAIT => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    };
    let client = match start() {
        Ok(c) => c,
        Err(e) => {
            let _ = lc.down();
            panic!("cluster start: {e}");
        }
    };
    let h = Harness {
        lc,
        client,
        _dir: dir,
    };
    for n in 1..=started {
        wait_up(&h.client, n, true);
    }
    h
}

/// A node that joins can win an earlier slot of a PG from a member that then wins a later
/// slot it could not draw before: that member stays in the PG at another slot, beside its
/// shards of the old one. Once the PG is clean it removes those (nothing reads them), keeps
/// the new slot's, and every object still reads back with two nodes dead. Before, the old
/// slot's shards kept their space for ever.
#[test]
fn a_member_moved_to_another_slot_gives_back_the_old_slots_shards() {
    use nvstore::node::scrub::locate_request;
    use nvstore::placement::pg_members;

    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster_partly_started(5, 4);
    let c = &h.client;
    // k + m = 4 nodes: before node 5 joins, every node holds a shard of every object.
    let pool = c.create_pool("slots", 2, 2, 4096, 16, None).unwrap();
    let objects = put_objects(c, pool, "m", 0, 48);
    let clean = |s: &StatusReport| {
        s.pg_states.keys().all(|k| k == "active+clean") && s.recovery.objects_left == 0
    };
    wait_recovered(c, clean);
    let map = c.map();
    let p = map.pools[&pool].clone();
    let before: Vec<Vec<Option<u32>>> = (0..p.pg_num).map(|pg| pg_members(&map, &p, pg)).collect();

    h.lc.start_member("node.5").unwrap();
    wait_up(c, 5, true);
    let map = c.map();
    // (pg, node, old slot, new slot) of the members node 5's arrival moved within a PG.
    let mut moved = Vec::new();
    for pg in 0..p.pg_num {
        let after = pg_members(&map, &p, pg);
        for (old, n) in before[pg as usize].iter().enumerate() {
            let Some(n) = *n else { continue };
            if let Some(new) = after.iter().position(|m| *m == Some(n)) {
                if new != old {
                    moved.push((pg, n, old as u8, new as u8));
                }
            }
        }
    }
    assert!(!moved.is_empty(), "node 5 moved no member to another slot");
    let has = |node: u32, name: &str, slot: u8| {
        c.node_call(
            node,
            nvstore::wire::MSG_NODE_LOCATE,
            &locate_request(pool, name.as_bytes(), slot),
        )
        .is_ok()
    };
    let of_pg = |pg: u32| -> Vec<&str> {
        objects
            .iter()
            .filter(|(n, _)| pg_of(&p, n.as_bytes()) == pg)
            .map(|(n, _)| n.as_str())
            .collect()
    };
    let shards: usize = moved.iter().map(|(pg, ..)| of_pg(*pg).len()).sum();
    assert!(shards > 0, "{moved:?}");
    wait_recovered(c, clean);
    wait_until(
        "the moved members to remove their old slots' shards",
        || {
            moved
                .iter()
                .all(|(pg, n, old, _)| of_pg(*pg).iter().all(|name| !has(*n, name, *old)))
        },
    );
    for (pg, n, _, new) in &moved {
        for name in of_pg(*pg) {
            assert!(
                has(*n, name, *new),
                "node {n} lacks {name} of its slot {new}"
            );
        }
        assert!(counter(c, *n, "recovery", "stray_keys_removed") > 0);
    }
    read_all(c, pool, &objects);
    h.kill_nodes(&[1, 2]);
    read_all(c, pool, &objects);
}
