"""Safe, streamed wire format for nested state dicts (the byte path of the checkpoint transports).

A state dict is split into two parts:

* a small JSON **header** describing the structure (dicts with their key types, lists,
  tuples, scalars, dtypes, devices) and, for every tensor, its dtype, shape and byte length;
* the raw **tensor bytes**, written straight from tensor memory (no intermediate copy of
  the whole state) in the order of the header's tensor table.

Decoding only ever parses JSON and copies bytes into freshly allocated (or caller-provided)
tensors: no pickle, no ``torch.load``, no attribute lookup driven by peer data, so a
malicious peer cannot execute code. Every frame carries a CRC32 so corruption and
truncation are detected before anything is returned.

Stream layout (all integers little endian)::

    header frame : MAGIC_HEADER | u64 json_len | u32 crc32(json) | json
    range frame  : MAGIC_RANGE | u64 start | u64 end
                   then for each tensor i in [start, end): raw bytes | u32 crc32(raw)
                   then MAGIC_END | u64 (end - start) | u32 crc32(all tensor crcs)

A full checkpoint is a header frame followed by the range frame of every tensor; the
parallel HTTP path fetches the header once and then disjoint ranges concurrently.

The functions here are the internal interface the transports use (``encode``,
``write_header``/``write_range``, ``read_header``/``read_range``, ``build``), kept small so
the byte path can later move to native code without touching the transports.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from torchft._torchft import _crc32_update

logger: logging.Logger = logging.getLogger(__name__)

MAGIC_HEADER = b"TFTCKH01"
MAGIC_RANGE = b"TFTCKR01"
MAGIC_END = b"TFTCKEND"
FORMAT_VERSION = 1

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_HEADER_PREFIX = struct.Struct("<8sQI")
_RANGE_PREFIX = struct.Struct("<8sQQ")
_END = struct.Struct("<8sQI")

# Bytes written per socket call / read per socket call; also the granularity of
# deadline and abort checks.
CHUNK_BYTES = 4 << 20
# Refuse absurd headers from a peer instead of allocating for them.
MAX_HEADER_BYTES = 256 << 20
# Header bytes read per call: the most a header read allocates beyond what the peer sent.
HEADER_READ_BYTES = 1 << 20
# Ranges with at least this many bytes hash on a worker thread, overlapping socket I/O.
_OVERLAP_MIN_BYTES = 1 << 20
# Nesting deeper than this is refused on both sides (it would exhaust the Python stack).
MAX_DEPTH = 256

_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
# Whitelist name -> dtype (only names this torch build knows). Decoding never looks a peer
# supplied name up anywhere else.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_TO_NAME: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


class CheckpointFormatError(RuntimeError):
    """The received checkpoint stream is corrupted, truncated or malformed.

    Raised instead of returning partially loaded state.
    """


@dataclass(frozen=True)
class TensorSpec:
    """Wire description of one tensor: dtype name, shape and exact byte length."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form stored in the header's tensor table."""
        return {"dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes}

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype (already validated against the whitelist)."""
        return _DTYPES[self.dtype]


@dataclass
class Encoded:
    """A state dict flattened for the wire.

    Attributes:
        header: the JSON header bytes (structure + tensor table + transport meta).
        tensors: the tensors referenced by the header, in table order (original objects:
            they may live on any device and be non-contiguous; bytes are taken at write time).
        specs: wire description of each tensor.
    """

    header: bytes
    tensors: list[torch.Tensor]
    specs: list[TensorSpec]

    @property
    def total_tensor_bytes(self) -> int:
        """Sum of the raw tensor bytes (payload size without framing)."""
        return sum(s.nbytes for s in self.specs)


@dataclass
class Header:
    """A decoded, validated header."""

    root: Any
    specs: list[TensorSpec]
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Encoding


def _tensor_spec(t: torch.Tensor, path: str) -> TensorSpec:
    if t.layout != torch.strided:
        raise TypeError(f"{path}: tensors with layout {t.layout} are not supported")
    if t.is_quantized:
        raise TypeError(f"{path}: quantized tensors are not supported")
    if t.device.type == "meta":
        raise TypeError(f"{path}: meta tensors carry no data and cannot be sent")
    name = _DTYPE_TO_NAME.get(t.dtype)
    if name is None:
        raise TypeError(f"{path}: tensor dtype {t.dtype} is not supported")
    shape = tuple(int(s) for s in t.shape)
    return TensorSpec(dtype=name, shape=shape, nbytes=t.numel() * t.element_size())


def _bytes_tensor(v: bytes | bytearray) -> torch.Tensor:
    if not v:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(v), dtype=torch.uint8)


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.specs: list[TensorSpec] = []
        self._tensor_ids: dict[int, int] = {}
        self._stack: set[int] = set()

    def _add_tensor(self, t: torch.Tensor, path: str) -> int:
        idx = self._tensor_ids.get(id(t))
        if idx is not None:
            return idx
        spec = _tensor_spec(t, path)
        idx = len(self.tensors)
        self.tensors.append(t)
        self.specs.append(spec)
        self._tensor_ids[id(t)] = idx
        return idx

    def key(self, k: object, path: str) -> Any:
        if k is None or type(k) in (bool, int, str):
            return k
        if type(k) is float or type(k) is tuple:
            return self.value(k, path, 0)
        raise TypeError(
            f"{path}: dict key {k!r} of type {type(k).__qualname__} is not supported "
            "(keys must be str, int, float, bool, None or tuples of those)"
        )

    def value(self, v: object, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"{path}: nesting deeper than {MAX_DEPTH} levels")
        tv = type(v)
        if v is None or tv is bool or tv is int or tv is str:
            return v
        if tv is float:
            if math.isfinite(v):  # type: ignore[arg-type]
                return v
            return {"$": "float", "v": repr(v)}
        if isinstance(v, torch.Tensor):
            if tv is torch.nn.Parameter:
                idx = self._add_tensor(v, path)
                return {"$": "param", "t": idx, "rg": bool(v.requires_grad)}
            if tv is not torch.Tensor:
                raise TypeError(f"{path}: tensor subclass {tv.__qualname__} is not supported")
            return {"$": "tensor", "t": self._add_tensor(v, path)}
        if tv is bytes or tv is bytearray:
            data = _bytes_tensor(v)  # type: ignore[arg-type]
            idx = self._add_tensor(data, path)
            return {"$": "bytes" if tv is bytes else "bytearray", "t": idx}
        if tv is torch.dtype:
            name = _DTYPE_TO_NAME.get(v)  # type: ignore[call-overload,unused-ignore]
            if name is None:
                raise TypeError(f"{path}: dtype {v} is not supported")
            return {"$": "dtype", "v": name}
        if tv is torch.device:
            return {"$": "device", "v": str(v)}
        if tv in (dict, OrderedDict, list, tuple):
            if id(v) in self._stack:
                raise TypeError(f"{path}: reference cycle in state dict")
            self._stack.add(id(v))
            try:
                return self._container(v, path, depth)
            finally:
                self._stack.discard(id(v))
        raise TypeError(
            f"{path}: value of type {tv.__module__}.{tv.__qualname__} is not supported in a "
            "checkpoint (supported: dict, OrderedDict, list, tuple, int, float, bool, str, "
            "None, bytes, torch.Tensor, torch.dtype, torch.device)"
        )

    def _container(self, v: Any, path: str, depth: int) -> Any:
        if type(v) is list:
            return [self.value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        if type(v) is tuple:
            return {
                "$": "tuple",
                "v": [self.value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)],
            }
        keys = []
        values = []
        for k, x in v.items():
            sub = f"{path}[{k!r}]"
            keys.append(self.key(k, sub))
            values.append(self.value(x, sub, depth + 1))
        node: dict[str, Any] = {"$": "dict" if type(v) is dict else "odict", "k": keys, "v": values}
        meta = getattr(v, "_metadata", None)
        if type(v) is OrderedDict and meta is not None:
            # nn.Module.state_dict() keeps per-module versions here; load_state_dict uses them.
            node["m"] = self.value(meta, f"{path}._metadata", depth + 1)
        return node


def encode(state_dict: object, meta: dict[str, Any] | None = None) -> Encoded:
    """Flattens a nested state dict into a JSON header and the list of its tensors.

    Cheap: no tensor data is read or copied (only references are kept), so it can run on
    the caller's thread and report unsupported values at once.

    Args:
        state_dict: nested dict/list/tuple of supported leaves.
        meta: small JSON-serialisable transport data stored in the header (e.g. the step).

    Returns:
        The encoded header with the tensor references.

    Raises:
        TypeError: a value (or key) of an unsupported type, a tensor subclass, an
            unsupported dtype/layout, a reference cycle or too deep nesting.
    """
    enc = _Encoder()
    root = enc.value(state_dict, "state_dict", 0)
    doc = {
        "version": FORMAT_VERSION,
        "meta": meta or {},
        "tensors": [s.to_json() for s in enc.specs],
        "root": root,
    }
    header = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return Encoded(header=header, tensors=enc.tensors, specs=enc.specs)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """Returns a contiguous flat uint8 CPU view of a tensor's data (copying only if needed).

    Args:
        t: any supported tensor (any device, possibly non-contiguous, conjugated or 0-dim).

    Returns:
        A 1-D uint8 CPU tensor with exactly ``numel * element_size`` bytes.
    """
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def header_frame(enc: Encoded) -> bytes:
    """Returns the framed header (magic, length, CRC, JSON)."""
    return _HEADER_PREFIX.pack(MAGIC_HEADER, len(enc.header), zlib.crc32(enc.header)) + enc.header


def range_frame_size(enc: Encoded, start: int, end: int) -> int:
    """Number of bytes :func:`write_range` produces for tensors ``[start, end)``."""
    payload = sum(s.nbytes for s in enc.specs[start:end])
    return _RANGE_PREFIX.size + payload + _U32.size * (end - start) + _END.size


class _Crc:
    """CRC32 over a sequence of pieces of tensor memory, optionally computed on a worker.

    zlib's CRC-32, computed natively without the GIL, so hashing piece k on the worker
    overlaps with the socket I/O of piece k+1 on the caller's thread; a single worker keeps
    the updates in order.
    """

    def __init__(self, pool: ThreadPoolExecutor | None) -> None:
        self._pool = pool
        self._crc = 0
        self._pending: Future[None] | None = None

    def _update(self, address: int, length: int, keep: memoryview) -> None:
        self._crc = _crc32_update(self._crc, address, length)

    def update(self, piece: memoryview, address: int) -> None:
        """Adds ``piece``, whose bytes start at ``address`` (must stay unmodified until
        :meth:`value`; the worker holds ``piece``, and so the memory, until it summed it)."""
        length = len(piece)
        if self._pool is None or length < _OVERLAP_MIN_BYTES:
            self._drain()
            self._update(address, length, piece)
        else:
            self._pending = self._pool.submit(self._update, address, length, piece)

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def value(self) -> int:
        """Returns the CRC of every piece added so far."""
        self._drain()
        return self._crc


def _crc_pool(nbytes: int) -> ThreadPoolExecutor | None:
    if nbytes < _OVERLAP_MIN_BYTES:
        return None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchft-ckpt-crc")


def _iter_range(
    enc: Encoded, start: int, end: int, chunk_bytes: int
) -> Iterator[bytes | memoryview]:
    yield _RANGE_PREFIX.pack(MAGIC_RANGE, start, end)
    crcs = bytearray()
    pool = _crc_pool(sum(s.nbytes for s in enc.specs[start:end]))
    try:
        for i in range(start, end):
            spec = enc.specs[i]
            flat = tensor_bytes(enc.tensors[i])
            if flat.numel() != spec.nbytes:
                # Resized after encode(): never send bytes the header doesn't describe.
                raise RuntimeError(
                    f"tensor {i} changed size while being sent "
                    f"({flat.numel()} != {spec.nbytes} bytes)"
                )
            crc = _Crc(pool)
            if spec.nbytes:
                mv = flat.numpy().data
                base = flat.data_ptr()
                for off in range(0, spec.nbytes, chunk_bytes):
                    piece = mv[off : off + chunk_bytes]
                    crc.update(piece, base + off)
                    yield piece
            crc_b = _U32.pack(crc.value())
            crcs += crc_b
            yield crc_b
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    yield _END.pack(MAGIC_END, end - start, zlib.crc32(crcs))


def write_range(
    enc: Encoded,
    start: int,
    end: int,
    write: Callable[[bytes | memoryview], object],
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Streams tensors ``[start, end)`` as a range frame through ``write``.

    Tensor memory is handed to ``write`` directly (memoryview slices), never accumulated.

    Args:
        enc: the encoded state dict.
        start: first tensor index.
        end: one past the last tensor index.
        write: called with each piece in order; may raise to abort (e.g. on deadline).
        chunk_bytes: maximum size of one piece.

    Returns:
        The number of bytes written.
    """
    if not 0 <= start <= end <= len(enc.specs):
        raise ValueError(f"invalid tensor range [{start}, {end}) of {len(enc.specs)}")
    n = 0
    for piece in _iter_range(enc, start, end, chunk_bytes):
        write(piece)
        n += len(piece)
    return n


# ---------------------------------------------------------------------------------------
# Decoding

ReadInto = Callable[[memoryview], int]


def read_exact(readinto: ReadInto, buf: memoryview, what: str) -> None:
    """Fills ``buf`` completely from ``readinto`` or raises.

    Raises:
        CheckpointFormatError: the stream ended early.
    """
    got = 0
    total = len(buf)
    while got < total:
        n = readinto(buf[got:])
        if not n:
            raise CheckpointFormatError(
                f"checkpoint stream truncated while reading {what} ({got}/{total} bytes)"
            )
        got += n


def _read_struct(readinto: ReadInto, st: struct.Struct, what: str) -> tuple[Any, ...]:
    buf = bytearray(st.size)
    read_exact(readinto, memoryview(buf), what)
    return st.unpack(buf)


def _reject_constant(name: str) -> Any:
    raise CheckpointFormatError(f"invalid JSON constant {name} in checkpoint header")


def _parse_specs(raw: Any) -> list[TensorSpec]:
    if not isinstance(raw, list):
        raise CheckpointFormatError("checkpoint header: tensor table is not a list")
    specs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise CheckpointFormatError(f"checkpoint header: tensor {i} is not an object")
        dtype = item.get("dtype")
        shape = item.get("shape")
        nbytes = item.get("nbytes")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise CheckpointFormatError(
                f"checkpoint header: tensor {i} has unknown dtype {dtype!r}"
            )
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise CheckpointFormatError(
                f"checkpoint header: tensor {i} has invalid shape {shape!r}"
            )
        if type(nbytes) is not int:
            raise CheckpointFormatError(f"checkpoint header: tensor {i} has invalid length")
        numel = math.prod(shape)
        expected = numel * _DTYPES[dtype].itemsize
        if nbytes != expected:
            raise CheckpointFormatError(
                f"checkpoint header: tensor {i} length {nbytes} does not match "
                f"{dtype}{shape} ({expected} bytes)"
            )
        specs.append(TensorSpec(dtype=dtype, shape=tuple(shape), nbytes=nbytes))
    return specs


def parse_header(data: bytes) -> Header:
    """Parses and validates header JSON (no framing).

    Raises:
        CheckpointFormatError: malformed JSON, unknown version or invalid tensor table.
    """
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"checkpoint header is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise CheckpointFormatError("checkpoint header has an unsupported format version")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise CheckpointFormatError("checkpoint header meta is not an object")
    if "root" not in doc:
        raise CheckpointFormatError("checkpoint header has no root")
    return Header(root=doc["root"], specs=_parse_specs(doc.get("tensors")), meta=meta)


def read_header(readinto: ReadInto) -> Header:
    """Reads and validates a header frame.

    Args:
        readinto: ``file.readinto``-like callable of the stream.

    Returns:
        The validated header.

    Raises:
        CheckpointFormatError: bad magic, oversized, CRC mismatch, truncated or malformed.
    """
    magic, length, crc = _read_struct(readinto, _HEADER_PREFIX, "header prefix")
    if magic != MAGIC_HEADER:
        raise CheckpointFormatError(
            "not a torchft checkpoint stream (bad header magic): the peer may be a "
            "pickle-based HTTPTransport, whose checkpoints this version never unpickles"
        )
    if length > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"checkpoint header too large ({length} bytes)")
    # The length is the peer's claim: read it in bounded pieces so memory grows with what
    # actually arrives, not with what was announced.
    data = bytearray()
    piece = bytearray(min(length, HEADER_READ_BYTES))
    view = memoryview(piece)
    while len(data) < length:
        n = readinto(view[: min(len(piece), length - len(data))])
        if not n:
            raise CheckpointFormatError(
                f"checkpoint stream truncated while reading header ({len(data)}/{length} bytes)"
            )
        data += view[:n]
    if zlib.crc32(data) != crc:
        raise CheckpointFormatError("checkpoint header checksum mismatch (corrupted stream)")
    return parse_header(bytes(data))


def alloc_tensor(spec: TensorSpec) -> torch.Tensor:
    """Allocates an uninitialised CPU tensor matching ``spec``.

    Raises:
        CheckpointFormatError: the size announced by the peer cannot be allocated.
    """
    try:
        return torch.empty(spec.shape, dtype=spec.torch_dtype)
    except (RuntimeError, MemoryError) as e:
        raise CheckpointFormatError(
            f"cannot allocate a {spec.dtype}{list(spec.shape)} tensor ({spec.nbytes} bytes): {e}"
        ) from None


def read_range(
    readinto: ReadInto,
    header: Header,
    start: int,
    end: int,
    out: list[torch.Tensor | None],
    chunk_bytes: int = CHUNK_BYTES,
    check: Callable[[], None] | None = None,
) -> None:
    """Reads a range frame for tensors ``[start, end)`` into ``out``.

    Each tensor's bytes are read directly into its (new, or already present in ``out`` and
    matching) CPU tensor memory and verified against the frame CRC.

    Args:
        readinto: ``file.readinto``-like callable of the stream.
        header: the header describing the tensors.
        start: first tensor index expected.
        end: one past the last tensor index expected.
        out: per-tensor destination list (len == number of tensors); ``None`` entries are
            allocated. Entries are only written after their CRC matched.
        chunk_bytes: maximum bytes per read call.
        check: called between reads (deadline / cancellation); may raise.

    Raises:
        CheckpointFormatError: wrong range, CRC mismatch, truncation or bad trailer.
    """
    magic, r_start, r_end = _read_struct(readinto, _RANGE_PREFIX, "range prefix")
    if magic != MAGIC_RANGE:
        raise CheckpointFormatError("bad range magic in checkpoint stream")
    if (r_start, r_end) != (start, end):
        raise CheckpointFormatError(f"expected tensors [{start}, {end}), got [{r_start}, {r_end})")
    crcs = bytearray()
    crc_buf = bytearray(4)
    pool = _crc_pool(sum(s.nbytes for s in header.specs[start:end]))
    try:
        for i in range(start, end):
            spec = header.specs[i]
            dst = out[i]
            if dst is None or not _is_plain_cpu_target(dst, spec):
                dst = alloc_tensor(spec)
            crc = _Crc(pool)
            if spec.nbytes:
                flat = dst.reshape(-1).view(torch.uint8)
                mv = flat.numpy().data
                base = flat.data_ptr()
                for off in range(0, spec.nbytes, chunk_bytes):
                    if check is not None:
                        check()
                    piece = mv[off : off + chunk_bytes]
                    read_exact(readinto, piece, f"tensor {i}")
                    crc.update(piece, base + off)
            read_exact(readinto, memoryview(crc_buf), f"tensor {i} checksum")
            crcs += crc_buf
            if _U32.unpack(crc_buf)[0] != crc.value():
                raise CheckpointFormatError(f"checksum mismatch in tensor {i} (corrupted stream)")
            out[i] = dst
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    magic, count, total_crc = _read_struct(readinto, _END, "range trailer")
    if magic != MAGIC_END or count != end - start or total_crc != zlib.crc32(crcs):
        raise CheckpointFormatError("bad trailer in checkpoint stream (corrupted or truncated)")


def _is_plain_cpu_target(t: torch.Tensor, spec: TensorSpec) -> bool:
    return (
        t.device.type == "cpu"
        and t.dtype == spec.torch_dtype
        and tuple(t.shape) == spec.shape
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def split_ranges(specs: Sequence[TensorSpec], parts: int) -> list[tuple[int, int]]:
    """Splits the tensor table into up to ``parts`` contiguous ranges of similar byte size.

    Args:
        specs: the tensor table.
        parts: desired number of ranges (>= 1).

    Returns:
        Non-empty ``(start, end)`` ranges covering every tensor, in order.
    """
    n = len(specs)
    if n == 0:
        return []
    parts = max(1, min(parts, n))
    total = sum(s.nbytes for s in specs) + n  # +n so that empty tensors still spread
    target = total / parts
    ranges: list[tuple[int, int]] = []
    start = 0
    acc = 0
    for i, s in enumerate(specs):
        acc += s.nbytes + 1
        remaining_parts = parts - len(ranges) - 1
        if (
            acc >= target * (len(ranges) + 1)
            and remaining_parts > 0
            and n - (i + 1) >= remaining_parts
        ):
            ranges.append((start, i + 1))
            start = i + 1
    ranges.append((start, n))
    return [r for r in ranges if r[0] < r[1]]


class _Builder:
    def __init__(self, tensors: Sequence[torch.Tensor | None], specs: Sequence[TensorSpec]) -> None:
        self._tensors = tensors
        self._specs = specs

    def _tensor(self, node: dict[str, Any]) -> torch.Tensor:
        idx = node.get("t")
        if type(idx) is not int or not 0 <= idx < len(self._tensors):
            raise CheckpointFormatError(f"checkpoint header references invalid tensor {idx!r}")
        t = self._tensors[idx]
        if t is None:
            raise CheckpointFormatError(f"tensor {idx} was not received")
        return t

    def key(self, node: Any, depth: int) -> Any:
        k = self.value(node, depth)
        if not (k is None or type(k) in (bool, int, float, str, tuple)):
            raise CheckpointFormatError(f"invalid dict key type {type(k).__qualname__}")
        return k

    def value(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CheckpointFormatError("checkpoint structure nested too deeply")
        tn = type(node)
        if node is None or tn in (bool, int, float, str):
            return node
        if tn is list:
            return [self.value(x, depth + 1) for x in node]
        if tn is not dict:
            raise CheckpointFormatError(f"invalid node in checkpoint header: {tn.__qualname__}")
        tag = node.get("$")
        if tag == "tensor":
            return self._tensor(node)
        if tag == "param":
            rg = node.get("rg")
            if type(rg) is not bool:
                raise CheckpointFormatError("invalid parameter node")
            return torch.nn.Parameter(self._tensor(node), requires_grad=rg)
        if tag in ("bytes", "bytearray"):
            t = self._tensor(node)
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise CheckpointFormatError("invalid bytes node")
            data = t.numpy().tobytes()
            return data if tag == "bytes" else bytearray(data)
        if tag == "tuple":
            items = node.get("v")
            if type(items) is not list:
                raise CheckpointFormatError("invalid tuple node")
            return tuple(self.value(x, depth + 1) for x in items)
        if tag in ("dict", "odict"):
            keys = node.get("k")
            vals = node.get("v")
            if type(keys) is not list or type(vals) is not list or len(keys) != len(vals):
                raise CheckpointFormatError("invalid dict node")
            pairs = [
                (self.key(k, depth + 1), self.value(v, depth + 1))
                for k, v in zip(keys, vals, strict=True)
            ]
            if tag == "dict":
                return dict(pairs)
            od: OrderedDict[Any, Any] = OrderedDict(pairs)
            if "m" in node:
                od._metadata = self.value(node["m"], depth + 1)  # type: ignore[attr-defined]
            return od
        if tag == "float":
            v = node.get("v")
            if v not in ("nan", "inf", "-inf"):
                raise CheckpointFormatError(f"invalid float node {v!r}")
            return float(v)
        if tag == "dtype":
            name = node.get("v")
            if not isinstance(name, str) or name not in _DTYPES:
                raise CheckpointFormatError(f"invalid dtype {name!r}")
            return _DTYPES[name]
        if tag == "device":
            dev = node.get("v")
            if not isinstance(dev, str) or len(dev) > 64:
                raise CheckpointFormatError("invalid device node")
            try:
                return torch.device(dev)
            except (RuntimeError, ValueError) as e:
                raise CheckpointFormatError(f"invalid device {dev!r}: {e}") from None
        raise CheckpointFormatError(f"unknown node tag {tag!r} in checkpoint header")


def build(header: Header, tensors: Sequence[torch.Tensor | None]) -> Any:
    """Rebuilds the original nested structure from a header and its received tensors.

    Args:
        header: the validated header.
        tensors: received tensors in table order.

    Returns:
        The state dict, with container and key types preserved.

    Raises:
        CheckpointFormatError: the structure is malformed or references a missing tensor.
    """
    try:
        return _Builder(tensors, header.specs).value(header.root, 0)
    except RecursionError:
        raise CheckpointFormatError("checkpoint structure nested too deeply") from None


def decode_stream(
    readinto: ReadInto, check: Callable[[], None] | None = None
) -> tuple[Header, Any]:
    """Reads a full stream (header frame + one range frame with every tensor).

    Args:
        readinto: ``file.readinto``-like callable.
        check: called between reads; may raise (deadline).

    Returns:
        ``(header, state_dict)``.
    """
    header = read_header(readinto)
    out: list[torch.Tensor | None] = [None] * len(header.specs)
    read_range(readinto, header, 0, len(header.specs), out, check=check)
    return header, build(header, out)


def encode_to_bytes(state_dict: object, meta: dict[str, Any] | None = None) -> bytes:
    """Encodes a whole state dict into one bytes object (tests and small payloads only)."""
    enc = encode(state_dict, meta)
    parts: list[bytes] = [header_frame(enc)]
    write_range(enc, 0, len(enc.specs), lambda b: parts.append(bytes(b)))
    return b"".join(parts)


def decode_bytes(data: bytes | bytearray | memoryview) -> Any:
    """Decodes a stream held in memory (tests and small payloads only)."""
    mv = memoryview(data)
    pos = 0

    def readinto(buf: memoryview) -> int:
        nonlocal pos
        n = min(len(buf), len(mv) - pos)
        buf[:n] = mv[pos : pos + n]
        pos += n
        return n

    _, sd = decode_stream(readinto)
    if pos != len(mv):
        raise CheckpointFormatError(f"{len(mv) - pos} trailing bytes after checkpoint stream")
    return sd


def tensor_paths(header: Header) -> list[tuple[tuple[Any, ...], int]]:
    """Lists where each tensor sits in the structure (for in-place receives).

    Args:
        header: a validated header.

    Returns:
        ``(path, tensor_index)`` pairs; a path is the sequence of dict keys / list indices
        leading from the root to a plain tensor node. Malformed parts are skipped (they
        fail later in :func:`build`).
    """
    builder = _Builder([], header.specs)
    found: list[tuple[tuple[Any, ...], int]] = []

    def walk(node: Any, path: tuple[Any, ...], depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if type(node) is list:
            for i, x in enumerate(node):
                walk(x, (*path, i), depth + 1)
            return
        if type(node) is not dict:
            return
        tag = node.get("$")
        if tag == "tensor" and type(node.get("t")) is int:
            found.append((path, node["t"]))
        elif tag == "tuple" and type(node.get("v")) is list:
            for i, x in enumerate(node["v"]):
                walk(x, (*path, i), depth + 1)
        elif tag in ("dict", "odict"):
            keys, vals = node.get("k"), node.get("v")
            if type(keys) is list and type(vals) is list:
                for k, v in zip(keys, vals, strict=False):
                    try:
                        key = builder.key(k, depth + 1)
                    except CheckpointFormatError:
                        continue
                    walk(v, (*path, key), depth + 1)

    walk(header.root, (), 0)
    return found


def lookup(root: Any, path: Sequence[Any]) -> Any:
    """The value at ``path`` (dict keys / list indices) in ``root``, or None if absent."""
    node = root
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def inplace_targets(
    header: Header, local: Any, accept: Callable[[torch.Tensor], bool]
) -> dict[int, torch.Tensor]:
    """Picks, for each tensor of ``header``, the local tensor it can be received into.

    A local tensor at the same path qualifies when ``accept`` takes it and it has the
    announced dtype and shape, is contiguous and neither conjugated nor negated. A tensor's
    memory is given to one header tensor at most: locals that share or overlap memory (tied
    weights, views) are used once, so no two receives ever write the same bytes.

    Args:
        header: the validated header of the incoming state.
        local: the receiver's current state (same structure as the sender's).
        accept: extra condition (e.g. the device).

    Returns:
        Header tensor index -> a view of the local tensor's memory to write into. The view
        has its own autograd version counter (``t.data``, not ``t.detach()``): a receive that
        writes it on another thread (a device copy on the quorum thread) must not bump the
        version counter of a live parameter, or a backward paused in a communication hook
        would fail with "modified by an inplace operation" when it resumes.
    """
    candidates: list[tuple[str, int, int, int, torch.Tensor]] = []
    seen: set[int] = set()
    for path, idx in tensor_paths(header):
        if idx in seen or not 0 <= idx < len(header.specs):
            continue
        t = lookup(local, path)
        spec = header.specs[idx]
        if not (
            isinstance(t, torch.Tensor)
            and accept(t)
            and t.dtype == spec.torch_dtype
            and tuple(t.shape) == spec.shape
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
        ):
            continue
        seen.add(idx)
        start = t.data_ptr()
        candidates.append((str(t.device), start, start + spec.nbytes, idx, t.data))
    targets: dict[int, torch.Tensor] = {}
    candidates.sort(key=lambda c: (c[0], c[1], c[2]))
    last_device, last_end = None, 0
    for device, start, end, idx, t in candidates:
        if start == end:  # empty: nothing is written
            targets[idx] = t
            continue
        if device == last_device and start < last_end:
            continue  # overlaps memory already given to another tensor
        targets[idx] = t
        last_device, last_end = device, end
    return targets
