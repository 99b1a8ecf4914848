//! The messenger crate's one error type, and the data enums that say why a peer was refused.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::auth::Identity;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the messenger reports. Variants about a peer carry its address (and identity once
/// known) so a log line says which connection it was.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The operating system refused an operation (socket, epoll, eventfd, a read or write).
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A configuration value is out of range.
    #[error("invalid messenger configuration: {0}")]
    Config(String),
    /// The cluster secret key file is missing, unreadable, too open or malformed.
    #[error("key file {}: {detail}", path.display())]
    KeyFile { path: PathBuf, detail: String },
    /// A peer sent bytes that break the wire protocol; its connection was closed.
    #[error("{peer}: protocol violation: {violation}")]
    Protocol {
        peer: SocketAddr,
        violation: Violation,
    },
    /// Mutual authentication failed; the connection was closed.
    #[error("{peer}: authentication failed: {reason}")]
    AuthFailed {
        peer: SocketAddr,
        reason: AuthFailure,
    },
    /// A wait ran past its deadline.
    #[error("{peer}: timed out after {after:?} waiting for {what}")]
    Timeout {
        peer: SocketAddr,
        what: &'static str,
        after: Duration,
    },
    /// The connection dropped while this request was pending (the client side reconnects in the
    /// background; the request was not retried).
    #[error("{peer}: connection lost: {reason}")]
    ConnectionLost { peer: SocketAddr, reason: String },
    /// The connection is not established right now (reconnecting, or closed for good).
    #[error("{peer}: not connected ({state})")]
    NotConnected {
        peer: SocketAddr,
        state: &'static str,
    },
    /// The peer's handler dropped the request without replying.
    #[error("{peer} ({identity}): request abandoned by the peer's handler")]
    RequestAbandoned {
        peer: SocketAddr,
        identity: Identity,
    },
    /// A message is larger than the configured maximum frame payload.
    #[error("payload of {len} bytes exceeds the maximum of {max} bytes")]
    PayloadTooLarge { len: u64, max: u32 },
    /// The messenger is shutting down or has shut down.
    #[error("messenger is shut down")]
    Shutdown,
}

impl Error {
    pub(crate) fn io(what: &'static str, source: std::io::Error) -> Error {
        Error::Io { what, source }
    }
}

/// Why a peer's bytes were refused. Data, not an error type: it travels inside
/// [`Error::Protocol`] and in log lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    BadMagic {
        found: u32,
    },
    BadVersion {
        found: u8,
    },
    BadHeaderCrc {
        stored: u32,
        computed: u32,
    },
    BadPayloadCrc {
        stored: u32,
        computed: u32,
    },
    UnknownKind {
        found: u8,
    },
    UnknownFlags {
        kind: u8,
        flags: u16,
    },
    ReservedNonZero,
    Oversized {
        len: u32,
        max: u32,
    },
    /// The peer closed the stream in the middle of a frame.
    Truncated {
        have: usize,
        want: usize,
    },
    /// A frame of a kind that is not allowed in the connection's current phase (for example
    /// anything but the handshake before authentication).
    UnexpectedKind {
        kind: u8,
        phase: &'static str,
    },
    /// A handshake frame of the right kind with the wrong size or content.
    BadHandshake {
        detail: &'static str,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::BadMagic { found } => write!(f, "bad magic {found:#010x}"),
            Violation::BadVersion { found } => write!(f, "unsupported version {found}"),
            Violation::BadHeaderCrc { stored, computed } => {
                write!(
                    f,
                    "bad header crc: stored {stored:#010x}, computed {computed:#010x}"
                )
            }
            Violation::BadPayloadCrc { stored, computed } => {
                write!(
                    f,
                    "bad payload crc: stored {stored:#010x}, computed {computed:#010x}"
                )
            }
            Violation::UnknownKind { found } => write!(f, "unknown frame kind {found}"),
            Violation::UnknownFlags { kind, flags } => {
                write!(f, "unknown flags {flags:#06x} on frame kind {kind}")
            }
            Violation::ReservedNonZero => write!(f, "reserved header bytes are not zero"),
            Violation::Oversized { len, max } => {
                write!(f, "oversized length: payload {len} bytes, maximum {max}")
            }
            Violation::Truncated { have, want } => {
                write!(
                    f,
                    "truncated frame: stream ended after {have} of {want} bytes"
                )
            }
            Violation::UnexpectedKind { kind, phase } => {
                write!(f, "frame kind {kind} not allowed {phase}")
            }
            Violation::BadHandshake { detail } => write!(f, "malformed handshake: {detail}"),
        }
    }
}

/// Why mutual authentication failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthFailure {
    /// The peer's HMAC proof does not verify: it does not hold our cluster secret.
    BadProof,
    /// The peer is not who the connecting side asked for.
    WrongPeer { expected: Identity, found: Identity },
    /// The handshake did not complete in time.
    TimedOut,
    /// The server closed the connection during the handshake (it rejected us).
    ClosedByPeer,
}

impl fmt::Display for AuthFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthFailure::BadProof => write!(f, "HMAC proof does not verify (wrong cluster secret)"),
            AuthFailure::WrongPeer { expected, found } => {
                write!(f, "expected peer {expected}, peer is {found}")
            }
            AuthFailure::TimedOut => write!(f, "handshake timed out"),
            AuthFailure::ClosedByPeer => write!(f, "peer closed the connection during handshake"),
        }
    }
}
