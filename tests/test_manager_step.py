"""Manager step protocol with fakes: quorum, commit vote, members lost mid-step, retries,
and the structured records of each step."""

from __future__ import annotations

import logging
import threading
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


def test_happy_path_commits_and_advances(harness: Any) -> None:
    """A clean step commits, advances the step and counts the participants' batches."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=3, max_world_size=3)]
    m = h.manager
    m.start_quorum()
    assert m.num_participants() == 3
    assert m.is_participating()
    assert m.participating_rank() == 0
    assert m.should_commit()
    assert m.current_step() == 1
    assert m.batches_committed() == 3
    assert h.native.commit_calls == [(0, 0, True)]
    assert h.transport.disallowed == 1
    # the quorum request carries the step, the transport metadata and init_sync
    call = h.native.quorum_calls[0]
    assert call["step"] == 0 and call["checkpoint_metadata"] == "rg0" and call["init_sync"]
    assert call["group_rank"] == 0 and call["commit_failures"] == 0


def test_configure_only_on_new_quorum_id(harness: Any) -> None:
    """The process group is rebuilt on a fresh store prefix only when quorum_id changes."""
    h = harness()
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_rank=1, replica_world_size=2, max_replica_rank=1),
        make_quorum(quorum_id=7, replica_rank=1, replica_world_size=2, max_replica_rank=1),
        make_quorum(quorum_id=9, replica_rank=0, replica_world_size=1),
    ]
    m = h.manager
    for _ in range(3):
        m.start_quorum()
        assert m.should_commit()
    assert [c[0] for c in h.pg.configures] == [
        "storehost:1234/torchft/7/0",
        "storehost:1234/torchft/9/0",
    ]
    assert [(c[2], c[3]) for c in h.pg.configures] == [(1, 2), (0, 1)]
    assert h.pg.configures[0][1].startswith("rg0:")  # fresh replica id with uuid suffix


def test_vote_aborts_the_group_only_after_skipping_a_collective(harness: Any) -> None:
    """A rank that turned a collective into a no-op (its step had errored) aborts the
    quorum's group at its vote, after its own collectives finished, so peers waiting on the
    skipped one fail at once; the same quorum id is then rebuilt. An error recorded after
    every collective ran aborts nothing (the peers' step is not cut short), nor does a clean
    step."""
    h = harness()
    h.native.quorums = [make_quorum(quorum_id=7, replica_world_size=2)] * 4
    m = h.manager
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert h.pg.aborts == 0

    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    m.report_error(RuntimeError("late local failure"))
    assert not m.should_commit()
    assert h.pg.aborts == 0

    h.pg.future_error = RuntimeError("peer reset")
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    h.pg.future_error = None
    calls = len(h.pg.allreduces)
    m.allreduce(torch.ones(2)).wait()  # a no-op: the step errored
    assert len(h.pg.allreduces) == calls
    assert not m.should_commit()
    assert h.pg.aborts == 1
    assert len(h.pg.configures) == 1

    # Same quorum id: the aborted group is rebuilt all the same, and the step commits.
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert h.pg.aborts == 1
    assert len(h.pg.configures) == 2


def test_quorum_answered_before_a_members_loss_is_not_rebuilt(harness: Any) -> None:
    """A quorum answer that still lists a member already declared lost (issued just before it
    died) fails the step at once instead of rendezvousing with the dead member."""
    h = harness()
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_ids=["rg0", "dead"], **two),
        make_quorum(quorum_id=7, replica_ids=["rg0", "dead"], **two),
        make_quorum(quorum_id=9, replica_ids=["rg0"]),
    ]
    m = h.manager
    m.start_quorum()
    assert m.should_commit()
    m._on_lost("dead", 7)  # the lighthouse's event, between two steps
    m.start_quorum()
    assert not m.should_commit()
    assert "dead" in str(m.errored())
    m.start_quorum()
    assert m.should_commit()
    assert [c[0] for c in h.pg.configures] == [
        "storehost:1234/torchft/7/0",
        "storehost:1234/torchft/9/0",
    ]


def test_loss_after_the_steps_collectives_completed_still_commits(harness: Any) -> None:
    """A member lost once the step's collectives have completed (it finished, or died after
    its own vote) does not cost this group the step: the collectives hold every member's
    data and the lost group may have committed it, so abandoning the step would leave two
    states under one step number. The group is still aborted and rebuilt."""
    h = harness()
    h.pg.strict_abort = True
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_ids=["rg0", "gone"], **two),
        make_quorum(quorum_id=9, replica_ids=["rg0"]),
    ]
    m = h.manager
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    m._on_lost("gone", 7)
    assert h.pg.aborts == 1
    assert m.should_commit()
    assert m.current_step() == 1
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert [c[0] for c in h.pg.configures] == [
        "storehost:1234/torchft/7/0",
        "storehost:1234/torchft/9/0",
    ]


def test_loss_while_a_completed_collectives_callback_waits_still_commits(harness: Any) -> None:
    """The backend completed the step's collective (every member's data is in), but its
    callback has not run yet (on a loaded machine it waits for the GIL) when the lighthouse
    reports a member lost: the member may have finished and committed the step, so the step
    still commits here too."""
    h = harness()
    h.pg.strict_abort = True
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [make_quorum(quorum_id=7, replica_ids=["rg0", "gone"], **two)]
    m = h.manager
    m.start_quorum()
    h.pg.hold = True
    work = m.allreduce(torch.ones(2))
    (backend,) = h.pg.held
    h.pg.held = []  # completed below by the backend, not failed by the abort
    in_callback, release = threading.Event(), threading.Event()
    server = m._manager
    assert server is not None
    busy = server.set_loop_busy

    def slow_callback(flag: bool) -> None:
        if not flag:  # the collective's callback, first thing it does
            in_callback.set()
            release.wait(10)
        busy(flag)

    server.set_loop_busy = slow_callback
    completer = threading.Thread(target=backend.set_result, args=([torch.ones(2)],))
    completer.start()
    assert in_callback.wait(10)
    m._on_lost("gone", 7)
    release.set()
    completer.join(10)
    work.wait()
    assert h.pg.aborts == 1
    assert m.should_commit(), m.errored()
    assert m.current_step() == 1


def test_loss_with_a_collective_in_flight_fails_the_step(harness: Any) -> None:
    """A member lost while a collective of the step is in flight (or one the step issues
    after the loss) fails the step at once; the next quorum rebuilds the group."""
    h = harness()
    h.pg.strict_abort = True
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_ids=["rg0", "gone"], **two),
        make_quorum(quorum_id=9, replica_ids=["rg0", "late"], **two),
        make_quorum(quorum_id=11, replica_ids=["rg0"]),
    ]
    m = h.manager
    m.start_quorum()
    h.pg.hold = True
    work = m.allreduce(torch.ones(2))
    m._on_lost("gone", 7)
    work.wait()
    assert not m.should_commit()
    assert "gone" in str(m.errored())
    assert m.current_step() == 0

    # A loss between two collectives of a step: the later one fails on the aborted group.
    h.pg.hold = False
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    m._on_lost("late", 9)
    m.allreduce(torch.ones(2)).wait()
    assert not m.should_commit()
    assert "aborted" in str(m.errored())
    m.start_quorum()
    m._on_lost("late", 9)  # an event for a quorum this rank no longer runs: ignored
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert len(h.pg.configures) == 3


def test_min_replica_size_guard(harness: Any) -> None:
    """Fewer participants than min_replica_size → local vote is no, step does not advance."""
    h = harness(min_replica_size=2)
    h.native.quorums = [make_quorum(replica_world_size=1, max_world_size=1)]
    m = h.manager
    m.start_quorum()
    assert not m.should_commit()
    assert m.current_step() == 0
    assert h.native.commit_calls == [(0, 0, False)]


def test_max_retries_raises_runtime_error(harness: Any) -> None:
    """More than max_retries consecutive failed commits raise RuntimeError."""
    h = harness(min_replica_size=2, max_retries=2)
    m = h.manager
    for _ in range(2):
        m.start_quorum()
        assert not m.should_commit()
    m.start_quorum()
    with pytest.raises(RuntimeError, match="max_retries"):
        m.should_commit()
    # the commit failure count reaches the next quorum request
    assert [c["commit_failures"] for c in h.native.quorum_calls] == [0, 1, 2]


def test_failed_commits_reset_after_success(harness: Any) -> None:
    """A successful commit resets the consecutive failure count."""
    h = harness(max_retries=1)
    m = h.manager
    h.native.commit_result = False
    m.start_quorum()
    assert not m.should_commit()
    assert (m.current_step(), m.commit_failures()) == (0, 1)
    h.native.commit_result = None
    m.start_quorum()
    assert m.should_commit()
    assert (m.current_step(), m.commit_failures()) == (1, 0)
    h.native.commit_result = False
    m.start_quorum()
    assert not m.should_commit()  # 1 failure again, not 2: no RuntimeError
    assert (m.current_step(), m.commit_failures()) == (1, 1)


def test_committed_steps_are_noted_for_the_heartbeats(harness: Any) -> None:
    """Each commit (and only a commit) hands the new step to the manager server, whose
    heartbeats tell the lighthouse this group's progress."""
    h = harness()
    m = h.manager
    server = h.native.servers[-1]
    m.start_quorum()
    assert m.should_commit()
    h.native.commit_result = False
    m.start_quorum()
    assert not m.should_commit()
    h.native.commit_result = None
    m.start_quorum()
    assert m.should_commit()
    assert server.committed_steps == [1, 2]


def test_single_rank_group_votes_locally(harness: Any) -> None:
    """With one group rank the commit decision is the local vote (no server round trip)."""
    h = harness(world_size=1)
    m = h.manager
    m.start_quorum()
    assert m.should_commit()
    m.start_quorum()
    m.report_error(RuntimeError("boom"))
    assert not m.should_commit()
    assert h.native.commit_calls == []
    assert m.current_step() == 1
    # Its quorum requests start on the manager server it hosts (the own-link path).
    assert h.native.server_quorum_starts == 2
    assert len(h.native.quorum_calls) == 2


def test_a_group_of_several_ranks_starts_its_quorum_through_the_client(harness: Any) -> None:
    """Only a group of one rank starts its quorum on the server: the others' ranks gather in
    the server's round through their clients."""
    h = harness()
    assert h.manager._group_world_size > 1
    h.manager.start_quorum()
    assert h.manager.should_commit()
    assert h.native.server_quorum_starts == 0
    assert len(h.native.quorum_calls) == 1


def test_structured_log_records(harness: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Quorum, commit and error records carry the structured fields."""
    caplog.set_level(logging.INFO)
    h = harness()
    m = h.manager
    m.start_quorum()
    assert m.should_commit()
    m.start_quorum()
    m.report_error(RuntimeError("injected"))
    assert not m.should_commit()
    by_name: dict[str, list[logging.LogRecord]] = {}
    for r in caplog.records:
        by_name.setdefault(r.name, []).append(r)
    q = by_name["torchft_quorums"][0]
    assert q.replica_id.startswith("rg0:") and q.rank == 0 and q.quorum_id == 1  # type: ignore[attr-defined]
    commits = by_name["torchft_commits"]
    assert [r.commit for r in commits] == [True, False]  # type: ignore[attr-defined]
    assert [r.step for r in commits] == [0, 1]  # type: ignore[attr-defined]
    assert "injected" in by_name["torchft_errors"][0].error  # type: ignore[attr-defined]
    assert all(hasattr(r, "job_id") for r in commits)
