//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nvstore_messenger::auth::{fresh_nonce, handshake_header, ClientHandshake, HsStep};
use nvstore_messenger::frame::{encode_frame, parse_frame, Header, Parsed, HEADER_SIZE};
use nvstore_messenger::{Config, Dispatcher, Identity, Incoming, Messenger, OutMessage, Secret};

pub const ECHO: u16 = 1;
pub const SERVER: Identity = Identity::Node(0);

/// Replies to every request with its own payload.
pub struct Echo {
    pub inline: bool,
}

impl Dispatcher for Echo {
    fn handle(&self, mut msg: Incoming) {
        if msg.is_request() {
            let p = msg.payload().clone();
            msg.reply(OutMessage::new(ECHO, p)).unwrap();
        }
    }

    fn runs_inline(&self, _t: u16) -> bool {
        self.inline
    }
}

pub fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

pub fn small_config() -> Config {
    Config {
        workers: 1,
        handler_threads: 1,
        ..Config::default()
    }
}

pub fn start_server(
    config: Config,
    secret: &Secret,
    d: Arc<dyn Dispatcher>,
) -> (Messenger, SocketAddr) {
    let m = Messenger::new(config, SERVER, secret.clone(), d).unwrap();
    let addr = m.listen(localhost()).unwrap();
    (m, addr)
}

pub fn client(config: Config, id: u32, secret: &Secret) -> Messenger {
    Messenger::new(
        config,
        Identity::Client(id),
        secret.clone(),
        Arc::new(Echo { inline: true }),
    )
    .unwrap()
}

/// Poll `cond` until it holds; panics with `what` after `limit` (a liveness guard, not a
/// performance threshold).
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < limit,
            "gave up waiting for {what} after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ---- log capture ------------------------------------------------------------------------------

static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

#[derive(Clone)]
struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        std::io::stderr().write_all(b)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Capture warnings (and worse) of this test binary.
pub fn capture_logs() {
    let buf = LOGS
        .get_or_init(|| Arc::new(Mutex::new(Vec::new())))
        .clone();
    let w = LogWriter(buf);
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || w.clone())
        .try_init();
}

/// The captured log lines that mention `needle_a` and `needle_b`.
pub fn log_lines_with(needle_a: &str, needle_b: &str) -> Vec<String> {
    let buf = LOGS.get().expect("capture_logs first").lock().unwrap();
    String::from_utf8_lossy(&buf)
        .lines()
        .filter(|l| l.contains(needle_a) && l.contains(needle_b))
        .map(str::to_owned)
        .collect()
}

// ---- a raw client speaking the protocol by hand -------------------------------------------------

pub fn read_frame(s: &mut TcpStream) -> (Header, Vec<u8>) {
    let mut buf = Vec::new();
    loop {
        match parse_frame(&buf, 1 << 20).expect("server sent a valid frame") {
            Parsed::Frame(h) => {
                return (
                    h,
                    buf[HEADER_SIZE..HEADER_SIZE + h.payload_len as usize].to_vec(),
                )
            }
            Parsed::NeedMore(n) => {
                let mut more = vec![0u8; n];
                s.read_exact(&mut more).expect("read frame");
                buf.extend_from_slice(&more);
            }
        }
    }
}

/// Connect a plain socket and authenticate as `me`.
pub fn raw_authenticated(addr: SocketAddr, secret: &Secret, me: Identity) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hs = ClientHandshake::new(me, SERVER, fresh_nonce());
    let (k, p) = hs.hello();
    s.write_all(&encode_frame(&handshake_header(k, p.len()), &p))
        .unwrap();
    loop {
        let (h, p) = read_frame(&mut s);
        match hs.on_frame(secret, &h, &p).expect("handshake") {
            HsStep::Send(k, p) => s
                .write_all(&encode_frame(&handshake_header(k, p.len()), &p))
                .unwrap(),
            HsStep::Done { .. } => return s,
        }
    }
}

/// True when the server closed `s` (EOF or reset) within the read timeout.
pub fn closed_by_server(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

// ---- CPU readings -------------------------------------------------------------------------------

pub fn cpu_ns(tids: &[i32]) -> u64 {
    tids.iter()
        .map(|&t| nvstore_messenger::sys::thread_cpu_ns(t).unwrap())
        .sum()
}

pub fn cpu_ticks(tids: &[i32]) -> u64 {
    tids.iter()
        .map(|&t| nvstore_messenger::sys::thread_cpu_ticks(t).unwrap())
        .sum()
}
