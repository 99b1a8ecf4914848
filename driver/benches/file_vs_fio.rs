//! `cargo bench -p nvstore-driver`: FileDevice vs fio on the same file, same sizes and depths,
//! interleaved in the same run. Environment:
//! * `NVSTORE_BENCH_SECS` seconds per run (default 5), `NVSTORE_BENCH_ROUNDS` (default 3),
//! * `NVSTORE_BENCH_FILE` the file to use (default: a 1 GiB file under the target directory),
//! * `NVSTORE_BENCH_SPAN_MB` how much of it to use (default 1024),
//! * `NVSTORE_BENCH_ONLY` run only workloads whose label contains this (e.g. `QD32`).

use std::path::PathBuf;
use std::time::Duration;

use nvstore_driver::workload::{compare_with_fio, prefill, print_table, standard_specs};
use nvstore_driver::{FileDevice, FileOptions};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // cargo bench passes --bench; a plain `cargo test --benches` passes nothing: run quickly then.
    let quick = !std::env::args().any(|a| a == "--bench");
    let secs = env_u64("NVSTORE_BENCH_SECS", if quick { 1 } else { 5 });
    let rounds = env_u64("NVSTORE_BENCH_ROUNDS", if quick { 1 } else { 3 }) as usize;
    let span = env_u64("NVSTORE_BENCH_SPAN_MB", if quick { 64 } else { 1024 }) << 20;
    let path = std::env::var_os("NVSTORE_BENCH_FILE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("driver-bench.img"));
    println!(
        "FileDevice vs fio on {} ({} MiB span, {secs} s × {rounds} rounds, medians)",
        path.display(),
        span >> 20
    );
    let dev = FileDevice::create(&path, span, FileOptions::default()).expect("bench file");
    println!("engine: {:?}", dev.engine());
    prefill(&dev, span).expect("prefill");
    let only = std::env::var("NVSTORE_BENCH_ONLY").unwrap_or_default();
    let specs: Vec<_> = standard_specs(span, Duration::from_secs(secs))
        .into_iter()
        .filter(|s| s.label().contains(&only))
        .collect();
    let rows = compare_with_fio(&dev, &path, &specs, rounds).expect("benchmark");
    print_table(&rows);
    println!(
        "peak RSS: {} MiB",
        nvstore_driver::workload::peak_rss_kib() / 1024
    );
}
