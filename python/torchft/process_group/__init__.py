"""Reconfigurable process groups for fault-tolerant training.

torch's process groups are built once for a fixed world. Fault tolerance changes the set of
replica groups every time a quorum changes, so the process groups here can be torn down and
rebuilt in place: ``configure(store_addr, replica_id, rank, world_size)`` connects to the store
named by ``store_addr`` ("host:port/prefix") and builds a fresh group on that prefix.

Implementations:

* ``ProcessGroupGloo`` / ``ProcessGroupNCCL``: the real group lives in this process and is
  replaced on every ``configure``.
* ``ProcessGroupBabyGloo`` / ``ProcessGroupBabyNCCL``: the real group lives in a child process
  that is killed and respawned on every ``configure``/``abort``. A hung or crashed collective
  can then always be recovered from, at the cost of moving tensors through shared memory.
* ``ProcessGroupDummy``: completes everything at once (unit tests, world-size-1 DDP).
* ``ProcessGroupNative``: drives a torch group created with ``enable_reconfigure=True``
  (torch 2.15+) through ``pg.reconfigure`` after a handle exchange on the store prefix; the
  Manager wraps such a group by itself. ``reconfigure_with_store`` does one reconfiguration
  without a Manager.
* Wrappers: ``ProcessGroupWrapper`` (delegation), ``ErrorSwallowingProcessGroupWrapper``
  (record the first error, turn later collectives into no-ops), ``FakeProcessGroupWrapper``
  (inject future errors in tests) and ``ManagedProcessGroup`` (allreduce through a Manager).

Every group is a ``torch.distributed.ProcessGroup`` subclass, so it can be handed to torch
code (DDP, DeviceMesh via ``register``). The backends are also registered with
``torch.distributed.Backend`` as ``torchft-gloo``, ``torchft-nccl``, ``torchft-baby-gloo`` and
``torchft-baby-nccl``.

The environment variable ``TORCHFT_TIMEOUT_SEC`` overrides the timeout given to any group.

Layout: ``base`` (the ``ProcessGroup`` base class with every collective's signature, and the
shared helpers), ``reconfigurable`` (``ProcessGroupWrapper``, Gloo, NCCL), ``dummy``,
``wrappers`` (error swallowing, fakes, the managed group), ``native`` (torch's own
reconfigurable groups), ``baby`` (child-process groups)
and ``baby_ipc`` (their wire to the child). Everything is re-exported from here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from torchft.process_group.baby import (
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)
from torchft.process_group.base import (
    AbortedTimeoutError,
    ProcessGroup,
    create_store_client,
)

# Helpers callers used from the single-module layout, re-exported explicitly.
from torchft.process_group.base import _check_rank as _check_rank
from torchft.process_group.base import _check_timeout as _check_timeout
from torchft.process_group.base import _env_timeout as _env_timeout
from torchft.process_group.base import _parse_store_addr as _parse_store_addr
from torchft.process_group.dummy import ProcessGroupDummy
from torchft.process_group.native import (
    ProcessGroupNative,
    ReconfigureTimeoutError,
    reconfigure_with_store,
)
from torchft.process_group.reconfigurable import (
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
)
from torchft.process_group.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
)

__all__ = [
    "AbortedTimeoutError",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupNative",
    "ProcessGroupWrapper",
    "ReconfigureTimeoutError",
    "create_store_client",
    "reconfigure_with_store",
]

# ---- torch.distributed backend registration -------------------------------------------


def _backend_factory(
    cls: type[ProcessGroupWrapper] | type[ProcessGroupBaby],
) -> Callable[[Store, int, int, timedelta], ProcessGroup]:
    def create(store: Store, rank: int, world_size: int, timeout: timedelta) -> ProcessGroup:
        pg = cls(timeout=timeout)
        pg._configure_store(store, rank, world_size)
        return pg

    return create


def _register_backends() -> None:
    """Registers the torchft backends with torch.distributed (safe to call repeatedly)."""
    backends: list[tuple[str, Any, list[str]]] = [
        ("torchft-gloo", ProcessGroupGloo, ["cpu", "cuda"]),
        ("torchft-nccl", ProcessGroupNCCL, ["cuda"]),
        ("torchft-baby-gloo", ProcessGroupBabyGloo, ["cpu"]),
        ("torchft-baby-nccl", ProcessGroupBabyNCCL, ["cuda"]),
    ]
    plugins = getattr(dist.Backend, "_plugins", {})
    for name, cls, devices in backends:
        if name.upper() in plugins or name in dist.Backend.backend_list:
            continue
        dist.Backend.register_backend(name, _backend_factory(cls), devices=devices)


_register_backends()
