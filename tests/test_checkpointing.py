"""Tests for the checkpoint transports and their wire format (torchft.checkpointing)."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchft.checkpointing import CheckpointTransport, HTTPTransport, PGTransport
from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._serialization import CheckpointFormatError

TIMEOUT = timedelta(seconds=10)

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


# --------------------------------------------------------------------------- utilities


@pytest.fixture(autouse=True)
def _checkpoint_servers_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests dial 127.0.0.1: the checkpoint servers listen there, whatever the host
    name of the machine resolves to."""
    monkeypatch.setenv("TORCHFT_CHECKPOINT_BIND", "127.0.0.1")


def assert_identical(a: Any, b: Any, path: str = "root") -> None:
    """Asserts exact equality of structure, types, and tensor bytes."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        ab = ser.tensor_bytes(a)
        bb = ser.tensor_bytes(b)
        assert torch.equal(ab, bb), f"{path}: tensor bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert type(ka) is type(kb), f"{path}: key type {type(ka)} != {type(kb)}"
            assert_identical(va, vb, f"{path}[{ka!r}]")
        if isinstance(a, OrderedDict):
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of any dtype (NaN payloads, denormals, ... included)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = math.prod(shape) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.head = torch.nn.Linear(32, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.norm(torch.relu(self.lin(self.emb(x))))))


def realistic_state(seed: int = 0) -> tuple[dict[str, Any], _Model, torch.optim.Optimizer, Any]:
    """A Manager-shaped state: model + AdamW + LR scheduler + nested user state."""
    torch.manual_seed(seed)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        x = torch.randint(0, 50, (8,))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    user_extra = {
        "epoch": 3,
        "ratio": 0.25,
        "rng": torch.get_rng_state(),
        "history": [1.5, float("inf"), float("nan"), -0.0],
        7: ("tuple", None, True, b"\x00\xffbytes"),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "non_contig": torch.randn(6, 4).t(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
    }
    state = {
        "user": {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "lr_scheduler": sched.state_dict(),
            "extra": user_extra,
        },
        "torchft": {"step": 3, "batches_committed": 12},
    }
    return state, model, opt, sched


@contextmanager
def http_pair(**kwargs: Any) -> Iterator[tuple[HTTPTransport[Any], HTTPTransport[Any]]]:
    """A sender and a receiver transport, always shut down."""
    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT, **kwargs)
        try:
            yield sender, receiver
        finally:
            receiver.shutdown()
    finally:
        sender.shutdown()


class TamperProxy:
    """TCP proxy that can flip one body byte or cut the body of every HTTP response."""

    def __init__(self, target_port: int, flip_at: int | None = None, cut_at: int | None = None):
        self.target_port = target_port
        self.flip_at = flip_at
        self.cut_at = cut_at
        self.tampered = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/checkpoint"

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._socks += [client, upstream]
            for t in (
                threading.Thread(target=self._pipe, args=(client, upstream), daemon=True),
                threading.Thread(target=self._respond, args=(upstream, client), daemon=True),
            ):
                self._threads.append(t)
                t.start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _respond(self, upstream: socket.socket, client: socket.socket) -> None:
        head = b""
        body_off = None
        try:
            while data := upstream.recv(65536):
                buf = bytearray(data)
                if body_off is None:
                    head += bytes(buf)
                    idx = head.find(b"\r\n\r\n")
                    if idx < 0:
                        client.sendall(buf)
                        continue
                    # bytes of this chunk before the body start
                    body_start_in_buf = len(buf) - (len(head) - (idx + 4))
                    client.sendall(buf[:body_start_in_buf])
                    buf = buf[body_start_in_buf:]
                    body_off = 0
                if self.flip_at is not None and body_off <= self.flip_at < body_off + len(buf):
                    buf[self.flip_at - body_off] ^= 0x01
                    with self._lock:
                        self.tampered += 1
                if self.cut_at is not None and body_off + len(buf) > self.cut_at:
                    client.sendall(buf[: max(self.cut_at - body_off, 0)])
                    with self._lock:
                        self.tampered += 1
                    break
                client.sendall(buf)
                body_off += len(buf)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        self._accept.join(2)
        for t in self._threads:
            t.join(2)


class RawServer:
    """Serves fixed bytes as the body of any GET (a malicious or broken peer)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/checkpoint"

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    req = b""
                    while b"\r\n\r\n" not in req:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        req += chunk
                    conn.sendall(
                        b"HTTP/1.0 200 OK\r\nContent-Length: "
                        + str(len(self.body)).encode()
                        + b"\r\n\r\n"
                        + self.body
                    )
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(2)


def frame_header(doc: dict[str, Any]) -> bytes:
    """Frames a hand-written header document like a real sender would."""
    data = json.dumps(doc).encode()
    return struct.pack("<8sQI", ser.MAGIC_HEADER, len(data), zlib.crc32(data)) + data


def empty_range(n: int = 0) -> bytes:
    return struct.pack("<8sQQ", ser.MAGIC_RANGE, 0, n) + struct.pack(
        "<8sQI", ser.MAGIC_END, n, zlib.crc32(b"")
    )


# --------------------------------------------------------------------------- wire format


def test_transports_are_checkpoint_transports() -> None:
    """Both implementations satisfy the abstract CheckpointTransport interface."""
    assert issubclass(HTTPTransport, CheckpointTransport)
    assert issubclass(PGTransport, CheckpointTransport)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_serialization_bit_identical_all_dtypes(dtype: torch.dtype) -> None:
    """Random bit patterns of every dtype survive encode/decode bit for bit, in all layouts."""
    gen = torch.Generator().manual_seed(1234)
    base = random_tensor(dtype, (7, 6), gen)
    state = {
        "plain": base,
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "scalar": random_tensor(dtype, (), gen),
        "empty": random_tensor(dtype, (0, 4), gen),
        "big": random_tensor(dtype, (3, 1 << 16), gen),
    }
    assert not state["transposed"].is_contiguous()
    out = ser.decode_bytes(ser.encode_to_bytes(state))
    assert_identical(state, out)
    assert out["scalar"].dim() == 0


def test_serialization_conj_and_neg_views() -> None:
    """Lazily conjugated / negated views are sent with their logical values."""
    c = torch.randn(4, 3, dtype=torch.complex64)
    state = {"conj": c.conj(), "neg": c.conj().imag}
    assert state["conj"].is_conj()
    out = ser.decode_bytes(ser.encode_to_bytes(state))
    assert torch.equal(out["conj"], c.conj().resolve_conj())
    assert torch.equal(out["neg"], c.conj().imag.resolve_neg())


def test_serialization_preserves_structure_and_types() -> None:
    """Tuples stay tuples, int/float/tuple keys keep their type, odd floats are exact."""
    shared = torch.arange(4)
    od: OrderedDict[str, Any] = OrderedDict(a=1, b=torch.ones(2))
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    state = {
        1: "int key",
        2.5: "float key",
        (1, "x"): "tuple key",
        None: "none key",
        False: "bool key",
        "t": (1, (2, [3, {4: 5}]), ()),
        "floats": [0.1, -0.0, float("inf"), float("-inf"), float("nan"), 1e308, 5e-324],
        "ints": [0, -1, 2**70, -(2**63)],
        "bytes": b"\x00\x01\xff",
        "empty_bytes": b"",
        "bytearray": bytearray(b"xy"),
        "dtypes": [torch.float32, torch.bfloat16, torch.int64],
        "device": torch.device("cpu"),
        "odict": od,
        "shared": [shared, shared],
        "param": torch.nn.Parameter(torch.randn(2, 2)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "str": "ünïcødé",
    }
    out = ser.decode_bytes(ser.encode_to_bytes(state))
    assert_identical(state, out)
    assert out["shared"][0] is out["shared"][1]
    assert isinstance(out["param"], torch.nn.Parameter) and out["param"].requires_grad
    assert not out["frozen"].requires_grad


def test_serialization_module_and_optimizer_reload() -> None:
    """A decoded model/optimizer/scheduler state loads into fresh objects exactly."""
    state, model, opt, sched = realistic_state()
    out = ser.decode_bytes(ser.encode_to_bytes(state))
    assert_identical(state, out)
    model2 = _Model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    model2.load_state_dict(out["user"]["model"])
    opt2.load_state_dict(out["user"]["optim"])
    sched2.load_state_dict(out["user"]["lr_scheduler"])
    assert_identical(model.state_dict(), model2.state_dict())
    assert_identical(opt.state_dict(), opt2.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr()


class _Custom:
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    "make_bad",
    [
        _Custom,
        lambda: {1, 2},
        lambda: lambda: None,
        _quantized,
        lambda: torch.ones(2).to_sparse(),
        lambda: torch.empty(2, device="meta"),
        lambda: {frozenset(): 1},
        lambda: {"nested": [1, {"deep": object()}]},
    ],
    ids=["object", "set", "lambda", "quantized", "sparse", "meta", "bad_key", "nested_object"],
)
def test_unsupported_values_raise_type_error(make_bad: Callable[[], Any]) -> None:
    """Values outside the safe format are refused at send time with a TypeError."""
    with pytest.raises(TypeError):
        ser.encode({"x": make_bad()})


def test_unsupported_value_raises_in_send_checkpoint() -> None:
    """HTTPTransport.send_checkpoint reports unsupported values to the caller at once."""
    transport: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        with pytest.raises(TypeError, match="_Custom"):
            transport.send_checkpoint([1], 1, {"a": {"b": _Custom()}}, TIMEOUT)
    finally:
        transport.shutdown()


def test_reference_cycle_raises_type_error() -> None:
    """A self-referencing structure is refused instead of recursing forever."""
    a: list[Any] = [1]
    a.append(a)
    with pytest.raises(TypeError, match="cycle"):
        ser.encode(a)


class _Exploit:
    """Pickling this yields a payload that creates a file when unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def test_malicious_payloads_never_execute_code(tmp_path: Path) -> None:
    """Pickle payloads (raw, or smuggled in a header) are refused and never run."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"x": _Exploit(str(marker))})
    # The payload really is dangerous under pickle.
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()

    bad_streams = [
        payload,
        frame_header(
            {
                "version": 1,
                "meta": {},
                "tensors": [],
                "root": {"$": "pickle", "v": base64.b64encode(payload).decode()},
            }
        )
        + empty_range(),
        frame_header(
            {
                "version": 1,
                "meta": {},
                "tensors": [{"dtype": "__import__", "shape": [1], "nbytes": 1}],
                "root": None,
            }
        )
        + empty_range(),
        frame_header(
            {"version": 1, "meta": {}, "tensors": [], "root": {"$": "dtype", "v": "os.system"}}
        )
        + empty_range(),
        frame_header({"version": 1, "meta": {}, "tensors": [], "root": {"$": "tensor", "t": 3}})
        + empty_range(),
        frame_header(
            {
                "version": 1,
                "meta": {},
                "tensors": [{"dtype": "float32", "shape": [1 << 40], "nbytes": 4}],
                "root": None,
            }
        ),
        frame_header({"version": 2, "meta": {}, "tensors": [], "root": None}) + empty_range(),
    ]
    for stream in bad_streams:
        with pytest.raises(CheckpointFormatError):
            ser.decode_bytes(stream)
    assert not marker.exists()

    # The same through the HTTP receiver: a "peer" serving a pickle.
    server = RawServer(payload)
    receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        with pytest.raises(CheckpointFormatError):
            receiver.recv_checkpoint(0, server.url(), 1, TIMEOUT)
    finally:
        receiver.shutdown()
        server.close()
    assert not marker.exists()


def test_deeply_nested_header_is_refused() -> None:
    """A header nested deeper than the Python stack allows fails cleanly."""
    deep = "[" * 100_000 + "]" * 100_000
    data = ('{"version":1,"meta":{},"tensors":[],"root":' + deep + "}").encode()
    stream = struct.pack("<8sQI", ser.MAGIC_HEADER, len(data), zlib.crc32(data)) + data
    with pytest.raises(CheckpointFormatError):
        ser.decode_bytes(stream + empty_range())


def test_serialization_deep_but_allowed_nesting_round_trips() -> None:
    """Nesting up to the documented limit works; beyond it is a TypeError at send time."""
    ok: Any = torch.ones(1)
    for i in range(ser.MAX_DEPTH - 1):
        ok = ({i: ok}, [ok], (ok,))[i % 3]
    assert_identical(ok, ser.decode_bytes(ser.encode_to_bytes(ok)))
    too_deep: Any = 1
    for _ in range(ser.MAX_DEPTH + 5):
        too_deep = [too_deep]
    with pytest.raises(TypeError, match="nesting"):
        ser.encode(too_deep)


def test_absurd_tensor_size_from_peer_is_refused() -> None:
    """A header announcing a tensor too large to allocate fails cleanly."""
    n = 1 << 62
    stream = frame_header(
        {
            "version": 1,
            "meta": {},
            "tensors": [{"dtype": "uint8", "shape": [n], "nbytes": n}],
            "root": {"$": "tensor", "t": 0},
        }
    ) + struct.pack("<8sQQ", ser.MAGIC_RANGE, 0, 1)
    with pytest.raises(CheckpointFormatError):
        ser.decode_bytes(stream)


def test_serialization_detects_every_flipped_region() -> None:
    """A flipped bit anywhere in the stream (header, tensor, checksum, trailer) is caught."""
    state = {"a": torch.randn(100), "b": [torch.arange(10), 3]}
    data = ser.encode_to_bytes(state)
    for pos in list(range(0, len(data), 7)) + [len(data) - 1]:
        corrupted = bytearray(data)
        corrupted[pos] ^= 0x10
        with pytest.raises(CheckpointFormatError):
            ser.decode_bytes(bytes(corrupted))
    for cut in range(0, len(data), 13):
        with pytest.raises(CheckpointFormatError):
            ser.decode_bytes(data[:cut])


def test_split_ranges_cover_all_tensors() -> None:
    """Chunk ranges are contiguous, non-empty and cover every tensor exactly once."""
    specs = [ser.TensorSpec("float32", (n,), 4 * n) for n in [0, 5, 1000, 0, 3, 7, 10_000, 1]]
    for parts in range(1, 12):
        ranges = ser.split_ranges(specs, parts)
        assert 1 <= len(ranges) <= min(parts, len(specs))
        assert ranges[0][0] == 0 and ranges[-1][1] == len(specs)
        for (a, b), (c, _) in zip(ranges, ranges[1:], strict=False):
            assert a < b == c
    assert ser.split_ranges([], 4) == []


# --------------------------------------------------------------------------- HTTP transport


@pytest.mark.parametrize("num_chunks", [0, 4])
def test_http_round_trip_realistic_state(num_chunks: int) -> None:
    """Model + AdamW + scheduler + user state arrive bit-identical over HTTP."""
    state, *_ = realistic_state()
    with http_pair(num_chunks=num_chunks) as (sender, receiver):
        assert sender.metadata().startswith("http://")
        sender.send_checkpoint([1], 3, state, TIMEOUT)
        out = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
        assert_identical(state, out)
        # Several receivers may fetch concurrently.
        with ThreadPoolExecutor(3) as pool:
            outs = list(
                pool.map(
                    lambda _: receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT), range(3)
                )
            )
        for o in outs:
            assert_identical(state, o)
        sender.disallow_checkpoint()


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_http_many_tensors_and_empty_state(num_chunks: int) -> None:
    """Many small tensors, an empty dict, and a state without tensors round-trip."""
    gen = torch.Generator().manual_seed(0)
    many = {
        f"t{i}": random_tensor(ALL_DTYPES[i % len(ALL_DTYPES)], (i % 5, 3), gen) for i in range(200)
    }
    with http_pair(num_chunks=num_chunks) as (sender, receiver):
        for step, state in enumerate([many, {}, {"only": [1, 2.0, "x"]}]):
            sender.send_checkpoint([1], step, state, TIMEOUT)
            out = receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT)
            assert_identical(state, out)


def test_http_wrong_step_is_an_error() -> None:
    """Asking for an older step fails at once; a newer one never served times out."""
    with http_pair() as (sender, receiver):
        sender.send_checkpoint([1], 5, {"x": torch.ones(3)}, TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="step 4"):
            receiver.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)
        assert time.monotonic() - t0 < 2
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(0, sender.metadata(), 6, timedelta(seconds=0.5))
        # After disallow, even the current step is no longer served.
        sender.disallow_checkpoint()
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=0.5))
        # An older step than the last served one stays an error after disallow.
        with pytest.raises(RuntimeError, match="step 2"):
            receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)


def test_http_receiver_times_out_when_nothing_served() -> None:
    """A receiver gives up with TimeoutError near its deadline if nothing is offered."""
    with http_pair() as (sender, receiver):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=0.5))
        elapsed = time.monotonic() - t0
        assert 0.3 < elapsed < 3, elapsed


def test_http_receiver_times_out_on_unreachable_or_silent_peer() -> None:
    """A peer that accepts but never answers cannot hang the receiver."""
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts/answers
    receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(
                0, f"http://127.0.0.1:{port}/checkpoint", 1, timedelta(seconds=0.5)
            )
        assert time.monotonic() - t0 < 3
    finally:
        receiver.shutdown()
        silent.close()


def test_http_receiver_may_ask_before_sender_serves() -> None:
    """A receiver that asks early is answered once the step is offered."""
    state = {"w": torch.randn(10, 10)}
    with http_pair(num_chunks=2) as (sender, receiver):
        timer = threading.Timer(0.3, sender.send_checkpoint, args=([1], 7, state, TIMEOUT))
        timer.start()
        try:
            out = receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
        finally:
            timer.cancel()
            timer.join()
        assert_identical(state, out)


@pytest.mark.timeout(60)
def test_http_stalled_receiver_does_not_block_sender() -> None:
    """Receivers that connect and stall never hold up disallow/shutdown or the state lock."""
    held = 0
    held_lock = threading.Lock()

    @contextmanager
    def read_lock() -> Iterator[None]:
        nonlocal held
        with held_lock:
            held += 1
        try:
            yield
        finally:
            with held_lock:
                held -= 1

    big = {"w": torch.randn(16 << 20)}  # 64 MiB: far more than socket buffers hold
    sender: HTTPTransport[Any] = HTTPTransport(timedelta(seconds=30), state_dict_lock=read_lock)
    port = int(sender.metadata().split(":")[2].split("/")[0])
    sockets = []
    try:
        sender.send_checkpoint([1], 1, big, TIMEOUT)
        # One receiver requests the body and never reads it, one never sends a request.
        reader = socket.create_connection(("127.0.0.1", port))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.sendall(b"GET /checkpoint/1/full?wait=1 HTTP/1.0\r\n\r\n")
        idle = socket.create_connection(("127.0.0.1", port))
        sockets += [reader, idle]
        deadline = time.monotonic() + 10
        while held == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held == 1, "transfer did not start"
        time.sleep(0.3)  # let the server block on the full socket buffer

        t0 = time.monotonic()
        sender.disallow_checkpoint()
        assert time.monotonic() - t0 < 2
        assert held == 0, "state lock still held after disallow_checkpoint"

        # The server keeps working for others after the aborted transfer.
        sender.send_checkpoint([1], 2, {"x": torch.ones(2)}, TIMEOUT)
        receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
        try:
            out = receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)
            assert torch.equal(out["x"], torch.ones(2))
        finally:
            receiver.shutdown()

        # A stalled transfer again, then shutdown must return promptly.
        sender.send_checkpoint([1], 3, big, TIMEOUT)
        reader2 = socket.create_connection(("127.0.0.1", port))
        reader2.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader2.sendall(b"GET /checkpoint/3/full?wait=1 HTTP/1.0\r\n\r\n")
        sockets.append(reader2)
        deadline = time.monotonic() + 10
        while held == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        t0 = time.monotonic()
        sender.shutdown()
        assert time.monotonic() - t0 < 3
        assert held == 0
    finally:
        sender.shutdown()
        for s in sockets:
            s.close()


@pytest.mark.timeout(30)
def test_http_server_deadline_bounds_a_slow_receiver() -> None:
    """Without disallow, a stalled transfer is cut (lock released) at the offer's timeout."""
    held = threading.Semaphore(0)
    released = threading.Event()

    @contextmanager
    def read_lock() -> Iterator[None]:
        held.release()
        try:
            yield
        finally:
            released.set()

    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT, state_dict_lock=read_lock)
    port = int(sender.metadata().split(":")[2].split("/")[0])
    reader = socket.create_connection(("127.0.0.1", port))
    try:
        sender.send_checkpoint([1], 1, {"w": torch.randn(16 << 20)}, timedelta(seconds=1))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.sendall(b"GET /checkpoint/1/full HTTP/1.0\r\n\r\n")
        assert held.acquire(timeout=5), "transfer did not start"
        t0 = time.monotonic()
        assert released.wait(timeout=5), "stalled transfer still holds the state lock"
        assert 0.5 < time.monotonic() - t0 < 3
        # The connection is dropped, not left streaming.
        deadline = time.monotonic() + 3
        while sender._server.connections() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sender._server.connections()
    finally:
        reader.close()
        sender.shutdown()


@pytest.mark.parametrize("num_chunks", [0, 4])
@pytest.mark.parametrize("where", ["header", "tensor"])
def test_http_corrupted_stream_is_detected(num_chunks: int, where: str) -> None:
    """A byte flipped in transit (tampering proxy) raises, nothing is returned (the HTTP
    path; the native one has its own tampering tests)."""
    state = {"a": torch.randn(64, 64), "b": torch.randn(1000), "c": [torch.arange(100)], "n": 1}
    with http_pair(num_chunks=num_chunks, native=False) as (sender, receiver):
        sender.send_checkpoint([1], 1, state, TIMEOUT)
        flip_at = 30 if where == "header" else 3000
        if where == "header" and num_chunks:
            flip_at = 20  # within the separately fetched header frame
        port = int(sender.metadata().split(":")[2].split("/")[0])
        proxy = TamperProxy(port, flip_at=flip_at)
        try:
            with pytest.raises(CheckpointFormatError):
                receiver.recv_checkpoint(0, proxy.url(), 1, TIMEOUT)
            assert proxy.tampered >= 1
        finally:
            proxy.close()
        # The untampered path still works.
        assert_identical(state, receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT))


@pytest.mark.parametrize("num_chunks", [0, 4])
@pytest.mark.parametrize("cut_at", [0, 10, 5000, 16_000])
def test_http_truncated_stream_is_detected(num_chunks: int, cut_at: int) -> None:
    """A body cut short by the network raises instead of returning partial state (the HTTP
    path)."""
    state = {"a": torch.randn(64, 64), "b": torch.randn(1000), "c": [torch.arange(100)]}
    with http_pair(num_chunks=num_chunks, native=False) as (sender, receiver):
        sender.send_checkpoint([1], 1, state, TIMEOUT)
        port = int(sender.metadata().split(":")[2].split("/")[0])
        proxy = TamperProxy(port, cut_at=cut_at)
        try:
            with pytest.raises(CheckpointFormatError):
                receiver.recv_checkpoint(0, proxy.url(), 1, TIMEOUT)
        finally:
            proxy.close()


def test_http_uses_state_dict_lock_while_serving() -> None:
    """The read lock is taken for every data request and released afterwards."""
    entered = []

    @contextmanager
    def lock() -> Iterator[None]:
        entered.append(threading.current_thread().name)
        yield

    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT, state_dict_lock=lock)
    receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT, num_chunks=2)
    try:
        sender.send_checkpoint([1], 1, {"a": torch.ones(10), "b": torch.zeros(10)}, TIMEOUT)
        receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert len(entered) == 2  # two range requests (the header needs no lock)
        assert all(name != threading.current_thread().name for name in entered)
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_http_rejects_garbage_requests() -> None:
    """Malformed URLs get a 4xx answer and do not disturb serving."""
    import http.client

    with http_pair() as (sender, receiver):
        sender.send_checkpoint([1], 1, {"a": torch.ones(2)}, TIMEOUT)
        port = int(sender.metadata().split(":")[2].split("/")[0])
        for path in [
            "/",
            "/checkpoint/abc/full",
            "/checkpoint/1/range/0/99?gen=x",
            "/checkpoint/1/unknown",
            "/checkpoint/1/full?wait=nan",
            "/checkpoint/1/range/a/b?gen=x",
        ]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                assert 400 <= resp.status < 500, (path, resp.status)
                resp.read()
            finally:
                conn.close()
        out = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert torch.equal(out["a"], torch.ones(2))


def test_http_metadata_is_reachable_and_env_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """metadata() names a reachable address; TORCHFT_TIMEOUT_SEC overrides the timeout."""
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "3.5")
    transport: HTTPTransport[Any] = HTTPTransport(timedelta(seconds=100))
    try:
        assert transport._timeout == timedelta(seconds=3.5)
        from urllib.parse import urlsplit

        url = urlsplit(transport.metadata())
        assert url.hostname and url.port
        with socket.create_connection((url.hostname, url.port), timeout=2):
            pass
    finally:
        transport.shutdown()
    with pytest.raises(ValueError):
        HTTPTransport(TIMEOUT, num_chunks=-1)


def test_http_metadata_falls_back_when_hostname_is_unusable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unresolvable hostname is skipped for an address that reaches the server."""
    from urllib.parse import urlsplit

    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "no-such-host.invalid")
    with http_pair() as (sender, receiver):
        url = urlsplit(sender.metadata())
        assert url.hostname and "invalid" not in url.hostname
        sender.send_checkpoint([1], 1, {"a": torch.arange(3)}, TIMEOUT)
        out = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert torch.equal(out["a"], torch.arange(3))


def test_http_shutdown_leaves_no_threads() -> None:
    """After shutdown(wait=True) no server, connection or fetch thread is left running."""
    before = set(threading.enumerate())
    with http_pair(num_chunks=3) as (sender, receiver):
        sender.send_checkpoint([1], 1, {"x": [torch.randn(1000) for _ in range(10)]}, TIMEOUT)
        receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert set(threading.enumerate()) - before, "the transports run server threads"
    deadline = time.monotonic() + 3
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in set(threading.enumerate()) - before]


def test_http_shutdown_is_idempotent_and_refuses_new_sends() -> None:
    """After shutdown the transport refuses to serve and a second shutdown is a no-op."""
    transport: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    transport.shutdown()
    transport.shutdown()
    with pytest.raises(RuntimeError):
        transport.send_checkpoint([1], 1, {}, TIMEOUT)


_SENDER_PROCESS = """
import sys, time
from contextlib import contextmanager
from datetime import timedelta

from test_checkpointing import realistic_state
from torchft.checkpointing import HTTPTransport

mode = sys.argv[1]


@contextmanager
def slow_lock():
    print("LOCKED", flush=True)
    time.sleep(float(sys.argv[2]))
    yield


lock = slow_lock if mode == "slow_lock" else None
state, *_ = realistic_state(seed=5)
transport = HTTPTransport(timedelta(seconds=30), state_dict_lock=lock)
transport.send_checkpoint([1], 9, state, timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.read()
transport.shutdown()
"""


@contextmanager
def sender_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Runs an HTTPTransport sender in its own process; yields it and its metadata URL."""
    import torchft

    paths = [str(Path(torchft.__file__).parent.parent), str(Path(__file__).parent)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER_PROCESS, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), f"sender process failed to start: {url!r}"
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


@pytest.mark.timeout(90)
def test_http_round_trip_across_processes() -> None:
    """A state served by another process arrives bit-identical to a local rebuild of it."""
    expected, *_ = realistic_state(seed=5)
    with sender_process("plain") as (_, url):
        for num_chunks in (0, 4):
            receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT, num_chunks=num_chunks)
            try:
                out = receiver.recv_checkpoint(0, url, 9, TIMEOUT)
            finally:
                receiver.shutdown()
            assert_identical(expected, out)


@pytest.mark.timeout(90)
def test_http_hung_or_killed_sender_fails_receiver_promptly() -> None:
    """SIGSTOP on the sender ends in TimeoutError at the deadline; SIGKILL in a prompt error."""
    receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        with sender_process("plain") as (proc, url):
            proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError):
                    receiver.recv_checkpoint(0, url, 9, timedelta(seconds=1))
                assert time.monotonic() - t0 < 4
            finally:
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10)
            t0 = time.monotonic()
            with pytest.raises(ConnectionError):
                receiver.recv_checkpoint(0, url, 9, TIMEOUT)
            assert time.monotonic() - t0 < 3

        # Killed while it holds the request (before the body): the receiver fails at once.
        with sender_process("slow_lock", "30") as (proc, url):
            result: list[BaseException | None] = []

            def fetch() -> None:
                try:
                    receiver.recv_checkpoint(0, url, 9, TIMEOUT)
                    result.append(None)
                except BaseException as e:  # noqa: BLE001
                    result.append(e)

            thread = threading.Thread(target=fetch)
            thread.start()
            assert proc.stdout is not None
            # Each parallel stream takes the lock: one or more LOCKED on the line.
            assert proc.stdout.readline().startswith("LOCKED")
            t0 = time.monotonic()
            proc.kill()
            thread.join(timeout=8)
            assert not thread.is_alive()
            assert time.monotonic() - t0 < 3
            assert isinstance(result[0], ConnectionError), result
    finally:
        receiver.shutdown()


# --------------------------------------------------------------------------- PG transport


def _gloo_pair(timeout: timedelta) -> list[Any]:
    """Two Gloo process groups (ranks 0 and 1) over loopback, built concurrently."""
    store = dist.HashStore()
    pgs: list[Any] = [None, None]

    def make(rank: int) -> None:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, opts)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(make, [0, 1]))
    return pgs


def _run_pair(fn0: Callable[[], Any], fn1: Callable[[], Any]) -> tuple[Any, Any]:
    with ThreadPoolExecutor(2) as pool:
        f0 = pool.submit(fn0)
        f1 = pool.submit(fn1)
        return f0.result(timeout=60), f1.result(timeout=60)


@pytest.mark.timeout(60)
def test_pg_transport_round_trip_and_in_place() -> None:
    """Gloo send/recv delivers the state bit-identical, in place when shapes match."""
    pgs = _gloo_pair(timedelta(seconds=20))
    state, *_ = realistic_state(seed=1)
    local, local_model, *_ = realistic_state(seed=2)
    local["user"]["model"]["extra_local_only"] = torch.zeros(3)
    local_w = local["user"]["model"]["lin.weight"]
    local_ptrs = {k: v.data_ptr() for k, v in local["user"]["model"].items()}

    sender: PGTransport[Any] = PGTransport(pgs[0], timedelta(seconds=20), torch.device("cpu"))
    receiver: PGTransport[Any] = PGTransport(
        pgs[1], timedelta(seconds=20), torch.device("cpu"), state_dict=lambda: local
    )
    assert isinstance(sender.metadata(), str)
    _, out = _run_pair(
        lambda: sender.send_checkpoint([1], 3, state, timedelta(seconds=20)),
        lambda: receiver.recv_checkpoint(0, "<n/a>", 3, timedelta(seconds=20)),
    )
    assert_identical(state, out)
    # Received in place: same storage as the local tensors, now holding the source's values.
    for k, v in out["user"]["model"].items():
        assert v.data_ptr() == local_ptrs[k], k
    assert torch.equal(local_w, state["user"]["model"]["lin.weight"])
    assert torch.equal(local_model.lin.weight, state["user"]["model"]["lin.weight"])

    # Without a local state dict, fresh tensors are allocated.
    plain: PGTransport[Any] = PGTransport(pgs[1], timedelta(seconds=20), torch.device("cpu"))
    _, out2 = _run_pair(
        lambda: sender.send_checkpoint([1], 4, state, timedelta(seconds=20)),
        lambda: plain.recv_checkpoint(0, "<n/a>", 4, timedelta(seconds=20)),
    )
    assert_identical(state, out2)
    assert out2["user"]["model"]["lin.weight"].data_ptr() != local_w.data_ptr()


@pytest.mark.timeout(60)
def test_pg_transport_wrong_step_and_timeout() -> None:
    """A step mismatch is an error; a receive with no sender times out."""
    pgs = _gloo_pair(timedelta(seconds=20))
    sender: PGTransport[Any] = PGTransport(pgs[0], timedelta(seconds=20), torch.device("cpu"))
    receiver: PGTransport[Any] = PGTransport(pgs[1], timedelta(seconds=20), torch.device("cpu"))
    state = {"a": torch.ones(4)}
    with ThreadPoolExecutor(2) as pool:
        fs = pool.submit(sender.send_checkpoint, [1], 5, state, timedelta(seconds=20))
        fr = pool.submit(receiver.recv_checkpoint, 0, "<n/a>", 6, timedelta(seconds=20))
        with pytest.raises(RuntimeError, match="step 5"):
            fr.result(timeout=30)
        # Drain the payload so the sender completes.
        buf = torch.empty(16, dtype=torch.uint8)
        pgs[1].recv([buf], 0, 0).wait()
        fs.result(timeout=30)
    assert torch.equal(buf.view(torch.float32), state["a"])

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        receiver.recv_checkpoint(0, "<n/a>", 1, timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 10


_PG_RECEIVER_PROCESS = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from test_checkpointing import assert_identical, realistic_state
from torchft.checkpointing import PGTransport

port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
opts = dist.ProcessGroupGloo._Options()
opts._timeout = timedelta(seconds=30)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = dist.ProcessGroupGloo(store, 1, 2, opts)
local, *_ = realistic_state(seed=8)
transport = PGTransport(pg, timedelta(seconds=30), torch.device("cpu"), state_dict=lambda: local)
out = transport.recv_checkpoint(0, "<n/a>", 11, timedelta(seconds=30))
expected, *_ = realistic_state(seed=3)
assert_identical(expected, out)
assert out["user"]["model"]["lin.weight"].data_ptr() == local["user"]["model"]["lin.weight"].data_ptr()
print("OK", flush=True)
"""


@pytest.mark.timeout(120)
def test_pg_transport_between_processes() -> None:
    """PGTransport over Gloo between two processes (TCPStore on port 0), in place."""
    import torchft

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    paths = [str(Path(torchft.__file__).parent.parent), str(Path(__file__).parent)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _PG_RECEIVER_PROCESS, str(store.port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=60)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, 0, 2, opts)
        state, *_ = realistic_state(seed=3)
        sender: PGTransport[Any] = PGTransport(pg, timedelta(seconds=60), torch.device("cpu"))  # type: ignore[arg-type]
        sender.send_checkpoint([1], 11, state, timedelta(seconds=60))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == "OK"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
