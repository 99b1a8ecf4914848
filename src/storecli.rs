//! `nvstore mkfs` and `nvstore store-tool`: label a device, and inspect or repair a store
//! offline.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use driver::nvme::{NvmeDevice, NvmeOptions};
use driver::{BlockDevice, FileDevice, FileOptions};
use store::space::SegState;
use store::{mkfs, parse_uuid, MkfsOptions, ObjectKey, Store, StoreConfig, Uuid};

type CliResult = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Debug, Args)]
pub struct MkfsArgs {
    /// Device: a file or block device path, or an NVMe PCI address bound to vfio-pci
    /// (`0000:00:04.0`, namespace 1; `0000:00:04.0/ns2` for another namespace)
    #[arg(long)]
    pub device: String,
    /// Cluster fsid (UUID) the device will belong to
    #[arg(long, value_parser = parse_fsid)]
    pub cluster: [u8; 16],
    /// Node id that owns the device
    #[arg(long)]
    pub node: u32,
    /// Create the file with this size if it does not exist (e.g. 4G, 512M)
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Write every block of a device file once before labelling it (zeros into its holes),
    /// as a block device's are: durable writes then never wait for the file system to
    /// allocate. Takes as long as writing the whole file once
    #[arg(long)]
    pub allocate: bool,
    /// Segment size in MiB (power of two)
    #[arg(long, default_value_t = 8)]
    pub segment_mib: u32,
    /// Chunk size in KiB (power of two)
    #[arg(long, default_value_t = 64)]
    pub chunk_kib: u32,
}

#[derive(Debug, Args)]
pub struct StoreToolArgs {
    /// Device: a file or block device path, or an NVMe PCI address (`ADDR[/nsN]`)
    #[arg(long)]
    pub device: String,
    /// Refuse the device unless it belongs to this cluster
    #[arg(long, value_parser = parse_fsid)]
    pub cluster: Option<[u8; 16]>,
    #[command(subcommand)]
    pub cmd: StoreToolCmd,
}

#[derive(Debug, Subcommand)]
pub enum StoreToolCmd {
    /// Label, space, object count and index memory
    Info,
    /// List objects of a pool
    Ls {
        #[arg(long, default_value_t = 0)]
        pool: u64,
        #[arg(long, default_value_t = 1000)]
        max: usize,
    },
    /// Size, version, mtime and checksum of an object
    Stat { pool: u64, name: String },
    /// Write an object's bytes to FILE (or stdout)
    Get {
        pool: u64,
        name: String,
        file: Option<PathBuf>,
    },
    /// Store FILE as an object
    Put {
        pool: u64,
        name: String,
        file: PathBuf,
    },
    /// Replay (past damaged checkpoint and log batches, which it lists), then verify every
    /// chunk; exits 1 if anything is corrupt or damaged
    Fsck,
    /// Write a checkpoint of the index now, so the next open replays no log (e.g. before
    /// moving a device to another host); refuses a store that does not open clean
    Checkpoint,
}

/// Parse a UUID for `--cluster`.
pub fn parse_fsid(s: &str) -> Result<[u8; 16], String> {
    parse_uuid(s).ok_or_else(|| {
        format!("expected a UUID like 6f1c9a8e-1b2d-4c3e-9f00-112233445566, got {s:?}")
    })
}

/// Parse a size with an optional K/M/G/T suffix (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        Some('T') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("expected a size like 4G, 512M or 1048576, got {s:?}"))
}

/// A device SPEC: a path, or a PCI address with an optional namespace.
pub enum DeviceSpec {
    Path(PathBuf),
    Nvme { bdf: String, nsid: u32 },
}

impl DeviceSpec {
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (addr, ns) = match spec.rsplit_once("/ns") {
            Some((a, n)) if is_pci_address(a) => (a, Some(n)),
            _ => (spec, None),
        };
        if !is_pci_address(addr) {
            return Ok(DeviceSpec::Path(PathBuf::from(spec)));
        }
        let nsid = match ns {
            None => 1,
            Some(n) => n.parse().map_err(|_| {
                format!("{spec}: expected ADDR/nsN with a namespace number, like 0000:00:04.0/ns2")
            })?,
        };
        let bdf = if addr.matches(':').count() == 1 {
            format!("0000:{addr}")
        } else {
            addr.to_string()
        };
        Ok(DeviceSpec::Nvme { bdf, nsid })
    }
}

/// Open a file device (creating it with `create` bytes when missing).
pub(crate) fn open_file(
    path: &std::path::Path,
    create: Option<u64>,
) -> Result<FileDevice, Box<dyn std::error::Error>> {
    let spec = path.display();
    match (path.exists(), create) {
        (false, Some(size)) => Ok(FileDevice::create(path, size, FileOptions::default())?),
        (false, None) => Err(format!("{spec}: no such file (pass --size to create it)").into()),
        (true, _) => Ok(FileDevice::open(path, FileOptions::default())?),
    }
}

/// Open an NVMe namespace through the VFIO driver.
pub(crate) fn open_nvme(bdf: &str, nsid: u32) -> Result<NvmeDevice, Box<dyn std::error::Error>> {
    Ok(NvmeDevice::open(bdf, nsid, NvmeOptions::default())?)
}

/// Run `$body` with `$dev` bound to the device a spec names, whatever its type.
macro_rules! with_device {
    ($spec:expr, $create:expr, |$dev:ident| $body:expr) => {
        match DeviceSpec::parse($spec)? {
            DeviceSpec::Path(p) => {
                let $dev = open_file(&p, $create)?;
                $body
            }
            DeviceSpec::Nvme { bdf, nsid } => {
                if $create.is_some() {
                    return Err("--size applies to files only".into());
                }
                let $dev = open_nvme(&bdf, nsid)?;
                $body
            }
        }
    };
}

/// `DDDD:BB:DD.F` or `BB:DD.F`.
pub fn is_pci_address(s: &str) -> bool {
    let parts: Vec<&str> = s.split([':', '.']).collect();
    let hex = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_hexdigit());
    (parts.len() == 4 || parts.len() == 3) && parts.iter().all(|p| hex(p)) && !s.contains('/')
}

pub fn run_mkfs(a: MkfsArgs) -> CliResult {
    match DeviceSpec::parse(&a.device)? {
        DeviceSpec::Path(p) => {
            let dev = open_file(&p, a.size)?;
            if a.allocate {
                allocate_file(&dev, &a.device)?;
            }
            mkfs_on(&dev, &a)
        }
        DeviceSpec::Nvme { bdf, nsid } => {
            if a.size.is_some() || a.allocate {
                return Err("--size and --allocate apply to files only".into());
            }
            mkfs_on(&open_nvme(&bdf, nsid)?, &a)
        }
    }
}

/// `mkfs --allocate`: write the file's holes once, saying how much and how fast.
fn allocate_file(dev: &FileDevice, spec: &str) -> Result<(), Box<dyn std::error::Error>> {
    let t = std::time::Instant::now();
    let n = dev.allocate()?;
    let secs = t.elapsed().as_secs_f64();
    if n == 0 {
        println!("{spec}: every block already written; nothing to allocate");
    } else {
        println!(
            "{spec}: allocated {} MiB (zeros into holes) in {secs:.1} s, {:.0} MB/s",
            n >> 20,
            n as f64 / secs.max(1e-9) / 1e6
        );
    }
    Ok(())
}

fn mkfs_on<D: BlockDevice>(dev: &D, a: &MkfsArgs) -> CliResult {
    let opts = MkfsOptions {
        cluster_fsid: a.cluster,
        node_id: a.node,
        segment_bytes: a
            .segment_mib
            .checked_mul(1 << 20)
            .ok_or("--segment-mib is too large")?,
        chunk_bytes: a
            .chunk_kib
            .checked_mul(1 << 10)
            .ok_or("--chunk-kib is too large")?,
        ..MkfsOptions::default()
    };
    let label = mkfs(dev, &opts)?;
    println!(
        "{}: labelled device {} for cluster {} node {}: {} segments of {} MiB, {} KiB chunks",
        a.device,
        Uuid(&label.device_uuid),
        Uuid(&label.cluster_fsid),
        label.node_id,
        label.segments,
        label.segment_bytes >> 20,
        label.chunk_bytes >> 10
    );
    Ok(ExitCode::SUCCESS)
}

pub fn run_store_tool(a: StoreToolArgs) -> CliResult {
    let none: Option<u64> = None;
    with_device!(&a.device, none, |dev| {
        let config = StoreConfig {
            cleaner: false,
            // fsck opens past damaged log batches to report them (and writes nothing that
            // would drop them: a later plain open still refuses); other commands refuse.
            salvage: matches!(a.cmd, StoreToolCmd::Fsck),
            ..StoreConfig::default()
        };
        let (store, report) = Store::open(dev, a.cluster, config)?;
        eprintln!("{}: {report}", a.device);
        tool(&store, a.cmd)
    })
}

fn tool<D: BlockDevice + 'static>(s: &Store<D>, cmd: StoreToolCmd) -> CliResult {
    let key = |pool, name: &str| ObjectKey::new(pool, name.as_bytes(), 0);
    match cmd {
        StoreToolCmd::Info => {
            let l = s.label();
            let sp = s.space();
            println!("device uuid     {}", Uuid(&l.device_uuid));
            println!("cluster fsid    {}", Uuid(&l.cluster_fsid));
            println!("node            {}", l.node_id);
            println!(
                "block / chunk   {} B / {} KiB",
                l.block_size,
                l.chunk_bytes >> 10
            );
            println!(
                "segments        {} of {} MiB: {} free, {} reserve, {} reclaimable",
                sp.segments_total,
                sp.segment_bytes >> 20,
                sp.segments_free,
                sp.segments_reserve,
                sp.segments_reclaimable
            );
            println!(
                "live / dead     {} MiB / {} MiB",
                sp.live_bytes >> 20,
                sp.dead_bytes >> 20
            );
            let per: Vec<String> = s
                .segments()
                .iter()
                .enumerate()
                .map(|(i, u)| {
                    let pct = u.live_bytes * 100 / sp.segment_bytes.max(1);
                    match u.state {
                        SegState::Free => format!("{i}:free"),
                        SegState::Reserved => format!("{i}:next"),
                        SegState::Checkpoint { .. } => format!("{i}:ckpt"),
                        SegState::Log { .. } if u.head => format!("{i}:head {pct}%"),
                        SegState::Log { .. } => format!("{i}:{pct}%"),
                    }
                })
                .collect();
            println!("per segment     {} (live %)", per.join(" "));
            println!("objects         {}", s.object_count());
            println!(
                "index           {:.0} bytes per object",
                s.index_bytes_per_object()
            );
        }
        StoreToolCmd::Ls { pool, max } => {
            for (k, st) in s.list(pool, None, max) {
                println!(
                    "{}\t{}\tv{}",
                    String::from_utf8_lossy(&k.name),
                    st.size,
                    st.version
                );
            }
        }
        StoreToolCmd::Stat { pool, name } => {
            let st = s.stat(&key(pool, &name))?;
            println!(
                "size {} version {} mtime_ns {} crc32c {:#010x}",
                st.size, st.version, st.mtime_unix_ns, st.checksum
            );
        }
        StoreToolCmd::Get { pool, name, file } => {
            let data = s.read_vec(&key(pool, &name), 0, u64::MAX)?;
            match file {
                Some(f) => {
                    std::fs::write(&f, &data).map_err(|e| format!("{}: {e}", f.display()))?
                }
                None => std::io::stdout().write_all(&data)?,
            }
        }
        StoreToolCmd::Put { pool, name, file } => {
            let data = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let v = s.write_full(&key(pool, &name), &data)?;
            println!("stored {} bytes as version {v}", data.len());
        }
        StoreToolCmd::Fsck => {
            let salvaged = s.salvage_report();
            for p in salvaged {
                println!("damaged: {p}");
            }
            let r = s.scrub();
            println!(
                "checked {} objects, {} chunks, {} MiB in {:.2} s: {} corrupt, {} unreadable",
                r.objects,
                r.chunks,
                r.bytes >> 20,
                r.elapsed.as_secs_f64(),
                r.corrupt.len(),
                r.errors.len()
            );
            for c in &r.corrupt {
                println!(
                    "corrupt: {} chunk {:?} at byte {}: expected crc32c {:#010x}, found {:#010x}",
                    c.key, c.chunk, c.offset, c.expected, c.found
                );
            }
            for (k, e) in &r.errors {
                println!("unreadable: {k}: {e}");
            }
            if !salvaged.is_empty() {
                println!(
                    "{} damaged place(s) in the checkpoint or log: objects a lost log batch \
                     changed read as their previous state, objects of a lost checkpoint batch \
                     as the log after it has them (or not at all), data items as corrupt; \
                     a node rebuilds them from its peers",
                    salvaged.len()
                );
            }
            if !r.corrupt.is_empty() || !r.errors.is_empty() || !salvaged.is_empty() {
                return Ok(ExitCode::FAILURE);
            }
        }
        StoreToolCmd::Checkpoint => {
            s.checkpoint()?;
            println!("checkpoint written: {} objects", s.object_count());
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_addresses_parse() {
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").unwrap_err().contains("expected a size"));
        assert!(is_pci_address("0000:00:04.0"));
        assert!(is_pci_address("00:04.0"));
        assert!(!is_pci_address("/dev/nvme0n1"));
        assert!(!is_pci_address("disk.img"));
        assert!(parse_fsid("nope").unwrap_err().contains("expected a UUID"));
        match DeviceSpec::parse("00:04.0/ns2").unwrap() {
            DeviceSpec::Nvme { bdf, nsid } => assert_eq!((bdf.as_str(), nsid), ("0000:00:04.0", 2)),
            DeviceSpec::Path(_) => panic!("a PCI address"),
        }
        assert!(matches!(
            DeviceSpec::parse("0000:00:04.0").unwrap(),
            DeviceSpec::Nvme { nsid: 1, .. }
        ));
        assert!(matches!(
            DeviceSpec::parse("/tmp/dev.img").unwrap(),
            DeviceSpec::Path(_)
        ));
        assert!(DeviceSpec::parse("0000:00:04.0/nsx").is_err());
    }
}
