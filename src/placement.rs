//! Placement: object → PG by a stable hash; PG → an ordered list of k + m nodes by weighted
//! rendezvous hashing (straw2-like) over nodes, with the host as a constraint.
//!
//! Slot `i` of a PG (which holds EC shard `i`) is drawn over nodes: every node with weight
//! draws `ln(u) / weight` from a hash of (pool, pg, node, slot, attempt) and the largest draw
//! wins. The draws are keyed by node, never by host, so a node's host only matters as a
//! constraint: a slot whose node sits on a host an earlier slot already holds draws again
//! (among hosts no slot holds). Consequences: adding, removing, marking up/down or in/out one
//! node changes only the PGs that involve it; moving a node to a host no member of a PG is on
//! changes no PG; moving it onto a host that holds another member of a PG changes only that
//! PG's later slot of the two. Down nodes stay members (their shards are served degraded); out
//! nodes are not drawn.

use crate::map::{ClusterMap, PoolInfo};

/// Independent draws per slot before falling back to the best usable node.
const ATTEMPTS_MAX: u32 = 64;

/// splitmix64 finaliser: a well-mixed 64-bit hash step.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn hash_str(s: &str) -> u64 {
    mix(crc32c::crc32c(s.as_bytes()) as u64 | ((s.len() as u64) << 32))
}

/// The PG of an object: crc32c of its name, seeded by the pool, mod pg_num.
pub fn pg_of(pool: &PoolInfo, name: &[u8]) -> u32 {
    let h = crc32c::crc32c_append(crc32c::crc32c(&pool.id.to_le_bytes()), name);
    h % pool.pg_num
}

/// The straw2 draw: larger wins. `ln(u)` is negative, so a heavier weight brings it closer to 0.
fn draw(seed: u64, weight: u64) -> f64 {
    let u = ((mix(seed) >> 11) as f64 + 1.0) / (1u64 << 53) as f64; // (0, 1]
    u.ln() / weight as f64
}

/// A node as placement sees it.
struct Cand {
    id: u32,
    key: u64,
    weight: u64,
    /// Hash of the host name (the failure domain).
    host: u64,
    r#in: bool,
}

fn candidates(map: &ClusterMap) -> Vec<Cand> {
    map.nodes
        .values()
        .filter(|n| n.weight > 0)
        .map(|n| Cand {
            id: n.id,
            key: mix(n.id as u64 ^ 0x4e4f_4445_0000_0000),
            weight: n.weight as u64,
            host: hash_str(&n.host),
            r#in: n.r#in,
        })
        .collect()
}

/// The k + m members of a PG, slot by slot (`None`: no node on a distinct host left for it).
///
/// Like CRUSH's `indep` mode, in three phases, each changing only the slots it must:
/// 1. Pass after pass (attempt p in pass p) every empty slot draws over all nodes, in or out,
///    until it wins a node no other slot holds. Only node ids and weights matter here.
/// 2. In slot order, a slot whose node's host an earlier slot holds draws again among nodes
///    (in or out) on hosts no slot holds.
/// 3. A slot whose node is out (or that is still empty) draws again among in nodes on hosts
///    no slot holds.
///
/// So when a node goes out only its slot changes, and a host change touches only PGs where
/// the node now shares a host with another member.
///
/// Before phase 3, the map's pins for the PG ([`ClusterMap::pins`]) put their nodes back in
/// their slots, so phase 3 redraws around them (see [`repin`]).
pub fn pg_members(map: &ClusterMap, pool: &PoolInfo, pg: u32) -> Vec<Option<u32>> {
    let cs = candidates(map);
    let own = own_members(&cs, pool, pg);
    let pins = map
        .pins
        .get(&pool.id)
        .and_then(|p| p.get(&pg))
        .map_or(&[][..], Vec::as_slice);
    ids(&cs, &settle(&cs, pool, pg, own, pins))
}

fn ids(cs: &[Cand], chosen: &[Option<usize>]) -> Vec<Option<u32>> {
    chosen.iter().map(|c| c.map(|i| cs[i].id)).collect()
}

fn seed_of(pool: &PoolInfo, pg: u32) -> impl Fn(usize, u64) -> u64 {
    let base = mix(pool.id ^ mix(pg as u64 ^ 0x5047_0000_0000));
    move |slot: usize, attempt: u64| mix(base ^ ((slot as u64) << 8) ^ (attempt << 40))
}

/// Phases 1 and 2: each slot's own node, in or out (indices into `cs`).
fn own_members(cs: &[Cand], pool: &PoolInfo, pg: u32) -> Vec<Option<usize>> {
    let seed_of = seed_of(pool, pg);
    let n = pool.size();
    let attempts = ATTEMPTS_MAX as u64;
    let mut chosen: Vec<Option<usize>> = vec![None; n];
    // 1: distinct nodes.
    for pass in 0..attempts {
        for slot in 0..n {
            if chosen[slot].is_none() {
                if let Some(i) = best_of(cs, seed_of(slot, pass), &|_| true) {
                    if !chosen.contains(&Some(i)) {
                        chosen[slot] = Some(i);
                    }
                }
            }
        }
        if chosen.iter().all(Option::is_some) {
            break;
        }
    }
    // 2: distinct hosts (in/out not looked at, so out/in moves nothing here).
    for slot in 0..n {
        let Some(i) = chosen[slot] else { continue };
        if chosen[..slot]
            .iter()
            .flatten()
            .any(|j| cs[*j].host == cs[i].host)
        {
            let seeds = (attempts..2 * attempts).map(|a| seed_of(slot, a));
            chosen[slot] = redraw(cs, &chosen, slot, seeds, |_| true);
        }
    }
    chosen
}

/// Phase 3 from the slots' own nodes `own`: first each pin whose slot's own node is out (or
/// missing) puts its node back, if that node is in and on a host no in node of another slot
/// and no earlier pin holds; then every slot still without an in node draws again among in
/// nodes on hosts no slot holds.
fn settle(
    cs: &[Cand],
    pool: &PoolInfo,
    pg: u32,
    own: Vec<Option<usize>>,
    pins: &[(u8, u32)],
) -> Vec<Option<usize>> {
    let seed_of = seed_of(pool, pg);
    let attempts = ATTEMPTS_MAX as u64;
    let n = own.len();
    let mut chosen = own;
    let mut pinned = vec![false; n];
    for &(slot, node) in pins {
        let s = slot as usize;
        if s >= n || chosen[s].is_some_and(|i| cs[i].r#in) {
            continue;
        }
        let Some(i) = cs.iter().position(|c| c.id == node && c.r#in) else {
            continue;
        };
        let clash = (0..n).filter(|t| *t != s).any(|t| {
            chosen[t].is_some_and(|j| (cs[j].r#in || pinned[t]) && cs[j].host == cs[i].host)
        });
        if !clash {
            chosen[s] = Some(i);
            pinned[s] = true;
        }
    }
    // Out nodes (and empty slots) give way to in nodes.
    for slot in 0..n {
        if chosen[slot].is_some_and(|i| cs[i].r#in) {
            continue;
        }
        chosen[slot] = None;
        let seeds = (2 * attempts..3 * attempts).map(|a| seed_of(slot, a));
        chosen[slot] = redraw(cs, &chosen, slot, seeds, |i| cs[i].r#in);
    }
    chosen
}

/// Recompute `after.pins` once a change that may move members (`before` → `after`) applied.
///
/// Per PG: the pins still in force are kept (the slot's own node out, the pinned node in).
/// A slot whose own node is out and whose replacement (its member under `before`) is still in
/// but would now get another node is pinned to that replacement, until nothing else would
/// move. A slot's own node coming back, or its replacement going out, still moves it: those
/// changes involve the slot. Finally a pin goes if the PG's members are the same without it,
/// so a map whose nodes are all back in has no pins.
pub(crate) fn repin(before: &ClusterMap, after: &mut ClusterMap) {
    let cs = candidates(after);
    let mut all = std::collections::BTreeMap::new();
    for pool in after.pools.values() {
        if !before.pools.contains_key(&pool.id) {
            continue;
        }
        let mut per_pg = std::collections::BTreeMap::new();
        let pool_pins = before.pins.get(&pool.id);
        for pg in 0..pool.pg_num {
            let own = own_members(&cs, pool, pg);
            let own_out = |s: usize| own[s].is_none_or(|i| !cs[i].r#in);
            // Only a slot whose own node is out holds a replacement; most PGs have none.
            if !(0..own.len()).any(own_out) && pool_pins.is_none_or(|p| !p.contains_key(&pg)) {
                continue;
            }
            let old = pg_members(before, pool, pg);
            let is_in = |id: u32| cs.iter().any(|c| c.id == id && c.r#in);
            let mut pins: Vec<(u8, u32)> = before
                .pins
                .get(&pool.id)
                .and_then(|p| p.get(&pg))
                .map(|v| {
                    v.iter()
                        .copied()
                        .filter(|&(s, node)| {
                            (s as usize) < own.len() && own_out(s as usize) && is_in(node)
                        })
                        .collect()
                })
                .unwrap_or_default();
            loop {
                let now = ids(&cs, &settle(&cs, pool, pg, own.clone(), &pins));
                let mut added = false;
                for s in 0..now.len() {
                    let Some(was) = old[s] else { continue };
                    if now[s] != Some(was)
                        && own_out(s)
                        && is_in(was)
                        && !pins.iter().any(|p| p.0 as usize == s)
                    {
                        pins.push((s as u8, was));
                        added = true;
                    }
                }
                if !added {
                    break;
                }
            }
            pins.sort_unstable();
            let with = settle(&cs, pool, pg, own.clone(), &pins);
            let mut i = 0;
            while i < pins.len() {
                let mut fewer = pins.clone();
                fewer.remove(i);
                if settle(&cs, pool, pg, own.clone(), &fewer) == with {
                    pins = fewer;
                } else {
                    i += 1;
                }
            }
            if !pins.is_empty() {
                per_pg.insert(pg, pins);
            }
        }
        if !per_pg.is_empty() {
            all.insert(pool.id, per_pg);
        }
    }
    after.pins = all;
}

/// The candidate with the largest draw for `seed` among the `usable` ones.
fn best_of(cs: &[Cand], seed: u64, usable: &dyn Fn(usize) -> bool) -> Option<usize> {
    cs.iter()
        .enumerate()
        .filter(|(i, _)| usable(*i))
        .map(|(i, c)| (i, draw(seed ^ c.key, c.weight)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

/// A new node for `slot`: one on a host no other slot holds, not held itself, and `eligible`.
/// Each seed draws over all nodes and keeps the winner only if it is usable (so the outcome
/// does not depend on which other nodes are usable); after the seeds run out, the best usable.
fn redraw(
    cs: &[Cand],
    chosen: &[Option<usize>],
    slot: usize,
    mut seeds: impl Iterator<Item = u64>,
    eligible: impl Fn(usize) -> bool,
) -> Option<usize> {
    let usable = |i: usize| {
        eligible(i)
            && chosen
                .iter()
                .enumerate()
                .filter(|(s, _)| *s != slot)
                .filter_map(|(_, c)| *c)
                .all(|j| j != i && cs[j].host != cs[i].host)
    };
    let mut last = 0;
    for seed in seeds.by_ref() {
        last = seed;
        if let Some(i) = best_of(cs, seed, &|_| true).filter(|i| usable(*i)) {
            return Some(i);
        }
    }
    best_of(cs, mix(last), &usable)
}

/// Where a PG stands under a map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acting {
    pub pool: u64,
    pub pg: u32,
    /// Slot i holds shard i.
    pub members: Vec<Option<u32>>,
    /// The first up member.
    pub primary: Option<u32>,
    /// Members that are up.
    pub up_count: usize,
    /// The PG's current interval began no earlier than this epoch: the last change that could
    /// move members, or the last boot or mark up of any member (down ones included: one that
    /// led the PG for a while and went down again ended an interval too). A client op sent at
    /// an older epoch may have been overtaken by writes of another primary meanwhile, so the
    /// primary refuses it (`StaleEpoch`) and the client resends it — like Ceph discarding ops
    /// from before `same_interval_since`.
    pub since: u64,
}

impl Acting {
    pub fn compute(map: &ClusterMap, pool: &PoolInfo, pg: u32) -> Acting {
        let members = pg_members(map, pool, pg);
        let up: Vec<u32> = members
            .iter()
            .flatten()
            .copied()
            .filter(|n| map.is_up(*n))
            .collect();
        let since = members
            .iter()
            .flatten()
            .filter_map(|n| map.nodes.get(n).map(|n| n.up_from))
            .fold(map.membership_epoch, u64::max);
        Acting {
            pool: pool.id,
            pg,
            primary: up.first().copied(),
            up_count: up.len(),
            members,
            since,
        }
    }

    /// The shard this node holds, if it is a member.
    pub fn shard_of(&self, node: u32) -> Option<usize> {
        self.members.iter().position(|m| *m == Some(node))
    }

    /// `active+clean`, `active+degraded` (writable), `undersized` (readable only: fewer than
    /// min_size up), or `down` (fewer than k up).
    pub fn state(&self, pool: &PoolInfo) -> &'static str {
        if self.up_count == pool.size() {
            "active+clean"
        } else if self.up_count >= pool.min_size as usize {
            "active+degraded"
        } else if self.up_count >= pool.k as usize {
            "undersized"
        } else {
            "down"
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::map::{Change, Incremental, NodeInfo, WEIGHT_ONE};

    /// An up, in node of weight one on `host` (test maps, here and in `node::peerping`).
    pub(crate) fn node(id: u32, host: &str) -> NodeInfo {
        NodeInfo {
            id,
            addr: format!("127.0.0.1:{}", 7000 + id).parse().unwrap(),
            host: host.into(),
            weight: WEIGHT_ONE,
            up: true,
            r#in: true,
            devices: vec![],
            up_from: 0,
            auto_out: false,
        }
    }

    /// Pool 1, EC 6+2 with `pg_num` PGs.
    pub(crate) fn pool(pg_num: u32) -> PoolInfo {
        PoolInfo {
            id: 1,
            name: "p".into(),
            k: 6,
            m: 2,
            stripe_unit: 65536,
            pg_num,
            min_size: 7,
        }
    }

    /// A map at epoch 1 where these nodes booted.
    pub(crate) fn map_of(nodes: Vec<NodeInfo>) -> ClusterMap {
        let mut m = ClusterMap::new("f".into());
        m.apply(&Incremental {
            epoch: 1,
            changes: nodes.into_iter().map(Change::NodeBoot).collect(),
        })
        .unwrap();
        m
    }

    fn twelve() -> ClusterMap {
        map_of((1..=12).map(|i| node(i, &format!("h{i}"))).collect())
    }

    #[test]
    fn members_are_distinct_hosts_and_deterministic() {
        let m = map_of(
            (1..=16)
                .map(|i| node(i, &format!("h{}", i.div_ceil(2))))
                .collect(),
        );
        let p = pool(256);
        for pg in 0..256 {
            let a = pg_members(&m, &p, pg);
            assert_eq!(a, pg_members(&m, &p, pg));
            let hosts: std::collections::BTreeSet<_> = a
                .iter()
                .map(|n| m.nodes[&n.expect("8 hosts for 8 slots")].host.clone())
                .collect();
            assert_eq!(hosts.len(), 8, "pg {pg}: {a:?}");
        }
    }

    #[test]
    fn too_few_hosts_leaves_slots_empty() {
        let m = map_of((1..=6).map(|i| node(i, &format!("h{i}"))).collect());
        let a = pg_members(&m, &pool(8), 3);
        assert_eq!(a.iter().filter(|s| s.is_some()).count(), 6);
        assert_eq!(a.iter().filter(|s| s.is_none()).count(), 2);
    }

    #[test]
    fn marking_one_node_out_moves_only_its_pgs() {
        let p = pool(512);
        let before = twelve();
        let mut after = before.clone();
        after
            .apply(&Incremental {
                epoch: 2,
                changes: vec![Change::NodeOut(5)],
            })
            .unwrap();
        let mut moved = 0;
        for pg in 0..p.pg_num {
            let a = pg_members(&before, &p, pg);
            let b = pg_members(&after, &p, pg);
            if a.contains(&Some(5)) {
                assert!(!b.contains(&Some(5)));
                // Every other slot keeps its node (and the shard it holds).
                for (x, y) in a.iter().zip(&b) {
                    if *x != Some(5) {
                        assert_eq!(x, y, "pg {pg}: {a:?} -> {b:?}");
                    }
                }
                moved += 1;
            } else {
                assert_eq!(a, b, "pg {pg} does not involve node 5 but moved");
            }
        }
        assert!(moved > 0);
        // Node 5 held about 8/12 of the PGs' slots: each PG has 8 of 12 hosts.
        assert!(
            (moved as f64 / p.pg_num as f64 - 8.0 / 12.0).abs() < 0.1,
            "{moved}"
        );
    }

    #[test]
    fn down_changes_only_primaries_of_pgs_it_leads() {
        let p = pool(256);
        let before = twelve();
        let mut after = before.clone();
        after
            .apply(&Incremental {
                epoch: 2,
                changes: vec![Change::NodeDown(3)],
            })
            .unwrap();
        for pg in 0..p.pg_num {
            let a = Acting::compute(&before, &p, pg);
            let b = Acting::compute(&after, &p, pg);
            assert_eq!(a.members, b.members, "down must not remap");
            if a.primary == Some(3) {
                assert_ne!(b.primary, Some(3));
                assert_eq!(b.state(&p), "active+degraded");
            } else {
                assert_eq!(a.primary, b.primary);
            }
        }
    }

    #[test]
    fn adding_a_node_moves_only_pgs_it_joins() {
        let p = pool(256);
        let before = twelve();
        let mut after = before.clone();
        after
            .apply(&Incremental {
                epoch: 2,
                changes: vec![Change::NodeBoot(node(13, "h13"))],
            })
            .unwrap();
        for pg in 0..p.pg_num {
            let b = pg_members(&after, &p, pg);
            if !b.contains(&Some(13)) {
                assert_eq!(pg_members(&before, &p, pg), b);
            }
        }
    }

    fn moved_to(before: &ClusterMap, id: u32, host: &str) -> ClusterMap {
        let mut after = before.clone();
        let mut n = before.nodes[&id].clone();
        n.host = host.into();
        after
            .apply(&Incremental {
                epoch: before.epoch + 1,
                changes: vec![Change::NodeBoot(n)],
            })
            .unwrap();
        after
    }

    #[test]
    fn moving_a_node_to_a_new_host_changes_no_pg() {
        let p = pool(512);
        let before = twelve();
        let after = moved_to(&before, 5, "elsewhere");
        for pg in 0..p.pg_num {
            assert_eq!(
                pg_members(&before, &p, pg),
                pg_members(&after, &p, pg),
                "pg {pg}"
            );
        }
    }

    #[test]
    fn moving_a_node_onto_a_members_host_changes_one_slot_of_such_pgs() {
        let p = pool(512);
        let before = twelve();
        let after = moved_to(&before, 5, "h7");
        let mut changed = 0;
        for pg in 0..p.pg_num {
            let a = pg_members(&before, &p, pg);
            let b = pg_members(&after, &p, pg);
            let hosts: std::collections::BTreeSet<_> = b
                .iter()
                .map(|n| after.nodes[&n.unwrap()].host.clone())
                .collect();
            assert_eq!(hosts.len(), 8, "pg {pg}: hosts stay distinct: {b:?}");
            if !(a.contains(&Some(5)) && a.contains(&Some(7))) {
                assert_eq!(a, b, "pg {pg} has not both 5 and 7 but changed");
                continue;
            }
            let diff: Vec<usize> = (0..a.len()).filter(|s| a[*s] != b[*s]).collect();
            assert_eq!(diff.len(), 1, "pg {pg}: {a:?} -> {b:?}");
            let s = diff[0];
            assert!(a[s] == Some(5) || a[s] == Some(7), "pg {pg}: slot {s}");
            changed += 1;
        }
        assert!(changed > 0);
    }

    /// Apply one change to a copy of `before`.
    fn changed(before: &ClusterMap, c: Change) -> ClusterMap {
        let mut after = before.clone();
        after
            .apply(&Incremental {
                epoch: before.epoch + 1,
                changes: vec![c],
            })
            .unwrap();
        after
    }

    /// Every slot that changed from `before` to `after` involves `node`: it held it before
    /// (the node went out) or holds it now (the node came back). Returns the slots changed.
    fn only_slots_of(before: &ClusterMap, after: &ClusterMap, p: &PoolInfo, node: u32) -> usize {
        let mut n = 0;
        for pg in 0..p.pg_num {
            let (a, b) = (pg_members(before, p, pg), pg_members(after, p, pg));
            for s in 0..a.len() {
                if a[s] != b[s] {
                    assert!(
                        a[s] == Some(node) || b[s] == Some(node),
                        "node {node}: pg {pg} slot {s} moved although it does not involve it: \
                         {a:?} -> {b:?}"
                    );
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn a_replacement_stays_put_while_other_nodes_go_out_and_come_back() {
        let p = pool(512);
        let mut start = twelve();
        start.pools.insert(p.id, p.clone());
        let pairs = [
            (5, 7),
            (7, 5),
            (1, 12),
            (12, 1),
            (3, 4),
            (9, 2),
            (6, 11),
            (10, 8),
        ];
        for (x, y) in pairs {
            let m1 = changed(&start, Change::NodeOut(x));
            assert!(only_slots_of(&start, &m1, &p, x) > 0);
            let m2 = changed(&m1, Change::NodeOut(y));
            assert!(only_slots_of(&m1, &m2, &p, y) > 0);
            let m3 = changed(&m2, Change::NodeIn(x));
            assert!(only_slots_of(&m2, &m3, &p, x) > 0);
            let m4 = changed(&m3, Change::NodeIn(y));
            assert!(only_slots_of(&m3, &m4, &p, y) > 0);
            for pg in 0..p.pg_num {
                assert_eq!(pg_members(&m4, &p, pg), pg_members(&start, &p, pg));
            }
            assert!(m4.pins.is_empty(), "every node is back: no pin is left");
        }
    }

    #[test]
    fn any_sequence_of_outs_and_ins_moves_only_the_slots_of_the_node_changed() {
        let p = pool(256);
        let mut m = twelve();
        m.pools.insert(p.id, p.clone());
        let start = m.clone();
        let mut rng = 0x1234_5678_9abc_def0u64;
        for step in 0..60 {
            rng = mix(rng ^ step);
            let out: Vec<u32> = m.nodes.values().filter(|n| !n.r#in).map(|n| n.id).collect();
            // At most three out at once: 9 in nodes leave every PG its 8 distinct hosts.
            let c = if !out.is_empty() && (out.len() == 3 || rng.is_multiple_of(2)) {
                Change::NodeIn(out[(rng >> 8) as usize % out.len()])
            } else {
                let ins: Vec<u32> = m.nodes.values().filter(|n| n.r#in).map(|n| n.id).collect();
                Change::NodeOut(ins[(rng >> 8) as usize % ins.len()])
            };
            let id = match c {
                Change::NodeIn(id) | Change::NodeOut(id) => id,
                _ => unreachable!(),
            };
            let next = changed(&m, c);
            only_slots_of(&m, &next, &p, id);
            let json = serde_json::to_string(&next).unwrap();
            assert_eq!(serde_json::from_str::<ClusterMap>(&json).unwrap(), next);
            m = next;
        }
        let out: Vec<u32> = m.nodes.values().filter(|n| !n.r#in).map(|n| n.id).collect();
        for id in out {
            let next = changed(&m, Change::NodeIn(id));
            only_slots_of(&m, &next, &p, id);
            m = next;
        }
        assert!(m.pins.is_empty());
        for pg in 0..p.pg_num {
            assert_eq!(pg_members(&m, &p, pg), pg_members(&start, &p, pg));
        }
    }

    #[test]
    fn weights_steer_the_share() {
        let mut nodes: Vec<NodeInfo> = (1..=10).map(|i| node(i, &format!("h{i}"))).collect();
        nodes[0].weight = 3 * WEIGHT_ONE;
        let m = map_of(nodes);
        let p = PoolInfo {
            k: 1,
            m: 1,
            ..pool(4096)
        };
        let mut count = [0u32; 11];
        for pg in 0..p.pg_num {
            count[pg_members(&m, &p, pg)[0].unwrap() as usize] += 1;
        }
        // Node 1 weighs 3 of 12: about a quarter of first slots.
        let share = count[1] as f64 / p.pg_num as f64;
        assert!((share - 0.25).abs() < 0.04, "share {share}");
    }

    #[test]
    fn pg_hash_is_stable() {
        // Pinned: a change here remaps every object of every existing cluster.
        let p = pool(64);
        assert_eq!(pg_of(&p, b"hello"), pg_of(&p, b"hello"));
        let spread: std::collections::BTreeSet<u32> = (0..1000)
            .map(|i| pg_of(&p, format!("o{i}").as_bytes()))
            .collect();
        assert_eq!(spread.len(), 64);
    }
}
