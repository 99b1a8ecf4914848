//! The in-memory index: where each object's newest state is.
//!
//! Two structures hold the same states, both written only by one thread (the commit thread;
//! at open, the replay):
//! * an **ordered** lock-free skip list, for what walks keys in order: `list`, checkpoints,
//!   scrub, the space accounting at open;
//! * a **point** hash, for what looks one key up: every read, the commit's checks, the
//!   cleaner, scrub. A skip-list search visits a node or two per level (p = 1/4), each a
//!   cache miss and a key comparison: at 200 k objects it was 25 % of a 4 KiB reader
//!   thread's CPU, at 600 k ~9 % of the commit thread's, and it deepens as objects are added.
//!   A hash lookup is two or three misses.
//!
//! The point hash does not store the key (that would cost the key's size again per object):
//! an entry is a 128-bit keyed hash of the key and the state, 24 bytes plus a control byte.
//! The 128 bits are two SipHash-1-3 functions with independent random keys drawn when the
//! index is made, so equal hashes for different keys are a 2^-128 event per pair (about
//! 10^-25 over the lifetime of a store of 10 M objects) and cannot be aimed at: the keys are
//! never shown. See [`Index::point_bytes`] for what it costs.
//!
//! The point hash is split into [`SHARDS`] shards, each behind its own lock: a reader takes
//! one shard's read lock for one lookup (no lock shared by all reads), and a shard that grows
//! rehashes ~1/256 of the objects.
//!
//! **Built after open, beside the serving store.** Open loads the checkpoint and replays the
//! log into the ordered view only (filling the hash there cost a restart of 1 M objects
//! 0.4 s more, 0.90–0.96 s against its 1 s goal). Once open, [`Index::go_live`] has the
//! writer keep both views and the `store-index` thread [`fill`](Index::fill)s the hash from
//! the ordered view; lookups use the ordered view until it is done. The filler takes a
//! shard's lock for each entry it adds, checks the entry is still in the ordered view and
//! adds it only where the writer has not: the writer changes the ordered view first, then the
//! hash under the same lock, so whichever of the two comes second leaves the newest state
//! (or none, for a removed key). Every key the filler's walk misses was added or changed
//! by the writer during it, which puts it in the hash itself.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::ops::RangeBounds;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use arc_swap::ArcSwap;
use crossbeam::utils::CachePadded;
use crossbeam_skiplist::{map, SkipMap};

use crate::key::ObjectKey;
use crate::meta::ObjectMeta;

/// Shards of the point hash (a power of two).
const SHARDS: usize = 256;

/// An object's identity in the point hash: two independent 64-bit keyed hashes of its key.
#[derive(Clone, Copy, PartialEq, Eq)]
struct PointKey {
    lo: u64,
    hi: u64,
}

impl Hash for PointKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Already a random hash: the table takes it as is.
        state.write_u64(self.lo);
    }
}

/// The identity hasher for [`PointKey`] (its `lo` is already uniformly random).
#[derive(Default)]
struct Passthrough(u64);

impl Hasher for Passthrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("PointKey hashes as one u64")
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Shard = HashMap<PointKey, Arc<ObjectMeta>, BuildHasherDefault<Passthrough>>;

/// Ordered (skip list) and point (hash) views of the same object states.
pub(crate) struct Index {
    /// Entries are updated in place (an `ArcSwap`), never replaced: crossbeam-skiplist 0.1.3
    /// (the newest release) replaces an existing key's entry in two steps (its issue #1023),
    /// and a range scan in between misses the key; an entry that is never replaced has no
    /// such moment.
    ordered: SkipMap<ObjectKey, ArcSwap<ObjectMeta>>,
    hash_keys: (RandomState, RandomState),
    shards: Box<[CachePadded<RwLock<Shard>>]>,
    /// The writer keeps the hash as well as the ordered view ([`Index::go_live`]).
    live: AtomicBool,
    /// The hash holds every object: lookups use it.
    ready: AtomicBool,
    /// The store is closing: a fill in progress gives up.
    stop: AtomicBool,
}

impl Index {
    pub(crate) fn new() -> Index {
        Index {
            ordered: SkipMap::new(),
            hash_keys: (RandomState::new(), RandomState::new()),
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(RwLock::new(Shard::default())))
                .collect(),
            live: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        }
    }

    /// From now on the writer keeps the hash too; then [`fill`](Self::fill) may run.
    pub(crate) fn go_live(&self) {
        self.live.store(true, Ordering::Release);
    }

    /// Add every object of the ordered view to the hash (see the module's docs for why this
    /// may run beside the writer), then have lookups use it. Returns whether it finished
    /// (false when [`stop_fill`](Self::stop_fill) came first).
    pub(crate) fn fill(&self) -> bool {
        self.fill_with(|_| {})
    }

    /// [`fill`](Self::fill), calling `between` with each entry's key after taking it from the
    /// walk and before adding it (tests put the writer's interleavings there).
    fn fill_with(&self, mut between: impl FnMut(&ObjectKey)) -> bool {
        assert!(self.live.load(Ordering::Acquire), "fill before go_live");
        let per = self.ordered.len().div_ceil(SHARDS);
        for s in self.shards.iter() {
            s.write()
                .unwrap_or_else(PoisonError::into_inner)
                .reserve(per);
        }
        for (n, e) in self.ordered.iter().enumerate() {
            if n % 4096 == 0 && self.stop.load(Ordering::Relaxed) {
                return false;
            }
            between(e.key());
            let pk = self.point_key(e.key());
            let mut shard = self
                .shard(&pk)
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            // Under the lock: the writer removes from the ordered view before the hash, and
            // sets the hash after the ordered view.
            if !e.is_removed() {
                shard.entry(pk).or_insert_with(|| e.value().load_full());
            }
        }
        self.ready.store(true, Ordering::Release);
        true
    }

    /// Make a fill in progress give up (the store is closing).
    pub(crate) fn stop_fill(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Whether lookups use the hash.
    pub(crate) fn point_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    fn point_key(&self, key: &ObjectKey) -> PointKey {
        PointKey {
            lo: self.hash_keys.0.hash_one(key),
            hi: self.hash_keys.1.hash_one(key),
        }
    }

    /// The shard of `pk`: bits of `hi`, so the bits the shard's table uses (`lo`'s low bits
    /// pick the bucket, its top seven the control byte) stay random within a shard.
    fn shard(&self, pk: &PointKey) -> &RwLock<Shard> {
        &self.shards[(pk.hi as usize) & (SHARDS - 1)]
    }

    /// The newest state of `key`.
    pub(crate) fn get(&self, key: &ObjectKey) -> Option<Arc<ObjectMeta>> {
        self.lookup(key, |m| m.clone())
    }

    /// The op sequence of `key`'s newest state.
    pub(crate) fn state_seq(&self, key: &ObjectKey) -> Option<u64> {
        self.lookup(key, |m| m.state_seq)
    }

    /// `f` of `key`'s newest state: from the hash once it is filled, else the ordered view.
    fn lookup<T>(&self, key: &ObjectKey, f: impl FnOnce(&Arc<ObjectMeta>) -> T) -> Option<T> {
        if !self.point_ready() {
            return self.ordered.get(key).map(|e| f(&e.value().load()));
        }
        let pk = self.point_key(key);
        let shard = self
            .shard(&pk)
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        shard.get(&pk).map(f)
    }

    /// Set `key`'s state; returns the state it replaced. In the ordered view the entry is
    /// updated in place when it exists (a scan sees the old or the new state, never none),
    /// one search whether the key is new or not (most keys a commit round sets are new).
    /// Only one thread writes an index.
    pub(crate) fn put(&self, key: &ObjectKey, meta: Arc<ObjectMeta>) -> Option<Arc<ObjectMeta>> {
        let e = self
            .ordered
            .get_or_insert_with(key.clone(), || ArcSwap::new(meta.clone()));
        let old = if Arc::ptr_eq(&e.value().load(), &meta) {
            None
        } else {
            Some(e.value().swap(meta.clone()))
        };
        drop(e);
        self.point_write(key, |shard, pk| drop(shard.insert(pk, meta)));
        old
    }

    /// Remove `key`; returns the state it had.
    pub(crate) fn remove(&self, key: &ObjectKey) -> Option<Arc<ObjectMeta>> {
        let old = self.ordered.remove(key).map(|e| e.value().load_full());
        self.point_write(key, |shard, pk| drop(shard.remove(&pk)));
        old
    }

    /// Once live, `f` on `key`'s shard of the hash, locked for writing (after the ordered
    /// view changed: see the module's docs).
    fn point_write(&self, key: &ObjectKey, f: impl FnOnce(&mut Shard, PointKey)) {
        if self.live.load(Ordering::Relaxed) {
            let pk = self.point_key(key);
            let mut shard = self
                .shard(&pk)
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            f(&mut shard, pk);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.ordered.len()
    }

    /// Every entry in key order.
    pub(crate) fn iter(&self) -> map::Iter<'_, ObjectKey, ArcSwap<ObjectMeta>> {
        self.ordered.iter()
    }

    /// The entries in `range`, in key order.
    pub(crate) fn range<R: RangeBounds<ObjectKey>>(
        &self,
        range: R,
    ) -> map::Range<'_, ObjectKey, R, ObjectKey, ArcSwap<ObjectMeta>> {
        self.ordered.range(range)
    }

    /// Bytes the point hash holds: per bucket an entry and a control byte (a table holds up
    /// to 7/8 of its buckets, which are a power of two).
    pub(crate) fn point_bytes(&self) -> usize {
        const ENTRY: usize = std::mem::size_of::<(PointKey, Arc<ObjectMeta>)>() + 1;
        self.shards
            .iter()
            .map(|s| {
                let cap = s.read().unwrap_or_else(PoisonError::into_inner).capacity();
                let buckets = if cap == 0 {
                    0
                } else {
                    (cap * 8 / 7).next_power_of_two()
                };
                buckets * ENTRY + std::mem::size_of::<CachePadded<RwLock<Shard>>>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(seq: u64) -> Arc<ObjectMeta> {
        Arc::new(ObjectMeta {
            version: seq,
            state_seq: seq,
            size: 0,
            mtime_unix_ns: 0,
            data_crc: 0,
            chunks: Default::default(),
            xattrs: Default::default(),
        })
    }

    fn key(i: u32) -> ObjectKey {
        ObjectKey::new(u64::from(i % 3), format!("obj-{i:06}"), (i % 5) as u8)
    }

    /// An index as open leaves it: `n` objects at `seq` in the ordered view, then live (the
    /// writer keeping both views), the hash not filled yet.
    fn opened(n: u32, seq: u64) -> Index {
        let ix = Index::new();
        for i in 0..n {
            ix.put(&key(i), meta(seq));
        }
        ix.go_live();
        ix
    }

    impl Index {
        /// Objects in the hash.
        fn point_len(&self) -> usize {
            self.shards.iter().map(|s| s.read().unwrap().len()).sum()
        }

        /// Every object of the ordered view has the same state in the hash, and the hash
        /// holds nothing else.
        fn assert_views_agree(&self) {
            assert!(self.point_ready());
            let mut n = 0;
            let mut last: Option<ObjectKey> = None;
            for e in self.iter() {
                let k = e.key();
                assert!(
                    last.as_ref().is_none_or(|l| l < k),
                    "ordered view out of order"
                );
                let same = self
                    .get(k)
                    .unwrap_or_else(|| panic!("{k:?} missing from the hash"));
                assert!(
                    Arc::ptr_eq(&same, &e.value().load()),
                    "views disagree on {k:?}"
                );
                last = Some(k.clone());
                n += 1;
            }
            assert_eq!(
                self.point_len(),
                n,
                "the hash holds objects the ordered view does not"
            );
        }
    }

    #[test]
    fn both_views_hold_the_same_states_through_puts_and_removes() {
        let ix = Index::new();
        ix.go_live();
        assert!(ix.fill());
        for i in 0..5_000 {
            assert!(ix.put(&key(i), meta(u64::from(i) + 1)).is_none());
        }
        // Overwrite every other one, remove every third.
        for i in (0..5_000).step_by(2) {
            let old = ix.put(&key(i), meta(10_000 + u64::from(i))).unwrap();
            assert_eq!(old.state_seq, u64::from(i) + 1);
        }
        for i in (0..5_000).step_by(3) {
            assert!(ix.remove(&key(i)).is_some());
            assert!(ix.remove(&key(i)).is_none());
        }
        let want = |i: u32| {
            (!i.is_multiple_of(3)).then(|| {
                if i.is_multiple_of(2) {
                    10_000 + u64::from(i)
                } else {
                    u64::from(i) + 1
                }
            })
        };
        for i in 0..5_000 {
            assert_eq!(ix.get(&key(i)).map(|m| m.state_seq), want(i), "key {i}");
            assert_eq!(ix.state_seq(&key(i)), want(i), "key {i}");
        }
        assert_eq!(ix.len(), (0..5_000).filter(|&i| want(i).is_some()).count());
        ix.assert_views_agree();
        // Names that differ only in their last byte or in the shard are different objects.
        assert!(ix.get(&ObjectKey::new(1, "obj-000001", 2)).is_none());
        assert!(ix.get(&ObjectKey::new(1, "obj-00000", 1)).is_none());
        assert!(ix.point_bytes() >= ix.len() * 25);
    }

    #[test]
    fn lookups_use_the_ordered_view_until_the_hash_is_filled() {
        let ix = Index::new();
        for i in 0..1_000 {
            ix.put(&key(i), meta(u64::from(i) + 1));
        }
        ix.remove(&key(7));
        assert_eq!(ix.point_len(), 0, "an index not live keeps no hash");
        assert!(!ix.point_ready());
        assert_eq!(ix.state_seq(&key(8)), Some(9));
        assert!(ix.get(&key(7)).is_none());
        ix.go_live();
        ix.put(&key(8), meta(5_000));
        assert_eq!(ix.get(&key(8)).unwrap().state_seq, 5_000);
        assert!(ix.fill());
        assert_eq!(ix.point_len(), 999);
        assert_eq!(ix.get(&key(8)).unwrap().state_seq, 5_000);
        ix.assert_views_agree();
    }

    /// The filler and the writer at once: whatever the interleaving, the hash ends up the
    /// ordered view exactly (no state lost, none stale, no removed key back).
    #[test]
    fn a_fill_beside_the_writer_leaves_the_hash_equal_to_the_ordered_view() {
        for round in 0..20u32 {
            let ix = opened(20_000, 1);
            std::thread::scope(|s| {
                let filler = s.spawn(|| ix.fill());
                // Overwrites, removes, new keys and removed keys put back, while it fills.
                let mut x = 0x9e37_79b9u32.wrapping_mul(round + 1);
                for n in 0..40_000u64 {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    let k = key(x % 30_000);
                    match x % 4 {
                        0 => {
                            ix.remove(&k);
                        }
                        _ => {
                            ix.put(&k, meta(2 + n));
                        }
                    }
                }
                assert!(filler.join().unwrap());
            });
            ix.assert_views_agree();
        }
    }

    /// The writer's every change landing between the filler taking an entry from its walk
    /// and adding it: a removed key stays removed, a changed one keeps its new state.
    #[test]
    fn the_writer_between_the_walk_and_the_add_wins() {
        let ix = opened(3_000, 1);
        assert!(ix.fill_with(|k| {
            let i: u32 = std::str::from_utf8(&k.name[4..]).unwrap().parse().unwrap();
            match i % 3 {
                0 => drop(ix.remove(k)),
                1 => drop(ix.put(k, meta(100 + u64::from(i)))),
                _ => {}
            }
        }));
        for i in 0..3_000 {
            let want = match i % 3 {
                0 => None,
                1 => Some(100 + u64::from(i)),
                _ => Some(1),
            };
            assert_eq!(ix.state_seq(&key(i)), want, "key {i}");
        }
        ix.assert_views_agree();
    }

    #[test]
    fn a_stopped_fill_leaves_lookups_on_the_ordered_view() {
        let ix = opened(10_000, 3);
        ix.stop_fill();
        assert!(!ix.fill());
        assert!(!ix.point_ready());
        assert_eq!(ix.state_seq(&key(9_999)), Some(3));
    }
}
