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
from typing import Any

import pytest

from torchft.launch import Launcher, _pids_with_marker
from torchft.launch import main as launch_main

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


def _launcher(tmp_path: Path, worker: str, **kwargs: Any) -> Launcher:
    """A launcher of two groups running ``worker`` (given ``tmp_path`` as its argument)
    against a lighthouse address the worker never dials."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    return Launcher(
        str(script), [str(tmp_path)], replicas=2, lighthouse="http://127.0.0.1:9", **kwargs
    )


def started(d: Path, group: int) -> list[str]:
    return sorted(p.name for p in d.glob(f"started_{group}_*"))


@pytest.mark.timeout(120)
def test_killed_group_is_restarted_and_nothing_leaks(tmp_path: Path) -> None:
    """SIGKILL of one group's worker restarts only that group; every process is gone after,
    and so is every directory the launch's torchruns made (none lands in the temp dir)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    launcher = _launcher(
        tmp_path, WORKER, max_restarts=2, on_line=lambda g, line: None, env={"TMPDIR": str(temp)}
    )
    code: list[int] = []
    try:
        launcher.start()
        runner = threading.Thread(target=lambda: code.append(launcher.run(timeout=100)))
        runner.start()
        wait_for(lambda: started(tmp_path, 0) and started(tmp_path, 1), 60, "both groups")
        assert launcher.log_dir is not None
        assert len(os.listdir(launcher.log_dir)) == 2, "each torchrun keeps its files there"
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
    assert not os.path.exists(launcher.log_dir)
    assert os.listdir(temp) == [], "a torchrun left files in the temp directory"


CHATTY = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    d = Path(sys.argv[1])
    if os.environ["REPLICA_GROUP_ID"] == "1" and not list(d.glob("wrote_*")):
        for i in range(200):
            print(f"line {os.getpid()} {i}", flush=True)
        (d / f"wrote_{os.getpid()}").touch()
    while not (d / "stop").exists():
        time.sleep(0.05)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("standby", [0, 1])
def test_joining_the_output_pumps_after_a_kill_hands_on_every_line_first(
    tmp_path: Path, standby: int
) -> None:
    """A killed group's last lines can still be on their way to ``on_line`` after the kill
    (a slow handler here): once its ``output_pumps`` are joined, every line it wrote has been
    handed on, so a caller can tell a dead incarnation's lines from its successor's."""
    handled: list[str] = []

    def slow(group: int, line: str) -> None:
        if line.startswith("line "):
            time.sleep(0.01)
            handled.append(line)

    launcher = _launcher(tmp_path, CHATTY, max_restarts=1, on_line=slow, standby=standby)
    try:
        launcher.start()
        wait_for(lambda: list(tmp_path.glob("wrote_*")), 90, "group 1's lines")
        pumps = launcher.output_pumps(1)
        assert pumps and all(t.is_alive() for t in pumps)
        assert launcher.kill_group(1, signal.SIGKILL)
        behind = 200 - len(handled)
        for t in pumps:
            t.join(30)
        assert not any(t.is_alive() for t in pumps)
        assert behind > 0, "the handler was not behind: the check would prove nothing"
        assert len(handled) == 200, f"{len(handled)} of 200 lines handed on"
    finally:
        (tmp_path / "stop").touch()
        launcher.shutdown()
    assert _pids_with_marker(launcher.marker) == []


@pytest.mark.timeout(60)
def test_cli_rejects_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bad flags exit 2 with a clear message and start nothing: the first case through the
    real command line, the others through the same entry point in this process (each
    ``python -m torchft.launch`` spends seconds importing torch before it reads its flags)."""
    script = tmp_path / "w.py"
    script.write_text("pass\n")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "")
    r = subprocess.run(
        [sys.executable, "-m", "torchft.launch", "--replicas", "0", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2, r
    assert "--replicas must be at least 1" in r.stderr
    for args, msg in [
        (["--replicas", "2", str(tmp_path / "missing.py")], "does not exist"),
        (["--replicas", "2", "--min-replicas", "3", str(script)], "--min-replicas"),
        (["--replicas", "2", "--standby", "-1", str(script)], "--standby must be >= 0"),
        (["--replicas", "2", "--preload", "numpy", str(script)], "--preload needs --standby"),
        (
            ["--replicas", "2", "--standby", "1", "--preload", "not a module", str(script)],
            "module names",
        ),
    ]:
        assert launch_main(args) == 2, args
        assert msg in capsys.readouterr().err, args


RESTARTED_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch
    from torchft import Manager, ProcessGroupGloo

    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if restart == 1 and rank == 0:
        time.sleep(3)  # rank 1 looks the manager up first, while the dead one's entry exists
    m = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        replica_id="torchrun_group",
        timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=30),
    )
    if restart == 0:
        time.sleep(1)
        if rank == 1:
            os._exit(3)  # the agent stops rank 0 and restarts both
        time.sleep(120)
    m.start_quorum()
    t = torch.ones(1)
    m.allreduce(t).wait()
    assert m.should_commit(), m.errored()
    print(f"rank {rank} restart {restart} committed step {m.current_step()}", flush=True)
    m.shutdown()
    """
)


@pytest.mark.timeout(180)
def test_worker_restarted_inside_torchrun_finds_the_new_manager(tmp_path: Path) -> None:
    """torchrun restarts a dead worker inside its agent (no new pod, no second torch import
    for the agent); the restarted ranks find the new incarnation's manager server, not the
    dead one's address left in the agent's store, and commit."""
    from torchft._torchft import LighthouseServer

    script = tmp_path / "worker.py"
    script.write_text(RESTARTED_WORKER)
    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--log-dir",  # else the agent leaves a directory in the system temp dir
                str(tmp_path / "torchrun"),
                "--standalone",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                "--monitor-interval",
                "0.1",
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=170,
            env=dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(), OMP_NUM_THREADS="1"),
            start_new_session=True,
        )
    finally:
        lighthouse.shutdown()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0 restart 1 committed step 1" in out
    assert "rank 1 restart 1 committed step 1" in out
