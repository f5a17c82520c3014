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


def test_mirror_of_a_complete_source_is_not_tracked() -> None:
    """A source already complete finishes its mirror at once; nothing is left to abort."""
    from torchft.work import _InFlight

    inflight = _InFlight()
    m = inflight.mirror(completed_future("ok"), timedelta(seconds=60))
    assert m.out.wait() == "ok"
    assert len(inflight) == 0
    assert inflight.fail_all(RuntimeError("aborted")) == 0


def test_abort_of_a_finished_source_keeps_its_value() -> None:
    """An abort (fail_all) that comes after the source completed, while its completion
    callback still waits, completes the mirror with the source's value, not the abort's
    error: the operation had finished."""
    from torchft.work import _InFlight

    src: Future[object] = Future()
    gate = threading.Event()
    src.add_done_callback(lambda _: gate.wait(10))  # runs before the mirror's callback
    inflight = _InFlight()
    seen: list[Exception] = []
    m = inflight.mirror(src, timedelta(seconds=60), seen.append)
    setter = threading.Thread(target=src.set_result, args=("value",), daemon=True)
    setter.start()
    deadline = time.monotonic() + 10
    while not src.done():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not m.out.done()
    assert inflight.fail_all(RuntimeError("aborted")) == 1
    assert m.out.wait() == "value"
    assert seen == []
    gate.set()
    setter.join(10)
    assert len(inflight) == 0


def test_abort_of_a_failed_source_keeps_its_error() -> None:
    """Likewise a source that failed before the abort completes the mirror with its own
    error (which on_error sees), not the abort's."""
    from torchft.work import _InFlight

    src: Future[object] = Future()
    gate = threading.Event()
    src.add_done_callback(lambda _: gate.wait(10))
    inflight = _InFlight()
    seen: list[Exception] = []
    m = inflight.mirror(src, None, seen.append)
    setter = threading.Thread(
        target=src.set_exception, args=(RuntimeError("peer reset"),), daemon=True
    )
    setter.start()
    deadline = time.monotonic() + 10
    while not src.done():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert inflight.fail_all(RuntimeError("aborted")) == 1
    with pytest.raises(RuntimeError, match="peer reset"):
        m.out.wait()
    assert [str(e) for e in seen] == ["peer reset"]
    gate.set()
    setter.join(10)


def test_fused_work_completes_with_what_the_adapter_returns() -> None:
    """_fuse has the work's own future complete with the adapter's value (after on_error
    saw an error) and hands back the backend's future; too late, it declines."""
    from torchft.work import _InFlight

    inflight = _InFlight()
    seen: list[Exception] = []

    def adapt(value: object, error: BaseException | None) -> tuple[object, None]:
        if error is not None:
            return f"swallowed {error}", None
        assert isinstance(value, int)
        return value * 2, None

    src: Future[object] = Future()
    m = inflight.mirror(src, timedelta(seconds=60), seen.append)
    work = _FutureWork(m.out, mirror=m)
    fused = work._fuse(adapt)
    assert fused is not None
    fut, source = fused
    assert source is src and fut is work.get_future()
    assert work._fuse(adapt) is None  # one adapter only
    src.set_result(21)
    assert fut.wait() == 42
    assert work.wait() is True

    failing: Future[object] = Future()
    m = inflight.mirror(failing, None, seen.append)
    fused = _FutureWork(m.out, mirror=m)._fuse(adapt)
    assert fused is not None
    failing.set_exception(RuntimeError("boom"))
    assert fused[0].wait() == "swallowed boom"
    assert [str(e) for e in seen] == ["boom"]

    late: Future[object] = Future()
    m = inflight.mirror(late, None)
    late.set_result(1)
    assert _FutureWork(m.out, mirror=m)._fuse(adapt) is None
    assert _FutureWork(completed_future(1))._fuse(adapt) is None  # no mirror
    assert len(inflight) == 0


def test_fused_adapter_that_raises_fails_the_future() -> None:
    """An adapter's own error becomes the future's error rather than being lost on the
    backend's thread."""
    from torchft.work import _InFlight

    def adapt(value: object, error: BaseException | None) -> tuple[object, None]:
        raise ValueError("bad result")

    src: Future[object] = Future()
    m = _InFlight().mirror(src, None)
    fused = _FutureWork(m.out, mirror=m)._fuse(adapt)
    assert fused is not None
    src.set_result(1)
    with pytest.raises(ValueError, match="bad result"):
        fused[0].wait()
