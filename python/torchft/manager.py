"""The per-step fault-tolerance coordinator of one training process.

A :class:`Manager` lives in every rank of a replica group. Once per step it asks the replica
group's manager server for a quorum (which replica groups take part, who heals from whom),
reconfigures the cross-replica process group when the membership changed, moves live
checkpoints between replica groups (healing), performs the cross-replica gradient allreduce on
behalf of DDP while swallowing communication errors, and finally decides with the other ranks
of its replica group whether the step commits.

The step protocol, seen from one rank::

    manager.start_quorum()          # optimizer.zero_grad(); async, overlapped with forward
    loss = model(batch); loss.backward()   # manager.allreduce(grad) through the DDP comm hook
    if manager.should_commit():     # optimizer.step(); vote of every rank in the group
        optimizer.step()

Errors on the training path (a peer died mid-allreduce, a heal failed) are recorded with
:meth:`Manager.report_error` and turn the step's commit vote into "no"; they are never raised
from inside collectives. Bad arguments raise at once.

Store keys: group rank 0 publishes the manager server address in the replica group's store under
``torchft/manager/{replica_id}/{restart}/addr`` (``replica_id`` is the constructor argument, so
several replica groups may share one store if they use distinct replica ids; ``restart`` is
torchrun's ``TORCHELASTIC_RESTART_COUNT``, 0 without it). A worker restarted inside torchrun's
agent meets the store its predecessor wrote to: the restart count in the key keeps a non-zero
rank from reading the dead incarnation's address before rank 0 publishes the new one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.distributed import ReduceOp, TCPStore, Work
from torch.futures import Future

from torchft import _torchft
from torchft.config import ManagerConfig, WorldSizeMode, heal_ifname
from torchft.coordination import (
    NativeManagerClient,
    NativeManagerServer,
    NativePendingQuorum,
    NativeQuorumResult,
)
from torchft.group_snapshots import GroupSnapshots
from torchft.hang import HangWatchdog
from torchft.loss_watch import LostWatcher
from torchft.parity import StateParity
from torchft.snapshot import Snapshot
from torchft.state_lock import ReadWriteLock
from torchft.telemetry import RankTelemetry
from torchft.work import _DummyWork, _FutureWork, future_timeout

if TYPE_CHECKING:
    from torchft.checkpointing import CheckpointTransport
    from torchft.process_group import ProcessGroup

logger: logging.Logger = logging.getLogger(__name__)
_quorum_logger: logging.Logger = logging.getLogger("torchft_quorums")
_commit_logger: logging.Logger = logging.getLogger("torchft_commits")
_error_logger: logging.Logger = logging.getLogger("torchft_errors")

T = TypeVar("T")

#: Key under which the default (legacy constructor) state dict functions are registered.
DEFAULT_STATE_DICT_KEY = "default"

#: A call to a heal source is retried in slices this long, checking whether it was lost.
_SOURCE_POLL_S = 1.0


class _ThisHost(str):
    """The default of ``Manager(hostname=)``: this machine's name, marked as not given, so
    the heal interface (``TORCHFT_HEAL_IFNAME``) wins over it while a given name wins over
    the interface."""

    __slots__ = ()


_THIS_HOST = _ThisHost(socket.gethostname())


def _heal_address(metadata: str) -> str:
    """``host:port`` of a checkpoint URL, the address a heal fetched from ("" when the
    transport's metadata is no URL, e.g. ``PGTransport``'s)."""
    with contextlib.suppress(ValueError):
        url = urllib.parse.urlsplit(metadata)
        if url.scheme in ("http", "https") and url.hostname:
            return url.netloc.rpartition("@")[2]
    return ""


def _group_name(incarnation: str) -> str:
    """The user-given name of a replica group incarnation (``{name}:{uuid}`` → ``name``)."""
    base, sep, tail = incarnation.rpartition(":")
    if sep:
        try:
            uuid.UUID(tail)
            return base
        except ValueError:
            pass
    return incarnation


class ExceptionWithTraceback(Exception):
    """An error recorded during a step, with the traceback captured where it was reported.

    Errors are reported on background threads and inspected later (at the commit decision),
    so the original stack would otherwise be lost.
    """

    def __init__(self, e: Exception) -> None:
        """Wraps ``e`` and captures the current traceback.

        Args:
            e: the original exception.
        """
        self.original_exception: Exception = e
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        self.stack_trace: str = "".join(tb)
        super().__init__(f"{type(e).__name__}: {e}")

    def __str__(self) -> str:
        return f"{type(self.original_exception).__name__}: {self.original_exception}"


class TornStateError(RuntimeError):
    """A heal that wrote into this group's own tensors failed midway, and no up-to-date
    replica group is left to heal it again: the state is one no step ever had, and only a
    restart of the process (which starts as it did before the heal, or loads a durable
    checkpoint) gets the group going again. Raised by :meth:`Manager.should_commit`; let it
    end the process so its supervisor (torchrun, Kubernetes, Ray) restarts it."""


#: Raised by :meth:`Manager.should_commit` (and the optimizer step) once runtime state parity
#: found this group's committed state different from the others' with no majority to say
#: which is right: training stops; restore a known good state (see :mod:`torchft.parity`).
StateDivergedError = _torchft.StateDivergedError


class HungProcessError(RuntimeError):
    """Why a process the lighthouse held hung ended itself (sent as its last telemetry
    report: the verdict, the manager server's state and every thread's stack)."""


class _QuorumTimeoutError(TimeoutError):
    """The quorum request itself hit its deadline (raised to wait_quorum/should_commit)."""


class _PendingQuorumFuture:
    """The quorum of an async step whose request is in flight in the native client.

    Quacks like the ``concurrent.futures.Future`` of the worker-thread path (``done``,
    ``result``). The first ``result`` waits for the answer (the request carries the quorum
    deadline) and adopts it: inline when only the step's roles change, on the worker thread
    (bounded by ``result``'s timeout) when the process group must be rebuilt or live state
    moves. Errors follow ``Manager._run_quorum``: the quorum deadline is recorded and raised,
    anything else only recorded.
    """

    def __init__(
        self,
        manager: Manager,
        pending: NativePendingQuorum,
        allow_heal: bool,
        quorum_timeout: timedelta,
    ) -> None:
        self._manager = manager
        self._pending = pending
        self._allow_heal = allow_heal
        self._quorum_timeout = quorum_timeout
        self._lock = threading.Lock()
        self._outcome: ConcurrentFuture[None] | None = None

    def done(self) -> bool:
        """Whether ``result`` would return without waiting for the network."""
        outcome = self._outcome
        if outcome is not None:
            return outcome.done()
        return self._pending.done()

    def result(self, timeout: float | None = None) -> None:
        """Waits for the quorum to be adopted.

        Args:
            timeout: bound (seconds) on the wait for the worker thread, if one is used.

        Raises:
            TimeoutError: the quorum deadline passed.
            concurrent.futures.TimeoutError: the worker thread did not finish in ``timeout``.
        """
        with self._lock:
            if self._outcome is None:
                self._outcome = self._adopt()
            outcome = self._outcome
        outcome.result(timeout=timeout)

    def _adopt(self) -> ConcurrentFuture[None]:
        m = self._manager
        done: ConcurrentFuture[None] = ConcurrentFuture()
        try:
            quorum = self._pending.wait()
        except TimeoutError as e:
            m._quorum_in_progress = False
            err = _QuorumTimeoutError(f"quorum not reached within {self._quorum_timeout}: {e}")
            err.__cause__ = e
            m.report_error(err)
            done.set_exception(err)
            return done
        except Exception as e:
            m._quorum_in_progress = False
            m.report_error(e)
            done.set_result(None)
            return done
        heavy = quorum.quorum_id != m._quorum_id or (
            self._allow_heal and (bool(quorum.heal) or bool(quorum.recover_dst_replica_ranks))
        )
        if heavy:
            return m._executor.submit(self._adopt_and_settle, quorum)
        self._adopt_and_settle(quorum)
        done.set_result(None)
        return done

    def _adopt_and_settle(self, quorum: NativeQuorumResult) -> None:
        """Adopts the answer; from then on the step runs on its quorum (see ``_on_lost``)."""
        m = self._manager
        try:
            m._adopt_quorum(quorum, self._allow_heal)
        finally:
            m._quorum_in_progress = False


class Manager:
    """Coordinates fault-tolerant data parallel training for one rank of a replica group.

    See the module documentation for the step protocol. Every public method is safe to call
    from the training thread; the quorum runs on one background worker thread.
    """

    def __init__(
        self,
        pg: ProcessGroup,
        load_state_dict: Callable[[T], None] | None,
        state_dict: Callable[[], T] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = _THIS_HOST,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: CheckpointTransport[dict[str, Any]] | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        telemetry: bool | None = None,
        hang_action: str | None = None,
        parity_every: int | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        snapshot_every: int | None = None,
        snapshot_keep: int | None = None,
    ) -> None:
        """Creates the manager, connects to the replica group's store and manager server.

        Args:
            pg: the cross-replica process group; reconfigured whenever the quorum changes.
                A torchft group (``configure`` on a fresh store prefix), or a torch group
                created with ``enable_reconfigure=True`` (torch 2.15+), which is
                reconfigured in place through ``pg.reconfigure`` after a handle exchange on
                that prefix (see docs/process_groups.md).
            load_state_dict: legacy loader of the user state (registered under key
                ``"default"``); may be None when :meth:`register_state_dict_fn` is used.
            state_dict: legacy saver of the user state, paired with ``load_state_dict``.
            min_replica_size: a step commits only with at least this many participants.
            use_async_quorum: run the quorum on a background thread, overlapped with the
                forward pass; healing replicas then sit out the step they heal in.
            timeout: default timeout of collectives, checkpoint transfer and commit votes.
            quorum_timeout: deadline of one quorum request.
            connect_timeout: deadline for connecting to the store and manager server.
            rank: group rank (default env ``RANK``).
            world_size: group size (default env ``WORLD_SIZE``).
            world_size_mode: see :class:`WorldSizeMode`.
            store_addr: host of the replica group's TCPStore (default env ``MASTER_ADDR``).
            store_port: port of that store (default env ``MASTER_PORT``).
            lighthouse_addr: lighthouse address (default env ``TORCHFT_LIGHTHOUSE``).
            replica_id: stable name of the replica group; a fresh uuid is appended per start.
            port: port of the manager server on group rank 0 (default env
                ``TORCHFT_MANAGER_PORT`` or 0 = any free port).
            hostname: host name other replica groups use to reach this one (default: this
                machine's); a healing group prefers an up-to-date group on its own host, or,
                with env ``WORLD_TOPOLOGY_FILE`` (and ``REPLICA_GROUP_ID``), the
                best-connected one (see docs/healing.md). Heals are served under it only when
                it is given or no heal interface is set: by default the checkpoint server
                listens on and advertises the address of env ``TORCHFT_HEAL_IFNAME`` (else
                the first interface of ``GLOO_SOCKET_IFNAME``, else of
                ``NCCL_SOCKET_IFNAME``), see docs/healing.md.
            heartbeat_interval: how often the manager server heartbeats the lighthouse.
            checkpoint_transport: how live checkpoints move between replica groups
                (default: ``HTTPTransport(timeout=timeout, num_chunks=0)``, which heals
                into the group's own tensors while the state is the one this process
                started with and into new ones after, so a heal that fails midway never
                tears a state that a restart could not give back; see docs/healing.md).
            init_sync: at step 0 make every replica group heal from one primary so all start
                from identical weights.
            max_retries: raise ``RuntimeError`` after more than this many consecutive failed
                commits (None = retry forever).
            quorum_retries: how often the manager server retries a failed lighthouse quorum.
            telemetry: report per-step timings and health to the lighthouse (fail-open; default
                env ``TORCHFT_TELEMETRY``, else on). See :mod:`torchft.telemetry`.
            hang_action: what the process does when the lighthouse holds its group hung
                (its training loop stayed away from the manager past the hang timeout):
                ``"exit"`` dumps every thread's stack and exits with code 76 for the
                supervisor to restart it, ``"keep"`` dumps and stays (default env
                ``TORCHFT_HANG_ACTION``, else ``"exit"``). See :mod:`torchft.hang`.
            parity_every: runtime state parity: every this many committed steps each rank
                digests its committed user state off the training thread and the lighthouse
                compares the groups' digests; a group that disagrees with a strict majority
                heals from it, and with no majority the groups stop with
                :class:`StateDivergedError` (default env ``TORCHFT_PARITY_EVERY``, else 100;
                0 = off). See :mod:`torchft.parity`.
            snapshot_dir: durable snapshots: a directory shared by every replica group
                (default env ``TORCHFT_SNAPSHOT_DIR``, else off). Every ``snapshot_every``
                committed steps one participating group (a different one each time) writes
                its committed state there with ``torch.distributed.checkpoint`` in the
                background; a job whose every group died resumes from the newest complete
                snapshot instead of step 0. See :mod:`torchft.snapshot` and
                docs/snapshots.md.
            snapshot_every: committed steps between snapshots (default env
                ``TORCHFT_SNAPSHOT_EVERY``, else 500).
            snapshot_keep: complete snapshots kept (default env ``TORCHFT_SNAPSHOT_KEEP``,
                else 3).

        Raises:
            ValueError: on invalid arguments or missing configuration, or a heal interface
                that does not exist or has no address (nothing is started then).
            TypeError: on arguments of the wrong type.
        """
        # ---- arguments and environment, resolved in one place (fail fast, clearly) ----
        hostname_given = not isinstance(hostname, _ThisHost)
        cfg = ManagerConfig.resolve(
            min_replica_size=min_replica_size,
            use_async_quorum=use_async_quorum,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            rank=rank,
            world_size=world_size,
            world_size_mode=world_size_mode,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse_addr,
            replica_id=replica_id,
            port=port,
            hostname=hostname if hostname_given else None,
            heartbeat_interval=heartbeat_interval,
            init_sync=init_sync,
            max_retries=max_retries,
            quorum_retries=quorum_retries,
            telemetry=telemetry,
            hang_action=hang_action,
            parity_every=parity_every,
            snapshot_dir=snapshot_dir,
            snapshot_every=snapshot_every,
            snapshot_keep=snapshot_keep,
        )
        if (load_state_dict is None) != (state_dict is None):
            raise ValueError("load_state_dict and state_dict must be given together (or neither)")

        self._config = cfg
        # A torch group created with enable_reconfigure=True is driven through a handle
        # exchange (torchft.process_group.native); torchft's own groups are used as given.
        from torchft.process_group.native import manager_group

        pg = manager_group(pg, cfg.timeout)
        self._pg = pg
        self._min_replica_size = cfg.min_replica_size
        self._use_async_quorum = cfg.use_async_quorum
        self._timeout = cfg.timeout
        self._quorum_timeout = cfg.quorum_timeout
        self._connect_timeout = cfg.connect_timeout
        self._group_rank: int = cfg.rank
        self._group_world_size: int = cfg.world_size
        self._world_size_mode = cfg.world_size_mode
        self._init_sync = cfg.init_sync
        self._max_retries = cfg.max_retries
        self._job_id = cfg.job_id

        # ---- user state ----
        self._load_state_dict_fns: dict[str, Callable[[Any], None]] = {}
        self._user_state_dicts: dict[str, Callable[[], Any]] = {}
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn(DEFAULT_STATE_DICT_KEY, load_state_dict, state_dict)
        self._state_dict_lock = ReadWriteLock()
        self._write_locked = False
        self._parity = StateParity(
            cfg.parity_every,
            lambda: {k: fn() for k, fn in self._user_state_dicts.items()},
        )

        # ---- per-step state ----
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_id = -1
        self._errored: ExceptionWithTraceback | None = None
        self._error_lock = threading.Lock()
        self._healing = False
        # A failed in-place heal left the local tensors partly overwritten (see _heal), and
        # the error that ends the process when nothing can make them whole again.
        self._state_torn = False
        self._torn_for_good: TornStateError | None = None
        # Set once the parity check stopped this group (raised from should_commit).
        self._diverged: Exception | None = None
        # Whether the state is still the one this process's start-up produced, which a
        # restart reproduces: no step committed, no heal applied yet (see _heal_into).
        self._startup_state = True
        self._pending_state_dict: dict[str, Any] | None = None
        self._pending_futures: list[Future[Any]] = []
        # This rank turned a collective of the step into a no-op (the step had errored): its
        # peers may be waiting on it, so the vote aborts the quorum's group (see should_commit).
        self._skipped_collective = False
        self._quorum_future: ConcurrentFuture[None] | _PendingQuorumFuture | None = None
        self._participating_replica_rank: int | None = None
        self._participating_replica_world_size: int = 0
        self._replica_rank: int | None = None
        self._replica_world_size: int = 0
        # Failure detection: the lighthouse's lost-member events abort the current quorum's
        # process group. `_reconfig_lock` orders that abort with switching to a new quorum.
        self._reconfig_lock = threading.Lock()
        self._pg_aborted = False
        self._quorum_in_progress = False
        # Collectives of the step issued through `allreduce` and not completed yet, and the
        # error an abort for a loss recorded in the group when there were none (that abort
        # alone does not fail the step). The abort completes futures (and runs their
        # callbacks) under `_reconfig_lock`, so the count has a lock of its own.
        self._inflight_lock = threading.Lock()
        self._collectives_in_flight = 0
        self._loss_abort_error: Exception | None = None
        # Members declared lost, per quorum id (a few recent quorums): a quorum answer that
        # arrives after its member's loss must not rendezvous with the dead member.
        self._lost_in: dict[int, set[str]] = {}
        self._watcher: LostWatcher | None = None
        # The replica group this rank is healing from, and the flag that ends the heal
        # when the lighthouse declares that group lost.
        self._heal_source: str | None = None
        self._heal_lost = threading.Event()
        # Durable snapshots (torchft.group_snapshots, once the group's id is known), and a
        # snapshot's state loaded while this process held its start-up state, applied after
        # the vote of the step that loaded it.
        self._snapshots: GroupSnapshots | None = None
        self._pending_restore: tuple[Snapshot, dict[str, Any]] | None = None

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchft_quorum")
        self._manager: NativeManagerServer | None = None
        self._client: NativeManagerClient | None = None
        self._telemetry: RankTelemetry | None = None
        self._shutdown = False

        if hasattr(pg, "set_timeout"):
            pg.set_timeout(cfg.timeout)

        # ---- checkpoint transport ----
        self._own_transport = checkpoint_transport is None
        if checkpoint_transport is None:
            from torchft.checkpointing import HTTPTransport

            checkpoint_transport = HTTPTransport(
                timeout=cfg.timeout,
                num_chunks=0,
                # Into this group's own tensors while that loses nothing (see _heal_into).
                state_dict=self._heal_into,
                state_dict_lock=self._state_dict_lock.read,
                state_version=self._state_dict_lock.version,
                # A given host name wins over the heal interface; without one, the
                # transport serves on the interface's address (docs/healing.md).
                hostname=cfg.hostname if hostname_given or heal_ifname() is None else None,
            )
        self._checkpoint_transport: CheckpointTransport[dict[str, Any]] = checkpoint_transport

        # ---- store, manager server, client ----
        self._store_addr = cfg.store_addr
        self._store_port = cfg.store_port
        base_id = cfg.replica_id if cfg.replica_id is not None else ""
        # torchrun restarts dead workers inside its agent, whose store keeps what the dead
        # incarnation wrote: the key names the restart, so no rank reads a dead address.
        key = f"torchft/manager/{base_id}/{cfg.restart_count}/addr"
        try:
            # Inside the try: a store that cannot be reached must not leave the checkpoint
            # server (started above) serving.
            self._store = TCPStore(
                host_name=cfg.store_addr,
                port=cfg.store_port,
                is_master=False,
                wait_for_workers=False,
                timeout=cfg.connect_timeout,
            )
            if self._group_rank == 0:
                full_id = f"{base_id}:{uuid.uuid4()}" if base_id else str(uuid.uuid4())
                self._manager = _torchft.ManagerServer(
                    replica_id=full_id,
                    lighthouse_addr=cfg.lighthouse_addr,
                    hostname=cfg.hostname,
                    bind=f"[::]:{cfg.port}",
                    store_addr=f"{cfg.store_addr}:{cfg.store_port}",
                    world_size=cfg.world_size,
                    heartbeat_interval=cfg.heartbeat_interval,
                    connect_timeout=cfg.connect_timeout,
                    quorum_retries=cfg.quorum_retries,
                    topology_file=cfg.topology_file,
                    topology_group=cfg.replica_group_index,
                )
                published = json.dumps({"address": self._manager.address(), "replica_id": full_id})
                self._store.set(key, published)
            info = json.loads(self._store.get(key).decode())
            self._replica_id: str = info["replica_id"]
            _torchft.set_log_context(self._replica_id, self._group_rank)
            manager_address: str = info["address"]
            self._client = _torchft.ManagerClient(
                manager_address, connect_timeout=cfg.connect_timeout
            )
            self._telemetry = RankTelemetry(
                self._client,
                replica_id=base_id or self._replica_id,
                incarnation=self._replica_id,
                group_rank=self._group_rank,
                group_world_size=self._group_world_size,
                hostname=cfg.hostname,
                enabled=cfg.telemetry,
            )
            self._watcher = LostWatcher(self._client, self._on_lost)
            if cfg.snapshot_dir is not None:
                self._snapshots = GroupSnapshots(
                    cfg.snapshot_dir,
                    every=cfg.snapshot_every,
                    keep=cfg.snapshot_keep,
                    name=base_id or self._replica_id,
                    replica_id=self._replica_id,
                    group_rank=self._group_rank,
                    group_world_size=self._group_world_size,
                    timeout=cfg.timeout,
                    store=self._store,
                    connect_timeout=cfg.connect_timeout,
                    telemetry=self._telemetry,
                    log_info=self._log_info,
                )
            if self._manager is not None:
                # The hosting rank acts on the lighthouse's hang verdict (torchft.hang).
                self._hang_watchdog = HangWatchdog(
                    self._manager.hung,
                    cfg.hang_action,
                    self._replica_id,
                    describe=self._manager.describe,
                    last_words=self._hang_last_words,
                ).start()
        except BaseException:
            self.shutdown(wait=False)
            raise
        self._log_info(
            "manager ready: replica_id=%s group_rank=%d/%d manager=%s async_quorum=%s",
            self._replica_id,
            self._group_rank,
            self._group_world_size,
            manager_address,
            cfg.use_async_quorum,
        )

    # ------------------------------------------------------------------ logging helpers

    def _log_info(self, msg: str, *args: object) -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                f"[{getattr(self, '_replica_id', '?')}/{self._group_rank} step {self._step}] "
                + msg,
                *args,
            )

    def _record(self, target: logging.Logger, **fields: object) -> None:
        """Emits a structured record (fields in ``extra``) on one of the torchft loggers."""
        if not target.isEnabledFor(logging.INFO):
            return
        extra = {
            "job_id": self._job_id,
            "replica_id": self._replica_id,
            "rank": self._group_rank,
            "quorum_id": self._quorum_id,
            "step": self._step,
        }
        extra.update(fields)
        target.info(" ".join(f"{k}={v}" for k, v in extra.items()), extra=extra)

    # ------------------------------------------------------------------ state dicts

    def _hang_last_words(self, report: str) -> None:
        """Before a hung process ends itself: its report (verdict, native state, stacks) as
        this rank's last telemetry report, then the manager server closed, which delivers
        it and ends the group's session at once."""
        tel = self._telemetry
        if tel is not None:
            tel.finish(HungProcessError(report), step=self._step)
        server = self._manager
        if server is not None:
            server.shutdown()

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers one piece of user state that is sent to / loaded from healing peers.

        Args:
            key: unique name of the state (e.g. ``"model"``, ``"optim"``).
            load_state_dict: loads a received state dict.
            state_dict: returns the current state dict (tensors are serialised lazily, under
                the read lock, when a peer fetches them).

        Raises:
            ValueError: if ``key`` is already registered.
        """
        if key in self._load_state_dict_fns:
            raise ValueError(f"state dict key {key!r} is already registered")
        self._load_state_dict_fns[key] = cast(Callable[[Any], None], load_state_dict)
        self._user_state_dicts[key] = state_dict

    def set_state_dict_fns(
        self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Sets (or replaces) the default state dict functions (legacy single-key API).

        Deprecated: use :meth:`register_state_dict_fn` with a key per piece of state.

        Args:
            load_state_dict: loads a received state dict.
            state_dict: returns the current state dict.
        """
        warnings.warn(
            "Manager.set_state_dict_fns is deprecated; use "
            "register_state_dict_fn(key, load_state_dict, state_dict) instead",
            DeprecationWarning,
            stacklevel=2,
        )
        self._load_state_dict_fns[DEFAULT_STATE_DICT_KEY] = cast(
            Callable[[Any], None], load_state_dict
        )
        self._user_state_dicts[DEFAULT_STATE_DICT_KEY] = state_dict

    def state_dict(self) -> dict[str, int]:
        """Returns the manager's own counters, to be saved with a regular checkpoint.

        Returns:
            ``{"step": int, "batches_committed": int}``.
        """
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores the manager's counters (e.g. after loading a regular checkpoint).

        Args:
            state_dict: a dict produced by :meth:`state_dict`.
        """
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def _manager_state_dict(self) -> dict[str, Any]:
        """The full state served to healing peers: user state plus the manager counters."""
        return {
            "user": {key: fn() for key, fn in self._user_state_dicts.items()},
            "torchft": self.state_dict(),
        }

    def allow_state_dict_read(self) -> None:
        """Allows checkpoint transports to read the state dict again (after optimizer step)."""
        if self._write_locked:
            self._write_locked = False
            self._state_dict_lock.release_write()

    def disallow_state_dict_read(self) -> None:
        """Blocks checkpoint reads while parameters change (around the optimizer step).

        Waits for a serialisation in progress to finish first.
        """
        if not self._write_locked:
            self._state_dict_lock.acquire_write()
            self._write_locked = True

    # ------------------------------------------------------------------ errors

    def report_error(self, e: Exception) -> None:
        """Records an error of the current step; the step will not commit.

        Args:
            e: the error (kept with its traceback; the first error of a step wins).
        """
        wrapped = e if isinstance(e, ExceptionWithTraceback) else ExceptionWithTraceback(e)
        original = wrapped.original_exception if isinstance(e, ExceptionWithTraceback) else e
        if isinstance(original, StateDivergedError):
            # Not a step error: the parity check stopped this group for good.
            self._diverged = original
        with self._error_lock:
            first = self._errored is None
            if first:
                self._errored = wrapped
        if first:
            logger.warning(
                "[%s/%d step %d] error reported, step will not commit: %s",
                getattr(self, "_replica_id", "?"),
                self._group_rank,
                self._step,
                wrapped,
            )
            self._record(_error_logger, error=str(wrapped))

    def errored(self) -> ExceptionWithTraceback | None:
        """Returns the error recorded for the current step, if any."""
        return self._errored

    def wrap_future(
        self, fut: Future[T], default: T, timeout: timedelta | None = None
    ) -> Future[T]:
        """Returns a future that never fails: errors and timeouts become ``default``.

        The error (or a ``TimeoutError``) is recorded with :meth:`report_error`.

        Args:
            fut: the future to wrap.
            default: value of the returned future when ``fut`` fails or times out.
            timeout: optional deadline for ``fut``.

        Returns:
            A torch future resolving to ``fut``'s value or ``default``.
        """
        source = future_timeout(fut, timeout) if timeout is not None else fut

        def settle(f: Future[T]) -> T:
            try:
                return f.value()
            except Exception as e:
                self.report_error(e)
                return default

        return source.then(settle)

    # ------------------------------------------------------------------ quorum

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: timedelta | None = None,
    ) -> None:
        """Starts the quorum of a new step (call at the start of every step).

        Clears the previous step's error state, then runs the quorum on the background thread
        (or inline with ``use_async_quorum=False``; healing is then done before returning).

        Args:
            allow_heal: heal from / serve live checkpoints to peers if needed.
            shrink_only: only allow the quorum to shrink (no new members).
            timeout: quorum deadline (default: ``quorum_timeout``).

        Raises:
            TimeoutError: with ``use_async_quorum=False``, the quorum deadline passed (as
                upstream torchft: the message carries "status: Cancelled" and "Timeout
                expired"). With the async quorum it surfaces from :meth:`wait_quorum` or
                :meth:`should_commit` instead. Other failures are recorded, never raised:
                the step does not commit.
        """
        if self._shutdown:
            raise RuntimeError("Manager is shut down")
        if self._quorum_future is not None and not self._quorum_future.done():
            # The single worker serialises quorums anyway; wait so state is not overwritten.
            try:
                self._quorum_future.result()
            except Exception:
                pass
        with self._error_lock:
            self._errored = None
        self._loss_abort_error = None
        self._healing = False
        self._pending_futures = []
        self._skipped_collective = False
        if self._pending_state_dict is not None:
            # A heal whose step did not commit (an error after it) left its user state
            # unloaded while the counters already name its step: load it before this step's
            # forward pass, so the gradients this group contributes are taken on that state.
            try:
                self._apply_pending_state_dict()
            except Exception as e:
                self.report_error(e)
        if self._snapshots is not None and not self._state_torn:
            self._snapshots.at_step_start(self._step, self._manager_state_dict)
        if not self._state_torn:
            try:
                self._parity.at_step_start(self._step)
            except Exception:
                # Fail-open: parity never stops training by failing itself.
                logger.exception("state digest of step %d not taken", self._step)
        quorum_timeout = timeout if timeout is not None else self._quorum_timeout
        if self._use_async_quorum:
            self._quorum_future = self._start_async_quorum(allow_heal, shrink_only, quorum_timeout)
        else:
            fut: ConcurrentFuture[None] = ConcurrentFuture()
            self._quorum_future = fut
            try:
                with self._timing_quorum(), self._in_torchft():
                    self._run_quorum(allow_heal, shrink_only, quorum_timeout)
                fut.set_result(None)
            except BaseException as e:
                # Raised here, as upstream's synchronous quorum does, and again from
                # wait_quorum()/should_commit() (the step cannot commit without a quorum).
                fut.set_exception(e)
                raise

    def wait_quorum(self) -> None:
        """Waits for the quorum started by :meth:`start_quorum`.

        Raises:
            TimeoutError: if the quorum request timed out.
            RuntimeError: if no quorum was started.
        """
        fut = self._quorum_future
        if fut is None:
            raise RuntimeError("wait_quorum() called before start_quorum()")
        # The quorum RPC and the heal each carry their own deadline; this bound is a backstop.
        limit = (self._quorum_timeout + 2 * self._timeout + self._connect_timeout).total_seconds()
        try:
            with self._timing_quorum(), self._in_torchft():
                fut.result(timeout=limit)
        except FutureTimeoutError:
            # concurrent.futures' TimeoutError is the built-in one: a quorum that itself
            # ended in a TimeoutError is re-raised as it is, not as this backstop's.
            if fut.done():
                raise
            raise TimeoutError(f"quorum did not finish within {limit:.1f}s") from None

    @contextmanager
    def _in_torchft(self) -> Iterator[None]:
        """Marks the training loop as inside torchft (a quorum, its process group, a heal, a
        vote): however long it takes, the lighthouse does not count it as away (hang watch)."""
        server = self._manager
        if server is None:
            yield
            return
        server.set_loop_busy(True)
        try:
            yield
        finally:
            server.set_loop_busy(False)

    def _timing_quorum(self) -> Any:
        """Context counting the time inside it as blocked on the quorum (telemetry)."""
        tel = self._telemetry
        return tel.quorum_wait() if tel is not None and tel.enabled else nullcontext()

    def _run_quorum(self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta) -> None:
        """Runs one quorum; errors other than the quorum deadline are recorded, not raised."""
        self._quorum_in_progress = True
        try:
            self._quorum_body(allow_heal, shrink_only, quorum_timeout)
        except _QuorumTimeoutError as e:
            self.report_error(e)
            raise
        except Exception as e:
            self.report_error(e)
        finally:
            self._quorum_in_progress = False

    # ------------------------------------------------------------------ failure detection

    def _on_lost(self, replica_id: str, quorum_id: int) -> None:
        """Aborts the current quorum's process group when one of its members is lost.

        The collectives in flight fail at once instead of at their timeout, and so does any
        the step issues later: the step then does not commit, and the next quorum (without
        the lost group) reconfigures the group. A step whose collectives had all completed
        before the loss still commits: they hold every member's data, and the lost group may
        itself have committed the step (it finished, or died after its vote), so abandoning
        the step here would leave two states under one step number.

        Args:
            replica_id: the lost replica group.
            quorum_id: the quorum it was lost from (events of older quorums are ignored).
        """
        with self._reconfig_lock:
            if self._shutdown or replica_id == self._replica_id:
                return
            self._lost_in.setdefault(quorum_id, set()).add(replica_id)
            while len(self._lost_in) > 8:
                del self._lost_in[min(self._lost_in)]
            if quorum_id != self._quorum_id:
                return
            self._pg_aborted = True
            logger.warning(
                "[%s/%d step %d] replica group %s of quorum %d lost; aborting its collectives",
                self._replica_id,
                self._group_rank,
                self._step,
                replica_id,
                quorum_id,
            )
            with self._inflight_lock:
                idle = self._collectives_in_flight == 0
            settled = not self._quorum_in_progress and idle
            before = self._pg_error()
            if not self._quorum_in_progress and not settled:
                # The step runs on this quorum with collectives in flight: it must not commit.
                # (While a quorum request is in flight the step has not used the group yet;
                # it is rebuilt instead.)
                self.report_error(
                    RuntimeError(f"replica group {replica_id} of quorum {quorum_id} was lost")
                )
            elif settled and before is not None:
                self.report_error(before)  # the group had failed before the loss
            # Ends a configure in progress too: its rendezvous waits for the lost member. A
            # collective the step issues from now on fails at once (and the step with it).
            try:
                self._pg.abort()
            except Exception:
                logger.exception("aborting the process group failed")
            if settled:
                # The abort's own error is no reason to abandon a step whose collectives
                # had all completed (see should_commit).
                self._loss_abort_error = self._pg_error()
            if replica_id == self._heal_source:
                # Its state will never arrive: end the heal now, the next quorum picks
                # another source.
                self._heal_lost.set()
                try:
                    self._checkpoint_transport.abort_recv()
                except Exception:
                    logger.exception("aborting the checkpoint transfer failed")

    def _pg_error(self) -> Exception | None:
        """The error the quorum's process group recorded since its configure, if any."""
        pg_errored = getattr(self._pg, "errored", None)
        return pg_errored() if pg_errored is not None else None

    def _adopt_quorum(self, quorum: NativeQuorumResult, allow_heal: bool) -> None:
        """Adopts an answer of an async quorum; errors are recorded, not raised."""
        try:
            self._apply_quorum(quorum, allow_heal)
        except Exception as e:
            self.report_error(e)

    def _start_async_quorum(
        self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta
    ) -> ConcurrentFuture[None] | _PendingQuorumFuture:
        """Starts the quorum of an async step.

        The request is sent by the native client without waiting, and the answer is handled
        by the first :meth:`wait_quorum` (usually from the first allreduce): a helper thread
        woken at every step would fight the training thread for the GIL during the forward
        pass.
        """
        # Until the answer is adopted the step has not used any process group: a loss
        # reported meanwhile rebuilds the group instead of failing the step (`_on_lost`).
        self._quorum_in_progress = True
        try:
            pending = self._rpc()._quorum_start(**self._quorum_request(shrink_only, quorum_timeout))
        except Exception as e:
            self._quorum_in_progress = False
            # Same contract as _run_quorum: recorded, the step does not commit.
            self.report_error(e)
            done: ConcurrentFuture[None] = ConcurrentFuture()
            done.set_result(None)
            return done
        return _PendingQuorumFuture(self, pending, allow_heal, quorum_timeout)

    def _rpc(self) -> NativeManagerClient:
        """The manager client; raises once the Manager is shut down."""
        client = self._client
        if client is None:
            raise RuntimeError("Manager is shut down")
        return client

    def _quorum_request(self, shrink_only: bool, quorum_timeout: timedelta) -> dict[str, Any]:
        """Keyword arguments of this rank's quorum request."""
        return {
            "group_rank": self._group_rank,
            "step": self._step,
            "checkpoint_metadata": self._checkpoint_transport.metadata(),
            "shrink_only": shrink_only,
            "timeout": quorum_timeout,
            "commit_failures": self._commit_failures,
            "init_sync": self._init_sync,
        }

    def _quorum_body(self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta) -> None:
        try:
            quorum = self._rpc()._quorum(**self._quorum_request(shrink_only, quorum_timeout))
        except TimeoutError as e:
            # Only the quorum deadline itself surfaces to the caller; timeouts while
            # reconfiguring or healing are ordinary step errors (recorded, retried).
            raise _QuorumTimeoutError(f"quorum not reached within {quorum_timeout}: {e}") from e
        self._apply_quorum(quorum, allow_heal)

    def _apply_quorum(self, quorum: NativeQuorumResult, allow_heal: bool) -> None:
        """Adopts a quorum answer: roles, process group, serving and fetching live state."""
        quorum_id: int = quorum.quorum_id
        replica_rank: int = quorum.replica_rank
        replica_world_size: int = quorum.replica_world_size
        max_step: int = quorum.max_step
        heal: bool = bool(quorum.heal) and allow_heal
        restored: Snapshot | None = None
        if self._snapshots is not None and self._startup_state and allow_heal:
            # First, while nothing of this answer is acted on yet: every rank of the group
            # reaches it, so the choice shared through the store is never waited for in vain.
            restored = self._restore_snapshot(quorum_id, max_step)
        if self._state_torn and not heal:
            # A failed in-place heal left this group's tensors partly overwritten: going on
            # would train, and later serve, a state no step ever had.
            if allow_heal and not quorum.heal:
                # No group ahead of this one is left (the lighthouse no longer waits for
                # one): nothing can make the state whole again, and a restart reproduces
                # what the heal began from. End the process instead of failing every step.
                self._torn_for_good = TornStateError(
                    "this replica group's state was partly overwritten by a heal that "
                    "failed, and no up-to-date replica group is left to heal it again: "
                    "restart the group (it then starts as it did before the heal, or loads "
                    "a durable checkpoint)"
                )
                raise self._torn_for_good
            raise RuntimeError(
                "this replica group's state was partly overwritten by a heal that failed; "
                "it does not train until a heal makes it whole"
            )

        # Who contributes gradients this step. A rank that heals in the background (async
        # quorum), or that is behind and may not heal, has stale weights: it sits out and
        # sends zeros. In sync mode a healing rank is up to date before the forward pass.
        if self._use_async_quorum or not allow_heal:
            participating_rank: int | None = quorum.max_replica_rank
            participating_world: int = quorum.max_world_size
        else:
            participating_rank = replica_rank
            participating_world = replica_world_size
        if self._world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
            participating_world = min(participating_world, self._min_replica_size)
            if participating_rank is not None and participating_rank >= self._min_replica_size:
                participating_rank = None
        self._replica_rank = replica_rank
        self._replica_world_size = replica_world_size
        self._participating_replica_rank = participating_rank
        self._participating_replica_world_size = participating_world

        with self._reconfig_lock:
            lost = self._lost_in.get(quorum_id, set()) & set(quorum.replica_ids)
            if lost:
                # The answer was issued before a member died: its group can never form (the
                # rendezvous would wait for the dead member until the timeout). The step fails
                # now; the next quorum, without that member, rebuilds the group.
                self._pg_aborted = True
                raise RuntimeError(
                    f"replica group(s) {sorted(lost)} of quorum {quorum_id} were lost "
                    "before this rank adopted it"
                )
            # An aborted group (a member was lost) is rebuilt even if the id did not change.
            reconfigure = quorum_id != self._quorum_id or self._pg_aborted
            if reconfigure:
                # Mark the new id before configuring: if configure fails the step is errored,
                # and the next quorum must not reuse a half-built group silently.
                self._quorum_id = quorum_id
                self._pg_aborted = False
                self._loss_abort_error = None
        if reconfigure:
            store_prefixed_addr = f"{quorum.store_address}/torchft/{quorum_id}/{self._group_rank}"
            self._log_info(
                "reconfiguring for quorum_id=%d replica_rank=%d/%d store=%s",
                quorum_id,
                replica_rank,
                replica_world_size,
                store_prefixed_addr,
            )
            try:
                self._pg.configure(
                    store_prefixed_addr, self._replica_id, replica_rank, replica_world_size
                )
            except Exception:
                self._quorum_id = -1
                raise
        self._record(
            _quorum_logger,
            replica_rank=replica_rank,
            replica_world_size=replica_world_size,
            participating_rank=participating_rank,
            num_participants=participating_world,
            max_step=max_step,
            heal=heal,
        )

        if restored is not None:
            # After configuring: the peers' rendezvous completes, and this group's skipped
            # collectives fail their step at once instead of at their timeout.
            raise RuntimeError(
                f"restored the snapshot of step {restored.step} from {restored.path} under "
                f"quorum {quorum_id}; this step's forward pass ran on the previous state, so "
                "it does not commit"
            )

        if allow_heal:
            dst_ranks = list(quorum.recover_dst_replica_ranks)
            if dst_ranks:
                self._log_info("serving checkpoint of step %d to replicas %s", max_step, dst_ranks)
                self._checkpoint_transport.send_checkpoint(
                    dst_ranks=dst_ranks,
                    step=max_step,
                    state_dict=self._manager_state_dict(),
                    timeout=self._timeout,
                )
            if heal:
                self._heal(quorum, max_step)

    def _heal(self, quorum: NativeQuorumResult, max_step: int) -> None:
        """Fetches the live state of step ``max_step`` from the quorum's recovery source."""
        # However long the heal takes (also on the quorum thread), the loop is not away.
        with self._in_torchft():
            self._heal_body(quorum, max_step)

    def _heal_body(self, quorum: NativeQuorumResult, max_step: int) -> None:
        self._healing = True
        src_rank = quorum.recover_src_replica_rank
        src_addr = quorum.recover_src_manager_address
        if src_rank is None or not src_addr:
            raise RuntimeError(f"told to heal without a recovery source: {quorum}")
        self._log_info("healing from replica %d (%s) at step %d", src_rank, src_addr, max_step)
        tel = self._telemetry
        if tel is not None:
            tel.heal_started(self._step, quorum.quorum_id)
        heal_t0 = time.perf_counter()
        replica_ids = list(quorum.replica_ids)
        src_id = replica_ids[src_rank] if 0 <= src_rank < len(replica_ids) else None
        with self._reconfig_lock:
            self._heal_lost.clear()
            self._heal_source = src_id
            lost_already = src_id is not None and src_id in self._lost_in.get(
                quorum.quorum_id, set()
            )
        try:
            if lost_already:
                raise ConnectionError(f"heal source {src_id} was lost before the heal began")
            src_client = _torchft.ManagerClient(src_addr, connect_timeout=self._connect_timeout)
            metadata = self._until_source_lost(
                lambda t: src_client._checkpoint_metadata(self._group_rank, timeout=t),
                f"checkpoint metadata from {src_addr}",
            )
            heal_addr = _heal_address(metadata)
            self._log_info(
                "fetching the checkpoint of step %d from replica %d at %s",
                max_step,
                src_rank,
                heal_addr or metadata,
            )
            in_place = self._receives_in_place()
            try:
                with self._writing_state(in_place):
                    received = self._checkpoint_transport.recv_checkpoint(
                        src_rank=src_rank, metadata=metadata, step=max_step, timeout=self._timeout
                    )
                if (
                    not isinstance(received, dict)
                    or "torchft" not in received
                    or "user" not in received
                ):
                    raise RuntimeError("received a checkpoint without 'torchft'/'user' sections")
            except BaseException:
                # A transport that says the receive failed before writing into this group's
                # tensors (e.g. the source died before sending its header) left them whole.
                if in_place and getattr(self._checkpoint_transport, "touched_local_state", True):
                    # Part of this group's tensors may hold the source's bytes now: only a
                    # later heal makes the state whole again (see _apply_quorum).
                    self._state_torn = True
                raise
        finally:
            with self._reconfig_lock:
                self._heal_source = None
        heal_s = time.perf_counter() - heal_t0
        source = _group_name(src_id) if src_id is not None else src_addr
        heal_bytes = tel.heal_done(heal_s, received, source, heal_addr) if tel is not None else 0
        self._log_info(
            "healed to step %d from %s: %d bytes in %.3fs (%.3f GB/s) into %s tensors",
            max_step,
            f"{source} at {heal_addr}" if heal_addr else source,
            heal_bytes,
            heal_s,
            heal_bytes / heal_s / 1e9 if heal_s > 0 else 0.0,
            "its own" if in_place else "new",
        )
        # The counters apply at once so the commit vote is for the healed step.
        self.load_state_dict(received["torchft"])
        self._state_torn = False
        self._torn_for_good = None
        # The healed state is no start-up state: if its source dies, it may be the best left.
        self._startup_state = False
        self._pending_state_dict = received["user"]
        if not self._use_async_quorum:
            self._apply_pending_state_dict()

    def _heal_into(self) -> dict[str, Any] | None:
        """The state the default transport receives a heal into (None: new tensors).

        The group's own tensors while this process has neither committed a step nor applied
        a heal: its state is then the one its start-up produced (initialised, or loaded from
        a durable checkpoint), which a restart reproduces, so a heal that fails midway and
        leaves the tensors torn loses nothing a restart would not give back. This is the
        common heal (a restarted group catching up) and it needs no memory beyond the
        group's own tensors. After that, the state may be the best one left if the source
        is lost midway: the heal then receives into new tensors and leaves it whole.
        """
        if not self._startup_state:
            return None
        return self._manager_state_dict()

    def _receives_in_place(self) -> bool:
        """Whether the next heal writes into this group's own tensors."""
        if self._own_transport:
            return self._startup_state
        return bool(getattr(self._checkpoint_transport, "receives_in_place", False))

    @contextmanager
    def _writing_state(self, in_place: bool) -> Iterator[None]:
        """Holds the state's write lock while a receive writes into this group's own tensors,
        so an optimizer step on the training thread (a DiLoCo inner step during an async
        quorum) waits instead of racing it, and no reader serves the half-written state."""
        if not in_place or self._state_dict_lock.held_by_me():
            if in_place:
                self._settle_state_readers()
            yield
            return
        self._settle_state_readers()
        if not self._state_dict_lock.acquire_write(self._timeout.total_seconds()):
            raise TimeoutError(
                f"the state stayed locked by a writer for {self._timeout}; cannot heal into it"
            )
        try:
            yield
        finally:
            self._state_dict_lock.release_write()

    def _until_source_lost(self, call: Callable[[timedelta], T], what: str) -> T:
        """Runs ``call(timeout)`` within ``timeout`` in slices of at most a second, so a
        source that is stopped (alive to TCP, silent) is abandoned within a second of being
        declared lost instead of at the timeout.

        Raises:
            ConnectionError: the heal source was declared lost.
            TimeoutError: ``timeout`` passed.
        """
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            if self._heal_lost.is_set():
                raise ConnectionError(f"{what}: the heal source was declared lost")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} did not answer within {self._timeout}")
            try:
                return call(timedelta(seconds=min(remaining, _SOURCE_POLL_S)))
            except TimeoutError:
                continue

    def _apply_pending_state_dict(self) -> None:
        """Loads healed user state into the registered loaders."""
        pending = self._pending_state_dict
        if pending is None:
            return
        self._settle_state_readers()
        self._pending_state_dict = None
        try:
            missing = set(self._load_state_dict_fns) - set(pending)
            if missing:
                raise RuntimeError(f"healed checkpoint lacks state for keys {sorted(missing)}")
            for key, load_fn in self._load_state_dict_fns.items():
                load_fn(pending[key])
        except BaseException:
            # The counters name the healed step but the state is not (all) of it: the group
            # does not train on it until a heal makes it whole (see _apply_quorum).
            self._state_torn = True
            raise
        self._log_info("applied healed state (%d keys)", len(pending))

    # ------------------------------------------------------------------ collectives

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    ) -> Work:
        """Allreduces ``tensor`` in place across the participating replica groups.

        Never raises for communication errors: they are recorded with :meth:`report_error`,
        the returned work still resolves to ``tensor``, and later collectives of the step
        become no-ops. Non-participants (healing ranks, spares) contribute zeros.

        Args:
            tensor: the tensor to reduce in place.
            should_quantize: request a quantized allreduce. Not implemented for this transport;
                falls back to the full-precision path (logged at debug level).
            reduce_op: ``ReduceOp.AVG`` (sum divided by the number of participants) or another
                reduce op passed to the process group unchanged.

        Returns:
            A ``Work`` whose future resolves to ``tensor``.
        """
        if self._errored is not None:
            self._skipped_collective = True
            return _DummyWork(tensor)
        try:
            self.wait_quorum()
        except Exception as e:
            self.report_error(e)
            self._skipped_collective = True
            return _DummyWork(tensor)
        if self._errored is not None:
            self._skipped_collective = True
            return _DummyWork(tensor)

        num_participants = self._participating_replica_world_size
        if self._participating_replica_rank is None:
            tensor.zero_()
        if should_quantize:
            logger.debug("quantized allreduce not available; using full precision")

        tel = self._telemetry
        token = tel.collective_started() if tel is not None else None
        with self._inflight_lock:
            self._collectives_in_flight += 1
        # A collective in flight is the loop inside torchft (the reducer waits for it inside
        # backward, outside any other torchft call): never "away" for the hang watch. The
        # collective's own timeout (an error, or the group's abort) bounds it.
        server = self._manager
        if server is not None:
            server.set_loop_busy(True)
        try:
            avg = reduce_op == ReduceOp.AVG
            op = ReduceOp.SUM if avg else reduce_op
            work = self._pg.allreduce([tensor], op)
            fut = work.get_future()

            divisor = num_participants if avg and num_participants > 0 else 0
            floating = tensor.is_floating_point() or tensor.is_complex()

            # One callback does the averaging and the error swallowing (one GIL acquisition
            # on the backend thread per bucket instead of two).
            def finish(f: Future[Any]) -> torch.Tensor:
                if tel is not None:
                    tel.collective_finished(token)
                if server is not None:
                    server.set_loop_busy(False)
                try:
                    f.value()
                except Exception as e:
                    self.report_error(e)
                    return tensor
                finally:
                    with self._inflight_lock:
                        self._collectives_in_flight -= 1
                if divisor:
                    if floating:
                        tensor.div_(divisor)
                    else:
                        tensor.floor_divide_(divisor)
                return tensor

            chained = fut.then(finish)
            self._pending_futures.append(chained)
            return _FutureWork(chained)
        except Exception as e:
            if tel is not None:
                tel.collective_finished(token)  # never started: not in flight
            with self._inflight_lock:
                self._collectives_in_flight -= 1
            if server is not None:
                server.set_loop_busy(False)
            self.report_error(e)
            self._skipped_collective = True
            return _DummyWork(tensor)

    # ------------------------------------------------------------------ commit

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Votes on the step with the other ranks of the replica group; True = commit.

        Waits for the quorum and outstanding allreduces, applies healed state (async mode),
        then votes yes only if no error was recorded and enough replicas took part. On commit
        the step counter advances.

        Args:
            timeout: deadline of the vote (default: ``timeout``).

        Returns:
            Whether every rank of the replica group voted to commit.

        Raises:
            TimeoutError: if the quorum or the vote timed out.
            RuntimeError: if more than ``max_retries`` consecutive commits failed.
            TornStateError: a heal that wrote into this group's tensors failed and no group
                is left to heal it again: the process must restart (see docs/healing.md).
        """
        # Waiting for collectives and the vote is inside torchft: never counted as away.
        with self._in_torchft():
            return self._should_commit(timeout)

    def _should_commit(self, timeout: timedelta | None) -> bool:
        vote_timeout = timeout if timeout is not None else self._timeout
        # The optimizer writes the state once the vote is in: the parity hash of the state
        # must be done by then (it overlapped the step's compute).
        self._settle_state_readers()
        quorum_timed_out: TimeoutError | None = None
        try:
            self.wait_quorum()
        except TimeoutError as e:
            quorum_timed_out = e
        except Exception as e:
            self.report_error(e)
        if self._torn_for_good is not None:
            self._record(_error_logger, error=str(self._torn_for_good))
            raise self._torn_for_good
        if self._diverged is not None:
            self._record(_error_logger, error=str(self._diverged))
            raise self._diverged

        for fut in self._pending_futures:
            fut.wait()  # wrapped futures never raise
        self._pending_futures = []

        if self._skipped_collective:
            # This rank skipped collectives of the step (no-ops once errored): peers still
            # waiting on them would wait until their timeout, which may outlast this group's
            # next quorum. Once its own collectives are done (so none a peer finishes with it
            # is cut short), aborting the quorum's group ends their wait now; the next quorum
            # rebuilds it (a commit failure changes the quorum id anyway). Socket backends
            # (Gloo) fail the peers' collectives at once; an NCCL peer still waits for its own
            # timeout.
            self._skipped_collective = False
            with self._reconfig_lock:
                if self._quorum_id >= 0 and not self._pg_aborted:
                    self._pg_aborted = True
                    try:
                        self._pg.abort()
                    except Exception:
                        logger.exception("aborting the process group failed")

        err = self._pg_error()
        if err is not None and err is not self._loss_abort_error:
            self.report_error(err)

        if quorum_timed_out is None and self._errored is None:
            try:
                self._apply_pending_state_dict()
            except Exception as e:
                self.report_error(e)

        enough_replicas = self._participating_replica_world_size >= self._min_replica_size
        local_vote = quorum_timed_out is None and self._errored is None and enough_replicas
        if quorum_timed_out is not None:
            # The manager server did not answer the quorum; the vote would not find peers.
            self._commit_failures += 1
            self._checkpoint_transport.disallow_checkpoint()
            self._report_step(False, 0.0, str(quorum_timed_out))
            raise quorum_timed_out
        vote_t0 = time.perf_counter()

        digest = self._parity.take()
        if self._group_world_size == 1:
            # The server's vote is a barrier + AND over the group's ranks; with a single rank
            # it is the local vote, so the round trip is skipped (hot path of plain DDP).
            # The manager server still gates a yes: the group's lease must hold (a group frozen
            # past it may have been declared lost) and the lighthouse must accept the
            # write-ahead commit (refused when the others went on without this group).
            server = self._manager
            if server is not None and digest is not None:
                server._offer_digest(self._group_rank, *digest)
            should_commit = local_vote and (
                server is None or bool(server.may_commit(self._step, vote_timeout))
            )
        elif digest is not None:
            should_commit = bool(
                self._rpc()._should_commit_digest(
                    self._group_rank, self._step, local_vote, vote_timeout, *digest
                )
            )
        else:
            should_commit = bool(
                self._rpc().should_commit(
                    self._group_rank, self._step, local_vote, timeout=vote_timeout
                )
            )
        vote_s = time.perf_counter() - vote_t0
        self._checkpoint_transport.disallow_checkpoint()
        self._report_step(
            should_commit, vote_s, str(self._errored) if self._errored is not None else None
        )
        self._record(
            _commit_logger,
            commit=should_commit,
            local_vote=local_vote,
            num_participants=self._participating_replica_world_size,
            enough_replicas=enough_replicas,
            errored=str(self._errored) if self._errored is not None else None,
        )
        if not enough_replicas:
            logger.debug(
                "not enough replicas to commit: %d < %d",
                self._participating_replica_world_size,
                self._min_replica_size,
            )
        if should_commit:
            self._startup_state = False
            self._step += 1
            self._batches_committed += self._participating_replica_world_size
            self._commit_failures = 0
            if self._manager is not None:
                # Heartbeats carry it: the lighthouse knows this group's progress even while
                # it is not asking for a quorum (no quorum may then regress past it).
                self._manager.note_committed_step(self._step)
            if self._snapshots is not None:
                self._snapshots.committed(
                    self._step,
                    self._quorum_id,
                    self._participating_replica_rank,
                    self._participating_replica_world_size,
                )
        else:
            self._commit_failures += 1
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                msg = (
                    f"exceeded max_retries={self._max_retries}: "
                    f"{self._commit_failures} consecutive failed commits"
                )
                self._record(_error_logger, error=msg)
                raise RuntimeError(msg)
        if self._pending_restore is not None:
            self._apply_restore()
        return should_commit

    # ------------------------------------------------------------------ durable snapshots

    def _settle_state_readers(self) -> None:
        """Waits for the background readers of the committed state (the parity digest, a
        snapshot's copy) before anything writes it: they overlap the step's compute."""
        self._parity.settle()
        if self._snapshots is not None:
            self._snapshots.settle()

    def _restore_snapshot(self, quorum_id: int, max_step: int) -> Snapshot | None:
        """Loads the newest usable snapshot newer than every live group's state, if any
        (see :meth:`GroupSnapshots.restore`); it applies after this step's vote.

        Raises:
            TornStateError: the choice or the load failed on this rank: the group's ranks
                may now disagree, so none goes on; a restart of the group chooses again.
        """
        assert self._snapshots is not None
        try:
            loaded = self._snapshots.restore(
                quorum_id,
                max_step,
                self._step,
                set(self._load_state_dict_fns),
                self._manager_state_dict,
            )
        except Exception as e:
            self._torn_for_good = TornStateError(
                f"restoring a durable snapshot failed on group rank {self._group_rank}: "
                f"{type(e).__name__}: {e}; restart the group"
            )
            raise self._torn_for_good from e
        if loaded is None:
            return None
        self._pending_restore = loaded
        return loaded[0]

    def _apply_restore(self) -> None:
        """Applies a loaded snapshot (after the vote of the step that loaded it)."""
        pending = self._pending_restore
        self._pending_restore = None
        if pending is None:
            return
        snap, state = pending
        self._settle_state_readers()
        self.load_state_dict(state["torchft"])
        self._pending_state_dict = state["user"]
        try:
            self._apply_pending_state_dict()
        except Exception as e:
            # Part of the snapshot may be loaded, and no live group holds a state to heal
            # from (that is why it was loaded): only a restart makes the state whole.
            self._torn_for_good = TornStateError(
                f"applying the snapshot of step {snap.step} from {snap.path} failed: "
                f"{type(e).__name__}: {e}; restart the group"
            )
            raise self._torn_for_good from e
        # The failed step still counts in commit_failures: the next quorum gets a new id,
        # so the process group aborted after this step is rebuilt on a fresh store prefix.
        self._startup_state = False
        self._log_info("resumed from the snapshot of step %d (%s)", snap.step, snap.path)

    def _report_step(self, committed: bool, vote_s: float, error: str | None) -> None:
        """Queues this step's telemetry report (never raises, never waits)."""
        tel = self._telemetry
        if tel is None:
            return
        replica_rank = self._replica_rank
        tel.step_ended(
            step=self._step,
            quorum_id=max(self._quorum_id, 0),
            participants=self._participating_replica_world_size,
            committed=committed,
            healed=self._healing,
            should_commit_s=vote_s,
            error=error,
            rank=(
                replica_rank * self._group_world_size + self._group_rank
                if replica_rank is not None
                else -1
            ),
        )

    # ------------------------------------------------------------------ accessors

    def current_step(self) -> int:
        """Returns the number of committed steps."""
        return self._step

    def batches_committed(self) -> int:
        """Returns the total number of replica-batches committed (sum of participants)."""
        return self._batches_committed

    def commit_failures(self) -> int:
        """Returns how many commits of the current step failed in a row (0 after a commit).

        Every ``should_commit`` changes either this or :meth:`current_step`, so the pair
        names one attempt at a step.
        """
        return self._commit_failures

    def participating_rank(self) -> int | None:
        """Returns this replica group's rank among the step's participants, None if sitting out.

        Waits for the quorum.
        """
        self.wait_quorum()
        return self._participating_replica_rank

    def num_participants(self) -> int:
        """Returns the number of replica groups contributing to this step (waits for quorum)."""
        self.wait_quorum()
        return self._participating_replica_world_size

    def is_participating(self) -> bool:
        """Returns whether this replica group contributes to this step (waits for quorum)."""
        return self.participating_rank() is not None

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, wait: bool = True) -> None:
        """Releases the quorum thread, manager server and client, transport and process group.

        Args:
            wait: wait for the quorum thread and transport to finish.
        """
        lock = getattr(self, "_reconfig_lock", None)
        # Under the lock: a lost-member abort in progress finishes first, none starts after.
        with lock if lock is not None else contextlib.nullcontext():
            if self._shutdown:
                return
            self._shutdown = True
        tel = getattr(self, "_telemetry", None)
        if tel is not None:
            # Called while an exception propagates (e.g. from a `finally:`): the rank failed.
            tel.finish(sys.exc_info()[1], step=self._step)
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.stop(wait=2 * LostWatcher.POLL.total_seconds() if wait else 0.0)
        hang_watchdog = getattr(self, "_hang_watchdog", None)
        if hang_watchdog is not None:
            hang_watchdog.stop()
        parity = getattr(self, "_parity", None)
        if parity is not None:
            parity.shutdown()
        snaps = getattr(self, "_snapshots", None)
        if snaps is not None:
            # A write in flight finishes (a snapshot is worth the wait); none starts after.
            snaps.shutdown(wait=wait)
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=True)
        transport = getattr(self, "_checkpoint_transport", None)
        if transport is not None:
            try:
                transport.shutdown(wait=wait)
            except Exception:
                logger.exception("checkpoint transport shutdown failed")
        if self._manager is not None:
            try:
                self._manager.shutdown()
            except Exception:
                logger.exception("manager server shutdown failed")
            self._manager = None
        self._client = None
        pg_shutdown = getattr(self._pg, "shutdown", None)
        if pg_shutdown is not None:
            try:
                pg_shutdown()
            except Exception:
                logger.exception("process group shutdown failed")
