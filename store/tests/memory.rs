//! A closed store gives its memory back: what stays resident after a store of a busy device
//! is closed does not grow with each store opened and closed. This binary's one test measures
//! its own process's resident set, so no other test runs beside it.

use driver::workload::{rss_kib, trim_heap};
use driver::{FileDevice, FileOptions};
use nvstore_store::{bench, mkfs, MkfsOptions, Store, StoreConfig};

/// Opens a store on `path`, has 16 threads write `per_writer` 4 MiB objects each, closes it.
fn busy_store(path: &std::path::Path, per_writer: u64) {
    let dev = FileDevice::create(path, 1 << 30, FileOptions::default()).unwrap();
    mkfs(&dev, &MkfsOptions::default()).unwrap();
    drop(dev);
    let dev = FileDevice::open(path, FileOptions::default()).unwrap();
    let (s, _) = Store::open(dev, None, StoreConfig::default()).unwrap();
    let data = vec![0x5a_u8; 4 << 20];
    std::thread::scope(|sc| {
        for t in 0..16 {
            let (s, data) = (&s, &data);
            sc.spawn(move || {
                for i in 0..per_writer {
                    s.write_full(&bench::key(t * 100 + i), data).unwrap();
                }
            });
        }
    });
    // Every object is there before the store closes (the writes were not lost).
    for t in 0..16 {
        for i in 0..per_writer {
            assert_eq!(s.stat(&bench::key(t * 100 + i)).unwrap().size, 4 << 20);
        }
    }
}

#[test]
fn a_closed_store_gives_back_its_buffers_however_many_writers_it_had() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev.img");
    trim_heap();
    let start = rss_kib();
    let mut after = Vec::new();
    for _ in 0..4 {
        busy_store(&path, 2);
        // Free memory the C allocator holds goes back to the kernel; what stays is held.
        trim_heap();
        after.push(rss_kib());
    }
    eprintln!("resident at start {start} KiB, after each closed store {after:?} KiB");
    // A store's DMA buffers are its own (its device's pool, 128 MiB at most) and go with it.
    // 4 MiB buffers from the C heap stayed in glibc's per-thread arenas instead: 60 MiB after
    // the first store, 100 MiB after the fourth.
    let held = after.iter().max().unwrap().saturating_sub(start);
    assert!(
        held < 24 << 10,
        "{held} KiB stay resident after closed stores (start {start} KiB, after each {after:?})"
    );
}
