"""torchft's process groups in torch.distributed: backend registration,
init_process_group, groups resolvable by name and DeviceMesh."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _process_group_kit import (  # noqa: F401 - the fixture, found by pytest by name
    _addr,
    store_fixture,
)
from torch.distributed import TCPStore

from torchft.process_group import (
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    _register_backends,
)


def test_backends_registered_idempotently() -> None:
    """The four backends are registered with torch and registering again is harmless."""
    _register_backends()
    _register_backends()
    for name in ("torchft-gloo", "torchft-nccl", "torchft-baby-gloo", "torchft-baby-nccl"):
        assert name in dist.Backend.backend_list
    assert dist.Backend.backend_list.count("torchft-gloo") == 1


def test_register_makes_group_resolvable(store: TCPStore) -> None:
    """register() exposes the group to torch.distributed by name; unregister() undoes it."""
    from torch.distributed.distributed_c10d import _resolve_process_group, _world

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(_addr(store, "reg"), "r", 0, 1)
    pg.register("torchft_test_group")
    try:
        assert _resolve_process_group("torchft_test_group") is pg
        assert dist.get_process_group_ranks(pg) == [0]
        t = torch.tensor([2.0])
        dist.all_reduce(t, group=pg)
        assert t.item() == 2.0
        with pytest.raises(ValueError, match="already registered"):
            ProcessGroupDummy(0, 1).register("torchft_test_group")
    finally:
        pg.unregister()
    assert pg not in _world.pg_map
    with pytest.raises(Exception):  # noqa: B017 - torch's lookup error type varies
        _resolve_process_group("torchft_test_group")
    pg.shutdown()


def test_init_process_group_with_torchft_gloo(store: TCPStore) -> None:
    """torch.distributed.init_process_group(backend="torchft-gloo") builds a usable group."""
    dist.init_process_group(
        backend="torchft-gloo",
        store=dist.PrefixStore("init", store),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
    )
    try:
        t = torch.tensor([5.0])
        dist.all_reduce(t)
        assert t.item() == 5.0
        assert isinstance(dist.group.WORLD, ProcessGroupGloo)
    finally:
        dist.destroy_process_group()


def test_registered_group_works_with_device_mesh(store: TCPStore) -> None:
    """A registered group can back a DeviceMesh dimension and functional collectives."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    try:
        pg.configure(_addr(store, "mesh"), "r", 0, 1)
        pg.register("torchft_mesh_dp")
        assert pg.group_name == "torchft_mesh_dp"
        mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("dp",))
        assert mesh.get_group("dp") is pg
        out = funcol.all_reduce(torch.full((2,), 3.0), "sum", mesh)
        assert torch.equal(funcol.wait_tensor(out), torch.full((2,), 3.0))
    finally:
        pg.unregister()
        pg.shutdown()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_init_process_group_with_torchft_baby_gloo(store: TCPStore) -> None:
    """The baby backend works through init_process_group: the child gets its own prefix on
    the same TCPStore server."""
    dist.init_process_group(
        backend="torchft-baby-gloo",
        store=dist.PrefixStore("baby_init", store),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, ProcessGroupBabyGloo)
        t = torch.tensor([6.0])
        dist.all_reduce(t)
        assert t.item() == 6.0
        assert pg._child is not None and pg._child.process.is_alive()
    finally:
        pg = dist.group.WORLD
        dist.destroy_process_group()
        if isinstance(pg, ProcessGroupBabyGloo):
            pg.shutdown()
