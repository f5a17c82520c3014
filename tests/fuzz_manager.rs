//! Property test of the manager server's request handlers over the wire: arbitrary requests
//! of every kind get an answer or a client-error status within their deadline, never an
//! internal error or a hang, and the server keeps serving ordinary rounds afterwards.
//!
//! Bounded in `make test` (32 cases); `make fuzz` sets `PROPTEST_CASES` much higher.

use std::time::Duration;

use proptest::prelude::*;
use torchft::error::Error;
use torchft::lighthouse::{LighthouseOptions, LighthouseServer};
use torchft::manager::{ManagerClient, ManagerOptions, ManagerServer};
use torchft::proto::{ManagerQuorumRequest, TelemetryBatch, TelemetryReport};
use torchft::security::Security;

const CALL: Duration = Duration::from_millis(400);

#[derive(Debug, Clone)]
enum Call {
    Quorum(ManagerQuorumRequest),
    ShouldCommit(i64, i64, bool),
    CheckpointMetadata(i64),
    Report(Vec<(String, i64, i64)>),
    WatchEvents(u64),
}

fn any_call() -> impl Strategy<Value = Call> {
    prop_oneof![
        (
            any::<i64>(),
            any::<i64>(),
            ".{0,24}",
            any::<bool>(),
            any::<bool>(),
            any::<i64>()
        )
            .prop_map(
                |(group_rank, step, checkpoint_metadata, shrink_only, init_sync, cf)| {
                    Call::Quorum(ManagerQuorumRequest {
                        group_rank: group_rank.rem_euclid(3) - 1,
                        step: step.rem_euclid(5) - 1,
                        checkpoint_metadata,
                        shrink_only,
                        init_sync,
                        commit_failures: cf,
                    })
                }
            ),
        (any::<i64>(), any::<i64>(), any::<bool>()).prop_map(|(r, s, c)| Call::ShouldCommit(
            r.rem_euclid(3) - 1,
            s,
            c
        )),
        any::<i64>().prop_map(Call::CheckpointMetadata),
        proptest::collection::vec((".{0,8}", any::<i64>(), any::<i64>()), 0..3)
            .prop_map(Call::Report),
        any::<u64>().prop_map(Call::WatchEvents),
    ]
}

async fn run(c: &ManagerClient, call: Call) -> Result<(), Error> {
    match call {
        Call::Quorum(r) => c.quorum(r, CALL).await.map(|_| ()),
        Call::ShouldCommit(r, s, v) => c.should_commit(r, s, v, CALL).await.map(|_| ()),
        Call::CheckpointMetadata(r) => c.checkpoint_metadata(r, CALL).await.map(|_| ()),
        Call::Report(reports) => {
            let batch = TelemetryBatch {
                reports: reports
                    .into_iter()
                    .map(|(replica_id, step, group_rank)| TelemetryReport {
                        replica_id,
                        step,
                        group_rank,
                        ..Default::default()
                    })
                    .collect(),
                dropped: 0,
                ..Default::default()
            };
            c.report(batch, CALL).await.map(|_| ())
        }
        Call::WatchEvents(after) => c.watch_events(after, CALL).await.map(|_| ()),
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32)
}

#[test]
fn manager_handlers_answer_any_request_cleanly() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (lh, server, client) = rt.block_on(async {
        let lh = LighthouseServer::bind(
            "127.0.0.1:0",
            LighthouseOptions {
                min_replicas: 1,
                join_timeout: Duration::from_millis(50),
                quorum_tick: Duration::from_millis(10),
                heartbeat_timeout: Duration::from_secs(5),
                progress_wait: Duration::ZERO,
                state_file: None,
                hang_timeout: None,
            },
        )
        .await
        .unwrap();
        let server = ManagerServer::start(ManagerOptions {
            replica_id: "fuzz".into(),
            lighthouse_addr: lh.address(),
            hostname: "127.0.0.1".into(),
            bind: "127.0.0.1:0".into(),
            store_addr: "fuzz-store:1".into(),
            world_size: 1,
            connect_timeout: Duration::from_secs(5),
            ..ManagerOptions::default()
        })
        .await
        .unwrap();
        let client = ManagerClient::connect_with(
            &server.address(),
            Duration::from_secs(5),
            &Security::none(),
        )
        .await
        .unwrap();
        (lh, server, client)
    });
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(cases()));
    runner
        .run(&proptest::collection::vec(any_call(), 1..4), |calls| {
            rt.block_on(async {
                for call in calls {
                    let started = std::time::Instant::now();
                    let outcome = tokio::time::timeout(CALL * 5, run(&client, call.clone()))
                        .await
                        .map_err(|_| TestCaseError::fail(format!("{call:?} hung")))?;
                    prop_assert!(started.elapsed() < CALL * 5);
                    if let Err(e) = outcome {
                        prop_assert!(
                            matches!(
                                e,
                                Error::InvalidArgument(_)
                                    | Error::FailedPrecondition(_)
                                    | Error::Timeout(_)
                            ),
                            "{call:?} -> {e}"
                        );
                    }
                }
                // The server still serves an ordinary round and commit vote.
                let step = 7;
                let r = client
                    .quorum(
                        ManagerQuorumRequest {
                            group_rank: 0,
                            step,
                            checkpoint_metadata: "ok".into(),
                            init_sync: false,
                            ..Default::default()
                        },
                        Duration::from_secs(5),
                    )
                    .await;
                prop_assert!(r.is_ok(), "{r:?}");
                Ok(())
            })
        })
        .unwrap();
    rt.block_on(async {
        server.shutdown().await;
        lh.shutdown().await;
    });
}
