//! Checksums end to end: bit flips in the durable image are reported as `Corrupted` (device,
//! offset, expected and found crc) by reads and by scrub — never returned as data — and rot in
//! an acknowledged log batch refuses the open instead of silently rolling objects back.

mod common;

use common::*;
use nvstore_store::{Store, StoreConfig, StoreError};

const BS: u64 = 4096;

/// Objects of 8–200 KiB; returns (name, data).
fn fill(s: &Store<driver::SimDevice>, n: usize, seed: u64) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let name = format!("obj{seed}-{i}");
            let d = data(seed * 1000 + i as u64, 8192 + (i * 7919) % 200_000);
            s.write_full(&key(&name), &d).unwrap();
            (name, d)
        })
        .collect()
}

/// Flip one bit inside the first block of chunk 0 of each chosen object; returns the chunk
/// offsets flipped.
fn flip_chunks(
    dev: &driver::SimDevice,
    s: &Store<driver::SimDevice>,
    names: &[&str],
    seed: u64,
) -> Vec<u64> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let m = s.meta(&key(name)).unwrap();
            let off = m.chunks[0].offset.get();
            let flips = dev.flip_bits(off / BS, 1, 1, seed + i as u64);
            assert_eq!(flips.len(), 1);
            off
        })
        .collect()
}

#[test]
fn flipped_bits_are_reported_never_returned() {
    let (dev, s) = fresh(64, 11);
    let objs = fill(&s, 40, 1);
    let victims: Vec<&str> = objs.iter().step_by(5).map(|(n, _)| n.as_str()).collect();
    let offsets = flip_chunks(&dev, &s, &victims, 99);
    let mut detected = 0;
    for (name, d) in &objs {
        match s.read_vec(&key(name), 0, u64::MAX) {
            Ok(got) => {
                assert!(
                    !victims.contains(&name.as_str()),
                    "{name}: a flipped chunk read back without error"
                );
                assert_eq!(&got, d, "{name}: wrong bytes");
            }
            Err(StoreError::Corrupted {
                offset,
                expected,
                found,
                device,
                ..
            }) => {
                assert!(
                    victims.contains(&name.as_str()),
                    "{name}: reported corrupt but not flipped"
                );
                assert!(
                    offsets.contains(&offset),
                    "the error names the chunk's offset"
                );
                assert_ne!(expected, found);
                assert!(device.starts_with("sim:"), "the error names the device");
                detected += 1;
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    assert_eq!(detected, victims.len(), "every flip detected by reads");
    let scrub = s.scrub();
    eprintln!(
        "flipped {} chunks; reads detected {detected}; scrub checked {} objects / {} chunks and found {} corrupt",
        victims.len(),
        scrub.objects,
        scrub.chunks,
        scrub.corrupt.len()
    );
    assert_eq!(scrub.corrupt.len(), victims.len(), "scrub finds every flip");
    assert_eq!(s.stats().corrupt_reads, victims.len() as u64);
}

#[test]
fn flips_in_checkpointed_data_are_found_after_reopen() {
    let (dev, s) = fresh(64, 12);
    let objs = fill(&s, 30, 2);
    s.checkpoint().unwrap();
    let victims: Vec<&str> = objs.iter().take(3).map(|(n, _)| n.as_str()).collect();
    flip_chunks(&dev, &s, &victims, 7);
    drop(s);
    let (s, r) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    assert_eq!(r.objects, 30);
    let scrub = s.scrub();
    assert_eq!(scrub.corrupt.len(), 3);
    for (name, d) in &objs[3..] {
        assert_eq!(&s.read_vec(&key(name), 0, u64::MAX).unwrap(), d);
    }
}

#[test]
fn rot_in_an_acknowledged_log_batch_refuses_to_open() {
    let (dev, s) = fresh(64, 13);
    s.checkpoint().unwrap();
    // Several acknowledged batches after the checkpoint, then rot the first one's records.
    let objs = fill(&s, 6, 3);
    let m = s.meta(&key(&objs[0].0)).unwrap();
    drop(s);
    // The batch header sits in the block before the first chunk of its data.
    let header = m.chunks[0].offset.get() - BS;
    dev.flip_bit(header + 20, 3);
    let e = Store::open(dev, Some(FSID), StoreConfig::default())
        .err()
        .expect("open must refuse");
    let msg = e.to_string();
    assert!(msg.contains("acknowledged data is corrupt"), "{msg}");
}

#[test]
fn background_scrub_finds_flips_on_its_own() {
    let dev = sim(64, 14);
    nvstore_store::mkfs(&dev, &mkfs_opts()).unwrap();
    let config = StoreConfig {
        scrub: Some(nvstore_store::ScrubSchedule {
            interval: std::time::Duration::from_millis(50),
            bytes_per_sec: 1 << 30,
        }),
        ..StoreConfig::default()
    };
    let (s, _) = Store::open(dev.clone(), Some(FSID), config).unwrap();
    let objs = fill(&s, 12, 4);
    let victims: Vec<&str> = objs.iter().take(2).map(|(n, _)| n.as_str()).collect();
    flip_chunks(&dev, &s, &victims, 31);
    // Wait (bounded) for a complete pass that started after the flips.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let report = loop {
        if let Some(r) = s.last_scrub().filter(|r| r.corrupt.len() == 2) {
            break r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no scrub pass reported the flips: {:?}",
            s.last_scrub()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(report.objects, 12);
    let mut keys: Vec<String> = report
        .corrupt
        .iter()
        .map(|c| String::from_utf8_lossy(&c.key.name).into_owned())
        .collect();
    keys.sort();
    let mut want: Vec<String> = victims.iter().map(|v| v.to_string()).collect();
    want.sort();
    assert_eq!(keys, want);
}

#[test]
fn locate_names_the_device_extents_of_an_objects_data() {
    let (dev, s) = fresh(64, 12);
    let objs = fill(&s, 6, 3);
    for (name, d) in &objs {
        let ext = s.locate(&key(name)).unwrap();
        let m = s.meta(&key(name)).unwrap();
        assert_eq!(
            ext.len(),
            m.chunks.iter().filter(|c| c.len.get() > 0).count()
        );
        assert!(
            ext.iter().map(|e| e.1).sum::<u64>() >= d.len() as u64,
            "{name}"
        );
    }
    assert!(matches!(
        s.locate(&key("absent")),
        Err(StoreError::NotFound(_))
    ));
    // A bit flipped at a located offset is what a read then reports.
    let (name, _) = &objs[2];
    let (off, _) = s.locate(&key(name)).unwrap()[0];
    assert_eq!(dev.flip_bits(off / BS, 1, 1, 5).len(), 1);
    match s.read_vec(&key(name), 0, u64::MAX) {
        Err(StoreError::Corrupted { offset, .. }) => assert_eq!(offset, off),
        other => panic!("{other:?}"),
    }
}
