"""What the benchmarks share: the MLP replica group the per-step ones train, the launch of
two groups as separate processes against one in-process lighthouse, a lighthouse in a
process of its own, and a percentile.

A benchmark script runs itself with ``worker ...`` arguments in each process; the worker
builds its group with :func:`train_group` and writes its timings to its ``--result`` file.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

REPO_PYTHON = str(Path(__file__).resolve().parent.parent / "python")


def train_group(replica_id: str, hidden: int, **manager_kwargs: Any) -> tuple[Any, Any, Any]:
    """One replica group's MLP (256 -> H -> H -> 10) with Manager, torchft DDP and AdamW on
    Gloo (state registered for healing); returns ``(manager, ddp, optimizer)``."""
    import torch
    from torch import nn

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        replica_id=replica_id,
        **manager_kwargs,
    )
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    return manager, ddp, optim


def run_two_groups(
    script: Path, worker_args: list[str], timeout_s: float, extra_env: dict[str, str] | None = None
) -> list[Any]:
    """Runs ``script worker --replica-id gI --result FILE *worker_args`` for two groups (one
    process each, their own TCPStore, ``RANK_SEED`` = I, ``extra_env`` added to this process's
    environment) against an in-process lighthouse, and returns what each wrote to its result
    file (JSON). Raises RuntimeError if a worker failed; no process outlives the call."""
    from torch.distributed import TCPStore

    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=2, join_timeout_ms=1000)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as d:
        results = [Path(d) / f"g{i}.json" for i in range(2)]
        stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in "ab"]
        try:
            for i in range(2):
                env = dict(os.environ)
                env.update(
                    {
                        "RANK": "0",
                        "WORLD_SIZE": "1",
                        "RANK_SEED": str(i),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(stores[i].port),
                        "TORCHFT_LIGHTHOUSE": lighthouse.address(),
                        "PYTHONPATH": REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", ""),
                        "OMP_NUM_THREADS": "1",
                        **(extra_env or {}),
                    }
                )
                cmd = [sys.executable, str(script), "worker", "--replica-id", f"g{i}"]
                cmd += ["--result", str(results[i]), *worker_args]
                procs.append(subprocess.Popen(cmd, env=env))
            for p in procs:
                if p.wait(timeout=timeout_s) != 0:
                    raise RuntimeError(f"worker exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            lighthouse.shutdown()
        return [json.loads(r.read_text()) for r in results]


def percentile(samples: list[float], q: float) -> float:
    """The q-quantile (0..1) of samples, nearest-rank."""
    ordered = sorted(samples)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


@contextlib.contextmanager
def lighthouse_process(
    script: str, env: dict[str, str], errors: IO[str], role: str = "lighthouse"
) -> Iterator[str]:
    """Runs ``script --role ROLE`` (which prints its address, then serves until its stdin
    closes) with ``env`` and its stderr into ``errors``; yields the address. Raises
    RuntimeError, with the end of its stderr, if it reports none. On exit its stdin is
    closed and it is waited for (killed after 10 s)."""
    lh = subprocess.Popen(
        [sys.executable, script, "--role", role],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env=env,
    )
    try:
        assert lh.stdout is not None
        address = lh.stdout.readline().strip()
        if not address:
            lh.wait(10)
            errors.seek(0)
            raise RuntimeError(
                f"the {role} process did not report its address:\n{errors.read()[-2000:]}"
            )
        yield address
    finally:
        if lh.stdin is not None:
            lh.stdin.close()
        try:
            lh.wait(10)
        except subprocess.TimeoutExpired:
            lh.kill()
            lh.wait()
