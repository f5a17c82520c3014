"""The step control-plane benchmark, small: its groups (ours, ours with telemetry on,
upstream's, ours against upstream's lighthouse, our native calls without the Python Manager,
the raw-sockets floor) still run a step the way the benchmark times it, and every step
commits (no timing is asserted); and its per-step CPU reading counts the step's own thread
only."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from _bench_kit import BENCHES, burn, load_bench

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_step_control_benchmark_small_version() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benches" / "step_control.py"),
            "--check",
            "--allow-missing-upstream",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"ours", "ours/telemetry", "ours/native-calls", "raw-sockets"} <= set(summary), text
    for row in summary.values():
        # Both parts of the control plane were measured in every configuration run.
        assert row["quorum_ms"] > 0 and row["vote_ms"] > 0, text
        assert row["median_ms"] > 0, text
        # The training thread's CPU per whole step was read around every step.
        assert row["thread_cpu_ms"] > 0, text
    assert "not every step committed" not in out.stdout, text


def _bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHES))  # the bench imports its sibling helpers
    return load_bench("step_control")


@pytest.mark.timeout(60)
def test_thread_cpu_per_step_counts_only_the_steps_own_thread_and_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A step whose quorum burns 2 ms of CPU and whose allreduce sleeps 5 ms, with another
    thread spinning meanwhile: the CPU per step is the quorum's 2 ms, in milliseconds, and
    never more than the step's own timed parts (the reads lie between steps)."""
    bench = _bench(monkeypatch)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    other = threading.Thread(target=spin, daemon=True)
    other.start()
    result = tmp_path / "steps.json"
    try:
        bench._time_steps(
            lambda _: burn(0.002),
            lambda: time.sleep(0.005),
            lambda _: True,
            20,
            2,
            str(result),
        )
    finally:
        stop.set()
        other.join()
    parts = json.loads(result.read_text())
    assert parts["committed"] == 20
    cpu = parts["cpu"]
    assert len(cpu) == 20
    # The sleep and the other thread's spinning are not in it; the burn is, in milliseconds.
    assert 1.9 <= statistics.median(cpu) < 4.0, cpu
    for i, used in enumerate(cpu):
        whole = parts["quorum"][i] + parts["allreduce"][i] + parts["vote"][i]
        assert used <= whole + 0.2, (i, used, whole)
