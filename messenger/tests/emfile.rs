//! Out of file descriptors, `accept` fails while the listener stays readable: a level-triggered
//! loop that just logs and returns would spin at 100 % CPU (the incident's failure in another
//! guise). The worker must set the listener aside and retry later, then accept normally once
//! descriptors are free again. (Its own test binary: it lowers the process's descriptor limit.)

mod common;

use std::fs::File;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use nvstore_messenger::{Config, Secret};

fn set_nofile(soft: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit fill or read the struct we pass; no other preconditions.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = soft.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
}

#[test]
fn accept_without_descriptors_does_not_spin() {
    let k = Secret::generate();
    let (server, addr) = start_server(
        Config {
            workers: 1,
            ..small_config()
        },
        &k,
        Arc::new(Echo { inline: true }),
    );
    // Use up every descriptor but one, under a limit of 256.
    set_nofile(256);
    let mut hog = Vec::new();
    while let Ok(f) = File::open("/dev/null") {
        hog.push(f);
    }
    drop(hog.pop());
    // The kernel completes the TCP handshake from the backlog; accept then has no descriptor.
    let _client = TcpStream::connect(addr).unwrap();
    wait_until("accept fails", Duration::from_secs(10), || {
        server.stats().workers[0].iterations > 0
    });
    // (No /proc reads here: they would need a descriptor too. Loop passes tell the story.)
    let w0 = server.stats().workers[0];
    std::thread::sleep(Duration::from_millis(500));
    let w1 = server.stats().workers[0];
    let passes = w1.iterations - w0.iterations;
    let spin_ms = (w1.busy_poll_ns - w0.busy_poll_ns) as f64 / 1e6;
    println!(
        "out of descriptors for 500 ms: {passes} loop passes, {} busy-poll spins ({spin_ms:.2} ms)",
        w1.busy_poll_spins - w0.busy_poll_spins
    );
    assert_eq!(w1.conns_accepted, 0);
    // One failed accept per 100 ms retry (each followed by one bounded busy-poll window).
    assert!(
        passes <= 20,
        "{passes} passes in 500 ms: the listener is spinning"
    );
    assert!(spin_ms < 5.0, "{spin_ms} ms of busy-polling in 500 ms");
    // Descriptors back: the listener is watched again and the connection accepted.
    drop(hog);
    wait_until("accepted after retry", Duration::from_secs(10), || {
        server.stats().workers[0].conns_accepted == 1
    });
}
