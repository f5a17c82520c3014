"""What a training process does when the lighthouse holds its replica group hung.

The lighthouse holds a group hung when its process (whose manager server heartbeats from its
own thread) lives but its training loop has not reached the manager (a quorum request or a
commit vote) for longer than the hang timeout while a quorum round waited on it; the other
groups then go on without it. Its manager server hears the verdict in its heartbeat replies,
and the :class:`HangWatchdog` of the hosting rank acts on it:

- it logs the verdict and dumps every thread's Python stack to stderr, so the log says
  where the loop is stuck;
- with the ``exit`` action (the default) it then ends the process with
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
from collections.abc import Callable

__all__ = ["HUNG_EXIT_CODE", "HangWatchdog"]

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
    """

    def __init__(
        self,
        verdict: Callable[[], str | None],
        action: str,
        name: str,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        if action not in ("exit", "keep"):
            raise ValueError(f"hang action must be 'exit' or 'keep', got {action!r}")
        self._verdict = verdict
        self._action = action
        self._name = name
        self._exit = exit
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
        logger.error(
            "%s: the lighthouse holds this replica group hung: %s. Every thread's stack "
            "follows; %s",
            self._name,
            why,
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
            self._exit(HUNG_EXIT_CODE)
