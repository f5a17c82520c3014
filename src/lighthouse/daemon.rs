//! The `torchft_lighthouse` daemon: flags, logging, serve until SIGTERM/SIGINT.
//!
//! Shared by the binary and the Python console script (`lighthouse_main`), so both accept the
//! same flags and behave the same.

use clap::Parser;
use tracing::info;

use super::config::LighthouseConfig;
use crate::error::{Error, Result};

/// torchft lighthouse: decides, per step, which replica groups take part in training.
///
/// Serves gRPC (quorum, heartbeat, telemetry) and HTTP (/healthz, /readyz, /status, /metrics,
/// /events, and the dashboard at /) on one port.
#[derive(Debug, Clone, Parser)]
#[command(name = "torchft_lighthouse", version, about, long_about = None)]
pub struct Args {
    /// The lighthouse's settings (every flag).
    #[command(flatten)]
    pub config: LighthouseConfig,
    /// Worker threads serving requests (default: TORCHFT_RUNTIME_THREADS when set, else one
    /// per core the process may use, its cgroup quota counted). A lighthouse of thousands of
    /// groups answers a round's requests on all of them.
    #[arg(long = "threads", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
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
    let env_threads = crate::runtime::threads_from_env()?;
    let threads = match args.threads {
        Some(n) => usize::from(n),
        None => env_threads.unwrap_or_else(crate::runtime::available_cores),
    };
    let (runtime, threads) = crate::runtime::get_with(threads);
    info!(threads, "lighthouse worker threads");
    runtime.block_on(async move {
        let config = args.config;
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
        assert_eq!(a.config.min_replicas, 2);
        assert_eq!(a.config.join_timeout_ms, 10);
        assert_eq!(a.config.quorum_tick_ms, 5);
        assert_eq!(a.config.heartbeat_timeout_ms, 5_000);
        assert_eq!(a.config.progress_wait_ms, 60_000);
        assert_eq!(
            a.config.options(),
            LighthouseOptions {
                min_replicas: 2,
                join_timeout: Duration::from_millis(10),
                quorum_tick: Duration::from_millis(5),
                ..LighthouseOptions::default()
            }
        );
        let b =
            Args::try_parse_from(["x", "--min_replicas", "1", "--progress-wait-ms", "0"]).unwrap();
        assert_eq!(b.config.options().progress_wait, Duration::ZERO);
        assert_eq!(a.config.bind, "[::]:29510");
        let o = a.config.options();
        assert_eq!(o.join_timeout, Duration::from_millis(10));
    }

    #[test]
    fn the_flags_defaults_are_the_python_constructors() {
        let a = Args::try_parse_from(["x", "--min_replicas", "3"]).unwrap();
        assert_eq!(
            a.config,
            LighthouseConfig::new(crate::lighthouse::config::DEFAULT_BIND, 3)
        );
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
            Args::try_parse_from(&argv).unwrap().config.access()
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
