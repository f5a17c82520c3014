"""Manager construction with fakes: server and environment wiring, argument and environment
validation, and the fakes' conformance to the native protocols the Manager is built on."""

from __future__ import annotations

import inspect
import re
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from _manager_kit import (  # noqa: F401 - fixtures, found by pytest by name
    FakeNative,
    FakePending,
    Harness,
    harness_fixture,
    master_store_fixture,
    native_fixture,
    store_fixture,
)
from torch.distributed import TCPStore

from torchft import coordination


def _protocol_methods(proto: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(proto).items()
        if callable(fn) and not name.startswith("__")
    }


@pytest.mark.parametrize(
    ("proto", "fake_name"),
    [
        (coordination.NativeManagerClient, "ManagerClient"),
        (coordination.NativeManagerServer, "ManagerServer"),
    ],
)
def test_fakes_implement_the_native_protocols(proto: type, fake_name: str) -> None:
    """The fakes offer every method of the protocol the Manager uses, with its parameters."""
    fake = getattr(FakeNative(), fake_name)
    for name, want in _protocol_methods(proto).items():
        got = inspect.signature(getattr(fake, name))
        assert list(got.parameters) == list(want.parameters), name
        for p in want.parameters.values():
            assert got.parameters[p.name].kind == p.kind, (name, p.name)


def test_fake_pending_implements_the_protocol() -> None:
    """The fake pending quorum has the protocol's methods."""
    for name, want in _protocol_methods(coordination.NativePendingQuorum).items():
        got = inspect.signature(getattr(FakePending, name))
        assert list(got.parameters) == list(want.parameters), name


# ----------------------------------------------------------------------------- construction


def test_constructor_wires_server_and_env(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 starts the server with the store address, port and a fresh replica id."""
    monkeypatch.setenv("TORCHFT_MANAGER_PORT", "0")
    h1 = harness()
    harness()
    s1, s2 = h1.native.servers
    assert s1.kwargs["bind"] == "[::]:0"
    assert s1.kwargs["store_addr"].startswith("127.0.0.1:")
    assert s1.kwargs["lighthouse_addr"] == "http://fake-lighthouse:1"
    assert s1.kwargs["replica_id"].startswith("rg0:")
    assert s1.kwargs["replica_id"] != s2.kwargs["replica_id"]
    assert h1.pg.timeout == timedelta(seconds=5)
    h1.manager.shutdown()
    assert s1.closed and h1.transport.closed and h1.pg.shut


def test_env_overrides(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHFT_*_SEC and TORCHFT_QUORUM_RETRIES override constructor arguments."""
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "7")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "3.5")
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "9")
    monkeypatch.setenv("TORCHFT_QUORUM_RETRIES", "4")
    h = harness(quorum_retries=1)
    kwargs = h.native.servers[0].kwargs
    assert kwargs["quorum_retries"] == 4
    assert kwargs["connect_timeout"] == timedelta(seconds=9)
    assert h.pg.timeout == timedelta(seconds=7)
    h.manager.start_quorum()
    assert h.manager.should_commit()
    assert h.native.quorum_calls[0]["timeout"] == timedelta(seconds=3.5)


def test_non_zero_rank_reads_published_address(
    harness: Any, store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-zero group rank starts no server and uses rank 0's published address and id."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    h0 = harness(rank=0)
    h1 = harness(rank=1)
    assert len(h0.native.servers) == 1
    assert h1.manager._replica_id == h0.manager._replica_id
    assert h1.manager._client.addr == "http://fake-manager:1"


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"min_replica_size": 0}, ValueError, "min_replica_size"),
        ({"min_replica_size": "2"}, TypeError, "min_replica_size"),
        ({"timeout": timedelta(0)}, ValueError, "timeout"),
        ({"quorum_timeout": 5}, TypeError, "quorum_timeout"),
        ({"connect_timeout": timedelta(seconds=-1)}, ValueError, "connect_timeout"),
        ({"max_retries": -1}, ValueError, "max_retries"),
        ({"quorum_retries": -1}, ValueError, "quorum_retries"),
        ({"rank": 3, "world_size": 2}, ValueError, "rank"),
        ({"world_size": 0}, ValueError, "world_size"),
        ({"port": 70000}, ValueError, "port"),
        ({"world_size_mode": "dynamic"}, TypeError, "world_size_mode"),
        ({"hang_action": "restart"}, ValueError, "hang_action"),
        ({"hang_action": 1}, TypeError, "hang_action"),
        ({"parity_every": -1}, ValueError, "parity_every"),
        ({"parity_every": 2.5}, TypeError, "parity_every"),
        ({"telemetry": "yes"}, TypeError, "telemetry"),
        ({"snapshot_dir": "gs://bucket/snaps"}, ValueError, "is a URL"),
        ({"snapshot_dir": ""}, ValueError, "snapshot_dir"),
        ({"snapshot_dir": "/d", "snapshot_every": 0}, ValueError, "snapshot_every"),
        ({"snapshot_dir": "/d", "snapshot_keep": 0}, ValueError, "snapshot_keep"),
        ({"snapshot_dir": "/d", "snapshot_every": "5"}, TypeError, "snapshot_every"),
    ],
)
def test_bad_arguments(harness: Any, kwargs: dict[str, Any], exc: type, match: str) -> None:
    """Invalid constructor arguments raise at once with a clear message."""
    with pytest.raises(exc, match=match):
        harness(**kwargs)


@pytest.mark.parametrize(
    ("backend", "missing"),
    [
        (object(), "object lacks ManagerServer, ManagerClient, set_log_context"),
        (
            SimpleNamespace(ManagerServer=FakeNative, ManagerClient=FakeNative, set_log_context=1),
            "SimpleNamespace lacks set_log_context",
        ),
    ],
)
def test_native_backend_is_checked_at_construction(
    store: TCPStore, backend: Any, missing: str
) -> None:
    """A native_backend that is no coordination.NativeBackend fails the constructor with a
    TypeError naming what it lacks, not the join on a later call."""
    with pytest.raises(TypeError, match=f"NativeBackend .*; {re.escape(missing)}$"):
        Harness(backend, {})


def test_missing_lighthouse(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No lighthouse address anywhere → ValueError naming TORCHFT_LIGHTHOUSE."""
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        harness()


def test_missing_rank_env(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No rank argument and no RANK env → ValueError."""
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="RANK"):
        harness()


def test_bad_env_override(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-numeric timeout override is rejected clearly."""
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "soon")
    with pytest.raises(ValueError, match="TORCHFT_TIMEOUT_SEC"):
        harness()
    monkeypatch.delenv("TORCHFT_TIMEOUT_SEC")
    monkeypatch.setenv("TORCHFT_TELEMETRY", "perhaps")
    with pytest.raises(ValueError, match="TORCHFT_TELEMETRY"):
        harness()
