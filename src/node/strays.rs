//! Stray shards: what a node holds of PGs it is no longer a member of.
//!
//! A node marked out, or a node that stood in for it and gave its slots back when it came
//! back in, keeps its shards of the PGs that moved away: nothing reads them (resolve, reads
//! and recovery ask the current members only), and they held their space for ever. Each
//! node now looks for such PGs when the map's membership changes (`node-strays` thread, at
//! lowered CPU priority; again every [`STRAY_PERIOD`] while any are left): a scan of its stores' keys finds the PGs it
//! holds keys of but is not a member of; it asks each one's primary whether the PG is clean
//! (`MSG_PG_CLEAN`: every member up and complete — the primary's last recovery pass at the
//! current node-change epoch left them all current), and removes its keys of the clean ones:
//! PG log entries and the recovery mark first (they sort first), then the shards and their
//! spilled rollback bytes, [`PURGE_BATCH`] keys per transaction. Each removal asserts the
//! store version it listed (a write since — the node became a member again — stops the
//! pass), each batch re-checks the map's membership epoch, and the batches and the
//! recovery listings (`SHARD_LIST`, `PG_LOG`) exclude each other (`Strays::gate`), so a
//! primary that makes this node a member again never lists keys a batch then removes.
//! Like Ceph removing a PG from an OSD that is no longer in its acting set once it is clean.
//!
//! A node can also stay a member of a PG at another slot: when a node joins the cluster and
//! wins an earlier slot of a PG, the member it displaced may win a later slot it could not
//! draw before (it held the earlier one). It keeps its shards of the old slot (pool, name,
//! old slot) beside the new slot's, which recovery fills; nothing reads them either. The
//! same scan finds them (shards and spilled rollback bytes of a slot other than the one the
//! node holds; the PG's log entries and mark stay) and the same sweep removes them once the
//! PG is clean — asking itself when it is the PG's primary.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use messenger::{Incoming, OutMessage};
use store::ObjectKey;
use tracing::{debug, info};

use super::local::SHARD_ROLLBACK_BIT;
use super::Node;
use crate::error::Result;
use crate::map::{ClusterMap, PoolInfo};
use crate::placement::{pg_members, pg_of, Acting};
use crate::wire::{self, Dec, Enc};

/// How often a node looks for stray PGs again while some are left.
pub const STRAY_PERIOD: Duration = Duration::from_secs(10);
/// Keys removed per transaction.
const PURGE_BATCH: usize = 128;
/// Longest wait for a primary's answer about its PG.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// (membership epoch, pool ids): what decides which PGs are stray.
type SweepKey = (u64, Vec<u64>);
/// Pool → PG → what of it is stray: `None` every key (this node is not a member), `Some(s)`
/// the shards of slots other than `s`, the one it holds now (it held another slot before).
type StrayPgs = BTreeMap<u64, BTreeMap<u32, Option<u8>>>;

#[derive(Default)]
pub struct Strays {
    /// The stray PGs (pool → PGs) a scan found at this membership, less those removed since:
    /// while some wait to be clean, a sweep asks their primaries again without a new scan.
    left: Mutex<Option<(SweepKey, StrayPgs)>>,
    /// Keys of stray PGs removed.
    pub removed_keys: AtomicU64,
    /// Stray PGs found at the last sweep that were not clean yet (gauge).
    pub pgs_waiting: AtomicU64,
    /// Held by a removal batch, and by the recovery listings of a PG's keys.
    pub(super) gate: Mutex<()>,
    /// Keys of deleted pools removed.
    pub deleted_pool_keys: AtomicU64,
    /// Deleted pools this node still held keys of after its last sweep (gauge).
    pub deleted_pools_left: AtomicU64,
    /// Deleted pools this node holds keys of: those a sweep is removing now, and those a
    /// failed batch left for the next (in heartbeats, for `nvstore status`).
    pub deleting_pools: Mutex<Vec<u64>>,
}

/// The PG a store key of `pool` belongs to: a shard's by its name, a PG log entry's or
/// recovery mark's from the name; `None` for other internal keys.
fn pg_of_key(info: &PoolInfo, k: &ObjectKey) -> Option<u32> {
    match k.name.first() {
        Some(0) if k.name.starts_with(b"\0log") || k.name.starts_with(b"\0rec") => k
            .name
            .get(4..8)
            .map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes"))),
        Some(0) | None => None,
        Some(_) => Some(pg_of(info, &k.name)),
    }
}

/// Whether `k` (a key of a PG whose slot `slot` this node holds) is a shard, or a shard's
/// spilled rollback bytes, of another slot.
fn other_slot(k: &ObjectKey, slot: u8) -> bool {
    k.name.first().is_some_and(|b| *b != 0) && k.shard & !SHARD_ROLLBACK_BIT != slot
}

/// Whether a sweep removes `k`, a key of a PG whose stray part is `what`.
fn is_stray(k: &ObjectKey, what: Option<u8>) -> bool {
    what.is_none_or(|slot| other_slot(k, slot))
}

impl Node {
    /// `node-strays`: a sweep every [`STRAY_PERIOD`] (one after the map changes).
    pub(super) fn strays_loop(self: std::sync::Arc<Self>) {
        super::recovery::lower_cpu_priority();
        loop {
            let epoch = self.monc.epoch();
            self.monc.wait_change(epoch, STRAY_PERIOD);
            // Let the map settle and recovery plan first.
            std::thread::sleep(Duration::from_secs(1));
            self.sweep_deleted_pools();
            self.sweep_strays();
        }
    }

    /// Remove every key this node holds of pools the map says were deleted — at once after
    /// the delete, and after a restart or a move for a device that missed it — and forget
    /// their idle PG slots. Safe without asking anyone: a pool's deletion is final and its
    /// id never reused (`ClusterMap::is_deleted_pool`), and a shard op of a deleted pool from
    /// a sender with an older map is refused (`check_shard_sender`); one that slipped in
    /// before this node had the new map leaves a key the next sweep removes.
    pub(super) fn sweep_deleted_pools(&self) {
        let map = self.monc.map();
        self.pgs.lock().unwrap().retain(|(pool, _), slot| {
            !map.is_deleted_pool(*pool) || slot.running || !slot.queue.is_empty()
        });
        let holding: Vec<u64> = (1..=map.pool_max())
            .filter(|id| map.is_deleted_pool(*id))
            .filter(|id| {
                let mut stores = self.local.stores.iter();
                stores.any(|st| !st.list(*id, None, 1).is_empty())
            })
            .collect();
        *self.strays.deleting_pools.lock().unwrap() = holding.clone();
        let mut left = 0;
        for pool in holding {
            if self.purge_pool(pool) {
                self.strays
                    .deleting_pools
                    .lock()
                    .unwrap()
                    .retain(|p| *p != pool);
            } else {
                left += 1;
            }
        }
        self.strays.deleted_pools_left.store(left, Relaxed);
    }

    /// Remove this node's keys of deleted pool `pool`, [`PURGE_BATCH`] per transaction; false
    /// if a batch failed (a key changed under it: the next sweep goes on).
    fn purge_pool(&self, pool: u64) -> bool {
        let mut removed = 0u64;
        let mut done = true;
        'stores: for st_idx in 0..self.local.stores.len() {
            loop {
                let batch: Vec<(ObjectKey, u64)> = self.local.stores[st_idx]
                    .list(pool, None, PURGE_BATCH)
                    .into_iter()
                    .map(|(k, s)| (k, s.version))
                    .collect();
                if batch.is_empty() {
                    break;
                }
                if let Err(e) = self.local.purge(st_idx, &batch) {
                    debug!("removing keys of deleted pool {pool}: {e}");
                    done = false;
                    break 'stores;
                }
                removed += batch.len() as u64;
                self.strays
                    .deleted_pool_keys
                    .fetch_add(batch.len() as u64, Relaxed);
            }
        }
        if removed > 0 {
            info!("removed {removed} keys of deleted pool {pool}");
        }
        done
    }

    /// One sweep (see the module docs). The stores are scanned for stray PGs once per
    /// membership; later sweeps ask again only about the ones not yet removed (and cost
    /// nothing once none are left).
    pub(super) fn sweep_strays(&self) {
        let map = self.monc.map();
        let key: SweepKey = (
            map.membership_epoch,
            map.pools.keys().copied().collect::<Vec<_>>(),
        );
        let mut left = {
            let cached = self.strays.left.lock().unwrap();
            match cached.as_ref() {
                Some((k, left)) if *k == key => left.clone(),
                _ => {
                    drop(cached);
                    self.find_strays(&map)
                }
            }
        };
        let mut waiting = 0;
        for (pool, pgs) in left.iter_mut() {
            let Some(info) = map.pools.get(pool) else {
                pgs.clear();
                continue;
            };
            let clean: HashMap<u32, Option<u8>> = pgs
                .iter()
                .filter(|(pg, _)| self.clean_at_primary(&map, info, **pg))
                .map(|(pg, what)| (*pg, *what))
                .collect();
            if !clean.is_empty() && self.purge_pgs(&map, info, &clean) {
                pgs.retain(|pg, _| !clean.contains_key(pg));
            }
            waiting += pgs.len();
        }
        left.retain(|_, pgs| !pgs.is_empty());
        self.strays.pgs_waiting.store(waiting as u64, Relaxed);
        *self.strays.left.lock().unwrap() = Some((key, left));
    }

    /// Pool → the PGs this node's stores hold keys of but the map does not make it a member
    /// of, and those it is a member of but holds shards of another slot of.
    fn find_strays(&self, map: &ClusterMap) -> StrayPgs {
        let mut out = BTreeMap::new();
        for info in map.pools.values() {
            let mine: HashMap<u32, u8> = (0..info.pg_num)
                .filter_map(|pg| {
                    let slot = pg_members(map, info, pg)
                        .iter()
                        .position(|m| *m == Some(self.id))?;
                    Some((pg, slot as u8))
                })
                .collect();
            let stray = self.local_strays(info, &mine);
            if !stray.is_empty() {
                out.insert(info.id, stray);
            }
        }
        out
    }

    /// The stray part of each PG of `info` this node's stores hold keys of, given the slot
    /// it holds of each PG it is a member of (`mine`).
    fn local_strays(&self, info: &PoolInfo, mine: &HashMap<u32, u8>) -> BTreeMap<u32, Option<u8>> {
        let mut stray = BTreeMap::new();
        for st in &self.local.stores {
            let mut from: Option<ObjectKey> = None;
            loop {
                let batch = st.list(info.id, from.as_ref(), 1024);
                let Some(last) = batch.last().map(|(k, _)| k.clone()) else {
                    break;
                };
                for (k, _) in &batch {
                    let Some(pg) = pg_of_key(info, k) else {
                        continue;
                    };
                    match mine.get(&pg) {
                        None => {
                            stray.insert(pg, None);
                        }
                        Some(slot) if other_slot(k, *slot) => {
                            stray.insert(pg, Some(*slot));
                        }
                        Some(_) => {}
                    }
                }
                from = Some(last);
            }
        }
        stray
    }

    /// Whether `pg`'s primary says it is clean (every member up and current).
    fn clean_at_primary(&self, map: &ClusterMap, info: &PoolInfo, pg: u32) -> bool {
        let Some(primary) = Acting::compute(map, info, pg).primary else {
            return false;
        };
        if primary == self.id {
            return self.is_clean(map.epoch, info.id, pg);
        }
        let mut e = Enc::new(map.epoch);
        e.u64(info.id).u32(pg);
        let r = self.peer(primary).and_then(|c| {
            let reply = c.request(OutMessage::new(wire::MSG_PG_CLEAN, e.finish()), ASK_TIMEOUT)?;
            Ok(wire::parse_reply(&reply.payload)?.1.first() == Some(&1))
        });
        r.unwrap_or_else(|e| {
            debug!(
                "strays: asking node {primary} about pg {}.{pg:x}: {e}",
                info.id
            );
            false
        })
    }

    /// Remove this node's stray keys of the `pgs` of `info`; false if the pass stopped early
    /// (the membership changed, or a key changed under it).
    fn purge_pgs(&self, map: &ClusterMap, info: &PoolInfo, pgs: &HashMap<u32, Option<u8>>) -> bool {
        let mut removed = 0u64;
        for st_idx in 0..self.local.stores.len() {
            let st = &self.local.stores[st_idx];
            let mut from: Option<ObjectKey> = None;
            loop {
                let listed = st.list(info.id, from.as_ref(), PURGE_BATCH);
                let Some(last) = listed.last().map(|(k, _)| k.clone()) else {
                    break;
                };
                let batch: Vec<(ObjectKey, u64)> = listed
                    .into_iter()
                    .filter(|(k, _)| {
                        pg_of_key(info, k)
                            .and_then(|pg| pgs.get(&pg))
                            .is_some_and(|what| is_stray(k, *what))
                    })
                    .map(|(k, s)| (k, s.version))
                    .collect();
                from = Some(last);
                if batch.is_empty() {
                    continue;
                }
                let _g = self.strays.gate.lock().unwrap();
                if self.monc.map().membership_epoch != map.membership_epoch {
                    return false;
                }
                match self.local.purge(st_idx, &batch) {
                    Ok(()) => removed += batch.len() as u64,
                    Err(e) => {
                        debug!("strays: removing keys of pool {}: {e}", info.id);
                        return false;
                    }
                }
            }
        }
        self.strays.removed_keys.fetch_add(removed, Relaxed);
        info!(
            "removed {removed} keys of {} PG(s) of pool {} that this node is no longer a member of",
            pgs.len(),
            info.id
        );
        true
    }

    /// `MSG_PG_CLEAN` at a PG's primary: 1 if every member is up and the last recovery pass,
    /// at the current node-change epoch and with the current members, left them all current;
    /// else 0 (also when this node does not lead the PG, or its map differs from the asker's).
    pub(super) fn pg_clean(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let mut d = Dec::new(msg.payload());
        let epoch = d.u64()?;
        let (pool, pg) = (d.u64()?, d.u32()?);
        d.end()?;
        Ok(wire::reply_ok(
            self.epoch(),
            &[self.is_clean(epoch, pool, pg) as u8],
        ))
    }

    /// Whether this node leads `pg` at map `epoch` (waiting up to [`ASK_TIMEOUT`] for it),
    /// every member is up, and its last recovery pass at the current node-change epoch, with
    /// these members, left them all current.
    fn is_clean(&self, epoch: u64, pool: u64, pg: u32) -> bool {
        if epoch > self.epoch() {
            self.monc.wait_epoch(epoch, ASK_TIMEOUT);
        }
        epoch == self.epoch()
            && self.recovery_ctx(pool, pg).is_some_and(|ctx| {
                ctx.acting.up_count == ctx.n()
                    && self
                        .pgs
                        .lock()
                        .unwrap()
                        .get(&(pool, pg))
                        .and_then(|s| {
                            let c = s.cache.try_lock().ok()?;
                            Some(
                                c.complete_at == Some(self.monc.node_change_epoch())
                                    && c.members == ctx.acting.members,
                            )
                        })
                        .unwrap_or(false)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shards by their names' PG; PG log entries and recovery marks by the PG in their names;
    /// other internal keys belong to no PG.
    #[test]
    fn keys_belong_to_the_pg_of_their_name() {
        let info = PoolInfo {
            id: 4,
            name: "p".into(),
            k: 2,
            m: 2,
            stripe_unit: 4096,
            pg_num: 16,
            min_size: 3,
        };
        let shard = ObjectKey::new(4, b"obj-1", 2);
        assert_eq!(pg_of_key(&info, &shard), Some(pg_of(&info, b"obj-1")));
        let spilled = ObjectKey::new(4, b"obj-1", 2 | super::super::local::SHARD_ROLLBACK_BIT);
        assert_eq!(pg_of_key(&info, &spilled), Some(pg_of(&info, b"obj-1")));
        let mut log = b"\0log".to_vec();
        log.extend_from_slice(&11u32.to_be_bytes());
        log.extend_from_slice(&7u64.to_be_bytes());
        log.extend_from_slice(b"obj-1");
        assert_eq!(pg_of_key(&info, &ObjectKey::new(4, log, 0xFE)), Some(11));
        let mark = super::super::local::mark_key(4, 9);
        assert_eq!(pg_of_key(&info, &mark), Some(9));
        assert_eq!(pg_of_key(&info, &ObjectKey::new(4, b"\0other", 0)), None);
    }

    /// Of a PG this node is a member of at slot 2, the shards (and spilled bytes) of other
    /// slots are stray; its own slot's, the PG log entries and the mark are not. Of a PG it
    /// is not a member of, every key is.
    #[test]
    fn other_slots_shards_are_stray_and_nothing_else_of_a_member() {
        let shard = |s: u8| ObjectKey::new(4, b"obj-1", s);
        assert!(!is_stray(&shard(2), Some(2)));
        assert!(!is_stray(&shard(2 | SHARD_ROLLBACK_BIT), Some(2)));
        assert!(is_stray(&shard(0), Some(2)));
        assert!(is_stray(&shard(3 | SHARD_ROLLBACK_BIT), Some(2)));
        let mut log = b"\0log".to_vec();
        log.extend_from_slice(&11u32.to_be_bytes());
        log.extend_from_slice(&7u64.to_be_bytes());
        let log = ObjectKey::new(4, log, 0xFE);
        let mark = super::super::local::mark_key(4, 11);
        assert!(!is_stray(&log, Some(2)) && !is_stray(&mark, Some(2)));
        for k in [shard(2), shard(0), log, mark] {
            assert!(is_stray(&k, None));
        }
    }
}
