"""Warm standby processes: a spare takes a dead process's identity, dead spares are replaced,
bad input fails at once, and nothing is left behind (real processes throughout)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from test_launch import started, wait_for

from torchft.chaos.history import _alive as alive
from torchft.launch import Launcher, _pids_with_marker
from torchft.standby import StandbyError, StandbyPool

SCRIPT = textwrap.dedent(
    """
    import os, sys
    warm = "torch" in sys.modules and "torch._dynamo" in sys.modules
    print("argv", sys.argv[1:], "env", os.environ.get("WHO"), "cwd", os.getcwd(),
          "warm", warm, "path0", sys.path[0], "big", len(os.environ.get("BIG", "")), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("CODE", "0")))
    """
)


@pytest.mark.timeout(120)
def test_pool_promotes_replaces_dead_spares_and_leaves_none(tmp_path: Path) -> None:
    """A promoted spare runs the script with exactly the given argv, environment and working
    directory (torch already imported), its exit status is the script's; a spare killed
    before promotion is replaced; close() kills the rest."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    pool = StandbyPool(1, env=dict(os.environ))
    pool.start()
    try:
        pool.wait_ready(90)
        spare = pool.take()
        assert spare is not None
        assert pool.take() is None  # its replacement is still warming
        env = {"WHO": "rank-3", "CODE": "7", "PATH": os.environ.get("PATH", "")}
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
        proc = pool.promote(spare, [str(script), "--x", "1"], env, cwd=str(tmp_path))
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 7
        assert f"argv ['--x', '1'] env rank-3 cwd {tmp_path} warm True path0 {tmp_path}" in out
        assert "to stderr" in out

        # The replacement warms; killing it before promotion gets it replaced again.
        pool.wait_ready(90)
        [victim] = pool.pids()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: pool.replaced == 1 and victim not in pool.pids(), 30, "replacement")
        pool.wait_ready(90)
        spares = pool.pids()
        assert len(spares) == 1 and spares[0] != victim
    finally:
        pool.close()
    assert pool.pids() == []
    assert not any(alive(p) for p in spares)


@pytest.mark.timeout(120)
def test_pool_output_file_and_bad_promotion(tmp_path: Path) -> None:
    """A promotion may send the script's output to a file; a promotion naming no script is
    refused by the spare with a clear message."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    log = tmp_path / "out.log"
    pool = StandbyPool(1, env=dict(os.environ))
    pool.start()
    try:
        pool.wait_ready(90)
        spare = pool.take()
        assert spare is not None
        proc = pool.promote(spare, [str(script)], dict(os.environ, WHO="file"), output=str(log))
        assert proc.wait(60) == 0
        text = log.read_text()
        assert "env file" in text and "to stderr" in text

        pool.wait_ready(90)
        spare = pool.take()
        assert spare is not None
        proc = pool.promote(spare, [str(tmp_path / "missing.py")], dict(os.environ))
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 4
        assert "missing.py" in out and "does not exist" in out

        # A promotion that is not JSON, or lacks its fields, is refused the same way.
        for garbage in ("not json\n", '{"argv": []}\n'):
            pool.wait_ready(90)
            spare = pool.take()
            assert spare is not None and spare.proc.stdin is not None
            spare.proc.stdin.write(garbage)
            spare.proc.stdin.close()
            spare.proc.stdin = None
            out, _ = spare.proc.communicate(timeout=60)
            assert spare.proc.returncode == 4, out
            assert "promotion" in out
    finally:
        pool.close()


@pytest.mark.timeout(150)
def test_a_spare_still_warming_can_be_promoted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With none ready, ``take(warming=True)`` hands over the spare that has warmed longest.
    Its promotion returns at once, even with an identity larger than a pipe holds, and the
    spare runs it once warm; its output after ``released`` is the script's only
    (the ``ready`` line stays with the pool), with an output file too; a warming spare that
    dies after its promotion ends as a failed process, and its owner is not left waiting."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    log = tmp_path / "out.log"
    caplog.set_level(logging.INFO, logger="torchft.standby")
    pool = StandbyPool(2, env=dict(os.environ))
    pool.start()
    try:
        assert pool.take() is None  # nothing is ready this early
        first = pool.take(warming=True)
        second = pool.take(warming=True)
        assert first is not None and second is not None
        assert not first.ready.is_set() and not second.ready.is_set()
        assert first.spawned <= second.spawned  # the one that has warmed longest goes first
        env = dict(os.environ, WHO="warming")

        # Promoted while warming, killed before it was ready: it ends killed, released.
        doomed = pool.take(warming=True)  # a replacement, spawned just now
        assert doomed is not None and not doomed.ready.is_set()
        victim = pool.promote(doomed, [str(script)], env)
        victim.kill()
        assert victim.wait(30) == -signal.SIGKILL
        assert doomed.released.wait(30) and not doomed.ready.is_set()
        # Killed by a signal: noted, not warned about.
        said = f"standby process {victim.pid}, promoted while warming, ended (exit -9)"
        wait_for(lambda: any(said in r.getMessage() for r in caplog.records), 10, "the note")
        assert all(r.levelno == logging.INFO for r in caplog.records if said in r.getMessage())

        # An identity larger than a pipe holds (a big environment) does not hold the owner
        # until the spare is warm enough to read it.
        big = dict(env, BIG="x" * 300_000)
        proc = pool.promote(first, [str(script), "--w"], big, cwd=str(tmp_path))
        assert not first.ready.is_set(), "the promotion waited for the spare to warm"
        filed = pool.promote(second, [str(script)], dict(env, WHO="filed"), output=str(log))
        assert first.released.wait(90)
        assert proc.stdout is not None
        out = proc.stdout.read()
        assert proc.wait(60) == 0
        assert f"argv ['--w'] env warming cwd {tmp_path} warm True" in out
        assert "big 300000" in out
        assert "ready" not in out.split()
        assert filed.wait(90) == 0
        assert second.released.is_set() and filed.stdout is None  # closed once released
        assert "env filed" in log.read_text()
    finally:
        pool.close()
    assert pool.pids() == []


@pytest.mark.timeout(60)
def test_pool_gives_up_when_spares_keep_dying_before_ready() -> None:
    """Spares that cannot start (here: an interpreter that exits at once) are respawned a
    few times, then the pool stops and says why instead of churning forever."""
    pool = StandbyPool(1, python="/bin/false")
    pool.start()
    try:
        with pytest.raises(StandbyError, match="5 standby processes in a row died"):
            pool.wait_ready(50)
        assert pool.pids() == []
        assert pool.take() is None
    finally:
        pool.close()


def test_bad_arguments_are_refused() -> None:
    from torchft.chaos import ChaosConfig

    with pytest.raises(ValueError, match="--standby must be >= 0"):
        StandbyPool(-1)
    with pytest.raises(ValueError, match="standby must be >= 0"):
        ChaosConfig(seed=1, standby=-1).validate()
    with pytest.raises(ValueError, match="module names"):
        StandbyPool(1, preload=["not a module"])


@pytest.mark.timeout(120)
def test_launch_fails_at_once_on_a_preload_that_does_not_import(tmp_path: Path) -> None:
    """``--preload`` of a module that does not import fails the launch with a clear error
    naming it, before any group starts; no process is left."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    marker = f"TORCHFT_TEST_MARKER_{os.getpid()}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchft.launch",
            "--replicas",
            "1",
            "--standby",
            "1",
            "--preload",
            "torchft_no_such_module",
            "--lighthouse",
            "http://127.0.0.1:9",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, **{marker: "1"}),
    )
    assert proc.returncode == 2, proc.stderr
    assert "torchft_no_such_module" in proc.stderr
    assert "failed to import" in proc.stderr
    assert "must not run" not in proc.stdout + proc.stderr
    needle = f"{marker}=1".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    assert needle not in f.read().split(b"\0"), f"process {entry} left behind"
            except OSError:
                pass


WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    warm = "torch._dynamo" in sys.modules
    import torch.distributed as dist
    d = Path(sys.argv[1])
    g, rank = os.environ["REPLICA_GROUP_ID"], os.environ["RANK"]
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    # torchrun's contract: env:// rendezvous through the agent's store.
    dist.init_process_group("gloo", world_size=int(os.environ["WORLD_SIZE"]), rank=int(rank))
    import torch
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == int(os.environ["WORLD_SIZE"])
    (d / f"started_{g}_{rank}_{restart}_{'warm' if warm else 'cold'}_{os.getpid()}").touch()
    print(f"worker up {g} {rank} {restart}", flush=True)
    while not (d / "stop").exists():
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(240)
def test_launch_replaces_a_dead_groups_ranks_with_warm_spares(tmp_path: Path) -> None:
    """Two groups of two ranks with two spares: SIGKILL of one rank of group 1 stops its
    other rank and starts both on warm spares (restart count 1, torchrun's environment,
    a working Gloo rendezvous); group 0 is untouched; nothing survives the launcher."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    launcher = Launcher(
        str(script),
        [str(tmp_path)],
        replicas=2,
        nproc_per_node=2,
        max_restarts=3,
        lighthouse="http://127.0.0.1:9",  # the worker never dials it
        on_line=lambda g, line: lines.append((g, line.strip())),
        standby=2,
    )
    lines: list[tuple[int, str]] = []
    code: list[int] = []
    spare_pids: list[int] = []
    try:
        launcher.start()
        runner = threading.Thread(target=lambda: code.append(launcher.run(timeout=200)))
        runner.start()
        wait_for(
            lambda: len(started(tmp_path, 0)) == 2 and len(started(tmp_path, 1)) == 2,
            120,
            "both groups",
        )
        # The first incarnation used the two spares ready at start (any mix is fine); wait
        # for two warm spares again before the fault.
        wait_for(lambda: launcher.pool.ready_count() == 2, 120, "spares to warm again")
        first = started(tmp_path, 1)
        killed = launcher.group_pids(1)
        assert len(killed) == 2
        os.kill(killed[1], signal.SIGKILL)  # rank 1 only: the launcher stops rank 0
        wait_for(lambda: len(started(tmp_path, 1)) == 4, 120, "group 1 restart")
        again = sorted(set(started(tmp_path, 1)) - set(first))
        assert [n.split("_")[2:4] for n in again] == [["0", "1"], ["1", "1"]]
        assert all("_warm_" in n for n in again), again
        assert launcher.groups[1].restarts == 1 and launcher.groups[1].warm == 2
        assert launcher.groups[0].restarts == 0
        assert len(started(tmp_path, 0)) == 2, "group 0 must not have been restarted"

        # A promoted spare that crashes is a crash like any other: the group restarts again.
        wait_for(lambda: launcher.pool.ready_count() == 2, 120, "spares to warm again")
        os.kill(launcher.group_pids(1)[0], signal.SIGKILL)
        wait_for(lambda: len(started(tmp_path, 1)) == 6, 120, "group 1 second restart")
        assert launcher.groups[1].restarts == 2 and launcher.groups[1].warm == 2

        # At once again, while the spares that replaced those two are still warming: the
        # restart takes them as they are (ahead of a cold start), and the ranks' output
        # still reaches the launcher, without the spares' own "ready" lines.
        assert launcher.pool.ready_count() == 0
        os.kill(launcher.group_pids(1)[0], signal.SIGKILL)
        wait_for(lambda: len(started(tmp_path, 1)) == 8, 120, "group 1 third restart")
        assert launcher.groups[1].restarts == 3 and launcher.groups[1].warm == 2
        third = sorted(n for n in started(tmp_path, 1) if n.split("_")[3] == "3")
        assert [n.split("_")[2] for n in third] == ["0", "1"], third
        assert all("_warm_" in n for n in third), third
        wait_for(
            lambda: {(1, "worker up 1 0 3"), (1, "worker up 1 1 3")} <= set(lines),
            30,
            "the third incarnation's output",
        )
        assert (1, "ready") not in lines
        spare_pids = launcher.pool.pids()
        (tmp_path / "stop").touch()
        runner.join(120)
        assert code == [0]
    finally:
        (tmp_path / "stop").touch()
        launcher.shutdown()
    assert _pids_with_marker(launcher.marker) == []
    assert not any(alive(p) for p in spare_pids + killed)
