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
//! [`STAGED_SHARD_TTL`], and one client may hold at most [`STAGED_BYTES_MAX`] per node (the
//! runtime setting `staged_bytes_max`): a client past that gets `TooLarge` and sends its data
//! to the primary instead. A write that names a shard this node does not hold fails that
//! member with `NotStaged`; the primary fails the write at once and the client sends the data
//! through the primary.
//!
//! A write can reach a member before the shard it names (the client sends its op right behind
//! its stages, and the op's path through the primary can overtake a stage), so a member waits
//! for a missing shard — but only while it may still come. A shard this node refused (over
//! the client's budget, too large) or dropped unused (its TTL) leaves a marker, kept at
//! least [`STAGED_SHARD_TTL`]: a write naming it fails at once, and one already waiting for it
//! is woken to fail. Only a shard this node never heard of (it restarted after taking it, or
//! the stage was lost with its connection) is waited for, up to [`STAGED_SHARD_WAIT`].

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
/// A shard this node refused or dropped is not waited for (see the module's docs).
pub const STAGED_SHARD_WAIT: Duration = Duration::from_secs(2);
/// Most markers of refused or expired shards kept at once (each ~80 bytes; those older than
/// [`STAGED_SHARD_TTL`] are dropped when the count reaches it); past it a write naming an
/// unmarked shard waits as for a lost one.
pub const GONE_MARKERS_MAX: usize = 1 << 16;

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

/// Why a shard a write names will not come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gone {
    /// This node refused the stage (the client's budget, or the shard too large).
    Refused,
    /// Staged, then dropped: no write took it within [`STAGED_SHARD_TTL`].
    Expired,
}

type ShardKey = (ReqId, u8);

#[derive(Default)]
struct Held {
    shards: HashMap<ShardKey, StagedShard>,
    /// Shards that will not come, and since when (see [`Staging::mark`]).
    gone: HashMap<ShardKey, (Instant, Gone)>,
}

pub struct Staging {
    held: Mutex<Held>,
    /// Notified when a shard is staged or refused (a write may be waiting for it).
    arrived: Condvar,
    /// Bytes of staged shards one client may hold here (runtime setting `staged_bytes_max`).
    pub bytes_max: AtomicU64,
    /// Shards staged, taken by a write, dropped unused (TTL), and writes that named a shard
    /// that was not here.
    pub staged: AtomicU64,
    pub taken: AtomicU64,
    pub expired: AtomicU64,
    pub missing: AtomicU64,
    pub bytes: AtomicU64,
    /// Writes that named a shard before it arrived, and waited for it.
    pub waits: AtomicU64,
    /// Stages refused (over the client's budget, too large).
    pub refused: AtomicU64,
    /// Of `missing`, writes that waited the whole [`STAGED_SHARD_WAIT`] for a shard this node
    /// never heard of (the others failed as soon as the shard was known refused or expired).
    pub wait_timeouts: AtomicU64,
}

impl Default for Staging {
    fn default() -> Self {
        Staging {
            held: Mutex::default(),
            arrived: Condvar::new(),
            bytes_max: AtomicU64::new(STAGED_BYTES_MAX as u64),
            staged: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            missing: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            wait_timeouts: AtomicU64::new(0),
        }
    }
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
        let key = (ReqId { who, id: upload }, slot);
        if data.len() as u64 > crate::ops::OBJECT_BYTES_MAX {
            self.refuse(key);
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
        if !keep {
            // As if this node had restarted after taking it: no marker.
            self.expired.fetch_add(1, Relaxed);
            return Ok(());
        }
        let mut st = self.held.lock().unwrap();
        self.expire(&mut st);
        let held: usize = st
            .shards
            .iter()
            .filter(|((r, _), _)| r.who == who)
            .map(|(_, s)| s.data.len())
            .sum();
        let max = self.bytes_max.load(Relaxed);
        if (held + data.len()) as u64 > max {
            drop(st);
            self.refuse(key);
            return Err(Error::remote(
                Status::TooLarge,
                format!("{who} would hold more than {max} bytes of staged shards"),
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
        st.gone.remove(&key);
        if let Some(old) = st.shards.insert(key, shard) {
            self.bytes.fetch_sub(old.data.len() as u64, Relaxed);
        }
        self.staged.fetch_add(1, Relaxed);
        drop(st);
        self.arrived.notify_all();
        Ok(())
    }

    /// Refuse a shard: a write naming it fails at once (one waiting for it now, too).
    fn refuse(&self, key: ShardKey) {
        Self::mark(&mut self.held.lock().unwrap(), key, Gone::Refused);
        self.refused.fetch_add(1, Relaxed);
        self.arrived.notify_all();
    }

    /// Markers are dropped only when they reach [`GONE_MARKERS_MAX`] (then those past the
    /// TTL): one outliving its TTL is harmless, as upload ids do not repeat.
    fn mark(st: &mut Held, key: ShardKey, why: Gone) {
        if st.gone.len() >= GONE_MARKERS_MAX {
            st.gone.retain(|_, (at, _)| at.elapsed() < STAGED_SHARD_TTL);
        }
        if st.gone.len() < GONE_MARKERS_MAX {
            st.gone.insert(key, (Instant::now(), why));
        }
    }

    /// The staged shard a write names, removed — waiting up to [`STAGED_SHARD_WAIT`] for it
    /// to arrive unless this node refused or dropped it; `NotStaged` when it is not here by
    /// then, will not come, or is not what the write says it is (another PG, another length).
    pub fn take(&self, r: &StagedRef, slot: u8, pool: u64, pg: u32) -> Result<StagedShard> {
        let key = (r.upload, slot);
        let deadline = Instant::now() + STAGED_SHARD_WAIT;
        let mut st = self.held.lock().unwrap();
        let mut waited = false;
        let mut gone = None;
        while !st.shards.contains_key(&key) {
            if let Some(&(_, why)) = st.gone.get(&key) {
                gone = Some(why);
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                self.wait_timeouts.fetch_add(1, Relaxed);
                break;
            }
            if !waited {
                waited = true;
                self.waits.fetch_add(1, Relaxed);
            }
            st = self.arrived.wait_timeout(st, deadline - now).unwrap().0;
        }
        let s = st.shards.remove(&key);
        if let Some(s) = &s {
            self.bytes.fetch_sub(s.data.len() as u64, Relaxed);
        }
        drop(st);
        match s {
            Some(s) if s.pool == pool && s.pg == pg && s.data.len() == r.len as usize => {
                self.taken.fetch_add(1, Relaxed);
                Ok(s)
            }
            s => {
                self.missing.fetch_add(1, Relaxed);
                let (id, who) = (r.upload.id, r.upload.who);
                Err(Error::remote(
                    Status::NotStaged,
                    match (s, gone) {
                        (Some(s), _) => format!(
                            "upload {id} of {who} staged {} bytes of shard {slot} for pg {}.{:x}, \
                             not {} for pg {pool}.{pg:x}",
                            s.data.len(),
                            s.pool,
                            s.pg,
                            r.len
                        ),
                        (None, Some(Gone::Refused)) => {
                            format!("shard {slot} of upload {id} from {who} was refused here")
                        }
                        (None, Some(Gone::Expired)) => format!(
                            "shard {slot} of upload {id} from {who} expired here unused \
                             (kept {} s)",
                            STAGED_SHARD_TTL.as_secs()
                        ),
                        (None, None) => format!(
                            "no shard {slot} of upload {id} from {who} staged here within {} s \
                             (never sent, lost with its connection, or the node restarted)",
                            STAGED_SHARD_WAIT.as_secs()
                        ),
                    },
                ))
            }
        }
    }

    fn expire(&self, st: &mut Held) {
        let before = st.shards.len();
        let mut dropped = Vec::new();
        st.shards.retain(|k, s| {
            let keep = s.at.elapsed() < STAGED_SHARD_TTL;
            if !keep {
                self.bytes.fetch_sub(s.data.len() as u64, Relaxed);
                dropped.push(*k);
            }
            keep
        });
        self.expired
            .fetch_add((before - st.shards.len()) as u64, Relaxed);
        for k in dropped {
            Self::mark(st, k, Gone::Expired);
        }
    }
}
