"""Fault-tolerant data-parallel training of a small MLP with torchft.

Run one replica group per torchrun job (or let ``python -m torchft.launch`` do it)::

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 torchrun --standalone --nproc-per-node 1 \
        examples/train_ddp.py --steps 200
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 torchrun --standalone --nproc-per-node 1 \
        examples/train_ddp.py --steps 200

Configuration comes from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
plus ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS``. The data set is
generated here (a fixed random "teacher" network labels random inputs), so the script needs
nothing from the network. Each step prints one progress line; at the end the script prints its
final step and a hash of its model and optimizer state, and can write them to a JSON file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from torchft import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)
from torchft.data import StepAlignedLoader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line of the example."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="committed steps to train for")
    p.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-replica-size", type=int, default=1, help="commit guard")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--result-file", default=os.environ.get("TORCHFT_RESULT_FILE"))
    p.add_argument("--timeout", type=float, default=10.0, help="collective timeout (s)")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="quorum timeout (s)")
    p.add_argument(
        "--hostname",
        default=socket.gethostname(),
        help="name other groups reach this one by (must match a TLS certificate, if any)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.hidden < 1 or args.batch_size < 1:
        p.error("--steps, --hidden and --batch-size must be positive")
    if args.min_replica_size < 1:
        p.error("--min-replica-size must be at least 1")
    return args


def env_int(name: str, default: int | None = None) -> int:
    """Reads an integer environment variable, failing with a clear message."""
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            sys.exit(f"train_ddp: environment variable {name} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        sys.exit(f"train_ddp: {name}={raw!r} is not an integer")


def make_dataset(n: int = 8192, features: int = 256, classes: int = 10) -> TensorDataset:
    """Inputs from a fixed seed labelled by a fixed random teacher network."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def state_hash(state: Any) -> str:
    """A hash over every tensor and value of a (nested) state dict, in a stable order."""
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(str(t.dtype).encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        else:
            h.update(repr(obj).encode())

    walk(state)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Trains until the replica groups have committed ``--steps`` steps."""
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    replica_group = env_int("REPLICA_GROUP_ID", 0)
    num_replica_groups = env_int("NUM_REPLICA_GROUPS", 2)
    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    if not 0 <= replica_group < num_replica_groups:
        sys.exit(
            f"train_ddp: REPLICA_GROUP_ID={replica_group} must be in [0, {num_replica_groups})"
        )
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        sys.exit("train_ddp: set TORCHFT_LIGHTHOUSE to the lighthouse address (http://host:port)")

    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    torch.manual_seed(0)  # every group starts from the same weights; healing keeps them equal

    dataset = make_dataset()
    sampler = DistributedSampler(
        dataset,
        replica_rank=replica_group,
        num_replica_groups=num_replica_groups,
        group_rank=rank,
        num_replicas=world_size,
        shuffle=True,
        seed=0,
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = nn.Sequential(
        nn.Linear(256, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 10),
    ).to(device)
    inner_optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner_optim.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner_optim.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    pg = (
        ProcessGroupNCCL(timeout=timeout)
        if device.type == "cuda"
        else ProcessGroupGloo(timeout=timeout)
    )
    started = time.monotonic()
    manager = Manager(
        pg=pg,
        min_replica_size=args.min_replica_size,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica_group}",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        hostname=args.hostname,
    )
    ddp_model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner_optim)
    loss_fn = nn.CrossEntropyLoss()

    print(
        f"[group {replica_group} rank {rank}] pid={os.getpid()} start step={manager.current_step()}",
        flush=True,
    )
    first_commit_s: float | None = None
    loss_value = float("nan")
    # Batch s of this group's shard for committed step s: a retried step reads the same
    # batch, a restarted group resumes its shard at the step it healed to.
    batches = StepAlignedLoader(loader, manager)
    try:
        while manager.current_step() < args.steps:
            optimizer.zero_grad()
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
            before = manager.current_step()
            optimizer.step()
            # Exactly one step further: a resume from a durable snapshot (every group had
            # died) jumps further without committing this step.
            committed = manager.current_step() == before + 1
            loss_value = loss.item()
            if committed and first_commit_s is None:
                first_commit_s = time.monotonic() - started
            print(
                f"[group {replica_group} rank {rank}] step={manager.current_step()} "
                f"loss={loss_value:.4f} participants={manager.num_participants()} "
                f"committed={committed}",
                flush=True,
            )
            if args.step_sleep:
                time.sleep(args.step_sleep)
        digest = state_hash({"model": model.state_dict(), "optim": inner_optim.state_dict()})
        result = {
            "replica_group": replica_group,
            "rank": rank,
            "step": manager.current_step(),
            "batches_committed": manager.batches_committed(),
            "loss": loss_value,
            "state_hash": digest,
            "first_commit_s": first_commit_s,
            "pid": os.getpid(),
        }
        print(f"[group {replica_group} rank {rank}] FINAL {json.dumps(result)}", flush=True)
        if args.result_file:
            path = args.result_file.format(replica_group=replica_group, rank=rank)
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, path)
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
