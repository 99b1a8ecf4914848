//! nvstore's log-structured object store, generic over the BlockDevice contract.
//!
//! Every node keeps its erasure-coded shards here. Objects are written as chunks into an
//! append-only log of batches; an in-memory index (a lock-free ordered map, and a sharded
//! hash for point lookups) points at the newest state of each object; checkpoints of the
//! index bound restart time; a cleaner relocates live data out of mostly-dead segments. See
//! docs/format.md for the bytes and docs/architecture.md for the flow.
//!
//! # Guarantees
//! * A transaction returns only after it is durable (flush or FUA covers it), and its effects
//!   become visible to readers only then.
//! * After a crash each transaction is fully applied or not at all.
//! * Every read verifies CRC32C; a mismatch is [`StoreError::Corrupted`] naming the device,
//!   byte offset, expected and found CRC — never wrong data.
//! * Restart reads the latest checkpoint and replays only the log written since it.

pub mod bench;
pub mod cache;
mod checkpoint;
mod cleaner;
mod commit;
mod emit;
pub mod error;
pub mod format;
mod index;
pub mod key;
pub mod meta;
mod open;
mod read;
mod reader;
mod scrub;
pub mod space;
pub mod stats;
mod stream;
mod txn;

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam::channel::Sender;
use driver::BlockDevice;

pub use cache::CacheStats;
pub use error::{Result, StoreError};
pub use key::{ObjectKey, NAME_BYTES_MAX, OBJECT_BYTES_MAX, XATTR_BYTES_MAX};
pub use meta::{chunk_digest, content_checksum, ObjectMeta};
pub use open::{
    mkfs, parse_uuid, read_label, Label, MkfsOptions, OpenReport, SalvageKind, Salvaged, Uuid,
};
pub use read::{ObjectStat, Part, ReadBuf};
pub use reader::Reader;
pub use scrub::{CorruptChunk, ScrubReport};
pub use space::SpaceReport;
pub use stats::StatsSnapshot;
pub use txn::{AsyncCommit, Transaction, MAKES_ROOM_BYTES_MAX};

/// Tunables of an open store (the on-disk format fixes block, segment and chunk sizes).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Write a checkpoint after this much log, or after as much log as the last checkpoint
    /// took if that is more (so checkpoints never write more than the log they cover).
    pub checkpoint_interval_bytes: u64,
    /// Largest batch (8 MiB: with the default 8 MiB segments a 4 MiB object then shares a
    /// batch with its neighbours instead of being cut at every 4 MiB batch boundary, whose
    /// remainder is copied into the next batch).
    pub batch_bytes_max: u64,
    /// Most data gathered into one commit round.
    pub round_bytes_max: u64,
    /// DMA staging memory for the commit thread.
    pub staging_bytes: usize,
    /// Run the background cleaner.
    pub cleaner: bool,
    /// Run a background scrub: every `interval` a pass reads and verifies every chunk at
    /// no more than `bytes_per_sec`. `None`: scrub only when asked (`scrub`, `scrub_step`).
    pub scrub: Option<ScrubSchedule>,
    /// Open past acknowledged log batches that fail their checks instead of refusing: apply a
    /// batch whose records check (its bad data items then read as `Corrupted`), skip one whose
    /// header or records do not, and list every such problem in [`Store::salvage_report`].
    /// For stores whose data has redundancy elsewhere (a cluster node); a lone store keeps the
    /// default, which refuses the open rather than lose acknowledged data silently.
    pub salvage: bool,
    /// Bytes of memory for the read cache of small reads ([`cache`]); 0: no cache.
    pub read_cache_bytes: u64,
    /// Each key's partner for [`Transaction::rename`] (`None`: the key has none). It must be
    /// an involution: `alias(a) == Some(b)` exactly when `alias(b) == Some(a)`. A renamed
    /// chunk stays where the key that wrote it put it; the cleaner finds a segment's objects
    /// by the keys that wrote there, so it looks at each one's partner too. `None` here: no
    /// renames.
    pub alias: Option<fn(&ObjectKey) -> Option<ObjectKey>>,
}

/// When and how fast the background scrub runs.
#[derive(Debug, Clone, Copy)]
pub struct ScrubSchedule {
    pub interval: std::time::Duration,
    pub bytes_per_sec: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            checkpoint_interval_bytes: 256 << 20,
            batch_bytes_max: 8 << 20,
            round_bytes_max: 64 << 20,
            staging_bytes: 16 << 20,
            cleaner: true,
            scrub: None,
            salvage: false,
            read_cache_bytes: 0,
            alias: None,
        }
    }
}

pub(crate) use index::Index;

/// CRC-32C of object data (a chunk's crc in its record). `crc-fast` folds with
/// VPCLMULQDQ where the CPU has it: on a 4 MiB write_full the `crc32c` crate's loop was 13 % of
/// the writer threads' CPU. Same values as `crc32c::crc32c` (tested).
#[inline]
pub(crate) fn data_crc(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// What every thread of an open store shares.
pub(crate) struct Shared<D: BlockDevice> {
    pub dev: D,
    pub name: Arc<str>,
    pub layout: stream::Layout,
    pub chunk_bytes: u64,
    pub label: Label,
    pub config: StoreConfig,
    pub index: Index,
    pub segs: Mutex<space::Segments>,
    pub stats: stats::Stats,
    pub read_queues: thread_local::ThreadLocal<RefCell<read::ThreadRead<D::Queue>>>,
    pub spare_queue: Mutex<Option<D::Queue>>,
    /// The last complete background scrub pass.
    pub last_scrub: Mutex<Option<ScrubReport>>,
    /// What a salvage open got past (empty when nothing was damaged).
    pub salvaged: Vec<Salvaged>,
    /// Verified chunks of small reads (`None` with `read_cache_bytes` 0).
    pub cache: Option<cache::ReadCache>,
}

/// An open store on a device. Share it between threads by reference (or `Arc`); every method
/// takes `&self`.
pub struct Store<D: BlockDevice + 'static> {
    sh: Arc<Shared<D>>,
    user_tx: Option<Sender<commit::Msg>>,
    bg_tx: Option<Sender<commit::Msg>>,
    cleaner_stop: Option<Sender<()>>,
    scrub_stop: Option<Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl<D: BlockDevice + 'static> Store<D> {
    /// Open a labelled device. With `cluster`, refuse a device labelled for another cluster.
    pub fn open(
        dev: D,
        cluster: Option<[u8; 16]>,
        config: StoreConfig,
    ) -> Result<(Self, OpenReport)> {
        open::mount(dev, cluster, config)
    }

    pub fn label(&self) -> &Label {
        &self.sh.label
    }

    /// The size of the chunks objects are stored in (each with its own CRC).
    pub fn chunk_bytes(&self) -> u64 {
        self.sh.chunk_bytes
    }

    pub fn device(&self) -> &D {
        &self.sh.dev
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.sh.stats.snapshot()
    }

    /// Switch the read cache on or off at run time (off drops its contents; on again starts
    /// empty). Without `read_cache_bytes` there is no cache and this does nothing; returns
    /// whether there is one.
    pub fn set_read_cache(&self, on: bool) -> bool {
        if let Some(c) = &self.sh.cache {
            c.set_enabled(on);
        }
        self.sh.cache.is_some()
    }

    /// The read cache's counters (all zero without a cache).
    pub fn cache_stats(&self) -> CacheStats {
        self.sh
            .cache
            .as_ref()
            .map_or_else(CacheStats::default, |c| c.stats())
    }

    /// Space accounting: used, free, reclaimable.
    pub fn space(&self) -> SpaceReport {
        let segs = self.sh.segs.lock().unwrap();
        let start = segs.replay_start;
        segs.report(start)
    }

    /// Each segment's state and live bytes, in segment order (the cleaner's view: what it
    /// could reclaim, and where).
    pub fn segments(&self) -> Vec<space::SegmentUsage> {
        let segs = self.sh.segs.lock().unwrap();
        segs.infos
            .iter()
            .enumerate()
            .map(|(i, info)| space::SegmentUsage {
                state: info.state,
                live_bytes: info.live_bytes,
                head: i as u32 == segs.head,
            })
            .collect()
    }

    /// Objects in the index.
    pub fn object_count(&self) -> usize {
        self.sh.index.len()
    }

    /// Approximate bytes the in-memory index spends per object: skip-list node, key and meta,
    /// and the point hash's share (its entries and their tables' empty buckets).
    pub fn index_bytes_per_object(&self) -> f64 {
        let n = self.sh.index.len();
        if n == 0 {
            return 0.0;
        }
        // crossbeam-skiplist node: key + value + refcount + tower (1.33 pointers on average
        // with its p = 1/4 levels, rounded up to 2) + allocator rounding.
        const NODE_OVERHEAD: usize = 48;
        let mut bytes = 0usize;
        for e in self.sh.index.iter() {
            bytes += NODE_OVERHEAD
                + std::mem::size_of::<ObjectKey>()
                + e.key().heap_bytes()
                + 16 // Arc counts
                + e.value().load().heap_bytes();
        }
        (bytes + self.sh.index.point_bytes()) as f64 / n as f64
    }

    /// Force a checkpoint now and wait until it is durable.
    pub fn checkpoint(&self) -> Result<()> {
        let (tx, rx) = crossbeam::channel::bounded(1);
        self.user_tx
            .as_ref()
            .ok_or(StoreError::Closed)?
            .send(commit::Msg::Checkpoint(tx))
            .map_err(|_| StoreError::Closed)?;
        rx.recv().map_err(|_| StoreError::Closed)?
    }

    /// Stop the background threads, finishing an in-progress checkpoint. Dropping the store
    /// does the same.
    pub fn close(mut self) {
        self.stop();
    }

    /// The damage a salvage open ([`StoreConfig::salvage`]) got past: one entry per damaged
    /// data item (its reads return `Corrupted` until rewritten) and per run of skipped log
    /// batches (objects they changed read as their previous state). Empty when the log
    /// replayed clean.
    pub fn salvage_report(&self) -> &[Salvaged] {
        &self.sh.salvaged
    }

    /// The last complete background scrub pass, if one has finished.
    pub fn last_scrub(&self) -> Option<ScrubReport> {
        self.sh.last_scrub.lock().unwrap().clone()
    }

    fn stop(&mut self) {
        self.sh.index.stop_fill();
        self.scrub_stop.take();
        self.cleaner_stop.take();
        self.user_tx.take();
        self.bg_tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl<D: BlockDevice + 'static> Drop for Store<D> {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn data_crc_matches_the_crc32c_crate() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let data: Vec<u8> = (0..(1 << 20) + 4099)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for len in [0, 1, 7, 64, 4095, 4096, 65_537, data.len()] {
            for start in [0, 3] {
                let d = &data[start..len.max(start)];
                assert_eq!(
                    super::data_crc(d),
                    crc32c::crc32c(d),
                    "len {len} start {start}"
                );
            }
        }
    }
}
