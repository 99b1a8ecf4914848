//! Backpressure: capped connections lose and reorder nothing, do not block their neighbours,
//! share a global cap round-robin, and wait for a wake rather than polling.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use nvstore_messenger::{
    Config, Dispatcher, Identity, Incoming, OutMessage, Secret, ThrottleLimits,
};

const T: Duration = Duration::from_secs(20);
const PARK: u16 = 7;

/// Records (peer, sequence number) in arrival order; parks PARK messages until told.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<(Identity, u32)>>,
    parked: Mutex<Vec<Incoming>>,
    slow_every: u32,
    /// Messages that said their connection had waited for throttle capacity.
    throttled: Mutex<u64>,
}

impl Dispatcher for Recorder {
    fn handle(&self, mut msg: Incoming) {
        if msg.is_request() {
            let p = msg.payload().clone();
            return msg.reply(OutMessage::new(ECHO, p)).unwrap();
        }
        let seq = u32::from_le_bytes(msg.payload()[..4].try_into().unwrap());
        let filler = &msg.payload()[4..];
        assert!(
            filler.iter().all(|&b| b == seq as u8),
            "payload of #{seq} corrupted"
        );
        self.seen.lock().unwrap().push((msg.peer(), seq));
        if msg.throttled().is_some() {
            *self.throttled.lock().unwrap() += 1;
        }
        if msg.msg_type() == PARK {
            self.parked.lock().unwrap().push(msg);
        } else if self.slow_every > 0 && seq % self.slow_every == 0 {
            // Hold the throttle a little so the caps stay hit.
            std::thread::sleep(Duration::from_micros(300));
        }
    }
}

fn numbered(msg_type: u16, seq: u32, filler: usize) -> OutMessage {
    OutMessage::new(msg_type, seq.to_le_bytes().to_vec()).with_part(vec![seq as u8; filler])
}

fn per_peer(seen: &[(Identity, u32)]) -> HashMap<Identity, Vec<u32>> {
    let mut m: HashMap<Identity, Vec<u32>> = HashMap::new();
    for &(who, seq) in seen {
        m.entry(who).or_default().push(seq);
    }
    m
}

#[test]
fn throttled_connections_lose_and_reorder_nothing() {
    let k = Secret::generate();
    let cfg = Config {
        handler_threads: 2,
        conn_throttle: ThrottleLimits {
            messages_max: 2,
            bytes_max: 64 << 10,
        },
        client_throttle: ThrottleLimits {
            messages_max: 5,
            bytes_max: 100 << 10,
        },
        ..small_config()
    };
    let d = Arc::new(Recorder {
        slow_every: 7,
        ..Default::default()
    });
    let (server, addr) = start_server(cfg, &k, d.clone());
    const N: u32 = 600;
    std::thread::scope(|s| {
        for id in 1..=3u32 {
            let k = k.clone();
            s.spawn(move || {
                let c = client(small_config(), id, &k);
                let conn = c.connect(addr, SERVER).unwrap();
                for seq in 0..N {
                    // Sizes from 0 to ~40 KiB: small frames share chunks, large ones get their own.
                    conn.send_oneway(numbered(1, seq, (seq as usize * 7919) % 40_000))
                        .unwrap();
                }
                // A request after the stream: when its reply is here, every message was read.
                conn.request(OutMessage::new(ECHO, vec![1]), T).unwrap();
            });
        }
    });
    wait_until("all messages handled", T, || {
        d.seen.lock().unwrap().len() == 3 * N as usize
    });
    let by_peer = per_peer(&d.seen.lock().unwrap());
    for id in 1..=3 {
        assert_eq!(
            by_peer[&Identity::Client(id)],
            (0..N).collect::<Vec<_>>(),
            "client.{id}: lost or reordered"
        );
    }
    // The last Incoming is dropped just after its handler replied.
    wait_until("all released", T, || {
        server.stats().client_throttle.messages_current == 0
    });
    let st = server.stats();
    let (conn, class) = (st.conn_throttles, st.client_throttle);
    println!("per-connection throttles: {conn:?}\nclient throttle: {class:?}");
    assert!(conn.paused > 0 && class.paused > 0, "both caps were hit");
    assert_eq!(
        conn.paused, conn.resumed,
        "every paused connection was woken"
    );
    assert_eq!(class.paused, class.resumed);
    // The first message read after each wait says so (op timelines show it as `throttled`).
    let marked = *d.throttled.lock().unwrap();
    assert!(
        marked > 0 && marked <= conn.resumed + class.resumed,
        "{marked} messages marked throttled"
    );
    assert_eq!(conn.messages_max, 2);
    assert_eq!(class.messages_max, 5);
    assert_eq!(
        (class.messages_current, class.bytes_current),
        (0, 0),
        "everything released"
    );
    assert_eq!(
        class.acquired,
        3 * N as u64 + 3,
        "the stream and the closing requests"
    );
}

/// One connection sits at its cap (its messages parked by the handler); another connection is
/// still served, and the paused one costs the worker nothing: it sleeps until the wake.
#[test]
fn a_connection_at_its_cap_does_not_block_others_and_waits_without_polling() {
    let k = Secret::generate();
    let cfg = Config {
        conn_throttle: ThrottleLimits {
            messages_max: 4,
            bytes_max: 1 << 20,
        },
        ..small_config()
    };
    let d = Arc::new(Recorder::default());
    let (server, addr) = start_server(cfg, &k, d.clone());
    let ca = client(small_config(), 1, &k);
    let a = ca.connect(addr, SERVER).unwrap();
    for seq in 0..10 {
        a.send_oneway(numbered(PARK, seq, 100)).unwrap();
    }
    wait_until("A at its cap", T, || {
        d.parked.lock().unwrap().len() == 4 && server.stats().conn_throttles.paused == 1
    });
    let cb = client(small_config(), 2, &k);
    let b = cb.connect(addr, SERVER).unwrap();
    for i in 0..20u8 {
        let r = b.request(OutMessage::new(ECHO, vec![i; 10]), T).unwrap();
        assert_eq!(&*r.payload, &[i; 10]);
    }
    let st = server.stats();
    assert_eq!(
        (st.conn_throttles.paused, st.conn_throttles.resumed),
        (1, 0),
        "A still paused while B was served"
    );
    // Paused, nothing else to do: once the busy-poll window after B's traffic has passed, the
    // worker must be asleep, not retrying.
    std::thread::sleep(Duration::from_millis(20));
    let w0 = server.stats().workers[0];
    std::thread::sleep(Duration::from_millis(300));
    let w1 = server.stats().workers[0];
    assert!(
        w1.iterations - w0.iterations <= 3,
        "paused connection polled: {w0:?} -> {w1:?}"
    );
    assert_eq!(w1.busy_poll_spins, w0.busy_poll_spins);
    // Release (the handler parks each arrival again, so keep releasing): A's other six
    // arrive, in order.
    wait_until("A drained", T, || {
        d.parked.lock().unwrap().clear();
        d.seen.lock().unwrap().len() == 10
    });
    let by_peer = per_peer(&d.seen.lock().unwrap());
    assert_eq!(by_peer[&Identity::Client(1)], (0..10).collect::<Vec<_>>());
    d.parked.lock().unwrap().clear();
}

/// With the class cap saturated, capacity goes to waiting connections first come first served:
/// a connection with ten times the traffic does not starve the others.
#[test]
fn global_cap_is_shared_round_robin() {
    let k = Secret::generate();
    let cfg = Config {
        client_throttle: ThrottleLimits {
            messages_max: 3,
            bytes_max: 1 << 20,
        },
        ..small_config()
    };
    let d = Arc::new(Recorder {
        slow_every: 1,
        ..Default::default()
    });
    let (_server, addr) = start_server(cfg, &k, d.clone());
    let clients: Vec<_> = (1..=4).map(|id| client(small_config(), id, &k)).collect();
    let conns: Vec<_> = clients
        .iter()
        .map(|c| c.connect(addr, SERVER).unwrap())
        .collect();
    for (i, conn) in conns.iter().enumerate() {
        let n = if i == 0 { 1000 } else { 100 };
        for seq in 0..n {
            conn.send_oneway(numbered(1, seq, 10)).unwrap();
        }
    }
    wait_until("all handled", T, || d.seen.lock().unwrap().len() == 1300);
    let seen = d.seen.lock().unwrap();
    let first: Vec<Identity> = seen[..300].iter().map(|&(w, _)| w).collect();
    let count = |id| first.iter().filter(|&&w| w == Identity::Client(id)).count();
    println!(
        "first 300 handled: {:?}",
        (1..=4).map(count).collect::<Vec<_>>()
    );
    for id in 2..=4 {
        assert!(
            count(id) >= 50,
            "client.{id} got {} of the first 300 (fair share 75)",
            count(id)
        );
    }
    let by_peer = per_peer(&seen);
    assert_eq!(by_peer[&Identity::Client(1)], (0..1000).collect::<Vec<_>>());
}
