"""Fault-tolerant HSDP with torchft, laid out as torchtitan does it.

Inside a replica group, FSDP2 (``fully_shard``) shards the model over the group's ranks with
an ordinary process group. Across replica groups only the *replicate* dimension is fault
tolerant: ``ManagedProcessGroup(manager)`` is registered as ``"dp_replicate"`` and FSDP2's
all-reduce hook averages each rank's gradient shard over the groups through it; the loss is
averaged with a functional collective on the same group. Run one torchrun job per group::

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    REPLICA_GROUP_ID=0 torchrun --standalone --nproc-per-node 2 examples/train_hsdp.py
    REPLICA_GROUP_ID=1 torchrun --standalone --nproc-per-node 2 examples/train_hsdp.py

It runs on CPU (Gloo) or CUDA (NCCL). Kill a group and start it again: each of its ranks
heals its own shard (parameters and optimizer state) from the same rank of a peer group. At
the end every rank prints its step and a hash of its shard, which the same rank of every
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
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from torchft import Manager, Optimizer, ProcessGroupGloo, ProcessGroupNCCL
from torchft.process_group import ManagedProcessGroup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line of the example."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="committed steps to train for")
    p.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--min-replica-size", type=int, default=1, help="commit guard")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--result-file", default=os.environ.get("TORCHFT_RESULT_FILE"))
    p.add_argument("--timeout", type=float, default=10.0, help="collective timeout (s)")
    p.add_argument("--quorum-timeout", type=float, default=60.0, help="quorum timeout (s)")
    args = p.parse_args(argv)
    if min(args.steps, args.hidden, args.batch_size) < 1:
        p.error("--steps, --hidden and --batch-size must be positive")
    return args


def env_int(name: str, default: int) -> int:
    """Reads an integer environment variable, failing with a clear message."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        sys.exit(f"train_hsdp: {name}={raw!r} is not an integer")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shard of the parameters and of the momentum buffers (plain tensors)."""
    momentum = {}
    for name, p in model.named_parameters():
        buf = optim.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            momentum[name] = local(buf)
    return {
        "params": {n: local(p.detach()) for n, p in model.named_parameters()},
        "momentum": momentum,
    }


def load_shard_state(model: nn.Module, optim: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Copies a peer's shard into this rank's parameters and momentum buffers."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local(p.data).copy_(sd["params"][name])
            buf = sd["momentum"].get(name)
            if buf is None:
                optim.state.pop(p, None)
                continue
            state = optim.state[p]
            if "momentum_buffer" in state and state["momentum_buffer"] is not None:
                local(state["momentum_buffer"]).copy_(buf)
            else:
                state["momentum_buffer"] = DTensor.from_local(
                    buf.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )


def shard_hash(state: dict[str, Any]) -> str:
    """A hash of a shard state, in a stable order."""
    h = hashlib.sha256()
    for section in ("params", "momentum"):
        for name in sorted(state[section]):
            t = state[section][name].detach().cpu().contiguous()
            h.update(f"{section}/{name}{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Trains until the replica groups have committed ``--steps`` steps."""
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    replica_group = env_int("REPLICA_GROUP_ID", 0)
    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        sys.exit("train_hsdp: set TORCHFT_LIGHTHOUSE to the lighthouse address (http://host:port)")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    # The group's own ranks: an ordinary process group and a 1-D mesh for FSDP2's sharding.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    shard_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU()
    )
    model.append(nn.Linear(args.hidden, 4))
    model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupNCCL(timeout=timeout) if cuda else ProcessGroupGloo(timeout=timeout),
        min_replica_size=args.min_replica_size,
        load_state_dict=lambda sd: load_shard_state(model, inner, sd),
        state_dict=lambda: shard_state(model, inner),
        replica_id=f"train_hsdp_{replica_group}",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
    )
    # The fault-tolerant replicate dimension, as torchtitan sets it up.
    replicate_pg = ManagedProcessGroup(manager).register("dp_replicate")

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicate_pg, op=ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)
    optimizer = Optimizer(manager, inner)

    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(1234))
    tag = f"[group {replica_group} rank {rank}]"
    print(f"{tag} pid={os.getpid()} start step={manager.current_step()}", flush=True)
    loss_value = float("nan")
    try:
        while manager.current_step() < args.steps:
            # Each rank of each group its own batch, reproducible from (group, rank, step).
            seed = (replica_group * 1000 + rank) * 100_003 + manager.current_step()
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(args.batch_size, 16, generator=gen)
            y = (x @ teacher).argmax(dim=1)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            # The loss averaged over the replica groups, as torchtitan logs it.
            global_loss = funcol.all_reduce(loss.detach(), "avg", group=replicate_pg)
            before = manager.current_step()
            optimizer.step()
            committed = manager.current_step() > before
            loss_value = float(global_loss)
            print(
                f"{tag} step={manager.current_step()} loss={loss_value:.4f} "
                f"participants={manager.num_participants()} committed={committed}",
                flush=True,
            )
            if args.step_sleep:
                time.sleep(args.step_sleep)
        shard = shard_state(model, inner)
        result = {
            "replica_group": replica_group,
            "rank": rank,
            "step": manager.current_step(),
            "loss": loss_value,
            "shard_hash": shard_hash(shard),
            "pid": os.getpid(),
        }
        print(f"{tag} FINAL {json.dumps(result)}", flush=True)
        if args.result_file:
            path = args.result_file.format(replica_group=replica_group, rank=rank)
            with open(f"{path}.tmp", "w") as f:
                json.dump(result, f)
            os.replace(f"{path}.tmp", path)
    finally:
        replicate_pg.unregister()
        manager.shutdown(wait=False)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
