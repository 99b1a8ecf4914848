//! Malformed input closes only the offending connection, with a logged reason naming the peer;
//! a wrong secret is refused. A well-behaved connection keeps working throughout.

mod common;

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use nvstore_messenger::frame::{encode_frame, offset, FrameKind, Header, HEADER_SIZE};
use nvstore_messenger::{
    AuthFailure, Config, Connection, Error, Identity, Messenger, OutMessage, Secret,
};

const T: Duration = Duration::from_secs(10);

struct Fixture {
    secret: Secret,
    server: Messenger,
    addr: std::net::SocketAddr,
    _good_client: Messenger,
    good: Connection,
}

impl Fixture {
    fn new() -> Fixture {
        capture_logs();
        let secret = Secret::generate();
        let cfg = Config {
            payload_bytes_max: 1 << 20,
            ..small_config()
        };
        let (server, addr) = start_server(cfg, &secret, Arc::new(Echo { inline: true }));
        let good_client = client(small_config(), 1, &secret);
        let good = good_client.connect(addr, SERVER).unwrap();
        Fixture {
            secret,
            server,
            addr,
            _good_client: good_client,
            good,
        }
    }

    fn good_still_works(&self) {
        let r = self
            .good
            .request(OutMessage::new(ECHO, b"still here".to_vec()), T)
            .unwrap();
        assert_eq!(&*r.payload, b"still here");
    }

    /// Send `bytes` on a fresh socket (authenticated first when asked), optionally half-close,
    /// and check the server closed it, counted it, and logged `reason` with the peer address.
    fn expect_closed(&self, authenticate: bool, bytes: &[u8], half_close: bool, reason: &str) {
        let errors_before = self.protocol_errors();
        let mut s = if authenticate {
            raw_authenticated(self.addr, &self.secret, Identity::Client(99))
        } else {
            TcpStream::connect(self.addr).unwrap()
        };
        let local = s.local_addr().unwrap().to_string();
        s.write_all(bytes).unwrap();
        if half_close {
            s.shutdown(Shutdown::Write).unwrap();
        }
        assert!(
            closed_by_server(&mut s),
            "server kept the connection open ({reason})"
        );
        wait_until("protocol error counted", T, || {
            self.protocol_errors() == errors_before + 1
        });
        let lines = log_lines_with(&format!("peer={local}"), reason);
        assert_eq!(
            lines.len(),
            1,
            "one log line naming {local} and {reason:?}; got {lines:?}"
        );
        self.good_still_works();
    }

    fn protocol_errors(&self) -> u64 {
        self.server.stats().total(|w| w.protocol_errors)
    }
}

fn request(len: u32) -> Header {
    Header {
        kind: FrameKind::Request,
        flags: 0,
        txn: 1,
        payload_len: len,
        msg_type: ECHO,
    }
}

#[test]
fn bad_magic_before_handshake() {
    let f = Fixture::new();
    f.expect_closed(
        false,
        b"GET / HTTP/1.1\r\nHost: nvstore\r\n\r\n",
        false,
        "bad magic",
    );
}

#[test]
fn bad_magic_after_handshake() {
    let f = Fixture::new();
    let mut frame = encode_frame(&request(3), b"abc");
    frame[0] = b'X';
    f.expect_closed(true, &frame, false, "bad magic");
}

#[test]
fn bad_header_crc() {
    let f = Fixture::new();
    let mut frame = encode_frame(&request(3), b"abc");
    frame[offset::TXN] ^= 1;
    f.expect_closed(true, &frame, false, "bad header crc");
}

#[test]
fn bad_payload_crc() {
    let f = Fixture::new();
    let mut frame = encode_frame(&request(3), b"abc");
    frame[HEADER_SIZE + 1] ^= 0x20;
    f.expect_closed(true, &frame, false, "bad payload crc");
}

#[test]
fn bad_payload_crc_on_a_large_frame() {
    let f = Fixture::new();
    let body = vec![5u8; 300_000];
    let mut frame = encode_frame(&request(body.len() as u32), &body);
    let n = frame.len();
    frame[n - 1] ^= 0x80;
    f.expect_closed(true, &frame, false, "bad payload crc");
}

#[test]
fn oversized_length() {
    let f = Fixture::new();
    // A valid header (crc and all) announcing 2 MiB to a server that takes 1 MiB.
    f.expect_closed(true, &request(2 << 20).encode(), false, "oversized length");
}

#[test]
fn oversized_length_before_handshake() {
    let f = Fixture::new();
    let hello = Header {
        kind: FrameKind::Hello,
        flags: 0,
        txn: 0,
        payload_len: 4096,
        msg_type: 0,
    };
    f.expect_closed(false, &hello.encode(), false, "oversized length");
}

#[test]
fn truncated_frame() {
    let f = Fixture::new();
    let frame = encode_frame(&request(1000), &[1u8; 1000]);
    f.expect_closed(
        true,
        &frame[..500],
        true,
        "truncated frame: stream ended after 500 of 1036 bytes",
    );
}

#[test]
fn truncated_large_frame() {
    let f = Fixture::new();
    let frame = encode_frame(&request(200_000), &[1u8; 200_000]);
    f.expect_closed(
        true,
        &frame[..150_000],
        true,
        "truncated frame: stream ended after 150000 of 200036 bytes",
    );
}

#[test]
fn truncated_header() {
    let f = Fixture::new();
    let frame = encode_frame(&request(10), &[1u8; 10]);
    f.expect_closed(
        true,
        &frame[..20],
        true,
        "truncated frame: stream ended after 20 of 32 bytes",
    );
}

#[test]
fn request_before_handshake() {
    let f = Fixture::new();
    f.expect_closed(
        false,
        &encode_frame(&request(3), b"abc"),
        false,
        "frame kind 16 not allowed before authentication",
    );
}

#[test]
fn garbage_before_handshake() {
    let f = Fixture::new();
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    f.expect_closed(false, &garbage, false, "bad magic");
}

#[test]
fn handshake_frame_after_handshake() {
    let f = Fixture::new();
    let hello = Header {
        kind: FrameKind::Hello,
        flags: 0,
        txn: 0,
        payload_len: 0,
        msg_type: 0,
    };
    f.expect_closed(
        true,
        &encode_frame(&hello, &[]),
        false,
        "frame kind 1 not allowed after authentication",
    );
}

#[test]
fn wrong_secret_messenger_client_is_rejected_both_sides_count_it() {
    let f = Fixture::new();
    let before = f.server.stats().total(|w| w.auth_failures);
    let intruder = client(small_config(), 66, &Secret::generate());
    let r = intruder.connect(f.addr, SERVER);
    assert!(
        matches!(
            r,
            Err(Error::AuthFailed {
                reason: AuthFailure::BadProof,
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(intruder.stats().total(|w| w.auth_failures), 1);
    wait_until("server counts the failed handshake", T, || {
        f.server.stats().total(|w| w.auth_failures) == before + 1
    });
    f.good_still_works();
}

/// A client that ignores the server's proof and answers with a forged one (it has no key) is
/// refused by the server: the log names its address.
#[test]
fn forged_client_proof_is_rejected_by_the_server() {
    use nvstore_messenger::auth::{fresh_nonce, handshake_header, ClientHandshake, RESPONSE_SIZE};
    let f = Fixture::new();
    let before = f.server.stats().total(|w| w.auth_failures);
    let mut s = TcpStream::connect(f.addr).unwrap();
    let local = s.local_addr().unwrap().to_string();
    let (k, p) = ClientHandshake::new(Identity::Client(5), SERVER, fresh_nonce()).hello();
    s.write_all(&encode_frame(&handshake_header(k, p.len()), &p))
        .unwrap();
    let (h, _) = read_frame(&mut s);
    assert_eq!(h.kind, FrameKind::Challenge);
    s.write_all(&encode_frame(
        &handshake_header(FrameKind::Response, RESPONSE_SIZE),
        &[0x42; RESPONSE_SIZE],
    ))
    .unwrap();
    assert!(closed_by_server(&mut s));
    wait_until("auth failure counted", T, || {
        f.server.stats().total(|w| w.auth_failures) == before + 1
    });
    let lines = log_lines_with(&format!("peer={local}"), "HMAC proof does not verify");
    assert_eq!(lines.len(), 1, "{lines:?}");
    f.good_still_works();
}

#[test]
fn silent_peer_is_dropped_at_the_handshake_timeout() {
    capture_logs();
    let k = Secret::generate();
    let cfg = Config {
        handshake_timeout: Duration::from_millis(100),
        ..small_config()
    };
    let (server, addr) = start_server(cfg, &k, Arc::new(Echo { inline: true }));
    let mut s = TcpStream::connect(addr).unwrap();
    assert!(closed_by_server(&mut s));
    assert_eq!(server.stats().total(|w| w.auth_failures), 1);
}
