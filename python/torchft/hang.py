"""What a training process does when the lighthouse holds its replica group hung.

The lighthouse holds a group hung when its process (whose manager server heartbeats from its
own thread) lives but its training loop has not reached the manager (a quorum request or a
commit vote) for longer than the hang timeout while a quorum round waited on it; the other
groups then go on without it. Its manager server hears the verdict in its heartbeat replies,
and the :class:`HangWatchdog` of the hosting rank acts on it:

- it logs the verdict and the native side's state (the manager server's view: committed
  step and quorum, how long ago the loop last reached it, ranks waiting in a quorum request
  or the commit vote, the lease, what the lighthouse said), then dumps every thread's Python
  stack to stderr, so the log says where the loop is stuck;
- with the ``exit`` action (the default) it sends the same (verdict, native state, every
  thread's stack, cut to the telemetry error limit) as the rank's last telemetry report, so
  the lighthouse's ``replica_failed`` event and the event log carry it, closes the manager
  server (the lighthouse sees the group gone at once) and ends the process with
  :data:`HUNG_EXIT_CODE`, so its supervisor (torchrun, Kubernetes, Ray, ``torchft.launch``)
  restarts it and the new process heals from a live group;
- with ``keep`` (``TORCHFT_HANG_ACTION=keep``) the process stays: when its loop comes back,
  its step cannot commit (its quorum was replaced) and the group rejoins and heals.

The watchdog polls a flag the native side keeps, so it runs even while the training thread
is blocked in native code that released the GIL (I/O, sleeps, collectives). A loop stuck in
native code that holds the GIL blocks the watchdog too: only the lighthouse's cut (the
others go on) then takes effect.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

__all__ = ["HUNG_EXIT_CODE", "HangWatchdog", "LoopBusy"]

logger = logging.getLogger(__name__)

#: Exit code of a process that ended itself because its replica group was held hung.
HUNG_EXIT_CODE = 76

#: How often the watchdog reads the verdict (seconds).
POLL_S = 0.5


class HangWatchdog:
    """Acts on the lighthouse's hang verdict for this process's replica group.

    Args:
        verdict: returns why the group is held hung, or None (the manager server's
            ``hung``).
        action: ``"exit"`` or ``"keep"`` (see the module docs).
        name: how the log names this group.
        exit: ends the process with a code (tests replace it).
        describe: the native side's state in one line (the manager server's ``describe``).
        last_words: called with the report (verdict, native state, stacks) before an
            ``exit``: the Manager sends it as the rank's last telemetry report and closes
            its manager server.
    """

    def __init__(
        self,
        verdict: Callable[[], str | None],
        action: str,
        name: str,
        exit: Callable[[int], None] = os._exit,
        describe: Callable[[], str] | None = None,
        last_words: Callable[[str], None] | None = None,
    ) -> None:
        if action not in ("exit", "keep"):
            raise ValueError(f"hang action must be 'exit' or 'keep', got {action!r}")
        self._verdict = verdict
        self._action = action
        self._name = name
        self._exit = exit
        self._describe = describe
        self._last_words = last_words
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchft-hang-watchdog", daemon=True)
        self.dumps = 0

    def start(self) -> HangWatchdog:
        """Starts watching (a daemon thread); returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * POLL_S)

    def _run(self) -> None:
        held = False
        while not self._stop.wait(POLL_S):
            try:
                why = self._verdict()
            except Exception:  # noqa: BLE001 - a shut-down server: nothing left to watch
                return
            if why is None:
                if held:
                    logger.warning("%s: the lighthouse no longer holds this group hung", self._name)
                held = False
                continue
            if held:
                continue
            held = True
            self.act(why)

    def act(self, why: str) -> None:
        """Logs the verdict, dumps every thread's stack, then exits or stays per the action."""
        ending = (
            f"ending the process with exit code {HUNG_EXIT_CODE} so its supervisor restarts it"
            if self._action == "exit"
            else "staying alive (TORCHFT_HANG_ACTION=keep): the group heals when its loop is back"
        )
        native = "unknown"
        if self._describe is not None:
            try:
                native = self._describe()
            except Exception as e:  # noqa: BLE001 - the report goes on without it
                native = f"unavailable ({e})"
        logger.error(
            "%s: the lighthouse holds this replica group hung: %s. Native side: %s. Every "
            "thread's stack follows; %s",
            self._name,
            why,
            native,
            ending,
        )
        for h in logging.getLogger().handlers + logger.handlers:
            try:
                h.flush()
            except Exception:  # noqa: BLE001 - a broken handler must not stop the dump
                pass
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self.dumps += 1
        if self._action == "exit":
            if self._last_words is not None:
                try:
                    self._last_words(f"hung: {why}\nnative side: {native}\n{stacks()}")
                except Exception:  # noqa: BLE001 - the exit must happen regardless
                    logger.exception("%s: the hang report was not sent", self._name)
            self._exit(HUNG_EXIT_CODE)


def stacks() -> str:
    """Every thread's Python stack as text, the thread that is neither this one nor a
    torchft helper first (the training loop, usually)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    frames = sorted(
        sys._current_frames().items(),
        key=lambda kv: (kv[0] == me, str(names.get(kv[0], "")).startswith("torchft")),
    )
    out = []
    for ident, frame in frames:
        if ident == me:
            continue
        out.append(f"Thread {names.get(ident, ident)}:\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


class _BusyMarker(Protocol):
    def set_loop_busy(self, busy: bool) -> None: ...


class LoopBusy:
    """Context marking the training loop as inside torchft on the manager server (a quorum,
    its process group, a heal, a vote): however long it takes, the lighthouse does not count
    it as away. A plain class, not a generator: it wraps every step's quorum and vote."""

    __slots__ = ("_server",)

    def __init__(self, server: _BusyMarker) -> None:
        self._server = server

    def __enter__(self) -> None:
        self._server.set_loop_busy(True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.set_loop_busy(False)
