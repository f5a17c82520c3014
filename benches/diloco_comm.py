"""Communication of DiLoCo against plain torch DDP for the same model, measured in one run.

Two processes train the same MLP (256 -> H -> H -> H -> 10, batch 32) on Gloo (CPU):

- plain DDP: ``torch.nn.parallel.DistributedDataParallel`` over one Gloo group. Its
  allreduce per step is the median time of a step minus the median time of a step under
  ``no_sync()`` (same computation, no allreduce), alternating so load affects both alike.
- DiLoCo: two replica groups of one rank, a lighthouse in this process, ``Manager``
  (synchronous quorum) and ``torchft.local_sgd.DiLoCo``. Its time per sync is the median time
  of an ``optimizer.step()`` that syncs (quorum, allreduce of the pseudo-gradients, commit
  vote, outer step) minus the median of one that does not. Plain DiLoCo syncs the whole model
  every ``--sync-every`` steps; streaming DiLoCo with 2 fragments syncs half of it twice as
  often (fragments of about equal size: the first two and the last two linear layers).

The three jobs run ``--runs`` times (>= 5), in rounds of one each, so load drifts fall on
all of them alike. It prints each side's communication time per sync (median over runs, with
min and max) and per inner step, and the ratio of DiLoCo's per-inner-step communication to
DDP's (of the medians). Exit status 1 if DiLoCo's per-inner-step communication is not below
DDP's.

Usage: ``python benches/diloco_comm.py [--hidden 1024] [--sync-every 8] [--syncs 10]
[--runs 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO_PYTHON = str(HERE.parent.parent / "python")


def _model(hidden: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Linear(256, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)]
    return nn.Sequential(
        layers[0], nn.ReLU(), layers[1], nn.ReLU(), layers[2], nn.ReLU(), nn.Linear(hidden, 10)
    )


def _write(path: str, payload: dict[str, Any]) -> None:
    with open(f"{path}.tmp", "w") as f:
        json.dump(payload, f)
    os.replace(f"{path}.tmp", path)


def worker_ddp(args: argparse.Namespace) -> None:
    """One rank of plain torch DDP: step times with and without the gradient allreduce."""
    import torch
    import torch.distributed as dist
    from torch import nn

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model = nn.parallel.DistributedDataParallel(_model(args.hidden))
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    synced, local = [], []
    for i in range(2 * (args.warmup + args.steps)):
        x, y = torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        sync = i % 2 == 0
        start = time.perf_counter()
        optim.zero_grad()
        if sync:
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            with model.no_sync():
                nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
        if i >= 2 * args.warmup:
            (synced if sync else local).append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    _write(args.result, {"synced": synced, "local": local})


def worker_diloco(args: argparse.Namespace) -> None:
    """One replica group running DiLoCo: times of inner steps that sync and that do not."""
    import torch
    from torch import nn

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    model = _model(args.hidden)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    fragments = (
        [nn.ModuleList(linears)]
        if args.fragments == 1
        else [nn.ModuleList(linears[:2]), nn.ModuleList(linears[2:])]
    )
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    outer = [
        torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments
    ]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=False,
        init_sync=False,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        replica_id=args.replica_id,
    )
    gen = torch.Generator().manual_seed(int(os.environ.get("BENCH_SEED", "0")))
    synced, local = [], []
    per_sync = args.sync_every // args.fragments
    total = per_sync * (args.warmup_syncs + args.syncs)
    try:
        with DiLoCo(manager, fragments, inner, outer, sync_every=args.sync_every):
            for i in range(total):
                x, y = (
                    torch.randn(32, 256, generator=gen),
                    torch.randint(0, 10, (32,), generator=gen),
                )
                inner.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                start = time.perf_counter()
                inner.step()
                elapsed = time.perf_counter() - start
                if i >= per_sync * args.warmup_syncs:
                    (synced if (i + 1) % per_sync == 0 else local).append(elapsed)
        committed = manager.current_step()
    finally:
        manager.shutdown(wait=False)
    _write(args.result, {"synced": synced, "local": local, "committed": committed})


def _spawn(mode: str, rank: int, port: int, extra: list[str], env_extra: dict[str, str]) -> Any:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2" if mode == "ddp" else "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1",
            **env_extra,
        }
    )
    return subprocess.Popen([sys.executable, str(HERE), "worker", "--mode", mode, *extra], env=env)


def _wait(procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            if p.wait(timeout=max(0.1, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"worker exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _comm(paths: list[Path]) -> float:
    """Median time with communication minus median time without, worst rank."""
    out = []
    for p in paths:
        r = json.loads(p.read_text())
        out.append(statistics.median(r["synced"]) - statistics.median(r["local"]))
    return max(out)


def run_ddp(tmp: Path, args: argparse.Namespace) -> float:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = [tmp / f"ddp_{r}.json" for r in range(2)]
    common = ["--hidden", str(args.hidden), "--steps", str(args.steps), "--warmup", "10"]
    procs = [
        _spawn("ddp", r, store.port, [*common, "--result", str(results[r])], {}) for r in range(2)
    ]
    _wait(procs, 600)
    return _comm(results)


def run_diloco(tmp: Path, args: argparse.Namespace, fragments: int, sync_every: int) -> float:
    from torch.distributed import TCPStore

    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    results = [tmp / f"diloco{fragments}_{r}.json" for r in range(2)]
    common = ["--hidden", str(args.hidden), "--fragments", str(fragments)]
    common += ["--sync-every", str(sync_every), "--syncs", str(args.syncs), "--warmup-syncs", "2"]
    try:
        procs = [
            _spawn(
                "diloco",
                0,
                stores[r].port,
                [*common, "--result", str(results[r]), "--replica-id", f"diloco_bench{r}"],
                {"TORCHFT_LIGHTHOUSE": lighthouse.address(), "BENCH_SEED": str(r)},
            )
            for r in range(2)
        ]
        _wait(procs, 600)
    finally:
        lighthouse.shutdown()
    committed = {json.loads(p.read_text())["committed"] for p in results}
    if committed != {args.syncs + 2}:
        raise RuntimeError(f"expected {args.syncs + 2} committed syncs, got {committed}")
    return _comm(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--mode", choices=["ddp", "diloco"], required=True)
    w.add_argument("--hidden", type=int, required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--steps", type=int, default=0)
    w.add_argument("--warmup", type=int, default=0)
    w.add_argument("--fragments", type=int, default=1)
    w.add_argument("--sync-every", type=int, default=8)
    w.add_argument("--syncs", type=int, default=10)
    w.add_argument("--warmup-syncs", type=int, default=2)
    w.add_argument("--replica-id", default="diloco_bench")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--sync-every", type=int, default=8, help="DiLoCo inner steps per sync")
    parser.add_argument("--syncs", type=int, default=10, help="measured syncs per DiLoCo run")
    parser.add_argument("--steps", type=int, default=60, help="measured DDP steps of each kind")
    parser.add_argument("--runs", type=int, default=5, help="rounds of the three jobs (>= 5)")
    args = parser.parse_args()
    if args.cmd == "worker":
        (worker_ddp if args.mode == "ddp" else worker_diloco)(args)
        return 0
    if args.runs < 5:
        parser.error("--runs must be >= 5 (a median and a spread)")
    if args.sync_every < 2 or args.sync_every % 2:
        parser.error("--sync-every must be an even number >= 2")

    h = args.hidden
    params = 256 * h + h + 2 * (h * h + h) + h * 10 + 10
    print(
        f"diloco_comm: MLP 256->{h}->{h}->{h}->10 ({params / 1e6:.2f} M params, "
        f"{params * 4 / 2**20:.1f} MiB fp32), batch 32, 2 processes, Gloo"
    )
    ddps: list[float] = []
    plains: list[float] = []
    streamings: list[float] = []
    with tempfile.TemporaryDirectory(prefix="diloco_comm") as d:
        tmp = Path(d)
        for _ in range(args.runs):
            ddps.append(run_ddp(tmp, args))
            plains.append(run_diloco(tmp, args, fragments=1, sync_every=args.sync_every))
            # Two fragments, each synced every 2 * sync_every steps: one sync every sync_every.
            streamings.append(run_diloco(tmp, args, fragments=2, sync_every=2 * args.sync_every))
    med = statistics.median
    ddp, plain = med(ddps), med(plains)
    n = args.sync_every
    rows = [
        ("plain DDP allreduce", "whole model", ddps, 1),
        ("DiLoCo sync", "whole model", plains, n),
        ("streaming DiLoCo sync", "half (1 of 2 frags)", streamings, n),
    ]
    print(f"  {args.runs} runs each; per sync: median [min, max]")
    print(
        f"  {'':24s} {'payload':18s} {'per sync':>10s} {'[min, max] ms':>17s} {'every':>7s} "
        f"{'per inner step':>15s}"
    )
    for name, payload, ts, every in rows:
        t = med(ts)
        spread = f"[{min(ts) * 1e3:.2f}, {max(ts) * 1e3:.2f}]"
        print(
            f"  {name:24s} {payload:18s} {t * 1e3:8.2f}ms {spread:>17s} {every:5d} st "
            f"{t / every * 1e3:12.3f}ms"
        )
    ratio = (plain / n) / ddp if ddp > 0 else float("inf")
    ok = ratio < 1.0
    print(
        f"  DiLoCo communication per inner step / DDP per step: {ratio:.3f} "
        f"(target < 1: {'ok' if ok else 'MISSED'})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
