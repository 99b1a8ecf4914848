//! IO counters of a device: relaxed atomics bumped at submit and completion (no allocation,
//! no lock on the IO path), read as a snapshot by `perf dump` and the metrics endpoint.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::device::Op;

#[derive(Debug, Default)]
pub struct IoCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    /// Write zeroes and deallocate.
    other: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    completions: AtomicU64,
    errors: AtomicU64,
    /// Submitted and not yet completed, over every queue of the device.
    in_flight: AtomicU64,
    /// Highest `in_flight` seen.
    in_flight_max: AtomicU64,
}

/// A device's IO counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub other: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub completions: u64,
    /// Completions that carried an error (IO error or short transfer).
    pub errors: u64,
    /// Gauge: requests in flight now (the device's queue depth in use).
    pub in_flight: u64,
    /// Gauge: the highest queue depth in use seen since the device was opened.
    pub in_flight_max: u64,
}

impl IoCounters {
    /// A request was accepted by a queue.
    #[inline]
    pub fn submitted(&self, op: Op, bytes: u64) {
        match op {
            Op::Read => {
                self.reads.fetch_add(1, Relaxed);
                self.read_bytes.fetch_add(bytes, Relaxed);
            }
            Op::Write { .. } => {
                self.writes.fetch_add(1, Relaxed);
                self.write_bytes.fetch_add(bytes, Relaxed);
            }
            Op::Flush => {
                self.flushes.fetch_add(1, Relaxed);
            }
            Op::WriteZeroes | Op::Deallocate => {
                self.other.fetch_add(1, Relaxed);
            }
        }
        let now = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.in_flight_max.fetch_max(now, Relaxed);
    }

    /// A request finished (`ok` false: it carried an error).
    #[inline]
    pub fn completed(&self, ok: bool) {
        self.completions.fetch_add(1, Relaxed);
        if !ok {
            self.errors.fetch_add(1, Relaxed);
        }
        self.in_flight.fetch_sub(1, Relaxed);
    }

    pub fn snapshot(&self) -> IoStats {
        IoStats {
            reads: self.reads.load(Relaxed),
            writes: self.writes.load(Relaxed),
            flushes: self.flushes.load(Relaxed),
            other: self.other.load(Relaxed),
            read_bytes: self.read_bytes.load(Relaxed),
            write_bytes: self.write_bytes.load(Relaxed),
            completions: self.completions.load(Relaxed),
            errors: self.errors.load(Relaxed),
            in_flight: self.in_flight.load(Relaxed),
            in_flight_max: self.in_flight_max.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_ops_bytes_errors_and_depth() {
        let c = IoCounters::default();
        c.submitted(Op::Read, 4096);
        c.submitted(Op::Write { fua: false }, 8192);
        c.submitted(Op::Flush, 0);
        let s = c.snapshot();
        assert_eq!((s.reads, s.writes, s.flushes), (1, 1, 1));
        assert_eq!((s.read_bytes, s.write_bytes), (4096, 8192));
        assert_eq!((s.in_flight, s.in_flight_max), (3, 3));
        c.completed(true);
        c.completed(false);
        let s = c.snapshot();
        assert_eq!(
            (s.completions, s.errors, s.in_flight, s.in_flight_max),
            (2, 1, 1, 3)
        );
    }
}
