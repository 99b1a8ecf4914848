//! A read allocates nothing of its own once its thread is warm: through a `Reader`, its chunk
//! refs, runs and buffer slots reuse the vectors of finished reads; through `Store::read`
//! (what a node's op threads call), the thread's vectors of its last read; and a one-part
//! result keeps its part and chunk CRC inline (the IO hot path standard). This binary counts
//! every allocation with a global allocator; its one test runs the two paths in turn, so no
//! other test's allocations are counted.

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
fn a_warm_read_allocates_nothing() {
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

    // The synchronous path: one read at a time on the thread's own queue.
    let sync = |n: usize| {
        for i in 0..n {
            let b = s.read(&keys[i % keys.len()], 0, 4096).unwrap();
            assert_eq!(b.len(), 4096);
            assert_eq!(b.chunk_crcs.len(), 1);
            assert_eq!(b.chunk_crcs[0].1, crc32c::crc32c(&d[..4096]));
        }
    };
    sync(256);
    let before = ALLOCS.load(Relaxed);
    sync(4096);
    let per_read = (ALLOCS.load(Relaxed) - before) as f64 / 4096.0;
    eprintln!("{per_read:.2} allocations per synchronous read");
    assert!(
        per_read < 0.5,
        "{per_read:.2} allocations per synchronous 4 KiB read"
    );
}
