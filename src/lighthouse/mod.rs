//! The lighthouse: decides, per step, which replica groups take part (the quorum).
//!
//! Two rooms and the service around them; dependencies point down this list:
//!
//! - [`server`], `grpc`, [`http`], `reply`, `state`: the service. The [`LighthouseServer`]
//!   serves the gRPC methods and the status pages on one port; `state` is the live state
//!   around the engine (waiting requests, sessions, the state file and its writer) and
//!   `reply` the forms in which an issued quorum reaches its members.
//! - [`daemon`] and [`config`]: the `torchft_lighthouse` flags and the one
//!   [`LighthouseConfig`] they share with the Python constructor.
//! - [`quorum`]: the pure quorum engine (state, now, options → decision).
//! - [`health`]: the health model, its hub and metrics, the hang and parity verdicts (the
//!   engine consults the verdicts; health depends on nothing above it).
//!
//! The clients of the lighthouse (and of the manager servers its kill action calls) live in
//! [`crate::client`], below all of these.

use std::time::Duration;

pub mod config;
pub mod daemon;
mod grpc;
pub mod health;
pub mod http;
pub mod quorum;
mod reply;
pub mod rooms;
pub mod server;
mod state;

pub use crate::client::LighthouseClient;
pub use config::LighthouseConfig;
pub use health::hub::ObservabilityOptions;
pub use rooms::RoomOptions;
pub use server::LighthouseServer;

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
    /// `progress_regressed`). A restarted lighthouse (its state file remembers the job, or
    /// a manager reports a quorum of an earlier life) also holds its first quorum for
    /// `min(heartbeat_timeout, progress_wait)`, until every group still heartbeating is
    /// heard; a fresh job's first quorum is issued at once. Zero: never wait (progress may
    /// regress while its holder is alive).
    pub progress_wait: Duration,
    /// Where the lighthouse keeps what it must not forget across its own restarts (the last
    /// quorum's id and members, the best committed step and its holders), written atomically
    /// (write, then rename) before a commit is acknowledged or a changed quorum is issued.
    /// A restarted lighthouse reads it: it refuses commits under quorums it had replaced and
    /// waits (up to `progress_wait`) for the holders of the best step. None: a restarted
    /// lighthouse starts from nothing, and holds its first quorum only once a manager tells
    /// it that it restarted (a heartbeat or request naming a quorum of the earlier life).
    pub state_file: Option<std::path::PathBuf>,
    /// A replica group whose training loop has not reached its manager for this long, while
    /// a round waits on it, is hung: the quorum rules stop counting it as healthy and the
    /// others go on without it (see [`health::hang`]). None: adaptive, ten times the job's recent
    /// round interval, within 10 s and one hour.
    pub hang_timeout: Option<Duration>,
}

impl Default for LighthouseOptions {
    fn default() -> Self {
        Self {
            min_replicas: 1,
            join_timeout: Duration::from_millis(config::DEFAULT_JOIN_TIMEOUT_MS),
            quorum_tick: Duration::from_millis(config::DEFAULT_QUORUM_TICK_MS),
            heartbeat_timeout: Duration::from_millis(config::DEFAULT_HEARTBEAT_TIMEOUT_MS),
            progress_wait: DEFAULT_PROGRESS_WAIT,
            state_file: None,
            hang_timeout: None,
        }
    }
}

/// Default of [`LighthouseOptions::progress_wait`] (see [`config::DEFAULT_PROGRESS_WAIT_MS`]).
pub const DEFAULT_PROGRESS_WAIT: Duration = Duration::from_millis(config::DEFAULT_PROGRESS_WAIT_MS);

/// Who may use a lighthouse and how much they may send; the defaults are an open,
/// plain-TCP lighthouse (as upstream's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessOptions {
    /// Token and TLS of the lighthouse, and of its calls to manager servers (the kill action).
    pub security: crate::security::Security,
    /// Require the token on the read-only pages too (`/`, `/status`, `/metrics`, `/events`,
    /// `/healthz`, `/readyz`).
    pub private_status: bool,
    /// Largest request message or HTTP body accepted; larger ones fail with a clear status.
    pub max_request_bytes: usize,
    /// Each job's own token (`--room_token_dir`): it acts on that job's room only, where
    /// `security.token` acts on every room. Empty: one token for all.
    pub room_tokens: crate::security::RoomTokens,
}

/// Default bound on one request to the lighthouse (a quorum request or a telemetry batch).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// Smallest accepted `max_request_bytes` (below it ordinary requests would fail).
pub const MIN_REQUEST_BYTES: usize = 4096;

impl Default for AccessOptions {
    fn default() -> Self {
        Self {
            security: crate::security::Security::none(),
            private_status: false,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            room_tokens: crate::security::RoomTokens::default(),
        }
    }
}

impl AccessOptions {
    /// Checks a request limit is workable (at least [`MIN_REQUEST_BYTES`]).
    pub fn check_max_request_bytes(max_request_bytes: usize) -> crate::error::Result<()> {
        if max_request_bytes < MIN_REQUEST_BYTES {
            return Err(crate::error::Error::InvalidArgument(format!(
                "max_request_bytes must be at least {MIN_REQUEST_BYTES}"
            )));
        }
        Ok(())
    }

    /// Checks the options are usable (a workable request limit, complete TLS files).
    pub fn validate(&self) -> crate::error::Result<()> {
        Self::check_max_request_bytes(self.max_request_bytes)?;
        if !self.room_tokens.is_empty() && self.security.token.is_none() {
            return Err(crate::error::Error::InvalidArgument(
                "per-job tokens (--room_token_dir) need the lighthouse's own token too \
                 (TORCHFT_TOKEN_FILE / --token_file): it acts on every room"
                    .into(),
            ));
        }
        if self.private_status && self.security.token.is_none() {
            return Err(crate::error::Error::InvalidArgument(
                "private_status needs a token (TORCHFT_TOKEN_FILE / --token_file)".into(),
            ));
        }
        self.security.tls.validate()
    }
}

impl LighthouseOptions {
    /// Checks the options are usable (at least one replica, non-zero tick and timeouts).
    pub fn validate(&self) -> crate::error::Result<()> {
        use crate::error::ensure;
        ensure!(self.min_replicas >= 1, "min_replicas must be at least 1");
        ensure!(!self.quorum_tick.is_zero(), "quorum_tick must be positive");
        ensure!(
            !self.heartbeat_timeout.is_zero(),
            "heartbeat_timeout must be positive"
        );
        Ok(())
    }
}
