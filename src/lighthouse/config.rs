//! One configuration of a lighthouse for both of its entry points: the `torchft_lighthouse`
//! flags ([`super::daemon::Args`]) and the Python constructor
//! `torchft._torchft.LighthouseServer(...)`.
//!
//! Both fill a [`LighthouseConfig`] in the units their users write (milliseconds, counts),
//! starting from the same defaults ([`LighthouseConfig::new`]); it is checked once
//! ([`LighthouseConfig::validate`]) and turned into the core's options.

use std::path::PathBuf;
use std::time::Duration;

use super::health::telemetry::{DEFAULT_STRAGGLER_MIN_MS, DEFAULT_STRAGGLER_SKEW_PCT};
use super::{
    AccessOptions, LighthouseOptions, LighthouseServer, ObservabilityOptions,
    DEFAULT_MAX_REQUEST_BYTES,
};
use crate::error::{Error, Result};
use crate::security::{Security, TlsFiles};

/// Default listening address of the daemon.
pub const DEFAULT_BIND: &str = "[::]:29510";
/// Default of [`LighthouseConfig::join_timeout_ms`].
pub const DEFAULT_JOIN_TIMEOUT_MS: u64 = 60_000;
/// Default of [`LighthouseConfig::quorum_tick_ms`].
pub const DEFAULT_QUORUM_TICK_MS: u64 = 100;
/// Default of [`LighthouseConfig::heartbeat_timeout_ms`].
pub const DEFAULT_HEARTBEAT_TIMEOUT_MS: u64 = 5_000;
/// Default of [`LighthouseConfig::progress_wait_ms`]: as long as the Manager's default
/// timeouts, so a group ahead of the others that is inside a blocking phase of its step
/// (store connect, heal, a collective) finishes it and rejoins before the job gives up on it.
pub const DEFAULT_PROGRESS_WAIT_MS: u64 = 60_000;

/// Everything a lighthouse is started with, as its entry points spell it. See the
/// `torchft_lighthouse` flags of the same names for what each one does.
#[derive(Debug, Clone, PartialEq)]
pub struct LighthouseConfig {
    /// Address to listen on (host:port); port 0 picks a free port.
    pub bind: String,
    /// Fewest replica groups a quorum may have (at least 1).
    pub min_replicas: u64,
    /// How long a round waits, from its first joiner, for healthy stragglers.
    pub join_timeout_ms: u64,
    /// How often the lighthouse re-evaluates a round (at least 1).
    pub quorum_tick_ms: u64,
    /// A replica group silent for this long is no longer healthy (at least 1).
    pub heartbeat_timeout_ms: u64,
    /// How long a round behind a group that may still come back waits for it (0: never).
    pub progress_wait_ms: u64,
    /// Where the lighthouse keeps what it must not forget across its own restarts.
    pub state_file: Option<PathBuf>,
    /// Hang timeout of a group's training loop (0: adaptive).
    pub hang_timeout_ms: u64,
    /// Where to append replica health events (JSON lines).
    pub event_log: Option<PathBuf>,
    /// Serve the dashboard's kill action.
    pub allow_kill: bool,
    /// Percent above the median busy time that makes a straggler (positive).
    pub straggler_skew_pct: f64,
    /// ... and at least this many milliseconds above it.
    pub straggler_min_ms: u64,
    /// A lasting straggler is dropped from the quorum after this long (0: only flagged).
    pub straggler_drop_after_ms: u64,
    /// File holding the shared secret (default from the environment).
    pub token_file: Option<PathBuf>,
    /// TLS files (each defaults to its environment variable).
    pub tls: TlsFiles,
    /// Require the token on the read-only pages too.
    pub private_status: bool,
    /// Largest request message or HTTP body accepted, in bytes.
    pub max_request_bytes: usize,
}

/// `ms` as a duration, or None for zero (the "off"/"adaptive" value of some settings).
fn nonzero_ms(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

impl LighthouseConfig {
    /// The defaults, listening on `bind` with quorums of at least `min_replicas`.
    pub fn new(bind: impl Into<String>, min_replicas: u64) -> Self {
        Self {
            bind: bind.into(),
            min_replicas,
            join_timeout_ms: DEFAULT_JOIN_TIMEOUT_MS,
            quorum_tick_ms: DEFAULT_QUORUM_TICK_MS,
            heartbeat_timeout_ms: DEFAULT_HEARTBEAT_TIMEOUT_MS,
            progress_wait_ms: DEFAULT_PROGRESS_WAIT_MS,
            state_file: None,
            hang_timeout_ms: 0,
            event_log: None,
            allow_kill: false,
            straggler_skew_pct: DEFAULT_STRAGGLER_SKEW_PCT as f64,
            straggler_min_ms: DEFAULT_STRAGGLER_MIN_MS,
            straggler_drop_after_ms: 0,
            token_file: None,
            tls: TlsFiles::default(),
            private_status: false,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
        }
    }

    /// Checks every setting that does not need the environment (the token and TLS files
    /// are read, and checked, by [`LighthouseConfig::access`]).
    pub fn validate(&self) -> Result<()> {
        if self.min_replicas < 1 {
            return Err(Error::InvalidArgument(format!(
                "min_replicas must be at least 1, got {}",
                self.min_replicas
            )));
        }
        for (name, ms) in [
            ("quorum_tick_ms", self.quorum_tick_ms),
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
        ] {
            if ms == 0 {
                return Err(Error::InvalidArgument(format!("{name} must be positive")));
            }
        }
        self.options().validate()?;
        self.observability().validate()?;
        AccessOptions::check_max_request_bytes(self.max_request_bytes)
    }

    /// The quorum engine's options.
    pub fn options(&self) -> LighthouseOptions {
        LighthouseOptions {
            min_replicas: self.min_replicas,
            join_timeout: Duration::from_millis(self.join_timeout_ms),
            quorum_tick: Duration::from_millis(self.quorum_tick_ms),
            heartbeat_timeout: Duration::from_millis(self.heartbeat_timeout_ms),
            progress_wait: Duration::from_millis(self.progress_wait_ms),
            state_file: self.state_file.clone(),
            hang_timeout: nonzero_ms(self.hang_timeout_ms),
        }
    }

    /// The event log, kill action and straggler settings.
    pub fn observability(&self) -> ObservabilityOptions {
        ObservabilityOptions {
            event_log: self.event_log.clone(),
            allow_kill: self.allow_kill,
            straggler_skew_pct: self.straggler_skew_pct,
            straggler_min: Duration::from_millis(self.straggler_min_ms),
            straggler_drop_after: nonzero_ms(self.straggler_drop_after_ms),
        }
    }

    /// Validates the configuration, then reads the token and TLS settings on top of the
    /// environment's ([`Security::from_env`]; a setting here wins over its variable) and
    /// checks them.
    pub fn access(&self) -> Result<AccessOptions> {
        self.validate()?;
        let access = AccessOptions {
            security: Security::from_env_and(self.token_file.as_deref(), &self.tls)?,
            private_status: self.private_status,
            max_request_bytes: self.max_request_bytes,
        };
        access.validate()?;
        Ok(access)
    }

    /// Binds and starts serving with `access` (from [`LighthouseConfig::access`]).
    pub async fn bind(&self, access: AccessOptions) -> Result<LighthouseServer> {
        LighthouseServer::bind_secured(&self.bind, self.options(), self.observability(), access)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_core_defaults() {
        let c = LighthouseConfig::new(DEFAULT_BIND, 1);
        c.validate().unwrap();
        assert_eq!(c.options(), LighthouseOptions::default());
        assert_eq!(c.observability(), ObservabilityOptions::default());
        assert_eq!(
            c.max_request_bytes,
            AccessOptions::default().max_request_bytes
        );
    }

    #[test]
    fn bad_settings_are_named() {
        let base = LighthouseConfig::new("127.0.0.1:0", 1);
        for (c, message) in [
            (
                LighthouseConfig {
                    min_replicas: 0,
                    ..base.clone()
                },
                "min_replicas",
            ),
            (
                LighthouseConfig {
                    quorum_tick_ms: 0,
                    ..base.clone()
                },
                "quorum_tick_ms",
            ),
            (
                LighthouseConfig {
                    heartbeat_timeout_ms: 0,
                    ..base.clone()
                },
                "heartbeat_timeout_ms",
            ),
            (
                LighthouseConfig {
                    straggler_skew_pct: f64::NAN,
                    ..base.clone()
                },
                "straggler_skew_pct",
            ),
            (
                LighthouseConfig {
                    max_request_bytes: 10,
                    ..base.clone()
                },
                "max_request_bytes",
            ),
        ] {
            let e = c.validate().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            assert!(e.to_string().contains(message), "{message}: {e}");
        }
        // Zero means "off" or "adaptive" where the flags say so.
        let c = LighthouseConfig {
            join_timeout_ms: 0,
            progress_wait_ms: 0,
            hang_timeout_ms: 0,
            straggler_drop_after_ms: 0,
            ..base
        };
        c.validate().unwrap();
        assert_eq!(c.options().hang_timeout, None);
        assert_eq!(c.observability().straggler_drop_after, None);
    }
}
