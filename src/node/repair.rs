//! Single-object repair: rebuild chosen shards of an object at its current version from k
//! good shards (EC reconstruct) and write them to their members (`MSG_SHARD_REPAIR`).
//!
//! Used by the scrub (`scrub.rs`), by reads that meet a corrupt shard (the read is served
//! degraded; the shard is rewritten after the reply, still inside the PG's turn), and meant
//! for recovery. A repair never moves a shard backwards: a member whose shard is already at a
//! newer version refuses it (`Local::repair`).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use ec::Shard;
use messenger::{Payload, SendBuf};
use tracing::{info, warn};

use super::local::{ShardData, ShardMeta, ShardWrite, WriteKind, BASE_ANY};
use super::primary::{bit, Ctx, ObjState, PgCache};
use super::Node;
use crate::error::{Error, Result};
use crate::map::{ClusterMap, PoolInfo};
use crate::wire::{self, Status};

/// A corrupt shard a read met, to be rewritten after the op's reply.
#[derive(Debug, Clone)]
pub struct PendingRepair {
    pub pool: u64,
    pub pg: u32,
    pub name: Vec<u8>,
    pub version: u64,
    pub slots: u64,
}

/// Most read repairs waiting at once (more are dropped; the scrub finds them).
const PENDING_REPAIRS_MAX: usize = 1024;

/// What [`Node::send_whole_shards`] achieved.
#[derive(Default)]
pub(crate) struct Sent {
    /// Slots whose member made its shard durable.
    pub acked: u64,
    /// Shard bytes they wrote.
    pub bytes: u64,
    pub first_err: Option<Error>,
}

impl Node {
    /// The op's view of a PG for background work (scrub, repair); `None` when this node is
    /// not its primary under `map`.
    pub(crate) fn pg_ctx(&self, map: &Arc<ClusterMap>, pool: &PoolInfo, pg: u32) -> Option<Ctx> {
        let acting = (*self.monc.acting(map, pool, pg)).clone();
        if acting.primary != Some(self.id) {
            return None;
        }
        let profile = pool.profile();
        Some(Ctx {
            codec: self.codec(profile),
            map: map.clone(),
            pool: pool.clone(),
            pg,
            acting,
            profile,
        })
    }

    /// Reconstruct `slots_mask` of `name` at `st.version` from k other current shards and
    /// write them to their members. Returns the bytes written.
    pub(crate) fn repair_shards(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        slots_mask: u64,
    ) -> Result<u64> {
        let len = ctx.clip(0, st.size);
        let mut sources: Vec<usize> = (0..ctx.n())
            .filter(|s| slots_mask & bit(*s) == 0 && st.current & bit(*s) != 0)
            .filter(|s| ctx.up(*s).is_some())
            .collect();
        // Prefer this node's own shard, then data shards (cheapest to decode from).
        sources.sort_by_key(|s| (ctx.acting.members[*s] != Some(self.id), *s));
        let mut got: HashMap<usize, Vec<u8>> = HashMap::new();
        for s in sources {
            if got.len() >= ctx.k() {
                break;
            }
            // One at a time, so a bad source is skipped rather than failing the repair.
            match self.fetch(ctx, name, st, &[(s, 0, len)]) {
                Ok(mut f) => {
                    got.insert(s, f.remove(&s).expect("asked").padded());
                }
                Err(e) => warn!(
                    "repair of {}: source shard {s} unreadable: {e}",
                    String::from_utf8_lossy(name)
                ),
            }
        }
        if got.len() < ctx.k() {
            return Err(Error::remote(
                Status::Unavailable,
                format!(
                    "repair of {}: {} good shard(s) readable, {} needed",
                    String::from_utf8_lossy(name),
                    got.len(),
                    ctx.k()
                ),
            ));
        }
        let rebuilt = rebuild(ctx, st, &got, slots_mask)?;
        self.write_repairs(ctx, name, st, rebuilt)
    }

    /// Send reconstructed shards (slot, bytes) to their members; the bytes written, or the
    /// first failure.
    pub(crate) fn write_repairs(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        shards: Vec<(usize, Vec<u8>)>,
    ) -> Result<u64> {
        let data = shards.into_iter().map(|(s, v)| (s, Arc::new(v))).collect();
        let sent = self.send_whole_shards(ctx, name, st, &data, wire::MSG_SHARD_REPAIR, &|w| {
            self.local.repair(w)
        });
        match sent.first_err {
            Some(e) => Err(e),
            None => Ok(sent.bytes),
        }
    }

    /// Write whole shards of an object at its current version (meta and every user xattr) to
    /// the members of their slots: `msg_type` to remote members, `local` for this node's own.
    pub(crate) fn send_whole_shards(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        data: &HashMap<usize, Arc<Vec<u8>>>,
        msg_type: u16,
        local: &dyn Fn(&ShardWrite) -> Result<()>,
    ) -> Sent {
        let meta = ShardMeta {
            version: st.version,
            size: st.size,
            mtime_unix_ns: st.mtime_unix_ns,
            deleted: st.deleted,
        };
        let xattrs: Vec<(String, Option<Vec<u8>>)> = st
            .xattrs
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone())))
            .collect();
        let write = |s: usize| ShardWrite {
            pool: ctx.pool.id,
            pg: ctx.pg,
            name,
            shard: s as u8,
            kind: WriteKind::Full,
            base_version: BASE_ANY,
            meta,
            offset: 0,
            xattrs: xattrs.clone(),
            // The rebuilt shard keeps the object's request history, as the others do.
            reqs: st.reqs.clone(),
            data: ShardData::Flat(&data[&s]),
            chunk_crcs: Vec::new(),
            listed_crcs: Vec::new(),
        };
        let reqs = data
            .keys()
            .map(|&s| {
                let head = write(s).encode_header(ctx.map.epoch);
                (
                    s,
                    vec![SendBuf::Vec(head), SendBuf::Shared(data[&s].clone())],
                )
            })
            .collect();
        let on_me = |s: usize, _parts: Vec<SendBuf>| -> Result<Payload> {
            let _admitted = self.check_own_op(ctx.map.epoch, ctx.pool.id, ctx.pg)?;
            local(&write(s))?;
            Ok(Payload::from_vec(Vec::new()))
        };
        let mut sent = Sent::default();
        for (slot, r) in self.fan_out(ctx, msg_type, reqs, &on_me) {
            match r {
                Ok(_) => {
                    sent.acked |= 1 << slot;
                    sent.bytes += data[&slot].len() as u64;
                }
                Err(e) => {
                    sent.first_err
                        .get_or_insert(Error::FetchFailed(slot, Box::new(e)));
                }
            }
        }
        sent
    }

    /// A read met corrupt shards: queue them for repair after the op's reply.
    pub(super) fn note_corrupt(&self, ctx: &Ctx, name: &[u8], st: &ObjState, slots: u64) {
        self.scrub
            .counts
            .read_corrupt
            .fetch_add(slots.count_ones() as u64, Relaxed);
        let mut p = self.scrub.pending.lock().unwrap();
        if p.len() < PENDING_REPAIRS_MAX {
            p.push(PendingRepair {
                pool: ctx.pool.id,
                pg: ctx.pg,
                name: name.to_vec(),
                version: st.version,
                slots,
            });
            self.scrub.has_pending.store(true, Relaxed);
        }
    }

    /// Rewrite the corrupt shards reads of this PG met (run by the op thread after the reply,
    /// while it still holds the PG, so no client op of the PG runs meanwhile).
    pub(super) fn run_read_repairs(&self, key: (u64, u32)) {
        if !self.scrub.has_pending.load(Relaxed) {
            return;
        }
        let mine: Vec<PendingRepair> = {
            let mut p = self.scrub.pending.lock().unwrap();
            let (mine, rest): (Vec<_>, Vec<_>) = p.drain(..).partition(|r| (r.pool, r.pg) == key);
            *p = rest;
            self.scrub.has_pending.store(!p.is_empty(), Relaxed);
            mine
        };
        for r in mine {
            let map = self.monc.map();
            let Some(pool) = map.pools.get(&r.pool).cloned() else {
                continue;
            };
            let Some(ctx) = self.pg_ctx(&map, &pool, r.pg) else {
                continue;
            };
            // Resolve afresh: the op may itself have written the object after reading it.
            let mut scratch = PgCache::default();
            let st = match self.resolve(&ctx, &mut scratch, &r.name) {
                Ok(st) if st.version == r.version && st.exists() => st,
                _ => continue,
            };
            match self.repair_shards(&ctx, &r.name, &st, r.slots) {
                Ok(bytes) => {
                    self.scrub
                        .counts
                        .read_repaired
                        .fetch_add(r.slots.count_ones() as u64, Relaxed);
                    info!(
                        "read repair: {} shard(s) {:#x} rewritten ({bytes} bytes)",
                        String::from_utf8_lossy(&r.name),
                        r.slots
                    );
                }
                Err(e) => warn!(
                    "read repair of {} shards {:#x} failed: {e}",
                    String::from_utf8_lossy(&r.name),
                    r.slots
                ),
            }
        }
    }
}

/// Rebuild the `mask` slots from the good shards in `got` (each the full padded shard
/// length); each result is clipped to its slot's meaningful bytes.
pub(crate) fn rebuild(
    ctx: &Ctx,
    st: &ObjState,
    got: &HashMap<usize, Vec<u8>>,
    mask: u64,
) -> Result<Vec<(usize, Vec<u8>)>> {
    let len = ctx.clip(0, st.size) as usize;
    let mut wanted: HashMap<usize, Vec<u8>> = (0..ctx.n())
        .filter(|s| mask & bit(*s) != 0)
        .map(|s| (s, vec![0u8; len]))
        .collect();
    if len > 0 {
        let mut refs: HashMap<usize, &mut Vec<u8>> =
            wanted.iter_mut().map(|(s, v)| (*s, v)).collect();
        let mut slots: Vec<Shard> = Vec::with_capacity(ctx.n());
        let mut used = 0;
        for s in 0..ctx.n() {
            slots.push(match (got.get(&s), refs.remove(&s)) {
                (_, Some(w)) => Shard::Wanted(w),
                (Some(v), None) if used < ctx.k() => {
                    used += 1;
                    Shard::Present(v)
                }
                _ => Shard::Missing,
            });
        }
        ctx.codec.reconstruct(&mut slots)?;
    }
    let mut out: Vec<(usize, Vec<u8>)> = wanted.into_iter().collect();
    for (s, v) in &mut out {
        v.truncate(ctx.clip(*s, st.size) as usize);
    }
    out.sort_by_key(|(s, _)| *s);
    Ok(out)
}
