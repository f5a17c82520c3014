"""Tests of the Work/Future helpers: completed works, future deadlines, error chaining."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.futures import Future

from torchft.work import (
    _TIMER,
    _DummyWork,
    _FutureWork,
    completed_future,
    context_timeout,
    future_on_error,
    future_timeout,
    future_wait,
)


def _complete_later(fut: Future[object], value: object, delay: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fut.set_result(value)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dummy_work_is_complete() -> None:
    """_DummyWork waits instantly and its future holds the result."""
    t = torch.ones(2)
    work = _DummyWork([t])
    assert work.wait() is True
    assert work.wait(timedelta(seconds=1)) is True
    assert work.is_completed() and work.is_success()
    assert work.get_future().done()
    assert work.get_future().value() == [t]


def test_future_work_waits_and_raises() -> None:
    """_FutureWork.wait blocks until the future completes and re-raises its error."""
    fut: Future[object] = Future()
    work = _FutureWork(fut)
    assert not work.is_completed()
    th = _complete_later(fut, 5, 0.05)
    assert work.wait() is True
    th.join()
    assert work.get_future().value() == 5

    bad: Future[object] = Future()
    bad.set_exception(ValueError("failed op"))
    with pytest.raises(ValueError, match="failed op"):
        _FutureWork(bad).wait()


def test_future_work_zero_timeout_means_none() -> None:
    """torch calls wait(timedelta(0)) to mean "no timeout": it must wait, not fail."""
    fut: Future[object] = Future()
    th = _complete_later(fut, 1, 0.1)
    assert _FutureWork(fut).wait(timedelta(0)) is True
    th.join()


def test_future_work_wait_timeout() -> None:
    """wait(timeout) on a never-completing future raises TimeoutError in time."""
    work = _FutureWork(Future(), timeout=timedelta(seconds=0.2))
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        work.wait()
    with pytest.raises(TimeoutError):
        work.wait(timedelta(seconds=0.1))
    assert time.monotonic() - start < 5


def test_future_timeout_passes_value_through() -> None:
    """A future completing before its deadline keeps its value and cancels the timer."""
    fut: Future[object] = Future()
    out = future_timeout(fut, timedelta(seconds=10))
    pending = _TIMER.pending()
    fut.set_result("ok")
    assert out.wait() == "ok"
    assert _TIMER.pending() == pending - 1
    assert future_timeout(completed_future(3), 1.0).wait() == 3


def test_future_timeout_fires() -> None:
    """A future that never completes yields TimeoutError after the deadline, not before."""
    start = time.monotonic()
    out = future_timeout(Future(), timedelta(seconds=0.3))
    with pytest.raises(TimeoutError):
        out.wait()
    elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 5


def test_future_timeout_passes_error_through() -> None:
    """An error of the source future is the timed future's error."""
    fut: Future[object] = Future()
    out = future_timeout(fut, 10)
    fut.set_exception(RuntimeError("source failed"))
    with pytest.raises(RuntimeError, match="source failed"):
        out.wait()


def test_many_deadlines_fire_in_order() -> None:
    """The shared timer serves many deadlines, each at its own time."""
    outs = [future_timeout(Future(), 0.05 * (i + 1)) for i in range(5)]
    fired: list[int] = []
    for i, out in enumerate(outs):
        out.add_done_callback(lambda _f, i=i: fired.append(i))
    for out in outs:
        with pytest.raises(TimeoutError):
            out.wait()
    assert fired == sorted(fired)


def test_future_wait() -> None:
    """future_wait returns the value, raises TimeoutError on expiry, waits forever on None."""
    fut: Future[object] = Future()
    with pytest.raises(TimeoutError):
        future_wait(fut, 0.1)
    th = _complete_later(fut, 7, 0.05)
    assert future_wait(fut, None) == 7
    th.join()
    assert future_wait(fut, timedelta(seconds=1)) == 7


def test_future_on_error_records_instead_of_raising() -> None:
    """Errors go to the handler and the chained future resolves to the default."""
    errors: list[Exception] = []
    bad: Future[int] = Future()
    out = future_on_error(bad, errors.append, default=-1)
    bad.set_exception(RuntimeError("comm failed"))
    assert out.wait() == -1
    assert [str(e) for e in errors] == ["comm failed"]

    good: Future[int] = Future()
    out2 = future_on_error(good, errors.append, default=-1, then=lambda v: v * 2)
    good.set_result(21)
    assert out2.wait() == 42
    assert len(errors) == 1

    # An error raised by ``then`` is recorded too, and a failing handler is contained.
    def fail_then(v: int) -> int:
        raise ValueError("bad transform")

    def bad_handler(e: Exception) -> None:
        raise KeyError("handler broke")

    assert future_on_error(completed_future(1), errors.append, 0, then=fail_then).wait() == 0
    assert isinstance(errors[-1], ValueError)
    assert future_on_error(completed_future(1), bad_handler, 9, then=fail_then).wait() == 9


def test_context_timeout_calls_back_only_when_late() -> None:
    """The callback fires if the block overruns and not if it finishes in time."""
    fired = threading.Event()
    with context_timeout(fired.set, timedelta(seconds=5)):
        pass
    time.sleep(0.05)
    assert not fired.is_set()
    with context_timeout(fired.set, 0.05):
        assert fired.wait(5)


def test_inflight_fail_all_releases_pending_only() -> None:
    """fail_all fails pending tracked futures (after on_error saw the error), leaves
    completed ones alone, and forgets futures once they complete."""
    from torchft.work import _InFlight

    inflight = _InFlight()
    seen: list[Exception] = []
    done_src: Future[object] = Future()
    done = inflight.track(done_src, None, seen.append)
    pending = inflight.track(Future(), timedelta(seconds=60), seen.append)
    done_src.set_result("ok")
    assert len(inflight) == 1
    assert inflight.fail_all(RuntimeError("aborted")) == 1
    with pytest.raises(RuntimeError, match="aborted"):
        pending.wait()
    assert done.wait() == "ok"
    assert [str(e) for e in seen] == ["aborted"]
    assert len(inflight) == 0
    assert inflight.fail_all(RuntimeError("again")) == 0


def test_inflight_timeout_is_a_timeout_error() -> None:
    """A tracked future past its deadline raises the builtin TimeoutError."""
    from torchft.work import _InFlight

    seen: list[Exception] = []
    out = _InFlight().track(Future(), 0.1, seen.append)
    with pytest.raises(TimeoutError):
        out.wait()
    assert isinstance(seen[0], TimeoutError)
