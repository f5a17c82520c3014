"""First-quorum latency of a fresh job: ours against upstream torchft's published wheel.

Each trial starts a fresh lighthouse in its own process (``LighthouseServer(bind="[::]:0",
min_replicas=1, join_timeout_ms=100)``, as upstream's own test does), then a replica group's
process that builds a ``Manager(use_async_quorum=False)`` and times its first
``start_quorum()``: what every job start (and every test) pays before its first step. The
same trials run against upstream 0.2.0 (installed by ``make bench`` under ``.venv/upstream``
and put first on ``PYTHONPATH``), alternating with ours in the same run.

Target: our median within 1.5x of upstream's (plus 20 ms of slack for the noise of a shared
machine), and below the 0.4 s upstream's test allows. Exits non-zero on a miss, or when
upstream's wheel is missing (``--allow-missing-upstream`` reports ours alone).

``--check`` runs one trial of each and checks that both measured a first quorum, without
judging the times (the bounded version ``make test`` runs).

Usage: ``python benches/first_quorum.py [--trials 7] [--json] [--check]``
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
from pathlib import Path

from _groups import lighthouse_process

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / ".venv" / "upstream"
TARGET_RATIO = 1.5
SLACK_S = 0.02
UPSTREAM_TEST_BOUND_S = 0.4


def _lighthouse() -> None:
    """Child: a fresh lighthouse; prints its address, serves until stdin closes."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    print(server.address(), flush=True)
    sys.stdin.read()
    server.shutdown()


def _job(address: str) -> None:
    """Child: one replica group's process; prints the first quorum's latency in seconds."""
    from datetime import timedelta

    import torch.distributed as dist

    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=lambda _: None,
        state_dict=lambda: None,
        replica_id="bench",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        use_async_quorum=False,
        lighthouse_addr=address,
        quorum_timeout=timedelta(seconds=30),
    )
    t0 = time.perf_counter()
    manager.start_quorum()
    elapsed = time.perf_counter() - t0
    manager.shutdown(wait=False)
    print(json.dumps({"first_quorum_s": elapsed}), flush=True)


def _env(upstream: bool) -> dict[str, str]:
    env = dict(os.environ, RUST_LOG="error", TORCHFT_TELEMETRY="0")
    if upstream:
        env["PYTHONPATH"] = os.pathsep.join([str(UPSTREAM), env.get("PYTHONPATH", "")])
    return env


def _trial(upstream: bool) -> float:
    """One fresh lighthouse and one job, each its own process; the job's first quorum (s)."""
    env = _env(upstream)
    me = str(Path(__file__).resolve())
    with (
        tempfile.TemporaryFile(mode="w+") as errors,
        lighthouse_process(me, env, errors) as address,
    ):
        out = subprocess.run(
            [sys.executable, me, "--role", "job", "--address", address],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"job process failed:\n{out.stderr[-2000:]}")
    line = out.stdout.strip().splitlines()[-1]
    return float(json.loads(line)["first_quorum_s"])


def _summary(samples: list[float]) -> str:
    med = statistics.median(samples)
    return (
        f"median {med * 1e3:7.1f} ms  min {min(samples) * 1e3:7.1f}  max {max(samples) * 1e3:7.1f}"
        f"  (n={len(samples)})"
    )


def main() -> int:
    """Runs the alternating trials and prints the comparison; non-zero on a missed target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["bench", "lighthouse", "job"], default="bench")
    parser.add_argument("--address", default="")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--allow-missing-upstream", action="store_true")
    parser.add_argument("--check", action="store_true", help="one trial each, no targets")
    args = parser.parse_args()
    if args.role == "lighthouse":
        _lighthouse()
        return 0
    if args.role == "job":
        _job(args.address)
        return 0
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.check:
        args.trials = 1
    have_upstream = (UPSTREAM / "torchft" / "__init__.py").exists()
    if not have_upstream and not args.allow_missing_upstream:
        print(
            f"upstream torchft is not installed under {UPSTREAM.relative_to(ROOT)}: run make bench"
        )
        return 2
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(args.trials):
        ours.append(_trial(upstream=False))
        if have_upstream:
            theirs.append(_trial(upstream=True))
        print(
            f"trial {i + 1}/{args.trials}: ours {ours[-1] * 1e3:.1f} ms"
            + (f", upstream {theirs[-1] * 1e3:.1f} ms" if theirs else ""),
            flush=True,
        )
    med = statistics.median(ours)
    print(f"first quorum, ours:     {_summary(ours)}")
    ok = med < UPSTREAM_TEST_BOUND_S
    result: dict[str, object] = {"ours_s": ours, "ours_median_s": med}
    if theirs:
        up = statistics.median(theirs)
        ratio = med / up if up > 0 else float("inf")
        print(f"first quorum, upstream: {_summary(theirs)}")
        print(f"ratio ours/upstream (medians): {ratio:.2f} (target <= {TARGET_RATIO})")
        ok = ok and med <= TARGET_RATIO * up + SLACK_S
        result.update(upstream_s=theirs, upstream_median_s=up, ratio=ratio)
    print(
        f"target: median < {UPSTREAM_TEST_BOUND_S}s (upstream's test bound)"
        f"{' and within the ratio' if theirs else ''}: {'met' if ok else 'MISSED'}"
    )
    if args.json:
        print(json.dumps(result))
    if args.check:
        return 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
