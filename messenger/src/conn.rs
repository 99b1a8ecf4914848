//! Connection handles and the mailbox through which any thread talks to a worker.

use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crossbeam::channel::Sender;
use crossbeam::queue::SegQueue;

use crate::auth::Identity;
use crate::error::{Error, Result};
use crate::frame::FrameKind;
use crate::message::{OutFrame, OutMessage, Reply, ReplyFn};
use crate::sys::EventFd;
use crate::throttle::Hold;
use crate::timer::UserTimer;

thread_local! {
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Mark the current thread as a messenger worker.
pub(crate) fn mark_worker_thread() {
    ON_WORKER.with(|w| w.set(true));
}

/// Blocking calls on a worker would wait for the very thread that must answer them.
pub(crate) fn assert_not_on_worker(call: &str) {
    assert!(
        !ON_WORKER.with(|w| w.get()),
        "{call} blocks and would deadlock on a messenger worker thread; use the callback form"
    );
}

/// Which throttle a grant belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    Conn,
    Global,
}

/// Work for a worker from another thread (or from code running on the worker itself).
pub(crate) enum Cmd {
    Listen(TcpListener),
    Adopt(TcpStream, SocketAddr),
    Connect {
        addr: SocketAddr,
        peer: Identity,
        done: Sender<Result<Connection>>,
    },
    Send {
        slot: u32,
        gen: u32,
        frame: OutFrame,
    },
    Request {
        conn: Arc<ConnShared>,
        txn: u64,
        frame: OutFrame,
        timeout: Duration,
        on_reply: ReplyFn,
    },
    Granted {
        slot: u32,
        gen: u32,
        level: Level,
        hold: Hold,
    },
    Close {
        slot: u32,
        gen: u32,
    },
    Timer {
        delay: Duration,
        timer: UserTimer,
    },
    Shutdown,
}

/// A worker's inbox. Posting never blocks; the eventfd is written only when the worker is (about
/// to be) asleep, so a busy or busy-polling worker is fed without a syscall.
pub(crate) struct Mailbox {
    queue: SegQueue<Cmd>,
    pub(crate) eventfd: EventFd,
    sleeping: AtomicBool,
    wake_pending: AtomicBool,
    /// The worker has stopped: posts are answered (failed) by the poster.
    closed: AtomicBool,
}

impl Mailbox {
    pub fn new() -> std::io::Result<Mailbox> {
        Ok(Mailbox {
            queue: SegQueue::new(),
            eventfd: EventFd::new()?,
            sleeping: AtomicBool::new(false),
            wake_pending: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        })
    }

    pub fn post(&self, cmd: Cmd) {
        self.queue.push(cmd);
        if self.closed.load(SeqCst) {
            // Nobody will read it: fail it here, so no caller waits forever.
            return self.fail_queued();
        }
        // Pairs with `about_to_sleep`: either the worker sees the command when it re-checks the
        // queue, or we see `sleeping` and write the eventfd (SeqCst on both sides).
        if self.sleeping.load(SeqCst) && !self.wake_pending.swap(true, SeqCst) {
            self.eventfd.notify();
        }
    }

    /// The worker stops: from now on commands are failed, not queued.
    pub fn close(&self) {
        self.closed.store(true, SeqCst);
        self.fail_queued();
    }

    /// Answer every queued command with [`Error::Shutdown`] (dropping the rest: grants release
    /// their capacity, frames their buffers).
    fn fail_queued(&self) {
        while let Some(cmd) = self.queue.pop() {
            match cmd {
                Cmd::Request { on_reply, .. } => on_reply(Err(Error::Shutdown)),
                Cmd::Connect { done, .. } => {
                    let _ = done.send(Err(Error::Shutdown));
                }
                _ => {}
            }
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(SeqCst)
    }

    pub fn pop(&self) -> Option<Cmd> {
        self.queue.pop()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The worker is going to sleep: returns false (do not sleep) if work arrived meanwhile.
    pub fn about_to_sleep(&self) -> bool {
        self.sleeping.store(true, SeqCst);
        if !self.queue.is_empty() {
            self.sleeping.store(false, SeqCst);
            return false;
        }
        true
    }

    pub fn awake(&self) {
        self.sleeping.store(false, SeqCst);
    }

    /// The eventfd fired: consume it.
    pub fn drain_wake(&self) {
        self.eventfd.drain();
        self.wake_pending.store(false, SeqCst);
    }
}

pub(crate) const STATE_CONNECTING: u8 = 0;
pub(crate) const STATE_OPEN: u8 = 1;
pub(crate) const STATE_RECONNECTING: u8 = 2;
pub(crate) const STATE_CLOSED: u8 = 3;

fn state_name(s: u8) -> &'static str {
    match s {
        STATE_CONNECTING => "connecting",
        STATE_OPEN => "open",
        STATE_RECONNECTING => "reconnecting",
        _ => "closed",
    }
}

/// What every handle of a connection shares with its worker.
pub(crate) struct ConnShared {
    pub id: u64,
    pub slot: u32,
    pub gen: u32,
    pub mailbox: Arc<Mailbox>,
    pub state: AtomicU8,
    pub peer_addr: SocketAddr,
    pub peer: OnceLock<Identity>,
    pub next_txn: AtomicU64,
    pub payload_max: u32,
}

/// A handle on one connection (cheap to clone). Sending through it goes to the worker that owns
/// the connection. A handle from [`crate::Messenger::connect`] survives reconnects; one handed to
/// a dispatcher for an accepted connection is dead once that connection closes.
#[derive(Clone)]
pub struct Connection {
    pub(crate) shared: Arc<ConnShared>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Connection#{}({} {}, {})",
            self.shared.id,
            self.peer(),
            self.shared.peer_addr,
            self.state()
        )
    }
}

impl Connection {
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The authenticated peer. Handles are only handed out after the handshake.
    pub fn peer(&self) -> Identity {
        *self
            .shared
            .peer
            .get()
            .expect("handles are handed out only after authentication")
    }

    pub fn peer_addr(&self) -> SocketAddr {
        self.shared.peer_addr
    }

    pub fn state(&self) -> &'static str {
        state_name(self.shared.state.load(Relaxed))
    }

    pub fn is_open(&self) -> bool {
        self.shared.state.load(Relaxed) == STATE_OPEN
    }

    pub(crate) fn payload_max(&self) -> u32 {
        self.shared.payload_max
    }

    fn check_open(&self) -> Result<()> {
        let s = self.shared.state.load(Relaxed);
        if s != STATE_OPEN {
            return Err(Error::NotConnected {
                peer: self.shared.peer_addr,
                state: state_name(s),
            });
        }
        Ok(())
    }

    pub(crate) fn post_frame(&self, frame: OutFrame) {
        self.shared.mailbox.post(Cmd::Send {
            slot: self.shared.slot,
            gen: self.shared.gen,
            frame,
        });
    }

    /// Send a one-way message. Fails at once when the connection is not open; once queued it is
    /// delivered unless the connection drops first (there is no acknowledgement).
    pub fn send_oneway(&self, msg: OutMessage) -> Result<()> {
        self.check_open()?;
        self.post_frame(OutFrame::build(
            FrameKind::OneWay,
            0,
            0,
            msg,
            self.shared.payload_max,
        )?);
        Ok(())
    }

    /// Send a request; `on_reply` runs on the owning worker with the reply, a timeout, or the
    /// error that ended the connection. It is called exactly once (also on errors found here).
    pub fn request_with(
        &self,
        msg: OutMessage,
        timeout: Duration,
        on_reply: impl FnOnce(Result<Reply>) + Send + 'static,
    ) {
        if let Err(e) = self.check_open() {
            return on_reply(Err(e));
        }
        let txn = self.shared.next_txn.fetch_add(1, Relaxed);
        match OutFrame::build(FrameKind::Request, 0, txn, msg, self.shared.payload_max) {
            Ok(frame) => self.shared.mailbox.post(Cmd::Request {
                conn: self.shared.clone(),
                txn,
                frame,
                timeout,
                on_reply: Box::new(on_reply),
            }),
            Err(e) => on_reply(Err(e)),
        }
    }

    /// Send a request and wait for its reply, its timeout, or the end of the connection.
    /// Not on a worker thread (inline handler, reply callback, timer): that would deadlock.
    pub fn request(&self, msg: OutMessage, timeout: Duration) -> Result<Reply> {
        assert_not_on_worker("Connection::request");
        let (tx, rx) = crossbeam::channel::bounded(1);
        self.request_with(msg, timeout, move |r| {
            let _ = tx.send(r);
        });
        // The worker always answers (reply, timeout timer, connection loss or shutdown); a
        // disconnected channel means the worker is gone.
        rx.recv().unwrap_or(Err(Error::Shutdown))
    }

    /// Close the connection (no reconnect). Pending requests fail.
    pub fn close(&self) {
        self.shared.mailbox.post(Cmd::Close {
            slot: self.shared.slot,
            gen: self.shared.gen,
        });
    }
}
