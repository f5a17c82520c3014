"""The sender's side of the HTTP checkpoint transport: a small threaded HTTP server (stdlib)
that offers one state at a time.

Between :meth:`CheckpointServer.offer` and :meth:`CheckpointServer.withdraw` it serves that
state, encoded by :mod:`torchft.checkpointing._serialization` (JSON header + raw tensor bytes
with CRCs, never pickle), under the endpoints of :mod:`torchft.checkpointing.http.wire`. The
training thread never serves: serving happens in server threads with socket timeouts and a
per-request deadline, and withdrawing an offer aborts its in-flight transfers instead of
waiting for slow receivers. Every request goes through the shared-secret token check and,
when configured, TLS (:mod:`torchft.checkpointing._security`).
"""

from __future__ import annotations

import contextlib
import http.server
import math
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._security import Endpoint, TransportSecurity, accept_connection
from torchft.checkpointing.http.offer import Served
from torchft.checkpointing.http.wire import BASE_PATH, Aborted, logger

_NOT_OURS = (
    "this checkpoint server speaks torchft's typed checkpoint format (JSON header and raw "
    "tensor bytes, never pickle) under {base}/<step>/full; a pickle-based HTTPTransport "
    "cannot heal from it: run the same torchft version on every replica group"
)

_Write = Callable[[bytes | memoryview], object]


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
        owner: CheckpointServer,
        family: socket.AddressFamily,
        host: str,
        tls: ssl.SSLContext | None,
    ) -> None:
        self.address_family = family
        self.owner = owner
        self.tls = tls
        super().__init__((host, 0), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's own thread: a slow TLS handshake holds up no one else.
        conn = accept_connection(request, self.tls, self.owner.timeout)
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
        owner = self.server.owner
        # Per-connection socket timeout (an idle or stalled client frees its thread).
        self.timeout = owner.timeout  # type: ignore[misc]
        super().setup()
        owner.register_conn(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner.unregister_conn(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("checkpoint server %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802
        # Set once the 200 status line went out: afterwards errors can only cut the body.
        self.streaming = False
        try:
            self.server.owner.handle_get(self)
        except _HTTPError as e:
            self._send_text(e.status, e.message)
        except Aborted as e:
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


class CheckpointServer:
    """The HTTP server of one transport, serving the state it was last offered.

    Listens on the first usable address of ``where.listen`` and runs in a daemon thread
    from construction until :meth:`stop`.

    Args:
        where: the addresses to listen on.
        security: the token every request must carry, and the TLS settings.
        timeout: seconds: the socket timeout of a connection, the longest a request waits
            for its step, and the bound on joining threads at shutdown (at most 5 s).
    """

    def __init__(self, where: Endpoint, security: TransportSecurity, timeout: float) -> None:
        self.timeout = timeout
        self._security = security
        self._cond = threading.Condition()
        self.served: Served | None = None
        self._last_step: int | None = None
        self._closed = False
        # connection socket -> generation being streamed on it (None: idle/not streaming)
        self._conns: dict[socket.socket, str | None] = {}
        self._conn_threads: set[threading.Thread] = set()
        # The connection threads open when the server was closed (joined by stop).
        self._closing_threads: list[threading.Thread] = []
        self._httpd = self._listen(where, security.server_context())
        self.address = str(self._httpd.server_address[0])
        self.port = int(self._httpd.server_address[1])
        self.family = socket.AddressFamily(self._httpd.address_family)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"torchft-ckpt-http-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _listen(self, where: Endpoint, tls: ssl.SSLContext | None) -> _Server:
        """Binds the server on the first usable address of ``where.listen``."""
        errors = []
        for family, host in where.listen:
            try:
                return _Server(self, family, host, tls)
            except OSError as e:
                errors.append(f"{host}: {e}")
        raise OSError(f"checkpoint server could not listen on any address ({'; '.join(errors)})")

    def connections(self) -> int:
        """How many connections are open."""
        with self._cond:
            return len(self._conns)

    def offer(self, served: Served) -> None:
        """Serves ``served`` from now on; transfers of the previous offer are aborted.

        Raises:
            RuntimeError: the server was stopped.
        """
        with self._cond:
            if self._closed:
                raise RuntimeError("HTTPTransport is shut down")
            old = self.served
            self.served = served
            self._last_step = served.step
            self._cond.notify_all()
        if old is not None:
            self.abort_transfers(old.gen)

    def withdraw(self) -> Served | None:
        """Stops serving; returns the offer withdrawn (its transfers still run: see
        :meth:`abort_transfers`)."""
        with self._cond:
            served = self.served
            if served is None:
                # Nothing was offered (every step of a steady run): nobody to tell.
                return None
            self.served = None
            self._cond.notify_all()
        return served

    def abort_transfers(self, gen: str) -> None:
        """Cuts the connections streaming generation ``gen``, and waits briefly for their
        threads to notice, so the state is no longer read once this returns."""
        with self._cond:
            socks = [s for s, g in self._conns.items() if g == gen]
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + min(self.timeout, 5.0)
        with self._cond:
            # Streaming threads notice the closed socket at their next write.
            while any(g == gen for g in self._conns.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("checkpoint transfer still running after abort")
                    break
                self._cond.wait(remaining)

    def register_conn(self, sock: socket.socket) -> None:
        """Records a connection's socket and thread (cut at once once closed)."""
        with self._cond:
            self._conns[sock] = None
            self._conn_threads.add(threading.current_thread())
            closed = self._closed
        if closed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def unregister_conn(self, sock: socket.socket) -> None:
        """Forgets a connection that ended."""
        with self._cond:
            self._conns.pop(sock, None)
            self._conn_threads.discard(threading.current_thread())
            self._cond.notify_all()

    def close(self) -> bool:
        """Stops serving and cuts every open connection; False if already closed."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self.served = None
            socks = list(self._conns)
            self._closing_threads = list(self._conn_threads)
            self._cond.notify_all()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        return True

    def stop(self, wait: bool) -> None:
        """Stops the server (after :meth:`close`) and, with ``wait``, joins its threads,
        bounded by the timeout (at most 5 s)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        if wait:
            deadline = time.monotonic() + min(self.timeout, 5.0)
            self._thread.join(max(deadline - time.monotonic(), 0))
            for t in self._closing_threads:
                t.join(max(deadline - time.monotonic(), 0))

    def _wait_served(self, step: int, wait_s: float) -> Served:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise _HTTPError(410, "checkpoint server is shutting down")
                served = self.served
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

    def handle_get(self, h: _Handler) -> None:
        """Answers one GET (raises :class:`_HTTPError` for an error status)."""
        url = urllib.parse.urlsplit(h.path)
        parts = url.path.split("/")
        refused = self._security.check(h.headers.get("Authorization"))
        if refused is not None:
            raise _HTTPError(401, refused)
        query = urllib.parse.parse_qs(url.query)
        # "", "checkpoint", step, kind, ...
        if len(parts) < 3 or parts[1] != BASE_PATH.strip("/"):
            raise _HTTPError(404, f"unknown path {url.path!r}")
        if len(parts) == 3 or parts[3].isdigit():
            # /checkpoint/<step>[/<chunk>]: a pickle-based HTTPTransport's request.
            raise _HTTPError(400, _NOT_OURS.format(base=BASE_PATH))
        try:
            step = int(parts[2])
            wait_s = float(query.get("wait", ["0"])[0])
        except ValueError:
            raise _HTTPError(400, f"invalid step or wait in {h.path!r}") from None
        if not math.isfinite(wait_s):
            raise _HTTPError(400, "invalid wait")
        wait_s = min(max(wait_s, 0.0), self.timeout)
        kind = parts[3]

        if kind == "range":
            # Ranges belong to one offered state (named by its generation): never wait,
            # and never mix tensors of two different offers.
            served = self.served
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

            def body(write: _Write) -> None:
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
        served: Served,
        body: Callable[[_Write], object],
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
                if self.served is not served:
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
                    if self.served is not served:
                        raise Aborted(f"step {served.step} no longer served")
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
