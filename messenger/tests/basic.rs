//! Request/reply, one-way, large payloads, timeouts, abandoned requests, connection loss and
//! reconnect.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use nvstore_messenger::{
    Config, Dispatcher, Error, Identity, Incoming, Messenger, OutMessage, Payload, RawBytes,
    Responder, Secret, SendBuf,
};

const T: Duration = Duration::from_secs(10);

#[test]
fn request_reply_round_trips_bytes_and_binds_identities() {
    let k = Secret::generate();
    for inline in [true, false] {
        let (server, addr) = start_server(small_config(), &k, Arc::new(Echo { inline }));
        let c = client(small_config(), 7, &k);
        let conn = c.connect(addr, SERVER).unwrap();
        assert_eq!(conn.peer(), SERVER);
        for i in 0..200u32 {
            let body: Vec<u8> = (0..i * 13).map(|b| (b ^ i) as u8).collect();
            let r = c
                .send_request(&conn, OutMessage::new(ECHO, body.clone()), T)
                .unwrap();
            assert_eq!(&*r.payload, &body[..]);
            assert_eq!(r.msg_type, ECHO);
        }
        let s = server.stats();
        assert_eq!(
            s.total(|w| w.frames_in),
            200 + 2,
            "two handshake frames, then the requests"
        );
        assert_eq!(
            s.total(|w| w.protocol_errors) + s.total(|w| w.auth_failures),
            0
        );
        // Small messages never fill a pass's write budget: no worker gave up its CPU.
        assert_eq!(s.total(|w| w.bulk_yields), 0);
        assert_eq!(c.stats().total(|w| w.bulk_yields), 0);
    }
}

/// Multi-part payloads of several MiB go out from the caller's buffers and come back intact
/// through the large-frame path; small and large frames interleave on one connection.
/// A region handed to the messenger by address (as a node sends a DMA buffer).
struct RawRegion(Arc<[u8]>);

// SAFETY: the Arc keeps the bytes alive and nothing writes them.
unsafe impl RawBytes for RawRegion {
    fn raw(&self) -> (*const u8, usize) {
        (self.0.as_ptr(), self.0.len())
    }
    fn crc32c_append(&self, crc: u32) -> u32 {
        nvstore_messenger::checksum::crc32c_append(crc, &self.0)
    }
}

#[test]
fn large_and_small_frames_interleave_intact() {
    let k = Secret::generate();
    let (_server, addr) = start_server(
        Config {
            workers: 2,
            ..small_config()
        },
        &k,
        Arc::new(Echo { inline: false }),
    );
    let c = client(small_config(), 1, &k);
    let conn = c.connect(addr, SERVER).unwrap();
    let big: Arc<[u8]> = (0..(4usize << 20) + 12345)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect::<Vec<_>>()
        .into();
    // Sent by address only, with its own crc (a DMA buffer's way).
    let raw: Arc<[u8]> = (0..300_001usize)
        .map(|i| (i * 13) as u8)
        .collect::<Vec<_>>()
        .into();
    let (tx, rx) = crossbeam::channel::unbounded();
    for i in 0..12usize {
        let msg = match i % 3 {
            0 => OutMessage::new(ECHO, big.clone()),
            1 => OutMessage::new(ECHO, vec![i as u8; 100])
                .with_part(big.clone())
                .with_part(SendBuf::Raw(Box::new(RawRegion(raw.clone()))))
                .with_part(&b"tail"[..]),
            _ => OutMessage::new(ECHO, vec![i as u8; 17_000]),
        };
        let tx = tx.clone();
        conn.request_with(msg, T, move |r| tx.send((i, r)).unwrap());
    }
    for _ in 0..12 {
        let (i, r) = rx.recv().unwrap();
        let p = r.unwrap().payload;
        match i % 3 {
            0 => assert!(*p == *big),
            1 => {
                assert_eq!(p.len(), 100 + big.len() + raw.len() + 4);
                assert!(p[..100].iter().all(|&b| b == i as u8));
                assert!(p[100..100 + big.len()] == *big);
                assert!(p[100 + big.len()..p.len() - 4] == *raw);
                assert_eq!(&p[p.len() - 4..], b"tail");
            }
            _ => assert!(p.len() == 17_000 && p.iter().all(|&b| b == i as u8)),
        }
    }
}

/// One server worker streaming large replies on many connections at once: each pass stops
/// at its write budget and resumes the connections it did not reach, and every byte of every
/// reply still arrives, in order, with the small replies in between.
#[test]
fn one_worker_streams_large_replies_to_many_connections_intact() {
    let k = Secret::generate();
    let (server, addr) = start_server(small_config(), &k, Arc::new(Echo { inline: false }));
    let c = client(
        Config {
            workers: 2,
            ..small_config()
        },
        1,
        &k,
    );
    let big: Arc<[u8]> = (0..(3usize << 20) + 777)
        .map(|i| (i * 13 + i / 65536) as u8)
        .collect::<Vec<_>>()
        .into();
    let conns: Vec<_> = (0..12).map(|_| c.connect(addr, SERVER).unwrap()).collect();
    let (tx, rx) = crossbeam::channel::unbounded();
    let mut sent = 0;
    for round in 0..3usize {
        for (n, conn) in conns.iter().enumerate() {
            let (t1, t2) = (tx.clone(), tx.clone());
            conn.request_with(OutMessage::new(ECHO, big.clone()), T, move |r| {
                t1.send((n, round, true, r)).unwrap()
            });
            conn.request_with(OutMessage::new(ECHO, vec![n as u8; 64]), T, move |r| {
                t2.send((n, round, false, r)).unwrap()
            });
            sent += 2;
        }
    }
    for _ in 0..sent {
        let (n, round, large, r) = rx.recv().unwrap();
        let p = r
            .unwrap_or_else(|e| panic!("conn {n} round {round}: {e}"))
            .payload;
        if large {
            assert!(*p == *big, "conn {n} round {round}: large reply damaged");
        } else {
            assert!(p.len() == 64 && p.iter().all(|&b| b == n as u8));
        }
    }
    // Streaming 3 MiB replies, the server's worker wrote whole pass budgets and yielded its
    // CPU between them (what lets a small op's threads run on a busy machine).
    let yields = server.stats().total(|w| w.bulk_yields);
    assert!(yields >= 1, "server worker yielded {yields} times");
}

struct Collect {
    got: Mutex<Vec<(Identity, Vec<u8>)>>,
    parked: Mutex<Vec<Responder>>,
}

impl Dispatcher for Collect {
    fn handle(&self, mut msg: Incoming) {
        match msg.msg_type() {
            // Never answered: parks the responder.
            2 => self
                .parked
                .lock()
                .unwrap()
                .push(msg.take_responder().unwrap()),
            // Dropped without answer: the requester hears "abandoned" at once.
            3 => drop(msg),
            _ => self
                .got
                .lock()
                .unwrap()
                .push((msg.peer(), msg.payload().to_vec())),
        }
    }
}

#[test]
fn oneway_timeout_and_abandoned_requests() {
    let k = Secret::generate();
    let d = Arc::new(Collect {
        got: Mutex::new(Vec::new()),
        parked: Mutex::new(Vec::new()),
    });
    let (_server, addr) = start_server(small_config(), &k, d.clone());
    let c = client(small_config(), 3, &k);
    let conn = c.connect(addr, SERVER).unwrap();
    for i in 0..50u8 {
        c.send_oneway(&conn, OutMessage::new(9, vec![i; i as usize]))
            .unwrap();
    }
    wait_until("one-way messages", T, || d.got.lock().unwrap().len() == 50);
    for (i, (who, body)) in d.got.lock().unwrap().iter().enumerate() {
        assert_eq!(*who, Identity::Client(3));
        assert_eq!(body, &vec![i as u8; i]);
    }
    let r = c.send_request(&conn, OutMessage::empty(2), Duration::from_millis(30));
    assert!(
        matches!(r, Err(Error::Timeout { what: "reply", .. })),
        "{r:?}"
    );
    let r = c.send_request(&conn, OutMessage::empty(3), T);
    assert!(
        matches!(
            r,
            Err(Error::RequestAbandoned {
                identity: Identity::Node(0),
                ..
            })
        ),
        "{r:?}"
    );
    // The parked request's late reply is counted and dropped.
    d.parked
        .lock()
        .unwrap()
        .pop()
        .unwrap()
        .reply(OutMessage::empty(2))
        .unwrap();
    wait_until("late reply", T, || c.stats().total(|w| w.late_replies) == 1);
}

#[test]
fn oversized_send_is_refused_locally() {
    let k = Secret::generate();
    let (_server, addr) = start_server(small_config(), &k, Arc::new(Echo { inline: true }));
    let c = client(
        Config {
            payload_bytes_max: 1000,
            ..small_config()
        },
        1,
        &k,
    );
    let conn = c.connect(addr, SERVER).unwrap();
    let r = c.send_oneway(&conn, OutMessage::new(1, vec![0; 1001]));
    assert!(matches!(
        r,
        Err(Error::PayloadTooLarge {
            len: 1001,
            max: 1000
        })
    ));
}

struct Hold {
    parked: Mutex<Vec<Incoming>>,
    disconnects: AtomicU64,
}

impl Dispatcher for Hold {
    fn handle(&self, msg: Incoming) {
        self.parked.lock().unwrap().push(msg);
    }
    fn disconnected(&self, _c: &nvstore_messenger::Connection, _r: &Error) {
        self.disconnects.fetch_add(1, Ordering::Relaxed);
    }
}

/// A dropped connection fails its pending requests with a clear error, and the client
/// reconnects (with backoff) to a server that comes back on the same address.
#[test]
fn connection_loss_fails_pending_and_client_reconnects() {
    let k = Secret::generate();
    let hold = Arc::new(Hold {
        parked: Mutex::new(Vec::new()),
        disconnects: AtomicU64::new(0),
    });
    let (server, addr) = start_server(small_config(), &k, hold.clone());
    let c = client(small_config(), 5, &k);
    let conn = c.connect(addr, SERVER).unwrap();
    let (tx, rx) = crossbeam::channel::unbounded();
    for _ in 0..3 {
        let tx = tx.clone();
        conn.request_with(OutMessage::empty(1), T, move |r| tx.send(r).unwrap());
    }
    wait_until("requests parked", T, || {
        hold.parked.lock().unwrap().len() == 3
    });
    hold.parked.lock().unwrap().clear();
    drop(server);
    for _ in 0..3 {
        match rx.recv().unwrap() {
            // The server's shutdown may abandon them first, or the connection drops first.
            Err(Error::ConnectionLost { peer, reason }) => {
                assert_eq!(peer, addr);
                assert!(!reason.is_empty());
            }
            Err(Error::RequestAbandoned { .. }) => {}
            other => panic!("expected a connection error, got {other:?}"),
        }
    }
    wait_until("client notices", T, || !conn.is_open());
    assert!(matches!(
        conn.send_oneway(OutMessage::empty(1)),
        Err(Error::NotConnected { .. })
    ));
    // Same address, new server.
    let server2 = Messenger::new(
        small_config(),
        SERVER,
        k.clone(),
        Arc::new(Echo { inline: true }),
    )
    .unwrap();
    let mut bound = None;
    for _ in 0..100 {
        if let Ok(a) = server2.listen(addr) {
            bound = Some(a);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(bound, Some(addr));
    wait_until("reconnected", T, || conn.is_open());
    let r = conn
        .request(OutMessage::new(ECHO, b"again".to_vec()), T)
        .unwrap();
    assert_eq!(&*r.payload, b"again");
    assert!(c.stats().total(|w| w.reconnects) >= 1);
}

#[test]
fn connect_to_nothing_fails_and_wrong_node_is_refused() {
    let k = Secret::generate();
    let c = client(
        Config {
            connect_timeout: Duration::from_secs(2),
            ..small_config()
        },
        1,
        &k,
    );
    let nobody = {
        let l = std::net::TcpListener::bind(localhost()).unwrap();
        l.local_addr().unwrap()
    };
    assert!(matches!(c.connect(nobody, SERVER), Err(Error::Io { .. })));
    let (_server, addr) = start_server(small_config(), &k, Arc::new(Echo { inline: true }));
    let r = c.connect(addr, Identity::Node(9));
    assert!(matches!(r, Err(Error::AuthFailed { .. })), "{r:?}");
}

#[test]
fn payload_views_outlive_the_message_and_go_back_to_the_pool() {
    let k = Secret::generate();
    let kept: Arc<Mutex<Vec<Payload>>> = Arc::default();
    struct Keep(Arc<Mutex<Vec<Payload>>>);
    impl Dispatcher for Keep {
        fn handle(&self, msg: Incoming) {
            self.0.lock().unwrap().push(msg.payload().clone());
        }
    }
    let (server, addr) = start_server(small_config(), &k, Arc::new(Keep(kept.clone())));
    let c = client(small_config(), 1, &k);
    let conn = c.connect(addr, SERVER).unwrap();
    for i in 0..4000u32 {
        conn.send_oneway(OutMessage::new(
            1,
            [&i.to_le_bytes()[..], &[7u8; 96]].concat(),
        ))
        .unwrap();
    }
    wait_until("all kept", T, || kept.lock().unwrap().len() == 4000);
    for (i, p) in kept.lock().unwrap().iter().enumerate() {
        assert_eq!(&p[..4], &(i as u32).to_le_bytes());
        assert_eq!(p.len(), 100);
    }
    // 4000 frames of 140 bytes filled several 64 KiB chunks; all still referenced.
    let before = server.stats().pool;
    assert!(before.fresh >= 8, "{before:?}");
    kept.lock().unwrap().clear();
    let after = server.stats().pool;
    assert!(
        after.returned >= before.returned + 7,
        "chunks go back to the pool: {before:?} -> {after:?}"
    );
}

#[test]
fn many_connections_many_threads() {
    let k = Secret::generate();
    let (server, addr) = start_server(
        Config {
            workers: 2,
            handler_threads: 2,
            ..Config::default()
        },
        &k,
        Arc::new(Echo { inline: false }),
    );
    let c = Arc::new(client(
        Config {
            workers: 2,
            ..small_config()
        },
        1,
        &k,
    ));
    let conns: Vec<_> = (0..16).map(|_| c.connect(addr, SERVER).unwrap()).collect();
    std::thread::scope(|s| {
        for (t, conn) in conns.iter().enumerate() {
            s.spawn(move || {
                for i in 0..100u32 {
                    let body = format!("{t}:{i}").into_bytes();
                    let r = conn
                        .request(OutMessage::new(ECHO, body.clone()), T)
                        .unwrap();
                    assert_eq!(&*r.payload, &body[..]);
                }
            });
        }
    });
    let st = server.stats();
    assert_eq!(st.total(|w| w.conns_accepted), 16);
    assert!(
        st.workers.iter().all(|w| w.conns_open == 8),
        "accepted connections spread over workers: {:?}",
        st.workers
    );
}

#[test]
fn after_shutdown_requests_fail_instead_of_hanging() {
    let k = Secret::generate();
    let (_server, addr) = start_server(small_config(), &k, Arc::new(Echo { inline: true }));
    let c = client(small_config(), 1, &k);
    let conn = c.connect(addr, SERVER).unwrap();
    c.shutdown();
    assert!(!conn.is_open());
    let r = conn.request(OutMessage::empty(ECHO), T);
    assert!(
        matches!(r, Err(Error::NotConnected { .. } | Error::Shutdown)),
        "{r:?}"
    );
    let (tx, rx) = crossbeam::channel::bounded(1);
    conn.request_with(OutMessage::empty(ECHO), T, move |r| {
        tx.send(r.is_err()).unwrap()
    });
    assert!(rx.recv().unwrap(), "callback ran with an error");
    assert!(matches!(c.connect(addr, SERVER), Err(Error::Shutdown)));
    assert!(matches!(c.listen(localhost()), Err(Error::Shutdown)));
}

/// A timer due inside the sleep floor fires on the next wake, late but not lost; a chain of
/// such timers fires at most once per floor, however close it asks to be.
#[test]
fn timers_inside_the_floor_fire_late_never_faster_than_the_floor() {
    let k = Secret::generate();
    let floor = Duration::from_millis(2);
    let m = Messenger::new(
        Config {
            sleep_floor: floor,
            busy_poll: Duration::ZERO,
            ..small_config()
        },
        SERVER,
        k,
        Arc::new(Echo { inline: true }),
    )
    .unwrap();
    let once = Arc::new(AtomicU64::new(0));
    let o = once.clone();
    let armed = std::time::Instant::now();
    m.schedule_timer(0, Duration::from_micros(10), move || {
        o.store(armed.elapsed().as_nanos() as u64, Ordering::Relaxed);
        None
    });
    wait_until("one-shot timer", T, || once.load(Ordering::Relaxed) > 0);
    assert!(
        once.load(Ordering::Relaxed) >= 10_000,
        "fired before it was due"
    );

    let fires = Arc::new(AtomicU64::new(0));
    let f = fires.clone();
    let t0 = std::time::Instant::now();
    m.schedule_timer(0, Duration::from_nanos(1), move || {
        f.fetch_add(1, Ordering::Relaxed);
        Some(Duration::from_nanos(1))
    });
    std::thread::sleep(Duration::from_millis(200));
    let (n, elapsed) = (fires.load(Ordering::Relaxed), t0.elapsed());
    let bound = (elapsed.as_nanos() / floor.as_nanos()) as u64 + 2;
    assert!(
        n >= 1 && n <= bound,
        "{n} firings in {elapsed:?}, at most {bound} allowed by the floor"
    );
    let w = m.stats().workers[0];
    assert_eq!(w.empty_iterations, 0, "{w:?}");
}
