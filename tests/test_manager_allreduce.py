"""Manager.allreduce with fakes: averaging over the participants, errors recorded instead
of raised, and who participates in each world size mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _manager_kit import (  # noqa: F401 - fixtures, found by pytest by name
    harness_fixture,
    make_quorum,
    master_store_fixture,
    native_fixture,
    store_fixture,
)
from torch.distributed import ReduceOp

from torchft.ddp import DistributedDataParallel
from torchft.manager import ExceptionWithTraceback, WorldSizeMode


def test_allreduce_avg_divides_by_participants(harness: Any) -> None:
    """AVG = SUM over the PG then divide by the number of participants."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=4, max_world_size=4)]
    h.pg.sum_factor = 4.0  # four identical contributions
    m = h.manager
    m.start_quorum()
    t = torch.tensor([1.0, 2.0, 3.0])
    work = m.allreduce(t)
    out = work.get_future().wait()
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))
    assert out is t
    assert h.pg.allreduces == [ReduceOp.SUM]
    assert m.should_commit()


def test_allreduce_sum_passes_through(harness: Any) -> None:
    """A SUM allreduce is not divided."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2)]
    h.pg.sum_factor = 2.0
    m = h.manager
    m.start_quorum()
    t = torch.ones(2)
    m.allreduce(t, reduce_op=ReduceOp.SUM).wait()
    assert torch.equal(t, torch.full((2,), 2.0))


def test_allreduce_quantize_falls_back(harness: Any) -> None:
    """should_quantize=True still returns a correctly averaged tensor."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2)]
    h.pg.sum_factor = 2.0
    m = h.manager
    m.start_quorum()
    t = torch.full((4,), 3.0)
    assert torch.equal(m.allreduce(t, should_quantize=True).get_future().wait(), t)
    assert torch.equal(t, torch.full((4,), 3.0))


def test_allreduce_error_is_swallowed_and_later_collectives_noop(harness: Any) -> None:
    """A raising allreduce is recorded; the work resolves to the tensor; later ones are no-ops."""
    h = harness()
    m = h.manager
    m.start_quorum()
    h.pg.raise_on_allreduce = RuntimeError("peer died")
    t = torch.ones(2)
    assert m.allreduce(t).get_future().wait() is t
    err = m.errored()
    assert isinstance(err, ExceptionWithTraceback)
    assert "peer died" in str(err.original_exception)
    assert "peer died" in err.stack_trace
    h.pg.raise_on_allreduce = None
    t2 = torch.ones(2)
    assert m.allreduce(t2).get_future().wait() is t2
    assert len(h.pg.allreduces) == 1  # the second call never reached the PG
    assert not m.should_commit()
    assert h.native.commit_calls == [(0, 0, False)]
    # the next step starts clean
    m.start_quorum()
    assert m.errored() is None
    assert m.should_commit()


def test_allreduce_future_error_is_recorded(harness: Any) -> None:
    """An error delivered through the collective's future is recorded, not raised."""
    h = harness()
    m = h.manager
    m.start_quorum()
    h.pg.future_error = RuntimeError("connection reset")
    t = torch.ones(2)
    fut = m.allreduce(t).get_future()
    assert fut.wait() is t
    assert m.errored() is not None
    assert not m.should_commit()


def test_pg_errored_blocks_commit(harness: Any) -> None:
    """An error reported by the process group itself makes the vote no."""
    h = harness()
    m = h.manager
    m.start_quorum()
    h.pg.pg_error = RuntimeError("aborted")
    assert not m.should_commit()


def _behind(h: Any, user_state: dict[str, Any]) -> Any:
    """Gives harness ``h`` a quorum in which its group is behind (step 5 at replica 0) and
    heals from ``user_state`` in the background: it sits out the step."""
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.transport.shared["src"] = (
        5,
        {"user": user_state, "torchft": {"step": 5, "batches_committed": 9}},
    )
    h.native.quorums = [
        make_quorum(
            replica_rank=1,
            replica_world_size=2,
            max_step=5,
            max_replica_rank=None,
            max_world_size=1,
            heal=True,
            recover_src_manager_address="http://src:1",
            recover_src_replica_rank=0,
        )
    ]
    return h


def test_non_participant_sends_zeros_async(harness: Any) -> None:
    """With async quorum a healing (behind) replica group sits out and contributes zeros."""
    h = _behind(harness(), {"default": {"w": torch.ones(3)}})
    m = h.manager
    m.start_quorum()
    assert not m.is_participating()
    assert m.num_participants() == 1
    t = torch.full((3,), 7.0)
    m.allreduce(t).wait()
    assert torch.equal(t, torch.zeros(3))


def test_fixed_with_spares_caps_participants(harness: Any) -> None:
    """FIXED_WITH_SPARES: ranks >= min_replica_size are spares sending zeros."""
    h = harness(min_replica_size=2, world_size_mode=WorldSizeMode.FIXED_WITH_SPARES)
    h.native.quorums = [
        make_quorum(replica_rank=2, replica_world_size=3, max_replica_rank=2, max_world_size=3)
    ]
    m = h.manager
    m.start_quorum()
    assert m.num_participants() == 2
    assert not m.is_participating()
    t = torch.ones(2)
    m.allreduce(t).wait()
    assert torch.equal(t, torch.zeros(2))
    assert m.should_commit()
    assert m.batches_committed() == 2


def test_fixed_with_spares_member_participates(harness: Any) -> None:
    """FIXED_WITH_SPARES: a rank below min_replica_size contributes normally."""
    h = harness(min_replica_size=2, world_size_mode=WorldSizeMode.FIXED_WITH_SPARES)
    h.native.quorums = [
        make_quorum(replica_rank=1, replica_world_size=3, max_replica_rank=1, max_world_size=3)
    ]
    h.pg.sum_factor = 2.0
    m = h.manager
    m.start_quorum()
    assert m.participating_rank() == 1
    t = torch.ones(2)
    m.allreduce(t).wait()
    assert torch.equal(t, torch.ones(2))


def test_dynamic_mode_uses_all_at_max_step(harness: Any) -> None:
    """DYNAMIC: every replica group at the max step participates."""
    h = harness(min_replica_size=2)
    h.native.quorums = [
        make_quorum(replica_rank=2, replica_world_size=3, max_replica_rank=2, max_world_size=3)
    ]
    m = h.manager
    m.start_quorum()
    assert m.num_participants() == 3
    assert m.participating_rank() == 2


def _ddp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _local_grads(x: torch.Tensor) -> list[torch.Tensor]:
    model = _ddp_model()
    model(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_ddp_with_a_manager_averages_in_the_reducer_as_the_quorum_changes(harness: Any) -> None:
    """With a Manager, torch's reducer writes each gradient into its bucket already divided by
    the step's participant count (read from the step's quorum, which changes from 2 to 4
    groups here) and the bucket goes through the Manager as a SUM: no hook, no second pass.
    Every peer sending the same gradients, the result is this group's own gradients."""
    h = harness()
    h.native.quorums = [
        make_quorum(replica_world_size=2, max_world_size=2, quorum_id=1),
        make_quorum(replica_world_size=4, max_world_size=4, quorum_id=2),
    ]
    model = _ddp_model()
    ddp = DistributedDataParallel(h.manager, model, bucket_cap_mb=0.0001)
    x = torch.randn(5, 8)
    want = _local_grads(x)
    for participants in (2, 4):
        h.pg.sum_factor = float(participants)  # every peer sent this group's gradients
        h.manager.start_quorum()
        before = len(h.pg.allreduces)
        model.zero_grad()
        ddp(x).pow(2).sum().backward()
        assert ddp.process_group.size() == participants
        ops = [_allreduce_op(o) for o in h.pg.allreduces[before:]]
        assert len(ops) >= 2 and set(ops) == {ReduceOp.SUM}  # several buckets, never AVG
        for p, w in zip(model.parameters(), want, strict=True):
            torch.testing.assert_close(p.grad, w)
        assert h.manager.should_commit()


def test_ddp_with_a_manager_sends_zeros_from_a_group_that_sits_out(harness: Any) -> None:
    """A healing group's scaled gradients are replaced by zeros before the sum: with the peer
    sending zeros too, its gradients after backward are zero."""
    h = _behind(harness(), {})
    model = _ddp_model()
    ddp = DistributedDataParallel(h.manager, model)
    h.manager.start_quorum()
    ddp(torch.randn(5, 8)).pow(2).sum().backward()
    assert not h.manager.is_participating()
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_ddp_with_a_manager_refuses_another_comm_hook_and_join(harness: Any) -> None:
    """The gradients' communication is the Manager's: a user's hook, a built-in one and
    DDP's join (its collectives would run through the Manager outside any step) are refused,
    by name, before anything runs."""
    h = harness()
    ddp = DistributedDataParallel(h.manager, _ddp_model())
    with pytest.raises(RuntimeError, match="through the Manager"):
        ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    with pytest.raises(RuntimeError, match="through the Manager"):
        ddp._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(RuntimeError, match="does not support join"):
        ddp.join()
    from torch.distributed.algorithms.join import Join

    with pytest.raises(RuntimeError, match="does not support join"):
        Join([ddp])
    assert h.pg.allreduces == []


def test_ddp_with_a_manager_after_an_error_neither_raises_nor_commits(harness: Any) -> None:
    """A step that errored before backward: the reducer's collectives are skipped, backward
    returns, and the vote is no."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2)]
    model = _ddp_model()
    ddp = DistributedDataParallel(h.manager, model)
    h.manager.start_quorum()
    h.manager.report_error(RuntimeError("injected"))
    ddp(torch.randn(5, 8)).pow(2).sum().backward()
    assert h.pg.allreduces == []
    assert all(p.grad is not None for p in model.parameters())
    assert not h.manager.should_commit()


class _Branchy(torch.nn.Module):
    """Two heads; ``use_b=False`` leaves the second unused (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the same weights every time; the inputs' RNG goes on
            torch.manual_seed(0)
            self.body = torch.nn.Linear(8, 16)
            self.a = torch.nn.Linear(16, 4)
            self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = self.body(x).relu()
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _record_reduce_ops(manager: Any) -> list[Any]:
    """The reduce op of every ``manager.allreduce`` from now on."""
    ops: list[Any] = []
    allreduce = manager.allreduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ops.append(kwargs.get("reduce_op", args[1] if len(args) > 1 else ReduceOp.AVG))
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = recording
    return ops


def _own_grads(batches: list[tuple[torch.Tensor, bool]]) -> list[torch.Tensor | None]:
    """This group's gradients of ``batches`` accumulated, without DDP."""
    model = _Branchy()
    for x, use_b in batches:
        model(x, use_b).pow(2).sum().backward()
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gradient_as_bucket_view": True},
        {"static_graph": True},
        {"find_unused_parameters": True},
    ],
    ids=["bucket_view", "static_graph", "unused_params"],
)
def test_ddp_with_a_manager_averages_under_ddp_options(harness: Any, kwargs: Any) -> None:
    """DDP's own options keep the reducer's averaging right through the Manager, over three
    steps (static_graph's first differs from the rest), with several buckets; with
    find_unused_parameters the second head is unused on the middle step (its gradient stays
    zero). Every peer sending the same gradients, each step's result is this group's own, and
    every bucket goes through the Manager as a SUM (the reducer divides)."""
    h = harness()
    h.native.quorums = [
        make_quorum(replica_world_size=2, max_world_size=2, quorum_id=1, max_step=step)
        for step in range(3)
    ]
    h.pg.sum_factor = 2.0
    model = _Branchy()
    ddp = DistributedDataParallel(h.manager, model, bucket_cap_mb=0.0001, **kwargs)
    ops = _record_reduce_ops(h.manager)
    unused = "find_unused_parameters" in kwargs
    inputs = [torch.randn(5, 8) for _ in range(3)]
    assert not torch.equal(inputs[0], inputs[1])
    for step, x in enumerate(inputs):
        use_b = not (unused and step == 1)
        h.manager.start_quorum()
        before = len(h.pg.allreduces)
        model.zero_grad(set_to_none=False)
        ddp(x, use_b).pow(2).sum().backward()
        assert len(h.pg.allreduces) > before + 1, "the buckets went through the Manager"
        assert ops and set(ops) == {ReduceOp.SUM}, "the reducer divides; the Manager sums"
        want = _own_grads([(x, use_b)])
        for p, w in zip(model.parameters(), want, strict=True):
            torch.testing.assert_close(p.grad, torch.zeros_like(p) if w is None else w)
        assert h.manager.should_commit()
        assert h.manager.current_step() == step + 1


def test_ddp_with_a_manager_no_sync_accumulates_then_averages_once(harness: Any) -> None:
    """Inside ``no_sync`` nothing goes through the Manager and the gradients accumulate; the
    next backward averages the accumulated gradients once."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2, quorum_id=1)]
    h.pg.sum_factor = 2.0
    model = _Branchy()
    ddp = DistributedDataParallel(h.manager, model)
    ops = _record_reduce_ops(h.manager)
    x1, x2 = torch.randn(5, 8), torch.randn(5, 8)
    h.manager.start_quorum()
    model.zero_grad()
    with ddp.no_sync():
        ddp(x1).pow(2).sum().backward()
    assert h.pg.allreduces == []
    ddp(x2).pow(2).sum().backward()
    assert h.pg.allreduces, "the synced backward went through the Manager"
    assert set(ops) == {ReduceOp.SUM}
    for p, w in zip(model.parameters(), _own_grads([(x1, True), (x2, True)]), strict=True):
        torch.testing.assert_close(p.grad, w)
    assert h.manager.should_commit()


def _allreduce_op(opts: Any) -> Any:
    return opts.reduceOp if hasattr(opts, "reduceOp") else opts
