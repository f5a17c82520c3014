"""HTTP checkpoint transport: every rank serves its live state, healing ranks pull it.

Two paths carry the tensor bytes:

- **native** (default, when the link is not TLS): the control exchange stays HTTP (the
  receiver fetches the JSON header, which names the source's data port), and the bytes move
  over the native data path (:mod:`torchft._torchft` ``CheckpointDataServer`` /
  ``CheckpointFetch``): streamed from the sender's tensor memory over several TCP
  connections, written straight into the receiver's tensors, CRC per tensor, the GIL
  released. With ``state_dict=`` the receiver writes into its own existing tensors.
- **HTTP** (TLS links, peers without a data port, ``native=False``): the stdlib server
  streams the same frames over HTTP(S).

The sender runs a small threaded HTTP server (stdlib) listening on one address: that of the
heal interface (``TORCHFT_HEAL_IFNAME``, else gloo's or NCCL's interface variable), else that
of the host name the manager advertises (see :mod:`torchft.checkpointing._security` for
binding, the shared-secret token and TLS, which every request goes through). Between
``send_checkpoint(step)`` and ``disallow_checkpoint()`` it serves the state of that step,
encoded by :mod:`torchft.checkpointing._serialization` (JSON header + raw tensor bytes with
CRCs, never pickle). Receivers stream the body straight into tensor memory, either as one
request or as ``num_chunks`` parallel range requests.

:class:`HTTPTransport` puts together the parts of :mod:`torchft.checkpointing.http`: the
server (``serve``), the receiver (``fetch``), the native data path (``native``) and host
discovery (``hosts``); the endpoints are described in ``wire``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, TypeVar, cast

from torchft import _torchft
from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._security import TransportSecurity, endpoint
from torchft.checkpointing.http import native as _native
from torchft.checkpointing.http.fetch import Receiver
from torchft.checkpointing.http.hosts import format_host, reachable_host
from torchft.checkpointing.http.native import DEFAULT_STREAMS, MAX_STREAMS
from torchft.checkpointing.http.offer import OfferRead, Served
from torchft.checkpointing.http.serve import CheckpointServer
from torchft.checkpointing.http.wire import BASE_PATH, logger
from torchft.checkpointing.transport import CheckpointTransport, _timeout_from_env

__all__ = ["DEFAULT_STREAMS", "MAX_STREAMS", "HTTPTransport"]

T = TypeVar("T")


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
        state_dict: Callable[[], T | None] | None = None,
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
        self._state_dict = state_dict
        self._state_dict_lock = state_dict_lock
        self._state_version = state_version
        self._security = security if security is not None else TransportSecurity.from_env()
        self._receiver = Receiver(
            self._security, self._security.client_context(), num_chunks, native, state_dict
        )

        # Resolved before anything listens: a bad host name or interface fails here, with
        # no server started.
        where = endpoint(hostname, bind)
        self._server = CheckpointServer(where, self._security, self._timeout.total_seconds())
        self._port = self._server.port
        # The native data server (None: the HTTP server carries the bytes).
        self._data: _torchft.CheckpointDataServer | None = None
        if native:
            self._data = _native.start_data_server(
                self._server.address, self._security, self._timeout
            )
        try:
            self._host = where.advertise or reachable_host(self._port, self._server.family)
        except Exception:
            self.shutdown(wait=False)
            raise
        # Sent with every quorum request: formatted once.
        self._metadata = (
            f"{self._security.scheme}://{format_host(self._host)}:{self._port}{BASE_PATH}"
        )
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
        return self._metadata

    @property
    def receives_in_place(self) -> bool:
        """True when given ``state_dict``: receives write into the local tensors."""
        return self._state_dict is not None

    @property
    def touched_local_state(self) -> bool:
        """Whether the last receive got as far as writing into local tensors (it had its
        header and at least one destination in the local state). A receive that failed
        before that left the local state as it was."""
        return self._receiver.touched_local

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
        sources = _native.native_sources(enc)
        read = OfferRead(self._state_dict_lock, self._state_version, enc, sources)
        if data is not None:
            # Offered before the header is served: a receiver reading the header may ask
            # for the bytes at once.
            _native.offer(data, step, gen, enc, sources, timedelta(seconds=serve_timeout), read)
        self._server.offer(
            Served(
                step=step,
                gen=gen,
                enc=enc,
                header_frame=ser.header_frame(enc),
                timeout=serve_timeout,
                read=read,
            )
        )
        logger.debug(
            "serving checkpoint step=%d to %s (%d tensors, %d bytes)",
            step,
            dst_ranks,
            len(enc.specs),
            enc.total_tensor_bytes,
        )

    def disallow_checkpoint(self) -> None:
        """Stops serving; in-flight transfers are aborted, and this returns promptly."""
        served = self._server.withdraw()
        if self._data is not None and not self._data.revoke():
            logger.warning("a native checkpoint stream still reads the state after its revoke")
        if served is not None:
            self._server.abort_transfers(served.gen)

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
        return cast(T, self._receiver.recv(src_rank, metadata, step, timeout))

    def abort_recv(self) -> None:
        """Breaks every receive in progress (see ``CheckpointTransport.abort_recv``)."""
        self._receiver.abort()

    def shutdown(self, wait: bool = True) -> None:
        """Stops the server, aborts open connections and (optionally) joins its threads.

        Args:
            wait: wait (bounded by the timeout) for connection threads to exit.
        """
        if not self._server.close():
            return
        if self._data is not None:
            self._data.shutdown()
        self._server.stop(wait)
