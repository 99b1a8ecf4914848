//! Peer pings: the failure reports that let the monitor see an asymmetric partition.
//!
//! The monitor's heartbeats show only whether a node reaches the *monitor*. A node whose
//! network to its peers is cut while its path to the monitor works stays up in the map, and
//! every write of a PG it is a member of waits on its shard (writes need every up member).
//! So each node pings its peers once per heartbeat period on a connection of its own (`node-peer-ping` thread, `MSG_PEER_PING`, answered on the receiving messenger
//! worker), and its heartbeat lists the peers it has had no answer from for two periods or
//! more, with how long (`NodeStats::silent_peers`); a peer's silence counts from its last
//! answer, or from when this node saw it come up since (a peer just back was not pinged
//! yet). The monitor marks a node down when at least two up nodes report it silent for the
//! whole `down_grace`, and keeps it down (its own heartbeats notwithstanding) until fewer
//! do — Ceph's failure reports with `mon_osd_min_down_reporters` = 2. One node cut off from
//! everyone reports all of them, but each of those has one reporter only, so only the
//! cut-off node goes down; a silent up peer also shows in `nvstore status`.
//!
//! A node's peers ([`peers_of`]) are the other members, up or down, of every PG it is a
//! member of — the nodes whose shards its writes wait on, and which wait on its — topped up
//! with the next nodes by id to at least [`MIN_PEERS`], like Ceph's heartbeat peers
//! (`osd_heartbeat_min_peers`). On a small cluster that is every node; on a large one a node
//! pings its PG peers, not the whole map (connections and pings grow with the PGs per node,
//! not with the node count squared).
//!
//! A connection whose ping fails is closed and dialled afresh (on a thread of its own) at the
//! next ping. Nodes the map marks down are pinged every [`DOWN_EVERY`] periods only (a dead
//! node's refused connects are logged), but are pinged: that is how their reporters see them
//! answer again, stop reporting them, and let the monitor mark them up. Nodes down and out
//! hold no PGs and are neither pinged nor reported.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use messenger::{Connection, Identity, OutMessage};

use super::Node;
use crate::map::ClusterMap;
use crate::placement::pg_members;
use crate::wire::{self, Enc};

/// A node down in the map is pinged once per this many periods.
const DOWN_EVERY: u64 = 8;
/// Silence shorter than this many periods is not reported (one lost ping is no failure).
const SILENT_PERIODS: u32 = 2;
/// Fewest peers a node pings (when it has fewer PG peers, the next nodes by id): enough that
/// a node has two reporters however few PGs it shares (Ceph's `osd_heartbeat_min_peers`).
pub const MIN_PEERS: usize = 10;

/// The nodes `me` pings: every other member, up or down, of each PG `me` is a member of; then,
/// while that is fewer than [`MIN_PEERS`], the nodes after `me` by id (wrapping around).
/// Nodes down and out hold no PGs and are not pinged.
pub fn peers_of(map: &ClusterMap, me: u32) -> BTreeSet<u32> {
    let candidate = |id: u32| id != me && map.nodes.get(&id).is_some_and(|n| n.up || n.r#in);
    let mut peers = BTreeSet::new();
    for pool in map.pools.values() {
        for pg in 0..pool.pg_num {
            let members = pg_members(map, pool, pg);
            if members.contains(&Some(me)) {
                peers.extend(members.into_iter().flatten().filter(|id| candidate(*id)));
            }
        }
    }
    let ids: Vec<u32> = map
        .nodes
        .keys()
        .copied()
        .filter(|id| candidate(*id))
        .collect();
    let after = ids.partition_point(|id| *id < me);
    for i in 0..ids.len() {
        if peers.len() >= MIN_PEERS {
            break;
        }
        peers.insert(ids[(after + i) % ids.len()]);
    }
    peers
}

/// What the pings found out.
#[derive(Default)]
pub struct PeerPing {
    /// Per peer: its last answer, or when pinging it began or it came up, if later.
    last_heard: Mutex<HashMap<u32, Instant>>,
    /// Pings sent and pings answered.
    pub sent: AtomicU64,
    pub answered: AtomicU64,
}

impl PeerPing {
    /// The peers silent for at least [`SILENT_PERIODS`] periods, with how long (ms), for the
    /// heartbeat.
    pub fn silent(&self, period: Duration) -> Vec<(u32, u64)> {
        let now = Instant::now();
        let mut out: Vec<(u32, u64)> = self
            .last_heard
            .lock()
            .unwrap()
            .iter()
            .map(|(id, t)| (*id, now.saturating_duration_since(*t)))
            .filter(|(_, d)| *d >= period * SILENT_PERIODS)
            .map(|(id, d)| (id, d.as_millis() as u64))
            .collect();
        out.sort_unstable();
        out
    }

    fn heard(&self, id: u32) {
        self.answered.fetch_add(1, Relaxed);
        self.last_heard.lock().unwrap().insert(id, Instant::now());
    }
}

impl Node {
    pub(super) fn peer_ping_loop(self: Arc<Self>) {
        let period = self.heartbeat_period();
        // A ping may take this long before it counts as unanswered.
        let timeout = (period * 2).max(Duration::from_secs(1));
        let mut conns: HashMap<u32, Connection> = HashMap::new();
        // Connects run on threads of their own (one to an unreachable peer takes up to the
        // messenger's connect timeout, which must not hold up the pings to the others).
        let (dialed_tx, dialed) = crossbeam::channel::unbounded::<(u32, Option<Connection>)>();
        let mut dialing: HashSet<u32> = HashSet::new();
        let mut was_up: HashSet<u32> = HashSet::new();
        // (map epoch, peers): placement runs again only when the map changes.
        let mut peers: (u64, BTreeSet<u32>) = (u64::MAX, BTreeSet::new());
        for tick in 0u64.. {
            let map = self.monc.map();
            if peers.0 != map.epoch {
                peers = (map.epoch, peers_of(&map, self.id));
            }
            let pinged = |id: &u32| peers.1.contains(id);
            for (id, c) in dialed.try_iter() {
                dialing.remove(&id);
                if let Some(c) = c {
                    if let Some(old) = conns.insert(id, c) {
                        old.close();
                    }
                }
            }
            conns.retain(|id, c| {
                let keep = c.is_open()
                    && pinged(id)
                    && map.nodes.get(id).is_some_and(|n| n.addr == c.peer_addr());
                if !keep {
                    c.close();
                }
                keep
            });
            {
                // A peer's silence counts from when it was last heard, or from when this
                // node first saw it up since then (a peer just back has not been pinged).
                let now = Instant::now();
                let mut heard = self.peer_ping.last_heard.lock().unwrap();
                heard.retain(|id, _| pinged(id));
                for n in map.nodes.values().filter(|n| pinged(&n.id)) {
                    let came_up = n.up && !was_up.contains(&n.id);
                    let t = heard.entry(n.id).or_insert(now);
                    if came_up {
                        *t = (*t).max(now);
                    }
                }
                was_up = map.nodes.values().filter(|n| n.up).map(|n| n.id).collect();
            }
            for n in map.nodes.values().filter(|n| pinged(&n.id)) {
                if !n.up && tick % DOWN_EVERY != 0 {
                    continue;
                }
                let Some(conn) = conns.get(&n.id).cloned() else {
                    if dialing.insert(n.id) {
                        let (me, tx, id, addr) = (self.clone(), dialed_tx.clone(), n.id, n.addr);
                        let spawned = std::thread::Builder::new()
                            .name("node-peer-dial".into())
                            .spawn(move || {
                                let _ =
                                    tx.send((id, me.msgr().connect(addr, Identity::Node(id)).ok()));
                            });
                        if spawned.is_err() {
                            dialing.remove(&n.id);
                        }
                    }
                    continue;
                };
                self.peer_ping.sent.fetch_add(1, Relaxed);
                let (me, id, c) = (self.clone(), n.id, conn.clone());
                conn.request_with(
                    OutMessage::new(wire::MSG_PEER_PING, Enc::new(map.epoch).finish()),
                    timeout,
                    move |r| match r {
                        Ok(_) => me.peer_ping.heard(id),
                        // Dialled afresh at the next ping: a kept connection would redial a
                        // dead node every backoff period, each refusal logged.
                        Err(_) => c.close(),
                    },
                );
            }
            std::thread::sleep(period);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::{Change, Incremental};
    use crate::placement::Acting;

    /// `nodes` nodes on hosts of their own and pool 1 (6+2) with `pg_num` PGs.
    fn map_of(nodes: u32, pg_num: u32) -> ClusterMap {
        use crate::placement::tests::{map_of, node, pool};
        let mut m = map_of((1..=nodes).map(|i| node(i, &format!("h{i}"))).collect());
        m.apply(&Incremental {
            epoch: 2,
            changes: vec![Change::PoolCreate(pool(pg_num))],
        })
        .unwrap();
        m
    }

    /// Every node pings the co-members of its PGs and at least MIN_PEERS nodes, never itself
    /// or a node down and out, and is pinged by at least two (the monitor's reporters); on a
    /// small cluster every node pings every other; on a large one far fewer than all.
    #[test]
    fn a_node_pings_its_pg_peers_topped_up_to_the_minimum() {
        let small = map_of(8, 32);
        for me in 1..=8 {
            let all: BTreeSet<u32> = (1..=8).filter(|i| *i != me).collect();
            assert_eq!(peers_of(&small, me), all);
        }
        for pg_num in [4, 64] {
            let mut m = map_of(60, pg_num);
            let mut apply = |c: Change| {
                let epoch = m.epoch + 1;
                m.apply(&Incremental {
                    epoch,
                    changes: vec![c],
                })
                .unwrap();
            };
            apply(Change::NodeDown(60));
            apply(Change::NodeOut(60));
            apply(Change::NodeDown(59));
            let pool = m.pools[&1].clone();
            let mut pinged_by: HashMap<u32, usize> = HashMap::new();
            let mut most = 0;
            for me in 1..=59 {
                let peers = peers_of(&m, me);
                assert!(peers.len() >= MIN_PEERS, "{me}: {peers:?}");
                assert!(!peers.contains(&me) && !peers.contains(&60));
                for pg in 0..pool.pg_num {
                    let a = Acting::compute(&m, &pool, pg);
                    if a.shard_of(me).is_some() {
                        for n in a.members.iter().flatten().filter(|n| **n != me) {
                            assert!(peers.contains(n), "{me} pings its PG peer {n}");
                        }
                    }
                }
                for p in &peers {
                    *pinged_by.entry(*p).or_default() += 1;
                }
                most = most.max(peers.len());
            }
            for id in 1..=59 {
                assert!(pinged_by.get(&id).copied().unwrap_or(0) >= 2, "{id}");
            }
            assert!(!pinged_by.contains_key(&60));
            if pg_num == 4 {
                assert!(most < 30, "few PGs: few peers, not the whole map ({most})");
            }
        }
    }

    #[test]
    fn only_peers_silent_for_two_periods_are_reported() {
        let p = PeerPing::default();
        let period = Duration::from_millis(100);
        let now = Instant::now();
        {
            let mut h = p.last_heard.lock().unwrap();
            h.insert(1, now);
            h.insert(2, now - Duration::from_millis(150));
            h.insert(3, now - Duration::from_millis(900));
            h.insert(4, now - Duration::from_millis(250));
        }
        let s = p.silent(period);
        assert_eq!(s.iter().map(|e| e.0).collect::<Vec<_>>(), vec![3, 4]);
        assert!(s[0].1 >= 900 && s[1].1 >= 250 && s[1].1 < 900);
        p.heard(3);
        assert_eq!(
            p.silent(period).iter().map(|e| e.0).collect::<Vec<_>>(),
            vec![4]
        );
    }
}
