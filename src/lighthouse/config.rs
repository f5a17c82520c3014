//! One configuration of a lighthouse for both of its entry points: the `torchft_lighthouse`
//! flags ([`super::daemon::Args`]) and the Python constructor
//! `torchft._torchft.LighthouseServer(...)`.
//!
//! The flags are parsed straight into a [`LighthouseConfig`] (it derives them); the Python
//! constructor fills one from its arguments, starting from [`LighthouseConfig::new`], whose
//! defaults are the flags' defaults. Either way it is checked once
//! ([`LighthouseConfig::validate`]) and turned into the core's options.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::TypedValueParser as _;

use super::health::telemetry::{DEFAULT_STRAGGLER_MIN_MS, DEFAULT_STRAGGLER_SKEW_PCT};
use super::rooms::{RoomOptions, DEFAULT_MAX_ROOMS};
use super::{
    AccessOptions, LighthouseOptions, LighthouseServer, ObservabilityOptions,
    DEFAULT_MAX_REQUEST_BYTES, MIN_REQUEST_BYTES,
};
use crate::error::{ensure, Result};
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

/// Everything a lighthouse is started with, as its entry points spell it: the field docs are
/// the `torchft_lighthouse` flags' help.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct LighthouseConfig {
    /// Fewest replica groups a quorum may have (at least 1).
    #[arg(
        long = "min_replicas",
        alias = "min-replicas",
        env = "TORCHFT_MIN_REPLICAS",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub min_replicas: u64,

    /// Address to listen on (host:port); port 0 picks a free port.
    #[arg(long = "bind", env = "TORCHFT_BIND", default_value = DEFAULT_BIND)]
    pub bind: String,

    /// How long a round waits, from its first joiner, for healthy stragglers (ms).
    #[arg(
        long = "join_timeout_ms",
        alias = "join-timeout-ms",
        env = "TORCHFT_JOIN_TIMEOUT_MS",
        default_value_t = DEFAULT_JOIN_TIMEOUT_MS
    )]
    pub join_timeout_ms: u64,

    /// How often the lighthouse re-evaluates a round (ms, at least 1).
    #[arg(
        long = "quorum_tick_ms",
        alias = "quorum-tick-ms",
        env = "TORCHFT_QUORUM_TICK_MS",
        default_value_t = DEFAULT_QUORUM_TICK_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub quorum_tick_ms: u64,

    /// A replica group silent for this long is no longer healthy (ms, at least 1).
    #[arg(
        long = "heartbeat_timeout_ms",
        alias = "heartbeat-timeout-ms",
        env = "TORCHFT_HEARTBEAT_TIMEOUT_MS",
        default_value_t = DEFAULT_HEARTBEAT_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub heartbeat_timeout_ms: u64,

    /// How long a round whose replica groups are all behind a group that may still come back
    /// (heartbeating, or silent with its session open) waits for it before training goes on
    /// from the older state, announced as `progress_regressed` (ms). A restarted lighthouse
    /// (its state file remembers the job, or a manager holds a quorum of an earlier life)
    /// also holds its first quorum for min(heartbeat timeout, this), or until every member
    /// of the quorum its state file remembers asks at the remembered best step; a fresh
    /// job's first quorum is never held. 0: never wait.
    #[arg(
        long = "progress_wait_ms",
        alias = "progress-wait-ms",
        env = "TORCHFT_PROGRESS_WAIT_MS",
        default_value_t = DEFAULT_PROGRESS_WAIT_MS
    )]
    pub progress_wait_ms: u64,

    /// Keep what the lighthouse must not forget across its own restarts (the last quorum, the
    /// best committed step and its holders) in this file, rewritten atomically (write, then
    /// rename) before a commit is acknowledged or a changed quorum is issued. A restarted
    /// lighthouse continues from it: it refuses commits under quorums it had replaced and
    /// waits (up to the progress wait) for the holders of the best step. Put it where a
    /// restarted container finds it again (an emptyDir volume survives container restarts).
    #[arg(
        long = "state_file",
        alias = "state-file",
        env = "TORCHFT_LIGHTHOUSE_STATE_FILE"
    )]
    pub state_file: Option<PathBuf>,

    /// A replica group whose training loop has not reached its manager for this long (ms),
    /// while a quorum round waits on it and its process still heartbeats, is hung: the
    /// others go on without it and its manager is told (by default its process dumps its
    /// stacks and exits so its supervisor restarts it). 0: adaptive, ten times the job's
    /// recent round interval, at least 10 s and at most one hour.
    #[arg(
        long = "hang_timeout_ms",
        alias = "hang-timeout-ms",
        env = "TORCHFT_HANG_TIMEOUT_MS",
        default_value_t = 0
    )]
    pub hang_timeout_ms: u64,

    /// Append replica health events (JSON lines) to this file, for post-mortems
    /// (`python -m torchft.eventlog PATH` summarises one).
    #[arg(long = "event_log", alias = "event-log", env = "TORCHFT_EVENT_LOG")]
    pub event_log: Option<PathBuf>,

    /// Enable the dashboard's kill action (POST /replicas/{id}/kill ends a group's manager).
    #[arg(long = "allow_kill", alias = "allow-kill", env = "TORCHFT_ALLOW_KILL")]
    pub allow_kill: bool,

    /// A group whose median busy time is this many percent above the median is a straggler.
    #[arg(
        long = "straggler_skew_pct",
        alias = "straggler-skew-pct",
        env = "TORCHFT_STRAGGLER_SKEW_PCT",
        default_value_t = DEFAULT_STRAGGLER_SKEW_PCT as f64,
        value_parser = clap::value_parser!(u64).range(1..).map(|pct| pct as f64)
    )]
    pub straggler_skew_pct: f64,

    /// ... and at least this many milliseconds above it.
    #[arg(
        long = "straggler_min_ms",
        alias = "straggler-min-ms",
        env = "TORCHFT_STRAGGLER_MIN_MS",
        default_value_t = DEFAULT_STRAGGLER_MIN_MS
    )]
    pub straggler_min_ms: u64,

    /// A replica group that stays a straggler this long (ms) is dropped from the quorum for
    /// as long again and told why (its quorum request waits, then it rejoins and heals), so
    /// one slow machine does not set the pace of all. 0: stragglers are only flagged.
    #[arg(
        long = "straggler_drop_after_ms",
        alias = "straggler-drop-after-ms",
        env = "TORCHFT_STRAGGLER_DROP_AFTER_MS",
        default_value_t = 0
    )]
    pub straggler_drop_after_ms: u64,

    /// Require this shared secret (read from the file) on every RPC and on the kill action
    /// (default: env TORCHFT_TOKEN_FILE, else TORCHFT_TOKEN; never pass the secret itself on
    /// a command line).
    #[arg(long = "token_file", alias = "token-file")]
    pub token_file: Option<PathBuf>,

    /// Serve TLS with this PEM certificate chain (default: env TORCHFT_TLS_CERT).
    #[arg(long = "tls_cert", alias = "tls-cert")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls_cert (default: env TORCHFT_TLS_KEY).
    #[arg(long = "tls_key", alias = "tls-key")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA bundle to verify manager servers with when dialing them (the kill action);
    /// default: env TORCHFT_TLS_CA.
    #[arg(long = "tls_ca", alias = "tls-ca")]
    pub tls_ca: Option<PathBuf>,

    /// Require client certificates signed by this PEM CA bundle (mutual TLS); default: env
    /// TORCHFT_TLS_CLIENT_CA.
    #[arg(long = "tls_client_ca", alias = "tls-client-ca")]
    pub tls_client_ca: Option<PathBuf>,

    /// Require the token on the read-only pages too (/, /status, /metrics, /events,
    /// /healthz, /readyz).
    #[arg(
        long = "private_status",
        alias = "private-status",
        env = "TORCHFT_PRIVATE_STATUS"
    )]
    pub private_status: bool,

    /// Largest request message or HTTP body accepted, in bytes (at least 4096).
    #[arg(
        long = "max_request_bytes",
        alias = "max-request-bytes",
        env = "TORCHFT_MAX_REQUEST_BYTES",
        default_value_t = DEFAULT_MAX_REQUEST_BYTES,
        value_parser = clap::value_parser!(u64)
            .range(MIN_REQUEST_BYTES as u64..)
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    )]
    pub max_request_bytes: usize,

    /// A job's room (other than the default room) closes after this long (ms) without a
    /// request, an open session or a waiting quorum request; its part of the state file
    /// stays. See docs/rooms.md.
    #[arg(
        long = "room_expiry_ms",
        alias = "room-expiry-ms",
        env = "TORCHFT_ROOM_EXPIRY_MS",
        default_value_t = ROOM_EXPIRY_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub room_expiry_ms: u64,

    /// Most rooms open at once besides the default room; a request naming one more job is
    /// refused.
    #[arg(
        long = "max_rooms",
        alias = "max-rooms",
        env = "TORCHFT_MAX_ROOMS",
        default_value_t = DEFAULT_MAX_ROOMS,
        value_parser = clap::value_parser!(u64)
            .range(1..)
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    )]
    pub max_rooms: usize,

    /// A directory of per-job tokens: a file named after a job holds that job's token (a
    /// Kubernetes Secret with one key per job, mounted as a volume). A job's token acts on
    /// its own room only; the lighthouse's token (--token_file) on every room.
    #[arg(
        long = "room_token_dir",
        alias = "room-token-dir",
        env = "TORCHFT_ROOM_TOKEN_DIR"
    )]
    pub room_token_dir: Option<PathBuf>,

    /// `JOB=N`: the room of JOB needs N replica groups per quorum instead of
    /// --min_replicas (repeat the flag for more jobs).
    #[arg(
        long = "room_min_replicas",
        alias = "room-min-replicas",
        value_name = "JOB=N",
        value_parser = parse_room_min_replicas
    )]
    pub room_min_replicas: Vec<(String, u64)>,
}

/// Default of `--room_expiry_ms`.
pub const ROOM_EXPIRY_MS: u64 = 3_600_000;

fn parse_room_min_replicas(spec: &str) -> std::result::Result<(String, u64), String> {
    RoomOptions::parse_min_replicas(spec).map_err(|e| e.message())
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
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            tls_client_ca: None,
            private_status: false,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            room_expiry_ms: ROOM_EXPIRY_MS,
            max_rooms: DEFAULT_MAX_ROOMS,
            room_min_replicas: Vec::new(),
            room_token_dir: None,
        }
    }

    /// Checks every setting that does not need the environment (the token and TLS files
    /// are read, and checked, by [`LighthouseConfig::access`]).
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.min_replicas >= 1,
            "min_replicas must be at least 1, got {}",
            self.min_replicas
        );
        for (name, ms) in [
            ("quorum_tick_ms", self.quorum_tick_ms),
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
        ] {
            ensure!(ms > 0, "{name} must be positive");
        }
        self.options().validate()?;
        self.observability().validate()?;
        self.rooms().validate()?;
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
            security: Security::from_env_and(self.token_file.as_deref(), &self.tls_files())?,
            private_status: self.private_status,
            max_request_bytes: self.max_request_bytes,
            room_tokens: match &self.room_token_dir {
                Some(dir) => crate::security::RoomTokens::load_dir(dir)?,
                None => crate::security::RoomTokens::default(),
            },
        };
        access.validate()?;
        Ok(access)
    }

    /// The TLS files named here (each unset one comes from its environment variable).
    pub fn tls_files(&self) -> TlsFiles {
        TlsFiles {
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            ca: self.tls_ca.clone(),
            client_ca: self.tls_client_ca.clone(),
        }
    }

    /// Binds and starts serving with `access` (from [`LighthouseConfig::access`]).
    /// The room settings (see [`super::rooms`]).
    pub fn rooms(&self) -> RoomOptions {
        RoomOptions {
            expiry: Duration::from_millis(self.room_expiry_ms),
            max_rooms: self.max_rooms,
            min_replicas: self.room_min_replicas.iter().cloned().collect(),
        }
    }

    pub async fn bind(&self, access: AccessOptions) -> Result<LighthouseServer> {
        LighthouseServer::bind_rooms(
            &self.bind,
            self.options(),
            self.observability(),
            access,
            self.rooms(),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

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
