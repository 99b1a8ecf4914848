//! The read cache: verified chunks of small reads, kept in memory so a re-read needs no
//! device command.
//!
//! **What.** A read of at most [`ADMIT_READ_BYTES`] through [`Store::read`](crate::Store::read)
//! that had to go to the device keeps copies of the chunks it read (each at most
//! [`ADMIT_CHUNK_BYTES`], after its crc32c checked; only if they are not much more than
//! what it asked for, [`ADMIT_WASTE_FACTOR`]), up to `StoreConfig::read_cache_bytes` in
//! all; a later read whose chunks are all cached is served from memory. Large reads neither
//! use nor fill it (they would only push out the small ones, and the copy would cost more than
//! it saves). Writes do not fill it. Eviction is quick_cache's S3-FIFO by bytes: a chunk read
//! once waits in a small probation queue, so a scan of many small reads does not push out
//! the chunks that are read again.
//!
//! **Why it cannot serve stale bytes.** An entry is keyed by the chunk's device offset and
//! records the chunk's length and crc32c and the *reuse generation* of its segment: a segment's
//! generation goes up each time the segment is taken for new writes
//! ([`Segments::alloc`](crate::space::Segments::alloc)). A lookup uses the chunk reference of
//! the index entry it just read and the segment's current generation, and hits only when
//! offset, generation, length and crc all match. Data at a given offset never changes within
//! one generation (the log is append-only and a segment is rewritten only after it is taken
//! again), so a hit returns exactly the bytes the device holds for that reference. An entry is
//! added only if, after the device read, the object's index entry is still the one the read
//! used: its chunks were live throughout, so their segment was not taken again in between and
//! the generation sampled before the read is theirs.
//!
//! **What it does not see.** Bytes that rot on the medium after they were cached: a cached
//! read returns the good copy. Scrubs and repairs read with [`Store::read_uncached`](
//! crate::Store::read_uncached), which always goes to the device.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::format::ChunkRef;

/// Reads longer than this neither use nor fill the cache.
pub const ADMIT_READ_BYTES: u64 = 64 << 10;
/// Chunks longer than this are never cached.
pub const ADMIT_CHUNK_BYTES: u32 = 64 << 10;
/// A read fills the cache only if the chunks it read are at most this many times the bytes
/// it asked for (or [`ADMIT_SMALL_BYTES`], whichever is more): a 4 KiB read of a 4 KiB object
/// is kept, a 4 KiB read at a random offset of a large object (one 64 KiB chunk read) is not
/// — random small reads over a large data set would otherwise copy 16× their bytes into a
/// cache they rarely hit.
pub const ADMIT_WASTE_FACTOR: u64 = 2;
pub const ADMIT_SMALL_BYTES: u64 = 4096;

/// One cached chunk.
#[derive(Debug)]
pub struct Cached {
    gen: u32,
    crc: u32,
    data: Box<[u8]>,
}

impl Cached {
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

#[derive(Clone)]
struct ByLen;

impl quick_cache::Weighter<u64, Arc<Cached>> for ByLen {
    fn weight(&self, _key: &u64, val: &Arc<Cached>) -> u64 {
        // The entry's own bookkeeping counts too, so a cache of tiny chunks stays bounded.
        val.data.len() as u64 + 64
    }
}

/// Counters the store reports.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Reads served from memory.
    pub hits: u64,
    /// Cacheable reads that went to the device (and filled the cache).
    pub misses: u64,
    /// Chunks added.
    pub inserts: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// The configured limit.
    pub capacity: u64,
}

pub(crate) struct ReadCache {
    map: quick_cache::sync::Cache<u64, Arc<Cached>, ByLen>,
    /// Per segment: how often it was taken for new writes (shared with `Segments`).
    gens: Arc<[AtomicU32]>,
    capacity: u64,
    /// Switched off at run time ([`crate::Store::set_read_cache`]): neither used nor filled.
    enabled: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
    inserts: AtomicU64,
}

impl ReadCache {
    pub fn new(capacity: u64, gens: Arc<[AtomicU32]>) -> ReadCache {
        // quick_cache sizes its tables from an item estimate: assume 4 KiB chunks.
        let items = (capacity / 4096).clamp(16, 1 << 22) as usize;
        ReadCache {
            map: quick_cache::sync::Cache::with_weighter(items, capacity, ByLen),
            gens,
            capacity,
            enabled: AtomicBool::new(true),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            inserts: AtomicU64::new(0),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Switch the cache on or off; off also drops what it holds.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
        if !on {
            self.map.clear();
        }
    }

    /// The current reuse generation of `seg`.
    pub fn gen(&self, seg: u32) -> u32 {
        self.gens[seg as usize].load(Ordering::Acquire)
    }

    /// The cached bytes of chunk `r` (in segment `seg`), if they are there.
    pub fn get(&self, r: &ChunkRef, seg: u32) -> Option<Arc<Cached>> {
        let c = self.map.get(&r.offset.get())?;
        (c.gen == self.gen(seg) && c.crc == r.crc.get() && c.data.len() == r.len.get() as usize)
            .then_some(c)
    }

    /// Keep a verified copy of chunk `r`, read while its segment was at generation `gen`.
    pub fn insert(&self, r: &ChunkRef, gen: u32, data: Vec<u8>) {
        debug_assert_eq!(data.len(), r.len.get() as usize);
        self.map.insert(
            r.offset.get(),
            Arc::new(Cached {
                gen,
                crc: r.crc.get(),
                data: data.into_boxed_slice(),
            }),
        );
        self.inserts.fetch_add(1, Ordering::Relaxed);
    }

    pub fn hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
    }

    pub fn miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            inserts: self.inserts.load(Ordering::Relaxed),
            bytes: self.map.weight(),
            capacity: if self.enabled() { self.capacity } else { 0 },
        }
    }
}

/// A fresh generation table for `count` segments.
pub(crate) fn generations(count: u32) -> Arc<[AtomicU32]> {
    (0..count).map(|_| AtomicU32::new(0)).collect()
}
