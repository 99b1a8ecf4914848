//! Stores opened past damage: a node opens its stores with `StoreConfig::salvage`, so one
//! rotten batch in the un-checkpointed log, or in the checkpoint, does not keep the whole node
//! down. What the open got past is in each store's `salvage_report()`: data items that now
//! read as `Corrupted`, skipped log batches whose objects read as their previous version (a
//! stale shard), and lost checkpoint batches whose objects read as the log after the
//! checkpoint has them or not at all (a missing shard). All are what the cluster scrub and
//! backfill repair (crc error, "missing" at another version, missing); this asks for it at
//! once instead of at the next scheduled pass. (A rebuilt log segment header lost nothing:
//! it asks for nothing, though it still counts as damage the operator hears of.)
//!
//! The scrub of a PG runs on its primary, so the node asks the primaries of the PGs the damage
//! touches (every PG it is a member of when a report cannot name all its objects) to start a
//! pass, itself included — after its own boot epoch, so they see it up.
//!
//! A skipped batch may also have held writes that this node's recovery mark of a PG ("my
//! shards are complete through version V", recovery.rs) vouches for. Before the node boots,
//! the marks of the PGs skipped batches touch (of every PG on that store when a report cannot
//! name all its objects) are dropped, so recovery backfills those PGs by listing the members'
//! shards rather than trusting the mark. That also covers what the scrub cannot see: a primary's
//! scrub walks the names it holds itself, so a shard the primary lost with the batch (an
//! object created in it) is found by the backfill, not by the scrub.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use messenger::OutMessage;
use store::{ObjectKey, SalvageKind, Salvaged};
use tracing::{info, warn};

use super::local::{mark_key, SHARD_LOG, SHARD_MARK};
use super::Node;
use crate::map::ClusterMap;
use crate::monclient::MonClient;
use crate::placement::pg_of;
use crate::wire::{self, Enc};

/// How long the node waits for the map that shows it up before asking for scrubs anyway.
const UP_WAIT: Duration = Duration::from_secs(30);
/// How long one scrub request to a peer may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The PG a store key belongs to: shard data, rollback spill and PG log keys (local.rs),
/// recovery marks (recovery.rs).
fn pg_of_key(map: &ClusterMap, key: &ObjectKey) -> Option<(u64, u32)> {
    let pool = map.pools.get(&key.pool)?;
    if key.shard == SHARD_LOG || key.shard == SHARD_MARK {
        let pg = u32::from_be_bytes(key.name.get(4..8)?.try_into().ok()?);
        return Some((key.pool, pg));
    }
    // Shard data and rollback spill keys (shard | 0x80) carry the object's name.
    Some((key.pool, pg_of(pool, &key.name)))
}

/// The nodes whose scrub covers the damage: the primaries of the PGs its keys fall in, or of
/// every PG `me` is a member of when some report cannot name all its objects (a record that
/// no longer reads, or a lost stretch of checkpoint).
pub(super) fn scrub_targets(
    map: &ClusterMap,
    monc: &MonClient,
    me: u32,
    reports: &[Salvaged],
) -> BTreeSet<u32> {
    let mut pgs: BTreeSet<(u64, u32)> = BTreeSet::new();
    let all = reports.iter().any(|r| !r.keys_complete);
    for r in reports {
        for k in &r.keys {
            match pg_of_key(map, k) {
                Some(pg) => {
                    pgs.insert(pg);
                }
                None => warn!("salvage: {k} belongs to no pool in the map"),
            }
        }
    }
    let mut out = BTreeSet::new();
    for pool in map.pools.values() {
        for pg in 0..pool.pg_num {
            if !all && !pgs.contains(&(pool.id, pg)) {
                continue;
            }
            let a = monc.acting(map, pool, pg);
            if a.members.contains(&Some(me)) || pgs.contains(&(pool.id, pg)) {
                out.extend(a.primary);
            }
        }
    }
    out
}

impl Node {
    /// How many damaged places the stores opened past (0 when all opened clean).
    pub fn salvaged_count(&self) -> usize {
        self.local
            .stores
            .iter()
            .map(|s| s.salvage_report().len())
            .sum()
    }

    /// The salvage reports of every store (empty when all opened clean).
    pub fn salvage_reports(&self) -> Vec<Salvaged> {
        self.local
            .stores
            .iter()
            .flat_map(|s| s.salvage_report().iter().cloned())
            .collect()
    }

    /// Drop the recovery marks that skipped batches may have made untrue (see the module
    /// doc). Run before the node boots, so no recovery pass has read them yet.
    pub(super) fn forget_marks_after_salvage(&self) {
        let map = self.monc.map();
        for st in &self.local.stores {
            let skipped: Vec<&Salvaged> = st
                .salvage_report()
                .iter()
                .filter(|r| !matches!(r.kind, SalvageKind::DataCrc | SalvageKind::SegmentHeader))
                .collect();
            if skipped.is_empty() {
                continue;
            }
            let all = skipped.iter().any(|r| !r.keys_complete);
            let pgs: BTreeSet<(u64, u32)> = skipped
                .iter()
                .flat_map(|r| &r.keys)
                .filter_map(|k| pg_of_key(&map, k))
                .collect();
            for pool in map.pools.values() {
                for pg in 0..pool.pg_num {
                    let mine = std::ptr::eq(self.local.store(pool.id, pg), st);
                    let key = mark_key(pool.id, pg);
                    if !mine || !(all || pgs.contains(&(pool.id, pg))) || !st.exists(&key) {
                        continue;
                    }
                    match self.local.remove_mark(pool.id, pg) {
                        Ok(_) => info!(
                            "salvage: recovery mark of PG {}.{pg:x} dropped: it will be backfilled",
                            pool.id
                        ),
                        Err(e) => warn!("salvage: dropping the recovery mark of {key}: {e}"),
                    }
                }
            }
        }
    }

    /// A store opened past damage: once the map that boots this node (`up_epoch`) is here,
    /// ask the primaries of the damaged PGs to scrub now (run on its own thread).
    pub(super) fn request_salvage_scrubs(self: &Arc<Self>, up_epoch: u64) {
        let all = self.salvage_reports();
        // A rebuilt segment header lost nothing: there is no shard to repair.
        let reports: Vec<Salvaged> = all
            .iter()
            .filter(|r| r.kind != SalvageKind::SegmentHeader)
            .cloned()
            .collect();
        if reports.is_empty() {
            if !all.is_empty() {
                info!(
                    "salvage: {} log segment header(s) rebuilt from their batches (listed \
                     above); nothing was lost, no scrub needed",
                    all.len()
                );
            }
            return;
        }
        if !self.monc.wait_epoch(up_epoch, UP_WAIT) {
            warn!("salvage: map epoch {up_epoch} not seen yet; asking for scrubs anyway");
        }
        let map = self.monc.map();
        let targets = scrub_targets(&map, &self.monc, self.id, &reports);
        warn!(
            "salvage: {} damaged place(s) in this node's store logs (listed above); asking \
             nodes {targets:?} to scrub now so the damaged shards are rebuilt from their peers",
            reports.len()
        );
        for n in targets {
            if n == self.id {
                self.scrub.request_start();
                continue;
            }
            let mut e = Enc::new(map.epoch);
            e.0.extend_from_slice(&super::scrub::scrub_request(1));
            let r = self.peer(n).and_then(|c| {
                let reply = c.request(
                    OutMessage::new(wire::MSG_NODE_SCRUB, e.finish()),
                    REQUEST_TIMEOUT,
                )?;
                wire::parse_reply(&reply.payload)?;
                Ok(())
            });
            match r {
                Ok(()) => info!("salvage: node {n} starts a scrub pass"),
                Err(e) => warn!("salvage: asking node {n} to scrub: {e}"),
            }
        }
    }
}
