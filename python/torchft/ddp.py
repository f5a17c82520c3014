"""Data parallelism whose gradient averaging goes through the Manager.

torch's ``DistributedDataParallel`` is kept for bucketing and overlap; the replica dimension
(which changes with every quorum) is owned by the Manager, which also swallows communication
errors so backward never raises. With a ``Manager``, torch's reducer is given a process group
whose size is the step's participant count and whose allreduce is the Manager's SUM: the
reducer then divides each gradient as it copies it into its bucket, in the same pass (a
communication hook would copy, and the average would be a second pass over the bucket).
Anything else that quacks like a manager gets a group of one and a hook that hands every
bucket to its ``allreduce``.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed import ReduceOp
from torch.futures import Future
from torch.nn import parallel

from torchft.process_group import ProcessGroupDummy
from torchft.telemetry import forward_done

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from torchft.manager import Manager

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]


def _first_tensor(value: object) -> torch.Tensor:
    """A manager allreduce future holds the tensor (or a one-element list of it)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise TypeError(f"allreduce future must hold a tensor, got {type(value).__name__}")


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP whose gradient communication goes through ``manager.allreduce``.

    Initial state synchronisation is left to the Manager (a joining replica heals from a
    peer), so buffers are not broadcast and parameters are not synced at construction.
    """

    def __init__(self, manager: Manager, module: nn.Module, **kwargs: Any) -> None:
        """Wraps ``module``.

        Args:
            manager: the Manager whose ``allreduce`` averages gradients across replicas.
            module: the model.
            **kwargs: forwarded to ``torch.nn.parallel.DistributedDataParallel``
                (``process_group``, ``broadcast_buffers`` and ``init_sync`` are fixed).

        Raises:
            ValueError: a fixed argument was passed.
        """
        for fixed in ("process_group", "broadcast_buffers", "init_sync"):
            if fixed in kwargs:
                raise ValueError(f"{fixed!r} is managed by torchft and cannot be passed")
        # The replica dimension goes through the manager. A Manager's group is handed to the
        # reducer itself (see _ManagerGroup); anything else that quacks like a manager gets a
        # group of one and a communication hook.
        from torchft.manager import Manager

        fused = isinstance(manager, Manager)
        group = _ManagerGroup(manager) if fused else ProcessGroupDummy(0, 1)
        with warnings.catch_warnings():
            # Newer torch deprecates broadcast_buffers, but it is still the only switch that
            # also skips the buffer sync at construction.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*")
            super().__init__(
                module,
                process_group=group,
                broadcast_buffers=False,
                init_sync=False,
                **kwargs,
            )
        self._manager = manager
        # torch re-buckets after the first backward (in gradient-ready order). A replica that
        # joins later would then reduce its first step with a different bucket layout than
        # its peers and mix up gradients, so fix the final layout now, identically everywhere.
        # The reducer's parameters are in reverse definition order (see
        # _build_params_for_reducer), which approximates the order gradients become ready, so
        # the early buckets can be reduced while backward is still running.
        reducer = getattr(self, "reducer", None)
        if reducer is not None and hasattr(reducer, "_push_all_rebuilt_params"):
            reducer._push_all_rebuilt_params()
            reducer._rebuild_buckets()
        if not fused:
            super().register_comm_hook(manager, _manager_comm_hook)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """Refused: the gradients' communication is torchft's (through the Manager). DDP's
        ``mixed_precision`` and optimizer-in-backward register one too, so they are refused
        here as well."""
        raise RuntimeError(_NO_HOOK)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """Refused, as :meth:`register_comm_hook`."""
        raise RuntimeError(_NO_HOOK)

    def join(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: uneven inputs across replica groups are the quorum's business (a group
        that stops training leaves it); DDP's join would run its own collectives through the
        Manager outside any step."""
        raise RuntimeError(
            "torchft's DistributedDataParallel does not support join(): a replica group that "
            "runs out of data stops calling the Manager and the others go on without it"
        )

    def join_hook(self, **kwargs: Any) -> Any:
        """Refused, as :meth:`join` (``torch.distributed.algorithms.Join`` asks for it)."""
        return self.join()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the wrapped DDP forward, timed as the step's forward phase (telemetry)."""
        t0 = time.perf_counter()
        try:
            return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            forward_done(t0)

    def _build_params_for_reducer(self) -> tuple[list[torch.Tensor], list[bool]]:
        """The reducer's parameters, last-defined first (roughly gradient-ready order)."""
        # torch leaves DistributedDataParallel._build_params_for_reducer unannotated.
        parameters, expect_sparse_gradient = super()._build_params_for_reducer()  # type: ignore[no-untyped-call]
        return list(reversed(parameters)), list(reversed(expect_sparse_gradient))


def _manager_comm_hook(state: Manager, bucket: GradBucket) -> Future[torch.Tensor]:
    """Averages one gradient bucket across replicas through the Manager.

    Args:
        state: the Manager.
        bucket: the gradient bucket (its flat buffer is reduced).

    Returns:
        A future holding the averaged buffer.
    """
    buffer = bucket.buffer()
    work = state.allreduce(buffer)
    return work.get_future().then(lambda fut: _first_tensor(fut.value()))


_NO_HOOK = (
    "torchft's DistributedDataParallel averages gradients through the Manager and takes no "
    "communication hook (DDP's mixed_precision and optimizer-in-backward install one)"
)


class _ManagerGroup(ProcessGroupDummy):
    """The process group torch's reducer is given for a ``Manager``: no communication hook,
    so the reducer's own path runs, which writes each gradient into its bucket already
    divided by the group's ``size()`` (one pass, where a hook's path copies, then divides the
    reduced bucket in a second pass) and allreduces the bucket through this group.

    ``size()`` is the number of replica groups contributing to the step (the reducer reads it
    at the first gradient of every backward): it waits for the step's quorum, as the first
    allreduce would. A floating-point allreduce (a gradient bucket) is
    the Manager's SUM, which makes non-participants contribute zeros and never raises; any
    other one (DDP's unused-parameter map) stays local, as with a group of one.
    """

    def __init__(self, manager: Manager) -> None:
        super().__init__(0, 1)
        self._manager = manager

    def size(self) -> int:
        """The replica groups contributing to the step (at least 1). A quorum that failed
        (or none started yet, as at construction) gives 1: the bucket's allreduce then finds
        the failure again and records it, and the step does not commit."""
        try:
            return max(self._manager.num_participants(), 1)
        except Exception:
            return 1

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> Any:
        """A bucket's sum through the Manager; anything else as a group of one (the base
        class has already normalised the tensors and the options)."""
        if op == "allreduce":
            tensors, opts = args
            if (
                len(tensors) == 1
                and (tensors[0].is_floating_point() or tensors[0].is_complex())
                and opts.reduceOp == ReduceOp.SUM
            ):
                return self._manager.allreduce(tensors[0], reduce_op=ReduceOp.SUM)
        return super()._dispatch(op, args)


# DDP validates the hook's annotations by identity, so they must be real objects rather than
# the strings produced by ``from __future__ import annotations``.
_manager_comm_hook.__annotations__ = {
    "state": object,
    "bucket": GradBucket,
    "return": Future[torch.Tensor],
}


class PureDistributedDataParallel(nn.Module):
    """A minimal data-parallel wrapper: one allreduce per parameter, no bucketing.

    Each parameter's gradient is handed to ``manager.allreduce`` as soon as it is
    accumulated; before ``backward()`` returns, all of them are waited for and the averaged
    values are in ``.grad``. Useful for debugging and for models DDP cannot handle.
    """

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        """Wraps ``module``.

        Args:
            manager: the Manager whose ``allreduce`` averages gradients across replicas.
            module: the model.
        """
        super().__init__()
        self.module = module
        self._manager = manager
        self._pending: list[tuple[torch.Tensor, Future[Any]]] = []
        self._callback_queued = False
        # torch leaves Tensor.register_post_accumulate_grad_hook unannotated.
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in module.parameters()
            if p.requires_grad
        ]

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        work = self._manager.allreduce(grad)
        self._pending.append((param, work.get_future()))
        if not self._callback_queued:
            self._callback_queued = True
            # Runs once the whole backward pass is done, still inside backward().
            torch.autograd.Variable._execution_engine.queue_callback(self._wait_all)

    def _wait_all(self) -> None:
        pending, self._pending = self._pending, []
        self._callback_queued = False
        for param, fut in pending:
            averaged = _first_tensor(fut.wait())
            grad = param.grad
            if grad is not None and averaged is not grad:
                grad.copy_(averaged)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module, timed as the step's forward phase (telemetry)."""
        t0 = time.perf_counter()
        try:
            return self.module(*args, **kwargs)
        finally:
            forward_done(t0)
