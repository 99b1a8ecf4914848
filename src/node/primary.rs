//! Client ops on a PG's primary: find the object's authoritative version among the members,
//! read (degraded when a data shard is missing), and write (encode, fan shard writes out,
//! acknowledge once every up member is durable and at least min_size are).
//!
//! **Which version is the object at?** Each member's shard says its version. The newest
//! version held by at least k up members is authoritative (decodable). A newer version held by
//! fewer than k is a write that did not complete: when the members that are known not to hold
//! it leave fewer than min_size that might, it cannot have been acknowledged and is rolled back
//! on the members that hold it (each keeps the record that undoes its last write); otherwise
//! the object is reported unavailable until more members answer. Members at an older version
//! are stale: they are not read, and take only whole-shard writes until recovery (issue 8)
//! catches them up.
//!
//! Versions are `epoch << 32 | per-PG counter` (and always above the object's current
//! version): a new primary always has a newer epoch than the last, so versions only grow.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ec::{Codec, Profile, Shard};
use messenger::checksum::crc32c_combine;
use messenger::{BufPool, Incoming, OutMessage, Payload, SendBuf};
use smallvec::SmallVec;

use super::local::{
    ReqHistory, ReqId, ShardData, ShardMeta, ShardState, ShardWrite, StagedRef, WriteKind, BASE_ANY,
};
use super::Node;
use crate::error::{Error, Result};
use crate::map::{ClusterMap, PoolInfo};
use crate::ops::{self, ClientOp, ObjStat, OpResult, SubOp};
use crate::optrack::{self, Ev};
use crate::placement::{pg_of, Acting};
use crate::queue::Gather;
use crate::wire::{self, Dec, Enc, Status};

/// Timeout of one shard request.
const SHARD_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause before sending a shard write again to a member that failed it.
const RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Attempts of an op whose cached object state turned out stale.
pub(super) const OP_ATTEMPTS_MAX: u32 = 3;
/// Objects whose state a PG keeps cached.
const CACHE_OBJECTS_MAX: usize = 4096;
/// Longest xattr name.
const XATTR_NAME_BYTES_MAX: usize = 200;

/// The authoritative state of an object, as the primary determined it.
#[derive(Debug, Clone, Default)]
pub struct ObjState {
    pub version: u64,
    pub size: u64,
    pub mtime_unix_ns: u64,
    pub deleted: bool,
    /// Slots whose shard is at `version`.
    pub current: u64,
    pub xattrs: BTreeMap<String, Vec<u8>>,
    /// The client requests whose writes made the object's recent versions, through
    /// `version`, as its shards recorded them.
    pub reqs: ReqHistory,
    /// Slots whose shard still keeps the rollback record of `version`, as `resolve` found
    /// them (0 when the state was learnt otherwise): a settle list that never reached them
    /// (lost with a primary's restart) is made up for by scrub.
    pub rollbacks: u64,
}

impl ObjState {
    pub fn exists(&self) -> bool {
        self.version > 0 && !self.deleted
    }
}

/// What a PG's primary remembers between ops (reset when the PG's members change).
#[derive(Default)]
pub struct PgCache {
    /// `MonClient::node_change_epoch` when the cache was filled.
    pub(super) node_change_epoch: u64,
    pub(super) members: Vec<Option<u32>>,
    pub(super) objs: HashMap<Vec<u8>, ObjState>,
    seq: u32,
    /// `Some(node_change_epoch)` when a recovery pass planned at that epoch, with these
    /// members, left every up member complete: from then until a node changes state, every
    /// acknowledged write of the PG includes this node's own shard, so an object this node
    /// has no shard of does not exist (no stat round to the members is needed to know it).
    pub(super) complete_at: Option<u64>,
    /// Newest version this primary wrote to every up member while `complete_at` held.
    pub(super) last_version: u64,
    /// Newest version the up members were told they are complete through (their marks).
    pub(super) marked: u64,
    /// Writes acknowledged without a member the node's current map has up (one failed, or a
    /// node changed state while the write ran: its members came from the older map). A
    /// recovery pass makes the PG complete only if none was acknowledged after it took the
    /// members' logs (`Pass::skipped`): such a write may be in no plan.
    pub(super) skipped: u64,
    /// Mutations this node applied as the PG's primary, by request id (kept across member
    /// changes: an op applied is applied, whoever led the PG since).
    applied: Applied,
    /// Acknowledged writes that replaced bytes: (name, version, slots) whose members keep a
    /// rollback record with the old bytes, no longer needed; sent to them in batches
    /// (`MSG_SHARD_SETTLE`, the recovery loop's `send_settles`). At most
    /// [`SETTLE_PENDING_MAX`]: past that, records stay until the object's next write. Its
    /// own lock: the batch is taken without waiting for the PG's running op.
    pub(super) to_settle: ToSettle,
    /// Acknowledged removes, oldest first. Once
    /// `tombstone_keep_s` old and under the members' marks, the members are told to forget
    /// the tombstones (`MSG_SHARD_FORGET`, the recovery loop's `send_forgets`). At most
    /// [`FORGET_PENDING_MAX`] (past that, and when this node stops leading the PG before
    /// every member has answered, tombstones stay for scrub to find); its own lock, like
    /// `to_settle`.
    pub(super) to_forget: ToForget,
}

/// Acknowledged writes to settle: (name, version, slots).
pub(super) type ToSettle = Arc<Mutex<Vec<(Vec<u8>, u64, u64)>>>;

/// Acknowledged removes whose tombstones are to be forgotten, oldest first.
pub(super) type ToForget = Arc<Mutex<VecDeque<Forget>>>;

/// An acknowledged remove whose tombstone is to be forgotten.
pub(super) struct Forget {
    pub name: Vec<u8>,
    pub version: u64,
    /// When it was acknowledged.
    pub at: Instant,
    /// Slots that answered a SHARD_FORGET naming it (kept until every slot has: a member
    /// down meanwhile gets it when it is back).
    pub done: u64,
}

/// Acknowledged removes a PG's primary holds until their tombstones may go.
const FORGET_PENDING_MAX: usize = 16 << 10;

/// Acknowledged writes a PG's primary holds for settling between batches.
pub(super) const SETTLE_PENDING_MAX: usize = 16 << 10;
/// A range overwritten in place is settled from this many bytes on a shard.
const SETTLE_RANGE_BYTES_MIN: usize = 64 << 10;

/// Client mutations this primary applied recently, (client, `ClientOp::reqid`) → the version
/// they made, so a resend of one (its reply was lost, or the client gave up waiting) is
/// answered with that version instead of being applied twice. In memory, per PG: every one
/// applied within the last `keep` (the node's `tombstone_keep_s`, 120 s by default: four times
/// the clients' op deadline, after which they no longer resend), however fast the PG is
/// written, up to [`APPLIED_PER_PG_MAX`]; and at least the newest [`APPLIED_PER_PG_MIN`]
/// whatever their age. A resend that reaches another primary is recognised by the object
/// instead: each shard keeps the request ids of the writes that made the object's last
/// versions (`ObjState::reqs`).
#[derive(Default)]
struct Applied {
    versions: HashMap<ReqId, u64>,
    /// Oldest first, with when each was applied.
    order: VecDeque<(ReqId, Instant)>,
}

/// Request ids a PG's primary keeps whatever their age.
const APPLIED_PER_PG_MIN: usize = 256;
/// Most request ids a PG's primary keeps (~72 bytes each with the map's and the queue's
/// overhead: ~1.2 MiB for a PG written 130 times a second for two minutes). Past it a resend
/// of an older write is still recognised by its object's history (its last 8 writes).
const APPLIED_PER_PG_MAX: usize = 16 << 10;

impl Applied {
    fn get(&self, r: ReqId) -> Option<u64> {
        self.versions.get(&r).copied()
    }

    /// Remember `r` made `version` (applied `now`), and forget those older than `keep` beyond
    /// the newest [`APPLIED_PER_PG_MIN`].
    fn insert(&mut self, r: ReqId, version: u64, now: Instant, keep: Duration) {
        if self.versions.insert(r, version).is_none() {
            self.order.push_back((r, now));
        }
        while self.order.len() > APPLIED_PER_PG_MAX
            || (self.order.len() > APPLIED_PER_PG_MIN
                && self
                    .order
                    .front()
                    .is_some_and(|&(_, at)| now.saturating_duration_since(at) > keep))
        {
            let (old, _) = self.order.pop_front().expect("non-empty");
            self.versions.remove(&old);
        }
    }
}

/// One op's view of its PG.
pub struct Ctx {
    pub map: Arc<ClusterMap>,
    pub pool: PoolInfo,
    pub pg: u32,
    pub acting: Acting,
    pub profile: Profile,
    pub codec: Arc<Codec>,
}

impl Ctx {
    pub(super) fn k(&self) -> usize {
        self.pool.k as usize
    }
    pub(super) fn n(&self) -> usize {
        self.pool.size()
    }
    pub(super) fn up(&self, slot: usize) -> Option<u32> {
        self.acting.members[slot].filter(|n| self.map.is_up(*n))
    }
    /// Bytes of shard `slot` that are not padding.
    pub(super) fn clip(&self, slot: usize, size: u64) -> u64 {
        if size == 0 {
            return 0;
        }
        // Parity is non-zero only where some data shard has bytes; shard 0 has the most.
        self.profile
            .shard_data_len(size, if slot >= self.k() { 0 } else { slot })
    }
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

pub(super) fn bit(slot: usize) -> u64 {
    1u64 << slot
}

/// Internal: the cached state was stale; resolve again and retry.
pub(super) fn stale() -> Error {
    Error::remote(Status::VersionMismatch, "stale cached object state")
}

/// The mutation part of a request.
pub(super) struct Mutation<'a> {
    pub(super) data: Option<SubOp<'a>>,
    pub(super) xattrs: Vec<(String, Option<Vec<u8>>)>,
}

impl Node {
    /// How long a PG's primary remembers the request ids of the mutations it applied (see
    /// [`Applied`]): as long as the PG's members keep a removed object's tombstone.
    fn applied_keep(&self) -> Duration {
        Duration::from_secs(self.cfg.tombstone_keep_s)
    }

    pub(super) fn run_client_op(
        &self,
        job: &Incoming,
        cache: &Mutex<PgCache>,
    ) -> Result<Vec<SendBuf>> {
        let p: &[u8] = job.payload();
        let op = ClientOp::decode(p)?;
        if op.epoch > self.epoch() {
            self.monc.wait_epoch(op.epoch, super::EPOCH_WAIT);
        }
        let staged = if op.flags & ops::FLAG_STAGED != 0 {
            Some(self.take_staged(job.peer(), op.upload_id)?)
        } else {
            None
        };
        // Only ops without reads are recognised when resent (the results of reads would have
        // to be kept and replayed).
        let reqid = (op.reqid != 0 && !op.ops.iter().any(|o| o.is_read())).then(|| ReqId {
            who: job.peer(),
            id: op.reqid,
        });
        let mut attempt = 0;
        loop {
            attempt += 1;
            let src = Source {
                staged: staged.as_deref(),
                request: job.payload(),
                reqid,
                upload: ReqId {
                    who: job.peer(),
                    id: op.upload_id,
                },
            };
            match self.try_op(&op, src, cache) {
                Err(Error::Remote {
                    status: Status::VersionMismatch,
                    message,
                }) if message == "stale cached object state" && attempt < OP_ATTEMPTS_MAX => {
                    cache.lock().unwrap().objs.remove(op.name);
                }
                r => return r,
            }
        }
    }

    pub(super) fn ctx(&self, op: &ClientOp) -> Result<Ctx> {
        let map = self.monc.map();
        let pool = map.pools.get(&op.pool).cloned().ok_or_else(|| {
            Error::remote(
                Status::NoSuchPool,
                format!("no pool with id {} at map epoch {}", op.pool, map.epoch),
            )
        })?;
        ops::check_name(op.name).map_err(|m| Error::remote(Status::Invalid, m))?;
        let pg = pg_of(&pool, op.name);
        let acting = (*self.monc.acting(&map, &pool, pg)).clone();
        if acting.primary != Some(self.id) {
            return Err(Error::remote(
                Status::WrongPrimary,
                format!(
                    "node {} is not the primary of pg {}.{pg:x} at epoch {} (primary: {:?})",
                    self.id, pool.id, map.epoch, acting.primary
                ),
            ));
        }
        if op.epoch < acting.since {
            // Sent before the PG's current interval: another primary may have written since
            // (a request TCP delivered late, after a partition healed). The client resends.
            self.counters.stale_ops_refused.fetch_add(1, Relaxed);
            return Err(Error::remote(
                Status::StaleEpoch,
                format!(
                    "op of epoch {} predates pg {}.{pg:x}'s current interval (since epoch {}); \
                     resend it with the map of epoch {}",
                    op.epoch, pool.id, acting.since, map.epoch
                ),
            ));
        }
        let profile = pool.profile();
        Ok(Ctx {
            codec: self.codec(profile),
            map,
            pool,
            pg,
            acting,
            profile,
        })
    }

    fn try_op(&self, op: &ClientOp, src: Source, cache: &Mutex<PgCache>) -> Result<Vec<SendBuf>> {
        let ctx = self.ctx(op)?;
        let m = check_ops(op)?;
        let mut c = cache.lock().unwrap();
        self.refresh_cache(&ctx, &mut c);
        let answer = |version: u64| {
            self.counters.resends_answered.fetch_add(1, Relaxed);
            let mut e = Enc::new(ctx.map.epoch);
            e.u16(Status::Ok as u16);
            ops::encode_results_parts(e, version, Vec::new())
        };
        // A resend of a mutation this node applied: its version, not a second apply.
        if let Some(version) = src.reqid.and_then(|r| c.applied.get(r)) {
            return Ok(answer(version));
        }
        let st = self.resolve(&ctx, &mut c, op.name)?;
        // A resend of a mutation that made one of the object's recent versions (applied by
        // a primary before this one, which died or lost the PG before it replied, and maybe
        // overwritten since): the history holds only versions that stand.
        if let Some((r, v)) = src.reqid.and_then(|r| Some((r, st.reqs.version_of(r)?))) {
            c.applied.insert(r, v, Instant::now(), self.applied_keep());
            return Ok(answer(v));
        }
        for o in &op.ops {
            match o {
                SubOp::AssertVersion(v) => {
                    if !st.exists() {
                        return Err(not_found(op.name));
                    }
                    if st.version != *v {
                        return Err(Error::remote(
                            Status::VersionMismatch,
                            format!("object is at version {}, the op asserted {v}", st.version),
                        ));
                    }
                }
                SubOp::AssertExists if !st.exists() => return Err(not_found(op.name)),
                SubOp::AssertAbsent if st.exists() => {
                    return Err(Error::remote(Status::Exists, "object exists"))
                }
                _ => {}
            }
        }
        let mut results = Vec::new();
        for o in op.ops.iter().filter(|o| o.is_read()) {
            if !st.exists() {
                return Err(not_found(op.name));
            }
            results.push(match o {
                SubOp::Stat => OpResult::Stat(ObjStat {
                    size: st.size,
                    version: st.version,
                    mtime_unix_ns: st.mtime_unix_ns,
                }),
                SubOp::Read { offset, len } => {
                    let d = self.read_range(&ctx, op.name, &st, *offset, *len)?;
                    self.counters.read_bytes.fetch_add(d.len() as u64, Relaxed);
                    OpResult::Data(d.into())
                }
                SubOp::GetXattr(n) => OpResult::Xattr(
                    st.xattrs
                        .get(*n)
                        .cloned()
                        .ok_or_else(|| Error::remote(Status::NoXattr, format!("no xattr {n:?}")))?,
                ),
                _ => OpResult::Xattrs(
                    st.xattrs
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                ),
            });
        }
        let version = if m.data.is_none() && m.xattrs.is_empty() {
            self.counters.read_ops.fetch_add(1, Relaxed);
            st.version
        } else {
            self.counters.write_ops.fetch_add(1, Relaxed);
            self.hot.invalidate(op.pool, op.name);
            let reqid = src.reqid;
            let v = self.write(&ctx, &mut c, op.name, &st, m, src)?;
            if let Some(r) = reqid {
                c.applied.insert(r, v, Instant::now(), self.applied_keep());
            }
            v
        };
        let mut e = Enc::new(ctx.map.epoch);
        e.u16(Status::Ok as u16);
        Ok(ops::encode_results_parts(e, version, results))
    }

    /// Erasure-coding counters: `bytes` of object data went through `encode`.
    fn count_encoded(&self, bytes: usize) {
        let ec = &self.perf.ec;
        ec.encode_calls.fetch_add(1, Relaxed);
        ec.encoded_bytes.fetch_add(bytes as u64, Relaxed);
    }

    /// Trust cached object states only while no node changed state since they were learnt:
    /// this node may have stopped being primary meanwhile (another one wrote), or a member may
    /// have missed writes.
    pub(super) fn refresh_cache(&self, ctx: &Ctx, c: &mut PgCache) {
        let changed = self.monc.node_change_epoch();
        if c.members != ctx.acting.members || c.node_change_epoch != changed {
            c.members = ctx.acting.members.clone();
            c.node_change_epoch = changed;
            c.objs.clear();
            c.complete_at = None;
        }
    }

    /// The PG's lists of writes to settle and removes to forget (`PgCache::to_settle`,
    /// `to_forget`).
    fn pending_lists(&self, ctx: &Ctx) -> (ToSettle, ToForget) {
        let mut pgs = self.pgs.lock().unwrap();
        let slot = pgs
            .entry((ctx.pool.id, ctx.pg))
            .or_insert_with(super::PgSlot::new);
        (slot.to_settle.clone(), slot.to_forget.clone())
    }

    /// Rollback records of an object's current version met by scrub, long after the write:
    /// the settle list that named them was lost (its primary restarted, the PG changed
    /// hands). Added to the PG's list (`MSG_SHARD_SETTLE` drops them) when at least
    /// min_size shards hold the version: resolve never rolls such a version back (fewer
    /// holders could be a write that failed, which a rollback may still undo).
    pub(super) fn rollbacks_found(&self, ctx: &Ctx, name: &[u8], st: &ObjState) {
        if st.rollbacks == 0 || st.current.count_ones() < ctx.pool.min_size {
            return;
        }
        let (pending, _) = self.pending_lists(ctx);
        let mut p = pending.lock().unwrap();
        if p.len() < SETTLE_PENDING_MAX {
            p.push((name.to_vec(), st.version, st.rollbacks));
        }
    }

    /// A removed object's tombstone met outside the list of the primary that removed it
    /// (scrub): that primary restarted, or the PG changed hands, before the tombstone was
    /// due. Queued to be forgotten once `tombstone_keep_s` past the remove (its `mtime`);
    /// a younger one is left to the list that holds it, or to the next pass.
    pub(super) fn tombstone_found(&self, ctx: &Ctx, name: &[u8], st: &ObjState) {
        let keep = Duration::from_secs(self.cfg.tombstone_keep_s);
        let age = Duration::from_nanos(now_ns().saturating_sub(st.mtime_unix_ns));
        if age < keep {
            return;
        }
        let (_, pending) = self.pending_lists(ctx);
        let mut p = pending.lock().unwrap();
        if p.len() < FORGET_PENDING_MAX
            && !p.iter().any(|e| e.version == st.version && e.name == name)
        {
            // Due at once (the list is oldest first).
            let at = Instant::now()
                .checked_sub(keep)
                .unwrap_or_else(Instant::now);
            p.push_front(Forget {
                name: name.to_vec(),
                version: st.version,
                at,
                done: 0,
            });
        }
    }

    /// Forget a cached object state (it turned out stale).
    pub(super) fn forget(c: &mut PgCache, name: &[u8]) {
        c.objs.remove(name);
    }

    // ---- shard requests -------------------------------------------------------------------

    /// Send one shard request per (slot, parts) and collect the replies; the slot on this
    /// node runs `local` here, after the remote requests are on their way.
    pub(super) fn fan_out(
        &self,
        ctx: &Ctx,
        msg_type: u16,
        reqs: Vec<(usize, Vec<SendBuf>)>,
        local: &dyn Fn(usize, Vec<SendBuf>) -> Result<Payload>,
    ) -> Vec<(usize, Result<Payload>)> {
        self.fan_out_with(ctx, msg_type, reqs, local, None)
    }

    /// [`Node::fan_out`], where `start_local` may start this node's slot without blocking:
    /// `Ok(true)` means it took the callback and will call it exactly once (from any thread);
    /// `Ok(false)` that it declined (then `local` runs here).
    pub(super) fn fan_out_with(
        &self,
        ctx: &Ctx,
        msg_type: u16,
        reqs: Vec<(usize, Vec<SendBuf>)>,
        local: &dyn Fn(usize, Vec<SendBuf>) -> Result<Payload>,
        start_local: Option<&StartLocal>,
    ) -> Vec<(usize, Result<Payload>)> {
        let up_here = |s: usize, here: bool| ctx.up(s).is_some_and(|n| (n == self.id) == here);
        let remote = reqs.iter().filter(|(s, _)| up_here(*s, false)).count();
        let mine_n = reqs.iter().filter(|(s, _)| up_here(*s, true)).count();
        // Every remote request ends in exactly one push (reply, timeout, connection loss, or
        // no connection), and this thread wakes once, when the last is in. With `start_local`
        // this node's slots push there too, so that waiting for them is the same one wake-up.
        let expected = remote + if start_local.is_some() { mine_n } else { 0 };
        let replies = Arc::new(Gather::new(expected));
        let op = optrack::current();
        let mut out = Vec::new();
        let mut mine = Vec::new();
        for (slot, parts) in reqs {
            let Some(node) = ctx.up(slot) else {
                out.push((slot, Err(Error::remote(Status::Unavailable, "member down"))));
                continue;
            };
            if node == self.id {
                mine.push((slot, parts));
                continue;
            }
            optrack::event(Ev::SubOpSent, slot as u8);
            match self.peer(node) {
                Ok(conn) => {
                    let (tx, op) = (replies.clone(), op.clone());
                    let msg = OutMessage { msg_type, parts };
                    conn.request_with(msg, SHARD_TIMEOUT, move |r| {
                        let r = r.map_err(Error::from).and_then(|reply| {
                            let (_, res) = wire::parse_reply_epoch(&reply.payload);
                            res.map(|_| reply.payload.clone())
                        });
                        // Recorded when the reply arrives, not when the op thread wakes.
                        if let Some(op) = &op {
                            op.event(sub_op_ev(&r), slot as u8);
                        }
                        tx.push((slot, r));
                    });
                }
                Err(e) => {
                    optrack::event(Ev::SubOpFailed, slot as u8);
                    replies.push((slot, Err(e)));
                }
            }
        }
        for (slot, parts) in mine {
            optrack::event(Ev::SubOpSent, slot as u8);
            let Some(start) = start_local else {
                let r = local(slot, parts);
                optrack::event(sub_op_ev(&r), slot as u8);
                out.push((slot, r));
                continue;
            };
            let (tx, op) = (replies.clone(), op.clone());
            let done: LocalDone = Box::new(move |r| {
                if let Some(op) = &op {
                    op.event(sub_op_ev(&r), slot as u8);
                }
                tx.push((slot, r));
            });
            let r = match start(slot, done) {
                Ok(true) => continue,
                Ok(false) => local(slot, parts),
                Err(e) => Err(e),
            };
            optrack::event(sub_op_ev(&r), slot as u8);
            replies.push((slot, r));
        }
        out.extend(replies.wait_all());
        out
    }

    /// The local half of a small shard request (stat, read, rollback).
    pub(super) fn local_small(
        &self,
        msg_type: u16,
    ) -> impl Fn(usize, Vec<SendBuf>) -> Result<Payload> + '_ {
        move |_slot, parts: Vec<SendBuf>| {
            let body = SendBuf::concat(&parts);
            self.local_shard_op(msg_type, &body).map(Payload::from_vec)
        }
    }

    pub(super) fn local_shard_op(&self, msg_type: u16, body: &[u8]) -> Result<Vec<u8>> {
        let mut d = Dec::new(body);
        let epoch = d.u64()?;
        let mut e = Enc::new(self.epoch());
        e.u16(Status::Ok as u16);
        match msg_type {
            wire::MSG_SHARD_WRITE => {
                let w = ShardWrite::decode(&mut d)?;
                let _admitted = self.check_own_op(epoch, w.pool, w.pg)?;
                self.local.apply(&w)?;
            }
            t => {
                let pool = d.u64()?;
                let pg = d.u32()?;
                let name = d.bytes()?;
                let shard = d.u8()?;
                // A drop or a rollback is checked; a read or a stat is not.
                let _admitted = match t {
                    wire::MSG_SHARD_READ | wire::MSG_SHARD_STAT => None,
                    _ => Some(self.check_own_op(epoch, pool, pg)?),
                };
                match t {
                    wire::MSG_SHARD_READ => {
                        let (v, off, len) = (d.u64()?, d.u64()?, d.u64()?);
                        let flags = d.opt_flags()?;
                        let cached = flags & wire::SHARD_READ_FROM_DEVICE == 0;
                        let crcs = flags & wire::SHARD_READ_CHUNK_CRCS != 0;
                        let r = self
                            .local
                            .read(pool, pg, name, shard, v, off, len, cached)?;
                        super::local::encode_read(&mut e, &r, crcs);
                    }
                    wire::MSG_SHARD_STAT => self.local.stat(pool, pg, name, shard)?.encode(&mut e),
                    wire::MSG_SHARD_DROP => {
                        let version = d.u64()?;
                        self.drop_stale(pool, pg, name, shard, version)?
                            .encode(&mut e);
                    }
                    _ => {
                        let from = d.u64()?;
                        self.local
                            .rollback(pool, pg, name, shard, from)?
                            .encode(&mut e);
                    }
                }
            }
        }
        Ok(e.finish())
    }

    /// A member's `StaleEpoch` says it has heard from a newer primary of the PG: this node
    /// no longer leads it. That ends the op (`Err`, after asking for the newer map; the client
    /// refreshes its own and retries at the new primary); any other outcome is handed back.
    pub(super) fn unless_superseded<T>(&self, r: Result<T>) -> Result<Result<T>> {
        match r {
            Err(
                e @ Error::Remote {
                    status: Status::StaleEpoch,
                    ..
                },
            ) => {
                let _ = self.monc.subscribe();
                Err(e)
            }
            r => Ok(r),
        }
    }

    pub(super) fn shard_req_head(&self, ctx: &Ctx, name: &[u8], slot: usize) -> Enc {
        let mut e = Enc::new(ctx.map.epoch);
        e.u64(ctx.pool.id).u32(ctx.pg).bytes(name).u8(slot as u8);
        e
    }

    // ---- resolve --------------------------------------------------------------------------

    pub(super) fn resolve(&self, ctx: &Ctx, c: &mut PgCache, name: &[u8]) -> Result<ObjState> {
        if let Some(s) = c.objs.get(name) {
            return Ok(s.clone());
        }
        if let Some(st) = self.known_absent(ctx, c, name) {
            return Ok(st);
        }
        self.counters.resolves_asked.fetch_add(1, Relaxed);
        let reqs = (0..ctx.n())
            .filter(|s| ctx.acting.members[*s].is_some())
            .map(|s| {
                (
                    s,
                    vec![SendBuf::Vec(self.shard_req_head(ctx, name, s).finish())],
                )
            })
            .collect();
        let mut states: Vec<Option<ShardState>> = vec![None; ctx.n()];
        // Why each silent member is silent, for the error if the object cannot be resolved.
        let mut silent = Vec::new();
        let local = self.local_small(wire::MSG_SHARD_STAT);
        for (slot, r) in self.fan_out(ctx, wire::MSG_SHARD_STAT, reqs, &local) {
            // Counting a superseded member as silent would report a readable object as
            // unavailable: the client must go to the new primary instead.
            match self.unless_superseded(r)? {
                Ok(p) => states[slot] = parse_state(&p).ok(),
                Err(e) => silent.push(format!("shard {slot}: {e}")),
            }
        }
        let silent = if silent.is_empty() {
            String::new()
        } else {
            format!(" ({})", silent.join("; "))
        };
        // Slots without a member hold nothing: they count as answered.
        let known = |states: &[Option<ShardState>], s: usize| {
            states[s].is_some() || ctx.acting.members[s].is_none()
        };
        for _ in 0..ctx.n() + 1 {
            let version =
                |s: &Option<ShardState>| s.as_ref().and_then(|s| s.meta).map_or(0, |m| m.version);
            let top = states.iter().map(version).max().unwrap_or(0);
            let holders: Vec<usize> = (0..ctx.n())
                .filter(|s| version(&states[*s]) == top && states[*s].is_some())
                .collect();
            let unknown = (0..ctx.n()).filter(|s| !known(&states, *s)).count();
            if top == 0 && unknown >= ctx.k() {
                // Enough silent members to hold a whole object: "absent" would be a guess.
                return Err(Error::remote(
                    Status::Unavailable,
                    format!(
                        "object {}: no answering member has it, but {unknown} member(s) do not \
                         answer{silent}; retry when they are back",
                        String::from_utf8_lossy(name)
                    ),
                ));
            }
            if top == 0 {
                let st = ObjState {
                    current: holders.iter().fold(0, |a, s| a | bit(*s)),
                    ..ObjState::default()
                };
                remember(c, name, &st);
                return Ok(st);
            }
            if holders.len() >= ctx.k() {
                let first = states[holders[0]].as_ref().unwrap();
                let meta = first.meta.unwrap();
                let st = ObjState {
                    version: meta.version,
                    size: meta.size,
                    mtime_unix_ns: meta.mtime_unix_ns,
                    deleted: meta.deleted,
                    current: holders.iter().fold(0, |a, s| a | bit(*s)),
                    xattrs: first.xattrs.clone(),
                    // One version, one write, one history: any holder that recorded one.
                    reqs: holders
                        .iter()
                        .filter_map(|h| states[*h].as_ref())
                        .map(|s| &s.reqs)
                        .find(|r| !r.is_empty())
                        .cloned()
                        .unwrap_or_default(),
                    rollbacks: holders
                        .iter()
                        .filter(|h| {
                            states[**h]
                                .as_ref()
                                .is_some_and(|s| s.rollback_from == meta.version)
                        })
                        .fold(0, |a, s| a | bit(*s)),
                };
                remember(c, name, &st);
                return Ok(st);
            }
            // Leftovers: a member whose mark says its shards of its slot are complete through
            // `top` has no shard of the object, so `top` is not the object's current state
            // (it was removed since and the tombstone forgotten, or `top` never took). With
            // fewer than k holders and silent members together, nothing could read it either:
            // drop it where it is.
            let complete_without = (0..ctx.n()).any(|s| {
                states[s].as_ref().is_some_and(|st| {
                    st.meta.is_none()
                        && st
                            .mark
                            .is_some_and(|(slot, v)| slot as usize == s && v >= top)
                })
            });
            if complete_without && holders.len() + unknown < ctx.k() {
                self.at_holders(ctx, name, &holders, top, wire::MSG_SHARD_DROP, &mut states)?;
                continue;
            }
            // Members that answer without `top` prove it was never acknowledged only if they
            // were the members when it was written (its epoch is in the version): after a
            // remap, the shards that acknowledged it may sit on nodes no longer asked.
            let same_members = (top >> 32) >= ctx.map.membership_epoch;
            if !same_members || holders.len() + unknown >= ctx.pool.min_size as usize {
                return Err(Error::remote(
                    Status::Unavailable,
                    format!(
                        "object {}: version {top} is on {} shard(s) (k = {}), {unknown} \
                         member(s) do not answer{silent}{}, so whether it was acknowledged is \
                         unknown; retry when they are back (or after recovery)",
                        String::from_utf8_lossy(name),
                        holders.len(),
                        ctx.k(),
                        if same_members {
                            ""
                        } else {
                            " and the PG's members changed since it was written"
                        }
                    ),
                ));
            }
            // Provably never acknowledged: undo it where it landed.
            self.at_holders(
                ctx,
                name,
                &holders,
                top,
                wire::MSG_SHARD_ROLLBACK,
                &mut states,
            )?;
        }
        Err(Error::remote(Status::Internal, "resolve did not converge"))
    }

    /// Send `msg_type` (SHARD_ROLLBACK or SHARD_DROP of `version`) to the holders of a
    /// version; their states after replace `states`' entries.
    fn at_holders(
        &self,
        ctx: &Ctx,
        name: &[u8],
        holders: &[usize],
        version: u64,
        msg_type: u16,
        states: &mut [Option<ShardState>],
    ) -> Result<()> {
        let reqs = holders
            .iter()
            .map(|&s| {
                let mut e = self.shard_req_head(ctx, name, s);
                e.u64(version);
                (s, vec![SendBuf::Vec(e.finish())])
            })
            .collect();
        let local = self.local_small(msg_type);
        for (slot, r) in self.fan_out(ctx, msg_type, reqs, &local) {
            states[slot] = Some(parse_state(&r?)?);
        }
        Ok(())
    }

    /// The absent state of an object this node, as a complete member (`PgCache::complete_at`),
    /// has no shard of; `None` when that is not known without asking the members.
    fn known_absent(&self, ctx: &Ctx, c: &PgCache, name: &[u8]) -> Option<ObjState> {
        let valid = c.complete_at.is_some()
            && c.complete_at == Some(self.monc.node_change_epoch())
            && c.members == ctx.acting.members;
        if !valid {
            return None;
        }
        let slot = ctx
            .acting
            .members
            .iter()
            .position(|m| *m == Some(self.id))?;
        let mine = self
            .local
            .stat(ctx.pool.id, ctx.pg, name, slot as u8)
            .ok()?;
        if mine.meta.is_some() {
            return None;
        }
        self.counters.resolves_absent_local.fetch_add(1, Relaxed);
        let current = (0..ctx.n())
            .filter(|s| ctx.up(*s).is_some())
            .fold(0, |a, s| a | bit(s));
        Some(ObjState {
            current,
            ..ObjState::default()
        })
    }

    // ---- read -----------------------------------------------------------------------------

    /// Fetch shard ranges (slot, offset, len) at the object's version, clipped to the shard's
    /// meaningful bytes and zero-padded to `len`.
    pub(super) fn fetch(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        want: &[(usize, u64, u64)],
    ) -> Result<HashMap<usize, Fetched>> {
        let reqs = want
            .iter()
            .map(|&(slot, off, len)| {
                let mut e = self.shard_req_head(ctx, name, slot);
                e.u64(st.version)
                    .u64(off)
                    .u64(len)
                    .u8(wire::SHARD_READ_CHUNK_CRCS);
                (slot, vec![SendBuf::Vec(e.finish())])
            })
            .collect();
        let mut out = HashMap::new();
        let local = self.local_small(wire::MSG_SHARD_READ);
        for (slot, r) in self.fan_out(ctx, wire::MSG_SHARD_READ, reqs, &local) {
            let p = match r {
                Ok(p) => p,
                Err(Error::Remote {
                    status: Status::VersionMismatch,
                    ..
                }) => return Err(stale()),
                Err(e) => return Err(Error::FetchFailed(slot, Box::new(e))),
            };
            let mut d = Dec::new(&p);
            d.u64()?;
            d.u16()?;
            let n = d.u32()? as usize;
            let at = d.pos();
            if p.len() - at < n {
                return Err(Error::Malformed("shard read reply is short".into()));
            }
            let &(_, off, len) = want.iter().find(|w| w.0 == slot).expect("asked");
            let clip = ctx.clip(slot, st.size).saturating_sub(off).min(len) as usize;
            d.skip(n)?;
            out.insert(
                slot,
                Fetched {
                    data: p.slice(at, n.min(clip)),
                    len: len as usize,
                    crcs: parse_chunk_crcs(&mut d, n)?,
                },
            );
        }
        Ok(out)
    }

    /// Object bytes `[offset, offset + len)` (clamped to the size), degraded when needed.
    pub(super) fn read_range(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>> {
        match self.read_range_as(ctx, name, st, offset, len, false)?.0 {
            RangeBytes::Assembled(v) => Ok(v),
            RangeBytes::Extents(_) => unreachable!("assembled when asked to"),
        }
    }

    /// [`Node::read_range`], assembled in one buffer or (`by_ref`) left in the members'
    /// replies as extents in object order; and the bytes' CRC-32C when the members' chunk
    /// CRCs give it without summing them (every stripe unit read whole from a member's
    /// device).
    pub(super) fn read_range_as(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        offset: u64,
        len: u64,
        by_ref: bool,
    ) -> Result<(RangeBytes, Option<u32>)> {
        if offset >= st.size || len == 0 {
            return Ok((RangeBytes::Assembled(Vec::new()), Some(0)));
        }
        // A shard that fails to answer is read around (degraded), as long as k others can.
        // A corrupt one is also repaired after the op (`repair::note_corrupt`).
        let mut excluded = 0u64;
        let mut corrupt = 0u64;
        loop {
            let r = self.read_range_without(ctx, name, st, offset, len, excluded, by_ref);
            if let Err(Error::FetchFailed(slot, e)) = &r {
                if e.status() == Status::Corrupted {
                    corrupt |= bit(*slot);
                }
            } else if r.is_ok() && corrupt != 0 {
                self.note_corrupt(ctx, name, st, corrupt);
            }
            match r {
                Err(Error::Remote {
                    status: Status::VersionMismatch,
                    message,
                }) => {
                    return Err(Error::Remote {
                        status: Status::VersionMismatch,
                        message,
                    })
                }
                // A member with a newer map says this node no longer leads the PG (a node
                // went out or in): the client must retry at the new primary, not read around.
                Err(Error::FetchFailed(_, e))
                    if matches!(
                        *e,
                        Error::Remote {
                            status: Status::StaleEpoch,
                            ..
                        }
                    ) =>
                {
                    return Err(*e)
                }
                Err(Error::FetchFailed(slot, _)) if excluded & bit(slot) == 0 => {
                    excluded |= bit(slot)
                }
                Err(Error::FetchFailed(_, e)) => return Err(*e),
                r => return r,
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read_range_without(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        offset: u64,
        len: u64,
        excluded: u64,
        by_ref: bool,
    ) -> Result<(RangeBytes, Option<u32>)> {
        let len = len.min(st.size - offset);
        let k = ctx.k();
        let mut ranges: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
        for e in ctx.profile.extents(offset, len) {
            let r = ranges.entry(e.shard).or_insert((u64::MAX, 0));
            r.0 = r.0.min(e.shard_offset);
            r.1 = r.1.max(e.shard_offset + e.len as u64);
        }
        let avail =
            |s: usize| st.current & bit(s) != 0 && excluded & bit(s) == 0 && ctx.up(s).is_some();
        let missing: Vec<usize> = ranges.keys().copied().filter(|s| !avail(*s)).collect();
        let bufs: HashMap<usize, (u64, Fetched)> = if missing.is_empty() {
            let want: Vec<_> = ranges
                .iter()
                .map(|(s, (lo, hi))| (*s, *lo, hi - lo))
                .collect();
            self.fetch(ctx, name, st, &want)?
                .into_iter()
                .map(|(s, f)| (s, (ranges[&s].0, f)))
                .collect()
        } else {
            let lo = ranges.values().map(|r| r.0).min().unwrap();
            let hi = ranges.values().map(|r| r.1).max().unwrap();
            let mut sources: Vec<usize> = ranges.keys().copied().filter(|s| avail(*s)).collect();
            let mut others: Vec<usize> = (0..ctx.n())
                .filter(|s| avail(*s) && !sources.contains(s))
                .collect();
            others.sort_by_key(|s| (ctx.acting.members[*s] != Some(self.id), *s));
            sources.extend(others);
            sources.truncate(k);
            if sources.len() < k {
                return Err(Error::remote(
                    Status::Unavailable,
                    format!(
                        "object {}: only {} current shard(s) reachable, {k} needed",
                        String::from_utf8_lossy(name),
                        sources.len()
                    ),
                ));
            }
            let want: Vec<_> = sources.iter().map(|s| (*s, lo, hi - lo)).collect();
            let got: HashMap<usize, Vec<u8>> = self
                .fetch(ctx, name, st, &want)?
                .into_iter()
                .map(|(s, f)| (s, f.padded()))
                .collect();
            let mut wanted: HashMap<usize, Vec<u8>> = missing
                .iter()
                .map(|s| (*s, vec![0u8; (hi - lo) as usize]))
                .collect();
            {
                let mut slots: Vec<Shard> = Vec::with_capacity(ctx.n());
                let mut wanted_refs: HashMap<usize, &mut Vec<u8>> =
                    wanted.iter_mut().map(|(s, v)| (*s, v)).collect();
                for s in 0..ctx.n() {
                    slots.push(match (got.get(&s), wanted_refs.remove(&s)) {
                        (Some(v), _) => Shard::Present(v),
                        (None, Some(w)) => Shard::Wanted(w),
                        _ => Shard::Missing,
                    });
                }
                ctx.codec.reconstruct(&mut slots)?;
            }
            let ec = &self.perf.ec;
            ec.reconstruct_calls.fetch_add(1, Relaxed);
            ec.reconstructed_bytes
                .fetch_add(missing.len() as u64 * (hi - lo), Relaxed);
            got.into_iter()
                .chain(wanted)
                .map(|(s, v)| (s, (lo, Fetched::from_vec(v))))
                .collect()
        };
        // Extents come in object order and tile the range: append, no zeroing pass first.
        let mut crc = Some(0);
        if by_ref {
            let mut out = Vec::with_capacity(ctx.profile.extents(offset, len).count());
            for e in ctx.profile.extents(offset, len) {
                let (base, buf) = &bufs[&e.shard];
                let x = buf.extent((e.shard_offset - base) as usize, e.len);
                crc = crc.and_then(|a| {
                    let a = crc32c_combine(a, x.crc?, x.data.len());
                    Some(crc32c_combine(a, zeros_crc(x.zeros), x.zeros))
                });
                out.push(x);
            }
            return Ok((RangeBytes::Extents(out), crc));
        }
        let mut out = Vec::with_capacity(len as usize);
        for e in ctx.profile.extents(offset, len) {
            let (base, buf) = &bufs[&e.shard];
            let at = (e.shard_offset - base) as usize;
            debug_assert_eq!(e.object_offset - offset, out.len() as u64);
            buf.append_to(at, e.len, &mut out);
            crc = crc.and_then(|a| Some(crc32c_combine(a, buf.crc_of(at, e.len)?, e.len)));
        }
        debug_assert_eq!(out.len() as u64, len);
        Ok((RangeBytes::Assembled(out), crc))
    }

    // ---- write ----------------------------------------------------------------------------

    fn write<'a>(
        &self,
        ctx: &Ctx,
        c: &mut PgCache,
        name: &[u8],
        st: &ObjState,
        m: Mutation<'a>,
        src: Source<'a>,
    ) -> Result<u64> {
        let Source {
            staged,
            request,
            reqid,
            upload,
        } = src;
        let mut xattrs = if st.exists() {
            st.xattrs.clone()
        } else {
            BTreeMap::new()
        };
        let creates = matches!(
            m.data,
            Some(SubOp::WriteFull(_) | SubOp::Write { .. } | SubOp::Append(_))
        );
        if !st.exists()
            && !creates
            && (!m.xattrs.is_empty() || matches!(m.data, Some(SubOp::Remove)))
        {
            return Err(not_found(name));
        }
        for (k, v) in &m.xattrs {
            match v {
                Some(v) => {
                    xattrs.insert(k.clone(), v.clone());
                }
                None => {
                    if xattrs.remove(k).is_none() {
                        return Err(Error::remote(Status::NoXattr, format!("no xattr {k:?}")));
                    }
                }
            }
        }
        // The client's bytes are used where they lie in the request unless staged bytes (an
        // upload's earlier pieces) go in front: a 4 MiB write_full is not copied first.
        let with_staged = |d: &'a [u8]| -> Cow<'a, [u8]> {
            match staged {
                Some(s) => Cow::Owned([s, d].concat()),
                None => Cow::Borrowed(d),
            }
        };
        let up_mask = (0..ctx.n())
            .filter(|s| ctx.up(*s).is_some())
            .fold(0, |a, s| a | bit(s));
        let all_current = !st.exists() || up_mask & !st.current == 0;
        c.seq = c.seq.wrapping_add(1);
        let version = (st.version + 1).max((ctx.map.epoch << 32) | c.seq as u64);
        let meta = |size: u64, deleted: bool| ShardMeta {
            version,
            size,
            mtime_unix_ns: now_ns(),
            deleted,
        };
        enum Plan<'a> {
            Full(Cow<'a, [u8]>, bool),
            Range(u64, Cow<'a, [u8]>),
            Meta,
            /// A whole object of this size, its shards encoded and staged by the client.
            Staged(u64),
        }
        let plan = match &m.data {
            Some(SubOp::WriteFull(d)) => Plan::Full(with_staged(d), false),
            Some(SubOp::WriteStaged { size, members }) => {
                // The client staged by its map: the members must be this write's, and every
                // member this write goes to must have its shard.
                if members.len() != ctx.n() {
                    return Err(Error::remote(
                        Status::Invalid,
                        format!(
                            "a staged write lists {} members; pool {} has {} shards",
                            members.len(),
                            ctx.pool.id,
                            ctx.n()
                        ),
                    ));
                }
                let missing = (0..ctx.n())
                    .any(|s| ctx.up(s).is_some() && members[s] != ctx.acting.members[s]);
                if missing {
                    return Err(Error::remote(
                        Status::StaleEpoch,
                        format!(
                            "pg {}.{:x} at epoch {} has members {:?}; the shards were staged on \
                             {members:?}: stage them again",
                            ctx.pool.id, ctx.pg, ctx.map.epoch, ctx.acting.members
                        ),
                    ));
                }
                Plan::Staged(*size)
            }
            Some(SubOp::Remove) => Plan::Full(Cow::Borrowed(&[]), true),
            Some(SubOp::Write { offset, data }) => {
                let data = with_staged(data);
                self.counters
                    .write_bytes
                    .fetch_add(data.len() as u64, Relaxed);
                Plan::Range(*offset, data)
            }
            Some(SubOp::Append(data)) => {
                let data = with_staged(data);
                self.counters
                    .write_bytes
                    .fetch_add(data.len() as u64, Relaxed);
                Plan::Range(if st.exists() { st.size } else { 0 }, data)
            }
            _ => Plan::Meta,
        };
        let plan = match plan {
            Plan::Range(off, data) if !st.exists() => {
                let mut full = vec![0u8; off as usize];
                full.extend_from_slice(&data);
                Plan::Full(Cow::Owned(full), false)
            }
            Plan::Range(off, data) if !all_current => {
                let mut full = self.read_range(ctx, name, st, 0, st.size)?;
                let end = off as usize + data.len();
                if full.len() < end {
                    full.resize(end, 0);
                }
                full[off as usize..end].copy_from_slice(&data);
                Plan::Full(Cow::Owned(full), false)
            }
            Plan::Meta if !all_current => Plan::Full(
                Cow::Owned(self.read_range(ctx, name, st, 0, st.size)?),
                st.deleted,
            ),
            p => p,
        };
        let full_xattrs: Vec<(String, Option<Vec<u8>>)> = xattrs
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone())))
            .collect();
        let n = ctx.n();
        type Planned = (u64, bool, Vec<(WriteKind, u64)>, Vec<ShardBytes>, u64);
        let owned = |v: Vec<Vec<u8>>| v.into_iter().map(ShardBytes::owned).collect();
        let (new_size, deleted, kinds, shards, targets): Planned = match plan {
            Plan::Full(data, deleted) => {
                if let Some(SubOp::WriteFull(_)) = m.data {
                    self.counters
                        .write_bytes
                        .fetch_add(data.len() as u64, Relaxed);
                }
                if data.len() as u64 > ops::OBJECT_BYTES_MAX {
                    return Err(too_large(data.len() as u64));
                }
                // The client's bytes where they lie in its request: data shards are sent
                // as references to its stripe units, not gathered into new buffers.
                let shards = match &data {
                    Cow::Borrowed(d) => match request.slice_of(d) {
                        Some(units) => encode_full_units(ctx, &units, self.msgr().buf_pool()),
                        None => owned(encode_full(ctx, d)),
                    },
                    Cow::Owned(d) => owned(encode_full(ctx, d)),
                };
                self.count_encoded(data.len());
                (
                    data.len() as u64,
                    deleted,
                    vec![(WriteKind::Full, 0); n],
                    shards,
                    up_mask,
                )
            }
            Plan::Range(off, data) => {
                let end = off + data.len() as u64;
                if end > ops::OBJECT_BYTES_MAX {
                    return Err(too_large(end));
                }
                let new_size = st.size.max(end);
                let (kinds, shards) = match self.parity_delta(ctx, name, st, off, &data)? {
                    Some(d) => d,
                    None => {
                        let (s_off, shards) =
                            self.encode_range(ctx, name, st, off, &data, new_size)?;
                        (vec![(WriteKind::Range, s_off); n], shards)
                    }
                };
                (new_size, false, kinds, owned(shards), up_mask & st.current)
            }
            Plan::Meta => (
                st.size,
                st.deleted,
                vec![(WriteKind::Meta, 0); n],
                owned(vec![Vec::new(); n]),
                up_mask & st.current,
            ),
            Plan::Staged(size) => {
                if size > ops::OBJECT_BYTES_MAX {
                    return Err(too_large(size));
                }
                self.counters.write_bytes.fetch_add(size, Relaxed);
                // This node's own shard was staged here too: it is taken now; the others
                // are taken by the members when the write names them.
                let shards = (0..n)
                    .map(|s| {
                        let len = ctx.clip(s, size) as u32;
                        let r = StagedRef { upload, len };
                        if ctx.acting.members[s] == Some(self.id) {
                            let st = self.shard_staging.take(&r, s as u8, ctx.pool.id, ctx.pg)?;
                            Ok(ShardBytes::StagedHere {
                                data: st.data,
                                crcs: st.crcs,
                            })
                        } else {
                            Ok(ShardBytes::Staged(r))
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                (size, false, vec![(WriteKind::Full, 0); n], shards, up_mask)
            }
        };
        let kind = if kinds.iter().all(|k| k.0 == WriteKind::Full) {
            WriteKind::Full
        } else {
            WriteKind::Range
        };
        let meta = meta(new_size, deleted);
        let base = if kind == WriteKind::Full {
            BASE_ANY
        } else {
            st.version
        };
        let xattr_list = if kind == WriteKind::Full {
            full_xattrs
        } else {
            m.xattrs.clone()
        };
        let reqs = st.reqs.after(reqid, version);
        let acked = self.replicate(
            ctx,
            name,
            &kinds,
            base,
            meta,
            &xattr_list,
            &reqs,
            &shards,
            targets,
        );
        // The members came from the map at the op's start (`refresh_cache`): a node that
        // changed state since (marked up while this ran) may be missing from them.
        let same_map = c.node_change_epoch == self.monc.node_change_epoch();
        match &acked {
            Ok(a) if up_mask & !a == 0 && same_map => c.last_version = c.last_version.max(version),
            // Some up member (maybe this node) lags an object now: this node's shards no longer
            // prove absence, and the members' marks cannot advance, until a recovery pass
            // planned after this write — queued here: a pass that took the logs before it
            // landed does not know it.
            _ => {
                c.complete_at = None;
                c.skipped += 1;
                self.recovery
                    .retry
                    .lock()
                    .unwrap()
                    .insert((ctx.pool.id, ctx.pg));
            }
        }
        let acked = acked?;
        if matches!(m.data, Some(SubOp::WriteStaged { .. })) {
            self.counters.writes_client_encoded.fetch_add(1, Relaxed);
        }
        // The slots that replaced existing bytes keep them for a rollback that will not
        // come now: have them dropped — whole shards replaced (an overwrite, a remove), and
        // large ranges overwritten in place. A small range's record (and an append's, which
        // replaced next to nothing) is left to the object's next write: dropping it would
        // cost a block written per shard for a few KiB.
        let in_place = matches!(m.data, Some(SubOp::Write { offset, .. }) if offset < st.size);
        let replaced = (0..n)
            .filter(|&s| match kinds[s].0 {
                WriteKind::Full => true,
                WriteKind::Range => in_place && shards[s].len() >= SETTLE_RANGE_BYTES_MIN,
                WriteKind::Meta => false,
            })
            .fold(0u64, |a, s| a | bit(s))
            & acked;
        if st.exists() && replaced != 0 {
            let mut pending = c.to_settle.lock().unwrap();
            if pending.len() < SETTLE_PENDING_MAX {
                pending.push((name.to_vec(), version, replaced));
            }
        }
        if st.exists() && deleted {
            let mut pending = c.to_forget.lock().unwrap();
            if pending.len() < FORGET_PENDING_MAX {
                pending.push_back(Forget {
                    name: name.to_vec(),
                    version,
                    at: Instant::now(),
                    done: 0,
                });
            }
        }
        let new = ObjState {
            version,
            size: new_size,
            mtime_unix_ns: meta.mtime_unix_ns,
            deleted,
            current: acked,
            xattrs: if deleted { BTreeMap::new() } else { xattrs },
            reqs,
            rollbacks: 0,
        };
        remember(c, name, &new);
        Ok(version)
    }

    /// A small overwrite inside the object through parity deltas: read the old bytes of the
    /// touched data-shard ranges and of the parity over their union, apply
    /// `Codec::parity_delta`, write just those ranges (untouched data shards only take the new
    /// version). `None` when a read-modify-write of the stripes reads less (ec's
    /// `update_method`), the write grows the object, or a needed shard is not up.
    #[allow(clippy::type_complexity)]
    fn parity_delta(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        off: u64,
        data: &[u8],
    ) -> Result<Option<(Vec<(WriteKind, u64)>, Vec<Vec<u8>>)>> {
        let (k, n) = (ctx.k(), ctx.n());
        if data.is_empty() || off + data.len() as u64 > st.size {
            return Ok(None);
        }
        let mut ranges: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
        for e in ctx.profile.extents(off, data.len() as u64) {
            let r = ranges.entry(e.shard).or_insert((u64::MAX, 0));
            r.0 = r.0.min(e.shard_offset);
            r.1 = r.1.max(e.shard_offset + e.len as u64);
        }
        if ctx.profile.update_method(ranges.len()) != ec::UpdateMethod::ParityDelta {
            return Ok(None);
        }
        let plo = ranges.values().map(|r| r.0).min().expect("a touched shard");
        let phi = ranges.values().map(|r| r.1).max().expect("a touched shard");
        let mut want: Vec<(usize, u64, u64)> = ranges
            .iter()
            .map(|(j, (lo, hi))| (*j, *lo, hi - lo))
            .collect();
        want.extend((k..n).map(|p| (p, plo, phi - plo)));
        if want
            .iter()
            .any(|w| st.current & bit(w.0) == 0 || ctx.up(w.0).is_none())
        {
            return Ok(None);
        }
        // A shard that cannot be read (corrupt, gone) leaves it to the read-modify-write,
        // which reads around it.
        let old: HashMap<usize, Vec<u8>> = match self.fetch(ctx, name, st, &want) {
            Err(Error::FetchFailed(..)) => return Ok(None),
            r => r?,
        }
        .into_iter()
        .map(|(s, f)| (s, f.padded()))
        .collect();
        let mut new: BTreeMap<usize, Vec<u8>> = ranges
            .iter()
            .map(|(j, (lo, hi))| (*j, vec![0u8; (hi - lo) as usize]))
            .collect();
        let mut covered = vec![0u64; k];
        for e in ctx.profile.extents(off, data.len() as u64) {
            let at = (e.shard_offset - ranges[&e.shard].0) as usize;
            let from = (e.object_offset - off) as usize;
            new.get_mut(&e.shard).expect("touched")[at..at + e.len]
                .copy_from_slice(&data[from..from + e.len]);
            covered[e.shard] += e.len as u64;
        }
        for (j, (lo, hi)) in &ranges {
            assert_eq!(
                covered[*j],
                hi - lo,
                "a shard's touched range is contiguous"
            );
        }
        let mut parity: Vec<Vec<u8>> = (k..n).map(|p| old[&p].clone()).collect();
        for (j, (lo, hi)) in &ranges {
            let (a, b) = ((lo - plo) as usize, (hi - plo) as usize);
            let mut slices: Vec<&mut [u8]> = parity.iter_mut().map(|v| &mut v[a..b]).collect();
            ctx.codec.parity_delta(*j, &old[j], &new[j], &mut slices);
        }
        self.perf
            .ec
            .delta_bytes
            .fetch_add(data.len() as u64, Relaxed);
        tracing::debug!(
            "parity delta: {} at {off}+{}: data shards {:?}, parity [{plo}, {phi})",
            String::from_utf8_lossy(name),
            data.len(),
            ranges.keys().collect::<Vec<_>>()
        );
        let mut kinds = vec![(WriteKind::Meta, 0); n];
        let mut shards = vec![Vec::new(); n];
        for (j, (lo, _)) in &ranges {
            kinds[*j] = (WriteKind::Range, *lo);
            shards[*j] = new.remove(j).expect("built");
        }
        for (i, p) in (k..n).zip(parity) {
            kinds[i] = (WriteKind::Range, plo);
            shards[i] = p;
        }
        Ok(Some((kinds, shards)))
    }

    /// Re-encode the stripes an overwrite touches; returns the shard offset and each slot's
    /// bytes from there (clipped to its meaningful length under the new size).
    fn encode_range(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &ObjState,
        off: u64,
        data: &[u8],
        new_size: u64,
    ) -> Result<(u64, Vec<Vec<u8>>)> {
        let w = ctx.profile.stripe_width();
        let u = ctx.profile.stripe_unit() as u64;
        let lo = off.min(st.size);
        let s0 = lo / w;
        let s1 = (off + data.len() as u64).div_ceil(w).max(s0 + 1);
        let base = s0 * w;
        let mut buf = vec![0u8; ((s1 - s0) * w) as usize];
        let old_end = (s1 * w).min(st.size);
        if old_end > base {
            let old = self.read_range(ctx, name, st, base, old_end - base)?;
            buf[..old.len()].copy_from_slice(&old);
        }
        let at = (off - base) as usize;
        buf[at..at + data.len()].copy_from_slice(data);
        let stripes = buf.len() / ctx.profile.stripe_width() as usize;
        let mut shards = stripes_to_shards(ctx, &buf, stripes);
        self.count_encoded(buf.len());
        let s_off = s0 * u;
        for (slot, v) in shards.iter_mut().enumerate() {
            let keep = ctx
                .clip(slot, new_size)
                .saturating_sub(s_off)
                .min(v.len() as u64);
            v.truncate(keep as usize);
        }
        Ok((s_off, shards))
    }

    /// Send the shard writes; wait until every up target is durable and at least min_size
    /// are, or the bounded wait ends. Returns the slots now current.
    #[allow(clippy::too_many_arguments)]
    fn replicate(
        &self,
        ctx: &Ctx,
        name: &[u8],
        kinds: &[(WriteKind, u64)],
        base: u64,
        meta: ShardMeta,
        xattrs: &[(String, Option<Vec<u8>>)],
        reqs: &ReqHistory,
        shards: &[ShardBytes],
        targets: u64,
    ) -> Result<u64> {
        let full = kinds.iter().all(|k| k.0 == WriteKind::Full);
        // This node's store takes a data shard it holds as the units it is made of, in place
        // (`ShardData::Parts`), without joining them.
        let own_parts: Vec<Vec<&[u8]>> = shards
            .iter()
            .enumerate()
            .map(|(s, b)| match b {
                ShardBytes::Units { units, .. } if ctx.acting.members[s] == Some(self.id) => {
                    units.iter().map(|u| &u[..]).collect()
                }
                _ => Vec::new(),
            })
            .collect();
        // Each piece of a whole shard summed once: the sums make the frame CRC of its message
        // (combined, not summed again), travel after the data as its chunk CRC list, and are
        // what the member's store — or this node's, for its own shard — records for the
        // chunks (a stripe unit is a store chunk with the default profile and store).
        let piece_crcs: Vec<Vec<(u32, u32)>> = shards
            .iter()
            .map(|b| match b {
                ShardBytes::Units { units, .. } if full => units
                    .iter()
                    .map(|u| (u.len() as u32, messenger::checksum::crc32c(u)))
                    .collect(),
                ShardBytes::StagedHere { crcs, .. } => crcs.clone(),
                _ => Vec::new(),
            })
            .collect();
        // Shards the client staged on the members go out as references to them.
        let staged = shards.iter().any(|b| matches!(b, ShardBytes::Staged(_)));
        let bytes_of = |s: usize| -> ShardData<'_> {
            match &shards[s] {
                ShardBytes::Owned(v) => ShardData::Flat(v),
                // This node's own units; for another member's, nothing: they are sent as
                // parts (the header gets the length from `ShardBytes::len`).
                ShardBytes::Units { .. } => ShardData::Parts(&own_parts[s]),
                ShardBytes::StagedHere { data, .. } => ShardData::Flat(data),
                // At the member: the message names it.
                ShardBytes::Staged(_) => ShardData::Flat(&[]),
            }
        };
        let deadline = Instant::now() + Duration::from_millis(self.cfg.write_wait_ms);
        let min_size = ctx.pool.min_size as usize;
        let mut acked = 0u64;
        let mut failed = 0u64; // tried recently and failed
        let mut failed_at = Instant::now();
        let mut attempted_epoch = 0u64;
        let mut last_err = String::new();
        // The last failure was a member's full store (a remove waits it out: see below).
        let mut no_space = false;
        let mut ctx_map = ctx.map.clone();
        let mut first_send = true;
        // Counts this write in `writes_held` until it returns, once injection held it.
        let mut _held: Option<HeldWrite> = None;
        loop {
            let map = self.monc.map();
            // A failed member is tried again when the map changes or after a pause (a
            // connection that dropped comes back; a dead node gets marked down).
            if map.epoch != attempted_epoch || failed_at.elapsed() >= RETRY_PAUSE {
                failed = 0;
                attempted_epoch = map.epoch;
                ctx_map = map.clone();
            }
            if map.epoch != ctx.map.epoch {
                if let Some(p) = map.pools.get(&ctx.pool.id) {
                    let now = self.monc.acting(&map, p, ctx.pg);
                    if now.primary != Some(self.id) || now.members != ctx.acting.members {
                        // Not ours to finish: the new primary settles the object (it rolls an
                        // incomplete write back or keeps it) and the client retries there.
                        return Err(Error::remote(
                            Status::WrongPrimary,
                            format!(
                                "pg {}.{:x} changed hands at epoch {} during the write",
                                ctx.pool.id, ctx.pg, map.epoch
                            ),
                        ));
                    }
                }
            }
            let up = |s: usize| ctx.acting.members[s].is_some_and(|n| ctx_map.is_up(n));
            let todo: Vec<usize> = (0..ctx.n())
                .filter(|s| targets & bit(*s) != 0 || (full && up(*s)))
                .filter(|s| up(*s) && acked & bit(*s) == 0 && failed & bit(*s) == 0)
                .collect();
            if !todo.is_empty() {
                if std::mem::take(&mut first_send) {
                    // Fault injection: the members are chosen, the shards not yet sent.
                    let delay = self.inject_write_delay_ms.load(Relaxed);
                    if delay > 0 {
                        self.counters.writes_delayed.fetch_add(1, Relaxed);
                        self.counters.writes_held.fetch_add(1, Relaxed);
                        _held = Some(HeldWrite(&self.counters.writes_held));
                        std::thread::sleep(Duration::from_millis(delay));
                    }
                }
                let sub = Ctx {
                    map: ctx_map.clone(),
                    pool: ctx.pool.clone(),
                    pg: ctx.pg,
                    acting: ctx.acting.clone(),
                    profile: ctx.profile,
                    codec: ctx.codec.clone(),
                };
                let write = |s: usize| ShardWrite {
                    pool: ctx.pool.id,
                    pg: ctx.pg,
                    name,
                    shard: s as u8,
                    kind: kinds[s].0,
                    base_version: base,
                    meta,
                    offset: kinds[s].1,
                    xattrs: xattrs.to_vec(),
                    reqs: reqs.clone(),
                    data: bytes_of(s),
                    chunk_crcs: piece_crcs[s].clone(),
                    listed_crcs: Vec::new(),
                };
                let reqs = todo
                    .iter()
                    .map(|&s| {
                        if let ShardBytes::Staged(r) = &shards[s] {
                            return (
                                s,
                                vec![SendBuf::Vec(write(s).encode_staged(ctx_map.epoch, r))],
                            );
                        }
                        let head = write(s).encode_header_len(ctx_map.epoch, shards[s].len());
                        let mut parts = vec![SendBuf::Vec(head)];
                        shards[s].push_parts_with_crcs(&piece_crcs[s], &mut parts);
                        (s, parts)
                    })
                    .collect();
                // Only after `start` (below) declined; checked again, as the admission
                // `start` took ended when it declined.
                let local = |s: usize, _parts: Vec<SendBuf>| -> Result<Payload> {
                    let _admitted = self.check_own_op(ctx_map.epoch, ctx.pool.id, ctx.pg)?;
                    self.local.apply(&write(s))?;
                    Ok(Payload::from_vec(Vec::new()))
                };
                // A small create of this node's shard commits while the remote ones travel;
                // its durability is one more reply to wait for, not a sleep of its own.
                // First this node's check of its own shard op (`check_own_op`); the op is
                // admitted until the shard is durable.
                let start = |s: usize, done: LocalDone| -> Result<bool> {
                    let admitted = self.check_own_op(ctx_map.epoch, ctx.pool.id, ctx.pg)?;
                    let op = optrack::current();
                    self.local.apply_async(
                        &write(s),
                        Box::new(move |r| {
                            drop(admitted);
                            if let Some(op) = &op {
                                op.event(Ev::CommitEnd, optrack::NO_SHARD);
                            }
                            done(match r {
                                Some(r) => r.map(|()| Payload::from_vec(Vec::new())),
                                None => Err(Error::remote(
                                    Status::Io,
                                    "the local shard write lost a race with the cleaner",
                                )),
                            })
                        }),
                    )
                };
                let msg_type = if staged {
                    wire::MSG_SHARD_WRITE_STAGED
                } else {
                    wire::MSG_SHARD_WRITE
                };
                let replies = self.fan_out_with(&sub, msg_type, reqs, &local, Some(&start));
                for (slot, r) in replies {
                    // The new primary settles the object.
                    match self.unless_superseded(r)? {
                        Ok(_) => acked |= bit(slot),
                        // The member does not have its shard (it restarted, or it took it in
                        // a try whose reply was lost): no later try can succeed; the client
                        // sends the data instead. The members that took theirs hold a
                        // version the next write or recovery settles, as after any failed
                        // write.
                        Err(e) if e.status() == Status::NotStaged => {
                            return Err(Error::remote(
                                Status::NotStaged,
                                format!("shard {slot}: {e}"),
                            ))
                        }
                        // A member's store is full of live data (with anything for its
                        // cleaner to reclaim it waits instead): no retry within the write's
                        // wait can succeed, and the client should hear "out of space", not
                        // a min_size wait that ends in "degraded". A remove is retried
                        // instead: the removes before it free space as their primaries settle
                        // them (each member keeps a removed shard's bytes until then).
                        Err(e) if e.status() == Status::NoSpace && !meta.deleted => {
                            return Err(Error::remote(
                                Status::NoSpace,
                                format!(
                                    "write of {:?}: shard {slot}: {}. The object holds either \
                                     its old or its new content",
                                    String::from_utf8_lossy(name),
                                    e.message()
                                ),
                            ))
                        }
                        Err(e) => {
                            no_space = e.status() == Status::NoSpace;
                            last_err = format!("shard {slot}: {e}");
                            failed |= bit(slot);
                            failed_at = Instant::now();
                        }
                    }
                }
            }
            let required = (0..ctx.n()).filter(|s| up(*s) && (targets & bit(*s) != 0 || full));
            let waiting = required.clone().filter(|s| acked & bit(*s) == 0).count();
            let n_acked = acked.count_ones() as usize;
            if waiting == 0 && n_acked >= min_size {
                return Ok(acked);
            }
            if Instant::now() >= deadline {
                let down: Vec<u32> = ctx
                    .acting
                    .members
                    .iter()
                    .flatten()
                    .copied()
                    .filter(|n| !ctx_map.is_up(*n))
                    .collect();
                let waited = if waiting > 0 {
                    format!(", {waiting} up member(s) did not confirm ({last_err})")
                } else {
                    String::new()
                };
                // A remove a full member kept refusing: say so.
                let status = if no_space && waiting > 0 {
                    Status::NoSpace
                } else {
                    Status::Degraded
                };
                return Err(Error::remote(
                    status,
                    format!(
                        "write of {:?} not acknowledged after {:.1} s: {n_acked} of {} shards \
                         durable, min_size is {min_size}; nodes down: {down:?}{waited}. The \
                         object holds either its old or its new content",
                        String::from_utf8_lossy(name),
                        self.cfg.write_wait_ms as f64 / 1000.0,
                        ctx.n()
                    ),
                ));
            }
            // Wait for the map to change (a failed member marked down, or one coming back).
            self.monc.wait_change(attempted_epoch, RETRY_PAUSE);
        }
    }
}

/// A write the `inject_write_delay_ms` fault injection held, counted in
/// `Counters::writes_held` until its `replicate` returns.
struct HeldWrite<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for HeldWrite<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// A shard range as read: the bytes the member returned (clipped to the shard's meaningful
/// length; a view of the reply, not a copy) and the logical length, zeros past the bytes.
/// The bytes of an object range ([`Node::read_range_as`]).
pub(super) enum RangeBytes {
    /// Copied into one buffer.
    Assembled(Vec<u8>),
    /// Where the members' replies left them: one extent per stripe unit, in object order.
    Extents(Vec<Extent>),
}

/// One stripe unit's bytes of a range, by reference into a member's reply.
pub(super) struct Extent {
    /// The shard's meaningful bytes of it.
    pub data: Payload,
    /// Zeros after them (past the end of the shard's data).
    pub zeros: usize,
    /// CRC-32C of `data`, from the member's chunk CRCs.
    pub crc: Option<u32>,
}

pub(super) struct Fetched {
    data: Payload,
    len: usize,
    /// (length, CRC-32C) of the member's chunks, tiling the bytes it sent (before `data` was
    /// clipped to the shard's size); empty when unknown.
    crcs: Vec<(u32, u32)>,
}

impl Fetched {
    fn from_vec(v: Vec<u8>) -> Fetched {
        let len = v.len();
        Fetched {
            data: Payload::from_vec(v),
            len,
            crcs: Vec::new(),
        }
    }

    /// The CRC-32C of bytes `[at, at + n)` as [`Fetched::append_to`] gives them, when the
    /// member's chunk CRCs cover exactly the meaningful part (whole chunks, none cut by `at`,
    /// the end or the clip); the zeros past the meaningful bytes combine in.
    fn crc_of(&self, at: usize, n: usize) -> Option<u32> {
        let have = self.data.len().clamp(at, at + n);
        if have == at {
            // No meaningful byte in the extent (a chunk that starts before `at` does not
            // matter then): it is all zeros.
            return Some(zeros_crc(n));
        }
        let mut crc = 0;
        let mut pos = 0usize;
        let mut to = at;
        for &(len, sum) in &self.crcs {
            let (lo, hi) = (pos, pos + len as usize);
            pos = hi;
            if hi <= at {
                continue;
            }
            if lo >= have {
                break;
            }
            if lo != to || hi > have {
                return None;
            }
            crc = crc32c_combine(crc, sum, len as usize);
            to = hi;
        }
        if to != have {
            return None;
        }
        Some(crc32c_combine(crc, zeros_crc(at + n - have), at + n - have))
    }

    /// Bytes `[at, at + n)` as [`Fetched::append_to`] gives them, by reference.
    fn extent(&self, at: usize, n: usize) -> Extent {
        debug_assert!(at + n <= self.len);
        let have = self.data.len().saturating_sub(at).min(n);
        Extent {
            data: self.data.slice(at.min(self.data.len()), have),
            zeros: n - have,
            crc: self.crc_of(at, have),
        }
    }

    /// Bytes `[at, at + out.len())` into `out`.
    fn copy_into(&self, at: usize, out: &mut [u8]) {
        debug_assert!(at + out.len() <= self.len);
        let have = self.data.len().saturating_sub(at).min(out.len());
        if have > 0 {
            out[..have].copy_from_slice(&self.data[at..at + have]);
        }
        out[have..].fill(0);
    }

    /// Bytes `[at, at + n)` appended to `out` (zeros past the shard's meaningful bytes).
    fn append_to(&self, at: usize, n: usize, out: &mut Vec<u8>) {
        debug_assert!(at + n <= self.len);
        let have = self.data.len().saturating_sub(at).min(n);
        if have > 0 {
            out.extend_from_slice(&self.data[at..at + have]);
        }
        out.resize(out.len() + n - have, 0);
    }

    pub(super) fn padded(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.copy_into(0, &mut v);
        v
    }
}

/// Called once with the outcome of this node's slot of a fan-out.
pub(super) type LocalDone = Box<dyn FnOnce(Result<Payload>) + Send>;
/// Starts this node's slot of a fan-out without blocking (see [`Node::fan_out_with`]).
pub(super) type StartLocal<'a> = dyn Fn(usize, LocalDone) -> Result<bool> + 'a;

/// The timeline event of a shard request's outcome.
fn sub_op_ev<T>(r: &Result<T>) -> Ev {
    if r.is_ok() {
        Ev::SubOpAcked
    } else {
        Ev::SubOpFailed
    }
}

pub(super) fn remember(c: &mut PgCache, name: &[u8], st: &ObjState) {
    if c.objs.len() >= CACHE_OBJECTS_MAX {
        c.objs.clear();
    }
    c.objs.insert(name.to_vec(), st.clone());
}

/// CRC-32C of `n` zero bytes.
fn zeros_crc(mut n: usize) -> u32 {
    static ZEROS: [u8; 4096] = [0; 4096];
    let mut crc = 0;
    while n > 0 {
        let k = n.min(ZEROS.len());
        crc = messenger::checksum::crc32c_append(crc, &ZEROS[..k]);
        n -= k;
    }
    crc
}

/// A shard read reply's chunk CRC list ([`wire::SHARD_READ_CHUNK_CRCS`]) after its `n` bytes:
/// empty when absent (an older member), or when it does not tile exactly the `n` bytes.
fn parse_chunk_crcs(d: &mut Dec, n: usize) -> Result<Vec<(u32, u32)>> {
    if d.remaining() == 0 {
        return Ok(Vec::new());
    }
    let mut v = d.crc_list("shard read reply")?;
    let total: u64 = v.iter().map(|&(len, _)| u64::from(len)).sum();
    if total != n as u64 {
        v.clear();
    }
    Ok(v)
}

fn parse_state(p: &[u8]) -> Result<ShardState> {
    let mut d = Dec::new(p);
    d.u64()?;
    d.u16()?;
    ShardState::decode(&mut d)
}

pub(super) fn not_found(name: &[u8]) -> Error {
    Error::remote(
        Status::NotFound,
        format!("no object {:?}", String::from_utf8_lossy(name)),
    )
}

fn too_large(n: u64) -> Error {
    Error::remote(
        Status::TooLarge,
        format!(
            "object would be {n} bytes; the maximum is {}",
            ops::OBJECT_BYTES_MAX
        ),
    )
}

/// Validate a request's sub-ops and split out its mutation.
pub(super) fn check_ops<'a>(op: &ClientOp<'a>) -> Result<Mutation<'a>> {
    let bad = |m: String| Error::remote(Status::Invalid, m);
    if op.ops.is_empty() {
        return Err(bad("request has no sub-ops".into()));
    }
    let mut m = Mutation {
        data: None,
        xattrs: Vec::new(),
    };
    for o in &op.ops {
        match o {
            SubOp::Read { offset, len } if offset.checked_add(*len).is_none() => {
                return Err(bad(format!("read at {offset} of {len} bytes overflows")))
            }
            SubOp::Write { offset, data } if offset + data.len() as u64 > ops::OBJECT_BYTES_MAX => {
                return Err(too_large(offset + data.len() as u64))
            }
            SubOp::WriteStaged { size, .. } if *size > ops::OBJECT_BYTES_MAX => {
                return Err(too_large(*size))
            }
            SubOp::SetXattr(n, v) => {
                if n.is_empty()
                    || n.len() > XATTR_NAME_BYTES_MAX
                    || v.len() > ops::XATTR_VALUE_BYTES_MAX
                {
                    return Err(bad(format!(
                        "xattr {n:?}: name 1..={XATTR_NAME_BYTES_MAX} bytes, value at most {} bytes",
                        ops::XATTR_VALUE_BYTES_MAX
                    )));
                }
                m.xattrs.push((n.to_string(), Some(v.to_vec())));
            }
            SubOp::RmXattr(n) => m.xattrs.push((n.to_string(), None)),
            o if o.is_data_mutation() => {
                if m.data.is_some() {
                    return Err(bad(
                        "at most one data mutation (write_full, write, append, remove) per request"
                            .into(),
                    ));
                }
                m.data = Some(o.clone());
            }
            _ => {}
        }
    }
    if matches!(m.data, Some(SubOp::Remove)) && !m.xattrs.is_empty() {
        return Err(bad("remove cannot be combined with xattr changes".into()));
    }
    Ok(m)
}

/// Shard-major layout of `stripes` stripes of object bytes taken from `buf` (zeros past its
/// end), parity computed: each slot's bytes for those stripes. A last stripe that `buf` fills
/// only partly is cut to what its first unit holds: the rest of every unit would be zeros,
/// and so would the parity there (RS is computed byte position by byte position). A 4 KiB
/// object encodes 8 × 4 KiB, not 8 whole 64 KiB units.
fn stripes_to_shards(ctx: &Ctx, buf: &[u8], stripes: usize) -> Vec<Vec<u8>> {
    let (k, u) = (ctx.k(), ctx.profile.stripe_unit());
    let w = k * u;
    let last = if stripes == 0 {
        0
    } else {
        buf.len().saturating_sub((stripes - 1) * w).clamp(1, u)
    };
    let len = stripes.saturating_sub(1) * u + last;
    // Filled by appending (no zeroing pass over what the copy overwrites next).
    let mut shards: Vec<Vec<u8>> = (0..ctx.n()).map(|_| Vec::with_capacity(len)).collect();
    for s in 0..stripes {
        let unit = if s + 1 == stripes { last } else { u };
        for (j, shard) in shards.iter_mut().enumerate().take(k) {
            let from = (s * w + j * u).min(buf.len());
            let to = (s * w + j * u + unit).min(buf.len());
            shard.extend_from_slice(&buf[from..to]);
            shard.resize(s * u + unit, 0);
        }
    }
    for parity in &mut shards[k..] {
        parity.resize(len, 0);
    }
    let (data, parity) = shards.split_at_mut(k);
    let d: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
    let mut p: Vec<&mut [u8]> = parity.iter_mut().map(|v| v.as_mut_slice()).collect();
    if stripes > 0 {
        ctx.codec.encode(&d, &mut p);
    }
    shards
}

/// Where a client op's data comes from.
#[derive(Clone, Copy)]
struct Source<'a> {
    /// The bytes of an upload's earlier pieces, which go in front of the op's data.
    staged: Option<&'a [u8]>,
    /// The request as received: data that lies in it is sent on by reference.
    request: &'a Payload,
    /// The request's id, when a resend of it is to be recognised.
    reqid: Option<ReqId>,
    /// The client and its `upload_id`: the shards a `WriteStaged` names.
    upload: ReqId,
}

/// A stripe unit sent with its CRC, which the frame's CRC combines instead of summing the
/// bytes again.
struct SummedUnit {
    unit: Payload,
    crc: u32,
}

// SAFETY: the bytes are a received payload (or a pool buffer frozen after the encode wrote
// it), which nothing writes while a view of it lives; this part holds one.
unsafe impl messenger::RawBytes for SummedUnit {
    fn raw(&self) -> (*const u8, usize) {
        (self.unit.as_ptr(), self.unit.len())
    }

    fn crc32c_append(&self, crc: u32) -> u32 {
        crc32c_combine(crc, self.crc, self.unit.len())
    }
}

/// One slot's bytes for a shard write.
#[derive(Clone)]
pub(super) enum ShardBytes {
    Owned(Arc<Vec<u8>>),
    /// A shard of a whole-object write in pieces (`len` bytes in all): a data shard's stripe
    /// units, in order, as they lie in the client's request, or a parity shard in one
    /// messenger pool buffer.
    Units {
        units: Vec<Payload>,
        len: usize,
    },
    /// This node's shard of a client-encoded write, as the client staged it here, with its
    /// checked chunk CRCs.
    StagedHere {
        data: Payload,
        crcs: Vec<(u32, u32)>,
    },
    /// Another member's shard of a client-encoded write, staged on that member.
    Staged(StagedRef),
}

impl ShardBytes {
    fn owned(v: Vec<u8>) -> ShardBytes {
        ShardBytes::Owned(Arc::new(v))
    }

    pub(super) fn len(&self) -> usize {
        match self {
            ShardBytes::Owned(v) => v.len(),
            ShardBytes::Units { len, .. } => *len,
            ShardBytes::StagedHere { data, .. } => data.len(),
            ShardBytes::Staged(r) => r.len as usize,
        }
    }

    /// [`ShardBytes::push_parts`] for a shard write with its pieces' sums (`crcs`, one per
    /// unit, or none): each unit goes out with its CRC, so the frame's CRC is combined from
    /// them instead of summed, and the list follows the data (docs/format.md, SHARD_WRITE).
    fn push_parts_with_crcs(&self, crcs: &[(u32, u32)], parts: &mut Vec<SendBuf>) {
        match self {
            ShardBytes::Units { units, .. } if crcs.len() == units.len() => {
                let mut list = Vec::with_capacity(4 + 8 * crcs.len());
                list.extend_from_slice(&(crcs.len() as u32).to_le_bytes());
                for (u, &(len, crc)) in units.iter().zip(crcs) {
                    parts.push(SendBuf::Raw(Box::new(SummedUnit {
                        unit: u.clone(),
                        crc,
                    })));
                    list.extend_from_slice(&len.to_le_bytes());
                    list.extend_from_slice(&crc.to_le_bytes());
                }
                parts.push(SendBuf::Vec(list));
            }
            _ => self.push_parts(parts),
        }
    }

    /// Append the bytes to a message as parts, without copying them.
    fn push_parts(&self, parts: &mut Vec<SendBuf>) {
        match self {
            ShardBytes::Owned(v) => parts.push(SendBuf::Shared(v.clone())),
            ShardBytes::Units { units, .. } => {
                parts.extend(units.iter().map(|u| SendBuf::Payload(u.clone())))
            }
            ShardBytes::StagedHere { data, .. } => parts.push(SendBuf::Payload(data.clone())),
            ShardBytes::Staged(_) => {}
        }
    }

    /// The bytes joined (tests compare them).
    #[cfg(test)]
    pub(super) fn to_vec(&self) -> Vec<u8> {
        match self {
            ShardBytes::Owned(v) => v.to_vec(),
            ShardBytes::Units { units, len } => {
                let mut out = Vec::with_capacity(*len);
                units.iter().for_each(|u| out.extend_from_slice(u));
                out
            }
            ShardBytes::StagedHere { data, .. } => data.to_vec(),
            ShardBytes::Staged(_) => Vec::new(),
        }
    }
}

/// [`encode_full`] of an object held in a received payload, without copying it: each data
/// shard is the list of its stripe units in `data` (shard j holds units j, j + k, j + 2k, …,
/// which never need padding once clipped), and parity is encoded stripe by stripe straight
/// from the payload. Only a short last stripe is copied, to zero-pad its units.
fn encode_full_units(ctx: &Ctx, data: &Payload, pool: &BufPool) -> Vec<ShardBytes> {
    let (k, n, u) = (ctx.k(), ctx.n(), ctx.profile.stripe_unit());
    let w = k * u;
    let size = data.len();
    if size == 0 {
        return encode_full(ctx, &[])
            .into_iter()
            .map(ShardBytes::owned)
            .collect();
    }
    let stripes = size.div_ceil(w);
    let mut shards: Vec<ShardBytes> = (0..k)
        .map(|j| {
            let units: Vec<Payload> = (0..stripes)
                .map(|s| s * w + j * u)
                .take_while(|&at| at < size)
                .map(|at| data.slice(at, u.min(size - at)))
                .collect();
            let len = units.iter().map(|p| p.len()).sum();
            ShardBytes::Units { units, len }
        })
        .collect();
    // Parity: whole stripes straight from the payload, then the short last one padded.
    let last = size - (stripes - 1) * w;
    let last_unit = last.clamp(1, u);
    let len = (stripes - 1) * u + last_unit;
    // Parity goes into messenger pool buffers (a recycled one is already faulted in and is
    // not zeroed: the encode writes every byte that is published).
    let mut parity: Vec<messenger::RecvBuf> = (0..n - k).map(|_| pool.take(len)).collect();
    let whole = if last == w { stripes } else { stripes - 1 };
    for s in 0..whole {
        let mut p: SmallVec<[&mut [u8]; 4]> = parity
            .iter_mut()
            .map(|v| &mut v.spare_mut()[s * u..(s + 1) * u])
            .collect();
        ctx.codec.encode_stripe(&data[s * w..(s + 1) * w], &mut p);
    }
    if whole < stripes {
        let stripe = crate::client_ec::padded_last_stripe(data, k, u, whole, last_unit);
        let mut p: SmallVec<[&mut [u8]; 4]> = parity
            .iter_mut()
            .map(|v| &mut v.spare_mut()[whole * u..len])
            .collect();
        ctx.codec.encode_stripe(&stripe, &mut p);
    }
    for (i, mut v) in parity.into_iter().enumerate() {
        v.advance(len);
        let clip = (ctx.clip(k + i, size as u64) as usize).min(len);
        // In stripe units, like a data shard: a unit is a store chunk (default profile).
        let units = (0..clip)
            .step_by(u)
            .map(|at| v.freeze(at, u.min(clip - at)))
            .collect();
        shards.push(ShardBytes::Units { units, len: clip });
    }
    debug_assert!(shards
        .iter()
        .enumerate()
        .all(|(slot, b)| b.len() as u64 == ctx.clip(slot, size as u64)));
    shards
}

/// Encode a whole object: every slot's shard, clipped to its meaningful bytes.
fn encode_full(ctx: &Ctx, data: &[u8]) -> Vec<Vec<u8>> {
    let w = ctx.profile.stripe_width() as usize;
    let mut shards = stripes_to_shards(ctx, data, data.len().div_ceil(w));
    for (slot, v) in shards.iter_mut().enumerate() {
        v.truncate(ctx.clip(slot, data.len() as u64) as usize);
    }
    shards
}

#[cfg(test)]
mod tests {
    use super::*;
    use messenger::checksum::crc32c;
    use proptest::prelude::*;

    fn req(id: u64) -> ReqId {
        ReqId {
            who: messenger::Identity::Client(7),
            id,
        }
    }

    /// A primary remembers every mutation of the last `keep`, however many (up to the cap),
    /// and at least the newest 256 whatever their age.
    #[test]
    fn applied_requests_are_kept_for_their_time_not_only_the_last_256() {
        let keep = Duration::from_secs(120);
        let t0 = Instant::now();
        let mut a = Applied::default();
        // 5 000 writes within a second: all recognised.
        for i in 0..5_000u64 {
            a.insert(req(i), i + 1, t0 + Duration::from_micros(i * 200), keep);
        }
        assert_eq!(a.order.len(), 5_000);
        assert_eq!(a.get(req(0)), Some(1));
        assert_eq!(a.get(req(4_999)), Some(5_000));
        // A resend recorded again keeps its first entry.
        a.insert(req(10), 11, t0 + Duration::from_secs(1), keep);
        assert_eq!(a.order.len(), 5_000);
        // Two minutes on: one more write forgets those older than `keep`, down to the newest
        // 256 (which stay whatever their age).
        let later = t0 + Duration::from_secs(125);
        a.insert(req(9_000), 9_001, later, keep);
        assert_eq!(a.order.len(), APPLIED_PER_PG_MIN);
        assert_eq!(a.get(req(0)), None);
        assert_eq!(a.get(req(4_999)), Some(5_000));
        assert_eq!(a.get(req(9_000)), Some(9_001));
        assert_eq!(a.get(req(5_000 - 256)), None);
        assert_eq!(a.get(req(5_000 - 255)), Some(5_000 - 254));
        assert_eq!(a.versions.len(), a.order.len());
        // The cap holds at any rate.
        for i in 0..(APPLIED_PER_PG_MAX as u64 + 100) {
            a.insert(req(100_000 + i), i, later, keep);
        }
        assert_eq!(a.order.len(), APPLIED_PER_PG_MAX);
        assert_eq!(a.versions.len(), APPLIED_PER_PG_MAX);
        assert_eq!(a.get(req(100_000 + 99)), None);
        assert_eq!(a.get(req(100_000 + 100)), Some(100));
    }

    /// A member's reply of `n` bytes in chunks of `chunk` (the last one short), as parsed,
    /// clipped to `clip` bytes of meaning, asked for `len`.
    fn fetched(n: usize, chunk: usize, clip: usize, len: usize) -> (Fetched, Vec<u8>) {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut list = Vec::new();
        list.extend_from_slice(&(n.div_ceil(chunk) as u32).to_le_bytes());
        for c in bytes.chunks(chunk) {
            list.extend_from_slice(&(c.len() as u32).to_le_bytes());
            list.extend_from_slice(&crc32c(c).to_le_bytes());
        }
        let crcs = parse_chunk_crcs(&mut Dec::new(&list), n).unwrap();
        assert_eq!(crcs.len(), n.div_ceil(chunk));
        let f = Fetched {
            data: Payload::from_vec(bytes[..n.min(clip)].to_vec()),
            len,
            crcs,
        };
        (f, bytes)
    }

    fn test_ctx(k: u32, m: u32, stripe_unit: u32) -> Ctx {
        let pool = PoolInfo {
            id: 1,
            name: "t".into(),
            k,
            m,
            stripe_unit,
            pg_num: 1,
            min_size: k + 1,
        };
        let profile = pool.profile();
        Ctx {
            map: Arc::new(ClusterMap::default()),
            acting: Acting {
                pool: 1,
                pg: 0,
                members: vec![None; (k + m) as usize],
                primary: None,
                up_count: 0,
                since: 0,
            },
            pool,
            pg: 0,
            codec: Arc::new(Codec::new(profile)),
            profile,
        }
    }

    proptest! {
        /// Client-side EC lays out and encodes a whole object exactly as the primary does
        /// (the members store the client's shards as the primary's), and each piece's CRC is
        /// the CRC of its bytes.
        #[test]
        fn the_clients_encode_matches_the_primarys(
            profile in prop_oneof![Just((6u32, 2u32, 4096u32)), Just((4, 2, 8192)), Just((2, 1, 4096))],
            size in prop_oneof![1usize..100_000, (1usize..8).prop_map(|s| s * 6 * 4096)],
            seed in any::<u64>(),
        ) {
            let ctx = test_ctx(profile.0, profile.1, profile.2);
            let mut x = seed | 1;
            let bytes: Vec<u8> = (0..size).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect();
            let want = encode_full(&ctx, &bytes);
            let got = crate::client_ec::encode_object(&ctx.profile, &ctx.codec, &bytes.clone().into());
            prop_assert_eq!(got.len(), want.len());
            for (slot, (g, w)) in got.iter().zip(&want).enumerate() {
                let joined: Vec<u8> = g.iter().flat_map(|u| u.bytes().to_vec()).collect();
                prop_assert!(&joined == w, "slot {} bytes", slot);
                for u in g {
                    prop_assert!(u.len() <= ctx.profile.stripe_unit() && !u.is_empty());
                    prop_assert_eq!(u.crc, messenger::checksum::crc32c(u.bytes()));
                }
            }
        }

        /// Shards sent as references to the request's stripe units are the bytes the
        /// gathering encoder makes: every slot, every size (whole, short and one-byte last
        /// stripes), several profiles; parity in recycled pool buffers full of old bytes.
        #[test]
        fn shards_from_units_match_the_gathered_encode(
            profile in prop_oneof![Just((6u32, 2u32, 4096u32)), Just((4, 2, 8192)), Just((2, 1, 4096))],
            size in prop_oneof![0usize..100_000, (1usize..8).prop_map(|s| s * 6 * 4096)],
            seed in any::<u64>(),
        ) {
            let ctx = test_ctx(profile.0, profile.1, profile.2);
            let mut x = seed | 1;
            let bytes: Vec<u8> = (0..size).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect();
            let want = encode_full(&ctx, &bytes);
            // In the middle of a bigger payload, as a sub-op's data lies in a request.
            let mut req = vec![7u8; 13];
            req.extend_from_slice(&bytes);
            req.extend_from_slice(&[9u8; 5]);
            let req = Payload::from_vec(req);
            // Parity buffers come back from the pool holding whatever their last user wrote.
            let pool = BufPool::new();
            let dirty: Vec<_> = [1usize, 1 << 16, 1 << 17, 1 << 18].iter().flat_map(|&l| [l, l]).map(|l| {
                let mut b = pool.take(l);
                b.spare_mut().fill(0xEE);
                b
            }).collect();
            drop(dirty);
            let got = encode_full_units(&ctx, &req.slice(13, size), &pool);
            prop_assert_eq!(got.len(), want.len());
            for (slot, (g, w)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.len(), w.len(), "slot {} length", slot);
                prop_assert!(&g.to_vec() == w, "slot {} bytes", slot);
                let mut parts = Vec::new();
                g.push_parts(&mut parts);
                prop_assert!(&SendBuf::concat(&parts) == w, "slot {} parts", slot);
            }
        }

        /// Whatever extent the primary asks about, a CRC it is given is that of exactly the
        /// bytes `append_to` produces (zero padding included); extents of whole chunks get one.
        #[test]
        fn an_extent_crc_is_the_crc_of_its_bytes(
            chunks in 1usize..6, tail in 1usize..=256, clip in 0usize..2000,
            // Mostly on chunk boundaries, where the CRC is known.
            at in prop_oneof![(0usize..7).prop_map(|c| c * 256), 0usize..1800],
            end in prop_oneof![(0usize..7).prop_map(|c| c * 256), 0usize..1800],
        ) {
            let chunk = 256;
            let total = (chunks - 1) * chunk + tail;
            let len = total + 500;
            let (f, _) = fetched(total, chunk, clip, len);
            let (at, end) = (at.min(end).min(len), end.max(at).min(len));
            let n = end - at;
            let mut out = Vec::new();
            f.append_to(at, n, &mut out);
            if let Some(crc) = f.crc_of(at, n) {
                prop_assert_eq!(crc, crc32c(&out), "at {} n {}", at, n);
            }
            let have = total.min(clip);
            let cut = |x: usize| x < have && !x.is_multiple_of(chunk);
            if !cut(at) && !cut(at + n) && (have == total || have.is_multiple_of(chunk)) {
                prop_assert!(f.crc_of(at, n).is_some(), "at {} n {}: whole chunks", at, n);
            }
        }
    }

    #[test]
    fn a_chunk_crc_list_that_does_not_tile_the_bytes_is_ignored() {
        let mut list = 2u32.to_le_bytes().to_vec();
        for _ in 0..2 {
            list.extend_from_slice(&100u32.to_le_bytes());
            list.extend_from_slice(&0u32.to_le_bytes());
        }
        assert_eq!(
            parse_chunk_crcs(&mut Dec::new(&list), 200).unwrap().len(),
            2
        );
        assert!(parse_chunk_crcs(&mut Dec::new(&list), 201)
            .unwrap()
            .is_empty());
        assert!(parse_chunk_crcs(&mut Dec::new(&[]), 200)
            .unwrap()
            .is_empty());
        assert!(parse_chunk_crcs(&mut Dec::new(&list[..12]), 200).is_err());
    }
}
