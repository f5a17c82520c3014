"""Wrappers around a process group: error swallowing, fault injection, and the managed group.

* ``ErrorSwallowingProcessGroupWrapper`` records the first error and turns later collectives
  into no-ops, so training code never sees a communication exception.
* ``FakeProcessGroupWrapper`` makes the next collective's future fail (tests).
* ``ManagedProcessGroup`` sends allreduce through a ``Manager`` so torch code that expects a
  group (DeviceMesh, FSDP's replicate dimension) gets the fault-tolerant allreduce.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, Work
from torch.futures import Future

from torchft.process_group.base import (
    ProcessGroup,
    _default_result,
    _weak_callback,
    _work_future,
)
from torchft.process_group.dummy import ProcessGroupDummy
from torchft.process_group.reconfigurable import ProcessGroupWrapper
from torchft.work import _DummyWork, _work_timeout, future_on_error


class AllreduceManager(Protocol):
    """What :class:`ManagedProcessGroup` uses of a ``torchft.Manager``.

    Spelled out here, below the Manager, so this module does not import the module that
    imports it.
    """

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = ...,
        reduce_op: ReduceOp.RedOpType = ...,
    ) -> Work: ...

    def num_participants(self) -> int: ...

    def participating_rank(self) -> int | None: ...


class _ErrorSwallowingWork(dist.Work):
    """A work whose failures are recorded on the wrapper instead of raised."""

    def __init__(
        self, pg: ErrorSwallowingProcessGroupWrapper, work: dist.Work, default: object
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

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        default = _default_result(op, args)
        if self.error() is not None:
            return _DummyWork(default)
        try:
            work = getattr(self._current(), op)(*args)
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            self.report_error(e)
            return _DummyWork(default)
        return _ErrorSwallowingWork(self, work, default)


class _FailingWork(dist.Work):
    """A work that fails with a given error once the underlying work is done."""

    def __init__(self, work: dist.Work, error: Exception) -> None:
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

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        work: dist.Work = getattr(self._current(), op)(*args)
        with self._lock:
            err = self._future_error
            self._future_error = None
        if err is None:
            return work
        return _FailingWork(work, err)


class _ManagedWork(dist.Work):
    """The manager allreduces of one collective: ``wait`` waits for them (they never fail);
    the future, resolving to the collective's tensors as torch's do, is chained only when
    asked for, so a caller that only waits (``dist.all_reduce``) adds no callback of its own
    on the backend's thread."""

    def __init__(self, works: list[Work], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._works = works
        self._tensors = tensors
        self._future: Future[list[torch.Tensor]] | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        timeout = _work_timeout(timeout)
        for work in self._works:
            if timeout is not None:
                work.wait(timeout)
            else:
                work.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> Future[list[torch.Tensor]]:
        if self._future is None:
            tensors = self._tensors
            futures = [w.get_future() for w in self._works]
            if len(futures) == 1:
                self._future = futures[0].then(lambda f: (f.value(), tensors)[1])
            else:
                self._future = torch.futures.collect_all(futures).then(
                    lambda f: ([x.value() for x in f.value()], tensors)[1]
                )
        return self._future


class ManagedProcessGroup(ProcessGroupWrapper):
    """A process group whose allreduce goes through a ``Manager``.

    This lets torch code that expects a group (DeviceMesh, FSDP's replicate dimension) use
    the fault-tolerant allreduce: errors are swallowed by the manager and the world size is
    the number of participating replica groups.
    """

    def __init__(self, manager: AllreduceManager) -> None:
        """Wraps ``manager``.

        Args:
            manager: the Manager whose ``allreduce`` and group are used.
        """
        inner = getattr(manager, "_pg", None)
        super().__init__(pg=inner if isinstance(inner, ProcessGroup) else ProcessGroupDummy(0, 1))
        self._manager = manager

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        """Allreduces each tensor with ``manager.allreduce`` (the future holds the tensors);
        other collectives run on the manager's group."""
        if op != "allreduce":
            return super()._dispatch(op, args)
        tensors, opts = args
        works = [self._manager.allreduce(t, reduce_op=opts.reduceOp) for t in tensors]
        return _ManagedWork(works, tensors)

    def _registration_size(self) -> int:
        # torchtitan registers the group at start-up, before the first quorum: the size is
        # not known yet (it changes every quorum anyway), so torch records a world of one.
        try:
            return self.size()
        except RuntimeError:
            return 1

    def size(self) -> int:
        """Number of replica groups taking part in the current step (waits for the quorum)."""
        return int(self._manager.num_participants())

    def rank(self) -> int:
        """This replica group's participating rank (0 when not participating)."""
        rank = self._manager.participating_rank()
        return int(rank) if rank is not None else 0

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-managed``."""
        return "torchft-managed"
