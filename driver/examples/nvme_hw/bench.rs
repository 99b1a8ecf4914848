//! Our driver vs the kernel nvme driver on the same emulated controller, in the same run:
//! 4 KiB random read QD1 and QD32, 4 KiB random write QD32, 128 KiB sequential write QD8.
//! Phases: ours (vfio-pci) → `nvstore device unbind` → kernel (FileDevice on /dev/nvmeXnY,
//! io_uring, O_DIRECT) → `nvstore device bind` → ours again. CPU time per IO is from
//! getrusage(RUSAGE_SELF) (all threads of the process, io_uring workers included).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use nvstore_driver::nvme::sysfs::PciFunction;
use nvstore_driver::workload::{self, Pattern, Report, Spec};
use nvstore_driver::{BlockDevice, FileDevice, FileOptions, NvmeDevice, NvmeOptions};

use crate::{marker, Args};

const SPAN_BYTES: u64 = 64 << 20;

fn specs(secs: u64) -> Vec<Spec> {
    let spec = |pattern, io_bytes, depth| Spec {
        pattern,
        io_bytes,
        depth,
        span_bytes: SPAN_BYTES,
        duration: Duration::from_secs(secs),
        seed: 0x6e76_7374,
    };
    vec![
        spec(Pattern::RandRead, 4096, 1),
        spec(Pattern::RandRead, 4096, 32),
        spec(Pattern::RandWrite, 4096, 32),
        spec(Pattern::SeqWrite, 128 << 10, 8),
    ]
}

fn rusage_cpu() -> Duration {
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage through a pointer to a live local.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// (report, CPU µs per IO from getrusage)
fn measure<D: BlockDevice>(dev: &D, spec: &Spec) -> (Report, f64) {
    let c0 = rusage_cpu();
    let r = workload::run(dev, spec).unwrap_or_else(|e| panic!("{}: {e}", spec.label()));
    let cpu = (rusage_cpu() - c0).as_secs_f64() * 1e6 / r.ios.max(1) as f64;
    println!(
        "  {:<22} {:>9.0} IOPS {:>8.1} MB/s  p50 {:>7.1} µs  p99 {:>8.1} µs  cpu {:>7.2} µs/IO",
        spec.label(),
        r.iops(),
        r.mb_per_s(),
        r.lat_p50_us,
        r.lat_p99_us,
        cpu
    );
    (r, cpu)
}

fn ours(bdf: &str, specs: &[Spec], fill: bool) -> Vec<(Report, f64)> {
    let dev = NvmeDevice::open(bdf, 1, NvmeOptions::default()).expect("open NVMe device");
    if fill {
        workload::prefill(&dev, SPAN_BYTES).expect("prefill");
    }
    println!("ours: userspace NVMe driver over VFIO on {}", dev.name());
    specs.iter().map(|s| measure(&dev, s)).collect()
}

fn cli(nvstore: &str, args: &[&str]) {
    let st = Command::new(nvstore)
        .args(args)
        .status()
        .expect("run nvstore");
    assert!(st.success(), "nvstore {args:?} failed: {st}");
}

fn kernel_disk(bdf: &str) -> PathBuf {
    let f = PciFunction::read(bdf).expect("pci function");
    for c in std::fs::read_dir(f.path().join("nvme")).expect("nvme dir") {
        let c = c.unwrap().file_name().to_string_lossy().into_owned();
        let disk = PathBuf::from(format!("/dev/{c}n1"));
        for _ in 0..100 {
            if disk.exists() {
                return disk;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    panic!("no kernel block device for {bdf}");
}

pub fn run(args: &Args) -> bool {
    let bdf = args.get("bdf");
    let nvstore = args.get("nvstore");
    let secs: u64 = args.get("secs").parse().expect("secs");
    let specs = specs(secs);
    let ours1 = ours(&bdf, &specs, true);
    cli(&nvstore, &["device", "unbind", &bdf]);
    let disk = kernel_disk(&bdf);
    let kernel: Vec<(Report, f64)> = {
        let dev = FileDevice::open(&disk, FileOptions::default()).expect("open kernel disk");
        println!(
            "kernel: nvme driver, FileDevice ({:?}, O_DIRECT) on {}",
            dev.engine(),
            disk.display()
        );
        specs.iter().map(|s| measure(&dev, s)).collect()
    };
    cli(&nvstore, &["device", "bind", &bdf]);
    let ours2 = ours(&bdf, &specs, false);
    println!();
    println!(
        "{:<22} | {:>9} {:>8} | {:>9} {:>8} | {:>9} {:>8} | {:>6} {:>6}",
        "workload",
        "ours IOPS",
        "cpu µs",
        "kern IOPS",
        "cpu µs",
        "ours#2",
        "cpu µs",
        "IOPS×",
        "CPU×"
    );
    for (i, s) in specs.iter().enumerate() {
        let (o, oc) = &ours1[i];
        let (k, kc) = &kernel[i];
        let (o2, o2c) = &ours2[i];
        let best = o.iops().max(o2.iops());
        let best_cpu = oc.min(*o2c);
        let line = format!(
            "{:<22} | {:>9.0} {:>8.2} | {:>9.0} {:>8.2} | {:>9.0} {:>8.2} | {:>5.2}x {:>5.2}x",
            s.label(),
            o.iops(),
            oc,
            k.iops(),
            kc,
            o2.iops(),
            o2c,
            best / k.iops(),
            kc / best_cpu
        );
        println!("{line}");
        marker(&format!("BENCH {line}"));
    }
    true
}
