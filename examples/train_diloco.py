"""Fault-tolerant streaming DiLoCo training of a small MLP with torchft.

Each replica group trains on its own data shard with a local (inner) optimizer and only talks
to the other groups when a model fragment syncs: once every ``--sync-every`` inner steps per
fragment, in turn. Run one replica group per torchrun job::

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 torchrun --standalone --nproc-per-node 1 \
        examples/train_diloco.py --steps 50
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 torchrun --standalone --nproc-per-node 1 \
        examples/train_diloco.py --steps 50

``--steps`` counts committed fragment syncs (the manager's step). Kill a group and start it
again: it heals from a peer (model, inner optimizer, global parameters, outer optimizer
state) and rejoins at its next sync. At the end the script prints its step and hashes of its
model and of the DiLoCo global state (global parameters and outer optimizers), which every
group that ends at the same step shares bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn

from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.local_sgd import DiLoCo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line of the example."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="committed fragment syncs to run")
    p.add_argument("--sync-every", type=int, default=8, help="inner steps per fragment sync")
    p.add_argument("--fragments", type=int, default=2, help="model fragments (1: plain DiLoCo)")
    p.add_argument("--fragment-sync-delay", type=int, default=1)
    p.add_argument("--fragment-update-alpha", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3, help="inner AdamW learning rate")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD lr")
    p.add_argument("--min-replica-size", type=int, default=1, help="commit guard")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per inner step")
    p.add_argument("--result-file", default=os.environ.get("TORCHFT_RESULT_FILE"))
    p.add_argument("--timeout", type=float, default=10.0, help="collective timeout (s)")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="quorum timeout (s)")
    args = p.parse_args(argv)
    if min(args.steps, args.hidden, args.batch_size, args.fragments) < 1:
        p.error("--steps, --hidden, --batch-size and --fragments must be positive")
    if args.fragments > 4:
        p.error("--fragments must be at most 4 (the MLP has 4 linear layers)")
    return args


def env_int(name: str, default: int) -> int:
    """Reads an integer environment variable, failing with a clear message."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        sys.exit(f"train_diloco: {name}={raw!r} is not an integer")


def state_hash(state: Any) -> str:
    """A hash over every tensor and value of a (nested) state, in a stable order."""
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
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


def make_batch(gen: torch.Generator, batch_size: int, teacher: torch.Tensor) -> Any:
    """A batch of random inputs labelled by a fixed random teacher network."""
    x = torch.randn(batch_size, teacher.shape[0], generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def main(argv: list[str] | None = None) -> int:
    """Trains until the manager has committed ``--steps`` fragment syncs."""
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    replica_group = env_int("REPLICA_GROUP_ID", 0)
    rank = env_int("RANK", 0)
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        sys.exit(
            "train_diloco: set TORCHFT_LIGHTHOUSE to the lighthouse address (http://host:port)"
        )
    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )

    torch.manual_seed(0)
    layers = [nn.Linear(32, args.hidden), nn.Linear(args.hidden, args.hidden)]
    layers += [nn.Linear(args.hidden, args.hidden), nn.Linear(args.hidden, 10)]
    model = nn.Sequential(
        layers[0], nn.ReLU(), layers[1], nn.ReLU(), layers[2], nn.ReLU(), layers[3]
    ).to(device)
    # Fragments: consecutive layers, as even as possible.
    n = args.fragments
    fragments: list[nn.Module] = []
    start = 0
    for count in [len(layers) // n + (i < len(layers) % n) for i in range(n)]:
        fragments.append(nn.ModuleList(layers[start : start + count]))
        start += count

    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    outer = [
        torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True)
        for f in fragments
    ]

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    pg = (
        ProcessGroupNCCL(timeout=timeout)
        if device.type == "cuda"
        else ProcessGroupGloo(timeout=timeout)
    )
    manager = Manager(
        pg=pg,
        min_replica_size=args.min_replica_size,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=False,  # DiLoCo needs the peers' state before it syncs
        replica_id=f"train_diloco_{replica_group}",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
    )
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(10_000 + replica_group)
    loss_fn = nn.CrossEntropyLoss()
    tag = f"[group {replica_group} rank {rank}]"
    print(f"{tag} pid={os.getpid()} start step={manager.current_step()}", flush=True)
    diloco = DiLoCo(
        manager,
        fragments,
        inner,
        outer,
        sync_every=args.sync_every,
        fragment_sync_delay=args.fragment_sync_delay,
        fragment_update_alpha=args.fragment_update_alpha,
    )
    loss_value = float("nan")
    inner_steps = 0
    try:
        with diloco:
            while manager.current_step() < args.steps:
                x, y = make_batch(gen, args.batch_size, teacher)
                inner.zero_grad()
                loss = loss_fn(model(x.to(device)), y.to(device))
                loss.backward()
                before = manager.current_step()
                inner.step()  # every few steps, a fragment syncs inside this call
                inner_steps += 1
                loss_value = loss.item()
                if manager.current_step() != before:
                    print(
                        f"{tag} step={manager.current_step()} loss={loss_value:.4f} "
                        f"participants={manager.num_participants()}",
                        flush=True,
                    )
                if args.step_sleep:
                    time.sleep(args.step_sleep)
        result = {
            "replica_group": replica_group,
            "rank": rank,
            "step": manager.current_step(),
            "inner_steps": inner_steps,
            "loss": loss_value,
            "model_hash": state_hash(model.state_dict()),
            "global_hash": state_hash(diloco.state_dict()),
            "pid": os.getpid(),
        }
        print(f"{tag} FINAL {json.dumps(result)}", flush=True)
        if args.result_file:
            path = args.result_file.format(replica_group=replica_group, rank=rank)
            with open(f"{path}.tmp", "w") as f:
                json.dump(result, f)
            os.replace(f"{path}.tmp", path)
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
