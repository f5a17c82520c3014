"""Property tests (hypothesis) of the checkpoint state (de)serializer and header parser.

Bounded in ``make test`` (hypothesis' default example count); ``make fuzz`` runs them with
``TORCHFT_HYPOTHESIS_PROFILE=fuzz`` for many more examples.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections import OrderedDict
from typing import Any

import pytest
import torch
from _checkpoint_kit import assert_identical
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._serialization import CheckpointFormatError

settings.register_profile(
    "fuzz", max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("TORCHFT_HYPOTHESIS_PROFILE", "default"))

pytestmark = pytest.mark.timeout(600)

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    t = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    if dtype == torch.bool:
        return (t % 2).to(torch.bool).reshape(shape)
    return t.view(dtype).reshape(shape)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    tensors(),
    st.sampled_from([torch.float32, torch.int64, torch.bfloat16]),
    st.just(torch.device("cpu")),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.booleans(), st.none())
states = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(st.text(max_size=6), children, max_size=4).map(OrderedDict),
    ),
    max_leaves=12,
)


@given(states)
def test_any_state_round_trips_bit_identical(state: Any) -> None:
    """Every supported state decodes to the same structure, types and bytes."""
    data = ser.encode_to_bytes(state, meta={"step": 1})
    assert_identical(ser.decode_bytes(data), state)


@given(states, st.data())
def test_corrupted_streams_are_refused_or_identical(state: Any, data: st.DataObject) -> None:
    """A flipped byte, a cut or trailing garbage never raises anything but
    CheckpointFormatError, and never yields a different state."""
    blob = bytearray(ser.encode_to_bytes(state))
    mode = data.draw(st.sampled_from(["flip", "cut", "extend"]))
    if mode == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    elif mode == "cut":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        blob += data.draw(st.binary(min_size=1, max_size=16))
    try:
        out = ser.decode_bytes(bytes(blob))
    except CheckpointFormatError:
        return
    assert_identical(out, state)


@given(st.binary(max_size=512))
def test_header_parser_refuses_garbage(raw: bytes) -> None:
    """Arbitrary bytes as header JSON raise CheckpointFormatError only."""
    try:
        ser.parse_header(raw)
    except CheckpointFormatError:
        pass


json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=6)
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values, json_values, json_values)
def test_well_framed_hostile_headers_are_refused_cleanly(
    root: Any, tensors_: Any, meta: Any
) -> None:
    """A correctly framed header (valid magic and CRC) with hostile contents is either
    refused with CheckpointFormatError or decodes without executing anything else."""
    doc = {"version": ser.FORMAT_VERSION, "root": root, "tensors": tensors_, "meta": meta}
    body = json.dumps(doc).encode()
    frame = struct.pack(ser._HEADER_PREFIX.format, ser.MAGIC_HEADER, len(body), zlib.crc32(body))
    stream = frame + body
    try:
        ser.decode_bytes(stream)
    except CheckpointFormatError:
        pass


class _LyingPeer:
    """A stream whose header prefix announces ``claimed`` bytes but which sends ``sent``."""

    def __init__(self, claimed: int, sent: bytes) -> None:
        prefix = struct.pack(ser._HEADER_PREFIX.format, ser.MAGIC_HEADER, claimed, 0)
        self.data = memoryview(prefix + sent)
        self.pos = 0
        self.largest_read = 0

    def readinto(self, buf: memoryview) -> int:
        self.largest_read = max(self.largest_read, len(buf))
        n = min(len(buf), len(self.data) - self.pos)
        buf[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


@pytest.mark.timeout(60)
def test_header_length_claim_does_not_allocate_what_was_not_sent() -> None:
    """A peer announcing a maximal header and sending 100 bytes makes the reader allocate
    about what arrived (one bounded read piece), not the announced length."""
    import tracemalloc

    peer = _LyingPeer(ser.MAX_HEADER_BYTES, b"{" * 100)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match=r"truncated while reading header \(100/"):
            ser.read_header(peer.readinto)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peer.largest_read <= ser.HEADER_READ_BYTES
    # One read piece plus bookkeeping; the claim was 256 MiB.
    assert peak < ser.HEADER_READ_BYTES + (1 << 20), peak
    # Just over the limit is refused before any body byte is read.
    peer = _LyingPeer(ser.MAX_HEADER_BYTES + 1, b"")
    with pytest.raises(CheckpointFormatError, match="too large"):
        ser.read_header(peer.readinto)


@settings(max_examples=20)
@given(st.integers(0, 3 * 1024 * 1024 + 17), st.integers(1, 3 * 1024 * 1024))
def test_header_read_in_pieces_round_trips(meta_len: int, max_read: int) -> None:
    """Headers of any size, delivered in reads of any size, parse to what was sent."""
    meta = {"step": 7, "gen": "g", "pad": "x" * meta_len}
    enc = ser.encode({"w": torch.arange(3.0)}, meta=meta)
    frame = memoryview(ser.header_frame(enc))
    pos = 0

    def readinto(buf: memoryview) -> int:
        nonlocal pos
        n = min(len(buf), max_read, len(frame) - pos)
        buf[:n] = frame[pos : pos + n]
        pos += n
        return n

    header = ser.read_header(readinto)
    assert header.meta == meta and pos == len(frame)
