"""Joining a replica group: the group's store, its manager server (started by group rank 0)
and this rank's client of that server.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed import TCPStore

if TYPE_CHECKING:
    from torchft.config import ManagerConfig
    from torchft.coordination import NativeBackend, NativeManagerClient, NativeManagerServer


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
