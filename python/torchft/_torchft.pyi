"""Type stubs for the native module ``torchft._torchft`` (Rust, built by maturin)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

class TorchFTError(RuntimeError):
    """A torchft operation failed (not a timeout, not a bad argument)."""

# --- lighthouse -----------------------------------------------------------------------------

class QuorumMember:
    """One replica group as presented to the lighthouse."""

    def __init__(
        self,
        replica_id: str,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 1,
        shrink_only: bool = False,
        commit_failures: int = 0,
        data: dict[str, Any] | None = None,
    ) -> None: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def store_address(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def shrink_only(self) -> bool: ...
    @property
    def commit_failures(self) -> int: ...
    @property
    def data(self) -> dict[str, Any]:
        """User metadata (JSON round-tripped); ``{}`` when none was given."""
    def __eq__(self, other: object) -> bool: ...

class Quorum:
    """The set of replica groups taking part in a step."""

    def __init__(
        self,
        quorum_id: int,
        participants: list[QuorumMember],
        created: datetime | None = None,
    ) -> None: ...
    @property
    def quorum_id(self) -> int: ...
    @property
    def participants(self) -> list[QuorumMember]:
        """Members sorted by replica_id."""
    @property
    def created(self) -> datetime:
        """When the lighthouse issued the quorum (timezone-aware, UTC)."""

class LighthouseServer:
    """A lighthouse (gRPC + HTTP on one port) running inside this process.

    Raises ValueError for bad arguments (``min_replicas < 1``, negative or zero durations where
    a positive one is needed, an unparsable bind address).
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
    ) -> None: ...
    def address(self) -> str:
        """``http://host:port`` to dial (the host name when bound to a wildcard address)."""
    def shutdown(self) -> None:
        """Stops serving; pending quorum requests fail."""

class LighthouseClient:
    """A client of a lighthouse."""

    def __init__(self, addr: str, connect_timeout: timedelta) -> None: ...
    def quorum(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str | None = None,
        store_address: str | None = None,
        step: int | None = None,
        world_size: int | None = None,
        shrink_only: bool | None = None,
        data: dict[str, Any] | None = None,
    ) -> Quorum:
        """Joins the current round and waits for a quorum containing ``replica_id``.

        Raises TimeoutError when ``timeout`` passes first, ValueError for bad arguments.
        """
    def heartbeat(self, replica_id: str, timeout: timedelta = ...) -> None:
        """Tells the lighthouse ``replica_id`` is alive (default timeout: 5 seconds)."""

def lighthouse_main() -> None:
    """Entry point of the ``torchft_lighthouse`` console script (parses ``sys.argv``)."""
