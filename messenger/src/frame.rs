//! Wire frames: a fixed 32-byte header, the payload, a 4-byte payload crc32c trailer.
//!
//! The byte table lives in docs/format.md ("Messenger"); the offsets below mirror it and the
//! const asserts tie the struct to them.
//!
//! ```text
//! | header (32) | payload (payload_len) | payload crc32c (4) |
//! ```
//!
//! Decoding checks, in order: magic, version, header crc (so a corrupted length is reported as a
//! bad crc, not acted upon), kind, flags, reserved bytes, then the length against the maximum.

use std::mem::{offset_of, size_of};

use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::Violation;

/// "NVMS" in the first four bytes of every frame.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"NVMS");
/// The only protocol version this code speaks.
pub const FRAME_VERSION: u8 = 1;
pub const HEADER_SIZE: usize = 32;
pub const TRAILER_SIZE: usize = 4;
/// Hard protocol limit on a frame's payload; [`crate::Config::payload_bytes_max`] may lower it.
pub const PAYLOAD_BYTES_LIMIT: u32 = 64 << 20;

/// Byte offsets of the header fields (docs/format.md, "Frame header").
pub mod offset {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 4;
    pub const KIND: usize = 5;
    pub const FLAGS: usize = 6;
    pub const TXN: usize = 8;
    pub const PAYLOAD_LEN: usize = 16;
    pub const MSG_TYPE: usize = 20;
    pub const RESERVED0: usize = 22;
    pub const RESERVED1: usize = 24;
    pub const HEADER_CRC: usize = 28;
}

/// The header exactly as it is on the wire (all integers little-endian).
#[repr(C)]
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
pub struct WireHeader {
    pub magic: U32,
    pub version: u8,
    pub kind: u8,
    pub flags: U16,
    pub txn: U64,
    pub payload_len: U32,
    pub msg_type: U16,
    pub reserved0: U16,
    pub reserved1: U32,
    /// crc32c of bytes 0..28.
    pub header_crc: U32,
}

const _: () = assert!(size_of::<WireHeader>() == HEADER_SIZE);
const _: () = assert!(offset_of!(WireHeader, magic) == offset::MAGIC);
const _: () = assert!(offset_of!(WireHeader, version) == offset::VERSION);
const _: () = assert!(offset_of!(WireHeader, kind) == offset::KIND);
const _: () = assert!(offset_of!(WireHeader, flags) == offset::FLAGS);
const _: () = assert!(offset_of!(WireHeader, txn) == offset::TXN);
const _: () = assert!(offset_of!(WireHeader, payload_len) == offset::PAYLOAD_LEN);
const _: () = assert!(offset_of!(WireHeader, msg_type) == offset::MSG_TYPE);
const _: () = assert!(offset_of!(WireHeader, reserved0) == offset::RESERVED0);
const _: () = assert!(offset_of!(WireHeader, reserved1) == offset::RESERVED1);
const _: () = assert!(offset_of!(WireHeader, header_crc) == offset::HEADER_CRC);
const _: () = assert!(offset::HEADER_CRC + 4 == HEADER_SIZE);
const _: () =
    assert!(PAYLOAD_BYTES_LIMIT as usize + HEADER_SIZE + TRAILER_SIZE <= u32::MAX as usize);

/// What a frame is. Handshake kinds are only valid before authentication, the others only after.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    Hello = 1,
    Challenge = 2,
    Response = 3,
    Accept = 4,
    Request = 16,
    Reply = 17,
    OneWay = 18,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Hello,
            2 => FrameKind::Challenge,
            3 => FrameKind::Response,
            4 => FrameKind::Accept,
            16 => FrameKind::Request,
            17 => FrameKind::Reply,
            18 => FrameKind::OneWay,
            _ => return None,
        })
    }

    pub fn is_handshake(self) -> bool {
        (self as u8) < 16
    }

    /// Flags this kind may carry.
    fn flags_allowed(self) -> u16 {
        match self {
            FrameKind::Reply => FLAG_REPLY_ABANDONED,
            _ => 0,
        }
    }
}

/// On a Reply: the peer's handler dropped the request without answering; the payload is empty.
pub const FLAG_REPLY_ABANDONED: u16 = 1 << 0;

/// A decoded, validated header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub flags: u16,
    /// Request/reply correlation; 0 on frames that are neither.
    pub txn: u64,
    pub payload_len: u32,
    /// Application message type (opaque to the messenger).
    pub msg_type: u16,
}

impl Header {
    /// Total bytes of the frame on the wire.
    pub fn frame_len(&self) -> usize {
        HEADER_SIZE + self.payload_len as usize + TRAILER_SIZE
    }

    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut wire = WireHeader {
            magic: U32::new(FRAME_MAGIC),
            version: FRAME_VERSION,
            kind: self.kind as u8,
            flags: U16::new(self.flags),
            txn: U64::new(self.txn),
            payload_len: U32::new(self.payload_len),
            msg_type: U16::new(self.msg_type),
            reserved0: U16::new(0),
            reserved1: U32::new(0),
            header_crc: U32::new(0),
        };
        let crc = crate::checksum::crc32c(&wire.as_bytes()[..offset::HEADER_CRC]);
        wire.header_crc = U32::new(crc);
        let mut out = [0u8; HEADER_SIZE];
        out.copy_from_slice(wire.as_bytes());
        out
    }

    /// Validate and decode a header. `payload_max` is the receiver's limit (at most
    /// [`PAYLOAD_BYTES_LIMIT`]).
    pub fn decode(bytes: &[u8; HEADER_SIZE], payload_max: u32) -> Result<Header, Violation> {
        let wire = WireHeader::read_from_bytes(bytes).expect("header array has the header size");
        let magic = wire.magic.get();
        if magic != FRAME_MAGIC {
            return Err(Violation::BadMagic { found: magic });
        }
        if wire.version != FRAME_VERSION {
            return Err(Violation::BadVersion {
                found: wire.version,
            });
        }
        let stored = wire.header_crc.get();
        let computed = crate::checksum::crc32c(&bytes[..offset::HEADER_CRC]);
        if stored != computed {
            return Err(Violation::BadHeaderCrc { stored, computed });
        }
        let kind =
            FrameKind::from_u8(wire.kind).ok_or(Violation::UnknownKind { found: wire.kind })?;
        let flags = wire.flags.get();
        if flags & !kind.flags_allowed() != 0 {
            return Err(Violation::UnknownFlags {
                kind: wire.kind,
                flags,
            });
        }
        if wire.reserved0.get() != 0 || wire.reserved1.get() != 0 {
            return Err(Violation::ReservedNonZero);
        }
        let payload_len = wire.payload_len.get();
        let max = payload_max.min(PAYLOAD_BYTES_LIMIT);
        if payload_len > max {
            return Err(Violation::Oversized {
                len: payload_len,
                max,
            });
        }
        Ok(Header {
            kind,
            flags,
            txn: wire.txn.get(),
            payload_len,
            msg_type: wire.msg_type.get(),
        })
    }
}

/// Check a received payload against its trailer.
pub fn check_payload(payload: &[u8], trailer: [u8; TRAILER_SIZE]) -> Result<(), Violation> {
    check_payload_crc(crate::checksum::crc32c(payload), trailer)
}

/// Check an already computed payload crc against its trailer.
pub fn check_payload_crc(computed: u32, trailer: [u8; TRAILER_SIZE]) -> Result<(), Violation> {
    let stored = u32::from_le_bytes(trailer);
    if stored != computed {
        return Err(Violation::BadPayloadCrc { stored, computed });
    }
    Ok(())
}

/// Encode a whole frame into one buffer (handshake frames, tests, tools; the data path sends
/// header, caller buffers and trailer with one vectored write instead).
pub fn encode_frame(header: &Header, payload: &[u8]) -> Vec<u8> {
    assert_eq!(
        header.payload_len as usize,
        payload.len(),
        "header length must match payload"
    );
    let mut out = Vec::with_capacity(header.frame_len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(payload);
    out.extend_from_slice(&crate::checksum::crc32c(payload).to_le_bytes());
    out
}

/// One step of parsing a byte stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Not enough bytes yet; at least this many more are needed.
    NeedMore(usize),
    /// A whole valid frame: the payload is `buf[HEADER_SIZE..HEADER_SIZE + payload_len]`, and the
    /// frame takes `header.frame_len()` bytes.
    Frame(Header),
}

/// Parse the frame at the start of `buf` (pure; the worker does the same steps incrementally so
/// it can apply throttles between header and payload). The fuzz target drives this.
pub fn parse_frame(buf: &[u8], payload_max: u32) -> Result<Parsed, Violation> {
    let Some(head) = buf.first_chunk::<HEADER_SIZE>() else {
        return Ok(Parsed::NeedMore(HEADER_SIZE - buf.len()));
    };
    let header = Header::decode(head, payload_max)?;
    let total = header.frame_len();
    if buf.len() < total {
        return Ok(Parsed::NeedMore(total - buf.len()));
    }
    let payload = &buf[HEADER_SIZE..HEADER_SIZE + header.payload_len as usize];
    let trailer = buf[total - TRAILER_SIZE..total]
        .try_into()
        .expect("4 bytes");
    check_payload(payload, trailer)?;
    Ok(Parsed::Frame(header))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(len: u32) -> Header {
        Header {
            kind: FrameKind::Request,
            flags: 0,
            txn: 7,
            payload_len: len,
            msg_type: 3,
        }
    }

    #[test]
    fn header_round_trips_and_magic_reads_nvms() {
        let h = req(5);
        let bytes = h.encode();
        assert_eq!(&bytes[..4], b"NVMS");
        assert_eq!(bytes[offset::VERSION], FRAME_VERSION);
        assert_eq!(bytes[offset::KIND], FrameKind::Request as u8);
        assert_eq!(Header::decode(&bytes, 1 << 20), Ok(h));
    }

    #[test]
    fn every_single_bit_flip_in_a_header_is_rejected() {
        let bytes = req(100).encode();
        for bit in 0..HEADER_SIZE * 8 {
            let mut b = bytes;
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(
                Header::decode(&b, 1 << 20).is_err(),
                "bit {bit} flip accepted"
            );
        }
    }

    #[test]
    fn oversized_length_is_refused_before_reading_the_payload() {
        let bytes = req(2 << 20).encode();
        assert_eq!(
            Header::decode(&bytes, 1 << 20),
            Err(Violation::Oversized {
                len: 2 << 20,
                max: 1 << 20
            })
        );
    }

    #[test]
    fn parse_frame_reports_need_more_then_frame_then_bad_payload_crc() {
        let frame = encode_frame(&req(3), b"abc");
        assert_eq!(parse_frame(&frame[..10], 1024), Ok(Parsed::NeedMore(22)));
        assert_eq!(parse_frame(&frame[..33], 1024), Ok(Parsed::NeedMore(6)));
        assert_eq!(parse_frame(&frame, 1024), Ok(Parsed::Frame(req(3))));
        let mut bad = frame.clone();
        bad[HEADER_SIZE + 1] ^= 0x40;
        assert!(matches!(
            parse_frame(&bad, 1024),
            Err(Violation::BadPayloadCrc { .. })
        ));
    }

    proptest::proptest! {
        /// The decoder on arbitrary bytes: no panic, never claims more than it was given.
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            match parse_frame(&data, 1 << 20) {
                Ok(Parsed::Frame(h)) => proptest::prop_assert!(h.frame_len() <= data.len()),
                Ok(Parsed::NeedMore(n)) => proptest::prop_assert!(n > 0),
                Err(_) => {}
            }
        }

        /// Any frame we encode decodes to itself, at any split of the stream.
        #[test]
        fn encoded_frames_parse_back(
            txn in proptest::prelude::any::<u64>(),
            msg_type in proptest::prelude::any::<u16>(),
            payload in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            cut in 0usize..400,
        ) {
            let h = Header { kind: FrameKind::OneWay, flags: 0, txn, payload_len: payload.len() as u32, msg_type };
            let frame = encode_frame(&h, &payload);
            let cut = cut.min(frame.len());
            if cut < frame.len() {
                proptest::prop_assert!(matches!(parse_frame(&frame[..cut], 1 << 20), Ok(Parsed::NeedMore(_))));
            }
            proptest::prop_assert_eq!(parse_frame(&frame, 1 << 20), Ok(Parsed::Frame(h)));
        }
    }

    #[test]
    fn flags_are_checked_per_kind() {
        let mut h = req(0);
        h.flags = FLAG_REPLY_ABANDONED;
        assert!(matches!(
            Header::decode(&h.encode(), 16),
            Err(Violation::UnknownFlags { .. })
        ));
        h.kind = FrameKind::Reply;
        assert_eq!(Header::decode(&h.encode(), 16), Ok(h));
    }
}
