//! Rooms: one lighthouse serving several jobs (a real lighthouse on 127.0.0.1:0, real gRPC
//! clients naming their job). Each job's quorums, quorum ids, commits, losses and pages are
//! its own; groups of different jobs may even share names.

mod common;
use common::{bounded, TempDir};

use std::collections::BTreeMap;
use std::time::Duration;

use torchft::lighthouse::{
    AccessOptions, LighthouseClient, LighthouseOptions, LighthouseServer, ObservabilityOptions,
    RoomOptions,
};
use torchft::proto::{Quorum, QuorumMember};

const ASK: Duration = Duration::from_secs(10);

fn opts(state_file: Option<std::path::PathBuf>) -> LighthouseOptions {
    LighthouseOptions {
        min_replicas: 2,
        join_timeout: Duration::from_secs(30),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_secs(5),
        progress_wait: Duration::ZERO,
        state_file,
        hang_timeout: None,
    }
}

async fn start_with(
    rooms: RoomOptions,
    state_file: Option<std::path::PathBuf>,
) -> LighthouseServer {
    LighthouseServer::bind_rooms(
        "127.0.0.1:0",
        opts(state_file),
        ObservabilityOptions::default(),
        AccessOptions::default(),
        rooms,
    )
    .await
    .expect("lighthouse binds")
}

async fn client(addr: &str, job: &str) -> LighthouseClient {
    LighthouseClient::connect(addr, ASK)
        .await
        .expect("connects")
        .with_job(job)
        .expect("valid job")
}

fn member(id: &str, step: i64) -> QuorumMember {
    QuorumMember {
        replica_id: id.to_string(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step,
        world_size: 1,
        ..Default::default()
    }
}

/// One round of `ids` (all at `step`) through `c`; every member's view of the quorum.
async fn round(c: &LighthouseClient, ids: &[&str], step: i64) -> Vec<Quorum> {
    let asks: Vec<_> = ids
        .iter()
        .map(|id| {
            let c = c.clone();
            let m = member(id, step);
            tokio::spawn(async move { c.quorum(m, ASK).await })
        })
        .collect();
    let mut out = Vec::new();
    for a in asks {
        out.push(a.await.unwrap().expect("quorum"));
    }
    out
}

async fn get_json(http: &reqwest::Client, url: &str) -> serde_json::Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

fn ids(q: &Quorum) -> Vec<&str> {
    q.participants
        .iter()
        .map(|m| m.replica_id.as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_the_same_group_names_get_their_own_quorums() {
    bounded(async {
        let server = start_with(RoomOptions::default(), None).await;
        let addr = server.address();
        let (a, b, default) = (
            client(&addr, "job-a").await,
            client(&addr, "job-b").await,
            client(&addr, "").await,
        );
        // Same names in three rooms, rounds interleaved.
        let (qa, qb, qd) = tokio::join!(
            round(&a, &["rg0", "rg1"], 3),
            round(&b, &["rg0", "rg1"], 7),
            round(&default, &["rg0", "rg1"], 0)
        );
        for (qs, step) in [(&qa, 3), (&qb, 7), (&qd, 0)] {
            assert_eq!(ids(&qs[0]), ["rg0", "rg1"]);
            assert_eq!(qs[0], qs[1], "both members see one quorum");
            assert!(qs[0].participants.iter().all(|m| m.step == step));
        }
        let (ida, idb) = (qa[0].quorum_id, qb[0].quorum_id);
        assert_ne!(ida, idb, "each room numbers its own quorums");
        assert_eq!(server.room_quorum_id("job-a"), Some(ida));
        assert_eq!(server.room_quorum_id("job-b"), Some(idb));
        assert_eq!(server.quorum_id(), Some(qd[0].quorum_id));
        assert_eq!(server.rooms(), ["", "job-a", "job-b"]);

        // Job a changes membership (rg1 leaves, rg2 and rg3 join) and fails a commit; job
        // b's quorum id never moves.
        let qa2 = round(&a, &["rg0", "rg2", "rg3"], 4).await;
        assert_ne!(qa2[0].quorum_id, ida);
        let refused = a.commit("rg1", ida, 5, 0.0, ASK).await.expect("an answer");
        assert!(
            refused.is_some(),
            "a commit under a replaced quorum is refused"
        );
        for step in 8..11 {
            let qb = round(&b, &["rg0", "rg1"], step).await;
            assert_eq!(qb[0].quorum_id, idb, "step {step}");
            assert_eq!(ids(&qb[0]), ["rg0", "rg1"]);
            let accepted = b.commit("rg0", idb, step + 1, 0.0, ASK).await.unwrap();
            assert_eq!(accepted, None, "job b commits as before");
        }
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_group_and_bad_input_in_one_job_leave_the_other_alone() {
    bounded(async {
        let server = start_with(RoomOptions::default(), None).await;
        let addr = server.address();
        let (a, b) = (client(&addr, "a").await, client(&addr, "b").await);
        let qa = round(&a, &["x", "y"], 1).await;
        let qb = round(&b, &["x", "y"], 1).await;
        // Both rooms' "y" hold sessions; job a's ends (its process died).
        let session_a = a.session("y", ASK).await.expect("session a");
        let mut session_b = b.session("y", ASK).await.expect("session b");
        let _session_ax = a.session("x", ASK).await.expect("session a x");
        assert_eq!(server.num_sessions(), 3);
        drop(session_a);
        // Job a's "y" is declared lost: its commit under qa is refused.
        let deadline = tokio::time::Instant::now() + ASK;
        loop {
            if a.commit("y", qa[0].quorum_id, 2, 0.0, ASK)
                .await
                .unwrap()
                .is_some()
            {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "loss not seen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Bad input in job a: an empty replica id, a malformed job name.
        let err = a.quorum(member("", 1), ASK).await.unwrap_err();
        assert!(err.to_string().contains("replica_id"), "{err}");
        let err = LighthouseClient::connect(&addr, ASK)
            .await
            .unwrap()
            .with_job("../etc")
            .unwrap_err();
        assert!(err.to_string().contains("invalid job name"), "{err}");
        // Job b: no loss announced, same quorum id, commits accepted.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), session_b.message())
                .await
                .is_err(),
            "job b's session heard nothing"
        );
        assert_eq!(
            b.commit("y", qb[0].quorum_id, 2, 0.0, ASK).await.unwrap(),
            None
        );
        assert_eq!(
            b.commit("x", qb[0].quorum_id, 2, 0.0, ASK).await.unwrap(),
            None
        );
        let qb2 = round(&b, &["x", "y"], 2).await;
        assert_eq!(qb2[0].quorum_id, qb[0].quorum_id);
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_have_their_own_min_replicas_limit_and_pages() {
    bounded(async {
        let server = start_with(
            RoomOptions {
                max_rooms: 2,
                min_replicas: BTreeMap::from([("solo".to_string(), 1)]),
                ..RoomOptions::default()
            },
            None,
        )
        .await;
        let addr = server.address();
        let solo = client(&addr, "solo").await;
        let q = round(&solo, &["only"], 0).await;
        assert_eq!(ids(&q[0]), ["only"], "min_replicas 1 in this room");
        let pair = client(&addr, "pair").await;
        round(&pair, &["p", "q"], 0).await;
        // A third room is refused, naming the limit; the open rooms are untouched.
        let third = client(&addr, "third").await;
        let err = third.quorum(member("t", 0), ASK).await.unwrap_err();
        assert!(err.to_string().contains("--max_rooms 2"), "{err}");
        assert_eq!(server.rooms(), ["", "pair", "solo"]);

        let http = reqwest::Client::new();
        let status = get_json(&http, &format!("{addr}/status?job=pair")).await;
        assert_eq!(status["job"], "pair");
        assert_eq!(status["members"].as_array().unwrap().len(), 2);
        let rooms: Vec<&str> = status["rooms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["job"].as_str().unwrap())
            .collect();
        assert_eq!(rooms, ["", "pair", "solo"]);
        let default = get_json(&http, &format!("{addr}/status")).await;
        assert_eq!(default["job"], "");
        assert!(default["members"].as_array().unwrap().is_empty());
        let missing = http
            .get(format!("{addr}/status?job=third"))
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 404, "pages never open a room");
        let metrics = http
            .get(format!("{addr}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(
            metrics
                .matches("# TYPE torchft_quorum_participants ")
                .count(),
            1
        );
        assert!(
            metrics.contains("torchft_quorum_participants 0\n"),
            "{metrics}"
        );
        assert!(metrics.contains("torchft_quorum_participants{job=\"pair\"} 2\n"));
        assert!(metrics.contains("torchft_quorum_participants{job=\"solo\"} 1\n"));
        assert!(metrics.contains("torchft_min_replicas{job=\"solo\"} 1\n"));
        assert!(metrics.contains("torchft_rooms 3\n"));
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_rooms_close_and_each_room_keeps_its_part_of_the_state_file() {
    bounded(async {
        let dir = TempDir::new("rooms-state");
        let state = dir.0.join("lighthouse.state");
        let rooms = RoomOptions {
            expiry: Duration::from_millis(300),
            ..RoomOptions::default()
        };
        let server = start_with(rooms.clone(), Some(state.clone())).await;
        let addr = server.address();
        let a = client(&addr, "a").await;
        let q1 = round(&a, &["x", "y"], 4).await[0].quorum_id;
        assert_eq!(a.commit("x", q1, 5, 0.0, ASK).await.unwrap(), None);
        server.flush_state().await.unwrap();
        let part = dir.0.join("lighthouse.state.room-a");
        assert!(part.exists(), "room a's part of the state file");
        // Idle past the expiry (no session, no waiter): the room closes, its part stays.
        let deadline = tokio::time::Instant::now() + ASK;
        while server.rooms() != [""] {
            assert!(
                tokio::time::Instant::now() < deadline,
                "room a never closed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(part.exists());
        server.shutdown().await;

        // A restarted lighthouse reopens room a from its part: quorum ids keep increasing,
        // and a commit under the quorum its previous life replaced is refused.
        let server = start_with(rooms, Some(state)).await;
        let a = client(&server.address(), "a").await;
        let q2 = round(&a, &["x", "z"], 5).await[0].quorum_id;
        assert!(q2 > q1, "{q2} after {q1}");
        assert!(a.commit("y", q1, 6, 0.0, ASK).await.unwrap().is_some());
        server.shutdown().await;
    })
    .await;
}
