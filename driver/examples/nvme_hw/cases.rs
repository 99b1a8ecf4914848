//! The suite's cases. Each returns `Err(reason)` or panics with one.

use std::collections::HashSet;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvstore_driver::conformance;
use nvstore_driver::io::{execute, IO_TIMEOUT};
use nvstore_driver::nvme::spec::{io_op, Command};
use nvstore_driver::nvme::{RawCommand, StatusKind};
use nvstore_driver::{
    BlockDevice, Completion, Controller, DmaBuf, Error, NvmeDevice, NvmeOptions, Op, QueueHandle,
    Request,
};

use crate::{case, marker, Args};

/// QEMU's NVMe model number.
const QEMU_MODEL: &str = "QEMU NVMe Ctrl";

type Res = Result<(), String>;

fn open(bdf: &str) -> Arc<Controller> {
    Controller::open(bdf, NvmeOptions::default()).unwrap_or_else(|e| panic!("open {bdf}: {e}"))
}

pub fn suite(args: &Args) -> bool {
    let (a_bdf, b_bdf) = (args.get("a"), args.get("b"));
    let mut results = Vec::new();
    let mut ctrls: Option<(Arc<Controller>, Arc<Controller>)> = None;
    case(
        &mut results,
        "open both controllers (bring-up; hugepage and 4 KiB arenas)",
        || {
            let (a, b) = (open(&a_bdf), open(&b_bdf));
            let huge = (a.arena().hugepages(), b.arena().hugepages());
            ctrls = Some((a, b));
            // The guest reserves hugepages for exactly one 64 MiB arena.
            if huge != (true, false) {
                return Err(format!(
                    "arena hugepages (A, B) = {huge:?}, want (true, false)"
                ));
            }
            Ok(())
        },
    );
    let Some((a, b)) = ctrls else {
        return summary(&results);
    };
    let a1 = NvmeDevice::new(&a, 1).expect("A ns1");
    let a2 = NvmeDevice::new(&a, 2).expect("A ns2");
    let b1 = NvmeDevice::new(&b, 1).expect("B ns1");
    let devs: [(&str, &NvmeDevice); 3] = [("A/ns1", &a1), ("A/ns2", &a2), ("B/ns1", &b1)];

    case(&mut results, "identify: model and serial", || {
        identify(&a, &args.get("serial_a"), &[512, 4096])?;
        identify(&b, &args.get("serial_b"), &[4096])
    });
    for (n, d) in devs {
        case(
            &mut results,
            &format!("all transfer sizes, unaligned buffers, split above MDTS: {n}"),
            || all_sizes(d),
        );
    }
    case(
        &mut results,
        "threads with their own queue pair at QD64",
        || threads_qd64(&[&a1, &a2, &b1]),
    );
    for (n, d) in devs {
        case(
            &mut results,
            &format!("queue-full backpressure: {n}"),
            || {
                conformance::queue_full(d);
                queue_full_multi_command(d)
            },
        );
    }
    for (n, d) in devs {
        case(
            &mut results,
            &format!("flush, write zeroes, deallocate: {n}"),
            || {
                conformance::flush_semantics(d);
                conformance::write_zeroes_and_deallocate(d);
                big_write_zeroes(d)
            },
        );
    }
    case(
        &mut results,
        "device errors are typed; controller healthy after",
        || typed_errors(&a1),
    );
    case(
        &mut results,
        "IOMMU blocks DMA to an unmapped IOVA (DMAR fault)",
        || iommu_blocks(&b1),
    );
    case(&mut results, "controller reset with IO outstanding", || {
        reset_with_io(&a1)
    });
    case(
        &mut results,
        "command timeout → abort → controller reset (throttled controller)",
        || timeout_abort_reset(&args.get("c")),
    );
    // The suite's all-sizes check writes a per-byte pattern for every block count up to the
    // maximum transfer: on the 512-byte namespace that is 2048 sizes under an emulated CPU, so
    // that device is capped at MDTS (the split path is covered by the all-sizes case above).
    let mdts = a.info().mdts_bytes.unwrap_or(1 << 20) as u32;
    let a1_mdts = NvmeDevice::with_max_transfer(&a, 1, mdts).expect("A ns1");
    let conf: [(&str, &NvmeDevice); 3] = [
        ("A/ns1 (max transfer = MDTS)", &a1_mdts),
        ("A/ns2", &a2),
        ("B/ns1", &b1),
    ];
    for (n, d) in conf {
        case(&mut results, &format!("conformance suite: {n}"), || {
            conformance_all(d);
            Ok(())
        });
    }
    drop(a1_mdts);
    drop((a1, a2, b1));
    summary(&results)
}

fn summary(results: &[(String, bool)]) -> bool {
    let passed = results.iter().filter(|r| r.1).count();
    let failed = results.len() - passed;
    marker(&format!("SUMMARY {passed} passed, {failed} failed"));
    failed == 0
}

fn identify(c: &Controller, serial: &str, block_sizes: &[u32]) -> Res {
    let i = c.info();
    println!(
        "{}: model {:?} serial {:?} firmware {:?} NVMe {} MDTS {:?} queues {} (allocated {}) \
         MQES+1 {} hugepages {}",
        c.name(),
        i.model,
        i.serial,
        i.firmware,
        i.version,
        i.mdts_bytes,
        i.io_queues,
        i.io_queues_allocated,
        i.max_queue_entries,
        c.arena().hugepages()
    );
    if i.model != QEMU_MODEL {
        return Err(format!("model {:?}, want {QEMU_MODEL:?}", i.model));
    }
    if i.serial != serial {
        return Err(format!("serial {:?}, want {serial:?}", i.serial));
    }
    let got: Vec<u32> = c.namespaces().iter().map(|n| n.block_bytes).collect();
    if got != block_sizes {
        return Err(format!(
            "namespace block sizes {got:?}, want {block_sizes:?}"
        ));
    }
    Ok(())
}

/// Pseudo-random bytes, fast to make (the guest CPU is emulated).
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn done(c: Completion, what: &str) -> Result<DmaBuf, String> {
    match c.result {
        Ok(()) => c.buf.ok_or_else(|| format!("{what}: no buffer back")),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

/// Every size from one block to MDTS, at buffer offsets 0, 4 and 4092 (PRP1 mid-page: PRP2 and
/// PRP lists from an unaligned start), plus sizes above MDTS that the queue splits.
fn all_sizes(dev: &NvmeDevice) -> Res {
    let g = dev.geometry().clone();
    let bs = g.block_size as usize;
    let mdts = dev
        .controller()
        .info()
        .mdts_bytes
        .map(|m| m as usize)
        .unwrap_or(1 << 20)
        .min(g.max_transfer_bytes as usize);
    let max = g.max_transfer_bytes as usize;
    let mut sizes: Vec<usize> = (bs..=mdts).step_by(bs).collect();
    for s in [mdts + bs, 2 * mdts, max - bs, max] {
        if s > mdts && s <= max && !sizes.contains(&s) {
            sizes.push(s);
        }
    }
    let pat = noise(max + 65536, 0x5eed);
    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
    let mut w = Some(dev.alloc_buf(max + 8192).map_err(|e| e.to_string())?);
    let mut r = Some(dev.alloc_buf(max + 8192).map_err(|e| e.to_string())?);
    let span_blocks = g.capacity_blocks - (max / bs) as u64;
    let mut ios = 0;
    for (i, &len) in sizes.iter().enumerate() {
        for off in [0usize, 4, 4092] {
            let blocks = (len / bs) as u32;
            let lba = (i as u64 * 7919 + off as u64 * 13) % span_blocks;
            let data = &pat[(i * 72 + off) % 65536..][..len];
            let what = format!("{len} bytes at LBA {lba}, buffer offset {off}");
            let mut wb = w.take().unwrap();
            wb.write_at(off, data);
            let c = execute(
                &mut q,
                Request::write(lba, blocks, wb, off, false, 1),
                IO_TIMEOUT,
            );
            w = Some(done(c, &format!("write {what}"))?);
            let mut rb = r.take().unwrap();
            rb.fill(0, rb.len(), 0xa5);
            let c = execute(&mut q, Request::read(lba, blocks, rb, off, 2), IO_TIMEOUT);
            let rb = done(c, &format!("read {what}"))?;
            if !rb.eq_at(off, data) {
                return Err(format!("{what}: read back differs"));
            }
            if rb.read_u32_le(off + len) != 0xa5a5_a5a5 {
                return Err(format!("{what}: the read overran its buffer range"));
            }
            r = Some(rb);
            ios += 2;
        }
    }
    println!(
        "{}: {} sizes ({}..{} bytes, MDTS {mdts}) × 3 buffer offsets, {ios} IOs",
        dev.name(),
        sizes.len(),
        sizes[0],
        sizes.last().unwrap()
    );
    Ok(())
}

/// Several threads, each with its own queue pair, random verified 1-block IO at QD64.
fn threads_qd64(devs: &[&NvmeDevice]) -> Res {
    const THREADS_PER_DEV: usize = 2;
    const IOS: usize = 3000;
    const DEPTH: usize = 64;
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (d, dev) in devs.iter().enumerate() {
            for t in 0..THREADS_PER_DEV {
                let dev: &NvmeDevice = dev;
                handles.push(s.spawn(move || -> Res {
                    let bs = dev.geometry().block_size as usize;
                    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
                    if q.depth() < DEPTH {
                        return Err(format!("queue depth {} < {DEPTH}", q.depth()));
                    }
                    let slots = 4096usize;
                    let base = (t * slots) as u64;
                    let mut gen = vec![0u64; slots];
                    let mut busy = HashSet::new();
                    let mut bufs: Vec<DmaBuf> =
                        (0..DEPTH).map(|_| dev.alloc_buf(bs).unwrap()).collect();
                    let mut out: Vec<Completion> =
                        (0..DEPTH).map(|_| Completion::default()).collect();
                    let mut rng = (d * 10 + t + 1) as u64 * 0x9e37_79b9_7f4a_7c15;
                    let (mut issued, mut finished, mut peak) = (0, 0, 0);
                    let word = |slot: usize, g: u64| (slot as u64) << 32 | g | (t as u64) << 60;
                    while finished < IOS {
                        while issued < IOS && !bufs.is_empty() {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            let slot = (rng % slots as u64) as usize;
                            if !busy.insert(slot) {
                                continue;
                            }
                            let mut b = bufs.pop().unwrap();
                            let lba = base + slot as u64;
                            let req = if rng & 2 == 0 && gen[slot] > 0 {
                                Request::read(lba, 1, b, 0, slot as u64)
                            } else {
                                gen[slot] += 1;
                                b.write_at(0, &word(slot, gen[slot]).to_le_bytes().repeat(bs / 8));
                                Request::write(lba, 1, b, 0, false, slot as u64 | 1 << 63)
                            };
                            q.submit(req).map_err(|e| format!("submit: {:?}", e.kind))?;
                            issued += 1;
                        }
                        peak = peak.max(q.in_flight());
                        let n = q.wait(&mut out, 1, IO_TIMEOUT).map_err(|e| e.to_string())?;
                        for c in &mut out[..n] {
                            let c = std::mem::take(c);
                            let slot = (c.tag & !(1 << 63)) as usize;
                            busy.remove(&slot);
                            let b = done(c, "threaded IO")?;
                            let want = word(slot, gen[slot]).to_le_bytes().repeat(bs / 8);
                            if !b.eq_at(0, &want) {
                                return Err(format!(
                                    "thread {t}: LBA {} holds stale data",
                                    base + slot as u64
                                ));
                            }
                            bufs.push(b);
                            finished += 1;
                        }
                    }
                    if peak < DEPTH {
                        return Err(format!("never reached QD{DEPTH} (peak {peak})"));
                    }
                    Ok(())
                }));
            }
        }
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "thread panicked".to_string())?)
            .collect::<Result<Vec<()>, String>>()
    })?;
    println!(
        "{} threads × {IOS} verified IOs at QD{DEPTH}",
        devs.len() * THREADS_PER_DEV
    );
    Ok(())
}

/// Multi-command requests (each split into several NVMe commands) up to QueueFull: the refused
/// request comes back, every accepted one completes, and the data reads back.
fn queue_full_multi_command(dev: &NvmeDevice) -> Res {
    let g = dev.geometry().clone();
    let bs = g.block_size as usize;
    let len = (256 << 10).min(g.max_transfer_bytes as usize);
    let blocks = (len / bs) as u32;
    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
    let depth = q.depth();
    let mut accepted = 0u64;
    let refused = loop {
        let mut b = dev.alloc_buf(len).map_err(|e| e.to_string())?;
        b.write_at(0, &noise(len, 1000 + accepted));
        match q.submit(Request::write(
            accepted * blocks as u64,
            blocks,
            b,
            0,
            false,
            accepted,
        )) {
            Ok(()) => accepted += 1,
            Err(e) if e.is_full() => break e.request,
            Err(e) => return Err(format!("submit: {:?}", e.kind)),
        }
        if accepted > depth as u64 + 1 {
            return Err("never reported QueueFull".into());
        }
    };
    if accepted != depth as u64 {
        return Err(format!(
            "QueueFull after {accepted} requests, depth is {depth}"
        ));
    }
    if refused.tag != accepted || refused.buf.is_none() {
        return Err("the refused request did not come back whole".into());
    }
    let mut out: Vec<Completion> = (0..8).map(|_| Completion::default()).collect();
    let mut seen = HashSet::new();
    while seen.len() < depth {
        let n = q.wait(&mut out, 1, IO_TIMEOUT).map_err(|e| e.to_string())?;
        for c in &mut out[..n] {
            let c = std::mem::take(c);
            let tag = c.tag;
            done(c, "queued write")?;
            if !seen.insert(tag) {
                return Err(format!("request {tag} completed twice"));
            }
        }
    }
    // read back
    for i in 0..accepted {
        let r = dev.alloc_buf(len).map_err(|e| e.to_string())?;
        let c = execute(
            &mut q,
            Request::read(i * blocks as u64, blocks, r, 0, 0),
            IO_TIMEOUT,
        );
        let r = done(c, "read back")?;
        if !r.eq_at(0, &noise(len, 1000 + i)) {
            return Err(format!("request {i} lost its data"));
        }
    }
    Ok(())
}

/// Write Zeroes larger than one command's 65536-block limit is split, and zeroes exactly its
/// range.
fn big_write_zeroes(dev: &NvmeDevice) -> Res {
    let g = dev.geometry().clone();
    let bs = g.block_size as u64;
    let blocks = (70_000u64).min(g.capacity_blocks / 2) as u32;
    let lba = 1000u64;
    let chunk = g.max_transfer_bytes as u64;
    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
    let mut buf = Some(dev.alloc_buf(chunk as usize).map_err(|e| e.to_string())?);
    buf.as_mut().unwrap().fill(0, chunk as usize, 0x77);
    // fill lba-1 .. lba+blocks+1 with 0x77
    let (start, end) = (lba - 1, lba + blocks as u64 + 1);
    let mut at = start;
    while at < end {
        let n = (chunk / bs).min(end - at) as u32;
        let c = execute(
            &mut q,
            Request::write(at, n, buf.take().unwrap(), 0, false, 0),
            IO_TIMEOUT,
        );
        buf = Some(done(c, "fill")?);
        at += n as u64;
    }
    let c = execute(&mut q, Request::write_zeroes(lba, blocks, 1), IO_TIMEOUT);
    c.result
        .map_err(|e| format!("write zeroes of {blocks} blocks: {e}"))?;
    let mut at = start;
    let zeros = vec![0u8; chunk as usize];
    let sevens = vec![0x77u8; bs as usize];
    while at < end {
        let n = (chunk / bs).min(end - at) as u32;
        let c = execute(
            &mut q,
            Request::read(at, n, buf.take().unwrap(), 0, 0),
            IO_TIMEOUT,
        );
        let b = done(c, "read back")?;
        for k in 0..n as u64 {
            let l = at + k;
            let off = (k * bs) as usize;
            let ok = if l < lba || l >= lba + blocks as u64 {
                b.eq_at(off, &sevens)
            } else {
                b.eq_at(off, &zeros[..bs as usize])
            };
            if !ok {
                return Err(format!(
                    "LBA {l} wrong after write zeroes of {lba}+{blocks}"
                ));
            }
        }
        buf = Some(b);
        at += n as u64;
    }
    Ok(())
}

fn raw_read(lba: u64, nsid: u32, buf: DmaBuf, len: usize, tag: u64) -> RawCommand {
    RawCommand {
        command: Command::read_write(io_op::READ, nsid, lba, 1, false),
        data: Some((buf, 0, len)),
        op: Op::Read,
        tag,
    }
}

fn wait_one(q: &mut impl QueueHandle) -> Result<Completion, String> {
    let mut one: [Completion; 1] = Default::default();
    q.wait(&mut one, 1, IO_TIMEOUT).map_err(|e| e.to_string())?;
    Ok(std::mem::take(&mut one[0]))
}

/// Commands the device rejects (bypassing our own checks) come back as typed errors, and the
/// controller keeps working.
fn typed_errors(dev: &NvmeDevice) -> Res {
    let g = dev.geometry().clone();
    let bs = g.block_size as usize;
    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
    let b = dev.alloc_buf(bs).unwrap();
    q.submit_raw(raw_read(g.capacity_blocks, dev.nsid(), b, bs, 1))
        .map_err(|e| e.0.to_string())?;
    let c = wait_one(&mut q)?;
    match &c.result {
        Err(Error::OutOfRange { lba, .. }) if *lba == g.capacity_blocks => {
            println!("read past the end → {}", c.result.as_ref().unwrap_err())
        }
        other => return Err(format!("read past the end: got {other:?}")),
    }
    let b = dev.alloc_buf(bs).unwrap();
    // QEMU answers NSIDs above its 256-namespace limit with Invalid Namespace or Format
    // (an unused NSID inside the limit gets Invalid Field).
    q.submit_raw(raw_read(0, 0x1000, b, bs, 2))
        .map_err(|e| e.0.to_string())?;
    let c = wait_one(&mut q)?;
    match &c.result {
        Err(
            e @ Error::Nvme {
                kind: StatusKind::InvalidNamespace,
                ..
            },
        ) => println!("namespace 0x1000 → {e}"),
        other => return Err(format!("invalid namespace: got {other:?}")),
    }
    dev.controller().check_fatal().map_err(|e| e.to_string())?;
    let mut w = dev.alloc_buf(bs).unwrap();
    w.write_at(0, &noise(bs, 42));
    done(
        execute(&mut q, Request::write(5, 1, w, 0, true, 3), IO_TIMEOUT),
        "write after errors",
    )?;
    let r = dev.alloc_buf(bs).unwrap();
    let r = done(
        execute(&mut q, Request::read(5, 1, r, 0, 4), IO_TIMEOUT),
        "read after errors",
    )?;
    if !r.eq_at(0, &noise(bs, 42)) {
        return Err("data wrong after errors".into());
    }
    Ok(())
}

/// Drain /dev/kmsg (non-blocking) into lines.
fn kernel_log() -> Vec<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
    else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    let mut buf = vec![0u8; 8192];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                let msg = rec.split_once(';').map(|x| x.1).unwrap_or(&rec);
                lines.push(msg.trim_end().to_string());
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue, // overwritten records
            Err(_) => break,
        }
    }
    lines
}

/// A read whose PRP points at an IOVA we never mapped: the IOMMU blocks the DMA. QEMU still
/// completes the command (with success); the evidence is the kernel's DMAR fault line naming
/// the address.
fn iommu_blocks(dev: &NvmeDevice) -> Res {
    let iova = dev.controller().unmapped_iova();
    let bs = dev.geometry().block_size as usize;
    let before = kernel_log().len();
    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
    let cmd = Command::read_write(io_op::READ, dev.nsid(), 0, 1, false);
    // SAFETY: `iova` lies in a guard gap of the IOVA space that is never mapped; the IOMMU
    // blocks the device's write, so no memory of this process can change.
    unsafe { q.submit_raw_iova(cmd, iova, bs, Op::Read, 1) }.map_err(|e| e.to_string())?;
    let c = wait_one(&mut q)?;
    println!("completion of the stray read: {:?}", c.result);
    let want = format!("fault addr 0x{iova:x}");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut log = Vec::new();
    while Instant::now() < deadline {
        log.extend(kernel_log());
        if log.iter().any(|l| l.contains("DMAR") && l.contains(&want)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let Some(line) = log.iter().find(|l| l.contains("DMAR") && l.contains(&want)) else {
        let dmar: Vec<&String> = log.iter().filter(|l| l.contains("DMAR")).collect();
        return Err(format!(
            "no DMAR fault for {iova:#x} in the kernel log ({before} lines before; DMAR lines: {dmar:?})"
        ));
    };
    println!("kernel: {line}");
    // The controller still works.
    let mut w = dev.alloc_buf(bs).unwrap();
    w.write_at(0, &noise(bs, 7));
    done(
        execute(&mut q, Request::write(9, 1, w, 0, false, 2), IO_TIMEOUT),
        "write after fault",
    )?;
    let r = dev.alloc_buf(bs).unwrap();
    let r = done(
        execute(&mut q, Request::read(9, 1, r, 0, 3), IO_TIMEOUT),
        "read after fault",
    )?;
    if !r.eq_at(0, &noise(bs, 7)) {
        return Err("data wrong after the DMAR fault".into());
    }
    Ok(())
}

/// Reset the controller with 64 writes outstanding: every request comes back (completed before
/// the reset, or failed with `Gone`), nothing hangs, and IO works afterwards.
fn reset_with_io(dev: &NvmeDevice) -> Res {
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
    const N: u64 = 64;
    let len = 16 * bs;
    for i in 0..N {
        let mut b = dev.alloc_buf(len).unwrap();
        b.write_at(0, &noise(len, i));
        q.submit(Request::write(2000 + i * 16, 16, b, 0, false, i))
            .map_err(|e| format!("submit: {:?}", e.kind))?;
    }
    q.kick().map_err(|e| e.to_string())?;
    let g0 = dev.controller().generation();
    dev.controller()
        .reset("hardware suite: reset with IO outstanding", None)
        .map_err(|e| e.to_string())?;
    if dev.controller().generation() == g0 {
        return Err("generation did not move".into());
    }
    let mut out: Vec<Completion> = (0..16).map(|_| Completion::default()).collect();
    let (mut ok, mut gone, mut got) = (0, 0, 0);
    let t = Instant::now();
    while got < N {
        let n = q.wait(&mut out, 1, IO_TIMEOUT).map_err(|e| e.to_string())?;
        for c in &mut out[..n] {
            let c = std::mem::take(c);
            got += 1;
            match c.result {
                Ok(()) => ok += 1,
                Err(Error::Gone { .. }) => gone += 1,
                Err(e) => return Err(format!("request {}: unexpected {e}", c.tag)),
            }
            if c.buf.is_none() {
                return Err("a failed request lost its buffer".into());
            }
        }
    }
    println!(
        "after reset: {ok} completed, {gone} failed with Gone, all back in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    for q2 in [&mut q, &mut dev.open_queue().map_err(|e| e.to_string())?] {
        let mut w = dev.alloc_buf(bs).unwrap();
        w.write_at(0, &noise(bs, 99));
        done(
            execute(q2, Request::write(11, 1, w, 0, false, 1), IO_TIMEOUT),
            "write after reset",
        )?;
        let r = dev.alloc_buf(bs).unwrap();
        let r = done(
            execute(q2, Request::read(11, 1, r, 0, 2), IO_TIMEOUT),
            "read after reset",
        )?;
        if !r.eq_at(0, &noise(bs, 99)) {
            return Err("data wrong after reset".into());
        }
    }
    Ok(())
}

fn conformance_all(d: &NvmeDevice) {
    conformance::round_trip_all_sizes(d);
    conformance::misaligned_rejected(d);
    conformance::out_of_range_rejected(d);
    conformance::flush_semantics(d);
    conformance::write_zeroes_and_deallocate(d);
    conformance::queue_full(d);
    conformance::queue_limit(d);
    conformance::threads_verified(d, 4, 2000);
    conformance::poll_bounded(d);
}

/// On controller C (a drive throttled to a few IOPS) commands outlive a 500 ms command timeout.
/// First with time for the Abort to work: QEMU aborts them and they fail with `Timeout`. Then
/// with no abort grace: the controller is reset and every outstanding request fails with
/// `Gone` naming the timeout. The controller works after each.
fn timeout_abort_reset(bdf: &str) -> Res {
    let opts = NvmeOptions {
        arena_bytes: 8 << 20,
        io_queues_max: 2,
        command_timeout: Duration::from_millis(500),
        abort_timeout: Duration::from_secs(2),
        ..NvmeOptions::default()
    };
    {
        let ctrl = Controller::open(bdf, opts.clone()).map_err(|e| e.to_string())?;
        let (ok, timed_out, gone) = slow_batch(&ctrl)?;
        println!("abort path: {ok} completed, {timed_out} aborted after the timeout, {gone} gone");
        if timed_out == 0 || gone != 0 {
            return Err("expected commands aborted after their timeout, and no reset".into());
        }
    }
    let opts = NvmeOptions {
        abort_timeout: Duration::ZERO,
        ..opts
    };
    let ctrl = Controller::open(bdf, opts).map_err(|e| e.to_string())?;
    let g0 = ctrl.generation();
    let (ok, timed_out, gone) = slow_batch(&ctrl)?;
    println!("reset path: {ok} completed, {timed_out} aborted, {gone} failed by the reset");
    if ctrl.generation() == g0 || gone == 0 {
        return Err(format!(
            "expected a reset failing the slow commands (generation {g0} → {}, {gone} failed)",
            ctrl.generation()
        ));
    }
    Ok(())
}

/// Submit 12 reads to the throttled controller, collect them all, then check that plain IO
/// works. Returns (completed, failed with Timeout, failed with Gone).
fn slow_batch(ctrl: &Arc<Controller>) -> Result<(u32, u32, u32), String> {
    let dev = NvmeDevice::new(ctrl, 1).map_err(|e| e.to_string())?;
    let bs = dev.geometry().block_size as usize;
    let mut q = dev.open_queue().map_err(|e| e.to_string())?;
    const N: u64 = 12;
    for i in 0..N {
        let b = dev.alloc_buf(bs).unwrap();
        q.submit(Request::read(i * 8, 1, b, 0, i))
            .map_err(|e| format!("submit: {:?}", e.kind))?;
    }
    let mut out: Vec<Completion> = (0..N).map(|_| Completion::default()).collect();
    let (mut ok, mut timed_out, mut gone, mut got) = (0, 0, 0, 0);
    while got < N {
        let n = q
            .wait(&mut out, 1, Duration::from_secs(60))
            .map_err(|e| e.to_string())?;
        for c in &mut out[..n] {
            let c = std::mem::take(c);
            got += 1;
            match c.result {
                Ok(()) => ok += 1,
                Err(e @ Error::Timeout { .. }) => {
                    if timed_out == 0 {
                        println!("  {e}");
                    }
                    timed_out += 1;
                }
                Err(e @ Error::Gone { .. }) if e.to_string().contains("timed out") => {
                    if gone == 0 {
                        println!("  {e}");
                    }
                    gone += 1;
                }
                Err(e) => return Err(format!("request {}: unexpected {e}", c.tag)),
            }
        }
    }
    // Let the throttle's budget refill (cancelled requests still count against it), then the
    // controller must work normally.
    std::thread::sleep(Duration::from_secs(3));
    let mut w = dev.alloc_buf(bs).unwrap();
    w.write_at(0, &noise(bs, 5));
    done(
        execute(&mut q, Request::write(3, 1, w, 0, false, 1), IO_TIMEOUT),
        "write after",
    )?;
    let r = dev.alloc_buf(bs).unwrap();
    let r = done(
        execute(&mut q, Request::read(3, 1, r, 0, 2), IO_TIMEOUT),
        "read after",
    )?;
    if !r.eq_at(0, &noise(bs, 5)) {
        return Err("data wrong after the timeout".into());
    }
    Ok((ok, timed_out, gone))
}
