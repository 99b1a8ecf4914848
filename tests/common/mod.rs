//! What the cluster integration tests share: a local cluster of real monitor and node
//! processes (the built `nvstore` binary) on loopback, torn down when the test ends whether it
//! passes or panics, and seeded object bytes.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;

use nvstore::cluster_cmd::{LocalCluster, LocalOptions};
use nvstore::Client;
use rand::{RngCore, SeedableRng};

pub struct Harness {
    pub lc: LocalCluster,
    pub client: Client,
    pub _dir: tempfile::TempDir,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.lc.down();
    }
}

/// Create a local cluster as `o` says in a fresh temporary directory named `prefix…`, start
/// it, and connect a client (a failed start stops whatever did start, then panics).
pub fn cluster(prefix: &str, o: &LocalOptions) -> Harness {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let lc = LocalCluster::new(dir.path(), Path::new(env!("CARGO_BIN_EXE_nvstore")));
    lc.create(o).unwrap();
    let client = match lc.up() {
        Ok(c) => c,
        Err(e) => {
            let _ = lc.down();
            panic!("cluster up: {e}");
        }
    };
    Harness {
        lc,
        client,
        _dir: dir,
    }
}

/// `len` bytes from a seeded generator: the same seed gives the same bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand_chacha::ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

struct Nothing;
impl messenger::Dispatcher for Nothing {
    fn handle(&self, _m: messenger::Incoming) {}
}

impl Harness {
    /// A messenger speaking as `me` with the cluster's key, for raw requests straight to
    /// nodes (bypassing the client's checks, or impersonating a node); it handles nothing
    /// sent to it.
    pub fn raw_messenger(&self, me: messenger::Identity) -> messenger::Messenger {
        let secret = messenger::Secret::load(&self.lc.dir.join("cluster.key")).unwrap();
        messenger::Messenger::new(
            messenger::Config::default(),
            me,
            secret,
            std::sync::Arc::new(Nothing),
        )
        .unwrap()
    }
}
