"""The user state a replica group serves to healing peers and writes to snapshots: pieces
registered by key, each a loader and a saver, and the read/write lock that keeps readers (a
peer's heal, a digest, a snapshot copy) off the state while the optimizer changes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from torchft.state_lock import ReadWriteLock

T = TypeVar("T")


class UserState:
    """The registered pieces of user state and their lock (see module doc)."""

    def __init__(self) -> None:
        """An empty registry with an unlocked lock."""
        #: Loaders by key (a received state dict of that piece goes in).
        self.loaders: dict[str, Callable[[Any], None]] = {}
        #: Savers by key (the current state dict of that piece comes out).
        self.savers: dict[str, Callable[[], Any]] = {}
        #: Held for writing while the state changes; readers take it for reading.
        self.lock = ReadWriteLock()
        self._write_locked = False

    def register(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers a piece under a new key.

        Raises:
            ValueError: if ``key`` is already registered.
        """
        if key in self.loaders:
            raise ValueError(f"state dict key {key!r} is already registered")
        self.set(key, load_state_dict, state_dict)

    def set(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers or replaces the piece under ``key``."""
        self.loaders[key] = cast(Callable[[Any], None], load_state_dict)
        self.savers[key] = state_dict

    def current(self) -> dict[str, Any]:
        """Every piece's current state dict, by key."""
        return {key: fn() for key, fn in self.savers.items()}

    def allow_read(self) -> None:
        """Lets readers in again (after the optimizer step)."""
        if self._write_locked:
            self._write_locked = False
            self.lock.release_write()

    def disallow_read(self) -> None:
        """Keeps readers out while the state changes; waits for a read in progress first."""
        if not self._write_locked:
            self.lock.acquire_write()
            self._write_locked = True
