//! Wire tests of the shared secret and TLS: real lighthouse and manager servers on
//! 127.0.0.1:0, real clients; every RPC and route without token, with a wrong one and with the
//! right one; TLS on, off and mismatched; request size limits.

mod common;
use common::bounded;

use std::path::PathBuf;
use std::time::Duration;

use torchft::error::Error;
use torchft::lighthouse::{
    AccessOptions, LighthouseClient, LighthouseOptions, LighthouseServer, ObservabilityOptions,
};
use torchft::manager::{ManagerClient, ManagerOptions, ManagerServer};
use torchft::proto::{ManagerQuorumRequest, QuorumMember, TelemetryBatch};
use torchft::security::{Security, TlsFiles, Token};

const CONNECT: Duration = Duration::from_secs(5);
const CALL: Duration = Duration::from_secs(5);

/// Runs a test body with an overall timeout so a hang fails instead of blocking CI.
fn cert(name: &str) -> Option<PathBuf> {
    Some(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/certs")
            .join(name),
    )
}

fn token(t: &str) -> Option<Token> {
    Some(Token::new(t).unwrap())
}

/// A server's settings: the token, and TLS with the test CA's server certificate.
fn server_security(tok: Option<&str>, tls: bool, mutual: bool) -> Security {
    Security {
        token: tok.map(|t| Token::new(t).unwrap()),
        tls: if tls {
            TlsFiles {
                cert: cert("server.pem"),
                key: cert("server.key"),
                ca: cert("ca.pem"),
                client_ca: if mutual { cert("ca.pem") } else { None },
            }
        } else {
            TlsFiles::default()
        },
    }
}

/// A client's settings: the token, the CA to trust, and optionally a client certificate.
fn client_security(tok: Option<&str>, ca: Option<&str>, client_cert: bool) -> Security {
    Security {
        token: tok.map(|t| Token::new(t).unwrap()),
        tls: TlsFiles {
            ca: ca.and_then(cert),
            cert: if client_cert {
                cert("client.pem")
            } else {
                None
            },
            key: if client_cert {
                cert("client.key")
            } else {
                None
            },
            client_ca: None,
        },
    }
}

fn opts() -> LighthouseOptions {
    LighthouseOptions {
        min_replicas: 1,
        join_timeout: Duration::from_millis(100),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_secs(5),
        progress_wait: Duration::ZERO,
        state_file: None,
        hang_timeout: None,
    }
}

async fn lighthouse(access: AccessOptions) -> LighthouseServer {
    let obs = ObservabilityOptions {
        allow_kill: true,
        ..Default::default()
    };
    LighthouseServer::bind_secured("127.0.0.1:0", opts(), obs, access)
        .await
        .unwrap()
}

fn member(id: &str) -> QuorumMember {
    QuorumMember {
        replica_id: id.into(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step: 1,
        world_size: 1,
        ..Default::default()
    }
}

fn is_unauthenticated(e: &Error, what: &str) -> bool {
    matches!(e, Error::Unauthenticated(m) if m.contains(what))
}

/// Every lighthouse RPC with `security`; Ok(()) if all passed, else the first error.
async fn every_lighthouse_rpc(addr: &str, security: &Security, id: &str) -> Result<(), Error> {
    let c = LighthouseClient::connect_with(addr, CONNECT, security).await?;
    c.heartbeat(id, CALL).await?;
    c.quorum(member(id), CALL).await?;
    c.report(TelemetryBatch::default(), CALL).await?;
    c.session(id, CALL).await.map_err(Error::from)?;
    // Refused (no quorum holds `id`) but answered: the call itself got through.
    c.commit(id, 1, 2, 0.0, CALL).await.map_err(Error::from)?;
    Ok(())
}

async fn status(base: &str) -> serde_json::Value {
    reqwest::get(format!("{base}/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_rpcs_need_the_token_and_refusals_change_nothing() {
    bounded(async {
        let server = lighthouse(AccessOptions {
            security: server_security(Some("right-token"), false, false),
            ..Default::default()
        })
        .await;
        let addr = server.address();
        let c = LighthouseClient::connect_with(&addr, CONNECT, &Security::none())
            .await
            .unwrap();
        let wrong = LighthouseClient::connect_with(
            &addr,
            CONNECT,
            &client_security(Some("nope"), None, false),
        )
        .await
        .unwrap();
        for (client, why) in [(&c, "missing token"), (&wrong, "wrong token")] {
            let e = client.heartbeat("intruder", CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "heartbeat: {e}");
            let e = client.quorum(member("intruder"), CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "quorum: {e}");
            let e = client
                .report(TelemetryBatch::default(), CALL)
                .await
                .unwrap_err();
            assert!(is_unauthenticated(&e, why), "report: {e}");
            let e = Error::from(client.session("intruder", CALL).await.unwrap_err());
            assert!(is_unauthenticated(&e, why), "session: {e}");
            let e = Error::from(
                client
                    .commit("intruder", 1, 2, 0.0, CALL)
                    .await
                    .unwrap_err(),
            );
            assert!(is_unauthenticated(&e, why), "commit: {e}");
        }
        // Nothing the refused calls said reached the engine.
        let s = status(&addr).await;
        assert_eq!(s["heartbeats"], serde_json::json!([]), "{s}");
        assert_eq!(s["quorum_id"], serde_json::Value::Null, "{s}");
        assert_eq!(server.num_sessions(), 0);

        every_lighthouse_rpc(
            &addr,
            &client_security(Some("right-token"), None, false),
            "good",
        )
        .await
        .unwrap();
        let s = status(&addr).await;
        assert_eq!(s["members"][0]["replica_id"], "good", "{s}");
        server.shutdown().await;
    })
    .await;
}

async fn post_kill(base: &str, auth: Option<&str>) -> (u16, String) {
    post_kill_from(base, auth, None).await
}

/// A kill as a browser sends it from a page of `origin` (`None`: not a browser).
async fn post_kill_from(base: &str, auth: Option<&str>, origin: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new().post(format!("{base}/replicas/nobody/kill"));
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    if let Some(o) = origin {
        req = req.header("origin", o);
    }
    let resp = req.send().await.unwrap();
    let code = resp.status().as_u16();
    (code, resp.text().await.unwrap())
}

async fn get(base: &str, path: &str, auth: Option<&str>) -> u16 {
    let mut req = reqwest::Client::new().get(format!("{base}{path}"));
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_route_needs_the_token_and_status_stays_open_unless_private() {
    bounded(async {
        let server = lighthouse(AccessOptions {
            security: server_security(Some("tok"), false, false),
            ..Default::default()
        })
        .await;
        let base = server.address();
        let (code, body) = post_kill(&base, None).await;
        assert_eq!(code, 401, "{body}");
        assert!(body.contains("missing token"), "{body}");
        let (code, body) = post_kill(&base, Some("Bearer wrong")).await;
        assert_eq!(code, 401, "{body}");
        assert!(body.contains("wrong token"), "{body}");
        // The right token passes the guard: the route itself answers (no such group).
        let (code, body) = post_kill(&base, Some("Bearer tok")).await;
        assert_eq!(code, 404, "{body}");
        // A browser's cached Basic credentials (any user, the token as password) do not
        // change anything: another site's page could make the browser resend them.
        let (code, body) = post_kill(&base, Some("Basic dXNlcjp0b2s=")).await;
        assert_eq!(code, 401, "{body}");
        assert!(body.contains("reading only"), "{body}");
        // The dashboard's own page (same origin) with the Bearer token passes; a page of
        // another origin is refused even with it.
        let (code, body) = post_kill_from(&base, Some("Bearer tok"), Some(&base)).await;
        assert_eq!(code, 404, "{body}");
        let (code, body) =
            post_kill_from(&base, Some("Bearer tok"), Some("http://evil.example")).await;
        assert_eq!(code, 403, "{body}");
        assert!(body.contains("cross-origin request refused"), "{body}");
        for path in [
            "/",
            "/dashboard.js",
            "/status",
            "/metrics",
            "/healthz",
            "/readyz",
        ] {
            assert_eq!(get(&base, path, None).await, 200, "{path}");
        }
        server.shutdown().await;

        let private = lighthouse(AccessOptions {
            security: server_security(Some("tok"), false, false),
            private_status: true,
            ..Default::default()
        })
        .await;
        let base = private.address();
        for path in [
            "/",
            "/dashboard.js",
            "/status",
            "/metrics",
            "/healthz",
            "/readyz",
            "/events",
        ] {
            assert_eq!(get(&base, path, None).await, 401, "{path}");
            assert_eq!(get(&base, path, Some("Bearer wrong")).await, 401, "{path}");
        }
        for path in ["/status", "/metrics", "/healthz"] {
            assert_eq!(get(&base, path, Some("Bearer tok")).await, 200, "{path}");
        }
        private.shutdown().await;

        // private_status without a token is refused at start.
        let err = LighthouseServer::bind_secured(
            "127.0.0.1:0",
            opts(),
            ObservabilityOptions::default(),
            AccessOptions {
                private_status: true,
                ..Default::default()
            },
        )
        .await
        .err()
        .unwrap();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    })
    .await;
}

fn manager_opts(lighthouse_addr: &str, security: Security) -> ManagerOptions {
    ManagerOptions {
        replica_id: "grp".into(),
        lighthouse_addr: lighthouse_addr.into(),
        hostname: "localhost".into(),
        bind: "127.0.0.1:0".into(),
        store_addr: "grp-store:1".into(),
        world_size: 1,
        heartbeat_interval: Duration::from_millis(50),
        connect_timeout: CONNECT,
        security,
        ..ManagerOptions::default()
    }
}

fn rank_request(step: i64) -> ManagerQuorumRequest {
    ManagerQuorumRequest {
        group_rank: 0,
        step,
        checkpoint_metadata: "http://ckpt".into(),
        shrink_only: false,
        init_sync: true,
        commit_failures: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_lighthouse_refuses_kills_from_other_sites_pages() {
    bounded(async {
        // No token at all: the kill route is open to clients, but not to a page of another
        // origin making the operator's browser send it (cross-site request forgery).
        let server = lighthouse(AccessOptions::default()).await;
        let base = server.address();
        let (code, body) = post_kill_from(&base, None, Some("http://evil.example")).await;
        assert_eq!(code, 403, "{body}");
        assert!(body.contains("http://evil.example"), "{body}");
        let (code, body) = post_kill_from(&base, None, Some("null")).await;
        assert_eq!(code, 403, "{body}");
        // Its own dashboard, and clients that are not browsers, reach the route.
        assert_eq!(post_kill_from(&base, None, Some(&base)).await.0, 404);
        assert_eq!(post_kill(&base, None).await.0, 404);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_rpcs_need_the_token() {
    bounded(async {
        let security = server_security(Some("job-secret"), false, false);
        let lh = lighthouse(AccessOptions {
            security: security.clone(),
            ..Default::default()
        })
        .await;
        let server = ManagerServer::start(manager_opts(&lh.address(), security.clone()))
            .await
            .unwrap();
        let addr = server.address();
        for (sec, why) in [
            (Security::none(), "missing token"),
            (client_security(Some("other"), None, false), "wrong token"),
        ] {
            let c = ManagerClient::connect_with(&addr, CONNECT, &sec)
                .await
                .unwrap();
            let e = c.quorum(rank_request(0), CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "quorum: {e}");
            let e = c.checkpoint_metadata(0, CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "checkpoint_metadata: {e}");
            let e = c.should_commit(0, 0, true, CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "should_commit: {e}");
            let e = c.report(TelemetryBatch::default(), CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "report: {e}");
            let e = c.watch_events(0, CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "watch_events: {e}");
            // The right token would end this test process: only refusals are checked here.
            let e = c.kill("not allowed", CALL).await.unwrap_err();
            assert!(is_unauthenticated(&e, why), "kill: {e}");
        }
        // The right token: a full round through the lighthouse, which also needs it.
        let c = ManagerClient::connect_with(&addr, CONNECT, &security)
            .await
            .unwrap();
        let r = c.quorum(rank_request(0), CALL).await.unwrap();
        assert_eq!(r.replica_world_size, 1);
        assert_eq!(c.checkpoint_metadata(0, CALL).await.unwrap(), "http://ckpt");
        assert!(c.should_commit(0, 0, true, CALL).await.unwrap());
        c.report(TelemetryBatch::default(), CALL).await.unwrap();
        c.watch_events(0, Duration::from_millis(50)).await.unwrap();
        server.shutdown().await;

        // A manager without the lighthouse's token: its ranks get a prompt, clear error.
        let stranger = ManagerServer::start(manager_opts(
            &lh.address(),
            server_security(Some("not-the-job-secret"), false, false),
        ))
        .await
        .unwrap();
        let c = ManagerClient::connect_with(
            &stranger.address(),
            CONNECT,
            &client_security(Some("not-the-job-secret"), None, false),
        )
        .await
        .unwrap();
        let e = c.quorum(rank_request(0), CALL).await.unwrap_err();
        assert!(e.to_string().contains("wrong token"), "{e}");
        stranger.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_on_off_and_mismatch() {
    bounded(async {
        let tls_lh = lighthouse(AccessOptions {
            security: server_security(None, true, false),
            ..Default::default()
        })
        .await;
        let addr = tls_lh.address();
        assert!(addr.starts_with("https://127.0.0.1:"), "{addr}");
        // TLS client with the right CA: every RPC works.
        every_lighthouse_rpc(
            &addr,
            &client_security(None, Some("ca.pem"), false),
            "tls-a",
        )
        .await
        .unwrap();
        // Plain client on the TLS server: a prompt, clear refusal.
        let plain_addr = addr.replace("https://", "http://");
        let c = LighthouseClient::connect_with(&plain_addr, CONNECT, &Security::none())
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let e = c.heartbeat("plain", CALL).await.unwrap_err();
        assert!(e.to_string().contains("accepts TLS only"), "{e}");
        assert!(started.elapsed() < CALL / 2);
        // An https address without a CA to verify it: refused before dialing.
        let e = LighthouseClient::connect_with(&addr, CONNECT, &Security::none())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("TORCHFT_TLS_CA"), "{e}");
        // A CA that did not sign the server's certificate: the handshake fails, promptly.
        let started = std::time::Instant::now();
        let e = LighthouseClient::connect_with(
            &addr,
            CONNECT,
            &client_security(None, Some("other-ca.pem"), false),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("TLS handshake failed"), "{e}");
        assert!(started.elapsed() < CONNECT);
        tls_lh.shutdown().await;

        // TLS client on a plain server: fails fast, saying TLS failed.
        let plain_lh = lighthouse(AccessOptions::default()).await;
        let started = std::time::Instant::now();
        let e = LighthouseClient::connect_with(
            &plain_lh.address(),
            CONNECT,
            &client_security(None, Some("ca.pem"), false),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("TLS handshake failed"), "{e}");
        assert!(started.elapsed() < CONNECT);
        plain_lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_requires_a_client_certificate() {
    bounded(async {
        let lh = lighthouse(AccessOptions {
            security: server_security(Some("t"), true, true),
            ..Default::default()
        })
        .await;
        let addr = lh.address();
        let no_cert = client_security(Some("t"), Some("ca.pem"), false);
        let refused = every_lighthouse_rpc(&addr, &no_cert, "nocert").await;
        assert!(
            refused.is_err(),
            "a client without a certificate got through"
        );
        every_lighthouse_rpc(
            &addr,
            &client_security(Some("t"), Some("ca.pem"), true),
            "cert",
        )
        .await
        .unwrap();

        // A manager server with the same settings, end to end through the lighthouse.
        let both = Security {
            token: token("t"),
            tls: TlsFiles {
                cert: cert("server.pem"),
                key: cert("server.key"),
                ca: cert("ca.pem"),
                client_ca: cert("ca.pem"),
            },
        };
        let server = ManagerServer::start(manager_opts(&addr, both.clone()))
            .await
            .unwrap();
        assert!(server.address().starts_with("https://localhost:"));
        let c = ManagerClient::connect_with(&server.address(), CONNECT, &both)
            .await
            .unwrap();
        let r = c.quorum(rank_request(0), CALL).await.unwrap();
        assert_eq!(r.replica_world_size, 1);
        server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_refused_with_a_clear_status() {
    bounded(async {
        let lh = lighthouse(AccessOptions {
            max_request_bytes: 4096,
            ..Default::default()
        })
        .await;
        let c = LighthouseClient::connect_with(&lh.address(), CONNECT, &Security::none())
            .await
            .unwrap();
        let mut big = member("big");
        big.data = "x".repeat(10_000);
        let e = c.quorum(big, CALL).await.unwrap_err();
        assert!(e.to_string().contains("limit of 4096 bytes"), "{e}");
        let e = c.heartbeat(&"y".repeat(10_000), CALL).await.unwrap_err();
        assert!(e.to_string().contains("4096"), "{e}");
        // Ordinary requests still pass, and the oversized one changed nothing.
        let q = c.quorum(member("small"), CALL).await.unwrap();
        assert_eq!(q.participants.len(), 1);
        lh.shutdown().await;

        let lh = lighthouse(AccessOptions::default()).await;
        let server = ManagerServer::start(ManagerOptions {
            max_request_bytes: 4096,
            ..manager_opts(&lh.address(), Security::none())
        })
        .await
        .unwrap();
        let c = ManagerClient::connect_with(&server.address(), CONNECT, &Security::none())
            .await
            .unwrap();
        let mut req = rank_request(0);
        req.checkpoint_metadata = "z".repeat(10_000);
        let e = c.quorum(req, CALL).await.unwrap_err();
        assert!(e.to_string().contains("4096"), "{e}");
        server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_own_token_acts_on_its_room_only() {
    bounded(async {
        let dir = common::TempDir::new("room-tokens");
        std::fs::write(dir.0.join("job-a"), "token-of-a\n").unwrap();
        std::fs::write(dir.0.join("job-b"), "token-of-b").unwrap();
        // A Kubernetes Secret volume's hidden entries are skipped.
        std::fs::create_dir(dir.0.join("..data")).unwrap();
        let room_tokens = torchft::security::RoomTokens::load_dir(&dir.0).unwrap();
        let server = lighthouse(AccessOptions {
            security: server_security(Some("admin-token"), false, false),
            private_status: true,
            room_tokens,
            ..Default::default()
        })
        .await;
        let addr = server.address();
        let as_token = |tok: &'static str, job: &'static str| {
            let addr = addr.clone();
            async move {
                LighthouseClient::connect_with(
                    &addr,
                    CONNECT,
                    &client_security(Some(tok), None, false),
                )
                .await
                .unwrap()
                .with_job(job)
                .unwrap()
            }
        };
        // Job a's token: its own room works, job b's room and the default room are refused.
        let a = as_token("token-of-a", "job-a").await;
        let q = a.quorum(member("x"), CALL).await.unwrap();
        assert_eq!(q.participants.len(), 1);
        for job in ["job-b", ""] {
            let err = as_token("token-of-a", job)
                .await
                .quorum(member("x"), CALL)
                .await
                .unwrap_err();
            assert!(matches!(err, Error::Unauthenticated(_)), "{job}: {err}");
            assert!(err.to_string().contains("job \"job-a\"'s"), "{err}");
        }
        let err = as_token("token-of-a", "job-b")
            .await
            .heartbeat("x", CALL)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unauthenticated(_)), "{err}");
        assert_eq!(server.rooms(), ["", "job-a"], "refusals open no room");
        // The lighthouse's own token acts on every room; an unknown token on none.
        let admin = as_token("admin-token", "job-b").await;
        admin.quorum(member("y"), CALL).await.unwrap();
        let err = as_token("nobody", "job-a")
            .await
            .quorum(member("x"), CALL)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("wrong token"), "{err}");

        // Private pages: job a's token reads its own room, not another's nor /metrics.
        let http = reqwest::Client::new();
        let get = |path: &str, tok: &str| {
            http.get(format!("{addr}{path}"))
                .header("authorization", format!("Bearer {tok}"))
                .send()
        };
        let own = get("/status?job=job-a", "token-of-a").await.unwrap();
        assert_eq!(own.status(), 200);
        let body: serde_json::Value = own.json().await.unwrap();
        let listed: Vec<&str> = body["rooms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["job"].as_str().unwrap())
            .collect();
        assert_eq!(listed, ["job-a"], "a job's token lists its own room only");
        for (path, code) in [
            ("/status?job=job-b", 403),
            ("/status", 403),
            ("/metrics", 403),
        ] {
            let resp = get(path, "token-of-a").await.unwrap();
            assert_eq!(resp.status(), code, "{path}");
        }
        assert_eq!(get("/metrics", "admin-token").await.unwrap().status(), 200);
        assert_eq!(
            get("/status?job=job-b", "admin-token")
                .await
                .unwrap()
                .status(),
            200
        );
        server.shutdown().await;
    })
    .await;
}

#[test]
fn room_token_directories_are_checked() {
    let dir = common::TempDir::new("room-tokens-bad");
    let err = torchft::security::RoomTokens::load_dir(&dir.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("holds no token"), "{err}");
    std::fs::write(dir.0.join("a"), "same").unwrap();
    std::fs::write(dir.0.join("b"), "same").unwrap();
    let err = torchft::security::RoomTokens::load_dir(&dir.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("the same token"), "{err}");
    std::fs::write(dir.0.join("b"), "other").unwrap();
    std::fs::write(dir.0.join("bad name"), "third").unwrap();
    let err = torchft::security::RoomTokens::load_dir(&dir.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("invalid job name"), "{err}");
    let err = AccessOptions {
        room_tokens: torchft::security::RoomTokens::from_pairs([(
            "a".to_string(),
            Token::new("t").unwrap(),
        )]),
        ..Default::default()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(err.contains("need the lighthouse's own token"), "{err}");
}
