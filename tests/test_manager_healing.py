"""Manager healing with fakes: receiving a peer's state (sync and async quorum, in place or
not), failed and torn heals, and serving the state to recovering peers."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _manager_kit import (  # noqa: F401 - fixtures, found by pytest by name
    FakeNative,
    FakePG,
    Harness,
    harness_fixture,
    make_quorum,
    master_store_fixture,
    native_fixture,
    store_fixture,
)
from torch.distributed import TCPStore

import torchft.manager as manager_mod


def _heal_quorum(max_step: int = 5) -> SimpleNamespace:
    return make_quorum(
        replica_rank=1,
        replica_world_size=2,
        max_step=max_step,
        max_replica_rank=None,
        max_world_size=1,
        heal=True,
        recover_src_manager_address="http://src:1",
        recover_src_replica_rank=0,
    )


def _serve(h: Harness, step: int, w: torch.Tensor) -> None:
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.transport.shared["src"] = (
        step,
        {"user": {"default": {"w": w}}, "torchft": {"step": step, "batches_committed": 11}},
    )


def test_heal_sync_applies_before_forward(harness: Any) -> None:
    """Sync quorum: healed user state is loaded before start_quorum returns."""
    h = harness(use_async_quorum=False)
    _serve(h, 5, torch.full((3,), 2.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum()
    assert torch.equal(h.user_state["w"], torch.full((3,), 2.0))
    assert m.current_step() == 5
    assert m.batches_committed() == 11
    # sync mode: the healed replica participates with its replica rank
    assert m.participating_rank() == 1
    assert m.num_participants() == 2
    assert m.should_commit()
    assert m.current_step() == 6
    assert h.native.commit_calls == [(0, 5, True)]


def test_heal_async_applies_in_should_commit(harness: Any) -> None:
    """Async quorum: counters apply at once, user state only in should_commit."""
    h = harness()
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert m.current_step() == 5
    assert h.loaded == []  # not yet: the forward pass may still be using the old weights
    assert torch.equal(h.user_state["w"], torch.zeros(3))
    assert m.should_commit()
    assert torch.equal(h.user_state["w"], torch.full((3,), 3.0))
    assert m.current_step() == 6
    assert m.batches_committed() == 11 + 1


def test_heal_of_a_failed_step_is_loaded_before_the_next_forward(harness: Any) -> None:
    """Async quorum: a heal whose step then failed leaves the counters at the healed step; the
    next step loads the healed state in start_quorum, before its forward pass (its gradients
    count: the group is up to date now), and serves that state, not the replaced one."""
    h = harness()
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [
        _heal_quorum(),
        make_quorum(
            replica_rank=1,
            replica_world_size=2,
            max_step=5,
            max_replica_rank=1,
            max_world_size=2,
            recover_dst_replica_ranks=[0],
        ),
    ]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    m.report_error(RuntimeError("a peer died mid-step"))
    assert not m.should_commit()
    assert m.current_step() == 5
    assert torch.equal(h.user_state["w"], torch.zeros(3))  # not loaded: the step failed

    m.start_quorum()
    # Loaded before the quorum answers, so before the forward pass of this step.
    assert torch.equal(h.user_state["w"], torch.full((3,), 3.0))
    m.wait_quorum()
    assert m.participating_rank() == 1
    step, sd = h.transport.shared["rg0"]
    assert step == 5
    assert torch.equal(sd["user"]["default"]["w"], torch.full((3,), 3.0))
    assert m.should_commit()
    assert m.current_step() == 6


def test_the_loop_is_marked_inside_torchft_through_quorum_heal_and_vote(harness: Any) -> None:
    """The hang watch never counts the loop as away while it waits in torchft: the quorum
    (and a heal), and the commit vote are each marked busy, and every mark is undone."""
    h = harness()
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    after_quorum = list(h.native.busy_calls)
    assert after_quorum.count(True) >= 2  # waiting for the quorum, and the heal inside it
    assert m.should_commit()
    calls = h.native.busy_calls
    assert len(calls) > len(after_quorum)  # the vote too
    depth = 0
    for busy in calls:
        depth += 1 if busy else -1
        assert depth >= 0
    assert depth == 0, calls


def test_a_collective_in_flight_is_the_loop_inside_torchft(harness: Any) -> None:
    """An allreduce in flight (the reducer waits for it inside backward, outside any other
    torchft call) marks the loop busy until it completes, with or without an error, so a
    group blocked on a collective is never held hung; the marks balance."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2)]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    before = len(h.native.busy_calls)
    h.pg.future_error = RuntimeError("connection reset")
    assert m.allreduce(torch.ones(2)).get_future().wait() is not None
    # The quorum is adopted already, so the allreduce's own wait for it returns at once
    # without a mark; the collective marks the loop busy until it completes.
    calls = h.native.busy_calls[before:]
    assert calls == [True, False], calls
    h.pg.future_error = None
    m.start_quorum()
    m.wait_quorum()
    before = len(h.native.busy_calls)
    h.pg.raise_on_allreduce = RuntimeError("peer died")
    m.allreduce(torch.ones(2)).get_future().wait()
    assert h.native.busy_calls[before:] == [True, False]
    # A quorum still in flight is waited for inside torchft: its wait is marked too.
    h.pg.raise_on_allreduce = None
    m.start_quorum()
    before = len(h.native.busy_calls)
    m.allreduce(torch.ones(2)).get_future().wait()
    assert h.native.busy_calls[before:] == [True, False, True, False]


def test_heal_disallowed_skips_recv(harness: Any) -> None:
    """allow_heal=False: a behind replica does not heal and does not participate."""
    h = harness(use_async_quorum=False)
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum(allow_heal=False)
    assert h.loaded == []
    assert m.current_step() == 0
    assert not m.is_participating()


def test_heal_failure_blocks_commit(harness: Any) -> None:
    """A heal that fails (wrong step) is recorded and the step does not commit."""
    h = harness()
    _serve(h, 4, torch.full((3,), 3.0))  # source has the wrong step
    h.native.quorums = [_heal_quorum(max_step=5)]
    m = h.manager
    m.start_quorum()
    t = torch.ones(1)
    assert m.allreduce(t).get_future().wait() is t
    assert "wrong step" in str(m.errored())
    assert not m.should_commit()
    assert h.loaded == []


def _failed_in_place_heal(harness: Any, **transport: bool) -> Harness:
    """A sync-quorum group whose heal into its own tensors just failed (the source serves
    the wrong step); ``transport`` sets attributes of the test transport."""
    h = harness(use_async_quorum=False)
    h.transport.receives_in_place = True
    for name, value in transport.items():
        setattr(h.transport, name, value)
    _serve(h, 4, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum(max_step=5)]
    h.manager.start_quorum()
    return h


def test_failed_in_place_heal_is_never_trained_on(harness: Any) -> None:
    """A heal that wrote into the group's own tensors and failed leaves a state no step had:
    the group does not commit on it unless a later heal makes it whole again."""
    h = _failed_in_place_heal(harness)
    m = h.manager
    assert "wrong step" in str(m.errored())
    assert not m.should_commit()
    # A quorum that may not heal (allow_heal=False) does not train on it either.
    h.native.quorums = [make_quorum(max_step=0)]
    m.start_quorum(allow_heal=False)
    assert "partly overwritten" in str(m.errored())
    assert not m.should_commit()
    # A heal that succeeds makes the state whole: the group commits again.
    _serve(h, 5, torch.full((3,), 2.0))
    h.native.quorums = [_heal_quorum(max_step=5)]
    m.start_quorum()
    assert m.errored() is None
    assert m.should_commit()
    assert torch.equal(h.user_state["w"], torch.full((3,), 2.0))


def test_an_in_place_heal_that_wrote_nothing_leaves_the_state_whole(harness: Any) -> None:
    """The transport says the failed receive never reached the local tensors (the source
    died before its header): the state is not torn, so with no source left the group
    trains on from it instead of asking for a restart."""
    h = _failed_in_place_heal(harness, touched_local_state=False)
    m = h.manager
    assert not m.should_commit()
    h.native.quorums = [make_quorum(max_step=0)]
    m.start_quorum()
    assert m.errored() is None
    assert m.should_commit()


def test_torn_state_with_no_source_left_ends_the_process(harness: Any) -> None:
    """Torn by a failed in-place heal, and the next quorum has no group ahead to heal from:
    nothing can make the state whole, so should_commit raises (the supervisor restarts the
    process) instead of failing every step forever."""
    h = _failed_in_place_heal(harness)
    m = h.manager
    assert not m.should_commit()
    h.native.quorums = [make_quorum(max_step=0)]
    m.start_quorum()
    with pytest.raises(manager_mod.TornStateError, match="restart the group"):
        m.should_commit()
    assert m.current_step() == 0


def test_default_transport_heals_in_place_until_the_first_commit(
    store: TCPStore, native: FakeNative
) -> None:
    """The default HTTPTransport receives into the group's own tensors while the process has
    committed nothing (a restart reproduces that state), into new ones after (the state may
    be the best left if the source dies midway)."""
    from torchft import Manager

    w = torch.zeros(3)
    native.quorums = [make_quorum(max_step=0)]
    m = Manager(
        pg=FakePG(),
        load_state_dict=lambda sd: None,
        state_dict=lambda: {"w": w},
        min_replica_size=1,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr="http://lighthouse:1",
        replica_id="rg0",
        native_backend=native,  # type: ignore[arg-type]
    )
    try:
        transport = m._checkpoint_transport
        assert transport.receives_in_place  # type: ignore[attr-defined]
        assert m._healer.receives_in_place()
        into = m._healer.heal_into()
        assert into is not None and into["user"]["default"]["w"] is w
        m.start_quorum()
        assert m.should_commit()
        assert not m._healer.receives_in_place()
        assert m._healer.heal_into() is None
    finally:
        m.shutdown(wait=False)


def test_default_in_place_rule_ends_with_the_first_applied_heal(harness: Any) -> None:
    """A heal applied makes the state one a restart does not reproduce: if its first step
    then fails and the group heals again, that heal must not tear it."""
    h = harness(use_async_quorum=False)
    m = h.manager
    # The rule of the default transport, with the test's transport.
    m._healer.attach(m._checkpoint_transport, own=True)
    assert m._healer.receives_in_place()
    _serve(h, 5, torch.full((3,), 2.0))
    h.native.quorums = [_heal_quorum(max_step=5)]
    m.start_quorum()
    assert m.errored() is None and m.current_step() == 5
    assert not m._healer.receives_in_place()
    assert m._healer.heal_into() is None


def test_in_place_heal_holds_the_state_write_lock(harness: Any) -> None:
    """An async in-place heal writes into the group's tensors on the quorum thread: it holds
    the state's write lock meanwhile, so an optimizer step (disallow_state_dict_read) on
    the training thread waits for it instead of racing it."""
    h = harness()
    h.transport.receives_in_place = True  # type: ignore[attr-defined]
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    lock = m._user.lock
    receiving, release = threading.Event(), threading.Event()
    held: list[bool] = []
    recv = h.transport.recv_checkpoint

    def slow_recv(*args: Any, **kwargs: Any) -> Any:
        held.append(lock.held_by_me())
        receiving.set()
        assert release.wait(10)
        return recv(*args, **kwargs)

    h.transport.recv_checkpoint = slow_recv  # type: ignore[method-assign]
    version = lock.version()
    m.start_quorum()
    # The answer is adopted (and the heal run on the worker thread) by the first wait.
    waiter = threading.Thread(target=m.wait_quorum)
    waiter.start()
    assert receiving.wait(10)
    stepped = threading.Event()

    def optimizer_step() -> None:
        m.disallow_state_dict_read()
        stepped.set()
        m.allow_state_dict_read()

    t = threading.Thread(target=optimizer_step)
    t.start()
    assert not stepped.wait(0.3)  # blocked by the heal
    release.set()
    assert stepped.wait(10)
    t.join(10)
    waiter.join(10)
    assert held == [True]
    assert lock.version() == version + 2  # the heal and the step each count as a write
    assert m.should_commit()


def test_sends_checkpoint_to_recovering_peers(harness: Any) -> None:
    """An up-to-date replica serves its user state and counters for the max step."""
    h = harness()
    h.user_state["w"] = torch.full((3,), 4.0)
    h.native.quorums = [
        make_quorum(replica_world_size=2, max_step=0, recover_dst_replica_ranks=[1])
    ]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert h.transport.sent == [([1], 0)]
    step, sd = h.transport.shared["rg0"]
    assert step == 0
    assert torch.equal(sd["user"]["default"]["w"], torch.full((3,), 4.0))
    assert sd["torchft"] == {"step": 0, "batches_committed": 0}
    assert m.should_commit()
    assert h.transport.disallowed == 1


def test_register_state_dict_fn_multiple_keys(harness: Any) -> None:
    """Several registered keys are served together and each loader gets its own state."""
    h = harness(use_async_quorum=False)
    extra: dict[str, Any] = {}
    h.manager.register_state_dict_fn("sched", lambda sd: extra.update(sd), lambda: {"lr": 0.1})
    with pytest.raises(ValueError, match="already registered"):
        h.manager.register_state_dict_fn("sched", lambda sd: None, lambda: {})
    full = h.manager._manager_state_dict()
    assert set(full["user"]) == {"default", "sched"}
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.transport.shared["src"] = (
        5,
        {
            "user": {"default": {"w": torch.ones(3)}, "sched": {"lr": 0.5}},
            "torchft": {"step": 5, "batches_committed": 5},
        },
    )
    h.native.quorums = [_heal_quorum()]
    h.manager.start_quorum()
    assert extra == {"lr": 0.5}
    assert torch.equal(h.user_state["w"], torch.ones(3))


def test_heal_timeout_is_recorded_not_raised(harness: Any) -> None:
    """A TimeoutError while healing (not the quorum itself) is a step error, not raised."""
    h = harness()
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.native.quorums = [_heal_quorum()]

    def slow_recv(*args: Any, **kwargs: Any) -> Any:
        raise TimeoutError("checkpoint fetch deadline")

    h.transport.recv_checkpoint = slow_recv  # type: ignore[method-assign]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert "checkpoint fetch deadline" in str(m.errored())
    assert not m.should_commit()
