"""Control-plane cost per training step, measured through the Python bindings.

One replica group (world_size 1) against an in-process lighthouse (min_replicas 1). Each step
does what ``torchft.Manager`` does on the fast path: ``ManagerClient._quorum(...)`` then
``ManagerClient.should_commit(...)``. Next to it, in the same run, the bare lighthouse fast-path
RPC (``LighthouseClient.quorum``) on a second lighthouse: the floor one gRPC hop costs here.
And the same manager step with the job secured (token + mutual TLS on the lighthouse and the
manager server, see docs/security.md): the cost of authentication and encryption per step.

Each of ``--runs`` runs (>= 5) sets everything up afresh and times ``--steps`` steps of
each; a row prints the median of the runs' medians with their min and max, and the p90 and
p99 of all steps. Target: the manager step's median (of the runs' medians) <= 0.5 ms; exits 1
when it is missed.

Usage: ``python benches/control_plane.py [--runs 5] [--steps 1000] [--warmup 200] [--json]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

from _groups import percentile

from torchft._torchft import QuorumRequest
from torchft.coordination import LighthouseClient, LighthouseServer, ManagerClient, ManagerServer

logger: logging.Logger = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=10)
TARGET_MEDIAN_MS = 0.5
REFERENCE_MEDIAN_MS = 0.7


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


CERTS = Path(__file__).resolve().parent.parent / "tests" / "certs"


@contextlib.contextmanager
def _secured() -> Iterator[None]:
    """Servers and clients created inside use a token and mutual TLS (test certificates)."""
    with tempfile.TemporaryDirectory() as d:
        token = Path(d) / "token"
        token.write_text("bench-token-" + "x" * 32)
        env = {
            "TORCHFT_TOKEN_FILE": str(token),
            "TORCHFT_TLS_CERT": str(CERTS / "server.pem"),
            "TORCHFT_TLS_KEY": str(CERTS / "server.key"),
            "TORCHFT_TLS_CA": str(CERTS / "ca.pem"),
            "TORCHFT_TLS_CLIENT_CA": str(CERTS / "ca.pem"),
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _manager_setup() -> tuple[Callable[[int], None], Callable[[], None]]:
    """A lighthouse, a one-rank group's manager server and its client: (step, cleanup)."""
    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
    try:
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
    except BaseException:
        lighthouse.shutdown()
        raise
    client = ManagerClient(server.address(), timedelta(seconds=10))

    def step(i: int) -> None:
        result = client._quorum(
            QuorumRequest(group_rank=0, step=i, checkpoint_metadata="", shrink_only=False), TIMEOUT
        )
        if result.heal or result.max_step != i:
            raise RuntimeError(f"unexpected quorum result at step {i}: {result}")
        if not client.should_commit(0, i, True, TIMEOUT):
            raise RuntimeError(f"step {i} did not commit")

    def cleanup() -> None:
        server.shutdown()
        lighthouse.shutdown()

    return step, cleanup


def bench_manager_steps(steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Per-step ``_quorum`` + ``should_commit`` latency (ms) of a one-rank replica group,
    plain and with a token and mutual TLS on every hop, alternating step by step so both see
    the same machine load.

    Args:
        steps: timed steps of each.
        warmup: untimed steps first (connections, first quorum).

    Returns:
        (plain samples, secured samples), in milliseconds.
    """
    plain_step, plain_cleanup = _manager_setup()
    try:
        with _secured():
            secure_step, secure_cleanup = _manager_setup()
        try:
            for i in range(warmup):
                plain_step(i)
                secure_step(i)
            plain: list[float] = []
            secure: list[float] = []
            for i in range(warmup, warmup + steps):
                for fn, out in ((plain_step, plain), (secure_step, secure)):
                    t0 = time.perf_counter()
                    fn(i)
                    out.append((time.perf_counter() - t0) * 1e3)
            return plain, secure
        finally:
            secure_cleanup()
    finally:
        plain_cleanup()


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


def main() -> int:
    """Runs both measurements and prints a comparison (or JSON with ``--json``); exits 1
    when the manager step's median misses its target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh setups (>= 5)")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    args = parser.parse_args()
    if args.runs < 5 or args.steps < 1:
        parser.error("--runs must be >= 5 (a median and a spread) and --steps >= 1")

    names = (
        "manager step (_quorum + should_commit)",
        "lighthouse quorum RPC alone",
        "manager step, token + mutual TLS",
    )
    samples: dict[str, list[float]] = {n: [] for n in names}
    run_medians: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.runs):
        manager, secured = bench_manager_steps(args.steps, args.warmup)
        direct = bench_lighthouse_rpc(args.steps, args.warmup)
        for name, s in zip(names, (manager, direct, secured), strict=True):
            samples[name] += s
            run_medians[name].append(statistics.median(s))
    summary = {
        name: {
            "median_ms": statistics.median(run_medians[name]),
            "min_run_median_ms": min(run_medians[name]),
            "max_run_median_ms": max(run_medians[name]),
            "p90_ms": percentile(samples[name], 0.9),
            "p99_ms": percentile(samples[name], 0.99),
        }
        for name in names
    }
    median = summary[names[0]]["median_ms"]
    floor = summary[names[1]]["median_ms"]
    secure_median = summary[names[2]]["median_ms"]
    met = median <= TARGET_MEDIAN_MS
    if args.json:
        out = {"runs": args.runs, "steps": args.steps, "results": summary, "target_met": met}
        print(json.dumps(out, indent=2))
        return 0 if met else 1
    print(
        f"control plane per step: {args.runs} runs of {args.steps} steps (after {args.warmup} "
        "warm-up each); median of the runs' medians [min, max], p90/p99 of all steps"
    )
    print(f"{'':42s} {'median ms':>10s} {'[min, max]':>17s} {'p90 ms':>8s} {'p99 ms':>8s}")
    for name, s in summary.items():
        spread = f"[{s['min_run_median_ms']:.3f}, {s['max_run_median_ms']:.3f}]"
        print(
            f"{name:42s} {s['median_ms']:10.3f} {spread:>17s} {s['p90_ms']:8.3f} {s['p99_ms']:8.3f}"
        )
    print(
        f"manager step / bare lighthouse RPC: {median / floor:.2f}x; "
        f"target median <= {TARGET_MEDIAN_MS} ms (reference {REFERENCE_MEDIAN_MS} ms): "
        f"{'met' if met else 'MISSED'}"
    )
    print(
        f"token + mutual TLS / plain manager step: {secure_median / median:.2f}x "
        f"(+{secure_median - median:.3f} ms per step)"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
