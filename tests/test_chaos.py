"""The chaos harness: a short soak against real processes, and the offline checker alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchft.chaos import Chaos, ChaosConfig, check

ROOT = Path(__file__).resolve().parent.parent


def _lighthouse_bin() -> list[str] | None:
    """The Rust daemon built by ``cargo test``/``cargo build`` if present (restarts fast)."""
    for profile in ("release", "debug"):
        b = ROOT / "target" / profile / "torchft_lighthouse"
        if b.exists():
            return [str(b)]
    return None


@pytest.mark.timeout(180)
def test_short_soak_keeps_every_invariant(tmp_path: Path) -> None:
    """30 random compound faults (kills, stops, kills while healing or voting, lighthouse
    restarts) against three groups: the offline checker finds no violation and every group
    ends at the target with one state."""
    cfg = ChaosConfig(seed=7, faults=30, mtbf=1.0, lighthouse_cmd=_lighthouse_bin())
    report = Chaos(cfg, tmp_path / "run").run()
    print(report.text())
    assert sum(report.faults.values()) == 30
    assert report.violations == []
    assert report.final["states"] == 1 and report.final["groups"] == 3


def _write(path: Path, recs: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _commit(group: str, pid: int, step: int, q: int, state: str, t: float) -> dict[str, object]:
    return {
        "kind": "commit",
        "group": group,
        "pid": pid,
        "step": step,
        "quorum_id": q,
        "participants": 1,
        "state": state,
        "t": t,
    }


def test_checker_flags_a_fork_while_the_holder_lives_and_accepts_one_after_it_died(
    tmp_path: Path,
) -> None:
    """Step 2 committed with another state while its first holder is alive is a violation;
    the same after the holder was killed is an unavoidable regression; quorum ids going back
    and an unfinished group are violations too."""
    _write(
        tmp_path / "a.history.jsonl",
        [
            _commit("a", 1, 1, 10, "s1", 1.0),
            _commit("a", 1, 2, 10, "s2", 2.0),
            {"kind": "finish", "group": "a", "pid": 1, "step": 2, "state": "s2", "t": 9.0},
        ],
    )
    _write(tmp_path / "b.history.jsonl", [_commit("b", 2, 2, 9, "x2", 3.0)])
    _write(
        tmp_path / "processes.jsonl",
        [
            {"kind": "start", "group": "a", "pid": 1, "t": 0.0},
            {"kind": "start", "group": "b", "pid": 2, "t": 0.0},
            {"kind": "exit", "group": "a", "pid": 1, "rc": 0, "killed": False, "t": 10.0},
            {"kind": "exit", "group": "b", "pid": 2, "rc": -9, "killed": True, "t": 4.0},
        ],
    )
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a", "b"])
    text = "\n".join(rep.violations)
    assert "progress regressed" in text and "committed step 2 with a new state" in text
    assert "quorum id 9 first used after 10" in text
    assert "group b did not finish" in text
    # Now the holder of the first state (pid 1) died before b's commit: unavoidable.
    _write(
        tmp_path / "processes.jsonl",
        [
            {"kind": "start", "group": "a", "pid": 1, "t": 0.0},
            {"kind": "exit", "group": "a", "pid": 1, "rc": -9, "killed": True, "t": 2.5},
            {"kind": "start", "group": "b", "pid": 2, "t": 0.0},
            {"kind": "exit", "group": "b", "pid": 2, "rc": 0, "killed": False, "t": 4.0},
        ],
    )
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert not any("progress regressed" in v for v in rep.violations), rep.violations
    assert len(rep.regressions) == 1
