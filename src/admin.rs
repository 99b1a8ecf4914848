//! Admin requests a client sends straight to one node (message types 50..=59): perf dump,
//! perf reset, slow ops; and the `nvstore perf` / `nvstore slow-ops` commands.

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
        let reply = c.request(
            OutMessage::new(msg_type, Enc::new(map.epoch).finish()),
            ADMIN_TIMEOUT,
        )?;
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
