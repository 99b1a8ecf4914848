//! The BlockDevice contract: the one interface the store uses for every kind of device.
//!
//! # Model
//! Designed for NVMe first: a device hands out **queue handles**, one per thread. A handle is
//! `Send` but not shared; the thread that owns it submits requests and polls completions on it,
//! with no locks between threads. Submission never blocks: a full queue is an explicit
//! [`SubmitErrorKind::QueueFull`] that hands the request back. Completions are polled into a
//! caller-provided slice, at most `out.len()` at a time, without allocating.
//!
//! Submitted requests become visible to the device at the next [`QueueHandle::kick`],
//! [`QueueHandle::poll`] or [`QueueHandle::wait`] (doorbells / `io_uring_enter` are batched).
//!
//! Data moves through [`DmaBuf`]s from [`BlockDevice::alloc_buf`]. A request owns its buffer
//! while in flight; the completion hands it back.
//!
//! # Failure semantics
//! * **Completion is not durability.** When [`Geometry::volatile_write_cache`] is true, a
//!   completed plain write may sit in a volatile cache and be lost on power failure.
//! * A write with `fua: true` is durable when it completes.
//! * A completed [`Op::Flush`] makes durable every write that **completed before the flush was
//!   submitted**. Writes still in flight when the flush is submitted are not covered.
//! * After a crash, each block written by a write that was not yet durable holds either its old
//!   or its new content per atomic unit ([`Geometry::atomic_write_bytes`], at least a sector):
//!   a multi-unit write may be torn at unit boundaries. No unit ever holds a mix of bytes.
//! * Overlapping writes in flight at the same time have no defined order.
//! * After [`Op::Deallocate`] a block's content is undefined until written (devices usually
//!   return zeros; do not rely on it). After [`Op::WriteZeroes`] it reads as zeros.
//! * A failed read ([`Error::Media`]) says nothing about neighbouring blocks; a failed write
//!   leaves the range's content undefined.

use std::sync::Arc;
use std::time::Duration;

use crate::dma::DmaBuf;
use crate::error::{Error, Result};

/// What a device is. Fixed for the life of an open device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    /// Logical block size in bytes: the unit of every LBA and length.
    pub block_size: u32,
    /// Number of logical blocks.
    pub capacity_blocks: u64,
    /// Largest single transfer in bytes (a multiple of `block_size`).
    pub max_transfer_bytes: u32,
    /// Requests one queue handle can have in flight.
    pub queue_depth: u32,
    /// Queue handles the device can have open at once.
    pub queue_count: u32,
    /// True when completed writes may be lost on power failure until flushed.
    pub volatile_write_cache: bool,
    /// Bytes that a single write is guaranteed to update atomically across a crash (a power of
    /// two, at least 512). Writes larger than this may tear at multiples of it.
    pub atomic_write_bytes: u32,
    /// Required alignment of a buffer's device address plus `buf_offset`.
    pub dma_alignment: u32,
}

impl Geometry {
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_blocks * self.block_size as u64
    }

    pub fn max_transfer_blocks(&self) -> u32 {
        self.max_transfer_bytes / self.block_size
    }

    /// Convert a byte range into (lba, blocks), rejecting anything not block aligned.
    pub fn blocks_for(&self, device: &Arc<str>, offset: u64, len: u64) -> Result<(u64, u32)> {
        let bs = self.block_size as u64;
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(Error::Misaligned {
                device: device.clone(),
                detail: format!(
                    "byte offset {offset} and length {len} must be multiples of the \
                     {bs}-byte block size"
                ),
            });
        }
        let blocks = u32::try_from(len / bs).map_err(|_| Error::Invalid {
            device: device.clone(),
            detail: format!("length {len} is too large for one request"),
        })?;
        Ok((offset / bs, blocks))
    }
}

/// The operation of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    /// Write; `fua` makes it durable on completion.
    Write {
        fua: bool,
    },
    Flush,
    WriteZeroes,
    Deallocate,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write { fua: false } => "write",
            Op::Write { fua: true } => "write(fua)",
            Op::Flush => "flush",
            Op::WriteZeroes => "write-zeroes",
            Op::Deallocate => "deallocate",
        }
    }

    /// True for the operations that move data through a buffer.
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write { .. })
    }
}

/// One command. Data operations transfer `blocks * block_size` bytes between the device at
/// `lba` and `buf` starting at `buf_offset`.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    pub lba: u64,
    pub blocks: u32,
    pub buf: Option<DmaBuf>,
    pub buf_offset: usize,
    /// The caller's tag, returned in the completion.
    pub tag: u64,
}

impl Request {
    pub fn read(lba: u64, blocks: u32, buf: DmaBuf, buf_offset: usize, tag: u64) -> Self {
        Request {
            op: Op::Read,
            lba,
            blocks,
            buf: Some(buf),
            buf_offset,
            tag,
        }
    }

    pub fn write(
        lba: u64,
        blocks: u32,
        buf: DmaBuf,
        buf_offset: usize,
        fua: bool,
        tag: u64,
    ) -> Self {
        Request {
            op: Op::Write { fua },
            lba,
            blocks,
            buf: Some(buf),
            buf_offset,
            tag,
        }
    }

    pub fn flush(tag: u64) -> Self {
        Request {
            op: Op::Flush,
            lba: 0,
            blocks: 0,
            buf: None,
            buf_offset: 0,
            tag,
        }
    }

    pub fn write_zeroes(lba: u64, blocks: u32, tag: u64) -> Self {
        Request {
            op: Op::WriteZeroes,
            lba,
            blocks,
            buf: None,
            buf_offset: 0,
            tag,
        }
    }

    pub fn deallocate(lba: u64, blocks: u32, tag: u64) -> Self {
        Request {
            op: Op::Deallocate,
            lba,
            blocks,
            buf: None,
            buf_offset: 0,
            tag,
        }
    }

    /// Check a request against a device's geometry. Every backend calls this at submit, so
    /// every backend rejects the same things with the same errors.
    pub fn validate(&self, device: &Arc<str>, geo: &Geometry) -> Result<()> {
        let invalid = |detail: String| Error::Invalid {
            device: device.clone(),
            detail,
        };
        if self.op == Op::Flush {
            return Ok(());
        }
        if self.blocks == 0 {
            return Err(invalid(format!("{} of zero blocks", self.op.name())));
        }
        let end = self.lba.checked_add(self.blocks as u64);
        if end.is_none_or(|end| end > geo.capacity_blocks) {
            return Err(Error::OutOfRange {
                device: device.clone(),
                lba: self.lba,
                blocks: self.blocks,
                capacity: geo.capacity_blocks,
            });
        }
        if !self.op.has_data() {
            return Ok(());
        }
        let bytes = self.blocks as u64 * geo.block_size as u64;
        if bytes > geo.max_transfer_bytes as u64 {
            return Err(invalid(format!(
                "{} of {bytes} bytes exceeds the maximum transfer size of {} bytes",
                self.op.name(),
                geo.max_transfer_bytes
            )));
        }
        let Some(buf) = &self.buf else {
            return Err(invalid(format!("{} without a buffer", self.op.name())));
        };
        let addr = buf.iova().wrapping_add(self.buf_offset as u64);
        if addr % geo.dma_alignment as u64 != 0 {
            return Err(Error::Misaligned {
                device: device.clone(),
                detail: format!(
                    "buffer address {addr:#x} (offset {}) is not aligned to {} bytes",
                    self.buf_offset, geo.dma_alignment
                ),
            });
        }
        if (self.buf_offset as u64).saturating_add(bytes) > buf.len() as u64 {
            return Err(invalid(format!(
                "{} of {bytes} bytes at buffer offset {} overruns a {}-byte buffer",
                self.op.name(),
                self.buf_offset,
                buf.len()
            )));
        }
        Ok(())
    }
}

/// A finished request. `Default` gives an empty slot for the caller's completion array.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub op: Op,
    pub result: Result<()>,
    /// The request's buffer, handed back.
    pub buf: Option<DmaBuf>,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            tag: 0,
            op: Op::Flush,
            result: Ok(()),
            buf: None,
        }
    }
}

/// Why a submit was refused. The request always comes back, so nothing is lost.
#[derive(Debug)]
pub enum SubmitErrorKind {
    /// `queue_depth` requests are already in flight: poll, then submit again.
    QueueFull,
    /// The request is invalid for this device (range, alignment, size) or the device is gone.
    /// Boxed so the common `Ok` path stays small; errors are off the hot path.
    Rejected(Box<Error>),
}

#[derive(Debug)]
pub struct SubmitError {
    pub kind: SubmitErrorKind,
    pub request: Request,
}

impl SubmitError {
    pub fn full(request: Request) -> Self {
        SubmitError {
            kind: SubmitErrorKind::QueueFull,
            request,
        }
    }

    pub fn rejected(error: Error, request: Request) -> Self {
        SubmitError {
            kind: SubmitErrorKind::Rejected(Box::new(error)),
            request,
        }
    }

    pub fn is_full(&self) -> bool {
        matches!(self.kind, SubmitErrorKind::QueueFull)
    }

    /// The error, dropping the request (convenient where the caller gives up).
    pub fn into_error(self, device: &Arc<str>) -> Error {
        match self.kind {
            SubmitErrorKind::Rejected(e) => *e,
            SubmitErrorKind::QueueFull => Error::Invalid {
                device: device.clone(),
                detail: "queue full".into(),
            },
        }
    }
}

/// A device: geometry, DMA memory and queue handles.
pub trait BlockDevice: Send + Sync {
    type Queue: QueueHandle;

    /// A short name for messages: a path, a PCI address and namespace, a simulator id.
    fn name(&self) -> &Arc<str>;

    fn geometry(&self) -> &Geometry;

    /// Open a queue handle for the calling thread. Fails with [`Error::NoQueue`] when
    /// `queue_count` handles are already open; dropping a handle frees its queue.
    fn open_queue(&self) -> Result<Self::Queue>;

    /// Allocate `len` bytes of memory this device can transfer to and from, zeroed, aligned to
    /// at least `dma_alignment` (buffers are page aligned on every backend).
    fn alloc_buf(&self, len: usize) -> Result<DmaBuf>;

    /// Memory whose `len` bytes the caller overwrites before they are used (a read's
    /// destination, or a write's staging copy that fills the whole buffer): like [`alloc_buf`],
    /// but it may be a recycled buffer still holding bytes of an earlier IO (initialised, not
    /// zeroed), so the IO path pays for neither an allocation nor a zeroing pass. By default
    /// `alloc_buf`.
    ///
    /// [`alloc_buf`]: BlockDevice::alloc_buf
    fn alloc_read_buf(&self, len: usize) -> Result<DmaBuf> {
        self.alloc_buf(len)
    }
}

/// One queue of a device, owned by one thread.
pub trait QueueHandle: Send {
    /// Queue a request. On `Err` the request is handed back untouched.
    fn submit(&mut self, req: Request) -> Result<(), SubmitError>;

    /// Make every queued request visible to the device (ring the doorbell).
    fn kick(&mut self) -> Result<()>;

    /// Kick, then move up to `out.len()` finished requests into `out`; returns how many.
    /// Never blocks and never allocates.
    fn poll(&mut self, out: &mut [Completion]) -> Result<usize>;

    /// Like [`poll`](Self::poll), but waits until at least `min` completions (capped at what is
    /// in flight and at `out.len()`) have been returned or `timeout` passes. Returns what was
    /// collected; [`Error::Timeout`] only when fewer than `min` arrived.
    fn wait(&mut self, out: &mut [Completion], min: usize, timeout: Duration) -> Result<usize>;

    /// Requests submitted and not yet returned by poll.
    fn in_flight(&self) -> usize;

    /// Maximum requests in flight on this handle.
    fn depth(&self) -> usize;
}
