//! The read cache (`store/src/cache.rs`) on SimDevice: repeated small reads are served from
//! memory with the right bytes, never with bytes of an older version or of a reused segment
//! (overwrites, removals, the cleaner relocating data and segments taken again under
//! readers), large reads leave it alone, and rot under a cached chunk is still found by
//! uncached reads and by scrub.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use common::*;
use driver::SimDevice;
use nvstore_store::{mkfs, MkfsOptions, Store, StoreConfig, StoreError};
use rand::{Rng, SeedableRng};

fn cached_store(
    capacity_mb: u64,
    segment_bytes: u32,
    cache: u64,
    seed: u64,
) -> (SimDevice, Store<SimDevice>) {
    let dev = sim(capacity_mb, seed);
    mkfs(
        &dev,
        &MkfsOptions {
            segment_bytes,
            ..mkfs_opts()
        },
    )
    .unwrap();
    let config = StoreConfig {
        read_cache_bytes: cache,
        ..StoreConfig::default()
    };
    let (s, _) = Store::open(dev.clone(), Some(FSID), config).unwrap();
    (dev, s)
}

#[test]
fn repeated_small_reads_come_from_memory_with_the_current_bytes() {
    let (dev, s) = cached_store(64, 2 << 20, 4 << 20, 1);
    let names: Vec<String> = (0..50).map(|i| format!("small-{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        s.write_full(&key(n), &data(i as u64, 4096 + i * 100))
            .unwrap();
    }
    // First pass: from the device (and into the cache); second pass: from memory.
    for (i, n) in names.iter().enumerate() {
        assert_eq!(
            s.read_vec(&key(n), 0, u64::MAX).unwrap(),
            data(i as u64, 4096 + i * 100)
        );
    }
    let (reads, st) = (dev.counters().reads, s.cache_stats());
    assert_eq!((st.hits, st.misses, st.inserts), (0, 50, 50), "{st:?}");
    for (i, n) in names.iter().enumerate() {
        let want = data(i as u64, 4096 + i * 100);
        assert_eq!(s.read_vec(&key(n), 0, u64::MAX).unwrap(), want);
        assert_eq!(s.read_vec(&key(n), 100, 1000).unwrap(), want[100..1100]);
        let r = s.read(&key(n), 4000, 1 << 20).unwrap();
        assert_eq!(r.to_vec(), want[4000..]);
        assert_eq!(r.version, s.stat(&key(n)).unwrap().version);
    }
    assert_eq!(
        dev.counters().reads,
        reads,
        "no device read for cached chunks"
    );
    assert_eq!(s.cache_stats().hits, 150);
    assert!(s.cache_stats().bytes > 50 * 4096, "{:?}", s.cache_stats());

    // An overwrite, a partial write, an append and a removal are seen at once.
    let k = key("small-7");
    s.write_full(&k, b"new bytes").unwrap();
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), b"new bytes");
    s.write(&k, 4, b"BYTES").unwrap();
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), b"new BYTES");
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), b"new BYTES", "cached");
    s.append(&k, b"!").unwrap();
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), b"new BYTES!");
    s.remove(&key("small-8")).unwrap();
    assert!(matches!(
        s.read_vec(&key("small-8"), 0, u64::MAX),
        Err(StoreError::NotFound(_))
    ));

    // A sparse object: a hole chunk reads as zeros from the cache path too.
    let sp = key("sparse");
    s.write(&sp, 70_000, b"tail").unwrap();
    let mut want = vec![0u8; 70_004];
    want[70_000..].copy_from_slice(b"tail");
    for _ in 0..2 {
        assert_eq!(s.read_vec(&sp, 60_000, 10_004).unwrap(), want[60_000..]);
    }

    // Large reads neither use nor fill the cache.
    let big = key("big");
    let bd = data(99, 1 << 20);
    s.write_full(&big, &bd).unwrap();
    let before = s.cache_stats();
    for _ in 0..3 {
        assert_eq!(s.read_vec(&big, 0, u64::MAX).unwrap(), bd);
        // Nor do small reads of a large object: each reads a whole 64 KiB chunk for 4 KiB.
        assert_eq!(s.read_vec(&big, 70_000, 4096).unwrap(), bd[70_000..74_096]);
    }
    let after = s.cache_stats();
    assert_eq!((after.hits, after.inserts), (before.hits, before.inserts));

    // Switched off: emptied, and reads go to the device again.
    assert!(s.set_read_cache(false));
    assert_eq!(s.cache_stats().bytes, 0);
    let reads = dev.counters().reads;
    assert_eq!(
        s.read_vec(&key("small-3"), 0, u64::MAX).unwrap(),
        data(3, 4396)
    );
    assert!(dev.counters().reads > reads);
    assert_eq!(s.cache_stats().inserts, after.inserts, "off: not filled");
}

/// `read_if_cached` (for callers that must not block, such as a node's messenger worker)
/// answers only from memory, with the current bytes, and never sends a device command.
#[test]
fn read_if_cached_answers_from_memory_or_not_at_all() {
    let (dev, s) = cached_store(64, 2 << 20, 4 << 20, 3);
    let k = key("probe");
    let want = data(5, 4096);
    s.write_full(&k, &want).unwrap();
    let reads = dev.counters().reads;
    assert!(s.read_if_cached(&k, 0, 4096).is_none(), "not read yet");
    assert!(s.read_if_cached(&key("absent"), 0, 4096).is_none());
    assert_eq!(dev.counters().reads, reads, "no device read");
    assert_eq!(s.read_vec(&k, 0, 4096).unwrap(), want);
    let reads = dev.counters().reads;
    let r = s.read_if_cached(&k, 0, 4096).expect("cached after a read");
    assert_eq!(r.to_vec(), want);
    assert_eq!(r.version, s.stat(&k).unwrap().version);
    assert_eq!(
        s.read_if_cached(&k, 100, 200).unwrap().to_vec(),
        want[100..300]
    );
    assert_eq!(dev.counters().reads, reads, "served from memory");
    // An overwrite's chunk is not cached (writes do not fill it): never the old bytes.
    let new = data(6, 4096);
    s.write_full(&k, &new).unwrap();
    assert!(s.read_if_cached(&k, 0, 4096).is_none());
    assert_eq!(s.read_vec(&k, 0, 4096).unwrap(), new);
    assert_eq!(s.read_if_cached(&k, 0, 4096).unwrap().to_vec(), new);
    s.remove(&k).unwrap();
    assert!(s.read_if_cached(&k, 0, 4096).is_none(), "removed");
    // Large reads never come from the cache.
    let big = key("big");
    s.write_full(&big, &data(7, 1 << 20)).unwrap();
    s.read_vec(&big, 0, u64::MAX).unwrap();
    assert!(s.read_if_cached(&big, 0, 1 << 20).is_none());
    // Switched off: nothing is cached.
    let k2 = key("other");
    s.write_full(&k2, &want).unwrap();
    s.read_vec(&k2, 0, 4096).unwrap();
    assert!(s.read_if_cached(&k2, 0, 4096).is_some());
    s.set_read_cache(false);
    assert!(s.read_if_cached(&k2, 0, 4096).is_none());
}

#[test]
fn a_store_without_a_cache_reads_the_device_every_time() {
    let (dev, s) = cached_store(16, 1 << 20, 0, 2);
    s.write_full(&key("a"), b"abc").unwrap();
    for _ in 0..3 {
        let reads = dev.counters().reads;
        assert_eq!(s.read_vec(&key("a"), 0, u64::MAX).unwrap(), b"abc");
        assert!(dev.counters().reads > reads);
    }
    assert!(!s.set_read_cache(true), "no cache to switch on");
    assert_eq!(s.cache_stats(), Default::default());
}

/// Object `i` at generation `g`: 16 bytes of (i, g), then bytes derived from both. A read
/// that returned another object's bytes, or an older generation than one already seen, is
/// caught by the check.
fn payload(i: u64, g: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&i.to_le_bytes());
    v.extend_from_slice(&g.to_le_bytes());
    v.extend_from_slice(&data(i << 32 | g, len - 16));
    v
}

fn check(i: u64, got: &[u8], len: usize, newest_seen: &mut u64) {
    let gi = u64::from_le_bytes(got[..8].try_into().unwrap());
    let g = u64::from_le_bytes(got[8..16].try_into().unwrap());
    assert_eq!(gi, i, "object {i} returned object {gi}'s bytes");
    assert!(
        g >= *newest_seen,
        "object {i}: generation {g} after {newest_seen}"
    );
    assert_eq!(
        got,
        payload(i, g, len),
        "object {i} generation {g}: bytes differ"
    );
    *newest_seen = g;
}

#[test]
fn churn_with_cleaning_and_segment_reuse_never_serves_stale_bytes() {
    let seed = std::env::var("NVSTORE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("cache churn seed {seed} (NVSTORE_SEED={seed} replays the writer's choices)");
    // 16 MiB in 1 MiB segments, 1 200 objects of 4 KiB (a third of the space live), a cache
    // of 1 MiB (a fifth of them: eviction too), overwritten until 8× the device was written.
    let (_dev, s) = cached_store(16, 1 << 20, 1 << 20, seed);
    const N: u64 = 1200;
    const LEN: usize = 4096;
    let gens: Vec<AtomicU64> = (0..N).map(|_| AtomicU64::new(0)).collect();
    for i in 0..N {
        s.write_full(&key(&format!("o{i}")), &payload(i, 0, LEN))
            .unwrap();
    }
    let stop = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for r in 0..2u64 {
            let (s, stop, reads, gens) = (&s, &stop, &reads, &gens);
            sc.spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (r + 1));
                let mut seen = vec![0u64; N as usize];
                while !stop.load(Relaxed) {
                    // Mostly a small hot set, so the cache hits; sometimes anything.
                    let i = if rng.gen_bool(0.8) {
                        rng.gen_range(0..N / 8)
                    } else {
                        rng.gen_range(0..N)
                    };
                    let got = s.read_vec(&key(&format!("o{i}")), 0, u64::MAX).unwrap();
                    check(i, &got, LEN, &mut seen[i as usize]);
                    assert!(seen[i as usize] <= gens[i as usize].load(Relaxed) + 1);
                    reads.fetch_add(1, Relaxed);
                }
            });
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let capacity = s.space().segments_total * s.space().segment_bytes;
        let mut written = 0u64;
        while written < 8 * capacity {
            let i = if rng.gen_bool(0.5) {
                rng.gen_range(0..N / 8)
            } else {
                rng.gen_range(0..N)
            };
            let g = gens[i as usize].load(Relaxed) + 1;
            s.write_full(&key(&format!("o{i}")), &payload(i, g, LEN))
                .unwrap();
            gens[i as usize].store(g, Relaxed);
            written += LEN as u64;
        }
        stop.store(true, Relaxed);
    });
    for i in 0..N {
        let got = s.read_vec(&key(&format!("o{i}")), 0, u64::MAX).unwrap();
        assert_eq!(
            got,
            payload(i, gens[i as usize].load(Relaxed), LEN),
            "object {i}"
        );
    }
    let (st, cs) = (s.stats(), s.cache_stats());
    eprintln!(
        "{} reads during the churn; cache {cs:?}; {} segments cleaned, {} MiB relocated",
        reads.load(Relaxed),
        st.cleaned_segments,
        st.relocated_bytes >> 20
    );
    assert!(
        st.cleaned_segments > 20,
        "segments were cleaned and taken again"
    );
    assert!(cs.hits > 1000 && cs.misses > 100, "{cs:?}");
    assert!(
        cs.bytes <= 1 << 20,
        "the cache stays within its budget: {cs:?}"
    );
}

#[test]
fn rot_under_a_cached_chunk_is_found_by_uncached_reads_and_scrub() {
    let (dev, s) = cached_store(16, 1 << 20, 1 << 20, 3);
    let k = key("rots");
    let d = data(5, 10_000);
    s.write_full(&k, &d).unwrap();
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), d);
    let off = s.meta(&k).unwrap().chunks[0].offset.get();
    dev.flip_bit(off + 1234, 3);
    // The cached copy was verified when it was read: still the right bytes.
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), d);
    assert_eq!(s.cache_stats().hits, 1);
    // What the medium holds is rotten, and reads that go there say so.
    match s.read_uncached(&k, 0, u64::MAX) {
        Err(StoreError::Corrupted { offset, .. }) => assert_eq!(offset, off),
        r => panic!("expected Corrupted, got {r:?}"),
    }
    let report = s.scrub();
    assert_eq!(report.corrupt.len(), 1, "{report:?}");
    // Switched off and on (emptied): the device copy is all there is.
    s.set_read_cache(false);
    s.set_read_cache(true);
    assert!(matches!(
        s.read_vec(&k, 0, u64::MAX),
        Err(StoreError::Corrupted { .. })
    ));
}
