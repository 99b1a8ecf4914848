//! FileDevice: a regular file or a kernel block device as a BlockDevice, O_DIRECT, through
//! io_uring (one ring per queue handle, batched submission), with a pread/pwrite fallback.
//!
//! This is the embedded default for laptops and CI. Semantics follow the contract in
//! [`crate::device`]: a flush is `fdatasync` through the ring, FUA is `RWF_DSYNC`, write-zeroes
//! is `fallocate(ZERO_RANGE)` and deallocate is `fallocate(PUNCH_HOLE)`.
//!
//! A regular file is sparse until written. A small durable write into a hole costs far more
//! than one into written blocks: the file system allocates, and RWF_DSYNC / fdatasync then
//! write the file's block map synchronously as well (several device commands, each a VM exit
//! on a virtual disk). So, as databases do with their log files, a small FUA write that lands
//! in a not yet filled 1 MiB region first fills that region's holes with zeros in one large
//! write ([`Prefill`]); the region's later small writes are plain overwrites. Holes read as
//! zeros, so this changes no content. Large writes, and plain writes (made durable together by
//! one flush), allocate for themselves and fill nothing.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use crate::device::{BlockDevice, Completion, Geometry, Op, QueueHandle, Request, SubmitError};
use crate::dma::{DmaBuf, HostMemory};
use crate::error::{Error, Result};

/// How a FileDevice moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// io_uring when the kernel allows it, else the synchronous fallback (logged once).
    Auto,
    /// io_uring or fail.
    IoUring,
    /// pread/pwrite on the calling thread; completions are ready at once.
    Sync,
}

/// Options for [`FileDevice::open`].
#[derive(Debug, Clone)]
pub struct FileOptions {
    pub block_size: u32,
    pub queue_depth: u32,
    pub queue_count: u32,
    /// Largest single read or write (default 4 MiB, the usual `max_sectors_kb` of NVMe and
    /// virtio disks: the store's 4 MiB object writes go out whole).
    pub max_transfer_bytes: u32,
    pub engine: Engine,
    /// Open with O_DIRECT. If the file system refuses (tmpfs), the device falls back to
    /// buffered IO and logs it once; durability still comes from fdatasync.
    pub direct: bool,
    /// Hold the device alone for as long as it is open: an exclusive advisory lock (`flock`)
    /// on the file, and for a kernel block device also `O_EXCL` (the kernel then refuses a
    /// disk that is mounted or held by another program). A second opener — another node, or
    /// `store-tool` on a running node's device — gets [`Error::InUse`] (once the device is
    /// still held after 2 s: a holder may be just exiting) instead of both writing one log.
    /// Only a tool that deliberately reads or writes a device beside its owner (a
    /// benchmark's raw loop, a test's corruption) turns this off.
    pub exclusive: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            block_size: 4096,
            queue_depth: 128,
            queue_count: 64,
            max_transfer_bytes: 4 << 20,
            engine: Engine::Auto,
            direct: true,
            exclusive: true,
        }
    }
}

/// Memory alignment O_DIRECT needs for buffers and offsets on the file systems we run on.
const DIRECT_ALIGN_BYTES: u32 = 512;
/// Buffers are page aligned regardless.
const BUF_ALIGN_BYTES: usize = 4096;

struct Inner {
    file: File,
    /// Holds the device alone while it is open (see [`hold`]); `None` without `exclusive`.
    _lock: Option<File>,
    name: Arc<str>,
    geometry: Geometry,
    engine: Engine,
    open_queues: AtomicU32,
    memory: Arc<HostMemory>,
    io: crate::iostats::IoCounters,
    /// `None` for block devices (nothing to allocate).
    prefill: Option<Prefill>,
}

impl Inner {
    fn size_bytes(&self) -> u64 {
        self.geometry.capacity_blocks * self.geometry.block_size as u64
    }
}

/// The largest write [`FileDevice::allocate`] issues.
const ALLOCATE_WRITE_BYTES: usize = 8 << 20;

/// Regions whose holes [`Prefill`] fills at once.
const FILL_REGION_BYTES: u64 = 1 << 20;

/// FUA writes up to this size fill their region's holes first (see the module docs).
const FILL_WRITE_BYTES_MAX: u64 = 128 << 10;

/// Which regions of a sparse file are known to have no holes, and how many writes are in
/// flight in each. A region is filled only while none is: zeros written into a hole must not
/// race a write of real data to the same blocks from another request.
struct Prefill {
    st: std::sync::Mutex<PrefillState>,
    /// Regions filled and zero bytes written, for [`FileDevice::prefill_stats`].
    regions_filled: std::sync::atomic::AtomicU64,
    bytes_filled: std::sync::atomic::AtomicU64,
}

struct PrefillState {
    filled: Vec<bool>,
    writing: Vec<u32>,
    /// A region's worth of zeros, DMA-aligned for O_DIRECT (allocated on first use).
    zeros: Option<DmaBuf>,
    /// A fill failed: stop trying (it is only an optimisation).
    disabled: bool,
}

impl Prefill {
    fn new(bytes: u64) -> Prefill {
        let n = bytes.div_ceil(FILL_REGION_BYTES) as usize;
        Prefill {
            st: std::sync::Mutex::new(PrefillState {
                filled: vec![false; n],
                writing: vec![0; n],
                zeros: None,
                disabled: false,
            }),
            regions_filled: Default::default(),
            bytes_filled: Default::default(),
        }
    }

    fn regions(offset: u64, len: u64) -> std::ops::Range<usize> {
        let first = (offset / FILL_REGION_BYTES) as usize;
        let last = ((offset + len.max(1) - 1) / FILL_REGION_BYTES) as usize;
        first..last + 1
    }

    /// Before a write of `len` bytes at `offset` is submitted: fill the holes of the regions
    /// it touches when it is a small durable (FUA) write and nothing else writes there; count
    /// it as in flight. Only FUA writes pay the block-map sync per write; plain writes share
    /// one flush, which syncs the map once for all of them.
    fn before_write(&self, dev: &Inner, offset: u64, len: u64, fua: bool) {
        let mut st = self.st.lock().unwrap();
        let all = Self::regions(offset, len);
        let range = all.start..all.end.min(st.filled.len());
        if fua && len <= FILL_WRITE_BYTES_MAX && !st.disabled {
            for r in range.clone() {
                if !st.filled[r] && st.writing[r] == 0 {
                    match self.fill(dev, &mut st, r) {
                        Ok(()) => st.filled[r] = true,
                        Err(e) => {
                            st.disabled = true;
                            tracing::warn!(device = %dev.name, error = %e,
                                "could not fill holes ahead of small writes; writing into holes");
                            break;
                        }
                    }
                }
            }
        }
        for r in range {
            st.writing[r] += 1;
        }
    }

    fn after_write(&self, offset: u64, len: u64) {
        let mut st = self.st.lock().unwrap();
        let n = st.filled.len();
        for r in Self::regions(offset, len) {
            if r < n {
                st.writing[r] -= 1;
            }
        }
    }

    /// Holes may be back (punched, or zeroed into unwritten extents).
    fn forget(&self, offset: u64, len: u64) {
        let mut st = self.st.lock().unwrap();
        let n = st.filled.len();
        for r in Self::regions(offset, len) {
            if r < n {
                st.filled[r] = false;
            }
        }
    }

    /// Write zeros into every hole of region `r` (synchronously; the caller holds the lock,
    /// and no write is in flight in the region).
    fn fill(&self, dev: &Inner, st: &mut PrefillState, r: usize) -> std::io::Result<()> {
        let lo = r as u64 * FILL_REGION_BYTES;
        let hi = (lo + FILL_REGION_BYTES).min(dev.size_bytes());
        if st.zeros.is_none() {
            let buf = dev
                .memory
                .alloc(FILL_REGION_BYTES as usize)
                .ok_or_else(|| std::io::Error::other("no memory for a zero buffer"))?;
            st.zeros = Some(buf);
        }
        let zeros = st.zeros.as_ref().expect("allocated above");
        let n = fill_holes(dev, lo, hi, zeros)?;
        self.bytes_filled.fetch_add(n, Ordering::Relaxed);
        self.regions_filled.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Write zeros into every hole between byte offsets `lo` and `hi` of the file (synchronously,
/// in writes of up to `zeros.len()` bytes); returns the bytes written. `zeros` must be all
/// zero and nothing may write it meanwhile. The caller makes sure no request writes into the
/// range meanwhile: zeros written into a hole must not race real data to the same blocks.
fn fill_holes(dev: &Inner, lo: u64, hi: u64, zeros: &DmaBuf) -> std::io::Result<u64> {
    let fd = dev.file.as_raw_fd();
    let bs = dev.geometry.block_size as u64;
    let chunk = (zeros.len() as u64 / bs * bs).max(bs);
    let mut written = 0u64;
    let mut at = lo;
    while at < hi {
        // SAFETY: lseek on our open fd; no memory is passed.
        let hole = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let hole = hole as u64;
        if hole >= hi {
            break;
        }
        // SAFETY: as above.
        let data = unsafe { libc::lseek(fd, hole as libc::off_t, libc::SEEK_DATA) };
        let end = if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENXIO) {
                return Err(e);
            }
            hi // no data after the hole
        } else {
            (data as u64).min(hi)
        };
        // Only whole device blocks inside the hole (O_DIRECT's alignment; a hole that starts
        // or ends mid-block, on a file system with smaller blocks, keeps those partial blocks
        // as holes rather than risk zeroing a neighbour's data).
        let (a, b) = (hole.div_ceil(bs) * bs, end / bs * bs);
        let mut o = a;
        while o < b {
            let n = (b - o).min(chunk) as usize;
            // SAFETY: `zeros` points at `zeros.len()` ≥ n bytes of a live DMA buffer, which
            // nothing writes (it stays zero); pwrite only reads it.
            let w = unsafe {
                libc::pwrite(
                    fd,
                    zeros.as_ptr() as *const libc::c_void,
                    n,
                    o as libc::off_t,
                )
            };
            if w < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if w == 0 {
                return Err(std::io::Error::other(
                    "zero-length write while filling a hole",
                ));
            }
            o += w as u64;
        }
        written += b.saturating_sub(a);
        at = end.max(hole + 1);
    }
    Ok(written)
}

/// A file or block device. Cheap to share: queues hold an `Arc` of the open file.
pub struct FileDevice {
    inner: Arc<Inner>,
}

static URING_FALLBACK_LOGGED: Once = Once::new();
static BUFFERED_FALLBACK_LOGGED: Once = Once::new();

impl FileDevice {
    /// IO counters over every queue of this device.
    pub fn io_stats(&self) -> crate::iostats::IoStats {
        self.inner.io.snapshot()
    }

    /// Create (or truncate) a sparse regular file of `size_bytes` and open it.
    pub fn create(path: &Path, size_bytes: u64, opts: FileOptions) -> Result<Self> {
        let name: Arc<str> = path.display().to_string().into();
        let io = |what| {
            let name = name.clone();
            move |source| Error::Io {
                device: name,
                what,
                source,
            }
        };
        // Created if missing but not truncated yet: a file another opener holds is refused
        // (below, by its lock) before anything in it changes.
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io("create"))?;
        Self::open_sized(path, opts, Some(size_bytes))
    }

    /// Open an existing file or block device.
    pub fn open(path: &Path, opts: FileOptions) -> Result<Self> {
        Self::open_sized(path, opts, None)
    }

    /// Open `path`; with `resize`, a regular file is then emptied and sized to that many bytes
    /// (once its lock is held).
    fn open_sized(path: &Path, opts: FileOptions, resize: Option<u64>) -> Result<Self> {
        let name: Arc<str> = path.display().to_string().into();
        let io_err = |what: &'static str, source| Error::Io {
            device: name.clone(),
            what,
            source,
        };
        check_options(&name, &opts)?;
        let block_dev = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
        let lock = if opts.exclusive {
            Some(hold(path, block_dev, &name)?)
        } else {
            None
        };
        let file = open_file(path, opts.direct).map_err(|e| io_err("open", e))?;
        if let Some(size) = resize.filter(|_| !block_dev) {
            file.set_len(0)
                .and_then(|()| file.set_len(size))
                .map_err(|e| io_err("set length", e))?;
        }
        let meta = file.metadata().map_err(|e| io_err("stat", e))?;
        let bytes = if meta.file_type().is_block_device() {
            block_device_size(&file).map_err(|e| io_err("BLKGETSIZE64", e))?
        } else {
            meta.len()
        };
        let engine = resolve_engine(&name, opts.engine)?;
        let geometry = Geometry {
            block_size: opts.block_size,
            capacity_blocks: bytes / opts.block_size as u64,
            max_transfer_bytes: opts.max_transfer_bytes,
            queue_depth: opts.queue_depth,
            queue_count: opts.queue_count,
            volatile_write_cache: true,
            atomic_write_bytes: opts.block_size.min(4096),
            dma_alignment: DIRECT_ALIGN_BYTES,
        };
        Ok(FileDevice {
            inner: Arc::new(Inner {
                file,
                _lock: lock,
                name,
                geometry,
                engine,
                open_queues: AtomicU32::new(0),
                memory: HostMemory::new(BUF_ALIGN_BYTES),
                io: crate::iostats::IoCounters::default(),
                prefill: (!meta.file_type().is_block_device()).then(|| Prefill::new(bytes)),
            }),
        })
    }

    /// Write every block of a regular file once: zeros into each of its holes (and into
    /// unwritten extents, which the file system reports as holes), then `fdatasync`. Returns
    /// the bytes written: 0 for a block device or a file already written throughout.
    ///
    /// A block device's blocks are all there; a sparse file's are allocated by the file system
    /// as they are first written, and a durable write or flush then waits for the file
    /// system's journal to record the allocation. A file written once never pays that again
    /// (the store writes no holes back: it never deallocates). The content does not change:
    /// holes read as zeros. Call it before any queue is open (refused otherwise): zeros
    /// written into a hole must not race a request's data to the same blocks.
    pub fn allocate(&self) -> Result<u64> {
        let dev = &self.inner;
        let Some(p) = &dev.prefill else {
            return Ok(0);
        };
        let open = dev.open_queues.load(Ordering::Acquire);
        if open != 0 {
            return Err(Error::Invalid {
                device: dev.name.clone(),
                detail: format!("allocate needs every queue closed; {open} open"),
            });
        }
        let io_err = |what, source| Error::Io {
            device: dev.name.clone(),
            what,
            source,
        };
        // Holding the fill lock keeps small writes' fills out while this one runs.
        let mut st = p.st.lock().unwrap();
        let zeros = dev
            .memory
            .alloc(ALLOCATE_WRITE_BYTES)
            .ok_or_else(|| Error::NoMemory {
                device: dev.name.clone(),
                len: ALLOCATE_WRITE_BYTES,
                detail: "a buffer of zeros to allocate the file with".into(),
            })?;
        let n = fill_holes(dev, 0, dev.size_bytes(), &zeros)
            .map_err(|e| io_err("write zeros into holes", e))?;
        dev.file.sync_data().map_err(|e| io_err("fdatasync", e))?;
        st.filled.iter_mut().for_each(|f| *f = true);
        Ok(n)
    }

    /// Regions whose holes were filled ahead of small writes, and the zero bytes written for
    /// it (see the module docs).
    pub fn prefill_stats(&self) -> (u64, u64) {
        self.inner.prefill.as_ref().map_or((0, 0), |p| {
            (
                p.regions_filled.load(Ordering::Relaxed),
                p.bytes_filled.load(Ordering::Relaxed),
            )
        })
    }

    /// The engine actually in use (never `Auto`).
    pub fn engine(&self) -> Engine {
        self.inner.engine
    }
}

fn check_options(name: &Arc<str>, o: &FileOptions) -> Result<()> {
    let bad = |detail: String| {
        Err(Error::Invalid {
            device: name.clone(),
            detail,
        })
    };
    if !o.block_size.is_power_of_two() || o.block_size < 512 {
        return bad(format!(
            "block size {} must be a power of two ≥ 512",
            o.block_size
        ));
    }
    if o.max_transfer_bytes < o.block_size || !o.max_transfer_bytes.is_multiple_of(o.block_size) {
        return bad(format!(
            "max transfer {} must be a positive multiple of the block size {}",
            o.max_transfer_bytes, o.block_size
        ));
    }
    if o.queue_depth == 0 || o.queue_depth > 4096 || o.queue_count == 0 {
        return bad(format!(
            "queue depth {} must be 1..=4096 and queue count {} at least 1",
            o.queue_depth, o.queue_count
        ));
    }
    Ok(())
}

/// How long an open waits for another holder of the device to let go before it reports the
/// device in use.
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// The descriptor that holds a device alone (`FileOptions::exclusive`): opened apart from the
/// one IO goes through, so closing it releases the device at once — the IO descriptor is
/// registered with the queues' io_uring instances, which the kernel tears down (and lets go
/// of the file) only some time after they are closed. Held with an exclusive `flock`, and
/// for a block device opened with `O_EXCL`.
fn hold(path: &Path, block_dev: bool, name: &Arc<str>) -> Result<File> {
    let io = |what, source| Error::Io {
        device: name.clone(),
        what,
        source,
    };
    // A holder that is exiting lets go within moments (its last thread closes its files):
    // only a device still held after LOCK_WAIT is in use.
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        let busy = match OpenOptions::new()
            .read(true)
            .custom_flags(if block_dev { libc::O_EXCL } else { 0 })
            .open(path)
        {
            Err(e) if block_dev && e.raw_os_error() == Some(libc::EBUSY) => {
                "the kernel reports the block device busy (mounted, or held by another program)"
            }
            Err(e) => return Err(io("open", e)),
            // SAFETY: flock on a descriptor this File owns; no memory is passed.
            Ok(f) => match unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } {
                0 => return Ok(f),
                _ => {
                    let e = std::io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EWOULDBLOCK) => {
                            "another opener holds it (a running node, or a store tool); stop \
                             that first"
                        }
                        // A file system without locks (some FUSE ones) must not keep a node
                        // down: it runs unguarded, and says so.
                        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS) => {
                            tracing::warn!(
                                device = %name,
                                error = %e,
                                "the file system cannot lock the device file: another opener \
                                 is not refused"
                            );
                            return Ok(f);
                        }
                        _ => return Err(io("lock", e)),
                    }
                }
            },
        };
        if Instant::now() >= deadline {
            return Err(Error::InUse {
                device: name.clone(),
                detail: busy.into(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Open `path` read-write, with O_DIRECT when `direct` (falling back to buffered IO where the
/// file system refuses it).
fn open_file(path: &Path, direct: bool) -> std::io::Result<File> {
    let plain = || OpenOptions::new().read(true).write(true).open(path);
    if !direct {
        return plain();
    }
    match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            BUFFERED_FALLBACK_LOGGED.call_once(|| {
                tracing::warn!(
                    path = %path.display(),
                    "file system refuses O_DIRECT; using buffered IO (durability via fdatasync)"
                )
            });
            plain()
        }
        other => other,
    }
}

fn block_device_size(file: &File) -> std::io::Result<u64> {
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at a live local.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut bytes as *mut u64) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(bytes)
}

fn resolve_engine(name: &Arc<str>, want: Engine) -> Result<Engine> {
    if want == Engine::Sync {
        return Ok(Engine::Sync);
    }
    match IoUring::new(4) {
        Ok(_) => Ok(Engine::IoUring),
        Err(source) if want == Engine::IoUring => Err(Error::Io {
            device: name.clone(),
            what: "io_uring setup",
            source,
        }),
        Err(e) => {
            URING_FALLBACK_LOGGED.call_once(
                || tracing::warn!(error = %e, "io_uring unavailable; FileDevice uses pread/pwrite"),
            );
            Ok(Engine::Sync)
        }
    }
}

impl BlockDevice for FileDevice {
    type Queue = FileQueue;

    fn name(&self) -> &Arc<str> {
        &self.inner.name
    }

    fn geometry(&self) -> &Geometry {
        &self.inner.geometry
    }

    fn open_queue(&self) -> Result<FileQueue> {
        let count = self.inner.geometry.queue_count;
        let taken = self
            .inner
            .open_queues
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < count).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(Error::NoQueue {
                device: self.inner.name.clone(),
                count,
            });
        }
        FileQueue::new(self.inner.clone()).inspect_err(|_| {
            self.inner.open_queues.fetch_sub(1, Ordering::AcqRel);
        })
    }

    fn alloc_buf(&self, len: usize) -> Result<DmaBuf> {
        let m = self.inner.memory.alloc(len);
        m.ok_or_else(|| Error::no_host_memory(&self.inner.name, len))
    }

    fn alloc_read_buf(&self, len: usize) -> Result<DmaBuf> {
        let m = self.inner.memory.alloc_for_read(len);
        m.ok_or_else(|| Error::no_host_memory(&self.inner.name, len))
    }
}

/// One in-flight request, indexed by its slot number (the io_uring user_data).
struct Slot {
    req: Option<Request>,
    /// Bytes a read or write must transfer; 0 for other ops.
    expect: usize,
}

enum Ring {
    /// Created lazily by the first thread that uses the queue (see [`UringState`]).
    Uring(Box<UringState>),
    /// Every request runs synchronously at submit (its result waits in `FileQueue::ready`).
    Sync,
}

/// Durable writes up to this size, and flushes, run on the submitting thread when nothing
/// else is in flight on the queue (see [`FileQueue::runs_inline`]).
const INLINE_DURABLE_BYTES_MAX: u64 = 128 << 10;

/// An io_uring set up like fio's: COOP_TASKRUN, and SINGLE_ISSUER + DEFER_TASKRUN when the
/// kernel has them, so completion work runs in batches when we reap instead of interrupting us.
/// SINGLE_ISSUER ties the ring to the thread that created it, so the ring is created on first
/// use, and rebuilt if an idle handle has moved to another thread.
struct UringState {
    ring: Option<IoUring>,
    owner: Option<std::thread::ThreadId>,
    deferred: bool,
}

/// A queue handle: one io_uring instance (or the synchronous fallback) owned by one thread.
pub struct FileQueue {
    dev: Arc<Inner>,
    ring: Ring,
    slots: Vec<Slot>,
    free: Vec<u32>,
    unsubmitted: usize,
    /// (slot, result) of requests already executed synchronously at submit; the slot stays
    /// taken until the completion is polled, so queue-full behaves as with a real queue.
    ready: VecDeque<(u32, i64)>,
}

impl FileQueue {
    fn new(dev: Arc<Inner>) -> Result<Self> {
        let depth = dev.geometry.queue_depth as usize;
        let ring = match dev.engine {
            Engine::Sync => Ring::Sync,
            _ => Ring::Uring(Box::new(UringState {
                ring: None,
                owner: None,
                deferred: false,
            })),
        };
        Ok(FileQueue {
            slots: (0..depth)
                .map(|_| Slot {
                    req: None,
                    expect: 0,
                })
                .collect(),
            free: (0..depth as u32).rev().collect(),
            dev,
            ring,
            unsubmitted: 0,
            ready: VecDeque::with_capacity(depth),
        })
    }

    /// The ring for the calling thread: created on first use; rebuilt when an idle handle has
    /// moved threads (SINGLE_ISSUER rings refuse other threads). Moving a handle with IO in
    /// flight is refused: its completions belong to the old thread's ring.
    fn uring(&mut self) -> Result<Option<&mut IoUring>> {
        let Ring::Uring(st) = &mut self.ring else {
            return Ok(None);
        };
        let me = std::thread::current().id();
        if st.ring.is_some() && st.owner != Some(me) && st.deferred {
            let in_flight = self.slots.len() - self.free.len();
            if in_flight > 0 {
                return Err(Error::Invalid {
                    device: self.dev.name.clone(),
                    detail: format!(
                        "queue handle moved to another thread with {in_flight} requests in flight"
                    ),
                });
            }
            st.ring = None;
        }
        if st.ring.is_none() {
            let (ring, deferred) = new_ring(&self.dev, self.slots.len())?;
            st.ring = Some(ring);
            st.deferred = deferred;
            st.owner = Some(me);
        }
        Ok(st.ring.as_mut())
    }

    /// Whether `req` runs synchronously on the calling thread. Always with the sync engine.
    /// With io_uring: a durable (FUA) write of at most [`INLINE_DURABLE_BYTES_MAX`] or a
    /// flush, when nothing else is in flight on this queue. The kernel cannot start either
    /// without blocking (O_DIRECT + RWF_DSYNC, fdatasync), so io_uring would hand it to one of
    /// its worker threads and wake us when done: two context switches per request, and
    /// nothing to overlap it with. (Measured on the 8-node bench cluster, where every store
    /// commit round is one small FUA write: 4 KiB writes +20 %.) Larger writes, and anything
    /// submitted while other IO is in flight, go through the ring and overlap.
    fn runs_inline(&self, req: &Request) -> bool {
        match self.ring {
            Ring::Sync => true,
            Ring::Uring(_) => {
                // The slot for `req` is not taken yet; ready requests are already done.
                let idle = self.in_flight() == self.ready.len() && self.unsubmitted == 0;
                idle && match req.op {
                    Op::Write { fua: true } => {
                        req.blocks as u64 * self.dev.geometry.block_size as u64
                            <= INLINE_DURABLE_BYTES_MAX
                    }
                    Op::Flush => true,
                    _ => false,
                }
            }
        }
    }

    fn io_error(&self, what: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            device: self.dev.name.clone(),
            what,
            source,
        }
    }

    fn complete(&mut self, slot: u32, res: i64) -> Completion {
        let s = &mut self.slots[slot as usize];
        let req = s.req.take().expect("completion for an empty slot");
        let expect = s.expect;
        self.free.push(slot);
        if let (Some(p), Op::Write { .. }) = (&self.dev.prefill, req.op) {
            let bs = self.dev.geometry.block_size as u64;
            p.after_write(req.lba * bs, req.blocks as u64 * bs);
        }
        let result = if res < 0 {
            Err(self.io_error(
                req.op.name(),
                std::io::Error::from_raw_os_error(-res as i32),
            ))
        } else if req.op.has_data() && res as usize != expect {
            Err(Error::Media {
                device: self.dev.name.clone(),
                op: req.op.name(),
                lba: req.lba,
                blocks: req.blocks,
                detail: format!("short transfer: {res} of {expect} bytes"),
            })
        } else {
            Ok(())
        };
        self.dev.io.completed(result.is_ok());
        Completion {
            tag: req.tag,
            op: req.op,
            result,
            buf: req.buf,
        }
    }

    fn reap(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let next = self.ready.pop_front().or_else(|| match &mut self.ring {
                Ring::Uring(st) => st.ring.as_mut().and_then(|ring| {
                    ring.completion()
                        .next()
                        .map(|cqe| (cqe.user_data() as u32, cqe.result() as i64))
                }),
                Ring::Sync => None,
            });
            let Some((slot, res)) = next else { break };
            out[n] = self.complete(slot, res);
            n += 1;
        }
        n
    }
}

/// Set up a ring for `depth` requests with the fio-like flags, falling back flag by flag on
/// kernels that refuse them. Returns the ring and whether DEFER_TASKRUN is on.
fn new_ring(dev: &Inner, depth: usize) -> Result<(IoUring, bool)> {
    let io = |what, source| Error::Io {
        device: dev.name.clone(),
        what,
        source,
    };
    let build = |defer: bool, coop: bool| {
        let mut b = IoUring::builder();
        b.setup_cqsize(2 * depth as u32);
        if coop {
            b.setup_coop_taskrun();
        }
        if defer {
            b.setup_single_issuer()
                .setup_defer_taskrun()
                .setup_taskrun_flag();
        }
        b.build(depth as u32)
    };
    let (ring, deferred) = match build(true, true) {
        Ok(r) => (r, true),
        Err(_) => match build(false, true) {
            Ok(r) => (r, false),
            Err(_) => (
                build(false, false).map_err(|e| io("io_uring setup", e))?,
                false,
            ),
        },
    };
    ring.submitter()
        .register_files(&[dev.file.as_raw_fd()])
        .map_err(|e| io("io_uring register file", e))?;
    Ok((ring, deferred))
}

/// Build the io_uring entry for a validated request in `slot`.
fn sqe_for(req: &Request, bs: u64, slot: u32) -> io_uring::squeue::Entry {
    let fd = types::Fixed(0);
    let offset = req.lba * bs;
    let len = req.blocks as u64 * bs;
    let buf_ptr = || {
        let buf = req
            .buf
            .as_ref()
            .expect("validated data request has a buffer");
        // SAFETY: validate() checked buf_offset + len <= buf.len(); the pointer stays valid
        // because the buffer lives in the slot until the completion is reaped.
        unsafe { buf.as_ptr().add(req.buf_offset) as *mut u8 }
    };
    let entry = match req.op {
        Op::Read => opcode::Read::new(fd, buf_ptr(), len as u32)
            .offset(offset)
            .build(),
        Op::Write { fua } => opcode::Write::new(fd, buf_ptr(), len as u32)
            .offset(offset)
            .rw_flags(if fua { libc::RWF_DSYNC } else { 0 })
            .build(),
        Op::Flush => opcode::Fsync::new(fd)
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
        Op::WriteZeroes => opcode::Fallocate::new(fd, len)
            .offset(offset)
            .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
            .build(),
        Op::Deallocate => opcode::Fallocate::new(fd, len)
            .offset(offset)
            .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
            .build(),
    };
    entry.user_data(slot as u64)
}

/// Execute a validated request with plain syscalls; returns bytes moved or -errno.
fn execute_sync(file: &File, req: &Request, bs: u64) -> i64 {
    let fd = file.as_raw_fd();
    let offset = (req.lba * bs) as libc::off_t;
    let len = req.blocks as u64 * bs;
    let ptr = req
        .buf
        .as_ref()
        // SAFETY: validate() checked buf_offset + len <= buf.len().
        .map(|b| unsafe { b.as_ptr().add(req.buf_offset) as *mut libc::c_void });
    // SAFETY: each call gets a valid fd and, for data ops, a pointer to at least `len` bytes
    // of memory this queue owns for the duration of the call.
    let rc = unsafe {
        match req.op {
            Op::Read => libc::pread(fd, ptr.unwrap(), len as usize, offset) as i64,
            Op::Write { fua } => {
                let iov = libc::iovec {
                    iov_base: ptr.unwrap(),
                    iov_len: len as usize,
                };
                let flags = if fua { libc::RWF_DSYNC } else { 0 };
                libc::pwritev2(fd, &iov, 1, offset, flags) as i64
            }
            Op::Flush => libc::fdatasync(fd) as i64,
            Op::WriteZeroes => libc::fallocate(
                fd,
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len as libc::off_t,
            ) as i64,
            Op::Deallocate => libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len as libc::off_t,
            ) as i64,
        }
    };
    if rc < 0 {
        -(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO) as i64)
    } else {
        rc
    }
}

impl QueueHandle for FileQueue {
    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        if let Err(e) = req.validate(&self.dev.name, &self.dev.geometry) {
            return Err(SubmitError::rejected(e, req));
        }
        if self.free.is_empty() {
            return Err(SubmitError::full(req));
        }
        // Before taking a slot: the ring check counts the requests in flight.
        if let Err(e) = self.uring() {
            return Err(SubmitError::rejected(e, req));
        }
        let inline = self.runs_inline(&req);
        let slot = self.free.pop().expect("checked non-empty");
        let bs = self.dev.geometry.block_size as u64;
        if let Some(p) = &self.dev.prefill {
            match req.op {
                Op::Write { fua } => {
                    p.before_write(&self.dev, req.lba * bs, req.blocks as u64 * bs, fua)
                }
                Op::WriteZeroes | Op::Deallocate => p.forget(req.lba * bs, req.blocks as u64 * bs),
                _ => {}
            }
        }
        let expect = if req.op.has_data() {
            (req.blocks as u64 * bs) as usize
        } else {
            0
        };
        self.dev.io.submitted(req.op, expect as u64);
        let ring = match &mut self.ring {
            Ring::Uring(st) if !inline => st.ring.as_mut(),
            _ => None,
        };
        match ring {
            Some(ring) => {
                let sqe = sqe_for(&req, bs, slot);
                // SAFETY: the entry's buffer pointer stays valid until its completion is reaped
                // (the request is parked in `slots[slot]`); the SQ has `depth` entries and at
                // most `depth` slots are in use, so the push cannot overflow.
                let pushed = unsafe { ring.submission().push(&sqe) };
                pushed.expect("submission queue sized to the queue depth");
                self.unsubmitted += 1;
                self.slots[slot as usize] = Slot {
                    req: Some(req),
                    expect,
                };
            }
            None => {
                let res = execute_sync(&self.dev.file, &req, bs);
                self.ready.push_back((slot, res));
                self.slots[slot as usize] = Slot {
                    req: Some(req),
                    expect,
                };
            }
        }
        Ok(())
    }

    fn kick(&mut self) -> Result<()> {
        let in_flight = self.in_flight();
        let unsubmitted = self.unsubmitted;
        let Some(ring) = self.uring()? else {
            return Ok(());
        };
        // With DEFER_TASKRUN, completions are only posted when we enter with GETEVENTS, which
        // `submit` does when the kernel flags pending task work.
        let pending_work = in_flight > 0 && ring.submission().taskrun();
        if unsubmitted == 0 && !pending_work {
            return Ok(());
        }
        if let Err(e) = ring.submit() {
            return Err(self.io_error("io_uring submit", e));
        }
        self.unsubmitted = 0;
        Ok(())
    }

    fn poll(&mut self, out: &mut [Completion]) -> Result<usize> {
        self.kick()?;
        Ok(self.reap(out))
    }

    fn wait(&mut self, out: &mut [Completion], min: usize, timeout: Duration) -> Result<usize> {
        let min = min.min(out.len()).min(self.in_flight());
        let deadline = Instant::now() + timeout;
        let mut got = self.reap(out);
        while got < min {
            let now = Instant::now();
            if now >= deadline {
                self.kick()?;
                return Err(Error::Timeout {
                    device: self.dev.name.clone(),
                    what: "io_uring completions",
                    timeout,
                });
            }
            if let Some(ring) = self.uring()? {
                // One io_uring_enter both submits what is queued and waits.
                let left = deadline - now;
                let ts = types::Timespec::new()
                    .sec(left.as_secs())
                    .nsec(left.subsec_nanos());
                let args = types::SubmitArgs::new().timespec(&ts);
                match ring.submitter().submit_with_args(min - got, &args) {
                    Ok(_) => self.unsubmitted = 0,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {
                        self.unsubmitted = 0
                    }
                    Err(e) => return Err(self.io_error("io_uring wait", e)),
                }
            }
            got += self.reap(&mut out[got..]);
        }
        self.kick()?;
        Ok(got)
    }

    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn depth(&self) -> usize {
        self.slots.len()
    }
}

impl Drop for FileQueue {
    fn drop(&mut self) {
        // The kernel may still be writing into buffers of in-flight requests: wait for them.
        // If they never finish, leak the buffers rather than free memory the kernel may write.
        let mut out: [Completion; 8] = Default::default();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.in_flight() > 0 && Instant::now() < deadline {
            match self.wait(&mut out, 1, Duration::from_secs(1)) {
                Ok(_) | Err(Error::Timeout { .. }) => {}
                Err(_) => break,
            }
        }
        if self.in_flight() > 0 {
            tracing::error!(device = %self.dev.name, n = self.in_flight(),
                "queue dropped with IO still in flight; leaking its buffers");
            for s in &mut self.slots {
                if let Some(req) = s.req.take() {
                    std::mem::forget(req);
                }
            }
        }
        self.dev.open_queues.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Request;

    /// A device is held alone while open: a second open, or a create over it, is refused
    /// with `InUse` and changes nothing; an open with `exclusive` off is let through (a raw
    /// reader beside the owner); once the owner is dropped the file opens again.
    #[test]
    fn an_open_device_is_refused_to_a_second_opener_and_its_bytes_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.img");
        let dev = FileDevice::create(&path, 1 << 20, FileOptions::default()).unwrap();
        let mut q = dev.open_queue().unwrap();
        let mut buf = dev.alloc_buf(4096).unwrap();
        buf.write_at(0, &[0xa5; 4096]);
        let c = crate::io::execute(
            &mut q,
            Request::write(3, 1, buf, 0, true, 1),
            Duration::from_secs(30),
        );
        c.result.unwrap();
        for e in [
            FileDevice::open(&path, FileOptions::default()).err(),
            FileDevice::create(&path, 2 << 20, FileOptions::default()).err(),
        ] {
            let e = e.expect("refused while the first device is open");
            assert!(matches!(e, Error::InUse { .. }), "got {e}");
            assert!(
                e.to_string().contains("in use: another opener holds it"),
                "{e}"
            );
        }
        let beside = FileOptions {
            exclusive: false,
            ..FileOptions::default()
        };
        let raw = FileDevice::open(&path, beside).unwrap();
        assert_eq!(raw.geometry().capacity_bytes(), 1 << 20, "not truncated");
        let mut rq = raw.open_queue().unwrap();
        let rbuf = raw.alloc_read_buf(4096).unwrap();
        let c = crate::io::execute(
            &mut rq,
            Request::read(3, 1, rbuf, 0, 2),
            Duration::from_secs(30),
        );
        assert!(
            c.buf.unwrap().eq_at(0, &[0xa5; 4096]),
            "the held device's bytes are intact"
        );
        drop((q, rq, raw, dev));
        let again = FileDevice::open(&path, FileOptions::default()).unwrap();
        assert_eq!(again.geometry().capacity_bytes(), 1 << 20);
        // A holder that lets go while the open waits (a process exiting) is waited for.
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(again);
        });
        FileDevice::open(&path, FileOptions::default()).expect("opened once the holder let go");
        letting_go.join().unwrap();
    }

    /// A 16 MiB sparse file through io_uring, and the directory that holds it.
    fn uring_dev() -> (tempfile::TempDir, FileDevice) {
        let dir = tempfile::tempdir().unwrap();
        let opts = FileOptions {
            engine: Engine::IoUring,
            ..FileOptions::default()
        };
        let dev = FileDevice::create(&dir.path().join("d.img"), 16 << 20, opts).unwrap();
        (dir, dev)
    }

    fn fill(dev: &FileDevice, len: usize, byte: u8) -> DmaBuf {
        let mut b = dev.alloc_buf(len).unwrap();
        b.write_at(0, &vec![byte; len]);
        b
    }

    /// Small durable writes and flushes on an idle io_uring queue complete on the calling
    /// thread; big writes, and anything submitted while IO is in flight, go through the ring.
    /// Every one completes once, with its own tag, and the bytes land.
    #[test]
    fn small_durable_requests_run_inline_only_on_an_idle_queue() {
        let (_dir, dev) = uring_dev();
        let mut q = dev.open_queue().unwrap();
        let mut out: [Completion; 8] = Default::default();
        // Idle: a 4 KiB FUA write is done when submit returns.
        q.submit(Request::write(0, 1, fill(&dev, 4096, 1), 0, true, 1))
            .map_err(|e| e.kind)
            .unwrap();
        assert_eq!((q.ready.len(), q.unsubmitted), (1, 0));
        // Busy with it (not reaped yet)? It is done, so the queue counts as idle: a flush too.
        q.submit(Request::flush(2)).map_err(|e| e.kind).unwrap();
        assert_eq!(q.ready.len(), 2);
        assert_eq!(q.wait(&mut out, 2, Duration::from_secs(5)).unwrap(), 2);
        assert_eq!([out[0].tag, out[1].tag], [1, 2]);
        assert!(out[..2].iter().all(|c| c.result.is_ok()));
        // Too big to run inline, and a plain write never does.
        let big = (INLINE_DURABLE_BYTES_MAX as usize) * 2;
        q.submit(Request::write(
            8,
            (big / 4096) as u32,
            fill(&dev, big, 2),
            0,
            true,
            3,
        ))
        .map_err(|e| e.kind)
        .unwrap();
        assert_eq!((q.ready.len(), q.unsubmitted), (0, 1));
        // In flight through the ring: a small FUA write now joins it there.
        q.submit(Request::write(1, 1, fill(&dev, 4096, 3), 0, true, 4))
            .map_err(|e| e.kind)
            .unwrap();
        assert_eq!((q.ready.len(), q.unsubmitted), (0, 2));
        let mut tags = Vec::new();
        while tags.len() < 2 {
            let n = q.wait(&mut out, 1, Duration::from_secs(5)).unwrap();
            for c in &out[..n] {
                assert!(c.result.is_ok());
                tags.push(c.tag);
            }
        }
        tags.sort();
        assert_eq!(tags, [3, 4]);
        q.submit(Request::write(2, 1, fill(&dev, 4096, 4), 0, false, 5))
            .map_err(|e| e.kind)
            .unwrap();
        assert_eq!((q.ready.len(), q.unsubmitted), (0, 1));
        assert_eq!(q.wait(&mut out, 1, Duration::from_secs(5)).unwrap(), 1);
        // What the file holds, read back through the ring.
        let total = 8 * 4096 + big;
        let mut rd = dev.alloc_buf(total).unwrap();
        rd.write_at(0, &vec![0xAA; total]);
        let blocks = (total / 4096) as u32;
        q.submit(Request::read(0, blocks, rd, 0, 6))
            .map_err(|e| e.kind)
            .unwrap();
        assert_eq!(q.wait(&mut out, 1, Duration::from_secs(5)).unwrap(), 1);
        let rd = out[0].buf.take().unwrap();
        let mut got = vec![0u8; total];
        rd.read_at(0, &mut got);
        assert!(got[..4096].iter().all(|&b| b == 1));
        assert!(got[4096..8192].iter().all(|&b| b == 3));
        assert!(got[8192..12288].iter().all(|&b| b == 4));
        assert!(got[8 * 4096..8 * 4096 + big].iter().all(|&b| b == 2));
    }

    fn holes_in(dev: &FileDevice, lo: u64, hi: u64) -> bool {
        let fd = dev.inner.file.as_raw_fd();
        // SAFETY: lseek on an open fd.
        let h = unsafe { libc::lseek(fd, lo as libc::off_t, libc::SEEK_HOLE) };
        (h as u64) < hi
    }

    /// A small FUA write into a hole fills its 1 MiB region with zeros first (content
    /// unchanged: holes read as zeros); large, plain, and overlapping-in-flight writes do not;
    /// a punched region is filled again.
    #[test]
    fn small_durable_writes_fill_their_region_first() {
        let (dir, dev) = uring_dev();
        let mut q = dev.open_queue().unwrap();
        let mut out: [Completion; 8] = Default::default();
        let run = |q: &mut FileQueue, req: Request| {
            let mut out: [Completion; 1] = Default::default();
            q.submit(req).map_err(|e| e.kind).unwrap();
            q.wait(&mut out, 1, Duration::from_secs(5)).unwrap();
            assert!(out[0].result.is_ok());
        };
        let mib = 1u64 << 20;
        assert!(holes_in(&dev, 5 * mib, 6 * mib));
        // 4 KiB FUA write at 5 MiB + 8 KiB: region 5 is filled.
        run(
            &mut q,
            Request::write((5 * mib + 8192) / 4096, 1, fill(&dev, 4096, 7), 0, true, 1),
        );
        assert_eq!(dev.prefill_stats(), (1, mib));
        assert!(!holes_in(&dev, 5 * mib, 6 * mib));
        let mut got = vec![0xAAu8; mib as usize];
        let f = std::fs::File::open(dir.path().join("d.img")).unwrap();
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, 5 * mib).unwrap();
        assert!(got[..8192].iter().all(|&b| b == 0));
        assert!(got[8192..12288].iter().all(|&b| b == 7));
        assert!(got[12288..].iter().all(|&b| b == 0));
        // A second small write there fills nothing more.
        run(
            &mut q,
            Request::write(5 * mib / 4096, 1, fill(&dev, 4096, 8), 0, true, 2),
        );
        assert_eq!(dev.prefill_stats(), (1, mib));
        // A plain small write and a large FUA write allocate for themselves.
        run(
            &mut q,
            Request::write(7 * mib / 4096, 1, fill(&dev, 4096, 1), 0, false, 3),
        );
        run(
            &mut q,
            Request::write(9 * mib / 4096, 64, fill(&dev, 256 << 10, 1), 0, true, 4),
        );
        assert_eq!(dev.prefill_stats().0, 1);
        assert!(holes_in(&dev, 7 * mib, 8 * mib) && holes_in(&dev, 9 * mib, 10 * mib));
        // While a write is in flight in a region, a small FUA write there does not fill it.
        q.submit(Request::write(
            11 * mib / 4096,
            64,
            fill(&dev, 256 << 10, 2),
            0,
            true,
            5,
        ))
        .map_err(|e| e.kind)
        .unwrap();
        q.submit(Request::write(
            (11 * mib + (512 << 10)) / 4096,
            1,
            fill(&dev, 4096, 3),
            0,
            true,
            6,
        ))
        .map_err(|e| e.kind)
        .unwrap();
        let mut done = 0;
        while done < 2 {
            done += q.wait(&mut out, 1, Duration::from_secs(5)).unwrap();
        }
        assert_eq!(dev.prefill_stats().0, 1);
        // Once idle again, it is.
        run(
            &mut q,
            Request::write(
                (11 * mib + (768 << 10)) / 4096,
                1,
                fill(&dev, 4096, 4),
                0,
                true,
                7,
            ),
        );
        assert_eq!(dev.prefill_stats().0, 2);
        assert!(!holes_in(&dev, 11 * mib, 12 * mib));
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, 11 * mib).unwrap();
        assert!(got[..256 << 10].iter().all(|&b| b == 2));
        assert!(got[512 << 10..(512 << 10) + 4096].iter().all(|&b| b == 3));
        assert!(got[768 << 10..(768 << 10) + 4096].iter().all(|&b| b == 4));
        let zero = |r: std::ops::Range<usize>| got[r].iter().all(|&b| b == 0);
        assert!(zero((256 << 10)..(512 << 10)) && zero(((768 << 10) + 4096)..mib as usize));
        // Punched: holes again, and the next small FUA write fills the region again.
        run(
            &mut q,
            Request {
                op: Op::Deallocate,
                lba: 5 * mib / 4096,
                blocks: 256,
                buf: None,
                buf_offset: 0,
                tag: 8,
            },
        );
        assert!(holes_in(&dev, 5 * mib, 6 * mib));
        run(
            &mut q,
            Request::write(5 * mib / 4096, 1, fill(&dev, 4096, 9), 0, true, 9),
        );
        assert_eq!(dev.prefill_stats().0, 3);
        assert!(!holes_in(&dev, 5 * mib, 6 * mib));
    }

    /// `allocate` writes zeros into every hole of a sparse file (more than one of its
    /// largest writes) and keeps what was written; a second call writes nothing; with a
    /// queue open it is refused.
    #[test]
    fn allocate_writes_every_hole_and_keeps_the_data() {
        let dir = tempfile::tempdir().unwrap();
        let size = 20u64 << 20;
        let dev =
            FileDevice::create(&dir.path().join("d.img"), size, FileOptions::default()).unwrap();
        assert!(
            size > 2 * ALLOCATE_WRITE_BYTES as u64,
            "the test wants several writes"
        );
        let mut q = dev.open_queue().unwrap();
        let mut out: [Completion; 1] = Default::default();
        let at = 9 << 20; // inside the second 8 MiB write
        q.submit(Request::write(
            at / 4096,
            2,
            fill(&dev, 8192, 0x3c),
            0,
            true,
            1,
        ))
        .map_err(|e| e.kind)
        .unwrap();
        q.wait(&mut out, 1, Duration::from_secs(5)).unwrap();
        assert!(out[0].result.is_ok());
        let refused = dev.allocate().unwrap_err().to_string();
        assert!(refused.contains("1 open"), "{refused}");
        drop(q);
        assert!(holes_in(&dev, 0, size));
        let written = dev.allocate().unwrap();
        // Everything but the 8 KiB written and the 1 MiB region its FUA write filled first.
        assert_eq!(written, size - (1 << 20));
        assert!(!holes_in(&dev, 0, size));
        let meta = std::fs::metadata(dir.path().join("d.img")).unwrap();
        assert!(std::os::unix::fs::MetadataExt::blocks(&meta) * 512 >= size);
        let f = std::fs::File::open(dir.path().join("d.img")).unwrap();
        let mut got = vec![0xAAu8; size as usize];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, 0).unwrap();
        let (a, b) = (at as usize, at as usize + 8192);
        assert!(got[..a].iter().all(|&x| x == 0) && got[b..].iter().all(|&x| x == 0));
        assert!(got[a..b].iter().all(|&x| x == 0x3c));
        assert_eq!(dev.allocate().unwrap(), 0);
    }
}
