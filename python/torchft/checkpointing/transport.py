"""The checkpoint transport interface used by the Manager to heal replicas from live peers."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

from torchft.config import timeout_override

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

TIMEOUT_ENV = "TORCHFT_TIMEOUT_SEC"


def _timeout_from_env(timeout: timedelta) -> timedelta:
    """Applies the ``TORCHFT_TIMEOUT_SEC`` override to a constructor timeout.

    Args:
        timeout: the timeout passed by the caller.

    Returns:
        The variable's value when set, else ``timeout``.

    Raises:
        ValueError: naming the variable when it is not a positive number of seconds.
    """
    return timeout_override(timeout)


class CheckpointTransport(Generic[T], ABC):
    """Moves the live state of an up-to-date replica to replicas that must heal.

    The Manager calls :meth:`send_checkpoint` on ranks that serve their state for a step,
    :meth:`recv_checkpoint` on ranks that heal, and :meth:`disallow_checkpoint` once the
    step's state may change again.
    """

    @abstractmethod
    def metadata(self) -> str:
        """Returns the string receivers need to reach this rank (e.g. an HTTP URL).

        Returns:
            Transport specific address; published through the manager server.
        """

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Makes ``state_dict`` available to ``dst_ranks`` as the state of ``step``.

        Args:
            dst_ranks: replica ranks that will receive (push-based transports use them).
            step: the step the state belongs to; receivers asking for another step fail.
            state_dict: the state to send; must not be mutated until
                :meth:`disallow_checkpoint` (or, for blocking transports, until return).
            timeout: bound on the whole operation.
        """

    @property
    def receives_in_place(self) -> bool:
        """True if :meth:`recv_checkpoint` writes into the receiver's existing tensors: a
        receive that fails then leaves them partly overwritten (the Manager must not go on
        with that state)."""
        return False

    @property
    def touched_local_state(self) -> bool:
        """Whether the last :meth:`recv_checkpoint` may have written into the receiver's
        existing tensors. Transports that know a failed receive wrote nothing (it failed
        before any data arrived) say False, and the Manager keeps the state as whole."""
        return self.receives_in_place

    def disallow_checkpoint(self) -> None:
        """Stops serving the current state (it is about to change). Returns promptly."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches the state of ``step`` from the replica at ``src_rank``.

        Args:
            src_rank: replica rank of the source.
            metadata: the source's :meth:`metadata` string.
            step: the step the caller expects; any other step is an error.
            timeout: bound on the whole transfer.

        Returns:
            The received state dict (never partially loaded).

        Raises:
            TimeoutError: the transfer did not complete in time.
            RuntimeError: wrong step, refused request or corrupted data.
        """

    def abort_recv(self) -> None:
        """Makes a :meth:`recv_checkpoint` in progress fail promptly.

        Called from another thread when the source was declared lost: its state will never
        arrive, and the next quorum needs this rank now. A transport without a way to break
        a transfer leaves this as a no-op (the transfer then ends at its timeout).
        """

    def shutdown(self, wait: bool = True) -> None:
        """Releases the transport's resources (servers, threads).

        Args:
            wait: wait for background threads to exit.
        """
