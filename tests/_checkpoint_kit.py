"""Shared helpers of the checkpoint transport tests (torchft.checkpointing): exact
comparison of states, random tensors of every dtype, a realistic Manager-shaped state and a
pair of HTTP transports.

A test module that starts checkpoint servers imports ``checkpoint_servers_on_loopback`` (an
autouse fixture, found by pytest by name there)."""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchft.checkpointing import HTTPTransport
from torchft.checkpointing import _serialization as ser

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


@pytest.fixture(autouse=True)
def checkpoint_servers_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
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
