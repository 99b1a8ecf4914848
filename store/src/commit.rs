//! The commit thread: group commit, the log writer, index updates and checkpoints.
//!
//! # Policy (nothing durable waits for a timer)
//! The thread sleeps only when it has nothing to do. When a transaction arrives it takes it and
//! everything else already queued (up to [`ROUND_TXNS_MAX`] / `round_bytes_max`), lays them out as
//! batches at the log head, writes them, and makes them durable with one flush (or one FUA write
//! when the round is a single write). While that round is on the device, new arrivals queue up and
//! become the next round the moment it finishes: the batch grows with the load and a lone writer
//! pays one device write + flush. When the thread wakes for a transaction of at most 64 KiB with no
//! round on the device, it first yields the CPU, again after each yield that brought more
//! transactions (at most [`ARRIVAL_YIELDS_MAX`] times): on a host whose cores are all busy the
//! threads that run meanwhile are often the ones about to submit, and their transactions join the
//! round instead of each paying a round of their own (on 2 cores running 8 nodes, 4 KiB writes went
//! from 2 to about 7 transactions per round and +35 % throughput). This waits for no timer and no
//! event: on an idle host the yield returns at once and the round starts. Only after the round is
//! durable are the new states published in the index and the waiters released: acknowledged =
//! durable, and readers never see data a crash could take back. A thread blocked on a small
//! transaction yields the CPU for up to [`COMMIT_WAIT_YIELD`] before it parks, so releasing it
//! is a store to memory and it is back with its next transaction before the next round starts.
//!
//! A checkpoint never holds up a round: it begins between rounds (nothing in flight, so the log
//! position it records covers every state in the index), the `store-ckpt` thread encodes the
//! index ([`crate::checkpoint`]) and this thread writes each finished batch beside the rounds;
//! only its completion (a flush, then the superblocks) waits for the rounds on the device.
//!
//! Transactions in one round touch disjoint objects (a second transaction on an object in the
//! round waits for the next round), so every transaction is checked against the index as the
//! previous rounds left it.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam::channel::{Receiver, Sender};
use driver::{BlockDevice, DmaBuf};
use smallvec::SmallVec;
use zerocopy::IntoBytes;

use crate::checkpoint::{Encoded, Encoder};
use crate::emit::Emitter;
use crate::error::{Result, StoreError};
use crate::format::{
    round_up, ChunkRef, Superblock, NO_SEGMENT, SEGMENT_CHECKPOINT, SUPERBLOCK_OFFSETS,
};
use crate::key::ObjectKey;
use crate::meta::{
    encode_owner, encode_remove, encode_state, owner_record_len, remove_record_len,
    state_record_len, ObjectMeta,
};
use crate::space::SegState;
use crate::stream::{batch_header, Pos, StreamHead};
use crate::Shared;

/// Most transactions in one round.
pub const ROUND_TXNS_MAX: usize = 4096;

/// Caller memory lent to the commit thread while the caller blocks in `Store::commit`.
pub(crate) struct Lent {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a Lent is created only by Store::commit from a slice that outlives the call, and the
// caller blocks until the commit thread has replied — after which the thread holds no Lent.
unsafe impl Send for Lent {}

impl Lent {
    /// # Safety
    /// `s` must stay valid and unmodified until the commit thread replies to the transaction.
    pub(crate) unsafe fn new(s: &[u8]) -> Self {
        Lent {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    fn get(&self) -> &[u8] {
        // SAFETY: see `new`: the slice is alive while the transaction is unanswered.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// The bytes of a lent slice.
pub(crate) fn lent_bytes(l: &Lent) -> &[u8] {
    l.get()
}

pub(crate) fn lent_len(l: &Lent) -> usize {
    l.len
}

pub(crate) enum DataRef {
    Lent(Lent),
    Owned(Vec<u8>),
    /// Already in a DMA buffer (copied there by the preparing caller, in parallel with other
    /// callers): written as its own IO, no copy on the commit thread. The buffer holds this
    /// chunk's `len` bytes and the `run - 1` whole chunks after it ([`DataRef::DmaPart`]s),
    /// which the batch lays out right after it: one write for all. `None` once submitted.
    Dma {
        buf: Option<DmaBuf>,
        len: usize,
        run: usize,
    },
    /// A chunk of `len` bytes held in the run buffer of an earlier chunk of the same object.
    DmaPart(usize),
}

impl DataRef {
    /// The bytes, for the copy path. Not for DMA items (no reference into DMA memory).
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            DataRef::Lent(l) => l.get(),
            DataRef::Owned(v) => v,
            DataRef::Dma { .. } | DataRef::DmaPart(_) => {
                unreachable!("DMA items are submitted, not copied")
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            DataRef::Lent(l) => l.len,
            DataRef::Owned(v) => v.len(),
            DataRef::Dma { len, .. } | DataRef::DmaPart(len) => *len,
        }
    }
}

pub(crate) enum ChunkSrc {
    Keep(ChunkRef),
    /// New bytes and their CRC32C (computed by whoever prepared them, off the commit thread).
    New(DataRef, u32),
    Hole,
}

pub(crate) enum XattrSrc {
    Keep(ChunkRef),
    /// Whatever the object has when the transaction commits (blind writes).
    Current,
    New(Vec<u8>),
    None,
}

/// What a transaction requires of an object's state when it commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Base {
    Any,
    Absent,
    Seq(u64),
}

pub(crate) struct PutState {
    pub size: u64,
    /// CRC32C of the whole new content (computed by the preparer).
    pub data_crc: u32,
    pub chunks: Vec<ChunkSrc>,
    pub xattrs: XattrSrc,
    /// A relocation: the user-visible version and mtime stay.
    pub relocation: bool,
}

pub(crate) enum MutOp {
    Remove,
    Put(PutState),
}

pub(crate) struct Mut {
    pub key: ObjectKey,
    pub base: Base,
    pub op: MutOp,
}

impl Mut {
    /// Whether the commit needs nothing of the object's current state before the round is
    /// durable: a blind mutation that keeps nothing of it (no relocation, no xattrs taken from
    /// the current state). The state it replaces is then read in the same index search that
    /// installs the new one, when the round is applied, instead of a search at the check.
    fn state_at_apply(&self) -> bool {
        self.base == Base::Any
            && match &self.op {
                MutOp::Remove => true,
                MutOp::Put(p) => !p.relocation && !matches!(p.xattrs, XattrSrc::Current),
            }
    }
}

pub(crate) struct Prepared {
    pub muts: Vec<Mut>,
    pub background: bool,
    /// How far into the reserve it may go.
    pub room: Room,
    /// The segment whose live data it relocates (the cleaner's victim): never placed there.
    pub moves_from: Option<u32>,
    /// When it first waited for the cleaner to free space (a retried transaction keeps it, so
    /// [`SPACE_WAIT_MAX`] bounds its whole wait).
    pub parked_at: Option<Instant>,
}

/// How far into the store's reserve a foreground transaction may go (the cleaner's own
/// relocations go furthest).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Room {
    /// Keeps the reserve.
    #[default]
    Normal,
    /// [`crate::Transaction::makes_room`]: down to one segment above the cleaner's floor.
    Makes,
    /// [`crate::Transaction::frees_space`]: down to the cleaner's floor.
    Frees,
}

pub(crate) enum TxnResult {
    Committed {
        version: u64,
    },
    /// An object changed since the transaction was prepared: prepare again.
    Conflict,
    Failed(StoreError),
}

/// The commit thread's answer to one transaction: to a thread blocked in `Store::commit`, or
/// a callback run on the commit thread (`Store::commit_async`). A thread waiting on a small
/// transaction yields the CPU for up to [`COMMIT_WAIT_YIELD`] before it parks; other waiters
/// park at once (a channel's receiver spins and yields before parking, which on a few cores
/// shared by many store threads cost more CPU than the wait itself). Dropped unanswered (the
/// commit thread stopping), it wakes the waiter with "closed" / calls the callback with `None`.
pub(crate) struct Reply(ReplyTo);

enum ReplyTo {
    Waiter(Arc<ReplySlot>),
    Call(Box<dyn FnOnce(Option<TxnResult>) + Send>),
    Sent,
}

/// Waits for a [`Reply`], on the thread that made the pair.
pub(crate) struct ReplyWaiter(Arc<ReplySlot>);

pub(crate) struct ReplySlot {
    /// `Some(None)`: the reply was dropped unanswered.
    v: std::sync::Mutex<Option<Option<TxnResult>>>,
    /// The waiting thread: woken with `unpark`, which costs no system call while it is not
    /// parked.
    thread: std::thread::Thread,
}

/// A reply and its waiter; the waiter waits on this thread.
pub(crate) fn reply_pair() -> (Reply, ReplyWaiter) {
    let slot = Arc::new(ReplySlot {
        v: std::sync::Mutex::new(None),
        thread: std::thread::current(),
    });
    (Reply(ReplyTo::Waiter(slot.clone())), ReplyWaiter(slot))
}

/// A reply that calls `f` on the commit thread (`None`: dropped unanswered).
pub(crate) fn reply_call(f: Box<dyn FnOnce(Option<TxnResult>) + Send>) -> Reply {
    Reply(ReplyTo::Call(f))
}

impl Reply {
    pub(crate) fn send(mut self, r: TxnResult) {
        self.put(Some(r));
    }

    fn put(&mut self, r: Option<TxnResult>) {
        match std::mem::replace(&mut self.0, ReplyTo::Sent) {
            ReplyTo::Waiter(slot) => {
                *slot.v.lock().unwrap() = Some(r);
                slot.thread.unpark();
            }
            ReplyTo::Call(f) => f(r),
            ReplyTo::Sent => {}
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        self.put(None);
    }
}

impl ReplyWaiter {
    /// The result; `Err` if the commit thread dropped the transaction unanswered. Parks at
    /// once.
    pub(crate) fn recv(self) -> std::result::Result<TxnResult, ()> {
        self.recv_yielding(Duration::ZERO)
    }

    /// As [`ReplyWaiter::recv`], but yields the CPU instead of parking for the first `yield_for`
    /// (see [`COMMIT_WAIT_YIELD`]).
    pub(crate) fn recv_yielding(self, yield_for: Duration) -> std::result::Result<TxnResult, ()> {
        debug_assert_eq!(self.0.thread.id(), std::thread::current().id());
        let start = (!yield_for.is_zero()).then(Instant::now);
        loop {
            if let Some(r) = self.0.v.lock().unwrap().take() {
                return r.ok_or(());
            }
            match start {
                Some(t) if t.elapsed() < yield_for => std::thread::yield_now(),
                _ => std::thread::park(),
            }
        }
    }
}

pub(crate) enum Msg {
    Txn(Box<Prepared>, Reply),
    Checkpoint(Sender<Result<()>>),
}

/// One value per mutation of a transaction: most have one, and a round allocates none for it.
type PerMut<T> = SmallVec<[T; 2]>;

/// A transaction that passed its checks, with everything needed to write and apply it.
struct Accepted {
    txn: Box<Prepared>,
    reply: Reply,
    seq: u64,
    /// Index state of each mut's object when checked (`None` also for a mut whose state is
    /// read when applied: [`Mut::state_at_apply`]).
    cur: PerMut<Option<Arc<ObjectMeta>>>,
    /// Placed data: per mut, the refs of its new chunks (by chunk index) and xattr blob.
    placed: PerMut<(SmallVec<[ChunkRef; 2]>, ChunkRef)>,
    new_metas: PerMut<Option<Arc<ObjectMeta>>>,
}

enum CheckErr {
    Reply(TxnResult),
    /// Not enough free space now, but the cleaner can reclaim enough: park the transaction.
    WaitSpace,
}

/// How long a transaction waits for the cleaner to free space before failing.
const SPACE_WAIT_MAX: Duration = Duration::from_secs(30);

/// Most times the commit thread yields the CPU before a round while transactions keep
/// arriving (see the module's policy). Measured on 2 cores running 8 nodes (4 KiB writes,
/// 16 clients): 1 yield took rounds from 2.0 to 3.3 transactions, 4 to about 7, 8 to about 8
/// with no more throughput.
const ARRIVAL_YIELDS_MAX: usize = 4;

/// Only a small transaction waits for others to join it: a large one's device write costs
/// far more than a round's fixed cost (and the yields measured no gain on 4 MiB writes).
const ARRIVAL_YIELD_TXN_BYTES_MAX: u64 = 64 << 10;

/// The thread woke for a transaction with nothing on the device: give the CPU to whichever
/// threads are runnable (on a busy host, often the very ones about to submit the next
/// transactions) and take the round after them, for as long as that brings more. When no
/// other thread wants the CPU, `yield_now` returns at once and the queue did not grow: one
/// system call, no wait.
fn yield_while_arriving(user: &Receiver<Msg>) {
    let mut queued = user.len();
    for _ in 0..ARRIVAL_YIELDS_MAX {
        std::thread::yield_now();
        let now = user.len();
        if now == queued {
            return;
        }
        queued = now;
    }
}

/// Rounds the commit thread keeps on the device at once: one being flushed while the next is
/// written. Only a round led by a transaction over [`ARRIVAL_YIELD_TXN_BYTES_MAX`] starts
/// beside another: a round of small ones waits until the device has nothing of the store's,
/// and so takes everything that arrived meanwhile. With a second round allowed beside a
/// small one, 32 writers of 4 KiB puts split into two groups taking turns (about 19 puts per
/// flush instead of 24 on the 49th stop's 2-vCPU host, where the commit thread's CPU is what
/// limits them: each round costs it a fixed share).
const PIPELINE_ROUNDS_MAX: usize = 2;

/// A round on the device.
struct InFlight {
    id: u64,
    accepted: Vec<Accepted>,
    /// Its last log batch: durable (and so acknowledged) once the round is.
    last_batch: u64,
}

/// One data item of a round: (txn index, mut index, chunk index or usize::MAX for xattrs).
type Item = (usize, usize, usize);

struct Checkpointing {
    id: u64,
    head: StreamHead,
    start: Pos,
    next_op_seq: u64,
    first_seg: u32,
    /// Every object is encoded and the last batch is written: the checkpoint completes once
    /// nothing is in flight (its flush, then the superblocks).
    walked: bool,
    batches: u32,
    objects: u64,
    /// Bytes written so far (batches, headers and padding).
    bytes: u64,
    waiters: Vec<Sender<Result<()>>>,
}

pub(crate) struct Committer<D: BlockDevice> {
    sh: Arc<Shared<D>>,
    em: Emitter<D>,
    log: StreamHead,
    sb: Superblock,
    next_op_seq: u64,
    deferred: VecDeque<(Box<Prepared>, Reply)>,
    ckpt: Option<Checkpointing>,
    /// The checkpoint encoder's thread, started with the first checkpoint.
    encoder: Option<Encoder>,
    ckpt_requests: Vec<Sender<Result<()>>>,
    log_bytes_since_ckpt: u64,
    /// Size of the newest checkpoint: the next one is due only after at least this much log
    /// (see [`Committer::checkpoint_due`]).
    last_ckpt_bytes: u64,
    /// Log written while the newest checkpoint was being written (the rounds go on beside
    /// it, and a restart replays from where it began).
    last_ckpt_log_during: u64,
    failed: Option<String>,
    /// Newest log batch known durable (the last batch of the last completed round).
    durable_through: u64,
    /// Rounds submitted and not yet durable, oldest first.
    inflight: VecDeque<InFlight>,
    /// Objects touched by rounds in flight: later transactions on them wait (the index does
    /// not show their new state yet).
    keys_in_flight: HashSet<ObjectKey>,
    round_id: u64,
    /// Transactions waiting for the cleaner to free space, and what they are retried on.
    space_waiters: Vec<(Box<Prepared>, Reply)>,
    space_retry: SpaceRetry,
}

/// When parked transactions are checked again: once a segment was freed or a round started
/// since the last of them parked (a transaction checked after others in the same round
/// counted their bytes too, and the log head moves: it may fit now), and at least every
/// [`SPACE_RETRY_PERIOD`] — a checkpoint can free segments and take one in the same step,
/// and a waiter whose space nothing can reclaim any more must get its error, not wait on.
#[derive(Clone, Copy)]
struct SpaceRetry {
    frees: u64,
    round: u64,
    at: Instant,
}

/// The longest a transaction waiting for space goes without being checked again.
const SPACE_RETRY_PERIOD: Duration = Duration::from_millis(250);

pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// CRC32C of `n` zero bytes.
pub(crate) fn zeros_crc(mut n: u64) -> u32 {
    static ZEROS: [u8; 4096] = [0; 4096];
    let mut crc = 0;
    while n > 0 {
        let k = n.min(4096);
        crc = crc32c::crc32c_append(crc, &ZEROS[..k as usize]);
        n -= k;
    }
    crc
}

impl<D: BlockDevice + 'static> Committer<D> {
    pub(crate) fn new(
        sh: Arc<Shared<D>>,
        log: StreamHead,
        sb: Superblock,
        next_op_seq: u64,
    ) -> Result<Self> {
        let em = Emitter::new(&sh.dev, sh.config.staging_bytes)?;
        let durable_through = log.pos.batch_seq - 1;
        // The checkpoint this open loaded, sized by its batch count (each batch is at most
        // `ckpt_batch_max` bytes and filled to within 64 KiB of it).
        let last_ckpt_bytes = sb.ckpt_batches.get() as u64 * ckpt_batch_max(&log.layout);
        Ok(Committer {
            sh,
            em,
            log,
            sb,
            next_op_seq,
            deferred: VecDeque::new(),
            ckpt: None,
            encoder: None,
            ckpt_requests: Vec::new(),
            log_bytes_since_ckpt: 0,
            last_ckpt_bytes,
            last_ckpt_log_during: 0,
            failed: None,
            durable_through,
            space_waiters: Vec::new(),
            space_retry: SpaceRetry {
                frees: 0,
                round: 0,
                at: Instant::now(),
            },
            inflight: VecDeque::new(),
            keys_in_flight: HashSet::new(),
            round_id: 0,
        })
    }

    /// The thread's loop. The store keeps a background sender for as long as the user channel
    /// is open, so `bg` never reports disconnection while the thread runs.
    pub(crate) fn run(mut self, user: Receiver<Msg>, bg: Receiver<Msg>) {
        loop {
            self.retry_space_waiters();
            // A checkpoint is encoded on its own thread and written alongside the rounds (see
            // `checkpoint_step`); only its completion waits for the device to have nothing of
            // the store's.
            let finishing = self.ckpt.as_ref().is_some_and(|c| c.walked);
            let can_start = self.inflight.len() < PIPELINE_ROUNDS_MAX && !finishing;
            let idle = self.inflight.is_empty() && self.deferred.is_empty();
            let mut got = None;
            let first = if !can_start {
                None
            } else if !idle {
                user.try_recv().or_else(|_| bg.try_recv()).ok()
            } else {
                // Sleep until a message arrives, or the encoder's next batch of a checkpoint
                // in progress, or (waiting for the cleaner) now and then, to retry or time out.
                let out = match self.encoder.as_ref().filter(|_| self.ckpt.is_some()) {
                    Some(enc) => enc.out().clone(),
                    None => crossbeam::channel::never(),
                };
                let tick = if self.space_waiters.is_empty() {
                    crossbeam::channel::never()
                } else {
                    crossbeam::channel::after(Duration::from_millis(20))
                };
                crossbeam::select! {
                    recv(user) -> m => match m { Ok(m) => Some(m), Err(_) => return self.shutdown() },
                    recv(bg) -> m => m.ok(),
                    recv(out) -> b => {
                        got = b.ok();
                        None
                    }
                    recv(tick) -> _ => None,
                }
            };
            let mut started = false;
            let (mut first, mut can_start) = (first, can_start);
            // The round's first transaction: the oldest deferred one, else the one received.
            let small_lead = self
                .deferred
                .front()
                .map(|(t, _)| &**t)
                .or(match &first {
                    Some(Msg::Txn(t, _)) => Some(&**t),
                    _ => None,
                })
                .is_some_and(|t| txn_bytes(t) <= ARRIVAL_YIELD_TXN_BYTES_MAX);
            if can_start && small_lead && !self.inflight.is_empty() {
                // Only big transactions start a round beside one on the device (see
                // `PIPELINE_ROUNDS_MAX`): small ones wait for it, and so does what they lead.
                if let Some(m) = first.take() {
                    match m {
                        Msg::Txn(t, r) => self.deferred.push_back((t, r)),
                        other => self.take(other, &mut Vec::new()),
                    }
                }
                can_start = false;
            }
            if can_start && small_lead && self.inflight.is_empty() {
                yield_while_arriving(&user);
            }
            if can_start {
                let mut round = Vec::new();
                if let Some(m) = first {
                    self.take(m, &mut round);
                }
                self.gather(&user, &bg, &mut round);
                if !round.is_empty() {
                    started = self.start_round(round);
                }
            }
            if self.ckpt.is_some() {
                // Checkpoint batches, while the round just started (if any) is on the device.
                let busy = !self.inflight.is_empty();
                self.checkpoint_step(busy, got, false);
            }
            if !self.inflight.is_empty() {
                // Wait for the device unless a new round was just started (then only reap).
                self.progress(!started);
            }
            if self.inflight.is_empty() && self.ckpt.is_none() && self.checkpoint_due() {
                self.checkpoint_begin();
            }
            if user.is_empty() && self.deferred.is_empty() && self.ckpt.is_none() && bg.is_empty() {
                // Idle: publish counters; nothing else to do until a message arrives.
                self.publish_stats();
            }
        }
    }

    /// Reap device completions; publish every round that became durable, in order.
    fn progress(&mut self, block: bool) {
        match self.em.progress(block) {
            Ok(durable) => {
                while self.inflight.front().is_some_and(|r| r.id <= durable) {
                    let r = self.inflight.pop_front().unwrap();
                    self.durable_through = r.last_batch;
                    for a in &r.accepted {
                        for m in &a.txn.muts {
                            self.keys_in_flight.remove(&m.key);
                        }
                    }
                    self.apply(r.accepted);
                }
            }
            Err(e) => self.fail_inflight(e),
        }
    }

    /// A device write or flush failed: every round in flight fails and the store stops
    /// accepting writes (the log may now have a hole that replay would stop at).
    fn fail_inflight(&mut self, e: StoreError) {
        let why = e.to_string();
        tracing::error!(error = %why, "log write failed; the store now refuses writes");
        self.failed = Some(why.clone());
        for r in std::mem::take(&mut self.inflight) {
            for a in r.accepted {
                let Accepted { txn, reply, .. } = a;
                drop(txn);
                reply.send(TxnResult::Failed(StoreError::Invalid(format!(
                    "log write failed: {why}"
                ))));
            }
        }
        self.keys_in_flight.clear();
        let _ = self.em.drain();
    }

    /// Write an empty batch whose `durable_through` covers every acknowledged batch, so rot in
    /// the last of them is told apart from a torn write at the next open.
    fn seal_log(&mut self) -> Result<()> {
        if self.durable_through + 1 != self.log.pos.batch_seq || self.durable_through == 0 {
            return Ok(());
        }
        let layout = self.log.layout;
        let bytes = layout.batch_bytes(0, 0);
        let placement = place_batch(&self.sh, &mut self.log, &mut self.em, bytes)?;
        let h = batch_header(
            self.log.stream_id,
            self.log.pos.batch_seq - 1,
            self.log.gen,
            0,
            &[],
            0,
            0,
            self.durable_through,
        );
        self.em.begin(placement.offset)?;
        self.em.put(h.as_bytes())?;
        self.em.pad_to_block()?;
        self.em.finish_round()?;
        self.durable_through = self.log.pos.batch_seq - 1;
        Ok(())
    }

    /// Requeue parked transactions when [`SpaceRetry`] says; fail those that waited too long.
    fn retry_space_waiters(&mut self) {
        if self.space_waiters.is_empty() {
            return;
        }
        let frees = self.sh.segs.lock().unwrap().frees;
        let now = Instant::now();
        let r = self.space_retry;
        let progressed = frees != r.frees || self.round_id != r.round || now >= r.at;
        for (t, r) in std::mem::take(&mut self.space_waiters) {
            let since = t.parked_at.unwrap_or(now);
            if now.duration_since(since) > SPACE_WAIT_MAX {
                drop(t);
                let segs = self.sh.segs.lock().unwrap();
                let rep = segs.report(segs.replay_start);
                r.send(TxnResult::Failed(StoreError::OutOfSpace {
                    device: self.sh.name.clone(),
                    used: rep.segments_total - rep.segments_free,
                    total: rep.segments_total,
                    reclaimable: rep.segments_reclaimable,
                    reserve: rep.segments_reserve,
                }));
            } else if progressed {
                self.deferred.push_back((t, r));
            } else {
                self.space_waiters.push((t, r));
            }
        }
    }

    fn shutdown(mut self) {
        while !self.inflight.is_empty() && self.failed.is_none() {
            self.progress(true);
        }
        for (t, r) in std::mem::take(&mut self.space_waiters) {
            drop(t);
            r.send(TxnResult::Failed(StoreError::Closed));
        }
        // Finish an in-progress checkpoint so the next open replays little.
        while self.ckpt.is_some() && self.failed.is_none() {
            self.checkpoint_step(false, None, true);
        }
        if self.failed.is_none() {
            if let Err(e) = self.seal_log() {
                tracing::warn!(error = %e, "could not seal the log at shutdown");
            }
        }
        self.publish_stats();
    }

    fn take(&mut self, m: Msg, round: &mut Vec<(Box<Prepared>, Reply)>) {
        match m {
            Msg::Txn(t, r) => round.push((t, r)),
            Msg::Checkpoint(r) => match &mut self.ckpt {
                Some(c) => c.waiters.push(r),
                None => self.ckpt_requests.push(r),
            },
        }
    }

    /// Add deferred and queued transactions to the round, keeping objects disjoint.
    fn gather(
        &mut self,
        user: &Receiver<Msg>,
        bg: &Receiver<Msg>,
        round: &mut Vec<(Box<Prepared>, Reply)>,
    ) {
        let mut incoming: Vec<_> = std::mem::take(round);
        incoming.splice(0..0, self.deferred.drain(..));
        let max_bytes = self.sh.config.round_bytes_max;
        let in_flight_set = std::mem::take(&mut self.keys_in_flight);
        let in_flight = &in_flight_set;
        let bytes = std::cell::Cell::new(0u64);
        let bg_bytes = std::cell::Cell::new(0u64);
        let mut keys: HashSet<ObjectKey> = HashSet::new();
        let mut admit =
            |t: Box<Prepared>, r: Reply, round: &mut Vec<_>, deferred: &mut VecDeque<_>| {
                let size = txn_bytes(&t);
                let clash = t
                    .muts
                    .iter()
                    .any(|m| keys.contains(&m.key) || in_flight.contains(&m.key));
                let full = round.len() >= ROUND_TXNS_MAX
                    || (!round.is_empty() && bytes.get() + size > max_bytes);
                if clash || full {
                    deferred.push_back((t, r));
                    return false;
                }
                for m in &t.muts {
                    keys.insert(m.key.clone());
                }
                bytes.set(bytes.get() + size);
                if t.background {
                    bg_bytes.set(bg_bytes.get() + size);
                }
                round.push((t, r));
                true
            };
        for (t, r) in incoming {
            admit(t, r, round, &mut self.deferred);
        }
        while self.deferred.is_empty() {
            let Ok(m) = user.try_recv() else { break };
            match m {
                Msg::Txn(t, r) => {
                    if !admit(t, r, round, &mut self.deferred) {
                        break;
                    }
                }
                other => self.take(other, round),
            }
        }
        // Background work (cleaner relocations) gets a bounded share of each round.
        let bg_cap = (max_bytes / 4).max(1 << 20);
        while self.deferred.is_empty() && bg_bytes.get() < bg_cap {
            let Ok(m) = bg.try_recv() else { break };
            match m {
                Msg::Txn(t, r) => {
                    if !admit(t, r, round, &mut self.deferred) {
                        break;
                    }
                }
                other => self.take(other, round),
            }
        }
        self.keys_in_flight = in_flight_set;
    }

    /// Check, lay out and submit a round; it is published when the device says it is durable.
    /// Returns whether anything was submitted.
    fn start_round(&mut self, round: Vec<(Box<Prepared>, Reply)>) -> bool {
        if let Some(why) = &self.failed {
            for (_, r) in round {
                r.send(TxnResult::Failed(StoreError::Invalid(format!(
                    "the store stopped accepting writes after a device write failed: {why}"
                ))));
            }
            return false;
        }
        let mut accepted = Vec::new();
        let mut need = 0u64;
        for (txn, reply) in round {
            match self.check(&txn, need) {
                Ok(cur) => {
                    need += txn_bytes(&txn) + 4096;
                    let seq = self.next_op_seq;
                    self.next_op_seq += 1;
                    let n = txn.muts.len();
                    accepted.push(Accepted {
                        txn,
                        reply,
                        seq,
                        cur,
                        placed: (0..n).map(|_| Default::default()).collect(),
                        new_metas: smallvec::smallvec![None; n],
                    });
                }
                Err(CheckErr::Reply(res)) => {
                    drop(txn);
                    reply.send(res);
                }
                Err(CheckErr::WaitSpace) => {
                    let mut txn = txn;
                    let now = Instant::now();
                    txn.parked_at.get_or_insert(now);
                    let frees = {
                        let mut segs = self.sh.segs.lock().unwrap();
                        segs.last_wait = Some(now);
                        segs.frees
                    };
                    self.space_retry = SpaceRetry {
                        frees,
                        round: self.round_id,
                        at: now + SPACE_RETRY_PERIOD,
                    };
                    self.space_waiters.push((txn, reply));
                }
            }
        }
        if accepted.is_empty() {
            return false;
        }
        self.round_id += 1;
        let id = self.round_id;
        self.em.begin_round(id);
        let written = self
            .write_round(&mut accepted)
            .and_then(|()| self.em.end_round(true));
        for a in &accepted {
            for m in &a.txn.muts {
                self.keys_in_flight.insert(m.key.clone());
            }
        }
        self.inflight.push_back(InFlight {
            id,
            accepted,
            last_batch: self.log.pos.batch_seq - 1,
        });
        if let Err(e) = written {
            self.fail_inflight(e);
            return false;
        }
        true
    }

    /// A relocation out of the open log head (once it holds batches): its round opens the next
    /// segment (`StreamHead::move_on`), so it counts no room left in this one.
    fn relocates_head(&self, txn: &Prepared) -> bool {
        self.log.pos.off > 0 && txn.moves_from == Some(self.log.pos.seg)
    }

    /// Check a transaction against the index and free space. `need` is what the round already
    /// takes.
    fn check(
        &self,
        txn: &Prepared,
        need: u64,
    ) -> Result<PerMut<Option<Arc<ObjectMeta>>>, CheckErr> {
        let mut cur = PerMut::with_capacity(txn.muts.len());
        for m in &txn.muts {
            if m.state_at_apply() {
                cur.push(None);
                continue;
            }
            let now = self.sh.index.get(&m.key);
            let ok = match (m.base, &now) {
                (Base::Any, _) => true,
                (Base::Absent, None) => true,
                (Base::Seq(s), Some(meta)) => meta.state_seq == s,
                _ => false,
            };
            if !ok {
                if txn.background {
                    self.sh.stats.reloc_conflicts.inc();
                }
                return Err(CheckErr::Reply(TxnResult::Conflict));
            }
            cur.push(now);
        }
        let mut segs = self.sh.segs.lock().unwrap();
        let layout = self.log.layout;
        // Usable bytes per segment, less the tail a batch may leave unused when it moves on.
        let usable = layout.segment_bytes
            - layout.block
            - (crate::space::HEAD_ROOM_MIN_DATA + 2 * layout.block);
        let bytes = need + txn_bytes(txn) + 4096;
        let here = if self.relocates_head(txn) {
            0
        } else {
            layout.segment_bytes.saturating_sub(
                self.log.pos.off.max(layout.block) + crate::space::HEAD_ROOM_MIN_DATA,
            )
        };
        // Each segment the round moves into allocates its own successor.
        let segments = bytes.saturating_sub(here).div_ceil(usable);
        // Keep room for a checkpoint: without one, segments the cleaner emptied stay pinned.
        // One in progress (written beside the rounds) already holds some of it.
        let ckpt_taken = self.ckpt.as_ref().map_or(0, |c| {
            c.head.pos.seg_seq + u64::from(c.head.pos.next_seg != NO_SEGMENT)
        });
        let ckpt = ((self.sh.index.len() as u64 * 160).div_ceil(usable) + 1)
            .saturating_sub(ckpt_taken)
            .max(1);
        // Removes only free space (each costs a small tombstone record): they may use the
        // reserve down to one segment above the cleaner's floor, so a full store can still be
        // emptied (a deleted pool's keys, strays) instead of refusing the very transactions
        // that make room.
        let removes_only =
            !txn.muts.is_empty() && txn.muts.iter().all(|m| matches!(m.op, MutOp::Remove));
        // So may a small transaction its caller says makes room (a remove that keeps the old
        // bytes until it is settled writes a tombstone's xattrs, not a remove record); one
        // that only frees space (dropping what such removes kept) may go as far as the
        // cleaner, so no number of removes leaves it no room.
        let room = match txn.room {
            Room::Normal => Room::Normal,
            r if txn_bytes(txn) <= crate::txn::MAKES_ROOM_BYTES_MAX => r,
            _ => Room::Normal,
        };
        let floor = if txn.background || room == Room::Frees {
            ckpt
        } else if removes_only || room == Room::Makes {
            ckpt + 1
        } else {
            segs.reserve.max(ckpt + 2)
        };
        let fits = segs.free_count() >= segments + floor;
        if !fits && segments > 0 && !txn.background {
            // The head has no room for this writer, and no segment may be opened for it: the
            // cleaner may now take the head ([`crate::space::Segments::victim`]).
            segs.head_full = true;
        }
        if !fits {
            let mut r = segs.report(self.sb.replay_batch_seq.get());
            r.segments_reclaimable = segs.pinned_dead(self.sb.replay_batch_seq.get());
            // The cleaner has something to reclaim (a segment with dead data, or dead segments
            // waiting for a checkpoint): wait for it instead of failing.
            let cleanable = segs
                .victim(self.next_op_seq, crate::space::VICTIM_LIVE_MAX)
                .is_some()
                || r.segments_reclaimable > 0;
            // Nor while a checkpoint is written beside the rounds: its completion frees the
            // old checkpoint and the dead segments it pinned (a transaction checked between
            // rounds used to see that done, the checkpoint never running beside one).
            let ckpt_frees = self.ckpt.is_some();
            if !txn.background && ((self.sh.config.cleaner && cleanable) || ckpt_frees) {
                tracing::debug!(
                    free = segs.free_count(),
                    segments,
                    floor,
                    reclaimable = r.segments_reclaimable,
                    ?room,
                    "transaction waits for the cleaner"
                );
                return Err(CheckErr::WaitSpace);
            }
            tracing::debug!(
                free = segs.free_count(),
                segments,
                floor,
                bytes,
                here,
                ?room,
                background = txn.background,
                "transaction refused: out of space"
            );
            return Err(CheckErr::Reply(TxnResult::Failed(StoreError::OutOfSpace {
                device: self.sh.name.clone(),
                used: r.segments_total - r.segments_free,
                total: r.segments_total,
                reclaimable: r.segments_reclaimable,
                reserve: r.segments_reserve,
            })));
        }
        Ok(cur)
    }

    /// Lay the round out as batches at the log head and submit the writes.
    fn write_round(&mut self, acc: &mut [Accepted]) -> Result<()> {
        let block = self.log.layout.block;
        let min_room = crate::space::HEAD_ROOM_MIN_DATA + 2 * block;
        let cap_max = self.sh.config.batch_bytes_max;
        let mut items: Vec<Item> = Vec::new();
        let mut recs: Vec<usize> = Vec::new();
        let (mut meta_len, mut data_len) = (0u64, 0u64);
        let room = |log: &StreamHead| {
            let off = log.pos.off.max(block);
            let left = log.layout.segment_bytes - off;
            let left = if left < min_room || log.move_on {
                log.layout.segment_bytes - block
            } else {
                left
            };
            left.min(cap_max)
        };
        // Relocations out of the head: the round starts in the next segment.
        if acc.iter().any(|a| self.relocates_head(&a.txn)) {
            self.log.move_on = true;
        }
        let mut cap = room(&self.log);
        for t in 0..acc.len() {
            let mut txn_items: Vec<(usize, usize, usize)> = Vec::new();
            for (m, mu) in acc[t].txn.muts.iter().enumerate() {
                let MutOp::Put(p) = &mu.op else { continue };
                for (i, c) in p.chunks.iter().enumerate() {
                    if matches!(c, ChunkSrc::New(..)) {
                        txn_items.push((m, i, chunk_len(c)));
                    }
                }
                if matches!(p.xattrs, XattrSrc::New(_)) {
                    txn_items.push((m, usize::MAX, xattr_len(&p.xattrs)));
                }
            }
            {
                for (m, i, len) in txn_items {
                    let size = round_up(len as u64, block);
                    // The first chunk of an object in a batch brings an owner record, so the
                    // cleaner can find the object from the segment its data sits in.
                    let owner_len = owner_record_len(acc[t].txn.muts[m].key.name.len(), 0) as u64;
                    // Each item is listed in its object's owner record (16 bytes); the first
                    // item of an object in a batch brings the record itself.
                    let owner = |items: &Vec<Item>| {
                        if items.iter().any(|&(t2, m2, _)| (t2, m2) == (t, m)) {
                            16
                        } else {
                            owner_len + 16
                        }
                    };
                    if self
                        .log
                        .layout
                        .batch_bytes(meta_len + owner(&items), data_len + size)
                        > cap
                    {
                        self.emit_batch(acc, &mut items, &mut recs, meta_len, data_len)?;
                        (meta_len, data_len) = (0, 0);
                        cap = room(&self.log);
                    }
                    meta_len += owner(&items);
                    items.push((t, m, i));
                    data_len += size;
                }
            }
            let rl = records_len(&acc[t].txn) as u64;
            if (!recs.is_empty() || !items.is_empty())
                && self.log.layout.batch_bytes(meta_len + rl, data_len) > cap
            {
                self.emit_batch(acc, &mut items, &mut recs, meta_len, data_len)?;
                (meta_len, data_len) = (0, 0);
                cap = room(&self.log);
            }
            if self.log.layout.batch_bytes(meta_len + rl, data_len) > cap {
                return Err(StoreError::TooLarge {
                    what: "transaction metadata",
                    size: rl,
                    max: cap / 2,
                });
            }
            recs.push(t);
            meta_len += rl;
        }
        self.emit_batch(acc, &mut items, &mut recs, meta_len, data_len)
    }

    /// Place, encode and submit one batch.
    fn emit_batch(
        &mut self,
        acc: &mut [Accepted],
        items: &mut Vec<Item>,
        recs: &mut Vec<usize>,
        meta_len: u64,
        data_len: u64,
    ) -> Result<()> {
        if items.is_empty() && recs.is_empty() {
            return Ok(());
        }
        let layout = self.log.layout;
        let bytes = layout.batch_bytes(meta_len, data_len);
        let placement = place_batch(&self.sh, &mut self.log, &mut self.em, bytes)?;
        let data_start = placement.offset + round_up(64 + meta_len, layout.block);
        // Place the data items; the owner records list them with their CRCs (computed by the
        // preparer), which is how replay verifies the data area.
        let mut at = data_start;
        let mut placed_items: Vec<ChunkRef> = Vec::with_capacity(items.len());
        for &(t, m, i) in items.iter() {
            let len = item_len(&acc[t], m, i) as u64;
            let r = ChunkRef {
                offset: at.into(),
                len: (len as u32).into(),
                crc: item_crc(&acc[t], m, i).into(),
            };
            placed_items.push(r);
            let (chunks, xattr) = &mut acc[t].placed[m];
            if i == usize::MAX {
                *xattr = r;
            } else {
                if chunks.len() <= i {
                    chunks.resize(i + 1, ChunkRef::default());
                }
                chunks[i] = r;
            }
            at += round_up(len, layout.block);
        }
        debug_assert_eq!(at - data_start, data_len);
        let mut meta = Vec::with_capacity(meta_len as usize);
        let mut count = 0u32;
        let mut owners: Vec<(usize, usize)> = Vec::new();
        for &(t, m, _) in items.iter() {
            if !owners.contains(&(t, m)) {
                owners.push((t, m));
                let refs: SmallVec<[ChunkRef; 4]> = items
                    .iter()
                    .zip(&placed_items)
                    .filter(|((t2, m2, _), _)| (*t2, *m2) == (t, m))
                    .map(|(_, r)| *r)
                    .collect();
                encode_owner(&acc[t].txn.muts[m].key, acc[t].seq, &refs, &mut meta);
                count += 1;
            }
        }
        for &t in recs.iter() {
            count += self.encode_txn(&mut acc[t], &mut meta);
        }
        debug_assert_eq!(meta.len() as u64, meta_len);
        let h = batch_header(
            self.log.stream_id,
            self.log.pos.batch_seq - 1,
            self.log.gen,
            count,
            &meta,
            data_len,
            0,
            self.durable_through,
        );
        self.em.begin(placement.offset)?;
        self.em.put(h.as_bytes())?;
        self.em.put(&meta)?;
        self.em.pad_to_block()?;
        // Data items in order: copied ones stream into staging buffers, DMA ones go out as
        // their own writes (a copied item after a DMA one starts a new run at its offset).
        let mut at = data_start;
        let mut in_run = true;
        for (k, &(t, m, i)) in items.iter().enumerate() {
            let len = item_len(&acc[t], m, i) as u64;
            if item_is_dma_part(&acc[t], m, i) {
                // Written with the run's first chunk.
                at += round_up(len, layout.block);
                continue;
            }
            if let Some((buf, run)) = item_dma(&mut acc[t], m, i) {
                // The run's chunks in this batch: all of them unless the batch ends inside
                // the run; then the rest go to the next batch as copies (at most one run
                // per batch is cut).
                let here = 1 + items[k + 1..]
                    .iter()
                    .take(run - 1)
                    .enumerate()
                    .take_while(|&(j, &it)| it == (t, m, i + 1 + j))
                    .count();
                let cb = len as usize;
                let mut buf = buf;
                if here < run {
                    self.split_run(&mut acc[t], m, i, &mut buf, here, run, cb);
                }
                self.em
                    .write_dma(at, buf, round_up((here * cb) as u64, layout.block) as usize)?;
                in_run = false;
            } else {
                if !in_run {
                    self.em.begin(at)?;
                    in_run = true;
                }
                self.em.put(item_bytes(&acc[t], m, i))?;
                self.em.pad_to_block()?;
            }
            at += round_up(len, layout.block);
        }
        self.log_bytes_since_ckpt += bytes;
        self.sh.stats.batches.inc();
        items.clear();
        recs.clear();
        Ok(())
    }

    /// A batch ends inside the DMA run that starts at chunk `i` (`run` whole chunks of `cb`
    /// bytes in `buf`, of which the first `here` are written now): the rest become a run of
    /// their own for the next batch. Split off `buf` where the cut falls on a page (always,
    /// for chunks of 4 KiB or more: no copy on the commit thread, which would hold up this
    /// batch's write); else copied once into a pooled DMA buffer, or without DMA memory to
    /// spare into owned copies. `buf` then keeps the first `here` chunks and goes out with
    /// this batch's write.
    #[allow(clippy::too_many_arguments)]
    fn split_run(
        &self,
        a: &mut Accepted,
        m: usize,
        i: usize,
        buf: &mut DmaBuf,
        here: usize,
        run: usize,
        cb: usize,
    ) {
        let MutOp::Put(p) = &mut a.txn.muts[m].op else {
            unreachable!("a run belongs to a put")
        };
        let rest = run - here;
        let at = here * cb;
        let tail = if at.is_multiple_of(4096) && at < buf.len() {
            Ok(buf.split_off(at))
        } else {
            self.sh.dev.alloc_read_buf(rest * cb).map(|mut tail| {
                tail.copy_from(0, buf, at, rest * cb);
                tail
            })
        };
        if let Ok(tail) = tail {
            if let Some(ChunkSrc::New(d @ DataRef::DmaPart(_), _)) = p.chunks.get_mut(i + here) {
                *d = DataRef::Dma {
                    buf: Some(tail),
                    len: d.len(),
                    run: rest,
                };
            }
            return;
        }
        for j in here..run {
            if let Some(ChunkSrc::New(d @ DataRef::DmaPart(_), _)) = p.chunks.get_mut(i + j) {
                let mut v = vec![0u8; d.len()];
                buf.read_at(j * cb, &mut v);
                *d = DataRef::Owned(v);
            }
        }
    }

    /// Build the new states of a transaction's objects and encode their records.
    fn encode_txn(&self, a: &mut Accepted, out: &mut Vec<u8>) -> u32 {
        let now = now_ns();
        for (m, mu) in a.txn.muts.iter().enumerate() {
            match &mu.op {
                MutOp::Remove => {
                    encode_remove(&mu.key, a.seq, a.seq, out);
                }
                MutOp::Put(p) => {
                    let (placed, placed_x) = &a.placed[m];
                    let chunks: crate::meta::Chunks = p
                        .chunks
                        .iter()
                        .enumerate()
                        .map(|(i, c)| match c {
                            ChunkSrc::Keep(r) => *r,
                            ChunkSrc::Hole => ChunkRef::default(),
                            ChunkSrc::New(..) => placed[i],
                        })
                        .collect();
                    let xattrs = match &p.xattrs {
                        XattrSrc::Keep(r) => *r,
                        XattrSrc::Current => {
                            a.cur[m].as_ref().map(|c| c.xattrs).unwrap_or_default()
                        }
                        XattrSrc::New(_) => *placed_x,
                        XattrSrc::None => ChunkRef::default(),
                    };
                    let cur = a.cur[m].as_ref();
                    let (version, mtime) = match (p.relocation, cur) {
                        (true, Some(c)) => (c.version, c.mtime_unix_ns),
                        _ => (a.seq, now),
                    };
                    let meta = ObjectMeta {
                        version,
                        state_seq: a.seq,
                        size: p.size,
                        mtime_unix_ns: mtime,
                        data_crc: p.data_crc,
                        chunks,
                        xattrs,
                    };
                    encode_state(&mu.key, &meta, out);
                    a.new_metas[m] = Some(Arc::new(meta));
                }
            }
        }
        a.txn.muts.len() as u32
    }

    /// Publish the durable round: index, segment liveness, waiters.
    fn apply(&mut self, accepted: Vec<Accepted>) {
        let layout = self.log.layout;
        let block = layout.block;
        let live = |r: &ChunkRef| {
            (r.len.get() > 0).then(|| {
                (
                    layout.segment_of(r.offset.get()),
                    round_up(r.len.get() as u64, block),
                )
            })
        };
        let mut user_bytes = 0u64;
        self.sh.stats.round_txns.record(accepted.len() as u64);
        for a in accepted {
            {
                let mut segs = self.sh.segs.lock().unwrap();
                // Count the new states before releasing the old: kept chunks must never make
                // their segment look empty (and get freed) in between — a renamed object's
                // chunks are released by one key and counted by another.
                for new in a.new_metas.iter().flatten() {
                    for (seg, n) in new.chunks.iter().chain([&new.xattrs]).filter_map(live) {
                        segs.add_live(seg, n, a.seq);
                    }
                }
                for (m, mu) in a.txn.muts.iter().enumerate() {
                    if let Some(old) = &a.cur[m] {
                        for (seg, n) in old.chunks.iter().chain([&old.xattrs]).filter_map(live) {
                            segs.sub_live(seg, n);
                        }
                    }
                    if let MutOp::Put(p) = &mu.op {
                        let n: u64 = p.chunks.iter().map(|c| chunk_len(c) as u64).sum();
                        if p.relocation {
                            self.sh.stats.relocated_bytes.add(n);
                        } else {
                            user_bytes += n;
                        }
                    }
                }
            }
            // States replaced by mutations that did not look them up at the check: released
            // now, after the new states were counted above.
            let mut replaced = Vec::new();
            for (m, mu) in a.txn.muts.iter().enumerate() {
                let old = match &a.new_metas[m] {
                    Some(meta) => self.sh.index.put(&mu.key, meta.clone()),
                    None => self.sh.index.remove(&mu.key),
                };
                if let Some(old) = old.filter(|_| mu.state_at_apply()) {
                    replaced.push(old);
                }
            }
            if !replaced.is_empty() {
                let mut segs = self.sh.segs.lock().unwrap();
                for old in &replaced {
                    for (seg, n) in old.chunks.iter().chain([&old.xattrs]).filter_map(live) {
                        segs.sub_live(seg, n);
                    }
                }
            }
            let version = a.seq;
            // Drop the transaction (and the caller memory it borrows) before releasing the caller.
            let Accepted { txn, reply, .. } = a;
            let background = txn.background;
            drop(txn);
            if !background {
                self.sh.stats.txns.inc();
            }
            reply.send(TxnResult::Committed { version });
        }
        self.sh.stats.user_bytes.add(user_bytes);
        self.sh.stats.rounds.inc();
        self.publish_stats();
    }

    fn publish_stats(&self) {
        let s = &self.sh.stats;
        s.device_bytes_written.set(self.em.bytes_written);
        s.flushes.set(self.em.flushes);
        s.fua_rounds.set(self.em.fua_rounds);
        s.next_op_seq.set(self.next_op_seq);
        s.replay_start_batch.set(self.sb.replay_batch_seq.get());
        s.log_head_batch.set(self.log.pos.batch_seq);
    }

    fn checkpoint_due(&mut self) -> bool {
        if self.sb.flags.get() & crate::format::SB_FLAG_NO_CHECKPOINTS != 0 {
            for r in self.ckpt_requests.drain(..) {
                let _ = r.send(Err(StoreError::Invalid(
                    "checkpoints are disabled on this store".into(),
                )));
            }
            return false;
        }
        if !self.ckpt_requests.is_empty() {
            return true;
        }
        // After `checkpoint_interval_bytes` of log, or after as much log as the last checkpoint
        // took, whichever is more. A checkpoint costs its size in device writes and a walk of
        // the whole index, however little changed: with the interval alone, a node of 10 M
        // objects (~1.3 GB of checkpoint) would write five times more checkpoint than log.
        // So checkpoints write about as much as the log they cover, and a restart replays
        // about the larger of the interval and one checkpoint's size (see `lead`).
        let due_after = self
            .sh
            .config
            .checkpoint_interval_bytes
            .max(self.last_ckpt_bytes);
        // A restart replays from where the newest complete checkpoint began: the log due
        // before it plus what the rounds wrote while it was written. So the next one begins
        // that much early (as the last one measured it; at most half the bound, so checkpoints
        // still write no more than about twice the log they cover).
        let lead = self.last_ckpt_log_during.min(due_after / 2);
        if self.log_bytes_since_ckpt + lead >= due_after {
            return true;
        }
        // The cleaner freed segments that only a checkpoint can release.
        let segs = self.sh.segs.lock().unwrap();
        let pinned = segs.pinned_dead(self.sb.replay_batch_seq.get());
        pinned > 0 && segs.free_count() < segs.reserve * 3 && self.log_bytes_since_ckpt > 0
    }

    fn checkpoint_begin(&mut self) {
        if self.failed.is_some() {
            return;
        }
        if self.encoder.is_none() {
            let meta_max = ckpt_batch_max(&self.log.layout) as usize - (68 << 10);
            match Encoder::start(self.sh.clone(), meta_max) {
                Ok(e) => self.encoder = Some(e),
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the checkpoint encoder");
                    for r in self.ckpt_requests.drain(..) {
                        let _ = r.send(Err(StoreError::Invalid(format!(
                            "cannot start the checkpoint encoder: {e}"
                        ))));
                    }
                    return;
                }
            }
        }
        let first = {
            let mut segs = self.sh.segs.lock().unwrap();
            segs.alloc(true)
        };
        let Some(first) = first else {
            tracing::error!("no segment free for a checkpoint");
            for r in self.ckpt_requests.drain(..) {
                let _ = r.send(Err(StoreError::Invalid(
                    "no free segment for a checkpoint".into(),
                )));
            }
            return;
        };
        let id = rand::random::<u64>() | 1;
        let head = StreamHead {
            layout: self.log.layout,
            stream_id: id,
            kind: SEGMENT_CHECKPOINT,
            gen: self.log.gen,
            pos: Pos {
                seg: first,
                off: 0,
                seg_seq: 1,
                batch_seq: 1,
                next_seg: NO_SEGMENT,
            },
            use_reserve: true,
            move_on: false,
        };
        self.ckpt = Some(Checkpointing {
            id,
            head,
            start: self.log.pos,
            next_op_seq: self.next_op_seq,
            first_seg: first,
            walked: false,
            batches: 0,
            objects: 0,
            bytes: 0,
            waiters: std::mem::take(&mut self.ckpt_requests),
        });
        self.encoder.as_ref().unwrap().begin(id);
        self.log_bytes_since_ckpt = 0;
    }

    /// Advance the checkpoint: write the batches the encoder has ready (one when rounds are on
    /// the device, `busy`, so a round never waits behind several; all of them otherwise), or
    /// `got`, one the loop already received; with `block`, wait for the next one (shutdown).
    /// Once the last batch is written and nothing is in flight, complete it.
    fn checkpoint_step(&mut self, busy: bool, got: Option<Encoded>, block: bool) {
        let res = match &self.failed {
            // A failed log write may have taken a checkpoint batch with it.
            Some(why) => Err(StoreError::Invalid(format!("the store failed: {why}"))),
            None if self.ckpt.as_ref().unwrap().walked => {
                if self.inflight.is_empty() {
                    self.checkpoint_complete()
                } else {
                    Ok(false)
                }
            }
            None => self.checkpoint_take(busy, got, block).map(|()| false),
        };
        match res {
            Ok(false) => {}
            Ok(true) => {
                let c = self.ckpt.take().unwrap();
                self.last_ckpt_bytes = c.bytes;
                self.last_ckpt_log_during = self.log_bytes_since_ckpt;
                self.sh.stats.checkpoints.inc();
                for w in c.waiters {
                    let _ = w.send(Ok(()));
                }
            }
            Err(e) => {
                let why = e.to_string();
                tracing::error!(error = %why, "checkpoint failed");
                let c = self.ckpt.take().unwrap();
                if let Some(enc) = &self.encoder {
                    enc.cancel();
                }
                {
                    let mut segs = self.sh.segs.lock().unwrap();
                    segs.free_checkpoint(c.id);
                    if segs.infos[c.first_seg as usize].state == SegState::Reserved {
                        segs.set_state(c.first_seg, SegState::Free);
                    }
                }
                for w in c.waiters {
                    let _ = w.send(Err(StoreError::Invalid(format!(
                        "checkpoint failed: {why}"
                    ))));
                }
                // A device that failed a checkpoint write fails the store's writes as a
                // failed log write does; the transactions waiting for the segments this
                // checkpoint was to free get that error now, not `OutOfSpace` in 30 s.
                // (Requeued, the next round refuses them as it refuses every transaction of a
                // failed store.) Rounds on the device beside it fail with it.
                if matches!(e, StoreError::Device(_)) {
                    self.fail_inflight(e);
                    self.failed = Some(format!("checkpoint write failed: {why}"));
                    self.deferred
                        .extend(std::mem::take(&mut self.space_waiters));
                }
            }
        }
    }

    /// Write the encoder's batches as [`Committer::checkpoint_step`] says.
    fn checkpoint_take(&mut self, busy: bool, mut got: Option<Encoded>, block: bool) -> Result<()> {
        use crossbeam::channel::TryRecvError;
        let stopped = || StoreError::Invalid("the checkpoint encoder stopped".into());
        loop {
            let batch = match got.take() {
                Some(b) => b,
                None => {
                    let out = self.encoder.as_ref().unwrap().out();
                    if block {
                        out.recv().map_err(|_| stopped())?
                    } else {
                        match out.try_recv() {
                            Ok(b) => b,
                            Err(TryRecvError::Empty) => return Ok(()),
                            Err(TryRecvError::Disconnected) => return Err(stopped()),
                        }
                    }
                }
            };
            let c = self.ckpt.as_ref().unwrap();
            if batch.id != c.id {
                // A cancelled checkpoint's.
                self.encoder.as_ref().unwrap().recycle(batch.meta);
                continue;
            }
            let last = batch.last;
            self.checkpoint_write(batch)?;
            if last || busy || block {
                return Ok(());
            }
        }
    }

    /// Write one encoded batch as its own round of the emitter. Nothing waits on that round:
    /// the checkpoint's completion flushes it.
    fn checkpoint_write(&mut self, batch: Encoded) -> Result<()> {
        let Encoded {
            meta, count, last, ..
        } = batch;
        let c = self.ckpt.as_mut().unwrap();
        c.walked = last;
        if count > 0 {
            let bytes = c.head.layout.batch_bytes(meta.len() as u64, 0);
            self.round_id += 1;
            self.em.begin_round(self.round_id);
            let (sh, em) = (&self.sh, &mut self.em);
            let wrote = (|| {
                let placement = place_batch(sh, &mut c.head, em, bytes)?;
                let h = batch_header(
                    c.id,
                    c.head.pos.batch_seq - 1,
                    c.head.gen,
                    count,
                    &meta,
                    0,
                    0,
                    0,
                );
                em.begin(placement.offset)?;
                em.put(h.as_bytes())?;
                em.put(&meta)?;
                em.pad_to_block()
            })();
            // Ended either way, so nothing of it is left to go out with the next round.
            let ended = self.em.end_round(false);
            wrote.and(ended)?;
            c.batches += 1;
            c.objects += count as u64;
            c.bytes += bytes;
        }
        self.encoder.as_ref().unwrap().recycle(meta);
        Ok(())
    }

    /// Every batch is written and nothing is in flight: make them durable, then point the
    /// superblocks at the checkpoint. Returns Ok(true): the checkpoint is complete and durable.
    fn checkpoint_complete(&mut self) -> Result<bool> {
        self.em.flush()?;
        let c = self.ckpt.as_ref().unwrap();
        let mut sb = self.sb;
        let old_id = sb.ckpt_id.get();
        let had_old = sb.ckpt_segment.get() != NO_SEGMENT;
        sb.sb_seq = (sb.sb_seq.get() + 1).into();
        if c.batches == 0 {
            sb.ckpt_segment = NO_SEGMENT.into();
        } else {
            sb.ckpt_segment = c.first_seg.into();
        }
        sb.ckpt_batches = c.batches.into();
        sb.ckpt_id = c.id.into();
        sb.ckpt_objects = c.objects.into();
        sb.replay_segment = c.start.seg.into();
        sb.replay_offset = (c.start.off as u32).into();
        sb.replay_batch_seq = c.start.batch_seq.into();
        sb.replay_segment_seq = c.start.seg_seq.into();
        // The replay start is this open's head (or later): no batch from there on is older
        // than this generation, whatever stale ones a crashed earlier open left behind it.
        sb.replay_gen = sb.gen;
        sb.next_op_seq = c.next_op_seq.into();
        // Both copies, one after the other: a torn write leaves the other copy (the previous
        // state, still whole: the old checkpoint is freed only below), and once both are
        // written, rot in either copy leaves the other saying the same.
        for i in 0..2 {
            if i == 1 {
                sb.sb_seq = (sb.sb_seq.get() + 1).into();
            }
            sb.seal();
            let copy = SUPERBLOCK_OFFSETS[(sb.sb_seq.get() % 2) as usize];
            self.em.write_fua(&self.sh.dev, copy, sb.as_bytes())?;
        }
        self.sb = sb;
        let mut segs = self.sh.segs.lock().unwrap();
        if c.batches == 0 {
            segs.free_checkpoint(c.id);
            if segs.infos[c.first_seg as usize].state == SegState::Reserved {
                segs.set_state(c.first_seg, SegState::Free);
            }
        }
        // The new chain's reserved next segment is never opened: release it.
        let next = c.head.pos.next_seg;
        if c.batches > 0
            && (next as u64) < segs.count()
            && segs.infos[next as usize].state == SegState::Reserved
        {
            segs.set_state(next, SegState::Free);
        }
        if had_old {
            segs.free_checkpoint(old_id);
        }
        segs.set_replay_start(sb.replay_batch_seq.get(), sb.replay_segment.get());
        segs.reclaim(self.log.pos.seg);
        Ok(true)
    }
}

/// Largest checkpoint batch.
fn ckpt_batch_max(layout: &crate::stream::Layout) -> u64 {
    (1u64 << 20).min(layout.segment_bytes / 2)
}

/// Reserve room for a batch at a stream's head; when that opens a segment, queue the segment
/// header write first.
fn place_batch<D: BlockDevice>(
    sh: &Shared<D>,
    head: &mut StreamHead,
    em: &mut Emitter<D>,
    bytes: u64,
) -> Result<crate::stream::Placement> {
    let placement = {
        let mut segs = sh.segs.lock().unwrap();
        head.place(bytes, &mut segs, now_ns())?
    };
    if let Some((at, h)) = placement.segment_header {
        em.begin(at)?;
        em.put(h.as_bytes())?;
        em.pad_to_block()?;
    }
    Ok(placement)
}

fn chunk_len(c: &ChunkSrc) -> usize {
    match c {
        ChunkSrc::New(d, _) => d.len(),
        _ => 0,
    }
}

/// Length of a data item.
fn item_len(a: &Accepted, m: usize, i: usize) -> usize {
    let MutOp::Put(p) = &a.txn.muts[m].op else {
        unreachable!("data item of a remove")
    };
    match p.chunks.get(i) {
        Some(c) if i != usize::MAX => chunk_len(c),
        _ => xattr_len(&p.xattrs),
    }
}

/// Take a data item's DMA buffer, if it has one, and the chunks it holds.
fn item_dma(a: &mut Accepted, m: usize, i: usize) -> Option<(DmaBuf, usize)> {
    let MutOp::Put(p) = &mut a.txn.muts[m].op else {
        return None;
    };
    match p.chunks.get_mut(i) {
        Some(ChunkSrc::New(DataRef::Dma { buf, run, .. }, _)) => buf.take().map(|b| (b, *run)),
        _ => None,
    }
}

/// Whether a data item's bytes sit in an earlier chunk's run buffer.
fn item_is_dma_part(a: &Accepted, m: usize, i: usize) -> bool {
    let MutOp::Put(p) = &a.txn.muts[m].op else {
        return false;
    };
    matches!(p.chunks.get(i), Some(ChunkSrc::New(DataRef::DmaPart(_), _)))
}

fn xattr_len(x: &XattrSrc) -> usize {
    match x {
        XattrSrc::New(v) => v.len(),
        _ => 0,
    }
}

/// The CRC of a data item: prepared for chunks, computed here for xattr maps (small).
fn item_crc(a: &Accepted, m: usize, i: usize) -> u32 {
    let MutOp::Put(p) = &a.txn.muts[m].op else {
        unreachable!("data item of a remove")
    };
    match p.chunks.get(i) {
        Some(ChunkSrc::New(_, crc)) => *crc,
        _ => crate::data_crc(item_bytes(a, m, i)),
    }
}

fn item_bytes(a: &Accepted, m: usize, i: usize) -> &[u8] {
    let MutOp::Put(p) = &a.txn.muts[m].op else {
        unreachable!("data item of a remove")
    };
    if i == usize::MAX {
        let XattrSrc::New(v) = &p.xattrs else {
            unreachable!("xattr item without xattrs")
        };
        return v;
    }
    match &p.chunks[i] {
        ChunkSrc::New(d, _) => d.bytes(),
        _ => unreachable!("data item of a kept chunk"),
    }
}

/// Bytes a transaction writes (data, padded loosely, plus records).
fn txn_bytes(t: &Prepared) -> u64 {
    let mut n = records_len(t) as u64;
    for m in &t.muts {
        if let MutOp::Put(p) = &m.op {
            n += p
                .chunks
                .iter()
                .map(|c| round_up(chunk_len(c) as u64, 4096))
                .sum::<u64>();
            n += round_up(xattr_len(&p.xattrs) as u64, 4096);
        }
    }
    n
}

fn records_len(t: &Prepared) -> usize {
    t.muts
        .iter()
        .map(|m| match &m.op {
            MutOp::Remove => remove_record_len(m.key.name.len()),
            MutOp::Put(p) => state_record_len(m.key.name.len(), p.chunks.len()),
        })
        .sum()
}

/// How long a thread blocked in `Store::commit` on a transaction of at most
/// [`ARRIVAL_YIELD_TXN_BYTES_MAX`] yields the CPU before it parks: the lone put's latency
/// budget. Parked, a waiter costs the commit thread a wake-up (a system call and, on a
/// virtual machine, often an interrupt to another CPU) and comes back a scheduler wake-up
/// later; yielding, it is answered by a store to memory and submits its next transaction
/// at once, in time for the next round. On the 49th stop's 2-vCPU host, 32 writers of 4 KiB
/// puts: parking at once 48–54 k puts/s and 23–24 puts per flush; yielding for 1 ms 56–58 k
/// and 26 (0.90–0.94× fio against 0.77–0.79×); never parking 60–63 k and 31–32. A lone
/// writer on an idle host spins for its put's wait (~0.1–0.2 ms); a wait longer than this
/// (a big round ahead, the cleaner freeing space) sleeps. Large transactions and the
/// cleaner's park at once: their waits are the device's.
pub(crate) const COMMIT_WAIT_YIELD: Duration = Duration::from_millis(1);

/// What a thread waiting for `txn` yields for before parking.
pub(crate) fn wait_yield(txn: &Prepared) -> Duration {
    if txn_bytes(txn) <= ARRIVAL_YIELD_TXN_BYTES_MAX {
        COMMIT_WAIT_YIELD
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(v: u64) -> TxnResult {
        TxnResult::Committed { version: v }
    }

    fn version(r: std::result::Result<TxnResult, ()>) -> Option<u64> {
        match r {
            Ok(TxnResult::Committed { version }) => Some(version),
            _ => None,
        }
    }

    #[test]
    fn a_waiter_gets_its_answer_whether_it_yields_or_parks() {
        // Answered at once, within the yield; answered long after it (parked, then woken);
        // parking at once.
        for (yield_for, answer_after) in [
            (Duration::from_millis(50), Duration::ZERO),
            (Duration::from_millis(1), Duration::from_millis(30)),
            (Duration::ZERO, Duration::from_millis(5)),
        ] {
            let (reply, waiter) = reply_pair();
            let t = std::thread::spawn(move || {
                std::thread::sleep(answer_after);
                reply.send(committed(7));
            });
            assert_eq!(version(waiter.recv_yielding(yield_for)), Some(7));
            t.join().unwrap();
        }
    }

    #[test]
    fn a_reply_dropped_unanswered_wakes_its_parked_waiter_with_an_error() {
        let (reply, waiter) = reply_pair();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(reply);
        });
        assert!(waiter.recv_yielding(Duration::from_millis(1)).is_err());
        t.join().unwrap();
    }

    #[test]
    fn only_small_transactions_yield_before_parking() {
        let put = |bytes: usize| Prepared {
            muts: vec![Mut {
                key: ObjectKey::new(1, "o", 0),
                base: Base::Any,
                op: MutOp::Put(PutState {
                    size: bytes as u64,
                    data_crc: 0,
                    chunks: vec![ChunkSrc::New(DataRef::Owned(vec![0; bytes]), 0)],
                    xattrs: XattrSrc::None,
                    relocation: false,
                }),
            }],
            background: false,
            room: Room::Normal,
            moves_from: None,
            parked_at: None,
        };
        assert_eq!(wait_yield(&put(4096)), COMMIT_WAIT_YIELD);
        assert_eq!(wait_yield(&put(1 << 20)), Duration::ZERO);
    }
}
