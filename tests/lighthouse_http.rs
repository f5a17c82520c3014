//! HTTP pages of a real lighthouse: health, readiness, status JSON, metrics, events, the
//! dashboard, and bad requests.

mod common;
use common::bounded;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::proto::QuorumMember;

async fn start(min: u64) -> LighthouseServer {
    let o = LighthouseOptions {
        min_replicas: min,
        join_timeout: Duration::from_secs(60),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_secs(5),
        // Not about the no-regression rules: no startup hold, no wait for progress.
        progress_wait: Duration::ZERO,
        state_file: None,
        hang_timeout: None,
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
        let csp = page.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(csp.contains("connect-src 'self'"), "{csp}");
        let html = page.text().await.unwrap();
        assert!(html.contains("torchft lighthouse"));
        // Self-contained: nothing is loaded from elsewhere.
        for external in ["src=\"http", "href=\"http", "src=\"//", "@import"] {
            assert!(!html.contains(external), "external asset: {external}");
        }
        // The data behind it: ids untouched in JSON (the page inserts them as text).
        let replicas = s["replicas"].as_array().unwrap();
        let ids: Vec<&str> = replicas
            .iter()
            .map(|r| r["replica_id"].as_str().unwrap())
            .collect();
        assert!(ids.contains(&"a<b>") && ids.contains(&"z"), "{ids:?}");
        assert!(
            replicas.iter().all(|r| r["state"] == "joining"),
            "{replicas:?}"
        );
        assert_eq!(s["allow_kill"], false);
        assert_eq!(s["events"][0]["kind"], "lighthouse_started");

        let metrics = http.get(format!("{base}/metrics")).send().await.unwrap();
        assert_eq!(metrics.status(), 200);
        assert!(metrics.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4"));
        let text = metrics.text().await.unwrap();
        assert!(text.contains(&format!("torchft_quorum_id {}\n", q.quorum_id)));
        assert!(text.contains("torchft_replica_state{replica_id=\"a<b>\",state=\"joining\"} 1"));
        assert!(text.contains("torchft_quorum_changes_total 1\n"), "{text}");

        // The kill action is refused unless enabled.
        let kill = http
            .post(format!("{base}/replicas/z/kill"))
            .send()
            .await
            .unwrap();
        assert_eq!(kill.status(), 403);
        assert!(kill.text().await.unwrap().contains("--allow_kill"));

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

/// Reads from `s` until the text seen contains `needle` (at most 10 s).
async fn read_until(s: &mut tokio::net::TcpStream, needle: &str) -> String {
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains(needle) {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} within 10s: {seen}"))
            .unwrap();
        assert!(n > 0, "stream closed: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_stream_live_and_replay_after_last_event_id() {
    bounded(async {
        let server = start(1).await;
        let base = server.address();
        let addr = server.local_addr();
        // A live subscriber sees the quorum of a new member as it happens.
        let mut live = tokio::net::TcpStream::connect(addr).await.unwrap();
        live.write_all(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let c = LighthouseClient::connect(&base, Duration::from_secs(5))
            .await
            .unwrap();
        let m = QuorumMember {
            replica_id: "solo".into(),
            world_size: 1,
            address: "http://solo:1".into(),
            ..Default::default()
        };
        c.quorum(m, Duration::from_secs(5)).await.unwrap();
        let seen = read_until(&mut live, "quorum_changed").await;
        assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
        assert!(seen.contains("text/event-stream"), "{seen}");
        assert!(seen.contains("\"kind\":\"replica_joined\""), "{seen}");
        // Reconnecting after event 1 replays the buffered events after it (not event 1).
        let mut again = tokio::net::TcpStream::connect(addr).await.unwrap();
        again
            .write_all(b"GET /events HTTP/1.1\r\nHost: x\r\nLast-Event-ID: 1\r\n\r\n")
            .await
            .unwrap();
        let replay = read_until(&mut again, "quorum_changed").await;
        assert!(replay.contains("\nid: 2\n"), "{replay}");
        assert!(!replay.contains("\nid: 1\n"), "{replay}");
        assert!(!replay.contains("lighthouse_started"), "{replay}");
        // Shutdown ends the streams (the server does not hang on them).
        let started = std::time::Instant::now();
        server.shutdown().await;
        assert!(started.elapsed() < Duration::from_secs(4));
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), live.read_to_end(&mut rest))
            .await
            .expect("stream not ended by shutdown")
            .ok();
    })
    .await;
}
