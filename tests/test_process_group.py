"""Tests of the reconfigurable process groups, their wrappers and backend registration."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import (
    AllreduceOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
    TCPStore,
)

from torchft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    _parse_store_addr,
    _register_backends,
    create_store_client,
)
from torchft.work import _DummyWork


@pytest.fixture
def store() -> Iterator[TCPStore]:
    """A TCPStore server on an ephemeral port, shut down after the test."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


def _addr(store: TCPStore, prefix: str) -> str:
    return f"127.0.0.1:{store.port}/{prefix}"


def _run_ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """Runs ``fn(rank)`` for every rank in its own thread and returns the results in order."""
    with ThreadPoolExecutor(max_workers=world) as pool:
        futures = [pool.submit(fn, rank) for rank in range(world)]
        return [f.result(timeout=90) for f in futures]


# ---- store addresses -------------------------------------------------------------------


def test_parse_store_addr_accepts_host_port_prefix() -> None:
    """host:port/prefix (IPv4, name, bracketed IPv6, nested prefix) parses into parts."""
    assert _parse_store_addr("127.0.0.1:1234/torchft/3/0") == ("127.0.0.1", 1234, "torchft/3/0")
    assert _parse_store_addr("node-1:80/p") == ("node-1", 80, "p")
    assert _parse_store_addr("[::1]:29500/x") == ("::1", 29500, "x")


@pytest.mark.parametrize(
    "bad", ["", "127.0.0.1:1234", "127.0.0.1/x", ":1234/x", "h:notaport/x", "h:0/x", "h:70000/x"]
)
def test_parse_store_addr_rejects_malformed(bad: str) -> None:
    """Malformed store addresses are rejected with a clear ValueError."""
    with pytest.raises(ValueError, match="store_addr|port"):
        _parse_store_addr(bad)


def test_store_client_is_scoped_to_prefix(store: TCPStore) -> None:
    """Keys written through the client land under the prefix on the server."""
    client = create_store_client(_addr(store, "pre/fix"), timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("pre/fix/k") == b"v"


# ---- ProcessGroupGloo ------------------------------------------------------------------


def test_gloo_collectives_and_reconfigure(store: TCPStore) -> None:
    """Every supported collective gives the right answer, before and after a reconfigure
    to a new prefix with a different world size."""
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=30)) for _ in range(3)]

    def round_one(rank: int) -> dict[str, Any]:
        pg = pgs[rank]
        pg.configure(_addr(store, "q1"), f"replica_{rank}", rank, 2)
        out: dict[str, Any] = {"size": pg.size(), "rank": pg.rank(), "getSize": pg.getSize()}

        t = torch.tensor([rank + 1.0, 10.0])
        work = pg.allreduce([t], ReduceOp.SUM)
        work.wait()
        out["sum"] = t.tolist()

        t = torch.tensor([rank + 1.0])
        fut = pg.allreduce([t], ReduceOp.AVG).get_future()
        out["avg"] = fut.wait()[0].tolist()

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MAX
        t = torch.tensor([float(rank)])
        pg.allreduce([t], opts).wait()
        out["max"] = t.item()

        gathered = [[torch.zeros(2) for _ in range(2)]]
        pg.allgather(gathered, [torch.full((2,), float(rank))]).wait()
        out["allgather"] = [g.tolist() for g in gathered[0]]

        t = torch.tensor([float(rank + 7)])
        pg.broadcast_one(t, root=1).wait()
        out["broadcast"] = t.item()

        t = torch.tensor([float(rank)])
        bopts = BroadcastOptions()
        bopts.rootRank = 0
        pg.broadcast([t], bopts).wait()
        out["broadcast0"] = t.item()

        tensors = [torch.tensor([1.0 + rank]), torch.tensor([2.0 + rank])]
        pg.allreduce_coalesced(tensors).wait()
        out["coalesced"] = [x.item() for x in tensors]

        rs_out = [torch.zeros(1)]
        rs_in = [[torch.tensor([float(rank)]), torch.tensor([float(rank * 10)])]]
        rs_opts = ReduceScatterOptions()
        rs_opts.reduceOp = ReduceOp.SUM
        pg.reduce_scatter(rs_out, rs_in, rs_opts).wait()
        out["reduce_scatter"] = rs_out[0].item()

        a2a_in = torch.tensor([rank * 10.0, rank * 10.0 + 1])
        a2a_out = torch.zeros(2)
        pg.alltoall_base(a2a_out, a2a_in, [1, 1], [1, 1]).wait()
        out["alltoall"] = a2a_out.tolist()

        if rank == 0:
            pg.send([torch.tensor([42.0])], 1, 0).wait()
        else:
            r = torch.zeros(1)
            pg.recv([r], 0, 0).wait()
            out["recv"] = r.item()

        pg.barrier().wait()
        return out

    r0, r1 = _run_ranks(2, round_one)
    for rank, r in enumerate((r0, r1)):
        assert (r["size"], r["rank"], r["getSize"]) == (2, rank, 2)
        assert r["sum"] == [3.0, 20.0]
        assert r["avg"] == [1.5]
        assert r["max"] == 1.0
        assert r["allgather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["broadcast"] == 8.0
        assert r["broadcast0"] == 0.0
        assert r["coalesced"] == [3.0, 5.0]
        assert r["alltoall"] == [0.0 + rank, 10.0 + rank]
    assert r0["reduce_scatter"] == 0.0 + 1.0  # piece 0: rank0's 0 + rank1's 1
    assert r1["reduce_scatter"] == 0.0 + 10.0  # piece 1: rank0's 0 + rank1's 10
    assert r1["recv"] == 42.0

    def round_two(rank: int) -> float:
        pg = pgs[rank]
        pg.configure(_addr(store, "q2"), f"replica_{rank}", rank, 3)
        t = torch.tensor([float(rank + 1)])
        pg.allreduce([t], ReduceOp.SUM).wait()
        assert pg.size() == 3
        return t.item()

    assert _run_ranks(3, round_two) == [6.0, 6.0, 6.0]
    for pg in pgs:
        assert pg.errored() is None
        pg.shutdown()


@pytest.mark.timeout(60)
def test_gloo_timeout_is_recorded_not_hung(store: TCPStore) -> None:
    """A collective whose peer never joins fails within the timeout and is recorded."""
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=2)) for _ in range(2)]
    _run_ranks(2, lambda r: pgs[r].configure(_addr(store, "t"), "r", r, 2))
    start = time.monotonic()
    work = pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM)
    with pytest.raises(Exception):  # noqa: B017 - Gloo's timeout error or ours
        work.wait()
    assert time.monotonic() - start < 20
    assert pgs[0].errored() is not None
    # A fresh configuration clears the error.
    _run_ranks(2, lambda r: pgs[r].configure(_addr(store, "t2"), "r", r, 2))
    assert pgs[0].errored() is None
    for pg in pgs:
        pg.shutdown()


def test_unconfigured_and_aborted_groups_raise_clearly() -> None:
    """Using a group before configure, or after abort, is a clear RuntimeError."""
    pg = ProcessGroupGloo()
    with pytest.raises(RuntimeError, match="not configured"):
        pg.allreduce([torch.ones(1)], ReduceOp.SUM)
    pg.abort()  # nothing to abort: no error
    assert pg.errored() is None


def test_gloo_abort_records_error(store: TCPStore) -> None:
    """abort() drops the group and errored() reports it until the next configure."""
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(_addr(store, "solo"), "r", 0, 1)
    t = torch.ones(1)
    pg.allreduce([t], ReduceOp.SUM).wait()
    pg.abort()
    assert isinstance(pg.errored(), RuntimeError)
    with pytest.raises(RuntimeError, match="not configured"):
        pg.allreduce([t], ReduceOp.SUM)
    pg.configure(_addr(store, "solo2"), "r", 0, 1)
    assert pg.errored() is None


def test_configure_rejects_bad_rank_and_world(store: TCPStore) -> None:
    """rank outside [0, world) or a non-positive world is a ValueError before any I/O."""
    pg = ProcessGroupGloo()
    with pytest.raises(ValueError, match="rank"):
        pg.configure(_addr(store, "x"), "r", 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        pg.configure(_addr(store, "x"), "r", 0, 0)
    with pytest.raises(ValueError, match="store_addr"):
        pg.configure("nonsense", "r", 0, 1)


def test_timeout_validation_and_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timeouts must be positive timedeltas; TORCHFT_TIMEOUT_SEC overrides the argument."""
    with pytest.raises(ValueError, match="positive"):
        ProcessGroupGloo(timeout=timedelta(seconds=0))
    with pytest.raises(TypeError):
        ProcessGroupGloo(timeout=5)  # type: ignore[arg-type]
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "7.5")
    assert ProcessGroupGloo(timeout=timedelta(seconds=60))._timeout == timedelta(seconds=7.5)
    assert ProcessGroupBabyGloo(timeout=timedelta(seconds=60))._timeout == timedelta(seconds=7.5)
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "soon")
    with pytest.raises(ValueError, match="TORCHFT_TIMEOUT_SEC"):
        ProcessGroupGloo()


# ---- ProcessGroupDummy -----------------------------------------------------------------


def test_dummy_completes_immediately() -> None:
    """The dummy group completes at once with the inputs and counts configure calls."""
    pg = ProcessGroupDummy(0, 1)
    t = torch.tensor([3.0])
    work = pg.allreduce([t], ReduceOp.SUM)
    assert work.wait() and work.get_future().done()
    assert work.get_future().value() == [t]
    out = [[torch.zeros(1)]]
    pg.allgather(out, [t]).wait()
    assert out[0][0].item() == 3.0
    assert pg.size() == 1 and pg.getSize() == 1
    pg.configure("127.0.0.1:1/x", "r", 1, 4)
    assert (pg.configure_count, pg.rank(), pg.size()) == (1, 1, 4)
    with pytest.raises(ValueError):
        ProcessGroupDummy(1, 1)


# ---- error swallowing and fakes --------------------------------------------------------


class _BrokenProcessGroup(ProcessGroupDummy):
    """Every collective raises synchronously; counts the calls."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.calls = 0

    def __getattribute__(self, name: str) -> Any:
        if name in _ALL_COLLECTIVES:

            def fail(*args: Any, **kwargs: Any) -> Any:
                object.__setattr__(self, "calls", object.__getattribute__(self, "calls") + 1)
                raise RuntimeError(f"{name} broke")

            return fail
        return object.__getattribute__(self, name)


_ALL_COLLECTIVES = [
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_into_tensor_coalesced",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "alltoall_base",
    "barrier",
    "send",
    "recv",
]


def _call(pg: ProcessGroup, name: str) -> Any:
    """Calls collective ``name`` on ``pg`` with valid world-size-1 arguments."""
    t = torch.ones(2)
    if name in ("allreduce", "allreduce_coalesced"):
        return getattr(pg, name)([t])
    if name == "allgather":
        return pg.allgather([[torch.zeros(2)]], [t])
    if name == "allgather_into_tensor_coalesced":
        return pg.allgather_into_tensor_coalesced([torch.zeros(2)], [t])
    if name == "broadcast":
        return pg.broadcast([t])
    if name == "reduce_scatter":
        return pg.reduce_scatter([torch.zeros(2)], [[t]])
    if name == "reduce_scatter_tensor_coalesced":
        return pg.reduce_scatter_tensor_coalesced([torch.zeros(2)], [t])
    if name == "alltoall_base":
        return pg.alltoall_base(torch.zeros(2), t, [2], [2])
    if name == "barrier":
        return pg.barrier()
    if name == "send":
        return pg.send([t], 0, 0)
    if name == "recv":
        return pg.recv([t], 0, 0)
    raise AssertionError(name)


@pytest.mark.parametrize("name", _ALL_COLLECTIVES)
def test_error_swallowing_sync_errors_every_collective(name: str) -> None:
    """A collective that raises is recorded, returns completed work, and later ones are
    no-ops that never reach the broken group."""
    inner = _BrokenProcessGroup()
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    work = _call(pg, name)
    assert work.wait() is True
    work.get_future().wait()
    err = pg.error()
    assert isinstance(err, RuntimeError) and f"{name} broke" in str(err)
    assert pg.errored() is err
    assert inner.calls == 1
    for other in _ALL_COLLECTIVES:
        _call(pg, other).wait()
    assert inner.calls == 1
    pg.configure("127.0.0.1:1/x", "r", 0, 1)
    assert pg.error() is None


@pytest.mark.parametrize("name", _ALL_COLLECTIVES)
def test_error_swallowing_future_errors_every_collective(name: str) -> None:
    """A collective whose future fails resolves to its default instead, and the error is
    recorded; the next collective is skipped."""
    fake = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg = ErrorSwallowingProcessGroupWrapper(fake)
    fake.report_future_error(RuntimeError("injected"))
    work = _call(pg, name)
    fut = work.get_future()
    fut.wait()  # does not raise
    assert str(pg.error()) == "injected"
    assert isinstance(_call(pg, "allreduce"), _DummyWork)


def test_error_swallowing_wait_records_error() -> None:
    """wait() on a failing work returns True and records the error."""
    fake = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg = ErrorSwallowingProcessGroupWrapper(fake)
    fake.report_future_error(RuntimeError("on wait"))
    assert pg.allreduce([torch.ones(1)]).wait() is True
    assert str(pg.error()) == "on wait"


def test_error_swallowing_with_real_gloo_timeout(store: TCPStore) -> None:
    """A real Gloo timeout under the swallowing wrapper is recorded, never raised."""
    inner = [ProcessGroupGloo(timeout=timedelta(seconds=2)) for _ in range(2)]
    pgs = [ErrorSwallowingProcessGroupWrapper(p) for p in inner]
    _run_ranks(2, lambda r: pgs[r].configure(_addr(store, "sw"), "r", r, 2))
    t = torch.ones(1)
    fut = pgs[0].allreduce([t], ReduceOp.SUM).get_future()
    assert fut.wait() == [t]
    assert pgs[0].error() is not None
    for p in pgs:
        p.shutdown()


def test_fake_wrapper_fails_only_the_next_future() -> None:
    """report_future_error affects exactly one collective."""
    pg = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg.report_future_error(ValueError("boom"))
    fut = pg.allreduce([torch.ones(1)]).get_future()
    with pytest.raises(ValueError, match="boom"):
        fut.wait()
    t = torch.ones(1)
    assert pg.allreduce([t]).get_future().wait() == [t]
    assert pg.size() == 1 and pg.getBackendName() == "torchft-dummy"


class _FakeManager:
    """Averages over a fixed number of participants, like Manager.allreduce with AVG."""

    def __init__(self, participants: int) -> None:
        self.participants = participants
        self.ops: list[Any] = []
        self._pg = ProcessGroupDummy(0, 1)

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> Any:
        self.ops.append(reduce_op)
        # Pretend every participant contributed the same tensor.
        if reduce_op == ReduceOp.SUM:
            tensor.mul_(self.participants)
        return _DummyWork(tensor)

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return 1


def test_managed_process_group_routes_through_manager() -> None:
    """allreduce goes through manager.allreduce with the requested op; size is the number
    of participants."""
    manager = _FakeManager(3)
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    a, b = torch.ones(2), torch.ones(1)
    assert pg.allreduce([a, b], ReduceOp.SUM).get_future().wait() == [a, b]
    assert a.tolist() == [3.0, 3.0] and b.item() == 3.0
    assert manager.ops == [ReduceOp.SUM, ReduceOp.SUM]
    assert (pg.size(), pg.getSize(), pg.rank()) == (3, 3, 1)
    assert pg.getBackendName() == "torchft-managed"


class _NoQuorumYetManager(_FakeManager):
    """A manager before its first quorum: asking for the participants raises, as Manager does."""

    def num_participants(self) -> int:
        raise RuntimeError("wait_quorum() called before start_quorum()")


def test_managed_process_group_registers_before_the_first_quorum() -> None:
    """torchtitan registers ManagedProcessGroup as "dp_replicate" at start-up, before any
    quorum: registration works (a world of one) and the name resolves to the group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = ManagedProcessGroup(_NoQuorumYetManager(2))  # type: ignore[arg-type]
    pg.register("torchft_test_dp_replicate")
    try:
        assert _resolve_process_group("torchft_test_dp_replicate") is pg
        assert dist.get_process_group_ranks(pg) == [0]
    finally:
        pg.unregister()


# ---- torch.distributed integration -----------------------------------------------------


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


# ---- child-process groups --------------------------------------------------------------


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


@pytest.mark.timeout(240)
def test_baby_gloo_allreduce_reconfigure_and_no_leaks(store: TCPStore) -> None:
    """Baby groups reduce correctly through shared memory, respawn their child on every
    configure, and leave no child process or fd behind after shutdown."""
    # Warm-up: the first use starts Python's fd-passing helper thread, which lives on.
    warm = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    warm.configure(_addr(store, "warm"), "r", 0, 1)
    warm.allreduce([torch.ones(1)], ReduceOp.SUM).wait()
    warm.shutdown()
    children_before = len(multiprocessing.active_children())
    fds_before = _fd_count()
    targets_before = _fd_targets()

    pgs = [ProcessGroupBabyGloo(timeout=timedelta(seconds=60)) for _ in range(2)]
    for rank, pg in enumerate(pgs):
        pg.configure(_addr(store, "b1"), "r", rank, 2)
    pids1 = [pg._child.process.pid for pg in pgs]  # type: ignore[union-attr]
    ts = [torch.tensor([rank + 1.0, 10.0]) for rank in range(2)]
    works = [pg.allreduce([t], ReduceOp.SUM) for pg, t in zip(pgs, ts, strict=True)]
    for w in works:
        w.wait()
    assert [t.tolist() for t in ts] == [[3.0, 20.0], [3.0, 20.0]]

    gathered = [[[torch.zeros(1), torch.zeros(1)]] for _ in range(2)]
    works = [pg.allgather(gathered[r], [torch.tensor([float(r)])]) for r, pg in enumerate(pgs)]
    assert works[0].get_future().wait() is gathered[0]
    works[1].wait()
    assert [[g.item() for g in out[0]] for out in gathered] == [[0.0, 1.0], [0.0, 1.0]]

    for rank, pg in enumerate(pgs):
        pg.configure(_addr(store, "b2"), "r", rank, 2)
    pids2 = [pg._child.process.pid for pg in pgs]  # type: ignore[union-attr]
    assert set(pids1).isdisjoint(pids2)
    for pid in pids1:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    ts = [torch.tensor([rank + 1.0]) for rank in range(2)]
    works = [pg.allreduce([t], ReduceOp.AVG) for pg, t in zip(pgs, ts, strict=True)]
    for w in works:
        w.wait()
    assert [t.item() for t in ts] == [1.5, 1.5]
    t = torch.tensor([float(1)])
    w0 = pgs[0].broadcast_one(torch.tensor([9.0]), root=0)
    pgs[1].broadcast_one(t, root=0).wait()
    w0.wait()
    assert t.item() == 9.0
    for pg in pgs:
        assert pg.errored() is None
        pg.shutdown()

    # Shared-memory tensors keep an fd while they are alive; release them before counting.
    del ts, t, gathered, works, w, w0
    gc.collect()
    assert len(multiprocessing.active_children()) == children_before
    assert _fd_count() <= fds_before, sorted(set(_fd_targets()) - set(targets_before))


@pytest.mark.timeout(180)
def test_baby_gloo_killed_child_and_abort_surface_as_errors(store: TCPStore) -> None:
    """A pending collective fails promptly when its child is killed, abort() fails pending
    work and kills the child, and the group works again after a configure."""
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    # World of two where the peer never shows up: the allreduce blocks in the child.
    pg.configure(_addr(store, "k1"), "r", 0, 2)
    fut = pg.allreduce([torch.ones(1)], ReduceOp.SUM).get_future()
    time.sleep(0.5)
    assert not fut.done()
    child = pg._child
    assert child is not None
    os.kill(child.process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exit"):
        fut.wait()
    assert time.monotonic() - start < 10
    assert pg.errored() is not None

    pg.configure(_addr(store, "k2"), "r", 0, 2)
    assert pg.errored() is None
    fut = pg.allreduce([torch.ones(1)], ReduceOp.SUM).get_future()
    pid = pg._child.process.pid  # type: ignore[union-attr]
    pg.abort()
    with pytest.raises(RuntimeError):
        fut.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert pg.errored() is not None
    with pytest.raises(RuntimeError, match="not configured"):
        pg.allreduce([torch.ones(1)], ReduceOp.SUM)

    pg.configure(_addr(store, "k3"), "r", 0, 1)
    t = torch.tensor([4.0])
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.item() == 4.0
    pg.shutdown()
    assert pg._child is None


@pytest.mark.timeout(120)
def test_baby_gloo_timeout(store: TCPStore) -> None:
    """A collective that cannot complete fails with a timeout instead of hanging."""
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=3))
    pg.configure(_addr(store, "to"), "r", 0, 2)
    # The child waits for the missing peer to rendezvous; our deadline fires first or the
    # child's store timeout does: either way an error, bounded in time.
    start = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)):
        pg.allreduce([torch.ones(1)], ReduceOp.SUM).wait()
    assert time.monotonic() - start < 30
    assert pg.errored() is not None
    pg.shutdown()


# ---- NCCL (GPU only) -------------------------------------------------------------------

_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


@_two_gpus
def test_nccl_allreduce_and_reconfigure(store: TCPStore) -> None:
    """NCCL groups reduce correctly and can be rebuilt on a new prefix."""
    pgs = [ProcessGroupNCCL(timeout=timedelta(seconds=30)) for _ in range(2)]

    def run(rank: int, prefix: str) -> float:
        torch.cuda.set_device(rank)
        pgs[rank].configure(_addr(store, prefix), "r", rank, 2)
        t = torch.tensor([rank + 1.0], device=f"cuda:{rank}")
        pgs[rank].allreduce([t], ReduceOp.SUM).wait()
        torch.cuda.synchronize()
        return t.item()

    assert _run_ranks(2, lambda r: run(r, "n1")) == [3.0, 3.0]
    assert _run_ranks(2, lambda r: run(r, "n2")) == [3.0, 3.0]
    for pg in pgs:
        pg.shutdown()


@_two_gpus
@pytest.mark.timeout(180)
def test_baby_nccl_allreduce(store: TCPStore) -> None:
    """Baby NCCL groups reduce CUDA tensors in place through IPC."""
    pgs = [ProcessGroupBabyNCCL(timeout=timedelta(seconds=60)) for _ in range(2)]
    for rank, pg in enumerate(pgs):
        pg.configure(_addr(store, "bn"), "r", rank, 2)
    ts = [torch.tensor([rank + 1.0], device=f"cuda:{rank}") for rank in range(2)]
    works = [pg.allreduce([t], ReduceOp.SUM) for pg, t in zip(pgs, ts, strict=True)]
    for w in works:
        w.wait()
    assert [t.item() for t in ts] == [3.0, 3.0]
    for pg in pgs:
        pg.shutdown()


_one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@_one_gpu
@pytest.mark.timeout(120)
def test_nccl_one_rank_reduces_aborts_and_reconfigures(store: TCPStore) -> None:
    """On one GPU: an NCCL group reduces in place, abort() drops it (errored() says so and a
    collective is refused clearly, without hanging), and a configure on a fresh prefix makes
    it work again."""
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(_addr(store, "n1a"), "r", 0, 1)
    t = torch.full((1 << 16,), 2.0, device="cuda")
    pg.allreduce([t], ReduceOp.SUM).wait()
    torch.cuda.synchronize()
    assert torch.equal(t, torch.full_like(t, 2.0))
    pg.abort()
    assert isinstance(pg.errored(), RuntimeError)
    with pytest.raises(RuntimeError):
        pg.allreduce([t], ReduceOp.SUM).wait()
    pg.configure(_addr(store, "n1b"), "r", 0, 1)
    assert pg.errored() is None
    t.fill_(3.0)
    pg.allreduce([t], ReduceOp.SUM).wait()
    torch.cuda.synchronize()
    assert torch.equal(t, torch.full_like(t, 3.0))
    pg.shutdown()


@_one_gpu
@pytest.mark.timeout(180)
def test_baby_nccl_killed_child_and_abort_surface_as_errors(store: TCPStore) -> None:
    """On one GPU: a Baby NCCL group reduces a CUDA tensor through its child; a collective
    waiting for a missing peer fails promptly when the child is SIGKILLed, abort() kills a
    child and fails its pending work, and the group works again after a configure."""
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=60))
    pg.configure(_addr(store, "bn1"), "r", 0, 1)
    t = torch.full((1024,), 4.0, device="cuda")
    pg.allreduce([t], ReduceOp.SUM).wait()
    torch.cuda.synchronize()
    assert torch.equal(t, torch.full_like(t, 4.0))

    pg.configure(_addr(store, "bn2"), "r", 0, 2)  # the peer never comes
    fut = pg.allreduce([torch.ones(4, device="cuda")], ReduceOp.SUM).get_future()
    time.sleep(1.0)
    assert not fut.done()
    child = pg._child
    assert child is not None
    os.kill(child.process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        fut.wait()
    assert time.monotonic() - start < 15
    assert pg.errored() is not None

    pg.configure(_addr(store, "bn3"), "r", 0, 2)
    fut = pg.allreduce([torch.ones(4, device="cuda")], ReduceOp.SUM).get_future()
    pid = pg._child.process.pid  # type: ignore[union-attr]
    pg.abort()
    with pytest.raises(RuntimeError):
        fut.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    pg.configure(_addr(store, "bn4"), "r", 0, 1)
    t.fill_(6.0)
    pg.allreduce([t], ReduceOp.SUM).wait()
    torch.cuda.synchronize()
    assert torch.equal(t, torch.full_like(t, 6.0))
    pg.shutdown()
    assert pg._child is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_nccl_without_cuda_fails_clearly(store: TCPStore) -> None:
    """Configuring NCCL on a machine without CUDA raises instead of hanging."""
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="CUDA"):
        pg.configure(_addr(store, "nocuda"), "r", 0, 1)
    baby = ProcessGroupBabyNCCL(timeout=timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="CUDA"):
        baby.configure(_addr(store, "nocuda"), "r", 0, 1)
    assert baby._child is None


# ---- real processes and signals --------------------------------------------------------


def _gloo_peer(store_addr: str, ready: Any) -> None:
    """Rank 1 in another process: allreduces forever until killed."""
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    pg.configure(store_addr, "peer", 1, 2)
    first = True
    while True:
        pg.allreduce([torch.ones(1)], ReduceOp.SUM).wait()
        if first:
            ready.set()
            first = False


@pytest.mark.timeout(120)
def test_gloo_peer_killed_fails_fast_and_recovers(store: TCPStore) -> None:
    """When the peer process is SIGKILLed mid-training, our collective fails (bounded by
    the timeout, not hung), the error is recorded, and a reconfigure to a smaller world
    works again."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    peer = ctx.Process(target=_gloo_peer, args=(_addr(store, "kill1"), ready), daemon=True)
    peer.start()
    try:
        # Generous while the peer process starts up, short once training runs.
        pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
        pg.configure(_addr(store, "kill1"), "me", 0, 2)
        pg.set_timeout(timedelta(seconds=5))
        t = torch.ones(1)
        pg.allreduce([t], ReduceOp.SUM).wait()
        assert t.item() == 2.0
        assert ready.wait(30)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - Gloo's connection error or our timeout
            for _ in range(1000):
                pg.allreduce([torch.ones(1)], ReduceOp.SUM).wait()
        assert time.monotonic() - start < 30
        assert pg.errored() is not None

        pg.configure(_addr(store, "kill2"), "me", 0, 1)
        assert pg.errored() is None
        t = torch.full((1,), 3.0)
        pg.allreduce([t], ReduceOp.SUM).wait()
        assert t.item() == 3.0
        pg.shutdown()
    finally:
        if peer.is_alive():
            peer.kill()
        peer.join(10)


@pytest.mark.timeout(60)
def test_gloo_configure_with_missing_peer_times_out(store: TCPStore) -> None:
    """Rendezvous with a peer that never comes raises within the timeout."""
    pg = ProcessGroupGloo(timeout=timedelta(seconds=2))
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own DistStoreError
        pg.configure(_addr(store, "lonely"), "r", 0, 2)
    assert time.monotonic() - start < 30


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split()[1]
    except FileNotFoundError:
        return False
    return True


def _baby_owner(store_addr: str, pid_queue: Any) -> None:
    """A process that owns a Baby group with a collective stuck in its child."""
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=600))
    pg.configure(store_addr, "owner", 0, 2)
    pg.allreduce([torch.ones(1)], ReduceOp.SUM)
    assert pg._child is not None
    pid_queue.put(pg._child.process.pid)
    time.sleep(600)


@pytest.mark.timeout(120)
def test_baby_child_exits_when_its_parent_is_killed(store: TCPStore) -> None:
    """Killing the training process never leaves an orphaned child behind, even with a
    collective stuck in the child."""
    ctx = multiprocessing.get_context("spawn")
    pids = ctx.Queue()
    # Not a daemon: daemonic processes may not start children.
    owner = ctx.Process(target=_baby_owner, args=(_addr(store, "orphan"), pids))
    owner.start()
    try:
        child_pid = pids.get(timeout=60)
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not _alive(child_pid):
                break
            time.sleep(0.1)
        else:
            os.kill(child_pid, signal.SIGKILL)
            pytest.fail("the child outlived its parent")
    finally:
        if owner.is_alive():
            owner.kill()
        owner.join(10)
        pids.close()
        pids.join_thread()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", [ProcessGroupGloo, ProcessGroupBabyGloo])
def test_abort_releases_blocked_waiters_at_once(
    store: TCPStore, cls: type[ProcessGroupGloo] | type[ProcessGroupBabyGloo]
) -> None:
    """abort() fails a collective that is stuck on a missing peer immediately, long before
    its timeout."""
    pgs = [cls(timeout=timedelta(seconds=60)) for _ in range(2)]
    # Both ranks rendezvous, then only rank 0 issues a collective: it blocks.
    _run_ranks(2, lambda r: pgs[r].configure(_addr(store, f"ab_{cls.__name__}"), "r", r, 2))
    if cls is ProcessGroupBabyGloo:
        # Make sure both children finished their rendezvous.
        works = [pg.barrier() for pg in pgs]
        for w in works:
            w.wait()
    work = pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM)
    time.sleep(0.3)
    assert not work.get_future().done()
    start = time.monotonic()
    pgs[0].abort()
    with pytest.raises(RuntimeError, match="abort"):
        work.wait()
    assert time.monotonic() - start < 10
    assert pgs[0].errored() is not None
    for pg in pgs:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_reconfigure_fails_old_ops_but_starts_clean(store: TCPStore) -> None:
    """A collective still pending when the group is reconfigured fails at once, and the new
    configuration reports no error."""
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=60)) for _ in range(2)]
    _run_ranks(2, lambda r: pgs[r].configure(_addr(store, "re1"), "r", r, 2))
    stuck = pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM)
    time.sleep(0.2)
    start = time.monotonic()
    pgs[0].configure(_addr(store, "re2"), "r", 0, 1)
    with pytest.raises(RuntimeError, match="reconfigured"):
        stuck.wait()
    assert time.monotonic() - start < 10
    assert pgs[0].errored() is None
    t = torch.tensor([2.0])
    pgs[0].allreduce([t], ReduceOp.SUM).wait()
    assert t.item() == 2.0
    for pg in pgs:
        pg.shutdown()


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


@pytest.mark.timeout(180)
def test_baby_abort_with_unsent_tensors_leaks_no_fds(store: TCPStore) -> None:
    """Aborting while operations wait in a child that never got to read them (stuck in a
    rendezvous) leaks neither shared-memory fds nor processes."""
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    pg.configure(_addr(store, "warm2"), "r", 0, 1)
    pg.allreduce([torch.ones(1)], ReduceOp.SUM).wait()
    pg.shutdown()
    gc.collect()
    fds_before = _fd_count()
    targets_before = _fd_targets()
    children_before = len(multiprocessing.active_children())

    for i in range(3):
        pg.configure(_addr(store, f"stuck{i}"), "r", 0, 2)  # the peer never comes
        works = [pg.allreduce([torch.ones(4)], ReduceOp.SUM) for _ in range(3)]
        time.sleep(0.3)
        pg.abort()
        for w in works:
            with pytest.raises(RuntimeError):
                w.wait()
        del works, w
    pg.shutdown()
    gc.collect()
    assert len(multiprocessing.active_children()) == children_before
    assert _fd_count() <= fds_before, sorted(set(_fd_targets()) - set(targets_before))


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


# Configures a group whose peer never comes, aborts the configure, and exits while an
# object torn down late in interpreter finalization (as a native library's handles can be)
# keeps the process alive past the abandoned rendezvous's timeout.
_ABANDONED_CONFIGURE_AT_EXIT = """
import builtins, sys, threading, time
from datetime import timedelta
from torchft.process_group import ProcessGroupGloo

class SlowTeardown:
    def __del__(self):
        time.sleep(2.5)

pg = ProcessGroupGloo(timeout=timedelta(seconds=1))
errors = []
def configure():
    try:
        pg.configure(sys.argv[1], "r", 0, 2)
    except RuntimeError as e:
        errors.append(e)
t = threading.Thread(target=configure)
t.start()
time.sleep(0.3)
pg.abort()
t.join(5)
assert errors and "aborted" in str(errors[0]), errors
pg.shutdown()
builtins._slow_teardown = SlowTeardown()
print("exiting", flush=True)
"""


@pytest.mark.timeout(60)
def test_abandoned_configure_never_kills_the_process_at_exit(store: TCPStore) -> None:
    """A configure abandoned by abort() leaves its rendezvous running until the timeout;
    when that ends while the interpreter is finalizing, the process still exits cleanly
    (it used to die with SIGABRT: a daemon thread returning from torch at that point is
    ended by the interpreter in a way C++ turns into std::terminate)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _ABANDONED_CONFIGURE_AT_EXIT, _addr(store, "abandoned")],
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert "exiting" in proc.stdout, proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}: {proc.stderr[-2000:]}"


# ---- timeout semantics as upstream torchft's (exception types, message parts) -----------


@pytest.mark.timeout(30)
def test_gloo_configure_timeout_matches_upstream(store: TCPStore) -> None:
    """A rendezvous timeout raises a RuntimeError with "timeout after 10ms", also errored()."""
    pg = ProcessGroupGloo(timeout=timedelta(milliseconds=10))
    with pytest.raises(RuntimeError, match=r"(timeout after 10ms|Socket Timeout)"):
        pg.configure(_addr(store, "cfg_timeout"), "r", 0, 2)
    assert isinstance(pg.errored(), RuntimeError)
    pg.shutdown()


@pytest.mark.timeout(30)
def test_gloo_collective_timeout_matches_upstream_future_timeout(store: TCPStore) -> None:
    """A collective past the timeout: TimeoutError "future did not complete within"."""
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=1)) for _ in range(2)]
    _run_ranks(2, lambda r: pgs[r].configure(_addr(store, "coll_timeout"), "r", r, 2))
    work = pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM)  # rank 1 never joins
    with pytest.raises(TimeoutError, match="future did not complete within"):
        work.wait()
    assert isinstance(pgs[0].errored(), TimeoutError)
    for pg in pgs:
        pg.shutdown()


def test_nccl_timeout_error_says_aborted_as_upstream() -> None:
    """NCCL's timeout abort records an error that is a RuntimeError saying "aborted" (as
    upstream's errored()) and a TimeoutError saying "timed out after"."""
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=1))
    pg._timed_out()  # what the work's deadline calls
    err = pg.errored()
    assert isinstance(err, RuntimeError) and isinstance(err, TimeoutError)
    with pytest.raises(RuntimeError, match="aborted"):
        raise err
    assert "timed out after 0:00:01" in str(err)
