//! Placement: object → PG by a stable hash; PG → an ordered list of k + m nodes by weighted
//! rendezvous hashing (straw2-like) with the host as failure domain.
//!
//! Slot `i` of a PG (which holds EC shard `i`) is drawn independently: every host with in-weight
//! draws `ln(u) / weight` from a hash of (pool, pg, host, slot, attempt) and the largest draw
//! wins; a host already holding an earlier slot makes the slot draw again with the next
//! attempt. Within the winning host, its in nodes draw the same way. A node that is not a
//! member of a PG never won a draw that mattered for it, so adding, removing, marking up/down
//! or in/out one node changes only the PGs that involve it. Down nodes stay members (their
//! shards are served degraded); out nodes are not drawn.

use std::collections::BTreeMap;

use crate::map::{ClusterMap, PoolInfo};

/// Independent draws per slot before falling back to the best untaken host.
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

struct Host {
    key: u64,
    /// Configured weight of all its nodes, in or out: marking a node out must not change the
    /// draws of the PGs that do not involve it.
    weight: u64,
    /// (node, weight, in)
    nodes: Vec<(u32, u64, bool)>,
}

impl Host {
    fn has_in(&self) -> bool {
        self.nodes.iter().any(|n| n.2)
    }
}

fn hosts(map: &ClusterMap) -> Vec<Host> {
    let mut by: BTreeMap<&str, Vec<(u32, u64, bool)>> = BTreeMap::new();
    for n in map.nodes.values().filter(|n| n.weight > 0) {
        by.entry(n.host.as_str())
            .or_default()
            .push((n.id, n.weight as u64, n.r#in));
    }
    by.into_iter()
        .map(|(name, nodes)| Host {
            key: hash_str(name),
            weight: nodes.iter().map(|n| n.1).sum(),
            nodes,
        })
        .collect()
}

/// The k + m members of a PG, slot by slot (`None`: no distinct host left for that slot).
///
/// Like CRUSH's `indep` mode, and stable under out/in: first every slot draws over all hosts,
/// in or out, pass after pass (attempt p in pass p) until it wins a host no other slot holds;
/// this phase does not look at in/out at all. Then each slot that won a host with no in node
/// draws again among the usable hosts left. So when a node goes out only its slot changes;
/// every other slot keeps its node, and with it the EC shard it holds.
pub fn pg_members(map: &ClusterMap, pool: &PoolInfo, pg: u32) -> Vec<Option<u32>> {
    let hs = hosts(map);
    let base = mix(pool.id ^ mix(pg as u64 ^ 0x5047_0000_0000));
    let n = pool.size();
    let best_of = |seed: u64, usable: &dyn Fn(usize) -> bool| {
        hs.iter()
            .enumerate()
            .filter(|(i, _)| usable(*i))
            .map(|(i, h)| (i, draw(seed ^ h.key, h.weight)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i)
    };
    let mut chosen: Vec<Option<usize>> = vec![None; n];
    for pass in 0..ATTEMPTS_MAX as u64 {
        for slot in 0..n {
            if chosen[slot].is_none() {
                let seed = mix(base ^ ((slot as u64) << 8) ^ (pass << 40));
                if let Some(i) = best_of(seed, &|_| true) {
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
    // Slots on hosts with no in node (or none found) draw again among the usable hosts left.
    for slot in 0..n {
        if chosen[slot].is_some_and(|i| hs[i].has_in()) {
            continue;
        }
        chosen[slot] = None;
        for pass in 0..=ATTEMPTS_MAX as u64 {
            let seed = mix(base ^ ((slot as u64) << 8) ^ ((ATTEMPTS_MAX as u64 + pass) << 40));
            let taken = chosen.clone();
            let usable = |i: usize| hs[i].has_in() && !taken.contains(&Some(i));
            let pick = if pass < ATTEMPTS_MAX as u64 {
                best_of(seed, &|_| true).filter(|i| usable(*i))
            } else {
                best_of(seed, &usable)
            };
            if pick.is_some() {
                chosen[slot] = pick;
                break;
            }
        }
    }
    chosen
        .iter()
        .enumerate()
        .map(|(slot, c)| {
            c.map(|i| {
                let seed = mix(base ^ ((slot as u64) << 8) ^ 0xdead_beef);
                hs[i]
                    .nodes
                    .iter()
                    .filter(|n| n.2)
                    .map(|&(id, w, _)| (id, draw(seed ^ mix(id as u64), w)))
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .map(|(id, _)| id)
                    .expect("a chosen host has an in node")
            })
        })
        .collect()
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
        Acting {
            pool: pool.id,
            pg,
            primary: up.first().copied(),
            up_count: up.len(),
            members,
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
mod tests {
    use super::*;
    use crate::map::{Change, Incremental, NodeInfo, WEIGHT_ONE};

    fn node(id: u32, host: &str) -> NodeInfo {
        NodeInfo {
            id,
            addr: format!("127.0.0.1:{}", 7000 + id).parse().unwrap(),
            host: host.into(),
            weight: WEIGHT_ONE,
            up: true,
            r#in: true,
            devices: vec![],
        }
    }

    fn pool(pg_num: u32) -> PoolInfo {
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

    fn map_of(nodes: Vec<NodeInfo>) -> ClusterMap {
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
