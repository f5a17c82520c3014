"""ProcessGroupGloo and ProcessGroupDummy: store addresses, every collective before and
after a reconfigure, timeouts, abort and argument checks."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from _process_group_kit import (  # noqa: F401 - the fixture, found by pytest by name
    _addr,
    _run_ranks,
    store_fixture,
)
from torch.distributed import (
    AllreduceOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
    TCPStore,
)

from torchft.process_group import (
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    _parse_store_addr,
    create_store_client,
)

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
