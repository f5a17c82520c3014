"""Per-step overhead of fault-tolerant DDP against plain torch DDP, measured in one run.

Both sides train the same MLP (256 -> H -> H -> 10, batch 32, AdamW) with two processes on
Gloo (CPU):

- plain: ``torch.nn.parallel.DistributedDataParallel`` over one Gloo process group;
- torchft: two replica groups of one rank each and a lighthouse (min_replicas=2), each its own
  process, ``Manager`` + ``torchft.DistributedDataParallel`` + ``torchft.Optimizer``;
- upstream: the same script on upstream torchft 0.2.0's published wheel (its managers and its
  lighthouse; ``make bench`` installs it under ``.venv/upstream``), when it is installed.

It prints the median step time of each and their ratio (torchft / plain) per hidden size, and
the recovery time: from the start of a killed group's replacement process to its first
committed step (which includes healing from the live group).

Plain, torchft and upstream runs alternate ``--rounds`` times (>= 5), so slow drifts of the
machine's load fall on every side alike; each side prints the median of its runs' medians
with their min and max, and each ratio is that of two medians. Targets (ours against plain
DDP): ratio <= 1.3 at H=256 and <= 1.05 at H=1024 (the step at its floor); exits 1 when one
is missed. Upstream's ratio is printed beside ours, with no target.

Every worker of every side runs with the same fixed glibc allocator thresholds
(``--allocator pinned``, the default). With glibc's adaptive ones, whether a process hands
its step's temporaries back to the kernel and faults them in again is settled by its early
allocations, process by process and on either side: one that does spends about 3 ms more per
step at H=1024 (about 2,000 page faults), a spread that has nothing to do with the code
measured. ``--allocator default`` measures with glibc's own behaviour. Each side prints its
minor page faults per step, which shows the regime a run was in.

Each side also prints where its CPU goes: milliseconds per step and process (the timed
steps' window, the ranks' mean, the median over runs) in all and by thread kind, the
training thread (``main``), Gloo's I/O loop and worker threads, the native runtime
(``torchft-rt``) and the threads named as the process (``python``: Python's helper threads
and unnamed native ones), torchft's each against plain DDP's. On a machine whose cores the
processes fill, the step time follows that CPU; torchft's lighthouse, a third process that
answers every step's quorum and commit, is not in these figures.

Usage: ``python benches/ddp_overhead.py [--steps N] [--warmup N] [--hidden 256 1024]
[--no-upstream] [--allocator pinned|default]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import signal
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
UPSTREAM = HERE.parent.parent / ".venv" / "upstream"


# ----------------------------------------------------------------------------- workers


def _model(hidden: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def _write(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _minor_faults() -> int:
    """This process's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _thread_cpu() -> dict[str, tuple[str, float]]:
    """CPU seconds each live thread of this process has used, by thread id with its kind:
    ``main`` (the training thread, which calls this), else its name as the OS knows it
    (``gloo_tcp_loop``, ``pt_gloo_runloop``, ``torchft-rt``; Python's own threads and unnamed
    native ones carry the process's name, ``python``); and ``all``, the whole process's
    (threads that already exited included). Nanosecond clocks: the scheduler's for the other
    threads, the thread's own CPU clock for this one."""
    out: dict[str, tuple[str, float]] = {}
    pid = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == pid:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # exited meanwhile: counted in "all" only
            continue
        out[tid] = (name, ns / 1e9)
    out[str(pid)] = ("main", time.thread_time())  # called from the training thread
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["all"] = ("all", usage.ru_utime + usage.ru_stime)
    return out


def _cpu_per_step(before: dict[str, tuple[str, float]] | None, steps: int) -> dict[str, float]:
    """Milliseconds of CPU per step by thread kind since ``before`` (see :func:`_thread_cpu`):
    each thread's own difference, so one that started or ended in between only adds what it
    used inside the window (an exited one's share shows in ``all`` only)."""
    if before is None or steps <= 0:
        return {}
    out: dict[str, float] = {}
    for key, (kind, seconds) in _thread_cpu().items():
        start = before.get(key)
        used = seconds - (start[1] if start is not None and start[0] == kind else 0.0)
        out[kind] = out.get(kind, 0.0) + used * 1e3 / steps
    return out


def worker_plain(args: argparse.Namespace) -> None:
    """One rank of plain torch DDP."""
    import torch
    import torch.distributed as dist
    from torch import nn

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model = nn.parallel.DistributedDataParallel(_model(args.hidden))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    times = []
    faults = 0
    cpu0 = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            cpu0 = _thread_cpu()
        x = torch.randn(32, 256, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        f0 = _minor_faults()
        start = time.perf_counter()
        optim.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            faults += _minor_faults() - f0
    cpu = _cpu_per_step(cpu0, args.steps)
    dist.barrier()
    dist.destroy_process_group()
    _write(
        args.result,
        {"times": times, "faults_per_step": faults / max(len(times), 1), "cpu_ms": cpu},
    )


def worker_ft(args: argparse.Namespace) -> None:
    """One replica group (one rank) of torchft DDP."""
    import torch
    from torch import nn

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    rank_seed = int(os.environ.get("BENCH_SEED", "0"))
    model = _model(args.hidden)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=int(os.environ.get("BENCH_MIN", "2")),
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        replica_id=args.replica_id,
    )
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    gen = torch.Generator().manual_seed(rank_seed)
    times = []
    faults = 0
    first_commit: float | None = None
    total = args.warmup + args.steps
    cpu0 = None
    window = 0  # steps run (committed or not) since cpu0
    try:
        while manager.current_step() < total:
            if cpu0 is None and manager.current_step() >= args.warmup:
                cpu0 = _thread_cpu()
            if cpu0 is not None:
                window += 1
            x = torch.randn(32, 256, generator=gen)
            y = torch.randint(0, 10, (32,), generator=gen)
            f0 = _minor_faults()
            start = time.perf_counter()
            optim.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            # The quorum (and any heal) finished inside backward: this is the voted step.
            before = manager.current_step()
            optim.step()
            elapsed = time.perf_counter() - start
            committed_step = manager.current_step()
            committed = committed_step == before + 1
            if first_commit is None and committed:
                first_commit = time.time()
                _write(args.result + ".first", {"t": first_commit, "step": committed_step})
            if before >= args.warmup and committed:
                times.append(elapsed)
                faults += _minor_faults() - f0
            if args.progress:
                _write(args.progress, {"step": committed_step})
        cpu = _cpu_per_step(cpu0, window)
    finally:
        manager.shutdown(wait=False)
    _write(
        args.result,
        {"times": times, "faults_per_step": faults / max(len(times), 1), "cpu_ms": cpu},
    )


def serve_lighthouse(min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> None:
    """A lighthouse of whichever torchft is first on the path: prints its address, then serves
    until stdin closes."""
    from torchft.coordination import LighthouseServer

    kwargs: dict[str, Any] = {"min_replicas": min_replicas, "join_timeout_ms": join_timeout_ms}
    if heartbeat_timeout_ms:
        kwargs["heartbeat_timeout_ms"] = heartbeat_timeout_ms
    server = LighthouseServer(bind="[::]:0", **kwargs)
    print(server.address(), flush=True)
    sys.stdin.read()
    server.shutdown()


# ----------------------------------------------------------------------------- driver


def _pythonpath(upstream: bool) -> str:
    path = [REPO_PYTHON, os.environ.get("PYTHONPATH", "")]
    if upstream:
        path.insert(0, str(UPSTREAM))
    return os.pathsep.join(p for p in path if p)


class _Lighthouse:
    """A lighthouse process (ours or upstream's); ``address`` once started (RuntimeError if
    it reports none within a minute). Closing its stdin ends it (killed if it lingers)."""

    def __init__(
        self,
        upstream: bool,
        min_replicas: int,
        join_timeout_ms: int,
        heartbeat_timeout_ms: int = 0,
    ) -> None:
        env = dict(os.environ, PYTHONPATH=_pythonpath(upstream), RUST_LOG="error")
        args = [str(min_replicas), str(join_timeout_ms), str(heartbeat_timeout_ms)]
        self._proc = subprocess.Popen(
            [sys.executable, str(HERE), "lighthouse", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], 60)
        self.address = self._proc.stdout.readline().strip() if ready else ""
        # Nothing else is read from it: a line it printed later must not block it.
        self._proc.stdout.close()
        if not self.address:
            self.close()
            raise RuntimeError("the lighthouse process did not report its address")

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _spawn(
    mode: str,
    rank: int,
    store_port: int,
    extra: list[str],
    env_extra: dict[str, str],
    script: Path = HERE,
):
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2" if mode == "plain" else "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store_port),
            "PYTHONPATH": _pythonpath(mode == "upstream"),
            "OMP_NUM_THREADS": "1",
            **_ALLOCATOR_ENV,
        }
    )
    if mode == "upstream":
        env["RUST_LOG"] = "error"  # upstream's managers log every step at INFO otherwise
    env.update(env_extra)
    worker_mode = "ft" if mode == "upstream" else mode
    cmd = [sys.executable, str(script), "worker", "--mode", worker_mode, *extra]
    return subprocess.Popen(cmd, env=env)


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"worker exited with {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


#: Per side (plain, ft, upstream), each run's minor page faults per step (its ranks' mean).
_FAULTS: dict[str, list[float]] = {}
#: Fixed glibc thresholds (bytes) for ``--allocator pinned``: no freed block is handed back
#: to the kernel and none is served by its own mapping, so no step faults its memory in.
PINNED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
#: The allocator environment every worker gets (set by ``main`` from ``--allocator``).
_ALLOCATOR_ENV: dict[str, str] = {}


#: Per side, each run's CPU milliseconds per step by thread kind (its ranks' mean).
_CPU: dict[str, list[dict[str, float]]] = {}


def _median_of(paths: list[Path], side: str) -> float:
    results = [json.loads(p.read_text()) for p in paths]
    faults = [r.get("faults_per_step", 0.0) for r in results]
    _FAULTS.setdefault(side, []).append(statistics.mean(faults))
    cpus = [r["cpu_ms"] for r in results if r.get("cpu_ms")]
    if cpus:
        kinds = {k for c in cpus for k in c}
        _CPU.setdefault(side, []).append(
            {k: statistics.mean(c.get(k, 0.0) for c in cpus) for k in kinds}
        )
    return max(statistics.median(r["times"]) for r in results)  # the slower rank bounds the step


def _cpu_line(side: str, base: str | None = None) -> str:
    """Where ``side``'s CPU per step and process goes (medians over the runs), by thread kind,
    each against ``base``'s when given, the largest increase first; empty without data. Each
    figure is its own median, so the kinds need not add up to ``all``."""
    runs, base_runs = _CPU.get(side, []), _CPU.get(base, []) if base else []
    if not runs or (base and not base_runs):
        return ""

    def med(rs: list[dict[str, float]], kind: str) -> float:
        return statistics.median(r.get(kind, 0.0) for r in rs) if rs else 0.0

    def vs(kind: str) -> str:
        return f" ({med(runs, kind) - med(base_runs, kind):+.2f})" if base else ""

    kinds = {k for r in runs + base_runs for k in r} - {"all"}
    order = sorted(kinds, key=lambda k: (med(base_runs, k) - med(runs, k), k))
    parts = ", ".join(
        f"{k} {med(runs, k):.2f}{vs(k)}"
        for k in order
        if max(med(runs, k), med(base_runs, k)) >= 0.01
    )
    against = f" against {base}" if base else ""
    return f"{med(runs, 'all'):.2f} ms{vs('all')}{against}: {parts}"


def _faults(side: str) -> str:
    runs = _FAULTS.pop(side, [])
    return f"{statistics.median(runs):6.0f} faults/step" if runs else ""


def run_plain(tmp: Path, hidden: int, steps: int, warmup: int) -> float:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = [tmp / f"plain_{hidden}_{r}.json" for r in range(2)]
    common = ["--hidden", str(hidden), "--steps", str(steps), "--warmup", str(warmup)]
    procs = [
        _spawn("plain", r, store.port, [*common, "--result", str(results[r])], {}) for r in range(2)
    ]
    _wait(procs, 600)
    return _median_of(results, "plain")


def run_ft(
    tmp: Path,
    hidden: int,
    steps: int,
    warmup: int,
    upstream: bool = False,
    script: Path = HERE,
    env_extra: dict[str, str] | None = None,
) -> float:
    """One run of the torchft side (or upstream's): a lighthouse and two replica groups;
    the slower rank's median step. ``script`` runs the workers (as this file's ``worker``
    command does), with ``env_extra`` in their environment."""
    from torch.distributed import TCPStore

    mode = "upstream" if upstream else "ft"
    lighthouse = _Lighthouse(upstream, min_replicas=2, join_timeout_ms=1000)
    try:
        stores = [
            TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)
        ]
        results = [tmp / f"{mode}_{hidden}_{r}.json" for r in range(2)]
        common = ["--hidden", str(hidden), "--steps", str(steps), "--warmup", str(warmup)]
        env = {"TORCHFT_LIGHTHOUSE": lighthouse.address}
        procs = [
            _spawn(
                mode,
                0,
                stores[r].port,
                [*common, "--result", str(results[r]), "--replica-id", f"bench{r}"],
                {**env, "BENCH_SEED": str(r), **(env_extra or {})},
                script,
            )
            for r in range(2)
        ]
        _wait(procs, 600)
    finally:
        lighthouse.close()
    return _median_of(results, mode)


def run_recovery(tmp: Path, hidden: int) -> dict[str, float]:
    """Kills one group mid-run and times its replacement from process start to first commit."""
    from torch.distributed import TCPStore

    lighthouse = _Lighthouse(False, min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000)
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address}
    procs: list[subprocess.Popen[bytes]] = []

    def start(r: int, tag: str, total: int) -> tuple[subprocess.Popen[bytes], Path, Path]:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        stores.append(store)
        result = tmp / f"rec_{tag}.json"
        progress = tmp / f"rec_{tag}.progress"
        args = ["--hidden", str(hidden), "--steps", str(total), "--warmup", "0"]
        args += ["--result", str(result), "--replica-id", f"rec{r}", "--progress", str(progress)]
        p = _spawn("ft", 0, store.port, args, {**env, "BENCH_SEED": str(r), "BENCH_MIN": "1"})
        procs.append(p)
        return p, result, progress

    def step_of(progress: Path) -> int:
        try:
            return int(json.loads(progress.read_text())["step"])
        except (FileNotFoundError, ValueError, KeyError):
            return -1

    stores: list[Any] = []
    try:
        total = 100000  # bounded by the kill below, not by steps
        _, _, prog0 = start(0, "a", total)
        victim, _, prog1 = start(1, "b", total)
        deadline = time.monotonic() + 120
        while min(step_of(prog0), step_of(prog1)) < 20:
            if time.monotonic() > deadline:
                raise RuntimeError("recovery run did not reach step 20")
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        t_start = time.time()
        _, result, _ = start(1, "c", total)
        first = Path(str(result) + ".first")
        while not first.exists():
            if time.monotonic() > deadline + 120:
                raise RuntimeError("replacement never committed")
            time.sleep(0.01)
        info = json.loads(first.read_text())
        return {"seconds": info["t"] - t_start, "healed_to_step": info["step"]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--mode", choices=["plain", "ft"], required=True)
    w.add_argument("--hidden", type=int, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--warmup", type=int, required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--replica-id", default="bench")
    w.add_argument("--progress", default="")
    lh = sub.add_parser("lighthouse")
    lh.add_argument("min_replicas", type=int)
    lh.add_argument("join_timeout_ms", type=int)
    lh.add_argument("heartbeat_timeout_ms", type=int)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternate plain/torchft runs (median, >= 5)"
    )
    parser.add_argument("--no-recovery", action="store_true")
    parser.add_argument(
        "--allocator",
        choices=["pinned", "default"],
        default="pinned",
        help="glibc allocator thresholds of every worker: fixed (pinned) or glibc's adaptive ones",
    )
    parser.add_argument(
        "--no-upstream", action="store_true", help="skip upstream's row even when installed"
    )
    args = parser.parse_args()

    if args.cmd is None and args.rounds < 5:
        parser.error("--rounds must be >= 5 (a median and a spread)")
    if args.cmd == "lighthouse":
        serve_lighthouse(args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms)
        return 0
    if args.cmd == "worker":
        if args.mode == "plain":
            worker_plain(args)
        else:
            worker_ft(args)
        return 0

    targets = {256: 1.3, 1024: 1.05}
    if args.allocator == "pinned":
        _ALLOCATOR_ENV.update(PINNED_ALLOCATOR)
    print(
        f"ddp_overhead: MLP 256->H->H->10, batch 32, AdamW, 2 processes, Gloo, {args.steps} steps"
        f"; {args.rounds} runs per side, median of the runs' medians [min, max]; allocator "
        f"thresholds {args.allocator}"
    )
    upstream = not args.no_upstream and (UPSTREAM / "torchft" / "__init__.py").exists()
    if not upstream and not args.no_upstream:
        print(f"  (upstream torchft is not installed under {UPSTREAM}: make bench; row skipped)")
    ok = True
    with tempfile.TemporaryDirectory(prefix="ddp_overhead") as d:
        tmp = Path(d)
        for hidden in args.hidden:
            plain_runs, ft_runs, up_runs = [], [], []
            _FAULTS.clear()
            _CPU.clear()
            for _ in range(args.rounds):
                plain_runs.append(run_plain(tmp, hidden, args.steps, args.warmup))
                ft_runs.append(run_ft(tmp, hidden, args.steps, args.warmup))
                if upstream:
                    try:
                        up_runs.append(run_ft(tmp, hidden, args.steps, args.warmup, upstream=True))
                    except RuntimeError as e:
                        # Upstream's row is a comparison, not ours: ours still reports.
                        print(f"  upstream run failed ({e}); its row is left out")
                        upstream = False
                        up_runs.clear()
                        _CPU.pop("upstream", None)
            plain = statistics.median(plain_runs)
            ft = statistics.median(ft_runs)
            ratio = ft / plain
            target = targets.get(hidden)
            verdict = ""
            if target is not None:
                verdict = f"(target <= {target}: {'ok' if ratio <= target else 'MISSED'})"
                ok = ok and ratio <= target
            print(
                f"  H={hidden:5d}: plain DDP {plain * 1e3:7.2f} ms/step "
                f"[{min(plain_runs) * 1e3:.2f}, {max(plain_runs) * 1e3:.2f}] {_faults('plain')}   "
                f"torchft {ft * 1e3:7.2f} ms/step "
                f"[{min(ft_runs) * 1e3:.2f}, {max(ft_runs) * 1e3:.2f}] {_faults('ft')}   "
                f"ratio of medians {ratio:.3f} {verdict}"
            )
            for side, base in (("plain", None), ("ft", "plain")):
                print(f"           CPU per step and process, {side}: {_cpu_line(side, base)}")
            if up_runs:
                up = statistics.median(up_runs)
                print(
                    f"           upstream 0.2.0 {up * 1e3:7.2f} ms/step "
                    f"[{min(up_runs) * 1e3:.2f}, {max(up_runs) * 1e3:.2f}] {_faults('upstream')}   "
                    f"ratio to plain {up / plain:.3f}   ours / upstream {ft / up:.3f}"
                )
                line = _cpu_line("upstream", "plain")
                print(f"           CPU per step and process, upstream: {line}")
        if not args.no_recovery:
            rec = run_recovery(tmp, args.hidden[0])
            print(
                f"  recovery: replacement process start -> first committed step "
                f"{rec['seconds']:.2f} s (healed to step {rec['healed_to_step']})"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
