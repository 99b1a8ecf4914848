//! Client operations: what a client sends a PG's primary, and what comes back
//! (docs/format.md, "Cluster messages").
//!
//! A request names one object and carries a list of sub-ops applied atomically: first the
//! asserts (in order), then the reads (which see the object as it was before this request),
//! then at most one data mutation (write_full, write, append, remove) and any xattr changes,
//! all as one new version. Any failing sub-op fails the whole request and changes nothing.

use crate::error::{Error, Result};
use crate::wire::{Dec, Enc};

/// Longest object name (the store's key limit less room for internal suffixes).
pub const OBJECT_NAME_BYTES_MAX: usize = 1000;
/// Largest object.
pub const OBJECT_BYTES_MAX: u64 = store::OBJECT_BYTES_MAX;
/// Most sub-ops in one request.
pub const SUB_OPS_MAX: usize = 64;
/// Bytes of object data a client puts in one message; larger writes are staged first.
pub const MESSAGE_DATA_BYTES_MAX: usize = 16 << 20;
/// Largest xattr value.
pub const XATTR_VALUE_BYTES_MAX: usize = 16 << 10;

/// Request flag: the data of the request's write is the staged upload `upload_id` followed by
/// the inline data.
pub const FLAG_STAGED: u32 = 1;
/// `SubOp::WriteStaged`'s member list: no shard staged in this slot.
const NO_MEMBER: u32 = u32::MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubOp<'a> {
    AssertVersion(u64),
    AssertExists,
    AssertAbsent,
    Stat,
    Read {
        offset: u64,
        len: u64,
    },
    GetXattr(&'a str),
    GetXattrs,
    WriteFull(&'a [u8]),
    Write {
        offset: u64,
        data: &'a [u8],
    },
    Append(&'a [u8]),
    Remove,
    SetXattr(&'a str, &'a [u8]),
    RmXattr(&'a str),
    /// Replace the object with `size` bytes the client erasure coded itself and staged, shard
    /// s on `members[s]` (`MSG_CLIENT_STAGE_SHARD`, upload `ClientOp::upload_id`); `None`
    /// where it staged nothing (no member, or down in its map). The primary refuses it when
    /// its acting set differs (`StaleEpoch`: stage again on the new one).
    WriteStaged {
        size: u64,
        members: Vec<Option<u32>>,
    },
}

impl SubOp<'_> {
    fn code(&self) -> u8 {
        match self {
            SubOp::AssertVersion(_) => 1,
            SubOp::AssertExists => 2,
            SubOp::AssertAbsent => 3,
            SubOp::Stat => 4,
            SubOp::Read { .. } => 5,
            SubOp::GetXattr(_) => 6,
            SubOp::GetXattrs => 7,
            SubOp::WriteFull(_) => 8,
            SubOp::Write { .. } => 9,
            SubOp::Append(_) => 10,
            SubOp::Remove => 11,
            SubOp::SetXattr(..) => 12,
            SubOp::RmXattr(_) => 13,
            SubOp::WriteStaged { .. } => 14,
        }
    }

    pub fn is_data_mutation(&self) -> bool {
        matches!(
            self,
            SubOp::WriteFull(_)
                | SubOp::Write { .. }
                | SubOp::Append(_)
                | SubOp::Remove
                | SubOp::WriteStaged { .. }
        )
    }

    pub fn is_mutation(&self) -> bool {
        self.is_data_mutation() || matches!(self, SubOp::SetXattr(..) | SubOp::RmXattr(_))
    }

    pub fn is_read(&self) -> bool {
        matches!(
            self,
            SubOp::Stat | SubOp::Read { .. } | SubOp::GetXattr(_) | SubOp::GetXattrs
        )
    }
}

/// A decoded (or to-be-encoded) client request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOp<'a> {
    pub epoch: u64,
    pub pool: u64,
    pub name: &'a [u8],
    pub flags: u32,
    pub upload_id: u64,
    /// The client's id for this request, the same on every resend of it (0: none). A
    /// primary remembers the versions its recent mutations made per PG by (client, reqid),
    /// and answers a resend of one it already applied with that version instead of applying
    /// it again (`node::primary`, like Ceph's reqid in the PG log); a primary after it knows
    /// the object's last 8 from its shards (`node::local::ReqHistory`).
    pub reqid: u64,
    pub ops: Vec<SubOp<'a>>,
}

impl<'a> ClientOp<'a> {
    pub fn encode(&self) -> Vec<u8> {
        let (mut head, tail) = self.encode_head();
        head.extend_from_slice(tail);
        head
    }

    /// The request as [`ClientOp::encode`] writes it, less the bytes of the last sub-op's data
    /// (its length is written): `encode` = head ‖ tail. A caller that owns the data in a
    /// shared buffer sends it as the frame's next part, so a large put is not copied.
    pub fn encode_head(&self) -> (Vec<u8>, &'a [u8]) {
        let mut e = Enc::new(self.epoch);
        e.u64(self.pool)
            .bytes(self.name)
            .u32(self.flags)
            .u64(self.upload_id)
            .u64(self.reqid)
            .u16(self.ops.len() as u16);
        let mut tail: &'a [u8] = &[];
        for (i, op) in self.ops.iter().enumerate() {
            e.u8(op.code());
            // Length-prefixed bytes; the last sub-op's are left to the caller.
            let mut bytes = |e: &mut Enc, b: &'a [u8]| {
                e.u32(b.len() as u32);
                if i + 1 == self.ops.len() {
                    tail = b;
                } else {
                    e.0.extend_from_slice(b);
                }
            };
            match *op {
                SubOp::AssertVersion(v) => {
                    e.u64(v);
                }
                SubOp::WriteStaged { size, ref members } => {
                    e.u64(size).u8(members.len() as u8);
                    for m in members {
                        e.u32(m.unwrap_or(NO_MEMBER));
                    }
                }
                SubOp::Read { offset, len } => {
                    e.u64(offset).u64(len);
                }
                SubOp::GetXattr(n) | SubOp::RmXattr(n) => {
                    e.str(n);
                }
                SubOp::WriteFull(d) | SubOp::Append(d) => bytes(&mut e, d),
                SubOp::Write { offset, data } => {
                    e.u64(offset);
                    bytes(&mut e, data);
                }
                SubOp::SetXattr(n, v) => {
                    e.str(n);
                    bytes(&mut e, v);
                }
                SubOp::AssertExists
                | SubOp::AssertAbsent
                | SubOp::Stat
                | SubOp::GetXattrs
                | SubOp::Remove => {}
            }
        }
        (e.finish(), tail)
    }

    pub fn decode(b: &'a [u8]) -> Result<ClientOp<'a>> {
        let mut d = Dec::new(b);
        let epoch = d.u64()?;
        let pool = d.u64()?;
        let name = d.bytes()?;
        let flags = d.u32()?;
        let upload_id = d.u64()?;
        let reqid = d.u64()?;
        let n = d.u16()? as usize;
        if n > SUB_OPS_MAX {
            return Err(Error::Malformed(format!(
                "{n} sub-ops; at most {SUB_OPS_MAX}"
            )));
        }
        let mut ops = Vec::with_capacity(n);
        for _ in 0..n {
            let code = d.u8()?;
            ops.push(match code {
                1 => SubOp::AssertVersion(d.u64()?),
                2 => SubOp::AssertExists,
                3 => SubOp::AssertAbsent,
                4 => SubOp::Stat,
                5 => SubOp::Read {
                    offset: d.u64()?,
                    len: d.u64()?,
                },
                6 => SubOp::GetXattr(d.str()?),
                7 => SubOp::GetXattrs,
                8 => SubOp::WriteFull(d.bytes()?),
                9 => SubOp::Write {
                    offset: d.u64()?,
                    data: d.bytes()?,
                },
                10 => SubOp::Append(d.bytes()?),
                11 => SubOp::Remove,
                12 => SubOp::SetXattr(d.str()?, d.bytes()?),
                13 => SubOp::RmXattr(d.str()?),
                14 => {
                    let size = d.u64()?;
                    let n = d.u8()? as usize;
                    let members = (0..n)
                        .map(|_| Ok(Some(d.u32()?).filter(|&m| m != NO_MEMBER)))
                        .collect::<Result<Vec<_>>>()?;
                    SubOp::WriteStaged { size, members }
                }
                c => return Err(Error::Malformed(format!("unknown sub-op code {c}"))),
            });
        }
        d.end()?;
        Ok(ClientOp {
            epoch,
            pool,
            name,
            flags,
            upload_id,
            reqid,
            ops,
        })
    }
}

/// What `stat` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjStat {
    pub size: u64,
    pub version: u64,
    pub mtime_unix_ns: u64,
}

/// Bytes a read returned: owned (built on this side), or a view into the received reply
/// (the client's decode: no copy out of the messenger's buffer, like a librados bufferlist).
#[derive(Clone)]
pub enum ReadData {
    Owned(Vec<u8>),
    Received(messenger::Payload),
}

impl ReadData {
    /// The bytes as a vector (moved when owned, copied out of a received reply).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            ReadData::Owned(v) => v,
            ReadData::Received(p) => p.to_vec(),
        }
    }
}

impl std::ops::Deref for ReadData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ReadData::Owned(v) => v,
            ReadData::Received(p) => p,
        }
    }
}

impl AsRef<[u8]> for ReadData {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl From<Vec<u8>> for ReadData {
    fn from(v: Vec<u8>) -> ReadData {
        ReadData::Owned(v)
    }
}

impl PartialEq for ReadData {
    fn eq(&self, other: &ReadData) -> bool {
        **self == **other
    }
}
impl Eq for ReadData {}

impl std::fmt::Debug for ReadData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReadData({} bytes)", self.len())
    }
}

impl From<ReadData> for messenger::SendBuf {
    fn from(d: ReadData) -> messenger::SendBuf {
        match d {
            ReadData::Owned(v) => messenger::SendBuf::Vec(v),
            ReadData::Received(p) => messenger::SendBuf::Payload(p),
        }
    }
}

/// One read sub-op's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpResult {
    Stat(ObjStat),
    Data(ReadData),
    Xattr(Vec<u8>),
    Xattrs(Vec<(String, Vec<u8>)>),
}

/// The body of a successful reply: the object's version after the request, then one result
/// per read sub-op, in order.
pub fn encode_results(e: &mut Enc, version: u64, results: &[OpResult]) {
    e.u64(version).u16(results.len() as u16);
    for r in results {
        encode_result(e, r);
    }
}

pub fn encode_result(e: &mut Enc, r: &OpResult) {
    match r {
        OpResult::Stat(s) => {
            e.u8(4).u64(s.size).u64(s.version).u64(s.mtime_unix_ns);
        }
        OpResult::Data(d) => {
            e.u8(5).bytes(d);
        }
        OpResult::Xattr(v) => {
            e.u8(6).bytes(v);
        }
        OpResult::Xattrs(list) => {
            e.u8(7).u32(list.len() as u32);
            for (k, v) in list {
                e.str(k).bytes(v);
            }
        }
    }
}

/// [`encode_results`] after the bytes already in `e`, with read data as buffers of their own
/// (sent without a copy). The bytes on the wire are the same.
pub fn encode_results_parts(
    mut e: Enc,
    version: u64,
    results: Vec<OpResult>,
) -> Vec<messenger::SendBuf> {
    let mut parts = Vec::new();
    e.u64(version).u16(results.len() as u16);
    for r in results {
        match r {
            OpResult::Data(d) => {
                e.u8(5).u32(d.len() as u32);
                parts.push(messenger::SendBuf::Vec(std::mem::take(&mut e.0)));
                parts.push(d.into());
            }
            other => encode_result(&mut e, &other),
        }
    }
    parts.push(messenger::SendBuf::Vec(e.0));
    parts.retain(|p| !p.is_empty());
    parts
}

/// Decode a reply body; read data is copied out.
pub fn decode_results(b: &[u8]) -> Result<(u64, Vec<OpResult>)> {
    decode_results_in(None, b)
}

/// Decode a reply body `b` borrowed from `payload`; read data points into `payload` (no copy).
pub fn decode_results_shared(
    payload: &messenger::Payload,
    b: &[u8],
) -> Result<(u64, Vec<OpResult>)> {
    decode_results_in(Some(payload), b)
}

fn decode_results_in(
    payload: Option<&messenger::Payload>,
    b: &[u8],
) -> Result<(u64, Vec<OpResult>)> {
    let mut d = Dec::new(b);
    let version = d.u64()?;
    let n = d.u16()? as usize;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(match d.u8()? {
            4 => OpResult::Stat(ObjStat {
                size: d.u64()?,
                version: d.u64()?,
                mtime_unix_ns: d.u64()?,
            }),
            5 => {
                let bytes = d.bytes()?;
                OpResult::Data(match payload {
                    Some(p) => ReadData::Received(p.slice_ref(bytes)),
                    None => ReadData::Owned(bytes.to_vec()),
                })
            }
            6 => OpResult::Xattr(d.bytes()?.to_vec()),
            7 => {
                let n = d.u32()? as usize;
                let mut l = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    l.push((d.str()?.to_string(), d.bytes()?.to_vec()));
                }
                OpResult::Xattrs(l)
            }
            c => return Err(Error::Malformed(format!("unknown result code {c}"))),
        });
    }
    Ok((version, out))
}

/// Check an object name: 1..=OBJECT_NAME_BYTES_MAX bytes, not starting with a NUL (internal
/// keys do).
pub fn check_name(name: &[u8]) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("object name is empty".into());
    }
    if name.len() > OBJECT_NAME_BYTES_MAX {
        return Err(format!(
            "object name is {} bytes; the maximum is {OBJECT_NAME_BYTES_MAX}",
            name.len()
        ));
    }
    if name[0] == 0 {
        return Err("object names may not start with a NUL byte".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_op_round_trip() {
        let op = ClientOp {
            epoch: 9,
            pool: 2,
            name: b"obj",
            flags: FLAG_STAGED,
            upload_id: 77,
            reqid: 0x1234_5678_9abc,
            ops: vec![
                SubOp::AssertVersion(5),
                SubOp::Stat,
                SubOp::Read { offset: 1, len: 2 },
                SubOp::GetXattr("a"),
                SubOp::Write {
                    offset: 3,
                    data: b"xyz",
                },
                SubOp::SetXattr("k", b"v"),
                SubOp::Remove,
                SubOp::WriteStaged {
                    size: 4 << 20,
                    members: vec![Some(3), None, Some(0), Some(u32::MAX - 1)],
                },
            ],
        };
        let b = op.encode();
        assert_eq!(ClientOp::decode(&b).unwrap(), op);
        for cut in 0..b.len() {
            assert!(ClientOp::decode(&b[..cut]).is_err(), "cut {cut}");
        }
        let mut e = Enc::default();
        let rs = vec![
            OpResult::Stat(ObjStat {
                size: 1,
                version: 2,
                mtime_unix_ns: 3,
            }),
            OpResult::Data(vec![1, 2].into()),
            OpResult::Xattrs(vec![("a".into(), vec![9])]),
        ];
        encode_results(&mut e, 42, &rs);
        assert_eq!(decode_results(&e.0).unwrap(), (42, rs.clone()));
        let parts = encode_results_parts(Enc::default(), 42, rs);
        let joined = messenger::SendBuf::concat(&parts);
        assert_eq!(joined, e.0, "the zero-copy form is the same bytes");
        assert!(check_name(&[0, 1]).is_err());
        assert!(check_name(&vec![b'a'; 1001]).unwrap_err().contains("1001"));
    }

    /// The head leaves out exactly the last sub-op's bytes: head ‖ tail is the request.
    #[test]
    fn encode_head_leaves_out_only_the_last_data() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
        let lasts = [
            (SubOp::WriteFull(&data), data.len()),
            (SubOp::Append(&data[..7]), 7),
            (
                SubOp::Write {
                    offset: 4096,
                    data: &data[1..],
                },
                data.len() - 1,
            ),
            (SubOp::SetXattr("user.k", b"value"), 5),
            (SubOp::Stat, 0),
            (SubOp::WriteFull(&[]), 0),
        ];
        for (last, tail_len) in lasts {
            let op = ClientOp {
                epoch: 3,
                pool: 1,
                name: b"obj",
                flags: 0,
                upload_id: 0,
                reqid: 5,
                // An earlier data sub-op keeps its bytes in the head.
                ops: vec![SubOp::Append(b"early"), last],
            };
            let (head, tail) = op.encode_head();
            assert_eq!(tail.len(), tail_len, "{:?}", op.ops[1]);
            assert_eq!([head.as_slice(), tail].concat(), op.encode());
            assert_eq!(ClientOp::decode(&op.encode()).unwrap(), op);
        }
    }
}
