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

    def __init__(self, fut: Future[Any], timeout: timedelta | None = None) -> None:
        """Wraps ``fut``.

        Args:
            fut: the future that completes when the operation is done.
            timeout: default deadline of ``wait()`` when it is called without one.
        """
        super().__init__()
        self._fut = fut
        self._timeout = timeout

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
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="torchft_timeouts", daemon=True
                )
                self._thread.start()
            if self._heap[0][1] == handle:
                # Only an earlier deadline needs the thread awake; a later one is found when
                # the current earliest fires. Saves a thread wake-up per collective.
                self._cond.notify()
            return handle

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


def _mirror(
    fut: Future[T],
    timeout: timedelta | float | None,
    on_error: Callable[[Exception], None] | None = None,
    like: object = None,
) -> tuple[Future[T], Callable[[BaseException], bool]]:
    """A future mirroring ``fut`` that can also be failed early (deadline or ``fail``);
    CUDA-aware when ``like`` (the expected result) holds CUDA tensors (see device_future).

    ``on_error`` (if given) sees the error before the returned future completes, so state
    it records is visible to anyone woken by the future.

    Returns:
        ``(out, fail)``: ``fail(err)`` completes ``out`` with ``err`` unless it is already
        complete, and returns whether it did.
    """
    seconds = _to_seconds(timeout)
    out: Future[T] = device_future(like)
    lock = threading.Lock()
    state: dict[str, bool | int | None] = {"done": False, "handle": None}

    def finish(value: T | None, error: BaseException | None) -> bool:
        with lock:
            if state["done"]:
                return False
            state["done"] = True
            handle = state["handle"]
        if handle is not None:
            _TIMER.cancel(handle)
        if error is not None:
            if on_error is not None and isinstance(error, Exception):
                try:
                    on_error(error)
                except Exception:
                    logger.exception("error handler failed")
            # torch types set_exception's argument as the result type, not an exception.
            out.set_exception(error)  # type: ignore[arg-type]
        else:
            out.set_result(value)  # type: ignore[arg-type]
        return True

    def fail(error: BaseException) -> bool:
        return finish(None, error)

    if seconds is not None:
        handle = _TIMER.schedule(
            seconds,
            lambda: finish(None, TimeoutError(f"future did not complete within {seconds}s")),
        )
        with lock:
            state["handle"] = handle

    def on_done(f: Future[T]) -> None:
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - propagated through the future
            # The traceback would only point here, but through its frames it would keep the
            # completing thread's locals (often tensors) alive as long as the error is kept.
            finish(None, e.with_traceback(None))
            return
        finish(value, None)

    fut.add_done_callback(on_done)
    return out, fail


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
    out, _ = _mirror(fut, timeout, like=like)
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
        out, fail = _mirror(fut, timeout, on_error, like)
        key = next(self._ids)
        with self._lock:
            self._fails[key] = fail

        def forget(_: Future[T]) -> None:
            with self._lock:
                self._fails.pop(key, None)

        out.add_done_callback(forget)
        return out

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
