//! `Transaction::rename`: an object moves to its partner key by reference (no bytes copied),
//! survives reopen with and without a checkpoint, and the cleaner still finds its chunks.

mod common;

use common::*;
use nvstore_store::{mkfs, MkfsOptions, ObjectKey, Store, StoreConfig, StoreError, Transaction};

/// The node's pairing: a shard and its rollback key differ in the top bit of the shard id.
fn partner(k: &ObjectKey) -> Option<ObjectKey> {
    Some(ObjectKey {
        shard: k.shard ^ 0x80,
        ..k.clone()
    })
}

fn config() -> StoreConfig {
    StoreConfig {
        alias: Some(partner),
        ..StoreConfig::default()
    }
}

fn rb(name: &str) -> ObjectKey {
    partner(&key(name)).unwrap()
}

#[test]
fn rename_moves_an_object_to_its_partner_without_copying_it() {
    let dev = sim(64, 21);
    mkfs(&dev, &mkfs_opts()).unwrap();
    let (s, _) = Store::open(dev.clone(), Some(FSID), config()).unwrap();
    let old = data(1, 1 << 20);
    let new = data(2, 300_000);
    s.write_full(&key("a"), &old).unwrap();
    let mut t = Transaction::new();
    t.set_xattr(key("a"), "color", b"blue");
    s.commit(t).unwrap();
    s.write_full(&rb("a"), b"an older rollback copy").unwrap();
    let live = s.space().live_bytes;
    let written = s.stats().device_bytes_written;

    // What a node's overwrite does: the old shard becomes the rollback key, the new bytes
    // the shard, in one transaction.
    let mut t = Transaction::new();
    t.rename(key("a"), rb("a")).write_full(key("a"), &new);
    s.commit(t).unwrap();
    let wrote = s.stats().device_bytes_written - written;
    assert!(
        wrote < new.len() as u64 + (64 << 10),
        "the overwrite wrote {wrote} bytes for {} new ones: the old {} were copied",
        new.len(),
        old.len()
    );
    assert_eq!(s.read_vec(&rb("a"), 0, u64::MAX).unwrap(), old);
    assert_eq!(s.get_xattr(&rb("a"), "color").unwrap(), b"blue");
    assert_eq!(
        s.stat(&rb("a")).unwrap().checksum,
        nvstore_store::content_checksum(&old, 64 << 10)
    );
    assert_eq!(s.read_vec(&key("a"), 0, u64::MAX).unwrap(), new);
    assert!(
        s.xattrs(&key("a")).unwrap().is_empty(),
        "the renamed object took its xattrs along"
    );
    // The older copy's bytes went; the renamed ones stay counted once.
    let now = s.space().live_bytes;
    assert!(
        now >= live + new.len() as u64 - 8192 && now <= live + new.len() as u64 + 8192,
        "{now} live bytes after, {live} before"
    );

    // Only to the partner key; only an object that exists, unchanged so far in the
    // transaction; and only with an alias configured.
    let mut t = Transaction::new();
    t.rename(key("a"), key("b"));
    assert!(matches!(s.commit(t), Err(StoreError::Invalid(_))));
    let mut t = Transaction::new();
    t.rename(key("nope"), rb("nope"));
    assert!(matches!(s.commit(t), Err(StoreError::NotFound(_))));
    let mut t = Transaction::new();
    t.write(key("a"), 0, b"x").rename(key("a"), rb("a"));
    assert!(matches!(s.commit(t), Err(StoreError::Invalid(_))));
    assert_eq!(s.read_vec(&key("a"), 0, u64::MAX).unwrap(), new);

    // Moved back, then through a reopen that replays it, and one after a checkpoint.
    let mut t = Transaction::new();
    t.remove(key("a")).rename(rb("a"), key("a"));
    s.commit(t).unwrap();
    assert_eq!(s.read_vec(&key("a"), 0, u64::MAX).unwrap(), old);
    assert!(!s.exists(&rb("a")));
    s.write_full(&key("c"), &new).unwrap();
    let mut t = Transaction::new();
    t.rename(key("c"), rb("c"));
    s.commit(t).unwrap();
    s.close();
    let check = |s: &Store<driver::SimDevice>| {
        assert_eq!(s.read_vec(&key("a"), 0, u64::MAX).unwrap(), old);
        assert_eq!(s.get_xattr(&key("a"), "color").unwrap(), b"blue");
        assert_eq!(s.read_vec(&rb("c"), 0, u64::MAX).unwrap(), new);
        assert!(!s.exists(&key("c")) && !s.exists(&rb("a")));
        let r = s.scrub();
        assert!(r.corrupt.is_empty() && r.errors.is_empty(), "{r:?}");
    };
    let (s, _) = Store::open(dev.clone(), Some(FSID), config()).unwrap();
    check(&s);
    let live = s.space().live_bytes;
    s.checkpoint().unwrap();
    s.close();
    let (s, _) = Store::open(dev.clone(), Some(FSID), config()).unwrap();
    check(&s);
    assert_eq!(
        s.space().live_bytes,
        live,
        "liveness rebuilt the same at open"
    );

    // A store opened without the pairing refuses renames.
    s.close();
    let (s, _) = Store::open(dev, Some(FSID), StoreConfig::default()).unwrap();
    let mut t = Transaction::new();
    t.rename(key("a"), rb("a"));
    assert!(matches!(s.commit(t), Err(StoreError::Invalid(_))));
}

/// Renamed chunks lie in segments written under the original key; the cleaner finds them
/// through the partner and relocates them, so churn cleans those segments too (without it
/// they never went free: their live bytes had no object the cleaner could find).
#[test]
fn the_cleaner_relocates_renamed_chunks() {
    let dev = sim(24, 22);
    let opts = MkfsOptions {
        segment_bytes: 1 << 20,
        ..mkfs_opts()
    };
    mkfs(&dev, &opts).unwrap();
    let (s, _) = Store::open(dev.clone(), Some(FSID), config()).unwrap();
    // Live filler, then objects to keep interleaved with objects to drop, so their segments
    // end half dead and free space runs low enough for the cleaner to want them.
    let obj = 128 << 10;
    for i in 0..24u64 {
        s.write_full(&key(&format!("fill{i}")), &data(500 + i, obj))
            .unwrap();
    }
    for i in 0..48u64 {
        s.write_full(&key(&format!("keep{i}")), &data(i, obj))
            .unwrap();
        s.write_full(&key(&format!("drop{i}")), &data(100 + i, obj))
            .unwrap();
    }
    let mut before = Vec::new();
    for i in 0..48u64 {
        let mut t = Transaction::new();
        t.rename(key(&format!("keep{i}")), rb(&format!("keep{i}")))
            .remove(key(&format!("drop{i}")));
        s.commit(t).unwrap();
        before.push(s.locate(&rb(&format!("keep{i}"))).unwrap());
    }
    // Churn: overwrite a few objects until ten devices' worth has been written.
    let cap = 24u64 << 20;
    let mut written = 0u64;
    let mut n = 0u64;
    while written < 10 * cap {
        s.write_full(&key(&format!("churn{}", n % 16)), &data(1000 + n, obj))
            .unwrap();
        written += obj as u64;
        n += 1;
    }
    let moved = (0..48u64)
        .filter(|&i| s.locate(&rb(&format!("keep{i}"))).unwrap() != before[i as usize])
        .count();
    eprintln!(
        "{moved} of 48 renamed objects relocated; {} segments cleaned",
        s.stats().cleaned_segments
    );
    assert!(moved > 0, "the cleaner never relocated a renamed object");
    for i in 0..48u64 {
        assert_eq!(
            s.read_vec(&rb(&format!("keep{i}")), 0, u64::MAX).unwrap(),
            data(i, obj),
            "keep{i}"
        );
    }
    s.close();
    let (s, _) = Store::open(dev, Some(FSID), config()).unwrap();
    for i in 0..48u64 {
        assert_eq!(
            s.read_vec(&rb(&format!("keep{i}")), 0, u64::MAX).unwrap(),
            data(i, obj)
        );
    }
    let r = s.scrub();
    assert!(r.corrupt.is_empty() && r.errors.is_empty(), "{r:?}");
}
