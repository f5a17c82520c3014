"""Reconfigurable process groups for fault-tolerant training.

torch's process groups are built once for a fixed world. Fault tolerance changes the set of
replica groups every time a quorum changes, so the process groups here can be torn down and
rebuilt in place: ``configure(store_addr, replica_id, rank, world_size)`` connects to the store
named by ``store_addr`` ("host:port/prefix") and builds a fresh group on that prefix.

Implementations:

* ``ProcessGroupGloo`` / ``ProcessGroupNCCL``: the real group lives in this process and is
  replaced on every ``configure``.
* ``ProcessGroupBabyGloo`` / ``ProcessGroupBabyNCCL``: the real group lives in a child process
  that is killed and respawned on every ``configure``/``abort``. A hung or crashed collective
  can then always be recovered from, at the cost of moving tensors through shared memory.
* ``ProcessGroupDummy``: completes everything at once (unit tests, world-size-1 DDP).
* Wrappers: ``ProcessGroupWrapper`` (delegation), ``ErrorSwallowingProcessGroupWrapper``
  (record the first error, turn later collectives into no-ops), ``FakeProcessGroupWrapper``
  (inject future errors in tests) and ``ManagedProcessGroup`` (allreduce through a Manager).

Every group is a ``torch.distributed.ProcessGroup`` subclass, so it can be handed to torch
code (DDP, DeviceMesh via ``register``). The backends are also registered with
``torch.distributed.Backend`` as ``torchft-gloo``, ``torchft-nccl``, ``torchft-baby-gloo`` and
``torchft-baby-nccl``.

The environment variable ``TORCHFT_TIMEOUT_SEC`` overrides the timeout given to any group.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import queue
import socket
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)
from torch.distributed import (
    PrefixStore,
    ReduceOp,
    Store,
    TCPStore,
)
from torch.distributed import ProcessGroup as BaseProcessGroup
from torch.futures import Future

from torchft.config import timeout_override
from torchft.work import (
    _DummyWork,
    _FutureWork,
    _InFlight,
    _work_timeout,
    context_timeout,
    future_on_error,
)

if TYPE_CHECKING:
    from torchft.manager import Manager

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "create_store_client",
]


def _env_timeout(timeout: timedelta) -> timedelta:
    """Applies the ``TORCHFT_TIMEOUT_SEC`` override to ``timeout`` (see torchft.config).

    Raises:
        ValueError: the variable is set but is not a positive number of seconds.
    """
    return timeout_override(timeout)


def _check_timeout(timeout: timedelta) -> timedelta:
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def _parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """Splits "host:port/prefix" into its parts (IPv6 hosts may be bracketed)."""
    if not isinstance(store_addr, str) or "/" not in store_addr:
        raise ValueError(f"store_addr must look like 'host:port/prefix', got {store_addr!r}")
    hostport, prefix = store_addr.split("/", 1)
    host, sep, port_s = hostport.rpartition(":")
    if not sep or not host:
        raise ValueError(f"store_addr must look like 'host:port/prefix', got {store_addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError as e:
        raise ValueError(f"invalid port in store_addr {store_addr!r}") from e
    if not 0 < port < 65536:
        raise ValueError(f"invalid port in store_addr {store_addr!r}")
    return host, port, prefix


def create_store_client(store_addr: str, timeout: timedelta) -> Store:
    """Connects to the TCPStore named by ``store_addr`` and scopes it to its prefix.

    Args:
        store_addr: "host:port/prefix".
        timeout: connect and per-operation timeout of the store client.

    Returns:
        A ``PrefixStore(prefix, TCPStore(host, port))`` client.

    Raises:
        ValueError: ``store_addr`` is malformed.
    """
    host, port, prefix = _parse_store_addr(store_addr)
    store = TCPStore(
        host_name=host,
        port=port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )
    return PrefixStore(prefix, store)


def _allreduce_opts(opts: AllreduceOptions | ReduceOp | Any) -> AllreduceOptions:
    """Accepts a ReduceOp, a RedOpType or AllreduceOptions and returns AllreduceOptions."""
    if isinstance(opts, AllreduceOptions):
        return opts
    out = AllreduceOptions()
    if opts is None:
        return out
    out.reduceOp = opts
    return out


def _is_avg(opts: AllreduceOptions) -> bool:
    return bool(opts.reduceOp == ReduceOp.AVG)


def _copy_opts(opts: AllreduceOptions, op: Any) -> AllreduceOptions:
    out = AllreduceOptions()
    out.reduceOp = op
    out.timeout = opts.timeout
    return out


class ProcessGroup(BaseProcessGroup):
    """Base class of the reconfigurable process groups.

    Subclasses implement ``configure`` and the collectives they support; the ones they do
    not support raise ``NotImplementedError`` with the group's name.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Initialises the torch base with a placeholder world of one rank.

        The real rank and size come from ``configure`` (see ``rank()``/``size()``).
        """
        super().__init__(0, 1)
        self._group_name: str | None = None
        self._torch_group_name = ""
        self._registered_store: Store | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Tears down the current group (if any) and builds a new one.

        Args:
            store_addr: "host:port/prefix" of the store to rendezvous on; each quorum uses a
                fresh prefix.
            replica_id: id of this replica group (for logs and debugging).
            rank: this process's rank in the new group.
            world_size: size of the new group.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    def abort(self) -> None:
        """Aborts in-flight work so that nothing blocks; the group must be reconfigured."""

    def shutdown(self) -> None:
        """Releases the group's resources (threads, child processes, sockets)."""

    def errored(self) -> Exception | None:
        """Returns the error that broke this group, if any (cleared by ``configure``)."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        """Changes the timeout of future operations."""
        raise NotImplementedError(f"{type(self).__name__} does not implement set_timeout")

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """Name of the backend (torch calls this)."""
        return "torchft"

    def size(self) -> int:
        """World size of the current configuration."""
        return 1

    def getSize(self) -> int:  # noqa: N802 - torch's C++ side calls this name
        """Same as ``size()``; the name torch's C++ code calls."""
        return self.size()

    def rank(self) -> int:
        """Rank of this process in the current configuration."""
        return 0

    def getRank(self) -> int:  # noqa: N802 - torch's C++ side calls this name
        """Same as ``rank()``; the name torch's C++ code calls."""
        return self.rank()

    # ---- registration with torch.distributed -----------------------------------------

    def getGroupName(self) -> str:  # noqa: N802 - torch's C++ side calls this name
        """The name given by ``register`` (torch reads it through ``group_name``)."""
        return self._torch_group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's C++ side calls this name
        """Records the name torch assigns to this group."""
        self._torch_group_name = name

    def register(self, name: str) -> ProcessGroup:
        """Makes this group visible to torch.distributed under ``name``.

        torch code that resolves groups by name (DeviceMesh, FSDP, functional collectives)
        can then use it. The group object is registered itself, so later reconfigurations
        are seen without registering again.

        Args:
            name: the group name; must not be registered already.

        Returns:
            ``self``.

        Raises:
            ValueError: ``name`` is empty or already registered with torch.
        """
        from torch._C._distributed_c10d import _register_process_group
        from torch.distributed.distributed_c10d import _world

        if not name:
            raise ValueError("register needs a non-empty name")
        if name in _world.pg_names.values():
            raise ValueError(f"a process group named {name!r} is already registered")
        if self._group_name is not None:
            self.unregister()
        self._set_group_name(name)
        self._group_name = name
        store = self._registered_store or dist.HashStore()
        _world.pg_map[self] = (self.getBackendName(), store)
        _world.pg_names[self] = name
        _world.pg_group_ranks[self] = {i: i for i in range(self.size())}
        _world.pg_backend_config[self] = self.getBackendName()
        tag = f"ptd:{name}"
        _world.pg_to_tag[self] = tag
        _world.tags_to_pg.setdefault(tag, []).append(self)
        _world.tags_to_pg.setdefault("", []).append(self)
        _register_process_group(name, self)
        return self

    def unregister(self) -> None:
        """Undoes ``register`` (a no-op if the group is not registered)."""
        from torch._C._distributed_c10d import _unregister_process_group
        from torch.distributed.distributed_c10d import _world

        name = self._group_name
        if name is None:
            return
        self._group_name = None
        _world.pg_map.pop(self, None)
        _world.pg_names.pop(self, None)
        _world.pg_group_ranks.pop(self, None)
        _world.pg_backend_config.pop(self, None)
        tag = _world.pg_to_tag.pop(self, None)
        for key in (tag, ""):
            if key is not None and key in _world.tags_to_pg:
                _world.tags_to_pg[key] = [p for p in _world.tags_to_pg[key] if p is not self]
                if not _world.tags_to_pg[key]:
                    del _world.tags_to_pg[key]
        try:
            _unregister_process_group(name)
        except Exception:  # noqa: BLE001 - already gone is fine
            logger.debug("process group %s was not registered in c10d", name)

    # ---- collectives (subclasses override what they support) --------------------------

    def _unsupported(self, op: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not support {op}")

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp | Any = None
    ) -> dist._Work:
        """Reduces ``tensors`` in place across the group.

        Args:
            tensors: the tensors to reduce (in place).
            opts: an ``AllreduceOptions`` or a ``ReduceOp`` (default SUM).

        Returns:
            A Work whose future resolves to ``tensors``.
        """
        raise self._unsupported("allreduce")

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | Any = None
    ) -> dist._Work:
        """Reduces several tensors as one operation."""
        raise self._unsupported("allreduce_coalesced")

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """Gathers every rank's ``input_tensors[i]`` into ``output_tensors[i]``."""
        raise self._unsupported("allgather")

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """Gathers into flat output tensors."""
        raise self._unsupported("allgather_into_tensor_coalesced")

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist._Work:
        """Copies the root's tensors to every rank."""
        raise self._unsupported("broadcast")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist._Work:
        """Broadcasts a single tensor from ``root``.

        Args:
            tensor: the tensor (source on ``root``, destination elsewhere).
            root: the rank that holds the data.

        Returns:
            The broadcast's Work.
        """
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """Reduces ``input_tensors`` and scatters the pieces to the ranks."""
        raise self._unsupported("reduce_scatter")

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """Reduce-scatter of flat tensors."""
        raise self._unsupported("reduce_scatter_tensor_coalesced")

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> dist._Work:
        """All-to-all exchange of one flat tensor."""
        raise self._unsupported("alltoall_base")

    def barrier(self, opts: BarrierOptions | None = None) -> dist._Work:
        """Synchronises all ranks."""
        raise self._unsupported("barrier")

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        """Sends ``tensors`` to ``dst_rank``."""
        raise self._unsupported("send")

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        """Receives into ``tensors`` from ``src_rank``."""
        raise self._unsupported("recv")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank()}, size={self.size()})"


# Collective names shared by the wrappers; each entry is (method name, index of the argument
# whose value the work's future resolves to).
_COLLECTIVES: dict[str, int] = {
    "allreduce": 0,
    "allreduce_coalesced": 0,
    "allgather": 0,
    "allgather_into_tensor_coalesced": 0,
    "broadcast": 0,
    "reduce_scatter": 0,
    "reduce_scatter_tensor_coalesced": 0,
    "alltoall_base": 0,
    "barrier": -1,
    "send": 0,
    "recv": 0,
}


def _default_result(op: str, args: Sequence[object]) -> object:
    """What a skipped collective's future resolves to (its output argument)."""
    index = _COLLECTIVES[op]
    if index < 0 or not args:
        return None
    return args[index]


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
        store = create_store_client(store_addr, timeout=self._timeout)
        self._configure_store(store, rank, world_size, replica_id)

    def _configure_store(
        self, store: Store, rank: int, world_size: int, replica_id: str | None = None
    ) -> None:
        """Builds a new group on an already scoped store (also used by backend factories)."""
        _check_rank(rank, world_size)
        # Operations of the previous configuration fail (and are recorded) first; the new
        # configuration then starts without an error.
        self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was reconfigured"))
        with self._lock:
            old = self._pg
            self._pg = None
            self._error = None
        if old is not None:
            box = [old]
            del old
            self._teardown(box)
        try:
            pg = self._create_pg(store, rank, world_size)
        except Exception as e:
            self._record_error(e)
            raise
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
            target=_release, args=(box, wait > 0), name="torchft_pg_release", daemon=True
        )
        thread.start()
        if wait > 0:
            thread.join(wait)

    def abort(self) -> None:
        """Aborts the current group; it must be reconfigured before further use."""
        with self._lock:
            pg = self._pg
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
        """Releases the current group."""
        with self._lock:
            pg = self._pg
            if not self._wrapped:
                self._pg = None
        if pg is None:
            return
        if self._wrapped:
            pg.shutdown()
            return
        self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was shut down"))
        box = [pg]
        del pg
        self._teardown(box, wait=5.0)

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

    def _wrap_work(self, work: dist._Work, result: object) -> dist._Work:
        """Post-processes a work from the underlying group (timeouts, error recording)."""
        if self._wrapped:
            return work
        fut = self._inflight.track(
            _work_future(work, result), self._timeout, _weak_callback(self._record_error)
        )
        return _FutureWork(fut)  # fut already carries the deadline

    def _run(self, op: str, *args: object) -> dist._Work:
        pg = self._current()
        work = getattr(pg, op)(*args)
        return self._wrap_work(work, _default_result(op, args))

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp | Any = None
    ) -> dist._Work:
        """See ``ProcessGroup.allreduce``."""
        if self._wrapped:
            return self._run("allreduce", tensors, opts)
        return self._run("allreduce", tensors, _allreduce_opts(opts))

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | Any = None
    ) -> dist._Work:
        """See ``ProcessGroup.allreduce_coalesced``."""
        return self._run("allreduce_coalesced", tensors, opts or AllreduceCoalescedOptions())

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.allgather``."""
        return self._run("allgather", output_tensors, input_tensors, opts or AllgatherOptions())

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.allgather_into_tensor_coalesced``."""
        return self._run(
            "allgather_into_tensor_coalesced",
            output_tensors,
            input_tensors,
            opts or AllgatherOptions(),
        )

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist._Work:
        """See ``ProcessGroup.broadcast``."""
        return self._run("broadcast", tensor_list, opts or BroadcastOptions())

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.reduce_scatter``."""
        return self._run(
            "reduce_scatter", output_tensors, input_tensors, opts or ReduceScatterOptions()
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.reduce_scatter_tensor_coalesced``."""
        return self._run(
            "reduce_scatter_tensor_coalesced",
            output_tensors,
            input_tensors,
            opts or ReduceScatterOptions(),
        )

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.alltoall_base``."""
        return self._run(
            "alltoall_base",
            output_buffer,
            input_buffer,
            output_split_sizes,
            input_split_sizes,
            opts or AllToAllOptions(),
        )

    def barrier(self, opts: BarrierOptions | None = None) -> dist._Work:
        """See ``ProcessGroup.barrier``."""
        return self._run("barrier", opts or BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        """See ``ProcessGroup.send``."""
        return self._run("send", tensors, dst_rank, tag)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        """See ``ProcessGroup.recv``."""
        return self._run("recv", tensors, src_rank, tag)


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


def _recording(fut: Future[Any], owner: ProcessGroupWrapper | ProcessGroupBaby) -> Future[Any]:
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


def _work_future(work: dist._Work, result: object) -> Future[Any]:
    """The work's future, or (for backend works without one) a future completed by a
    helper thread that waits on the work and then resolves to ``result``."""
    try:
        return work.get_future()
    except RuntimeError:
        pass
    fut: Future[Any] = Future()

    def wait() -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)
            return
        fut.set_result(result)

    threading.Thread(target=wait, name="torchft_work_wait", daemon=True).start()
    return fut


def _weak_callback(method: Callable[[Exception], None]) -> Callable[[Exception], None]:
    """Wraps a bound method so a future callback does not keep its object alive."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(e: Exception) -> None:
        m = ref()
        if m is not None:
            m(e)

    return call


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")


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


class ProcessGroupGloo(ProcessGroupWrapper):
    """Reconfigurable Gloo group: every ``configure`` builds a fresh Gloo group.

    ``ReduceOp.AVG`` (which Gloo lacks) is emulated as SUM followed by a division.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Creates an unconfigured group.

        Args:
            timeout: store connection and collective timeout.
        """
        super().__init__(timeout=timeout)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        return _build_gloo(store, rank, world_size, self._timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-gloo``."""
        return "torchft-gloo"

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp | Any = None
    ) -> dist._Work:
        """Allreduce; AVG is computed as SUM / world size."""
        opts = _allreduce_opts(opts)
        if not _is_avg(opts):
            return self._run("allreduce", tensors, opts)
        world = self.size()
        work = self._run("allreduce", tensors, _copy_opts(opts, ReduceOp.SUM))

        def divide(fut: Future[Any]) -> list[torch.Tensor]:
            fut.value()
            for t in tensors:
                if t.is_floating_point() or t.is_complex():
                    t.div_(world)
                else:
                    t.floor_divide_(world)
            return tensors

        return _FutureWork(work.get_future().then(divide))


class ProcessGroupNCCL(ProcessGroupWrapper):
    """Reconfigurable NCCL group that aborts the communicator when an operation times out.

    Works wait on the GPU stream as usual; ``wait()`` is guarded by the timeout, and when it
    passes the communicator is aborted (non-blocking mode) so the caller never hangs, and
    the error is kept for ``errored()``.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Creates an unconfigured group.

        Args:
            timeout: store connection and collective timeout.
        """
        super().__init__(timeout=timeout)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        return _build_nccl(store, rank, world_size, self._timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-nccl``."""
        return "torchft-nccl"

    def _timed_out(self) -> None:
        self._record_error(TimeoutError(f"NCCL operation timed out after {self._timeout}"))
        self.abort()

    def _wrap_work(self, work: dist._Work, result: object) -> dist._Work:
        return _NCCLWork(self, work, self._timeout)


class _NCCLWork(dist._Work):
    """An NCCL work whose ``wait`` aborts the group when it passes the timeout."""

    def __init__(self, pg: ProcessGroupNCCL, work: dist._Work, timeout: timedelta) -> None:
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


class ProcessGroupDummy(ProcessGroup):
    """A group whose collectives complete at once and leave the tensors as they are.

    With ``world == 1`` this is exactly right (every collective is the identity); for larger
    worlds it behaves as if every rank held the same data. Counts ``configure`` calls for tests.
    """

    def __init__(self, rank: int, world: int) -> None:
        """Creates the group.

        Args:
            rank: the rank reported by ``rank()``.
            world: the size reported by ``size()``.
        """
        _check_rank(rank, world)
        super().__init__()
        self._rank = rank
        self._world = world
        self.configure_count = 0

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Records the new rank/size; no store is contacted."""
        _check_rank(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.configure_count += 1

    def set_timeout(self, timeout: timedelta) -> None:
        """Accepted and ignored: nothing ever waits."""
        _check_timeout(timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-dummy``."""
        return "torchft-dummy"

    def size(self) -> int:
        """The configured world size."""
        return self._world

    def rank(self) -> int:
        """The configured rank."""
        return self._rank

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp | Any = None
    ) -> dist._Work:
        """Identity; the work's future holds ``tensors``."""
        return _DummyWork(tensors)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | Any = None
    ) -> dist._Work:
        """Identity."""
        return _DummyWork(tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """Copies each input into every slot of its output list."""
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            for out in outs:
                out.copy_(inp)
        return _DummyWork(output_tensors)

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """Copies each input into every chunk of its flat output."""
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            for chunk in out.view(-1).chunk(self._world):
                chunk.copy_(inp.view(-1))
        return _DummyWork(output_tensors)

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist._Work:
        """Identity."""
        return _DummyWork(tensor_list)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """Copies this rank's piece into the output (as if every rank contributed it once)."""
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            out.copy_(ins[self._rank])
        return _DummyWork(output_tensors)

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """Copies this rank's chunk into the output."""
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            out.view(-1).copy_(inp.view(-1).chunk(self._world)[self._rank])
        return _DummyWork(output_tensors)

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> dist._Work:
        """Copies the input into the output."""
        output_buffer.copy_(input_buffer)
        return _DummyWork(output_buffer)

    def barrier(self, opts: BarrierOptions | None = None) -> dist._Work:
        """Returns at once."""
        return _DummyWork(None)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        """Dropped."""
        return _DummyWork(tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        """Leaves the tensors unchanged."""
        return _DummyWork(tensors)


class _ErrorSwallowingWork(dist._Work):
    """A work whose failures are recorded on the wrapper instead of raised."""

    def __init__(
        self, pg: ErrorSwallowingProcessGroupWrapper, work: dist._Work, default: object
    ) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._default = default

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            timeout = _work_timeout(timeout)
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            self._pg.report_error(e)
        return True

    def get_future(self) -> Future[Any]:
        return future_on_error(
            _work_future(self._work, self._default),
            _weak_callback(self._pg.report_error),
            self._default,
        )


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Records the first error of any collective and turns later collectives into no-ops.

    Training code never sees a communication exception: works always complete, with the
    caller's own tensors as the result. The error is reported by ``error()`` (and
    ``errored()``) so the step can be discarded at commit time. ``configure`` clears it.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        """Wraps ``pg``.

        Args:
            pg: the group whose errors are swallowed.
        """
        super().__init__(pg=pg)

    def error(self) -> Exception | None:
        """The recorded error, if any."""
        with self._lock:
            return self._error

    def errored(self) -> Exception | None:
        """The recorded error, or the wrapped group's."""
        return self.error() or super().errored()

    def report_error(self, e: Exception) -> None:
        """Records ``e`` (the first one wins); later collectives become no-ops."""
        self._record_error(e)

    def _run(self, op: str, *args: object) -> dist._Work:
        default = _default_result(op, args)
        if self.error() is not None:
            return _DummyWork(default)
        try:
            work = getattr(self._current(), op)(*args)
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            self.report_error(e)
            return _DummyWork(default)
        return _ErrorSwallowingWork(self, work, default)


class _FailingWork(dist._Work):
    """A work that fails with a given error once the underlying work is done."""

    def __init__(self, work: dist._Work, error: Exception) -> None:
        super().__init__()
        self._work = work
        self._error = error
        self._fut: Future[Any] = Future()
        err = error

        def fail(f: Future[Any]) -> None:
            self._fut.set_exception(err)

        _work_future(work, None).add_done_callback(fail)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()
        return True

    def get_future(self) -> Future[Any]:
        return self._fut


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Test helper: ``report_future_error(e)`` makes the next collective's future fail."""

    def __init__(self, pg: ProcessGroup) -> None:
        """Wraps ``pg``.

        Args:
            pg: the group that really runs the collectives.
        """
        super().__init__(pg=pg)
        self._future_error: Exception | None = None

    def report_future_error(self, e: Exception) -> None:
        """Makes the future (and ``wait()``) of the next collective fail with ``e``."""
        with self._lock:
            self._future_error = e

    def _run(self, op: str, *args: object) -> dist._Work:
        work = getattr(self._current(), op)(*args)
        with self._lock:
            err = self._future_error
            self._future_error = None
        if err is None:
            return work
        return _FailingWork(work, err)


class ManagedProcessGroup(ProcessGroupWrapper):
    """A process group whose allreduce goes through a ``Manager``.

    This lets torch code that expects a group (DeviceMesh, FSDP's replicate dimension) use
    the fault-tolerant allreduce: errors are swallowed by the manager and the world size is
    the number of participating replica groups.
    """

    def __init__(self, manager: Manager) -> None:
        """Wraps ``manager``.

        Args:
            manager: the Manager whose ``allreduce`` and group are used.
        """
        inner = getattr(manager, "_pg", None)
        super().__init__(pg=inner if isinstance(inner, ProcessGroup) else ProcessGroupDummy(0, 1))
        self._manager = manager

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp | Any = None
    ) -> dist._Work:
        """Allreduces each tensor with ``manager.allreduce``; the future holds ``tensors``."""
        op = _allreduce_opts(opts).reduceOp
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        futures = []
        for t in tensors:
            work = self._manager.allreduce(t, reduce_op=op)
            futures.append(work.get_future())
        if len(futures) == 1:
            result = futures[0].then(lambda f: (f.value(), tensors)[1])
        else:
            result = torch.futures.collect_all(futures).then(
                lambda f: ([x.value() for x in f.value()], tensors)[1]
            )
        return _FutureWork(result)

    def size(self) -> int:
        """Number of replica groups taking part in the current step."""
        return int(self._manager.num_participants())

    def rank(self) -> int:
        """This replica group's participating rank (0 when not participating)."""
        rank = self._manager.participating_rank()
        return int(rank) if rank is not None else 0

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-managed``."""
        return "torchft-managed"


# ---- process groups living in a child process -----------------------------------------

_REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def _reduce_op_name(op: Any) -> str:
    """Turns a ReduceOp (which cannot be pickled) into its name."""
    for name in _REDUCE_OPS:
        if op == getattr(ReduceOp, name):
            return name
    raise ValueError(f"unsupported reduce op for a child-process group: {op!r}")


def _detach(value: object) -> object:
    """Detaches tensors (sharing storage) so they can be sent to the child process."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, list):
        return [_detach(v) for v in value]
    return value


# Tensors go to the child as shared memory. torch's default pickling passes each storage's
# fd through a helper thread that keeps a duplicate until the receiver fetches it, which
# leaks when the child is killed first (the usual case for a stuck collective). Here the
# fds travel in-band with the message over a Unix socket instead (SCM_RIGHTS): if the child
# dies before reading, the kernel closes them with the socket.

_HEADER = struct.Struct("!QI")  # payload length, number of fds
_MAX_FDS = 4096
_fd_context = threading.local()


def _reduce_storage_inband(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """Pickles a CPU storage as an index into the fds sent with the message."""
    fds: list[int] | None = getattr(_fd_context, "fds", None)
    if fds is None or storage.device.type != "cpu" or storage.size() == 0:
        from torch.multiprocessing.reductions import reduce_storage

        return reduce_storage(storage)
    fd, size = storage._share_fd_cpu_()
    fds.append(fd)
    return (_rebuild_storage_inband, (len(fds) - 1, size))


def _rebuild_storage_inband(index: int, size: int) -> torch.UntypedStorage:
    """Maps the ``index``-th fd received with the current message (child side)."""
    from torch.multiprocessing.reductions import StorageWeakRef, fd_id, shared_cache

    fd = _fd_context.received[index]
    key = fd_id(fd)
    cached = shared_cache.get(key)
    if cached is not None:
        storage = torch.UntypedStorage._new_with_weak_ptr(cached.cdata)
        if storage is not None:
            return storage
    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
    shared_cache[key] = StorageWeakRef(storage)
    return storage


class _InbandPickler(ForkingPickler):
    """ForkingPickler whose CPU storages are sent as in-band fds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage_inband


def _dumps_inband(obj: object) -> tuple[bytes, list[int]]:
    """Pickles ``obj``; returns the bytes and the fds (owned by the storages) to send."""
    buf = io.BytesIO()
    fds: list[int] = []
    _fd_context.fds = fds
    try:
        _InbandPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        _fd_context.fds = None
    return buf.getvalue(), fds


def _send_inband(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """Sends one framed message; the fds ride with its header."""
    header = _HEADER.pack(len(payload), len(fds))
    if fds:
        sent = socket.send_fds(sock, [header], fds)
        if sent < len(header):
            sock.sendall(header[sent:])
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise EOFError("socket closed")
        chunks += chunk
    return bytes(chunks)


def _recv_inband(sock: socket.socket) -> object:
    """Receives one framed message and unpickles it (closing the received fds after)."""
    data, fds, flags, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    try:
        if not data:
            raise EOFError("socket closed")
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            raise RuntimeError("too many tensors in one operation")
        if len(data) < _HEADER.size:
            data += _recv_exact(sock, _HEADER.size - len(data))
        length, nfds = _HEADER.unpack(data)
        if nfds != len(fds):
            raise RuntimeError(f"expected {nfds} fds, received {len(fds)}")
        payload = _recv_exact(sock, length)
        _fd_context.received = fds
        try:
            return pickle.loads(payload)
        finally:
            _fd_context.received = None
    finally:
        for fd in fds:
            os.close(fd)


@dataclass
class _BabyOp:
    """One operation sent to the child: a ProcessGroup method name and picklable args."""

    op_id: int
    method: str
    args: tuple[object, ...]


def _child_run_op(pg: ProcessGroup, method: str, args: tuple[object, ...]) -> dist._Work:
    """Rebuilds torch options from the plain arguments and runs the op on ``pg``."""
    if method in ("allreduce", "allreduce_coalesced"):
        tensors, op_name = args
        opts = AllreduceOptions() if method == "allreduce" else AllreduceCoalescedOptions()
        opts.reduceOp = getattr(ReduceOp, str(op_name))
        return getattr(pg, method)(tensors, opts)
    if method in ("reduce_scatter", "reduce_scatter_tensor_coalesced"):
        outputs, inputs, op_name = args
        rs_opts = ReduceScatterOptions()
        rs_opts.reduceOp = getattr(ReduceOp, str(op_name))
        return getattr(pg, method)(outputs, inputs, rs_opts)
    if method == "broadcast":
        tensors, root = args
        b_opts = BroadcastOptions()
        b_opts.rootRank = int(root)  # type: ignore[arg-type]
        return pg.broadcast(tensors, b_opts)  # type: ignore[arg-type]
    return getattr(pg, method)(*args)


def _start_parent_watchdog(parent_pid: int, interval: float = 0.5) -> None:
    """Exits this (child) process soon after its parent dies.

    EOF on the request pipe covers the common case, but the child may be stuck elsewhere
    (e.g. in a rendezvous that never completes); polling the parent pid covers that. A
    kernel parent-death signal is not used because it fires when the *thread* that
    spawned us exits, which is legitimate here.
    """

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(interval)

    threading.Thread(target=watch, name="torchft_parent_watchdog", daemon=True).start()


def _baby_worker(
    create: Callable[[Store, int, int, timedelta], ProcessGroup],
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    cuda_device: int | None,
    req: Any,
    resp: Any,
    parent_pid: int,
) -> None:
    """Entry point of the child process: builds the group and serves operations.

    Replies are ("ready",), ("done", op_id), ("error", op_id, message) or ("fatal", message).
    The loop ends when the parent closes its pipe (or dies) or asks for shutdown.
    """
    _start_parent_watchdog(parent_pid)
    use_cuda = cuda_device is not None
    if cuda_device is not None:
        # Same device as the parent's tensors.
        torch.cuda.set_device(cuda_device)
    send_lock = threading.Lock()

    def reply(msg: tuple[object, ...]) -> None:
        with send_lock:
            try:
                resp.send(msg)
            except (OSError, EOFError):
                pass

    try:
        store = create_store_client(store_addr, timeout)
        pg = create(store, rank, world_size, timeout)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        reply(("fatal", f"{type(e).__name__}: {e}"))
        return
    reply(("ready",))

    while True:
        try:
            msg = _recv_inband(req)
        except (EOFError, OSError):
            # The parent is gone: exit at once, even if a collective is stuck in the backend.
            os._exit(0)
        if msg is None:
            break
        if not isinstance(msg, _BabyOp):
            reply(("fatal", f"unexpected message {type(msg).__name__}"))
            break
        op_id = msg.op_id
        try:
            work = _child_run_op(pg, msg.method, msg.args)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            reply(("error", op_id, f"{type(e).__name__}: {e}"))
            continue

        def done(fut: Future[Any], op_id: int = op_id) -> None:
            try:
                fut.value()
                if use_cuda:
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported to the parent
                reply(("error", op_id, f"{type(e).__name__}: {e}"))
                return
            reply(("done", op_id))

        work.get_future().add_done_callback(done)
    # Polite shutdown requested; the parent kills us if this takes too long.
    pg.shutdown()


class _BabyChild:
    """Parent-side handle of one child process: pipes, a reader thread and pending futures."""

    def __init__(
        self,
        create: Callable[[Store, int, int, timedelta], ProcessGroup],
        store_addr: str,
        rank: int,
        world_size: int,
        timeout: timedelta,
        cuda_device: int | None,
    ) -> None:
        ctx = mp.get_context("spawn")
        req_w, req_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        resp_r, resp_w = ctx.Pipe(duplex=False)
        self._req = req_w
        self._resp = resp_r
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future[Any], object]] = {}
        self._next_id = 0
        self._closed = False
        self._error: Exception | None = None
        self.ready: Future[None] = Future()
        self.process = ctx.Process(
            target=_baby_worker,
            args=(
                create,
                store_addr,
                rank,
                world_size,
                timeout,
                cuda_device,
                req_r,
                resp_w,
                os.getpid(),
            ),
            name=f"torchft_baby_{rank}",
            daemon=True,
        )
        try:
            self.process.start()
        finally:
            # The child owns these ends now; keeping them open would hide its death (no EOF).
            req_r.close()
            resp_w.close()
        self._outbox: queue.SimpleQueue[tuple[bytes, list[int], object] | None] = (
            queue.SimpleQueue()
        )
        self._reader = threading.Thread(
            target=self._read_loop, name="torchft_baby_reader", daemon=True
        )
        self._reader.start()
        self._sender = threading.Thread(
            target=self._send_loop, name="torchft_baby_sender", daemon=True
        )
        self._sender.start()

    def submit(self, method: str, args: tuple[object, ...], result: object) -> Future[Any]:
        """Sends one operation; the returned future resolves to ``result`` when it is done."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed or self._error is not None:
                err = self._error or RuntimeError("child process group is closed")
                fut.set_exception(err)
                return fut
            op_id = self._next_id
            self._next_id += 1
            self._pending[op_id] = (fut, result)
        try:
            # Pickled here, in the caller's thread: this is where tensors move to shared
            # memory, so it must not race with the caller's own use of them.
            payload, fds = _dumps_inband(_BabyOp(op_id, method, args))
        except Exception as e:  # noqa: BLE001 - e.g. a tensor that cannot be shared
            with self._lock:
                self._pending.pop(op_id, None)
            fut.set_exception(RuntimeError(f"cannot send {method} to the child process: {e}"))
            return fut
        # A separate thread writes to the pipe, so a stuck child (full pipe) never blocks us.
        # ``args`` rides along: its storages own the fds until they are sent.
        self._outbox.put((payload, fds, args))
        return fut

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            payload, fds, _keepalive = item
            try:
                _send_inband(self._req, payload, fds)
            except Exception as e:  # noqa: BLE001 - broken pipe means the child is gone
                self._fail_all(RuntimeError(f"sending to the child process failed: {e}"))
                return

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._resp.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - a garbled reply ends the child
                logger.warning("bad reply from the child process group: %s", e)
                break
            kind = msg[0]
            if kind == "ready":
                self.ready.set_result(None)
            elif kind == "fatal":
                self._fail_all(RuntimeError(f"child process group failed to start: {msg[1]}"))
            elif kind in ("done", "error"):
                with self._lock:
                    entry = self._pending.pop(msg[1], None)
                if entry is None:
                    continue
                fut, result = entry
                if kind == "done":
                    fut.set_result(result)
                else:
                    fut.set_exception(RuntimeError(f"collective failed in child: {msg[2]}"))
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        self._fail_all(RuntimeError(f"child process group exited (exit code {code})"))

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
            pending = [fut for fut, _ in self._pending.values()]
            self._pending.clear()
        if not self.ready.done():
            self.ready.set_exception(err)
        # Only futures are kept here (not their tensors): an error stored later may hold this
        # frame through its traceback.
        for fut in pending:
            if not fut.done():
                fut.set_exception(err)

    @property
    def error(self) -> Exception | None:
        """Why the child stopped serving, if it did."""
        with self._lock:
            return self._error

    def close(self, graceful: bool = False) -> None:
        """Stops the child (politely if ``graceful``), joins it and releases every fd."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if graceful and self.process.is_alive():
            self._outbox.put((pickle.dumps(None), [], None))
            self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10.0)
        self._outbox.put(None)
        self._sender.join(timeout=10.0)
        self._reader.join(timeout=10.0)
        self._fail_all(RuntimeError("child process group was shut down"))
        self._req.close()
        self._resp.close()
        try:
            self.process.close()
        except ValueError:
            logger.warning("child process %s did not exit", self.process.pid)


class ProcessGroupBaby(ProcessGroup):
    """A process group whose real backend runs in a child process.

    ``configure`` and ``abort`` kill the child and spawn a new one, so a collective stuck in
    a backend (or a crashed backend) never takes the training process with it. Tensors are
    moved to shared memory (CPU) or shared through CUDA IPC, operations are sent over a
    pipe, and results come back as futures bounded by the timeout. A child that dies fails
    every pending future at once.
    """

    _use_cuda = False

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Creates an unconfigured group (no child yet).

        Args:
            timeout: store connection and per-operation timeout.
        """
        super().__init__()
        self._timeout = _env_timeout(_check_timeout(timeout))
        self._lock = threading.Lock()
        self._child: _BabyChild | None = None
        self._rank = 0
        self._world_size = 1
        self._error: Exception | None = None
        self._finalizer: weakref.finalize | None = None
        self._inflight = _InFlight()

    @classmethod
    def _create_pg(
        cls, store: Store, rank: int, world_size: int, timeout: timedelta
    ) -> ProcessGroup:
        """Builds the real group inside the child (subclasses implement)."""
        raise NotImplementedError(f"{cls.__name__} does not implement _create_pg")

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Kills the current child and spawns one that joins ``store_addr`` as ``rank``."""
        _check_rank(rank, world_size)
        _parse_store_addr(store_addr)
        if self._use_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"{type(self).__name__} needs CUDA GPUs")
        self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was reconfigured"))
        self._stop_child(graceful=False)
        child = _BabyChild(
            type(self)._create_pg,
            store_addr,
            rank,
            world_size,
            self._timeout,
            torch.cuda.current_device() if self._use_cuda else None,
        )
        with self._lock:
            self._child = child
            self._rank = rank
            self._world_size = world_size
            self._error = None
            self._finalizer = weakref.finalize(self, child.close)
        logger.info(
            "%s configured: replica_id=%s rank=%d world_size=%d pid=%s",
            type(self).__name__,
            replica_id,
            rank,
            world_size,
            child.process.pid,
        )

    def _configure_store(
        self, store: Store, rank: int, world_size: int, replica_id: str | None = None
    ) -> None:
        """Configures from a store object (backend factories): the child needs an address,
        so a fresh prefix on the same TCPStore server is agreed through ``store``."""
        base = store
        while isinstance(base, PrefixStore):
            base = base.underlying_store
        if not isinstance(base, TCPStore):
            raise ValueError(
                f"{type(self).__name__} needs a TCPStore-backed store, got {type(base).__name__}"
            )
        key = "torchft_baby_prefix"
        if rank == 0:
            store.set(key, f"torchft_baby/{uuid.uuid4().hex}")
        prefix = store.get(key).decode()
        self.configure(f"{base.host}:{base.port}/{prefix}", replica_id or "", rank, world_size)

    def _stop_child(self, graceful: bool) -> None:
        with self._lock:
            child = self._child
            self._child = None
            finalizer = self._finalizer
            self._finalizer = None
        if finalizer is not None:
            finalizer.detach()
        if child is not None:
            child.close(graceful=graceful)

    def abort(self) -> None:
        """Kills the child at once; pending operations fail. Reconfigure to continue."""
        err = RuntimeError(f"{type(self).__name__} was aborted")
        with self._lock:
            if self._child is not None and self._error is None:
                self._error = err
        # Release waiters first; killing and joining the child can take a moment.
        self._inflight.fail_all(err)
        self._stop_child(graceful=False)

    def shutdown(self) -> None:
        """Stops the child process and releases its pipes."""
        self._stop_child(graceful=True)

    def errored(self) -> Exception | None:
        """The first error since ``configure`` (timeouts, child death, failed ops)."""
        with self._lock:
            if self._error is not None:
                return self._error
            child = self._child
        return child.error if child is not None else None

    def set_timeout(self, timeout: timedelta) -> None:
        """Changes the per-operation timeout (the child's store timeout applies next configure)."""
        self._timeout = _check_timeout(timeout)

    def size(self) -> int:
        """World size of the current configuration."""
        return self._world_size

    def rank(self) -> int:
        """Rank of this process in the current configuration."""
        return self._rank

    def num_active_work(self) -> int:
        """Number of operations still in flight (for tests and debugging)."""
        with self._lock:
            child = self._child
        if child is None:
            return 0
        with child._lock:
            return len(child._pending)

    def _record_error(self, e: Exception) -> None:
        with self._lock:
            if self._error is None:
                self._error = e

    def _submit(self, method: str, args: tuple[object, ...], result: object) -> dist._Work:
        with self._lock:
            child = self._child
        if child is None:
            raise RuntimeError(f"{type(self).__name__} is not configured")
        if self._use_cuda:
            # The child reads the tensors from its own streams.
            torch.cuda.current_stream().synchronize()
        fut = self._inflight.track(
            child.submit(method, args, result), self._timeout, _weak_callback(self._record_error)
        )
        return _FutureWork(fut)  # fut already carries the deadline

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp | Any = None
    ) -> dist._Work:
        """See ``ProcessGroup.allreduce``; the child reduces the shared tensors in place."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = _reduce_op_name(_allreduce_opts(opts).reduceOp)
        return self._submit("allreduce", (_detach(tensors), op), tensors)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | Any = None
    ) -> dist._Work:
        """See ``ProcessGroup.allreduce_coalesced``."""
        op = _reduce_op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return self._submit("allreduce_coalesced", (_detach(tensors), op), tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.allgather``."""
        return self._submit(
            "allgather", (_detach(output_tensors), _detach(input_tensors)), output_tensors
        )

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.allgather_into_tensor_coalesced``."""
        return self._submit(
            "allgather_into_tensor_coalesced",
            (_detach(output_tensors), _detach(input_tensors)),
            output_tensors,
        )

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist._Work:
        """See ``ProcessGroup.broadcast``."""
        root = opts.rootRank if opts is not None else 0
        return self._submit("broadcast", (_detach(tensor_list), root), tensor_list)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.reduce_scatter``."""
        op = _reduce_op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return self._submit(
            "reduce_scatter",
            (_detach(output_tensors), _detach(input_tensors), op),
            output_tensors,
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.reduce_scatter_tensor_coalesced``."""
        op = _reduce_op_name(opts.reduceOp if opts is not None else ReduceOp.SUM)
        return self._submit(
            "reduce_scatter_tensor_coalesced",
            (_detach(output_tensors), _detach(input_tensors), op),
            output_tensors,
        )

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> dist._Work:
        """See ``ProcessGroup.alltoall_base``."""
        return self._submit(
            "alltoall_base",
            (
                _detach(output_buffer),
                _detach(input_buffer),
                list(output_split_sizes),
                list(input_split_sizes),
            ),
            output_buffer,
        )

    def barrier(self, opts: BarrierOptions | None = None) -> dist._Work:
        """See ``ProcessGroup.barrier``."""
        return self._submit("barrier", (), None)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist._Work:
        """See ``ProcessGroup.send``."""
        return self._submit("send", (_detach(tensors), dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist._Work:
        """See ``ProcessGroup.recv``."""
        return self._submit("recv", (_detach(tensors), src_rank, tag), tensors)


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """``ProcessGroupBaby`` running a Gloo group in the child (CPU tensors)."""

    @classmethod
    def _create_pg(
        cls, store: Store, rank: int, world_size: int, timeout: timedelta
    ) -> ProcessGroup:
        pg = ProcessGroupGloo(timeout=timeout)
        pg._configure_store(store, rank, world_size)
        return pg

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-baby-gloo``."""
        return "torchft-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """``ProcessGroupBaby`` running an NCCL group in the child (CUDA tensors via IPC).

    The parent synchronises its current stream before handing tensors over and the child
    synchronises its device before reporting completion, so results are visible to the
    parent's streams once the future resolves.
    """

    _use_cuda = True

    @classmethod
    def _create_pg(
        cls, store: Store, rank: int, world_size: int, timeout: timedelta
    ) -> ProcessGroup:
        # The worker already selected the parent's current device.
        pg = ProcessGroupNCCL(timeout=timeout)
        pg._configure_store(store, rank, world_size)
        return pg

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-baby-nccl``."""
        return "torchft-baby-nccl"


# ---- torch.distributed backend registration -------------------------------------------


def _backend_factory(
    cls: type[ProcessGroupWrapper] | type[ProcessGroupBaby],
) -> Callable[[Store, int, int, timedelta], ProcessGroup]:
    def create(store: Store, rank: int, world_size: int, timeout: timedelta) -> ProcessGroup:
        pg = cls(timeout=timeout)  # type: ignore[call-arg]
        pg._configure_store(store, rank, world_size)
        return pg

    return create


def _register_backends() -> None:
    """Registers the torchft backends with torch.distributed (safe to call repeatedly)."""
    backends: list[tuple[str, Any, list[str]]] = [
        ("torchft-gloo", ProcessGroupGloo, ["cpu", "cuda"]),
        ("torchft-nccl", ProcessGroupNCCL, ["cuda"]),
        ("torchft-baby-gloo", ProcessGroupBabyGloo, ["cpu"]),
        ("torchft-baby-nccl", ProcessGroupBabyNCCL, ["cuda"]),
    ]
    plugins = getattr(dist.Backend, "_plugins", {})
    for name, cls, devices in backends:
        if name.upper() in plugins or name in dist.Backend.backend_list:
            continue
        dist.Backend.register_backend(name, _backend_factory(cls), devices=devices)


_register_backends()
