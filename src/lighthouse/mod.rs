//! The lighthouse: decides, per step, which replica groups take part (the quorum).
//!
//! `quorum` is the pure engine (state, now, options → decision); `service` is the gRPC
//! service around it plus the [`LighthouseServer`] that hosts it; `http` the status pages
//! served on the same port; `client` the [`LighthouseClient`]; `daemon` the command-line entry
//! point shared by the `torchft_lighthouse` binary and the Python console script.

use std::time::Duration;

pub mod client;
pub mod compact;
pub mod daemon;
pub mod http;
pub mod hub;
pub mod metrics;
pub mod quorum;
pub mod service;
pub mod telemetry;

pub use client::LighthouseClient;
pub use hub::ObservabilityOptions;
pub use service::LighthouseServer;

/// Tunables of a lighthouse; the defaults match the `torchft_lighthouse` daemon's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LighthouseOptions {
    /// Fewest replica groups a quorum may have; smaller rounds wait.
    pub min_replicas: u64,
    /// How long a round waits, from its first joiner, for healthy stragglers.
    pub join_timeout: Duration,
    /// How often the lighthouse re-evaluates a round (join timeout, heartbeat expiry).
    pub quorum_tick: Duration,
    /// A replica group that has not heartbeated (or asked) for this long is not healthy.
    pub heartbeat_timeout: Duration,
    /// How long a round whose candidates are all behind a replica group that may still come
    /// back (heartbeating, or silent with its session open) waits for it, from the round's
    /// first request, before the job continues from the older state (announced as
    /// `progress_regressed`). A (re)started lighthouse also holds its first quorum for
    /// `min(heartbeat_timeout, progress_wait)`, until every group still heartbeating is
    /// heard. Zero: never wait (progress may regress while its holder is alive).
    pub progress_wait: Duration,
}

impl Default for LighthouseOptions {
    fn default() -> Self {
        Self {
            min_replicas: 1,
            join_timeout: Duration::from_secs(60),
            quorum_tick: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(5),
            progress_wait: DEFAULT_PROGRESS_WAIT,
        }
    }
}

/// Default of [`LighthouseOptions::progress_wait`]: as long as the Manager's default
/// timeouts, so a group ahead of the others that is inside a blocking phase of its step
/// (store connect, heal, a collective) finishes it and rejoins before the job gives up on it.
pub const DEFAULT_PROGRESS_WAIT: Duration = Duration::from_secs(60);

impl LighthouseOptions {
    /// Checks the options are usable (at least one replica, non-zero tick and timeouts).
    pub fn validate(&self) -> crate::error::Result<()> {
        use crate::error::Error;
        if self.min_replicas < 1 {
            return Err(Error::InvalidArgument(
                "min_replicas must be at least 1".into(),
            ));
        }
        if self.quorum_tick.is_zero() {
            return Err(Error::InvalidArgument(
                "quorum_tick must be positive".into(),
            ));
        }
        if self.heartbeat_timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "heartbeat_timeout must be positive".into(),
            ));
        }
        Ok(())
    }
}
