//! Streams of batches across chained segments: the log, and each checkpoint.
//!
//! A stream starts in a segment; each segment's header names the segment the stream continues
//! in (chosen when the segment is opened). Batches within a stream have consecutive sequence
//! numbers. A reader follows the chain and stops at the first batch that is missing, torn
//! (crc), out of sequence, from another stream (an older mkfs or checkpoint) or from an older
//! open generation than the batch before it (stale bytes past a crash point).

use std::time::Duration;

use driver::{BlockDevice, QueueHandle, Request};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::error::{Result, StoreError};
use crate::format::{
    round_up, BatchHeader, SegmentHeader, BATCH_MAGIC, FORMAT_VERSION, SEGMENTS_START_BYTES,
    SEGMENT_MAGIC,
};
use crate::space::{SegState, Segments};

/// Geometry of the store on its device.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub block: u64,
    pub segment_bytes: u64,
    pub segments: u32,
}

impl Layout {
    pub fn segment_base(&self, seg: u32) -> u64 {
        SEGMENTS_START_BYTES + seg as u64 * self.segment_bytes
    }

    /// The segment holding an absolute byte offset.
    pub fn segment_of(&self, offset: u64) -> u32 {
        ((offset - SEGMENTS_START_BYTES) / self.segment_bytes) as u32
    }

    /// Bytes a batch occupies: header + records padded to a block, then the data area.
    pub fn batch_bytes(&self, meta_bytes: u64, data_bytes: u64) -> u64 {
        round_up(64 + meta_bytes, self.block) + data_bytes
    }
}

/// A position in a stream: the next batch goes to byte `off` of `seg` (0: the segment is not
/// opened yet, its header comes first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pos {
    pub seg: u32,
    pub off: u64,
    pub seg_seq: u64,
    pub batch_seq: u64,
    /// Where the stream continues (valid once `seg` is opened).
    pub next_seg: u32,
}

/// A batch as read back.
pub struct BatchRead {
    pub header: BatchHeader,
    pub records: Vec<crate::meta::Record>,
    pub bytes: u64,
}

/// Read `len` bytes at `offset` with up to `depth` reads in flight.
pub fn read_region<D: BlockDevice>(
    dev: &D,
    q: &mut D::Queue,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>> {
    let geo = dev.geometry();
    let bs = geo.block_size as u64;
    let piece = geo.max_transfer_bytes.min(1 << 20) as u64;
    // Filled piece by piece as reads complete, in any order; its length is set once every
    // byte has been copied in (no zeroing pass over a whole segment first).
    let mut out: Vec<u8> = Vec::with_capacity(len as usize);
    let pieces = len.div_ceil(piece);
    let mut next = 0u64;
    let mut done = 0u64;
    let mut comps: Vec<driver::Completion> = (0..8).map(|_| Default::default()).collect();
    let mut spare: Vec<driver::DmaBuf> = Vec::new();
    while done < pieces {
        while next < pieces && q.in_flight() < q.depth().min(8) {
            let at = next * piece;
            let n = piece.min(len - at);
            let buf = match spare.pop() {
                Some(b) => b,
                None => dev.alloc_read_buf(piece as usize)?,
            };
            let req = Request::read((offset + at) / bs, (n / bs) as u32, buf, 0, next);
            q.submit(req).map_err(|e| e.into_error(dev.name()))?;
            next += 1;
        }
        let n = q.wait(&mut comps, 1, Duration::from_secs(30))?;
        for c in &mut comps[..n] {
            let c = std::mem::take(c);
            c.result?;
            let buf = c.buf.expect("read returns its buffer");
            let at = c.tag * piece;
            let n = piece.min(len - at) as usize;
            buf.read_into_uninit(
                0,
                &mut out.spare_capacity_mut()[at as usize..at as usize + n],
            );
            spare.push(buf);
            done += 1;
        }
    }
    // SAFETY: the capacity is `len`, and every piece completed: the pieces tile 0..len and
    // each was copied in above, so all `len` bytes are initialised.
    unsafe { out.set_len(len as usize) };
    Ok(out)
}

/// Parse and check a segment header.
pub fn parse_segment_header(image: &[u8]) -> Option<SegmentHeader> {
    let (h, _) = SegmentHeader::read_from_prefix(image).ok()?;
    h.is_valid().then_some(h)
}

/// Follows a stream, batch by batch.
pub struct StreamReader {
    layout: Layout,
    stream_id: u64,
    kind: u16,
    pub pos: Pos,
    /// No batch older than this open generation can follow: the newest generation of the
    /// batches read so far and of the segment headers passed. A segment opened by generation
    /// g holds only batches of g or later, so a stale batch of a crashed earlier open, left
    /// behind in a segment whose header a later open rewrote, is not taken for a new one.
    last_gen: u32,
    image: Option<(u32, Vec<u8>)>,
    /// Bytes of batches returned so far.
    pub bytes_read: u64,
    /// The newest `durable_through` of the batches returned so far: every batch up to it was
    /// acknowledged.
    pub durable_through: u64,
    /// Segments the stream visited, with the newest batch seen in each.
    pub visited: Vec<(u32, u64)>,
    /// Follow the chain past a segment header that fails its CRC when the batches behind it
    /// prove where the segment stands in the stream ([`Self::rebuilt`]); off: stop there.
    pub rebuild_headers: bool,
    /// Segment headers that failed their CRC and were identified from their batches, in
    /// stream order (only with `rebuild_headers`).
    pub rebuilt: Vec<RebuiltHeader>,
    /// The current segment's header was rebuilt and the segment the stream continues in is
    /// not known yet (`pos.next_seg` is `NO_SEGMENT`): found by a scan at its end.
    pub next_unknown: bool,
    /// The last segment header that stopped the reader by failing its CRC: (segment, stored
    /// crc, computed crc).
    pub rotten_header: Option<(u32, u32, u32)>,
}

/// A segment header that failed its CRC, rebuilt from what the stream proves: the segment's
/// first batch verifies as the batch the chain expects there (or, where replay starts, as the
/// stream's). The open writes it back with the segment it continues in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RebuiltHeader {
    pub seg: u32,
    pub seg_seq: u64,
    pub first_batch_seq: u64,
    /// The first batch's generation (the header's own is no newer).
    pub gen: u32,
    /// Where the stream continues; `NO_SEGMENT` until known (for the head's segment, the
    /// open reserves one).
    pub next_seg: u32,
    /// The CRC the rotten header stores and the one its bytes give.
    pub expected: u32,
    pub found: u32,
}

impl RebuiltHeader {
    /// The header to write back (`created_unix_ns`: when it was rebuilt).
    pub fn header(&self, stream_id: u64, kind: u16, now_ns: u64) -> SegmentHeader {
        let mut h = SegmentHeader::new_zeroed();
        h.magic = SEGMENT_MAGIC.into();
        h.version = (FORMAT_VERSION as u16).into();
        h.kind = kind.into();
        h.stream_id = stream_id.into();
        h.segment = self.seg.into();
        h.next_segment = self.next_seg.into();
        h.segment_seq = self.seg_seq.into();
        h.first_batch_seq = self.first_batch_seq.into();
        h.gen = self.gen.into();
        h.created_unix_ns = now_ns.into();
        h.seal();
        h
    }
}

/// The CRC a 64-byte header stores in its last four bytes, and the one its first 60 give.
fn stored_and_computed_crc(raw: &[u8]) -> (u32, u32) {
    let stored = u32::from_le_bytes(raw[60..64].try_into().unwrap());
    (stored, crc32c::crc32c(&raw[..60]))
}

impl StreamReader {
    /// Accept no batch or segment header older than open generation `gen` (the log's
    /// replay start records the generation that set it: `Superblock::replay_gen`).
    pub fn min_gen(&mut self, gen: u32) {
        self.last_gen = self.last_gen.max(gen);
    }

    pub fn new(layout: Layout, stream_id: u64, kind: u16, start: Pos) -> Self {
        StreamReader {
            layout,
            stream_id,
            kind,
            pos: start,
            last_gen: 0,
            image: None,
            bytes_read: 0,
            durable_through: 0,
            visited: Vec::new(),
            rebuild_headers: false,
            rebuilt: Vec::new(),
            next_unknown: false,
            rotten_header: None,
        }
    }

    fn load<'a, D: BlockDevice>(
        image: &'a mut Option<(u32, Vec<u8>)>,
        layout: &Layout,
        dev: &D,
        q: &mut D::Queue,
        seg: u32,
    ) -> Result<&'a [u8]> {
        if image.as_ref().is_none_or(|(s, _)| *s != seg) {
            let bytes = read_region(dev, q, layout.segment_base(seg), layout.segment_bytes)?;
            *image = Some((seg, bytes));
        }
        Ok(&image.as_ref().unwrap().1)
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn stream_id(&self) -> u64 {
        self.stream_id
    }

    fn header_ok(&self, h: &SegmentHeader, seg: u32, seg_seq: u64, batch_seq: u64) -> bool {
        h.stream_id.get() == self.stream_id
            && h.kind.get() == self.kind
            && h.segment.get() == seg
            && h.segment_seq.get() == seg_seq
            && h.first_batch_seq.get() == batch_seq
            && (h.next_segment.get() as usize) < self.layout.segments as usize
    }
}

/// A data item of a batch whose bytes fail the CRC its owner record lists.
#[derive(Debug, Clone)]
pub struct BadItem {
    pub key: crate::key::ObjectKey,
    pub item: crate::format::ChunkRef,
    pub found: u32,
}

/// What checking a batch at a position found.
enum Checked {
    /// No batch this stream expects here: no valid header, another stream, sequence or older
    /// generation, or it does not fit the segment.
    NoBatch,
    /// The expected batch's header checks but its records do not (or do not decode).
    BadRecords {
        header: BatchHeader,
        bytes: u64,
        found: u32,
    },
    /// Header and records check; `bad` lists the data items that fail their CRC.
    Batch(BatchRead, Vec<BadItem>),
}

/// Parse and verify the batch at `off` of a segment image, expecting `pos.batch_seq` from
/// `stream_id` with a generation of at least `min_gen`.
fn check_batch(
    layout: &Layout,
    stream_id: u64,
    pos: Pos,
    min_gen: u32,
    image: &[u8],
    off: u64,
) -> Checked {
    let seg_bytes = layout.segment_bytes;
    if off + layout.block > seg_bytes {
        return Checked::NoBatch;
    }
    let Ok((h, _)) = BatchHeader::read_from_prefix(&image[off as usize..]) else {
        return Checked::NoBatch;
    };
    if !h.is_valid()
        || h.stream_id.get() != stream_id
        || h.seq.get() != pos.batch_seq
        || h.gen.get() < min_gen
        || !(h.data_bytes.get() as u64).is_multiple_of(layout.block)
    {
        return Checked::NoBatch;
    }
    let total = layout.batch_bytes(h.meta_bytes.get() as u64, h.data_bytes.get() as u64);
    if off + total > seg_bytes {
        return Checked::NoBatch;
    }
    let meta_start = off as usize + 64;
    let meta = &image[meta_start..meta_start + h.meta_bytes.get() as usize];
    let meta_crc = crate::data_crc(meta);
    let bad_records = Checked::BadRecords {
        header: h,
        bytes: total,
        found: meta_crc,
    };
    if meta_crc != h.meta_crc.get() {
        return bad_records;
    }
    let Ok(records) = crate::meta::decode_records(meta, h.record_count.get()) else {
        return bad_records;
    };
    // The data area is verified item by item through the owner records' CRCs.
    let base = layout.segment_base(pos.seg);
    let data_lo = base + off + round_up(64 + h.meta_bytes.get() as u64, layout.block);
    let data_hi = data_lo + h.data_bytes.get() as u64;
    let mut bad = Vec::new();
    for r in &records {
        if let crate::meta::Record::Owner { key, items } = r {
            for it in items {
                let (o, n) = (it.offset.get(), it.len.get() as u64);
                if o < data_lo || o + n > data_hi {
                    // Records that point outside their own batch: not a batch we can trust.
                    return bad_records;
                }
                let found = crate::data_crc(&image[(o - base) as usize..(o - base + n) as usize]);
                if found != it.crc.get() {
                    bad.push(BadItem {
                        key: key.clone(),
                        item: *it,
                        found,
                    });
                }
            }
        }
    }
    Checked::Batch(
        BatchRead {
            header: h,
            records,
            bytes: total,
        },
        bad,
    )
}

/// Parse and fully verify the batch at `off` of a segment image (header, records and every
/// data item).
fn batch_at(
    layout: &Layout,
    stream_id: u64,
    pos: Pos,
    min_gen: u32,
    image: &[u8],
    off: u64,
) -> Option<BatchRead> {
    match check_batch(layout, stream_id, pos, min_gen, image, off) {
        Checked::Batch(b, bad) if bad.is_empty() => Some(b),
        _ => None,
    }
}

impl StreamReader {
    /// The next batch, or `None` at the end of the stream (the position then says where the
    /// stream continues).
    pub fn next<D: BlockDevice>(&mut self, dev: &D, q: &mut D::Queue) -> Result<Option<BatchRead>> {
        let layout = self.layout;
        if self.pos.off > 0 && self.pos.next_seg == crate::format::NO_SEGMENT && !self.next_unknown
        {
            // Starting mid-segment: learn where the stream continues from the segment header.
            let image = Self::load(&mut self.image, &layout, dev, q, self.pos.seg)?;
            match parse_segment_header(image) {
                Some(h)
                    if h.stream_id.get() == self.stream_id && h.segment.get() == self.pos.seg =>
                {
                    self.pos.next_seg = h.next_segment.get();
                    self.last_gen = self.last_gen.max(h.gen.get());
                }
                Some(_) => return Ok(None),
                None => {
                    if !self.rebuild_start(dev, q)? {
                        return Ok(None);
                    }
                }
            }
        }
        loop {
            if self.pos.off == 0 {
                let image = Self::load(&mut self.image, &layout, dev, q, self.pos.seg)?;
                match parse_segment_header(image) {
                    Some(h) => {
                        if !self.header_ok(&h, self.pos.seg, self.pos.seg_seq, self.pos.batch_seq) {
                            return Ok(None);
                        }
                        self.pos.off = layout.block;
                        self.pos.next_seg = h.next_segment.get();
                        self.last_gen = self.last_gen.max(h.gen.get());
                    }
                    None => {
                        let (seg, seg_seq) = (self.pos.seg, self.pos.seg_seq);
                        if !self.rebuild_entered(dev, q, seg, seg_seq)? {
                            return Ok(None);
                        }
                        self.pos.off = layout.block;
                    }
                }
            }
            let (stream_id, pos, last_gen) = (self.stream_id, self.pos, self.last_gen);
            let image = Self::load(&mut self.image, &layout, dev, q, self.pos.seg)?;
            if let Some(b) = batch_at(&layout, stream_id, pos, last_gen, image, pos.off) {
                self.advance(&b);
                return Ok(Some(b));
            }
            if self.pos.off == layout.block {
                // A segment's first batch always starts at block 1 (a batch fits any empty
                // segment): nothing valid there, so the stream ends here. Going on to this
                // segment's successor would leave it unread, so unaccounted and free to be
                // reused while the chain still runs through it.
                return Ok(None);
            }
            // The stream may continue in the next segment if the batch did not fit here.
            if self.next_unknown {
                let Some(next) = self.find_successor(dev, q)? else {
                    return Ok(None);
                };
                self.pos.next_seg = next;
                self.next_unknown = false;
                if let Some(rb) = self.rebuilt.last_mut() {
                    rb.next_seg = next;
                }
            }
            let next = self.pos.next_seg;
            let image = Self::load(&mut self.image, &layout, dev, q, next)?;
            let (seg_seq, batch_seq) = (self.pos.seg_seq + 1, self.pos.batch_seq);
            let next_seg = match parse_segment_header(image) {
                Some(h) if self.header_ok(&h, next, seg_seq, batch_seq) => {
                    self.last_gen = self.last_gen.max(h.gen.get());
                    h.next_segment.get()
                }
                None if self.rebuild_entered(dev, q, next, seg_seq)? => crate::format::NO_SEGMENT,
                _ => {
                    // Keep the current segment image for the caller's position.
                    self.image = None;
                    return Ok(None);
                }
            };
            self.pos = Pos {
                seg: next,
                off: layout.block,
                seg_seq,
                batch_seq,
                next_seg,
            };
        }
    }

    /// The header of `seg`, which the chain enters as its `seg_seq`-th segment expecting batch
    /// `pos.batch_seq` first, fails its CRC. Note it in `rotten_header`; with
    /// `rebuild_headers`, rebuild it if the segment's first batch verifies as exactly that
    /// batch (header, records and data, no older generation than the stream's), and go on with
    /// the successor unknown. Returns whether it did.
    fn rebuild_entered<D: BlockDevice>(
        &mut self,
        dev: &D,
        q: &mut D::Queue,
        seg: u32,
        seg_seq: u64,
    ) -> Result<bool> {
        let layout = self.layout;
        let (sid, batch_seq, last_gen) = (self.stream_id, self.pos.batch_seq, self.last_gen);
        let image = Self::load(&mut self.image, &layout, dev, q, seg)?;
        let (expected, found) = stored_and_computed_crc(image);
        let at = Pos {
            seg,
            off: layout.block,
            seg_seq,
            batch_seq,
            next_seg: crate::format::NO_SEGMENT,
        };
        let Some(first) = batch_at(&layout, sid, at, last_gen, image, layout.block) else {
            // No batch the chain expects: a segment reserved and never opened, or one whose
            // opening was torn by a crash — unless a later batch of this stream in it was
            // written after that first batch had been acknowledged. Then the first batch is
            // rot too, and the segment is ours: with `rebuild_headers`, rebuild the header
            // (the stream's generation so far: no batch behind it is older) and go on; replay
            // then stops at the rotten first batch, which salvage skips and reports.
            if !acked_later_batch(&layout, sid, last_gen, image, batch_seq) {
                return Ok(false);
            }
            self.rotten_header = Some((seg, expected, found));
            if !self.rebuild_headers {
                return Ok(false);
            }
            self.note_rebuilt(seg, seg_seq, batch_seq, last_gen, (expected, found));
            return Ok(true);
        };
        self.rotten_header = Some((seg, expected, found));
        if !self.rebuild_headers {
            return Ok(false);
        }
        self.note_rebuilt(
            seg,
            seg_seq,
            batch_seq,
            first.header.gen.get(),
            (expected, found),
        );
        Ok(true)
    }

    /// Go on in `seg` behind its rebuilt header; the segment it continues in is found at its
    /// end ([`Self::find_successor`]).
    fn note_rebuilt(&mut self, seg: u32, seg_seq: u64, first: u64, gen: u32, crcs: (u32, u32)) {
        self.rebuilt.push(RebuiltHeader {
            seg,
            seg_seq,
            first_batch_seq: first,
            gen,
            next_seg: crate::format::NO_SEGMENT,
            expected: crcs.0,
            found: crcs.1,
        });
        self.last_gen = self.last_gen.max(gen);
        self.next_unknown = true;
    }

    /// Replay starts inside `pos.seg` and its header fails its CRC. The superblock vouches for
    /// the segment's place in the stream; its first batch header (which must check and be this
    /// stream's, no later than where replay starts) gives the rest. When that batch header
    /// fails too, [`rotten_first_batch`] looks behind it. Returns whether it rebuilt the
    /// header (only with `rebuild_headers`).
    fn rebuild_start<D: BlockDevice>(&mut self, dev: &D, q: &mut D::Queue) -> Result<bool> {
        let layout = self.layout;
        let pos = self.pos;
        let sid = self.stream_id;
        let image = Self::load(&mut self.image, &layout, dev, q, pos.seg)?;
        let (expected, found) = stored_and_computed_crc(image);
        let first = valid_header_at(image, layout.block, sid)
            .filter(|h| h.seq.get() <= pos.batch_seq)
            .map(|h| (h.seq.get(), h.gen.get()))
            .or_else(|| rotten_first_batch(&layout, sid, image, pos));
        self.rotten_header = Some((pos.seg, expected, found));
        let Some((seq, gen)) = first else {
            return Ok(false);
        };
        if !self.rebuild_headers {
            return Ok(false);
        }
        self.note_rebuilt(pos.seg, pos.seg_seq, seq, gen, (expected, found));
        Ok(true)
    }

    /// The segment the stream continues in after the current one, whose rebuilt header no
    /// longer says: the one whose header checks as this stream's next (`seg_seq + 1`, first
    /// batch the one expected next), or whose header fails its CRC but whose first batch
    /// verifies as that batch. Among several (a crashed open may have left a stale one), the
    /// one whose first batch verifies, then the newest generation. Reads two blocks of every
    /// segment (and the whole of each candidate): a salvage open pays it once per rebuilt
    /// header. `None`: the stream ends in the current segment.
    fn find_successor<D: BlockDevice>(&mut self, dev: &D, q: &mut D::Queue) -> Result<Option<u32>> {
        let layout = self.layout;
        let pos = self.pos;
        let (sid, kind, last_gen) = (self.stream_id, self.kind, self.last_gen);
        let want = Pos {
            seg: 0,
            off: layout.block,
            seg_seq: pos.seg_seq + 1,
            batch_seq: pos.batch_seq,
            next_seg: crate::format::NO_SEGMENT,
        };
        let mut best: Option<((bool, u32), u32)> = None;
        for seg in (0..layout.segments).filter(|&s| s != pos.seg) {
            let head = read_region(dev, q, layout.segment_base(seg), 2 * layout.block)?;
            let gen = match parse_segment_header(&head) {
                Some(h) => {
                    if h.stream_id.get() != sid
                        || h.kind.get() != kind
                        || h.segment.get() != seg
                        || h.segment_seq.get() != want.seg_seq
                        || h.first_batch_seq.get() != want.batch_seq
                        || h.gen.get() < last_gen
                        || h.next_segment.get() >= layout.segments
                    {
                        continue;
                    }
                    Some(h.gen.get())
                }
                None => None,
            };
            let first = BatchHeader::read_from_prefix(&head[layout.block as usize..])
                .ok()
                .map(|(h, _)| h)
                .filter(|h| {
                    h.is_valid()
                        && h.stream_id.get() == sid
                        && h.seq.get() == want.batch_seq
                        && h.gen.get() >= last_gen
                });
            if gen.is_none() && first.is_none() {
                continue;
            }
            let image = Self::load(&mut self.image, &layout, dev, q, seg)?;
            let at = Pos { seg, ..want };
            let verifies = batch_at(&layout, sid, at, last_gen, image, layout.block).is_some();
            let Some(gen) = gen.or(verifies.then(|| first.unwrap().gen.get())) else {
                // A rotten header and a first batch that does not verify: not provably ours.
                continue;
            };
            let rank = (verifies, gen);
            if best.is_none_or(|(r, _)| rank > r) {
                best = Some((rank, seg));
            }
        }
        self.image = None;
        Ok(best.map(|(_, seg)| seg))
    }
}

/// Whether a segment image holds, after its first batch's block, a valid batch header of
/// stream `sid` with a sequence above `missing`, no generation older than `gen`, written after
/// batch `missing` had been acknowledged (its `durable_through` covers it).
fn acked_later_batch(layout: &Layout, sid: u64, gen: u32, image: &[u8], missing: u64) -> bool {
    acked_later_batch_gen(layout, sid, gen, image, missing).is_some()
}

/// [`acked_later_batch`], giving the generation of the first such batch.
fn acked_later_batch_gen(
    layout: &Layout,
    sid: u64,
    gen: u32,
    image: &[u8],
    missing: u64,
) -> Option<u32> {
    let mut off = 2 * layout.block;
    while off + 64 <= layout.segment_bytes {
        if let Some(h) = valid_header_at(image, off, sid) {
            if h.seq.get() > missing && h.gen.get() >= gen && h.durable_through.get() >= missing {
                return Some(h.gen.get());
            }
        }
        off += layout.block;
    }
    None
}

/// The batch header at `off` of a segment image, if it checks and is stream `sid`'s.
fn valid_header_at(image: &[u8], off: u64, sid: u64) -> Option<BatchHeader> {
    let (h, _) = BatchHeader::read_from_prefix(image.get(off as usize..)?).ok()?;
    (h.is_valid() && h.stream_id.get() == sid).then_some(h)
}

/// Replay starts at `pos` in a segment whose header and first batch header (block 1) both
/// fail their CRCs: (first batch seq, generation) for the rebuilt header, when the segment's
/// other batches vouch for them.
///
/// * Replay starts behind the first batch (`pos.off` > 1 block): the first valid header of
///   the stream after block 1 from which the batches chain to the replay start (each the
///   one before's length further on, `seq` + 1, `gen` no older) is the second batch: the
///   rotten one is the one before it. Its records are covered by the checkpoint (replay
///   starts after it), so nothing is lost.
/// * Replay starts at the rotten batch itself: as when the chain enters such a segment
///   ([`StreamReader::rebuild_entered`]), a later batch written after it had been
///   acknowledged proves the rot; the first batch is the replay start's, and replay stops
///   there for the salvage to skip it and report it.
fn rotten_first_batch(layout: &Layout, sid: u64, image: &[u8], pos: Pos) -> Option<(u64, u32)> {
    if pos.off <= layout.block {
        let gen = acked_later_batch_gen(layout, sid, 0, image, pos.batch_seq)?;
        return Some((pos.batch_seq, gen));
    }
    let mut off = 2 * layout.block;
    while off <= pos.off {
        if let Some(second) = valid_header_at(image, off, sid).filter(|h| {
            (1..=pos.batch_seq).contains(&h.seq.get())
                && (h.data_bytes.get() as u64).is_multiple_of(layout.block)
        }) {
            let (mut at, mut seq, mut cur) = (off, second.seq.get(), second);
            while at < pos.off {
                at += layout.batch_bytes(cur.meta_bytes.get() as u64, cur.data_bytes.get() as u64);
                seq += 1;
                if at >= pos.off {
                    break;
                }
                match valid_header_at(image, at, sid) {
                    Some(n) if n.seq.get() == seq && n.gen.get() >= cur.gen.get() => cur = n,
                    _ => break,
                }
            }
            if at == pos.off && seq == pos.batch_seq {
                return Some((second.seq.get() - 1, second.gen.get()));
            }
        }
        off += layout.block;
    }
    None
}

impl StreamReader {
    /// After the stream ended at `pos`: look through the rest of this segment and the next
    /// one for a batch of this stream written after the missing one *and* after it had been
    /// acknowledged (`durable_through` covers it). Finding one means the missing batch is not
    /// a torn tail but rotten acknowledged data. Returns its byte offset and sequence.
    pub fn acked_batch_after_end<D: BlockDevice>(
        &mut self,
        dev: &D,
        q: &mut D::Queue,
    ) -> Result<Option<(u64, u64)>> {
        let layout = self.layout;
        let missing = self.pos.batch_seq;
        let mut places = vec![(self.pos.seg, self.pos.off.max(layout.block))];
        if self.pos.off > 0 && (self.pos.next_seg as u64) < layout.segments as u64 {
            places.push((self.pos.next_seg, layout.block));
        }
        for (seg, from) in places {
            let image = Self::load(&mut self.image, &layout, dev, q, seg)?;
            let mut off = from;
            while off + 64 <= layout.segment_bytes {
                if let Ok((h, _)) = BatchHeader::read_from_prefix(&image[off as usize..]) {
                    if h.is_valid()
                        && h.stream_id.get() == self.stream_id
                        && h.seq.get() > missing
                        && h.durable_through.get() >= missing
                    {
                        return Ok(Some((layout.segment_base(seg) + off, h.seq.get())));
                    }
                }
                off += layout.block;
            }
        }
        Ok(None)
    }
}

/// Why replay could not read an acknowledged batch (see [`StreamReader::salvage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipKind {
    /// The batch header fails its CRC (or is not this stream's expected batch).
    Header,
    /// The header checks; the records fail the meta CRC or do not decode.
    Records,
}

/// Batches replay skipped: `[offset, offset + len)` held batches `first_seq..resume_seq`.
#[derive(Debug, Clone)]
pub struct Skip {
    pub kind: SkipKind,
    /// Absolute byte offset of the first skipped batch.
    pub offset: u64,
    pub len: u64,
    pub first_seq: u64,
    pub resume_seq: u64,
    /// The CRC the header (or records) say, and what the bytes give.
    pub expected: u32,
    pub found: u32,
    /// Keys named by the records that still pass their own record CRC (best effort).
    pub keys: Vec<crate::key::ObjectKey>,
    /// Whether `keys` is every key the skipped batches named (false when a record or the
    /// header did not read, or when more than one batch was skipped).
    pub keys_complete: bool,
}

/// What [`StreamReader::salvage`] did about an acknowledged batch replay could not read.
pub enum Salvage {
    /// Header and records check, these data items do not: the batch is returned for the
    /// caller to apply (reads of those items will report `Corrupted`).
    Data(BatchRead, Vec<BadItem>),
    /// The batch could not be parsed and was skipped; the reader continues after it.
    Skipped(Skip),
    /// The batch could not be parsed and no valid batch of the stream follows it (or the
    /// proof is from an older generation, or the chain's next segment does not continue this
    /// stream): the reader stays where it was. For the log that is a chain it cannot follow
    /// ([`StreamReader::chain_broken`]); for a checkpoint, whose batch count is known, it may
    /// just be its last batch.
    Unresumable(Skip),
}

impl StreamReader {
    fn advance(&mut self, b: &BatchRead) {
        self.pos.off += b.bytes;
        self.pos.batch_seq += 1;
        self.last_gen = b.header.gen.get();
        self.bytes_read += b.bytes;
        self.durable_through = self.durable_through.max(b.header.durable_through.get());
        self.note_visit(self.pos.seg, b.header.seq.get());
    }

    fn note_visit(&mut self, seg: u32, seq: u64) {
        match self.visited.iter_mut().find(|(s, _)| *s == seg) {
            Some((_, max)) => *max = (*max).max(seq),
            None => self.visited.push((seg, seq)),
        }
    }

    /// After the stream ended at an acknowledged batch (see [`Self::acked_batch_after_end`]):
    /// get past it. If its header and records check and only data items fail, return it to be
    /// applied. Otherwise skip it: resume at the first block-aligned position after it (in
    /// this segment, then the next one of the chain) holding a valid header of this stream
    /// with a higher sequence and no older generation; [`Salvage::Unresumable`] when there is
    /// none (the next segment's header does not read or does not continue the stream). `Err`
    /// when the reader is not inside a segment whose header it read.
    pub fn salvage<D: BlockDevice>(&mut self, dev: &D, q: &mut D::Queue) -> Result<Salvage> {
        let layout = self.layout;
        let (pos, last_gen, stream_id) = (self.pos, self.last_gen, self.stream_id);
        if pos.off == 0 || (pos.next_seg as u64 >= layout.segments as u64 && !self.next_unknown) {
            return Err(self.chain_broken(dev, pos.seg));
        }
        let image = Self::load(&mut self.image, &layout, dev, q, pos.seg)?;
        let at = layout.segment_base(pos.seg) + pos.off;
        let (kind, expected, found, from, meta_len) =
            match check_batch(&layout, stream_id, pos, last_gen, image, pos.off) {
                Checked::Batch(b, bad) => {
                    self.advance(&b);
                    return Ok(Salvage::Data(b, bad));
                }
                Checked::BadRecords {
                    header,
                    bytes,
                    found,
                } => (
                    SkipKind::Records,
                    header.meta_crc.get(),
                    found,
                    pos.off + bytes,
                    Some((header.meta_bytes.get() as usize, header.record_count.get())),
                ),
                Checked::NoBatch => {
                    // (No room for a header at all when the segment is full up to `pos.off`.)
                    let raw = image.get(pos.off as usize..pos.off as usize + 64);
                    let (stored, computed) = raw.map_or((0, 0), stored_and_computed_crc);
                    (
                        SkipKind::Header,
                        stored,
                        computed,
                        pos.off + layout.block,
                        None,
                    )
                }
            };
        let resume = self.find_resume(dev, q, from)?;
        let image = Self::load(&mut self.image, &layout, dev, q, pos.seg)?;
        let end = match resume {
            Some((p, _)) if p.seg == pos.seg => p.off,
            _ => layout.segment_bytes,
        };
        let records = image
            .get(pos.off as usize + 64..end as usize)
            .unwrap_or_default();
        let (keys, complete) = crate::meta::salvage_keys(records, meta_len);
        let Some((next, len)) = resume else {
            return Ok(Salvage::Unresumable(Skip {
                kind,
                offset: at,
                len: end - pos.off,
                first_seq: pos.batch_seq,
                resume_seq: pos.batch_seq + 1,
                expected,
                found,
                keys,
                keys_complete: false,
            }));
        };
        let len = len - pos.off;
        // The segment holds the skipped batches: it stays the log's until a checkpoint passes.
        self.note_visit(pos.seg, next.batch_seq - 1);
        self.pos = next;
        Ok(Salvage::Skipped(Skip {
            kind,
            offset: at,
            len,
            first_seq: pos.batch_seq,
            resume_seq: next.batch_seq,
            expected,
            found,
            keys,
            // Batches after the first one of a skipped run were not parsed at all.
            keys_complete: complete && next.batch_seq == pos.batch_seq + 1,
        }))
    }

    /// Where replay resumes after a skipped batch, and the skipped length counted from the
    /// start of the current segment (so `len - pos.off` is what was skipped).
    fn find_resume<D: BlockDevice>(
        &mut self,
        dev: &D,
        q: &mut D::Queue,
        from: u64,
    ) -> Result<Option<(Pos, u64)>> {
        let layout = self.layout;
        let pos = self.pos;
        let image = Self::load(&mut self.image, &layout, dev, q, pos.seg)?;
        let (sid, gen) = (self.stream_id, self.last_gen);
        if let Some((off, seq)) = first_header_after(&layout, sid, gen, image, from, pos.batch_seq)
        {
            let next = Pos {
                off,
                batch_seq: seq,
                ..pos
            };
            return Ok(Some((next, off)));
        }
        let seg = pos.next_seg;
        if self.next_unknown {
            // After a rebuilt header: the skipped run would have to end in a segment nothing
            // names. Not followed.
            return Ok(None);
        }
        let image = Self::load(&mut self.image, &layout, dev, q, seg)?;
        let Some(h) = parse_segment_header(image) else {
            // A rotten header, or a segment the stream reserved and never opened.
            return Ok(None);
        };
        if h.stream_id.get() != self.stream_id
            || h.kind.get() != self.kind
            || h.segment.get() != seg
            || h.segment_seq.get() != pos.seg_seq + 1
            || h.first_batch_seq.get() < pos.batch_seq
        {
            // The next segment was never opened by this stream: nothing to resume at.
            return Ok(None);
        }
        let found = first_header_after(&layout, sid, gen, image, layout.block, pos.batch_seq);
        let Some((off, seq)) = found else {
            return Ok(None);
        };
        let next = Pos {
            seg,
            off,
            seg_seq: pos.seg_seq + 1,
            batch_seq: seq,
            next_seg: h.next_segment.get(),
        };
        Ok(Some((next, layout.segment_bytes + off - layout.block)))
    }

    pub fn chain_broken<D: BlockDevice>(&self, dev: &D, seg: u32) -> StoreError {
        StoreError::Format {
            device: dev.name().clone(),
            detail: format!(
                "log batch {} (at or after byte {} of segment {}) is unreadable and was \
                 acknowledged, and salvage cannot follow the log past it (the header of \
                 segment {seg} is unreadable or no valid batch follows); rebuild this device \
                 from its peers",
                self.pos.batch_seq, self.pos.off, self.pos.seg
            ),
        }
    }
}

/// The first block-aligned offset from `from` holding a valid batch header of `stream_id` with
/// a sequence above `missing` and a generation of at least `min_gen`.
fn first_header_after(
    layout: &Layout,
    stream_id: u64,
    min_gen: u32,
    image: &[u8],
    from: u64,
    missing: u64,
) -> Option<(u64, u64)> {
    let mut off = round_up(from, layout.block);
    while off + 64 <= layout.segment_bytes {
        if let Ok((h, _)) = BatchHeader::read_from_prefix(&image[off as usize..]) {
            if h.is_valid()
                && h.stream_id.get() == stream_id
                && h.seq.get() > missing
                && h.gen.get() >= min_gen
            {
                return Some((off, h.seq.get()));
            }
        }
        off += layout.block;
    }
    None
}

/// Where the next batch of a stream goes, and the segment header to write first if the batch
/// opens a segment.
pub struct Placement {
    pub offset: u64,
    pub segment_header: Option<(u64, SegmentHeader)>,
}

/// The writing end of a stream.
pub struct StreamHead {
    pub layout: Layout,
    pub stream_id: u64,
    pub kind: u16,
    pub gen: u32,
    pub pos: Pos,
    pub use_reserve: bool,
    /// The next batch opens the next segment, however much room is left in this one (the
    /// cleaner relocates this segment's live data: it must land elsewhere).
    pub move_on: bool,
}

impl StreamHead {
    fn open_segment(&mut self, segs: &mut Segments, now_ns: u64) -> Result<(u64, SegmentHeader)> {
        let next = segs
            .alloc(self.use_reserve)
            .ok_or_else(|| out_of_space(segs))?;
        let mut h = SegmentHeader::new_zeroed();
        h.magic = SEGMENT_MAGIC.into();
        h.version = (FORMAT_VERSION as u16).into();
        h.kind = self.kind.into();
        h.stream_id = self.stream_id.into();
        h.segment = self.pos.seg.into();
        h.next_segment = next.into();
        h.segment_seq = self.pos.seg_seq.into();
        h.first_batch_seq = self.pos.batch_seq.into();
        h.gen = self.gen.into();
        h.created_unix_ns = now_ns.into();
        h.seal();
        self.pos.off = self.layout.block;
        self.pos.next_seg = next;
        Ok((self.layout.segment_base(self.pos.seg), h))
    }

    /// Reserve room for a batch of `bytes`, opening segments as needed.
    pub fn place(&mut self, bytes: u64, segs: &mut Segments, now_ns: u64) -> Result<Placement> {
        assert!(
            bytes + self.layout.block <= self.layout.segment_bytes,
            "batch of {bytes} bytes cannot fit a segment"
        );
        let mut header = None;
        if self.pos.off != 0 && (self.move_on || self.pos.off + bytes > self.layout.segment_bytes) {
            self.pos = Pos {
                seg: self.pos.next_seg,
                off: 0,
                seg_seq: self.pos.seg_seq + 1,
                batch_seq: self.pos.batch_seq,
                next_seg: 0,
            };
        }
        if self.pos.off == 0 {
            let kind_state = if self.kind == crate::format::SEGMENT_LOG {
                SegState::Log {
                    max_batch_seq: self.pos.batch_seq,
                }
            } else {
                SegState::Checkpoint { id: self.stream_id }
            };
            segs.set_state(self.pos.seg, kind_state);
            header = Some(self.open_segment(segs, now_ns)?);
        }
        let offset = self.layout.segment_base(self.pos.seg) + self.pos.off;
        tracing::debug!(
            stream = self.stream_id,
            seg = self.pos.seg,
            off = self.pos.off,
            bytes,
            batch = self.pos.batch_seq,
            opened = header.is_some(),
            "place batch"
        );
        self.pos.off += bytes;
        self.pos.batch_seq += 1;
        self.move_on = false;
        if self.kind == crate::format::SEGMENT_LOG {
            segs.note_batch(self.pos.seg, self.pos.batch_seq - 1);
            segs.head = self.pos.seg;
            // A new head starts with room; one a writer found too full for it stays so until
            // the log moves on.
            segs.head_full = (segs.head_full && header.is_none())
                || crate::space::head_is_full(
                    self.layout.segment_bytes,
                    self.layout.block,
                    self.pos.off,
                );
        }
        Ok(Placement {
            offset,
            segment_header: header,
        })
    }
}

pub fn out_of_space(segs: &Segments) -> StoreError {
    StoreError::OutOfSpace {
        device: "store".into(),
        used: segs.count() - segs.free_count(),
        total: segs.count(),
        reclaimable: 0,
        reserve: segs.reserve,
    }
}

/// Build a sealed batch header.
#[allow(clippy::too_many_arguments)]
pub fn batch_header(
    stream_id: u64,
    seq: u64,
    gen: u32,
    records: u32,
    meta: &[u8],
    data_bytes: u64,
    data_crc: u32,
    durable_through: u64,
) -> BatchHeader {
    let mut h = BatchHeader::new_zeroed();
    h.magic = BATCH_MAGIC.into();
    h.version = (FORMAT_VERSION as u16).into();
    h.stream_id = stream_id.into();
    h.seq = seq.into();
    h.gen = gen.into();
    h.record_count = records.into();
    h.meta_bytes = (meta.len() as u32).into();
    h.data_bytes = (data_bytes as u32).into();
    h.meta_crc = crc32c::crc32c(meta).into();
    h.data_crc = data_crc.into();
    h.durable_through = durable_through.into();
    h.seal();
    let _ = h.as_bytes();
    h
}
