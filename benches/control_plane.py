"""Control-plane cost per training step, measured through the Python bindings.

One replica group (world_size 1) against an in-process lighthouse (min_replicas 1). Each step
does what ``torchft.Manager`` does on the fast path: ``ManagerClient._quorum(...)`` then
``ManagerClient.should_commit(...)``. Next to it, in the same run, the bare lighthouse fast-path
RPC (``LighthouseClient.quorum``) on a second lighthouse: the floor one gRPC hop costs here.

Usage: ``python benches/control_plane.py [--steps 2000] [--warmup 200] [--json]``
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

from torchft.coordination import LighthouseClient, LighthouseServer, ManagerClient, ManagerServer

logger: logging.Logger = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=10)
TARGET_MEDIAN_MS = 0.5
REFERENCE_MEDIAN_MS = 0.7


def _percentile(samples: list[float], q: float) -> float:
    """The q-quantile (0..1) of samples, nearest-rank."""
    ordered = sorted(samples)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


def _time_steps(step_fn: Callable[[int], None], steps: int, warmup: int) -> list[float]:
    """Runs ``step_fn(i)`` warmup + steps times; returns the timed steps in milliseconds."""
    for i in range(warmup):
        step_fn(i)
    samples: list[float] = []
    for i in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        step_fn(i)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def bench_manager_step(steps: int, warmup: int) -> list[float]:
    """Per-step ``_quorum`` + ``should_commit`` latency (ms) of a one-rank replica group.

    Args:
        steps: timed steps.
        warmup: untimed steps first (connections, first quorum).

    Returns:
        One latency sample per timed step, in milliseconds.
    """
    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
    server = ManagerServer(
        replica_id="bench",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:29500",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=10),
        quorum_retries=0,
    )
    try:
        client = ManagerClient(server.address(), timedelta(seconds=10))

        def step(i: int) -> None:
            result = client._quorum(0, i, "", False, TIMEOUT, 0)
            if result.heal or result.max_step != i:
                raise RuntimeError(f"unexpected quorum result at step {i}: {result}")
            if not client.should_commit(0, i, True, TIMEOUT):
                raise RuntimeError(f"step {i} did not commit")

        return _time_steps(step, steps, warmup)
    finally:
        server.shutdown()
        lighthouse.shutdown()


def bench_lighthouse_rpc(steps: int, warmup: int) -> list[float]:
    """Latency (ms) of the bare lighthouse fast-path quorum RPC, for comparison.

    Args:
        steps: timed calls.
        warmup: untimed calls first.

    Returns:
        One latency sample per timed call, in milliseconds.
    """
    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
    try:
        client = LighthouseClient(lighthouse.address(), timedelta(seconds=10))

        def step(i: int) -> None:
            client.quorum(
                "direct",
                TIMEOUT,
                address="http://127.0.0.1:1",
                store_address="127.0.0.1:2",
                step=i,
                world_size=1,
            )

        return _time_steps(step, steps, warmup)
    finally:
        lighthouse.shutdown()


def main() -> None:
    """Runs both measurements and prints a comparison (or JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    args = parser.parse_args()

    manager = bench_manager_step(args.steps, args.warmup)
    direct = bench_lighthouse_rpc(args.steps, args.warmup)
    rows = {
        "manager step (_quorum + should_commit)": manager,
        "lighthouse quorum RPC alone": direct,
    }
    summary = {
        name: {
            "median_ms": statistics.median(s),
            "p90_ms": _percentile(s, 0.9),
            "p99_ms": _percentile(s, 0.99),
        }
        for name, s in rows.items()
    }
    median = summary["manager step (_quorum + should_commit)"]["median_ms"]
    floor = summary["lighthouse quorum RPC alone"]["median_ms"]
    if args.json:
        print(json.dumps({"steps": args.steps, "results": summary}, indent=2))
        return
    print(f"control plane per step, {args.steps} steps (after {args.warmup} warm-up)")
    print(f"{'':42s} {'median ms':>10s} {'p90 ms':>8s} {'p99 ms':>8s}")
    for name, s in summary.items():
        print(f"{name:42s} {s['median_ms']:10.3f} {s['p90_ms']:8.3f} {s['p99_ms']:8.3f}")
    print(
        f"manager step / bare lighthouse RPC: {median / floor:.2f}x; "
        f"target median <= {TARGET_MEDIAN_MS} ms (reference {REFERENCE_MEDIAN_MS} ms): "
        f"{'met' if median <= TARGET_MEDIAN_MS else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
