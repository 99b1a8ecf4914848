//! A worker thread (`msgr-worker-N`): one epoll set, its connections, its timer heap.
//!
//! # The loop
//! Each pass: wait on epoll, handle socket events, drain the mailbox, fire due timers, flush the
//! connections that have output. The wait's timeout is chosen by [`Worker::wait_timeout`]:
//! * zero while work is known to be ready (commands queued, timers already due);
//! * zero for a bounded busy-poll window after socket or mailbox activity (a reply usually
//!   follows a request within microseconds; polling avoids a sleep/wake pair);
//! * otherwise sleep until the next timer, **floored** ([`crate::sys::sleep_timeout`]), or until
//!   an event when there is no timer. Never zero while nothing is ready.
//!
//! Timers firing do not start the busy-poll window: a timer chain re-arming itself sub-µs ahead
//! (the incident) costs one floored sleep and one wake per firing, never a spin.
//!
//! # Backpressure
//! A frame's header is decoded before its payload is read; requests and one-way messages then
//! take capacity from the connection's throttle and its peer class's throttle. When either is
//! full the connection stops reading (read interest dropped) and waits for a grant command; the
//! bytes already buffered stay where they are, so nothing is lost or reordered.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam::channel::Sender;
use rand::Rng;
use tracing::{debug, info, warn};

use crate::auth::{
    fresh_nonce, ClientHandshake, HsStep, Identity, Rejection, Secret, ServerHandshake,
};
use crate::conn::{
    Cmd, ConnShared, Connection, Level, Mailbox, STATE_CLOSED, STATE_CONNECTING, STATE_OPEN,
    STATE_RECONNECTING,
};
use crate::error::{AuthFailure, Error, Violation};
use crate::frame::{
    check_payload, check_payload_crc, FrameKind, Header, FLAG_REPLY_ABANDONED, HEADER_SIZE,
    TRAILER_SIZE,
};
use crate::message::{Dispatcher, Incoming, OutFrame, Reply, ReplyFn, Responder, Ticket};
use crate::messenger::Config;
use crate::pool::{BufPool, Payload, RecvBuf, CHUNK_BYTES, LARGE_PAYLOAD_MIN};
use crate::stats::WorkerCounters;
use crate::sys::{gettid, sleep_timeout, Epoll};
use crate::throttle::{Hold, Throttle, ThrottleCounters};
use crate::timer::{TimerAction, Timers};

const TOKEN_EVENTFD: u64 = u64::MAX;
/// Listener `i` has token `TOKEN_LISTENER_BASE + i`; connection tokens stay below 2^63.
const TOKEN_LISTENER_BASE: u64 = 1 << 63;
const SOCK_GEN_MASK: u32 = 0x7fff_ffff;
/// Handshake frames are tiny; a pre-authentication peer cannot make us buffer more than this.
const HANDSHAKE_PAYLOAD_MAX: u32 = 128;
/// Bounds per pass, so one source of work cannot starve the others.
const COMMANDS_PER_PASS: usize = 4096;
const TIMERS_PER_PASS: usize = 1024;
const ACCEPTS_PER_PASS: usize = 64;
/// Segments per vectored write.
const IOV_MAX: usize = 64;
/// Read at least this much at once; a smaller tail of a chunk is abandoned for a fresh chunk.
const READ_MIN_BYTES: usize = 4096;
const _: () = assert!(READ_MIN_BYTES < CHUNK_BYTES);

/// What every worker of a messenger shares.
pub(crate) struct Shared {
    pub config: Config,
    pub identity: Identity,
    pub secret: Secret,
    pub dispatcher: Arc<dyn Dispatcher>,
    pub mailboxes: Vec<Arc<Mailbox>>,
    pub counters: Vec<Arc<WorkerCounters>>,
    pub next_worker: AtomicUsize,
    pub next_conn_id: AtomicU64,
    pub client_throttle: Arc<Throttle>,
    pub node_throttle: Arc<Throttle>,
    pub conn_counters: Arc<ThrottleCounters>,
    pub pool: BufPool,
}

impl Shared {
    pub fn pick_worker(&self) -> usize {
        self.next_worker.fetch_add(1, Relaxed) % self.mailboxes.len()
    }
}

/// Why a connection is being closed. Logged with the peer address.
enum Close {
    Violation(Violation),
    Auth(AuthFailure),
    PeerClosed,
    Io(io::Error),
    ConnectTimeout,
    User,
    Shutdown,
}

impl From<Violation> for Close {
    fn from(v: Violation) -> Close {
        Close::Violation(v)
    }
}

impl Close {
    fn describe(&self) -> String {
        match self {
            Close::Violation(v) => format!("protocol violation: {v}"),
            Close::Auth(a) => format!("authentication failed: {a}"),
            Close::PeerClosed => "closed by peer".into(),
            Close::Io(e) => format!("socket error: {e}"),
            Close::ConnectTimeout => "connect timed out".into(),
            Close::User => "closed locally".into(),
            Close::Shutdown => "messenger shut down".into(),
        }
    }

    /// The error a waiting `connect` gets.
    fn to_connect_error(&self, peer: SocketAddr, timeout: Duration) -> Error {
        match self {
            Close::Violation(v) => Error::Protocol {
                peer,
                violation: v.clone(),
            },
            Close::Auth(a) => Error::AuthFailed {
                peer,
                reason: a.clone(),
            },
            Close::Io(e) => Error::io("connect", io::Error::new(e.kind(), e.to_string())),
            Close::ConnectTimeout => Error::Timeout {
                peer,
                what: "connect",
                after: timeout,
            },
            Close::Shutdown => Error::Shutdown,
            Close::PeerClosed | Close::User => Error::ConnectionLost {
                peer,
                reason: self.describe(),
            },
        }
    }

    /// The error pending requests fail with.
    fn to_request_error(&self, peer: SocketAddr) -> Error {
        match self {
            Close::Shutdown => Error::Shutdown,
            _ => Error::ConnectionLost {
                peer,
                reason: self.describe(),
            },
        }
    }
}

enum Phase {
    /// Non-blocking connect in progress (client side).
    Connecting,
    Handshake(Handshake),
    Open,
    /// Waiting for the reconnect timer (client side).
    Backoff,
}

enum Handshake {
    Client(ClientHandshake),
    Server(ServerHandshake),
}

enum Role {
    Server,
    Client {
        addr: SocketAddr,
        expected: Identity,
        backoff: Duration,
        /// The `connect` call waiting for the first handshake; `None` once established.
        waiter: Option<Sender<Result<Connection, Error>>>,
    },
}

struct Pending {
    on_reply: ReplyFn,
    timeout: Duration,
}

/// A large frame received into a buffer of its own.
struct LargeRx {
    header: Header,
    buf: RecvBuf,
    trailer: [u8; TRAILER_SIZE],
    trailer_have: usize,
    /// crc32c of the payload bytes received so far, computed while they are hot in cache.
    crc: u32,
}

impl LargeRx {
    fn payload_missing(&self) -> usize {
        self.header.payload_len as usize - self.buf.filled()
    }

    fn complete(&self) -> bool {
        self.payload_missing() == 0 && self.trailer_have == TRAILER_SIZE
    }
}

struct Rx {
    chunk: RecvBuf,
    /// First unparsed byte of `chunk`.
    start: usize,
    large: Option<LargeRx>,
}

impl Rx {
    fn buffered(&self) -> usize {
        self.chunk.filled() - self.start
    }

    fn discard(&mut self) {
        self.large = None;
        self.start = self.chunk.filled();
    }
}

#[derive(Default)]
struct Tx {
    queue: VecDeque<OutFrame>,
    /// Bytes of the queue's first frame already written.
    head_done: usize,
    /// The last write hit EAGAIN: wait for EPOLLOUT.
    blocked: bool,
}

struct Conn {
    shared: Arc<ConnShared>,
    sock: Option<TcpStream>,
    sock_gen: u32,
    phase: Phase,
    role: Role,
    rx: Rx,
    tx: Tx,
    pending: HashMap<u64, Pending>,
    conn_throttle: Arc<Throttle>,
    global_throttle: Option<Arc<Throttle>>,
    conn_hold: Option<Hold>,
    global_hold: Option<Hold>,
    paused: bool,
    /// Events registered with epoll (0: not registered).
    interest: u32,
    lane: usize,
    dirty: bool,
}

impl Conn {
    fn token(&self) -> u64 {
        self.shared.slot as u64 | (self.sock_gen as u64) << 32
    }

    fn throttle_key(&self) -> u64 {
        self.shared.slot as u64 | (self.shared.gen as u64) << 32
    }

    fn handle(&self) -> Connection {
        Connection {
            shared: self.shared.clone(),
        }
    }

    fn desired_interest(&self) -> u32 {
        let (rd, wr) = (libc::EPOLLIN as u32, libc::EPOLLOUT as u32);
        match self.phase {
            Phase::Connecting => wr,
            Phase::Backoff => 0,
            Phase::Handshake(_) | Phase::Open => {
                (if self.paused { 0 } else { rd }) | (if self.tx.blocked { wr } else { 0 })
            }
        }
    }
}

/// Why a pass waits the way it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WaitKind {
    /// Work is known to be ready: poll without blocking.
    Ready,
    /// Inside the busy-poll window after activity: poll without blocking.
    BusyPoll,
    /// Block until an event or the (floored) next timer.
    Sleep,
}

/// Flow of parsing buffered bytes.
enum Flow {
    NeedBytes,
    Paused,
}

struct Ctx {
    idx: usize,
    shared: Arc<Shared>,
    mailbox: Arc<Mailbox>,
    counters: Arc<WorkerCounters>,
    lanes: Vec<Sender<Incoming>>,
    epoll: Epoll,
}

pub(crate) struct Worker {
    ctx: Ctx,
    conns: Vec<Option<Conn>>,
    gens: Vec<u32>,
    free: Vec<u32>,
    listeners: Vec<TcpListener>,
    timers: Timers,
    dirty: Vec<u32>,
    events: Vec<libc::epoll_event>,
    stopping: bool,
    /// End of the current busy-poll window.
    busy_until: Instant,
}

impl Worker {
    pub fn new(
        idx: usize,
        shared: Arc<Shared>,
        lanes: Vec<Sender<Incoming>>,
    ) -> io::Result<Worker> {
        let epoll = Epoll::new()?;
        let mailbox = shared.mailboxes[idx].clone();
        epoll.add(mailbox.eventfd.raw(), libc::EPOLLIN as u32, TOKEN_EVENTFD)?;
        let events = vec![libc::epoll_event { events: 0, u64: 0 }; shared.config.events_per_wait];
        let counters = shared.counters[idx].clone();
        Ok(Worker {
            ctx: Ctx {
                idx,
                shared,
                mailbox,
                counters,
                lanes,
                epoll,
            },
            conns: Vec::new(),
            gens: Vec::new(),
            free: Vec::new(),
            listeners: Vec::new(),
            timers: Timers::default(),
            dirty: Vec::new(),
            events,
            stopping: false,
            busy_until: Instant::now(),
        })
    }

    /// The thread body: report the thread id, signal `ready`, loop until shut down.
    pub fn run_with_ready(mut self, ready: Sender<()>) {
        self.ctx.counters.tid.store(gettid(), Relaxed);
        crate::conn::mark_worker_thread();
        let _ = ready.send(());
        drop(ready);
        while !self.stopping {
            let pass_start = Instant::now();
            let (mut timeout, mut kind) = self.wait_timeout(pass_start);
            if kind == WaitKind::Sleep && !self.ctx.mailbox.about_to_sleep() {
                (timeout, kind) = (Some(Duration::ZERO), WaitKind::Ready);
            }
            let n = match self.ctx.epoll.wait(&mut self.events, timeout) {
                Ok(n) => n,
                Err(e) => panic!("msgr-worker-{}: epoll_wait failed: {e}", self.ctx.idx),
            };
            if kind == WaitKind::Sleep {
                self.ctx.mailbox.awake();
                self.ctx.counters.sleeps.add(1);
            }
            let io = self.handle_events(n);
            let cmds = self.drain_mailbox();
            let now = Instant::now();
            let fired = self.run_timers(now);
            self.flush_dirty();
            self.account(kind, io, cmds, fired, pass_start);
            if io + cmds > 0 {
                self.busy_until = Instant::now() + self.ctx.shared.config.busy_poll;
            }
        }
        self.stop();
    }

    /// See the module docs: zero only while work is known to be ready or inside the busy-poll
    /// window.
    fn wait_timeout(&mut self, now: Instant) -> (Option<Duration>, WaitKind) {
        let conns = &self.conns;
        let next = self.timers.next_due(|a| timer_live(conns, a));
        if !self.ctx.mailbox.is_empty() || next.is_some_and(|d| d <= now) {
            return (Some(Duration::ZERO), WaitKind::Ready);
        }
        if now < self.busy_until {
            return (Some(Duration::ZERO), WaitKind::BusyPoll);
        }
        (
            sleep_timeout(now, next, self.ctx.shared.config.sleep_floor),
            WaitKind::Sleep,
        )
    }

    /// A pass that found no work is an empty iteration, unless it was a busy-poll spin (counted
    /// apart, with its time). In the incident every "sleep" was a zero wait that found nothing:
    /// such passes land here as empty iterations.
    fn account(
        &mut self,
        kind: WaitKind,
        io: usize,
        cmds: usize,
        fired: usize,
        pass_start: Instant,
    ) {
        let c = &self.ctx.counters;
        if io + cmds + fired == 0 {
            if kind == WaitKind::BusyPoll {
                c.busy_poll_spins.add(1);
                c.busy_poll_ns.add(pass_start.elapsed().as_nanos() as u64);
            } else {
                c.iterations.add(1);
                c.empty_iterations.add(1);
            }
            return;
        }
        c.iterations.add(1);
        c.wake_io.add((io > 0) as u64);
        c.wake_mailbox.add((cmds > 0) as u64);
        c.wake_timer.add((fired > 0) as u64);
    }

    // ---- slab -------------------------------------------------------------------------------

    fn alloc_slot(&mut self) -> (u32, u32) {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.gens.push(0);
            (self.conns.len() - 1) as u32
        });
        (slot, self.gens[slot as usize])
    }

    fn free_slot(&mut self, slot: u32) {
        self.conns[slot as usize] = None;
        self.gens[slot as usize] = self.gens[slot as usize].wrapping_add(1);
        self.free.push(slot);
    }

    fn take_conn(&mut self, slot: u32, gen: u32) -> Option<Conn> {
        if self.gens.get(slot as usize) != Some(&gen) {
            return None;
        }
        self.conns[slot as usize].take()
    }

    /// Run `f` on a connection taken out of the slab; put it back, or close it on error.
    fn with_conn(
        &mut self,
        slot: u32,
        gen: u32,
        f: impl FnOnce(&mut Worker, &mut Conn) -> Result<(), Close>,
    ) {
        let Some(mut c) = self.take_conn(slot, gen) else {
            return;
        };
        match f(self, &mut c) {
            Ok(()) => self.conns[slot as usize] = Some(c),
            Err(reason) => self.close_conn(c, reason),
        }
    }

    fn new_conn(
        &mut self,
        sock: Option<TcpStream>,
        peer_addr: SocketAddr,
        phase: Phase,
        role: Role,
    ) -> Conn {
        let (slot, gen) = self.alloc_slot();
        let sh = &self.ctx.shared;
        let id = sh.next_conn_id.fetch_add(1, Relaxed);
        let shared = Arc::new(ConnShared {
            id,
            slot,
            gen,
            mailbox: self.ctx.mailbox.clone(),
            state: AtomicU8::new(STATE_CONNECTING),
            peer_addr,
            peer: OnceLock::new(),
            next_txn: AtomicU64::new(1),
            payload_max: sh.config.payload_bytes_max,
        });
        Conn {
            shared,
            sock,
            sock_gen: 0,
            phase,
            role,
            rx: Rx {
                chunk: sh.pool.take(CHUNK_BYTES),
                start: 0,
                large: None,
            },
            tx: Tx::default(),
            pending: HashMap::new(),
            conn_throttle: Throttle::new(sh.config.conn_throttle, sh.conn_counters.clone()),
            global_throttle: None,
            conn_hold: None,
            global_hold: None,
            paused: false,
            interest: 0,
            lane: id as usize % self.ctx.lanes.len().max(1),
            dirty: false,
        }
    }

    // ---- events -----------------------------------------------------------------------------

    fn handle_events(&mut self, n: usize) -> usize {
        let mut io = 0;
        for i in 0..n {
            let ev = self.events[i];
            let (token, bits) = (ev.u64, ev.events);
            if token == TOKEN_EVENTFD {
                self.ctx.mailbox.drain_wake();
                continue;
            }
            io += 1;
            if token >= TOKEN_LISTENER_BASE {
                self.accept((token - TOKEN_LISTENER_BASE) as usize);
                continue;
            }
            let slot = token as u32;
            let Some(Some(c)) = self.conns.get(slot as usize) else {
                continue;
            };
            if c.token() != token {
                continue; // an event for a socket this slot no longer has
            }
            let gen = c.shared.gen;
            self.with_conn(slot, gen, |w, c| w.on_event(c, bits));
        }
        io
    }

    fn on_event(&mut self, c: &mut Conn, bits: u32) -> Result<(), Close> {
        let hup = bits & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0;
        let rd = libc::EPOLLIN as u32;
        let wr = libc::EPOLLOUT as u32;
        if hup && c.paused && c.interest & wr == 0 {
            // Hang-up reported while we are not reading (it is reported whatever the interest):
            // stop watching instead of spinning on it; resuming re-registers, and the read then
            // sees the end of the stream after the buffered bytes.
            self.deregister(c);
            return Ok(());
        }
        if bits & wr != 0 || (hup && c.interest & wr != 0) {
            if let Phase::Connecting = c.phase {
                return self.finish_connect(c);
            }
            self.flush(c)?;
        }
        if (bits & rd != 0 || hup) && c.interest & rd != 0 {
            self.read_conn(c)?;
        }
        Ok(())
    }

    fn accept(&mut self, li: usize) {
        for _ in 0..ACCEPTS_PER_PASS {
            let (stream, addr) = match self.listeners[li].accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!(worker = self.ctx.idx, "accept failed: {e}");
                    return;
                }
            };
            let target = self.ctx.shared.pick_worker();
            if target == self.ctx.idx {
                self.adopt(stream, addr);
            } else {
                self.ctx.shared.mailboxes[target].post(Cmd::Adopt(stream, addr));
            }
        }
    }

    fn adopt(&mut self, stream: TcpStream, addr: SocketAddr) {
        if let Err(e) = stream
            .set_nonblocking(true)
            .and_then(|_| stream.set_nodelay(true))
        {
            warn!(peer = %addr, "cannot set up accepted socket: {e}");
            return;
        }
        self.ctx.counters.conns_accepted.add(1);
        let hs = ServerHandshake::new(self.ctx.shared.identity, fresh_nonce());
        let mut c = self.new_conn(
            Some(stream),
            addr,
            Phase::Handshake(Handshake::Server(hs)),
            Role::Server,
        );
        let deadline = Instant::now() + self.ctx.shared.config.handshake_timeout;
        self.timers.push(
            deadline,
            TimerAction::EstablishTimeout {
                slot: c.shared.slot,
                gen: c.shared.gen,
                sock: c.sock_gen,
            },
        );
        let slot = c.shared.slot;
        match self.apply_interest(&mut c) {
            Ok(()) => self.conns[slot as usize] = Some(c),
            Err(r) => self.close_conn(c, r),
        }
    }

    // ---- epoll interest ---------------------------------------------------------------------

    fn apply_interest(&self, c: &mut Conn) -> Result<(), Close> {
        let want = c.desired_interest();
        if want == c.interest {
            return Ok(());
        }
        let Some(sock) = &c.sock else { return Ok(()) };
        let fd = sock.as_raw_fd();
        let ep = &self.ctx.epoll;
        let r = match (c.interest, want) {
            (0, w) => ep.add(fd, w, c.token()),
            (_, 0) => ep.delete(fd),
            (_, w) => ep.modify(fd, w, c.token()),
        };
        r.map_err(Close::Io)?;
        c.interest = want;
        Ok(())
    }

    fn deregister(&self, c: &mut Conn) {
        if c.interest != 0 {
            if let Some(sock) = &c.sock {
                let _ = self.ctx.epoll.delete(sock.as_raw_fd());
            }
            c.interest = 0;
        }
    }

    // ---- receive ----------------------------------------------------------------------------

    fn payload_limit(&self, c: &Conn) -> u32 {
        match c.phase {
            Phase::Open => self.ctx.shared.config.payload_bytes_max,
            _ => HANDSHAKE_PAYLOAD_MAX,
        }
    }

    /// Parse what is buffered, then read more, until the socket is drained, the per-pass budget
    /// is spent, or the connection is paused.
    fn read_conn(&mut self, c: &mut Conn) -> Result<(), Close> {
        let mut budget = self.ctx.shared.config.read_budget_bytes;
        loop {
            if let Flow::Paused = self.parse(c)? {
                return Ok(());
            }
            if budget == 0 || c.sock.is_none() {
                return Ok(());
            }
            match self.read_some(c) {
                Ok(0) => return Err(self.end_of_stream(c)),
                Ok(n) => {
                    self.ctx.counters.bytes_in.add(n as u64);
                    budget = budget.saturating_sub(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Close::Io(e)),
            }
        }
    }

    fn end_of_stream(&self, c: &Conn) -> Close {
        if let Some(l) = &c.rx.large {
            let have = HEADER_SIZE + l.buf.filled() + l.trailer_have;
            return Violation::Truncated {
                have,
                want: l.header.frame_len(),
            }
            .into();
        }
        let have = c.rx.buffered();
        if have > 0 {
            let want = c.rx.chunk.data()[c.rx.start..]
                .first_chunk::<HEADER_SIZE>()
                .and_then(|h| Header::decode(h, u32::MAX).ok())
                .map_or(HEADER_SIZE, |h| h.frame_len());
            return Violation::Truncated { have, want }.into();
        }
        match c.phase {
            Phase::Handshake(_) => Close::Auth(AuthFailure::ClosedByPeer),
            _ => Close::PeerClosed,
        }
    }

    /// One read (or readv) from the socket into the right buffers.
    fn read_some(&mut self, c: &mut Conn) -> io::Result<usize> {
        make_room(&self.ctx.shared.pool, &mut c.rx);
        let sock = c
            .sock
            .as_mut()
            .expect("reading a connection without a socket");
        let Rx { chunk, large, .. } = &mut c.rx;
        let Some(l) = large.as_mut() else {
            let n = sock.read(chunk.spare_mut())?;
            chunk.advance(n);
            return Ok(n);
        };
        // Rest of the large payload, its trailer, then whatever follows into the chunk.
        let missing = l.payload_missing();
        let before = l.buf.filled();
        let n = {
            let payload = &mut l.buf.spare_mut()[..missing];
            let trailer = &mut l.trailer[l.trailer_have..];
            let mut iov = [
                IoSliceMut::new(payload),
                IoSliceMut::new(trailer),
                IoSliceMut::new(chunk.spare_mut()),
            ];
            sock.read_vectored(&mut iov)?
        };
        let to_payload = n.min(missing);
        l.buf.advance(to_payload);
        l.crc = crate::checksum::crc32c_append(l.crc, &l.buf.data()[before..before + to_payload]);
        let to_trailer = (n - to_payload).min(TRAILER_SIZE - l.trailer_have);
        l.trailer_have += to_trailer;
        chunk.advance(n - to_payload - to_trailer);
        Ok(n)
    }

    /// Decode and deliver buffered frames.
    fn parse(&mut self, c: &mut Conn) -> Result<Flow, Close> {
        loop {
            if let Some(l) = &c.rx.large {
                if !l.complete() {
                    return Ok(Flow::NeedBytes);
                }
                let l = c.rx.large.take().expect("checked above");
                check_payload_crc(l.crc, l.trailer)?;
                let payload = l.buf.freeze(0, l.header.payload_len as usize);
                self.deliver(c, l.header, payload)?;
                continue;
            }
            let avail = c.rx.buffered();
            if avail < HEADER_SIZE {
                return Ok(Flow::NeedBytes);
            }
            let head = *c.rx.chunk.data()[c.rx.start..]
                .first_chunk::<HEADER_SIZE>()
                .expect("avail checked");
            let header = Header::decode(&head, self.payload_limit(c))?;
            let phase_ok = match c.phase {
                Phase::Open => !header.kind.is_handshake(),
                _ => header.kind.is_handshake(),
            };
            if !phase_ok {
                let phase = if matches!(c.phase, Phase::Open) {
                    "after authentication"
                } else {
                    "before authentication"
                };
                return Err(Violation::UnexpectedKind {
                    kind: header.kind as u8,
                    phase,
                }
                .into());
            }
            if matches!(header.kind, FrameKind::Request | FrameKind::OneWay)
                && !self.admit(c, &header)
            {
                return Ok(Flow::Paused);
            }
            let total = header.frame_len();
            let plen = header.payload_len as usize;
            let p0 = c.rx.start + HEADER_SIZE;
            if avail >= total {
                let data = c.rx.chunk.data();
                let trailer = *data[p0 + plen..]
                    .first_chunk::<TRAILER_SIZE>()
                    .expect("frame complete");
                check_payload(&data[p0..p0 + plen], trailer)?;
                let payload = c.rx.chunk.freeze(p0, plen);
                c.rx.start += total;
                self.deliver(c, header, payload)?;
                continue;
            }
            if plen < LARGE_PAYLOAD_MIN {
                return Ok(Flow::NeedBytes);
            }
            // A large payload gets a buffer of its own; move what already arrived into it.
            let have = avail - HEADER_SIZE;
            let in_payload = have.min(plen);
            let mut buf = self.ctx.shared.pool.take(plen);
            let data = c.rx.chunk.data();
            buf.spare_mut()[..in_payload].copy_from_slice(&data[p0..p0 + in_payload]);
            buf.advance(in_payload);
            let crc = crate::checksum::crc32c(&data[p0..p0 + in_payload]);
            let mut trailer = [0u8; TRAILER_SIZE];
            let in_trailer = have - in_payload;
            trailer[..in_trailer]
                .copy_from_slice(&data[p0 + in_payload..p0 + in_payload + in_trailer]);
            c.rx.start = c.rx.chunk.filled();
            c.rx.large = Some(LargeRx {
                header,
                buf,
                trailer,
                trailer_have: in_trailer,
                crc,
            });
        }
    }

    /// Take throttle capacity for the frame at the head of the buffer; false: paused until a
    /// grant arrives.
    fn admit(&mut self, c: &mut Conn, header: &Header) -> bool {
        let bytes = header.payload_len as u64;
        let (slot, gen, key) = (c.shared.slot, c.shared.gen, c.throttle_key());
        if c.conn_hold.is_none() {
            let mb = self.ctx.mailbox.clone();
            let grant = move |hold| {
                mb.post(Cmd::Granted {
                    slot,
                    gen,
                    level: Level::Conn,
                    hold,
                })
            };
            match c.conn_throttle.acquire(key, bytes, grant) {
                Some(h) => c.conn_hold = Some(h),
                None => return self.pause(c),
            }
        }
        if c.global_hold.is_none() {
            let mb = self.ctx.mailbox.clone();
            let grant = move |hold| {
                mb.post(Cmd::Granted {
                    slot,
                    gen,
                    level: Level::Global,
                    hold,
                })
            };
            let global = c
                .global_throttle
                .as_ref()
                .expect("open connections have a class throttle");
            match global.acquire(key, bytes, grant) {
                Some(h) => c.global_hold = Some(h),
                None => return self.pause(c),
            }
        }
        true
    }

    fn pause(&mut self, c: &mut Conn) -> bool {
        c.paused = true;
        // Dropping read interest cannot fail in a way we could act on here; a failure shows up
        // on the next epoll_ctl or read.
        let _ = self.apply_interest(c);
        false
    }

    fn granted(&mut self, c: &mut Conn, level: Level, hold: Hold) -> Result<(), Close> {
        if !c.paused {
            // A grant for a wait that ended with the old socket (a client connection that
            // reconnected meanwhile): give the capacity back.
            drop(hold);
            return Ok(());
        }
        match level {
            Level::Conn => c.conn_hold = Some(hold),
            Level::Global => c.global_hold = Some(hold),
        }
        c.paused = false;
        self.read_conn(c)?;
        // Re-adds read interest (re-registering the socket if a hang-up dropped it meanwhile).
        self.apply_interest(c)
    }

    fn deliver(&mut self, c: &mut Conn, header: Header, payload: Payload) -> Result<(), Close> {
        self.ctx.counters.frames_in.add(1);
        match header.kind {
            FrameKind::Request | FrameKind::OneWay => {
                self.dispatch(c, &header, payload);
                Ok(())
            }
            FrameKind::Reply => {
                self.complete_request(c, &header, payload);
                Ok(())
            }
            _ => self.handshake_frame(c, &header, &payload),
        }
    }

    fn dispatch(&mut self, c: &mut Conn, header: &Header, payload: Payload) {
        let ticket = Ticket {
            _conn: c.conn_hold.take().expect("admitted"),
            _global: c.global_hold.take().expect("admitted"),
        };
        let conn = c.handle();
        let responder = (header.kind == FrameKind::Request).then(|| Responder {
            conn: conn.clone(),
            txn: header.txn,
            done: false,
        });
        let msg = Incoming {
            conn,
            msg_type: header.msg_type,
            payload,
            responder,
            _ticket: Some(ticket),
        };
        let d = &self.ctx.shared.dispatcher;
        if d.runs_inline(header.msg_type) || self.ctx.lanes.is_empty() {
            d.handle(msg);
        } else {
            // A send fails only while shutting down; the message is dropped with its ticket.
            let _ = self.ctx.lanes[c.lane].send(msg);
        }
    }

    fn complete_request(&mut self, c: &mut Conn, header: &Header, payload: Payload) {
        let Some(p) = c.pending.remove(&header.txn) else {
            self.ctx.counters.late_replies.add(1);
            return;
        };
        let r = if header.flags & FLAG_REPLY_ABANDONED != 0 {
            Err(Error::RequestAbandoned {
                peer: c.shared.peer_addr,
                identity: c.handle().peer(),
            })
        } else {
            Ok(Reply {
                msg_type: header.msg_type,
                payload,
            })
        };
        (p.on_reply)(r);
    }

    fn handshake_frame(
        &mut self,
        c: &mut Conn,
        header: &Header,
        payload: &[u8],
    ) -> Result<(), Close> {
        let secret = &self.ctx.shared.secret;
        let step = match &mut c.phase {
            Phase::Handshake(Handshake::Client(h)) => h.on_frame(secret, header, payload),
            Phase::Handshake(Handshake::Server(h)) => h.on_frame(secret, header, payload),
            _ => unreachable!("handshake frames are refused outside the handshake"),
        };
        match step {
            Err(Rejection::Protocol(v)) => Err(Close::Violation(v)),
            Err(Rejection::Auth(a)) => Err(Close::Auth(a)),
            Ok(HsStep::Send(kind, p)) => {
                self.queue_frame(c, OutFrame::handshake(kind, p));
                Ok(())
            }
            Ok(HsStep::Done { peer, reply }) => {
                if let Some((kind, p)) = reply {
                    self.queue_frame(c, OutFrame::handshake(kind, p));
                }
                self.established(c, peer);
                Ok(())
            }
        }
    }

    fn established(&mut self, c: &mut Conn, peer: Identity) {
        let sh = &self.ctx.shared;
        let first = c.shared.peer.set(peer).is_ok();
        debug_assert!(
            first || c.shared.peer.get() == Some(&peer),
            "a reconnect reaches the same peer"
        );
        c.global_throttle = Some(match peer {
            Identity::Client(_) => sh.client_throttle.clone(),
            Identity::Node(_) => sh.node_throttle.clone(),
        });
        c.phase = Phase::Open;
        c.shared.state.store(STATE_OPEN, Relaxed);
        self.ctx.counters.conns_open.add(1);
        debug!(worker = self.ctx.idx, peer = %c.shared.peer_addr, identity = %peer, "connection authenticated");
        if let Role::Client {
            backoff, waiter, ..
        } = &mut c.role
        {
            *backoff = sh.config.reconnect_backoff_min;
            if let Some(w) = waiter.take() {
                let _ = w.send(Ok(c.handle()));
            }
        }
        sh.dispatcher.connected(&c.handle());
    }

    // ---- send -------------------------------------------------------------------------------

    fn queue_frame(&mut self, c: &mut Conn, frame: OutFrame) {
        c.tx.queue.push_back(frame);
        if !c.dirty {
            c.dirty = true;
            self.dirty.push(c.shared.slot);
        }
    }

    fn flush_dirty(&mut self) {
        while let Some(slot) = self.dirty.pop() {
            let Some(Some(c)) = self.conns.get_mut(slot as usize) else {
                continue;
            };
            c.dirty = false;
            let gen = c.shared.gen;
            self.with_conn(slot, gen, |w, c| w.flush(c));
        }
    }

    /// Write queued frames with vectored writes until done or the socket is full.
    fn flush(&mut self, c: &mut Conn) -> Result<(), Close> {
        if matches!(c.phase, Phase::Connecting | Phase::Backoff) {
            return Ok(());
        }
        let Some(sock) = c.sock.as_mut() else {
            return Ok(());
        };
        c.tx.blocked = write_queued(sock, &mut c.tx, &self.ctx.counters)?;
        self.apply_interest(c)
    }

    // ---- connect ----------------------------------------------------------------------------

    fn connect(
        &mut self,
        addr: SocketAddr,
        peer: Identity,
        done: Sender<Result<Connection, Error>>,
    ) {
        let role = Role::Client {
            addr,
            expected: peer,
            backoff: self.ctx.shared.config.reconnect_backoff_min,
            waiter: Some(done),
        };
        let mut c = self.new_conn(None, addr, Phase::Backoff, role);
        c.shared.peer.set(peer).expect("fresh connection");
        match self.start_connect(&mut c) {
            Ok(()) => {
                let slot = c.shared.slot;
                self.conns[slot as usize] = Some(c);
            }
            Err(r) => self.close_conn(c, r),
        }
    }

    fn start_connect(&mut self, c: &mut Conn) -> Result<(), Close> {
        let Role::Client { addr, .. } = c.role else {
            unreachable!("only clients connect")
        };
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )
        .and_then(|s| s.set_nonblocking(true).map(|_| s))
        .and_then(|s| s.set_nodelay(true).map(|_| s))
        .map_err(Close::Io)?;
        match sock.connect(&addr.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(Close::Io(e)),
        }
        c.sock = Some(sock.into());
        c.sock_gen = c.sock_gen.wrapping_add(1) & SOCK_GEN_MASK;
        c.phase = Phase::Connecting;
        let deadline = Instant::now() + self.ctx.shared.config.connect_timeout;
        self.timers.push(
            deadline,
            TimerAction::EstablishTimeout {
                slot: c.shared.slot,
                gen: c.shared.gen,
                sock: c.sock_gen,
            },
        );
        self.apply_interest(c)
    }

    fn finish_connect(&mut self, c: &mut Conn) -> Result<(), Close> {
        let sock = c.sock.as_ref().expect("connecting socket");
        match sock.take_error() {
            Ok(None) => {}
            Ok(Some(e)) | Err(e) => return Err(Close::Io(e)),
        }
        let Role::Client { expected, .. } = c.role else {
            unreachable!("only clients connect")
        };
        let hs = ClientHandshake::new(self.ctx.shared.identity, expected, fresh_nonce());
        let (kind, hello) = hs.hello();
        c.phase = Phase::Handshake(Handshake::Client(hs));
        c.tx.queue.push_back(OutFrame::handshake(kind, hello));
        self.flush(c)
    }

    // ---- close ------------------------------------------------------------------------------

    fn close_conn(&mut self, mut c: Conn, reason: Close) {
        let addr = c.shared.peer_addr;
        let who = match (&c.phase, c.shared.peer.get()) {
            (Phase::Open, Some(p)) => p.to_string(),
            (_, Some(p)) => format!("unauthenticated (expected {p})"),
            (_, None) => "unauthenticated".to_string(),
        };
        let counters = &self.ctx.counters;
        match &reason {
            Close::Violation(_) => {
                counters.protocol_errors.add(1);
                warn!(worker = self.ctx.idx, peer = %addr, identity = %who, "closing connection: {}", reason.describe());
            }
            Close::Auth(_) => {
                counters.auth_failures.add(1);
                warn!(worker = self.ctx.idx, peer = %addr, identity = %who, "closing connection: {}", reason.describe());
            }
            Close::Io(_) | Close::ConnectTimeout => {
                info!(worker = self.ctx.idx, peer = %addr, identity = %who, "closing connection: {}", reason.describe())
            }
            Close::PeerClosed | Close::User | Close::Shutdown => {
                debug!(worker = self.ctx.idx, peer = %addr, identity = %who, "closing connection: {}", reason.describe())
            }
        }
        self.deregister(&mut c);
        c.sock = None;
        let key = c.throttle_key();
        c.conn_throttle.cancel(key);
        if let Some(g) = &c.global_throttle {
            g.cancel(key);
        }
        c.conn_hold = None;
        c.global_hold = None;
        c.paused = false;
        c.rx.discard();
        c.tx = Tx::default();
        let was_open = matches!(c.phase, Phase::Open);
        if was_open {
            counters.conns_open.sub(1);
        }
        for (_, p) in c.pending.drain() {
            (p.on_reply)(Err(reason.to_request_error(addr)));
        }
        let reconnect = match &mut c.role {
            Role::Client {
                waiter: Some(w), ..
            } => {
                let _ = w.send(Err(
                    reason.to_connect_error(addr, self.ctx.shared.config.connect_timeout)
                ));
                false
            }
            Role::Client { waiter: None, .. } => {
                !matches!(reason, Close::User | Close::Shutdown) && !self.stopping
            }
            Role::Server => false,
        };
        if was_open {
            let err = reason.to_request_error(addr);
            self.ctx.shared.dispatcher.disconnected(&c.handle(), &err);
        }
        if reconnect {
            self.schedule_reconnect(c);
        } else {
            c.shared.state.store(STATE_CLOSED, Relaxed);
            self.free_slot(c.shared.slot);
        }
    }

    fn schedule_reconnect(&mut self, mut c: Conn) {
        let Role::Client { backoff, .. } = &mut c.role else {
            unreachable!("only clients reconnect")
        };
        let cfg = &self.ctx.shared.config;
        // Up to 25 % jitter so a node restart is not met by every client at the same instant.
        let delay = backoff.mul_f64(1.0 + rand::thread_rng().gen_range(0.0..0.25));
        *backoff = (*backoff * 2).min(cfg.reconnect_backoff_max);
        c.phase = Phase::Backoff;
        c.shared.state.store(STATE_RECONNECTING, Relaxed);
        self.timers.push(
            Instant::now() + delay,
            TimerAction::Reconnect {
                slot: c.shared.slot,
                gen: c.shared.gen,
            },
        );
        let slot = c.shared.slot;
        self.conns[slot as usize] = Some(c);
    }

    // ---- mailbox and timers -----------------------------------------------------------------

    fn drain_mailbox(&mut self) -> usize {
        let mut n = 0;
        while n < COMMANDS_PER_PASS {
            let Some(cmd) = self.ctx.mailbox.pop() else {
                break;
            };
            n += 1;
            self.command(cmd);
        }
        n
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Listen(l) => {
                let token = TOKEN_LISTENER_BASE + self.listeners.len() as u64;
                match self
                    .ctx
                    .epoll
                    .add(l.as_raw_fd(), libc::EPOLLIN as u32, token)
                {
                    Ok(()) => self.listeners.push(l),
                    Err(e) => warn!(worker = self.ctx.idx, "cannot watch listener: {e}"),
                }
            }
            Cmd::Adopt(s, addr) => self.adopt(s, addr),
            Cmd::Connect { addr, peer, done } => self.connect(addr, peer, done),
            Cmd::Send { slot, gen, frame } => self.with_conn(slot, gen, |w, c| {
                if matches!(c.phase, Phase::Open) {
                    w.queue_frame(c, frame);
                }
                Ok(())
            }),
            Cmd::Request {
                conn,
                txn,
                frame,
                timeout,
                on_reply,
            } => self.request(&conn, txn, frame, timeout, on_reply),
            Cmd::Granted {
                slot,
                gen,
                level,
                hold,
            } => self.with_conn(slot, gen, |w, c| w.granted(c, level, hold)),
            Cmd::Close { slot, gen } => {
                if let Some(c) = self.take_conn(slot, gen) {
                    self.close_conn(c, Close::User);
                }
            }
            Cmd::Timer { delay, timer } => self
                .timers
                .push(Instant::now() + delay, TimerAction::User(timer)),
            Cmd::Shutdown => self.stopping = true,
        }
    }

    fn request(
        &mut self,
        conn: &ConnShared,
        txn: u64,
        frame: OutFrame,
        timeout: Duration,
        on_reply: ReplyFn,
    ) {
        let (slot, gen) = (conn.slot, conn.gen);
        let Some(mut c) = self.take_conn(slot, gen) else {
            return on_reply(Err(Error::NotConnected {
                peer: conn.peer_addr,
                state: "closed",
            }));
        };
        if !matches!(c.phase, Phase::Open) {
            let state = if matches!(c.phase, Phase::Backoff) {
                "reconnecting"
            } else {
                "connecting"
            };
            on_reply(Err(Error::NotConnected {
                peer: c.shared.peer_addr,
                state,
            }));
        } else {
            c.pending.insert(txn, Pending { on_reply, timeout });
            self.timers.push(
                Instant::now() + timeout,
                TimerAction::RequestTimeout { slot, gen, txn },
            );
            self.queue_frame(&mut c, frame);
        }
        self.conns[slot as usize] = Some(c);
        let conns = &self.conns;
        self.timers.maybe_compact(|a| timer_live(conns, a));
    }

    fn run_timers(&mut self, now: Instant) -> usize {
        let mut fired = 0;
        while fired < TIMERS_PER_PASS {
            let Some(action) = self.timers.pop_due(now) else {
                break;
            };
            if self.fire(action) {
                fired += 1;
            }
        }
        self.ctx.counters.timers_fired.add(fired as u64);
        fired
    }

    /// Run one due timer; false if its purpose was already gone.
    fn fire(&mut self, action: TimerAction) -> bool {
        match action {
            TimerAction::User(mut f) => {
                if let Some(again) = f() {
                    self.timers
                        .push(Instant::now() + again, TimerAction::User(f));
                }
                true
            }
            TimerAction::RequestTimeout { slot, gen, txn } => {
                let Some(Some(c)) = self.conns.get_mut(slot as usize) else {
                    return false;
                };
                if self.gens[slot as usize] != gen {
                    return false;
                }
                let Some(p) = c.pending.remove(&txn) else {
                    return false;
                };
                (p.on_reply)(Err(Error::Timeout {
                    peer: c.shared.peer_addr,
                    what: "reply",
                    after: p.timeout,
                }));
                true
            }
            TimerAction::EstablishTimeout { slot, gen, sock } => {
                let Some(c) = self.take_conn(slot, gen) else {
                    return false;
                };
                let reason = match c.phase {
                    _ if c.sock_gen != sock => None,
                    Phase::Connecting => Some(Close::ConnectTimeout),
                    Phase::Handshake(_) => Some(Close::Auth(AuthFailure::TimedOut)),
                    Phase::Open | Phase::Backoff => None,
                };
                match reason {
                    Some(r) => self.close_conn(c, r),
                    None => self.conns[slot as usize] = Some(c),
                }
                true
            }
            TimerAction::Reconnect { slot, gen } => {
                let Some(mut c) = self.take_conn(slot, gen) else {
                    return false;
                };
                if !matches!(c.phase, Phase::Backoff) {
                    self.conns[slot as usize] = Some(c);
                    return false;
                }
                self.ctx.counters.reconnects.add(1);
                match self.start_connect(&mut c) {
                    Ok(()) => self.conns[slot as usize] = Some(c),
                    Err(r) => self.close_conn(c, r),
                }
                true
            }
        }
    }

    fn stop(mut self) {
        for slot in 0..self.conns.len() as u32 {
            let gen = self.gens[slot as usize];
            if let Some(c) = self.take_conn(slot, gen) {
                self.close_conn(c, Close::Shutdown);
            }
        }
        // Answer whatever is still queued, and whatever is posted from now on, so no caller
        // waits forever.
        self.ctx.mailbox.close();
    }
}

/// Whether a timer still has a purpose.
fn timer_live(conns: &[Option<Conn>], a: &TimerAction) -> bool {
    let conn = |slot: u32, gen: u32| {
        conns
            .get(slot as usize)
            .and_then(|c| c.as_ref())
            .filter(|c| c.shared.gen == gen)
    };
    match a {
        TimerAction::User(_) => true,
        TimerAction::RequestTimeout { slot, gen, txn } => {
            conn(*slot, *gen).is_some_and(|c| c.pending.contains_key(txn))
        }
        TimerAction::EstablishTimeout { slot, gen, sock } => conn(*slot, *gen).is_some_and(|c| {
            c.sock_gen == *sock && matches!(c.phase, Phase::Connecting | Phase::Handshake(_))
        }),
        TimerAction::Reconnect { slot, gen } => {
            conn(*slot, *gen).is_some_and(|c| matches!(c.phase, Phase::Backoff))
        }
    }
}

/// Make sure the chunk has room for the next read (and, for a partial small frame, room for the
/// whole frame), moving a partial frame to a fresh chunk when needed.
fn make_room(pool: &BufPool, rx: &mut Rx) {
    let pending = rx.buffered();
    if pending == 0 && rx.chunk.reset_if_unshared() {
        rx.start = 0;
        return;
    }
    let want = match rx.large {
        Some(_) => 0,
        None => rx.chunk.data()[rx.start..]
            .first_chunk::<HEADER_SIZE>()
            .and_then(|h| Header::decode(h, LARGE_PAYLOAD_MIN as u32).ok())
            .map_or(HEADER_SIZE, |h| h.frame_len()),
    };
    let spare = rx.chunk.capacity() - rx.chunk.filled();
    if spare >= READ_MIN_BYTES && rx.start + want <= rx.chunk.capacity() {
        return;
    }
    let mut fresh = pool.take(CHUNK_BYTES);
    fresh.spare_mut()[..pending].copy_from_slice(&rx.chunk.data()[rx.start..]);
    fresh.advance(pending);
    rx.chunk = fresh;
    rx.start = 0;
}

/// Write until the queue is empty (false) or the socket is full (true). A short write means
/// the socket buffer is full: stop there rather than pay for a write that returns EAGAIN.
fn write_queued(
    sock: &mut TcpStream,
    tx: &mut Tx,
    counters: &WorkerCounters,
) -> Result<bool, Close> {
    while !tx.queue.is_empty() {
        let (r, asked) = {
            let mut iov = [IoSlice::new(&[]); IOV_MAX];
            let k = gather(tx, &mut iov);
            let asked: usize = iov[..k].iter().map(|s| s.len()).sum();
            (sock.write_vectored(&iov[..k]), asked)
        };
        match r {
            Ok(0) => return Err(Close::Io(io::ErrorKind::WriteZero.into())),
            Ok(n) => {
                counters.bytes_out.add(n as u64);
                counters.frames_out.add(consume(tx, n));
                if n < asked {
                    return Ok(true);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Close::Io(e)),
        }
    }
    Ok(false)
}

/// Fill `iov` with the unwritten bytes of the queued frames; returns how many slices.
fn gather<'a>(tx: &'a Tx, iov: &mut [IoSlice<'a>; IOV_MAX]) -> usize {
    let mut k = 0;
    let mut skip = tx.head_done;
    'frames: for f in &tx.queue {
        let segs = std::iter::once(&f.header[..])
            .chain(f.parts.iter().map(|p| p.bytes()))
            .chain(std::iter::once(&f.trailer[..]));
        for seg in segs {
            if skip >= seg.len() {
                skip -= seg.len();
                continue;
            }
            iov[k] = IoSlice::new(&seg[skip..]);
            skip = 0;
            k += 1;
            if k == IOV_MAX {
                break 'frames;
            }
        }
    }
    k
}

/// Account `n` written bytes; returns how many frames completed.
fn consume(tx: &mut Tx, mut n: usize) -> u64 {
    let mut done = 0;
    while let Some(f) = tx.queue.front() {
        let left = f.len - tx.head_done;
        if n < left {
            tx.head_done += n;
            break;
        }
        n -= left;
        tx.head_done = 0;
        tx.queue.pop_front();
        done += 1;
    }
    done
}
