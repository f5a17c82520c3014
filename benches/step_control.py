"""Control-plane cost of one step, the way a job runs it: ours against upstream torchft.

Two replica groups of one rank each, each its own process, and the lighthouse in a third
process (``min_replicas=2``). Every step is what a training step does around its compute:
``start_quorum()`` (the async quorum, the default), ``wait_quorum()``, one gradient
``allreduce`` of a small tensor (which keeps the groups in step, as a real step's does: a
group healing at the start is waited for), then ``should_commit()``. Each group times, per
step, the control plane (the two parts below; the allreduce is not counted):

- **quorum**: ``start_quorum`` + ``wait_quorum``: the manager server's round and the
  lighthouse's quorum (fast path);
- **vote**: ``should_commit``: the group's vote and, in ours, the write-ahead commit the
  lighthouse records before a group applies a step.

Configurations, alternated trial by trial in the same run (fresh processes each trial):

- ``ours``: our lighthouse and our managers, telemetry off (``TORCHFT_TELEMETRY=0``, as in
  every configuration but the next: upstream has none);
- ``ours/telemetry``: ``ours`` with telemetry on, as a job runs by default: each step's
  report queued by the rank, forwarded in batches by the manager server and taken in by the
  lighthouse (what telemetry costs the control plane, no target of its own);
- ``upstream``: upstream 0.2.0's (``make bench`` installs it under ``.venv/upstream``);
- ``ours/upstream-lh``: our managers against upstream's lighthouse, which has neither the
  write-ahead commit nor the quorum stream: our path without that round trip (what the
  commit costs, from the votes) and with a new Quorum call per step to upstream's quorum
  engine (the quorums: the stream and the two lighthouses' own costs together);
- ``ours/native-calls``: our lighthouse, and in each group the native calls the Manager makes
  on this path (the manager server's ``_quorum_start`` + ``wait``, ``may_commit``) with a
  plain Gloo allreduce between them, no Python ``Manager``: what the Manager's Python adds
  is ``ours`` minus this;
- ``raw-sockets``: the floor of the exchanges themselves: in place of the lighthouse a hub
  process with one loopback TCP connection (``TCP_NODELAY``) per group, and per step a
  one-byte barrier across the groups (the quorum: answered when both groups asked) and a
  one-byte round trip (the write-ahead commit), Python at both ends, nothing else. What any
  design with a lighthouse barrier and a lighthouse round trip per step costs on this
  machine before it does any work (``ours`` is also given as a multiple of it).

A row is the median over trials of the slower group's per-trial median of the control plane
per step, with the min and max over trials, the p90 of all steps, the same medians of its two
parts, the allreduce's for reference, and the CPU the groups' training threads used per
whole step (the larger of the two groups' medians per trial, then the median over trials;
quorum, allreduce and vote: the Python and the native calls that thread runs itself, not
what it waits for; read between steps, outside the timed parts). ``ours`` minus
``ours/native-calls`` in that column is the extra CPU the training thread spends per whole
step, the allreduce's Python included; work handed to other threads (the allreduce's
completion callback, upstream's quorum worker) is not in it, so rows whose steps hand work
to other threads differently are not comparable in that column. Target: ours <= 0.3 ms per
step; exits 1 when it is missed (2 when upstream is not installed, unless
``--allow-missing-upstream``).

``--check`` runs one short trial of each configuration and checks that every step committed,
without judging the times (the bounded version ``make test`` runs).

Usage: ``python benches/step_control.py [--trials 5] [--steps 2000] [--warmup 200] [--json]
[--check] [--allow-missing-upstream] [--configs ours ours/telemetry upstream
ours/upstream-lh ours/native-calls raw-sockets]``
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _groups import lighthouse_process, percentile

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / ".venv" / "upstream"
TARGET_MS = 0.3
CONFIGS = {
    # name: (lighthouse is upstream's, managers are upstream's)
    "ours": (False, False),
    "ours/telemetry": (False, False),
    "upstream": (True, True),
    "ours/upstream-lh": (True, False),
    "ours/native-calls": (False, False),
    "raw-sockets": (False, False),
}
#: Configurations whose groups make the native calls directly (no Python Manager).
NATIVE_CALLS = {"ours/native-calls"}
#: Configurations that run with telemetry on (the default of a job).
TELEMETRY_ON = {"ours/telemetry"}
#: Configurations with a raw socket hub in place of the lighthouse.
RAW = {"raw-sockets"}
#: Groups per trial (the hub's barrier waits for this many).
GROUPS = 2


def _lighthouse() -> None:
    """Child: a lighthouse for two groups; prints its address, serves until stdin closes."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000)
    print(server.address(), flush=True)
    sys.stdin.read()
    server.shutdown()


def _hub() -> None:
    """Child: the raw-sockets floor's hub; prints its address, then answers each group's
    ``q`` once every group sent one (a barrier) and each ``c`` at once, until stdin closes."""
    import selectors
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{server.getsockname()[1]}", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    waiting: list[socket.socket] = []
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not sys.stdin.readline():
                    return
            elif key.data == "accept":
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sel.register(conn, selectors.EVENT_READ, conn)
            else:
                conn = key.data
                data = conn.recv(64)
                if not data:
                    sel.unregister(conn)
                    conn.close()
                    continue
                for byte in data:
                    if byte == ord("q"):
                        waiting.append(conn)
                        if len(waiting) == GROUPS:
                            for c in waiting:
                                c.sendall(b"Q")
                            waiting.clear()
                    else:
                        conn.sendall(b"C")


def _raw_group(address: str, steps: int, warmup: int, result: str) -> None:
    """Child: one group of the raw-sockets floor: per step the hub's barrier (``q``) and one
    round trip (``c``), timed as :func:`_group` times its quorum and vote."""
    import socket

    host, port = address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(ask: bytes, answer: bytes) -> bool:
        conn.sendall(ask)
        got = conn.recv(1)
        if got != answer:
            raise RuntimeError(f"the hub answered {got!r} to {ask!r}")
        return True

    try:
        _time_steps(
            lambda _: exchange(b"q", b"Q"),
            lambda: None,
            lambda _: exchange(b"c", b"C"),
            steps,
            warmup,
            result,
        )
    finally:
        conn.close()


def _group(address: str, replica_id: str, steps: int, warmup: int, result: str) -> None:
    """Child: one replica group (one rank); times each step and writes them to ``result``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=2,
        load_state_dict=lambda _: None,
        state_dict=lambda: None,
        replica_id=replica_id,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=address,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
    )
    grad = torch.ones(1024)

    def quorum(_: int) -> None:
        manager.start_quorum()
        manager.wait_quorum()

    try:
        _time_steps(
            quorum,
            lambda: manager.allreduce(grad).wait(),
            lambda _: manager.should_commit(),
            steps,
            warmup,
            result,
        )
    finally:
        manager.shutdown(wait=False)


def _time_steps(
    quorum: Callable[[int], object],
    allreduce: Callable[[], object],
    vote: Callable[[int], bool],
    steps: int,
    warmup: int,
    result: str,
) -> None:
    """Runs ``warmup + steps`` steps (quorum and vote of step ``i``, an allreduce between) and writes the
    timed steps' parts in milliseconds, their control plane (quorum + vote), the CPU the
    calling (training) thread used in each whole step (``cpu``: quorum, allreduce and vote;
    read between steps, outside the timed parts) and how many committed to ``result``
    (JSON)."""
    parts: dict[str, list[float]] = {
        "total": [],
        "quorum": [],
        "vote": [],
        "allreduce": [],
        "cpu": [],
    }
    committed = 0
    for i in range(warmup + steps):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        quorum(i)
        t1 = time.perf_counter()
        allreduce()
        t2 = time.perf_counter()
        ok = vote(i)
        t3 = time.perf_counter()
        c1 = time.thread_time()
        if i >= warmup:
            committed += bool(ok)
            parts["quorum"].append((t1 - t0) * 1e3)
            parts["allreduce"].append((t2 - t1) * 1e3)
            parts["vote"].append((t3 - t2) * 1e3)
            parts["total"].append(parts["quorum"][-1] + parts["vote"][-1])
            parts["cpu"].append((c1 - c0) * 1e3)
    Path(result).write_text(json.dumps({**parts, "committed": committed}))


def _native_group(
    address: str, replica_id: str, steps: int, warmup: int, result: str, store_port: int
) -> None:
    """Child: one replica group (one rank) making the Manager's native calls of a step
    directly: the async quorum, a Gloo allreduce (a plain process group over the bench's
    store), the single-rank vote; writes the same timings as :func:`_group`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from torchft.coordination import ManagerServer

    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    rank = int(replica_id.removeprefix("g"))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    server = ManagerServer(
        replica_id=replica_id,
        lighthouse_addr=address,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:0",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timeout,
        quorum_retries=0,
    )
    grad = torch.ones(1024)
    try:
        _time_steps(
            # A group of one rank starts its quorum on the server, as the Manager does.
            lambda i: server._quorum_start(
                group_rank=0, step=i, checkpoint_metadata="", shrink_only=False, timeout=timeout
            ).wait(),
            lambda: dist.all_reduce(grad),
            lambda i: server.may_commit(i, timeout),
            steps,
            warmup,
            result,
        )
    finally:
        server.shutdown()
        dist.destroy_process_group()


def _env(upstream: bool, telemetry: bool = False) -> dict[str, str]:
    env = dict(
        os.environ,
        RUST_LOG="error",
        TORCHFT_TELEMETRY="1" if telemetry else "0",
        OMP_NUM_THREADS="1",
    )
    path = [str(ROOT / "python"), env.get("PYTHONPATH", "")]
    if upstream:
        path.insert(0, str(UPSTREAM))
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return env


def _trial(config: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    """One lighthouse and two groups, each its own process; the groups' results."""
    lh_upstream, mgr_upstream = CONFIGS[config]
    me = str(Path(__file__).resolve())
    with (
        tempfile.TemporaryDirectory(prefix="step_control") as d,
        tempfile.TemporaryFile(mode="w+") as errors,
    ):
        groups: list[subprocess.Popen[str]] = []
        role = ["--role", "group"]
        if config in RAW:
            role = ["--role", "raw-group"]
        if config in NATIVE_CALLS:
            # The two groups' Gloo process group meets on a store of this process.
            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            role = ["--role", "native-group", "--store-port", str(store.port)]
        try:
            hub = "hub" if config in RAW else "lighthouse"
            with lighthouse_process(me, _env(lh_upstream), errors, role=hub) as address:
                results = [Path(d) / f"g{i}.json" for i in range(GROUPS)]
                for i in range(GROUPS):
                    groups.append(
                        subprocess.Popen(
                            [sys.executable, me, *role, "--address", address,
                             "--replica-id", f"g{i}", "--steps", str(steps), "--warmup",
                             str(warmup), "--result", str(results[i])],
                            stderr=errors,
                            text=True,
                            env=_env(mgr_upstream, config in TELEMETRY_ON),
                        )
                    )  # fmt: skip
                deadline = time.monotonic() + 300 + steps * 0.05
                for g in groups:
                    rc = g.wait(timeout=max(1.0, deadline - time.monotonic()))
                    if rc != 0:
                        errors.seek(0)
                        raise RuntimeError(
                            f"{config}: a group exited {rc}:\n{errors.read()[-3000:]}"
                        )
                return [json.loads(r.read_text()) for r in results]
        finally:
            for g in groups:
                if g.poll() is None:
                    g.kill()
                    g.wait()


def main() -> int:
    """Runs the alternating trials and prints the comparison; non-zero on a missed target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--role",
        choices=["bench", "lighthouse", "group", "native-group", "hub", "raw-group"],
        default="bench",
    )
    parser.add_argument("--store-port", type=int, default=0)
    parser.add_argument("--address", default="")
    parser.add_argument("--replica-id", default="")
    parser.add_argument("--result", default="")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--check", action="store_true", help="one short trial each, no target")
    parser.add_argument("--allow-missing-upstream", action="store_true")
    parser.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="rows to run"
    )
    args = parser.parse_args()
    if args.role == "lighthouse":
        _lighthouse()
        return 0
    if args.role == "group":
        _group(args.address, args.replica_id, args.steps, args.warmup, args.result)
        return 0
    if args.role == "hub":
        _hub()
        return 0
    if args.role == "raw-group":
        _raw_group(args.address, args.steps, args.warmup, args.result)
        return 0
    if args.role == "native-group":
        _native_group(
            args.address, args.replica_id, args.steps, args.warmup, args.result, args.store_port
        )
        return 0
    if args.check:
        args.trials, args.steps, args.warmup = 1, 50, 10
    elif args.trials < 5:
        parser.error("--trials must be >= 5 (a median and a spread)")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    have_upstream = (UPSTREAM / "torchft" / "__init__.py").exists()
    needs_upstream = any(any(CONFIGS[c]) for c in args.configs)
    if needs_upstream and not have_upstream and not args.allow_missing_upstream:
        print(f"upstream torchft is not installed under {UPSTREAM.relative_to(ROOT)}: make bench")
        return 2
    configs = [c for c in args.configs if have_upstream or not any(CONFIGS[c])]
    print(
        f"step_control: 2 groups x 1 rank + lighthouse, separate processes; {args.steps} steps "
        f"(quorum, allreduce, vote; the control plane is quorum + vote), {args.trials} trials per configuration, "
        "alternating; per trial the slower group's median",
        flush=True,
    )
    runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in configs}
    for t in range(args.trials):
        for c in configs:
            runs[c].append(_trial(c, args.steps, args.warmup))
        line = ", ".join(
            f"{c} {max(statistics.median(g['total']) for g in runs[c][-1]):.3f}" for c in configs
        )
        print(f"trial {t + 1}/{args.trials} (control plane, ms per step): {line}", flush=True)

    summary: dict[str, dict[str, float]] = {}
    incomplete = []
    print(
        f"{'':18} {'control ms: median':>18} {'[min, max]':>17} {'p90':>7} {'quorum':>7} "
        f"{'vote':>7} {'(allreduce)':>11} {'thread CPU':>10}"
    )
    for c in configs:
        per_trial = {
            part: [max(statistics.median(g[part]) for g in groups) for groups in runs[c]]
            for part in ("total", "quorum", "vote", "allreduce", "cpu")
        }
        every = [s for groups in runs[c] for g in groups for s in g["total"]]
        med = statistics.median(per_trial["total"])
        summary[c] = {
            "median_ms": med,
            "min_ms": min(per_trial["total"]),
            "max_ms": max(per_trial["total"]),
            "p90_ms": percentile(every, 0.9),
            "quorum_ms": statistics.median(per_trial["quorum"]),
            "vote_ms": statistics.median(per_trial["vote"]),
            "allreduce_ms": statistics.median(per_trial["allreduce"]),
            "thread_cpu_ms": statistics.median(per_trial["cpu"]),
        }
        s = summary[c]
        print(
            f"{c:18} {med:18.3f} [{s['min_ms']:6.3f}, {s['max_ms']:6.3f}] {s['p90_ms']:7.3f} "
            f"{s['quorum_ms']:7.3f} {s['vote_ms']:7.3f} {s['allreduce_ms']:11.3f} "
            f"{s['thread_cpu_ms']:10.3f}"
        )
        if any(g["committed"] != args.steps for groups in runs[c] for g in groups):
            incomplete.append(c)
    if "upstream" in summary and "ours" in summary:
        ratio = summary["ours"]["median_ms"] / summary["upstream"]["median_ms"]
        print(f"ours / upstream (medians): {ratio:.2f}")
    if "ours/upstream-lh" in summary and "ours" in summary:
        ours, other = summary["ours"], summary["ours/upstream-lh"]
        cost = ours["vote_ms"] - other["vote_ms"]
        print(f"the write-ahead commit's share of ours (votes): {cost:+.3f} ms per step")
        saved = other["quorum_ms"] - ours["quorum_ms"]
        print(
            f"ours' quorum against upstream's lighthouse (a Quorum call per step there): "
            f"{saved:+.3f} ms less per step"
        )
    if "ours/telemetry" in summary and "ours" in summary:
        cost = summary["ours/telemetry"]["median_ms"] - summary["ours"]["median_ms"]
        print(f"telemetry's share (ours/telemetry - ours): {cost:+.3f} ms per step")
    if "ours/native-calls" in summary and "ours" in summary:
        ours, native = summary["ours"], summary["ours/native-calls"]
        cost = ours["median_ms"] - native["median_ms"]
        cpu = ours["thread_cpu_ms"] - native["thread_cpu_ms"]
        print(f"the Python Manager's share of ours: {cost:+.3f} ms per step")
        print(
            "training thread's CPU per whole step (quorum, allreduce, vote), "
            f"ours - ours/native-calls: {cpu:+.3f} ms"
        )
    if "raw-sockets" in summary and "ours" in summary:
        floor = summary["raw-sockets"]["median_ms"]
        print(
            f"ours / the raw-sockets floor (a barrier and a round trip per step): "
            f"{summary['ours']['median_ms'] / floor:.2f}x ({floor:.3f} ms)"
        )
    for c in incomplete:
        print(f"{c}: not every step committed (a step that did not commit is not a fast path)")
    met = "ours" not in summary or summary["ours"]["median_ms"] <= TARGET_MS
    if "ours" in summary:
        print(
            f"target ours <= {TARGET_MS} ms of control plane per step: {'met' if met else 'MISSED'}"
        )
    if args.json:
        print(json.dumps(summary))
    if incomplete:
        return 1
    if args.check:
        return 0
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
