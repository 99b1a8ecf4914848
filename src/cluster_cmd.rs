//! A local cluster on loopback (`nvstore cluster up/down`), and the client commands
//! (`status`, `pool create`, `put`, `get`, `stat`, `rm`, `ls`).
//!
//! `cluster up --dir DIR` lays out:
//! ```text
//! DIR/cluster.key            the cluster secret (mode 0600)
//! DIR/client.toml            what clients need (monitors, key)
//! DIR/mon.N/monitor.toml     monitor N's config; its raft files next to it
//! DIR/node.N/node.toml       node N's config; its device file dev0.img next to it
//! DIR/pids                   "mon.N PID" / "node.N PID" of the processes started
//! DIR/*.log                  each process's stderr
//! ```
//! Running `up` again on the same directory restarts the recorded processes with their data.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use messenger::Secret;

use crate::config::{write_toml, ClientConfig, MonitorConfig, NodeConfig};
use crate::error::{Error, Result};
use crate::netns::Fabric;
use crate::Client;

/// The monitors' port on a network-namespace fabric.
const MON_PORT: u16 = 6789;

/// How long `up` waits for every node to be up in the map.
const UP_WAIT: Duration = Duration::from_secs(90);

/// Options of a local cluster.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    pub nodes: u32,
    pub monitors: u32,
    pub device_bytes: u64,
    pub down_grace_ms: u64,
    pub out_grace_ms: u64,
    pub heartbeat_ms: u64,
    pub write_wait_ms: u64,
    pub op_threads: usize,
    /// Nodes' `slow_op_ms`.
    pub slow_op_ms: u64,
    /// Nodes' `read_coalescing` switch.
    pub read_coalescing: bool,
    /// Nodes' `read_cache_bytes`.
    pub read_cache_bytes: u64,
    /// Nodes' `tombstone_keep_s`.
    pub tombstone_keep_s: u64,
    /// Every member in a network namespace of its own on one bridge (`netns.rs`; root and
    /// iproute2), so a member's network can be cut without stopping it. Off: loopback.
    pub netns: bool,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions {
            nodes: 8,
            monitors: 1,
            device_bytes: 2 << 30,
            down_grace_ms: 4000,
            out_grace_ms: 600_000,
            heartbeat_ms: 500,
            write_wait_ms: 10_000,
            op_threads: 8,
            slow_op_ms: 5000,
            read_coalescing: true,
            read_cache_bytes: crate::node::local::READ_CACHE_BYTES_DEFAULT,
            tombstone_keep_s: crate::config::default_tombstone_keep_s(),
            netns: false,
        }
    }
}

/// A cluster of monitor and node processes on this machine.
pub struct LocalCluster {
    pub dir: PathBuf,
    pub exe: PathBuf,
    /// Start processes in their own process group, so a terminal's Ctrl-C to a later command
    /// does not reach them (`cluster up`). Off for the demo and tests: an interrupted run takes
    /// its cluster down with it.
    pub detach: bool,
}

/// Takes a local cluster down if the thread unwinds past it. A program that panics part way
/// (the demo, or a bench whose output pipe closed: printing then panics) must not leave its
/// node processes running — in a temporary directory removed on the way out, nothing would
/// find them to stop them.
pub struct DownOnUnwind<'a>(pub &'a LocalCluster);

impl Drop for DownOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.0.down();
        }
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("bind a free port", e))?;
    Ok(l.local_addr()
        .map_err(|e| Error::io("local addr", e))?
        .port())
}

fn random_uuid() -> String {
    let b: [u8; 16] = rand::random();
    store::Uuid(&b).to_string()
}

impl LocalCluster {
    pub fn new(dir: &Path, exe: &Path) -> LocalCluster {
        LocalCluster {
            dir: dir.to_owned(),
            exe: exe.to_owned(),
            detach: false,
        }
    }

    pub fn client_config(&self) -> PathBuf {
        self.dir.join("client.toml")
    }

    /// Write configs for a new cluster (nothing is started). Warns when the file system holding
    /// `dir` has less free space than the device files can grow to.
    pub fn create(&self, o: &LocalOptions) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| Error::io(format!("{}", self.dir.display()), e))?;
        let devices = u64::from(o.nodes) * o.device_bytes;
        if let Some(free) = free_bytes(&self.dir).filter(|&f| f < devices) {
            // The device files are sparse, so this is not an error yet; but a node whose file
            // cannot grow fails its store's writes (ENOSPC) and stops accepting writes.
            eprintln!(
                "warning: {} has {} MiB free, less than the {} MiB the {} device files can grow \
                 to; a node whose device file cannot grow stops accepting writes",
                self.dir.display(),
                free >> 20,
                devices >> 20,
                o.nodes
            );
        }
        let key = self.dir.join("cluster.key");
        Secret::generate().save(&key)?;
        let fsid = random_uuid();
        let names: Vec<String> = (1..=o.monitors)
            .map(|id| format!("mon.{id}"))
            .chain((1..=o.nodes).map(|id| format!("node.{id}")))
            .collect();
        let fabric = if o.netns {
            Some(Fabric::create(&self.dir, &names)?)
        } else {
            None
        };
        // A member's address: its own on the fabric, else loopback. Port 0 where the member
        // records the port it got (no race for free ports).
        let addr = |member: &str, port: u16| -> Result<SocketAddr> {
            Ok(match &fabric {
                Some(f) => SocketAddr::from((f.addr(member)?, port)),
                None => SocketAddr::from(([127, 0, 0, 1], port)),
            })
        };
        let mons: Vec<SocketAddr> = (1..=o.monitors)
            .map(|id| match &fabric {
                // Alone at its address: any fixed port is free.
                Some(_) => addr(&format!("mon.{id}"), MON_PORT),
                None => addr("", free_port()?),
            })
            .collect::<Result<_>>()?;
        for id in 1..=o.monitors {
            let d = self.dir.join(format!("mon.{id}"));
            std::fs::create_dir_all(&d).map_err(|e| Error::io("mkdir", e))?;
            write_toml(
                &d.join("monitor.toml"),
                &MonitorConfig {
                    id,
                    monitors: mons.clone(),
                    fsid: fsid.clone(),
                    key_file: key.clone(),
                    data_dir: d.clone(),
                    down_grace_ms: o.down_grace_ms,
                    out_grace_ms: o.out_grace_ms,
                    metrics_listen: Some(addr(&format!("mon.{id}"), 0)?),
                },
            )?;
        }
        for id in 1..=o.nodes {
            let d = self.dir.join(format!("node.{id}"));
            std::fs::create_dir_all(&d).map_err(|e| Error::io("mkdir", e))?;
            write_toml(
                &d.join("node.toml"),
                &NodeConfig {
                    id,
                    host: format!("host{id}"),
                    listen: addr(&format!("node.{id}"), 0)?,
                    monitors: mons.clone(),
                    key_file: key.clone(),
                    devices: vec![d.join("dev0.img").display().to_string()],
                    data_dir: d.clone(),
                    device_size: Some(o.device_bytes),
                    weight: crate::map::WEIGHT_ONE,
                    heartbeat_ms: o.heartbeat_ms,
                    op_threads: o.op_threads,
                    write_wait_ms: o.write_wait_ms,
                    busy_poll_us: 20,
                    slow_op_ms: o.slow_op_ms,
                    metrics_listen: Some(addr(&format!("node.{id}"), 0)?),
                    scrub_bytes_per_sec: 32 << 20,
                    scrub_interval_s: 7 * 24 * 3600,
                    read_coalescing: o.read_coalescing,
                    hot_cache_bytes: crate::node::hot::CACHE_BYTES_DEFAULT,
                    read_cache_bytes: o.read_cache_bytes,
                    tombstone_keep_s: o.tombstone_keep_s,
                    inject_boot_delay_ms: 0,
                },
            )?;
        }
        write_toml(
            &self.client_config(),
            &ClientConfig {
                monitors: mons,
                key_file: key,
                op_timeout_ms: 30_000,
            },
        )
    }

    /// Where a running member ("mon.N" or "node.N") serves Prometheus metrics: the address it
    /// recorded in its data dir, else its configured one (None: metrics are off).
    pub fn metrics_addr(&self, member: &str) -> Result<Option<SocketAddr>> {
        let d = self.dir.join(member);
        let (listen, data_dir) = if member.starts_with("mon.") {
            let c = MonitorConfig::load(&d.join("monitor.toml"))?;
            (c.metrics_listen, c.data_dir)
        } else {
            let c = NodeConfig::load(&d.join("node.toml"))?;
            (c.metrics_listen, c.data_dir)
        };
        let Some(listen) = listen else {
            return Ok(None);
        };
        match std::fs::read_to_string(data_dir.join(crate::prom::ADDR_FILE)) {
            Ok(s) => s.trim().parse().map(Some).map_err(|e| {
                Error::Config(format!("{member}: bad {}: {e}", crate::prom::ADDR_FILE))
            }),
            Err(_) if listen.port() != 0 => Ok(Some(listen)),
            Err(e) => Err(Error::io(
                format!("{member}: metrics address not recorded yet"),
                e,
            )),
        }
    }

    fn members(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)
            .map_err(|e| Error::io(format!("{}", self.dir.display()), e))?
        {
            let e = e.map_err(|e| Error::io("readdir", e))?;
            let name = e.file_name().to_string_lossy().to_string();
            if e.path().is_dir() && (name.starts_with("mon.") || name.starts_with("node.")) {
                out.push(name);
            }
        }
        // Monitors first.
        out.sort_by_key(|n| {
            (
                n.starts_with("node."),
                n.split('.').nth(1).and_then(|i| i.parse::<u32>().ok()),
            )
        });
        Ok(out)
    }

    fn pids(&self) -> BTreeMap<String, i32> {
        std::fs::read_to_string(self.dir.join("pids"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let (n, p) = l.split_once(' ')?;
                Some((n.to_string(), p.trim().parse().ok()?))
            })
            .collect()
    }

    fn save_pids(&self, pids: &BTreeMap<String, i32>) -> Result<()> {
        let text: String = pids.iter().map(|(n, p)| format!("{n} {p}\n")).collect();
        std::fs::write(self.dir.join("pids"), text).map_err(|e| Error::io("write pids", e))
    }

    fn alive(pid: i32) -> bool {
        // SAFETY: kill with signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(pid, 0) } == 0;
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        });
        // A process's main thread turns zombie before its other threads have exited, and
        // its files (a device's lock) close only with the last of them: alive until then.
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
        exists && (!zombie || threads > 1)
    }

    /// Whether the process recorded for `member` ("mon.N" or "node.N") is running.
    pub fn is_running(&self, member: &str) -> bool {
        self.pids().get(member).is_some_and(|&p| Self::alive(p))
    }

    /// Start one member ("mon.N" or "node.N") unless it is running.
    pub fn start_member(&self, member: &str) -> Result<i32> {
        let mut pids = self.pids();
        if let Some(p) = pids.get(member) {
            if Self::alive(*p) {
                return Ok(*p);
            }
        }
        let (what, file) = if member.starts_with("mon.") {
            ("monitor", "monitor.toml")
        } else {
            ("node", "node.toml")
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{member}.log")))
            .map_err(|e| Error::io("open log", e))?;
        let mut cmd = match Fabric::load(&self.dir)? {
            Some(f) => {
                // `down` removed the namespaces; the configs still name their addresses.
                f.ensure(&self.members()?)?;
                f.command(member, &self.exe)
            }
            None => Command::new(&self.exe),
        };
        if self.detach {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        let child = cmd
            .args([what, "run", "--config"])
            .arg(self.dir.join(member).join(file))
            .env(
                "RUST_LOG",
                std::env::var("NVSTORE_DAEMON_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::io(format!("start {}", self.exe.display()), e))?;
        let pid = child.id() as i32;
        // The process outlives this handle: it is stopped through its recorded pid.
        std::mem::forget(child);
        pids.insert(member.to_string(), pid);
        self.save_pids(&pids)?;
        Ok(pid)
    }

    /// Stop one member: SIGTERM (or SIGKILL when `kill`), then wait for it to go.
    pub fn stop_member(&self, member: &str, kill: bool) -> Result<bool> {
        let mut pids = self.pids();
        let Some(pid) = pids.remove(member) else {
            return Ok(false);
        };
        let sig = if kill { libc::SIGKILL } else { libc::SIGTERM };
        // SAFETY: signalling a pid this cluster started and recorded.
        unsafe { libc::kill(pid, sig) };
        // Gone for good before this returns (a SIGKILL too): its devices are free for the
        // next opener.
        let gone = || {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Self::alive(pid) && Instant::now() < deadline {
                reap();
                std::thread::sleep(Duration::from_millis(20));
            }
            !Self::alive(pid)
        };
        if !gone() {
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            gone();
        }
        reap();
        self.save_pids(&pids)?;
        Ok(true)
    }

    /// Start every member; wait until all nodes are up in the map.
    pub fn up(&self) -> Result<Client> {
        for m in self.members()? {
            self.start_member(&m)?;
            if m.starts_with("mon.") {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let nodes = self
            .members()?
            .iter()
            .filter(|m| m.starts_with("node."))
            .count();
        let deadline = Instant::now() + UP_WAIT;
        let client = loop {
            match Client::from_config(&self.client_config()) {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(e) => {
                    if let Some(dead) = self.dead_member() {
                        return Err(Error::Config(format!("{dead}\n(client: {e})")));
                    }
                    std::thread::sleep(Duration::from_millis(200))
                }
            }
        };
        self.wait_nodes_up(&client, nodes, deadline)?;
        Ok(client)
    }

    /// A started process that is gone, with the end of its log.
    fn dead_member(&self) -> Option<String> {
        for (m, pid) in self.pids() {
            reap();
            if !Self::alive(pid) {
                let log =
                    std::fs::read_to_string(self.dir.join(format!("{m}.log"))).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                return Some(format!("{m} (pid {pid}) exited:\n{}", tail.join("\n")));
            }
        }
        None
    }

    pub fn wait_nodes_up(&self, client: &Client, nodes: usize, deadline: Instant) -> Result<()> {
        loop {
            if let Some(dead) = self.dead_member() {
                return Err(Error::Config(dead));
            }
            let _ = client.refresh_map();
            let m = client.map();
            let up = m.nodes.values().filter(|n| n.up && n.r#in).count();
            if up >= nodes {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "{up} of {nodes} nodes up (see {}/node.*.log)",
                        self.dir.display()
                    ),
                    secs: UP_WAIT.as_secs_f64(),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stop every recorded process (nodes first), then remove the network namespaces if the
    /// cluster has them (a later start builds them again, at the same addresses).
    pub fn down(&self) -> Result<usize> {
        let mut n = 0;
        let mut members: Vec<String> = self.pids().into_keys().collect();
        members.sort_by_key(|m| m.starts_with("mon."));
        for m in members {
            if self.stop_member(&m, false)? {
                n += 1;
            }
        }
        if let Some(f) = Fabric::load(&self.dir)? {
            f.destroy();
        }
        Ok(n)
    }

    /// Cut `member`'s network (`connected = false`: nothing reaches it, its process runs on)
    /// or restore it. Only for a cluster created with `netns`.
    pub fn set_connected(&self, member: &str, connected: bool) -> Result<()> {
        self.fabric()?.set_connected(member, connected)
    }

    /// Cut (`connected` false) or restore the path between members `a` and `b` only
    /// ([`Fabric::set_link`]); both keep their paths to everyone else.
    pub fn set_link(&self, a: &str, b: &str, connected: bool) -> Result<()> {
        self.fabric()?.set_link(a, b, connected)
    }

    fn fabric(&self) -> Result<Fabric> {
        Fabric::load(&self.dir)?.ok_or_else(|| {
            Error::Config(format!(
                "{}: this cluster runs on loopback; only one made with network namespaces \
                 (`cluster up --netns`) can have a member's network cut",
                self.dir.display()
            ))
        })
    }
}

/// Collect exited children (this process started them).
fn reap() {
    loop {
        // SAFETY: non-blocking wait for any child; no memory is passed.
        let r = unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) };
        if r <= 0 {
            break;
        }
    }
}

// ---- CLI ------------------------------------------------------------------------------------

use clap::{Args, Subcommand};

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Start a monitor and N node processes on loopback with file devices
    Up {
        #[arg(long, default_value_t = 8)]
        nodes: u32,
        #[arg(long, default_value_t = 1)]
        monitors: u32,
        #[arg(long)]
        dir: PathBuf,
        /// Size of each node's device file (sparse)
        #[arg(long, default_value = "2G", value_parser = crate::storecli::parse_size)]
        device_size: u64,
        /// Create a pool of this name (k = min(6, nodes - 2), m = 2); "" for none
        #[arg(long, default_value = "data")]
        pool: String,
        /// Put each monitor and node in a network namespace of its own, on one bridge (needs
        /// root and iproute2), so `cluster cut` can partition one; a new cluster only
        #[arg(long)]
        netns: bool,
    },
    /// Stop the processes `up` started (by their recorded ids)
    Down {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Stop one node or monitor (`node.3`, `mon.1`); --kill sends SIGKILL
    Stop {
        #[arg(long)]
        dir: PathBuf,
        member: String,
        #[arg(long)]
        kill: bool,
    },
    /// Start one stopped node or monitor
    Start {
        #[arg(long)]
        dir: PathBuf,
        member: String,
    },
    /// Cut one member's network (a cluster made with `up --netns`): it keeps running, and
    /// nothing reaches it or leaves it until `heal`; with `--from`, only its paths to those
    /// members (an asymmetric partition: it still reaches everyone else)
    Cut {
        #[arg(long)]
        dir: PathBuf,
        member: String,
        /// Members (comma-separated, e.g. node.1,node.2) to cut it off from, instead of all
        #[arg(long, value_delimiter = ',')]
        from: Vec<String>,
    },
    /// Restore a member's network cut by `cut` (with `--from`: the paths `cut --from` cut)
    Heal {
        #[arg(long)]
        dir: PathBuf,
        member: String,
        #[arg(long, value_delimiter = ',')]
        from: Vec<String>,
    },
}

#[derive(Debug, Args)]
pub struct ConfArg {
    /// Client config (written by `cluster up`); default $NVSTORE_CONF
    #[arg(short = 'c', long = "conf", env = "NVSTORE_CONF")]
    pub conf: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum PoolCommand {
    /// Create an erasure-coded pool
    Create {
        name: String,
        #[arg(long, default_value_t = 6)]
        k: u32,
        #[arg(long, default_value_t = 2)]
        m: u32,
        #[arg(long, default_value_t = crate::map::PG_NUM_DEFAULT)]
        pg_num: u32,
        #[arg(long, default_value = "64K", value_parser = crate::storecli::parse_size)]
        stripe_unit: u64,
        /// Shards durable before a write is acknowledged (default k + 1)
        #[arg(long)]
        min_size: Option<u32>,
        #[command(flatten)]
        conf: ConfArg,
    },
    /// Delete a pool and every object in it, for good (the nodes reclaim its space in the
    /// background)
    Delete {
        name: String,
        /// Required: the pool's objects cannot be brought back
        #[arg(long)]
        yes_i_really_mean_it: bool,
        #[command(flatten)]
        conf: ConfArg,
    },
    /// List pools
    Ls {
        #[command(flatten)]
        conf: ConfArg,
    },
}

type CliResult = std::result::Result<ExitCode, Box<dyn std::error::Error>>;

pub fn run_cluster(cmd: ClusterCommand) -> CliResult {
    let exe = std::env::current_exe()?;
    match cmd {
        ClusterCommand::Up {
            nodes,
            monitors,
            dir,
            device_size,
            pool,
            netns,
        } => {
            let mut lc = LocalCluster::new(&dir, &exe);
            lc.detach = true;
            let fresh = !dir.join("cluster.key").exists();
            if fresh {
                lc.create(&LocalOptions {
                    nodes,
                    monitors,
                    device_bytes: device_size,
                    netns,
                    ..LocalOptions::default()
                })?;
            } else if netns && Fabric::load(&dir)?.is_none() {
                return Err(format!(
                    "{} holds a cluster made on loopback; --netns applies to a new cluster",
                    dir.display()
                )
                .into());
            }
            let client = lc.up()?;
            if fresh && !pool.is_empty() {
                let k = nodes.saturating_sub(2).clamp(1, 6);
                client.create_pool(
                    &pool,
                    k,
                    2.min(nodes.saturating_sub(k)).max(1),
                    64 << 10,
                    crate::map::PG_NUM_DEFAULT,
                    None,
                )?;
                println!(
                    "created pool {pool:?} (EC {k}+{})",
                    2.min(nodes.saturating_sub(k)).max(1)
                );
            }
            let m = client.map();
            println!(
                "cluster {} up: {} monitor(s), {} node(s), epoch {}",
                m.fsid,
                monitors,
                m.nodes.len(),
                m.epoch
            );
            println!("export NVSTORE_CONF={}", lc.client_config().display());
            Ok(ExitCode::SUCCESS)
        }
        ClusterCommand::Down { dir } => {
            let lc = LocalCluster::new(&dir, &exe);
            if lc.members()?.is_empty() {
                return Err(format!(
                    "{} holds no cluster made by `nvstore cluster up` (no mon.N or node.N \
                     directory in it)",
                    dir.display()
                )
                .into());
            }
            let n = lc.down()?;
            println!("stopped {n} process(es); data kept in {}", dir.display());
            Ok(ExitCode::SUCCESS)
        }
        ClusterCommand::Stop { dir, member, kill } => {
            if !LocalCluster::new(&dir, &exe).stop_member(&member, kill)? {
                return Err(format!("{member} is not running (no recorded pid)").into());
            }
            Ok(ExitCode::SUCCESS)
        }
        ClusterCommand::Start { dir, member } => {
            let mut lc = LocalCluster::new(&dir, &exe);
            lc.detach = true;
            let pid = lc.start_member(&member)?;
            println!("{member} pid {pid}");
            Ok(ExitCode::SUCCESS)
        }
        ClusterCommand::Cut { dir, member, from } => {
            cut_or_heal(&LocalCluster::new(&dir, &exe), &member, &from, false)
        }
        ClusterCommand::Heal { dir, member, from } => {
            cut_or_heal(&LocalCluster::new(&dir, &exe), &member, &from, true)
        }
    }
}

/// `cluster cut|heal`: the member's whole network, or with `from` only its paths to those
/// members.
fn cut_or_heal(lc: &LocalCluster, member: &str, from: &[String], connected: bool) -> CliResult {
    if from.is_empty() {
        lc.set_connected(member, connected)?;
        match connected {
            false => {
                println!("{member}: network cut (its process runs on; `cluster heal` restores it)")
            }
            true => println!("{member}: network restored"),
        }
    }
    for other in from {
        lc.set_link(member, other, connected)?;
        match connected {
            false => println!("{member} <-> {other}: path cut (both reach everyone else)"),
            true => println!("{member} <-> {other}: path restored"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn run_pool(cmd: PoolCommand) -> CliResult {
    match cmd {
        PoolCommand::Create {
            name,
            k,
            m,
            pg_num,
            stripe_unit,
            min_size,
            conf,
        } => {
            let c = Client::from_config(&conf.conf)?;
            let id = c.create_pool(&name, k, m, stripe_unit as u32, pg_num, min_size)?;
            println!("pool {name:?} created: id {id}, EC {k}+{m}, {pg_num} pgs");
        }
        PoolCommand::Delete {
            name,
            yes_i_really_mean_it,
            conf,
        } => {
            if !yes_i_really_mean_it {
                return Err(format!(
                    "deleting pool {name:?} removes every object in it for good; \
                     pass --yes-i-really-mean-it to go ahead"
                )
                .into());
            }
            let c = Client::from_config(&conf.conf)?;
            c.delete_pool(&name)?;
            println!(
                "pool {name:?} deleted at map epoch {}; the nodes are removing its objects",
                c.map().epoch
            );
        }
        PoolCommand::Ls { conf } => {
            let c = Client::from_config(&conf.conf)?;
            for p in c.map().pools.values() {
                println!(
                    "{}\t{}\tEC {}+{}\tunit {} KiB\t{} pgs\tmin_size {}",
                    p.id,
                    p.name,
                    p.k,
                    p.m,
                    p.stripe_unit >> 10,
                    p.pg_num,
                    p.min_size
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn human(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

/// "N s ago" for a unix time, "never" for 0.
pub fn ago(unix: u64) -> String {
    if unix == 0 {
        return "never".into();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{} s ago", now.saturating_sub(unix))
}

/// `nvstore status` as text.
pub fn render_status(s: &crate::monitor::StatusReport) -> String {
    let mut o = String::new();
    let mons: Vec<String> = s
        .monitors
        .iter()
        .map(|(id, a, r)| format!("mon.{id} {a} ({r})"))
        .collect();
    o += &format!(
        "  cluster:\n    id:     {}\n    health: {}\n",
        s.fsid, s.health
    );
    for d in &s.health_detail {
        o += &format!("            {d}\n");
    }
    o += &format!(
        "\n  services:\n    mon:  {} daemon(s): {}\n    node: {} nodes: {} up, {} in\n",
        s.monitors.len(),
        mons.join(", "),
        s.nodes_total,
        s.nodes_up,
        s.nodes_in
    );
    o += &format!(
        "\n  data:\n    map:    epoch {}\n    pools:  {} pools, {} pgs\n    shards: {}\n    usage:  {} used of {}\n",
        s.epoch,
        s.pools.len(),
        s.pg_total,
        s.shards,
        human(s.used_bytes as f64),
        human(s.capacity_bytes as f64)
    );
    o += "    pgs:    ";
    let states: Vec<String> = s
        .pg_states
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect();
    o += &(if states.is_empty() {
        "none".to_string()
    } else {
        states.join(", ")
    });
    o += "\n";
    o += &render_deleting(s);
    let sc = &s.scrub;
    o += &format!(
        "    scrub:  {} objects, {} read; {} crc errors, {} missing/stale, {} parity; {} \
         repaired, {} unrepairable; reads met {} corrupt shards, repaired {}; last complete \
         pass on every node: {}\n",
        sc.objects,
        human(sc.bytes as f64),
        sc.crc_errors,
        sc.missing,
        sc.parity_errors,
        sc.repaired,
        sc.unrepairable,
        sc.read_corrupt,
        sc.read_repaired,
        if sc.passes == 0 {
            "never".into()
        } else {
            ago(sc.last_complete_unix)
        }
    );
    o += &format!(
        "\n  io:\n    client: {}/s rd, {}/s wr, {:.0} op/s rd, {:.0} op/s wr\n",
        human(s.io.read_bytes_s),
        human(s.io.write_bytes_s),
        s.io.read_ops_s,
        s.io.write_ops_s
    );
    if !s.hot_objects.is_empty() {
        o += "\n  hot objects:\n";
        for h in &s.hot_objects {
            let pool = s
                .pools
                .iter()
                .find(|p| p.id == h.pool)
                .map_or_else(|| h.pool.to_string(), |p| p.name.clone());
            o += &format!(
                "    {pool}/{}: {:.0} op/s from {} client(s), coalesced {:.0} % (primary node {})\n",
                h.name, h.ops_s, h.clients, h.coalesced_pct, h.node
            );
        }
    }
    o += &render_recovery(&s.recovery);
    o
}

/// The status report's line on pool deletions whose keys nodes are still removing (nothing
/// when none is).
fn render_deleting(s: &crate::monitor::StatusReport) -> String {
    let mut pools: Vec<u64> = Vec::new();
    let mut nodes = 0;
    for st in s
        .node_stats
        .values()
        .filter(|st| !st.deleting_pools.is_empty())
    {
        nodes += 1;
        pools.extend(&st.deleting_pools);
    }
    if nodes == 0 {
        return String::new();
    }
    pools.sort_unstable();
    pools.dedup();
    let removed: u64 = s.node_stats.values().map(|st| st.deleted_pool_keys).sum();
    let ids: Vec<String> = pools.iter().map(|p| p.to_string()).collect();
    format!(
        "    delete: pool id(s) {} still being removed from {nodes} node(s); {removed} keys of \
         deleted pools removed since the nodes started\n",
        ids.join(", ")
    )
}

/// The status report's recovery line (nothing when recovery never ran).
fn render_recovery(r: &crate::node::recovery::RecoveryStats) -> String {
    let done = format!(
        "{} object(s), {} rebuilt (delta {}, backfill {})",
        r.objects_done,
        human(r.bytes_done as f64),
        r.delta_objects,
        r.backfill_objects
    );
    if r.active() {
        let eta = r
            .eta_s()
            .map_or("unknown".to_string(), |s| format!("{s:.0} s"));
        format!(
            "    recovery: {} object(s), {} left, {} pg(s) pending, {}/s, ETA {eta}; done: {done}\n",
            r.objects_left,
            human(r.bytes_left as f64),
            r.pgs_pending,
            human(r.rate_bytes_s),
        )
    } else if r.objects_done > 0 || r.failures > 0 {
        format!("    recovery: idle; done: {done}\n")
    } else {
        String::new()
    }
}

pub fn run_status(conf: &Path, json: bool) -> CliResult {
    let c = Client::from_config(conf)?;
    let s = c.status()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", render_status(&s));
    }
    Ok(if s.health == "HEALTH_ERR" {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `nvstore node out ID` / `node in ID`.
pub fn run_mark(conf: &Path, id: u32, r#in: bool) -> CliResult {
    let c = Client::from_config(conf)?;
    if !c.map().nodes.contains_key(&id) {
        return Err(format!("no node {id} in the map (epoch {})", c.map().epoch).into());
    }
    let cmd = if r#in {
        crate::monitor::raft::MonCommand::MarkIn(id)
    } else {
        crate::monitor::raft::MonCommand::MarkOut(vec![id])
    };
    let r = c.command(&cmd)?;
    if !r.ok {
        return Err(format!("monitor refused: {}", r.message).into());
    }
    println!(
        "node {id} marked {} at epoch {}",
        if r#in { "in" } else { "out" },
        r.epoch
    );
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct ObjArgs {
    pub pool: String,
    pub name: String,
    /// File to read from (put) or write to (get); stdin/stdout when absent
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub conf: ConfArg,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    pub pool: String,
    #[command(flatten)]
    pub conf: ConfArg,
}

pub fn run_obj(cmd: &str, a: ObjArgs) -> CliResult {
    let c = Client::from_config(&a.conf.conf)?;
    let pool = c.pool_id(&a.pool)?;
    let name = a.name.as_bytes();
    match cmd {
        "put" => {
            let data = match &a.file {
                Some(f) => std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?,
                None => {
                    let mut v = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)?;
                    v
                }
            };
            let v = c.put(pool, name, &data)?;
            eprintln!("{}/{}: {} bytes, version {v}", a.pool, a.name, data.len());
        }
        "get" => {
            let data = c.get(pool, name)?;
            match &a.file {
                Some(f) => std::fs::write(f, &data).map_err(|e| format!("{}: {e}", f.display()))?,
                None => std::io::stdout().write_all(&data)?,
            }
        }
        "stat" => {
            let s = c.stat(pool, name)?;
            println!(
                "{}/{} size {} version {} mtime_ns {}",
                a.pool, a.name, s.size, s.version, s.mtime_unix_ns
            );
        }
        _ => {
            let v = c.remove(pool, name)?;
            eprintln!("{}/{}: removed at version {v}", a.pool, a.name);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn run_ls(a: LsArgs) -> CliResult {
    let c = Client::from_config(&a.conf.conf)?;
    let pool = c.pool_id(&a.pool)?;
    for (name, s) in c.list(pool)? {
        println!(
            "{}\t{}\tv{}",
            String::from_utf8_lossy(&name),
            s.size,
            s.version
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes available to an unprivileged writer on the file system holding `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` is writable memory for one statvfs, which
    // the call fills when it returns 0.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use crate::monitor::{NodeStats, StatusReport};

    #[test]
    fn status_shows_pools_still_being_deleted_and_the_keys_removed() {
        let stats = |pools: &[u64], keys: u64| NodeStats {
            deleting_pools: pools.to_vec(),
            deleted_pool_keys: keys,
            ..NodeStats::default()
        };
        let mut s: StatusReport = serde_json::from_value(serde_json::json!({
            "fsid": "f", "health": "HEALTH_OK", "health_detail": [], "epoch": 9,
            "monitors": [], "leader": 1, "nodes_total": 3, "nodes_up": 3, "nodes_in": 3,
            "pools": [], "pg_total": 0, "pg_states": {}, "shards": 0, "used_bytes": 0,
            "capacity_bytes": 0,
            "io": {"read_ops_s": 0.0, "write_ops_s": 0.0, "read_bytes_s": 0.0, "write_bytes_s": 0.0}
        }))
        .unwrap();
        s.node_stats.insert(1, stats(&[], 100));
        s.node_stats.insert(2, stats(&[4, 2], 2_000));
        s.node_stats.insert(3, stats(&[2], 30_000));
        let out = super::render_status(&s);
        assert!(
            out.contains(
                "    delete: pool id(s) 2, 4 still being removed from 2 node(s); 32100 keys of \
                 deleted pools removed since the nodes started\n"
            ),
            "{out}"
        );
        for st in s.node_stats.values_mut() {
            st.deleting_pools.clear();
        }
        assert!(!super::render_status(&s).contains("delete:"));
    }

    #[test]
    fn free_bytes_reads_the_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let free = super::free_bytes(dir.path()).expect("statvfs of a temp dir");
        assert!(free > 0);
        assert_eq!(super::free_bytes(&dir.path().join("missing/dir")), None);
    }
}
