"""The Baby process groups (collectives run in a child process): results through shared
memory, a killed or aborted child, timeouts, orphans and leaked fds."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from _process_group_kit import (  # noqa: F401 - the fixture, found by pytest by name
    _addr,
    store_fixture,
)
from torch.distributed import ReduceOp, TCPStore

from torchft.process_group import ProcessGroupBabyGloo


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
