//! Crash consistency across a killed guest: `crash-write` writes numbered records and flushes
//! after each batch, printing how many are durable; the host kills QEMU mid-write and boots
//! `crash-verify`, which checks that every record below the last printed count is intact.

use std::time::Duration;

use nvstore_driver::io::{execute, IO_TIMEOUT};
use nvstore_driver::{BlockDevice, Completion, NvmeDevice, NvmeOptions, QueueHandle, Request};

use crate::{marker, Args};

const MAGIC: u64 = 0x4e56_5354_4352_5348; // "NVSTCRSH"
const BATCH: u64 = 32;
const RECORDS_MAX: u64 = 1 << 20;

fn record(seq: u64, bs: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(bs);
    v.extend_from_slice(&MAGIC.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while v.len() < bs {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(bs);
    v
}

fn open(args: &Args) -> NvmeDevice {
    let opts = NvmeOptions {
        arena_bytes: 16 << 20,
        io_queues_max: 1,
        ..NvmeOptions::default()
    };
    let nsid = args.get("nsid").parse().expect("nsid");
    NvmeDevice::open(&args.get("bdf"), nsid, opts).expect("open device")
}

pub fn write(args: &Args) -> bool {
    let dev = open(args);
    let bs = dev.geometry().block_size as usize;
    let cap = dev.geometry().capacity_blocks.min(RECORDS_MAX);
    let mut q = dev.open_queue().expect("queue");
    let mut bufs: Vec<_> = (0..BATCH).map(|_| dev.alloc_buf(bs).unwrap()).collect();
    let mut out: Vec<Completion> = (0..BATCH).map(|_| Completion::default()).collect();
    marker("CRASH-WRITING");
    let mut seq = 0u64;
    while seq + BATCH <= cap {
        for i in 0..BATCH {
            let mut b = bufs.pop().unwrap();
            b.write_at(0, &record(seq + i, bs));
            q.submit(Request::write(seq + i, 1, b, 0, false, i))
                .expect("submit");
        }
        let mut got = 0;
        while got < BATCH as usize {
            let n = q.wait(&mut out[got..], 1, IO_TIMEOUT).expect("wait");
            got += n;
        }
        for c in &mut out[..] {
            let c = std::mem::take(c);
            c.result.expect("write");
            bufs.push(c.buf.unwrap());
        }
        seq += BATCH;
        // Every write above completed before this flush is submitted: durable once it completes.
        execute(&mut q, Request::flush(0), IO_TIMEOUT)
            .result
            .expect("flush");
        marker(&format!("FLUSHED {seq}"));
    }
    marker("CRASH-WRITER-DONE");
    std::thread::sleep(Duration::from_secs(600));
    true
}

pub fn verify(args: &Args) -> bool {
    let dev = open(args);
    let flushed: u64 = args.get("flushed").parse().expect("flushed");
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().expect("queue");
    let per = (dev.geometry().max_transfer_bytes as usize / bs) as u64;
    let mut buf = Some(dev.alloc_buf(per as usize * bs).unwrap());
    let (mut bad, mut beyond) = (Vec::new(), 0u64);
    let end = (flushed + 4 * BATCH).min(dev.geometry().capacity_blocks);
    let mut at = 0;
    while at < end {
        let n = per.min(end - at);
        let c = execute(
            &mut q,
            Request::read(at, n as u32, buf.take().unwrap(), 0, 0),
            IO_TIMEOUT,
        );
        c.result.expect("read");
        let b = c.buf.unwrap();
        for k in 0..n {
            let seq = at + k;
            let intact = b.eq_at(k as usize * bs, &record(seq, bs));
            if seq < flushed && !intact {
                bad.push(seq);
            } else if seq >= flushed && intact {
                beyond += 1;
            }
        }
        buf = Some(b);
        at += n;
    }
    println!(
        "{flushed} records were durable (flushed) when the guest was killed; {beyond} later \
         records also survived"
    );
    if bad.is_empty() {
        marker(&format!(
            "PASS crash: all {flushed} flushed records intact after kill"
        ));
        marker("SUMMARY 1 passed, 0 failed");
        true
    } else {
        marker(&format!(
            "FAIL crash: {} flushed records damaged, first {:?}",
            bad.len(),
            &bad[..bad.len().min(8)]
        ));
        marker("SUMMARY 0 passed, 1 failed");
        false
    }
}
