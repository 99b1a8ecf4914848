//! Pooled receive buffers and the zero-copy [`Payload`] views handed to the dispatcher.
//!
//! A worker reads socket bytes into a [`RecvBuf`]: small frames share one 64 KiB chunk, each
//! payload handed out as a [`Payload`] (an `Arc` on the chunk plus a range); a large frame gets
//! a buffer of its own sized to the frame. When the last `Payload` of a buffer is dropped (on any
//! thread) the buffer goes back to its size class's free list, up to a cap per class.
//!
//! Copies on the receive path are bounded and small: when a large frame's header is parsed,
//! the part of its payload that arrived in the same read (less than one chunk) is moved into
//! the frame's own buffer, and the rest is read straight into it; a small frame cut by the end
//! of a chunk moves (less than 17 KiB) to the next chunk.
//!
//! Soundness rule: the worker writes only into `[filled, capacity)` of a buffer; `Payload`s only
//! cover `[0, filled)` at the time they are made, and `filled` never moves backwards while any
//! `Payload` of the buffer exists (it is reset only when the worker's `Arc` is the only one).

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Bytes of a shared receive chunk for small frames.
pub const CHUNK_BYTES: usize = 64 << 10;
/// Payloads at least this large are received into a buffer of their own.
pub const LARGE_PAYLOAD_BYTES_MIN: usize = 16 << 10;
const _: () = assert!(
    LARGE_PAYLOAD_BYTES_MIN + 64 < CHUNK_BYTES / 2,
    "a small frame must fit in half a chunk"
);
/// Smallest size class above the chunk; classes double up to the protocol limit.
const LARGE_CLASS_MIN_SHIFT: u32 = 17;
const LARGE_CLASS_MAX_SHIFT: u32 = 26;
const CLASS_COUNT: usize = 1 + (LARGE_CLASS_MAX_SHIFT - LARGE_CLASS_MIN_SHIFT + 1) as usize;
const _: () = assert!(1 << LARGE_CLASS_MAX_SHIFT == crate::frame::PAYLOAD_BYTES_LIMIT);
/// Free buffers kept per class: chunks, then for each large class as many as fit in
/// [`KEEP_LARGE_BYTES`], at least [`KEEP_LARGE_MIN`]. A buffer freed because its list was full
/// comes back as fresh memory, which the kernel faults in and zeroes page by page: with 8 kept
/// per class, 4 MiB cluster writes (a node holding a dozen or more ~700 KiB shard writes at
/// once) spent ~3.4 % of all CPU faulting in receive buffers.
const KEEP_CHUNKS_MAX: usize = 256;
const KEEP_LARGE_BYTES: usize = 32 << 20;
const KEEP_LARGE_MIN: usize = 8;

#[derive(Debug, Default)]
struct PoolCounters {
    fresh: AtomicU64,
    reused: AtomicU64,
    returned: AtomicU64,
    freed: AtomicU64,
}

/// Pool counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers allocated from the system.
    pub fresh: u64,
    /// Buffers taken from a free list.
    pub reused: u64,
    /// Buffers given back to a free list.
    pub returned: u64,
    /// Buffers released to the system because their free list was full.
    pub freed: u64,
}

struct PoolShared {
    classes: [Mutex<Vec<Box<[u8]>>>; CLASS_COUNT],
    counters: PoolCounters,
}

/// A set of size-classed free lists shared by a messenger's workers.
#[derive(Clone)]
pub struct BufPool {
    shared: Arc<PoolShared>,
}

impl Default for BufPool {
    fn default() -> Self {
        BufPool::new()
    }
}

impl BufPool {
    pub fn new() -> BufPool {
        BufPool {
            shared: Arc::new(PoolShared {
                classes: std::array::from_fn(|_| Mutex::new(Vec::new())),
                counters: PoolCounters::default(),
            }),
        }
    }

    pub fn stats(&self) -> PoolStats {
        let c = &self.shared.counters;
        PoolStats {
            fresh: c.fresh.load(Relaxed),
            reused: c.reused.load(Relaxed),
            returned: c.returned.load(Relaxed),
            freed: c.freed.load(Relaxed),
        }
    }

    fn class_of(len: usize) -> (usize, usize) {
        if len <= CHUNK_BYTES {
            return (0, CHUNK_BYTES);
        }
        let shift = (usize::BITS - (len - 1).leading_zeros()).max(LARGE_CLASS_MIN_SHIFT);
        (
            1 + (shift - LARGE_CLASS_MIN_SHIFT) as usize,
            1usize << shift,
        )
    }

    /// A writable buffer of at least `len` bytes.
    pub fn take(&self, len: usize) -> RecvBuf {
        let (class, size) = Self::class_of(len);
        assert!(
            class < CLASS_COUNT,
            "buffer of {len} bytes is past the protocol limit"
        );
        let c = &self.shared.counters;
        let reused = self.shared.classes[class].lock().expect("pool lock").pop();
        let mem = match reused {
            Some(b) => {
                c.reused.fetch_add(1, Relaxed);
                b
            }
            None => {
                c.fresh.fetch_add(1, Relaxed);
                vec![0u8; size].into_boxed_slice()
            }
        };
        RecvBuf {
            inner: Arc::new(BufInner::new(mem, Some((self.shared.clone(), class)))),
            filled: 0,
        }
    }
}

/// The allocation behind a [`RecvBuf`] and its [`Payload`]s.
struct BufInner {
    ptr: *mut u8,
    cap: usize,
    home: Option<(Arc<PoolShared>, usize)>,
}

// SAFETY: the bytes behind `ptr` are owned by this struct (from a leaked Box). Writes happen only
// through `RecvBuf::spare_mut` into the unpublished tail, reads through `Payload` only of the
// published head (module docs), so moving or sharing the handle across threads races on nothing.
unsafe impl Send for BufInner {}
// SAFETY: as above; shared access only ever reads published bytes.
unsafe impl Sync for BufInner {}

impl BufInner {
    fn new(mem: Box<[u8]>, home: Option<(Arc<PoolShared>, usize)>) -> BufInner {
        let cap = mem.len();
        let ptr = Box::into_raw(mem) as *mut u8;
        BufInner { ptr, cap, home }
    }
}

impl Drop for BufInner {
    fn drop(&mut self) {
        // SAFETY: ptr/cap came from Box::into_raw of a boxed slice of exactly cap bytes, and this
        // is the last reference, so rebuilding the Box takes back sole ownership.
        let mem = unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.cap)) };
        let Some((pool, class)) = self.home.take() else {
            return;
        };
        let keep = if class == 0 {
            KEEP_CHUNKS_MAX
        } else {
            (KEEP_LARGE_BYTES / self.cap).max(KEEP_LARGE_MIN)
        };
        let mut free = pool.classes[class].lock().expect("pool lock");
        if free.len() < keep {
            free.push(mem);
            pool.counters.returned.fetch_add(1, Relaxed);
        } else {
            drop(free);
            pool.counters.freed.fetch_add(1, Relaxed);
        }
    }
}

/// The worker's writable view of a receive buffer.
pub struct RecvBuf {
    inner: Arc<BufInner>,
    filled: usize,
}

impl RecvBuf {
    pub fn capacity(&self) -> usize {
        self.inner.cap
    }

    pub fn filled(&self) -> usize {
        self.filled
    }

    /// The unwritten tail, for the next `read`.
    pub fn spare_mut(&mut self) -> &mut [u8] {
        // SAFETY: [filled, cap) is inside the allocation and no Payload covers it (Payloads are
        // made only below `filled`); `&mut self` makes this the only writer.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.inner.ptr.add(self.filled),
                self.inner.cap - self.filled,
            )
        }
    }

    /// Mark `n` more bytes of the spare tail as written.
    pub fn advance(&mut self, n: usize) {
        assert!(self.filled + n <= self.inner.cap, "advance past capacity");
        self.filled += n;
    }

    /// The written bytes.
    pub fn data(&self) -> &[u8] {
        // SAFETY: [0, filled) is initialised (the allocation is zeroed and then written) and is
        // never written again while borrowed: writes go to the tail through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.inner.ptr, self.filled) }
    }

    /// A zero-copy view of written bytes.
    pub fn freeze(&self, start: usize, len: usize) -> Payload {
        assert!(start + len <= self.filled, "payload past the written bytes");
        Payload {
            inner: Some(self.inner.clone()),
            start,
            len,
        }
    }

    /// Start again from offset 0 when no Payload still looks at this buffer. Returns whether it
    /// did.
    pub fn reset_if_unshared(&mut self) -> bool {
        if Arc::strong_count(&self.inner) == 1 {
            self.filled = 0;
            true
        } else {
            false
        }
    }
}

/// Received payload bytes, shared without copying. Cheap to clone; the buffer returns to its
/// pool when the last view of it is dropped.
#[derive(Clone, Default)]
pub struct Payload {
    inner: Option<Arc<BufInner>>,
    start: usize,
    len: usize,
}

impl Payload {
    /// A payload owning a plain vector (tests, tools, local loops).
    pub fn from_vec(v: Vec<u8>) -> Payload {
        let len = v.len();
        Payload {
            inner: Some(Arc::new(BufInner::new(v.into_boxed_slice(), None))),
            start: 0,
            len,
        }
    }

    /// A sub-range of this payload, sharing the same buffer.
    pub fn slice(&self, start: usize, len: usize) -> Payload {
        assert!(start + len <= self.len, "slice past the payload");
        Payload {
            inner: self.inner.clone(),
            start: self.start + start,
            len,
        }
    }

    /// The sub-range that `sub`, a slice borrowed from this payload (a decoder's view, say),
    /// covers, sharing the same buffer. Panics if `sub` does not lie within this payload.
    pub fn slice_ref(&self, sub: &[u8]) -> Payload {
        if sub.is_empty() {
            return Payload::default();
        }
        self.slice_of(sub)
            .expect("slice_ref: the slice is not inside this payload")
    }

    /// [`Payload::slice_ref`] of a non-empty `sub` that may or may not lie in this payload:
    /// `None` when it does not (or is empty).
    pub fn slice_of(&self, sub: &[u8]) -> Option<Payload> {
        let base = self.as_ptr() as usize;
        let at = (sub.as_ptr() as usize).wrapping_sub(base);
        (!sub.is_empty() && at <= self.len && sub.len() <= self.len - at)
            .then(|| self.slice(at, sub.len()))
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.inner {
            // SAFETY: [start, start+len) was written before this view was made (freeze checks it
            // is below `filled`) and the writer never touches bytes below `filled` again.
            Some(b) => unsafe { std::slice::from_raw_parts(b.ptr.add(self.start), self.len) },
            None => &[],
        }
    }
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_share_the_chunk_and_return_it_to_the_pool_when_dropped() {
        let pool = BufPool::new();
        let mut b = pool.take(100);
        assert_eq!(b.capacity(), CHUNK_BYTES);
        b.spare_mut()[..6].copy_from_slice(b"abcdef");
        b.advance(6);
        let p1 = b.freeze(0, 3);
        let p2 = b.freeze(3, 3);
        assert!(!b.reset_if_unshared());
        b.spare_mut()[..2].copy_from_slice(b"gh");
        b.advance(2);
        assert_eq!(&*p1, b"abc");
        assert_eq!(&*p2, b"def");
        drop((p1, p2));
        assert!(b.reset_if_unshared());
        drop(b);
        assert_eq!(
            pool.stats(),
            PoolStats {
                fresh: 1,
                reused: 0,
                returned: 1,
                freed: 0
            }
        );
        let b = pool.take(10);
        assert_eq!(pool.stats().reused, 1);
        let p = b.freeze(0, 0);
        drop(b);
        let other = std::thread::spawn(move || p.len()).join().unwrap();
        assert_eq!(other, 0);
        assert_eq!(pool.stats().returned, 2);
    }

    #[test]
    fn large_classes_keep_what_fits_their_byte_budget() {
        let pool = BufPool::new();
        // A shard write of ~700 KiB: the 1 MiB class keeps 32 buffers (32 MiB).
        let held: Vec<RecvBuf> = (0..40).map(|_| pool.take(700 << 10)).collect();
        assert_eq!(held[0].capacity(), 1 << 20);
        drop(held);
        let st = pool.stats();
        assert_eq!((st.fresh, st.returned, st.freed), (40, 32, 8));
        let again: Vec<RecvBuf> = (0..32).map(|_| pool.take(1 << 20)).collect();
        assert_eq!((pool.stats().reused, pool.stats().fresh), (32, 40));
        drop(again);
        // The largest classes keep at least KEEP_LARGE_MIN.
        let big: Vec<RecvBuf> = (0..10).map(|_| pool.take((32 << 20) + 1)).collect();
        drop(big);
        let st = pool.stats();
        assert_eq!(
            (st.returned, st.freed),
            (32 + 32 + KEEP_LARGE_MIN as u64, 8 + 2)
        );
    }

    #[test]
    fn slice_ref_finds_a_borrowed_sub_slice_and_refuses_others() {
        let p = Payload::from_vec(b"header:body".to_vec());
        let body = &p[7..];
        let q = p.slice_ref(body);
        assert_eq!(&*q, b"body");
        assert_eq!(&*q.slice_ref(&q[1..3]), b"od");
        assert!(p.slice_ref(&p[11..]).is_empty());
        let other = b"body".to_vec();
        let r = std::panic::catch_unwind(|| p.slice_ref(&other));
        assert!(r.is_err(), "a slice of another buffer must not be accepted");
    }

    #[test]
    fn size_classes_double_from_128k() {
        assert_eq!(BufPool::class_of(1), (0, CHUNK_BYTES));
        assert_eq!(BufPool::class_of(CHUNK_BYTES + 1), (1, 128 << 10));
        assert_eq!(BufPool::class_of(4 << 20), (6, 4 << 20));
        assert_eq!(BufPool::class_of((4 << 20) + 1), (7, 8 << 20));
        assert_eq!(
            BufPool::class_of(crate::frame::PAYLOAD_BYTES_LIMIT as usize).0,
            CLASS_COUNT - 1
        );
    }
}
