"""Process groups whose real backend runs in a child process (Gloo or NCCL).

``configure`` and ``abort`` kill the child and spawn a new one, so a collective stuck in a
backend (or a crashed backend) never takes the training process with it. The wire between
parent and child lives in ``baby_ipc``.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from torchft.process_group.baby_ipc import _BabyChild, _ChildGroup, _to_wire
from torchft.process_group.base import (
    ProcessGroup,
    _check_rank,
    _check_timeout,
    _default_result,
    _env_timeout,
    _parse_store_addr,
    _weak_callback,
)
from torchft.process_group.reconfigurable import ProcessGroupGloo, ProcessGroupNCCL
from torchft.work import _InFlight

logger: logging.Logger = logging.getLogger(__name__)


class ProcessGroupBaby(ProcessGroup):
    """A process group whose real backend runs in a child process.

    ``configure`` and ``abort`` kill the child and spawn a new one, so a collective stuck in
    a backend (or a crashed backend) never takes the training process with it. Tensors are
    moved to shared memory (CPU) or shared through CUDA IPC, operations are sent over a
    pipe, and results come back as futures bounded by the timeout. A child that dies fails
    every pending future at once.
    """

    _use_cuda = False
    #: The torchft group the child builds on the store with the group's timeout (a subclass
    #: that needs more overrides ``_create_pg`` instead).
    _child_pg: ClassVar[type[ProcessGroupGloo] | type[ProcessGroupNCCL] | None] = None

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
        self._finalizer: weakref.finalize[[], ProcessGroupBaby] | None = None
        self._inflight = _InFlight()
        # Made once: an operation's error is recorded without keeping the group alive.
        self._on_error = _weak_callback(self._record_error)

    @classmethod
    def _create_pg(
        cls, store: Store, rank: int, world_size: int, timeout: timedelta
    ) -> ProcessGroup:
        """Builds the real group inside the child (subclasses set ``_child_pg`` or implement
        this). With CUDA the worker has already selected the parent's current device."""
        if cls._child_pg is None:
            raise NotImplementedError(f"{cls.__name__} does not implement _create_pg")
        pg = cls._child_pg(timeout=timeout)
        pg._configure_store(store, rank, world_size)
        return pg

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Kills the current child and spawns one that joins ``store_addr`` as ``rank``."""
        _check_rank(rank, world_size)
        _parse_store_addr(store_addr)
        if self._use_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"{type(self).__name__} needs CUDA GPUs")
        self._inflight.fail_all(RuntimeError(f"{type(self).__name__} was reconfigured"))
        self._stop_child(graceful=False)
        child = _BabyChild(
            _ChildGroup(
                type(self)._create_pg,
                store_addr,
                rank,
                world_size,
                self._timeout,
                torch.cuda.current_device() if self._use_cuda else None,
            )
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

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        """Sends ``op`` to the child, which runs it on the shared tensors in place."""
        wire = _to_wire(args)
        with self._lock:
            child = self._child
        if child is None:
            raise RuntimeError(f"{type(self).__name__} is not configured")
        if self._use_cuda:
            # The child reads the tensors from its own streams.
            torch.cuda.current_stream().synchronize()
        return self._inflight.work(
            child.submit(op, wire, _default_result(op, args)),
            self._timeout,
            self._on_error,
        )


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """``ProcessGroupBaby`` running a Gloo group in the child (CPU tensors)."""

    _child_pg = ProcessGroupGloo

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
    _child_pg = ProcessGroupNCCL

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-baby-nccl``."""
        return "torchft-baby-nccl"
