//! The BlockDevice contract on an NVMe namespace: one [`NvmeDevice`] per namespace, all sharing
//! their controller's I/O queue pairs and DMA arena.

use std::sync::Arc;

use super::controller::{Controller, NvmeOptions};
use super::queue::{NsContext, NvmeQueue};
use crate::device::{BlockDevice, Geometry};
use crate::dma::DmaBuf;
use crate::error::{Error, Result};

/// Required alignment of a transfer's device address: PRP entries must be dword aligned
/// (Base 1.4 §4.3).
pub const NVME_DMA_ALIGNMENT: u32 = 4;

/// One namespace of an NVMe controller driven from userspace over VFIO.
pub struct NvmeDevice {
    ctrl: Arc<Controller>,
    ns: Arc<NsContext>,
}

impl NvmeDevice {
    /// Open the controller at `bdf` and its namespace `nsid`.
    pub fn open(bdf: &str, nsid: u32, opts: NvmeOptions) -> Result<Self> {
        let ctrl = Controller::open(bdf, opts)?;
        Self::new(&ctrl, nsid)
    }

    /// A device for namespace `nsid` of an open controller.
    pub fn new(ctrl: &Arc<Controller>, nsid: u32) -> Result<Self> {
        Self::with_max_transfer(ctrl, nsid, u32::MAX)
    }

    /// Like [`new`](Self::new), with the largest request capped at `max_transfer_bytes`
    /// (rounded down to whole blocks, at least one).
    pub fn with_max_transfer(
        ctrl: &Arc<Controller>,
        nsid: u32,
        max_transfer_bytes: u32,
    ) -> Result<Self> {
        let Some(info) = ctrl.namespace(nsid) else {
            return Err(Error::Invalid {
                device: ctrl.name().clone(),
                detail: format!(
                    "no active namespace {nsid} (active: {:?})",
                    ctrl.namespaces().iter().map(|n| n.nsid).collect::<Vec<_>>()
                ),
            });
        };
        let c = ctrl.info();
        let bs = info.block_bytes;
        let layout = ctrl.layout();
        let atomic_blocks = info
            .atomic_write_blocks
            .unwrap_or(c.atomic_write_blocks)
            .max(1);
        let atomic = prev_power_of_two(atomic_blocks as u64 * bs as u64).max(512) as u32;
        let geometry = Geometry {
            block_size: bs,
            capacity_blocks: info.blocks,
            max_transfer_bytes: (layout.max_transfer_bytes.min(max_transfer_bytes) / bs).max(1)
                * bs,
            queue_depth: layout.depth,
            queue_count: c.io_queues as u32,
            volatile_write_cache: c.volatile_write_cache,
            atomic_write_bytes: atomic,
            dma_alignment: NVME_DMA_ALIGNMENT,
        };
        let ns = NsContext {
            name: format!("{}/ns{nsid}", ctrl.name()).into(),
            nsid,
            geometry,
            write_zeroes: c.supports_write_zeroes(),
            deallocate: c.supports_deallocate(),
        };
        Ok(NvmeDevice {
            ctrl: ctrl.clone(),
            ns: Arc::new(ns),
        })
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctrl
    }

    pub fn nsid(&self) -> u32 {
        self.ns.nsid
    }
}

fn prev_power_of_two(x: u64) -> u64 {
    if x == 0 {
        0
    } else {
        1 << (63 - x.leading_zeros())
    }
}

impl BlockDevice for NvmeDevice {
    type Queue = NvmeQueue;

    fn name(&self) -> &Arc<str> {
        &self.ns.name
    }

    fn geometry(&self) -> &Geometry {
        &self.ns.geometry
    }

    fn open_queue(&self) -> Result<NvmeQueue> {
        NvmeQueue::open(&self.ctrl, &self.ns)
    }

    fn alloc_buf(&self, len: usize) -> Result<DmaBuf> {
        self.ctrl.arena().alloc(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_unit_is_a_power_of_two() {
        assert_eq!(prev_power_of_two(512), 512);
        assert_eq!(prev_power_of_two(3 * 512), 1024);
        assert_eq!(prev_power_of_two(1), 1);
    }
}
