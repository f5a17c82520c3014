//! The lighthouse's gRPC methods.
//!
//! Heartbeat, Report and Session go through the tonic server generated from the proto (less
//! Quorum, see `build.rs`). Quorum has its own route, the only one: it long-polls the round
//! and answers with the issued quorum's shared pre-framed bytes (see [`super::reply`]), so a
//! round of 10,000 groups encodes each form of the quorum once instead of once per member.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::http::{self, HeaderMap};
use axum::response::IntoResponse;
use prost::Message;
use tonic::{Request, Response, Status};

use super::state::{wait_for_quorum, SessionStream, Shared};
use crate::proto::served::lighthouse_service_server::{LighthouseService, LighthouseServiceServer};
use crate::proto::{
    LighthouseHeartbeatRequest, LighthouseHeartbeatResponse, LighthouseQuorumRequest,
    SessionRequest, TelemetryAck, TelemetryBatch,
};

/// Largest gRPC message accepted or sent (a quorum of 10,000+ groups is a few MB).
const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// The generated service for every lighthouse method but Quorum.
struct Grpc {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl LighthouseService for Grpc {
    async fn heartbeat(
        &self,
        request: Request<LighthouseHeartbeatRequest>,
    ) -> std::result::Result<Response<LighthouseHeartbeatResponse>, Status> {
        let timeout = self.shared.heartbeat(&request.into_inner().replica_id)?;
        Ok(Response::new(LighthouseHeartbeatResponse {
            heartbeat_timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        }))
    }

    async fn report(
        &self,
        request: Request<TelemetryBatch>,
    ) -> std::result::Result<Response<TelemetryAck>, Status> {
        let accepted = self.shared.report(request.get_ref())?;
        Ok(Response::new(TelemetryAck { accepted }))
    }

    type SessionStream = SessionStream;

    async fn session(
        &self,
        request: Request<SessionRequest>,
    ) -> std::result::Result<Response<SessionStream>, Status> {
        let stream = self.shared.open_session(&request.into_inner().replica_id)?;
        Ok(Response::new(stream))
    }
}

/// The gRPC routes of the lighthouse: the generated service, and the Quorum route.
pub(crate) fn router(shared: Arc<Shared>) -> axum::Router {
    let grpc = LighthouseServiceServer::new(Grpc {
        shared: shared.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tonic::service::Routes::new(grpc)
        .into_axum_router()
        .route_service(QUORUM_PATH, QuorumRoute { shared })
}

/// Path of the Quorum RPC.
const QUORUM_PATH: &str = "/torchft.LighthouseService/Quorum";

/// Largest Quorum request accepted (one member with its metadata).
const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

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
    shared: Arc<Shared>,
}

impl QuorumRoute {
    async fn serve(
        shared: Arc<Shared>,
        req: http::Request<axum::body::Body>,
    ) -> std::result::Result<http::Response<axum::body::Body>, Status> {
        let is_grpc = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/grpc"));
        if !is_grpc {
            return Ok((
                http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "expected application/grpc\n",
            )
                .into_response());
        }
        let timeout = req
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(crate::net::parse_grpc_timeout);
        let body = axum::body::to_bytes(req.into_body(), MAX_REQUEST_BYTES)
            .await
            .map_err(|e| Status::invalid_argument(format!("cannot read request: {e}")))?;
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
        let msg = LighthouseQuorumRequest::decode(&body[5..])
            .map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))?;
        let known = (msg.known_quorum_id, msg.known_revision);
        let issued = wait_for_quorum(&shared, msg.requester, timeout).await?;
        shared.count_reply(&issued, known);
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let body = SharedBody {
            data: Some(issued.framed(known)),
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

impl tower::Service<http::Request<axum::body::Body>> for QuorumRoute {
    type Response = http::Response<axum::body::Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = std::result::Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<axum::body::Body>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            Ok(Self::serve(shared, req)
                .await
                .unwrap_or_else(|status| status.into_http()))
        })
    }
}
