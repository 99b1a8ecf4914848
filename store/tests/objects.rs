//! The object API on SimDevice: every operation, limits, errors, reopen.

mod common;

use common::*;
use nvstore_store::{mkfs, AsyncCommit, ObjectKey, Store, StoreConfig, StoreError, Transaction};

#[test]
fn write_full_and_read_every_size() {
    let (_dev, s) = fresh(64, 1);
    let sizes = [
        0usize,
        1,
        4095,
        4096,
        65535,
        65536,
        65537,
        300_000,
        (1 << 20) + 1,
        4 << 20,
    ];
    for (i, &n) in sizes.iter().enumerate() {
        let k = key(&format!("obj-{n}"));
        let d = data(i as u64, n);
        let v = s.write_full(&k, &d).unwrap();
        assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), d, "size {n}");
        let st = s.stat(&k).unwrap();
        assert_eq!((st.size, st.version), (n as u64, v));
        assert_eq!(
            st.checksum,
            nvstore_store::content_checksum(&d, 64 << 10),
            "stat checksum of {n} bytes"
        );
        if n > 10 {
            let (lo, hi) = (n / 3, n / 3 + n / 4 + 1);
            assert_eq!(
                s.read_vec(&k, lo as u64, (hi - lo) as u64).unwrap(),
                d[lo..hi]
            );
        }
    }
}

#[test]
fn partial_writes_appends_and_gaps() {
    let (_dev, s) = fresh(64, 2);
    let k = key("p");
    let mut model = data(1, 200_000);
    s.write_full(&k, &model).unwrap();
    for (seed, off, len) in [
        (2u64, 10usize, 5usize),
        (3, 65530, 20),
        (4, 131_072, 65_536),
        (5, 199_990, 30),
    ] {
        let d = data(seed, len);
        s.write(&k, off as u64, &d).unwrap();
        if model.len() < off + len {
            model.resize(off + len, 0);
        }
        model[off..off + len].copy_from_slice(&d);
        assert_eq!(
            s.read_vec(&k, 0, u64::MAX).unwrap(),
            model,
            "after write at {off}+{len}"
        );
    }
    let tail = data(9, 7000);
    s.append(&k, &tail).unwrap();
    model.extend_from_slice(&tail);
    // A write far past the end leaves a zero-filled gap.
    let far = data(10, 100);
    s.write(&k, 1_000_000, &far).unwrap();
    model.resize(1_000_000, 0);
    model.extend_from_slice(&far);
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), model);
    assert_eq!(
        s.stat(&k).unwrap().checksum,
        nvstore_store::content_checksum(&model, 64 << 10)
    );
}

#[test]
fn versions_increase_and_remove_list_xattrs_work() {
    let (_dev, s) = fresh(64, 3);
    let v1 = s.write_full(&key("a"), b"one").unwrap();
    let v2 = s.write_full(&key("a"), b"two").unwrap();
    assert!(v2 > v1);
    for i in 0..25 {
        s.write_full(&key(&format!("l{i:02}")), b"x").unwrap();
    }
    s.write_full(&ObjectKey::new(2, b"other-pool", 0), b"y")
        .unwrap();
    let page1 = s.list(1, None, 10);
    assert_eq!(page1.len(), 10);
    assert_eq!(page1[0].0, key("a"));
    let page2 = s.list(1, Some(&page1[9].0), 100);
    assert_eq!(page2.len(), 16, "26 objects in pool 1");
    assert!(page2.iter().all(|(k, _)| k.pool == 1));
    s.set_xattr(&key("a"), "color", b"blue").unwrap();
    s.set_xattr(&key("a"), "size", b"xl").unwrap();
    assert_eq!(s.get_xattr(&key("a"), "color").unwrap(), b"blue");
    s.write_full(&key("a"), b"three").unwrap();
    assert_eq!(
        s.get_xattr(&key("a"), "color").unwrap(),
        b"blue",
        "write_full keeps xattrs"
    );
    s.rm_xattr(&key("a"), "color").unwrap();
    assert!(matches!(
        s.get_xattr(&key("a"), "color"),
        Err(StoreError::NoXattr { .. })
    ));
    assert_eq!(s.xattrs(&key("a")).unwrap().len(), 1);
    s.remove(&key("a")).unwrap();
    assert!(matches!(s.stat(&key("a")), Err(StoreError::NotFound(_))));
    assert!(matches!(s.remove(&key("a")), Err(StoreError::NotFound(_))));
    let v3 = s.write_full(&key("a"), b"again").unwrap();
    assert!(v3 > v2, "a recreated object's version keeps increasing");
    assert!(
        s.xattrs(&key("a")).unwrap().is_empty(),
        "remove dropped the xattrs"
    );
}

#[test]
fn transactions_are_atomic_and_conditional() {
    let (_dev, s) = fresh(64, 4);
    let v = s.write_full(&key("x"), b"x0").unwrap();
    let mut t = Transaction::new();
    t.write_full(key("y"), b"y1")
        .assert_version(key("x"), v + 100)
        .write_full(key("x"), b"x1");
    let e = s.commit(t).unwrap_err();
    assert!(matches!(e, StoreError::VersionMismatch { .. }), "{e}");
    assert!(!s.exists(&key("y")), "a failed transaction applies nothing");
    assert_eq!(s.read_vec(&key("x"), 0, 10).unwrap(), b"x0");
    let mut t = Transaction::new();
    t.assert_version(key("x"), v)
        .write_full(key("x"), b"x1")
        .write_full(key("y"), b"y1")
        .set_xattr(key("y"), "k", b"v")
        .append(key("y"), b"+")
        .assert_exists(key("x"));
    let v2 = s.commit(t).unwrap();
    assert_eq!(s.stat(&key("x")).unwrap().version, v2);
    assert_eq!(s.stat(&key("y")).unwrap().version, v2);
    assert_eq!(s.read_vec(&key("y"), 0, 10).unwrap(), b"y1+");
    assert_eq!(s.get_xattr(&key("y"), "k").unwrap(), b"v");
    let mut t = Transaction::new();
    t.assert_exists(key("nope")).write_full(key("z"), b"z");
    assert!(matches!(s.commit(t), Err(StoreError::NotFound(_))));
    assert!(!s.exists(&key("z")));
}

#[test]
fn bad_input_gets_clear_errors_and_changes_nothing() {
    let (_dev, s) = fresh(64, 5);
    s.write_full(&key("keep"), b"safe").unwrap();
    let long = ObjectKey::new(1, vec![b'n'; 1025], 0);
    let e = s.write_full(&long, b"x").unwrap_err();
    assert!(
        e.to_string()
            .contains("object name is 1025 bytes; the maximum is 1024"),
        "{e}"
    );
    let e = s.write(&key("big"), 64 << 20, b"x").unwrap_err();
    assert!(matches!(e, StoreError::TooLarge { .. }), "{e}");
    let huge = vec![0u8; 70_000];
    let e = s.set_xattr(&key("keep"), "k", &huge).unwrap_err();
    assert!(e.to_string().contains("xattrs of one object"), "{e}");
    let e = s
        .set_xattr(&key("keep"), &"n".repeat(300), b"v")
        .unwrap_err();
    assert!(e.to_string().contains("xattr name"), "{e}");
    assert!(!s.exists(&key("big")));
    assert_eq!(s.read_vec(&key("keep"), 0, 100).unwrap(), b"safe");
    assert!(s.xattrs(&key("keep")).unwrap().is_empty());
}

/// A checkpoint is due after `checkpoint_interval_bytes` of log or after as much log as the
/// last checkpoint took, whichever is more: a big index is not rewritten every interval.
#[test]
fn a_big_index_is_checkpointed_after_as_much_log_as_its_checkpoint() {
    let dev = sim(128, 9);
    mkfs(&dev, &mkfs_opts()).unwrap();
    let cfg = StoreConfig {
        checkpoint_interval_bytes: 256 << 10,
        cleaner: false,
        ..StoreConfig::default()
    };
    let open = || Store::open(dev.clone(), Some(FSID), cfg.clone()).unwrap();
    // 20 000 empty objects with 200-byte names: a checkpoint of several MiB.
    const OBJECTS: u64 = 20_000;
    let name = |i: u64| key(&format!("{i:0>200}"));
    let (s, _) = open();
    for chunk in 0..OBJECTS / 500 {
        let mut t = Transaction::new();
        for i in chunk * 500..(chunk + 1) * 500 {
            t.write_full(name(i), &[]);
        }
        s.commit(t).unwrap();
    }
    s.checkpoint().unwrap();
    s.close();
    let (s, r) = open();
    eprintln!("{r}");
    assert_eq!(r.checkpoint_objects, OBJECTS, "{r}");
    let ckpt = r.checkpoint_bytes;
    assert!(ckpt > 16 * cfg.checkpoint_interval_bytes, "{r}");

    // Half the checkpoint's size in log: no checkpoint yet, though the interval has passed
    // many times over (the next open replays all of it).
    let payload = data(7, 64 << 10);
    let mut written = 0u64;
    let mut n = 0u64;
    let mut put = |s: &Store<_>, upto: u64| {
        while written < upto {
            s.write_full(&key(&format!("w{}", n % 8)), &payload)
                .unwrap();
            written += payload.len() as u64;
            n += 1;
        }
    };
    put(&s, ckpt / 2);
    s.close();
    let (s, r) = open();
    eprintln!("{r}");
    assert_eq!(
        r.checkpoint_objects, OBJECTS,
        "no checkpoint before {ckpt} B of log: {r}"
    );
    assert!(r.replayed_bytes >= ckpt / 2, "{r}");

    // Well past the checkpoint's size: checkpoints came, and the replay is at most about one
    // checkpoint's worth of log.
    put(&s, ckpt / 2 + 3 * ckpt);
    s.close();
    let (s, r) = open();
    eprintln!("{r}");
    assert_eq!(r.objects, OBJECTS + 8, "{r}");
    assert_eq!(r.checkpoint_objects, OBJECTS + 8, "{r}");
    assert!(r.replayed_bytes <= ckpt + ckpt / 4, "{r}");
    assert_eq!(s.read_vec(&key("w3"), 0, u64::MAX).unwrap(), payload);
    assert!(s.exists(&name(OBJECTS - 1)));
}

/// Objects bigger than a segment go out from their caller's DMA buffer in several batches
/// (the buffer split where each batch ends, the split halves split again): after a reopen
/// every byte reads back from the device, and the store's DMA memory is not held by the
/// halves (reopen and rewrite work within the same budget).
#[test]
fn objects_spanning_segments_read_back_after_reopen() {
    let dev = sim(96, 12);
    mkfs(&dev, &mkfs_opts()).unwrap(); // 2 MiB segments
    let sizes = [
        5 << 20,
        (3 << 20) + 4096,
        9 << 20,
        (2 << 20) - 4096,
        6 << 20,
    ];
    for round in 0..2u64 {
        let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            let k = key(&format!("big{i}"));
            s.write_full(&k, &data(round * 10 + i as u64, n)).unwrap();
        }
        s.close();
        let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            let k = key(&format!("big{i}"));
            let got = s.read_vec(&k, 0, u64::MAX).unwrap();
            assert!(
                got == data(round * 10 + i as u64, n),
                "round {round}: object {i} of {n} bytes differs after reopen"
            );
        }
        s.close();
    }
}

#[test]
fn survives_reopen_with_and_without_checkpoint() {
    let dev = sim(64, 6);
    mkfs(&dev, &mkfs_opts()).unwrap();
    let (s, r) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    assert_eq!(r.objects, 0);
    for i in 0..50 {
        s.write_full(&key(&format!("o{i}")), &data(i, 10_000 + i as usize))
            .unwrap();
    }
    s.checkpoint().unwrap();
    for i in 50..80 {
        s.write_full(&key(&format!("o{i}")), &data(i, 10_000 + i as usize))
            .unwrap();
    }
    s.remove(&key("o3")).unwrap();
    s.close();
    let (s, r) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    eprintln!("{r}");
    assert_eq!(r.checkpoint_objects, 50);
    assert_eq!(r.objects, 79);
    assert!(r.replayed_batches >= 1 && r.replayed_batches <= 32, "{r}");
    for i in 0..80u64 {
        let k = key(&format!("o{i}"));
        if i == 3 {
            assert!(!s.exists(&k));
        } else {
            assert_eq!(
                s.read_vec(&k, 0, u64::MAX).unwrap(),
                data(i, 10_000 + i as usize)
            );
        }
    }
    let v = s.write_full(&key("new"), b"n").unwrap();
    assert!(v > 81, "versions continue after reopen (got {v})");
}

#[test]
fn labels_are_checked() {
    let dev = sim(64, 7);
    let e = Store::open(dev.clone(), Some(FSID), StoreConfig::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("run `nvstore mkfs`"), "{e}");
    mkfs(&dev, &mkfs_opts()).unwrap();
    let other = *b"another-cluster!";
    let e = Store::open(dev, Some(other), StoreConfig::default())
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("74657374-2d63-6c75-7374-65722d696421"),
        "names the device's fsid: {msg}"
    );
    assert!(
        msg.contains("616e6f74-6865-722d-636c-757374657221"),
        "names the expected fsid: {msg}"
    );
}

#[test]
fn read_many_matches_single_reads() {
    let (_dev, s) = fresh(64, 8);
    let objs: Vec<(ObjectKey, Vec<u8>)> = (0..40)
        .map(|i| {
            let k = key(&format!("rm{i}"));
            let d = data(i, (i as usize * 37_001) % 300_000);
            s.write_full(&k, &d).unwrap();
            (k, d)
        })
        .collect();
    let mut reqs: Vec<(ObjectKey, u64, u64)> = objs
        .iter()
        .enumerate()
        .map(|(i, (k, d))| (k.clone(), (i as u64 * 1000) % (d.len() as u64 + 1), 70_000))
        .collect();
    reqs.push((key("missing"), 0, 10));
    let got = s.read_many(&reqs);
    assert_eq!(got.len(), reqs.len());
    for ((k, off, len), r) in reqs.iter().zip(&got) {
        match objs.iter().find(|(ok, _)| ok == k) {
            Some((_, d)) => {
                let lo = (*off as usize).min(d.len());
                let hi = (lo + *len as usize).min(d.len());
                assert_eq!(r.as_ref().unwrap().to_vec(), d[lo..hi], "{k} @{off}+{len}");
            }
            None => assert!(matches!(r, Err(StoreError::NotFound(_)))),
        }
    }
}

#[test]
fn async_reader_keeps_many_reads_in_flight() {
    let (_dev, s) = fresh(64, 9);
    let objs: Vec<(ObjectKey, Vec<u8>)> = (0..50)
        .map(|i| {
            let k = key(&format!("ar{i}"));
            let d = data(100 + i, (i as usize * 51_001) % 400_000);
            s.write_full(&k, &d).unwrap();
            (k, d)
        })
        .collect();
    let mut r = s.reader().unwrap();
    assert!(matches!(
        r.submit(&key("missing"), 0, 1, 0),
        Err(StoreError::NotFound(_))
    ));
    let mut out = Vec::new();
    let mut next = 0;
    let mut got = std::collections::BTreeMap::new();
    // Keep up to 16 reads in flight, resubmitting as results come back.
    while got.len() < objs.len() {
        while next < objs.len() && r.in_flight() < 16 {
            let (k, d) = &objs[next];
            r.submit(k, 1000, d.len() as u64, next as u64).unwrap();
            next += 1;
        }
        r.poll(&mut out, true).unwrap();
        for (tag, res) in out.drain(..) {
            got.insert(tag, res.unwrap().to_vec());
        }
    }
    for (i, (_, d)) in objs.iter().enumerate() {
        let lo = 1000.min(d.len());
        assert_eq!(got[&(i as u64)], d[lo..], "object {i}");
    }
    assert_eq!(r.in_flight(), 0);
}

#[test]
fn commit_async_is_durable_when_it_says_so_and_owns_its_data() {
    let (dev, s) = fresh(64, 11);
    let (tx, rx) = std::sync::mpsc::channel();
    let n = 200u64;
    for i in 0..n {
        let mut d = data(i, 100 + i as usize * 37);
        let mut t = Transaction::new();
        t.write_full(key(&format!("a{i}")), &d);
        t.set_xattr(key(&format!("a{i}")), "x", b"v");
        let tx = tx.clone();
        s.commit_async(t, Box::new(move |r| tx.send((i, r)).unwrap()))
            .unwrap();
        // The store copied what it needs: the caller's buffer is free at once.
        d.fill(0xEE);
        drop(d);
    }
    let mut versions = Vec::new();
    for _ in 0..n {
        let (i, r) = rx.recv().unwrap();
        match r {
            AsyncCommit::Durable(v) => versions.push((i, v)),
            other => panic!("a{i}: {other:?}"),
        }
    }
    // Every callback ran once, after its transaction became durable: a crash now (dropping
    // every write not yet flushed) keeps all of them.
    versions.sort();
    assert_eq!(versions.len() as u64, n);
    let crashed = dev.crash(5);
    drop(s);
    let (s, _) = Store::open(crashed, Some(FSID), StoreConfig::default()).unwrap();
    for (i, v) in versions {
        let k = key(&format!("a{i}"));
        assert_eq!(
            s.read_vec(&k, 0, u64::MAX).unwrap(),
            data(i, 100 + i as usize * 37)
        );
        assert_eq!(s.stat(&k).unwrap().version, v);
        assert_eq!(s.get_xattr(&k, "x").unwrap(), b"v");
    }
    // Validation errors come back from the call; the callback is not run.
    let mut t = Transaction::new();
    t.remove(key("absent"));
    let called = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c = called.clone();
    let r = s.commit_async(
        t,
        Box::new(move |_| c.store(true, std::sync::atomic::Ordering::SeqCst)),
    );
    assert!(matches!(r, Err(StoreError::NotFound(_))), "{r:?}");
    // A failed commit (an assert that no longer holds at commit time) reaches the callback.
    let mut t = Transaction::new();
    t.assert_version(key("a1"), 1);
    t.write_full(key("a1"), b"new");
    let r = s.commit_async(
        t,
        Box::new(move |_| panic!("not called: the version check fails at preparation")),
    );
    assert!(
        matches!(r, Err(StoreError::VersionMismatch { .. })),
        "{r:?}"
    );
    assert!(!called.load(std::sync::atomic::Ordering::SeqCst));
    // A closed store's commit thread answers what it still holds.
    let (tx, rx) = std::sync::mpsc::channel();
    let mut t = Transaction::new();
    t.write_full(key("last"), b"bytes");
    s.commit_async(t, Box::new(move |r| tx.send(r).unwrap()))
        .unwrap();
    s.close();
    assert!(matches!(rx.recv().unwrap(), AsyncCommit::Durable(_)));
}

/// A reader must never see an object vanish while another thread overwrites it: the index's
/// replace of an existing key (crossbeam-skiplist 0.1.3, its issue #1023) has a moment where a
/// lookup finds no entry; the store hides that moment from every lookup.
#[test]
fn overwrites_never_make_an_object_vanish_for_readers() {
    let (_dev, s) = fresh(64, 12);
    let k = key("hot");
    s.write_full(&k, b"version 0").unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let misses = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..3 {
            sc.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if !s.exists(&k) || s.meta(&k).is_none() || s.stat(&k).is_err() {
                        misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    match s.read_vec(&k, 0, u64::MAX) {
                        Ok(_) => {}
                        Err(StoreError::NotFound(_)) => {
                            misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            });
        }
        for i in 0..3000u64 {
            s.write_full(&k, format!("version {i}").as_bytes()).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(misses.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn list_never_skips_an_object_being_overwritten() {
    let (_dev, s) = fresh(64, 13);
    const N: usize = 64;
    for i in 0..N {
        s.write_full(&key(&format!("l{i:03}")), b"v0").unwrap();
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (short, lists) = (
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    );
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let got = s.list(1, None, 1000);
                    if got.len() != N {
                        short.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    lists.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        for r in 0..40u64 {
            let v = format!("v{r}");
            let mut t = Transaction::new();
            for i in 0..N {
                t.write_full(key(&format!("l{i:03}")), v.as_bytes());
            }
            s.commit(t).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let (short, lists) = (short.into_inner(), lists.into_inner());
    eprintln!("{lists} lists during 40 rounds of {N} overwrites; {short} missed an object");
    assert!(lists > 0);
    assert_eq!(
        short, 0,
        "a list missed an object that was being overwritten"
    );
}

/// Whole chunks of a big write share one DMA buffer per device transfer and go out as one
/// write: a 4 MiB object on a device that takes 1 MiB transfers costs a handful of writes, not
/// one per 64 KiB chunk as before. With 1 MiB segments no run fits a batch, so every run is
/// cut where its batch ends and the rest is copied into the next: objects, an overwrite in
/// the middle and an append all read back exact, before and after a reopen.
#[test]
fn big_writes_go_out_in_device_sized_writes() {
    let opts = nvstore_store::MkfsOptions {
        segment_bytes: 8 << 20,
        ..mkfs_opts()
    };
    let (dev, s) = fresh_with(128, 90, &opts);
    let big = data(90, 4 << 20);
    let before = dev.write_ios();
    s.write_full(&key("big"), &big).unwrap();
    let ios = dev.write_ios() - before;
    // Four runs, plus the batch headers and records: a 4 MiB object and its records do not
    // fit one 4 MiB batch, so the last chunk goes to a second batch. One write per chunk was
    // 64 and more.
    assert!(
        (4..=10).contains(&ios),
        "a 4 MiB write took {ios} device writes"
    );
    assert_eq!(s.read_vec(&key("big"), 0, u64::MAX).unwrap(), big);

    let dev = sim(64, 91);
    let opts = nvstore_store::MkfsOptions {
        segment_bytes: 1 << 20,
        ..opts
    };
    nvstore_store::mkfs(&dev, &opts).unwrap();
    let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    let mut want = Vec::new();
    for i in 0..3u64 {
        let d = data(100 + i, (4 << 20) + 12_345 * i as usize);
        s.write_full(&key(&format!("o{i}")), &d).unwrap();
        want.push(d);
    }
    let patch = data(200, 2 << 20);
    s.write(&key("o1"), 100_000, &patch).unwrap();
    want[1][100_000..100_000 + patch.len()].copy_from_slice(&patch);
    let tail = data(201, 1 << 20);
    s.write(&key("o2"), want[2].len() as u64, &tail).unwrap();
    want[2].extend_from_slice(&tail);
    let check = |s: &Store<driver::SimDevice>| {
        for (i, d) in want.iter().enumerate() {
            let got = s.read_vec(&key(&format!("o{i}")), 0, u64::MAX).unwrap();
            assert!(got == *d, "o{i}: {} bytes, want {}", got.len(), d.len());
        }
    };
    check(&s);
    drop(s);
    let (s, _) = Store::open(dev, Some(FSID), StoreConfig::default()).unwrap();
    check(&s);
    assert!(s.scrub().corrupt.is_empty());
}

/// A read made of whole chunks lists each chunk's CRC (a node sends them with a shard read,
/// and both it and the primary combine them into frame CRCs instead of summing the bytes
/// again). The CRCs tile the read, each that of exactly its bytes; a read that starts or ends
/// inside a chunk lists none.
#[test]
fn whole_chunk_reads_list_the_crc_of_each_chunk() {
    let opts = nvstore_store::MkfsOptions {
        segment_bytes: 8 << 20,
        ..mkfs_opts()
    };
    let (_dev, s) = fresh_with(128, 92, &opts);
    let cb = 64 << 10;
    let big = data(93, 3 * (1 << 20) + 5_000);
    s.write_full(&key("o"), &big).unwrap();
    let small = data(94, 3_000);
    s.write_full(&key("s"), &small).unwrap();
    let check = |name: &str, off: u64, len: u64, whole: bool| {
        let src = if name == "o" { &big } else { &small };
        let r = s.read_uncached(&key(name), off, len).unwrap();
        let mut got = Vec::new();
        r.append_to(&mut got);
        let end = off.saturating_add(len).min(src.len() as u64) as usize;
        assert!(got == src[off as usize..end], "{name} {off}+{len}: bytes");
        let mut c = 0;
        for &(n, sum) in &r.chunk_crcs {
            let chunk = &got[c..c + n as usize];
            assert_eq!(
                sum,
                crc32c::crc32c(chunk),
                "{name} {off}+{len}: chunk at {c}"
            );
            c += n as usize;
        }
        if whole {
            assert_eq!(
                c,
                got.len(),
                "{name} {off}+{len}: the chunk crcs tile the read"
            );
            assert!(!r.chunk_crcs.is_empty());
        } else {
            assert!(
                r.chunk_crcs.is_empty(),
                "{name} {off}+{len}: a cut chunk, no crcs"
            );
        }
    };
    check("o", 0, u64::MAX, true);
    check("o", cb, 2 * cb, true);
    check("o", 3 << 20, u64::MAX, true);
    check("o", 100, 2 * cb, false);
    check("o", cb, cb - 1, false);
    check("s", 0, u64::MAX, true);
    check("s", 0, 2_999, false);
}

/// `replace` makes an object exactly its data with no xattrs, created or not; xattrs set after
/// it in the same transaction are the only ones. Replaced, fully rewritten and removed states
/// are released from the space accounting when the commit applies (a replace does not look the
/// old state up before): the live bytes the running store counts equal what a reopen recounts
/// from the index.
#[test]
fn replace_drops_xattrs_and_releases_what_it_replaced() {
    let (dev, s) = fresh(64, 7);
    let k = key("replaced");
    let (d1, d2) = (data(1, 5000), data(2, 200_000));
    let mut t = Transaction::new();
    t.replace(k.clone(), &d1);
    s.commit(t).unwrap();
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), data(1, 5000));
    assert!(s.xattrs(&k).unwrap().is_empty());

    s.set_xattr(&k, "old", b"o").unwrap();
    let v_before = s.stat(&k).unwrap().version;
    let mut t = Transaction::new();
    t.replace(k.clone(), &d2).set_xattr(k.clone(), "new", b"n");
    let v = s.commit(t).unwrap();
    assert!(v > v_before);
    assert_eq!(s.read_vec(&k, 0, u64::MAX).unwrap(), data(2, 200_000));
    let x = s.xattrs(&k).unwrap();
    assert_eq!(
        x.into_iter().collect::<Vec<_>>(),
        vec![("new".to_string(), b"n".to_vec())],
        "only the xattr set after the replace"
    );
    // write_full keeps xattrs (the contrast).
    s.write_full(&k, &data(3, 10)).unwrap();
    assert_eq!(s.get_xattr(&k, "new").unwrap(), b"n");
    // An xattr removed after a replace was never there.
    let mut t = Transaction::new();
    t.replace(k.clone(), b"x").rm_xattr(k.clone(), "new");
    assert!(matches!(s.commit(t), Err(StoreError::NoXattr { .. })));
    assert_eq!(
        s.read_vec(&k, 0, u64::MAX).unwrap(),
        data(3, 10),
        "unchanged"
    );

    // Churn: replace, write_full and remove over a few keys, sizes across chunk boundaries.
    for i in 0..300u64 {
        let k = key(&format!("churn-{}", i % 7));
        let n = [0usize, 1, 4096, 70_000, 200_000][(i % 5) as usize];
        match i % 3 {
            0 => {
                let d = data(i, n);
                let mut t = Transaction::new();
                t.replace(k.clone(), &d).set_xattr(k, "a", b"1");
                s.commit(t).unwrap();
            }
            1 => {
                s.write_full(&k, &data(i, n)).unwrap();
            }
            _ => {
                if s.exists(&k) {
                    s.remove(&k).unwrap();
                }
            }
        }
    }
    let live = s.space().live_bytes;
    s.close();
    let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    assert_eq!(
        s.space().live_bytes,
        live,
        "live bytes counted while running vs recounted at open"
    );
    let r = s.scrub();
    assert!(r.corrupt.is_empty() && r.errors.is_empty());
    assert!(r.objects >= 5, "{} objects", r.objects);
}

/// `replace_parts` stores exactly what `replace` of the joined bytes does, however the parts
/// cut the chunks: stripe-unit parts (whole chunks used in place, big enough for the DMA
/// path), cuts inside chunks, empty parts; bytes, size and content checksum agree, no xattrs
/// survive, and so after a reopen, with a clean scrub.
#[test]
fn replace_parts_stores_what_replace_of_the_joined_bytes_does() {
    let (dev, s) = fresh(64, 11);
    let unit = 64 << 10;
    let cases: Vec<(usize, Vec<usize>)> = vec![
        (0, vec![]),
        (1, vec![0, 1]),
        (unit, vec![unit]),
        (3 * unit + 17, vec![unit, 2 * unit, 3 * unit]),
        (16 * unit, (1..16).map(|i| i * unit).collect()),
        (16 * unit - 5, (1..16).map(|i| i * unit).collect()),
        (200_000, vec![1000, 1000, 70_000, 131_072, 199_999]),
        (700_000, vec![3, 65_535, 65_537, 300_000, 300_000, 699_000]),
    ];
    let mut want = Vec::new();
    for (i, (len, cuts)) in cases.iter().enumerate() {
        let d = data(100 + i as u64, *len);
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(cuts.iter().copied())
            .chain(std::iter::once(*len))
            .collect();
        let parts: Vec<&[u8]> = bounds.windows(2).map(|w| &d[w[0]..w[1]]).collect();
        let (kp, kj) = (key(&format!("parts-{i}")), key(&format!("joined-{i}")));
        s.set_xattr(&kp, "old", b"x").unwrap_err(); // absent: nothing to keep
        s.write_full(&kp, b"previous content").unwrap();
        s.set_xattr(&kp, "old", b"x").unwrap();
        let mut t = Transaction::new();
        t.replace_parts(kp.clone(), &parts);
        s.commit(t).unwrap();
        let mut t = Transaction::new();
        t.replace(kj.clone(), &d);
        s.commit(t).unwrap();
        want.push((kp, kj, d));
    }
    let check = |s: &Store<_>| {
        for (kp, kj, d) in &want {
            assert_eq!(&s.read_vec(kp, 0, u64::MAX).unwrap(), d, "{kp} bytes");
            let (a, b) = (s.stat(kp).unwrap(), s.stat(kj).unwrap());
            assert_eq!(a.size, d.len() as u64, "{kp} size");
            assert_eq!(a.checksum, b.checksum, "{kp} content checksum vs {kj}");
            assert!(s.xattrs(kp).unwrap().is_empty(), "{kp} xattrs dropped");
        }
    };
    check(&s);
    s.close();
    let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    check(&s);
    let r = s.scrub();
    assert!(r.corrupt.is_empty() && r.errors.is_empty(), "{r:?}");
}

/// `replace_parts_with_crcs` records the caller's chunk CRCs instead of summing the bytes:
/// right ones read back and scrub clean, with the same content checksum as a plain replace; a
/// wrong one is recorded, so that chunk then reads as `Corrupted` (expected = the given CRC,
/// found = the bytes') and never as wrong bytes, and the other chunks still read; a count
/// that is not the chunk count is refused and changes nothing; a later data op on the object
/// in the same transaction drops the given CRCs.
#[test]
fn replace_parts_with_crcs_records_the_given_crcs() {
    let (_dev, s) = fresh(64, 13);
    let cb = s.chunk_bytes() as usize;
    let d = data(5, 3 * cb + 100);
    let parts: Vec<&[u8]> = d.chunks(cb).collect();
    let crcs: Vec<u32> = parts.iter().map(|p| crc32c::crc32c(p)).collect();
    assert_eq!(crcs.len(), 4);

    let (good, plain) = (key("with-crcs"), key("plain"));
    let mut t = Transaction::new();
    t.replace_parts_with_crcs(good.clone(), &parts, &crcs);
    t.replace(plain.clone(), &d);
    s.commit(t).unwrap();
    assert_eq!(s.read_vec(&good, 0, u64::MAX).unwrap(), d);
    assert_eq!(
        s.stat(&good).unwrap().checksum,
        s.stat(&plain).unwrap().checksum
    );
    let r = s.scrub();
    assert!(r.corrupt.is_empty() && r.errors.is_empty(), "{r:?}");

    // A count that is not the chunk count: refused, nothing changes.
    let mut t = Transaction::new();
    t.replace_parts_with_crcs(good.clone(), &parts[..1], &crcs);
    assert!(matches!(s.commit(t), Err(StoreError::Invalid(_))));
    assert_eq!(s.read_vec(&good, 0, u64::MAX).unwrap(), d);

    // A wrong CRC is what the store records: that chunk fails, the others read.
    let bad = key("wrong-crc");
    let mut wrong = crcs.clone();
    wrong[1] ^= 0x5555;
    let mut t = Transaction::new();
    t.replace_parts_with_crcs(bad.clone(), &parts, &wrong);
    s.commit(t).unwrap();
    match s.read_vec(&bad, 0, u64::MAX) {
        Err(StoreError::Corrupted {
            expected, found, ..
        }) => assert_eq!((expected, found), (wrong[1], crcs[1])),
        other => panic!("a chunk recorded with a wrong CRC read as {other:?}"),
    }
    assert_eq!(s.read_vec(&bad, 0, cb as u64).unwrap(), &d[..cb]);
    assert_eq!(
        s.read_vec(&bad, 2 * cb as u64, u64::MAX).unwrap(),
        &d[2 * cb..]
    );
    assert_eq!(s.scrub().corrupt.len(), 1);

    // A write after it in the same transaction: the store sums the result itself.
    let later = key("written-after");
    let mut t = Transaction::new();
    t.replace_parts_with_crcs(later.clone(), &parts, &wrong)
        .write(later.clone(), 10, b"changed");
    s.commit(t).unwrap();
    let mut want = d.clone();
    want[10..17].copy_from_slice(b"changed");
    assert_eq!(s.read_vec(&later, 0, u64::MAX).unwrap(), want);
}
