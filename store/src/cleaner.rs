//! The cleaner: when free segments run low, pick a victim by cost-benefit, find its live
//! chunks by walking its batches and checking each object they name, and its partner key
//! (which a rename may have given the chunks), against the index, and relocate them
//! through the commit thread, one transaction per object with up to 256 objects / 1 MiB in
//! flight (the commit thread gives background work a bounded share of each round, so
//! foreground IO is not stalled, and many small relocations share one device write). A relocation commits only if the object is still in
//! the state it was read in. Once a victim holds no live data it is freed as soon as the next
//! checkpoint moves the replay start past it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};
use driver::BlockDevice;

use crate::commit::{
    Base, ChunkSrc, DataRef, Msg, Mut, MutOp, Prepared, PutState, ReplyWaiter, TxnResult, XattrSrc,
};
use crate::error::Result;
use crate::format::{ChunkRef, SEGMENT_LOG};
use crate::key::ObjectKey;
use crate::meta::{decode_records, Record};
use crate::space::{BACKGROUND_LIVE_MAX, VICTIM_LIVE_MAX};
use crate::stream::{parse_segment_header, read_region};
use crate::Shared;

/// How often the cleaner looks at free space when nothing wakes it.
const CLEANER_PERIOD: Duration = Duration::from_millis(20);
/// Relocations the cleaner keeps in flight: at most this many objects ...
const RELOCATE_TXNS_MAX: usize = 256;
/// ... and about this many bytes (the commit thread gives background work at least 1 MiB
/// of each round).
const RELOCATE_BYTES_MAX: u64 = 1 << 20;

/// Wait for the oldest relocation in flight. `Ok(false)`: the store is shutting down.
fn wait_oldest(
    pending: &mut VecDeque<(ReplyWaiter, u64)>,
    pending_bytes: &mut u64,
) -> Result<bool> {
    let Some((rx, bytes)) = pending.pop_front() else {
        return Ok(true);
    };
    *pending_bytes -= bytes;
    match rx.recv() {
        // A conflict: the object changed since it was read; its new state lives elsewhere.
        Ok(TxnResult::Committed { .. }) | Ok(TxnResult::Conflict) => Ok(true),
        Ok(TxnResult::Failed(e)) => Err(e),
        Err(_) => Ok(false),
    }
}

pub(crate) struct Cleaner<D: BlockDevice> {
    sh: Arc<Shared<D>>,
    bg: Sender<Msg>,
    q: D::Queue,
}

impl<D: BlockDevice> Cleaner<D> {
    pub(crate) fn new(sh: Arc<Shared<D>>, bg: Sender<Msg>) -> Result<Self> {
        let q = sh.dev.open_queue()?;
        Ok(Cleaner { sh, bg, q })
    }

    /// Clean while free space is below the target: 2× the reserve plus 5 % of the device —
    /// in the background only victims at most [`BACKGROUND_LIVE_MAX`] live, and up to
    /// [`VICTIM_LIVE_MAX`] when writes need the space.
    fn wants_cleaning(&self) -> Option<u32> {
        let segs = self.sh.segs.lock().unwrap();
        let target = segs.reserve * 2 + segs.count() / 20;
        if segs.free_count() + segs.pinned_dead(segs.replay_start) >= target {
            return None;
        }
        let now = self.sh.stats.next_op_seq.get();
        let live_max = if segs.writes_need_space() {
            VICTIM_LIVE_MAX
        } else {
            BACKGROUND_LIVE_MAX
        };
        segs.victim(now, live_max)
    }

    pub(crate) fn run(mut self, stop: Receiver<()>) {
        loop {
            match stop.recv_timeout(CLEANER_PERIOD) {
                Err(RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            while let Some(victim) = self.wants_cleaning() {
                if stop.try_recv() != Err(crossbeam::channel::TryRecvError::Empty) {
                    return;
                }
                match self.clean(victim) {
                    Ok(true) => self.sh.stats.cleaned_segments.inc(),
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(segment = victim, error = %e, "cleaning failed");
                        break;
                    }
                }
            }
        }
    }

    /// Relocate every live chunk out of `seg`. Returns whether the segment ended with no live
    /// data.
    fn clean(&mut self, seg: u32) -> Result<bool> {
        let layout = self.sh.layout;
        tracing::debug!(
            seg,
            live = self.sh.segs.lock().unwrap().infos[seg as usize].live_bytes,
            "cleaning"
        );
        let base = layout.segment_base(seg);
        let image = read_region(&self.sh.dev, &mut self.q, base, layout.segment_bytes)?;
        let Some(h) = parse_segment_header(&image) else {
            return Ok(false);
        };
        if h.kind.get() != SEGMENT_LOG {
            return Ok(false);
        }
        // Walk the batches in the segment; collect keys that have records here. A block that
        // holds no valid header (a batch a salvage open skipped, or the unwritten tail) is
        // stepped over block by block: keys found are only candidates, checked against the
        // index below, so a stale batch costs a lookup and nothing else.
        let mut keys: BTreeMap<ObjectKey, ()> = BTreeMap::new();
        let mut off = layout.block;
        while off + layout.block <= layout.segment_bytes {
            let Ok((bh, _)) = <crate::format::BatchHeader as zerocopy::FromBytes>::read_from_prefix(
                &image[off as usize..],
            ) else {
                break;
            };
            let total = layout.batch_bytes(bh.meta_bytes.get() as u64, bh.data_bytes.get() as u64);
            if !bh.is_valid()
                || bh.stream_id.get() != h.stream_id.get()
                || off + total > layout.segment_bytes
            {
                off += layout.block;
                continue;
            }
            let meta = &image[off as usize + 64..off as usize + 64 + bh.meta_bytes.get() as usize];
            if crc32c::crc32c(meta) == bh.meta_crc.get() {
                if let Ok(recs) = decode_records(meta, bh.record_count.get()) {
                    for r in recs {
                        if let Record::State { key, .. } | Record::Owner { key, .. } = r {
                            // A chunk written here may since have been renamed to the key's
                            // partner (`Transaction::rename`).
                            if let Some(partner) = self.sh.config.alias.and_then(|a| a(&key)) {
                                keys.insert(partner, ());
                            }
                            keys.insert(key, ());
                        }
                    }
                }
            }
            off += total;
        }
        let in_seg = |r: &ChunkRef| r.len.get() > 0 && layout.segment_of(r.offset.get()) == seg;
        // Relocations in flight: the commit thread takes many into one round (its background
        // share), so small objects do not cost a device write and flush each.
        let mut pending: VecDeque<(ReplyWaiter, u64)> = VecDeque::new();
        let mut pending_bytes = 0u64;
        for key in keys.into_keys() {
            let Some(m) = self.sh.index_get(&key) else {
                continue;
            };
            if !m.chunks.iter().chain([&m.xattrs]).any(in_seg) {
                continue;
            }
            let take = |r: &ChunkRef| -> Option<Vec<u8>> {
                let at = (r.offset.get() - base) as usize;
                let bytes = &image[at..at + r.len.get() as usize];
                if crate::data_crc(bytes) == r.crc.get() {
                    return Some(bytes.to_vec());
                }
                // Written after the image was read (the segment was the log's head, or was
                // freed and reused since it was picked): read it again (verified) before
                // calling it corrupt. A corrupt chunk is not relocated: scrub and reads
                // report it.
                self.sh.read_ref_vec(r, "cleaner relocation").ok()
            };
            let mut chunks = Vec::with_capacity(m.chunks.len());
            let mut ok = true;
            for r in m.chunks.iter() {
                chunks.push(if r.len.get() == 0 {
                    ChunkSrc::Hole
                } else if in_seg(r) {
                    match take(r) {
                        Some(v) => ChunkSrc::New(DataRef::Owned(v), r.crc.get()),
                        None => {
                            ok = false;
                            ChunkSrc::Keep(*r)
                        }
                    }
                } else {
                    ChunkSrc::Keep(*r)
                });
            }
            let xattrs = if in_seg(&m.xattrs) {
                match take(&m.xattrs) {
                    Some(v) => XattrSrc::New(v),
                    None => {
                        ok = false;
                        XattrSrc::Keep(m.xattrs)
                    }
                }
            } else if m.xattrs.len.get() == 0 {
                XattrSrc::None
            } else {
                XattrSrc::Keep(m.xattrs)
            };
            if !ok {
                self.sh.stats.corrupt_reads.inc();
                tracing::warn!(%key, segment = seg, "corrupt chunk left in place by the cleaner");
            }
            let txn = Prepared {
                muts: vec![Mut {
                    key: key.clone(),
                    base: Base::Seq(m.state_seq),
                    op: MutOp::Put(PutState {
                        size: m.size,
                        data_crc: m.data_crc,
                        chunks,
                        xattrs,
                        relocation: true,
                    }),
                }],
                background: true,
                room: crate::commit::Room::Normal,
                moves_from: Some(seg),
                parked_at: None,
            };
            let moved: u64 = m
                .chunks
                .iter()
                .chain([&m.xattrs])
                .filter(|r| in_seg(r))
                .map(|r| r.len.get() as u64)
                .sum();
            let (tx, rx) = crate::commit::reply_pair();
            if self.bg.send(Msg::Txn(Box::new(txn), tx)).is_err() {
                return Ok(false);
            }
            pending.push_back((rx, moved));
            pending_bytes += moved;
            while pending.len() >= RELOCATE_TXNS_MAX || pending_bytes > RELOCATE_BYTES_MAX {
                if !wait_oldest(&mut pending, &mut pending_bytes)? {
                    return Ok(false);
                }
            }
        }
        while !pending.is_empty() {
            if !wait_oldest(&mut pending, &mut pending_bytes)? {
                return Ok(false);
            }
        }
        let segs = self.sh.segs.lock().unwrap();
        Ok(segs.infos[seg as usize].live_bytes == 0)
    }
}
