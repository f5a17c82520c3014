"""The chaos checker's rules on regressions of progress, on synthetic runs: a fork while a
holder lives is a violation, one after every holder died (or was stopped as diverged) is an
unavoidable regression that something recorded must explain."""

from __future__ import annotations

from pathlib import Path

import pytest
from _chaos_runs import (
    _commit,
    _exit,
    _fault,
    _finish,
    _hang,
    _killed,
    _life,
    _read,
    _run,
    _start,
    _write,
)

from torchft.chaos import check
from torchft.chaos.report import Report


def test_checker_flags_a_fork_while_the_holder_lives_and_accepts_one_after_it_died(
    tmp_path: Path,
) -> None:
    """Step 2 committed with another state while its first holder is alive is a violation;
    the same after the holder was killed is an unavoidable regression; quorum ids going back
    and an unfinished group are violations too."""
    A, B = 10**6 + 601, 10**6 + 602  # pids surely not running here
    _run(
        tmp_path,
        {
            "a": [
                _commit("a", A, 1, 10, "s1", 1.0),
                _commit("a", A, 2, 10, "s2", 2.0),
                _finish("a", A, 2, "s2", 9.0),
            ],
            "b": [_commit("b", B, 2, 9, "x2", 3.0)],
        },
        [_start("a", A, 0.0), _start("b", B, 0.0), _exit("a", A, 10.0), _killed("b", B, 4.0)],
    )
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a", "b"])
    text = "\n".join(rep.violations)
    assert "progress regressed" in text and "committed step 2 with a new state" in text
    assert "quorum id 9 first used after 10" in text
    assert "group b did not finish" in text
    # Now the holder of the first state (A) died before b's commit: unavoidable.
    b_life = _life("b", B, 0.0, 4.0)
    _write(tmp_path / "processes.jsonl", [_start("a", A, 0.0), _killed("a", A, 2.5), *b_life])
    # Nothing the run recorded explains why its only holder died: a violation.
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert any("progress regressed with nothing to explain it" in v for v in rep.violations)
    # A total loss between the holder's last commit and the re-commit explains it.
    kill_all = _fault("kill_all", ["a", "b"], 2.4, best_step=2, snapshot_step=0, snapshot_every=10)
    _write(tmp_path / "faults.jsonl", [kill_all])
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert not any("progress regressed" in v for v in rep.violations), rep.violations
    assert len(rep.regressions) == 1 and "a total loss (kill_all)" in rep.regressions[0]
    # So does a holder that ended itself (here: held hung, exit 76) instead.
    (tmp_path / "faults.jsonl").unlink()
    _write(tmp_path / "processes.jsonl", [*_life("a", A, 0.0, 2.5, rc=76), *b_life])
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert not any("progress regressed" in v for v in rep.violations), rep.violations
    assert "ended itself: held hung" in rep.regressions[0]


def test_a_killed_holder_is_dead_from_its_kill_not_from_when_its_exit_was_reaped(
    tmp_path: Path,
) -> None:
    """The lighthouse sees a SIGKILLed holder die as its connections close, and the others
    may re-commit its step at once; the supervisor reaps the exit up to a poll later. A
    re-commit after the kill is an unavoidable regression (the process ran no code after
    the signal), one before the kill a violation, and an exit record without the kill's
    instant (an older run) is judged by its reaped exit, as before."""
    A, C = 10**6 + 621, 10**6 + 622  # pids surely not running here

    def run(killed_at: float | None) -> list[str]:
        exit_a = _killed("a", A, 5.1)
        if killed_at is not None:
            exit_a["killed_at"] = killed_at
        _run(
            tmp_path,
            {
                "a": [_commit("a", A, 1, 10, "s1", 1.0), _commit("a", A, 2, 10, "a2", 2.0)],
                "c": [
                    _commit("c", C, 1, 10, "s1", 1.0),
                    _commit("c", C, 2, 12, "c2", 5.0),
                    _finish("c", C, 2, "c2", 7.0),
                ],
            },
            [_start("a", A, 0.0), exit_a, *_life("c", C, 0.0, 8.0)],
        )
        kill = _fault("kill_one", ["a"], 4.9, best=2, best_left=1)
        _write(tmp_path / "faults.jsonl", [kill])
        rep = check(tmp_path, target=2, min_replicas=1, groups=["c"])
        return [v for v in rep.violations if "regress" in v] + rep.regressions

    said = run(4.95)
    assert len(said) == 1 and said[0].startswith("step 2 re-committed by c"), said
    assert "kill_one of ['a'] took the last live holders of step 2" in said[0], said
    said = run(5.05)  # killed after c re-committed: a live holder was bypassed
    assert any(v.startswith("progress regressed: c") for v in said), said
    said = run(None)  # reaped after the re-commit, no kill instant: alive until then
    assert any(v.startswith("progress regressed: c") for v in said), said


def test_a_holder_stopped_as_diverged_holds_no_progress_from_its_last_commit(
    tmp_path: Path,
) -> None:
    """A re-commit past a live holder is a violation, unless that holder was stopped as
    diverged (it ends itself with exit 77 and commits nothing after its verdict): from its
    last commit on, its state is not progress. Then the re-commit is an unavoidable
    regression named after it, however long the stopped process takes to exit; a holder
    that kept committing, or that exited otherwise, still makes it a violation."""
    from torchft.chaos.history import DIVERGED_EXIT

    A, C = 10**6 + 611, 10**6 + 612  # pids surely not running here

    def run(a_rc: int, a_last: float) -> list[str]:
        _run(
            tmp_path,
            {
                "a": [
                    _commit("a", A, 1, 10, "s1", 1.0),
                    _commit("a", A, 2, 11, "a2", 2.0),
                    _commit("a", A, 3, 11, "a3", a_last),
                ],
                "c": [
                    _commit("c", C, 1, 10, "s1", 1.0),
                    _commit("c", C, 2, 12, "c2", 5.0),
                    _commit("c", C, 3, 12, "c3", 6.0),
                    _finish("c", C, 3, "c3", 7.0),
                ],
            },
            [*_life("a", A, 0.0, 9.0, rc=a_rc), *_life("c", C, 0.0, 8.0)],
        )
        rep = check(tmp_path, target=3, min_replicas=1, groups=["c"])
        return [v for v in rep.violations if "regress" in v] + rep.regressions

    said = run(DIVERGED_EXIT, 3.0)
    assert len(said) == 1 and "step 2 re-committed by c" in said[0], said
    assert f"process {A} (a) stopped as diverged with no majority" in said[0]
    # Still committing after the re-commit: it was not stopped; a live holder was bypassed.
    said = run(DIVERGED_EXIT, 5.5)
    assert any(v.startswith("progress regressed: c") for v in said), said
    # A holder that did not stop as diverged (exit 0 later): a violation, as before.
    said = run(0, 3.0)
    assert any(v.startswith("progress regressed: c") for v in said), said


def test_a_holder_the_lighthouse_stopped_as_diverged_holds_nothing_even_if_killed(
    tmp_path: Path,
) -> None:
    """The lighthouse stops a holder as diverged (its event log says so) and a fault kills
    it before it can end itself: from the verdict on its state is not progress, so a fresh
    group that restores an older snapshot and re-commits past it is an unavoidable
    regression named after it, not a bypassed live holder. Without the verdict, or with a
    verdict that comes only after the restore, both are violations."""
    A, C = 10**6 + 621, 10**6 + 622  # pids surely not running here

    def run(verdict_t: float | None) -> Report:
        _run(
            tmp_path,
            {
                "a": [_commit("a", A, s, 10, f"s{s}", float(s)) for s in (1, 2, 3)],
                "c": [
                    {"kind": "restore", "group": "c", "pid": C, "step": 1, "state": "s1", "t": 4.5},
                    _commit("c", C, 2, 12, "c2", 6.0),
                    _commit("c", C, 3, 12, "c3", 7.0),
                    _finish("c", C, 3, "c3", 8.0),
                ],
            },
            [_start("a", A, 0.0), _start("c", C, 4.0), _killed("a", A, 9.0), _exit("c", C, 9.0)],
        )
        events = tmp_path / "events.jsonl"
        events.unlink(missing_ok=True)
        if verdict_t is not None:
            verdict = {
                "kind": "replica_diverged",
                "action": "stop",
                "replica_id": "a:0f1e2d3c",
                "step": 3,
                "ts": verdict_t,
            }
            # A bit flip explains the verdict (else it is a false one).
            flip = {"kind": "bitflip", "group": "a", "pid": A, "step": 2, "parity_every": 1}
            _write(
                tmp_path / "a.history.jsonl",
                [*_read(tmp_path / "a.history.jsonl"), {**flip, "t": 2.5}],
            )
            _write(events, [verdict])
        return check(tmp_path, target=3, min_replicas=1, groups=["c"])

    rep = run(3.5)
    assert not [v for v in rep.violations if "regress" in v or "bypassed" in v], rep.violations
    assert len(rep.regressions) == 1, rep.regressions
    assert f"process {A} (a) stopped as diverged with no majority" in rep.regressions[0]
    for verdict_t in (None, 6.5):
        said = run(verdict_t).violations
        assert any("bypassed" in v for v in said), (verdict_t, said)
        assert any(v.startswith("progress regressed: c") for v in said), (verdict_t, said)


def test_checker_flags_a_process_whose_own_progress_goes_back(tmp_path: Path) -> None:
    """A process that commits a step it already committed (same state, so no fork) is a
    violation: its progress went back, though nobody else holds another state."""
    p1 = 10**6 + 300  # a pid that is surely not running here
    _run(
        tmp_path,
        {
            "a": [
                _commit("a", p1, 1, 10, "s1", 1.0),
                _commit("a", p1, 2, 10, "s2", 2.0),
                _commit("a", p1, 2, 11, "s2", 3.0),
                _finish("a", p1, 2, "s2", 9.0),
            ]
        },
        _life("a", p1, 0.0, 10.0),
    )
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert rep.violations == [
        f"a (pid {p1}) committed step 2 after its own commit of step 2: a process's "
        "progress went back"
    ]


def test_checker_judges_a_fork_inside_a_reported_regression_on_its_own(tmp_path: Path) -> None:
    """After an unavoidable regression over steps 2..3 (their holder died), a third state of
    step 3 committed while the holder of the second one lives is still a violation."""
    p1, p2, p3 = 10**6 + 310, 10**6 + 311, 10**6 + 312  # pids surely not running here
    _run(
        tmp_path,
        {
            "a": [
                _commit("a", p1, 1, 10, "s1", 1.0),
                _commit("a", p1, 2, 10, "s2", 2.0),
                _commit("a", p1, 3, 10, "s3", 3.0),
                _hang("a", p1, 3, 3.1),
            ],
            "b": [
                _commit("b", p2, 2, 11, "x2", 4.0),
                _commit("b", p2, 3, 11, "x3", 5.0),
                _finish("b", p2, 3, "x3", 9.0),
            ],
            "c": [_commit("c", p3, 3, 12, "y3", 6.0), _finish("c", p3, 3, "x3", 9.0)],
        },
        [
            _start("a", p1, 0.0),
            # It ended itself (held hung): what explains that its steps died with it.
            _exit("a", p1, 3.5, rc=76),
            _start("b", p2, 3.6),
            _start("c", p3, 3.6),
            _exit("b", p2, 10.0),
            _exit("c", p3, 10.0),
        ],
    )
    rep = check(tmp_path, target=3, min_replicas=1, groups=["b", "c"])
    assert len(rep.regressions) == 1 and rep.steps_lost == 2
    assert rep.violations == [
        f"progress regressed: c (pid {p3}, quorum 12) committed step 3 with a new state "
        f"while pids [{p2}] holding step >= 3 (best 3) were alive"
    ]


@pytest.mark.parametrize(
    "case",
    ["redone", "redone-same-state", "restored", "reported-late", "restored-past-live-holder"],
)
def test_a_live_laggard_must_resume_from_a_newer_snapshot(tmp_path: Path, case: str) -> None:
    """b stops after step 3 while a trains on alone to step 10 (snapshot of step 8 reported
    complete at t=8.5); a is killed, and b's next quorum (12) forms at t=11.

    - Going on from step 3 then redoes steps a restore of snapshot 8 would have kept: one
      violation (at the quorum change, not at every step after it), whether the redone
      steps fork (new states) or not (the same data gave the same states).
    - Restoring it is none, nor going on from step 3 when the snapshot was reported only
      after the quorum formed.
    - Restoring it while a, which committed step 8 and more after b's last commit, is
      still alive bypasses a live holder: a violation."""
    A, B = 10**6 + 611, 10**6 + 612  # pids surely not running here
    hist_a = [_commit("a", A, s, 10 if s <= 3 else 11, f"s{s}", float(s)) for s in range(1, 11)]
    hist_b = [_commit("b", B, s, 10, f"s{s}", s + 0.1) for s in range(1, 4)]
    if case.startswith("restored"):
        restore = {"kind": "restore", "group": "b", "pid": B, "step": 8, "state": "s8"}
        hist_b.append({**restore, "t": 11.5, "quorum_id": 12})
        hist_b += [_commit("b", B, s, 13, f"t{s}", 11.5 + 0.1 * s) for s in range(9, 13)]
    else:
        same = case == "redone-same-state"
        hist_b += [
            _commit("b", B, s, 12, f"s{s}" if same and s <= 10 else f"t{s}", 11.5 + 0.1 * s)
            for s in range(4, 13)
        ]
    hist_b.append(_finish("b", B, 12, "t12", 14.0))
    a_end = _exit("a", A, 14.5) if case == "restored-past-live-holder" else _killed("a", A, 10.5)
    faults = [] if case == "restored-past-live-holder" else [_fault("kill_one", ["a"], 10.5)]
    _run(
        tmp_path,
        {"a": hist_a, "b": hist_b},
        [_start("a", A, 0.0), a_end, *_life("b", B, 0.0, 14.5)],
        [{**f, "best": 10, "best_left": 3} for f in faults],
    )
    reported_at = 11.2 if case == "reported-late" else 8.5
    events = [
        {"seq": 1, "ts": 0.5, "kind": "quorum_changed", "quorum_id": 10},
        {"seq": 2, "ts": 3.5, "kind": "quorum_changed", "quorum_id": 11},
        {"seq": 3, "ts": reported_at, "kind": "snapshot_complete", "step": 8},
        {"seq": 4, "ts": 11.0, "kind": "quorum_changed", "quorum_id": 12},
    ]
    _write(tmp_path / "events.jsonl", sorted(events, key=lambda e: float(e["ts"])))
    violations = check(tmp_path, target=12, min_replicas=1, groups=["b"]).violations
    skipped = [v for v in violations if "snapshot was not restored" in v]
    bypassed = [v for v in violations if "bypassed" in v]
    if case.startswith("redone"):
        assert len(skipped) == 1, violations
        assert "step 8" in skipped[0] and "from step 3" in skipped[0] and "5 steps" in skipped[0]
    else:
        assert skipped == [], violations
    assert len(bypassed) == (case == "restored-past-live-holder"), violations
