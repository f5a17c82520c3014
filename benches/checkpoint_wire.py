"""Two-process benchmark: a heal's bytes between separate processes, vs a raw socket copy.

The figure that counts for live recovery. A sender process holds the state (1 GiB by default,
in 4 MiB float32 tensors); a receiver process holds tensors of the same shapes already
allocated and touched, as a healing replica does. Over loopback, in the same run:

- **raw**: ``--streams`` TCP connections at once (as many as the native row uses), each
  served by its own sender thread and read by its own receiver thread, each carrying a
  contiguous share of the tensors (split by bytes, as the native path splits them): the
  sender ``sendall``s each tensor's memory, the receiver ``recv_into``s its own tensors. The
  best a plain socket copy into already-existing memory does with those streams (the
  baseline);
- **http**: ``HTTPTransport(native=False)``, the HTTP path (the receiver allocates new
  tensors, as before ``state_dict=`` existed);
- **native**: ``HTTPTransport(state_dict=...)``, the default: bytes over the native data path
  (``--streams`` connections, by default the native path's own default), written straight
  into the receiver's own tensors;
- **raw1** and **native1**: the same two at one stream each, so the comparison holds at equal
  stream counts both where parallel streams share the cores and where one stream's own
  per-byte work is all there is.

Each row runs in fresh processes and reports the median, min and max of ``--repeat``
receives (GB/s, ratio of medians to raw) and both processes' peak RSS above what they held
once the state existed (the transport's own memory). Every receive is checked whole: each
tensor ``torch.equal`` to the sender's (whose bit patterns differ at every element and in
every tensor, so a misplaced or torn piece shows). The target, for each pair of native and
raw rows at the same stream count: native median >= 0.9x raw median throughput, receiver
extra memory none beyond its tensors (under 64 MiB of bookkeeping), sender extra at most one
piece per stream plus the same. Exits 1 when a target is missed.

Usage: ``python benches/checkpoint_wire.py [--mb 1024] [--tensor-mb 4] [--repeat 5]
[--streams 4] [--rows raw http native raw1 native1]``; ``--check`` runs a small
correctness-only version (what ``make test`` runs: no timing targets).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

TIMEOUT = timedelta(seconds=300)
STEP = 7
TARGET_RATIO = 0.9
# Memory a transport may use beyond the state for its own bookkeeping (buffers, threads,
# the header): far below one tensor's worth of the state at benchmark sizes.
BOOKKEEPING_MB = 64
PIECE_MB = 0.25  # the native server's piece: its sender-side buffer per stream
# Each row's kind and stream count: ``None`` is ``--streams``. A native row and the raw row
# of the same stream count form a pair the target applies to.
ROWS: dict[str, tuple[str, int | None]] = {
    "raw": ("raw", None),
    "http": ("http", None),
    "native": ("native", None),
    "raw1": ("raw", 1),
    "native1": ("native", 1),
}


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


def _expected(i: int, numel: int) -> Any:
    """Tensor ``i``'s content on the sender: distinct 32-bit patterns at every element and in
    every tensor (small integers' bits, as float32: finite, never NaN)."""
    import torch

    return torch.arange(i * 7919, i * 7919 + numel, dtype=torch.int32).view(torch.float32)


def _make_state(mb: int, tensor_mb: int, fill: bool) -> dict[str, Any]:
    import torch

    n = max(1, mb // tensor_mb)
    numel = (tensor_mb << 20) // 4
    model = {}
    for i in range(n):
        # Every page touched, as in a live replica.
        model[f"layer{i}.weight"] = _expected(i, numel) if fill else torch.zeros(numel)
    return {"model": model, "step": STEP}


def _tensors(state: dict[str, Any]) -> list[Any]:
    return list(state["model"].values())


class _Checker:
    """Checks every received tensor whole against the sender's content, bit for bit, through
    one buffer allocated before the receiver's memory baseline is taken (the check adds
    nothing to the transport's memory figure)."""

    CHUNK = 1 << 20  # elements compared at a time

    def __init__(self) -> None:
        import torch

        self._want = torch.zeros(self.CHUNK, dtype=torch.int32)

    def __call__(self, state: dict[str, Any]) -> bool:
        import torch

        if state.get("step") != STEP:
            return False
        for i, t in enumerate(_tensors(state)):
            got = t.view(torch.int32)
            for a in range(0, got.numel(), self.CHUNK):
                b = min(a + self.CHUNK, got.numel())
                want = self._want[: b - a]
                torch.arange(i * 7919 + a, i * 7919 + b, dtype=torch.int32, out=want)
                if not torch.equal(got[a:b], want):
                    return False
        return True


def _shares(n: int, streams: int) -> list[range]:
    """Contiguous shares of ``n`` equal tensors for ``streams`` connections (the native path
    splits its tensor table the same way: contiguous ranges of similar byte size)."""
    k = max(1, min(streams, n))
    return [range(j * n // k, (j + 1) * n // k) for j in range(k)]


def _sender(args: argparse.Namespace) -> None:
    args.row = ROWS[args.row][0]
    state = _make_state(args.mb, args.tensor_mb, fill=True)
    base = _rss_mb()
    if args.row == "raw":
        import torch

        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        print(json.dumps({"addr": f"127.0.0.1:{listener.getsockname()[1]}"}), flush=True)
        views = [t.view(torch.uint8).numpy().data for t in _tensors(state)]
        shares = _shares(len(views), args.streams)

        def serve(conn: socket.socket) -> None:
            with conn:
                # The receiver's thread says which share this connection carries.
                share = shares[int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")]
                for j in share:
                    conn.sendall(views[j])

        threads = []
        for _ in range(args.repeat * len(shares)):
            conn, _ = listener.accept()
            th = threading.Thread(target=serve, args=(conn,))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
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


def _recv_raw(addr: str, state: dict[str, Any], streams: int) -> float:
    """Seconds for one raw receive: one connection and thread per share, all at once."""
    import torch

    host, port = addr.rsplit(":", 1)
    views = [t.view(torch.uint8).numpy().data for t in _tensors(state)]
    shares = _shares(len(views), streams)
    errors: list[BaseException] = []
    start = threading.Barrier(len(shares) + 1)

    def recv(index: int) -> None:
        try:
            with socket.create_connection((host, int(port))) as sock:
                start.wait()
                sock.sendall(index.to_bytes(4, "little"))
                for j in shares[index]:
                    v = views[j]
                    got = 0
                    while got < len(v):
                        n = sock.recv_into(v[got:])
                        if not n:
                            raise RuntimeError("raw copy truncated")
                        got += n
        except BaseException as e:  # reported by the caller
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=recv, args=(i,)) for i in range(len(shares))]
    for th in threads:
        th.start()
    # Timed from when every connection is open (the native row's connects are timed too,
    # but they are a few hundred microseconds against a receive of seconds).
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def _receiver(args: argparse.Namespace) -> None:
    args.row = ROWS[args.row][0]
    state = _make_state(args.mb, args.tensor_mb, fill=False)
    _check = _Checker()
    base = _rss_mb()
    times = []
    ok = True
    in_place = 0
    if args.row == "raw":
        for _ in range(args.repeat):
            for t in _tensors(state):
                t.zero_()
            times.append(_recv_raw(args.addr, state, args.streams))
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
    with the sender's under ``"sender"`` and the row's stream count under ``"streams"``."""
    streams = ROWS[row][1] or args.streams
    common = [
        "--mb",
        str(args.mb),
        "--tensor-mb",
        str(args.tensor_mb),
        "--repeat",
        str(args.repeat),
        "--streams",
        str(streams),
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
        result["streams"] = streams
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
    parser.add_argument("--repeat", type=int, default=5, help="receives per row (median)")
    parser.add_argument(
        "--streams",
        type=int,
        default=None,
        help="parallel streams of the native and raw rows (default: the native path's default)",
    )
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
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
    if args.streams is None:
        from torchft.checkpointing.http.native import DEFAULT_STREAMS

        args.streams = DEFAULT_STREAMS
    if args.check:
        args.mb, args.tensor_mb, args.repeat = 32, 1, 5
    if args.mb < args.tensor_mb or args.tensor_mb < 1 or args.repeat < 5 or args.streams < 1:
        parser.error("need --mb >= --tensor-mb >= 1, --repeat >= 5 and --streams >= 1")

    results = {row: run_row(args, row) for row in args.rows}
    first = next(iter(results.values()))
    print(
        f"state: {first['bytes'] / 2**30:.2f} GiB in {first['tensors']} float32 tensors, "
        f"two processes over loopback, {args.repeat} receives per row (median [min, max]); "
        f"streams: {args.streams} (raw, http, native), 1 (raw1, native1)"
    )
    print(
        f"{'row':<8} {'streams':>7} {'median s':>8} {'[min, max]':>17} {'GB/s':>7} "
        f"{'vs raw':>7} {'in place':>9} {'recv +MB':>9} {'send +MB':>9}  ok"
    )
    med = statistics.median
    # The raw row of each stream count: every other row is compared with it.
    raw_meds = {
        r["streams"]: med(r["times"]) for row, r in results.items() if ROWS[row][0] == "raw"
    }
    failed = []
    for row, r in results.items():
        m = med(r["times"])
        raw_med = raw_meds.get(r["streams"])
        ratio = f"{raw_med / m:.2f}" if raw_med else "-"
        spread = f"[{min(r['times']):.3f}, {max(r['times']):.3f}]"
        print(
            f"{row:<8} {r['streams']:>7} {m:8.3f} {spread:>17} {r['bytes'] / m / 1e9:7.2f} "
            f"{ratio:>7} {r['in_place']:>4}/{r['tensors']:<4} {r['extra_mb']:9.1f} "
            f"{r['sender']['extra_mb']:9.1f}  {'yes' if r['ok'] else 'NO'}"
        )
        if not r["ok"]:
            failed.append(f"{row}: received state is wrong")
        if ROWS[row][0] != "native":
            continue
        if r["in_place"] != r["tensors"]:
            failed.append(f"{row}: not every tensor was received in place")
        if args.check:
            continue
        # A native row run without its raw row (``--rows native``) has no ratio to meet.
        if raw_med is not None and raw_med / m < TARGET_RATIO:
            failed.append(
                f"{row}: median below {TARGET_RATIO}x the raw copy's throughput at "
                f"{r['streams']} stream(s)"
            )
        if r["extra_mb"] > BOOKKEEPING_MB:
            failed.append(f"{row}: receiver memory beyond its own tensors")
        if r["sender"]["extra_mb"] > BOOKKEEPING_MB + PIECE_MB * r["streams"]:
            failed.append(f"{row}: sender memory beyond one piece per stream")
    for f in failed:
        print(f"MISSED {f}")
    if not failed:
        print("targets met" if not args.check else "check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
