//! Wire encoding of nvstore's cluster messages (docs/format.md, "Cluster messages").
//!
//! Every payload starts with the sender's map epoch (u64 LE); then the message body, built
//! from little-endian integers and length-prefixed byte strings (u32 LE length). Control-plane
//! bodies (maps, monitor commands, raft RPCs) are JSON after the epoch; data-path bodies
//! (client ops, shard ops) are binary.

use std::fmt;

use crate::error::{Error, Result};

// Message types (messenger msg_type). Monitor range 1..=19, node range 20..=49.
pub const MSG_MON_GET_MAP: u16 = 1;
pub const MSG_MON_SUBSCRIBE: u16 = 2;
pub const MSG_MON_MAP_PUSH: u16 = 3;
pub const MSG_MON_COMMAND: u16 = 4;
pub const MSG_MON_HEARTBEAT: u16 = 5;
pub const MSG_MON_STATUS: u16 = 6;
pub const MSG_RAFT_VOTE: u16 = 10;
pub const MSG_RAFT_APPEND: u16 = 11;
pub const MSG_RAFT_SNAPSHOT: u16 = 12;
pub const MSG_CLIENT_OP: u16 = 20;
pub const MSG_CLIENT_STAGE: u16 = 21;
pub const MSG_CLIENT_LIST: u16 = 22;
/// A shard of a whole-object write the client encoded itself, staged on the member that
/// stores it until the primary's `MSG_SHARD_WRITE_STAGED` names it (`node::staging`).
pub const MSG_CLIENT_STAGE_SHARD: u16 = 23;
pub const MSG_SHARD_WRITE: u16 = 30;
pub const MSG_SHARD_READ: u16 = 31;
/// `MSG_SHARD_READ` flag: read the device, not the member's read cache (scrub).
pub const SHARD_READ_FROM_DEVICE: u8 = 1;
/// `MSG_SHARD_READ` flag: after the bytes, list the CRC of each whole chunk they are made of
/// (the primary combines them into the reply's frame CRC instead of summing the bytes).
pub const SHARD_READ_CHUNK_CRCS: u8 = 2;
pub const MSG_SHARD_STAT: u16 = 32;
pub const MSG_SHARD_ROLLBACK: u16 = 33;
/// Remove a member's leftover shard of an object (a state older than what a member complete
/// past it knows: `resolve`).
pub const MSG_SHARD_DROP: u16 = 34;
/// `MSG_SHARD_WRITE` whose data a client staged on the member (`MSG_CLIENT_STAGE_SHARD`):
/// the body names the staged shard instead of carrying its bytes.
pub const MSG_SHARD_WRITE_STAGED: u16 = 35;
// Recovery (src/node/recovery.rs): served on the members' low-priority queue.
/// A member's shards of one PG: (name, shard, version, size, deleted), paged by name.
pub const MSG_SHARD_LIST: u16 = 40;
/// A member's PG log window and its recovery mark.
pub const MSG_PG_LOG: u16 = 41;
/// Record on a member that its slot of a PG is complete through a version.
pub const MSG_PG_MARK: u16 = 42;
/// `MSG_SHARD_READ` at recovery priority.
pub const MSG_RECOVERY_READ: u16 = 43;
/// A whole-shard write at recovery priority; a member already at or past its version skips it.
pub const MSG_RECOVERY_WRITE: u16 = 44;
/// Drop the rollback records of writes the primary saw acknowledged.
pub const MSG_SHARD_SETTLE: u16 = 45;
/// Ask a PG's primary whether the PG is clean (a former member may then remove its keys).
pub const MSG_PG_CLEAN: u16 = 46;
/// Remove the tombstones of objects removed a while ago (`tombstone_keep_s`).
pub const MSG_SHARD_FORGET: u16 = 47;
// Admin range 50..=59 (client → node, JSON replies; docs/operations.md).
pub const MSG_ADMIN_PERF_DUMP: u16 = 50;
pub const MSG_ADMIN_PERF_RESET: u16 = 51;
pub const MSG_ADMIN_SLOW_OPS: u16 = 52;
/// Runtime settings: get them all, or set one (key and value strings) and get them all.
pub const MSG_ADMIN_CONFIG: u16 = 53;
/// Replace a shard at a version with reconstructed bytes (scrub and read repair).
pub const MSG_SHARD_REPAIR: u16 = 70;
/// Scrub control: start a pass now, or report the node's scrub state (JSON).
pub const MSG_NODE_SCRUB: u16 = 71;
/// Where a shard's data chunks sit on the node's device (tests and `nvstore scrub locate`).
pub const MSG_NODE_LOCATE: u16 = 72;
/// A node's ping of another node (empty; answered Ok on the receiving messenger worker):
/// the failure reports of `node/peerping.rs`.
pub const MSG_PEER_PING: u16 = 60;
/// Every reply uses this type; its body starts with a [`Status`].
pub const MSG_REPLY: u16 = 99;

/// Identity numbers of monitors: `node.(MON_IDENTITY_BASE + monitor id)`.
pub const MON_IDENTITY_BASE: u32 = 0x4000_0000;

/// Status of a reply (u16 LE right after the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[repr(u16)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    VersionMismatch = 2,
    Exists = 3,
    NoSuchPool = 4,
    Invalid = 5,
    TooLarge = 6,
    /// This node is not the PG's primary in the epoch in the reply: refresh the map, retry.
    WrongPrimary = 7,
    /// Fewer than min_size shards could be made durable: the write was not acknowledged.
    Degraded = 8,
    /// Not enough shards reachable to read the object.
    Unavailable = 9,
    /// The sender's epoch is older than one the receiver must not go back from.
    StaleEpoch = 10,
    Io = 11,
    Malformed = 12,
    NoXattr = 13,
    NoSpace = 14,
    TimedOut = 15,
    NotLeader = 16,
    Internal = 17,
    /// A stored checksum did not match: the message names device, byte offset and the
    /// expected and found crc32c. The primary reads around the shard and repairs it.
    Corrupted = 18,
    /// A shard the op names was not staged on the node (expired, the node restarted, or it
    /// was staged elsewhere): the client stages again or sends the data to the primary.
    NotStaged = 19,
}

impl Status {
    pub fn from_u16(v: u16) -> Status {
        use Status::*;
        [
            Ok,
            NotFound,
            VersionMismatch,
            Exists,
            NoSuchPool,
            Invalid,
            TooLarge,
            WrongPrimary,
            Degraded,
            Unavailable,
            StaleEpoch,
            Io,
            Malformed,
            NoXattr,
            NoSpace,
            TimedOut,
            NotLeader,
            Internal,
            Corrupted,
            NotStaged,
        ]
        .get(v as usize)
        .copied()
        .unwrap_or(Internal)
    }

    pub fn name(self) -> &'static str {
        use Status::*;
        match self {
            Ok => "ok",
            NotFound => "not found",
            VersionMismatch => "version mismatch",
            Exists => "already exists",
            NoSuchPool => "no such pool",
            Invalid => "invalid argument",
            TooLarge => "too large",
            WrongPrimary => "not the primary",
            Degraded => "degraded below min_size",
            Unavailable => "unavailable",
            StaleEpoch => "stale map epoch",
            Io => "i/o error",
            Malformed => "malformed request",
            NoXattr => "no such xattr",
            NoSpace => "out of space",
            TimedOut => "timed out",
            NotLeader => "not the monitor leader",
            Internal => "internal error",
            Corrupted => "corrupt shard",
            NotStaged => "shard not staged",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Little-endian encoder.
#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn new(epoch: u64) -> Enc {
        let mut e = Enc(Vec::with_capacity(64));
        e.u64(epoch);
        e
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// u32 length, then the bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }
    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Little-endian decoder over a received payload; every read is bounds checked.
pub struct Dec<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Dec<'a> {
    pub fn new(b: &'a [u8]) -> Dec<'a> {
        Dec { b, at: 0 }
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() - self.at < n {
            return Err(Error::Malformed(format!(
                "message ends at byte {} but {} more bytes were expected at {}",
                self.b.len(),
                n,
                self.at
            )));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<&'a str> {
        std::str::from_utf8(self.bytes()?)
            .map_err(|_| Error::Malformed("string is not UTF-8".into()))
    }
    /// A trailing flags byte that older senders leave out: 0 when the message ends here.
    pub fn opt_flags(&mut self) -> Result<u8> {
        if self.at == self.b.len() {
            Ok(0)
        } else {
            self.u8()
        }
    }
    /// Step over `n` bytes.
    pub fn skip(&mut self, n: usize) -> Result<()> {
        self.take(n).map(|_| ())
    }
    /// A list of (length u32, crc32c u32) pieces, count u32 first (shard writes, staged
    /// shards, shard read replies); `what` names the message in the error for a short one.
    pub fn crc_list(&mut self, what: &str) -> Result<Vec<(u32, u32)>> {
        let n = self.u32()? as usize;
        if n > self.remaining() / 8 {
            return Err(Error::Malformed(format!("{what}: chunk crc list is short")));
        }
        (0..n).map(|_| Ok((self.u32()?, self.u32()?))).collect()
    }
    /// Bytes left to read.
    pub fn remaining(&self) -> usize {
        self.b.len() - self.at
    }
    /// Offset of the next unread byte.
    pub fn pos(&self) -> usize {
        self.at
    }
    pub fn rest(&mut self) -> &'a [u8] {
        let r = &self.b[self.at..];
        self.at = self.b.len();
        r
    }
    pub fn end(&self) -> Result<()> {
        if self.at != self.b.len() {
            return Err(Error::Malformed(format!(
                "{} unexpected trailing bytes",
                self.b.len() - self.at
            )));
        }
        Ok(())
    }
}

/// A reply payload: epoch, status, then either the body (ok) or an error message.
pub fn reply_ok(epoch: u64, body: &[u8]) -> Vec<u8> {
    let mut e = Enc::new(epoch);
    e.u16(Status::Ok as u16);
    e.0.extend_from_slice(body);
    e.finish()
}

pub fn reply_err(epoch: u64, status: Status, message: &str) -> Vec<u8> {
    let mut e = Enc::new(epoch);
    e.u16(status as u16).str(message);
    e.finish()
}

/// Split a reply into (epoch, body) or the error it carries.
pub fn parse_reply(b: &[u8]) -> Result<(u64, &[u8])> {
    let mut d = Dec::new(b);
    let epoch = d.u64()?;
    let status = Status::from_u16(d.u16()?);
    if status == Status::Ok {
        return Ok((epoch, d.rest()));
    }
    let msg = d.str().unwrap_or("(no message)").to_string();
    Err(Error::Remote {
        status,
        message: msg,
    })
}

/// Like [`parse_reply`] but keeps the epoch of an error reply.
pub fn parse_reply_epoch(b: &[u8]) -> (u64, Result<&[u8]>) {
    let epoch = Dec::new(b).u64().unwrap_or(0);
    (epoch, parse_reply(b).map(|(_, body)| body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut e = Enc::new(7);
        e.u8(1).u16(2).u32(3).u64(4).str("héllo").bytes(&[9, 9]);
        let v = e.finish();
        let mut d = Dec::new(&v);
        assert_eq!(d.u64().unwrap(), 7);
        assert_eq!(d.u8().unwrap(), 1);
        assert_eq!(d.u16().unwrap(), 2);
        assert_eq!(d.u32().unwrap(), 3);
        assert_eq!(d.u64().unwrap(), 4);
        assert_eq!(d.str().unwrap(), "héllo");
        assert_eq!(d.bytes().unwrap(), &[9, 9]);
        d.end().unwrap();
        let mut short = Dec::new(&v[..v.len() - 1]);
        short.u64().unwrap();
        short.u8().unwrap();
        short.u16().unwrap();
        short.u32().unwrap();
        short.u64().unwrap();
        short.str().unwrap();
        assert!(matches!(short.bytes(), Err(Error::Malformed(_))));
        let r = reply_err(5, Status::NoSuchPool, "pool 9");
        match parse_reply(&r) {
            Err(Error::Remote { status, message }) => {
                assert_eq!(status, Status::NoSuchPool);
                assert_eq!(message, "pool 9");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(parse_reply(&reply_ok(3, b"xy")).unwrap(), (3, &b"xy"[..]));
    }
}
