//! HTTP pages of a real lighthouse: health, readiness, status JSON, HTML, and bad requests.

use std::future::Future;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::proto::QuorumMember;

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("test timed out");
}

async fn start(min: u64) -> LighthouseServer {
    let o = LighthouseOptions {
        min_replicas: min,
        join_timeout: Duration::from_secs(60),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_secs(5),
    };
    LighthouseServer::bind("127.0.0.1:0", o).await.unwrap()
}

/// Sends raw bytes and returns whatever the server answers before closing.
async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_ready_status_and_index() {
    bounded(async {
        let server = start(2).await;
        let base = server.address();
        let http = reqwest::Client::new();
        let r = http.get(format!("{base}/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "ok");
        assert_eq!(
            http.get(format!("{base}/readyz"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );

        let s: serde_json::Value = http
            .get(format!("{base}/status"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(s["min_replicas"], 2);
        assert!(s["quorum_id"].is_null());
        assert_eq!(s["reason"], "no replica is asking for a quorum");

        // One replica waits: the reason says how many more are needed.
        let c = LighthouseClient::connect(&base, Duration::from_secs(5))
            .await
            .unwrap();
        let c1 = c.clone();
        let waiting = tokio::spawn(async move {
            let m = QuorumMember {
                replica_id: "a<b>".into(),
                step: 4,
                world_size: 1,
                address: "http://x:1".into(),
                ..Default::default()
            };
            c1.quorum(m, Duration::from_secs(20)).await
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s: serde_json::Value = http
            .get(format!("{base}/status"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(s["participants"][0], "a<b>");
        assert_eq!(
            s["reason"],
            "waiting for 1 more replica to reach min_replicas=2"
        );
        assert_eq!(s["heartbeats"][0]["replica_id"], "a<b>");
        assert_eq!(s["ready"], false);

        let m = QuorumMember {
            replica_id: "z".into(),
            step: 4,
            world_size: 1,
            address: "http://z:1".into(),
            store_address: "z:2".into(),
            ..Default::default()
        };
        let q = c.quorum(m, Duration::from_secs(5)).await.unwrap();
        waiting.await.unwrap().unwrap();
        let s: serde_json::Value = http
            .get(format!("{base}/status"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(s["quorum_id"], q.quorum_id);
        assert_eq!(s["members"][1]["replica_id"], "z");
        assert_eq!(s["members"][1]["store_address"], "z:2");
        assert_eq!(s["members"][1]["step"], 4);

        let page = http.get(format!("{base}/")).send().await.unwrap();
        assert_eq!(page.status(), 200);
        let html = page.text().await.unwrap();
        assert!(html.contains("torchft lighthouse"));
        assert!(html.contains("a&lt;b&gt;"), "replica id not escaped");
        assert!(html.contains(&q.quorum_id.to_string()));

        assert_eq!(
            http.get(format!("{base}/nope"))
                .send()
                .await
                .unwrap()
                .status(),
            404
        );
        assert_eq!(
            http.post(format!("{base}/status"))
                .send()
                .await
                .unwrap()
                .status(),
            405
        );
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_requests_get_4xx_and_server_survives() {
    bounded(async {
        let server = start(1).await;
        let addr = server.local_addr();
        let resp = raw(addr, b"THIS IS NOT HTTP\r\n\r\n").await;
        assert!(resp.is_empty() || resp.starts_with("HTTP/1.1 4"), "{resp}");
        let resp = raw(addr, b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.1 4"), "{resp}");
        let resp = raw(addr, &[0xff; 64]).await;
        assert!(resp.is_empty() || resp.starts_with("HTTP/1.1 4"), "{resp}");
        // A gRPC path over HTTP/1 with a garbage body.
        let resp = raw(
            addr,
            b"POST /torchft.LighthouseService/Quorum HTTP/1.1\r\nHost: x\r\ncontent-type: application/grpc\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains("grpc-status: 3"), "{resp}");
        assert!(resp.contains("truncated%20gRPC%20message"), "{resp}");
        // The same path without a gRPC content type.
        let resp = raw(
            addr,
            b"POST /torchft.LighthouseService/Quorum HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 415"), "{resp}");
        let r = reqwest::get(format!("{}/healthz", server.address())).await.unwrap();
        assert_eq!(r.status(), 200);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_ok_then_closed_after_shutdown() {
    bounded(async {
        let server = start(1).await;
        let addr = server.local_addr();
        // Keep an HTTP/1 connection open across the start of shutdown.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 1024];
        let n = s.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        server.shutdown().await;
        // After shutdown the port no longer serves.
        assert!(reqwest::get(format!("{}/readyz", server.address()))
            .await
            .is_err());
    })
    .await;
}
