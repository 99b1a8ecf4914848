//! I/O queue pairs: the hot path.
//!
//! One [`NvmeQueue`] per thread, lock-free: it owns an SQ/CQ pair, command-id-indexed
//! trackers and request slots, all preallocated when the controller opens. `submit` turns a
//! request into one or more commands (split at MDTS, PRP lists written into the tracker's
//! preallocated list slot) and queues them without touching the doorbell; `kick`/`poll`/`wait`
//! ring the SQ tail doorbell once per batch (after a write barrier), reap at most
//! [`REAP_MAX`] completions per call by phase tag, and ring the CQ head doorbell once.
//! Nothing on this path allocates.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::controller::{Controller, QueueLayout};
use super::ring::{Cq, Doorbell, Sq};
use super::spec::{
    self, io_op, Command, DsmRange, Status, StatusKind, CQE_BYTES, NLB_MAX, PAGE_BYTES, SQE_BYTES,
};
use crate::device::{Completion, Geometry, Op, QueueHandle, Request, SubmitError};
use crate::dma::DmaBuf;
use crate::error::{Error, Result};

/// Most completion entries reaped by one poll, so one busy queue cannot starve its caller's
/// other work (and the CQ head doorbell is written at least this often).
pub const REAP_MAX: usize = 64;
/// Consumed completion entries reported to the controller in one CQ head doorbell write (the
/// doorbell is written earlier when the CQ could otherwise run out of free entries).
pub const CQ_DOORBELL_BATCH: u16 = 16;
/// First and longest sleep of a `wait` that has stopped spinning (see
/// [`NvmeOptions::wait_spin`](super::NvmeOptions::wait_spin)).
const WAIT_NAP_MIN: Duration = Duration::from_micros(5);
const WAIT_NAP_MAX: Duration = Duration::from_micros(500);
/// Polls without progress between checks of command timeouts and CSTS.
const HEALTH_CHECK_POLLS: u32 = 4096;
/// Longest a `wait` goes between checks of command timeouts and CSTS.
const HEALTH_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// What a namespace-bound queue needs to know.
#[derive(Debug)]
pub(crate) struct NsContext {
    pub name: Arc<str>,
    pub nsid: u32,
    pub geometry: Geometry,
    pub write_zeroes: bool,
    pub deallocate: bool,
}

#[derive(Clone, Copy, Default)]
struct Tracker {
    /// Request slot this command belongs to.
    req: u16,
    busy: bool,
}

struct ReqSlot {
    busy: bool,
    tag: u64,
    op: Op,
    lba: u64,
    blocks: u32,
    buf: Option<DmaBuf>,
    /// Commands of this request not yet completed.
    pending: u16,
    error: Option<Error>,
    started: Instant,
    /// Outlived the command timeout and was aborted.
    timed_out: bool,
}

/// An I/O SQ/CQ pair with its trackers. Lives in the controller's pool when no handle has it.
pub(crate) struct QueuePair {
    qid: u16,
    sq: Sq,
    cq: Cq,
    generation: Option<u64>,
    layout: QueueLayout,
    trackers: Box<[Tracker]>,
    free_cids: Vec<u16>,
    reqs: Box<[ReqSlot]>,
    free_reqs: Vec<u16>,
    /// Finished request slots waiting to be handed out by poll.
    done: VecDeque<u16>,
    /// PRP lists / DSM ranges: `prp_slot_bytes` per command id.
    prp: DmaBuf,
    in_flight: usize,
}

impl QueuePair {
    pub(crate) fn new(ctrl: &Controller, qid: u16) -> Result<Self> {
        let l = *ctrl.layout();
        let stride = ctrl.info().doorbell_stride_bytes;
        let arena = ctrl.arena();
        let bar = ctrl.bar();
        let sq = Sq::new(
            arena.alloc(l.entries as usize * SQE_BYTES)?,
            l.entries,
            Doorbell::new(bar.register_ptr(spec::sq_tail_doorbell(qid, stride))),
        );
        let cq = Cq::new(
            arena.alloc(l.entries as usize * CQE_BYTES)?,
            l.entries,
            Doorbell::new(bar.register_ptr(spec::cq_head_doorbell(qid, stride))),
        );
        let prp = arena.alloc(l.commands as usize * l.prp_slot_bytes)?;
        let now = Instant::now();
        let mut pair = QueuePair {
            qid,
            sq,
            cq,
            generation: None,
            layout: l,
            trackers: vec![Tracker::default(); l.commands as usize].into_boxed_slice(),
            free_cids: Vec::with_capacity(l.commands as usize),
            reqs: (0..l.depth)
                .map(|_| ReqSlot {
                    busy: false,
                    tag: 0,
                    op: Op::Flush,
                    lba: 0,
                    blocks: 0,
                    buf: None,
                    pending: 0,
                    error: None,
                    started: now,
                    timed_out: false,
                })
                .collect(),
            free_reqs: Vec::with_capacity(l.depth as usize),
            done: VecDeque::with_capacity(l.depth as usize),
            prp,
            in_flight: 0,
        };
        pair.reset_free_lists();
        Ok(pair)
    }

    fn reset_free_lists(&mut self) {
        self.free_cids.clear();
        self.free_cids.extend((0..self.layout.commands).rev());
        self.free_reqs.clear();
        self.free_reqs.extend((0..self.layout.depth as u16).rev());
        self.trackers.fill(Tracker::default());
    }

    pub(crate) fn qid(&self) -> u16 {
        self.qid
    }
    pub(crate) fn entries(&self) -> u16 {
        self.layout.entries
    }
    pub(crate) fn sq_iova(&self) -> u64 {
        self.sq.iova()
    }
    pub(crate) fn cq_iova(&self) -> u64 {
        self.cq.iova()
    }
    pub(crate) fn generation(&self) -> Option<u64> {
        self.generation
    }
    pub(crate) fn set_generation(&mut self, g: Option<u64>) {
        self.generation = g;
    }

    /// Zero the CQ and rewind both rings (the queue is about to be created on the device).
    /// Only valid with nothing outstanding.
    pub(crate) fn reset_rings(&mut self) {
        assert!(
            self.trackers.iter().all(|t| !t.busy),
            "ring reset with commands outstanding"
        );
        self.sq.reset();
        self.cq.reset();
    }

    /// Fail every outstanding request with `error()` (the device has dropped them: the
    /// controller was reset or the queue deleted) and queue them for delivery.
    fn fail_outstanding(&mut self, error: impl Fn() -> Error) {
        for i in 0..self.reqs.len() {
            let r = &mut self.reqs[i];
            if r.busy && r.pending > 0 {
                r.pending = 0;
                r.error.get_or_insert_with(&error);
                self.done.push_back(i as u16);
            }
        }
        self.trackers.fill(Tracker::default());
        self.free_cids.clear();
        self.free_cids.extend((0..self.layout.commands).rev());
    }

    /// Address of command `cid`'s PRP list slot: (pointer, iova).
    fn prp_slot(&mut self, cid: u16) -> (*mut u8, u64) {
        let off = cid as usize * self.layout.prp_slot_bytes;
        // SAFETY: cid < commands, and prp holds commands * prp_slot_bytes bytes.
        let ptr = unsafe { self.prp.as_mut_ptr().add(off) };
        (ptr, self.prp.iova() + off as u64)
    }

    /// Reap up to REAP_MAX completions into `done`. Returns how many CQEs were consumed.
    fn reap(&mut self, ns: &NsContext) -> usize {
        let mut n = 0;
        while n < REAP_MAX {
            let Some(c) = self.cq.peek() else { break };
            self.cq.advance();
            self.sq.set_head(c.sq_head);
            n += 1;
            let cid = c.cid as usize;
            if cid >= self.trackers.len() || !self.trackers[cid].busy {
                tracing::warn!(device = %ns.name, qid = self.qid, "completion for idle cid {cid}");
                continue;
            }
            let t = std::mem::take(&mut self.trackers[cid]);
            self.free_cids.push(c.cid);
            let slot = t.req as usize;
            let r = &mut self.reqs[slot];
            let status = c.status();
            if !status.is_success() && r.error.is_none() {
                r.error = Some(if r.timed_out && status.kind() == StatusKind::Aborted {
                    Error::Timeout {
                        device: ns.name.clone(),
                        what: "an NVMe command (aborted after its command timeout)",
                        timeout: r.started.elapsed(),
                    }
                } else {
                    status_error(ns, r.op, r.lba, r.blocks, status)
                });
            }
            r.pending -= 1;
            if r.pending == 0 {
                self.done.push_back(slot as u16);
            }
        }
        if self.cq.unrung() >= CQ_DOORBELL_BATCH.min(self.layout.entries / 4) {
            self.cq.ring();
        }
        n
    }

    /// Commands submitted and not yet completed.
    fn outstanding_commands(&self) -> usize {
        self.layout.commands as usize - self.free_cids.len()
    }

    /// Hand out up to `out.len()` finished requests.
    fn deliver(&mut self, out: &mut [Completion]) -> usize {
        let mut k = 0;
        while k < out.len() {
            let Some(slot) = self.done.pop_front() else {
                break;
            };
            let r = &mut self.reqs[slot as usize];
            out[k] = Completion {
                tag: r.tag,
                op: r.op,
                result: r.error.take().map_or(Ok(()), Err),
                buf: r.buf.take(),
            };
            r.busy = false;
            self.free_reqs.push(slot);
            self.in_flight -= 1;
            k += 1;
        }
        k
    }

    /// Take a request slot and `commands` command ids, if available.
    fn reserve(&mut self, commands: usize) -> Option<u16> {
        if self.free_reqs.is_empty()
            || self.free_cids.len() < commands
            || (self.sq.space() as usize) < commands
        {
            return None;
        }
        self.free_reqs.pop()
    }

    /// Queue one command for request `slot`; the caller reserved a cid and SQ space.
    fn push(&mut self, slot: u16, mut cmd: Command) {
        // The controller may post a completion for every outstanding command; it sees as free
        // only the CQ entries behind the head we last reported. Report consumed entries before
        // they are needed: unreported + outstanding must stay below the CQ size.
        if self.cq.unrung() as usize + self.outstanding_commands() + 1
            > self.layout.commands as usize
        {
            self.cq.ring();
        }
        let cid = self.free_cids.pop().expect("reserved cid");
        self.trackers[cid as usize] = Tracker {
            req: slot,
            busy: true,
        };
        cmd.set_cid(cid);
        self.sq.push(&cmd);
    }

    /// The cid `push` will use next (to write its PRP list first).
    fn next_cid(&self) -> u16 {
        *self.free_cids.last().expect("reserved cid")
    }
}

/// The typed error for a failed NVMe status.
fn status_error(ns: &NsContext, op: Op, lba: u64, blocks: u32, s: Status) -> Error {
    match s.kind() {
        StatusKind::LbaOutOfRange => Error::OutOfRange {
            device: ns.name.clone(),
            lba,
            blocks,
            capacity: ns.geometry.capacity_blocks,
        },
        StatusKind::Media => Error::Media {
            device: ns.name.clone(),
            op: op.name(),
            lba,
            blocks,
            detail: format!(
                "NVMe status {} (type {:#x}, code {:#04x})",
                s.meaning(),
                s.sct,
                s.sc
            ),
        },
        kind => Error::Nvme {
            device: ns.name.clone(),
            op: op.name(),
            kind,
            status_type: s.sct,
            status_code: s.sc,
            meaning: s.meaning(),
        },
    }
}

/// Where the PRP entries of one command go (Base 1.4 §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrpLayout {
    /// The transfer fits in the first page: PRP2 unused.
    One { prp1: u64 },
    /// Exactly two pages: PRP2 is the second page.
    Two { prp1: u64, prp2: u64 },
    /// More: PRP2 points to a list of `count` page addresses starting at `first`.
    List { prp1: u64, first: u64, count: usize },
}

/// The PRP layout for `len` bytes at device address `iova` (dword aligned, len > 0).
pub fn prp_layout(iova: u64, len: usize) -> PrpLayout {
    debug_assert!(iova.is_multiple_of(4) && len > 0);
    let page = PAGE_BYTES as u64;
    let first_len = page - iova % page;
    if len as u64 <= first_len {
        return PrpLayout::One { prp1: iova };
    }
    let next = iova + first_len;
    let rest = len as u64 - first_len;
    if rest <= page {
        return PrpLayout::Two {
            prp1: iova,
            prp2: next,
        };
    }
    PrpLayout::List {
        prp1: iova,
        first: next,
        count: rest.div_ceil(page) as usize,
    }
}

/// A queue handle for one namespace. Owned by one thread; `Send`, never shared.
pub struct NvmeQueue {
    ctrl: Arc<Controller>,
    ns: Arc<NsContext>,
    pair: Option<QueuePair>,
    idle_polls: u32,
    last_health_check: Instant,
}

/// A command the caller builds: sent as is, with PRPs for its data. For tools and the hardware
/// suite (invalid namespace, vendor commands); the normal path is [`QueueHandle::submit`].
#[derive(Debug)]
pub struct RawCommand {
    /// Opcode, NSID and command dwords 10–15; CID and PRPs are filled in by the queue.
    pub command: Command,
    /// Data buffer and (offset, length) in it, if the command moves data.
    pub data: Option<(DmaBuf, usize, usize)>,
    /// How the completion reports it.
    pub op: Op,
    pub tag: u64,
}

impl NvmeQueue {
    pub(crate) fn open(ctrl: &Arc<Controller>, ns: &Arc<NsContext>) -> Result<Self> {
        let pair = ctrl.take_pair().ok_or_else(|| Error::NoQueue {
            device: ns.name.clone(),
            count: ctrl.info().io_queues as u32,
        })?;
        let mut q = NvmeQueue {
            ctrl: ctrl.clone(),
            ns: ns.clone(),
            pair: Some(pair),
            idle_polls: 0,
            last_health_check: Instant::now(),
        };
        q.sync_generation()?;
        Ok(q)
    }

    /// The I/O queue ID this handle drives.
    pub fn qid(&self) -> u16 {
        self.pair().qid
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctrl
    }

    fn pair(&self) -> &QueuePair {
        self.pair.as_ref().expect("queue pair present until drop")
    }

    fn pair_mut(&mut self) -> &mut QueuePair {
        self.pair.as_mut().expect("queue pair present until drop")
    }

    /// After a controller reset: fail what was outstanding and re-create the queues.
    fn sync_generation(&mut self) -> Result<()> {
        let g = self.ctrl.generation();
        if self.pair().generation == Some(g) {
            return Ok(());
        }
        if self.ctrl.is_failed() {
            let (name, ctrl) = (self.ns.name.clone(), self.ctrl.clone());
            self.pair_mut().fail_outstanding(|| Error::Gone {
                device: name.clone(),
                reason: "the controller failed and could not be reset",
            });
            return Err(Error::Controller {
                device: ctrl.name().clone(),
                state: "failed",
                detail: format!("last reset: {}; reopen the device", ctrl.reset_cause()),
            });
        }
        if self.pair().generation.is_some() {
            let (name, cause) = (self.ns.name.clone(), self.ctrl.reset_cause());
            self.pair_mut().fail_outstanding(|| Error::Gone {
                device: name.clone(),
                reason: cause,
            });
        }
        // Commands the device dropped are failed; the rings start over. Requests waiting in
        // `done` stay there (they no longer hold command ids).
        let pair = self.pair.as_mut().expect("pair");
        self.ctrl.create_io_queue(pair)
    }

    fn geometry(&self) -> &Geometry {
        &self.ns.geometry
    }

    /// Commands a request needs.
    fn commands_for(&self, req: &Request) -> usize {
        let bs = self.geometry().block_size;
        match req.op {
            Op::Read | Op::Write { .. } => {
                let per = (self.pair().layout.command_bytes_max / bs).max(1);
                req.blocks.div_ceil(per) as usize
            }
            Op::WriteZeroes => req.blocks.div_ceil(NLB_MAX) as usize,
            Op::Flush | Op::Deallocate => 1,
        }
    }

    fn check_supported(&self, req: &Request) -> Result<()> {
        let unsupported = |what: &str| Error::Invalid {
            device: self.ns.name.clone(),
            detail: format!("the controller does not support {what} (ONCS)"),
        };
        match req.op {
            Op::WriteZeroes if !self.ns.write_zeroes => Err(unsupported("Write Zeroes")),
            Op::Deallocate if !self.ns.deallocate => Err(unsupported("Dataset Management")),
            _ => Ok(()),
        }
    }

    /// Queue `raw` (see [`RawCommand`]). The buffer range must be dword aligned and at most one
    /// command's transfer size (MDTS).
    pub fn submit_raw(&mut self, raw: RawCommand) -> Result<(), Box<(Error, RawCommand)>> {
        if let Err(e) = self.sync_generation() {
            return Err(Box::new((e, raw)));
        }
        if let Some((buf, off, len)) = &raw.data {
            let bad = !(buf.iova() + *off as u64).is_multiple_of(4)
                || *len == 0
                || off.saturating_add(*len) > buf.len()
                || *len > self.pair().layout.command_bytes_max as usize;
            if bad {
                let e = Error::Invalid {
                    device: self.ns.name.clone(),
                    detail: format!(
                        "raw command data range {off}+{len} of a {}-byte buffer is unaligned, \
                         empty, out of bounds or above MDTS",
                        buf.len()
                    ),
                };
                return Err(Box::new((e, raw)));
            }
        }
        let ns = self.ns.clone();
        let pair = self.pair_mut();
        let Some(slot) = pair.reserve(1) else {
            let e = Error::Invalid {
                device: ns.name.clone(),
                detail: "queue full".into(),
            };
            return Err(Box::new((e, raw)));
        };
        let RawCommand {
            mut command,
            data,
            op,
            tag,
        } = raw;
        let (buf, iova_len) = match data {
            Some((b, off, len)) => {
                let at = b.iova() + off as u64;
                (Some(b), Some((at, len)))
            }
            None => (None, None),
        };
        if let Some((iova, len)) = iova_len {
            fill_prps(pair, &mut command, iova, len);
        }
        start_request(
            pair,
            slot,
            tag,
            op,
            command.cdw10 as u64 | (command.cdw11 as u64) << 32,
            (command.cdw12 & 0xffff) + 1,
            buf,
            1,
        );
        pair.push(slot, command);
        Ok(())
    }

    /// Queue a data command whose PRPs point at `iova` directly, bypassing the buffer checks.
    ///
    /// # Safety
    /// The device will read or write `len` bytes at `iova`. If that range is mapped in this
    /// controller's IOMMU domain, the caller must own the memory behind it exclusively and not
    /// touch it until the completion. Unmapped IOVAs are blocked by the IOMMU (the use this
    /// exists for: proving DMA confinement).
    pub unsafe fn submit_raw_iova(
        &mut self,
        mut command: Command,
        iova: u64,
        len: usize,
        op: Op,
        tag: u64,
    ) -> Result<()> {
        self.sync_generation()?;
        assert!(
            iova.is_multiple_of(4)
                && len > 0
                && len <= self.pair().layout.command_bytes_max as usize
        );
        let name = self.ns.name.clone();
        let pair = self.pair_mut();
        let slot = pair.reserve(1).ok_or_else(|| Error::Invalid {
            device: name,
            detail: "queue full".into(),
        })?;
        fill_prps(pair, &mut command, iova, len);
        start_request(pair, slot, tag, op, 0, 0, None, 1);
        pair.push(slot, command);
        Ok(())
    }

    /// Check for commands past their timeout (abort them, then reset the controller) and for a
    /// fatal controller status (reset). Called from `wait` and from idle polls.
    fn health_check(&mut self) -> Result<()> {
        self.last_health_check = Instant::now();
        self.idle_polls = 0;
        if let Err(e) = self.ctrl.check_fatal() {
            tracing::error!("{e}");
            let g = self.ctrl.generation();
            return self
                .ctrl
                .reset(
                    "controller fatal status (CSTS.CFS=1); the controller was reset",
                    Some(g),
                )
                .and_then(|()| self.sync_generation());
        }
        let timeout = self.ctrl.options().command_timeout;
        let now = Instant::now();
        let expired = self
            .pair()
            .reqs
            .iter()
            .any(|r| r.busy && r.pending > 0 && now.duration_since(r.started) > timeout);
        if expired {
            self.recover_timeouts(timeout)?;
        }
        Ok(())
    }

    /// Abort every command of every expired request; if they do not complete within the abort
    /// timeout, reset the controller (which fails everything outstanding on every queue).
    fn recover_timeouts(&mut self, timeout: Duration) -> Result<()> {
        let g = self.ctrl.generation();
        let now = Instant::now();
        let qid = self.pair().qid;
        let mut aborted = Vec::new(); // the error path may allocate
        for (cid, t) in self.pair().trackers.iter().enumerate() {
            let r = &self.pair().reqs[t.req as usize];
            if t.busy && now.duration_since(r.started) > timeout {
                aborted.push((cid as u16, t.req));
            }
        }
        tracing::warn!(
            device = %self.ns.name,
            qid,
            "{} command(s) outstanding longer than {timeout:?}: aborting",
            aborted.len()
        );
        for &(cid, req) in &aborted {
            self.pair_mut().reqs[req as usize].timed_out = true;
            if let Err(e) = self.ctrl.abort(qid, cid) {
                tracing::warn!("abort of cid {cid} failed: {e}");
            }
        }
        let deadline = Instant::now() + self.ctrl.options().abort_timeout;
        let ns = self.ns.clone();
        while Instant::now() < deadline {
            self.pair_mut().reap(&ns);
            if aborted
                .iter()
                .all(|&(cid, _)| !self.pair().trackers[cid as usize].busy)
            {
                return Ok(());
            }
            std::thread::yield_now();
        }
        self.ctrl.reset(
            "a command timed out and Abort did not complete it; the controller was reset and \
             every outstanding command failed",
            Some(g),
        )?;
        self.sync_generation()
    }
}

/// Fill PRP1/PRP2 of `cmd` for `len` bytes at `iova`, writing a PRP list into the slot of the
/// cid the next `push` will use.
fn fill_prps(pair: &mut QueuePair, cmd: &mut Command, iova: u64, len: usize) {
    match prp_layout(iova, len) {
        PrpLayout::One { prp1 } => {
            cmd.prp1 = prp1;
            cmd.prp2 = 0;
        }
        PrpLayout::Two { prp1, prp2 } => {
            cmd.prp1 = prp1;
            cmd.prp2 = prp2;
        }
        PrpLayout::List { prp1, first, count } => {
            let cid = pair.next_cid();
            let (ptr, list_iova) = pair.prp_slot(cid);
            assert!(
                count * 8 <= pair.layout.prp_slot_bytes,
                "PRP list of {count} entries exceeds its slot"
            );
            for k in 0..count {
                // SAFETY: k * 8 + 8 <= prp_slot_bytes (asserted); the slot belongs to this cid,
                // which is free, so the device is not reading it; 8-byte aligned.
                unsafe {
                    std::ptr::write_volatile(
                        (ptr as *mut u64).add(k),
                        first + (k * PAGE_BYTES) as u64,
                    )
                };
            }
            cmd.prp1 = prp1;
            cmd.prp2 = list_iova;
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn start_request(
    pair: &mut QueuePair,
    slot: u16,
    tag: u64,
    op: Op,
    lba: u64,
    blocks: u32,
    buf: Option<DmaBuf>,
    commands: u16,
) {
    let r = &mut pair.reqs[slot as usize];
    debug_assert!(!r.busy);
    *r = ReqSlot {
        busy: true,
        tag,
        op,
        lba,
        blocks,
        buf,
        pending: commands,
        error: None,
        started: Instant::now(),
        timed_out: false,
    };
    pair.in_flight += 1;
}

impl QueueHandle for NvmeQueue {
    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        if let Err(e) = self.sync_generation() {
            return Err(SubmitError::rejected(e, req));
        }
        if let Err(e) = req
            .validate(&self.ns.name, &self.ns.geometry)
            .and_then(|()| self.check_supported(&req))
        {
            return Err(SubmitError::rejected(e, req));
        }
        let commands = self.commands_for(&req);
        if commands > self.pair().layout.commands as usize {
            let e = Error::Invalid {
                device: self.ns.name.clone(),
                detail: format!(
                    "{} of {} blocks needs {commands} commands; a queue holds {}: split it",
                    req.op.name(),
                    req.blocks,
                    self.pair().layout.commands
                ),
            };
            return Err(SubmitError::rejected(e, req));
        }
        let nsid = self.ns.nsid;
        let bs = self.ns.geometry.block_size;
        let pair = self.pair.as_mut().expect("pair");
        let Some(slot) = pair.reserve(commands) else {
            return Err(SubmitError::full(req));
        };
        let Request {
            op,
            lba,
            blocks,
            buf,
            buf_offset,
            tag,
        } = req;
        let base_iova = buf.as_ref().map(|b| b.iova() + buf_offset as u64);
        start_request(pair, slot, tag, op, lba, blocks, buf, commands as u16);
        match op {
            Op::Read | Op::Write { .. } => {
                let per = (pair.layout.command_bytes_max / bs).max(1);
                let (opcode, fua) = match op {
                    Op::Write { fua } => (io_op::WRITE, fua),
                    _ => (io_op::READ, false),
                };
                let base_iova = base_iova.expect("validated data op has a buffer");
                let mut done = 0u32;
                while done < blocks {
                    let n = per.min(blocks - done);
                    let mut cmd = Command::read_write(opcode, nsid, lba + done as u64, n, fua);
                    let at = base_iova + done as u64 * bs as u64;
                    fill_prps(pair, &mut cmd, at, (n * bs) as usize);
                    pair.push(slot, cmd);
                    done += n;
                }
            }
            Op::Flush => pair.push(slot, Command::new(io_op::FLUSH, nsid)),
            Op::WriteZeroes => {
                let mut done = 0u32;
                while done < blocks {
                    let n = NLB_MAX.min(blocks - done);
                    pair.push(slot, Command::write_zeroes(nsid, lba + done as u64, n));
                    done += n;
                }
            }
            Op::Deallocate => {
                let cid = pair.next_cid();
                let (ptr, iova) = pair.prp_slot(cid);
                let range = DsmRange {
                    cattr: 0.into(),
                    nlb: blocks.into(),
                    slba: lba.into(),
                };
                // SAFETY: the slot (at least 64 bytes) belongs to the free cid the next push
                // uses; the device is not reading it; DsmRange has alignment 1.
                unsafe { std::ptr::write_volatile(ptr as *mut DsmRange, range) };
                let mut cmd = Command::deallocate(nsid, 1);
                cmd.prp1 = iova;
                pair.push(slot, cmd);
            }
        }
        Ok(())
    }

    fn kick(&mut self) -> Result<()> {
        self.sync_generation()?;
        self.pair_mut().sq.ring();
        Ok(())
    }

    fn poll(&mut self, out: &mut [Completion]) -> Result<usize> {
        if let Err(e) = self.sync_generation() {
            // The controller is gone for good: still hand back the requests it failed (with
            // their buffers) before reporting the error itself.
            let n = self.pair_mut().deliver(out);
            return if n > 0 { Ok(n) } else { Err(e) };
        }
        let ns = self.ns.clone();
        let pair = self.pair.as_mut().expect("pair");
        pair.sq.ring();
        let reaped = pair.reap(&ns);
        let n = pair.deliver(out);
        if reaped == 0 && pair.in_flight > 0 {
            self.idle_polls += 1;
            if self.idle_polls >= HEALTH_CHECK_POLLS
                && self.last_health_check.elapsed() >= HEALTH_CHECK_INTERVAL
            {
                self.health_check()?;
            }
        } else {
            self.idle_polls = 0;
        }
        Ok(n)
    }

    fn wait(&mut self, out: &mut [Completion], min: usize, timeout: Duration) -> Result<usize> {
        let start = Instant::now();
        let spin_limit = self.ctrl.options().wait_spin;
        let mut last_progress = start;
        let mut nap = WAIT_NAP_MIN;
        let mut got = 0;
        let mut spins = 0u32;
        loop {
            let want = min.min(out.len()).min(got + self.in_flight());
            let n = self.poll(&mut out[got..])?;
            got += n;
            if got >= want {
                return Ok(got);
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                let now = Instant::now();
                if n > 0 {
                    last_progress = now;
                    nap = WAIT_NAP_MIN;
                }
                if now.duration_since(self.last_health_check) >= HEALTH_CHECK_INTERVAL {
                    self.health_check()?;
                }
                if now.duration_since(start) > timeout {
                    return Err(Error::Timeout {
                        device: self.ns.name.clone(),
                        what: "NVMe completions",
                        timeout,
                    });
                }
                match spin_limit {
                    Some(limit) if now.duration_since(last_progress) > limit => {
                        std::thread::sleep(nap);
                        nap = (nap * 2).min(WAIT_NAP_MAX);
                    }
                    _ => std::thread::yield_now(),
                }
            } else if n > 0 {
                last_progress = Instant::now();
                nap = WAIT_NAP_MIN;
            }
            std::hint::spin_loop();
        }
    }

    fn in_flight(&self) -> usize {
        self.pair().in_flight
    }

    fn depth(&self) -> usize {
        self.pair().layout.depth as usize
    }
}

impl Drop for NvmeQueue {
    fn drop(&mut self) {
        let Some(mut pair) = self.pair.take() else {
            return;
        };
        if pair.in_flight > 0 {
            // Deleting the SQ aborts its commands inside the device; only then may the buffers
            // they point at be freed.
            if let Err(e) = self.ctrl.delete_io_queue(&mut pair) {
                tracing::error!(device = %self.ns.name, "deleting queue {}: {e}", pair.qid);
                let g = self.ctrl.generation();
                let _ = self.ctrl.reset(
                    "a queue with commands outstanding could not be deleted",
                    Some(g),
                );
            }
            pair.fail_outstanding(|| Error::Gone {
                device: self.ns.name.clone(),
                reason: "queue dropped",
            });
            while let Some(slot) = pair.done.pop_front() {
                let r = &mut pair.reqs[slot as usize];
                r.busy = false;
                r.buf = None;
                r.error = None;
            }
            pair.in_flight = 0;
            pair.reset_free_lists();
        }
        self.ctrl.return_pair(pair);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prp_one_two_and_list() {
        let base = 0x1_0000_0000u64;
        assert_eq!(prp_layout(base, 4096), PrpLayout::One { prp1: base });
        assert_eq!(
            prp_layout(base + 4, 4092),
            PrpLayout::One { prp1: base + 4 }
        );
        assert_eq!(
            prp_layout(base + 4, 4096),
            PrpLayout::Two {
                prp1: base + 4,
                prp2: base + 4096
            }
        );
        assert_eq!(
            prp_layout(base, 8192),
            PrpLayout::Two {
                prp1: base,
                prp2: base + 4096
            }
        );
        assert_eq!(
            prp_layout(base, 8192 + 512),
            PrpLayout::List {
                prp1: base,
                first: base + 4096,
                count: 2
            }
        );
        // 128 KiB from a dword offset spans 33 pages: 32 list entries
        assert_eq!(
            prp_layout(base + 4, 128 << 10),
            PrpLayout::List {
                prp1: base + 4,
                first: base + 4096,
                count: 32
            }
        );
    }

    #[test]
    fn prp_list_entries_cover_the_transfer() {
        for off in [0u64, 4, 512, 4092] {
            for len in [512usize, 4096, 4100, 12288, 65536, 131072] {
                let iova = 0x2_0000_0000 + off;
                let covered = match prp_layout(iova, len) {
                    PrpLayout::One { .. } => 4096 - off,
                    PrpLayout::Two { prp2, .. } => {
                        assert_eq!(prp2 % 4096, 0);
                        4096 - off + 4096
                    }
                    PrpLayout::List { first, count, .. } => {
                        assert_eq!(first % 4096, 0);
                        4096 - off + count as u64 * 4096
                    }
                };
                assert!(covered >= len as u64, "off {off} len {len}");
                assert!(covered < len as u64 + 4096 + 4096 - off, "no extra page");
            }
        }
    }
}
