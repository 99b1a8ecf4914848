//! nvstore's block layer: the [`BlockDevice`] contract and its backends.
//!
//! * [`FileDevice`]: files and kernel block devices through io_uring (the embedded default).
//! * [`SimDevice`]: in-memory, seeded, with crash images and injected faults (for crash tests).
//! * [`NvmeDevice`]: an NVMe namespace driven from userspace over VFIO ([`nvme`]).
//!
//! The store is generic over [`BlockDevice`]; only binaries name a concrete backend.

pub mod conformance;
pub mod device;
pub mod dma;
pub mod error;
pub mod file;
pub mod io;
pub mod iostats;
pub mod nvme;
pub mod sim;
pub mod workload;

pub use device::{
    BlockDevice, Completion, Geometry, Op, QueueHandle, Request, SubmitError, SubmitErrorKind,
};
pub use dma::{DmaBuf, DmaOwner, HostMemory};
pub use error::{Error, Result};
pub use file::{Engine, FileDevice, FileOptions};
pub use iostats::{IoCounters, IoStats};
pub use nvme::{Controller, NvmeDevice, NvmeOptions, NvmeQueue};
pub use sim::{Fault, Latency, SimConfig, SimDevice};
