from datetime import timedelta

# --- manager ---------------------------------------------------------------------------------

class ManagerServer:
    """The manager server of one replica group (hosted by group rank 0).

    Gathers the group's ranks for each quorum round, asks the lighthouse once, answers each
    rank its role; runs the per-step commit vote; heartbeats the lighthouse.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta = ...,
        connect_timeout: timedelta = ...,
        quorum_retries: int = 0,
    ) -> None: ...
    def address(self) -> str:
        """``http://{hostname}:{port}``: what ranks and other groups dial."""
    def shutdown(self) -> None:
        """Stops serving; pending calls end with an error. Safe to call twice."""

class ManagerClient:
    """A client of one manager server (one channel, shared by all calls)."""

    def __init__(self, addr: str, connect_timeout: timedelta = ...) -> None: ...
    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        commit_failures: int = 0,
        init_sync: bool = True,
    ) -> QuorumResult:
        """This rank's part of the next quorum. Raises TimeoutError at the deadline."""
    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """The checkpoint metadata group rank ``rank`` sent with its latest quorum request."""
    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Casts this rank's vote for ``step``; True only if every rank of the group voted True."""
    def kill(self, msg: str, timeout: timedelta = ...) -> None:
        """Ends the process hosting the manager server (logged with ``msg``)."""

class QuorumResult:
    """One rank's role in a quorum (constructible by hand for tests)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str]

    def __init__(
        self,
        quorum_id: int = 0,
        replica_rank: int = 0,
        replica_world_size: int = 1,
        recover_src_manager_address: str = "",
        recover_src_replica_rank: int | None = None,
        recover_dst_replica_ranks: list[int] = ...,
        store_address: str = "",
        max_step: int = 0,
        max_replica_rank: int | None = None,
        max_world_size: int = 0,
        heal: bool = False,
        commit_failures: int = 0,
        replica_ids: list[str] = ...,
    ) -> None: ...
