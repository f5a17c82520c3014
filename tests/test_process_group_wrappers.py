"""The process group wrappers: errors swallowed and recorded for every collective, the
fake that fails on demand, and ManagedProcessGroup routing through the Manager."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _process_group_kit import (  # noqa: F401 - the fixture, found by pytest by name
    _addr,
    _run_ranks,
    store_fixture,
)
from torch.distributed import ReduceOp, TCPStore

from torchft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
)
from torchft.work import _DummyWork


class _BrokenProcessGroup(ProcessGroupDummy):
    """Every collective raises synchronously; counts the calls."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.calls = 0

    def __getattribute__(self, name: str) -> Any:
        if name in _ALL_COLLECTIVES:

            def fail(*args: Any, **kwargs: Any) -> Any:
                object.__setattr__(self, "calls", object.__getattribute__(self, "calls") + 1)
                raise RuntimeError(f"{name} broke")

            return fail
        return object.__getattribute__(self, name)


_ALL_COLLECTIVES = [
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_into_tensor_coalesced",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "alltoall_base",
    "barrier",
    "send",
    "recv",
]


def _call(pg: ProcessGroup, name: str) -> Any:
    """Calls collective ``name`` on ``pg`` with valid world-size-1 arguments."""
    t = torch.ones(2)
    if name in ("allreduce", "allreduce_coalesced"):
        return getattr(pg, name)([t])
    if name == "allgather":
        return pg.allgather([[torch.zeros(2)]], [t])
    if name == "allgather_into_tensor_coalesced":
        return pg.allgather_into_tensor_coalesced([torch.zeros(2)], [t])
    if name == "broadcast":
        return pg.broadcast([t])
    if name == "reduce_scatter":
        return pg.reduce_scatter([torch.zeros(2)], [[t]])
    if name == "reduce_scatter_tensor_coalesced":
        return pg.reduce_scatter_tensor_coalesced([torch.zeros(2)], [t])
    if name == "alltoall_base":
        return pg.alltoall_base(torch.zeros(2), t, [2], [2])
    if name == "barrier":
        return pg.barrier()
    if name == "send":
        return pg.send([t], 0, 0)
    if name == "recv":
        return pg.recv([t], 0, 0)
    raise AssertionError(name)


@pytest.mark.parametrize("name", _ALL_COLLECTIVES)
def test_error_swallowing_sync_errors_every_collective(name: str) -> None:
    """A collective that raises is recorded, returns completed work, and later ones are
    no-ops that never reach the broken group."""
    inner = _BrokenProcessGroup()
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    work = _call(pg, name)
    assert work.wait() is True
    work.get_future().wait()
    err = pg.error()
    assert isinstance(err, RuntimeError) and f"{name} broke" in str(err)
    assert pg.errored() is err
    assert inner.calls == 1
    for other in _ALL_COLLECTIVES:
        _call(pg, other).wait()
    assert inner.calls == 1
    pg.configure("127.0.0.1:1/x", "r", 0, 1)
    assert pg.error() is None


@pytest.mark.parametrize("name", _ALL_COLLECTIVES)
def test_error_swallowing_future_errors_every_collective(name: str) -> None:
    """A collective whose future fails resolves to its default instead, and the error is
    recorded; the next collective is skipped."""
    fake = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg = ErrorSwallowingProcessGroupWrapper(fake)
    fake.report_future_error(RuntimeError("injected"))
    work = _call(pg, name)
    fut = work.get_future()
    fut.wait()  # does not raise
    assert str(pg.error()) == "injected"
    assert isinstance(_call(pg, "allreduce"), _DummyWork)


def test_error_swallowing_wait_records_error() -> None:
    """wait() on a failing work returns True and records the error."""
    fake = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg = ErrorSwallowingProcessGroupWrapper(fake)
    fake.report_future_error(RuntimeError("on wait"))
    assert pg.allreduce([torch.ones(1)]).wait() is True
    assert str(pg.error()) == "on wait"


def test_error_swallowing_with_real_gloo_timeout(store: TCPStore) -> None:
    """A real Gloo timeout under the swallowing wrapper is recorded, never raised."""
    inner = [ProcessGroupGloo(timeout=timedelta(seconds=2)) for _ in range(2)]
    pgs = [ErrorSwallowingProcessGroupWrapper(p) for p in inner]
    _run_ranks(2, lambda r: pgs[r].configure(_addr(store, "sw"), "r", r, 2))
    t = torch.ones(1)
    fut = pgs[0].allreduce([t], ReduceOp.SUM).get_future()
    assert fut.wait() == [t]
    assert pgs[0].error() is not None
    for p in pgs:
        p.shutdown()


def test_fake_wrapper_fails_only_the_next_future() -> None:
    """report_future_error affects exactly one collective."""
    pg = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg.report_future_error(ValueError("boom"))
    fut = pg.allreduce([torch.ones(1)]).get_future()
    with pytest.raises(ValueError, match="boom"):
        fut.wait()
    t = torch.ones(1)
    assert pg.allreduce([t]).get_future().wait() == [t]
    assert pg.size() == 1 and pg.getBackendName() == "torchft-dummy"


class _FakeManager:
    """Averages over a fixed number of participants, like Manager.allreduce with AVG."""

    def __init__(self, participants: int) -> None:
        self.participants = participants
        self.ops: list[Any] = []
        self._pg = ProcessGroupDummy(0, 1)

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> Any:
        self.ops.append(reduce_op)
        # Pretend every participant contributed the same tensor.
        if reduce_op == ReduceOp.SUM:
            tensor.mul_(self.participants)
        return _DummyWork(tensor)

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return 1


def test_managed_process_group_routes_through_manager() -> None:
    """allreduce goes through manager.allreduce with the requested op; size is the number
    of participants."""
    manager = _FakeManager(3)
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    a, b = torch.ones(2), torch.ones(1)
    assert pg.allreduce([a, b], ReduceOp.SUM).get_future().wait() == [a, b]
    assert a.tolist() == [3.0, 3.0] and b.item() == 3.0
    assert manager.ops == [ReduceOp.SUM, ReduceOp.SUM]
    assert (pg.size(), pg.getSize(), pg.rank()) == (3, 3, 1)
    assert pg.getBackendName() == "torchft-managed"


class _NoQuorumYetManager(_FakeManager):
    """A manager before its first quorum: asking for the participants raises, as Manager does."""

    def num_participants(self) -> int:
        raise RuntimeError("wait_quorum() called before start_quorum()")


def test_managed_process_group_registers_before_the_first_quorum() -> None:
    """torchtitan registers ManagedProcessGroup as "dp_replicate" at start-up, before any
    quorum: registration works (a world of one) and the name resolves to the group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = ManagedProcessGroup(_NoQuorumYetManager(2))  # type: ignore[arg-type]
    pg.register("torchft_test_dp_replicate")
    try:
        assert _resolve_process_group("torchft_test_dp_replicate") is pg
        assert dist.get_process_group_ranks(pg) == [0]
    finally:
        pg.unregister()


def test_managed_process_group_work_waits_without_a_future_of_its_own() -> None:
    """A managed allreduce's wait() waits on the manager's works; its torch-style future
    (resolving to the tensors) is made once, when asked for."""
    manager = _FakeManager(2)
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    a = torch.ones(3)
    work = pg.allreduce([a], ReduceOp.SUM)
    assert work.wait() is True
    assert work.is_completed()
    assert a.tolist() == [2.0, 2.0, 2.0]
    fut = work.get_future()
    assert fut is work.get_future()
    assert fut.wait() == [a]
    assert work.wait(timedelta(seconds=5)) is True


class _CountingWork(_DummyWork):
    """A complete work that counts the futures asked of it."""

    asked = 0

    def get_future(self) -> Any:
        type(self).asked += 1
        return super().get_future()


class _CountingManager(_FakeManager):
    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> Any:
        super().allreduce(tensor, should_quantize, reduce_op)
        return _CountingWork(tensor)


def test_managed_allreduce_that_is_only_waited_for_chains_nothing() -> None:
    """wait() alone asks no future of the manager's works (nothing is chained on the
    backend's thread); the torch-style future is chained once, on the first ask."""
    _CountingWork.asked = 0
    pg = ManagedProcessGroup(_CountingManager(2))  # type: ignore[arg-type]
    a, b = torch.ones(2), torch.ones(1)
    work = pg.allreduce([a, b], ReduceOp.SUM)
    assert work.wait() is True
    assert _CountingWork.asked == 0
    assert work.get_future().wait() == [a, b]
    work.get_future()
    assert _CountingWork.asked == 2  # one per tensor, once
