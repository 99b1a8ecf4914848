//! A read through a thread's `Reader` allocates nothing of its own once the reader is warm:
//! its chunk refs, runs and buffer slots reuse the vectors of finished reads, and a one-part
//! result keeps its part and chunk CRC inline. (The IO hot path standard: a node's op threads
//! serve reads through readers.) This binary counts every allocation with a global allocator.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use common::*;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    // SAFETY: `GlobalAlloc::alloc`'s contract, which the caller keeps and the body passes
    // on to `System` unchanged.
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: the caller upholds `alloc`'s contract, which we pass on.
        unsafe { System.alloc(l) }
    }
    // SAFETY: `GlobalAlloc::dealloc`'s contract, passed on to `System` unchanged.
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System.alloc` with `l` (above).
        unsafe { System.dealloc(p, l) }
    }
    // SAFETY: `GlobalAlloc::realloc`'s contract, passed on to `System` unchanged.
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: as `dealloc` and `alloc`.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[test]
fn a_warm_reader_allocates_nothing_per_read() {
    // A file device, as a node's: the simulated device copies each read through a vector.
    // /var/tmp, not /tmp: tmpfs refuses O_DIRECT.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let dev = driver::FileDevice::create(
        &dir.path().join("d.img"),
        64 << 20,
        driver::FileOptions::default(),
    )
    .unwrap();
    nvstore_store::mkfs(&dev, &mkfs_opts()).unwrap();
    let (s, _) =
        nvstore_store::Store::open(dev, Some(FSID), nvstore_store::StoreConfig::default()).unwrap();
    let d = data(96, 4096);
    let keys: Vec<_> = (0..64).map(|i| key(&format!("o{i}"))).collect();
    for k in &keys {
        s.write_full(k, &d).unwrap();
    }
    let mut r = s.reader().unwrap();
    let mut out = Vec::with_capacity(64);
    let mut read = |n: usize| {
        for i in 0..n {
            r.submit(&keys[i % keys.len()], 0, 4096, i as u64).unwrap();
            if r.in_flight() >= 16 {
                r.poll(&mut out, true).unwrap();
            }
            for (_, res) in out.drain(..) {
                let b = res.unwrap();
                assert_eq!(b.len(), 4096);
                assert_eq!(b.chunk_crcs.len(), 1);
            }
        }
        while r.in_flight() > 0 {
            r.poll(&mut out, true).unwrap();
            out.clear();
        }
    };
    read(256);
    let before = ALLOCS.load(Relaxed);
    read(4096);
    let per_read = (ALLOCS.load(Relaxed) - before) as f64 / 4096.0;
    eprintln!("{per_read:.2} allocations per read");
    assert!(per_read < 0.5, "{per_read:.2} allocations per 4 KiB read");
}
