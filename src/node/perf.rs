//! A node's performance counters: collection from every subsystem (messenger, stores,
//! devices, erasure coding, ops, and any subsystem that registers a source), `perf dump`
//! JSON, `perf reset`, slow ops, and the Prometheus page.
//!
//! Reset keeps the raw counters (Prometheus needs them monotonic) and remembers them as a
//! baseline; `perf dump` reports counters minus that baseline. Gauges are never reset.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use messenger::Incoming;
use serde_json::{json, Map, Value};

use super::Node;
use crate::error::{Error, Result};
use crate::optrack::OpTracker;
use crate::prom::{Kind, Sample, Samples};
use crate::wire::{self, Dec, Status};

/// Bytes through the erasure codec at this node (as a primary).
#[derive(Default)]
pub struct EcCounters {
    /// Data bytes encoded into full stripes (parity computed).
    pub encoded_bytes: AtomicU64,
    /// Data bytes whose change was applied to parity by delta (small overwrites).
    pub delta_bytes: AtomicU64,
    /// Shard bytes rebuilt from k surviving shards (degraded reads, repair).
    pub reconstructed_bytes: AtomicU64,
    pub encode_calls: AtomicU64,
    pub reconstruct_calls: AtomicU64,
}

/// Group-commit batch sizes: `store::stats::RoundHistogram`'s buckets.
const ROUND_BUCKET_NAMES: [&str; store::stats::ROUND_TXNS_BUCKETS] = [
    "commit_rounds_txns_le_1",
    "commit_rounds_txns_le_2",
    "commit_rounds_txns_le_4",
    "commit_rounds_txns_le_8",
    "commit_rounds_txns_le_16",
    "commit_rounds_txns_le_32",
    "commit_rounds_txns_le_64",
    "commit_rounds_txns_le_128",
    "commit_rounds_txns_gt_128",
];

/// (name, kind, value, help) of one sample.
type Row = (&'static str, Kind, u64, &'static str);

/// Adds a subsystem's samples to a collection.
pub type PerfSource = Box<dyn Fn(&mut Samples) + Send + Sync>;

/// The node's observability state.
pub struct Perf {
    pub ops: OpTracker,
    pub ec: EcCounters,
    started: Instant,
    /// Counter values at the last reset, by sample key.
    baseline: Mutex<(u64, HashMap<String, u64>)>,
    sources: Mutex<Vec<PerfSource>>,
}

impl Perf {
    pub fn new(slow_op: Duration) -> Perf {
        Perf {
            ops: OpTracker::new(slow_op),
            ec: EcCounters::default(),
            started: Instant::now(),
            baseline: Mutex::new((0, HashMap::new())),
            sources: Mutex::new(Vec::new()),
        }
    }

    /// Where a subsystem (recovery, scrub, ...) registers its counters: `source` is called on
    /// every `perf dump` and scrape and pushes samples into its own group (e.g. "recovery",
    /// which becomes the `recovery` object of `perf dump` and `nvstore_recovery_*` metrics).
    pub fn register_source(&self, source: PerfSource) {
        self.sources.lock().unwrap().push(source);
    }
}

fn key(s: &Sample) -> String {
    match &s.label {
        Some((k, v)) => format!("{}/{}/{k}={v}", s.group, s.name),
        None => format!("{}/{}", s.group, s.name),
    }
}

impl Node {
    /// Every sample of this node, raw (not reset).
    pub fn perf_samples(&self) -> Samples {
        let mut s = Samples::default();
        crate::prom::messenger_samples(&self.msgr().stats(), &mut s);
        self.store_samples(&mut s);
        self.node_samples(&mut s);
        for src in self.perf.sources.lock().unwrap().iter() {
            src(&mut s);
        }
        s
    }

    fn store_samples(&self, out: &mut Samples) {
        use Kind::{Counter as C, Gauge as G};
        for st in &self.local.stores {
            let dev = store::Uuid(&st.label().device_uuid).to_string();
            let (t, sp, io) = (st.stats(), st.space(), st.device().io_stats());
            let (fill_regions, fill_bytes) = st.device().prefill_stats();
            let cache = st.cache_stats();
            #[rustfmt::skip]
            let store: [Row; 20] = [
                ("txns", C, t.txns, "Store transactions committed"),
                ("user_bytes", C, t.user_bytes, "Object data bytes written by users"),
                ("device_bytes_written", C, t.device_bytes_written, "Bytes written to the device"),
                ("commit_rounds", C, t.rounds, "Group-commit rounds (durable points)"),
                ("batches", C, t.batches, "Log batches written"),
                ("flushes", C, t.flushes, "Device cache flushes"),
                ("fua_rounds", C, t.fua_rounds, "Rounds made durable by one FUA write"),
                ("checkpoints", C, t.checkpoints, "Index checkpoints written"),
                ("cleaner_relocated_bytes", C, t.relocated_bytes, "Bytes the cleaner relocated"),
                ("cleaner_segments", C, t.cleaned_segments, "Segments the cleaner freed"),
                ("reads", C, t.reads, "Store reads"),
                ("read_bytes", C, t.read_bytes, "Bytes read by the store"),
                ("corrupt_reads", C, t.corrupt_reads, "Reads that found a crc mismatch"),
                ("read_cache_hits", C, cache.hits, "Small reads served from the read cache"),
                ("read_cache_misses", C, cache.misses, "Cacheable reads that went to the device (and filled the read cache)"),
                ("read_cache_bytes", G, cache.bytes, "Bytes held by the read cache"),
                ("live_bytes", G, sp.live_bytes, "Live bytes in the store"),
                ("objects", G, st.object_count() as u64, "Keys in the store's index: shards (tombstones included), spilled rollback bytes, PG log entries, recovery marks"),
                ("segments_free", G, sp.segments_free, "Free segments"),
                ("segments_total", G, sp.segments_total, "Segments on the device"),
            ];
            #[rustfmt::skip]
            let driver: [Row; 12] = [
                ("reads", C, io.reads, "Device read commands"),
                ("writes", C, io.writes, "Device write commands"),
                ("flushes", C, io.flushes, "Device flush commands"),
                ("other_ios", C, io.other, "Write-zeroes and deallocate commands"),
                ("read_bytes", C, io.read_bytes, "Bytes read from the device"),
                ("write_bytes", C, io.write_bytes, "Bytes written to the device"),
                ("completions", C, io.completions, "Device commands completed"),
                ("errors", C, io.errors, "Device commands that failed"),
                ("queue_depth", G, io.in_flight, "Device commands in flight now"),
                ("queue_depth_max", G, io.in_flight_max, "Most device commands in flight at once"),
                ("prefill_regions", C, fill_regions, "1 MiB regions of a sparse device file filled with zeros ahead of small durable writes"),
                ("prefill_bytes", C, fill_bytes, "Zero bytes written to fill holes ahead of small durable writes"),
            ];
            let rounds = ROUND_BUCKET_NAMES.iter().zip(t.round_txns);
            let by_size: Vec<Row> = rounds
                .map(|(name, n)| (*name, C, n, "Commit rounds by transactions made durable"))
                .collect();
            for (group, rows) in [
                ("store", &store[..]),
                ("store", &by_size),
                ("driver", &driver[..]),
            ] {
                for &(name, kind, v, help) in rows {
                    out.push(group, name, help, kind, Some(("device", dev.clone())), v);
                }
            }
        }
    }

    fn node_samples(&self, out: &mut Samples) {
        use Kind::{Counter as C, Gauge as G};
        let (c, e, ops) = (&self.counters, &self.perf.ec, &self.perf.ops);
        let (done, slow) = ops.totals();
        let (recent, longest) = ops.health();
        let threshold = ops.threshold().as_millis() as u64;
        let (rss, peak) = (
            driver::workload::rss_kib(),
            driver::workload::peak_rss_kib(),
        );
        #[rustfmt::skip]
        let rows: [(&'static str, Row); 63] = [
            ("client", ("read_ops", C, c.read_ops.load(Relaxed), "Client read ops run as primary")),
            ("client", ("write_ops", C, c.write_ops.load(Relaxed), "Client write ops run as primary")),
            ("client", ("read_bytes", C, c.read_bytes.load(Relaxed), "Bytes returned to clients")),
            ("client", ("write_bytes", C, c.write_bytes.load(Relaxed), "Bytes clients wrote")),
            ("client", ("resolves_asked", C, c.resolves_asked.load(Relaxed), "Object states resolved by a stat round to the members")),
            ("client", ("inline_reads", C, self.hot.counters.inline_reads.load(Relaxed), "Read-only ops answered on the messenger worker from the cached object state and the hot-object cache")),
            ("client", ("resolves_absent_local", C, c.resolves_absent_local.load(Relaxed), "Objects known absent from this complete member's own shards, without a stat round")),
            ("node", ("stale_primary_refused", C, c.stale_primary_refused.load(Relaxed), "Shard and recovery ops refused from a primary that a newer map or a newer primary of the PG superseded (this node's own, as a primary that lost the PG, included)")),
            ("node", ("stale_ops_refused", C, c.stale_ops_refused.load(Relaxed), "Client ops refused because they were sent before their PG's current interval (the client resends them)")),
            ("client", ("resends_answered", C, c.resends_answered.load(Relaxed), "Resent client mutations answered with the version they made the first time, not applied again")),
            ("node", ("peer_pings_sent", C, self.peer_ping.sent.load(Relaxed), "Pings sent to other nodes (failure reports, node/peerping.rs)")),
            ("node", ("peer_pings_answered", C, self.peer_ping.answered.load(Relaxed), "Pings other nodes answered")),
            ("node", ("peers_silent", G, self.peer_ping.silent(self.heartbeat_period()).len() as u64, "Other nodes that have not answered a ping for two heartbeat periods or more (reported to the monitor)")),
            ("node", ("boot_gate_refused", C, c.boot_gate_refused.load(Relaxed), "Shard ops refused before this node registered, or while its map lagged its boot epoch")),
            ("node", ("writes_delayed", C, c.writes_delayed.load(Relaxed), "Client writes held by the inject_write_delay_ms runtime setting (fault injection)")),
            ("node", ("writes_held", G, c.writes_held.load(Relaxed), "Of those, writes not yet done sending their shards")),
            ("node", ("shard_writes_delayed", C, c.shard_writes_delayed.load(Relaxed), "Shard writes held between their check and their apply by the inject_shard_apply_delay_ms runtime setting (fault injection)")),
            ("node", ("primary_change_waits", C, self.intervals.drain_waits.load(Relaxed), "Shard and recovery ops of a PG's new primary that waited for the ops this node had admitted from its previous primary to finish")),
            ("node", ("primary_change_timeouts", C, self.intervals.drain_timeouts.load(Relaxed), "Of those, ops refused because the previous primary's ops were still in flight after the wait (the new primary retries)")),
            ("client", ("writes_client_encoded", C, c.writes_client_encoded.load(Relaxed), "Whole-object writes led here whose shards the client encoded and staged on the members (client-side EC), acknowledged")),
            ("node", ("shards_staged", C, self.shard_staging.staged.load(Relaxed), "Shards clients staged here for their own encoded writes")),
            ("node", ("staged_shards_taken", C, self.shard_staging.taken.load(Relaxed), "Of those, shards a primary's write took")),
            ("node", ("staged_shards_missing", C, self.shard_staging.missing.load(Relaxed), "Staged writes that named a shard not staged here (the client sent the data to the primary instead)")),
            ("node", ("staged_shards_expired", C, self.shard_staging.expired.load(Relaxed), "Staged shards dropped unused: no write took them within 30 s (a client gone between its stages and its op, a write that failed first), or dropped on arrival by the inject_drop_staged fault injection")),
            ("node", ("staged_shard_waits", C, self.shard_staging.waits.load(Relaxed), "Staged writes that reached this node before the shard they name, and waited for it")),
            ("node", ("staged_shards_refused", C, self.shard_staging.refused.load(Relaxed), "Stages this node refused (the client over staged_bytes_max, or a shard too large); a write naming one fails at once")),
            ("node", ("staged_shard_wait_timeouts", C, self.shard_staging.wait_timeouts.load(Relaxed), "Of staged_shards_missing, writes that waited the whole 2 s for a shard this node never heard of (lost with its connection, or staged before a restart); the others failed at once")),
            ("node", ("staged_shard_bytes", G, self.shard_staging.bytes.load(Relaxed), "Bytes of staged shards waiting for their write")),
            ("node", ("shard_crcs_vouched", C, c.shard_crcs_vouched.load(Relaxed), "Shard writes whose listed chunk CRCs matched the verified frame CRC (recorded without summing the bytes)")),
            ("node", ("shard_crcs_dropped", C, c.shard_crcs_dropped.load(Relaxed), "Shard writes whose listed chunk CRCs did not describe the bytes (summed instead)")),
            ("recovery", ("marks_refreshed", C, self.recovery.marks_refreshed.load(Relaxed), "Times a PG's member marks were advanced between passes")),
            ("recovery", ("rollbacks_dropped", C, self.recovery.rollbacks_dropped.load(Relaxed), "Rollback records of acknowledged writes dropped here on their primary's word (their old bytes freed)")),
            ("recovery", ("settles_sent", C, self.recovery.settles_sent.load(Relaxed), "Acknowledged writes, led here, whose members were told to drop their rollback records")),
            ("recovery", ("settles_failed", C, self.recovery.settles_failed.load(Relaxed), "SHARD_SETTLE requests a member did not answer (its entries are sent again at the next pass)")),
            ("recovery", ("forgets_sent", C, self.recovery.forgets_sent.load(Relaxed), "Removes led here whose tombstone every member was told to forget (tombstone_keep_s after the remove; a member down meanwhile is told when back)")),
            ("recovery", ("tombstones_forgotten", C, self.recovery.tombstones_forgotten.load(Relaxed), "Tombstones removed here on their primary's word (index entry and record freed)")),
            ("recovery", ("stale_shards_dropped", C, self.recovery.stale_shards_dropped.load(Relaxed), "Leftover shards removed here on a primary's word: a state older than what a member complete past it knows (a removed object's, a write that never took)")),
            ("recovery", ("stray_keys_removed", C, self.strays.removed_keys.load(Relaxed), "Keys (shards, log entries, marks) removed of PGs this node is no longer a member of, and shards of slots of a PG it no longer holds, once clean")),
            ("recovery", ("deleted_pool_keys_removed", C, self.strays.deleted_pool_keys.load(Relaxed), "Keys (shards, log entries, marks) of deleted pools removed")),
            ("recovery", ("deleted_pools_left", G, self.strays.deleted_pools_left.load(Relaxed), "Deleted pools this node still held keys of after its last sweep")),
            ("recovery", ("stray_pgs_waiting", G, self.strays.pgs_waiting.load(Relaxed), "PGs this node holds keys of but is no longer a member of (or shards of a slot it no longer holds), not yet clean on their members")),
            ("recovery", ("marks_behind", G, self.marks_behind(), "PGs led here whose member marks lag acknowledged writes")),
            ("ec", ("encoded_bytes", C, e.encoded_bytes.load(Relaxed), "Data bytes encoded in full stripes")),
            ("ec", ("delta_bytes", C, e.delta_bytes.load(Relaxed), "Data bytes applied to parity by delta")),
            ("ec", ("reconstructed_bytes", C, e.reconstructed_bytes.load(Relaxed), "Shard bytes rebuilt")),
            ("ec", ("encode_calls", C, e.encode_calls.load(Relaxed), "Stripe encode calls")),
            ("ec", ("reconstruct_calls", C, e.reconstruct_calls.load(Relaxed), "Reconstruct calls")),
            ("ops", ("finished", C, done, "Client and shard ops answered")),
            ("ops", ("slow", C, slow, "Ops that took slow_op_ms or longer")),
            ("ops", ("in_flight", G, ops.in_flight(), "Ops received and not yet answered")),
            ("ops", ("slow_recent", G, recent, "Ops slow within the last minute, or slow and running")),
            ("ops", ("slow_longest_ms", G, longest, "Longest of those ops, in milliseconds")),
            ("ops", ("slow_threshold_ms", G, threshold, "The slow_op_ms setting")),
            ("node", ("peer_conns", G, self.peers.len() as u64, "Connections kept to other nodes")),
            ("node", ("peer_conns_closed", C, self.peers.closed(), "Connections to other nodes closed because the map marked them down (not redialled)")),
            ("node", ("shards", G, self.local.shard_count(), "Shards stored on this node")),
            ("node", ("uptime_s", G, self.perf.started.elapsed().as_secs(), "Seconds since start")),
            ("node", ("op_threads", G, self.cfg.op_threads as u64, "Threads running client ops")),
            ("node", ("shard_threads", G, super::SHARD_THREADS as u64, "Threads running shard ops")),
            ("node", ("devices", G, self.local.stores.len() as u64, "Devices this node serves")),
            ("node", ("salvaged_places", G, self.salvaged_count() as u64, "Damaged places its stores opened past at this start (see the log)")),
            ("process", ("rss_bytes", G, rss << 10, "Resident memory of the node process (VmRSS)")),
            ("process", ("peak_rss_bytes", G, peak << 10, "Peak resident memory of the node process since it started (VmHWM)")),
        ];
        for (group, (name, kind, v, help)) in rows {
            out.push(group, name, help, kind, None, v);
        }
    }

    /// `perf dump`: counters since the last reset, gauges as they are.
    pub fn perf_dump(&self) -> Value {
        let samples = self.perf_samples();
        let (reset_ms, base) = {
            let b = self.perf.baseline.lock().unwrap();
            (b.0, b.1.clone())
        };
        let mut root = Map::new();
        root.insert("node_id".into(), json!(self.id));
        root.insert("reset_unix_ms".into(), json!(reset_ms));
        // Every group a subsystem may register is present, even before it has counters.
        root.insert("recovery".into(), json!({}));
        for s in &samples.0 {
            let v = match s.kind {
                Kind::Counter => s
                    .value
                    .saturating_sub(base.get(&key(s)).copied().unwrap_or(0)),
                Kind::Gauge => s.value,
            };
            let Some(g) = root
                .entry(s.group)
                .or_insert_with(|| json!({}))
                .as_object_mut()
            else {
                continue; // a group named like a top-level field: not one of ours
            };
            match &s.label {
                None => {
                    g.insert(s.name.into(), json!(v));
                }
                Some((lk, lv)) => {
                    if s.kind == Kind::Counter {
                        let t = g.entry(s.name).or_insert(json!(0));
                        *t = json!(t.as_u64().unwrap_or(0) + v);
                    }
                    g.entry(format!("by_{lk}"))
                        .or_insert_with(|| json!({}))
                        .as_object_mut()
                        .expect("object")
                        .entry(lv.clone())
                        .or_insert_with(|| json!({}))
                        .as_object_mut()
                        .expect("object")
                        .insert(s.name.into(), json!(v));
                }
            }
        }
        if let Some(st) = root.get_mut("store").and_then(Value::as_object_mut) {
            let txns = st.get("txns").and_then(Value::as_u64).unwrap_or(0);
            let rounds = st.get("commit_rounds").and_then(Value::as_u64).unwrap_or(0);
            if rounds > 0 {
                st.insert(
                    "group_commit_txns_per_round".into(),
                    json!(txns as f64 / rounds as f64),
                );
            }
        }
        Value::Object(root)
    }

    /// `perf reset`: counters start again from zero in `perf dump`.
    pub fn perf_reset(&self) {
        let samples = self.perf_samples();
        let base = samples
            .0
            .iter()
            .filter(|s| s.kind == Kind::Counter)
            .map(|s| (key(s), s.value))
            .collect();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        *self.perf.baseline.lock().unwrap() = (now, base);
    }

    /// The Prometheus page of this node.
    pub fn metrics_text(&self) -> String {
        crate::prom::render(&self.perf_samples().0, &[("node", self.id.to_string())])
    }

    /// `MSG_ADMIN_*`: perf dump, perf reset, slow ops, runtime config (JSON replies).
    pub(super) fn admin(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let mut d = Dec::new(msg.payload());
        let _epoch = d.u64()?;
        let set = if msg.msg_type() == wire::MSG_ADMIN_CONFIG {
            let key = String::from_utf8_lossy(d.bytes()?).into_owned();
            let value = String::from_utf8_lossy(d.bytes()?).into_owned();
            (!key.is_empty()).then_some((key, value))
        } else {
            None
        };
        d.end()?;
        let v = match msg.msg_type() {
            wire::MSG_ADMIN_CONFIG => {
                if let Some((k, v)) = &set {
                    self.set_runtime(k, v)?;
                }
                self.runtime_config()
            }
            wire::MSG_ADMIN_PERF_DUMP => self.perf_dump(),
            wire::MSG_ADMIN_PERF_RESET => {
                self.perf_reset();
                json!({"node": self.id, "reset": true})
            }
            wire::MSG_ADMIN_SLOW_OPS => serde_json::to_value(self.perf.ops.report(self.id))
                .map_err(|e| Error::remote(Status::Internal, format!("slow ops to JSON: {e}")))?,
            t => return Err(Error::Malformed(format!("unknown admin message type {t}"))),
        };
        let body = serde_json::to_vec(&v)
            .map_err(|e| Error::remote(Status::Internal, format!("to JSON: {e}")))?;
        Ok(wire::reply_ok(self.epoch(), &body))
    }

    /// The settings `nvstore config set` can change on a running node (not written back to
    /// its config file: a restart returns to the file's values).
    fn runtime_config(&self) -> Value {
        json!({
            "node": self.id,
            "read_coalescing": self.hot.enabled(),
            "read_cache": self.local.stores.iter().any(|s| s.cache_stats().capacity > 0),
            "slow_op_ms": self.perf.ops.threshold().as_millis() as u64,
            "inject_write_delay_ms": self.inject_write_delay_ms.load(Relaxed),
            "inject_shard_apply_delay_ms": self.inject_shard_apply_delay_ms.load(Relaxed),
            "inject_drop_staged": self.inject_drop_staged.load(Relaxed),
            "staged_bytes_max": self.shard_staging.bytes_max.load(Relaxed),
        })
    }

    fn set_runtime(&self, key: &str, value: &str) -> Result<()> {
        let bad = |want: &str| {
            Error::remote(
                Status::Invalid,
                format!("{key}: expected {want}, got {value:?}"),
            )
        };
        match key {
            "read_coalescing" => {
                let on = match value {
                    "true" | "on" | "1" => true,
                    "false" | "off" | "0" => false,
                    _ => return Err(bad("true or false")),
                };
                self.hot.set_enabled(on, self.cfg.hot_cache_bytes);
            }
            "read_cache" => {
                let on = match value {
                    "true" | "on" | "1" => true,
                    "false" | "off" | "0" => false,
                    _ => return Err(bad("true or false")),
                };
                for st in &self.local.stores {
                    st.set_read_cache(on);
                }
            }
            "slow_op_ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|_| bad("milliseconds (an integer)"))?;
                self.perf.ops.set_threshold(Duration::from_millis(ms));
            }
            "inject_write_delay_ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|_| bad("milliseconds (an integer; 0 turns it off)"))?;
                self.inject_write_delay_ms.store(ms, Relaxed);
            }
            "inject_shard_apply_delay_ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|_| bad("milliseconds (an integer; 0 turns it off)"))?;
                self.inject_shard_apply_delay_ms.store(ms, Relaxed);
            }
            "inject_drop_staged" => {
                let on = match value {
                    "true" | "on" | "1" => true,
                    "false" | "off" | "0" => false,
                    _ => return Err(bad("true or false")),
                };
                self.inject_drop_staged.store(on, Relaxed);
            }
            "staged_bytes_max" => {
                let n: u64 = value
                    .parse()
                    .map_err(|_| bad("bytes (an integer; 0 refuses every stage)"))?;
                self.shard_staging.bytes_max.store(n, Relaxed);
            }
            _ => {
                return Err(Error::remote(
                    Status::Invalid,
                    format!(
                        "no runtime setting {key:?}; settable: read_coalescing, read_cache, \
                         slow_op_ms, inject_write_delay_ms, inject_shard_apply_delay_ms, \
                         inject_drop_staged, staged_bytes_max (others need node.toml and a \
                         restart)"
                    ),
                ))
            }
        }
        tracing::info!("runtime config: {key} = {value}");
        Ok(())
    }

    /// Serve the Prometheus page when `metrics_listen` is set.
    pub(super) fn start_metrics(self: &Arc<Self>) -> Result<()> {
        let Some(addr) = self.cfg.metrics_listen else {
            return Ok(());
        };
        let n = self.clone();
        let bound = crate::prom::serve(addr, "node-metrics", Arc::new(move || n.metrics_text()))?;
        crate::prom::record_addr(&self.cfg.data_dir, bound)?;
        tracing::info!("node {}: metrics at http://{bound}/metrics", self.id);
        Ok(())
    }
}
