"""Coordination primitives: the lighthouse and the per replica group manager server.

These are the native (Rust) implementations re-exported under a stable public module, so user
code does not import the private ``torchft._torchft`` directly.

The ``Native*`` protocols say exactly what the :class:`~torchft.Manager` needs from the native
manager server and client. The Manager is written against them (it never probes for
optional methods), and test doubles implement them in full; ``make lint`` checks that the
native classes satisfy them (see the ``TYPE_CHECKING`` block at the end).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

from torchft._torchft import (
    LighthouseClient,
    LighthouseServer,
    ManagerClient,
    ManagerServer,
    PendingQuorum,
    Quorum,
    QuorumMember,
    QuorumRequest,
    QuorumResult,
    TelemetryReport,
)

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "NativeManagerClient",
    "NativeManagerServer",
    "NativePendingQuorum",
    "NativeQuorumResult",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
]


#: One rank's role in a quorum. The native :class:`QuorumResult` is itself constructible by
#: hand and mutable, so test doubles build real ones (or stand-ins typed ``Any``): it needs no
#: protocol restating its fields.
NativeQuorumResult = QuorumResult


class NativePendingQuorum(Protocol):
    """A quorum request in flight, answered once (:class:`PendingQuorum`)."""

    def done(self) -> bool:
        """Whether ``wait`` would return without waiting for the network."""
        ...

    def wait(self) -> NativeQuorumResult:
        """The answer; raises like ``NativeManagerClient._quorum``."""
        ...


class NativeManagerServer(Protocol):
    """The manager server hosted by group rank 0 (:class:`ManagerServer`)."""

    def address(self) -> str:
        """The address ranks and other replica groups dial."""
        ...

    def lease_held(self) -> bool:
        """False if the group's heartbeats lapsed during the step: it must not commit."""
        ...

    def may_commit(self, step: int, timeout: timedelta) -> bool:
        """Whether the group may commit ``step``: its lease held and the lighthouse accepted
        the write-ahead commit announcement."""
        ...

    def _quorum_start(
        self, request: QuorumRequest | None = None, timeout: timedelta | None = None, **fields: Any
    ) -> NativePendingQuorum:
        """``NativeManagerClient._quorum_start`` for the hosting rank of a group of one rank
        (the request goes on a lighthouse connection the calling thread drives)."""
        ...

    def _offer_digest(self, group_rank: int, step: int, digest: bytes) -> None:
        """Takes the hosting rank's digest of its committed state after ``step``."""
        ...

    def _note_quorum_wait(self, step: int, seconds: float) -> None:
        """Notes the hosting rank's quorum wait in ``step``; its commit announcement carries
        it to the lighthouse (goodput)."""
        ...

    def note_committed_step(self, step: int) -> None:
        """Records the group's committed step; heartbeats carry it to the lighthouse."""
        ...

    def describe(self) -> str:
        """The server's view of the group now, in one line (for a hang report)."""
        ...

    def hung(self) -> str | None:
        """Why the lighthouse holds the group hung, or None (see :mod:`torchft.hang`)."""
        ...

    def parity_verdicts(self) -> tuple[bool, int, int]:
        """What the lighthouse's parity checks said of the group's committed states:
        ``(checked, ok_step, diverged_step)`` (see :mod:`torchft.parity`)."""
        ...

    def set_loop_busy(self, busy: bool) -> None:
        """Marks the training loop as inside torchft (a heal) or back out of it."""
        ...

    def shutdown(self) -> None:
        """Stops serving."""
        ...


class NativeManagerClient(Protocol):
    """A rank's client of its replica group's manager server (:class:`ManagerClient`)."""

    def _quorum(
        self, request: QuorumRequest | None = None, timeout: timedelta | None = None, **fields: Any
    ) -> NativeQuorumResult:
        """This rank's part of the next quorum (the request, or its fields as keywords);
        TimeoutError at the deadline."""
        ...

    def _quorum_start(
        self, request: QuorumRequest | None = None, timeout: timedelta | None = None, **fields: Any
    ) -> NativePendingQuorum:
        """Sends the ``_quorum`` request without waiting for the answer."""
        ...

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """The checkpoint metadata a rank of that group sent with its last quorum request."""
        ...

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Casts this rank's vote; True only if every rank of the group voted True."""
        ...

    def _should_commit_digest(
        self,
        group_rank: int,
        step: int,
        should_commit: bool,
        timeout: timedelta,
        digest_step: int,
        digest: bytes,
    ) -> bool:
        """Casts this rank's vote and hands over its digest of a committed state."""
        ...

    def _watch_events(
        self, after_seq: int, timeout: timedelta
    ) -> tuple[int, list[tuple[str, int]]]:
        """Lost-member events after ``after_seq``: ``(last_seq, [(replica_id, quorum_id)])``."""
        ...

    def report(self, report: TelemetryReport | None = None, /, **fields: Any) -> bool:
        """Queues a telemetry report (the record, or its fields as keywords) without waiting;
        False if it was dropped."""
        ...

    def _telemetry_flush(self, timeout: timedelta = ...) -> None:
        """Sends the queued telemetry reports, waiting at most ``timeout``."""
        ...


class NativeBackend(Protocol):
    """What the Manager needs of the native module to join its replica group: the module
    ``torchft._torchft`` itself, or a test double passed as ``Manager(native_backend=)``."""

    def ManagerServer(  # noqa: N802 (the native class it constructs)
        self,
        *,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int,
        topology_file: str | None,
        topology_group: int | None,
        job: str,
        sparse_quorum: bool,
    ) -> NativeManagerServer:
        """Starts the replica group's manager server (on group rank 0)."""
        ...

    def ManagerClient(  # noqa: N802 (the native class it constructs)
        self, addr: str, connect_timeout: timedelta
    ) -> NativeManagerClient:
        """Connects a client to a manager server."""
        ...

    def set_log_context(self, replica_id: str, group_rank: int) -> None:
        """Names the replica group and rank in the native log lines."""
        ...


def check_native_backend(native: object) -> NativeBackend:
    """``native`` as a :class:`NativeBackend`, checked when a Manager is built rather than at
    its first use on a background thread.

    Raises:
        TypeError: ``native`` lacks one of the protocol's methods (named in the message).
    """
    wanted = [name for name, v in vars(NativeBackend).items() if callable(v) and name[0] != "_"]
    missing = [name for name in wanted if not callable(getattr(native, name, None))]
    if missing:
        raise TypeError(
            "native_backend must implement torchft.coordination.NativeBackend "
            f"({', '.join(wanted)}); {type(native).__name__} lacks {', '.join(missing)}"
        )
    return cast(NativeBackend, native)


if TYPE_CHECKING:
    # Checked by mypy in `make lint`: the native classes satisfy the protocols.
    def _native_client(c: ManagerClient) -> NativeManagerClient:
        return c

    def _native_server(s: ManagerServer) -> NativeManagerServer:
        return s

    def _native_pending(p: PendingQuorum) -> NativePendingQuorum:
        return p

    def _native_backend() -> NativeBackend:
        import torchft._torchft as module

        return module
