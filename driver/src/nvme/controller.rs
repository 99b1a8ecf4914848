//! One NVMe controller: bring-up as an explicit state machine (Base 1.4 §7.6.1), the admin
//! queue, identify data, the pool of I/O queue pairs, abort and controller reset.
//!
//! # Reset semantics
//! [`Controller::reset`] disables the controller (CC.EN=0, wait for CSTS.RDY=0 within CAP.TO),
//! which drops every I/O queue and every outstanding command inside the device, then bumps the
//! controller *generation*, re-enables it and sets the queue count again. Each queue pair
//! notices the new generation at its next submit/poll, fails every request it had outstanding
//! with [`Error::Gone`] (the reason names the cause), zeroes its rings and re-creates its
//! queues through the admin queue. Requests are **failed, not resubmitted**: the caller owns
//! retry policy (a store must not blindly replay a write it may have superseded). The buffers
//! come back with the failed completions; the device no longer touches them because the
//! generation only moves after CSTS.RDY=0.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use zerocopy::FromBytes;

use super::arena::{Arena, IovaSpace};
use super::queue::QueuePair;
use super::ring::{Cq, Doorbell, Sq};
use super::spec::{
    self, cc, cns, csts, reg, ActiveNamespaces, Cap, Command, Completion, IdentifyController,
    IdentifyNamespace, Version, CQE_BYTES, PAGE_BYTES, SQE_BYTES,
};
use super::vfio::VfioPci;
use crate::dma::DmaBuf;
use crate::error::{Error, Result};

/// Admin queue entries (both rings).
pub const ADMIN_QUEUE_ENTRIES: u16 = 32;

/// Tunables of a controller, fixed at open.
#[derive(Debug, Clone)]
pub struct NvmeOptions {
    /// Bytes of DMA memory mapped up front (rounded up to 2 MiB): queues, PRP lists and every
    /// buffer `alloc_buf` hands out.
    pub arena_bytes: usize,
    /// I/O queue pairs to ask the controller for (Set Features – Number of Queues).
    pub io_queues_max: u16,
    /// Requests one queue handle can have in flight.
    pub queue_depth: u32,
    /// Largest request a queue accepts; requests above the controller's MDTS are split into
    /// several commands.
    pub max_transfer_bytes: u32,
    /// A command outstanding longer than this is aborted (then the controller reset).
    pub command_timeout: Duration,
    /// How long an Abort gets to make the timed-out command complete before the reset.
    pub abort_timeout: Duration,
    /// Deadline of one admin command.
    pub admin_timeout: Duration,
    /// How long `wait` spins without a completion before it starts sleeping between polls
    /// (5 µs doubling to 500 µs). `None` (the default) spins: lowest latency, one core busy
    /// per waiting thread. Worth setting where cores are shared with the device itself
    /// (a VM or an emulated controller), where spinning takes CPU from the device.
    pub wait_spin: Option<Duration>,
}

impl Default for NvmeOptions {
    fn default() -> Self {
        NvmeOptions {
            arena_bytes: 64 << 20,
            io_queues_max: 8,
            queue_depth: 128,
            max_transfer_bytes: 1 << 20,
            command_timeout: Duration::from_secs(30),
            abort_timeout: Duration::from_secs(1),
            admin_timeout: Duration::from_secs(10),
            wait_spin: None,
        }
    }
}

/// What identify said about the controller.
#[derive(Debug, Clone)]
pub struct ControllerInfo {
    pub vendor_id: u16,
    pub subsystem_vendor_id: u16,
    pub model: String,
    pub serial: String,
    pub firmware: String,
    pub version: Version,
    /// Maximum data transfer size in bytes, `None` when the controller sets no limit.
    pub mdts_bytes: Option<u64>,
    /// CAP.MQES + 1: the largest queue the controller accepts.
    pub max_queue_entries: u32,
    /// CAP.TO in milliseconds.
    pub ready_timeout_ms: u64,
    pub doorbell_stride_bytes: usize,
    /// Largest valid namespace ID.
    pub namespace_count: u32,
    /// Optional NVM command support bits (ONCS).
    pub oncs: u16,
    pub volatile_write_cache: bool,
    /// Atomic write unit power fail, in blocks (AWUPF + 1).
    pub atomic_write_blocks: u32,
    /// I/O queue pairs in use: what Set Features – Number of Queues granted, capped at
    /// [`NvmeOptions::io_queues_max`].
    pub io_queues: u16,
    /// I/O queue pairs the controller said it allocated (its limit when asked for more).
    pub io_queues_allocated: u16,
}

impl ControllerInfo {
    pub fn supports_write_zeroes(&self) -> bool {
        self.oncs & spec::ONCS_WRITE_ZEROES != 0
    }

    pub fn supports_deallocate(&self) -> bool {
        self.oncs & spec::ONCS_DSM != 0
    }
}

/// One LBA format a namespace supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbaFormatInfo {
    pub block_bytes: u32,
    pub metadata_bytes: u16,
    /// 0 best … 3 degraded.
    pub relative_performance: u8,
}

/// What identify said about one active namespace.
#[derive(Debug, Clone)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub blocks: u64,
    pub block_bytes: u32,
    /// Index of the format in use in `formats`.
    pub format_index: u8,
    pub formats: Vec<LbaFormatInfo>,
    /// Namespace atomic write unit power fail in blocks, when the namespace reports one.
    pub atomic_write_blocks: Option<u32>,
}

impl NamespaceInfo {
    pub fn bytes(&self) -> u64 {
        self.blocks * self.block_bytes as u64
    }
}

/// Sizes of every I/O queue pair, derived from the options and the controller's limits.
#[derive(Debug, Clone, Copy)]
pub struct QueueLayout {
    /// Requests in flight per queue handle.
    pub depth: u32,
    /// Commands in flight per queue (trackers, command ids): depth × the split factor.
    pub commands: u16,
    /// Entries of each SQ and CQ: `commands + 1` (one slot stays empty).
    pub entries: u16,
    /// Largest data transfer of one command (MDTS, capped so a PRP list fits in a page).
    pub command_bytes_max: u32,
    /// Bytes of PRP-list (or DSM-range) memory per command id.
    pub prp_slot_bytes: usize,
    /// Largest request, before splitting.
    pub max_transfer_bytes: u32,
}

/// Largest transfer of one command when MDTS is unlimited or larger: one PRP list page holds
/// 512 entries = 2 MiB, and 1 MiB keeps the per-command list at most a page.
pub const COMMAND_BYTES_CAP: u32 = 1 << 20;
const _: () = assert!(COMMAND_BYTES_CAP as usize / PAGE_BYTES * 8 <= PAGE_BYTES);

impl QueueLayout {
    fn new(opts: &NvmeOptions, info: &ControllerInfo) -> Result<Self, String> {
        let command_bytes_max = info
            .mdts_bytes
            .unwrap_or(u64::MAX)
            .min(COMMAND_BYTES_CAP as u64) as u32;
        if command_bytes_max < PAGE_BYTES as u32 {
            return Err(format!(
                "MDTS of {command_bytes_max} bytes is below one page"
            ));
        }
        let max_transfer_bytes = opts.max_transfer_bytes.max(command_bytes_max);
        let split = max_transfer_bytes.div_ceil(command_bytes_max);
        let entries_max = info.max_queue_entries.min(u16::MAX as u32);
        let commands = (opts.queue_depth * split).min(entries_max - 1);
        let depth = opts.queue_depth.min(commands);
        if depth == 0 {
            return Err("queue depth 0".into());
        }
        // PRP list entries needed by the largest command: one per page after the first.
        let list_bytes = (command_bytes_max as usize / PAGE_BYTES) * 8;
        let prp_slot_bytes = list_bytes.next_power_of_two().clamp(64, PAGE_BYTES);
        Ok(QueueLayout {
            depth,
            commands: commands as u16,
            entries: commands as u16 + 1,
            command_bytes_max,
            prp_slot_bytes,
            max_transfer_bytes,
        })
    }
}

/// The admin queue pair; used synchronously, one command at a time, under the admin lock.
struct Admin {
    sq: Sq,
    cq: Cq,
    next_cid: u16,
    /// 4 KiB for identify data.
    page: DmaBuf,
}

/// Steps of bring-up and reset. Each wait has a deadline; an error names the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BringUp {
    Disable,
    WaitDisabled,
    ConfigureAdmin,
    Enable,
    WaitReady,
    IdentifyController,
    ListNamespaces,
    IdentifyNamespaces,
    SetQueueCount,
    Ready,
}

impl BringUp {
    fn describe(self) -> &'static str {
        match self {
            BringUp::Disable => "disabling (CC.EN=0)",
            BringUp::WaitDisabled => "waiting for CSTS.RDY=0 after disable",
            BringUp::ConfigureAdmin => "configuring the admin queue (AQA/ASQ/ACQ)",
            BringUp::Enable => "enabling (CC.EN=1)",
            BringUp::WaitReady => "waiting for CSTS.RDY=1 after enable",
            BringUp::IdentifyController => "identifying the controller",
            BringUp::ListNamespaces => "listing active namespaces",
            BringUp::IdentifyNamespaces => "identifying namespaces",
            BringUp::SetQueueCount => "setting the number of I/O queues",
            BringUp::Ready => "ready",
        }
    }
}

/// An open controller. Shared (`Arc`) by its namespaces' devices and their queue handles.
pub struct Controller {
    name: Arc<str>,
    cap: Cap,
    opts: NvmeOptions,
    info: ControllerInfo,
    namespaces: Vec<NamespaceInfo>,
    layout: QueueLayout,
    admin: Mutex<Admin>,
    /// Free I/O queue pairs (created on the device or waiting to be re-created).
    pool: Mutex<Vec<QueuePair>>,
    generation: AtomicU64,
    reset_cause: Mutex<&'static str>,
    failed: AtomicBool,
    unmapped_iova: u64,
    // Drop order: the arena outlives nothing that uses it (every DmaBuf holds it); the PCI
    // function (BAR, device, container) goes last.
    arena: Arena,
    pci: VfioPci,
}

impl Controller {
    /// Open the controller at `bdf` (bound to vfio-pci), bring it up and create its I/O queues.
    pub fn open(bdf: &str, opts: NvmeOptions) -> Result<Arc<Self>> {
        // Every host-side problem is reported before the device is opened.
        let name: Arc<str> = super::sysfs::full_bdf(bdf).into();
        super::vfio::check_host(&name)?;
        super::arena::check_memlock(&name, Arena::mapped_len(opts.arena_bytes))?;
        let pci = VfioPci::open(bdf)?;
        let name = pci.name().clone();
        let mut iovas = IovaSpace::default();
        let arena = Arena::map(&name, pci.container(), &mut iovas, opts.arena_bytes)?;
        let unmapped_iova = iovas.unmapped_probe();
        let cap = Cap(pci.bar0().read64(reg::CAP));
        check_cap(&name, cap)?;
        let stride = cap.doorbell_stride_bytes();
        let bar = pci.bar0();
        let mut admin = Admin {
            sq: Sq::new(
                arena.alloc(ADMIN_QUEUE_ENTRIES as usize * SQE_BYTES)?,
                ADMIN_QUEUE_ENTRIES,
                Doorbell::new(bar.register_ptr(spec::sq_tail_doorbell(0, stride))),
            ),
            cq: Cq::new(
                arena.alloc(ADMIN_QUEUE_ENTRIES as usize * CQE_BYTES)?,
                ADMIN_QUEUE_ENTRIES,
                Doorbell::new(bar.register_ptr(spec::cq_head_doorbell(0, stride))),
            ),
            next_cid: 0,
            page: arena.alloc(PAGE_BYTES)?,
        };
        let mut found = Found::default();
        run_state_machine(&name, &pci, cap, &opts, &mut admin, &mut found, true, || {})?;
        let (info, namespaces) = (found.info.expect("identified"), found.namespaces);
        let layout = QueueLayout::new(&opts, &info).map_err(|detail| Error::Controller {
            device: name.clone(),
            state: "sizing I/O queues",
            detail,
        })?;
        let ctrl = Arc::new(Controller {
            name,
            cap,
            opts,
            info,
            namespaces,
            layout,
            admin: Mutex::new(admin),
            pool: Mutex::new(Vec::new()),
            generation: AtomicU64::new(1),
            reset_cause: Mutex::new("not reset"),
            failed: AtomicBool::new(false),
            unmapped_iova,
            arena,
            pci,
        });
        // Create every I/O queue pair now: memory and device queues are set up front.
        let mut pairs = Vec::with_capacity(ctrl.info.io_queues as usize);
        for qid in 1..=ctrl.info.io_queues {
            let mut pair = QueuePair::new(&ctrl, qid)?;
            ctrl.create_io_queue(&mut pair)?;
            pairs.push(pair);
        }
        pairs.reverse(); // hand out qid 1 first
        *ctrl.pool.lock().expect("pool lock") = pairs;
        Ok(ctrl)
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    pub fn info(&self) -> &ControllerInfo {
        &self.info
    }

    pub fn namespaces(&self) -> &[NamespaceInfo] {
        &self.namespaces
    }

    pub fn namespace(&self, nsid: u32) -> Option<&NamespaceInfo> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }

    pub fn cap(&self) -> Cap {
        self.cap
    }

    pub fn options(&self) -> &NvmeOptions {
        &self.opts
    }

    pub fn layout(&self) -> &QueueLayout {
        &self.layout
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// An IOVA inside the controller's IOMMU domain that is never mapped: DMA to it must be
    /// blocked by the IOMMU (used by the hardware suite to prove confinement).
    pub fn unmapped_iova(&self) -> u64 {
        self.unmapped_iova
    }

    /// Bumped by every reset; queue pairs compare it to notice a reset.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Why the last reset happened.
    pub fn reset_cause(&self) -> &'static str {
        *self.reset_cause.lock().expect("reset cause lock")
    }

    /// True when a reset failed: the controller is unusable until reopened.
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Read CSTS.
    pub fn status_register(&self) -> u32 {
        self.pci.bar0().read32(reg::CSTS)
    }

    /// Check CSTS: `Err` when the controller reports a fatal status or no longer answers.
    pub fn check_fatal(&self) -> Result<()> {
        let csts = self.status_register();
        if csts == csts::GONE {
            return Err(self.error(
                "not responding",
                "CSTS reads all ones: the device was removed or its link is down".into(),
            ));
        }
        if csts & csts::CFS != 0 {
            return Err(self.error(
                "fatal status",
                format!("CSTS.CFS=1 (CSTS={csts:#x}): the controller hit a fatal error"),
            ));
        }
        Ok(())
    }

    fn error(&self, state: &'static str, detail: String) -> Error {
        Error::Controller {
            device: self.name.clone(),
            state,
            detail,
        }
    }

    pub(crate) fn bar(&self) -> &super::vfio::Bar {
        self.pci.bar0()
    }

    fn lock_admin(&self) -> MutexGuard<'_, Admin> {
        // A panic while holding the lock leaves the admin rings consistent (each exec finishes
        // its command or times out), so a poisoned lock is still usable.
        self.admin.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run one admin command and wait for it (up to the admin timeout).
    pub fn admin_command(&self, cmd: Command, what: &'static str) -> Result<Completion> {
        let mut admin = self.lock_admin();
        admin.exec(
            &self.name,
            self.pci.bar0(),
            cmd,
            self.opts.admin_timeout,
            what,
        )
    }

    /// Abort command `cid` on queue `qid`. `Ok(true)` when the controller says it aborted it
    /// (Base 1.4 §5.1: dword 0 bit 0 clear), `Ok(false)` when it did not.
    pub fn abort(&self, qid: u16, cid: u16) -> Result<bool> {
        let c = self.admin_command(Command::abort(qid, cid), "abort")?;
        Ok(c.dw0 & 1 == 0)
    }

    /// Reset the controller (see the module doc). `seen_generation`: only reset if nobody has
    /// since `seen_generation` (so several queues noticing one failure reset once).
    pub fn reset(&self, cause: &'static str, seen_generation: Option<u64>) -> Result<()> {
        let mut admin = self.lock_admin();
        if seen_generation.is_some_and(|g| g != self.generation()) {
            return Ok(());
        }
        tracing::warn!(device = %self.name, "resetting the controller: {cause}");
        let mut found = Found::default();
        let bump = || {
            *self.reset_cause.lock().expect("reset cause lock") = cause;
            self.generation.fetch_add(1, Ordering::AcqRel);
        };
        let r = run_state_machine(
            &self.name, &self.pci, self.cap, &self.opts, &mut admin, &mut found, false, bump,
        );
        if let Err(e) = &r {
            tracing::error!(device = %self.name, "controller reset failed: {e}");
            self.failed.store(true, Ordering::Release);
        } else if let Some(n) = found.io_queues {
            if n < self.info.io_queues {
                self.failed.store(true, Ordering::Release);
                return Err(self.error(
                    "reset",
                    format!(
                        "after reset the controller grants {n} I/O queues, fewer than the {} in use",
                        self.info.io_queues
                    ),
                ));
            }
        }
        r
    }

    /// Create `pair`'s CQ then SQ on the device, for the current generation.
    pub(crate) fn create_io_queue(&self, pair: &mut QueuePair) -> Result<()> {
        let mut admin = self.lock_admin();
        if self.is_failed() {
            return Err(self.error("failed", "a reset failed earlier; reopen the device".into()));
        }
        let generation = self.generation();
        let (qid, entries) = (pair.qid(), pair.entries() as u32);
        let t = self.opts.admin_timeout;
        pair.reset_rings();
        let bar = self.pci.bar0();
        admin.exec(
            &self.name,
            bar,
            Command::create_io_cq(qid, entries, pair.cq_iova()),
            t,
            "creating an I/O completion queue",
        )?;
        admin.exec(
            &self.name,
            bar,
            Command::create_io_sq(qid, entries, pair.sq_iova(), qid),
            t,
            "creating an I/O submission queue",
        )?;
        pair.set_generation(Some(generation));
        Ok(())
    }

    /// Delete `pair`'s SQ (aborting its commands) then its CQ, if they exist in this generation.
    pub(crate) fn delete_io_queue(&self, pair: &mut QueuePair) -> Result<()> {
        let mut admin = self.lock_admin();
        if pair.generation() != Some(self.generation()) || self.is_failed() {
            pair.set_generation(None);
            return Ok(());
        }
        let t = self.opts.admin_timeout;
        let bar = self.pci.bar0();
        let qid = pair.qid();
        pair.set_generation(None);
        admin.exec(
            &self.name,
            bar,
            Command::delete_io_sq(qid),
            t,
            "deleting an I/O SQ",
        )?;
        admin.exec(
            &self.name,
            bar,
            Command::delete_io_cq(qid),
            t,
            "deleting an I/O CQ",
        )?;
        Ok(())
    }

    /// Take a free queue pair, or `None` when all are in use.
    pub(crate) fn take_pair(&self) -> Option<QueuePair> {
        self.pool.lock().expect("pool lock").pop()
    }

    /// Give a queue pair back.
    pub(crate) fn return_pair(&self, pair: QueuePair) {
        self.pool.lock().expect("pool lock").push(pair);
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        // Normal shutdown (Base 1.4 §7.6.2): CC.SHN=01b, wait for CSTS.SHST=10b, then disable,
        // so the device has flushed its volatile cache and stops DMA before the arena goes.
        let bar = self.pci.bar0();
        if self.is_failed() || bar.read32(reg::CSTS) == csts::GONE {
            return;
        }
        let cc = bar.read32(reg::CC);
        bar.write32(reg::CC, (cc & !cc::SHN_MASK) | cc::SHN_NORMAL);
        let deadline = Instant::now() + Duration::from_millis(self.cap.timeout_ms().max(1000));
        while bar.read32(reg::CSTS) & csts::SHST_MASK != csts::SHST_COMPLETE {
            if Instant::now() > deadline {
                tracing::warn!(device = %self.name, "shutdown did not complete within CAP.TO");
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        bar.write32(reg::CC, 0);
        let deadline = Instant::now() + Duration::from_millis(self.cap.timeout_ms().max(1000));
        while bar.read32(reg::CSTS) & csts::RDY != 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn check_cap(name: &Arc<str>, cap: Cap) -> Result<()> {
    let fail = |detail: String| Error::Controller {
        device: name.clone(),
        state: "reading CAP",
        detail,
    };
    if cap.0 == u64::MAX {
        return Err(fail(
            "CAP reads all ones: the device does not answer".into(),
        ));
    }
    if !cap.css_nvm() {
        return Err(fail(
            "the controller does not support the NVM command set".into(),
        ));
    }
    if cap.mps_min_bytes() > PAGE_BYTES as u64 || cap.mps_max_bytes() < PAGE_BYTES as u64 {
        return Err(fail(format!(
            "memory page size {}..{} excludes 4 KiB",
            cap.mps_min_bytes(),
            cap.mps_max_bytes()
        )));
    }
    if cap.mqes_entries() < 2 {
        return Err(fail("MQES allows fewer than 2 queue entries".into()));
    }
    Ok(())
}

/// What the state machine learned.
#[derive(Default)]
struct Found {
    info: Option<ControllerInfo>,
    nsids: Vec<u32>,
    namespaces: Vec<NamespaceInfo>,
    io_queues: Option<u16>,
}

/// Drive bring-up (`full`: with identify) or reset (`!full`) to Ready. `on_disabled` runs once
/// the controller is disabled (CSTS.RDY=0), before it is enabled again.
#[allow(clippy::too_many_arguments)]
fn run_state_machine(
    name: &Arc<str>,
    pci: &VfioPci,
    cap: Cap,
    opts: &NvmeOptions,
    admin: &mut Admin,
    found: &mut Found,
    full: bool,
    mut on_disabled: impl FnMut(),
) -> Result<()> {
    let bar = pci.bar0();
    let ready_timeout = Duration::from_millis(cap.timeout_ms().max(500));
    let mut state = BringUp::Disable;
    let mut deadline = Instant::now();
    loop {
        let fail = |detail: String| Error::Controller {
            device: name.clone(),
            state: state.describe(),
            detail,
        };
        state = match state {
            BringUp::Disable => {
                bar.write32(reg::CC, bar.read32(reg::CC) & !cc::EN);
                deadline = Instant::now() + ready_timeout;
                BringUp::WaitDisabled
            }
            BringUp::WaitDisabled => {
                let s = bar.read32(reg::CSTS);
                if s == csts::GONE {
                    return Err(fail(
                        "CSTS reads all ones: the device does not answer".into(),
                    ));
                }
                if s & csts::RDY == 0 {
                    on_disabled();
                    BringUp::ConfigureAdmin
                } else if Instant::now() > deadline {
                    return Err(fail(format!(
                        "CSTS.RDY still 1 after CAP.TO = {ready_timeout:?} (CSTS={s:#x})"
                    )));
                } else {
                    std::thread::sleep(Duration::from_micros(100));
                    BringUp::WaitDisabled
                }
            }
            BringUp::ConfigureAdmin => {
                admin.sq.reset();
                admin.cq.reset();
                bar.write32(
                    reg::AQA,
                    spec::aqa(admin.sq.entries() as u32, admin.cq.entries() as u32),
                );
                bar.write64(reg::ASQ, admin.sq.iova());
                bar.write64(reg::ACQ, admin.cq.iova());
                BringUp::Enable
            }
            BringUp::Enable => {
                let v =
                    cc::EN | cc::CSS_NVM | cc::MPS_4K | cc::AMS_RR | cc::IOSQES_64 | cc::IOCQES_16;
                bar.write32(reg::CC, v);
                deadline = Instant::now() + ready_timeout;
                BringUp::WaitReady
            }
            BringUp::WaitReady => {
                let s = bar.read32(reg::CSTS);
                if s == csts::GONE {
                    return Err(fail(
                        "CSTS reads all ones: the device does not answer".into(),
                    ));
                }
                if s & csts::CFS != 0 {
                    return Err(fail(format!("controller fatal status (CSTS={s:#x})")));
                }
                if s & csts::RDY != 0 {
                    if full {
                        BringUp::IdentifyController
                    } else {
                        BringUp::SetQueueCount
                    }
                } else if Instant::now() > deadline {
                    return Err(fail(format!(
                        "CSTS.RDY still 0 after CAP.TO = {ready_timeout:?} (CSTS={s:#x})"
                    )));
                } else {
                    std::thread::sleep(Duration::from_micros(100));
                    BringUp::WaitReady
                }
            }
            BringUp::IdentifyController => {
                let id: IdentifyController = admin.identify(
                    name,
                    bar,
                    cns::CONTROLLER,
                    0,
                    opts.admin_timeout,
                    state.describe(),
                )?;
                found.info = Some(controller_info(&id, cap, bar.read32(reg::VS)));
                BringUp::ListNamespaces
            }
            BringUp::ListNamespaces => {
                let list: ActiveNamespaces = admin.identify(
                    name,
                    bar,
                    cns::ACTIVE_NAMESPACES,
                    0,
                    opts.admin_timeout,
                    state.describe(),
                )?;
                found.nsids = list.iter().collect();
                BringUp::IdentifyNamespaces
            }
            BringUp::IdentifyNamespaces => {
                for &nsid in &found.nsids {
                    let id: IdentifyNamespace = admin.identify(
                        name,
                        bar,
                        cns::NAMESPACE,
                        nsid,
                        opts.admin_timeout,
                        state.describe(),
                    )?;
                    if id.nsze.get() > 0 {
                        found.namespaces.push(namespace_info(nsid, &id));
                    }
                }
                BringUp::SetQueueCount
            }
            BringUp::SetQueueCount => {
                let want = opts.io_queues_max.max(1);
                let c = admin.exec(
                    name,
                    bar,
                    Command::set_number_of_queues(want, want),
                    opts.admin_timeout,
                    state.describe(),
                )?;
                let allocated = ((c.dw0 & 0xffff) as u16)
                    .min((c.dw0 >> 16) as u16)
                    .saturating_add(1);
                let granted = allocated.min(want);
                found.io_queues = Some(granted);
                if let Some(info) = found.info.as_mut() {
                    info.io_queues = granted;
                    info.io_queues_allocated = allocated;
                }
                BringUp::Ready
            }
            BringUp::Ready => return Ok(()),
        };
    }
}

fn controller_info(id: &IdentifyController, cap: Cap, vs: u32) -> ControllerInfo {
    ControllerInfo {
        vendor_id: id.vid.get(),
        subsystem_vendor_id: id.ssvid.get(),
        model: spec::ascii_field(&id.mn),
        serial: spec::ascii_field(&id.sn),
        firmware: spec::ascii_field(&id.fr),
        version: Version(vs),
        mdts_bytes: (id.mdts != 0).then(|| cap.mps_min_bytes() << id.mdts),
        max_queue_entries: cap.mqes_entries(),
        ready_timeout_ms: cap.timeout_ms(),
        doorbell_stride_bytes: cap.doorbell_stride_bytes(),
        namespace_count: id.nn.get(),
        oncs: id.oncs.get(),
        volatile_write_cache: id.vwc & 1 == 1,
        atomic_write_blocks: id.awupf.get() as u32 + 1,
        io_queues: 0,
        io_queues_allocated: 0,
    }
}

fn namespace_info(nsid: u32, id: &IdentifyNamespace) -> NamespaceInfo {
    NamespaceInfo {
        nsid,
        blocks: id.nsze.get(),
        block_bytes: id.block_bytes(),
        format_index: id.flbas & 0xf,
        formats: id
            .formats()
            .iter()
            .map(|f| LbaFormatInfo {
                block_bytes: 1 << f.lbads,
                metadata_bytes: f.ms.get(),
                relative_performance: f.rp & 3,
            })
            .collect(),
        atomic_write_blocks: (id.nsfeat & 2 != 0).then(|| id.nawupf.get() as u32 + 1),
    }
}

impl Admin {
    /// Submit `cmd`, ring, and poll for its completion until `timeout`.
    fn exec(
        &mut self,
        name: &Arc<str>,
        bar: &super::vfio::Bar,
        mut cmd: Command,
        timeout: Duration,
        what: &'static str,
    ) -> Result<Completion> {
        let cid = self.next_cid;
        self.next_cid = (self.next_cid + 1) % ADMIN_QUEUE_ENTRIES;
        cmd.set_cid(cid);
        if self.sq.space() == 0 {
            // Only possible if earlier commands timed out and never completed.
            return Err(Error::Controller {
                device: name.clone(),
                state: what,
                detail: "the admin queue is full of commands that never completed".into(),
            });
        }
        self.sq.push(&cmd);
        self.sq.ring();
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(c) = self.cq.peek() {
                self.cq.advance();
                self.cq.ring();
                self.sq.set_head(c.sq_head);
                if c.cid != cid {
                    tracing::warn!(device = %name, "stale admin completion for cid {}", c.cid);
                    continue;
                }
                let status = c.status();
                if !status.is_success() {
                    return Err(Error::Nvme {
                        device: name.clone(),
                        op: what,
                        kind: status.kind(),
                        status_type: status.sct,
                        status_code: status.sc,
                        meaning: status.meaning(),
                    });
                }
                return Ok(c);
            }
            spins += 1;
            if spins.is_multiple_of(1024) {
                let s = bar.read32(reg::CSTS);
                if s == csts::GONE || s & csts::CFS != 0 {
                    return Err(Error::Controller {
                        device: name.clone(),
                        state: what,
                        detail: format!("controller failed during an admin command (CSTS={s:#x})"),
                    });
                }
                if start.elapsed() > timeout {
                    return Err(Error::Controller {
                        device: name.clone(),
                        state: what,
                        detail: format!(
                            "admin command opcode {:#04x} did not complete within {timeout:?} \
                             (CSTS={s:#x})",
                            cmd.opcode()
                        ),
                    });
                }
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
    }

    /// Identify `cns`/`nsid` into the admin page and copy the result out.
    fn identify<T: FromBytes>(
        &mut self,
        name: &Arc<str>,
        bar: &super::vfio::Bar,
        cns: u32,
        nsid: u32,
        timeout: Duration,
        what: &'static str,
    ) -> Result<T> {
        self.page.fill(0, PAGE_BYTES, 0);
        let cmd = Command::identify(cns, nsid, self.page.iova());
        self.exec(name, bar, cmd, timeout, what)?;
        let mut bytes = [0u8; PAGE_BYTES];
        self.page.read_at(0, &mut bytes);
        Ok(T::read_from_bytes(&bytes[..]).expect("identify structures are 4096 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(mdts: Option<u64>, mqes: u32) -> ControllerInfo {
        ControllerInfo {
            vendor_id: 0x1b36,
            subsystem_vendor_id: 0x1af4,
            model: "QEMU NVMe Ctrl".into(),
            serial: "S".into(),
            firmware: "10.0.2".into(),
            version: Version(0x10400),
            mdts_bytes: mdts,
            max_queue_entries: mqes,
            ready_timeout_ms: 7500,
            doorbell_stride_bytes: 4,
            namespace_count: 2,
            oncs: spec::ONCS_DSM | spec::ONCS_WRITE_ZEROES,
            volatile_write_cache: true,
            atomic_write_blocks: 1,
            io_queues: 8,
            io_queues_allocated: 64,
        }
    }

    #[test]
    fn layout_splits_above_mdts() {
        let opts = NvmeOptions::default();
        let l = QueueLayout::new(&opts, &info(Some(128 << 10), 2048)).unwrap();
        assert_eq!(l.command_bytes_max, 128 << 10);
        assert_eq!(l.max_transfer_bytes, 1 << 20);
        assert_eq!(l.commands, 128 * 8);
        assert_eq!(l.entries, 128 * 8 + 1);
        assert_eq!(l.depth, 128);
        assert_eq!(l.prp_slot_bytes, 256, "32 entries of 8 bytes");
    }

    #[test]
    fn layout_respects_mqes_and_unlimited_mdts() {
        let opts = NvmeOptions::default();
        let l = QueueLayout::new(&opts, &info(None, 64)).unwrap();
        assert_eq!(l.command_bytes_max, COMMAND_BYTES_CAP);
        assert_eq!(l.commands, 63);
        assert_eq!(l.depth, 63, "depth shrinks to what the queue can hold");
        assert_eq!(l.prp_slot_bytes, 2048, "256 entries of 8 bytes");
        assert!(QueueLayout::new(&opts, &info(Some(2048), 64)).is_err());
    }

    #[test]
    fn bring_up_states_have_names() {
        assert_eq!(
            BringUp::WaitDisabled.describe(),
            "waiting for CSTS.RDY=0 after disable"
        );
        assert!(BringUp::WaitReady.describe().contains("CSTS.RDY=1"));
    }
}
