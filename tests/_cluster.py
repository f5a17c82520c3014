"""Replica-group processes for end-to-end tests: start, SIGKILL, watch, collect results.

Each replica group is one or more worker processes (tests/_ft_worker.py) with their own
TCPStore (created here, as torchrun would). Every process started is killed on close().
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

WORKER = str(Path(__file__).with_name("_ft_worker.py"))
REPO_PYTHON = str(Path(__file__).resolve().parent.parent / "python")


@dataclass
class Group:
    """One incarnation of a replica group: its store and its rank processes."""

    name: str
    incarnation: int
    store: TCPStore
    procs: list[subprocess.Popen[bytes]]
    progress: list[Path]
    results: list[Path]
    logs: list[Path]

    def steps(self) -> list[int]:
        """Committed step reported by each rank (-1 before the first report)."""
        out = []
        for p in self.progress:
            try:
                out.append(json.loads(p.read_text())["step"])
            except (FileNotFoundError, json.JSONDecodeError):
                out.append(-1)
        return out


@dataclass
class Cluster:
    """Starts, kills and watches replica-group processes; kills everything on teardown."""

    tmp: Path
    lighthouse_addr: str
    groups: list[Group] = field(default_factory=list)

    @property
    def stop_file(self) -> Path:
        return self.tmp / "stop"

    def start(
        self,
        name: str,
        *,
        ranks: int = 1,
        sync: bool = False,
        seed: int = 0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Group:
        """Starts an incarnation of replica group ``name`` with ``ranks`` processes
        (``env``: extra environment of every rank)."""
        incarnation = sum(1 for g in self.groups if g.name == name)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs, progress, results, logs = [], [], [], []
        for rank in range(ranks):
            tag = f"{name}_{incarnation}_r{rank}"
            proc_env = dict(os.environ)
            proc_env.update(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(ranks),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port),
                    "TORCHFT_LIGHTHOUSE": self.lighthouse_addr,
                    "PYTHONPATH": REPO_PYTHON + os.pathsep + proc_env.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1",
                    **(env or {}),
                }
            )
            cmd = [
                sys.executable,
                WORKER,
                "--replica-id",
                name,
                "--progress",
                str(self.tmp / f"{tag}.progress"),
                "--stop",
                str(self.stop_file),
                "--result",
                str(self.tmp / f"{tag}.result"),
                "--seed",
                str(seed),
            ]
            if sync:
                cmd.append("--sync")
            cmd += extra or []
            log = self.tmp / f"{tag}.log"
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(cmd, env=proc_env, stdout=out, stderr=subprocess.STDOUT)
                )
            progress.append(self.tmp / f"{tag}.progress")
            results.append(self.tmp / f"{tag}.result")
            logs.append(log)
        group = Group(name, incarnation, store, procs, progress, results, logs)
        self.groups.append(group)
        return group

    def kill(self, group: Group) -> None:
        """SIGKILLs every process of ``group`` and reaps them."""
        for p in group.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in group.procs:
            p.wait(timeout=10)

    def wait_until(self, cond: Any, timeout: float, what: str) -> None:
        """Polls ``cond()`` until true; fails (with logs) on timeout or a crashed worker."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            for g in self.live():
                for p in g.procs:
                    if p.poll() not in (None, 0):
                        self.fail(f"worker of {g.name} exited with {p.returncode} ({what})")
            time.sleep(0.05)
        self.fail(f"timed out after {timeout}s waiting for {what}")

    def live(self) -> list[Group]:
        """Groups that were not killed (their latest incarnation)."""
        latest: dict[str, Group] = {}
        for g in self.groups:
            latest[g.name] = g
        return [g for g in latest.values() if all(p.returncode != -signal.SIGKILL for p in g.procs)]

    def stop_at(self, target: int) -> None:
        """Tells every worker to exit once it committed ``target`` steps."""
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text(str(target))
        os.replace(tmp, self.stop_file)

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        """Waits for the live groups to exit cleanly and returns their result files."""
        deadline = time.monotonic() + timeout
        for g in self.live():
            for p in g.procs:
                left = max(0.1, deadline - time.monotonic())
                try:
                    rc = p.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    self.fail(f"{g.name} did not stop in time")
                if rc != 0:
                    self.fail(f"{g.name} exited with {rc}")
        return [json.loads(r.read_text()) for g in self.live() for r in g.results]

    def fail(self, msg: str) -> None:
        tails = []
        for g in self.groups:
            for log in g.logs:
                text = log.read_text(errors="replace") if log.exists() else ""
                tails.append(f"--- {log.name} ---\n" + "\n".join(text.splitlines()[-25:]))
        pytest.fail(msg + "\n" + "\n".join(tails), pytrace=False)

    def close(self) -> None:
        for g in self.groups:
            for p in g.procs:
                if p.poll() is None:
                    p.kill()
            for p in g.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
