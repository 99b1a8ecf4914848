//! Kept connections to storage nodes: a node's to its peers, a client's to primaries.
//!
//! A connection is reused while its node keeps its address, and the messenger reconnects it
//! with backoff when it drops. Once the map marks the node down (or drops it), the
//! connection is closed instead: otherwise every node and client would redial a dead node
//! every `reconnect_backoff_max` (2 s), logging each refused attempt, for as long as it
//! stays down. The next request for the node after it is back up connects afresh.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use messenger::{Connection, Identity, Messenger};

use crate::error::Result;
use crate::monclient::MonClient;

#[derive(Default)]
pub struct PeerConns {
    inner: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    conns: HashMap<u32, Connection>,
    /// `MonClient::node_change_epoch` at the last prune.
    pruned_at: u64,
    /// Connections closed because the map marked their node down.
    closed: u64,
}

impl PeerConns {
    /// The kept connection to node `id` at `addr`, connecting if there is none (or it is for
    /// an old address). Connections to nodes that went down since the last look are closed
    /// first.
    pub fn get(
        &self,
        msgr: &Messenger,
        monc: &MonClient,
        id: u32,
        addr: SocketAddr,
    ) -> Result<Connection> {
        // Held across the connect: threads racing to reach the same node share one
        // connection (a second one would close the first under the other's requests).
        let mut t = self.inner.lock().unwrap();
        t.prune(monc);
        if let Some(c) = t.conns.get(&id) {
            if c.peer_addr() == addr {
                return Ok(c.clone());
            }
        }
        let c = msgr.connect(addr, Identity::Node(id))?;
        if let Some(old) = t.conns.insert(id, c.clone()) {
            old.close();
        }
        Ok(c)
    }

    /// Close the connections to nodes the map marks down or no longer lists, if node states
    /// changed since the last look; returns how many were closed. Cheap when nothing changed
    /// (one atomic load under the table's lock), so callers may run it on every tick.
    pub fn prune(&self, monc: &MonClient) -> usize {
        self.inner.lock().unwrap().prune(monc)
    }

    /// Kept connections.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections closed so far because the map marked their node down.
    pub fn closed(&self) -> u64 {
        self.inner.lock().unwrap().closed
    }
}

impl Table {
    fn prune(&mut self, monc: &MonClient) -> usize {
        // The epoch before the map: the map read after it is at least that new.
        let epoch = monc.node_change_epoch();
        if epoch == self.pruned_at {
            return 0;
        }
        let map = monc.map();
        let before = self.conns.len();
        self.conns.retain(|id, c| {
            let keep = map.is_up(*id);
            if !keep {
                tracing::debug!(
                    node = id,
                    epoch = map.epoch,
                    "closing the connection to a down node"
                );
                c.close();
            }
            keep
        });
        self.pruned_at = epoch;
        let n = before - self.conns.len();
        self.closed += n as u64;
        n
    }
}
