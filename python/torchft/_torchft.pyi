"""Type stubs for the native module ``torchft._torchft`` (Rust, built by maturin)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, final

__all__ = [
    "CheckpointDataServer",
    "CheckpointFetch",
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "PendingQuorum",
    "Quorum",
    "QuorumMember",
    "QuorumRequest",
    "QuorumResult",
    "TelemetryReport",
    "EVENT_KINDS",
    "TorchFTError",
    "StateDivergedError",
    "lighthouse_main",
    "security_settings",
    "set_log_context",
    "_digest_update",
    "_crc32_update",
]

class TorchFTError(RuntimeError):
    """A torchft operation failed (not a timeout, not a bad argument)."""

class StateDivergedError(TorchFTError):
    """This replica group's committed state differs from the others' with no majority to say
    which is right (runtime state parity): training must stop."""

#: The lighthouse's event kinds, each with whether its events name a replica group.
EVENT_KINDS: list[tuple[str, bool]]

def set_log_context(replica_id: str, group_rank: int) -> None:
    """Names this process on every following native log line: ``[replica_id/group_rank]``."""

# --- lighthouse -----------------------------------------------------------------------------

@final
class QuorumMember:
    """One replica group as presented to the lighthouse."""

    def __new__(
        cls,
        replica_id: str,
        address: str = ...,
        store_address: str = ...,
        step: int = 0,
        world_size: int = 1,
        shrink_only: bool = False,
        commit_failures: int = 0,
        data: dict[str, Any] | None = None,
    ) -> QuorumMember: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def store_address(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def shrink_only(self) -> bool: ...
    @property
    def commit_failures(self) -> int: ...
    @property
    def data(self) -> dict[str, Any]:
        """User metadata (JSON round-tripped); ``{}`` when none was given."""
    def __eq__(self, other: object, /) -> bool: ...

@final
class Quorum:
    """The set of replica groups taking part in a step."""

    def __new__(
        cls,
        quorum_id: int,
        participants: list[QuorumMember],
        created: datetime | None = None,
    ) -> Quorum: ...
    @property
    def quorum_id(self) -> int: ...
    @property
    def participants(self) -> list[QuorumMember]:
        """Members sorted by replica_id."""
    @property
    def created(self) -> datetime:
        """When the lighthouse issued the quorum (timezone-aware, UTC)."""

@final
class LighthouseServer:
    """A lighthouse (gRPC + HTTP on one port) running inside this process.

    Raises ValueError for bad arguments (``min_replicas < 1``, negative or zero durations where
    a positive one is needed, an unparsable bind address).

    ``progress_wait_ms`` (default 60000): how long a round whose groups are all behind a group
    that may still come back (heartbeating, or silent with its session open) waits for it
    before training goes on from the older state (announced as ``progress_regressed``); a
    new lighthouse also holds its first quorum for ``min(heartbeat_timeout_ms,
    progress_wait_ms)``. 0 disables both.

    ``state_file`` (default none): the lighthouse keeps its durable state there (the last
    quorum, the best committed step and its holders, rewritten atomically before a commit is
    acknowledged), so a lighthouse restarted with the same file refuses commits under quorums
    it had replaced and waits for the holders of the best step.
    """

    def __new__(
        cls,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        *,
        progress_wait_ms: int | None = None,
        state_file: str | None = None,
        event_log: str | None = None,
        allow_kill: bool = False,
        straggler_skew_pct: float | None = None,
        straggler_min_ms: int | None = None,
        token_file: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        tls_client_ca: str | None = None,
        private_status: bool = False,
        max_request_bytes: int | None = None,
        room_expiry_ms: int | None = None,
        max_rooms: int | None = None,
        room_min_replicas: dict[str, int] | None = None,
        room_token_dir: str | None = None,
    ) -> LighthouseServer:
        """Token and TLS default to ``TORCHFT_TOKEN_FILE``/``TORCHFT_TOKEN``/``TORCHFT_TLS_*``;
        the keyword arguments win over them (see docs/security.md)."""
    def address(self) -> str:
        """``http://host:port`` to dial (``https://`` with TLS; the host name when bound to a
        wildcard address)."""
    def shutdown(self) -> None:
        """Stops serving; pending quorum requests fail."""

@final
class LighthouseClient:
    """A client of a lighthouse."""

    def __new__(cls, addr: str, connect_timeout: timedelta, job: str = ...) -> LighthouseClient:
        """Connects; every request names ``job`` (its room on the lighthouse; empty: the
        default room). ValueError for an invalid job name."""
    def quorum(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str | None = None,
        store_address: str | None = None,
        step: int | None = None,
        world_size: int | None = None,
        shrink_only: bool | None = None,
        data: dict[str, Any] | None = None,
    ) -> Quorum:
        """Joins the current round and waits for a quorum containing ``replica_id``.

        Raises TimeoutError when ``timeout`` passes first, ValueError for bad arguments.
        """
    def heartbeat(self, replica_id: str, timeout: timedelta = ..., step: int | None = None) -> None:
        """Tells the lighthouse ``replica_id`` is alive (default timeout: 5 seconds) and, if
        given, its committed step (ValueError if negative)."""

def security_settings() -> dict[str, str | None]:
    """This process's token and TLS files from ``TORCHFT_TOKEN_FILE``/``TORCHFT_TOKEN``/
    ``TORCHFT_TLS_*``: keys ``token``, ``tls_cert``, ``tls_key``, ``tls_ca``, ``tls_client_ca``.

    Raises ValueError on an unreadable token file or an incomplete TLS combination.
    """

def lighthouse_main() -> None:
    """Entry point of the ``torchft_lighthouse`` console script (parses ``sys.argv``)."""

# --- manager ---------------------------------------------------------------------------------

def _digest_update(crc: int, adler: int, address: int, length: int) -> tuple[int, int]:
    """Continues a state digest over the ``length`` bytes at ``address``: ``(crc, adler)``
    as ``zlib.crc32`` and ``zlib.adler32`` would give, computed without the GIL. The caller
    keeps the memory alive and unchanged for the call. ValueError for a null address with
    bytes to read, or a range past the end of memory."""

@final
class ManagerServer:
    """The manager server of one replica group (hosted by group rank 0).

    Gathers the group's ranks for each quorum round, asks the lighthouse once, answers each
    rank its role; runs the per-step commit vote; heartbeats the lighthouse.
    """

    def __new__(
        cls,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta = ...,
        connect_timeout: timedelta = ...,
        quorum_retries: int = 0,
        topology_file: str | None = None,
        topology_group: int | None = None,
        job: str = ...,
        sparse_quorum: bool = True,
    ) -> ManagerServer:
        """Starts the server; its requests to the lighthouse name ``job`` (the group's room on
        a lighthouse shared by many jobs; empty: the default room; ValueError for an invalid
        name). With ``topology_file`` (the job's topology, JSON version 0.1) and
        ``topology_group`` (this group's index; its ranks there are
        ``topology_group * world_size + group_rank``) heal sources follow the file. Raises
        ValueError on a malformed file (naming the field) or one lacking this group's ranks.
        Without a topology file and with ``sparse_quorum``, the lighthouse answers each
        quorum with this group's own answer and the few members it names: the
        ``replica_ids`` of its results name those members only (empty strings elsewhere)."""
    def lease_held(self) -> bool:
        """False if this group's heartbeats lapsed during the current step (it may have been
        declared lost): the step must not commit."""
    def may_commit(self, step: int, timeout: timedelta) -> bool:
        """Whether this group may commit ``step`` (its committed step count before the
        commit): its lease held and the lighthouse accepted the write-ahead announcement
        (retried up to ``timeout`` while the lighthouse is unreachable). The calling thread
        (GIL released) drives the announcement's own connection while it waits. Raises
        ValueError if ``step`` is negative, StateDivergedError once the parity check stopped
        the group."""
    def _quorum_start(self, *args: Any, **fields: Any) -> PendingQuorum:
        """``ManagerClient._quorum_start`` for the hosting rank of a group of one rank: the
        request goes on a connection to the lighthouse that the calling thread drives (GIL
        released) until it is written, and again in ``PendingQuorum.wait`` (a backstop thread
        drives it meanwhile when the wait is long in coming; before that connection is made,
        the request goes as a client's). Same arguments, answers and errors; raises
        ValueError in a group of several ranks."""
    def _offer_digest(self, group_rank: int, step: int, digest: bytes) -> None:
        """Takes the hosting rank's digest of its committed state after ``step`` (runtime
        state parity). Raises ValueError for a step below 1, a rank outside the group, or a
        digest that is empty or longer than 64 bytes."""
    def _note_quorum_wait(self, step: int, seconds: float) -> None:
        """Notes this (hosting) rank's quorum wait in ``step`` (its committed step count before
        the step), in seconds, before it votes: the step's commit announcement carries it to
        the lighthouse. Raises ValueError for a negative step or a wait that is negative or not
        finite."""
    def note_committed_step(self, step: int) -> None:
        """Notes the group's committed step (after each commit); heartbeats carry it to the
        lighthouse. Raises ValueError if negative."""
    def describe(self) -> str:
        """The server's view of the group now, in one line: committed step and quorum, how
        long ago the training loop last reached it, ranks waiting in a quorum request or the
        commit vote, the lease, and what the lighthouse last said (for a hang report)."""
    def hung(self) -> str | None:
        """Why the lighthouse holds this group hung (its training loop stayed away from the
        manager past the hang timeout while a round waited on it), or None."""
    def parity_verdicts(self) -> tuple[bool, int, int]:
        """What the lighthouse's parity checks said of this group's committed states, as
        ``(checked, ok_step, diverged_step)``: whether the lighthouse says at all (upstream
        lighthouses do not), the newest step decided with this group's digest and no
        disagreement, and the newest step at which it differed (0 = none of either)."""
    def set_loop_busy(self, busy: bool) -> None:
        """Marks the training loop as inside torchft (a heal, however long) or back out of
        it; while busy the group is never reported away."""
    def address(self) -> str:
        """``http://{hostname}:{port}``: what ranks and other groups dial."""
    def shutdown(self) -> None:
        """Stops serving; pending calls end with an error. Safe to call twice."""

@final
class ManagerClient:
    """A client of one manager server (one channel, shared by all calls)."""

    def __new__(cls, addr: str, connect_timeout: timedelta = ...) -> ManagerClient: ...
    def report(self, report: TelemetryReport | None = None, /, **fields: Any) -> bool:
        """Queues a telemetry report (never waits); False if the queue was full.

        Takes a :class:`TelemetryReport`, or its fields as keywords. Raises ValueError on a
        malformed report (unknown phase, negative or non-finite seconds, a path over 4096
        bytes, ...).
        """
    def _telemetry_flush(self, timeout: timedelta = ...) -> None:
        """Sends the queued telemetry reports now, waiting at most ``timeout``."""
    def _telemetry_dropped(self) -> int:
        """Telemetry reports dropped so far."""
    def _quorum(self, *args: Any, **fields: Any) -> QuorumResult:
        """This rank's part of the next quorum (waits for every rank of the group); takes a
        :class:`QuorumRequest` and ``timeout``, its fields and ``timeout`` as keywords, or
        upstream's positional form ``(group_rank, step, checkpoint_metadata, shrink_only,
        timeout, commit_failures, init_sync)``.

        Raises TimeoutError at the deadline (the rank then leaves the round), ValueError for a
        rank outside the group or a negative step, and TorchFTError when the lighthouse cannot be
        reached or the group's ranks disagree on the step (every waiting rank gets it at once).
        """
    def _quorum_start(self, *args: Any, **fields: Any) -> PendingQuorum:
        """Sends the ``_quorum`` request without waiting; collect it with ``PendingQuorum.wait``."""
    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """The checkpoint metadata group rank ``rank`` sent with its latest quorum request."""
    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Casts this rank's vote for ``step``; True only if every rank of the group voted True.

        Raises TimeoutError at the deadline (the vote is then withdrawn), ValueError for a rank
        outside the group or a negative step, and TorchFTError for every waiting rank when ranks
        vote for different steps.
        """
    def _should_commit_digest(
        self,
        group_rank: int,
        step: int,
        should_commit: bool,
        timeout: timedelta,
        digest_step: int,
        digest: bytes,
    ) -> bool:
        """``should_commit`` that also hands over this rank's digest of its committed state
        after ``digest_step`` (runtime state parity). Raises ValueError for a step below 1 or
        a digest that is empty or longer than 64 bytes."""
    def _watch_events(
        self, after_seq: int, timeout: timedelta
    ) -> tuple[int, list[tuple[str, int]]]:
        """Waits for lost-member events after ``after_seq``: ``(last_seq, [(replica_id,
        quorum_id)])``, empty when none arrived within ``timeout``."""
    def kill(self, msg: str, timeout: timedelta = ...) -> None:
        """Ends the process hosting the manager server (logged with ``msg``)."""

@final
class TelemetryReport:
    """One telemetry report of a rank (frozen): identity, step, timings, commit result, errors.

    ``phase`` is one of step, heal_started, finished, failed, snapshot (a durable snapshot of
    committed step ``step`` completed: ``snapshot_path``, ``snapshot_stage_s``,
    ``snapshot_write_s``, the group's ``snapshot_bytes``; sent once per snapshot) and
    snapshot_failed (``error`` says why); neither snapshot phase is a step. Raises ValueError
    for an unknown phase; ``ManagerClient.report`` checks the rest. Fields left out are zero
    or empty, except ``phase`` ("step") and ``rank`` (-1: not known).
    """

    def __new__(
        cls,
        *,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        step: int,
        phase: str = ...,
        incarnation: str = ...,
        rank: int = ...,
        hostname: str = ...,
        pid: int = ...,
        quorum_id: int = ...,
        participants: int = ...,
        committed: bool = ...,
        healed: bool = ...,
        step_s: float = ...,
        quorum_wait_s: float = ...,
        collective_s: float = ...,
        should_commit_s: float = ...,
        busy_s: float = ...,
        heal_s: float = ...,
        heal_bytes: int = ...,
        heal_source: str = ...,
        heal_addr: str = ...,
        error: str = ...,
        unix_s: float = ...,
        snapshot_path: str = ...,
        snapshot_stage_s: float = ...,
        snapshot_write_s: float = ...,
        snapshot_bytes: int = ...,
        input_s: float = ...,
        forward_s: float = ...,
        backward_s: float = ...,
        optimizer_s: float = ...,
        cpu_s: float = ...,
        rss_bytes: int = ...,
        host_load: float = ...,
        host_mem_total_bytes: int = ...,
        host_mem_available_bytes: int = ...,
        net_rx_bytes_per_s: float = ...,
        net_tx_bytes_per_s: float = ...,
        host_steal: float = ...,
        gpu: bool = ...,
        gpu_util_pct: float = ...,
        gpu_mem_used_bytes: int = ...,
        gpu_mem_total_bytes: int = ...,
    ) -> TelemetryReport: ...

@final
class QuorumRequest:
    """One rank's request for its part of the next quorum (frozen); ``commit_failures``
    defaults to 0, ``init_sync`` to True."""

    def __new__(
        cls,
        *,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        commit_failures: int = ...,
        init_sync: bool = ...,
    ) -> QuorumRequest: ...

def _crc32_update(crc: int, address: int, length: int) -> int:
    """Continues a CRC-32 over the ``length`` bytes at ``address``: the value
    ``zlib.crc32`` would give, computed without the GIL. The caller keeps the memory alive
    and unchanged for the call. ValueError for a null address with bytes to
    read, or a range past the end of memory."""

@final
class CheckpointDataServer:
    """Serves one offered state's tensor bytes to ``CheckpointFetch`` receivers over TCP
    (the native checkpoint data path; streams read the tensors' memory directly)."""

    def __new__(
        cls, host: str, token: str | None = None, request_timeout: timedelta = ...
    ) -> CheckpointDataServer: ...
    @property
    def port(self) -> int:
        """The port the server listens on."""
    def offer(
        self,
        step: int,
        gen: str,
        tensors: list[tuple[int, int]],
        timeout: timedelta,
        keepalive: object,
        enter: Callable[[], AbstractContextManager[object]] | None = None,
        stage: Callable[[int, int, memoryview], None] | None = None,
    ) -> bool:
        """Serves ``tensors`` (per tensor ``(address, length)``, address 0: copied by
        ``stage(index, offset, view)``) as the state of ``step`` until ``revoke``; the memory
        must stay valid and unchanged until then. ``enter`` is held while a stream reads;
        its ``__enter__`` returns None, or a message saying why the state is no longer the
        one offered (the stream is then refused as no longer served)."""
    def revoke(self) -> bool:
        """Stops serving the offer; True once no stream reads it (waits a few seconds)."""
    def shutdown(self) -> None:
        """Revokes the offer, closes every connection and stops listening."""

@final
class CheckpointFetch:
    """One receive from a ``CheckpointDataServer``; ``abort`` breaks it from another thread."""

    def __new__(cls) -> CheckpointFetch: ...
    def abort(self) -> None:
        """Breaks the fetch: ``run`` returns ``("aborted", 0, ...)`` promptly."""
    def run(
        self,
        addr: str,
        token: str | None,
        step: int,
        gen: str,
        ranges: list[tuple[int, int]],
        dests: list[tuple[int, int]],
        timeout: timedelta,
    ) -> tuple[str, int, str] | None:
        """Receives tensor ``ranges`` (one connection each) into ``dests`` (per tensor
        ``(address, length)``); None on success, else ``(kind, status, message)`` with kind
        timeout, connect, broken, corrupt, refused or aborted. The GIL is released."""

@final
class PendingQuorum:
    """A quorum request in flight (from ``ManagerClient._quorum_start``), answered once."""

    def done(self) -> bool:
        """Whether the answer (or error) has arrived."""
    def wait(self) -> QuorumResult:
        """Waits (GIL released) for the answer; same errors as ``ManagerClient._quorum``."""

@final
class QuorumResult:
    """One rank's role in a quorum (constructible by hand for tests: every field defaults to
    zero, empty or None, except ``replica_world_size`` to 1)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str]

    def __new__(
        cls,
        quorum_id: int = ...,
        replica_rank: int = ...,
        replica_world_size: int = ...,
        recover_src_manager_address: str = ...,
        recover_src_replica_rank: int | None = ...,
        recover_dst_replica_ranks: list[int] = ...,
        store_address: str = ...,
        max_step: int = ...,
        max_replica_rank: int | None = ...,
        max_world_size: int = ...,
        heal: bool = ...,
        commit_failures: int = ...,
        replica_ids: list[str] = ...,
    ) -> QuorumResult: ...
