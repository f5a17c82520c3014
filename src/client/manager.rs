//! The client every group rank uses to talk to its replica group's manager server (and that a
//! healing rank uses to ask a source group's manager for checkpoint metadata).
//!
//! One HTTP/2 channel per client, shared by its clones; every call carries its deadline to the
//! server and is also bounded locally, so no call blocks past its timeout. The per-step calls
//! (quorum, commit vote) and the telemetry batches to a server in this same process skip the
//! network (see [`super::in_process`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{in_process, rpc_error};
use crate::error::{Error, Result};
use crate::net::with_timeout;
use crate::proto::manager_service_client::ManagerServiceClient;
use crate::proto::manager_service_server::ManagerService;
use crate::proto::{
    CheckpointMetadataRequest, KillRequest, LostEvent, ManagerQuorumRequest, ManagerQuorumResponse,
    ShouldCommitRequest, TelemetryBatch, WatchEventsRequest,
};
use crate::security::client::AuthChannel;

/// What a quorum call is called in its errors.
const QUORUM: &str = "manager quorum";
use crate::security::Token;

/// A connection to one manager server. Cheap to clone (clones share the channel).
#[derive(Debug, Clone)]
pub struct ManagerClient {
    client: ManagerServiceClient<AuthChannel>,
    /// The address dialled and the token sent: what finds the server in this process.
    address: Arc<str>,
    token: Option<Token>,
    /// Never in process (see [`ManagerClient::network_only`]).
    network_only: bool,
}

impl ManagerClient {
    dial_constructors!(|channel, address, security| Self {
        client: ManagerServiceClient::new(channel),
        address: address.into(),
        token: security.token.clone(),
        network_only: false,
    });

    /// This client, making every call over the network even to a server in this process
    /// (as a rank in another process does).
    pub fn network_only(mut self) -> Self {
        self.network_only = true;
        self
    }

    /// The server dialled, if it runs in this process and takes this client's token.
    fn in_process(&self) -> Option<in_process::InProcess> {
        if self.network_only {
            return None;
        }
        in_process::find(&self.address, self.token.as_ref())
    }

    /// Runs one RPC (`what`, for the timeout error) on a clone of the channel: `req` carries
    /// `timeout` to the server, which enforces the same deadline, and the call is also
    /// bounded by it here.
    async fn call<Req, T, F, Fut>(
        &self,
        what: &str,
        req: Req,
        timeout: Duration,
        rpc: F,
    ) -> Result<T>
    where
        F: FnOnce(ManagerServiceClient<AuthChannel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let call = rpc(self.client.clone(), with_timeout(req, timeout));
        Self::bounded(what, timeout, call).await
    }

    /// `req` to the handler (`handler` calls it) of `local`, the server in this process:
    /// checked against the server's size limit as the network path checks it, and bounded by
    /// `timeout`.
    async fn call_local<Req, T, F, Fut>(
        local: in_process::InProcess,
        what: &str,
        req: Req,
        timeout: Duration,
        handler: F,
    ) -> Result<T>
    where
        Req: prost::Message,
        F: FnOnce(Arc<dyn ManagerService>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        if let Some(refused) = local.refuse_size(&req) {
            return Err(Error::from(refused));
        }
        let call = handler(local.service().clone(), with_timeout(req, timeout));
        Self::bounded(what, timeout, call).await
    }

    /// Awaits one call (over the network or in process), bounded by `timeout`; a failed
    /// status becomes the error Python sees.
    async fn bounded<T>(
        what: &str,
        timeout: Duration,
        call: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(resp)) => Ok(resp.into_inner()),
            Ok(Err(status)) => Err(rpc_error(status, started, timeout)),
            Err(_) => Err(Error::timeout(what, timeout)),
        }
    }

    /// [`ManagerClient::quorum`] of a server in this process.
    pub(crate) async fn quorum_local(
        local: in_process::InProcess,
        req: ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<ManagerQuorumResponse> {
        let handler = |svc: Arc<dyn ManagerService>, r| async move { svc.quorum(r).await };
        Self::call_local(local, QUORUM, req, timeout, handler).await
    }

    /// Asks for this rank's part of the next quorum; waits until the whole group and the
    /// lighthouse have answered, or `timeout`.
    pub async fn quorum(
        &self,
        req: ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<ManagerQuorumResponse> {
        if let Some(local) = self.in_process() {
            return Self::quorum_local(local, req, timeout).await;
        }
        self.call(
            QUORUM,
            req,
            timeout,
            |mut c, r| async move { c.quorum(r).await },
        )
        .await
    }

    /// The checkpoint metadata group rank `rank` of that manager's group sent with its latest
    /// quorum request (where that rank serves its state for healing).
    pub async fn checkpoint_metadata(&self, rank: i64, timeout: Duration) -> Result<String> {
        let req = CheckpointMetadataRequest { rank };
        self.call("checkpoint_metadata", req, timeout, |mut c, r| async move {
            c.checkpoint_metadata(r).await
        })
        .await
        .map(|r| r.checkpoint_metadata)
    }

    /// Casts this rank's commit vote for `step`; returns the group's decision (true only if
    /// every rank voted true).
    pub async fn should_commit(
        &self,
        group_rank: i64,
        step: i64,
        should_commit: bool,
        timeout: Duration,
    ) -> Result<bool> {
        self.should_commit_digest(group_rank, step, should_commit, None, timeout)
            .await
    }

    /// [`ManagerClient::should_commit`] that also hands over this rank's digest of its
    /// committed state after a step (`(step, digest)`, runtime state parity).
    pub async fn should_commit_digest(
        &self,
        group_rank: i64,
        step: i64,
        should_commit: bool,
        digest: Option<(i64, Vec<u8>)>,
        timeout: Duration,
    ) -> Result<bool> {
        let (digest_step, digest) = digest.unwrap_or_default();
        let req = ShouldCommitRequest {
            should_commit,
            group_rank,
            step,
            digest_step,
            digest,
        };
        if let Some(local) = self.in_process() {
            let handler =
                |svc: Arc<dyn ManagerService>, r| async move { svc.should_commit(r).await };
            return Self::call_local(local, "should_commit", req, timeout, handler)
                .await
                .map(|r| r.should_commit);
        }
        self.call("should_commit", req, timeout, |mut c, r| async move {
            c.should_commit(r).await
        })
        .await
        .map(|r| r.should_commit)
    }

    /// Sends a batch of this rank's telemetry reports; returns how many were accepted.
    pub async fn report(&self, batch: TelemetryBatch, timeout: Duration) -> Result<u32> {
        if let Some(local) = self.in_process() {
            let handler = |svc: Arc<dyn ManagerService>, r| async move { svc.report(r).await };
            return Self::call_local(local, "report", batch, timeout, handler)
                .await
                .map(|r| r.accepted);
        }
        self.call("report", batch, timeout, |mut c, r| async move {
            c.report(r).await
        })
        .await
        .map(|r| r.accepted)
    }

    /// Asks the manager server to end its hosting process (logged with `msg`).
    pub async fn kill(&self, msg: &str, timeout: Duration) -> Result<()> {
        let req = KillRequest {
            msg: msg.to_string(),
        };
        self.call(
            "kill",
            req,
            timeout,
            |mut c, r| async move { c.kill(r).await },
        )
        .await
        .map(|_| ())
    }

    /// Waits up to `timeout` for lost-member events numbered after `after_seq`.
    ///
    /// Returns the events (oldest first; empty when none arrived in time) and the number to
    /// pass as `after_seq` next time.
    pub async fn watch_events(
        &self,
        after_seq: u64,
        timeout: Duration,
    ) -> Result<(Vec<LostEvent>, u64)> {
        let req = WatchEventsRequest { after_seq };
        match self
            .call("watch_events", req, timeout, |mut c, r| async move {
                c.watch_events(r).await
            })
            .await
        {
            Ok(r) => Ok((r.events, r.last_seq)),
            // No event in time is the ordinary outcome of a long-poll, not a failure.
            Err(e) if e.is_timeout() => Ok((Vec::new(), after_seq)),
            Err(e) => Err(e),
        }
    }
}
