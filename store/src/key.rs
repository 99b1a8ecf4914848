//! Object keys and the limits on what the store accepts.

use std::fmt;

/// Longest object name.
pub const NAME_BYTES_MAX: usize = 1024;
/// Largest object.
pub const OBJECT_BYTES_MAX: u64 = 64 << 20;
/// Largest serialized xattr map of one object.
pub const XATTR_BYTES_MAX: usize = 64 << 10;
/// Longest xattr name.
pub const XATTR_NAME_BYTES_MAX: usize = 255;

/// Name bytes an [`ObjectKey`] holds inline; longer names go to the heap. 40 keeps the key at
/// 64 bytes and covers the names seen in practice (a node's PG-log key, 16 bytes longer than
/// its object's name, included).
pub const NAME_INLINE_BYTES: usize = 40;

/// An object's name bytes: inline up to [`NAME_INLINE_BYTES`], so comparing keys in the index
/// (a skip list) reads the name from the node itself instead of following a pointer per
/// comparison, and cloning a key does not allocate. Derefs to `[u8]`; compares, orders and
/// hashes as the byte slice.
pub type Name = smallvec::SmallVec<[u8; NAME_INLINE_BYTES]>;

/// An object: (pool, name, shard). Ordered by pool, then name bytes, then shard, which is the
/// order `list` returns.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub pool: u64,
    pub name: Name,
    pub shard: u8,
}

impl ObjectKey {
    pub fn new(pool: u64, name: impl AsRef<[u8]>, shard: u8) -> Self {
        ObjectKey {
            pool,
            name: Name::from_slice(name.as_ref()),
            shard,
        }
    }

    /// Heap bytes the key holds beyond its own size: a name longer than the inline room, with
    /// the allocator's 16-byte chunk header.
    pub fn heap_bytes(&self) -> usize {
        if self.name.spilled() {
            self.name.capacity() + 16
        } else {
            0
        }
    }

    /// CRC32C of (pool, name, shard): the key hash stored in record headers.
    pub fn hash32(&self) -> u32 {
        let c = crc32c::crc32c(&self.pool.to_le_bytes());
        let c = crc32c::crc32c_append(c, &self.name);
        crc32c::crc32c_append(c, &[self.shard])
    }

    pub fn check(&self) -> crate::Result<()> {
        if self.name.len() > NAME_BYTES_MAX {
            return Err(crate::StoreError::TooLarge {
                what: "object name",
                size: self.name.len() as u64,
                max: NAME_BYTES_MAX as u64,
            });
        }
        Ok(())
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.pool, String::from_utf8_lossy(&self.name))?;
        if self.shard != 0 {
            write!(f, "#{}", self.shard)?;
        }
        Ok(())
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_64_bytes_and_order_by_name_bytes_inline_or_not() {
        assert_eq!(std::mem::size_of::<ObjectKey>(), 64);
        let short = ObjectKey::new(1, b"b", 0);
        let edge = ObjectKey::new(1, [b'b'; NAME_INLINE_BYTES], 0);
        let long = ObjectKey::new(1, [b'b'; NAME_INLINE_BYTES + 1], 0);
        let longer = ObjectKey::new(1, [b'a'; NAME_BYTES_MAX], 0);
        assert_eq!((short.heap_bytes(), edge.heap_bytes()), (0, 0));
        assert!(long.heap_bytes() > NAME_INLINE_BYTES);
        let mut keys = vec![long.clone(), short.clone(), longer.clone(), edge.clone()];
        keys.sort();
        assert_eq!(keys, vec![longer.clone(), short, edge, long.clone()]);
        // Same name bytes, inline or spilled: equal keys, equal hashes.
        let copy = ObjectKey::new(1, &long.name[..], 0);
        assert_eq!(copy, long);
        let rs = std::hash::RandomState::new();
        assert_eq!(
            std::hash::BuildHasher::hash_one(&rs, &copy),
            std::hash::BuildHasher::hash_one(&rs, &long)
        );
        assert_eq!(&*longer.name, &[b'a'; NAME_BYTES_MAX][..]);
    }
}
