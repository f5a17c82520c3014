//! The `torchft_lighthouse` daemon: flags, logging, serve until SIGTERM/SIGINT.
//!
//! Shared by the binary and the Python console script (`lighthouse_main`), so both accept the
//! same flags and behave the same.

use clap::Parser;
use tracing::info;

use super::config::{
    LighthouseConfig, DEFAULT_BIND, DEFAULT_HEARTBEAT_TIMEOUT_MS, DEFAULT_JOIN_TIMEOUT_MS,
    DEFAULT_PROGRESS_WAIT_MS, DEFAULT_QUORUM_TICK_MS,
};
use super::health::telemetry::{DEFAULT_STRAGGLER_MIN_MS, DEFAULT_STRAGGLER_SKEW_PCT};
use crate::error::{Error, Result};
use crate::security::TlsFiles;

/// torchft lighthouse: decides, per step, which replica groups take part in training.
///
/// Serves gRPC (quorum, heartbeat, telemetry) and HTTP (/healthz, /readyz, /status, /metrics,
/// /events, and the dashboard at /) on one port.
#[derive(Debug, Clone, Parser)]
#[command(name = "torchft_lighthouse", version, about, long_about = None)]
pub struct Args {
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
    pub state_file: Option<std::path::PathBuf>,

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
    pub event_log: Option<std::path::PathBuf>,

    /// Enable the dashboard's kill action (POST /replicas/{id}/kill ends a group's manager).
    #[arg(long = "allow_kill", alias = "allow-kill", env = "TORCHFT_ALLOW_KILL")]
    pub allow_kill: bool,

    /// A group whose median busy time is this many percent above the median is a straggler.
    #[arg(
        long = "straggler_skew_pct",
        alias = "straggler-skew-pct",
        env = "TORCHFT_STRAGGLER_SKEW_PCT",
        default_value_t = DEFAULT_STRAGGLER_SKEW_PCT,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub straggler_skew_pct: u64,

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
    pub token_file: Option<std::path::PathBuf>,

    /// Serve TLS with this PEM certificate chain (default: env TORCHFT_TLS_CERT).
    #[arg(long = "tls_cert", alias = "tls-cert")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// PEM private key of --tls_cert (default: env TORCHFT_TLS_KEY).
    #[arg(long = "tls_key", alias = "tls-key")]
    pub tls_key: Option<std::path::PathBuf>,

    /// PEM CA bundle to verify manager servers with when dialing them (the kill action);
    /// default: env TORCHFT_TLS_CA.
    #[arg(long = "tls_ca", alias = "tls-ca")]
    pub tls_ca: Option<std::path::PathBuf>,

    /// Require client certificates signed by this PEM CA bundle (mutual TLS); default: env
    /// TORCHFT_TLS_CLIENT_CA.
    #[arg(long = "tls_client_ca", alias = "tls-client-ca")]
    pub tls_client_ca: Option<std::path::PathBuf>,

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
        default_value_t = super::DEFAULT_MAX_REQUEST_BYTES as u64,
        value_parser = clap::value_parser!(u64).range(super::MIN_REQUEST_BYTES as u64..)
    )]
    pub max_request_bytes: u64,
}

impl Args {
    /// The configuration these flags describe.
    pub fn config(&self) -> LighthouseConfig {
        LighthouseConfig {
            bind: self.bind.clone(),
            min_replicas: self.min_replicas,
            join_timeout_ms: self.join_timeout_ms,
            quorum_tick_ms: self.quorum_tick_ms,
            heartbeat_timeout_ms: self.heartbeat_timeout_ms,
            progress_wait_ms: self.progress_wait_ms,
            state_file: self.state_file.clone(),
            hang_timeout_ms: self.hang_timeout_ms,
            event_log: self.event_log.clone(),
            allow_kill: self.allow_kill,
            straggler_skew_pct: self.straggler_skew_pct as f64,
            straggler_min_ms: self.straggler_min_ms,
            straggler_drop_after_ms: self.straggler_drop_after_ms,
            token_file: self.token_file.clone(),
            tls: TlsFiles {
                cert: self.tls_cert.clone(),
                key: self.tls_key.clone(),
                ca: self.tls_ca.clone(),
                client_ca: self.tls_client_ca.clone(),
            },
            private_status: self.private_status,
            max_request_bytes: usize::try_from(self.max_request_bytes).unwrap_or(usize::MAX),
        }
    }
}

/// A future that resolves with the name of the first SIGTERM/SIGINT received.
///
/// The handlers are installed when this is called (not when it is first polled), so a signal
/// arriving right after the "listening" log line is never lost.
fn shutdown_signal() -> Result<impl std::future::Future<Output = &'static str>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())
            .map_err(|e| Error::Unavailable(format!("cannot listen for SIGTERM: {e}")))?;
        let mut int = signal(SignalKind::interrupt())
            .map_err(|e| Error::Unavailable(format!("cannot listen for SIGINT: {e}")))?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async move {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        })
    }
}

/// Runs the lighthouse until SIGTERM or SIGINT, then shuts it down gracefully.
///
/// Blocks the calling thread on the process-wide runtime.
pub fn run(args: Args) -> Result<()> {
    crate::logging::init("info")?;
    crate::logging::set_default_level("info")?;
    crate::runtime::threads_from_env()?;
    crate::runtime::get().block_on(async move {
        let config = args.config();
        let signal = shutdown_signal()?;
        let access = config.access()?;
        let (authenticated, tls) = (access.security.token.is_some(), access.security.tls.clone());
        let server = config.bind(access).await?;
        info!(
            min_replicas = config.min_replicas,
            join_timeout_ms = config.join_timeout_ms,
            quorum_tick_ms = config.quorum_tick_ms,
            heartbeat_timeout_ms = config.heartbeat_timeout_ms,
            progress_wait_ms = config.progress_wait_ms,
            hang_timeout_ms = config.hang_timeout_ms,
            state_file = ?config.state_file,
            event_log = ?config.event_log,
            allow_kill = config.allow_kill,
            authenticated,
            tls = tls.serves_tls(),
            mutual_tls = tls.client_ca.is_some(),
            private_status = config.private_status,
            "lighthouse listening on {} (dashboard at /, metrics at /metrics)",
            server.address()
        );
        let name = signal.await;
        info!("received {name}, shutting down");
        server.shutdown().await;
        info!("lighthouse stopped");
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::lighthouse::LighthouseOptions;

    #[test]
    fn flags_parse_with_both_spellings() {
        let a = Args::try_parse_from([
            "torchft_lighthouse",
            "--min_replicas",
            "2",
            "--join-timeout-ms",
            "10",
            "--quorum_tick_ms=5",
        ])
        .unwrap();
        assert_eq!(a.min_replicas, 2);
        assert_eq!(a.join_timeout_ms, 10);
        assert_eq!(a.quorum_tick_ms, 5);
        assert_eq!(a.heartbeat_timeout_ms, 5_000);
        assert_eq!(a.progress_wait_ms, 60_000);
        assert_eq!(
            a.config().options(),
            LighthouseOptions {
                min_replicas: 2,
                join_timeout: Duration::from_millis(10),
                quorum_tick: Duration::from_millis(5),
                ..LighthouseOptions::default()
            }
        );
        let b =
            Args::try_parse_from(["x", "--min_replicas", "1", "--progress-wait-ms", "0"]).unwrap();
        assert_eq!(b.config().options().progress_wait, Duration::ZERO);
        assert_eq!(a.bind, "[::]:29510");
        let o = a.config().options();
        assert_eq!(o.join_timeout, Duration::from_millis(10));
    }

    #[test]
    fn security_flags_are_checked_at_start() {
        let certs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/certs");
        let cert = certs.join("server.pem").display().to_string();
        let key = certs.join("server.key").display().to_string();
        let dir = std::env::temp_dir().join(format!("torchft-flags-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "s3cret\n").unwrap();
        let (empty, token) = (empty.display().to_string(), token.display().to_string());
        let missing = dir.join("missing").display().to_string();
        let access = |flags: &[&str]| {
            let mut argv = vec!["x", "--min_replicas", "1"];
            argv.extend_from_slice(flags);
            Args::try_parse_from(&argv).unwrap().config().access()
        };
        for (flags, message) in [
            (vec!["--tls_cert", cert.as_str()], "private key"),
            (vec!["--tls_key", key.as_str()], "certificate"),
            (vec!["--tls_client_ca", cert.as_str()], "server certificate"),
            (vec!["--token_file", empty.as_str()], "empty"),
            (vec!["--token_file", missing.as_str()], "missing"),
            (vec!["--private_status"], "needs a token"),
        ] {
            let err = access(&flags).unwrap_err().to_string();
            assert!(err.contains(message), "{flags:?}: {err}");
        }
        assert!(
            Args::try_parse_from(["x", "--min_replicas", "1", "--max_request_bytes", "10"])
                .is_err()
        );
        let ok = access(&[
            "--token_file",
            &token,
            "--tls_cert",
            &cert,
            "--tls_key",
            &key,
            "--private_status",
        ])
        .unwrap();
        assert!(ok.security.token.unwrap().matches(b"s3cret"));
        assert!(ok.security.tls.serves_tls() && ok.private_status);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_flags_rejected() {
        for argv in [
            vec!["x", "--min_replicas", "0"],
            vec!["x", "--min_replicas", "abc"],
            vec!["x", "--min_replicas", "1", "--bogus"],
            vec!["x", "--min_replicas", "1", "--quorum_tick_ms", "0"],
            vec!["x", "--min_replicas", "1", "--heartbeat_timeout_ms", "-5"],
            vec!["x", "--min_replicas", "1", "--progress_wait_ms", "-1"],
            vec!["x", "--min_replicas", "1", "--progress_wait_ms", "soon"],
        ] {
            assert!(Args::try_parse_from(&argv).is_err(), "{argv:?} accepted");
        }
    }
}
