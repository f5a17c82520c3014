//! Helpers shared by the integration tests: each test file declares `mod common;`.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use torchft::proto::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};

/// The longest one test may run: a hung test fails instead of stalling the suite.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f`, failing the test if it takes longer than [`TEST_TIMEOUT`].
pub async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

/// Serves the scripted lighthouse `svc` on 127.0.0.1:0; returns its address
/// (`http://127.0.0.1:port`), the sender that stops it (send `true`) and its task.
#[allow(dead_code)] // not every test file scripts a lighthouse
pub async fn serve_fake<S: LighthouseService>(
    svc: S,
) -> (String, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let svc = LighthouseServiceServer::new(svc);
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
