//! The read path: lock-free index lookups, per-thread device queues, chunk reads into DMA
//! buffers verified by CRC32C.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;
use std::time::Duration;

use driver::{BlockDevice, Completion, DmaBuf, QueueHandle, Request};
use smallvec::SmallVec;

use crate::cache::{
    Cached, ReadCache, ADMIT_CHUNK_BYTES, ADMIT_READ_BYTES, ADMIT_SMALL_BYTES, ADMIT_WASTE_FACTOR,
};
use crate::error::{Result, StoreError};
use crate::format::{round_up, ChunkRef};
use crate::key::ObjectKey;
use crate::meta::ObjectMeta;
use crate::{Shared, Store};

/// How long a read may wait for the device.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a read retries when the object moved underneath it (cleaner relocation).
const READ_RETRIES_MAX: u32 = 8;

/// What `stat` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectStat {
    pub size: u64,
    pub version: u64,
    pub mtime_unix_ns: u64,
    /// CRC32C of the whole content.
    pub checksum: u32,
}

impl From<&ObjectMeta> for ObjectStat {
    fn from(m: &ObjectMeta) -> Self {
        ObjectStat {
            size: m.size,
            version: m.version,
            mtime_unix_ns: m.mtime_unix_ns,
            checksum: m.data_crc,
        }
    }
}

/// A piece of a read result.
#[derive(Debug)]
pub enum Part {
    /// `len` bytes at `start` of a DMA buffer the device read into.
    Data {
        buf: DmaBuf,
        start: usize,
        len: usize,
    },
    /// A hole: zeros.
    Zeros(usize),
    /// `len` bytes at `start` of a chunk held by the read cache.
    Cached {
        chunk: Arc<Cached>,
        start: usize,
        len: usize,
    },
}

impl Part {
    fn len(&self) -> usize {
        match self {
            Part::Data { len, .. } | Part::Cached { len, .. } => *len,
            Part::Zeros(n) => *n,
        }
    }
}

/// The bytes of a read, in order, left where the device put them.
#[derive(Debug, Default)]
pub struct ReadBuf {
    /// Inline for the common one-part read: a small read allocates no vector.
    pub parts: SmallVec<[Part; 1]>,
    /// Version of the object the bytes belong to.
    pub version: u64,
    /// (length, CRC-32C) of each chunk the read returned, in order, tiling its bytes; empty
    /// unless every byte is part of a whole chunk read from the device and verified. A node
    /// sends them with a shard read, so the primary knows the CRC of each stripe unit it
    /// reassembles without summing the bytes (docs/format.md, SHARD_READ).
    pub chunk_crcs: SmallVec<[(u32, u32); 2]>,
}

impl ReadBuf {
    pub fn len(&self) -> usize {
        self.parts.iter().map(Part::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy into `out` (which must be `len()` bytes).
    pub fn copy_to(&self, out: &mut [u8]) {
        assert_eq!(
            out.len(),
            self.len(),
            "copy_to needs a buffer of exactly len() bytes"
        );
        let mut at = 0;
        for p in &self.parts {
            let to = &mut out[at..at + p.len()];
            match p {
                Part::Data { buf, start, .. } => buf.read_at(*start, to),
                Part::Zeros(_) => to.fill(0),
                Part::Cached { chunk, start, len } => {
                    to.copy_from_slice(&chunk.bytes()[*start..start + len])
                }
            }
            at += p.len();
        }
    }

    /// The bytes in a new Vec (copied once; no zeroing pass first).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        self.append_to(&mut v);
        v
    }

    /// Append the bytes to `v` (copied once).
    pub fn append_to(&self, v: &mut Vec<u8>) {
        v.reserve(self.len());
        for p in &self.parts {
            match p {
                Part::Data { buf, start, len } => buf.append_to(*start, *len, v),
                Part::Zeros(n) => v.resize(v.len() + n, 0),
                Part::Cached { chunk, start, len } => {
                    v.extend_from_slice(&chunk.bytes()[*start..start + len])
                }
            }
        }
    }
}

/// A thread's queue handle for synchronous reads, and the vectors of its last read.
pub(crate) struct ThreadRead<Q> {
    q: Option<Q>,
    scratch: ReadScratch,
}

/// The vectors of a synchronous read (chunk refs, IO runs, per-ref locations, run buffers,
/// completions), kept per thread for the next.
#[derive(Default)]
pub(crate) struct ReadScratch {
    refs: Vec<ChunkRef>,
    runs: Vec<(u64, u64)>,
    loc: Vec<(usize, usize)>,
    bufs: Vec<Option<DmaBuf>>,
    comps: Vec<Completion>,
}

/// IO runs (disk offset, bytes), and per ref (run index, offset in the run).
type RunPlan = (Vec<(u64, u64)>, Vec<(usize, usize)>);

/// Buffers of a `read_refs`, and per ref (buffer index, offset in it).
pub(crate) type RefsRead = (Vec<DmaBuf>, Vec<(usize, usize)>);

impl<D: BlockDevice> Shared<D> {
    /// Run `f` with this thread's queue handle (opened on first use), or the shared spare
    /// queue when the device has no queue left for this thread, and the thread's read
    /// vectors.
    pub(crate) fn with_queue<T>(&self, f: impl FnOnce(&mut D::Queue, &mut ReadScratch) -> T) -> T {
        let cell = self.read_queues.get_or(|| {
            std::cell::RefCell::new(ThreadRead {
                q: self.dev.open_queue().ok(),
                scratch: ReadScratch::default(),
            })
        });
        let mut t = cell.borrow_mut();
        let t = &mut *t;
        match t.q.as_mut() {
            Some(q) => f(q, &mut t.scratch),
            None => {
                let mut spare = self.spare_queue.lock().unwrap();
                f(spare.as_mut().expect("spare queue"), &mut t.scratch)
            }
        }
    }

    fn corrupted(&self, what: &'static str, r: &ChunkRef, found: u32) -> StoreError {
        StoreError::Corrupted {
            device: self.name.clone(),
            what,
            offset: r.offset.get(),
            len: r.len.get() as u64,
            expected: r.crc.get(),
            found,
        }
    }

    /// Read whole chunk refs (each verified) into DMA buffers: refs adjacent in the list and
    /// on disk are merged into one IO of up to the device's max transfer; a hole (zero-length
    /// ref) is skipped and ends a run. Returns one entry per ref: (buffer index, offset in that
    /// buffer), `usize::MAX` for holes.
    pub(crate) fn read_refs(&self, refs: &[ChunkRef], what: &'static str) -> Result<RefsRead> {
        let (runs, loc) = self.plan_runs(refs);
        let bufs = self.read_runs(&runs)?;
        self.verify_refs(refs, &loc, what, |b| &bufs[b])?;
        Ok((bufs, loc))
    }

    /// Group refs into IO runs: (disk offset, bytes) per run, and per ref (run, offset in it).
    pub(crate) fn plan_runs(&self, refs: &[ChunkRef]) -> RunPlan {
        let (mut runs, mut loc) = (Vec::new(), Vec::with_capacity(refs.len()));
        self.plan_runs_into(refs, &mut runs, &mut loc);
        (runs, loc)
    }

    /// [`Shared::plan_runs`] into vectors the caller keeps (cleared first).
    pub(crate) fn plan_runs_into(
        &self,
        refs: &[ChunkRef],
        runs: &mut Vec<(u64, u64)>,
        loc: &mut Vec<(usize, usize)>,
    ) {
        let block = self.layout.block;
        let max = self.dev.geometry().max_transfer_bytes as u64;
        runs.clear();
        loc.clear();
        let mut prev_hole = true;
        for r in refs {
            if r.len.get() == 0 {
                loc.push((usize::MAX, 0));
                prev_hole = true;
                continue;
            }
            let (off, len) = (r.offset.get(), round_up(r.len.get() as u64, block));
            let joinable = !prev_hole;
            prev_hole = false;
            let last_idx = runs.len().wrapping_sub(1);
            match runs.last_mut() {
                Some((start, n)) if joinable && *start + *n == off && *n + len <= max => {
                    loc.push((last_idx, *n as usize));
                    *n += len;
                }
                _ => {
                    loc.push((runs.len(), 0));
                    runs.push((off, len));
                }
            }
        }
    }

    /// Read each (disk offset, bytes) run into its own DMA buffer, all in flight at once up to
    /// the queue depth. On an error the remaining reads are still drained, so the thread's
    /// queue is left idle.
    fn read_runs(&self, runs: &[(u64, u64)]) -> Result<Vec<DmaBuf>> {
        let mut bufs = Vec::new();
        self.with_queue(|q, s| self.read_runs_into(q, &mut s.comps, runs, &mut bufs))?;
        Ok(bufs
            .into_iter()
            .map(|b| b.expect("every run completed"))
            .collect())
    }

    /// [`Shared::read_runs`] on `q`, into `bufs` (one per run; cleared first), reaping into
    /// `comps`: with vectors the caller keeps, a read allocates nothing.
    fn read_runs_into(
        &self,
        q: &mut D::Queue,
        comps: &mut Vec<Completion>,
        runs: &[(u64, u64)],
        bufs: &mut Vec<Option<DmaBuf>>,
    ) -> Result<()> {
        let block = self.layout.block;
        bufs.clear();
        bufs.resize_with(runs.len(), || None);
        if comps.is_empty() {
            comps.resize_with(8, Completion::default);
        }
        let mut next = 0;
        let mut error = None;
        while next < runs.len() || q.in_flight() > 0 {
            while error.is_none() && next < runs.len() && q.in_flight() < q.depth() {
                let (off, len) = runs[next];
                let submitted = self
                    .dev
                    .alloc_read_buf(len as usize)
                    .map_err(Into::into)
                    .and_then(|buf| {
                        let req =
                            Request::read(off / block, (len / block) as u32, buf, 0, next as u64);
                        q.submit(req).map_err(|e| e.into_error(&self.name).into())
                    });
                if let Err(e) = submitted {
                    error = Some(e);
                    break;
                }
                next += 1;
            }
            if error.is_some() && q.in_flight() == 0 {
                break;
            }
            let n = q.wait(comps, 1, READ_TIMEOUT)?;
            for c in &mut comps[..n] {
                let c = std::mem::take(c);
                match c.result {
                    Ok(()) => bufs[c.tag as usize] = c.buf,
                    Err(e) => {
                        error.get_or_insert(e.into());
                    }
                }
            }
        }
        match error {
            Some(e) => {
                bufs.clear();
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Check each chunk's CRC-32C where `buf(b)`, its run's buffer, holds it (holes skipped).
    fn verify_refs<'a>(
        &self,
        refs: &[ChunkRef],
        loc: &[(usize, usize)],
        what: &'static str,
        buf: impl Fn(usize) -> &'a DmaBuf,
    ) -> Result<()> {
        for (r, &(b, at)) in refs.iter().zip(loc) {
            if b == usize::MAX {
                continue;
            }
            let found = buf(b).crc32c(0, at, r.len.get() as usize);
            if found != r.crc.get() {
                return Err(self.corrupted(what, r, found));
            }
        }
        Ok(())
    }

    /// Read one chunk ref fully into a Vec (read-modify-write, xattrs, the cleaner).
    pub(crate) fn read_ref_vec(&self, r: &ChunkRef, what: &'static str) -> Result<Vec<u8>> {
        let (bufs, loc) = self.read_refs(std::slice::from_ref(r), what)?;
        let mut v = vec![0u8; r.len.get() as usize];
        bufs[loc[0].0].read_at(loc[0].1, &mut v);
        Ok(v)
    }

    /// The chunk refs covering `offset..offset+len` of an object (holes as zero refs), the
    /// first chunk index, and the clamped end.
    pub(crate) fn refs_for(
        &self,
        m: &ObjectMeta,
        offset: u64,
        len: u64,
    ) -> (Vec<ChunkRef>, usize, u64) {
        let mut refs = Vec::new();
        let (first, end) = self.refs_into(m, offset, len, &mut refs);
        (refs, first, end)
    }

    /// [`Shared::refs_for`] into a vector the caller keeps (cleared first): the first chunk
    /// index and the clamped end.
    pub(crate) fn refs_into(
        &self,
        m: &ObjectMeta,
        offset: u64,
        len: u64,
        refs: &mut Vec<ChunkRef>,
    ) -> (usize, u64) {
        let cb = self.chunk_bytes;
        let end = offset.saturating_add(len).min(m.size);
        refs.clear();
        if offset >= end {
            return (0, end);
        }
        let first = (offset / cb) as usize;
        let last = ((end - 1) / cb) as usize;
        refs.extend((first..=last).map(|i| m.chunks.get(i).copied().unwrap_or_default()));
        (first, end)
    }

    /// Turn read runs into the parts of a result: one part per run (chunks in a run are
    /// logically consecutive), one per hole. Takes the run buffers out of `bufs`.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        &self,
        m: &ObjectMeta,
        offset: u64,
        end: u64,
        first: usize,
        refs: &[ChunkRef],
        loc: &[(usize, usize)],
        bufs: &mut [Option<DmaBuf>],
    ) -> ReadBuf {
        let cb = self.chunk_bytes;
        let mut out = ReadBuf {
            parts: SmallVec::new(),
            version: m.version,
            chunk_crcs: SmallVec::with_capacity(loc.len()),
        };
        let mut whole = true;
        let mut i = 0;
        while i < loc.len() {
            let c = (first + i) as u64;
            let lo = (c * cb).max(offset);
            let (b, at) = loc[i];
            let mut j = i + 1;
            while j < loc.len() && b != usize::MAX && loc[j].0 == b {
                j += 1;
            }
            let hi = ((first + j) as u64 * cb).min(end);
            if b == usize::MAX {
                out.parts.push(Part::Zeros((hi - lo) as usize));
                whole = false;
            } else {
                let start = at + (lo - c * cb) as usize;
                let buf = bufs[b].take().expect("a run buffer backs one part");
                // The chunk CRCs, when each chunk in the part is covered from its first byte
                // through its stored length, where the buffer holds it: the part is then
                // exactly the chunks' verified bytes back to back.
                for t in i..j {
                    let ct = (first + t) as u64;
                    let (clo, chi) = ((ct * cb).max(lo), ((ct + 1) * cb).min(hi));
                    let (len, sum) = (refs[t].len.get(), refs[t].crc.get());
                    whole &= clo == ct * cb
                        && chi - clo == u64::from(len)
                        && loc[t].1 == start + (clo - lo) as usize;
                    if whole {
                        out.chunk_crcs.push((len, sum));
                    }
                }
                out.parts.push(Part::Data {
                    buf,
                    start,
                    len: (hi - lo) as usize,
                });
            }
            i = j;
        }
        if !whole {
            out.chunk_crcs.clear();
        }
        out
    }

    /// Verify the chunks of a finished read and assemble its parts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn verify_and_assemble(
        &self,
        m: &ObjectMeta,
        offset: u64,
        end: u64,
        first: usize,
        refs: &[ChunkRef],
        loc: &[(usize, usize)],
        bufs: &mut [Option<DmaBuf>],
    ) -> Result<ReadBuf> {
        self.verify_runs(refs, loc, bufs)?;
        Ok(self.assemble(m, offset, end, first, refs, loc, bufs))
    }

    /// [`Shared::verify_refs`] of an object's chunks over run buffers still in their slots.
    fn verify_runs(
        &self,
        refs: &[ChunkRef],
        loc: &[(usize, usize)],
        bufs: &[Option<DmaBuf>],
    ) -> Result<()> {
        self.verify_refs(refs, loc, "object chunk", |b| {
            bufs[b].as_ref().expect("run buffer present")
        })
    }

    /// Read a range of the object `m` (the index entry of `key`) from the device. With
    /// `fill`, a small read keeps copies of its chunks in the read cache.
    fn read_meta(
        &self,
        key: &ObjectKey,
        m: &ObjectMeta,
        offset: u64,
        len: u64,
        fill: bool,
    ) -> Result<ReadBuf> {
        // The thread's vectors of its last read: a read allocates none of its own (the node
        // serves every read from its op threads through here).
        self.with_queue(|q, s| {
            let (first, end) = self.refs_into(m, offset, len, &mut s.refs);
            let refs = &s.refs;
            let wanted = end.saturating_sub(offset);
            let chunk_bytes: u64 = refs.iter().map(|r| r.len.get() as u64).sum();
            let fill = self.cache.as_ref().filter(|c| {
                fill && c.enabled()
                    && wanted <= ADMIT_READ_BYTES
                    && chunk_bytes <= ADMIT_WASTE_FACTOR * wanted.max(ADMIT_SMALL_BYTES)
                    && refs.iter().all(|r| r.len.get() <= ADMIT_CHUNK_BYTES)
            });
            // Sampled before the read: see the cache module on why that makes an entry exact.
            let gens: Vec<u32> = match fill {
                Some(c) => refs
                    .iter()
                    .map(|r| match r.len.get() {
                        0 => 0,
                        _ => c.gen(self.layout.segment_of(r.offset.get())),
                    })
                    .collect(),
                None => Vec::new(),
            };
            self.plan_runs_into(refs, &mut s.runs, &mut s.loc);
            let read = self.read_runs_into(q, &mut s.comps, &s.runs, &mut s.bufs);
            if let Err(e) = read.and_then(|()| self.verify_runs(refs, &s.loc, &s.bufs)) {
                // No buffer of a failed read stays with the thread.
                s.bufs.clear();
                return Err(e);
            }
            if let Some(c) = fill {
                c.miss();
                if !self.moved(key, m) {
                    for ((r, &(b, at)), gen) in refs.iter().zip(&s.loc).zip(gens) {
                        if let Some(buf) = s.bufs.get(b).and_then(Option::as_ref) {
                            let mut v = Vec::with_capacity(r.len.get() as usize);
                            buf.append_to(at, r.len.get() as usize, &mut v);
                            c.insert(r, gen, v);
                        }
                    }
                }
            }
            let out = self.assemble(m, offset, end, first, refs, &s.loc, &mut s.bufs);
            s.bufs.clear();
            Ok(out)
        })
    }

    /// A small read of the object `m` served from the read cache, if every chunk it needs is
    /// there.
    fn read_cached(&self, c: &ReadCache, m: &ObjectMeta, offset: u64, len: u64) -> Option<ReadBuf> {
        let (refs, first, end) = self.refs_for(m, offset, len);
        if refs.is_empty() || end - offset > ADMIT_READ_BYTES {
            return None;
        }
        let cb = self.chunk_bytes;
        let mut out = ReadBuf {
            parts: SmallVec::with_capacity(refs.len()),
            version: m.version,
            chunk_crcs: SmallVec::new(),
        };
        for (i, r) in refs.iter().enumerate() {
            let ci = (first + i) as u64;
            let lo = (ci * cb).max(offset);
            let want = (((ci + 1) * cb).min(end) - lo) as usize;
            if r.len.get() == 0 {
                out.parts.push(Part::Zeros(want));
                continue;
            }
            let chunk = c.get(r, self.layout.segment_of(r.offset.get()))?;
            let start = (lo - ci * cb) as usize;
            let have = chunk.bytes().len().saturating_sub(start).min(want);
            out.parts.push(Part::Cached {
                chunk,
                start,
                len: have,
            });
            if have < want {
                out.parts.push(Part::Zeros(want - have));
            }
        }
        c.hit();
        Some(out)
    }

    /// [`Shared::read_object`] when the read cache holds every chunk the range needs; `None`
    /// otherwise (and for an object that is not there): never a device command.
    pub(crate) fn read_if_cached(&self, key: &ObjectKey, offset: u64, len: u64) -> Option<ReadBuf> {
        let c = self.cache.as_ref().filter(|c| c.enabled())?;
        let m = self.lookup(key).ok()?;
        let r = self.read_cached(c, &m, offset, len)?;
        self.stats.reads.inc();
        self.stats.read_bytes.add(r.len() as u64);
        Some(r)
    }

    /// Several reads in one go from the calling thread: every object's IOs are in flight
    /// together (up to the queue depth), so one thread drives the device at depth.
    pub(crate) fn read_many(&self, reqs: &[(ObjectKey, u64, u64)]) -> Vec<Result<ReadBuf>> {
        let mut plans = Vec::with_capacity(reqs.len());
        let mut all: Vec<ChunkRef> = Vec::new();
        for (key, off, len) in reqs {
            match self.lookup(key) {
                Ok(m) => {
                    let (refs, first, end) = self.refs_for(&m, *off, *len);
                    let at = all.len();
                    all.extend_from_slice(&refs);
                    all.push(ChunkRef::default()); // a hole keeps runs from spanning objects
                    plans.push(Ok((m, first, end, at, refs.len())));
                }
                Err(e) => plans.push(Err(e)),
            }
        }
        let (runs, loc) = self.plan_runs(&all);
        let mut bufs: Vec<Option<DmaBuf>> = match self.read_runs(&runs) {
            Ok(b) => b.into_iter().map(Some).collect(),
            Err(_) => {
                // A device error: fall back to one read each, so each gets its own result.
                return reqs
                    .iter()
                    .map(|(k, o, l)| self.read_object(k, *o, *l, false))
                    .collect();
            }
        };
        let mut out = Vec::with_capacity(reqs.len());
        for (i, plan) in plans.into_iter().enumerate() {
            let (m, first, end, at, n) = match plan {
                Ok(p) => p,
                Err(e) => {
                    out.push(Err(e));
                    continue;
                }
            };
            let (key, off, len) = &reqs[i];
            let refs = &all[at..at + n];
            let locs = &loc[at..at + n];
            let verified = self.verify_runs(refs, locs, &bufs);
            match verified {
                Ok(()) => {
                    let rb = self.assemble(&m, *off, end, first, refs, locs, &mut bufs);
                    self.stats.reads.inc();
                    self.stats.read_bytes.add(rb.len() as u64);
                    out.push(Ok(rb));
                }
                // Moved underneath (or really corrupt): the single-read path retries or
                // reports it.
                Err(_) => out.push(self.read_object(key, *off, *len, false)),
            }
        }
        out
    }

    /// Read a range of `key`; with `cached`, from the read cache when it holds the chunks
    /// (and filling it when it does not).
    pub(crate) fn read_object(
        &self,
        key: &ObjectKey,
        offset: u64,
        len: u64,
        cached: bool,
    ) -> Result<ReadBuf> {
        let mut attempt = 0;
        loop {
            let m = self.lookup(key)?;
            if let Some(r) = self
                .cache
                .as_ref()
                .filter(|c| cached && c.enabled())
                .and_then(|c| self.read_cached(c, &m, offset, len))
            {
                self.stats.reads.inc();
                self.stats.read_bytes.add(r.len() as u64);
                return Ok(r);
            }
            match self.read_meta(key, &m, offset, len, cached) {
                Err(StoreError::Corrupted { .. })
                    if attempt < READ_RETRIES_MAX && self.moved(key, &m) =>
                {
                    // The cleaner relocated the object and its old segment was reused while
                    // we read it: read the new location.
                    self.stats.read_retries.inc();
                    attempt += 1;
                }
                Err(e @ StoreError::Corrupted { .. }) => {
                    self.stats.corrupt_reads.inc();
                    return Err(e);
                }
                Err(e) => return Err(e),
                Ok(r) => {
                    self.stats.reads.inc();
                    self.stats.read_bytes.add(r.len() as u64);
                    return Ok(r);
                }
            }
        }
    }

    pub(crate) fn moved(&self, key: &ObjectKey, m: &ObjectMeta) -> bool {
        self.index.state_seq(key).is_none_or(|s| s != m.state_seq)
    }

    pub(crate) fn lookup(&self, key: &ObjectKey) -> Result<Arc<ObjectMeta>> {
        self.index_get(key)
            .ok_or_else(|| StoreError::NotFound(key.clone()))
    }

    /// The index entry of `key` (entries are updated in place, so an object being
    /// overwritten is never missing: see [`crate::Index`]).
    pub(crate) fn index_get(&self, key: &ObjectKey) -> Option<Arc<ObjectMeta>> {
        self.index.get(key)
    }

    pub(crate) fn load_xattrs(&self, m: &ObjectMeta) -> Result<BTreeMap<String, Vec<u8>>> {
        self.load_xattr_map(&m.xattrs)
    }

    /// The xattr map stored at `r` (empty for a zero-length ref).
    pub(crate) fn load_xattr_map(&self, r: &ChunkRef) -> Result<BTreeMap<String, Vec<u8>>> {
        if r.len.get() == 0 {
            return Ok(BTreeMap::new());
        }
        let raw = self.read_ref_vec(r, "xattr map")?;
        decode_xattrs(&raw).ok_or_else(|| StoreError::Format {
            device: self.name.clone(),
            detail: format!("xattr map at byte {} does not parse", r.offset.get()),
        })
    }
}

/// Serialized xattr map: count (u32), then per entry name length (u16), value length (u32),
/// name bytes, value bytes; entries in name order.
pub(crate) fn encode_xattrs(map: &BTreeMap<String, Vec<u8>>) -> Vec<u8> {
    let bytes: usize = map.iter().map(|(k, val)| 6 + k.len() + val.len()).sum();
    let mut v = Vec::with_capacity(4 + bytes);
    v.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (k, val) in map {
        v.extend_from_slice(&(k.len() as u16).to_le_bytes());
        v.extend_from_slice(&(val.len() as u32).to_le_bytes());
        v.extend_from_slice(k.as_bytes());
        v.extend_from_slice(val);
    }
    v
}

pub(crate) fn decode_xattrs(mut b: &[u8]) -> Option<BTreeMap<String, Vec<u8>>> {
    let take = |b: &mut &[u8], n: usize| -> Option<Vec<u8>> {
        if b.len() < n {
            return None;
        }
        let (h, t) = b.split_at(n);
        *b = t;
        Some(h.to_vec())
    };
    let n = u32::from_le_bytes(take(&mut b, 4)?.try_into().ok()?);
    let mut map = BTreeMap::new();
    for _ in 0..n {
        let kl = u16::from_le_bytes(take(&mut b, 2)?.try_into().ok()?) as usize;
        let vl = u32::from_le_bytes(take(&mut b, 4)?.try_into().ok()?) as usize;
        let k = String::from_utf8(take(&mut b, kl)?).ok()?;
        let v = take(&mut b, vl)?;
        map.insert(k, v);
    }
    b.is_empty().then_some(map)
}

impl<D: BlockDevice + 'static> Store<D> {
    pub fn stat(&self, key: &ObjectKey) -> Result<ObjectStat> {
        Ok(ObjectStat::from(&*self.sh.lookup(key)?))
    }

    pub fn exists(&self, key: &ObjectKey) -> bool {
        self.sh.index_get(key).is_some()
    }

    /// Read `len` bytes at `offset` (clamped to the object's size) into DMA buffers, or from
    /// the read cache when it holds them (see [`crate::cache`]).
    pub fn read(&self, key: &ObjectKey, offset: u64, len: u64) -> Result<ReadBuf> {
        self.sh.read_object(key, offset, len, true)
    }

    /// Like [`Store::read`], but always from the device, checking every chunk's crc32c there
    /// (scrubs and repairs: a cached copy would hide rot on the medium); leaves the read
    /// cache as it is.
    pub fn read_uncached(&self, key: &ObjectKey, offset: u64, len: u64) -> Result<ReadBuf> {
        self.sh.read_object(key, offset, len, false)
    }

    /// [`Store::read`] only when the read cache holds every chunk of the range; `None`
    /// otherwise. Never waits for the device: for a caller that must not block (a messenger
    /// thread), which sends anything else to a thread that may.
    pub fn read_if_cached(&self, key: &ObjectKey, offset: u64, len: u64) -> Option<ReadBuf> {
        self.sh.read_if_cached(key, offset, len)
    }

    /// Several reads issued together from this thread (up to the device queue depth in
    /// flight), from the device: for callers serving many requests at once.
    pub fn read_many(&self, reqs: &[(ObjectKey, u64, u64)]) -> Vec<Result<ReadBuf>> {
        self.sh.read_many(reqs)
    }

    /// Read a range into a new Vec.
    pub fn read_vec(&self, key: &ObjectKey, offset: u64, len: u64) -> Result<Vec<u8>> {
        Ok(self.read(key, offset, len)?.to_vec())
    }

    /// Objects of `pool` in key order, starting after `after` (a name), at most `max`.
    pub fn list(
        &self,
        pool: u64,
        after: Option<&ObjectKey>,
        max: usize,
    ) -> Vec<(ObjectKey, ObjectStat)> {
        let lower = match after {
            Some(k) => Bound::Excluded(k.clone()),
            None => Bound::Included(ObjectKey {
                pool,
                name: Default::default(),
                shard: 0,
            }),
        };
        self.sh
            .index
            .range((lower, Bound::Unbounded))
            .take_while(|e| e.key().pool == pool)
            .take(max)
            .map(|e| (e.key().clone(), ObjectStat::from(&**e.value().load())))
            .collect()
    }

    pub fn get_xattr(&self, key: &ObjectKey, name: &str) -> Result<Vec<u8>> {
        let m = self.sh.lookup(key)?;
        self.sh
            .load_xattrs(&m)?
            .remove(name)
            .ok_or_else(|| StoreError::NoXattr {
                key: key.clone(),
                name: name.into(),
            })
    }

    pub fn xattrs(&self, key: &ObjectKey) -> Result<BTreeMap<String, Vec<u8>>> {
        let m = self.sh.lookup(key)?;
        self.sh.load_xattrs(&m)
    }

    /// The index entry of an object (for tools and tests).
    pub fn meta(&self, key: &ObjectKey) -> Option<Arc<ObjectMeta>> {
        self.sh.index_get(key)
    }

    /// Where an object's data chunks sit on the device now: (byte offset, length) of each
    /// stored chunk in order, holes skipped (the xattr map is not included). The cleaner may
    /// move them later. For tools and for tests that corrupt data in place.
    pub fn locate(&self, key: &ObjectKey) -> Result<Vec<(u64, u64)>> {
        let m = self.sh.lookup(key)?;
        Ok(m.chunks
            .iter()
            .filter(|r| r.len.get() > 0)
            .map(|r| (r.offset.get(), r.len.get() as u64))
            .collect())
    }
}
