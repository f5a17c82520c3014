//! The own lighthouse connection of a hosting rank that is its group's only rank.
//!
//! A single-rank group's training thread asks the lighthouse twice per step: for the quorum
//! ([`super::ManagerServer::quorum_start_blocking`], sent at the step's start and waited
//! for later) and for the write-ahead commit
//! ([`super::ManagerServer::may_commit_blocking`]). Over the server's shared connection each
//! round trip takes two hand-offs between threads: the request wakes a runtime thread to
//! write it, and the answer, read by that thread, wakes the training thread again. On a
//! machine whose cores the job keeps busy, each wake-up waits for a core. Here the
//! connection lives on a runtime without worker threads: the training thread drives it
//! itself (writes the request, reads the answer), so nothing else has to be scheduled (a
//! lighthouse named by host name is resolved on a blocking thread when it is dialled).
//!
//! A quorum is started, not waited for: the thread drives the connection until the request
//! is written (the link counts the bytes it writes, and stops once a write is followed by a
//! pass with nothing more to do; the server starts quorums here only on a connection already
//! made, which the commit announcements dial), and drives it again when it waits for the
//! answer. Meanwhile the answer may come and wait unread: the server dates the quorum from
//! when its request was sent (see `lighthouse`), which the commit lease needs. A request left
//! undriven for longer than a heartbeat interval (its rank in a long forward pass) is driven
//! by a backstop thread until the rank waits ([`OwnLink::drive_unattended`]), so its answer
//! is read when it comes: its deadline and its waiting notes, timers that a late reading
//! would race, hold as on the shared connection.
//!
//! Between two requests nothing drives the connection, so it cannot answer the lighthouse,
//! nor notice by itself that the lighthouse is gone. The server therefore closes it (shuts
//! its socket down and drops its runtime) when it may be in the way or dead:
//! - when the open lighthouse session on the shared connection ends, or a new one fails to
//!   open: a lighthouse stopping ends its sessions first, and the group closes this
//!   connection a round trip later, so the lighthouse's graceful stop does not wait out its
//!   grace for the answer to its last ping; a connection the shared link's keep-alive finds
//!   dead ends the session too. A quorum request in flight on it is sent again on the
//!   shared connection;
//! - when an announcement gets no answer on it within [`OWN_LINK_TRY`](super::OWN_LINK_TRY):
//!   the announcement is sent again on the shared connection;
//! - when a quorum request on it fails in its transport (it is sent again on the shared
//!   connection) or times out (a quorum may rightly wait long for its members, so no
//!   shorter try is cut off; a silent connection costs that one request);
//! - for good at the server's shutdown.
//!
//! After any of these but the last, the next request dials anew.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::runtime::{Builder, Runtime};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::{Endpoint, Uri};

use crate::client::LighthouseClient;
use crate::error::{Error, Result};
use crate::manager::ManagerOptions;
use crate::security::Token;

/// The connection, opened on first use (multi-rank groups never use it).
pub(super) struct OwnLink {
    endpoint: Endpoint,
    token: Option<Token>,
    job: String,
    /// The server's shared client, whose quorum cache the link's client shares.
    shared: LighthouseClient,
    open: Mutex<Option<Arc<Link>>>,
    /// Set at the server's shutdown: no connection is opened any more.
    shut: AtomicBool,
}

/// One connection and the runtime it lives on.
struct Link {
    /// Always `Some` until dropped (taken to shut it down without blocking).
    rt: Option<Runtime>,
    lighthouse: LighthouseClient,
    /// Bytes written on the connection so far.
    written: Arc<AtomicU64>,
    /// The connection's live sockets (a duplicate handle per dial, dropped with its
    /// connection), shut down when the link is closed.
    sockets: Sockets,
    /// Set when the link is closed: a request still in flight on it gives up.
    closed: watch::Sender<bool>,
    /// A started request nobody drives (see [`OwnLink::drive_unattended`]).
    unattended: Arc<Unattended>,
}

/// The link's latest started request: since when it has been left without a thread driving
/// the link (None: it is being waited for, or is done), and whether a backstop thread drives
/// the link now. A newer request takes the slot over: an older one's end or drop leaves it.
#[derive(Default)]
struct Unattended {
    slot: Mutex<Slot>,
    /// Woken when the request is done or a waiter takes over.
    attended: tokio::sync::Notify,
    backstop: AtomicBool,
}

#[derive(Default)]
struct Slot {
    request: u64,
    since: Option<Instant>,
    done: bool,
}

impl Unattended {
    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new request: returns its number.
    fn begin(&self) -> u64 {
        let mut slot = self.slot();
        *slot = Slot {
            request: slot.request + 1,
            since: None,
            done: false,
        };
        slot.request
    }

    /// Request `n` is left undriven (unless it is done, or no longer the latest).
    fn left(&self, n: u64) {
        let mut slot = self.slot();
        if slot.request == n && !slot.done {
            slot.since = Some(Instant::now());
        }
    }

    /// A waiter takes request `n` over (`done`: or it ended): a backstop stops driving.
    fn taken(&self, n: u64, done: bool) {
        {
            let mut slot = self.slot();
            if slot.request == n {
                slot.since = None;
                slot.done |= done;
            }
        }
        self.attended.notify_waiters();
    }

    fn since(&self) -> Option<Instant> {
        self.slot().since
    }
}

/// What a request started on the link ([`OwnLink::start`]) runs with.
#[derive(Clone)]
pub(super) struct Attempt {
    /// The link's client (it shares the server's quorum cache: see `OwnLink::new`).
    pub(super) lighthouse: LighthouseClient,
    closed: watch::Receiver<bool>,
}

impl Attempt {
    /// Resolves once the link is closed (a request on it will not be answered there).
    pub(super) async fn closed(&self) {
        let mut rx = self.closed.clone();
        let _ = rx.wait_for(|closed| *closed).await;
    }
}

/// Passes of the link's runtime `is_done` drives to read an answer that is in.
const READ_PASSES: usize = 3;

/// Most passes of the link's runtime a start drives while waiting for its request to be
/// written (each is one poll of the connection's socket without waiting); a request not
/// written by then goes out when the link is next driven (its waiter, or a backstop).
const FLUSH_PASSES: usize = 16;

/// A request started on the link and left running; the caller drives the link again to
/// wait for its answer. Dropped unanswered, the request is cancelled.
pub(super) struct Started<T: Send + 'static> {
    link: Arc<Link>,
    /// The request's number on its link (see `Unattended`).
    n: u64,
    handle: Option<JoinHandle<T>>,
}

impl<T: Send + 'static> Started<T> {
    /// Waits for the answer on this thread, which drives the link meanwhile.
    ///
    /// # Errors
    /// `InvalidArgument` inside a tokio runtime; `Unavailable` if the request's task failed.
    pub(super) fn wait(mut self) -> Result<T> {
        outside_runtime(
            "waiting for a started quorum",
            "await ManagerClient::quorum",
        )?;
        let (Some(rt), Some(handle)) = (&self.link.rt, self.handle.take()) else {
            return Err(Error::Shutdown);
        };
        self.link.unattended.taken(self.n, false);
        rt.block_on(handle)
            .map_err(|e| Error::Unavailable(format!("the quorum request's task failed: {e}")))
    }

    /// Whether the answer is in: drives the link for a few passes (without waiting) first,
    /// so an answer that arrived is read.
    pub(super) fn is_done(&self) -> bool {
        let Some(handle) = &self.handle else {
            return true;
        };
        if !handle.is_finished() && may_block() {
            if let Some(rt) = &self.link.rt {
                self.link.unattended.taken(self.n, false);
                rt.block_on(async {
                    // The socket is read in one pass, the answer handed on in the next.
                    for _ in 0..READ_PASSES {
                        tokio::task::yield_now().await;
                        if handle.is_finished() {
                            break;
                        }
                    }
                });
                self.link.unattended.left(self.n);
            }
        }
        handle.is_finished()
    }
}

impl<T: Send + 'static> Drop for Started<T> {
    fn drop(&mut self) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        self.link.unattended.taken(self.n, true);
        handle.abort();
        // Let the task see its cancellation (it may hold the link's quorum stream); from
        // inside a runtime, it does when the link is next driven or closed.
        if let (Some(rt), true) = (&self.link.rt, may_block()) {
            let _ = rt.block_on(handle);
        }
    }
}

impl std::fmt::Debug for OwnLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        f.debug_struct("OwnLink").field("open", &open).finish()
    }
}

impl OwnLink {
    /// The lighthouse at `endpoint` (without keep-alive: between two waits nothing would
    /// answer a ping; see the module's documentation for what replaces it), with the token
    /// and job of `opts`; not dialled yet. Its client shares `shared`'s quorum cache (the
    /// last quorum received, which the next request and the heartbeats name), so either
    /// connection may carry a group's next quorum request.
    pub(super) fn new(
        endpoint: Endpoint,
        opts: &ManagerOptions,
        shared: &LighthouseClient,
    ) -> Self {
        Self {
            endpoint,
            token: opts.security.token.clone(),
            job: opts.job.clone(),
            shared: shared.clone(),
            open: Mutex::new(None),
            shut: AtomicBool::new(false),
        }
    }

    /// Starts `call` on the link's live connection and drives the link on this thread
    /// until its request is written, then returns: the request goes on while
    /// the caller does other work, and [`Started::wait`] drives the link again for the
    /// answer.
    ///
    /// # Errors
    /// `Unavailable` when the link has no live connection (`start` does not dial: see
    /// `ManagerServer::quorum_start_blocking`). The caller checks it runs outside any
    /// runtime.
    pub(super) fn start<F, Fut>(&self, call: F) -> Result<Started<Fut::Output>>
    where
        F: FnOnce(Attempt) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        let link = self.connected_link().ok_or(Error::Unavailable(
            "the own connection is not connected".into(),
        ))?;
        let Some(rt) = &link.rt else {
            return Err(Error::Shutdown);
        };
        let attempt = Attempt {
            lighthouse: link.lighthouse.clone(),
            closed: link.closed.subscribe(),
        };
        let mut last = link.written.load(Ordering::Relaxed);
        let request = call(attempt);
        let n = link.unattended.begin();
        let unattended = link.unattended.clone();
        let handle = rt.spawn(async move {
            let answer = request.await;
            unattended.taken(n, true);
            answer
        });
        rt.block_on(async {
            // Each pass runs every task the last one woke and polls the socket once: the
            // request is written once a pass wrote and the next one had nothing more to do.
            let mut wrote = false;
            for _ in 0..FLUSH_PASSES {
                tokio::task::yield_now().await;
                if handle.is_finished() {
                    break;
                }
                let now = link.written.load(Ordering::Relaxed);
                if now != last {
                    last = now;
                    wrote = true;
                } else if wrote {
                    break;
                }
            }
        });
        // Until its caller waits, a backstop may drive the link (see `drive_unattended`).
        link.unattended.left(n);
        Ok(Started {
            link,
            n,
            handle: Some(handle),
        })
    }

    /// Drives the link on a thread of its own while a started request has been left
    /// undriven for longer than `after` (its caller busy elsewhere, e.g. in a forward pass
    /// longer than that), until the caller waits or the request ends: the answer is then
    /// read when it comes, so the request's deadline and its waiting notes do not depend on
    /// when the caller comes back. Called by the heartbeat loop; returns at once.
    pub(super) fn drive_unattended(&self, after: Duration) {
        let link = match &*self.open.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(link) => link.clone(),
            None => return,
        };
        if link
            .unattended
            .since()
            .is_some_and(|since| since.elapsed() >= after)
        {
            backstop(link);
        }
    }

    /// Runs `call` with the link's client to completion on this thread, which drives the
    /// connection meanwhile (dialled first if it is not open).
    ///
    /// # Errors
    /// `Unavailable` when the link's runtime cannot start; `Shutdown` after
    /// [`OwnLink::close_for_good`]. The caller checks it runs outside any runtime.
    pub(super) fn run<F, Fut>(&self, call: F) -> Result<Fut::Output>
    where
        F: FnOnce(LighthouseClient) -> Fut,
        Fut: Future,
    {
        let link = self.link()?;
        match &link.rt {
            Some(rt) => Ok(rt.block_on(call(link.lighthouse.clone()))),
            None => Err(Error::Shutdown),
        }
    }

    /// Closes the connection, if open: its sockets are shut down, a request in flight on it
    /// gives up (see [`Attempt::closed`]; one left undriven is driven by a backstop thread
    /// meanwhile), and its runtime and tasks are dropped once the calls still running on it
    /// return. The next announcement dials anew.
    pub(super) fn close(&self) {
        let link = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(link) = link {
            link.closed.send_replace(true);
            // A request left on it is sent again on the shared connection by its task, which
            // must be driven for that: now, not when its caller comes back.
            if link.unattended.since().is_some() {
                backstop(link.clone());
            }
            // A started request may keep the runtime (and so the socket) alive until its
            // caller comes back: the socket is shut down now, so the lighthouse sees it
            // close at once (its graceful stop does not wait for it).
            for (_, s) in link
                .sockets
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
            {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// [`OwnLink::close`], if `attempt` runs on the connection open now (not on one closed
    /// already, whose successor must stay).
    pub(super) fn close_for(&self, attempt: &Attempt) {
        let same = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|link| link.closed.subscribe().same_channel(&attempt.closed));
        if same {
            self.close();
        }
    }

    /// Closes the connection and opens none any more (the server's shutdown): later calls
    /// fail with `Shutdown`.
    pub(super) fn close_for_good(&self) {
        self.shut.store(true, Ordering::SeqCst);
        self.close();
    }

    /// The open link, if it has a live connection (one its channel still holds).
    fn connected_link(&self) -> Option<Arc<Link>> {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let link = open.as_ref()?;
        let live = !link
            .sockets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        live.then(|| link.clone())
    }

    /// Whether a connection is open (for tests).
    pub(super) fn is_open(&self) -> bool {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn link(&self) -> Result<Arc<Link>> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if self.shut.load(Ordering::SeqCst) {
            return Err(Error::Shutdown);
        }
        if let Some(link) = &*open {
            return Ok(link.clone());
        }
        let rt = Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Unavailable(format!("cannot start the own link's runtime: {e}")))?;
        let written = Arc::new(AtomicU64::new(0));
        let sockets = Sockets::default();
        let lighthouse = {
            // The lazy channel starts its worker on the runtime entered here.
            let _entered = rt.enter();
            let channel = self
                .endpoint
                .connect_with_connector_lazy(CountingConnector {
                    written: written.clone(),
                    sockets: sockets.clone(),
                });
            LighthouseClient::from_channel(channel, self.token.as_ref())
                .with_job(&self.job)?
                .sharing_quorums_with(&self.shared)
        };
        let link = Arc::new(Link {
            rt: Some(rt),
            lighthouse,
            written,
            sockets,
            closed: watch::channel(false).0,
            unattended: Arc::default(),
        });
        *open = Some(link.clone());
        Ok(link)
    }
}

/// `InvalidArgument` on a thread inside a tokio runtime, whose threads must not block:
/// `what` is the call refused, and `instead` what to do inside a runtime.
pub(super) fn outside_runtime(what: &str, instead: &str) -> Result<()> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::InvalidArgument(format!(
            "{what} waits on the calling thread: call it from outside any tokio runtime \
             (inside one, {instead})"
        )));
    }
    Ok(())
}

/// Whether this thread is outside any tokio runtime (it may block on the link's).
fn may_block() -> bool {
    tokio::runtime::Handle::try_current().is_err()
}

impl Drop for Link {
    fn drop(&mut self) {
        // The last owner may be a task of the shared runtime, where blocking is not allowed.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Dials plain TCP (no delay) like the endpoint's own connector, handing out connections
/// that add the bytes they write to a counter ([`OwnLink::start`] watches it). The
/// endpoint's TLS, if any, is layered on top by the channel.
#[derive(Clone)]
struct CountingConnector {
    written: Arc<AtomicU64>,
    /// Where each connection's socket is kept (a duplicate handle) for `OwnLink::close`.
    sockets: Sockets,
}

/// A link's live sockets by dial number.
type Sockets = Arc<Mutex<Vec<(u64, std::net::TcpStream)>>>;

/// Numbers the dials of all links.
static DIALS: AtomicU64 = AtomicU64::new(0);

impl tower::Service<Uri> for CountingConnector {
    type Response = Counted;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Counted>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let written = self.written.clone();
        let sockets = self.sockets.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| std::io::Error::other(format!("no host in {uri}")))?;
            // A bracketed IPv6 literal is dialled without its brackets.
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri
                .port_u16()
                .unwrap_or(if uri.scheme_str() == Some("https") {
                    443
                } else {
                    80
                });
            let stream = tokio::net::TcpStream::connect((host, port)).await?;
            stream.set_nodelay(true)?;
            let plain = stream.into_std()?;
            let dial = DIALS.fetch_add(1, Ordering::Relaxed);
            sockets
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((dial, plain.try_clone()?));
            let stream = tokio::net::TcpStream::from_std(plain)?;
            Ok(Counted {
                io: TokioIo::new(stream),
                written,
                dial,
                sockets,
            })
        })
    }
}

/// A connection that counts the bytes written on it; leaves its link's live sockets when
/// the channel drops it.
struct Counted {
    io: TokioIo<tokio::net::TcpStream>,
    written: Arc<AtomicU64>,
    dial: u64,
    sockets: Sockets,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.sockets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(dial, _)| *dial != self.dial);
    }
}

impl Counted {
    fn count(&self, n: usize) {
        self.written.fetch_add(n as u64, Ordering::Relaxed);
    }
}

impl hyper::rt::Read for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.count(n);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            self.count(n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Drives `link` on a thread of its own until its latest started request is taken over by
/// a waiter or ends (one such thread per link at a time); returns at once.
fn backstop(link: Arc<Link>) {
    if link.unattended.backstop.swap(true, Ordering::SeqCst) {
        return;
    }
    /// Clears the link's backstop mark when the thread ends, panicking or not.
    struct Running(Arc<Link>);
    impl Drop for Running {
        fn drop(&mut self) {
            self.0.unattended.backstop.store(false, Ordering::SeqCst);
        }
    }
    let running = Running(link.clone());
    let spawned = std::thread::Builder::new()
        .name("torchft-own-link".into())
        .spawn(move || {
            let link = running.0.clone();
            let Some(rt) = &link.rt else {
                return;
            };
            let u = &link.unattended;
            rt.block_on(async {
                loop {
                    // Registered before the check, so a wake-up in between is not lost.
                    let woken = u.attended.notified();
                    tokio::pin!(woken);
                    woken.as_mut().enable();
                    if u.since().is_none() {
                        break;
                    }
                    woken.await;
                }
            });
            drop(running);
        });
    if spawned.is_err() {
        link.unattended.backstop.store(false, Ordering::SeqCst);
    }
}
