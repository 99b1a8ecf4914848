//! `cargo bench -p nvstore-messenger`: the messenger against its baselines, same run, loopback.
//!
//! * Bulk: 4 MiB messages over one connection (window of 4 requests, empty acks) vs `iperf3`
//!   single stream. Goal ≥ 0.9×.
//! * Small request/reply: 50 connections, one request in flight each, vs `redis-server` +
//!   `redis-benchmark -t ping -c 50`. Goal ≥ 1.0×. p50/p99 latency and CPU per op for both.
//!   Then the same with one connection (latency). The messenger runs with its default
//!   busy-poll window and with busy-polling off, to show what the window buys and costs.
//!
//! Rounds alternate baseline and messenger; the table shows medians. Environment:
//! `NVSTORE_BENCH_SECS` seconds per run (default 5; 1 without `--bench`),
//! `NVSTORE_BENCH_ROUNDS` (default 3; 1 without `--bench`), `NVSTORE_BENCH_ONLY` (`bulk` or
//! `small`). Needs iperf3, redis-server and redis-tools (scripts/deps installs them).

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use nvstore_messenger::{
    Config, Connection, Dispatcher, Identity, Incoming, Messenger, OutMessage, Secret,
};

const BULK: u16 = 1;
const PING: u16 = 2;
const BULK_BYTES: usize = 4 << 20;
const BULK_WINDOW: usize = 4;
const T: Duration = Duration::from_secs(30);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The server side: acks bulk messages, answers pings, inline on the worker.
struct Server;

impl Dispatcher for Server {
    fn handle(&self, mut msg: Incoming) {
        let reply = match msg.msg_type() {
            BULK => OutMessage::empty(BULK),
            _ => OutMessage::new(PING, &b"PONG"[..]),
        };
        msg.reply(reply).expect("reply");
    }

    fn runs_inline(&self, _t: u16) -> bool {
        true
    }
}

/// A server and a client messenger, one worker each; `busy_poll` `None` keeps the default.
fn pair(busy_poll: Option<Duration>) -> (Messenger, Messenger, SocketAddr) {
    let k = Secret::generate();
    let mut cfg = Config {
        workers: 1,
        handler_threads: 0,
        ..Config::default()
    };
    if let Some(bp) = busy_poll {
        cfg.busy_poll = bp;
    }
    let server =
        Messenger::new(cfg.clone(), Identity::Node(0), k.clone(), Arc::new(Server)).unwrap();
    let addr = server.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let client = Messenger::new(cfg, Identity::Client(1), k, Arc::new(Server)).unwrap();
    (server, client, addr)
}

/// CPU seconds of this process (user + system).
fn self_cpu() -> f64 {
    rusage_secs(libc::RUSAGE_SELF)
}

fn rusage_secs(who: i32) -> f64 {
    // SAFETY: getrusage fills the zeroed struct we pass; no other preconditions.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn proc_cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum::<u64>() as f64 / nvstore_messenger::sys::ticks_per_second() as f64
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn need(tool: &str) {
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{tool} not found: run scripts/deps (as root) to install the benchmark baselines"
    );
}

// ---- bulk ----------------------------------------------------------------------------------------

struct Bulk {
    gbit: f64,
    cpu_pct: f64,
}

fn bulk_messenger(secs: u64) -> Bulk {
    let (_server, client, addr) = pair(None);
    let conn = client.connect(addr, Identity::Node(0)).unwrap();
    let data: Arc<[u8]> = (0..BULK_BYTES)
        .map(|i| (i * 31 + i / 977) as u8)
        .collect::<Vec<_>>()
        .into();
    let acked = Arc::new(AtomicU64::new(0));
    let (done_tx, done_rx) = crossbeam::channel::unbounded();
    // Warm up, then measure.
    let warm = Instant::now() + Duration::from_millis(300);
    send_bulk_window(&conn, &data, warm, &Arc::new(AtomicU64::new(0)), &done_tx);
    for _ in 0..BULK_WINDOW {
        done_rx.recv().unwrap();
    }
    let (t0, cpu0) = (Instant::now(), self_cpu());
    send_bulk_window(
        &conn,
        &data,
        t0 + Duration::from_secs(secs),
        &acked,
        &done_tx,
    );
    for _ in 0..BULK_WINDOW {
        done_rx.recv().unwrap();
    }
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), self_cpu() - cpu0);
    Bulk {
        gbit: acked.load(Relaxed) as f64 * 8.0 / wall / 1e9,
        cpu_pct: 100.0 * cpu / wall,
    }
}

fn send_bulk_window(
    conn: &Connection,
    data: &Arc<[u8]>,
    until: Instant,
    acked: &Arc<AtomicU64>,
    done: &crossbeam::channel::Sender<()>,
) {
    for _ in 0..BULK_WINDOW {
        send_bulk(
            conn.clone(),
            data.clone(),
            until,
            acked.clone(),
            done.clone(),
        );
    }
}

fn send_bulk(
    conn: Connection,
    data: Arc<[u8]>,
    until: Instant,
    acked: Arc<AtomicU64>,
    done: crossbeam::channel::Sender<()>,
) {
    let next = conn.clone();
    conn.request_with(OutMessage::new(BULK, data.clone()), T, move |r| {
        r.expect("bulk ack");
        acked.fetch_add(BULK_BYTES as u64, Relaxed);
        if Instant::now() < until {
            send_bulk(next, data, until, acked, done);
        } else {
            done.send(()).unwrap();
        }
    });
}

fn bulk_iperf3(secs: u64) -> Bulk {
    let port = free_port().to_string();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("iperf3 -s");
    wait_port(&port);
    let out = Command::new("iperf3")
        .args([
            "-c",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            &secs.to_string(),
            "-O",
            "1",
            "-J",
        ])
        .output()
        .expect("iperf3 -c");
    let _ = server.wait();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("iperf3 JSON");
    let bps = j["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .expect("bits_per_second");
    let cpu = &j["end"]["cpu_utilization_percent"];
    Bulk {
        gbit: bps / 1e9,
        cpu_pct: cpu["host_total"].as_f64().unwrap_or(0.0)
            + cpu["remote_total"].as_f64().unwrap_or(0.0),
    }
}

/// Wait until something listens on 127.0.0.1:`port`, without connecting to it (a probe
/// connection would be taken as a client by `iperf3 -s -1`).
fn wait_port(port: &str) {
    let hex = format!("{:04X}", port.parse::<u16>().unwrap());
    let listening = |file: &str| {
        std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .any(|l| {
                // local_address ("ADDR:PORT" in hex) is field 2; state 0A is LISTEN.
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[1].rsplit(':').next() == Some(hex.as_str()) && f[3] == "0A"
            })
    };
    for _ in 0..500 {
        if listening("/proc/net/tcp") || listening("/proc/net/tcp6") {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("nothing listens on port {port}");
}

// ---- small request/reply -------------------------------------------------------------------------

struct Small {
    ops: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_us_per_op: f64,
}

struct Loop {
    until: Instant,
    ops: AtomicU64,
    hist: Mutex<Histogram<u64>>,
    done: crossbeam::channel::Sender<()>,
}

fn ping(conn: Connection, lp: Arc<Loop>) {
    let next = conn.clone();
    let t = Instant::now();
    conn.request_with(OutMessage::new(PING, &b"PING"[..]), T, move |r| {
        r.expect("pong");
        let ns = t.elapsed().as_nanos() as u64;
        lp.hist.lock().unwrap().record(ns.max(1)).unwrap();
        lp.ops.fetch_add(1, Relaxed);
        if Instant::now() < lp.until {
            ping(next, lp);
        } else {
            lp.done.send(()).unwrap();
        }
    });
}

fn small_messenger(secs: u64, conns_n: usize, busy_poll: Option<Duration>) -> Small {
    let (_server, client, addr) = pair(busy_poll);
    let conns: Vec<_> = (0..conns_n)
        .map(|_| client.connect(addr, Identity::Node(0)).unwrap())
        .collect();
    let run = |d: Duration| {
        let (tx, rx) = crossbeam::channel::unbounded();
        let lp = Arc::new(Loop {
            until: Instant::now() + d,
            ops: AtomicU64::new(0),
            hist: Mutex::new(Histogram::new(3).unwrap()),
            done: tx,
        });
        let (t0, cpu0) = (Instant::now(), self_cpu());
        for c in &conns {
            ping(c.clone(), lp.clone());
        }
        for _ in 0..conns_n {
            rx.recv().unwrap();
        }
        (lp, t0.elapsed().as_secs_f64(), self_cpu() - cpu0)
    };
    run(Duration::from_millis(300));
    let (lp, wall, cpu) = run(Duration::from_secs(secs));
    let h = lp.hist.lock().unwrap();
    let ops = lp.ops.load(Relaxed) as f64;
    Small {
        ops: ops / wall,
        p50_us: h.value_at_quantile(0.5) as f64 / 1e3,
        p99_us: h.value_at_quantile(0.99) as f64 / 1e3,
        cpu_us_per_op: cpu * 1e6 / ops,
    }
}

struct Redis {
    child: Child,
    port: String,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn small_redis(secs: u64, conns_n: usize, expected_ops: f64) -> Small {
    let port = free_port().to_string();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server");
    let redis = Redis { child, port };
    wait_port(&redis.port);
    let n = ((expected_ops * secs as f64) as u64)
        .max(10_000)
        .to_string();
    let (srv0, kids0, t0) = (
        proc_cpu_secs(redis.child.id()),
        rusage_secs(libc::RUSAGE_CHILDREN),
        Instant::now(),
    );
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            &redis.port,
            "-t",
            "ping",
            "-c",
            &conns_n.to_string(),
            "-n",
            &n,
            "--csv",
        ])
        .output()
        .expect("redis-benchmark");
    let _wall = t0.elapsed();
    let cpu =
        (proc_cpu_secs(redis.child.id()) - srv0) + (rusage_secs(libc::RUSAGE_CHILDREN) - kids0);
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<Vec<f64>> = text
        .lines()
        .filter(|l| l.starts_with("\"PING"))
        .map(|l| {
            l.split(',')
                .skip(1)
                .map(|f| f.trim_matches('"').parse().unwrap_or(0.0))
                .collect()
        })
        .collect();
    assert_eq!(rows.len(), 2, "redis-benchmark output: {text}");
    // Two tests (inline and multibulk PING) ran; credit redis with its better one.
    let best = rows.iter().max_by(|a, b| a[0].total_cmp(&b[0])).unwrap();
    let total_ops = 2.0 * n.parse::<f64>().unwrap();
    Small {
        ops: best[0],
        p50_us: best[3] * 1e3,
        p99_us: best[5] * 1e3,
        cpu_us_per_op: cpu * 1e6 / total_ops,
    }
}

fn small_cell(o: &Small) -> String {
    format!(
        "{:.0} op/s, p50 {:.0} µs, p99 {:.0} µs, {:.1} µs cpu/op",
        o.ops, o.p50_us, o.p99_us, o.cpu_us_per_op
    )
}

fn median_by<T>(mut v: Vec<T>, key: impl Fn(&T) -> f64) -> T {
    v.sort_by(|a, b| key(a).total_cmp(&key(b)));
    v.swap_remove(v.len() / 2)
}

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let secs = env_u64("NVSTORE_BENCH_SECS", if quick { 1 } else { 5 });
    let rounds = env_u64("NVSTORE_BENCH_ROUNDS", if quick { 1 } else { 3 }) as usize;
    let only = std::env::var("NVSTORE_BENCH_ONLY").unwrap_or_default();
    if cfg!(debug_assertions) {
        println!(
            "(unoptimised build: a smoke run of the harness, not a measurement; use cargo bench)"
        );
    }
    println!(
        "nvstore-messenger vs baselines on loopback, {secs} s × {rounds} rounds (medians), {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let mut rows = Vec::new();
    if only.is_empty() || only == "bulk" {
        need("iperf3");
        let (mut ours, mut base) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            base.push(bulk_iperf3(secs));
            ours.push(bulk_messenger(secs));
        }
        let (o, b) = (median_by(ours, |x| x.gbit), median_by(base, |x| x.gbit));
        rows.push([
            "4 MiB messages, 1 connection".to_string(),
            format!("{:.1} Gbit/s, cpu {:.0} %", o.gbit, o.cpu_pct),
            format!(
                "iperf3 1 stream: {:.1} Gbit/s, cpu {:.0} %",
                b.gbit, b.cpu_pct
            ),
            format!("{:.2}×", o.gbit / b.gbit),
            "≥ 0.90×".to_string(),
        ]);
    }
    if only.is_empty() || only == "small" {
        need("redis-server");
        need("redis-benchmark");
        for conns_n in [50usize, 1] {
            let (mut polled, mut unpolled, mut base) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rounds {
                let o = small_messenger(secs, conns_n, None);
                base.push(small_redis(secs, conns_n, o.ops));
                polled.push(o);
                unpolled.push(small_messenger(secs, conns_n, Some(Duration::ZERO)));
            }
            let b = median_by(base, |x| x.ops);
            let goal = if conns_n == 50 { "≥ 1.00×" } else { "-" };
            for (label, v) in [
                ("busy-poll 50 µs (default)", polled),
                ("busy-poll off", unpolled),
            ] {
                let o = median_by(v, |x| x.ops);
                rows.push([
                    format!("request/reply, {conns_n} conn, {label}"),
                    small_cell(&o),
                    format!("redis ping -c {conns_n}: {}", small_cell(&b)),
                    format!("{:.2}×", o.ops / b.ops),
                    goal.to_string(),
                ]);
            }
        }
    }
    print_table(
        &["workload", "nvstore-messenger", "baseline", "ratio", "goal"],
        &rows,
    );
}

fn print_table(head: &[&str; 5], rows: &[[String; 5]]) {
    let w: Vec<usize> = (0..5)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([head[i].len()])
                .max()
                .unwrap()
        })
        .collect();
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&w)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(head.to_vec());
    println!(
        "|{}|",
        w.iter()
            .map(|w| "-".repeat(w + 2))
            .collect::<Vec<_>>()
            .join("|")
    );
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}
