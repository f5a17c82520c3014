"""One replica group of a chaos run (one rank): trains a small MLP and records its history.

Run by :mod:`torchft.chaos.harness` as ``python -m torchft.chaos.worker``; the store, the
lighthouse and the group name come from the environment as under torchrun (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHFT_LIGHTHOUSE``).

The history (see :mod:`torchft.chaos.history`) gets one JSON line per committed step: step,
quorum id, participants, a hash of the parameters and optimizer state, and the wall time; a
``finish`` line at the target step (written to ``--target-file`` by the harness). ``--phase`` is a one-byte file the worker overwrites
with its phase (``q`` quorum/compute, ``c`` commit vote) so faults can aim at a phase.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.chaos.history import RESTART_EXIT, HistoryWriter, state_hash
from torchft.manager import TornStateError

_IMPORTED = time.time()


def _read_target(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _hang(path: str, history: HistoryWriter, step: int) -> None:
    """Blocks the training loop as a stuck input pipeline would (the process lives on)."""
    try:
        with open(path) as f:
            seconds = float(f.read())
        os.remove(path)
    except (OSError, ValueError):
        return  # being written, or taken already: the next step looks again
    history.hang(seconds, step)
    time.sleep(seconds)


def main(argv: list[str] | None = None) -> int:
    """Trains until the step in ``--target-file``; returns 0 when it got there."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", required=True)
    p.add_argument("--history", required=True)
    p.add_argument("--phase", required=True)
    p.add_argument("--target-file", required=True, help="holds the step to stop at, once set")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument(
        "--hang-file",
        default=None,
        help="when this file exists at the top of a step, the loop blocks for the seconds it "
        "holds (removed first), while the process and its heartbeats live on",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="level of the worker's own log lines (stderr, kept in the run directory)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {args.group} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=args.min_replicas,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30),
        replica_id=args.group,
    )
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    history = HistoryWriter(args.history, args.group, os.getpid())
    history.ready(imported=_IMPORTED)
    phase = os.open(args.phase, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            target = _read_target(args.target_file)
            if target is not None and manager.current_step() >= target:
                break
            if args.hang_file and os.path.exists(args.hang_file):
                _hang(args.hang_file, history, manager.current_step())
            os.pwrite(phase, b"q", 0)
            optim.zero_grad()
            # The data of a step depends only on the step: any group may take any step.
            gen = torch.Generator().manual_seed(manager.current_step())
            x = torch.randn(32, 16, generator=gen)
            y = torch.randint(0, 4, (32,), generator=gen)
            nn.functional.cross_entropy(ddp(x), y).backward()
            os.pwrite(phase, b"c", 0)
            before = manager.current_step()
            optim.step()
            if manager.current_step() == before + 1:
                history.commit(
                    step=before + 1,
                    quorum_id=manager._quorum_id,
                    participants=manager.num_participants(),
                    state=state_hash(model.state_dict(), optim.state_dict()),
                )
            if args.step_sleep:
                time.sleep(args.step_sleep)
        history.finish(manager.current_step(), state_hash(model.state_dict(), optim.state_dict()))
    except TornStateError as e:
        # What a supervisor is for: the harness restarts a process that exits with this.
        logging.getLogger(__name__).error("%s", e)
        return RESTART_EXIT
    finally:
        os.close(phase)
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
