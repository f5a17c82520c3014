"""HTTP checkpoint transport: every rank serves its live state, healing ranks pull it.

Two paths carry the tensor bytes:

- **native** (default, when the link is not TLS): the control exchange stays HTTP (the
  receiver fetches the JSON header, which names the source's data port), and the bytes move
  over the native data path (:mod:`torchft._torchft` ``CheckpointDataServer`` /
  ``CheckpointFetch``): streamed from the sender's tensor memory over several TCP
  connections, written straight into the receiver's tensors, CRC per tensor, the GIL
  released. With ``state_dict=`` the receiver writes into its own existing tensors.
- **HTTP** (TLS links, peers without a data port, ``native=False``): the stdlib server
  below streams the same frames over HTTP(S).

The sender runs a small threaded HTTP server (stdlib) listening on one address: that of the
heal interface (``TORCHFT_HEAL_IFNAME``, else gloo's or NCCL's interface variable), else that
of the host name the manager advertises (see :mod:`torchft.checkpointing._security` for
binding, the shared-secret token and TLS, which every request goes through). Between
``send_checkpoint(step)`` and ``disallow_checkpoint()`` it serves the state of that step,
encoded by :mod:`torchft.checkpointing._serialization` (JSON header + raw tensor bytes with
CRCs, never pickle). Receivers stream the body straight into tensor memory, either as one
request or as ``num_chunks`` parallel range requests.

Endpoints (``{base}`` is :meth:`HTTPTransport.metadata`)::

    GET {base}/{step}/full?wait=S          header frame + every tensor
    GET {base}/{step}/header?wait=S        header frame only
    GET {base}/{step}/range/{a}/{b}?gen=G  tensors [a, b) of the state identified by G

A request for a step that is not served yet waits up to ``wait`` seconds (the receiver may
ask before the source reached ``send_checkpoint``); a request for an older step than the
one served fails at once with 409. The training thread never serves: serving happens in
server threads with socket timeouts and a per-request deadline, and ``disallow_checkpoint``
aborts in-flight transfers instead of waiting for slow receivers.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import logging
import math
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

from torchft import _torchft
from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._security import (
    CheckpointAuthError,
    Endpoint,
    TransportSecurity,
    accept_connection,
    describe_tls_failure,
    endpoint,
)
from torchft.checkpointing.transport import CheckpointTransport, _timeout_from_env

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")
_F = TypeVar("_F", bound="_Abortable")

_BASE_PATH = "/checkpoint"
_MAX_ERROR_BODY = 64 << 10
# Parallel connections of a native receive when ``num_chunks`` is 0.
DEFAULT_STREAMS = 4
# Most connections of one native receive (the native fetch's own limit): a source serves
# a bounded number of streams at once, shared by every group healing from it.
MAX_STREAMS = 16
_NOT_OURS = (
    "this checkpoint server speaks torchft's typed checkpoint format (JSON header and raw "
    "tensor bytes, never pickle) under {base}/<step>/full; a pickle-based HTTPTransport "
    "cannot heal from it: run the same torchft version on every replica group"
)


class _Abortable(Protocol):
    def abort(self) -> None: ...


@dataclass
class _Receiving:
    """One receive in progress: its cancel flag, its open fetches, and whether it was broken
    by ``abort_recv`` (rather than by one of its own failed fetches)."""

    cancel: threading.Event
    fetches: list[_Abortable]
    lost: bool = False


class _Aborted(Exception):
    """The transfer was cancelled (checkpoint disallowed or transport shut down)."""


class _OfferRead:
    """The read guard of one offer, entered by every stream that reads its tensors.

    Holds the state's read lock (when the owner gave one) while the stream runs, and its
    ``__enter__`` says why the state is no longer the one offered: written since the offer
    (the state version moved), or a tensor read straight from memory was moved or resized.
    The streams of one receive each enter separately, so without this a write between two
    of them would hand the receiver ranges of two different states, every CRC correct.
    """

    def __init__(
        self,
        lock: Callable[[], AbstractContextManager[object]] | None,
        version: Callable[[], int] | None,
        enc: ser.Encoded,
        sources: list[tuple[int, int]],
    ) -> None:
        self._lock = lock
        self._version = version
        self._offered = version() if version is not None else None
        self._memory = [
            (t, addr, n) for t, (addr, n) in zip(enc.tensors, sources, strict=True) if addr
        ]

    def changed(self) -> str | None:
        """Why the state differs from the offered one (None: it is the same)."""
        if self._version is not None and self._version() != self._offered:
            return "the state was written since"
        for t, addr, n in self._memory:
            if t.data_ptr() != addr or t.nbytes != n:
                return "a tensor's memory was moved or resized"
        return None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[str | None]:
        with self._lock() if self._lock is not None else contextlib.nullcontext():
            yield self.changed()


@dataclass
class _Served:
    """The state currently offered to receivers."""

    step: int
    gen: str
    enc: ser.Encoded
    header_frame: bytes
    # Bound (seconds) on serving one request of this offer, so a stalled receiver cannot
    # hold the state (and its read lock) longer.
    timeout: float
    # Entered by every stream that reads the tensors.
    read: _OfferRead


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # shutdown() aborts and joins connections itself, bounded
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self,
        transport: HTTPTransport,
        family: socket.AddressFamily,
        host: str,
        tls: ssl.SSLContext | None,
    ) -> None:
        self.address_family = family
        self.transport = transport
        self.tls = tls
        super().__init__((host, 0), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's own thread: a slow TLS handshake holds up no one else.
        conn = accept_connection(request, self.tls, self.transport._timeout.total_seconds())
        if conn is None:
            return
        super().finish_request(conn, client_address)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            # Dual stack: accept IPv4 clients too, whatever the hostname resolves to.
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("checkpoint server error for %s", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    streaming: bool = False
    protocol_version = "HTTP/1.0"
    disable_nagle_algorithm = True

    def setup(self) -> None:
        transport = self.server.transport
        # Per-connection socket timeout (an idle or stalled client frees its thread).
        self.timeout = transport._timeout.total_seconds()  # type: ignore[misc]
        super().setup()
        transport._register_conn(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.transport._unregister_conn(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("checkpoint server %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802
        # Set once the 200 status line went out: afterwards errors can only cut the body.
        self.streaming = False
        try:
            self.server.transport._handle_get(self)
        except _HTTPError as e:
            self._send_text(e.status, e.message)
        except _Aborted as e:
            logger.info("checkpoint transfer to %s aborted: %s", self.address_string(), e)
            self.close_connection = True
        except Exception as e:
            self.close_connection = True
            if self.streaming:
                logger.warning("checkpoint transfer to %s failed: %r", self.address_string(), e)
            else:
                # e.g. the state-dict lock could not be taken in time.
                logger.warning("checkpoint request from %s failed: %r", self.address_string(), e)
                status = 503 if isinstance(e, TimeoutError) else 500
                self._send_text(status, f"checkpoint could not be served: {e!r}")

    def _send_text(self, status: int, message: str) -> None:
        body = message.encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError as e:
            logger.debug("could not send error response: %s", e)


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _listen(transport: HTTPTransport, where: Endpoint, tls: ssl.SSLContext | None) -> _Server:
    """Binds the checkpoint server on the first usable address of ``where.listen``."""
    errors = []
    for family, host in where.listen:
        try:
            return _Server(transport, family, host, tls)
        except OSError as e:
            errors.append(f"{host}: {e}")
    raise OSError(f"checkpoint server could not listen on any address ({'; '.join(errors)})")


def _primary_ip(family: socket.AddressFamily) -> str | None:
    """Address of the interface holding the default route (no packet is sent)."""
    probe = ("10.255.255.255", 1) if family == socket.AF_INET else ("fd00::1", 1, 0, 0)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)
            return str(s.getsockname()[0])
    except OSError:
        return None


def _can_connect(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _reachable_host(port: int, family: socket.AddressFamily) -> str:
    """Picks the first name/address under which the server on ``port`` is reachable."""
    candidates: list[str | None] = [socket.gethostname(), socket.getfqdn()]
    candidates.append(_primary_ip(socket.AF_INET))
    if family == socket.AF_INET6:
        candidates.append(_primary_ip(socket.AF_INET6))
    candidates += ["127.0.0.1", "::1"] if family == socket.AF_INET6 else ["127.0.0.1"]
    seen = set()
    for host in candidates:
        if not host or host in seen:
            continue
        seen.add(host)
        if _can_connect(host, port):
            return host
        logger.info("checkpoint server not reachable as %s:%d, trying next address", host, port)
    raise RuntimeError(f"checkpoint server on port {port} is not reachable under any local address")


class HTTPTransport(CheckpointTransport[T]):
    """Serves this rank's live state over HTTP and fetches peers' state for healing.

    Args:
        timeout: default bound for serving one request and for waiting for a step to be
            offered (overridden by ``TORCHFT_TIMEOUT_SEC``).
        num_chunks: parallel connections of a receive: native receives use this many
            (0: ``DEFAULT_STREAMS``, at most ``MAX_STREAMS``); HTTP receives use this many
            range requests (0: one streamed request).
        state_dict: optional callable returning this rank's current state; a receive
            writes each tensor into the local tensor at the same place (same dtype and
            shape, contiguous) instead of allocating a new one. A failed receive then
            leaves those tensors partly overwritten. When it returns None, that receive
            allocates new tensors (the Manager's default transport receives in place
            only while its state is the one its process started with; docs/healing.md).
        state_dict_lock: optional factory of a context manager held while the state is
            read for a transfer (the Manager passes its state-dict read lock, so an
            optimizer step cannot race a transfer).
        state_version: optional callable returning a number that changes whenever the
            state is written (the Manager passes its lock's write count). An offer is
            served only while the number is the one it had when offered, so a receive
            never gets some tensors from before a write and others from after it: it
            fails instead (and the heal is retried).
        hostname: the host name receivers fetch from (the Manager passes the one it was
            given). The server listens on its addresses only. Default: the address of the
            heal interface (env ``TORCHFT_HEAL_IFNAME``, else the first interface of
            ``GLOO_SOCKET_IFNAME``, else of ``NCCL_SOCKET_IFNAME``), which the server then
            listens on; without one, this machine's host name. A given ``hostname`` wins
            over the interface variables (they are then not read).
        bind: listen here instead (``"::"`` or ``"0.0.0.0"`` for every interface); default
            env ``TORCHFT_CHECKPOINT_BIND``. A specific address is also what receivers are
            told (unless ``hostname`` is given) and wins over gloo's and NCCL's interface
            variables; ``TORCHFT_HEAL_IFNAME``, when set, must own it.
        security: token and TLS settings (default: from ``TORCHFT_TOKEN_FILE`` /
            ``TORCHFT_TOKEN`` / ``TORCHFT_TLS_*``, as the manager server reads them).
        native: serve and fetch tensor bytes over the native data path when the link is
            not TLS (False: HTTP only, as before it existed).
    """

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int = 0,
        state_dict: Callable[[], T] | None = None,
        state_dict_lock: Callable[[], AbstractContextManager[object]] | None = None,
        *,
        state_version: Callable[[], int] | None = None,
        hostname: str | None = None,
        bind: str | None = None,
        security: TransportSecurity | None = None,
        native: bool = True,
    ) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        self._timeout = _timeout_from_env(timeout)
        if self._timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if state_dict is not None and not callable(state_dict):
            raise TypeError("state_dict must be a callable returning the local state")
        self._num_chunks = num_chunks
        self._state_dict = state_dict
        self._touched_local = False
        self._native = native
        self._state_dict_lock = state_dict_lock
        self._state_version = state_version
        self._security = security if security is not None else TransportSecurity.from_env()
        self._client_tls = self._security.client_context()

        self._cond = threading.Condition()
        self._served: _Served | None = None
        self._last_step: int | None = None
        self._closed = False
        # connection socket -> generation being streamed on it (None: idle/not streaming)
        self._conns: dict[socket.socket, str | None] = {}
        self._conn_threads: set[threading.Thread] = set()
        # Receives in progress: their cancel flags and open fetches (see abort_recv).
        self._receiving: list[_Receiving] = []
        self._recv_lock = threading.Lock()

        # Resolved before anything listens: a bad host name or interface fails here, with
        # no server started.
        where = endpoint(hostname, bind)
        self._server = _listen(self, where, self._security.server_context())
        self._port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"torchft-ckpt-http-{self._port}",
            daemon=True,
        )
        self._thread.start()
        # The native data server: not on TLS links (its streams are not encrypted), where
        # the HTTPS path carries the bytes instead.
        self._data: _torchft.CheckpointDataServer | None = None
        if native and not self._security.serves_tls:
            try:
                self._data = _torchft.CheckpointDataServer(
                    str(self._server.server_address[0]),
                    token=self._security.token,
                    request_timeout=self._timeout,
                )
            except (OSError, ValueError) as e:
                # Healing still works, over HTTP: slower, never wrong.
                logger.warning(
                    "native checkpoint data server unavailable, serving over HTTP: %s", e
                )
        try:
            self._host = where.advertise or _reachable_host(
                self._port, socket.AddressFamily(self._server.address_family)
            )
        except Exception:
            self.shutdown(wait=False)
            raise
        if where.interface is not None:
            logger.info(
                "checkpoint server listening at %s (interface %s, %s)",
                self.metadata(),
                where.interface.interface,
                where.interface.setting.describe(),
            )
        else:
            logger.info("checkpoint server listening at %s", self.metadata())

    # ------------------------------------------------------------------ sender side

    def metadata(self) -> str:
        """Returns the base URL receivers fetch this rank's state from."""
        return f"{self._security.scheme}://{_format_host(self._host)}:{self._port}{_BASE_PATH}"

    @property
    def receives_in_place(self) -> bool:
        """True when given ``state_dict``: receives write into the local tensors."""
        return self._state_dict is not None

    @property
    def touched_local_state(self) -> bool:
        """Whether the last receive got as far as writing into local tensors (it had its
        header and at least one destination in the local state). A receive that failed
        before that left the local state as it was."""
        return self._touched_local

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Offers ``state_dict`` as the state of ``step`` until :meth:`disallow_checkpoint`.

        Non-blocking: only the structure is walked here (unsupported values raise at once);
        tensor bytes are read by server threads when receivers ask.

        Args:
            dst_ranks: receivers (informational; any receiver may fetch).
            step: the step being served.
            state_dict: the state; its tensors must not be mutated while served.
            timeout: bound on serving each request of this offer (a stalled or slow
                receiver is cut off after it); non-positive means the transport's timeout.

        Raises:
            TypeError: the state contains an unsupported value.
            RuntimeError: the transport was shut down.
        """
        gen = uuid.uuid4().hex
        meta: dict[str, Any] = {"step": step, "gen": gen}
        data = self._data
        if data is not None:
            meta["data_port"] = data.port
        enc = ser.encode(state_dict, meta=meta)
        serve_timeout = timeout.total_seconds()
        if serve_timeout <= 0:
            serve_timeout = self._timeout.total_seconds()
        sources = _native_sources(enc)
        read = _OfferRead(self._state_dict_lock, self._state_version, enc, sources)
        if data is not None:
            # Offered before the header is served: a receiver reading the header may ask
            # for the bytes at once.
            data.offer(
                step,
                gen,
                sources,
                timedelta(seconds=serve_timeout),
                keepalive=enc,
                enter=read,
                stage=_Stager(enc.tensors).stage,
            )
        served = _Served(
            step=step,
            gen=gen,
            enc=enc,
            header_frame=ser.header_frame(enc),
            timeout=serve_timeout,
            read=read,
        )
        with self._cond:
            if self._closed:
                raise RuntimeError("HTTPTransport is shut down")
            old = self._served
            self._served = served
            self._last_step = step
            self._cond.notify_all()
        if old is not None:
            self._abort_transfers(old.gen)
        logger.debug(
            "serving checkpoint step=%d to %s (%d tensors, %d bytes)",
            step,
            dst_ranks,
            len(enc.specs),
            enc.total_tensor_bytes,
        )

    def disallow_checkpoint(self) -> None:
        """Stops serving; in-flight transfers are aborted, and this returns promptly."""
        with self._cond:
            served = self._served
            self._served = None
            self._cond.notify_all()
        if self._data is not None and not self._data.revoke():
            logger.warning("a native checkpoint stream still reads the state after its revoke")
        if served is not None:
            self._abort_transfers(served.gen)

    def _abort_transfers(self, gen: str) -> None:
        with self._cond:
            socks = [s for s, g in self._conns.items() if g == gen]
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + min(self._timeout.total_seconds(), 5.0)
        with self._cond:
            # Streaming threads notice the closed socket at their next write; wait briefly
            # so the state is no longer read once this returns.
            while any(g == gen for g in self._conns.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("checkpoint transfer still running after abort")
                    break
                self._cond.wait(remaining)

    def _register_conn(self, sock: socket.socket) -> None:
        with self._cond:
            self._conns[sock] = None
            self._conn_threads.add(threading.current_thread())
            closed = self._closed
        if closed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _unregister_conn(self, sock: socket.socket) -> None:
        with self._cond:
            self._conns.pop(sock, None)
            self._conn_threads.discard(threading.current_thread())
            self._cond.notify_all()

    def _wait_served(self, step: int, wait_s: float) -> _Served:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise _HTTPError(410, "checkpoint server is shutting down")
                served = self._served
                if served is not None and served.step == step:
                    return served
                current = served.step if served is not None else self._last_step
                if current is not None and current > step:
                    raise _HTTPError(
                        409,
                        f"requested step {step} but this replica is at step {current}",
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _HTTPError(
                        503,
                        f"step {step} was not served within {wait_s:.1f}s "
                        f"(current step: {current})",
                    )
                self._cond.wait(remaining)

    def _handle_get(self, h: _Handler) -> None:
        url = urllib.parse.urlsplit(h.path)
        parts = url.path.split("/")
        refused = self._security.check(h.headers.get("Authorization"))
        if refused is not None:
            raise _HTTPError(401, refused)
        query = urllib.parse.parse_qs(url.query)
        # "", "checkpoint", step, kind, ...
        if len(parts) < 3 or parts[1] != _BASE_PATH.strip("/"):
            raise _HTTPError(404, f"unknown path {url.path!r}")
        if len(parts) == 3 or parts[3].isdigit():
            # /checkpoint/<step>[/<chunk>]: a pickle-based HTTPTransport's request.
            raise _HTTPError(400, _NOT_OURS.format(base=_BASE_PATH))
        try:
            step = int(parts[2])
            wait_s = float(query.get("wait", ["0"])[0])
        except ValueError:
            raise _HTTPError(400, f"invalid step or wait in {h.path!r}") from None
        if not math.isfinite(wait_s):
            raise _HTTPError(400, "invalid wait")
        wait_s = min(max(wait_s, 0.0), self._timeout.total_seconds())
        kind = parts[3]

        if kind == "range":
            # Ranges belong to one offered state (named by its generation): never wait,
            # and never mix tensors of two different offers.
            served = self._served
            if served is None or served.step != step or query.get("gen", [""])[0] != served.gen:
                raise _HTTPError(409, f"the state of step {step} is no longer served")
        else:
            served = self._wait_served(step, wait_s)
        if kind == "header" and len(parts) == 4:
            self._stream(
                h,
                served,
                lambda write: write(served.header_frame),
                len(served.header_frame),
                lock=False,
            )
            return
        if kind == "full" and len(parts) == 4:
            n = len(served.enc.specs)
            size = len(served.header_frame) + ser.range_frame_size(served.enc, 0, n)

            def body(write: Callable[[bytes | memoryview], object]) -> None:
                write(served.header_frame)
                ser.write_range(served.enc, 0, n, write)

            self._stream(h, served, body, size, lock=True)
            return
        if kind == "range" and len(parts) == 6:
            try:
                start, end = int(parts[4]), int(parts[5])
            except ValueError:
                raise _HTTPError(400, f"invalid range in {h.path!r}") from None
            if not 0 <= start <= end <= len(served.enc.specs):
                raise _HTTPError(400, f"range [{start}, {end}) out of bounds")
            size = ser.range_frame_size(served.enc, start, end)
            self._stream(
                h,
                served,
                lambda write: ser.write_range(served.enc, start, end, write),
                size,
                lock=True,
            )
            return
        raise _HTTPError(404, f"unknown path {url.path!r}")

    def _stream(
        self,
        h: _Handler,
        served: _Served,
        body: Callable[[Callable[[bytes | memoryview], object]], object],
        size: int,
        lock: bool,
    ) -> None:
        sock = h.connection
        guard: AbstractContextManager[str | None] = (
            served.read() if lock else contextlib.nullcontext()
        )
        with guard as changed:
            if changed is not None:
                raise _HTTPError(
                    409,
                    f"the state of step {served.step} changed since it was offered ({changed}); "
                    "it is no longer served",
                )
            with self._cond:
                if self._served is not served:
                    raise _HTTPError(409, f"step {served.step} is no longer served")
                self._conns[sock] = served.gen
            try:
                deadline = time.monotonic() + served.timeout
                h.send_response(200)
                h.send_header("Content-Type", "application/octet-stream")
                h.send_header("Content-Length", str(size))
                h.end_headers()
                h.streaming = True
                sent = 0

                def write(piece: bytes | memoryview) -> None:
                    nonlocal sent
                    if self._served is not served:
                        raise _Aborted(f"step {served.step} no longer served")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"checkpoint transfer exceeded {served.timeout:.1f}s")
                    sock.settimeout(remaining)
                    h.wfile.write(piece)
                    sent += len(piece)

                body(write)
                if sent != size:
                    raise RuntimeError(f"sent {sent} bytes, announced {size}")
            finally:
                with self._cond:
                    if sock in self._conns:
                        self._conns[sock] = None
                    self._cond.notify_all()

    # ------------------------------------------------------------------ receiver side

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches the state of ``step`` from the peer serving at ``metadata``.

        Args:
            src_rank: replica rank of the source (for error messages).
            metadata: the source's base URL (its :meth:`metadata`).
            step: the expected step.
            timeout: bound on the whole transfer.

        Returns:
            The received state dict (CPU tensors), fully verified.

        Raises:
            TimeoutError: the source did not serve ``step`` or the transfer was too slow.
            ConnectionError: the source could not be reached or dropped the connection
                before answering.
            RuntimeError: wrong step, refused request, or corrupted/truncated data
                (:class:`~torchft.checkpointing._serialization.CheckpointFormatError`).
            CheckpointAuthError: the source refused this process's token.
            ValueError: ``metadata`` is not an ``http(s)://host:port/...`` URL, or is TLS
                without a CA to verify it.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        base = urllib.parse.urlsplit(metadata)
        if not base.hostname or base.port is None:
            raise ValueError(f"invalid checkpoint address {metadata!r}")
        scheme = self._security.fetch_scheme(base.scheme, metadata)
        base = base._replace(scheme=scheme)
        prefix = base.path.rstrip("/")
        t0 = time.monotonic()
        self._touched_local = False
        entry = _Receiving(threading.Event(), [])
        with self._recv_lock:
            self._receiving.append(entry)
        try:
            if self._native:
                state, nbytes = self._recv_ranges(base, prefix, step, deadline, src_rank, entry)
            elif self._num_chunks <= 0:
                state, nbytes = self._recv_full(base, prefix, step, deadline, src_rank, entry)
            else:
                state, nbytes = self._recv_chunked(base, prefix, step, deadline, src_rank, entry)
        except (ConnectionError, ser.CheckpointFormatError, _Aborted, TimeoutError) as e:
            if entry.lost:
                raise ConnectionError(
                    f"checkpoint transfer from replica {src_rank} aborted: the source was lost"
                ) from e
            raise
        finally:
            with self._recv_lock:
                self._receiving.remove(entry)
        elapsed = time.monotonic() - t0
        logger.info(
            "received checkpoint step=%d from replica %d (%d bytes in %.3fs, %.1f MB/s)",
            step,
            src_rank,
            nbytes,
            elapsed,
            nbytes / max(elapsed, 1e-9) / 1e6,
        )
        return state

    def abort_recv(self) -> None:
        """Breaks every receive in progress (see ``CheckpointTransport.abort_recv``)."""
        with self._recv_lock:
            for r in self._receiving:
                r.lost = True
            receiving = [(r.cancel, list(r.fetches)) for r in self._receiving]
        for cancel, fetches in receiving:
            cancel.set()
            for f in fetches:
                f.abort()

    def _open(self, entry: _Receiving, fetch: _F) -> _F:
        """Registers ``fetch`` with its receive so ``abort_recv`` can break it."""
        with self._recv_lock:
            entry.fetches.append(fetch)
        if entry.cancel.is_set():
            fetch.abort()
            raise _Aborted("cancelled")
        return fetch

    def _recv_full(
        self,
        base: urllib.parse.SplitResult,
        prefix: str,
        step: int,
        deadline: float,
        src: int,
        entry: _Receiving,
    ) -> tuple[Any, int]:
        path = f"{prefix}/{step}/full?wait={_wait_param(deadline)}"
        with self._open(
            entry, _Fetch(base, path, deadline, src, self._fetch_opts(), entry.cancel)
        ) as f:
            header = ser.read_header(f.readinto)
            _check_meta(header, step, src)
            out = self._destinations(header, cpu_only=True)
            ser.read_range(f.readinto, header, 0, len(out), out, check=f.check)
            f.expect_eof()
        return ser.build(header, out), sum(s.nbytes for s in header.specs)

    def _recv_chunked(
        self,
        base: urllib.parse.SplitResult,
        prefix: str,
        step: int,
        deadline: float,
        src: int,
        entry: _Receiving,
    ) -> tuple[Any, int]:
        header = self._fetch_header(base, prefix, step, deadline, src, entry)
        gen = _check_meta(header, step, src)
        out = self._destinations(header, cpu_only=True)
        ranges = ser.split_ranges(header.specs, self._num_chunks)
        self._fetch_http_ranges(base, prefix, header, gen, ranges, out, deadline, src, entry)
        return ser.build(header, out), sum(s.nbytes for s in header.specs)

    def _recv_ranges(
        self,
        base: urllib.parse.SplitResult,
        prefix: str,
        step: int,
        deadline: float,
        src: int,
        entry: _Receiving,
    ) -> tuple[Any, int]:
        """Header over HTTP, then the bytes natively when the source offers a data port
        (else as HTTP range requests)."""
        header = self._fetch_header(base, prefix, step, deadline, src, entry)
        gen = _check_meta(header, step, src)
        port = header.meta.get("data_port")
        native = type(port) is int and 0 < port < 65536 and not self._security.dials_tls
        out = self._destinations(header, cpu_only=not native)
        if native:
            assert base.hostname is not None and isinstance(port, int)
            self._fetch_native(base.hostname, port, header, gen, out, deadline, src, entry)
        else:
            ranges = ser.split_ranges(header.specs, max(self._num_chunks, 1))
            self._fetch_http_ranges(base, prefix, header, gen, ranges, out, deadline, src, entry)
        return ser.build(header, out), sum(s.nbytes for s in header.specs)

    def _destinations(self, header: ser.Header, cpu_only: bool) -> list[torch.Tensor | None]:
        """Per header tensor, the local tensor to receive into (None: allocate one)."""
        out: list[torch.Tensor | None] = [None] * len(header.specs)
        local = self._state_dict() if self._state_dict is not None else None
        if local is None:
            return out
        # Device (CUDA) tensors only natively, staged through pinned host memory.
        devices = ("cpu",) if cpu_only else ("cpu", "cuda")

        def accept(t: torch.Tensor) -> bool:
            return t.device.type in devices

        for i, t in ser.inplace_targets(header, local, accept).items():
            out[i] = t
            self._touched_local = True
        return out

    def _fetch_header(
        self,
        base: urllib.parse.SplitResult,
        prefix: str,
        step: int,
        deadline: float,
        src: int,
        entry: _Receiving,
    ) -> ser.Header:
        header_path = f"{prefix}/{step}/header?wait={_wait_param(deadline)}"
        with self._open(
            entry, _Fetch(base, header_path, deadline, src, self._fetch_opts(), entry.cancel)
        ) as f:
            header = ser.read_header(f.readinto)
            f.expect_eof()
        return header

    def _fetch_native(
        self,
        host: str,
        port: int,
        header: ser.Header,
        gen: str,
        out: list[torch.Tensor | None],
        deadline: float,
        src: int,
        entry: _Receiving,
    ) -> None:
        """Receives every tensor over the native data path into ``out`` (filled in)."""
        dests: list[tuple[int, int]] = []
        staged: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for i, spec in enumerate(header.specs):
            t = out[i]
            if t is None:
                t = out[i] = ser.alloc_tensor(spec)
            elif t.device.type != "cpu":
                # A device tensor: received into a pinned host buffer, then copied over.
                buf = torch.empty(
                    spec.shape, dtype=spec.torch_dtype, pin_memory=torch.cuda.is_available()
                )
                staged.append((i, buf, t))
                t = buf
            dests.append((t.data_ptr() if spec.nbytes else 0, spec.nbytes))
        streams = min(self._num_chunks if self._num_chunks > 0 else DEFAULT_STREAMS, MAX_STREAMS)
        ranges = ser.split_ranges(header.specs, streams)
        fetch = self._open(entry, _torchft.CheckpointFetch())
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"checkpoint transfer from replica {src} timed out")
        addr = f"{_format_host(host)}:{port}"
        failure = fetch.run(
            addr,
            self._security.token,
            int(header.meta["step"]),
            gen,
            ranges,
            dests,
            timedelta(seconds=remaining),
        )
        if failure is not None:
            raise _native_error(failure, src, addr)
        for i, buf, target in staged:
            target.copy_(buf)
            out[i] = target
        if staged and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _fetch_http_ranges(
        self,
        base: urllib.parse.SplitResult,
        prefix: str,
        header: ser.Header,
        gen: str,
        ranges: list[tuple[int, int]],
        out: list[torch.Tensor | None],
        deadline: float,
        src: int,
        entry: _Receiving,
    ) -> None:
        cancel, fetches = entry.cancel, entry.fetches
        step = header.meta["step"]

        def fetch(start: int, end: int) -> None:
            path = f"{prefix}/{step}/range/{start}/{end}?gen={gen}"
            with self._open(
                entry, _Fetch(base, path, deadline, src, self._fetch_opts(), cancel)
            ) as fetch:
                ser.read_range(fetch.readinto, header, start, end, out, check=fetch.check)
                fetch.expect_eof()

        if ranges:
            pool = ThreadPoolExecutor(
                max_workers=len(ranges), thread_name_prefix="torchft-ckpt-recv"
            )
            try:
                futures = [pool.submit(fetch, a, b) for a, b in ranges]
                done, pending = wait(
                    futures,
                    timeout=max(deadline - time.monotonic(), 0),
                    return_when=FIRST_EXCEPTION,
                )
                failed = [f for f in done if f.exception() is not None]
                if failed or pending:
                    cancel.set()
                    with self._recv_lock:
                        opened = list(fetches)
                    for fe in opened:
                        fe.abort()
                    if failed:
                        raise failed[0].exception()  # type: ignore[misc]
                    raise TimeoutError(f"checkpoint transfer from replica {src} timed out")
            finally:
                pool.shutdown(wait=True, cancel_futures=True)

    def _fetch_opts(self) -> _FetchOpts:
        return _FetchOpts(tls=self._client_tls, headers=self._security.headers())

    def shutdown(self, wait: bool = True) -> None:
        """Stops the server, aborts open connections and (optionally) joins its threads.

        Args:
            wait: wait (bounded by the timeout) for connection threads to exit.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._served = None
            socks = list(self._conns)
            threads = list(self._conn_threads)
            self._cond.notify_all()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if self._data is not None:
            self._data.shutdown()
        self._server.shutdown()
        self._server.server_close()
        if wait:
            deadline = time.monotonic() + min(self._timeout.total_seconds(), 5.0)
            self._thread.join(max(deadline - time.monotonic(), 0))
            for t in threads:
                t.join(max(deadline - time.monotonic(), 0))


def _native_sources(enc: ser.Encoded) -> list[tuple[int, int]]:
    """Per tensor ``(address, length)`` for the native server: the tensor's own memory when it
    is a plain contiguous CPU tensor, else address 0 (staged by :class:`_Stager`)."""
    sources = []
    for t, spec in zip(enc.tensors, enc.specs, strict=True):
        direct = (
            t.device.type == "cpu"
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
            and spec.nbytes > 0
        )
        sources.append((t.data_ptr() if direct else 0, spec.nbytes))
    return sources


class _Stager:
    """Copies pieces of the tensors the native server cannot read directly into its stream
    buffers: device tensors through a pinned host buffer of one piece per stream thread, and
    non-contiguous tensors from a contiguous copy of the tensor being sent (one per stream
    thread at a time, made once per tensor, not once per piece).

    Per-thread state is keyed by the OS thread id: each call from the native server may come
    with a fresh Python thread state, so ``threading.local`` would not survive between them.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors
        self._lock = threading.Lock()
        # thread id -> (tensor index, contiguous bytes of that tensor)
        self._flat: dict[int, tuple[int, torch.Tensor]] = {}
        # thread id -> pinned host buffer
        self._pinned: dict[int, torch.Tensor] = {}

    def stage(self, index: int, offset: int, view: memoryview) -> None:
        """Fills ``view`` with bytes ``[offset, offset + len(view))`` of tensor ``index``."""
        n = len(view)
        dst = torch.frombuffer(view, dtype=torch.uint8)
        me = threading.get_ident()
        with self._lock:
            cached = self._flat.get(me)
        if cached is None or cached[0] != index:
            cached = (index, _flat_bytes(self._tensors[index]))
            with self._lock:
                self._flat[me] = cached
        flat = cached[1]
        if offset + n >= flat.numel():
            with self._lock:
                self._flat.pop(me, None)  # the tensor's last piece: free its copy
        if flat.device.type == "cpu":
            dst.copy_(flat[offset : offset + n])
            return
        with self._lock:
            pinned = self._pinned.get(me)
        if pinned is None or pinned.numel() < n:
            pinned = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=True)
            with self._lock:
                self._pinned[me] = pinned
        pinned[:n].copy_(flat[offset : offset + n])
        dst.copy_(pinned[:n])


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous flat uint8 view of ``t``'s data on its own device (copied only when
    ``t`` is not contiguous, conjugated or negated)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _native_error(failure: tuple[str, int, str], src: int, addr: str) -> Exception:
    """The exception for a failed native fetch (same types as the HTTP path raises)."""
    kind, status, message = failure
    where = f"replica {src} ({addr})"
    if kind == "timeout":
        return TimeoutError(f"timed out fetching checkpoint from {where}: {message}")
    if kind == "connect":
        return ConnectionError(f"could not fetch checkpoint from {where}: {message}")
    if kind in ("broken", "corrupt"):
        return ser.CheckpointFormatError(f"checkpoint stream from {where}: {message}")
    if kind == "aborted":
        return _Aborted("cancelled")
    if status == 401:
        return CheckpointAuthError(f"{where}'s checkpoint server refused the token: {message}")
    return RuntimeError(f"checkpoint request to {where} failed ({status}): {message}")


def _wait_param(deadline: float) -> str:
    # Ask the server to answer slightly before our own deadline so its message arrives.
    return f"{max(deadline - time.monotonic() - 0.05, 0.0):.3f}"


def _check_meta(header: ser.Header, step: int, src: int) -> str:
    got = header.meta.get("step")
    if got != step:
        raise RuntimeError(f"replica {src} sent the state of step {got!r}, expected step {step}")
    gen = header.meta.get("gen")
    if not isinstance(gen, str) or not gen.isalnum():
        raise ser.CheckpointFormatError("checkpoint header has no valid generation id")
    return gen


@dataclass(frozen=True)
class _FetchOpts:
    """How fetches reach a checkpoint server: TLS context (None: plain) and headers."""

    tls: ssl.SSLContext | None
    headers: dict[str, str]


class _Fetch:
    """One streamed GET with a whole-request deadline and optional cancellation."""

    def __init__(
        self,
        base: urllib.parse.SplitResult,
        path: str,
        deadline: float,
        src: int,
        opts: _FetchOpts,
        cancel: threading.Event | None = None,
    ) -> None:
        self._opts = opts
        self._base = base
        self._path = path
        self._deadline = deadline
        self._src = src
        self._cancel = cancel
        self._conn: http.client.HTTPConnection | None = None
        self._sock: socket.socket | None = None
        self._resp: http.client.HTTPResponse | None = None
        self.url = f"{base.scheme}://{base.netloc}{path}"

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"timed out fetching checkpoint from replica {self._src} ({self.url})"
            )
        return remaining

    def check(self) -> None:
        """Raises if the deadline passed or the fetch was cancelled."""
        if self._cancel is not None and self._cancel.is_set():
            raise _Aborted("cancelled")
        self._sock_timeout()

    def _sock_timeout(self) -> None:
        remaining = self._remaining()
        if self._sock is not None:
            self._sock.settimeout(remaining)

    def __enter__(self) -> _Fetch:
        assert self._base.hostname is not None
        conn: http.client.HTTPConnection
        if self._base.scheme == "https":
            conn = http.client.HTTPSConnection(
                self._base.hostname,
                self._base.port,
                timeout=self._remaining(),
                context=self._opts.tls,
            )
        else:
            conn = http.client.HTTPConnection(
                self._base.hostname, self._base.port, timeout=self._remaining()
            )
        self._conn = conn
        try:
            conn.connect()
            self._sock = conn.sock
            if self._cancel is not None and self._cancel.is_set():
                raise _Aborted("cancelled")
            conn.putrequest("GET", self._path)
            for name, value in self._opts.headers.items():
                conn.putheader(name, value)
            conn.endheaders()
            self._sock_timeout()
            resp = conn.getresponse()
        except TimeoutError:
            self.__exit__(None, None, None)
            raise TimeoutError(
                f"timed out fetching checkpoint from replica {self._src} ({self.url})"
            ) from None
        except ssl.SSLError as e:
            self.__exit__(None, None, None)
            raise ConnectionError(describe_tls_failure(e, self.url)) from e
        except (ConnectionResetError, http.client.RemoteDisconnected) as e:
            self.__exit__(None, None, None)
            if self._base.scheme == "https":
                raise ConnectionError(describe_tls_failure(e, self.url)) from e
            raise ConnectionError(
                f"could not fetch checkpoint from replica {self._src} ({self.url}): {e!r}"
            ) from e
        except (OSError, http.client.HTTPException) as e:
            self.__exit__(None, None, None)
            raise ConnectionError(
                f"could not fetch checkpoint from replica {self._src} ({self.url}): {e!r}"
            ) from e
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self._resp = resp
        if resp.status != 200:
            try:
                msg = resp.read(_MAX_ERROR_BODY).decode(errors="replace")
            except (OSError, http.client.HTTPException):
                msg = ""
            self.__exit__(None, None, None)
            if resp.status == 401:
                raise CheckpointAuthError(
                    f"replica {self._src}'s checkpoint server refused the token: {msg.strip()}"
                )
            if resp.status == 503:
                raise TimeoutError(
                    f"replica {self._src} did not serve the checkpoint in time: {msg}"
                )
            raise RuntimeError(
                f"checkpoint request to replica {self._src} failed (HTTP {resp.status}): {msg}"
            )
        return self

    def readinto(self, buf: memoryview) -> int:
        """Reads into ``buf`` (``file.readinto`` semantics), mapping stream errors."""
        assert self._resp is not None
        try:
            return self._resp.readinto(buf)
        except http.client.IncompleteRead as e:
            raise ser.CheckpointFormatError(
                f"checkpoint stream from {self.url} truncated: {e!r}"
            ) from None
        except TimeoutError:
            raise TimeoutError(
                f"timed out reading checkpoint from replica {self._src} ({self.url})"
            ) from None
        except (ConnectionError, http.client.HTTPException) as e:
            if self._cancel is not None and self._cancel.is_set():
                raise _Aborted("cancelled") from None
            raise ser.CheckpointFormatError(
                f"checkpoint stream from {self.url} broke: {e!r}"
            ) from None

    def expect_eof(self) -> None:
        """Raises if the server sent more bytes than the frames describe."""
        if self.readinto(memoryview(bytearray(1))) != 0:
            raise ser.CheckpointFormatError(f"unexpected trailing bytes from {self.url}")

    def abort(self) -> None:
        """Breaks the connection so a blocked read returns at once."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __exit__(self, *exc: object) -> None:
        if self._resp is not None:
            with contextlib.suppress(Exception):
                self._resp.close()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
