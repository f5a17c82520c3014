//! Wire compatibility with upstream torchft.
//!
//! The messages upstream's proto defines are written out below by hand, with upstream's field
//! names, numbers and types: that is the contract. The first tests pin our generated types to
//! it in both directions (every field set, encoded by one side, decoded by the other); the
//! last ones run an upstream-style client — the upstream messages only, so no compact replies
//! are asked for — against a real lighthouse on 127.0.0.1:0, alone and next to our client.

mod common;
use common::bounded;

use std::time::Duration;

use prost::Message;
use tonic::codegen::http::uri::PathAndQuery;
use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::proto as ours;

/// Upstream torchft's messages, as its proto defines them.
mod upstream {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct QuorumMember {
        #[prost(string, tag = "1")]
        pub replica_id: String,
        #[prost(string, tag = "2")]
        pub address: String,
        #[prost(string, tag = "3")]
        pub store_address: String,
        #[prost(int64, tag = "4")]
        pub step: i64,
        #[prost(uint64, tag = "5")]
        pub world_size: u64,
        #[prost(bool, tag = "6")]
        pub shrink_only: bool,
        #[prost(int64, tag = "8")]
        pub commit_failures: i64,
        #[prost(string, tag = "7")]
        pub data: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Quorum {
        #[prost(int64, tag = "1")]
        pub quorum_id: i64,
        #[prost(message, repeated, tag = "2")]
        pub participants: Vec<QuorumMember>,
        #[prost(message, optional, tag = "3")]
        pub created: Option<prost_types::Timestamp>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LighthouseQuorumRequest {
        #[prost(message, optional, tag = "1")]
        pub requester: Option<QuorumMember>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LighthouseQuorumResponse {
        #[prost(message, optional, tag = "1")]
        pub quorum: Option<Quorum>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LighthouseHeartbeatRequest {
        #[prost(string, tag = "1")]
        pub replica_id: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LighthouseHeartbeatResponse {}

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ManagerQuorumRequest {
        #[prost(int64, tag = "1")]
        pub group_rank: i64,
        #[prost(int64, tag = "2")]
        pub step: i64,
        #[prost(string, tag = "3")]
        pub checkpoint_metadata: String,
        #[prost(bool, tag = "4")]
        pub shrink_only: bool,
        #[prost(bool, tag = "5")]
        pub init_sync: bool,
        #[prost(int64, tag = "6")]
        pub commit_failures: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ManagerQuorumResponse {
        #[prost(int64, tag = "1")]
        pub quorum_id: i64,
        #[prost(string, tag = "2")]
        pub recover_src_manager_address: String,
        #[prost(int64, optional, tag = "3")]
        pub recover_src_replica_rank: Option<i64>,
        #[prost(int64, repeated, tag = "4")]
        pub recover_dst_replica_ranks: Vec<i64>,
        #[prost(string, tag = "5")]
        pub store_address: String,
        #[prost(int64, tag = "6")]
        pub max_step: i64,
        #[prost(int64, optional, tag = "7")]
        pub max_replica_rank: Option<i64>,
        #[prost(int64, tag = "8")]
        pub max_world_size: i64,
        #[prost(int64, tag = "9")]
        pub replica_rank: i64,
        #[prost(int64, tag = "10")]
        pub replica_world_size: i64,
        #[prost(bool, tag = "11")]
        pub heal: bool,
        #[prost(int64, tag = "12")]
        pub commit_failures: i64,
        #[prost(string, repeated, tag = "13")]
        pub replica_ids: Vec<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CheckpointMetadataRequest {
        #[prost(int64, tag = "1")]
        pub rank: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CheckpointMetadataResponse {
        #[prost(string, tag = "1")]
        pub checkpoint_metadata: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ShouldCommitRequest {
        #[prost(bool, tag = "1")]
        pub should_commit: bool,
        #[prost(int64, tag = "2")]
        pub group_rank: i64,
        #[prost(int64, tag = "3")]
        pub step: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ShouldCommitResponse {
        #[prost(bool, tag = "1")]
        pub should_commit: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KillRequest {
        #[prost(string, tag = "1")]
        pub msg: String,
    }
}

const ASK: Duration = Duration::from_secs(10);

/// Runs a test body with an overall timeout so a hang fails instead of blocking CI.
/// Encodes `msg` with one side's type and decodes it with the other's.
fn cross<A: Message, B: Message + Default>(msg: &A) -> B {
    B::decode(msg.encode_to_vec().as_slice()).expect("decodes across the contract")
}

fn upstream_member(id: &str, step: i64, failures: i64) -> upstream::QuorumMember {
    upstream::QuorumMember {
        replica_id: id.to_string(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step,
        world_size: 3,
        shrink_only: false,
        commit_failures: failures,
        data: format!("{{\"name\":\"{id}\"}}"),
    }
}

fn our_member(id: &str, step: i64) -> ours::QuorumMember {
    ours::QuorumMember {
        replica_id: id.to_string(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step,
        world_size: 2,
        shrink_only: false,
        commit_failures: 0,
        data: "{\"ours\":true}".to_string(),
    }
}

#[test]
fn quorum_member_matches_upstream_numbers_both_ways() {
    let ours_m = ours::QuorumMember {
        replica_id: "r:1".into(),
        address: "http://h:1".into(),
        store_address: "h:2".into(),
        step: 41,
        world_size: 7,
        shrink_only: true,
        commit_failures: 3,
        data: "{\"k\":1}".into(),
    };
    let up: upstream::QuorumMember = cross(&ours_m);
    assert_eq!(
        (
            up.replica_id.as_str(),
            up.address.as_str(),
            up.store_address.as_str()
        ),
        ("r:1", "http://h:1", "h:2")
    );
    assert_eq!((up.step, up.world_size, up.shrink_only), (41, 7, true));
    assert_eq!(up.commit_failures, 3, "commit_failures is field 8");
    assert_eq!(up.data, "{\"k\":1}", "data is field 7");
    let back: ours::QuorumMember = cross(&up);
    assert_eq!(back, ours_m);
}

#[test]
fn lighthouse_messages_match_upstream_numbers_both_ways() {
    let member = |id: &str| ours::QuorumMember {
        replica_id: id.into(),
        address: format!("http://{id}:1"),
        store_address: format!("{id}:2"),
        step: 5,
        world_size: 2,
        shrink_only: false,
        commit_failures: 1,
        data: "{}".into(),
    };
    let created = prost_types::Timestamp {
        seconds: 1_700_000_000,
        nanos: 17,
    };
    let quorum = ours::Quorum {
        quorum_id: 1234,
        participants: vec![member("a"), member("b")],
        created: Some(created),
        ..Default::default()
    };
    let resp = ours::LighthouseQuorumResponse {
        quorum: Some(quorum.clone()),
    };
    let up: upstream::LighthouseQuorumResponse = cross(&resp);
    let uq = up.quorum.clone().expect("quorum is field 1");
    assert_eq!(uq.quorum_id, 1234);
    assert_eq!(uq.created, Some(created));
    let ids: Vec<_> = uq
        .participants
        .iter()
        .map(|m| m.replica_id.as_str())
        .collect();
    assert_eq!(ids, ["a", "b"]);
    assert!(uq
        .participants
        .iter()
        .all(|m| m.data == "{}" && m.commit_failures == 1));
    let back: ours::LighthouseQuorumResponse = cross(&up);
    assert_eq!(back.quorum, Some(quorum));

    let req = upstream::LighthouseQuorumRequest {
        requester: Some(upstream_member("u", 9, 2)),
    };
    let ours_req: ours::LighthouseQuorumRequest = cross(&req);
    let r = ours_req.requester.expect("requester is field 1");
    assert_eq!(
        (r.replica_id.as_str(), r.step, r.commit_failures),
        ("u", 9, 2)
    );
    assert_eq!(r.data, "{\"name\":\"u\"}");
    // An upstream request asks for no compact form.
    assert_eq!((ours_req.known_quorum_id, ours_req.known_revision), (0, 0));

    let hb: ours::LighthouseHeartbeatRequest = cross(&upstream::LighthouseHeartbeatRequest {
        replica_id: "u".into(),
    });
    assert_eq!(hb.replica_id, "u");
    // Upstream sends no committed step nor quorum: ours reads them as absent (so an
    // upstream manager never turns a lighthouse's startup hold on).
    assert_eq!((hb.step, hb.quorum_id), (None, None));
    // Ours with a step and a quorum stays readable by upstream (the fields are skipped).
    let up: upstream::LighthouseHeartbeatRequest = cross(&ours::LighthouseHeartbeatRequest {
        replica_id: "u".into(),
        step: Some(7),
        quorum_id: Some(42),
        loop_idle_ms: Some(1500),
        digest: Some(ours::StateDigest {
            step: 10,
            ranks: vec![vec![1; 16], vec![2; 16]],
        }),
        job: "a-job".into(),
    });
    assert_eq!(up.replica_id, "u");
    // Upstream sends no job: ours reads the default room.
    assert_eq!(hb.job, "");
    // Our heartbeat reply carries fields upstream does not know: they must be skippable.
    let _: upstream::LighthouseHeartbeatResponse = cross(&ours::LighthouseHeartbeatResponse {
        heartbeat_timeout_ms: 5000,
        waiting: "the round has waited 2.5s: waiting for 1 straggler".into(),
        hung: "no training-loop activity for 12.0s".into(),
        parity_step: 10,
        diverged: "no majority".into(),
        parity_ok_step: 10,
        parity_diverged_step: 0,
    });
    // Upstream's empty reply reads as ours with nothing said.
    let back: ours::LighthouseHeartbeatResponse = cross(&upstream::LighthouseHeartbeatResponse {});
    assert_eq!(
        (
            back.heartbeat_timeout_ms,
            back.waiting.as_str(),
            back.hung.as_str()
        ),
        (0, "", "")
    );
}

#[test]
fn manager_messages_match_upstream_numbers_both_ways() {
    let req = ours::ManagerQuorumRequest {
        group_rank: 3,
        step: 11,
        checkpoint_metadata: "http://h:9/ckpt".into(),
        shrink_only: true,
        init_sync: true,
        commit_failures: 4,
    };
    let up: upstream::ManagerQuorumRequest = cross(&req);
    assert_eq!(
        (up.group_rank, up.step, up.checkpoint_metadata.as_str()),
        (3, 11, "http://h:9/ckpt")
    );
    assert_eq!(
        (up.shrink_only, up.init_sync, up.commit_failures),
        (true, true, 4)
    );
    assert_eq!(cross::<_, ours::ManagerQuorumRequest>(&up), req);

    let resp = ours::ManagerQuorumResponse {
        quorum_id: 8,
        recover_src_manager_address: "http://src:1".into(),
        recover_src_replica_rank: Some(1),
        recover_dst_replica_ranks: vec![2, 3],
        store_address: "store:4".into(),
        max_step: 99,
        max_replica_rank: Some(0),
        max_world_size: 2,
        replica_rank: 1,
        replica_world_size: 4,
        heal: true,
        commit_failures: 5,
        replica_ids: vec!["a".into(), "b".into()],
    };
    let up: upstream::ManagerQuorumResponse = cross(&resp);
    assert_eq!(up.quorum_id, 8);
    assert_eq!(up.recover_src_manager_address, "http://src:1");
    assert_eq!(up.recover_src_replica_rank, Some(1));
    assert_eq!(up.recover_dst_replica_ranks, [2, 3]);
    assert_eq!(up.store_address, "store:4");
    assert_eq!(
        (up.max_step, up.max_replica_rank, up.max_world_size),
        (99, Some(0), 2)
    );
    assert_eq!(
        (up.replica_rank, up.replica_world_size, up.heal),
        (1, 4, true)
    );
    assert_eq!(up.commit_failures, 5);
    assert_eq!(up.replica_ids, ["a", "b"]);
    assert_eq!(cross::<_, ours::ManagerQuorumResponse>(&up), resp);

    let sc = ours::ShouldCommitRequest {
        should_commit: true,
        group_rank: 2,
        step: 6,
        ..Default::default()
    };
    let up: upstream::ShouldCommitRequest = cross(&sc);
    assert_eq!((up.should_commit, up.group_rank, up.step), (true, 2, 6));
    assert_eq!(cross::<_, ours::ShouldCommitRequest>(&up), sc);
    // A vote carrying a state digest stays readable by an upstream manager server.
    let up: upstream::ShouldCommitRequest = cross(&ours::ShouldCommitRequest {
        digest_step: 5,
        digest: vec![3; 16],
        ..sc.clone()
    });
    assert_eq!((up.should_commit, up.group_rank, up.step), (true, 2, 6));
    let up: upstream::ShouldCommitResponse = cross(&ours::ShouldCommitResponse {
        should_commit: true,
    });
    assert!(up.should_commit);

    let up: upstream::CheckpointMetadataRequest =
        cross(&ours::CheckpointMetadataRequest { rank: 7 });
    assert_eq!(up.rank, 7);
    let up: upstream::CheckpointMetadataResponse = cross(&ours::CheckpointMetadataResponse {
        checkpoint_metadata: "meta".into(),
    });
    assert_eq!(up.checkpoint_metadata, "meta");
    let up: upstream::KillRequest = cross(&ours::KillRequest { msg: "bye".into() });
    assert_eq!(up.msg, "bye");
}

async fn start(min_replicas: u64) -> LighthouseServer {
    let opts = LighthouseOptions {
        min_replicas,
        join_timeout: Duration::from_secs(30),
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_secs(5),
        // No startup hold: rounds are issued at once.
        progress_wait: Duration::ZERO,
        state_file: None,
        hang_timeout: None,
    };
    LighthouseServer::bind("127.0.0.1:0", opts)
        .await
        .expect("lighthouse binds")
}

/// A client that speaks only upstream's messages, over a plain gRPC channel.
#[derive(Clone)]
struct UpstreamClient {
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
}

impl UpstreamClient {
    async fn connect(addr: &str) -> Self {
        // Upstream has no token or TLS: a plain channel, as an upstream manager dials.
        let channel = torchft::client::connect(
            addr,
            Duration::from_secs(5),
            &torchft::security::Security::none(),
        )
        .await
        .expect("connects");
        Self {
            grpc: tonic::client::Grpc::new(channel),
        }
    }

    async fn call<Req, Resp>(&mut self, path: &'static str, msg: Req) -> Resp
    where
        Req: Message + Send + Sync + 'static,
        Resp: Message + Default + Send + Sync + 'static,
    {
        self.grpc.ready().await.expect("channel ready");
        let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
        let req = torchft::net::with_timeout(msg, ASK);
        self.grpc
            .unary(req, PathAndQuery::from_static(path), codec)
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .into_inner()
    }

    async fn quorum(&mut self, member: upstream::QuorumMember) -> upstream::Quorum {
        let resp: upstream::LighthouseQuorumResponse = self
            .call(
                "/torchft.LighthouseService/Quorum",
                upstream::LighthouseQuorumRequest {
                    requester: Some(member),
                },
            )
            .await;
        resp.quorum.expect("a quorum in the reply")
    }

    async fn heartbeat(&mut self, replica_id: &str) {
        let _: upstream::LighthouseHeartbeatResponse = self
            .call(
                "/torchft.LighthouseService/Heartbeat",
                upstream::LighthouseHeartbeatRequest {
                    replica_id: replica_id.into(),
                },
            )
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_clients_get_full_quorums_from_our_lighthouse() {
    bounded(async {
        let server = start(2).await;
        let addr = server.address();
        let a = UpstreamClient::connect(&addr).await;
        let b = UpstreamClient::connect(&addr).await;
        let mut first_id = None;
        for round in 0..5i64 {
            let (mut ca, mut cb) = (a.clone(), b.clone());
            ca.heartbeat("a").await;
            cb.heartbeat("b").await;
            let ta = tokio::spawn(async move { ca.quorum(upstream_member("a", round, 0)).await });
            let tb = tokio::spawn(async move { cb.quorum(upstream_member("b", round, 0)).await });
            let (qa, qb) = (ta.await.unwrap(), tb.await.unwrap());
            assert_eq!(qa, qb, "round {round}: both see the same quorum");
            // Full replies every round: every member with every field, as sent.
            assert_eq!(
                qa.participants,
                vec![
                    upstream_member("a", round, 0),
                    upstream_member("b", round, 0)
                ],
                "round {round}"
            );
            assert!(qa.created.is_some());
            let id = *first_id.get_or_insert(qa.quorum_id);
            assert_eq!(qa.quorum_id, id, "round {round}: same members keep the id");
        }
        // A member reporting commit failures (field 8) forces a new quorum id.
        let (mut ca, mut cb) = (a.clone(), b.clone());
        let ta = tokio::spawn(async move { ca.quorum(upstream_member("a", 5, 2)).await });
        let tb = tokio::spawn(async move { cb.quorum(upstream_member("b", 5, 0)).await });
        let (qa, qb) = (ta.await.unwrap(), tb.await.unwrap());
        assert_eq!(qa, qb);
        assert!(
            qa.quorum_id > first_id.unwrap(),
            "commit failures bump the id"
        );
        assert_eq!(qa.participants[0].commit_failures, 2);
        assert_eq!(qa.participants[0].data, "{\"name\":\"a\"}");
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_and_our_clients_share_a_quorum() {
    bounded(async {
        let server = start(2).await;
        let addr = server.address();
        let mut up = UpstreamClient::connect(&addr).await;
        let ourc = LighthouseClient::connect(&addr, ASK)
            .await
            .expect("connects");
        for round in 0..3i64 {
            let c = ourc.clone();
            let t = tokio::spawn(async move { c.quorum(our_member("z", round), ASK).await });
            let q_up = up.quorum(upstream_member("u", round, 0)).await;
            let q_ours = t.await.unwrap().expect("our client gets a quorum");
            assert_eq!(q_up.quorum_id, q_ours.quorum_id);
            // The upstream client sees our member's fields, data included, in full.
            let z = q_up
                .participants
                .iter()
                .find(|m| m.replica_id == "z")
                .expect("our member is in the upstream reply");
            assert_eq!((z.step, z.world_size), (round, 2));
            assert_eq!(z.data, "{\"ours\":true}");
            // And ours sees the upstream member's data where upstream put it.
            let u = q_ours
                .participants
                .iter()
                .find(|m| m.replica_id == "u")
                .expect("the upstream member is in our reply");
            assert_eq!(u.data, "{\"name\":\"u\"}");
            assert_eq!(u.world_size, 3);
        }
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_clients_join_the_default_room_next_to_a_named_job() {
    bounded(async {
        let server = start(2).await;
        let addr = server.address();
        let mut up = UpstreamClient::connect(&addr).await;
        let ours_default = LighthouseClient::connect(&addr, ASK)
            .await
            .expect("connects");
        let job = LighthouseClient::connect(&addr, ASK)
            .await
            .expect("connects")
            .with_job("other-job")
            .unwrap();
        // The named job runs its own round with the same replica names.
        let (j1, j2) = (job.clone(), job.clone());
        let ju = tokio::spawn(async move { j1.quorum(our_member("u", 40), ASK).await });
        let jz = tokio::spawn(async move { j2.quorum(our_member("z", 40), ASK).await });
        // The upstream client (no job field) and ours (no job) meet in the default room.
        let c = ours_default.clone();
        let t = tokio::spawn(async move { c.quorum(our_member("z", 1), ASK).await });
        let q_up = up.quorum(upstream_member("u", 1, 0)).await;
        let q_ours = t.await.unwrap().expect("our client gets a quorum");
        assert_eq!(q_up.quorum_id, q_ours.quorum_id);
        assert!(q_up.participants.iter().all(|m| m.step == 1));
        let q_job = ju.await.unwrap().expect("job quorum");
        assert_eq!(jz.await.unwrap().expect("job quorum"), q_job);
        assert!(q_job.participants.iter().all(|m| m.step == 40));
        assert_ne!(q_job.quorum_id, q_up.quorum_id);
        assert_eq!(server.quorum_id(), Some(q_up.quorum_id));
        assert_eq!(server.room_quorum_id("other-job"), Some(q_job.quorum_id));
        server.shutdown().await;
    })
    .await;
}
