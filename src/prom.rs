//! Metrics as samples, rendered as Prometheus text exposition format 0.0.4, and the small
//! HTTP listener that serves them (`GET /metrics`) on nodes and monitors.
//!
//! The listener is a std `TcpListener` loop on one thread, not an HTTP crate: it answers one
//! method on one path and closes each connection, which is a few dozen lines, with the limits
//! (request size, read timeout) in plain sight and no extra threads or dependencies.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use messenger::MessengerStats;

use crate::error::{Error, Result};

/// Bytes of a request (line and headers) the listener reads before giving up on it.
const REQUEST_BYTES_MAX: usize = 8192;
/// A scraper that sends nothing for this long is dropped.
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(2);
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (reset by `perf reset` in `perf dump`, never in Prometheus).
    Counter,
    /// A level: in flight now, a high-water mark, a size.
    Gauge,
}

/// One value of one metric.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Subsystem: the `perf dump` object and the metric name's middle part.
    pub group: &'static str,
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    /// At most one instance label (worker, device, throttle class), or none.
    pub label: Option<(&'static str, String)>,
    pub value: u64,
}

/// Samples being collected.
#[derive(Debug, Default)]
pub struct Samples(pub Vec<Sample>);

impl Samples {
    pub fn counter(&mut self, group: &'static str, name: &'static str, help: &'static str, v: u64) {
        self.push(group, name, help, Kind::Counter, None, v);
    }

    pub fn gauge(&mut self, group: &'static str, name: &'static str, help: &'static str, v: u64) {
        self.push(group, name, help, Kind::Gauge, None, v);
    }

    pub fn push(
        &mut self,
        group: &'static str,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        label: Option<(&'static str, String)>,
        value: u64,
    ) {
        self.0.push(Sample {
            group,
            name,
            help,
            kind,
            label,
            value,
        });
    }
}

/// The metric name of a sample: `nvstore_<group>_<name>`, `_total` for counters.
pub fn metric_name(s: &Sample) -> String {
    let suffix = if s.kind == Kind::Counter {
        "_total"
    } else {
        ""
    };
    format!("nvstore_{}_{}{suffix}", s.group, s.name)
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Render samples as exposition format 0.0.4: one HELP and TYPE line per metric, then its
/// samples, each with the `common` labels (e.g. `node="3"`) and its own.
pub fn render(samples: &[Sample], common: &[(&str, String)]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut by_name: std::collections::HashMap<String, Vec<&Sample>> = Default::default();
    for s in samples {
        let n = metric_name(s);
        if !by_name.contains_key(&n) {
            order.push(n.clone());
        }
        by_name.entry(n).or_default().push(s);
    }
    let mut out = String::new();
    for n in order {
        let group = &by_name[&n];
        let first = group[0];
        let kind = match first.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        };
        let _ = writeln!(out, "# HELP {n} {}", first.help.replace('\n', " "));
        let _ = writeln!(out, "# TYPE {n} {kind}");
        for s in group {
            let labels: Vec<String> = common
                .iter()
                .map(|(k, v)| (*k, v.as_str()))
                .chain(s.label.as_ref().map(|(k, v)| (*k, v.as_str())))
                .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                .collect();
            if labels.is_empty() {
                let _ = writeln!(out, "{n} {}", s.value);
            } else {
                let _ = writeln!(out, "{n}{{{}}} {}", labels.join(","), s.value);
            }
        }
    }
    out
}

/// A messenger's counters: per worker, per throttle class, and the buffer pool.
pub fn messenger_samples(m: &MessengerStats, out: &mut Samples) {
    use Kind::{Counter as C, Gauge as G};
    for (i, w) in m.workers.iter().enumerate() {
        #[rustfmt::skip]
        let rows: [(&'static str, Kind, u64, &'static str); 19] = [
            ("iterations", C, w.iterations, "Event-loop passes that slept or found work"),
            ("empty_iterations", C, w.empty_iterations, "Passes that woke and found nothing to do"),
            ("sleeps", C, w.sleeps, "Blocking waits of the event loop"),
            ("busy_poll_spins", C, w.busy_poll_spins, "Busy-poll passes that found nothing"),
            ("busy_poll_ns", C, w.busy_poll_ns, "Nanoseconds spent busy-polling"),
            ("wake_io", C, w.wake_io, "Passes with socket events"),
            ("wake_mailbox", C, w.wake_mailbox, "Passes with commands from other threads"),
            ("wake_timer", C, w.wake_timer, "Passes that fired timers"),
            ("bulk_yields", C, w.bulk_yields, "Passes that wrote a whole pass budget, then yielded the CPU"),
            ("frames_in", C, w.frames_in, "Frames received"),
            ("frames_out", C, w.frames_out, "Frames sent"),
            ("bytes_in", C, w.bytes_in, "Bytes received"),
            ("bytes_out", C, w.bytes_out, "Bytes sent"),
            ("conns_open", G, w.conns_open, "Connections open on the worker"),
            ("conns_accepted", C, w.conns_accepted, "Connections accepted"),
            ("protocol_errors", C, w.protocol_errors, "Connections closed for protocol errors"),
            ("auth_failures", C, w.auth_failures, "Handshakes that failed authentication"),
            ("late_replies", C, w.late_replies, "Replies after their request timed out"),
            ("reconnects", C, w.reconnects, "Reconnections of outgoing connections"),
        ];
        for (name, kind, v, help) in rows {
            out.push(
                "messenger",
                name,
                help,
                kind,
                Some(("worker", i.to_string())),
                v,
            );
        }
    }
    for (class, t) in [
        ("client", &m.client_throttle),
        ("node", &m.node_throttle),
        ("connection", &m.conn_throttles),
    ] {
        #[rustfmt::skip]
        let rows: [(&'static str, Kind, u64, &'static str); 8] = [
            ("acquired", C, t.acquired, "Throttle grants, immediate or after a pause"),
            ("paused", C, t.paused, "Times a connection stopped reading at the cap"),
            ("resumed", C, t.resumed, "Times a paused connection was granted capacity"),
            ("paused_ns", C, t.paused_ns, "Nanoseconds connections spent paused"),
            ("messages_current", G, t.messages_current, "Messages holding capacity now"),
            ("bytes_current", G, t.bytes_current, "Bytes holding capacity now"),
            ("messages_max", G, t.messages_max, "High-water mark of messages in one throttle"),
            ("bytes_max", G, t.bytes_max, "High-water mark of bytes in one throttle"),
        ];
        for (name, kind, v, help) in rows {
            out.push(
                "throttle",
                name,
                help,
                kind,
                Some(("class", class.to_string())),
                v,
            );
        }
    }
    let p = &m.pool;
    out.counter(
        "msgr_pool",
        "fresh",
        "Receive buffers allocated from the system",
        p.fresh,
    );
    out.counter(
        "msgr_pool",
        "reused",
        "Receive buffers taken from a free list",
        p.reused,
    );
}

/// What a metrics endpoint serves: called on every scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Serve `GET /metrics` on `addr` from a thread named `thread` (port 0: any free port).
/// Returns the bound address.
/// The file in a member's data dir that names the address its metrics are served at (the
/// config may say port 0: the port is then the one the listener got).
pub const ADDR_FILE: &str = "metrics.addr";

/// Record where metrics are served, for tools that find members by their data dir.
pub fn record_addr(data_dir: &std::path::Path, bound: SocketAddr) -> Result<()> {
    let tmp = data_dir.join(format!("{ADDR_FILE}.tmp"));
    std::fs::write(&tmp, bound.to_string())
        .and_then(|_| std::fs::rename(&tmp, data_dir.join(ADDR_FILE)))
        .map_err(|e| Error::io(format!("{}", data_dir.join(ADDR_FILE).display()), e))
}

pub fn serve(addr: SocketAddr, thread: &str, render: Render) -> Result<SocketAddr> {
    let l = TcpListener::bind(addr).map_err(|e| Error::io(format!("metrics listen {addr}"), e))?;
    let bound = l
        .local_addr()
        .map_err(|e| Error::io("metrics local addr", e))?;
    std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || {
            for s in l.incoming().flatten() {
                if let Err(e) = answer(s, &render) {
                    tracing::debug!("metrics request: {e}");
                }
            }
        })
        .map_err(|e| Error::io("spawn", e))?;
    Ok(bound)
}

fn answer(mut s: TcpStream, render: &Render) -> std::io::Result<()> {
    s.set_read_timeout(Some(REQUEST_READ_TIMEOUT))?;
    s.set_write_timeout(Some(REQUEST_READ_TIMEOUT))?;
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        if buf.len() > REQUEST_BYTES_MAX {
            return respond(
                &mut s,
                "431 Request Header Fields Too Large",
                "request too large\n",
            );
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf);
    let line = text.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => {
            let body = render();
            write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n",
                body.len()
            )?;
            s.write_all(body.as_bytes())
        }
        ("GET", _) => respond(&mut s, "404 Not Found", "only /metrics is served here\n"),
        ("", _) => respond(&mut s, "400 Bad Request", "no request line\n"),
        _ => respond(
            &mut s,
            "405 Method Not Allowed",
            "only GET is served here\n",
        ),
    }
}

fn respond(s: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_help_type_and_labels_once_per_metric() {
        let mut s = Samples::default();
        s.push(
            "store",
            "txns",
            "Transactions",
            Kind::Counter,
            Some(("device", "a\"b".into())),
            3,
        );
        s.push(
            "store",
            "txns",
            "Transactions",
            Kind::Counter,
            Some(("device", "c".into())),
            4,
        );
        s.gauge("ops", "in_flight", "Ops in flight", 2);
        let t = render(&s.0, &[("node", "7".into())]);
        assert_eq!(
            t,
            "# HELP nvstore_store_txns_total Transactions\n\
             # TYPE nvstore_store_txns_total counter\n\
             nvstore_store_txns_total{node=\"7\",device=\"a\\\"b\"} 3\n\
             nvstore_store_txns_total{node=\"7\",device=\"c\"} 4\n\
             # HELP nvstore_ops_in_flight Ops in flight\n\
             # TYPE nvstore_ops_in_flight gauge\n\
             nvstore_ops_in_flight{node=\"7\"} 2\n"
        );
    }

    #[test]
    fn serves_metrics_and_refuses_other_requests() {
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            "test-metrics",
            Arc::new(|| "x 1\n".to_string()),
        )
        .unwrap();
        let get = |req: &str| {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(req.as_bytes()).unwrap();
            let mut r = String::new();
            c.read_to_string(&mut r).unwrap();
            r
        };
        let r = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(
            r.contains(CONTENT_TYPE) && r.ends_with("\r\n\r\nx 1\n"),
            "{r}"
        );
        assert!(get("GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    }
}
