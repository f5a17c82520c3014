"""The errors the Manager records and raises (re-exported by :mod:`torchft.manager`)."""

from __future__ import annotations

import traceback

from torchft import _torchft


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
