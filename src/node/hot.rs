//! Hot objects: read coalescing at the primary, a small cache of hot objects' bytes, and a
//! detector that names the hottest objects.
//!
//! **Coalescing.** When an op thread takes a read-only op off a PG's queue it also takes the
//! read-only ops queued behind it for the same object, up to the first op that may change
//! that object (ops on other objects stay where they are). They are served together: one
//! resolve, then one shard fetch and decode per group of overlapping ranges, and every
//! request's reply points into the same buffer (no per-reply copy). Arrival order semantics
//! hold: everything taken was queued before any later mutation of the object, and every
//! mutation queued before them has finished, so each read sees exactly the writes that were
//! acknowledged before it was queued, plus possibly writes queued before it.
//!
//! **Pacing.** A large coalesced reply is handed to the messenger only when the coalesced
//! bytes it still holds leave room under [`REPLY_BYTES_INFLIGHT_MAX`] (a drop guard on each
//! shared view counts them): a hundred 4 MiB replies queued at once would make every other
//! message this node sends (a probe's reply, shard requests) wait behind them.
//!
//! **Cache.** Bytes read for a hot object (or for a coalesced group) are kept, up to
//! `hot_cache_bytes` per node, keyed by (pool, name) and tagged with the version, size and
//! mtime the primary resolved. A lookup uses the freshly resolved state, so a different version
//! never matches; a write through this primary drops the object's entry as well.
//!
//! **Detector.** A space-saving top-k ([`TopK`], k = [`TOPK_ENTRIES`]) of (pool, object) by
//! read ops, with counts in a sliding window of [`WINDOW`], a bitmap estimate of the distinct
//! clients, and how many data reads were absorbed (served without a fetch of their own).
//! The heartbeat carries the entries above [`HOT_OPS_S_MIN`]; `nvstore status` names them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use messenger::{Identity, Incoming, Payload, SendBuf};
use serde::{Deserialize, Serialize};

use super::primary::{self, Extent, ObjState, PgCache, RangeBytes, OP_ATTEMPTS_MAX};
use super::{Job, Node};
use crate::error::{Error, Result};
use crate::ops::{self, ClientOp, ObjStat, OpResult, SubOp};
use crate::optrack::{CurrentGuard, Ev, TrackedOp, NO_SHARD};
use crate::wire::{Enc, Status};

/// Objects the detector tracks.
pub const TOPK_ENTRIES: usize = 16;
/// The detector's rate window.
pub const WINDOW: Duration = Duration::from_secs(4);
/// Bits of each entry's distinct-client bitmap (linear counting).
const CLIENT_BITS: usize = 1024;
/// Objects read at least this often are hot: reported, and their bytes cached.
pub const HOT_OPS_S_MIN: f64 = 5.0;
/// Hot objects one heartbeat reports.
pub const HOT_REPORT_MAX: usize = 8;
/// Ops served by one coalesced batch.
const BATCH_OPS_MAX: usize = 256;
/// Queued ops looked at when building a batch.
const QUEUE_SCAN_MAX: usize = 1024;
/// Largest range the cache keeps.
const CACHE_ENTRY_BYTES_MAX: usize = 16 << 20;
/// Objects the cache keeps at most (eviction scans them).
const CACHE_ENTRIES_MAX: usize = 256;
/// Coalesced reply bytes the messenger may hold before large replies wait for it to drain.
const REPLY_BYTES_INFLIGHT_MAX: u64 = 4 << 20;
/// Replies this large are paced; smaller ones (a probe's) never wait.
const PACED_REPLY_BYTES_MIN: u64 = 256 << 10;
/// Longest a reply waits for room.
const PACE_WAIT_MAX: Duration = Duration::from_secs(2);
/// Default `hot_cache_bytes`.
pub const CACHE_BYTES_DEFAULT: u64 = 64 << 20;

const _: () = assert!(CACHE_ENTRY_BYTES_MAX as u64 <= CACHE_BYTES_DEFAULT);
const _: () = assert!(HOT_REPORT_MAX <= TOPK_ENTRIES);

/// A hot object as a heartbeat and `StatusReport` carry it.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct HotObject {
    pub pool: u64,
    /// The object name (lossy UTF-8).
    pub name: String,
    /// Read ops per second over the last [`WINDOW`].
    pub ops_s: f64,
    /// Distinct clients over the window (estimate).
    pub clients: u32,
    /// Percent of its data reads served without a fetch of their own (coalesced or cached).
    pub coalesced_pct: f64,
    /// The node that reported it (its primary).
    #[serde(default)]
    pub node: u32,
}

// ---- detector -----------------------------------------------------------------------------

#[derive(Clone, Copy, Default)]
struct Counts {
    reads: u64,
    data_reads: u64,
    absorbed: u64,
}

impl Counts {
    fn add(&mut self, o: Counts) {
        self.reads += o.reads;
        self.data_reads += o.data_reads;
        self.absorbed += o.absorbed;
    }
}

struct Entry {
    pool: u64,
    name: Vec<u8>,
    cur: Counts,
    prev: Counts,
    /// Reads inherited from the entry this one replaced (space-saving's overestimate), per
    /// window.
    err_cur: u64,
    err_prev: u64,
    clients_cur: Box<[u64; CLIENT_BITS / 64]>,
    clients_prev: Box<[u64; CLIENT_BITS / 64]>,
}

impl Entry {
    fn new(pool: u64, name: &[u8]) -> Entry {
        Entry {
            pool,
            name: name.to_vec(),
            cur: Counts::default(),
            prev: Counts::default(),
            err_cur: 0,
            err_prev: 0,
            clients_cur: Box::new([0; CLIENT_BITS / 64]),
            clients_prev: Box::new([0; CLIENT_BITS / 64]),
        }
    }

    /// Reads over the sliding window: the current window plus the share of the previous one
    /// still inside it.
    fn estimate(&self, weight: f64) -> f64 {
        self.cur.reads as f64 + self.prev.reads as f64 * weight
    }

    /// The reads certainly of this object (the estimate less what it inherited).
    fn guaranteed(&self, weight: f64) -> f64 {
        self.estimate(weight) - (self.err_cur as f64 + self.err_prev as f64 * weight)
    }

    /// Linear counting over both windows' bitmaps.
    fn clients(&self) -> u32 {
        let set: u32 = self
            .clients_cur
            .iter()
            .zip(self.clients_prev.iter())
            .map(|(a, b)| (a | b).count_ones())
            .sum();
        let m = CLIENT_BITS as f64;
        let zeros = m - set as f64;
        if zeros < 1.0 {
            // Saturated: at least this many.
            return (m * m.ln()) as u32;
        }
        (m * (m / zeros).ln()).round() as u32
    }
}

/// Space-saving top-k of (pool, object) by read ops over a sliding window.
pub struct TopK {
    entries: Vec<Entry>,
    window_start: Instant,
}

impl TopK {
    pub fn new(now: Instant) -> TopK {
        TopK {
            entries: Vec::with_capacity(TOPK_ENTRIES),
            window_start: now,
        }
    }

    fn rotate(&mut self, now: Instant) {
        let el = now.saturating_duration_since(self.window_start);
        if el < WINDOW {
            return;
        }
        let two = el >= WINDOW * 2;
        for e in &mut self.entries {
            e.prev = if two { Counts::default() } else { e.cur };
            e.cur = Counts::default();
            e.err_prev = if two { 0 } else { e.err_cur };
            e.err_cur = 0;
            *e.clients_prev = if two {
                [0; CLIENT_BITS / 64]
            } else {
                *e.clients_cur
            };
            *e.clients_cur = [0; CLIENT_BITS / 64];
        }
        self.entries.retain(|e| e.prev.reads > 0 || e.cur.reads > 0);
        self.window_start = if two { now } else { self.window_start + WINDOW };
    }

    /// Weight of the previous window in the sliding estimate.
    fn weight(&self, now: Instant) -> f64 {
        let el = now
            .saturating_duration_since(self.window_start)
            .as_secs_f64();
        (1.0 - el / WINDOW.as_secs_f64()).clamp(0.0, 1.0)
    }

    /// Count `n` read ops of one object by `client`: `data` of them read bytes, `absorbed` of
    /// those were served without a fetch of their own.
    pub fn record(&mut self, pool: u64, name: &[u8], client: u64, c: RecordCounts, now: Instant) {
        self.rotate(now);
        let w = self.weight(now);
        let i = match self
            .entries
            .iter()
            .position(|e| e.pool == pool && e.name == name)
        {
            Some(i) => i,
            None if self.entries.len() < TOPK_ENTRIES => {
                self.entries.push(Entry::new(pool, name));
                self.entries.len() - 1
            }
            None => {
                // Space-saving: the newcomer takes the least entry's place and count (an upper
                // bound of its own), so a heavy hitter cannot be pushed out by churn.
                let (i, _) = self
                    .entries
                    .iter()
                    .enumerate()
                    .min_by(|a, b| a.1.estimate(w).total_cmp(&b.1.estimate(w)))
                    .expect("full");
                let old = &mut self.entries[i];
                old.pool = pool;
                old.name = name.to_vec();
                old.err_cur = old.cur.reads;
                old.err_prev = old.prev.reads;
                (old.cur.data_reads, old.cur.absorbed) = (0, 0);
                (old.prev.data_reads, old.prev.absorbed) = (0, 0);
                *old.clients_cur = [0; CLIENT_BITS / 64];
                *old.clients_prev = [0; CLIENT_BITS / 64];
                i
            }
        };
        let e = &mut self.entries[i];
        e.cur.add(Counts {
            reads: c.reads,
            data_reads: c.data_reads,
            absorbed: c.absorbed,
        });
        let bit = (client % CLIENT_BITS as u64) as usize;
        e.clients_cur[bit / 64] |= 1 << (bit % 64);
    }

    /// Read ops per second of one object, at least (0 when it is not tracked).
    pub fn rate(&mut self, pool: u64, name: &[u8], now: Instant) -> f64 {
        self.rotate(now);
        let w = self.weight(now);
        self.entries
            .iter()
            .find(|e| e.pool == pool && e.name == name)
            .map_or(0.0, |e| e.guaranteed(w) / WINDOW.as_secs_f64())
    }

    /// The tracked objects read at least `min_ops_s`, hottest first, at most `max`.
    pub fn hottest(&mut self, min_ops_s: f64, max: usize, now: Instant) -> Vec<HotObject> {
        self.rotate(now);
        let w = self.weight(now);
        let secs = WINDOW.as_secs_f64();
        let mut out: Vec<HotObject> = self
            .entries
            .iter()
            .map(|e| {
                let data = e.cur.data_reads as f64 + e.prev.data_reads as f64 * w;
                let absorbed = e.cur.absorbed as f64 + e.prev.absorbed as f64 * w;
                HotObject {
                    pool: e.pool,
                    name: String::from_utf8_lossy(&e.name).into_owned(),
                    ops_s: e.guaranteed(w) / secs,
                    clients: e.clients(),
                    coalesced_pct: if data > 0.0 {
                        100.0 * absorbed / data
                    } else {
                        0.0
                    },
                    node: 0,
                }
            })
            .filter(|h| h.ops_s >= min_ops_s)
            .collect();
        out.sort_by(|a, b| b.ops_s.total_cmp(&a.ops_s));
        out.truncate(max);
        out
    }
}

/// What one batch did for one client, as the detector counts it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordCounts {
    pub reads: u64,
    pub data_reads: u64,
    pub absorbed: u64,
}

// ---- cache --------------------------------------------------------------------------------

/// Slices at least this long share their range's crc. The threshold dates from crc-fast's
/// combine (a GF(2) matrix squaring per bit of the length: 10–17 µs, a 40× loss on a 4 KiB
/// reply); `checksum::crc32c_combine` now takes ~0.07 µs against 0.65 µs to sum 4 KiB, so
/// smaller replies could share too. A range whose crc came with its shard reads
/// ([`Node::read_range_as`]) is never summed, whatever its length.
const CRC_SHARE_BYTES_MIN: usize = 1 << 20;

/// A view into a shared buffer, sent without a copy. Views of the same range share one
/// crc (`crc`): the frame checksum of a hundred identical replies is computed once.
struct Slice {
    data: Arc<Vec<u8>>,
    at: usize,
    len: usize,
    crc: Arc<OnceLock<u32>>,
    inflight: Arc<Inflight>,
}

impl Slice {
    fn new(
        data: Arc<Vec<u8>>,
        at: usize,
        len: usize,
        crc: Arc<OnceLock<u32>>,
        inflight: &Arc<Inflight>,
    ) -> Slice {
        assert!(at + len <= data.len(), "slice inside its buffer");
        inflight.add(len as u64);
        Slice {
            data,
            at,
            len,
            crc,
            inflight: inflight.clone(),
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.data[self.at..self.at + self.len]
    }
}

// SAFETY: the bytes are a range of a Vec behind an Arc this slice holds (checked in `new`);
// nobody mutates a shared Vec, so they stay valid and unchanged while the slice lives.
unsafe impl messenger::RawBytes for Slice {
    fn raw(&self) -> (*const u8, usize) {
        (self.bytes().as_ptr(), self.len)
    }

    fn crc32c_append(&self, crc: u32) -> u32 {
        if let Some(&own) = self.crc.get() {
            return messenger::checksum::crc32c_combine(crc, own, self.len);
        }
        if self.len < CRC_SHARE_BYTES_MIN {
            return messenger::checksum::crc32c_append(crc, self.bytes());
        }
        let own = *self
            .crc
            .get_or_init(|| messenger::checksum::crc32c(self.bytes()));
        messenger::checksum::crc32c_combine(crc, own, self.len)
    }
}

/// A range's extents as reply parts, by reference ([`ExtentSlice`]); zeros past a shard's
/// data as small buffers. The last part holds the reply's `len` bytes in `inflight`.
fn extent_parts(x: Vec<Extent>, len: usize, inflight: &Arc<Inflight>) -> Vec<SendBuf> {
    let mut parts = Vec::with_capacity(x.len() + 1);
    for e in x {
        if !e.data.is_empty() {
            parts.push(SendBuf::Raw(Box::new(ExtentSlice {
                data: e.data,
                crc: e.crc,
                account: None,
            })));
        }
        if e.zeros > 0 {
            parts.push(SendBuf::Vec(vec![0; e.zeros]));
        }
    }
    inflight.add(len as u64);
    parts.push(SendBuf::Raw(Box::new(ExtentSlice {
        data: Payload::default(),
        crc: Some(0),
        account: Some((inflight.clone(), len as u64)),
    })));
    parts
}

/// A stripe unit of a range in a member's reply, sent without a copy.
struct ExtentSlice {
    data: Payload,
    /// CRC-32C of `data` from the member's chunk CRCs.
    crc: Option<u32>,
    /// On the reply's last part: the bytes it counted in the node's unsent replies.
    account: Option<(Arc<Inflight>, u64)>,
}

// SAFETY: the bytes are a received payload this part holds a reference to; nobody writes a
// received payload, so they stay valid and unchanged while the part lives.
unsafe impl messenger::RawBytes for ExtentSlice {
    fn raw(&self) -> (*const u8, usize) {
        (self.data.as_ptr(), self.data.len())
    }

    fn crc32c_append(&self, crc: u32) -> u32 {
        match self.crc {
            Some(own) => messenger::checksum::crc32c_combine(crc, own, self.data.len()),
            None => messenger::checksum::crc32c_append(crc, &self.data),
        }
    }
}

impl Drop for ExtentSlice {
    fn drop(&mut self) {
        if let Some((inflight, n)) = self.account.take() {
            inflight.sub(n);
        }
    }
}

impl Drop for Slice {
    /// The messenger wrote the reply (or dropped it with its connection).
    fn drop(&mut self) {
        self.inflight.sub(self.len as u64);
    }
}

/// Bytes of coalesced replies made and not yet written by the messenger.
#[derive(Default)]
pub struct Inflight {
    bytes: Mutex<u64>,
    drained: Condvar,
}

impl Inflight {
    fn add(&self, n: u64) {
        *self.bytes.lock().unwrap() += n;
    }

    fn sub(&self, n: u64) {
        *self.bytes.lock().unwrap() -= n;
        self.drained.notify_all();
    }

    pub fn bytes(&self) -> u64 {
        *self.bytes.lock().unwrap()
    }

    /// Wait until a reply of `next` bytes fits in `max` besides the `unsent` bytes the caller
    /// made and holds (or `timeout` passes: a stuck client must not stall the PG for good).
    fn wait_room(&self, next: u64, unsent: u64, max: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut b = self.bytes.lock().unwrap();
        loop {
            let sent = b.saturating_sub(unsent);
            let now = Instant::now();
            if sent == 0 || sent + next <= max || now >= deadline {
                return;
            }
            b = self.drained.wait_timeout(b, deadline - now).unwrap().0;
        }
    }
}

/// What identifies the bytes of one version of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    pub version: u64,
    pub size: u64,
    pub mtime_unix_ns: u64,
}

impl Tag {
    fn of(st: &ObjState) -> Tag {
        Tag {
            version: st.version,
            size: st.size,
            mtime_unix_ns: st.mtime_unix_ns,
        }
    }
}

struct CacheEntry {
    tag: Tag,
    offset: u64,
    data: Arc<Vec<u8>>,
    last_use: u64,
}

/// Recently read bytes of hot objects, bounded in bytes.
pub struct DataCache {
    bytes_max: u64,
    bytes: u64,
    tick: u64,
    entries: HashMap<(u64, Vec<u8>), CacheEntry>,
}

impl DataCache {
    pub fn new(bytes_max: u64) -> DataCache {
        DataCache {
            bytes_max,
            bytes: 0,
            tick: 0,
            entries: HashMap::new(),
        }
    }

    /// Bytes `[off, off + len)` of the object at `tag`, as (buffer, where they start in it).
    pub fn get(
        &mut self,
        pool: u64,
        name: &[u8],
        tag: Tag,
        off: u64,
        len: u64,
    ) -> Option<(Arc<Vec<u8>>, usize)> {
        self.tick += 1;
        let e = self.entries.get_mut(&(pool, name.to_vec()))?;
        if e.tag != tag || off < e.offset || off + len > e.offset + e.data.len() as u64 {
            return None;
        }
        e.last_use = self.tick;
        Some((e.data.clone(), (off - e.offset) as usize))
    }

    pub fn insert(&mut self, pool: u64, name: &[u8], tag: Tag, offset: u64, data: Arc<Vec<u8>>) {
        let n = data.len() as u64;
        if data.len() > CACHE_ENTRY_BYTES_MAX || n > self.bytes_max {
            return;
        }
        if let Some(e) = self.entries.get(&(pool, name.to_vec())) {
            // Keep the wider range of the same version (a whole-object read over a piece).
            if e.tag == tag && e.data.len() >= data.len() {
                return;
            }
        }
        self.invalidate(pool, name);
        while !self.entries.is_empty()
            && (self.bytes + n > self.bytes_max || self.entries.len() >= CACHE_ENTRIES_MAX)
        {
            let lru = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| k.clone())
                .expect("not empty");
            let e = self.entries.remove(&lru).expect("present");
            self.bytes -= e.data.len() as u64;
        }
        self.tick += 1;
        self.bytes += n;
        self.entries.insert(
            (pool, name.to_vec()),
            CacheEntry {
                tag,
                offset,
                data,
                last_use: self.tick,
            },
        );
    }

    pub fn invalidate(&mut self, pool: u64, name: &[u8]) {
        if let Some(e) = self.entries.remove(&(pool, name.to_vec())) {
            self.bytes -= e.data.len() as u64;
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

// ---- the node's part ----------------------------------------------------------------------

/// Cumulative counters of the read path's sharing.
#[derive(Default)]
pub struct HotCounters {
    /// Client ops served as part of a batch of more than one.
    pub batched_ops: AtomicU64,
    /// Data reads served by another read's fetch in the same batch.
    pub coalesced_reads: AtomicU64,
    /// Data reads served from the cache.
    pub cache_hits: AtomicU64,
    /// Shard fetches (with decode when degraded) done for client reads.
    pub read_fetches: AtomicU64,
    /// Of those, fetches whose bytes' CRC came from the members' chunk CRCs: their replies
    /// were sent without a pass to sum the bytes.
    pub crc_known_fetches: AtomicU64,
    /// Large replies that waited their turn behind other replies (hot objects only).
    pub paced_replies: AtomicU64,
    /// Read-only ops answered on the messenger worker that received them, from the cached
    /// object state and the cache, without a hand-off to an op thread.
    pub inline_reads: AtomicU64,
}

/// The node's hot-object state.
pub struct Hot {
    /// Read coalescing and the cache (`read_coalescing`; `nvstore config set` changes it).
    enabled: AtomicBool,
    pub inflight: Arc<Inflight>,
    pub topk: Mutex<TopK>,
    pub cache: Mutex<DataCache>,
    pub counters: HotCounters,
}

impl Hot {
    pub fn new(enabled: bool, cache_bytes: u64) -> Hot {
        Hot {
            enabled: AtomicBool::new(enabled),
            inflight: Arc::new(Inflight::default()),
            topk: Mutex::new(TopK::new(Instant::now())),
            cache: Mutex::new(DataCache::new(if enabled { cache_bytes } else { 0 })),
            counters: HotCounters::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Relaxed)
    }

    /// Switch coalescing and the cache on (with `cache_bytes`) or off (the cache is emptied).
    pub fn set_enabled(&self, on: bool, cache_bytes: u64) {
        self.enabled.store(on, Relaxed);
        *self.cache.lock().unwrap() = DataCache::new(if on { cache_bytes } else { 0 });
    }

    /// A write through this primary: drop the object's cached bytes.
    pub fn invalidate(&self, pool: u64, name: &[u8]) {
        self.cache.lock().unwrap().invalidate(pool, name);
    }

    pub fn hottest(&self) -> Vec<HotObject> {
        self.topk
            .lock()
            .unwrap()
            .hottest(HOT_OPS_S_MIN, HOT_REPORT_MAX, Instant::now())
    }
}

fn client_hash(who: Identity) -> u64 {
    let mut h = DefaultHasher::new();
    who.hash(&mut h);
    h.finish()
}

/// The object a request is on, when the request only reads it.
fn read_only(payload: &[u8]) -> Option<(u64, &[u8])> {
    let op = ClientOp::decode(payload).ok()?;
    let reads = op.flags & ops::FLAG_STAGED == 0 && !op.ops.iter().any(|o| o.is_mutation());
    reads.then_some((op.pool, op.name))
}

/// Which queued requests (by index) join a batch led by the read-only request `first`: the
/// read-only ones on the same object, up to the first one that may change it (or does not
/// decode, so may be anything). Pure, so it can be tested without a network.
pub fn batch_indices<'a>(first: &[u8], queued: impl Iterator<Item = &'a [u8]>) -> Vec<usize> {
    let Some((pool, name)) = read_only(first) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, p) in queued.enumerate().take(QUEUE_SCAN_MAX) {
        if out.len() + 1 >= BATCH_OPS_MAX {
            break;
        }
        match ClientOp::decode(p) {
            Ok(op) if op.pool == pool && op.name == name => {
                if op.flags & ops::FLAG_STAGED != 0 || op.ops.iter().any(|o| o.is_mutation()) {
                    break;
                }
                out.push(i);
            }
            Ok(_) => {}
            // Its object is unknown: it cannot be passed.
            Err(_) => break,
        }
    }
    out
}

/// Take `first` and the queued requests that join it (see [`batch_indices`]).
pub fn take_batch(first: Job, queue: &mut VecDeque<Job>) -> Vec<Job> {
    let idx = batch_indices(first.0.payload(), queue.iter().map(|m| &m.0.payload()[..]));
    let mut out = Vec::with_capacity(idx.len() + 1);
    out.push(first);
    for i in idx.iter().rev() {
        out.push(queue.remove(*i).expect("index from this queue"));
    }
    out[1..].reverse();
    out
}

/// One read range a batch needs: [lo, hi) of the object.
struct Fetch {
    lo: u64,
    hi: u64,
    data: Option<Arc<Vec<u8>>>,
    at: usize,
    err: Option<(Status, String)>,
    /// CRC-32C of the whole range, once a reply of exactly it computed it.
    crc: Arc<OnceLock<u32>>,
    /// The range's bytes left in the members' replies, for the one reply that sends them
    /// (instead of `data`).
    extents: Option<Vec<Extent>>,
}

/// Merge ranges that overlap or touch; returns the merged ranges.
fn merge_ranges(mut r: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (lo, hi) in r {
        match out.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

impl Node {
    /// Run the client ops an op thread took off a PG's queue and reply to each.
    pub(super) fn run_jobs(&self, jobs: Vec<Job>, cache: &Mutex<PgCache>) {
        let read = jobs
            .first()
            .and_then(|j| read_only(j.0.payload()).map(|(p, n)| (p, n.to_vec())));
        for (_, op) in &jobs {
            op.event(Ev::Started, NO_SHARD);
        }
        match read {
            Some((pool, name)) if self.hot.enabled() => {
                let (mut msgs, ops): (Vec<Incoming>, Vec<Arc<TrackedOp>>) =
                    jobs.into_iter().unzip();
                // The batch's shard requests are recorded on the op that leads it.
                let (rs, counts) = {
                    let _current = CurrentGuard::set(&ops[0]);
                    self.run_read_batch(&msgs, cache)
                };
                let mut unsent: u64 = rs.iter().map(shared_bytes).sum();
                // Only hot objects' replies are paced: a lone read of a cold object (a
                // sequential reader's) must not queue behind other replies.
                let paced = msgs.len() > 1
                    || self
                        .hot
                        .topk
                        .lock()
                        .unwrap()
                        .rate(pool, &name, Instant::now())
                        >= HOT_OPS_S_MIN;
                for (((job, op), r), c) in msgs.iter_mut().zip(&ops).zip(rs).zip(counts) {
                    self.hot.topk.lock().unwrap().record(
                        pool,
                        &name,
                        client_hash(job.peer()),
                        c,
                        Instant::now(),
                    );
                    // Pace large replies by what the messenger has written: a hot object's
                    // replies queued by the hundred would make every message this node sends
                    // wait behind them.
                    let n = shared_bytes(&r);
                    if paced && n >= PACED_REPLY_BYTES_MIN {
                        self.hot.counters.paced_replies.fetch_add(1, Relaxed);
                        self.hot.inflight.wait_room(
                            n,
                            unsent,
                            REPLY_BYTES_INFLIGHT_MAX,
                            PACE_WAIT_MAX,
                        );
                    }
                    unsent -= n;
                    self.finish_op(job, op, r);
                }
            }
            _ => {
                for (mut job, op) in jobs {
                    let r = {
                        let _current = CurrentGuard::set(&op);
                        self.run_client_op(&job, cache)
                    };
                    if let Some((pool, name)) = &read {
                        let data = ClientOp::decode(job.payload()).map_or(0, |o| {
                            o.ops.iter().any(|s| matches!(s, SubOp::Read { .. })) as u64
                        });
                        let c = RecordCounts {
                            reads: 1,
                            data_reads: data,
                            absorbed: 0,
                        };
                        self.counters_fetch(data);
                        self.hot.topk.lock().unwrap().record(
                            *pool,
                            name,
                            client_hash(job.peer()),
                            c,
                            Instant::now(),
                        );
                    }
                    self.finish_op(&mut job, &op, r);
                }
            }
        }
    }

    /// A read-only op answered from the PG's cached object state and bytes in memory (the
    /// hot-object cache, or this node's own data shard in its store's read cache), by the
    /// messenger worker that received it, while it holds the idle PG's turn
    /// (see `Node::enqueue_op`): no hand-off to an op thread and back, no shard request.
    /// `None` when anything it needs is not cached, when it could fail (the queue reports
    /// errors), or when its reply is large enough to be paced; the op then takes the queue.
    pub(super) fn try_cached_read(
        &self,
        msg: &Incoming,
        cache: &Mutex<PgCache>,
    ) -> Option<Result<Vec<SendBuf>>> {
        let op = ClientOp::decode(msg.payload()).ok()?;
        if op.flags & ops::FLAG_STAGED != 0
            || op.ops.iter().any(|o| o.is_mutation())
            || op.epoch > self.epoch()
        {
            return None;
        }
        let ctx = self.ctx(&op).ok()?;
        // Never wait on the worker: a PG cache held elsewhere (recovery) means the queue.
        let st = {
            let mut c = cache.try_lock().ok()?;
            self.refresh_cache(&ctx, &mut c);
            c.objs.get(op.name)?.clone()
        };
        check_reads(&op, &st).ok()?;
        let ranges = merge_ranges(read_ranges(&op, &st));
        if ranges.iter().map(|(lo, hi)| hi - lo).sum::<u64>() >= PACED_REPLY_BYTES_MIN {
            return None;
        }
        let tag = Tag::of(&st);
        let mut fetches = Vec::with_capacity(ranges.len());
        let mut local = 0;
        for (lo, hi) in ranges {
            let hit = self
                .hot
                .cache
                .lock()
                .unwrap()
                .get(op.pool, op.name, tag, lo, hi - lo);
            let (d, at) = match hit {
                Some(h) => h,
                None => {
                    local += 1;
                    (self.local_cached_range(&ctx, op.name, &st, lo, hi)?, 0)
                }
            };
            fetches.push(Fetch {
                lo,
                hi,
                data: Some(d),
                at,
                err: None,
                crc: Arc::default(),
                extents: None,
            });
        }
        let data = !fetches.is_empty() as u64;
        // A read served by this node's own shard counts as a fetch, one the hot-object cache
        // served as absorbed: as on an op thread.
        let absorbed = data * (local == 0) as u64;
        let ctr = &self.hot.counters;
        ctr.inline_reads.fetch_add(1, Relaxed);
        ctr.cache_hits.fetch_add(absorbed, Relaxed);
        self.counters_fetch(local);
        self.hot.topk.lock().unwrap().record(
            op.pool,
            op.name,
            client_hash(msg.peer()),
            RecordCounts {
                reads: 1,
                data_reads: data,
                absorbed,
            },
            Instant::now(),
        );
        Some(self.encode_reads(ctx.map.epoch, &op, &st, &mut fetches))
    }

    /// Object bytes `[lo, hi)` when they lie in one stripe unit of a data shard this node
    /// holds, current at the object's version, and its store has them in memory (the read
    /// cache): a copy of them, without a device command. `None` otherwise.
    fn local_cached_range(
        &self,
        ctx: &primary::Ctx,
        name: &[u8],
        st: &ObjState,
        lo: u64,
        hi: u64,
    ) -> Option<Arc<Vec<u8>>> {
        let mut ext = ctx.profile.extents(lo, hi - lo);
        let e = ext.next()?;
        if ext.next().is_some()
            || ctx.up(e.shard) != Some(self.id)
            || st.current & primary::bit(e.shard) == 0
        {
            return None;
        }
        let r = self.local.read_if_cached(
            ctx.pool.id,
            ctx.pg,
            name,
            e.shard as u8,
            st.version,
            e.shard_offset,
            e.len as u64,
        )?;
        if r.len() != e.len {
            return None;
        }
        let mut v = Vec::with_capacity(e.len);
        r.append_to(&mut v);
        Some(Arc::new(v))
    }

    fn counters_fetch(&self, n: u64) {
        self.hot.counters.read_fetches.fetch_add(n, Relaxed);
    }

    /// Serve read-only requests on one object together. Returns each request's reply and
    /// what the detector counts for it.
    fn run_read_batch(
        &self,
        jobs: &[Incoming],
        cache: &Mutex<PgCache>,
    ) -> (Vec<Result<Vec<SendBuf>>>, Vec<RecordCounts>) {
        let mut counts = vec![RecordCounts::default(); jobs.len()];
        let decoded: Vec<Result<ClientOp>> =
            jobs.iter().map(|j| ClientOp::decode(j.payload())).collect();
        let epoch = decoded.iter().flatten().map(|o| o.epoch).max().unwrap_or(0);
        if epoch > self.epoch() {
            self.monc.wait_epoch(epoch, super::EPOCH_WAIT);
        }
        if jobs.len() > 1 {
            self.hot
                .counters
                .batched_ops
                .fetch_add(jobs.len() as u64, Relaxed);
        }
        let mut attempt = 0;
        let shared = loop {
            attempt += 1;
            match self.read_batch_once(&decoded, cache, &mut counts) {
                Err(e) if is_stale(&e) && attempt < OP_ATTEMPTS_MAX => {
                    let first = decoded.iter().flatten().next().expect("a request decoded");
                    Node::forget(&mut cache.lock().unwrap(), first.name);
                }
                r => break r,
            }
        };
        let out = match shared {
            Ok(v) => v,
            Err(e) => {
                let (s, m) = (e.status(), e.message());
                (0..jobs.len())
                    .map(|_| Err(Error::remote(s, m.clone())))
                    .collect()
            }
        };
        for c in &mut counts {
            c.reads = 1;
        }
        (out, counts)
    }

    /// One attempt at a batch: an error here is everyone's (the object's state); an error of
    /// one request goes in its slot.
    fn read_batch_once(
        &self,
        decoded: &[Result<ClientOp>],
        cache: &Mutex<PgCache>,
        counts: &mut [RecordCounts],
    ) -> Result<Vec<Result<Vec<SendBuf>>>> {
        let first = decoded
            .iter()
            .flatten()
            .next()
            .ok_or_else(|| Error::Malformed("no request of the batch decodes".into()))?;
        let ctx = self.ctx(first)?;
        let mut c = cache.lock().unwrap();
        self.refresh_cache(&ctx, &mut c);
        let st = self.resolve(&ctx, &mut c, first.name)?;
        // Which requests pass their asserts, and the ranges they read.
        let checked: Vec<Result<()>> = decoded
            .iter()
            .map(|r| match r {
                Ok(op) => check_reads(op, &st),
                Err(e) => Err(Error::remote(e.status(), e.message())),
            })
            .collect();
        let mut ranges = Vec::new();
        for (op, ok) in decoded.iter().zip(&checked) {
            if let (Ok(op), Ok(())) = (op, ok) {
                ranges.extend(read_ranges(op, &st));
            }
        }
        let ranges_count = ranges.len();
        let mut fetches: Vec<Fetch> = merge_ranges(ranges)
            .into_iter()
            .map(|(lo, hi)| Fetch {
                lo,
                hi,
                data: None,
                at: 0,
                err: None,
                crc: Arc::default(),
                extents: None,
            })
            .collect();
        let tag = Tag::of(&st);
        let hot = self
            .hot
            .topk
            .lock()
            .unwrap()
            .rate(first.pool, first.name, Instant::now())
            >= HOT_OPS_S_MIN;
        // One reader of ranges that did not merge, of an object not hot: nothing will share
        // the bytes, so its reply sends them where the members' replies left them instead of
        // copying them into one buffer for the cache.
        let by_ref = !hot && decoded.len() == 1 && fetches.len() == ranges_count;
        let mut fetched = vec![false; fetches.len()];
        for (i, f) in fetches.iter_mut().enumerate() {
            let hit =
                self.hot
                    .cache
                    .lock()
                    .unwrap()
                    .get(first.pool, first.name, tag, f.lo, f.hi - f.lo);
            if let Some((d, at)) = hit {
                f.data = Some(d);
                f.at = at;
                continue;
            }
            fetched[i] = true;
            self.counters_fetch(1);
            match self.read_range_as(&ctx, first.name, &st, f.lo, f.hi - f.lo, by_ref) {
                Ok((d, crc)) => {
                    // Known from the members' chunk CRCs: no reply sums these bytes.
                    if let Some(crc) = crc {
                        let _ = f.crc.set(crc);
                        self.hot.counters.crc_known_fetches.fetch_add(1, Relaxed);
                    }
                    let d = match d {
                        RangeBytes::Assembled(d) => Arc::new(d),
                        RangeBytes::Extents(x) => {
                            f.extents = Some(x);
                            continue;
                        }
                    };
                    if hot || decoded.len() > 1 {
                        self.hot.cache.lock().unwrap().insert(
                            first.pool,
                            first.name,
                            tag,
                            f.lo,
                            d.clone(),
                        );
                    }
                    f.data = Some(d);
                }
                Err(e) if is_stale(&e) => return Err(e),
                Err(e) => f.err = Some((e.status(), e.message())),
            }
        }
        drop(c);
        // The first reader of a fetched range paid for it; everyone else was absorbed.
        let mut paid = vec![false; fetches.len()];
        let mut out = Vec::with_capacity(decoded.len());
        for (i, (op, ok)) in decoded.iter().zip(checked).enumerate() {
            let op = match (op, ok) {
                (Ok(op), Ok(())) => op,
                (_, Err(e)) => {
                    out.push(Err(e));
                    continue;
                }
                (Err(_), Ok(())) => unreachable!("a request that does not decode fails its check"),
            };
            let mut has_data = false;
            let mut absorbed = true;
            for (lo, hi) in read_ranges(op, &st) {
                has_data = true;
                let j = fetches
                    .iter()
                    .position(|f| f.lo <= lo && hi <= f.hi)
                    .expect("merged ranges cover every read");
                if fetched[j] && !paid[j] {
                    paid[j] = true;
                    absorbed = false;
                }
            }
            if has_data {
                counts[i].data_reads = 1;
                counts[i].absorbed = absorbed as u64;
                let ctr = &self.hot.counters;
                if absorbed && fetches.iter().any(|f| f.data.is_some()) {
                    let from_cache = read_ranges(op, &st).iter().all(|(lo, hi)| {
                        let j = fetches.iter().position(|f| f.lo <= *lo && *hi <= f.hi);
                        j.is_some_and(|j| !fetched[j])
                    });
                    if from_cache {
                        ctr.cache_hits.fetch_add(1, Relaxed);
                    } else {
                        ctr.coalesced_reads.fetch_add(1, Relaxed);
                    }
                }
            }
            out.push(self.encode_reads(ctx.map.epoch, op, &st, &mut fetches));
        }
        Ok(out)
    }

    /// One request's reply from the batch's buffers (data parts point into them).
    fn encode_reads(
        &self,
        epoch: u64,
        op: &ClientOp,
        st: &ObjState,
        fetches: &mut [Fetch],
    ) -> Result<Vec<SendBuf>> {
        let mut e = Enc::new(epoch);
        e.u16(Status::Ok as u16);
        let n = op.ops.iter().filter(|o| o.is_read()).count();
        e.u64(st.version).u16(n as u16);
        let mut parts = Vec::new();
        for o in op.ops.iter().filter(|o| o.is_read()) {
            match o {
                SubOp::Read { offset, len } => {
                    let (lo, hi) = clamp(*offset, *len, st.size);
                    let mut data = Vec::new();
                    if hi > lo {
                        let f = fetches
                            .iter_mut()
                            .find(|f| f.lo <= lo && hi <= f.hi)
                            .expect("merged ranges cover every read");
                        if let Some((s, m)) = &f.err {
                            return Err(Error::remote(*s, m.clone()));
                        }
                        if let Some(x) = f.extents.take() {
                            debug_assert_eq!((lo, hi), (f.lo, f.hi), "one reader, unmerged");
                            data = extent_parts(x, (hi - lo) as usize, &self.hot.inflight);
                        }
                    }
                    if hi > lo && data.is_empty() {
                        let f = fetches
                            .iter()
                            .find(|f| f.lo <= lo && hi <= f.hi)
                            .expect("merged ranges cover every read");
                        let d = f.data.clone().expect("fetched or failed");
                        let crc = if (lo, hi) == (f.lo, f.hi) {
                            f.crc.clone()
                        } else {
                            Arc::default()
                        };
                        data.push(SendBuf::Raw(Box::new(Slice::new(
                            d,
                            f.at + (lo - f.lo) as usize,
                            (hi - lo) as usize,
                            crc,
                            &self.hot.inflight,
                        ))));
                    }
                    let len = (hi - lo) as usize;
                    self.counters.read_bytes.fetch_add(len as u64, Relaxed);
                    e.u8(5).u32(len as u32);
                    if !data.is_empty() {
                        parts.push(SendBuf::Vec(std::mem::take(&mut e.0)));
                        parts.append(&mut data);
                    }
                }
                SubOp::Stat => ops::encode_result(
                    &mut e,
                    &OpResult::Stat(ObjStat {
                        size: st.size,
                        version: st.version,
                        mtime_unix_ns: st.mtime_unix_ns,
                    }),
                ),
                SubOp::GetXattr(name) => {
                    let v = st.xattrs.get(*name).cloned().ok_or_else(|| {
                        Error::remote(Status::NoXattr, format!("no xattr {name:?}"))
                    })?;
                    ops::encode_result(&mut e, &OpResult::Xattr(v));
                }
                _ => ops::encode_result(
                    &mut e,
                    &OpResult::Xattrs(
                        st.xattrs
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect(),
                    ),
                ),
            }
        }
        self.counters.read_ops.fetch_add(1, Relaxed);
        parts.push(SendBuf::Vec(e.0));
        parts.retain(|p| !p.is_empty());
        Ok(parts)
    }
}

/// Bytes of a reply that point into shared buffers.
fn shared_bytes(r: &Result<Vec<SendBuf>>) -> u64 {
    r.as_ref().map_or(0, |parts| {
        parts
            .iter()
            .filter(|p| matches!(p, SendBuf::Raw(_)))
            .map(|p| p.len() as u64)
            .sum()
    })
}

fn is_stale(e: &Error) -> bool {
    matches!(e, Error::Remote { status: Status::VersionMismatch, message }
        if *message == primary::stale().message())
}

/// A request's asserts and validity against the object's state (as `try_op` checks them).
fn check_reads(op: &ClientOp, st: &ObjState) -> Result<()> {
    primary::check_ops(op)?;
    for o in &op.ops {
        match o {
            SubOp::AssertVersion(v) => {
                if !st.exists() {
                    return Err(primary::not_found(op.name));
                }
                if st.version != *v {
                    return Err(Error::remote(
                        Status::VersionMismatch,
                        format!("object is at version {}, the op asserted {v}", st.version),
                    ));
                }
            }
            SubOp::AssertExists if !st.exists() => return Err(primary::not_found(op.name)),
            SubOp::AssertAbsent if st.exists() => {
                return Err(Error::remote(Status::Exists, "object exists"))
            }
            _ => {}
        }
    }
    if op.ops.iter().any(|o| o.is_read()) && !st.exists() {
        return Err(primary::not_found(op.name));
    }
    Ok(())
}

/// `[offset, offset + len)` clamped to the object's size.
fn clamp(offset: u64, len: u64, size: u64) -> (u64, u64) {
    let lo = offset.min(size);
    (lo, offset.saturating_add(len).min(size).max(lo))
}

/// The non-empty byte ranges a (checked) request reads.
fn read_ranges(op: &ClientOp, st: &ObjState) -> Vec<(u64, u64)> {
    op.ops
        .iter()
        .filter_map(|o| match o {
            SubOp::Read { offset, len } => Some(clamp(*offset, *len, st.size)),
            _ => None,
        })
        .filter(|(lo, hi)| hi > lo)
        .collect()
}

/// This process's CPU time (user + system), from /proc/self/stat.
pub fn process_cpu_ns() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // Fields after the command name (which may hold spaces) start at field 3 (state);
    // utime and stime are fields 14 and 15.
    let f: Vec<&str> = s
        .rsplit_once(')')
        .map_or("", |(_, r)| r)
        .split_whitespace()
        .collect();
    let ticks: u64 = f
        .get(11..13)
        .map_or(0, |v| v.iter().filter_map(|x| x.parse::<u64>().ok()).sum());
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    ticks * (1_000_000_000 / hz)
}

/// Hot objects of several nodes, hottest first, at most `max`.
pub fn merge_hottest(per_node: BTreeMap<u32, Vec<HotObject>>, max: usize) -> Vec<HotObject> {
    let mut all: Vec<HotObject> = per_node
        .into_iter()
        .flat_map(|(n, v)| {
            v.into_iter().map(move |mut h| {
                h.node = n;
                h
            })
        })
        .collect();
    all.sort_by(|a, b| b.ops_s.total_cmp(&a.ops_s));
    all.truncate(max);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(n: u64) -> RecordCounts {
        RecordCounts {
            reads: n,
            data_reads: n,
            absorbed: 0,
        }
    }

    #[test]
    fn topk_finds_the_heavy_hitter_among_churn() {
        let t0 = Instant::now();
        let mut k = TopK::new(t0);
        // 2000 reads of "hot" from 100 clients interleaved with 3000 reads of distinct cold
        // objects (far more than TOPK_ENTRIES), all within one second.
        for i in 0..5000u64 {
            let now = t0 + Duration::from_micros(i * 200);
            if i % 5 < 2 {
                let c = RecordCounts {
                    reads: 1,
                    data_reads: 1,
                    absorbed: (i % 10 != 0) as u64,
                };
                let client = Identity::Client((i / 5 % 100) as u32);
                k.record(1, b"hot", client_hash(client), c, now);
            } else {
                k.record(1, format!("cold-{i}").as_bytes(), i, one(1), now);
            }
        }
        let now = t0 + Duration::from_secs(1);
        let h = k.hottest(HOT_OPS_S_MIN, HOT_REPORT_MAX, now);
        assert_eq!(h[0].name, "hot", "{h:?}");
        // 2000 reads in a 4 s window.
        assert!((h[0].ops_s - 500.0).abs() < 1.0, "{}", h[0].ops_s);
        assert!(
            (90..=110).contains(&h[0].clients),
            "{} clients",
            h[0].clients
        );
        assert!(
            (h[0].coalesced_pct - 75.0).abs() < 0.5,
            "{}",
            h[0].coalesced_pct
        );
        // Cold objects churn through the other slots and stay below the threshold.
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(k.entries.len() <= TOPK_ENTRIES);
    }

    #[test]
    fn topk_rate_slides_and_forgets() {
        let t0 = Instant::now();
        let mut k = TopK::new(t0);
        k.record(2, b"x", 1, one(400), t0);
        assert!((k.rate(2, b"x", t0) - 100.0).abs() < 1e-6);
        // One window later the old count weighs 3/4, a quarter of a window on.
        let t = t0 + WINDOW + WINDOW / 4;
        assert!(
            (k.rate(2, b"x", t) - 75.0).abs() < 1e-6,
            "{}",
            k.rate(2, b"x", t)
        );
        // Two idle windows: forgotten.
        let t = t0 + WINDOW * 3;
        assert_eq!(k.rate(2, b"x", t), 0.0);
        assert!(k.hottest(0.0, 8, t).is_empty());
    }

    #[test]
    fn cache_never_serves_another_version_and_stays_bounded() {
        let mut c = DataCache::new(1000);
        let v1 = Tag {
            version: 1,
            size: 600,
            mtime_unix_ns: 5,
        };
        let v2 = Tag { version: 2, ..v1 };
        c.insert(1, b"a", v1, 0, Arc::new(vec![7u8; 600]));
        let (d, at) = c.get(1, b"a", v1, 100, 50).expect("hit");
        assert_eq!((d[at], at), (7, 100));
        assert!(c.get(1, b"a", v2, 100, 50).is_none(), "other version");
        assert!(
            c.get(1, b"a", v1, 590, 20).is_none(),
            "past the cached range"
        );
        // Same version number, other mtime (a rolled-back write's number reused): a miss.
        let other = Tag {
            mtime_unix_ns: 6,
            ..v1
        };
        assert!(c.get(1, b"a", other, 0, 1).is_none());
        c.invalidate(1, b"a");
        assert!(c.get(1, b"a", v1, 0, 1).is_none(), "invalidated by a write");
        assert_eq!(c.bytes(), 0);
        c.insert(1, b"a", v1, 0, Arc::new(vec![1u8; 600]));
        c.insert(1, b"b", v1, 0, Arc::new(vec![2u8; 600]));
        assert!(c.bytes() <= 1000);
        assert!(
            c.get(1, b"a", v1, 0, 1).is_none(),
            "least recently used went"
        );
        assert!(c.get(1, b"b", v1, 0, 1).is_some());
        c.insert(1, b"big", v1, 0, Arc::new(vec![0u8; 1001]));
        assert!(
            c.get(1, b"big", v1, 0, 1).is_none(),
            "larger than the cache"
        );
    }

    fn req(name: &[u8], ops: Vec<SubOp>) -> Vec<u8> {
        ClientOp {
            epoch: 1,
            pool: 1,
            name,
            flags: 0,
            upload_id: 0,
            reqid: 0,
            ops,
        }
        .encode()
    }

    #[test]
    fn batches_stop_at_a_mutation_of_the_object() {
        let rd = SubOp::Read { offset: 0, len: 10 };
        let first = req(b"o", vec![rd.clone()]);
        let q = [
            req(b"o", vec![SubOp::Stat, rd.clone()]),
            req(b"other", vec![SubOp::WriteFull(b"x")]),
            req(b"o", vec![SubOp::AssertVersion(3), rd.clone()]),
            req(b"o", vec![SubOp::SetXattr("k", b"v")]),
            req(b"o", vec![rd.clone()]),
        ];
        let idx = batch_indices(&first, q.iter().map(|v| v.as_slice()));
        assert_eq!(idx, vec![0, 2], "reads of o before its xattr change");
        // A mutation never leads a batch.
        let w = req(
            b"o",
            vec![SubOp::Write {
                offset: 0,
                data: b"x",
            }],
        );
        assert!(batch_indices(&w, q.iter().map(|v| v.as_slice())).is_empty());
        // A request that does not decode may be anything: nothing passes it.
        let q2 = [b"garbage".to_vec(), req(b"o", vec![rd])];
        assert!(batch_indices(&first, q2.iter().map(|v| v.as_slice())).is_empty());
    }

    #[test]
    fn slices_of_one_range_share_one_crc_and_continue_any_seed() {
        use messenger::checksum::{crc32c, crc32c_append};
        use messenger::RawBytes;
        let inflight = Arc::new(Inflight::default());
        let data = Arc::new(
            (0..3 << 20)
                .map(|i: u32| (i * 7) as u8)
                .collect::<Vec<u8>>(),
        );
        let memo: Arc<OnceLock<u32>> = Arc::default();
        let (at, n) = (100, 2 << 20);
        let a = Slice::new(data.clone(), at, n, memo.clone(), &inflight);
        let b = Slice::new(data.clone(), at, n, memo.clone(), &inflight);
        let seed = crc32c(b"reply header");
        let want = &data[at..at + n];
        assert_eq!(a.crc32c_append(seed), crc32c_append(seed, want));
        assert_eq!(memo.get(), Some(&crc32c(want)), "computed once, kept");
        assert_eq!(b.crc32c_append(7), crc32c_append(7, want));
        assert_eq!(b.raw(), (want.as_ptr(), n));
        // A small slice sums its bytes (no memo).
        let small_memo: Arc<OnceLock<u32>> = Arc::default();
        let c = Slice::new(data.clone(), 5, 4096, small_memo.clone(), &inflight);
        assert_eq!(c.crc32c_append(seed), crc32c_append(seed, &data[5..4101]));
        assert_eq!(small_memo.get(), None);
    }

    #[test]
    fn large_replies_wait_for_the_messenger_to_drain() {
        let inflight = Arc::new(Inflight::default());
        let data = Arc::new(vec![0u8; 100]);
        let mine = Slice::new(data.clone(), 10, 50, Arc::default(), &inflight);
        // Only the caller's own unsent reply is in flight: no wait, even over the budget.
        inflight.wait_room(50, 50, 10, Duration::from_secs(30));
        let sent = Slice::new(data, 0, 100, Arc::default(), &inflight);
        assert_eq!((inflight.bytes(), mine.bytes().len()), (150, 50));
        // 100 bytes sent and not drained + 50 > 120: waits until the messenger drops them.
        std::thread::scope(|s| {
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                drop(sent);
            });
            inflight.wait_room(50, 50, 120, Duration::from_secs(30));
            assert_eq!(inflight.bytes(), 50, "returned once the sent reply drained");
        });
        drop(mine);
        assert_eq!(inflight.bytes(), 0);
    }

    #[test]
    fn ranges_merge_when_they_overlap_or_touch() {
        assert_eq!(
            merge_ranges(vec![(10, 20), (0, 5), (5, 8), (15, 30), (40, 41)]),
            vec![(0, 8), (10, 30), (40, 41)]
        );
        assert_eq!(clamp(5, u64::MAX, 10), (5, 10));
        assert_eq!(clamp(50, 10, 10), (10, 10));
    }
}
