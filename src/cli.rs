//! Command-line interface: one enum of command groups, each dispatched to its module.
//! A group that is not built yet says so and exits with status 2; it never pretends.

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
    /// Run a storage node
    Node {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start and stop a local cluster; pools
    Cluster {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Store an object: put POOL NAME [FILE]
    Put {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Fetch an object: get POOL NAME [FILE]
    Get {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Show an object's size, version and checksum
    Stat {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Remove an object
    Rm {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// List a pool's objects
    Ls {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks: devices now; the cluster (write/seq/rand) later
    Bench {
        #[command(subcommand)]
        what: crate::bench::BenchCommand,
    },
    /// Cluster health, map, PG states, IO rates, recovery progress
    Status {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Dump or reset a node's performance counters
    Perf {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Dump a node's slow-op history as JSON
    SlowOps {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start an 8-node local cluster, write, kill nodes, read degraded, heal, clean up
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
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

/// Exit status of a command group that does not exist yet.
const NOT_BUILT: u8 = 2;

pub(crate) fn not_built(group: &str, issue: u32) -> ExitCode {
    eprintln!("nvstore {group}: not built yet (tracked in issue #{issue}); nothing was done");
    ExitCode::from(NOT_BUILT)
}

pub fn run(cli: Cli) -> Result<ExitCode, Box<dyn std::error::Error>> {
    Ok(match cli.command {
        Command::Device { what } => crate::device::run(what)?,
        Command::Mkfs(a) => crate::storecli::run_mkfs(a)?,
        Command::StoreTool(a) => crate::storecli::run_store_tool(a)?,
        Command::Node { .. } => not_built("node", 7),
        Command::Cluster { .. } => not_built("cluster", 7),
        Command::Put { .. } => not_built("put", 7),
        Command::Get { .. } => not_built("get", 7),
        Command::Stat { .. } => not_built("stat", 7),
        Command::Rm { .. } => not_built("rm", 7),
        Command::Ls { .. } => not_built("ls", 7),
        Command::Bench { what } => crate::bench::run_bench(what)?,
        Command::Status { .. } => not_built("status", 7),
        Command::Perf { .. } => not_built("perf", 8),
        Command::SlowOps { .. } => not_built("slow-ops", 8),
        Command::Demo { .. } => not_built("demo", 7),
    })
}
