//! The userspace NVMe driver over VFIO.
//!
//! After `nvstore device bind`, a controller is driven entirely from this process: BAR0 is
//! mapped, DMA memory is one arena mapped through the IOMMU up front, and each thread owns a
//! polled I/O queue pair. No kernel code is in the IO path; the IOMMU confines every DMA to the
//! arena.
//!
//! Layout (one job per file, after SPDK's lib/nvme and ixy):
//! * [`spec`]: registers, queue entries, identify pages and status codes, each citing the spec.
//! * [`sysfs`]: PCI functions as sysfs shows them.
//! * [`vfio`]: container, group, device, config space, BAR0 (the only MMIO code).
//! * [`arena`]: DMA arena, page allocator, IOVA allocator.
//! * `ring`: SQ/CQ rings in DMA memory (volatile access, barriers before doorbells).
//! * [`controller`]: bring-up state machine, admin queue, abort, reset.
//! * [`queue`]: the I/O queue pair behind a queue handle: trackers, PRPs, splitting, polling.
//! * [`device`]: the BlockDevice contract per namespace.

pub mod arena;
pub mod controller;
pub mod device;
pub mod queue;
mod ring;
pub mod spec;
pub mod sysfs;
pub mod vfio;

pub use arena::Arena;
pub use controller::{
    Controller, ControllerInfo, LbaFormatInfo, NamespaceInfo, NvmeOptions, QueueLayout,
};
pub use device::NvmeDevice;
pub use queue::{NvmeQueue, RawCommand};
pub use spec::StatusKind;
