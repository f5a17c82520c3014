"""The receiver's side of the HTTP checkpoint transport.

A :class:`Receiver` fetches peers' states; each state fetched is one :class:`Receive`, which
holds what that receive needs (the source, the step, the deadline, its cancel flag and open
fetches) and fetches it one of three ways:

- **native** (the transport's default): the header over HTTP, then the bytes over the native
  data path (:mod:`torchft.checkpointing.http.native`) when the source offers a data port and
  the link is not TLS, else as HTTP range requests;
- **full** (``native=False``, ``num_chunks`` 0): one streamed request for everything;
- **chunked** (``native=False``, ``num_chunks`` > 0): the header, then ``num_chunks``
  parallel range requests.

Bytes are streamed straight into tensor memory: the local tensors when the transport was
given ``state_dict`` (and they match), else new ones.
"""

from __future__ import annotations

import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

from torchft import _torchft
from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._security import TransportSecurity
from torchft.checkpointing.http import wire
from torchft.checkpointing.http.native import NativeReceive
from torchft.checkpointing.http.request import Fetch, FetchOpts
from torchft.checkpointing.http.wire import Aborted, logger


class _Abortable(Protocol):
    def abort(self) -> None: ...


_F = TypeVar("_F", bound=_Abortable)


@dataclass(frozen=True)
class ReceiveConfig:
    """What every receive of one transport shares.

    Attributes:
        security: the token sent, and whether fetches use TLS.
        opts: how fetches reach a server (TLS context and headers).
        num_chunks: parallel connections (see :class:`HTTPTransport`).
        native: receive the bytes natively where the source offers it.
        local: returns the local state to receive into (None: new tensors).
    """

    security: TransportSecurity
    opts: FetchOpts
    num_chunks: int
    native: bool
    local: Callable[[], Any] | None


def _check_meta(header: ser.Header, step: int, src: int) -> str:
    """The header's generation id, after checking it is the state of ``step``."""
    got = header.meta.get("step")
    if got != step:
        raise RuntimeError(f"replica {src} sent the state of step {got!r}, expected step {step}")
    gen = header.meta.get("gen")
    if not isinstance(gen, str) or not gen.isalnum():
        raise ser.CheckpointFormatError("checkpoint header has no valid generation id")
    return gen


class Receive:
    """One receive in progress: the state of ``step`` from replica ``src`` at ``base``,
    before ``deadline`` (``time.monotonic``).

    Also its cancel flag, its open fetches (so :meth:`abort` can break them), whether it was
    broken by :meth:`abort` (rather than by one of its own failed fetches), and whether it
    wrote into local tensors.
    """

    def __init__(
        self,
        config: ReceiveConfig,
        base: urllib.parse.SplitResult,
        step: int,
        deadline: float,
        src: int,
    ) -> None:
        self.config = config
        self.base = base
        self.prefix = base.path.rstrip("/")
        self.step = step
        self.deadline = deadline
        self.src = src
        self.cancel = threading.Event()
        self.lost = False
        self.touched_local = False
        self._fetches: list[_Abortable] = []
        self._lock = threading.Lock()

    def run(self) -> tuple[Any, int]:
        """Fetches the state; returns it and its tensor bytes."""
        if self.config.native:
            return self._native_or_ranges()
        if self.config.num_chunks <= 0:
            return self._full()
        return self._chunked()

    def abort(self) -> None:
        """Breaks the receive: its source was lost."""
        with self._lock:
            self.lost = True
            fetches = list(self._fetches)
        self.cancel.set()
        for f in fetches:
            f.abort()

    def open(self, fetch: _F) -> _F:
        """Registers ``fetch`` with this receive so :meth:`abort` can break it."""
        with self._lock:
            self._fetches.append(fetch)
        if self.cancel.is_set():
            fetch.abort()
            raise Aborted("cancelled")
        return fetch

    def get(self, path: str) -> Fetch:
        """A registered GET of ``path`` from the source."""
        return self.open(
            Fetch(self.base, path, self.deadline, self.src, self.config.opts, self.cancel)
        )

    def _full(self) -> tuple[Any, int]:
        with self.get(wire.full_path(self.prefix, self.step, self.deadline)) as f:
            header = ser.read_header(f.readinto)
            _check_meta(header, self.step, self.src)
            out = self.destinations(header, cpu_only=True)
            ser.read_range(f.readinto, header, 0, len(out), out, check=f.check)
            f.expect_eof()
        return ser.build(header, out), sum(s.nbytes for s in header.specs)

    def _chunked(self) -> tuple[Any, int]:
        header = self.header()
        gen = _check_meta(header, self.step, self.src)
        out = self.destinations(header, cpu_only=True)
        self.http_ranges(header, gen, ser.split_ranges(header.specs, self.config.num_chunks), out)
        return ser.build(header, out), sum(s.nbytes for s in header.specs)

    def _native_or_ranges(self) -> tuple[Any, int]:
        """Header over HTTP, then the bytes natively when the source offers a data port
        (else as HTTP range requests)."""
        header = self.header()
        gen = _check_meta(header, self.step, self.src)
        port = header.meta.get("data_port")
        native = type(port) is int and 0 < port < 65536 and not self.config.security.dials_tls
        out = self.destinations(header, cpu_only=not native)
        if native:
            assert self.base.hostname is not None and isinstance(port, int)
            self.native(self.base.hostname, port, header, gen, out)
        else:
            ranges = ser.split_ranges(header.specs, max(self.config.num_chunks, 1))
            self.http_ranges(header, gen, ranges, out)
        return ser.build(header, out), sum(s.nbytes for s in header.specs)

    def destinations(self, header: ser.Header, cpu_only: bool) -> list[torch.Tensor | None]:
        """Per header tensor, the local tensor to receive into (None: allocate one)."""
        out: list[torch.Tensor | None] = [None] * len(header.specs)
        local = self.config.local() if self.config.local is not None else None
        if local is None:
            return out
        # Device (CUDA) tensors only natively, staged through pinned host memory.
        devices = ("cpu",) if cpu_only else ("cpu", "cuda")

        def accept(t: torch.Tensor) -> bool:
            return t.device.type in devices

        for i, t in ser.inplace_targets(header, local, accept).items():
            out[i] = t
            self.touched_local = True
        return out

    def header(self) -> ser.Header:
        """The source's header of the step."""
        with self.get(wire.header_path(self.prefix, self.step, self.deadline)) as f:
            header = ser.read_header(f.readinto)
            f.expect_eof()
        return header

    def native(
        self, host: str, port: int, header: ser.Header, gen: str, out: list[torch.Tensor | None]
    ) -> None:
        """Receives every tensor over the native data path into ``out`` (filled in)."""
        receive = NativeReceive(header, out, self.config.num_chunks)
        fetch = self.open(_torchft.CheckpointFetch())
        receive.run(fetch, host, port, self.config.security.token, gen, self.deadline, self.src)

    def http_ranges(
        self,
        header: ser.Header,
        gen: str,
        ranges: list[tuple[int, int]],
        out: list[torch.Tensor | None],
    ) -> None:
        """Receives tensor ``ranges`` as parallel HTTP range requests into ``out``."""
        step = header.meta["step"]

        def fetch(start: int, end: int) -> None:
            with self.get(wire.range_path(self.prefix, step, start, end, gen)) as f:
                ser.read_range(f.readinto, header, start, end, out, check=f.check)
                f.expect_eof()

        if not ranges:
            return
        pool = ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix="torchft-ckpt-recv")
        try:
            futures = [pool.submit(fetch, a, b) for a, b in ranges]
            done, pending = wait(
                futures,
                timeout=max(self.deadline - time.monotonic(), 0),
                return_when=FIRST_EXCEPTION,
            )
            failed = [f for f in done if f.exception() is not None]
            if failed or pending:
                self.cancel.set()
                with self._lock:
                    opened = list(self._fetches)
                for fe in opened:
                    fe.abort()
                if failed:
                    raise failed[0].exception()  # type: ignore[misc]
                raise TimeoutError(f"checkpoint transfer from replica {self.src} timed out")
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


class Receiver:
    """Fetches peers' states for one transport, and breaks the receives in progress when
    their source is lost.

    Args:
        security: the token sent and the TLS settings.
        client_tls: the TLS context fetches use (None: plain).
        num_chunks: parallel connections of a receive.
        native: receive the bytes natively where the source offers it.
        local: returns the local state to receive into (None: new tensors).
    """

    def __init__(
        self,
        security: TransportSecurity,
        client_tls: ssl.SSLContext | None,
        num_chunks: int,
        native: bool,
        local: Callable[[], Any] | None,
    ) -> None:
        opts = FetchOpts(tls=client_tls, headers=security.headers())
        self._config = ReceiveConfig(security, opts, num_chunks, native, local)
        self._receiving: list[Receive] = []
        self._lock = threading.Lock()
        self._last: Receive | None = None

    @property
    def touched_local(self) -> bool:
        """Whether the last receive wrote into local tensors."""
        last = self._last
        return last is not None and last.touched_local

    def recv(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetches the state of ``step`` from the peer serving at ``metadata`` (see
        :meth:`HTTPTransport.recv_checkpoint`)."""
        deadline = time.monotonic() + timeout.total_seconds()
        base = urllib.parse.urlsplit(metadata)
        if not base.hostname or base.port is None:
            raise ValueError(f"invalid checkpoint address {metadata!r}")
        scheme = self._config.security.fetch_scheme(base.scheme, metadata)
        base = base._replace(scheme=scheme)
        t0 = time.monotonic()
        receive = Receive(self._config, base, step, deadline, src_rank)
        self._last = receive
        with self._lock:
            self._receiving.append(receive)
        try:
            state, nbytes = receive.run()
        except (ConnectionError, ser.CheckpointFormatError, Aborted, TimeoutError) as e:
            if receive.lost:
                raise ConnectionError(
                    f"checkpoint transfer from replica {src_rank} aborted: the source was lost"
                ) from e
            raise
        finally:
            with self._lock:
                self._receiving.remove(receive)
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

    def abort(self) -> None:
        """Breaks every receive in progress."""
        with self._lock:
            receiving = list(self._receiving)
        for receive in receiving:
            receive.abort()
