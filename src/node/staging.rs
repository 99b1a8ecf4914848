//! Shards a client erasure coded itself, staged on the members that store them until the
//! primary's `MSG_SHARD_WRITE_STAGED` names them (client-side EC of whole-object writes).
//!
//! A client writing a whole large object encodes it with the pool's codec and sends shard s
//! straight to member s (`MSG_CLIENT_STAGE_SHARD`), then the op to the primary, which keeps
//! everything it does for any write — the PG's order, the version, the log, the interval
//! checks and rollback records — but sends each member a reference to its staged shard
//! instead of the bytes. The object's bytes cross the network once as shards (4/3 of the
//! object for 6+2) instead of once whole to the primary and again as shards (4/3 + 1).
//!
//! A staged shard is kept as the received payload (no copy) with its chunk CRCs, which the
//! client listed and which are checked against the frame's CRC here, so the store records
//! them without summing the bytes again. It lives until a write takes it, for at most
//! [`STAGED_SHARD_TTL`], and one client may hold at most [`STAGED_BYTES_MAX`] per node: a
//! client past that gets `TooLarge` and sends its data to the primary instead. A write that
//! names a shard this node does not hold fails that member with `NotStaged`; the primary
//! fails the write at once and the client sends the data through the primary.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use messenger::{Identity, Incoming, Payload};

use super::local::{crcs_describe, ReqId, StagedRef};
use crate::error::{Error, Result};
use crate::wire::{Dec, Status};

/// A staged shard no write took within this long is dropped (a client that died between
/// staging and its op, or a write that failed before reaching this member).
pub const STAGED_SHARD_TTL: Duration = Duration::from_secs(30);
/// Bytes of staged shards one client may hold on one node.
pub const STAGED_BYTES_MAX: usize = 256 << 20;
/// How long a write waits for a shard it names to arrive: the client sends the op right
/// after its stages, not after their replies, so the primary's write can overtake a stage.
pub const STAGED_SHARD_WAIT: Duration = Duration::from_secs(2);

/// One staged shard: its bytes where they lie in the received message.
pub struct StagedShard {
    pub data: Payload,
    /// (length, CRC-32C) of consecutive pieces tiling `data`, checked against the frame's
    /// CRC; empty when the client listed none (or a list that did not add up).
    pub crcs: Vec<(u32, u32)>,
    pool: u64,
    pg: u32,
    at: Instant,
}

#[derive(Default)]
pub struct Staging {
    shards: Mutex<HashMap<(ReqId, u8), StagedShard>>,
    /// Notified when a shard is staged (a write may be waiting for it).
    arrived: Condvar,
    /// Shards staged, taken by a write, dropped unused (TTL), and writes that named a shard
    /// that was not here.
    pub staged: AtomicU64,
    pub taken: AtomicU64,
    pub expired: AtomicU64,
    pub missing: AtomicU64,
    pub bytes: AtomicU64,
    /// Writes that named a shard before it arrived, and waited for it.
    pub waits: AtomicU64,
}

impl Staging {
    /// `MSG_CLIENT_STAGE_SHARD`: epoch u64, upload u64, pool u64, pg u32, slot u8, the shard's
    /// bytes (u32 length first), then its pieces' CRCs (u32 count, count × (length u32,
    /// crc32c u32)). `keep` false: checked and answered, then dropped (fault injection).
    pub fn stage(&self, msg: &Incoming, keep: bool) -> Result<()> {
        let who = msg.peer();
        if !matches!(who, Identity::Client(_)) {
            return Err(Error::remote(
                Status::Invalid,
                "shards are staged by clients",
            ));
        }
        let p: &Payload = msg.payload();
        let mut d = Dec::new(p);
        let _epoch = d.u64()?;
        let upload = d.u64()?;
        let pool = d.u64()?;
        let pg = d.u32()?;
        let slot = d.u8()?;
        let data = d.bytes()?;
        let listed = d.crc_list("staged shard")?;
        d.end()?;
        if data.len() as u64 > crate::ops::OBJECT_BYTES_MAX {
            return Err(Error::remote(Status::TooLarge, "staged shard too large"));
        }
        let crcs = if crcs_describe(p, msg.payload_crc(), data, &listed) {
            listed
        } else {
            if !listed.is_empty() {
                tracing::warn!(%who, "a staged shard's crc list does not describe its bytes");
            }
            Vec::new()
        };
        let key = (ReqId { who, id: upload }, slot);
        if !keep {
            self.expired.fetch_add(1, Relaxed);
            return Ok(());
        }
        let mut st = self.shards.lock().unwrap();
        self.expire(&mut st);
        let held: usize = st
            .iter()
            .filter(|((r, _), _)| r.who == who)
            .map(|(_, s)| s.data.len())
            .sum();
        if held + data.len() > STAGED_BYTES_MAX {
            return Err(Error::remote(
                Status::TooLarge,
                format!("{who} would hold more than {STAGED_BYTES_MAX} bytes of staged shards"),
            ));
        }
        let shard = StagedShard {
            data: p.slice_ref(data),
            crcs,
            pool,
            pg,
            at: Instant::now(),
        };
        self.bytes.fetch_add(data.len() as u64, Relaxed);
        if let Some(old) = st.insert(key, shard) {
            self.bytes.fetch_sub(old.data.len() as u64, Relaxed);
        }
        self.staged.fetch_add(1, Relaxed);
        drop(st);
        self.arrived.notify_all();
        Ok(())
    }

    /// The staged shard a write names, removed — waiting up to [`STAGED_SHARD_WAIT`] for it
    /// to arrive; `NotStaged` when it is not here by then or not what the write says it is
    /// (another PG, another length).
    pub fn take(&self, r: &StagedRef, slot: u8, pool: u64, pg: u32) -> Result<StagedShard> {
        let key = (r.upload, slot);
        let deadline = Instant::now() + STAGED_SHARD_WAIT;
        let mut st = self.shards.lock().unwrap();
        let mut waited = false;
        while !st.contains_key(&key) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            if !waited {
                waited = true;
                self.waits.fetch_add(1, Relaxed);
            }
            st = self.arrived.wait_timeout(st, deadline - now).unwrap().0;
        }
        let s = st.remove(&key);
        if let Some(s) = &s {
            self.bytes.fetch_sub(s.data.len() as u64, Relaxed);
        }
        match s {
            Some(s) if s.pool == pool && s.pg == pg && s.data.len() == r.len as usize => {
                self.taken.fetch_add(1, Relaxed);
                Ok(s)
            }
            s => {
                self.missing.fetch_add(1, Relaxed);
                Err(Error::remote(
                    Status::NotStaged,
                    match s {
                        Some(s) => format!(
                            "upload {} of {} staged {} bytes of shard {slot} for pg {}.{:x}, \
                             not {} for pg {pool}.{pg:x}",
                            r.upload.id,
                            r.upload.who,
                            s.data.len(),
                            s.pool,
                            s.pg,
                            r.len
                        ),
                        None => format!(
                            "no shard {slot} of upload {} from {} staged here (expired, \
                             never sent, or the node restarted)",
                            r.upload.id, r.upload.who
                        ),
                    },
                ))
            }
        }
    }

    fn expire(&self, st: &mut HashMap<(ReqId, u8), StagedShard>) {
        let before = st.len();
        st.retain(|_, s| {
            let keep = s.at.elapsed() < STAGED_SHARD_TTL;
            if !keep {
                self.bytes.fetch_sub(s.data.len() as u64, Relaxed);
            }
            keep
        });
        self.expired.fetch_add((before - st.len()) as u64, Relaxed);
    }
}
