//! The real receive path: arbitrary bytes written to a live messenger over TCP, before or after
//! a genuine handshake, optionally with every frame's crcs fixed up so the fuzzer reaches
//! payload handling (small and large frames, requests, replies, throttling). The server must
//! answer or close, never hang or die: after the writer half-closes, it must reach EOF.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use nvstore_messenger::auth::{fresh_nonce, handshake_header, ClientHandshake, HsStep};
use nvstore_messenger::checksum::crc32c;
use nvstore_messenger::frame::{encode_frame, parse_frame, Parsed, HEADER_SIZE};
use nvstore_messenger::{
    Config, Dispatcher, Identity, Incoming, Messenger, OutMessage, Secret, ThrottleLimits,
};

struct Echo;

impl Dispatcher for Echo {
    fn handle(&self, mut msg: Incoming) {
        if msg.is_request() {
            let p = msg.payload().clone();
            let _ = msg.reply(OutMessage::new(1, p));
        }
    }
    fn runs_inline(&self, _t: u16) -> bool {
        true
    }
}

struct Server {
    _m: Messenger,
    addr: SocketAddr,
    secret: Secret,
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let secret = Secret::from_bytes([9; 32]);
        let cfg = Config {
            workers: 1,
            handler_threads: 0,
            payload_bytes_max: 256 << 10,
            conn_throttle: ThrottleLimits {
                messages_max: 2,
                bytes_max: 64 << 10,
            },
            handshake_timeout: Duration::from_secs(2),
            ..Config::default()
        };
        let m = Messenger::new(cfg, Identity::Node(0), secret.clone(), Arc::new(Echo)).unwrap();
        let addr = m.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        Server {
            _m: m,
            addr,
            secret,
        }
    })
}

fn read_frame(s: &mut TcpStream) -> Option<(nvstore_messenger::frame::Header, Vec<u8>)> {
    let mut buf = Vec::new();
    loop {
        match parse_frame(&buf, 1 << 20).ok()? {
            Parsed::Frame(h) => {
                return Some((
                    h,
                    buf[HEADER_SIZE..HEADER_SIZE + h.payload_len as usize].to_vec(),
                ))
            }
            Parsed::NeedMore(n) => {
                let mut more = vec![0u8; n];
                s.read_exact(&mut more).ok()?;
                buf.extend_from_slice(&more);
            }
        }
    }
}

fn authenticate(s: &mut TcpStream, secret: &Secret) -> Option<()> {
    let mut hs = ClientHandshake::new(Identity::Client(1), Identity::Node(0), fresh_nonce());
    let (k, p) = hs.hello();
    s.write_all(&encode_frame(&handshake_header(k, p.len()), &p))
        .ok()?;
    loop {
        let (h, p) = read_frame(s)?;
        match hs.on_frame(secret, &h, &p).ok()? {
            HsStep::Send(k, p) => s
                .write_all(&encode_frame(&handshake_header(k, p.len()), &p))
                .ok()?,
            HsStep::Done { .. } => return Some(()),
        }
    }
}

/// Make every frame-shaped piece of `data` carry valid crcs (lengths clamped to what follows).
fn fix_crcs(data: &mut [u8]) {
    let mut o = 0;
    while data.len() - o >= HEADER_SIZE + 4 {
        let room = data.len() - o - HEADER_SIZE - 4;
        let asked = u32::from_le_bytes(data[o + 16..o + 20].try_into().unwrap()) as usize;
        let len = asked % (room + 1);
        data[o + 16..o + 20].copy_from_slice(&(len as u32).to_le_bytes());
        let hcrc = crc32c(&data[o..o + 28]);
        data[o + 28..o + 32].copy_from_slice(&hcrc.to_le_bytes());
        let p = o + HEADER_SIZE;
        let pcrc = crc32c(&data[p..p + len]);
        data[p + len..p + len + 4].copy_from_slice(&pcrc.to_le_bytes());
        o = p + len + 4;
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, stream)) = data.split_first() else {
        return;
    };
    let srv = server();
    let mut s = TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    if mode & 1 == 1 && authenticate(&mut s, &srv.secret).is_none() {
        panic!("genuine handshake failed");
    }
    let mut bytes = stream.to_vec();
    if mode & 2 == 2 {
        fix_crcs(&mut bytes);
    }
    // The server may close early (that is a valid answer to garbage): write errors are fine.
    let _ = s.write_all(&bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = [0u8; 65536];
    loop {
        match s.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("server neither answered nor closed: {e}"),
        }
    }
});
