"""Where a fault-tolerant DDP step's time goes, by torchft entry point, measured as users run it.

Runs the torchft side of ``ddp_overhead.py`` (a lighthouse and two replica groups of one rank
each, separate processes, Gloo, the MLP of hidden size ``--hidden``, AdamW) with each entry
point of the step wrapped, and prints per step the thread CPU and the wall time spent inside
each: the quorum's start (in ``zero_grad``) and its wait (at the first gradient bucket), each
bucket's allreduce and its native issue, the commit vote, the step's telemetry report, the
completion callbacks on the backend's thread, and for scale the forward pass and the wrapped
optimizer's own step. Entries nest as indented (a parent includes its children). Figures are
means over the loop's iterations after the first ``--warmup`` (committed or not; a step ends
when the optimizer wrapper's step returns, and a completion callback that runs after that
counts in the next) and over both ranks, then the median over ``--runs`` runs; ``calls`` is
per step. A completion callback runs on the backend's thread, or inline on the training
thread when its collective was done as it was chained.

On a loaded machine a call costs several times what it does in a hot loop (the step's
compute evicts the caches every call needs): this is why the profile is taken in the real
job's processes, not a micro-benchmark. The wrappers add about a microsecond of CPU per call.

A profile, not a benchmark: no target. Exits 1 when an entry point it hooks was never
called (the code it names moved: the table below needs the new name).

Usage: ``python benches/step_profile.py [--hidden 1024] [--steps 1000] [--warmup 50]
[--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import ddp_overhead  # noqa: E402

#: (label, module, owner or "" for a module-level function, attribute); the label's leading
#: spaces show the nesting.
ENTRIES: list[tuple[str, str, str, str]] = [
    ("OptimizerWrapper.zero_grad", "torchft.optim", "OptimizerWrapper", "zero_grad"),
    ("  Manager.start_quorum", "torchft.manager", "Manager", "start_quorum"),
    ("    start_pending (native send)", "torchft.manager", "", "start_pending"),
    ("DistributedDataParallel.forward", "torchft.ddp", "DistributedDataParallel", "forward"),
    ("Manager.allreduce (each bucket)", "torchft.manager", "Manager", "allreduce"),
    (
        "  PendingQuorum._adopt (native wait, adopt)",
        "torchft.quorum_group",
        "PendingQuorum",
        "_adopt",
    ),
    ("  ProcessGroup.allreduce (native issue)", "torch.distributed", "ProcessGroup", "allreduce"),
    ("_Mirror._on_done (completion)", "torchft.work", "_Mirror", "_on_done"),
    ("OptimizerWrapper.step", "torchft.optim", "OptimizerWrapper", "step"),
    ("  Manager.should_commit", "torchft.manager", "Manager", "should_commit"),
    ("    vote (native)", "torchft.manager", "", "vote"),
    ("    Manager._report_step (telemetry)", "torchft.manager", "Manager", "_report_step"),
    ("  AdamW.step (the wrapped optimizer)", "torch.optim", "AdamW", "step"),
]


class _Profile:
    """Per-step sums of thread CPU, wall time and calls by entry, closed at each step's end
    (the outermost ``OptimizerWrapper.step`` returning)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: dict[str, list[float]] = {}
        self.steps: list[dict[str, list[float]]] = []

    def add(self, label: str, cpu: float, wall: float) -> None:
        with self._lock:
            e = self._step.setdefault(label, [0.0, 0.0, 0.0])
            e[0] += cpu
            e[1] += wall
            e[2] += 1

    def close_step(self) -> None:
        with self._lock:
            self.steps.append(self._step)
            self._step = {}


def _wrap(profile: _Profile, label: str, fn: Callable[..., Any], last: bool) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            profile.add(label, time.thread_time() - c0, time.perf_counter() - t0)
            if last:
                profile.close_step()

    return wrapped


def install(profile: _Profile) -> None:
    """Wraps every entry of :data:`ENTRIES` (before the worker builds its objects)."""
    import importlib

    for label, module, owner, attr in ENTRIES:
        target: Any = importlib.import_module(module)
        if owner:
            target = getattr(target, owner)
        last = label == "OptimizerWrapper.step"
        setattr(target, attr, _wrap(profile, label, getattr(target, attr), last))


def summarize(steps: list[dict[str, list[float]]], warmup: int) -> dict[str, list[float]]:
    """Per entry, the mean per step of [CPU ms, wall ms, calls] over the steps after
    ``warmup`` (an entry absent from a step counts zero there)."""
    kept = steps[warmup:]
    out: dict[str, list[float]] = {}
    for label, *_ in ENTRIES:
        sums = [0.0, 0.0, 0.0]
        for s in kept:
            e = s.get(label)
            if e is not None:
                sums = [a + b for a, b in zip(sums, e, strict=True)]
        n = max(len(kept), 1)
        out[label] = [sums[0] * 1e3 / n, sums[1] * 1e3 / n, sums[2] / n]
    return out


def worker() -> None:
    """A replica group's process: ``ddp_overhead``'s worker with the entries wrapped; writes
    the summary to ``$STEP_PROFILE_OUT.<pid>.json`` at exit."""
    profile = _Profile()
    install(profile)
    warmup = int(sys.argv[sys.argv.index("--warmup") + 1])
    try:
        ddp_overhead.main()
    finally:
        out = os.environ.get("STEP_PROFILE_OUT")
        if out:
            Path(f"{out}.{os.getpid()}.json").write_text(
                json.dumps(summarize(profile.steps, warmup))
            )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.runs < 1 or args.hidden < 1:
        parser.error("--steps, --runs and --hidden must be >= 1, --warmup >= 0")
    ddp_overhead._ALLOCATOR_ENV.update(ddp_overhead.PINNED_ALLOCATOR)
    runs: list[dict[str, list[float]]] = []
    steps: list[float] = []
    with tempfile.TemporaryDirectory(prefix="step_profile") as d:
        tmp = Path(d)
        for i in range(args.runs):
            step = ddp_overhead.run_ft(
                tmp,
                args.hidden,
                args.steps,
                args.warmup,
                script=HERE,
                env_extra={"STEP_PROFILE_OUT": str(tmp / f"profile_{i}")},
            )
            steps.append(step)
            ranks = [json.loads(p.read_text()) for p in tmp.glob(f"profile_{i}.*.json")]
            if len(ranks) != 2:
                raise RuntimeError(f"run {i}: {len(ranks)} of 2 ranks wrote their profile")
            runs.append(
                {
                    label: [statistics.mean(r[label][k] for r in ranks) for k in range(3)]
                    for label, *_ in ENTRIES
                }
            )
    print(
        f"step_profile: MLP 256->{args.hidden}->{args.hidden}->10, 2 replica groups of one "
        f"rank, Gloo, {args.steps} steps after {args.warmup} of warmup, {args.runs} run(s); "
        f"median step {statistics.median(steps) * 1e3:.2f} ms"
    )
    print(
        f"  {'entry (per step; a parent includes its children)':50s} {'CPU ms':>8s} "
        f"{'wall ms':>8s} {'calls':>6s}"
    )
    missing = []
    for label, *_ in ENTRIES:
        cpu, wall, calls = (statistics.median(r[label][k] for r in runs) for k in range(3))
        print(f"  {label:50s} {cpu:8.3f} {wall:8.3f} {calls:6.2f}")
        if calls == 0:
            missing.append(label.strip())
    if missing:
        print(f"MISSED: never called (renamed or moved?): {', '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
