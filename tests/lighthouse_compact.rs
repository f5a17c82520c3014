//! Wire tests of compact quorum replies: a real lighthouse on 127.0.0.1:0 with clients that
//! hold the previous quorum, old-style clients that do not, and a scripted lighthouse whose
//! compact replies cannot be expanded.

mod common;
use common::{bounded, serve_fake, FakeLighthouse};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::{Request, Response, Status};
use torchft::client::compact::compact_form;
use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::proto::lighthouse_service_client::LighthouseServiceClient;
use torchft::proto::{
    LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    LighthouseQuorumResponse, Quorum, QuorumMember,
};

const ASK: Duration = Duration::from_secs(10);

/// Runs a test body with an overall timeout so a hang fails instead of blocking CI.
fn member(id: &str, step: i64) -> QuorumMember {
    QuorumMember {
        replica_id: id.to_string(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step,
        world_size: 2,
        ..Default::default()
    }
}

async fn start(min_replicas: u64) -> LighthouseServer {
    let opts = LighthouseOptions {
        min_replicas,
        join_timeout: Duration::from_secs(30),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_secs(5),
        // Not about the no-regression rules: no startup hold, no wait for progress.
        progress_wait: Duration::ZERO,
        state_file: None,
        hang_timeout: None,
    };
    LighthouseServer::bind("127.0.0.1:0", opts).await.unwrap()
}

async fn raw_client(addr: &str) -> LighthouseServiceClient<tonic::transport::Channel> {
    let channel = torchft::client::connect(
        addr,
        Duration::from_secs(5),
        &torchft::security::Security::none(),
    )
    .await
    .unwrap();
    LighthouseServiceClient::new(channel)
}

/// One raw Quorum call with the given knowledge; the reply as sent on the wire.
async fn raw_quorum(
    raw: &LighthouseServiceClient<tonic::transport::Channel>,
    m: QuorumMember,
    known: (i64, u64),
) -> Quorum {
    let mut raw = raw.clone();
    let req = torchft::net::with_timeout(
        LighthouseQuorumRequest {
            requester: Some(m),
            known_quorum_id: known.0,
            known_revision: known.1,
            ..Default::default()
        },
        ASK,
    );
    raw.quorum(req).await.unwrap().into_inner().quorum.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_get_compact_replies_over_many_rounds_and_see_full_quorums() {
    bounded(async {
        let server = start(4).await;
        let addr = server.address();
        // Three manager-like clients, one raw client that sends what it knows and one
        // old-style raw client that never does.
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(LighthouseClient::connect(&addr, ASK).await.unwrap());
        }
        let raw = raw_client(&addr).await;
        let mut raw_known: Option<Quorum> = None;
        let mut first_id = None;
        let mut compact_seen = 0;
        for round in 0..12i64 {
            // Group c lags one step every third round; the others advance together.
            let step_of = |id: &str| {
                if id == "c" && round % 3 == 2 {
                    round
                } else {
                    round + 1
                }
            };
            let tasks: Vec<_> = clients
                .iter()
                .zip(["a", "b", "c"])
                .map(|(c, id)| {
                    let (c, m) = (c.clone(), member(id, step_of(id)));
                    tokio::spawn(async move { c.quorum(m, ASK).await })
                })
                .collect();
            let known = raw_known
                .as_ref()
                .map_or((0, 0), |q| (q.quorum_id, q.revision));
            let raw_reply = raw_quorum(&raw, member("d", round + 1), known).await;
            let mut full = Vec::new();
            for t in tasks {
                full.push(t.await.unwrap().unwrap());
            }
            let expected: Vec<(String, i64)> = ["a", "b", "c", "d"]
                .iter()
                .map(|id| {
                    (
                        id.to_string(),
                        if *id == "d" { round + 1 } else { step_of(id) },
                    )
                })
                .collect();
            for (q, c) in full.iter().zip(&clients) {
                assert_eq!(
                    q, &full[0],
                    "round {round}: every client sees the same quorum"
                );
                let got: Vec<(String, i64)> = q
                    .participants
                    .iter()
                    .map(|m| (m.replica_id.clone(), m.step))
                    .collect();
                assert_eq!(got, expected, "round {round}");
                assert!(q.compact.is_none());
                assert_eq!(q.participants[0].address, "http://a.example:1");
                assert_eq!(c.known_quorum().as_deref(), Some(q), "round {round}: cache");
            }
            assert_eq!(
                full[0].revision,
                round as u64 + 1,
                "one revision per quorum"
            );
            assert_eq!(
                *first_id.get_or_insert(full[0].quorum_id),
                full[0].quorum_id
            );
            // What the wire carried for the raw client that told what it knows.
            if round == 0 {
                assert_eq!(raw_reply.participants.len(), 4, "nothing known: full form");
                assert!(raw_reply.compact.is_none());
            } else {
                assert!(
                    raw_reply.participants.is_empty(),
                    "round {round}: compact form"
                );
                let c = raw_reply.compact.as_ref().unwrap();
                assert_eq!(c.count, 4);
                assert_eq!(c.base_step, round + 1);
                if round % 3 == 2 {
                    assert_eq!(
                        (c.indices.as_slice(), c.steps.as_slice()),
                        (&[2][..], &[round][..])
                    );
                } else {
                    assert!(c.indices.is_empty());
                }
                compact_seen += 1;
            }
            let expanded = torchft::client::compact::expand(raw_known.as_ref(), raw_reply).unwrap();
            assert_eq!(expanded, full[0], "round {round}: raw expansion");
            raw_known = Some(expanded);
        }
        assert_eq!(compact_seen, 11);
        // The manager-like clients and the raw one got compact replies after round one.
        assert_eq!(server.reply_counts(), (4, 44));
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_style_requests_keep_getting_full_quorums() {
    bounded(async {
        let server = start(2).await;
        let addr = server.address();
        let client = LighthouseClient::connect(&addr, ASK).await.unwrap();
        let raw = raw_client(&addr).await;
        for round in 1..=5i64 {
            let (new, old) = tokio::join!(
                client.quorum(member("new", round), ASK),
                raw_quorum(&raw, member("old", round), (0, 0)),
            );
            let new = new.unwrap();
            assert!(old.compact.is_none(), "round {round}");
            assert_eq!(old.participants.len(), 2, "round {round}: full form");
            assert_eq!(old, new, "round {round}");
        }
        assert_eq!(
            server.reply_counts(),
            (6, 4),
            "only the new client gets compact replies"
        );
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_or_foreign_knowledge_gets_the_full_form() {
    bounded(async {
        let server = start(1).await;
        let raw = raw_client(&server.address()).await;
        let q1 = raw_quorum(&raw, member("a", 1), (0, 0)).await;
        let q2 = raw_quorum(&raw, member("a", 2), (q1.quorum_id, q1.revision)).await;
        assert!(q2.participants.is_empty(), "steady state: compact");
        // Data changes: the holder of an older revision needs the full form.
        let changed = QuorumMember {
            data: "{\"k\":1}".into(),
            ..member("a", 3)
        };
        let q3 = raw_quorum(&raw, changed.clone(), (q1.quorum_id, q1.revision)).await;
        assert_eq!(q3.participants, vec![changed.clone()]);
        let changed4 = QuorumMember {
            step: 4,
            ..changed.clone()
        };
        // A revision from before the change, another id, or a revision never issued.
        for known in [
            (q1.quorum_id, q1.revision),
            (q1.quorum_id + 1000, q3.revision),
            (q1.quorum_id, q3.revision + 100),
        ] {
            let q = raw_quorum(&raw, changed4.clone(), known).await;
            assert_eq!(q.participants, vec![changed4.clone()], "known {known:?}");
        }
        // Holding the latest revision: compact again.
        let last = raw_quorum(&raw, changed4.clone(), (0, 0)).await;
        let q = raw_quorum(&raw, changed4.clone(), (last.quorum_id, last.revision)).await;
        assert!(q.participants.is_empty());
        assert_eq!(q.compact.unwrap().base_step, 4);
        server.shutdown().await;
    })
    .await;
}

/// A lighthouse that records `(known_quorum_id, known_revision)` of every request and answers
/// with the next scripted reply.
#[derive(Clone)]
struct Scripted {
    known: Arc<Mutex<Vec<(i64, u64)>>>,
    replies: Arc<Mutex<Vec<Quorum>>>,
}

#[tonic::async_trait]
impl FakeLighthouse for Scripted {
    async fn quorum(
        &self,
        request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        let req = request.into_inner();
        self.known
            .lock()
            .unwrap()
            .push((req.known_quorum_id, req.known_revision));
        let mut replies = self.replies.lock().unwrap();
        if replies.is_empty() {
            return Err(Status::unavailable("script exhausted"));
        }
        Ok(Response::new(LighthouseQuorumResponse {
            quorum: Some(replies.remove(0)),
        }))
    }

    async fn heartbeat(
        &self,
        _request: Request<LighthouseHeartbeatRequest>,
    ) -> Result<Response<LighthouseHeartbeatResponse>, Status> {
        Ok(Response::new(LighthouseHeartbeatResponse::default()))
    }
}

fn quorum(id: i64, revision: u64, steps: &[i64]) -> Quorum {
    Quorum {
        quorum_id: id,
        revision,
        participants: steps
            .iter()
            .enumerate()
            .map(|(i, s)| member(&format!("g{i}"), *s))
            .collect(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexpandable_compact_reply_falls_back_to_the_full_form() {
    bounded(async {
        // Each case: the compact reply the client cannot expand after holding q1.
        let q1 = quorum(5, 1, &[1, 1, 1]);
        let cases: Vec<(&str, Quorum)> = vec![
            ("other quorum id", compact_form(&quorum(6, 2, &[2, 2, 2]))),
            ("other member count", compact_form(&quorum(5, 2, &[2, 2]))),
            ("older revision", compact_form(&quorum(5, 0, &[2, 2, 2]))),
        ];
        for (name, bad) in cases {
            let full = quorum(7, 3, &[3, 3, 2]);
            let fake = Scripted {
                known: Arc::default(),
                replies: Arc::new(Mutex::new(vec![q1.clone(), bad, full.clone()])),
            };
            let (addr, stop_tx, serve) = serve_fake(fake.clone()).await;
            let client = LighthouseClient::connect(&addr, ASK).await.unwrap();
            let got1 = client.quorum(member("g0", 1), ASK).await.unwrap();
            assert_eq!(got1, q1, "{name}");
            let got2 = client.quorum(member("g0", 3), ASK).await.unwrap();
            assert_eq!(got2, full, "{name}: the full form, never a guess");
            assert_eq!(client.known_quorum().as_deref(), Some(&full), "{name}");
            assert_eq!(
                *fake.known.lock().unwrap(),
                vec![(0, 0), (5, 1), (0, 0)],
                "{name}: asked again without known_*"
            );
            let _ = stop_tx.send(true);
            serve.abort();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_leaving_is_sent_as_a_delta() {
    bounded(async {
        let opts = LighthouseOptions {
            min_replicas: 1,
            join_timeout: Duration::from_millis(200),
            quorum_tick: Duration::from_millis(10),
            heartbeat_timeout: Duration::from_secs(5),
            // Not about the no-regression rules: no startup hold, no wait for progress.
            progress_wait: Duration::ZERO,
            state_file: None,
            hang_timeout: None,
        };
        let server = LighthouseServer::bind("127.0.0.1:0", opts).await.unwrap();
        let addr = server.address();
        let (a, c) = (
            LighthouseClient::connect(&addr, ASK).await.unwrap(),
            LighthouseClient::connect(&addr, ASK).await.unwrap(),
        );
        let raw = raw_client(&addr).await;
        // Heartbeat all three first so the first round waits for everyone.
        for id in ["a", "b", "c"] {
            a.heartbeat(id, ASK).await.unwrap();
        }
        let (qa, qb, qc) = tokio::join!(
            a.quorum(member("a", 1), ASK),
            raw_quorum(&raw, member("b", 1), (0, 0)),
            c.quorum(member("c", 1), ASK),
        );
        let (qa, qc) = (qa.unwrap(), qc.unwrap());
        assert_eq!(qa, qb);
        assert_eq!(qa, qc);
        assert_eq!(qa.participants.len(), 3);
        // c is gone; a and b form a quorum after the join timeout.
        let (qa2, qb2) = tokio::join!(
            a.quorum(member("a", 2), ASK),
            raw_quorum(&raw, member("b", 2), (qb.quorum_id, qb.revision)),
        );
        let qa2 = qa2.unwrap();
        assert_ne!(qa2.quorum_id, qa.quorum_id);
        assert_eq!(qa2.participants, vec![member("a", 2), member("b", 2)]);
        assert!(qb2.participants.is_empty(), "a delta, not the member list");
        let delta = qb2.compact.clone().unwrap();
        assert_eq!(delta.removed, vec!["c".to_string()]);
        assert!(delta.upserts.is_empty());
        assert_eq!(
            torchft::client::compact::expand(Some(&qb), qb2).unwrap(),
            qa2
        );
        // First round: 3 full replies; second: a and b get deltas.
        assert_eq!(server.reply_counts(), (3, 2));
        server.shutdown().await;
    })
    .await;
}
