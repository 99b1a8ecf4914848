#![allow(dead_code)]

use driver::{SimConfig, SimDevice};
use nvstore_store::{mkfs, MkfsOptions, ObjectKey, Store, StoreConfig};

pub const FSID: [u8; 16] = *b"test-cluster-id!";

pub fn sim(capacity_mb: u64, seed: u64) -> SimDevice {
    SimDevice::new(
        SimConfig {
            capacity_blocks: capacity_mb * 256,
            ..SimConfig::default()
        },
        seed,
    )
}

pub fn mkfs_opts() -> MkfsOptions {
    MkfsOptions {
        cluster_fsid: FSID,
        node_id: 1,
        segment_bytes: 2 << 20,
        chunk_bytes: 64 << 10,
        ..MkfsOptions::default()
    }
}

pub fn fresh(capacity_mb: u64, seed: u64) -> (SimDevice, Store<SimDevice>) {
    fresh_with(capacity_mb, seed, &mkfs_opts())
}

/// [`fresh`] with other mkfs options (segment size, say).
pub fn fresh_with(
    capacity_mb: u64,
    seed: u64,
    opts: &MkfsOptions,
) -> (SimDevice, Store<SimDevice>) {
    let dev = sim(capacity_mb, seed);
    mkfs(&dev, opts).unwrap();
    let (store, _) = Store::open(dev.clone(), Some(FSID), StoreConfig::default()).unwrap();
    (dev, store)
}

pub fn key(name: &str) -> ObjectKey {
    ObjectKey::new(1, name.as_bytes(), 0)
}

/// Deterministic bytes for (seed, length).
pub fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
