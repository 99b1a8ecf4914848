//! Background cluster scrub, run by each node over the PGs it is primary of.
//!
//! A pass walks the node's pools in id order and, within a pool, the object names this node
//! holds shards of in name order; it scrubs the objects whose PG this node leads. Per object,
//! holding the PG's turn (no client op of that PG runs meanwhile): resolve the current
//! version; read every up member's whole shard at that version (the store checks every
//! chunk's crc32c; a mismatch comes back as `Status::Corrupted`); note members whose shard is
//! missing or at another version; rebuild bad shards from k good ones (`repair.rs`). When
//! every shard reads clean, re-encode the parity from the data and compare: a mismatch with
//! every crc fine is reported with its stripes and the parity is rewritten.
//!
//! Rate: `scrub_bytes_per_sec` of shard bytes read (node config). Schedule: a pass every
//! `scrub_interval_s` (0: only on request, `nvstore scrub start`). Resumable: the cursor
//! (pool, PG and last object name) and the counters are saved in `<data_dir>/scrub.json`
//! at most every 100 ms and at the end of a pass; a restarted node continues from there.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use messenger::{Incoming, SendBuf};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::primary::{bit, Ctx, PgCache};
use super::repair::{rebuild, PendingRepair};
use super::Node;
use crate::error::{Error, Result};
use crate::placement::pg_of;
use crate::wire::{self, Dec, Enc, Status};

/// Names listed from the local stores per step of a pass.
const LIST_BATCH: usize = 256;
/// How often (at most) a running pass saves its cursor: a small file, so often enough that a
/// slow, rate-limited pass loses little when the node stops.
const CURSOR_SAVE_PERIOD: Duration = Duration::from_millis(100);
/// Longest sleep of the idle scrub thread before it looks at its schedule again.
const IDLE_WAIT_MAX: Duration = Duration::from_secs(30);
/// Longest wait for a PG's turn (busy PGs are skipped and scrubbed next pass).
const PG_WAIT_MAX: Duration = Duration::from_secs(10);

/// Scrub and repair counters (totals since the node's data dir was created). Travels in
/// heartbeats (`NodeStats::scrub`), summed in `nvstore status`, and in `scrub status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScrubStats {
    /// Objects scrubbed.
    pub objects: u64,
    /// Shard bytes read by the scrub.
    pub bytes: u64,
    /// Shards whose stored crc32c did not match (scrub).
    pub crc_errors: u64,
    /// Shards missing on, or at another version than, an up member (scrub).
    pub missing: u64,
    /// Stripes whose parity disagreed with data whose crcs were all fine (scrub).
    pub parity_errors: u64,
    /// Shards the scrub rewrote.
    pub repaired: u64,
    pub repaired_bytes: u64,
    /// Bad shards the scrub could not rewrite (fewer than k good shards, or the write failed).
    pub unrepairable: u64,
    /// Corrupt shards client reads met (read around, then rewritten).
    pub read_corrupt: u64,
    pub read_repaired: u64,
    /// Complete passes.
    pub passes: u64,
    /// When the last pass completed (unix seconds; 0: never).
    pub last_complete_unix: u64,
}

impl ScrubStats {
    /// Sum another node's counters in (`last_complete_unix`: the oldest non-zero).
    pub fn add(&mut self, o: &ScrubStats) {
        self.objects += o.objects;
        self.bytes += o.bytes;
        self.crc_errors += o.crc_errors;
        self.missing += o.missing;
        self.parity_errors += o.parity_errors;
        self.repaired += o.repaired;
        self.repaired_bytes += o.repaired_bytes;
        self.unrepairable += o.unrepairable;
        self.read_corrupt += o.read_corrupt;
        self.read_repaired += o.read_repaired;
        self.passes += o.passes;
        self.last_complete_unix = match (self.last_complete_unix, o.last_complete_unix) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
    }

    /// Counters of `self` minus an earlier snapshot (one pass's share).
    fn since(&self, base: &ScrubStats) -> ScrubStats {
        ScrubStats {
            objects: self.objects - base.objects,
            bytes: self.bytes - base.bytes,
            crc_errors: self.crc_errors - base.crc_errors,
            missing: self.missing - base.missing,
            parity_errors: self.parity_errors - base.parity_errors,
            repaired: self.repaired - base.repaired,
            repaired_bytes: self.repaired_bytes - base.repaired_bytes,
            unrepairable: self.unrepairable - base.unrepairable,
            read_corrupt: self.read_corrupt - base.read_corrupt,
            read_repaired: self.read_repaired - base.read_repaired,
            passes: self.passes - base.passes,
            last_complete_unix: self.last_complete_unix,
        }
    }
}

/// Where a pass stands: resume after `after` (hex of the name) in `pool`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub pool: u64,
    /// PG of the last object scrubbed (informational).
    pub pg: u32,
    pub after_hex: String,
    pub started_unix: u64,
    /// Counters when the pass started (a pass's own counts are the difference).
    pub base: ScrubStats,
}

/// `<data_dir>/scrub.json`, and the body of a `MSG_NODE_SCRUB` reply.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ScrubState {
    pub node: u32,
    /// The pass in progress (`None`: idle).
    pub cursor: Option<Cursor>,
    pub totals: ScrubStats,
    /// Counts of the last complete pass.
    pub last_pass: ScrubStats,
}

/// Atomic counters, updated from op threads (read repairs) and the scrub thread.
#[derive(Default)]
pub struct Counts {
    pub objects: AtomicU64,
    pub bytes: AtomicU64,
    pub crc_errors: AtomicU64,
    pub missing: AtomicU64,
    pub parity_errors: AtomicU64,
    pub repaired: AtomicU64,
    pub repaired_bytes: AtomicU64,
    pub unrepairable: AtomicU64,
    pub read_corrupt: AtomicU64,
    pub read_repaired: AtomicU64,
    pub passes: AtomicU64,
    pub last_complete_unix: AtomicU64,
}

impl Counts {
    fn load(&self, s: &ScrubStats) {
        self.objects.store(s.objects, Relaxed);
        self.bytes.store(s.bytes, Relaxed);
        self.crc_errors.store(s.crc_errors, Relaxed);
        self.missing.store(s.missing, Relaxed);
        self.parity_errors.store(s.parity_errors, Relaxed);
        self.repaired.store(s.repaired, Relaxed);
        self.repaired_bytes.store(s.repaired_bytes, Relaxed);
        self.unrepairable.store(s.unrepairable, Relaxed);
        self.read_corrupt.store(s.read_corrupt, Relaxed);
        self.read_repaired.store(s.read_repaired, Relaxed);
        self.passes.store(s.passes, Relaxed);
        self.last_complete_unix.store(s.last_complete_unix, Relaxed);
    }

    pub fn snapshot(&self) -> ScrubStats {
        ScrubStats {
            objects: self.objects.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            crc_errors: self.crc_errors.load(Relaxed),
            missing: self.missing.load(Relaxed),
            parity_errors: self.parity_errors.load(Relaxed),
            repaired: self.repaired.load(Relaxed),
            repaired_bytes: self.repaired_bytes.load(Relaxed),
            unrepairable: self.unrepairable.load(Relaxed),
            read_corrupt: self.read_corrupt.load(Relaxed),
            read_repaired: self.read_repaired.load(Relaxed),
            passes: self.passes.load(Relaxed),
            last_complete_unix: self.last_complete_unix.load(Relaxed),
        }
    }

    fn add(&self, o: &ObjScrub) {
        self.objects.fetch_add(o.objects, Relaxed);
        self.bytes.fetch_add(o.bytes, Relaxed);
        self.crc_errors.fetch_add(o.crc_errors, Relaxed);
        self.missing.fetch_add(o.missing, Relaxed);
        self.parity_errors.fetch_add(o.parity_errors, Relaxed);
        self.repaired.fetch_add(o.repaired, Relaxed);
        self.repaired_bytes.fetch_add(o.repaired_bytes, Relaxed);
        self.unrepairable.fetch_add(o.unrepairable, Relaxed);
    }
}

struct Control {
    cursor: Option<Cursor>,
    last_pass: ScrubStats,
    start_requested: bool,
}

/// A node's scrub state.
pub struct Scrub {
    pub(super) pending: Mutex<Vec<PendingRepair>>,
    /// `pending` is not empty (checked without the lock after every client op).
    pub(super) has_pending: AtomicBool,
    pub counts: Counts,
    control: Mutex<Control>,
    wake: Condvar,
    path: PathBuf,
    started: Instant,
}

impl Scrub {
    /// Load `<data_dir>/scrub.json` (absent: a fresh state; unreadable: a warning and a fresh
    /// state — the counters restart, no data is at risk).
    pub fn load(data_dir: &std::path::Path) -> Scrub {
        let path = data_dir.join("scrub.json");
        let saved: ScrubState = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                warn!("{}: {e}; scrub state starts afresh", path.display());
                ScrubState::default()
            }),
            Err(_) => ScrubState::default(),
        };
        let counts = Counts::default();
        counts.load(&saved.totals);
        Scrub {
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            counts,
            control: Mutex::new(Control {
                cursor: saved.cursor,
                last_pass: saved.last_pass,
                start_requested: false,
            }),
            wake: Condvar::new(),
            path,
            started: Instant::now(),
        }
    }

    pub fn state(&self, node: u32) -> ScrubState {
        let c = self.control.lock().unwrap();
        ScrubState {
            node,
            cursor: c.cursor.clone(),
            totals: self.counts.snapshot(),
            last_pass: c.last_pass,
        }
    }

    /// Ask for a pass now (a pass in progress just continues).
    pub fn request_start(&self) {
        self.control.lock().unwrap().start_requested = true;
        self.wake.notify_all();
    }

    fn save(&self, node: u32) {
        let s = self.state(node);
        let tmp = self.path.with_extension("json.tmp");
        let r = serde_json::to_vec_pretty(&s)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|_| std::fs::rename(&tmp, &self.path));
        if let Err(e) = r {
            warn!("save {}: {e}", self.path.display());
        }
    }

    /// Block until a pass is due; returns its cursor (resumed or new).
    fn wait_due(&self, interval: Duration) -> Cursor {
        let mut c = self.control.lock().unwrap();
        loop {
            if let Some(cur) = c.cursor.clone() {
                c.start_requested = false;
                return cur;
            }
            let last = self.counts.last_complete_unix.load(Relaxed);
            let since_last = if last == 0 {
                self.started.elapsed()
            } else {
                Duration::from_secs(now_unix().saturating_sub(last))
            };
            let due = !interval.is_zero() && since_last >= interval;
            if c.start_requested || due {
                c.start_requested = false;
                let cur = Cursor {
                    started_unix: now_unix(),
                    base: self.counts.snapshot(),
                    ..Cursor::default()
                };
                c.cursor = Some(cur.clone());
                return cur;
            }
            let wait = if interval.is_zero() {
                IDLE_WAIT_MAX
            } else {
                (interval - since_last).min(IDLE_WAIT_MAX)
            };
            c = self.wake.wait_timeout(c, wait).unwrap().0;
        }
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// What scrubbing one object found and did.
#[derive(Debug, Default)]
struct ObjScrub {
    objects: u64,
    bytes: u64,
    crc_errors: u64,
    missing: u64,
    parity_errors: u64,
    repaired: u64,
    repaired_bytes: u64,
    unrepairable: u64,
}

/// Re-encode parity from the data shards (all `len` bytes, zero padded) and compare with the
/// stored parity: the stripe indexes (of `unit` bytes per shard) that disagree, and per
/// parity slot its recomputed bytes when it differs anywhere.
pub(crate) fn parity_mismatch(
    codec: &ec::Codec,
    shards: &[&[u8]],
    unit: usize,
) -> (Vec<u64>, Vec<(usize, Vec<u8>)>) {
    let k = codec.profile().k();
    let len = shards[0].len();
    let mut parity: Vec<Vec<u8>> = vec![vec![0u8; len]; shards.len() - k];
    {
        let mut p: Vec<&mut [u8]> = parity.iter_mut().map(|v| v.as_mut_slice()).collect();
        codec.encode(&shards[..k], &mut p);
    }
    let mut stripes = Vec::new();
    for (i, at) in (0..len).step_by(unit.max(1)).enumerate() {
        let end = (at + unit).min(len);
        if parity
            .iter()
            .zip(&shards[k..])
            .any(|(want, have)| want[at..end] != have[at..end])
        {
            stripes.push(i as u64);
        }
    }
    let fixed = parity
        .into_iter()
        .enumerate()
        .filter(|(i, want)| *want != shards[k + i])
        .map(|(i, want)| (k + i, want))
        .collect();
    (stripes, fixed)
}

impl Node {
    /// `MSG_NODE_SCRUB`: op 0 reports the scrub state, op 1 starts a pass now (and reports
    /// the state from just before); JSON reply.
    pub(super) fn scrub_control(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let mut d = Dec::new(msg.payload());
        let epoch = d.u64()?;
        let op = d.u8()?;
        d.end()?;
        if op == 1 {
            // A pass asked for by a node that just booted must see it up (salvage.rs).
            self.monc.wait_epoch(epoch, super::EPOCH_WAIT);
        }
        // The state from before a start: a quick pass may end before the reply is built, and
        // the caller waits for `passes` to grow past this.
        let state = self.scrub.state(self.id);
        match op {
            0 => {}
            1 => self.scrub.request_start(),
            o => {
                return Err(Error::remote(
                    Status::Invalid,
                    format!("scrub op {o}: 0 = status, 1 = start"),
                ))
            }
        }
        let body = serde_json::to_vec(&state)
            .map_err(|e| Error::remote(Status::Internal, e.to_string()))?;
        Ok(wire::reply_ok(self.epoch(), &body))
    }

    /// `MSG_NODE_LOCATE`: where this node's shard of an object sits on its device (JSON
    /// `{"device": path, "extents": [[offset, len], ...]}`).
    pub(super) fn locate(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let mut d = Dec::new(msg.payload());
        let _epoch = d.u64()?;
        let pool = d.u64()?;
        let name = d.bytes()?;
        let shard = d.u8()?;
        d.end()?;
        let map = self.monc.map();
        let p = map
            .pools
            .get(&pool)
            .ok_or_else(|| Error::remote(Status::NoSuchPool, format!("pool {pool}")))?;
        let (device, extents) = self.local.locate(pool, pg_of(p, name), name, shard)?;
        let body = serde_json::json!({ "device": device, "extents": extents });
        Ok(wire::reply_ok(self.epoch(), body.to_string().as_bytes()))
    }

    /// The `node-scrub` thread: run passes as scheduled or requested.
    pub(super) fn scrub_loop(self: Arc<Self>) {
        let interval = Duration::from_secs(self.cfg.scrub_interval_s);
        loop {
            let cursor = self.scrub.wait_due(interval);
            info!(
                "scrub: pass {} from pool {} after {:?}",
                if cursor.after_hex.is_empty() && cursor.pool == 0 {
                    "starts"
                } else {
                    "resumes"
                },
                cursor.pool,
                cursor.after_hex
            );
            self.scrub_pass(cursor);
        }
    }

    fn scrub_pass(&self, mut cur: Cursor) {
        let rate = self.cfg.scrub_bytes_per_sec.max(1) as f64;
        let t0 = Instant::now();
        let mut read = 0u64;
        let mut saved = Instant::now();
        let pools: Vec<u64> = self
            .monc
            .map()
            .pools
            .keys()
            .copied()
            .filter(|id| *id >= cur.pool)
            .collect();
        for pool_id in pools {
            if pool_id != cur.pool {
                cur.pool = pool_id;
                cur.after_hex.clear();
            }
            'names: loop {
                let after = unhex(&cur.after_hex);
                let names = match self.local.list(pool_id, &after, LIST_BATCH, true) {
                    Ok(n) => n,
                    Err(e) => {
                        warn!("scrub: list pool {pool_id}: {e}");
                        break;
                    }
                };
                if names.is_empty() {
                    break;
                }
                for name in names {
                    let map = self.monc.map();
                    let Some(pool) = map.pools.get(&pool_id).cloned() else {
                        break 'names;
                    };
                    let pg = pg_of(&pool, &name);
                    let r = self.with_pg((pool_id, pg), PG_WAIT_MAX, || {
                        let ctx = self.pg_ctx(&map, &pool, pg)?;
                        Some(self.scrub_object(&ctx, &name))
                    });
                    match r {
                        Some(Some(Ok(o))) => {
                            read += o.bytes;
                            self.scrub.counts.add(&o);
                        }
                        Some(Some(Err(e))) => {
                            debug!("scrub: {}: skipped ({e})", String::from_utf8_lossy(&name))
                        }
                        _ => {}
                    }
                    cur.pg = pg;
                    cur.after_hex = hex(&name);
                    let due = Duration::from_secs_f64(read as f64 / rate);
                    if let Some(w) = due.checked_sub(t0.elapsed()) {
                        std::thread::sleep(w);
                    }
                    if saved.elapsed() >= CURSOR_SAVE_PERIOD {
                        self.scrub.control.lock().unwrap().cursor = Some(cur.clone());
                        self.scrub.save(self.id);
                        saved = Instant::now();
                    }
                }
            }
        }
        let c = &self.scrub.counts;
        c.passes.fetch_add(1, Relaxed);
        c.last_complete_unix.store(now_unix(), Relaxed);
        let pass = c.snapshot().since(&cur.base);
        info!(
            "scrub: pass complete: {} objects, {} bytes, {} crc errors, {} missing/stale, {} \
             parity mismatches, {} shards repaired, {} unrepairable",
            pass.objects,
            pass.bytes,
            pass.crc_errors,
            pass.missing,
            pass.parity_errors,
            pass.repaired,
            pass.unrepairable
        );
        {
            let mut ctl = self.scrub.control.lock().unwrap();
            ctl.cursor = None;
            ctl.last_pass = pass;
        }
        self.scrub.save(self.id);
    }

    /// Scrub one object (the caller holds its PG's turn).
    fn scrub_object(&self, ctx: &Ctx, name: &[u8]) -> Result<ObjScrub> {
        let st = self.resolve(ctx, &mut PgCache::default(), name)?;
        let mut o = ObjScrub::default();
        self.rollbacks_found(ctx, name, &st);
        if st.deleted {
            self.tombstone_found(ctx, name, &st);
        }
        if !st.exists() {
            return Ok(o);
        }
        o.objects = 1;
        let len = ctx.clip(0, st.size);
        let mut missing = 0u64;
        let mut reqs = Vec::new();
        for s in (0..ctx.n()).filter(|s| ctx.up(*s).is_some()) {
            if st.current & bit(s) == 0 {
                missing |= bit(s);
                continue;
            }
            let mut e = self.shard_req_head(ctx, name, s);
            // From the device: a cached copy would hide rot on the medium.
            e.u64(st.version)
                .u64(0)
                .u64(len)
                .u8(wire::SHARD_READ_FROM_DEVICE);
            reqs.push((s, vec![SendBuf::Vec(e.finish())]));
        }
        let local = self.local_small(wire::MSG_SHARD_READ);
        let mut good: HashMap<usize, Vec<u8>> = HashMap::new();
        let mut corrupt = 0u64;
        for (slot, r) in self.fan_out(ctx, wire::MSG_SHARD_READ, reqs, &local) {
            let p = match r {
                Ok(p) => p,
                Err(e) => {
                    self.note_scrub_read_error(
                        name,
                        st.version,
                        slot,
                        &e,
                        &mut corrupt,
                        &mut missing,
                    );
                    continue;
                }
            };
            match shard_bytes(&p) {
                Ok(b) => {
                    o.bytes += b.len() as u64;
                    let mut v = vec![0u8; len as usize];
                    let n = b.len().min(ctx.clip(slot, st.size) as usize);
                    v[..n].copy_from_slice(&b[..n]);
                    good.insert(slot, v);
                }
                Err(e) => debug!("scrub: shard {slot}: {e}"),
            }
        }
        o.crc_errors = corrupt.count_ones() as u64;
        o.missing = missing.count_ones() as u64;
        let bad = corrupt | missing;
        if bad != 0 {
            if good.len() < ctx.k() {
                o.unrepairable = bad.count_ones() as u64;
                return Ok(o);
            }
            let rebuilt = rebuild(ctx, &st, &good, bad)?;
            match self.write_repairs(ctx, name, &st, rebuilt) {
                Ok(b) => {
                    o.repaired = bad.count_ones() as u64;
                    o.repaired_bytes = b;
                }
                Err(e) => {
                    warn!("scrub: repair of {}: {e}", String::from_utf8_lossy(name));
                    o.unrepairable = bad.count_ones() as u64;
                }
            }
            return Ok(o);
        }
        if good.len() == ctx.n() && len > 0 {
            let shards: Vec<&[u8]> = (0..ctx.n()).map(|s| good[&s].as_slice()).collect();
            if !ctx.codec.verify(&shards).is_empty() {
                let (stripes, fixed) =
                    parity_mismatch(&ctx.codec, &shards, ctx.profile.stripe_unit());
                warn!(
                    "scrub: {} v{}: parity disagrees with the data in stripe(s) {stripes:?} \
                     though every crc is fine; rewriting parity shard(s) {:?}",
                    String::from_utf8_lossy(name),
                    st.version,
                    fixed.iter().map(|f| f.0).collect::<Vec<_>>()
                );
                o.parity_errors = stripes.len() as u64;
                let n = fixed.len() as u64;
                let fixed = fixed
                    .into_iter()
                    .map(|(s, mut v)| {
                        v.truncate(ctx.clip(s, st.size) as usize);
                        (s, v)
                    })
                    .collect();
                match self.write_repairs(ctx, name, &st, fixed) {
                    Ok(b) => {
                        o.repaired = n;
                        o.repaired_bytes = b;
                    }
                    Err(e) => {
                        warn!("scrub: parity rewrite: {e}");
                        o.unrepairable = n;
                    }
                }
            }
        }
        Ok(o)
    }
}

impl Node {
    /// Classify a failed shard read of the scrub.
    fn note_scrub_read_error(
        &self,
        name: &[u8],
        version: u64,
        slot: usize,
        e: &Error,
        corrupt: &mut u64,
        missing: &mut u64,
    ) {
        match e.status() {
            Status::Corrupted => {
                warn!(
                    "scrub: {} v{version} shard {slot}: {}",
                    String::from_utf8_lossy(name),
                    e.message()
                );
                *corrupt |= bit(slot);
            }
            Status::VersionMismatch => *missing |= bit(slot),
            _ => debug!("scrub: shard {slot} unreadable now: {e}"),
        }
    }
}

/// The data of a shard read reply (epoch, status, u32 length, bytes).
fn shard_bytes(p: &[u8]) -> Result<&[u8]> {
    let mut d = Dec::new(p);
    d.u64()?;
    d.u16()?;
    d.bytes()
}

/// Request body of `MSG_NODE_SCRUB` after the epoch (for [`crate::Client::node_call`]).
pub fn scrub_request(op: u8) -> Vec<u8> {
    let mut e = Enc::default();
    e.u8(op);
    e.finish()
}

/// Request body of `MSG_NODE_LOCATE` after the epoch.
pub fn locate_request(pool: u64, name: &[u8], shard: u8) -> Vec<u8> {
    let mut e = Enc::default();
    e.u64(pool).bytes(name).u8(shard);
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parity_mismatch_names_the_stripe_and_recomputes_parity() {
        let profile = ec::Profile::new(4, 2, 4096).unwrap();
        let codec = ec::Codec::new(profile);
        let len = 3 * 4096;
        let data: Vec<Vec<u8>> = (0..4)
            .map(|j| (0..len).map(|i| (i * 7 + j * 13) as u8).collect())
            .collect();
        let mut parity = vec![vec![0u8; len]; 2];
        {
            let d: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            let mut p: Vec<&mut [u8]> = parity.iter_mut().map(|v| v.as_mut_slice()).collect();
            codec.encode(&d, &mut p);
        }
        let good = parity[1].clone();
        let all = |p: &[Vec<u8>]| -> Vec<Vec<u8>> { data.iter().chain(p).cloned().collect() };
        let clean = all(&parity);
        let refs: Vec<&[u8]> = clean.iter().map(|v| v.as_slice()).collect();
        assert_eq!(parity_mismatch(&codec, &refs, 4096), (vec![], vec![]));
        // Flip a byte of parity shard 5 in stripe 2.
        parity[1][2 * 4096 + 17] ^= 0x40;
        let bad = all(&parity);
        let refs: Vec<&[u8]> = bad.iter().map(|v| v.as_slice()).collect();
        let (stripes, fixed) = parity_mismatch(&codec, &refs, 4096);
        assert_eq!(stripes, vec![2]);
        assert_eq!(fixed, vec![(5, good)]);
    }

    #[test]
    fn stats_sum_and_cursor_names_round_trip() {
        let mut a = ScrubStats {
            crc_errors: 2,
            last_complete_unix: 50,
            ..ScrubStats::default()
        };
        a.add(&ScrubStats {
            crc_errors: 3,
            last_complete_unix: 40,
            ..ScrubStats::default()
        });
        a.add(&ScrubStats::default());
        assert_eq!((a.crc_errors, a.last_complete_unix), (5, 40));
        let name = b"obj\x00\xff-7";
        assert_eq!(unhex(&hex(name)), name.to_vec());
        let old: ScrubState = serde_json::from_str("{}").unwrap();
        assert!(old.cursor.is_none());
    }
}
