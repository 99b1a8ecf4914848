//! The messenger: configuration, worker and handler threads, and the public entry points.

use std::net::{SocketAddr, TcpListener};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::error;

use crate::auth::{Identity, Secret};
use crate::conn::{Cmd, Connection, Mailbox};
use crate::error::{Error, Result};
use crate::frame::PAYLOAD_BYTES_LIMIT;
use crate::message::{Dispatcher, Incoming, OutMessage, Reply};
use crate::pool::BufPool;
use crate::stats::{MessengerStats, WorkerCounters};
use crate::throttle::{Throttle, ThrottleCounters, ThrottleLimits};
use crate::worker::{Shared, Worker};

/// The smallest sleep floor accepted. A zero floor is the incident's bug and is refused.
pub const SLEEP_FLOOR_MIN: Duration = Duration::from_micros(1);
/// Longest busy-poll window accepted: polling is for the gap between a request and its reply,
/// not a way to never sleep.
pub const BUSY_POLL_MAX: Duration = Duration::from_millis(10);

/// Messenger settings. `Config::default()` suits a storage node.
#[derive(Debug, Clone)]
pub struct Config {
    /// Worker threads (`msgr-worker-N`), each with its own epoll set and connections.
    pub workers: usize,
    /// Handler threads (`msgr-handler-N`) for messages not handled inline. 0: every message is
    /// handled inline on its worker.
    pub handler_threads: usize,
    /// After socket or mailbox activity, keep polling without sleeping this long.
    pub busy_poll: Duration,
    /// The shortest sleep when nothing is ready; a timer due sooner fires up to this late.
    pub sleep_floor: Duration,
    /// Largest payload accepted or sent (at most 64 MiB).
    pub payload_bytes_max: u32,
    /// Cap per connection on received requests/one-way messages in flight.
    pub conn_throttle: ThrottleLimits,
    /// Cap over all connections from `client.N` peers.
    pub client_throttle: ThrottleLimits,
    /// Cap over all connections from `node.N` peers.
    pub node_throttle: ThrottleLimits,
    /// Connect plus handshake, for outgoing connections.
    pub connect_timeout: Duration,
    /// Handshake, for accepted connections.
    pub handshake_timeout: Duration,
    pub reconnect_backoff_min: Duration,
    pub reconnect_backoff_max: Duration,
    /// Bytes read from one connection per loop pass before moving on to the others.
    pub read_budget_bytes: usize,
    /// epoll events fetched per wait.
    pub events_per_wait: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            workers: 2,
            handler_threads: 2,
            busy_poll: Duration::from_micros(50),
            sleep_floor: Duration::from_micros(50),
            payload_bytes_max: 16 << 20,
            conn_throttle: ThrottleLimits {
                messages_max: 128,
                bytes_max: 64 << 20,
            },
            // The OSD cap from the incident: 256 client messages.
            client_throttle: ThrottleLimits {
                messages_max: 256,
                bytes_max: 256 << 20,
            },
            node_throttle: ThrottleLimits {
                messages_max: 1024,
                bytes_max: 512 << 20,
            },
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            reconnect_backoff_min: Duration::from_millis(10),
            reconnect_backoff_max: Duration::from_secs(2),
            read_budget_bytes: 1 << 20,
            events_per_wait: 256,
        }
    }
}

impl Config {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.workers == 0 || self.workers > 1024 {
            return bad(format!("workers = {} (1..=1024)", self.workers));
        }
        if self.sleep_floor < SLEEP_FLOOR_MIN {
            return bad(format!(
                "sleep_floor = {:?}: at least {SLEEP_FLOOR_MIN:?}; a zero floor spins",
                self.sleep_floor
            ));
        }
        if self.busy_poll > BUSY_POLL_MAX {
            return bad(format!(
                "busy_poll = {:?}: at most {BUSY_POLL_MAX:?}",
                self.busy_poll
            ));
        }
        if self.payload_bytes_max == 0 || self.payload_bytes_max > PAYLOAD_BYTES_LIMIT {
            return bad(format!(
                "payload_bytes_max = {} (1..={PAYLOAD_BYTES_LIMIT})",
                self.payload_bytes_max
            ));
        }
        for (name, t) in [
            ("conn", self.conn_throttle),
            ("client", self.client_throttle),
            ("node", self.node_throttle),
        ] {
            if t.messages_max == 0 || t.bytes_max == 0 {
                return bad(format!("{name}_throttle caps must be at least 1"));
            }
        }
        if self.reconnect_backoff_min.is_zero()
            || self.reconnect_backoff_max < self.reconnect_backoff_min
        {
            return bad("reconnect backoff: 0 < min <= max".into());
        }
        if self.read_budget_bytes == 0 || self.events_per_wait == 0 {
            return bad("read_budget_bytes and events_per_wait must be at least 1".into());
        }
        Ok(())
    }
}

/// A messenger endpoint: listens, connects, sends, and dispatches what arrives.
pub struct Messenger {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    handlers: Mutex<Vec<JoinHandle<()>>>,
}

impl Messenger {
    /// Start the worker and handler threads. `identity` is who this endpoint is; `secret` the
    /// cluster key every peer must hold.
    pub fn new(
        config: Config,
        identity: Identity,
        secret: Secret,
        dispatcher: Arc<dyn Dispatcher>,
    ) -> Result<Messenger> {
        config.validate()?;
        let mailboxes = (0..config.workers)
            .map(|_| Mailbox::new().map(Arc::new))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::io("eventfd", e))?;
        let shared = Arc::new(Shared {
            client_throttle: Throttle::new(
                config.client_throttle,
                Arc::new(ThrottleCounters::default()),
            ),
            node_throttle: Throttle::new(
                config.node_throttle,
                Arc::new(ThrottleCounters::default()),
            ),
            conn_counters: Arc::new(ThrottleCounters::default()),
            counters: (0..config.workers)
                .map(|_| Arc::new(WorkerCounters::default()))
                .collect(),
            mailboxes,
            next_worker: AtomicUsize::new(0),
            next_conn_id: AtomicU64::new(1),
            pool: BufPool::new(),
            config,
            identity,
            secret,
            dispatcher,
        });
        let (lanes, rxs): (Vec<_>, Vec<_>) = (0..shared.config.handler_threads)
            .map(|_| crossbeam::channel::unbounded::<Incoming>())
            .unzip();
        let mut handlers = Vec::new();
        for (i, rx) in rxs.into_iter().enumerate() {
            let d = shared.dispatcher.clone();
            let h = std::thread::Builder::new()
                .name(format!("msgr-handler-{i}"))
                .spawn(move || {
                    for m in rx {
                        // A panicking handler loses its message (a request is answered as
                        // abandoned when the Incoming is dropped); the thread carries on.
                        if catch_unwind(AssertUnwindSafe(|| d.handle(m))).is_err() {
                            error!("msgr-handler-{i}: handler panicked; message dropped");
                        }
                    }
                })
                .map_err(|e| Error::io("spawn handler thread", e))?;
            handlers.push(h);
        }
        let mut workers = Vec::new();
        let (ready_tx, ready_rx) = crossbeam::channel::bounded(shared.config.workers);
        for i in 0..shared.config.workers {
            let w =
                Worker::new(i, shared.clone(), lanes.clone()).map_err(|e| Error::io("epoll", e))?;
            let ready = ready_tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("msgr-worker-{i}"))
                .spawn(move || {
                    // A worker that panicked (in its own code, an inline handler or a reply
                    // callback) cannot go on with half-updated connection state, and callers
                    // waiting on it would hang: stop the process, as an assertion failure would.
                    if catch_unwind(AssertUnwindSafe(|| w.run_with_ready(ready))).is_err() {
                        error!("msgr-worker-{i} panicked; aborting");
                        std::process::abort();
                    }
                })
                .map_err(|e| Error::io("spawn worker thread", e))?;
            workers.push(h);
        }
        drop(lanes);
        for _ in 0..shared.config.workers {
            ready_rx.recv().expect("worker thread started");
        }
        Ok(Messenger {
            shared,
            workers: Mutex::new(workers),
            handlers: Mutex::new(handlers),
        })
    }

    pub fn identity(&self) -> Identity {
        self.shared.identity
    }

    /// Listen on `addr` (port 0 picks one); returns the bound address. Accepted connections are
    /// spread over the workers.
    pub fn listen(&self, addr: SocketAddr) -> Result<SocketAddr> {
        let l = TcpListener::bind(addr).map_err(|e| Error::io("bind", e))?;
        l.set_nonblocking(true)
            .map_err(|e| Error::io("listener nonblocking", e))?;
        let local = l
            .local_addr()
            .map_err(|e| Error::io("listener address", e))?;
        let mb = &self.shared.mailboxes[self.shared.pick_worker()];
        if mb.is_closed() {
            return Err(Error::Shutdown);
        }
        mb.post(Cmd::Listen(l));
        Ok(local)
    }

    /// Connect to `peer` at `addr` and authenticate both ways; returns once the handshake is
    /// done (or failed, or `connect_timeout` passed). The connection reconnects with backoff
    /// whenever it drops afterwards, until closed.
    /// Blocks: not on a worker thread.
    pub fn connect(&self, addr: SocketAddr, peer: Identity) -> Result<Connection> {
        crate::conn::assert_not_on_worker("Messenger::connect");
        let (done, rx) = crossbeam::channel::bounded(1);
        let w = self.shared.pick_worker();
        self.shared.mailboxes[w].post(Cmd::Connect { addr, peer, done });
        rx.recv().unwrap_or(Err(Error::Shutdown))
    }

    /// Send a request and wait for the reply (or the timeout, or the connection's end).
    pub fn send_request(
        &self,
        conn: &Connection,
        msg: OutMessage,
        timeout: Duration,
    ) -> Result<Reply> {
        conn.request(msg, timeout)
    }

    /// Send a request; `on_reply` runs on the connection's worker (see
    /// [`Connection::request_with`]).
    pub fn send_request_with(
        &self,
        conn: &Connection,
        msg: OutMessage,
        timeout: Duration,
        on_reply: impl FnOnce(Result<Reply>) + Send + 'static,
    ) {
        conn.request_with(msg, timeout, on_reply)
    }

    pub fn send_oneway(&self, conn: &Connection, msg: OutMessage) -> Result<()> {
        conn.send_oneway(msg)
    }

    /// Run `f` on worker `worker` after `delay`; when it returns `Some(d)` it runs again `d`
    /// later. For periodic work (heartbeats, scrubs) that belongs with a worker's connections.
    pub fn schedule_timer(
        &self,
        worker: usize,
        delay: Duration,
        f: impl FnMut() -> Option<Duration> + Send + 'static,
    ) {
        let mb = &self.shared.mailboxes[worker % self.shared.mailboxes.len()];
        mb.post(Cmd::Timer {
            delay,
            timer: Box::new(f),
        });
    }

    /// The pool receive buffers come from: a caller building a large outgoing payload (a
    /// primary's parity shards) can take one that the last receive or send returned, already
    /// faulted in, instead of allocating and zeroing a fresh one. Its bytes are whatever the
    /// last user left: write every byte you publish.
    pub fn buf_pool(&self) -> &BufPool {
        &self.shared.pool
    }

    pub fn stats(&self) -> MessengerStats {
        let s = &self.shared;
        MessengerStats {
            workers: s.counters.iter().map(|c| c.snapshot()).collect(),
            client_throttle: s.client_throttle.counters().snapshot(),
            node_throttle: s.node_throttle.counters().snapshot(),
            conn_throttles: s.conn_counters.snapshot(),
            pool: s.pool.stats(),
        }
    }

    /// Kernel thread ids of the workers, in worker order.
    pub fn worker_tids(&self) -> Vec<i32> {
        self.stats().workers.iter().map(|w| w.tid).collect()
    }

    /// Close every connection (pending requests fail with [`Error::Shutdown`]) and stop the
    /// threads. Idempotent; also done on drop.
    pub fn shutdown(&self) {
        for mb in &self.shared.mailboxes {
            mb.post(Cmd::Shutdown);
        }
        for h in self.workers.lock().expect("workers lock").drain(..) {
            let _ = h.join();
        }
        // The workers held the only senders of the handler lanes: handlers finish what is
        // queued and exit.
        for h in self.handlers.lock().expect("handlers lock").drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Messenger {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_and_a_zero_floor_is_refused() {
        Config::default().validate().unwrap();
        let zero = Config {
            sleep_floor: Duration::ZERO,
            ..Config::default()
        };
        assert!(matches!(zero.validate(), Err(Error::Config(m)) if m.contains("sleep_floor")));
        let spin = Config {
            busy_poll: Duration::from_secs(1),
            ..Config::default()
        };
        assert!(spin.validate().is_err());
        let big = Config {
            payload_bytes_max: PAYLOAD_BYTES_LIMIT + 1,
            ..Config::default()
        };
        assert!(big.validate().is_err());
    }
}
