"""Adaptor to the native data path (:mod:`torchft._torchft` ``CheckpointDataServer`` /
``CheckpointFetch``), both ends.

The control exchange stays HTTP (the receiver fetches the JSON header, which names the
source's data port); the bytes move natively: streamed from the sender's tensor memory over
several TCP connections, written straight into the receiver's tensors, CRC per tensor, the
GIL released. Tensors the native server cannot read directly (device memory, non-contiguous
layouts) are staged by :class:`Stager`; device tensors a receiver writes into are received
into pinned host buffers and copied over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta

import torch

from torchft import _torchft
from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._security import CheckpointAuthError, TransportSecurity
from torchft.checkpointing.http.hosts import format_host
from torchft.checkpointing.http.wire import Aborted, logger

# Parallel connections of a native receive when ``num_chunks`` is 0.
DEFAULT_STREAMS = 4
# Most connections of one native receive (the native fetch's own limit): a source serves
# a bounded number of streams at once, shared by every group healing from it.
MAX_STREAMS = 16


def start_data_server(
    host: str, security: TransportSecurity, timeout: timedelta
) -> _torchft.CheckpointDataServer | None:
    """The native data server on ``host``, or None where it cannot run (healing then goes
    over HTTP: slower, never wrong). Not on TLS links: its streams are not encrypted."""
    if security.serves_tls:
        return None
    try:
        return _torchft.CheckpointDataServer(host, token=security.token, request_timeout=timeout)
    except (OSError, ValueError) as e:
        logger.warning("native checkpoint data server unavailable, serving over HTTP: %s", e)
        return None


def native_sources(enc: ser.Encoded) -> list[tuple[int, int]]:
    """Per tensor ``(address, length)`` for the native server: the tensor's own memory when it
    is a plain contiguous CPU tensor, else address 0 (staged by :class:`Stager`)."""
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


def offer(
    data: _torchft.CheckpointDataServer,
    step: int,
    gen: str,
    enc: ser.Encoded,
    sources: list[tuple[int, int]],
    timeout: timedelta,
    read: Callable[[], AbstractContextManager[str | None]],
) -> None:
    """Offers the encoded state ``enc`` of ``step`` (generation ``gen``) to native
    receivers; ``read`` is entered by every stream that reads the tensors."""
    data.offer(
        step,
        gen,
        sources,
        timeout,
        keepalive=enc,
        enter=read,
        stage=Stager(enc.tensors).stage,
    )


class Stager:
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
            cached = (index, flat_bytes(self._tensors[index]))
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


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous flat uint8 view of ``t``'s data on its own device (copied only when
    ``t`` is not contiguous, conjugated or negated)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


class NativeReceive:
    """The destinations of one native receive: every tensor of ``header`` is written into
    ``out`` (allocated where ``out`` has None; a device tensor through a pinned host buffer),
    over ``streams`` connections.

    Args:
        header: the state's header.
        out: per header tensor, the local tensor to receive into, or None; filled in.
        streams: parallel connections (0: ``DEFAULT_STREAMS``; at most ``MAX_STREAMS``).
    """

    def __init__(self, header: ser.Header, out: list[torch.Tensor | None], streams: int) -> None:
        self._header = header
        self._out = out
        self._dests: list[tuple[int, int]] = []
        self._staged: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for i, spec in enumerate(header.specs):
            t = out[i]
            if t is None:
                t = out[i] = ser.alloc_tensor(spec)
            elif t.device.type != "cpu":
                # A device tensor: received into a pinned host buffer, then copied over.
                buf = torch.empty(
                    spec.shape, dtype=spec.torch_dtype, pin_memory=torch.cuda.is_available()
                )
                self._staged.append((i, buf, t))
                t = buf
            self._dests.append((t.data_ptr() if spec.nbytes else 0, spec.nbytes))
        self._ranges = ser.split_ranges(
            header.specs, min(streams if streams > 0 else DEFAULT_STREAMS, MAX_STREAMS)
        )

    def run(
        self,
        fetch: _torchft.CheckpointFetch,
        host: str,
        port: int,
        token: str | None,
        gen: str,
        deadline: float,
        src: int,
    ) -> None:
        """Fetches the bytes of generation ``gen`` from ``host:port`` before ``deadline``
        (``time.monotonic``); raises as the HTTP path does (see :func:`native_error`)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"checkpoint transfer from replica {src} timed out")
        addr = f"{format_host(host)}:{port}"
        failure = fetch.run(
            addr,
            token,
            int(self._header.meta["step"]),
            gen,
            self._ranges,
            self._dests,
            timedelta(seconds=remaining),
        )
        if failure is not None:
            raise native_error(failure, src, addr)
        for i, buf, target in self._staged:
            target.copy_(buf)
            self._out[i] = target
        if self._staged and torch.cuda.is_available():
            torch.cuda.synchronize()


def native_error(failure: tuple[str, int, str], src: int, addr: str) -> Exception:
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
        return Aborted("cancelled")
    if status == 401:
        return CheckpointAuthError(f"{where}'s checkpoint server refused the token: {message}")
    return RuntimeError(f"checkpoint request to {where} failed ({status}): {message}")
