//! The monitor: authority for the cluster map, replicated with openraft.
//!
//! Nodes register (`Boot`) and send heartbeats to every monitor; the raft leader marks a node
//! down after `down_grace` without one and out after `out_grace` down. Each map change is a
//! raft entry; applying it bumps the epoch and the monitor pushes the incrementals to every
//! subscribed connection (nodes and clients). Map reads are served by any monitor from its
//! applied state; commands go to the leader (others answer `NotLeader` naming it).

mod metrics;
pub mod raft;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use messenger::{Connection, Dispatcher, Identity, Incoming, Messenger, OutMessage, Secret};
use openraft::storage::Adaptor;
use openraft::{BasicNode, ServerState};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::config::MonitorConfig;
use crate::error::{Error, Result};
use crate::map::{ClusterMap, Incremental};
use crate::placement::Acting;
use crate::wire::{self, Dec, Enc, Status, MON_IDENTITY_BASE};
use raft::{MonCommand, MonStore, Network, Raft};

/// How long a map change may wait to be committed by a majority of monitors.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the leader checks heartbeats.
const LIVENESS_TICK: Duration = Duration::from_millis(200);
/// Hot objects a status report names.
const HOT_OBJECTS_MAX: usize = 8;

/// A map (full) or the incrementals that bring the asker up to date.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct MapReply {
    pub full: Option<ClusterMap>,
    pub incs: Vec<Incremental>,
}

/// Cumulative counters a node reports in each heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct NodeStats {
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub shards: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    /// Ops slow within the last minute, or slow and still running.
    #[serde(default)]
    pub slow_ops: u64,
    /// The longest of those, in milliseconds.
    #[serde(default)]
    pub slow_longest_ms: u64,
    /// Scrub and repair counters (docs/architecture.md, "Scrub and repair").
    #[serde(default)]
    pub scrub: crate::node::scrub::ScrubStats,
    /// The node's hottest objects (`node/hot.rs`).
    #[serde(default)]
    pub hot: Vec<crate::node::hot::HotObject>,
    /// Client ops served in coalesced batches of more than one.
    #[serde(default)]
    pub batched_ops: u64,
    /// Data reads served by another read's fetch.
    #[serde(default)]
    pub coalesced_reads: u64,
    /// Data reads served from the hot-object cache.
    #[serde(default)]
    pub cache_hits: u64,
    /// Shard fetches done for client reads.
    #[serde(default)]
    pub read_fetches: u64,
    /// Of those, fetches whose CRC the members' chunk CRCs gave (no summing pass).
    #[serde(default)]
    pub crc_known_fetches: u64,
    /// Messenger loop passes, and those that woke to find nothing to do.
    #[serde(default)]
    pub msgr_iterations: u64,
    #[serde(default)]
    pub msgr_empty_iterations: u64,
    /// The node process's CPU time (user + system).
    #[serde(default)]
    pub cpu_ns: u64,
    /// When the node took these figures (its clock), for rates from two reports.
    #[serde(default)]
    pub at_unix_ns: u64,
    #[serde(default)]
    pub recovery: crate::node::recovery::RecoveryStats,
    /// Large replies of hot objects that waited behind other replies (`node/hot.rs`).
    #[serde(default)]
    pub paced_replies: u64,
    /// Read-only ops answered on the messenger worker from the caches (`node/hot.rs`).
    #[serde(default)]
    pub inline_reads: u64,
    /// Damaged places (rotten checkpoint or log batches, data items) the node's stores
    /// opened past at its last start (`node/salvage.rs`).
    #[serde(default)]
    pub salvaged: u64,
    /// Failure reports: other nodes this node's pings have had no answer from for two
    /// heartbeat periods or more, with how long (ms) (`node/peerping.rs`).
    #[serde(default)]
    pub silent_peers: Vec<(u32, u64)>,
    /// Deleted pools whose keys the node is still removing (`node/strays.rs`), and the keys
    /// of deleted pools it removed since it started.
    #[serde(default)]
    pub deleting_pools: Vec<u64>,
    #[serde(default)]
    pub deleted_pool_keys: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct IoRates {
    pub read_ops_s: f64,
    pub write_ops_s: f64,
    pub read_bytes_s: f64,
    pub write_bytes_s: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    pub fsid: String,
    pub health: String,
    pub health_detail: Vec<String>,
    pub epoch: u64,
    /// (id, address, raft role)
    pub monitors: Vec<(u32, String, String)>,
    pub leader: Option<u64>,
    pub nodes_total: usize,
    pub nodes_up: usize,
    pub nodes_in: usize,
    pub pools: Vec<crate::map::PoolInfo>,
    pub pg_total: usize,
    pub pg_states: BTreeMap<String, usize>,
    pub shards: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub io: IoRates,
    /// Scrub and repair counters summed over the up nodes; `last_complete_unix` is the
    /// oldest node's last complete pass.
    #[serde(default)]
    pub scrub: crate::node::scrub::ScrubStats,
    /// The hottest objects cluster-wide (each names the node that reported it).
    #[serde(default)]
    pub hot_objects: Vec<crate::node::hot::HotObject>,
    /// Each up node's last heartbeat figures.
    #[serde(default)]
    pub node_stats: BTreeMap<u32, NodeStats>,
    /// Recovery summed over the up nodes.
    #[serde(default)]
    pub recovery: crate::node::recovery::RecoveryStats,
}

struct Seen {
    at: Instant,
    stats: NodeStats,
    rates: IoRates,
}

pub struct Monitor {
    cfg: MonitorConfig,
    rt: tokio::runtime::Runtime,
    raft: OnceLock<Raft>,
    store: MonStore,
    subs: Mutex<Vec<(Connection, u64)>>,
    seen: Mutex<HashMap<u32, Seen>>,
    down_since: Mutex<HashMap<u32, Instant>>,
    /// Leader: since when each up node has been up, as seen from here, with the `up_from` it
    /// had then (failure reports).
    up_since: Mutex<HashMap<u32, (u64, Instant)>>,
}

struct MonDispatcher(OnceLock<Arc<Monitor>>);

impl Dispatcher for MonDispatcher {
    fn handle(&self, mut msg: Incoming) {
        let Some(mon) = self.0.get() else { return };
        let t = msg.msg_type();
        let reply = mon.handle(&msg);
        if msg.is_request() {
            let body =
                reply.unwrap_or_else(|e| wire::reply_err(mon.epoch(), e.status(), &e.message()));
            let _ = msg.reply(OutMessage::new(wire::MSG_REPLY, body));
        } else if let Err(e) = reply {
            warn!("monitor: one-way message type {t} from {}: {e}", msg.peer());
        }
    }
}

impl Monitor {
    fn epoch(&self) -> u64 {
        self.store.shared.state.lock().unwrap().map.epoch
    }

    fn raft(&self) -> &Raft {
        self.raft
            .get()
            .expect("raft started before messages are served")
    }

    fn is_leader(&self) -> bool {
        let m = self.raft().metrics().borrow().clone();
        m.state == ServerState::Leader
    }

    fn map_reply(&self, have: u64) -> MapReply {
        let s = self.store.shared.state.lock().unwrap();
        match s.since(have) {
            Some(incs) if have > 0 => MapReply { full: None, incs },
            _ => MapReply {
                full: Some(s.map.clone()),
                incs: vec![],
            },
        }
    }

    fn handle(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let p: &[u8] = msg.payload();
        let mut d = Dec::new(p);
        let peer_epoch = d.u64()?;
        let body = d.rest();
        let json = |v: &dyn erased::Ser| -> Result<Vec<u8>> {
            Ok(wire::reply_ok(self.epoch(), &v.to_json()?))
        };
        match msg.msg_type() {
            wire::MSG_RAFT_APPEND => {
                let req = serde_json::from_slice(body).map_err(bad)?;
                json(&self.rt.block_on(self.raft().append_entries(req)))
            }
            wire::MSG_RAFT_VOTE => {
                let req = serde_json::from_slice(body).map_err(bad)?;
                json(&self.rt.block_on(self.raft().vote(req)))
            }
            wire::MSG_RAFT_SNAPSHOT => {
                let req = serde_json::from_slice(body).map_err(bad)?;
                json(&self.rt.block_on(self.raft().install_snapshot(req)))
            }
            wire::MSG_MON_GET_MAP => json(&self.map_reply(peer_epoch)),
            wire::MSG_MON_SUBSCRIBE => {
                let r = self.map_reply(peer_epoch);
                let e = self.epoch();
                let mut subs = self.subs.lock().unwrap();
                subs.retain(|(c, _)| c.is_open() && c.id() != msg.conn().id());
                subs.push((msg.conn().clone(), e));
                drop(subs);
                json(&r)
            }
            wire::MSG_MON_COMMAND => {
                let cmd: MonCommand = serde_json::from_slice(body).map_err(bad)?;
                self.command(cmd).and_then(|r| json(&r))
            }
            wire::MSG_MON_HEARTBEAT => {
                let mut d = Dec::new(body);
                let id = d.u32()?;
                let stats: NodeStats = serde_json::from_slice(d.rest()).map_err(bad)?;
                self.heartbeat(id, stats);
                Ok(vec![])
            }
            wire::MSG_MON_STATUS => json(&self.status()),
            t => Err(Error::Malformed(format!(
                "unknown monitor message type {t}"
            ))),
        }
    }

    /// Propose a command (this monitor must be the leader).
    fn command(&self, cmd: MonCommand) -> Result<raft::MonResponse> {
        use openraft::error::{ClientWriteError, RaftError};
        let write = self.raft().client_write(cmd);
        let r = self
            .rt
            .block_on(async { tokio::time::timeout(COMMAND_TIMEOUT, write).await })
            .map_err(|_| {
                Error::Monitor(format!(
                    "no quorum: the change was not committed within {COMMAND_TIMEOUT:?} \
                     (are a majority of monitors up?)"
                ))
            })?;
        match r {
            Ok(r) => Ok(r.data),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => Err(Error::remote(
                Status::NotLeader,
                f.leader_node.map(|n| n.addr).unwrap_or_default(),
            )),
            Err(e) => Err(Error::Monitor(e.to_string())),
        }
    }

    fn heartbeat(&self, id: u32, stats: NodeStats) {
        let now = Instant::now();
        let mut seen = self.seen.lock().unwrap();
        let rates = match seen.get(&id) {
            Some(prev) if now > prev.at && stats.read_ops >= prev.stats.read_ops => {
                let dt = (now - prev.at).as_secs_f64().max(1e-3);
                IoRates {
                    read_ops_s: (stats.read_ops - prev.stats.read_ops) as f64 / dt,
                    write_ops_s: stats.write_ops.saturating_sub(prev.stats.write_ops) as f64 / dt,
                    read_bytes_s: stats.read_bytes.saturating_sub(prev.stats.read_bytes) as f64
                        / dt,
                    write_bytes_s: stats.write_bytes.saturating_sub(prev.stats.write_bytes) as f64
                        / dt,
                }
            }
            _ => IoRates::default(),
        };
        seen.insert(
            id,
            Seen {
                at: now,
                stats,
                rates,
            },
        );
    }

    /// Leader only: mark nodes down after the grace (no heartbeat, or failure reports from
    /// their peers: [`reported_by_peers`]), out after the longer one.
    fn liveness_loop(self: Arc<Self>) {
        let mut was_leader = false;
        loop {
            std::thread::sleep(LIVENESS_TICK);
            let leader = self.is_leader();
            let map = self.store.shared.state.lock().unwrap().map.clone();
            let now = Instant::now();
            if leader && !was_leader {
                // A new leader gives every node a full grace period.
                let mut seen = self.seen.lock().unwrap();
                for id in map.nodes.keys() {
                    seen.entry(*id)
                        .and_modify(|s| s.at = s.at.max(now))
                        .or_insert(Seen {
                            at: now,
                            stats: NodeStats::default(),
                            rates: IoRates::default(),
                        });
                }
                self.down_since.lock().unwrap().clear();
                self.up_since.lock().unwrap().clear();
            }
            was_leader = leader;
            if !leader {
                continue;
            }
            let (mut down, mut up) = (Vec::new(), Vec::new());
            let mut cut_off = Vec::new();
            {
                let mut seen = self.seen.lock().unwrap();
                let grace = self.cfg.down_grace();
                // Keyed by `up_from` too: a node that restarts between two ticks is never
                // seen down here, but its boot moves `up_from`.
                let mut up_since = self.up_since.lock().unwrap();
                up_since.retain(|id, _| map.is_up(*id));
                for n in map.nodes.values().filter(|n| n.up) {
                    let e = up_since.entry(n.id).or_insert((n.up_from, now));
                    if e.0 != n.up_from {
                        *e = (n.up_from, now);
                    }
                }
                let reported = reported_by_peers(
                    seen.iter()
                        .filter(|(id, s)| map.is_up(**id) && now.duration_since(s.at) < grace)
                        .map(|(id, s)| (*id, s.at, &s.stats.silent_peers[..])),
                    |id| up_since.get(&id).map(|e| e.1),
                    grace,
                );
                drop(up_since);
                for n in map.nodes.values() {
                    // A node new to this leader gets a full grace period.
                    let last = Some(
                        seen.entry(n.id)
                            .or_insert(Seen {
                                at: now,
                                stats: NodeStats::default(),
                                rates: IoRates::default(),
                            })
                            .at,
                    );
                    let fresh = last.is_some_and(|t| now.duration_since(t) < grace);
                    let by_peers = reported.get(&n.id);
                    if n.up && !fresh {
                        down.push(n.id);
                    } else if n.up {
                        if let Some(r) = by_peers {
                            cut_off.push((n.id, r.clone()));
                        }
                    } else if fresh
                        && by_peers.is_none()
                        && last.is_some_and(|t| t > now - LIVENESS_TICK * 3)
                    {
                        up.push(n.id);
                    }
                }
            }
            let mut out = Vec::new();
            {
                let mut ds = self.down_since.lock().unwrap();
                for n in map.nodes.values() {
                    if n.up {
                        ds.remove(&n.id);
                    } else {
                        let since = *ds.entry(n.id).or_insert(now);
                        if n.r#in && now.duration_since(since) >= self.cfg.out_grace() {
                            out.push(n.id);
                        }
                    }
                }
            }
            if !down.is_empty() {
                info!(
                    "monitor: marking down {down:?} (no heartbeat for {:?})",
                    self.cfg.down_grace()
                );
                let _ = self.command(MonCommand::MarkDown(down));
            }
            if !cut_off.is_empty() {
                for (id, by) in &cut_off {
                    info!(
                        "monitor: marking down node {id}: its heartbeats arrive, but nodes \
                         {by:?} have had no answer to their pings for {:?} or longer",
                        self.cfg.down_grace()
                    );
                }
                let _ = self.command(MonCommand::MarkDown(
                    cut_off.into_iter().map(|(id, _)| id).collect(),
                ));
            }
            for id in up {
                let _ = self.command(MonCommand::MarkUp(id));
            }
            if !out.is_empty() {
                info!(
                    "monitor: marking out {out:?} (down for {:?})",
                    self.cfg.out_grace()
                );
                let _ = self.command(MonCommand::AutoOut(out));
            }
        }
    }

    /// Push new epochs to subscribers.
    fn push_loop(self: Arc<Self>, rx: crossbeam::channel::Receiver<u64>) {
        for _ in rx {
            let s = self.store.shared.state.lock().unwrap();
            let epoch = s.map.epoch;
            let mut subs = self.subs.lock().unwrap();
            subs.retain(|(c, _)| c.is_open());
            for (c, have) in subs.iter_mut() {
                if *have >= epoch {
                    continue;
                }
                let reply = match s.since(*have) {
                    Some(incs) => MapReply { full: None, incs },
                    None => MapReply {
                        full: Some(s.map.clone()),
                        incs: vec![],
                    },
                };
                let mut e = Enc::new(epoch);
                e.0.extend_from_slice(&serde_json::to_vec(&reply).expect("map serializes"));
                if c.send_oneway(OutMessage::new(wire::MSG_MON_MAP_PUSH, e.finish()))
                    .is_ok()
                {
                    *have = epoch;
                }
            }
        }
    }

    /// One health line per up node whose last report `line` has something to say about.
    fn node_details(
        &self,
        map: &ClusterMap,
        line: impl Fn(u32, &NodeStats) -> Option<String>,
    ) -> Vec<String> {
        let seen = self.seen.lock().unwrap();
        map.nodes
            .values()
            .filter(|n| n.up)
            .filter_map(|n| line(n.id, &seen.get(&n.id)?.stats))
            .collect()
    }

    /// "N slow ops on node X, oldest Y s" for each up node that reported slow ops.
    fn slow_op_details(&self, map: &ClusterMap) -> Vec<String> {
        self.node_details(map, |id, s| {
            (s.slow_ops > 0).then(|| {
                format!(
                    "{} slow ops on node {id}, oldest {:.1} s",
                    s.slow_ops,
                    s.slow_longest_ms as f64 / 1000.0
                )
            })
        })
    }

    /// "node X has had no answer from node(s) [..] for N s" for each up node whose pings of
    /// up peers have gone unanswered for the down grace: the peers' failure reports that did
    /// not (yet) get a node marked down — one broken path between two nodes (one reporter
    /// each) stays here, and writes of the PGs holding both wait on it.
    fn unreachable_details(&self, map: &ClusterMap) -> Vec<String> {
        let grace = self.cfg.down_grace();
        self.node_details(map, |id, s| {
            let silent: Vec<(u32, u64)> = s
                .silent_peers
                .iter()
                .copied()
                .filter(|(n, ms)| map.is_up(*n) && Duration::from_millis(*ms) >= grace)
                .collect();
            let longest = silent.iter().map(|e| e.1).max()?;
            let peers: Vec<u32> = silent.iter().map(|e| e.0).collect();
            Some(format!(
                "node {id} has had no answer from up node(s) {peers:?} for up to {:.1} s \
                 (network path between them?)",
                longest as f64 / 1000.0
            ))
        })
    }

    /// "node X opened its store past N damaged place(s) …" for each up node whose stores
    /// did at its last start: the device rotted, which an operator should hear of even
    /// though the cluster repairs the shards. Clears when the node restarts clean.
    fn salvage_details(&self, map: &ClusterMap) -> Vec<String> {
        self.node_details(map, |id, s| {
            (s.salvaged > 0).then(|| {
                format!(
                    "node {id} opened its store past {} damaged place(s) at its last start \
                     (see its log); the shards affected are rebuilt by scrub and recovery",
                    s.salvaged
                )
            })
        })
    }

    pub fn status(&self) -> StatusReport {
        let map = self.store.shared.state.lock().unwrap().map.clone();
        let metrics = self.raft().metrics().borrow().clone();
        let mut pg_states: BTreeMap<String, usize> = BTreeMap::new();
        let mut pg_total = 0;
        for p in map.pools.values() {
            for pg in 0..p.pg_num {
                let a = Acting::compute(&map, p, pg);
                *pg_states.entry(a.state(p).to_string()).or_default() += 1;
                pg_total += 1;
            }
        }
        let mut detail = Vec::new();
        let up = map.nodes.values().filter(|n| n.up).count();
        let inn = map.nodes.values().filter(|n| n.r#in).count();
        let downs: Vec<u32> = map.nodes.values().filter(|n| !n.up).map(|n| n.id).collect();
        if !downs.is_empty() {
            detail.push(format!("{} node(s) down: {downs:?}", downs.len()));
        }
        for (state, n) in &pg_states {
            match state.as_str() {
                "active+clean" => {}
                "active+degraded" => detail.push(format!("{n} pgs degraded (writable)")),
                "undersized" => {
                    detail.push(format!("{n} pgs undersized: readable, writes blocked"))
                }
                _ => detail.push(format!("{n} pgs down: objects unavailable")),
            }
        }
        let recovery = {
            let seen = self.seen.lock().unwrap();
            let mut r = crate::node::recovery::RecoveryStats::default();
            for n in map.nodes.values().filter(|n| n.up) {
                if let Some(s) = seen.get(&n.id) {
                    r.add(&s.stats.recovery);
                }
            }
            r
        };
        if recovery.active() {
            detail.push(format!(
                "recovering: {} object(s) ({:.1} MiB) left, {} pg(s) pending",
                recovery.objects_left,
                recovery.bytes_left as f64 / (1u64 << 20) as f64,
                recovery.pgs_pending
            ));
        }
        detail.extend(self.slow_op_details(&map));
        detail.extend(self.salvage_details(&map));
        detail.extend(self.unreachable_details(&map));
        let health = if pg_states.contains_key("down") {
            "HEALTH_ERR"
        } else if detail.is_empty() {
            "HEALTH_OK"
        } else {
            "HEALTH_WARN"
        };
        let seen = self.seen.lock().unwrap();
        let mut io = IoRates::default();
        let (mut shards, mut used, mut cap) = (0, 0, 0);
        let mut scrub = crate::node::scrub::ScrubStats::default();
        let mut node_stats = BTreeMap::new();
        for n in map.nodes.values().filter(|n| n.up) {
            if let Some(s) = seen.get(&n.id) {
                node_stats.insert(n.id, s.stats.clone());
                io.read_ops_s += s.rates.read_ops_s;
                io.write_ops_s += s.rates.write_ops_s;
                io.read_bytes_s += s.rates.read_bytes_s;
                io.write_bytes_s += s.rates.write_bytes_s;
                shards += s.stats.shards;
                scrub.add(&s.stats.scrub);
                used += s.stats.used_bytes;
                cap += s.stats.capacity_bytes;
            }
        }
        let monitors = self
            .cfg
            .monitors
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let id = i as u64 + 1;
                let role = if metrics.current_leader == Some(id) {
                    "leader"
                } else if metrics
                    .membership_config
                    .membership()
                    .get_node(&id)
                    .is_some()
                {
                    "peon"
                } else {
                    "unknown"
                };
                (id as u32, a.to_string(), role.to_string())
            })
            .collect();
        StatusReport {
            fsid: map.fsid.clone(),
            health: health.into(),
            health_detail: detail,
            epoch: map.epoch,
            monitors,
            leader: metrics.current_leader,
            nodes_total: map.nodes.len(),
            nodes_up: up,
            nodes_in: inn,
            pools: map.pools.values().cloned().collect(),
            pg_total,
            pg_states,
            shards,
            used_bytes: used,
            capacity_bytes: cap,
            io,
            scrub,
            hot_objects: crate::node::hot::merge_hottest(
                node_stats
                    .iter()
                    .map(|(id, s)| (*id, s.hot.clone()))
                    .collect(),
                HOT_OBJECTS_MAX,
            ),
            node_stats,
            recovery,
        }
    }
}

fn bad(e: serde_json::Error) -> Error {
    Error::Malformed(e.to_string())
}

/// Serialize anything to JSON behind a trait object (for the reply helper).
mod erased {
    pub trait Ser {
        fn to_json(&self) -> crate::Result<Vec<u8>>;
    }
    impl<T: serde::Serialize> Ser for T {
        fn to_json(&self) -> crate::Result<Vec<u8>> {
            serde_json::to_vec(self).map_err(|e| crate::Error::Malformed(e.to_string()))
        }
    }
}

/// Run a monitor until the process is killed.
pub fn run(cfg: MonitorConfig) -> Result<()> {
    let started = start(cfg)?;
    info!("monitor {} serving", started.cfg.id);
    loop {
        std::thread::park();
    }
}

/// Start a monitor's threads; returns once it serves.
pub fn start(cfg: MonitorConfig) -> Result<Arc<Monitor>> {
    let secret = Secret::load(&cfg.key_file)?;
    let listen: SocketAddr = cfg.monitors[cfg.id as usize - 1];
    let (tx, rx) = crossbeam::channel::unbounded();
    let store = MonStore::open(&cfg.data_dir, &cfg.fsid, tx)
        .map_err(|e| Error::io(format!("monitor data dir {}", cfg.data_dir.display()), e))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name_fn(|| {
            // Numbered so `top -H` tells the runtime's threads apart.
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            format!("mon-raft-{n}")
        })
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))?;
    let disp = Arc::new(MonDispatcher(OnceLock::new()));
    let msgr = Arc::new(Messenger::new(
        messenger::Config {
            handler_threads: 4,
            // Many processes share few cores: sleep right away instead of spinning.
            busy_poll: Duration::ZERO,
            ..messenger::Config::default()
        },
        Identity::Node(MON_IDENTITY_BASE + cfg.id),
        secret,
        disp.clone(),
    )?);
    let mon = Arc::new(Monitor {
        cfg: cfg.clone(),
        rt,
        raft: OnceLock::new(),
        store: store.clone(),
        subs: Mutex::new(Vec::new()),
        seen: Mutex::new(HashMap::new()),
        down_since: Mutex::new(HashMap::new()),
        up_since: Mutex::new(HashMap::new()),
    });
    let raft_cfg = openraft::Config {
        cluster_name: format!("nvstore-{}", cfg.fsid),
        heartbeat_interval: 100,
        election_timeout_min: 400,
        election_timeout_max: 800,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(1000),
        max_in_snapshot_log_to_keep: 100,
        ..openraft::Config::default()
    }
    .validate()
    .map_err(|e| Error::Config(e.to_string()))?;
    let pristine = store.is_pristine();
    let (log_store, sm) = Adaptor::new(store);
    let net = Network {
        msgr: msgr.clone(),
        timeout: Duration::from_secs(2),
    };
    let raft = mon
        .rt
        .block_on(Raft::new(
            cfg.id as u64,
            Arc::new(raft_cfg),
            net,
            log_store,
            sm,
        ))
        .map_err(|e| Error::Monitor(e.to_string()))?;
    let _ = mon.raft.set(raft);
    let _ = disp.0.set(mon.clone());
    msgr.listen(listen)?;
    mon.start_metrics(&msgr)?;
    if pristine && cfg.id == 1 {
        let members: BTreeMap<u64, BasicNode> = cfg
            .monitors
            .iter()
            .enumerate()
            .map(|(i, a)| {
                (
                    i as u64 + 1,
                    BasicNode {
                        addr: a.to_string(),
                    },
                )
            })
            .collect();
        mon.rt
            .block_on(mon.raft().initialize(members))
            .map_err(|e| Error::Monitor(format!("initialize raft: {e}")))?;
    }
    // The messenger lives as long as the process (its threads hold what they need).
    std::mem::forget(msgr);
    let m = mon.clone();
    std::thread::Builder::new()
        .name("mon-push".into())
        .spawn(move || m.push_loop(rx))
        .map_err(|e| Error::io("spawn", e))?;
    let m = mon.clone();
    std::thread::Builder::new()
        .name("mon-liveness".into())
        .spawn(move || m.liveness_loop())
        .map_err(|e| Error::io("spawn", e))?;
    Ok(mon)
}

/// Up nodes that must report a node silent before the monitor marks it down on their word
/// (Ceph's `mon_osd_min_down_reporters`): one node cut off from all others reports every one
/// of them, but each of those is reported by it alone.
pub const MIN_DOWN_REPORTERS: usize = 2;

/// Nodes that at least [`MIN_DOWN_REPORTERS`] reporters have pinged without an answer for
/// `grace` or longer: node → its reporters. `reports` are (reporter, when its report came,
/// its silent peers with how long in ms) from reporters that are up and heard from within
/// the grace. A report counts against an up node only if the node had been up (`up_since`,
/// as this monitor saw it) for the grace when the report came: a node that just came up has
/// not been pinged yet, and the reports sent before it did still call it silent.
fn reported_by_peers<'a>(
    reports: impl Iterator<Item = (u32, Instant, &'a [(u32, u64)])>,
    up_since: impl Fn(u32) -> Option<Instant>,
    grace: Duration,
) -> BTreeMap<u32, Vec<u32>> {
    let mut by: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (reporter, at, silent) in reports {
        for &(node, ms) in silent {
            let up_long = up_since(node).is_none_or(|t| at.saturating_duration_since(t) >= grace);
            if node != reporter && Duration::from_millis(ms) >= grace && up_long {
                by.entry(node).or_default().push(reporter);
            }
        }
    }
    by.retain(|_, r| {
        r.sort_unstable();
        r.dedup();
        r.len() >= MIN_DOWN_REPORTERS
    });
    by
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node is reported when two reporters have had no answer for the whole grace; one
    /// reporter (a node cut off from the others reports them all) or a shorter silence is
    /// not enough.
    #[test]
    fn a_node_is_reported_by_two_peers_silent_for_the_grace() {
        let grace = Duration::from_millis(1000);
        // Node 5 is cut off: it reports 1..4; 1, 2 and 3 report it (3 not for long yet).
        let r5: &[(u32, u64)] = &[(1, 3000), (2, 3000), (3, 3000), (4, 3000)];
        let r1: &[(u32, u64)] = &[(5, 2500)];
        let r2: &[(u32, u64)] = &[(5, 1000)];
        let r3: &[(u32, u64)] = &[(5, 400)];
        let now = Instant::now();
        let at = |r: &'static [(u32, u64)], id: u32| (id, now, r);
        let down = |_: u32| None;
        let by = reported_by_peers(
            [at(r5, 5), at(r1, 1), at(r2, 2), at(r3, 3), at(&[], 4)].into_iter(),
            down,
            grace,
        );
        assert_eq!(by.into_iter().collect::<Vec<_>>(), vec![(5, vec![1, 2])]);
        // One reporter, or reporters silent for less than the grace: nobody.
        assert!(reported_by_peers([at(r1, 1), at(r3, 3)].into_iter(), down, grace).is_empty());
        // A node does not report itself; one reporter counted once.
        let twice: &[(u32, u64)] = &[(5, 2000), (5, 2000)];
        let own: &[(u32, u64)] = &[(1, 2000)];
        assert!(
            reported_by_peers([(1, now, twice), (1, now, own)].into_iter(), down, grace).is_empty()
        );
        // Node 5 came up 0.5 s before the reports: they do not count yet; after the grace
        // they do.
        let up = |n: u32| (n == 5).then(|| now - Duration::from_millis(500));
        assert!(reported_by_peers([at(r1, 1), at(r2, 2)].into_iter(), up, grace).is_empty());
        let later = now + Duration::from_millis(600);
        let by = reported_by_peers([(1, later, r1), (2, later, r2)].into_iter(), up, grace);
        assert_eq!(by.len(), 1);
    }
}
