//! Command-line interface: one enum of command groups, each dispatched to its module.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "nvstore",
    version,
    about = "Kernel-bypass NVMe object store",
    long_about = "nvstore: a userspace NVMe driver over VFIO feeding a log-structured object \
                  store, with objects erasure coded 6+2 across storage nodes."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// NVMe devices: list, bind to vfio-pci, unbind, identify
    Device {
        #[command(subcommand)]
        what: crate::device::DeviceCommand,
    },
    /// Label a device for a cluster and node (writes the superblock)
    Mkfs(crate::storecli::MkfsArgs),
    /// Inspect or repair a device's store offline: info, ls, stat, get, put, fsck
    StoreTool(crate::storecli::StoreToolArgs),
    /// Run a storage node: node run --config node.toml
    Node {
        #[command(subcommand)]
        cmd: NodeCommand,
    },
    /// Run a monitor: monitor run --config monitor.toml
    Monitor {
        #[command(subcommand)]
        cmd: MonitorCommand,
    },
    /// Start and stop a local cluster on loopback (up, down, stop, start)
    Cluster {
        #[command(subcommand)]
        cmd: crate::cluster_cmd::ClusterCommand,
    },
    /// Pools: create, ls, delete
    Pool {
        #[command(subcommand)]
        cmd: crate::cluster_cmd::PoolCommand,
    },
    /// Store an object: put POOL NAME [FILE]
    Put(crate::cluster_cmd::ObjArgs),
    /// Fetch an object: get POOL NAME [FILE]
    Get(crate::cluster_cmd::ObjArgs),
    /// Show an object's size and version: stat POOL NAME
    Stat(crate::cluster_cmd::ObjArgs),
    /// Remove an object: rm POOL NAME
    Rm(crate::cluster_cmd::ObjArgs),
    /// List a pool's objects: ls POOL
    Ls(crate::cluster_cmd::LsArgs),
    /// Benchmarks: devices, and the cluster (write/seq/rand, like rados bench)
    Bench {
        #[command(subcommand)]
        what: crate::bench::BenchCommand,
    },
    /// Cluster health, map, PG states, IO rates
    Status {
        /// JSON instead of text
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conf: crate::cluster_cmd::ConfArg,
    },
    /// Dump or reset a node's performance counters
    Perf {
        #[command(subcommand)]
        cmd: crate::admin::PerfCommand,
    },
    /// Dump a node's slow ops (in flight and recent history) as JSON: slow-ops NODE
    SlowOps(crate::admin::NodeArg),
    /// A running node's runtime settings: config get NODE | config set NODE KEY VALUE
    Config {
        #[command(subcommand)]
        cmd: crate::admin::ConfigCommand,
    },
    /// Start an 8-node local cluster, write, kill nodes, read degraded, heal, clean up
    Demo(crate::demo::DemoArgs),
    /// Scrub: start a pass now, show counters, locate a shard on its device
    Scrub {
        #[command(subcommand)]
        cmd: crate::scrub_cmd::ScrubCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Run the node in the foreground until killed
    Run {
        #[arg(long)]
        config: std::path::PathBuf,
    },
    /// Mark a node out: its PGs remap and recovery rebuilds its shards on the new members
    Out {
        id: u32,
        #[command(flatten)]
        conf: crate::cluster_cmd::ConfArg,
    },
    /// Mark a node in again: its PGs map back to it and recovery catches it up
    In {
        id: u32,
        #[command(flatten)]
        conf: crate::cluster_cmd::ConfArg,
    },
}

#[derive(Debug, Subcommand)]
pub enum MonitorCommand {
    /// Run the monitor in the foreground until killed
    Run {
        #[arg(long)]
        config: std::path::PathBuf,
    },
}

/// Install the tracing subscriber: `RUST_LOG` filters, warnings by default, to stderr.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

pub fn run(cli: Cli) -> Result<ExitCode, Box<dyn std::error::Error>> {
    Ok(match cli.command {
        Command::Device { what } => crate::device::run(what)?,
        Command::Mkfs(a) => crate::storecli::run_mkfs(a)?,
        Command::StoreTool(a) => crate::storecli::run_store_tool(a)?,
        Command::Node {
            cmd: NodeCommand::Run { config },
        } => {
            crate::node::run(crate::config::NodeConfig::load(&config)?)?;
            ExitCode::SUCCESS
        }
        Command::Node {
            cmd: NodeCommand::Out { id, conf },
        } => crate::cluster_cmd::run_mark(&conf.conf, id, false)?,
        Command::Node {
            cmd: NodeCommand::In { id, conf },
        } => crate::cluster_cmd::run_mark(&conf.conf, id, true)?,
        Command::Monitor {
            cmd: MonitorCommand::Run { config },
        } => {
            crate::monitor::run(crate::config::MonitorConfig::load(&config)?)?;
            ExitCode::SUCCESS
        }
        Command::Cluster { cmd } => crate::cluster_cmd::run_cluster(cmd)?,
        Command::Pool { cmd } => crate::cluster_cmd::run_pool(cmd)?,
        Command::Put(a) => crate::cluster_cmd::run_obj("put", a)?,
        Command::Get(a) => crate::cluster_cmd::run_obj("get", a)?,
        Command::Stat(a) => crate::cluster_cmd::run_obj("stat", a)?,
        Command::Rm(a) => crate::cluster_cmd::run_obj("rm", a)?,
        Command::Ls(a) => crate::cluster_cmd::run_ls(a)?,
        Command::Bench { what } => crate::bench::run_bench(what)?,
        Command::Status { json, conf } => crate::cluster_cmd::run_status(&conf.conf, json)?,
        Command::Perf { cmd } => crate::admin::run_perf(cmd)?,
        Command::SlowOps(a) => crate::admin::run_slow_ops(a)?,
        Command::Config { cmd } => crate::admin::run_config(cmd)?,
        Command::Demo(a) => crate::demo::run(a)?,
        Command::Scrub { cmd } => crate::scrub_cmd::run(cmd)?,
    })
}
