//! The driver crate's one error type.

use std::sync::Arc;
use std::time::Duration;

/// Everything a block device can report. `device` names the device (path, PCI address or
/// simulator id) so an error read in a log says where it happened.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The operating system refused an operation (open, ioctl, io_uring setup, a read or write).
    #[error("{device}: {what}: {source}")]
    Io {
        device: Arc<str>,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A buffer offset, byte offset or length is not aligned as the device requires.
    #[error("{device}: misaligned request: {detail}")]
    Misaligned { device: Arc<str>, detail: String },
    /// The LBA range extends past the end of the device.
    #[error(
        "{device}: LBA range {lba}+{blocks} is past the end of the device ({capacity} blocks)"
    )]
    OutOfRange {
        device: Arc<str>,
        lba: u64,
        blocks: u32,
        capacity: u64,
    },
    /// A request that is malformed for a reason other than alignment or range.
    #[error("{device}: invalid request: {detail}")]
    Invalid { device: Arc<str>, detail: String },
    /// The medium could not deliver or store the data (an unrecoverable read or write error).
    #[error("{device}: media error on {op} at LBA {lba}+{blocks}: {detail}")]
    Media {
        device: Arc<str>,
        op: &'static str,
        lba: u64,
        blocks: u32,
        detail: String,
    },
    /// The device is held by another opener (see `FileOptions::exclusive`).
    #[error("{device}: in use: {detail}")]
    InUse { device: Arc<str>, detail: String },
    /// Every queue the device offers is already open.
    #[error("{device}: no free queue: all {count} queues are open")]
    NoQueue { device: Arc<str>, count: u32 },
    /// DMA memory could not be allocated or mapped.
    #[error("{device}: cannot allocate {len} bytes of DMA memory: {detail}")]
    NoMemory {
        device: Arc<str>,
        len: usize,
        detail: String,
    },
    /// A wait ran past its deadline.
    #[error("{device}: timed out after {timeout:?} waiting for {what}")]
    Timeout {
        device: Arc<str>,
        what: &'static str,
        timeout: Duration,
    },
    /// The device was crashed, removed or reset underneath this handle.
    #[error("{device}: device is gone: {reason}")]
    Gone {
        device: Arc<str>,
        reason: &'static str,
    },
    /// An NVMe command completed with an error status that no more specific variant covers
    /// (invalid field, invalid namespace, aborted, internal error, …). LBA-out-of-range maps to
    /// [`Error::OutOfRange`] and media errors to [`Error::Media`].
    #[error(
        "{device}: {op} failed: NVMe status {meaning} (type {status_type:#x}, code {status_code:#04x})"
    )]
    Nvme {
        device: Arc<str>,
        op: &'static str,
        kind: crate::nvme::StatusKind,
        status_type: u8,
        status_code: u8,
        meaning: &'static str,
    },
    /// The NVMe controller failed, or a bring-up/reset step did not finish: `state` names the
    /// step (e.g. "waiting for CSTS.RDY=0 after disable").
    #[error("{device}: controller {state}: {detail}")]
    Controller {
        device: Arc<str>,
        state: &'static str,
        detail: String,
    },
    /// The host is not set up for a VFIO device (no IOMMU, vfio-pci not loaded, permissions,
    /// locked-memory limit): `fix` says what to do.
    #[error("{device}: {problem}; fix: {fix}")]
    Setup {
        device: Arc<str>,
        problem: String,
        fix: String,
    },
}

impl Error {
    /// True when the error says the data itself is bad or unreadable (as opposed to a bad request
    /// or an unavailable device): the caller may repair from redundancy.
    pub fn is_media(&self) -> bool {
        matches!(self, Error::Media { .. })
    }

    /// Host memory for a DMA buffer of `len` bytes could not be allocated.
    pub fn no_host_memory(device: &Arc<str>, len: usize) -> Error {
        Error::NoMemory {
            device: device.clone(),
            len,
            detail: "host allocation failed".into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
