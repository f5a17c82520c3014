//! The sending side: serves ranges of one offered state from its memory, straight from the
//! tensor in chunks of [`DIRECT_WRITE_BYTES`] to receivers that fetch a torn tensor again
//! (`direct` requests), else through a per-stream staging buffer one [`PIECE_BYTES`] piece at
//! a time (the piece sent is the piece checksummed).
//!
//! The owner offers a state ([`DataServer::offer`]) and revokes it before the state may change
//! ([`DataServer::revoke`]): revoking stops every stream of the offer at its next write (their
//! sockets are shut down, so a stream blocked on a slow receiver returns at once) and waits,
//! bounded, until none reads the state any more. Each stream also has a deadline (the offer's
//! timeout): a slow or stalled receiver never holds the sender longer.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

use super::wire::{self, Request};
use crate::security::Token;

/// Bytes a staged stream copies into its buffer, checksums and writes per socket call (the
/// size of that buffer). Small enough that the piece copied into the buffer is still in the
/// core's cache when it is checksummed and when the kernel copies it into the socket (a 1 MiB
/// piece, with a few streams sharing a core, was not: the second pass came from memory, and a
/// heal moved about 8% fewer bytes per second).
pub const PIECE_BYTES: usize = 256 << 10;
/// Bytes a `direct` stream checksums and then hands to the socket, straight from the
/// tensor's memory (no copy, so no buffer to keep small): the kernel's copy finds the chunk
/// the checksum pass read in the last-level cache as long as the streams' chunks fit in it
/// (four streams' 16 MiB in the 32 MiB of the machine measured; a core's 1 MiB L2 holds only
/// part of one), and a stream makes 16 times fewer writes than with [`PIECE_BYTES`]. In
/// `benches/checkpoint_wire.py` (1 GiB, one stream, two cores), 256 KiB writes measured
/// 0.50-0.84 of the raw copy's throughput in 5 runs, with single receives from 0.16 to
/// 0.54 s, and 4 MiB writes 0.87-1.10 in 12 of 13 runs (0.66 in one); four streams measured
/// the same either way.
pub const DIRECT_WRITE_BYTES: usize = 4 << 20;
/// Connections open at once (streaming, queued or still sending their request); more are
/// answered "unavailable" at once (receivers retry that until their deadline).
pub const MAX_CONNECTIONS: usize = 256;
/// Streams reading the state at once; authenticated requests beyond it queue for a slot
/// (bounded by the request timeout), so one source can serve many healing groups in turn.
pub const MAX_STREAMS: usize = 64;
/// Longest a new connection may take to send its request: until then it is not
/// authenticated, so a peer that connects and stays silent cannot hold a slot for long.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a revoke waits for streams to let go of the state.
const REVOKE_WAIT: Duration = Duration::from_secs(5);

/// Where one tensor's bytes come from.
#[derive(Debug, Clone, Copy)]
pub enum Source {
    /// Plain memory the core reads directly (a contiguous CPU tensor).
    Memory {
        /// Address of the first byte.
        addr: usize,
        /// Number of bytes.
        len: usize,
    },
    /// Memory only the owner can read (a GPU or non-contiguous tensor): copied piece by
    /// piece into the stream's staging buffer by [`OfferHooks::stage`].
    Staged {
        /// Number of bytes.
        len: usize,
    },
}

impl Source {
    /// Number of bytes of the tensor.
    pub fn len(&self) -> usize {
        match *self {
            Source::Memory { len, .. } | Source::Staged { len } => len,
        }
    }

    /// True for an empty tensor.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a stream may not read the offered state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnterError {
    /// The state changed since it was offered (a write, or a tensor moved): every range
    /// must come from one state, so the offer cannot be served any more.
    Changed(String),
    /// The state could not be locked for reading.
    Failed(String),
}

/// What the owner of an offer does for the streams that read it.
pub trait OfferHooks: Send + Sync {
    /// Called before a stream reads the state; the guard is dropped when the stream ends
    /// (the owner's read lock, so the state cannot change under a stream). Refuses with
    /// [`EnterError::Changed`] once the state is no longer the one offered, so the ranges
    /// of one receive never mix two states.
    fn enter(&self) -> Result<Box<dyn Send>, EnterError>;
    /// Copies bytes `[offset, offset + out.len())` of tensor `index` (a [`Source::Staged`]
    /// one) into `out`.
    fn stage(&self, index: usize, offset: u64, out: &mut [u8]) -> Result<(), String>;
}

/// One state offered to receivers.
pub struct Offer {
    step: i64,
    gen: String,
    sources: Vec<Source>,
    timeout: Duration,
    hooks: Box<dyn OfferHooks>,
    revoked: AtomicBool,
}

impl Offer {
    /// An offer of `sources` as the state of `step`, generation `gen`.
    ///
    /// # Safety
    /// Every [`Source::Memory`] range must stay valid for reads for as long as the offer is
    /// alive (streams hold it until they end): the owner keeps the memory alive through
    /// `hooks`, refuses in `enter` once it moved, and does not write it before
    /// [`DataServer::revoke`] returned true (its `enter` guard blocks writers while a stream
    /// runs). Bytes changed anyway are sent as copied, with a checksum of that copy.
    pub unsafe fn new(
        step: i64,
        gen: String,
        sources: Vec<Source>,
        timeout: Duration,
        hooks: Box<dyn OfferHooks>,
    ) -> Self {
        Offer {
            step,
            gen,
            sources,
            timeout,
            hooks,
            revoked: AtomicBool::new(false),
        }
    }
}

struct Conn {
    stream: TcpStream,
    gen: Option<String>,
}

#[derive(Default)]
struct State {
    offer: Option<Arc<Offer>>,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    /// Stream slots taken (at most [`MAX_STREAMS`]).
    streaming: usize,
    closed: bool,
}

struct Shared {
    token: Option<Token>,
    request_timeout: Duration,
    state: Mutex<State>,
    cond: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits (until `deadline`) for one of the [`MAX_STREAMS`] stream slots; None when the
    /// deadline passed or the server closed first.
    fn stream_slot(&self, deadline: Instant) -> Option<StreamSlot<'_>> {
        let mut st = self.lock();
        loop {
            if st.closed {
                return None;
            }
            if st.streaming < MAX_STREAMS {
                st.streaming += 1;
                return Some(StreamSlot(self));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self
                .cond
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One taken stream slot, given back on drop.
struct StreamSlot<'a>(&'a Shared);

impl Drop for StreamSlot<'_> {
    fn drop(&mut self) {
        self.0.lock().streaming -= 1;
        self.0.cond.notify_all();
    }
}

/// Serves the current offer to receivers over TCP.
pub struct DataServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl DataServer {
    /// Listens on `host` (an IP address; `::` also accepts IPv4) at an ephemeral port.
    ///
    /// `request_timeout` bounds reading a request from a new connection.
    pub fn bind(
        host: &str,
        token: Option<Token>,
        request_timeout: Duration,
    ) -> std::io::Result<Self> {
        let ip: std::net::IpAddr = host.trim_matches(['[', ']']).parse().map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("invalid listen address {host:?}: {e}"),
            )
        })?;
        let addr = SocketAddr::new(ip, 0);
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        if ip.is_ipv6() && ip.is_unspecified() {
            socket.set_only_v6(false)?;
        }
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(128)?;
        let listener: TcpListener = socket.into();
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            token,
            request_timeout,
            state: Mutex::new(State::default()),
            cond: Condvar::new(),
        });
        let accept_shared = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("torchft-ckpt-data-{}", addr.port()))
            .spawn(move || accept_loop(listener, accept_shared))?;
        Ok(DataServer {
            shared,
            addr,
            accept: Mutex::new(Some(handle)),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Makes `offer` the served state (revoking the previous one first).
    pub fn offer(&self, offer: Offer) -> bool {
        let stopped = self.revoke();
        let mut st = self.shared.lock();
        if !st.closed {
            st.offer = Some(Arc::new(offer));
        }
        stopped
    }

    /// Stops serving the current offer: streams of it end at their next write (their sockets
    /// are shut down). Waits up to a few seconds for them; returns false if some stream still
    /// holds the offer then (it stops at its next write, and keeps the offer alive until).
    pub fn revoke(&self) -> bool {
        let mut st = self.shared.lock();
        let Some(offer) = st.offer.take() else {
            return true;
        };
        offer.revoked.store(true, Ordering::SeqCst);
        for c in st.conns.values() {
            if c.gen.as_deref() == Some(offer.gen.as_str()) {
                let _ = c.stream.shutdown(Shutdown::Both);
            }
        }
        let gen = offer.gen.as_str();
        let (_st, waited) = self
            .shared
            .cond
            .wait_timeout_while(st, REVOKE_WAIT, |st| {
                st.conns.values().any(|c| c.gen.as_deref() == Some(gen))
            })
            .unwrap_or_else(|e| e.into_inner());
        if waited.timed_out() {
            tracing::warn!(gen, "checkpoint streams still running after revoke");
            return false;
        }
        true
    }

    /// Number of connections open right now (for tests and diagnostics).
    pub fn connections(&self) -> usize {
        self.shared.lock().conns.len()
    }

    /// Revokes the offer, closes every connection, stops accepting and waits (a few seconds
    /// at most) for the connection threads to end.
    pub fn shutdown(&self) {
        self.revoke();
        {
            let mut st = self.shared.lock();
            st.closed = true;
            for c in st.conns.values() {
                let _ = c.stream.shutdown(Shutdown::Both);
            }
            // Connections queued for a stream slot give up.
            self.shared.cond.notify_all();
        }
        // Wake the accept loop, which checks `closed` after every connection.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        let handle = self.accept.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        // Every connection thread ends at its next socket call (all were shut down): wait,
        // bounded, until they did, so no stream outlives the server.
        let (st, waited) = self
            .shared
            .cond
            .wait_timeout_while(self.shared.lock(), REVOKE_WAIT, |st| !st.conns.is_empty())
            .unwrap_or_else(|e| e.into_inner());
        if waited.timed_out() {
            tracing::warn!(
                open = st.conns.len(),
                "checkpoint connections still open after shutdown"
            );
        }
    }
}

impl Drop for DataServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.lock().closed {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "checkpoint data accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = {
            let mut st = shared.lock();
            if st.conns.len() >= MAX_CONNECTIONS {
                drop(st);
                refuse(stream, "too many checkpoint connections; retry");
                continue;
            }
            let Ok(clone) = stream.try_clone() else {
                continue;
            };
            st.next_id += 1;
            let id = st.next_id;
            st.conns.insert(
                id,
                Conn {
                    stream: clone,
                    gen: None,
                },
            );
            id
        };
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("torchft-ckpt-send".into())
            .spawn(move || {
                serve_connection(&conn_shared, id, stream);
                let mut st = conn_shared.lock();
                st.conns.remove(&id);
                conn_shared.cond.notify_all();
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start a checkpoint stream thread");
            shared.lock().conns.remove(&id);
        }
    }
}

fn refuse(mut stream: TcpStream, why: &str) {
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = wire::write_reply(&mut stream, wire::STATUS_UNAVAILABLE, why);
}

fn serve_connection(shared: &Shared, id: u64, stream: TcpStream) {
    let handshake = HANDSHAKE_TIMEOUT.min(shared.request_timeout);
    let _ = stream.set_read_timeout(Some(handshake));
    let _ = stream.set_write_timeout(Some(handshake));
    let _ = stream.set_nodelay(true);
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let mut reader = BufReader::with_capacity(256, &stream);
    let req = match wire::read_request(&mut reader) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "bad checkpoint data request");
            let _ = wire::write_reply(&mut &stream, wire::STATUS_BAD_REQUEST, &e);
            return;
        }
    };
    drop(reader);
    if let Err((status, msg)) = check_request(shared, &req) {
        let _ = wire::write_reply(&mut &stream, status, &msg);
        return;
    }
    let _ = stream.set_write_timeout(Some(shared.request_timeout));
    let Some(_slot) = shared.stream_slot(Instant::now() + shared.request_timeout) else {
        let msg = format!(
            "busy: all {MAX_STREAMS} checkpoint streams stayed in use for {:?}; retry",
            shared.request_timeout
        );
        let _ = wire::write_reply(&mut &stream, wire::STATUS_UNAVAILABLE, &msg);
        return;
    };
    let offer = {
        let st = shared.lock();
        match &st.offer {
            Some(o) if o.step == req.step && o.gen == req.gen => o.clone(),
            _ => {
                drop(st);
                let msg = format!("the state of step {} is no longer served", req.step);
                let _ = wire::write_reply(&mut &stream, wire::STATUS_NOT_SERVED, &msg);
                return;
            }
        }
    };
    let (start, end) = (req.start as usize, req.end as usize);
    if !(start <= end && end <= offer.sources.len()) {
        let msg = format!(
            "range [{start}, {end}) out of bounds ({} tensors)",
            offer.sources.len()
        );
        let _ = wire::write_reply(&mut &stream, wire::STATUS_BAD_REQUEST, &msg);
        return;
    }
    // The owner's read lock first, then the registration revoke waits for: a revoke between
    // the two is seen by the check below.
    let guard = match offer.hooks.enter() {
        Ok(g) => g,
        Err(EnterError::Changed(why)) => {
            let msg = format!(
                "the state of step {} changed since it was offered ({why}); it is no longer \
                 served",
                req.step
            );
            let _ = wire::write_reply(&mut &stream, wire::STATUS_NOT_SERVED, &msg);
            return;
        }
        Err(EnterError::Failed(e)) => {
            let _ = wire::write_reply(&mut &stream, wire::STATUS_INTERNAL, &e);
            return;
        }
    };
    {
        let mut st = shared.lock();
        let current = st.offer.as_ref().is_some_and(|o| Arc::ptr_eq(o, &offer));
        if !current || offer.revoked.load(Ordering::SeqCst) {
            drop(st);
            drop(guard);
            let msg = format!("the state of step {} is no longer served", req.step);
            let _ = wire::write_reply(&mut &stream, wire::STATUS_NOT_SERVED, &msg);
            return;
        }
        if let Some(c) = st.conns.get_mut(&id) {
            c.gen = Some(offer.gen.clone());
        }
    }
    let t0 = Instant::now();
    let result = stream_range(&offer, &stream, start, end, req.direct);
    drop(guard);
    match result {
        Ok(bytes) => tracing::debug!(
            %peer, step = offer.step, start, end, bytes,
            secs = t0.elapsed().as_secs_f64(), "checkpoint range sent"
        ),
        Err(e) => tracing::info!(%peer, step = offer.step, error = %e, "checkpoint range not sent"),
    }
}

fn check_request(shared: &Shared, req: &Request) -> Result<(), (u32, String)> {
    if let Some(token) = &shared.token {
        let presented = req.token.as_deref().unwrap_or("");
        if presented.is_empty() {
            return Err((
                wire::STATUS_UNAUTHORIZED,
                "missing token: this checkpoint server requires the job's shared secret; set \
                 TORCHFT_TOKEN_FILE (or TORCHFT_TOKEN)"
                    .into(),
            ));
        }
        if !token.matches(presented.as_bytes()) {
            return Err((
                wire::STATUS_UNAUTHORIZED,
                "wrong token: the shared secret sent does not match this checkpoint server's; \
                 check TORCHFT_TOKEN_FILE / TORCHFT_TOKEN on both sides"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// Why a stream stopped early.
#[derive(Debug, thiserror::Error)]
enum StreamError {
    /// The offer was revoked.
    #[error("the offer was revoked")]
    Revoked,
    /// The offer's timeout passed.
    #[error("the transfer exceeded its {0:?} deadline")]
    Deadline(Duration),
    /// The owner could not stage a piece.
    #[error("staging failed: {0}")]
    Stage(String),
    /// The receiver went away or the socket failed.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
}

/// Makes `staging` hold at least one piece of a `len`-byte tensor.
fn grow(staging: &mut Vec<u8>, len: usize) {
    if staging.len() < PIECE_BYTES.min(len) {
        *staging = vec![0u8; PIECE_BYTES.min(len)];
    }
}

/// Sends tensors `[start, end)` of `offer`. With `direct`, plain memory goes to the socket
/// from the tensor itself (see [`wire::Request::direct`]), else through the staging buffer.
fn stream_range(
    offer: &Offer,
    stream: &TcpStream,
    start: usize,
    end: usize,
    direct: bool,
) -> Result<u64, StreamError> {
    let deadline = Instant::now() + offer.timeout;
    let mut out = stream;
    let mut sent = 0u64;
    let mut refresh = wire::TimeoutRefresh::default();
    // One socket call at a time, each bounded by the time left: a blocking send returns what
    // it queued when its timeout passes, so a receiver that drains the socket slowly but
    // steadily cannot stretch one large write past the deadline, and a revocation is seen
    // between calls (a revoked stream's socket is also shut down, which ends a call at once).
    let mut write = |bytes: &[u8]| -> Result<(), StreamError> {
        let mut rest = bytes;
        while !rest.is_empty() {
            if offer.revoked.load(Ordering::Relaxed) {
                return Err(StreamError::Revoked);
            }
            let now = Instant::now();
            let remaining = deadline.saturating_duration_since(now);
            if remaining.is_zero() {
                return Err(StreamError::Deadline(offer.timeout));
            }
            if refresh.due(now) {
                out.set_write_timeout(Some(remaining))?;
            }
            match out.write(rest) {
                Ok(0) => return Err(StreamError::Io(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    rest = &rest[n..];
                    sent += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(StreamError::Deadline(offer.timeout));
                }
                Err(_) if offer.revoked.load(Ordering::Relaxed) => {
                    return Err(StreamError::Revoked)
                }
                Err(e) => return Err(StreamError::Io(e)),
            }
        }
        Ok(())
    };
    let mut reply = Vec::with_capacity(16);
    wire::write_reply(&mut reply, wire::STATUS_OK, "")?;
    reply.extend_from_slice(&wire::range_prefix(start as u64, end as u64));
    write(&reply)?;
    let mut crcs = Vec::with_capacity(4 * (end - start));
    let mut staging: Vec<u8> = Vec::new();
    for (index, source) in offer.sources[start..end].iter().enumerate() {
        let index = start + index;
        let mut crc = crc32fast::Hasher::new();
        match *source {
            Source::Memory { addr, len } => {
                if len > 0 {
                    // SAFETY: `Offer::new`'s contract: the range is valid while the offer
                    // lives, and this stream holds the offer and the owner's read guard.
                    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                    if direct {
                        for src in bytes.chunks(DIRECT_WRITE_BYTES) {
                            // Checksummed first: that pass brings the chunk into the cache
                            // the kernel then copies it from (one read from memory per
                            // byte, as a plain socket copy). Written in between, the chunk
                            // fails the receiver's check, which then asks for the tensor
                            // again, staged.
                            crc.update(src);
                            write(src)?;
                        }
                    } else {
                        grow(&mut staging, len);
                        for src in bytes.chunks(PIECE_BYTES) {
                            // One copy, checksummed and sent: memory the owner changes
                            // outside its lock (running statistics updated by a concurrent
                            // forward) cannot make the bytes sent differ from the bytes
                            // checksummed.
                            let piece = &mut staging[..src.len()];
                            piece.copy_from_slice(src);
                            crc.update(piece);
                            write(piece)?;
                        }
                    }
                }
            }
            Source::Staged { len } => {
                grow(&mut staging, len);
                let mut offset = 0usize;
                while offset < len {
                    let n = (len - offset).min(staging.len());
                    let piece = &mut staging[..n];
                    offer
                        .hooks
                        .stage(index, offset as u64, piece)
                        .map_err(StreamError::Stage)?;
                    crc.update(piece);
                    write(piece)?;
                    offset += n;
                }
            }
        }
        let c = crc.finalize().to_le_bytes();
        crcs.extend_from_slice(&c);
        write(&c)?;
    }
    write(&wire::range_trailer((end - start) as u64, &crcs))?;
    Ok(sent)
}
