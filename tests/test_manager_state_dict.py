"""Manager state dict with fakes: the read lock around optimizer steps, the counters'
round trip and the legacy state dict functions."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _manager_kit import (  # noqa: F401 - fixtures, found by pytest by name
    harness_fixture,
    master_store_fixture,
    native_fixture,
    store_fixture,
)


def test_disallow_state_dict_read_excludes_readers(harness: Any) -> None:
    """While reads are disallowed a transport's read lock blocks until allowed again."""
    m = harness().manager
    m.disallow_state_dict_read()
    m.disallow_state_dict_read()  # idempotent
    got = threading.Event()

    def reader() -> None:
        with m._user.lock.read():
            got.set()

    t = threading.Thread(target=reader)
    t.start()
    assert not got.wait(0.2)
    m.allow_state_dict_read()
    assert got.wait(2)
    t.join()
    m.allow_state_dict_read()  # idempotent


def test_state_dict_roundtrip(harness: Any) -> None:
    """state_dict/load_state_dict round-trip the manager counters."""
    m = harness().manager
    m.load_state_dict({"step": 12, "batches_committed": 30})
    assert m.state_dict() == {"step": 12, "batches_committed": 30}
    assert m.current_step() == 12


def test_set_state_dict_fns_replaces_default(harness: Any) -> None:
    """set_state_dict_fns (deprecated, and says so) replaces the legacy default key's
    functions."""
    m = harness().manager
    with pytest.warns(DeprecationWarning, match="register_state_dict_fn"):
        m.set_state_dict_fns(lambda sd: None, lambda: {"x": 1})
    assert m._manager_state_dict()["user"] == {"default": {"x": 1}}
