"""Micro-benchmark: HTTPTransport healing throughput vs a raw loopback socket copy.

Both sides run in this process over loopback TCP (the transport's sender and receiver, and
the baseline's), with the same tensor bytes (~200 MB by default). The baseline uses as many
TCP connections as the variant under test, each with its own sender and receiver thread and
a contiguous, byte-balanced share of the tensors; it sends every tensor's memory with
``sendall`` and receives it with ``recv_into`` into buffers allocated before the timed copy:
the best a Python stream copy does with those streams. The transport's receiver allocates
its tensors (no ``state_dict=``: a group past its first commit heals so) and adds the HTTP
exchange, framing, CRC32 and structure decoding. Streams per variant, as the transport
picks them: plain (native data path) ``num_chunks`` connections, 0 meaning
``DEFAULT_STREAMS`` (4); token + mutual TLS (HTTPS, the native path is not used on TLS
links) ``num_chunks`` range requests, 0 meaning one request.

Each variant and its baseline alternate, ``--repeat`` times (>= 5), so both see the same
load; rows print the median with min and max, and the ratio of medians. Each transport
variant also runs secured (shared-secret token and mutual TLS, with the test certificates in
``tests/certs``): the cost of encryption on a heal, reported against the plain row.

Target (docs/healing.md's for the native data path): every plain variant's median
throughput >= 0.8x its same-stream raw baseline's. docs/healing.md measures it receiving in
place (``benches/checkpoint_wire.py``); here the receiver allocates, so a miss here that
``checkpoint_wire.py`` does not show is the cost of fresh allocations. The secured rows are
reported, not gated (no figure is claimed for them). Exits 1 when a target is missed.

Usage: ``python benches/checkpoint_transport.py [--mb 200] [--repeat 5] [--chunks 0 4]``
"""

from __future__ import annotations

import argparse
import logging
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._security import TransportSecurity
from torchft.checkpointing._serialization import tensor_bytes
from torchft.checkpointing.http_transport import DEFAULT_STREAMS

logger: logging.Logger = logging.getLogger(__name__)

#: The native data path's target against a raw copy with as many streams (docs/healing.md).
TARGET_RATIO = 0.8


def make_state(total_mb: int) -> dict[str, Any]:
    """A model-like state: a few large and many small float32/bfloat16 tensors."""
    torch.manual_seed(0)
    total = total_mb << 20
    state: dict[str, Any] = {"model": {}, "optim": {"state": {}}, "step": 10}
    # 3/4 in large tensors (4 MiB .. 32 MiB), 1/4 in small ones (16 KiB .. 256 KiB).
    big_bytes = total * 3 // 4
    i = 0
    while big_bytes > 0:
        n = min(big_bytes, (4 << 20) << (i % 4)) // 4
        state["model"][f"layer{i}.weight"] = torch.randn(n)
        big_bytes -= n * 4
        i += 1
    small_bytes = total - total * 3 // 4
    j = 0
    while small_bytes > 0:
        n = min(small_bytes, (16 << 10) << (j % 5)) // 2
        state["optim"]["state"][j] = {"exp_avg": torch.randn(n).to(torch.bfloat16)}
        small_bytes -= n * 2
        j += 1
    return state


def all_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors of a nested state, in traversal order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in all_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in all_tensors(v)]
    return []


def shares(sizes: list[int], streams: int) -> list[range]:
    """Contiguous ranges of ``sizes``' indices of similar byte totals, one per stream (the
    transport splits its tensor table the same way)."""
    n = len(sizes)
    parts = max(1, min(streams, n))
    total = sum(sizes)
    out: list[range] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        left = parts - len(out) - 1
        if acc >= total * (len(out) + 1) / parts and left > 0 and n - (i + 1) >= left:
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, n))
    return [r for r in out if len(r)]


def raw_socket_copy(views: list[memoryview], dests: list[memoryview], streams: int) -> float:
    """Seconds to copy ``views`` into the already-allocated ``dests`` over ``streams``
    loopback TCP connections at once, one sender and one receiver thread per connection
    (timed from when every connection is open to the last byte received)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    parts = shares([len(v) for v in views], streams)
    errors: list[BaseException] = []
    ready = threading.Barrier(len(parts) + 1)

    def serve(conn: socket.socket) -> None:
        try:
            with conn:
                part = parts[int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")]
                for j in part:
                    conn.sendall(views[j])
        except BaseException as e:  # reported by the caller
            errors.append(e)

    def accept() -> None:
        for _ in parts:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def recv(index: int) -> None:
        try:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                ready.wait()
                sock.sendall(index.to_bytes(4, "little"))
                for j in parts[index]:
                    mv, got = dests[j], 0
                    while got < len(mv):
                        n = sock.recv_into(mv[got:])
                        if not n:
                            raise RuntimeError("raw copy truncated")
                        got += n
        except BaseException as e:  # reported by the caller
            errors.append(e)
            ready.abort()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    threads = [threading.Thread(target=recv, args=(i,)) for i in range(len(parts))]
    for th in threads:
        th.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    acceptor.join(timeout=10)
    listener.close()
    if errors:
        raise errors[0]
    return elapsed


def streams_of(num_chunks: int, tls: bool) -> int:
    """The connections one receive of the transport opens (see the module docstring)."""
    if tls:
        return max(num_chunks, 1)
    return num_chunks if num_chunks > 0 else DEFAULT_STREAMS


CERTS = Path(__file__).resolve().parent.parent / "tests" / "certs"


def secured() -> TransportSecurity:
    """Token and mutual TLS, as a secured job's ranks have them (both ends alike)."""
    return TransportSecurity(
        token="bench-secret",
        tls_cert=str(CERTS / "server.pem"),
        tls_key=str(CERTS / "server.key"),
        tls_ca=str(CERTS / "ca.pem"),
        tls_client_ca=str(CERTS / "ca.pem"),
    )


def http_copy(state: dict[str, Any], num_chunks: int, security: TransportSecurity) -> float:
    """Seconds for one HTTPTransport send/recv of ``state`` over loopback."""
    timeout = timedelta(seconds=120)
    # "localhost": the name the test certificate is issued for.
    sender: HTTPTransport[Any] = HTTPTransport(timeout, hostname="localhost", security=security)
    receiver: HTTPTransport[Any] = HTTPTransport(
        timeout, num_chunks=num_chunks, hostname="localhost", security=security
    )
    try:
        sender.send_checkpoint([1], 1, state, timeout)
        t0 = time.perf_counter()
        out = receiver.recv_checkpoint(0, sender.metadata(), 1, timeout)
        elapsed = time.perf_counter() - t0
        sender.disallow_checkpoint()
        if out["step"] != state["step"]:
            raise RuntimeError("wrong state received")
        del out
        return elapsed
    finally:
        receiver.shutdown()
        sender.shutdown()


def _row(name: str, times: list[float], nbytes: int, note: str) -> None:
    med = statistics.median(times)
    print(
        f"{name:<44} {med:7.3f}s [{min(times):.3f}, {max(times):.3f}] "
        f"{nbytes / med / 1e6:9.1f} MB/s  {note}"
    )


def main() -> int:
    """Runs the comparison, prints medians, spreads and ratios; 1 when a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="payload size in MiB")
    parser.add_argument("--repeat", type=int, default=5, help="runs per variant (median)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4], help="num_chunks values")
    args = parser.parse_args()
    if args.repeat < 5:
        parser.error("--repeat must be >= 5 (a median and a spread)")

    state = make_state(args.mb)
    tensors = all_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    views = [tensor_bytes(t).numpy().data for t in tensors]
    print(
        f"payload: {nbytes / 1e6:.1f} MB in {len(tensors)} tensors; {args.repeat} runs per "
        "row, median [min, max] seconds"
    )
    missed = []
    for chunks in args.chunks:
        plain_times: list[float] = []
        for tls in (False, True):
            streams = streams_of(chunks, tls)
            # The baseline's buffers exist, every page touched, before any timed copy (and
            # are reused by every run).
            dests = [torch.ones(len(v), dtype=torch.uint8).numpy().data for v in views]
            raw: list[float] = []
            got: list[float] = []
            for _ in range(args.repeat):
                raw.append(raw_socket_copy(views, dests, streams))
                got.append(http_copy(state, chunks, secured() if tls else TransportSecurity()))
            name = f"HTTPTransport num_chunks={chunks}" + (", token + mTLS" if tls else "")
            ratio = statistics.median(raw) / statistics.median(got)
            _row(f"raw loopback socket, {streams} stream(s)", raw, nbytes, "baseline")
            note = f"{ratio:.2f}x raw throughput"
            if tls:
                note += (
                    f", {statistics.median(got) / statistics.median(plain_times):.2f}x plain time"
                )
            else:
                plain_times = got
                if ratio < TARGET_RATIO:
                    missed.append(f"{name}: {ratio:.2f}x raw throughput < {TARGET_RATIO}x")
            _row(name, got, nbytes, note)
    for m in missed:
        print(f"MISSED {m}")
    print(
        f"target: plain transport >= {TARGET_RATIO}x its same-stream raw copy: "
        + ("met" if not missed else "MISSED")
    )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
