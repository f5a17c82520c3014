"""The step profile (``benches/step_profile.py``) runs end to end as users run it (a
lighthouse and two replica-group processes), finds every entry point it hooks, and its
per-step accounting is right."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _bench_kit import BENCHES, load_bench

REPO = Path(__file__).resolve().parents[1]


def _profile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHES))  # it imports ddp_overhead
    return load_bench("step_profile")


@pytest.mark.timeout(240)
def test_a_short_profile_finds_every_entry_point() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "benches" / "step_profile.py"),
            "--hidden",
            "64",
            "--steps",
            "30",
            "--warmup",
            "5",
            "--runs",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its lighthouse and workers go with it on a timeout
    )
    try:
        out, _ = proc.communicate(timeout=220)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    rows = {
        line[:52].strip(): line[52:].split()
        for line in out.splitlines()
        if line.startswith("  ") and len(line[52:].split()) == 3
    }
    # One quorum start, wait and vote per step; the start inside zero_grad, the vote inside
    # the optimizer wrapper's step (a parent holds at least its children's CPU).
    for entry in ("Manager.start_quorum", "vote (native)", "Manager.should_commit"):
        assert float(rows[entry][2]) == pytest.approx(1.0, abs=0.01), out
    assert float(rows["Manager.allreduce (each bucket)"][2]) >= 1.0, out
    assert float(rows["OptimizerWrapper.step"][0]) >= float(rows["Manager.should_commit"][0]), out


def test_summary_is_the_mean_per_step_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _profile(monkeypatch)
    entry = "Manager.allreduce (each bucket)"
    steps = [{entry: [1.0, 2.0, 2.0]}] + [{entry: [0.002, 0.004, 2.0]}, {}]
    got = {label.strip(): v for label, v in bench.summarize(steps, warmup=1).items()}
    # The warmup step is left out; a step without the entry counts zero for it.
    assert got[entry] == pytest.approx([1.0, 2.0, 1.0])
    assert got["vote (native)"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "bad", [["--runs", "0"], ["--steps", "0"], ["--warmup", "-1"], ["--hidden", "0"]]
)
def test_bad_arguments_are_refused_before_anything_starts(bad: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benches" / "step_profile.py"), *bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "must be >= 1" in out.stderr and "step_profile:" not in out.stdout, out.stderr
