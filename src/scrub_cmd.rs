//! `nvstore scrub start|status|locate`: drive and inspect the nodes' background scrub.

use std::process::ExitCode;

use clap::Subcommand;

use crate::cluster_cmd::ConfArg;
use crate::node::scrub::{locate_request, scrub_request, ScrubState};
use crate::wire;
use crate::Client;

#[derive(Debug, Subcommand)]
pub enum ScrubCommand {
    /// Start a scrub pass now on one node, or on every up node
    Start {
        /// Node id (default: every up node)
        #[arg(long)]
        node: Option<u32>,
        #[command(flatten)]
        conf: ConfArg,
    },
    /// Each node's scrub counters, pass in progress and last complete pass
    Status {
        #[arg(long)]
        node: Option<u32>,
        /// JSON (one object per node, in an array)
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conf: ConfArg,
    },
    /// Where a node's shard of an object sits on its device (JSON)
    Locate {
        pool: String,
        name: String,
        #[arg(long)]
        shard: u8,
        #[arg(long)]
        node: u32,
        #[command(flatten)]
        conf: ConfArg,
    },
}

type CliResult = std::result::Result<ExitCode, Box<dyn std::error::Error>>;

fn targets(c: &Client, node: Option<u32>) -> Vec<u32> {
    match node {
        Some(n) => vec![n],
        None => c
            .map()
            .nodes
            .values()
            .filter(|n| n.up)
            .map(|n| n.id)
            .collect(),
    }
}

/// The scrub state of a node (`op` 0: status, 1: start a pass, then status).
pub fn scrub_call(c: &Client, node: u32, op: u8) -> crate::Result<ScrubState> {
    let body = c.node_call(node, wire::MSG_NODE_SCRUB, &scrub_request(op))?;
    serde_json::from_slice(&body)
        .map_err(|e| crate::Error::Malformed(format!("scrub reply of node {node}: {e}")))
}

pub fn run(cmd: ScrubCommand) -> CliResult {
    match cmd {
        ScrubCommand::Start { node, conf } => {
            let c = Client::from_config(&conf.conf)?;
            for n in targets(&c, node) {
                scrub_call(&c, n, 1)?;
                println!("node.{n}: scrub pass requested");
            }
        }
        ScrubCommand::Status { node, json, conf } => {
            let c = Client::from_config(&conf.conf)?;
            let states = targets(&c, node)
                .into_iter()
                .map(|n| scrub_call(&c, n, 0))
                .collect::<crate::Result<Vec<_>>>()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&states)?);
            }
            for s in states.iter().filter(|_| !json) {
                let t = &s.totals;
                let pass = match &s.cursor {
                    Some(cur) => format!("running (pool {} pg {:x})", cur.pool, cur.pg),
                    None => "idle".into(),
                };
                println!(
                    "node.{}: {pass}; {} passes, last complete {}; {} objects, {} bytes; \
                     errors: {} crc, {} missing/stale, {} parity; {} repaired, {} unrepairable; \
                     reads: {} corrupt shards met, {} repaired",
                    s.node,
                    t.passes,
                    crate::cluster_cmd::ago(t.last_complete_unix),
                    t.objects,
                    t.bytes,
                    t.crc_errors,
                    t.missing,
                    t.parity_errors,
                    t.repaired,
                    t.unrepairable,
                    t.read_corrupt,
                    t.read_repaired
                );
            }
        }
        ScrubCommand::Locate {
            pool,
            name,
            shard,
            node,
            conf,
        } => {
            let c = Client::from_config(&conf.conf)?;
            let pool = c.pool_id(&pool)?;
            let body = c.node_call(
                node,
                wire::MSG_NODE_LOCATE,
                &locate_request(pool, name.as_bytes(), shard),
            )?;
            println!("{}", String::from_utf8_lossy(&body));
        }
    }
    Ok(ExitCode::SUCCESS)
}
