//! The manager server's gRPC service, its lighthouse calls and its heartbeat loop.
//!
//! One quorum round: every group rank calls `Quorum`; the rank that completes the round
//! triggers ONE lighthouse request (retried `quorum_retries` times with backoff, bounded by the
//! longest deadline of the waiting ranks); each rank then gets its own answer from
//! [`compute_quorum_results`]. If the lighthouse call fails, every waiting rank gets the error at
//! once. Every rank's request honours its own deadline and leaves the round when it expires.
//!
//! The lighthouse channel is lazy and reconnects by itself, so the server starts while the
//! lighthouse is down and recovers when it comes back on the same address.
//!
//! The server also holds a session with the lighthouse for its life (reopened with backoff
//! when the lighthouse restarts): its end tells the lighthouse this group died, and it brings
//! the lighthouse's lost-member events, which ranks collect with the `WatchEvents` long-poll.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tonic::{Request, Response, Status};
use tracing::{debug, error, info, warn};

use super::commit::CommitBarrier;
use super::compute::compute_quorum_results;
use super::gather::{LeaveGuard, QuorumGather, ReadyRound};
use super::parity::DigestCollector;
use super::reports::ReportQueue;
use super::topology::{member_data, source_choice, SourceChoice};
use super::{rpc_error, server_budget, ManagerOptions, DEFAULT_REQUEST_TIMEOUT};
use crate::client::LighthouseClient;
use crate::error::{Error, Result};
use crate::net::{request_timeout, Backoff};
use crate::proto::manager_service_server::{ManagerService, ManagerServiceServer};
use crate::proto::{
    CheckpointMetadataRequest, CheckpointMetadataResponse, KillRequest, KillResponse, LostEvent,
    ManagerQuorumRequest, ManagerQuorumResponse, Quorum, QuorumMember, ShouldCommitRequest,
    ShouldCommitResponse, TelemetryAck, TelemetryBatch, TelemetryReport, WatchEventsRequest,
    WatchEventsResponse,
};
use crate::security::server::{Guard, OpenRoutes};
use crate::telemetry::{base_id, validate_batch};

/// How often the ranks' telemetry reports are forwarded to the lighthouse.
const REPORT_INTERVAL: Duration = Duration::from_millis(250);
/// Bound on one telemetry send to the lighthouse.
const REPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on the last telemetry flush at shutdown or kill.
const REPORT_FLUSH: Duration = Duration::from_secs(1);

/// How long a graceful shutdown waits for open connections before closing them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Lost-member events kept for ranks that poll late (events are rare: one per lost peer).
const EVENT_HISTORY: usize = 64;

/// The lost-member events received from the lighthouse, numbered from 1, with a watch of the
/// last number so long-polls wake up when one arrives.
#[derive(Debug)]
struct EventLog {
    events: Mutex<VecDeque<(u64, LostEvent)>>,
    last: watch::Sender<u64>,
}

impl EventLog {
    fn new() -> Self {
        Self {
            events: Mutex::new(VecDeque::new()),
            last: watch::channel(0).0,
        }
    }

    fn push(&self, event: LostEvent) {
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let seq = *self.last.borrow() + 1;
        events.push_back((seq, event));
        while events.len() > EVENT_HISTORY {
            events.pop_front();
        }
        self.last.send_replace(seq);
    }

    /// Buffered events after `after` and the number of the last one (`after` if none).
    fn after(&self, after: u64) -> (Vec<LostEvent>, u64) {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = after;
        let found = events
            .iter()
            .filter(|(seq, _)| *seq > after)
            .map(|(seq, e)| {
                last = *seq;
                e.clone()
            })
            .collect();
        (found, last)
    }

    /// Waits until there are events after `after` or `deadline` passes.
    async fn wait(&self, after: u64, deadline: Instant) -> (Vec<LostEvent>, u64) {
        let mut rx = self.last.subscribe();
        let _ = tokio::time::timeout_at(deadline, rx.wait_for(|last| *last > after)).await;
        self.after(after)
    }
}

/// Whether this group may still count itself a live member of its quorum (a fence against
/// committing a step the other members abandoned).
///
/// A group frozen (e.g. SIGSTOP) for the lighthouse's heartbeat timeout is declared lost and
/// the others abort the step; when it resumes it may still complete that step's collectives
/// from data already buffered, so it must not commit it. The lease is held while heartbeat
/// acknowledgements arrive without a gap longer than half the lighthouse's heartbeat timeout
/// (measured from when each acknowledged heartbeat was sent, on the monotonic clock, which a
/// frozen process does not stop).
#[derive(Debug, Default)]
struct Lease {
    /// The lighthouse's heartbeat timeout (None until a lighthouse said it).
    timeout: Option<Duration>,
    /// When the last acknowledged heartbeat was sent.
    last_ack_sent: Option<Instant>,
    /// When a gap longer than the lease was last seen.
    broken_at: Option<Instant>,
    /// When the last quorum was received (the start of the current step's membership).
    quorum_at: Option<Instant>,
}

impl Lease {
    fn lease(timeout: Duration) -> Duration {
        timeout / 2
    }

    /// A heartbeat sent at `sent` was acknowledged by a lighthouse with `timeout`.
    fn on_ack(&mut self, sent: Instant, timeout: Option<Duration>) {
        if timeout.is_some() {
            self.timeout = timeout;
        }
        if let (Some(prev), Some(t)) = (self.last_ack_sent, self.timeout) {
            if sent.saturating_duration_since(prev) > Self::lease(t) {
                self.broken_at = Some(sent);
            }
        }
        if self.last_ack_sent.is_none_or(|prev| sent > prev) {
            self.last_ack_sent = Some(sent);
        }
    }

    /// True unless the lease lapsed since the last quorum (or is lapsing now).
    fn held(&self, now: Instant) -> bool {
        let Some(t) = self.timeout else {
            return true; // a lighthouse that does not state its timeout: no fence
        };
        let Some(last) = self.last_ack_sent else {
            return true;
        };
        if now.saturating_duration_since(last) > Self::lease(t) {
            return false;
        }
        match (self.broken_at, self.quorum_at) {
            (Some(broken), Some(quorum)) => broken < quorum,
            (Some(_), None) => false,
            (None, _) => true,
        }
    }
}

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

/// A quorum request waiting at the lighthouse longer than this says why in the log (a
/// second after the lighthouse starts to say why its round waits, so heartbeat replies
/// have brought the reason by then) ...
const QUORUM_WAIT_NOTE_AFTER: Duration = Duration::from_secs(3);

/// ... and again this often while it keeps waiting.
const QUORUM_WAIT_NOTE_EVERY: Duration = Duration::from_secs(10);

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
        if opts.world_size == 0 {
            return Err(Error::InvalidArgument(
                "world_size must be at least 1".into(),
            ));
        }
        if opts.replica_id.is_empty() {
            return Err(Error::InvalidArgument(
                "replica_id must not be empty".into(),
            ));
        }
        if opts.hostname.is_empty() {
            return Err(Error::InvalidArgument("hostname must not be empty".into()));
        }
        if opts.heartbeat_interval.is_zero() {
            return Err(Error::InvalidArgument(
                "heartbeat_interval must be positive".into(),
            ));
        }
        if opts.connect_timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "connect_timeout must be positive".into(),
            ));
        }
        if opts.max_request_bytes < MIN_REQUEST_LIMIT {
            return Err(Error::InvalidArgument(format!(
                "max_request_bytes must be at least {MIN_REQUEST_LIMIT}"
            )));
        }
        if let Some(p) = &opts.placement {
            p.topology.check_group(p.group, opts.world_size)?;
        }
        let tls = crate::security::server::acceptor(&opts.security)?;
        let endpoint = crate::security::client::endpoint(
            &opts.lighthouse_addr,
            opts.connect_timeout,
            &opts.security,
        )
        .map_err(|e| Error::InvalidArgument(format!("lighthouse address: {}", e.message())))?;
        let lighthouse_addr = endpoint.uri().to_string();
        let lighthouse =
            LighthouseClient::from_channel(endpoint.connect_lazy(), opts.security.token.as_ref());

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
            shutdown: shutdown_rx.clone(),
            reports: ReportQueue::default(),
            committed_step: AtomicI64::new(-1),
            quorum_id: AtomicI64::new(-1),
            commit_unsupported: AtomicBool::new(false),
            topology_unused: AtomicBool::new(false),
            lighthouse_waiting: Mutex::new(None),
            loop_visit: Mutex::new(None),
            loop_busy: AtomicUsize::new(0),
            hung: Mutex::new(None),
            digests: Mutex::new(DigestCollector::new(opts.world_size)),
            diverged: Mutex::new(None),
            opts,
        });

        let service = ManagerServiceServer::new(Service {
            inner: inner.clone(),
        })
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
        let heartbeat = tokio::spawn(heartbeat_loop(inner.clone()));
        let session = tokio::spawn(session_loop(inner.clone()));
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
    /// unreachable). Single-rank groups, which vote locally, ask this; the ranks of larger
    /// groups get the same gate through `ShouldCommit`.
    pub async fn may_commit(&self, step: i64, timeout: Duration) -> Result<bool> {
        self.inner.visit();
        self.inner.check_diverged()?;
        if !self.inner.lease_held() {
            return Ok(false);
        }
        Ok(tokio::select! {
            ok = self.inner.announce_commit(step, timeout) => ok,
            _ = shutting_down(self.inner.shutdown.clone()) => false,
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
        if !*self.shutdown_tx.borrow() {
            // The ranks' last words (e.g. "finished") reach the lighthouse before the session
            // ends.
            self.inner.flush_reports().await;
        }
        let _ = self.shutdown_tx.send(true);
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
        let _ = self.shutdown_tx.send(true);
    }
}

/// Heartbeats the lighthouse every interval. Each attempt is bounded by the interval, so the
/// period holds while the lighthouse is down; the lazy channel reconnects when it is back.
async fn heartbeat_loop(inner: Arc<Inner>) {
    let period = inner.opts.heartbeat_interval;
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut shutdown = inner.shutdown.clone();
    let mut failing = false;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.wait_for(|down| *down) => return,
        }
        let sent = Instant::now();
        let step = inner.committed_step.load(Ordering::Relaxed);
        let digest = inner
            .digests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .to_send();
        let result = inner
            .lighthouse
            .heartbeat_digest(
                &inner.opts.replica_id,
                (step >= 0).then_some(step),
                inner.loop_idle(sent),
                digest,
                period,
            )
            .await;
        if result.is_err() {
            // A reason heard before the lighthouse went silent no longer holds.
            *inner
                .lighthouse_waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = None;
        }
        match result {
            Ok(ack) => {
                inner
                    .lease
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .on_ack(sent, ack.timeout);
                *inner
                    .lighthouse_waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = ack.waiting;
                inner.set_hung(ack.hung);
                inner
                    .digests
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .acknowledged(ack.parity_step);
                if let Some(why) = ack.diverged {
                    inner.set_diverged(why);
                }
                if failing {
                    info!(lighthouse = %inner.lighthouse_addr, "lighthouse heartbeat recovered");
                    failing = false;
                }
            }
            Err(status) if status.code() != tonic::Code::DeadlineExceeded => {
                if !failing {
                    warn!(lighthouse = %inner.lighthouse_addr, error = %status.message(),
                        "lighthouse heartbeat failed; retrying every {period:?}");
                    failing = true;
                }
            }
            Err(_) => {
                if !failing {
                    warn!(lighthouse = %inner.lighthouse_addr,
                        "lighthouse heartbeat timed out; retrying every {period:?}");
                    failing = true;
                }
            }
        }
    }
}

/// Holds the session with the lighthouse open for the server's life, reopening it with
/// backoff (a lighthouse restart is not a death), and records the lost-member events it
/// brings. The session ends with the process, which tells the lighthouse at once.
async fn session_loop(inner: Arc<Inner>) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    let mut shutdown = inner.shutdown.clone();
    let open_timeout = inner.opts.connect_timeout.min(Duration::from_secs(5));
    let mut failing = false;
    loop {
        let opened = tokio::select! {
            r = inner.lighthouse.session(&inner.opts.replica_id, open_timeout) => r,
            _ = shutdown.wait_for(|down| *down) => return,
        };
        let ended = match opened {
            Ok(mut stream) => {
                info!(lighthouse = %inner.lighthouse_addr, "lighthouse session open");
                failing = false;
                backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
                loop {
                    let next = tokio::select! {
                        m = stream.message() => m,
                        _ = shutdown.wait_for(|down| *down) => return,
                    };
                    match next {
                        Ok(Some(event)) => {
                            if let Some(lost) = event.lost {
                                warn!(lost = %lost.replica_id, quorum_id = lost.quorum_id,
                                    "lighthouse reports a lost replica group");
                                inner.on_lost(lost);
                            }
                        }
                        Ok(None) => break "the lighthouse closed it".to_string(),
                        Err(status) => break status.message().to_string(),
                    }
                }
            }
            Err(status) => status.message().to_string(),
        };
        if !failing {
            warn!(lighthouse = %inner.lighthouse_addr, reason = %ended,
                "lighthouse session ended; reopening");
            failing = true;
        }
        let delay = backoff.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.wait_for(|down| *down) => return,
        }
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

    /// The write-ahead commit: tells the lighthouse this group is about to commit `step + 1`
    /// under its quorum; true if the lighthouse accepted (or predates announcements). A
    /// refusal (the quorum was replaced, or the group was declared lost in it) and a
    /// lighthouse unreachable until `timeout` are a "no": the group rejoins and heals.
    async fn announce_commit(&self, step: i64, timeout: Duration) -> bool {
        if self.commit_unsupported.load(Ordering::Relaxed) {
            return true;
        }
        let quorum_id = self.quorum_id.load(Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                warn!(step, quorum_id, lighthouse = %self.lighthouse_addr,
                    "cannot reach the lighthouse to announce the commit; not committing");
                return false;
            }
            let answer = self
                .lighthouse
                .commit(&self.opts.replica_id, quorum_id, step + 1, remaining)
                .await;
            let status = match answer {
                Ok(None) => return true,
                Ok(Some(reason)) => {
                    warn!(step, quorum_id, reason = %reason,
                        "the lighthouse refused the commit; rejoining to heal");
                    return false;
                }
                Err(status) => status,
            };
            match status.code() {
                tonic::Code::Unimplemented => {
                    if !self.commit_unsupported.swap(true, Ordering::Relaxed) {
                        warn!(lighthouse = %self.lighthouse_addr,
                            "the lighthouse does not take commit announcements (an older or \
                             upstream lighthouse): committing without them, so a group frozen \
                             mid-step may commit a step the others redid");
                    }
                    return true;
                }
                tonic::Code::InvalidArgument
                | tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied => {
                    warn!(step, error = %status.message(), "commit announcement refused");
                    return false;
                }
                _ => {
                    let delay = backoff.next_delay();
                    debug!(step, error = %status.message(),
                        "commit announcement failed; retrying in {delay:?}");
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(delay.min(remaining)).await;
                }
            }
        }
    }

    /// Warns (once per manager) when this group has a topology file that `quorum` does not
    /// use for choosing heal sources.
    fn warn_if_topology_unused(&self, quorum: &Quorum) {
        let Some(placement) = &self.opts.placement else {
            return;
        };
        let participants: Vec<&QuorumMember> = quorum.participants.iter().collect();
        let choice = source_choice(&participants, Some(&*placement.topology));
        if choice != SourceChoice::TopologyFile
            && !self.topology_unused.swap(true, Ordering::Relaxed)
        {
            let fallback = match choice {
                SourceChoice::Hosts => "host locality",
                _ => "round-robin (a member of an older or upstream build)",
            };
            warn!(
                quorum_id = quorum.quorum_id,
                digest = placement.topology.digest(),
                "the quorum's members do not all announce this topology file (a member without \
                 one, with another file, or with the same replica group index); heal sources \
                 are chosen by {fallback} (warned once)"
            );
        }
    }

    /// Asks the lighthouse for the quorum of `round`, retrying with backoff.
    async fn lighthouse_quorum(&self, round: &ReadyRound) -> Result<Quorum> {
        let member = QuorumMember {
            replica_id: self.opts.replica_id.clone(),
            address: self.address.clone(),
            store_address: self.opts.store_addr.clone(),
            step: round.step,
            world_size: self.opts.world_size,
            shrink_only: round.shrink_only,
            commit_failures: round.commit_failures,
            data: member_data(self.opts.placement.as_ref()),
        };
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        let mut attempt: u64 = 0;
        let asked = Instant::now();
        let mut next_note = asked + QUORUM_WAIT_NOTE_AFTER;
        loop {
            let remaining = round.deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(Error::Timeout(format!(
                    "lighthouse quorum at {} did not answer before the ranks' deadline",
                    self.lighthouse_addr
                )));
            }
            let started = Instant::now();
            let call = self.lighthouse.quorum_status(member.clone(), remaining);
            tokio::pin!(call);
            let answer = loop {
                tokio::select! {
                    answer = &mut call => break answer,
                    _ = tokio::time::sleep_until(next_note) => {
                        self.note_quorum_wait(round, asked.elapsed());
                        next_note += QUORUM_WAIT_NOTE_EVERY;
                    }
                }
            };
            let err = match answer {
                Ok(quorum) => return Ok(quorum),
                Err(status) => rpc_error(status, started, remaining),
            };
            match err {
                Error::Timeout(_) | Error::InvalidArgument(_) | Error::FailedPrecondition(_) => {
                    return Err(err)
                }
                Error::Diverged(why) => {
                    self.set_diverged(why.clone());
                    return Err(Error::Diverged(why));
                }
                _ => {}
            }
            if attempt >= self.opts.quorum_retries {
                return Err(Error::Unavailable(format!(
                    "lighthouse quorum request to {} failed after {} attempt(s): {}",
                    self.lighthouse_addr,
                    attempt + 1,
                    err.message()
                )));
            }
            attempt += 1;
            let delay = backoff.next_delay();
            warn!(
                lighthouse = %self.lighthouse_addr, attempt, error = %err,
                "lighthouse quorum request failed; retrying in {delay:?}"
            );
            let remaining = round.deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(delay.min(remaining)).await;
        }
    }

    /// Says at WARN that this group's quorum request has waited `waited` at the lighthouse,
    /// and why, as the lighthouse's heartbeat replies tell it.
    fn note_quorum_wait(&self, round: &ReadyRound, waited: Duration) {
        let why = self
            .lighthouse_waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| {
                "the lighthouse has not said why (it is not reachable, predates this report, \
                 or its round is about to end)"
                    .to_string()
            });
        let deadline_in = round.deadline.saturating_duration_since(Instant::now());
        warn!(
            step = round.step,
            lighthouse = %self.lighthouse_addr,
            "quorum request waiting {:.1}s (deadline in {:.1}s): {why}",
            waited.as_secs_f64(),
            deadline_in.as_secs_f64()
        );
    }

    /// Runs the lighthouse request of a complete round and answers every rank of it.
    async fn answer_round(self: Arc<Self>, round: ReadyRound) {
        self.committed_step.store(round.step, Ordering::Relaxed);
        let result = tokio::select! {
            r = self.lighthouse_quorum(&round) => r,
            _ = shutting_down(self.shutdown.clone()) => Err(Error::Shutdown),
        };
        match result {
            Ok(quorum) => {
                self.quorum_id.store(quorum.quorum_id, Ordering::Relaxed);
                // A step whose vote was ended by a lost member is retried in this quorum.
                self.barrier.new_quorum();
                self.lease
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .quorum_at = Some(Instant::now());
                debug!(
                    quorum_id = quorum.quorum_id,
                    step = round.step,
                    participants = quorum.participants.len(),
                    "quorum received"
                );
                self.warn_if_topology_unused(&quorum);
                for (rank, tx) in round.replies {
                    let answer = compute_quorum_results(
                        &self.opts.replica_id,
                        rank,
                        &quorum,
                        round.init_sync,
                        self.opts.placement.as_ref().map(|p| &*p.topology),
                    );
                    let _ = tx.send(answer);
                }
            }
            Err(e) => {
                warn!(step = round.step, error = %e, "quorum round failed");
                for (_, tx) in round.replies {
                    let _ = tx.send(Err(e.duplicate()));
                }
            }
        }
    }

    /// Waits for a rank's answer until `deadline`, or until shutdown.
    async fn await_answer<T>(
        &self,
        rx: oneshot::Receiver<Result<T>>,
        deadline: Instant,
        timeout: Duration,
        what: &str,
    ) -> Result<T> {
        tokio::select! {
            r = tokio::time::timeout_at(deadline, rx) => match r {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(Error::Shutdown),
                Err(_) => Err(Error::timeout(what, timeout)),
            },
            _ = shutting_down(self.shutdown.clone()) => Err(Error::Shutdown),
        }
    }
}

/// The tonic service; a thin layer over [`Inner`].
#[derive(Debug)]
struct Service {
    inner: Arc<Inner>,
}

#[tonic::async_trait]
impl ManagerService for Service {
    async fn quorum(
        &self,
        request: Request<ManagerQuorumRequest>,
    ) -> Result<Response<ManagerQuorumResponse>, Status> {
        let timeout = server_budget(request_timeout(&request).unwrap_or(DEFAULT_REQUEST_TIMEOUT));
        let deadline = Instant::now() + timeout;
        let req = request.into_inner();
        let inner = &self.inner;
        inner.visit();
        inner.check_diverged()?;
        let joined = inner.gather.join(&req, deadline)?;
        let _guard = LeaveGuard {
            gather: &inner.gather,
            group_rank: req.group_rank,
            ticket: joined.ticket,
        };
        if let Some(round) = joined.ready {
            if round.replies.len() == 1 {
                // Only this rank waits: answer inline (no extra task on the hot path). The
                // deadline below still bounds it.
                let what = format!("quorum (group rank {}, step {})", req.group_rank, req.step);
                let fut = inner.clone().answer_round(round);
                return tokio::select! {
                    _ = fut => inner.await_answer(joined.rx, deadline, timeout, &what).await,
                    _ = tokio::time::sleep_until(deadline) => Err(Error::timeout(&what, timeout)),
                }
                .map(Response::new)
                .map_err(Status::from);
            }
            // Several ranks wait on this round: it must outlive this request.
            tokio::spawn(inner.clone().answer_round(round));
        }
        let what = format!("quorum (group rank {}, step {})", req.group_rank, req.step);
        inner
            .await_answer(joined.rx, deadline, timeout, &what)
            .await
            .map(Response::new)
            .map_err(Status::from)
    }

    async fn checkpoint_metadata(
        &self,
        request: Request<CheckpointMetadataRequest>,
    ) -> Result<Response<CheckpointMetadataResponse>, Status> {
        let rank = request.get_ref().rank;
        let checkpoint_metadata = self.inner.gather.checkpoint_metadata(rank)?;
        Ok(Response::new(CheckpointMetadataResponse {
            checkpoint_metadata,
        }))
    }

    async fn should_commit(
        &self,
        request: Request<ShouldCommitRequest>,
    ) -> Result<Response<ShouldCommitResponse>, Status> {
        let timeout = server_budget(request_timeout(&request).unwrap_or(DEFAULT_REQUEST_TIMEOUT));
        let req = request.into_inner();
        self.inner.visit();
        if !req.digest.is_empty() {
            let offered = self
                .inner
                .digests
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .offer(req.group_rank, req.digest_step, req.digest);
            if let Err(e) = offered {
                warn!(group_rank = req.group_rank, "state digest refused: {e}");
            }
        }
        self.inner.check_diverged()?;
        let local = req.should_commit && self.inner.lease_held();
        let inner = self.inner.clone();
        let vote = self.inner.barrier.vote_gated(
            req.group_rank,
            req.step,
            local,
            timeout,
            move |step, gate_budget| async move {
                tokio::select! {
                    ok = inner.announce_commit(step, gate_budget) => ok,
                    _ = shutting_down(inner.shutdown.clone()) => false,
                }
            },
        );
        let should_commit = tokio::select! {
            r = vote => r?,
            _ = shutting_down(self.inner.shutdown.clone()) => return Err(Error::Shutdown.into()),
        };
        Ok(Response::new(ShouldCommitResponse { should_commit }))
    }

    async fn watch_events(
        &self,
        request: Request<WatchEventsRequest>,
    ) -> Result<Response<WatchEventsResponse>, Status> {
        let timeout = server_budget(request_timeout(&request).unwrap_or(DEFAULT_REQUEST_TIMEOUT));
        let after = request.into_inner().after_seq;
        let deadline = Instant::now() + timeout;
        let (events, last_seq) = tokio::select! {
            r = self.inner.events.wait(after, deadline) => r,
            _ = shutting_down(self.inner.shutdown.clone()) => return Err(Error::Shutdown.into()),
        };
        Ok(Response::new(WatchEventsResponse { events, last_seq }))
    }

    async fn report(
        &self,
        request: Request<TelemetryBatch>,
    ) -> Result<Response<TelemetryAck>, Status> {
        let batch = request.into_inner();
        validate_batch(&batch)?;
        let own = &self.inner.opts.replica_id;
        if let Some(r) = batch
            .reports
            .iter()
            .find(|r| !r.incarnation.is_empty() && r.incarnation != *own)
        {
            return Err(Error::InvalidArgument(format!(
                "telemetry report for {:?} sent to the manager of {own:?}",
                r.incarnation
            ))
            .into());
        }
        let mut accepted = 0u32;
        for r in batch.reports {
            if self.inner.reports.push(r) {
                accepted += 1;
            }
        }
        self.inner.reports.count_dropped(batch.dropped);
        Ok(Response::new(TelemetryAck { accepted }))
    }

    async fn kill(&self, request: Request<KillRequest>) -> Result<Response<KillResponse>, Status> {
        let msg = request.into_inner().msg;
        warn!(replica_id = %self.inner.opts.replica_id, reason = %msg,
            "kill requested; ending this process");
        // The process ends now: make the reason visible even without a log subscriber.
        eprintln!(
            "torchft manager {}: kill requested: {msg}",
            self.inner.opts.replica_id
        );
        // Tell the lighthouse why this group is about to vanish, give the response a moment
        // to reach the caller, then end the process.
        self.inner.group_report(
            crate::proto::telemetry_report::Phase::Failed,
            format!("killed: {msg}"),
        );
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let flushed = inner.flush_reports();
            let _ = tokio::join!(flushed, tokio::time::sleep(Duration::from_millis(50)));
            std::process::exit(1);
        });
        Ok(Response::new(KillResponse {}))
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
    async fn event_log_numbers_keeps_and_wakes() {
        let log = Arc::new(EventLog::new());
        let ev = |id: &str| LostEvent {
            replica_id: id.into(),
            quorum_id: 7,
        };
        // Nothing yet: the wait ends at its deadline with nothing.
        let (none, last) = log
            .wait(0, Instant::now() + Duration::from_millis(20))
            .await;
        assert!(none.is_empty());
        assert_eq!(last, 0);
        // A waiter wakes when an event arrives.
        let waiter = {
            let log = log.clone();
            tokio::spawn(async move { log.wait(0, Instant::now() + Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        log.push(ev("a"));
        let (got, last) = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, vec![ev("a")]);
        assert_eq!(last, 1);
        log.push(ev("b"));
        assert_eq!(log.after(0), (vec![ev("a"), ev("b")], 2));
        assert_eq!(log.after(1), (vec![ev("b")], 2));
        assert_eq!(log.after(2), (vec![], 2));
        // The history is bounded.
        for _ in 0..2 * EVENT_HISTORY {
            log.push(ev("c"));
        }
        let (kept, last) = log.after(0);
        assert_eq!(kept.len(), EVENT_HISTORY);
        assert_eq!(last, 2 + 2 * EVENT_HISTORY as u64);
    }

    #[test]
    fn lease_lapses_with_a_heartbeat_gap_during_the_step() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut l = Lease::default();
        // No lighthouse timeout known: no fence.
        assert!(l.held(t0));
        l.on_ack(t0, Some(ms(2000)));
        l.quorum_at = Some(t0 + ms(10));
        // Regular acks every 100 ms: held.
        for i in 1..=20 {
            l.on_ack(t0 + ms(100 * i), None);
            assert!(l.held(t0 + ms(100 * i + 50)));
        }
        let last = t0 + ms(2000);
        // Frozen: no ack for more than half the timeout → not held while it lasts ...
        assert!(l.held(last + ms(900)));
        assert!(!l.held(last + ms(1100)));
        // ... nor after a fresh ack, for the rest of this step ...
        l.on_ack(last + ms(3000), None);
        assert!(!l.held(last + ms(3010)));
        // ... until the next quorum.
        l.quorum_at = Some(last + ms(3100));
        assert!(l.held(last + ms(3150)));
        // An ack older than the newest does not move it back.
        l.on_ack(last + ms(2500), None);
        assert_eq!(l.last_ack_sent, Some(last + ms(3000)));
    }

    #[test]
    fn duplicate_keeps_the_kind() {
        assert!(Error::Timeout("x".into()).duplicate().is_timeout());
        assert!(matches!(
            Error::Unavailable("x".into()).duplicate(),
            Error::Unavailable(m) if m == "x"
        ));
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
