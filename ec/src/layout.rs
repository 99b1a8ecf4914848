//! Where each byte of an object lives: stripes, shards, offsets, padding.
//!
//! An object is cut into stripes of k × U data bytes (U = stripe unit). Within stripe s, data
//! shard j holds object bytes `[s·k·U + j·U, s·k·U + (j+1)·U)`, and every shard (data or parity)
//! stores its unit of stripe s at shard offset `s·U`. So a shard is the concatenation of its
//! units, each stripe is one contiguous run of object bytes, and the m parity units of stripe s
//! are computed from its k data units.
//!
//! The last stripe is padded with zeros to a full stripe: every shard of an object of size S
//! is `stripe_count(S) · U` bytes. Padding is zero on disk, so growing the object inside its
//! last stripe is a partial-stripe update whose old data is zero.
//!
//! ```text
//!  object:  | u0 | u1 | u2 | u3 | u4 | u5 | u6 | u7 | u8 | ...      (6+2, units of U bytes)
//!  shard 0: | u0 | u6 | ...      shard 1: | u1 | u7 | ...   ...   shard 6, 7: parity
//! ```

use crate::Profile;

/// The position of one object byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub stripe: u64,
    /// The data shard, 0..k.
    pub shard: usize,
    /// Offset inside the shard's unit of this stripe, 0..U.
    pub unit_offset: usize,
    /// Offset inside the shard: `stripe · U + unit_offset`.
    pub shard_offset: u64,
}

/// A run of object bytes that sits inside one stripe unit of one data shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub stripe: u64,
    /// The data shard, 0..k.
    pub shard: usize,
    pub shard_offset: u64,
    pub object_offset: u64,
    pub len: usize,
}

/// How to bring parity up to date after overwriting part of a stripe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateMethod {
    /// Read the old bytes of the touched data shards and the m parity ranges; apply
    /// [`Codec::parity_delta`](crate::Codec::parity_delta).
    ParityDelta,
    /// Read the untouched data shards, then [`Codec::encode`](crate::Codec::encode) the stripe.
    ReadModifyWrite,
}

impl Profile {
    /// Data bytes per stripe: k · U.
    pub fn stripe_width(&self) -> u64 {
        (self.k() * self.stripe_unit()) as u64
    }

    /// Stripes holding an object of `object_size` bytes (the last one possibly padded).
    pub fn stripe_count(&self, object_size: u64) -> u64 {
        object_size.div_ceil(self.stripe_width())
    }

    /// Bytes of every shard, data and parity alike, for an object of `object_size` bytes.
    pub fn shard_size(&self, object_size: u64) -> u64 {
        self.stripe_count(object_size) * self.stripe_unit() as u64
    }

    /// Zero bytes appended to fill the last stripe.
    pub fn padding(&self, object_size: u64) -> u64 {
        self.stripe_count(object_size) * self.stripe_width() - object_size
    }

    /// How many bytes of `shard` are object data rather than padding. Parity shards are
    /// entirely meaningful: their size is [`Profile::shard_size`].
    ///
    /// # Panics
    /// If `shard >= k + m`.
    pub fn shard_data_len(&self, object_size: u64, shard: usize) -> u64 {
        assert!(shard < self.shard_count(), "shard {shard} out of range");
        if shard >= self.k() || object_size == 0 {
            return self.shard_size(object_size);
        }
        let unit = self.stripe_unit() as u64;
        let last = self.stripe_count(object_size) - 1;
        let in_last = object_size - last * self.stripe_width();
        let in_last_for_shard = in_last.saturating_sub(shard as u64 * unit).min(unit);
        last * unit + in_last_for_shard
    }

    /// Where object byte `offset` lives.
    pub fn locate(&self, offset: u64) -> Location {
        let unit = self.stripe_unit() as u64;
        let stripe = offset / self.stripe_width();
        let within = offset % self.stripe_width();
        let shard = (within / unit) as usize;
        let unit_offset = (within % unit) as usize;
        Location {
            stripe,
            shard,
            unit_offset,
            shard_offset: stripe * unit + unit_offset as u64,
        }
    }

    /// The object offset of byte `shard_offset` of data shard `shard` (inverse of `locate`).
    ///
    /// # Panics
    /// If `shard` is not a data shard.
    pub fn object_offset(&self, shard: usize, shard_offset: u64) -> u64 {
        assert!(shard < self.k(), "shard {shard} holds no object bytes");
        let unit = self.stripe_unit() as u64;
        let stripe = shard_offset / unit;
        stripe * self.stripe_width() + shard as u64 * unit + shard_offset % unit
    }

    /// Splits object bytes `[offset, offset + len)` into per-shard extents, in object order,
    /// each inside one stripe unit.
    pub fn extents(&self, offset: u64, len: u64) -> Extents {
        Extents {
            profile: *self,
            next: offset,
            end: offset + len,
        }
    }

    /// Whether a parity delta reads fewer shards than a read-modify-write, when an overwrite
    /// touches `touched` of the k data shards of a stripe (and the parity covers the union of
    /// their ranges). Delta reads touched + m shards; read-modify-write reads the k − touched
    /// untouched data shards. Ties go to the delta, which writes the same and reads ranges
    /// no longer than whole units. A write covering the whole stripe needs neither: encode.
    ///
    /// # Panics
    /// If `touched` is 0 or more than k.
    pub fn update_method(&self, touched: usize) -> UpdateMethod {
        assert!((1..=self.k()).contains(&touched), "touched {touched} of k");
        if touched + self.m() <= self.k() - touched {
            UpdateMethod::ParityDelta
        } else {
            UpdateMethod::ReadModifyWrite
        }
    }
}

/// Iterator returned by [`Profile::extents`].
#[derive(Clone, Debug)]
pub struct Extents {
    profile: Profile,
    next: u64,
    end: u64,
}

impl Iterator for Extents {
    type Item = Extent;

    fn next(&mut self) -> Option<Extent> {
        if self.next >= self.end {
            return None;
        }
        let loc = self.profile.locate(self.next);
        let room = (self.profile.stripe_unit() - loc.unit_offset) as u64;
        let len = room.min(self.end - self.next);
        let extent = Extent {
            stripe: loc.stripe,
            shard: loc.shard,
            shard_offset: loc.shard_offset,
            object_offset: self.next,
            len: len as usize,
        };
        self.next += len;
        Some(extent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KIB: u64 = 1024;

    #[test]
    fn default_profile_layout() {
        let p = Profile::default(); // 6+2, 64 KiB
        assert_eq!(p.stripe_width(), 384 * KIB);
        assert_eq!(p.stripe_count(0), 0);
        assert_eq!(p.shard_size(0), 0);
        assert_eq!(p.stripe_count(1), 1);
        assert_eq!(p.shard_size(1), 64 * KIB);
        assert_eq!(p.padding(1), 384 * KIB - 1);
        assert_eq!(p.stripe_count(384 * KIB), 1);
        assert_eq!(p.stripe_count(384 * KIB + 1), 2);
        assert_eq!(p.padding(768 * KIB), 0);
        // 100 KiB object: shard 0 full unit, shard 1 36 KiB, shards 2..6 empty, parity full.
        let s = 100 * KIB;
        let lens: Vec<u64> = (0..8).map(|j| p.shard_data_len(s, j)).collect();
        assert_eq!(lens, [64 * KIB, 36 * KIB, 0, 0, 0, 0, 64 * KIB, 64 * KIB]);
        assert_eq!(
            p.locate(400 * KIB + 5),
            Location {
                stripe: 1,
                shard: 0,
                unit_offset: (16 * KIB + 5) as usize,
                shard_offset: 80 * KIB + 5
            }
        );
    }

    #[test]
    fn extents_split_at_unit_boundaries() {
        let p = Profile::new(4, 2, 4096).unwrap();
        let e: Vec<Extent> = p.extents(4000, 4096 * 4 + 200).collect();
        let lens: Vec<usize> = e.iter().map(|x| x.len).collect();
        assert_eq!(lens, [96, 4096, 4096, 4096, 4096, 104]);
        let shards: Vec<usize> = e.iter().map(|x| x.shard).collect();
        assert_eq!(shards, [0, 1, 2, 3, 0, 1]);
        assert_eq!(e[4].stripe, 1);
        assert_eq!(e[4].shard_offset, 4096);
    }

    #[test]
    fn update_method_for_6_2() {
        let p = Profile::default();
        assert_eq!(p.update_method(1), UpdateMethod::ParityDelta);
        assert_eq!(p.update_method(2), UpdateMethod::ParityDelta);
        assert_eq!(p.update_method(3), UpdateMethod::ReadModifyWrite);
        assert_eq!(p.update_method(6), UpdateMethod::ReadModifyWrite);
    }

    fn profiles() -> impl Strategy<Value = Profile> {
        (1usize..=12, 1usize..=4, 1usize..=256)
            .prop_map(|(k, m, u)| Profile::new(k, m, u * 4096).unwrap())
    }

    proptest! {
        #[test]
        fn locate_and_object_offset_are_inverse(p in profiles(), off in 0u64..1 << 40) {
            let loc = p.locate(off);
            prop_assert!(loc.shard < p.k());
            prop_assert!(loc.unit_offset < p.stripe_unit());
            prop_assert_eq!(p.object_offset(loc.shard, loc.shard_offset), off);
        }

        #[test]
        fn shard_sizes_add_up(p in profiles(), size in 0u64..1 << 34) {
            let shard = p.shard_size(size);
            prop_assert_eq!(shard % p.stripe_unit() as u64, 0);
            prop_assert_eq!(shard * p.k() as u64, size + p.padding(size));
            prop_assert!(p.padding(size) < p.stripe_width());
            let data: u64 = (0..p.k()).map(|j| p.shard_data_len(size, j)).sum();
            prop_assert_eq!(data, size);
            // The last data byte of the object lies inside its shard's data length.
            if size > 0 {
                let last = p.locate(size - 1);
                prop_assert_eq!(p.shard_data_len(size, last.shard), last.shard_offset + 1);
            }
        }

        #[test]
        fn extents_tile_the_range(p in profiles(), off in 0u64..1 << 32, len in 0u64..1 << 24) {
            let mut at = off;
            for e in p.extents(off, len) {
                prop_assert_eq!(e.object_offset, at);
                prop_assert!(e.len > 0);
                let loc = p.locate(at);
                prop_assert_eq!((e.stripe, e.shard, e.shard_offset), (loc.stripe, loc.shard, loc.shard_offset));
                prop_assert!(loc.unit_offset + e.len <= p.stripe_unit());
                at += e.len as u64;
            }
            prop_assert_eq!(at, off + len);
        }
    }
}
