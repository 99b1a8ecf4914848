//! The conformance suite on every backend available without hardware: FileDevice through
//! io_uring, FileDevice through the pread/pwrite fallback, and SimDevice (with completion
//! reordering and latency jitter on, so nothing depends on completion order).

use std::time::Duration;

use nvstore_driver::conformance::Fixture;
use nvstore_driver::{Engine, FileDevice, FileOptions, Latency, SimConfig, SimDevice};

fn file_fixture(engine: Engine) -> Fixture<FileDevice> {
    let dir = tempfile::tempdir().unwrap();
    let opts = FileOptions {
        engine,
        queue_count: 8,
        ..FileOptions::default()
    };
    let dev = FileDevice::create(&dir.path().join("dev.img"), 64 << 20, opts).unwrap();
    assert_eq!(
        dev.engine(),
        engine,
        "the requested engine is the one in use"
    );
    Fixture {
        dev,
        keep: Some(Box::new(dir)),
    }
}

fn sim_fixture() -> Fixture<SimDevice> {
    let seed = 0x5eed_0001;
    eprintln!("sim seed {seed:#x}");
    let config = SimConfig {
        capacity_blocks: 16 * 1024,
        queue_count: 8,
        latency: Latency {
            read: Duration::from_micros(20),
            write: Duration::from_micros(30),
            flush: Duration::from_micros(100),
            jitter_pct: 50,
        },
        ..SimConfig::default()
    };
    Fixture {
        dev: SimDevice::new(config, seed),
        keep: None,
    }
}

mod file_uring {
    use super::*;
    nvstore_driver::conformance_tests!(file_fixture(Engine::IoUring));
}

mod file_sync {
    use super::*;
    nvstore_driver::conformance_tests!(file_fixture(Engine::Sync));
}

mod sim {
    use super::*;
    nvstore_driver::conformance_tests!(sim_fixture());
}
