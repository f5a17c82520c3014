"""The step control-plane benchmark, small: its groups (ours, ours with telemetry on,
upstream's, ours against upstream's lighthouse, our native calls without the Python Manager,
the raw-sockets floor) still run a step the way the benchmark times it, and every step
commits. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
