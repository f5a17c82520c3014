//! The client's quorum requests on one long-lived stream: against scripted lighthouses that
//! count what arrives (streams and calls, not only answers), and against ours (its stop, its
//! successor on the same address, malformed and oversized stream requests).

mod common;
use common::{bounded, not_here, serve_fake, Answers, FakeLighthouse};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use torchft::client::LighthouseClient;
use torchft::lighthouse::{
    AccessOptions, LighthouseOptions, LighthouseServer, ObservabilityOptions,
};
use torchft::proto::{
    LighthouseQuorumRequest, LighthouseQuorumResponse, Quorum, QuorumMember, QuorumStreamRequest,
};

const ASK: Duration = Duration::from_secs(5);
/// A requester the scripted lighthouse fails with INVALID_ARGUMENT.
const BAD: &str = "bad";
/// A requester the scripted lighthouse never answers.
const SILENT: &str = "silent";

/// Counts of what reached a scripted lighthouse.
#[derive(Default)]
struct Seen {
    streams: AtomicUsize,
    on_streams: AtomicUsize,
    calls: AtomicUsize,
}

/// A lighthouse that answers each quorum request at once with a quorum of the requester
/// alone (failing [`BAD`], never answering [`SILENT`]) and counts them; `streams: false`
/// answers the stream UNIMPLEMENTED, as upstream's lighthouse and older ones of ours do.
#[derive(Clone)]
struct Counting {
    seen: Arc<Seen>,
    streams: bool,
}

async fn answer(req: LighthouseQuorumRequest) -> Result<LighthouseQuorumResponse, Status> {
    let member = req
        .requester
        .ok_or_else(|| Status::invalid_argument("no requester"))?;
    match member.replica_id.as_str() {
        BAD => return Err(Status::invalid_argument("scripted refusal")),
        SILENT => futures::future::pending::<()>().await,
        _ => {}
    }
    Ok(LighthouseQuorumResponse {
        quorum: Some(Quorum {
            quorum_id: 7,
            participants: vec![member],
            ..Default::default()
        }),
    })
}

#[tonic::async_trait]
impl FakeLighthouse for Counting {
    async fn quorum(
        &self,
        request: Request<LighthouseQuorumRequest>,
    ) -> Result<Response<LighthouseQuorumResponse>, Status> {
        self.seen.calls.fetch_add(1, Ordering::SeqCst);
        answer(request.into_inner()).await.map(Response::new)
    }

    async fn quorum_stream(
        &self,
        request: Request<Streaming<QuorumStreamRequest>>,
    ) -> Result<Response<Answers<LighthouseQuorumResponse>>, Status> {
        if !self.streams {
            return not_here("quorum stream");
        }
        self.seen.streams.fetch_add(1, Ordering::SeqCst);
        let seen = self.seen.clone();
        let answers = request.into_inner().then(move |req| {
            let seen = seen.clone();
            async move {
                let req = req?;
                seen.on_streams.fetch_add(1, Ordering::SeqCst);
                assert!(req.timeout_ms > 0, "a stream request without its deadline");
                answer(req.request.unwrap_or_default()).await
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

fn member(id: &str) -> QuorumMember {
    QuorumMember {
        replica_id: id.to_string(),
        address: format!("http://{id}.example:1"),
        store_address: format!("{id}.example:2"),
        step: 3,
        world_size: 1,
        ..Default::default()
    }
}

fn ids(q: &Quorum) -> Vec<String> {
    q.participants
        .iter()
        .map(|m| m.replica_id.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorums_share_one_stream_and_a_failed_or_silent_one_is_replaced() {
    bounded(async {
        let seen = Arc::new(Seen::default());
        let (addr, _stop, _serve) = serve_fake(Counting {
            seen: seen.clone(),
            streams: true,
        })
        .await;
        let c = LighthouseClient::connect(&addr, ASK).await.unwrap();
        // One stream carries every request, one at a time; clones share it.
        for _ in 0..3 {
            assert_eq!(ids(&c.quorum(member("a"), ASK).await.unwrap()), ["a"]);
        }
        assert_eq!(
            ids(&c.clone().quorum(member("b"), ASK).await.unwrap()),
            ["b"]
        );
        assert_eq!(counts(&seen), (1, 4, 0));

        // An error answer ends the stream with the status a call would have had ...
        let bad = c.quorum_status(member(BAD), ASK).await.unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
        assert!(bad.message().contains("scripted refusal"), "{bad}");
        // ... and the next request opens a new one.
        c.quorum(member("a"), ASK).await.unwrap();
        assert_eq!(counts(&seen), (2, 6, 0));

        // A request not answered within its timeout: a deadline error in about the timeout,
        // and the stream is dropped (a late answer could not be matched to its request).
        let short = Duration::from_millis(300);
        let started = Instant::now();
        let late = c.quorum_status(member(SILENT), short).await.unwrap_err();
        assert_eq!(late.code(), tonic::Code::DeadlineExceeded, "{late}");
        assert!(started.elapsed() < ASK, "{:?}", started.elapsed());
        c.quorum(member("a"), ASK).await.unwrap();
        assert_eq!(counts(&seen), (3, 8, 0));

        // A request of a clone while another holds the stream goes as a call (a long poll
        // never waits behind another, and no stream is opened for one request only) ...
        let (c1, c2) = (c.clone(), c.clone());
        let silent = tokio::spawn(async move { c1.quorum(member(SILENT), short).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(ids(&c2.quorum(member("b"), ASK).await.unwrap()), ["b"]);
        assert!(silent.await.unwrap().unwrap_err().is_timeout());
        assert_eq!(counts(&seen), (3, 9, 1));
        // ... and once the holder gave up (its stream dropped), the next request opens a
        // stream, which the one after it uses.
        c.quorum(member("a"), ASK).await.unwrap();
        c.quorum(member("b"), ASK).await.unwrap();
        assert_eq!(counts(&seen), (4, 11, 1));
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
        assert_eq!(ids(&c.quorum(member("a"), ASK).await.unwrap()), ["a"]);
        let bad = c.quorum_status(member(BAD), ASK).await.unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
        let late = c
            .quorum_status(member(SILENT), Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(late.code(), tonic::Code::DeadlineExceeded, "{late}");
        assert_eq!(ids(&c.quorum(member("b"), ASK).await.unwrap()), ["b"]);
        // Every request went as a call; the stream was asked for once.
        assert_eq!(counts(&seen), (0, 0, 4));
    })
    .await;
}

fn opts() -> LighthouseOptions {
    LighthouseOptions {
        min_replicas: 1,
        join_timeout: Duration::ZERO,
        heartbeat_timeout: Duration::from_millis(500),
        progress_wait: Duration::ZERO,
        ..LighthouseOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lighthouse_stop_ends_the_stream_and_its_successor_answers_the_next_request() {
    bounded(async {
        let server = LighthouseServer::bind("127.0.0.1:0", opts()).await.unwrap();
        let addr = server.address();
        let c = LighthouseClient::connect(&addr, ASK).await.unwrap();
        let first = c.quorum(member("a"), ASK).await.unwrap();
        assert_eq!(ids(&first), ["a"]);
        // The idle stream does not hold the graceful stop for its grace period.
        let started = Instant::now();
        server.shutdown().await;
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the stop waited {:?} for the open quorum stream",
            started.elapsed()
        );
        // A successor on the same address: the kept stream died with the old lighthouse, and
        // the request is answered on a new one (no failed attempt for the caller to retry).
        let bind = addr.trim_start_matches("http://").to_string();
        let again = LighthouseServer::bind(&bind, opts()).await.unwrap();
        let second = c.quorum(member("a"), ASK).await.unwrap();
        assert_eq!(ids(&second), ["a"]);
        again.shutdown().await;
    })
    .await;
}

/// Our lighthouse on 127.0.0.1:0 waiting for two groups (a lone request stays unanswered).
async fn lighthouse_of_two() -> LighthouseServer {
    LighthouseServer::bind(
        "127.0.0.1:0",
        LighthouseOptions {
            min_replicas: 2,
            ..opts()
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_on_a_kept_stream_ends_at_the_lighthouse_stop_with_its_status() {
    bounded(async {
        let server = lighthouse_of_two().await;
        let c = LighthouseClient::connect(&server.address(), ASK)
            .await
            .unwrap();
        let (a, b) = tokio::join!(c.quorum(member("a"), ASK), c.quorum(member("b"), ASK));
        a.unwrap();
        b.unwrap();
        // a asks again on a kept stream and waits for b, which does not come.
        let waiting = {
            let c = c.clone();
            tokio::spawn(async move { c.quorum_status(member("a"), ASK).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = Instant::now();
        server.shutdown().await;
        let err = waiting.await.unwrap().unwrap_err();
        // The lighthouse's own answer (its stop), as a call gets it: not retried here.
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_oversized_stream_requests_are_refused_with_their_reason() {
    bounded(async {
        let server = LighthouseServer::bind_secured(
            "127.0.0.1:0",
            opts(),
            ObservabilityOptions::default(),
            AccessOptions {
                max_request_bytes: 4096,
                ..AccessOptions::default()
            },
        )
        .await
        .unwrap();
        let mut raw = torchft::proto::lighthouse_service_client::LighthouseServiceClient::connect(
            server.address(),
        )
        .await
        .unwrap();
        let good = QuorumStreamRequest {
            request: Some(LighthouseQuorumRequest {
                requester: Some(member("a")),
                ..Default::default()
            }),
            timeout_ms: 5_000,
        };
        let huge = QuorumStreamRequest {
            request: Some(LighthouseQuorumRequest {
                requester: Some(member(&"x".repeat(8192))),
                ..Default::default()
            }),
            timeout_ms: 5_000,
        };
        let cases = [
            (
                QuorumStreamRequest {
                    request: None,
                    timeout_ms: 5_000,
                },
                tonic::Code::InvalidArgument,
                "without a request",
            ),
            (
                QuorumStreamRequest {
                    request: Some(LighthouseQuorumRequest::default()),
                    timeout_ms: 5_000,
                },
                tonic::Code::InvalidArgument,
                "requester",
            ),
            (huge, tonic::Code::ResourceExhausted, "max_request_bytes"),
        ];
        for (bad, code, why) in cases {
            // A good request, the bad one, then one that is never answered: the stream ends
            // at the bad one with its status and reason.
            let sent = vec![good.clone(), bad, good.clone()];
            let mut answers = raw
                .quorum_stream(tokio_stream::iter(sent))
                .await
                .unwrap()
                .into_inner();
            let q = answers.message().await.unwrap().unwrap().quorum.unwrap();
            assert_eq!(ids(&q), ["a"], "{why}");
            let err = answers.message().await.unwrap_err();
            assert_eq!(err.code(), code, "{why}: {err}");
            assert!(err.message().contains(why), "{why}: {}", err.message());
            assert!(matches!(answers.message().await, Ok(None)), "{why}");
        }
        // A request's own deadline bounds its wait, as a call's grpc-timeout does.
        let two = lighthouse_of_two().await;
        let mut raw2 = torchft::proto::lighthouse_service_client::LighthouseServiceClient::connect(
            two.address(),
        )
        .await
        .unwrap();
        let started = Instant::now();
        let mut answers = raw2
            .quorum_stream(tokio_stream::iter(vec![QuorumStreamRequest {
                timeout_ms: 300,
                ..good.clone()
            }]))
            .await
            .unwrap()
            .into_inner();
        let err = answers.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
        assert!(started.elapsed() < ASK, "{:?}", started.elapsed());
        two.shutdown().await;
        server.shutdown().await;
    })
    .await;
}
