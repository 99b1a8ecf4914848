//! Talking to the monitors: map subscription, commands (with leader redirect), heartbeats,
//! status. Used by nodes and clients alike.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use messenger::{Connection, Identity, Messenger, OutMessage};

use crate::error::{Error, Result};
use crate::map::{Change, ClusterMap, PoolInfo};
use crate::monitor::raft::{MonCommand, MonResponse};
use crate::monitor::{MapReply, NodeStats, StatusReport};
use crate::placement::Acting;
use crate::wire::{self, Enc, Status, MON_IDENTITY_BASE};

/// How long one monitor request may take.
const MON_REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a command keeps looking for a leader.
const MON_COMMAND_DEADLINE: Duration = Duration::from_secs(20);
/// Map poll / re-subscribe period (pushes usually arrive first).
pub const MAP_POLL_PERIOD: Duration = Duration::from_millis(500);

/// (epoch, (pool, pg) → placement at that epoch).
type PlacementMemo = (u64, HashMap<(u64, u32), Arc<Acting>>);

pub struct MonClient {
    msgr: Arc<Messenger>,
    monitors: Vec<SocketAddr>,
    cur: Mutex<usize>,
    /// One lock per monitor: a slow connect to one does not hold up the others.
    conns: Vec<Mutex<Option<Connection>>>,
    map: RwLock<Arc<ClusterMap>>,
    /// Held while a map reply is applied: one update at a time, computed outside `map`'s
    /// lock (a change that moves members recomputes slot pins over every PG), so readers
    /// wait only for the swap.
    applying: Mutex<()>,
    epoch: (Mutex<u64>, Condvar),
    /// PG placements computed at one epoch (placement hashing is not free on every op).
    placement: Mutex<PlacementMemo>,
    /// Epoch of the last map change to any node's state (boot, up/down, in/out).
    node_change_epoch: std::sync::atomic::AtomicU64,
}

impl MonClient {
    pub fn new(msgr: Arc<Messenger>, monitors: Vec<SocketAddr>) -> Arc<MonClient> {
        let n = monitors.len();
        Arc::new(MonClient {
            msgr,
            monitors,
            cur: Mutex::new(0),
            conns: (0..n).map(|_| Mutex::new(None)).collect(),
            map: RwLock::new(Arc::new(ClusterMap::default())),
            applying: Mutex::new(()),
            epoch: (Mutex::new(0), Condvar::new()),
            placement: Mutex::new((0, HashMap::new())),
            node_change_epoch: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.read().unwrap().clone()
    }

    /// Where a PG stands under `map` (memoised per epoch).
    pub fn acting(&self, map: &ClusterMap, pool: &PoolInfo, pg: u32) -> Arc<Acting> {
        let mut c = self.placement.lock().unwrap();
        if c.0 != map.epoch {
            c.0 = map.epoch;
            c.1.clear();
        }
        c.1.entry((pool.id, pg))
            .or_insert_with(|| Arc::new(Acting::compute(map, pool, pg)))
            .clone()
    }

    /// Epoch of the last change to any node's state seen. A primary's cached view of its
    /// PGs' objects is only trusted while this stays the same (it may have stopped being the
    /// primary, or a member may have been down, in between).
    pub fn node_change_epoch(&self) -> u64 {
        self.node_change_epoch
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn epoch(&self) -> u64 {
        self.map.read().unwrap().epoch
    }

    fn conn(&self, i: usize) -> Result<Connection> {
        // Held across the connect so racing threads share one connection. A connection that
        // is reconnecting is kept (the messenger brings it back); its requests fail meanwhile.
        let mut slot = self.conns[i].lock().unwrap();
        if let Some(c) = &*slot {
            if c.state() != "closed" {
                return Ok(c.clone());
            }
        }
        let c = self.msgr.connect(
            self.monitors[i],
            Identity::Node(MON_IDENTITY_BASE + i as u32 + 1),
        )?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// One request to the current monitor, moving on to the next one on connection errors.
    fn request(&self, msg_type: u16, body: &[u8]) -> Result<Vec<u8>> {
        let n = self.monitors.len();
        let mut last = None;
        for _ in 0..n {
            let i = *self.cur.lock().unwrap();
            let mut e = Enc::new(self.epoch());
            e.0.extend_from_slice(body);
            let r = self.conn(i).and_then(|c| {
                Ok(c.request(OutMessage::new(msg_type, e.finish()), MON_REQUEST_TIMEOUT)?)
            });
            match r {
                Ok(reply) => return Ok(reply.payload.to_vec()),
                Err(err) => {
                    last = Some(err);
                    *self.cur.lock().unwrap() = (i + 1) % n;
                }
            }
        }
        Err(Error::Monitor(format!(
            "no monitor of {:?} answered: {}",
            self.monitors,
            last.map_or("no monitors configured".into(), |e| e.to_string())
        )))
    }

    /// Apply a map reply; returns whether the map is complete (no gap).
    pub fn apply(&self, r: MapReply) -> bool {
        let _one = self.applying.lock().unwrap();
        let mut ok = true;
        let mut node_change = None;
        let mut base = self.map.read().unwrap().clone();
        let mut changed = false;
        if let Some(full) = r.full {
            if full.epoch > base.epoch || base.fsid.is_empty() {
                node_change = Some(full.epoch);
                base = Arc::new(full);
                changed = true;
            }
        }
        let mut next: Option<ClusterMap> = None;
        for inc in &r.incs {
            if inc.epoch <= next.as_ref().map_or(base.epoch, |n| n.epoch) {
                continue;
            }
            let n = next.get_or_insert_with(|| (*base).clone());
            if n.apply(inc).is_err() {
                ok = false;
                break;
            }
            if inc
                .changes
                .iter()
                .any(|c| !matches!(c, Change::PoolCreate(_) | Change::PoolDelete(_)))
            {
                node_change = Some(inc.epoch);
            }
            changed = true;
        }
        let epoch = {
            let mut m = self.map.write().unwrap();
            if changed {
                *m = next.map_or(base, Arc::new);
            }
            if let Some(e) = node_change {
                self.node_change_epoch
                    .store(e, std::sync::atomic::Ordering::SeqCst);
            }
            m.epoch
        };
        *self.epoch.0.lock().unwrap() = epoch;
        self.epoch.1.notify_all();
        ok
    }

    /// A pushed map update (`MSG_MON_MAP_PUSH` payload).
    pub fn handle_push(&self, payload: &[u8]) {
        if payload.len() < 8 {
            return;
        }
        if let Ok(r) = serde_json::from_slice::<MapReply>(&payload[8..]) {
            if !self.apply(r) {
                // A gap: fetch the whole map.
                let _ = self.fetch_full();
            }
        }
    }

    fn fetch_full(&self) -> Result<()> {
        let mut e = Enc::new(0);
        e.u64(0);
        let reply = self.request_raw_epoch(wire::MSG_MON_GET_MAP, 0)?;
        let (_, body) = wire::parse_reply(&reply)?;
        let r: MapReply =
            serde_json::from_slice(body).map_err(|e| Error::Malformed(e.to_string()))?;
        self.apply(r);
        Ok(())
    }

    fn request_raw_epoch(&self, msg_type: u16, epoch: u64) -> Result<Vec<u8>> {
        let i = *self.cur.lock().unwrap();
        let c = self.conn(i)?;
        let reply = c.request(
            OutMessage::new(msg_type, Enc::new(epoch).finish()),
            MON_REQUEST_TIMEOUT,
        )?;
        Ok(reply.payload.to_vec())
    }

    /// Subscribe (again) to map pushes and catch up now.
    pub fn subscribe(&self) -> Result<u64> {
        let reply = self.request(wire::MSG_MON_SUBSCRIBE, &[])?;
        let (_, body) = wire::parse_reply(&reply)?;
        let r: MapReply =
            serde_json::from_slice(body).map_err(|e| Error::Malformed(e.to_string()))?;
        if !self.apply(r) {
            self.fetch_full()?;
        }
        Ok(self.epoch())
    }

    /// Keep the map current in the background (re-subscribing, which also survives monitor
    /// failover).
    pub fn start_poller(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("monc-poll".into())
            .spawn(move || loop {
                std::thread::sleep(MAP_POLL_PERIOD);
                let Some(me) = me.upgrade() else { return };
                let _ = me.subscribe();
            })
            .expect("spawn map poller");
    }

    /// Wait until the map is at least at `epoch`.
    pub fn wait_epoch(&self, epoch: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut e = self.epoch.0.lock().unwrap();
        while *e < epoch {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            e = self.epoch.1.wait_timeout(e, deadline - now).unwrap().0;
        }
        true
    }

    /// Wait for any map change after `epoch` (or the timeout).
    pub fn wait_change(&self, epoch: u64, timeout: Duration) {
        self.wait_epoch(epoch + 1, timeout);
    }

    /// Send a command to the leader (following redirects) and wait until the local map has
    /// caught up with its result.
    pub fn command(&self, cmd: &MonCommand) -> Result<MonResponse> {
        let body = serde_json::to_vec(cmd).expect("commands serialize");
        let deadline = Instant::now() + MON_COMMAND_DEADLINE;
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.request(wire::MSG_MON_COMMAND, &body).and_then(|r| {
                let (_, b) = wire::parse_reply(&r)?;
                serde_json::from_slice::<MonResponse>(b)
                    .map_err(|e| Error::Malformed(e.to_string()))
            }) {
                Ok(r) => {
                    if r.ok {
                        let _ = self.subscribe();
                        self.wait_epoch(r.epoch, Duration::from_secs(5));
                    }
                    return Ok(r);
                }
                Err(Error::Remote {
                    status: Status::NotLeader,
                    message,
                }) => {
                    let hint = message.parse::<SocketAddr>().ok();
                    let mut cur = self.cur.lock().unwrap();
                    *cur = hint
                        .and_then(|a| self.monitors.iter().position(|m| *m == a))
                        .unwrap_or((*cur + 1) % self.monitors.len());
                    last = "no leader elected yet".into();
                }
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(Error::Monitor(format!(
            "command {cmd:?} found no monitor leader within {MON_COMMAND_DEADLINE:?}: {last}"
        )))
    }

    pub fn status(&self) -> Result<StatusReport> {
        let reply = self.request(wire::MSG_MON_STATUS, &[])?;
        let (_, body) = wire::parse_reply(&reply)?;
        serde_json::from_slice(body).map_err(|e| Error::Malformed(e.to_string()))
    }

    /// A heartbeat to every monitor (one-way; unreachable monitors are skipped).
    pub fn heartbeat(&self, node: u32, stats: &NodeStats) {
        let mut e = Enc::new(self.epoch());
        e.u32(node);
        e.0.extend_from_slice(&serde_json::to_vec(stats).expect("stats serialize"));
        let body = Arc::new(e.finish());
        for i in 0..self.monitors.len() {
            if let Ok(c) = self.conn(i) {
                let _ = c.send_oneway(OutMessage::new(wire::MSG_MON_HEARTBEAT, body.clone()));
            }
        }
    }
}
