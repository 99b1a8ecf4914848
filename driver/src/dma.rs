//! DMA buffers: memory a device may read or write, reached only through copy accessors.
//!
//! A [`DmaBuf`] carries (virtual address, device address, length). It never hands out a Rust
//! reference to its memory: while a command is in flight the device may write it, and a `&[u8]`
//! over memory that changes underneath is undefined behaviour. Ownership of the buffer moves into
//! the queue with the request and comes back with the completion, so the holder of a `DmaBuf`
//! is the only party touching it — but the accessors still copy, so a misbehaving device cannot
//! turn into unsoundness in safe code. The one exception is internal: `crc32c` sums in place
//! memory that no device can reach outside a request (host memory behind a file or the
//! simulator), where the copy would only cost time.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// Copies shorter than this use plain stores (a small copy's lines are cheap to keep).
const STREAM_BYTES_MIN: usize = 4096;

/// Copy `src` to `dst` (32-byte aligned) with 32-byte non-temporal stores, then fence.
///
/// # Safety
/// `dst..dst+src.len()` must be valid for writes, not overlap `src`, and be 32-byte aligned;
/// the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_copy_avx2(dst: *mut u8, src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    let n = src.len() / 128 * 128;
    let mut i = 0;
    while i < n {
        // SAFETY: i + 128 <= src.len(); loads are unaligned; stores land in dst's range at
        // 32-byte aligned addresses (dst aligned, i a multiple of 128).
        unsafe {
            let s = src.as_ptr().add(i) as *const __m256i;
            let d = dst.add(i) as *mut __m256i;
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            _mm256_stream_si256(d.add(2), c);
            _mm256_stream_si256(d.add(3), e);
        }
        i += 128;
    }
    // SAFETY: the tail stays within both ranges; the fence orders the streaming stores before
    // anything that follows (the buffer is handed to the device after this returns).
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr().add(n), dst.add(n), src.len() - n);
        _mm_sfence();
    }
}

/// Who hands a region back when a [`DmaBuf`] is dropped.
///
/// # Safety
/// `release` receives exactly the (ptr, iova, len) a buffer was created with, once. Implementors
/// must not reuse the region until `release` is called.
pub unsafe trait DmaOwner: Send + Sync {
    /// Take a region back.
    fn release(&self, ptr: NonNull<u8>, iova: u64, len: usize);

    /// Whether the device reaches a region only while a request holding its buffer is in
    /// flight: host memory that the kernel pins for a system call and unpins before the
    /// completion is posted (files, the simulator). Then the holder of a buffer is the only
    /// party touching it and may read it in place. `false` (the default) for memory mapped
    /// into a device's IOMMU domain, which the device could write at any time.
    fn reached_only_in_flight(&self) -> bool {
        false
    }

    /// Whether buffers of this owner are parts of a larger region ([`DmaBuf::split_off`]):
    /// keeping one keeps the whole region.
    fn is_part(&self) -> bool {
        false
    }
}

/// A region of DMA-able memory. Not `Clone`; moves into a queue with a request and back out
/// with its completion.
pub struct DmaBuf {
    ptr: NonNull<u8>,
    iova: u64,
    len: usize,
    owner: Arc<dyn DmaOwner>,
}

// SAFETY: a DmaBuf is the unique owner of its region (the DmaOwner contract); moving it to
// another thread moves that ownership.
unsafe impl Send for DmaBuf {}
// SAFETY: &DmaBuf only permits copying out of the region; writes need &mut DmaBuf.
unsafe impl Sync for DmaBuf {}

impl DmaBuf {
    /// Wrap a region.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, exclusively owned by the new buffer
    /// until `owner.release` is called with the same values, and `iova` must be the address at
    /// which the device sees `ptr`.
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        iova: u64,
        len: usize,
        owner: Arc<dyn DmaOwner>,
    ) -> Self {
        DmaBuf {
            ptr,
            iova,
            len,
            owner,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address the device uses for the first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// The virtual address of the first byte, for syscalls (pread, writev, io_uring) that take a
    /// pointer. Never turn it into a reference.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Mutable variant of [`as_ptr`](Self::as_ptr).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "DmaBuf access {offset}+{len} out of bounds (buffer is {} bytes)",
            self.len
        );
    }

    /// Copy `src` into the buffer at `offset`. Panics if it does not fit.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: bounds checked above; we own the region exclusively (&mut self); src is a
        // distinct Rust allocation so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        }
    }

    /// Copy `src` into the buffer at `offset` with non-temporal (streaming) stores where the
    /// CPU has AVX2 and the destination is 32-byte aligned: for a staging copy the device reads
    /// next, not the CPU, this skips reading every destination line into the cache first and
    /// leaves the cache to the caller. Otherwise the same as [`write_at`](Self::write_at).
    pub fn write_at_streaming(&mut self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: offset + len is within the buffer (checked above); the address is only
            // inspected here.
            let dst = unsafe { self.ptr.as_ptr().add(offset) };
            if src.len() >= STREAM_BYTES_MIN
                && (dst as usize).is_multiple_of(32)
                && std::arch::is_x86_feature_detected!("avx2")
            {
                // SAFETY: bounds checked above; exclusive access through &mut self; src is a
                // distinct allocation; AVX2 was detected at run time.
                unsafe { stream_copy_avx2(dst, src) };
                return;
            }
        }
        self.write_at(offset, src)
    }

    /// Copy bytes at `offset` out into `dst`. Panics if the range is out of bounds.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        // SAFETY: bounds checked above; dst is a distinct Rust allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
    }

    /// Copy bytes at `offset` out into uninitialised memory (a `Vec`'s spare capacity, say),
    /// which they then initialise. Panics if the range is out of bounds.
    pub fn read_into_uninit(&self, offset: usize, dst: &mut [std::mem::MaybeUninit<u8>]) {
        self.check(offset, dst.len());
        // SAFETY: bounds checked above; dst is a distinct Rust allocation, and writing bytes
        // into MaybeUninit<u8> slots is always valid.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr().cast::<u8>(),
                dst.len(),
            )
        }
    }

    /// Append `len` bytes at `offset` to `out`, copying straight into its spare capacity (no
    /// zeroing pass first). Panics if the range is out of bounds.
    pub fn append_to(&self, offset: usize, len: usize, out: &mut Vec<u8>) {
        self.check(offset, len);
        out.reserve(len);
        let at = out.len();
        // SAFETY: bounds checked above; `reserve` made room for `len` more bytes after `at`,
        // which this copy initialises before `set_len` exposes them; the regions are distinct
        // allocations.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr().add(at),
                len,
            );
            out.set_len(at + len);
        }
    }

    /// Set `len` bytes at `offset` to `byte`.
    pub fn fill(&mut self, offset: usize, len: usize, byte: u8) {
        self.check(offset, len);
        // SAFETY: bounds checked above; exclusive access through &mut self.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), byte, len) }
    }

    /// Copy `len` bytes from `src` at `src_offset` into this buffer at `offset`.
    pub fn copy_from(&mut self, offset: usize, src: &DmaBuf, src_offset: usize, len: usize) {
        self.check(offset, len);
        src.check(src_offset, len);
        // SAFETY: both ranges bounds-checked; two distinct DmaBufs own disjoint regions.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.ptr.as_ptr().add(src_offset),
                self.ptr.as_ptr().add(offset),
                len,
            )
        }
    }

    /// Split the buffer at `at`: `self` keeps bytes `0..at`, the returned buffer owns
    /// `at..len`. Each half can go out with a request of its own; the region goes back to its
    /// owner once both are dropped. Panics unless `0 < at < len` and `at` is a multiple of
    /// 4096: the tail then starts on a page, where any device can address a buffer.
    pub fn split_off(&mut self, at: usize) -> DmaBuf {
        assert!(
            at > 0 && at < self.len && at.is_multiple_of(4096),
            "split of a {}-byte DMA buffer at {at}",
            self.len
        );
        let whole = Arc::new(Halves {
            owner: self.owner.clone(),
            ptr: self.ptr,
            iova: self.iova,
            len: self.len,
            left: AtomicUsize::new(2),
        });
        let tail_len = self.len - at;
        self.owner = whole.clone();
        self.len = at;
        // SAFETY: `at < len`, so the tail lies inside the region; from here `self` covers only
        // `0..at` and the tail `at..len`: disjoint, each owned by one buffer. `Halves` hands
        // the whole region back to its owner with the original values once both are released,
        // and the device sees the tail at `iova + at`.
        unsafe {
            DmaBuf::from_raw_parts(
                NonNull::new_unchecked(self.ptr.as_ptr().add(at)),
                self.iova + at as u64,
                tail_len,
                whole,
            )
        }
    }

    /// Whether this buffer is part of a larger region ([`DmaBuf::split_off`]): a pool that
    /// kept it would keep the whole region.
    pub fn is_part(&self) -> bool {
        self.owner.is_part()
    }

    /// Read a little-endian u32 at `offset` (volatile: the value is read exactly once).
    pub fn read_u32_le(&self, offset: usize) -> u32 {
        let mut b = [0u8; 4];
        self.read_at(offset, &mut b);
        u32::from_le_bytes(b)
    }

    /// Read a little-endian u64 at `offset`.
    pub fn read_u64_le(&self, offset: usize) -> u64 {
        let mut b = [0u8; 8];
        self.read_at(offset, &mut b);
        u64::from_le_bytes(b)
    }

    /// Compare the bytes at `offset` with `expected` without exposing the region as a slice.
    pub fn eq_at(&self, offset: usize, expected: &[u8]) -> bool {
        let mut chunk = [0u8; 4096];
        expected.chunks(chunk.len()).enumerate().all(|(i, want)| {
            let got = &mut chunk[..want.len()];
            self.read_at(offset + i * 4096, got);
            got == want
        })
    }

    /// CRC32C (Castagnoli) of `len` bytes at `offset`, continuing from `seed` (as
    /// `crc32c::crc32c_append`). Memory a device can reach at any time (VFIO) is read through
    /// a small stack buffer, so no reference into the region is formed; memory whose owner
    /// says it is reached only in flight ([`DmaOwner::reached_only_in_flight`]: file and
    /// simulated devices) is summed in place. The sum is crc-fast's folding one (several times
    /// the `crc32` instruction loop on large buffers). The stack buffer is not zeroed first: a
    /// 4 KiB memset per call cost as much as copying a 4 KiB chunk, and more than a small one.
    pub fn crc32c(&self, seed: u32, offset: usize, len: usize) -> u32 {
        const STEP: usize = 4096;
        self.check(offset, len);
        let mut d = crc_fast::Digest::new_with_init_state(
            crc_fast::CrcAlgorithm::Crc32Iscsi,
            u64::from(!seed),
        );
        if self.owner.reached_only_in_flight() {
            // SAFETY: bounds checked above. The owner's contract: no device reaches the region
            // while no request holds it, and this buffer (borrowed here) is held by none, so
            // nothing writes the bytes while the slice lives.
            let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) };
            d.update(bytes);
            return d.finalize() as u32;
        }
        let mut chunk = [std::mem::MaybeUninit::<u8>::uninit(); STEP];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(STEP);
            self.read_into_uninit(offset + done, &mut chunk[..n]);
            // SAFETY: the copy just above initialised the first n bytes of `chunk`, and only
            // those are viewed.
            let bytes = unsafe { std::slice::from_raw_parts(chunk.as_ptr().cast::<u8>(), n) };
            d.update(bytes);
            done += n;
        }
        d.finalize() as u32
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        self.owner.release(self.ptr, self.iova, self.len);
    }
}

/// The owner of the halves [`DmaBuf::split_off`] makes: gives the whole region back to its
/// owner when the second half is released.
struct Halves {
    owner: Arc<dyn DmaOwner>,
    ptr: NonNull<u8>,
    iova: u64,
    len: usize,
    left: AtomicUsize,
}

// SAFETY: the pointer is only handed back to `owner` (itself Send + Sync) once; nothing reads
// or writes through it here.
unsafe impl Send for Halves {}
// SAFETY: as above; `left` is atomic.
unsafe impl Sync for Halves {}

// SAFETY: each half is released once (by its DmaBuf's drop); the region goes back to the
// original owner, with the values it was handed out with, after both have been.
unsafe impl DmaOwner for Halves {
    fn release(&self, _ptr: NonNull<u8>, _iova: u64, _len: usize) {
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            self.owner.release(self.ptr, self.iova, self.len);
        }
    }

    fn reached_only_in_flight(&self) -> bool {
        self.owner.reached_only_in_flight()
    }

    fn is_part(&self) -> bool {
        true
    }
}

impl fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaBuf")
            .field("ptr", &self.ptr)
            .field("iova", &format_args!("{:#x}", self.iova))
            .field("len", &self.len)
            .finish()
    }
}

/// Ordinary host memory, aligned, for devices that address memory by virtual address (files
/// through the kernel, the simulator). The device address is the virtual address.
///
/// Released buffers are kept for reuse, per size class, up to [`KEEP_BYTES_MAX`] in all: a
/// read or write then costs no allocation and no page faults. Sizes up to 64 KiB round up
/// to a multiple of 4 KiB, larger ones to a power of two; nothing above
/// [`POOLED_BYTES_MAX`] is kept.
pub struct HostMemory {
    align: usize,
    /// Free regions of each class (addresses), see [`class_of`].
    free: Vec<crossbeam::queue::ArrayQueue<usize>>,
    /// Bytes of the regions in `free`.
    kept: AtomicUsize,
}

/// Bytes of released buffers kept at most (per allocator, that is per device): 32 buffers of
/// 4 MiB, so a store serving 16 concurrent 4 MiB writes (each holding a staging copy while
/// the previous round's are still on the device) recycles every buffer. With 32 MiB, 16 such
/// writers faulted in and zeroed fresh memory for about half their buffers: a quarter of the
/// CPU went to `clear_page` and `memset`. The pool only ever holds what was in use at once.
pub const KEEP_BYTES_MAX: usize = 128 << 20;
/// Regions one size class keeps at most.
const KEEP_PER_CLASS_MAX: usize = 256;
/// Largest buffer kept for reuse.
pub const POOLED_BYTES_MAX: usize = 16 << 20;
/// Sizes up to this are classed in steps of [`SMALL_STEP`].
const SMALL_MAX: usize = 64 << 10;
const SMALL_STEP: usize = 4 << 10;
const SMALL_CLASSES: usize = SMALL_MAX / SMALL_STEP;
/// Power-of-two classes above [`SMALL_MAX`] up to [`POOLED_BYTES_MAX`].
const LARGE_CLASSES: usize =
    (POOLED_BYTES_MAX.trailing_zeros() - SMALL_MAX.trailing_zeros()) as usize;

/// Bytes a buffer of class `c` allocates.
fn class_bytes(c: usize) -> usize {
    if c < SMALL_CLASSES {
        (c + 1) * SMALL_STEP
    } else {
        SMALL_MAX << (c - SMALL_CLASSES + 1)
    }
}

/// (class index, bytes the class allocates) of a buffer of `len` bytes, or `None` past
/// [`POOLED_BYTES_MAX`] (allocated exactly, never kept).
fn class_of(len: usize) -> Option<(usize, usize)> {
    let len = len.max(1);
    let c = if len <= SMALL_MAX {
        len.div_ceil(SMALL_STEP) - 1
    } else if len <= POOLED_BYTES_MAX {
        SMALL_CLASSES
            + (len.next_power_of_two().trailing_zeros() - SMALL_MAX.trailing_zeros()) as usize
            - 1
    } else {
        return None;
    };
    Some((c, class_bytes(c)))
}

/// Transparent huge page size (x86-64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// The layout of a `size`-byte region: buffers of a huge page or more are huge-page aligned
/// (and advised as huge pages when allocated), so each 2 MiB of a buffer is physically
/// contiguous and a 4 MiB write reaches the block layer as a few segments instead of 1 024
/// pages, which it would split into several requests (`max_segments`).
fn layout_of(size: usize, align: usize) -> Layout {
    let align = if size >= HUGE_PAGE && size.is_multiple_of(HUGE_PAGE) {
        align.max(HUGE_PAGE)
    } else {
        align
    };
    Layout::from_size_align(size, align).expect("DMA buffer layout")
}

/// Memory for a region of `layout` (non-zero size). Huge-page-aligned regions (2 MiB and
/// more) are mapped from the kernel on their own and advised as huge pages; smaller ones come
/// from the global allocator. Big regions do not come from the C heap because glibc, once
/// it has unmapped a freed region of a size, serves that size from its per-thread arenas from
/// then on and keeps what those free: sixteen writers of 4 MiB objects left 60–110 MiB
/// resident after their store was closed (growing with each store opened and closed), and a
/// benchmark's later phases counted it in their peak.
fn alloc_region(layout: Layout) -> Option<NonNull<u8>> {
    if layout.align() < HUGE_PAGE {
        // SAFETY: layout has a non-zero size.
        return NonNull::new(unsafe { std::alloc::alloc(layout) });
    }
    // Whole huge pages, so every part unmapped below (and at release) is page aligned.
    let size = layout.size().checked_next_multiple_of(HUGE_PAGE)?;
    let span = size.checked_add(layout.align())?;
    // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let base = base as usize;
    let start = base.next_multiple_of(layout.align());
    let (head, tail) = (start - base, base + span - (start + size));
    // SAFETY: the head and tail are parts of the mapping just made, outside the region kept;
    // unmapping them changes nothing else. The hint covers whole huge pages of the region
    // (its start and size are multiples of HUGE_PAGE) and changes no contents.
    unsafe {
        if head > 0 {
            libc::munmap(base as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap((start + size) as *mut libc::c_void, tail);
        }
        libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
    }
    NonNull::new(start as *mut u8)
}

/// Give back a region from [`alloc_region`].
///
/// # Safety
/// `ptr` came from `alloc_region(layout)` with this same layout, and nothing refers to it.
unsafe fn free_region(ptr: NonNull<u8>, layout: Layout) {
    if layout.align() < HUGE_PAGE {
        // SAFETY: the caller's contract: allocated by the global allocator with `layout`.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        return;
    }
    // SAFETY: the caller's contract: the mapping at ptr, `layout.size()` rounded up to whole
    // huge pages as `alloc_region` made it.
    unsafe {
        libc::munmap(
            ptr.as_ptr().cast(),
            layout.size().next_multiple_of(HUGE_PAGE),
        )
    };
}

impl HostMemory {
    /// An allocator handing out memory aligned to `align` bytes (a power of two).
    pub fn new(align: usize) -> Arc<Self> {
        assert!(
            align.is_power_of_two(),
            "alignment {align} is not a power of two"
        );
        let free = (0..SMALL_CLASSES + LARGE_CLASSES)
            .map(|c| {
                crossbeam::queue::ArrayQueue::new(
                    (KEEP_BYTES_MAX / class_bytes(c)).clamp(1, KEEP_PER_CLASS_MAX),
                )
            })
            .collect();
        Arc::new(HostMemory {
            align,
            free,
            kept: AtomicUsize::new(0),
        })
    }

    /// The layout a buffer of `len` bytes is allocated (and deallocated) with.
    fn layout(&self, len: usize) -> Layout {
        let size = class_of(len).map_or(len.max(1), |(_, size)| size);
        layout_of(size, self.align)
    }

    /// Allocate `len` zeroed bytes, every page faulted in: the kernel's non-blocking direct-IO
    /// path (io_uring tries it first) cannot pin a page that is not present, and punts such IO
    /// to a worker thread — slower by a context switch. `alloc_zeroed` may hand out untouched
    /// zero pages, so the zeroing is done here explicitly.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Option<DmaBuf> {
        let (ptr, _) = self.take(len)?;
        // SAFETY: ptr is an allocation of at least `len` bytes that nothing else uses.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Some(self.wrap(ptr, len))
    }

    /// Allocate `len` bytes for a read that overwrites all of them: a recycled buffer keeps
    /// the bytes it last held (initialised memory, never zeroed again); a fresh one is zeroed.
    pub fn alloc_for_read(self: &Arc<Self>, len: usize) -> Option<DmaBuf> {
        let (ptr, fresh) = self.take(len)?;
        if fresh {
            // SAFETY: ptr is a fresh allocation of at least `len` bytes.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        }
        Some(self.wrap(ptr, len))
    }

    /// A recycled region of `len`'s class, or a fresh one (`true`).
    fn take(&self, len: usize) -> Option<(NonNull<u8>, bool)> {
        if let Some((c, size)) = class_of(len) {
            if let Some(addr) = self.free[c].pop() {
                self.kept.fetch_sub(size, Relaxed);
                return NonNull::new(addr as *mut u8).map(|p| (p, false));
            }
        }
        let ptr = alloc_region(self.layout(len))?;
        Some((ptr, true))
    }

    fn wrap(self: &Arc<Self>, ptr: NonNull<u8>, len: usize) -> DmaBuf {
        // SAFETY: an allocation of at least `len` bytes (its class) owned only by this buffer;
        // released to HostMemory::release with the same len, so the same class and layout.
        unsafe { DmaBuf::from_raw_parts(ptr, ptr.as_ptr() as u64, len, self.clone()) }
    }
}

// SAFETY: release deallocates exactly the layout alloc used (the class of `len`), once per
// buffer, or keeps the region for a later buffer of the same class.
unsafe impl DmaOwner for HostMemory {
    fn release(&self, ptr: NonNull<u8>, _iova: u64, len: usize) {
        if let Some((c, size)) = class_of(len) {
            // Reserve the bytes first, so racing releases cannot keep more than the bound.
            if self.kept.fetch_add(size, Relaxed) + size <= KEEP_BYTES_MAX
                && self.free[c].push(ptr.as_ptr() as usize).is_ok()
            {
                return;
            }
            self.kept.fetch_sub(size, Relaxed);
        }
        // SAFETY: ptr was allocated by `take` with this same layout.
        unsafe { free_region(ptr, self.layout(len)) }
    }

    /// The kernel reads or writes a file device's buffer only inside the system call or
    /// io_uring request that holds it, and the simulator only while it holds the request.
    fn reached_only_in_flight(&self) -> bool {
        true
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        for (c, q) in self.free.iter().enumerate() {
            let layout = layout_of(class_bytes(c), self.align);
            while let Some(addr) = q.pop() {
                let Some(ptr) = NonNull::new(addr as *mut u8) else {
                    continue;
                };
                // SAFETY: every kept region was allocated by `take` with its class's layout,
                // and no buffer refers to it any more.
                unsafe { free_region(ptr, layout) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region returned to the pool is handed out again for a read as it is: the same
    /// region, its bytes kept (not zeroed again).
    #[test]
    fn a_released_small_region_keeps_its_bytes() {
        let mem = HostMemory::new(4096);
        let mut b = mem.alloc(4096).unwrap();
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 31 + 7) as u8).collect();
        b.write_at(0, &pattern);
        let at = b.iova();
        drop(b);
        let b = mem.alloc_for_read(4096).unwrap();
        assert_eq!(b.iova(), at, "the pooled region");
        assert!(b.eq_at(0, &pattern));
    }

    /// A split buffer's halves cover the region without overlap, keep its bytes, and the
    /// region goes back to the pool only once both halves are dropped.
    #[test]
    fn a_split_region_goes_back_when_both_halves_have() {
        let mem = HostMemory::new(4096);
        let len = 64 << 10;
        let mut head = mem.alloc(len).unwrap();
        let pattern: Vec<u8> = (0..len as u32).map(|i| (i * 13 + i / 4099) as u8).collect();
        head.write_at(0, &pattern);
        let at = head.iova();
        assert!(!head.is_part());
        let tail = head.split_off(16 << 10);
        assert!(head.is_part() && tail.is_part());
        assert_eq!((head.len(), tail.len()), (16 << 10, 48 << 10));
        assert_eq!(tail.iova(), at + (16 << 10));
        assert!(head.eq_at(0, &pattern[..16 << 10]) && tail.eq_at(0, &pattern[16 << 10..]));
        drop(head);
        let other = mem.alloc_for_read(len).unwrap();
        assert_ne!(other.iova(), at, "the tail still holds the region");
        drop(tail);
        let again = mem.alloc_for_read(len).unwrap();
        assert_eq!(again.iova(), at, "the region back in the pool");
        assert!(again.eq_at(0, &pattern));
        drop(other);
    }

    #[test]
    fn buffers_of_a_huge_page_or_more_are_huge_page_aligned() {
        let mem = HostMemory::new(4096);
        for len in [2 << 20, (2 << 20) + 1, 4 << 20, 16 << 20, 24 << 20] {
            let b = mem.alloc(len).unwrap();
            assert_eq!(
                b.iova() % HUGE_PAGE as u64,
                0,
                "{len} bytes at {:#x}",
                b.iova()
            );
            assert_eq!(b.read_u64_le(len - 8), 0, "zeroed to the end");
        }
        // Smaller classes keep the device's alignment only (no 2 MiB of slack per buffer).
        assert_eq!(layout_of(1 << 20, 4096).align(), 4096);
        assert_eq!(
            layout_of(3 << 20, 4096).align(),
            4096,
            "not a whole number of huge pages"
        );
    }

    #[test]
    fn streaming_copy_writes_every_byte_and_nothing_else() {
        let mem = HostMemory::new(4096);
        let src: Vec<u8> = (0..70_001u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for (offset, len) in [
            (0, 70_001),
            (32, 4096),
            (64, 4097 + 127),
            (0, 4096),
            (5, 9000),
            (0, 100),
        ] {
            let mut buf = mem.alloc(80 << 10).unwrap();
            buf.fill(0, buf.len(), 0xee);
            buf.write_at_streaming(offset, &src[..len]);
            let mut out = vec![0u8; buf.len()];
            buf.read_at(0, &mut out);
            assert!(
                out[..offset].iter().all(|&b| b == 0xee),
                "before, {offset}+{len}"
            );
            assert_eq!(&out[offset..offset + len], &src[..len], "{offset}+{len}");
            assert!(
                out[offset + len..].iter().all(|&b| b == 0xee),
                "after, {offset}+{len}"
            );
        }
    }

    #[test]
    fn classes_cover_every_size_and_buffers_are_reused() {
        for len in [
            1,
            4095,
            4096,
            4097,
            65536,
            65537,
            699_392,
            1 << 20,
            16 << 20,
        ] {
            let (c, size) = class_of(len).unwrap();
            assert!(size >= len, "{len} fits its class");
            assert_eq!(class_bytes(c), size);
            if c > 0 {
                assert!(
                    class_bytes(c - 1) < len,
                    "{len}: the class below is too small"
                );
            }
        }
        assert_eq!(class_of((16 << 20) + 1), None);
        let mem = HostMemory::new(4096);
        let mut a = mem.alloc_for_read(699_392).unwrap();
        a.write_at(0, b"left over");
        let addr = a.as_ptr() as usize;
        drop(a);
        let b = mem.alloc_for_read(600_000).unwrap();
        assert_eq!(
            b.as_ptr() as usize,
            addr,
            "same class: the region is reused"
        );
        assert!(
            b.eq_at(0, b"left over"),
            "a read buffer is not zeroed again"
        );
        drop(b);
        let z = mem.alloc(700_000).unwrap();
        assert_eq!(z.as_ptr() as usize, addr);
        assert_eq!(z.read_u64_le(0), 0, "alloc always zeroes");
        let big = mem.alloc((16 << 20) + 1).unwrap();
        assert_eq!(big.len(), (16 << 20) + 1);
        drop((z, big));
        let many: Vec<DmaBuf> = (0..(KEEP_BYTES_MAX >> 20) + 8)
            .map(|_| mem.alloc_for_read(1 << 20).unwrap())
            .collect();
        drop(many);
        assert!(mem.kept.load(Relaxed) <= KEEP_BYTES_MAX, "the bound holds");
        assert_eq!(mem.kept.load(Relaxed), KEEP_BYTES_MAX);
    }

    #[test]
    fn copy_accessors_round_trip() {
        let mem = HostMemory::new(4096);
        let mut buf = mem.alloc(8192).unwrap();
        assert_eq!(buf.as_ptr() as usize % 4096, 0);
        assert_eq!(buf.read_u64_le(100), 0, "fresh buffers are zeroed");
        buf.write_at(4090, b"hello world");
        let mut out = [0u8; 11];
        buf.read_at(4090, &mut out);
        assert_eq!(&out, b"hello world");
        assert!(buf.eq_at(4090, b"hello world"));
        assert!(!buf.eq_at(4090, b"hello worle"));
        assert_eq!(buf.crc32c(0, 4090, 11), crc32c::crc32c(b"hello world"));
        let seed = crc32c::crc32c(b"seed");
        let mut long = mem.alloc(16384).unwrap();
        let pattern: Vec<u8> = (0..9000u32).map(|i| (i * 31 % 251) as u8).collect();
        long.write_at(100, &pattern);
        assert_eq!(
            long.crc32c(seed, 100, 9000),
            crc32c::crc32c_append(seed, &pattern)
        );
        buf.fill(4090, 5, b'j');
        assert!(buf.eq_at(4090, b"jjjjj world"));
        let mut raw = Vec::with_capacity(11);
        buf.read_into_uninit(4090, &mut raw.spare_capacity_mut()[..11]);
        // SAFETY: the 11 bytes were just copied in.
        unsafe { raw.set_len(11) };
        assert_eq!(raw, b"jjjjj world");
        let mut v = b"abc".to_vec();
        buf.append_to(4090, 11, &mut v);
        buf.append_to(0, 2, &mut v);
        assert_eq!(v, b"abcjjjjj world\0\0");
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_panics() {
        let mem = HostMemory::new(512);
        let buf = mem.alloc(512).unwrap();
        let mut out = [0u8; 2];
        buf.read_at(511, &mut out);
    }
}
