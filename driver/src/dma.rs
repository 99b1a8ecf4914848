//! DMA buffers: memory a device may read or write, reached only through copy accessors.
//!
//! A [`DmaBuf`] carries (virtual address, device address, length). It never hands out a Rust
//! reference to its memory: while a command is in flight the device may write it, and a `&[u8]`
//! over memory that changes underneath is undefined behaviour. Ownership of the buffer moves into
//! the queue with the request and comes back with the completion, so the holder of a `DmaBuf`
//! is the only party touching it — but the accessors still copy, so a misbehaving device cannot
//! turn into unsoundness in safe code.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// Who hands a region back when a [`DmaBuf`] is dropped.
///
/// # Safety
/// `release` receives exactly the (ptr, iova, len) a buffer was created with, once. Implementors
/// must not reuse the region until `release` is called.
pub unsafe trait DmaOwner: Send + Sync {
    /// Take a region back.
    fn release(&self, ptr: NonNull<u8>, iova: u64, len: usize);
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

    /// CRC32C (Castagnoli) of `len` bytes at `offset`, continuing from `seed`.
    /// Reads through a small stack buffer, so no reference into the region is formed.
    pub fn crc32c(&self, seed: u32, offset: usize, len: usize) -> u32 {
        self.check(offset, len);
        let mut chunk = [0u8; 4096];
        let mut crc = seed;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(chunk.len());
            self.read_at(offset + done, &mut chunk[..n]);
            crc = crc32c::crc32c_append(crc, &chunk[..n]);
            done += n;
        }
        crc
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        self.owner.release(self.ptr, self.iova, self.len);
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
pub struct HostMemory {
    align: usize,
}

impl HostMemory {
    /// An allocator handing out memory aligned to `align` bytes (a power of two).
    pub fn new(align: usize) -> Arc<Self> {
        assert!(
            align.is_power_of_two(),
            "alignment {align} is not a power of two"
        );
        Arc::new(HostMemory { align })
    }

    fn layout(&self, len: usize) -> Layout {
        Layout::from_size_align(len.max(1), self.align).expect("DMA buffer layout")
    }

    /// Allocate `len` zeroed bytes, every page faulted in: the kernel's non-blocking direct-IO
    /// path (io_uring tries it first) cannot pin a page that is not present, and punts such IO
    /// to a worker thread — slower by a context switch. `alloc_zeroed` may hand out untouched
    /// zero pages, so the zeroing is done here explicitly.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Option<DmaBuf> {
        let layout = self.layout(len);
        // SAFETY: layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) })?;
        // SAFETY: ptr is a fresh allocation of layout.size() bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, layout.size()) };
        // SAFETY: a fresh allocation of `len` bytes owned only by this buffer; released to
        // HostMemory::release with the same layout.
        Some(unsafe { DmaBuf::from_raw_parts(ptr, ptr.as_ptr() as u64, len, self.clone()) })
    }
}

// SAFETY: release deallocates exactly the layout alloc used, once per buffer.
unsafe impl DmaOwner for HostMemory {
    fn release(&self, ptr: NonNull<u8>, _iova: u64, len: usize) {
        // SAFETY: ptr was returned by alloc_zeroed with this same layout.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), self.layout(len)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        buf.fill(4090, 5, b'j');
        assert!(buf.eq_at(4090, b"jjjjj world"));
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
