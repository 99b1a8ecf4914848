//! `nvstore bench`: the device benchmark, and the cluster benchmarks (`bench_cluster`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use driver::workload::{compare_with_fio, prefill, print_table, run, standard_specs};
use driver::{FileDevice, FileOptions};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// FileDevice workloads (4 KiB random read/write at QD1 and QD32, 128 KiB sequential
    /// write) on a file or block device, side by side with fio on the same file
    Device {
        /// File (created if missing) or block device to benchmark. Its contents are overwritten.
        #[arg(long)]
        path: PathBuf,
        /// Bytes of the device to use, in MiB
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(16..))]
        size_mb: u64,
        /// Seconds per workload run
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
        seconds: u64,
        /// Runs per workload (medians are reported)
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
        rounds: u64,
        /// Skip the fio comparison
        #[arg(long)]
        no_fio: bool,
    },
    /// The store's workloads (lone put latency, 4 KiB puts, 4 MiB writes, 4 KiB reads) on a
    /// device: a file, a block device or an NVMe PCI address
    Store(crate::storebench::StoreBenchArgs),
    /// Cluster write benchmark (like rados bench write): whole-object puts
    Write(crate::bench_cluster::ClusterBenchArgs),
    /// Cluster sequential read benchmark over the objects a `write` run left
    Seq(crate::bench_cluster::ClusterBenchArgs),
    /// Cluster random read benchmark over the objects a `write` run left
    Rand(crate::bench_cluster::ClusterBenchArgs),
    /// Cluster overwrite benchmark: whole-object puts over the objects a `write` run left
    Overwrite(crate::bench_cluster::ClusterBenchArgs),
    /// Recovery: start a local cluster, fill it, lose a node; rebuild rate vs the raw
    /// bottleneck, client p99 during recovery vs without
    Recovery(crate::bench_recovery::RecoveryBenchArgs),
    /// Hot object storm: many clients re-reading one 4 MiB object while a probe reads
    /// unrelated objects; with read coalescing on and off
    Hot(crate::bench_hot::HotBenchArgs),
}

pub fn run_bench(cmd: BenchCommand) -> Result<ExitCode, Box<dyn std::error::Error>> {
    match cmd {
        BenchCommand::Device {
            path,
            size_mb,
            seconds,
            rounds,
            no_fio,
        } => device(path, size_mb, seconds, rounds as usize, no_fio),
        BenchCommand::Store(a) => crate::storebench::run(a),
        BenchCommand::Write(a) => crate::bench_cluster::run(crate::bench_cluster::Mode::Write, a),
        BenchCommand::Seq(a) => crate::bench_cluster::run(crate::bench_cluster::Mode::Seq, a),
        BenchCommand::Rand(a) => crate::bench_cluster::run(crate::bench_cluster::Mode::Rand, a),
        BenchCommand::Overwrite(a) => {
            crate::bench_cluster::run(crate::bench_cluster::Mode::Overwrite, a)
        }
        BenchCommand::Recovery(a) => crate::bench_recovery::run(a),
        BenchCommand::Hot(a) => crate::bench_hot::run(a),
    }
}

fn device(
    path: PathBuf,
    size_mb: u64,
    seconds: u64,
    rounds: usize,
    no_fio: bool,
) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let span = size_mb << 20;
    let dev = if path.exists() {
        FileDevice::open(&path, FileOptions::default())?
    } else {
        FileDevice::create(&path, span, FileOptions::default())?
    };
    let cap = driver::BlockDevice::geometry(&dev).capacity_bytes();
    if cap < span {
        return Err(format!(
            "{} holds {} MiB; --size-mb {size_mb} needs more (pass a smaller --size-mb)",
            path.display(),
            cap >> 20
        )
        .into());
    }
    println!(
        "device {} ({:?}), {size_mb} MiB, {seconds} s × {rounds} rounds; filling first…",
        path.display(),
        dev.engine()
    );
    prefill(&dev, span)?;
    let specs = standard_specs(span, Duration::from_secs(seconds));
    if no_fio {
        for spec in &specs {
            let r = run(&dev, spec)?;
            println!(
                "{:<22} {:>10.0} IOPS {:>9.1} MB/s  p50 {:>7.1} µs  p99 {:>7.1} µs  cpu {:.2} µs/IO",
                spec.label(),
                r.iops(),
                r.mb_per_s(),
                r.lat_p50_us,
                r.lat_p99_us,
                r.cpu_us_per_io
            );
        }
    } else {
        print_table(&compare_with_fio(&dev, &path, &specs, rounds)?);
    }
    Ok(ExitCode::SUCCESS)
}
