"""The NCCL process groups: collectives and reconfigure on GPUs, abort and a killed child
on one GPU, clear failures without CUDA, and the timeout error as upstream's."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
from _process_group_kit import (  # noqa: F401 - the fixture, found by pytest by name
    _addr,
    _run_ranks,
    store_fixture,
)
from torch.distributed import ReduceOp, TCPStore

from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupNCCL

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
