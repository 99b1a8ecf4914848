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
            let l = || Some(("device", dev.clone()));
            let t = st.stats();
            let sp = st.space();
            let rows: [(&'static str, &'static str, Kind, u64); 16] = [
                ("txns", "Store transactions committed", C, t.txns),
                (
                    "user_bytes",
                    "Object data bytes written by users",
                    C,
                    t.user_bytes,
                ),
                (
                    "device_bytes_written",
                    "Bytes written to the device",
                    C,
                    t.device_bytes_written,
                ),
                (
                    "commit_rounds",
                    "Group-commit rounds (durable points)",
                    C,
                    t.rounds,
                ),
                ("batches", "Log batches written", C, t.batches),
                ("flushes", "Device cache flushes", C, t.flushes),
                (
                    "fua_rounds",
                    "Rounds made durable by one FUA write",
                    C,
                    t.fua_rounds,
                ),
                ("checkpoints", "Index checkpoints written", C, t.checkpoints),
                (
                    "cleaner_relocated_bytes",
                    "Bytes the cleaner relocated",
                    C,
                    t.relocated_bytes,
                ),
                (
                    "cleaner_segments",
                    "Segments the cleaner freed",
                    C,
                    t.cleaned_segments,
                ),
                ("reads", "Store reads", C, t.reads),
                ("read_bytes", "Bytes read by the store", C, t.read_bytes),
                (
                    "corrupt_reads",
                    "Reads that found a crc mismatch",
                    C,
                    t.corrupt_reads,
                ),
                ("live_bytes", "Live bytes in the store", G, sp.live_bytes),
                ("segments_free", "Free segments", G, sp.segments_free),
                (
                    "segments_total",
                    "Segments on the device",
                    G,
                    sp.segments_total,
                ),
            ];
            for (name, help, kind, v) in rows {
                out.push("store", name, help, kind, l(), v);
            }
            let io = st.device().io_stats();
            let rows: [(&'static str, &'static str, Kind, u64); 10] = [
                ("reads", "Device read commands", C, io.reads),
                ("writes", "Device write commands", C, io.writes),
                ("flushes", "Device flush commands", C, io.flushes),
                (
                    "other_ios",
                    "Write-zeroes and deallocate commands",
                    C,
                    io.other,
                ),
                ("read_bytes", "Bytes read from the device", C, io.read_bytes),
                (
                    "write_bytes",
                    "Bytes written to the device",
                    C,
                    io.write_bytes,
                ),
                (
                    "completions",
                    "Device commands completed",
                    C,
                    io.completions,
                ),
                ("errors", "Device commands that failed", C, io.errors),
                (
                    "queue_depth",
                    "Device commands in flight now",
                    G,
                    io.in_flight,
                ),
                (
                    "queue_depth_max",
                    "Most device commands in flight at once",
                    G,
                    io.in_flight_max,
                ),
            ];
            for (name, help, kind, v) in rows {
                out.push("driver", name, help, kind, l(), v);
            }
        }
    }

    fn node_samples(&self, out: &mut Samples) {
        let c = &self.counters;
        out.counter(
            "client",
            "read_ops",
            "Client read ops run as primary",
            c.read_ops.load(Relaxed),
        );
        out.counter(
            "client",
            "write_ops",
            "Client write ops run as primary",
            c.write_ops.load(Relaxed),
        );
        out.counter(
            "client",
            "read_bytes",
            "Bytes returned to clients",
            c.read_bytes.load(Relaxed),
        );
        out.counter(
            "client",
            "write_bytes",
            "Bytes clients wrote",
            c.write_bytes.load(Relaxed),
        );
        let e = &self.perf.ec;
        out.counter(
            "ec",
            "encoded_bytes",
            "Data bytes erasure-encoded in full stripes",
            e.encoded_bytes.load(Relaxed),
        );
        out.counter(
            "ec",
            "delta_bytes",
            "Data bytes applied to parity by delta",
            e.delta_bytes.load(Relaxed),
        );
        out.counter(
            "ec",
            "reconstructed_bytes",
            "Shard bytes rebuilt from surviving shards",
            e.reconstructed_bytes.load(Relaxed),
        );
        out.counter(
            "ec",
            "encode_calls",
            "Stripe encode calls",
            e.encode_calls.load(Relaxed),
        );
        out.counter(
            "ec",
            "reconstruct_calls",
            "Reconstruct calls",
            e.reconstruct_calls.load(Relaxed),
        );
        let (done, slow) = self.perf.ops.totals();
        let (recent, longest) = self.perf.ops.health();
        out.counter("ops", "finished", "Client and shard ops answered", done);
        out.counter("ops", "slow", "Ops slower than slow_op_ms", slow);
        out.gauge(
            "ops",
            "in_flight",
            "Ops received and not yet answered",
            self.perf.ops.in_flight(),
        );
        out.gauge(
            "ops",
            "slow_recent",
            "Ops slow within the last minute or slow and running",
            recent,
        );
        out.gauge(
            "ops",
            "slow_longest_ms",
            "Longest of those ops, in milliseconds",
            longest,
        );
        out.gauge(
            "ops",
            "slow_threshold_ms",
            "The slow_op_ms setting",
            self.perf.ops.threshold().as_millis() as u64,
        );
        out.gauge(
            "node",
            "shards",
            "Shards stored on this node",
            self.local.shard_count(),
        );
        out.gauge(
            "node",
            "uptime_s",
            "Seconds since the node started",
            self.perf.started.elapsed().as_secs(),
        );
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

    /// `MSG_ADMIN_*`: perf dump, perf reset, slow ops (JSON replies).
    pub(super) fn admin(&self, msg: &Incoming) -> Result<Vec<u8>> {
        let mut d = Dec::new(msg.payload());
        let _epoch = d.u64()?;
        d.end()?;
        let v = match msg.msg_type() {
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

    /// Serve the Prometheus page when `metrics_listen` is set.
    pub(super) fn start_metrics(self: &Arc<Self>) -> Result<()> {
        let Some(addr) = self.cfg.metrics_listen else {
            return Ok(());
        };
        let n = self.clone();
        let bound = crate::prom::serve(addr, "node-metrics", Arc::new(move || n.metrics_text()))?;
        tracing::info!("node {}: metrics at http://{bound}/metrics", self.id);
        Ok(())
    }
}
