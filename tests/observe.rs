//! Seeing inside a running cluster (real monitor and node processes): `perf dump` counters
//! that move after a known workload, `perf reset`, slow ops with their timelines and the
//! health warning, Prometheus scrapes of a node and a monitor parsed strictly, thread names,
//! and clear errors for bad input.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::Harness;
use messenger::{Identity, OutMessage};
use nvstore::cluster_cmd::LocalOptions;
use nvstore::wire::{self, Status};
use nvstore::{Client, Error};
use serde_json::Value;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const NODES: u32 = 4;
const OBJECTS: usize = 12;
const OBJECT_BYTES: usize = 48 << 10;

fn cluster(o: LocalOptions) -> Harness {
    common::cluster("nvstore-observe-", &o)
}

fn u(v: &Value, path: &str) -> u64 {
    let mut cur = v;
    for p in path.split('.') {
        cur = &cur[p];
    }
    cur.as_u64()
        .unwrap_or_else(|| panic!("{path} is not a number in {v:#}"))
}

/// Sum of one counter over every node's dump.
fn total(dumps: &[Value], path: &str) -> u64 {
    dumps.iter().map(|d| u(d, path)).sum()
}

fn dump_all(c: &Client) -> Vec<Value> {
    (1..=NODES).map(|n| c.perf_dump(n).unwrap()).collect()
}

fn write_objects(c: &Client, pool: u64, prefix: &str) {
    for i in 0..OBJECTS {
        let data = vec![i as u8 ^ 0x5a; OBJECT_BYTES];
        c.put(pool, format!("{prefix}-{i}").as_bytes(), &data)
            .unwrap();
    }
}

// ---- Prometheus text format 0.0.4, parsed strictly -------------------------------------------

type Labels = BTreeMap<String, String>;

#[derive(Debug)]
struct Scrape {
    types: BTreeMap<String, String>,
    samples: Vec<(String, Labels, f64)>,
}

impl Scrape {
    fn get(&self, name: &str, want: &[(&str, &str)]) -> Vec<f64> {
        self.samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && want
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| *v)
            .collect()
    }

    fn sum(&self, name: &str) -> f64 {
        let v = self.get(name, &[]);
        assert!(!v.is_empty(), "no samples of {name}");
        v.iter().sum()
    }
}

fn valid_name(n: &str) -> bool {
    let mut ch = n.chars();
    ch.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && ch.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_labels(s: &str) -> Labels {
    let mut out = Labels::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let eq = s[i..].find('=').expect("label without =") + i;
        let key = &s[i..eq];
        assert!(valid_name(key), "bad label name {key:?}");
        assert_eq!(b[eq + 1], b'"', "label value not quoted in {s:?}");
        let mut v = String::new();
        let mut j = eq + 2;
        loop {
            match b[j] {
                b'\\' => {
                    v.push(match b[j + 1] {
                        b'n' => '\n',
                        b'"' => '"',
                        b'\\' => '\\',
                        c => panic!("bad escape \\{} in {s:?}", c as char),
                    });
                    j += 2;
                }
                b'"' => break,
                _ => {
                    let c = s[j..].chars().next().unwrap();
                    v.push(c);
                    j += c.len_utf8();
                }
            }
        }
        assert!(
            out.insert(key.to_string(), v).is_none(),
            "duplicate label {key}"
        );
        i = j + 1;
        if i < b.len() {
            assert_eq!(b[i], b',', "labels not comma separated in {s:?}");
            i += 1;
        }
    }
    out
}

/// Every line is a HELP, a TYPE (before the metric's samples, once) or a sample of a typed
/// metric; counters are named `_total`.
fn parse_exposition(text: &str) -> Scrape {
    let mut types = BTreeMap::new();
    let mut helped = HashSet::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, _) = rest.split_once(' ').expect("HELP has text");
            assert!(
                valid_name(name) && helped.insert(name.to_string()),
                "{line}"
            );
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, t) = rest.split_once(' ').expect("TYPE has a type");
            assert!(valid_name(name), "{line}");
            assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&t));
            assert!(
                types.insert(name.to_string(), t.to_string()).is_none(),
                "{line}"
            );
            if t == "counter" {
                assert!(name.ends_with("_total"), "counter {name} not named _total");
            }
        } else {
            assert!(
                !line.starts_with('#') && !line.is_empty(),
                "stray line {line:?}"
            );
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, parse_labels(l.strip_suffix('}').expect("labels close"))),
                None => (series, Labels::new()),
            };
            assert!(valid_name(name), "{line}");
            assert!(types.contains_key(name), "sample before TYPE: {line}");
            let v: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line}"));
            samples.push((name.to_string(), labels, v));
        }
    }
    Scrape { types, samples }
}

fn scrape(addr: SocketAddr) -> Scrape {
    let r = common::metrics_page(addr).unwrap();
    let (head, body) = r.split_once("\r\n\r\n").expect("HTTP response");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    parse_exposition(body)
}

// ---- threads ------------------------------------------------------------------------------

/// A `kB` field of `/proc/PID/status`, in bytes.
fn proc_status_bytes(pid: i32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let l = s.lines().find(|l| l.starts_with(field)).unwrap();
    l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() << 10
}

/// Names every thread of `pid` has (`/proc/PID/task/*/comm`).
fn thread_names(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path().join("comm");
            std::fs::read_to_string(p).unwrap().trim().to_string()
        })
        .collect()
}

/// Only the main thread carries the program's name; every other one is named for its job,
/// and numbered ones are unique (a thread spawned unnamed would inherit its parent's name).
fn assert_threads_named(pid: i32, allowed: &[&str]) {
    let names = thread_names(pid);
    let main = names.iter().filter(|n| *n == "nvstore").count();
    assert_eq!(main, 1, "unnamed threads in {pid}: {names:?}");
    let mut seen = HashSet::new();
    for n in names.iter().filter(|n| *n != "nvstore") {
        // io_uring's workers are named by the kernel.
        if n.starts_with("iou-") {
            continue;
        }
        assert!(
            allowed.iter().any(|a| n.starts_with(a)),
            "thread {n:?} of {pid} is not named for its job: {names:?}"
        );
        if n.ends_with(|c: char| c.is_ascii_digit()) {
            assert!(seen.insert(n.clone()), "two threads named {n}: {names:?}");
        }
    }
}

/// Stop (SIGSTOP) a node holding a shard of an object, write the object, and find the write
/// in the primary's in-flight slow ops with a request to that node's shard unanswered; then
/// let the node go on and the write completes.
fn stalled_op_shows_the_shard_it_waits_for(h: &Harness, pool: u64) {
    const STOPPED: u32 = NODES;
    let c = &h.client;
    let map = c.map();
    let p = &map.pools[&pool];
    let (name, primary, slot) = (0..1000)
        .find_map(|i| {
            let name = format!("stall-{i}");
            let pg = nvstore::placement::pg_of(p, name.as_bytes());
            let a = nvstore::placement::Acting::compute(&map, p, pg);
            let slot = a.members.iter().position(|m| *m == Some(STOPPED))?;
            (a.primary != Some(STOPPED)).then(|| (name, a.primary.unwrap(), slot))
        })
        .expect("an object with a shard on the stopped node");
    let pid = h.lc.start_member(&format!("node.{STOPPED}")).unwrap();
    // SAFETY: signalling a node process this test's cluster started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let found = std::thread::scope(|s| {
        let writer = s.spawn(|| c.put(pool, name.as_bytes(), b"waits for a stopped node"));
        let t = Instant::now();
        let found = loop {
            let r = c.slow_ops(primary).unwrap();
            let stuck = r["in_flight"].as_array().unwrap().iter().find(|op| {
                let on_slot = |ev: &str| {
                    op["events"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|e| e["event"] == ev && e["shard"] == slot)
                        .count()
                };
                op["object"] == name.as_str()
                    && op["in_flight"] == true
                    && on_slot("sub_op_sent") > on_slot("sub_op_acked") + on_slot("sub_op_failed")
            });
            if let Some(op) = stuck {
                break Some(op.clone());
            }
            if t.elapsed() > Duration::from_secs(2) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        writer
            .join()
            .unwrap()
            .expect("the write completes once the node runs again");
        found
    });
    let op = found.expect("the stalled write in the primary's in-flight slow ops");
    assert_eq!(op["op"], "client_op");
    assert!(op.get("status").is_none(), "no reply yet: {op:#}");
    assert_eq!(
        c.get(pool, name.as_bytes()).unwrap(),
        b"waits for a stopped node"
    );
}

#[test]
fn counters_slow_ops_metrics_and_thread_names() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let h = cluster(LocalOptions {
        nodes: NODES,
        monitors: 1,
        device_bytes: 256 << 20,
        heartbeat_ms: 300,
        // Every op counts as slow (a threshold of 0): the slow-op path runs for every op, so
        // the test does not depend on how fast this machine is.
        slow_op_ms: 0,
        ..LocalOptions::default()
    });
    let c = &h.client;
    let pool = c.create_pool("obs", 2, 1, 16 << 10, 8, None).unwrap();

    // perf dump counters move by what a known workload did.
    let before = dump_all(c);
    write_objects(c, pool, "a");
    let after = dump_all(c);
    let delta = |path: &str| total(&after, path) - total(&before, path);
    // Every object: k+m = 3 shard writes, each one store transaction.
    assert!(delta("store.txns") >= 3 * OBJECTS as u64, "{after:#?}");
    assert!(delta("client.write_ops") >= OBJECTS as u64);
    // Exactly the bytes written, unless a lost reply made the client send a write again.
    let written = (OBJECTS * OBJECT_BYTES) as u64;
    assert!((written..2 * written).contains(&delta("client.write_bytes")));
    assert!(delta("ec.encoded_bytes") >= (OBJECTS * OBJECT_BYTES) as u64);
    assert!(delta("driver.writes") > 0 && delta("driver.write_bytes") > 0);
    assert!(delta("store.flushes") + delta("store.fua_rounds") > 0);
    assert!(delta("messenger.bytes_in") > (OBJECTS * OBJECT_BYTES) as u64);
    // Each object: the client op and the k+m-1 = 2 remote shard writes (the primary's own
    // shard is written in place; a new object in a complete PG needs no stat round).
    assert!(delta("ops.finished") >= 3 * OBJECTS as u64);
    assert!(
        delta("client.resolves_absent_local") + delta("client.resolves_asked") >= OBJECTS as u64
    );
    for d in &after {
        // Group-commit batch sizes: every round lands in one bucket (a round may finish
        // between reading the round count and the buckets).
        let buckets: u64 = ["1", "2", "4", "8", "16", "32", "64", "128"]
            .iter()
            .map(|b| u(d, &format!("store.commit_rounds_txns_le_{b}")))
            .sum::<u64>()
            + u(d, "store.commit_rounds_txns_gt_128");
        let rounds = u(d, "store.commit_rounds");
        assert!(
            rounds > 0 && (rounds..=rounds + 1).contains(&buckets),
            "{d:#}"
        );
        let dev = d["store"]["by_device"].as_object().expect("per device");
        assert_eq!(dev.len(), 1, "{d:#}");
        assert!(dev.values().all(|v| v["segments_total"].as_u64() > Some(0)));
        assert!(d["messenger"]["by_worker"]["0"]["iterations"].is_u64());
        assert!(d["throttle"]["by_class"]["client"]["acquired"].is_u64());
        assert!(d["recovery"].is_object());
        assert_eq!(u(d, "ops.slow_threshold_ms"), 0);
        let (rss, peak) = (u(d, "process.rss_bytes"), u(d, "process.peak_rss_bytes"));
        assert!(rss > 1 << 20 && peak >= rss, "{d:#}");
    }

    // perf reset zeroes counters, keeps gauges.
    for n in 1..=NODES {
        assert_eq!(c.perf_reset(n).unwrap()["reset"], true);
    }
    let reset = dump_all(c);
    for (d, was) in reset.iter().zip(&after) {
        assert_eq!(u(d, "client.write_ops"), 0);
        assert_eq!(u(d, "ec.encoded_bytes"), 0);
        // Store and device counters start again too, but a background transaction (a PG
        // mark another node's primary advances every 2 s) may land right after the reset.
        for k in ["store.txns", "driver.writes"] {
            assert!(u(d, k) <= 2 && u(d, k) < u(was, k), "{k}: {d:#}");
        }
        let dev = d["store"]["by_device"].as_object().unwrap();
        let gauge = dev.values().next().unwrap()["segments_total"].as_u64();
        assert!(gauge > Some(0), "gauges survive a reset");
        assert!(u(d, "reset_unix_ms") > 0);
    }
    write_objects(c, pool, "b");
    assert_eq!(c.get(pool, b"b-3").unwrap(), vec![3 ^ 0x5a; OBJECT_BYTES]);
    let again = dump_all(c);
    assert!(total(&again, "store.txns") >= 3 * OBJECTS as u64);
    // A whole-object get of an object that fits in one message is one op: the stat the
    // client needs to know the size rides along with the read.
    assert_eq!(total(&again, "client.read_ops"), 1);
    assert!(total(&again, "client.read_bytes") >= OBJECT_BYTES as u64);

    // Slow ops: with a 1 ms threshold the writes were slow; their timelines are in order.
    let mut client_ops = Vec::new();
    for n in 1..=NODES {
        let r = c.slow_ops(n).unwrap();
        assert_eq!(u(&r, "threshold_ms"), 0);
        assert!(u(&r, "slow_total") > 0, "{r:#}");
        for op in r["history"].as_array().unwrap() {
            let evs: Vec<&str> = op["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["event"].as_str().unwrap())
                .collect();
            let offs: Vec<f64> = op["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["offset_ms"].as_f64().unwrap())
                .collect();
            assert!(offs.windows(2).all(|w| w[0] <= w[1]), "{op:#}");
            assert_eq!(evs[0], "received", "{op:#}");
            assert!(op["duration_ms"].as_f64().unwrap() > 0.0);
            if op["events_dropped"] == 0 {
                assert_eq!(*evs.last().unwrap(), "replied", "{op:#}");
            }
            if op["op"] == "client_op" {
                client_ops.push((
                    evs.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                    op.clone(),
                ));
            }
        }
    }
    let (evs, op) = client_ops
        .iter()
        .find(|(e, _)| e.contains(&"commit_start".to_string()))
        .expect("a slow client op that committed a local shard");
    let pos = |name: &str| {
        evs.iter()
            .position(|e| e == name)
            .unwrap_or_else(|| panic!("{name} in {op:#}"))
    };
    assert!(pos("received") < pos("queued") && pos("queued") < pos("started"));
    assert!(pos("started") < pos("sub_op_sent") && pos("sub_op_sent") < pos("sub_op_acked"));
    assert!(pos("commit_start") < pos("commit_end"));
    assert!(op["client"].as_str().unwrap().starts_with("client."));
    assert!(op["object"].as_str().unwrap().len() >= 3);
    assert_eq!(op["status"], "ok");

    // An op stuck on a member shows, while in flight, which shard it waits for.
    stalled_op_shows_the_shard_it_waits_for(&h, pool);

    // Health warns about them (heartbeats carry the count).
    let t = Instant::now();
    let st = loop {
        let st = c.status().unwrap();
        if st
            .health_detail
            .iter()
            .any(|d| d.contains("slow ops on node"))
        {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no slow-op warning: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(st.health, "HEALTH_WARN", "{st:?}");
    let line = st
        .health_detail
        .iter()
        .find(|d| d.contains("slow ops on node"))
        .unwrap();
    assert!(line.contains(", oldest ") && line.ends_with(" s"), "{line}");

    // Prometheus: a node and a monitor, scraped over HTTP and parsed strictly.
    let node_addr =
        h.lc.metrics_addr("node.1")
            .unwrap()
            .expect("node metrics port");
    let mon_addr =
        h.lc.metrics_addr("mon.1")
            .unwrap()
            .expect("monitor metrics port");
    let s0 = scrape(node_addr);
    assert_eq!(s0.types["nvstore_store_txns_total"], "counter");
    assert_eq!(s0.types["nvstore_driver_queue_depth"], "gauge");
    assert_eq!(
        s0.get("nvstore_ops_slow_threshold_ms", &[("node", "1")]),
        [0.0]
    );
    assert!(!s0
        .get(
            "nvstore_messenger_iterations_total",
            &[("node", "1"), ("worker", "0")]
        )
        .is_empty());
    assert!(s0
        .samples
        .iter()
        .filter(|(n, ..)| n == "nvstore_store_txns_total")
        .all(|(_, l, _)| l.contains_key("device")));
    write_objects(c, pool, "c");
    let s1 = scrape(node_addr);
    assert!(
        s1.sum("nvstore_messenger_bytes_in_total") > s0.sum("nvstore_messenger_bytes_in_total")
    );
    assert!(s1.sum("nvstore_ops_finished_total") > s0.sum("nvstore_ops_finished_total"));
    assert!(
        s1.sum("nvstore_store_txns_total") >= s0.sum("nvstore_store_txns_total"),
        "counters never go back (perf reset does not touch Prometheus)"
    );
    let m = scrape(mon_addr);
    assert_eq!(
        m.get("nvstore_cluster_nodes_up", &[("monitor", "1")]),
        [NODES as f64]
    );
    assert_eq!(m.get("nvstore_cluster_health", &[]), [1.0], "HEALTH_WARN");
    assert_eq!(m.get("nvstore_monitor_is_leader", &[]), [1.0]);
    assert!(m.sum("nvstore_messenger_frames_in_total") > 0.0);
    assert!(m.sum("nvstore_node_slow_ops") > 0.0);

    // Threads are named for their jobs.
    let node_pid = h.lc.start_member("node.1").unwrap();
    assert_threads_named(
        node_pid,
        &[
            "msgr-worker-",
            "msgr-handler-",
            "node-op-",
            "node-shard-",
            "node-heartbeat",
            "node-peer-ping",
            "node-peer-dial",
            "node-scrub",
            "node-strays",
            "node-recovery",
            "node-rebuild-",
            "node-rshard-",
            "node-metrics",
            "monc-poll",
            "store-",
        ],
    );
    let names = thread_names(node_pid);
    assert!(names.iter().any(|n| n == "node-metrics") && names.iter().any(|n| n == "store-commit"));
    // The node's memory figures are its own process's: between the RSS read before the dump
    // and the high-water mark read after it (which only grows).
    let rss_before = proc_status_bytes(node_pid, "VmRSS:");
    let peak = u(&c.perf_dump(1).unwrap(), "process.peak_rss_bytes");
    let hwm_after = proc_status_bytes(node_pid, "VmHWM:");
    assert!(
        rss_before <= peak && peak <= hwm_after,
        "VmRSS {rss_before} <= peak {peak} <= VmHWM {hwm_after}"
    );
    assert!(scrape(node_addr).get("nvstore_process_peak_rss_bytes", &[("node", "1")])[0] > 0.0);
    let mon_pid = h.lc.start_member("mon.1").unwrap();
    assert_threads_named(
        mon_pid,
        &[
            "msgr-worker-",
            "msgr-handler-",
            "mon-raft-",
            "mon-push",
            "mon-liveness",
            "mon-metrics",
        ],
    );

    // Bad input gets a clear error, and the nodes keep serving.
    let e = c.perf_dump(99).unwrap_err().to_string();
    assert!(e.contains("no node 99 in the map"), "{e}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["perf", "dump", "77", "--conf"])
        .arg(h.lc.client_config())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no node 77"),
        "{out:?}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["slow-ops", "2", "--conf"])
        .arg(h.lc.client_config())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["node"], 2);
    raw_admin_requests_get_clear_errors(&h);
    assert!(c.perf_dump(1).is_ok(), "the node keeps serving");
    runtime_config_changes_a_running_node(&h);
}

/// `nvstore config get|set`: the setting changes on the running node, and what it governs
/// follows (the slow-op threshold in the slow-ops report); bad keys and values are refused
/// with what was expected, changing nothing.
fn runtime_config_changes_a_running_node(h: &Harness) {
    let c = &h.client;
    let v = c.config(3, None).unwrap();
    assert_eq!(v["node"], 3);
    assert_eq!(v["read_coalescing"], true, "{v}");
    assert_eq!(
        v["slow_op_ms"], 0,
        "this cluster counts every op as slow: {v}"
    );
    let v = c.config(3, Some(("read_coalescing", "false"))).unwrap();
    assert_eq!(v["read_coalescing"], false, "{v}");
    let v = c.config(3, Some(("slow_op_ms", "2500"))).unwrap();
    assert_eq!(v["slow_op_ms"], 2500, "{v}");
    assert_eq!(c.slow_ops(3).unwrap()["threshold_ms"], 2500);
    // A setting the node refuses: the error text.
    let refused = |key: &str, value: &str| c.config(3, Some((key, value))).unwrap_err().to_string();
    let e = refused("cache_bytes", "1");
    assert!(
        e.contains("no runtime setting") && e.contains("read_coalescing"),
        "{e}"
    );
    let e = refused("read_coalescing", "maybe");
    assert!(e.contains("expected true or false"), "{e}");
    let e = refused("slow_op_ms", "-4");
    assert!(e.contains("expected milliseconds"), "{e}");
    assert_eq!(v["inject_write_delay_ms"], 0, "fault injection is off: {v}");
    let e = refused("inject_write_delay_ms", "soon");
    assert!(e.contains("expected milliseconds"), "{e}");
    assert_eq!(
        v["inject_shard_apply_delay_ms"], 0,
        "fault injection is off: {v}"
    );
    let e = refused("inject_shard_apply_delay_ms", "1.5");
    assert!(e.contains("expected milliseconds"), "{e}");
    assert_eq!(
        v["inject_drop_staged"], false,
        "fault injection is off: {v}"
    );
    let e = refused("inject_drop_staged", "sometimes");
    assert!(e.contains("expected true or false"), "{e}");
    let v = c.config(3, None).unwrap();
    assert_eq!(v["inject_write_delay_ms"], 0, "{v}");
    assert_eq!(v["inject_shard_apply_delay_ms"], 0, "{v}");
    assert_eq!(v["inject_drop_staged"], false, "{v}");
    assert_eq!(
        (&v["read_coalescing"], &v["slow_op_ms"]),
        (&false.into(), &2500.into())
    );
    // The CLI: set then get.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvstore"))
        .args(["config", "set", "3", "read_coalescing", "true", "--conf"])
        .arg(h.lc.client_config())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["read_coalescing"], true, "{v}");
    // Other nodes are untouched.
    assert_eq!(c.config(2, None).unwrap()["slow_op_ms"], 0);
}

/// Admin messages straight to a node with bodies the client would never send.
fn raw_admin_requests_get_clear_errors(h: &Harness) {
    let m = h.raw_messenger(Identity::Client(4243));
    let map = h.client.map();
    let conn = m.connect(map.nodes[&1].addr, Identity::Node(1)).unwrap();
    let ask = |t: u16, payload: Vec<u8>| -> String {
        let r = conn
            .request(OutMessage::new(t, payload), Duration::from_secs(10))
            .unwrap();
        match wire::parse_reply(&r.payload) {
            Err(Error::Remote { status, message }) => {
                assert_eq!(status, Status::Malformed, "{message}");
                message
            }
            other => panic!("type {t}: {other:?}"),
        }
    };
    let epoch = map.epoch.to_le_bytes().to_vec();
    let short = ask(wire::MSG_ADMIN_PERF_DUMP, vec![1, 2]);
    assert!(short.contains("bytes were expected"), "{short}");
    let trailing = ask(wire::MSG_ADMIN_SLOW_OPS, [&epoch[..], b"xyz"].concat());
    assert!(
        trailing.contains("3 unexpected trailing bytes"),
        "{trailing}"
    );
    let unknown = ask(59, epoch);
    assert!(unknown.contains("unknown message type 59"), "{unknown}");
}
