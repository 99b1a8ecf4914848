//! The monitor's raft: openraft type config, storage and network.
//!
//! **Storage** (one struct, `MonStore`, behind openraft's v1 `Adaptor`): the log lives in memory
//! and in `raft-log.jsonl` (one JSON entry per line, appended and fdatasync'd before `append`
//! returns; rewritten whole — temp file + rename — when a suffix is truncated or a prefix
//! purged); the vote and the committed log id in small JSON files written the same way; the
//! state machine (the cluster map and recent incrementals) in memory, rebuilt at start from
//! `snapshot.json` plus the committed log. Snapshots are the whole state as JSON (a map is
//! small). **Network**: raft RPCs are messenger requests between monitors, JSON bodies.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::io::{Cursor, Write};
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use messenger::{Connection, Identity, Messenger, OutMessage};
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, LogState, RaftLogReader, RaftNetwork,
    RaftNetworkFactory, RaftSnapshotBuilder, RaftStorage, Snapshot, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership, Vote,
};
use serde::{Deserialize, Serialize};

use crate::map::{Change, ClusterMap, Incremental, NodeInfo, PoolInfo, POOL_NAME_BYTES_MAX};
use crate::wire::{self, MON_IDENTITY_BASE};

/// Incrementals kept for subscribers that are a few epochs behind.
pub const HISTORY_MAX: usize = 512;

/// A change proposed to the map.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum MonCommand {
    /// A node started: record (or update) it, up and in.
    Boot(NodeInfo),
    MarkDown(Vec<u32>),
    MarkUp(u32),
    MarkOut(Vec<u32>),
    /// The monitor's own mark-out of nodes down past `out_grace` (undone when they are back).
    AutoOut(Vec<u32>),
    MarkIn(u32),
    CreatePool {
        name: String,
        k: u32,
        m: u32,
        stripe_unit: u32,
        pg_num: u32,
        min_size: Option<u32>,
    },
    /// Remove a pool from the map; its objects go with it (each node sweeps its keys).
    DeletePool {
        name: String,
    },
}

/// What applying a command produced.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct MonResponse {
    pub ok: bool,
    pub epoch: u64,
    pub message: String,
}

openraft::declare_raft_types!(
    pub TypeConfig:
        D = MonCommand,
        R = MonResponse,
        NodeId = u64,
        Node = BasicNode,
        Entry = Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type Raft = openraft::Raft<TypeConfig>;
type SErr = StorageError<u64>;

/// The replicated state: the map and its recent history.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct MonState {
    pub last_applied: Option<LogId<u64>>,
    pub membership: StoredMembership<u64, BasicNode>,
    pub map: ClusterMap,
    pub history: VecDeque<Incremental>,
}

impl MonState {
    /// Apply a command; changes (if any) become the next epoch.
    pub fn execute(&mut self, cmd: &MonCommand) -> MonResponse {
        let changes = match self.changes_for(cmd) {
            Ok(c) => c,
            Err(message) => {
                return MonResponse {
                    ok: false,
                    epoch: self.map.epoch,
                    message,
                }
            }
        };
        if !changes.is_empty() {
            let inc = Incremental {
                epoch: self.map.epoch + 1,
                changes,
            };
            self.map.apply(&inc).expect("next epoch");
            self.history.push_back(inc);
            while self.history.len() > HISTORY_MAX {
                self.history.pop_front();
            }
        }
        MonResponse {
            ok: true,
            epoch: self.map.epoch,
            message: String::new(),
        }
    }

    fn changes_for(&self, cmd: &MonCommand) -> Result<Vec<Change>, String> {
        let m = &self.map;
        let node = |id: &u32| m.nodes.get(id);
        Ok(match cmd {
            MonCommand::Boot(n) => {
                let mut n = n.clone();
                n.up = true;
                n.r#in = true;
                if node(&n.id) == Some(&n) {
                    vec![]
                } else {
                    vec![Change::NodeBoot(n)]
                }
            }
            MonCommand::MarkDown(ids) => ids
                .iter()
                .filter(|id| node(id).is_some_and(|n| n.up))
                .map(|id| Change::NodeDown(*id))
                .collect(),
            MonCommand::MarkUp(id) => match node(id) {
                // Back from a spell the monitor marked out: back in too (like Ceph's
                // mon_osd_auto_mark_auto_out_in). An operator's out stays.
                Some(n) if !n.up && n.auto_out && !n.r#in => {
                    vec![Change::NodeUp(*id), Change::NodeIn(*id)]
                }
                Some(n) if !n.up => vec![Change::NodeUp(*id)],
                Some(_) => vec![],
                None => return Err(format!("no node {id}")),
            },
            MonCommand::MarkOut(ids) => ids
                .iter()
                .filter(|id| node(id).is_some_and(|n| n.r#in))
                .map(|id| Change::NodeOut(*id))
                .collect(),
            MonCommand::AutoOut(ids) => ids
                .iter()
                .filter(|id| node(id).is_some_and(|n| n.r#in))
                .map(|id| Change::NodeAutoOut(*id))
                .collect(),
            MonCommand::MarkIn(id) => match node(id) {
                Some(n) if !n.r#in => vec![Change::NodeIn(*id)],
                Some(_) => vec![],
                None => return Err(format!("no node {id}")),
            },
            MonCommand::CreatePool {
                name,
                k,
                m: parity,
                stripe_unit,
                pg_num,
                min_size,
            } => {
                if name.is_empty()
                    || name.len() > POOL_NAME_BYTES_MAX
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                {
                    return Err(format!(
                        "pool name {name:?}: 1..={POOL_NAME_BYTES_MAX} characters of \
                         [A-Za-z0-9._-]"
                    ));
                }
                if m.pool_by_name(name).is_some() {
                    return Err(format!("pool {name:?} already exists"));
                }
                ec::Profile::new(*k as usize, *parity as usize, *stripe_unit as usize)
                    .map_err(|e| e.to_string())?;
                if *pg_num == 0 || *pg_num > crate::map::PG_NUM_MAX {
                    return Err(format!("pg_num {pg_num}: 1..={}", crate::map::PG_NUM_MAX));
                }
                let min_size = min_size.unwrap_or((k + 1).min(k + parity));
                if min_size < *k || min_size > k + parity {
                    return Err(format!(
                        "min_size {min_size}: k..=k+m ({k}..={})",
                        k + parity
                    ));
                }
                // Never a deleted pool's id: its keys may still be on some node's devices.
                let id = m.pool_max() + 1;
                vec![Change::PoolCreate(PoolInfo {
                    id,
                    name: name.clone(),
                    k: *k,
                    m: *parity,
                    stripe_unit: *stripe_unit,
                    pg_num: *pg_num,
                    min_size,
                })]
            }
            MonCommand::DeletePool { name } => match m.pool_by_name(name) {
                Some(p) => vec![Change::PoolDelete(p.id)],
                None => return Err(format!("no pool {name:?}")),
            },
        })
    }

    /// Incrementals after `have`, or `None` when they are no longer all kept.
    pub fn since(&self, have: u64) -> Option<Vec<Incremental>> {
        if have >= self.map.epoch {
            return Some(vec![]);
        }
        let first = self.history.front()?.epoch;
        if have + 1 < first {
            return None;
        }
        Some(
            self.history
                .iter()
                .filter(|i| i.epoch > have)
                .cloned()
                .collect(),
        )
    }
}

/// What storage shares with the monitor service.
pub struct Shared {
    pub state: Mutex<MonState>,
    /// Told the new epoch whenever the map changes.
    pub changed: crossbeam::channel::Sender<u64>,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<u64, BasicNode>,
    data: Vec<u8>,
}

struct Inner {
    dir: PathBuf,
    log: BTreeMap<u64, Entry<TypeConfig>>,
    last_purged: Option<LogId<u64>>,
    vote: Option<Vote<u64>>,
    committed: Option<LogId<u64>>,
    snapshot: Option<StoredSnapshot>,
    snapshot_seq: u64,
}

/// The monitor's raft storage (log + state machine), cheap to clone.
#[derive(Clone)]
pub struct MonStore {
    inner: Arc<Mutex<Inner>>,
    pub shared: Arc<Shared>,
}

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Write a file whole and durably: temp file, fsync, rename, fsync the directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
}

impl MonStore {
    /// Open (or create) the monitor's raft state in `dir`.
    pub fn open(
        dir: &Path,
        fsid: &str,
        changed: crossbeam::channel::Sender<u64>,
    ) -> std::io::Result<MonStore> {
        std::fs::create_dir_all(dir)?;
        let read = |name: &str| std::fs::read(dir.join(name)).ok();
        let vote = read("vote.json")
            .map(|b| serde_json::from_slice(&b))
            .transpose()
            .map_err(io_err)?;
        let committed = read("committed.json")
            .map(|b| serde_json::from_slice(&b))
            .transpose()
            .map_err(io_err)?
            .flatten();
        let snapshot: Option<StoredSnapshot> = read("snapshot.json")
            .map(|b| serde_json::from_slice(&b))
            .transpose()
            .map_err(io_err)?;
        let mut state = MonState {
            map: ClusterMap::new(fsid.to_string()),
            ..MonState::default()
        };
        if let Some(s) = &snapshot {
            state = serde_json::from_slice(&s.data).map_err(io_err)?;
        }
        let mut log = BTreeMap::new();
        let mut last_purged = snapshot.as_ref().and_then(|s| s.meta.last_log_id);
        if let Some(text) = read("raft-log.jsonl") {
            for line in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                // A torn last line (crash mid-append, never acknowledged) ends the log.
                let Ok(e) = serde_json::from_slice::<LogLine>(line) else {
                    break;
                };
                match e {
                    LogLine::Entry(e) => {
                        log.insert(e.log_id.index, e);
                    }
                    LogLine::Purged(p) => last_purged = Some(p),
                }
            }
        }
        Ok(MonStore {
            inner: Arc::new(Mutex::new(Inner {
                dir: dir.to_owned(),
                log,
                last_purged,
                vote,
                committed,
                snapshot,
                snapshot_seq: 0,
            })),
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                changed,
            }),
        })
    }

    /// Whether this monitor has never been part of a raft group.
    pub fn is_pristine(&self) -> bool {
        let i = self.inner.lock().unwrap();
        i.vote.is_none() && i.log.is_empty() && i.snapshot.is_none()
    }
}

#[derive(Serialize, Deserialize)]
enum LogLine {
    Entry(Entry<TypeConfig>),
    Purged(LogId<u64>),
}

impl Inner {
    fn append_lines(&self, lines: &[LogLine]) -> std::io::Result<()> {
        let mut buf = Vec::new();
        for l in lines {
            serde_json::to_writer(&mut buf, l).map_err(io_err)?;
            buf.push(b'\n');
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("raft-log.jsonl"))?;
        f.write_all(&buf)?;
        f.sync_data()
    }

    fn rewrite_log(&self) -> std::io::Result<()> {
        let mut buf = Vec::new();
        if let Some(p) = self.last_purged {
            serde_json::to_writer(&mut buf, &LogLine::Purged(p)).map_err(io_err)?;
            buf.push(b'\n');
        }
        for e in self.log.values() {
            serde_json::to_writer(&mut buf, &LogLine::Entry(e.clone())).map_err(io_err)?;
            buf.push(b'\n');
        }
        write_atomic(&self.dir.join("raft-log.jsonl"), &buf)
    }
}

impl RaftLogReader<TypeConfig> for MonStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SErr> {
        let i = self.inner.lock().unwrap();
        Ok(i.log.range(range).map(|(_, e)| e.clone()).collect())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for MonStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, SErr> {
        let (data, last, membership) = {
            let s = self.shared.state.lock().unwrap();
            (
                serde_json::to_vec(&*s).map_err(|e| StorageIOError::write_state_machine(&e))?,
                s.last_applied,
                s.membership.clone(),
            )
        };
        let mut i = self.inner.lock().unwrap();
        i.snapshot_seq += 1;
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: membership,
            snapshot_id: format!("{}-{}", last.map_or(0, |l| l.index), i.snapshot_seq),
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: data.clone(),
        };
        let bytes =
            serde_json::to_vec(&stored).map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        write_atomic(&i.dir.join("snapshot.json"), &bytes)
            .map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        i.snapshot = Some(stored);
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStorage<TypeConfig> for MonStore {
    type LogReader = Self;
    type SnapshotBuilder = Self;

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), SErr> {
        let mut i = self.inner.lock().unwrap();
        let bytes = serde_json::to_vec(vote).map_err(|e| StorageIOError::write_vote(&e))?;
        write_atomic(&i.dir.join("vote.json"), &bytes)
            .map_err(|e| StorageIOError::write_vote(&e))?;
        i.vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, SErr> {
        Ok(self.inner.lock().unwrap().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), SErr> {
        let mut i = self.inner.lock().unwrap();
        let bytes = serde_json::to_vec(&committed).map_err(|e| StorageIOError::write(&e))?;
        write_atomic(&i.dir.join("committed.json"), &bytes)
            .map_err(|e| StorageIOError::write(&e))?;
        i.committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<u64>>, SErr> {
        Ok(self.inner.lock().unwrap().committed)
    }

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, SErr> {
        let i = self.inner.lock().unwrap();
        let last = i
            .log
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(i.last_purged);
        Ok(LogState {
            last_purged_log_id: i.last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn append_to_log<I>(&mut self, entries: I) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
    {
        let mut i = self.inner.lock().unwrap();
        let lines: Vec<LogLine> = entries.into_iter().map(LogLine::Entry).collect();
        i.append_lines(&lines)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        for l in lines {
            if let LogLine::Entry(e) = l {
                i.log.insert(e.log_id.index, e);
            }
        }
        Ok(())
    }

    async fn delete_conflict_logs_since(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        let mut i = self.inner.lock().unwrap();
        i.log.retain(|idx, _| *idx < log_id.index);
        i.rewrite_log()
            .map_err(|e| StorageIOError::write_logs(&e).into())
    }

    async fn purge_logs_upto(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        let mut i = self.inner.lock().unwrap();
        i.log.retain(|idx, _| *idx > log_id.index);
        i.last_purged = Some(log_id);
        i.rewrite_log()
            .map_err(|e| StorageIOError::write_logs(&e).into())
    }

    async fn last_applied_state(
        &mut self,
    ) -> Result<(Option<LogId<u64>>, StoredMembership<u64, BasicNode>), SErr> {
        let s = self.shared.state.lock().unwrap();
        Ok((s.last_applied, s.membership.clone()))
    }

    async fn apply_to_state_machine(
        &mut self,
        entries: &[Entry<TypeConfig>],
    ) -> Result<Vec<MonResponse>, SErr> {
        let mut out = Vec::with_capacity(entries.len());
        let mut s = self.shared.state.lock().unwrap();
        let before = s.map.epoch;
        for e in entries {
            s.last_applied = Some(e.log_id);
            out.push(match &e.payload {
                EntryPayload::Blank => MonResponse {
                    ok: true,
                    epoch: s.map.epoch,
                    message: String::new(),
                },
                EntryPayload::Normal(cmd) => s.execute(cmd),
                EntryPayload::Membership(m) => {
                    s.membership = StoredMembership::new(Some(e.log_id), m.clone());
                    MonResponse {
                        ok: true,
                        epoch: s.map.epoch,
                        message: String::new(),
                    }
                }
            });
        }
        if s.map.epoch != before {
            let _ = self.shared.changed.send(s.map.epoch);
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let data = snapshot.into_inner();
        let new: MonState = serde_json::from_slice(&data)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        {
            let i = self.inner.lock().unwrap();
            let bytes = serde_json::to_vec(&stored)
                .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
            write_atomic(&i.dir.join("snapshot.json"), &bytes)
                .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        }
        self.inner.lock().unwrap().snapshot = Some(stored);
        let epoch = {
            let mut s = self.shared.state.lock().unwrap();
            *s = new;
            s.map.epoch
        };
        let _ = self.shared.changed.send(epoch);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, SErr> {
        let i = self.inner.lock().unwrap();
        Ok(i.snapshot.as_ref().map(|s| Snapshot {
            meta: s.meta.clone(),
            snapshot: Box::new(Cursor::new(s.data.clone())),
        }))
    }
}

/// Raft RPCs over the messenger.
#[derive(Clone)]
pub struct Network {
    pub msgr: Arc<Messenger>,
    pub timeout: Duration,
}

pub struct Peer {
    msgr: Arc<Messenger>,
    target: u64,
    addr: String,
    conn: Option<Connection>,
    timeout: Duration,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Peer {
        Peer {
            msgr: self.msgr.clone(),
            target,
            addr: node.addr.clone(),
            conn: None,
            timeout: self.timeout,
        }
    }
}

impl Peer {
    async fn call<Req: Serialize, Resp: for<'de> Deserialize<'de>, E>(
        &mut self,
        msg_type: u16,
        req: &Req,
    ) -> Result<Resp, RPCError<u64, BasicNode, E>>
    where
        E: std::error::Error + for<'de> Deserialize<'de>,
    {
        let net = |e: &dyn std::fmt::Display| {
            RPCError::Network(NetworkError::new(&std::io::Error::other(e.to_string())))
        };
        if self.conn.as_ref().is_none_or(|c| !c.is_open()) {
            let msgr = self.msgr.clone();
            let addr: std::net::SocketAddr = self.addr.parse().map_err(|e| net(&e))?;
            let id = Identity::Node(MON_IDENTITY_BASE + self.target as u32);
            let c = tokio::task::spawn_blocking(move || msgr.connect(addr, id))
                .await
                .map_err(|e| net(&e))?
                .map_err(|e| net(&e))?;
            self.conn = Some(c);
        }
        let conn = self.conn.as_ref().unwrap();
        let mut body = wire::Enc::new(0);
        body.0
            .extend_from_slice(&serde_json::to_vec(req).map_err(|e| net(&e))?);
        let (tx, rx) = tokio::sync::oneshot::channel();
        conn.request_with(
            OutMessage::new(msg_type, body.finish()),
            self.timeout,
            move |r| {
                let _ = tx.send(r);
            },
        );
        let reply = rx.await.map_err(|e| net(&e))?.map_err(|e| net(&e))?;
        let (_, body) = wire::parse_reply(&reply.payload).map_err(|e| net(&e))?;
        let r: Result<Resp, E> = serde_json::from_slice(body).map_err(|e| net(&e))?;
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.call(wire::MSG_RAFT_APPEND, &rpc).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        self.call(wire::MSG_RAFT_SNAPSHOT, &rpc).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        _option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.call(wire::MSG_RAFT_VOTE, &rpc).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boot(id: u32) -> MonCommand {
        MonCommand::Boot(NodeInfo {
            id,
            addr: format!("127.0.0.1:{}", 7000 + id).parse().unwrap(),
            host: format!("host{id}"),
            weight: crate::map::WEIGHT_ONE,
            up: true,
            r#in: true,
            devices: vec![],
            up_from: 0,
            auto_out: false,
        })
    }

    /// A node the monitor marked out (down past the grace) comes back in when it is marked
    /// up; one an operator marked out stays out until marked in.
    #[test]
    fn marking_up_undoes_the_monitors_own_mark_out_only() {
        let mut s = MonState::default();
        for id in [1, 2] {
            assert!(s.execute(&boot(id)).ok);
        }
        s.execute(&MonCommand::MarkDown(vec![1, 2]));
        s.execute(&MonCommand::AutoOut(vec![1]));
        s.execute(&MonCommand::MarkOut(vec![2]));
        assert!(s.map.nodes[&1].auto_out && !s.map.nodes[&1].r#in);
        assert!(!s.map.nodes[&2].auto_out && !s.map.nodes[&2].r#in);
        let membership = s.map.membership_epoch;
        for id in [1, 2] {
            assert!(s.execute(&MonCommand::MarkUp(id)).ok);
        }
        let (n1, n2) = (&s.map.nodes[&1], &s.map.nodes[&2]);
        assert!(n1.up && n1.r#in && !n1.auto_out, "{n1:?}");
        assert!(n2.up && !n2.r#in, "{n2:?}");
        assert!(
            s.map.membership_epoch > membership,
            "coming back in moves members"
        );
    }

    /// A deleted pool's id is never given to a later pool (its keys may still be on a node's
    /// devices), also when it was the newest; deleting an unknown pool is refused.
    #[test]
    fn deleted_pools_ids_are_never_reused() {
        let mut s = MonState::default();
        let create = |name: &str| MonCommand::CreatePool {
            name: name.into(),
            k: 2,
            m: 1,
            stripe_unit: 4096,
            pg_num: 4,
            min_size: None,
        };
        let delete = |name: &str| MonCommand::DeletePool { name: name.into() };
        assert!(s.execute(&create("a")).ok);
        assert!(s.execute(&create("b")).ok);
        assert_eq!(s.map.pool_by_name("b").unwrap().id, 2);
        let epoch = s.map.epoch;
        assert!(s.execute(&delete("b")).ok);
        assert_eq!(s.map.epoch, epoch + 1);
        assert!(s.map.pool_by_name("b").is_none());
        assert!(s.map.is_deleted_pool(2) && !s.map.is_deleted_pool(1));
        assert!(!s.map.is_deleted_pool(3), "not created yet");
        assert!(s.execute(&create("b")).ok);
        assert_eq!(s.map.pool_by_name("b").unwrap().id, 3);
        assert!(s.map.is_deleted_pool(2));
        let r = s.execute(&delete("nope"));
        assert!(!r.ok && r.message.contains("no pool \"nope\""), "{r:?}");
        assert!(s.execute(&delete("a")).ok);
        assert!(s.execute(&delete("b")).ok);
        assert!(s.map.pools.is_empty());
        assert!(s.execute(&create("c")).ok);
        assert_eq!(s.map.pool_by_name("c").unwrap().id, 4);
        // A node applying the same incrementals computes the same.
        let mut m = crate::map::ClusterMap::default();
        for inc in &s.history {
            m.apply(inc).unwrap();
        }
        assert_eq!(m, s.map);
    }
}
