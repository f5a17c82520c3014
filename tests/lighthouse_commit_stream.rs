//! The client's write-ahead commits on one long-lived stream: against scripted lighthouses
//! that count what arrives, so the tests see streams and calls, not only answers.

mod common;
use common::{bounded, not_here, serve_fake, Answers, FakeLighthouse};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use torchft::client::LighthouseClient;
use torchft::lighthouse::{LighthouseOptions, LighthouseServer};
use torchft::proto::{LighthouseCommitRequest, LighthouseCommitResponse};

const ASK: Duration = Duration::from_secs(5);
/// A step the scripted lighthouse refuses.
const REFUSED_STEP: i64 = 13;
/// A step the scripted lighthouse never answers on a stream.
const UNANSWERED_STEP: i64 = 99;

/// Counts of what reached a scripted lighthouse.
#[derive(Default)]
struct Seen {
    streams: AtomicUsize,
    on_streams: AtomicUsize,
    calls: AtomicUsize,
}

/// A lighthouse that answers commits (refusing [`REFUSED_STEP`], failing a negative step
/// with INVALID_ARGUMENT as ours does) and counts them; `streams: false` answers the stream
/// UNIMPLEMENTED, as a lighthouse from before it does.
#[derive(Clone)]
struct Counting {
    seen: Arc<Seen>,
    streams: bool,
}

fn answer(req: &LighthouseCommitRequest) -> Result<LighthouseCommitResponse, Status> {
    if req.step < 0 {
        return Err(Status::invalid_argument("step must not be negative"));
    }
    let refused = req.step == REFUSED_STEP;
    Ok(LighthouseCommitResponse {
        accepted: !refused,
        reason: if refused {
            "scripted refusal".into()
        } else {
            String::new()
        },
    })
}

#[tonic::async_trait]
impl FakeLighthouse for Counting {
    async fn commit(
        &self,
        request: Request<LighthouseCommitRequest>,
    ) -> Result<Response<LighthouseCommitResponse>, Status> {
        self.seen.calls.fetch_add(1, Ordering::SeqCst);
        answer(request.get_ref()).map(Response::new)
    }

    async fn commit_stream(
        &self,
        request: Request<Streaming<LighthouseCommitRequest>>,
    ) -> Result<Response<Answers<LighthouseCommitResponse>>, Status> {
        if !self.streams {
            return not_here("commit stream");
        }
        self.seen.streams.fetch_add(1, Ordering::SeqCst);
        let seen = self.seen.clone();
        let answers = request.into_inner().then(move |req| {
            let seen = seen.clone();
            async move {
                let req = req?;
                seen.on_streams.fetch_add(1, Ordering::SeqCst);
                if req.step == UNANSWERED_STEP {
                    futures::future::pending::<()>().await;
                }
                answer(&req)
            }
        });
        Ok(Response::new(answers.boxed()))
    }
}

fn counts(seen: &Seen) -> (usize, usize, usize) {
    (
        seen.streams.load(Ordering::SeqCst),
        seen.on_streams.load(Ordering::SeqCst),
        seen.calls.load(Ordering::SeqCst),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_share_one_stream_and_a_failed_or_silent_one_is_replaced() {
    bounded(async {
        let seen = Arc::new(Seen::default());
        let (addr, _stop, _serve) = serve_fake(Counting {
            seen: seen.clone(),
            streams: true,
        })
        .await;
        let c = LighthouseClient::connect(&addr, ASK).await.unwrap();
        // Accepted and refused answers come back in order on one stream; clones share it.
        for step in 10..13 {
            assert_eq!(c.commit("a", 1, step, 0.0, ASK).await.unwrap(), None);
        }
        let why = c.clone().commit("a", 1, REFUSED_STEP, 0.0, ASK).await;
        assert_eq!(why.unwrap().as_deref(), Some("scripted refusal"));
        assert_eq!(counts(&seen), (1, 4, 0));

        // An error answer ends the stream with the same status a call would have had ...
        let bad = c.commit("a", 1, -1, 0.0, ASK).await.unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
        // ... and the next commit opens a new one.
        assert_eq!(c.commit("a", 1, 14, 0.0, ASK).await.unwrap(), None);
        assert_eq!(counts(&seen), (2, 6, 0));

        // A stream that does not answer within the timeout: a deadline error in about the
        // timeout, and the stream is dropped (a late answer could not be matched), so the
        // next commit is answered on a new one.
        let short = Duration::from_millis(300);
        let started = Instant::now();
        let late = c.commit("a", 1, UNANSWERED_STEP, 0.0, short).await;
        assert_eq!(late.unwrap_err().code(), tonic::Code::DeadlineExceeded);
        assert!(started.elapsed() < ASK, "{:?}", started.elapsed());
        assert_eq!(c.commit("a", 1, 15, 0.0, ASK).await.unwrap(), None);
        assert_eq!(counts(&seen), (3, 8, 0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lighthouse_without_the_stream_gets_single_calls_and_is_not_asked_again() {
    bounded(async {
        let seen = Arc::new(Seen::default());
        let (addr, _stop, _serve) = serve_fake(Counting {
            seen: seen.clone(),
            streams: false,
        })
        .await;
        let c = LighthouseClient::connect(&addr, ASK).await.unwrap();
        assert_eq!(c.commit("a", 1, 10, 0.0, ASK).await.unwrap(), None);
        let why = c.commit("a", 1, REFUSED_STEP, 0.0, ASK).await.unwrap();
        assert_eq!(why.as_deref(), Some("scripted refusal"));
        let bad = c.commit("a", 1, -1, 0.0, ASK).await.unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
        assert_eq!(c.commit("a", 1, 11, 0.0, ASK).await.unwrap(), None);
        // Every commit went as a call; the stream was never served.
        assert_eq!(counts(&seen), (0, 0, 4));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lighthouse_stop_ends_the_stream_at_once_and_its_successor_gets_a_new_one() {
    bounded(async {
        let opts = LighthouseOptions {
            min_replicas: 1,
            heartbeat_timeout: Duration::from_millis(500),
            progress_wait: Duration::ZERO,
            ..LighthouseOptions::default()
        };
        let server = LighthouseServer::bind("127.0.0.1:0", opts.clone())
            .await
            .unwrap();
        let addr = server.address();
        let c = LighthouseClient::connect(&addr, ASK).await.unwrap();
        // A lighthouse that has issued no quorum accepts (it cannot know better).
        assert_eq!(c.commit("a", 1, 10, 0.0, ASK).await.unwrap(), None);
        // The stream is open; the graceful stop still ends at once, not after its grace
        // period for open connections.
        let started = Instant::now();
        server.shutdown().await;
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the stop waited {:?} for the open commit stream",
            started.elapsed()
        );
        let gone = c.commit("a", 1, 11, 0.0, Duration::from_secs(2)).await;
        assert!(gone.is_err(), "{gone:?}");
        // A successor on the same address: the next commit opens a stream there.
        let bind = addr.trim_start_matches("http://").to_string();
        let again = LighthouseServer::bind(&bind, opts).await.unwrap();
        assert_eq!(c.commit("a", 1, 11, 0.0, ASK).await.unwrap(), None);
        again.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_stream_is_refused_with_its_reason_and_ends_the_stream() {
    bounded(async {
        let opts = LighthouseOptions {
            min_replicas: 1,
            progress_wait: Duration::ZERO,
            ..LighthouseOptions::default()
        };
        let server = LighthouseServer::bind("127.0.0.1:0", opts).await.unwrap();
        let mut raw = torchft::proto::lighthouse_service_client::LighthouseServiceClient::connect(
            server.address(),
        )
        .await
        .unwrap();
        let good = LighthouseCommitRequest {
            replica_id: "a".into(),
            quorum_id: 1,
            step: 10,
            ..Default::default()
        };
        let cases = [
            (
                LighthouseCommitRequest {
                    step: -1,
                    ..good.clone()
                },
                "step must not be negative",
            ),
            (
                LighthouseCommitRequest {
                    quorum_wait_s: f64::NAN,
                    ..good.clone()
                },
                "quorum_wait_s",
            ),
            (
                LighthouseCommitRequest {
                    replica_id: String::new(),
                    ..good.clone()
                },
                "replica",
            ),
        ];
        for (bad, why) in cases {
            // A good announcement, the bad one, then one that is never answered: the stream
            // ends at the bad one with INVALID_ARGUMENT and its reason.
            let sent = vec![good.clone(), bad, good.clone()];
            let mut answers = raw
                .commit_stream(tokio_stream::iter(sent))
                .await
                .unwrap()
                .into_inner();
            assert!(answers.message().await.unwrap().unwrap().accepted, "{why}");
            let err = answers.message().await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{why}: {err}");
            assert!(err.message().contains(why), "{why}: {}", err.message());
            assert!(matches!(answers.message().await, Ok(None)), "{why}");
        }
        server.shutdown().await;
    })
    .await;
}
