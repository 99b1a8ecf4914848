//! The monitor's Prometheus page: cluster state as this monitor sees it (map, PG states,
//! health, IO rates from heartbeats, slow ops per node), raft role, and its messenger.

use std::sync::Arc;

use messenger::Messenger;

use super::Monitor;
use crate::error::Result;
use crate::prom::{Kind, Samples};

/// `health` gauge values.
fn health_code(h: &str) -> u64 {
    match h {
        "HEALTH_OK" => 0,
        "HEALTH_WARN" => 1,
        _ => 2,
    }
}

impl Monitor {
    fn samples(&self, msgr: &Messenger) -> Samples {
        let mut s = Samples::default();
        let st = self.status();
        let g = "cluster";
        s.gauge(g, "epoch", "Cluster map epoch", st.epoch);
        s.gauge(
            g,
            "health",
            "Health: 0 ok, 1 warn, 2 err",
            health_code(&st.health),
        );
        s.gauge(
            g,
            "health_details",
            "Health detail lines",
            st.health_detail.len() as u64,
        );
        s.gauge(g, "nodes", "Nodes in the map", st.nodes_total as u64);
        s.gauge(g, "nodes_up", "Nodes up", st.nodes_up as u64);
        s.gauge(g, "nodes_in", "Nodes in", st.nodes_in as u64);
        s.gauge(g, "pools", "Pools", st.pools.len() as u64);
        s.gauge(g, "pgs", "Placement groups", st.pg_total as u64);
        for (state, n) in &st.pg_states {
            let help = "Placement groups by state";
            s.push(
                g,
                "pgs_by_state",
                help,
                Kind::Gauge,
                Some(("state", state.clone())),
                *n as u64,
            );
        }
        s.gauge(
            g,
            "shards",
            "Shards stored (sum of up nodes' reports)",
            st.shards,
        );
        s.gauge(
            g,
            "used_bytes",
            "Live bytes (sum of up nodes' reports)",
            st.used_bytes,
        );
        s.gauge(
            g,
            "capacity_bytes",
            "Device capacity (sum of up nodes' reports)",
            st.capacity_bytes,
        );
        s.gauge(
            g,
            "read_ops_per_s",
            "Client read ops per second",
            st.io.read_ops_s as u64,
        );
        s.gauge(
            g,
            "write_ops_per_s",
            "Client write ops per second",
            st.io.write_ops_s as u64,
        );
        s.gauge(
            g,
            "read_bytes_per_s",
            "Client read bytes per second",
            st.io.read_bytes_s as u64,
        );
        s.gauge(
            g,
            "write_bytes_per_s",
            "Client write bytes per second",
            st.io.write_bytes_s as u64,
        );
        let leader = st.leader == Some(self.cfg.id as u64);
        s.gauge(
            "monitor",
            "is_leader",
            "1 when this monitor is the raft leader",
            leader as u64,
        );
        for (id, seen) in self.seen.lock().unwrap().iter() {
            let l = || Some(("node", id.to_string()));
            let help = "Slow ops a node reported in its last heartbeat";
            s.push(
                "node",
                "slow_ops",
                help,
                Kind::Gauge,
                l(),
                seen.stats.slow_ops,
            );
            let help = "Longest of those ops, in milliseconds";
            s.push(
                "node",
                "slow_longest_ms",
                help,
                Kind::Gauge,
                l(),
                seen.stats.slow_longest_ms,
            );
        }
        crate::prom::messenger_samples(&msgr.stats(), &mut s);
        s
    }

    /// Serve the Prometheus page when `metrics_listen` is set.
    pub(super) fn start_metrics(self: &Arc<Self>, msgr: &Arc<Messenger>) -> Result<()> {
        let Some(addr) = self.cfg.metrics_listen else {
            return Ok(());
        };
        let (m, msgr) = (self.clone(), msgr.clone());
        let render = Arc::new(move || {
            crate::prom::render(&m.samples(&msgr).0, &[("monitor", m.cfg.id.to_string())])
        });
        let bound = crate::prom::serve(addr, "mon-metrics", render)?;
        tracing::info!("monitor {}: metrics at http://{bound}/metrics", self.cfg.id);
        Ok(())
    }
}
