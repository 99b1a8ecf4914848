//! `nvstore device list|bind|unbind|identify`: find NVMe controllers, hand them to vfio-pci
//! (and back to the kernel), and identify them through our own driver.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Subcommand;
use driver::nvme::sysfs::{self, PciFunction};
use driver::nvme::{Controller, NvmeOptions};

#[derive(Debug, Subcommand)]
pub enum DeviceCommand {
    /// Every NVMe PCI function: address, IDs, driver, IOMMU group, NUMA node, block devices
    List,
    /// Give controllers to vfio-pci so nvstore can drive them from userspace
    Bind {
        /// PCI addresses (`0000:5e:00.0` or `5e:00.0`)
        #[arg(required = true)]
        addrs: Vec<String>,
        /// Bind even when a namespace is mounted or held open (its users lose the device)
        #[arg(long)]
        force: bool,
    },
    /// Give controllers back to the kernel nvme driver
    Unbind {
        #[arg(required = true)]
        addrs: Vec<String>,
    },
    /// Identify a controller bound to vfio-pci through nvstore's driver
    Identify { addr: String },
}

/// A failure with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{addr}: {problem}{}", fix_suffix(.fix))]
    Refused {
        addr: String,
        problem: String,
        fix: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Driver(#[from] driver::Error),
}

fn fix_suffix(fix: &str) -> String {
    if fix.is_empty() {
        String::new()
    } else {
        format!("\n  fix: {fix}")
    }
}

fn refused(addr: &str, problem: impl Into<String>, fix: impl Into<String>) -> DeviceError {
    DeviceError::Refused {
        addr: addr.to_string(),
        problem: problem.into(),
        fix: fix.into(),
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DeviceError {
    let what = what.into();
    move |source| DeviceError::Io { what, source }
}

pub fn run(cmd: DeviceCommand) -> Result<ExitCode, DeviceError> {
    match cmd {
        DeviceCommand::List => list(),
        DeviceCommand::Bind { addrs, force } => {
            for a in &addrs {
                bind(a, force)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        DeviceCommand::Unbind { addrs } => {
            for a in &addrs {
                unbind(a)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        DeviceCommand::Identify { addr } => identify(&addr),
    }
}

/// A kernel block device of a controller bound to the nvme driver.
#[derive(Debug, Clone)]
pub struct BlockDev {
    /// `nvme0n1`
    pub name: String,
    pub bytes: u64,
    /// Mount points of the device or its partitions.
    pub mounts: Vec<String>,
    /// Other reasons it is busy: swap, holders (dm/md), processes with it open.
    pub users: Vec<String>,
}

impl BlockDev {
    pub fn in_use(&self) -> bool {
        !self.mounts.is_empty() || !self.users.is_empty()
    }
}

/// The namespaces' block devices of `f` (empty unless bound to nvme).
pub fn block_devices(f: &PciFunction) -> Vec<BlockDev> {
    let mut names = Vec::new();
    let nvme_dir = f.path().join("nvme");
    for ctrl in read_names(&nvme_dir) {
        for entry in read_names(&nvme_dir.join(&ctrl)) {
            if entry.starts_with(&ctrl) && entry.contains('n') && entry != ctrl {
                names.push(entry);
            }
        }
    }
    // Multipath kernels list the per-path node nvme0c0n1 under the controller; the disk users
    // see is nvme0n1 (the head). Prefer the head when it exists.
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for n in names {
        let head = head_name(&n);
        let disk = if Path::new("/sys/block").join(&head).exists() {
            head
        } else {
            n
        };
        if seen.insert(disk.clone()) && Path::new("/sys/block").join(&disk).exists() {
            out.push(describe_block(&disk));
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// `nvme0c1n2` → `nvme0n2`; other names unchanged.
fn head_name(name: &str) -> String {
    let Some(rest) = name.strip_prefix("nvme") else {
        return name.to_string();
    };
    match (rest.find('c'), rest.find('n')) {
        (Some(c), Some(n)) if c < n => format!("nvme{}{}", &rest[..c], &rest[n..]),
        _ => name.to_string(),
    }
}

fn read_names(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn describe_block(disk: &str) -> BlockDev {
    let sys = Path::new("/sys/block").join(disk);
    let sectors: u64 = fs::read_to_string(sys.join("size"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    // The disk and its partitions.
    let mut parts = vec![disk.to_string()];
    parts.extend(read_names(&sys).into_iter().filter(|p| p.starts_with(disk)));
    let devs: HashSet<String> = parts.iter().map(|p| format!("/dev/{p}")).collect();
    let majmin: HashSet<String> = parts
        .iter()
        .filter_map(|p| {
            let dir = if p == disk { sys.clone() } else { sys.join(p) };
            fs::read_to_string(dir.join("dev"))
                .ok()
                .map(|s| s.trim().to_string())
        })
        .collect();
    let mut mounts = Vec::new();
    if let Ok(mi) = fs::read_to_string("/proc/self/mountinfo") {
        for line in mi.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 4 && majmin.contains(f[2]) {
                mounts.push(f[4].to_string());
            }
        }
    }
    let mut users = Vec::new();
    if let Ok(sw) = fs::read_to_string("/proc/swaps") {
        for line in sw.lines().skip(1) {
            if let Some(dev) = line.split_whitespace().next() {
                if devs.contains(dev) {
                    users.push(format!("swap on {dev}"));
                }
            }
        }
    }
    for p in &parts {
        let dir = if p == disk { sys.clone() } else { sys.join(p) };
        for h in read_names(&dir.join("holders")) {
            users.push(format!("held by {h}"));
        }
    }
    users.extend(open_by_processes(&devs));
    BlockDev {
        name: disk.to_string(),
        bytes: sectors * 512,
        mounts,
        users,
    }
}

/// Processes with any of `devs` open (scans /proc/*/fd; needs root to see other users').
fn open_by_processes(devs: &HashSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    let me = std::process::id().to_string();
    for pid in read_names(Path::new("/proc")) {
        if !pid.bytes().all(|b| b.is_ascii_digit()) || pid == me {
            continue;
        }
        let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
        let hit = read_names(&fd_dir).into_iter().any(|fd| {
            fs::read_link(fd_dir.join(fd))
                .map(|t| devs.contains(&*t.to_string_lossy()))
                .unwrap_or(false)
        });
        if hit {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            out.push(format!("open by pid {pid} ({})", comm.trim()));
        }
    }
    out
}

fn list() -> Result<ExitCode, DeviceError> {
    let fns = sysfs::nvme_functions().map_err(io("list PCI devices"))?;
    if fns.is_empty() {
        println!("no NVMe controllers (PCI class 010802) found");
        return Ok(ExitCode::SUCCESS);
    }
    if !sysfs::iommu_enabled() {
        println!(
            "note: no IOMMU groups: the kernel runs without an IOMMU; `bind` needs \
             intel_iommu=on (or amd_iommu=on) iommu=pt on the kernel command line"
        );
    }
    for f in &fns {
        let group = match f.iommu_group {
            Some(g) => {
                let peers = f.group_peers();
                if peers.is_empty() {
                    format!("{g} (alone)")
                } else {
                    format!("{g} (with {})", peers.join(", "))
                }
            }
            None => "none".to_string(),
        };
        println!(
            "{}  {:04x}:{:04x}  driver {}  iommu group {}  numa node {}",
            f.bdf,
            f.vendor,
            f.device,
            f.driver.as_deref().unwrap_or("none"),
            group,
            f.numa_node
        );
        for b in block_devices(f) {
            let state = if b.mounts.is_empty() && b.users.is_empty() {
                "not in use".to_string()
            } else {
                let mut s: Vec<String> =
                    b.mounts.iter().map(|m| format!("mounted on {m}")).collect();
                s.extend(b.users.iter().cloned());
                s.join(", ")
            };
            println!(
                "    /dev/{}  {:.1} GiB  {state}",
                b.name,
                b.bytes as f64 / (1u64 << 30) as f64
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn write_sysfs(path: impl AsRef<Path>, value: &str) -> Result<(), DeviceError> {
    let path = path.as_ref();
    fs::write(path, value).map_err(|e| {
        let what = format!("write {value:?} to {}", path.display());
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            DeviceError::Io {
                what: format!("{what} (run as root)"),
                source: e,
            }
        } else {
            DeviceError::Io { what, source: e }
        }
    })
}

/// Wait until `cond` holds, up to `timeout`.
fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_function(addr: &str) -> Result<PciFunction, DeviceError> {
    PciFunction::read(addr).map_err(|e| {
        refused(
            addr,
            e.to_string(),
            "see `nvstore device list` for addresses",
        )
    })
}

/// Bind one controller to vfio-pci.
pub fn bind(addr: &str, force: bool) -> Result<(), DeviceError> {
    let f = read_function(addr)?;
    let bdf = f.bdf.clone();
    if !f.is_nvme() && !force {
        return Err(refused(
            &bdf,
            format!("class {:06x} is not an NVMe controller", f.class),
            "pass an NVMe address, or --force",
        ));
    }
    if f.iommu_group.is_none() {
        return Err(refused(
            &bdf,
            "the kernel runs without an IOMMU: vfio-pci cannot isolate the device",
            "enable VT-d/AMD-Vi in the firmware and add `intel_iommu=on iommu=pt` (or \
             `amd_iommu=on iommu=pt`) to the kernel command line, then reboot",
        ));
    }
    if f.driver.as_deref() == Some("vfio-pci") {
        println!("{bdf}: already bound to vfio-pci");
        return check_vfio_ready(&f);
    }
    let busy: Vec<BlockDev> = block_devices(&f)
        .into_iter()
        .filter(|b| b.in_use())
        .collect();
    if !busy.is_empty() && !force {
        let what: Vec<String> = busy
            .iter()
            .map(|b| {
                let mut why: Vec<String> =
                    b.mounts.iter().map(|m| format!("mounted on {m}")).collect();
                why.extend(b.users.iter().cloned());
                format!("/dev/{} {}", b.name, why.join(", "))
            })
            .collect();
        return Err(refused(
            &bdf,
            format!("a namespace is in use: {}", what.join("; ")),
            "unmount it and stop its users, or pass --force (they lose the device)",
        ));
    }
    ensure_vfio_pci(&bdf)?;
    if let Some(d) = &f.driver {
        write_sysfs(f.path().join("driver/unbind"), &bdf)?;
        println!("{bdf}: unbound from {d}");
    }
    write_sysfs(f.path().join("driver_override"), "vfio-pci")?;
    // drivers_probe binds the device to its override; an error here (e.g. EINVAL when no driver
    // accepts it) is checked through the driver link just below.
    let _ = fs::write("/sys/bus/pci/drivers_probe", &bdf);
    let bound = wait_for(Duration::from_secs(5), || {
        PciFunction::read(&bdf)
            .map(|g| g.driver.as_deref() == Some("vfio-pci"))
            .unwrap_or(false)
    });
    if !bound {
        return Err(refused(
            &bdf,
            "vfio-pci did not take the device",
            "check `dmesg` for vfio-pci errors",
        ));
    }
    println!("{bdf}: bound to vfio-pci");
    check_vfio_ready(&f)
}

/// Load vfio-pci if it is not there.
fn ensure_vfio_pci(bdf: &str) -> Result<(), DeviceError> {
    if sysfs::vfio_pci_loaded() {
        return Ok(());
    }
    let status = std::process::Command::new("modprobe")
        .arg("vfio-pci")
        .status();
    if sysfs::vfio_pci_loaded() {
        return Ok(());
    }
    Err(refused(
        bdf,
        format!(
            "the vfio-pci driver is not loaded and `modprobe vfio-pci` {}",
            match status {
                Ok(s) => format!("exited with {s}"),
                Err(e) => format!("could not run: {e}"),
            }
        ),
        "install the kernel's modules package and `modprobe vfio-pci` as root",
    ))
}

/// After binding: `/dev/vfio/N` exists and every other device of the group is unbound or on
/// vfio-pci (otherwise VFIO refuses the group).
fn check_vfio_ready(f: &PciFunction) -> Result<(), DeviceError> {
    let g = f.iommu_group.expect("checked by the caller");
    let node = PathBuf::from(format!("/dev/vfio/{g}"));
    if !wait_for(Duration::from_secs(5), || node.exists()) {
        return Err(refused(
            &f.bdf,
            format!("{} did not appear", node.display()),
            "check that devtmpfs/udev runs and `dmesg` for vfio errors",
        ));
    }
    let blockers: Vec<String> = f
        .group_peers()
        .into_iter()
        .filter_map(|peer| {
            let p = PciFunction::read(&peer).ok()?;
            match p.driver.as_deref() {
                None | Some("vfio-pci") | Some("pcieport") => None,
                Some(d) => Some(format!("{peer} (bound to {d})")),
            }
        })
        .collect();
    if !blockers.is_empty() {
        return Err(refused(
            &f.bdf,
            format!(
                "IOMMU group {g} is not viable: {} still bound to a kernel driver",
                blockers.join(", ")
            ),
            "bind those devices too (`nvstore device bind ADDR…`) or unbind them",
        ));
    }
    println!("{}: {} ready (IOMMU group {g})", f.bdf, node.display());
    Ok(())
}

/// Give one controller back to the kernel nvme driver.
pub fn unbind(addr: &str) -> Result<(), DeviceError> {
    let f = read_function(addr)?;
    let bdf = f.bdf.clone();
    if f.driver.as_deref() == Some("nvme") {
        println!("{bdf}: already bound to nvme");
        return Ok(());
    }
    if let Some(d) = &f.driver {
        write_sysfs(f.path().join("driver/unbind"), &bdf)?;
        println!("{bdf}: unbound from {d}");
    }
    write_sysfs(f.path().join("driver_override"), "\n")?;
    if !Path::new("/sys/bus/pci/drivers/nvme").exists() {
        let _ = std::process::Command::new("modprobe").arg("nvme").status();
    }
    let _ = fs::write("/sys/bus/pci/drivers_probe", &bdf);
    let bound = wait_for(Duration::from_secs(10), || {
        PciFunction::read(&bdf)
            .map(|g| g.driver.as_deref() == Some("nvme"))
            .unwrap_or(false)
    });
    if !bound {
        return Err(refused(
            &bdf,
            "the nvme driver did not take the device back",
            "`modprobe nvme`, then `echo BDF > /sys/bus/pci/drivers_probe`; see `dmesg`",
        ));
    }
    let f = read_function(&bdf)?;
    // The kernel scans namespaces asynchronously after probe.
    let mut disks = Vec::new();
    wait_for(Duration::from_secs(10), || {
        disks = block_devices(&f);
        !disks.is_empty()
    });
    let names: Vec<String> = disks.iter().map(|b| format!("/dev/{}", b.name)).collect();
    println!(
        "{bdf}: bound to nvme{}",
        if names.is_empty() {
            String::new()
        } else {
            format!(" ({})", names.join(", "))
        }
    );
    Ok(())
}

fn identify(addr: &str) -> Result<ExitCode, DeviceError> {
    let f = read_function(addr)?;
    if f.driver.as_deref() != Some("vfio-pci") {
        return Err(refused(
            &f.bdf,
            format!(
                "bound to {}, not vfio-pci",
                f.driver.as_deref().unwrap_or("no driver")
            ),
            format!("`nvstore device bind {}` first", f.bdf),
        ));
    }
    let opts = NvmeOptions {
        arena_bytes: 8 << 20,
        io_queues_max: 1,
        ..NvmeOptions::default()
    };
    let ctrl = Controller::open(&f.bdf, opts)?;
    print!("{}", describe(&ctrl));
    Ok(ExitCode::SUCCESS)
}

/// The identify report.
pub fn describe(ctrl: &Controller) -> String {
    use std::fmt::Write;
    let i = ctrl.info();
    let mut s = String::new();
    let _ = writeln!(s, "controller {}", ctrl.name());
    let _ = writeln!(s, "  model     {}", i.model);
    let _ = writeln!(s, "  serial    {}", i.serial);
    let _ = writeln!(s, "  firmware  {}", i.firmware);
    let _ = writeln!(s, "  NVMe      {}", i.version);
    let _ = writeln!(
        s,
        "  PCI IDs   vendor {:04x} subsystem vendor {:04x}",
        i.vendor_id, i.subsystem_vendor_id
    );
    let _ = writeln!(
        s,
        "  MDTS      {}",
        match i.mdts_bytes {
            Some(b) => format!("{} KiB per command", b / 1024),
            None => "no limit".into(),
        }
    );
    let _ = writeln!(
        s,
        "  queues    up to {} I/O queue pairs, {} entries each (CAP.MQES+1), doorbell stride {} B",
        i.io_queues_allocated, i.max_queue_entries, i.doorbell_stride_bytes
    );
    let _ = writeln!(s, "  CAP.TO    {} ms", i.ready_timeout_ms);
    let _ = writeln!(
        s,
        "  features  volatile write cache: {}; write zeroes: {}; deallocate: {}",
        yes(i.volatile_write_cache),
        yes(i.supports_write_zeroes()),
        yes(i.supports_deallocate())
    );
    let _ = writeln!(
        s,
        "  DMA       {} MiB arena on {} pages",
        ctrl.arena().len() >> 20,
        if ctrl.arena().hugepages() {
            "2 MiB huge"
        } else {
            "4 KiB (no hugepages reserved)"
        }
    );
    let _ = writeln!(s, "  namespaces {}", ctrl.namespaces().len());
    for ns in ctrl.namespaces() {
        let _ = writeln!(
            s,
            "    ns {}: {} blocks of {} B = {:.1} MiB",
            ns.nsid,
            ns.blocks,
            ns.block_bytes,
            ns.bytes() as f64 / (1 << 20) as f64
        );
        for (k, lf) in ns.formats.iter().enumerate() {
            let _ = writeln!(
                s,
                "      LBA format {k}: {} B data + {} B metadata, relative performance {}{}",
                lf.block_bytes,
                lf.metadata_bytes,
                lf.relative_performance,
                if k == ns.format_index as usize {
                    " (in use)"
                } else {
                    ""
                }
            );
        }
    }
    s
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipath_names_map_to_disks() {
        assert_eq!(head_name("nvme0c1n2"), "nvme0n2");
        assert_eq!(head_name("nvme3n1"), "nvme3n1");
    }

    #[test]
    fn refusals_carry_their_fix() {
        let e = refused("0000:00:03.0", "a namespace is in use", "unmount it");
        let s = e.to_string();
        assert!(s.starts_with("0000:00:03.0: a namespace is in use"), "{s}");
        assert!(s.contains("fix: unmount it"), "{s}");
    }

    #[test]
    fn unknown_address_is_refused_with_a_hint() {
        let e = bind("ffff:ff:1f.7", false).unwrap_err();
        assert!(e.to_string().contains("nvstore device list"), "{e}");
    }
}
