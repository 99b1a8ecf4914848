//! A node's own shards: applying shard writes (with the record that undoes them), reads,
//! stats, rollbacks, and the per-PG log, all on the local stores.
//!
//! Store keys (docs/format.md, "Cluster messages" → "Shard objects"):
//! * `(pool, name, shard)` — shard data; xattr `nv.meta` = [`ShardMeta`], `nv.rb` = the
//!   [`Rollback`] of the last write, `nv.req` = the [`ReqHistory`] of the object's recent
//!   writes (when any had a request id), `u.<name>` = user xattrs (every shard carries them
//!   all).
//! * `(pool, name, shard | 0x80)` — rollback bytes too large for the xattr.
//! * `(pool, "\0log" ‖ pg BE32 ‖ version BE64 ‖ name, 0xFE)` — per-PG log entry (empty).
//! * `(pool, "\0rec" ‖ pg BE32, 0xFD)` — the PG's recovery mark: slot u8, version u64
//!   ("my shards of this slot are complete through this version"; `recovery.rs`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use driver::{BlockDevice, FileDevice};
use store::{AsyncCommit, ObjectKey, Part, ReadBuf, Store, StoreError, Transaction};

use crate::error::{Error, Result};
use crate::wire::{Dec, Enc, Status};
use messenger::{Identity, SendBuf};

/// Rollback bytes kept inline in the `nv.rb` xattr up to this size.
const ROLLBACK_INLINE_BYTES_MAX: usize = 32 << 10;
/// Shard writes up to this size that create their shard are applied without blocking, on the
/// thread that received them ([`Local::apply_async`]); their data is copied once.
pub const ASYNC_APPLY_BYTES_MAX: usize = 64 << 10;
/// Default `read_cache_bytes`: memory per device for the store's cache of small reads.
pub const READ_CACHE_BYTES_DEFAULT: u64 = 64 << 20;
/// Per-PG log entries a member keeps.
pub const PG_LOG_ENTRIES_MAX: usize = 512;
pub const SHARD_ROLLBACK_BIT: u8 = 0x80;
pub const SHARD_LOG: u8 = 0xFE;
const XATTR_META: &str = "nv.meta";
const XATTR_RB: &str = "nv.rb";
/// The object's [`ReqHistory`] (absent when empty).
const XATTR_REQ: &str = "nv.req";
const USER_PREFIX: &str = "u.";
/// `base_version` meaning "whatever the member has".
pub const BASE_ANY: u64 = u64::MAX;

/// The client request a write carries out: who sent it and its `ClientOp::reqid`. Each shard
/// keeps those of the writes that made the object's recent versions (`nv.req`, a
/// [`ReqHistory`]), so a node that later leads the PG recognises a resend of one of them
/// (`ObjState::reqs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReqId {
    pub who: Identity,
    pub id: u64,
}

impl ReqId {
    /// kind u8 (1 client, 2 node), who u32 LE, id u64 LE.
    pub const BYTES: usize = 13;

    pub(super) fn to_bytes(self) -> [u8; Self::BYTES] {
        let (kind, n) = match self.who {
            Identity::Client(n) => (1u8, n),
            Identity::Node(n) => (2u8, n),
        };
        let mut b = [0u8; Self::BYTES];
        b[0] = kind;
        b[1..5].copy_from_slice(&n.to_le_bytes());
        b[5..].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    /// `None` for anything that is not 13 bytes of a known kind.
    pub(super) fn from_bytes(b: &[u8]) -> Option<ReqId> {
        if b.len() != Self::BYTES {
            return None;
        }
        let n = u32::from_le_bytes(b[1..5].try_into().expect("4 bytes"));
        let who = match b[0] {
            1 => Identity::Client(n),
            2 => Identity::Node(n),
            _ => return None,
        };
        let id = u64::from_le_bytes(b[5..].try_into().expect("8 bytes"));
        Some(ReqId { who, id })
    }
}

/// Request ids an object's history keeps: a resend is recognised on a new primary while its
/// write is among the object's last this many writes that had one.
pub const REQ_HISTORY_MAX: usize = 8;

/// The client requests whose writes made an object's recent versions, newest first, each with
/// the version it made (at most [`REQ_HISTORY_MAX`]). Every shard of a version holds the same
/// history: the primary that writes the version sends it (`ShardWrite::reqs`), recovery and
/// repair writes carry the object's, and a rollback keeps only the entries at or below the
/// version it restores. Its entries are facts: each names a version that was acknowledged or
/// rolled forward, so a resend found in it is answered with that version, never applied again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReqHistory(Vec<(ReqId, u64)>);

impl ReqHistory {
    /// One entry as `nv.req` and the wire hold it: a [`ReqId`] (13 bytes), version u64 LE.
    pub const ENTRY_BYTES: usize = ReqId::BYTES + 8;

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn entries(&self) -> &[(ReqId, u64)] {
        &self.0
    }

    /// The version the write of request `r` made, if it is in the history.
    pub fn version_of(&self, r: ReqId) -> Option<u64> {
        self.0.iter().find(|(q, _)| *q == r).map(|&(_, v)| v)
    }

    /// The history after a write that makes `version`: that write's request (if it has one)
    /// first, then this history, trimmed to [`REQ_HISTORY_MAX`].
    pub fn after(&self, req: Option<ReqId>, version: u64) -> ReqHistory {
        let mut h = Vec::with_capacity(REQ_HISTORY_MAX.min(self.0.len() + 1));
        h.extend(req.map(|r| (r, version)));
        h.extend(self.0.iter().copied().filter(|(q, _)| Some(*q) != req));
        h.truncate(REQ_HISTORY_MAX);
        ReqHistory(h)
    }

    /// The entries of writes at or below `version` (what a rollback to it keeps).
    pub fn through(&self, version: u64) -> ReqHistory {
        ReqHistory(
            self.0
                .iter()
                .copied()
                .filter(|&(_, v)| v <= version)
                .collect(),
        )
    }

    /// `nv.req`: n × (request id, version u64 LE).
    fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.0.len() * Self::ENTRY_BYTES);
        for (r, v) in &self.0 {
            b.extend_from_slice(&r.to_bytes());
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// `nv.req` as stored; `version` is the shard's. A value written before histories (one
    /// 13-byte request id, the write that made `version`) reads as that one entry; anything
    /// unreadable as none (a resend is then applied again, never wrongly answered).
    fn from_bytes(b: &[u8], version: u64) -> ReqHistory {
        if let Some(r) = ReqId::from_bytes(b) {
            return ReqHistory(vec![(r, version)]);
        }
        if !b.len().is_multiple_of(Self::ENTRY_BYTES)
            || b.len() / Self::ENTRY_BYTES > REQ_HISTORY_MAX
        {
            return ReqHistory::default();
        }
        b.chunks_exact(Self::ENTRY_BYTES)
            .map(|e| {
                let (r, v) = e.split_at(ReqId::BYTES);
                Some((
                    ReqId::from_bytes(r)?,
                    u64::from_le_bytes(v.try_into().expect("8 bytes")),
                ))
            })
            .collect::<Option<Vec<_>>>()
            .map(ReqHistory)
            .unwrap_or_default()
    }

    /// On the wire: n u8, then n entries as in `nv.req`.
    fn encode(&self, e: &mut Enc) {
        e.u8(self.0.len() as u8);
        e.0.extend_from_slice(&self.to_bytes());
    }

    fn decode(d: &mut Dec) -> Result<ReqHistory> {
        let n = d.u8()? as usize;
        if n > REQ_HISTORY_MAX {
            return Err(Error::Malformed(format!(
                "request history of {n} entries (at most {REQ_HISTORY_MAX})"
            )));
        }
        let mut h = Vec::with_capacity(n);
        for _ in 0..n {
            let mut b = [0u8; ReqId::BYTES];
            b[0] = d.u8()?;
            b[1..5].copy_from_slice(&d.u32()?.to_le_bytes());
            b[5..].copy_from_slice(&d.u64()?.to_le_bytes());
            let r = ReqId::from_bytes(&b)
                .ok_or_else(|| Error::Malformed(format!("request id kind {}", b[0])))?;
            h.push((r, d.u64()?));
        }
        Ok(ReqHistory(h))
    }
}

/// The object as one shard knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardMeta {
    pub version: u64,
    /// Logical object size.
    pub size: u64,
    pub mtime_unix_ns: u64,
    /// A tombstone: the object was removed at `version`.
    pub deleted: bool,
}

impl ShardMeta {
    pub fn encode(&self, e: &mut Enc) {
        e.u64(self.version)
            .u64(self.size)
            .u64(self.mtime_unix_ns)
            .u8(self.deleted as u8);
    }
    pub fn decode(d: &mut Dec) -> Result<ShardMeta> {
        Ok(ShardMeta {
            version: d.u64()?,
            size: d.u64()?,
            mtime_unix_ns: d.u64()?,
            deleted: d.u8()? != 0,
        })
    }
    fn to_bytes(self) -> Vec<u8> {
        let mut e = Enc::default();
        self.encode(&mut e);
        e.0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore {
    /// Only metadata and xattrs changed.
    Nothing,
    /// The object did not exist: remove it.
    Remove,
    /// Put back the whole old shard.
    Full(Vec<u8>),
    /// Put back old bytes at an offset.
    Range(u64, Vec<u8>),
    /// Put back the whole old shard, which the write moved to the rollback key (pool, name,
    /// shard|0x80) by reference instead of copying it. Encoded as `Full` with its bytes
    /// spilled there, and decoded as that.
    Moved,
}

/// The store's rename partner of a shard key: its rollback key, and back (the shard id's top
/// bit flipped; [`store::StoreConfig::alias`]). Internal keys (names starting with 0: PG log
/// entries, marks) have none.
pub fn rollback_partner(k: &ObjectKey) -> Option<ObjectKey> {
    (k.name.first() != Some(&0)).then(|| ObjectKey {
        shard: k.shard ^ SHARD_ROLLBACK_BIT,
        ..k.clone()
    })
}

/// A list of xattr changes: u32 count, then per entry name `str`, u8 present, value `bytes`
/// when present (`None` removes).
fn encode_xattr_changes(e: &mut Enc, xattrs: &[(String, Option<Vec<u8>>)]) {
    e.u32(xattrs.len() as u32);
    for (k, v) in xattrs {
        e.str(k);
        match v {
            Some(v) => e.u8(1).bytes(v),
            None => e.u8(0),
        };
    }
}

fn decode_xattr_changes(d: &mut Dec) -> Result<Vec<(String, Option<Vec<u8>>)>> {
    let n = d.u32()? as usize;
    let mut xattrs = Vec::with_capacity(n.min(256));
    for _ in 0..n {
        let k = d.str()?.to_string();
        let v = match d.u8()? {
            0 => None,
            _ => Some(d.bytes()?.to_vec()),
        };
        xattrs.push((k, v));
    }
    Ok(xattrs)
}

/// How to undo the last write on a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rollback {
    pub version_from: u64,
    pub prev: Option<ShardMeta>,
    pub restore: Restore,
    /// Old values of the user xattrs the write touched (`None`: absent).
    pub xattrs: Vec<(String, Option<Vec<u8>>)>,
}

impl Rollback {
    /// Encode; bytes over the inline limit go to `spill` instead.
    fn encode(&self, spill: &mut Option<Vec<u8>>) -> Vec<u8> {
        let mut e = Enc::default();
        e.u64(self.version_from);
        match &self.prev {
            Some(m) => {
                e.u8(1);
                m.encode(&mut e);
            }
            None => {
                e.u8(0);
            }
        }
        let (kind, off, bytes): (u8, u64, &[u8]) = match &self.restore {
            Restore::Nothing => (0, 0, &[]),
            Restore::Remove => (1, 0, &[]),
            Restore::Full(b) => (2, 0, b),
            Restore::Range(o, b) => (3, *o, b),
            Restore::Moved => (2, 0, &[]),
        };
        e.u8(kind).u64(off);
        if self.restore == Restore::Moved {
            // Already at the rollback key.
            e.u8(1);
        } else if bytes.len() > ROLLBACK_INLINE_BYTES_MAX {
            e.u8(1);
            *spill = Some(bytes.to_vec());
        } else {
            e.u8(0).bytes(bytes);
        }
        encode_xattr_changes(&mut e, &self.xattrs);
        e.0
    }

    fn decode(b: &[u8], spilled: impl FnOnce() -> Result<Vec<u8>>) -> Result<Rollback> {
        let mut d = Dec::new(b);
        let version_from = d.u64()?;
        let prev = match d.u8()? {
            0 => None,
            _ => Some(ShardMeta::decode(&mut d)?),
        };
        let kind = d.u8()?;
        let off = d.u64()?;
        let bytes = match d.u8()? {
            0 => d.bytes()?.to_vec(),
            _ => spilled()?,
        };
        let restore = match kind {
            0 => Restore::Nothing,
            1 => Restore::Remove,
            2 => Restore::Full(bytes),
            _ => Restore::Range(off, bytes),
        };
        let xattrs = decode_xattr_changes(&mut d)?;
        Ok(Rollback {
            version_from,
            prev,
            restore,
            xattrs,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    /// Replace the shard (and every user xattr).
    Full = 0,
    /// Write bytes at an offset.
    Range = 1,
    /// Metadata and xattr changes only.
    Meta = 2,
}

/// A shard write's bytes: one slice (as decoded from a message), or the pieces a primary
/// holds its own data shard in (the stripe units of the client's request), which its store
/// takes without joining them ([`store::Transaction::replace_parts`]).
#[derive(Debug, Clone, Copy)]
pub enum ShardData<'a> {
    Flat(&'a [u8]),
    Parts(&'a [&'a [u8]]),
}

impl<'a> ShardData<'a> {
    pub fn len(&self) -> usize {
        match self {
            ShardData::Flat(d) => d.len(),
            ShardData::Parts(p) => p.iter().map(|p| p.len()).sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes as one slice: borrowed when flat, joined when in parts.
    pub fn joined(&self) -> std::borrow::Cow<'a, [u8]> {
        match self {
            ShardData::Flat(d) => std::borrow::Cow::Borrowed(d),
            ShardData::Parts(p) => std::borrow::Cow::Owned(p.concat()),
        }
    }
}

/// One shard write, as a primary sends it.
#[derive(Debug, Clone)]
pub struct ShardWrite<'a> {
    pub pool: u64,
    pub pg: u32,
    pub name: &'a [u8],
    pub shard: u8,
    pub kind: WriteKind,
    /// The version the member must hold (Range/Meta), or [`BASE_ANY`].
    pub base_version: u64,
    pub meta: ShardMeta,
    pub offset: u64,
    /// Full: the complete set; Range/Meta: changes (`None` removes).
    pub xattrs: Vec<(String, Option<Vec<u8>>)>,
    /// The requests whose writes made the object's recent versions, through `meta.version`,
    /// kept with the shard (`nv.req`): the primary's write puts its own request first; a
    /// recovery or repair carries the object's as resolved.
    pub reqs: ReqHistory,
    pub data: ShardData<'a>,
    /// (length, CRC-32C) of consecutive pieces of `data`, tiling it, known to describe it:
    /// the primary's own sums, or a member's list that [`ShardWrite::vouch`] checked against
    /// the frame's CRC. A whole-shard write whose pieces are the store's chunks records these
    /// instead of summing the bytes again. Empty: unknown.
    pub chunk_crcs: Vec<(u32, u32)>,
    /// The list as the message carried it, not yet checked (see [`ShardWrite::vouch`]).
    pub listed_crcs: Vec<(u32, u32)>,
}

impl<'a> ShardWrite<'a> {
    /// Everything but the data; the data goes as the message's last part (u32 length first).
    pub fn encode_header(&self, epoch: u64) -> Vec<u8> {
        self.encode_header_len(epoch, self.data.len())
    }

    /// [`ShardWrite::encode_header`] for `data_len` bytes of data that `self.data` does not
    /// hold (they go out as several parts).
    pub fn encode_header_len(&self, epoch: u64, data_len: usize) -> Vec<u8> {
        let mut e = Enc::new(epoch);
        e.u64(self.pool)
            .u32(self.pg)
            .bytes(self.name)
            .u8(self.shard)
            .u8(self.kind as u8)
            .u64(self.base_version);
        self.meta.encode(&mut e);
        e.u64(self.offset);
        encode_xattr_changes(&mut e, &self.xattrs);
        self.reqs.encode(&mut e);
        e.u32(data_len as u32);
        e.0
    }

    pub fn decode(d: &mut Dec<'a>) -> Result<ShardWrite<'a>> {
        Ok(Self::decode_inner(d, false)?.0)
    }

    /// A `MSG_SHARD_WRITE_STAGED` body after the epoch: the write (no data) and the staged
    /// shard it names.
    pub fn decode_staged(d: &mut Dec<'a>) -> Result<(ShardWrite<'a>, StagedRef)> {
        let (w, r) = Self::decode_inner(d, true)?;
        Ok((w, r.expect("decoded when asked for")))
    }

    /// [`ShardWrite::encode_header`] of a write whose data a client staged on the member:
    /// no data (length 0), then the staged shard's reference.
    pub fn encode_staged(&self, epoch: u64, r: &StagedRef) -> Vec<u8> {
        let mut b = self.encode_header_len(epoch, 0);
        b.extend_from_slice(&r.upload.to_bytes());
        b.extend_from_slice(&r.len.to_le_bytes());
        b
    }

    fn decode_inner(d: &mut Dec<'a>, staged: bool) -> Result<(ShardWrite<'a>, Option<StagedRef>)> {
        let pool = d.u64()?;
        let pg = d.u32()?;
        let name = d.bytes()?;
        let shard = d.u8()?;
        let kind = match d.u8()? {
            0 => WriteKind::Full,
            1 => WriteKind::Range,
            2 => WriteKind::Meta,
            k => return Err(Error::Malformed(format!("shard write kind {k}"))),
        };
        let base_version = d.u64()?;
        let meta = ShardMeta::decode(d)?;
        let offset = d.u64()?;
        let xattrs = decode_xattr_changes(d)?;
        let reqs = ReqHistory::decode(d)?;
        let bytes = d.bytes()?;
        let data = ShardData::Flat(bytes);
        let staged = if staged {
            if !bytes.is_empty() {
                return Err(Error::Malformed("a staged shard write carries data".into()));
            }
            let upload = ReqId::from_bytes(d.take(ReqId::BYTES)?)
                .ok_or_else(|| Error::Malformed("staged shard write: bad upload id".into()))?;
            Some(StagedRef {
                upload,
                len: d.u32()?,
            })
        } else {
            None
        };
        // Optionally, after the data: n u32, n × (length u32, crc32c u32) of its pieces.
        let mut listed_crcs = Vec::new();
        if d.remaining() > 0 {
            listed_crcs = d.crc_list("shard write")?;
            let total: u64 = listed_crcs.iter().map(|&(l, _)| u64::from(l)).sum();
            if total != bytes.len() as u64 {
                return Err(Error::Malformed(format!(
                    "shard write: chunk crcs cover {total} bytes of {}",
                    bytes.len()
                )));
            }
        }
        d.end()?;
        let w = ShardWrite {
            pool,
            pg,
            name,
            shard,
            kind,
            base_version,
            meta,
            offset,
            xattrs,
            reqs,
            data,
            chunk_crcs: Vec::new(),
            listed_crcs,
        };
        Ok((w, staged))
    }

    /// Adopt the chunk CRCs the message listed if they describe the data: the receiving
    /// messenger verified `payload_crc` over the whole `payload` (this write's bytes lie in
    /// it), so the CRC of the bytes before the data, the listed CRCs combined, and the CRC of
    /// the bytes after must combine to it. That costs a pass over the few bytes around the
    /// data, not over the data. A list that does not add up (a sender bug: the bytes
    /// themselves arrived intact) is dropped and the store sums the bytes.
    /// Returns `None` when nothing was listed, else whether the list was adopted.
    pub fn vouch(&mut self, payload: &[u8], payload_crc: u32) -> Option<bool> {
        let listed = std::mem::take(&mut self.listed_crcs);
        let ShardData::Flat(data) = self.data else {
            return None;
        };
        if listed.is_empty() {
            return None;
        }
        if crcs_describe(payload, payload_crc, data, &listed) {
            self.chunk_crcs = listed;
            Some(true)
        } else {
            tracing::warn!(
                shard = self.shard,
                "a shard write's chunk crc list does not describe its bytes; summing them"
            );
            Some(false)
        }
    }
}

/// Whether `listed` (length, CRC-32C) pieces tiling `data`, which lies inside `payload`,
/// describe it: the CRC of the bytes before `data`, the listed CRCs combined and the CRC of
/// the bytes after must combine to `payload_crc`, which the receiving messenger verified over
/// the whole payload. A pass over the bytes around the data, not over the data.
pub fn crcs_describe(payload: &[u8], payload_crc: u32, data: &[u8], listed: &[(u32, u32)]) -> bool {
    let start = (data.as_ptr() as usize).wrapping_sub(payload.as_ptr() as usize);
    let covered: u64 = listed.iter().map(|&(l, _)| u64::from(l)).sum();
    if start > payload.len() || covered != data.len() as u64 {
        return false;
    }
    let Some(after) = payload.get(start.saturating_add(data.len())..) else {
        return false;
    };
    use messenger::checksum::{crc32c, crc32c_combine};
    let data_crc = listed
        .iter()
        .fold(0, |c, &(len, crc)| crc32c_combine(c, crc, len as usize));
    let whole = crc32c_combine(
        crc32c_combine(crc32c(&payload[..start]), data_crc, data.len()),
        crc32c(after),
        after.len(),
    );
    whole == payload_crc
}

/// A staged shard a `MSG_SHARD_WRITE_STAGED` names: the client's upload and the shard's
/// length (docs/format.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedRef {
    pub upload: ReqId,
    pub len: u32,
}

/// The CRC of each store chunk of a whole shard of `len` bytes, from `pieces` (length, crc)
/// that tile it, if each piece is exactly one chunk of `chunk_bytes` (the last one shorter).
fn chunk_crcs_of(pieces: &[(u32, u32)], len: usize, chunk_bytes: u64) -> Option<Vec<u32>> {
    let cb = chunk_bytes as usize;
    if pieces.is_empty() || pieces.len() != len.div_ceil(cb) {
        return None;
    }
    let last = pieces.len() - 1;
    pieces
        .iter()
        .enumerate()
        .all(|(i, &(l, _))| l as usize == if i == last { len - cb * last } else { cb })
        .then(|| pieces.iter().map(|&(_, c)| c).collect())
}

/// A shard's state as `stat` reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardState {
    pub meta: Option<ShardMeta>,
    /// The version the stored rollback record undoes (0: none).
    pub rollback_from: u64,
    pub xattrs: BTreeMap<String, Vec<u8>>,
    /// The requests whose writes made the object's recent versions (the `nv.req` xattr).
    pub reqs: ReqHistory,
    /// For a member with no shard of the object: its recovery mark of the PG, (slot,
    /// version), if it has one. A member complete through a version that has no shard of
    /// an object proves that no acknowledged state of the object at or below that version
    /// is current (`resolve` drops such leftovers).
    pub mark: Option<(u8, u64)>,
}

impl ShardState {
    pub fn encode(&self, e: &mut Enc) {
        match &self.meta {
            Some(m) => {
                e.u8(1);
                m.encode(e);
            }
            None => {
                e.u8(0);
            }
        }
        e.u64(self.rollback_from).u32(self.xattrs.len() as u32);
        for (k, v) in &self.xattrs {
            e.str(k).bytes(v);
        }
        self.reqs.encode(e);
        match self.mark {
            Some((slot, version)) => e.u8(1).u8(slot).u64(version),
            None => e.u8(0),
        };
    }
    pub fn decode(d: &mut Dec) -> Result<ShardState> {
        let meta = match d.u8()? {
            0 => None,
            _ => Some(ShardMeta::decode(d)?),
        };
        let rollback_from = d.u64()?;
        let n = d.u32()? as usize;
        let mut xattrs = BTreeMap::new();
        for _ in 0..n {
            xattrs.insert(d.str()?.to_string(), d.bytes()?.to_vec());
        }
        let reqs = ReqHistory::decode(d)?;
        let mark = match d.u8()? {
            0 => None,
            _ => Some((d.u8()?, d.u64()?)),
        };
        Ok(ShardState {
            meta,
            rollback_from,
            xattrs,
            reqs,
            mark,
        })
    }
}

/// How [`Local::apply_with`] commits.
enum Commit {
    /// Block until durable.
    Wait,
    /// Block until durable, keeping no undo record: the write puts a state that stands (a
    /// recovery write of an object's resolved version), so nothing will roll it back.
    WaitSettled,
    /// Return at once; the callback runs on the commit thread.
    Async(Arc<Local>, Box<dyn FnOnce(Option<Result<()>>) + Send>),
}

/// What a shard write's commit leaves to do once it is durable.
struct Applied {
    pg: (u64, u32),
    key: ObjectKey,
    log_key: ObjectKey,
    meta: ShardMeta,
}

/// Most shard states the meta cache keeps (about 120 bytes each: 64 MiB at most).
const META_CACHE_ENTRIES: usize = 1 << 19;

/// Shard states (`None`: no such shard) recently read or written, so that a shard write or a
/// cached read does not parse the state xattr from the store again. Bounded: two generations
/// of at most half the entries each; when the current one is full it becomes the old one (the
/// old one is dropped), and an entry found in the old one moves to the current one. A miss
/// costs a store lookup, never a wrong answer: every change to a shard's state goes through
/// `insert` or `remove`.
struct MetaCache {
    cur: HashMap<ObjectKey, Option<ShardMeta>>,
    old: HashMap<ObjectKey, Option<ShardMeta>>,
    half: usize,
}

impl MetaCache {
    fn new(entries: usize) -> MetaCache {
        MetaCache {
            cur: HashMap::new(),
            old: HashMap::new(),
            half: (entries / 2).max(1),
        }
    }

    fn get(&mut self, key: &ObjectKey) -> Option<Option<ShardMeta>> {
        if let Some(m) = self.cur.get(key) {
            return Some(*m);
        }
        let (k, m) = self.old.remove_entry(key)?;
        self.insert(k, m);
        Some(m)
    }

    fn insert(&mut self, key: ObjectKey, m: Option<ShardMeta>) {
        if self.cur.len() >= self.half && !self.cur.contains_key(&key) {
            self.old = std::mem::take(&mut self.cur);
        }
        self.cur.insert(key, m);
    }

    fn remove(&mut self, key: &ObjectKey) {
        self.cur.remove(key);
        self.old.remove(key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.cur.len() + self.old.len()
    }
}

/// The node's stores and the indexes it keeps over them.
pub struct Local {
    pub stores: Vec<Store<FileDevice>>,
    meta_cache: Mutex<MetaCache>,
    pg_logs: Mutex<HashMap<(u64, u32), VecDeque<ObjectKey>>>,
    /// The newest version trimmed from each PG's log since the node started.
    log_trimmed: Mutex<HashMap<(u64, u32), u64>>,
    /// Each PG's recovery mark as read or last written (`None`: the PG has none).
    marks: Mutex<HashMap<(u64, u32), Option<Mark>>>,
}

/// A PG's recovery mark: (slot, version) this node's shards of that slot are complete
/// through.
pub type Mark = (u8, u64);

/// Store key shard byte of a PG's recovery mark: `(pool, "\0rec" ‖ pg BE32, 0xFD)`.
pub const SHARD_MARK: u8 = 0xFD;

/// The store key of a PG's recovery mark.
pub fn mark_key(pool: u64, pg: u32) -> ObjectKey {
    let mut n = b"\0rec".to_vec();
    n.extend_from_slice(&pg.to_be_bytes());
    ObjectKey::new(pool, n, SHARD_MARK)
}

fn log_name(pg: u32, version: u64, name: &[u8]) -> Vec<u8> {
    let mut n = Vec::with_capacity(16 + name.len());
    n.extend_from_slice(b"\0log");
    n.extend_from_slice(&pg.to_be_bytes());
    n.extend_from_slice(&version.to_be_bytes());
    n.extend_from_slice(name);
    n
}

/// The version of a PG log entry's key.
fn log_version(k: &ObjectKey) -> Option<u64> {
    (k.name.len() >= 16).then(|| u64::from_be_bytes(k.name[8..16].try_into().expect("8 bytes")))
}

fn user_xattrs(all: BTreeMap<String, Vec<u8>>) -> BTreeMap<String, Vec<u8>> {
    all.into_iter()
        .filter_map(|(k, v)| k.strip_prefix(USER_PREFIX).map(|n| (n.to_string(), v)))
        .collect()
}

impl Local {
    pub fn new(stores: Vec<Store<FileDevice>>) -> Local {
        Local {
            stores,
            meta_cache: Mutex::new(MetaCache::new(META_CACHE_ENTRIES)),
            pg_logs: Mutex::new(HashMap::new()),
            log_trimmed: Mutex::new(HashMap::new()),
            marks: Mutex::new(HashMap::new()),
        }
    }

    /// The PG's recovery mark on this node: (slot, version) its shards of that slot are
    /// complete through.
    pub fn mark(&self, pool: u64, pg: u32) -> Result<Option<(u8, u64)>> {
        // Held over the store read: a mark written meanwhile is cached after this one.
        let mut marks = self.marks.lock().unwrap();
        if let Some(m) = marks.get(&(pool, pg)) {
            return Ok(*m);
        }
        let m = match self
            .store(pool, pg)
            .read_vec(&mark_key(pool, pg), 0, u64::MAX)
        {
            Ok(b) => {
                let mut d = Dec::new(&b);
                Some((d.u8()?, d.u64()?))
            }
            Err(StoreError::NotFound(_)) => None,
            Err(e) => return Err(e.into()),
        };
        marks.insert((pool, pg), m);
        Ok(m)
    }

    /// Record durably that this node's shards of `slot` of the PG are complete through
    /// `version`.
    pub fn set_mark(&self, pool: u64, pg: u32, slot: u8, version: u64) -> Result<()> {
        let st = self.store(pool, pg);
        let key = mark_key(pool, pg);
        let mut b = Enc::default();
        b.u8(slot).u64(version);
        let mut t = Transaction::new();
        if st.exists(&key) {
            t.remove(key.clone());
        }
        t.write_full(key, &b.0);
        match st.commit(t) {
            Ok(_) => {
                self.marks
                    .lock()
                    .unwrap()
                    .insert((pool, pg), Some((slot, version)));
                Ok(())
            }
            Err(e) => {
                self.marks.lock().unwrap().remove(&(pool, pg));
                Err(e.into())
            }
        }
    }

    /// Drop the PG's recovery mark (its shards may have lost data: salvage). Returns whether
    /// there was one.
    pub fn remove_mark(&self, pool: u64, pg: u32) -> Result<bool> {
        let st = self.store(pool, pg);
        let key = mark_key(pool, pg);
        let r = if st.exists(&key) {
            st.remove(&key).map(|_| true)
        } else {
            Ok(false)
        };
        self.marks.lock().unwrap().remove(&(pool, pg));
        Ok(r?)
    }

    /// The store a PG's shards live on.
    pub fn store(&self, pool: u64, pg: u32) -> &Store<FileDevice> {
        let c = crc32c::crc32c_append(
            crc32c::crc32c(&pool.to_le_bytes()),
            &(pg as u64).to_le_bytes(),
        );
        let i = c as usize % self.stores.len();
        &self.stores[i]
    }

    /// A shard's state as the meta cache holds it (`None`: not cached).
    fn meta_cached(&self, key: &ObjectKey) -> Option<Option<ShardMeta>> {
        self.meta_cache.lock().unwrap().get(key)
    }

    pub fn meta(&self, st: &Store<FileDevice>, key: &ObjectKey) -> Result<Option<ShardMeta>> {
        if let Some(m) = self.meta_cached(key) {
            return Ok(m);
        }
        let m = match st.get_xattr(key, XATTR_META) {
            Ok(b) => Some(ShardMeta::decode(&mut Dec::new(&b))?),
            Err(StoreError::NotFound(_)) | Err(StoreError::NoXattr { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        self.meta_cache.lock().unwrap().insert(key.clone(), m);
        Ok(m)
    }

    pub fn stat(&self, pool: u64, pg: u32, name: &[u8], shard: u8) -> Result<ShardState> {
        let st = self.store(pool, pg);
        let key = ObjectKey::new(pool, name, shard);
        // An unreadable mark proves nothing: the state says no mark rather than fail the
        // stat (the member would count as silent for every absent object).
        let absent = || {
            Ok(ShardState {
                mark: self.mark(pool, pg).unwrap_or(None),
                ..ShardState::default()
            })
        };
        let Some(meta) = self.meta(st, &key)? else {
            return absent();
        };
        let all = match st.xattrs(&key) {
            Ok(a) => a,
            // Removed since its meta was cached (a forgotten tombstone, a dropped leftover).
            Err(StoreError::NotFound(_)) => {
                self.meta_cache.lock().unwrap().remove(&key);
                return absent();
            }
            Err(e) => return Err(e.into()),
        };
        let rollback_from = all
            .get(XATTR_RB)
            .and_then(|b| Dec::new(b).u64().ok())
            .unwrap_or(0);
        let reqs = all
            .get(XATTR_REQ)
            .map(|b| ReqHistory::from_bytes(b, meta.version))
            .unwrap_or_default();
        Ok(ShardState {
            meta: Some(meta),
            rollback_from,
            xattrs: user_xattrs(all),
            reqs,
            mark: None,
        })
    }

    /// Read `len` bytes at `offset` of the shard, if it is at `version`; with `cached`, from
    /// the store's read cache when it holds them, else from the device (scrub, recovery).
    #[allow(clippy::too_many_arguments)]
    pub fn read(
        &self,
        pool: u64,
        pg: u32,
        name: &[u8],
        shard: u8,
        version: u64,
        offset: u64,
        len: u64,
        cached: bool,
    ) -> Result<ReadBuf> {
        let st = self.store(pool, pg);
        let key = ObjectKey::new(pool, name, shard);
        let meta = self.meta(st, &key)?;
        let have = meta.map_or(0, |m| m.version);
        if have != version {
            return Err(Error::remote(
                Status::VersionMismatch,
                format!("shard {shard} holds version {have}, not {version}"),
            ));
        }
        // A tombstone is empty (its old bytes, kept until the remove is settled, are not its
        // content).
        if len == 0 || meta.is_some_and(|m| m.deleted) {
            return Ok(ReadBuf::default());
        }
        let r = if cached {
            st.read(&key, offset, len)
        } else {
            st.read_uncached(&key, offset, len)
        };
        match r {
            Ok(b) => Ok(b),
            Err(StoreError::NotFound(_)) => Ok(ReadBuf::default()),
            Err(e) => Err(e.into()),
        }
    }

    /// [`Local::read`] only when the shard's metadata and every chunk of the range are in
    /// memory (the meta cache and the store's read cache); `None` otherwise, including a
    /// version other than `version`. Never waits for the device.
    #[allow(clippy::too_many_arguments)]
    pub fn read_if_cached(
        &self,
        pool: u64,
        pg: u32,
        name: &[u8],
        shard: u8,
        version: u64,
        offset: u64,
        len: u64,
    ) -> Option<ReadBuf> {
        let key = ObjectKey::new(pool, name, shard);
        let meta = self.meta_cache.lock().unwrap().get(&key)??;
        if meta.version != version || meta.deleted {
            return None;
        }
        self.store(pool, pg).read_if_cached(&key, offset, len)
    }

    fn load_log(&self, st: &Store<FileDevice>, pool: u64, pg: u32) -> VecDeque<ObjectKey> {
        let prefix = log_name(pg, 0, b"");
        let start = ObjectKey::new(pool, &prefix[..8], SHARD_LOG);
        let mut out = VecDeque::new();
        let mut after = start;
        loop {
            let batch = st.list(pool, Some(&after), 1024);
            let Some(last) = batch.last().map(|(k, _)| k.clone()) else {
                break;
            };
            let mut done = false;
            for (k, _) in batch {
                if !k.name.starts_with(&prefix[..8]) {
                    done = true;
                    break;
                }
                if k.shard == SHARD_LOG {
                    out.push_back(k);
                }
            }
            if done {
                break;
            }
            after = last;
        }
        out
    }

    /// Apply a shard write durably (with its rollback record and log entry).
    pub fn apply(&self, w: &ShardWrite) -> Result<()> {
        self.apply_with(w, Commit::Wait).map(|_| ())
    }

    /// [`Local::apply`] without a rollback record (and without reading the old bytes for
    /// one): for writes of a state that stands, such as recovery's whole shards of an
    /// object's resolved version. A rollback of the version then fails (nothing to undo).
    pub fn apply_settled(&self, w: &ShardWrite) -> Result<()> {
        self.apply_with(w, Commit::WaitSettled).map(|_| ())
    }

    /// Drop the rollback records of this PG's shard `shard` of objects written at the given
    /// versions, which their primary saw acknowledged (so no one will roll them back): the
    /// old bytes they keep — a whole old shard for an overwrite or a remove — are space
    /// otherwise held until the object's next write. An entry whose shard has moved on to
    /// another version, or holds no record of that version, is skipped; so is one a
    /// concurrent write overtook (each entry's commit asserts the store version it read).
    /// The commits need no flush of their own (a lost one leaves a record to drop later).
    /// Returns how many records were dropped.
    pub fn settle(&self, pool: u64, pg: u32, shard: u8, entries: &[(&[u8], u64)]) -> Result<u64> {
        let st = self.store(pool, pg);
        // Per entry: the shard, its store version, its spilled record, and — for a tombstone
        // still holding the bytes it removed — the xattrs it keeps once they go.
        type Settle = (
            ObjectKey,
            u64,
            Option<ObjectKey>,
            Option<BTreeMap<String, Vec<u8>>>,
        );
        let mut txns: Vec<Settle> = Vec::new();
        for &(name, version) in entries {
            let key = ObjectKey::new(pool, name, shard);
            let Some(meta) = self.meta(st, &key)?.filter(|m| m.version == version) else {
                continue;
            };
            let (Ok(stat), Ok(rb)) = (st.stat(&key), st.get_xattr(&key, XATTR_RB)) else {
                continue;
            };
            if Dec::new(&rb).u64().ok() != Some(version) {
                continue;
            }
            let rb_key = ObjectKey::new(pool, name, shard | SHARD_ROLLBACK_BIT);
            let spill = st.exists(&rb_key).then_some(rb_key);
            let kept = if meta.deleted && stat.size > 0 {
                let Ok(mut all) = st.xattrs(&key) else {
                    continue;
                };
                all.remove(XATTR_RB);
                Some(all)
            } else {
                None
            };
            txns.push((key, stat.version, spill, kept));
        }
        let (tx, rx) = std::sync::mpsc::channel::<bool>();
        let mut started = 0;
        for (key, store_version, spill, kept) in txns {
            let mut t = Transaction::new();
            // It only frees space: a full store takes it, after any number of removes.
            t.frees_space();
            t.assert_version(key.clone(), store_version);
            match &kept {
                // A settled remove: its old bytes go; the tombstone stays (with its metadata
                // and request history) until its primary has it forgotten.
                Some(all) => {
                    t.replace(key.clone(), &[]);
                    for (k, v) in all {
                        t.set_xattr(key.clone(), k, v);
                    }
                }
                None => {
                    t.rm_xattr(key, XATTR_RB);
                }
            }
            if let Some(k) = spill {
                t.remove(k);
            }
            let tx = tx.clone();
            // Grouped into the store's next flush with everything else committing. An error
            // here (the shard changed since it was read: the assert) means a skip.
            let done = Box::new(move |r: AsyncCommit| {
                let _ = tx.send(matches!(r, AsyncCommit::Durable(_)));
            });
            if st.commit_async(t, done).is_ok() {
                started += 1;
            }
        }
        drop(tx);
        Ok(rx.iter().take(started).filter(|ok| *ok).count() as u64)
    }

    /// Remove a shard that its primary found to be a leftover: the object's state it holds
    /// (`version`) is older than what a member complete past it knows — the object was
    /// removed and its tombstone forgotten, or the write never took. Only if the shard is
    /// still at `version`; durable. Returns whether it went, and the shard's state after.
    pub fn drop_stale(
        &self,
        pool: u64,
        pg: u32,
        name: &[u8],
        shard: u8,
        version: u64,
    ) -> Result<(bool, ShardState)> {
        let st = self.store(pool, pg);
        let key = ObjectKey::new(pool, name, shard);
        let at_version = self.meta(st, &key)?.map(|m| m.version) == Some(version);
        if at_version {
            let store_version = st.stat(&key)?.version;
            let mut t = Transaction::new();
            t.frees_space();
            t.assert_version(key.clone(), store_version);
            t.remove(key.clone());
            let rb_key = ObjectKey::new(pool, name, shard | SHARD_ROLLBACK_BIT);
            if st.exists(&rb_key) {
                t.remove(rb_key);
            }
            let r = st.commit(t);
            self.meta_cache.lock().unwrap().remove(&key);
            r?;
        }
        Ok((at_version, self.stat(pool, pg, name, shard)?))
    }

    /// Remove the tombstones of this PG's shard `shard` that its primary listed: objects
    /// removed at the given versions, acknowledged long enough ago that no resend of the
    /// remove is still expected. Each only if this node's mark says its shards of that slot
    /// are complete through the version (so its missing shard proves the removal to a later
    /// `resolve`: see [`ShardState::mark`]) and the shard is still that tombstone (each
    /// commit asserts the store version it read). The commits ride the store's next flush
    /// (a lost one leaves a tombstone that a later resolve drops). Returns how many went.
    pub fn forget(&self, pool: u64, pg: u32, shard: u8, entries: &[(&[u8], u64)]) -> Result<u64> {
        let Some((slot, through)) = self.mark(pool, pg)? else {
            return Ok(0);
        };
        if slot != shard {
            return Ok(0);
        }
        let st = self.store(pool, pg);
        let mut keys: Vec<(ObjectKey, u64, Option<ObjectKey>)> = Vec::new();
        for &(name, version) in entries {
            let key = ObjectKey::new(pool, name, shard);
            let tombstone = self
                .meta(st, &key)?
                .is_some_and(|m| m.deleted && m.version == version);
            if !tombstone || version > through {
                continue;
            }
            let Ok(stat) = st.stat(&key) else {
                continue;
            };
            let rb_key = ObjectKey::new(pool, name, shard | SHARD_ROLLBACK_BIT);
            let spill = st.exists(&rb_key).then_some(rb_key);
            keys.push((key, stat.version, spill));
        }
        let (tx, rx) = std::sync::mpsc::channel::<(ObjectKey, bool)>();
        let mut started = 0;
        for (key, store_version, spill) in keys {
            let mut t = Transaction::new();
            t.frees_space();
            t.assert_version(key.clone(), store_version);
            t.remove(key.clone());
            if let Some(k) = spill {
                t.remove(k);
            }
            let tx = tx.clone();
            let k = key.clone();
            let done = Box::new(move |r: AsyncCommit| {
                let _ = tx.send((k, matches!(r, AsyncCommit::Durable(_))));
            });
            if st.commit_async(t, done).is_ok() {
                started += 1;
            }
        }
        drop(tx);
        let mut n = 0;
        for (key, ok) in rx.iter().take(started) {
            if ok {
                // A stat that cached the tombstone meanwhile finds the key gone and drops it.
                self.meta_cache.lock().unwrap().remove(&key);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Remove these keys of store `st_idx` (a stray PG's shards, log entries and mark), each
    /// only if still at the store version listed, in one durable transaction; forgets them
    /// in the meta cache and the PG logs held in memory.
    pub fn purge(&self, st_idx: usize, keys: &[(ObjectKey, u64)]) -> Result<()> {
        let st = &self.stores[st_idx];
        let mut t = Transaction::new();
        for (k, v) in keys {
            t.assert_version(k.clone(), *v);
            t.remove(k.clone());
        }
        let r = st.commit(t);
        let mut cache = self.meta_cache.lock().unwrap();
        for (k, _) in keys {
            cache.remove(k);
        }
        drop(cache);
        for (k, _) in keys.iter().filter(|(k, _)| k.shard == SHARD_MARK) {
            if let Some(b) = k.name.get(4..8) {
                let pg = u32::from_be_bytes(b.try_into().expect("4 bytes"));
                self.marks.lock().unwrap().remove(&(k.pool, pg));
            }
        }
        for (k, _) in keys.iter().filter(|(k, _)| k.name.starts_with(b"\0log")) {
            if let Some(b) = k.name.get(4..8) {
                let pg = u32::from_be_bytes(b.try_into().expect("4 bytes"));
                self.pg_logs.lock().unwrap().remove(&(k.pool, pg));
                self.log_trimmed.lock().unwrap().remove(&(k.pool, pg));
            }
        }
        r?;
        Ok(())
    }

    /// Start applying a small write that creates a shard, without blocking: no device read,
    /// no wait for the commit. `done` runs on the store's commit thread once the write is
    /// durable (`Some(Ok)`), failed (`Some(Err)`), or lost a race with another writer of the
    /// shard (`None`: nothing was applied; apply it again). Returns `Ok(false)`, having done
    /// nothing, for any other write (it may need to read the shard's old bytes for its
    /// rollback record): use [`Local::apply`] on a thread that may block. After an error
    /// return `done` is not called; otherwise it is called exactly once.
    pub fn apply_async(
        self: &Arc<Self>,
        w: &ShardWrite,
        done: Box<dyn FnOnce(Option<Result<()>>) + Send>,
    ) -> Result<bool> {
        self.apply_with(w, Commit::Async(self.clone(), done))
    }

    fn apply_with(&self, w: &ShardWrite, how: Commit) -> Result<bool> {
        let st = self.store(w.pool, w.pg);
        let key = ObjectKey::new(w.pool, w.name, w.shard);
        // One index lookup serves the checks below (each is a skip-list search: several of
        // them per shard write showed as 6 % of all CPU in 4 KiB write profiles).
        let stored_size = st.stat(&key).ok().map(|s| s.size);
        let exists = stored_size.is_some();
        if matches!(how, Commit::Async(..))
            && (w.kind != WriteKind::Full || w.data.len() > ASYNC_APPLY_BYTES_MAX || exists)
        {
            return Ok(false);
        }
        let cur = match self.meta_cached(&key) {
            Some(m) => m,
            // Absent from the store: no state to read.
            None if !exists => None,
            None => self.meta(st, &key)?,
        };
        if w.base_version != BASE_ANY && cur.map_or(0, |m| m.version) != w.base_version {
            return Err(Error::remote(
                Status::VersionMismatch,
                format!(
                    "shard {} holds version {}, the write is based on {}",
                    w.shard,
                    cur.map_or(0, |m| m.version),
                    w.base_version
                ),
            ));
        }
        let old_all = if exists {
            st.xattrs(&key)?
        } else {
            BTreeMap::new()
        };
        let had_reqid = old_all.contains_key(XATTR_REQ);
        let old_user = user_xattrs(old_all);
        let settled = matches!(how, Commit::WaitSettled);
        if settled && w.kind != WriteKind::Full {
            return Err(Error::remote(
                Status::Invalid,
                "only whole-shard writes are applied without a rollback record",
            ));
        }
        // A remove leaves the shard's bytes where they are, under a tombstone's metadata, until
        // its primary settles it (`settle` drops them): its rollback then only puts the
        // metadata back, and the remove writes no copy of the old bytes — so a member whose
        // store is full still takes it (a copy would need the space the remove is to free).
        let cur_deleted = cur.is_some_and(|m| m.deleted);
        let keep =
            !settled && exists && w.kind == WriteKind::Full && w.meta.deleted && w.data.is_empty();
        if w.kind == WriteKind::Range && cur_deleted {
            return Err(Error::remote(
                Status::Invalid,
                format!(
                    "shard {} is removed: a range write needs a whole shard",
                    w.shard
                ),
            ));
        }
        let restore = match (w.kind, exists) {
            (_, _) if settled => Restore::Nothing,
            (WriteKind::Meta, _) => Restore::Nothing,
            _ if keep => Restore::Nothing,
            (_, false) => Restore::Remove,
            // A tombstone's content is empty, whatever old bytes it still keeps.
            (WriteKind::Full, true) if cur_deleted => Restore::Full(Vec::new()),
            // A big old shard moves to the rollback key by reference (renamed below); a small
            // one is copied into the record (no separate object to keep or drop).
            (WriteKind::Full, true)
                if stored_size.unwrap_or(0) > ROLLBACK_INLINE_BYTES_MAX as u64 =>
            {
                Restore::Moved
            }
            (WriteKind::Full, true) => Restore::Full(st.read_vec(&key, 0, u64::MAX)?),
            (WriteKind::Range, true) => {
                Restore::Range(w.offset, st.read_vec(&key, w.offset, w.data.len() as u64)?)
            }
        };
        let mut undo: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        if w.kind == WriteKind::Full {
            for (k, v) in &old_user {
                undo.push((k.clone(), Some(v.clone())));
            }
            for (k, _) in &w.xattrs {
                if !old_user.contains_key(k) {
                    undo.push((k.clone(), None));
                }
            }
        } else {
            for (k, _) in &w.xattrs {
                undo.push((k.clone(), old_user.get(k).cloned()));
            }
        }
        let rb = Rollback {
            version_from: w.meta.version,
            prev: cur,
            restore,
            xattrs: undo,
        };
        let mut spill = None;
        let rb_bytes = rb.encode(&mut spill);
        let meta_bytes = w.meta.to_bytes();
        let rb_key = ObjectKey::new(w.pool, w.name, w.shard | SHARD_ROLLBACK_BIT);
        let log_key = ObjectKey::new(w.pool, log_name(w.pg, w.meta.version, w.name), SHARD_LOG);
        let names: Vec<(String, Option<Vec<u8>>)> = w
            .xattrs
            .iter()
            .map(|(k, v)| (format!("{USER_PREFIX}{k}"), v.clone()))
            .collect();
        let range = match w.kind {
            WriteKind::Range => w.data.joined(),
            _ => std::borrow::Cow::Borrowed(&[][..]),
        };
        let mut t = Transaction::new();
        if w.meta.deleted && w.data.is_empty() {
            // A remove: a tombstone's metadata, no copy of any bytes. A full store takes it.
            t.makes_room();
        }
        match w.kind {
            // The bytes stay; every other xattr goes, as with a replace (the new metadata, the
            // record and the request history are set below).
            WriteKind::Full if keep => {
                for k in old_user.keys() {
                    t.rm_xattr(key.clone(), &format!("{USER_PREFIX}{k}"));
                }
                if st.exists(&rb_key) {
                    // The bytes an earlier write's record spilled: no record refers to them now.
                    t.remove(rb_key.clone());
                }
            }
            // A replace needs no index search to prepare or check: the shard's xattrs are
            // all set below, and whatever it held is released when the commit applies.
            WriteKind::Full => {
                if rb.restore == Restore::Moved {
                    // The old shard becomes the rollback key (whatever that held goes), and
                    // the new bytes replace it.
                    t.rename(key.clone(), rb_key.clone());
                }
                let flat;
                let parts: &[&[u8]] = match &w.data {
                    ShardData::Flat(d) => {
                        flat = [*d];
                        &flat
                    }
                    ShardData::Parts(p) => p,
                };
                match (
                    chunk_crcs_of(&w.chunk_crcs, w.data.len(), st.chunk_bytes()),
                    &w.data,
                ) {
                    (Some(crcs), _) => t.replace_parts_with_crcs(key.clone(), parts, &crcs),
                    (None, ShardData::Flat(d)) => t.replace(key.clone(), d),
                    (None, ShardData::Parts(p)) => t.replace_parts(key.clone(), p),
                };
            }
            WriteKind::Range => {
                t.write(key.clone(), w.offset, &range);
            }
            WriteKind::Meta => {
                if !exists {
                    return Err(Error::remote(
                        Status::NotFound,
                        format!("shard {} has no object to update", w.shard),
                    ));
                }
            }
        }
        t.set_xattr(key.clone(), XATTR_META, &meta_bytes);
        if settled {
            // No record (a whole-shard write drops the old xattrs), and no old spill left.
            if st.exists(&rb_key) {
                t.remove(rb_key.clone());
            }
        } else {
            t.set_xattr(key.clone(), XATTR_RB, &rb_bytes);
        }
        // The object's request history through this version (a whole-shard write replaces
        // every xattr: nothing to remove then).
        let reqs = (!w.reqs.is_empty()).then(|| w.reqs.to_bytes());
        match &reqs {
            Some(r) => {
                t.set_xattr(key.clone(), XATTR_REQ, r);
            }
            None if had_reqid && (w.kind != WriteKind::Full || keep) => {
                t.rm_xattr(key.clone(), XATTR_REQ);
            }
            None => {}
        }
        if let Some(s) = &spill {
            t.write_full(rb_key, s);
        }
        for ((k, v), (plain, _)) in names.iter().zip(&w.xattrs) {
            match v {
                Some(v) => {
                    t.set_xattr(key.clone(), k, v);
                }
                None if w.kind != WriteKind::Full && old_user.contains_key(plain) => {
                    t.rm_xattr(key.clone(), k);
                }
                None => {}
            }
        }
        t.replace(log_key.clone(), &[]);
        let mut logs = self.pg_logs.lock().unwrap();
        let log = logs
            .entry((w.pool, w.pg))
            .or_insert_with(|| self.load_log(st, w.pool, w.pg));
        let mut trimmed = Vec::new();
        while log.len() + 1 > PG_LOG_ENTRIES_MAX {
            trimmed.push(log.pop_front().expect("non-empty"));
        }
        drop(logs);
        if let Some(v) = trimmed.iter().filter_map(log_version).max() {
            let mut t = self.log_trimmed.lock().unwrap();
            let e = t.entry((w.pool, w.pg)).or_default();
            *e = (*e).max(v);
        }
        for k in &trimmed {
            if st.exists(k) {
                t.remove(k.clone());
            }
        }
        let applied = Applied {
            pg: (w.pool, w.pg),
            key,
            log_key,
            meta: w.meta,
        };
        crate::optrack::event(crate::optrack::Ev::CommitStart, crate::optrack::NO_SHARD);
        match how {
            Commit::Wait | Commit::WaitSettled => {
                let r = st.commit(t);
                crate::optrack::event(crate::optrack::Ev::CommitEnd, crate::optrack::NO_SHARD);
                self.applied(applied, r.is_ok());
                r?;
            }
            Commit::Async(local, done) => {
                self.meta_cache.lock().unwrap().remove(&applied.key);
                st.commit_async(
                    t,
                    Box::new(move |r| {
                        let r = match r {
                            AsyncCommit::Durable(_) => Some(Ok(())),
                            AsyncCommit::Raced => None,
                            AsyncCommit::Failed(e) => Some(Err(e.into())),
                        };
                        local.applied(applied, matches!(r, Some(Ok(()))));
                        done(r)
                    }),
                )?;
            }
        }
        Ok(true)
    }

    /// Bookkeeping after a shard write's commit: the PG log gains its entry, the meta cache
    /// the new state (or forgets the old one when the commit failed).
    fn applied(&self, a: Applied, ok: bool) {
        let mut cache = self.meta_cache.lock().unwrap();
        if !ok {
            cache.remove(&a.key);
            return;
        }
        cache.insert(a.key, Some(a.meta));
        drop(cache);
        self.pg_logs
            .lock()
            .unwrap()
            .entry(a.pg)
            .or_default()
            .push_back(a.log_key);
    }

    /// Undo the write that produced `version_from` (it must be the shard's current version).
    pub fn rollback(
        &self,
        pool: u64,
        pg: u32,
        name: &[u8],
        shard: u8,
        version_from: u64,
    ) -> Result<ShardState> {
        let st = self.store(pool, pg);
        let key = ObjectKey::new(pool, name, shard);
        let cur = self.meta(st, &key)?;
        if cur.map_or(0, |m| m.version) != version_from {
            return Err(Error::remote(
                Status::VersionMismatch,
                format!(
                    "shard {shard} is at version {}, not {version_from}",
                    cur.map_or(0, |m| m.version)
                ),
            ));
        }
        let rb_key = ObjectKey::new(pool, name, shard | SHARD_ROLLBACK_BIT);
        let rb_raw = st.get_xattr(&key, XATTR_RB)?;
        let rb = Rollback::decode(&rb_raw, || Ok(st.read_vec(&rb_key, 0, u64::MAX)?))?;
        if rb.version_from != version_from {
            return Err(Error::remote(
                Status::Invalid,
                format!(
                    "shard {shard}: the rollback record undoes version {}, not {version_from}",
                    rb.version_from
                ),
            ));
        }
        let mut t = Transaction::new();
        let mut cleared = false;
        match &rb.restore {
            Restore::Nothing => {}
            Restore::Remove => {
                t.remove(key.clone());
            }
            Restore::Full(b) => {
                t.remove(key.clone());
                t.write_full(key.clone(), b);
                cleared = true;
            }
            Restore::Range(off, b) => {
                t.write(key.clone(), *off, b);
            }
            // Decoded as `Full` (its bytes read from the rollback key).
            Restore::Moved => unreachable!("a decoded record is never Moved"),
        }
        let prev_bytes = rb.prev.map(|m| m.to_bytes());
        let names: Vec<(String, &Option<Vec<u8>>)> = rb
            .xattrs
            .iter()
            .map(|(k, v)| (format!("{USER_PREFIX}{k}"), v))
            .collect();
        let mut now_all = if rb.restore == Restore::Remove {
            BTreeMap::new()
        } else {
            st.xattrs(&key)?
        };
        // The undone write's request goes with it: the history keeps the entries of the
        // version restored and older.
        let reqs = match (now_all.get(XATTR_REQ), rb.prev) {
            (Some(b), Some(prev)) => ReqHistory::from_bytes(b, version_from).through(prev.version),
            _ => ReqHistory::default(),
        }
        .to_bytes();
        if cleared {
            now_all.clear();
        }
        let had_reqid = now_all.contains_key(XATTR_REQ);
        let now_user = user_xattrs(now_all);
        if rb.restore != Restore::Remove {
            match &prev_bytes {
                Some(p) => {
                    t.set_xattr(key.clone(), XATTR_META, p);
                }
                None => {
                    t.remove(key.clone());
                }
            }
            if !cleared {
                t.rm_xattr(key.clone(), XATTR_RB);
            }
            if !reqs.is_empty() {
                t.set_xattr(key.clone(), XATTR_REQ, &reqs);
            } else if had_reqid {
                t.rm_xattr(key.clone(), XATTR_REQ);
            }
            for ((k, v), (plain, _)) in names.iter().zip(&rb.xattrs) {
                match v {
                    Some(v) => {
                        t.set_xattr(key.clone(), k, v);
                    }
                    None if now_user.contains_key(plain) => {
                        t.rm_xattr(key.clone(), k);
                    }
                    None => {}
                }
            }
        }
        let log_key = ObjectKey::new(pool, log_name(pg, version_from, name), SHARD_LOG);
        if st.exists(&log_key) {
            t.remove(log_key);
        }
        crate::optrack::event(crate::optrack::Ev::CommitStart, crate::optrack::NO_SHARD);
        let r = st.commit(t);
        crate::optrack::event(crate::optrack::Ev::CommitEnd, crate::optrack::NO_SHARD);
        self.meta_cache.lock().unwrap().remove(&key);
        r?;
        self.stat(pool, pg, name, shard)
    }

    /// Names of objects of `pool` this node holds a live shard of, after `after`; with
    /// `tombstones`, of removed objects whose tombstone it holds too (scrub).
    pub fn list(
        &self,
        pool: u64,
        after: &[u8],
        max: usize,
        tombstones: bool,
    ) -> Result<Vec<Vec<u8>>> {
        let mut names: Vec<Vec<u8>> = Vec::new();
        for st in &self.stores {
            let mut from = ObjectKey::new(pool, after, u8::MAX);
            'outer: loop {
                let batch = st.list(pool, Some(&from), 256);
                let Some(last) = batch.last().map(|(k, _)| k.clone()) else {
                    break;
                };
                for (k, _) in batch {
                    if k.name.first() == Some(&0) || k.shard >= SHARD_ROLLBACK_BIT {
                        continue;
                    }
                    if names.last().is_some_and(|n| **n == *k.name) {
                        continue;
                    }
                    if self.meta(st, &k)?.is_some_and(|m| tombstones || !m.deleted) {
                        names.push(k.name.to_vec());
                        if names.len() >= max {
                            break 'outer;
                        }
                    }
                }
                from = last;
            }
        }
        names.sort();
        names.dedup();
        names.truncate(max);
        Ok(names)
    }

    /// The PG's log window on this member, oldest first: (version, object name), and the
    /// newest version trimmed from it (0: none; every entry after it is in the window). For a
    /// window found full at start, its oldest version stands for that.
    pub fn log_window(&self, pool: u64, pg: u32) -> (Vec<(u64, Vec<u8>)>, u64) {
        let st = self.store(pool, pg);
        let mut logs = self.pg_logs.lock().unwrap();
        let log = logs
            .entry((pool, pg))
            .or_insert_with(|| self.load_log(st, pool, pg));
        let mut out: Vec<(u64, Vec<u8>)> = log
            .iter()
            .filter_map(|k| Some((log_version(k)?, k.name[16..].to_vec())))
            .collect();
        let full = log.len() >= PG_LOG_ENTRIES_MAX;
        drop(logs);
        out.sort();
        let trimmed = self
            .log_trimmed
            .lock()
            .unwrap()
            .get(&(pool, pg))
            .copied()
            .or_else(|| full.then(|| out.first().map_or(0, |e| e.0)))
            .unwrap_or(0);
        (out, trimmed)
    }

    pub fn shard_count(&self) -> u64 {
        self.stores.iter().map(|s| s.object_count() as u64).sum()
    }

    /// Replace a shard with reconstructed bytes at `w.meta.version` (scrub and read repair).
    /// Refused when the shard is already at a newer version (a write overtook the repair).
    /// Unlike [`Local::apply`] it never reads the old bytes (they may be what is corrupt): a
    /// shard repaired at its own version keeps its rollback record when that is readable; a
    /// missing or stale shard gets none (the version it takes is on at least k shards, so it
    /// is never rolled back) and no PG log entry.
    pub fn repair(&self, w: &ShardWrite) -> Result<()> {
        let st = self.store(w.pool, w.pg);
        let key = ObjectKey::new(w.pool, w.name, w.shard);
        let cur = self.meta(st, &key).ok().flatten().map_or(0, |m| m.version);
        if cur > w.meta.version {
            return Err(Error::remote(
                Status::VersionMismatch,
                format!(
                    "shard {} is at version {cur}, newer than the repair's {}",
                    w.shard, w.meta.version
                ),
            ));
        }
        // Not a tombstone's: its record may say the bytes it kept are the content to restore
        // (`Restore::Nothing`), and the repair writes none.
        let keep_rb = if cur == w.meta.version && !w.meta.deleted {
            st.get_xattr(&key, XATTR_RB).ok()
        } else {
            None
        };
        let meta_bytes = w.meta.to_bytes();
        let user: Vec<(String, &[u8])> = w
            .xattrs
            .iter()
            .filter_map(|(k, v)| Some((format!("{USER_PREFIX}{k}"), v.as_deref()?)))
            .collect();
        let data = w.data.joined();
        let mut t = Transaction::new();
        if st.exists(&key) {
            t.remove(key.clone());
        }
        t.write_full(key.clone(), &data);
        t.set_xattr(key.clone(), XATTR_META, &meta_bytes);
        if let Some(rb) = &keep_rb {
            t.set_xattr(key.clone(), XATTR_RB, rb);
        }
        let reqs = w.reqs.to_bytes();
        if !reqs.is_empty() {
            t.set_xattr(key.clone(), XATTR_REQ, &reqs);
        }
        for (k, v) in &user {
            t.set_xattr(key.clone(), k, v);
        }
        let r = st.commit(t);
        self.meta_cache.lock().unwrap().remove(&key);
        r?;
        self.meta_cache.lock().unwrap().insert(key, Some(w.meta));
        // Move the replay start past the log that held the bad copy: an open would otherwise
        // report it again (salvage) or refuse (a lone store). Repairs are rare; a checkpoint
        // is cheap.
        if let Err(e) = st.checkpoint() {
            tracing::warn!("checkpoint after repairing shard {}: {e}", w.shard);
        }
        Ok(())
    }

    /// Where a shard's data is: the device's name and (byte offset, length) per chunk.
    pub fn locate(
        &self,
        pool: u64,
        pg: u32,
        name: &[u8],
        shard: u8,
    ) -> Result<(String, Vec<(u64, u64)>)> {
        let st = self.store(pool, pg);
        let ext = st.locate(&ObjectKey::new(pool, name, shard))?;
        Ok((st.device().name().to_string(), ext))
    }
}

/// A shard read's reply: `e` (the reply so far), the length, then the bytes as they lie:
/// device buffers by address (no copy into a message buffer; see [`DmaSlice`]), cached chunks
/// shared, holes as zeros; with `crcs` ([`crate::wire::SHARD_READ_CHUNK_CRCS`]) the chunk CRC list
/// after them. The same bytes on the wire as [`encode_read`].
pub fn read_reply(mut e: Enc, r: ReadBuf, crcs: bool) -> Vec<SendBuf> {
    e.u32(r.len() as u32);
    let trailer = crcs.then(|| chunk_crcs(&r));
    let mut parts = vec![SendBuf::Vec(e.finish())];
    let mut chunks = r.chunk_crcs.iter();
    for p in r.parts {
        parts.push(match p {
            Part::Data { buf, start, len } => {
                assert!(
                    start + len <= buf.len(),
                    "a read part lies inside its buffer"
                );
                let crc = part_crc(&mut chunks, len);
                SendBuf::Raw(Box::new(DmaSlice {
                    buf,
                    start,
                    len,
                    crc,
                }))
            }
            Part::Zeros(n) => SendBuf::Vec(vec![0; n]),
            Part::Cached { chunk, start, len } => {
                SendBuf::Shared(Arc::new(CachedSlice { chunk, start, len }))
            }
        });
    }
    parts.extend(trailer.map(SendBuf::Vec));
    parts
}

/// A shard read's reply bytes after `e`, copied (the primary's own shard: no message).
pub fn encode_read(e: &mut Enc, r: &ReadBuf, crcs: bool) {
    e.u32(r.len() as u32);
    r.append_to(&mut e.0);
    if crcs {
        e.0.extend_from_slice(&chunk_crcs(r));
    }
}

/// The CRC of the next `len` bytes of a read from its chunk CRCs (the store lists them only
/// when every part is whole chunks, so a part ends where a chunk does); `None` without them.
fn part_crc<'a>(chunks: &mut impl Iterator<Item = &'a (u32, u32)>, len: usize) -> Option<u32> {
    let mut crc = 0;
    let mut have = 0;
    while have < len {
        let &(n, sum) = chunks.next()?;
        crc = messenger::checksum::crc32c_combine(crc, sum, n as usize);
        have += n as usize;
    }
    (have == len).then_some(crc)
}

/// The chunk CRC list of a shard read reply: count u32, then (length u32, CRC-32C u32) per
/// chunk, tiling the bytes; count 0 when the store does not know them all.
fn chunk_crcs(r: &ReadBuf) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + 8 * r.chunk_crcs.len());
    v.extend_from_slice(&(r.chunk_crcs.len() as u32).to_le_bytes());
    for &(len, crc) in &r.chunk_crcs {
        v.extend_from_slice(&len.to_le_bytes());
        v.extend_from_slice(&crc.to_le_bytes());
    }
    v
}

/// `len` bytes at `start` of a buffer the device read into, handed to the messenger by address.
struct DmaSlice {
    buf: driver::DmaBuf,
    start: usize,
    len: usize,
    /// The bytes' CRC, combined from the chunk CRCs the store verified: the frame checksum
    /// then does not read the bytes a second time.
    crc: Option<u32>,
}

// SAFETY: the DmaBuf is owned here and its read has completed (the store returns buffers only
// after their completions), so no device or thread writes it while this lives; the range was
// checked against the buffer when `read_reply` made the slice.
unsafe impl messenger::RawBytes for DmaSlice {
    fn raw(&self) -> (*const u8, usize) {
        (self.buf.as_ptr().wrapping_add(self.start), self.len)
    }

    fn crc32c_append(&self, crc: u32) -> u32 {
        match self.crc {
            Some(own) => messenger::checksum::crc32c_combine(crc, own, self.len),
            None => self.buf.crc32c(crc, self.start, self.len),
        }
    }
}

/// Part of a cached chunk (ordinary memory), shared with the messenger.
struct CachedSlice {
    chunk: Arc<store::cache::Cached>,
    start: usize,
    len: usize,
}

impl AsRef<[u8]> for CachedSlice {
    fn as_ref(&self) -> &[u8] {
        &self.chunk.bytes()[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod meta_cache_tests {
    use super::*;

    fn meta(version: u64) -> Option<ShardMeta> {
        Some(ShardMeta {
            version,
            size: version * 10,
            mtime_unix_ns: 0,
            deleted: false,
        })
    }

    #[test]
    fn the_meta_cache_stays_bounded_and_keeps_what_is_used() {
        let key = |i: u64| ObjectKey::new(1, format!("o{i}"), 0);
        let mut c = MetaCache::new(8);
        for i in 0..100 {
            c.insert(key(i), meta(i));
            // Entry 0 is read after every insert: it never leaves.
            assert_eq!(c.get(&key(0)), Some(meta(0)), "after {i}");
            assert!(c.len() <= 8, "{} entries after {i}", c.len());
        }
        // The newest entries are there, with their own states; long-unused ones are gone.
        for i in 97..100 {
            assert_eq!(c.get(&key(i)), Some(meta(i)));
        }
        assert_eq!(c.get(&key(50)), None);
        // A removed entry is gone from either generation.
        c.remove(&key(0));
        c.remove(&key(97));
        assert_eq!(c.get(&key(0)), None);
        assert_eq!(c.get(&key(97)), None);
        // A cached absence is an answer, not a miss.
        c.insert(key(200), None);
        assert_eq!(c.get(&key(200)), Some(None));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_of_a_pg_is_the_crc_of_pool_and_pg_as_on_disk_layouts_expect() {
        // `Local::store` picks a PG's device from this CRC; nodes with several devices found
        // their shards by it before it stopped concatenating into a temporary buffer.
        for (pool, pg) in [(1u64, 0u32), (7, 0x3f), (u64::MAX, u32::MAX)] {
            let joined = [pool.to_le_bytes(), (pg as u64).to_le_bytes()].concat();
            let appended = crc32c::crc32c_append(
                crc32c::crc32c(&pool.to_le_bytes()),
                &(pg as u64).to_le_bytes(),
            );
            assert_eq!(appended, crc32c::crc32c(&joined));
        }
    }

    #[test]
    fn rollback_record_round_trip_and_spill() {
        let rb = Rollback {
            version_from: 7,
            prev: Some(ShardMeta {
                version: 3,
                size: 10,
                mtime_unix_ns: 1,
                deleted: false,
            }),
            restore: Restore::Range(4096, vec![5; 100]),
            xattrs: vec![("a".into(), None), ("b".into(), Some(vec![1]))],
        };
        let mut spill = None;
        let b = rb.encode(&mut spill);
        assert!(spill.is_none());
        assert_eq!(Rollback::decode(&b, || unreachable!()).unwrap(), rb);
        let big = Rollback {
            restore: Restore::Full(vec![9; ROLLBACK_INLINE_BYTES_MAX + 1]),
            ..rb
        };
        let b = big.encode(&mut spill);
        let s = spill.clone().unwrap();
        assert_eq!(Rollback::decode(&b, || Ok(s)).unwrap(), big);
    }
}

#[cfg(test)]
mod store_tests {
    use super::*;
    use driver::FileOptions;
    use store::{MkfsOptions, StoreConfig};

    fn local() -> (tempfile::TempDir, Local) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        let dev = FileDevice::create(&path, 256 << 20, FileOptions::default()).unwrap();
        store::mkfs(
            &dev,
            &MkfsOptions {
                node_id: 1,
                ..MkfsOptions::default()
            },
        )
        .unwrap();
        let config = StoreConfig {
            alias: Some(rollback_partner),
            ..StoreConfig::default()
        };
        let (st, _) = Store::open(dev, None, config).unwrap();
        (dir, Local::new(vec![st]))
    }

    fn meta(version: u64, size: u64) -> ShardMeta {
        ShardMeta {
            version,
            size,
            mtime_unix_ns: version * 10,
            deleted: false,
        }
    }

    fn full<'a>(version: u64, data: &'a [u8], xattrs: &[(&str, &[u8])]) -> ShardWrite<'a> {
        ShardWrite {
            pool: 1,
            pg: 3,
            name: b"obj",
            shard: 2,
            kind: WriteKind::Full,
            base_version: BASE_ANY,
            meta: meta(version, data.len() as u64 * 6),
            offset: 0,
            xattrs: xattrs
                .iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_vec())))
                .collect(),
            reqs: ReqHistory::default(),
            data: ShardData::Flat(data),
            chunk_crcs: Vec::new(),
            listed_crcs: Vec::new(),
        }
    }

    /// A write naming a staged shard decodes to the same write and the reference; it carries
    /// no data, and a plain decode of it (or a staged decode of a plain write) fails.
    #[test]
    fn a_staged_shard_write_names_its_upload_and_carries_no_data() {
        let w = full(9, &[], &[("k", b"v")]);
        let r = StagedRef {
            upload: ReqId {
                who: Identity::Client(41),
                id: 0xfeed_0000_0001,
            },
            len: 699_051,
        };
        let p = w.encode_staged(5, &r);
        let mut d = Dec::new(&p);
        assert_eq!(d.u64().unwrap(), 5);
        let (got, got_r) = ShardWrite::decode_staged(&mut d).unwrap();
        assert_eq!(got_r, r);
        assert_eq!((got.name, got.shard, got.meta), (w.name, w.shard, w.meta));
        assert_eq!(got.xattrs, w.xattrs);
        assert!(got.data.is_empty());
        let mut d = Dec::new(&p[8..]);
        assert!(
            ShardWrite::decode(&mut d).is_err(),
            "the reference is not a crc list"
        );
        let mut plain = full(9, b"abc", &[]).encode_header(5);
        plain.extend_from_slice(b"abc");
        let mut d = Dec::new(&plain[8..]);
        assert!(
            ShardWrite::decode_staged(&mut d).is_err(),
            "data in a staged write"
        );
        for cut in 8..p.len() {
            let mut d = Dec::new(&p[8..cut]);
            assert!(ShardWrite::decode_staged(&mut d).is_err(), "cut at {cut}");
        }
    }

    /// A shard write as a primary sends it with its chunk CRC list: decoded, the list is
    /// only *listed*; `vouch` adopts it when it combines to the payload CRC the messenger
    /// verified, and drops a list with one wrong CRC (the bytes themselves intact). Applied
    /// with vouched CRCs, the store records them (the shard reads back, its scrub is clean);
    /// CRCs that are not the store's chunks are not used.
    #[test]
    fn chunk_crc_lists_are_vouched_against_the_payload_crc() {
        use messenger::checksum::crc32c;
        let cb = 64 << 10;
        let data: Vec<u8> = (0..3 * cb + 100).map(|i| (i * 7 % 251) as u8).collect();
        let pieces: Vec<(u32, u32)> = data
            .chunks(cb)
            .map(|c| (c.len() as u32, crc32c(c)))
            .collect();
        let message = |list: &[(u32, u32)]| {
            let mut p = full(7, &data, &[("a", b"1")]).encode_header_len(3, data.len());
            p.extend_from_slice(&data);
            p.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for (l, c) in list {
                p.extend_from_slice(&l.to_le_bytes());
                p.extend_from_slice(&c.to_le_bytes());
            }
            p
        };
        let decode = |p: &[u8]| {
            let mut d = Dec::new(p);
            d.u64().unwrap();
            let mut w = ShardWrite::decode(&mut d).unwrap();
            assert!(w.chunk_crcs.is_empty(), "decoding vouches for nothing");
            let adopted = w.vouch(p, crc32c(p));
            assert_eq!(adopted, Some(!w.chunk_crcs.is_empty()));
            (w.chunk_crcs.clone(), w.data.len())
        };
        let p = message(&pieces);
        assert_eq!(decode(&p), (pieces.clone(), data.len()));
        let mut wrong = pieces.clone();
        wrong[2].1 ^= 1;
        assert_eq!(
            decode(&message(&wrong)).0,
            vec![],
            "a wrong crc drops the list"
        );
        // A list that does not cover the data is malformed.
        let short = message(&pieces[..3]);
        let mut d = Dec::new(&short);
        d.u64().unwrap();
        assert!(ShardWrite::decode(&mut d).is_err());
        // Without a list (an older primary, or recovery writes): nothing listed.
        let mut d = Dec::new(&p[..p.len() - 4 - 8 * pieces.len()]);
        d.u64().unwrap();
        assert!(ShardWrite::decode(&mut d).unwrap().listed_crcs.is_empty());

        // Only pieces that are the store's chunks are used.
        assert_eq!(
            chunk_crcs_of(&pieces, data.len(), cb as u64),
            Some(pieces.iter().map(|p| p.1).collect())
        );
        assert_eq!(chunk_crcs_of(&pieces, data.len(), 4096), None);
        let halves: Vec<(u32, u32)> = data
            .chunks(cb / 2)
            .map(|c| (c.len() as u32, crc32c(c)))
            .collect();
        assert_eq!(chunk_crcs_of(&halves, data.len(), cb as u64), None);

        // Applied with vouched CRCs: recorded, and they are right.
        let (_dir, l) = local();
        let mut d = Dec::new(&p);
        d.u64().unwrap();
        let mut w = ShardWrite::decode(&mut d).unwrap();
        w.vouch(&p, crc32c(&p));
        l.apply(&w).unwrap();
        let st = l.store(1, 3);
        let key = ObjectKey::new(1, b"obj", 2);
        assert_eq!(st.read_vec(&key, 0, u64::MAX).unwrap(), data);
        let r = st.scrub();
        assert!(r.corrupt.is_empty() && r.errors.is_empty(), "{r:?}");
    }

    /// The shard's state less its rollback record (one level of undo is kept).
    fn snapshot(l: &Local) -> (ShardState, Vec<u8>) {
        let mut st = l.stat(1, 3, b"obj", 2).unwrap();
        st.rollback_from = 0;
        let v = st.meta.map_or(0, |m| m.version);
        let data = if v == 0 {
            Vec::new()
        } else {
            l.read(1, 3, b"obj", 2, v, 0, u64::MAX, true)
                .unwrap()
                .to_vec()
        };
        (st, data)
    }

    /// Every kind of shard write, undone by its rollback record, leaves the shard exactly as
    /// it was: data, metadata and user xattrs.
    #[test]
    fn rollback_restores_data_meta_and_xattrs_for_every_write_kind() {
        let (_d, l) = local();
        // Undo a create: the shard disappears.
        l.apply(&full(10, b"first", &[("a", b"1")])).unwrap();
        let st = l.rollback(1, 3, b"obj", 2, 10).unwrap();
        assert_eq!(st, ShardState::default());
        // Undo a full overwrite (small, inline record).
        l.apply(&full(11, b"hello world", &[("a", b"1"), ("b", b"2")]))
            .unwrap();
        let before = snapshot(&l);
        l.apply(&full(12, b"HELLO", &[("a", b"9")])).unwrap();
        assert_eq!(snapshot(&l).1, b"HELLO");
        l.rollback(1, 3, b"obj", 2, 12).unwrap();
        assert_eq!(snapshot(&l), before);
        // Undo a range write that grew the shard, with xattr changes.
        let w = ShardWrite {
            kind: WriteKind::Range,
            base_version: 11,
            meta: meta(13, 100),
            offset: 6,
            xattrs: vec![("a".into(), None), ("c".into(), Some(b"3".to_vec()))],
            data: ShardData::Flat(b"WORLD!!!"),
            ..full(13, b"", &[])
        };
        l.apply(&w).unwrap();
        assert_eq!(snapshot(&l).1, b"hello WORLD!!!");
        assert_eq!(snapshot(&l).0.xattrs.get("c").unwrap(), b"3");
        l.rollback(1, 3, b"obj", 2, 13).unwrap();
        let after = snapshot(&l);
        assert_eq!(after.0, before.0);
        // The bytes past the old length may remain; readers clip to the object's size.
        assert_eq!(&after.1[..before.1.len()], &before.1[..]);
        // Undo a metadata-only write.
        let w = ShardWrite {
            kind: WriteKind::Meta,
            base_version: 11,
            meta: meta(14, 66),
            xattrs: vec![("b".into(), Some(b"changed".to_vec()))],
            ..full(14, b"", &[])
        };
        l.apply(&w).unwrap();
        l.rollback(1, 3, b"obj", 2, 14).unwrap();
        assert_eq!(snapshot(&l).0, before.0);
        // Undo a remove (a tombstone) and a big overwrite whose old bytes spill to an object.
        let big = vec![7u8; ROLLBACK_INLINE_BYTES_MAX * 3];
        l.apply(&full(15, &big, &[])).unwrap();
        let before_big = snapshot(&l);
        let mut tomb = full(16, b"", &[]);
        tomb.meta.deleted = true;
        l.apply(&tomb).unwrap();
        assert!(snapshot(&l).0.meta.unwrap().deleted);
        l.rollback(1, 3, b"obj", 2, 16).unwrap();
        assert_eq!(snapshot(&l), before_big);
        // Only the latest write can be undone, and only by its own version.
        assert!(l.rollback(1, 3, b"obj", 2, 14).is_err());
        let w = ShardWrite {
            base_version: 3,
            ..full(17, b"x", &[])
        };
        let w = ShardWrite {
            kind: WriteKind::Range,
            ..w
        };
        let e = l.apply(&w).unwrap_err();
        assert_eq!(e.status(), Status::VersionMismatch, "{e}");
    }

    /// `settle` drops the rollback record (and its spilled bytes) of the version named, only
    /// while the shard is at that version; `apply_settled` keeps none. A settled version can
    /// no longer be rolled back; the data stays as written.
    #[test]
    fn settled_writes_keep_no_rollback_record() {
        let (_d, l) = local();
        let st = &l.stores[0];
        let spill = ObjectKey::new(1, b"obj", 2 | SHARD_ROLLBACK_BIT);
        let rb_from = || l.stat(1, 3, b"obj", 2).unwrap().rollback_from;
        let big = vec![5u8; ROLLBACK_INLINE_BYTES_MAX * 2];
        l.apply(&full(11, &big, &[])).unwrap();
        l.apply(&full(12, b"second", &[])).unwrap();
        assert!(
            st.exists(&spill),
            "the old bytes spill to an object of their own"
        );
        assert_eq!(rb_from(), 12);
        // The wrong version, or a name with no shard here: nothing dropped.
        assert_eq!(
            l.settle(1, 3, 2, &[(b"obj", 11), (b"nope", 12)]).unwrap(),
            0
        );
        assert_eq!(rb_from(), 12);
        let live = st.space().live_bytes;
        assert_eq!(l.settle(1, 3, 2, &[(b"obj", 12)]).unwrap(), 1);
        assert_eq!(rb_from(), 0);
        assert!(!st.exists(&spill));
        assert!(st.space().live_bytes + big.len() as u64 <= live);
        assert!(l.rollback(1, 3, b"obj", 2, 12).is_err());
        assert_eq!(snapshot(&l).1, b"second");
        // Settling again finds nothing; a later write keeps its own record.
        assert_eq!(l.settle(1, 3, 2, &[(b"obj", 12)]).unwrap(), 0);
        l.apply(&full(13, b"third", &[])).unwrap();
        assert_eq!(l.settle(1, 3, 2, &[(b"obj", 12)]).unwrap(), 0);
        assert_eq!(rb_from(), 13);
        l.rollback(1, 3, b"obj", 2, 13).unwrap();
        assert_eq!(snapshot(&l).1, b"second");
        // A recovery-style write: no record, and an old spill does not linger.
        l.apply(&full(14, &big, &[])).unwrap();
        l.apply(&full(15, b"x", &[])).unwrap();
        assert!(st.exists(&spill));
        l.apply_settled(&full(16, b"recovered", &[])).unwrap();
        assert_eq!(rb_from(), 0);
        assert!(!st.exists(&spill));
        assert_eq!(snapshot(&l).1, b"recovered");
        let mut range = full(17, b"R", &[]);
        range.kind = WriteKind::Range;
        range.base_version = 16;
        assert!(l.apply_settled(&range).is_err(), "whole shards only");
    }

    /// An overwrite of a big shard keeps the old one for its rollback by moving it to the
    /// rollback key (a store rename): nothing read, nothing copied. The rollback, and a
    /// settle, work on it as on a copied one.
    #[test]
    fn an_overwrite_moves_the_old_shard_to_its_rollback_key_without_copying_it() {
        let (_d, l) = local();
        let st = &l.stores[0];
        let spill = ObjectKey::new(1, b"obj", 2 | SHARD_ROLLBACK_BIT);
        let old = vec![3u8; 1 << 20];
        let new = vec![4u8; 1 << 20];
        l.apply(&full(10, &old, &[("a", b"1")])).unwrap();
        let before = snapshot(&l);
        let (written, reads) = (st.stats().device_bytes_written, st.stats().reads);
        l.apply(&full(11, &new, &[])).unwrap();
        let wrote = st.stats().device_bytes_written - written;
        assert!(
            wrote < new.len() as u64 + (128 << 10),
            "the overwrite wrote {wrote} bytes for a {} byte shard: the old one was copied",
            new.len()
        );
        assert_eq!(st.stats().reads, reads, "the old shard was read");
        assert_eq!(st.read_vec(&spill, 0, u64::MAX).unwrap(), old);
        assert_eq!(snapshot(&l).1, new);
        l.rollback(1, 3, b"obj", 2, 11).unwrap();
        assert_eq!(snapshot(&l), before);
        // Again, settled: the moved bytes go.
        l.apply(&full(12, &new, &[])).unwrap();
        let live = st.space().live_bytes;
        assert_eq!(l.settle(1, 3, 2, &[(b"obj", 12)]).unwrap(), 1);
        assert!(!st.exists(&spill));
        assert!(st.space().live_bytes + old.len() as u64 <= live);
        assert_eq!(snapshot(&l).1, new);
    }

    /// A remove writes no copy of the shard (a full store takes it): the old bytes stay under
    /// the tombstone, which reads as empty; a rollback puts back the metadata and xattrs over
    /// them; `settle` drops them and keeps the tombstone. A write over a tombstone whose bytes
    /// are still there keeps an empty shard for its own rollback, not those bytes.
    #[test]
    fn a_remove_keeps_the_old_bytes_in_place_until_it_is_settled() {
        let (_d, l) = local();
        let st = &l.stores[0];
        let key = ObjectKey::new(1, b"obj", 2);
        let spill = ObjectKey::new(1, b"obj", 2 | SHARD_ROLLBACK_BIT);
        let big = vec![6u8; ROLLBACK_INLINE_BYTES_MAX * 4];
        let remove = |v: u64| {
            let mut rm = full(v, b"", &[]);
            rm.meta.deleted = true;
            rm.meta.size = 0;
            rm
        };
        // An overwrite spills the first version; the remove after it drops that spill.
        l.apply(&full(10, &big, &[("a", b"1")])).unwrap();
        l.apply(&full(11, &big, &[("a", b"1"), ("b", b"2")]))
            .unwrap();
        assert!(st.exists(&spill));
        let before = snapshot(&l);
        let written = st.stats().device_bytes_written;
        l.apply(&remove(12)).unwrap();
        assert!(!st.exists(&spill), "no record refers to the old spill");
        let wrote = st.stats().device_bytes_written - written;
        assert!(
            wrote < big.len() as u64 / 2,
            "the remove wrote {wrote} bytes: a copy of the {} it removed",
            big.len()
        );
        let (tomb, data) = snapshot(&l);
        assert!(tomb.meta.unwrap().deleted && tomb.xattrs.is_empty());
        assert_eq!(data, b"", "a tombstone reads as empty");
        assert_eq!(st.read_vec(&key, 0, u64::MAX).unwrap(), big);
        l.rollback(1, 3, b"obj", 2, 12).unwrap();
        assert_eq!(snapshot(&l), before);
        // Removed again, and settled: the bytes go, the tombstone stays and cannot be undone.
        l.apply(&remove(13)).unwrap();
        let live = st.space().live_bytes;
        assert_eq!(l.settle(1, 3, 2, &[(b"obj", 13)]).unwrap(), 1);
        assert!(st.space().live_bytes + big.len() as u64 <= live);
        assert_eq!(st.stat(&key).unwrap().size, 0);
        let (tomb, data) = snapshot(&l);
        assert!(tomb.meta.unwrap().deleted && data.is_empty());
        assert_eq!(tomb.meta.unwrap().version, 13);
        assert!(l.rollback(1, 3, b"obj", 2, 13).is_err());
        // A write over an unsettled tombstone, rolled back: the tombstone, empty.
        l.apply(&full(14, &big, &[])).unwrap();
        l.apply(&remove(15)).unwrap();
        l.apply(&full(16, b"new", &[])).unwrap();
        assert_eq!(snapshot(&l).1, b"new");
        l.rollback(1, 3, b"obj", 2, 16).unwrap();
        let (tomb, data) = snapshot(&l);
        assert_eq!(tomb.meta.unwrap().version, 15);
        assert!(tomb.meta.unwrap().deleted && data.is_empty());
        assert_eq!(st.stat(&key).unwrap().size, 0);
        // No range write lands on a tombstone's leftover bytes.
        let mut range = full(17, b"R", &[]);
        range.kind = WriteKind::Range;
        range.base_version = 15;
        assert_eq!(l.apply(&range).unwrap_err().status(), Status::Invalid);
    }

    /// A tombstone goes only on its primary's word, only at the listed version and only
    /// under this member's mark of the same slot; once gone, the member's stat of the name
    /// reports its mark (the proof `resolve` uses). A leftover shard is dropped only at the
    /// version named.
    #[test]
    fn tombstones_are_forgotten_under_the_mark_and_leftovers_dropped_at_their_version() {
        let (_d, l) = local();
        let st = &l.stores[0];
        let key = ObjectKey::new(1, b"obj", 2);
        let big = vec![5u8; ROLLBACK_INLINE_BYTES_MAX * 2];
        l.apply(&full(11, &big, &[])).unwrap();
        let mut rm = full(12, b"", &[]);
        rm.meta.deleted = true;
        rm.meta.size = 0;
        l.apply(&rm).unwrap();
        let spill = ObjectKey::new(1, b"obj", 2 | SHARD_ROLLBACK_BIT);
        assert!(
            !st.exists(&spill) && st.read_vec(&key, 0, u64::MAX).unwrap() == big,
            "the remove keeps the old bytes in place for a rollback"
        );
        let stat = l.stat(1, 3, b"obj", 2).unwrap();
        assert!(stat.meta.unwrap().deleted);
        assert_eq!(stat.mark, None, "a member holding a shard reports no mark");
        // No mark, a mark of another slot, a mark below the version: nothing goes.
        assert_eq!(l.forget(1, 3, 2, &[(b"obj", 12)]).unwrap(), 0);
        l.set_mark(1, 3, 4, 20).unwrap();
        assert_eq!(l.forget(1, 3, 2, &[(b"obj", 12)]).unwrap(), 0);
        l.set_mark(1, 3, 2, 11).unwrap();
        assert_eq!(l.forget(1, 3, 2, &[(b"obj", 12)]).unwrap(), 0);
        l.set_mark(1, 3, 2, 12).unwrap();
        // Wrong version, unknown name: skipped.
        assert_eq!(
            l.forget(1, 3, 2, &[(b"obj", 11), (b"nope", 12)]).unwrap(),
            0
        );
        assert!(st.exists(&key));
        let live = st.space().live_bytes;
        assert_eq!(l.forget(1, 3, 2, &[(b"obj", 12)]).unwrap(), 1);
        assert!(!st.exists(&key) && !st.exists(&spill));
        assert!(st.space().live_bytes + big.len() as u64 <= live);
        let stat = l.stat(1, 3, b"obj", 2).unwrap();
        assert_eq!(stat.meta, None);
        assert_eq!(
            stat.mark,
            Some((2, 12)),
            "the absent shard carries the mark"
        );
        // The mark survives a reopen of the index (read from the store, not the cache).
        l.marks.lock().unwrap().clear();
        assert_eq!(l.mark(1, 3).unwrap(), Some((2, 12)));
        // A live shard is no tombstone: forget leaves it.
        l.apply(&full(13, b"back", &[])).unwrap();
        assert_eq!(l.forget(1, 3, 2, &[(b"obj", 13)]).unwrap(), 0);
        assert_eq!(snapshot(&l).1, b"back");
        // drop_stale: not at another version; at its own, gone with its spilled record.
        l.apply(&full(14, &big, &[])).unwrap();
        l.apply(&full(15, b"stale", &[])).unwrap();
        assert!(st.exists(&spill));
        let (dropped, after) = l.drop_stale(1, 3, b"obj", 2, 14).unwrap();
        assert!(!dropped);
        assert_eq!(after.meta.map(|m| m.version), Some(15));
        let (dropped, after) = l.drop_stale(1, 3, b"obj", 2, 15).unwrap();
        assert!(dropped);
        assert_eq!(after.meta, None);
        assert_eq!(after.mark, Some((2, 12)));
        assert!(!st.exists(&key) && !st.exists(&spill));
        // The mark goes with salvage's word.
        assert!(l.remove_mark(1, 3).unwrap());
        assert_eq!(l.stat(1, 3, b"obj", 2).unwrap().mark, None);
        assert!(!l.remove_mark(1, 3).unwrap());
    }

    #[test]
    fn pg_log_entries_are_kept_per_pg_and_trimmed() {
        let (_d, l) = local();
        for v in 1..=(PG_LOG_ENTRIES_MAX as u64 + 20) {
            l.apply(&full(v, b"x", &[])).unwrap();
        }
        let st = &l.stores[0];
        let n = st
            .list(1, None, 10_000)
            .iter()
            .filter(|(k, _)| k.shard == SHARD_LOG && k.name.starts_with(b"\0log"))
            .count();
        assert_eq!(n, PG_LOG_ENTRIES_MAX);
        // A fresh index (as after a restart) finds the same entries.
        let reloaded = l.load_log(st, 1, 3);
        assert_eq!(reloaded.len(), PG_LOG_ENTRIES_MAX);
        assert!(reloaded.front().unwrap().name.ends_with(b"obj"));
    }

    /// A write's request history travels in SHARD_WRITE and is kept with the shard (`stat`
    /// reports it, and SHARD_STAT carries it): replaced by the next write's, kept by a write
    /// that adds no request, cut back to the restored version by a rollback, restored by a
    /// repair that carries it; a value from before histories reads as one entry.
    #[test]
    fn a_shard_keeps_the_request_history_of_the_writes_that_made_its_versions() {
        let (_d, l) = local();
        let rid = |n: u64| ReqId {
            who: Identity::Client(7),
            id: n,
        };
        let mut w = full(5, b"abc", &[]);
        w.reqs = ReqHistory::default().after(Some(rid(0xfeed)), 5);
        let head = w.encode_header(9);
        let mut msg = head.clone();
        msg.extend_from_slice(b"abc");
        let mut d = Dec::new(&msg);
        assert_eq!(d.u64().unwrap(), 9);
        assert_eq!(ShardWrite::decode(&mut d).unwrap().reqs, w.reqs);
        // A request id of an unknown kind is malformed, and so is an overlong history.
        let at = head.len() - 4 - ReqHistory::ENTRY_BYTES;
        assert_eq!((head[at - 1], head[at]), (1, 1));
        msg[at] = 9;
        let mut d = Dec::new(&msg);
        d.u64().unwrap();
        assert!(ShardWrite::decode(&mut d).is_err());
        msg[at] = 1;
        msg[at - 1] = REQ_HISTORY_MAX as u8 + 1;
        let mut d = Dec::new(&msg);
        d.u64().unwrap();
        assert!(ShardWrite::decode(&mut d).is_err());

        let stat = || {
            let s = l.stat(1, 3, b"obj", 2).unwrap();
            let mut e = Enc::default();
            s.encode(&mut e);
            assert_eq!(ShardState::decode(&mut Dec::new(&e.0)).unwrap(), s);
            let ids: Vec<(u64, u64)> = s.reqs.entries().iter().map(|(r, v)| (r.id, *v)).collect();
            (s.meta.map(|m| m.version), ids)
        };
        l.apply(&w).unwrap();
        assert_eq!(stat(), (Some(5), vec![(0xfeed, 5)]));
        let mut w6 = full(6, b"abcd", &[]);
        w6.reqs = w.reqs.after(Some(rid(6)), 6);
        l.apply(&w6).unwrap();
        assert_eq!(stat(), (Some(6), vec![(6, 6), (0xfeed, 5)]));
        // A range write without a request keeps the history it is sent.
        let mut w7 = full(7, b"Z", &[]);
        w7.kind = WriteKind::Range;
        w7.base_version = 6;
        w7.offset = 1;
        w7.reqs = w6.reqs.after(None, 7);
        l.apply(&w7).unwrap();
        assert_eq!(stat(), (Some(7), vec![(6, 6), (0xfeed, 5)]));
        let mut w8 = w7.clone();
        w8.meta.version = 8;
        w8.base_version = 7;
        w8.reqs = w7.reqs.after(Some(rid(8)), 8);
        l.apply(&w8).unwrap();
        assert_eq!(stat(), (Some(8), vec![(8, 8), (6, 6), (0xfeed, 5)]));
        // Undone: version 7 again, and request 8 is no longer in the history.
        l.rollback(1, 3, b"obj", 2, 8).unwrap();
        assert_eq!(stat(), (Some(7), vec![(6, 6), (0xfeed, 5)]));
        // A rollback of a whole-shard write keeps the history too.
        let mut w9 = full(9, b"whole", &[]);
        w9.reqs = w7.reqs.after(Some(rid(9)), 9);
        l.apply(&w9).unwrap();
        l.rollback(1, 3, b"obj", 2, 9).unwrap();
        assert_eq!(stat(), (Some(7), vec![(6, 6), (0xfeed, 5)]));
        // A repair writes what it is given; without a history the shard has none.
        let mut r = full(7, b"aZcd", &[]);
        l.repair(&r).unwrap();
        assert_eq!(stat(), (Some(7), vec![]));
        r.reqs = ReqHistory::default().after(Some(rid(7)), 7);
        l.repair(&r).unwrap();
        assert_eq!(stat(), (Some(7), vec![(7, 7)]));
        // The newest REQ_HISTORY_MAX are kept; a resent request moves to the front.
        let mut h = ReqHistory::default();
        for v in 1..=20 {
            h = h.after(Some(rid(v)), v);
        }
        assert_eq!(h.entries().len(), REQ_HISTORY_MAX);
        assert_eq!(h.version_of(rid(20)), Some(20));
        assert_eq!(h.version_of(rid(20 - REQ_HISTORY_MAX as u64)), None);
        assert_eq!(h.after(Some(rid(15)), 21).entries().len(), REQ_HISTORY_MAX);
        assert_eq!(h.through(14).entries().len(), 14 - 12);
        // `nv.req` as the previous format wrote it: one request id, the current version's.
        let legacy = ReqHistory::from_bytes(&rid(3).to_bytes(), 44);
        assert_eq!(legacy.entries(), &[(rid(3), 44)]);
        assert!(ReqHistory::from_bytes(&[1, 2, 3], 44).is_empty());
        assert_eq!(ReqHistory::from_bytes(&h.to_bytes(), 0), h);
    }

    /// The non-blocking path writes exactly what the blocking one does (data, metadata,
    /// xattrs, log entry, an undo record that removes the shard), and declines every write it
    /// could not do without reading the device.
    #[test]
    fn apply_async_matches_apply_and_declines_what_could_block() {
        let (_d, sync) = local();
        let (_d2, l) = local();
        let l = Arc::new(l);
        let w = full(10, b"first bytes", &[("a", b"1")]);
        sync.apply(&w).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = tx.clone();
        assert!(l
            .apply_async(&w, Box::new(move |r| t.send(r).unwrap()))
            .unwrap());
        assert!(matches!(rx.recv().unwrap(), Some(Ok(()))));
        assert_eq!(snapshot(&l), snapshot(&sync));
        assert_eq!(l.log_window(1, 3), sync.log_window(1, 3));
        assert_eq!(l.log_window(1, 3).0.len(), 1);
        // The shard exists now: an overwrite must read the old bytes for its undo record.
        let declined = |w: &ShardWrite| {
            l.apply_async(w, Box::new(|_| panic!("declined writes are not applied")))
                .unwrap()
        };
        assert!(!declined(&full(11, b"second", &[])));
        // Too big for the copy, or not a create.
        let big = vec![1u8; ASYNC_APPLY_BYTES_MAX + 1];
        let mut other = full(12, &big, &[]);
        other.name = b"other";
        assert!(!declined(&other));
        other.data = ShardData::Flat(b"small");
        other.kind = WriteKind::Range;
        assert!(!declined(&other));
        assert_eq!(snapshot(&l), snapshot(&sync));
        // Its undo record removes the shard, as the blocking path's does.
        let st = l.rollback(1, 3, b"obj", 2, 10).unwrap();
        assert_eq!(st, ShardState::default());
        // A version mismatch is an error from the call; nothing is applied.
        let mut w = full(13, b"x", &[]);
        w.base_version = 12;
        let r = l.apply_async(&w, Box::new(|_| panic!("not applied")));
        assert!(r.is_err());
        assert_eq!(snapshot(&l).0, ShardState::default());
    }
}
