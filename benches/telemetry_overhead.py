"""Step time with telemetry on vs off, measured in one run (target: at most 1% apart).

Two replica groups (one process each) train an MLP (256 -> H -> H -> 10, batch 32, AdamW)
with Manager + torchft DDP on Gloo against an in-process lighthouse. Steps rotate, by step
number and in both groups together, through three kinds: telemetry on, off, and off again
(a control). Interleaving step by step makes all three share the machine's background load;
whole-run or block-wise A/B comparisons on this shared machine differ by several percent
with no change at all. The median step time of "on" is compared with "off", and the control
with "off" shows the noise floor of the same run. The slower group's ratio is reported.

It also times the rank-side telemetry work of one step in isolation (the report call, the
timing bookkeeping) as a second, noise-free view of the cost.

Usage: ``python benches/telemetry_overhead.py [--steps N] [--block N] [--hidden H]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _groups import run_two_groups, train_group

HERE = Path(__file__).resolve()
TARGET = 1.01


def worker(args: argparse.Namespace) -> None:
    """One replica group: trains, toggling telemetry every ``block`` steps."""
    import torch
    from torch import nn

    manager, ddp, optim = train_group(args.replica_id, args.hidden, telemetry=True)
    gen = torch.Generator().manual_seed(int(os.environ["RANK_SEED"]))
    tel = manager._telemetry
    assert tel is not None
    times: dict[str, list[float]] = {"on": [], "off": [], "control": []}
    kinds = ["on", "off", "control"]
    total = args.warmup + args.steps
    try:
        while manager.current_step() < total:
            step = manager.current_step()
            kind = kinds[(step // args.block) % 3]
            tel.enabled = kind == "on"
            x = torch.randn(32, 256, generator=gen)
            y = torch.randint(0, 10, (32,), generator=gen)
            start = time.perf_counter()
            optim.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optim.step()
            elapsed = time.perf_counter() - start
            if step >= args.warmup and manager.current_step() == step + 1:
                times[kind].append(elapsed)
    finally:
        manager.shutdown(wait=False)
    Path(args.result).write_text(json.dumps(times))


def isolated_cost(n: int = 20000) -> float:
    """Seconds of rank-side telemetry work per step (report queued, bookkeeping), alone."""
    from torchft.telemetry import RankTelemetry

    class Sink:
        def report(self, **kwargs: Any) -> bool:
            return True

    tel = RankTelemetry(Sink(), "g", "g", 0, 1, "host", enabled=True)
    start = time.perf_counter()
    for i in range(n):
        with tel.quorum_wait():
            pass
        tok = tel.collective_started()
        tel.collective_finished(tok)
        tel.step_ended(
            step=i,
            quorum_id=1,
            participants=2,
            committed=True,
            healed=False,
            should_commit_s=0.0,
            error=None,
            rank=0,
        )
    python_side = (time.perf_counter() - start) / n

    # The native report call itself (queue push, validation) against a real manager server.
    from torchft._torchft import LighthouseServer, ManagerClient, ManagerServer

    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
    server = ManagerServer(
        replica_id="g",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=1,
    )
    try:
        client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=10))
        start = time.perf_counter()
        for i in range(n):
            client.report(
                replica_id="g",
                group_rank=0,
                group_world_size=1,
                step=i,
                committed=True,
                step_s=0.01,
                busy_s=0.009,
                hostname="host",
                unix_s=time.time(),
            )
        native = (time.perf_counter() - start) / n
    finally:
        server.shutdown()
        lighthouse.shutdown()
    return python_side + native


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--block", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--replica-id", required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--warmup", type=int, required=True)
    w.add_argument("--block", type=int, required=True)
    w.add_argument("--hidden", type=int, required=True)
    args = parser.parse_args()
    if args.cmd == "worker":
        worker(args)
        return 0
    if args.steps < 3 * args.block or args.block < 1:
        parser.error("--steps must cover at least three blocks and --block must be >= 1")

    try:
        got = run_two_groups(
            HERE,
            [
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--block",
                str(args.block),
                "--hidden",
                str(args.hidden),
            ],
            timeout_s=900,
        )
    except RuntimeError as e:
        print(e)
        return 1
    ratios, noise = [], []
    print(f"hidden={args.hidden}, {args.steps} steps, kind rotated every {args.block} step(s)")
    print(
        f"{'group':>6} {'on (ms)':>9} {'off (ms)':>9} {'control':>9} "
        f"{'on/(off+ctrl)':>13} {'ctrl/off':>8} {'steps':>6}"
    )
    for i, t in enumerate(got):
        on, off, ctl = (statistics.median(t[k]) for k in ("on", "off", "control"))
        # "on" is compared with every telemetry-off step (off and control pooled).
        pooled = statistics.median(t["off"] + t["control"])
        ratios.append(on / pooled)
        noise.append(ctl / off)
        print(
            f"{'g' + str(i):>6} {on * 1e3:9.3f} {off * 1e3:9.3f} {ctl * 1e3:9.3f} "
            f"{on / pooled:13.4f} {ctl / off:8.4f} {len(t['on']):>6}"
        )
    cost = isolated_cost()
    worst = max(ratios)
    print(f"rank-side telemetry work per step, in isolation: {cost * 1e6:.1f} us")
    print(
        f"step time, telemetry on / off: {worst:.4f} (target <= {TARGET}); "
        f"control / off (noise floor): {max(noise, key=lambda v: abs(v - 1)):.4f}"
    )
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
