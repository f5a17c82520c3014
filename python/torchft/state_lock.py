"""The lock between the training thread, which writes the state (the optimizer step, a heal
received into the group's own tensors), and the readers that serve or copy it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ReadWriteLock:
    """A writer-preferring read/write lock.

    Checkpoint transports take the read side while serialising the state dict; the optimizer
    step takes the write side so a peer never reads half-updated parameters. Every write
    bumps :meth:`version`, so a transport can tell that the state it offered changed since.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writer_thread: int | None = None
        self._writers_waiting = 0
        self._version = 0

    def acquire_read(self) -> None:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self, timeout: float | None = None) -> bool:
        """Takes the write side (waiting at most ``timeout`` seconds); False if it could not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        self._cond.notify_all()  # readers held back by this waiting writer
                        return False
                    self._cond.wait(remaining)
            finally:
                self._writers_waiting -= 1
            self._writer = True
            self._writer_thread = threading.get_ident()
            self._version += 1
            return True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._writer_thread = None
            self._cond.notify_all()

    def version(self) -> int:
        """Number of writes begun so far."""
        with self._cond:
            return self._version

    def held_by_me(self) -> bool:
        """True when the calling thread holds the write side."""
        with self._cond:
            return self._writer and self._writer_thread == threading.get_ident()

    @contextmanager
    def read(self) -> Iterator[None]:
        """Context manager holding the read side."""
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()
