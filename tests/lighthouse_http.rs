//! HTTP pages of a real lighthouse: health, readiness, status JSON, metrics, events, the
//! dashboard, and bad requests.

mod common;
use common::{bounded, TempDir};

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::manager::{ManagerClient, ManagerOptions, ManagerServer};
use torchft::proto::telemetry_report::Phase;
use torchft::proto::{QuorumMember, TelemetryBatch, TelemetryReport};

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
        // Scripts come from the lighthouse only: none inline.
        assert!(csp.contains("script-src 'self';"), "{csp}");
        let html = page.text().await.unwrap();
        assert!(html.contains("torchft lighthouse"));
        assert!(html.contains("<script src=\"dashboard.js\"></script>"));
        let script = http
            .get(format!("{base}/dashboard.js"))
            .send()
            .await
            .unwrap();
        assert_eq!(script.status(), 200);
        assert_eq!(
            script.headers()["content-type"],
            "text/javascript; charset=utf-8"
        );
        let script = script.text().await.unwrap();
        assert!(script.contains("'use strict'"), "{script:.80}");
        // Self-contained: nothing is loaded from elsewhere.
        for text in [&html, &script] {
            for external in ["src=\"http", "href=\"http", "src=\"//", "@import"] {
                assert!(!text.contains(external), "external asset: {external}");
            }
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

/// Polls `f` every 20 ms until it returns Some (at most 10 s).
async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {what} within 10s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn get_json(http: &reqwest::Client, url: &str) -> serde_json::Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

async fn get_text(http: &reqwest::Client, url: &str) -> String {
    http.get(url).send().await.unwrap().text().await.unwrap()
}

/// A snapshot report as the rank that wrote the manifest sends it.
fn snapshot_report(step: i64, phase: Phase) -> TelemetryReport {
    TelemetryReport {
        replica_id: "g0".into(),
        group_rank: 0,
        group_world_size: 1,
        hostname: "h".into(),
        step,
        quorum_id: 3,
        phase: phase as i32,
        snapshot_path: format!("/snap/step_{step}"),
        snapshot_stage_s: 0.25,
        snapshot_write_s: 4.5,
        snapshot_bytes: 1 << 20,
        error: if phase == Phase::SnapshotFailed {
            "disk full".into()
        } else {
            String::new()
        },
        unix_s: 1.7e9,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_show_in_status_and_metrics_and_survive_a_restart() {
    bounded(async {
        let dir = TempDir::new("snapshot");
        let state_file = dir.0.join("lighthouse.state");
        let o = LighthouseOptions {
            min_replicas: 1,
            join_timeout: Duration::from_secs(60),
            quorum_tick: Duration::from_millis(10),
            heartbeat_timeout: Duration::from_secs(5),
            progress_wait: Duration::ZERO,
            state_file: Some(state_file.clone()),
            hang_timeout: None,
        };
        let server = LighthouseServer::bind("127.0.0.1:0", o.clone())
            .await
            .unwrap();
        let base = server.address();
        let http = reqwest::Client::new();
        let s = get_json(&http, &format!("{base}/status")).await;
        assert!(s["snapshot"].is_null(), "{}", s["snapshot"]);
        let text = get_text(&http, &format!("{base}/metrics")).await;
        assert!(!text.contains("torchft_snapshot_latest_step"), "{text}");
        assert!(text.contains("torchft_snapshots_total 0\n"), "{text}");

        // Through a real manager server, as a rank's report travels.
        let manager = ManagerServer::start(ManagerOptions {
            replica_id: "g0".into(),
            lighthouse_addr: base.clone(),
            hostname: "127.0.0.1".into(),
            bind: "127.0.0.1:0".into(),
            store_addr: "g0-store:1".into(),
            world_size: 1,
            heartbeat_interval: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(5),
            ..ManagerOptions::default()
        })
        .await
        .unwrap();
        let rank = ManagerClient::connect(&manager.address(), Duration::from_secs(5))
            .await
            .unwrap();
        let send = |reports: Vec<TelemetryReport>| {
            let rank = rank.clone();
            async move {
                let batch = TelemetryBatch {
                    reports,
                    dropped: 0,
                    ..Default::default()
                };
                rank.report(batch, Duration::from_secs(5)).await.unwrap();
            }
        };
        send(vec![snapshot_report(100, Phase::Snapshot)]).await;
        let snap = eventually("snapshot in /status", || async {
            let s = get_json(&http, &format!("{base}/status")).await;
            (!s["snapshot"].is_null()).then(|| s["snapshot"].clone())
        })
        .await;
        assert_eq!(snap["step"], 100);
        assert_eq!(snap["replica_id"], "g0");
        assert_eq!(snap["path"], "/snap/step_100");
        assert_eq!(snap["bytes"], 1 << 20);
        assert_eq!(snap["stage_s"], 0.25);
        assert_eq!(snap["write_s"], 4.5);
        assert_eq!(snap["quorum_id"], 3);
        assert_eq!(snap["unix_s"], 1.7e9);
        assert!(snap["age_s"].as_f64().unwrap() > 0.0, "{snap}");

        // An older snapshot and a failed attempt: counted and announced, the latest stays.
        send(vec![
            snapshot_report(50, Phase::Snapshot),
            snapshot_report(150, Phase::SnapshotFailed),
        ])
        .await;
        let s = eventually("the counters", || async {
            let s = get_json(&http, &format!("{base}/status")).await;
            (s["counters"]["snapshot_failures"] == 1).then_some(s)
        })
        .await;
        assert_eq!(s["counters"]["snapshots"], 2);
        assert_eq!(s["snapshot"]["step"], 100);
        let kinds: Vec<(String, serde_json::Value, serde_json::Value)> = s["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["kind"].as_str().unwrap().starts_with("snapshot_"))
            .map(|e| {
                (
                    e["kind"].as_str().unwrap().into(),
                    e["step"].clone(),
                    e["latest"].clone(),
                )
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("snapshot_complete".into(), 100.into(), true.into()),
                ("snapshot_complete".into(), 50.into(), false.into()),
                (
                    "snapshot_failed".into(),
                    150.into(),
                    serde_json::Value::Null
                ),
            ]
        );
        // Not a step: the group has no committed step.
        let g0 = &s["replicas"][0];
        assert_eq!(g0["replica_id"], "g0");
        assert_eq!(g0["counters"]["steps_committed"], 0);
        assert_eq!(g0["counters"]["commit_failures"], 0);
        let text = get_text(&http, &format!("{base}/metrics")).await;
        for line in [
            "torchft_snapshot_latest_step 100",
            "torchft_snapshot_bytes 1048576",
            "torchft_snapshot_write_seconds 4.5",
            "torchft_snapshot_stage_seconds 0.25",
            "torchft_snapshots_total 2",
            "torchft_snapshot_failures_total 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing: {text}");
        }
        assert!(text.contains("\ntorchft_snapshot_age_seconds "), "{text}");

        // The state file has it within a tick; a restarted lighthouse still shows it.
        eventually("the snapshot in the state file", || async {
            let saved = std::fs::read_to_string(&state_file).ok()?;
            let saved: serde_json::Value = serde_json::from_str(&saved).ok()?;
            (saved["snapshot"]["step"] == 100).then_some(())
        })
        .await;
        manager.shutdown().await;
        server.shutdown().await;
        let server = LighthouseServer::bind("127.0.0.1:0", o).await.unwrap();
        let base = server.address();
        let s = get_json(&http, &format!("{base}/status")).await;
        assert_eq!(s["snapshot"]["step"], 100);
        assert_eq!(s["snapshot"]["path"], "/snap/step_100");
        assert_eq!(s["snapshot"]["replica_id"], "g0");
        assert_eq!(s["counters"]["snapshots"], 0, "counters are this life's");
        let text = get_text(&http, &format!("{base}/metrics")).await;
        assert!(
            text.contains("\ntorchft_snapshot_latest_step 100\n"),
            "{text}"
        );
        server.shutdown().await;
    })
    .await;
}
