//! mkfs, the label, and opening a store: checkpoint load, log replay, space rebuild.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender};
use driver::BlockDevice;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::commit::{now_ns, Committer};
use crate::error::{Result, StoreError};
use crate::format::{
    round_up, Superblock, FORMAT_VERSION, NO_SEGMENT, SB_FLAG_NO_CHECKPOINTS, SEGMENTS_START_BYTES,
    SEGMENT_CHECKPOINT, SEGMENT_LOG, SUPERBLOCK_MAGIC, SUPERBLOCK_OFFSETS,
};
use crate::key::ObjectKey;
use crate::meta::Record;
use crate::space::{SegState, Segments};
use crate::stream::{read_region, Layout, Pos, Salvage, SkipKind, StreamHead, StreamReader};
use crate::{Shared, Store, StoreConfig};

/// Options for [`mkfs`].
#[derive(Debug, Clone)]
pub struct MkfsOptions {
    pub cluster_fsid: [u8; 16],
    pub node_id: u32,
    /// Random when `None`.
    pub device_uuid: Option<[u8; 16]>,
    pub segment_bytes: u32,
    pub chunk_bytes: u32,
    /// Never checkpoint: every open replays the whole log and the cleaner cannot free space.
    /// For measuring what checkpoints buy; not for real use.
    pub no_checkpoints: bool,
}

impl Default for MkfsOptions {
    fn default() -> Self {
        MkfsOptions {
            cluster_fsid: [0; 16],
            node_id: 0,
            device_uuid: None,
            segment_bytes: 8 << 20,
            chunk_bytes: 64 << 10,
            no_checkpoints: false,
        }
    }
}

/// What a device's label says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub device_uuid: [u8; 16],
    pub cluster_fsid: [u8; 16],
    pub node_id: u32,
    pub block_size: u32,
    pub segment_bytes: u32,
    pub chunk_bytes: u32,
    pub segments: u32,
    pub created_unix_ns: u64,
}

/// Format 16 bytes as a UUID string.
pub struct Uuid<'a>(pub &'a [u8; 16]);

impl fmt::Display for Uuid<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Parse a UUID string (hex with optional dashes).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: String = s.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl Label {
    fn from_sb(sb: &Superblock) -> Self {
        Label {
            device_uuid: sb.device_uuid,
            cluster_fsid: sb.cluster_fsid,
            node_id: sb.node_id.get(),
            block_size: sb.block_size.get(),
            segment_bytes: sb.segment_bytes.get(),
            chunk_bytes: sb.chunk_bytes.get(),
            segments: sb.segment_count.get(),
            created_unix_ns: sb.created_unix_ns.get(),
        }
    }
}

/// What a salvage open got past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SalvageKind {
    /// A data item of an applied batch fails its CRC: reads of it return `Corrupted`.
    DataCrc,
    /// A batch header fails its CRC: the batch was skipped.
    BatchHeader,
    /// A batch's records fail their CRC (or do not decode): the batch was skipped.
    BatchRecords,
    /// A checkpoint batch's header or records fail their CRC: the object states it held were
    /// not loaded (those objects read as their state in the log after the checkpoint, or do
    /// not exist).
    CheckpointBatch,
    /// The checkpoint cannot be read past this point: nothing valid follows a rotten batch
    /// (it is the last one, or the chain broke after it), or a segment header of its chain
    /// fails its CRC. This batch and every later one were not loaded.
    CheckpointChain,
    /// A log segment header fails its CRC: it was rebuilt from the batches the segment holds
    /// (the first verifies as the batch the chain expects there) and written back. Nothing was
    /// lost.
    SegmentHeader,
}

impl fmt::Display for SalvageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SalvageKind::DataCrc => "data-crc",
            SalvageKind::BatchHeader => "batch-header",
            SalvageKind::BatchRecords => "batch-records",
            SalvageKind::CheckpointBatch => "checkpoint-batch",
            SalvageKind::CheckpointChain => "checkpoint-chain",
            SalvageKind::SegmentHeader => "segment-header",
        })
    }
}

/// One problem a salvage open got past ([`crate::Store::salvage_report`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Salvaged {
    pub device: Arc<str>,
    pub kind: SalvageKind,
    /// Absolute byte offset: the data item, or the first skipped batch.
    pub offset: u64,
    /// Bytes: the data item, or the skipped stretch of log.
    pub len: u64,
    /// Batch sequence of the damaged batch (the first one, for a skipped run) in its stream:
    /// the log, or the checkpoint for the checkpoint kinds.
    pub batch_seq: u64,
    /// Batches skipped (0 for a data item: its batch was applied).
    pub batches_skipped: u64,
    /// The CRC the format stores (item, header or records) and the one the bytes give.
    pub expected: u32,
    pub found: u32,
    /// Objects affected, when known: the item's owner; for a skipped batch, the keys its
    /// records name as far as they still read (each record has its own CRC). Such objects
    /// read as their state before the batch (or do not exist).
    pub keys: Vec<ObjectKey>,
    /// Whether `keys` names every object affected. When false, any object of the store may
    /// be: a node treats the whole store as suspect (salvage.rs).
    pub keys_complete: bool,
}

impl SalvageKind {
    fn is_checkpoint(self) -> bool {
        matches!(
            self,
            SalvageKind::CheckpointBatch | SalvageKind::CheckpointChain
        )
    }
}

impl fmt::Display for Salvaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} at byte offset {} ({} bytes, {} batch {}",
            self.device,
            self.kind,
            self.offset,
            self.len,
            if self.kind.is_checkpoint() {
                "checkpoint"
            } else {
                "log"
            },
            self.batch_seq
        )?;
        if self.batches_skipped > 0 {
            write!(f, ", {} batch(es) skipped", self.batches_skipped)?;
        }
        if self.expected == self.found {
            // (A chain that broke at a segment header: no batch CRC to show.)
            f.write_str("): ")?;
        } else {
            write!(
                f,
                "): expected crc32c {:#010x}, found {:#010x}; ",
                self.expected, self.found
            )?;
        }
        if self.kind == SalvageKind::SegmentHeader {
            return f.write_str(
                "no objects affected: the header was rebuilt from the batches the segment holds \
                 and written back",
            );
        }
        if self.keys.is_empty() {
            return f.write_str("objects affected unknown");
        }
        f.write_str("objects ")?;
        for (i, k) in self.keys.iter().take(8).enumerate() {
            write!(f, "{}{k}", if i > 0 { ", " } else { "" })?;
        }
        if self.keys.len() > 8 {
            write!(f, " and {} more", self.keys.len() - 8)?;
        }
        if !self.keys_complete {
            f.write_str(", and others that no longer read")?;
        }
        Ok(())
    }
}

/// What an open found and how long it took.
#[derive(Debug, Clone, Default)]
pub struct OpenReport {
    pub objects: u64,
    pub checkpoint_objects: u64,
    pub checkpoint_bytes: u64,
    pub replayed_batches: u64,
    pub replayed_bytes: u64,
    pub elapsed: Duration,
    /// Problems a salvage open got past (also [`crate::Store::salvage_report`]).
    pub salvaged: Vec<Salvaged>,
}

impl fmt::Display for OpenReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "opened in {:.3} s: {} objects ({} from checkpoint, {:.1} MiB), replayed {} batches / {:.1} MiB of log",
            self.elapsed.as_secs_f64(),
            self.objects,
            self.checkpoint_objects,
            self.checkpoint_bytes as f64 / 1048576.0,
            self.replayed_batches,
            self.replayed_bytes as f64 / 1048576.0
        )?;
        if !self.salvaged.is_empty() {
            write!(
                f,
                "; SALVAGED past {} damaged place(s) in the checkpoint or log",
                self.salvaged.len()
            )?;
        }
        Ok(())
    }
}

/// Label a device and write an empty store on it. Destroys whatever the device held.
pub fn mkfs<D: BlockDevice>(dev: &D, opts: &MkfsOptions) -> Result<Label> {
    let geo = dev.geometry();
    let bad = |detail: String| StoreError::Format {
        device: dev.name().clone(),
        detail,
    };
    let block = geo.block_size;
    if block > 4096 {
        return Err(bad(format!(
            "block size {block} is larger than the 4096 the format supports"
        )));
    }
    if !opts.segment_bytes.is_power_of_two() || opts.segment_bytes < (1 << 20) {
        return Err(bad(format!(
            "segment size {} must be a power of two ≥ 1 MiB",
            opts.segment_bytes
        )));
    }
    if !opts.chunk_bytes.is_power_of_two()
        || opts.chunk_bytes < block
        || opts.chunk_bytes > geo.max_transfer_bytes
        || opts.chunk_bytes as u64 * 8 > opts.segment_bytes as u64
    {
        return Err(bad(format!(
            "chunk size {} must be a power of two between the block size and the max transfer, \
             and at most 1/8 of a segment",
            opts.chunk_bytes
        )));
    }
    let cap = geo.capacity_bytes();
    let segments = cap.saturating_sub(SEGMENTS_START_BYTES) / opts.segment_bytes as u64;
    if segments < 8 {
        return Err(bad(format!(
            "device of {} bytes holds {segments} segments of {} bytes; at least 8 are needed",
            cap, opts.segment_bytes
        )));
    }
    let mut sb = Superblock::new_zeroed();
    sb.magic = SUPERBLOCK_MAGIC;
    sb.format_version = FORMAT_VERSION.into();
    sb.block_size = block.into();
    sb.device_uuid = opts.device_uuid.unwrap_or_else(rand::random);
    sb.cluster_fsid = opts.cluster_fsid;
    sb.node_id = opts.node_id.into();
    sb.segment_bytes = opts.segment_bytes.into();
    sb.chunk_bytes = opts.chunk_bytes.into();
    sb.segment_count = (segments.min(u32::MAX as u64 - 1) as u32).into();
    sb.log_id = (rand::random::<u64>() | 1).into();
    sb.created_unix_ns = now_ns().into();
    sb.flags = (if opts.no_checkpoints {
        SB_FLAG_NO_CHECKPOINTS
    } else {
        0
    })
    .into();
    sb.ckpt_segment = NO_SEGMENT.into();
    sb.replay_segment = 0.into();
    sb.replay_offset = 0.into();
    sb.replay_batch_seq = 1.into();
    sb.replay_segment_seq = 1.into();
    sb.next_op_seq = 1.into();
    let mut q = dev.open_queue()?;
    for seq in [1u64, 2] {
        sb.sb_seq = seq.into();
        sb.seal();
        let at = SUPERBLOCK_OFFSETS[(seq % 2) as usize];
        let mut block_img = vec![0u8; block as usize];
        block_img[..256].copy_from_slice(sb.as_bytes());
        driver::io::write_slice(dev, &mut q, at, &block_img, true)?;
    }
    Ok(Label::from_sb(&sb))
}

/// Read the newest valid superblock copy.
pub fn read_label<D: BlockDevice>(dev: &D) -> Result<Superblock> {
    let mut q = dev.open_queue()?;
    read_superblock(dev, &mut q)
}

fn read_superblock<D: BlockDevice>(dev: &D, q: &mut D::Queue) -> Result<Superblock> {
    let block = dev.geometry().block_size as u64;
    let img = read_region(dev, q, 0, round_up(8192, block))?;
    let copies = SUPERBLOCK_OFFSETS.map(|off| {
        Superblock::read_from_prefix(&img[off as usize..])
            .ok()
            .map(|(sb, _)| sb)
            .filter(|sb| sb.is_valid())
    });
    let best = copies
        .into_iter()
        .flatten()
        .max_by_key(|sb| sb.sb_seq.get());
    let Some(sb) = best else {
        // Magic but no valid copy: a label that rotted, not a blank device. `mkfs` would
        // erase what it holds, so say so rather than suggest it.
        let magic = SUPERBLOCK_OFFSETS
            .iter()
            .any(|&off| img.get(off as usize..off as usize + 8) == Some(&SUPERBLOCK_MAGIC[..]));
        if magic {
            return Err(StoreError::Format {
                device: dev.name().clone(),
                detail: "both superblock copies (bytes 0 and 4096) fail their CRC: the device \
                         holds an nvstore store whose label rotted. Do not mkfs it (that \
                         erases it); rebuild it from its peers"
                    .into(),
            });
        }
        return Err(StoreError::Unlabelled {
            device: dev.name().clone(),
        });
    };
    if sb.format_version.get() != FORMAT_VERSION {
        return Err(StoreError::Format {
            device: dev.name().clone(),
            detail: format!(
                "format version {} (this build reads version {FORMAT_VERSION})",
                sb.format_version.get()
            ),
        });
    }
    Ok(sb)
}

pub(crate) fn mount<D: BlockDevice + 'static>(
    dev: D,
    cluster: Option<[u8; 16]>,
    config: StoreConfig,
) -> Result<(Store<D>, OpenReport)> {
    let t0 = Instant::now();
    let name = dev.name().clone();
    let mut q = dev.open_queue()?;
    let mut sb = read_superblock(&dev, &mut q)?;
    if let Some(want) = cluster {
        if sb.cluster_fsid != want {
            return Err(StoreError::WrongCluster {
                device: name,
                found: Uuid(&sb.cluster_fsid).to_string(),
                expected: Uuid(&want).to_string(),
            });
        }
    }
    let geo = dev.geometry();
    let layout = Layout {
        block: sb.block_size.get() as u64,
        segment_bytes: sb.segment_bytes.get() as u64,
        segments: sb.segment_count.get(),
    };
    if layout.block != geo.block_size as u64
        || SEGMENTS_START_BYTES + layout.segments as u64 * layout.segment_bytes
            > geo.capacity_bytes()
    {
        return Err(StoreError::Format {
            device: name,
            detail: format!(
                "label says {} segments of {} bytes with {}-byte blocks; the device has {} \
                 blocks of {} bytes",
                layout.segments,
                layout.segment_bytes,
                layout.block,
                geo.capacity_blocks,
                geo.block_size
            ),
        });
    }
    // A new open generation, durable before any log write: stale batches from a crashed
    // earlier open can never be mistaken for new ones.
    sb.gen = (sb.gen.get() + 1).into();
    for _ in 0..2 {
        // Both copies, one after the other (docs/format.md "Device layout").
        sb.sb_seq = (sb.sb_seq.get() + 1).into();
        sb.seal();
        let mut img = vec![0u8; layout.block as usize];
        img[..256].copy_from_slice(sb.as_bytes());
        driver::io::write_slice(
            &dev,
            &mut q,
            SUPERBLOCK_OFFSETS[(sb.sb_seq.get() % 2) as usize],
            &img,
            true,
        )?;
    }

    let index = crate::Index::new();
    let mut report = OpenReport::default();
    let mut ckpt_segments = Vec::new();
    let start = Pos {
        seg: sb.replay_segment.get(),
        off: sb.replay_offset.get() as u64,
        seg_seq: sb.replay_segment_seq.get(),
        batch_seq: sb.replay_batch_seq.get(),
        next_seg: NO_SEGMENT,
    };
    let mut r = StreamReader::new(layout, sb.log_id.get(), SEGMENT_LOG, start);
    r.min_gen(sb.replay_gen.get());
    // This thread reads, checks and decodes the checkpoint's and the log's batches; a
    // `store-load` thread puts their records into the index, in the same order.
    let (read, applied) = std::thread::scope(|sc| {
        let (tx, rx) = crossbeam::channel::bounded(LOAD_QUEUE_BATCHES);
        let applier = std::thread::Builder::new()
            .name("store-load".into())
            .spawn_scoped(sc, || apply_loads(&index, rx))
            .expect("spawn the store-load thread");
        let read = (|| -> Result<u64> {
            if sb.ckpt_segment.get() != NO_SEGMENT {
                let start = Pos {
                    seg: sb.ckpt_segment.get(),
                    off: 0,
                    seg_seq: 1,
                    batch_seq: 1,
                    next_seg: NO_SEGMENT,
                };
                let mut c = StreamReader::new(layout, sb.ckpt_id.get(), SEGMENT_CHECKPOINT, start);
                load_checkpoint(&dev, &mut q, &mut c, &sb, &tx, config.salvage, &mut report)?;
                // A chain that broke leaves its unread segments unaccounted: they are free
                // for the log, and this open's report is the record of what they held.
                report.checkpoint_bytes = c.bytes_read;
                ckpt_segments = c.visited.iter().map(|(s, _)| *s).collect();
                // The chain's reserved-but-unopened next segment is not part of it.
            }
            replay_log(&dev, &mut q, &mut r, &tx, config.salvage, &mut report)
        })();
        drop(tx);
        (read, applier.join())
    });
    let (checkpoint_objects, max_seq) =
        applied.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    report.checkpoint_objects = checkpoint_objects;
    let skipped_batches = read?;
    report.replayed_bytes = r.bytes_read;
    let mut head = r.pos;
    if head.off > 0 && head.next_seg as u64 >= layout.segments as u64 && !r.next_unknown {
        // Replay starts inside a segment whose header does not check, so the log cannot be
        // followed (nor appended to) from here.
        return Err(StoreError::Format {
            device: name,
            detail: format!(
                "the log segment {} where replay starts (byte {} in it, batch {}) has no valid \
                 segment header; the log cannot be followed. {}",
                head.seg,
                head.off,
                head.batch_seq,
                if config.salvage {
                    "Rebuild this device from its peers"
                } else {
                    "Open with salvage (a node does) to rebuild the header from the batches \
                     behind it, or rebuild this device from its peers"
                }
            ),
        });
    }
    tracing::debug!(?head, ?sb.replay_segment, replay_off = sb.replay_offset.get(), replay_batch = sb.replay_batch_seq.get(), ckpt = sb.ckpt_segment.get(), "replay done");

    let mut segs = Segments::new(layout.segments, layout.segment_bytes);
    for e in index.iter() {
        let m = e.value().load();
        for c in m.chunks.iter().chain([&m.xattrs]) {
            if c.len.get() > 0 {
                let seg = layout.segment_of(c.offset.get());
                segs.add_live(seg, round_up(c.len.get() as u64, layout.block), m.state_seq);
            }
        }
    }
    for seg in 0..layout.segments {
        if segs.infos[seg as usize].live_bytes > 0 {
            segs.set_state(seg, SegState::Log { max_batch_seq: 0 });
        }
    }
    for &(seg, max) in &r.visited {
        segs.set_state(seg, SegState::Log { max_batch_seq: max });
    }
    for &seg in &ckpt_segments {
        segs.set_state(
            seg,
            SegState::Checkpoint {
                id: sb.ckpt_id.get(),
            },
        );
    }
    if r.next_unknown {
        // The head's segment header was rebuilt and nothing follows it: reserve the segment
        // the log continues in; the rewritten header names it.
        let next = segs
            .alloc(true)
            .ok_or_else(|| crate::stream::out_of_space(&segs))?;
        head.next_seg = next;
        if let Some(rb) = r.rebuilt.last_mut() {
            rb.next_seg = next;
        }
    }
    rewrite_rebuilt_headers(&dev, &mut q, &r)?;
    if head.off == 0 {
        segs.set_state(head.seg, SegState::Reserved);
    } else {
        // The open head segment may hold no valid batch yet (its first one was torn): it is
        // still the log's, not free.
        if segs.infos[head.seg as usize].state == SegState::Free {
            segs.set_state(
                head.seg,
                SegState::Log {
                    max_batch_seq: head.batch_seq,
                },
            );
        }
        segs.set_state(head.next_seg, SegState::Reserved);
    }
    // Replay may start at the end of a segment that holds no batch it reads (the checkpoint
    // began when the head had no room left): that segment's header is read at every open
    // until a newer checkpoint moves the replay start, so it is not free.
    let replay_seg = sb.replay_segment.get();
    if (replay_seg as u64) < layout.segments as u64
        && segs.infos[replay_seg as usize].state == SegState::Free
    {
        segs.set_state(
            replay_seg,
            SegState::Log {
                max_batch_seq: sb.replay_batch_seq.get().saturating_sub(1),
            },
        );
    }
    segs.set_replay_start(sb.replay_batch_seq.get(), replay_seg);
    segs.head = head.seg;
    segs.head_full = crate::space::head_is_full(layout.segment_bytes, layout.block, head.off);
    // Skipped batches held op sequences replay never saw; hand out none of them again (a
    // batch holds one round's transactions at most).
    let next_op_seq = sb.next_op_seq.get().max(max_seq + 1)
        + skipped_batches * crate::commit::ROUND_TXNS_MAX as u64;
    report.objects = index.len() as u64;
    drop(q);

    let label = Label::from_sb(&sb);
    let gens = segs.gens.clone();
    let sh = Arc::new(Shared {
        name,
        layout,
        chunk_bytes: sb.chunk_bytes.get() as u64,
        label,
        config: config.clone(),
        index,
        segs: Mutex::new(segs),
        stats: Default::default(),
        read_queues: thread_local::ThreadLocal::new(),
        spare_queue: Mutex::new(None),
        last_scrub: Mutex::new(None),
        salvaged: report.salvaged.clone(),
        cache: (config.read_cache_bytes > 0)
            .then(|| crate::cache::ReadCache::new(config.read_cache_bytes, gens)),
        dev,
    });
    *sh.spare_queue.lock().unwrap() = Some(sh.dev.open_queue()?);
    // The point index is built beside the serving store (see the index module).
    sh.index.go_live();
    let log = StreamHead {
        layout,
        stream_id: sb.log_id.get(),
        kind: SEGMENT_LOG,
        gen: sb.gen.get(),
        pos: head,
        // The commit thread's admission check enforces the reserve; placement may use it.
        use_reserve: true,
        move_on: false,
    };
    let committer = Committer::new(sh.clone(), log, sb, next_op_seq)?;
    let (user_tx, user_rx) = crossbeam::channel::unbounded();
    let (bg_tx, bg_rx) = crossbeam::channel::unbounded();
    let mut threads = Vec::new();
    threads.push(
        std::thread::Builder::new()
            .name("store-commit".into())
            .spawn(move || committer.run(user_rx, bg_rx))
            .expect("spawn commit thread"),
    );
    let fill_sh = sh.clone();
    threads.push(
        std::thread::Builder::new()
            .name("store-index".into())
            .spawn(move || {
                let t0 = Instant::now();
                let objects = fill_sh.index.len();
                if fill_sh.index.fill() {
                    let elapsed = t0.elapsed();
                    tracing::debug!(device = %fill_sh.name, objects, ?elapsed, "point index built");
                }
            })
            .expect("spawn index thread"),
    );
    let mut cleaner_stop = None;
    if config.cleaner {
        let (stop_tx, stop_rx) = crossbeam::channel::bounded::<()>(0);
        let c = crate::cleaner::Cleaner::new(sh.clone(), bg_tx.clone())?;
        threads.push(
            std::thread::Builder::new()
                .name("store-cleaner".into())
                .spawn(move || c.run(stop_rx))
                .expect("spawn cleaner thread"),
        );
        cleaner_stop = Some(stop_tx);
    }
    report.elapsed = t0.elapsed();
    tracing::info!(device = %sh.name, "{report}");
    let mut store = Store {
        sh,
        user_tx: Some(user_tx),
        bg_tx: Some(bg_tx),
        cleaner_stop,
        scrub_stop: None,
        threads,
    };
    if let Some(schedule) = config.scrub {
        let (stop_tx, stop_rx) = crossbeam::channel::bounded::<()>(0);
        let sh = store.sh.clone();
        store.threads.push(
            std::thread::Builder::new()
                .name("store-scrub".into())
                .spawn(move || crate::scrub::background(sh, schedule, stop_rx))
                .expect("spawn scrub thread"),
        );
        store.scrub_stop = Some(stop_tx);
    }
    Ok((store, report))
}

/// Load the checkpoint's object states into the index. A batch that does not read (the
/// superblock says how many there are, so every one is known to have been written): refuse,
/// or with `salvage` skip it, or stop at a chain that cannot be followed, and note it in the
/// report. Objects whose states were in a lost batch then read as the log after the
/// checkpoint has them, or do not exist: never as bytes they did not have.
fn load_checkpoint<D: BlockDevice>(
    dev: &D,
    q: &mut D::Queue,
    r: &mut StreamReader,
    sb: &Superblock,
    load: &Sender<Load>,
    salvage: bool,
    report: &mut OpenReport,
) -> Result<()> {
    let name = dev.name();
    let layout = Layout {
        block: sb.block_size.get() as u64,
        segment_bytes: sb.segment_bytes.get() as u64,
        segments: sb.segment_count.get(),
    };
    let batches = sb.ckpt_batches.get() as u64;
    // (A send fails only when the store-load thread is gone: its panic is raised at join.)
    let send = |recs: Vec<Record>| drop(load.send(Load::Checkpoint(recs)));
    // Checkpoint batches are numbered from 1.
    while r.pos.batch_seq <= batches {
        if let Some(b) = r.next(dev, q)? {
            send(b.records);
            continue;
        }
        let at = r.pos;
        if !salvage {
            return Err(StoreError::Format {
                device: name.clone(),
                detail: format!(
                    "checkpoint {:#x} is unreadable at batch {} of {batches} (segment {}, \
                     byte {} in it): a header, its records or the segment header fail their \
                     CRC. Open with salvage (a node does) to load the rest and rebuild the \
                     lost objects from peers, or rebuild this device from its peers",
                    sb.ckpt_id.get(),
                    at.batch_seq,
                    at.seg,
                    at.off
                ),
            });
        }
        let chain_lost = |report: &mut OpenReport| {
            report.salvaged.push(Salvaged {
                device: name.clone(),
                kind: SalvageKind::CheckpointChain,
                offset: layout.segment_base(at.seg) + at.off,
                len: 0,
                batch_seq: at.batch_seq,
                batches_skipped: batches + 1 - at.batch_seq,
                expected: 0,
                found: 0,
                keys: Vec::new(),
                keys_complete: false,
            });
        };
        match r.salvage(dev, q) {
            Ok(Salvage::Data(b, _)) => send(b.records), // (no data items)
            Ok(Salvage::Skipped(s)) if s.first_seq <= batches => {
                report.salvaged.push(Salvaged {
                    device: name.clone(),
                    kind: SalvageKind::CheckpointBatch,
                    offset: s.offset,
                    len: s.len,
                    batch_seq: s.first_seq,
                    batches_skipped: s.resume_seq.min(batches + 1) - s.first_seq,
                    expected: s.expected,
                    found: s.found,
                    keys: s.keys,
                    keys_complete: s.keys_complete,
                });
            }
            Ok(Salvage::Skipped(_)) => unreachable!("the loop stops after the last batch"),
            // Nothing valid follows: the rotten batch is the last one, or the chain broke
            // after it (the batches after it are lost too; which, the bytes cannot tell).
            Ok(Salvage::Unresumable(s)) => {
                report.salvaged.push(Salvaged {
                    device: name.clone(),
                    kind: SalvageKind::CheckpointChain,
                    offset: s.offset,
                    len: s.len,
                    batch_seq: s.first_seq,
                    batches_skipped: batches + 1 - s.first_seq,
                    expected: s.expected,
                    found: s.found,
                    keys: s.keys,
                    keys_complete: false,
                });
                break;
            }
            Err(StoreError::Format { .. }) => {
                chain_lost(report);
                break;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Replay the log from the reader's start into the index. At an unreadable batch that a later
/// batch proves acknowledged: refuse, or with `salvage` get past it and note it in the report.
/// The batches' records go to `load`, in log order. Returns how many batches were skipped.
fn replay_log<D: BlockDevice>(
    dev: &D,
    q: &mut D::Queue,
    r: &mut StreamReader,
    load: &Sender<Load>,
    salvage: bool,
    report: &mut OpenReport,
) -> Result<u64> {
    let name = dev.name();
    let mut skipped_batches = 0u64;
    // (A send fails only when the store-load thread is gone: its panic is raised at join.)
    let send = |recs: Vec<Record>| drop(load.send(Load::Replay(recs)));
    r.rebuild_headers = salvage;
    loop {
        while let Some(b) = r.next(dev, q)? {
            send(b.records);
            report.replayed_batches += 1;
        }
        let Some((offset, seq)) = r.acked_batch_after_end(dev, q)? else {
            // A torn tail (nothing later proves it was acknowledged): the log ends here.
            break;
        };
        if let (false, Some((seg, expected, found))) = (salvage, r.rotten_header) {
            return Err(StoreError::Format {
                device: name.clone(),
                detail: format!(
                    "the header of log segment {seg} (byte {}) fails its crc32c (expected \
                     {expected:#010x}, found {found:#010x}), and batch {seq} at byte {offset} \
                     was written after the batches behind it had been acknowledged. Refusing \
                     to open rather than lose them; open with salvage (a node does) to \
                     rebuild the header from those batches, or rebuild this device from its \
                     peers",
                    r.layout().segment_base(seg)
                ),
            });
        }
        if !salvage {
            let head = r.pos;
            return Err(StoreError::Format {
                device: name.clone(),
                detail: format!(
                    "log batch {} (at or after byte {} of segment {}) is unreadable, but batch \
                     {seq} at byte {offset} was written after it had been acknowledged: \
                     acknowledged data is corrupt. Refusing to open rather than lose it \
                     silently; rebuild this device from its peers",
                    head.batch_seq, head.off, head.seg
                ),
            });
        }
        match r.salvage(dev, q)? {
            Salvage::Data(b, bad) => {
                let batch_seq = b.header.seq.get();
                for it in bad {
                    report.salvaged.push(Salvaged {
                        device: name.clone(),
                        kind: SalvageKind::DataCrc,
                        offset: it.item.offset.get(),
                        len: it.item.len.get() as u64,
                        batch_seq,
                        batches_skipped: 0,
                        expected: it.item.crc.get(),
                        found: it.found,
                        keys: vec![it.key],
                        keys_complete: true,
                    });
                }
                send(b.records);
                report.replayed_batches += 1;
            }
            Salvage::Unresumable(_) => return Err(r.chain_broken(dev, r.pos.next_seg)),
            Salvage::Skipped(s) => {
                skipped_batches += s.resume_seq - s.first_seq;
                report.salvaged.push(Salvaged {
                    device: name.clone(),
                    kind: match s.kind {
                        SkipKind::Header => SalvageKind::BatchHeader,
                        SkipKind::Records => SalvageKind::BatchRecords,
                    },
                    offset: s.offset,
                    len: s.len,
                    batch_seq: s.first_seq,
                    batches_skipped: s.resume_seq - s.first_seq,
                    expected: s.expected,
                    found: s.found,
                    keys: s.keys,
                    keys_complete: s.keys_complete,
                });
            }
        }
    }
    for rb in &r.rebuilt {
        if r.durable_through < rb.first_batch_seq {
            // Nothing proves the segment's batches were acknowledged: its header may just
            // have been torn by a crash as the segment opened. Rebuilt all the same (the
            // batches verify), but not reported as damage.
            tracing::info!(
                device = %name,
                segment = rb.seg,
                "log segment header failed its crc and no later batch proves the segment \
                 acknowledged (torn as it opened); rebuilt from its batches"
            );
            continue;
        }
        report.salvaged.push(Salvaged {
            device: name.clone(),
            kind: SalvageKind::SegmentHeader,
            offset: r.layout().segment_base(rb.seg),
            len: r.layout().block,
            batch_seq: rb.first_batch_seq,
            batches_skipped: 0,
            expected: rb.expected,
            found: rb.found,
            keys: Vec::new(),
            keys_complete: true,
        });
    }
    for p in &report.salvaged {
        tracing::warn!(
            device = %p.device,
            offset = p.offset,
            expected = format_args!("{:#010x}", p.expected),
            found = format_args!("{:#010x}", p.found),
            "salvage: {p}"
        );
    }
    Ok(skipped_batches)
}

/// Write back the log segment headers replay rebuilt (FUA each), now that each names the
/// segment its stream continues in. A torn write leaves it rotten: the next salvage open
/// rebuilds it again.
fn rewrite_rebuilt_headers<D: BlockDevice>(
    dev: &D,
    q: &mut D::Queue,
    r: &StreamReader,
) -> Result<()> {
    let layout = r.layout();
    let now = now_ns();
    for rb in &r.rebuilt {
        if rb.next_seg == NO_SEGMENT {
            // (Cannot happen: the reader leaves a segment only for a known successor, and the
            // head's was reserved above.) Left rotten rather than written wrong.
            tracing::warn!(segment = rb.seg, "rebuilt segment header has no successor");
            continue;
        }
        let h = rb.header(r.stream_id(), SEGMENT_LOG, now);
        let mut img = vec![0u8; layout.block as usize];
        img[..64].copy_from_slice(h.as_bytes());
        driver::io::write_slice(dev, q, layout.segment_base(rb.seg), &img, true)?;
        tracing::info!(
            segment = rb.seg,
            next = rb.next_seg,
            first_batch = rb.first_batch_seq,
            "rebuilt log segment header written back"
        );
    }
    Ok(())
}

/// Decoded batches an open has read, queued for the index. Open reads and checks the next
/// batches while the records of earlier ones go in (`store-load` thread), so building the
/// index overlaps the reading: a million-object restart on 2 cores opened in 0.51–0.67 s
/// instead of 0.78–1.06 s (store bench, four pairs).
pub(crate) enum Load {
    /// A checkpoint batch's object states.
    Checkpoint(Vec<Record>),
    /// A log batch's records, replayed over the checkpoint.
    Replay(Vec<Record>),
}

/// Batches queued between open's reader and the `store-load` thread (a batch decodes to at
/// most a few MiB of records).
const LOAD_QUEUE_BATCHES: usize = 16;

/// The `store-load` thread: apply queued batches in order until the queue closes. Returns the
/// checkpoint's object count and the highest op sequence the log replayed.
fn apply_loads(index: &crate::Index, rx: Receiver<Load>) -> (u64, u64) {
    let (mut objects, mut max_seq) = (0u64, 0u64);
    for load in rx {
        match load {
            Load::Checkpoint(recs) => {
                for rec in recs {
                    if let Record::State { key, meta } = rec {
                        index.put(&key, Arc::new(meta));
                        objects += 1;
                    }
                }
            }
            Load::Replay(recs) => replay_records(index, recs, &mut max_seq),
        }
    }
    (objects, max_seq)
}

/// Apply one replayed batch's records to the index: a state or remove wins over what the index
/// holds only when its op sequence is newer.
fn replay_records(index: &crate::Index, records: Vec<Record>, max_seq: &mut u64) {
    for rec in records {
        match rec {
            Record::State { key, meta } => {
                *max_seq = (*max_seq).max(meta.state_seq);
                let newer = index.state_seq(&key).is_none_or(|s| s < meta.state_seq);
                if newer {
                    index.put(&key, Arc::new(meta));
                }
            }
            Record::Remove { key, seq, .. } => {
                *max_seq = (*max_seq).max(seq);
                if index.state_seq(&key).is_some_and(|s| s < seq) {
                    index.remove(&key);
                }
            }
            Record::Owner { .. } => {}
        }
    }
}
