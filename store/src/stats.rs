//! Store counters: cheap atomics, read by reports and `perf dump`.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Buckets of [`RoundHistogram`]: 1, 2, 3-4, 5-8, ..., 65-128, and more than 128.
pub const ROUND_TXNS_BUCKETS: usize = 9;

/// How many transactions each group-commit round made durable (log2 buckets).
#[derive(Debug, Default)]
pub struct RoundHistogram([Counter; ROUND_TXNS_BUCKETS]);

impl RoundHistogram {
    /// Bucket of a round of `txns` transactions: the smallest `i` with `txns <= 2^i`.
    pub fn bucket(txns: u64) -> usize {
        let i = txns.max(1).next_power_of_two().trailing_zeros() as usize;
        i.min(ROUND_TXNS_BUCKETS - 1)
    }

    pub fn record(&self, txns: u64) {
        self.0[Self::bucket(txns)].inc();
    }

    pub fn snapshot(&self) -> [u64; ROUND_TXNS_BUCKETS] {
        std::array::from_fn(|i| self.0[i].get())
    }
}

#[derive(Debug, Default)]
pub struct Stats {
    /// User transactions committed.
    pub txns: Counter,
    /// Object data bytes users wrote (chunk payloads).
    pub user_bytes: Counter,
    /// Every byte written to the device: data, metadata, padding, relocation, checkpoints.
    pub device_bytes_written: Counter,
    /// Commit rounds (each one durable point).
    pub rounds: Counter,
    pub batches: Counter,
    pub flushes: Counter,
    /// Rounds made durable by a single FUA write instead of write + flush.
    pub fua_rounds: Counter,
    pub checkpoints: Counter,
    pub relocated_bytes: Counter,
    pub reloc_conflicts: Counter,
    pub reads: Counter,
    pub read_bytes: Counter,
    pub read_retries: Counter,
    pub corrupt_reads: Counter,
    pub txn_conflicts: Counter,
    pub cleaned_segments: Counter,
    pub next_op_seq: Counter,
    pub replay_start_batch: Counter,
    pub log_head_batch: Counter,
    /// Transactions per commit round (user and background).
    pub round_txns: RoundHistogram,
}

/// A snapshot of the counters that matter for reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub txns: u64,
    pub user_bytes: u64,
    pub device_bytes_written: u64,
    pub rounds: u64,
    pub batches: u64,
    pub flushes: u64,
    pub fua_rounds: u64,
    pub checkpoints: u64,
    pub relocated_bytes: u64,
    pub reads: u64,
    pub read_bytes: u64,
    pub corrupt_reads: u64,
    pub cleaned_segments: u64,
    /// Commit rounds by transactions made durable: bucket i holds rounds of at most 2^i
    /// (and more than 2^(i-1)); the last bucket holds everything larger.
    pub round_txns: [u64; ROUND_TXNS_BUCKETS],
}

impl StatsSnapshot {
    /// Device bytes written per user byte.
    pub fn write_amplification(&self) -> f64 {
        self.device_bytes_written as f64 / self.user_bytes.max(1) as f64
    }

    /// Average transactions made durable per round (group commit batch size).
    pub fn txns_per_round(&self) -> f64 {
        self.txns as f64 / self.rounds.max(1) as f64
    }
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            txns: self.txns.get(),
            user_bytes: self.user_bytes.get(),
            device_bytes_written: self.device_bytes_written.get(),
            rounds: self.rounds.get(),
            batches: self.batches.get(),
            flushes: self.flushes.get(),
            fua_rounds: self.fua_rounds.get(),
            checkpoints: self.checkpoints.get(),
            relocated_bytes: self.relocated_bytes.get(),
            reads: self.reads.get(),
            read_bytes: self.read_bytes.get(),
            corrupt_reads: self.corrupt_reads.get(),
            cleaned_segments: self.cleaned_segments.get(),
            round_txns: self.round_txns.snapshot(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_sizes_land_in_log2_buckets() {
        let h = RoundHistogram::default();
        for n in [0, 1, 2, 3, 4, 5, 8, 9, 128, 129, 10_000] {
            h.record(n);
        }
        assert_eq!(h.snapshot(), [2, 1, 2, 2, 1, 0, 0, 1, 2]);
    }
}
