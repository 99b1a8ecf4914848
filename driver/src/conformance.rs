//! The BlockDevice conformance suite: one set of checks every backend must pass unchanged
//! (file, simulator, and the VFIO NVMe driver inside the QEMU guest).
//!
//! Each check panics with a message naming what broke. [`conformance_tests!`] expands them into
//! `#[test]` functions for a backend; the hardware suite calls them directly.

use std::collections::HashSet;
use std::time::Duration;

use crate::device::{BlockDevice, Completion, QueueHandle, Request, SubmitErrorKind};
use crate::dma::DmaBuf;
use crate::error::Error;
use crate::io::{execute, IO_TIMEOUT};

/// Deterministic pattern bytes for (seed, byte position): every 8-byte word is distinct, so a
/// misplaced block or a shifted buffer never verifies by accident.
pub fn pattern(seed: u64, pos: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let p = pos + i as u64;
        let word =
            (p / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        *b = (word >> ((p % 8) * 8)) as u8;
    }
}

fn fill_pattern(buf: &mut DmaBuf, offset: usize, len: usize, seed: u64, pos: u64) {
    let mut tmp = vec![0u8; len];
    pattern(seed, pos, &mut tmp);
    buf.write_at(offset, &tmp);
}

fn check_pattern(buf: &DmaBuf, offset: usize, len: usize, seed: u64, pos: u64, what: &str) {
    let mut want = vec![0u8; len];
    pattern(seed, pos, &mut want);
    let mut got = vec![0u8; len];
    buf.read_at(offset, &mut got);
    if got != want {
        let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
        panic!(
            "{what}: data mismatch at byte {first} of {len}: got {:#04x}, want {:#04x}",
            got[first], want[first]
        );
    }
}

fn ok(c: Completion, what: &str) -> Option<DmaBuf> {
    match c.result {
        Ok(()) => c.buf,
        Err(e) => panic!("{what}: {e}"),
    }
}

/// Every transfer size from one block to the maximum transfer round-trips, at a buffer offset
/// of `dma_alignment` as well as 0 (for NVMe: PRP lists from a page-unaligned start).
pub fn round_trip_all_sizes<D: BlockDevice>(dev: &D) {
    let geo = dev.geometry().clone();
    let bs = geo.block_size as usize;
    let max_blocks = geo.max_transfer_blocks();
    let mut q = dev.open_queue().expect("open queue");
    let misalign = if (geo.dma_alignment as usize) < bs {
        geo.dma_alignment as usize
    } else {
        0
    };
    let mut wbuf = Some(dev.alloc_buf(geo.max_transfer_bytes as usize + bs).unwrap());
    let mut rbuf = Some(dev.alloc_buf(geo.max_transfer_bytes as usize + bs).unwrap());
    let span = (geo.capacity_blocks - max_blocks as u64).max(1);
    for blocks in 1..=max_blocks {
        for &off in &[0usize, misalign] {
            let lba = (blocks as u64 * 7919 + off as u64) % span;
            let len = blocks as usize * bs;
            let seed = blocks as u64 * 31 + off as u64;
            let mut w = wbuf.take().unwrap();
            fill_pattern(&mut w, off, len, seed, lba * bs as u64);
            let what = format!("{} blocks at LBA {lba}, buffer offset {off}", blocks);
            wbuf = ok(
                execute(
                    &mut q,
                    Request::write(lba, blocks, w, off, false, 1),
                    IO_TIMEOUT,
                ),
                &what,
            );
            let mut r = rbuf.take().unwrap();
            r.fill(0, r.len(), 0xa5);
            let r = ok(
                execute(&mut q, Request::read(lba, blocks, r, off, 2), IO_TIMEOUT),
                &what,
            )
            .unwrap();
            check_pattern(&r, off, len, seed, lba * bs as u64, &what);
            rbuf = Some(r);
        }
    }
}

fn expect_rejected<Q: QueueHandle>(q: &mut Q, req: Request, what: &str) -> Error {
    let tag = req.tag;
    let had_buf = req.buf.is_some();
    match q.submit(req) {
        Ok(()) => panic!("{what}: accepted, expected a clear error"),
        Err(e) => {
            assert_eq!(
                e.request.tag, tag,
                "{what}: the rejected request must come back"
            );
            assert_eq!(
                e.request.buf.is_some(),
                had_buf,
                "{what}: the buffer must come back"
            );
            match e.kind {
                SubmitErrorKind::Rejected(err) => *err,
                SubmitErrorKind::QueueFull => {
                    panic!("{what}: reported queue full on an idle queue")
                }
            }
        }
    }
}

/// Misaligned buffers, byte offsets and lengths, oversized and empty transfers are refused at
/// submit with a clear error, the request handed back, and the queue keeps working.
pub fn misaligned_rejected<D: BlockDevice>(dev: &D) {
    let geo = dev.geometry().clone();
    let bs = geo.block_size as usize;
    let mut q = dev.open_queue().unwrap();
    if geo.dma_alignment > 1 {
        let buf = dev.alloc_buf(2 * bs).unwrap();
        let e = expect_rejected(&mut q, Request::read(0, 1, buf, 1, 7), "buffer offset 1");
        assert!(
            matches!(e, Error::Misaligned { .. }),
            "buffer offset 1: got {e}"
        );
        assert!(
            e.to_string().contains("aligned"),
            "message should say why: {e}"
        );
    }
    let e = geo
        .blocks_for(dev.name(), bs as u64 / 2, bs as u64)
        .unwrap_err();
    assert!(
        matches!(e, Error::Misaligned { .. }),
        "half-block byte offset: got {e}"
    );
    let e = geo.blocks_for(dev.name(), 0, bs as u64 + 1).unwrap_err();
    assert!(
        matches!(e, Error::Misaligned { .. }),
        "length not a block multiple: got {e}"
    );
    let small = dev.alloc_buf(bs).unwrap();
    let e = expect_rejected(
        &mut q,
        Request::write(0, 2, small, 0, false, 8),
        "buffer too small",
    );
    assert!(
        matches!(e, Error::Invalid { .. }),
        "buffer too small: got {e}"
    );
    let buf = dev.alloc_buf(bs).unwrap();
    let e = expect_rejected(&mut q, Request::read(0, 0, buf, 0, 9), "zero blocks");
    assert!(matches!(e, Error::Invalid { .. }), "zero blocks: got {e}");
    let big = dev.alloc_buf(geo.max_transfer_bytes as usize + bs).unwrap();
    let blocks = geo.max_transfer_blocks() + 1;
    let e = expect_rejected(
        &mut q,
        Request::read(0, blocks, big, 0, 10),
        "over max transfer",
    );
    assert!(
        e.to_string().contains("maximum transfer"),
        "over max transfer: got {e}"
    );
    let data = dev.alloc_buf(bs).unwrap();
    let c = execute(&mut q, Request::read(0, 1, data, 0, 11), IO_TIMEOUT);
    ok(c, "read after rejected requests");
}

/// LBAs past the end are refused with `OutOfRange`, including ranges that overflow u64; the
/// device works afterwards.
pub fn out_of_range_rejected<D: BlockDevice>(dev: &D) {
    let geo = dev.geometry().clone();
    let bs = geo.block_size as usize;
    let cap = geo.capacity_blocks;
    let mut q = dev.open_queue().unwrap();
    for (lba, blocks) in [(cap, 1), (cap - 1, 2), (u64::MAX, 1), (u64::MAX - 1, 4)] {
        let buf = dev.alloc_buf(4 * bs).unwrap();
        let what = format!("read of {blocks} blocks at LBA {lba} (capacity {cap})");
        let e = expect_rejected(&mut q, Request::read(lba, blocks, buf, 0, 1), &what);
        assert!(matches!(e, Error::OutOfRange { .. }), "{what}: got {e}");
        let what = format!("write-zeroes at LBA {lba}");
        let e = expect_rejected(&mut q, Request::write_zeroes(lba, blocks, 2), &what);
        assert!(matches!(e, Error::OutOfRange { .. }), "{what}: got {e}");
    }
    // The last block itself is addressable.
    let mut w = dev.alloc_buf(bs).unwrap();
    fill_pattern(&mut w, 0, bs, 99, 0);
    ok(
        execute(
            &mut q,
            Request::write(cap - 1, 1, w, 0, false, 3),
            IO_TIMEOUT,
        ),
        "write last block",
    );
    let r = dev.alloc_buf(bs).unwrap();
    let r = ok(
        execute(&mut q, Request::read(cap - 1, 1, r, 0, 4), IO_TIMEOUT),
        "read last block",
    );
    check_pattern(&r.unwrap(), 0, bs, 99, 0, "last block");
}

/// Flush and FUA complete successfully and do not disturb data; an empty flush is fine.
pub fn flush_semantics<D: BlockDevice>(dev: &D) {
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().unwrap();
    ok(
        execute(&mut q, Request::flush(1), IO_TIMEOUT),
        "flush with nothing written",
    );
    for (i, fua) in [(0u64, true), (1, false)] {
        let mut w = dev.alloc_buf(4 * bs).unwrap();
        fill_pattern(&mut w, 0, 4 * bs, 500 + i, 0);
        ok(
            execute(
                &mut q,
                Request::write(100 + 8 * i, 4, w, 0, fua, 2),
                IO_TIMEOUT,
            ),
            "write",
        );
    }
    ok(
        execute(&mut q, Request::flush(3), IO_TIMEOUT),
        "flush after writes",
    );
    for i in 0..2u64 {
        let r = dev.alloc_buf(4 * bs).unwrap();
        let r = ok(
            execute(&mut q, Request::read(100 + 8 * i, 4, r, 0, 4), IO_TIMEOUT),
            "read",
        );
        check_pattern(&r.unwrap(), 0, 4 * bs, 500 + i, 0, "after flush");
    }
}

/// Write-zeroes makes blocks read as zeros; deallocate succeeds and the range is writable after.
pub fn write_zeroes_and_deallocate<D: BlockDevice>(dev: &D) {
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().unwrap();
    let lba = 200;
    let mut w = dev.alloc_buf(8 * bs).unwrap();
    fill_pattern(&mut w, 0, 8 * bs, 77, 0);
    let w = ok(
        execute(&mut q, Request::write(lba, 8, w, 0, false, 1), IO_TIMEOUT),
        "write",
    );
    ok(
        execute(&mut q, Request::write_zeroes(lba + 2, 4, 2), IO_TIMEOUT),
        "write-zeroes",
    );
    let r = dev.alloc_buf(8 * bs).unwrap();
    let r = ok(
        execute(&mut q, Request::read(lba, 8, r, 0, 3), IO_TIMEOUT),
        "read",
    )
    .unwrap();
    check_pattern(&r, 0, 2 * bs, 77, 0, "blocks before the zeroed range");
    assert!(
        r.eq_at(2 * bs, &vec![0u8; 4 * bs]),
        "write-zeroes range must read as zeros"
    );
    check_pattern(
        &r,
        6 * bs,
        2 * bs,
        77,
        6 * bs as u64,
        "blocks after the zeroed range",
    );
    ok(
        execute(&mut q, Request::deallocate(lba, 8, 4), IO_TIMEOUT),
        "deallocate",
    );
    let w = w.unwrap();
    ok(
        execute(&mut q, Request::write(lba, 8, w, 0, false, 5), IO_TIMEOUT),
        "rewrite",
    );
    let r = ok(
        execute(&mut q, Request::read(lba, 8, r, 0, 6), IO_TIMEOUT),
        "reread",
    )
    .unwrap();
    check_pattern(&r, 0, 8 * bs, 77, 0, "after deallocate and rewrite");
}

/// Filling a queue to its depth then submitting once more gives an explicit QueueFull that
/// hands the request back; every queued request completes with correct data; nothing is lost.
pub fn queue_full<D: BlockDevice>(dev: &D) {
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().unwrap();
    let depth = q.depth();
    assert!(
        depth as u32 <= dev.geometry().queue_depth,
        "handle deeper than the geometry says"
    );
    let cap = dev.geometry().capacity_blocks;
    assert!(
        cap > depth as u64 + 1,
        "device too small for the queue-full check"
    );
    for i in 0..depth as u64 {
        let mut w = dev.alloc_buf(bs).unwrap();
        fill_pattern(&mut w, 0, bs, 1000 + i, 0);
        q.submit(Request::write(i, 1, w, 0, false, i))
            .expect("submit below depth");
    }
    assert_eq!(q.in_flight(), depth);
    let extra = dev.alloc_buf(bs).unwrap();
    let err = q
        .submit(Request::write(depth as u64, 1, extra, 0, false, 9999))
        .unwrap_err();
    assert!(
        err.is_full(),
        "submit beyond depth must say queue full, got {:?}",
        err.kind
    );
    assert_eq!(err.request.tag, 9999, "the refused request comes back");
    let mut seen = HashSet::new();
    let mut out: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
    while seen.len() < depth {
        let n = q.wait(&mut out, 1, IO_TIMEOUT).expect("wait");
        assert!(n <= out.len(), "poll returned more than the slice holds");
        for c in &mut out[..n] {
            let c = std::mem::take(c);
            assert!(c.result.is_ok(), "write {} failed: {:?}", c.tag, c.result);
            assert!(seen.insert(c.tag), "completion for tag {} twice", c.tag);
        }
    }
    assert_eq!(q.in_flight(), 0);
    q.submit(err.request).expect("resubmit after draining");
    let mut one: [Completion; 1] = Default::default();
    assert_eq!(q.wait(&mut one, 1, IO_TIMEOUT).unwrap(), 1);
    assert_eq!(one[0].tag, 9999);
    let r = dev.alloc_buf(depth * bs).unwrap();
    let max_blocks = dev.geometry().max_transfer_blocks() as usize;
    let mut r = Some(r);
    for start in (0..depth).step_by(max_blocks) {
        let n = max_blocks.min(depth - start);
        let c = execute(
            &mut q,
            Request::read(start as u64, n as u32, r.take().unwrap(), 0, 0),
            IO_TIMEOUT,
        );
        let b = ok(c, "read back queue-full writes").unwrap();
        for i in 0..n {
            check_pattern(&b, i * bs, bs, 1000 + (start + i) as u64, 0, "queued write");
        }
        r = Some(b);
    }
}

/// Opening more queues than `queue_count` fails with NoQueue; dropping one frees it.
pub fn queue_limit<D: BlockDevice>(dev: &D) {
    let count = dev.geometry().queue_count as usize;
    let qs: Vec<_> = (0..count)
        .map(|i| {
            dev.open_queue()
                .unwrap_or_else(|e| panic!("queue {i}: {e}"))
        })
        .collect();
    let e = dev
        .open_queue()
        .err()
        .expect("one queue too many must fail");
    assert!(matches!(e, Error::NoQueue { .. }), "got {e}");
    drop(qs);
    dev.open_queue().expect("queue after dropping the others");
}

/// Several threads, each with its own queue handle, run random verified IO at depth at once.
pub fn threads_verified<D: BlockDevice>(dev: &D, threads: usize, ios_per_thread: usize) {
    let geo = dev.geometry().clone();
    let bs = geo.block_size as usize;
    let region = geo.capacity_blocks / threads as u64;
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut q = dev.open_queue().expect("per-thread queue");
                let depth = q.depth().min(16);
                let base = t as u64 * region;
                let slots = (region as usize).min(256);
                // generation per slot: what each block should hold now
                let mut gen = vec![0u64; slots];
                let mut out: Vec<Completion> = (0..depth).map(|_| Completion::default()).collect();
                let mut rng = (t as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
                let mut busy = HashSet::new();
                let mut done = 0;
                let mut issued = 0;
                while done < ios_per_thread {
                    while issued < ios_per_thread && q.in_flight() < depth {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let slot = (rng % slots as u64) as usize;
                        if !busy.insert(slot) {
                            break;
                        }
                        let lba = base + slot as u64;
                        let mut b = dev.alloc_buf(bs).unwrap();
                        let req = if rng & 1 == 0 && gen[slot] > 0 {
                            Request::read(lba, 1, b, 0, slot as u64)
                        } else {
                            gen[slot] += 1;
                            fill_pattern(&mut b, 0, bs, gen[slot] ^ (t as u64) << 32, lba);
                            Request::write(lba, 1, b, 0, false, slot as u64 | 1 << 63)
                        };
                        q.submit(req).expect("submit below depth");
                        issued += 1;
                    }
                    let n = q.wait(&mut out, 1, IO_TIMEOUT).expect("wait");
                    for c in &mut out[..n] {
                        let c = std::mem::take(c);
                        let slot = (c.tag & !(1 << 63)) as usize;
                        busy.remove(&slot);
                        let b = ok(c, "threaded IO").unwrap();
                        let lba = base + slot as u64;
                        check_pattern(&b, 0, bs, gen[slot] ^ (t as u64) << 32, lba, "threaded IO");
                        done += 1;
                    }
                }
            });
        }
    });
}

/// A queue handle is `Send`: used on one thread, then moved to another (idle in between), it
/// keeps working. (Regression: the io_uring backend's thread check counted the request being
/// submitted as already in flight and refused every moved handle.)
pub fn queue_moves_between_threads<D: BlockDevice>(dev: &D) {
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().unwrap();
    let mut w = dev.alloc_buf(bs).unwrap();
    fill_pattern(&mut w, 0, bs, 4242, 0);
    ok(
        execute(&mut q, Request::write(7, 1, w, 0, false, 1), IO_TIMEOUT),
        "write on the first thread",
    );
    for round in 0..3 {
        q = std::thread::scope(|s| {
            s.spawn(move || {
                let r = dev.alloc_buf(bs).unwrap();
                let what = format!("read on moved thread {round}");
                let r = ok(
                    execute(&mut q, Request::read(7, 1, r, 0, 2), IO_TIMEOUT),
                    &what,
                )
                .unwrap();
                check_pattern(&r, 0, bs, 4242, 0, &what);
                q
            })
            .join()
            .unwrap()
        });
    }
}

/// `poll` never returns more than the slice holds, and `wait` with a timeout returns when
/// nothing is in flight instead of hanging.
pub fn poll_bounded<D: BlockDevice>(dev: &D) {
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().unwrap();
    let mut none: [Completion; 0] = [];
    assert_eq!(q.poll(&mut none).unwrap(), 0);
    for i in 0..8u64 {
        let b = dev.alloc_buf(bs).unwrap();
        q.submit(Request::read(i, 1, b, 0, i)).unwrap();
    }
    let mut one: [Completion; 1] = Default::default();
    let mut got = 0;
    while got < 8 {
        let n = q.wait(&mut one, 1, IO_TIMEOUT).unwrap();
        assert_eq!(n, 1, "wait into a 1-slot array returns exactly one");
        got += 1;
    }
    let n = q.wait(&mut one, 1, Duration::from_millis(10)).unwrap();
    assert_eq!(
        n, 0,
        "wait with nothing in flight returns at once with nothing"
    );
}

/// Expand the conformance suite into `#[test]`s. `$make` is an expression producing a
/// [`Fixture`]; each test gets a fresh one.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        #[test]
        fn conformance_round_trip_all_sizes() {
            let f = $make;
            $crate::conformance::round_trip_all_sizes(&f.dev);
        }
        #[test]
        fn conformance_misaligned_rejected() {
            let f = $make;
            $crate::conformance::misaligned_rejected(&f.dev);
        }
        #[test]
        fn conformance_out_of_range_rejected() {
            let f = $make;
            $crate::conformance::out_of_range_rejected(&f.dev);
        }
        #[test]
        fn conformance_flush_semantics() {
            let f = $make;
            $crate::conformance::flush_semantics(&f.dev);
        }
        #[test]
        fn conformance_write_zeroes_and_deallocate() {
            let f = $make;
            $crate::conformance::write_zeroes_and_deallocate(&f.dev);
        }
        #[test]
        fn conformance_queue_full() {
            let f = $make;
            $crate::conformance::queue_full(&f.dev);
        }
        #[test]
        fn conformance_queue_limit() {
            let f = $make;
            $crate::conformance::queue_limit(&f.dev);
        }
        #[test]
        fn conformance_threads_verified() {
            let f = $make;
            $crate::conformance::threads_verified(&f.dev, 4, 2000);
        }
        #[test]
        fn conformance_queue_moves_between_threads() {
            let f = $make;
            $crate::conformance::queue_moves_between_threads(&f.dev);
        }
        #[test]
        fn conformance_poll_bounded() {
            let f = $make;
            $crate::conformance::poll_bounded(&f.dev);
        }
    };
}

/// A device plus whatever must outlive it (a temporary directory).
pub struct Fixture<D> {
    pub dev: D,
    pub keep: Option<Box<dyn std::any::Any>>,
}
