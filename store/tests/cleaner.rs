//! The cleaner under churn: fill the store to 90 % of its usable space, then overwrite random
//! objects until ten times the device's capacity has been written. Space stays bounded (no
//! out-of-space errors, writes wait for the cleaner at most), every object verifies, and the
//! write amplification is reported.

mod common;

use common::*;
use driver::{SimConfig, SimDevice};
use nvstore_store::space::SegState;
use nvstore_store::{mkfs, MkfsOptions, Store, StoreConfig};
use rand::{Rng, SeedableRng};

#[test]
fn churn_at_90_percent_full_stays_bounded() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let seed = 0xc1ea;
    eprintln!("churn seed {seed:#x}");
    let dev = SimDevice::new(
        SimConfig {
            capacity_blocks: 64 * 256,
            ..SimConfig::default()
        },
        seed,
    );
    let opts = MkfsOptions {
        segment_bytes: 2 << 20,
        ..mkfs_opts()
    };
    mkfs(&dev, &opts).unwrap();
    let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    let space = s.space();
    let usable = space.usable_bytes();
    let obj = 64 << 10;
    let count = (usable * 9 / 10 / obj) as usize;
    let capacity = space.segments_total * space.segment_bytes;
    eprintln!(
        "{} segments of {} KiB, reserve {}, {count} objects of 64 KiB",
        space.segments_total,
        space.segment_bytes >> 10,
        space.segments_reserve
    );
    let mut gen = vec![0u64; count];
    // Fill with 16-object transactions so batch headers take little of the 10 % left over.
    let initial: Vec<Vec<u8>> = (0..count).map(|i| data(i as u64, obj as usize)).collect();
    for group in (0..count).collect::<Vec<_>>().chunks(16) {
        let mut t = nvstore_store::Transaction::new();
        for &i in group {
            t.write_full(key(&format!("o{i}")), &initial[i]);
        }
        s.commit(t).unwrap();
    }
    drop(initial);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut written = count as u64 * obj;
    let mut min_free = u64::MAX;
    while written < 10 * capacity {
        let i = rng.gen_range(0..count);
        gen[i] += 1;
        let d = data((i as u64) << 32 | gen[i], obj as usize);
        s.write_full(&key(&format!("o{i}")), &d)
            .unwrap_or_else(|e| panic!("overwrite after {written} bytes: {e}"));
        written += obj;
        min_free = min_free.min(s.space().segments_free);
    }
    for (i, &g) in gen.iter().enumerate() {
        let want = data(
            if g == 0 {
                i as u64
            } else {
                (i as u64) << 32 | g
            },
            obj as usize,
        );
        assert_eq!(
            s.read_vec(&key(&format!("o{i}")), 0, u64::MAX).unwrap(),
            want,
            "object {i}"
        );
    }

    let st = s.stats();
    let space = s.space();
    eprintln!(
        "wrote {} MiB ({:.1}× capacity): write amplification {:.2}, relocated {} MiB, {} segments cleaned, {} checkpoints, min free segments {min_free}, live {} MiB, dead {} MiB",
        written >> 20,
        written as f64 / capacity as f64,
        st.write_amplification(),
        st.relocated_bytes >> 20,
        st.cleaned_segments,
        st.checkpoints,
        space.live_bytes >> 20,
        space.dead_bytes >> 20
    );
    assert!(st.cleaned_segments > 0, "the cleaner ran");
    assert!(
        space.live_bytes >= count as u64 * obj,
        "live bytes cover every object"
    );
    drop(s);
    let (s, r) = Store::open(dev, Some(FSID), StoreConfig::default()).unwrap();
    assert_eq!(r.objects as usize, count);
    assert!(s.scrub().corrupt.is_empty());
}

/// Label `dev` with 1 MiB segments (a few of them fill quickly) and open it with the cleaner
/// on or off (off: the test sets up the space it wants).
fn mkfs_1mib_segments(dev: &SimDevice, cleaner: bool) -> Store<SimDevice> {
    let opts = MkfsOptions {
        segment_bytes: 1 << 20,
        ..mkfs_opts()
    };
    mkfs(dev, &opts).unwrap();
    let config = StoreConfig {
        cleaner,
        ..StoreConfig::default()
    };
    Store::open(dev.clone(), Some(FSID), config).unwrap().0
}

/// A store full of live data refuses writes but still takes removes, even when the removes
/// need a segment from the reserve (the log head is full) — a full node must be able to drop
/// a deleted pool's keys — and afterwards takes writes again.
#[test]
fn a_full_store_takes_removes_and_then_writes_again() {
    let dev = SimDevice::new(
        SimConfig {
            capacity_blocks: 32 * 256,
            ..SimConfig::default()
        },
        0xf011,
    );
    let s = mkfs_1mib_segments(&dev, false);
    let full = |r: nvstore_store::Result<u64>| match r {
        Ok(_) => false,
        Err(nvstore_store::StoreError::OutOfSpace { .. }) => true,
        Err(e) => panic!("{e}"),
    };
    // 60 KiB objects until one does not fit, then empty ones until not even a record fits:
    // the free segments are down to the floor kept for writes, and the log head is full.
    let obj = 60 << 10;
    let mut n = 0usize;
    while !full(s.write_full(&key(&format!("o{n}")), &data(n as u64, obj))) {
        n += 1;
        assert!(n < 10_000, "a 32 MiB store never filled");
    }
    let mut e = 0usize;
    while !full(s.write_full(&key(&format!("e{e}")), &[])) {
        e += 1;
        assert!(e < 100_000, "empty objects never filled the log head");
    }
    let space = s.space();
    eprintln!(
        "full after {n} objects and {e} empty ones: {} of {} segments free, reserve {}",
        space.segments_free, space.segments_total, space.segments_reserve
    );
    // Neither a small metadata change nor a write that says it makes room but is not small
    // gets in; a small one that says so does (a node's remove: a tombstone's xattrs and a log
    // entry, the old bytes kept until the remove is settled), and so do the drops of the old
    // bytes that follow such removes, even once removes fill all the room they may use.
    let mut t = nvstore_store::Transaction::new();
    t.set_xattr(key("o0"), "tomb", b"1");
    assert!(full(s.commit(t)), "a plain metadata change on a full store");
    let big = data(7, nvstore_store::MAKES_ROOM_BYTES_MAX as usize + 4096);
    let mut t = nvstore_store::Transaction::new();
    t.makes_room().write_full(key("room"), &big);
    assert!(full(s.commit(t)), "a big write that says it makes room");
    let mut t = nvstore_store::Transaction::new();
    t.makes_room()
        .set_xattr(key("o0"), "tomb", b"1")
        .replace(key("log-o0"), &[]);
    s.commit(t).expect("a small transaction that makes room");
    assert_eq!(s.get_xattr(&key("o0"), "tomb").unwrap(), b"1");
    assert_eq!(
        s.read_vec(&key("o0"), 0, obj as u64).unwrap(),
        data(0, obj),
        "the tombstone keeps the old bytes until it is settled"
    );
    // Tombstones until not even they fit: the steps that free their bytes still do.
    let mut tombs = 1usize;
    loop {
        let mut t = nvstore_store::Transaction::new();
        t.makes_room()
            .set_xattr(key(&format!("o{tombs}")), "tomb", b"1")
            .replace(key(&format!("log-o{tombs}")), &[]);
        if full(s.commit(t)) {
            break;
        }
        tombs += 1;
        assert!(
            tombs < n,
            "{tombs} tombstones never filled the room they may use"
        );
    }
    // A drop costs about what its tombstone did (a record and an xattr block); the drops get
    // a segment more than the tombstones had (the head's rest and one), so at least half of
    // them fit with the cleaner off. With it on, the bytes they free come back (below).
    let mut dropped = 0usize;
    for i in 0..tombs {
        let mut t = nvstore_store::Transaction::new();
        t.frees_space()
            .replace(key(&format!("o{i}")), &[])
            .set_xattr(key(&format!("o{i}")), "tomb", b"1")
            .remove(key(&format!("log-o{i}")));
        if full(s.commit(t)) {
            break;
        }
        assert_eq!(s.stat(&key(&format!("o{i}"))).unwrap().size, 0);
        dropped += 1;
    }
    assert!(
        dropped * 2 >= tombs,
        "{dropped} of {tombs} tombstones' bytes dropped"
    );
    eprintln!("{tombs} tombstones filled the room removes may use; {dropped} drops fit after");
    for group in (0..n).collect::<Vec<_>>().chunks(16) {
        let mut t = nvstore_store::Transaction::new();
        for &i in group {
            t.remove(key(&format!("o{i}")));
        }
        s.commit(t)
            .unwrap_or_else(|err| panic!("removes of o{}..: {err}", group[0]));
    }
    assert_eq!(s.list(1, None, usize::MAX).len(), e);
    // With the cleaner (and the checkpoint that releases dead segments), the space comes back.
    drop(s);
    let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    for i in 0..n / 2 {
        s.write_full(&key(&format!("p{i}")), &data(100 + i as u64, obj))
            .unwrap_or_else(|err| panic!("write p{i} after the removes: {err}"));
    }
    for i in 0..n / 2 {
        assert_eq!(
            s.read_vec(&key(&format!("p{i}")), 0, obj as u64).unwrap(),
            data(100 + i as u64, obj)
        );
    }
}

/// A store at the floor it keeps for writes, whose sealed segments are all nearly all live
/// and whose head filled with overwritten versions of one object: no write may open the next
/// segment, and the only dead data is in the head. Built with the cleaner off and closed;
/// returns the device, the number of `big{i}` objects and the live version of `churn`.
fn full_head_store(reorder: bool) -> (SimDevice, u64, u64) {
    let dev = SimDevice::new(
        SimConfig {
            capacity_blocks: 16 * 256,
            atomic_write_bytes: 512,
            reorder,
            ..SimConfig::default()
        },
        0x4ead,
    );
    let s = mkfs_1mib_segments(&dev, false);
    // As on any store that has run a while, a checkpoint holds a segment (the next one, which
    // frees the cleaned head, replaces it).
    s.write_full(&key("first"), b"x").unwrap();
    s.checkpoint().unwrap();
    let seg = s.space().segment_bytes;
    let reserve = s.space().segments_reserve;
    let head = |s: &Store<SimDevice>| {
        let segs = s.segments();
        let i = segs.iter().position(|u| u.head).unwrap();
        (i, segs[i].live_bytes)
    };
    // Two 500 KiB objects fill a 1 MiB segment (98 % live) and leave its head full. Stop one
    // segment above the floor, with the head full of live data.
    let mut n = 0u64;
    loop {
        s.write_full(&key(&format!("big{n}")), &data(n, BIG))
            .unwrap_or_else(|e| panic!("big{n}: {e}"));
        n += 1;
        let (_, live) = head(&s);
        if s.space().segments_free == reserve + 1 && live * 100 >= seg * 95 {
            break;
        }
        assert!(n < 64, "never one segment above the floor with a full head");
    }
    // Overwrite one small object: the log moves into the last segment it may open, which
    // fills with dead versions until a write is refused.
    let (full_at, _) = head(&s);
    let mut v = 0u64;
    loop {
        match s.write_full(&key("churn"), &data(1000 + v, SMALL)) {
            Ok(_) => v += 1,
            Err(nvstore_store::StoreError::OutOfSpace { .. }) => break,
            Err(e) => panic!("churn {v}: {e}"),
        }
        assert!(v < 1000, "the head never filled");
    }
    let (churn_head, live) = head(&s);
    assert_ne!(churn_head, full_at, "the churn opened a segment of its own");
    assert_eq!(
        live, SMALL as u64,
        "only the last version is live in the head"
    );
    assert_eq!(s.space().segments_free, reserve);
    for (i, u) in s.segments().iter().enumerate() {
        if i != churn_head && u.live_bytes > 0 {
            assert!(u.live_bytes * 100 >= seg * 95, "segment {i}: {u:?}");
        }
    }
    drop(s);
    (dev, n, 1000 + v - 1)
}

const BIG: usize = 500 << 10;
const SMALL: usize = 32 << 10;

/// Everything [`full_head_store`] wrote reads back.
fn verify_full_head_store(s: &Store<SimDevice>, n: u64, churn: u64, ctx: &str) {
    for i in 0..n {
        let k = key(&format!("big{i}"));
        assert_eq!(
            s.read_vec(&k, 0, BIG as u64).unwrap(),
            data(i, BIG),
            "{ctx}: big{i}"
        );
    }
    assert_eq!(
        s.read_vec(&key("churn"), 0, SMALL as u64).unwrap(),
        data(churn, SMALL),
        "{ctx}: churn"
    );
}

/// The dead data of a full log head comes back ([`full_head_store`]). The cleaner takes the
/// full head as its victim (relocating the live version moves the log on), so a write that
/// waits for it goes in — where a cleaner that never cleans the head left the store refusing
/// every write for good.
#[test]
fn the_dead_data_of_a_full_log_head_is_reclaimed() {
    let (dev, n, churn) = full_head_store(false);
    let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    s.write_full(&key("after"), &data(7, BIG))
        .expect("a write once the head's dead data is reclaimed");
    assert_eq!(
        s.read_vec(&key("after"), 0, BIG as u64).unwrap(),
        data(7, BIG)
    );
    verify_full_head_store(&s, n, churn, "after the reclaim");
    assert!(s.scrub().corrupt.is_empty());
}

/// Power fails at every write or flush of that reclaim in turn (the relocation out of the
/// head into the next segment, the checkpoint that frees the head, the write that waited),
/// with unflushed writes dropped, kept or torn: after reopening, everything written before
/// reads back, and the waiting write is there if it was acknowledged.
#[test]
fn a_crash_while_the_full_head_is_reclaimed_loses_nothing() {
    let (base, n, churn) = full_head_store(true);
    let mut points = 0;
    let mut finished = false;
    for k in 1..200u64 {
        let dev = base.crash(0);
        let ctx = format!("crash after write or flush {k}");
        let (s, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
        dev.power_fail_after(k);
        let acked = s.write_full(&key("after"), &data(7, BIG)).is_ok() && !dev.is_gone();
        if acked {
            // Past the reclaim's last write: every crash point was visited.
            finished = true;
            break;
        }
        drop(s);
        points += 1;
        for crash_seed in 0..8 {
            let after = dev.crash(crash_seed);
            let (s, _) = Store::open(after, Some(FSID), StoreConfig::default())
                .unwrap_or_else(|e| panic!("{ctx}, crash seed {crash_seed}: open: {e}"));
            let ctx = format!("{ctx}, crash seed {crash_seed}");
            verify_full_head_store(&s, n, churn, &ctx);
            if let Ok(got) = s.read_vec(&key("after"), 0, BIG as u64) {
                assert_eq!(got, data(7, BIG), "{ctx}: after");
            }
        }
    }
    assert!(
        finished && points >= 3,
        "{points} crash points, finished {finished}"
    );
    eprintln!("{points} crash points × 8 crash seeds");
}

/// A store near full whose sealed segments are all 80–95 % live, with free segments to spare
/// above the floor kept for writes: small writes that fit do not set the cleaner relocating
/// those segments (4 to 19 bytes written per byte freed), though free space is below the
/// cleaner's target; writes that need the space get it from them, and everything verifies.
#[test]
fn highly_live_segments_are_cleaned_only_when_writes_need_the_space() {
    let dev = SimDevice::new(
        SimConfig {
            capacity_blocks: 48 * 256,
            ..SimConfig::default()
        },
        0x11fe,
    );
    let s = mkfs_1mib_segments(&dev, true);
    let space = s.space();
    let (reserve, seg) = (space.segments_reserve, space.segment_bytes);
    let target = reserve * 2 + space.segments_total / 20;
    // 60 KiB objects (16 to a segment) until the free segments are 2 below the cleaner's
    // target, then a remove of every sixteenth: each sealed segment loses one of its 15 or 16.
    let obj = 60 << 10;
    let mut n = 0u64;
    while s.space().segments_free > target - 2 {
        s.write_full(&key(&format!("o{n}")), &data(n, obj)).unwrap();
        n += 1;
    }
    let mut t = nvstore_store::Transaction::new();
    for i in (0..n).step_by(16) {
        t.remove(key(&format!("o{i}")));
    }
    s.commit(t).unwrap();
    let live = |i: u64| !i.is_multiple_of(16);
    for u in s.segments() {
        if matches!(u.state, SegState::Log { .. }) && !u.head {
            let f = u.live_bytes as f64 / seg as f64;
            assert!(f > 0.8 && f <= 0.95, "a sealed segment {f:.3} live");
        }
    }
    let free = s.space().segments_free;
    assert!(
        free >= reserve + 4 && free < target,
        "{free} free segments, reserve {reserve}, cleaner's target {target}"
    );
    // A trickle of small writes that have room, for 25 of the cleaner's 20 ms looks.
    for i in 0..25u64 {
        s.write_full(&key(&format!("s{i}")), &data(1000 + i, 512))
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let st = s.stats();
    assert_eq!(
        (st.cleaned_segments, st.relocated_bytes),
        (0, 0),
        "the cleaner relocated highly live segments while writes had room ({} free, reserve {reserve})",
        s.space().segments_free
    );
    // Writes that need more than the free segments above the reserve hold: the cleaner
    // reclaims the dead data of those segments for them.
    let space = s.space();
    let want = ((space.segments_free - reserve) * seg + space.dead_bytes / 4) / obj as u64;
    for i in 0..want {
        s.write_full(&key(&format!("p{i}")), &data(2000 + i, obj))
            .unwrap_or_else(|e| panic!("write p{i} of {want}: {e}"));
    }
    let st = s.stats();
    eprintln!(
        "{n} objects, {want} more written: {} segments cleaned, {} KiB relocated",
        st.cleaned_segments,
        st.relocated_bytes >> 10
    );
    assert!(st.cleaned_segments > 0, "the writes needed the cleaner");
    for i in (0..n).filter(|&i| live(i)) {
        assert_eq!(
            s.read_vec(&key(&format!("o{i}")), 0, u64::MAX).unwrap(),
            data(i, obj),
            "o{i}"
        );
    }
    for i in 0..want {
        assert_eq!(
            s.read_vec(&key(&format!("p{i}")), 0, u64::MAX).unwrap(),
            data(2000 + i, obj),
            "p{i}"
        );
    }
    assert!(s.scrub().corrupt.is_empty());
}
