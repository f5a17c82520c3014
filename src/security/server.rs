//! Servers' side: one function that serves an axum router (gRPC and HTTP routes alike) over
//! plain TCP or TLS, and the guard every request passes first (token, TLS-only).
//!
//! A TLS server still accepts plain connections, only to answer each request on them with a
//! clear "this server accepts TLS only" (a gRPC status or an HTTP 400), so a client
//! configured without TLS fails at once with a message instead of a broken stream.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use super::{Security, Token};
use crate::error::{Error, Result};

/// Bound on a client's TLS handshake (and on its first byte arriving).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections handed from the accept task to the server, waiting to be served.
const ACCEPT_QUEUE: usize = 256;

/// The first byte of a TLS record carrying a handshake (a ClientHello).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Which requests may pass without the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenRoutes {
    /// Every request needs the token (manager servers; `--private_status`).
    None,
    /// `GET`/`HEAD` of the lighthouse's read-only pages stay open.
    ReadOnlyStatus,
}

/// Read-only lighthouse pages: open unless the lighthouse is private.
const READ_ONLY_PATHS: &[&str] = &[
    "/",
    "/dashboard.js",
    "/status",
    "/metrics",
    "/healthz",
    "/readyz",
    "/events",
];

/// Who a request comes from, as the guard found it (in the request's extensions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No token is required here (none configured, or an open read-only page).
    Anyone,
    /// The server's own token: may act on everything.
    Admin,
    /// A job's own token (see [`super::RoomTokens`]): may act on that job's room only.
    Room(String),
}

impl Caller {
    /// Whether this caller may act on (or read the private pages of) `job`'s room.
    pub fn may_act_on(&self, job: &str) -> crate::error::Result<()> {
        match self {
            Caller::Room(own) if own != job => Err(crate::error::Error::Unauthenticated(format!(
                "the token presented is job {own:?}'s: it acts on that job's room only, not on \
                 {}",
                if job.is_empty() {
                    "the default room".to_string()
                } else {
                    format!("job {job:?}'s")
                }
            ))),
            _ => Ok(()),
        }
    }
}

/// How a server checks who talks to it.
#[derive(Debug, Clone)]
pub struct Guard {
    token: Option<Token>,
    room_tokens: super::RoomTokens,
    tls_only: bool,
    open: OpenRoutes,
}

impl Guard {
    /// A guard requiring `security.token` (if any) on every request but `open` ones, and TLS
    /// on every connection when `security` serves TLS.
    pub fn new(security: &Security, open: OpenRoutes) -> Self {
        Self {
            token: security.token.clone(),
            room_tokens: super::RoomTokens::default(),
            tls_only: security.tls.serves_tls(),
            open,
        }
    }

    /// This guard also accepting each job's own token (for that job's room only; the
    /// handlers check the room with [`Caller::may_act_on`]).
    pub fn with_room_tokens(mut self, room_tokens: super::RoomTokens) -> Self {
        self.room_tokens = room_tokens;
        self
    }

    fn is_open(&self, method: &Method, path: &str) -> bool {
        self.open == OpenRoutes::ReadOnlyStatus
            && (method == Method::GET || method == Method::HEAD)
            && READ_ONLY_PATHS.contains(&path)
    }

    /// Who sent a request with these headers, if it may pass; else why not.
    fn admit(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> std::result::Result<Caller, &'static str> {
        let Some(token) = self.token.as_ref() else {
            return Ok(Caller::Anyone);
        };
        if self.is_open(method, path) {
            return Ok(Caller::Anyone);
        }
        if changes_state(method) && !is_grpc(headers) && is_basic(headers) {
            // A browser that logged in to a private dashboard resends Basic credentials by
            // itself, also on a request another site's page makes it send.
            return Err(
                "HTTP Basic credentials are accepted for reading only (a browser resends them                  by itself): send the token as `Authorization: Bearer <token>`",
            );
        }
        match presented_token(headers) {
            None => Err(
                "missing token: this server requires the shared secret; set TORCHFT_TOKEN_FILE \
                 (or TORCHFT_TOKEN) to the job's token",
            ),
            Some(t) if token.matches(&t) => Ok(Caller::Admin),
            Some(t) => match self.room_tokens.job_of(&t) {
                Some(job) => Ok(Caller::Room(job.to_string())),
                None => Err(
                    "wrong token: the shared secret sent does not match this server's; check \
                     TORCHFT_TOKEN_FILE / TORCHFT_TOKEN on both sides",
                ),
            },
        }
    }
}

/// The token in an `authorization` header: `Bearer <token>`, or HTTP Basic with the token as
/// the password (what a browser sends after the dashboard's login prompt).
fn presented_token(headers: &HeaderMap) -> Option<Vec<u8>> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    if let Some(t) = strip_prefix_ci(value, b"bearer ") {
        return Some(t.trim_ascii().to_vec());
    }
    let basic = strip_prefix_ci(value, b"basic ")?;
    let decoded = base64_decode(basic.trim_ascii())?;
    let colon = decoded.iter().position(|b| *b == b':')?;
    Some(decoded[colon + 1..].to_vec())
}

fn is_basic(headers: &HeaderMap) -> bool {
    headers
        .get(header::AUTHORIZATION)
        .is_some_and(|v| strip_prefix_ci(v.as_bytes(), b"basic ").is_some())
}

/// Methods that may change something (everything but reads).
fn changes_state(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Why a state-changing browser request from another site's page is refused (`None`: it is
/// not one). A browser names the page's origin in `Origin` on such requests; it must be this
/// server (the `Host` it was sent to; `authority`: the request target's, which HTTP/2 sends
/// instead of `Host`). Clients that are not browsers send no `Origin`.
fn cross_origin(method: &Method, headers: &HeaderMap, authority: Option<&str>) -> Option<String> {
    if !changes_state(method) || is_grpc(headers) {
        return None;
    }
    let origin = headers.get(header::ORIGIN)?.to_str().unwrap_or("");
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or(authority)
        .unwrap_or("");
    let authority = origin
        .split_once("://")
        .map(|(_, rest)| rest.trim_end_matches('/'))
        .unwrap_or("");
    if !authority.is_empty() && authority.eq_ignore_ascii_case(host) {
        return None;
    }
    Some(format!(
        "cross-origin request refused: a page from {origin:?} may not change this server          ({host:?}); use the lighthouse's own dashboard, or a client that is not a browser"
    ))
}

fn strip_prefix_ci<'a>(value: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    (value.len() >= prefix.len() && value[..prefix.len()].eq_ignore_ascii_case(prefix))
        .then(|| &value[prefix.len()..])
}

/// Standard base64 (with or without padding); `None` on anything else.
fn base64_decode(input: &[u8]) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let trimmed = input
        .strip_suffix(b"==")
        .or_else(|| input.strip_suffix(b"="))
        .unwrap_or(input);
    if trimmed.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(trimmed.len() * 3 / 4);
    for chunk in trimmed.chunks(4) {
        let mut acc = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            acc |= value(*c)? << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// How a connection reached the server.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// The client's address.
    pub addr: SocketAddr,
    /// Whether the connection is TLS.
    pub tls: bool,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, SecureListener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, SecureListener>) -> Self {
        *stream.remote_addr()
    }
}

/// The middleware in front of every route.
async fn check(
    State(guard): State<Arc<Guard>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    req: Request,
    next: Next,
) -> Response {
    let grpc = is_grpc(req.headers());
    if guard.tls_only && !peer.tls {
        debug!(peer = %peer.addr, "plain request on a TLS server refused");
        let msg = "this server accepts TLS only: dial it with an https:// address and set \
                   TORCHFT_TLS_CA to the CA that signed its certificate";
        return if grpc {
            grpc_error(tonic::Status::unavailable(msg))
        } else {
            (StatusCode::BAD_REQUEST, format!("{msg}\n")).into_response()
        };
    }
    let authority = req.uri().authority().map(|a| a.as_str());
    if let Some(why) = cross_origin(req.method(), req.headers(), authority) {
        debug!(peer = %peer.addr, path = %req.uri().path(), "{why}");
        return (StatusCode::FORBIDDEN, format!("{why}\n")).into_response();
    }
    let admitted = guard.admit(req.method(), req.uri().path(), req.headers());
    if let Err(why) = admitted {
        debug!(peer = %peer.addr, path = %req.uri().path(), "{why}");
        return if grpc {
            grpc_error(tonic::Status::unauthenticated(why))
        } else {
            let mut resp = (StatusCode::UNAUTHORIZED, format!("{why}\n")).into_response();
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"torchft\", charset=\"UTF-8\""),
            );
            resp
        };
    }
    let mut req = req;
    if let Ok(caller) = admitted {
        req.extensions_mut().insert(caller);
    }
    next.run(req).await
}

fn grpc_error(status: tonic::Status) -> Response {
    status
        .into_http::<axum::body::Body>()
        .map(axum::body::Body::new)
}

/// A connection as the server sees it: plain TCP or TLS over TCP.
pub enum Io {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A listener whose connections are plain, or TLS after a handshake done off the accept
/// path (a slow client never holds up the others).
pub struct SecureListener {
    local: SocketAddr,
    inner: Inner,
}

enum Inner {
    Plain(TcpListener),
    Tls {
        rx: mpsc::Receiver<(Io, Peer)>,
        task: JoinHandle<()>,
    },
}

impl Drop for SecureListener {
    fn drop(&mut self) {
        if let Inner::Tls { task, .. } = &self.inner {
            task.abort();
        }
    }
}

impl SecureListener {
    /// Wraps a bound listener; with `tls`, connections are served TLS (plain ones are
    /// served only to be refused with a clear message).
    pub fn new(listener: TcpListener, tls: Option<TlsAcceptor>) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let inner = match tls {
            None => Inner::Plain(listener),
            Some(acceptor) => {
                let (tx, rx) = mpsc::channel(ACCEPT_QUEUE);
                let task = tokio::spawn(accept_tls(listener, acceptor, tx));
                Inner::Tls { rx, task }
            }
        };
        Ok(Self { local, inner })
    }
}

async fn accept_tls(listener: TcpListener, acceptor: TlsAcceptor, tx: mpsc::Sender<(Io, Peer)>) {
    loop {
        let (tcp, addr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let handshake = async {
                let mut first = [0u8; 1];
                let n = tcp.peek(&mut first).await?;
                if n == 1 && first[0] == TLS_HANDSHAKE_RECORD {
                    let tls = acceptor.accept(tcp).await?;
                    Ok::<_, io::Error>((Io::Tls(Box::new(tls)), Peer { addr, tls: true }))
                } else {
                    Ok((Io::Plain(tcp), Peer { addr, tls: false }))
                }
            };
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                Ok(Ok(conn)) => {
                    let _ = tx.send(conn).await;
                }
                Ok(Err(e)) => warn!(peer = %addr, error = %e, "TLS handshake failed"),
                Err(_) => debug!(peer = %addr, "TLS handshake timed out"),
            }
        });
    }
}

impl axum::serve::Listener for SecureListener {
    type Io = Io;
    type Addr = Peer;

    async fn accept(&mut self) -> (Io, Peer) {
        match &mut self.inner {
            Inner::Plain(listener) => loop {
                match TcpListener::accept(listener).await {
                    Ok((tcp, addr)) => {
                        let _ = tcp.set_nodelay(true);
                        return (Io::Plain(tcp), Peer { addr, tls: false });
                    }
                    Err(e) => {
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            },
            Inner::Tls { rx, .. } => match rx.recv().await {
                Some(conn) => conn,
                // The accept task is gone (only at shutdown): accept nothing more.
                None => std::future::pending().await,
            },
        }
    }

    fn local_addr(&self) -> io::Result<Peer> {
        Ok(Peer {
            addr: self.local,
            tls: matches!(self.inner, Inner::Tls { .. }),
        })
    }
}

fn read_pem(what: &str, path: &Path) -> Result<Vec<u8>> {
    super::read_named(what, path, |p| std::fs::read(p))
}

fn certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let pem = read_pem(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| {
            Error::InvalidArgument(format!("{what} {} is not PEM: {e}", path.display()))
        })?;
    if certs.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{what} {} holds no certificate",
            path.display()
        )));
    }
    Ok(certs)
}

/// The rustls provider every config uses (ring), chosen explicitly so nothing depends on a
/// process-wide default.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The TLS acceptor of a server with `security`'s certificate (`None` when it serves plain
/// TCP): ALPN h2 and http/1.1; client certificates required when a client CA is set.
pub fn acceptor(security: &Security) -> Result<Option<TlsAcceptor>> {
    let tls = &security.tls;
    tls.validate()?;
    let (Some(cert), Some(key)) = (&tls.cert, &tls.key) else {
        return Ok(None);
    };
    let chain = certs("TLS certificate", cert)?;
    let key = PrivateKeyDer::from_pem_slice(&read_pem("TLS key", key)?).map_err(|e| {
        Error::InvalidArgument(format!(
            "TLS key {} is not a PEM private key: {e}",
            key.display()
        ))
    })?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::InvalidArgument(format!("TLS setup failed: {e}")))?;
    let builder = match &tls.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs("TLS client CA", ca)? {
                roots.add(c).map_err(|e| {
                    Error::InvalidArgument(format!("TLS client CA {}: {e}", ca.display()))
                })?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots.into(),
                provider(),
            )
            .build()
            .map_err(|e| Error::InvalidArgument(format!("TLS client CA {}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        Error::InvalidArgument(format!(
            "TLS certificate {} and its key do not fit: {e}",
            cert.display()
        ))
    })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

/// Serves `app` on `listener` until `shutdown` resolves: TLS when `tls` is given, every
/// request through `guard` first.
pub async fn serve<F>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    guard: Guard,
    app: Router,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let listener = SecureListener::new(listener, tls)?;
    let app = app.layer(axum::middleware::from_fn_with_state(Arc::new(guard), check));
    axum::serve(listener, app.into_make_service_with_connect_info::<Peer>())
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(auth).unwrap());
        h
    }

    #[test]
    fn base64_decodes_what_browsers_send() {
        assert_eq!(base64_decode(b"dTpzM2NyZXQ=").unwrap(), b"u:s3cret");
        assert_eq!(base64_decode(b"OnRvaw==").unwrap(), b":tok");
        assert_eq!(base64_decode(b"YWJj").unwrap(), b"abc");
        assert!(base64_decode(b"a").is_none());
        assert!(base64_decode(b"!!!!").is_none());
    }

    #[test]
    fn guard_rules() {
        let security = Security {
            token: Some(Token::new("tok").unwrap()),
            ..Default::default()
        };
        let public_reads = Guard::new(&security, OpenRoutes::ReadOnlyStatus);
        let private = Guard::new(&security, OpenRoutes::None);
        let open = Guard::new(&Security::none(), OpenRoutes::None);
        let (get, head, post) = (Method::GET, Method::HEAD, Method::POST);
        let kill = "/replicas/a/kill";
        // (guard, method, path, Authorization header, None: let through, Some(start of the
        // reason): refused).
        let cases = [
            (&public_reads, &get, "/status", None, None),
            (&public_reads, &head, "/metrics", None, None),
            (&public_reads, &post, "/status", None, Some("")),
            (&public_reads, &post, kill, None, Some("missing")),
            (
                &public_reads,
                &post,
                kill,
                Some("Bearer nope"),
                Some("wrong"),
            ),
            (&public_reads, &post, kill, Some("Bearer tok"), None),
            (&public_reads, &post, "/x", Some("bearer tok"), None),
            // Basic (what a browser caches and resends) opens reads only.
            (
                &public_reads,
                &post,
                "/x",
                Some("Basic dTp0b2s="),
                Some("HTTP Basic credentials are accepted for reading only"),
            ),
            (&public_reads, &post, "/x", Some("Basic dTpub3Q="), Some("")),
            (&private, &get, "/status", Some("Basic dTp0b2s="), None),
            (&private, &get, "/status", Some("Basic dTpub3Q="), Some("")),
            (&private, &get, "/status", None, Some("")),
            (&open, &post, "/x", None, None),
        ];
        for (guard, method, path, auth, refused) in cases {
            let h = auth.map_or_else(HeaderMap::new, headers);
            let why = guard.admit(method, path, &h).err();
            let case = format!("{method} {path} with {auth:?}: {why:?}");
            match refused {
                None => assert!(why.is_none(), "{case}"),
                Some(start) => assert!(why.is_some_and(|w| w.starts_with(start)), "{case}"),
            }
        }
    }

    #[test]
    fn room_tokens_name_their_job_and_the_servers_token_acts_on_all() {
        let security = Security {
            token: Some(Token::new("admin").unwrap()),
            ..Default::default()
        };
        let rooms = super::super::RoomTokens::from_pairs([
            ("a".to_string(), Token::new("tok-a").unwrap()),
            ("b".to_string(), Token::new("tok-b").unwrap()),
        ]);
        let guard = Guard::new(&security, OpenRoutes::ReadOnlyStatus).with_room_tokens(rooms);
        let post = Method::POST;
        let path = "/torchft.LighthouseService/Quorum";
        let admit = |auth: &str| guard.admit(&post, path, &headers(auth));
        assert_eq!(admit("Bearer admin"), Ok(Caller::Admin));
        assert_eq!(admit("Bearer tok-a"), Ok(Caller::Room("a".into())));
        assert_eq!(admit("Bearer tok-b"), Ok(Caller::Room("b".into())));
        assert!(admit("Bearer tok-c")
            .unwrap_err()
            .starts_with("wrong token"));
        assert_eq!(
            guard.admit(&Method::GET, "/status", &HeaderMap::new()),
            Ok(Caller::Anyone)
        );
        let a = Caller::Room("a".into());
        a.may_act_on("a").unwrap();
        let err = a.may_act_on("b").unwrap_err().to_string();
        assert!(
            err.contains("job \"a\"'s") && err.contains("job \"b\"'s"),
            "{err}"
        );
        assert!(a
            .may_act_on("")
            .unwrap_err()
            .to_string()
            .contains("default room"));
        for caller in [Caller::Admin, Caller::Anyone] {
            caller.may_act_on("b").unwrap();
            caller.may_act_on("").unwrap();
        }
    }

    fn with(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn state_changing_browser_requests_must_come_from_this_server() {
        let host = (header::HOST, "lh.example:29510");
        // The dashboard's own page: same origin.
        let same = with(&[host.clone(), (header::ORIGIN, "http://lh.example:29510")]);
        assert!(cross_origin(&Method::POST, &same, None).is_none());
        let tls = with(&[host.clone(), (header::ORIGIN, "https://LH.example:29510/")]);
        assert!(cross_origin(&Method::POST, &tls, None).is_none());
        // Another site's page, an opaque origin, another port: refused, naming the origin.
        for origin in ["http://evil.example", "null", "http://lh.example:8080"] {
            let h = with(&[host.clone(), (header::ORIGIN, origin)]);
            let why = cross_origin(&Method::POST, &h, None).expect(origin);
            assert!(why.contains("cross-origin request refused"), "{why}");
            assert!(cross_origin(&Method::DELETE, &h, None).is_some());
            // Reads and gRPC are not what a cross-site page can abuse.
            assert!(cross_origin(&Method::GET, &h, None).is_none());
            let mut grpc = h.clone();
            grpc.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            assert!(cross_origin(&Method::POST, &grpc, None).is_none());
        }
        // Clients that are not browsers send no Origin.
        assert!(cross_origin(&Method::POST, &with(std::slice::from_ref(&host)), None).is_none());
        // HTTP/2: no Host header, the target's authority instead.
        let h2 = with(&[(header::ORIGIN, "https://lh.example:29510")]);
        assert!(cross_origin(&Method::POST, &h2, Some("lh.example:29510")).is_none());
        assert!(cross_origin(&Method::POST, &h2, Some("other:1")).is_some());
    }
}
