//! The erasure profile: k data shards, m parity shards, and the stripe unit.

use crate::{Error, SHARD_COUNT_MAX};

pub const DATA_SHARDS_DEFAULT: usize = 6;
pub const PARITY_SHARDS_DEFAULT: usize = 2;
/// Bytes of one shard in one stripe. 64 KiB: a 64 KiB-aligned read touches one node, and a
/// 6+2 stripe (384 KiB of data) keeps the padding of small objects bounded.
pub const STRIPE_UNIT_DEFAULT_BYTES: usize = 64 * 1024;
pub const STRIPE_UNIT_MIN_BYTES: usize = 4 * 1024;
pub const STRIPE_UNIT_MAX_BYTES: usize = 1024 * 1024;
/// Stripe units are whole device blocks, so every shard IO is block aligned.
pub const STRIPE_UNIT_ALIGN_BYTES: usize = 4 * 1024;

const _: () = assert!(STRIPE_UNIT_MIN_BYTES.is_multiple_of(STRIPE_UNIT_ALIGN_BYTES));
const _: () = assert!(STRIPE_UNIT_MAX_BYTES.is_multiple_of(STRIPE_UNIT_ALIGN_BYTES));
const _: () = assert!(STRIPE_UNIT_DEFAULT_BYTES >= STRIPE_UNIT_MIN_BYTES);
const _: () = assert!(STRIPE_UNIT_DEFAULT_BYTES <= STRIPE_UNIT_MAX_BYTES);
const _: () = assert!(DATA_SHARDS_DEFAULT + PARITY_SHARDS_DEFAULT <= SHARD_COUNT_MAX);

/// k data shards + m parity shards, each stripe holding `stripe_unit` bytes per shard.
///
/// Any k of the k + m shards of a stripe rebuild it. Construct with [`Profile::new`] (which
/// validates) or take [`Profile::default`] (6+2, 64 KiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Profile {
    k: usize,
    m: usize,
    stripe_unit: usize,
}

impl Profile {
    /// Checks 1 ≤ k, 1 ≤ m, k + m ≤ `SHARD_COUNT_MAX`, and that the stripe unit is a multiple
    /// of `STRIPE_UNIT_ALIGN_BYTES` within `STRIPE_UNIT_MIN_BYTES..=STRIPE_UNIT_MAX_BYTES`.
    pub fn new(k: usize, m: usize, stripe_unit: usize) -> Result<Profile, Error> {
        let invalid = |reason| Error::InvalidProfile {
            k,
            m,
            stripe_unit,
            reason,
        };
        if k == 0 {
            return Err(invalid("k must be at least 1"));
        }
        if m == 0 {
            return Err(invalid("m must be at least 1"));
        }
        if k + m > SHARD_COUNT_MAX {
            return Err(invalid("k + m exceeds SHARD_COUNT_MAX (64)"));
        }
        if !(STRIPE_UNIT_MIN_BYTES..=STRIPE_UNIT_MAX_BYTES).contains(&stripe_unit) {
            return Err(invalid("stripe unit outside 4 KiB..=1 MiB"));
        }
        if !stripe_unit.is_multiple_of(STRIPE_UNIT_ALIGN_BYTES) {
            return Err(invalid("stripe unit is not a multiple of 4 KiB"));
        }
        Ok(Profile { k, m, stripe_unit })
    }

    /// Data shards per stripe.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Parity shards per stripe.
    pub fn m(&self) -> usize {
        self.m
    }

    /// k + m.
    pub fn shard_count(&self) -> usize {
        self.k + self.m
    }

    /// Bytes of one shard in one stripe.
    pub fn stripe_unit(&self) -> usize {
        self.stripe_unit
    }
}

impl Default for Profile {
    fn default() -> Profile {
        Profile {
            k: DATA_SHARDS_DEFAULT,
            m: PARITY_SHARDS_DEFAULT,
            stripe_unit: STRIPE_UNIT_DEFAULT_BYTES,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(Profile::new(6, 2, 4096).is_ok());
        assert!(Profile::new(6, 2, 1 << 20).is_ok());
        assert!(Profile::new(62, 2, 4096).is_ok());
        for (k, m, unit) in [
            (0, 2, 4096),
            (6, 0, 4096),
            (63, 2, 4096),
            (6, 2, 2048),
            (6, 2, 2 << 20),
            (6, 2, 4096 + 512),
        ] {
            let e = Profile::new(k, m, unit).unwrap_err();
            assert!(
                matches!(e, Error::InvalidProfile { .. }),
                "{k}+{m} {unit}: {e}"
            );
        }
        let d = Profile::default();
        assert_eq!((d.k(), d.m(), d.stripe_unit()), (6, 2, 64 * 1024));
        assert_eq!(d.shard_count(), 8);
    }
}
