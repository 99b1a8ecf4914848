//! The receive path: reading into pooled buffers, decoding frames, admission through the
//! throttles, and delivery (handshake, dispatcher, reply callbacks).

use super::*;

/// A large frame received into a buffer of its own.
pub(super) struct LargeRx {
    pub(super) header: Header,
    pub(super) buf: RecvBuf,
    pub(super) trailer: [u8; TRAILER_SIZE],
    pub(super) trailer_have: usize,
    /// crc32c of the payload bytes received so far, computed while they are hot in cache.
    pub(super) crc: u32,
}

impl LargeRx {
    pub(super) fn payload_missing(&self) -> usize {
        self.header.payload_len as usize - self.buf.filled()
    }

    pub(super) fn complete(&self) -> bool {
        self.payload_missing() == 0 && self.trailer_have == TRAILER_SIZE
    }
}

pub(super) struct Rx {
    /// The shared receive chunk; `None` while the connection has nothing buffered, so an idle
    /// connection holds no receive memory.
    pub(super) chunk: Option<RecvBuf>,
    /// First unparsed byte of `chunk`.
    pub(super) start: usize,
    pub(super) large: Option<LargeRx>,
}

impl Rx {
    pub(super) fn new() -> Rx {
        Rx {
            chunk: None,
            start: 0,
            large: None,
        }
    }

    /// The received, unparsed bytes of the chunk.
    pub(super) fn unparsed(&self) -> &[u8] {
        self.chunk.as_ref().map_or(&[], |c| &c.data()[self.start..])
    }

    pub(super) fn buffered(&self) -> usize {
        self.unparsed().len()
    }

    /// A zero-copy view of `len` unparsed bytes from `offset` (relative to the unparsed start).
    fn freeze(&self, offset: usize, len: usize) -> Payload {
        self.chunk
            .as_ref()
            .expect("bytes are buffered")
            .freeze(self.start + offset, len)
    }

    /// Give the chunk back when nothing is buffered (its payloads keep it alive until dropped).
    pub(super) fn release_if_idle(&mut self) {
        if self.large.is_none() && self.buffered() == 0 {
            self.chunk = None;
            self.start = 0;
        }
    }

    pub(super) fn discard(&mut self) {
        self.large = None;
        self.chunk = None;
        self.start = 0;
    }
}

/// Flow of parsing buffered bytes.
pub(super) enum Flow {
    NeedBytes,
    Paused,
}

impl Worker {
    // ---- receive ----------------------------------------------------------------------------

    pub(super) fn payload_limit(&self, c: &Conn) -> u32 {
        match c.phase {
            Phase::Open => self.ctx.shared.config.payload_bytes_max,
            _ => HANDSHAKE_PAYLOAD_BYTES_MAX,
        }
    }

    /// Parse what is buffered, then read more, until the socket is drained, the per-pass budget
    /// is spent, or the connection is paused.
    pub(super) fn read_conn(&mut self, c: &mut Conn) -> Result<(), Close> {
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
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    c.rx.release_if_idle();
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Close::Io(e)),
            }
        }
    }

    pub(super) fn end_of_stream(&self, c: &Conn) -> Close {
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
            let want =
                c.rx.unparsed()
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
    pub(super) fn read_some(&mut self, c: &mut Conn) -> io::Result<usize> {
        make_room(&self.ctx.shared.pool, &mut c.rx);
        let sock = c
            .sock
            .as_mut()
            .expect("reading a connection without a socket");
        let Rx { chunk, large, .. } = &mut c.rx;
        let chunk = chunk.as_mut().expect("make_room provides a chunk");
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
    pub(super) fn parse(&mut self, c: &mut Conn) -> Result<Flow, Close> {
        loop {
            if let Some(l) = &c.rx.large {
                if !l.complete() {
                    return Ok(Flow::NeedBytes);
                }
                let l = c.rx.large.take().expect("checked above");
                check_payload_crc(l.crc, l.trailer)?;
                let payload = l.buf.freeze(0, l.header.payload_len as usize);
                self.deliver(c, l.header, payload, l.crc)?;
                continue;
            }
            let avail = c.rx.buffered();
            if avail < HEADER_SIZE {
                return Ok(Flow::NeedBytes);
            }
            let head = *c
                .rx
                .unparsed()
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
            let p0 = HEADER_SIZE;
            if avail >= total {
                let data = c.rx.unparsed();
                let trailer = *data[p0 + plen..]
                    .first_chunk::<TRAILER_SIZE>()
                    .expect("frame complete");
                check_payload(&data[p0..p0 + plen], trailer)?;
                let payload = c.rx.freeze(p0, plen);
                c.rx.start += total;
                self.deliver(c, header, payload, u32::from_le_bytes(trailer))?;
                continue;
            }
            if plen < LARGE_PAYLOAD_BYTES_MIN {
                return Ok(Flow::NeedBytes);
            }
            // A large payload gets a buffer of its own; move what already arrived into it.
            let have = avail - HEADER_SIZE;
            let in_payload = have.min(plen);
            let mut buf = self.ctx.shared.pool.take(plen);
            let data = c.rx.unparsed();
            buf.spare_mut()[..in_payload].copy_from_slice(&data[p0..p0 + in_payload]);
            buf.advance(in_payload);
            let crc = crate::checksum::crc32c(&data[p0..p0 + in_payload]);
            let mut trailer = [0u8; TRAILER_SIZE];
            let in_trailer = have - in_payload;
            trailer[..in_trailer]
                .copy_from_slice(&data[p0 + in_payload..p0 + in_payload + in_trailer]);
            c.rx.start += avail;
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
    pub(super) fn admit(&mut self, c: &mut Conn, header: &Header) -> bool {
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

    pub(super) fn pause(&mut self, c: &mut Conn) -> bool {
        c.paused = true;
        c.paused_at.get_or_insert_with(std::time::Instant::now);
        // Dropping read interest cannot fail in a way we could act on here; a failure shows up
        // on the next epoll_ctl or read.
        let _ = self.apply_interest(c);
        false
    }

    pub(super) fn granted(&mut self, c: &mut Conn, level: Level, hold: Hold) -> Result<(), Close> {
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

    pub(super) fn deliver(
        &mut self,
        c: &mut Conn,
        header: Header,
        payload: Payload,
        payload_crc: u32,
    ) -> Result<(), Close> {
        self.ctx.counters.frames_in.add(1);
        match header.kind {
            FrameKind::Request | FrameKind::OneWay => {
                self.dispatch(c, &header, payload, payload_crc);
                Ok(())
            }
            FrameKind::Reply => {
                self.complete_request(c, &header, payload);
                Ok(())
            }
            _ => self.handshake_frame(c, &header, &payload),
        }
    }

    pub(super) fn dispatch(
        &mut self,
        c: &mut Conn,
        header: &Header,
        payload: Payload,
        payload_crc: u32,
    ) {
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
            throttled: c.paused_at.take().map(|t| t.elapsed()),
            payload_crc,
        };
        let d = &self.ctx.shared.dispatcher;
        if d.runs_inline(header.msg_type) || self.ctx.lanes.is_empty() {
            d.handle(msg);
        } else {
            // A send fails only while shutting down; the message is dropped with its ticket.
            let _ = self.ctx.lanes[c.lane].send(msg);
        }
    }

    pub(super) fn complete_request(&mut self, c: &mut Conn, header: &Header, payload: Payload) {
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

    pub(super) fn handshake_frame(
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

    pub(super) fn established(&mut self, c: &mut Conn, peer: Identity) {
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
}

/// Make sure there is a chunk with room for the next read (and, for a partial small frame, room
/// for the whole frame), moving a partial frame to a fresh chunk when needed.
pub(super) fn make_room(pool: &BufPool, rx: &mut Rx) {
    let pending = rx.buffered();
    let Some(chunk) = rx.chunk.as_mut() else {
        rx.chunk = Some(pool.take(CHUNK_BYTES));
        rx.start = 0;
        return;
    };
    if pending == 0 && chunk.reset_if_unshared() {
        rx.start = 0;
        return;
    }
    let want = match rx.large {
        Some(_) => 0,
        None => rx
            .unparsed()
            .first_chunk::<HEADER_SIZE>()
            .and_then(|h| Header::decode(h, LARGE_PAYLOAD_BYTES_MIN as u32).ok())
            .map_or(HEADER_SIZE, |h| h.frame_len()),
    };
    let chunk = rx.chunk.as_ref().expect("checked above");
    let spare = chunk.capacity() - chunk.filled();
    if spare >= READ_MIN_BYTES && rx.start + want <= chunk.capacity() {
        return;
    }
    let mut fresh = pool.take(CHUNK_BYTES);
    fresh.spare_mut()[..pending].copy_from_slice(rx.unparsed());
    fresh.advance(pending);
    rx.chunk = Some(fresh);
    rx.start = 0;
}
