"""Manager quorum failures and deadlines with fakes: quorum timeouts and errors, wrap_future
deadlines, and the async quorum overlapping the caller."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from _manager_kit import (  # noqa: F401 - fixtures, found by pytest by name
    harness_fixture,
    master_store_fixture,
    native_fixture,
    store_fixture,
)
from torch.futures import Future


def test_quorum_timeout_surfaces_as_timeout_error(harness: Any) -> None:
    """A quorum TimeoutError reaches wait_quorum/should_commit; allreduce swallows it."""
    h = harness()
    h.native.quorums = [TimeoutError("quorum deadline exceeded")]
    m = h.manager
    m.start_quorum()
    with pytest.raises(TimeoutError):
        m.wait_quorum()
    t = torch.ones(2)
    assert m.allreduce(t).get_future().wait() is t
    with pytest.raises(TimeoutError):
        m.should_commit()
    assert m.current_step() == 0
    # a later step works again
    m.start_quorum()
    assert m.should_commit()


def test_quorum_timeout_sync_mode(harness: Any) -> None:
    """Sync mode: the quorum timeout is raised by start_quorum (as upstream's) and again by
    should_commit; the step does not commit and the next one works."""
    h = harness(use_async_quorum=False)
    h.native.quorums = [TimeoutError("deadline")]
    m = h.manager
    with pytest.raises(TimeoutError, match="deadline"):
        m.start_quorum()
    with pytest.raises(TimeoutError, match="deadline"):
        m.should_commit()
    assert m.current_step() == 0
    m.start_quorum()
    assert m.should_commit()
    assert m.current_step() == 1


def test_quorum_other_error_is_recorded(harness: Any) -> None:
    """A non-timeout quorum failure is recorded and the step votes no."""
    h = harness()
    h.native.quorums = [RuntimeError("lighthouse unreachable")]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert "lighthouse unreachable" in str(m.errored())
    assert not m.should_commit()


def test_wrap_future_timeout_returns_default(harness: Any) -> None:
    """wrap_future resolves to the default and records a TimeoutError on expiry (its own
    timeout, not the manager's, which is far longer here)."""
    m = harness(timeout=timedelta(seconds=120)).manager
    m.start_quorum()
    never: Future[int] = Future()
    start = time.monotonic()
    out = m.wrap_future(never, 42, timeout=timedelta(milliseconds=200))
    assert out.wait() == 42
    assert time.monotonic() - start < 60
    err = m.errored()
    assert err is not None and isinstance(err.original_exception, TimeoutError)


def test_wrap_future_passes_value_and_errors(harness: Any) -> None:
    """wrap_future passes a value through and turns an error into the default."""
    m = harness().manager
    m.start_quorum()
    ok: Future[int] = Future()
    out = m.wrap_future(ok, -1)
    ok.set_result(5)
    assert out.wait() == 5
    assert m.errored() is None
    bad: Future[int] = Future()
    out2 = m.wrap_future(bad, -1)
    bad.set_exception(ValueError("boom"))
    assert out2.wait() == -1
    assert "boom" in str(m.errored())


def test_async_quorum_overlaps_caller(harness: Any) -> None:
    """start_quorum returns before a slow quorum finishes (async mode)."""
    h = harness()
    h.native.quorum_delay = 0.5
    m = h.manager
    start = time.monotonic()
    m.start_quorum()
    assert time.monotonic() - start < 0.4
    assert m.should_commit()
