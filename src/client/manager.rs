//! The client every group rank uses to talk to its replica group's manager server (and that a
//! healing rank uses to ask a source group's manager for checkpoint metadata).
//!
//! One HTTP/2 channel per client, shared by its clones; every call carries its deadline to the
//! server and is also bounded locally, so no call blocks past its timeout.

use std::future::Future;
use std::time::Duration;

use super::{dial, rpc_error};
use crate::error::{Error, Result};
use crate::net::with_timeout;
use crate::proto::manager_service_client::ManagerServiceClient;
use crate::proto::{
    CheckpointMetadataRequest, KillRequest, LostEvent, ManagerQuorumRequest, ManagerQuorumResponse,
    ShouldCommitRequest, TelemetryBatch, WatchEventsRequest,
};
use crate::security::client::AuthChannel;
use crate::security::Security;

/// A connection to one manager server. Cheap to clone (clones share the channel).
#[derive(Debug, Clone)]
pub struct ManagerClient {
    client: ManagerServiceClient<AuthChannel>,
}

/// Runs one RPC bounded by `timeout` (the server enforces the same deadline).
async fn bounded<T, F>(what: &str, timeout: Duration, call: F) -> Result<T>
where
    F: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let started = tokio::time::Instant::now();
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(resp)) => Ok(resp.into_inner()),
        Ok(Err(status)) => Err(rpc_error(status, started, timeout)),
        Err(_) => Err(Error::timeout(what, timeout)),
    }
}

impl ManagerClient {
    /// Dials the manager server at `addr`, retrying until `connect_timeout` (the server may
    /// start a moment after its ranks).
    ///
    /// The token and TLS settings come from the environment ([`Security::from_env`]).
    pub async fn connect(addr: &str, connect_timeout: Duration) -> Result<Self> {
        Self::connect_with(addr, connect_timeout, &Security::from_env()?).await
    }

    /// Dials `addr` with explicit token and TLS settings.
    pub async fn connect_with(
        addr: &str,
        connect_timeout: Duration,
        security: &Security,
    ) -> Result<Self> {
        Ok(Self {
            client: ManagerServiceClient::new(dial(addr, connect_timeout, security).await?),
        })
    }

    /// Asks for this rank's part of the next quorum; waits until the whole group and the
    /// lighthouse have answered, or `timeout`.
    pub async fn quorum(
        &self,
        req: ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<ManagerQuorumResponse> {
        let mut client = self.client.clone();
        bounded(
            "manager quorum",
            timeout,
            client.quorum(with_timeout(req, timeout)),
        )
        .await
    }

    /// The checkpoint metadata group rank `rank` of that manager's group sent with its latest
    /// quorum request (where that rank serves its state for healing).
    pub async fn checkpoint_metadata(&self, rank: i64, timeout: Duration) -> Result<String> {
        let mut client = self.client.clone();
        bounded(
            "checkpoint_metadata",
            timeout,
            client.checkpoint_metadata(with_timeout(CheckpointMetadataRequest { rank }, timeout)),
        )
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
        let mut client = self.client.clone();
        let (digest_step, digest) = digest.unwrap_or_default();
        let req = ShouldCommitRequest {
            should_commit,
            group_rank,
            step,
            digest_step,
            digest,
        };
        bounded(
            "should_commit",
            timeout,
            client.should_commit(with_timeout(req, timeout)),
        )
        .await
        .map(|r| r.should_commit)
    }

    /// Sends a batch of this rank's telemetry reports; returns how many were accepted.
    pub async fn report(&self, batch: TelemetryBatch, timeout: Duration) -> Result<u32> {
        let mut client = self.client.clone();
        bounded(
            "report",
            timeout,
            client.report(with_timeout(batch, timeout)),
        )
        .await
        .map(|r| r.accepted)
    }

    /// Asks the manager server to end its hosting process (logged with `msg`).
    pub async fn kill(&self, msg: &str, timeout: Duration) -> Result<()> {
        let mut client = self.client.clone();
        let req = KillRequest {
            msg: msg.to_string(),
        };
        bounded("kill", timeout, client.kill(with_timeout(req, timeout)))
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
        let mut client = self.client.clone();
        let req = WatchEventsRequest { after_seq };
        match bounded(
            "watch_events",
            timeout,
            client.watch_events(with_timeout(req, timeout)),
        )
        .await
        {
            Ok(r) => Ok((r.events, r.last_seq)),
            // No event in time is the ordinary outcome of a long-poll, not a failure.
            Err(e) if e.is_timeout() => Ok((Vec::new(), after_seq)),
            Err(e) => Err(e),
        }
    }
}
