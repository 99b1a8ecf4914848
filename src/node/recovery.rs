//! Recovery and backfill: bring every up member of the PGs this node leads back to the
//! objects' current versions, using the bandwidth clients leave idle.
//!
//! **When.** The `node-recovery` thread plans a *pass* over every PG this node is primary of
//! whenever a node changes state in the map (`MonClient::node_change_epoch`), when the set of
//! pools changes, at start, and again (after [`RETRY_PAUSE`]) for a PG whose pass failed.
//!
//! **What (planning a PG).** Every up member sends its PG log window and its *mark*
//! (`MSG_PG_LOG`): the mark says "my shards of slot s are complete through version V", written
//! by the primary (`MSG_PG_MARK`) at the end of each pass that left the member current. For
//! each up member X:
//! * **delta**: X's mark is for the slot X holds now, and every other up member with such a
//!   mark still has its log back to X's V (the window was not trimmed past it). The objects to
//!   check are those in the other members' logs after V that X's own log lacks — only the
//!   writes X missed, no scan.
//! * **backfill** otherwise (no mark: a new member after a remap; the slot changed; the logs
//!   were trimmed past V): every up member lists its shards of the PG (`MSG_SHARD_LIST`) and
//!   the objects whose newest version X's slot does not hold are checked.
//!
//! **How (one object).** On a `node-rebuild-N` worker, holding the PG's op lock (the same
//! `PgCache` mutex client ops hold, so a client write to the object waits, and vice versa):
//! `resolve` the object afresh; for every up slot not current, read k current shards
//! (`MSG_RECOVERY_READ`), `Codec::reconstruct` the missing ones, and send whole-shard writes
//! at the object's version with its meta and xattrs (`MSG_RECOVERY_WRITE`; a member already at
//! or past that version skips it). Afterwards `resolve` sees the slots current.
//!
//! **Rate.** The number of object rebuilds in flight (the window) follows AIMD on this node's
//! client-op latency: every [`TICK`], with no client ops it goes to the maximum; with client
//! ops it grows by one unless their p90 latency exceeds [`LATENCY_RISE`] × the baseline (the p90
//! measured while recovery was idle, or the lowest recent one), then it halves; at one
//! rebuild in flight a pause before each rebuild doubles instead (20..500 ms: a shorter one is
//! small next to a rebuild under load, which takes tens of ms), and shrinks by a quarter per
//! tick within the bound (halving it let recovery double its rate every tick and overshoot
//! again: `bench recovery`'s client p99 was a median 2.8× the baseline over four runs, 2.05×
//! over five with these two changes). With nothing to
//! rebuild it rests at one while clients are busy (a recovery starting under load starts
//! narrow) and at [`WINDOW_START`] otherwise. On the
//! members, recovery messages go to their own queue served by `node-rshard-N` threads that
//! stand aside while client shard ops wait, so a client op never queues behind recovery.
//! Recovery's threads run at nice [`RECOVERY_NICE`], so where they compete with client work
//! for CPU the scheduler favours the clients.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ec::Shard;
use messenger::{Incoming, Payload, SendBuf};
use serde::{Deserialize, Serialize};
use store::ObjectKey;
use tracing::{debug, info};

use super::local::{ShardWrite, WriteKind, BASE_ANY, SHARD_ROLLBACK_BIT};
use super::primary::{remember, Ctx, PgCache};
use super::Node;
use crate::error::{Error, Result};
use crate::placement::pg_of;
use crate::queue::WaitQueue;
use crate::wire::{self, Dec, Enc, Status};

/// Worker threads rebuilding objects (`node-rebuild-N`); the window never exceeds it.
pub const RECOVERY_THREADS: usize = 16;
/// Threads serving recovery messages on a member (`node-rshard-N`).
pub const RECOVERY_SHARD_THREADS: usize = 4;
const WINDOW_MIN: usize = 1;
const WINDOW_MAX: usize = RECOVERY_THREADS;
pub const WINDOW_START: usize = 4;
/// The controller's period.
pub const TICK: Duration = Duration::from_millis(200);
/// How often a primary advances its members' marks over the writes they all acknowledged,
/// so a member that goes down later is caught up by delta from a recent mark.
const MARK_REFRESH: Duration = Duration::from_secs(2);
/// Client latency (p90 of a tick) above this multiple of the baseline halves the window.
/// 1.15 rather than 1.25: the goal is on the clients' p99, which a p90 within 1.25× still let
/// rise to a median 2.33× of its baseline over seven `bench recovery` runs, against 1.83× at
/// 1.15, for ~16 % less rebuild under load (docs/benchmarks.md, twenty-fourth stop).
const LATENCY_RISE: f64 = 1.15;
/// Client latencies kept per tick for the p90.
const LATENCY_SAMPLES_MAX: usize = 4096;
/// Range of the pause before each rebuild when one in flight is still too many.
const PAUSE_MS_MIN: u64 = 20;
const PAUSE_MS_MAX: u64 = 500;
/// ... and only if it is at least this much above it (noise on a quiet node).
const LATENCY_RISE_FLOOR_US: f64 = 250.0;
/// Ticks of client latency means kept for the fallback baseline (their minimum).
const LATENCY_HISTORY_TICKS: usize = 50;
/// A PG whose pass failed is planned again after this pause.
pub const RETRY_PAUSE: Duration = Duration::from_secs(2);
/// Attempts at one object's rebuild when clients keep writing it.
const REBUILD_ATTEMPTS_MAX: u32 = 3;
/// Entries one `MSG_SHARD_LIST` reply carries at most.
const LIST_PAGE_MAX: u32 = 4096;
/// Longest a recovery message waits for client shard ops to drain before it runs anyway.
const YIELD_MAX: Duration = Duration::from_millis(20);

/// Recovery progress and counters, as a node reports them in its heartbeat (and the monitor
/// sums them in its status report).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq)]
#[serde(default)]
pub struct RecoveryStats {
    /// PGs waiting to be planned or with a pass running.
    pub pgs_pending: u64,
    /// Objects queued for rebuild and not yet done.
    pub objects_left: u64,
    /// Estimated shard bytes those objects will write.
    pub bytes_left: u64,
    pub objects_done: u64,
    /// Shard bytes written by recovery.
    pub bytes_done: u64,
    /// Recent rebuild rate (shard bytes written per second).
    pub rate_bytes_s: f64,
    /// Objects / shard bytes rebuilt for members caught up from the PG logs.
    pub delta_objects: u64,
    pub delta_bytes: u64,
    /// Objects / shard bytes rebuilt for members found behind by a full scan.
    pub backfill_objects: u64,
    pub backfill_bytes: u64,
    /// Object rebuilds that failed (retried with their PG's next pass).
    pub failures: u64,
    /// The current window (rebuilds in flight allowed); the maximum over nodes in a report.
    pub window: u64,
    /// When this node last finished rebuilding an object (Unix ms; 0: never); the latest
    /// over nodes in a report. Benchmarks time a rebuild's end by it rather than by when a
    /// status poll first saw nothing left (which lags by up to a heartbeat).
    pub last_done_unix_ms: u64,
}

impl RecoveryStats {
    /// Add another node's stats (rates and counters sum; the window is the largest).
    pub fn add(&mut self, o: &RecoveryStats) {
        self.pgs_pending += o.pgs_pending;
        self.objects_left += o.objects_left;
        self.bytes_left += o.bytes_left;
        self.objects_done += o.objects_done;
        self.bytes_done += o.bytes_done;
        self.rate_bytes_s += o.rate_bytes_s;
        self.delta_objects += o.delta_objects;
        self.delta_bytes += o.delta_bytes;
        self.backfill_objects += o.backfill_objects;
        self.backfill_bytes += o.backfill_bytes;
        self.failures += o.failures;
        self.window = self.window.max(o.window);
        self.last_done_unix_ms = self.last_done_unix_ms.max(o.last_done_unix_ms);
    }

    pub fn active(&self) -> bool {
        self.pgs_pending > 0 || self.objects_left > 0
    }

    /// Seconds until done at the current rate, if it can be told.
    pub fn eta_s(&self) -> Option<f64> {
        (self.rate_bytes_s > 0.0 && self.bytes_left > 0)
            .then(|| self.bytes_left as f64 / self.rate_bytes_s)
    }
}

/// Per up slot: object name → (version, size, deleted) of that slot's shard on its member.
type MemberLists = HashMap<usize, HashMap<Vec<u8>, (u64, u64, bool)>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Delta,
    Backfill,
}

/// One PG's pass: what it found, and what to record when every object is done.
struct Pass {
    pool: u64,
    pg: u32,
    members: Vec<Option<u32>>,
    /// `MonClient::node_change_epoch` when planned.
    node_change_epoch: u64,
    /// Slots that were up when planned: each gets the mark at `version` if the pass succeeds.
    up_slots: Vec<usize>,
    version: u64,
    /// `PgCache::skipped` before the members' logs were asked for.
    skipped: u64,
    left: AtomicUsize,
    failed: AtomicBool,
}

struct Item {
    pass: Arc<Pass>,
    name: Vec<u8>,
    path: Path,
    /// Estimated shard bytes.
    bytes: u64,
}

#[derive(Default)]
struct Control {
    window: usize,
    /// Pause before each rebuild once the window is down to one and clients still suffer.
    pause_ms: u64,
    inflight: usize,
}

#[derive(Default)]
struct Latency {
    /// This tick's client-op latencies (at most `LATENCY_SAMPLES_MAX`).
    samples: Vec<f64>,
    /// p90 while recovery was idle (EWMA).
    idle_baseline_us: Option<f64>,
    history: VecDeque<f64>,
}

/// A node's recovery state.
pub struct Recovery {
    items: WaitQueue<Item>,
    ctl: Mutex<Control>,
    ctl_cv: Condvar,
    lat: Mutex<Latency>,
    /// Client shard ops queued or running on this node.
    pub(super) client_shard_queued: AtomicUsize,
    /// PGs to plan again after a failed pass.
    pub(super) retry: Mutex<BTreeSet<(u64, u32)>>,
    active_passes: AtomicU64,
    pgs_pending: AtomicU64,
    objects_left: AtomicU64,
    bytes_left: AtomicU64,
    objects_done: AtomicU64,
    bytes_done: AtomicU64,
    delta_objects: AtomicU64,
    delta_bytes: AtomicU64,
    backfill_objects: AtomicU64,
    backfill_bytes: AtomicU64,
    failures: AtomicU64,
    rate_bits: AtomicU64,
    /// Times a PG's marks were advanced outside a pass (`refresh_marks`).
    pub(super) marks_refreshed: AtomicU64,
    /// Rollback records this node dropped on its primaries' word (`MSG_SHARD_SETTLE`).
    pub(super) rollbacks_dropped: AtomicU64,
    /// Acknowledged writes whose rollback records this node, as primary, sent to be dropped,
    /// and SHARD_SETTLE requests that failed (their entries are sent again at the next pass).
    pub(super) settles_sent: AtomicU64,
    pub(super) settles_failed: AtomicU64,
    /// Tombstones this node, as primary, had its members forget (`MSG_SHARD_FORGET`), and
    /// those this node removed on its primaries' word.
    pub(super) forgets_sent: AtomicU64,
    pub(super) tombstones_forgotten: AtomicU64,
    /// Leftover shards this node removed on a primary's word (`MSG_SHARD_DROP`: older than
    /// what a member complete past them knows).
    pub(super) stale_shards_dropped: AtomicU64,
    last_done_unix_ms: AtomicU64,
}

impl Default for Recovery {
    fn default() -> Self {
        Recovery {
            items: WaitQueue::new(),
            ctl: Mutex::new(Control {
                window: WINDOW_START,
                pause_ms: 0,
                inflight: 0,
            }),
            ctl_cv: Condvar::new(),
            lat: Mutex::new(Latency::default()),
            client_shard_queued: AtomicUsize::new(0),
            retry: Mutex::new(BTreeSet::new()),
            active_passes: AtomicU64::new(0),
            pgs_pending: AtomicU64::new(0),
            objects_left: AtomicU64::new(0),
            bytes_left: AtomicU64::new(0),
            objects_done: AtomicU64::new(0),
            bytes_done: AtomicU64::new(0),
            delta_objects: AtomicU64::new(0),
            delta_bytes: AtomicU64::new(0),
            backfill_objects: AtomicU64::new(0),
            backfill_bytes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            rate_bits: AtomicU64::new(0),
            marks_refreshed: AtomicU64::new(0),
            rollbacks_dropped: AtomicU64::new(0),
            settles_sent: AtomicU64::new(0),
            settles_failed: AtomicU64::new(0),
            forgets_sent: AtomicU64::new(0),
            tombstones_forgotten: AtomicU64::new(0),
            stale_shards_dropped: AtomicU64::new(0),
            last_done_unix_ms: AtomicU64::new(0),
        }
    }
}

impl Recovery {
    /// A client op finished after `d` (from its arrival).
    pub fn client_latency(&self, d: Duration) {
        let mut l = self.lat.lock().unwrap();
        if l.samples.len() < LATENCY_SAMPLES_MAX {
            l.samples.push(d.as_secs_f64() * 1e6);
        }
    }

    pub fn stats(&self) -> RecoveryStats {
        RecoveryStats {
            pgs_pending: self.pgs_pending.load(Relaxed),
            objects_left: self.objects_left.load(Relaxed),
            bytes_left: self.bytes_left.load(Relaxed),
            objects_done: self.objects_done.load(Relaxed),
            bytes_done: self.bytes_done.load(Relaxed),
            rate_bytes_s: f64::from_bits(self.rate_bits.load(Relaxed)),
            delta_objects: self.delta_objects.load(Relaxed),
            delta_bytes: self.delta_bytes.load(Relaxed),
            backfill_objects: self.backfill_objects.load(Relaxed),
            backfill_bytes: self.backfill_bytes.load(Relaxed),
            failures: self.failures.load(Relaxed),
            window: self.ctl.lock().unwrap().window as u64,
            last_done_unix_ms: self.last_done_unix_ms.load(Relaxed),
        }
    }

    /// One controller step: AIMD on the window from the client latency of the last tick.
    fn tick(&self) {
        let busy = self.objects_left.load(Relaxed) > 0;
        let mean = {
            let mut l = self.lat.lock().unwrap();
            let mean = p90(&mut l.samples);
            l.samples.clear();
            if let Some(m) = mean {
                if !busy {
                    l.idle_baseline_us = Some(l.idle_baseline_us.map_or(m, |b| 0.8 * b + 0.2 * m));
                }
                l.history.push_back(m);
                if l.history.len() > LATENCY_HISTORY_TICKS {
                    l.history.pop_front();
                }
            }
            let lowest = l.history.iter().copied().fold(f64::INFINITY, f64::min);
            mean.map(|m| (m, l.idle_baseline_us.unwrap_or(lowest)))
        };
        let mut c = self.ctl.lock().unwrap();
        (c.window, c.pause_ms) = if busy {
            next_window((c.window, c.pause_ms), mean)
        } else if mean.is_some() {
            // Nothing to rebuild, clients busy: the next recovery starts at one rebuild in
            // flight and grows from there (starting wider hits their latency before the
            // first tick can react).
            (WINDOW_MIN, 0)
        } else {
            // Nothing to rebuild, no clients: the next recovery starts from the start (and
            // takes everything at its first tick if clients stay away).
            (WINDOW_START, 0)
        };
        drop(c);
        self.ctl_cv.notify_all();
    }

    fn acquire(&self) {
        let mut c = self.ctl.lock().unwrap();
        while c.inflight >= c.window {
            c = self.ctl_cv.wait(c).unwrap();
        }
        c.inflight += 1;
        let pause = c.pause_ms;
        drop(c);
        if pause > 0 {
            std::thread::sleep(Duration::from_millis(pause));
        }
    }

    fn release(&self) {
        self.ctl.lock().unwrap().inflight -= 1;
        self.ctl_cv.notify_all();
    }
}

/// Recovery's own threads (rebuild, recovery shard service) run at this nice value: where
/// they compete with client work for CPU — reading, reconstructing and sending shards on a
/// busy machine — the scheduler gives the client threads the CPU first.
const RECOVERY_NICE: i32 = 10;

/// Lower the calling thread's CPU priority to [`RECOVERY_NICE`] (Linux: per thread).
pub(super) fn lower_cpu_priority() {
    // SAFETY: setpriority on the calling thread (who = 0); no memory is passed.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, RECOVERY_NICE) };
    if r != 0 {
        debug!(
            "recovery: could not lower thread priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The 90th percentile of some samples (reordered), `None` when there are none.
fn p90(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let i = (v.len() * 9 / 10).min(v.len() - 1);
    Some(*v.select_nth_unstable_by(i, |a, b| a.total_cmp(b)).1)
}

/// AIMD on (window, pause ms): `lat` is (this tick's client p90, baseline) in µs, `None`
/// with no client ops. No clients: everything (the largest window, no pause). A rise halves
/// the window; at one rebuild in flight it doubles a pause before each rebuild instead.
/// Otherwise the pause shrinks by a quarter until it is gone, then the window grows by one.
fn next_window((window, pause_ms): (usize, u64), lat: Option<(f64, f64)>) -> (usize, u64) {
    match lat {
        Some((m, base)) if m > base * LATENCY_RISE && m > base + LATENCY_RISE_FLOOR_US => {
            if window > WINDOW_MIN {
                ((window / 2).max(WINDOW_MIN), pause_ms)
            } else {
                (WINDOW_MIN, (pause_ms * 2).clamp(PAUSE_MS_MIN, PAUSE_MS_MAX))
            }
        }
        None => (WINDOW_MAX, 0),
        _ if pause_ms > 0 => (
            window,
            if pause_ms * 3 / 4 < PAUSE_MS_MIN {
                0
            } else {
                pause_ms * 3 / 4
            },
        ),
        _ => ((window + 1).min(WINDOW_MAX), 0),
    }
}

/// A member's answer to `MSG_PG_LOG`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogInfo {
    /// (slot, complete-through version)
    pub mark: Option<(u8, u64)>,
    /// The newest version trimmed from the window (0: none).
    pub trimmed: u64,
    /// (version, name), oldest first.
    pub entries: Vec<(u64, Vec<u8>)>,
}

impl LogInfo {
    pub fn encode(&self, e: &mut Enc) {
        match self.mark {
            Some((s, v)) => e.u8(1).u8(s).u64(v),
            None => e.u8(0).u8(0).u64(0),
        };
        e.u64(self.trimmed).u32(self.entries.len() as u32);
        for (v, n) in &self.entries {
            e.u64(*v).bytes(n);
        }
    }

    pub fn decode(d: &mut Dec) -> Result<LogInfo> {
        let has = d.u8()? != 0;
        let (s, v) = (d.u8()?, d.u64()?);
        let trimmed = d.u64()?;
        let n = d.u32()? as usize;
        let mut entries = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            entries.push((d.u64()?, d.bytes()?.to_vec()));
        }
        Ok(LogInfo {
            mark: has.then_some((s, v)),
            trimmed,
            entries,
        })
    }

    /// Whether the window still holds every entry after `version`.
    fn covers(&self, version: u64) -> bool {
        self.trimmed <= version
    }
}

/// One shard a member lists (`MSG_SHARD_LIST`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub name: Vec<u8>,
    pub shard: u8,
    pub version: u64,
    pub size: u64,
    pub deleted: bool,
}

fn bit(slot: usize) -> u64 {
    1u64 << slot
}

/// The bytes of a shard covering whole stripes of an object of `size` bytes.
fn padded_shard_len(ctx: &Ctx, size: u64) -> u64 {
    size.div_ceil(ctx.profile.stripe_width()) * ctx.profile.stripe_unit() as u64
}

// ---- member side ----------------------------------------------------------------------------

impl Node {
    /// Queue a recovery message (types 40..=44) for the low-priority shard threads.
    pub(super) fn enqueue_recovery(&self, msg: Incoming) {
        self.recovery_q.push(msg);
    }

    pub(super) fn recovery_shard_thread(self: Arc<Self>) {
        lower_cpu_priority();
        while let Some(mut msg) = self.recovery_q.pop() {
            // Stand aside while client shard ops are queued or running.
            let t = Instant::now();
            while self.recovery.client_shard_queued.load(Relaxed) > 0 && t.elapsed() < YIELD_MAX {
                std::thread::sleep(Duration::from_micros(200));
            }
            let r = self.recovery_shard_op(&msg);
            self.reply_parts(&mut msg, r);
        }
    }

    fn recovery_shard_op(&self, msg: &Incoming) -> Result<Vec<SendBuf>> {
        if !matches!(msg.peer(), messenger::Identity::Node(_)) {
            return Err(Error::remote(Status::Invalid, "recovery ops are for nodes"));
        }
        if msg.msg_type() == wire::MSG_PG_CLEAN {
            return Ok(vec![SendBuf::Vec(self.pg_clean(msg)?)]);
        }
        let p: &[u8] = msg.payload();
        let mut d = Dec::new(p);
        let epoch = d.u64()?;
        if msg.msg_type() == wire::MSG_RECOVERY_WRITE {
            let w = ShardWrite::decode(&mut d)?;
            let _admitted = self.check_shard_sender(msg, epoch, w.pool, w.pg)?;
            self.apply_recovery(&w)?;
            return Ok(vec![SendBuf::Vec(wire::reply_ok(self.epoch(), &[]))]);
        }
        let pool = d.u64()?;
        let pg = d.u32()?;
        let _admitted = self.check_shard_sender(msg, epoch, pool, pg)?;
        let mut e = Enc::new(self.epoch());
        e.u16(Status::Ok as u16);
        match msg.msg_type() {
            // Not while a batch removes a stray PG's keys (`strays`): the listing would show
            // keys about to go.
            wire::MSG_SHARD_LIST => {
                let (after, max) = (d.bytes()?, d.u32()?);
                d.end()?;
                let _g = self.strays.gate.lock().unwrap();
                self.encode_pg_list(&mut e, pool, pg, after, max)?;
            }
            wire::MSG_PG_LOG => {
                d.end()?;
                let _g = self.strays.gate.lock().unwrap();
                self.log_info(pool, pg)?.encode(&mut e);
            }
            wire::MSG_PG_MARK => {
                let slot = d.u8()?;
                let version = d.u64()?;
                d.end()?;
                self.set_mark(pool, pg, slot, version)?;
            }
            wire::MSG_SHARD_SETTLE => {
                let (shard, entries) = decode_settle(&mut d)?;
                e.u64(self.settle(pool, pg, shard, &entries)?);
            }
            wire::MSG_SHARD_FORGET => {
                let (shard, entries) = decode_settle(&mut d)?;
                e.u64(self.forget_tombstones(pool, pg, shard, &entries)?);
            }
            wire::MSG_RECOVERY_READ => {
                let name = d.bytes()?;
                let shard = d.u8()?;
                let (version, off, len) = (d.u64()?, d.u64()?, d.u64()?);
                d.end()?;
                // From the device: recovery checks what the medium holds and leaves the
                // clients' cache alone.
                let data = self
                    .local
                    .read(pool, pg, name, shard, version, off, len, false)?;
                return Ok(super::local::read_reply(e, data, false));
            }
            t => return Err(Error::Malformed(format!("not a recovery message: {t}"))),
        }
        Ok(vec![SendBuf::Vec(e.finish())])
    }

    /// A whole-shard write from recovery: skipped when the shard is already at or past it.
    fn apply_recovery(&self, w: &ShardWrite) -> Result<()> {
        if w.kind != WriteKind::Full || w.base_version != BASE_ANY {
            return Err(Error::remote(
                Status::Invalid,
                "recovery writes replace whole shards",
            ));
        }
        let st = self.local.store(w.pool, w.pg);
        let key = ObjectKey::new(w.pool, w.name, w.shard);
        if self
            .local
            .meta(st, &key)?
            .is_some_and(|m| m.version >= w.meta.version)
        {
            return Ok(());
        }
        // The object's resolved version stands: nothing will undo this write, so it keeps
        // no rollback record (nor reads the stale bytes for one).
        self.local.apply_settled(w)
    }

    /// SHARD_SETTLE on this member: drop the rollback records its primary listed.
    fn settle(&self, pool: u64, pg: u32, shard: u8, entries: &[(&[u8], u64)]) -> Result<u64> {
        let n = self.local.settle(pool, pg, shard, entries)?;
        self.recovery.rollbacks_dropped.fetch_add(n, Relaxed);
        Ok(n)
    }

    /// SHARD_DROP on this member (sent by a peer or by this node as primary): remove a
    /// leftover shard at `version`, counted when it went; the shard's state after.
    pub(super) fn drop_stale(
        &self,
        pool: u64,
        pg: u32,
        name: &[u8],
        shard: u8,
        version: u64,
    ) -> Result<super::local::ShardState> {
        let (dropped, state) = self.local.drop_stale(pool, pg, name, shard, version)?;
        self.recovery
            .stale_shards_dropped
            .fetch_add(dropped as u64, Relaxed);
        Ok(state)
    }

    /// SHARD_FORGET on this member: remove the tombstones its primary listed.
    fn forget_tombstones(
        &self,
        pool: u64,
        pg: u32,
        shard: u8,
        entries: &[(&[u8], u64)],
    ) -> Result<u64> {
        let n = self.local.forget(pool, pg, shard, entries)?;
        self.recovery.tombstones_forgotten.fetch_add(n, Relaxed);
        Ok(n)
    }

    /// A `SHARD_LIST` reply body: more u8, count u32, then per shard name, slot, version,
    /// size, deleted (at most `max`, clamped to 1..=LIST_PAGE_MAX).
    fn encode_pg_list(
        &self,
        e: &mut Enc,
        pool: u64,
        pg: u32,
        after: &[u8],
        max: u32,
    ) -> Result<()> {
        let (items, more) = self.list_pg(pool, pg, after, max.clamp(1, LIST_PAGE_MAX) as usize)?;
        e.u8(more as u8).u32(items.len() as u32);
        for l in &items {
            e.bytes(&l.name)
                .u8(l.shard)
                .u64(l.version)
                .u64(l.size)
                .u8(l.deleted as u8);
        }
        Ok(())
    }

    /// This member's shards of a PG, in name order after `after` (empty: from the start).
    fn list_pg(&self, pool: u64, pg: u32, after: &[u8], max: usize) -> Result<(Vec<Listed>, bool)> {
        let map = self.monc.map();
        let info = map
            .pools
            .get(&pool)
            .ok_or_else(|| Error::remote(Status::NoSuchPool, format!("pool {pool}")))?;
        let st = self.local.store(pool, pg);
        let mut from = (!after.is_empty()).then(|| ObjectKey::new(pool, after, u8::MAX));
        let mut out: Vec<Listed> = Vec::new();
        loop {
            let batch = st.list(pool, from.as_ref(), 256);
            let Some(last) = batch.last().map(|(k, _)| k.clone()) else {
                return Ok((out, false));
            };
            for (k, _) in batch {
                if k.name.first() == Some(&0)
                    || k.shard >= SHARD_ROLLBACK_BIT
                    || pg_of(info, &k.name) != pg
                {
                    continue;
                }
                // Stop at a name boundary so a page never splits one object's shards.
                if out.len() >= max && out.last().is_some_and(|l| *l.name != *k.name) {
                    return Ok((out, true));
                }
                if let Some(m) = self.local.meta(st, &k)? {
                    out.push(Listed {
                        name: k.name.to_vec(),
                        shard: k.shard,
                        version: m.version,
                        size: m.size,
                        deleted: m.deleted,
                    });
                }
            }
            from = Some(last);
        }
    }

    fn log_info(&self, pool: u64, pg: u32) -> Result<LogInfo> {
        let (entries, trimmed) = self.local.log_window(pool, pg);
        Ok(LogInfo {
            mark: self.mark(pool, pg)?,
            trimmed,
            entries,
        })
    }

    fn mark(&self, pool: u64, pg: u32) -> Result<Option<(u8, u64)>> {
        self.local.mark(pool, pg)
    }

    fn set_mark(&self, pool: u64, pg: u32, slot: u8, version: u64) -> Result<()> {
        self.local.set_mark(pool, pg, slot, version)
    }
}

// ---- primary side: planning -------------------------------------------------------------------

impl Node {
    /// `node-recovery`: plan passes when the map says members may have changed; run the
    /// window controller.
    pub(super) fn recovery_loop(self: Arc<Self>) {
        let mut seen: Option<(u64, Vec<u64>)> = None;
        let mut dirty: BTreeSet<(u64, u32)> = BTreeSet::new();
        let mut retry_at = Instant::now();
        let mut next_tick = Instant::now() + TICK;
        let mut next_marks = Instant::now() + MARK_REFRESH;
        loop {
            let map = self.monc.map();
            let key = (
                self.monc.node_change_epoch(),
                map.pools.keys().copied().collect::<Vec<_>>(),
            );
            if seen.as_ref() != Some(&key) {
                seen = Some(key);
                // Stop redialling nodes that went down (`crate::peers`).
                self.peers.prune(&self.monc);
                for p in map.pools.values() {
                    for pg in 0..p.pg_num {
                        if self.monc.acting(&map, p, pg).primary == Some(self.id) {
                            dirty.insert((p.id, pg));
                        }
                    }
                }
            }
            if Instant::now() >= retry_at {
                dirty.extend(std::mem::take(&mut *self.recovery.retry.lock().unwrap()));
                retry_at = Instant::now() + RETRY_PAUSE;
            }
            let r = &self.recovery;
            r.pgs_pending.store(
                dirty.len() as u64
                    + r.retry.lock().unwrap().len() as u64
                    + r.active_passes.load(Relaxed),
                Relaxed,
            );
            if Instant::now() >= next_tick {
                let done = r.bytes_done.load(Relaxed);
                r.tick();
                self.update_rate(done, next_tick);
                next_tick = Instant::now() + TICK;
            }
            if Instant::now() >= next_marks {
                self.refresh_marks();
                self.send_settles();
                self.send_forgets();
                next_marks = Instant::now() + MARK_REFRESH;
            }
            match dirty.pop_first() {
                Some((pool, pg)) => {
                    if let Err(e) = self.plan(pool, pg) {
                        debug!("recovery: pg {pool}.{pg:x}: planning failed: {e}");
                        r.retry.lock().unwrap().insert((pool, pg));
                    }
                }
                None => {
                    let now = self.monc.epoch();
                    self.monc
                        .wait_change(now, next_tick.saturating_duration_since(Instant::now()));
                }
            }
        }
    }

    fn update_rate(&self, done_before_tick: u64, _at: Instant) {
        // EWMA of bytes done per tick, from the counter's movement since the last tick.
        thread_local! {
            static LAST: std::cell::Cell<(u64, Option<Instant>)> =
                const { std::cell::Cell::new((0, None)) };
        }
        let r = &self.recovery;
        let now = Instant::now();
        let (prev, at) = LAST.with(|l| l.get());
        LAST.with(|l| l.set((done_before_tick, Some(now))));
        let Some(at) = at else { return };
        let dt = now.duration_since(at).as_secs_f64().max(1e-3);
        let inst = done_before_tick.saturating_sub(prev) as f64 / dt;
        let old = f64::from_bits(r.rate_bits.load(Relaxed));
        let idle = r.objects_left.load(Relaxed) == 0 && r.active_passes.load(Relaxed) == 0;
        let rate = if idle { 0.0 } else { 0.7 * old + 0.3 * inst };
        r.rate_bits.store(rate.to_bits(), Relaxed);
    }

    pub(super) fn recovery_ctx(&self, pool: u64, pg: u32) -> Option<Ctx> {
        let map = self.monc.map();
        let info = map.pools.get(&pool)?.clone();
        let acting = (*self.monc.acting(&map, &info, pg)).clone();
        if acting.primary != Some(self.id) {
            return None;
        }
        let profile = info.profile();
        Some(Ctx {
            codec: self.codec(profile),
            map,
            pool: info,
            pg,
            acting,
            profile,
        })
    }

    /// Small request to every listed slot; every one must answer.
    fn ask_all(
        &self,
        ctx: &Ctx,
        msg_type: u16,
        reqs: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Payload)>> {
        let reqs = reqs
            .into_iter()
            .map(|(s, b)| (s, vec![SendBuf::Vec(b)]))
            .collect();
        let local = |_slot: usize, parts: Vec<SendBuf>| -> Result<Payload> {
            let body = SendBuf::concat(&parts);
            self.local_recovery_op(msg_type, &body)
                .map(Payload::from_vec)
        };
        let mut out = Vec::new();
        for (slot, r) in self.fan_out(ctx, msg_type, reqs, &local) {
            out.push((slot, r.map_err(|e| Error::FetchFailed(slot, Box::new(e)))?));
        }
        Ok(out)
    }

    /// The local half of a recovery request (same bodies and replies as over the wire).
    fn local_recovery_op(&self, msg_type: u16, body: &[u8]) -> Result<Vec<u8>> {
        let mut d = Dec::new(body);
        let epoch = d.u64()?;
        let mut e = Enc::new(self.epoch());
        e.u16(Status::Ok as u16);
        match msg_type {
            wire::MSG_RECOVERY_WRITE => {
                let w = ShardWrite::decode(&mut d)?;
                let _admitted = self.check_own_op(epoch, w.pool, w.pg)?;
                self.apply_recovery(&w)?;
            }
            wire::MSG_RECOVERY_READ => {
                let (pool, pg, name, shard) = (d.u64()?, d.u32()?, d.bytes()?, d.u8()?);
                let (v, off, len) = (d.u64()?, d.u64()?, d.u64()?);
                let r = self.local.read(pool, pg, name, shard, v, off, len, false)?;
                super::local::encode_read(&mut e, &r, false);
            }
            // A new primary's first look at its own shard's log, like its look at the
            // others', comes after the ops it admitted from the previous primary.
            wire::MSG_PG_LOG => {
                let (pool, pg) = (d.u64()?, d.u32()?);
                let _admitted = self.check_own_op(epoch, pool, pg)?;
                self.log_info(pool, pg)?.encode(&mut e);
            }
            wire::MSG_PG_MARK => {
                let (pool, pg, slot, v) = (d.u64()?, d.u32()?, d.u8()?, d.u64()?);
                let _admitted = self.check_own_op(epoch, pool, pg)?;
                self.set_mark(pool, pg, slot, v)?;
            }
            wire::MSG_SHARD_FORGET => {
                let (pool, pg) = (d.u64()?, d.u32()?);
                let (shard, entries) = decode_settle(&mut d)?;
                let _admitted = self.check_own_op(epoch, pool, pg)?;
                e.u64(self.forget_tombstones(pool, pg, shard, &entries)?);
            }
            wire::MSG_SHARD_SETTLE => {
                let (pool, pg) = (d.u64()?, d.u32()?);
                let (shard, entries) = decode_settle(&mut d)?;
                let _admitted = self.check_own_op(epoch, pool, pg)?;
                e.u64(self.settle(pool, pg, shard, &entries)?);
            }
            wire::MSG_SHARD_LIST => {
                let (pool, pg, after, max) = (d.u64()?, d.u32()?, d.bytes()?, d.u32()?);
                let _admitted = self.check_own_op(epoch, pool, pg)?;
                self.encode_pg_list(&mut e, pool, pg, after, max)?;
            }
            t => return Err(Error::Malformed(format!("not a recovery message: {t}"))),
        }
        Ok(e.finish())
    }

    /// Every shard of the PG each up slot's member holds: slot → name → (version, size,
    /// deleted) of the shard of that slot.
    fn list_members(&self, ctx: &Ctx, up: &[usize]) -> Result<MemberLists> {
        let mut out: MemberLists = up.iter().map(|s| (*s, HashMap::new())).collect();
        let mut after: HashMap<usize, Vec<u8>> = up.iter().map(|s| (*s, Vec::new())).collect();
        while !after.is_empty() {
            let reqs = after
                .iter()
                .map(|(s, a)| {
                    let mut e = Enc::new(ctx.map.epoch);
                    e.u64(ctx.pool.id).u32(ctx.pg).bytes(a).u32(LIST_PAGE_MAX);
                    (*s, e.finish())
                })
                .collect();
            for (slot, p) in self.ask_all(ctx, wire::MSG_SHARD_LIST, reqs)? {
                let mut d = Dec::new(&p);
                d.u64()?;
                d.u16()?;
                let more = d.u8()? != 0;
                let n = d.u32()? as usize;
                let mut last = Vec::new();
                for _ in 0..n {
                    let name = d.bytes()?.to_vec();
                    let (shard, version, size, deleted) =
                        (d.u8()?, d.u64()?, d.u64()?, d.u8()? != 0);
                    if shard as usize == slot {
                        out.get_mut(&slot)
                            .expect("asked")
                            .insert(name.clone(), (version, size, deleted));
                    }
                    last = name;
                }
                if more && !last.is_empty() {
                    after.insert(slot, last);
                } else {
                    after.remove(&slot);
                }
            }
        }
        Ok(out)
    }

    /// Plan one PG's pass: find what each up member misses, queue the rebuilds.
    fn plan(&self, pool: u64, pg: u32) -> Result<()> {
        let started = Instant::now();
        let node_change_epoch = self.monc.node_change_epoch();
        let Some(ctx) = self.recovery_ctx(pool, pg) else {
            return Ok(());
        };
        let up: Vec<usize> = (0..ctx.n()).filter(|s| ctx.up(*s).is_some()).collect();
        // Before the logs: a write acknowledged without a member after this may be missing
        // from them (`PgCache::skipped`); one acknowledged before is in them.
        let skipped = self.pg_lock(pool, pg).lock().unwrap().skipped;
        let reqs = up
            .iter()
            .map(|s| {
                let mut e = Enc::new(ctx.map.epoch);
                e.u64(pool).u32(pg);
                (*s, e.finish())
            })
            .collect();
        let mut logs: HashMap<usize, LogInfo> = HashMap::new();
        for (slot, p) in self.ask_all(&ctx, wire::MSG_PG_LOG, reqs)? {
            let mut d = Dec::new(&p);
            d.u64()?;
            d.u16()?;
            logs.insert(slot, LogInfo::decode(&mut d)?);
        }
        let version = logs
            .values()
            .flat_map(|l| {
                l.entries
                    .last()
                    .map(|e| e.0)
                    .into_iter()
                    .chain(l.mark.map(|m| m.1))
            })
            .max()
            .unwrap_or(0);
        let logs_ms = started.elapsed().as_secs_f64() * 1e3;
        let (delta, backfill_slots) = plan_delta(&logs, &up);
        let mut todo: BTreeMap<Vec<u8>, (Path, u64)> =
            delta.into_iter().map(|n| (n, (Path::Delta, 0))).collect();
        if !backfill_slots.is_empty() {
            let lists = self.list_members(&ctx, &up)?;
            for (name, (path, bytes)) in plan_backfill(&ctx, &lists, &backfill_slots) {
                todo.insert(name, (path, bytes));
            }
        }
        let pass = Arc::new(Pass {
            pool,
            pg,
            members: ctx.acting.members.clone(),
            node_change_epoch,
            up_slots: up,
            version,
            skipped,
            left: AtomicUsize::new(todo.len()),
            failed: AtomicBool::new(false),
        });
        let r = &self.recovery;
        r.active_passes.fetch_add(1, Relaxed);
        if todo.is_empty() {
            self.finish_pass(&pass);
            return Ok(());
        }
        info!(
            "recovery: pg {pool}.{pg:x}: {} object(s) to check ({} by backfill for slots {:?}); \
             planned in {:.1} ms ({logs_ms:.1} ms for the members' logs)",
            todo.len(),
            todo.values().filter(|t| t.0 == Path::Backfill).count(),
            backfill_slots,
            started.elapsed().as_secs_f64() * 1e3
        );
        for (name, (path, bytes)) in todo {
            r.objects_left.fetch_add(1, Relaxed);
            r.bytes_left.fetch_add(bytes, Relaxed);
            r.items.push(Item {
                pass: pass.clone(),
                name,
                path,
                bytes,
            });
        }
        Ok(())
    }

    /// After a pass's last object: mark the members complete, or plan the PG again later.
    fn finish_pass(&self, pass: &Pass) {
        let r = &self.recovery;
        let ok = !pass.failed.load(Relaxed) && self.mark_members(pass).is_ok();
        if !ok {
            r.retry.lock().unwrap().insert((pass.pool, pass.pg));
        } else {
            // Every up member, this one included, holds every acknowledged object of the PG.
            let pg = self.pg_lock(pass.pool, pass.pg);
            let mut c = pg.lock().unwrap();
            if let Some(ctx) = self.recovery_ctx(pass.pool, pass.pg) {
                self.refresh_cache(&ctx, &mut c);
                if c.members == pass.members
                    && c.node_change_epoch == pass.node_change_epoch
                    && c.skipped == pass.skipped
                {
                    c.complete_at = Some(pass.node_change_epoch);
                    // `mark_members` marked every up member complete through it.
                    c.marked = c.marked.max(pass.version);
                } else if c.skipped != pass.skipped {
                    // A write some member missed came after the logs: plan again.
                    r.retry.lock().unwrap().insert((pass.pool, pass.pg));
                }
            }
        }
        r.active_passes.fetch_sub(1, Relaxed);
    }

    /// Advance the marks of every PG this node leads whose up members have all acknowledged
    /// every write since its last complete pass (`PgCache::complete_at`): they are complete
    /// through the newest such write. An op holds its PG's cache lock until its write is
    /// acknowledged, so a version read under the lock has no write below it in flight.
    fn refresh_marks(&self) {
        type Caches = Vec<((u64, u32), Arc<Mutex<PgCache>>)>;
        let pgs: Caches = self
            .pgs
            .lock()
            .unwrap()
            .iter()
            .map(|(k, s)| (*k, s.cache.clone()))
            .collect();
        for ((pool, pg), cache) in pgs {
            let Some(ctx) = self.recovery_ctx(pool, pg) else {
                continue;
            };
            let version = {
                let Ok(mut c) = cache.try_lock() else {
                    continue; // an op is running: next time
                };
                self.refresh_cache(&ctx, &mut c);
                if c.complete_at.is_none() || c.last_version <= c.marked {
                    continue;
                }
                c.last_version
            };
            let reqs = (0..ctx.n())
                .filter(|s| ctx.up(*s).is_some())
                .map(|s| {
                    let mut e = Enc::new(ctx.map.epoch);
                    e.u64(pool).u32(pg).u8(s as u8).u64(version);
                    (s, e.finish())
                })
                .collect();
            match self.ask_all(&ctx, wire::MSG_PG_MARK, reqs) {
                Ok(_) => {
                    let mut c = cache.lock().unwrap();
                    c.marked = c.marked.max(version);
                    self.recovery.marks_refreshed.fetch_add(1, Relaxed);
                }
                Err(e) => debug!("recovery: pg {pool}.{pg:x}: advancing marks failed: {e}"),
            }
        }
    }

    /// Send each member of the PGs this node leads the acknowledged writes whose rollback
    /// records it may drop (`PgCache::to_settle`), one SHARD_SETTLE per member and PG. A
    /// member that does not answer, or is down, is sent its entries again next time (while
    /// the list is under `SETTLE_PENDING_MAX`): one that went down after taking a write and
    /// before its settle gets it once it is back, instead of keeping the old bytes until the
    /// object's next write.
    fn send_settles(&self) {
        let pgs: Vec<((u64, u32), super::primary::ToSettle)> = self
            .pgs
            .lock()
            .unwrap()
            .iter()
            .map(|(k, s)| (*k, s.to_settle.clone()))
            .collect();
        for ((pool, pg), pending) in pgs {
            let list = std::mem::take(&mut *pending.lock().unwrap());
            if list.is_empty() {
                continue;
            }
            let Some(ctx) = self.recovery_ctx(pool, pg) else {
                continue;
            };
            let down = (0..ctx.n())
                .filter(|s| ctx.up(*s).is_none())
                .fold(0u64, |m, s| m | bit(s));
            let reqs: Vec<(usize, Vec<SendBuf>)> = (0..ctx.n())
                .filter(|s| down & bit(*s) == 0)
                .filter_map(|s| {
                    let mine: Vec<&(Vec<u8>, u64, u64)> =
                        list.iter().filter(|e| e.2 & (1 << s) != 0).collect();
                    if mine.is_empty() {
                        return None;
                    }
                    let mut e = Enc::new(ctx.map.epoch);
                    e.u64(pool).u32(pg).u8(s as u8).u32(mine.len() as u32);
                    for (name, version, _) in mine {
                        e.bytes(name).u64(*version);
                    }
                    Some((s, vec![SendBuf::Vec(e.finish())]))
                })
                .collect();
            let local = |_slot: usize, parts: Vec<SendBuf>| -> Result<Payload> {
                let body = SendBuf::concat(&parts);
                self.local_recovery_op(wire::MSG_SHARD_SETTLE, &body)
                    .map(Payload::from_vec)
            };
            let sent = list.iter().filter(|e| e.2 & !down != 0).count();
            self.recovery.settles_sent.fetch_add(sent as u64, Relaxed);
            let mut failed = 0u64;
            for (slot, r) in self.fan_out(&ctx, wire::MSG_SHARD_SETTLE, reqs, &local) {
                if let Err(e) = r {
                    self.recovery.settles_failed.fetch_add(1, Relaxed);
                    failed |= bit(slot);
                    debug!("pg {pool}.{pg:x}: settling rollback records on slot {slot}: {e}");
                }
            }
            // A member up but not answering (busy, or its reply lost), or down, gets its
            // entries again next time: a removed object has no next write to drop its
            // records, and the bytes a remove kept stay held until they are settled.
            // Settling is idempotent (a member skips an entry whose shard moved on, and a
            // node that took the slot over since has no record to drop).
            let again = failed | down;
            if again != 0 {
                let mut p = pending.lock().unwrap();
                for (name, version, slots) in list {
                    if slots & again != 0 && p.len() < super::primary::SETTLE_PENDING_MAX {
                        p.push((name, version, slots & again));
                    }
                }
            }
        }
    }

    /// Tell the up members of the PGs this node leads to forget the tombstones of objects
    /// removed at least `tombstone_keep_s` ago (`PgCache::to_forget`) whose versions their
    /// marks cover: one SHARD_FORGET per member and PG. Each member removes only tombstones
    /// its own mark covers; the missing shard then proves the removal to a later `resolve`
    /// (`ShardState::mark`). An entry stays listed until every slot has answered for it: a
    /// member that failed, or was down, gets it when it is back.
    fn send_forgets(&self) {
        let keep = Duration::from_secs(self.cfg.tombstone_keep_s);
        type Pending = Vec<((u64, u32), super::primary::ToForget, Arc<Mutex<PgCache>>)>;
        let pgs: Pending = self
            .pgs
            .lock()
            .unwrap()
            .iter()
            .map(|(k, s)| (*k, s.to_forget.clone(), s.cache.clone()))
            .collect();
        for ((pool, pg), pending, cache) in pgs {
            if pending.lock().unwrap().is_empty() {
                continue;
            }
            let Some(ctx) = self.recovery_ctx(pool, pg) else {
                // No longer led here: the new primary's scrub finds what is left.
                pending.lock().unwrap().clear();
                continue;
            };
            let marked = match cache.try_lock() {
                Ok(c) => c.marked,
                Err(_) => continue, // an op is running: next time
            };
            let all = (0..ctx.n()).fold(0u64, |a, s| a | bit(s));
            let up = (0..ctx.n())
                .filter(|s| ctx.up(*s).is_some())
                .fold(0u64, |a, s| a | bit(s));
            // The due entries, taken out of the list while they are sent (entries keep their
            // order: the aged ones are its front).
            let mut due: Vec<super::primary::Forget> = {
                let mut p = pending.lock().unwrap();
                let aged = p.iter().take_while(|e| e.at.elapsed() >= keep).count();
                p.drain(..aged).collect()
            };
            let wanted = |e: &super::primary::Forget| e.version <= marked && up & !e.done != 0;
            let reqs: Vec<(usize, Vec<SendBuf>)> = (0..ctx.n())
                .filter(|s| up & bit(*s) != 0)
                .filter_map(|s| {
                    let mine: Vec<&super::primary::Forget> = due
                        .iter()
                        .filter(|e| wanted(e) && e.done & bit(s) == 0)
                        .collect();
                    if mine.is_empty() {
                        return None;
                    }
                    let mut e = Enc::new(ctx.map.epoch);
                    e.u64(pool).u32(pg).u8(s as u8).u32(mine.len() as u32);
                    for f in mine {
                        e.bytes(&f.name).u64(f.version);
                    }
                    Some((s, vec![SendBuf::Vec(e.finish())]))
                })
                .collect();
            let local = |_slot: usize, parts: Vec<SendBuf>| -> Result<Payload> {
                let body = SendBuf::concat(&parts);
                self.local_recovery_op(wire::MSG_SHARD_FORGET, &body)
                    .map(Payload::from_vec)
            };
            let mut answered = 0u64;
            for (slot, r) in self.fan_out(&ctx, wire::MSG_SHARD_FORGET, reqs, &local) {
                match r {
                    Ok(_) => answered |= bit(slot),
                    Err(e) => debug!("pg {pool}.{pg:x}: forgetting tombstones on slot {slot}: {e}"),
                }
            }
            for e in due.iter_mut().filter(|e| wanted(e)) {
                e.done |= answered;
                if e.done & all == all {
                    self.recovery.forgets_sent.fetch_add(1, Relaxed);
                }
            }
            due.retain(|e| e.done & all != all);
            let mut p = pending.lock().unwrap();
            for e in due.into_iter().rev() {
                p.push_front(e);
            }
        }
    }

    /// PGs this node leads whose members' marks lag writes they all acknowledged (an op
    /// running in a PG counts as lagging).
    pub(super) fn marks_behind(&self) -> u64 {
        let pgs: Vec<Arc<Mutex<PgCache>>> = self
            .pgs
            .lock()
            .unwrap()
            .values()
            .map(|s| s.cache.clone())
            .collect();
        pgs.iter()
            .filter(|c| match c.try_lock() {
                Ok(c) => c.complete_at.is_some() && c.last_version > c.marked,
                Err(_) => true,
            })
            .count() as u64
    }

    fn mark_members(&self, pass: &Pass) -> Result<()> {
        let Some(ctx) = self.recovery_ctx(pass.pool, pass.pg) else {
            return Ok(());
        };
        if ctx.acting.members != pass.members {
            // Members moved while the pass ran: the next pass (already due) marks them.
            return Ok(());
        }
        let reqs = pass
            .up_slots
            .iter()
            .filter(|s| ctx.up(**s).is_some())
            .map(|s| {
                let mut e = Enc::new(ctx.map.epoch);
                e.u64(pass.pool).u32(pass.pg).u8(*s as u8).u64(pass.version);
                (*s, e.finish())
            })
            .collect();
        self.ask_all(&ctx, wire::MSG_PG_MARK, reqs)?;
        Ok(())
    }
}

/// Which objects each up member misses by the logs: the names to check, and the slots that
/// need a full scan instead.
fn plan_delta(logs: &HashMap<usize, LogInfo>, up: &[usize]) -> (BTreeSet<Vec<u8>>, Vec<usize>) {
    let valid = |s: usize| logs[&s].mark.is_some_and(|m| m.0 as usize == s);
    let mut names = BTreeSet::new();
    let mut backfill = Vec::new();
    for &x in up {
        if !valid(x) {
            backfill.push(x);
            continue;
        }
        let since = logs[&x].mark.expect("valid").1;
        let sources: Vec<usize> = up
            .iter()
            .copied()
            .filter(|s| *s != x && valid(*s))
            .collect();
        if sources.is_empty() || sources.iter().any(|s| !logs[s].covers(since)) {
            backfill.push(x);
            continue;
        }
        let have: HashSet<&(u64, Vec<u8>)> = logs[&x].entries.iter().collect();
        for s in sources {
            for e in &logs[&s].entries {
                if e.0 > since && !have.contains(e) {
                    names.insert(e.1.clone());
                }
            }
        }
    }
    (names, backfill)
}

/// Objects whose newest version a backfill slot does not hold, with estimated shard bytes.
fn plan_backfill(ctx: &Ctx, lists: &MemberLists, slots: &[usize]) -> Vec<(Vec<u8>, (Path, u64))> {
    let mut top: HashMap<&[u8], (u64, u64, bool)> = HashMap::new();
    for l in lists.values() {
        for (name, v) in l {
            let t = top.entry(name.as_slice()).or_insert(*v);
            if v.0 > t.0 {
                *t = *v;
            }
        }
    }
    let mut out = Vec::new();
    for (name, (version, size, deleted)) in top {
        let behind: Vec<usize> = slots
            .iter()
            .copied()
            .filter(|s| lists[s].get(name).map(|v| v.0) != Some(version))
            .filter(|s| !deleted || lists[s].contains_key(name))
            .collect();
        if !behind.is_empty() {
            let bytes = behind.iter().map(|s| ctx.clip(*s, size)).sum();
            out.push((name.to_vec(), (Path::Backfill, bytes)));
        }
    }
    out
}

// ---- primary side: rebuilding ------------------------------------------------------------------

impl Node {
    /// `node-rebuild-N`: rebuild queued objects, at most the window at a time.
    pub(super) fn recovery_worker(self: Arc<Self>) {
        lower_cpu_priority();
        let r = &self.recovery;
        while let Some(item) = r.items.pop() {
            r.acquire();
            let res = self.rebuild(&item);
            r.release();
            match res {
                Ok(Some(bytes)) => {
                    r.objects_done.fetch_add(1, Relaxed);
                    r.bytes_done.fetch_add(bytes, Relaxed);
                    r.last_done_unix_ms.fetch_max(unix_ms(), Relaxed);
                    let (o, b) = match item.path {
                        Path::Delta => (&r.delta_objects, &r.delta_bytes),
                        Path::Backfill => (&r.backfill_objects, &r.backfill_bytes),
                    };
                    o.fetch_add(1, Relaxed);
                    b.fetch_add(bytes, Relaxed);
                }
                Ok(None) => {}
                Err(e) => {
                    debug!(
                        "recovery: {:?} in pg {}.{:x}: {e}",
                        String::from_utf8_lossy(&item.name),
                        item.pass.pool,
                        item.pass.pg
                    );
                    r.failures.fetch_add(1, Relaxed);
                    item.pass.failed.store(true, Relaxed);
                }
            }
            r.objects_left.fetch_sub(1, Relaxed);
            let _ = r
                .bytes_left
                .fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(item.bytes)));
            if item.pass.left.fetch_sub(1, Relaxed) == 1 {
                self.finish_pass(&item.pass);
            }
        }
    }

    /// The PG's op lock (created if no client op used the PG yet).
    fn pg_lock(&self, pool: u64, pg: u32) -> Arc<Mutex<PgCache>> {
        self.pgs
            .lock()
            .unwrap()
            .entry((pool, pg))
            .or_insert_with(super::PgSlot::new)
            .cache
            .clone()
    }

    /// Bring every up member of the object's PG to its current version. `Some(shard bytes
    /// written)` when something was rebuilt.
    fn rebuild(&self, item: &Item) -> Result<Option<u64>> {
        for _ in 0..REBUILD_ATTEMPTS_MAX {
            match self.rebuild_once(item) {
                // A client wrote the object meanwhile: look again.
                Err(Error::Remote {
                    status: Status::VersionMismatch,
                    ..
                }) => {}
                Err(Error::FetchFailed(_, e))
                    if matches!(
                        *e,
                        Error::Remote {
                            status: Status::VersionMismatch,
                            ..
                        }
                    ) => {}
                r => return r,
            }
        }
        Err(Error::remote(
            Status::VersionMismatch,
            "the object kept changing during its rebuild",
        ))
    }

    /// The PG's op lock, its cache reset if members or node states changed since it was filled.
    fn lock_pg<'a>(
        &self,
        ctx: &Ctx,
        lock: &'a Mutex<PgCache>,
    ) -> std::sync::MutexGuard<'a, PgCache> {
        let mut c = lock.lock().unwrap();
        let changed = self.monc.node_change_epoch();
        if c.members != ctx.acting.members || c.node_change_epoch != changed {
            c.members = ctx.acting.members.clone();
            c.node_change_epoch = changed;
            c.objs.clear();
        }
        c
    }

    /// One attempt. The PG's op lock is held to resolve the object and again to write, not
    /// while the shards are read and decoded: client ops on the PG wait only for the
    /// (small) stat round and the writes. A client write in between changes the version,
    /// which the second look (or a read at the old version) notices: `VersionMismatch`.
    fn rebuild_once(&self, item: &Item) -> Result<Option<u64>> {
        let (pool, pg, name) = (item.pass.pool, item.pass.pg, item.name.as_slice());
        let Some(ctx) = self.recovery_ctx(pool, pg) else {
            return Ok(None); // no longer ours: the new primary recovers it
        };
        let lock = self.pg_lock(pool, pg);
        let st = {
            let mut c = self.lock_pg(&ctx, &lock);
            match c.objs.get(name) {
                Some(st) => st.clone(),
                None => self.resolve(&ctx, &mut c, name)?,
            }
        };
        let up_mask = (0..ctx.n())
            .filter(|s| ctx.up(*s).is_some())
            .fold(0, |a, s| a | bit(s));
        if st.version == 0 || up_mask & !st.current == 0 {
            return Ok(None);
        }
        // Unlocked from here: a client write racing these writes is safe. A whole-shard
        // client write reaches the target too, and whichever lands second, the newer version
        // stays (a recovery write never replaces a newer shard); a partial one skips the
        // target (not current), which stays stale and is not marked current below.
        let shards: HashMap<usize, Arc<Vec<u8>>> = self
            .rebuilt_shards(&ctx, name, &st, up_mask & !st.current)?
            .into_iter()
            .map(|(s, v)| (s, Arc::new(v)))
            .collect();
        let sent =
            self.send_whole_shards(&ctx, name, &st, &shards, wire::MSG_RECOVERY_WRITE, &|w| {
                self.apply_recovery(w)
            });
        let (bytes, acked, err) = (sent.bytes, sent.acked, sent.first_err);
        // The slots are current only if the object is still at the version rebuilt; if a
        // client wrote it meanwhile, look again (the caller retries).
        let mut c = self.lock_pg(&ctx, &lock);
        if let Some(now) = c.objs.get(name) {
            if now.version != st.version {
                return Err(Error::remote(Status::VersionMismatch, "written meanwhile"));
            }
            let mut now = now.clone();
            now.current |= acked;
            remember(&mut c, name, &now);
        }
        drop(c);
        match err {
            Some(e) => Err(e),
            None => Ok(Some(bytes)),
        }
    }

    /// The shards of the slots in `need`, rebuilt from k current ones and clipped.
    fn rebuilt_shards(
        &self,
        ctx: &Ctx,
        name: &[u8],
        st: &super::primary::ObjState,
        need: u64,
    ) -> Result<BTreeMap<usize, Vec<u8>>> {
        let slots = (0..ctx.n()).filter(|s| need & bit(*s) != 0);
        if st.deleted || st.size == 0 {
            return Ok(slots.map(|s| (s, Vec::new())).collect());
        }
        let len = padded_shard_len(ctx, st.size);
        let mut sources: Vec<usize> = (0..ctx.n())
            .filter(|s| st.current & bit(*s) != 0 && ctx.up(*s).is_some())
            .collect();
        sources.sort_by_key(|s| (ctx.acting.members[*s] != Some(self.id), *s));
        sources.truncate(ctx.k());
        if sources.len() < ctx.k() {
            return Err(Error::remote(
                Status::Unavailable,
                format!(
                    "object {}: {} current shard(s) reachable, {} needed to rebuild",
                    String::from_utf8_lossy(name),
                    sources.len(),
                    ctx.k()
                ),
            ));
        }
        let reqs = sources
            .iter()
            .map(|&s| {
                let mut e = self.shard_req_head(ctx, name, s);
                e.u64(st.version).u64(0).u64(len);
                (s, e.finish())
            })
            .collect();
        // Each source's bytes where the reply holds them; only a shard shorter than the padded
        // length (clipped at the object's end) is copied, to pad it with zeros.
        let mut got: HashMap<usize, SourceShard> = HashMap::new();
        for (slot, p) in self.ask_all(ctx, wire::MSG_RECOVERY_READ, reqs)? {
            let mut d = Dec::new(&p);
            d.u64()?;
            d.u16()?;
            let n = d.u32()? as usize;
            let at = d.pos();
            if p.len() - at < n || n as u64 > len {
                return Err(Error::Malformed("recovery read reply is short".into()));
            }
            let src = if n as u64 == len {
                SourceShard::Reply(p.slice(at, n))
            } else {
                let mut v = vec![0u8; len as usize];
                v[..n].copy_from_slice(&p[at..at + n]);
                SourceShard::Padded(v)
            };
            got.insert(slot, src);
        }
        let mut wanted: BTreeMap<usize, Vec<u8>> =
            slots.map(|s| (s, vec![0u8; len as usize])).collect();
        {
            let mut refs: HashMap<usize, &mut Vec<u8>> =
                wanted.iter_mut().map(|(s, v)| (*s, v)).collect();
            let mut all: Vec<Shard> = Vec::with_capacity(ctx.n());
            for s in 0..ctx.n() {
                all.push(match (got.get(&s), refs.remove(&s)) {
                    (Some(v), _) => Shard::Present(v.bytes()),
                    (None, Some(w)) => Shard::Wanted(w),
                    _ => Shard::Missing,
                });
            }
            ctx.codec.reconstruct(&mut all)?;
        }
        for (s, v) in wanted.iter_mut() {
            v.truncate(ctx.clip(*s, st.size) as usize);
        }
        Ok(wanted)
    }
}

/// A source shard for a rebuild: in the reply that brought it, or copied and zero-padded.
enum SourceShard {
    Reply(Payload),
    Padded(Vec<u8>),
}

impl SourceShard {
    fn bytes(&self) -> &[u8] {
        match self {
            SourceShard::Reply(p) => p,
            SourceShard::Padded(v) => v,
        }
    }
}

/// (name, version) entries of a SHARD_SETTLE.
type SettleEntries<'a> = Vec<(&'a [u8], u64)>;

/// A SHARD_SETTLE body after pool and pg: shard u8, n u32, n × (name bytes, version u64).
fn decode_settle<'a>(d: &mut Dec<'a>) -> Result<(u8, SettleEntries<'a>)> {
    let shard = d.u8()?;
    let n = d.u32()? as usize;
    if n > d.remaining() / 12 {
        return Err(Error::Malformed("shard settle: short entry list".into()));
    }
    let entries = (0..n)
        .map(|_| Ok((d.bytes()?, d.u64()?)))
        .collect::<Result<Vec<_>>>()?;
    d.end()?;
    Ok((shard, entries))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(mark: Option<(u8, u64)>, trimmed: u64, entries: &[(u64, &str)]) -> LogInfo {
        LogInfo {
            mark,
            trimmed,
            entries: entries
                .iter()
                .map(|(v, n)| (*v, n.as_bytes().to_vec()))
                .collect(),
        }
    }

    #[test]
    fn log_info_round_trips() {
        let l = log(Some((3, 77)), 4, &[(5, "a"), (9, "bb")]);
        let mut e = Enc::default();
        l.encode(&mut e);
        assert_eq!(LogInfo::decode(&mut Dec::new(&e.0)).unwrap(), l);
        let l = log(None, 0, &[]);
        let mut e = Enc::default();
        l.encode(&mut e);
        assert_eq!(LogInfo::decode(&mut Dec::new(&e.0)).unwrap(), l);
    }

    /// A member back from a short outage is caught up from the others' logs: exactly the
    /// writes it lacks; one without a mark for its slot, or beyond the window, is backfilled.
    #[test]
    fn delta_takes_the_missed_writes_and_falls_back_to_backfill() {
        let mut logs = HashMap::new();
        logs.insert(0, log(Some((0, 10)), 0, &[(5, "a"), (11, "b"), (12, "c")]));
        logs.insert(1, log(Some((1, 10)), 0, &[(5, "a"), (11, "b"), (12, "c")]));
        // Slot 2 was down from version 10: it missed b and c; it got d after coming back.
        logs.insert(2, log(Some((2, 10)), 0, &[(5, "a"), (13, "d")]));
        logs.insert(0, {
            let mut l = logs[&0].clone();
            l.entries.push((13, b"d".to_vec()));
            l
        });
        let (names, backfill) = plan_delta(&logs, &[0, 1, 2]);
        let names: Vec<String> = names
            .into_iter()
            .map(|n| String::from_utf8(n).unwrap())
            .collect();
        // Slot 1 missed d (it is in slot 0's log), slot 2 missed b and c.
        assert_eq!(names, ["b", "c", "d"]);
        assert!(backfill.is_empty());
        // A mark for another slot (a remap) means a scan.
        logs.insert(2, log(Some((5, 10)), 0, &[(5, "a")]));
        assert_eq!(plan_delta(&logs, &[0, 1, 2]).1, vec![2]);
        // A trimmed window that starts after the mark means a scan.
        logs.insert(2, log(Some((2, 3)), 0, &[(5, "a")]));
        logs.insert(0, log(Some((0, 10)), 4, &[(5, "a"), (11, "b")]));
        assert_eq!(plan_delta(&logs, &[0, 1, 2]).1, vec![2]);
        // No mark at all: a scan.
        logs.insert(1, log(None, 0, &[]));
        assert!(plan_delta(&logs, &[0, 1, 2]).1.contains(&1));
    }

    #[test]
    fn window_grows_additively_halves_on_latency_rise_then_pauses() {
        let mut w = (WINDOW_START, 0);
        w = next_window(w, Some((900.0, 1000.0)));
        assert_eq!(w, (WINDOW_START + 1, 0));
        w = next_window(w, Some((1200.0, 1000.0)));
        assert_eq!(w, (WINDOW_START + 2, 0), "1.2x the baseline is fine");
        w = next_window(w, Some((1300.0, 1000.0)));
        assert_eq!(w, ((WINDOW_START + 2) / 2, 0), "1.3x is a rise");
        // A rise of less than the floor on a very fast baseline is noise.
        assert_eq!(next_window((4, 0), Some((300.0, 100.0))), (5, 0));
        // No clients at all: take everything.
        w = next_window(w, None);
        assert_eq!(w, (WINDOW_MAX, 0));
        for _ in 0..100 {
            w = next_window(w, Some((1e6, 10.0)));
        }
        assert_eq!(w, (WINDOW_MIN, PAUSE_MS_MAX), "one in flight, then paced");
        // Clients are fine again: the pause shrinks away before the window grows.
        let mut steps = 0;
        while w.1 > 0 {
            w = next_window(w, Some((10.0, 10.0)));
            steps += 1;
        }
        assert!(steps <= 20 && w == (WINDOW_MIN, 0), "{steps} {w:?}");
        assert_eq!(next_window(w, Some((10.0, 10.0))), (WINDOW_MIN + 1, 0));
        let mut v = vec![5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0];
        assert_eq!(p90(&mut v), Some(10.0));
        assert_eq!(p90(&mut []), None);
    }
}
