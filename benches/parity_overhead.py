"""Step time with runtime state parity on vs off, in one run (target: at most 1% apart at
the default ``parity_every``).

Two replica groups (one process each) train an MLP (256 -> H -> H -> 10, batch 32, AdamW)
with Manager + torchft DDP on Gloo against an in-process lighthouse. Parity's cost comes once
per digest (the hash of the whole state on a background thread, overlapped with the step's
compute, a wait before the commit vote if it is not done, and the CPU the hash takes from
the other process on a shared machine), so kinds rotate by blocks of ``--every`` steps, in
both groups together: parity on (the block's first step is a parity step), off, and off again
(a control). Short blocks interleave the kinds finely, so all three share the machine's
background load (long blocks on this shared machine differ by tens of percent with no change).
The mean step time of a block is one sample; per group, the median "on" block against the
median of the "off" and control blocks pooled gives the cost of one digest, measured at
``--every`` steps and projected to the default ``parity_every`` (the same digest, spread over
more steps); control / off shows the noise floor of the same run. The slower group's figures
are reported, and the projected ratio must be at most 1.01.

It also times one digest of the same state in isolation (the background hash) as a second
view of the cost, and the digest's throughput on a larger state (``--digest-mb``, in 4 MiB
tensors) against the previous version's digest, zlib's two sums over each tensor one after
the other, alternating in the same run: the native sums must be at least
``DIGEST_SPEEDUP_TARGET`` times as fast and give the same 8 bytes.

Usage: ``python benches/parity_overhead.py [--every N] [--blocks B] [--hidden H]
[--digest-mb M]``; ``--check`` runs a small version with no timing targets (what ``make test``
runs: the groups train with parity on and off, and the two digests agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _groups import run_two_groups, train_group

HERE = Path(__file__).resolve()
TARGET = 1.01
DIGEST_SPEEDUP_TARGET = 3.0
DEFAULT_EVERY = 100  # torchft.parity.DEFAULT_EVERY (checked in main)


def worker(args: argparse.Namespace) -> None:
    """One replica group: trains, with parity on in one block of ``every`` steps out of three."""
    import torch
    from torch import nn

    manager, ddp, optim = train_group(args.replica_id, args.hidden, parity_every=args.every)
    gen = torch.Generator().manual_seed(int(os.environ["RANK_SEED"]))
    parity = manager._parity
    every = args.every
    blocks: dict[str, list[list[float]]] = {"on": [], "off": [], "control": []}
    kinds = ["on", "off", "control"]
    warmup = 3 * every  # the first blocks: the process warms up
    total = warmup + 3 * args.blocks * every
    block_start = -1
    try:
        while manager.current_step() < total:
            step = manager.current_step()
            kind = kinds[(step // every) % 3]
            parity._off_reason = None if kind == "on" else "off for this block"
            if step % every == 0 and step >= warmup and step != block_start:
                block_start = step
                blocks[kind].append([])
            x = torch.randn(32, 256, generator=gen)
            y = torch.randint(0, 10, (32,), generator=gen)
            start = time.perf_counter()
            optim.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optim.step()
            elapsed = time.perf_counter() - start
            if step >= warmup and manager.current_step() == step + 1 and blocks[kind]:
                blocks[kind][-1].append(elapsed)
    finally:
        manager.shutdown(wait=False)
    means = {k: [statistics.fmean(b) for b in v if b] for k, v in blocks.items()}
    Path(args.result).write_text(json.dumps({"means": means, "every": every}))


def isolated_cost(hidden: int) -> float:
    """Seconds of one digest of the benchmark's model and optimizer state, alone."""
    import torch
    from torch import nn

    from torchft.parity import StateParity

    model = nn.Sequential(
        nn.Linear(256, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    nn.functional.cross_entropy(model(torch.randn(4, 256)), torch.tensor([0, 1, 2, 3])).backward()
    optim.step()
    p = StateParity(1, lambda: {"model": model.state_dict(), "optim": optim.state_dict()})
    times = []
    for step in range(1, 21):
        t0 = time.perf_counter()
        p.at_step_start(step)
        p.settle()
        times.append(time.perf_counter() - t0)
        assert p.take() is not None
    p.shutdown()
    return statistics.median(times)


def _zlib_digest(tensors: list[tuple[str, Any]]) -> bytes:
    """The previous version's digest: zlib's CRC-32, then its Adler-32, over each tensor."""
    import zlib

    import torch

    crc, adler = 0, 1
    for path, t in tensors:
        meta = f"{path}:{t.dtype}:{tuple(t.shape)};".encode()
        crc, adler = zlib.crc32(meta, crc), zlib.adler32(meta, adler)
        data = t.reshape(-1).view(torch.uint8).numpy().data
        crc, adler = zlib.crc32(data, crc), zlib.adler32(data, adler)
    return crc.to_bytes(4, "big") + adler.to_bytes(4, "big")


def digest_speed(mb: int, repeat: int = 5) -> tuple[list[float], list[float]]:
    """GB/s of the native digest and of zlib's over ``mb`` MiB of float32 state, alternating
    ``repeat`` times; raises if the two digests differ."""
    import torch

    from torchft.parity import digest_tensors

    gen = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}", torch.randn(1 << 20, generator=gen)) for i in range(max(1, mb // 4))]
    gb = sum(t.numel() * t.element_size() for _, t in tensors) / 1e9
    native: list[float] = []
    zlib_: list[float] = []
    digests = set()
    for _ in range(repeat):
        for fn, out in ((digest_tensors, native), (_zlib_digest, zlib_)):
            t0 = time.perf_counter()
            digests.add(fn(tensors))
            out.append(gb / (time.perf_counter() - t0))
    if len(digests) != 1:
        raise RuntimeError(f"the native digest differs from zlib's: {sorted(digests)}")
    return native, zlib_


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10, help="steps per block (and digest)")
    parser.add_argument("--blocks", type=int, default=60, help="blocks per kind")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--digest-mb", type=int, default=256, help="state size of the digest throughput check"
    )
    parser.add_argument("--check", action="store_true", help="small run, no timing targets")
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--replica-id", required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--every", type=int, required=True)
    w.add_argument("--blocks", type=int, required=True)
    w.add_argument("--hidden", type=int, required=True)
    args = parser.parse_args()
    if args.cmd == "worker":
        worker(args)
        return 0
    if args.check:
        args.blocks, args.every, args.hidden, args.digest_mb = 5, 2, 64, 8
    if args.blocks < 3 or args.every < 2:
        parser.error("--blocks must be at least 3 and --every at least 2")
    if args.digest_mb < 4:
        parser.error("--digest-mb must be at least 4")

    from torchft.parity import DEFAULT_EVERY as LIBRARY_DEFAULT

    assert LIBRARY_DEFAULT == DEFAULT_EVERY, "the benchmark's default is the library's"

    try:
        got = run_two_groups(
            HERE,
            [
                "--blocks",
                str(args.blocks),
                "--every",
                str(args.every),
                "--hidden",
                str(args.hidden),
            ],
            timeout_s=1800,
        )
    except RuntimeError as e:
        print(e)
        return 1
    projected, measured, noise = [], [], []
    print(
        f"hidden={args.hidden}, {args.blocks} blocks of {args.every} steps per kind "
        f"(one digest per 'on' block); default parity_every={DEFAULT_EVERY}"
    )
    print(
        f"{'group':>6} {'on (ms)':>9} {'off (ms)':>9} {'control':>9} {'ctrl/off':>8} "
        f"{'on/off':>7} {'per digest':>11} {'at default':>10} {'spread':>7}"
    )
    for i, result in enumerate(got):
        t = result["means"]
        on, off, ctl = (statistics.median(t[k]) for k in ("on", "off", "control"))
        pooled = statistics.median(t["off"] + t["control"])
        per_digest = (on - pooled) * args.every
        at_default = 1 + per_digest / (DEFAULT_EVERY * pooled)
        q = statistics.quantiles(t["on"], n=4)
        spread = (q[2] - q[0]) / on
        projected.append(at_default)
        measured.append(on / pooled)
        noise.append(ctl / off)
        print(
            f"{'g' + str(i):>6} {on * 1e3:9.3f} {off * 1e3:9.3f} {ctl * 1e3:9.3f} "
            f"{ctl / off:8.4f} {on / pooled:7.4f} {per_digest * 1e3:8.2f} ms "
            f"{at_default:10.4f} {spread:7.1%}"
        )
    cost = isolated_cost(args.hidden)
    worst = max(projected)
    print(f"one digest of this state, alone: {cost * 1e3:.2f} ms (median of 20)")
    print(
        f"step time, parity on / off at parity_every={args.every}: {max(measured):.4f}; "
        f"projected to the default parity_every={DEFAULT_EVERY}: {worst:.4f} "
        f"(target <= {TARGET}); control / off (noise floor): "
        f"{max(noise, key=lambda v: abs(v - 1)):.4f}"
    )
    native, zlib_ = digest_speed(args.digest_mb)
    n, z = statistics.median(native), statistics.median(zlib_)
    speedup = n / z
    print(
        f"digest of {args.digest_mb} MiB, 5 runs each, median [min, max]: native "
        f"{n:.2f} GB/s [{min(native):.2f}, {max(native):.2f}], previous (zlib) {z:.2f} GB/s "
        f"[{min(zlib_):.2f}, {max(zlib_):.2f}], {speedup:.1f}x (target >= "
        f"{DIGEST_SPEEDUP_TARGET}x: {'ok' if speedup >= DIGEST_SPEEDUP_TARGET else 'MISSED'}); "
        "same digest"
    )
    if args.check:
        return 0
    return 0 if worst <= TARGET and speedup >= DIGEST_SPEEDUP_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
