"""Survivor gap after a peer's failure: how long training stalls when a replica group dies.

Each trial starts two one-rank replica groups (real processes: tests/_ft_worker.py, Manager +
DDP + AdamW on Gloo, CPU) against an in-process lighthouse, waits until they train together,
then at a random point of a step either SIGKILLs one group (a death: noticed from its broken
session at once) or SIGSTOPs it (a hang: noticed when its heartbeat expires). The measure is
the survivor's longest gap between committed steps around the fault, reported as median and
max over the trials next to the configured heartbeat timeout.

Targets: SIGKILL ≤ 1 s; SIGSTOP ≤ heartbeat timeout + 1 s (the exit status is non-zero if a
trial misses its target).

Usage: ``python benches/failure_gap.py [--trials 10] [--heartbeat-timeout 5] [--json]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from torchft._torchft import LighthouseServer

logger: logging.Logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "_ft_worker.py")
KILL_TARGET_S = 1.0
STOP_SLACK_S = 1.0


def _read_step(path: Path) -> int:
    """Committed step in a worker's progress file (-1 before the first)."""
    try:
        return int(json.loads(path.read_text())["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return -1


def _wait(cond: Any, timeout: float, what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Polls ``cond()`` until true; raises on timeout or when a worker exits with an error."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        for p in procs:
            if p.poll() not in (None, 0, -signal.SIGKILL):
                raise RuntimeError(f"a worker exited with {p.returncode} ({what})")
        time.sleep(0.02)


def trial(mode: str, heartbeat_timeout_s: float, tmp: Path) -> float:
    """Runs one trial; returns the survivor's gap (seconds) around the fault.

    Args:
        mode: ``"kill"`` (SIGKILL) or ``"stop"`` (SIGSTOP, then SIGKILL at the end).
        heartbeat_timeout_s: the lighthouse's heartbeat timeout.
        tmp: an empty directory for the workers' files.

    Returns:
        Seconds from the survivor's last commit before the fault to its first after it.
    """
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=1000,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    procs: list[subprocess.Popen[bytes]] = []
    stores = []
    stop_file = tmp / "stop"
    try:
        for i in range(2):
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            stores.append(store)
            env = dict(os.environ)
            env.update(
                {
                    "RANK": "0",
                    "WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port),
                    "TORCHFT_LIGHTHOUSE": lighthouse.address(),
                    "PYTHONPATH": str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1",
                }
            )
            cmd = [
                sys.executable,
                WORKER,
                "--replica-id",
                f"rg{i}",
                "--progress",
                str(tmp / f"rg{i}.progress"),
                "--stop",
                str(stop_file),
                "--result",
                str(tmp / f"rg{i}.result"),
                "--seed",
                str(i),
                "--step-sleep",
                "0.02",
            ]
            with open(tmp / f"rg{i}.log", "wb") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        survivor, victim = procs
        s_prog, v_prog = tmp / "rg0.progress", tmp / "rg1.progress"
        _wait(lambda: min(_read_step(s_prog), _read_step(v_prog)) >= 10, 120, "start", procs)
        time.sleep(random.uniform(0.0, 0.15))
        fault = time.time()
        victim.send_signal(signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        at = _read_step(s_prog)
        _wait(lambda: _read_step(s_prog) >= at + 10, 120, "survivor to go on", procs)
        if mode == "stop":
            victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        target = _read_step(s_prog) + 3
        tmp_stop = stop_file.with_suffix(".tmp")
        tmp_stop.write_text(str(target))
        os.replace(tmp_stop, stop_file)
        if survivor.wait(timeout=120) != 0:
            raise RuntimeError(f"survivor exited with {survivor.returncode}")
        result = json.loads((tmp / "rg0.result").read_text())
        times = sorted(t for _, t in result["commit_times"])
        before = [t for t in times if t <= fault]
        after = [t for t in times if t > fault]
        return after[0] - (before[-1] if before else fault)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("worker %d did not exit", p.pid)
        lighthouse.shutdown()


def main() -> int:
    """Runs the trials and prints the table; non-zero exit if a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds")
    parser.add_argument("--json", action="store_true", help="print the samples as JSON too")
    args = parser.parse_args()
    hb = args.heartbeat_timeout
    samples: dict[str, list[float]] = {"kill": [], "stop": []}
    for mode in ("kill", "stop"):
        for i in range(args.trials):
            with tempfile.TemporaryDirectory() as d:
                gap = trial(mode, hb, Path(d))
            samples[mode].append(gap)
            print(f"  {mode} trial {i + 1}/{args.trials}: survivor gap {gap:.3f}s", flush=True)
    targets = {"kill": KILL_TARGET_S, "stop": hb + STOP_SLACK_S}
    names = {"kill": "SIGKILL (death)", "stop": "SIGSTOP (hang)"}
    print(f"\nsurvivor gap between committed steps, {args.trials} trials each")
    print(f"{'fault':<18}{'heartbeat_timeout':>18}{'median':>10}{'max':>10}{'target':>10}  ok")
    ok = True
    for mode, gaps in samples.items():
        good = max(gaps) <= targets[mode]
        ok &= good
        print(
            f"{names[mode]:<18}{hb:>17.1f}s{statistics.median(gaps):>9.3f}s"
            f"{max(gaps):>9.3f}s{targets[mode]:>9.1f}s  {'yes' if good else 'NO'}"
        )
    if args.json:
        print(json.dumps({"heartbeat_timeout_s": hb, "gaps_s": samples}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
