//! The receiving side: pulls ranges of an offered state over parallel connections, writing
//! every piece straight into its destination memory.
//!
//! A [`Fetch`] is one receive. It can be broken from another thread ([`Fetch::abort`], e.g.
//! when the source is declared lost): every connection is shut down, so blocked reads return
//! at once. A source that dies ends its streams with EOF or a reset, which fails the fetch at
//! once; one that stops answering fails it at the deadline.
//!
//! Ranges are asked for `direct` (see [`wire::Request::direct`]): the source sends tensor
//! memory without staging a copy, and a tensor whose checksum does not match (written while
//! it was sent, or damaged on the way) is fetched once more, alone and staged, after its
//! range; if that copy does not match either, the fetch fails.

use std::collections::HashMap;
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wire::{self, Request};

/// Bytes read per call before checksumming them (small enough to still be in cache).
pub const READ_PIECE_BYTES: usize = 512 << 10;
/// Most connections one fetch opens (the source serves a bounded number of streams).
pub const MAX_STREAMS_PER_FETCH: usize = 16;
/// Longest single connection attempt (an abort is noticed between attempts).
const CONNECT_SLICE: Duration = Duration::from_secs(1);
/// Longest pause between two attempts at a source that answered "busy".
const BUSY_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Where one tensor's bytes go.
#[derive(Debug, Clone, Copy)]
pub struct Dest {
    /// Address of the first byte.
    pub addr: usize,
    /// Number of bytes (must equal the tensor's length in the header).
    pub len: usize,
}

/// What to fetch and from where.
#[derive(Debug, Clone)]
pub struct FetchSpec {
    /// `host:port` of the source's data server.
    pub addr: String,
    /// The job's shared secret, when it has one.
    pub token: Option<String>,
    /// The step to heal to.
    pub step: i64,
    /// The offer's generation id (from the header).
    pub gen: String,
    /// Disjoint `[start, end)` tensor ranges, one connection each.
    pub ranges: Vec<(usize, usize)>,
    /// Deadline of the whole fetch.
    pub deadline: Instant,
}

/// Why a fetch failed. Nothing received is valid then: the caller must not use it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    /// The deadline passed.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The source could not be reached.
    #[error("could not connect: {0}")]
    Connect(String),
    /// The stream ended early or broke (the source died or closed it).
    #[error("stream broke: {0}")]
    Broken(String),
    /// The bytes do not check out (CRC, framing, lengths).
    #[error("corrupted stream: {0}")]
    Corrupt(String),
    /// The source answered with a refusal.
    #[error("refused ({status}): {message}")]
    Refused {
        /// The reply status (see `wire::STATUS_*`).
        status: u32,
        /// The source's explanation.
        message: String,
    },
    /// [`Fetch::abort`] was called.
    #[error("aborted")]
    Aborted,
}

/// One receive in progress (see the module doc).
#[derive(Default)]
pub struct Fetch {
    aborted: AtomicBool,
    failed: AtomicBool,
    /// Open connections by id (so `abort` can shut them down), dropped when done.
    socks: Mutex<(u64, HashMap<u64, TcpStream>)>,
}

impl Fetch {
    /// A fetch not started yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Breaks the fetch: its connections are shut down and it fails with
    /// [`FetchError::Aborted`]. Safe from any thread, before or during [`Fetch::run`].
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.stop_all();
    }

    fn stop_all(&self) {
        for s in self
            .socks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .values()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn stopped(&self) -> bool {
        self.aborted.load(Ordering::SeqCst) || self.failed.load(Ordering::SeqCst)
    }

    /// Makes `s` reachable by `abort` until the returned registration is dropped.
    fn register(&self, s: &TcpStream) -> Result<Registered<'_>, FetchError> {
        let clone = s
            .try_clone()
            .map_err(|e| FetchError::Connect(e.to_string()))?;
        let id = {
            let mut socks = self.socks.lock().unwrap_or_else(|e| e.into_inner());
            socks.0 += 1;
            let id = socks.0;
            socks.1.insert(id, clone);
            id
        };
        let registered = Registered { fetch: self, id };
        if self.stopped() {
            let _ = s.shutdown(Shutdown::Both);
            return Err(FetchError::Aborted);
        }
        Ok(registered)
    }

    /// Fetches every range of `spec` into `dests` (indexed by tensor), one connection per
    /// range, in parallel. Returns the number of tensor bytes received.
    ///
    /// # Safety
    /// Every `dests[i]` must be valid for writes of `len` bytes for the whole call and not
    /// overlap any other destination; nothing else may access that memory meanwhile.
    pub unsafe fn run(&self, spec: &FetchSpec, dests: &[Dest]) -> Result<u64, FetchError> {
        check_ranges(&spec.ranges, dests)?;
        let addrs: Vec<SocketAddr> = spec
            .addr
            .to_socket_addrs()
            .map_err(|e| FetchError::Connect(format!("{}: {e}", spec.addr)))?
            .collect();
        if addrs.is_empty() {
            return Err(FetchError::Connect(format!(
                "{} resolves to nothing",
                spec.addr
            )));
        }
        let first_error: Mutex<Option<FetchError>> = Mutex::new(None);
        std::thread::scope(|scope| {
            for &(start, end) in &spec.ranges {
                let (addrs, first_error) = (&addrs, &first_error);
                scope.spawn(move || {
                    let r = self
                        .while_busy(spec, || {
                            // SAFETY: forwarded from this function's contract; ranges are
                            // disjoint.
                            unsafe { self.fetch_range_once(spec, addrs, start, end, dests, true) }
                        })
                        // SAFETY: as above; the torn tensors are within this range.
                        .and_then(|torn| unsafe { self.refetch(spec, addrs, &torn, dests) });
                    if let Err(e) = r {
                        let mut first = first_error.lock().unwrap_or_else(|e| e.into_inner());
                        // The first real failure wins over the breakage it causes elsewhere.
                        if first.is_none() && !self.failed.load(Ordering::SeqCst) {
                            *first = Some(e);
                        }
                        self.failed.store(true, Ordering::SeqCst);
                        drop(first);
                        self.stop_all();
                    }
                });
            }
        });
        if self.aborted.load(Ordering::SeqCst) {
            return Err(FetchError::Aborted);
        }
        if let Some(e) = first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(e);
        }
        Ok(spec
            .ranges
            .iter()
            .flat_map(|&(a, b)| dests[a..b].iter())
            .map(|d| d.len as u64)
            .sum())
    }

    /// Runs `attempt` (one [`Fetch::fetch_range_once`]), again while the source answers
    /// "busy" (all its stream slots in use, e.g. serving many healing groups at once), until
    /// the deadline.
    fn while_busy<T>(
        &self,
        spec: &FetchSpec,
        mut attempt: impl FnMut() -> Result<T, FetchError>,
    ) -> Result<T, FetchError> {
        let mut backoff = Duration::from_millis(20);
        loop {
            match attempt() {
                Err(FetchError::Refused {
                    status: wire::STATUS_UNAVAILABLE,
                    message,
                }) => {
                    let left = spec.deadline.saturating_duration_since(Instant::now());
                    if left <= backoff {
                        return Err(FetchError::Timeout(format!(
                            "{} stayed busy until the deadline: {message}",
                            spec.addr
                        )));
                    }
                    // Sleep in short slices so an abort is seen promptly.
                    let until = Instant::now() + backoff;
                    while Instant::now() < until {
                        if self.stopped() {
                            return Err(FetchError::Aborted);
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    backoff = (backoff * 2).min(BUSY_BACKOFF_MAX);
                }
                r => return r,
            }
        }
    }

    /// Connects to the first address that answers, in attempts of at most
    /// [`CONNECT_SLICE`] so an abort is seen within about that long.
    fn connect(&self, spec: &FetchSpec, addrs: &[SocketAddr]) -> Result<TcpStream, FetchError> {
        let mut last = String::new();
        for addr in addrs {
            loop {
                if self.stopped() {
                    return Err(FetchError::Aborted);
                }
                let remaining = remaining(spec, "connecting")?;
                match TcpStream::connect_timeout(addr, remaining.min(CONNECT_SLICE)) {
                    Ok(s) => return Ok(s),
                    Err(e) if is_timeout(&e) => {
                        if remaining <= CONNECT_SLICE {
                            return Err(FetchError::Timeout(format!("connecting to {addr}")));
                        }
                    }
                    Err(e) => {
                        last = format!("{addr}: {e}");
                        break;
                    }
                }
            }
        }
        Err(FetchError::Connect(last))
    }

    /// Fetches each tensor of `torn` again, alone and staged by the source (not `direct`),
    /// so what arrives is what the source checksummed even while it writes that tensor.
    ///
    /// # Safety
    /// As [`Fetch::run`], for the tensors of `torn`.
    unsafe fn refetch(
        &self,
        spec: &FetchSpec,
        addrs: &[SocketAddr],
        torn: &[usize],
        dests: &[Dest],
    ) -> Result<(), FetchError> {
        for &i in torn {
            self.while_busy(spec, || {
                // SAFETY: forwarded from this function's contract.
                unsafe { self.fetch_range_once(spec, addrs, i, i + 1, dests, false) }
            })
            .map_err(|e| match e {
                e @ (FetchError::Aborted
                | FetchError::Timeout(_)
                | FetchError::Corrupt(_)
                | FetchError::Refused { .. }) => e,
                // The mismatch is what went wrong; say so, and why it could not be repaired.
                e => FetchError::Corrupt(format!(
                    "checksum mismatch in tensor {i}, and fetching it again failed: {e}"
                )),
            })?;
        }
        Ok(())
    }

    /// Fetches tensors `[start, end)` over one connection. With `direct`, returns the
    /// tensors whose checksum did not match (for [`Fetch::refetch`]); without, such a
    /// tensor fails the fetch.
    unsafe fn fetch_range_once(
        &self,
        spec: &FetchSpec,
        addrs: &[SocketAddr],
        start: usize,
        end: usize,
        dests: &[Dest],
        direct: bool,
    ) -> Result<Vec<usize>, FetchError> {
        if self.stopped() {
            return Err(FetchError::Aborted);
        }
        let stream = self.connect(spec, addrs)?;
        let _registered = self.register(&stream)?;
        let _ = stream.set_nodelay(true);
        let mut io = Io {
            fetch: self,
            spec,
            stream: &stream,
            refresh: wire::TimeoutRefresh::default(),
        };
        let req = Request {
            token: spec.token.clone(),
            step: spec.step,
            gen: spec.gen.clone(),
            start: start as u64,
            end: end as u64,
            direct,
        };
        // Until the source answers, a broken connection means it could not serve at all.
        let unanswered = |e: FetchError| match e {
            FetchError::Broken(m) => FetchError::Connect(m),
            e => e,
        };
        io.set_timeouts()?;
        wire::write_request(&mut &stream, &req)
            .map_err(|e| unanswered(io.error(e, "sending the request")))?;
        io.set_timeouts()?;
        let (status, message) = wire::read_reply(&mut &stream).map_err(|e| {
            let e = if e.kind() == ErrorKind::UnexpectedEof {
                std::io::Error::new(ErrorKind::UnexpectedEof, "closed before answering")
            } else {
                e
            };
            unanswered(io.error(e, "the reply"))
        })?;
        if status != wire::STATUS_OK {
            return Err(FetchError::Refused { status, message });
        }
        let mut prefix = [0u8; 24];
        io.read_exact(&mut prefix, "the range prefix")?;
        if prefix != wire::range_prefix(start as u64, end as u64) {
            return Err(FetchError::Corrupt(format!(
                "expected the frame of tensors [{start}, {end})"
            )));
        }
        let mut crcs = Vec::with_capacity(4 * (end - start));
        let mut torn = Vec::new();
        for (i, dest) in dests.iter().enumerate().take(end).skip(start) {
            let out: &mut [u8] = if dest.len == 0 {
                &mut [] // an empty tensor's address may be null
            } else {
                // SAFETY: the caller's contract on `dests` (checked non-null in `run`).
                unsafe { std::slice::from_raw_parts_mut(dest.addr as *mut u8, dest.len) }
            };
            let mut crc = crc32fast::Hasher::new();
            io.read_checksummed(out, &mut crc)?;
            let mut got = [0u8; 4];
            io.read_exact(&mut got, "a tensor checksum")?;
            if u32::from_le_bytes(got) != crc.finalize() {
                if !direct {
                    return Err(FetchError::Corrupt(format!(
                        "checksum mismatch in tensor {i}"
                    )));
                }
                // The frame stays in step (every length is known): read on, fetch it later.
                torn.push(i);
            }
            crcs.extend_from_slice(&got);
        }
        let mut trailer = [0u8; 20];
        io.read_exact(&mut trailer, "the range trailer")?;
        if trailer != wire::range_trailer((end - start) as u64, &crcs) {
            return Err(FetchError::Corrupt("bad range trailer".into()));
        }
        let mut extra = [0u8; 1];
        match (&stream).read(&mut extra) {
            Ok(0) => Ok(torn),
            Ok(_) => Err(FetchError::Corrupt("trailing bytes after the range".into())),
            Err(e) => Err(io.error(e, "closing")),
        }
    }
}

/// A connection registered with its fetch; unregistered (its descriptor closed) on drop.
struct Registered<'a> {
    fetch: &'a Fetch,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut socks = self.fetch.socks.lock().unwrap_or_else(|e| e.into_inner());
        socks.1.remove(&self.id);
    }
}

struct Io<'a> {
    fetch: &'a Fetch,
    spec: &'a FetchSpec,
    stream: &'a TcpStream,
    refresh: wire::TimeoutRefresh,
}

impl Io<'_> {
    /// Fails once the deadline has passed; else bounds the socket's blocking calls by the
    /// time left (see [`wire::TimeoutRefresh`]).
    fn set_timeouts(&mut self) -> Result<(), FetchError> {
        let r = remaining(self.spec, "receiving")?;
        if !self.refresh.due(Instant::now()) {
            return Ok(());
        }
        self.stream
            .set_read_timeout(Some(r))
            .and_then(|_| self.stream.set_write_timeout(Some(r)))
            .map_err(|e| FetchError::Broken(e.to_string()))
    }

    fn read_exact(&mut self, buf: &mut [u8], what: &str) -> Result<(), FetchError> {
        self.read_seen(buf, what, usize::MAX, |_| {})
    }

    /// Fills `buf` from the stream, adding every byte to `crc` as it arrives.
    ///
    /// Each read asks for everything still missing (at most [`READ_PIECE_BYTES`]), as a
    /// plain socket copy does, and checksums the bytes it returned at once, while they are
    /// still in cache: a read that returns early is not followed by another read into the
    /// same piece before anything is checksummed, and no byte is checksummed from memory.
    fn read_checksummed(
        &mut self,
        buf: &mut [u8],
        crc: &mut crc32fast::Hasher,
    ) -> Result<(), FetchError> {
        self.read_seen(buf, "tensor bytes", READ_PIECE_BYTES, |b| crc.update(b))
    }

    /// Fills `buf` (`what`, for errors) with reads of at most `piece` bytes, each bounded by
    /// the fetch's deadline, handing `seen` the bytes of each read as it returns.
    fn read_seen(
        &mut self,
        buf: &mut [u8],
        what: &str,
        piece: usize,
        mut seen: impl FnMut(&[u8]),
    ) -> Result<(), FetchError> {
        let mut got = 0;
        while got < buf.len() {
            self.set_timeouts()?;
            let end = buf.len().min(got.saturating_add(piece));
            match (&*self.stream).read(&mut buf[got..end]) {
                Ok(0) => {
                    if self.fetch.stopped() {
                        return Err(FetchError::Aborted);
                    }
                    return Err(FetchError::Broken(format!(
                        "the source closed the stream while sending {what}"
                    )));
                }
                Ok(n) => {
                    seen(&buf[got..got + n]);
                    got += n;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.error(e, what)),
            }
        }
        Ok(())
    }

    fn error(&self, e: std::io::Error, what: &str) -> FetchError {
        if self.fetch.stopped() {
            FetchError::Aborted
        } else if is_timeout(&e) {
            FetchError::Timeout(format!("{what} from {}", self.spec.addr))
        } else if e.kind() == ErrorKind::InvalidData {
            FetchError::Corrupt(e.to_string())
        } else {
            FetchError::Broken(format!("{what} from {}: {e}", self.spec.addr))
        }
    }
}

/// Ranges within `dests`, at most [`MAX_STREAMS_PER_FETCH`] of them, disjoint, and every
/// non-empty destination they cover non-null and disjoint from the others.
fn check_ranges(ranges: &[(usize, usize)], dests: &[Dest]) -> Result<(), FetchError> {
    let bad = |m: String| Err(FetchError::Corrupt(m));
    if ranges.len() > MAX_STREAMS_PER_FETCH {
        return bad(format!(
            "{} ranges asked; a fetch opens at most {MAX_STREAMS_PER_FETCH} streams",
            ranges.len()
        ));
    }
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    let mut last_end = 0;
    for &(a, b) in &sorted {
        if a > b || b > dests.len() {
            return bad(format!("range [{a}, {b}) out of {} tensors", dests.len()));
        }
        if a < last_end {
            return bad(format!("range [{a}, {b}) overlaps another range"));
        }
        last_end = b;
    }
    let mut spans: Vec<(usize, usize)> = sorted
        .iter()
        .flat_map(|&(a, b)| dests[a..b].iter())
        .filter(|d| d.len > 0)
        .map(|d| (d.addr, d.addr.saturating_add(d.len)))
        .collect();
    if spans.iter().any(|&(a, _)| a == 0) {
        return bad("a destination has a null address".into());
    }
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[1].0 < w[0].1) {
        return bad("two destinations overlap".into());
    }
    Ok(())
}

fn remaining(spec: &FetchSpec, what: &str) -> Result<Duration, FetchError> {
    let r = spec.deadline.saturating_duration_since(Instant::now());
    if r.is_zero() {
        return Err(FetchError::Timeout(format!("{what} from {}", spec.addr)));
    }
    Ok(r)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    use super::*;
    use crate::checkpoint::server::{
        DataServer, EnterError, Offer, OfferHooks, Source, DIRECT_WRITE_BYTES,
    };
    use crate::security::Token;

    /// The owner's hooks: an optional state version (bumped by a write), compared with the
    /// version the offer was made at.
    #[derive(Default)]
    struct Hooks {
        version: Option<(Arc<AtomicU64>, u64)>,
        /// Streams wait in `enter` until the flag is set (holding their stream slot).
        gate: Option<Arc<(Mutex<bool>, std::sync::Condvar)>>,
        entered: Arc<AtomicU64>,
        /// Told when a stream that entered lets go of the state (its guard is dropped).
        released: Option<Mutex<std::sync::mpsc::Sender<Instant>>>,
    }
    /// A stream's hold on the state; tells `released`, if any, when it ends.
    struct Guard(Option<std::sync::mpsc::Sender<Instant>>);
    impl Drop for Guard {
        fn drop(&mut self) {
            if let Some(tx) = &self.0 {
                let _ = tx.send(Instant::now());
            }
        }
    }
    impl OfferHooks for Hooks {
        fn enter(&self) -> Result<Box<dyn Send>, EnterError> {
            self.entered.fetch_add(1, Ordering::SeqCst);
            if let Some(gate) = &self.gate {
                let mut open = gate.0.lock().unwrap();
                while !*open {
                    open = gate.1.wait(open).unwrap();
                }
            }
            match &self.version {
                Some((now, offered)) if now.load(Ordering::SeqCst) != *offered => {
                    Err(EnterError::Changed("written since".into()))
                }
                _ => {
                    let released = self.released.as_ref();
                    Ok(Box::new(Guard(
                        released.map(|tx| tx.lock().unwrap().clone()),
                    )))
                }
            }
        }
        fn stage(&self, index: usize, offset: u64, out: &mut [u8]) -> Result<(), String> {
            for (k, b) in out.iter_mut().enumerate() {
                *b = (index as u64 + offset + k as u64) as u8;
            }
            Ok(())
        }
    }

    fn offer(server: &DataServer, data: &[Vec<u8>], staged_len: usize) {
        offer_with(server, data, staged_len, Hooks::default());
    }

    fn offer_with(server: &DataServer, data: &[Vec<u8>], staged_len: usize, hooks: Hooks) {
        let mut sources: Vec<Source> = data
            .iter()
            .map(|v| Source::Memory {
                addr: v.as_ptr() as usize,
                len: v.len(),
            })
            .collect();
        sources.push(Source::Staged { len: staged_len });
        // SAFETY: `data` outlives the server in every test below.
        unsafe { offer_sources(server, sources, hooks) };
    }

    /// Offers `sources` as step 3 of generation "g1".
    ///
    /// # Safety
    /// The memory the sources name must outlive the server.
    unsafe fn offer_sources(server: &DataServer, sources: Vec<Source>, hooks: Hooks) {
        let o = unsafe {
            Offer::new(
                3,
                "g1".into(),
                sources,
                Duration::from_secs(10),
                Box::new(hooks),
            )
        };
        server.offer(o);
    }

    /// A fetch of step 3 of generation "g1" from `addr`, with a ten-second deadline.
    fn spec_at(addr: impl ToString, token: Option<&str>, ranges: Vec<(usize, usize)>) -> FetchSpec {
        FetchSpec {
            addr: addr.to_string(),
            token: token.map(str::to_string),
            step: 3,
            gen: "g1".into(),
            ranges,
            deadline: Instant::now() + Duration::from_secs(10),
        }
    }

    fn spec(server: &DataServer, token: Option<&str>, ranges: Vec<(usize, usize)>) -> FetchSpec {
        spec_at(server.local_addr(), token, ranges)
    }

    fn dests_of(out: &mut [Vec<u8>]) -> Vec<Dest> {
        out.iter_mut()
            .map(|v| Dest {
                addr: v.as_mut_ptr() as usize,
                len: v.len(),
            })
            .collect()
    }

    /// A source that is no data server: one accepted connection handed to `serve`.
    fn fake_source(
        serve: impl FnOnce(TcpStream) + Send + 'static,
    ) -> (SocketAddr, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = std::thread::spawn(move || serve(listener.accept().unwrap().0));
        (addr, t)
    }

    #[test]
    fn fetches_memory_and_staged_tensors_over_parallel_streams() {
        let token = Token::new("s3cret").unwrap();
        let server = DataServer::bind("127.0.0.1", Some(token), Duration::from_secs(5)).unwrap();
        // The first tensor spans three of a direct stream's writes, the last one partial; no
        // two 256-byte blocks of a tensor are alike, so a chunk sent twice or out of place
        // shows.
        let len = |i: usize| {
            if i == 0 {
                2 * DIRECT_WRITE_BYTES + 5
            } else {
                (3 << 20) + i
            }
        };
        let byte = |i: usize, k: usize| ((k ^ (k >> 8) ^ (k >> 16)).wrapping_mul(7) + i) as u8;
        let data: Vec<Vec<u8>> = (0..5)
            .map(|i| (0..len(i)).map(|k| byte(i, k)).collect())
            .collect();
        let staged_len = (2 << 20) + 3;
        let entered = Arc::new(AtomicU64::new(0));
        let hooks = Hooks {
            entered: entered.clone(),
            ..Hooks::default()
        };
        offer_with(&server, &data, staged_len, hooks);
        let mut out: Vec<Vec<u8>> = data.iter().map(|v| vec![0u8; v.len()]).collect();
        out.push(vec![0u8; staged_len]);
        let dests = dests_of(&mut out);
        let f = Fetch::new();
        let n = unsafe {
            f.run(
                &spec(&server, Some("s3cret"), vec![(0, 2), (2, 4), (4, 6)]),
                &dests,
            )
        }
        .unwrap();
        assert_eq!(n, out.iter().map(|v| v.len() as u64).sum::<u64>());
        assert_eq!(&out[..5], &data[..]);
        // One stream per range, none fetched again: every direct tensor's checksum held.
        assert_eq!(entered.load(Ordering::SeqCst), 3);
        let expect: Vec<u8> = (0..staged_len).map(|k| (5 + k) as u8).collect();
        assert_eq!(out[5], expect);

        // Wrong token, wrong generation: refused, nothing served.
        let e = unsafe { Fetch::new().run(&spec(&server, Some("nope"), vec![(0, 1)]), &dests) };
        assert!(
            matches!(e, Err(FetchError::Refused { status: 401, .. })),
            "{e:?}"
        );
        let mut s = spec(&server, Some("s3cret"), vec![(0, 1)]);
        s.gen = "other".into();
        let e = unsafe { Fetch::new().run(&s, &dests) };
        assert!(
            matches!(e, Err(FetchError::Refused { status: 409, .. })),
            "{e:?}"
        );

        // Revoked: refused too.
        assert!(server.revoke());
        let e = unsafe { Fetch::new().run(&spec(&server, Some("s3cret"), vec![(0, 1)]), &dests) };
        assert!(
            matches!(e, Err(FetchError::Refused { status: 409, .. })),
            "{e:?}"
        );
        server.shutdown();
    }

    #[test]
    fn a_state_written_after_its_offer_is_never_served() {
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(5)).unwrap();
        let data: Vec<Vec<u8>> = vec![vec![1u8; 1000], vec![2u8; 1000]];
        let version = Arc::new(AtomicU64::new(7));
        let hooks = Hooks {
            version: Some((version.clone(), 7)),
            ..Hooks::default()
        };
        offer_with(&server, &data, 10, hooks);
        let mut out: Vec<Vec<u8>> = vec![vec![0u8; 1000], vec![0u8; 1000], vec![0u8; 10]];
        let dests = dests_of(&mut out);
        let ok = unsafe { Fetch::new().run(&spec(&server, None, vec![(0, 1), (1, 3)]), &dests) };
        assert!(ok.is_ok(), "{ok:?}");
        // A write: no range of the offer is served any more, whatever was sent before.
        version.fetch_add(1, Ordering::SeqCst);
        let e = unsafe { Fetch::new().run(&spec(&server, None, vec![(1, 3)]), &dests) };
        assert!(
            matches!(&e, Err(FetchError::Refused { status: 409, message }) if message.contains("changed")),
            "{e:?}"
        );
        server.shutdown();
    }

    #[test]
    fn more_streams_than_slots_queue_instead_of_failing() {
        use crate::checkpoint::server::MAX_STREAMS;
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(20)).unwrap();
        let data: Vec<Vec<u8>> = (0..MAX_STREAMS_PER_FETCH)
            .map(|i| vec![i as u8; 10_000])
            .collect();
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let entered = Arc::new(AtomicU64::new(0));
        let hooks = Hooks {
            gate: Some(gate.clone()),
            entered: entered.clone(),
            ..Hooks::default()
        };
        offer_with(&server, &data, 0, hooks);
        // Five healing groups at once, 16 streams each: more than the server's slots.
        let fetches = 5;
        assert!(fetches * MAX_STREAMS_PER_FETCH > MAX_STREAMS);
        let ranges: Vec<(usize, usize)> = (0..MAX_STREAMS_PER_FETCH).map(|i| (i, i + 1)).collect();
        let results = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..fetches)
                .map(|_| {
                    let s = spec(&server, None, ranges.clone());
                    scope.spawn(move || {
                        let mut out: Vec<Vec<u8>> = (0..=MAX_STREAMS_PER_FETCH)
                            .map(|i| vec![0u8; if i < MAX_STREAMS_PER_FETCH { 10_000 } else { 0 }])
                            .collect();
                        let dests = dests_of(&mut out);
                        let r = unsafe { Fetch::new().run(&s, &dests) };
                        (r, out)
                    })
                })
                .collect();
            // Every slot is taken by a stream held in `enter`; the rest wait for one.
            let t0 = Instant::now();
            while entered.load(Ordering::SeqCst) < MAX_STREAMS as u64 {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "streams never entered"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(entered.load(Ordering::SeqCst), MAX_STREAMS as u64);
            *gate.0.lock().unwrap() = true;
            gate.1.notify_all();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (r, out) in results {
            assert!(r.is_ok(), "{r:?}");
            assert_eq!(&out[..MAX_STREAMS_PER_FETCH], &data[..]);
        }
        server.shutdown();
    }

    #[test]
    fn silent_connections_cannot_starve_a_receiver() {
        use crate::checkpoint::server::MAX_CONNECTIONS;
        // A one-second request timeout: connections that never send a request are cut then.
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(1)).unwrap();
        let data: Vec<Vec<u8>> = vec![vec![5u8; 100_000]];
        offer(&server, &data, 0);
        let silent: Vec<TcpStream> = (0..MAX_CONNECTIONS + 20)
            .filter_map(|_| TcpStream::connect(server.local_addr()).ok())
            .collect();
        let mut out: Vec<Vec<u8>> = vec![vec![0u8; 100_000], vec![]];
        let dests = dests_of(&mut out);
        let r = unsafe { Fetch::new().run(&spec(&server, None, vec![(0, 2)]), &dests) };
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(out[0], data[0]);
        // Shutdown ends every connection thread, even with the peers still connected.
        let more: Vec<TcpStream> = (0..10)
            .filter_map(|_| TcpStream::connect(server.local_addr()).ok())
            .collect();
        server.shutdown();
        assert_eq!(server.connections(), 0);
        drop((silent, more));
    }

    #[test]
    fn overlapping_or_too_many_ranges_are_refused_before_connecting() {
        let mut out: Vec<Vec<u8>> = vec![vec![0u8; 8], vec![0u8; 8], vec![]];
        let mut dests = dests_of(&mut out);
        let mut s = spec_at("127.0.0.1:1", None, vec![(0, 2), (1, 3)]);
        let e = unsafe { Fetch::new().run(&s, &dests) };
        assert!(
            matches!(&e, Err(FetchError::Corrupt(m)) if m.contains("overlaps")),
            "{e:?}"
        );
        s.ranges = (0..=MAX_STREAMS_PER_FETCH).map(|_| (0, 0)).collect();
        let e = unsafe { Fetch::new().run(&s, &dests) };
        assert!(
            matches!(&e, Err(FetchError::Corrupt(m)) if m.contains("at most")),
            "{e:?}"
        );
        s.ranges = vec![(0, 1), (1, 3)];
        dests[1].addr = dests[0].addr + 4;
        let e = unsafe { Fetch::new().run(&s, &dests) };
        assert!(
            matches!(&e, Err(FetchError::Corrupt(m)) if m.contains("overlap")),
            "{e:?}"
        );
    }

    #[test]
    fn memory_changing_outside_the_lock_never_fails_an_honest_sender() {
        // Buffers the owner updates without the write lock (running statistics of a
        // concurrent forward): what is sent is what was checksummed, so the CRC holds.
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(5)).unwrap();
        let words: Vec<AtomicU64> = (0..(4 << 20) / 8).map(AtomicU64::new).collect();
        let len = words.len() * 8;
        let sources = vec![Source::Memory {
            addr: words.as_ptr() as usize,
            len,
        }];
        // SAFETY: `words` outlives the server; it changes under the offer on purpose.
        unsafe { offer_sources(&server, sources, Hooks::default()) };
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for w in words.iter().step_by(509) {
                        w.fetch_add(k, Ordering::Relaxed);
                    }
                    k += 1;
                }
            });
            let results: Vec<_> = (0..5)
                .map(|_| {
                    let mut out = vec![vec![0u8; len]];
                    let dests = dests_of(&mut out);
                    unsafe { Fetch::new().run(&spec(&server, None, vec![(0, 1)]), &dests) }
                })
                .collect();
            stop.store(true, Ordering::Relaxed);
            for r in results {
                assert!(r.is_ok(), "{r:?}");
            }
        });
        server.shutdown();
    }

    /// A proxy that flips the byte at `flip_at` of the server's answer, or cuts the answer
    /// at `cut_at`: on every connection, or (`every` false) on the first only. Counts the
    /// connections it accepted.
    fn tamper(
        target: SocketAddr,
        flip_at: Option<usize>,
        cut_at: Option<usize>,
        every: bool,
    ) -> (SocketAddr, Arc<AtomicU64>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let first = count.fetch_add(1, Ordering::SeqCst) == 0;
                let (flip_at, cut_at) = if first || every {
                    (flip_at, cut_at)
                } else {
                    (None, None)
                };
                std::thread::spawn(move || proxy(client, target, flip_at, cut_at, None));
            }
        });
        (addr, accepted)
    }

    /// Forwards the request, then the answer (damaged as [`tamper`] says). At `cut_at`,
    /// with `hold`, both connections stay open and silent until `hold` is signalled.
    fn proxy(
        mut client: TcpStream,
        target: SocketAddr,
        flip_at: Option<usize>,
        cut_at: Option<usize>,
        hold: Option<std::sync::mpsc::Receiver<()>>,
    ) {
        let mut server = TcpStream::connect(target).unwrap();
        let mut req = vec![0u8; 4096];
        let n = client.read(&mut req).unwrap();
        server.write_all(&req[..n]).unwrap();
        let mut pos = 0usize;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match server.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut n = n;
            if let Some(cut) = cut_at {
                if pos + n >= cut {
                    n = cut - pos;
                    let _ = client.write_all(&buf[..n]);
                    if let Some(hold) = hold {
                        let _ = hold.recv_timeout(Duration::from_secs(30));
                    }
                    break;
                }
            }
            if let Some(f) = flip_at {
                if (pos..pos + n).contains(&f) {
                    buf[f - pos] ^= 0x40;
                }
            }
            if client.write_all(&buf[..n]).is_err() {
                break;
            }
            pos += n;
        }
    }

    #[test]
    fn a_tensor_damaged_on_a_direct_stream_is_fetched_again_whole() {
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(5)).unwrap();
        let data: Vec<Vec<u8>> = vec![vec![7u8; 100_000], vec![9u8; 50_000]];
        offer(&server, &data, 10);
        // Reply (16) + range prefix (24) come first: one flip in each memory tensor.
        for flip in [40 + 5_000, 40 + 100_000 + 4 + 7] {
            let mut out: Vec<Vec<u8>> = vec![vec![0u8; 100_000], vec![0u8; 50_000], vec![0u8; 10]];
            let dests = dests_of(&mut out);
            let (addr, accepted) = tamper(server.local_addr(), Some(flip), None, false);
            let mut s = spec(&server, None, vec![(0, 3)]);
            s.addr = addr.to_string();
            let r = unsafe { Fetch::new().run(&s, &dests) };
            assert!(r.is_ok(), "flip at {flip}: {r:?}");
            assert_eq!(&out[..2], &data[..], "flip at {flip}");
            assert_eq!(out[2], (0..10u8).map(|k| 2 + k).collect::<Vec<_>>());
            // The range, then the damaged tensor alone.
            assert_eq!(accepted.load(Ordering::SeqCst), 2, "flip at {flip}");
        }
        server.shutdown();
    }

    #[test]
    fn tampered_or_cut_streams_fail_and_say_why() {
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(5)).unwrap();
        let data: Vec<Vec<u8>> = vec![vec![7u8; 100_000], vec![9u8; 50_000]];
        offer(&server, &data, 10);
        let mut out: Vec<Vec<u8>> = vec![vec![0u8; 100_000], vec![0u8; 50_000], vec![0u8; 10]];
        let dests = dests_of(&mut out);
        // Reply (16) + range prefix (24) come first: flip inside tensor 0, a CRC, the trailer.
        for flip in [40 + 5_000, 40 + 100_000 + 1, 40 + 150_008 + 10 + 4 + 3] {
            let mut s = spec(&server, None, vec![(0, 3)]);
            // Damaged on every connection: the tensor fetched again is damaged too.
            s.addr = tamper(server.local_addr(), Some(flip), None, true)
                .0
                .to_string();
            let e = unsafe { Fetch::new().run(&s, &dests) };
            assert!(
                matches!(e, Err(FetchError::Corrupt(_))),
                "flip at {flip}: {e:?}"
            );
        }
        for cut in [8, 30, 70_000] {
            let mut s = spec(&server, None, vec![(0, 3)]);
            s.addr = tamper(server.local_addr(), None, Some(cut), true)
                .0
                .to_string();
            let e = unsafe { Fetch::new().run(&s, &dests) };
            let want_connect = cut < 16;
            assert!(
                if want_connect {
                    matches!(e, Err(FetchError::Connect(_)))
                } else {
                    matches!(e, Err(FetchError::Broken(_)))
                },
                "cut at {cut}: {e:?}"
            );
        }
        server.shutdown();
    }

    #[test]
    fn a_source_going_silent_mid_tensor_fails_the_fetch_at_its_deadline() {
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(30)).unwrap();
        let data: Vec<Vec<u8>> = vec![vec![7u8; 4 << 20]];
        offer(&server, &data, 10);
        // Forwards the reply, the range prefix and 1 MiB of the tensor, then holds both
        // connections open without a byte more until the test ends.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let target = server.local_addr();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let stalling = std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            proxy(client, target, None, Some(40 + (1 << 20)), Some(done_rx));
        });
        let mut out = vec![vec![0u8; 4 << 20], vec![0u8; 10]];
        let dests = dests_of(&mut out);
        let budget = Duration::from_millis(800);
        let s = FetchSpec {
            deadline: Instant::now() + budget,
            ..spec_at(addr, None, vec![(0, 2)])
        };
        let t0 = Instant::now();
        let e = unsafe { Fetch::new().run(&s, &dests) };
        let took = t0.elapsed();
        assert!(matches!(e, Err(FetchError::Timeout(_))), "{e:?}");
        // Ended by the deadline (give or take the timeout refresh), not by the source's
        // 30 s offer timeout or the proxy's release.
        assert!(took >= budget && took < budget * 5, "failed after {took:?}");
        let _ = done_tx.send(());
        stalling.join().unwrap();
        server.shutdown();
    }

    #[test]
    fn a_receiver_draining_slowly_but_steadily_is_cut_at_the_streams_deadline() {
        let server = DataServer::bind("127.0.0.1", None, Duration::from_secs(5)).unwrap();
        let data: Vec<Vec<u8>> = vec![vec![3u8; 6 * DIRECT_WRITE_BYTES]];
        let timeout = Duration::from_secs(1);
        let sources = vec![Source::Memory {
            addr: data[0].as_ptr() as usize,
            len: data[0].len(),
        }];
        let (tx, released) = std::sync::mpsc::channel();
        let hooks = Box::new(Hooks {
            released: Some(Mutex::new(tx)),
            ..Hooks::default()
        });
        // SAFETY: `data` outlives the server.
        let o = unsafe { Offer::new(3, "g1".into(), sources, timeout, hooks) };
        server.offer(o);
        // A small receive buffer, read 16 KiB every 20 ms (under 1 MB/s): one direct write
        // takes seconds to drain, always making progress.
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_recv_buffer_size(64 << 10).unwrap();
        sock.connect(&server.local_addr().into()).unwrap();
        let mut stream: TcpStream = sock.into();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let req = Request {
            token: None,
            step: 3,
            gen: "g1".into(),
            start: 0,
            end: 1,
            direct: true,
        };
        let t0 = Instant::now();
        wire::write_request(&mut stream, &req).unwrap();
        let (status, _) = wire::read_reply(&mut stream).unwrap();
        assert_eq!(status, wire::STATUS_OK);
        let mut got = 0usize;
        let mut buf = vec![0u8; 16 << 10];
        let at = loop {
            if let Ok(at) = released.try_recv() {
                break at;
            }
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => {
                    panic!("the stream ended, {got} bytes read, the state still held")
                }
                Ok(n) => got += n,
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the stream never let go"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let held = at - t0;
        // The stream let go at its deadline (give or take a socket timeout refresh), not
        // once the write in progress drained.
        assert!(
            held < timeout * 3,
            "the state was held {held:?} ({got} bytes read by then)"
        );
        assert!(got < data[0].len(), "the whole tensor arrived: {got} bytes");
        server.shutdown();
    }

    #[test]
    fn a_source_that_is_not_a_data_server_fails_clearly() {
        let (addr, t) = fake_source(|mut s| {
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n");
        });
        let mut out = vec![vec![0u8; 16]];
        let dests = dests_of(&mut out);
        let s = spec_at(addr, None, vec![(0, 1)]);
        let e = unsafe { Fetch::new().run(&s, &dests) }.unwrap_err();
        assert!(
            matches!(e, FetchError::Corrupt(ref m) if m.contains("not a torchft")),
            "{e:?}"
        );
        t.join().unwrap();
    }

    #[test]
    fn abort_breaks_a_fetch_stuck_on_a_silent_source() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (addr, t) = fake_source(move |_s| {
            let _ = rx.recv_timeout(Duration::from_secs(30));
        });
        let mut out = vec![vec![0u8; 16]];
        let dests = dests_of(&mut out);
        let s = FetchSpec {
            deadline: Instant::now() + Duration::from_secs(30),
            ..spec_at(addr, None, vec![(0, 1)])
        };
        let f = Fetch::new();
        let t0 = Instant::now();
        let e = std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                f.abort();
            });
            unsafe { f.run(&s, &dests) }
        });
        assert!(matches!(e, Err(FetchError::Aborted)), "{e:?}");
        assert!(t0.elapsed() < Duration::from_secs(10));
        let _ = tx.send(());
        t.join().unwrap();
    }
}
