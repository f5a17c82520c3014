//! A client of the lighthouse gRPC service (used by manager servers, tools and tests).
//!
//! The client keeps the last full quorum it received and tells the lighthouse which one it
//! holds (`known_quorum_id`, `known_revision`), so in the steady state the lighthouse answers
//! with the compact form (steps only, O(1) bytes when every member is at the same step; a
//! delta of the changed members when the membership or a member's fields changed). The
//! client expands compact replies back into full quorums: callers always see a full
//! [`Quorum`]. A compact reply that cannot be expanded is never guessed at: the client asks
//! again without `known_*` and gets the full form.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::Status;
use tracing::warn;

use super::compact;
use crate::error::{Error, Result};
use crate::net::with_timeout;
use crate::proto::lighthouse_service_client::LighthouseServiceClient;
use crate::proto::{
    CompactSteps, LighthouseHeartbeatRequest, LighthouseQuorumRequest, Quorum, QuorumMember,
    SessionEvent, SessionRequest, TelemetryBatch,
};
use crate::security::client::{authenticated, AuthChannel};
use crate::security::Token;

/// A cheap-to-clone handle on one lighthouse connection (HTTP/2 multiplexes the calls).
///
/// Clones share the cache of the last full quorum received.
#[derive(Debug, Clone)]
pub struct LighthouseClient {
    client: LighthouseServiceClient<AuthChannel>,
    known: Arc<Mutex<Option<Arc<Held>>>>,
    /// Id of the last quorum received (0: none). Unlike `known`, never forgotten: heartbeats
    /// carry it, and it tells a restarted lighthouse that the job ran before.
    last_quorum_id: Arc<AtomicI64>,
    /// The job (room) every request names; empty: the lighthouse's default room.
    job: Arc<str>,
    /// The commit stream (see [`LighthouseClient::commit`]), shared by clones.
    commits: Arc<tokio::sync::Mutex<CommitLink>>,
    /// The quorum stream, shared by clones (see [`LighthouseClient::quorum_on_stream`]).
    quorums: Arc<Mutex<QuorumLink>>,
}

/// A client's quorum stream to the lighthouse.
#[derive(Debug, Default)]
enum QuorumLink {
    /// Not open (never opened, or dropped after a failure or a timeout): the next request
    /// opens one.
    #[default]
    Closed,
    /// Open and idle: requests go in `tx`, their answers come out of `rx` in order.
    Open {
        tx: tokio::sync::mpsc::Sender<crate::proto::QuorumStreamRequest>,
        rx: Box<tonic::Streaming<crate::proto::LighthouseQuorumResponse>>,
    },
    /// A request holds the stream (or is opening it): requests meanwhile go as calls.
    InUse,
    /// The lighthouse has no quorum stream (upstream's, or an older one of ours): quorum
    /// requests go as single calls for the rest of the client's life.
    Unsupported,
}

/// A request's hold on the quorum stream: the link is `InUse` while it lives, and `Closed`
/// again if the request ends without handing a stream back (a failure, or its future dropped
/// at a deadline).
struct StreamClaim<'a>(&'a Mutex<QuorumLink>);

impl StreamClaim<'_> {
    /// Ends the hold, leaving `link` in the slot.
    fn release(self, link: QuorumLink) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = link;
        std::mem::forget(self);
    }
}

impl Drop for StreamClaim<'_> {
    fn drop(&mut self) {
        let mut link = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*link, QuorumLink::InUse) {
            *link = QuorumLink::Closed;
        }
    }
}

/// A client's write-ahead commit stream to the lighthouse.
#[derive(Debug, Default)]
enum CommitLink {
    /// Not open (never opened, or dropped after a failure or a timeout): the next commit
    /// opens one.
    #[default]
    Closed,
    /// Open: announcements go in `tx`, their answers come out of `rx` in order.
    Open {
        tx: tokio::sync::mpsc::Sender<crate::proto::LighthouseCommitRequest>,
        rx: Box<tonic::Streaming<crate::proto::LighthouseCommitResponse>>,
    },
    /// The lighthouse has no commit stream (upstream's, or an older one of ours): commits
    /// go as single calls for the rest of the client's life (a lighthouse upgraded behind it
    /// gets calls too, which it still serves).
    Unsupported,
}

/// The last full quorum a client (and its clones) received.
#[derive(Debug)]
struct Held {
    quorum: Arc<Quorum>,
    /// The quorum's steps as the lighthouse summarises them, computed on first use.
    steps: OnceLock<CompactSteps>,
}

impl Held {
    /// True when `reply` is an abridged form of exactly the held quorum (same quorum_id and
    /// revision, the same step summary): a clone already expanded it, and it can be shared
    /// as it is instead of being rebuilt (an O(members) copy per clone).
    fn is(&self, reply: &Quorum) -> bool {
        let Some(c) = &reply.compact else {
            return false;
        };
        let q = &self.quorum;
        if reply.revision == 0 || q.quorum_id != reply.quorum_id || q.revision != reply.revision {
            return false;
        }
        let held = self.steps.get_or_init(|| compact::compact_steps(q));
        held.count == c.count
            && held.base_step == c.base_step
            && held.indices == c.indices
            && held.steps == c.steps
    }
}

/// A lighthouse's answer to a heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeartbeatAck {
    /// The lighthouse's heartbeat timeout (None if it does not say): the group cannot be
    /// declared lost by heartbeat expiry sooner than that after the heartbeat was sent.
    pub timeout: Option<Duration>,
    /// While the group's quorum request waits in a round that has waited long: why (None
    /// otherwise, and from lighthouses that do not say).
    pub waiting: Option<String>,
    /// While the lighthouse holds the group hung: why (None otherwise).
    pub hung: Option<String>,
    /// The step of the last state digest the lighthouse took from the group (0 = none).
    pub parity_step: i64,
    /// When the parity check stopped the group (its state differs from the others' with no
    /// majority): why (None otherwise).
    pub diverged: Option<String>,
    /// The newest step the parity check decided with the group's digest and no disagreement
    /// (0 = none, and from lighthouses that do not say).
    pub parity_ok_step: i64,
    /// The newest step at which the group's digest differed from the others' (0 = never).
    pub parity_diverged_step: i64,
}

impl LighthouseClient {
    /// A write-ahead commit: `replica_id` is about to commit `step` (its committed step count
    /// after the commit) under quorum `quorum_id`. `Ok(None)`: accepted; `Ok(Some(reason))`:
    /// refused, the group must not commit. An upstream lighthouse answers UNIMPLEMENTED.
    /// `quorum_wait_s`: group rank 0's quorum wait in the step (0: not known).
    ///
    /// Sent on the client's commit stream (opened on first use and kept, so a step costs one
    /// message each way and no new call); as a single Commit call where the lighthouse has no
    /// such stream. A stream that fails or does not answer within `timeout` is dropped (the
    /// next commit opens a new one): its answers could no longer be matched to announcements.
    pub async fn commit(
        &self,
        replica_id: &str,
        quorum_id: i64,
        step: i64,
        quorum_wait_s: f64,
        timeout: Duration,
    ) -> std::result::Result<Option<String>, Status> {
        let req = crate::proto::LighthouseCommitRequest {
            replica_id: replica_id.to_string(),
            quorum_id,
            step,
            quorum_wait_s,
            job: self.job.to_string(),
        };
        let deadline = || {
            Status::deadline_exceeded(format!(
                "lighthouse commit did not complete within {timeout:?}"
            ))
        };
        let started = Instant::now();
        let mut first = tokio::time::timeout(timeout, self.commit_on_stream(req.clone())).await;
        if let Ok(Some(Err(s))) = &first {
            // Failed in its transport, without an answer (a connection that closed under it
            // as the lighthouse restarted): once more, on a new stream. A status the
            // lighthouse sent has no source; an announcement is idempotent anyway (the same
            // step under the same quorum).
            if std::error::Error::source(s).is_some() {
                let remaining = timeout.saturating_sub(started.elapsed());
                first = tokio::time::timeout(remaining, self.commit_on_stream(req.clone())).await;
            }
        }
        let answer = match first {
            Ok(Some(answer)) => answer,
            Ok(None) => {
                let mut client = self.client.clone();
                let remaining = timeout.saturating_sub(started.elapsed());
                match tokio::time::timeout(remaining, client.commit(with_timeout(req, remaining)))
                    .await
                {
                    Ok(r) => r.map(|resp| resp.into_inner()),
                    Err(_) => return Err(deadline()),
                }
            }
            Err(_) => return Err(deadline()),
        };
        answer.map(|resp| (!resp.accepted).then_some(resp.reason))
    }

    /// `req` on the commit stream, opening it if needed; None when the lighthouse has no
    /// commit stream. The stream is taken out of the shared link while in use and put back
    /// only after a good answer, so a failure, or this future dropped at a timeout, drops it.
    async fn commit_on_stream(
        &self,
        req: crate::proto::LighthouseCommitRequest,
    ) -> Option<std::result::Result<crate::proto::LighthouseCommitResponse, Status>> {
        let mut link = self.commits.lock().await;
        let (tx, mut rx) = match std::mem::take(&mut *link) {
            CommitLink::Unsupported => {
                *link = CommitLink::Unsupported;
                return None;
            }
            CommitLink::Open { tx, rx } => {
                if tx.send(req).await.is_err() {
                    return Some(Err(Status::unavailable("the commit stream closed")));
                }
                (tx, rx)
            }
            CommitLink::Closed => {
                let (tx, announcements) = tokio::sync::mpsc::channel(1);
                // The first announcement waits in the channel until the call sends it.
                let _ = tx.send(req).await;
                let mut client = self.client.clone();
                let opened = client
                    .commit_stream(tokio_stream::wrappers::ReceiverStream::new(announcements))
                    .await;
                match opened {
                    Ok(r) => (tx, Box::new(r.into_inner())),
                    Err(s) if s.code() == tonic::Code::Unimplemented => {
                        *link = CommitLink::Unsupported;
                        return None;
                    }
                    Err(s) => return Some(Err(s)),
                }
            }
        };
        let answer = match rx.message().await {
            Ok(Some(answer)) => answer,
            Ok(None) => return Some(Err(Status::unavailable("the commit stream ended"))),
            Err(s) if s.code() == tonic::Code::Unimplemented => {
                *link = CommitLink::Unsupported;
                return None;
            }
            Err(s) => return Some(Err(s)),
        };
        *link = CommitLink::Open { tx, rx };
        Some(Ok(answer))
    }

    /// Sends a batch of telemetry reports; returns how many the lighthouse accepted.
    pub async fn report(&self, mut batch: TelemetryBatch, timeout: Duration) -> Result<u32> {
        let mut client = self.client.clone();
        batch.job = self.job.to_string();
        match tokio::time::timeout(timeout, client.report(with_timeout(batch, timeout))).await {
            Ok(Ok(r)) => Ok(r.into_inner().accepted),
            Ok(Err(status)) => Err(status.into()),
            Err(_) => Err(Error::timeout("lighthouse report", timeout)),
        }
    }

    dial_constructors!(|channel, _, _| Self::from_auth(channel));

    /// Wraps an existing channel (e.g. one shared by many clients, or a lazy one); every call
    /// carries `token` when given.
    pub fn from_channel(channel: Channel, token: Option<&Token>) -> Self {
        Self::from_auth(authenticated(channel, token))
    }

    /// Wraps a channel that already carries the token.
    fn from_auth(channel: AuthChannel) -> Self {
        Self {
            client: LighthouseServiceClient::new(channel)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
            known: Arc::new(Mutex::new(None)),
            last_quorum_id: Arc::new(AtomicI64::new(0)),
            job: Arc::from(""),
            commits: Arc::default(),
            quorums: Arc::default(),
        }
    }

    /// This client with every request naming `job` (the lighthouse room it belongs to; empty
    /// is the default room). Refused when the name is not a valid job name (see
    /// [`crate::ids::validate_job`]).
    pub fn with_job(mut self, job: &str) -> Result<Self> {
        crate::ids::validate_job(job)?;
        self.job = Arc::from(job);
        Ok(self)
    }

    /// This client sharing `other`'s quorum cache (the last quorum received, and its id):
    /// a quorum either receives is the one the other's next request and heartbeats name.
    /// For two connections of one group to the same lighthouse, asking one at a time.
    pub fn sharing_quorums_with(mut self, other: &LighthouseClient) -> Self {
        self.known = other.known.clone();
        self.last_quorum_id = other.last_quorum_id.clone();
        self
    }

    /// The job (room) this client's requests name (empty: the default room).
    pub fn job(&self) -> &str {
        &self.job
    }

    /// Id of the last quorum this client received, if any (kept when the cached quorum is
    /// forgotten).
    pub fn last_quorum_id(&self) -> Option<i64> {
        let id = self.last_quorum_id.load(Ordering::Relaxed);
        (id > 0).then_some(id)
    }

    /// The last full quorum this client received (expanded if it came compact), if any.
    pub fn known_quorum(&self) -> Option<Arc<Quorum>> {
        self.held().map(|h| h.quorum.clone())
    }

    fn held(&self) -> Option<Arc<Held>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets the cached quorum: the next request asks for the full form.
    pub fn forget_known_quorum(&self) {
        *self.known.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn remember(&self, quorum: Quorum) -> Arc<Quorum> {
        self.last_quorum_id
            .store(quorum.quorum_id, Ordering::Relaxed);
        let quorum = Arc::new(quorum);
        *self.known.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(Held {
            quorum: quorum.clone(),
            steps: OnceLock::new(),
        }));
        quorum
    }

    /// Expands `reply` against `known` (what the request said it holds), or shares the held
    /// quorum when a clone already expanded this very reply.
    fn expand(
        &self,
        known: Option<&Quorum>,
        reply: Quorum,
    ) -> std::result::Result<Arc<Quorum>, Error> {
        if let Some(held) = self.held().filter(|h| h.is(&reply)) {
            self.last_quorum_id
                .store(reply.quorum_id, Ordering::Relaxed);
            return Ok(held.quorum.clone());
        }
        compact::expand(known, reply).map(|q| self.remember(q))
    }

    /// One quorum request telling the lighthouse it holds `known`; the raw (possibly compact)
    /// reply. Sent on the client's quorum stream (see [`LighthouseClient::quorum_on_stream`]),
    /// or as a single Quorum call where the lighthouse has no such stream.
    async fn call(
        &self,
        requester: QuorumMember,
        known: Option<&Quorum>,
        sparse: Option<bool>,
        timeout: Duration,
    ) -> std::result::Result<Quorum, Status> {
        let req = LighthouseQuorumRequest {
            requester: Some(requester),
            known_quorum_id: known.map_or(0, |q| q.quorum_id),
            known_revision: known.map_or(0, |q| q.revision),
            sparse: sparse.is_some(),
            init_sync: sparse.unwrap_or(false),
            job: self.job.to_string(),
        };
        let started = Instant::now();
        let deadline = started + timeout;
        let streamed = tokio::time::timeout(timeout, self.quorum_on_stream(&req, deadline)).await;
        let resp = match streamed {
            Ok(Some(answer)) => answer,
            Ok(None) => {
                let mut client = self.client.clone();
                let remaining = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(remaining, client.quorum(with_timeout(req, remaining)))
                    .await
                {
                    Ok(r) => r.map(|r| r.into_inner()),
                    Err(_) => return Err(quorum_deadline(timeout)),
                }
            }
            Err(_) => return Err(quorum_deadline(timeout)),
        };
        resp.map_err(|s| quorum_call_error(s, started.elapsed(), timeout))?
            .quorum
            .ok_or_else(|| Status::internal("lighthouse answered without a quorum"))
    }

    /// `req` on the client's quorum stream, opening it if it is not open; None when the
    /// request should go as a call: the lighthouse has no quorum stream, or another request
    /// of this client (a clone) holds the stream.
    ///
    /// The stream serves one request at a time, which is what a manager server makes: it
    /// is taken out of the shared link for the request and put back after a good answer.
    /// Requests of clones made meanwhile go as calls, which cost a new stream each anyway (a
    /// stream opened for one request and closed after it would cost more). A failure, or
    /// this future dropped at its deadline, drops the stream, and with it the request on the
    /// lighthouse (it leaves the round, as a dropped call does). A stream kept from an
    /// earlier request may have died with its connection since (the lighthouse restarted or
    /// was killed): when it ends, or fails in its transport, without an answer from the
    /// lighthouse, the request goes once more, on a new stream. Opening that stream may fail
    /// in its transport too, on the dead connection the channel has not yet seen close (a
    /// race with the old lighthouse's stop): it is opened once more, on the connection the
    /// channel then makes. An error the lighthouse answered (its own deadline, a refusal,
    /// its stop) is returned as a call's would be, never retried here.
    async fn quorum_on_stream(
        &self,
        req: &LighthouseQuorumRequest,
        deadline: Instant,
    ) -> Option<std::result::Result<crate::proto::LighthouseQuorumResponse, Status>> {
        // After a kept stream failed, the request goes on a new one, or as a call.
        let mut fresh_only = false;
        // A new stream whose opening failed in its transport is opened once more.
        let mut reopened = false;
        loop {
            let (kept, claim) = {
                let mut link = self.quorums.lock().unwrap_or_else(|e| e.into_inner());
                match std::mem::replace(&mut *link, QuorumLink::InUse) {
                    QuorumLink::Open { tx, rx } if !fresh_only => {
                        (Some((tx, rx)), StreamClaim(&self.quorums))
                    }
                    QuorumLink::Closed => (None, StreamClaim(&self.quorums)),
                    other => {
                        *link = other;
                        return None;
                    }
                }
            };
            let msg = crate::proto::QuorumStreamRequest {
                request: Some(req.clone()),
                // At least 1 ms: 0 would mean no deadline.
                timeout_ms: u64::try_from(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .as_millis(),
                )
                .unwrap_or(u64::MAX)
                .max(1),
            };
            let (tx, mut rx, reused) = match kept {
                Some((tx, rx)) => {
                    if tx.send(msg).await.is_err() {
                        fresh_only = true; // that stream is gone (the claim closes the link)
                        continue;
                    }
                    (tx, rx, true)
                }
                None => {
                    let (tx, requests) = tokio::sync::mpsc::channel(1);
                    // The first request waits in the channel until the call sends it.
                    let _ = tx.send(msg).await;
                    let mut client = self.client.clone();
                    let opened = client
                        .quorum_stream(tokio_stream::wrappers::ReceiverStream::new(requests))
                        .await;
                    match opened {
                        Ok(r) => (tx, Box::new(r.into_inner()), false),
                        Err(s) if s.code() == tonic::Code::Unimplemented => {
                            claim.release(QuorumLink::Unsupported);
                            return None;
                        }
                        // A status tonic made from a transport error carries it as its
                        // source; one the lighthouse sent has none.
                        Err(s) if !reopened && std::error::Error::source(&s).is_some() => {
                            reopened = true;
                            fresh_only = true;
                            continue;
                        }
                        Err(s) => return Some(Err(s)),
                    }
                }
            };
            match rx.message().await {
                Ok(Some(answer)) => {
                    claim.release(QuorumLink::Open { tx, rx });
                    return Some(Ok(answer));
                }
                Err(s) if s.code() == tonic::Code::Unimplemented => {
                    claim.release(QuorumLink::Unsupported);
                    return None;
                }
                Ok(None) if reused => fresh_only = true,
                // A status tonic made from a transport error carries that error as its source;
                // one the lighthouse sent (in trailers) has none.
                Err(s) if reused && std::error::Error::source(&s).is_some() => fresh_only = true,
                Ok(None) => return Some(Err(Status::unavailable("the quorum stream ended"))),
                Err(s) => return Some(Err(s)),
            }
        }
    }

    /// Like [`LighthouseClient::quorum`], but a failed call reports its gRPC status (for
    /// callers that classify failures themselves, e.g. to retry).
    pub async fn quorum_status(
        &self,
        requester: QuorumMember,
        timeout: Duration,
    ) -> std::result::Result<Quorum, Status> {
        self.quorum_status_shared(requester, timeout)
            .await
            .map(Arc::unwrap_or_clone)
    }

    /// Like [`LighthouseClient::quorum_status`], but the quorum is shared with the client's
    /// cache instead of copied: clones that receive the same quorum share one copy (e.g. one
    /// process driving many replica groups over one connection).
    pub async fn quorum_status_shared(
        &self,
        requester: QuorumMember,
        timeout: Duration,
    ) -> std::result::Result<Arc<Quorum>, Status> {
        self.ask(requester, None, timeout).await
    }

    /// Like [`LighthouseClient::quorum_status_shared`], but asks for the sparse form, planned
    /// with `init_sync` and without a topology file (see [`crate::manager::sparse`]): the
    /// quorum returned has `sparse` set (each rank's answer comes from
    /// [`crate::manager::sparse::sparse_answer`]), or it is the full quorum when the
    /// lighthouse does not plan this one (or predates the form).
    pub async fn quorum_status_sparse(
        &self,
        requester: QuorumMember,
        init_sync: bool,
        timeout: Duration,
    ) -> std::result::Result<Arc<Quorum>, Status> {
        self.ask(requester, Some(init_sync), timeout).await
    }

    async fn ask(
        &self,
        requester: QuorumMember,
        sparse: Option<bool>,
        timeout: Duration,
    ) -> std::result::Result<Arc<Quorum>, Status> {
        let deadline = Instant::now() + timeout;
        let known = self.known_quorum();
        let reply = self
            .call(requester.clone(), known.as_deref(), sparse, timeout)
            .await?;
        if sparse.is_some() && reply.sparse.is_some() {
            // Not a full quorum to hold: the next request asks without one.
            self.forget_known_quorum();
            self.last_quorum_id
                .store(reply.quorum_id, Ordering::Relaxed);
            return Ok(Arc::new(reply));
        }
        let err = match self.expand(known.as_deref(), reply) {
            Ok(q) => return Ok(q),
            Err(e) => e,
        };
        // Never guess: drop the cache and ask for the full form (this joins the next round).
        warn!(error = %err, "cannot expand the compact quorum; asking again for the full form");
        self.forget_known_quorum();
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(Status::deadline_exceeded(format!(
                "lighthouse quorum did not complete within {timeout:?}"
            )));
        }
        let reply = self.call(requester, None, None, remaining).await?;
        match compact::expand(None, reply) {
            Ok(q) => Ok(self.remember(q)),
            Err(e) => Err(Status::internal(format!(
                "lighthouse sent a compact quorum to a request that holds none: {e}"
            ))),
        }
    }

    /// Joins the current round and waits until `requester` is in an issued quorum.
    ///
    /// Always returns the full quorum. Fails with [`Error::Timeout`] when `timeout` passes
    /// first (the request then leaves the round on the server), [`Error::InvalidArgument`] for
    /// a malformed member.
    pub async fn quorum(&self, requester: QuorumMember, timeout: Duration) -> Result<Quorum> {
        self.quorum_status(requester, timeout)
            .await
            .map_err(Error::from)
    }

    /// Like [`LighthouseClient::quorum`], but the quorum is shared with the client's cache
    /// (see [`LighthouseClient::quorum_status_shared`]).
    pub async fn quorum_shared(
        &self,
        requester: QuorumMember,
        timeout: Duration,
    ) -> Result<Arc<Quorum>> {
        self.quorum_status_shared(requester, timeout)
            .await
            .map_err(Error::from)
    }

    /// Tells the lighthouse `replica_id` is alive.
    pub async fn heartbeat(&self, replica_id: &str, timeout: Duration) -> Result<()> {
        self.heartbeat_status(replica_id, timeout)
            .await
            .map_err(Error::from)
    }

    /// Like [`LighthouseClient::heartbeat`], but a failed call reports its gRPC status.
    pub async fn heartbeat_status(
        &self,
        replica_id: &str,
        timeout: Duration,
    ) -> std::result::Result<(), Status> {
        self.heartbeat_lease(replica_id, None, None, timeout)
            .await
            .map(|_| ())
    }

    /// Heartbeats (with the group's committed `step`, if known, how long ago its training
    /// loop last reached its manager, if known, and the last quorum this client received)
    /// and returns the lighthouse's answer (see [`HeartbeatAck`]).
    pub async fn heartbeat_lease(
        &self,
        replica_id: &str,
        step: Option<i64>,
        loop_idle: Option<Duration>,
        timeout: Duration,
    ) -> std::result::Result<HeartbeatAck, Status> {
        self.heartbeat_digest(replica_id, step, loop_idle, None, timeout)
            .await
    }

    /// [`LighthouseClient::heartbeat_lease`] that also carries the group's state `digest` of
    /// one committed step (runtime state parity), when it has one to send.
    pub async fn heartbeat_digest(
        &self,
        replica_id: &str,
        step: Option<i64>,
        loop_idle: Option<Duration>,
        digest: Option<crate::proto::StateDigest>,
        timeout: Duration,
    ) -> std::result::Result<HeartbeatAck, Status> {
        let mut client = self.client.clone();
        let req = with_timeout(
            LighthouseHeartbeatRequest {
                replica_id: replica_id.to_string(),
                step,
                quorum_id: self.last_quorum_id(),
                loop_idle_ms: loop_idle.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                digest,
                job: self.job.to_string(),
            },
            timeout,
        );
        match tokio::time::timeout(timeout, client.heartbeat(req)).await {
            Ok(r) => r.map(|resp| {
                let resp = resp.into_inner();
                let ms = resp.heartbeat_timeout_ms;
                HeartbeatAck {
                    timeout: (ms > 0).then(|| Duration::from_millis(ms)),
                    waiting: (!resp.waiting.is_empty()).then_some(resp.waiting),
                    hung: (!resp.hung.is_empty()).then_some(resp.hung),
                    parity_step: resp.parity_step,
                    diverged: (!resp.diverged.is_empty()).then_some(resp.diverged),
                    parity_ok_step: resp.parity_ok_step,
                    parity_diverged_step: resp.parity_diverged_step,
                }
            }),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "lighthouse heartbeat did not complete within {timeout:?}"
            ))),
        }
    }

    /// Opens the session of `replica_id`: a stream the lighthouse keeps open for the life of
    /// the caller and on which it announces lost members of the caller's quorum. Dropping
    /// the stream (or the process dying) ends the session, which declares the group lost.
    ///
    /// `timeout` bounds opening the stream only (the first message is the lighthouse's
    /// acknowledgement, consumed here).
    pub async fn session(
        &self,
        replica_id: &str,
        timeout: Duration,
    ) -> std::result::Result<tonic::Streaming<SessionEvent>, Status> {
        let mut client = self.client.clone();
        let open = async {
            let mut stream = client
                .session(SessionRequest {
                    replica_id: replica_id.to_string(),
                    job: self.job.to_string(),
                })
                .await?
                .into_inner();
            match stream.message().await? {
                Some(_) => Ok(stream),
                None => Err(Status::unavailable(
                    "the lighthouse closed the session at once",
                )),
            }
        };
        match tokio::time::timeout(timeout, open).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "lighthouse session did not open within {timeout:?}"
            ))),
        }
    }
}

/// The status of a quorum call that passed its deadline, saying what timed out.
fn quorum_deadline(timeout: Duration) -> Status {
    Status::deadline_exceeded(format!(
        "lighthouse quorum did not complete within {timeout:?}"
    ))
}

/// The status a failed quorum call reports. tonic's own deadline (the request's
/// grpc-timeout) comes back as `Cancelled` "Timeout expired": past the deadline it says what
/// timed out. A call cancelled before its deadline is a dropped connection (e.g. the
/// lighthouse died mid-reply), which callers retry: it keeps its code.
fn quorum_call_error(status: Status, elapsed: Duration, timeout: Duration) -> Status {
    if status.code() == tonic::Code::Cancelled && elapsed >= timeout {
        quorum_deadline(timeout)
    } else {
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quorum(id: i64, revision: u64, steps: &[i64]) -> Quorum {
        Quorum {
            quorum_id: id,
            revision,
            participants: steps
                .iter()
                .enumerate()
                .map(|(i, s)| crate::testkit::member(&format!("r{i}"), *s))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_held_quorum_is_shared_only_for_its_own_abridged_reply() {
        let next = quorum(4, 3, &[2, 2, 5]);
        let held = Held {
            quorum: Arc::new(next.clone()),
            steps: OnceLock::new(),
        };
        assert!(held.is(&compact::compact_form(&next)));
        assert!(held.is(&compact::delta_form(&quorum(3, 2, &[1, 1, 1]), &next)));
        for (name, reply) in [
            ("the full form", next.clone()),
            (
                "another revision",
                compact::compact_form(&quorum(4, 4, &[2, 2, 5])),
            ),
            (
                "another id",
                compact::compact_form(&quorum(5, 3, &[2, 2, 5])),
            ),
            (
                "other steps",
                compact::compact_form(&quorum(4, 3, &[2, 2, 6])),
            ),
            (
                "another count",
                compact::compact_form(&quorum(4, 3, &[2, 2])),
            ),
            (
                "no revision",
                compact::compact_form(&quorum(4, 0, &[2, 2, 5])),
            ),
        ] {
            assert!(!held.is(&reply), "{name}");
        }
    }

    #[test]
    fn only_a_cancel_at_the_deadline_reads_as_a_timeout() {
        let t = Duration::from_secs(2);
        let dropped = quorum_call_error(
            Status::cancelled("h2 protocol error: error reading a body from connection"),
            Duration::from_millis(300),
            t,
        );
        assert_eq!(dropped.code(), tonic::Code::Cancelled);
        let late = quorum_call_error(Status::cancelled("Timeout expired"), t, t);
        assert_eq!(late.code(), tonic::Code::DeadlineExceeded);
        assert!(
            late.message().contains("did not complete within 2s"),
            "{late:?}"
        );
        let other = quorum_call_error(Status::unavailable("down"), t, t);
        assert_eq!(other.code(), tonic::Code::Unavailable);
    }
}
