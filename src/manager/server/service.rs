//! The manager server's gRPC service: a thin layer over the server's state that validates
//! each request, bounds it by the caller's deadline and hands it to the round, vote or queue
//! it belongs to.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::warn;

use super::{shutting_down, Inner};
use crate::error::{Error, Result};
use crate::manager::gather;
use crate::manager::{server_budget, DEFAULT_REQUEST_TIMEOUT};
use crate::net::request_timeout;
use crate::proto::manager_service_server::ManagerService;
use crate::proto::{
    CheckpointMetadataRequest, CheckpointMetadataResponse, KillRequest, KillResponse,
    ManagerQuorumRequest, ManagerQuorumResponse, ShouldCommitRequest, ShouldCommitResponse,
    TelemetryAck, TelemetryBatch, WatchEventsRequest, WatchEventsResponse,
};
use crate::telemetry::validate_batch;

impl Inner {
    /// Waits for a rank's quorum answer until `deadline`, or until shutdown.
    async fn await_answer(
        &self,
        joined: gather::Joined<'_>,
        deadline: Instant,
        timeout: Duration,
        what: &str,
    ) -> Result<ManagerQuorumResponse> {
        tokio::select! {
            r = joined.answer(deadline, timeout, what) => r,
            _ = shutting_down(self.shutdown.clone()) => Err(Error::Shutdown),
        }
    }
}

/// The tonic service; a thin layer over [`Inner`].
#[derive(Debug)]
pub(super) struct Service {
    pub(super) inner: Arc<Inner>,
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
        let (joined, ready) = inner.gather.join(&req, deadline)?;
        let what = format!("quorum (group rank {}, step {})", req.group_rank, req.step);
        if let Some(round) = ready {
            if round.replies.len() == 1 {
                // Only this rank waits: answer inline (no extra task on the hot path). The
                // deadline below still bounds it.
                let fut = inner.clone().answer_round(round);
                return tokio::select! {
                    // An answer that is in wins over the deadline (on the hosting rank's own
                    // connection it may be read late).
                    biased;
                    _ = fut => inner.await_answer(joined, deadline, timeout, &what).await,
                    _ = tokio::time::sleep_until(deadline) => Err(Error::timeout(&what, timeout)),
                }
                .map(Response::new)
                .map_err(Status::from);
            }
            // Several ranks wait on this round: it must outlive this request.
            tokio::spawn(inner.clone().answer_round(round));
        }
        inner
            .await_answer(joined, deadline, timeout, &what)
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
    use crate::manager::{ManagerOptions, ManagerServer};
    use crate::proto::TelemetryReport;

    #[tokio::test]
    async fn telemetry_for_another_incarnation_is_refused_and_not_queued() {
        let server = ManagerServer::start(ManagerOptions {
            replica_id: "a:1".into(),
            lighthouse_addr: "127.0.0.1:1".into(),
            bind: "127.0.0.1:0".into(),
            ..ManagerOptions::default()
        })
        .await
        .unwrap();
        let service = Service {
            inner: server.inner.clone(),
        };
        let report = |incarnation: &str| TelemetryReport {
            replica_id: crate::telemetry::base_id(incarnation).to_string(),
            incarnation: incarnation.into(),
            group_world_size: 1,
            ..TelemetryReport::default()
        };
        let batch = TelemetryBatch {
            reports: vec![report("a:1"), report("b:2")],
            dropped: 0,
            ..Default::default()
        };
        let err = service.report(Request::new(batch)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("\"b:2\""), "{}", err.message());
        let batch = TelemetryBatch {
            reports: vec![report("a:1")],
            dropped: 0,
            ..Default::default()
        };
        let ack = service.report(Request::new(batch)).await.unwrap();
        assert_eq!(ack.into_inner().accepted, 1);
        server.shutdown().await;
    }
}
