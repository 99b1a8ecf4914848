//! On-disk structures. docs/format.md is the byte-level truth; every struct here mirrors a table
//! there, is `#[repr(C)]` with little-endian fields (zerocopy derives prove there is no padding),
//! and has a compile-time size assert. Offsets are asserted in the tests at the bottom.
//!
//! Device layout (block size B, segment size S, both from the superblock):
//!
//! ```text
//! block 0: superblock copy A    block 1: superblock copy B    blocks 2..: reserved
//! segment i starts at byte SEGMENTS_START + i * S:
//!   [segment header block][batch][batch]...        (log and checkpoint segments alike)
//! batch: [BatchHeader][RecordHeader+payload]...(pad to B)[data area: block-aligned chunks]
//! ```

use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Superblock magic, "NVSTORE\0".
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"NVSTORE\0";
pub const FORMAT_VERSION: u32 = 1;
/// Byte offset of the first segment: the superblock copies live in the first 64 KiB.
pub const SEGMENTS_START_BYTES: u64 = 64 * 1024;
/// Byte offsets of the two superblock copies.
pub const SUPERBLOCK_OFFSETS: [u64; 2] = [0, 4096];
/// No segment (end of a chain, no checkpoint).
pub const NO_SEGMENT: u32 = u32::MAX;

pub const SEGMENT_MAGIC: u32 = u32::from_le_bytes(*b"NVSG");
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"NVBT");
pub const RECORD_MAGIC: u16 = u16::from_le_bytes(*b"RC");

/// Segment kinds.
pub const SEGMENT_LOG: u16 = 1;
pub const SEGMENT_CHECKPOINT: u16 = 2;

/// Record kinds.
pub const RECORD_OBJECT_STATE: u8 = 1;
pub const RECORD_REMOVE: u8 = 2;
/// Names an object whose data is in the batch (segment summary for the cleaner).
pub const RECORD_OWNER: u8 = 3;

/// Superblock flag: checkpoints disabled (every open replays the whole log; for benchmarks).
pub const SB_FLAG_NO_CHECKPOINTS: u32 = 1;

/// The device label and the store's root pointers. Two copies (blocks 0 and 1); each write goes
/// to copy `sb_seq % 2`, so a torn superblock write leaves the other copy valid.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct Superblock {
    pub magic: [u8; 8],
    pub format_version: U32,
    pub block_size: U32,
    pub device_uuid: [u8; 16],
    pub cluster_fsid: [u8; 16],
    pub node_id: U32,
    pub segment_bytes: U32,
    pub chunk_bytes: U32,
    pub segment_count: U32,
    /// Random per mkfs: the stream id of the log; headers of an older mkfs never match it.
    pub log_id: U64,
    pub created_unix_ns: U64,
    /// Increases with every superblock write; the valid copy with the highest wins.
    pub sb_seq: U64,
    /// Open generation: bumped and persisted at every read-write open before any log write.
    pub gen: U32,
    pub flags: U32,
    /// First segment of the current checkpoint, or NO_SEGMENT.
    pub ckpt_segment: U32,
    /// Batches in the checkpoint chain.
    pub ckpt_batches: U32,
    /// Stream id stamped on the checkpoint's segment and batch headers.
    pub ckpt_id: U64,
    pub ckpt_objects: U64,
    /// Where replay starts: segment, byte offset in it, expected batch and segment sequence.
    pub replay_segment: U32,
    pub replay_offset: U32,
    pub replay_batch_seq: U64,
    pub replay_segment_seq: U64,
    /// Op sequence floor: versions handed out after open are above this.
    pub next_op_seq: U64,
    /// The open generation that set the replay start (wrote the checkpoint): every batch
    /// from the replay start on was written by it or a later open, so replay accepts none
    /// older. 0 on devices labelled before the field existed (then only the headers and
    /// batches read along the way raise the floor).
    pub replay_gen: U32,
    pub reserved: [u8; 96],
    /// CRC32C of every byte before this field.
    pub crc: U32,
}
const _: () = assert!(core::mem::size_of::<Superblock>() == 256);

/// First block of every segment.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SegmentHeader {
    pub magic: U32,
    pub version: U16,
    pub kind: U16,
    /// log_id for log segments, ckpt_id for checkpoint segments.
    pub stream_id: U64,
    pub segment: U32,
    /// The segment the stream continues in when this one is full (chosen when this one opens).
    pub next_segment: U32,
    /// Position of this segment in its stream (1, 2, …).
    pub segment_seq: U64,
    /// Sequence of the first batch written in this segment.
    pub first_batch_seq: U64,
    pub gen: U32,
    pub reserved: U32,
    pub created_unix_ns: U64,
    pub reserved2: [u8; 4],
    pub crc: U32,
}
const _: () = assert!(core::mem::size_of::<SegmentHeader>() == 64);

/// Starts every batch (block aligned). Followed by `meta_bytes` of records, padding to the
/// block size, then `data_bytes` of data area.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct BatchHeader {
    pub magic: U32,
    pub version: U16,
    pub flags: U16,
    pub stream_id: U64,
    /// Consecutive within a stream.
    pub seq: U64,
    pub gen: U32,
    pub record_count: U32,
    pub meta_bytes: U32,
    /// A multiple of the block size.
    pub data_bytes: U32,
    /// CRC32C over the record bytes.
    pub meta_crc: U32,
    /// CRC32C over the whole data area.
    pub data_crc: U32,
    /// Every batch of this stream up to this sequence was durable (acknowledged) before this
    /// batch was written. Replay uses it to tell a torn tail (stop) from a rotten batch that
    /// was already acknowledged (refuse to open: data would be lost silently; or, with
    /// `StoreConfig::salvage`, get past it and report it).
    pub durable_through: U64,
    pub reserved: [u8; 4],
    /// CRC32C of the header bytes before this field.
    pub header_crc: U32,
}
const _: () = assert!(core::mem::size_of::<BatchHeader>() == 64);

/// Starts every record in a batch's meta area. Followed by `payload_len` bytes:
/// pool (u64), name (`name_len` bytes), then the kind's body.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct RecordHeader {
    pub magic: U16,
    pub kind: u8,
    pub flags: u8,
    pub shard: u8,
    pub reserved: u8,
    pub name_len: U16,
    /// CRC32C of (pool, name, shard): lets scans skip other objects without parsing keys.
    pub key_hash: U32,
    pub payload_len: U32,
    /// Op sequence of the state this record describes.
    pub seq: U64,
    pub reserved2: U32,
    /// CRC32C over this header (with `crc` zero) and the payload.
    pub crc: U32,
}
const _: () = assert!(core::mem::size_of::<RecordHeader>() == 32);

/// Body of an object-state record: the complete state of an object after an op (or a
/// relocation). Followed by `chunk_count` [`ChunkRef`]s.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ObjectStateBody {
    pub version: U64,
    pub size: U64,
    pub mtime_unix_ns: U64,
    /// CRC32C of the object's whole content.
    pub data_crc: U32,
    pub chunk_count: U32,
    /// The serialized xattr map (a data-area extent), or len 0.
    pub xattrs: ChunkRef,
}
const _: () = assert!(core::mem::size_of::<ObjectStateBody>() == 48);

/// Where a chunk of object data (or the xattr map) lives: a block-aligned extent written in
/// some batch's data area, `len` bytes (padded to blocks on disk), with its CRC32C. `len == 0`
/// is a hole (reads as zeros).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct ChunkRef {
    pub offset: U64,
    pub len: U32,
    pub crc: U32,
}
const _: () = assert!(core::mem::size_of::<ChunkRef>() == 16);

/// Body of a remove record.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct RemoveBody {
    pub version: U64,
}
const _: () = assert!(core::mem::size_of::<RemoveBody>() == 8);

/// CRC32C of a struct's bytes up to (not including) its trailing 4-byte crc field.
pub fn crc_before_tail<T: IntoBytes + Immutable>(v: &T) -> u32 {
    let b = v.as_bytes();
    crc32c::crc32c(&b[..b.len() - 4])
}

impl Superblock {
    pub fn seal(&mut self) {
        self.crc = crc_before_tail(self).into();
    }

    pub fn is_valid(&self) -> bool {
        self.magic == SUPERBLOCK_MAGIC && self.crc.get() == crc_before_tail(self)
    }
}

impl SegmentHeader {
    pub fn seal(&mut self) {
        self.crc = crc_before_tail(self).into();
    }

    pub fn is_valid(&self) -> bool {
        self.magic.get() == SEGMENT_MAGIC && self.crc.get() == crc_before_tail(self)
    }
}

impl BatchHeader {
    pub fn seal(&mut self) {
        self.header_crc = crc_before_tail(self).into();
    }

    pub fn is_valid(&self) -> bool {
        self.magic.get() == BATCH_MAGIC && self.header_crc.get() == crc_before_tail(self)
    }
}

/// Round `n` up to a multiple of `to` (a power of two).
pub fn round_up(n: u64, to: u64) -> u64 {
    debug_assert!(to.is_power_of_two());
    (n + to - 1) & !(to - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;
    use zerocopy::FromZeros;

    /// The offsets docs/format.md documents. Changing a struct without the doc fails here.
    #[test]
    fn offsets_match_docs_format_md() {
        assert_eq!(offset_of!(Superblock, format_version), 8);
        assert_eq!(offset_of!(Superblock, block_size), 12);
        assert_eq!(offset_of!(Superblock, device_uuid), 16);
        assert_eq!(offset_of!(Superblock, cluster_fsid), 32);
        assert_eq!(offset_of!(Superblock, node_id), 48);
        assert_eq!(offset_of!(Superblock, segment_bytes), 52);
        assert_eq!(offset_of!(Superblock, chunk_bytes), 56);
        assert_eq!(offset_of!(Superblock, segment_count), 60);
        assert_eq!(offset_of!(Superblock, log_id), 64);
        assert_eq!(offset_of!(Superblock, created_unix_ns), 72);
        assert_eq!(offset_of!(Superblock, sb_seq), 80);
        assert_eq!(offset_of!(Superblock, gen), 88);
        assert_eq!(offset_of!(Superblock, flags), 92);
        assert_eq!(offset_of!(Superblock, ckpt_segment), 96);
        assert_eq!(offset_of!(Superblock, ckpt_batches), 100);
        assert_eq!(offset_of!(Superblock, ckpt_id), 104);
        assert_eq!(offset_of!(Superblock, ckpt_objects), 112);
        assert_eq!(offset_of!(Superblock, replay_segment), 120);
        assert_eq!(offset_of!(Superblock, replay_offset), 124);
        assert_eq!(offset_of!(Superblock, replay_batch_seq), 128);
        assert_eq!(offset_of!(Superblock, replay_segment_seq), 136);
        assert_eq!(offset_of!(Superblock, next_op_seq), 144);
        assert_eq!(offset_of!(Superblock, replay_gen), 152);
        assert_eq!(offset_of!(Superblock, reserved), 156);
        assert_eq!(offset_of!(Superblock, crc), 252);

        assert_eq!(offset_of!(SegmentHeader, kind), 6);
        assert_eq!(offset_of!(SegmentHeader, stream_id), 8);
        assert_eq!(offset_of!(SegmentHeader, segment), 16);
        assert_eq!(offset_of!(SegmentHeader, next_segment), 20);
        assert_eq!(offset_of!(SegmentHeader, segment_seq), 24);
        assert_eq!(offset_of!(SegmentHeader, first_batch_seq), 32);
        assert_eq!(offset_of!(SegmentHeader, gen), 40);
        assert_eq!(offset_of!(SegmentHeader, created_unix_ns), 48);
        assert_eq!(offset_of!(SegmentHeader, crc), 60);

        assert_eq!(offset_of!(BatchHeader, flags), 6);
        assert_eq!(offset_of!(BatchHeader, stream_id), 8);
        assert_eq!(offset_of!(BatchHeader, seq), 16);
        assert_eq!(offset_of!(BatchHeader, gen), 24);
        assert_eq!(offset_of!(BatchHeader, record_count), 28);
        assert_eq!(offset_of!(BatchHeader, meta_bytes), 32);
        assert_eq!(offset_of!(BatchHeader, data_bytes), 36);
        assert_eq!(offset_of!(BatchHeader, meta_crc), 40);
        assert_eq!(offset_of!(BatchHeader, data_crc), 44);
        assert_eq!(offset_of!(BatchHeader, durable_through), 48);
        assert_eq!(offset_of!(BatchHeader, header_crc), 60);

        assert_eq!(offset_of!(RecordHeader, kind), 2);
        assert_eq!(offset_of!(RecordHeader, shard), 4);
        assert_eq!(offset_of!(RecordHeader, name_len), 6);
        assert_eq!(offset_of!(RecordHeader, key_hash), 8);
        assert_eq!(offset_of!(RecordHeader, payload_len), 12);
        assert_eq!(offset_of!(RecordHeader, seq), 16);
        assert_eq!(offset_of!(RecordHeader, crc), 28);

        assert_eq!(offset_of!(ObjectStateBody, size), 8);
        assert_eq!(offset_of!(ObjectStateBody, mtime_unix_ns), 16);
        assert_eq!(offset_of!(ObjectStateBody, data_crc), 24);
        assert_eq!(offset_of!(ObjectStateBody, chunk_count), 28);
        assert_eq!(offset_of!(ObjectStateBody, xattrs), 32);
        assert_eq!(offset_of!(ChunkRef, len), 8);
        assert_eq!(offset_of!(ChunkRef, crc), 12);
    }

    #[test]
    fn seal_and_validate() {
        let mut h = BatchHeader::new_zeroed();
        h.magic = BATCH_MAGIC.into();
        h.seq = 42.into();
        assert!(!h.is_valid());
        h.seal();
        assert!(h.is_valid());
        h.seq = 43.into();
        assert!(!h.is_valid(), "a changed field breaks the crc");
    }
}
