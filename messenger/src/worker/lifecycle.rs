//! Connecting, closing and reconnecting.

use super::*;

impl Worker {
    // ---- connect ----------------------------------------------------------------------------

    pub(super) fn connect(
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

    pub(super) fn start_connect(&mut self, c: &mut Conn) -> Result<(), Close> {
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

    pub(super) fn finish_connect(&mut self, c: &mut Conn) -> Result<(), Close> {
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

    pub(super) fn close_conn(&mut self, mut c: Conn, reason: Close) {
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
        c.paused_at = None;
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

    pub(super) fn schedule_reconnect(&mut self, mut c: Conn) {
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
}
