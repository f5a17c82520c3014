"""torchft.launch runs replica groups under torchrun, restarts a killed group, cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from torchft.launch import Launcher, _pids_with_marker

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    d = Path(sys.argv[1])
    g = os.environ["REPLICA_GROUP_ID"]
    assert os.environ["NUM_REPLICA_GROUPS"] == "2"
    assert os.environ["TORCHFT_LIGHTHOUSE"]
    (d / f"started_{g}_{os.getpid()}").touch()
    while not (d / "stop").exists():
        time.sleep(0.05)
    """
)


def wait_for(cond, timeout: float, what: str) -> None:
    """Polls ``cond`` until true or fails the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def started(d: Path, group: int) -> list[str]:
    return sorted(p.name for p in d.glob(f"started_{group}_*"))


@pytest.mark.timeout(120)
def test_killed_group_is_restarted_and_nothing_leaks(tmp_path: Path) -> None:
    """SIGKILL of one group's worker restarts only that group; every process is gone after."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    launcher = Launcher(
        str(script),
        [str(tmp_path)],
        replicas=2,
        max_restarts=2,
        lighthouse="http://127.0.0.1:9",  # the worker never dials it
        on_line=lambda g, line: None,
    )
    code: list[int] = []
    try:
        launcher.start()
        runner = threading.Thread(target=lambda: code.append(launcher.run(timeout=100)))
        runner.start()
        wait_for(lambda: started(tmp_path, 0) and started(tmp_path, 1), 60, "both groups")
        first = started(tmp_path, 1)
        killed = launcher.kill_group(1, signal.SIGKILL)
        assert killed, "no worker process found for group 1"
        wait_for(lambda: len(started(tmp_path, 1)) == 2, 60, "group 1 restart")
        assert launcher.groups[1].restarts == 1
        assert launcher.groups[0].restarts == 0
        assert len(started(tmp_path, 0)) == 1, "group 0 must not have been restarted"
        assert started(tmp_path, 1) != first
        (tmp_path / "stop").touch()
        runner.join(60)
        assert code == [0]
    finally:
        (tmp_path / "stop").touch()
        launcher.shutdown()
    assert _pids_with_marker(launcher.marker) == []


@pytest.mark.timeout(60)
def test_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    """Bad flags exit non-zero with a clear message and start nothing."""
    script = tmp_path / "w.py"
    script.write_text("pass\n")
    for args, msg in [
        (["--replicas", "0", str(script)], "--replicas must be at least 1"),
        (["--replicas", "2", str(tmp_path / "missing.py")], "does not exist"),
        (["--replicas", "2", "--min-replicas", "3", str(script)], "--min-replicas"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "torchft.launch", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "TORCHFT_LIGHTHOUSE": ""},
        )
        assert r.returncode == 2, r
        assert msg in r.stderr
