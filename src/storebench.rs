//! `nvstore bench store --device SPEC`: the store's own workloads on any device nvstore can
//! open (a file, a kernel block device, or an NVMe namespace through the VFIO driver). The
//! hardware suite runs it on the emulated NVMe controller through our driver and through the
//! kernel's, in the same guest run.

use std::process::ExitCode;

use clap::Args;
use driver::BlockDevice;
use store::bench::{async_reads, durable_puts, fill, lone_put_latency};
use store::{mkfs, MkfsOptions, Store, StoreConfig};

use crate::storecli::{open_file, open_nvme, DeviceSpec};

#[derive(Debug, Args)]
pub struct StoreBenchArgs {
    /// Device: a file or block device path, or an NVMe PCI address (`ADDR[/nsN]`)
    #[arg(long)]
    pub device: String,
    /// Format the device first (destroys what it holds)
    #[arg(long)]
    pub mkfs: bool,
    /// Seconds per throughput phase
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Objects the read phase reads among
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(32..))]
    pub objects: u64,
    /// A label for the result lines (e.g. "vfio" or "kernel")
    #[arg(long, default_value = "store")]
    pub label: String,
}

pub fn run(a: StoreBenchArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    match DeviceSpec::parse(&a.device)? {
        DeviceSpec::Path(p) => bench(open_file(&p, None)?, &a),
        DeviceSpec::Nvme { bdf, nsid } => bench(open_nvme(&bdf, nsid)?, &a),
    }
}

fn bench<D: BlockDevice + 'static>(
    dev: D,
    a: &StoreBenchArgs,
) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if a.mkfs {
        mkfs(
            &dev,
            &MkfsOptions {
                segment_bytes: 8 << 20,
                ..MkfsOptions::default()
            },
        )?;
    }
    let (s, report) = Store::open(dev, None, StoreConfig::default())?;
    eprintln!("{}: {report}", a.device);
    let secs = a.seconds as f64;
    // Keep the live data of the overwrite phases to a quarter of the device.
    let budget = s.space().usable_bytes() / 4;
    let small_per_writer = (budget / 4096 / 32).clamp(1, 10_000);
    let big_per_writer = (budget / (4 << 20) / 4).clamp(1, 8);
    let objects = a.objects.min(budget / 4096).max(32);
    let (p50, p99) = lone_put_latency(&s, 200);
    println!(
        "STOREBENCH {} lone-put-4k p50_us={p50:.0} p99_us={p99:.0}",
        a.label
    );
    let puts = durable_puts(&s, 4096, 32, small_per_writer, secs);
    println!("STOREBENCH {} puts-4k-32w ops_per_s={puts:.0}", a.label);
    let big = durable_puts(&s, 4 << 20, 4, big_per_writer, secs);
    println!(
        "STOREBENCH {} write-4m-4w mb_per_s={:.1}",
        a.label,
        big * 4.0 * 1048576.0 / 1e6
    );
    fill(&s, objects, &vec![0x22u8; 4096], 8);
    let (reads, cpu) = async_reads(&s, objects, 4096, 32, secs);
    println!(
        "STOREBENCH {} reads-4k-qd32 ops_per_s={reads:.0} cpu_us_per_read={cpu:.1}",
        a.label
    );
    let st = s.stats();
    println!(
        "STOREBENCH {} totals puts_per_flush={:.1} write_amplification={:.2} index_bytes_per_object={:.0}",
        a.label,
        st.txns_per_round(),
        st.write_amplification(),
        s.index_bytes_per_object()
    );
    Ok(ExitCode::SUCCESS)
}
