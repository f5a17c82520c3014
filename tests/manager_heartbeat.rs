//! The manager's heartbeat loop against a scripted lighthouse that hangs: the period holds.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use torchft::manager::{ManagerOptions, ManagerServer};
use torchft::proto::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};
use torchft::proto::{
    LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse,
};

const TEST_TIMEOUT: Duration = Duration::from_secs(30);

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

/// A lighthouse whose heartbeat handler records the arrival and then hangs for a long time.
#[derive(Clone, Default)]
struct HangingLighthouse {
    arrivals: Arc<Mutex<Vec<(Instant, String)>>>,
}

#[tonic::async_trait]
impl LighthouseService for HangingLighthouse {
    async fn quorum(
        &self,
        _request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        Err(Status::unimplemented("not used here"))
    }

    async fn heartbeat(
        &self,
        request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        self.arrivals
            .lock()
            .unwrap()
            .push((Instant::now(), request.into_inner().replica_id));
        tokio::time::sleep(Duration::from_secs(20)).await;
        Ok(Response::new(LighthouseHeartbeatResponse {}))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_keeps_its_period_while_the_lighthouse_hangs() {
    bounded(async {
        let fake = HangingLighthouse::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let svc = LighthouseServiceServer::new(fake.clone());
        let serve = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(TcpIncoming::from(listener), async move {
                    let _ = stop_rx.wait_for(|s| *s).await;
                })
                .await;
        });

        let period = Duration::from_millis(50);
        let server = ManagerServer::start(ManagerOptions {
            replica_id: "hb".into(),
            lighthouse_addr: format!("http://{addr}"),
            hostname: "127.0.0.1".into(),
            bind: "127.0.0.1:0".into(),
            store_addr: "s:1".into(),
            world_size: 1,
            heartbeat_interval: period,
            connect_timeout: Duration::from_secs(5),
            quorum_retries: 0,
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
