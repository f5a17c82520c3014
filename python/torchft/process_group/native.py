"""torch's own reconfigurable process groups as the Manager's cross-replica group.

torch (2.15+) can reconfigure a process group in place: a group created with
``enable_reconfigure=True`` (``dist.init_process_group(..., enable_reconfigure=True)`` then
``dist.group.WORLD``, or a ``ProcessGroup`` around ``ProcessGroupGloo(store, rank, size,
enable_reconfigure=True)``) connects no communicator at start; ``pg.reconfigure(opts)`` with a
fresh ``uuid`` and one *reconfigure handle* per member (``pg.get_reconfigure_handle()``, in rank
order) builds a new communicator among exactly those members, on the same group object.

A Manager given such a group wraps it in :class:`ProcessGroupNative`, which offers the
``configure(store_addr, replica_id, rank, world_size)`` of torchft's own groups: on every
quorum change the members publish their handles under the quorum's fresh store prefix,
replica rank 0 draws the uuid, and every member calls ``pg.reconfigure(opts).wait()``. As with
torchft's groups, errors are recorded (``errored()``) and surface at the commit vote; a lost
member aborts the group (``abort()``), which ends a handle exchange in progress at once.

Backend constraint (torch's, not ours): Gloo's reconfigure rendezvous runs on the store the
backend was *created* with, keyed by the uuid and the member's creation rank. So every replica
group's native Gloo group must be created on one shared store (e.g. a TCPStore every replica
group reaches) with a creation rank of its own; a restarted replica group takes its
predecessor's. NCCL works the same way where torch offers it.

:func:`reconfigure_with_store` does one such reconfiguration without a Manager.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed import ProcessGroup as BaseProcessGroup

from torchft.process_group.base import (
    ProcessGroup,
    _check_rank,
    _check_timeout,
    _env_timeout,
    _work_future,
    create_store_client,
)
from torchft.process_group.reconfigurable import ProcessGroupWrapper

logger: logging.Logger = logging.getLogger(__name__)

try:  # torch 2.15+; older torch has no native reconfiguration (and no such groups)
    from torch._C._distributed_c10d import ReconfigureOptions
except ImportError:  # pragma: no cover - depends on the installed torch
    ReconfigureOptions = None  # type: ignore[assignment,misc]  # absent before torch 2.15

# How often a waiting member looks for its peers' handles (bounded so that abort is prompt).
_POLL_MAX_S = 0.05


class ReconfigureTimeoutError(dist.DistStoreError, TimeoutError):
    """A member's reconfigure handle did not arrive within the timeout.

    Both a ``DistStoreError`` (what a store wait raises, as upstream torchft's exchange does)
    and a ``TimeoutError`` (what every torchft deadline raises), so either ``except`` works.
    """


def is_native_reconfigurable(pg: object) -> bool:
    """Whether ``pg`` is a torch process group that torch itself can reconfigure.

    torchft's own groups (which have ``configure``) are not: the Manager drives them directly.

    Args:
        pg: the object a Manager was given as ``pg``.

    Returns:
        True for a torch ``ProcessGroup`` whose backend was created with
        ``enable_reconfigure=True``.
    """
    if isinstance(pg, ProcessGroup) or not isinstance(pg, BaseProcessGroup):
        return False
    try:
        return bool(pg.supports_reconfigure)
    except Exception:  # noqa: BLE001 - a group without a default backend cannot say
        return False


def exchange_handles(
    store: Store,
    rank: int,
    world_size: int,
    handle: str,
    timeout: timedelta,
    cancelled: threading.Event | None = None,
) -> tuple[int, list[str]]:
    """Publishes this member's reconfigure handle and collects everyone's.

    Rank 0 also publishes the communicator uuid (a fresh random 63-bit number). The store
    must be scoped to this one reconfiguration (a fresh prefix): keys are never deleted.

    Args:
        store: the store to exchange on.
        rank: this member's rank in the new group.
        world_size: size of the new group.
        handle: this member's ``pg.get_reconfigure_handle()``.
        timeout: how long to wait for the other members.
        cancelled: set by another thread to end the wait at once.

    Returns:
        ``(uuid, handles)``, handles in rank order.

    Raises:
        ValueError: bad rank, world size or handle.
        TypeError: ``timeout`` is not a timedelta.
        ReconfigureTimeoutError: some member's handle (or the uuid) did not arrive in time.
        RuntimeError: ``cancelled`` was set.
    """
    _check_rank(rank, world_size)
    _check_timeout(timeout)
    if not isinstance(handle, str) or not handle:
        raise ValueError(f"reconfigure handle must be a non-empty str, got {handle!r}")
    store.set(f"handle/{rank}", handle)
    if rank == 0:
        store.set("uuid", str(random.SystemRandom().getrandbits(63)))
    keys = ["uuid", *(f"handle/{peer}" for peer in range(world_size))]
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    while not store.check(keys):
        if cancelled is not None and cancelled.is_set():
            raise RuntimeError("reconfigure handle exchange was aborted")
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [k for k in keys if not store.check([k])]
            raise ReconfigureTimeoutError(
                f"wait timeout after {int(timeout.total_seconds() * 1000)}ms exchanging "
                f"reconfigure handles (rank {rank} of {world_size}), missing keys: {missing}"
            )
        if cancelled is not None:
            cancelled.wait(min(pause, left))
        else:
            time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)
    uuid_raw, *raw = store.multi_get(keys)
    handles = [h.decode("utf-8") for h in raw]
    if handles[rank] != handle:
        raise RuntimeError(
            f"rank {rank}'s reconfigure handle was overwritten (two members claim rank {rank})"
        )
    return int(uuid_raw), handles


def _reconfigure(pg: BaseProcessGroup, uuid: int, handles: list[str], timeout: timedelta) -> None:
    """Calls ``pg.reconfigure`` with the exchanged uuid and handles and waits for it."""
    if ReconfigureOptions is None:
        raise RuntimeError(
            f"torch {torch.__version__} cannot reconfigure a process group in place "
            "(torch 2.15+ can)"
        )
    opts = ReconfigureOptions()
    opts.uuid = uuid
    opts.handles = handles
    opts.timeout = timeout
    pg.reconfigure(opts).wait()


def reconfigure_with_store(
    pg: BaseProcessGroup,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta = timedelta(seconds=60),
) -> None:
    """Reconfigures a native group with the handles its members exchange through a store.

    For use without a Manager. Every reconfiguration needs a store prefix of its own, e.g.
    ``host:port/my/prefix/1``, then ``.../2``.

    Args:
        pg: a torch group created with ``enable_reconfigure=True``.
        store_addr: "host:port/prefix" of the store to exchange handles on.
        rank: this member's rank in the new group.
        world_size: size of the new group.
        timeout: bound of the exchange and of the reconfiguration.

    Raises:
        ReconfigureTimeoutError: a member did not publish its handle in time.
        ValueError: bad arguments.
        RuntimeError: the backend failed to reconfigure.
    """
    _check_rank(rank, world_size)
    _check_timeout(timeout)
    store = create_store_client(store_addr, timeout)
    uuid, handles = exchange_handles(store, rank, world_size, pg.get_reconfigure_handle(), timeout)
    _reconfigure(pg, uuid, handles, timeout)


class _Attempt:
    """One ``configure`` running on a helper thread; ``abort`` may abandon it."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None


class ProcessGroupNative(ProcessGroupWrapper):
    """Drives a torch group created with ``enable_reconfigure=True`` like a torchft group.

    Collectives go to the wrapped group (bounded by the timeout, errors recorded);
    ``configure`` reconfigures it in place through a handle exchange on the given store
    prefix; ``abort`` aborts it (it stays usable: the next ``configure`` rebuilds it).
    """

    def __init__(self, pg: BaseProcessGroup, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Wraps ``pg``.

        Args:
            pg: a torch ``ProcessGroup`` whose backend supports reconfigure.
            timeout: bound of each collective, handle exchange and reconfiguration
                (overridden by env ``TORCHFT_TIMEOUT_SEC``).

        Raises:
            ValueError: ``pg`` cannot be reconfigured by torch.
        """
        if not is_native_reconfigurable(pg):
            raise ValueError(
                f"{type(pg).__name__} cannot be reconfigured: create it with "
                "enable_reconfigure=True (torch 2.15+), or use a torchft process group"
            )
        super().__init__(pg=pg, timeout=timeout)  # type: ignore[arg-type]
        self._native: BaseProcessGroup = pg
        self._attempt: _Attempt | None = None
        self._configures = 0

    @property
    def native(self) -> BaseProcessGroup:
        """The wrapped torch group (the user's object, reconfigured in place)."""
        return self._native

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Reconfigures the wrapped group for a new membership.

        Publishes this member's handle under ``store_addr`` (a fresh prefix per quorum),
        waits for every member's, and calls ``pg.reconfigure(...).wait()``. The wait for the
        handles ends at once on ``abort``; the backend's own rendezvous is bounded by the
        timeout (a previous, abandoned one is waited for first: one reconfigure at a time).

        Raises:
            ReconfigureTimeoutError: a member's handle did not arrive within the timeout.
            RuntimeError: aborted meanwhile, or the backend failed.
        """
        _check_rank(rank, world_size)
        self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was reconfigured"))
        timeout = self._timeout
        with self._lock:
            previous = self._attempt
        if previous is not None and previous.thread is not None:
            previous.thread.join(timeout.total_seconds() + 5.0)
            if previous.thread.is_alive():
                err = RuntimeError("an abandoned reconfigure of the native group is still running")
                self._record_error(err)
                raise err
        attempt = _Attempt()
        with self._lock:
            self._attempt = attempt
            self._error = None
        # torch leaves torch.cuda.is_initialized unannotated.
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        attempt.thread = threading.Thread(
            target=self._run,
            args=(attempt, store_addr, rank, world_size, timeout, device),
            name="torchft_native_reconfigure",
            daemon=False,  # a native call must not be torn down at exit (see reconfigurable)
        )
        attempt.thread.start()
        # The exchange and the backend are each bounded by the timeout; this is a backstop.
        deadline = time.monotonic() + 2 * timeout.total_seconds() + 5.0
        while not attempt.done.is_set() and not attempt.cancelled.is_set():
            attempt.done.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                attempt.cancelled.set()
        if not attempt.done.is_set():
            err = RuntimeError(
                f"{type(self).__name__} configure aborted (rank {rank} of {world_size})"
            )
            self._record_error(err)
            raise err
        if attempt.error is not None:
            if isinstance(attempt.error, Exception):
                self._record_error(attempt.error)
            raise attempt.error
        with self._lock:
            self._rank = rank
            self._world_size = world_size
            self._replica_id = replica_id
            self._configures += 1
        logger.info(
            "native %s reconfigured: replica_id=%s rank=%d world_size=%d",
            self._native.name() if hasattr(self._native, "name") else "group",
            replica_id,
            rank,
            world_size,
        )

    def _run(
        self,
        attempt: _Attempt,
        store_addr: str,
        rank: int,
        world_size: int,
        timeout: timedelta,
        device: int | None,
    ) -> None:
        """The helper thread of ``configure``: exchange handles, then reconfigure."""
        try:
            if device is not None:
                torch.cuda.set_device(device)
            store = create_store_client(store_addr, timeout)
            # A prefix reused (the same quorum configured again after an abort) must not
            # serve the previous attempt's handles: each attempt gets a sub-prefix.
            generation = store.add(f"native_attempt/{rank}", 1)
            scoped = PrefixStore(f"attempt{generation}", store)
            uuid, handles = exchange_handles(
                scoped,
                rank,
                world_size,
                self._native.get_reconfigure_handle(),
                timeout,
                attempt.cancelled,
            )
            if attempt.cancelled.is_set():
                raise RuntimeError("reconfigure aborted before it started")
            _reconfigure(self._native, uuid, handles, timeout)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting configure
            attempt.error = e
        finally:
            attempt.done.set()

    def abort(self) -> None:
        """Aborts the wrapped group and ends a handle exchange in progress.

        The group object stays valid; the next ``configure`` reconfigures it.
        """
        with self._lock:
            attempt = self._attempt
            if self._error is None:
                self._error = RuntimeError(f"{type(self).__name__} was aborted")
            err = self._error
        if attempt is not None:
            attempt.cancelled.set()
        self._inflight.fail_all(err)
        try:
            self._native.abort()
        except Exception as e:  # noqa: BLE001 - best effort; reconfigure rebuilds it
            logger.debug("aborting the native group failed: %s", e)

    def shutdown(self) -> None:
        """Abandons a configure in progress and fails in-flight operations.

        The wrapped group belongs to the caller (``dist.destroy_process_group`` or its own
        ``shutdown``); it is left alive.
        """
        with self._lock:
            attempt = self._attempt
        if attempt is not None:
            attempt.cancelled.set()
        self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was shut down"))

    def set_timeout(self, timeout: timedelta) -> None:
        """Changes the timeout of later operations (and the wrapped group's default)."""
        self._timeout = _check_timeout(timeout)
        try:
            self._native.set_timeout(timeout)
        except Exception as e:  # noqa: BLE001 - not every backend supports it
            logger.debug("set_timeout not supported by the native group: %s", e)

    def errored(self) -> Exception | None:
        """The first error since the last ``configure``."""
        with self._lock:
            return self._error

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The wrapped group's backend name."""
        try:
            return str(self._native.name())
        except Exception:  # noqa: BLE001 - a group without a default backend
            return "torchft"

    def _wrap_work(self, work: dist.Work, result: object) -> dist.Work:
        """Bounds the work by the timeout and records its error (as torchft's groups do)."""
        return self._inflight.work(
            _work_future(work, result),
            self._timeout,
            self._on_error,
            like=result,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank()}, size={self.size()})"


def manager_group(pg: Any, timeout: timedelta) -> Any:
    """The group a Manager drives for ``pg``: ``pg`` itself, or a native group wrapped.

    Args:
        pg: the Manager's ``pg`` argument.
        timeout: the Manager's timeout.

    Returns:
        ``ProcessGroupNative(pg)`` for a torch group created with ``enable_reconfigure=True``;
        any other object unchanged.

    Raises:
        ValueError: ``pg`` is a plain torch group that torch cannot reconfigure.
    """
    if is_native_reconfigurable(pg):
        return ProcessGroupNative(pg, timeout=_env_timeout(timeout))
    if (
        isinstance(pg, BaseProcessGroup)
        and not isinstance(pg, ProcessGroup)
        and not hasattr(pg, "configure")
    ):
        raise ValueError(
            f"a plain torch {type(pg).__name__} cannot follow quorum changes: create it "
            "with enable_reconfigure=True (torch 2.15+), or use a torchft process group "
            "(e.g. ProcessGroupGloo)"
        )
    return pg
