//! What applications send and receive, and the dispatcher interface.

use std::sync::Arc;

use crate::auth::Identity;
use crate::conn::Connection;
use crate::error::{Error, Result};
use crate::frame::{FrameKind, Header, HEADER_SIZE, TRAILER_SIZE};
use crate::pool::Payload;
use crate::throttle::Hold;

/// One piece of an outgoing payload. Pieces go to the socket with vectored writes straight from
/// these buffers; nothing is copied into a send buffer.
pub enum SendBuf {
    Vec(Vec<u8>),
    Static(&'static [u8]),
    Shared(Arc<dyn AsRef<[u8]> + Send + Sync>),
    /// Forward received bytes without copying.
    Payload(Payload),
    /// Bytes sent by address: memory the messenger must not form a Rust reference to (a DMA
    /// buffer a device read into), or whose owner knows its checksum better (a shared reply
    /// buffer whose crc is computed once). The address goes to `writev`; the checksum comes
    /// from [`RawBytes`].
    Raw(Box<dyn RawBytes>),
}

/// A region sent by address only (see [`SendBuf::Raw`]).
///
/// # Safety
/// The region [`raw`](RawBytes::raw) describes must be valid for reads, and unchanged, for as
/// long as the object lives: nothing (no device either) writes it meanwhile.
pub unsafe trait RawBytes: Send + Sync {
    /// (address, length) of the region.
    fn raw(&self) -> (*const u8, usize);
    /// CRC-32C of the region continued from `crc`, as [`crate::checksum::crc32c_append`].
    fn crc32c_append(&self, crc: u32) -> u32;
}

impl SendBuf {
    fn slice(&self) -> Option<&[u8]> {
        match self {
            SendBuf::Vec(v) => Some(v),
            SendBuf::Static(s) => Some(s),
            SendBuf::Shared(a) => Some((**a).as_ref()),
            SendBuf::Payload(p) => Some(p),
            SendBuf::Raw(_) => None,
        }
    }

    /// (address, length) of the bytes, for `writev`.
    pub(crate) fn raw(&self) -> (*const u8, usize) {
        match (self, self.slice()) {
            (_, Some(s)) => (s.as_ptr(), s.len()),
            (SendBuf::Raw(r), None) => r.raw(),
            (_, None) => unreachable!("only raw buffers have no slice"),
        }
    }

    pub fn len(&self) -> usize {
        self.raw().1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// CRC-32C of the bytes continued from `crc`.
    pub fn crc32c_append(&self, crc: u32) -> u32 {
        match (self, self.slice()) {
            (_, Some(s)) => crate::checksum::crc32c_append(crc, s),
            (SendBuf::Raw(r), None) => r.crc32c_append(crc),
            (_, None) => unreachable!("only raw buffers have no slice"),
        }
    }

    /// The bytes of `parts`, joined into one vector (an in-process delivery, say).
    pub fn concat(parts: &[SendBuf]) -> Vec<u8> {
        let mut out = Vec::with_capacity(parts.iter().map(SendBuf::len).sum());
        for p in parts {
            p.append_to(&mut out);
        }
        out
    }

    /// Append a copy of the bytes to `out`.
    pub fn append_to(&self, out: &mut Vec<u8>) {
        if let Some(s) = self.slice() {
            out.extend_from_slice(s);
            return;
        }
        let (ptr, len) = self.raw();
        out.reserve(len);
        // SAFETY: RawBytes promises `len` readable, unchanging bytes at `ptr` while `self`
        // lives; `out` has room for them after its length (reserved above), a distinct
        // allocation, and they are initialised once copied.
        unsafe {
            std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr().add(out.len()), len);
            out.set_len(out.len() + len);
        }
    }
}

impl From<Vec<u8>> for SendBuf {
    fn from(v: Vec<u8>) -> SendBuf {
        SendBuf::Vec(v)
    }
}
impl From<&'static [u8]> for SendBuf {
    fn from(s: &'static [u8]) -> SendBuf {
        SendBuf::Static(s)
    }
}
impl From<Arc<[u8]>> for SendBuf {
    fn from(a: Arc<[u8]>) -> SendBuf {
        SendBuf::Shared(Arc::new(a))
    }
}
impl From<Arc<Vec<u8>>> for SendBuf {
    fn from(a: Arc<Vec<u8>>) -> SendBuf {
        SendBuf::Shared(a)
    }
}
impl From<Payload> for SendBuf {
    fn from(p: Payload) -> SendBuf {
        SendBuf::Payload(p)
    }
}

/// An outgoing message: an application type and a payload made of one or more buffers.
pub struct OutMessage {
    pub msg_type: u16,
    pub parts: Vec<SendBuf>,
}

impl OutMessage {
    pub fn new(msg_type: u16, payload: impl Into<SendBuf>) -> OutMessage {
        OutMessage {
            msg_type,
            parts: vec![payload.into()],
        }
    }

    pub fn empty(msg_type: u16) -> OutMessage {
        OutMessage {
            msg_type,
            parts: Vec::new(),
        }
    }

    /// Append another buffer to the payload (e.g. an op header then the data).
    pub fn with_part(mut self, part: impl Into<SendBuf>) -> OutMessage {
        self.parts.push(part.into());
        self
    }

    pub fn len(&self) -> usize {
        self.parts.iter().map(SendBuf::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A frame ready for the socket: encoded header, the caller's buffers, encoded trailer.
pub(crate) struct OutFrame {
    pub header: [u8; HEADER_SIZE],
    pub parts: Vec<SendBuf>,
    pub trailer: [u8; TRAILER_SIZE],
    pub len: usize,
}

impl OutFrame {
    /// Build a frame; the payload crc is computed here, on the sending thread, not the worker.
    pub fn build(
        kind: FrameKind,
        flags: u16,
        txn: u64,
        msg: OutMessage,
        payload_max: u32,
    ) -> Result<OutFrame> {
        let len = msg.len();
        if len > payload_max as usize {
            return Err(Error::PayloadTooLarge {
                len: len as u64,
                max: payload_max,
            });
        }
        let crc = msg.parts.iter().fold(0, |c, p| p.crc32c_append(c));
        let header = Header {
            kind,
            flags,
            txn,
            payload_len: len as u32,
            msg_type: msg.msg_type,
        };
        Ok(OutFrame {
            header: header.encode(),
            parts: msg.parts,
            trailer: crc.to_le_bytes(),
            len: header.frame_len(),
        })
    }

    pub fn handshake(kind: FrameKind, payload: Vec<u8>) -> OutFrame {
        let header = crate::auth::handshake_header(kind, payload.len());
        let trailer = crate::checksum::crc32c(&payload).to_le_bytes();
        OutFrame {
            header: header.encode(),
            len: header.frame_len(),
            parts: vec![SendBuf::Vec(payload)],
            trailer,
        }
    }
}

/// A reply to a request.
#[derive(Debug)]
pub struct Reply {
    pub msg_type: u16,
    pub payload: Payload,
}

/// Called with the outcome of a request, on the worker thread that owns the connection: keep it
/// short (hand work to another thread if it is not).
pub type ReplyFn = Box<dyn FnOnce(Result<Reply>) + Send>;

/// Throttle capacity a received message holds until it is dropped.
pub(crate) struct Ticket {
    pub _conn: Hold,
    pub _global: Hold,
}

/// A received request or one-way message. It holds throttle capacity (per connection and per
/// peer class) until it is dropped: keep it only as long as the work needs it.
pub struct Incoming {
    pub(crate) conn: Connection,
    pub(crate) msg_type: u16,
    pub(crate) payload: Payload,
    pub(crate) responder: Option<Responder>,
    pub(crate) _ticket: Option<Ticket>,
    /// How long the connection waited for throttle capacity before this message was read.
    pub(crate) throttled: Option<std::time::Duration>,
    /// CRC-32C of the payload, verified against the frame's trailer.
    pub(crate) payload_crc: u32,
}

impl Incoming {
    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    pub fn peer(&self) -> Identity {
        self.conn.peer()
    }

    pub fn msg_type(&self) -> u16 {
        self.msg_type
    }

    /// The payload bytes, in a pooled receive buffer (no copy was made).
    pub fn payload(&self) -> &Payload {
        &self.payload
    }

    /// CRC-32C of the whole payload, which the receiving worker summed and checked against
    /// the frame's trailer: a handler can check that CRCs the sender listed for parts of the
    /// payload describe them (`checksum::crc32c_combine`) without summing those bytes again.
    pub fn payload_crc(&self) -> u32 {
        self.payload_crc
    }

    pub fn is_request(&self) -> bool {
        self.responder.is_some()
    }

    /// How long its connection stopped reading for throttle capacity before this message
    /// was admitted; `None` when it was not throttled.
    pub fn throttled(&self) -> Option<std::time::Duration> {
        self.throttled
    }

    /// The reply handle of a request (to reply later or from elsewhere). `None` for one-way
    /// messages, or when already taken.
    pub fn take_responder(&mut self) -> Option<Responder> {
        self.responder.take()
    }

    /// Reply to this request now. Replying to a one-way message is a programmer error.
    pub fn reply(&mut self, msg: OutMessage) -> Result<()> {
        self.responder
            .take()
            .expect("reply to a message that is not a request (or twice)")
            .reply(msg)
    }
}

/// The right to answer one request. Replies travel through the worker that owns the
/// connection. Dropped without replying, it tells the requester the request was abandoned so it
/// does not wait for its timeout.
pub struct Responder {
    pub(crate) conn: Connection,
    pub(crate) txn: u64,
    pub(crate) done: bool,
}

impl Responder {
    pub fn reply(mut self, msg: OutMessage) -> Result<()> {
        self.done = true;
        let frame = OutFrame::build(FrameKind::Reply, 0, self.txn, msg, self.conn.payload_max())?;
        self.conn.post_frame(frame);
        Ok(())
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.done {
            let frame = OutFrame::build(
                FrameKind::Reply,
                crate::frame::FLAG_REPLY_ABANDONED,
                self.txn,
                OutMessage::empty(0),
                u32::MAX,
            )
            .expect("empty reply fits");
            self.conn.post_frame(frame);
        }
    }
}

/// Where received requests and one-way messages go.
///
/// `handle` runs on a handler thread, fed over a crossbeam channel; messages of one connection
/// always go to the same handler thread, so they are handled in the order they were sent. A
/// message type for which `runs_inline` is true is handled right on the worker thread instead:
/// only for work that is cheap and never blocks (it delays every other connection of that
/// worker).
///
/// A panic in `handle` on a handler thread drops that message (a request is answered as
/// abandoned); a panic in code running on a worker (inline handlers, `connected`,
/// `disconnected`, reply callbacks, timers) aborts the process.
pub trait Dispatcher: Send + Sync + 'static {
    fn handle(&self, msg: Incoming);

    fn runs_inline(&self, _msg_type: u16) -> bool {
        false
    }

    /// A connection finished its handshake (runs on the worker thread).
    fn connected(&self, _conn: &Connection) {}

    /// A connection closed; its pending requests have been failed (runs on the worker thread).
    fn disconnected(&self, _conn: &Connection, _reason: &Error) {}
}
