//! An idle messenger with 100 idle connections costs (next to) nothing: its workers sleep in
//! epoll with no timeout and never wake. The budget is 0.1 % of a core over 10 s; this
//! test measures 3 s to keep CI short, on both ends, in nanoseconds (schedstat) and in clock
//! ticks (/proc/self/task/TID/stat).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use nvstore_messenger::sys::ticks_per_second;
use nvstore_messenger::{Config, OutMessage, Secret};

const WINDOW: Duration = Duration::from_secs(3);

#[test]
fn idle_messenger_with_100_idle_connections_uses_no_cpu() {
    let k = Secret::generate();
    let (server, addr) = start_server(Config::default(), &k, Arc::new(Echo { inline: false }));
    let c = client(Config::default(), 1, &k);
    let conns: Vec<_> = (0..100).map(|_| c.connect(addr, SERVER).unwrap()).collect();
    for conn in &conns {
        // Each connection used once, leaving dead request-timeout timers behind.
        conn.request(OutMessage::new(ECHO, vec![1; 10]), Duration::from_secs(10))
            .unwrap();
    }
    assert_eq!(server.stats().total(|w| w.conns_open), 100);
    // Idle connections hold no receive memory: the chunks went back to the pool and were
    // reused, a handful for all 100 connections.
    let pool = server.stats().pool;
    assert!(pool.fresh <= 8, "{pool:?}");
    // Let busy-poll windows and in-flight wakes end.
    std::thread::sleep(Duration::from_millis(100));

    let mut tids = server.worker_tids();
    tids.extend(c.worker_tids());
    let (ns0, ticks0, s0, c0, t0) = (
        cpu_ns(&tids),
        cpu_ticks(&tids),
        server.stats(),
        c.stats(),
        Instant::now(),
    );
    std::thread::sleep(WINDOW);
    let (ns1, ticks1, s1, c1, wall) = (
        cpu_ns(&tids),
        cpu_ticks(&tids),
        server.stats(),
        c.stats(),
        t0.elapsed(),
    );

    let wakes = |a: &nvstore_messenger::MessengerStats, b: &nvstore_messenger::MessengerStats| {
        b.total(|w| w.iterations + w.busy_poll_spins)
            - a.total(|w| w.iterations + w.busy_poll_spins)
    };
    let (server_wakes, client_wakes) = (wakes(&s0, &s1), wakes(&c0, &c1));
    let cpu = ns1 - ns0;
    let budget_ns = (wall.as_nanos() / 1000) as u64; // 0.1 % of one core
    println!(
        "idle {wall:?}, 100 connections, 4 workers: cpu {cpu} ns ({} ticks of {} per second), budget {budget_ns} ns; \
         passes: server {server_wakes}, client {client_wakes}",
        ticks1 - ticks0,
        ticks_per_second()
    );
    assert!(
        cpu <= budget_ns,
        "idle workers used {cpu} ns over {wall:?} (budget {budget_ns} ns)"
    );
    // Tick accounting is sampled: allow the one tick a stray wake could be charged.
    assert!(
        ticks1 - ticks0 <= 1,
        "{} clock ticks of CPU while idle",
        ticks1 - ticks0
    );
    assert!(
        server_wakes + client_wakes <= 2,
        "idle workers woke {server_wakes} + {client_wakes} times"
    );
    assert!(conns.iter().all(|c| c.is_open()));
}
