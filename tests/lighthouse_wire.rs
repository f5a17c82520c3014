//! Wire tests: a real lighthouse on 127.0.0.1:0 and real gRPC/HTTP clients.

mod common;
use common::bounded;
use common::TempDir;
use common::TEST_TIMEOUT;

use std::time::Duration;

use torchft::error::Error;
use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::proto::{Quorum, QuorumMember, TelemetryBatch, TelemetryReport};

/// Runs a test body with an overall timeout so a hang fails instead of blocking CI.
fn opts(min_replicas: u64, join_timeout_ms: u64) -> LighthouseOptions {
    LighthouseOptions {
        min_replicas,
        join_timeout: Duration::from_millis(join_timeout_ms),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_millis(500),
        // Not about the no-regression rules: no startup hold, no wait for progress.
        progress_wait: Duration::ZERO,
        state_file: None,
        hang_timeout: None,
    }
}

fn member(id: &str) -> QuorumMember {
    QuorumMember {
        replica_id: id.to_string(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step: 3,
        world_size: 2,
        ..Default::default()
    }
}

async fn start(o: LighthouseOptions) -> (LighthouseServer, LighthouseClient) {
    let server = LighthouseServer::bind("127.0.0.1:0", o).await.unwrap();
    let client = LighthouseClient::connect(&server.address(), Duration::from_secs(5))
        .await
        .unwrap();
    (server, client)
}

fn ids(q: &Quorum) -> Vec<String> {
    q.participants
        .iter()
        .map(|m| m.replica_id.clone())
        .collect()
}

async fn ask(c: &LighthouseClient, m: QuorumMember, ms: u64) -> Result<Quorum, Error> {
    c.quorum(m, Duration::from_millis(ms)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_join_and_fast_path() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        assert!(server.address().starts_with("http://127.0.0.1:"));
        let (a, b) = tokio::join!(ask(&c, member("a"), 5_000), ask(&c, member("b"), 5_000));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b);
        assert_eq!(ids(&a), ["a", "b"]);
        assert!(a.created.is_some());
        assert_eq!(a.participants[0].step, 3);
        assert_eq!(a.participants[0].world_size, 2);
        // Second round: both ask again → fast path, same id.
        let (a2, b2) = tokio::join!(ask(&c, member("a"), 5_000), ask(&c, member("b"), 5_000));
        assert_eq!(a2.unwrap().quorum_id, a.quorum_id);
        assert_eq!(b2.unwrap().quorum_id, a.quorum_id);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_timeout_issues_without_straggler() {
    bounded(async {
        let (server, c) = start(opts(1, 300)).await;
        // c heartbeats (healthy) but never asks; a and b are a majority of 3.
        let hb = c.clone();
        let beat = tokio::spawn(async move {
            for _ in 0..20 {
                let _ = hb.heartbeat("c", Duration::from_secs(1)).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        tokio::time::sleep(Duration::from_millis(60)).await;
        let t0 = std::time::Instant::now();
        let (a, b) = tokio::join!(ask(&c, member("a"), 5_000), ask(&c, member("b"), 5_000));
        let waited = t0.elapsed();
        assert_eq!(ids(&a.unwrap()), ["a", "b"]);
        assert_eq!(ids(&b.unwrap()), ["a", "b"]);
        assert!(
            waited >= Duration::from_millis(250),
            "answered before join timeout: {waited:?}"
        );
        beat.abort();
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_expiry_drops_replica() {
    bounded(async {
        let (server, c) = start(opts(1, 60_000)).await;
        c.heartbeat("gone", Duration::from_secs(1)).await.unwrap();
        // With "gone" healthy, a + b (2 of 3) wait for it; after 500 ms it expires.
        let t0 = std::time::Instant::now();
        let (a, b) = tokio::join!(ask(&c, member("a"), 5_000), ask(&c, member("b"), 5_000));
        assert_eq!(ids(&a.unwrap()), ["a", "b"]);
        b.unwrap();
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_millis(400),
            "did not wait for heartbeat: {waited:?}"
        );
        assert!(
            waited < Duration::from_secs(5),
            "join timeout used instead: {waited:?}"
        );
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_exceeded_and_request_leaves_round() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        let err = ask(&c, member("a"), 200).await.unwrap_err();
        assert!(err.is_timeout(), "{err}");
        // Let a's heartbeat expire so it is not waited for as a straggler.
        tokio::time::sleep(Duration::from_millis(600)).await;
        // a left: b and c form a quorum without it.
        let (b, cc) = tokio::join!(ask(&c, member("b"), 5_000), ask(&c, member("c"), 5_000));
        assert_eq!(ids(&b.unwrap()), ["b", "c"]);
        assert_eq!(ids(&cc.unwrap()), ["b", "c"]);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_request_leaves_round() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        // Client-side cancel (drop the future) long before the deadline.
        let pending = ask(&c, member("a"), 30_000);
        assert!(tokio::time::timeout(Duration::from_millis(100), pending)
            .await
            .is_err());
        tokio::time::sleep(Duration::from_millis(700)).await;
        let (b, cc) = tokio::join!(ask(&c, member("b"), 5_000), ask(&c, member("c"), 5_000));
        assert_eq!(ids(&b.unwrap()), ["b", "c"]);
        cc.unwrap();
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_request_supersedes_old_waiter() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        let c1 = c.clone();
        let old = tokio::spawn(async move { ask(&c1, member("a"), 10_000).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c2 = c.clone();
        let new = tokio::spawn(async move { ask(&c2, member("a"), 10_000).await });
        let old_err = old.await.unwrap().unwrap_err();
        assert!(old_err.to_string().contains("superseded"), "{old_err}");
        // The newer request is still in the round.
        let b = ask(&c, member("b"), 5_000).await.unwrap();
        assert_eq!(ids(&b), ["a", "b"]);
        assert_eq!(ids(&new.await.unwrap().unwrap()), ["a", "b"]);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_failures_bump_id() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        let (a, _) = tokio::join!(ask(&c, member("a"), 5_000), ask(&c, member("b"), 5_000));
        let id1 = a.unwrap().quorum_id;
        let failing = QuorumMember {
            commit_failures: 1,
            ..member("a")
        };
        let (a, _) = tokio::join!(ask(&c, failing, 5_000), ask(&c, member("b"), 5_000));
        let id2 = a.unwrap().quorum_id;
        assert!(id2 > id1);
        let (a, _) = tokio::join!(ask(&c, member("a"), 5_000), ask(&c, member("b"), 5_000));
        assert_eq!(a.unwrap().quorum_id, id2);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrink_only_excludes_newcomer() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        let (a, _) = tokio::join!(ask(&c, member("a"), 5_000), ask(&c, member("b"), 5_000));
        let id1 = a.unwrap().quorum_id;
        let c3 = c.clone();
        let newcomer = tokio::spawn(async move { ask(&c3, member("c"), 1_000).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let shrink = QuorumMember {
            shrink_only: true,
            ..member("a")
        };
        let (a, b) = tokio::join!(ask(&c, shrink, 5_000), ask(&c, member("b"), 5_000));
        let a = a.unwrap();
        assert_eq!(ids(&a), ["a", "b"]);
        assert_eq!(a.quorum_id, id1);
        b.unwrap();
        // The newcomer was left for a later round and times out here.
        assert!(newcomer.await.unwrap().unwrap_err().is_timeout());
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_input_refused_state_unchanged() {
    bounded(async {
        let (server, c) = start(opts(1, 60_000)).await;
        let bad = [
            QuorumMember {
                replica_id: String::new(),
                ..member("x")
            },
            QuorumMember {
                step: -1,
                ..member("x")
            },
            QuorumMember {
                world_size: 0,
                ..member("x")
            },
            QuorumMember {
                data: "{oops".into(),
                ..member("x")
            },
        ];
        for m in bad {
            let err = ask(&c, m, 2_000).await.unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
        assert!(matches!(
            c.heartbeat("", Duration::from_secs(1)).await.unwrap_err(),
            Error::InvalidArgument(_)
        ));
        // Missing requester, sent with the raw stub.
        let channel = torchft::client::connect(
            &server.address(),
            Duration::from_secs(5),
            &torchft::security::Security::none(),
        )
        .await
        .unwrap();
        let mut raw =
            torchft::proto::lighthouse_service_client::LighthouseServiceClient::new(channel);
        let status = raw
            .quorum(torchft::proto::LighthouseQuorumRequest {
                requester: None,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        // Nothing was recorded: a single valid replica forms a quorum alone at once.
        assert_eq!(server.quorum_id(), None);
        let q = ask(&c, member("ok"), 2_000).await.unwrap();
        assert_eq!(ids(&q), ["ok"]);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_pending_long_polls() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        let c1 = c.clone();
        let pending = tokio::spawn(async move { ask(&c1, member("a"), 30_000).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t0 = std::time::Instant::now();
        server.shutdown().await;
        let err = pending.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::Unavailable(_)), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_on_same_port_keeps_ids_increasing() {
    bounded(async {
        let (server, c) = start(opts(1, 60_000)).await;
        let port = server.local_addr().port();
        let id1 = ask(&c, member("a"), 5_000).await.unwrap().quorum_id;
        server.shutdown().await;
        drop(server);
        let bind = format!("127.0.0.1:{port}");
        let mut server2 = None;
        for _ in 0..50 {
            match LighthouseServer::bind(&bind, opts(1, 60_000)).await {
                Ok(s) => {
                    server2 = Some(s);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let server2 = server2.expect("could not rebind the same port");
        let c2 = LighthouseClient::connect(&server2.address(), Duration::from_secs(5))
            .await
            .unwrap();
        let id2 = ask(&c2, member("a"), 5_000).await.unwrap().quorum_id;
        assert!(id2 > id1, "id reused after restart: {id1} then {id2}");
        server2.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients() {
    bounded(async {
        let n = 200;
        let (server, c) = start(LighthouseOptions {
            min_replicas: n,
            ..opts(n, 60_000)
        })
        .await;
        let mut tasks = Vec::new();
        for i in 0..n {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                ask(&c, member(&format!("r{i:03}")), 20_000).await
            }));
        }
        let mut id = None;
        for t in tasks {
            let q = t.await.unwrap().unwrap();
            assert_eq!(q.participants.len(), n as usize);
            assert!(id.is_none() || id == Some(q.quorum_id));
            id = Some(q.quorum_id);
        }
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lagging_waiter_gets_its_quorum_after_many_others() {
    bounded(async {
        let (server, c) = start(opts(2, 60_000)).await;
        let (b, _) = tokio::join!(ask(&c, member("b"), 5_000), ask(&c, member("c"), 5_000));
        let id = b.unwrap().quorum_id;
        let c1 = c.clone();
        let lagging = tokio::spawn(async move { ask(&c1, member("a"), 30_000).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        // 300 quorums are issued while "a" waits (b shrinks, so "a" is left out each time).
        for _ in 0..300 {
            let shrink = QuorumMember {
                shrink_only: true,
                ..member("b")
            };
            let (b, cc) = tokio::join!(ask(&c, shrink, 5_000), ask(&c, member("c"), 5_000));
            assert_eq!(ids(&b.unwrap()), ["b", "c"]);
            assert_eq!(cc.unwrap().quorum_id, id);
        }
        assert!(!lagging.is_finished());
        let (b, _) = tokio::join!(ask(&c, member("b"), 5_000), ask(&c, member("c"), 5_000));
        assert_eq!(ids(&b.unwrap()), ["a", "b", "c"]);
        assert_eq!(ids(&lagging.await.unwrap().unwrap()), ["a", "b", "c"]);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcard_bind_reports_dialable_hostname() {
    bounded(async {
        let server = LighthouseServer::bind("0.0.0.0:0", opts(1, 60_000))
            .await
            .unwrap();
        let addr = server.address();
        let host = torchft::lighthouse::server::hostname();
        assert_eq!(
            addr,
            format!("http://{host}:{}", server.local_addr().port())
        );
        let c = LighthouseClient::connect(&addr, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(ids(&ask(&c, member("a"), 5_000).await.unwrap()), ["a"]);
        server.shutdown().await;
    })
    .await;
}

/// Heartbeats for `replica_id` every 100 ms, as a manager does, until aborted.
fn heartbeats(c: &LighthouseClient, replica_id: &'static str) -> tokio::task::JoinHandle<()> {
    let c = c.clone();
    tokio::spawn(async move {
        loop {
            let _ = c.heartbeat(replica_id, TEST_TIMEOUT).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_are_written_ahead_and_survive_a_lighthouse_restart() {
    bounded(async {
        let dir = TempDir::new("state");
        let file = dir.0.join("lighthouse.state");
        let o = LighthouseOptions {
            heartbeat_timeout: Duration::from_millis(1_000),
            progress_wait: Duration::from_secs(30),
            state_file: Some(file.clone()),
            ..opts(1, 0)
        };
        let (server, c) = start(o.clone()).await;
        // a heartbeats throughout, as a manager does: a member silent for a heartbeat
        // timeout is declared lost. A fresh job: the first quorum is not held.
        let beats = heartbeats(&c, "a");
        // a alone at step 3.
        let q = ask(&c, member("a"), 5_000).await.unwrap();
        assert_eq!(
            c.commit("a", q.quorum_id, 4, 0.0, TEST_TIMEOUT)
                .await
                .unwrap(),
            None
        );
        // A commit under another quorum, or by a non-member, is refused with a reason.
        let why = c
            .commit("a", q.quorum_id - 1, 4, 0.0, TEST_TIMEOUT)
            .await
            .unwrap();
        assert!(why.is_some_and(|w| w.contains("replaced")));
        assert!(c
            .commit("z", q.quorum_id, 4, 0.0, TEST_TIMEOUT)
            .await
            .unwrap()
            .is_some());
        let bad = c
            .commit("a", q.quorum_id, -1, 0.0, TEST_TIMEOUT)
            .await
            .unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        for wait in [-0.5, f64::NAN, f64::INFINITY] {
            let bad = c
                .commit("a", q.quorum_id, 4, wait, TEST_TIMEOUT)
                .await
                .unwrap_err();
            assert_eq!(bad.code(), tonic::Code::InvalidArgument);
            assert!(bad.message().contains("quorum_wait_s"), "{}", bad.message());
        }
        let saved: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(saved["quorum_id"], q.quorum_id);
        assert_eq!(saved["best_step"], 4);
        assert_eq!(saved["holders"], serde_json::json!(["a"]));
        beats.abort();
        server.shutdown().await;

        // Restarted with the same file while a is silent: b at step 3 waits for a (the
        // remembered holder of step 4) beyond the startup hold ...
        let (server, c) = start(o.clone()).await;
        let b_beats = heartbeats(&c, "b");
        let err = ask(
            &c,
            QuorumMember {
                step: 3,
                ..member("b")
            },
            1_000,
        )
        .await
        .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        // ... the old quorum is still current for a ...
        assert_eq!(
            c.commit("a", q.quorum_id, 5, 0.0, TEST_TIMEOUT)
                .await
                .unwrap(),
            None
        );
        // ... and once a is back and asks at step 5, both go on from there.
        let a_beats = heartbeats(&c, "a");
        let (qa, qb) = tokio::join!(
            ask(
                &c,
                QuorumMember {
                    step: 5,
                    ..member("a")
                },
                5_000
            ),
            ask(
                &c,
                QuorumMember {
                    step: 3,
                    ..member("b")
                },
                5_000
            )
        );
        let (qa, qb) = (qa.unwrap(), qb.unwrap());
        assert_eq!(qa, qb);
        assert!(qa.quorum_id > q.quorum_id);
        assert_eq!(ids(&qa), ["a", "b"]);
        // The quorum before the restart is replaced now.
        assert!(c
            .commit("a", q.quorum_id, 6, 0.0, TEST_TIMEOUT)
            .await
            .unwrap()
            .is_some());
        a_beats.abort();
        b_beats.abort();
        server.shutdown().await;

        // A state file that is not one is refused at start, with the path in the message.
        std::fs::write(&file, "not json").unwrap();
        let err = LighthouseServer::bind("127.0.0.1:0", o)
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("lighthouse.state"), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lighthouse_restarted_more_often_than_the_progress_wait_still_gives_up_on_a_dead_holder()
{
    bounded(async {
        let dir = TempDir::new("state");
        let file = dir.0.join("lighthouse.state");
        let progress_wait = Duration::from_secs(4);
        let o = LighthouseOptions {
            progress_wait,
            state_file: Some(file.clone()),
            ..opts(1, 0)
        };
        // a commits step 4 and dies.
        let (server, c) = start(o.clone()).await;
        let beats = heartbeats(&c, "a");
        let q = ask(&c, member("a"), 5_000).await.unwrap();
        let committed = std::time::Instant::now();
        assert_eq!(
            c.commit("a", q.quorum_id, 4, 0.0, TEST_TIMEOUT)
                .await
                .unwrap(),
            None
        );
        beats.abort();
        server.shutdown().await;
        let saved: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert!(saved["silent_ms"]["a"].is_u64(), "{saved}");
        // The lighthouse is then restarted every 1.5 s, well within the progress wait of
        // its start, while b asks at step 3. The silence each life saw of a adds up: once it
        // reaches the progress wait, a is given up on.
        let mut issued = None;
        for life in 1..=10 {
            let (server, c) = start(o.clone()).await;
            let b_beats = heartbeats(&c, "b");
            let got = ask(
                &c,
                QuorumMember {
                    step: 3,
                    ..member("b")
                },
                1_500,
            )
            .await;
            b_beats.abort();
            server.shutdown().await;
            match got {
                Ok(q) => {
                    issued = Some((life, q, committed.elapsed()));
                    break;
                }
                Err(e) => assert!(e.is_timeout(), "life {life}: {e}"),
            }
        }
        let (life, q, after) = issued.expect("no quorum while the lighthouse kept restarting");
        assert_eq!(ids(&q), ["b"]);
        assert!(
            after >= progress_wait - Duration::from_millis(5),
            "a given up on {after:?} after it was last heard (life {life})"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_report_batch_is_already_in_the_state_file() {
    // A batch acknowledged and then lost with a SIGKILLed lighthouse is never sent again:
    // what it changed in the goodput accounts must be on disk before the acknowledgement.
    bounded(async {
        let dir = TempDir::new("reports");
        let file = dir.0.join("lighthouse.state");
        let o = LighthouseOptions {
            state_file: Some(file.clone()),
            ..opts(1, 0)
        };
        let (server, c) = start(o).await;
        let beats = heartbeats(&c, "a");
        let q = ask(&c, member("a"), 5_000).await.unwrap();
        // The steps end (the rank's clock) after the goodput window opens at the first commit.
        let base = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            + 1.0;
        for step in 3..6 {
            assert_eq!(
                c.commit("a", q.quorum_id, step + 1, 0.0, TEST_TIMEOUT)
                    .await
                    .unwrap(),
                None
            );
            let report = TelemetryReport {
                replica_id: "a".into(),
                step,
                committed: true,
                step_s: 0.5,
                quorum_wait_s: 0.125,
                group_world_size: 1,
                unix_s: base + step as f64,
                ..Default::default()
            };
            let batch = TelemetryBatch {
                reports: vec![report],
                ..Default::default()
            };
            assert_eq!(c.report(batch, TEST_TIMEOUT).await.unwrap(), 1);
            // Read at once, as a lighthouse restarted right after the acknowledgement would.
            let saved: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
            let groups = saved["goodput"]["groups"].as_array().cloned().unwrap();
            let a = groups
                .iter()
                .find(|g| g[0] == "a")
                .expect("a's accounts saved");
            assert_eq!(a[1]["life"]["reported_unix"], base + step as f64, "{a}");
            // The first report is start-up; each later one is a productive step.
            assert_eq!(a[1]["accounts"]["steps_committed"], step - 3, "{a}");
        }
        beats.abort();
        server.shutdown().await;
    })
    .await;
}
