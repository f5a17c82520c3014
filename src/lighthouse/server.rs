//! The lighthouse server: one listener serving gRPC and the HTTP pages (axum, HTTP/1 and h2c
//! on the same port), the tick task re-evaluating the round, the telemetry tick, and a
//! graceful shutdown.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::warn;

use super::health::hub::{Hub, ObservabilityOptions};
use super::rooms::{RoomOptions, Rooms};
use super::state::{initial_quorum_id, Shared};
use super::{AccessOptions, LighthouseOptions};
use crate::error::{Error, Result};
use crate::security::server::{Guard, OpenRoutes};

/// How often replica health is re-derived (heartbeat ages, straggler verdicts).
const TELEMETRY_TICK: Duration = Duration::from_millis(250);

/// How long [`LighthouseServer::shutdown`] waits for connections to drain before aborting.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Runs `tick` every `period` (a late tick is delayed, not bunched) until `stop` turns true.
fn spawn_ticker(
    period: Duration,
    mut stop: watch::Receiver<bool>,
    tick: impl Fn() + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = interval.tick() => tick(),
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    })
}

/// A running lighthouse: gRPC + HTTP on one port, spawned on the current tokio runtime.
pub struct LighthouseServer {
    local_addr: SocketAddr,
    /// Whether it serves TLS (its address is then `https://`).
    tls: bool,
    rooms: Arc<Rooms>,
    stop: watch::Sender<bool>,
    tasks: tokio::sync::Mutex<Vec<JoinHandle<()>>>,
}

/// The machine's host name, so an address bound to a wildcard is dialable from elsewhere.
pub fn hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_string())
        .chain(std::env::var("HOSTNAME").ok())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

impl LighthouseServer {
    /// Binds `bind` (e.g. `"[::]:0"`, `"127.0.0.1:0"`) and starts serving.
    pub async fn bind(bind: &str, opts: LighthouseOptions) -> Result<Self> {
        Self::bind_with(bind, opts, ObservabilityOptions::default()).await
    }

    /// Binds `bind` and starts serving, with an event log, kill action and straggler
    /// thresholds as `obs` says. Nothing is left behind on error.
    pub async fn bind_with(
        bind: &str,
        opts: LighthouseOptions,
        obs: ObservabilityOptions,
    ) -> Result<Self> {
        Self::bind_secured(bind, opts, obs, AccessOptions::default()).await
    }

    /// Binds `bind` and starts serving with the token, TLS and request limits of `access`.
    /// Nothing is left behind on error.
    pub async fn bind_secured(
        bind: &str,
        opts: LighthouseOptions,
        obs: ObservabilityOptions,
        access: AccessOptions,
    ) -> Result<Self> {
        Self::bind_rooms(bind, opts, obs, access, RoomOptions::default()).await
    }

    /// Binds `bind` and starts serving every job's room (see [`super::rooms`]), with the
    /// room settings of `rooms`. Nothing is left behind on error.
    pub async fn bind_rooms(
        bind: &str,
        opts: LighthouseOptions,
        obs: ObservabilityOptions,
        access: AccessOptions,
        rooms: RoomOptions,
    ) -> Result<Self> {
        opts.validate()?;
        obs.validate()?;
        access.validate()?;
        rooms.validate()?;
        let tls = crate::security::server::acceptor(&access.security)?;
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(bind)
            .await
            .map_err(|e| Error::InvalidArgument(format!("invalid bind address {bind:?}: {e}")))?
            .collect();
        let mut last_err = None;
        let mut listener = None;
        for a in &addrs {
            match tokio::net::TcpListener::bind(a).await {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        let listener = listener.ok_or_else(|| {
            Error::Unavailable(format!(
                "cannot bind {bind:?}: {}",
                last_err.map_or_else(|| "no address".to_string(), |e| e.to_string())
            ))
        })?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::Unavailable(format!("cannot read bound address: {e}")))?;

        let tick = opts.quorum_tick;
        let hub = Hub::new(obs.clone(), opts.heartbeat_timeout, opts.min_replicas)?;
        let shared = Arc::new(Shared::with_hub(
            opts.clone(),
            initial_quorum_id(),
            hub,
            access.security.clone(),
        )?);
        let rooms = Arc::new(
            Rooms::new(shared, opts, obs, access.security.clone(), rooms)?
                .with_tokens(access.room_tokens.clone()),
        );
        let (stop, stop_rx) = watch::channel(false);

        let app = super::grpc::router(rooms.clone(), access.max_request_bytes, stop_rx.clone())
            .merge(super::http::router(rooms.clone(), access.max_request_bytes))
            .fallback(super::http::not_found);
        let open = if access.private_status {
            OpenRoutes::None
        } else {
            OpenRoutes::ReadOnlyStatus
        };
        let guard = Guard::new(&access.security, open).with_room_tokens(access.room_tokens.clone());
        let serves_tls = tls.is_some();
        let mut serve_stop = stop_rx.clone();
        let server = tokio::spawn(async move {
            let stopped = async move {
                let _ = serve_stop.wait_for(|s| *s).await;
            };
            let res = crate::security::server::serve(listener, tls, guard, app, stopped).await;
            if let Err(e) = res {
                warn!(error = %e, "lighthouse server stopped with an error");
            }
        });

        let telemetry = spawn_ticker(TELEMETRY_TICK, stop_rx.clone(), {
            let rooms = rooms.clone();
            move || rooms.telemetry_tick()
        });
        let ticker = spawn_ticker(tick, stop_rx, {
            let rooms = rooms.clone();
            move || rooms.tick()
        });

        Ok(Self {
            local_addr,
            tls: serves_tls,
            rooms,
            stop,
            tasks: tokio::sync::Mutex::new(vec![server, ticker, telemetry]),
        })
    }

    /// Number of replica groups whose session is open (each manager server holds one), over
    /// every room.
    pub fn num_sessions(&self) -> usize {
        self.rooms.num_sessions()
    }

    /// The socket address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `http://host:port` to dial (`https://` when it serves TLS); a wildcard bind reports
    /// the machine's host name.
    pub fn address(&self) -> String {
        let port = self.local_addr.port();
        let scheme = if self.tls { "https" } else { "http" };
        match self.local_addr.ip() {
            ip if ip.is_unspecified() => format!("{scheme}://{}:{port}", hostname()),
            IpAddr::V4(ip) => format!("{scheme}://{ip}:{port}"),
            IpAddr::V6(ip) => format!("{scheme}://[{ip}]:{port}"),
        }
    }

    /// Id of the last issued quorum of the default room, if any (for tests and tooling).
    pub fn quorum_id(&self) -> Option<i64> {
        self.rooms.default_room().snapshot().quorum_id
    }

    /// Id of the last issued quorum of `job`'s room (empty: the default room), if the room
    /// is open and issued one.
    pub fn room_quorum_id(&self, job: &str) -> Option<i64> {
        self.rooms.existing(job)?.snapshot().quorum_id
    }

    /// The jobs with an open room, the default room (`""`) first.
    pub fn rooms(&self) -> Vec<String> {
        self.rooms.all().into_iter().map(|r| r.job).collect()
    }

    /// Quorum replies sent so far as `(full, compact)` (for tests and tooling; compact counts
    /// steps-only, delta and sparse replies): every requester that holds the previous quorum,
    /// or that asked for the sparse form, gets a compact reply.
    pub fn reply_counts(&self) -> (u64, u64) {
        self.rooms.reply_counts()
    }

    /// Graceful stop: pending long-polls end with UNAVAILABLE, then the listener and the tick
    /// task are joined (connections still open after a grace period are cut), and the last
    /// state handed to the state file's writer is written.
    pub async fn shutdown(&self) {
        self.rooms.begin_shutdown();
        let _ = self.stop.send(true);
        let tasks: Vec<JoinHandle<()>> = self.tasks.lock().await.drain(..).collect();
        for mut t in tasks {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut t).await.is_err() {
                warn!("lighthouse task did not stop within {SHUTDOWN_GRACE:?}; aborting it");
                t.abort();
            }
        }
        if let Err(e) = self.rooms.close_state().await {
            warn!(error = %e, "the lighthouse state file may miss the last state");
        }
    }

    /// Waits until the state file holds everything the lighthouse has handed to its writer
    /// (at once without a state file). Answers already wait for what they depend on (a
    /// commit, a changed quorum); this is for readers of the file (tools and tests).
    pub async fn flush_state(&self) -> Result<()> {
        self.rooms.flush_state().await
    }
}

impl Drop for LighthouseServer {
    fn drop(&mut self) {
        // Dropping without `shutdown()` still stops serving (without waiting).
        self.rooms.begin_shutdown();
        let _ = self.stop.send(true);
    }
}
