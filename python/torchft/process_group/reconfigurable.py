"""Process groups rebuilt in place on every ``configure``: Gloo and NCCL.

``ProcessGroupWrapper`` is both the delegating base of the wrappers (given a group) and the
reconfigurable group (given none): ``configure`` connects to the store prefix of the new
quorum and builds a fresh torch group with ``_create_pg``, releasing the old one on a helper
thread so a backend stuck with a dead peer never blocks reconfiguration.

The blocking part of ``configure`` (store connect and the backend's rendezvous, which waits for
every rank of the new group) runs on a helper thread, and ``abort`` ends it at once: when a
member of the quorum being configured is declared lost the rendezvous can never complete, so
the caller gets an error now instead of at the store or backend timeout. A build that finishes
after its configure was abandoned is released, never installed.

Helper threads that call into torch are never daemon threads: a daemon thread that returns
from a native call while the interpreter finalizes is ended by the interpreter with a forced
unwind, which the C++ runtime turns into ``std::terminate`` (SIGABRT). So the interpreter's
exit waits for an abandoned rendezvous or a release (both bounded by the timeout) instead.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.distributed import ProcessGroup as BaseProcessGroup
from torch.distributed import ReduceOp
from torch.futures import Future

from torchft.process_group.base import (
    AbortedTimeoutError,
    ProcessGroup,
    _check_rank,
    _check_timeout,
    _copy_opts,
    _default_result,
    _env_timeout,
    _is_avg,
    _weak_callback,
    _work_future,
    create_store_client,
)
from torchft.work import _FutureWork, _InFlight, _work_timeout, context_timeout

logger: logging.Logger = logging.getLogger(__name__)


class _PendingBuild:
    """One ``configure`` whose store connect and rendezvous run on a helper thread.

    Whoever learns last that the build is not wanted releases it: the helper thread when it
    finishes after ``cancel``, the waiting ``configure`` when ``cancel`` came after the
    finish. ``wake`` fires on either.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.cancelled: str | None = None
        self.finished = False
        self.pg: BaseProcessGroup | None = None
        self.store: Store | None = None
        self.error: BaseException | None = None

    def cancel(self, why: str) -> None:
        with self.lock:
            if self.cancelled is None:
                self.cancelled = why
        self.wake.set()


class ProcessGroupWrapper(ProcessGroup):
    """Forwards every call to a wrapped group, or to one it builds itself.

    With ``pg`` given this is a plain delegating wrapper (base of the error-handling
    wrappers). Without it, subclasses implement ``_create_pg`` and ``configure`` builds a
    fresh torch group on the new store prefix each time.
    """

    def __init__(
        self, pg: ProcessGroup | None = None, timeout: timedelta = timedelta(seconds=60)
    ) -> None:
        """Creates the wrapper.

        Args:
            pg: the group to forward to; None to build groups with ``_create_pg``.
            timeout: timeout of store connections and collectives (overridden by env
                ``TORCHFT_TIMEOUT_SEC``).
        """
        super().__init__()
        self._pg: BaseProcessGroup | None = pg
        self._wrapped = pg is not None
        self._timeout = _env_timeout(_check_timeout(timeout))
        self._lock = threading.RLock()
        self._rank = 0
        self._world_size = 1
        self._error: Exception | None = None
        self._replica_id: str | None = None
        self._inflight = _InFlight()
        # Made once: a collective's error is recorded without keeping the group alive.
        self._on_error = _weak_callback(self._record_error)
        # Helper threads still releasing aborted groups: shutdown waits a little for them
        # (the interpreter's exit waits for the rest; see the module docstring).
        self._releasing: list[threading.Thread] = []
        # The configure in progress (its rendezvous may be abandoned by abort()).
        self._pending: _PendingBuild | None = None

    @property
    def parent(self) -> BaseProcessGroup | None:
        """The wrapped (or currently built) group."""
        return self._pg

    # ---- lifecycle -------------------------------------------------------------------

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        """Builds the torch group for one configuration (subclasses implement)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _create_pg")

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Rebuilds the group (or reconfigures the wrapped one); see ``ProcessGroup``."""
        _check_rank(rank, world_size)
        if self._wrapped:
            pg = self._pg
            assert isinstance(pg, ProcessGroup)
            pg.configure(store_addr, replica_id, rank, world_size)
            with self._lock:
                self._error = None
                self._rank = rank
                self._world_size = world_size
            return
        self._build(
            lambda: create_store_client(store_addr, timeout=self._timeout),
            rank,
            world_size,
            replica_id,
        )

    def _configure_store(
        self, store: Store, rank: int, world_size: int, replica_id: str | None = None
    ) -> None:
        """Builds a new group on an already scoped store (also used by backend factories)."""
        _check_rank(rank, world_size)
        self._build(lambda: store, rank, world_size, replica_id)

    def _build(self, connect: Any, rank: int, world_size: int, replica_id: str | None) -> None:
        """Replaces the group with one built on the store ``connect()`` returns.

        Raises:
            RuntimeError: ``abort`` was called meanwhile (a member of the new group is gone).
            Exception: the store connect or the backend failed (recorded as the group's error).
        """
        # Operations of the previous configuration fail (and are recorded) first; the new
        # configuration then starts without an error.
        self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was reconfigured"))
        pending = _PendingBuild()
        with self._lock:
            old = self._pg
            self._pg = None
            self._error = None
            previous = self._pending
            self._pending = pending
        if previous is not None:
            previous.cancel("superseded by a newer configure")
        if old is not None:
            box = [old]
            del old
            self._teardown(box)
        thread = threading.Thread(
            target=self._run_build,
            args=(pending, connect, rank, world_size),
            name="torchft_pg_configure",
            daemon=False,  # see the module docstring
        )
        thread.start()
        # The store connect and the rendezvous are bounded by the timeout; this is a backstop.
        if not pending.wake.wait(2 * self._timeout.total_seconds() + 5.0):
            pending.cancel(f"configure did not finish within {2 * self._timeout}")
        with pending.lock:
            why = pending.cancelled
            pg, store, error = pending.pg, pending.store, pending.error
            pending.pg = None
        with self._lock:
            if self._pending is pending:
                self._pending = None
        if why is not None:
            if pg is not None:
                self._teardown([pg])
            del pg
            err = RuntimeError(f"{type(self).__name__} configure aborted: {why}")
            self._record_error(err)
            raise err
        if error is not None:
            if isinstance(error, Exception):
                self._record_error(error)
            raise error
        assert pg is not None and store is not None
        with self._lock:
            self._pg = pg
            self._rank = rank
            self._world_size = world_size
            self._replica_id = replica_id
            self._registered_store = store
        logger.info(
            "%s configured: replica_id=%s rank=%d world_size=%d",
            type(self).__name__,
            replica_id,
            rank,
            world_size,
        )

    def _run_build(self, pending: _PendingBuild, connect: Any, rank: int, world_size: int) -> None:
        """The helper thread of ``_build``: connect, rendezvous, hand over (or release)."""
        pg: BaseProcessGroup | None = None
        store: Store | None = None
        error: BaseException | None = None
        try:
            store = connect()
            pg = self._create_pg(store, rank, world_size)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting configure
            error = e
        with pending.lock:
            pending.finished = True
            orphan = pending.cancelled is not None
            if not orphan:
                pending.pg, pending.store, pending.error = pg, store, error
        pending.wake.set()
        if orphan and pg is not None:
            # The configure gave up on this build: release it, never install it.
            self._teardown([pg])

    def _teardown(self, box: list[BaseProcessGroup], wait: float = 0.0) -> None:
        """Aborts and releases an old group on a helper thread.

        Destroying a backend joins its worker threads, which may be stuck in a collective
        with a dead peer until the backend's own timeout; that must never block configure or
        abort. ``box`` holds the only reference, which the helper thread takes over.

        Args:
            box: a one-element list with the group (emptied by the helper).
            wait: how long to wait for the release (0: do not wait).
        """
        thread = threading.Thread(
            target=_release, args=(box, wait > 0), name="torchft_pg_release", daemon=False
        )
        with self._lock:
            self._releasing = [t for t in self._releasing if t.is_alive()]
            self._releasing.append(thread)
        thread.start()
        if wait > 0:
            thread.join(wait)

    def abort(self) -> None:
        """Aborts the current group; it must be reconfigured before further use.

        A ``configure`` in progress raises at once (its rendezvous is abandoned).
        """
        with self._lock:
            pg = self._pg
            pending = self._pending
        if pending is not None:
            pending.cancel("the group was aborted (a member of the new quorum is gone)")
        if pg is None:
            return
        if self._wrapped:
            pg.abort()
            return
        err = RuntimeError(f"{type(self).__name__} was aborted")
        with self._lock:
            self._pg = None
            if self._error is None:
                self._error = err
        # Release everyone blocked on this group's collectives now, not at their timeout.
        self._inflight.fail_all(err)
        box = [pg]
        del pg
        self._teardown(box)

    def shutdown(self) -> None:
        """Releases the current group (and abandons a configure in progress); waits (up to
        5 s) for groups aborted earlier to finish their release."""
        with self._lock:
            pg = self._pg
            pending = self._pending
            if not self._wrapped:
                self._pg = None
        if pending is not None:
            pending.cancel("the group was shut down")
        if pg is not None and self._wrapped:
            pg.shutdown()
        elif pg is not None:
            self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was shut down"))
            box = [pg]
            del pg
            self._teardown(box, wait=5.0)
        deadline = time.monotonic() + 5.0
        with self._lock:
            releasing, self._releasing = self._releasing, []
        for t in releasing:
            t.join(max(0.0, deadline - time.monotonic()))

    def errored(self) -> Exception | None:
        """The first error seen since the last ``configure`` (or the wrapped group's)."""
        with self._lock:
            if self._error is not None:
                return self._error
            pg = self._pg
        if self._wrapped and isinstance(pg, ProcessGroup):
            return pg.errored()
        return None

    def _record_error(self, e: Exception) -> None:
        with self._lock:
            if self._error is None:
                self._error = e
        logger.warning("%s: collective failed: %s", type(self).__name__, e)

    def set_timeout(self, timeout: timedelta) -> None:
        """Changes the timeout of later operations (and of the wrapped group)."""
        self._timeout = _check_timeout(timeout)
        with self._lock:
            pg = self._pg
        if isinstance(pg, ProcessGroup):
            pg.set_timeout(timeout)
        elif pg is not None:
            try:
                pg.set_timeout(timeout)
            except Exception as e:  # noqa: BLE001 - not every backend supports it
                logger.debug("set_timeout not supported by %s: %s", type(pg).__name__, e)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The wrapped group's backend name (or this class's)."""
        if self._wrapped and self._pg is not None:
            return self._pg.getBackendName() if isinstance(self._pg, ProcessGroup) else "torchft"
        return "torchft"

    def size(self) -> int:
        """World size of the current configuration."""
        if self._wrapped and self._pg is not None:
            return self._pg.size()
        return self._world_size

    def rank(self) -> int:
        """Rank of this process in the current configuration."""
        if self._wrapped and self._pg is not None:
            return self._pg.rank()
        return self._rank

    # ---- collectives -----------------------------------------------------------------

    def _current(self) -> BaseProcessGroup:
        with self._lock:
            pg = self._pg
        if pg is None:
            raise RuntimeError(
                f"{type(self).__name__} is not configured (call configure first, or it was aborted)"
            )
        return pg

    def _wrap_work(self, work: dist.Work, result: object) -> dist.Work:
        """Post-processes a work from the underlying group (timeouts, error recording)."""
        if self._wrapped:
            return work
        return self._inflight.work(
            _work_future(work, result),
            self._timeout,
            self._on_error,
            like=result,
        )

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        pg = self._current()
        work = getattr(pg, op)(*args)
        return self._wrap_work(work, _default_result(op, args))


def _release(box: list[BaseProcessGroup], graceful: bool) -> None:
    """Shuts down or aborts (best effort) and drops the group in ``box`` (helper thread)."""
    pg = box.pop()
    try:
        if graceful:
            pg.shutdown()
        else:
            pg.abort()
    except Exception as e:  # noqa: BLE001 - not every backend supports it; dropping is enough
        logger.debug("releasing %s failed: %s", type(pg).__name__, e)
    del pg


def _recording(fut: Future[Any], owner: ProcessGroupWrapper) -> Future[Any]:
    """Chains ``fut`` so a failure is recorded on ``owner`` before anyone sees it.

    The returned future completes only after the error is recorded, so ``errored()`` is
    already set when a waiter wakes up. Only a weak reference to ``owner`` is kept:
    callbacks run on backend threads, and if they dropped the last reference the backend
    would be destroyed (and join itself) there.
    """
    ref = weakref.ref(owner)

    def check(f: Future[Any]) -> Any:
        try:
            return f.value()
        except Exception as e:
            pg = ref()
            if pg is not None:
                pg._record_error(e)
            raise

    return fut.then(check)


def _build_gloo(store: Store, rank: int, world_size: int, timeout: timedelta) -> BaseProcessGroup:
    """Builds a torch ProcessGroup with a Gloo backend for CPU (and CUDA tensors if present)."""
    from torch.distributed import ProcessGroupGloo as BaseProcessGroupGloo

    backend = BaseProcessGroupGloo(store, rank, world_size, timeout)
    pg = BaseProcessGroup(store, rank, world_size)
    pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.GLOO, backend)
    return pg


def _build_nccl(store: Store, rank: int, world_size: int, timeout: timedelta) -> BaseProcessGroup:
    """Builds a torch ProcessGroup with a non-blocking (abortable) NCCL backend."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise RuntimeError("NCCL process groups need CUDA GPUs and a torch built with NCCL")
    from torch.distributed import ProcessGroupNCCL as BaseProcessGroupNCCL

    opts = BaseProcessGroupNCCL.Options()
    opts._timeout = timeout
    # Non-blocking communicators can be aborted while a collective is stuck.
    opts.config.blocking = False
    backend = BaseProcessGroupNCCL(store, rank, world_size, opts)
    pg = BaseProcessGroup(store, rank, world_size)
    pg._set_default_backend(BaseProcessGroup.BackendType.NCCL)
    pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.NCCL, backend)
    return pg


class _OwnGroup(ProcessGroupWrapper):
    """A wrapper that builds a torch group of its own backend on every ``configure``."""

    #: The name torch knows the backend by (``getBackendName``).
    _backend_name = ""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Creates an unconfigured group.

        Args:
            timeout: store connection and collective timeout.
        """
        super().__init__(timeout=timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-gloo`` or ``torchft-nccl``."""
        return self._backend_name


class ProcessGroupGloo(_OwnGroup):
    """Reconfigurable Gloo group: every ``configure`` builds a fresh Gloo group.

    ``ReduceOp.AVG`` (which Gloo lacks) is emulated as SUM followed by a division.
    """

    _backend_name = "torchft-gloo"

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        return _build_gloo(store, rank, world_size, self._timeout)

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        """Runs ``op``; an AVG allreduce is computed as SUM / world size."""
        if op != "allreduce" or not _is_avg(args[1]):
            return super()._dispatch(op, args)
        tensors: list[torch.Tensor]
        tensors, opts = args
        world = self.size()
        work = super()._dispatch("allreduce", (tensors, _copy_opts(opts, ReduceOp.SUM)))

        def divide(fut: Future[Any]) -> list[torch.Tensor]:
            fut.value()
            for t in tensors:
                if t.is_floating_point() or t.is_complex():
                    t.div_(world)
                else:
                    t.floor_divide_(world)
            return tensors

        return _FutureWork(work.get_future().then(divide))


class ProcessGroupNCCL(_OwnGroup):
    """Reconfigurable NCCL group that aborts the communicator when an operation times out.

    Works wait on the GPU stream as usual; ``wait()`` is guarded by the timeout, and when it
    passes the communicator is aborted (non-blocking mode) so the caller never hangs, and
    the error is kept for ``errored()``.
    """

    _backend_name = "torchft-nccl"

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        return _build_nccl(store, rank, world_size, self._timeout)

    def _timed_out(self) -> None:
        self._record_error(
            AbortedTimeoutError(
                f"NCCL operation timed out after {self._timeout}; the group was aborted"
            )
        )
        self.abort()

    def _wrap_work(self, work: dist.Work, result: object) -> dist.Work:
        return _NCCLWork(self, work, self._timeout)


class _NCCLWork(dist.Work):
    """An NCCL work whose ``wait`` aborts the group when it passes the timeout."""

    def __init__(self, pg: ProcessGroupNCCL, work: dist.Work, timeout: timedelta) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._timeout = timeout

    def wait(self, timeout: timedelta | None = None) -> bool:
        timeout = _work_timeout(timeout)
        with context_timeout(self._pg._timed_out, timeout or self._timeout):
            try:
                self._work.wait()
            except Exception as e:
                self._pg._record_error(e)
                raise
        # If the work finished because of an abort, surface that error.
        err = self._pg.errored()
        if err is not None:
            raise err
        return True

    def get_future(self) -> Future[Any]:
        return _recording(self._work.get_future(), self._pg)
