//! Admin requests a client sends straight to one node (message types 50..=59): perf dump,
//! perf reset, slow ops, runtime config; and the `nvstore perf` / `slow-ops` / `config`
//! commands.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use messenger::OutMessage;

use crate::error::{Error, Result};
use crate::wire::{self, Enc, Status};
use crate::Client;

/// How long an admin request may take (a dump walks every counter; it is quick).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

impl Client {
    /// One admin request to `node`; its JSON reply.
    fn admin(&self, node: u32, msg_type: u16) -> Result<serde_json::Value> {
        self.admin_with(node, msg_type, |_| {})
    }

    /// One admin request to `node` whose body `fill` extends after the epoch.
    fn admin_with(
        &self,
        node: u32,
        msg_type: u16,
        fill: impl FnOnce(&mut Enc),
    ) -> Result<serde_json::Value> {
        let map = self.map();
        let n = map.nodes.get(&node).ok_or_else(|| {
            let ids: Vec<u32> = map.nodes.keys().copied().collect();
            Error::remote(
                Status::Invalid,
                format!(
                    "no node {node} in the map at epoch {} (nodes: {ids:?})",
                    map.epoch
                ),
            )
        })?;
        if !n.up {
            return Err(Error::remote(
                Status::Unavailable,
                format!("node {node} is down (map epoch {})", map.epoch),
            ));
        }
        let c = self.node_conn(node, n.addr)?;
        let mut e = Enc::new(map.epoch);
        fill(&mut e);
        let reply = c.request(OutMessage::new(msg_type, e.finish()), ADMIN_TIMEOUT)?;
        let (_, body) = wire::parse_reply(&reply.payload)?;
        serde_json::from_slice(body).map_err(|e| Error::Malformed(format!("admin reply: {e}")))
    }

    /// A node's counters since its last reset (`perf dump`; JSON shape in
    /// docs/operations.md).
    pub fn perf_dump(&self, node: u32) -> Result<serde_json::Value> {
        self.admin(node, wire::MSG_ADMIN_PERF_DUMP)
    }

    /// Zero a node's counters (gauges stay).
    pub fn perf_reset(&self, node: u32) -> Result<serde_json::Value> {
        self.admin(node, wire::MSG_ADMIN_PERF_RESET)
    }

    /// A node's slow ops: in flight over the threshold, and the recent history.
    pub fn slow_ops(&self, node: u32) -> Result<serde_json::Value> {
        self.admin(node, wire::MSG_ADMIN_SLOW_OPS)
    }

    /// A node's runtime settings, after setting `key` to `value` when given (the node
    /// answers `Invalid` naming what it expected; nothing is written to its config file).
    pub fn config(&self, node: u32, set: Option<(&str, &str)>) -> Result<serde_json::Value> {
        let (k, v) = set.unwrap_or(("", ""));
        self.admin_with(node, wire::MSG_ADMIN_CONFIG, |e| {
            e.bytes(k.as_bytes()).bytes(v.as_bytes());
        })
    }
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print a node's runtime settings as JSON
    Get(NodeArg),
    /// Change one runtime setting until the node restarts: read_coalescing (true|false),
    /// read_cache (true|false; false also empties it), slow_op_ms (milliseconds),
    /// inject_write_delay_ms (fault injection: hold each client write led here this long
    /// before its shards are sent; 0 = off), inject_shard_apply_delay_ms (fault injection:
    /// hold each shard write a primary sends here this long between its check and its
    /// apply; 0 = off), inject_drop_staged (fault injection: acknowledge the shards clients
    /// stage here and drop them, true|false), staged_bytes_max (bytes of staged shards one
    /// client may hold here; past it a stage is refused and its write fails at once)
    Set {
        /// Node id
        node: u32,
        key: String,
        value: String,
        #[command(flatten)]
        conf: crate::cluster_cmd::ConfArg,
    },
}

pub fn run_config(cmd: ConfigCommand) -> Result<ExitCode> {
    match cmd {
        ConfigCommand::Get(a) => print(&Client::from_config(&a.conf.conf)?.config(a.node, None)?),
        ConfigCommand::Set {
            node,
            key,
            value,
            conf,
        } => print(&Client::from_config(&conf.conf)?.config(node, Some((&key, &value)))?),
    }
}

#[derive(Debug, Subcommand)]
pub enum PerfCommand {
    /// Print a node's counters as JSON
    Dump(NodeArg),
    /// Zero a node's counters (gauges keep their values)
    Reset(NodeArg),
}

#[derive(Debug, Args)]
pub struct NodeArg {
    /// Node id
    pub node: u32,
    #[command(flatten)]
    pub conf: crate::cluster_cmd::ConfArg,
}

fn print(v: &serde_json::Value) -> Result<ExitCode> {
    let text =
        serde_json::to_string_pretty(v).map_err(|e| Error::Malformed(format!("JSON: {e}")))?;
    println!("{text}");
    Ok(ExitCode::SUCCESS)
}

pub fn run_perf(cmd: PerfCommand) -> Result<ExitCode> {
    match cmd {
        PerfCommand::Dump(a) => print(&Client::from_config(&a.conf.conf)?.perf_dump(a.node)?),
        PerfCommand::Reset(a) => print(&Client::from_config(&a.conf.conf)?.perf_reset(a.node)?),
    }
}

pub fn run_slow_ops(a: NodeArg) -> Result<ExitCode> {
    print(&Client::from_config(&a.conf.conf)?.slow_ops(a.node)?)
}
