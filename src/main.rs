//! The `nvstore` command: devices, stores, nodes, the cluster, and client operations.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    nvstore::cli::init_tracing();
    let cli = nvstore::cli::Cli::parse();
    match nvstore::cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("nvstore: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
