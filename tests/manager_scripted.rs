//! The manager against scripted lighthouses: what it sends, how often, retries, heartbeats.

mod common;
use common::{alone, bounded, requester, serve_fake, FakeLighthouse};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use torchft::error::Error;
use torchft::manager::{ManagerClient, ManagerOptions, ManagerServer};
use torchft::proto::{
    LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse, ManagerQuorumRequest, QuorumMember, TelemetryAck, TelemetryBatch,
    TelemetryReport,
};

/// A lighthouse whose heartbeat handler records the arrival and then hangs for a long time.
#[derive(Clone, Default)]
struct HangingLighthouse {
    arrivals: Arc<Mutex<Vec<(Instant, String)>>>,
}

#[tonic::async_trait]
impl FakeLighthouse for HangingLighthouse {
    async fn heartbeat(
        &self,
        request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        self.arrivals
            .lock()
            .unwrap()
            .push((Instant::now(), request.into_inner().replica_id));
        tokio::time::sleep(Duration::from_secs(20)).await;
        Ok(Response::new(LighthouseHeartbeatResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_keeps_its_period_while_the_lighthouse_hangs() {
    bounded(async {
        let fake = HangingLighthouse::default();
        let (addr, stop_tx, serve) = serve_fake(fake.clone()).await;

        let period = Duration::from_millis(50);
        let server = ManagerServer::start(ManagerOptions {
            replica_id: "hb".into(),
            lighthouse_addr: addr,
            hostname: "127.0.0.1".into(),
            bind: "127.0.0.1:0".into(),
            store_addr: "s:1".into(),
            world_size: 1,
            heartbeat_interval: period,
            connect_timeout: Duration::from_secs(5),
            ..ManagerOptions::default()
        })
        .await
        .unwrap();
        let window = Duration::from_millis(1000);
        tokio::time::sleep(window).await;
        server.shutdown().await;
        let arrivals = fake.arrivals.lock().unwrap().clone();
        // Every attempt hangs; each is cut at one period, so about one per period arrives
        // (a loop that waited for each answer would have sent one).
        assert!(
            arrivals.len() >= 8,
            "only {} heartbeats in {window:?}",
            arrivals.len()
        );
        assert!(arrivals.iter().all(|(_, id)| id == "hb"));
        let gaps: Vec<Duration> = arrivals.windows(2).map(|w| w[1].0 - w[0].0).collect();
        let max_gap = gaps.iter().max().copied().unwrap_or_default();
        assert!(max_gap < period * 5, "largest gap {max_gap:?}");
        // After shutdown no more heartbeats are sent.
        let count = arrivals.len();
        tokio::time::sleep(period * 4).await;
        assert_eq!(fake.arrivals.lock().unwrap().len(), count);

        let _ = stop_tx.send(true);
        serve.abort();
    })
    .await;
}

/// A lighthouse that records every quorum request, fails the first `fail_first` of them with
/// UNAVAILABLE and answers the others with a quorum of just the requester.
#[derive(Clone, Default)]
struct RecordingLighthouse {
    requests: Arc<Mutex<Vec<QuorumMember>>>,
    fail_first: usize,
    reports: Arc<Mutex<Vec<TelemetryBatch>>>,
}

#[tonic::async_trait]
impl FakeLighthouse for RecordingLighthouse {
    async fn quorum(
        &self,
        request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        let member = requester(request)?;
        let n = {
            let mut reqs = self.requests.lock().unwrap();
            reqs.push(member.clone());
            reqs.len()
        };
        if n <= self.fail_first {
            return Err(Status::unavailable(format!("scripted failure {n}")));
        }
        Ok(alone(member, 42))
    }

    async fn heartbeat(
        &self,
        _request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        Ok(Response::new(LighthouseHeartbeatResponse::default()))
    }

    async fn report(
        &self,
        request: Request<TelemetryBatch>,
    ) -> Result<Response<TelemetryAck>, Status> {
        let batch = request.into_inner();
        let accepted = batch.reports.len() as u32;
        self.reports.lock().unwrap().push(batch);
        Ok(Response::new(TelemetryAck { accepted }))
    }
}

fn manager_opts(lighthouse_addr: &str, world_size: u64, quorum_retries: u64) -> ManagerOptions {
    ManagerOptions {
        replica_id: "grp".into(),
        lighthouse_addr: lighthouse_addr.into(),
        hostname: "127.0.0.1".into(),
        bind: "127.0.0.1:0".into(),
        store_addr: "grp-store:1".into(),
        world_size,
        heartbeat_interval: Duration::from_millis(100),
        connect_timeout: Duration::from_secs(5),
        quorum_retries,
        ..ManagerOptions::default()
    }
}

async fn all_ranks(
    server: &ManagerServer,
    reqs: Vec<ManagerQuorumRequest>,
) -> Vec<Result<torchft::proto::ManagerQuorumResponse, Error>> {
    let mut calls = Vec::new();
    for r in reqs {
        let c = ManagerClient::connect(&server.address(), Duration::from_secs(5))
            .await
            .unwrap();
        calls.push(async move { c.quorum(r, Duration::from_secs(10)).await });
    }
    futures::future::join_all(calls).await
}

fn rank_req(
    group_rank: i64,
    shrink_only: bool,
    commit_failures: i64,
    init_sync: bool,
) -> ManagerQuorumRequest {
    ManagerQuorumRequest {
        group_rank,
        step: 9,
        checkpoint_metadata: String::new(),
        shrink_only,
        init_sync,
        commit_failures,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lighthouse_request_per_round_with_merged_flags() {
    bounded(async {
        let fake = RecordingLighthouse::default();
        let (addr, stop, handle) = serve_fake(fake.clone()).await;
        let server = ManagerServer::start(manager_opts(&addr, 3, 0))
            .await
            .unwrap();
        let results = all_ranks(
            &server,
            vec![
                rank_req(0, false, 1, false),
                rank_req(1, true, 4, false),
                rank_req(2, false, 0, false),
            ],
        )
        .await;
        for r in results {
            let r = r.unwrap();
            assert_eq!(r.quorum_id, 42);
            assert_eq!(r.commit_failures, 4);
            assert_eq!(r.replica_ids, vec!["grp"]);
        }
        let reqs = fake.requests.lock().unwrap().clone();
        assert_eq!(reqs.len(), 1, "one lighthouse request for the whole group");
        let m = &reqs[0];
        assert_eq!(m.replica_id, "grp");
        assert_eq!(m.address, server.address());
        assert_eq!(m.store_address, "grp-store:1");
        assert_eq!(m.step, 9);
        assert_eq!(m.world_size, 3);
        assert!(m.shrink_only, "shrink_only is OR-ed over the ranks");
        assert_eq!(
            m.commit_failures, 4,
            "commit_failures is max-ed over the ranks"
        );
        assert_eq!(
            m.data, r#"{"heal_sources":1}"#,
            "the member announces how it chooses heal sources"
        );
        server.shutdown().await;
        let _ = stop.send(true);
        handle.await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_lighthouse_requests_are_retried_up_to_quorum_retries() {
    bounded(async {
        // Two failures, two retries allowed: the third attempt answers.
        let fake = RecordingLighthouse {
            fail_first: 2,
            ..Default::default()
        };
        let (addr, stop, handle) = serve_fake(fake.clone()).await;
        let server = ManagerServer::start(manager_opts(&addr, 2, 2))
            .await
            .unwrap();
        let results = all_ranks(
            &server,
            vec![rank_req(0, false, 0, true), rank_req(1, false, 0, true)],
        )
        .await;
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        assert_eq!(fake.requests.lock().unwrap().len(), 3);
        server.shutdown().await;
        let _ = stop.send(true);
        handle.await.unwrap();

        // Two failures, one retry allowed: every rank gets the error, after two attempts.
        let fake = RecordingLighthouse {
            fail_first: 2,
            ..Default::default()
        };
        let (addr, stop, handle) = serve_fake(fake.clone()).await;
        let server = ManagerServer::start(manager_opts(&addr, 2, 1))
            .await
            .unwrap();
        let start = Instant::now();
        let results = all_ranks(
            &server,
            vec![rank_req(0, false, 0, true), rank_req(1, false, 0, true)],
        )
        .await;
        for r in results {
            let err = r.unwrap_err();
            assert!(matches!(err, Error::Unavailable(_)), "{err}");
            assert!(err.to_string().contains("2 attempt"), "{err}");
        }
        assert!(start.elapsed() < Duration::from_secs(3));
        assert_eq!(fake.requests.lock().unwrap().len(), 2);
        server.shutdown().await;
        let _ = stop.send(true);
        handle.await.unwrap();
    })
    .await;
}

fn telemetry(incarnation: &str, step: i64) -> TelemetryReport {
    TelemetryReport {
        replica_id: "grp".into(),
        incarnation: incarnation.into(),
        group_rank: 0,
        group_world_size: 1,
        step,
        committed: true,
        busy_s: 0.01,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_reports_are_forwarded_in_batches_and_garbage_is_refused() {
    bounded(async {
        let fake = RecordingLighthouse::default();
        let (addr, stop, handle) = serve_fake(fake.clone()).await;
        let server = ManagerServer::start(manager_opts(&addr, 1, 0))
            .await
            .unwrap();
        let client = ManagerClient::connect(&server.address(), Duration::from_secs(5))
            .await
            .unwrap();
        let t = Duration::from_secs(5);
        for step in 0..3 {
            let batch = TelemetryBatch {
                reports: vec![telemetry("grp", step)],
                dropped: 2,
                ..Default::default()
            };
            assert_eq!(client.report(batch, t).await.unwrap(), 1);
        }
        // Malformed reports, and reports about another group, are refused whole.
        let mut nan = telemetry("grp", 3);
        nan.busy_s = f64::NAN;
        let mut no_id = telemetry("", 3);
        no_id.replica_id.clear();
        for bad in [nan, no_id, telemetry("other", 3)] {
            let batch = TelemetryBatch {
                reports: vec![telemetry("grp", 3), bad],
                dropped: 0,
                ..Default::default()
            };
            let err = client.report(batch, t).await.unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
        // Forwarded within a few intervals, in one or more batches, drops carried along.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (steps, dropped): (Vec<i64>, u64) = {
                let got = fake.reports.lock().unwrap();
                (
                    got.iter()
                        .flat_map(|b| b.reports.iter().map(|r| r.step))
                        .collect(),
                    got.iter().map(|b| b.dropped).sum(),
                )
            };
            if steps.len() == 3 {
                assert_eq!(steps, vec![0, 1, 2]);
                assert_eq!(dropped, 6);
                break;
            }
            assert!(Instant::now() < deadline, "forwarded only {steps:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Reports queued just before shutdown still go out (flushed before the session ends).
        let batch = TelemetryBatch {
            reports: vec![telemetry("grp", 9)],
            dropped: 0,
            ..Default::default()
        };
        client.report(batch, t).await.unwrap();
        server.shutdown().await;
        let last = fake.reports.lock().unwrap().last().cloned().unwrap();
        assert_eq!(last.reports[0].step, 9);
        let _ = stop.send(true);
        let _ = handle.await;
    })
    .await;
}
