"""Process groups under failure: a peer process killed, a peer that never comes, abort
and reconfigure releasing blocked collectives, and a configure abandoned at exit."""

from __future__ import annotations

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
    _run_ranks,
    store_fixture,
)
from torch.distributed import ReduceOp, TCPStore

from torchft.process_group import ProcessGroupBabyGloo, ProcessGroupGloo


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
