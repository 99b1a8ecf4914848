//! A storage node: its stores, the shard service it gives primaries, and the client ops it
//! runs for the PGs it leads (`primary`).
//!
//! Threads: the messenger's workers hand each message to a queue right on the worker (cheap,
//! and in arrival order); `node-op-N` threads run client ops, one PG at a time per thread, in
//! each PG's arrival order; `node-shard-N` threads apply shard ops against the local stores
//! (they block on group commit, so there are several); `node-heartbeat` reports to the
//! monitors; `node-scrub` runs the background scrub (`scrub.rs`); `node-recovery` plans
//! recovery, `node-rebuild-N` rebuild objects and `node-rshard-N` serve recovery messages at
//! low priority (`recovery`).

pub mod hot;
pub mod identity;
pub mod interval;
pub mod local;
pub mod peerping;
pub mod perf;
pub mod primary;
pub mod recovery;
pub mod repair;
pub mod salvage;
pub mod scrub;
pub mod staging;
pub mod strays;

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::queue::WaitQueue;
use driver::{BlockDevice, FileDevice, FileOptions};
use messenger::{
    Connection, Dispatcher, Identity, Incoming, Messenger, OutMessage, Secret, SendBuf,
};
use store::{MkfsOptions, Store, StoreConfig, Uuid};
use tracing::{info, warn};

use crate::config::NodeConfig;
use crate::error::{Error, Result};
use crate::map::NodeInfo;
use crate::monclient::MonClient;
use crate::monitor::raft::MonCommand;
use crate::monitor::NodeStats;
use crate::optrack::{CurrentGuard, Ev, OpDesc, TrackedOp, NO_SHARD};
use crate::wire::{self, Dec, Enc, Status};
use interval::{Admission, Admitted};
use local::{Local, ShardWrite};
use primary::PgCache;

/// Threads applying shard ops.
const SHARD_THREADS: usize = 12;
/// A staged upload not finished within this long is dropped.
const STAGING_TTL: Duration = Duration::from_secs(120);
/// Bytes one client may have staged at once.
const STAGING_BYTES_MAX: usize = 256 << 20;
/// How long a message from a newer epoch waits for the node's map to catch up.
pub const EPOCH_WAIT: Duration = Duration::from_secs(5);

/// `Node::boot_epoch` before the monitor has answered the node's Boot.
const BOOTING: u64 = u64::MAX;

/// What a shard op does about the node's boot epoch.
#[derive(Debug, PartialEq, Eq)]
enum BootGate {
    /// The local map has reached the boot epoch: the usual map and interval checks decide.
    Pass,
    /// The map lags the boot epoch: wait for it (the monitor this node subscribed to may be a
    /// follower that applies the log late).
    Wait,
    /// Not registered yet.
    Refuse,
}

/// Shard ops wait until the node's map has reached the epoch its Boot was committed at. A
/// restarted node has lost its in-memory intervals (which primary superseded which); with a
/// map from before its Boot, from a lagging monitor, a PG's old primary could still pass the
/// map check and write what the new primary never hears of. From the boot epoch on the map
/// names the PG's current primary, and the map check refuses the old one.
fn boot_gate(boot_epoch: u64, map_epoch: u64) -> BootGate {
    if boot_epoch == BOOTING {
        BootGate::Refuse
    } else if map_epoch >= boot_epoch {
        BootGate::Pass
    } else {
        BootGate::Wait
    }
}

#[derive(Default)]
pub struct Counters {
    pub read_ops: AtomicU64,
    pub write_ops: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// Object states resolved by a stat round to the PG's members.
    pub resolves_asked: AtomicU64,
    /// Object states known absent without one (`PgCache::complete_at`).
    pub resolves_absent_local: AtomicU64,
    /// Shard and recovery ops refused because a newer map or a newer primary's ops name
    /// another primary of the PG (this node's own ops on its own shard included).
    pub stale_primary_refused: AtomicU64,
    /// Client ops refused because they were sent before their PG's current interval.
    pub stale_ops_refused: AtomicU64,
    /// Resent client mutations answered with the version they made the first time.
    pub resends_answered: AtomicU64,
    /// Shard ops refused because the node had not registered yet, or its map had not reached
    /// its boot epoch within `EPOCH_WAIT`.
    pub boot_gate_refused: AtomicU64,
    /// Shard writes whose chunk CRC list combined to the verified payload CRC (the store
    /// recorded those instead of summing), and those whose list did not (summed instead).
    pub shard_crcs_vouched: AtomicU64,
    pub shard_crcs_dropped: AtomicU64,
    /// Whole-object writes whose shards the client encoded and staged (client-side EC).
    pub writes_client_encoded: AtomicU64,
    /// Client writes held by the `inject_write_delay_ms` runtime setting, and those of them
    /// still sending their shards (the hold over or not).
    pub writes_delayed: AtomicU64,
    pub writes_held: AtomicU64,
    /// Shard writes held by the `inject_shard_apply_delay_ms` runtime setting.
    pub shard_writes_delayed: AtomicU64,
}

/// A client op waiting on its PG: the message and its tracking.
pub type Job = (Incoming, Arc<TrackedOp>);

struct PgSlot {
    queue: VecDeque<Job>,
    running: bool,
    cache: Arc<Mutex<PgCache>>,
    /// The cache's `to_settle` and `to_forget`, reachable without waiting for a running op.
    to_settle: primary::ToSettle,
    to_forget: primary::ToForget,
}

impl PgSlot {
    pub(super) fn new() -> PgSlot {
        let cache = PgCache::default();
        PgSlot {
            queue: VecDeque::new(),
            running: false,
            to_settle: cache.to_settle.clone(),
            to_forget: cache.to_forget.clone(),
            cache: Arc::new(Mutex::new(cache)),
        }
    }
}

struct Staged {
    data: Vec<u8>,
    at: Instant,
}

pub struct Node {
    pub id: u32,
    pub cfg: NodeConfig,
    pub local: Arc<Local>,
    pub monc: Arc<MonClient>,
    msgr: OnceLock<Arc<Messenger>>,
    pub(crate) peers: crate::peers::PeerConns,
    pgs: Mutex<HashMap<(u64, u32), PgSlot>>,
    /// Per PG: the newest (epoch, primary) that sent this node a shard or recovery op (a
    /// primary of an older epoch is refused from then on, even before this node has the map
    /// that replaced it; see `check_shard_sender`), and the ops admitted under it.
    pub intervals: Arc<interval::Intervals>,
    /// The map epoch this node's Boot was committed at; [`BOOTING`] until the monitor has
    /// answered. Shard ops wait for the local map to reach it (see [`boot_gate`]).
    boot_epoch: AtomicU64,
    run_q: Arc<WaitQueue<(u64, u32)>>,
    shard_q: Arc<WaitQueue<(Incoming, Arc<TrackedOp>)>>,
    staging: Mutex<HashMap<(Identity, u64), Staged>>,
    /// Shards clients encoded and staged here for whole-object writes (client-side EC).
    pub shard_staging: staging::Staging,
    codecs: Mutex<HashMap<ec::Profile, Arc<ec::Codec>>>,
    pub counters: Counters,
    /// Op tracking, slow ops, counters of every subsystem (`perf dump`, metrics).
    pub perf: perf::Perf,
    pub scrub: scrub::Scrub,
    /// Read coalescing, the hot-object cache and detector.
    pub hot: hot::Hot,
    /// Recovery messages, served after client shard ops.
    recovery_q: Arc<WaitQueue<Incoming>>,
    pub recovery: recovery::Recovery,
    /// Pings to the other nodes, for the heartbeat's failure reports.
    pub peer_ping: peerping::PeerPing,
    /// Keys of PGs this node is no longer a member of.
    pub strays: strays::Strays,
    /// Fault injection (runtime setting `inject_write_delay_ms`, 0 = off): each client
    /// write led here waits this long between choosing the members its shards go to (by the
    /// map of that moment) and sending them, as if the network to every member were that
    /// slow. For tests of what happens while a write is in flight.
    pub(crate) inject_write_delay_ms: AtomicU64,
    /// Fault injection (runtime setting `inject_shard_apply_delay_ms`, 0 = off): each shard
    /// write a primary sends here waits this long between passing the interval check and
    /// being applied, as if the device were that slow. For tests of a primary change while a
    /// member is applying the old primary's write.
    pub(crate) inject_shard_apply_delay_ms: AtomicU64,
    /// Fault injection (runtime setting `inject_drop_staged`): the node acknowledges the
    /// shards clients stage on it and drops them, as if it had restarted in between (no
    /// marker is kept, so a write naming one waits `STAGED_SHARD_WAIT` for it, then fails
    /// with `NotStaged`; the client then sends the data to the primary).
    pub(crate) inject_drop_staged: AtomicBool,
}

struct NodeDispatcher {
    node: OnceLock<Arc<Node>>,
    monc: OnceLock<Arc<MonClient>>,
}

impl Dispatcher for NodeDispatcher {
    fn runs_inline(&self, t: u16) -> bool {
        matches!(
            t,
            wire::MSG_CLIENT_OP
                | wire::MSG_PEER_PING
                | wire::MSG_SHARD_WRITE
                | wire::MSG_SHARD_WRITE_STAGED
                | wire::MSG_SHARD_READ
                | wire::MSG_SHARD_STAT
                | wire::MSG_SHARD_ROLLBACK
                | wire::MSG_SHARD_DROP
                | wire::MSG_SHARD_LIST
                | wire::MSG_PG_LOG
                | wire::MSG_PG_MARK
                | wire::MSG_RECOVERY_READ
                | wire::MSG_RECOVERY_WRITE
                | wire::MSG_SHARD_SETTLE
                | wire::MSG_SHARD_FORGET
                | wire::MSG_PG_CLEAN
                | wire::MSG_SHARD_REPAIR
        )
    }

    fn handle(&self, mut msg: Incoming) {
        if msg.msg_type() == wire::MSG_MON_MAP_PUSH {
            if let Some(m) = self.monc.get() {
                m.handle_push(msg.payload());
            }
            return;
        }
        let Some(node) = self.node.get() else {
            if msg.is_request() {
                let _ = msg.reply(OutMessage::new(
                    wire::MSG_REPLY,
                    wire::reply_err(0, Status::Io, "node is starting"),
                ));
            }
            return;
        };
        match msg.msg_type() {
            wire::MSG_CLIENT_OP => node.enqueue_op(msg),
            wire::MSG_PEER_PING => {
                let epoch = node.epoch();
                node.reply(&mut msg, Ok(wire::reply_ok(epoch, &[])));
            }
            wire::MSG_SHARD_WRITE => node.shard_write(msg),
            wire::MSG_SHARD_READ
            | wire::MSG_SHARD_STAT
            | wire::MSG_SHARD_ROLLBACK
            | wire::MSG_SHARD_DROP
            | wire::MSG_SHARD_REPAIR
            | wire::MSG_SHARD_WRITE_STAGED => node.enqueue_shard_op(msg),
            wire::MSG_SHARD_LIST
            | wire::MSG_PG_LOG
            | wire::MSG_PG_MARK
            | wire::MSG_RECOVERY_READ
            | wire::MSG_RECOVERY_WRITE
            | wire::MSG_SHARD_SETTLE
            | wire::MSG_SHARD_FORGET
            | wire::MSG_PG_CLEAN => node.enqueue_recovery(msg),
            t => {
                let r = match t {
                    wire::MSG_CLIENT_STAGE => node.stage(&msg),
                    wire::MSG_CLIENT_STAGE_SHARD => node
                        .shard_staging
                        .stage(&msg, !node.inject_drop_staged.load(Relaxed))
                        .map(|()| wire::reply_ok(node.epoch(), &[])),
                    wire::MSG_CLIENT_LIST => node.list(&msg),
                    wire::MSG_ADMIN_PERF_DUMP
                    | wire::MSG_ADMIN_PERF_RESET
                    | wire::MSG_ADMIN_SLOW_OPS
                    | wire::MSG_ADMIN_CONFIG => node.admin(&msg),
                    wire::MSG_NODE_SCRUB => node.scrub_control(&msg),
                    wire::MSG_NODE_LOCATE => node.locate(&msg),
                    _ => Err(Error::Malformed(format!("unknown message type {t}"))),
                };
                node.reply(&mut msg, r);
            }
        }
    }
}

impl Node {
    pub fn epoch(&self) -> u64 {
        self.monc.epoch()
    }

    fn msgr(&self) -> &Arc<Messenger> {
        self.msgr.get().expect("messenger started")
    }

    pub fn reply(&self, msg: &mut Incoming, r: Result<Vec<u8>>) {
        self.reply_parts(msg, r.map(|b| vec![SendBuf::Vec(b)]));
    }

    /// Reply with a payload made of several buffers (bulk data goes out without a copy).
    pub fn reply_parts(&self, msg: &mut Incoming, r: Result<Vec<SendBuf>>) {
        if !msg.is_request() {
            return;
        }
        let parts = match r {
            Ok(p) => p,
            Err(e) => vec![SendBuf::Vec(wire::reply_err(
                self.epoch(),
                e.status(),
                &e.message(),
            ))],
        };
        let _ = msg.reply(OutMessage {
            msg_type: wire::MSG_REPLY,
            parts,
        });
    }

    pub fn codec(&self, p: ec::Profile) -> Arc<ec::Codec> {
        self.codecs
            .lock()
            .unwrap()
            .entry(p)
            .or_insert_with(|| Arc::new(ec::Codec::new(p)))
            .clone()
    }

    /// A connection to another node (kept; the messenger reconnects it until the map marks
    /// the node down: [`crate::peers`]).
    pub fn peer(&self, id: u32) -> Result<Connection> {
        let map = self.monc.map();
        let addr = map
            .nodes
            .get(&id)
            .ok_or_else(|| Error::remote(Status::Unavailable, format!("no node {id} in the map")))?
            .addr;
        self.peers.get(self.msgr(), &self.monc, id, addr)
    }

    /// Put a client op on its PG's queue (on the messenger worker: cheap, in arrival order).
    fn enqueue_op(&self, mut msg: Incoming) {
        let (key, op) = {
            let mut d = Dec::new(msg.payload());
            match (d.u64(), d.u64(), d.bytes()) {
                (Ok(_), Ok(pool), Ok(name)) => {
                    let map = self.monc.map();
                    let pg = map
                        .pools
                        .get(&pool)
                        .map_or(0, |p| crate::placement::pg_of(p, name));
                    let desc = OpDesc::new("client_op", msg.peer(), pool, pg, name);
                    ((pool, pg), self.perf.ops.begin(desc, msg.throttled()))
                }
                _ => {
                    return self.reply(
                        &mut msg,
                        Err(Error::Malformed("client op header does not decode".into())),
                    )
                }
            }
        };
        let mut pgs = self.pgs.lock().unwrap();
        let slot = pgs.entry(key).or_insert_with(PgSlot::new);
        op.event(Ev::Queued, NO_SHARD);
        if slot.running || !slot.queue.is_empty() {
            slot.queue.push_back((msg, op));
            if !slot.running {
                slot.running = true;
                self.run_q.push(key);
            }
            return;
        }
        // The PG is idle: take its turn here, as an op thread would, and answer a read the
        // caches hold without handing it to an op thread and back (two thread wake-ups,
        // each of which can wait for a CPU when the node is busy). Ops of the PG that arrive
        // meanwhile queue behind it, so they see its effects in order.
        slot.running = true;
        let cache = slot.cache.clone();
        drop(pgs);
        let r = {
            let _current = CurrentGuard::set(&op);
            self.try_cached_read(&msg, &cache)
        };
        let answered = r.is_some();
        if let Some(r) = r {
            op.event(Ev::Started, NO_SHARD);
            self.finish_op(&mut msg, &op, r);
        }
        let mut pgs = self.pgs.lock().unwrap();
        let slot = pgs.get_mut(&key).expect("held PG has a slot");
        if !answered {
            // First in line: it arrived before anything queued meanwhile.
            slot.queue.push_front((msg, op));
            self.run_q.push(key);
        } else if slot.queue.is_empty() {
            slot.running = false;
        } else {
            self.run_q.push(key);
        }
    }

    fn op_thread(self: Arc<Self>) {
        while let Some(key) = self.run_q.pop() {
            loop {
                let (jobs, cache) = {
                    let mut pgs = self.pgs.lock().unwrap();
                    let slot = pgs.get_mut(&key).expect("queued PG has a slot");
                    match slot.queue.pop_front() {
                        Some(j) if self.hot.enabled() => {
                            (hot::take_batch(j, &mut slot.queue), slot.cache.clone())
                        }
                        Some(j) => (vec![j], slot.cache.clone()),
                        None => {
                            slot.running = false;
                            break;
                        }
                    }
                };
                self.run_jobs(jobs, &cache);
                // Still holding the PG: rewrite corrupt shards the ops' reads met.
                self.run_read_repairs(key);
            }
        }
    }

    /// Reply and stop tracking the op.
    pub(super) fn finish_op(
        &self,
        msg: &mut Incoming,
        op: &Arc<TrackedOp>,
        r: Result<Vec<SendBuf>>,
    ) {
        let status: std::borrow::Cow<'static, str> = match &r {
            Ok(_) => "ok".into(),
            Err(e) => e.message().into(),
        };
        self.reply_parts(msg, r);
        self.perf.ops.finish(op, &status);
        if msg.msg_type() == wire::MSG_CLIENT_OP {
            self.recovery.client_latency(op.age());
        }
    }

    /// Track a shard op and queue it for the shard threads (on the messenger worker).
    fn enqueue_shard_op(&self, msg: Incoming) {
        let op = self.track_shard_op(&msg);
        self.shard_q.push((msg, op));
    }

    fn track_shard_op(&self, msg: &Incoming) -> Arc<TrackedOp> {
        let kind = match msg.msg_type() {
            wire::MSG_SHARD_WRITE | wire::MSG_SHARD_WRITE_STAGED => "shard_write",
            wire::MSG_SHARD_READ => "shard_read",
            wire::MSG_SHARD_STAT => "shard_stat",
            wire::MSG_SHARD_REPAIR => "shard_repair",
            wire::MSG_SHARD_DROP => "shard_drop",
            _ => "shard_rollback",
        };
        let desc = {
            // Every shard op starts: epoch, pool, pg, name (shard_op checks it all again).
            let mut d = Dec::new(msg.payload());
            let _ = d.u64();
            match (d.u64(), d.u32(), d.bytes()) {
                (Ok(pool), Ok(pg), Ok(name)) => OpDesc::new(kind, msg.peer(), pool, pg, name),
                _ => OpDesc::new(kind, msg.peer(), 0, 0, b""),
            }
        };
        let op = self.perf.ops.begin(desc, msg.throttled());
        op.event(Ev::Queued, NO_SHARD);
        self.recovery.client_shard_queued.fetch_add(1, Relaxed);
        op
    }

    /// A shard write, on the messenger worker. One that creates its shard with a little data
    /// (most small-object writes) is applied right here, without blocking, and answered from
    /// the store's commit thread once durable: no hand-off to a shard thread and back. Any
    /// other, or one that would wait (for a newer map, for a device read), goes to the shard
    /// threads.
    fn shard_write(self: &Arc<Self>, msg: Incoming) {
        let op = self.track_shard_op(&msg);
        if let Some((msg, op)) = self.shard_write_async(msg, op) {
            self.shard_q.push((msg, op));
        }
    }

    /// The non-blocking path of [`Node::shard_write`]; gives the op back when it does not
    /// apply.
    fn shard_write_async(
        self: &Arc<Self>,
        mut msg: Incoming,
        op: Arc<TrackedOp>,
    ) -> Option<(Incoming, Arc<TrackedOp>)> {
        if !matches!(msg.peer(), Identity::Node(_)) {
            return Some((msg, op));
        }
        // A view of the payload (no copy), so that `msg` can move into the callback.
        let payload = msg.payload().clone();
        let mut d = Dec::new(&payload);
        let Ok(epoch) = d.u64() else {
            return Some((msg, op));
        };
        let Ok(w) = ShardWrite::decode(&mut d) else {
            return Some((msg, op));
        };
        if epoch > self.epoch()
            || self.inject_shard_apply_delay_ms.load(Relaxed) > 0
            || boot_gate(self.boot_epoch.load(Acquire), self.epoch()) != BootGate::Pass
            || w.kind != local::WriteKind::Full
            || w.data.len() > local::ASYNC_APPLY_BYTES_MAX
        {
            return Some((msg, op));
        }
        op.event(Ev::Started, NO_SHARD);
        let r = {
            let _current = CurrentGuard::set(&op);
            self.check_sender_or_decline(msg.peer(), epoch, w.pool, w.pg, false)
        };
        let admitted = match r {
            Ok(Some(a)) => a,
            // An earlier primary's ops are still in flight: wait for them on a shard thread.
            Ok(None) => return Some((msg, op)),
            Err(e) => {
                self.finish_shard_op(&mut msg, &op, Err(e));
                return None;
            }
        };
        // The callback owns the request from here; it comes back only if the call declines.
        let slot = Arc::new(Mutex::new(Some((msg, op.clone()))));
        let node = self.clone();
        let cb_slot = slot.clone();
        let done = Box::new(move |r: Option<Result<()>>| {
            // In flight until the shard is durable (or the write failed or is handed back).
            let _admitted = admitted;
            let Some((mut msg, op)) = cb_slot.lock().unwrap().take() else {
                return;
            };
            op.event(Ev::CommitEnd, NO_SHARD);
            match r {
                Some(r) => {
                    let r = r.map(|()| vec![SendBuf::Vec(wire::reply_ok(node.epoch(), &[]))]);
                    node.finish_shard_op(&mut msg, &op, r);
                }
                // Lost a race (the cleaner moved something it read): the blocking path
                // prepares it again.
                None => node.shard_q.push((msg, op)),
            }
        });
        let r = {
            let _current = CurrentGuard::set(&op);
            self.local.apply_async(&w, done)
        };
        match r {
            Ok(true) => None,
            Ok(false) => slot.lock().unwrap().take(),
            Err(e) => {
                let (mut msg, op) = slot.lock().unwrap().take()?;
                self.finish_shard_op(&mut msg, &op, Err(e));
                None
            }
        }
    }

    fn finish_shard_op(&self, msg: &mut Incoming, op: &Arc<TrackedOp>, r: Result<Vec<SendBuf>>) {
        self.finish_op(msg, op, r);
        self.recovery.client_shard_queued.fetch_sub(1, Relaxed);
    }

    fn shard_thread(self: Arc<Self>) {
        while let Some((mut msg, op)) = self.shard_q.pop() {
            op.event(Ev::Started, NO_SHARD);
            let r = {
                let _current = CurrentGuard::set(&op);
                self.shard_op(&msg)
            };
            self.finish_shard_op(&mut msg, &op, r);
        }
    }

    /// Check a shard op's epoch: wait for a newer map; refuse a sender that is no longer the
    /// PG's primary under ours, or that an op from a newer primary of the PG has superseded.
    ///
    /// The second rule closes the interval race: a new primary starts by asking every member
    /// for its PG log. A member that answers before it has the new map (the wait for it is
    /// bounded) would otherwise still take writes from the old primary afterwards, writes the
    /// new primary never heard of. Only nodes acting as a PG's primary send these ops, so the
    /// sender of the newest epoch seen is the PG's current primary as far as this node knows.
    fn check_shard_sender(
        &self,
        msg: &Incoming,
        epoch: u64,
        pool: u64,
        pg: u32,
    ) -> Result<Admitted> {
        self.await_boot_epoch()?;
        if epoch > self.epoch() {
            self.monc.wait_epoch(epoch, EPOCH_WAIT);
        }
        self.check_sender(msg.peer(), epoch, pool, pg)
    }

    /// What a member checks of a primary's shard or recovery op that changes its shards, its
    /// log or its marks — here made of this node's own such op as a primary (its own shard is
    /// written, dropped or rolled back in place, not sent): a primary that lost the PG while
    /// the op was under way (a newer map has another primary, or another primary of a newer
    /// epoch has sent this node ops of the PG) must not change its own shard either, or it
    /// could put an older version under the newer one there, behind the marks' back. Keep
    /// the [`Admitted`] until the change is applied.
    pub(super) fn check_own_op(&self, epoch: u64, pool: u64, pg: u32) -> Result<Admitted> {
        self.check_sender(Identity::Node(self.id), epoch, pool, pg)
    }

    /// [`Self::check_shard_sender`] after the boot gate, for `sender`'s op of `epoch`; waits
    /// (bounded) for ops admitted under an earlier primary of the PG to finish.
    fn check_sender(&self, sender: Identity, epoch: u64, pool: u64, pg: u32) -> Result<Admitted> {
        match self.check_sender_or_decline(sender, epoch, pool, pg, true)? {
            Some(a) => Ok(a),
            None => Err(Error::remote(Status::Internal, "interval check declined")),
        }
    }

    /// The map check, then [`interval::Intervals::admit`]: `None` (only without `wait`)
    /// when the op would have to wait for an earlier primary's ops.
    fn check_sender_or_decline(
        &self,
        sender: Identity,
        epoch: u64,
        pool: u64,
        pg: u32,
        wait: bool,
    ) -> Result<Option<Admitted>> {
        if epoch < self.epoch() {
            let map = self.monc.map();
            let Some(p) = map.pools.get(&pool) else {
                return Err(Error::remote(Status::NoSuchPool, format!("pool {pool}")));
            };
            let a = crate::placement::Acting::compute(&map, p, pg);
            if a.primary.map(Identity::Node) != Some(sender) {
                self.counters.stale_primary_refused.fetch_add(1, Relaxed);
                return Err(Error::remote(
                    Status::StaleEpoch,
                    format!(
                        "{sender} is not the primary of pg {pool}.{pg:x} at epoch {}",
                        map.epoch
                    ),
                ));
            }
        }
        // Only a sender that passed the map check is recorded as the PG's newest primary.
        match self.intervals.admit(sender, epoch, pool, pg, wait)? {
            Admission::Admitted(a) => Ok(Some(a)),
            Admission::WouldWait => Ok(None),
            Admission::Superseded { primary, since } => {
                self.counters.stale_primary_refused.fetch_add(1, Relaxed);
                Err(Error::remote(
                    Status::StaleEpoch,
                    format!(
                        "{sender} sent an op of epoch {epoch} for pg {pool}.{pg:x}, whose \
                         primary is {primary} since epoch {since}"
                    ),
                ))
            }
        }
    }

    /// Hold a shard op until this node's map has reached the epoch its Boot was committed at
    /// (bounded by [`EPOCH_WAIT`]); refuse it before the Boot is answered.
    fn await_boot_epoch(&self) -> Result<()> {
        let booted = self.boot_epoch.load(Acquire);
        match boot_gate(booted, self.epoch()) {
            BootGate::Pass => return Ok(()),
            BootGate::Wait => {
                self.monc.wait_epoch(booted, EPOCH_WAIT);
                if boot_gate(booted, self.epoch()) == BootGate::Pass {
                    return Ok(());
                }
            }
            BootGate::Refuse => {}
        }
        self.counters.boot_gate_refused.fetch_add(1, Relaxed);
        Err(Error::remote(
            Status::StaleEpoch,
            if booted == BOOTING {
                format!(
                    "node {} is starting: not registered with the monitor yet",
                    self.id
                )
            } else {
                format!(
                    "node {} booted at map epoch {booted} and its map is still at {}",
                    self.id,
                    self.epoch()
                )
            },
        ))
    }

    fn shard_op(&self, msg: &Incoming) -> Result<Vec<SendBuf>> {
        if !matches!(msg.peer(), Identity::Node(_)) {
            return Err(Error::remote(Status::Invalid, "shard ops are for nodes"));
        }
        let p: &[u8] = msg.payload();
        let mut d = Dec::new(p);
        let epoch = d.u64()?;
        match msg.msg_type() {
            wire::MSG_SHARD_WRITE => {
                let mut w = ShardWrite::decode(&mut d)?;
                let _admitted = self.check_shard_sender(msg, epoch, w.pool, w.pg)?;
                let delay = self.inject_shard_apply_delay_ms.load(Relaxed);
                if delay > 0 {
                    self.counters.shard_writes_delayed.fetch_add(1, Relaxed);
                    std::thread::sleep(Duration::from_millis(delay));
                }
                match w.vouch(p, msg.payload_crc()) {
                    Some(true) => self.counters.shard_crcs_vouched.fetch_add(1, Relaxed),
                    Some(false) => self.counters.shard_crcs_dropped.fetch_add(1, Relaxed),
                    None => 0,
                };
                self.local.apply(&w)?;
                Ok(vec![SendBuf::Vec(wire::reply_ok(self.epoch(), &[]))])
            }
            wire::MSG_SHARD_WRITE_STAGED => {
                let (mut w, r) = ShardWrite::decode_staged(&mut d)?;
                let _admitted = self.check_shard_sender(msg, epoch, w.pool, w.pg)?;
                let staged = self.shard_staging.take(&r, w.shard, w.pool, w.pg)?;
                w.data = local::ShardData::Flat(&staged.data);
                w.chunk_crcs = staged.crcs.clone();
                self.local.apply(&w)?;
                Ok(vec![SendBuf::Vec(wire::reply_ok(self.epoch(), &[]))])
            }
            wire::MSG_SHARD_REPAIR => {
                let w = ShardWrite::decode(&mut d)?;
                let _admitted = self.check_shard_sender(msg, epoch, w.pool, w.pg)?;
                self.local.repair(&w)?;
                Ok(vec![SendBuf::Vec(wire::reply_ok(self.epoch(), &[]))])
            }
            t => {
                let pool = d.u64()?;
                let pg = d.u32()?;
                let name = d.bytes()?;
                let shard = d.u8()?;
                let _admitted = self.check_shard_sender(msg, epoch, pool, pg)?;
                let mut e = Enc::new(self.epoch());
                e.u16(Status::Ok as u16);
                match t {
                    wire::MSG_SHARD_READ => {
                        let version = d.u64()?;
                        let off = d.u64()?;
                        let len = d.u64()?;
                        let flags = d.opt_flags()?;
                        let cached = flags & wire::SHARD_READ_FROM_DEVICE == 0;
                        let crcs = flags & wire::SHARD_READ_CHUNK_CRCS != 0;
                        d.end()?;
                        let data = self
                            .local
                            .read(pool, pg, name, shard, version, off, len, cached)?;
                        return Ok(local::read_reply(e, data, crcs));
                    }
                    wire::MSG_SHARD_STAT => {
                        d.end()?;
                        self.local.stat(pool, pg, name, shard)?.encode(&mut e);
                    }
                    wire::MSG_SHARD_DROP => {
                        let version = d.u64()?;
                        d.end()?;
                        self.drop_stale(pool, pg, name, shard, version)?
                            .encode(&mut e);
                    }
                    _ => {
                        let from = d.u64()?;
                        d.end()?;
                        self.local
                            .rollback(pool, pg, name, shard, from)?
                            .encode(&mut e);
                    }
                }
                Ok(vec![SendBuf::Vec(e.finish())])
            }
        }
    }

    /// `MSG_CLIENT_STAGE`: part of a large write, kept until the op that uses it.
    fn stage(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let mut d = Dec::new(msg.payload());
        let _epoch = d.u64()?;
        let upload = d.u64()?;
        let offset = d.u64()?;
        let data = d.bytes()?;
        d.end()?;
        let mut st = self.staging.lock().unwrap();
        st.retain(|_, s| s.at.elapsed() < STAGING_TTL);
        let held: usize = st
            .iter()
            .filter(|((who, _), _)| *who == msg.peer())
            .map(|(_, s)| s.data.len())
            .sum();
        if held + data.len() > STAGING_BYTES_MAX {
            return Err(Error::remote(
                Status::TooLarge,
                format!(
                    "{} would stage more than {STAGING_BYTES_MAX} bytes",
                    msg.peer()
                ),
            ));
        }
        let s = st.entry((msg.peer(), upload)).or_insert(Staged {
            data: Vec::new(),
            at: Instant::now(),
        });
        if offset != s.data.len() as u64
            || offset + data.len() as u64 > crate::ops::OBJECT_BYTES_MAX
        {
            return Err(Error::remote(
                Status::Invalid,
                format!(
                    "upload {upload}: part at {offset}, expected {}",
                    s.data.len()
                ),
            ));
        }
        s.data.extend_from_slice(data);
        s.at = Instant::now();
        Ok(wire::reply_ok(self.epoch(), &[]))
    }

    pub fn take_staged(&self, who: Identity, upload: u64) -> Result<Vec<u8>> {
        self.staging
            .lock()
            .unwrap()
            .remove(&(who, upload))
            .map(|s| s.data)
            .ok_or_else(|| {
                Error::remote(
                    Status::Invalid,
                    format!(
                        "no staged upload {upload} from {who} (expired or sent to another node)"
                    ),
                )
            })
    }

    /// `MSG_CLIENT_LIST`: names of a pool's objects this node holds shards of.
    fn list(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let mut d = Dec::new(msg.payload());
        let _epoch = d.u64()?;
        let pool = d.u64()?;
        let after = d.bytes()?;
        let max = d.u32()?.min(10_000) as usize;
        d.end()?;
        let names = self.local.list(pool, after, max, false)?;
        let mut e = Enc::new(self.epoch());
        e.u16(Status::Ok as u16).u32(names.len() as u32);
        for n in &names {
            e.bytes(n);
        }
        Ok(e.finish())
    }

    fn stats(&self) -> NodeStats {
        let (slow_ops, slow_longest_ms) = self.perf.ops.health();
        let (mut used, mut cap) = (0, 0);
        for s in &self.local.stores {
            let sp = s.space();
            used += sp.live_bytes;
            cap += sp.segments_total * sp.segment_bytes;
        }
        let msgr = self.msgr().stats();
        NodeStats {
            read_ops: self.counters.read_ops.load(Relaxed),
            write_ops: self.counters.write_ops.load(Relaxed),
            read_bytes: self.counters.read_bytes.load(Relaxed),
            write_bytes: self.counters.write_bytes.load(Relaxed),
            shards: self.local.shard_count(),
            used_bytes: used,
            capacity_bytes: cap,
            slow_ops,
            slow_longest_ms,
            scrub: self.scrub.counts.snapshot(),
            hot: self.hot.hottest(),
            batched_ops: self.hot.counters.batched_ops.load(Relaxed),
            coalesced_reads: self.hot.counters.coalesced_reads.load(Relaxed),
            cache_hits: self.hot.counters.cache_hits.load(Relaxed),
            read_fetches: self.hot.counters.read_fetches.load(Relaxed),
            crc_known_fetches: self.hot.counters.crc_known_fetches.load(Relaxed),
            paced_replies: self.hot.counters.paced_replies.load(Relaxed),
            inline_reads: self.hot.counters.inline_reads.load(Relaxed),
            msgr_iterations: msgr.total(|w| w.iterations),
            msgr_empty_iterations: msgr.total(|w| w.empty_iterations),
            silent_peers: self.peer_ping.silent(self.heartbeat_period()),
            cpu_ns: hot::process_cpu_ns(),
            at_unix_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            recovery: self.recovery.stats(),
            salvaged: self.salvaged_count() as u64,
            deleting_pools: self.strays.deleting_pools.lock().unwrap().clone(),
            deleted_pool_keys: self.strays.deleted_pool_keys.load(Relaxed),
        }
    }

    /// Run `f` holding a PG's turn: no client op of the PG runs meanwhile (ops that arrive
    /// queue up and run after). Waits up to `wait` for the turn; `None` if it never came.
    pub(crate) fn with_pg<T>(
        &self,
        key: (u64, u32),
        wait: Duration,
        f: impl FnOnce() -> T,
    ) -> Option<T> {
        let deadline = Instant::now() + wait;
        loop {
            {
                let mut pgs = self.pgs.lock().unwrap();
                let slot = pgs.entry(key).or_insert_with(PgSlot::new);
                if !slot.running {
                    slot.running = true;
                    break;
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = f();
        let mut pgs = self.pgs.lock().unwrap();
        let slot = pgs.get_mut(&key).expect("held PG has a slot");
        if slot.queue.is_empty() {
            slot.running = false;
        } else {
            // Ops queued meanwhile: hand the PG (still marked running) to an op thread.
            self.run_q.push(key);
        }
        Some(r)
    }

    /// How often the node heartbeats to the monitors and pings its peers.
    pub(crate) fn heartbeat_period(&self) -> Duration {
        Duration::from_millis(self.cfg.heartbeat_ms.max(50))
    }

    fn heartbeat_loop(self: Arc<Self>) {
        let period = self.heartbeat_period();
        loop {
            self.monc.heartbeat(self.id, &self.stats());
            std::thread::sleep(period);
        }
    }
}

/// Open (creating and labelling when configured) the node's devices.
fn open_devices(cfg: &NodeConfig, fsid: &[u8; 16]) -> Result<Vec<Store<FileDevice>>> {
    let mut stores = Vec::new();
    for spec in &cfg.devices {
        if crate::storecli::is_pci_address(spec) {
            return Err(Error::Config(format!(
                "{spec}: NVMe devices through VFIO are not in this build; use a file path"
            )));
        }
        let path = Path::new(spec);
        let dev = if path.exists() {
            FileDevice::open(path, FileOptions::default())?
        } else {
            let size = cfg.device_size.ok_or_else(|| {
                Error::Config(format!(
                    "{spec}: no such device (set device_size to create it)"
                ))
            })?;
            let dev = FileDevice::create(path, size, FileOptions::default())?;
            let label = store::mkfs(
                &dev,
                &MkfsOptions {
                    cluster_fsid: *fsid,
                    node_id: cfg.id,
                    ..MkfsOptions::default()
                },
            )?;
            info!(
                "{spec}: created and labelled device {}",
                Uuid(&label.device_uuid)
            );
            dev
        };
        // Salvage: a rotten batch in the log must not keep the node down; its shards are
        // rebuilt from their peers (salvage.rs).
        let config = StoreConfig {
            salvage: true,
            read_cache_bytes: cfg.read_cache_bytes,
            // An overwrite moves the old shard to its rollback key (local.rs).
            alias: Some(local::rollback_partner),
            ..StoreConfig::default()
        };
        let (st, report) = Store::open(dev, Some(*fsid), config)?;
        if st.label().node_id != cfg.id {
            return Err(Error::Config(format!(
                "{spec}: labelled for node {}, this is node {}",
                st.label().node_id,
                cfg.id
            )));
        }
        info!("{spec}: {report}");
        let _ = st.device().geometry();
        stores.push(st);
    }
    Ok(stores)
}

/// Start a node; returns once it has registered with the monitors.
pub fn start(mut cfg: NodeConfig) -> Result<Arc<Node>> {
    cfg.id = identity::node_identity(&cfg)?;
    let secret = Secret::load(&cfg.key_file)?;
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| Error::io(format!("data dir {}", cfg.data_dir.display()), e))?;
    let disp = Arc::new(NodeDispatcher {
        node: OnceLock::new(),
        monc: OnceLock::new(),
    });
    let msgr = Arc::new(Messenger::new(
        messenger::Config {
            payload_bytes_max: messenger::frame::PAYLOAD_BYTES_LIMIT,
            busy_poll: Duration::from_micros(cfg.busy_poll_us),
            ..messenger::Config::default()
        },
        Identity::Node(cfg.id),
        secret,
        disp.clone(),
    )?);
    let monc = MonClient::new(msgr.clone(), cfg.monitors.clone());
    let _ = disp.monc.set(monc.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match monc.subscribe() {
            Ok(_) if !monc.map().fsid.is_empty() => break,
            Ok(_) => {}
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => {}
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let fsid = store::parse_uuid(&monc.map().fsid).ok_or_else(|| {
        Error::Config(format!("monitor fsid {:?} is not a UUID", monc.map().fsid))
    })?;
    let stores = open_devices(&cfg, &fsid)?;
    let devices = stores
        .iter()
        .map(|s| Uuid(&s.label().device_uuid).to_string())
        .collect();
    let node = Arc::new(Node {
        id: cfg.id,
        cfg: cfg.clone(),
        local: Arc::new(Local::new(stores)),
        monc: monc.clone(),
        msgr: OnceLock::new(),
        peers: Default::default(),
        pgs: Mutex::new(HashMap::new()),
        intervals: Arc::default(),
        boot_epoch: AtomicU64::new(BOOTING),
        run_q: Arc::new(WaitQueue::new()),
        shard_q: Arc::new(WaitQueue::new()),
        staging: Mutex::new(HashMap::new()),
        shard_staging: staging::Staging::default(),
        codecs: Mutex::new(HashMap::new()),
        counters: Counters::default(),
        perf: perf::Perf::new(Duration::from_millis(cfg.slow_op_ms)),
        scrub: scrub::Scrub::load(&cfg.data_dir),
        hot: hot::Hot::new(cfg.read_coalescing, cfg.hot_cache_bytes),
        recovery_q: Arc::new(WaitQueue::new()),
        recovery: recovery::Recovery::default(),
        peer_ping: peerping::PeerPing::default(),
        strays: strays::Strays::default(),
        inject_write_delay_ms: AtomicU64::new(0),
        inject_shard_apply_delay_ms: AtomicU64::new(0),
        inject_drop_staged: AtomicBool::new(false),
    });
    node.forget_marks_after_salvage();
    let _ = node.msgr.set(msgr.clone());
    let _ = disp.node.set(node.clone());
    let addr = msgr.listen(cfg.listen)?;
    node.start_metrics()?;
    for i in 0..cfg.op_threads.max(1) {
        let n = node.clone();
        std::thread::Builder::new()
            .name(format!("node-op-{i}"))
            .spawn(move || n.op_thread())
            .map_err(|e| Error::io("spawn", e))?;
    }
    for i in 0..SHARD_THREADS {
        let n = node.clone();
        std::thread::Builder::new()
            .name(format!("node-shard-{i}"))
            .spawn(move || n.shard_thread())
            .map_err(|e| Error::io("spawn", e))?;
    }
    for i in 0..recovery::RECOVERY_SHARD_THREADS {
        let n = node.clone();
        std::thread::Builder::new()
            .name(format!("node-rshard-{i}"))
            .spawn(move || n.recovery_shard_thread())
            .map_err(|e| Error::io("spawn", e))?;
    }
    if cfg.inject_boot_delay_ms > 0 {
        tracing::warn!(
            "fault injection: holding the Boot for {} ms (inject_boot_delay_ms)",
            cfg.inject_boot_delay_ms
        );
        std::thread::sleep(Duration::from_millis(cfg.inject_boot_delay_ms));
    }
    let r = monc.command(&MonCommand::Boot(NodeInfo {
        id: cfg.id,
        addr,
        host: cfg.host.clone(),
        weight: cfg.weight,
        up: true,
        r#in: true,
        devices,
        // Set by the map when it applies the boot.
        up_from: 0,
        auto_out: false,
    }))?;
    if !r.ok {
        return Err(Error::Monitor(format!(
            "registration refused: {}",
            r.message
        )));
    }
    node.boot_epoch.store(r.epoch, Release);
    monc.start_poller();
    let n = node.clone();
    std::thread::Builder::new()
        .name("node-heartbeat".into())
        .spawn(move || n.heartbeat_loop())
        .map_err(|e| Error::io("spawn", e))?;
    let n = node.clone();
    std::thread::Builder::new()
        .name("node-peer-ping".into())
        .spawn(move || n.peer_ping_loop())
        .map_err(|e| Error::io("spawn", e))?;
    for i in 0..recovery::RECOVERY_THREADS {
        let n = node.clone();
        std::thread::Builder::new()
            .name(format!("node-rebuild-{i}"))
            .spawn(move || n.recovery_worker())
            .map_err(|e| Error::io("spawn", e))?;
    }
    let n = node.clone();
    std::thread::Builder::new()
        .name("node-recovery".into())
        .spawn(move || n.recovery_loop())
        .map_err(|e| Error::io("spawn", e))?;
    let n = node.clone();
    std::thread::Builder::new()
        .name("node-scrub".into())
        .spawn(move || n.scrub_loop())
        .map_err(|e| Error::io("spawn", e))?;
    let n = node.clone();
    std::thread::Builder::new()
        .name("node-strays".into())
        .spawn(move || n.strays_loop())
        .map_err(|e| Error::io("spawn", e))?;
    if !node.salvage_reports().is_empty() {
        let n = node.clone();
        let epoch = r.epoch;
        std::thread::Builder::new()
            .name("node-salvage".into())
            .spawn(move || n.request_salvage_scrubs(epoch))
            .map_err(|e| Error::io("spawn", e))?;
    }
    info!("node {} up at {addr}, map epoch {}", cfg.id, r.epoch);
    if !monc.map().nodes.contains_key(&cfg.id) {
        warn!("node {}: registered but not yet in the local map", cfg.id);
    }
    std::mem::forget(msgr);
    Ok(node)
}

/// Run a node until the process is killed.
pub fn run(cfg: NodeConfig) -> Result<()> {
    let _node = start(cfg)?;
    loop {
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_ops_wait_for_the_boot_epoch() {
        // Not registered: refused, whatever map the node holds.
        assert_eq!(boot_gate(BOOTING, 0), BootGate::Refuse);
        assert_eq!(boot_gate(BOOTING, u64::MAX - 1), BootGate::Refuse);
        // Booted at 40 with a map from a monitor that lags: wait for the map.
        assert_eq!(boot_gate(40, 0), BootGate::Wait);
        assert_eq!(boot_gate(40, 39), BootGate::Wait);
        // The map has caught up: the map and interval checks decide.
        assert_eq!(boot_gate(40, 40), BootGate::Pass);
        assert_eq!(boot_gate(40, 41), BootGate::Pass);
    }
}
