//! Transactions: a batch of operations over several objects, applied atomically.
//!
//! `Store::commit` prepares the transaction against the current index (reading the old bytes
//! of partially overwritten chunks and the old xattr map where needed), hands it to the commit
//! thread, and blocks until it is durable. The commit thread re-checks that every object it
//! depends on is still in the state it was prepared against; if another writer got there
//! first, the transaction is prepared again (optimistic concurrency), so concurrent writers of
//! one object see one linear history.

use std::collections::BTreeMap;
use std::sync::Arc;

use driver::BlockDevice;

use crate::commit::{
    zeros_crc, Base, ChunkSrc, DataRef, Lent, Msg, Mut, MutOp, Prepared, PutState, TxnResult,
    XattrSrc,
};
use crate::error::{Result, StoreError};
use crate::format::ChunkRef;
use crate::key::{ObjectKey, OBJECT_BYTES_MAX, XATTR_BYTES_MAX, XATTR_NAME_BYTES_MAX};
use crate::meta::ObjectMeta;
use crate::read::encode_xattrs;
use crate::{Shared, Store};

/// Objects writing at least this much new data copy it into DMA buffers on the caller's
/// thread (parallel across callers); smaller ones are copied by the commit thread, which packs
/// them into one write with their neighbours.
const DMA_COPY_BYTES_MIN: u64 = 256 << 10;

/// How a [`Store::commit_async`] ended.
#[derive(Debug)]
pub enum AsyncCommit {
    /// Durable; the store's op sequence number it got.
    Durable(u64),
    /// Lost a race with another writer of one of its objects; nothing was applied.
    Raced,
    Failed(StoreError),
}

/// How many times a transaction is prepared again after losing a race.
const CONFLICT_RETRIES_MAX: u32 = 1000;

enum Op<'a> {
    WriteFull(&'a [u8]),
    Replace(&'a [u8]),
    /// A replace whose data is the concatenation of these slices, and optionally the CRC of
    /// each chunk of it, which the caller vouches for.
    ReplaceParts(Vec<&'a [u8]>, Option<Vec<u32>>),
    Write(u64, &'a [u8]),
    Append(&'a [u8]),
    Remove,
    /// Give this object's state to the key named (its partner), and remove it.
    RenameTo(ObjectKey),
    SetXattr(String, &'a [u8]),
    RmXattr(String),
    AssertVersion(u64),
    AssertExists,
    AssertAbsent,
}

/// Operations to apply atomically. Data is borrowed until `Store::commit` returns.
#[derive(Default)]
pub struct Transaction<'a> {
    ops: Vec<(ObjectKey, Op<'a>)>,
    room: crate::commit::Room,
}

impl<'a> Transaction<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Replace the object's content (creating it).
    pub fn write_full(&mut self, key: ObjectKey, data: &'a [u8]) -> &mut Self {
        self.ops.push((key, Op::WriteFull(data)));
        self
    }

    /// Make the object exactly `data` with no xattrs, whether or not it exists (creating
    /// it). Unlike [`Transaction::write_full`], which keeps the object's xattrs, the result
    /// does not depend on the object's current state: nothing is looked up to prepare it, and
    /// xattrs set after it in the same transaction are the object's only ones.
    pub fn replace(&mut self, key: ObjectKey, data: &'a [u8]) -> &mut Self {
        self.ops.push((key, Op::Replace(data)));
        self
    }

    /// [`Transaction::replace`] with the data given as the concatenation of `parts`, so a
    /// caller holding it in pieces (a node's own data shard: the stripe units of the client's
    /// request) need not join them first. Whole chunks inside one part are used in place like
    /// a single slice's; a chunk that spans parts is assembled.
    pub fn replace_parts(&mut self, key: ObjectKey, parts: &[&'a [u8]]) -> &mut Self {
        self.ops.push((key, Op::ReplaceParts(parts.to_vec(), None)));
        self
    }

    /// [`Transaction::replace_parts`] with the CRC-32C of each of the data's chunks
    /// ([`Store::chunk_bytes`] each, the last one shorter), which the store records instead of
    /// summing the bytes again: a node whose messenger has just verified the bytes against a
    /// frame CRC made of these (a shard write's chunk CRCs) saves a pass over them. The caller
    /// vouches for them: a wrong one is recorded, and reading that chunk then fails as
    /// `Corrupted` (never returns wrong bytes). Their number must be the data's chunk count.
    pub fn replace_parts_with_crcs(
        &mut self,
        key: ObjectKey,
        parts: &[&'a [u8]],
        chunk_crcs: &[u32],
    ) -> &mut Self {
        self.ops.push((
            key,
            Op::ReplaceParts(parts.to_vec(), Some(chunk_crcs.to_vec())),
        ));
        self
    }

    /// Write at an offset (creating the object, zero-filling any gap).
    pub fn write(&mut self, key: ObjectKey, offset: u64, data: &'a [u8]) -> &mut Self {
        self.ops.push((key, Op::Write(offset, data)));
        self
    }

    pub fn append(&mut self, key: ObjectKey, data: &'a [u8]) -> &mut Self {
        self.ops.push((key, Op::Append(data)));
        self
    }

    /// Remove the object (it must exist).
    pub fn remove(&mut self, key: ObjectKey) -> &mut Self {
        self.ops.push((key, Op::Remove));
        self
    }

    /// Move the object `from` (it must exist, unchanged so far in this transaction) to its
    /// partner key `to` ([`crate::StoreConfig::alias`]): `to` takes its data and xattrs,
    /// replacing whatever it held, and `from` is removed. No bytes move: the new state names
    /// the same chunks, so it costs a record, whatever the object's size.
    pub fn rename(&mut self, from: ObjectKey, to: ObjectKey) -> &mut Self {
        self.ops.push((from, Op::RenameTo(to)));
        self
    }

    pub fn set_xattr(&mut self, key: ObjectKey, name: &str, value: &'a [u8]) -> &mut Self {
        self.ops.push((key, Op::SetXattr(name.into(), value)));
        self
    }

    pub fn rm_xattr(&mut self, key: ObjectKey, name: &str) -> &mut Self {
        self.ops.push((key, Op::RmXattr(name.into())));
        self
    }

    /// Fail the whole transaction unless the object exists at exactly this version.
    pub fn assert_version(&mut self, key: ObjectKey, version: u64) -> &mut Self {
        self.ops.push((key, Op::AssertVersion(version)));
        self
    }

    pub fn assert_exists(&mut self, key: ObjectKey) -> &mut Self {
        self.ops.push((key, Op::AssertExists));
        self
    }

    pub fn assert_absent(&mut self, key: ObjectKey) -> &mut Self {
        self.ops.push((key, Op::AssertAbsent));
        self
    }

    /// Mark the transaction as one that makes room: a remove that writes a little metadata
    /// (a node's remove: a tombstone whose old bytes stay until the remove is settled). Like a
    /// transaction of removes only, it may then use the store's reserve down to one segment
    /// above the cleaner's floor, so a full store still takes it. Only while its records and
    /// data are small ([`MAKES_ROOM_BYTES_MAX`]); a bigger one is held to the floor every
    /// write keeps.
    pub fn makes_room(&mut self) -> &mut Self {
        self.room = crate::commit::Room::Makes;
        self
    }

    /// Mark the transaction as one that only frees space (the drop of bytes a settled remove
    /// kept, the removal of tombstones): small ones may use the reserve down to the cleaner's
    /// own floor, a segment below what [`Transaction::makes_room`] may use — so removes that
    /// filled all the room they may use leave the drops of their bytes a segment of their own.
    pub fn frees_space(&mut self) -> &mut Self {
        self.room = crate::commit::Room::Frees;
        self
    }
}

/// The most a [`Transaction::makes_room`] or [`Transaction::frees_space`] may write (records,
/// xattr maps, data) to be let into the reserve.
pub const MAKES_ROOM_BYTES_MAX: u64 = 64 << 10;

/// The prepared state of one object.
enum Chunk {
    Keep(ChunkRef),
    Lent(Lent),
    Owned(Vec<u8>),
    Hole,
}

struct Obj {
    key: ObjectKey,
    /// The object's state in the index; looked up only once an op needs it (`loaded`).
    cur: Option<Arc<ObjectMeta>>,
    loaded: bool,
    exists: bool,
    size: u64,
    version: u64,
    chunks: Vec<Chunk>,
    xattrs: Option<BTreeMap<String, Vec<u8>>>,
    xattrs_cleared: bool,
    removed: bool,
    /// Only blind ops (write_full, replace, remove, xattrs set after a replace) so far: the
    /// commit need not pin the current state.
    blind: bool,
    /// Some op changes the object (not just asserts).
    dirty: bool,
    /// The CRC of each chunk, given by the caller with the replace that made the content
    /// (`replace_parts_with_crcs`); dropped by any later op that changes the data.
    known_crcs: Option<Vec<u32>>,
    /// The stored xattr map the object's xattrs are, when not its own state's (it was
    /// renamed here in this transaction).
    xattr_src: Option<ChunkRef>,
}

impl Obj {
    /// The object is gone (removed, or renamed away) as of this op.
    fn set_removed(&mut self) {
        self.exists = false;
        self.removed = true;
        self.size = 0;
        self.chunks.clear();
        self.xattrs = None;
        self.xattrs_cleared = true;
    }
}

impl<D: BlockDevice> Shared<D> {
    /// An object of the transaction, its state not looked up yet ([`Shared::load`]).
    fn new_obj(&self, key: &ObjectKey) -> Obj {
        Obj {
            key: key.clone(),
            cur: None,
            loaded: false,
            exists: false,
            size: 0,
            version: 0,
            chunks: Vec::new(),
            xattrs: None,
            xattrs_cleared: false,
            removed: false,
            blind: true,
            dirty: false,
            known_crcs: None,
            xattr_src: None,
        }
    }

    /// Look the object up in the index, once. Before any op it takes the whole state; after a
    /// write_full or replace (the only ops that run on an object not looked up) their content
    /// stands and only the version and the current state (for xattrs and the commit's check)
    /// are taken. `seen` records what was looked at.
    fn load(&self, o: &mut Obj, seen: &mut Vec<(ObjectKey, Option<u64>)>) {
        if o.loaded {
            return;
        }
        o.loaded = true;
        let cur = self.index_get(&o.key);
        seen.push((o.key.clone(), cur.as_ref().map(|m| m.state_seq)));
        if let Some(m) = &cur {
            o.version = m.version;
            if !o.dirty {
                o.exists = true;
                o.size = m.size;
                o.chunks = m.chunks.iter().map(|r| Chunk::Keep(*r)).collect();
            }
        }
        o.cur = cur;
    }

    /// The logical length of chunk `i` in an object of `size` bytes.
    fn chunk_len(&self, i: usize, size: u64) -> usize {
        let cb = self.chunk_bytes;
        cb.min(size.saturating_sub(i as u64 * cb)) as usize
    }

    /// Make chunk `i` an owned buffer of its logical length under `size` (reading old bytes).
    fn own_chunk(&self, o: &mut Obj, i: usize, size: u64) -> Result<()> {
        let want = self.chunk_len(i, size);
        let mut v = match std::mem::replace(&mut o.chunks[i], Chunk::Hole) {
            Chunk::Keep(r) if r.len.get() > 0 => self.read_ref_vec(&r, "object chunk")?,
            Chunk::Keep(_) | Chunk::Hole => Vec::new(),
            Chunk::Lent(l) => crate::commit::lent_bytes(&l).to_vec(),
            Chunk::Owned(v) => v,
        };
        v.resize(want, 0);
        o.chunks[i] = Chunk::Owned(v);
        Ok(())
    }

    fn write_at(&self, o: &mut Obj, offset: u64, data: &[u8]) -> Result<()> {
        let end = offset + data.len() as u64;
        if end > OBJECT_BYTES_MAX {
            return Err(StoreError::TooLarge {
                what: "object (offset + length)",
                size: end,
                max: OBJECT_BYTES_MAX,
            });
        }
        let cb = self.chunk_bytes;
        let old_size = o.size;
        let new_size = old_size.max(end);
        let n = new_size.div_ceil(cb) as usize;
        // The old last chunk grows if the object grows past it: give it its new length.
        if new_size > old_size && old_size > 0 {
            let last = ((old_size - 1) / cb) as usize;
            if !old_size.is_multiple_of(cb)
                && !matches!(o.chunks.get(last), Some(Chunk::Hole) | None)
            {
                self.own_chunk(o, last, new_size.min((last as u64 + 1) * cb))?;
            }
        }
        o.chunks.resize_with(n.max(o.chunks.len()), || Chunk::Hole);
        o.size = new_size;
        let first = (offset / cb) as usize;
        let last = if data.is_empty() {
            first
        } else {
            ((end - 1) / cb) as usize
        };
        for i in first..=last.min(n.saturating_sub(1)) {
            let c_lo = i as u64 * cb;
            let lo = offset.max(c_lo);
            let hi = end.min(c_lo + cb);
            if lo >= hi {
                continue;
            }
            let piece = &data[(lo - offset) as usize..(hi - offset) as usize];
            let whole = lo == c_lo && hi as usize == c_lo as usize + self.chunk_len(i, new_size);
            if whole {
                // SAFETY: `data` is borrowed from the Transaction, which Store::commit holds
                // until the commit thread has replied.
                o.chunks[i] = Chunk::Lent(unsafe { Lent::new(piece) });
            } else {
                self.own_chunk(o, i, new_size)?;
                let Chunk::Owned(v) = &mut o.chunks[i] else {
                    unreachable!()
                };
                v[(lo - c_lo) as usize..(hi - c_lo) as usize].copy_from_slice(piece);
            }
        }
        Ok(())
    }

    fn xattrs_mut<'m>(&self, o: &'m mut Obj) -> Result<&'m mut BTreeMap<String, Vec<u8>>> {
        if o.xattrs.is_none() {
            let map = match (&o.xattr_src, &o.cur, o.xattrs_cleared) {
                (_, _, true) => BTreeMap::new(),
                (Some(r), _, false) => self.load_xattr_map(r)?,
                (None, Some(m), false) => self.load_xattrs(m)?,
                (None, None, false) => BTreeMap::new(),
            };
            o.xattrs = Some(map);
        }
        Ok(o.xattrs.as_mut().unwrap())
    }

    fn apply_op(
        &self,
        o: &mut Obj,
        op: &Op<'_>,
        seen: &mut Vec<(ObjectKey, Option<u64>)>,
    ) -> Result<()> {
        // Every op but these needs the object's current state: a full write or replace sets
        // the content whatever it was; xattrs changed after a replace (or a remove) in this
        // transaction start from an empty map of an object known to exist (or not).
        let needs_state = match op {
            Op::WriteFull(_) | Op::Replace(_) | Op::ReplaceParts(..) => false,
            Op::SetXattr(..) | Op::RmXattr(_) => !o.xattrs_cleared,
            _ => true,
        };
        if needs_state {
            self.load(o, seen);
        }
        if !matches!(
            op,
            Op::AssertExists | Op::AssertAbsent | Op::AssertVersion(_)
        ) {
            o.dirty = true;
        }
        if !matches!(
            op,
            Op::AssertExists
                | Op::AssertAbsent
                | Op::AssertVersion(_)
                | Op::SetXattr(..)
                | Op::RmXattr(_)
        ) {
            // The data changes: CRCs given for an earlier content no longer describe it.
            o.known_crcs = None;
        }
        match op {
            Op::AssertExists => {
                o.blind = false;
                if !o.exists {
                    return Err(StoreError::NotFound(o.key.clone()));
                }
            }
            Op::AssertAbsent => {
                o.blind = false;
                if o.exists {
                    return Err(StoreError::Invalid(format!("{} exists", o.key)));
                }
            }
            Op::AssertVersion(v) => {
                o.blind = false;
                if !o.exists {
                    return Err(StoreError::NotFound(o.key.clone()));
                }
                if o.version != *v {
                    return Err(StoreError::VersionMismatch {
                        key: o.key.clone(),
                        expected: *v,
                        actual: o.version,
                    });
                }
            }
            Op::WriteFull(_) | Op::Replace(_) | Op::ReplaceParts(..) => {
                let (parts, crcs): (&[&[u8]], _) = match op {
                    Op::WriteFull(d) | Op::Replace(d) => (std::slice::from_ref(d), None),
                    Op::ReplaceParts(p, c) => (p, c.as_ref()),
                    _ => unreachable!("matched above"),
                };
                let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
                check_size(total)?;
                if let Some(c) = crcs {
                    let chunks = total.div_ceil(self.chunk_bytes);
                    if c.len() as u64 != chunks {
                        return Err(StoreError::Invalid(format!(
                            "{} chunk CRCs given for {total} bytes, which are {chunks} chunks",
                            c.len()
                        )));
                    }
                }
                o.chunks.clear();
                o.size = 0;
                o.exists = true;
                if !matches!(op, Op::WriteFull(_)) {
                    o.xattrs = None;
                    o.xattrs_cleared = true;
                }
                let mut at = 0u64;
                for p in parts {
                    self.write_at(o, at, p)?;
                    at += p.len() as u64;
                }
                o.size = total;
                o.known_crcs = crcs.cloned();
            }
            Op::Write(off, data) => {
                o.blind = false;
                o.exists = true;
                self.write_at(o, *off, data)?;
            }
            Op::Append(data) => {
                o.blind = false;
                o.exists = true;
                let at = o.size;
                self.write_at(o, at, data)?;
            }
            Op::RenameTo(_) => unreachable!("renames are prepared by `rename_into`"),
            Op::Remove => {
                if !o.exists {
                    return Err(StoreError::NotFound(o.key.clone()));
                }
                o.set_removed();
            }
            Op::SetXattr(name, value) => {
                o.blind &= o.xattrs_cleared;
                if !o.exists {
                    return Err(StoreError::NotFound(o.key.clone()));
                }
                if name.len() > XATTR_NAME_BYTES_MAX {
                    return Err(StoreError::TooLarge {
                        what: "xattr name",
                        size: name.len() as u64,
                        max: XATTR_NAME_BYTES_MAX as u64,
                    });
                }
                self.xattrs_mut(o)?.insert(name.clone(), value.to_vec());
            }
            Op::RmXattr(name) => {
                o.blind &= o.xattrs_cleared;
                if !o.exists {
                    return Err(StoreError::NotFound(o.key.clone()));
                }
                if self.xattrs_mut(o)?.remove(name).is_none() {
                    return Err(StoreError::NoXattr {
                        key: o.key.clone(),
                        name: name.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    fn finish(&self, o: Obj) -> Result<Option<Mut>> {
        debug_assert!(o.blind || o.loaded, "an op that read the state loaded it");
        let base = if o.blind {
            Base::Any
        } else {
            match &o.cur {
                Some(m) => Base::Seq(m.state_seq),
                None => Base::Absent,
            }
        };
        let op = if !o.exists {
            if !o.removed {
                return Ok(None); // only asserts on an absent object
            }
            MutOp::Remove
        } else {
            if !o.dirty && o.cur.is_some() {
                return Ok(None); // only asserts: nothing to write
            }
            let xattrs = match (o.xattrs, o.xattrs_cleared) {
                (Some(map), _) => {
                    let bytes = encode_xattrs(&map);
                    if bytes.len() > XATTR_BYTES_MAX {
                        return Err(StoreError::TooLarge {
                            what: "xattrs of one object",
                            size: bytes.len() as u64,
                            max: XATTR_BYTES_MAX as u64,
                        });
                    }
                    if map.is_empty() {
                        XattrSrc::None
                    } else {
                        XattrSrc::New(bytes)
                    }
                }
                (None, true) => XattrSrc::None,
                (None, false) => match (o.xattr_src, &o.cur, base) {
                    // Renamed here: the renamed object's stored map.
                    (Some(r), ..) if r.len.get() > 0 => XattrSrc::Keep(r),
                    (Some(_), ..) => XattrSrc::None,
                    (None, _, Base::Any) => XattrSrc::Current,
                    (None, Some(m), _) => XattrSrc::Keep(m.xattrs),
                    (None, None, _) => XattrSrc::None,
                },
            };
            let cb = self.chunk_bytes;
            let size = o.size;
            let mut object_crc = 0u32;
            let lent = o
                .chunks
                .iter()
                .filter(|c| matches!(c, Chunk::Lent(_)))
                .count() as u64;
            let dma = lent * cb >= DMA_COPY_BYTES_MIN;
            // Whole chunks of big writes are copied into DMA memory here, on the caller's
            // thread, so the commit thread only submits them. Consecutive whole chunks share
            // one buffer (up to the device's largest transfer), so they go out as one write:
            // the first chunk's `DataRef::Dma` holds it, the others are `DmaPart`s. The copy
            // overwrites every byte, so a recycled buffer is not zeroed.
            let run_max = (self.dev.geometry().max_transfer_bytes as u64 / cb).max(1) as usize;
            let whole: Vec<bool> = o
                .chunks
                .iter()
                .map(|c| {
                    dma && matches!(c, Chunk::Lent(l) if crate::commit::lent_len(l) as u64 == cb)
                })
                .collect();
            // CRCs the caller gave with the replace that made the content (one per chunk).
            let known = o.known_crcs.as_deref();
            let mut chunks: Vec<ChunkSrc> = Vec::with_capacity(o.chunks.len());
            // The open run: (index of its first chunk, chunks it holds, chunks filled).
            let mut run: Option<(usize, usize, usize)> = None;
            for (i, c) in o.chunks.into_iter().enumerate() {
                let logical = cb.min(size - i as u64 * cb);
                let (src, crc) = match c {
                    Chunk::Keep(r) if r.len.get() == 0 => (ChunkSrc::Hole, None),
                    Chunk::Keep(r) => (ChunkSrc::Keep(r), Some(r.crc.get())),
                    Chunk::Hole => (ChunkSrc::Hole, None),
                    Chunk::Lent(l) => {
                        let bytes = crate::commit::lent_bytes(&l);
                        let crc = known.map_or_else(|| crate::data_crc(bytes), |k| k[i]);
                        if run.is_some_and(|(_, n, filled)| filled == n) {
                            run = None;
                        }
                        let src = match &mut run {
                            Some((head, _, filled)) if whole[i] => {
                                let ChunkSrc::New(DataRef::Dma { buf: Some(buf), .. }, _) =
                                    &mut chunks[*head]
                                else {
                                    unreachable!("a run starts with its buffer")
                                };
                                buf.write_at_streaming(*filled * cb as usize, bytes);
                                *filled += 1;
                                DataRef::DmaPart(bytes.len())
                            }
                            _ if whole[i] => {
                                let n = whole[i..].iter().take_while(|w| **w).count().min(run_max);
                                match self.dev.alloc_read_buf(n * cb as usize) {
                                    Ok(mut buf) => {
                                        buf.write_at_streaming(0, bytes);
                                        run = Some((i, n, 1));
                                        DataRef::Dma {
                                            buf: Some(buf),
                                            len: bytes.len(),
                                            run: n,
                                        }
                                    }
                                    Err(_) => DataRef::Lent(l),
                                }
                            }
                            _ => DataRef::Lent(l),
                        };
                        (ChunkSrc::New(src, crc), Some(crc))
                    }
                    Chunk::Owned(v) => {
                        let crc = known.map_or_else(|| crate::data_crc(&v), |k| k[i]);
                        (ChunkSrc::New(DataRef::Owned(v), crc), Some(crc))
                    }
                };
                if !matches!(
                    src,
                    ChunkSrc::New(DataRef::Dma { .. } | DataRef::DmaPart(_), _)
                ) {
                    run = None;
                }
                let part = crc.unwrap_or_else(|| zeros_crc(logical));
                object_crc = crc32c::crc32c_append(object_crc, &part.to_le_bytes());
                chunks.push(src);
            }
            // The object checksum: `meta::chunk_digest` of the chunk CRCs.
            let data_crc = object_crc;
            MutOp::Put(PutState {
                size: o.size,
                data_crc,
                chunks,
                xattrs,
                relocation: false,
            })
        };
        Ok(Some(Mut {
            key: o.key,
            base,
            op,
        }))
    }

    /// Prepare a rename of `objs[from]` to `objs[to]`: the partner takes the state the index
    /// holds for `from` (its chunks and xattr map, by reference), `from` is removed.
    fn rename_into(
        &self,
        objs: &mut [Obj],
        from: usize,
        to: usize,
        seen: &mut Vec<(ObjectKey, Option<u64>)>,
    ) -> Result<()> {
        let (fk, tk) = (&objs[from].key, &objs[to].key);
        let partners = self
            .config
            .alias
            .is_some_and(|alias| alias(fk).as_ref() == Some(tk) && alias(tk).as_ref() == Some(fk));
        if from == to || !partners {
            return Err(StoreError::Invalid(format!(
                "rename of {fk} to {tk}: an object moves only to its partner key \
                 (StoreConfig::alias)"
            )));
        }
        let o = &mut objs[from];
        if o.dirty {
            return Err(StoreError::Invalid(format!(
                "rename of {}: the object changed earlier in the same transaction",
                o.key
            )));
        }
        self.load(o, seen);
        if !o.exists {
            return Err(StoreError::NotFound(o.key.clone()));
        }
        let m = o
            .cur
            .clone()
            .expect("a loaded object that exists has a state");
        o.blind = false;
        o.dirty = true;
        o.known_crcs = None;
        o.set_removed();
        let t = &mut objs[to];
        t.dirty = true;
        t.exists = true;
        t.size = m.size;
        t.chunks = m.chunks.iter().map(|r| Chunk::Keep(*r)).collect();
        t.xattrs = None;
        t.xattrs_cleared = false;
        t.xattr_src = Some(m.xattrs);
        t.known_crcs = None;
        Ok(())
    }

    /// Whether any object changed state since `prepare` looked at it.
    fn any_moved(&self, seen: &[(ObjectKey, Option<u64>)]) -> bool {
        seen.iter()
            .any(|(k, was)| self.index_get(k).map(|m| m.state_seq) != *was)
    }

    /// Build the commit-thread form of a transaction; `seen` records the state of each object
    /// it looked at.
    fn prepare(
        &self,
        ops: &[(ObjectKey, Op<'_>)],
        seen: &mut Vec<(ObjectKey, Option<u64>)>,
    ) -> Result<Prepared> {
        let mut objs: Vec<Obj> = Vec::new();
        for (key, op) in ops {
            key.check()?;
            let mut at = |key: &ObjectKey| match objs.iter().position(|o| &o.key == key) {
                Some(i) => i,
                None => {
                    objs.push(self.new_obj(key));
                    objs.len() - 1
                }
            };
            let i = at(key);
            if let Op::RenameTo(to) = op {
                to.check()?;
                let j = at(to);
                self.rename_into(&mut objs, i, j, seen)?;
                continue;
            }
            self.apply_op(&mut objs[i], op, seen)?;
        }
        let mut muts = Vec::new();
        for o in objs {
            if let Some(m) = self.finish(o)? {
                muts.push(m);
            }
        }
        Ok(Prepared {
            muts,
            background: false,
            room: crate::commit::Room::Normal,
            moves_from: None,
            parked_at: None,
        })
    }
}

fn check_size(n: u64) -> Result<()> {
    if n > OBJECT_BYTES_MAX {
        return Err(StoreError::TooLarge {
            what: "object",
            size: n,
            max: OBJECT_BYTES_MAX,
        });
    }
    Ok(())
}

impl<D: BlockDevice + 'static> Store<D> {
    /// Apply a transaction atomically; returns once it is durable, with the new version of
    /// every object it changed. Validation errors (missing object, version mismatch, limits)
    /// leave the store untouched.
    pub fn commit(&self, txn: Transaction<'_>) -> Result<u64> {
        let tx = self.user_tx.as_ref().ok_or(StoreError::Closed)?;
        for _ in 0..CONFLICT_RETRIES_MAX {
            let mut seen = Vec::new();
            let mut prepared = match self.sh.prepare(&txn.ops, &mut seen) {
                Err(StoreError::Corrupted { .. }) if self.sh.any_moved(&seen) => {
                    // A read for the preparation raced with the cleaner moving the object.
                    self.sh.stats.txn_conflicts.inc();
                    continue;
                }
                other => other?,
            };
            prepared.room = txn.room;
            if prepared.muts.is_empty() {
                return Ok(self.sh.stats.next_op_seq.get().saturating_sub(1));
            }
            let (rtx, rrx) = crate::commit::reply_pair();
            let yield_for = crate::commit::wait_yield(&prepared);
            tx.send(Msg::Txn(Box::new(prepared), rtx))
                .map_err(|_| StoreError::Closed)?;
            // The commit thread reads `txn`'s data until it replies: this wait is unconditional.
            match rrx
                .recv_yielding(yield_for)
                .map_err(|_| StoreError::Closed)?
            {
                TxnResult::Committed { version } => return Ok(version),
                TxnResult::Conflict => self.sh.stats.txn_conflicts.inc(),
                TxnResult::Failed(e) => return Err(e),
            }
        }
        Err(StoreError::Invalid(format!(
            "transaction lost {CONFLICT_RETRIES_MAX} races in a row against concurrent writers"
        )))
    }

    /// [`Store::commit`] without waiting: `done` runs on the commit thread once the transaction
    /// is durable or has failed, and must be quick (it holds up the next round). The new data
    /// is copied (this is meant for small writes), so `txn` may be dropped at once.
    /// [`AsyncCommit::Raced`] means an object changed between preparation and commit: nothing
    /// was applied; commit again. An error returned here (validation, a closed store) means
    /// `done` was not called and will not be; otherwise it is called exactly once.
    pub fn commit_async(
        &self,
        txn: Transaction<'_>,
        done: Box<dyn FnOnce(AsyncCommit) + Send>,
    ) -> Result<()> {
        let tx = self.user_tx.as_ref().ok_or(StoreError::Closed)?;
        let mut tries = 0;
        let mut prepared = loop {
            let mut seen = Vec::new();
            match self.sh.prepare(&txn.ops, &mut seen) {
                // A read for the preparation raced with the cleaner moving the object.
                Err(StoreError::Corrupted { .. })
                    if tries < CONFLICT_RETRIES_MAX && self.sh.any_moved(&seen) =>
                {
                    self.sh.stats.txn_conflicts.inc();
                    tries += 1;
                }
                other => break other?,
            }
        };
        prepared.room = txn.room;
        if prepared.muts.is_empty() {
            done(AsyncCommit::Durable(
                self.sh.stats.next_op_seq.get().saturating_sub(1),
            ));
            return Ok(());
        }
        // No Lent may outlive this call: copy the borrowed bytes.
        for m in &mut prepared.muts {
            if let MutOp::Put(p) = &mut m.op {
                for c in &mut p.chunks {
                    if let ChunkSrc::New(d @ DataRef::Lent(_), _) = c {
                        *d = DataRef::Owned(d.bytes().to_vec());
                    }
                }
            }
        }
        let sh = self.sh.clone();
        let reply = crate::commit::reply_call(Box::new(move |r| {
            done(match r {
                Some(TxnResult::Committed { version }) => AsyncCommit::Durable(version),
                Some(TxnResult::Conflict) => {
                    sh.stats.txn_conflicts.inc();
                    AsyncCommit::Raced
                }
                Some(TxnResult::Failed(e)) => AsyncCommit::Failed(e),
                None => AsyncCommit::Failed(StoreError::Closed),
            })
        }));
        // A send fails only once the commit thread has gone; the reply then drops with the
        // message and calls `done` with `Failed(Closed)`.
        let _ = tx.send(Msg::Txn(Box::new(prepared), reply));
        Ok(())
    }

    pub fn write_full(&self, key: &ObjectKey, data: &[u8]) -> Result<u64> {
        let mut t = Transaction::new();
        t.write_full(key.clone(), data);
        self.commit(t)
    }

    pub fn write(&self, key: &ObjectKey, offset: u64, data: &[u8]) -> Result<u64> {
        let mut t = Transaction::new();
        t.write(key.clone(), offset, data);
        self.commit(t)
    }

    pub fn append(&self, key: &ObjectKey, data: &[u8]) -> Result<u64> {
        let mut t = Transaction::new();
        t.append(key.clone(), data);
        self.commit(t)
    }

    pub fn remove(&self, key: &ObjectKey) -> Result<u64> {
        let mut t = Transaction::new();
        t.remove(key.clone());
        self.commit(t)
    }

    pub fn set_xattr(&self, key: &ObjectKey, name: &str, value: &[u8]) -> Result<u64> {
        let mut t = Transaction::new();
        t.set_xattr(key.clone(), name, value);
        self.commit(t)
    }

    pub fn rm_xattr(&self, key: &ObjectKey, name: &str) -> Result<u64> {
        let mut t = Transaction::new();
        t.rm_xattr(key.clone(), name);
        self.commit(t)
    }
}
