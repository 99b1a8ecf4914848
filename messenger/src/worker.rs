//! A worker thread (`msgr-worker-N`): one epoll set, its connections, its timer heap.
//!
//! # The loop
//! Each pass: wait on epoll, handle socket events, drain the mailbox, fire due timers, flush the
//! connections that have output. The wait's timeout is chosen by [`Worker::wait_timeout`]:
//! * zero while commands are queued;
//! * zero for a bounded busy-poll window after socket or mailbox activity (a reply usually
//!   follows a request within microseconds; polling avoids a sleep/wake pair), yielding the
//!   CPU between empty polls so a polling worker never keeps a runnable peer thread (often the
//!   one about to send what it polls for) off a shared core;
//! * otherwise sleep until the next timer, **floored** ([`crate::sys::sleep_timeout`]), or until
//!   an event when there is no timer. Never zero while nothing is ready.
//!
//! Timers firing do not start the busy-poll window, and a due timer does not make the wait zero:
//! a timer chain re-arming itself sub-µs ahead (the incident) costs one floored sleep and one
//! wake per firing, never a spin. Timers fire at most `sleep_floor` late (plus kernel timer
//! slack), or earlier when socket or mailbox activity wakes the worker.
//!
//! # Backpressure
//! A frame's header is decoded before its payload is read; requests and one-way messages then
//! take capacity from the connection's throttle and its peer class's throttle. When either is
//! full the connection stops reading (read interest dropped) and waits for a grant command; the
//! bytes already buffered stay where they are, so nothing is lost or reordered.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSliceMut, Read};
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
use crate::pool::{BufPool, Payload, RecvBuf, CHUNK_BYTES, LARGE_PAYLOAD_BYTES_MIN};
use crate::stats::WorkerCounters;
use crate::sys::{gettid, sleep_timeout, Epoll};
use crate::throttle::{Hold, Throttle, ThrottleCounters};
use crate::timer::{TimerAction, Timers};

mod lifecycle;
mod rx;
mod tx;

use rx::Rx;
use tx::Tx;

const TOKEN_EVENTFD: u64 = u64::MAX;
/// Listener `i` has token `TOKEN_LISTENER_BASE + i`; connection tokens stay below 2^63.
const TOKEN_LISTENER_BASE: u64 = 1 << 63;
const SOCK_GEN_MASK: u32 = 0x7fff_ffff;
/// Handshake frames are tiny; a pre-authentication peer cannot make us buffer more than this.
const HANDSHAKE_PAYLOAD_BYTES_MAX: u32 = 128;
/// Bounds per pass, so one source of work cannot starve the others.
const COMMANDS_PER_PASS: usize = 4096;
const TIMERS_PER_PASS: usize = 1024;
const ACCEPTS_PER_PASS: usize = 64;
/// How long a listener is left alone after accept failed for lack of descriptors or memory.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
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
    /// When the connection last stopped reading for throttle capacity (cleared by the next
    /// message it delivers, which carries the wait as [`Incoming::throttled`]).
    paused_at: Option<std::time::Instant>,
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
    /// Connections that spent their write quantum: they go on next pass (marked dirty).
    resume: Vec<u32>,
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
            resume: Vec::new(),
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
            // Writes cut short by the quantum go first in the dirty list, so what this pass
            // adds (a small reply, say) is written before them.
            let resumed = self.resume.len();
            self.resume.append(&mut self.dirty);
            std::mem::swap(&mut self.resume, &mut self.dirty);
            let io = self.handle_events(n) + resumed;
            let cmds = self.drain_mailbox();
            let now = Instant::now();
            let fired = self.run_timers(now);
            let wrote = self.flush_dirty();
            self.account(kind, io, cmds, fired, pass_start);
            if wrote >= tx::PASS_WRITE_BUDGET as u64 {
                // Streaming bulk data: let any thread waiting for this CPU run now rather than
                // at the end of our time slice (1.4 ms on 2 CPUs). A small op's every hand-off
                // wakes a thread; on a machine whose cores this worker keeps busy it would
                // otherwise wait behind our copying (the hot-object storm's probe).
                self.ctx.counters.bulk_yields.add(1);
                crate::sys::yield_cpu();
            }
            if io + cmds > 0 {
                self.busy_until = Instant::now() + self.ctx.shared.config.busy_poll;
            } else if kind == WaitKind::BusyPoll && fired == 0 {
                // Poll politely: let any other runnable thread on this CPU (often the peer that
                // is about to send what we are polling for) run before polling again.
                crate::sys::yield_cpu();
            }
        }
        self.stop();
    }

    /// See the module docs: zero only while commands are queued or inside the busy-poll
    /// window. A timer that is already due does not make the wait zero: this pass just ran the
    /// due timers, so one due now was armed (or left over) during it, and it fires after the
    /// floored sleep. Otherwise a timer re-arming itself less than one pass ahead would turn the
    /// loop into a spin: the incident again, with "ready" work instead of a truncated timeout.
    fn wait_timeout(&mut self, now: Instant) -> (Option<Duration>, WaitKind) {
        let conns = &self.conns;
        let next = self.timers.next_due(|a| timer_live(conns, a));
        if !self.ctx.mailbox.is_empty() || !self.resume.is_empty() {
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
            rx: Rx::new(),
            tx: Tx::default(),
            pending: HashMap::new(),
            conn_throttle: Throttle::new(sh.config.conn_throttle, sh.conn_counters.clone()),
            global_throttle: None,
            conn_hold: None,
            global_hold: None,
            paused: false,
            paused_at: None,
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
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    // Out of descriptors or memory: the listener stays readable, so watching it
                    // now would spin. Stop watching it for a while instead.
                    warn!(
                        worker = self.ctx.idx,
                        "accept failed: {e}; pausing this listener for {ACCEPT_RETRY:?}"
                    );
                    let _ = self.ctx.epoll.delete(self.listeners[li].as_raw_fd());
                    self.timers.push(
                        Instant::now() + ACCEPT_RETRY,
                        TimerAction::Relisten { idx: li },
                    );
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
            TimerAction::Relisten { idx } => {
                let l = &self.listeners[idx];
                let token = TOKEN_LISTENER_BASE + idx as u64;
                if let Err(e) = self
                    .ctx
                    .epoll
                    .add(l.as_raw_fd(), libc::EPOLLIN as u32, token)
                {
                    warn!(worker = self.ctx.idx, "cannot watch listener again: {e}");
                }
                true
            }
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
        TimerAction::User(_) | TimerAction::Relisten { .. } => true,
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
