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
    let mut out = vec![0u8; len as usize];
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
                None => dev.alloc_buf(piece as usize)?,
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
            buf.read_at(0, &mut out[at as usize..at as usize + n]);
            spare.push(buf);
            done += 1;
        }
    }
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
    last_gen: u32,
    image: Option<(u32, Vec<u8>)>,
    /// Bytes of batches returned so far.
    pub bytes_read: u64,
    /// Segments the stream visited, with the newest batch seen in each.
    pub visited: Vec<(u32, u64)>,
}

impl StreamReader {
    pub fn new(layout: Layout, stream_id: u64, kind: u16, start: Pos) -> Self {
        StreamReader {
            layout,
            stream_id,
            kind,
            pos: start,
            last_gen: 0,
            image: None,
            bytes_read: 0,
            visited: Vec::new(),
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

    fn header_ok(&self, h: &SegmentHeader, seg: u32, seg_seq: u64, batch_seq: u64) -> bool {
        h.stream_id.get() == self.stream_id
            && h.kind.get() == self.kind
            && h.segment.get() == seg
            && h.segment_seq.get() == seg_seq
            && h.first_batch_seq.get() == batch_seq
            && (h.next_segment.get() as usize) < self.layout.segments as usize
    }
}

/// Parse and fully verify the batch at `off` of a segment image, expecting `pos.batch_seq`
/// from `stream_id` with a generation of at least `min_gen`.
fn batch_at(
    layout: &Layout,
    stream_id: u64,
    pos: Pos,
    min_gen: u32,
    image: &[u8],
    off: u64,
) -> Option<BatchRead> {
    {
        let seg_bytes = layout.segment_bytes;
        if off + layout.block > seg_bytes {
            return None;
        }
        let (h, _) = BatchHeader::read_from_prefix(&image[off as usize..]).ok()?;
        let fits = |h: &BatchHeader| {
            let total = layout.batch_bytes(h.meta_bytes.get() as u64, h.data_bytes.get() as u64);
            (off + total <= seg_bytes).then_some(total)
        };
        if !h.is_valid()
            || h.stream_id.get() != stream_id
            || h.seq.get() != pos.batch_seq
            || h.gen.get() < min_gen
            || !(h.data_bytes.get() as u64).is_multiple_of(layout.block)
        {
            return None;
        }
        let total = fits(&h)?;
        let meta_start = off as usize + 64;
        let meta = &image[meta_start..meta_start + h.meta_bytes.get() as usize];
        if crc32c::crc32c(meta) != h.meta_crc.get() {
            return None;
        }
        let records = crate::meta::decode_records(meta, h.record_count.get()).ok()?;
        // The data area is verified item by item through the owner records' CRCs.
        let data_lo = layout.segment_base(pos.seg)
            + off
            + round_up(64 + h.meta_bytes.get() as u64, layout.block);
        let data_hi = data_lo + h.data_bytes.get() as u64;
        let base = layout.segment_base(pos.seg);
        for r in &records {
            if let crate::meta::Record::Owner { items, .. } = r {
                for it in items {
                    let (o, n) = (it.offset.get(), it.len.get() as u64);
                    if o < data_lo || o + n > data_hi {
                        return None;
                    }
                    let bytes = &image[(o - base) as usize..(o - base + n) as usize];
                    if crc32c::crc32c(bytes) != it.crc.get() {
                        return None;
                    }
                }
            }
        }
        Some(BatchRead {
            header: h,
            records,
            bytes: total,
        })
    }
}

impl StreamReader {
    /// The next batch, or `None` at the end of the stream (the position then says where the
    /// stream continues).
    pub fn next<D: BlockDevice>(&mut self, dev: &D, q: &mut D::Queue) -> Result<Option<BatchRead>> {
        let layout = self.layout;
        if self.pos.off > 0 && self.pos.next_seg == crate::format::NO_SEGMENT {
            // Starting mid-segment: learn where the stream continues from the segment header.
            let image = Self::load(&mut self.image, &layout, dev, q, self.pos.seg)?;
            match parse_segment_header(image) {
                Some(h)
                    if h.stream_id.get() == self.stream_id && h.segment.get() == self.pos.seg =>
                {
                    self.pos.next_seg = h.next_segment.get();
                }
                _ => return Ok(None),
            }
        }
        loop {
            if self.pos.off == 0 {
                let image = Self::load(&mut self.image, &layout, dev, q, self.pos.seg)?;
                let Some(h) = parse_segment_header(image) else {
                    return Ok(None);
                };
                if !self.header_ok(&h, self.pos.seg, self.pos.seg_seq, self.pos.batch_seq) {
                    return Ok(None);
                }
                self.pos.off = layout.block;
                self.pos.next_seg = h.next_segment.get();
            }
            let (stream_id, pos, last_gen) = (self.stream_id, self.pos, self.last_gen);
            let image = Self::load(&mut self.image, &layout, dev, q, self.pos.seg)?;
            if let Some(b) = batch_at(&layout, stream_id, pos, last_gen, image, pos.off) {
                self.pos.off += b.bytes;
                self.pos.batch_seq += 1;
                self.last_gen = b.header.gen.get();
                self.bytes_read += b.bytes;
                match self.visited.last_mut() {
                    Some((s, max)) if *s == self.pos.seg => *max = b.header.seq.get(),
                    _ => self.visited.push((self.pos.seg, b.header.seq.get())),
                }
                return Ok(Some(b));
            }
            // The stream may continue in the next segment if the batch did not fit here.
            let next = self.pos.next_seg;
            let image = Self::load(&mut self.image, &layout, dev, q, next)?;
            let Some(h) = parse_segment_header(image) else {
                return Ok(None);
            };
            if !self.header_ok(&h, next, self.pos.seg_seq + 1, self.pos.batch_seq) {
                // Keep the current segment image for the caller's position.
                self.image = None;
                return Ok(None);
            }
            self.pos = Pos {
                seg: next,
                off: layout.block,
                seg_seq: self.pos.seg_seq + 1,
                batch_seq: self.pos.batch_seq,
                next_seg: h.next_segment.get(),
            };
        }
    }
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
        if self.pos.off != 0 && self.pos.off + bytes > self.layout.segment_bytes {
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
        if self.kind == crate::format::SEGMENT_LOG {
            segs.note_batch(self.pos.seg, self.pos.batch_seq - 1);
            segs.head = self.pos.seg;
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
