//! Configuration files (TOML) of monitors, nodes and clients.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

fn read_toml<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
}

pub fn write_toml<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    let text = toml::to_string(v).map_err(|e| Error::Config(e.to_string()))?;
    std::fs::write(path, text).map_err(|e| Error::io(format!("write {}", path.display()), e))
}

/// `monitor.toml`: one monitor of the cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MonitorConfig {
    /// 1-based: this monitor's position in `monitors`.
    pub id: u32,
    /// Every monitor's address, in id order (the same list in every monitor's file).
    pub monitors: Vec<SocketAddr>,
    pub fsid: String,
    pub key_file: PathBuf,
    /// Raft log, vote and snapshot live here.
    pub data_dir: PathBuf,
    /// A node that has not sent a heartbeat for this long is marked down.
    #[serde(default = "default_down_grace_ms")]
    pub down_grace_ms: u64,
    /// A node down for this long is marked out (its PGs remap).
    #[serde(default = "default_out_grace_ms")]
    pub out_grace_ms: u64,
    /// Serve Prometheus metrics (`GET /metrics`) here; off when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
}

fn default_down_grace_ms() -> u64 {
    4000
}
fn default_out_grace_ms() -> u64 {
    600_000
}

impl MonitorConfig {
    pub fn load(path: &Path) -> Result<MonitorConfig> {
        let c: MonitorConfig = read_toml(path)?;
        if c.id == 0 || c.id as usize > c.monitors.len() {
            return Err(Error::Config(format!(
                "{}: id {} is not a position in monitors (1..={})",
                path.display(),
                c.id,
                c.monitors.len()
            )));
        }
        Ok(c)
    }
    pub fn down_grace(&self) -> Duration {
        Duration::from_millis(self.down_grace_ms)
    }
    pub fn out_grace(&self) -> Duration {
        Duration::from_millis(self.out_grace_ms)
    }
}

/// `node.toml`: one storage node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeConfig {
    /// Node id; 0 or absent: take it from the devices' labels (a node's identity travels
    /// with its disks).
    #[serde(default)]
    pub id: u32,
    /// Failure domain name.
    pub host: String,
    pub listen: SocketAddr,
    pub monitors: Vec<SocketAddr>,
    pub key_file: PathBuf,
    /// Device paths (files or block devices), each labelled by `nvstore mkfs` (or created and
    /// labelled at first start when `device_size` is set).
    pub devices: Vec<String>,
    pub data_dir: PathBuf,
    /// Create missing device files with this many bytes and label them.
    #[serde(default)]
    pub device_size: Option<u64>,
    #[serde(default = "default_weight")]
    pub weight: u32,
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Threads that run client ops (each PG's ops run in order on one of them at a time).
    #[serde(default = "default_op_threads")]
    pub op_threads: usize,
    /// How long a write waits for enough shards before failing.
    #[serde(default = "default_write_wait_ms")]
    pub write_wait_ms: u64,
    /// Messenger busy-poll window after activity, in µs (0: sleep at once). Short: many
    /// node processes may share few cores.
    #[serde(default = "default_busy_poll_us")]
    pub busy_poll_us: u64,
    /// An op that takes at least this long is a slow op: kept for `nvstore slow-ops` and
    /// warned about in health. 0 records every op (debugging).
    #[serde(default = "default_slow_op_ms")]
    pub slow_op_ms: u64,
    /// Serve Prometheus metrics (`GET /metrics`) here; off when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// Background scrub read rate, shard bytes per second.
    #[serde(default = "default_scrub_bytes_per_sec")]
    pub scrub_bytes_per_sec: u64,
    /// Start a scrub pass this long after the last one completed (0: only when asked, with
    /// `nvstore scrub start`).
    #[serde(default = "default_scrub_interval_s")]
    pub scrub_interval_s: u64,
    /// Serve concurrent reads of one object with one fetch, and cache hot objects' bytes
    /// (`node/hot.rs`). Off only to measure what it buys.
    #[serde(default = "default_true")]
    pub read_coalescing: bool,
    /// Bytes of hot objects' data a node caches.
    #[serde(default = "default_hot_cache_bytes")]
    pub hot_cache_bytes: u64,
    /// Bytes of memory per device for the store's cache of small reads (`store/src/cache.rs`;
    /// 0: none).
    #[serde(default = "default_read_cache_bytes")]
    pub read_cache_bytes: u64,
    /// How long the members of a PG keep a removed object's tombstone (its shards' index
    /// entries and records) after the remove was acknowledged: a client that resends the
    /// remove within this time (its reply was lost) gets the remove's own answer. After it the
    /// members forget the object entirely (`MSG_SHARD_FORGET`). Keep it well above the
    /// clients' `op_timeout_ms`.
    #[serde(default = "default_tombstone_keep_s")]
    pub tombstone_keep_s: u64,
    /// Fault injection for tests: wait this long after the node starts serving before it
    /// registers (Boot) with the monitor, holding open the window in which it must refuse
    /// shard ops (`tests/recovery.rs`). 0, the default, in any real deployment.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inject_boot_delay_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// 5 s: far above a healthy op (milliseconds) yet clear of the stalls a busy shared test
/// machine shows; an op this slow is worth a health warning.
fn default_slow_op_ms() -> u64 {
    5000
}
fn default_scrub_bytes_per_sec() -> u64 {
    32 << 20
}
fn default_scrub_interval_s() -> u64 {
    7 * 24 * 3600
}
fn default_true() -> bool {
    true
}
fn default_hot_cache_bytes() -> u64 {
    crate::node::hot::CACHE_BYTES_DEFAULT
}
fn default_read_cache_bytes() -> u64 {
    crate::node::local::READ_CACHE_BYTES_DEFAULT
}

/// Four times the clients' default op deadline (30 s).
pub fn default_tombstone_keep_s() -> u64 {
    120
}

fn default_busy_poll_us() -> u64 {
    20
}

fn default_weight() -> u32 {
    crate::map::WEIGHT_ONE
}
fn default_heartbeat_ms() -> u64 {
    1000
}
fn default_op_threads() -> usize {
    8
}
fn default_write_wait_ms() -> u64 {
    10_000
}

impl NodeConfig {
    pub fn load(path: &Path) -> Result<NodeConfig> {
        let c: NodeConfig = read_toml(path)?;
        if c.devices.is_empty() {
            return Err(Error::Config(format!("{}: no devices", path.display())));
        }
        if c.monitors.is_empty() {
            return Err(Error::Config(format!("{}: no monitors", path.display())));
        }
        Ok(c)
    }
}

/// `client.toml`: what a client needs to reach the cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClientConfig {
    pub monitors: Vec<SocketAddr>,
    pub key_file: PathBuf,
    /// Per-op deadline, retries included.
    #[serde(default = "default_op_timeout_ms")]
    pub op_timeout_ms: u64,
}

fn default_op_timeout_ms() -> u64 {
    30_000
}

impl ClientConfig {
    pub fn load(path: &Path) -> Result<ClientConfig> {
        read_toml(path)
    }
}
