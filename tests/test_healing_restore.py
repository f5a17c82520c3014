"""When a replica group's healer looks for a durable snapshot, and what it does when the
choice or the load fails or the group's ranks did not all load it (no processes: the
snapshot side is a stand-in that records the calls)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from torchft.healing import Healer, LocalState, TornStateError
from torchft.snapshot import Snapshot
from torchft.state_lock import ReadWriteLock

pytestmark = pytest.mark.timeout(60)


class _Snapshots:
    """A stand-in for GroupSnapshots: answers ``restore`` with ``loaded`` (or raises
    ``error``) and ``agreed`` with ``all_loaded``, recording the quorums asked about."""

    def __init__(self, loaded: Any = None, error: Exception | None = None) -> None:
        self.loaded, self.error, self.all_loaded = loaded, error, True
        self.asked: list[tuple[int, bool]] = []

    def restore(self, quorum_id: int, *args: Any) -> Any:
        self.asked.append((quorum_id, args[-1]))
        if self.error is not None:
            raise self.error
        return self.loaded

    def agreed(self, quorum_id: int) -> bool:
        return self.all_loaded


def _healer(applied: list[Any]) -> Healer:
    return Healer(
        native=None,  # type: ignore[arg-type]  # never used without a heal
        state_lock=ReadWriteLock(),
        served_state=lambda: {"user": {"model": 0}, "torchft": {"step": 3}},
        load_counters=lambda counters: applied.append(("counters", counters["step"])),
        loaders={"model": lambda value: applied.append(("model", value))},
        settle_readers=lambda: None,
        in_torchft=contextlib.nullcontext,
        telemetry=lambda: None,
        step=lambda: 3,
        log_info=lambda *a: None,
        group_rank=0,
        timeout=timedelta(seconds=5),
        connect_timeout=timedelta(seconds=5),
        apply_at_once=False,
    )


def _snapshot(step: int) -> tuple[Snapshot, dict[str, Any]]:
    snap = Snapshot(path=Path(f"/snaps/step_{step}"), step=step, manifest={})
    return snap, {"user": {"model": f"state of {step}"}, "torchft": {"step": step}}


def test_a_trained_group_looks_once_per_quorum_and_a_fresh_one_at_every_answer() -> None:
    """A process in its start-up state looks at every answer; once it trained, at the first
    answer of each new quorum only (and as a trained group, two steps ahead)."""
    applied: list[Any] = []
    healer, snaps = _healer(applied), _Snapshots()
    for q in (5, 5, 6):
        healer.restore(snaps, q, 3, 0)  # type: ignore[arg-type]
    assert snaps.asked == [(5, True), (5, True), (6, True)]
    healer.committed()
    assert healer.state is LocalState.TRAINED
    for q in (6, 6, 7, 7, 8):
        healer.restore(snaps, q, 3, 3)  # type: ignore[arg-type]
    # Quorum 6 was looked at already (in the start-up state): only the new ones.
    assert snaps.asked[3:] == [(7, False), (8, False)]
    assert healer.restore_quorum == 8  # what the chaos worker's restore line names


def test_a_failed_restore_ends_only_a_process_in_its_start_up_state() -> None:
    """A trained group keeps its state (nothing was applied); a fresh one must restart."""
    healer = _healer([])
    failing = _Snapshots(error=OSError("snapshot directory unreachable"))
    with pytest.raises(TornStateError, match="restart the group"):
        healer.restore(failing, 5, 3, 0)  # type: ignore[arg-type]
    trained = _healer([])
    trained.committed()
    assert trained.restore(failing, 5, 3, 3) is None  # type: ignore[arg-type]
    assert trained.fatal is None


def test_a_snapshot_not_every_rank_loaded_is_not_applied() -> None:
    applied: list[Any] = []
    healer = _healer(applied)
    healer.committed()
    snaps = _Snapshots(loaded=_snapshot(20))
    snaps.all_loaded = False
    assert healer.restore(snaps, 5, 3, 3).step == 20  # type: ignore[arg-type, union-attr]
    healer.apply_restore()
    assert applied == []
    snaps.all_loaded = True
    healer.restore(snaps, 6, 3, 3)  # type: ignore[arg-type]
    healer.apply_restore()
    assert applied == [("counters", 20), ("model", "state of 20")]


def test_a_snapshot_whose_vote_raised_applies_at_the_next_step() -> None:
    """The vote of the step that loaded it raised, so should_commit never applied it: the
    next step applies it before its forward pass (the other ranks applied theirs), and a
    step is never committed past it."""
    applied: list[Any] = []
    healer = _healer(applied)
    healer.committed()
    healer.restore(_Snapshots(loaded=_snapshot(30)), 5, 3, 3)  # type: ignore[arg-type]
    healer.new_step()
    assert applied == [("counters", 30), ("model", "state of 30")]
    healer.apply_restore()  # nothing left to apply
    assert len(applied) == 2


def test_a_restore_makes_a_torn_state_whole() -> None:
    """A group whose failed heal tore its tensors and that restores a snapshot holds a
    whole state afterwards (it is not ended later as torn)."""
    applied: list[Any] = []
    healer = _healer(applied)
    healer.committed()
    healer._tear()
    assert healer.state is LocalState.TORN
    healer.restore(_Snapshots(loaded=_snapshot(40)), 5, 3, 3)  # type: ignore[arg-type]
    healer.check_trainable(True, True, False)  # the restore counts as the mend
    healer.apply_restore()
    assert healer.state is LocalState.TRAINED and healer.fatal is None
