"""One rank of a replica group for the fault-tolerance tests (run as a subprocess).

Trains a small MLP with the Manager, torchft DDP and the optimizer wrapper (AdamW) on Gloo.
Group rank, group size, store and lighthouse come from the environment exactly as under
torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHFT_LIGHTHOUSE).

The test drives it through files:
- ``--progress``: rewritten after every step with the committed step (atomic rename).
- ``--stop``: when this file exists it holds the target step; the worker exits once its
  committed step reaches it (so every replica group stops at the same step).
- ``--sleep-file``: while it exists, the worker sleeps the seconds it holds after every step
  (a straggler on demand).
- ``--hold-file``: while it exists and holds a step the worker has committed, the worker
  waits before its next step: every group of the job holds at that step, however long the
  test takes to act (the groups before it go on to it, so none waits on a held one).
- ``--result``: written at exit with the step, hashes of parameters and optimizer state, and
  the commit result and parameter hash of every attempted step.

Fault hooks for the failure-detection tests (a marker file records the wall time of the fault):
- ``--kill-self-in-configure MARKER``: SIGKILLs itself inside its first process-group configure
  (after the quorum was issued with it, before its peers' rendezvous can complete).
- ``--stop-self-when-serving MARKER``: SIGSTOPs itself right after offering its state of
  step ≥ 5 to a healing peer, unless another group already did (the marker is created
  exclusively).

- ``--native-store HOST:PORT --native-rank R --native-world N``: the Manager's process group
  is torch's own Gloo group created with ``enable_reconfigure=True`` through
  ``dist.init_process_group`` (``dist.group.WORLD``) on the job-wide store at HOST:PORT, with
  creation rank R of N (native Gloo rendezvous on the store it was created with).

- ``--data-groups N``: the data comes from a ``torchft.data.DistributedSampler`` shard
  (``REPLICA_GROUP_ID`` of N groups) through ``StepAlignedLoader``; ``--data-log`` receives a
  JSON line per step attempt: ``[position, step, committed, participating, sample ids]``.

With env ``FT_DEBUG=1`` every committed optimizer step logs hashes of parameters, gradients
and optimizer state, which pinpoints the first step where replica groups diverge.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.data import DistributedSampler, StepAlignedLoader
from torchft.process_group import FakeProcessGroupWrapper

logger = logging.getLogger("ft_worker")


def hash_state(obj: Any, h: Any | None = None) -> str:
    """Hashes nested dicts/lists of tensors and scalars deterministically (sorted keys)."""
    top = h is None
    if h is None:
        h = hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            h.update(f"K{k!r}".encode())
            hash_state(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            hash_state(v, h)
    else:
        h.update(f"V{obj!r}".encode())
    return h.hexdigest() if top else ""


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Writes JSON atomically (readers never see a partial file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def read_stop(path: str) -> int | None:
    """Returns the step written in ``path`` (the stop or hold file), if it exists."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def read_seconds(path: str) -> float:
    """Seconds written in ``path`` (0 if the file is missing or unreadable)."""
    try:
        with open(path) as f:
            return float(f.read().strip())
    except (FileNotFoundError, ValueError):
        return 0.0


def mark(path: str) -> bool:
    """Creates ``path`` exclusively with the wall time and pid; False if it already exists.

    The content is written to a private file first and then hard-linked into place, so a
    reader that sees ``path`` always sees it whole (an exclusive create then a write would
    let a watcher read it empty in between)."""
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as f:
        f.write(f"{time.time()} {os.getpid()}")
    try:
        os.link(staging, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(staging)
    return True


def install_fault_hooks(args: argparse.Namespace, pg: Any, manager: Manager) -> None:
    """Wraps the process group / transport with the self-inflicted faults asked for."""
    if args.kill_self_in_configure:
        configure = pg.configure

        def dying_configure(*a: Any, **kw: Any) -> None:
            mark(args.kill_self_in_configure)
            os.kill(os.getpid(), signal.SIGKILL)
            configure(*a, **kw)

        pg.configure = dying_configure
    if args.stop_self_when_serving:
        transport = manager._checkpoint_transport
        send = transport.send_checkpoint

        def stopping_send(*a: Any, **kw: Any) -> None:
            send(*a, **kw)
            # Not the step-0 sync of the initial weights: a heal of a later joiner.
            if kw.get("step", 0) >= 5 and mark(args.stop_self_when_serving):
                os.kill(os.getpid(), signal.SIGSTOP)

        transport.send_checkpoint = stopping_send  # type: ignore[method-assign]


DATA_SAMPLES = 480
DATA_BATCH = 4


def make_stream(groups: int, group_rank: int, manager: Manager) -> StepAlignedLoader:
    """This rank's shard of DATA_SAMPLES sample ids, read through the step-aligned stream."""
    dataset = TensorDataset(torch.arange(DATA_SAMPLES))
    sampler = DistributedSampler(
        dataset,
        replica_rank=int(os.environ["REPLICA_GROUP_ID"]),
        num_replica_groups=groups,
        group_rank=group_rank,
        num_replicas=int(os.environ["WORLD_SIZE"]),
        shuffle=True,
        seed=11,
        drop_last=True,
    )
    loader = DataLoader(dataset, batch_size=DATA_BATCH, sampler=sampler, drop_last=True)
    return StepAlignedLoader(loader, manager)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-steps", default="", help="steps whose first attempt fails")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument(
        "--sleep-file", default="", help="while this file exists, sleep its seconds per step"
    )
    parser.add_argument(
        "--hold-file",
        default="",
        help="while this file exists and holds a step committed here, wait before the next step",
    )
    parser.add_argument(
        "--backward-sleep-file",
        default="",
        help="while this file exists, the backward pass sleeps its seconds (a slow backward)",
    )
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--quorum-timeout", type=float, default=30.0)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda)")
    parser.add_argument("--kill-self-in-configure", default="")
    parser.add_argument("--stop-self-when-serving", default="")
    parser.add_argument("--data-groups", type=int, default=0)
    parser.add_argument("--data-log", default="")
    parser.add_argument("--native-store", default="")
    parser.add_argument("--native-rank", type=int, default=0)
    parser.add_argument("--native-world", type=int, default=1)
    parser.add_argument(
        "--commit-log",
        default="",
        help="append [step, param hash, optim hash] per commit to this path + .r<RANK>",
    )
    args = parser.parse_args()
    if args.native_store and (args.fail_steps or args.kill_self_in_configure):
        parser.error("fault injection through the process group needs a torchft group")

    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.replica_id}/r{os.environ.get('RANK')} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(1)
    group_rank = int(os.environ["RANK"])
    # Different initial weights per replica group: init_sync must make them identical.
    torch.manual_seed(1000 + args.seed)
    model = nn.Sequential(
        nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU()
    )
    model.append(nn.Linear(args.hidden, 4))
    model.to(args.device)

    pg: Any
    if args.native_store:
        host, port = args.native_store.rsplit(":", 1)
        shared = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"native/{group_rank}", shared),
            rank=args.native_rank,
            world_size=args.native_world,
            timeout=timedelta(seconds=args.timeout),
            enable_reconfigure=True,
        )
        pg = dist.group.WORLD
    else:
        pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)))
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=not args.sync,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=30),
        replica_id=args.replica_id,
    )
    install_fault_hooks(args, pg, manager)
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-2))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)

    if os.environ.get("FT_DEBUG"):

        def pre_hook(opt: Any, *a: Any) -> None:
            grads = {i: p.grad for i, p in enumerate(model.parameters())}
            logger.info(
                "DEBUG step %d params %s grads %s optim %s",
                manager.current_step(),
                hash_state(model.state_dict())[:10],
                hash_state(grads)[:10],
                hash_state(optim.state_dict())[:10],
            )

        optim.register_step_pre_hook(pre_hook)

    fail_steps = {int(s) for s in args.fail_steps.split(",") if s}
    injected: set[int] = set()
    attempts: list[list[Any]] = []
    commit_times: list[list[float]] = []  # [step, wall time] of every committed step
    data_gen = torch.Generator().manual_seed(7 * args.seed + group_rank)
    stream: StepAlignedLoader | None = None
    if args.data_groups:
        stream = make_stream(args.data_groups, group_rank, manager)
        table = torch.Generator().manual_seed(5)
        features = torch.randn(DATA_SAMPLES, 16, generator=table)
        labels = torch.randint(0, 4, (DATA_SAMPLES,), generator=table)
    try:
        while True:
            target = read_stop(args.stop)
            step = manager.current_step()
            if (target is not None and step >= target) or step >= args.max_steps:
                break
            optim.zero_grad()
            if step in fail_steps and step not in injected:
                injected.add(step)
                pg.report_future_error(RuntimeError(f"injected allreduce failure at step {step}"))
            ids: list[int] = []
            if stream is not None:
                # After zero_grad: in sync mode the quorum (and any heal) is done.
                (batch,) = next(stream)
                ids = batch.tolist()
                x, y = features[batch], labels[batch]
            else:
                x = torch.randn(32, 16, generator=data_gen)
                y = torch.randint(0, 4, (32,), generator=data_gen)
            x, y = x.to(args.device), y.to(args.device)
            out = ddp(x)
            if args.backward_sleep_file:
                slow_s = read_seconds(args.backward_sleep_file)
                if slow_s:
                    # Runs inside the backward pass, as a slow kernel would.
                    out.register_hook(lambda g, s=slow_s: (time.sleep(s), g)[1])
            loss = nn.functional.cross_entropy(out, y)
            loss.backward()
            # The quorum finished inside backward (allreduce waits for it): healed counters
            # are in place, so this is the step being voted on.
            before = manager.current_step()
            optim.step()
            committed = manager.current_step() == before + 1
            attempts.append([before, committed, hash_state(model.state_dict())[:12]])
            if committed:
                commit_times.append([before, time.time()])
                if args.commit_log:
                    line = [
                        manager.current_step(),
                        hash_state(model.state_dict()),
                        hash_state(optim.state_dict()),
                    ]
                    with open(f"{args.commit_log}.r{group_rank}", "a") as f:
                        f.write(json.dumps(line) + "\n")
            if args.data_log and stream is not None:
                record = [stream.position, before, committed, manager.is_participating(), ids]
                with open(args.data_log, "a") as f:
                    f.write(json.dumps(record) + "\n")
            write_json(args.progress, {"step": manager.current_step(), "pid": os.getpid()})
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.sleep_file:
                extra = read_seconds(args.sleep_file)
                if extra:
                    time.sleep(extra)
            while args.hold_file and 0 < (read_stop(args.hold_file) or 0) <= manager.current_step():
                time.sleep(0.02)
        write_json(
            args.result,
            {
                "replica_id": args.replica_id,
                "group_rank": group_rank,
                "step": manager.current_step(),
                "batches_committed": manager.batches_committed(),
                "param_hash": hash_state(model.state_dict()),
                "optim_hash": hash_state(optim.state_dict()),
                "attempts": attempts,
                "commit_times": commit_times,
            },
        )
    finally:
        manager.shutdown(wait=False)
        if args.native_store:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
