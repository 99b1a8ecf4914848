//! The `nvstore` package's one error type.

use crate::wire::Status;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Messenger(#[from] messenger::Error),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Ec(#[from] ec::Error),
    #[error(transparent)]
    Device(#[from] driver::Error),
    /// A configuration file or value is wrong.
    #[error("configuration: {0}")]
    Config(String),
    /// A peer sent bytes that do not decode as the message they claim to be.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The peer answered with an error status.
    #[error("{status}: {message}")]
    Remote { status: Status, message: String },
    /// No monitor answered, or no leader could be found.
    #[error("monitor: {0}")]
    Monitor(String),
    /// A wait ran out.
    #[error("timed out after {secs:.1} s: {what}")]
    Timeout { what: String, secs: f64 },
    /// Internal to a node: reading shard `.0` failed (it is read around when possible).
    #[error("shard {0}: {1}")]
    FetchFailed(usize, Box<Error>),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn remote(status: Status, message: impl Into<String>) -> Error {
        Error::Remote {
            status,
            message: message.into(),
        }
    }

    pub fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// The text a reply carries (the status travels separately).
    pub fn message(&self) -> String {
        match self {
            Error::Remote { message, .. } => message.clone(),
            e => e.to_string(),
        }
    }

    /// The status a node reports for this error.
    pub fn status(&self) -> Status {
        match self {
            Error::Remote { status, .. } => *status,
            Error::Store(store::StoreError::NotFound(_)) => Status::NotFound,
            Error::Store(store::StoreError::VersionMismatch { .. }) => Status::VersionMismatch,
            Error::Store(store::StoreError::TooLarge { .. }) => Status::TooLarge,
            Error::Store(store::StoreError::Invalid(_)) => Status::Invalid,
            Error::Store(store::StoreError::NoXattr { .. }) => Status::NoXattr,
            Error::Store(store::StoreError::OutOfSpace { .. }) => Status::NoSpace,
            Error::Store(store::StoreError::Corrupted { .. }) => Status::Corrupted,
            Error::Malformed(_) => Status::Malformed,
            Error::Timeout { .. } => Status::TimedOut,
            Error::FetchFailed(_, e) => e.status(),
            _ => Status::Io,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
