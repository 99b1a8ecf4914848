//! Store workloads shared by `cargo bench -p nvstore-store` and `nvstore bench store` (which
//! also runs inside the QEMU suite on the NVMe driver). Each returns its figure; callers print
//! and compare.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use driver::BlockDevice;

use crate::{ObjectKey, Store, Transaction};

/// The key of benchmark object `i` (pool 1): `object-` and `i` as ten zero-padded digits
/// (more when `i` needs them). Built on the stack: a `format!` here cost ~1 µs of a 4 KiB
/// read's ~7.6 µs of CPU in the read benchmarks, harness cost that fio does not pay.
pub fn key(i: u64) -> ObjectKey {
    const P: &[u8] = b"object-";
    let mut name = [0u8; P.len() + 20];
    name[..P.len()].copy_from_slice(P);
    let digits = i.checked_ilog10().map_or(1, |l| l as usize + 1).max(10);
    let end = P.len() + digits;
    let mut v = i;
    for b in name[P.len()..end].iter_mut().rev() {
        *b = b'0' + (v % 10) as u8;
        v /= 10;
    }
    ObjectKey::new(1, &name[..end], 0)
}

/// Run `threads` workers for `secs`, each calling `op(thread, i)`; returns calls per second.
pub fn drive(threads: usize, secs: f64, op: impl Fn(usize, u64) + Sync) -> f64 {
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stop, done, op) = (&stop, &done, &op);
            let named = std::thread::Builder::new().name(format!("bench-{t}"));
            named
                .spawn_scoped(s, move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        op(t, i);
                        i += 1;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
                .expect("spawn a bench thread");
        }
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
    });
    done.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64()
}

/// Write objects `0..n` with `data`: `threads` writers, 64-object transactions.
pub fn fill<D: BlockDevice + 'static>(s: &Store<D>, n: u64, data: &[u8], threads: usize) {
    let next = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let start = next.fetch_add(64, Ordering::Relaxed);
                if start >= n {
                    break;
                }
                let mut t = Transaction::new();
                for i in start..(start + 64).min(n) {
                    t.write_full(key(i), data);
                }
                s.commit(t).expect("fill");
            });
        }
    });
}

/// Latency of `n` lone synchronous 4 KiB puts: (p50, p99) in microseconds.
pub fn lone_put_latency<D: BlockDevice + 'static>(s: &Store<D>, n: u64) -> (f64, f64) {
    let data = vec![7u8; 4096];
    let mut h = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
    for i in 0..n {
        let t = Instant::now();
        s.write_full(&key(1_000_000_000 + i % 64), &data)
            .expect("put");
        h.record(t.elapsed().as_micros() as u64).expect("record");
    }
    (
        h.value_at_quantile(0.5) as f64,
        h.value_at_quantile(0.99) as f64,
    )
}

/// Durable `size`-byte write_full calls per second from `threads` writers over `objects`
/// distinct objects per writer.
pub fn durable_puts<D: BlockDevice + 'static>(
    s: &Store<D>,
    size: usize,
    threads: usize,
    objects: u64,
    secs: f64,
) -> f64 {
    let data = vec![0x11u8; size];
    drive(threads, secs, |t, i| {
        s.write_full(&key(t as u64 * 1_000_000 + i % objects), &data)
            .expect("put");
    })
}

/// Reads per second of `len` bytes at random among objects `0..n`, one thread keeping `depth`
/// reads on the device through the async reader, each poll waiting for one completion (as
/// fio does); also returns CPU µs per read.
pub fn async_reads<D: BlockDevice + 'static>(
    s: &Store<D>,
    n: u64,
    len: u64,
    depth: usize,
    secs: f64,
) -> (f64, f64) {
    let mut r = s.reader().expect("reader");
    let mut out = Vec::new();
    let (mut i, mut done) = (0u64, 0u64);
    let t0 = Instant::now();
    let cpu0 = driver::workload::thread_cpu_time();
    while t0.elapsed().as_secs_f64() < secs {
        while r.on_device() < depth {
            r.submit(&key(i.wrapping_mul(2_654_435_761) % n), 0, len, i)
                .expect("submit read");
            i += 1;
        }
        r.poll_min(&mut out, 1).expect("poll");
        for (_, res) in out.drain(..) {
            assert_eq!(res.expect("read").len() as u64, len, "short read");
            done += 1;
        }
    }
    let cpu = driver::workload::thread_cpu_time() - cpu0;
    (
        done as f64 / t0.elapsed().as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / done.max(1) as f64,
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn key_names_match_the_padded_decimal_form() {
        for i in [
            0,
            7,
            42,
            9_999_999_999,
            10_000_000_000,
            1_000_000_123,
            u64::MAX,
        ] {
            assert_eq!(
                &super::key(i).name[..],
                format!("object-{i:010}").as_bytes()
            );
        }
    }
}
