//! The error type shared by the lighthouse, the manager and their clients.
//!
//! Exactly one conversion to `tonic::Status` lives here (and one back, for clients); the
//! conversion to Python exceptions lives in `bindings`.

use std::time::Duration;

use tonic::{Code, Status};

/// Everything that can go wrong in the torchft core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request or argument was malformed; nothing was changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The caller's deadline passed before an answer was ready.
    #[error("timed out: {0}")]
    Timeout(String),
    /// A peer could not be reached within the connect timeout.
    #[error("could not connect to {addr}: {reason}")]
    Connect {
        /// The address that was dialled.
        addr: String,
        /// Why the last attempt failed.
        reason: String,
    },
    /// The request was valid but the state of the round refuses it (e.g. a step mismatch).
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// A peer we depend on (e.g. the lighthouse) failed or is unavailable.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The caller did not present the shared secret, or presented a wrong one; nothing was
    /// changed.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The replica groups' committed states differ with no majority to say which is right
    /// (runtime state parity): the group must stop training.
    #[error("replica state diverged: {0}")]
    Diverged(String),
    /// The server is shutting down.
    #[error("server is shutting down")]
    Shutdown,
    /// Any other failure reported by a remote peer.
    #[error("{0}")]
    Remote(String),
}

/// Result alias for the torchft core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns `Err(Error::InvalidArgument(format!(..)))` from the enclosing function unless the
/// condition holds: one line per argument check, the message formatted only on failure.
macro_rules! ensure {
    ($ok:expr, $($message:tt)+) => {
        if !$ok {
            return Err($crate::error::Error::InvalidArgument(format!($($message)+)));
        }
    };
}
pub(crate) use ensure;

impl Error {
    /// A timeout error naming what was being waited for and for how long.
    pub fn timeout(what: &str, after: Duration) -> Self {
        Error::Timeout(format!("{what} did not complete within {after:?}"))
    }

    /// True if this error means a deadline expired (maps to Python `TimeoutError`).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout(_))
    }
}

impl Error {
    /// The message without the kind prefix (the gRPC status code already carries the kind,
    /// and the receiving side adds the prefix back when it converts the status).
    fn detail(&self) -> String {
        match self {
            Error::InvalidArgument(m)
            | Error::Timeout(m)
            | Error::FailedPrecondition(m)
            | Error::Unavailable(m)
            | Error::Unauthenticated(m)
            | Error::Diverged(m)
            | Error::Remote(m) => m.clone(),
            other => other.to_string(),
        }
    }

    /// A copy of this error, so one failure can be delivered to several waiters.
    pub fn duplicate(&self) -> Self {
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
            Error::Timeout(m) => Error::Timeout(m.clone()),
            Error::Connect { addr, reason } => Error::Connect {
                addr: addr.clone(),
                reason: reason.clone(),
            },
            Error::FailedPrecondition(m) => Error::FailedPrecondition(m.clone()),
            Error::Unavailable(m) => Error::Unavailable(m.clone()),
            Error::Unauthenticated(m) => Error::Unauthenticated(m.clone()),
            Error::Diverged(m) => Error::Diverged(m.clone()),
            Error::Shutdown => Error::Shutdown,
            Error::Remote(m) => Error::Remote(m.clone()),
        }
    }

    /// The message without the kind prefix (the kind is kept by a wrapping error).
    pub fn message(&self) -> String {
        self.detail()
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let msg = e.detail();
        match e {
            Error::InvalidArgument(_) => Status::invalid_argument(msg),
            Error::Timeout(_) => Status::deadline_exceeded(msg),
            Error::Connect { .. } | Error::Unavailable(_) | Error::Shutdown => {
                Status::unavailable(msg)
            }
            Error::FailedPrecondition(_) => Status::failed_precondition(msg),
            Error::Unauthenticated(_) => Status::unauthenticated(msg),
            Error::Diverged(_) => Status::data_loss(msg),
            Error::Remote(_) => Status::internal(msg),
        }
    }
}

impl From<Status> for Error {
    fn from(s: Status) -> Self {
        let msg = s.message().to_string();
        match s.code() {
            Code::DeadlineExceeded | Code::Cancelled => Error::Timeout(msg),
            Code::InvalidArgument => Error::InvalidArgument(msg),
            Code::FailedPrecondition => Error::FailedPrecondition(msg),
            Code::Unavailable => Error::Unavailable(msg),
            Code::Unauthenticated => Error::Unauthenticated(msg),
            Code::DataLoss => Error::Diverged(msg),
            code => Error::Remote(format!("{code:?}: {msg}")),
        }
    }
}
