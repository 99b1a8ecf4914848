//! nvstore's messenger: every client↔node and node↔node message goes through it.
//!
//! * **Event loop** ([`worker`]): N threads `msgr-worker-N`, each with its own epoll set,
//!   connections and timer heap. After activity a worker busy-polls for a bounded window, then
//!   sleeps until its next timer. The sleep is computed in nanoseconds and **floored**
//!   ([`sys::sleep_timeout`]): it is never zero while nothing is ready, which is what turned a
//!   sub-microsecond timer into a 100 % CPU spin in the incident this crate exists to avoid.
//! * **Frames** ([`frame`]): a 32-byte `#[repr(C)]` header with its own crc32c, the payload, a
//!   payload crc32c. Payloads go out with vectored writes straight from the caller's buffers
//!   and come in as zero-copy views of pooled buffers ([`pool`]).
//! * **Authentication** ([`auth`]): a cluster secret and a mutual HMAC-SHA256
//!   challenge–response that binds the peer's identity (`client.N` / `node.N`).
//! * **Throttles** ([`throttle`]): caps on received messages and bytes in flight, per connection
//!   and per peer class; a connection at the cap stops being read until capacity is released —
//!   a wake, never a retry loop.
//! * **API** ([`Messenger`], [`Connection`], [`Dispatcher`]): requests with timeouts, one-way
//!   messages, replies through the owning worker, reconnect with backoff.
//!
//! Byte layouts: docs/format.md, "Messenger". Data flow: docs/architecture.md, "messenger".

pub mod auth;
pub mod checksum;
pub mod conn;
pub mod error;
pub mod frame;
pub mod message;
pub mod messenger;
pub mod pool;
pub mod stats;
pub mod sys;
pub mod throttle;
mod timer;
pub mod worker;

pub use auth::{Identity, Secret};
pub use conn::Connection;
pub use error::{AuthFailure, Error, Result, Violation};
pub use message::{Dispatcher, Incoming, OutMessage, RawBytes, Reply, Responder, SendBuf};
pub use messenger::{Config, Messenger};
pub use pool::{BufPool, Payload, RecvBuf};
pub use stats::{MessengerStats, WorkerStats};
pub use throttle::{ThrottleLimits, ThrottleStats};
pub use timer::UserTimer;
