//! The manager server of one replica group: its lifecycle and the state its parts share.
//!
//! One quorum round: every group rank calls `Quorum`; the rank that completes the round
//! triggers ONE lighthouse request (retried `quorum_retries` times with backoff, bounded by the
//! longest deadline of the waiting ranks); each rank then gets its own answer from
//! [`super::compute_quorum_results`]. If the lighthouse call fails, every waiting rank gets the
//! error at once. Every rank's request honours its own deadline and leaves the round when it
//! expires.
//!
//! The lighthouse channel is lazy and reconnects by itself, so the server starts while the
//! lighthouse is down and recovers when it comes back on the same address.
//!
//! The server also holds a session with the lighthouse for its life (reopened with backoff
//! when the lighthouse restarts): its end tells the lighthouse this group died, and it brings
//! the lighthouse's lost-member events, which ranks collect with the `WatchEvents` long-poll.
//!
//! - this module: the server's lifecycle and shared state;
//! - `service`: the gRPC service;
//! - `lighthouse`: the quorum request and the commit announcement to the lighthouse;
//! - `heartbeat`: the heartbeat loop, the commit lease and the lighthouse session;
//! - `events`: the lost-member events kept for the ranks' long-polls.

mod events;
mod heartbeat;
mod lighthouse;
mod own_link;
mod service;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use self::events::EventLog;
use self::heartbeat::{heartbeat_loop, session_loop, Lease};
use self::lighthouse::Announced;
use self::own_link::OwnLink;
use self::service::Service;
use super::commit::CommitBarrier;
use super::gather::QuorumGather;
use super::parity::DigestCollector;
use super::reports::ReportQueue;
use super::ManagerOptions;
use crate::client::LighthouseClient;
use crate::error::{ensure, Error, Result};
use crate::proto::manager_service_server::ManagerServiceServer;
use crate::proto::{LostEvent, TelemetryReport};
use crate::security::server::{Guard, OpenRoutes};
use crate::telemetry::base_id;

/// How often the ranks' telemetry reports are forwarded to the lighthouse.
const REPORT_INTERVAL: Duration = Duration::from_millis(250);
/// Bound on one telemetry send to the lighthouse.
const REPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on the last telemetry flush at shutdown or kill.
const REPORT_FLUSH: Duration = Duration::from_secs(1);

/// The longest a single-rank group's commit announcement waits on the rank's own
/// connection, which no keep-alive watches, before that connection is closed and the
/// announcement is sent again on the shared connection (whose keep-alive finds a silent
/// connection dead within 30 s). Quorum requests on that connection have no such cap (they
/// may rightly wait long for the other groups).
pub const OWN_LINK_TRY: Duration = Duration::from_secs(10);

/// How long a graceful shutdown waits for open connections before closing them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running manager server (spawned on the current tokio runtime).
///
/// Dropping it signals shutdown; [`ManagerServer::shutdown`] also waits for it to finish.
#[derive(Debug)]
pub struct ManagerServer {
    address: String,
    inner: Arc<Inner>,
    shutdown_tx: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Debug)]
struct Inner {
    opts: ManagerOptions,
    address: String,
    lighthouse_addr: String,
    /// Keeps the last quorum received, so the lighthouse can answer in compact form.
    lighthouse: LighthouseClient,
    /// The quorum requests and commit announcements of a hosting rank that is its group's
    /// only rank, on a connection its thread drives (see
    /// [`ManagerServer::quorum_start_blocking`], [`ManagerServer::may_commit_blocking`]);
    /// dialled by the first announcement, closed when it may be in the way or dead (see
    /// `own_link`).
    own_link: OwnLink,
    gather: QuorumGather,
    barrier: CommitBarrier,
    events: EventLog,
    lease: Mutex<Lease>,
    shutdown: watch::Receiver<bool>,
    /// The ranks' telemetry reports, waiting to be forwarded to the lighthouse.
    reports: ReportQueue,
    /// The group's committed step as last seen (a quorum round, or a commit noted by the
    /// hosting rank); -1 before either. Heartbeats carry it to the lighthouse, which then
    /// knows this group's progress while it is not asking for a quorum.
    committed_step: AtomicI64,
    /// The hosting rank's quorum wait in the step it is about to vote on: `(step, seconds)`,
    /// sent with that step's commit announcement.
    step_wait: Mutex<Option<(i64, f64)>>,
    /// Id of the last quorum received (-1 before any): a loss reported for it ends the commit
    /// vote in progress, and commits are announced under it.
    quorum_id: AtomicI64,
    /// The lighthouse answered a commit announcement UNIMPLEMENTED (an upstream lighthouse):
    /// commits go ahead without one (warned once).
    commit_unsupported: AtomicBool,
    /// A quorum did not use this group's topology file (its members announced different
    /// files, or none): warned once.
    topology_unused: AtomicBool,
    /// Why the lighthouse's round this group asks in waits, as its last heartbeat reply
    /// said (None when it did not say): the quorum request's long waits log it.
    lighthouse_waiting: Mutex<Option<String>>,
    /// When the group's training loop last reached this server (a rank's quorum request or
    /// commit vote); None before the first visit. Heartbeats report its age (hang watch).
    loop_visit: Mutex<Option<Instant>>,
    /// Heals in progress in the hosting rank: the loop is inside torchft, not away.
    loop_busy: AtomicUsize,
    /// Why the lighthouse holds this group hung, as its last heartbeat reply said.
    hung: Mutex<Option<String>>,
    /// The ranks' state digests (runtime state parity), sent with the heartbeats.
    digests: Mutex<DigestCollector>,
    /// Why the parity check stopped this group (its state differs from the others' with no
    /// majority): set once, for the life of the server; quorums and commits are refused.
    diverged: Mutex<Option<String>>,
    /// What the lighthouse's parity checks said of this group's states, as the newest
    /// heartbeat replies told it (see [`ParityVerdicts`]).
    parity: Mutex<ParityVerdicts>,
}

/// What the lighthouse's parity checks said of this group's committed states, over this
/// server's life (a restarted lighthouse starts its checks afresh: the newest of each is kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParityVerdicts {
    /// Whether the lighthouse says (it answers heartbeats with its timeout: upstream and
    /// unreachable lighthouses do not, and check nothing).
    pub checked: bool,
    /// The newest step decided with this group's digest and no disagreement (0 = none).
    pub ok_step: i64,
    /// The newest step at which this group's digest differed from the others' (0 = never).
    pub diverged_step: i64,
}

/// A quorum request started by [`ManagerServer::quorum_start_blocking`]; dropped unanswered,
/// it is cancelled.
pub struct OwnQuorum(Path);

/// Where a started quorum request runs.
enum Path {
    /// On the hosting rank's own connection, driven by its waiter.
    Own(own_link::Started<Result<crate::proto::ManagerQuorumResponse>>),
    /// A task of the process's runtime, on the shared connection (the own connection is
    /// not connected yet).
    Spawned(Aborting),
}

/// A spawned quorum request, cancelled when dropped unanswered (as the own connection's).
struct Aborting(Option<JoinHandle<Result<crate::proto::ManagerQuorumResponse>>>);

impl Drop for Aborting {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            handle.abort();
        }
    }
}

impl std::fmt::Debug for OwnQuorum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let own = matches!(self.0, Path::Own(_));
        f.debug_struct("OwnQuorum")
            .field("own_link", &own)
            .finish_non_exhaustive()
    }
}

impl OwnQuorum {
    /// Waits for the answer on this thread (outside any tokio runtime), which drives the
    /// connection meanwhile; bounded by the request's deadline.
    ///
    /// # Errors
    /// As `ManagerClient::quorum`; `InvalidArgument` inside a tokio runtime.
    pub fn wait(self) -> Result<crate::proto::ManagerQuorumResponse> {
        match self.0 {
            Path::Own(started) => started.wait()?,
            Path::Spawned(mut spawned) => {
                own_link::outside_runtime("OwnQuorum::wait", "await ManagerClient::quorum")?;
                let Some(handle) = spawned.0.take() else {
                    return Err(Error::Shutdown);
                };
                crate::runtime::get().block_on(handle).map_err(|e| {
                    Error::Unavailable(format!("the quorum request's task failed: {e}"))
                })?
            }
        }
    }

    /// Whether the answer is in (an answer already arrived is read first, without waiting).
    pub fn is_done(&self) -> bool {
        match &self.0 {
            Path::Own(started) => started.is_done(),
            Path::Spawned(spawned) => spawned.0.as_ref().is_none_or(|h| h.is_finished()),
        }
    }

    /// Whether the request went on the hosting rank's own connection.
    pub fn on_own_link(&self) -> bool {
        matches!(self.0, Path::Own(_))
    }
}

/// Formats `http://host:port` (`https://` for a TLS server), bracketing IPv6 literals.
fn http_address(hostname: &str, port: u16, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    if hostname.contains(':') && !hostname.starts_with('[') {
        format!("{scheme}://[{hostname}]:{port}")
    } else {
        format!("{scheme}://{hostname}:{port}")
    }
}

/// Smallest accepted `max_request_bytes` (below it ordinary requests would fail).
const MIN_REQUEST_LIMIT: usize = 4096;

/// Resolves once `rx` says the server is shutting down (or its sender is gone).
async fn shutting_down(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|down| *down).await;
}

impl ManagerServer {
    /// Validates `opts`, binds `opts.bind` and starts serving and heartbeating.
    ///
    /// The lighthouse is dialled lazily: a lighthouse that is down only fails quorum requests
    /// (promptly), it does not prevent the server from starting.
    pub async fn start(opts: ManagerOptions) -> Result<Self> {
        ensure!(opts.world_size > 0, "world_size must be at least 1");
        ensure!(!opts.replica_id.is_empty(), "replica_id must not be empty");
        ensure!(!opts.hostname.is_empty(), "hostname must not be empty");
        ensure!(
            !opts.heartbeat_interval.is_zero(),
            "heartbeat_interval must be positive"
        );
        ensure!(
            !opts.connect_timeout.is_zero(),
            "connect_timeout must be positive"
        );
        ensure!(
            opts.max_request_bytes >= MIN_REQUEST_LIMIT,
            "max_request_bytes must be at least {MIN_REQUEST_LIMIT}"
        );
        if let Some(p) = &opts.placement {
            p.topology.check_group(p.group, opts.world_size)?;
        }
        let tls = crate::security::server::acceptor(&opts.security)?;
        // Read once (TLS files included): the shared connection adds keep-alive to it.
        let quiet = crate::security::client::quiet_endpoint(
            &opts.lighthouse_addr,
            opts.connect_timeout,
            &opts.security,
        )
        .map_err(|e| Error::InvalidArgument(format!("lighthouse address: {}", e.message())))?;
        let endpoint = crate::security::client::with_keep_alive(quiet.clone());
        let lighthouse_addr = endpoint.uri().to_string();
        let lighthouse =
            LighthouseClient::from_channel(endpoint.connect_lazy(), opts.security.token.as_ref())
                .with_job(&opts.job)?;
        let own_link = OwnLink::new(quiet, &opts, &lighthouse);

        let listener = tokio::net::TcpListener::bind(&opts.bind)
            .await
            .map_err(|e| Error::Unavailable(format!("cannot listen on {}: {e}", opts.bind)))?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::Unavailable(format!("cannot read the bound address: {e}")))?
            .port();
        let address = http_address(&opts.hostname, port, tls.is_some());

        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let inner = Arc::new(Inner {
            gather: QuorumGather::new(opts.world_size)?,
            barrier: CommitBarrier::new(opts.world_size)?,
            events: EventLog::new(),
            lease: Mutex::new(Lease::default()),
            address: address.clone(),
            lighthouse_addr,
            lighthouse,
            own_link,
            shutdown: shutdown_rx.clone(),
            reports: ReportQueue::default(),
            committed_step: AtomicI64::new(-1),
            step_wait: Mutex::new(None),
            quorum_id: AtomicI64::new(-1),
            commit_unsupported: AtomicBool::new(false),
            topology_unused: AtomicBool::new(false),
            lighthouse_waiting: Mutex::new(None),
            loop_visit: Mutex::new(None),
            loop_busy: AtomicUsize::new(0),
            hung: Mutex::new(None),
            digests: Mutex::new(DigestCollector::new(opts.world_size)),
            diverged: Mutex::new(None),
            parity: Mutex::new(ParityVerdicts::default()),
            opts,
        });

        let service = Arc::new(Service {
            inner: inner.clone(),
        });
        // This process's own clients of the server (group rank 0) reach it without the
        // network; see `crate::client::in_process`.
        crate::client::in_process::register(
            &address,
            service.clone(),
            inner.opts.security.token.clone(),
            inner.opts.max_request_bytes,
        );
        let service = ManagerServiceServer::from_arc(service)
            .max_decoding_message_size(inner.opts.max_request_bytes);
        let app = tonic::service::Routes::new(service).into_axum_router();
        let guard = Guard::new(&inner.opts.security, OpenRoutes::None);
        let signal = shutting_down(shutdown_rx.clone());
        let serve = tokio::spawn(async move {
            if let Err(e) = crate::security::server::serve(listener, tls, guard, app, signal).await
            {
                warn!(error = %e, "manager server stopped with an error");
            }
        });
        let (heartbeat_running, heartbeat_ended) = tokio::sync::oneshot::channel();
        let heartbeat = tokio::spawn(heartbeat_loop(inner.clone(), heartbeat_running));
        let session = tokio::spawn(session_loop(inner.clone(), heartbeat_ended));
        let forwarder = inner.reports.spawn_forwarder(
            REPORT_INTERVAL,
            shutdown_rx.clone(),
            inner.lighthouse.clone(),
            REPORT_TIMEOUT,
        );
        info!(
            replica_id = %inner.opts.replica_id,
            address = %address,
            lighthouse = %inner.lighthouse_addr,
            world_size = inner.opts.world_size,
            "manager server listening"
        );
        Ok(Self {
            address,
            inner,
            shutdown_tx,
            tasks: Mutex::new(vec![serve, heartbeat, session, forwarder]),
        })
    }

    /// False if this group may have been declared lost during the current step (its
    /// heartbeats lapsed for half the lighthouse's heartbeat timeout since the last quorum):
    /// the step must then not commit. Single-rank groups that vote locally ask this.
    pub fn lease_held(&self) -> bool {
        self.inner.lease_held()
    }

    /// Why the lighthouse holds this group hung (its training loop stayed away from this
    /// server past the hang timeout while a round waited on it), or None.
    pub fn hung(&self) -> Option<String> {
        self.inner
            .hung
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// What the lighthouse's parity checks said of this group's committed states.
    pub fn parity_verdicts(&self) -> ParityVerdicts {
        *self.inner.parity.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The server's view of the group now, in one line, for a hang report: its committed
    /// step and quorum, how long ago its training loop last reached the server, the ranks
    /// waiting in a quorum request or the commit vote, its lease, and what the lighthouse
    /// last said about it.
    pub fn describe(&self) -> String {
        let inner = &self.inner;
        let now = Instant::now();
        let idle = match inner.loop_idle(now) {
            Some(d) if d.is_zero() && inner.loop_busy.load(Ordering::Relaxed) > 0 => {
                "inside torchft (a heal in progress)".to_string()
            }
            Some(d) => format!("last reached this server {:.1}s ago", d.as_secs_f64()),
            None => "never reached this server".to_string(),
        };
        let said = |slot: &Mutex<Option<String>>| {
            slot.lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or_else(|| "nothing".into())
        };
        format!(
            "manager server of {}: committed step {}, quorum {}; training loop {idle}; ranks \
             waiting in a quorum request: {}, in the commit vote: {}; lease {}; lighthouse \
             says: waiting: {}; hung: {}",
            inner.opts.replica_id,
            inner.committed_step.load(Ordering::Relaxed),
            inner.quorum_id.load(Ordering::Relaxed),
            inner.gather.waiting(),
            inner.barrier.pending_votes(),
            if inner
                .lease
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .held(now)
            {
                "held"
            } else {
                "lapsed"
            },
            said(&inner.lighthouse_waiting),
            said(&inner.hung),
        )
    }

    /// Marks the hosting rank's training loop as inside torchft (`busy`: a heal, which may
    /// take long) or back out of it; while busy the loop is never reported away.
    pub fn set_loop_busy(&self, busy: bool) {
        if busy {
            self.inner.loop_busy.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ = self
                .inner
                .loop_busy
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            self.inner.visit();
        }
    }

    /// Whether this group may commit the step `step` (its committed step count before the
    /// commit): its lease held, and the lighthouse accepted the write-ahead announcement of
    /// `step + 1` under the group's quorum (retried until `timeout` while the lighthouse is
    /// unreachable). Single-rank groups, which vote locally, ask this (their training thread
    /// through [`ManagerServer::may_commit_blocking`]); the ranks of larger groups get the
    /// same gate through `ShouldCommit`.
    pub async fn may_commit(&self, step: i64, timeout: Duration) -> Result<bool> {
        let announced = self
            .may_commit_via(&self.inner.lighthouse, step, timeout)
            .await?;
        Ok(announced == Announced::Accepted)
    }

    /// [`ManagerServer::may_commit`] for the hosting rank's own thread, outside any tokio
    /// runtime: blocks until the answer, the announcement going on a connection of this
    /// server's that the waiting thread drives itself (see `own_link`): the round trip
    /// wakes no runtime thread on either way. Same answers and deadline. A first try that
    /// gets no answer within [`OWN_LINK_TRY`] closes that connection, which may have gone
    /// silent (no keep-alive watches it), and the announcement is sent again, for the rest
    /// of the deadline, on the shared connection, as `may_commit` sends it (a lighthouse
    /// slower than that is still heard; an announcement may be repeated).
    ///
    /// # Errors
    /// As `may_commit`; `InvalidArgument` when called from inside a tokio runtime.
    pub fn may_commit_blocking(&self, step: i64, timeout: Duration) -> Result<bool> {
        own_link::outside_runtime("may_commit_blocking", "await may_commit")?;
        if *self.inner.shutdown.borrow() {
            return Ok(false); // as `may_commit` answers once the server is shut down
        }
        let link = &self.inner.own_link;
        if self.inner.commit_unsupported.load(Ordering::Relaxed) {
            // No announcement to send (an upstream lighthouse): the gate is local. The link
            // stays open for the group's quorum requests.
            return crate::runtime::get().block_on(self.may_commit(step, timeout));
        }
        let started = Instant::now();
        let first = timeout.min(OWN_LINK_TRY);
        let announced = match link
            .run(|lighthouse| async move { self.may_commit_via(&lighthouse, step, first).await })
        {
            Ok(announced) => announced?,
            // Shut down meanwhile: the answer is no, as above.
            Err(Error::Shutdown) => return Ok(false),
            Err(e) => return Err(e),
        };
        if announced != Announced::Unreached {
            return Ok(announced == Announced::Accepted);
        }
        // Nothing else would notice a connection that went silent: the next commit dials
        // anew, and this one goes on the shared connection, which keep-alive watches.
        link.close();
        let remaining = timeout.saturating_sub(started.elapsed());
        if remaining.is_zero() {
            self.inner.warn_unreached(step);
            return Ok(false);
        }
        info!(step, waited = ?first,
            "no answer to the commit announcement on the rank's own connection; closed it, \
             sending again on the shared connection");
        crate::runtime::get().block_on(self.may_commit(step, remaining))
    }

    /// Starts this rank's quorum request, as `ManagerClient::quorum` to this server would, on
    /// the calling thread (outside any tokio runtime) of a group whose only rank is the
    /// hosting one: the lighthouse request goes on the connection that thread drives (see
    /// `own_link`, and [`ManagerServer::may_commit_blocking`] for the other request on it).
    /// This drives it until the request is written, and returns; [`OwnQuorum::wait`] drives
    /// it again until the answer (a request left undriven for longer than a heartbeat
    /// interval is driven by a backstop thread meanwhile, so its answer is read in time). Same
    /// answers, errors and deadline as the client's call; a request whose connection fails
    /// or is closed under it is sent again on the shared connection for the rest of the
    /// deadline. While that connection is not connected (it is dialled by the rank's commit
    /// announcement), the request goes on the shared connection from the server's tasks,
    /// as a client's does.
    ///
    /// # Errors
    /// `InvalidArgument` in a group of several ranks (their round is answered once all
    /// have asked, on the server's tasks) or inside a tokio runtime; `Shutdown` once the
    /// server shuts down.
    pub fn quorum_start_blocking(
        &self,
        req: crate::proto::ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<OwnQuorum> {
        own_link::outside_runtime("quorum_start_blocking", "await ManagerClient::quorum")?;
        ensure!(
            self.inner.opts.world_size == 1,
            "quorum_start_blocking is for a group of one rank (this one has {}); its ranks ask \
             through a ManagerClient",
            self.inner.opts.world_size
        );
        // The registration ends when the server starts shutting down.
        let local =
            crate::client::in_process::find(&self.address, self.inner.opts.security.token.as_ref())
                .ok_or(Error::Shutdown)?;
        let started = self.inner.own_link.start({
            let (local, req, inner) = (local.clone(), req.clone(), self.inner.clone());
            move |attempt| async move {
                let on = attempt.clone();
                let answer = lighthouse::OWN_QUORUM
                    .scope(
                        attempt,
                        crate::client::ManagerClient::quorum_local(local, req, timeout),
                    )
                    .await;
                if matches!(answer, Err(Error::Timeout(_))) {
                    // Whichever deadline ended it: the connection may have gone silent,
                    // which nothing else would notice.
                    inner.own_link.close_for(&on);
                }
                answer
            }
        });
        match started {
            Ok(started) => Ok(OwnQuorum(Path::Own(started))),
            // Not connected (the group's first step, or the first after the connection was
            // closed): dialling it now would keep the request from the wire until the rank
            // waits, maybe after a long first forward pass, while the other groups' round
            // waits for it. It goes on the shared connection, as from a client; the rank's
            // next commit announcement dials the own connection.
            Err(Error::Unavailable(_)) => {
                let call = crate::client::ManagerClient::quorum_local(local, req, timeout);
                Ok(OwnQuorum(Path::Spawned(Aborting(Some(
                    crate::runtime::get().spawn(call),
                )))))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the hosting rank's own connection (quorum requests, commit announcements) is
    /// open (for tests).
    pub fn own_commit_link_open(&self) -> bool {
        self.inner.own_link.is_open()
    }

    async fn may_commit_via(
        &self,
        lighthouse: &LighthouseClient,
        step: i64,
        timeout: Duration,
    ) -> Result<Announced> {
        self.inner.visit();
        self.inner.check_diverged()?;
        if !self.inner.lease_held() {
            return Ok(Announced::Refused);
        }
        Ok(tokio::select! {
            announced = self.inner.announce_commit_via(lighthouse, step, timeout) => announced,
            _ = shutting_down(self.inner.shutdown.clone()) => Announced::Refused,
        })
    }

    /// Takes the hosting rank's digest of its committed state after `step` (runtime state
    /// parity; other ranks hand theirs over with their commit votes).
    pub fn offer_digest(&self, group_rank: i64, step: i64, digest: Vec<u8>) -> Result<()> {
        self.inner
            .digests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .offer(group_rank, step, digest)
    }

    /// Notes the hosting rank's quorum wait in `step` (its committed step count before the
    /// step), sent with that step's commit announcement: the lighthouse accounts a step whose
    /// telemetry report is lost with a killed process with it (goodput).
    pub fn note_step_wait(&self, step: i64, seconds: f64) -> Result<()> {
        ensure!(step >= 0, "step must not be negative, got {step}");
        ensure!(
            seconds.is_finite() && seconds >= 0.0,
            "the quorum wait must be a finite number of seconds, not negative, got {seconds}"
        );
        *self
            .inner
            .step_wait
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some((step, seconds));
        Ok(())
    }

    /// Notes that the group has committed `step` (called by the hosting rank after each
    /// commit): heartbeats report it, so the lighthouse knows this group's progress between
    /// quorum requests. Negative values are ignored.
    pub fn note_committed_step(&self, step: i64) {
        if step >= 0 {
            self.inner.committed_step.store(step, Ordering::Relaxed);
        }
    }

    /// The address other groups and this group's ranks dial: `http://{hostname}:{port}`.
    pub fn address(&self) -> String {
        self.address.clone()
    }

    /// Stops serving: pending quorum and commit waits end with `Shutdown`, the heartbeat loop
    /// stops, open connections get a bounded grace period. Idempotent.
    pub async fn shutdown(&self) {
        crate::client::in_process::unregister(&self.address);
        if !*self.shutdown_tx.borrow() {
            // The ranks' last words (e.g. "finished") reach the lighthouse before the session
            // ends.
            self.inner.flush_reports().await;
        }
        let _ = self.shutdown_tx.send(true);
        self.inner.own_link.close_for_good();
        self.inner.gather.fail_all();
        self.inner.barrier.fail_all();
        let tasks: Vec<JoinHandle<()>> = {
            let mut guard = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
            guard.drain(..).collect()
        };
        for mut task in tasks {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
            {
                warn!("manager server task did not stop in time; aborting it");
                task.abort();
            }
        }
        debug!(address = %self.address, "manager server stopped");
    }
}

impl Drop for ManagerServer {
    fn drop(&mut self) {
        crate::client::in_process::unregister(&self.address);
        let _ = self.shutdown_tx.send(true);
    }
}

impl Inner {
    /// The group's training loop reached this server now.
    fn visit(&self) {
        *self.loop_visit.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// How long ago (as of `now`) the loop last reached this server: zero while a heal is in
    /// progress, None before its first visit.
    fn loop_idle(&self, now: Instant) -> Option<Duration> {
        if self.loop_busy.load(Ordering::Relaxed) > 0 {
            return Some(Duration::ZERO);
        }
        self.loop_visit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|at| now.saturating_duration_since(at))
    }

    /// Records the lighthouse's hang verdict for this group, logging its changes.
    fn set_hung(&self, hung: Option<String>) {
        let mut slot = self.hung.lock().unwrap_or_else(|p| p.into_inner());
        match (&*slot, &hung) {
            (None, Some(why)) => {
                warn!(replica_id = %self.opts.replica_id, "the lighthouse holds this group hung: {why}")
            }
            (Some(_), None) => {
                info!(replica_id = %self.opts.replica_id, "the lighthouse no longer holds this group hung")
            }
            _ => {}
        }
        *slot = hung;
    }

    /// Takes a heartbeat reply's parity verdicts (see [`ParityVerdicts`]).
    fn note_parity(&self, ack: &crate::client::lighthouse::HeartbeatAck) {
        if ack.timeout.is_none() {
            return; // a lighthouse that does not say (upstream)
        }
        let mut v = self.parity.lock().unwrap_or_else(|p| p.into_inner());
        v.checked = true;
        v.ok_step = v.ok_step.max(ack.parity_ok_step);
        v.diverged_step = v.diverged_step.max(ack.parity_diverged_step);
    }

    /// Records that the parity check stopped this group (once; it is never lifted).
    fn set_diverged(&self, why: String) {
        let mut slot = self.diverged.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            error!(replica_id = %self.opts.replica_id,
                "the lighthouse stopped this group: {why}");
            *slot = Some(why);
            // Ranks already waiting in the commit vote get "no" now; their next call raises.
            self.barrier.abort_round();
        }
    }

    /// Fails with the parity stop, if this group was stopped.
    fn check_diverged(&self) -> Result<()> {
        match &*self.diverged.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(Error::Diverged(why.clone())),
            None => Ok(()),
        }
    }

    /// A member of a quorum was declared lost: ranks learn it through `WatchEvents`, and a
    /// commit vote of the current quorum in progress is decided "no" at once (a rank of this
    /// group may be held up by the lost peer; the step cannot commit anyway).
    fn on_lost(&self, lost: LostEvent) {
        if lost.quorum_id == self.quorum_id.load(Ordering::Relaxed) {
            if let Some(step) = self.barrier.abort_round() {
                info!(step, lost = %lost.replica_id, "commit vote ended: a quorum member was lost");
            }
        }
        self.events.push(lost);
    }

    /// Sends the queued telemetry reports now (bounded by [`REPORT_FLUSH`]).
    async fn flush_reports(&self) {
        self.reports.flush(&self.lighthouse, REPORT_FLUSH).await;
    }

    /// A report about the whole group from the server itself (e.g. it is being killed).
    fn group_report(&self, phase: crate::proto::telemetry_report::Phase, error: String) {
        let id = &self.opts.replica_id;
        self.reports.push(TelemetryReport {
            replica_id: base_id(id).to_string(),
            incarnation: id.clone(),
            group_rank: 0,
            group_world_size: i64::try_from(self.opts.world_size).unwrap_or(i64::MAX),
            rank: -1,
            hostname: self.opts.hostname.clone(),
            pid: std::process::id(),
            phase: phase as i32,
            error,
            unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            ..Default::default()
        });
    }

    fn lease_held(&self) -> bool {
        let held = self
            .lease
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .held(Instant::now());
        if !held {
            warn!(replica_id = %self.opts.replica_id,
                "heartbeats lapsed during this step (the group may have been declared lost); \
                 voting not to commit");
        }
        held
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_brackets_ipv6() {
        assert_eq!(http_address("host", 5, false), "http://host:5");
        assert_eq!(http_address("::1", 5, false), "http://[::1]:5");
        assert_eq!(http_address("[::1]", 5, false), "http://[::1]:5");
        assert_eq!(http_address("host", 5, true), "https://host:5");
    }

    #[tokio::test]
    async fn start_refuses_bad_options() {
        let ok = ManagerOptions {
            replica_id: "a".into(),
            lighthouse_addr: "127.0.0.1:1".into(),
            bind: "127.0.0.1:0".into(),
            ..ManagerOptions::default()
        };
        for bad in [
            ManagerOptions {
                world_size: 0,
                ..ok.clone()
            },
            ManagerOptions {
                replica_id: String::new(),
                ..ok.clone()
            },
            ManagerOptions {
                lighthouse_addr: String::new(),
                ..ok.clone()
            },
            ManagerOptions {
                heartbeat_interval: Duration::ZERO,
                ..ok.clone()
            },
        ] {
            assert!(matches!(
                ManagerServer::start(bad).await,
                Err(Error::InvalidArgument(_))
            ));
        }
    }
}
