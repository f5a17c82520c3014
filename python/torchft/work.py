"""Work and Future helpers shared by the process groups, the Manager and DDP.

torch's collectives hand back a ``Work`` whose ``get_future()`` is a
``torch.futures.Future``. Fault tolerance needs a few extra shapes of that contract:

* a Work that is already complete (used when a collective is skipped after an error,
  or when a fake process group answers instantly),
* a Work that simply wraps a Future produced elsewhere (child processes, managers),
* deadlines on Futures, so that no caller ever blocks past its configured timeout,
* callbacks that record errors instead of raising them into the training loop.

Timers for all deadlines are served by one lazily started daemon thread (see
``_TimerThread``) instead of one thread per Future: allreduces are issued per gradient
bucket, so a per-call thread would be far too expensive.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.futures import Future

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S")

__all__ = [
    "_DummyWork",
    "_FutureWork",
    "context_timeout",
    "future_on_error",
    "future_timeout",
    "future_wait",
    "completed_future",
]


def completed_future(value: T) -> Future[T]:
    """Returns a torch Future that already holds ``value``.

    Args:
        value: the result the future resolves to.

    Returns:
        A completed ``torch.futures.Future``.
    """
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def device_future(like: object = None) -> Future[Any]:
    """A new future for a result shaped like ``like``: CUDA-aware on the devices of its CUDA
    tensors, if any.

    A future mirroring a collective's future must be: completed from the collective's
    callback (whose current streams wait for the collective's kernels), it records events on
    those streams, and whoever waits on it or chains a callback to it waits for them. A plain
    future would hand the tensors on while the backend's copies into them may still run
    (Gloo copies a CUDA result back on a stream of its own), and work queued on the tensors
    next, such as averaging the gradients, would race that copy.
    """
    if type(like) is list and len(like) == 1 and type(like[0]) is torch.Tensor:
        # A collective's usual result: one tensor (the common case, kept cheap).
        only = like[0]
        return Future(devices=[only.device]) if only.is_cuda else Future()
    devices = sorted({t.device for t in _tensors_of(like) if t.device.type == "cuda"}, key=str)
    if devices:
        return Future(devices=list(devices))
    return Future()


def _work_timeout(timeout: timedelta | None) -> timedelta | None:
    """torch passes a zero timeout to ``Work.wait`` to mean "no timeout"."""
    if timeout is None or timeout.total_seconds() <= 0:
        return None
    return timeout


def _to_seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


class _DummyWork(dist.Work):
    """A Work that is complete from the start and whose future holds ``result``.

    Returned for collectives that are skipped (after an error was recorded, or by fake
    process groups), so callers can treat every collective uniformly.
    """

    def __init__(self, result: object) -> None:
        """Creates the completed work.

        Args:
            result: the value ``get_future()`` resolves to (usually the input tensors).
        """
        super().__init__()
        self._result = result
        self._future: Future[object] = completed_future(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Returns True at once: the work is already complete."""
        return True

    def is_completed(self) -> bool:
        """Always True."""
        return True

    def is_success(self) -> bool:
        """Always True."""
        return True

    def get_future(self) -> Future[object]:
        """Returns the completed future holding the result."""
        return self._future


class _FutureWork(dist.Work):
    """A Work backed by a torch Future produced elsewhere.

    ``wait()`` waits for the future (honouring an optional timeout) and re-raises its
    error, exactly like a native Work would.
    """

    def __init__(
        self, fut: Future[Any], timeout: timedelta | None = None, mirror: _Mirror | None = None
    ) -> None:
        """Wraps ``fut``.

        Args:
            fut: the future that completes when the operation is done.
            timeout: default deadline of ``wait()`` when it is called without one.
            mirror: the mirror ``fut`` is the output of, when it is one (see ``_fuse``).
        """
        super().__init__()
        self._fut = fut
        self._timeout = timeout
        self._mirror = mirror

    def _fuse(self, adapt: Adapt) -> tuple[Future[Any], Future[Any]] | None:
        """For the one owner of a fresh work: has ``adapt`` shape what the work's future
        completes with, inside the completion callback the future already has, instead of a
        ``then`` of its own (one GIL hand-off less on the backend's thread per collective).

        Returns:
            ``(future, source)``: the work's future, now completing with what ``adapt``
            returns, and the backend's own future (done once the backend finished, before
            any callback ran); None when the work cannot fuse (no mirror, or complete
            already): chain a ``then`` instead.
        """
        m = self._mirror
        if m is None or not m.attach(adapt):
            return None
        return self._fut, m.source

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Blocks until the future completes.

        Args:
            timeout: deadline; defaults to the one given at construction (None: forever).

        Returns:
            True once the operation completed successfully.

        Raises:
            TimeoutError: the deadline passed first.
            Exception: the error the future completed with.
        """
        timeout = _work_timeout(timeout)
        future_wait(self._fut, timeout if timeout is not None else self._timeout)
        return True

    def is_completed(self) -> bool:
        """Whether the underlying future is done (successfully or not)."""
        return self._fut.done()

    def get_future(self) -> Future[Any]:
        """Returns the wrapped future."""
        return self._fut


class _TimerThread:
    """One daemon thread firing callbacks at deadlines (a heap ordered by due time).

    The heap holds only (due, handle); callbacks live in a dict that ``cancel`` empties, so a
    cancelled deadline does not keep its future (and the tensors it holds) alive.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, delay: float, callback: Callable[[], object]) -> int:
        """Runs ``callback`` after ``delay`` seconds unless cancelled; returns a handle."""
        with self._cond:
            handle = next(self._ids)
            heapq.heappush(self._heap, (time.monotonic() + delay, handle))
            self._callbacks[handle] = callback
            if len(self._heap) > 1024 and len(self._heap) > 4 * len(self._callbacks):
                # Drop cancelled entries so a long run of short ops does not grow the heap.
                self._heap = [e for e in self._heap if e[1] in self._callbacks]
                heapq.heapify(self._heap)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="torchft_timeouts", daemon=True
                )
                self._thread.start()
            if self._heap[0][1] == handle:
                # Only an earlier deadline needs the thread awake; a later one is found when
                # the current earliest fires. Saves a thread wake-up per collective.
                self._cond.notify()
            return handle

    def _forget_thread(self) -> None:
        """After a fork: the thread is gone (the lock is made anew, its holder is too)."""
        self._cond = threading.Condition()
        self._thread = None

    def cancel(self, handle: int) -> None:
        """Prevents a scheduled callback from firing (no-op if it already fired)."""
        with self._cond:
            self._callbacks.pop(handle, None)

    def pending(self) -> int:
        """Number of deadlines still armed (for tests)."""
        with self._cond:
            return len(self._callbacks)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                due, handle = self._heap[0]
                now = time.monotonic()
                if due > now and handle in self._callbacks:
                    self._cond.wait(due - now)
                    continue
                heapq.heappop(self._heap)
                callback = self._callbacks.pop(handle, None)
            if callback is None:
                continue
            try:
                callback()
            except Exception:
                logger.exception("timeout callback failed")


_TIMER = _TimerThread()
# A forked child has none of its parent's threads: its first deadline starts its own.
os.register_at_fork(after_in_child=_TIMER._forget_thread)


#: What :meth:`_FutureWork._fuse` attaches: it sees the operation's value or error (after
#: ``on_error``) and returns the value and error the work's future completes with.
Adapt = Callable[[Any, "BaseException | None"], "tuple[Any, BaseException | None]"]


class _Mirror:
    """A future (``out``) mirroring a source future that can also be failed early (deadline
    or ``fail``); CUDA-aware when ``like`` (the expected result) holds CUDA tensors (see
    device_future).

    Everything that happens at completion runs in the one callback on the source future:
    cancelling the deadline, ``on_error``, ``on_finish``, an adapter the work's owner
    attached (see :meth:`_FutureWork._fuse`), then completing ``out``. Each further callback
    chained on the way would take the GIL again on the backend's thread, and on a loaded
    machine every such hand-off costs a thread wake-up on the step's critical path.
    """

    __slots__ = ("out", "source", "_lock", "_done", "_handle", "_adapt", "_on_error", "_on_finish")

    def __init__(
        self,
        fut: Future[Any],
        timeout: timedelta | float | None,
        on_error: Callable[[Exception], None] | None = None,
        like: object = None,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        seconds = _to_seconds(timeout)
        self.source = fut
        self.out: Future[Any] = device_future(like)
        self._lock = threading.Lock()
        self._done = False
        self._handle: int | None = None
        self._adapt: Adapt | None = None
        self._on_error = on_error
        self._on_finish = on_finish
        if seconds is not None:
            handle = _TIMER.schedule(seconds, lambda: self.finish(None, _timed_out(seconds)))
            with self._lock:
                self._handle = handle
        fut.add_done_callback(self._on_done)

    def attach(self, adapt: Adapt) -> bool:
        """Has ``adapt`` shape the completion; False when it came too late (completed)."""
        with self._lock:
            if self._done or self._adapt is not None:
                return False
            self._adapt = adapt
            return True

    @property
    def finished(self) -> bool:
        """Whether the completion has begun (``out`` is complete or about to be)."""
        return self._done

    def fail(self, error: BaseException) -> bool:
        """Completes ``out`` with ``error`` unless it is complete; whether it did.

        A source that has completed while its callback still waits (for the GIL, say) is
        not failed: its outcome is there, and it is what ``out`` completes with. An abort
        or a deadline then does not undo an operation that had finished.
        """
        if self.source.done():
            try:
                # wait(), not value(): a CUDA result is ordered after its kernels on the
                # current streams, as the completion callback would have it.
                value = self.source.wait()
            except Exception as e:  # noqa: BLE001 - delivered through the future
                return self.finish(None, e.with_traceback(None))
            return self.finish(value, None)
        return self.finish(None, error)

    def finish(self, value: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            handle = self._handle
            adapt = self._adapt
        if handle is not None:
            _TIMER.cancel(handle)
        if self._on_finish is not None:
            try:
                self._on_finish()
            except Exception:
                logger.exception("completion hook failed")
        if error is not None and self._on_error is not None and isinstance(error, Exception):
            try:
                self._on_error(error)
            except Exception:
                logger.exception("error handler failed")
        if adapt is not None:
            try:
                value, error = adapt(value, error)
            except Exception as e:  # noqa: BLE001 - delivered through the future
                value, error = None, e
        if error is not None:
            self.out.set_exception(error)
        else:
            self.out.set_result(value)
        return True

    def _on_done(self, f: Future[Any]) -> None:
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - propagated through the future
            # The traceback would only point here, but through its frames it would keep the
            # completing thread's locals (often tensors) alive as long as the error is kept.
            self.finish(None, e.with_traceback(None))
            return
        self.finish(value, None)


def _timed_out(seconds: float) -> TimeoutError:
    return TimeoutError(f"future did not complete within {seconds}s")


def future_timeout(fut: Future[T], timeout: timedelta | float, like: object = None) -> Future[T]:
    """Returns a future that mirrors ``fut`` but fails with TimeoutError after ``timeout``.

    ``fut`` itself is not cancelled (torch futures cannot be); the returned future just
    stops waiting for it so the caller never blocks past the deadline.

    Args:
        fut: the future to watch.
        timeout: the deadline (timedelta or seconds).
        like: the expected result (its CUDA tensors make the mirror CUDA-aware).

    Returns:
        A new future with ``fut``'s value, or a TimeoutError.
    """
    if fut.done():
        return fut
    out: Future[T] = _Mirror(fut, timeout, like=like).out
    return out


class _InFlight:
    """Tracks the futures of in-flight operations so that ``abort`` can fail them all.

    Aborting a quorum must release every caller blocked on its collectives at once,
    instead of leaving them to their timeouts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fails: dict[int, Callable[[BaseException], bool]] = {}
        self._ids = itertools.count()

    def track(
        self,
        fut: Future[T],
        timeout: timedelta | float | None,
        on_error: Callable[[Exception], None] | None = None,
        like: object = None,
    ) -> Future[T]:
        """Returns a mirror of ``fut`` bounded by ``timeout`` and failed by ``fail_all``.

        Args:
            fut: the operation's future.
            timeout: its deadline (None: none besides ``fail_all``).
            on_error: called with the error (operation failure, timeout or abort) before
                the returned future completes.
            like: the expected result (its CUDA tensors make the mirror CUDA-aware).

        Returns:
            The future callers should wait on.
        """
        return self.mirror(fut, timeout, on_error, like).out

    def mirror(
        self,
        fut: Future[T],
        timeout: timedelta | float | None,
        on_error: Callable[[Exception], None] | None = None,
        like: object = None,
    ) -> _Mirror:
        """As :meth:`track`, returning the mirror itself (its ``out`` is the future); the
        tracking ends inside the mirror's one completion callback."""
        key = next(self._ids)

        def forget() -> None:
            with self._lock:
                self._fails.pop(key, None)

        m = _Mirror(fut, timeout, on_error, like, on_finish=forget)
        with self._lock:
            # A source already complete finished the mirror inline (its ``forget`` found
            # nothing); one finishing now runs ``forget`` after this lock is released.
            if not m.finished:
                self._fails[key] = m.fail
        return m

    def work(
        self,
        fut: Future[Any],
        timeout: timedelta | float | None,
        on_error: Callable[[Exception], None] | None = None,
        like: object = None,
    ) -> _FutureWork:
        """A work on a tracked mirror of ``fut`` (see :meth:`mirror`) whose owner may fuse
        its completion (:meth:`_FutureWork._fuse`); the mirror carries the deadline."""
        m = self.mirror(fut, timeout, on_error, like)
        return _FutureWork(m.out, mirror=m)

    def fail_all(self, error: BaseException) -> int:
        """Fails every tracked future that is still pending; returns how many."""
        with self._lock:
            fails = list(self._fails.values())
            self._fails.clear()
        return sum(1 for fail in fails if fail(error))

    def __len__(self) -> int:
        with self._lock:
            return len(self._fails)


def future_wait(fut: Future[T], timeout: timedelta | float | None) -> T:
    """Waits for ``fut`` at most ``timeout`` and returns its value.

    Args:
        fut: the future to wait for.
        timeout: the deadline (timedelta or seconds); None waits forever.

    Returns:
        The future's value.

    Raises:
        TimeoutError: the deadline passed first.
        Exception: the error the future completed with.
    """
    seconds = _to_seconds(timeout)
    if seconds is None or fut.done():
        return fut.wait()
    event = threading.Event()
    fut.add_done_callback(lambda _: event.set())
    if not event.wait(seconds):
        raise TimeoutError(f"future did not complete within {seconds}s")
    return fut.wait()


def future_on_error(
    fut: Future[T],
    on_error: Callable[[Exception], None],
    default: S,
    then: Callable[[T], S] | None = None,
) -> Future[S]:
    """Chains a callback that records errors instead of propagating them.

    Args:
        fut: the source future.
        on_error: called with the exception if ``fut`` (or ``then``) fails.
        default: the value the returned future takes on error.
        then: optional transformation of the successful value.

    Returns:
        A future that always succeeds: ``then(value)`` (or ``value``), or ``default``.
    """

    def callback(f: Future[T]) -> S:
        try:
            value = f.value()
            return then(value) if then is not None else value  # type: ignore[return-value]
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            try:
                on_error(e)
            except Exception:
                logger.exception("error handler failed")
            return default

    return fut.then(callback)


@contextmanager
def context_timeout(callback: Callable[[], None], timeout: timedelta | float) -> Generator[None]:
    """Calls ``callback`` (e.g. an abort) if the enclosed block runs longer than ``timeout``.

    Args:
        callback: what to do when the deadline passes while still inside the block.
        timeout: the deadline (timedelta or seconds).
    """
    seconds = _to_seconds(timeout)
    handle = _TIMER.schedule(seconds if seconds is not None else 0.0, callback)
    try:
        yield
    finally:
        _TIMER.cancel(handle)


def _tensors_of(value: object) -> list[torch.Tensor]:
    """Flattens the tensors contained in a (nested) list or tuple."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[torch.Tensor] = []
        for v in value:
            out.extend(_tensors_of(v))
        return out
    return []
