//! The store's one error type.

use std::sync::Arc;

use crate::key::ObjectKey;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Device(#[from] driver::Error),
    /// A checksum did not match. Never returned as data: the caller repairs or fails.
    #[error(
        "{device}: corrupt {what} at byte offset {offset} ({len} bytes): expected crc32c \
         {expected:#010x}, found {found:#010x}"
    )]
    Corrupted {
        device: Arc<str>,
        what: &'static str,
        offset: u64,
        len: u64,
        expected: u32,
        found: u32,
    },
    #[error("no such object: {0}")]
    NotFound(ObjectKey),
    #[error("{key}: version is {actual}, the operation asserted {expected}")]
    VersionMismatch {
        key: ObjectKey,
        expected: u64,
        actual: u64,
    },
    #[error("{what} is {size} bytes; the maximum is {max}")]
    TooLarge {
        what: &'static str,
        size: u64,
        max: u64,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("no such xattr {name:?} on {key}")]
    NoXattr { key: ObjectKey, name: String },
    #[error(
        "{device}: out of space: {used} of {total} segments in use ({reclaimable} reclaimable by \
         the cleaner); {reserve} are kept in reserve for cleaning"
    )]
    OutOfSpace {
        device: Arc<str>,
        used: u64,
        total: u64,
        reclaimable: u64,
        reserve: u64,
    },
    #[error("{device}: not an nvstore device (no valid label); run `nvstore mkfs` first")]
    Unlabelled { device: Arc<str> },
    #[error(
        "{device}: labelled for cluster {found}, but this node belongs to cluster {expected}; \
         refusing to use it"
    )]
    WrongCluster {
        device: Arc<str>,
        found: String,
        expected: String,
    },
    #[error("{device}: unusable store format: {detail}")]
    Format { device: Arc<str>, detail: String },
    #[error("the store is shut down")]
    Closed,
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
