//! Object metadata as the index holds it, and its encoding as records.

use zerocopy::{FromBytes, IntoBytes};

use crate::format::{
    ChunkRef, ObjectStateBody, RecordHeader, RemoveBody, RECORD_MAGIC, RECORD_OBJECT_STATE,
    RECORD_OWNER, RECORD_REMOVE,
};
use crate::key::ObjectKey;

/// An object's chunk refs: held in the state itself for a one-chunk object (every object up
/// to the chunk size), so it costs no allocation of its own and a read follows one pointer
/// fewer. With glibc's malloc that is 16 bytes less per such object: the state grows from
/// 72 to 80 bytes (its `Arc` allocation from a 96- to a 112-byte chunk) and the boxed list's
/// 32-byte chunk goes.
pub type Chunks = smallvec::SmallVec<[ChunkRef; 1]>;

/// The complete state of one object. Immutable once published in the index (shared by `Arc`):
/// a change publishes a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// User-visible version: the op sequence of the last mutation.
    pub version: u64,
    /// Op sequence of the record that produced this state (a relocation changes it, not the
    /// version). Replay applies a record only when its sequence is newer than this.
    pub state_seq: u64,
    pub size: u64,
    pub mtime_unix_ns: u64,
    /// CRC32C of the whole content.
    pub data_crc: u32,
    /// Chunk `i` holds bytes `i*chunk_bytes..`; a zero-length ref is a hole.
    pub chunks: Chunks,
    /// The serialized xattr map, or a zero-length ref.
    pub xattrs: ChunkRef,
}

/// The object checksum `stat` reports: CRC32C over the little-endian CRC32C of each chunk in
/// order (a hole counts as the CRC of its zero bytes). Cheap to maintain — no pass over the
/// data beyond the per-chunk CRCs every write computes anyway.
pub fn chunk_digest(chunk_crcs: impl IntoIterator<Item = u32>) -> u32 {
    chunk_crcs
        .into_iter()
        .fold(0, |acc, c| crc32c::crc32c_append(acc, &c.to_le_bytes()))
}

/// The checksum `stat` reports for `data` stored with `chunk_bytes` chunks.
pub fn content_checksum(data: &[u8], chunk_bytes: usize) -> u32 {
    chunk_digest(data.chunks(chunk_bytes).map(crate::data_crc))
}

impl ObjectMeta {
    /// Bytes the index spends on this entry's heap parts (for the index-bytes-per-object report).
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + if self.chunks.spilled() {
                std::mem::size_of_val(&*self.chunks)
            } else {
                0
            }
    }
}

/// A decoded record.
#[derive(Debug)]
pub enum Record {
    State {
        key: ObjectKey,
        meta: ObjectMeta,
    },
    Remove {
        key: ObjectKey,
        seq: u64,
        version: u64,
    },
    /// The batch's data area holds these chunks of this object: a segment summary entry (the
    /// cleaner finds objects by it) and the per-item checksums replay verifies the data by.
    Owner {
        key: ObjectKey,
        items: Vec<ChunkRef>,
    },
}

const HDR: usize = std::mem::size_of::<RecordHeader>();

/// Encoded size of an object-state record.
pub fn state_record_len(name_len: usize, chunks: usize) -> usize {
    HDR + 8 + name_len + std::mem::size_of::<ObjectStateBody>() + chunks * 16
}

/// Encoded size of an owner record listing `items` data items.
pub fn owner_record_len(name_len: usize, items: usize) -> usize {
    HDR + 8 + name_len + 4 + 16 * items
}

/// Encoded size of a remove record.
pub fn remove_record_len(name_len: usize) -> usize {
    HDR + 8 + name_len + std::mem::size_of::<RemoveBody>()
}

fn header(key: &ObjectKey, kind: u8, seq: u64, payload_len: usize) -> RecordHeader {
    RecordHeader {
        magic: RECORD_MAGIC.into(),
        kind,
        flags: 0,
        shard: key.shard,
        reserved: 0,
        name_len: (key.name.len() as u16).into(),
        key_hash: key.hash32().into(),
        payload_len: (payload_len as u32).into(),
        seq: seq.into(),
        reserved2: 0.into(),
        crc: 0.into(),
    }
}

/// Append the header and payload, then patch the crc over both.
fn finish(out: &mut [u8], start: usize) {
    let crc = crc32c::crc32c(&out[start..]);
    out[start + HDR - 4..start + HDR].copy_from_slice(&crc.to_le_bytes());
}

pub fn encode_state(key: &ObjectKey, m: &ObjectMeta, out: &mut Vec<u8>) {
    let start = out.len();
    let payload = state_record_len(key.name.len(), m.chunks.len()) - HDR;
    out.extend_from_slice(header(key, RECORD_OBJECT_STATE, m.state_seq, payload).as_bytes());
    out.extend_from_slice(&key.pool.to_le_bytes());
    out.extend_from_slice(&key.name);
    let body = ObjectStateBody {
        version: m.version.into(),
        size: m.size.into(),
        mtime_unix_ns: m.mtime_unix_ns.into(),
        data_crc: m.data_crc.into(),
        chunk_count: (m.chunks.len() as u32).into(),
        xattrs: m.xattrs,
    };
    out.extend_from_slice(body.as_bytes());
    out.extend_from_slice(m.chunks.as_bytes());
    finish(out, start);
}

pub fn encode_owner(key: &ObjectKey, seq: u64, items: &[ChunkRef], out: &mut Vec<u8>) {
    let start = out.len();
    let payload = owner_record_len(key.name.len(), items.len()) - HDR;
    out.extend_from_slice(header(key, RECORD_OWNER, seq, payload).as_bytes());
    out.extend_from_slice(&key.pool.to_le_bytes());
    out.extend_from_slice(&key.name);
    out.extend_from_slice(&(items.len() as u32).to_le_bytes());
    out.extend_from_slice(items.as_bytes());
    finish(out, start);
}

pub fn encode_remove(key: &ObjectKey, seq: u64, version: u64, out: &mut Vec<u8>) {
    let start = out.len();
    let payload = remove_record_len(key.name.len()) - HDR;
    out.extend_from_slice(header(key, RECORD_REMOVE, seq, payload).as_bytes());
    out.extend_from_slice(&key.pool.to_le_bytes());
    out.extend_from_slice(&key.name);
    out.extend_from_slice(
        RemoveBody {
            version: version.into(),
        }
        .as_bytes(),
    );
    finish(out, start);
}

/// Decode every record of a meta area. The batch's meta crc already vouched for the bytes, so
/// a malformed record here means a format bug or a crc collision: reported, never guessed at.
pub fn decode_records(mut meta: &[u8], count: u32) -> Result<Vec<Record>, String> {
    let mut out = Vec::with_capacity(count as usize);
    for i in 0..count {
        let (h, _) = RecordHeader::read_from_prefix(meta)
            .map_err(|_| format!("record {i}: truncated header"))?;
        if h.magic.get() != RECORD_MAGIC {
            return Err(format!("record {i}: bad magic {:#06x}", h.magic.get()));
        }
        let total = HDR + h.payload_len.get() as usize;
        if total > meta.len() {
            return Err(format!("record {i}: payload runs past the meta area"));
        }
        // The record's CRC covers it with its own crc field as zeros.
        let crc = crc32c::crc32c_append(crc32c::crc32c(&meta[..HDR - 4]), &[0; 4]);
        if crc32c::crc32c_append(crc, &meta[HDR..total]) != h.crc.get() {
            return Err(format!("record {i}: crc mismatch"));
        }
        out.push(decode_one(&h, &meta[HDR..total]).map_err(|e| format!("record {i}: {e}"))?);
        meta = &meta[total..];
    }
    Ok(out)
}

/// Best effort for a batch replay had to skip: the keys named by its records, read from the
/// start of the meta area while each record passes its own CRC (`meta`: the meta length and
/// record count when the batch header was readable), and whether that is all of them (every
/// record the header counts was read). Informational only; never applied.
pub fn salvage_keys(mut bytes: &[u8], meta: Option<(usize, u32)>) -> (Vec<ObjectKey>, bool) {
    let Some((len, count)) = meta else {
        // Without a header the record count is unknown: whatever reads is only a lower bound.
        return (keys_while_readable(bytes, u32::MAX).0, false);
    };
    bytes = &bytes[..len.min(bytes.len())];
    let (keys, read) = keys_while_readable(bytes, count);
    (keys, read == count)
}

/// The distinct keys of the first records that pass their CRC (at most `count` records), and
/// how many records that was.
fn keys_while_readable(mut bytes: &[u8], count: u32) -> (Vec<ObjectKey>, u32) {
    let mut keys: Vec<ObjectKey> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut read = 0;
    while read < count {
        let Ok(recs) = decode_records(bytes, 1) else {
            break;
        };
        let (Record::State { key, .. } | Record::Remove { key, .. } | Record::Owner { key, .. }) =
            recs.into_iter().next().expect("one record");
        let (h, _) = RecordHeader::read_from_prefix(bytes).expect("decoded");
        bytes = &bytes[HDR + h.payload_len.get() as usize..];
        read += 1;
        if seen.insert(key.clone()) {
            keys.push(key);
        }
    }
    (keys, read)
}

fn decode_one(h: &RecordHeader, p: &[u8]) -> Result<Record, String> {
    let name_len = h.name_len.get() as usize;
    if p.len() < 8 + name_len {
        return Err("payload shorter than its key".into());
    }
    let pool = u64::from_le_bytes(p[..8].try_into().unwrap());
    let key = ObjectKey {
        pool,
        name: p[8..8 + name_len].into(),
        shard: h.shard,
    };
    let body = &p[8 + name_len..];
    match h.kind {
        RECORD_OBJECT_STATE => {
            let (b, rest) =
                ObjectStateBody::read_from_prefix(body).map_err(|_| "truncated object state")?;
            let n = b.chunk_count.get() as usize;
            let chunks = <[ChunkRef]>::ref_from_prefix_with_elems(rest, n)
                .map_err(|_| "truncated chunk list")?
                .0;
            Ok(Record::State {
                key,
                meta: ObjectMeta {
                    version: b.version.get(),
                    state_seq: h.seq.get(),
                    size: b.size.get(),
                    mtime_unix_ns: b.mtime_unix_ns.get(),
                    data_crc: b.data_crc.get(),
                    chunks: chunks.into(),
                    xattrs: b.xattrs,
                },
            })
        }
        RECORD_REMOVE => {
            let (b, _) = RemoveBody::read_from_prefix(body).map_err(|_| "truncated remove")?;
            Ok(Record::Remove {
                key,
                seq: h.seq.get(),
                version: b.version.get(),
            })
        }
        RECORD_OWNER => {
            let n = u32::from_le_bytes(
                body.get(..4)
                    .ok_or("truncated owner record")?
                    .try_into()
                    .unwrap(),
            );
            let items = <[ChunkRef]>::ref_from_prefix_with_elems(&body[4..], n as usize)
                .map_err(|_| "truncated owner item list")?
                .0;
            Ok(Record::Owner {
                key,
                items: items.to_vec(),
            })
        }
        k => Err(format!("unknown record kind {k}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_detect_corruption() {
        let key = ObjectKey::new(7, b"obj-name", 3);
        let meta = ObjectMeta {
            version: 11,
            state_seq: 12,
            size: 70_000,
            mtime_unix_ns: 99,
            data_crc: 0xdead_beef,
            chunks: vec![
                ChunkRef {
                    offset: 65536.into(),
                    len: 65536.into(),
                    crc: 1.into(),
                },
                ChunkRef::default(),
            ]
            .into(),
            xattrs: ChunkRef::default(),
        };
        let mut out = Vec::new();
        encode_state(&key, &meta, &mut out);
        assert_eq!(out.len(), state_record_len(8, 2));
        encode_remove(&key, 13, 13, &mut out);
        let recs = decode_records(&out, 2).unwrap();
        match &recs[0] {
            Record::State { key: k, meta: m } => {
                assert_eq!(k, &key);
                assert_eq!(m, &meta);
            }
            r => panic!("{r:?}"),
        }
        assert!(matches!(
            &recs[1],
            Record::Remove {
                seq: 13,
                version: 13,
                ..
            }
        ));
        out[40] ^= 1;
        assert!(decode_records(&out, 2).unwrap_err().contains("crc"));
    }
}
