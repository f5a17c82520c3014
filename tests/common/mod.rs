//! Helpers shared by the integration tests: each test file declares `mod common;`.

#[allow(dead_code)] // only the manager wire tests start groups
pub mod groups;

use std::future::Future;
use std::time::Duration;

use futures::stream::BoxStream;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use torchft::proto::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};
use torchft::proto::{
    LighthouseCommitRequest, LighthouseCommitResponse, LighthouseHeartbeatRequest,
    LighthouseHeartbeatResponse, LighthouseQuorumRequest, LighthouseQuorumResponse, Quorum,
    QuorumMember, QuorumStreamRequest, SessionEvent, SessionRequest, TelemetryAck, TelemetryBatch,
};

/// The longest one test may run: a hung test fails instead of stalling the suite.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f`, failing the test if it takes longer than [`TEST_TIMEOUT`].
pub async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

/// A stream a scripted lighthouse answers with.
pub type Answers<T> = BoxStream<'static, Result<T, Status>>;

/// The refusal of a method a scripted lighthouse does not have: UNIMPLEMENTED, as from an
/// upstream lighthouse (or an older one of ours), which clients fall back from.
#[allow(dead_code)] // not every test file scripts a lighthouse
pub fn not_here<T>(method: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!("no {method} here")))
}

/// A scripted lighthouse: a test implements the methods it exercises; every other method
/// answers UNIMPLEMENTED (see [`not_here`]). Served by [`serve_fake`].
#[allow(dead_code)] // not every test file scripts a lighthouse
#[tonic::async_trait]
pub trait FakeLighthouse: Send + Sync + 'static {
    async fn quorum(
        &self,
        _request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        not_here("quorum")
    }

    async fn quorum_stream(
        &self,
        _request: Request<Streaming<QuorumStreamRequest>>,
    ) -> Result<Response<Answers<LighthouseQuorumResponse>>, Status> {
        not_here("quorum stream")
    }

    async fn heartbeat(
        &self,
        _request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        not_here("heartbeat")
    }

    async fn session(
        &self,
        _request: Request<SessionRequest>,
    ) -> Result<Response<Answers<SessionEvent>>, Status> {
        not_here("session")
    }

    async fn report(
        &self,
        _request: Request<TelemetryBatch>,
    ) -> Result<Response<TelemetryAck>, Status> {
        not_here("telemetry")
    }

    async fn commit(
        &self,
        _request: Request<LighthouseCommitRequest>,
    ) -> Result<Response<LighthouseCommitResponse>, Status> {
        not_here("commit announcement")
    }

    async fn commit_stream(
        &self,
        _request: Request<Streaming<LighthouseCommitRequest>>,
    ) -> Result<Response<Answers<LighthouseCommitResponse>>, Status> {
        not_here("commit stream")
    }
}

/// The member a Quorum call asks for (InvalidArgument when it names none).
#[allow(dead_code)] // not every test file scripts a lighthouse
pub fn requester(request: Request<LighthouseQuorumRequest>) -> Result<QuorumMember, Status> {
    request
        .into_inner()
        .requester
        .ok_or_else(|| Status::invalid_argument("no requester"))
}

/// An answer as upstream's lighthouse gives a lone group: quorum `quorum_id` of `member`
/// alone.
#[allow(dead_code)] // not every test file scripts a lighthouse
pub fn alone(member: QuorumMember, quorum_id: i64) -> Response<LighthouseQuorumResponse> {
    Response::new(LighthouseQuorumResponse {
        quorum: Some(Quorum {
            quorum_id,
            participants: vec![member],
            ..Default::default()
        }),
    })
}

/// The gRPC service of a [`FakeLighthouse`].
struct Fake<T>(T);

#[tonic::async_trait]
impl<T: FakeLighthouse> LighthouseService for Fake<T> {
    type QuorumStreamStream = Answers<LighthouseQuorumResponse>;
    type SessionStream = Answers<SessionEvent>;
    type CommitStreamStream = Answers<LighthouseCommitResponse>;

    async fn quorum(
        &self,
        request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        self.0.quorum(request).await
    }

    async fn quorum_stream(
        &self,
        request: Request<Streaming<QuorumStreamRequest>>,
    ) -> Result<Response<Self::QuorumStreamStream>, Status> {
        self.0.quorum_stream(request).await
    }

    async fn heartbeat(
        &self,
        request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        self.0.heartbeat(request).await
    }

    async fn session(
        &self,
        request: Request<SessionRequest>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        self.0.session(request).await
    }

    async fn report(
        &self,
        request: Request<TelemetryBatch>,
    ) -> Result<Response<TelemetryAck>, Status> {
        self.0.report(request).await
    }

    async fn commit(
        &self,
        request: Request<LighthouseCommitRequest>,
    ) -> Result<Response<LighthouseCommitResponse>, Status> {
        self.0.commit(request).await
    }

    async fn commit_stream(
        &self,
        request: Request<Streaming<LighthouseCommitRequest>>,
    ) -> Result<Response<Self::CommitStreamStream>, Status> {
        self.0.commit_stream(request).await
    }
}

/// Serves the scripted lighthouse `svc` on 127.0.0.1:0; returns its address
/// (`http://127.0.0.1:port`), the sender that stops it (send `true`) and its task.
#[allow(dead_code)] // not every test file scripts a lighthouse
pub async fn serve_fake<S: FakeLighthouse>(
    svc: S,
) -> (String, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let svc = LighthouseServiceServer::new(Fake(svc));
    let handle = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            })
            .await;
    });
    (format!("http://{addr}"), stop_tx, handle)
}

/// A fresh directory under the system temp dir, removed on drop.
#[allow(dead_code)] // not every test file makes one
pub struct TempDir(pub std::path::PathBuf);

#[allow(dead_code)]
impl TempDir {
    /// Creates `torchft-{tag}-{pid}-{nanos}` under the system temp dir.
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("torchft-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
