//! The cluster map: nodes, pools and devices, versioned by epoch.
//!
//! The monitor owns it (replicated through raft); nodes and clients hold copies kept current by
//! [`Incremental`]s, each bumping the epoch by exactly one. The map is small and travels as
//! JSON (docs/format.md, "Cluster messages").

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// A node's weight unit: 1.0 == 0x10000 (a device of 1 TiB, say; only ratios matter).
pub const WEIGHT_ONE: u32 = 0x10000;
/// Default placement groups per pool.
pub const PG_NUM_DEFAULT: u32 = 64;
/// Most placement groups a pool may have.
pub const PG_NUM_MAX: u32 = 1 << 16;
/// Longest pool name.
pub const POOL_NAME_BYTES_MAX: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: u32,
    pub addr: SocketAddr,
    /// Failure domain: no two shards of a PG on one host.
    pub host: String,
    pub weight: u32,
    pub up: bool,
    /// An out node holds no PGs (its shards are remapped; recovery rebuilds them, issue 8).
    pub r#in: bool,
    /// Device uuids (hex) the node serves.
    pub devices: Vec<String>,
    /// The epoch of the node's last boot or mark up (kept while it is down). A PG's current
    /// interval began no earlier than its members' `up_from` (`Acting::since`).
    #[serde(default)]
    pub up_from: u64,
    /// Out because the monitor found it down past `out_grace` (not an operator's `node out`):
    /// it is marked in again when it comes back up.
    #[serde(default)]
    pub auto_out: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolInfo {
    pub id: u64,
    pub name: String,
    pub k: u32,
    pub m: u32,
    pub stripe_unit: u32,
    pub pg_num: u32,
    /// Shards that must be durable before a write is acknowledged (default k + 1).
    pub min_size: u32,
}

impl PoolInfo {
    pub fn size(&self) -> usize {
        (self.k + self.m) as usize
    }

    pub fn profile(&self) -> ec::Profile {
        ec::Profile::new(self.k as usize, self.m as usize, self.stripe_unit as usize)
            .expect("pool profiles are validated when the pool is created")
    }
}

/// One change to the map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// A node registered (new, or with a new address/host/devices); it is up and in.
    NodeBoot(NodeInfo),
    NodeUp(u32),
    NodeDown(u32),
    NodeIn(u32),
    NodeOut(u32),
    /// Out as the monitor's own decision (down past `out_grace`); see `NodeInfo::auto_out`.
    NodeAutoOut(u32),
    PoolCreate(PoolInfo),
    PoolDelete(u64),
}

/// The changes that take a map from `epoch - 1` to `epoch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incremental {
    pub epoch: u64,
    pub changes: Vec<Change>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMap {
    pub fsid: String,
    pub epoch: u64,
    pub nodes: BTreeMap<u32, NodeInfo>,
    pub pools: BTreeMap<u64, PoolInfo>,
    /// Device uuid → node id.
    pub devices: BTreeMap<String, u32>,
    /// Epoch of the last change that can move PG members (a node added, marked in or out,
    /// or its host or weight changed). Before it a PG may have had other members.
    #[serde(default)]
    pub membership_epoch: u64,
    /// Slot pins, like Ceph's upmap items: pool → PG → (slot, node), sorted by slot. A slot
    /// whose own node is out holds a replacement; when another node later goes out or comes
    /// back, the stateless draw could hand that slot a different replacement and move its
    /// shard for nothing. `apply` pins the replacement instead, and drops a pin once the
    /// slot's own node is back in, the pinned node is out, or the draw gives the same anyway
    /// (`placement::repin`). Derived from the changes alone, so every holder of the map
    /// computes the same pins.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pins: BTreeMap<u64, BTreeMap<u32, Vec<(u8, u32)>>>,
    /// The highest pool id ever created (0: none yet, or a map from before pools could be
    /// deleted; see [`ClusterMap::pool_max`]). Pool ids are never reused, so what a node still
    /// holds of a deleted pool can never be taken for a later pool's objects.
    #[serde(default)]
    pub pool_max: u64,
}

impl ClusterMap {
    pub fn new(fsid: String) -> ClusterMap {
        ClusterMap {
            fsid,
            ..ClusterMap::default()
        }
    }

    pub fn pool_by_name(&self, name: &str) -> Option<&PoolInfo> {
        self.pools.values().find(|p| p.name == name)
    }

    /// The highest pool id ever created: the next pool gets the one after it.
    pub fn pool_max(&self) -> u64 {
        self.pools
            .keys()
            .next_back()
            .map_or(self.pool_max, |last| self.pool_max.max(*last))
    }

    /// Whether pool `id` was created and has been deleted since (its keys left on a node's
    /// devices are garbage). An id above [`ClusterMap::pool_max`] is not deleted: it may be
    /// a pool created after this map.
    pub fn is_deleted_pool(&self, id: u64) -> bool {
        id != 0 && id <= self.pool_max() && !self.pools.contains_key(&id)
    }

    pub fn is_up(&self, node: u32) -> bool {
        self.nodes.get(&node).is_some_and(|n| n.up)
    }

    /// Apply one incremental; it must be for exactly the next epoch.
    pub fn apply(&mut self, inc: &Incremental) -> Result<(), String> {
        if inc.epoch != self.epoch + 1 {
            return Err(format!(
                "incremental for epoch {} does not follow map epoch {}",
                inc.epoch, self.epoch
            ));
        }
        for c in &inc.changes {
            let before = self.moves_members(c).then(|| self.clone());
            self.apply_change(c, inc.epoch);
            if let Some(before) = before {
                self.membership_epoch = inc.epoch;
                crate::placement::repin(&before, self);
            }
        }
        self.epoch = inc.epoch;
        Ok(())
    }

    fn moves_members(&self, c: &Change) -> bool {
        match c {
            Change::NodeBoot(n) => self
                .nodes
                .get(&n.id)
                .is_none_or(|o| o.host != n.host || o.weight != n.weight || o.r#in != n.r#in),
            Change::NodeIn(id) => self.nodes.get(id).is_some_and(|n| !n.r#in),
            Change::NodeOut(id) | Change::NodeAutoOut(id) => {
                self.nodes.get(id).is_some_and(|n| n.r#in)
            }
            _ => false,
        }
    }

    fn apply_change(&mut self, c: &Change, epoch: u64) {
        match c {
            Change::NodeBoot(n) => {
                self.devices.retain(|_, owner| *owner != n.id);
                for d in &n.devices {
                    self.devices.insert(d.clone(), n.id);
                }
                // A boot is a new life of the node even where it was never marked down.
                let up_from = if n.up { epoch } else { n.up_from };
                self.nodes.insert(
                    n.id,
                    NodeInfo {
                        up_from,
                        ..n.clone()
                    },
                );
            }
            Change::NodeUp(id) | Change::NodeDown(id) => {
                if let Some(n) = self.nodes.get_mut(id) {
                    let up = matches!(c, Change::NodeUp(_));
                    if up && !n.up {
                        n.up_from = epoch;
                    }
                    n.up = up;
                }
            }
            Change::NodeIn(id) | Change::NodeOut(id) | Change::NodeAutoOut(id) => {
                if let Some(n) = self.nodes.get_mut(id) {
                    n.r#in = matches!(c, Change::NodeIn(_));
                    n.auto_out = matches!(c, Change::NodeAutoOut(_));
                }
            }
            Change::PoolCreate(p) => {
                self.pool_max = self.pool_max().max(p.id);
                self.pools.insert(p.id, p.clone());
            }
            Change::PoolDelete(id) => {
                self.pool_max = self.pool_max();
                self.pools.remove(id);
                self.pins.remove(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn node(id: u32) -> NodeInfo {
        NodeInfo {
            id,
            addr: format!("127.0.0.1:{}", 7000 + id).parse().unwrap(),
            host: format!("host{id}"),
            weight: WEIGHT_ONE,
            up: true,
            r#in: true,
            devices: vec![format!("dev{id}")],
            up_from: 0,
            auto_out: false,
        }
    }

    /// `up_from` is the epoch of a node's last boot or mark up, kept while it is down; with
    /// the membership epoch it bounds where a PG's interval began (`Acting::since`).
    #[test]
    fn up_from_follows_boots_and_mark_ups_and_bounds_the_interval() {
        let mut m = ClusterMap::new("f".into());
        fn step(m: &mut ClusterMap, changes: Vec<Change>) {
            let epoch = m.epoch + 1;
            m.apply(&Incremental { epoch, changes }).unwrap();
        }
        step(
            &mut m,
            vec![Change::NodeBoot(node(1)), Change::NodeBoot(node(2))],
        );
        step(&mut m, vec![Change::NodeDown(2)]);
        step(&mut m, vec![Change::NodeUp(1)]); // already up: not a new life
        assert_eq!((m.nodes[&1].up_from, m.nodes[&2].up_from), (1, 1));
        step(&mut m, vec![Change::NodeUp(2)]);
        assert_eq!(m.nodes[&2].up_from, 4);
        step(&mut m, vec![Change::NodeDown(2)]);
        assert_eq!(m.nodes[&2].up_from, 4, "kept while down");
        step(&mut m, vec![Change::NodeBoot(node(1))]);
        assert_eq!(
            m.nodes[&1].up_from, 6,
            "a restart is a new life, marked down or not"
        );
        let pool = PoolInfo {
            id: 1,
            name: "p".into(),
            k: 1,
            m: 1,
            stripe_unit: 4096,
            pg_num: 1,
            min_size: 1,
        };
        m.pools.insert(1, pool.clone());
        let a = crate::placement::Acting::compute(&m, &pool, 0);
        assert_eq!(a.primary, Some(1));
        assert_eq!(a.since, 6, "node 1's restart began the interval");
        m.membership_epoch = 9;
        assert_eq!(crate::placement::Acting::compute(&m, &pool, 0).since, 9);
    }

    #[test]
    fn incrementals_apply_in_order_only() {
        let mut m = ClusterMap::new("f".into());
        m.apply(&Incremental {
            epoch: 1,
            changes: vec![Change::NodeBoot(node(1)), Change::NodeBoot(node(2))],
        })
        .unwrap();
        assert_eq!(m.devices.get("dev2"), Some(&2));
        let skip = Incremental {
            epoch: 3,
            changes: vec![Change::NodeDown(1)],
        };
        assert!(m.apply(&skip).unwrap_err().contains("does not follow"));
        m.apply(&Incremental {
            epoch: 2,
            changes: vec![Change::NodeDown(1), Change::NodeOut(2)],
        })
        .unwrap();
        assert!(!m.is_up(1));
        assert!(!m.nodes[&2].r#in);
        assert_eq!(m.epoch, 2);
        assert_eq!(m.membership_epoch, 2, "out moves members; down does not");
        m.apply(&Incremental {
            epoch: 3,
            changes: vec![Change::NodeBoot(node(1))],
        })
        .unwrap();
        assert_eq!(
            m.membership_epoch, 2,
            "a restart on the same host moves nothing"
        );
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(serde_json::from_str::<ClusterMap>(&json).unwrap(), m);
    }
}
