//! The lighthouse's gRPC methods.
//!
//! Heartbeat, Report, Session, Commit and CommitStream go through the tonic server generated
//! from the proto (less Quorum and QuorumStream, see `build.rs`). Quorum and QuorumStream have
//! routes of their own: they long-poll the round and answer with the issued quorum's shared
//! pre-framed bytes (see [`super::reply`]), so a round of 10,000 groups encodes each form of
//! the quorum once instead of once per member. QuorumStream carries the same requests as
//! Quorum on one stream a manager server keeps open, so a step's quorum is one message each
//! way instead of a new call.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{self, HeaderMap};
use axum::response::IntoResponse;
use futures::stream::{BoxStream, StreamExt};
use prost::Message;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use super::rooms::Rooms;
use super::state::{wait_for_quorum, SessionStream};
use crate::proto::served::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};
use crate::proto::{
    LighthouseCommitRequest, LighthouseCommitResponse, LighthouseHeartbeatRequest,
    LighthouseHeartbeatResponse, LighthouseQuorumRequest, SessionRequest, TelemetryAck,
    TelemetryBatch,
};
use crate::security::server::Caller;

/// Largest gRPC message sent (a quorum of 10,000+ groups is a few MB).
const MAX_RESPONSE_BYTES: usize = 256 * 1024 * 1024;

/// Who sent a request (the guard put it in the request's extensions).
fn caller(extensions: &http::Extensions) -> Caller {
    extensions
        .get::<Caller>()
        .cloned()
        .unwrap_or(Caller::Anyone)
}

/// The generated service for every lighthouse method but Quorum and QuorumStream; each
/// request goes to the room of the job it names.
struct Grpc {
    rooms: Arc<Rooms>,
    /// Turns true when the lighthouse stops: commit streams end then (as session streams
    /// do), so no open stream holds the graceful stop for its grace period.
    stop: watch::Receiver<bool>,
}

#[tonic::async_trait]
impl LighthouseService for Grpc {
    async fn heartbeat(
        &self,
        request: Request<LighthouseHeartbeatRequest>,
    ) -> std::result::Result<Response<LighthouseHeartbeatResponse>, Status> {
        let who = caller(request.extensions());
        let req = request.into_inner();
        let reply = self.rooms.room_for(&req.job, &who)?.heartbeat(
            &req.replica_id,
            req.step,
            req.quorum_id,
            req.loop_idle_ms.map(Duration::from_millis),
            req.digest,
        )?;
        Ok(Response::new(LighthouseHeartbeatResponse {
            heartbeat_timeout_ms: u64::try_from(reply.timeout.as_millis()).unwrap_or(u64::MAX),
            waiting: reply.waiting.map(|w| w.to_string()).unwrap_or_default(),
            hung: reply.hung.unwrap_or_default(),
            parity_step: reply.parity_step,
            diverged: reply.diverged.unwrap_or_default(),
            parity_ok_step: reply.parity_mark.ok,
            parity_diverged_step: reply.parity_mark.diverged,
        }))
    }

    async fn report(
        &self,
        request: Request<TelemetryBatch>,
    ) -> std::result::Result<Response<TelemetryAck>, Status> {
        let who = caller(request.extensions());
        let batch = request.get_ref();
        let room = self.rooms.room_for(&batch.job, &who)?;
        let accepted = room.report(batch)?;
        room.save_reports().await?;
        Ok(Response::new(TelemetryAck { accepted }))
    }

    async fn commit(
        &self,
        request: Request<LighthouseCommitRequest>,
    ) -> std::result::Result<Response<LighthouseCommitResponse>, Status> {
        let who = caller(request.extensions());
        let answer = commit_one(&self.rooms, &who, request.into_inner()).await?;
        Ok(Response::new(answer))
    }

    type CommitStreamStream =
        BoxStream<'static, std::result::Result<LighthouseCommitResponse, Status>>;

    async fn commit_stream(
        &self,
        request: Request<Streaming<LighthouseCommitRequest>>,
    ) -> std::result::Result<Response<Self::CommitStreamStream>, Status> {
        let who = caller(request.extensions());
        let rooms = self.rooms.clone();
        let mut stop = self.stop.clone();
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        // One answer per announcement, in order; an error answer ends the stream with its
        // status (tonic sends it as the trailers), as the same request sent to Commit would
        // have failed. The lighthouse's stop ends it (the client opens a new one at its next
        // commit).
        let answers = request.into_inner().take_until(stopped).then(move |req| {
            let rooms = rooms.clone();
            let who = who.clone();
            async move { commit_one(&rooms, &who, req?).await }
        });
        Ok(Response::new(answers.boxed()))
    }

    type SessionStream = SessionStream;

    async fn session(
        &self,
        request: Request<SessionRequest>,
    ) -> std::result::Result<Response<SessionStream>, Status> {
        let who = caller(request.extensions());
        let req = request.into_inner();
        let stream = self
            .rooms
            .room_for(&req.job, &who)?
            .open_session(&req.replica_id)?;
        Ok(Response::new(stream))
    }
}

/// One write-ahead commit announcement (from Commit or CommitStream), in the room its job
/// names.
async fn commit_one(
    rooms: &Rooms,
    who: &Caller,
    req: LighthouseCommitRequest,
) -> std::result::Result<LighthouseCommitResponse, Status> {
    let refused = rooms
        .room_for(&req.job, who)?
        .commit(&req.replica_id, req.quorum_id, req.step, req.quorum_wait_s)
        .await?;
    Ok(LighthouseCommitResponse {
        accepted: refused.is_none(),
        reason: refused.unwrap_or_default(),
    })
}

/// The gRPC routes of the lighthouse: the generated service, and the Quorum and QuorumStream
/// routes. Requests larger than `max_request_bytes` are refused.
pub(crate) fn router(
    rooms: Arc<Rooms>,
    max_request_bytes: usize,
    stop: watch::Receiver<bool>,
) -> axum::Router {
    let grpc = LighthouseServiceServer::new(Grpc {
        rooms: rooms.clone(),
        stop: stop.clone(),
    })
    .max_decoding_message_size(max_request_bytes)
    .max_encoding_message_size(MAX_RESPONSE_BYTES);
    tonic::service::Routes::new(grpc)
        .into_axum_router()
        .route_service(
            QUORUM_PATH,
            QuorumRoute {
                rooms: rooms.clone(),
                max_request_bytes,
            },
        )
        .route_service(
            QUORUM_STREAM_PATH,
            QuorumStreamRoute {
                rooms,
                max_request_bytes,
                stop,
            },
        )
}

/// Path of the Quorum RPC.
const QUORUM_PATH: &str = "/torchft.LighthouseService/Quorum";

/// A unary gRPC response body: one shared data frame, then `grpc-status: 0` trailers.
struct SharedBody {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for SharedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<http_body::Frame<Bytes>, Infallible>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(d))));
        }
        Poll::Ready(
            self.trailers
                .take()
                .map(|t| Ok(http_body::Frame::trailers(t))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

/// Serves the Quorum RPC with the quorum's shared pre-framed response (zero-copy per member),
/// keeping a round linear in the number of replica groups on the server side.
#[derive(Clone)]
struct QuorumRoute {
    rooms: Arc<Rooms>,
    max_request_bytes: usize,
}

impl QuorumRoute {
    async fn serve(
        rooms: Arc<Rooms>,
        max_request_bytes: usize,
        req: http::Request<axum::body::Body>,
    ) -> std::result::Result<http::Response<axum::body::Body>, Status> {
        if !is_grpc(&req) {
            return Ok(not_grpc());
        }
        let who = caller(req.extensions());
        let timeout = req
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(crate::net::parse_grpc_timeout);
        let body = axum::body::to_bytes(req.into_body(), max_request_bytes)
            .await
            .map_err(|e| {
                if crate::net::error_chain(&e).contains("length limit exceeded") {
                    Status::resource_exhausted(format!(
                        "request larger than the lighthouse's limit of {max_request_bytes} bytes \
                         (--max_request_bytes)"
                    ))
                } else {
                    Status::invalid_argument(format!("cannot read request: {e}"))
                }
            })?;
        let msg = decode_quorum_request(&body)?;
        let data = answer_quorum(&rooms, &who, msg, timeout).await?;
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let body = SharedBody {
            data: Some(data),
            trailers: Some(trailers),
        };
        let mut resp = http::Response::new(axum::body::Body::new(body));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        Ok(resp)
    }
}

/// Waits until the requester of `msg` is in an issued quorum (at most `timeout`), and
/// returns the answer's pre-framed gRPC message: the sparse form where asked for and
/// available, else the full or compact form for what the requester holds.
async fn answer_quorum(
    rooms: &Rooms,
    who: &Caller,
    msg: LighthouseQuorumRequest,
    timeout: Option<Duration>,
) -> std::result::Result<Bytes, Status> {
    let known = (msg.known_quorum_id, msg.known_revision);
    let shared = rooms.room_for(&msg.job, who)?;
    let sparse_for = msg
        .sparse
        .then(|| msg.requester.as_ref().map(|r| r.replica_id.clone()))
        .flatten();
    let issued = wait_for_quorum(&shared, msg.requester, msg.known_quorum_id, timeout).await?;
    Ok(
        match sparse_for.and_then(|id| issued.sparse_framed(&id, msg.init_sync)) {
            Some(sparse) => {
                shared.count_reply(true);
                sparse
            }
            None => {
                shared.count_reply(issued.abridged_for(known));
                issued.framed(known)
            }
        },
    )
}

/// Buffer a quorum stream keeps between requests (a request is a few hundred bytes).
const KEEP_BUFFER_BYTES: usize = 64 << 10;

/// Path of the QuorumStream RPC.
const QUORUM_STREAM_PATH: &str = "/torchft.LighthouseService/QuorumStream";

/// A streamed gRPC response body: the frames of a stream (data frames, then trailers).
struct FrameBody(BoxStream<'static, http_body::Frame<Bytes>>);

impl http_body::Body for FrameBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0.poll_next_unpin(cx).map(|f| f.map(Ok))
    }
}

/// Serves QuorumStream: the requests of one stream answered one at a time, in order, each
/// exactly as [`QuorumRoute`] answers the same request (the same shared pre-framed reply);
/// the first failure ends the stream with its status, as the call would have failed. The
/// stream ends when the client closes its side or the lighthouse stops. A request dropped
/// with its stream (the client gave up) leaves the round, as a dropped call does.
#[derive(Clone)]
struct QuorumStreamRoute {
    rooms: Arc<Rooms>,
    max_request_bytes: usize,
    stop: watch::Receiver<bool>,
}

/// What a QuorumStream's response is made of, one frame at a time.
struct QuorumStreamState {
    rooms: Arc<Rooms>,
    who: Caller,
    requests: axum::body::BodyDataStream,
    buf: Vec<u8>,
    max_request_bytes: usize,
    stop: watch::Receiver<bool>,
    ended: bool,
}

impl QuorumStreamState {
    /// The next request of the stream: None when the client closed its side or the
    /// lighthouse stops.
    async fn next_request(
        &mut self,
    ) -> std::result::Result<Option<crate::proto::QuorumStreamRequest>, Status> {
        loop {
            if self.buf.len() >= 5 {
                if self.buf[0] != 0 {
                    // Not UNIMPLEMENTED: on a stream, that tells a client the lighthouse has
                    // no quorum stream at all.
                    return Err(Status::invalid_argument(
                        "compressed requests are not supported",
                    ));
                }
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                // The same bound as a Quorum call's body: the frame, its 5-byte prefix counted.
                if len.saturating_add(5) > self.max_request_bytes {
                    return Err(Status::resource_exhausted(format!(
                        "request larger than the lighthouse's limit of {} bytes \
                         (--max_request_bytes)",
                        self.max_request_bytes
                    )));
                }
                if self.buf.len() >= 5 + len {
                    let msg = crate::proto::QuorumStreamRequest::decode(&self.buf[5..5 + len])
                        .map_err(|e| Status::invalid_argument(format!("malformed request: {e}")));
                    self.buf.drain(..5 + len);
                    if self.buf.is_empty() && self.buf.capacity() > KEEP_BUFFER_BYTES {
                        // A large request does not keep its memory for the stream's life.
                        self.buf = Vec::new();
                    }
                    return msg.map(Some);
                }
            }
            let mut stop = self.stop.clone();
            let piece = tokio::select! {
                piece = self.requests.next() => piece,
                _ = stop.wait_for(|s| *s) => return Ok(None),
            };
            match piece {
                Some(Ok(bytes)) => self.buf.extend_from_slice(&bytes),
                Some(Err(e)) => {
                    return Err(Status::invalid_argument(format!(
                        "cannot read request: {e}"
                    )))
                }
                None if self.buf.is_empty() => return Ok(None),
                None => return Err(Status::invalid_argument("truncated gRPC message")),
            }
        }
    }

    /// The next frame of the response: an answer, or the trailers that end the stream.
    async fn next_frame(&mut self) -> Option<http_body::Frame<Bytes>> {
        if self.ended {
            return None;
        }
        let answer = match self.next_request().await {
            Ok(Some(req)) => {
                let timeout = (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms));
                match req.request {
                    Some(msg) => answer_quorum(&self.rooms, &self.who, msg, timeout).await,
                    None => Err(Status::invalid_argument(
                        "a stream request without a request",
                    )),
                }
            }
            Ok(None) => Err(Status::ok("")),
            Err(status) => Err(status),
        };
        match answer {
            Ok(data) => Some(http_body::Frame::data(data)),
            Err(status) => {
                self.ended = true;
                let mut trailers = HeaderMap::new();
                if status.add_header(&mut trailers).is_err() {
                    trailers.insert("grpc-status", http::HeaderValue::from_static("13"));
                }
                Some(http_body::Frame::trailers(trailers))
            }
        }
    }
}

impl tower::Service<http::Request<axum::body::Body>> for QuorumStreamRoute {
    type Response = http::Response<axum::body::Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = std::result::Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<axum::body::Body>) -> Self::Future {
        let is_grpc = is_grpc(&req);
        let state = QuorumStreamState {
            rooms: self.rooms.clone(),
            who: caller(req.extensions()),
            requests: req.into_body().into_data_stream(),
            buf: Vec::new(),
            max_request_bytes: self.max_request_bytes,
            stop: self.stop.clone(),
            ended: false,
        };
        Box::pin(async move {
            if !is_grpc {
                return Ok(not_grpc());
            }
            let frames = futures::stream::unfold(state, |mut state| async move {
                state.next_frame().await.map(|frame| (frame, state))
            });
            let mut resp = http::Response::new(axum::body::Body::new(FrameBody(frames.boxed())));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            Ok(resp)
        })
    }
}

/// Whether `req` says it is a gRPC request.
fn is_grpc(req: &http::Request<axum::body::Body>) -> bool {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// The answer to a request on a gRPC route that is not gRPC.
fn not_grpc() -> http::Response<axum::body::Body> {
    (
        http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "expected application/grpc\n",
    )
        .into_response()
}

/// Decodes one uncompressed gRPC frame holding a `LighthouseQuorumRequest`; anything else is
/// an `InvalidArgument` (or `Unimplemented` for compression) naming what is wrong.
pub(crate) fn decode_quorum_request(
    body: &[u8],
) -> std::result::Result<LighthouseQuorumRequest, Status> {
    if body.len() < 5 {
        return Err(Status::invalid_argument("truncated gRPC message"));
    }
    if body[0] != 0 {
        return Err(Status::unimplemented(
            "compressed requests are not supported",
        ));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if body.len() != 5 + len {
        return Err(Status::invalid_argument(
            "gRPC message length does not match body",
        ));
    }
    LighthouseQuorumRequest::decode(&body[5..])
        .map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))
}

impl tower::Service<http::Request<axum::body::Body>> for QuorumRoute {
    type Response = http::Response<axum::body::Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = std::result::Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<axum::body::Body>) -> Self::Future {
        let rooms = self.rooms.clone();
        let limit = self.max_request_bytes;
        Box::pin(async move {
            Ok(Self::serve(rooms, limit, req)
                .await
                .unwrap_or_else(|status| status.into_http()))
        })
    }
}

/// Property tests of the request handlers: any bytes, any member, any batch. Bounded here
/// (proptest's default case count); `make fuzz` runs them for much longer.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;
    use crate::error::Error;
    use crate::lighthouse::quorum::validate_member;
    use crate::lighthouse::state::Shared;
    use crate::lighthouse::LighthouseOptions;
    use crate::proto::{QuorumMember, TelemetryReport};

    fn frame(msg: &LighthouseQuorumRequest) -> Vec<u8> {
        let body = msg.encode_to_vec();
        let mut out = vec![0u8];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
        out
    }

    fn any_member() -> impl Strategy<Value = QuorumMember> {
        (
            prop_oneof!["", "[a-z]{1,8}", "\\PC{0,12}", " +"],
            ".{0,16}",
            ".{0,16}",
            any::<i64>(),
            any::<u64>(),
            any::<bool>(),
            any::<i64>(),
            ".{0,32}",
        )
            .prop_map(
                |(replica_id, address, store_address, step, world_size, shrink_only, cf, data)| {
                    QuorumMember {
                        replica_id,
                        address,
                        store_address,
                        step,
                        world_size,
                        shrink_only,
                        commit_failures: cf,
                        data,
                    }
                },
            )
    }

    proptest! {
        /// Arbitrary bytes never panic the Quorum route's decoder; they are refused with a
        /// client-error status.
        #[test]
        fn quorum_route_decodes_any_bytes(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Err(status) = decode_quorum_request(&body) {
                prop_assert!(matches!(
                    status.code(),
                    tonic::Code::InvalidArgument | tonic::Code::Unimplemented
                ), "{status:?}");
            }
        }

        /// A valid request survives a round trip through framing; any corruption of its
        /// length prefix is refused.
        #[test]
        fn quorum_route_frames(member in any_member(), id in any::<i64>(), rev in any::<u64>(),
                               bad_len in any::<u32>(), sparse in any::<bool>(),
                               init_sync in any::<bool>()) {
            let msg = LighthouseQuorumRequest {
                requester: Some(member),
                known_quorum_id: id,
                known_revision: rev,
                sparse,
                init_sync,
                job: String::new(),
            };
            let framed = frame(&msg);
            prop_assert_eq!(decode_quorum_request(&framed).unwrap(), msg);
            let mut wrong = framed.clone();
            if bad_len as usize != framed.len() - 5 {
                wrong[1..5].copy_from_slice(&bad_len.to_be_bytes());
                prop_assert!(decode_quorum_request(&wrong).is_err());
            }
        }

        /// Any member asking for a quorum: invalid ones are refused with InvalidArgument and
        /// leave no trace; valid ones join the round. Heartbeats and telemetry batches with
        /// arbitrary contents never panic, and refusals change nothing.
        #[test]
        fn handlers_accept_or_refuse_cleanly(
            members in proptest::collection::vec(any_member(), 1..6),
            beat in "\\PC{0,12}",
            reports in proptest::collection::vec(
                (".{0,12}", any::<i64>(), any::<i64>(), any::<f64>()), 0..4),
        ) {
            let shared = Shared::new(LighthouseOptions { min_replicas: 50, ..Default::default() }, 1);
            let mut joined = std::collections::BTreeSet::new();
            for m in members {
                let valid = validate_member(&m).is_ok();
                let id = m.replica_id.clone();
                match shared.join(m, 0) {
                    Ok(_) => {
                        prop_assert!(valid);
                        joined.insert(id);
                    }
                    Err(Error::InvalidArgument(_)) => prop_assert!(!valid),
                    Err(e) => prop_assert!(false, "unexpected error {e}"),
                }
            }
            let waiting: std::collections::BTreeSet<String> =
                shared.snapshot().participants.into_iter().collect();
            prop_assert_eq!(waiting, joined);
            let before = shared.snapshot().heartbeats.len();
            match shared.heartbeat(&beat, None, None, None, None) {
                Ok(_) => prop_assert!(!beat.trim().is_empty()),
                Err(_) => prop_assert_eq!(shared.snapshot().heartbeats.len(), before),
            }
            let batch = TelemetryBatch {
                reports: reports
                    .into_iter()
                    .map(|(replica_id, step, group_rank, wait)| TelemetryReport {
                        replica_id,
                        step,
                        group_rank,
                        quorum_wait_s: wait,
                        ..Default::default()
                    })
                    .collect(),
                dropped: 0,
                job: String::new(),
            };
            let _ = shared.report(&batch);
        }
    }
}
