"""Watching for lost replica groups: the lighthouse tells the members of a quorum when one
of them dies or goes silent, through the group's manager server; each rank long-polls it on
a daemon thread and hands every loss to the Manager, which aborts that quorum's collectives
(see docs/process_groups.md and the Manager's failure detection)."""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchft.coordination import NativeManagerClient

logger: logging.Logger = logging.getLogger(__name__)


class LostWatcher:
    """A daemon thread long-polling the group's manager server for lost replica groups.

    Every live watcher is stopped and joined at interpreter exit (before daemon threads are
    torn down), so a poll in flight in native code never meets interpreter finalization.
    """

    POLL = timedelta(milliseconds=500)
    _live: set[LostWatcher] = set()
    _live_lock = threading.Lock()

    def __init__(self, client: NativeManagerClient, on_lost: Callable[[str, int], None]) -> None:
        """Starts watching.

        Args:
            client: the rank's manager client (``_watch_events`` releases the GIL).
            on_lost: called with ``(replica_id, quorum_id)`` for every lost-member event.
        """
        self._client = client
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchft_watch", daemon=True)
        with LostWatcher._live_lock:
            LostWatcher._live.add(self)
        self._thread.start()

    def _run(self) -> None:
        after = 0
        try:
            while not self._stop.is_set():
                try:
                    after, events = self._client._watch_events(after, self.POLL)
                except Exception as e:
                    # The group's manager server is unreachable (e.g. shutting down): retry.
                    logger.debug("watching for lost replica groups failed: %s", e)
                    self._stop.wait(self.POLL.total_seconds())
                    continue
                for replica_id, quorum_id in events:
                    if self._stop.is_set():
                        break
                    try:
                        self._on_lost(replica_id, quorum_id)
                    except Exception:
                        logger.exception("handling the loss of %s failed", replica_id)
        finally:
            with LostWatcher._live_lock:
                LostWatcher._live.discard(self)

    def stop(self, wait: float = 0.0) -> None:
        """Stops watching.

        Args:
            wait: seconds to wait for the thread to end (0: do not wait).
        """
        self._stop.set()
        if wait > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait)

    @staticmethod
    def stop_all() -> None:
        """Stops and joins every live watcher (registered with ``atexit``)."""
        with LostWatcher._live_lock:
            live = list(LostWatcher._live)
        for w in live:
            w.stop()
        for w in live:
            w.stop(wait=2 * w.POLL.total_seconds() + 1.0)


atexit.register(LostWatcher.stop_all)
