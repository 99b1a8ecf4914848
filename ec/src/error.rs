//! The crate's one error type.

use crate::Backend;

/// What can go wrong at run time. Shape mistakes (wrong shard count, shards of different
/// lengths, an index out of range) are programmer errors and panic with a message instead.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The profile is outside what this crate supports.
    #[error("invalid erasure profile {k}+{m} with a {stripe_unit} B stripe unit: {reason}")]
    InvalidProfile {
        k: usize,
        m: usize,
        stripe_unit: usize,
        reason: &'static str,
    },
    /// The requested backend would execute instructions this CPU does not have.
    #[error("the {backend} backend cannot run on this CPU: it lacks {missing:?}")]
    BackendUnavailable {
        backend: Backend,
        missing: Vec<&'static str>,
    },
    /// More shards are missing than the code tolerates.
    #[error("only {present} shards are present; decoding needs {needed}")]
    TooFewShards { present: usize, needed: usize },
}
