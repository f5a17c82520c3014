"""Two-process benchmark: a heal's bytes between separate processes, vs a raw socket copy.

The figure that counts for live recovery. A sender process holds the state (1 GiB by default,
in 4 MiB float32 tensors); a receiver process holds tensors of the same shapes already
allocated and touched, as a healing replica does. Over loopback, in the same run:

- **raw**: one TCP connection; the sender ``sendall``s each tensor's memory, the receiver
  ``recv_into``s each of its own tensors: the best a plain socket copy into already-existing
  memory does (the baseline);
- **http**: ``HTTPTransport(native=False)``, the HTTP path (the receiver allocates new
  tensors, as before ``state_dict=`` existed);
- **native**: ``HTTPTransport(state_dict=...)``, the default: bytes over the native data path,
  written straight into the receiver's own tensors.

Each row runs in fresh processes and reports the best of ``--repeat`` receives (GB/s, ratio
to raw) and both processes' peak RSS above what they held once the state existed (the
transport's own memory). Every receive is checked: each tensor's first and last value.
The target: native >= 0.8x raw throughput, receiver extra memory none beyond its tensors
(under 64 MiB of bookkeeping), sender extra at most one piece per stream plus the same.
Exits 1 when a target is missed.

Usage: ``python benches/checkpoint_wire.py [--mb 1024] [--tensor-mb 4] [--repeat 3]
[--streams 4] [--rows raw http native]``; ``--check`` runs a small correctness-only version
(what ``make test`` runs: no timing targets).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

TIMEOUT = timedelta(seconds=300)
STEP = 7
TARGET_RATIO = 0.8
# Memory a transport may use beyond the state for its own bookkeeping (buffers, threads,
# the header): far below one tensor's worth of the state at benchmark sizes.
BOOKKEEPING_MB = 64
PIECE_MB = 1  # the native server's piece: its sender-side buffer per stream, when staging


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def _peak_mb() -> float:
    return _status_kb("VmHWM") / 1024


def _make_state(mb: int, tensor_mb: int, fill: bool) -> dict[str, Any]:
    import torch

    n = max(1, mb // tensor_mb)
    numel = (tensor_mb << 20) // 4
    model = {}
    for i in range(n):
        t = torch.empty(numel, dtype=torch.float32)
        # Every page touched, as in a live replica; the sender's values identify the tensor.
        t.fill_(i + 0.5 if fill else 0.0)
        t[-1] = -(i + 0.5) if fill else 0.0
        model[f"layer{i}.weight"] = t
    return {"model": model, "step": STEP}


def _tensors(state: dict[str, Any]) -> list[Any]:
    return list(state["model"].values())


def _check(state: dict[str, Any]) -> bool:
    return state.get("step") == STEP and all(
        float(t[0]) == i + 0.5 and float(t[-1]) == -(i + 0.5) for i, t in enumerate(_tensors(state))
    )


def _sender(args: argparse.Namespace) -> None:
    state = _make_state(args.mb, args.tensor_mb, fill=True)
    base = _rss_mb()
    if args.row == "raw":
        import torch

        listener = socket.create_server(("127.0.0.1", 0))
        print(json.dumps({"addr": f"127.0.0.1:{listener.getsockname()[1]}"}), flush=True)
        views = [t.view(torch.uint8).numpy().data for t in _tensors(state)]
        for _ in range(args.repeat):
            conn, _ = listener.accept()
            with conn:
                for v in views:
                    conn.sendall(v)
        listener.close()
    else:
        from torchft.checkpointing import HTTPTransport

        transport: HTTPTransport[Any] = HTTPTransport(
            TIMEOUT, hostname="127.0.0.1", native=args.row == "native"
        )
        transport.send_checkpoint([1], STEP, state, TIMEOUT)
        print(json.dumps({"addr": transport.metadata()}), flush=True)
    sys.stdin.readline()  # the receiver is done
    if args.row != "raw":
        transport.disallow_checkpoint()
        transport.shutdown()
    print(json.dumps({"base_mb": base, "extra_mb": _peak_mb() - base}), flush=True)


def _recv_raw(addr: str, state: dict[str, Any]) -> float:
    import torch

    host, port = addr.rsplit(":", 1)
    views = [t.view(torch.uint8).numpy().data for t in _tensors(state)]
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port))) as sock:
        for v in views:
            got = 0
            while got < len(v):
                n = sock.recv_into(v[got:])
                if not n:
                    raise RuntimeError("raw copy truncated")
                got += n
    return time.perf_counter() - t0


def _receiver(args: argparse.Namespace) -> None:
    state = _make_state(args.mb, args.tensor_mb, fill=False)
    base = _rss_mb()
    times = []
    ok = True
    in_place = 0
    if args.row == "raw":
        for _ in range(args.repeat):
            for t in _tensors(state):
                t.zero_()
            times.append(_recv_raw(args.addr, state))
            ok = ok and _check(state)
        in_place = len(_tensors(state))  # by construction: recv_into its own tensors
    else:
        from torchft.checkpointing import HTTPTransport

        native = args.row == "native"
        transport: HTTPTransport[Any] = HTTPTransport(
            TIMEOUT,
            num_chunks=args.streams if native else 0,
            state_dict=(lambda: state) if native else None,
            hostname="127.0.0.1",
            native=native,
        )
        try:
            for _ in range(args.repeat):
                for t in _tensors(state):
                    t.zero_()
                t0 = time.perf_counter()
                got = transport.recv_checkpoint(0, args.addr, STEP, TIMEOUT)
                times.append(time.perf_counter() - t0)
                ok = ok and _check(got)
                mine = {t.data_ptr() for t in _tensors(state)}
                in_place = sum(t.data_ptr() in mine for t in _tensors(got))
                del got
        finally:
            transport.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    print(
        json.dumps(
            {
                "times": times,
                "bytes": nbytes,
                "ok": ok,
                "in_place": in_place,
                "tensors": len(_tensors(state)),
                "base_mb": base,
                "extra_mb": _peak_mb() - base,
            }
        ),
        flush=True,
    )


def run_row(args: argparse.Namespace, row: str) -> dict[str, Any]:
    """Runs one row in a fresh sender/receiver process pair; returns the receiver's report
    with the sender's under ``"sender"``."""
    common = [
        "--mb",
        str(args.mb),
        "--tensor-mb",
        str(args.tensor_mb),
        "--repeat",
        str(args.repeat),
        "--streams",
        str(args.streams),
        "--row",
        row,
    ]
    me = os.path.abspath(__file__)
    sender = subprocess.Popen(
        [sys.executable, me, "--role", "sender", *common],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdin is not None and sender.stdout is not None
        line = sender.stdout.readline()
        if not line:
            raise RuntimeError(f"{row}: the sender exited before serving")
        addr = json.loads(line)["addr"]
        recv = subprocess.run(
            [sys.executable, me, "--role", "receiver", "--addr", addr, *common],
            stdout=subprocess.PIPE,
            text=True,
            timeout=TIMEOUT.total_seconds(),
            check=True,
        )
        result: dict[str, Any] = json.loads(recv.stdout.strip().splitlines()[-1])
        sender.stdin.write("done\n")
        sender.stdin.flush()
        result["sender"] = json.loads(sender.stdout.readline())
        sender.wait(timeout=60)
        return result
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()


def main() -> int:
    """Runs the rows in fresh process pairs and prints the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024, help="state size in MiB")
    parser.add_argument("--tensor-mb", type=int, default=4, help="size of each tensor in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="receives per row (best kept)")
    parser.add_argument("--streams", type=int, default=4, help="native parallel streams")
    parser.add_argument("--rows", nargs="+", default=["raw", "http", "native"])
    parser.add_argument("--check", action="store_true", help="small, correctness only")
    parser.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "sender":
        _sender(args)
        return 0
    if args.role == "receiver":
        _receiver(args)
        return 0
    if args.check:
        args.mb, args.tensor_mb, args.repeat = 32, 1, 1
    if args.mb < args.tensor_mb or args.tensor_mb < 1 or args.repeat < 1 or args.streams < 1:
        parser.error("need --mb >= --tensor-mb >= 1, --repeat >= 1 and --streams >= 1")

    results = {row: run_row(args, row) for row in args.rows}
    first = next(iter(results.values()))
    print(
        f"state: {first['bytes'] / 2**30:.2f} GiB in {first['tensors']} float32 tensors, "
        f"two processes over loopback, best of {args.repeat}; native streams: {args.streams}"
    )
    print(
        f"{'row':<8} {'seconds':>8} {'GB/s':>7} {'vs raw':>7} {'in place':>9} "
        f"{'recv +MB':>9} {'send +MB':>9}  ok"
    )
    raw_best = min(results["raw"]["times"]) if "raw" in results else None
    failed = []
    for row, r in results.items():
        best = min(r["times"])
        ratio = f"{raw_best / best:.2f}" if raw_best else "-"
        print(
            f"{row:<8} {best:8.3f} {r['bytes'] / best / 1e9:7.2f} {ratio:>7} "
            f"{r['in_place']:>4}/{r['tensors']:<4} {r['extra_mb']:9.1f} "
            f"{r['sender']['extra_mb']:9.1f}  {'yes' if r['ok'] else 'NO'}"
        )
        if not r["ok"]:
            failed.append(f"{row}: received state is wrong")
    native = results.get("native")
    if native is not None:
        if native["in_place"] != native["tensors"]:
            failed.append("native: not every tensor was received in place")
        if not args.check:
            if raw_best is not None and raw_best / min(native["times"]) < TARGET_RATIO:
                failed.append(f"native: below {TARGET_RATIO}x the raw copy's throughput")
            if native["extra_mb"] > BOOKKEEPING_MB:
                failed.append("native: receiver memory beyond its own tensors")
            if native["sender"]["extra_mb"] > BOOKKEEPING_MB + PIECE_MB * args.streams:
                failed.append("native: sender memory beyond one piece per stream")
    for f in failed:
        print(f"MISSED {f}")
    if not failed:
        print("targets met" if not args.check else "check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
