//! The floor of the load generator: a trivial server in its process that answers every
//! quorum request with the bytes the lighthouse would send, once every group of the round
//! has asked, with no quorum engine behind it.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use anyhow::Result;
use axum::body::Bytes;
use prost::Message;
use torchft::client::compact;
use torchft::manager::sparse::SparsePlans;
use torchft::proto::{LighthouseQuorumRequest, Quorum, QuorumMember};

use super::Group;

/// What the trivial server answers in the current round: the quorum in its three forms,
/// once every group of the round has asked (as the lighthouse does: a group's client state
/// when it asks, hence the form it gets, is the same as against the lighthouse).
struct Forms {
    quorum: Quorum,
    /// Requests of this round still to come; answers wait until none is.
    missing: AtomicU64,
    all_asked: tokio::sync::watch::Sender<bool>,
    full: Bytes,
    compact: Bytes,
    /// The delta against the previous quorum, when the membership changed.
    delta: Option<((i64, u64), Bytes)>,
    /// The plans of the sparse form, built on the first sparse request.
    plans: SparsePlans,
}

fn frame(quorum: &Quorum) -> Bytes {
    let msg = torchft::proto::LighthouseQuorumResponse {
        quorum: Some(quorum.clone()),
    };
    let mut buf = vec![0u8];
    buf.extend_from_slice(&(msg.encoded_len() as u32).to_be_bytes());
    msg.encode(&mut buf).expect("a Vec grows");
    Bytes::from(buf)
}

impl Forms {
    fn new(quorum: Quorum, previous: Option<&Quorum>) -> Self {
        let missing = AtomicU64::new(quorum.participants.len() as u64);
        let delta = previous
            .filter(|p| p.quorum_id != quorum.quorum_id)
            .map(|p| {
                (
                    (p.quorum_id, p.revision),
                    frame(&compact::delta_form(p, &quorum)),
                )
            });
        Self {
            full: frame(&quorum),
            compact: frame(&compact::compact_form(&quorum)),
            delta,
            plans: SparsePlans::default(),
            quorum,
            missing,
            all_asked: tokio::sync::watch::channel(false).0,
        }
    }

    /// Counts one request and waits until the whole round has asked.
    async fn barrier(&self) {
        let mut asked = self.all_asked.subscribe();
        if self.missing.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.all_asked.send_replace(true);
        }
        let _ = asked.wait_for(|a| *a).await;
    }

    /// The lighthouse's choice for a requester holding `known` (`sparse`: its replica id and
    /// init_sync, when it asked for the sparse form).
    fn reply(&self, known: (i64, u64), sparse: Option<(&str, bool)>) -> Bytes {
        if let Some(form) = sparse.and_then(|(id, s)| self.plans.form(&self.quorum, id, s)) {
            return frame(&form);
        }
        match &self.delta {
            Some((base, bytes)) if *base == known => bytes.clone(),
            _ if known.1 != 0 && known.0 == self.quorum.quorum_id => self.compact.clone(),
            _ => self.full.clone(),
        }
    }
}

/// A unary gRPC body: one data frame, then `grpc-status: 0`.
struct Unary(Option<Bytes>, bool);

impl http_body::Body for Unary {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<http_body::Frame<Bytes>, Self::Error>>> {
        if let Some(d) = self.0.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(d))));
        }
        if std::mem::take(&mut self.1) {
            let mut t = axum::http::HeaderMap::new();
            t.insert("grpc-status", axum::http::HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(http_body::Frame::trailers(t))));
        }
        Poll::Ready(None)
    }
}

/// The trivial server: its address, and the forms it answers with (set per round).
pub(super) struct Floor {
    pub(super) addr: String,
    forms: Arc<Mutex<Arc<Forms>>>,
    _runtime: tokio::runtime::Runtime,
}

impl Floor {
    pub(super) fn start() -> Result<Self> {
        // Its own threads, as the daemon has its own process: as many as the daemon's
        // default (one per core).
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(torchft::runtime::available_cores())
            .enable_all()
            .build()?;
        let forms = Arc::new(Mutex::new(Arc::new(Forms::new(Quorum::default(), None))));
        let state = forms.clone();
        let handler = move |body: Bytes| {
            let forms = state.lock().expect("not poisoned").clone();
            async move {
                let req = LighthouseQuorumRequest::decode(body.get(5..).unwrap_or_default())
                    .unwrap_or_default();
                forms.barrier().await;
                let sparse_for = req
                    .requester
                    .as_ref()
                    .filter(|_| req.sparse)
                    .map(|r| (r.replica_id.as_str(), req.init_sync));
                let bytes = forms.reply((req.known_quorum_id, req.known_revision), sparse_for);
                let mut resp =
                    axum::http::Response::new(axum::body::Body::new(Unary(Some(bytes), true)));
                resp.headers_mut().insert(
                    axum::http::header::CONTENT_TYPE,
                    axum::http::HeaderValue::from_static("application/grpc"),
                );
                resp
            }
        };
        let app = axum::Router::new().route(
            "/torchft.LighthouseService/Quorum",
            axum::routing::post(handler),
        );
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = format!("http://{}", listener.local_addr()?);
        runtime.spawn(async move {
            use axum::serve::ListenerExt;
            // As the lighthouse's sockets: no Nagle delay on the small replies.
            let listener = listener.tap_io(|s| {
                let _ = s.set_nodelay(true);
            });
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr,
            forms,
            _runtime: runtime,
        })
    }

    /// Sets what the next round answers: `groups` as the lighthouse would issue them.
    pub(super) fn set(&self, groups: &[Group], quorum_id: i64, revision: u64) {
        let mut participants: Vec<QuorumMember> = groups.iter().map(|g| g.member.clone()).collect();
        participants.sort_unstable_by(|a, b| a.replica_id.cmp(&b.replica_id));
        let quorum = Quorum {
            quorum_id,
            participants,
            created: None,
            revision,
            compact: None,
            sparse: None,
        };
        let mut forms = self.forms.lock().expect("not poisoned");
        let previous = &forms.quorum;
        let next = Forms::new(quorum, (previous.revision != 0).then_some(previous));
        *forms = Arc::new(next);
    }
}
