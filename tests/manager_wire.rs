//! Wire tests: a real lighthouse and real manager servers on 127.0.0.1:0, real gRPC clients.

mod common;
use common::bounded;
use common::groups::{
    dead_port, group, group_with, lighthouse, lighthouse_on, opts, req, round, CONNECT, LONG,
};

use std::time::{Duration, Instant};

use torchft::client::in_process;
use torchft::error::Error;
use torchft::manager::{ManagerClient, ManagerOptions, ManagerServer};
use torchft::proto::{TelemetryBatch, TelemetryReport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_round_two_groups_two_ranks() {
    bounded(async {
        let lh = lighthouse(2).await;
        let a = group("a", &lh.address(), 2).await;
        let b = group("b", &lh.address(), 2).await;
        // Group a is up to date at step 3, group b is behind at step 1.
        let (ra, rb) = tokio::join!(round(&a, 3, LONG), round(&b, 1, LONG));
        let ra: Vec<_> = ra.into_iter().map(Result::unwrap).collect();
        let rb: Vec<_> = rb.into_iter().map(Result::unwrap).collect();
        for (rank, r) in ra.iter().enumerate() {
            assert_eq!(r.replica_rank, 0);
            assert_eq!(r.replica_world_size, 2);
            assert_eq!(r.replica_ids, vec!["a", "b"]);
            assert_eq!(r.max_step, 3);
            assert_eq!(r.max_replica_rank, Some(0));
            assert_eq!(r.max_world_size, 1);
            assert!(!r.heal, "rank {rank}");
            assert_eq!(r.recover_dst_replica_ranks, vec![1]);
            assert_eq!(r.store_address, "a-store:29500");
        }
        for r in &rb {
            assert_eq!(r.replica_rank, 1);
            assert!(r.heal);
            assert_eq!(r.max_replica_rank, None);
            assert_eq!(r.recover_src_replica_rank, Some(0));
            assert_eq!(r.recover_src_manager_address, a.server.address());
            assert_eq!(r.store_address, "a-store:29500");
        }
        let ids: Vec<_> = ra.iter().chain(rb.iter()).map(|r| r.quorum_id).collect();
        assert!(ids.iter().all(|&id| id == ids[0] && id > 0), "{ids:?}");

        // A healer asks the source's manager for the metadata of its own group rank.
        let src = ManagerClient::connect(&rb[1].recover_src_manager_address, CONNECT)
            .await
            .unwrap();
        assert_eq!(src.checkpoint_metadata(1, LONG).await.unwrap(), "meta-1");
        assert_eq!(src.checkpoint_metadata(0, LONG).await.unwrap(), "meta-0");

        lh.shutdown().await;
        a.server.shutdown().await;
        b.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_steps_with_commit_votes() {
    bounded(async {
        let lh = lighthouse(2).await;
        let a = group("a", &lh.address(), 2).await;
        let b = group("b", &lh.address(), 2).await;
        let mut last_id = None;
        for step in 0..10 {
            let (ra, rb) = tokio::join!(round(&a, step, LONG), round(&b, step, LONG));
            let all: Vec<_> = ra.into_iter().chain(rb).map(Result::unwrap).collect();
            let id = all[0].quorum_id;
            assert!(all.iter().all(|r| r.quorum_id == id && r.max_step == step));
            // Membership is stable: the id is kept after the first round.
            if let Some(prev) = last_id {
                assert_eq!(id, prev);
            }
            last_id = Some(id);
            // Both groups vote; group b's rank 1 votes no on odd steps.
            let votes = [&a, &b].into_iter().enumerate().flat_map(|(gi, g)| {
                g.clients.iter().enumerate().map(move |(rank, c)| {
                    let c = c.clone();
                    let vote = !(gi == 1 && rank == 1 && step % 2 == 1);
                    async move { (gi, c.should_commit(rank as i64, step, vote, LONG).await) }
                })
            });
            for (gi, decision) in futures::future::join_all(votes).await {
                let expected = !(gi == 1 && step % 2 == 1);
                assert_eq!(decision.unwrap(), expected, "group {gi} step {step}");
            }
        }
        // Managers without a topology file ask for the sparse form: no reply carries the
        // full member list, the first round's included.
        assert_eq!(lh.reply_counts(), (0, 20));
        lh.shutdown().await;
        a.server.shutdown().await;
        b.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_never_started_fails_all_ranks_promptly() {
    bounded(async {
        let addr = format!("http://127.0.0.1:{}", dead_port());
        let g = group("a", &addr, 2).await;
        let start = Instant::now();
        for r in round(&g, 0, LONG).await {
            let err = r.unwrap_err();
            assert!(matches!(err, Error::Unavailable(_)), "{err}");
            assert!(err.to_string().contains("lighthouse"), "{err}");
        }
        assert!(start.elapsed() < LONG / 2, "took {:?}", start.elapsed());
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_shut_down_fails_all_ranks_promptly() {
    bounded(async {
        let lh = lighthouse(1).await;
        let g = group("a", &lh.address(), 2).await;
        for r in round(&g, 0, LONG).await {
            r.unwrap();
        }
        lh.shutdown().await;
        let start = Instant::now();
        for r in round(&g, 1, LONG).await {
            assert!(matches!(r, Err(Error::Unavailable(_))), "{r:?}");
        }
        assert!(start.elapsed() < LONG / 2, "took {:?}", start.elapsed());
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_ride_out_a_lighthouse_that_comes_up_late() {
    bounded(async {
        let port = dead_port();
        let addr = format!("127.0.0.1:{port}");
        let mut o = opts("a", &addr, 1);
        o.quorum_retries = 20;
        let g = group_with(o).await;
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            lighthouse_on(&addr, 1).await
        });
        let r = g.clients[0].quorum(req(0, 0), LONG).await.unwrap();
        assert_eq!(r.replica_world_size, 1);
        late.await.unwrap().shutdown().await;
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_restart_on_same_port_next_quorum_forms_with_higher_id() {
    bounded(async {
        let lh = lighthouse(1).await;
        let bind = lh.local_addr().to_string();
        let g = group("a", &lh.address(), 2).await;
        let first = round(&g, 0, LONG).await;
        let id1 = first[0].as_ref().unwrap().quorum_id;
        lh.shutdown().await;
        drop(lh);
        // While it is down, rounds fail promptly.
        assert!(round(&g, 1, LONG).await.iter().all(|r| r.is_err()));
        let lh = lighthouse_on(&bind, 1).await;
        // Let the heartbeat loop find the new daemon (a few heartbeat periods).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let second = round(&g, 1, LONG).await;
        let ids: Vec<_> = second.into_iter().map(|r| r.unwrap().quorum_id).collect();
        assert_eq!(ids[0], ids[1]);
        assert!(ids[0] > id1, "quorum id went from {id1} to {}", ids[0]);
        lh.shutdown().await;
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_rank_others_time_out_at_their_deadline_and_leave() {
    bounded(async {
        let lh = lighthouse(1).await;
        let g = group("a", &lh.address(), 2).await;
        let deadline = Duration::from_millis(500);
        let start = Instant::now();
        let err = g.clients[0].quorum(req(0, 0), deadline).await.unwrap_err();
        let elapsed = start.elapsed();
        assert!(err.is_timeout(), "{err}");
        assert!(
            elapsed >= deadline - Duration::from_millis(50),
            "{elapsed:?}"
        );
        assert!(
            elapsed < deadline + Duration::from_millis(400),
            "{elapsed:?}"
        );
        // Rank 0 left the round: rank 1 alone does not complete it.
        let err = g.clients[1].quorum(req(1, 0), deadline).await.unwrap_err();
        assert!(err.is_timeout(), "{err}");
        // With both present the round completes.
        for r in round(&g, 0, LONG).await {
            r.unwrap();
        }
        lh.shutdown().await;
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lighthouse_waiting_is_bounded_by_each_ranks_deadline() {
    bounded(async {
        // min_replicas 2 with one group: the lighthouse never answers.
        let lh = lighthouse(2).await;
        let g = group("a", &lh.address(), 2).await;
        let start = Instant::now();
        let short = Duration::from_millis(300);
        let long = Duration::from_millis(900);
        let (r0, r1) = tokio::join!(
            async {
                let r = g.clients[0].quorum(req(0, 0), short).await;
                (r, start.elapsed())
            },
            async {
                let r = g.clients[1].quorum(req(1, 0), long).await;
                (r, start.elapsed())
            }
        );
        assert!(r0.0.unwrap_err().is_timeout());
        assert!(r1.0.unwrap_err().is_timeout());
        assert!(r0.1 < short + Duration::from_millis(300), "{:?}", r0.1);
        assert!(r1.1 >= long - Duration::from_millis(50), "{:?}", r1.1);
        assert!(r1.1 < long + Duration::from_millis(300), "{:?}", r1.1);
        lh.shutdown().await;
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_mismatch_between_ranks_fails_all_ranks() {
    bounded(async {
        let lh = lighthouse(1).await;
        let g = group("a", &lh.address(), 2).await;
        let start = Instant::now();
        let (r0, r1) = tokio::join!(g.clients[0].quorum(req(0, 4), LONG), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            g.clients[1].quorum(req(1, 5), LONG).await
        });
        for r in [r0, r1] {
            let err = r.unwrap_err();
            assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
            assert!(err.to_string().contains("step"), "{err}");
        }
        assert!(start.elapsed() < LONG / 2);
        lh.shutdown().await;
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused() {
    bounded(async {
        let lh = lighthouse(1).await;
        let g = group("a", &lh.address(), 2).await;
        let c = &g.clients[0];
        for bad in [req(2, 0), req(-1, 0), req(0, -1)] {
            let err = c.quorum(bad, LONG).await.unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
        let err = c.checkpoint_metadata(1, LONG).await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("group rank 1"), "{err}");
        for (rank, step) in [(2, 0), (-1, 0), (0, -1)] {
            let err = c.should_commit(rank, step, true, LONG).await.unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
        let bad_opts = ManagerOptions {
            world_size: 0,
            ..opts("b", &lh.address(), 1)
        };
        assert!(matches!(
            ManagerServer::start(bad_opts).await,
            Err(Error::InvalidArgument(_))
        ));
        lh.shutdown().await;
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn should_commit_across_two_ranks() {
    bounded(async {
        let lh = lighthouse(1).await;
        let g = group("a", &lh.address(), 2).await;
        let (c0, c1) = (&g.clients[0], &g.clients[1]);
        let (d0, d1) = tokio::join!(
            c0.should_commit(0, 5, true, LONG),
            c1.should_commit(1, 5, true, LONG)
        );
        assert!(d0.unwrap() && d1.unwrap());
        let (d0, d1) = tokio::join!(
            c0.should_commit(0, 6, true, LONG),
            c1.should_commit(1, 6, false, LONG)
        );
        assert!(!d0.unwrap() && !d1.unwrap());
        // A lone voter times out at its deadline, then a full round decides without it.
        let start = Instant::now();
        let err = c0
            .should_commit(0, 7, false, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(start.elapsed() < LONG / 2, "took {:?}", start.elapsed());
        let (d0, d1) = tokio::join!(
            c0.should_commit(0, 7, true, LONG),
            c1.should_commit(1, 7, true, LONG)
        );
        assert!(d0.unwrap() && d1.unwrap());
        // Votes for different steps fail both ranks at once.
        let start = Instant::now();
        let (d0, d1) = tokio::join!(c0.should_commit(0, 8, true, LONG), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            c1.should_commit(1, 9, true, LONG).await
        });
        assert!(matches!(d0, Err(Error::FailedPrecondition(_))), "{d0:?}");
        assert!(matches!(d1, Err(Error::FailedPrecondition(_))), "{d1:?}");
        assert!(start.elapsed() < LONG / 2);
        g.server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_commit_the_step_a_lost_member_interrupted_in_the_next_quorum() {
    bounded(async {
        let lh = lighthouse(1).await;
        let a = group("a", &lh.address(), 2).await;
        let b = group("b", &lh.address(), 2).await;
        // Both heartbeat before the round, so the quorum waits for both.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (ra, rb) = tokio::join!(round(&a, 5, LONG), round(&b, 5, LONG));
        assert!(ra
            .iter()
            .chain(rb.iter())
            .all(|r| r.as_ref().is_ok_and(|r| r.replica_ids == ["a", "b"])));
        // Rank 0 of a votes; rank 1 is still held up when b is lost: the vote ends "no".
        let (c0, c1) = (a.clients[0].clone(), a.clients[1].clone());
        let first = tokio::spawn(async move { c0.should_commit(0, 5, true, LONG).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.server.shutdown().await;
        assert!(
            !first.await.unwrap().unwrap(),
            "the vote of the lost member's quorum"
        );
        assert!(
            !c1.should_commit(1, 5, true, LONG).await.unwrap(),
            "its late voter"
        );
        // The survivors form a new quorum and retry step 5: it commits.
        let again = round(&a, 5, LONG).await;
        assert!(again
            .iter()
            .all(|r| r.as_ref().is_ok_and(|r| r.replica_ids == ["a"])));
        let (c0, c1) = (&a.clients[0], &a.clients[1]);
        let (d0, d1) = tokio::join!(
            c0.should_commit(0, 5, true, LONG),
            c1.should_commit(1, 5, true, LONG)
        );
        assert!(d0.unwrap() && d1.unwrap(), "step 5 never commits again");
        a.server.shutdown().await;
        lh.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_yes_round_does_not_commit_while_the_lighthouse_is_unreachable() {
    bounded(async {
        // The write-ahead commit cannot be announced: the round decides no (within the
        // ranks' budget), it does not fail.
        let addr = format!("http://127.0.0.1:{}", dead_port());
        let g = group("a", &addr, 2).await;
        let (c0, c1) = (&g.clients[0], &g.clients[1]);
        let short = Duration::from_millis(800);
        let (d0, d1) = tokio::join!(
            c0.should_commit(0, 5, true, short),
            c1.should_commit(1, 5, true, short)
        );
        assert!(!d0.unwrap() && !d1.unwrap());
        assert!(!g.server.may_commit(5, short).await.unwrap());
        g.server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_pending_calls() {
    bounded(async {
        let addr = format!("http://127.0.0.1:{}", dead_port());
        let g = group("a", &addr, 2).await;
        let c0 = g.clients[0].clone();
        let pending = tokio::spawn(async move { c0.should_commit(0, 1, true, LONG).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let start = Instant::now();
        g.server.shutdown().await;
        let r = pending.await.unwrap();
        assert!(r.is_err(), "{r:?}");
        assert!(!r.unwrap_err().is_timeout());
        assert!(start.elapsed() < Duration::from_secs(3));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_calls_answer_as_the_network_does() {
    bounded(async {
        let lh = lighthouse(1).await;
        let g = group("a", &lh.address(), 1).await;
        let local = g.clients[0].clone();
        let net = ManagerClient::connect(&g.server.address(), CONNECT)
            .await
            .unwrap()
            .network_only();
        let address = g.server.address();
        assert!(in_process::find(&address, None).is_some());
        // The same rank asks step after step, alternately in process and over the network.
        let mut answers = Vec::new();
        for step in 0..4 {
            let c = if step % 2 == 0 { &local } else { &net };
            let r = c.quorum(req(0, step), LONG).await.unwrap();
            assert!(c.should_commit(0, step, true, LONG).await.unwrap());
            answers.push(r);
        }
        // One quorum throughout (the same members), each answer at the step asked.
        for (i, r) in answers.iter().enumerate() {
            assert_eq!(r.quorum_id, answers[0].quorum_id, "{answers:?}");
            assert_eq!(r.replica_rank, 0);
            assert_eq!(r.replica_world_size, 1);
            assert_eq!(r.max_step, i as i64, "{answers:?}");
        }
        // A bad request is refused alike (same kind, same words) both ways.
        for bad in [req(2, 4), req(0, -1)] {
            let a = local.quorum(bad.clone(), LONG).await.unwrap_err();
            let b = net.quorum(bad, LONG).await.unwrap_err();
            assert!(matches!(a, Error::InvalidArgument(_)), "{a}");
            assert_eq!(a.to_string(), b.to_string());
        }
        let a = local.should_commit(3, 4, true, LONG).await.unwrap_err();
        let b = net.should_commit(3, 4, true, LONG).await.unwrap_err();
        assert_eq!(a.to_string(), b.to_string());
        // Telemetry batches: taken alike, and a malformed one refused alike.
        let report = |replica_id: &str| TelemetryReport {
            replica_id: replica_id.into(),
            group_world_size: 1,
            step: 1,
            ..Default::default()
        };
        let batch = |r: TelemetryReport| TelemetryBatch {
            reports: vec![r],
            ..Default::default()
        };
        assert_eq!(local.report(batch(report("a")), LONG).await.unwrap(), 1);
        assert_eq!(net.report(batch(report("a")), LONG).await.unwrap(), 1);
        let a = local.report(batch(report("")), LONG).await.unwrap_err();
        let b = net.report(batch(report("")), LONG).await.unwrap_err();
        assert!(matches!(a, Error::InvalidArgument(_)), "{a}");
        assert_eq!(a.to_string(), b.to_string());
        // Once the server stops, an in-process call fails at once, as a network one does.
        g.server.shutdown().await;
        assert!(in_process::find(&address, None).is_none());
        let start = Instant::now();
        let e = local.quorum(req(0, 4), LONG).await.unwrap_err();
        assert!(!e.is_timeout(), "{e}");
        assert!(start.elapsed() < Duration::from_secs(3));
        lh.shutdown().await;
    })
    .await;
}
