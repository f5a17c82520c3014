"""Micro-benchmark: HTTPTransport healing throughput vs a raw loopback socket copy.

Both sides run in this process over loopback TCP, with the same tensor bytes (~200 MB by
default). The baseline sends every tensor's memory with ``sendall`` and receives it with
``recv_into`` into preallocated buffers: the best a Python stream copy can do. The
transport adds the HTTP exchange, framing, CRC32 on both sides and structure decoding.
The printed ratio (transport time / raw time) is what matters, not absolute numbers.
Each transport variant also runs secured (shared-secret token and mutual TLS, with the test
certificates in ``tests/certs``), in the same run: the cost of encryption on a heal.

Usage: ``python benches/checkpoint_transport.py [--mb 200] [--repeat 3] [--chunks 0 4]``
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._security import TransportSecurity
from torchft.checkpointing._serialization import tensor_bytes

logger: logging.Logger = logging.getLogger(__name__)


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


def raw_socket_copy(tensors: list[torch.Tensor]) -> float:
    """Seconds to copy the tensors' bytes over a loopback TCP socket into new buffers."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    views = [tensor_bytes(t).numpy().data for t in tensors]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            for v in views:
                conn.sendall(v)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for v in views:
            dst = torch.empty(len(v), dtype=torch.uint8)
            mv = dst.numpy().data
            got = 0
            while got < len(v):
                n = sock.recv_into(mv[got:])
                if not n:
                    raise RuntimeError("raw copy truncated")
                got += n
    elapsed = time.perf_counter() - t0
    thread.join()
    listener.close()
    return elapsed


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


def main() -> None:
    """Runs the comparison and prints throughput and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="payload size in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="runs per variant (best kept)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4], help="num_chunks values")
    args = parser.parse_args()

    state = make_state(args.mb)
    tensors = all_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"payload: {nbytes / 1e6:.1f} MB in {len(tensors)} tensors, best of {args.repeat}")

    raw = min(raw_socket_copy(tensors) for _ in range(args.repeat))
    print(f"{'raw loopback socket':<44} {raw:7.3f}s {nbytes / raw / 1e6:9.1f} MB/s  ratio 1.00")
    for chunks in args.chunks:
        plain = min(http_copy(state, chunks, TransportSecurity()) for _ in range(args.repeat))
        print(
            f"{f'HTTPTransport num_chunks={chunks}':<44} {plain:7.3f}s "
            f"{nbytes / plain / 1e6:9.1f} MB/s  ratio {plain / raw:.2f}x raw time"
        )
        tls = min(http_copy(state, chunks, secured()) for _ in range(args.repeat))
        print(
            f"{f'HTTPTransport num_chunks={chunks}, token + mTLS':<44} {tls:7.3f}s "
            f"{nbytes / tls / 1e6:9.1f} MB/s  ratio {tls / raw:.2f}x raw time, "
            f"{tls / plain:.2f}x plain"
        )


if __name__ == "__main__":
    main()
