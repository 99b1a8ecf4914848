//! The commit thread's write path: streams byte runs into preallocated DMA staging buffers and
//! submits them as writes, then makes a round durable with one flush, or with FUA when the
//! whole round was a single write.

use std::time::Duration;

use driver::{BlockDevice, Completion, DmaBuf, QueueHandle, Request};

use crate::error::Result;

/// Tag of the pipeline's flushes.
const FLUSH_TAG: u64 = u64::MAX;

/// How long a device write or flush may take before the store gives up on it.
pub const DEVICE_TIMEOUT: Duration = Duration::from_secs(30);

struct Piece {
    buf: DmaBuf,
    offset: u64,
    len: usize,
}

pub struct Emitter<D: BlockDevice> {
    pub q: D::Queue,
    free: Vec<DmaBuf>,
    /// Staging buffers the emitter owns (`free` plus those in flight).
    staging: usize,
    piece_bytes: usize,
    block: usize,
    volatile: bool,
    comps: Vec<Completion>,
    /// The piece being filled.
    cur: Option<Piece>,
    /// The last full piece, not yet submitted: a round of one write goes out with FUA.
    held: Option<Piece>,
    submitted_in_round: u64,
    error: Option<driver::Error>,
    /// Pipelined rounds: (round id, writes still in flight), oldest first.
    rounds: std::collections::VecDeque<(u64, usize)>,
    /// The round whose writes are being submitted now (tag of its writes).
    cur_round: u64,
    /// Newest round whose writes have all completed (contiguously from the oldest).
    written: u64,
    /// Newest round known durable.
    durable: u64,
    /// A flush in flight covers rounds up to this one.
    flush_covers: Option<u64>,
    /// A round that went out as one FUA write: durable when that write completes.
    fua_round: Option<u64>,
    /// Totals for write-amplification reports.
    pub bytes_written: u64,
    pub writes: u64,
    pub flushes: u64,
    pub fua_rounds: u64,
}

impl<D: BlockDevice> Emitter<D> {
    pub fn new(dev: &D, staging_bytes: usize) -> Result<Self> {
        let geo = dev.geometry();
        let piece_bytes = (geo.max_transfer_bytes as usize).min(1 << 20);
        let count = (staging_bytes / piece_bytes).max(4);
        let free = (0..count)
            .map(|_| dev.alloc_buf(piece_bytes))
            .collect::<driver::Result<Vec<_>>>()?;
        Ok(Emitter {
            q: dev.open_queue()?,
            free,
            staging: count,
            piece_bytes,
            block: geo.block_size as usize,
            volatile: geo.volatile_write_cache,
            comps: (0..16).map(|_| Completion::default()).collect(),
            cur: None,
            held: None,
            submitted_in_round: 0,
            error: None,
            rounds: std::collections::VecDeque::new(),
            cur_round: 0,
            written: 0,
            durable: 0,
            flush_covers: None,
            fua_round: None,
            bytes_written: 0,
            writes: 0,
            flushes: 0,
            fua_rounds: 0,
        })
    }

    fn reap(&mut self, min: usize) -> Result<()> {
        let n = self.q.wait(&mut self.comps, min, DEVICE_TIMEOUT)?;
        for k in 0..n {
            let c = std::mem::take(&mut self.comps[k]);
            if let Err(e) = c.result {
                self.error.get_or_insert(e);
            }
            if c.op == driver::Op::Flush && c.tag == FLUSH_TAG {
                if let Some(upto) = self.flush_covers.take() {
                    self.durable = self.durable.max(upto);
                }
                self.flushes += 1;
            } else if let Some(r) = self.rounds.iter_mut().find(|r| r.0 == c.tag) {
                r.1 -= 1;
            }
            // Staging buffers go back to the pool; callers' DMA buffers are freed. (A caller's
            // buffer can be as big as a piece: the pool keeps at most its own count, so such a
            // buffer may stand in for a staging one but the pool never grows. Not a part of a
            // split buffer, though: keeping that would keep its whole region.)
            if let Some(b) = c.buf.filter(|b| {
                b.len() == self.piece_bytes && !b.is_part() && self.free.len() < self.staging
            }) {
                self.free.push(b);
            }
        }
        Ok(())
    }

    /// Start a pipelined round: its writes are tagged with `id` (increasing).
    pub fn begin_round(&mut self, id: u64) {
        debug_assert!(self.rounds.back().is_none_or(|r| r.0 < id));
        self.cur_round = id;
        self.rounds.push_back((id, 0));
        self.submitted_in_round = 0;
    }

    /// All of the current round's bytes are written: submit what is held. A round that is a
    /// single write with nothing else in flight goes out with FUA and needs no flush (unless
    /// `may_fua` is false: a checkpoint batch, which nothing waits on until the checkpoint's
    /// own flush).
    pub fn end_round(&mut self, may_fua: bool) -> Result<()> {
        self.close_piece()?;
        let alone = may_fua
            && self.rounds.len() == 1
            && self.flush_covers.is_none()
            && self.submitted_in_round == 0;
        if let Some(p) = self.held.take() {
            let fua = alone && self.volatile;
            if fua {
                self.fua_round = Some(self.cur_round);
                self.fua_rounds += 1;
            }
            self.submit(p, fua)?;
        }
        self.advance()
    }

    /// Reap completions (waiting for at least one when `block` and something is in flight),
    /// then start the flush that makes finished rounds durable. Returns the newest durable round.
    pub fn progress(&mut self, block: bool) -> Result<u64> {
        let busy = self.q.in_flight() > 0;
        self.reap(usize::from(block && busy))?;
        if let Some(e) = self.error.take() {
            return Err(e.into());
        }
        self.advance()?;
        Ok(self.durable)
    }

    fn advance(&mut self) -> Result<()> {
        while let Some(&(id, left)) = self.rounds.front() {
            if left > 0 || (id == self.cur_round && self.held.is_some()) {
                break;
            }
            self.rounds.pop_front();
            self.written = self.written.max(id);
            if self.fua_round == Some(id) || !self.volatile {
                self.fua_round = None;
                self.durable = self.durable.max(id);
            }
        }
        if self.written > self.durable && self.flush_covers.is_none() {
            self.flush_covers = Some(self.written);
            self.submit_req(Request::flush(FLUSH_TAG))?;
            self.q.kick()?;
        }
        Ok(())
    }

    /// Submit a request, reaping completions while the queue is full.
    fn submit_req(&mut self, mut req: Request) -> Result<()> {
        loop {
            match self.q.submit(req) {
                Ok(()) => return Ok(()),
                Err(e) if e.is_full() => {
                    req = e.request;
                    self.reap(1)?;
                }
                Err(e) => return Err(e.into_error(&"store".into()).into()),
            }
        }
    }

    fn take_buf(&mut self) -> Result<DmaBuf> {
        while self.free.is_empty() {
            self.reap(1)?;
        }
        Ok(self.free.pop().unwrap())
    }

    fn submit(&mut self, p: Piece, fua: bool) -> Result<()> {
        debug_assert_eq!(p.len % self.block, 0);
        debug_assert_eq!(p.offset % self.block as u64, 0);
        let bs = self.block as u64;
        let tag = self.cur_round;
        let blocks = (p.len / self.block) as u32;
        self.submit_req(Request::write(p.offset / bs, blocks, p.buf, 0, fua, tag))?;
        self.bytes_written += p.len as u64;
        self.writes += 1;
        self.submitted_in_round += 1;
        if let Some(r) = self.rounds.back_mut().filter(|r| r.0 == tag) {
            r.1 += 1;
        }
        Ok(())
    }

    /// Close the current piece: it becomes the held piece; the previously held one goes out.
    fn close_piece(&mut self) -> Result<()> {
        let Some(mut p) = self.cur.take() else {
            return Ok(());
        };
        let padded = p.len.next_multiple_of(self.block);
        p.buf.fill(p.len, padded - p.len, 0);
        p.len = padded;
        if let Some(prev) = self.held.replace(p) {
            self.submit(prev, false)?;
        }
        Ok(())
    }

    /// Start a contiguous run at a block-aligned byte offset.
    pub fn begin(&mut self, offset: u64) -> Result<()> {
        self.close_piece()?;
        let buf = self.take_buf()?;
        self.cur = Some(Piece {
            buf,
            offset,
            len: 0,
        });
        Ok(())
    }

    /// Append bytes to the current run.
    pub fn put(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let cur = self.cur.as_mut().expect("put without begin");
            if cur.len == self.piece_bytes {
                let next_off = cur.offset + cur.len as u64;
                self.begin(next_off)?;
                continue;
            }
            let n = (self.piece_bytes - cur.len).min(bytes.len());
            cur.buf.write_at(cur.len, &bytes[..n]);
            cur.len += n;
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Write a caller-filled DMA buffer's first `len` bytes (block multiple) at `offset` as its
    /// own IO in the current round. Ends the current run.
    pub fn write_dma(&mut self, offset: u64, buf: DmaBuf, len: usize) -> Result<()> {
        self.close_piece()?;
        if let Some(prev) = self.held.take() {
            self.submit(prev, false)?;
        }
        self.submit(Piece { buf, offset, len }, false)
    }

    /// Pad the run with zeros to the next block boundary.
    pub fn pad_to_block(&mut self) -> Result<()> {
        let cur = self.cur.as_mut().expect("pad without begin");
        let pad = cur.len.next_multiple_of(self.block) - cur.len;
        if pad > 0 {
            let zeros = [0u8; 4096];
            let mut left = pad;
            while left > 0 {
                let n = left.min(zeros.len());
                self.put(&zeros[..n])?;
                left -= n;
            }
        }
        Ok(())
    }

    /// Wait for everything in flight.
    pub fn drain(&mut self) -> Result<()> {
        while self.q.in_flight() > 0 {
            self.reap(1)?;
        }
        match self.error.take() {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Make every write of this round durable: one FUA write if the round was a single write,
    /// else all writes, wait, one flush (skipped when the device has no volatile cache).
    pub fn finish_round(&mut self) -> Result<()> {
        self.close_piece()?;
        let single = self.submitted_in_round == 0;
        if let Some(p) = self.held.take() {
            self.submit(p, single && self.volatile)?;
        }
        let wrote = self.submitted_in_round > 0;
        self.submitted_in_round = 0;
        self.drain()?;
        if wrote && self.volatile && !single {
            self.flush()?;
        } else if wrote && single && self.volatile {
            self.fua_rounds += 1;
        }
        Ok(())
    }

    /// Submit a flush and wait for it (nothing else may be in flight).
    pub fn flush(&mut self) -> Result<()> {
        self.drain()?;
        let c = driver::io::execute(&mut self.q, Request::flush(0), DEVICE_TIMEOUT);
        self.flushes += 1;
        c.result?;
        // Every round written before it is durable now: none needs a flush of its own.
        while self.rounds.front().is_some_and(|r| r.1 == 0) && self.held.is_none() {
            let (id, _) = self.rounds.pop_front().unwrap();
            self.written = self.written.max(id);
        }
        self.durable = self.durable.max(self.written);
        Ok(())
    }

    /// Write one block-padded region synchronously with FUA (superblocks).
    pub fn write_fua(&mut self, dev: &D, offset: u64, bytes: &[u8]) -> Result<()> {
        self.drain()?;
        let len = bytes.len().next_multiple_of(self.block);
        let mut buf = dev.alloc_buf(len)?;
        buf.write_at(0, bytes);
        let bs = self.block as u64;
        let req = Request::write(offset / bs, (len / self.block) as u32, buf, 0, true, 0);
        let c = driver::io::execute(&mut self.q, req, DEVICE_TIMEOUT);
        self.bytes_written += len as u64;
        self.writes += 1;
        c.result.map_err(Into::into)
    }
}
