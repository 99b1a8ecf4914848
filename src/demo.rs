//! `nvstore demo`.
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Keep the cluster directory afterwards
    #[arg(long)]
    pub keep: bool,
}

pub fn run(_a: DemoArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    Ok(ExitCode::from(2))
}
