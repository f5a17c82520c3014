"""Fault-tolerant data-parallel training on Ray Train with torchft.

Every Ray Train worker is one replica group (group size 1). Ray's ``TorchftConfig`` starts a
``torchft.coordination.LighthouseServer`` in an actor, points every worker at it through
``TORCHFT_LIGHTHOUSE`` and, when a worker fails, replaces only that replica group while the
others keep training. The replacement heals from a live peer over the replica process group
(``PGTransport``) and trains on with it::

    pip install "ray[train]"
    python examples/ray_train.py --groups 2 --steps 1500 --fail-group 1 --fail-at-step 300

``--fail-group``/``--fail-at-step`` make one replica group raise once mid-run, to watch the
replacement join. With ``--result-dir`` every replica group incarnation writes a JSON record
of its run there: the step it started at, when it committed what, how many groups took part,
and a hash of its final model and optimizer state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line of the example."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2, help="replica groups (Ray workers)")
    p.add_argument("--steps", type=int, default=1500, help="committed steps to train for")
    p.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--alone-sleep",
        type=float,
        default=0.0,
        help="extra seconds per step while fewer than --groups groups take part (paces a "
        "survivor until the replacement of a failed group is back)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="collective timeout (s)")
    p.add_argument("--fail-group", type=int, default=None, help="replica group that fails once")
    p.add_argument("--fail-at-step", type=int, default=None, help="step at which it fails")
    p.add_argument("--max-failures", type=int, default=3, help="replacements Ray may make")
    p.add_argument("--result-dir", default=None, help="where each incarnation writes a record")
    p.add_argument("--storage-path", default=None, help="Ray Train storage (default: a tmpdir)")
    args = p.parse_args(argv)
    if args.groups < 1 or args.steps < 1 or args.hidden < 1 or args.batch_size < 1:
        p.error("--groups, --steps, --hidden and --batch-size must be positive")
    if args.step_sleep < 0 or args.alone_sleep < 0:
        p.error("--step-sleep and --alone-sleep must be >= 0")
    if (args.fail_group is None) != (args.fail_at_step is None):
        p.error("--fail-group and --fail-at-step go together")
    if args.fail_group is not None and not 0 <= args.fail_group < args.groups:
        p.error(f"--fail-group must be in [0, {args.groups})")
    if args.fail_at_step is not None and not 0 < args.fail_at_step < args.steps:
        p.error(f"--fail-at-step must be in (0, {args.steps})")
    return args


def state_hash(state: Any) -> str:
    """A hash over every tensor and value of a (nested) state dict, in a stable order."""
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


def train_loop(config: dict[str, Any]) -> None:
    """The training function every Ray Train worker runs: one replica group each."""
    import ray.train
    from torch.utils.data import DataLoader, TensorDataset

    from torchft import (
        DistributedDataParallel,
        DistributedSampler,
        Manager,
        Optimizer,
        ProcessGroupGloo,
    )
    from torchft.checkpointing import PGTransport

    ctx = ray.train.get_context()
    group = ctx.get_world_rank()
    num_groups = ctx.get_world_size()
    started_unix = time.time()

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(dim=1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(
        dataset, replica_rank=group, num_replica_groups=num_groups, shuffle=True, seed=0
    )
    loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    hidden = config["hidden"]
    model = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=config["lr"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=config["timeout"])
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        world_size=1,
        rank=0,
        replica_id=f"ray_train_{group}",
        timeout=timeout,
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    ddp_model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    loss_fn = nn.CrossEntropyLoss()

    steps = config["steps"]
    fail_marker = config.get("fail_marker")
    fails_here = config.get("fail_group") == group
    # (step, unix time, participants) of every commit: when this group trained, and with whom.
    commits: list[tuple[int, float, int]] = []
    healed_to: int | None = None
    epoch = 0
    try:
        while manager.current_step() < steps:
            sampler.set_epoch(epoch)
            epoch += 1
            for xb, yb in loader:
                if manager.current_step() >= steps:
                    break
                if (
                    fails_here
                    and manager.current_step() >= config["fail_at_step"]
                    and fail_marker is not None
                    and not os.path.exists(fail_marker)
                ):
                    open(fail_marker, "w").close()
                    raise RuntimeError(
                        f"injected failure of replica group {group} "
                        f"at step {manager.current_step()}"
                    )
                before = manager.current_step()
                optimizer.zero_grad()
                loss_fn(ddp_model(xb), yb).backward()
                optimizer.step()
                after = manager.current_step()
                if after > before:
                    if after > before + 1 and healed_to is None:
                        healed_to = after - 1  # healed to the peers' step, then committed
                    commits.append((after, time.time(), manager.num_participants()))
                pace = config["step_sleep"]
                if config["alone_sleep"] and manager.num_participants() < num_groups:
                    pace += config["alone_sleep"]
                if pace:
                    time.sleep(pace)
        record = {
            "group": group,
            "pid": os.getpid(),
            "started_unix": started_unix,
            "healed_to": healed_to,
            "first_commit": commits[0] if commits else None,
            "last_commit": commits[-1] if commits else None,
            "joint_commits": sum(1 for c in commits if c[2] > 1),
            "commits": len(commits),
            # Every commit as [step, unix time, participants]: when it trained, with whom.
            "commit_log": commits,
            "step": manager.current_step(),
            "state_hash": state_hash(state_dict()),
        }
        print(f"[ray_train group {group}] FINAL {json.dumps(record)}", flush=True)
        if config.get("result_dir"):
            path = os.path.join(config["result_dir"], f"group{group}-{uuid.uuid4().hex[:8]}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
    finally:
        manager.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    """Starts Ray, trains ``--groups`` replica groups with TorchftConfig, prints the result."""
    args = parse_args(argv)
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray.train.v2.torch.torchft_config import TorchftConfig
    except ImportError as e:
        sys.exit(f"ray_train: needs Ray Train with torchft support (pip install 'ray[train]'): {e}")

    storage = args.storage_path or tempfile.mkdtemp(prefix="ray_train_torchft_")
    config = {
        "steps": args.steps,
        "hidden": args.hidden,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "step_sleep": args.step_sleep,
        "alone_sleep": args.alone_sleep,
        "timeout": args.timeout,
        "fail_group": args.fail_group,
        "fail_at_step": args.fail_at_step,
        "fail_marker": os.path.join(storage, "injected_failure"),
        "result_dir": args.result_dir,
    }
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
    trainer = TorchTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.groups, use_gpu=False),
        torch_config=TorchftConfig(lighthouse_kwargs={"min_replicas": 1}, backend="gloo"),
        run_config=RunConfig(
            storage_path=storage,
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    print(f"ray_train: done (error={result.error})", flush=True)
    ray.shutdown()
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
