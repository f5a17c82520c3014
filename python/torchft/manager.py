"""The per-step fault-tolerance coordinator of one training process.

A :class:`Manager` lives in every rank of a replica group. Once per step it asks the replica
group's manager server for a quorum (which replica groups take part, who heals from whom),
reconfigures the cross-replica process group when the membership changed, moves live
checkpoints between replica groups (healing), performs the cross-replica gradient allreduce on
behalf of DDP while swallowing communication errors, and finally decides with the other ranks
of its replica group whether the step commits.

The step protocol, seen from one rank::

    manager.start_quorum()          # optimizer.zero_grad(); async, overlapped with forward
    loss = model(batch); loss.backward()   # each gradient bucket through manager.allreduce
    if manager.should_commit():     # optimizer.step(); vote of every rank in the group
        optimizer.step()

Errors on the training path (a peer died mid-allreduce, a heal failed) are recorded with
:meth:`Manager.report_error` and turn the step's commit vote into "no"; they are never raised
from inside collectives. Bad arguments raise at once.

The Manager is the step protocol; its rooms are :mod:`torchft.group_connect` (joining the
replica group: store, manager server, client), :mod:`torchft.quorum_group` (the
cross-replica process group under the quorums, failure detection), :mod:`torchft.healing`
(healing and the torn-state policy), :mod:`torchft.group_snapshots` (durable snapshots),
:mod:`torchft.parity`, :mod:`torchft.telemetry`, :mod:`torchft.hang`,
:mod:`torchft.loss_watch` and :mod:`torchft.state_lock` (see docs/architecture.md).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.distributed import ReduceOp, Work
from torch.futures import Future

from torchft import _torchft
from torchft.config import THIS_HOST, ManagerConfig, ThisHost, WorldSizeMode
from torchft.coordination import check_native_backend
from torchft.errors import (
    ExceptionWithTraceback,
    HungProcessError,
    StateDivergedError,
    StepErrors,
    TornStateError,
)
from torchft.group_connect import join_group, start_services, vote
from torchft.group_snapshots import GroupSnapshots
from torchft.hang import HangWatchdog, LoopBusy
from torchft.healing import Healer
from torchft.loss_watch import LostWatcher
from torchft.parity import StateParity
from torchft.quorum_group import (
    PendingQuorum,
    QuorumCall,
    QuorumGroup,
    participation,
    quorum_sender,
    run_quorum,
    start_pending,
)
from torchft.telemetry import RankTelemetry
from torchft.user_state import UserState
from torchft.work import _DummyWork, _FutureWork

if TYPE_CHECKING:
    from torchft.checkpointing import CheckpointTransport
    from torchft.coordination import (
        NativeBackend,
        NativeManagerClient,
        NativeManagerServer,
        NativeQuorumResult,
    )
    from torchft.process_group import ProcessGroup

__all__ = ["DEFAULT_STATE_DICT_KEY", "ExceptionWithTraceback", "HungProcessError", "Manager"]
__all__ += ["StateDivergedError", "TornStateError", "WorldSizeMode"]

logger: logging.Logger = logging.getLogger(__name__)
_quorum_logger: logging.Logger = logging.getLogger("torchft_quorums")
_commit_logger: logging.Logger = logging.getLogger("torchft_commits")
_error_logger: logging.Logger = logging.getLogger("torchft_errors")

T = TypeVar("T")

#: Key under which the default (legacy constructor) state dict functions are registered.
DEFAULT_STATE_DICT_KEY = "default"

#: The constructor's arguments that are objects, not settings resolved by ManagerConfig.
_NOT_SETTINGS = frozenset(
    {"self", "pg", "load_state_dict", "state_dict", "hostname", "checkpoint_transport"}
    | {"native_backend"}
)


class Manager:
    """Coordinates fault-tolerant data parallel training for one rank of a replica group.

    See the module documentation for the step protocol. Every public method is safe to call
    from the training thread; the quorum runs on one background worker thread.

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
        job: this job's room on a lighthouse that serves many jobs: its quorums, quorum ids,
            progress records and events are its own (default env ``TORCHFT_JOB``, else the
            lighthouse's default room). See docs/rooms.md.

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
        hostname: str = THIS_HOST,
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
        job: str | None = None,
        native_backend: NativeBackend | None = None,
    ) -> None:
        """Creates the manager, joins the replica group (store, manager server, client).

        The arguments are described in the class documentation.

        Raises:
            ValueError: on invalid arguments or missing configuration, or a heal interface
                that does not exist or has no address (nothing is started then).
            TypeError: on arguments of the wrong type.
        """
        given = dict(locals())  # the arguments: no other local exists yet
        settings = {k: v for k, v in given.items() if k not in _NOT_SETTINGS}
        hostname_given = not isinstance(hostname, ThisHost)
        cfg = ManagerConfig.resolve(**settings, hostname=hostname if hostname_given else None)
        if (load_state_dict is None) != (state_dict is None):
            raise ValueError("load_state_dict and state_dict must be given together (or neither)")
        # A torch group created with enable_reconfigure=True is driven through a handle
        # exchange (torchft.process_group.native); torchft's own groups are used as given.
        from torchft.process_group.native import manager_group

        self._config = cfg
        self._native: NativeBackend = (
            _torchft if native_backend is None else check_native_backend(native_backend)
        )
        self._group_rank: int = cfg.rank
        self._group_world_size: int = cfg.world_size
        self._init_state()
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn(DEFAULT_STATE_DICT_KEY, load_state_dict, state_dict)
        self._parity = StateParity(cfg.parity_every, self._user.current)
        self._group = QuorumGroup(
            manager_group(pg, cfg.timeout), self.report_error, self._source_lost, self._where
        )
        self._healer = self._new_healer(cfg)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchft_quorum")
        if hasattr(self._pg, "set_timeout"):
            self._pg.set_timeout(cfg.timeout)
        self._checkpoint_transport = (
            self._healer.attach_default(cfg, hostname_given)
            if checkpoint_transport is None
            else self._healer.attach(checkpoint_transport)
        )
        try:
            # Inside the try: a group that cannot be joined must not leave the checkpoint
            # server (started above) serving.
            self._join(cfg)
        except BaseException:
            self.shutdown(wait=False)
            raise

    # ------------------------------------------------------------------ construction

    def _init_state(self) -> None:
        """The state of a fresh Manager, before it joined its group: the registered user
        state and its lock, the counters, the step's state, the services not started yet."""
        self._replica_id = "?"
        self._user = UserState()
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._errors = StepErrors(self._first_error)
        self._pending_futures: list[Future[Any]] = []
        # This rank turned a collective of the step into a no-op (the step had errored): its
        # peers may be waiting on it, so the vote aborts the quorum's group (see should_commit).
        self._skipped_collective = False
        self._quorum_future: ConcurrentFuture[None] | PendingQuorum | None = None
        self._participating_replica_rank: int | None = None
        self._participating_replica_world_size: int = 0
        self._replica_rank: int | None = None
        self._replica_world_size: int = 0
        self._manager: NativeManagerServer | None = None
        self._client: NativeManagerClient | None = None
        self._telemetry: RankTelemetry | None = None
        self._watcher: LostWatcher | None = None
        self._hang_watchdog: HangWatchdog | None = None
        self._snapshots: GroupSnapshots | None = None
        self._shutdown = False

    def _new_healer(self, cfg: ManagerConfig) -> Healer:
        return Healer(
            native=self._native,
            state_lock=self._user.lock,
            served_state=self._manager_state_dict,
            load_counters=self.load_state_dict,
            loaders=self._user.loaders,
            settle_readers=self._settle_state_readers,
            in_torchft=self._in_torchft,
            telemetry=lambda: self._telemetry,
            step=lambda: self._step,
            log_info=self._log_info,
            group_rank=cfg.rank,
            timeout=cfg.timeout,
            connect_timeout=cfg.connect_timeout,
            apply_at_once=not cfg.use_async_quorum,
        )

    def _join(self, cfg: ManagerConfig) -> None:
        """Joins the replica group and starts the services that watch it."""
        conn = join_group(cfg, self._native)
        self._store, self._manager, self._client = conn.store, conn.server, conn.client
        self._replica_id = conn.replica_id
        services = start_services(
            cfg, conn, self._on_lost, lambda: self._step, self._log_info, self._parity
        )
        self._telemetry, self._watcher = services.telemetry, services.watcher
        self._snapshots, self._hang_watchdog = services.snapshots, services.hang_watchdog
        self._log_info(
            "manager ready: replica_id=%s group_rank=%d/%d manager=%s async_quorum=%s",
            conn.replica_id,
            cfg.rank,
            cfg.world_size,
            conn.address,
            cfg.use_async_quorum,
        )

    @property
    def _use_async_quorum(self) -> bool:
        """Whether the quorum runs in the background (DiLoCo refuses it)."""
        return self._config.use_async_quorum

    @property
    def _quorum_id(self) -> int:
        """The quorum the cross-replica group is configured for (-1: none yet)."""
        return self._group.quorum_id

    @property
    def _pg(self) -> Any:
        """The cross-replica process group."""
        return self._group.pg

    def _where(self) -> str:
        return f"{self._replica_id}/{self._group_rank} step {self._step}"

    def _source_lost(self, replica_id: str) -> None:
        self._healer.source_lost(replica_id)

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
            "job_id": self._config.job_id,
            "replica_id": self._replica_id,
            "rank": self._group_rank,
            "quorum_id": self._group.quorum_id,
            "step": self._step,
        }
        extra.update(fields)
        target.info(" ".join(f"{k}={v}" for k, v in extra.items()), extra=extra)

    # ------------------------------------------------------------------ state dicts

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
        self._user.register(key, load_state_dict, state_dict)

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
        self._user.set(DEFAULT_STATE_DICT_KEY, load_state_dict, state_dict)

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
            "user": self._user.current(),
            "torchft": self.state_dict(),
        }

    def allow_state_dict_read(self) -> None:
        """Allows checkpoint transports to read the state dict again (after optimizer step)."""
        self._user.allow_read()

    def disallow_state_dict_read(self) -> None:
        """Blocks checkpoint reads while parameters change (around the optimizer step).

        Waits for a serialisation in progress to finish first.
        """
        self._user.disallow_read()

    # ------------------------------------------------------------------ errors

    def report_error(self, e: Exception) -> None:
        """Records an error of the current step; the step will not commit.

        Args:
            e: the error (kept with its traceback; the first error of a step wins).
        """
        self._errors.report(e)

    def _first_error(self, wrapped: ExceptionWithTraceback) -> None:
        logger.warning("[%s] error reported, step will not commit: %s", self._where(), wrapped)
        self._record(_error_logger, error=str(wrapped))

    @property
    def _errored(self) -> ExceptionWithTraceback | None:
        return self._errors.error

    def errored(self) -> ExceptionWithTraceback | None:
        """Returns the error recorded for the current step, if any."""
        return self._errors.error

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
        return self._errors.wrap_future(fut, default, timeout)

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
        self._errors.clear()
        self._group.loss_abort_error = None
        self._pending_futures = []
        self._skipped_collective = False
        try:
            self._healer.new_step()
        except Exception as e:
            self.report_error(e)
        if self._snapshots is not None and not self._healer.state.torn:
            self._snapshots.at_step_start(self._step, self._manager_state_dict)
        if not self._healer.state.torn:
            try:
                self._parity.at_step_start(self._step)
            except Exception:
                # Fail-open: parity never stops training by failing itself.
                logger.exception("state digest of step %d not taken", self._step)
        quorum_timeout = timeout if timeout is not None else self._config.quorum_timeout
        if self._config.use_async_quorum:
            # The request is sent natively without waiting, and the answer is
            # handled by the first wait_quorum (from DDP's first gradient, or the first
            # allreduce): a helper thread woken at every step would fight the training
            # thread for the GIL during the forward pass.
            self._quorum_future = start_pending(
                QuorumCall(
                    self._group,
                    lambda quorum: self._adopt_quorum(quorum, allow_heal),
                    self.report_error,
                    quorum_timeout,
                ),
                lambda: quorum_sender(
                    self._manager, self._group_world_size, self._rpc
                )._quorum_start(**self._quorum_request(shrink_only, quorum_timeout)),
                self._executor,
                allow_heal,
            )
        else:
            fut: ConcurrentFuture[None] = ConcurrentFuture()
            self._quorum_future = fut
            try:
                with self._timing_quorum(), self._in_torchft():
                    run_quorum(
                        QuorumCall(
                            self._group,
                            lambda quorum: self._apply_quorum(quorum, allow_heal),
                            self.report_error,
                            quorum_timeout,
                        ),
                        lambda: self._rpc()._quorum(
                            **self._quorum_request(shrink_only, quorum_timeout)
                        ),
                    )
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
        if fut.settled() if isinstance(fut, PendingQuorum) else fut.done():
            # Already adopted (the step's backward waited for it): nothing to time
            # or mark busy; its outcome is raised as it is.
            fut.result()
            return
        # The quorum RPC and the heal each carry their own deadline; this bound is a backstop.
        limit = (
            self._config.quorum_timeout + 2 * self._config.timeout + self._config.connect_timeout
        ).total_seconds()
        try:
            with self._timing_quorum(), self._in_torchft():
                fut.result(timeout=limit)
        except FutureTimeoutError:
            # concurrent.futures' TimeoutError is the built-in one: a quorum that itself
            # ended in a TimeoutError is re-raised as it is, not as this backstop's.
            if fut.done():
                raise
            raise TimeoutError(f"quorum did not finish within {limit:.1f}s") from None

    def _in_torchft(self) -> AbstractContextManager[None]:
        """Marks the training loop as inside torchft (a quorum, its process group, a heal, a
        vote): however long it takes, the lighthouse does not count it as away (hang watch)."""
        server = self._manager
        return LoopBusy(server) if server is not None else nullcontext()

    def _timing_quorum(self) -> Any:
        """Context counting the time inside it as blocked on the quorum (telemetry)."""
        tel = self._telemetry
        return tel.quorum_wait() if tel is not None and tel.enabled else nullcontext()

    # ------------------------------------------------------------------ failure detection

    def _on_lost(self, replica_id: str, quorum_id: int) -> None:
        """A member of a quorum was declared lost: its collectives are aborted (see
        :meth:`QuorumGroup.on_lost`) and a heal from it ends."""
        self._group.on_lost(replica_id, quorum_id, self._replica_id)

    def _adopt_quorum(self, quorum: NativeQuorumResult, allow_heal: bool) -> None:
        """Adopts an answer of an async quorum; errors are recorded, not raised."""
        try:
            self._apply_quorum(quorum, allow_heal)
        except Exception as e:
            self.report_error(e)

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
            "init_sync": self._config.init_sync,
        }

    def _apply_quorum(self, quorum: NativeQuorumResult, allow_heal: bool) -> None:
        """Adopts a quorum answer: roles, process group, serving and fetching live state."""
        quorum_id: int = quorum.quorum_id
        max_step: int = quorum.max_step
        heal: bool = bool(quorum.heal) and allow_heal
        restored = None
        if self._snapshots is not None and allow_heal:
            # First, while nothing of this answer is acted on yet: every rank of the group
            # reaches it, so the choice shared through the store is never waited for in vain
            # (the healer decides which answers look: see Healer.restore).
            restored = self._healer.restore(self._snapshots, quorum_id, max_step, self._step)
        # A failed in-place heal left this group's tensors partly overwritten: going on would
        # train, and later serve, a state no step ever had (a heal or a restore mends it).
        self._healer.check_trainable(heal or restored is not None, allow_heal, bool(quorum.heal))
        self._take_roles(quorum, allow_heal)
        if self._group.needs_configure(quorum):
            store_prefixed_addr = f"{quorum.store_address}/torchft/{quorum_id}/{self._group_rank}"
            self._log_info(
                "reconfiguring for quorum_id=%d replica_rank=%d/%d store=%s",
                quorum_id,
                quorum.replica_rank,
                quorum.replica_world_size,
                store_prefixed_addr,
            )
            self._group.configure(
                store_prefixed_addr,
                self._replica_id,
                quorum.replica_rank,
                quorum.replica_world_size,
            )
        self._record(
            _quorum_logger,
            replica_rank=quorum.replica_rank,
            replica_world_size=quorum.replica_world_size,
            participating_rank=self._participating_replica_rank,
            num_participants=self._participating_replica_world_size,
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
            self._healer.serve(quorum, max_step)
            if heal:
                self._healer.heal(
                    quorum, max_step, lambda src: self._group.was_lost(quorum_id, src)
                )

    def _take_roles(self, quorum: NativeQuorumResult, allow_heal: bool) -> None:
        self._replica_rank = quorum.replica_rank
        self._replica_world_size = quorum.replica_world_size
        self._participating_replica_rank, self._participating_replica_world_size = participation(
            quorum, self._config, allow_heal
        )

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

        try:
            reduced = self._group.allreduce(
                tensor, reduce_op, num_participants, self._telemetry, self._manager
            )
        except Exception as e:
            self.report_error(e)
            self._skipped_collective = True
            return _DummyWork(tensor)
        self._pending_futures.append(reduced)
        return _FutureWork(reduced)

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
        vote_timeout = timeout if timeout is not None else self._config.timeout
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
        for stop in (self._healer.fatal, self._errors.diverged):
            if stop is not None:  # the group cannot go on: a torn state, a parity verdict
                self._record(_error_logger, error=str(stop))
                raise stop

        for fut in self._pending_futures:
            fut.wait()  # wrapped futures never raise
        self._pending_futures = []

        if self._skipped_collective:
            # Peers may wait on the collectives this rank skipped (see QuorumGroup).
            self._skipped_collective = False
            self._group.abort_after_skip()

        err = self._group.error()
        if err is not None and err is not self._group.loss_abort_error:
            self.report_error(err)

        if quorum_timed_out is None and self._errored is None:
            try:
                self._healer.apply_pending()
            except Exception as e:
                self.report_error(e)

        enough_replicas = self._participating_replica_world_size >= self._config.min_replica_size
        local_vote = quorum_timed_out is None and self._errored is None and enough_replicas
        if quorum_timed_out is not None:
            # The manager server did not answer the quorum; the vote would not find peers.
            self._commit_failures += 1
            self._checkpoint_transport.disallow_checkpoint()
            self._report_step(False, 0.0, str(quorum_timed_out))
            raise quorum_timed_out
        vote_t0 = time.perf_counter()
        should_commit = vote(
            self._manager,
            self._rpc(),
            group_rank=self._group_rank,
            world_size=self._group_world_size,
            step=self._step,
            local_vote=local_vote,
            timeout=vote_timeout,
            digest=self._parity.take(),
            quorum_wait=self._telemetry.step_quorum_wait() if self._telemetry else None,
        )
        vote_s = time.perf_counter() - vote_t0
        self._checkpoint_transport.disallow_checkpoint()
        errored = str(self._errored) if self._errored is not None else None
        self._report_step(should_commit, vote_s, errored)
        self._record(
            _commit_logger,
            commit=should_commit,
            local_vote=local_vote,
            num_participants=self._participating_replica_world_size,
            enough_replicas=enough_replicas,
            errored=errored,
        )
        if not enough_replicas:
            logger.debug(
                "not enough replicas to commit: %d < %d",
                self._participating_replica_world_size,
                self._config.min_replica_size,
            )
        if should_commit:
            self._healer.committed()
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
                    self._group.quorum_id,
                    self._participating_replica_rank,
                    self._participating_replica_world_size,
                )
        else:
            self._commit_failures += 1
            limit = self._config.max_retries
            if limit is not None and self._commit_failures > limit:
                msg = f"exceeded max_retries={limit}: {self._commit_failures} consecutive failed commits"
                self._record(_error_logger, error=msg)
                raise RuntimeError(msg)
        self._healer.apply_restore()
        return should_commit

    # ------------------------------------------------------------------ durable snapshots

    def _settle_state_readers(self) -> None:
        """Waits for the background readers of the committed state (the parity digest, a
        snapshot's copy) before anything writes it: they overlap the step's compute."""
        self._parity.settle()
        if self._snapshots is not None:
            self._snapshots.settle()

    def _report_step(self, committed: bool, vote_s: float, error: str | None) -> None:
        """Queues this step's telemetry report (never raises, never waits)."""
        tel = self._telemetry
        if tel is None:
            return
        replica_rank = self._replica_rank
        tel.step_ended(
            step=self._step,
            quorum_id=max(self._group.quorum_id, 0),
            participants=self._participating_replica_world_size,
            committed=committed,
            healed=self._healer.healed,
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
        # Under the group's lock: a lost-member abort in progress finishes first, none starts
        # after.
        if not self._group.close():
            return
        self._shutdown = True
        if self._telemetry is not None:
            # Called while an exception propagates (e.g. from a `finally:`): the rank failed.
            self._telemetry.finish(sys.exc_info()[1], step=self._step)
        if self._watcher is not None:
            self._watcher.stop(wait=2 * LostWatcher.POLL.total_seconds() if wait else 0.0)
        if self._hang_watchdog is not None:
            self._hang_watchdog.stop()
        self._parity.shutdown()
        if self._snapshots is not None:
            # A write in flight finishes (a snapshot is worth the wait); none starts after.
            self._snapshots.shutdown(wait=wait)
        self._executor.shutdown(wait=wait, cancel_futures=True)
        try:
            self._checkpoint_transport.shutdown(wait=wait)
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
