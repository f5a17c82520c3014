"""Joining a replica group: the group's store, its manager server (started by group rank 0),
this rank's client of that server, the services that watch the group (telemetry, lost
members, durable snapshots, the hang verdict) and the group's commit vote.

Group rank 0 publishes the manager server address in the replica group's store under
``torchft/manager/{replica_id}/{restart}/addr`` (``replica_id`` is the Manager's argument, so
several replica groups may share one store if they use distinct replica ids; ``restart`` is
torchrun's ``TORCHELASTIC_RESTART_COUNT``, 0 without it). A worker restarted inside torchrun's
agent meets the store its predecessor wrote to: the restart count in the key keeps a non-zero
rank from reading the dead incarnation's address before rank 0 publishes the new one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from torch._C._distributed_c10d import TCPStore

from torchft.errors import HungProcessError
from torchft.group_snapshots import GroupSnapshots, parity_confirmation
from torchft.hang import HangWatchdog
from torchft.loss_watch import LostWatcher
from torchft.telemetry import RankTelemetry

if TYPE_CHECKING:
    from torchft.config import ManagerConfig
    from torchft.coordination import NativeBackend, NativeManagerClient, NativeManagerServer
    from torchft.parity import StateParity


@dataclass
class GroupConnection:
    """What a rank holds of its replica group once joined."""

    #: The replica group's store.
    store: TCPStore
    #: The group's manager server, on group rank 0 only.
    server: NativeManagerServer | None
    #: This rank's client of the manager server.
    client: NativeManagerClient
    #: The group's incarnation: ``{replica_id}:{uuid}`` (a fresh uuid per start).
    replica_id: str
    #: The manager server's address.
    address: str


def join_group(cfg: ManagerConfig, native: NativeBackend) -> GroupConnection:
    """Connects to the store, starts the manager server on group rank 0 and connects a client.

    Nothing is left running when it raises.
    """
    base_id = cfg.replica_id if cfg.replica_id is not None else ""
    # torchrun restarts dead workers inside its agent, whose store keeps what the dead
    # incarnation wrote: the key names the restart, so no rank reads a dead address.
    key = f"torchft/manager/{base_id}/{cfg.restart_count}/addr"
    store = TCPStore(
        host_name=cfg.store_addr,
        port=cfg.store_port,
        is_master=False,
        wait_for_workers=False,
        timeout=cfg.connect_timeout,
    )
    server: NativeManagerServer | None = None
    try:
        if cfg.rank == 0:
            full_id = f"{base_id}:{uuid.uuid4()}" if base_id else str(uuid.uuid4())
            server = native.ManagerServer(
                replica_id=full_id,
                lighthouse_addr=cfg.lighthouse_addr,
                hostname=cfg.hostname,
                bind=f"[::]:{cfg.port}",
                store_addr=f"{cfg.store_addr}:{cfg.store_port}",
                world_size=cfg.world_size,
                heartbeat_interval=cfg.heartbeat_interval,
                connect_timeout=cfg.connect_timeout,
                quorum_retries=cfg.quorum_retries,
                topology_file=cfg.topology_file,
                topology_group=cfg.replica_group_index,
                job=cfg.job,
                sparse_quorum=cfg.sparse_quorum,
            )
            store.set(key, json.dumps({"address": server.address(), "replica_id": full_id}))
        info = json.loads(store.get(key).decode())
        replica_id: str = info["replica_id"]
        native.set_log_context(replica_id, cfg.rank)
        address: str = info["address"]
        client = native.ManagerClient(address, connect_timeout=cfg.connect_timeout)
    except BaseException:
        if server is not None:
            server.shutdown()
        raise
    return GroupConnection(store, server, client, replica_id, address)


@dataclass
class GroupServices:
    """The services that watch a joined group from this rank."""

    #: Per-step timings and health, to the lighthouse (fail-open).
    telemetry: RankTelemetry
    #: Hands every lost member of a quorum to the Manager.
    watcher: LostWatcher
    #: Durable snapshots, when a directory is configured.
    snapshots: GroupSnapshots | None
    #: Acts on the lighthouse's hang verdict (on the rank hosting the manager server).
    hang_watchdog: HangWatchdog | None


def start_services(
    cfg: ManagerConfig,
    conn: GroupConnection,
    on_lost: Callable[[str, int], None],
    step: Callable[[], int],
    log_info: Callable[..., None],
    parity: StateParity | None = None,
) -> GroupServices:
    """Starts the services of a joined group; nothing is left running when it raises.

    Args:
        cfg: the Manager's settings.
        conn: the joined group.
        on_lost: called with ``(replica_id, quorum_id)`` for every lost member.
        step: the current step.
        log_info: the Manager's prefixed info logger (snapshot progress).
        parity: the ranks' state digests (runtime state parity): while on, every snapshot
            step is digested too, and group rank 0 makes a snapshot complete only once the
            parity check confirmed its state.
    """
    name = cfg.replica_id or conn.replica_id
    telemetry = RankTelemetry(
        conn.client,
        replica_id=name,
        incarnation=conn.replica_id,
        group_rank=cfg.rank,
        group_world_size=cfg.world_size,
        hostname=cfg.hostname,
        enabled=cfg.telemetry,
    )
    watcher = LostWatcher(conn.client, on_lost)
    try:
        snapshots = None
        if cfg.snapshot_dir is not None:
            confirm = None
            if conn.server is not None:
                on = parity
                confirm = parity_confirmation(
                    conn.server.parity_verdicts, lambda: on is not None and on.every > 0
                )
            snapshots = GroupSnapshots(
                cfg, name, conn.replica_id, conn.store, telemetry, log_info, confirm
            )
            if parity is not None:
                # Every group digests every snapshot step too, so a snapshot's own step is
                # compared at once (not at the next parity step, up to an interval later).
                parity.also_digest(snapshots.writer.due)
        hang = None
        if conn.server is not None:
            server = conn.server

            def last_words(report: str) -> None:
                # Before a hung process ends itself: its report (verdict, native state,
                # stacks) as this rank's last telemetry report, then the manager server
                # closed, which delivers it and ends the group's session at once.
                telemetry.finish(HungProcessError(report), step=step())
                server.shutdown()

            hang = HangWatchdog(
                conn.server.hung,
                cfg.hang_action,
                conn.replica_id,
                describe=conn.server.describe,
                last_words=last_words,
            ).start()
    except BaseException:
        watcher.stop(wait=0.0)
        raise
    return GroupServices(telemetry, watcher, snapshots, hang)


def vote(
    server: NativeManagerServer | None,
    client: NativeManagerClient,
    *,
    group_rank: int,
    world_size: int,
    step: int,
    local_vote: bool,
    timeout: timedelta,
    digest: tuple[int, bytes] | None,
    quorum_wait: float | None = None,
) -> bool:
    """The group's commit vote on ``step``: every rank's ``local_vote`` ANDed by the manager
    server (with the step's parity digest, if one was taken). The hosting rank's
    ``quorum_wait`` in the step (seconds, when measured) goes with the group's commit
    announcement to the lighthouse, which accounts the step with it if its telemetry report
    is lost (goodput).

    With a single rank the vote is the local one, so the round trip is skipped (the hot path
    of plain DDP); the manager server still gates a yes: the group's lease must hold (a group
    frozen past it may have been declared lost) and the lighthouse must accept the
    write-ahead commit (refused when the others went on without this group).
    """
    if server is not None and quorum_wait is not None:
        server._note_quorum_wait(step, quorum_wait)
    if world_size == 1:
        if server is not None and digest is not None:
            server._offer_digest(group_rank, *digest)
        return local_vote and (server is None or bool(server.may_commit(step, timeout)))
    if digest is not None:
        return bool(client._should_commit_digest(group_rank, step, local_vote, timeout, *digest))
    return bool(client.should_commit(group_rank, step, local_vote, timeout=timeout))
