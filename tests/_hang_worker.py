"""One replica group (one rank) whose training loop can be made to hang, or whose parameters
can be corrupted, for the hang and state parity tests.

Trains a small MLP with the Manager, DDP and AdamW on Gloo until it has committed the step
written in ``--target-file`` (once that file exists), appending a JSON line per commit to ``--history`` (step, participants, state hash,
time). When the file ``--hang-file`` exists at the top of a step, the loop blocks (as a
stuck input pipeline would) for the seconds the file holds, while the process and its
manager server live on; the file is removed first, so the hang happens once. At the end the
final state's hash is written as a ``finished`` line.

While the file ``--slow-file`` exists, every step sleeps the seconds it holds before its
forward pass (a slow machine: the group keeps taking part, late).

When the file ``--flip-file`` exists at the top of a step (removed first), one bit of the
first parameter is flipped in memory, as bad memory would, and a ``flip`` line is written.
If the parity check stops the group (``StateDivergedError``), a ``stopped`` line is written
and the process exits with :data:`DIVERGED_EXIT`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore

from torchft import (
    DistributedDataParallel,
    Manager,
    Optimizer,
    ProcessGroupGloo,
    StateDivergedError,
)
from torchft.chaos.history import state_hash

#: Exit code after the parity check stopped the group.
DIVERGED_EXIT = 77


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replica-id", required=True)
    p.add_argument("--history", required=True)
    p.add_argument("--hang-file", required=True)
    p.add_argument("--target-file", required=True)
    p.add_argument("--flip-file", default=None)
    p.add_argument("--slow-file", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=120),
        replica_id=args.replica_id,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
    )
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    with open(args.history, "a") as history:

        def record(**line: object) -> None:
            history.write(json.dumps({"pid": os.getpid(), "t": time.time(), **line}) + "\n")
            history.flush()

        while True:
            try:
                with open(args.target_file) as f:
                    if manager.current_step() >= int(f.read()):
                        break
            except (FileNotFoundError, ValueError):
                pass
            seconds = None
            try:
                with open(args.hang_file) as f:
                    seconds = float(f.read())
            except (FileNotFoundError, ValueError):
                pass  # no hang asked for, or the file is being written: read at the next step
            if seconds is not None:
                os.remove(args.hang_file)
                record(hang=seconds, step=manager.current_step())
                time.sleep(seconds)  # the loop is stuck; heartbeats go on
                record(hang_over=True, step=manager.current_step())
            if args.flip_file and os.path.exists(args.flip_file):
                os.remove(args.flip_file)
                with torch.no_grad():
                    bits = model[0].weight.view(-1).view(torch.int32)
                    bits[3] ^= 1 << 4  # a low mantissa bit: training goes on, state differs
                record(flip=True, step=manager.current_step())
            optim.zero_grad()
            if args.slow_file:
                try:
                    with open(args.slow_file) as f:
                        time.sleep(float(f.read()))
                except (OSError, ValueError):
                    pass  # not slow (or the file is being written)
            gen = torch.Generator().manual_seed(manager.current_step())
            x = torch.randn(32, 16, generator=gen)
            y = torch.randint(0, 4, (32,), generator=gen)
            nn.functional.cross_entropy(ddp(x), y).backward()
            before = manager.current_step()
            try:
                optim.step()
            except StateDivergedError as e:
                record(stopped=str(e), step=manager.current_step())
                manager.shutdown(wait=False)
                raise SystemExit(DIVERGED_EXIT) from e
            if manager.current_step() == before + 1:
                record(
                    step=before + 1,
                    participants=manager.num_participants(),
                    state=state_hash(model.state_dict(), optim.state_dict()),
                )
            time.sleep(0.02)
        record(
            finished=manager.current_step(),
            state=state_hash(model.state_dict(), optim.state_dict()),
        )
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
