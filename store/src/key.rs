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

/// An object: (pool, name, shard). Ordered by pool, then name bytes, then shard, which is the
/// order `list` returns.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub pool: u64,
    pub name: Box<[u8]>,
    pub shard: u8,
}

impl ObjectKey {
    pub fn new(pool: u64, name: impl AsRef<[u8]>, shard: u8) -> Self {
        ObjectKey {
            pool,
            name: name.as_ref().into(),
            shard,
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
