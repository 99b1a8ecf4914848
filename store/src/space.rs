//! The segment table: what each segment holds, live bytes per segment, allocation with a
//! reserve for the cleaner, and the rule for when a segment may be reused.
//!
//! A log segment may be reused only when (a) no object references data in it (live bytes 0),
//! (b) every batch in it is older than the durable checkpoint's replay start, and (c) it is not
//! the segment the replay starts in, so no future replay reads it. Checkpoint segments are freed
//! when a newer checkpoint is durable.
//!
//! (c) matters when a checkpoint starts while the head segment has no room for the next batch:
//! the replay then starts at that segment's end and reads only its header (to learn the next
//! segment), yet every batch in it is older than the replay start.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The cleaner never takes a segment more live than this: relocating 95 % of a segment to
/// gain 5 % costs 19 bytes written per byte freed.
pub const VICTIM_LIVE_MAX: f64 = 0.95;

/// The cleaner's background work (keeping free space at its target while writes still have
/// room) takes only victims at most this live: up to 4 bytes relocated per byte freed. Fuller
/// ones are taken only when writes need the space ([`Segments::writes_need_space`]), and by
/// then more of their data may have died. Without this, a store near full whose segments were
/// all 80–95 % live relocated them over and over as small writes that had room trickled in
/// (25 writes of 512 B: 18 segments, 14.8 MiB, in the cleaner tests).
pub const BACKGROUND_LIVE_MAX: f64 = 0.8;

/// Free segments above the reserve at or below which writes need the cleaner.
pub const DEMAND_MARGIN: u64 = 2;

/// How long after a transaction waited for space writes count as needing the cleaner (waiters
/// are checked again at least every 250 ms, and one that waits again renews it).
pub const DEMAND_WINDOW: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegState {
    Free,
    /// Holds log batches; `max_batch_seq` is the newest batch written in it.
    Log {
        max_batch_seq: u64,
    },
    /// Part of a checkpoint stream (`id` = ckpt id).
    Checkpoint {
        id: u64,
    },
    /// Chosen as a stream's next segment, not yet opened.
    Reserved,
}

#[derive(Debug, Clone, Copy)]
pub struct SegInfo {
    pub state: SegState,
    /// Bytes of object data and xattr maps in this segment that the index references.
    pub live_bytes: u64,
    /// Newest op sequence whose data landed here (age for cost-benefit cleaning).
    pub newest_seq: u64,
}

impl SpaceReport {
    /// Bytes of object data the store can hold: all segments but the cleaner's reserve, the
    /// open head and its reserved successor, less each segment's header block.
    pub fn usable_bytes(&self) -> u64 {
        self.segments_total
            .saturating_sub(self.segments_reserve + 2)
            * (self.segment_bytes - 4096)
    }
}

/// Space numbers for reports and the out-of-space error.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpaceReport {
    pub segment_bytes: u64,
    pub segments_total: u64,
    pub segments_free: u64,
    /// Log segments with no live data still pinned by the replay range.
    pub segments_reclaimable: u64,
    pub segments_reserve: u64,
    pub live_bytes: u64,
    /// Bytes in use (non-free segments) minus live bytes: what cleaning can recover.
    pub dead_bytes: u64,
}

/// Whether a log head at `off` in its segment is full: less room left than the commit
/// thread needs to start a batch there (64 KiB and two blocks), so its next round moves on.
pub fn head_is_full(segment_bytes: u64, block: u64, off: u64) -> bool {
    off > 0 && segment_bytes.saturating_sub(off) < HEAD_ROOM_MIN_DATA + 2 * block
}

/// The room (besides two blocks) a round wants at the log head to start a batch there.
pub const HEAD_ROOM_MIN_DATA: u64 = 64 * 1024;

/// One segment's state and live bytes ([`crate::Store::segments`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentUsage {
    pub state: SegState,
    pub live_bytes: u64,
    /// The log's open segment (the cleaner picks it only once it is full:
    /// [`Segments::victim`]).
    pub head: bool,
}

pub struct Segments {
    pub infos: Vec<SegInfo>,
    free: BTreeSet<u32>,
    pub segment_bytes: u64,
    /// Free segments kept back from foreground writes for the cleaner and checkpoints.
    pub reserve: u64,
    /// The durable checkpoint's replay start (batch sequence): older batches are never read.
    pub replay_start: u64,
    /// The segment that replay starts in: its header is read at every open.
    pub replay_seg: u32,
    /// The log's open segment.
    pub head: u32,
    /// The open segment has less room left than a round needs to start a batch in it
    /// ([`head_is_full`]), or a writer found it too full and no segment may be opened for
    /// it: the cleaner may take it as a victim. Cleared when the log moves on.
    pub head_full: bool,
    /// How many times a segment was freed (waiters for space look again when it moves).
    pub frees: u64,
    /// When a transaction last had to wait for space: the cleaner then takes victims up to
    /// [`VICTIM_LIVE_MAX`] live, not only those it cleans in the background.
    pub last_wait: Option<Instant>,
    /// Per segment: how often it was taken for new writes (the read cache's generations).
    pub gens: Arc<[AtomicU32]>,
}

impl Segments {
    pub fn new(count: u32, segment_bytes: u64) -> Self {
        let reserve = (count as u64 / 20).clamp(4, 64).min(count as u64 / 2);
        Segments {
            infos: vec![
                SegInfo {
                    state: SegState::Free,
                    live_bytes: 0,
                    newest_seq: 0,
                };
                count as usize
            ],
            free: (0..count).collect(),
            segment_bytes,
            reserve,
            replay_start: 0,
            replay_seg: u32::MAX,
            head: u32::MAX,
            head_full: false,
            frees: 0,
            last_wait: None,
            gens: crate::cache::generations(count),
        }
    }

    pub fn count(&self) -> u64 {
        self.infos.len() as u64
    }

    pub fn free_count(&self) -> u64 {
        self.free.len() as u64
    }

    pub fn set_state(&mut self, seg: u32, state: SegState) {
        tracing::debug!(
            seg,
            ?state,
            live = self.infos[seg as usize].live_bytes,
            "segment state"
        );
        if state == SegState::Free {
            self.frees += 1;
            self.free.insert(seg);
        } else {
            self.free.remove(&seg);
        }
        self.infos[seg as usize].state = state;
    }

    /// Take a free segment. Foreground users may not dip into the reserve.
    pub fn alloc(&mut self, use_reserve: bool) -> Option<u32> {
        if !use_reserve && self.free.len() as u64 <= self.reserve {
            return None;
        }
        let seg = *self.free.iter().next()?;
        self.set_state(seg, SegState::Reserved);
        // Before anything is written to it: cached chunks of its last use stop matching.
        self.gens[seg as usize].fetch_add(1, Ordering::AcqRel);
        Some(seg)
    }

    /// Whether `segments` more can be taken by a foreground (or background) writer.
    pub fn can_take(&self, segments: u64, use_reserve: bool) -> bool {
        let floor = if use_reserve { 0 } else { self.reserve };
        self.free.len() as u64 >= segments + floor
    }

    pub fn note_batch(&mut self, seg: u32, batch_seq: u64) {
        let info = &mut self.infos[seg as usize];
        info.state = match info.state {
            SegState::Log { max_batch_seq } => SegState::Log {
                max_batch_seq: max_batch_seq.max(batch_seq),
            },
            _ => SegState::Log {
                max_batch_seq: batch_seq,
            },
        };
        self.free.remove(&seg);
    }

    pub fn add_live(&mut self, seg: u32, bytes: u64, seq: u64) {
        let info = &mut self.infos[seg as usize];
        info.live_bytes += bytes;
        info.newest_seq = info.newest_seq.max(seq);
    }

    pub fn sub_live(&mut self, seg: u32, bytes: u64) {
        let info = &mut self.infos[seg as usize];
        assert!(
            info.live_bytes >= bytes,
            "segment {seg}: live bytes would go negative ({} - {bytes})",
            info.live_bytes
        );
        info.live_bytes -= bytes;
        if seg != self.head && self.is_reclaimable(seg, self.replay_start) {
            self.set_state(seg, SegState::Free);
            self.infos[seg as usize].newest_seq = 0;
        }
    }

    fn is_reclaimable(&self, seg: u32, replay_start: u64) -> bool {
        let info = &self.infos[seg as usize];
        matches!(info.state, SegState::Log { max_batch_seq } if max_batch_seq < replay_start)
            && info.live_bytes == 0
            && seg != self.replay_seg
    }

    /// A new durable replay start: batch `batch_seq`, in segment `seg`.
    pub fn set_replay_start(&mut self, batch_seq: u64, seg: u32) {
        self.replay_start = batch_seq;
        self.replay_seg = seg;
    }

    /// Free every log segment that is dead and older than the replay start. Returns how many.
    pub fn reclaim(&mut self, head_segment: u32) -> u64 {
        let mut n = 0;
        for seg in 0..self.infos.len() as u32 {
            if seg != head_segment && self.is_reclaimable(seg, self.replay_start) {
                self.set_state(seg, SegState::Free);
                self.infos[seg as usize].newest_seq = 0;
                n += 1;
            }
        }
        n
    }

    /// Free all segments of checkpoint `id`.
    pub fn free_checkpoint(&mut self, id: u64) {
        for seg in 0..self.infos.len() as u32 {
            if self.infos[seg as usize].state == (SegState::Checkpoint { id }) {
                self.set_state(seg, SegState::Free);
            }
        }
    }

    /// Log segments with no live data waiting for a checkpoint to pass them.
    pub fn pinned_dead(&self, replay_start: u64) -> u64 {
        self.infos
            .iter()
            .filter(|i| {
                matches!(i.state, SegState::Log { max_batch_seq } if max_batch_seq >= replay_start)
                    && i.live_bytes == 0
            })
            .count() as u64
    }

    pub fn report(&self, replay_start: u64) -> SpaceReport {
        let live: u64 = self.infos.iter().map(|i| i.live_bytes).sum();
        let used = self.count() - self.free_count();
        SpaceReport {
            segment_bytes: self.segment_bytes,
            segments_total: self.count(),
            segments_free: self.free_count(),
            segments_reclaimable: self.pinned_dead(replay_start),
            segments_reserve: self.reserve,
            live_bytes: live,
            dead_bytes: (used * self.segment_bytes).saturating_sub(live),
        }
    }

    /// The cleaner's victim ([`Segments::pick_victim`]), skipping the open head unless it is
    /// full. A full head is as sealed as any other segment: relocating its live data moves the
    /// log on. Were it skipped, the dead data of a head that filled while the store was at its
    /// floor could never be reclaimed — every other segment nearly all live, no foreground
    /// write allowed to open the next segment, and nothing left for the cleaner to clean.
    /// Victims are at most `live_max` live (a fraction of the segment).
    pub fn victim(&self, now_seq: u64, live_max: f64) -> Option<u32> {
        if self.head_full {
            self.pick_victim(now_seq, &[], live_max)
        } else {
            self.pick_victim(now_seq, &[self.head], live_max)
        }
    }

    /// Whether writes need the cleaner now, not only its background work: a transaction
    /// waited for space within [`DEMAND_WINDOW`], or the free segments are within
    /// [`DEMAND_MARGIN`] of the reserve. (A full head alone is not: while segments may be
    /// opened the next write opens one; when none may, that write waits.)
    pub fn writes_need_space(&self) -> bool {
        self.free_count() <= self.reserve + DEMAND_MARGIN
            || self.last_wait.is_some_and(|t| t.elapsed() < DEMAND_WINDOW)
    }

    /// Cost-benefit victim choice (Rosenblum & Ousterhout): maximise (1-u)·age / (1+u) over
    /// sealed log segments, where u is the live fraction and age is how many ops ago the
    /// newest data in it was written. Skips `exclude` (the open head), empty-of-live ones
    /// (those only need a checkpoint) and those more than `live_max` live.
    pub fn pick_victim(&self, now_seq: u64, exclude: &[u32], live_max: f64) -> Option<u32> {
        let mut best: Option<(u32, f64)> = None;
        for (seg, info) in self.infos.iter().enumerate() {
            let seg = seg as u32;
            if exclude.contains(&seg) || !matches!(info.state, SegState::Log { .. }) {
                continue;
            }
            if info.live_bytes == 0 {
                continue;
            }
            let u = info.live_bytes as f64 / self.segment_bytes as f64;
            if u > live_max {
                continue;
            }
            let age = now_seq.saturating_sub(info.newest_seq).max(1) as f64;
            let score = (1.0 - u) * age / (1.0 + u);
            if best.is_none_or(|(_, s)| score > s) {
                best = Some((seg, score));
            }
        }
        best.map(|(s, _)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_kept_from_foreground() {
        let mut s = Segments::new(10, 1 << 20);
        assert_eq!(s.reserve, 4);
        let mut got = 0;
        while s.alloc(false).is_some() {
            got += 1;
        }
        assert_eq!(got, 6);
        assert!(s.alloc(true).is_some(), "the cleaner may use the reserve");
    }

    #[test]
    fn reclaim_waits_for_the_replay_start() {
        let mut s = Segments::new(10, 1 << 20);
        let seg = s.alloc(false).unwrap();
        s.note_batch(seg, 5);
        s.add_live(seg, 100, 1);
        s.set_replay_start(10, 9);
        assert_eq!(s.reclaim(99), 0, "live data pins it");
        s.set_replay_start(5, 9);
        s.sub_live(seg, 100);
        assert_eq!(s.reclaim(99), 0, "batch 5 is still in the replay range");
        assert_eq!(s.pinned_dead(5), 1);
        s.set_replay_start(6, 9);
        assert_eq!(s.reclaim(99), 1);
        assert_eq!(s.free_count(), 10);
    }

    #[test]
    fn the_segment_replay_starts_in_is_kept() {
        let mut s = Segments::new(10, 1 << 20);
        let seg = s.alloc(false).unwrap();
        s.note_batch(seg, 5);
        s.add_live(seg, 100, 1);
        // Replay starts after batch 5, at the end of `seg`: it still reads the header there.
        s.set_replay_start(6, seg);
        s.sub_live(seg, 100);
        assert_eq!(s.reclaim(99), 0);
        assert!(matches!(s.infos[seg as usize].state, SegState::Log { .. }));
        s.set_replay_start(7, 3);
        assert_eq!(s.reclaim(99), 1);
    }

    #[test]
    fn a_full_head_may_be_the_victim() {
        let mut s = Segments::new(10, 1000);
        for (seg, live) in [(0u32, 990u64), (1, 100)] {
            s.set_state(seg, SegState::Log { max_batch_seq: 1 });
            s.add_live(seg, live, 10);
        }
        s.head = 1;
        assert_eq!(
            s.victim(100, VICTIM_LIVE_MAX),
            None,
            "the open head is skipped, the other is all live"
        );
        s.head_full = true;
        assert_eq!(
            s.victim(100, VICTIM_LIVE_MAX),
            Some(1),
            "a full head is cleanable"
        );
    }

    #[test]
    fn victim_prefers_emptier_and_older() {
        let mut s = Segments::new(10, 1000);
        for (seg, live, seq) in [(0u32, 900u64, 10u64), (1, 100, 10), (2, 100, 90)] {
            s.set_state(seg, SegState::Log { max_batch_seq: 1 });
            s.add_live(seg, live, seq);
        }
        assert_eq!(s.pick_victim(100, &[], VICTIM_LIVE_MAX), Some(1));
        assert_eq!(s.pick_victim(100, &[1], VICTIM_LIVE_MAX), Some(2));
    }

    #[test]
    fn fuller_victims_only_when_writes_need_the_space() {
        let mut s = Segments::new(20, 1000);
        // Segment 1, 85 % live but old, scores above segment 2, 75 % live and new.
        for (seg, live, seq) in [(0u32, 960u64, 1u64), (1, 850, 1), (2, 750, 95)] {
            s.alloc(false).unwrap();
            s.set_state(seg, SegState::Log { max_batch_seq: 1 });
            s.add_live(seg, live, seq);
        }
        s.head = 3;
        assert_eq!(s.victim(100, VICTIM_LIVE_MAX), Some(1));
        assert_eq!(s.victim(100, BACKGROUND_LIVE_MAX), Some(2));
        s.head_full = true;
        assert!(
            !s.writes_need_space(),
            "17 free, reserve 4: a full head is left for a write"
        );
        s.last_wait = Some(Instant::now());
        assert!(s.writes_need_space(), "a transaction just waited for space");
        s.last_wait = Instant::now().checked_sub(DEMAND_WINDOW);
        assert!(!s.writes_need_space());
        while s.free_count() > s.reserve + DEMAND_MARGIN {
            s.alloc(false).unwrap();
        }
        assert!(s.writes_need_space(), "free segments near the reserve");
    }
}
