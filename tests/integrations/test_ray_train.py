"""torchft under Ray Train: a failed replica group is replaced and heals from the live survivor.

Runs ``examples/ray_train.py`` as a user would (a local Ray cluster, ``TorchftConfig``, two
replica groups on CPU/Gloo, ``PGTransport`` for healing) with replica group 1 raising once
mid-run. Each incarnation that finishes writes a record (see the example); the test checks:

- the replacement of group 1 healed from the survivor (its step jumped past the failure step)
  and its first commit came while the survivor was still training;
- the two groups then trained together (steps with two participants on both sides);
- both ended at the last step with bit-identical model and optimizer state.

Ray needs from a few seconds to tens of seconds (on a loaded machine) to replace a worker, so
the survivor is paced while it trains alone (``--alone-sleep``): 70 s of steps left at the
failure, and the two groups train the rest unpaced once the replacement is back.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray.train.v2.torch.torchft_config", reason="needs ray[train] >= 2.60")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_train.py"
STEPS = 1500
FAIL_AT = 100
ALONE_SLEEP = 0.05  # up to ~70 s of survivor training alone after the failure


def _session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` (the driver's; Ray's local cluster runs in it too)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _run_example(cmd: list[str], ray_tmp: str, tmp_path: Path) -> tuple[int | None, str]:
    """Runs the example with Ray's session directory under ``ray_tmp``; returns its exit code
    (None past the timeout) and the tail of its log. Nothing of the run (driver, Ray's
    cluster) outlives it."""
    env = {
        **os.environ,
        "RAY_DISABLE_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        "RAY_TMPDIR": ray_tmp,
    }
    log = tmp_path / "ray_train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=840)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            for pid in _session_pids(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                proc.wait(timeout=30)
    return code, log.read_text()[-6000:]


@pytest.mark.timeout(900)
def test_replacement_heals_from_the_running_survivor(tmp_path: Path) -> None:
    """The replacement of a failed group heals from the survivor while it trains, trains
    with it, and both end at the last step with one state."""
    results = tmp_path / "results"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--groups=2",
        f"--steps={STEPS}",
        f"--alone-sleep={ALONE_SLEEP}",
        "--fail-group=1",
        f"--fail-at-step={FAIL_AT}",
        f"--result-dir={results}",
        f"--storage-path={tmp_path / 'storage'}",
    ]
    # Ray's session directory (logs, sockets) goes to a directory of the test's own, removed
    # afterwards. It is short because Ray puts Unix sockets under it (their paths have a
    # small length limit), so it is not under pytest's tmp_path.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        code, tail = _run_example(cmd, ray_tmp, tmp_path)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0, f"example exited with {code}:\n{tail}"

    records = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    by_group: dict[int, list[dict]] = {}
    for r in records:
        by_group.setdefault(r["group"], []).append(r)
    # The failed incarnation raised (no record); one survivor and one replacement finished.
    assert sorted(by_group) == [0, 1] and all(len(v) == 1 for v in by_group.values()), records
    survivor, replacement = by_group[0][0], by_group[1][0]

    # The replacement healed from the survivor's live state, past the failure step...
    assert replacement["healed_to"] is not None and replacement["healed_to"] > FAIL_AT, records
    first_step, first_t, _ = replacement["first_commit"]
    assert first_step == replacement["healed_to"] + 1
    # ...while the survivor was still training (its last commit comes later)...
    last_step, last_t, _ = survivor["last_commit"]
    assert first_t < last_t and first_step < last_step, records
    # ...at the survivor's then current step: when the replacement committed its first step,
    # the survivor had committed the step it healed to (and at most the one they committed
    # together), and the survivor went on committing with two participants.
    survivor_log = survivor["commit_log"]
    survivor_then = max(step for step, t, _ in survivor_log if t <= first_t)
    assert replacement["healed_to"] <= survivor_then <= replacement["healed_to"] + 1, (
        survivor_then,
        replacement["healed_to"],
    )
    after = [(step, n) for step, t, n in survivor_log if t > first_t]
    assert after and any(n == 2 for _, n in after), after[:10]
    # ...then both trained together...
    assert replacement["joint_commits"] > 0 and survivor["joint_commits"] > 0, records
    # ...and they end at the last step with bit-identical state.
    assert survivor["step"] == replacement["step"] == STEPS
    assert survivor["state_hash"] == replacement["state_hash"], records
