//! A set of shard indices of one stripe, as a bit mask.

use crate::SHARD_COUNT_MAX;

/// A set of shard indices (0..`SHARD_COUNT_MAX`), e.g. the parity shards that failed
/// verification. Copy, no allocation.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ShardSet(u64);

const _: () = assert!(SHARD_COUNT_MAX <= u64::BITS as usize);

impl ShardSet {
    pub const EMPTY: ShardSet = ShardSet(0);

    /// # Panics
    /// If `shard >= SHARD_COUNT_MAX`.
    pub fn insert(&mut self, shard: usize) {
        assert!(shard < SHARD_COUNT_MAX, "shard index {shard} out of range");
        self.0 |= 1 << shard;
    }

    pub fn contains(self, shard: usize) -> bool {
        shard < SHARD_COUNT_MAX && self.0 & (1 << shard) != 0
    }

    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The indices in ascending order.
    pub fn iter(self) -> impl Iterator<Item = usize> {
        let mut bits = self.0;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(i)
        })
    }

    /// The raw mask (bit i = shard i).
    pub fn bits(self) -> u64 {
        self.0
    }
}

impl FromIterator<usize> for ShardSet {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> ShardSet {
        let mut s = ShardSet::EMPTY;
        for i in iter {
            s.insert(i);
        }
        s
    }
}

impl std::fmt::Debug for ShardSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_operations() {
        let s: ShardSet = [7, 0, 3].into_iter().collect();
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 3, 7]);
        assert_eq!(s.len(), 3);
        assert!(s.contains(3) && !s.contains(4) && !s.contains(99));
        assert_eq!(format!("{s:?}"), "{0, 3, 7}");
        assert!(ShardSet::EMPTY.is_empty());
        let mut t = ShardSet::EMPTY;
        t.insert(63);
        assert_eq!(t.bits(), 1 << 63);
    }
}
