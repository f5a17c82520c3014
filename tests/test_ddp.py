"""Tests of DistributedDataParallel and PureDistributedDataParallel with fake managers."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import ReduceOp, TCPStore

from torchft.ddp import DistributedDataParallel, PureDistributedDataParallel
from torchft.process_group import ProcessGroupBabyGloo, ProcessGroupGloo
from torchft.work import _DummyWork, _FutureWork


class _ScalingManager:
    """Pretends the other replicas sent ``peer_grads``: AVG of (own, peers...)."""

    def __init__(self, num_participants: int, list_result: bool = False) -> None:
        self.num_participants = num_participants
        self.list_result = list_result
        self.calls = 0
        self.sizes: list[int] = []

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> Any:
        self.calls += 1
        self.sizes.append(tensor.numel())
        # Every peer contributed zeros: the average is tensor / participants.
        tensor.div_(self.num_participants)
        return _DummyWork([tensor] if self.list_result else tensor)


class _GlooManager:
    """A manager whose allreduce is a real Gloo SUM followed by a division (AVG)."""

    def __init__(self, pg: ProcessGroupGloo | ProcessGroupBabyGloo) -> None:
        self.pg = pg
        self.calls = 0

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> Any:
        self.calls += 1
        world = self.pg.size()
        fut = self.pg.allreduce([tensor], ReduceOp.SUM).get_future()
        return _FutureWork(fut.then(lambda _: tensor.div_(world)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.fixture
def store() -> Iterator[TCPStore]:
    """A TCPStore server on an ephemeral port."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


@pytest.mark.parametrize("list_result", [False, True])
def test_ddp_routes_buckets_through_manager(list_result: bool) -> None:
    """Each bucket goes through manager.allreduce and the averaged value ends in .grad."""
    manager = _ScalingManager(num_participants=4, list_result=list_result)
    model = _model()
    reference = copy.deepcopy(model)
    # A tiny bucket cap forces several buckets.
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=0.0001)  # type: ignore[arg-type]
    x = torch.randn(5, 8)
    ddp(x).pow(2).sum().backward()
    expected = _grads(reference, x)
    assert manager.calls >= 1
    assert sum(manager.sizes) == sum(p.numel() for p in model.parameters())
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g / 4)


def test_ddp_rejects_fixed_kwargs() -> None:
    """process_group / broadcast_buffers / init_sync are owned by torchft."""
    with pytest.raises(ValueError, match="process_group"):
        DistributedDataParallel(_ScalingManager(1), _model(), process_group=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="broadcast_buffers"):
        DistributedDataParallel(_ScalingManager(1), _model(), broadcast_buffers=True)  # type: ignore[arg-type]


def test_ddp_does_not_sync_buffers_at_construction() -> None:
    """Buffers stay local at construction (state sync is the manager's job)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(3.0)
    ddp = DistributedDataParallel(_ScalingManager(2), model)  # type: ignore[arg-type]
    assert torch.equal(ddp.module[1].running_mean, torch.full((4,), 3.0))


def _run_ranks(world: int, fn: Any) -> list[Any]:
    with ThreadPoolExecutor(max_workers=world) as pool:
        futures = [pool.submit(fn, rank) for rank in range(world)]
        return [f.result(timeout=90) for f in futures]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("wrapper", "group"), [("ddp", "gloo"), ("pure", "gloo"), ("ddp", "baby"), ("pure", "baby")]
)
def test_gradients_are_averaged_over_real_gloo(store: TCPStore, wrapper: str, group: str) -> None:
    """Two replicas with different data end with identical grads equal to the mean of their
    local grads, and identical parameters after an optimizer step, over two steps; with the
    group in this process and in a child process."""
    world = 2
    inputs = [[torch.randn(6, 8) for _ in range(world)] for _ in range(2)]
    cls = ProcessGroupGloo if group == "gloo" else ProcessGroupBabyGloo
    pgs = [cls(timeout=timedelta(seconds=60)) for _ in range(world)]
    # Built up front: seeding the global RNG from two threads would race.
    models = [_model() for _ in range(world)]

    def run(rank: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], int]:
        pg = pgs[rank]
        pg.configure(f"127.0.0.1:{store.port}/{group}_{wrapper}", f"replica_{rank}", rank, world)
        manager = _GlooManager(pg)
        model = models[rank]
        if wrapper == "ddp":
            wrapped: nn.Module = DistributedDataParallel(manager, model, bucket_cap_mb=0.0001)  # type: ignore[arg-type]
        else:
            wrapped = PureDistributedDataParallel(manager, model)  # type: ignore[arg-type]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step_grads = []
        for step in range(2):
            opt.zero_grad()
            wrapped(inputs[step][rank]).pow(2).sum().backward()
            step_grads.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
            opt.step()
        return step_grads, [p.detach().clone() for p in model.parameters()], manager.calls

    results = _run_ranks(world, run)

    # Reference: plain training on the mean gradient.
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        per_rank = [_grads(reference, inputs[step][r]) for r in range(world)]
        mean = [sum(gs) / world for gs in zip(*per_rank, strict=True)]
        for rank in range(world):
            for got, want in zip(results[rank][0][step], mean, strict=True):
                torch.testing.assert_close(got, want)
        for p, g in zip(reference.parameters(), mean, strict=True):
            p.grad = g
        ref_opt.step()
    for rank in range(world):
        for got, want in zip(results[rank][1], reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach())
        assert results[rank][2] >= 2
    # Replicas are bit-identical to each other.
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)
    for pg in pgs:
        pg.shutdown()


def test_pure_ddp_waits_for_every_allreduce_before_backward_returns() -> None:
    """Gradients are averaged as soon as backward() returns, one allreduce per parameter,
    also on a second backward pass."""

    class _SlowManager(_ScalingManager):
        def allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            self.pending.append((tensor, fut))
            return _FutureWork(fut)

    manager = _SlowManager(num_participants=2)
    manager.pending = []  # type: ignore[attr-defined]
    model = _model()
    reference = copy.deepcopy(model)
    pure = PureDistributedDataParallel(manager, model)  # type: ignore[arg-type]

    import threading

    stop = threading.Event()

    def complete() -> None:
        while not stop.is_set():
            while manager.pending:  # type: ignore[attr-defined]
                t, fut = manager.pending.pop(0)  # type: ignore[attr-defined]
                fut.set_result(t.div(2))  # a new tensor: must be copied into .grad
            stop.wait(0.01)

    helper = threading.Thread(target=complete, daemon=True)
    helper.start()
    try:
        for _ in range(2):
            x = torch.randn(3, 8)
            model.zero_grad()
            pure(x).pow(2).sum().backward()
            expected = _grads(reference, x)
            for p, g in zip(model.parameters(), expected, strict=True):
                torch.testing.assert_close(p.grad, g / 2)
    finally:
        stop.set()
        helper.join(timeout=5)
    assert manager.calls == 2 * len(list(model.parameters()))


def test_bucket_layout_is_fixed_from_construction() -> None:
    """A fresh replica reduces with the same bucket layout as one that already trained, so a
    late joiner's buckets line up with its peers' (torch would otherwise re-bucket after the
    first backward)."""

    def layout(steps: int) -> list[int]:
        manager = _ScalingManager(num_participants=1)
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4))
        ddp = DistributedDataParallel(manager, model, bucket_cap_mb=0.01)  # type: ignore[arg-type]
        for _ in range(steps):
            manager.sizes.clear()
            model.zero_grad()
            ddp(torch.randn(2, 8)).sum().backward()
        return list(manager.sizes)

    fresh = layout(1)
    trained = layout(3)
    assert len(fresh) >= 2
    assert fresh == trained
