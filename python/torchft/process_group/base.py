"""The base of every torchft process group, and the helpers all of them share.

``ProcessGroup`` writes each collective's signature once: the public method normalises its
arguments (default options, a bare tensor turned into a list) and hands the operation to
``_dispatch(op, args)``, the one method an implementation overrides. ``args`` is exactly the
positional argument tuple of the torch backend method of the same name, so a wrapper can
forward it with ``getattr(pg, op)(*args)``.

The environment variable ``TORCHFT_TIMEOUT_SEC`` overrides the timeout given to any group.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceScatterOptions,
    Store,
    TCPStore,
)
from torch.distributed import ProcessGroup as BaseProcessGroup
from torch.distributed import ReduceOp
from torch.futures import Future

from torchft.config import timeout_override
from torchft.work import device_future

logger: logging.Logger = logging.getLogger(__name__)


class AbortedTimeoutError(TimeoutError, RuntimeError):
    """An operation passed its timeout and the group was aborted to end it.

    A ``TimeoutError`` like every torchft deadline, and a ``RuntimeError`` whose message says
    "aborted", which is what upstream torchft's aborted groups report from ``errored()``.
    """


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
        from torch._C._distributed_c10d import HashStore, _register_process_group
        from torch.distributed.distributed_c10d import GroupName, _world

        if not name:
            raise ValueError("register needs a non-empty name")
        if name in _world.pg_names.values():
            raise ValueError(f"a process group named {name!r} is already registered")
        if self._group_name is not None:
            self.unregister()
        self._set_group_name(GroupName(name))
        self._group_name = name
        store = self._registered_store or HashStore()
        _world.pg_map[self] = (self.getBackendName(), store)
        _world.pg_names[self] = GroupName(name)
        _world.pg_group_ranks[self] = {i: i for i in range(self._registration_size())}
        _world.pg_backend_config[self] = self.getBackendName()
        tag = f"ptd:{name}"
        _world.pg_to_tag[self] = tag
        _world.tags_to_pg.setdefault(tag, []).append(self)
        _world.tags_to_pg.setdefault("", []).append(self)
        _register_process_group(GroupName(name), self)
        return self

    def _registration_size(self) -> int:
        """The group size recorded with torch when registering (the current size)."""
        return self.size()

    def unregister(self) -> None:
        """Undoes ``register`` (a no-op if the group is not registered)."""
        from torch._C._distributed_c10d import _unregister_process_group
        from torch.distributed.distributed_c10d import GroupName, _world

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
            _unregister_process_group(GroupName(name))
        except Exception:  # noqa: BLE001 - already gone is fine
            logger.debug("process group %s was not registered in c10d", name)

    # ---- collectives -----------------------------------------------------------------
    # Each signature is written here once. Implementations override ``_dispatch``.
    # torch's stubs also list the C++ methods' op/timeout overloads; these take the options
    # form that torch.distributed calls, hence the ignore[override] on six of them.

    def _unsupported(self, op: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not support {op}")

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        """Runs collective ``op`` with its normalised positional arguments.

        Args:
            op: the collective's name (a key of ``_COLLECTIVES``).
            args: the arguments of the torch backend method of that name, options filled in.

        Returns:
            The operation's Work.
        """
        raise self._unsupported(op)

    def allreduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp | Any = None
    ) -> dist.Work:
        """Reduces ``tensors`` in place across the group.

        Args:
            tensors: the tensors to reduce (in place); a single tensor is accepted too.
            opts: an ``AllreduceOptions`` or a ``ReduceOp`` (default SUM).

        Returns:
            A Work whose future resolves to ``tensors``.
        """
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        return self._dispatch("allreduce", (tensors, _allreduce_opts(opts)))

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | Any = None
    ) -> dist.Work:
        """Reduces several tensors as one operation."""
        return self._dispatch("allreduce_coalesced", (tensors, opts or AllreduceCoalescedOptions()))

    def allgather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        """Gathers every rank's ``input_tensors[i]`` into ``output_tensors[i]``."""
        return self._dispatch(
            "allgather", (output_tensors, input_tensors, opts or AllgatherOptions())
        )

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> dist.Work:
        """Gathers into flat output tensors."""
        return self._dispatch(
            "allgather_into_tensor_coalesced",
            (output_tensors, input_tensors, opts or AllgatherOptions()),
        )

    def broadcast(  # type: ignore[override]
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> dist.Work:
        """Copies the root's tensors to every rank."""
        return self._dispatch("broadcast", (tensor_list, opts or BroadcastOptions()))

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
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

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> dist.Work:
        """Reduces ``input_tensors`` and scatters the pieces to the ranks."""
        return self._dispatch(
            "reduce_scatter", (output_tensors, input_tensors, opts or ReduceScatterOptions())
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> dist.Work:
        """Reduce-scatter of flat tensors."""
        return self._dispatch(
            "reduce_scatter_tensor_coalesced",
            (output_tensors, input_tensors, opts or ReduceScatterOptions()),
        )

    def alltoall_base(  # type: ignore[override]
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> dist.Work:
        """All-to-all exchange of one flat tensor."""
        return self._dispatch(
            "alltoall_base",
            (
                output_buffer,
                input_buffer,
                output_split_sizes,
                input_split_sizes,
                opts or AllToAllOptions(),
            ),
        )

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:  # type: ignore[override]
        """Synchronises all ranks."""
        return self._dispatch("barrier", (opts or BarrierOptions(),))

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        """Sends ``tensors`` to ``dst_rank``."""
        return self._dispatch("send", (tensors, dst_rank, tag))

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        """Receives into ``tensors`` from ``src_rank``."""
        return self._dispatch("recv", (tensors, src_rank, tag))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank()}, size={self.size()})"


# Every collective, with the index of the argument whose value the work's future resolves to
# (-1: none).
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


def _work_future(work: dist.Work, result: object) -> Future[Any]:
    """The work's future, or (for backend works without one) a future completed by a
    helper thread that waits on the work and then resolves to ``result``."""
    try:
        return work.get_future()
    except RuntimeError:
        pass
    fut: Future[Any] = device_future(result)

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
    ref = weakref.WeakMethod(method)

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
