"""What durable snapshots cost the training loop, next to their baselines (same run).

1. Training-thread blocked time per snapshot (target: at most 100 ms per GB of state).

   The snapshot takes the state's structure at the top of a step (``SnapshotWriter.save``,
   called from ``Manager.start_quorum``) and copies its tensors on the writer thread while
   the step's forward and backward passes run; ``settle()``, which the Manager calls before
   the optimizer writes the state, waits for the copy. The blocked time is ``save()`` plus
   that wait. Three processes:

   - *in a training step* (the target): an MLP whose parameters and AdamW moments hold
     ``--gb`` GB trains; steps that take a snapshot alternate with steps that do not (each
     snapshot's write is waited for and flushed first), and the blocked time of each
     snapshot step is timed, as well as the step's extra time over the step after it
     (the copy and the beginning of the write compete with training for the cores);
   - *nothing to overlap* (the worst case): a model-and-optimizer-like state of ``--gb``
     GB (a transformer-shaped stack of float32 weights: an embedding, a few large matrices
     per layer, many small biases and norm weights; AdamW's ``exp_avg``/``exp_avg_sq`` and
     scalar ``step`` tensors under integer keys; ``param_groups`` and a few plain numbers),
     ``save()`` followed at once by ``settle()``: the whole copy is waited for. Each
     background write is waited for (``writer.wait()``; its time, DCP save + checksums +
     manifest, is reported too) and the dirty pages flushed (``os.sync()``, untimed, as
     they would be by the next snapshot 500 steps later) before the next repetition. The
     first save allocates the staging buffers (first-touch page faults) and is reported
     apart as "first". After each repetition (interleaved, so they share that moment's
     load) the same process times reference copies of the same tensors: into fresh tensors
     (``torch.empty_like(t).copy_(t)``) and into reused ones, at torch's default thread
     count and at one thread, and glibc's ``memcpy`` into reused ones: the host's copy
     bandwidth, which bounds this case;
   - the baseline a user would otherwise write, a synchronous
   ``torch.save(state, path)`` of the same shapes to the same file system (a temporary
   directory under the default temp dir, like the snapshots).

2. Throughput loss at the default interval (target: at most 2% at
   ``torchft.snapshot.DEFAULT_EVERY`` = 500 committed steps) for the demo's model
   (examples/train_ddp.py: MLP 256 -> 256 -> 256 -> 10, AdamW, batch 32).

   Two replica groups (one process each) train with Manager + torchft DDP on Gloo against
   an in-process lighthouse, with snapshots every ``--every`` (10) committed steps, so a
   snapshot is taken (by one group, alternating) many times in the run. A whole-run A/B of
   snapshots on and off is too noisy on a shared 2-core machine to resolve 2%; instead each
   step is classified, by step number and across both groups (they wait for each other in
   the allreduce), as:

   - *stage*: a group staged a snapshot at its start (``SnapshotWriter.save`` on the
     training thread, inside ``start_quorum``);
   - *overlap*: a background write was in flight in either group during the step;
   - *clean*: neither.

   ``t`` is the median clean step time. A snapshot's *window* is its stage step and the
   overlap steps that follow it; its extra time is ``sum(step time - t)`` over the window.
   The extra time per snapshot ``E`` is the median over all windows (the mean is printed
   too), and the loss at interval ``N`` is ``E / (N * t)``. The components are printed
   alongside: the stage step's median extra, the overlap steps' median slowdown, and the
   mean number of overlap steps per snapshot (the stage step's extra is mostly the write
   starting on the writer thread at once, competing for the GIL and the cores; the time of
   ``save()`` itself is printed above the table). A control, the same computation over
   windows of the same lengths placed on clean steps half an interval later, shows what
   the arithmetic gives with no snapshot at all (the noise floor; it is not subtracted).

   The loss is also measured directly at the short interval: the mean time of every step
   over the mean time of the clean steps, minus one; it is printed next to ``E / (N * t)``
   at the same ``N``, and the two agree to within the gap between the clean steps' mean
   and median. The extrapolation holds while the writes do not overlap one another (each
   window ends long before the next snapshot). The directory is checked for complete,
   verifiable snapshots, and the run fails if none were written or a write failed; saves
   refused because the group's previous write was still running are counted and printed.

   The demo's processes run torch on one thread (``train_group``), so their staging copies
   are single-threaded; part 1 uses torch's default thread count.

Both groups' rows are printed; each target is judged on the worse. ``--quick`` runs a
0.05 GB state and 300 steps, a smoke test of a few seconds: it fails on errors and missing
snapshots but does not enforce the targets (a 50 MB state is dominated by per-tensor
costs, not the per-GB ones the target is about). Usage:
``python benches/snapshot_overhead.py [--gb G] [--reps R] [--steps N] [--every K] [--quick]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _groups import REPO_PYTHON, run_two_groups, train_group

HERE = Path(__file__).resolve()
BLOCKED_TARGET_MS_PER_GB = 100.0
LOSS_TARGET = 0.02


# ----------------------------------------------------------------------------- the state


def build_state(gb: float) -> dict[str, Any]:
    """A model-and-optimizer-like state of about ``gb`` GB of float32 tensors, shaped as
    ``Manager`` hands it to the writer (``{"user": ..., "torchft": ...}``)."""
    import torch

    budget = int(gb * 1e9) // 4 // 3  # parameter elements: weights + exp_avg + exp_avg_sq
    d = 1024 if gb >= 0.25 else 256
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (8192, d))]
    layer = [
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.out.weight", (d, d)),
        ("attn.out.bias", (d,)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("mlp.up.weight", (4 * d, d)),
        ("mlp.up.bias", (4 * d,)),
        ("mlp.down.weight", (d, 4 * d)),
        ("mlp.down.bias", (d,)),
    ]
    per_layer = sum(math.prod(s) for _, s in layer)
    used = math.prod(shapes[0][1])
    i = 0
    while used + per_layer + 2 * d <= budget:
        shapes += [(f"layers.{i}.{n}", s) for n, s in layer]
        used += per_layer
        i += 1
    shapes += [("norm.weight", (d,)), ("norm.bias", (d,))]
    used += 2 * d
    shapes.append(("head.weight", (max((budget - used) // d, 1), d)))

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape).uniform_(-0.1, 0.1)

    model = {name: tensor(s) for name, s in shapes}
    optim_state = {
        i: {
            "step": torch.tensor(1234.0),
            "exp_avg": tensor(s),
            "exp_avg_sq": tensor(s).abs_(),
        }
        for i, (_, s) in enumerate(shapes)
    }
    param_groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.01,
            "amsgrad": False,
            "params": list(range(len(shapes))),
        }
    ]
    return {
        "user": {
            "model": model,
            "optim": {"state": optim_state, "param_groups": param_groups},
            "schedule": {"step": 1234, "lr": 3e-4},
        },
        "torchft": {"step": 1234, "batches_committed": 2468},
    }


def _tensors(obj: Any) -> list[Any]:
    """Every tensor of a nested state, in order."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ----------------------------------------------------------------------------- arms (part 1)


def bench_writer(directory: str) -> Any:
    """A one-rank group's snapshot writer into ``directory``, every step, keeping two."""
    from torchft.snapshot import SnapshotWriter

    return SnapshotWriter(
        directory,
        every=1,
        keep=2,
        replica_id="bench",
        incarnation="bench",
        group_rank=0,
        group_world_size=1,
        timeout=60.0,
    )


def arm_snapshot(args: argparse.Namespace) -> None:
    """Blocked time of ``SnapshotWriter.save`` and its background write; after each
    repetition, the reference copies of the same tensors (interleaved, so they share the
    machine's load of that moment)."""
    import torch

    from torchft.snapshot import list_snapshots, verify

    # Staging checks each tensor for a DTensor, importing torch.distributed.tensor on the
    # first call; a training process has it loaded by then (constructing any torch.optim
    # optimizer loads it), so it is loaded here too, and its import time reported apart.
    start = time.perf_counter()
    import torch.distributed.tensor  # noqa: F401

    import_s = time.perf_counter() - start
    state = build_state(args.gb)
    tensors = _tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    threads = torch.get_num_threads()
    buffers = [torch.empty_like(t).copy_(t) for t in tensors]

    def copy_fresh() -> None:
        copies = [torch.empty_like(t).copy_(t) for t in tensors]
        del copies

    def copy_reused() -> None:
        for b, t in zip(buffers, tensors, strict=True):
            b.copy_(t)

    def copy_reused_1() -> None:
        torch.set_num_threads(1)
        try:
            copy_reused()
        finally:
            torch.set_num_threads(threads)

    def memcpy_reused() -> None:
        # glibc's memcpy, on one thread.
        for b, t in zip(buffers, tensors, strict=True):
            ctypes.memmove(b.data_ptr(), t.data_ptr(), t.numel() * t.element_size())

    references = {
        f"fresh_{threads}": copy_fresh,
        f"reused_{threads}": copy_reused,
        "reused_1": copy_reused_1,
        "memcpy_1": memcpy_reused,
    }
    refs: dict[str, list[float]] = {k: [] for k in references}
    out: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": len(tensors),
        "threads": threads,
        "dtensor_import_s": import_s,
    }
    blocked_s, write_s = [], []
    directory = tempfile.mkdtemp(prefix="torchft_snapshot_bench_")
    try:
        writer = bench_writer(directory)
        for rep in range(args.reps + 1):
            # Nothing to overlap the copy with: save(), then at once settle() (where the
            # Manager waits before the optimizer writes the state). The worst case.
            start = time.perf_counter()
            failed = writer.save(rep + 1, 0, state)
            writer.settle()
            blocked_s.append(time.perf_counter() - start)
            if failed is not None:
                raise RuntimeError(f"snapshot not queued: {failed.error}")
            result = writer.wait()
            if result is None or not result.complete:
                raise RuntimeError(f"snapshot write failed: {result}")
            write_s.append(result.write_s)
            # Dirty pages flushed before the next one, as 500 steps later they would be.
            os.sync()
            if rep == 0:
                continue
            for key, fn in references.items():
                start = time.perf_counter()
                fn()
                refs[key].append(time.perf_counter() - start)
        writer.shutdown()
        snaps = list_snapshots(directory)
        if not snaps or snaps[0].step != args.reps + 1 or verify(snaps[0]) is not None:
            raise RuntimeError(f"the last snapshot is missing or does not verify: {snaps}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out.update(blocked_s=blocked_s, write_s=write_s, refs=refs)
    Path(args.result).write_text(json.dumps(out))


def train_model(gb: float) -> tuple[Any, Any]:
    """An MLP whose parameters and AdamW moments hold about ``gb`` GB, with its optimizer
    stepped once (so its moments exist)."""
    import torch
    from torch import nn

    d = 2048 if gb >= 0.25 else 512
    layers = max(1, round(gb * 1e9 / 12 / (d * d + d)))
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, d)).sum().backward()
    optim.step()
    return model, optim


def arm_train(args: argparse.Namespace) -> None:
    """The training thread's wait in a real training step: a snapshot is taken at the top
    of the step (``save()``), the forward and backward passes run while the writer thread
    copies, and ``settle()`` comes before the optimizer step, where the Manager calls it.
    Steps with a snapshot alternate with steps without one (after the write and a flush),
    so the step's extra time is measured in the same conditions."""
    import torch
    import torch.distributed.tensor  # noqa: F401  (loaded by torch.optim in a trainer)

    model, optim = train_model(args.gb)
    d = model[0].in_features
    gen = torch.Generator().manual_seed(0)

    def state(step: int) -> dict[str, Any]:
        return {
            "user": {"model": model.state_dict(), "optim": optim.state_dict()},
            "torchft": {"step": step, "batches_committed": step},
        }

    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state(0)))

    def step(writer: Any, n: int) -> tuple[float, float, float]:
        """One step; returns (step seconds, training-thread wait, forward + backward)."""
        x = torch.randn(32, d, generator=gen)
        start = time.perf_counter()
        if writer is not None:
            writer.save(n, 0, state(n))
        waited = time.perf_counter() - start
        optim.zero_grad()
        t_fb = time.perf_counter()
        model(x).square().mean().backward()
        fb = time.perf_counter() - t_fb
        if writer is not None:
            waited += writer.settle()
        optim.step()
        return time.perf_counter() - start, waited, fb

    directory = tempfile.mkdtemp(prefix="torchft_snapshot_bench_")
    with_s, without_s, blocked_s, fb_s = [], [], [], []
    try:
        writer = bench_writer(directory)
        for rep in range(args.reps + 1):
            took, waited, fb = step(writer, rep + 1)
            result = writer.wait()
            if result is None or not result.complete:
                raise RuntimeError(f"snapshot write failed: {result}")
            os.sync()
            plain, _, _ = step(None, 0)
            if rep == 0:
                continue  # the first allocates the staging buffers
            with_s.append(took)
            without_s.append(plain)
            blocked_s.append(waited)
            fb_s.append(fb)
        writer.shutdown()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    Path(args.result).write_text(
        json.dumps(
            {
                "bytes": nbytes,
                "layers": len(model),
                "width": d,
                "with_s": with_s,
                "without_s": without_s,
                "blocked_s": blocked_s,
                "forward_backward_s": fb_s,
            }
        )
    )


def arm_torch_save(args: argparse.Namespace) -> None:
    """Synchronous ``torch.save`` of the same state to the same file system."""
    import torch

    state = build_state(args.gb)
    directory = tempfile.mkdtemp(prefix="torchft_snapshot_bench_")
    times = []
    try:
        for rep in range(args.reps + 1):
            path = Path(directory) / f"state_{rep}.pt"
            start = time.perf_counter()
            torch.save(state, path)
            times.append(time.perf_counter() - start)
            size = path.stat().st_size
            if rep > 0:
                (Path(directory) / f"state_{rep - 1}.pt").unlink()
            os.sync()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    Path(args.result).write_text(json.dumps({"save_s": times, "file_bytes": size}))


def run_arm(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs one arm in its own process and returns what it measured."""
    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "result.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, str(HERE), name, "--gb", str(args.gb), "--reps", str(args.reps)]
        rc = subprocess.call([*cmd, "--result", str(result)], env=env, timeout=900)
        if rc != 0:
            raise RuntimeError(f"{name} exited with {rc}")
        got: dict[str, Any] = json.loads(result.read_text())
        return got


# ----------------------------------------------------------------------------- groups (part 2)


def worker(args: argparse.Namespace) -> None:
    """One replica group of the demo's shape, snapshots every ``every`` steps; records each
    committed step's time and whether it staged a snapshot or overlapped a write."""
    import torch
    from torch import nn

    manager, ddp, optim = train_group(
        args.replica_id,
        args.hidden,
        snapshot_dir=args.snapshot_dir,
        snapshot_every=args.every,
    )
    group = manager._snapshots
    assert group is not None, "snapshots are not enabled"
    snaps = group.writer
    staged: list[tuple[int, float, bool]] = []  # (step, seconds in save, queued)
    written: list[dict[str, Any]] = []
    save, on_done = snaps.save, snaps._on_done

    def timed_save(step: int, quorum_id: int, state: dict[str, Any]) -> Any:
        start = time.perf_counter()
        failed = save(step, quorum_id, state)
        staged.append((step, time.perf_counter() - start, failed is None))
        return failed

    def record_done(result: Any) -> None:
        written.append(
            {
                "step": result.step,
                "write_s": result.write_s,
                "error": result.error,
                "complete": result.complete,
            }
        )
        if on_done is not None:
            on_done(result)

    snaps.save = timed_save  # type: ignore[method-assign]
    snaps._on_done = record_done
    gen = torch.Generator().manual_seed(int(os.environ["RANK_SEED"]))
    steps: list[tuple[int, float, bool, bool]] = []  # (step, s, staged, overlapped a write)
    total = args.warmup + args.steps
    try:
        while manager.current_step() < total:
            step = manager.current_step()
            n_staged = len(staged)
            busy = snaps.busy()
            start = time.perf_counter()
            x = torch.randn(32, 256, generator=gen)
            y = torch.randint(0, 10, (32,), generator=gen)
            optim.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optim.step()
            elapsed = time.perf_counter() - start
            busy = busy or snaps.busy()
            if step >= args.warmup and manager.current_step() == step + 1:
                queued = any(q for _, _, q in staged[n_staged:])
                steps.append((step, elapsed, queued, busy))
        snaps.wait(timeout=120)
    finally:
        manager.shutdown(wait=False)
    Path(args.result).write_text(json.dumps({"steps": steps, "staged": staged, "written": written}))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def analyse(got: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    """Per group: clean median, stage/overlap extras, per-snapshot extra, control, losses."""
    stage_steps: set[int] = set()
    busy_steps: set[int] = set()
    for g in got:
        for step, _, staged, busy in g["steps"]:
            if staged:
                stage_steps.add(step)
            elif busy:
                busy_steps.add(step)
    busy_steps -= stage_steps
    out = []
    for g in got:
        times = {step: s for step, s, _, _ in g["steps"]}
        clean = [s for step, s in times.items() if step not in stage_steps | busy_steps]
        stage = [times[s] for s in stage_steps if s in times]
        overlap = [times[s] for s in busy_steps if s in times]
        t = _median(clean)
        windows, controls, lengths = [], [], []
        for s in sorted(stage_steps):
            if s not in times:
                continue
            window = [s]
            while window[-1] + 1 in busy_steps and window[-1] + 1 in times:
                window.append(window[-1] + 1)
            windows.append(sum(times[k] - t for k in window))
            lengths.append(len(window) - 1)
            ctl = [k + every // 2 for k in window]
            if all(k in times and k not in stage_steps | busy_steps for k in ctl):
                controls.append(sum(times[k] - t for k in ctl))
        all_mean = statistics.fmean(times.values())
        out.append(
            {
                "clean_s": t,
                "clean_n": len(clean),
                "stage_extra_s": _median(stage) - t,
                "overlap_extra_s": _median(overlap) - t,
                "overlap_per_snapshot": statistics.fmean(lengths) if lengths else float("nan"),
                "extra_s": _median(windows),
                "extra_mean_s": statistics.fmean(windows) if windows else float("nan"),
                "control_s": _median(controls),
                "windows": len(windows),
                "direct_loss": all_mean / statistics.fmean(clean) - 1 if clean else float("nan"),
            }
        )
    return out


# ----------------------------------------------------------------------------- main


def blocked_part(args: argparse.Namespace) -> bool:
    """Part 1: prints the table; returns whether the target was met."""
    ours = run_arm("arm-snapshot", args)
    base = run_arm("arm-torch-save", args)
    train = run_arm("arm-train", args)
    gb = ours["bytes"] / 1e9
    first_blocked = ours["blocked_s"][0] / gb * 1e3
    blocked = [b / gb * 1e3 for b in ours["blocked_s"][1:]]
    writes = [w / gb for w in ours["write_s"][1:]]
    saves = [s / gb for s in base["save_s"][1:]]
    med = statistics.median(blocked)
    print(
        f"state: {gb:.3f} GB in {ours['tensors']} tensors (+ param_groups, ints, floats); "
        f"{args.reps} repetitions after a first one (medians and min-max over those); "
        f"torch threads: {ours['threads']}"
    )
    print(f"{'per GB of state':<48} {'median':>9} {'min':>9} {'max':>9} {'first':>9}")

    def row(name: str, xs: list[float], first: float, unit: str) -> None:
        print(
            f"{name + ' (' + unit + ')':<48} {statistics.median(xs):9.1f} {min(xs):9.1f} "
            f"{max(xs):9.1f} {first:9.1f}"
        )

    tgb = train["bytes"] / 1e9
    in_step = [b / tgb * 1e3 for b in train["blocked_s"]]
    extra = [(w - o) / tgb * 1e3 for w, o in zip(train["with_s"], train["without_s"], strict=True)]
    row("snapshot in a training step: thread waited", in_step, float("nan"), "ms")
    row("snapshot in a training step: step extra", extra, float("nan"), "ms")
    row("snapshot, nothing to overlap: thread waited", blocked, first_blocked, "ms")
    row("snapshot: background write", writes, ours["write_s"][0] / gb, "s")
    row("torch.save, synchronous (baseline)", saves, base["save_s"][0] / gb, "s")
    n = ours["threads"]
    refs = [
        (f"fresh_{n}", f"ref: empty_like(t).copy_(t), {n} thr"),
        (f"reused_{n}", f"ref: reused buffer copy_, {n} thr"),
        ("reused_1", "ref: reused buffer copy_, 1 thr"),
        ("memcpy_1", "ref: reused buffer memcpy, 1 thr"),
    ]
    for key, label in dict(refs).items():
        row(label, [r / gb * 1e3 for r in ours["refs"][key]], float("nan"), "ms")
    print(
        "(first: the first save, which allocates the staging buffers and touches every page; "
        f"torch.distributed.tensor was imported before it, {ours['dtensor_import_s']:.2f} s, "
        "as any process that built a torch.optim optimizer has it)"
    )
    print(
        f"(training step: MLP of {train['layers']} x Linear({train['width']}, "
        f"{train['width']}), AdamW, batch 32, {tgb:.3f} GB of state; forward + backward "
        f"{statistics.median(train['forward_backward_s']):.3f} s, step without a snapshot "
        f"{statistics.median(train['without_s']):.3f} s (medians); the copy runs on the "
        "writer thread during forward and backward, and the step waits before the "
        "optimizer writes the state; step extra: step with a snapshot - the step after it "
        "without one, which includes the copy and the write competing for the cores)"
    )
    in_med = statistics.median(in_step)
    ratio = in_med / 1e3 / statistics.median(saves)
    ok = in_med <= BLOCKED_TARGET_MS_PER_GB
    print(
        f"training thread waited {in_med:.1f} ms/GB in a training step (target <= "
        f"{BLOCKED_TARGET_MS_PER_GB:.0f}): {'met' if ok else 'MISSED'}; {ratio:.3f} of a "
        f"synchronous torch.save of the same state; with nothing to overlap the copy it "
        f"waits {med:.1f} ms/GB (the host's copy bandwidth)"
    )
    return ok


def throughput_part(args: argparse.Namespace) -> bool:
    """Part 2: prints the table; returns whether the target was met."""
    from torchft.snapshot import DEFAULT_EVERY, list_snapshots, verify

    directory = tempfile.mkdtemp(prefix="torchft_snapshot_bench_")
    try:
        got = run_two_groups(
            HERE,
            [
                *("--steps", str(args.steps), "--warmup", str(args.warmup)),
                *("--hidden", str(args.hidden), "--every", str(args.every)),
                *("--snapshot-dir", directory),
            ],
            timeout_s=600,
        )
        snaps = list_snapshots(directory)
        bad = [s.path.name for s in snaps if verify(s) is not None]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    written, failed, skipped, stage_ms, first_ms = [], [], 0, [], []
    for g in got:
        # A save refused because the group's previous write is still running is reported
        # through the same callback; it is counted apart from a write that failed.
        refused = {step for step, _, queued in g["staged"] if not queued}
        skipped += len(refused)
        ms = [s * 1e3 for _, s, queued in g["staged"] if queued]
        first_ms += ms[:1]
        stage_ms += ms[1:]
        for w in g["written"]:
            if w["complete"] and w["error"] is None:
                written.append(w)
            elif w["step"] not in refused:
                failed.append(w)
    print(
        f"\ndemo MLP 256 -> {args.hidden} -> {args.hidden} -> 10, AdamW, batch 32, two groups; "
        f"snapshot every {args.every} steps over {args.steps} steps: {len(written)} written "
        f"({len(failed)} failed, {skipped} skipped as the group's previous one was still being "
        f"written), {len(snaps)} complete kept in the directory ({len(bad)} fail verification)"
    )
    if not snaps or not written or failed or bad:
        raise RuntimeError(
            f"snapshots were not written as expected: {len(written)} complete, failed "
            f"{failed[:3]}, {len(snaps)} in the directory, failing verification {bad}"
        )
    write_ms = [w["write_s"] * 1e3 for w in written]
    print(
        f"per snapshot: save() on the training thread {_median(stage_ms):.2f} ms (median; each "
        f"group's first: {', '.join(f'{m:.1f}' for m in first_ms)} ms), background write "
        f"{_median(write_ms):.1f} ms (median)"
    )
    rows = analyse(got, args.every)
    print(
        f"{'group':>5} {'clean':>8} {'stage +':>8} {'overlap +':>9} {'overlaps':>8} "
        f"{'E/snap':>8} {'E mean':>8} {'control':>8} {'loss@' + str(args.every):>9} "
        f"{'direct@' + str(args.every):>9} {'loss@' + str(DEFAULT_EVERY):>9}"
    )
    print(
        f"{'':>5} {'ms':>8} {'ms':>8} {'ms/step':>9} {'steps':>8} {'ms':>8} {'ms':>8} "
        f"{'ms':>8} {'':>9} {'':>9} {'':>9}"
    )
    losses = []
    for i, r in enumerate(rows):
        t = r["clean_s"]
        loss_short = r["extra_s"] / (args.every * t)
        loss = r["extra_s"] / (DEFAULT_EVERY * t)
        losses.append(loss)
        print(
            f"{'g' + str(i):>5} {t * 1e3:8.3f} {r['stage_extra_s'] * 1e3:8.3f} "
            f"{r['overlap_extra_s'] * 1e3:9.3f} {r['overlap_per_snapshot']:8.1f} "
            f"{r['extra_s'] * 1e3:8.2f} {r['extra_mean_s'] * 1e3:8.2f} "
            f"{r['control_s'] * 1e3:8.2f} {loss_short:9.2%} {r['direct_loss']:9.2%} "
            f"{loss:9.3%}"
        )
    worst = max(losses)
    ok = worst <= LOSS_TARGET
    print(
        f"(clean: median step with no snapshot activity; E: extra time per snapshot, median "
        f"over {rows[0]['windows']} snapshots; control: E's arithmetic on clean steps; "
        f"loss@N = E / (N * clean); direct: mean step / mean clean step - 1)"
    )
    print(
        f"throughput loss at the default interval ({DEFAULT_EVERY} steps): {worst:.3%} "
        f"(target <= {LOSS_TARGET:.0%}): {'met' if ok else 'MISSED'}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size of part 1 (GB)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions after the first")
    parser.add_argument("--steps", type=int, default=3000, help="measured steps of part 2")
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="snapshot interval of part 2")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="small state, few steps (smoke)")
    sub = parser.add_subparsers(dest="cmd")
    for name in ("arm-snapshot", "arm-torch-save", "arm-train"):
        a = sub.add_parser(name)
        a.add_argument("--gb", type=float, required=True)
        a.add_argument("--reps", type=int, required=True)
        a.add_argument("--result", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--replica-id", required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--warmup", type=int, required=True)
    w.add_argument("--hidden", type=int, required=True)
    w.add_argument("--every", type=int, required=True)
    w.add_argument("--snapshot-dir", required=True)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.cmd == "arm-snapshot":
        arm_snapshot(args)
        return 0
    if args.cmd == "arm-torch-save":
        arm_torch_save(args)
        return 0
    if args.cmd == "arm-train":
        arm_train(args)
        return 0
    if args.cmd == "worker":
        worker(args)
        return 0
    if args.quick:
        args.gb, args.steps, args.warmup = 0.05, 300, 20
    if args.reps < 1 or args.gb <= 0 or args.every < 2 or args.steps < 4 * args.every:
        parser.error("need --reps >= 1, --gb > 0, --every >= 2 and --steps >= 4 * --every")

    try:
        blocked_ok = blocked_part(args)
        loss_ok = throughput_part(args)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"FAILED: {e}")
        return 1
    if args.quick:
        print("(--quick is a smoke test: the targets are judged at the default sizes, not here)")
        return 0
    return 0 if blocked_ok and loss_ok else 1


if __name__ == "__main__":
    sys.exit(main())
