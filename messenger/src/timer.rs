//! A worker's timer heap. Entries are never removed in place: a timer whose purpose is gone (the
//! request was answered, the handshake finished) is skipped when it reaches the top, and the
//! heap is compacted when dead entries outnumber live ones, so it stays O(live) in size.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

/// A user timer: runs on its worker; returning `Some(d)` re-arms it `d` from now.
pub type UserTimer = Box<dyn FnMut() -> Option<Duration> + Send>;

pub(crate) enum TimerAction {
    /// Watch listener `idx` again after accept failed for lack of resources.
    Relisten {
        idx: usize,
    },
    RequestTimeout {
        slot: u32,
        gen: u32,
        txn: u64,
    },
    /// Connect or handshake did not finish in time. `sock` is the connection's socket generation
    /// when armed.
    EstablishTimeout {
        slot: u32,
        gen: u32,
        sock: u32,
    },
    Reconnect {
        slot: u32,
        gen: u32,
    },
    User(UserTimer),
}

struct Entry {
    due: Instant,
    seq: u64,
    action: TimerAction,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    /// Reversed: BinaryHeap is a max-heap and we want the earliest first (FIFO among equals).
    fn cmp(&self, o: &Self) -> Ordering {
        (o.due, o.seq).cmp(&(self.due, self.seq))
    }
}

/// Compact when the heap holds this many entries beyond twice its size after the last compaction.
const COMPACT_SLACK: usize = 1024;

#[derive(Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Entry>,
    seq: u64,
    /// Heap size after the last compaction: everything in it was live then.
    live_at_compaction: usize,
}

impl Timers {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn push(&mut self, due: Instant, action: TimerAction) {
        self.seq += 1;
        self.heap.push(Entry {
            due,
            seq: self.seq,
            action,
        });
    }

    /// Drop dead entries from the top, then return the earliest live deadline.
    pub fn next_due(&mut self, live: impl Fn(&TimerAction) -> bool) -> Option<Instant> {
        while let Some(top) = self.heap.peek() {
            if live(&top.action) {
                return Some(top.due);
            }
            self.heap.pop();
        }
        None
    }

    /// Pop the earliest entry if it is due at `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<TimerAction> {
        if self.heap.peek()?.due <= now {
            return self.heap.pop().map(|e| e.action);
        }
        None
    }

    /// Remove dead entries once the heap has more than doubled since the last compaction
    /// (amortised O(1) per push).
    pub fn maybe_compact(&mut self, live: impl Fn(&TimerAction) -> bool) {
        if self.heap.len() > 2 * self.live_at_compaction + COMPACT_SLACK {
            self.heap.retain(|e| live(&e.action));
            self.live_at_compaction = self.heap.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(a: &TimerAction) -> u64 {
        match a {
            TimerAction::RequestTimeout { txn, .. } => *txn,
            _ => u64::MAX,
        }
    }

    #[test]
    fn earliest_first_dead_skipped_and_compaction_keeps_live() {
        let mut t = Timers::default();
        let now = Instant::now();
        for txn in 0..3000u64 {
            t.push(
                now + Duration::from_micros(3000 - txn),
                TimerAction::RequestTimeout {
                    slot: 0,
                    gen: 0,
                    txn,
                },
            );
        }
        let live = |a: &TimerAction| key(a).is_multiple_of(1000);
        assert_eq!(t.next_due(live), Some(now + Duration::from_micros(1000)));
        t.maybe_compact(live);
        assert_eq!(t.len(), 3);
        assert!(t.pop_due(now).is_none());
        let later = now + Duration::from_secs(1);
        let fired: Vec<u64> = std::iter::from_fn(|| t.pop_due(later))
            .map(|a| key(&a))
            .collect();
        assert_eq!(fired, vec![2000, 1000, 0]);
    }
}
