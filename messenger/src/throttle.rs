//! Backpressure: caps on messages and bytes in flight, with a FIFO of paused connections.
//!
//! A worker asks for capacity when it has decoded a frame header and before it reads the
//! payload. When the cap is hit the connection is queued here and the worker stops reading it
//! (drops read interest); it is never polled or retried. When capacity is released (a received
//! message is dropped, on any thread) the throttle grants it to the queue's head, in order, and
//! wakes that connection's worker with the grant. First come, first served: a connection that
//! was granted and wants more goes to the back, so one connection cannot starve the others.
//!
//! Capacity is held as [`Hold`]s, released on drop, so no path can leak or double-release it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Caps on what a throttle lets in flight at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottleLimits {
    pub messages_max: u64,
    pub bytes_max: u64,
}

impl ThrottleLimits {
    pub const UNLIMITED: ThrottleLimits = ThrottleLimits {
        messages_max: u64::MAX,
        bytes_max: u64::MAX,
    };
}

/// Counters of one throttle (or, for per-connection throttles, all of them together).
#[derive(Debug, Default)]
pub(crate) struct ThrottleCounters {
    acquired: AtomicU64,
    paused: AtomicU64,
    resumed: AtomicU64,
    paused_ns: AtomicU64,
    messages_max: AtomicU64,
    bytes_max: AtomicU64,
    messages_now: AtomicU64,
    bytes_now: AtomicU64,
}

/// A snapshot of throttle counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThrottleStats {
    /// Grants, immediate or after a pause.
    pub acquired: u64,
    /// Times a connection had to stop reading because the cap was hit.
    pub paused: u64,
    /// Times a paused connection was granted capacity and woken.
    pub resumed: u64,
    /// Messages and bytes in flight now (summed over connections for the per-connection class).
    pub messages_current: u64,
    pub bytes_current: u64,
    /// High-water marks of a single throttle.
    pub messages_max: u64,
    pub bytes_max: u64,
    /// Total time connections spent paused.
    pub paused_ns: u64,
}

impl ThrottleCounters {
    pub(crate) fn snapshot(&self) -> ThrottleStats {
        ThrottleStats {
            acquired: self.acquired.load(Relaxed),
            paused: self.paused.load(Relaxed),
            resumed: self.resumed.load(Relaxed),
            messages_current: self.messages_now.load(Relaxed),
            bytes_current: self.bytes_now.load(Relaxed),
            messages_max: self.messages_max.load(Relaxed),
            bytes_max: self.bytes_max.load(Relaxed),
            paused_ns: self.paused_ns.load(Relaxed),
        }
    }
}

type GrantFn = Box<dyn FnOnce(Hold) + Send>;

struct Waiter {
    key: u64,
    bytes: u64,
    since: Instant,
    grant: GrantFn,
}

struct State {
    messages: u64,
    bytes: u64,
    waiters: VecDeque<Waiter>,
}

/// One cap on messages and bytes in flight.
pub struct Throttle {
    limits: ThrottleLimits,
    state: Mutex<State>,
    counters: Arc<ThrottleCounters>,
}

/// Capacity for one message of `bytes` bytes, given back when dropped.
pub struct Hold {
    throttle: Arc<Throttle>,
    bytes: u64,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hold({} bytes)", self.bytes)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.throttle.release(self.bytes);
    }
}

impl Throttle {
    pub(crate) fn new(limits: ThrottleLimits, counters: Arc<ThrottleCounters>) -> Arc<Throttle> {
        Arc::new(Throttle {
            limits,
            state: Mutex::new(State {
                messages: 0,
                bytes: 0,
                waiters: VecDeque::new(),
            }),
            counters,
        })
    }

    pub(crate) fn counters(&self) -> &ThrottleCounters {
        &self.counters
    }

    /// A message always fits into an empty throttle, however large, so a frame bigger than the
    /// byte cap cannot wedge a connection.
    fn fits(&self, s: &State, bytes: u64) -> bool {
        s.messages < self.limits.messages_max
            && (s.messages == 0 || s.bytes + bytes <= self.limits.bytes_max)
    }

    fn take(&self, s: &mut State, bytes: u64) {
        s.messages += 1;
        s.bytes += bytes;
        let c = &self.counters;
        c.acquired.fetch_add(1, Relaxed);
        c.messages_now.fetch_add(1, Relaxed);
        c.bytes_now.fetch_add(bytes, Relaxed);
        c.messages_max.fetch_max(s.messages, Relaxed);
        c.bytes_max.fetch_max(s.bytes, Relaxed);
    }

    /// Take capacity now, or queue `key` and return `None`: `grant` is called later (on the
    /// releasing thread) with the capacity.
    pub(crate) fn acquire(
        self: &Arc<Self>,
        key: u64,
        bytes: u64,
        grant: impl FnOnce(Hold) + Send + 'static,
    ) -> Option<Hold> {
        let mut s = self.state.lock().expect("throttle lock");
        if s.waiters.is_empty() && self.fits(&s, bytes) {
            self.take(&mut s, bytes);
            return Some(Hold {
                throttle: self.clone(),
                bytes,
            });
        }
        s.waiters.push_back(Waiter {
            key,
            bytes,
            since: Instant::now(),
            grant: Box::new(grant),
        });
        self.counters.paused.fetch_add(1, Relaxed);
        None
    }

    /// Forget a queued waiter (its connection closed). A grant already handed out is not
    /// affected: it travels as a `Hold` and is released wherever it is dropped.
    pub(crate) fn cancel(&self, key: u64) {
        let mut s = self.state.lock().expect("throttle lock");
        s.waiters.retain(|w| w.key != key);
    }

    fn release(self: &Arc<Self>, bytes: u64) {
        let mut granted = Vec::new();
        {
            let mut s = self.state.lock().expect("throttle lock");
            s.messages -= 1;
            s.bytes -= bytes;
            self.counters.messages_now.fetch_sub(1, Relaxed);
            self.counters.bytes_now.fetch_sub(bytes, Relaxed);
            while let Some(w) = s.waiters.front() {
                if !self.fits(&s, w.bytes) {
                    break;
                }
                let w = s.waiters.pop_front().expect("front exists");
                self.take(&mut s, w.bytes);
                self.counters.resumed.fetch_add(1, Relaxed);
                self.counters
                    .paused_ns
                    .fetch_add(w.since.elapsed().as_nanos() as u64, Relaxed);
                granted.push(w);
            }
        }
        // Wake outside the lock: a grant may be dropped right away (its worker is gone), which
        // re-enters `release`.
        for w in granted {
            (w.grant)(Hold {
                throttle: self.clone(),
                bytes: w.bytes,
            });
        }
    }

    #[cfg(test)]
    fn in_flight(&self) -> (u64, u64) {
        let s = self.state.lock().unwrap();
        (s.messages, s.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn caps_queue_in_fifo_order_and_release_wakes_the_head() {
        let counters = Arc::new(ThrottleCounters::default());
        let t = Throttle::new(
            ThrottleLimits {
                messages_max: 2,
                bytes_max: 100,
            },
            counters.clone(),
        );
        let (tx, rx) = mpsc::channel();
        let a = t.acquire(1, 10, |_| unreachable!()).expect("fits");
        let b = t.acquire(1, 10, |_| unreachable!()).expect("fits");
        for key in 2..5u64 {
            let tx = tx.clone();
            assert!(t
                .acquire(key, 10, move |h| tx.send((key, h)).unwrap())
                .is_none());
        }
        assert_eq!(t.in_flight(), (2, 20));
        drop(a);
        let (k, h2) = rx.try_recv().unwrap();
        assert_eq!(k, 2);
        assert!(rx.try_recv().is_err(), "only one slot was freed");
        t.cancel(3);
        drop(b);
        assert_eq!(rx.try_recv().unwrap().0, 4);
        drop(h2);
        let s = counters.snapshot();
        assert_eq!(
            (s.acquired, s.paused, s.resumed, s.messages_max),
            (4, 3, 2, 2)
        );
        assert_eq!(s.messages_current, 0);
    }

    #[test]
    fn a_message_larger_than_the_byte_cap_passes_alone() {
        let t = Throttle::new(
            ThrottleLimits {
                messages_max: 10,
                bytes_max: 100,
            },
            Default::default(),
        );
        let big = t
            .acquire(1, 1000, |_| unreachable!())
            .expect("empty throttle admits anything");
        let (tx, rx) = mpsc::channel();
        assert!(t.acquire(2, 1, move |h| tx.send(h).unwrap()).is_none());
        drop(big);
        assert!(rx.try_recv().is_ok());
    }

    #[test]
    fn newcomers_queue_behind_waiters_even_if_they_would_fit() {
        let t = Throttle::new(
            ThrottleLimits {
                messages_max: 10,
                bytes_max: 100,
            },
            Default::default(),
        );
        let a = t.acquire(1, 90, |_| unreachable!()).unwrap();
        let (tx, rx) = mpsc::channel();
        let tx2 = tx.clone();
        assert!(t
            .acquire(2, 50, move |h| tx.send((2, h)).unwrap())
            .is_none());
        assert!(
            t.acquire(3, 5, move |h| tx2.send((3, h)).unwrap())
                .is_none(),
            "must not overtake key 2"
        );
        drop(a);
        let order: Vec<u64> = rx.try_iter().map(|(k, _h)| k).collect();
        assert_eq!(order, vec![2, 3]);
    }
}
