"""The chaos harness's own goodput figure (torchft.chaos.goodput) and what it learns from the
phase files of processes that died before writing their last step's line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torchft.chaos.goodput import compare, harness_goodput, read_voted, voted
from torchft.chaos.history import HistoryWriter, _unseen_steps, read_jsonl

pytestmark = pytest.mark.timeout(30)

T0 = 1000.0


def _line(kind: str, t: float, step: int | None = None, wait: float = 0.0) -> dict[str, Any]:
    r: dict[str, Any] = {"kind": kind, "t": T0 + t, "group": "g0", "pid": 7}
    if step is not None:
        r.update(step=step, quorum_wait=wait, step_healed=False)
    return r


def _finish(t: float) -> dict[str, Any]:
    """The group's end, written by its next process (the killed one wrote none)."""
    return {**_line("finish", t), "pid": 8}


def _history() -> list[dict[str, Any]]:
    # ready, a start-up step, then three productive steps of 1 s with 0.25 s quorum wait.
    return [
        _line("ready", 0.0),
        _line("commit", 2.0, 1),
        _line("commit", 3.0, 2, 0.25),
        _line("commit", 4.0, 3, 0.25),
        _line("commit", 5.0, 4, 0.25),
    ]


def test_steps_are_accounted_from_the_history_lines() -> None:
    """The first step is start-up; each later step spans the time since the previous line,
    less its quorum wait; a step committed again by the group moves to regressed."""
    lines = [*_history(), _line("restore", 6.0, 2), _line("commit", 7.0, 3), _line("finish", 8.0)]
    g = harness_goodput(lines, T0)
    assert g["groups"]["g0"]["wall_s"] == pytest.approx(8.0)
    # Productive: steps 2 and 4, and step 3 again; its first commit was lost.
    assert g["groups"]["g0"]["regressed_steps"] == 1
    assert g["groups"]["g0"]["regressed_s"] == pytest.approx(0.75)
    assert g["productive_s"] == pytest.approx(0.75 * 2 + 1.0)
    assert g["ratio"] == g["ratio_high"] == pytest.approx(2.5 / 8.0)


def test_only_the_part_of_a_step_inside_the_window_counts() -> None:
    """A window that opens late (a lighthouse that lost its state opens it at the first
    commit it sees): a step under way then counts from the window's start, its quorum wait
    first; a step that ended before it counts nothing. The figures never exceed the wall."""
    lines = [
        _line("ready", 0.0),
        _line("commit", 1.0, 1),  # start-up
        _line("commit", 2.0, 2, 0.25),  # before the window
        _line("commit", 6.0, 3, 3.0),  # 2 to 6, the window opens at 4: 1 s wait, 1 s work
        _line("commit", 7.0, 4, 0.5),  # inside, whole
        _line("finish", 8.0),
    ]
    g = harness_goodput(lines, T0 + 4.0)["groups"]["g0"]
    assert g["wall_s"] == pytest.approx(4.0)
    assert g["productive_s"] == pytest.approx(1.0 + 0.5)
    assert g["quorum_s"] == pytest.approx(1.0 + 0.5)
    assert g["steps_committed"] == 2
    # Opened after the step's quorum wait: its work is cut, the wait does not count.
    late = harness_goodput(lines, T0 + 5.5)["groups"]["g0"]
    assert late["productive_s"] == pytest.approx(0.5 + 0.5)
    assert late["quorum_s"] == pytest.approx(0.5)
    assert late["productive_s"] + late["quorum_s"] <= late["wall_s"]


def test_the_vote_record_round_trips_and_survives_a_shorter_overwrite() -> None:
    rec = voted(41, 42, True, 0.125)
    assert len(rec) == 64 and rec[:1] == b"d"
    back = read_voted(rec)
    assert back is not None
    assert (back["before"], back["after"], back["step_healed"]) == (41, 42, True)
    assert back["quorum_wait"] == pytest.approx(0.125)
    # The next step overwrites the first byte only: not in phase d any more.
    assert read_voted(b"q" + rec[1:]) is None
    assert read_voted(b"d garbage") is None and read_voted(b"") is None


def _records(
    run: Path,
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]], list[dict[str, Any]]]:
    """What the checker has read of a run: histories by file name, processes and faults."""
    histories = {p.name: read_jsonl(p) for p in run.glob("*.history.jsonl")}
    return histories, read_jsonl(run / "processes.jsonl"), read_jsonl(run / "faults.jsonl")


def _run(tmp_path: Path, phase: bytes, lines: list[dict[str, Any]], exit_t: float) -> Path:
    (tmp_path / "g0.0.history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "g0.0.phase").write_bytes(phase)
    (tmp_path / "processes.jsonl").write_text(
        json.dumps({"kind": "exit", "group": "g0", "pid": 7, "killed": True, "t": T0 + exit_t})
        + "\n"
    )
    fault = {"kind": "fault", "fault": "kill_all", "groups": ["g0"], "t": T0 + exit_t - 0.5}
    (tmp_path / "faults.jsonl").write_text(json.dumps(fault) + "\n")
    return tmp_path


def test_a_step_voted_but_not_written_is_taken_from_the_phase_file(tmp_path: Path) -> None:
    """Killed after the vote returned, before the line: the phase record says the step
    committed, when, and its quorum wait, so the harness counts it exactly."""
    # As voted(4, 5, False, 0.5) writes it, 1 s after the last line.
    rec = f"d4 5 0 {T0 + 6.0:.6f} 0.500000".ljust(64).encode()
    run = _run(tmp_path, rec, _history(), 7.0)
    unseen, in_vote = _unseen_steps(run, *_records(run))
    assert in_vote == {}
    assert [(r["kind"], r["step"]) for r in unseen] == [("commit", 5)]
    g = harness_goodput([*_history(), *unseen, _finish(9.0)], T0)
    assert g["productive_s"] == pytest.approx(0.75 * 3 + 0.5)
    assert g["unsure_s"] == 0.0


def test_a_written_step_is_not_counted_again_from_its_phase_record(tmp_path: Path) -> None:
    """The worker gives the phase record and the step's line the same instant (the step's
    end as its report measured it, rounded to the microsecond): a step whose line was
    written is not also taken from the phase file, whatever the rounding."""
    for frac in (0.1234564, 0.1234565, 0.9999996):
        path = tmp_path / "g0.0.history.jsonl"
        path.unlink(missing_ok=True)
        writer = HistoryWriter(str(path), "g0", 7)
        ended = round(T0 + 6.0 + frac, 6)
        writer.commit(step=5, quorum_id=1, participants=1, state="s", quorum_wait=0.5, t=ended)
        lines = read_jsonl(path)
        assert lines[-1]["t"] == ended
        run = _run(tmp_path, voted(4, 5, False, 0.5, ended), lines, 7.5)
        back = read_voted(voted(4, 5, False, 0.5, ended))
        assert back is not None and back["t"] == ended
        unseen, in_vote = _unseen_steps(run, *_records(run))
        assert unseen == [] and in_vote == {}


def test_a_kill_inside_the_vote_makes_the_harness_figure_a_range(tmp_path: Path) -> None:
    """Killed in phase c, the step may have committed (the lighthouse knows, the history
    cannot): up to the time from the last line to the kill is added to the high end only,
    and the lighthouse's figure is checked against the range."""
    run = _run(tmp_path, b"c", _history(), 7.0)
    unseen, in_vote = _unseen_steps(run, *_records(run))
    assert unseen == [] and in_vote == {7: pytest.approx(T0 + 6.5)}
    g = harness_goodput([*_history(), _finish(10.0)], T0, in_vote)
    assert g["unsure_s"] == pytest.approx(1.5)
    assert g["ratio"] == pytest.approx(2.25 / 10.0)
    assert g["ratio_high"] == pytest.approx(3.75 / 10.0)
    for ratio in (0.225, 0.3, 0.375):
        assert compare({"ratio": ratio}, g) is None
    # Outside the range by more than 1% either way is a violation that names the range.
    for ratio in (0.2220, 0.3800):
        why = compare({"ratio": ratio}, g)
        assert why is not None and "0.2250 to 0.3750" in why
    # Without a kill in the vote the figure is a point.
    point = harness_goodput([*_history(), _finish(10.0)], T0)
    assert compare({"ratio": 0.23}, point) is not None


def test_a_goodput_violation_names_each_groups_accounts(tmp_path: Path) -> None:
    """The violation carries both sides' accounts per group, so a failed run says where the
    figures part even after its run directory is gone."""
    from torchft.chaos.history import _judge_goodput
    from torchft.chaos.report import Report

    (tmp_path / "g0.0.history.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [*_history(), _finish(10.0)])
    )
    group = {"replica_id": "g0", "productive_s": 1.0, "heal_s": 0.0, "quorum_s": 0.5}
    event = {"kind": "goodput", "final": True, "ratio": 0.1, "window_start_unix_s": T0}
    (tmp_path / "events.jsonl").write_text(json.dumps({**event, "groups": [group]}) + "\n")
    rep = Report()
    _judge_goodput(rep, tmp_path, [], [])
    assert len(rep.violations) == 1
    assert "g0: productive 1.0 / 2.250s" in rep.violations[0], rep.violations[0]
