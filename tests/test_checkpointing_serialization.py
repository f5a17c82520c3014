"""The checkpoint wire format (torchft.checkpointing._serialization): every dtype and layout
bit for bit, structure and types, refusal of unsafe or malformed input, and checksums."""

from __future__ import annotations

import base64
import io
import json
import pickle
import socket
import struct
import threading
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoint_kit import (  # noqa: F401 - the autouse fixture, found by pytest by name
    ALL_DTYPES,
    TIMEOUT,
    _Model,
    assert_identical,
    checkpoint_servers_on_loopback,
    random_tensor,
    realistic_state,
)

from torchft.checkpointing import CheckpointTransport, HTTPTransport, PGTransport
from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._serialization import CheckpointFormatError


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


def test_tensor_checksums_are_zlibs_crc32() -> None:
    """The stream's per-tensor checksums are zlib's CRC-32 of the tensor bytes, small tensors
    and ones large enough to be checksummed on the worker alike, so streams interoperate with
    every version; the native sum continues a CRC as zlib's does."""
    g = torch.Generator().manual_seed(1)
    small, big = torch.randn(37, generator=g), torch.randn(3 << 18, generator=g)  # 3 MiB
    data = ser.encode_to_bytes({"small": small, "big": big})
    for t in (small, big):
        raw = t.numpy().tobytes()
        at = data.find(raw)
        assert at >= 0
        (crc,) = struct.unpack("<I", data[at + len(raw) : at + len(raw) + 4])
        assert crc == zlib.crc32(raw)
    got = ser.decode_bytes(data)
    assert torch.equal(got["small"], small) and torch.equal(got["big"], big)
    # In 1 MiB pieces the big tensor's sum is carried through several worker updates.
    enc = ser.encode({"big": big})
    stream = bytearray()
    ser.write_range(enc, 0, 1, stream.extend, chunk_bytes=1 << 20)
    raw = big.numpy().tobytes()
    at = stream.find(raw)
    assert struct.unpack("<I", stream[at + len(raw) : at + len(raw) + 4])[0] == zlib.crc32(raw)
    out: list[torch.Tensor | None] = [torch.empty_like(big)]
    readinto = io.BytesIO(bytes(stream)).readinto
    ser.read_range(readinto, ser.parse_header(enc.header), 0, 1, out, chunk_bytes=1 << 20)
    assert out[0] is not None and torch.equal(out[0], big)
    part = ser._crc32_update(0, big.data_ptr(), 1001)
    assert ser._crc32_update(part, big.data_ptr() + 1001, len(raw) - 1001) == zlib.crc32(raw)
    assert ser._crc32_update(9, 0, 0) == 9
    with pytest.raises(ValueError, match="null address"):
        ser._crc32_update(0, 0, 4)
    with pytest.raises(ValueError, match="past the end of memory"):
        ser._crc32_update(0, 16, 2**63)


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
