//! `nvstore::Client`: the Rust API applications use, like librados.
//!
//! Connect with monitor addresses and the cluster key; the client keeps the map current
//! (pushes plus a poll), sends each op to its PG's primary, and when the primary changed (or
//! died) waits for the map to say who leads now and retries there, until the op's deadline.
//! An op waiting for a reply does not wait for the deadline when the map moves its PG to
//! another primary meanwhile: a primary cut off by the network leaves its clients'
//! connections hanging, not closed, so the map is what says to go elsewhere (Ceph's Objecter
//! resends on map changes the same way).
//!
//! Retries resend the request with the same request id (`ClientOp::reqid`): the primary that
//! applied it answers with the version it made instead of applying it again, and so does a
//! new primary (the first died or was marked down after applying) while the write is among
//! the object's last 8 that had a request id — its shards keep their ids and versions
//! (`node::local::ReqHistory`). A resend that reaches a new primary after more writes than
//! that to the object may still apply twice — harmless for write_full/write/remove/xattrs,
//! not for append. Staged puts (> 16 MiB) and ops with reads carry no request id.

use std::collections::BTreeSet;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ec::{Codec, Profile};
use messenger::{
    Connection, Dispatcher, Identity, Incoming, Messenger, OutMessage, Secret, SendBuf,
};

use crate::client_ec::{encode_object, SharedUnit, CLIENT_EC_BYTES_MIN};
use crate::config::ClientConfig;
use crate::error::{Error, Result};
use crate::map::ClusterMap;
use crate::monclient::MonClient;
use crate::monitor::raft::MonCommand;
use crate::monitor::StatusReport;
use crate::ops::{self, ClientOp, ObjStat, OpResult, ReadData, SubOp};
use crate::placement::pg_of;
use crate::wire::{self, Dec, Enc, Status};

struct ClientDispatcher(OnceLock<Arc<MonClient>>);

impl Dispatcher for ClientDispatcher {
    fn handle(&self, msg: Incoming) {
        if msg.msg_type() == wire::MSG_MON_MAP_PUSH {
            if let Some(m) = self.0.get() {
                m.handle_push(msg.payload());
            }
        }
    }
}

/// A connection to an nvstore cluster. Cheap to share (`&Client` from many threads).
pub struct Client {
    msgr: Arc<Messenger>,
    monc: Arc<MonClient>,
    conns: crate::peers::PeerConns,
    timeout: Duration,
    next_upload: AtomicU64,
    /// Request ids (`ClientOp::reqid`): from a random start, so two clients that drew the
    /// same identity do not share them; never 0.
    next_reqid: AtomicU64,
    /// Encode large whole-object writes here and stage the shards on the members
    /// ([`crate::client_ec`]); on by default.
    client_ec: AtomicBool,
    codecs: Mutex<HashMap<Profile, Arc<Codec>>>,
    /// Writes encoded here, and those that fell back to sending the data to the primary.
    ec_puts: AtomicU64,
    ec_fallbacks: AtomicU64,
    /// Time spent encoding and staging, and waiting for the op after it (ns, summed).
    ec_stage_ns: AtomicU64,
    ec_op_ns: AtomicU64,
}

impl Client {
    pub fn from_config(path: &Path) -> Result<Client> {
        let c = ClientConfig::load(path)?;
        Client::connect(
            &c.monitors,
            &Secret::load(&c.key_file)?,
            Duration::from_millis(c.op_timeout_ms),
        )
    }

    /// Connect to the cluster whose monitors are at `monitors`.
    pub fn connect(
        monitors: &[SocketAddr],
        secret: &Secret,
        op_timeout: Duration,
    ) -> Result<Client> {
        let disp = Arc::new(ClientDispatcher(OnceLock::new()));
        let id = rand::random::<u32>() & 0x3fff_ffff;
        let msgr = Arc::new(Messenger::new(
            messenger::Config {
                workers: 1,
                handler_threads: 1,
                payload_bytes_max: messenger::frame::PAYLOAD_BYTES_LIMIT,
                // Many processes share few cores: sleep right away instead of spinning.
                busy_poll: Duration::ZERO,
                ..messenger::Config::default()
            },
            Identity::Client(id),
            secret.clone(),
            disp.clone(),
        )?);
        let monc = MonClient::new(msgr.clone(), monitors.to_vec());
        let _ = disp.0.set(monc.clone());
        monc.subscribe()?;
        monc.start_poller();
        Ok(Client {
            msgr,
            monc,
            conns: Default::default(),
            timeout: op_timeout,
            next_upload: AtomicU64::new(rand::random::<u64>() >> 1),
            next_reqid: AtomicU64::new((rand::random::<u64>() >> 1) | 1),
            client_ec: AtomicBool::new(true),
            codecs: Mutex::new(HashMap::new()),
            ec_puts: AtomicU64::new(0),
            ec_fallbacks: AtomicU64::new(0),
            ec_stage_ns: AtomicU64::new(0),
            ec_op_ns: AtomicU64::new(0),
        })
    }

    pub fn map(&self) -> Arc<ClusterMap> {
        self.monc.map()
    }

    pub fn status(&self) -> Result<StatusReport> {
        self.monc.status()
    }

    /// Wait until the map is at least at `epoch`.
    pub fn wait_epoch(&self, epoch: u64, timeout: Duration) -> bool {
        self.monc.wait_epoch(epoch, timeout)
    }

    /// Refresh the map from the monitors now.
    pub fn refresh_map(&self) -> Result<u64> {
        self.monc.subscribe()
    }

    pub fn command(&self, cmd: &MonCommand) -> Result<crate::monitor::raft::MonResponse> {
        self.monc.command(cmd)
    }

    /// Create an EC pool; returns its id.
    pub fn create_pool(
        &self,
        name: &str,
        k: u32,
        m: u32,
        stripe_unit: u32,
        pg_num: u32,
        min_size: Option<u32>,
    ) -> Result<u64> {
        let r = self.monc.command(&MonCommand::CreatePool {
            name: name.into(),
            k,
            m,
            stripe_unit,
            pg_num,
            min_size,
        })?;
        if !r.ok {
            return Err(Error::remote(Status::Invalid, r.message));
        }
        self.pool_id(name)
    }

    /// Delete pool `name` and every object in it, for good: the monitor removes it from the
    /// map at once (its objects are gone for clients from that epoch on) and each node then
    /// removes its keys of the pool in the background. The pool's id is never reused.
    pub fn delete_pool(&self, name: &str) -> Result<()> {
        let r = self
            .monc
            .command(&MonCommand::DeletePool { name: name.into() })?;
        if !r.ok {
            return Err(Error::remote(Status::NoSuchPool, r.message));
        }
        self.monc.subscribe()?;
        Ok(())
    }

    pub fn pool_id(&self, name: &str) -> Result<u64> {
        if let Some(p) = self.map().pool_by_name(name) {
            return Ok(p.id);
        }
        self.monc.subscribe()?;
        self.map()
            .pool_by_name(name)
            .map(|p| p.id)
            .ok_or_else(|| Error::remote(Status::NoSuchPool, format!("no pool named {name:?}")))
    }

    /// The (kept) connection to a node, for requests that are not object ops.
    pub(crate) fn node_conn(&self, node: u32, addr: SocketAddr) -> Result<Connection> {
        self.conn(node, addr)
    }

    fn conn(&self, node: u32, addr: SocketAddr) -> Result<Connection> {
        self.conns.get(&self.msgr, &self.monc, node, addr)
    }

    /// Run `f(attempt)` against the primary of (pool, name), retrying on primary changes and
    /// lost connections until the op deadline.
    fn with_primary<T>(
        &self,
        pool: u64,
        name: &[u8],
        mut f: impl FnMut(&Attempt) -> Result<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + self.timeout;
        let mut last = String::from("no attempt");
        let mut refreshed = false;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: format!("op on {pool}/{}: {last}", String::from_utf8_lossy(name)),
                    secs: self.timeout.as_secs_f64(),
                });
            }
            let map = self.map();
            let Some(p) = map.pools.get(&pool) else {
                if !refreshed {
                    refreshed = true;
                    let _ = self.monc.subscribe();
                    continue;
                }
                return Err(Error::remote(
                    Status::NoSuchPool,
                    format!("no pool with id {pool} at epoch {}", map.epoch),
                ));
            };
            let a = self.monc.acting(&map, p, pg_of(p, name));
            let Some(primary) = a.primary else {
                last = format!("pg {pool}.{:x} has no up member", a.pg);
                self.monc.wait_change(map.epoch, Duration::from_millis(500));
                continue;
            };
            let addr = map.nodes[&primary].addr;
            let r = self.conn(primary, addr).and_then(|conn| {
                f(&Attempt {
                    client: self,
                    conn,
                    epoch: map.epoch,
                    deadline,
                    pool,
                    pg: a.pg,
                    primary,
                })
            });
            match r {
                Ok(v) => return Ok(v),
                Err(Error::Remote { status, message })
                    if matches!(status, Status::WrongPrimary | Status::StaleEpoch)
                        || (status == Status::Io && message == "node is starting") =>
                {
                    last = format!("node {primary}: {message}");
                    let _ = self.monc.subscribe();
                    self.monc.wait_change(map.epoch, Duration::from_millis(200));
                }
                Err(Error::Messenger(e)) => {
                    // The primary is unreachable: wait for the monitors to mark it down.
                    last = format!("node {primary}: {e}");
                    self.monc.wait_change(map.epoch, Duration::from_millis(500));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Apply sub-ops to one object atomically (see [`crate::ops`]). Returns the object's
    /// version after the request and one result per read sub-op.
    pub fn op(&self, pool: u64, name: &[u8], sub: &[SubOp]) -> Result<(u64, Vec<OpResult>)> {
        self.op_flags(pool, name, sub, 0, 0)
    }

    fn op_flags(
        &self,
        pool: u64,
        name: &[u8],
        sub: &[SubOp],
        flags: u32,
        upload: u64,
    ) -> Result<(u64, Vec<OpResult>)> {
        ops::check_name(name).map_err(|m| Error::remote(Status::Invalid, m))?;
        let reqid = self.reqid();
        self.with_primary(pool, name, |at| {
            let msg = ClientOp {
                epoch: at.epoch,
                pool,
                name,
                flags,
                upload_id: upload,
                reqid,
                ops: sub.to_vec(),
            }
            .encode();
            self.send_op(at, OutMessage::new(wire::MSG_CLIENT_OP, msg))
        })
    }

    /// Send one encoded client op and decode its results.
    fn send_op(&self, at: &Attempt, msg: OutMessage) -> Result<(u64, Vec<OpResult>)> {
        let reply = at.request(msg)?;
        let (e, body) = wire::parse_reply_epoch(&reply.payload);
        if e > self.monc.epoch() {
            let _ = self.monc.subscribe();
        }
        ops::decode_results_shared(&reply.payload, body?)
    }

    /// [`Client::put`] of bytes the caller shares rather than lends: the request refers to
    /// them instead of copying them into the frame (like a librados write of a bufferlist).
    /// Objects larger than one message take `put`'s staged path, which copies.
    pub fn put_shared(&self, pool: u64, name: &[u8], data: Arc<[u8]>) -> Result<u64> {
        if data.len() >= CLIENT_EC_BYTES_MIN && self.client_ec.load(Relaxed) {
            match self.put_encoded(pool, name, &data)? {
                Some(v) => return Ok(v),
                None => {
                    self.ec_fallbacks.fetch_add(1, Relaxed);
                }
            }
        }
        if data.len() > ops::MESSAGE_DATA_BYTES_MAX {
            return self.put_via_primary(pool, name, &data);
        }
        ops::check_name(name).map_err(|m| Error::remote(Status::Invalid, m))?;
        let reqid = self.reqid();
        self.with_primary(pool, name, |at| {
            let (head, tail) = ClientOp {
                epoch: at.epoch,
                pool,
                name,
                flags: 0,
                upload_id: 0,
                reqid,
                ops: vec![SubOp::WriteFull(&data)],
            }
            .encode_head();
            debug_assert_eq!(tail.len(), data.len());
            let msg = OutMessage::new(wire::MSG_CLIENT_OP, head).with_part(data.clone());
            Ok(self.send_op(at, msg)?.0)
        })
    }

    /// Replace an object's content (any size up to 64 MiB; large ones are staged in parts on
    /// the primary first). Returns the new version.
    pub fn put(&self, pool: u64, name: &[u8], data: &[u8]) -> Result<u64> {
        if data.len() >= CLIENT_EC_BYTES_MIN
            && data.len() as u64 <= ops::OBJECT_BYTES_MAX
            && self.client_ec.load(Relaxed)
        {
            // One copy here instead of the primary's fan-out of the whole object.
            return self.put_shared(pool, name, Arc::from(data));
        }
        self.put_via_primary(pool, name, data)
    }

    /// [`Client::put`] sending the object to the primary, which encodes it: in one message,
    /// or staged in parts first when larger than one.
    fn put_via_primary(&self, pool: u64, name: &[u8], data: &[u8]) -> Result<u64> {
        if data.len() <= ops::MESSAGE_DATA_BYTES_MAX {
            return Ok(self.op(pool, name, &[SubOp::WriteFull(data)])?.0);
        }
        if data.len() as u64 > ops::OBJECT_BYTES_MAX {
            return Err(too_large(data.len()));
        }
        ops::check_name(name).map_err(|m| Error::remote(Status::Invalid, m))?;
        let split = data.len() - data.len() % ops::MESSAGE_DATA_BYTES_MAX.max(1);
        let split = if split == data.len() {
            split - ops::MESSAGE_DATA_BYTES_MAX
        } else {
            split
        };
        let (staged, tail) = data.split_at(split);
        self.with_primary(pool, name, |at| {
            let upload = self.next_upload.fetch_add(1, Relaxed);
            for (i, part) in staged.chunks(ops::MESSAGE_DATA_BYTES_MAX).enumerate() {
                let mut e = Enc::new(at.epoch);
                e.u64(upload)
                    .u64((i * ops::MESSAGE_DATA_BYTES_MAX) as u64)
                    .bytes(part);
                let reply = at.request(OutMessage::new(wire::MSG_CLIENT_STAGE, e.finish()))?;
                wire::parse_reply(&reply.payload)?;
            }
            let msg = ClientOp {
                epoch: at.epoch,
                pool,
                name,
                flags: ops::FLAG_STAGED,
                upload_id: upload,
                // No dedup: each try stages anew (a dedup hit would leave that upload
                // unused), and a whole-object write applied twice leaves the same bytes.
                reqid: 0,
                ops: vec![SubOp::WriteFull(tail)],
            }
            .encode();
            let reply = at.request(OutMessage::new(wire::MSG_CLIENT_OP, msg))?;
            let (_, body) = wire::parse_reply_epoch(&reply.payload);
            Ok(ops::decode_results(body?)?.0)
        })
    }

    /// Turn client-side erasure coding of large whole-object writes on or off (on by
    /// default; off sends the object to the primary, which encodes it).
    pub fn set_client_ec(&self, on: bool) {
        self.client_ec.store(on, Relaxed);
    }

    /// Writes this client encoded itself, and those that fell back to sending the object to
    /// the primary (a member had lost its staged shard, or staging failed).
    pub fn client_ec_stats(&self) -> (u64, u64) {
        (self.ec_puts.load(Relaxed), self.ec_fallbacks.load(Relaxed))
    }

    /// Of the writes this client encoded, the time spent encoding and queueing the stages,
    /// and the time from then until the op's reply, summed (seconds).
    pub fn client_ec_times(&self) -> (f64, f64) {
        (
            self.ec_stage_ns.load(Relaxed) as f64 / 1e9,
            self.ec_op_ns.load(Relaxed) as f64 / 1e9,
        )
    }

    fn codec(&self, p: Profile) -> Arc<Codec> {
        self.codecs
            .lock()
            .unwrap()
            .entry(p)
            .or_insert_with(|| Arc::new(Codec::new(p)))
            .clone()
    }

    /// A whole-object write encoded here ([`crate::client_ec`]): stage every up member's
    /// shard on it, and send the primary the op naming them right behind. `None` when it
    /// should go the usual way instead: a member was unreachable, or the write found a shard
    /// missing (a stage failed — a member's staging was full — or a member lost it).
    fn put_encoded(&self, pool: u64, name: &[u8], data: &Arc<[u8]>) -> Result<Option<u64>> {
        ops::check_name(name).map_err(|m| Error::remote(Status::Invalid, m))?;
        if data.len() as u64 > ops::OBJECT_BYTES_MAX {
            return Err(too_large(data.len()));
        }
        let reqid = self.reqid();
        let mut encoded: Option<(Profile, Vec<Vec<SharedUnit>>)> = None;
        let r = self.with_primary(pool, name, |at| {
            let t0 = Instant::now();
            let map = self.map();
            let Some(p) = map.pools.get(&pool) else {
                return Err(Error::remote(
                    Status::StaleEpoch,
                    format!("pool {pool} is not in the map at epoch {}", map.epoch),
                ));
            };
            let profile = p.profile();
            if encoded.as_ref().is_none_or(|(pr, _)| *pr != profile) {
                encoded = Some((profile, encode_object(&profile, &self.codec(profile), data)));
            }
            let shards = &encoded.as_ref().expect("encoded above").1;
            let acting = self.monc.acting(&map, p, at.pg);
            let upload = self.next_upload.fetch_add(1, Relaxed);
            let left = at.deadline.saturating_duration_since(Instant::now());
            let failed = Arc::new(AtomicBool::new(false));
            let mut members = vec![None; acting.members.len()];
            for (slot, m) in acting.members.iter().enumerate() {
                let Some(node) = m.filter(|n| map.is_up(*n)) else {
                    continue;
                };
                let Ok(conn) = self.conn(node, map.nodes[&node].addr) else {
                    return Ok(None);
                };
                members[slot] = Some(node);
                let units = &shards[slot];
                let mut e = Enc::new(at.epoch);
                e.u64(upload).u64(pool).u32(at.pg).u8(slot as u8);
                e.u32(units.iter().map(|u| u.len()).sum::<usize>() as u32);
                let mut msg = OutMessage::new(wire::MSG_CLIENT_STAGE_SHARD, e.finish());
                let mut list = Vec::with_capacity(4 + 8 * units.len());
                list.extend_from_slice(&(units.len() as u32).to_le_bytes());
                for u in units {
                    msg = msg.with_part(SendBuf::Raw(Box::new(u.clone())));
                    list.extend_from_slice(&(u.len() as u32).to_le_bytes());
                    list.extend_from_slice(&u.crc.to_le_bytes());
                }
                let failed = failed.clone();
                conn.request_with(msg.with_part(list), left, move |r| {
                    let r = r
                        .map_err(Error::from)
                        .and_then(|reply| wire::parse_reply(&reply.payload).map(|_| ()));
                    if let Err(e) = r {
                        tracing::debug!("staging shard {slot} on node {node} failed: {e}");
                        failed.store(true, Relaxed);
                    }
                });
            }
            let t1 = Instant::now();
            let msg = ClientOp {
                epoch: at.epoch,
                pool,
                name,
                flags: 0,
                upload_id: upload,
                reqid,
                ops: vec![SubOp::WriteStaged {
                    size: data.len() as u64,
                    members,
                }],
            }
            .encode();
            // Sent right behind the stages, not after their replies: a member (the primary
            // too) waits a little for a shard the write names that has not arrived yet.
            let r = self.send_op(at, OutMessage::new(wire::MSG_CLIENT_OP, msg));
            self.ec_stage_ns
                .fetch_add((t1 - t0).as_nanos() as u64, Relaxed);
            self.ec_op_ns
                .fetch_add(t1.elapsed().as_nanos() as u64, Relaxed);
            match r {
                Ok((v, _)) => Ok(Some(v)),
                Err(Error::Remote {
                    status: Status::NotStaged,
                    message,
                }) => {
                    tracing::debug!(
                        stage_failed = failed.load(Relaxed),
                        "{message}; sending the data to the primary"
                    );
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        })?;
        if r.is_some() {
            self.ec_puts.fetch_add(1, Relaxed);
        }
        Ok(r)
    }

    pub fn stat(&self, pool: u64, name: &[u8]) -> Result<ObjStat> {
        match self.op(pool, name, &[SubOp::Stat])?.1.pop() {
            Some(OpResult::Stat(s)) => Ok(s),
            other => Err(Error::Malformed(format!("stat returned {other:?}"))),
        }
    }

    /// Bytes `[offset, offset + len)` (clamped to the object's size), read in message-sized
    /// pieces all at one version. The first message also asks for the object's stat, so an
    /// object that fits in one message (any object up to 16 MiB read whole) costs one round
    /// trip; later pieces assert the version the first one saw.
    pub fn get_range(&self, pool: u64, name: &[u8], offset: u64, len: u64) -> Result<Vec<u8>> {
        self.read(pool, name, offset, len).map(ReadData::into_vec)
    }

    /// [`Client::get_range`] without a copy: a read that fits in one message returns a view
    /// into the reply as the messenger received it (a larger one is assembled into one
    /// buffer). Like a librados `read` into a bufferlist.
    pub fn read(&self, pool: u64, name: &[u8], offset: u64, len: u64) -> Result<ReadData> {
        let piece = ops::MESSAGE_DATA_BYTES_MAX as u64;
        if len <= piece {
            return match self.op(pool, name, &[SubOp::Read { offset, len }])?.1.pop() {
                Some(OpResult::Data(d)) => Ok(d),
                other => Err(Error::Malformed(format!("read returned {other:?}"))),
            };
        }
        'attempt: for _ in 0..8 {
            let (_, mut r) = self.op(
                pool,
                name,
                &[SubOp::Stat, SubOp::Read { offset, len: piece }],
            )?;
            let (st, mut out) = match (r.pop(), r.pop()) {
                (Some(OpResult::Data(d)), Some(OpResult::Stat(st))) => (st, d.into_vec()),
                other => return Err(Error::Malformed(format!("stat + read returned {other:?}"))),
            };
            let end = offset.saturating_add(len).min(st.size);
            let mut at = offset + out.len() as u64;
            if at < end {
                out.reserve((end - at) as usize);
            }
            while at < end {
                let n = (end - at).min(piece);
                match self.op(
                    pool,
                    name,
                    &[
                        SubOp::AssertVersion(st.version),
                        SubOp::Read { offset: at, len: n },
                    ],
                ) {
                    Ok((_, mut r)) => match r.pop() {
                        Some(OpResult::Data(d)) => out.extend_from_slice(&d),
                        other => return Err(Error::Malformed(format!("read returned {other:?}"))),
                    },
                    Err(Error::Remote {
                        status: Status::VersionMismatch,
                        ..
                    }) => continue 'attempt,
                    Err(e) => return Err(e),
                }
                at += n;
            }
            return Ok(ReadData::Owned(out));
        }
        Err(Error::remote(
            Status::VersionMismatch,
            "object kept changing during a multi-part read",
        ))
    }

    /// The whole object.
    pub fn get(&self, pool: u64, name: &[u8]) -> Result<Vec<u8>> {
        self.get_range(pool, name, 0, ops::OBJECT_BYTES_MAX)
    }

    pub fn write(&self, pool: u64, name: &[u8], offset: u64, data: &[u8]) -> Result<u64> {
        Ok(self.op(pool, name, &[SubOp::Write { offset, data }])?.0)
    }

    pub fn append(&self, pool: u64, name: &[u8], data: &[u8]) -> Result<u64> {
        Ok(self.op(pool, name, &[SubOp::Append(data)])?.0)
    }

    pub fn remove(&self, pool: u64, name: &[u8]) -> Result<u64> {
        Ok(self.op(pool, name, &[SubOp::Remove])?.0)
    }

    pub fn set_xattr(&self, pool: u64, name: &[u8], key: &str, value: &[u8]) -> Result<u64> {
        Ok(self.op(pool, name, &[SubOp::SetXattr(key, value)])?.0)
    }

    pub fn rm_xattr(&self, pool: u64, name: &[u8], key: &str) -> Result<u64> {
        Ok(self.op(pool, name, &[SubOp::RmXattr(key)])?.0)
    }

    pub fn get_xattr(&self, pool: u64, name: &[u8], key: &str) -> Result<Vec<u8>> {
        match self.op(pool, name, &[SubOp::GetXattr(key)])?.1.pop() {
            Some(OpResult::Xattr(v)) => Ok(v),
            other => Err(Error::Malformed(format!("getxattr returned {other:?}"))),
        }
    }

    pub fn xattrs(&self, pool: u64, name: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
        match self.op(pool, name, &[SubOp::GetXattrs])?.1.pop() {
            Some(OpResult::Xattrs(v)) => Ok(v),
            other => Err(Error::Malformed(format!("getxattrs returned {other:?}"))),
        }
    }

    /// Objects of a pool with their stats, in name order. Asks every up node which names it
    /// holds shards of, then stats each through its primary (so only objects that exist at
    /// their authoritative version are listed).
    pub fn list(&self, pool: u64) -> Result<Vec<(Vec<u8>, ObjStat)>> {
        let map = self.map();
        if !map.pools.contains_key(&pool) {
            return Err(Error::remote(
                Status::NoSuchPool,
                format!("no pool with id {pool}"),
            ));
        }
        let mut names = BTreeSet::new();
        for n in map.nodes.values().filter(|n| n.up) {
            let mut after: Vec<u8> = Vec::new();
            loop {
                let c = self.conn(n.id, n.addr)?;
                let mut e = Enc::new(map.epoch);
                e.u64(pool).bytes(&after).u32(1000);
                let reply = c.request(
                    OutMessage::new(wire::MSG_CLIENT_LIST, e.finish()),
                    self.timeout,
                )?;
                let (_, body) = wire::parse_reply(&reply.payload)?;
                let mut d = Dec::new(body);
                let count = d.u32()?;
                for _ in 0..count {
                    after = d.bytes()?.to_vec();
                    names.insert(after.clone());
                }
                if count < 1000 {
                    break;
                }
            }
        }
        let mut out = Vec::new();
        for name in names {
            match self.stat(pool, &name) {
                Ok(s) => out.push((name, s)),
                Err(Error::Remote {
                    status: Status::NotFound,
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}

impl Client {
    fn reqid(&self) -> u64 {
        match self.next_reqid.fetch_add(1, Relaxed) {
            0 => self.next_reqid.fetch_add(1, Relaxed),
            r => r,
        }
    }
}

/// The error for an object larger than [`ops::OBJECT_BYTES_MAX`].
fn too_large(n: usize) -> Error {
    Error::remote(
        Status::TooLarge,
        format!(
            "object of {n} bytes; the maximum is {}",
            ops::OBJECT_BYTES_MAX
        ),
    )
}

/// How often a request waiting for its reply looks for a map that moved its PG.
const RETARGET_CHECK: Duration = Duration::from_millis(50);

/// One try of an op at the primary the map named at `epoch`.
struct Attempt<'a> {
    client: &'a Client,
    conn: Connection,
    epoch: u64,
    deadline: Instant,
    pool: u64,
    pg: u32,
    primary: u32,
}

impl Attempt<'_> {
    /// Send a request to the primary and wait for its reply until the op's deadline — or
    /// until a newer map names another primary for the PG (or none), which ends the try with
    /// `WrongPrimary` so the op goes where the map now points (a reply that still comes is
    /// dropped).
    fn request(&self, msg: OutMessage) -> Result<messenger::Reply> {
        let (tx, rx) = crossbeam::channel::bounded(1);
        let left = self.deadline.saturating_duration_since(Instant::now());
        self.conn.request_with(msg, left, move |r| {
            let _ = tx.send(r);
        });
        let mut seen = self.epoch;
        loop {
            match rx.recv_timeout(RETARGET_CHECK) {
                Ok(r) => return Ok(r?),
                // The worker always answers; a dropped callback means it is gone.
                Err(crossbeam::channel::RecvTimeoutError::Disconnected) => {
                    return Err(messenger::Error::Shutdown.into())
                }
                Err(crossbeam::channel::RecvTimeoutError::Timeout) => {}
            }
            let map = self.client.map();
            if map.epoch == seen {
                continue;
            }
            seen = map.epoch;
            // Only another primary (or none): the same primary always answers, if only to
            // refuse an op sent before a new interval of the PG (`Acting::since`), and giving
            // up on a request it may still apply would risk applying it twice.
            let now = map
                .pools
                .get(&self.pool)
                .and_then(|p| self.client.monc.acting(&map, p, self.pg).primary);
            if now != Some(self.primary) {
                return Err(Error::remote(
                    Status::WrongPrimary,
                    format!(
                        "pg {}.{:x} changed hands at epoch {} (was node {}, now {}); resending",
                        self.pool,
                        self.pg,
                        map.epoch,
                        self.primary,
                        now.map_or("none".into(), |n| format!("node {n}"))
                    ),
                ));
            }
        }
    }
}

impl Client {
    /// Send one admin request (`body` after the epoch) to a node and return the reply body
    /// (after epoch and status); error replies become `Error::Remote`.
    pub fn node_call(&self, node: u32, msg_type: u16, body: &[u8]) -> Result<Vec<u8>> {
        let map = self.map();
        let n = map
            .nodes
            .get(&node)
            .ok_or_else(|| Error::remote(Status::Invalid, format!("no node {node} in the map")))?;
        let c = self.conn(node, n.addr)?;
        let mut e = Enc::new(map.epoch);
        e.0.extend_from_slice(body);
        let reply = c.request(OutMessage::new(msg_type, e.finish()), self.timeout)?;
        let (_, body) = wire::parse_reply(&reply.payload)?;
        Ok(body.to_vec())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.msgr.shutdown();
    }
}
