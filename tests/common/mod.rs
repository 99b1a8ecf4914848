//! What the cluster integration tests share: a local cluster of real monitor and node
//! processes (the built `nvstore` binary) on loopback, torn down when the test ends whether it
//! passes or panics, and seeded object bytes.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;
use std::time::{Duration, Instant};

use nvstore::cluster_cmd::{render_status, LocalCluster, LocalOptions};
use nvstore::monitor::StatusReport;
use nvstore::Client;
use rand::{RngCore, SeedableRng};

/// How long a test waits for a map change or recovery before failing.
pub const WAIT: Duration = Duration::from_secs(60);

pub struct Harness {
    pub lc: LocalCluster,
    pub client: Client,
    pub _dir: tempfile::TempDir,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_store_metrics(&self.lc);
            print_log_tails(self._dir.path());
        }
        let _ = self.lc.down();
        if std::thread::panicking() && std::env::var_os("NVSTORE_TEST_KEEP").is_some() {
            let dir = self._dir.path().to_path_buf();
            // Replace the guard with one that no longer owns the directory.
            let _ = std::mem::replace(&mut self._dir, tempfile::tempdir().unwrap()).keep();
            eprintln!(
                "NVSTORE_TEST_KEEP: the cluster's directory is kept: {}",
                dir.display()
            );
        }
    }
}

/// A failed test's evidence, taken before the cluster goes down: each running node's store,
/// space and recovery counters from its metrics page.
fn print_store_metrics(lc: &LocalCluster) {
    for n in 1..=64 {
        if !lc.dir.join(format!("node.{n}")).is_dir() {
            break;
        }
        let Ok(Some(addr)) = lc.metrics_addr(&format!("node.{n}")) else {
            continue;
        };
        let Ok(page) = metrics_page(addr) else {
            eprintln!("---- node.{n} metrics: not served");
            continue;
        };
        // `nvstore_store_live_bytes{node="1",device="…"} 123` → `store_live_bytes=123`.
        let rows: Vec<String> = page
            .lines()
            .filter(|l| l.starts_with("nvstore_store_") || l.starts_with("nvstore_recovery_"))
            .filter(|l| !l.ends_with(" 0"))
            .filter_map(|l| {
                let (name, value) = l.rsplit_once(' ')?;
                let name = name.split('{').next()?.trim_start_matches("nvstore_");
                Some(format!("{name}={value}"))
            })
            .collect();
        eprintln!("---- node.{n} metrics: {}", rows.join(" "));
    }
}

/// The whole HTTP response (head and body) to `GET /metrics` at `addr`.
pub fn metrics_page(addr: std::net::SocketAddr) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")?;
    let mut page = String::new();
    s.read_to_string(&mut page)?;
    Ok(page)
}

/// A failed test's evidence, also taken before the cluster goes down (whose connection
/// noise would fill the tails): the end of every member's log (`DIR/*.log`, their stderr),
/// so a CI failure shows what the monitors and nodes saw. `NVSTORE_TEST_KEEP=1` keeps the
/// whole directory instead of removing it.
fn print_log_tails(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut logs: Vec<_> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    for p in logs {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(15)..];
        eprintln!(
            "---- {} (last {} of {} lines)",
            p.display(),
            tail.len(),
            lines.len()
        );
        for l in tail {
            eprintln!("{l}");
        }
    }
}

/// Create a local cluster as `o` says in a fresh temporary directory named `prefix…`, start
/// it, and connect a client (a failed start stops whatever did start, then panics).
pub fn cluster(prefix: &str, o: &LocalOptions) -> Harness {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let lc = LocalCluster::new(dir.path(), Path::new(env!("CARGO_BIN_EXE_nvstore")));
    lc.create(o).unwrap();
    let client = match lc.up() {
        Ok(c) => c,
        Err(e) => {
            let _ = lc.down();
            panic!("cluster up: {e}");
        }
    };
    Harness {
        lc,
        client,
        _dir: dir,
    }
}

/// `len` bytes from a seeded generator: the same seed gives the same bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand_chacha::ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

struct Nothing;
impl messenger::Dispatcher for Nothing {
    fn handle(&self, _m: messenger::Incoming) {}
}

impl Harness {
    /// A messenger speaking as `me` with the cluster's key, for raw requests straight to
    /// nodes (bypassing the client's checks, or impersonating a node); it handles nothing
    /// sent to it.
    pub fn raw_messenger(&self, me: messenger::Identity) -> messenger::Messenger {
        let secret = messenger::Secret::load(&self.lc.dir.join("cluster.key")).unwrap();
        messenger::Messenger::new(
            messenger::Config::default(),
            me,
            secret,
            std::sync::Arc::new(Nothing),
        )
        .unwrap()
    }
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Wait until `f` succeeds; a timeout names the last error it returned.
pub fn wait_ok<T, E: std::fmt::Display>(what: &str, mut f: impl FnMut() -> Result<T, E>) -> T {
    let t = Instant::now();
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) => assert!(
                t.elapsed() < WAIT,
                "timed out waiting for {what}; the last error: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Wait until the client's map shows node `id` up (or down).
pub fn wait_up(c: &Client, id: u32, up: bool) {
    wait_until(&format!("node {id} up={up}"), || {
        let _ = c.refresh_map();
        c.map().nodes.get(&id).is_some_and(|n| n.up == up)
    });
}

/// Wait until every up node has reported no recovery left for a few polls in a row and
/// `done(report)` holds; returns the last report.
pub fn wait_recovered(c: &Client, done: impl Fn(&StatusReport) -> bool) -> StatusReport {
    let t = Instant::now();
    let mut quiet = 0;
    loop {
        let s = c.status().unwrap();
        if !s.recovery.active() && done(&s) {
            quiet += 1;
            if quiet >= 4 {
                return s;
            }
        } else {
            quiet = 0;
        }
        assert!(
            t.elapsed() < WAIT,
            "recovery did not finish: {:?}\n{}",
            s.recovery,
            render_status(&s)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Every object reads back byte-exact.
pub fn read_all(c: &Client, pool: u64, objects: &[(String, Vec<u8>)]) {
    for (name, data) in objects {
        let got = c
            .get(pool, name.as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == *data, "{name}: {} bytes read back wrong", data.len());
    }
}

impl Harness {
    /// SIGKILL these nodes and wait until the map shows them down.
    pub fn kill_nodes(&self, ids: &[u32]) {
        for id in ids {
            self.lc.stop_member(&format!("node.{id}"), true).unwrap();
        }
        for id in ids {
            wait_up(&self.client, *id, false);
        }
    }
}

/// Object sizes that cover empty, sub-stripe, multi-stripe and unaligned objects.
pub fn size_of(i: usize) -> usize {
    [0, 1, 5000, 40_000, 100_003, 300_000][i % 6]
}

/// Put objects `{prefix}-0` … `{prefix}-{n-1}` (bytes seeded `seed + i`, sizes
/// [`size_of`]) into `pool`; returns them as (name, bytes).
pub fn put_objects(
    c: &Client,
    pool: u64,
    prefix: &str,
    seed: u64,
    n: usize,
) -> Vec<(String, Vec<u8>)> {
    let objects: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| (format!("{prefix}-{i}"), bytes(seed + i as u64, size_of(i))))
        .collect();
    for (name, d) in &objects {
        c.put(pool, name.as_bytes(), d)
            .unwrap_or_else(|e| panic!("put {name}: {e}"));
    }
    objects
}

impl Harness {
    /// Send a client append of `entry;` straight to the PG's primary in the client's
    /// current map, as `m` (a [`Harness::raw_messenger`]), with request id `reqid`: (the
    /// primary, the version its reply names).
    pub fn raw_append(
        &self,
        m: &messenger::Messenger,
        pool: u64,
        name: &[u8],
        reqid: u64,
    ) -> (u32, u64) {
        use nvstore::ops::{ClientOp, SubOp};
        use nvstore::placement::{pg_of, Acting};
        use nvstore::wire;
        let _ = self.client.refresh_map();
        let map = self.client.map();
        let p = &map.pools[&pool];
        let primary = Acting::compute(&map, p, pg_of(p, name)).primary.unwrap();
        let conn = m
            .connect(map.nodes[&primary].addr, messenger::Identity::Node(primary))
            .unwrap();
        let op = ClientOp {
            epoch: map.epoch,
            pool,
            name,
            flags: 0,
            upload_id: 0,
            reqid,
            ops: vec![SubOp::Append(b"entry;")],
        }
        .encode();
        let r = conn
            .request(
                messenger::OutMessage::new(wire::MSG_CLIENT_OP, op),
                Duration::from_secs(30),
            )
            .unwrap();
        let (_, body) = wire::parse_reply_epoch(&r.payload);
        let version = nvstore::ops::decode_results(body.unwrap()).unwrap().0;
        (primary, version)
    }
}

/// Counter `group.name` of node `id`'s `perf dump`.
pub fn counter(c: &Client, id: u32, group: &str, name: &str) -> u64 {
    c.perf_dump(id).unwrap()[group][name]
        .as_u64()
        .unwrap_or_else(|| panic!("node {id} has no counter {group}.{name}"))
}

/// Live bytes of node `id`'s stores (`perf dump`'s `store.by_device.*.live_bytes`), summed.
pub fn live_bytes(c: &Client, id: u32) -> u64 {
    store_sum(c, id, "live_bytes")
}

/// Gauge `store.by_device.*.name` of node `id`'s `perf dump`, summed over its devices.
pub fn store_sum(c: &Client, id: u32, name: &str) -> u64 {
    c.perf_dump(id).unwrap()["store"]["by_device"]
        .as_object()
        .expect("store.by_device")
        .values()
        .map(|v| v[name].as_u64().unwrap_or_else(|| panic!("store.{name}")))
        .sum()
}
