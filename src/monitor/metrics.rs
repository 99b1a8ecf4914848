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
        use Kind::Gauge as G;
        let mut s = Samples::default();
        let st = self.status();
        let leader = st.leader == Some(self.cfg.id as u64);
        let subscribers = self.subs.lock().unwrap().len() as u64;
        let nodes_seen = self.seen.lock().unwrap().len() as u64;
        #[rustfmt::skip]
        let rows: [(&'static str, &'static str, u64, &'static str); 18] = [
            ("cluster", "epoch", st.epoch, "Cluster map epoch"),
            ("cluster", "health", health_code(&st.health), "Health: 0 ok, 1 warn, 2 err"),
            ("cluster", "health_details", st.health_detail.len() as u64, "Health detail lines"),
            ("cluster", "nodes", st.nodes_total as u64, "Nodes in the map"),
            ("cluster", "nodes_up", st.nodes_up as u64, "Nodes up"),
            ("cluster", "nodes_in", st.nodes_in as u64, "Nodes in"),
            ("cluster", "pools", st.pools.len() as u64, "Pools"),
            ("cluster", "pgs", st.pg_total as u64, "Placement groups"),
            ("cluster", "shards", st.shards, "Shards stored (sum of up nodes' reports)"),
            ("cluster", "used_bytes", st.used_bytes, "Live bytes (sum of up nodes' reports)"),
            ("cluster", "capacity_bytes", st.capacity_bytes, "Capacity (sum of up nodes' reports)"),
            ("cluster", "read_ops_per_s", st.io.read_ops_s as u64, "Client read ops per second"),
            ("cluster", "write_ops_per_s", st.io.write_ops_s as u64, "Client write ops per second"),
            ("cluster", "read_bytes_per_s", st.io.read_bytes_s as u64, "Client read bytes per second"),
            ("cluster", "write_bytes_per_s", st.io.write_bytes_s as u64, "Client write bytes per second"),
            ("monitor", "is_leader", leader as u64, "1 when this monitor is the raft leader"),
            ("monitor", "subscribers", subscribers, "Connections subscribed to map pushes"),
            ("monitor", "nodes_seen", nodes_seen, "Nodes this monitor has heard from"),
        ];
        for (group, name, v, help) in rows {
            s.push(group, name, help, G, None, v);
        }
        for (state, n) in &st.pg_states {
            let help = "Placement groups by state";
            let l = Some(("state", state.clone()));
            s.push("cluster", "pgs_by_state", help, G, l, *n as u64);
        }
        for (id, seen) in self.seen.lock().unwrap().iter() {
            let l = || Some(("node", id.to_string()));
            let help = "Slow ops a node reported in its last heartbeat";
            s.push("node", "slow_ops", help, G, l(), seen.stats.slow_ops);
            let help = "Longest of those ops, in milliseconds";
            s.push(
                "node",
                "slow_longest_ms",
                help,
                G,
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
        crate::prom::record_addr(&self.cfg.data_dir, bound)?;
        tracing::info!("monitor {}: metrics at http://{bound}/metrics", self.cfg.id);
        Ok(())
    }
}
