//! NVMe structures and constants, each citing the NVM Express Base Specification revision 1.4
//! ("Base 1.4") section it comes from. Every struct is `#[repr(C)]` with a compile-time size
//! assert; data structures the controller writes (identify pages) use zerocopy's unaligned
//! little-endian field types and derive `IntoBytes`, which proves the layout has no padding.
//!
//! Nothing here touches hardware: these are plain values that the queue and register modules
//! copy into and out of device-visible memory.

use std::mem::size_of;

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

#[cfg(not(target_endian = "little"))]
compile_error!("the NVMe driver writes queue entries in host byte order: little-endian hosts only");

/// Memory page size the driver programs into CC.MPS (Base 1.4 §3.1.5: MPS = 0 → 4 KiB).
pub const PAGE_BYTES: usize = 4096;
/// log2 of [`PAGE_BYTES`].
pub const PAGE_SHIFT: u32 = 12;
const _: () = assert!(1 << PAGE_SHIFT == PAGE_BYTES);

/// Submission queue entry size: 2^6 = 64 bytes (Base 1.4 §4.2, CC.IOSQES).
pub const SQE_BYTES: usize = 64;
/// Completion queue entry size: 2^4 = 16 bytes (Base 1.4 §4.6, CC.IOCQES).
pub const CQE_BYTES: usize = 16;

/// Controller register offsets in BAR0 (Base 1.4 §3.1, Figure 78).
pub mod reg {
    /// Controller Capabilities, 64 bit (§3.1.1).
    pub const CAP: usize = 0x00;
    /// Version, 32 bit (§3.1.2).
    pub const VS: usize = 0x08;
    /// Controller Configuration, 32 bit (§3.1.5).
    pub const CC: usize = 0x14;
    /// Controller Status, 32 bit (§3.1.6).
    pub const CSTS: usize = 0x1c;
    /// Admin Queue Attributes, 32 bit (§3.1.8).
    pub const AQA: usize = 0x24;
    /// Admin Submission Queue Base Address, 64 bit (§3.1.9).
    pub const ASQ: usize = 0x28;
    /// Admin Completion Queue Base Address, 64 bit (§3.1.10).
    pub const ACQ: usize = 0x30;
    /// First doorbell (SQ 0 tail); the rest follow at the CAP.DSTRD stride (§3.1.24).
    pub const DOORBELL_BASE: usize = 0x1000;
}

/// The start of the controller register block in BAR0 (Base 1.4 §3.1, Figure 78), up to the
/// admin queue base addresses. The driver reads and writes registers one at a time through
/// volatile accesses at the [`reg`] offsets; this struct pins those offsets to the spec layout.
#[repr(C)]
pub struct RegisterBlock {
    /// CAP (§3.1.1).
    pub cap: u64,
    /// VS (§3.1.2).
    pub vs: u32,
    /// INTMS, INTMC (§3.1.3, §3.1.4): unused (polled queues, no INTx).
    pub intms: u32,
    pub intmc: u32,
    /// CC (§3.1.5).
    pub cc: u32,
    _rsvd18: u32,
    /// CSTS (§3.1.6).
    pub csts: u32,
    /// NSSR (§3.1.7): unused.
    pub nssr: u32,
    /// AQA (§3.1.8).
    pub aqa: u32,
    /// ASQ (§3.1.9).
    pub asq: u64,
    /// ACQ (§3.1.10).
    pub acq: u64,
}
const _: () = assert!(size_of::<RegisterBlock>() == 0x38);
const _: () = assert!(std::mem::offset_of!(RegisterBlock, cap) == reg::CAP);
const _: () = assert!(std::mem::offset_of!(RegisterBlock, vs) == reg::VS);
const _: () = assert!(std::mem::offset_of!(RegisterBlock, cc) == reg::CC);
const _: () = assert!(std::mem::offset_of!(RegisterBlock, csts) == reg::CSTS);
const _: () = assert!(std::mem::offset_of!(RegisterBlock, aqa) == reg::AQA);
const _: () = assert!(std::mem::offset_of!(RegisterBlock, asq) == reg::ASQ);
const _: () = assert!(std::mem::offset_of!(RegisterBlock, acq) == reg::ACQ);

/// Controller Capabilities (Base 1.4 §3.1.1, Figure 79), decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cap(pub u64);

impl Cap {
    /// Maximum Queue Entries Supported, as a count (the register is 0-based).
    pub fn mqes_entries(self) -> u32 {
        (self.0 & 0xffff) as u32 + 1
    }
    /// Contiguous Queues Required.
    pub fn cqr(self) -> bool {
        self.0 >> 16 & 1 == 1
    }
    /// Timeout: worst-case time for CSTS.RDY to change after CC.EN changes, in milliseconds
    /// (the register counts 500 ms units).
    pub fn timeout_ms(self) -> u64 {
        (self.0 >> 24 & 0xff) * 500
    }
    /// Doorbell Stride: doorbells are `4 << DSTRD` bytes apart.
    pub fn doorbell_stride_bytes(self) -> usize {
        4 << (self.0 >> 32 & 0xf)
    }
    /// NVM Subsystem Reset Supported.
    pub fn nssrs(self) -> bool {
        self.0 >> 36 & 1 == 1
    }
    /// Command Sets Supported, bit 0: the NVM command set.
    pub fn css_nvm(self) -> bool {
        self.0 >> 37 & 1 == 1
    }
    /// Memory Page Size Minimum in bytes (2 ^ (12 + MPSMIN)).
    pub fn mps_min_bytes(self) -> u64 {
        1 << (12 + (self.0 >> 48 & 0xf))
    }
    /// Memory Page Size Maximum in bytes (2 ^ (12 + MPSMAX)).
    pub fn mps_max_bytes(self) -> u64 {
        1 << (12 + (self.0 >> 52 & 0xf))
    }
}

/// Version (Base 1.4 §3.1.2): major.minor.tertiary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version(pub u32);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{}.{}",
            self.0 >> 16,
            self.0 >> 8 & 0xff,
            self.0 & 0xff
        )
    }
}

/// Controller Configuration fields (Base 1.4 §3.1.5, Figure 84).
pub mod cc {
    /// Enable.
    pub const EN: u32 = 1;
    /// I/O Command Set Selected = NVM (000b), bits 6:4.
    pub const CSS_NVM: u32 = 0 << 4;
    /// Memory Page Size = 2^(12+0) = 4 KiB, bits 10:7.
    pub const MPS_4K: u32 = 0 << 7;
    /// Arbitration Mechanism = round robin, bits 13:11.
    pub const AMS_RR: u32 = 0 << 11;
    /// Shutdown Notification, bits 15:14.
    pub const SHN_MASK: u32 = 3 << 14;
    /// Normal shutdown notification.
    pub const SHN_NORMAL: u32 = 1 << 14;
    /// I/O Submission Queue Entry Size = 2^6 = 64 bytes, bits 19:16.
    pub const IOSQES_64: u32 = 6 << 16;
    /// I/O Completion Queue Entry Size = 2^4 = 16 bytes, bits 23:20.
    pub const IOCQES_16: u32 = 4 << 20;
}

/// Controller Status fields (Base 1.4 §3.1.6, Figure 85).
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1;
    /// Controller Fatal Status.
    pub const CFS: u32 = 1 << 1;
    /// Shutdown Status, bits 3:2.
    pub const SHST_MASK: u32 = 3 << 2;
    /// Shutdown processing complete.
    pub const SHST_COMPLETE: u32 = 2 << 2;
    /// All ones: the device no longer answers (surprise removal, PCIe link down).
    pub const GONE: u32 = u32::MAX;
}

/// Admin Queue Attributes (Base 1.4 §3.1.8): 0-based sizes of the admin SQ (bits 11:0) and CQ
/// (bits 27:16).
pub fn aqa(sq_entries: u32, cq_entries: u32) -> u32 {
    assert!((2..=4096).contains(&sq_entries) && (2..=4096).contains(&cq_entries));
    (sq_entries - 1) | (cq_entries - 1) << 16
}

/// Byte offset in BAR0 of submission queue `qid`'s tail doorbell (Base 1.4 §3.1.24).
pub fn sq_tail_doorbell(qid: u16, stride_bytes: usize) -> usize {
    reg::DOORBELL_BASE + (2 * qid as usize) * stride_bytes
}

/// Byte offset in BAR0 of completion queue `qid`'s head doorbell (Base 1.4 §3.1.25).
pub fn cq_head_doorbell(qid: u16, stride_bytes: usize) -> usize {
    reg::DOORBELL_BASE + (2 * qid as usize + 1) * stride_bytes
}

/// Admin command opcodes (Base 1.4 §5, Figure 139).
pub mod admin_op {
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const DELETE_IO_CQ: u8 = 0x04;
    pub const CREATE_IO_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
}

/// NVM command set I/O opcodes (Base 1.4 §6, Figure 346).
pub mod io_op {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// Identify CNS values (Base 1.4 §5.15.1, Figure 244).
pub mod cns {
    pub const NAMESPACE: u32 = 0x00;
    pub const CONTROLLER: u32 = 0x01;
    pub const ACTIVE_NAMESPACES: u32 = 0x02;
}

/// Feature identifiers (Base 1.4 §5.21.1, Figure 271).
pub mod feature {
    /// Number of Queues (§5.21.1.7).
    pub const NUMBER_OF_QUEUES: u32 = 0x07;
}

/// Write command dword 12 Force Unit Access bit (Base 1.4 §6.15, Figure 404).
pub const RW_FUA: u32 = 1 << 30;
/// Dataset Management dword 11 Attribute – Deallocate (Base 1.4 §6.7, Figure 364).
pub const DSM_DEALLOCATE: u32 = 1 << 2;
/// Create I/O CQ/SQ dword 11 Physically Contiguous (Base 1.4 §5.3/§5.4).
pub const QUEUE_PHYS_CONTIG: u32 = 1;
/// Largest NLB of one Read/Write/Write Zeroes: a 16-bit 0-based count (Base 1.4 §6.9).
pub const NLB_MAX: u32 = 1 << 16;

/// Submission Queue Entry, common command format (Base 1.4 §4.2, Figure 105). 64 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Command {
    /// Command Dword 0: opcode (7:0), fused (9:8), PSDT (15:14) = 0 for PRPs, CID (31:16).
    pub cdw0: u32,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    /// Metadata pointer (unused: no metadata formats).
    pub mptr: u64,
    /// Data pointer: PRP entry 1.
    pub prp1: u64,
    /// Data pointer: PRP entry 2 or the address of a PRP list.
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}
const _: () = assert!(size_of::<Command>() == SQE_BYTES);

impl Command {
    /// A command with `opcode` and namespace `nsid`, everything else zero.
    pub fn new(opcode: u8, nsid: u32) -> Self {
        Command {
            cdw0: opcode as u32,
            nsid,
            ..Default::default()
        }
    }

    pub fn opcode(&self) -> u8 {
        self.cdw0 as u8
    }

    pub fn cid(&self) -> u16 {
        (self.cdw0 >> 16) as u16
    }

    pub fn set_cid(&mut self, cid: u16) {
        self.cdw0 = (self.cdw0 & 0xffff) | (cid as u32) << 16;
    }

    /// Read or write `blocks` (1..=65536) logical blocks at `lba` (Base 1.4 §6.9 / §6.15).
    pub fn read_write(opcode: u8, nsid: u32, lba: u64, blocks: u32, fua: bool) -> Self {
        assert!((1..=NLB_MAX).contains(&blocks), "NLB {blocks} out of range");
        let mut c = Command::new(opcode, nsid);
        c.cdw10 = lba as u32;
        c.cdw11 = (lba >> 32) as u32;
        c.cdw12 = (blocks - 1) | if fua { RW_FUA } else { 0 };
        c
    }

    /// Write Zeroes of `blocks` (1..=65536) at `lba` (Base 1.4 §6.16).
    pub fn write_zeroes(nsid: u32, lba: u64, blocks: u32) -> Self {
        Command::read_write(io_op::WRITE_ZEROES, nsid, lba, blocks, false)
    }

    /// Dataset Management with the deallocate attribute over `ranges` (1..=256) entries of
    /// [`DsmRange`] at PRP1 (Base 1.4 §6.7).
    pub fn deallocate(nsid: u32, ranges: u32) -> Self {
        assert!((1..=256).contains(&ranges));
        let mut c = Command::new(io_op::DATASET_MANAGEMENT, nsid);
        c.cdw10 = ranges - 1;
        c.cdw11 = DSM_DEALLOCATE;
        c
    }

    /// Identify with `cns` into the 4 KiB buffer at `prp1` (Base 1.4 §5.15).
    pub fn identify(cns: u32, nsid: u32, prp1: u64) -> Self {
        let mut c = Command::new(admin_op::IDENTIFY, nsid);
        c.prp1 = prp1;
        c.cdw10 = cns;
        c
    }

    /// Set Features – Number of Queues: request `sq` and `cq` I/O queues (Base 1.4 §5.21.1.7).
    pub fn set_number_of_queues(sq: u16, cq: u16) -> Self {
        assert!(sq >= 1 && cq >= 1);
        let mut c = Command::new(admin_op::SET_FEATURES, 0);
        c.cdw10 = feature::NUMBER_OF_QUEUES;
        c.cdw11 = (sq as u32 - 1) | (cq as u32 - 1) << 16;
        c
    }

    /// Create I/O Completion Queue `qid` of `entries`, physically contiguous at `iova`,
    /// interrupts disabled (polled) (Base 1.4 §5.3).
    pub fn create_io_cq(qid: u16, entries: u32, iova: u64) -> Self {
        let mut c = Command::new(admin_op::CREATE_IO_CQ, 0);
        c.prp1 = iova;
        c.cdw10 = qid as u32 | (entries - 1) << 16;
        c.cdw11 = QUEUE_PHYS_CONTIG; // IEN (bit 1) = 0: no interrupts
        c
    }

    /// Create I/O Submission Queue `qid` of `entries` at `iova`, completing to CQ `cqid`
    /// (Base 1.4 §5.4).
    pub fn create_io_sq(qid: u16, entries: u32, iova: u64, cqid: u16) -> Self {
        let mut c = Command::new(admin_op::CREATE_IO_SQ, 0);
        c.prp1 = iova;
        c.cdw10 = qid as u32 | (entries - 1) << 16;
        c.cdw11 = QUEUE_PHYS_CONTIG | (cqid as u32) << 16;
        c
    }

    /// Delete I/O Submission Queue `qid` (Base 1.4 §5.6).
    pub fn delete_io_sq(qid: u16) -> Self {
        let mut c = Command::new(admin_op::DELETE_IO_SQ, 0);
        c.cdw10 = qid as u32;
        c
    }

    /// Delete I/O Completion Queue `qid` (Base 1.4 §5.5).
    pub fn delete_io_cq(qid: u16) -> Self {
        let mut c = Command::new(admin_op::DELETE_IO_CQ, 0);
        c.cdw10 = qid as u32;
        c
    }

    /// Abort command `cid` on submission queue `sqid` (Base 1.4 §5.1).
    pub fn abort(sqid: u16, cid: u16) -> Self {
        let mut c = Command::new(admin_op::ABORT, 0);
        c.cdw10 = sqid as u32 | (cid as u32) << 16;
        c
    }
}

/// Completion Queue Entry (Base 1.4 §4.6, Figure 121). 16 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Completion {
    /// Command specific dword 0.
    pub dw0: u32,
    pub dw1: u32,
    /// SQ Head Pointer: where the controller has consumed the SQ up to.
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    /// Phase tag (bit 0) and Status Field (bits 15:1).
    pub status: u16,
}
const _: () = assert!(size_of::<Completion>() == CQE_BYTES);
/// Byte offset of the status/phase half-word inside a CQE.
pub const CQE_STATUS_OFFSET: usize = 14;

impl Completion {
    pub fn phase(&self) -> bool {
        self.status & 1 == 1
    }

    pub fn status(&self) -> Status {
        Status::from_field(self.status)
    }
}

/// The Status Field of a completion (Base 1.4 §4.6.1, Figure 124), without the phase tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// Status Code Type (§4.6.1.1, Figure 125).
    pub sct: u8,
    /// Status Code.
    pub sc: u8,
    /// Do Not Retry.
    pub dnr: bool,
    /// More information in the error log.
    pub more: bool,
}

/// Status code types (Base 1.4 §4.6.1.1, Figure 125).
pub mod sct {
    pub const GENERIC: u8 = 0;
    pub const COMMAND_SPECIFIC: u8 = 1;
    pub const MEDIA: u8 = 2;
    pub const PATH: u8 = 3;
    pub const VENDOR: u8 = 7;
}

/// Generic command status codes (Base 1.4 §4.6.1.2.1, Figures 126–127).
pub mod generic {
    pub const SUCCESS: u8 = 0x00;
    pub const INVALID_OPCODE: u8 = 0x01;
    pub const INVALID_FIELD: u8 = 0x02;
    pub const CID_CONFLICT: u8 = 0x03;
    pub const DATA_TRANSFER_ERROR: u8 = 0x04;
    pub const ABORTED_POWER_LOSS: u8 = 0x05;
    pub const INTERNAL_ERROR: u8 = 0x06;
    pub const ABORTED_BY_REQUEST: u8 = 0x07;
    pub const ABORTED_SQ_DELETED: u8 = 0x08;
    pub const INVALID_NAMESPACE: u8 = 0x0b;
    pub const COMMAND_SEQUENCE_ERROR: u8 = 0x0c;
    pub const INVALID_PRP_OFFSET: u8 = 0x13;
    /// NVM command set specific generic codes (Figure 127).
    pub const LBA_OUT_OF_RANGE: u8 = 0x80;
    pub const CAPACITY_EXCEEDED: u8 = 0x81;
    pub const NAMESPACE_NOT_READY: u8 = 0x82;
}

/// Command specific status codes used by the admin commands we send (Base 1.4 §4.6.1.2.2).
pub mod specific {
    pub const INVALID_QUEUE_ID: u8 = 0x01;
    pub const INVALID_QUEUE_SIZE: u8 = 0x02;
    pub const ABORT_LIMIT_EXCEEDED: u8 = 0x03;
    pub const INVALID_QUEUE_DELETION: u8 = 0x0c;
}

/// Media and data integrity errors (Base 1.4 §4.6.1.2.3, Figure 130).
pub mod media {
    pub const WRITE_FAULT: u8 = 0x80;
    pub const UNRECOVERED_READ: u8 = 0x81;
    pub const GUARD_CHECK: u8 = 0x82;
    pub const APP_TAG_CHECK: u8 = 0x83;
    pub const REF_TAG_CHECK: u8 = 0x84;
    pub const COMPARE_FAILURE: u8 = 0x85;
    pub const ACCESS_DENIED: u8 = 0x86;
    pub const DEALLOCATED_OR_UNWRITTEN: u8 = 0x87;
}

/// What a status means to a caller: the typed classes the driver maps into its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusKind {
    Success,
    LbaOutOfRange,
    InvalidField,
    InvalidOpcode,
    InvalidNamespace,
    /// Unrecovered read, write fault, end-to-end check failures, …
    Media,
    /// Aborted by an Abort command or because its SQ was deleted.
    Aborted,
    /// Anything else: internal error, data transfer error, vendor codes, …
    Other,
}

impl Status {
    /// Decode the 16-bit status half-word of a CQE (bit 0 is the phase tag and is ignored).
    pub fn from_field(field: u16) -> Self {
        Status {
            sc: (field >> 1) as u8,
            sct: (field >> 9 & 0x7) as u8,
            more: field >> 14 & 1 == 1,
            dnr: field >> 15 & 1 == 1,
        }
    }

    pub fn is_success(self) -> bool {
        self.sct == sct::GENERIC && self.sc == generic::SUCCESS
    }

    pub fn kind(self) -> StatusKind {
        match (self.sct, self.sc) {
            (sct::GENERIC, generic::SUCCESS) => StatusKind::Success,
            (sct::GENERIC, generic::LBA_OUT_OF_RANGE) => StatusKind::LbaOutOfRange,
            (sct::GENERIC, generic::INVALID_FIELD | generic::INVALID_PRP_OFFSET) => {
                StatusKind::InvalidField
            }
            (sct::GENERIC, generic::INVALID_OPCODE) => StatusKind::InvalidOpcode,
            (sct::GENERIC, generic::INVALID_NAMESPACE) => StatusKind::InvalidNamespace,
            (sct::GENERIC, generic::ABORTED_BY_REQUEST | generic::ABORTED_SQ_DELETED) => {
                StatusKind::Aborted
            }
            (sct::MEDIA, _) => StatusKind::Media,
            _ => StatusKind::Other,
        }
    }

    /// A short human name for the status (for error messages).
    pub fn meaning(self) -> &'static str {
        match (self.sct, self.sc) {
            (sct::GENERIC, generic::SUCCESS) => "successful completion",
            (sct::GENERIC, generic::INVALID_OPCODE) => "invalid command opcode",
            (sct::GENERIC, generic::INVALID_FIELD) => "invalid field in command",
            (sct::GENERIC, generic::CID_CONFLICT) => "command ID conflict",
            (sct::GENERIC, generic::DATA_TRANSFER_ERROR) => "data transfer error",
            (sct::GENERIC, generic::ABORTED_POWER_LOSS) => "aborted due to power loss",
            (sct::GENERIC, generic::INTERNAL_ERROR) => "internal error",
            (sct::GENERIC, generic::ABORTED_BY_REQUEST) => "command abort requested",
            (sct::GENERIC, generic::ABORTED_SQ_DELETED) => "aborted: submission queue deleted",
            (sct::GENERIC, generic::INVALID_NAMESPACE) => "invalid namespace or format",
            (sct::GENERIC, generic::COMMAND_SEQUENCE_ERROR) => "command sequence error",
            (sct::GENERIC, generic::INVALID_PRP_OFFSET) => "invalid PRP offset",
            (sct::GENERIC, generic::LBA_OUT_OF_RANGE) => "LBA out of range",
            (sct::GENERIC, generic::CAPACITY_EXCEEDED) => "capacity exceeded",
            (sct::GENERIC, generic::NAMESPACE_NOT_READY) => "namespace not ready",
            (sct::COMMAND_SPECIFIC, specific::INVALID_QUEUE_ID) => "invalid queue identifier",
            (sct::COMMAND_SPECIFIC, specific::INVALID_QUEUE_SIZE) => "invalid queue size",
            (sct::COMMAND_SPECIFIC, specific::ABORT_LIMIT_EXCEEDED) => "abort limit exceeded",
            (sct::COMMAND_SPECIFIC, specific::INVALID_QUEUE_DELETION) => "invalid queue deletion",
            (sct::MEDIA, media::WRITE_FAULT) => "write fault",
            (sct::MEDIA, media::UNRECOVERED_READ) => "unrecovered read error",
            (sct::MEDIA, media::GUARD_CHECK) => "end-to-end guard check error",
            (sct::MEDIA, media::APP_TAG_CHECK) => "end-to-end application tag check error",
            (sct::MEDIA, media::REF_TAG_CHECK) => "end-to-end reference tag check error",
            (sct::MEDIA, media::COMPARE_FAILURE) => "compare failure",
            (sct::MEDIA, media::ACCESS_DENIED) => "access denied",
            (sct::MEDIA, media::DEALLOCATED_OR_UNWRITTEN) => "deallocated or unwritten block",
            (sct::MEDIA, _) => "media or data integrity error",
            (sct::PATH, _) => "path related status",
            (sct::VENDOR, _) => "vendor specific status",
            _ => "unknown status",
        }
    }
}

/// One Dataset Management range (Base 1.4 §6.7, Figure 365). 16 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct DsmRange {
    /// Context attributes.
    pub cattr: U32,
    /// Length in logical blocks (1-based).
    pub nlb: U32,
    /// Starting LBA.
    pub slba: U64,
}
const _: () = assert!(size_of::<DsmRange>() == 16);

/// Identify Controller data structure (Base 1.4 §5.15.2.2, Figure 247), the fields the driver
/// reads; the rest is kept as reserved byte runs at their spec offsets. 4096 bytes.
#[repr(C)]
#[derive(Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct IdentifyController {
    /// PCI Vendor ID (bytes 1:0).
    pub vid: U16,
    /// PCI Subsystem Vendor ID (3:2).
    pub ssvid: U16,
    /// Serial Number, ASCII, space padded (23:4).
    pub sn: [u8; 20],
    /// Model Number (63:24).
    pub mn: [u8; 40],
    /// Firmware Revision (71:64).
    pub fr: [u8; 8],
    /// Recommended Arbitration Burst (72).
    pub rab: u8,
    /// IEEE OUI (75:73).
    pub ieee: [u8; 3],
    /// Multi-path and namespace sharing capabilities (76).
    pub cmic: u8,
    /// Maximum Data Transfer Size: 2^MDTS units of CAP.MPSMIN; 0 = no limit (77).
    pub mdts: u8,
    /// Controller ID (79:78).
    pub cntlid: U16,
    /// Version (83:80).
    pub ver: U32,
    _rsvd84: [u8; 172],
    /// Optional Admin Command Support (257:256).
    pub oacs: U16,
    /// Abort Command Limit, 0-based (258).
    pub acl: u8,
    _rsvd259: [u8; 253],
    /// Submission Queue Entry Size: required (3:0) and maximum (7:4), log2 bytes (512).
    pub sqes: u8,
    /// Completion Queue Entry Size (513).
    pub cqes: u8,
    /// Maximum Outstanding Commands (515:514).
    pub maxcmd: U16,
    /// Number of Namespaces: the largest valid NSID (519:516).
    pub nn: U32,
    /// Optional NVM Command Support (521:520): bit 2 DSM, bit 3 Write Zeroes.
    pub oncs: U16,
    /// Fused Operation Support (523:522).
    pub fuses: U16,
    /// Format NVM Attributes (524).
    pub fna: u8,
    /// Volatile Write Cache: bit 0 = present (525).
    pub vwc: u8,
    /// Atomic Write Unit Normal, 0-based blocks (527:526).
    pub awun: U16,
    /// Atomic Write Unit Power Fail, 0-based blocks (529:528).
    pub awupf: U16,
    _rsvd530: [u8; 238],
    /// NVM Subsystem NVMe Qualified Name (1023:768).
    pub subnqn: [u8; 256],
    _rsvd1024: [u8; 3072],
}
const _: () = assert!(size_of::<IdentifyController>() == 4096);
const _: () = assert!(std::mem::offset_of!(IdentifyController, oacs) == 256);
const _: () = assert!(std::mem::offset_of!(IdentifyController, sqes) == 512);
const _: () = assert!(std::mem::offset_of!(IdentifyController, vwc) == 525);
const _: () = assert!(std::mem::offset_of!(IdentifyController, subnqn) == 768);

/// ONCS bit: Dataset Management supported.
pub const ONCS_DSM: u16 = 1 << 2;
/// ONCS bit: Write Zeroes supported.
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;

/// An ASCII, space-padded identify string, trimmed.
pub fn ascii_field(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .trim_end_matches([' ', '\0'])
        .trim_start()
        .to_string()
}

/// LBA Format (Base 1.4 §5.15.2.1, Figure 250). 4 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct LbaFormat {
    /// Metadata Size in bytes.
    pub ms: U16,
    /// LBA Data Size: 2^LBADS bytes.
    pub lbads: u8,
    /// Relative Performance (bits 1:0).
    pub rp: u8,
}
const _: () = assert!(size_of::<LbaFormat>() == 4);

/// Identify Namespace data structure (Base 1.4 §5.15.2.1, Figure 245). 4096 bytes.
#[repr(C)]
#[derive(Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct IdentifyNamespace {
    /// Namespace Size in logical blocks (7:0).
    pub nsze: U64,
    /// Namespace Capacity (15:8).
    pub ncap: U64,
    /// Namespace Utilization (23:16).
    pub nuse: U64,
    /// Namespace Features (24): bit 1 = NAWUN/NAWUPF/NACWU valid.
    pub nsfeat: u8,
    /// Number of LBA Formats, 0-based (25).
    pub nlbaf: u8,
    /// Formatted LBA Size: bits 3:0 index the LBA format in use (26).
    pub flbas: u8,
    /// Metadata Capabilities (27).
    pub mc: u8,
    /// End-to-end Data Protection Capabilities and Settings (29:28).
    pub dpc: u8,
    pub dps: u8,
    /// Namespace Multi-path I/O and Sharing (30).
    pub nmic: u8,
    /// Reservation Capabilities (31).
    pub rescap: u8,
    /// Format Progress Indicator (32).
    pub fpi: u8,
    /// Deallocate Logical Block Features (33): bits 2:0 = what deallocated blocks read as.
    pub dlfeat: u8,
    /// Namespace Atomic Write Unit Normal, 0-based (35:34).
    pub nawun: U16,
    /// Namespace Atomic Write Unit Power Fail, 0-based (37:36).
    pub nawupf: U16,
    _rsvd38: [u8; 90],
    /// LBA Format 0..15 support (191:128).
    pub lbaf: [LbaFormat; 16],
    _rsvd192: [u8; 3904],
}
const _: () = assert!(size_of::<IdentifyNamespace>() == 4096);
const _: () = assert!(std::mem::offset_of!(IdentifyNamespace, lbaf) == 128);

impl IdentifyNamespace {
    /// The LBA format in use.
    pub fn current_format(&self) -> LbaFormat {
        self.lbaf[(self.flbas & 0xf) as usize]
    }

    /// Logical block size in bytes of the LBA format in use.
    pub fn block_bytes(&self) -> u32 {
        1 << self.current_format().lbads
    }

    /// The formats the namespace supports.
    pub fn formats(&self) -> &[LbaFormat] {
        &self.lbaf[..(self.nlbaf as usize + 1).min(16)]
    }
}

/// Active Namespace ID list (Base 1.4 §5.15.2.3, CNS 02h): up to 1024 NSIDs in increasing
/// order, zero-terminated. 4096 bytes.
#[repr(C)]
#[derive(Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct ActiveNamespaces {
    pub ids: [U32; 1024],
}
const _: () = assert!(size_of::<ActiveNamespaces>() == 4096);

impl ActiveNamespaces {
    /// The listed NSIDs (up to the first zero).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.ids.iter().map(|i| i.get()).take_while(|&i| i != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_fields_decode() {
        // QEMU's NVMe model: MQES 2047, CQR, TO 15 (7.5 s), DSTRD 0, CSS NVM, MPSMIN 0, MPSMAX 4
        let cap = Cap(0x07ff | 1 << 16 | 15 << 24 | 1 << 37 | 4u64 << 52);
        assert_eq!(cap.mqes_entries(), 2048);
        assert!(cap.cqr());
        assert_eq!(cap.timeout_ms(), 7500);
        assert_eq!(cap.doorbell_stride_bytes(), 4);
        assert!(cap.css_nvm());
        assert_eq!(cap.mps_min_bytes(), 4096);
        assert_eq!(cap.mps_max_bytes(), 65536);
        assert_eq!(Cap(2u64 << 32).doorbell_stride_bytes(), 16);
    }

    #[test]
    fn doorbells_follow_the_stride() {
        assert_eq!(sq_tail_doorbell(0, 4), 0x1000);
        assert_eq!(cq_head_doorbell(0, 4), 0x1004);
        assert_eq!(sq_tail_doorbell(3, 4), 0x1018);
        assert_eq!(cq_head_doorbell(3, 16), 0x1000 + 7 * 16);
    }

    #[test]
    fn aqa_is_zero_based() {
        assert_eq!(aqa(32, 32), 31 | 31 << 16);
    }

    #[test]
    fn read_write_encoding() {
        let mut c = Command::read_write(io_op::WRITE, 1, 0x1_2345_6789, 8, true);
        c.set_cid(0xbeef);
        assert_eq!(c.opcode(), io_op::WRITE);
        assert_eq!(c.cid(), 0xbeef);
        assert_eq!(c.cdw10, 0x2345_6789);
        assert_eq!(c.cdw11, 1);
        assert_eq!(c.cdw12, 7 | RW_FUA);
        let z = Command::write_zeroes(2, 5, NLB_MAX);
        assert_eq!(z.opcode(), io_op::WRITE_ZEROES);
        assert_eq!(z.cdw12, 0xffff);
        assert_eq!(z.nsid, 2);
    }

    #[test]
    fn sqe_byte_layout() {
        let mut c = Command::identify(cns::CONTROLLER, 0, 0x1122_3344_5566_7788);
        c.set_cid(7);
        // SAFETY: Command is repr(C), 64 bytes of plain integers with no padding (size assert).
        let bytes: [u8; 64] = unsafe { std::mem::transmute(c) };
        assert_eq!(bytes[0], admin_op::IDENTIFY);
        assert_eq!(&bytes[2..4], &7u16.to_le_bytes());
        assert_eq!(&bytes[24..32], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&bytes[40..44], &cns::CONTROLLER.to_le_bytes());
    }

    #[test]
    fn queue_admin_commands() {
        let c = Command::create_io_sq(3, 256, 0x10000, 3);
        assert_eq!(c.cdw10, 3 | 255 << 16);
        assert_eq!(c.cdw11, 1 | 3 << 16);
        let c = Command::create_io_cq(3, 256, 0x20000);
        assert_eq!(c.cdw11, 1, "polled queues have interrupts off");
        let c = Command::set_number_of_queues(8, 8);
        assert_eq!(c.cdw11, 7 | 7 << 16);
        let c = Command::abort(2, 17);
        assert_eq!(c.cdw10, 2 | 17 << 16);
    }

    #[test]
    fn status_decodes_into_kinds() {
        let field = |sct: u16, sc: u16, dnr: bool| 1 | sc << 1 | sct << 9 | (dnr as u16) << 15;
        let s = Status::from_field(field(0, 0x80, true));
        assert_eq!(s.kind(), StatusKind::LbaOutOfRange);
        assert!(s.dnr);
        assert_eq!(s.meaning(), "LBA out of range");
        assert_eq!(
            Status::from_field(field(0, 0x0b, false)).kind(),
            StatusKind::InvalidNamespace
        );
        assert_eq!(
            Status::from_field(field(0, 0x02, false)).kind(),
            StatusKind::InvalidField
        );
        assert_eq!(
            Status::from_field(field(2, 0x81, false)).kind(),
            StatusKind::Media
        );
        assert_eq!(
            Status::from_field(field(0, 0x07, false)).kind(),
            StatusKind::Aborted
        );
        assert!(Status::from_field(field(0, 0, false)).is_success());
        let cqe = Completion {
            status: field(2, 0x81, false),
            ..Default::default()
        };
        assert!(cqe.phase());
        assert_eq!(cqe.status().sct, sct::MEDIA);
    }

    #[test]
    fn identify_pages_parse() {
        let mut page = [0u8; 4096];
        page[4..24].copy_from_slice(b"SERIAL-1            ");
        page[24..38].copy_from_slice(b"QEMU NVMe Ctrl");
        page[24 + 14..64].fill(b' ');
        page[77] = 5;
        page[516..520].copy_from_slice(&2u32.to_le_bytes());
        page[520..522].copy_from_slice(&(ONCS_DSM | ONCS_WRITE_ZEROES).to_le_bytes());
        page[525] = 1;
        let id = IdentifyController::read_from_bytes(&page[..]).unwrap();
        assert_eq!(ascii_field(&id.sn), "SERIAL-1");
        assert_eq!(ascii_field(&id.mn), "QEMU NVMe Ctrl");
        assert_eq!(id.mdts, 5);
        assert_eq!(id.nn.get(), 2);
        assert_eq!(id.vwc & 1, 1);

        let mut page = [0u8; 4096];
        page[0..8].copy_from_slice(&1000u64.to_le_bytes());
        page[25] = 1; // two formats
        page[26] = 1; // using format 1
        page[128 + 2] = 9;
        page[132 + 2] = 12;
        let ns = IdentifyNamespace::read_from_bytes(&page[..]).unwrap();
        assert_eq!(ns.nsze.get(), 1000);
        assert_eq!(ns.block_bytes(), 4096);
        assert_eq!(ns.formats().len(), 2);
        assert_eq!(ns.formats()[0].lbads, 9);

        let mut page = [0u8; 4096];
        page[0..4].copy_from_slice(&1u32.to_le_bytes());
        page[4..8].copy_from_slice(&2u32.to_le_bytes());
        let list = ActiveNamespaces::read_from_bytes(&page[..]).unwrap();
        assert_eq!(list.iter().collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn version_prints() {
        assert_eq!(Version(0x0001_0400).to_string(), "1.4.0");
    }
}
