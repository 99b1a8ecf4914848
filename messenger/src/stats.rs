//! Counters. Each worker writes its own counters (single writer: a plain load and store, no
//! locked instruction) and anyone may read a snapshot.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::Relaxed};

use crate::pool::PoolStats;
use crate::throttle::ThrottleStats;

#[derive(Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    /// Only the owning worker calls this.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }

    #[inline]
    pub fn sub(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_sub(n), Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

macro_rules! worker_counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        #[derive(Default)]
        pub(crate) struct WorkerCounters {
            pub tid: AtomicI32,
            $(pub $name: Counter,)*
        }

        /// One worker's counters.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct WorkerStats {
            /// Kernel thread id of `msgr-worker-N` (for /proc/self/task/TID).
            pub tid: i32,
            $($(#[$doc])* pub $name: u64,)*
        }

        impl WorkerCounters {
            pub fn snapshot(&self) -> WorkerStats {
                WorkerStats { tid: self.tid.load(Relaxed), $($name: self.$name.get(),)* }
            }
        }
    };
}

worker_counters! {
    /// Loop passes that slept or found work (idle busy-poll spins are counted apart).
    iterations,
    /// Passes that woke from a sleep and found nothing to do: the incident's symptom.
    empty_iterations,
    /// Blocking waits (with a floored timeout, or until an event).
    sleeps,
    /// Zero-timeout polls inside the busy-poll window that found nothing.
    busy_poll_spins,
    /// Time spent in those polls.
    busy_poll_ns,
    /// Passes with socket events.
    wake_io,
    /// Passes with commands from the mailbox (other threads, replies, grants).
    wake_mailbox,
    /// Passes that fired timers.
    wake_timer,
    /// Passes that wrote a whole pass budget of bulk data and then yielded the CPU to any
    /// thread waiting for it.
    bulk_yields,
    timers_fired,
    frames_in,
    frames_out,
    bytes_in,
    bytes_out,
    conns_open,
    conns_accepted,
    /// Connections closed for breaking the protocol (bad magic, crc, length, …).
    protocol_errors,
    /// Handshakes that failed authentication.
    auth_failures,
    /// Replies that arrived after their request timed out.
    late_replies,
    reconnects,
}

/// A messenger's counters.
#[derive(Debug, Clone, Default)]
pub struct MessengerStats {
    pub workers: Vec<WorkerStats>,
    /// The global throttle for messages from `client.N` peers.
    pub client_throttle: ThrottleStats,
    /// The global throttle for messages from `node.N` peers.
    pub node_throttle: ThrottleStats,
    /// All per-connection throttles together.
    pub conn_throttles: ThrottleStats,
    pub pool: PoolStats,
}

impl MessengerStats {
    /// Sum of one counter over workers.
    pub fn total(&self, f: impl Fn(&WorkerStats) -> u64) -> u64 {
        self.workers.iter().map(f).sum()
    }
}
