//! Op tracking: every client op and shard op a node runs carries a timeline of events
//! (received, throttled, queued, started, sub-ops sent and acked per shard, store commit
//! start/end, replied). Ops slower than the node's `slow_op_ms` are kept in a bounded history,
//! and ops still in flight past it are reported too (`nvstore slow-ops NODE`, health).
//!
//! Cost per op: one allocation (the `TrackedOp`, whose timeline is a fixed array), an insert
//! into one of a few sharded in-flight maps, and an uncontended lock per event. Code deep in
//! the node (fan-out, store commits) records events on the op the current thread runs through
//! a thread-local, so no signature has to carry the op.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use messenger::Identity;
use serde::Serialize;

/// Events one op's timeline holds; later events are counted in `events_dropped`.
pub const EVENTS_MAX: usize = 40;
/// Completed slow ops kept for `slow-ops`.
pub const SLOW_HISTORY_MAX: usize = 64;
/// Health counts ops that were slow within this window (plus those slow and still running).
pub const SLOW_WARN_WINDOW: Duration = Duration::from_secs(60);
/// Slow-op completion times kept for the health count (older ones fall off the window).
const SLOW_RECENT_MAX: usize = 4096;
/// Object-name bytes kept in an op's description.
const NAME_BYTES_MAX: usize = 48;
/// In-flight maps (sharded by op id so op threads rarely meet on one lock).
const INFLIGHT_SHARDS: usize = 8;
/// `shard` of an event that is not about one shard.
pub const NO_SHARD: u8 = u8::MAX;

/// What happened to an op, in the order they usually happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ev {
    /// The messenger handed the message to the node (on the connection's worker).
    Received,
    /// The connection had stopped reading for throttle capacity before this message (the
    /// wait ended as it was received: offset 0; its length is the op's `throttled_ms`).
    Throttled,
    /// Put on its PG's queue (client ops) or the shard queue (shard ops).
    Queued,
    /// An op thread (or shard thread) took it.
    Started,
    /// A shard request went to the member holding `shard`.
    SubOpSent,
    /// The member holding `shard` answered with success.
    SubOpAcked,
    /// The member holding `shard` failed, timed out or was unreachable.
    SubOpFailed,
    /// A local store transaction started committing (waits for group commit).
    CommitStart,
    /// It is durable.
    CommitEnd,
    /// The reply was handed to the messenger.
    Replied,
}

#[derive(Debug, Clone, Copy)]
struct EvRec {
    ev: Ev,
    shard: u8,
    /// Since the op was received.
    at_ns: u64,
}

struct Timeline {
    events: [EvRec; EVENTS_MAX],
    len: usize,
    dropped: u32,
}

/// What the op is (fixed size: no allocation beyond the op itself).
#[derive(Clone, Copy)]
pub struct OpDesc {
    /// "client_op", "shard_write", "shard_read", "shard_stat", "shard_rollback", "shard_drop",
    /// "shard_repair".
    pub kind: &'static str,
    pub peer: Identity,
    pub pool: u64,
    pub pg: u32,
    name: [u8; NAME_BYTES_MAX],
    name_len: u8,
    name_cut: bool,
}

impl OpDesc {
    pub fn new(kind: &'static str, peer: Identity, pool: u64, pg: u32, obj: &[u8]) -> OpDesc {
        let n = obj.len().min(NAME_BYTES_MAX);
        let mut name = [0u8; NAME_BYTES_MAX];
        name[..n].copy_from_slice(&obj[..n]);
        OpDesc {
            kind,
            peer,
            pool,
            pg,
            name,
            name_len: n as u8,
            name_cut: obj.len() > n,
        }
    }

    fn object(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.name[..self.name_len as usize]).into_owned();
        if self.name_cut {
            s.push('…');
        }
        s
    }
}

/// One op being tracked.
pub struct TrackedOp {
    pub id: u64,
    start: Instant,
    start_unix_ms: u64,
    desc: OpDesc,
    throttled: Option<Duration>,
    tl: Mutex<Timeline>,
}

impl TrackedOp {
    /// Records `ev` now. The clock is read under the timeline's lock: sub-op replies arrive
    /// on several threads at once, and a timeline must stay in time order.
    pub fn event(&self, ev: Ev, shard: u8) {
        let mut t = self.tl.lock().unwrap();
        let at_ns = self.start.elapsed().as_nanos() as u64;
        Self::push(&mut t, ev, shard, at_ns);
    }

    fn event_at(&self, ev: Ev, shard: u8, at_ns: u64) {
        Self::push(&mut self.tl.lock().unwrap(), ev, shard, at_ns);
    }

    fn push(t: &mut Timeline, ev: Ev, shard: u8, at_ns: u64) {
        if t.len == EVENTS_MAX {
            t.dropped += 1;
            return;
        }
        let i = t.len;
        t.events[i] = EvRec { ev, shard, at_ns };
        t.len += 1;
    }

    pub fn age(&self) -> Duration {
        self.start.elapsed()
    }

    fn record(&self, duration: Duration, in_flight: bool, status: Option<&str>) -> SlowOp {
        let t = self.tl.lock().unwrap();
        SlowOp {
            id: self.id,
            op: self.desc.kind,
            pool: self.desc.pool,
            pg: format!("{}.{:x}", self.desc.pool, self.desc.pg),
            object: self.desc.object(),
            client: self.desc.peer.to_string(),
            started_unix_ms: self.start_unix_ms,
            duration_ms: duration.as_secs_f64() * 1e3,
            in_flight,
            status: status.map(str::to_string),
            throttled_ms: self.throttled.map(|d| d.as_secs_f64() * 1e3),
            events: t.events[..t.len]
                .iter()
                .map(|e| SlowEvent {
                    event: e.ev,
                    shard: (e.shard != NO_SHARD).then_some(e.shard),
                    offset_ms: e.at_ns as f64 / 1e6,
                })
                .collect(),
            events_dropped: t.dropped,
        }
    }
}

/// One event of a reported op.
#[derive(Debug, Clone, Serialize)]
pub struct SlowEvent {
    pub event: Ev,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<u8>,
    /// Milliseconds since the op was received.
    pub offset_ms: f64,
}

/// A slow op as `slow-ops` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct SlowOp {
    pub id: u64,
    pub op: &'static str,
    pub pool: u64,
    pub pg: String,
    pub object: String,
    /// The sender: `client.N` for client ops, `node.N` (the primary) for shard ops.
    pub client: String,
    pub started_unix_ms: u64,
    /// Total so far for an op still in flight.
    pub duration_ms: f64,
    pub in_flight: bool,
    /// The reply's status ("ok" or the error); absent while in flight.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// How long its connection waited for throttle capacity before it was received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throttled_ms: Option<f64>,
    pub events: Vec<SlowEvent>,
    pub events_dropped: u32,
}

/// What `slow-ops` returns.
#[derive(Debug, Clone, Serialize)]
pub struct SlowOpsReport {
    pub node: u32,
    pub threshold_ms: u64,
    /// Ops that went over the threshold since the node started.
    pub slow_total: u64,
    /// Ops still running that are already over the threshold, oldest first.
    pub in_flight: Vec<SlowOp>,
    /// The last completed slow ops, newest last (at most `history_max`).
    pub history: Vec<SlowOp>,
    pub history_max: usize,
}

/// A node's op tracker.
pub struct OpTracker {
    /// The slow-op threshold in nanoseconds (`slow_op_ms`; `nvstore config set` changes it).
    threshold_ns: AtomicU64,
    next_id: AtomicU64,
    inflight: [Mutex<HashMap<u64, Arc<TrackedOp>>>; INFLIGHT_SHARDS],
    history: Mutex<VecDeque<SlowOp>>,
    /// (finished at, duration) of recent slow ops, for health.
    recent: Mutex<VecDeque<(Instant, Duration)>>,
    slow_total: AtomicU64,
    ops_total: AtomicU64,
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<TrackedOp>>> = const { RefCell::new(None) };
}

/// Record an event on the op the calling thread is running (nothing when it runs none).
pub fn event(ev: Ev, shard: u8) {
    CURRENT.with(|c| {
        if let Some(op) = &*c.borrow() {
            op.event(ev, shard);
        }
    });
}

/// The calling thread's current op, to record events for it from other threads (a shard
/// reply's callback on a messenger worker).
pub fn current() -> Option<Arc<TrackedOp>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Makes `op` the calling thread's current op until dropped.
pub struct CurrentGuard(Option<Arc<TrackedOp>>);

impl CurrentGuard {
    pub fn set(op: &Arc<TrackedOp>) -> CurrentGuard {
        CurrentGuard(CURRENT.with(|c| c.borrow_mut().replace(op.clone())))
    }
}

impl Drop for CurrentGuard {
    fn drop(&mut self) {
        let prev = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = prev);
    }
}

impl OpTracker {
    pub fn new(threshold: Duration) -> OpTracker {
        OpTracker {
            threshold_ns: AtomicU64::new(threshold.as_nanos() as u64),
            next_id: AtomicU64::new(1),
            inflight: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            history: Mutex::new(VecDeque::with_capacity(SLOW_HISTORY_MAX)),
            recent: Mutex::new(VecDeque::new()),
            slow_total: AtomicU64::new(0),
            ops_total: AtomicU64::new(0),
        }
    }

    pub fn threshold(&self) -> Duration {
        Duration::from_nanos(self.threshold_ns.load(Relaxed))
    }

    pub fn set_threshold(&self, d: Duration) {
        self.threshold_ns.store(d.as_nanos() as u64, Relaxed);
    }

    /// Start tracking an op received now; `throttled` is how long its connection waited for
    /// throttle capacity first.
    pub fn begin(&self, desc: OpDesc, throttled: Option<Duration>) -> Arc<TrackedOp> {
        let id = self.next_id.fetch_add(1, Relaxed);
        let op = Arc::new(TrackedOp {
            id,
            start: Instant::now(),
            start_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            desc,
            throttled,
            tl: Mutex::new(Timeline {
                events: [EvRec {
                    ev: Ev::Received,
                    shard: NO_SHARD,
                    at_ns: 0,
                }; EVENTS_MAX],
                len: 1,
                dropped: 0,
            }),
        });
        if throttled.is_some() {
            op.event_at(Ev::Throttled, NO_SHARD, 0);
        }
        self.inflight[id as usize % INFLIGHT_SHARDS]
            .lock()
            .unwrap()
            .insert(id, op.clone());
        op
    }

    /// The op was answered (`status`: "ok" or the error): stop tracking it, and keep it
    /// when it was slow.
    pub fn finish(&self, op: &Arc<TrackedOp>, status: &str) {
        op.event(Ev::Replied, NO_SHARD);
        self.inflight[op.id as usize % INFLIGHT_SHARDS]
            .lock()
            .unwrap()
            .remove(&op.id);
        self.ops_total.fetch_add(1, Relaxed);
        let d = op.age();
        if d < self.threshold() {
            return;
        }
        self.slow_total.fetch_add(1, Relaxed);
        let rec = op.record(d, false, Some(status));
        {
            let mut h = self.history.lock().unwrap();
            if h.len() == SLOW_HISTORY_MAX {
                h.pop_front();
            }
            h.push_back(rec);
        }
        let mut r = self.recent.lock().unwrap();
        if r.len() == SLOW_RECENT_MAX {
            r.pop_front();
        }
        r.push_back((Instant::now(), d));
    }

    /// Ops in flight for at least the threshold, oldest first.
    fn slow_in_flight(&self) -> Vec<Arc<TrackedOp>> {
        let mut v: Vec<Arc<TrackedOp>> = self
            .inflight
            .iter()
            .flat_map(|m| {
                m.lock()
                    .unwrap()
                    .values()
                    .filter(|o| o.age() >= self.threshold())
                    .cloned()
                    .collect::<Vec<_>>()
            })
            .collect();
        v.sort_by_key(|o| std::cmp::Reverse(o.age()));
        v
    }

    pub fn report(&self, node: u32) -> SlowOpsReport {
        SlowOpsReport {
            node,
            threshold_ms: self.threshold().as_millis() as u64,
            slow_total: self.slow_total.load(Relaxed),
            in_flight: self
                .slow_in_flight()
                .iter()
                .map(|o| o.record(o.age(), true, None))
                .collect(),
            history: self.history.lock().unwrap().iter().cloned().collect(),
            history_max: SLOW_HISTORY_MAX,
        }
    }

    /// For health: (ops slow within [`SLOW_WARN_WINDOW`] or slow and still running, the
    /// longest of their durations in ms).
    pub fn health(&self) -> (u64, u64) {
        let now = Instant::now();
        let mut r = self.recent.lock().unwrap();
        while r
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > SLOW_WARN_WINDOW)
        {
            r.pop_front();
        }
        let mut n = r.len() as u64;
        let mut longest = r.iter().map(|(_, d)| *d).max().unwrap_or_default();
        drop(r);
        for o in self.slow_in_flight() {
            n += 1;
            longest = longest.max(o.age());
        }
        (n, longest.as_millis() as u64)
    }

    /// (ops finished, slow ops) since start.
    pub fn totals(&self) -> (u64, u64) {
        (self.ops_total.load(Relaxed), self.slow_total.load(Relaxed))
    }

    /// Ops in flight now.
    pub fn in_flight(&self) -> u64 {
        self.inflight
            .iter()
            .map(|m| m.lock().unwrap().len() as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> OpDesc {
        OpDesc::new("client_op", Identity::Client(7), 1, 0x1f, b"obj")
    }

    #[test]
    fn fast_ops_are_not_kept_and_slow_ones_are_with_their_timeline() {
        let t = OpTracker::new(Duration::from_millis(20));
        let fast = t.begin(desc(), None);
        t.finish(&fast, "ok");
        assert_eq!(t.report(1).history.len(), 0);
        assert_eq!(t.totals(), (1, 0));

        let slow = t.begin(desc(), Some(Duration::from_millis(3)));
        {
            let _g = CurrentGuard::set(&slow);
            event(Ev::Started, NO_SHARD);
            event(Ev::SubOpSent, 2);
            std::thread::sleep(Duration::from_millis(25));
            event(Ev::SubOpAcked, 2);
        }
        // Not current any more: no event lands.
        event(Ev::CommitStart, NO_SHARD);
        let r = t.report(1);
        assert_eq!(r.in_flight.len(), 1, "slow and still running");
        assert!(r.in_flight[0].in_flight);
        t.finish(&slow, "ok");
        let r = t.report(1);
        assert!(r.in_flight.is_empty());
        assert_eq!(r.history.len(), 1);
        let h = &r.history[0];
        assert_eq!(h.object, "obj");
        assert_eq!(h.pg, "1.1f");
        assert_eq!(h.client, "client.7");
        let evs: Vec<Ev> = h.events.iter().map(|e| e.event).collect();
        assert_eq!(
            evs,
            [
                Ev::Received,
                Ev::Throttled,
                Ev::Started,
                Ev::SubOpSent,
                Ev::SubOpAcked,
                Ev::Replied
            ]
        );
        assert_eq!(h.events[3].shard, Some(2));
        assert!(h.duration_ms >= 20.0);
        assert_eq!(h.throttled_ms, Some(3.0));
        assert!(h
            .events
            .windows(2)
            .all(|w| w[0].offset_ms <= w[1].offset_ms));
        assert_eq!(t.health().0, 1);
    }

    #[test]
    fn timeline_and_history_are_bounded() {
        let t = OpTracker::new(Duration::ZERO);
        let op = t.begin(desc(), None);
        for _ in 0..EVENTS_MAX + 5 {
            op.event(Ev::SubOpSent, 0);
        }
        t.finish(&op, "ok");
        let r = t.report(1);
        assert_eq!(r.history[0].events.len(), EVENTS_MAX);
        // Received and the first EVENTS_MAX - 1 sends fit; 6 sends and the reply fell off.
        assert_eq!(r.history[0].events_dropped, 7);
        for _ in 0..SLOW_HISTORY_MAX + 3 {
            let o = t.begin(desc(), None);
            t.finish(&o, "ok");
        }
        assert_eq!(t.report(1).history.len(), SLOW_HISTORY_MAX);
        assert_eq!(t.totals().1, SLOW_HISTORY_MAX as u64 + 4);
    }

    /// Threads tracking ops at once through one tracker (begin, current-op guard, 10 events,
    /// finish) leave nothing behind: no op in flight, none slow. Prints the cost per tracked
    /// op for information (`-- --nocapture`); it asserts no timing.
    #[test]
    fn tracker_cost() {
        const OPS: usize = 5_000;
        let t = std::sync::Arc::new(OpTracker::new(Duration::from_secs(5)));
        let one_round = |t: &OpTracker| {
            let start = Instant::now();
            for _ in 0..OPS {
                let op = t.begin(desc(), None);
                let _g = CurrentGuard::set(&op);
                for s in 0..5u8 {
                    event(Ev::SubOpSent, s);
                    event(Ev::SubOpAcked, s);
                }
                t.finish(&op, "ok");
            }
            start.elapsed().as_nanos() as f64 / OPS as f64
        };
        for threads in [1usize, 4] {
            let mut rounds: Vec<f64> = (0..5)
                .map(|_| {
                    std::thread::scope(|s| {
                        let hs: Vec<_> = (0..threads).map(|_| s.spawn(|| one_round(&t))).collect();
                        hs.into_iter().map(|h| h.join().unwrap()).sum::<f64>() / threads as f64
                    })
                })
                .collect();
            rounds.sort_by(f64::total_cmp);
            println!(
                "{threads} thread(s): median {:.0} ns per tracked op",
                rounds[2]
            );
        }
        assert_eq!(t.totals().1, 0, "no op was slow");
        let r = t.report(1);
        assert!(r.history.is_empty() && r.in_flight.is_empty(), "{r:?}");
    }
}
