//! SimDevice: an in-memory block device for crash and fault tests, deterministic from a seed.
//!
//! It keeps two images: **live** (what reads see) and **durable** (what survives a crash).
//! With a volatile write cache (the default), a completed write is only in `live` and in a list
//! of pending writes; a flush that completes persists every write that completed before the
//! flush was submitted, and a FUA write persists when it completes. [`SimDevice::crash`] builds
//! the post-crash device from the durable image plus, for each still-pending write (in flight
//! or completed-but-unflushed), a seeded choice: keep it, drop it, or tear it (each atomic unit
//! independently kept or dropped). The same history and the same crash seed give the same image.
//!
//! A newer write over an older pending one supersedes it in the cache, as a drive's cache would:
//! after a crash a unit holds its durable content or the newest pending content, never older
//! pending content. Injected faults: read or write errors on an LBA range, latent bit flips,
//! a latency model, and completion reordering. Fault counters record what happened.
//!
//! Old queue handles of a crashed device fail with [`Error::Gone`].

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::device::{BlockDevice, Completion, Geometry, Op, QueueHandle, Request, SubmitError};
use crate::dma::{DmaBuf, HostMemory};
use crate::error::{Error, Result};

/// Service time per operation. `jitter_pct` spreads each latency uniformly by ±that percent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Latency {
    pub read: Duration,
    pub write: Duration,
    pub flush: Duration,
    pub jitter_pct: u32,
}

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub block_size: u32,
    pub capacity_blocks: u64,
    /// Crash tear granularity: a pending write survives or vanishes in units of this many bytes.
    pub atomic_write_bytes: u32,
    pub queue_depth: u32,
    pub queue_count: u32,
    pub max_transfer_bytes: u32,
    pub volatile_write_cache: bool,
    pub dma_alignment: u32,
    pub latency: Latency,
    /// Deliver ready completions in a seeded random order instead of submission order.
    pub reorder: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            block_size: 4096,
            capacity_blocks: 16 * 1024,
            atomic_write_bytes: 512,
            queue_depth: 128,
            queue_count: 64,
            max_transfer_bytes: 1 << 20,
            volatile_write_cache: true,
            dma_alignment: 4,
            latency: Latency::default(),
            reorder: true,
        }
    }
}

/// A fault to inject. Ranges are in logical blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Reads touching the range fail with a media error.
    ReadError { lba: u64, blocks: u64 },
    /// Writes (and write-zeroes) touching the range fail with a media error and change nothing.
    WriteError { lba: u64, blocks: u64 },
}

impl Fault {
    fn hits(&self, op: Op, lba: u64, blocks: u32) -> bool {
        let (start, len, ops_read) = match *self {
            Fault::ReadError { lba, blocks } => (lba, blocks, true),
            Fault::WriteError { lba, blocks } => (lba, blocks, false),
        };
        let is_read = op == Op::Read;
        let is_write = matches!(op, Op::Write { .. } | Op::WriteZeroes);
        let relevant = if ops_read { is_read } else { is_write };
        relevant && lba < start + len && start < lba + blocks as u64
    }
}

/// What the simulator did, for test reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimCounters {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub read_errors: u64,
    pub write_errors: u64,
    pub bits_flipped: u64,
    /// At the crash that built this device: pending writes kept whole, dropped, torn.
    pub crash_kept: u64,
    pub crash_dropped: u64,
    pub crash_torn: u64,
}

const CHUNK_BYTES: usize = 64 * 1024;

/// A sparse byte image in 64 KiB chunks; absent chunks read as zeros.
#[derive(Clone)]
struct Image {
    chunks: Vec<Option<Box<[u8]>>>,
}

impl Image {
    fn new(bytes: u64) -> Self {
        let n = (bytes as usize).div_ceil(CHUNK_BYTES);
        Image {
            chunks: (0..n).map(|_| None).collect(),
        }
    }

    /// Visit the chunk pieces covering `off..off+len` as (chunk index, offset in chunk, piece
    /// offset in the range, piece length).
    fn pieces(off: u64, len: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
        let mut done = 0usize;
        std::iter::from_fn(move || {
            if done >= len {
                return None;
            }
            let pos = off as usize + done;
            let (c, o) = (pos / CHUNK_BYTES, pos % CHUNK_BYTES);
            let n = (CHUNK_BYTES - o).min(len - done);
            let piece = (c, o, done, n);
            done += n;
            Some(piece)
        })
    }

    fn read(&self, off: u64, out: &mut [u8]) {
        for (c, o, at, n) in Self::pieces(off, out.len()) {
            match &self.chunks[c] {
                Some(chunk) => out[at..at + n].copy_from_slice(&chunk[o..o + n]),
                None => out[at..at + n].fill(0),
            }
        }
    }

    fn chunk_mut(&mut self, c: usize) -> &mut [u8] {
        self.chunks[c].get_or_insert_with(|| vec![0u8; CHUNK_BYTES].into_boxed_slice())
    }

    fn write(&mut self, off: u64, data: &[u8]) {
        for (c, o, at, n) in Self::pieces(off, data.len()) {
            self.chunk_mut(c)[o..o + n].copy_from_slice(&data[at..at + n]);
        }
    }

    fn zero(&mut self, off: u64, len: usize) {
        for (c, o, _, n) in Self::pieces(off, len) {
            if let Some(chunk) = &mut self.chunks[c] {
                chunk[o..o + n].fill(0);
            }
        }
    }

    fn flip(&mut self, byte: u64, bit: u8) {
        let (c, o) = (byte as usize / CHUNK_BYTES, byte as usize % CHUNK_BYTES);
        self.chunk_mut(c)[o] ^= 1 << bit;
    }
}

/// Content of a pending write.
enum Data {
    Bytes(Vec<u8>),
    Zeros,
}

/// What a pending write's atomic unit still means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// The newest content written to the unit.
    Live,
    /// A newer write to the unit is pending but not durable. A flush that covers this write
    /// still persists this content: a drive's flush makes every completed write durable, and
    /// the unit then holds this content or the newer one, never what was there before.
    Superseded,
    /// A newer write to the unit is durable: this content is never persisted.
    Dead,
}

/// A write that is in `live` but not (yet) in `durable`.
struct Pending {
    id: u64,
    offset: u64,
    len: usize,
    data: Data,
    /// Per atomic unit.
    units: Vec<Unit>,
    /// Completion sequence number once the completion has been delivered.
    completed_seq: Option<u64>,
}

struct State {
    live: Image,
    durable: Image,
    pending: Vec<Pending>,
    next_write_id: u64,
    completion_seq: u64,
    faults: Vec<Fault>,
    counters: SimCounters,
}

struct Shared {
    name: Arc<str>,
    geometry: Geometry,
    config: SimConfig,
    seed: u64,
    gone: AtomicBool,
    state: Mutex<State>,
    open_queues: AtomicU32,
    queues_opened: AtomicU32,
    memory: Arc<HostMemory>,
    /// Writes and flushes submitted so far, and the count at which power fails.
    write_ios: AtomicU64,
    power_fail_at: AtomicU64,
}

/// The simulated device. Clones share the same device.
#[derive(Clone)]
pub struct SimDevice {
    shared: Arc<Shared>,
}

impl SimDevice {
    /// A zeroed device. `seed` drives completion order, latency jitter and nothing else;
    /// crash outcomes come from the seed given to [`crash`](Self::crash).
    pub fn new(config: SimConfig, seed: u64) -> Self {
        let bytes = config.capacity_blocks * config.block_size as u64;
        Self::with_image(config, seed, Image::new(bytes), SimCounters::default())
    }

    fn with_image(config: SimConfig, seed: u64, image: Image, counters: SimCounters) -> Self {
        assert!(config.block_size.is_power_of_two() && config.block_size >= 512);
        assert!(
            config.atomic_write_bytes.is_power_of_two()
                && config.atomic_write_bytes >= 512
                && config.atomic_write_bytes <= config.block_size,
            "atomic write unit must be a power of two between 512 and the block size"
        );
        assert!(config.max_transfer_bytes.is_multiple_of(config.block_size));
        let geometry = Geometry {
            block_size: config.block_size,
            capacity_blocks: config.capacity_blocks,
            max_transfer_bytes: config.max_transfer_bytes,
            queue_depth: config.queue_depth,
            queue_count: config.queue_count,
            volatile_write_cache: config.volatile_write_cache,
            atomic_write_bytes: config.atomic_write_bytes,
            dma_alignment: config.dma_alignment,
        };
        SimDevice {
            shared: Arc::new(Shared {
                name: format!("sim:{seed:#x}").into(),
                geometry,
                config,
                seed,
                gone: AtomicBool::new(false),
                state: Mutex::new(State {
                    live: image.clone(),
                    durable: image,
                    pending: Vec::new(),
                    next_write_id: 0,
                    completion_seq: 0,
                    faults: Vec::new(),
                    counters,
                }),
                open_queues: AtomicU32::new(0),
                queues_opened: AtomicU32::new(0),
                memory: HostMemory::new(4096),
                write_ios: AtomicU64::new(0),
                power_fail_at: AtomicU64::new(u64::MAX),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().expect("sim state poisoned")
    }

    pub fn seed(&self) -> u64 {
        self.shared.seed
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.config
    }

    /// Power-fail the device. Returns a new device holding the post-crash image; this device
    /// and its queues become [`Error::Gone`]. Deterministic in (history, `crash_seed`).
    pub fn crash(&self, crash_seed: u64) -> SimDevice {
        let st = self.state();
        self.shared.gone.store(true, Ordering::Release);
        let mut rng = ChaCha8Rng::seed_from_u64(crash_seed);
        let mut image = st.durable.clone();
        let mut counters = SimCounters::default();
        let unit = self.shared.config.atomic_write_bytes as usize;
        let zeros = vec![0u8; unit];
        // Only the newest pending content of a unit can survive a crash next to the durable
        // content; writes with no such unit draw nothing from the rng.
        for p in st.pending.iter().filter(|p| p.units.contains(&Unit::Live)) {
            let choice = rng.gen_range(0..3u32);
            let keep_unit = |rng: &mut ChaCha8Rng| match choice {
                0 => true,
                1 => false,
                _ => rng.gen_bool(0.5),
            };
            match choice {
                0 => counters.crash_kept += 1,
                1 => counters.crash_dropped += 1,
                _ => counters.crash_torn += 1,
            }
            for i in 0..p.len / unit {
                if keep_unit(&mut rng) && p.units[i] == Unit::Live {
                    let src = match &p.data {
                        Data::Bytes(b) => &b[i * unit..(i + 1) * unit],
                        Data::Zeros => &zeros[..],
                    };
                    image.write(p.offset + (i * unit) as u64, src);
                }
            }
        }
        drop(st);
        let next_seed = self
            .shared
            .seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(crash_seed);
        Self::with_image(self.shared.config.clone(), next_seed, image, counters)
    }

    /// Lose power right after the `n`-th write or flush from now is submitted: that one
    /// executes (into the cache), nothing after it does, no completion is delivered any more,
    /// and the device freezes until [`crash`](Self::crash) builds the post-crash image. This
    /// gives crash points that replay exactly for a deterministic IO sequence.
    pub fn power_fail_after(&self, n: u64) {
        let now = self.shared.write_ios.load(Ordering::Acquire);
        self.shared
            .power_fail_at
            .store(now + n.max(1), Ordering::Release);
    }

    /// Whether power has failed (by `power_fail_after` or `crash`).
    pub fn is_gone(&self) -> bool {
        self.shared.gone.load(Ordering::Acquire)
    }

    /// Writes and flushes submitted to this device so far.
    pub fn write_ios(&self) -> u64 {
        self.shared.write_ios.load(Ordering::Acquire)
    }

    /// Add a fault.
    pub fn inject(&self, fault: Fault) {
        self.state().faults.push(fault);
    }

    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// Flip `count` random bits in `lba..lba+blocks` of the medium (latent corruption: both
    /// what reads see and what survives a crash). Returns (byte offset, bit) of each flip.
    pub fn flip_bits(&self, lba: u64, blocks: u64, count: usize, seed: u64) -> Vec<(u64, u8)> {
        let bs = self.shared.geometry.block_size as u64;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut st = self.state();
        let flips: Vec<(u64, u8)> = (0..count)
            .map(|_| {
                (
                    lba * bs + rng.gen_range(0..blocks * bs),
                    rng.gen_range(0..8u8),
                )
            })
            .collect();
        for &(byte, bit) in &flips {
            st.live.flip(byte, bit);
            st.durable.flip(byte, bit);
        }
        st.counters.bits_flipped += count as u64;
        flips
    }

    /// Flip one bit at an exact byte offset of the medium.
    pub fn flip_bit(&self, byte: u64, bit: u8) {
        let mut st = self.state();
        st.live.flip(byte, bit);
        st.durable.flip(byte, bit);
        st.counters.bits_flipped += 1;
    }

    pub fn counters(&self) -> SimCounters {
        self.state().counters.clone()
    }

    /// Writes in the cache not yet durable (in flight or completed and unflushed).
    pub fn pending_writes(&self) -> usize {
        self.state().pending.len()
    }

    /// Copy bytes of the durable image (what a crash would certainly keep).
    pub fn read_durable(&self, offset: u64, out: &mut [u8]) {
        self.state().durable.read(offset, out)
    }

    /// Copy bytes of the live image (what reads return).
    pub fn read_live(&self, offset: u64, out: &mut [u8]) {
        self.state().live.read(offset, out)
    }
}

impl BlockDevice for SimDevice {
    type Queue = SimQueue;

    fn name(&self) -> &Arc<str> {
        &self.shared.name
    }

    fn geometry(&self) -> &Geometry {
        &self.shared.geometry
    }

    fn open_queue(&self) -> Result<SimQueue> {
        let count = self.shared.geometry.queue_count;
        let opened =
            self.shared
                .open_queues
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < count).then_some(n + 1)
                });
        if opened.is_err() {
            return Err(Error::NoQueue {
                device: self.shared.name.clone(),
                count,
            });
        }
        let index = self.shared.queues_opened.fetch_add(1, Ordering::AcqRel) as u64;
        let depth = self.shared.geometry.queue_depth as usize;
        Ok(SimQueue {
            dev: self.clone(),
            slots: (0..depth).map(|_| None).collect(),
            in_flight: 0,
            rng: ChaCha8Rng::seed_from_u64(
                self.shared.seed ^ (index + 1).wrapping_mul(0x2545_f491),
            ),
        })
    }

    fn alloc_buf(&self, len: usize) -> Result<DmaBuf> {
        let m = self.shared.memory.alloc(len);
        m.ok_or_else(|| Error::no_host_memory(&self.shared.name, len))
    }

    fn alloc_read_buf(&self, len: usize) -> Result<DmaBuf> {
        let m = self.shared.memory.alloc_for_read(len);
        m.ok_or_else(|| Error::no_host_memory(&self.shared.name, len))
    }
}

struct Slot {
    req: Request,
    ready_at: Instant,
    result: Result<()>,
    /// For writes: the pending-write id (None when it failed or was applied durably at once).
    write_id: Option<u64>,
    /// For flushes: persist pending writes with a completion sequence ≤ this.
    flush_upto: u64,
}

/// A queue handle of a [`SimDevice`].
pub struct SimQueue {
    dev: SimDevice,
    slots: Vec<Option<Slot>>,
    in_flight: usize,
    rng: ChaCha8Rng,
}

impl SimQueue {
    fn gone(&self) -> Error {
        Error::Gone {
            device: self.dev.shared.name.clone(),
            reason: "the simulated device crashed",
        }
    }

    fn latency(&mut self, op: Op) -> Duration {
        let l = self.dev.shared.config.latency;
        let base = match op {
            Op::Read => l.read,
            Op::Flush => l.flush,
            _ => l.write,
        };
        if base.is_zero() || l.jitter_pct == 0 {
            return base;
        }
        let pct = self
            .rng
            .gen_range(100 - l.jitter_pct.min(100)..=100 + l.jitter_pct);
        base * pct / 100
    }

    /// Execute a validated request against the images; returns (result, pending write id,
    /// flush coverage).
    fn execute(&self, st: &mut State, req: &mut Request) -> (Result<()>, Option<u64>, u64) {
        let shared = &self.dev.shared;
        let bs = shared.geometry.block_size as u64;
        let (offset, len) = (req.lba * bs, req.blocks as usize * bs as usize);
        if let Some(_f) = st
            .faults
            .iter()
            .find(|f| f.hits(req.op, req.lba, req.blocks))
        {
            let read = req.op == Op::Read;
            if read {
                st.counters.read_errors += 1;
            } else {
                st.counters.write_errors += 1;
            }
            let err = Error::Media {
                device: shared.name.clone(),
                op: req.op.name(),
                lba: req.lba,
                blocks: req.blocks,
                detail: "injected fault".into(),
            };
            return (Err(err), None, 0);
        }
        match req.op {
            Op::Read => {
                st.counters.reads += 1;
                let buf = req.buf.as_mut().expect("validated read has a buffer");
                let mut tmp = vec![0u8; len];
                st.live.read(offset, &mut tmp);
                buf.write_at(req.buf_offset, &tmp);
                (Ok(()), None, 0)
            }
            Op::Flush => {
                st.counters.flushes += 1;
                (Ok(()), None, st.completion_seq)
            }
            Op::Write { .. } | Op::WriteZeroes | Op::Deallocate => {
                st.counters.writes += 1;
                let data = match &req.buf {
                    Some(buf) if req.op.has_data() => {
                        let mut tmp = vec![0u8; len];
                        buf.read_at(req.buf_offset, &mut tmp);
                        st.live.write(offset, &tmp);
                        Data::Bytes(tmp)
                    }
                    _ => {
                        st.live.zero(offset, len);
                        Data::Zeros
                    }
                };
                let id = self.add_pending(st, offset, len, data);
                (Ok(()), Some(id), 0)
            }
        }
    }

    /// Record a cached write, superseding older pending content of the same units.
    fn add_pending(&self, st: &mut State, offset: u64, len: usize, data: Data) -> u64 {
        let unit = self.dev.shared.config.atomic_write_bytes as u64;
        let end = offset + len as u64;
        for p in &mut st.pending {
            let p_end = p.offset + p.len as u64;
            if p.offset < end && offset < p_end {
                let from = (offset.max(p.offset) - p.offset) / unit;
                let to = (end.min(p_end) - p.offset) / unit;
                for u in &mut p.units[from as usize..to as usize] {
                    if *u == Unit::Live {
                        *u = Unit::Superseded;
                    }
                }
            }
        }
        let id = st.next_write_id;
        st.next_write_id += 1;
        st.pending.push(Pending {
            id,
            offset,
            len,
            data,
            units: vec![Unit::Live; (len as u64 / unit) as usize],
            completed_seq: None,
        });
        id
    }

    /// The device reports completion of `slot`: apply durability effects.
    fn deliver(&self, st: &mut State, slot: &Slot) {
        let volatile = self.dev.shared.config.volatile_write_cache;
        st.completion_seq += 1;
        let seq = st.completion_seq;
        if let Some(id) = slot.write_id {
            let fua = matches!(slot.req.op, Op::Write { fua: true });
            if let Some(p) = st.pending.iter_mut().find(|p| p.id == id) {
                p.completed_seq = Some(seq);
            }
            if fua || !volatile {
                persist(st, |p| p.id == id);
            }
        }
        if slot.req.op == Op::Flush && slot.result.is_ok() {
            let upto = slot.flush_upto;
            persist(st, |p| p.completed_seq.is_some_and(|s| s <= upto));
        }
    }

    fn take_ready(&mut self, now: Instant) -> Option<usize> {
        let n = self.slots.len();
        let start = if self.dev.shared.config.reorder {
            self.rng.gen_range(0..n)
        } else {
            0
        };
        let mut best: Option<(usize, Instant)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            if let Some(s) = &self.slots[i] {
                if s.ready_at <= now {
                    if self.dev.shared.config.reorder {
                        return Some(i);
                    }
                    if best.is_none_or(|(_, t)| s.ready_at < t) {
                        best = Some((i, s.ready_at));
                    }
                }
            }
        }
        best.map(|(i, _)| i)
    }

    fn next_ready_at(&self) -> Option<Instant> {
        self.slots.iter().flatten().map(|s| s.ready_at).min()
    }
}

/// Move pending writes selected by `pick` into the durable image, oldest first. A persisted
/// write's units kill the overlapping units of older pending writes: that older content can
/// no longer reach the durable image, nor survive a crash.
fn persist(st: &mut State, pick: impl Fn(&Pending) -> bool) {
    let State {
        durable, pending, ..
    } = st;
    let picked: Vec<bool> = pending.iter().map(&pick).collect();
    for (i, _) in picked.iter().enumerate().filter(|(_, &p)| p) {
        let (older, rest) = pending.split_at_mut(i);
        let p = &rest[0];
        let u = p.len / p.units.len().max(1);
        for (k, &state) in p.units.iter().enumerate() {
            if state == Unit::Dead {
                continue;
            }
            let at = p.offset + (k * u) as u64;
            match &p.data {
                Data::Bytes(b) => durable.write(at, &b[k * u..(k + 1) * u]),
                Data::Zeros => durable.zero(at, u),
            }
        }
        let end = p.offset + p.len as u64;
        for o in older.iter_mut() {
            let o_end = o.offset + o.len as u64;
            if o.offset < end && p.offset < o_end {
                let ou = (o.len / o.units.len().max(1)) as u64;
                let from = (p.offset.max(o.offset) - o.offset) / ou;
                let to = (end.min(o_end) - o.offset) / ou;
                o.units[from as usize..to as usize].fill(Unit::Dead);
            }
        }
    }
    let mut k = 0;
    pending.retain(|p| {
        let keep = !picked[k] && p.units.iter().any(|&u| u != Unit::Dead);
        k += 1;
        keep
    });
}

impl QueueHandle for SimQueue {
    fn submit(&mut self, mut req: Request) -> Result<(), SubmitError> {
        if self.dev.shared.gone.load(Ordering::Acquire) {
            let e = self.gone();
            return Err(SubmitError::rejected(e, req));
        }
        if let Err(e) = req.validate(&self.dev.shared.name, &self.dev.shared.geometry) {
            return Err(SubmitError::rejected(e, req));
        }
        let Some(free) = self.slots.iter().position(|s| s.is_none()) else {
            return Err(SubmitError::full(req));
        };
        let ready_at = Instant::now() + self.latency(req.op);
        let dev = self.dev.clone();
        let mut st = dev.state();
        let mut freeze = false;
        if req.op != Op::Read {
            let shared = &dev.shared;
            let n = shared.write_ios.fetch_add(1, Ordering::AcqRel) + 1;
            let at = shared.power_fail_at.load(Ordering::Acquire);
            if n > at {
                drop(st);
                let e = self.gone();
                return Err(SubmitError::rejected(e, req));
            }
            freeze = n == at;
        }
        let (result, write_id, flush_upto) = self.execute(&mut st, &mut req);
        if freeze {
            dev.shared.gone.store(true, Ordering::Release);
        }
        drop(st);
        self.slots[free] = Some(Slot {
            req,
            ready_at,
            result,
            write_id,
            flush_upto,
        });
        self.in_flight += 1;
        Ok(())
    }

    fn kick(&mut self) -> Result<()> {
        Ok(())
    }

    fn poll(&mut self, out: &mut [Completion]) -> Result<usize> {
        let now = Instant::now();
        let mut n = 0;
        let dev = self.dev.clone();
        let gone = dev.shared.gone.load(Ordering::Acquire);
        let mut st = dev.state();
        while n < out.len() {
            let Some(i) = self.take_ready(now) else { break };
            let slot = self.slots[i].take().expect("ready slot");
            self.in_flight -= 1;
            let result = if gone {
                Err(self.gone())
            } else {
                self.deliver(&mut st, &slot);
                slot.result
            };
            out[n] = Completion {
                tag: slot.req.tag,
                op: slot.req.op,
                result,
                buf: slot.req.buf,
            };
            n += 1;
        }
        Ok(n)
    }

    fn wait(&mut self, out: &mut [Completion], min: usize, timeout: Duration) -> Result<usize> {
        let min = min.min(out.len()).min(self.in_flight);
        let deadline = Instant::now() + timeout;
        let mut got = self.poll(out)?;
        while got < min {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    device: self.dev.shared.name.clone(),
                    what: "simulated completions",
                    timeout,
                });
            }
            if let Some(t) = self.next_ready_at() {
                if t > now {
                    std::thread::sleep(t.min(deadline) - now);
                }
            }
            got += self.poll(&mut out[got..])?;
        }
        Ok(got)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn depth(&self) -> usize {
        self.slots.len()
    }
}

impl Drop for SimQueue {
    fn drop(&mut self) {
        self.dev.shared.open_queues.fetch_sub(1, Ordering::AcqRel);
    }
}
