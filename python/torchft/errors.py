"""The errors the Manager records and raises (re-exported by :mod:`torchft.manager`)."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from torch.futures import Future

from torchft import _torchft
from torchft.work import future_timeout

T = TypeVar("T")


class ExceptionWithTraceback(Exception):
    """An error recorded during a step, with the traceback captured where it was reported.

    Errors are reported on background threads and inspected later (at the commit decision),
    so the original stack would otherwise be lost.
    """

    def __init__(self, e: Exception) -> None:
        """Wraps ``e`` and captures the current traceback.

        Args:
            e: the original exception.
        """
        self.original_exception: Exception = e
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        self.stack_trace: str = "".join(tb)
        super().__init__(f"{type(e).__name__}: {e}")

    def __str__(self) -> str:
        return f"{type(self.original_exception).__name__}: {self.original_exception}"


class TornStateError(RuntimeError):
    """A heal that wrote into this group's own tensors failed midway, and no up-to-date
    replica group is left to heal it again: the state is one no step ever had, and only a
    restart of the process (which starts as it did before the heal, or loads a durable
    checkpoint) gets the group going again. Raised by :meth:`Manager.should_commit`; let it
    end the process so its supervisor (torchrun, Kubernetes, Ray) restarts it."""


#: Raised by :meth:`Manager.should_commit` (and the optimizer step) once runtime state parity
#: found this group's committed state different from the others' with no majority to say
#: which is right: training stops; restore a known good state (see :mod:`torchft.parity`).
StateDivergedError = _torchft.StateDivergedError


class HungProcessError(RuntimeError):
    """Why a process the lighthouse held hung ended itself (sent as its last telemetry
    report: the verdict, the manager server's state and every thread's stack)."""


class QuorumTimeoutError(TimeoutError):
    """The quorum request itself hit its deadline (raised to wait_quorum/should_commit)."""


class StepErrors:
    """The error of the current step (the first one reported wins: the step does not
    commit), and the parity verdict that stopped the group for good, if any."""

    def __init__(self, on_first: Callable[[ExceptionWithTraceback], None]) -> None:
        """Args:
        on_first: called with the step's first error (logging), outside the lock."""
        self._on_first = on_first
        self._lock = threading.Lock()
        #: The step's first error.
        self.error: ExceptionWithTraceback | None = None
        #: Set once the parity check stopped this group (raised from should_commit).
        self.diverged: Exception | None = None

    def clear(self) -> None:
        """A new step begins."""
        with self._lock:
            self.error = None

    def report(self, e: Exception) -> None:
        """Records ``e`` (kept with its traceback) unless the step already has an error."""
        wrapped = e if isinstance(e, ExceptionWithTraceback) else ExceptionWithTraceback(e)
        if isinstance(wrapped.original_exception, StateDivergedError):
            # Not a step error: the parity check stopped this group for good.
            self.diverged = wrapped.original_exception
        with self._lock:
            first = self.error is None
            if first:
                self.error = wrapped
        if first:
            self._on_first(wrapped)

    def wrap_future(self, fut: Future[T], default: T, timeout: timedelta | None) -> Future[T]:
        """A future that never fails: errors and timeouts are reported and become
        ``default``."""
        source = future_timeout(fut, timeout, like=default) if timeout is not None else fut

        def settle(f: Future[T]) -> T:
            try:
                value: T = f.value()
            except Exception as e:
                self.report(e)
                return default
            return value

        return source.then(settle)
