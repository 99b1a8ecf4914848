//! DMA memory: one arena per controller, mapped into the IOMMU once at open and carved into
//! page-aligned [`DmaBuf`]s by a page bitmap. Nothing is mapped or unmapped per IO.
//!
//! The arena is backed by 2 MiB hugepages when enough are reserved
//! (`/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages`), otherwise by ordinary 4 KiB
//! pages (populated and pinned by VFIO); [`Arena::hugepages`] says which, and the fallback is
//! logged with how to reserve hugepages. IOVAs come from [`IovaSpace`], which leaves an unmapped
//! guard gap after every range so a DMA that runs past a range faults in the IOMMU.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use vfio_ioctls::VfioContainer;

use super::spec::PAGE_BYTES;
use crate::dma::{DmaBuf, DmaOwner};
use crate::error::{Error, Result};

/// Bytes of one hugepage.
pub const HUGEPAGE_BYTES: usize = 2 << 20;
/// First IOVA handed out: above the low 4 GiB, clear of the x86 MSI window (0xfee00000) and of
/// anything a platform reserves low; well inside the 39-bit address width of the smallest
/// Intel IOMMUs.
pub const IOVA_BASE: u64 = 1 << 32;
/// End of the IOVA space used (39-bit IOMMU address width).
pub const IOVA_LIMIT: u64 = 1 << 39;
/// Unmapped IOVA left after every mapped range.
pub const IOVA_GUARD_BYTES: u64 = 2 << 20;
const _: () = assert!(IOVA_BASE < IOVA_LIMIT && IOVA_GUARD_BYTES as usize >= HUGEPAGE_BYTES);

/// A bump allocator of IO virtual addresses with guard gaps. Ranges are never reused: a
/// controller maps a handful of arenas in its life.
#[derive(Debug)]
pub struct IovaSpace {
    next: u64,
    limit: u64,
}

impl Default for IovaSpace {
    fn default() -> Self {
        IovaSpace {
            next: IOVA_BASE,
            limit: IOVA_LIMIT,
        }
    }
}

impl IovaSpace {
    /// Reserve `len` bytes aligned to `align` (a power of two); `None` when the space is used up.
    pub fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        assert!(align.is_power_of_two() && len > 0);
        let start = self.next.checked_add(align - 1)? & !(align - 1);
        let end = start.checked_add(len)?;
        if end > self.limit {
            return None;
        }
        self.next = end + IOVA_GUARD_BYTES;
        Some(start)
    }

    /// An address that is never mapped (inside the guard gap after the last range): DMA to it
    /// must fault in the IOMMU.
    pub fn unmapped_probe(&self) -> u64 {
        self.next - IOVA_GUARD_BYTES / 2
    }
}

/// Which pages of an arena are in use: one bit per 4 KiB page, first fit.
#[derive(Debug)]
pub struct PageBitmap {
    words: Vec<u64>,
    pages: usize,
    used: usize,
}

impl PageBitmap {
    pub fn new(pages: usize) -> Self {
        PageBitmap {
            words: vec![0; pages.div_ceil(64)],
            pages,
            used: 0,
        }
    }

    fn is_set(&self, page: usize) -> bool {
        self.words[page / 64] >> (page % 64) & 1 == 1
    }

    fn set_range(&mut self, first: usize, count: usize, value: bool) {
        for p in first..first + count {
            let (w, b) = (p / 64, p % 64);
            assert_eq!(
                self.words[w] >> b & 1 == 1,
                !value,
                "page {p} double {}",
                if value { "allocation" } else { "free" }
            );
            if value {
                self.words[w] |= 1 << b;
            } else {
                self.words[w] &= !(1 << b);
            }
        }
    }

    /// Find and mark `count` consecutive free pages; returns the first page index.
    pub fn alloc(&mut self, count: usize) -> Option<usize> {
        assert!(count > 0);
        let mut run = 0;
        let mut page = 0;
        while page < self.pages {
            if run == 0 && page % 64 == 0 && self.words[page / 64] == u64::MAX {
                page += 64; // a full word: skip it whole
                continue;
            }
            if self.is_set(page) {
                run = 0;
            } else {
                run += 1;
                if run == count {
                    let first = page + 1 - count;
                    self.set_range(first, count, true);
                    self.used += count;
                    return Some(first);
                }
            }
            page += 1;
        }
        None
    }

    /// Mark `count` pages from `first` free. Panics on a double free.
    pub fn free(&mut self, first: usize, count: usize) {
        self.set_range(first, count, false);
        self.used -= count;
    }

    pub fn used_pages(&self) -> usize {
        self.used
    }
}

struct ArenaInner {
    name: Arc<str>,
    container: Arc<VfioContainer>,
    ptr: NonNull<u8>,
    len: usize,
    iova: u64,
    hugepages: bool,
    pages: Mutex<PageBitmap>,
}

// SAFETY: the arena's memory is reached only through raw pointers handed out as DmaBufs (each
// the exclusive owner of its pages); the bitmap is behind a Mutex.
unsafe impl Send for ArenaInner {}
// SAFETY: as above.
unsafe impl Sync for ArenaInner {}

// SAFETY: release returns exactly the pages alloc handed out for (ptr, len), once per DmaBuf;
// alloc never hands out pages that are marked used.
unsafe impl DmaOwner for ArenaInner {
    fn release(&self, ptr: NonNull<u8>, _iova: u64, len: usize) {
        let first = (ptr.as_ptr() as usize - self.ptr.as_ptr() as usize) / PAGE_BYTES;
        self.pages
            .lock()
            .expect("arena lock")
            .free(first, len.max(1).div_ceil(PAGE_BYTES));
    }
}

impl Drop for ArenaInner {
    fn drop(&mut self) {
        // Unmap exactly the range mapped. Every DmaBuf holds an Arc to us, so none is alive.
        if let Err(e) = self.container.vfio_dma_unmap(self.iova, self.len) {
            tracing::warn!(device = %self.name, "VFIO DMA unmap of the arena failed: {e}");
        }
        // SAFETY: ptr/len are what mmap returned; the IOMMU mapping is gone and no DmaBuf exists.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// DMA memory of one controller.
#[derive(Clone)]
pub struct Arena {
    inner: Arc<ArenaInner>,
}

impl Arena {
    /// Map `len` bytes (rounded up to 2 MiB) for the device behind `container`, at an IOVA
    /// from `iovas`. Tries hugepages first.
    pub fn map(
        name: &Arc<str>,
        container: &Arc<VfioContainer>,
        iovas: &mut IovaSpace,
        len: usize,
    ) -> Result<Self> {
        let len = Self::mapped_len(len);
        check_memlock(name, len)?;
        let (ptr, hugepages) = alloc_memory(name, len)?;
        let no_iova = || Error::NoMemory {
            device: name.clone(),
            len,
            detail: "the IOVA space is used up".into(),
        };
        let iova = iovas
            .alloc(len as u64, HUGEPAGE_BYTES as u64)
            .ok_or_else(no_iova)?;
        // SAFETY: ptr..ptr+len is a fresh anonymous mapping owned by the arena and never
        // referenced by Rust: it is reached only through raw pointers (DmaBuf copy accessors and
        // volatile queue accesses). It stays mapped until ArenaInner::drop unmaps the IOVA first.
        if let Err(e) = unsafe { container.vfio_dma_map(iova, len, ptr.as_ptr()) } {
            // SAFETY: undo the mmap above; nothing else saw it.
            unsafe { libc::munmap(ptr.as_ptr() as *mut libc::c_void, len) };
            return Err(Error::NoMemory {
                device: name.clone(),
                len,
                detail: format!(
                    "VFIO DMA map failed: {e} (is RLIMIT_MEMLOCK at least {} KiB? see `ulimit -l`)",
                    len / 1024
                ),
            });
        }
        if !hugepages {
            tracing::warn!(
                device = %name,
                "DMA arena of {} MiB uses 4 KiB pages: no 2 MiB hugepages reserved (reserve \
                 them with `echo N > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages`)",
                len >> 20
            );
        }
        Ok(Arena {
            inner: Arc::new(ArenaInner {
                name: name.clone(),
                container: container.clone(),
                ptr,
                len,
                iova,
                hugepages,
                pages: Mutex::new(PageBitmap::new(len / PAGE_BYTES)),
            }),
        })
    }

    /// Bytes actually mapped for a requested arena of `len` bytes (whole 2 MiB units).
    pub fn mapped_len(len: usize) -> usize {
        len.max(1).next_multiple_of(HUGEPAGE_BYTES)
    }

    /// True when backed by 2 MiB hugepages, false for 4 KiB pages.
    pub fn hugepages(&self) -> bool {
        self.inner.hugepages
    }

    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// (first IOVA, length) of the mapping.
    pub fn iova_range(&self) -> (u64, usize) {
        (self.inner.iova, self.inner.len)
    }

    /// Bytes handed out now.
    pub fn used_bytes(&self) -> usize {
        self.inner.pages.lock().expect("arena lock").used_pages() * PAGE_BYTES
    }

    /// A zeroed, page-aligned buffer of `len` bytes.
    pub fn alloc(&self, len: usize) -> Result<DmaBuf> {
        let pages = len.max(1).div_ceil(PAGE_BYTES);
        let first = self
            .inner
            .pages
            .lock()
            .expect("arena lock")
            .alloc(pages)
            .ok_or_else(|| Error::NoMemory {
                device: self.inner.name.clone(),
                len,
                detail: format!(
                    "the {} MiB DMA arena has no {pages} free consecutive pages ({} MiB in \
                     use); raise NvmeOptions::arena_bytes",
                    self.inner.len >> 20,
                    self.used_bytes() >> 20
                ),
            })?;
        let offset = first * PAGE_BYTES;
        // SAFETY: first..first+pages is inside the arena (the bitmap covers exactly len bytes).
        let ptr = unsafe { self.inner.ptr.as_ptr().add(offset) };
        // SAFETY: the pages were free, so no DmaBuf and no in-flight command uses them; zeroing
        // through a raw pointer forms no reference.
        unsafe { std::ptr::write_bytes(ptr, 0, pages * PAGE_BYTES) };
        let owner: Arc<dyn DmaOwner> = self.inner.clone();
        // SAFETY: the range is exclusively ours until release (bitmap marked used); the device
        // sees it at iova + offset through the mapping made in Arena::map.
        Ok(unsafe {
            DmaBuf::from_raw_parts(
                NonNull::new(ptr).expect("arena pointer"),
                self.inner.iova + offset as u64,
                len,
                owner,
            )
        })
    }
}

fn alloc_memory(name: &Arc<str>, len: usize) -> Result<(NonNull<u8>, bool)> {
    let free_huge =
        std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(0);
    let base = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
    let attempts: &[(libc::c_int, bool)] = if free_huge >= len / HUGEPAGE_BYTES {
        &[(base | libc::MAP_HUGETLB, true), (base, false)]
    } else {
        &[(base, false)]
    };
    for &(flags, huge) in attempts {
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            return Ok((
                NonNull::new(p as *mut u8).expect("mmap returned null"),
                huge,
            ));
        }
    }
    Err(Error::NoMemory {
        device: name.clone(),
        len,
        detail: format!("mmap failed: {}", std::io::Error::last_os_error()),
    })
}

/// Pinned DMA memory counts against RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK. Fail
/// early with the size needed instead of letting the VFIO map fail with a bare ENOMEM.
pub fn check_memlock(name: &Arc<str>, len: usize) -> Result<()> {
    if has_cap_ipc_lock() {
        return Ok(());
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a pointer to a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Ok(()); // cannot tell: let the map report
    }
    if lim.rlim_cur != libc::RLIM_INFINITY && (lim.rlim_cur as u128) < len as u128 {
        return Err(Error::Setup {
            device: name.clone(),
            problem: format!(
                "RLIMIT_MEMLOCK is {} KiB but the DMA arena needs {} KiB pinned",
                lim.rlim_cur / 1024,
                len / 1024
            ),
            fix: format!(
                "`ulimit -l {}` (or `memlock` in /etc/security/limits.conf), or run as root",
                len / 1024 + 1024
            ),
        });
    }
    Ok(())
}

/// CAP_IPC_LOCK (bit 14) in the effective capability set, from /proc/self/status.
fn has_cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps >> 14 & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_first_fit_and_free() {
        let mut b = PageBitmap::new(200);
        assert_eq!(b.alloc(1), Some(0));
        assert_eq!(b.alloc(64), Some(1));
        assert_eq!(b.alloc(3), Some(65));
        b.free(1, 64);
        assert_eq!(b.used_pages(), 4);
        // the hole fits 64 again, and smaller runs take its start
        assert_eq!(b.alloc(10), Some(1));
        assert_eq!(b.alloc(54), Some(11));
        assert_eq!(b.alloc(200), None, "no run that long");
        assert_eq!(b.alloc(132), Some(68));
        assert_eq!(b.alloc(1), None, "full");
        assert_eq!(b.used_pages(), 200);
    }

    #[test]
    fn bitmap_skips_full_words() {
        let mut b = PageBitmap::new(256);
        assert_eq!(b.alloc(128), Some(0));
        assert_eq!(b.alloc(2), Some(128));
        b.free(0, 128);
        assert_eq!(b.alloc(100), Some(0));
        assert_eq!(b.alloc(40), Some(130));
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn bitmap_double_free_panics() {
        let mut b = PageBitmap::new(8);
        let p = b.alloc(2).unwrap();
        b.free(p, 2);
        b.free(p, 2);
    }

    #[test]
    fn iova_ranges_are_aligned_with_guards() {
        let mut s = IovaSpace::default();
        let a = s.alloc(4096, 4096).unwrap();
        assert_eq!(a, IOVA_BASE);
        let probe = s.unmapped_probe();
        assert!(probe >= a + 4096);
        let b = s
            .alloc(HUGEPAGE_BYTES as u64, HUGEPAGE_BYTES as u64)
            .unwrap();
        assert_eq!(b % HUGEPAGE_BYTES as u64, 0);
        assert!(
            b >= a + 4096 + IOVA_GUARD_BYTES,
            "guard gap after each range"
        );
        assert!(
            probe < b,
            "the probe address lies in the gap, not in the next range"
        );
        let mut tiny = IovaSpace {
            next: IOVA_LIMIT - 8192,
            limit: IOVA_LIMIT,
        };
        assert!(tiny.alloc(16384, 4096).is_none());
    }
}
