//! Our driver vs the kernel nvme driver on the same emulated controller, in the same run:
//! 4 KiB random read QD1 and QD32, 4 KiB random write QD32, 128 KiB sequential write QD8.
//! Phases: ours (vfio-pci) → `nvstore device unbind` → kernel (FileDevice on /dev/nvmeXnY,
//! io_uring, O_DIRECT) → `nvstore device bind` → ours again. CPU time per IO is from
//! getrusage(RUSAGE_SELF) (all threads of the process, io_uring workers included).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use nvstore_driver::nvme::sysfs::PciFunction;
use nvstore_driver::workload::{self, Pattern, Report, Spec};
use nvstore_driver::{
    BlockDevice, Completion, FileDevice, FileOptions, NvmeDevice, NvmeOptions, QueueHandle, Request,
};

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

/// What one access to an emulated device register costs the guest CPU: the floor under every
/// doorbell write and register read.
fn mmio_cost(dev: &NvmeDevice) -> f64 {
    const N: u32 = 20_000;
    let c0 = rusage_cpu();
    let mut x = 0u32;
    for _ in 0..N {
        x ^= dev.controller().status_register();
    }
    std::hint::black_box(x);
    (rusage_cpu() - c0).as_secs_f64() * 1e6 / N as f64
}

/// Where a polling driver's CPU goes at 4 KiB random read QD32: time inside `submit` and inside
/// polls that returned completions (the driver's own work) versus polls that found nothing
/// (waiting for the device). Returns (driver µs per IO, waiting µs per IO).
fn driver_work(dev: &NvmeDevice, secs: u64) -> (f64, f64) {
    const QD: usize = 32;
    let mut q = dev.open_queue().expect("queue");
    let slots = SPAN_BYTES / 4096;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % slots
    };
    let bs = dev.geometry().block_size as u64;
    let blocks = (4096 / bs) as u32;
    let mut out: Vec<Completion> = (0..QD).map(|_| Completion::default()).collect();
    let (mut work, mut idle, mut ios) = (Duration::ZERO, Duration::ZERO, 0u64);
    let t = Instant::now();
    for i in 0..QD {
        let b = dev.alloc_buf(4096).unwrap();
        q.submit(Request::read(
            next() * blocks as u64,
            blocks,
            b,
            0,
            i as u64,
        ))
        .expect("submit");
    }
    work += t.elapsed();
    let deadline = Instant::now() + Duration::from_secs(secs);
    while q.in_flight() > 0 {
        let t0 = Instant::now();
        let n = q.poll(&mut out).expect("poll");
        if n == 0 {
            idle += t0.elapsed();
            continue;
        }
        let more = t0 < deadline;
        for c in &mut out[..n] {
            let c = std::mem::take(c);
            c.result.expect("read");
            ios += 1;
            if more {
                let lba = next() * blocks as u64;
                q.submit(Request::read(lba, blocks, c.buf.unwrap(), 0, c.tag))
                    .expect("submit");
            }
        }
        work += t0.elapsed();
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / ios as f64;
    (per(work), per(idle))
}

fn ours(
    bdf: &str,
    label: &str,
    specs: &[Spec],
    fill: bool,
    opts: NvmeOptions,
) -> Vec<(Report, f64)> {
    let dev = NvmeDevice::open(bdf, 1, opts.clone()).expect("open NVMe device");
    if fill {
        workload::prefill(&dev, SPAN_BYTES).expect("prefill");
        let mmio = mmio_cost(&dev);
        println!("one emulated register read (CSTS) costs {mmio:.2} µs of guest CPU");
        marker(&format!(
            "BENCH-COST [{label}] one emulated register access: {mmio:.2} µs of guest CPU"
        ));
        let (work, wait) = driver_work(&dev, 2);
        let line = format!(
            "randread 4k QD32 (spinning): driver work {work:.2} µs per IO (submit + polls that \
             reaped), waiting for the device {wait:.2} µs per IO (empty polls)"
        );
        println!("{line}");
        marker(&format!("BENCH-COST [{label}] {line}"));
    }
    println!(
        "ours: userspace NVMe driver over VFIO on {} (wait_spin {:?})",
        dev.name(),
        opts.wait_spin
    );
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
    let label = args.get("label");
    let secs: u64 = args.get("secs").parse().expect("secs");
    let specs = specs(secs);
    let ours1 = ours(&bdf, &label, &specs, true, NvmeOptions::default());
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
    // The same driver, sleeping between polls after 20 µs without a completion: under
    // emulation the guest's spinning vCPU competes with QEMU's device model for 2 host cores.
    let hybrid = NvmeOptions {
        wait_spin: Some(Duration::from_micros(20)),
        ..NvmeOptions::default()
    };
    let ours2 = ours(&bdf, &label, &specs, false, hybrid);
    println!();
    let header = format!(
        "{:<20} | {:>9} {:>7} | {:>9} {:>7} | {:>9} {:>7} | {:>11} | {:>11}",
        "workload",
        "spin IOPS",
        "cpu µs",
        "nap IOPS",
        "cpu µs",
        "kern IOPS",
        "cpu µs",
        "IOPS× s/n",
        "CPU× s/n"
    );
    println!("{header}");
    marker(&format!("BENCH [{label}] {header}"));
    for (i, s) in specs.iter().enumerate() {
        let (o, oc) = &ours1[i];
        let (k, kc) = &kernel[i];
        let (o2, o2c) = &ours2[i];
        let line = format!(
            "{:<20} | {:>9.0} {:>7.2} | {:>9.0} {:>7.2} | {:>9.0} {:>7.2} | {:>5.2} {:>5.2} | {:>5.2} {:>5.2}",
            s.label(),
            o.iops(),
            oc,
            o2.iops(),
            o2c,
            k.iops(),
            kc,
            o.iops() / k.iops(),
            o2.iops() / k.iops(),
            kc / oc,
            kc / o2c
        );
        println!("{line}");
        marker(&format!("BENCH [{label}] {line}"));
    }
    true
}
