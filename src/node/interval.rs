//! Which primary of each PG this node takes shard and recovery ops from, and the hand-over
//! between two primaries.
//!
//! Per PG the node records the newest (epoch, primary) that sent it an op; a primary of an
//! older epoch is refused from then on (the interval race, see `Node::check_shard_sender`).
//! That check alone leaves a window: an op of the old primary that passed it a moment before
//! the new primary's first op arrived may still be applying when the new primary's op is
//! served — typically its query of the PG log, which would then miss a write that lands
//! right after the answer, a write the new primary never hears of. So every op that passes
//! the check is *admitted* ([`Admitted`], held until the op's change is durable or it
//! failed), and the first op of a new primary waits until the ops admitted under earlier
//! primaries are done (bounded by [`DRAIN_WAIT`]; then it is refused and the new primary
//! retries). This is the order Ceph gets from serving each PG's ops one at a time under the
//! PG lock: everything the member took from the old primary happens before it answers the
//! new one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use messenger::Identity;

use crate::error::{Error, Result};
use crate::wire::Status;

/// How long a new primary's op waits for the ops admitted under the PG's earlier primaries.
pub const DRAIN_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Interval {
    /// The newest epoch any sender of the PG's ops used, and that sender.
    epoch: u64,
    primary: Identity,
    /// Bumped at each change of primary; an [`Admitted`] of an older generation is one of
    /// the `draining` ops.
    gen: u64,
    /// Ops admitted under the current primary and not done.
    inflight: u32,
    /// Ops admitted under earlier primaries and not done.
    draining: u32,
}

/// The per-PG record, shared with the [`Admitted`] guards (which outlive the call that made
/// them when an op completes on the store's commit thread).
#[derive(Default)]
pub struct Intervals {
    map: Mutex<HashMap<(u64, u32), Interval>>,
    drained: Condvar,
    /// Ops that waited for a previous primary's ops to finish.
    pub drain_waits: AtomicU64,
    /// Of those, ops refused because the wait ran out.
    pub drain_timeouts: AtomicU64,
}

/// What [`Intervals::admit`] decided.
pub enum Admission {
    Admitted(Admitted),
    /// `sender` is superseded by the primary of `since` (the op is refused).
    Superseded {
        primary: Identity,
        since: u64,
    },
    /// Ops of an earlier primary are still in flight and the caller asked not to wait.
    WouldWait,
}

impl Intervals {
    /// Admit `sender`'s op of `epoch` for the PG: record a newer sender as the PG's primary;
    /// refuse a sender that a newer primary superseded (the same primary's own older-epoch
    /// ops are its to order); then, if ops admitted under an earlier primary are still in
    /// flight, wait for them (when `wait`) for up to [`DRAIN_WAIT`].
    pub fn admit(
        self: &Arc<Self>,
        sender: Identity,
        epoch: u64,
        pool: u64,
        pg: u32,
        wait: bool,
    ) -> Result<Admission> {
        let key = (pool, pg);
        let mut deadline = None;
        let mut map = self.map.lock().unwrap();
        loop {
            let iv = map.entry(key).or_insert(Interval {
                epoch,
                primary: sender,
                gen: 0,
                inflight: 0,
                draining: 0,
            });
            if epoch > iv.epoch {
                if sender != iv.primary {
                    iv.draining += iv.inflight;
                    iv.inflight = 0;
                    iv.gen += 1;
                    iv.primary = sender;
                }
                iv.epoch = epoch;
            } else if epoch < iv.epoch && sender != iv.primary {
                return Ok(Admission::Superseded {
                    primary: iv.primary,
                    since: iv.epoch,
                });
            }
            if iv.draining == 0 {
                iv.inflight += 1;
                return Ok(Admission::Admitted(Admitted {
                    intervals: self.clone(),
                    key,
                    gen: iv.gen,
                }));
            }
            if !wait {
                return Ok(Admission::WouldWait);
            }
            let now = Instant::now();
            let until = *deadline.get_or_insert_with(|| {
                self.drain_waits.fetch_add(1, Relaxed);
                now + DRAIN_WAIT
            });
            if now >= until {
                self.drain_timeouts.fetch_add(1, Relaxed);
                return Err(Error::remote(
                    Status::TimedOut,
                    format!(
                        "pg {pool}.{pg:x}: {} op(s) of its previous primary still in flight \
                         after {} s (retry)",
                        iv.draining,
                        DRAIN_WAIT.as_secs()
                    ),
                ));
            }
            map = self.drained.wait_timeout(map, until - now).unwrap().0;
        }
    }

    fn done(&self, key: (u64, u32), gen: u64) {
        let mut map = self.map.lock().unwrap();
        let Some(iv) = map.get_mut(&key) else {
            return;
        };
        if gen == iv.gen {
            iv.inflight -= 1;
        } else {
            iv.draining -= 1;
            if iv.draining == 0 {
                self.drained.notify_all();
            }
        }
    }

    /// (ops in flight under the current primary, ops of earlier primaries in flight) of a
    /// PG, for tests.
    #[cfg(test)]
    fn counts(&self, pool: u64, pg: u32) -> (u32, u32) {
        let map = self.map.lock().unwrap();
        map.get(&(pool, pg))
            .map_or((0, 0), |iv| (iv.inflight, iv.draining))
    }
}

/// An op that passed the interval check, in flight until dropped: keep it until the op's
/// change is applied (durable) or has failed.
#[must_use = "an admitted op counts as in flight until this is dropped"]
pub struct Admitted {
    intervals: Arc<Intervals>,
    key: (u64, u32),
    gen: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.intervals.done(self.key, self.gen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admit(iv: &Arc<Intervals>, who: u32, epoch: u64, wait: bool) -> Admission {
        iv.admit(Identity::Node(who), epoch, 1, 7, wait).unwrap()
    }

    fn admitted(a: Admission) -> Admitted {
        match a {
            Admission::Admitted(a) => a,
            Admission::Superseded { primary, since } => {
                panic!("superseded by {primary} since {since}")
            }
            Admission::WouldWait => panic!("would wait"),
        }
    }

    #[test]
    fn a_new_primary_waits_for_the_old_ones_ops_in_flight() {
        let iv = Arc::new(Intervals::default());
        let w1 = admitted(admit(&iv, 1, 5, true));
        let w2 = admitted(admit(&iv, 1, 5, true));
        assert_eq!(iv.counts(1, 7), (2, 0));
        // Node 2 leads from epoch 6: without waiting it is told to come back.
        assert!(matches!(admit(&iv, 2, 6, false), Admission::WouldWait));
        assert_eq!(iv.counts(1, 7), (0, 2));
        // The old primary is refused from now on, in flight or not.
        assert!(matches!(
            admit(&iv, 1, 5, true),
            Admission::Superseded { since: 6, .. }
        ));
        // A waiting op of the new primary goes on once both old ops are done, not before.
        let (tx, rx) = std::sync::mpsc::channel();
        let iv2 = iv.clone();
        let t = std::thread::spawn(move || {
            let a = admitted(admit(&iv2, 2, 6, true));
            tx.send(()).unwrap();
            a
        });
        drop(w1);
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        drop(w2);
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let a = t.join().unwrap();
        assert_eq!(iv.counts(1, 7), (1, 0));
        assert_eq!(iv.drain_waits.load(Relaxed), 1);
        drop(a);
        assert_eq!(iv.counts(1, 7), (0, 0));
    }

    #[test]
    fn the_same_primary_in_a_newer_epoch_does_not_wait_for_itself() {
        let iv = Arc::new(Intervals::default());
        let _w = admitted(admit(&iv, 1, 5, true));
        let _n = admitted(admit(&iv, 1, 9, false));
        // Its own older-epoch ops are still its to order.
        let _o = admitted(admit(&iv, 1, 5, false));
        assert_eq!(iv.counts(1, 7), (3, 0));
        // Other PGs are separate.
        let _p = admitted(iv.admit(Identity::Node(2), 9, 1, 8, false).unwrap());
        assert_eq!(iv.counts(1, 8), (1, 0));
    }

    #[test]
    fn ops_of_several_earlier_primaries_all_drain() {
        let iv = Arc::new(Intervals::default());
        let a = admitted(admit(&iv, 1, 5, true));
        assert!(matches!(admit(&iv, 2, 6, false), Admission::WouldWait));
        // Node 2's op was never admitted; node 3 takes over at 7 while node 1's op is
        // still in flight.
        assert!(matches!(admit(&iv, 3, 7, false), Admission::WouldWait));
        assert_eq!(iv.counts(1, 7), (0, 1));
        drop(a);
        let _c = admitted(admit(&iv, 3, 7, false));
        assert_eq!(iv.counts(1, 7), (1, 0));
    }
}
