"""Heals between a replica group running upstream torchft 0.2.0 and one running this package,
both ways, for LocalSGD and streaming DiLoCo, on this package's lighthouse.

Upstream torchft is taken from ``<repo>/.venv/upstream`` (a ``pip install --target`` of the
published wheel and its dependencies); the tests skip when it is not there. Each group is a
process running ``tests/_local_sgd_worker.py`` with its own store; the first trains alone,
the second starts late and heals from it, then both train on and must end bit-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
UPSTREAM = REPO / ".venv" / "upstream"
WORKER = str(TESTS / "_local_sgd_worker.py")
STEPS = 5

pytestmark = pytest.mark.skipif(
    not (UPSTREAM / "torchft").is_dir(),
    reason=f"upstream torchft 0.2.0 is not installed at {UPSTREAM}",
)


@pytest.fixture
def lighthouse() -> Iterator[Any]:
    """This package's lighthouse on [::]:0 (min_replicas=1), shut down after the test."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=10)
    try:
        yield server
    finally:
        server.shutdown()


class _Groups:
    """Starts worker processes and kills every one of them at the end, also on failure."""

    def __init__(self, tmp: Path, lighthouse_addr: str) -> None:
        self.tmp = tmp
        self.lighthouse_addr = lighthouse_addr
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.stores: list[TCPStore] = []

    def start(self, build: str, name: str, mode: str, seed: int, extra: list[str]) -> Path:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        first = UPSTREAM if build == "upstream" else REPO / "python"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(first), env.get("PYTHONPATH")) if p)
        result = self.tmp / f"{name}.pt"
        log = self.tmp / f"{name}.log"
        cmd = [
            sys.executable,
            WORKER,
            "--mode",
            mode,
            "--replica-id",
            name,
            "--lighthouse",
            self.lighthouse_addr,
            "--store-port",
            str(store.port),
            "--folder",
            str(self.tmp / f"{name}_ckpt"),
            "--result",
            str(result),
            "--steps",
            str(STEPS),
            "--seed",
            str(seed),
            *extra,
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, cwd=self.tmp, stdout=out, stderr=subprocess.STDOUT
            )
        self.procs.append((name, proc, log))
        return result

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name, proc, _ in self.procs:
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"{name} did not finish within {timeout}s")
            if rc != 0:
                self.fail(f"{name} exited with {rc}")

    def fail(self, msg: str) -> None:
        tails = []
        for name, _, log in self.procs:
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            tails.append(f"--- {name} ---\n" + "\n".join(lines[-30:]))
        pytest.fail(msg + "\n" + "\n".join(tails), pytrace=False)

    def close(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.mark.timeout(55)
@pytest.mark.parametrize("mode", ["localsgd", "diloco"])
@pytest.mark.parametrize(
    ("first", "late"),
    [("upstream", "ours"), ("ours", "upstream")],
    ids=["up-heals-ours", "ours-heals-up"],
)
def test_late_group_heals_across_builds(
    tmp_path: Path, lighthouse: Any, mode: str, first: str, late: str
) -> None:
    """A group of one build heals from a group of the other and both end bit-identical."""
    ready = tmp_path / "late_ready"
    paused = tmp_path / "first_paused"
    groups = _Groups(tmp_path, lighthouse.address())
    try:
        first_result = groups.start(
            first,
            "first0",
            mode,
            seed=1,
            extra=["--pause-at", "2", "--paused", str(paused), "--wait-for", str(ready)],
        )
        late_result = groups.start(
            late,
            "late1",
            mode,
            seed=2,
            extra=["--start-after", str(paused), "--ready", str(ready)],
        )
        groups.wait(timeout=45)
        a = torch.load(first_result, weights_only=True)
        b = torch.load(late_result, weights_only=True)
    finally:
        groups.close()

    assert a["step"] == b["step"] == STEPS
    assert b["steps_seen"][0] == 0 and b["steps_seen"][1] >= 2, (
        f"the late group healed past the first one's step 2: saw steps {b['steps_seen']}"
    )
    if mode == "localsgd":
        # LocalSGD's state is the user's model: averaged at every sync, identical after it.
        assert a["fragments"] == {} and b["fragments"] == {}
        for p, q in zip(a["params"], b["params"], strict=True):
            assert torch.equal(p, q)
    else:
        # Both builds register the same keys and layout; the global state is identical.
        assert (
            sorted(a["fragments"])
            == sorted(b["fragments"])
            == [
                "StreamingDiLoCoFragment_0",
                "StreamingDiLoCoFragment_1",
            ]
        )
        for key in a["fragments"]:
            fa, fb = a["fragments"][key], b["fragments"][key]
            assert sorted(fa) == sorted(fb) == ["original_parameters", "outer_optimizer"]
            torch.testing.assert_close(fa, fb, rtol=0, atol=0)
