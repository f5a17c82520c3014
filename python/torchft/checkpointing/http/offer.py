"""One offered state: what the sender serves to receivers between ``send_checkpoint`` and
``disallow_checkpoint``, over HTTP and over the native data path alike."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torchft.checkpointing import _serialization as ser


class OfferRead:
    """The read guard of one offer, entered by every stream that reads its tensors.

    Holds the state's read lock (when the owner gave one) while the stream runs, and its
    ``__enter__`` says why the state is no longer the one offered: written since the offer
    (the state version moved), or a tensor read straight from memory was moved or resized.
    The streams of one receive each enter separately, so without this a write between two
    of them would hand the receiver ranges of two different states, every CRC correct.
    """

    def __init__(
        self,
        lock: Callable[[], AbstractContextManager[object]] | None,
        version: Callable[[], int] | None,
        enc: ser.Encoded,
        sources: list[tuple[int, int]],
    ) -> None:
        self._lock = lock
        self._version = version
        self._offered = version() if version is not None else None
        self._memory = [
            (t, addr, n) for t, (addr, n) in zip(enc.tensors, sources, strict=True) if addr
        ]

    def changed(self) -> str | None:
        """Why the state differs from the offered one (None: it is the same)."""
        if self._version is not None and self._version() != self._offered:
            return "the state was written since"
        for t, addr, n in self._memory:
            if t.data_ptr() != addr or t.nbytes != n:
                return "a tensor's memory was moved or resized"
        return None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[str | None]:
        with self._lock() if self._lock is not None else contextlib.nullcontext():
            yield self.changed()


@dataclass
class Served:
    """The state currently offered to receivers."""

    step: int
    gen: str
    enc: ser.Encoded
    header_frame: bytes
    # Bound (seconds) on serving one request of this offer, so a stalled receiver cannot
    # hold the state (and its read lock) longer.
    timeout: float
    # Entered by every stream that reads the tensors.
    read: OfferRead
