"""torch's native reconfigurable groups driven like torchft groups (handle exchange, abort)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from torchft.process_group import ProcessGroupGloo
from torchft.process_group.native import (
    ProcessGroupNative,
    ReconfigureTimeoutError,
    exchange_handles,
    is_native_reconfigurable,
    manager_group,
    reconfigure_with_store,
)

pytestmark = pytest.mark.skipif(
    not hasattr(dist.ProcessGroup, "reconfigure"), reason="torch without native reconfigure"
)

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    """A TCPStore server on a free port."""
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield s


def _client(store: TCPStore, prefix: str) -> PrefixStore:
    """A separate connection (concurrent waits need their own) scoped to ``prefix``."""
    c = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
    return PrefixStore(prefix, c)


def _native_gloo(store: TCPStore, rank: int, size: int) -> dist.ProcessGroup:
    """A ProcessGroup around a Gloo backend created with enable_reconfigure=True."""
    s = _client(store, "native")
    backend = dist.ProcessGroupGloo(s, rank, size, enable_reconfigure=True)
    pg = dist.ProcessGroup(s, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def _parallel(*calls: Callable[[], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as ex:
        return [f.result(timeout=30) for f in [ex.submit(c) for c in calls]]


@pytest.mark.timeout(30)
def test_exchange_returns_one_uuid_and_handles_in_rank_order(store: TCPStore) -> None:
    """Every member gets the same uuid and the handles ordered by rank."""
    out = _parallel(
        *(
            lambda r=r: exchange_handles(_client(store, "x"), r, 3, f"h{r}", TIMEOUT)
            for r in (2, 0, 1)
        )
    )
    uuids = {u for u, _ in out}
    assert len(uuids) == 1 and 0 <= uuids.pop() < 2**63
    assert all(h == ["h0", "h1", "h2"] for _, h in out)


@pytest.mark.timeout(30)
def test_exchange_missing_peer_times_out_within_the_timeout(store: TCPStore) -> None:
    """A member that never publishes → ReconfigureTimeoutError (a TimeoutError) in time."""
    t0 = time.monotonic()
    with pytest.raises(ReconfigureTimeoutError, match=r"wait timeout after 300ms.*handle/1"):
        exchange_handles(_client(store, "y"), 0, 2, "h0", timedelta(milliseconds=300))
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 1.5, elapsed
    assert issubclass(ReconfigureTimeoutError, TimeoutError)
    assert issubclass(ReconfigureTimeoutError, dist.DistStoreError)


@pytest.mark.timeout(30)
def test_exchange_rejects_bad_input_before_touching_the_store(store: TCPStore) -> None:
    """Bad rank, world size, handle or timeout raise at once and publish nothing."""
    s = _client(store, "z")
    with pytest.raises(ValueError, match="rank"):
        exchange_handles(s, 2, 2, "h", TIMEOUT)
    with pytest.raises(ValueError, match="world_size"):
        exchange_handles(s, 0, 0, "h", TIMEOUT)
    with pytest.raises(ValueError, match="handle"):
        exchange_handles(s, 0, 1, "", TIMEOUT)
    with pytest.raises(TypeError, match="timedelta"):
        exchange_handles(s, 0, 1, "h", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        exchange_handles(s, 0, 1, "h", timedelta(0))
    assert not s.check(["handle/0"]) and not s.check(["uuid"])


@pytest.mark.timeout(30)
def test_exchange_ends_at_once_when_cancelled(store: TCPStore) -> None:
    """Setting the cancel event ends a wait for a missing member well before its timeout."""
    cancelled = threading.Event()
    threading.Timer(0.2, cancelled.set).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        exchange_handles(_client(store, "c"), 0, 2, "h0", timedelta(seconds=20), cancelled)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.timeout(30)
def test_detection_and_manager_group_choice(store: TCPStore) -> None:
    """Native groups are wrapped, torchft groups kept, plain torch groups rejected clearly."""
    native = _native_gloo(store, 0, 1)
    assert is_native_reconfigurable(native)
    assert isinstance(manager_group(native, TIMEOUT), ProcessGroupNative)
    ours = ProcessGroupGloo(timeout=TIMEOUT)
    assert not is_native_reconfigurable(ours)
    assert manager_group(ours, TIMEOUT) is ours
    empty = dist.ProcessGroup(dist.HashStore(), 0, 1)  # no backend: cannot say
    assert not is_native_reconfigurable(empty)
    with pytest.raises(ValueError, match="enable_reconfigure=True"):
        manager_group(empty, TIMEOUT)
    with pytest.raises(ValueError, match="enable_reconfigure=True"):
        ProcessGroupNative(empty)  # type: ignore[arg-type]


@pytest.mark.timeout(40)
def test_configure_resizes_in_place_and_allreduces(store: TCPStore) -> None:
    """configure reconfigures the same objects through membership changes; sums are right."""
    natives = [_native_gloo(store, r, 2) for r in range(2)]
    pgs = [ProcessGroupNative(n, timeout=TIMEOUT) for n in natives]
    addr = f"127.0.0.1:{store.port}/torchft"

    def allreduce(pg: ProcessGroupNative, value: float) -> float:
        t = torch.tensor([value])
        pg.allreduce([t], dist.ReduceOp.SUM).wait()
        return float(t.item())

    _parallel(*(lambda r=r: pgs[r].configure(f"{addr}/1/0", f"rg{r}", r, 2) for r in range(2)))
    assert _parallel(lambda: allreduce(pgs[0], 1.0), lambda: allreduce(pgs[1], 2.0)) == [3.0, 3.0]
    # Shrink to one member, then grow again with the ranks swapped.
    pgs[0].configure(f"{addr}/2/0", "rg0", 0, 1)
    assert natives[0].size() == 1 and allreduce(pgs[0], 5.0) == 5.0
    _parallel(
        lambda: pgs[0].configure(f"{addr}/3/0", "rg0", 1, 2),
        lambda: pgs[1].configure(f"{addr}/3/0", "rg1", 0, 2),
    )
    assert (natives[0].rank(), natives[1].rank()) == (1, 0)
    assert _parallel(lambda: allreduce(pgs[0], 4.0), lambda: allreduce(pgs[1], 6.0)) == [
        10.0,
        10.0,
    ]
    assert pgs[0].errored() is None and pgs[1].errored() is None


@pytest.mark.timeout(40)
def test_abort_ends_a_configure_waiting_for_a_lost_member(store: TCPStore) -> None:
    """abort() during the exchange: configure raises at once, error recorded, group reusable."""
    natives = [_native_gloo(store, r, 2) for r in range(2)]
    pgs = [ProcessGroupNative(n, timeout=timedelta(seconds=20)) for n in natives]
    addr = f"127.0.0.1:{store.port}/torchft"
    threading.Timer(0.3, pgs[0].abort).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        pgs[0].configure(f"{addr}/1/0", "rg0", 0, 2)  # rank 1 never comes
    assert time.monotonic() - t0 < 3.0
    assert pgs[0].errored() is not None
    # The same object reconfigures with both members afterwards; the error is cleared.
    _parallel(*(lambda r=r: pgs[r].configure(f"{addr}/2/0", f"rg{r}", r, 2) for r in range(2)))
    assert pgs[0].errored() is None
    ts = [torch.ones(2), torch.ones(2)]
    _parallel(*(lambda r=r: pgs[r].allreduce([ts[r]], dist.ReduceOp.SUM).wait() for r in range(2)))
    assert ts[0].tolist() == [2.0, 2.0]


@pytest.mark.timeout(30)
def test_configure_timeout_is_recorded_and_raised(store: TCPStore) -> None:
    """A missing member fails configure with the timeout error, also kept by errored()."""
    pg = ProcessGroupNative(_native_gloo(store, 0, 2), timeout=timedelta(milliseconds=300))
    with pytest.raises(TimeoutError, match="wait timeout after 300ms"):
        pg.configure(f"127.0.0.1:{store.port}/torchft/1/0", "rg0", 0, 2)
    assert isinstance(pg.errored(), ReconfigureTimeoutError)


@pytest.mark.timeout(30)
def test_reconfigure_with_store_without_a_manager(store: TCPStore) -> None:
    """The standalone helper reconfigures two members on a store prefix."""
    natives = [_native_gloo(store, r, 2) for r in range(2)]
    addr = f"127.0.0.1:{store.port}/standalone/1"
    _parallel(
        *(lambda r=r: reconfigure_with_store(natives[r], addr, r, 2, TIMEOUT) for r in (0, 1))
    )
    assert [n.size() for n in natives] == [2, 2]


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL"
)
def test_native_nccl_reconfigures_and_allreduces(store: TCPStore) -> None:
    """A native NCCL group (enable_reconfigure) is driven the same way (one GPU: size 1)."""
    s = _client(store, "nccl")
    opts = dist.ProcessGroupNCCL.Options()
    opts.enable_reconfigure = True
    backend = dist.ProcessGroupNCCL(s, 0, 1, opts)
    native = dist.ProcessGroup(s, 0, 1)
    native._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    native._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    pg = manager_group(native, TIMEOUT)
    assert isinstance(pg, ProcessGroupNative)
    for quorum in (1, 2):
        pg.configure(f"127.0.0.1:{store.port}/torchft/{quorum}/0", "rg0", 0, 1)
        t = torch.full((4,), float(quorum), device="cuda")
        pg.allreduce([t], dist.ReduceOp.SUM).wait()
        torch.cuda.synchronize()
        assert t.tolist() == [float(quorum)] * 4
    assert pg.errored() is None


@pytest.mark.timeout(60)
def test_torch_without_native_reconfiguration_still_imports_and_builds_managers() -> None:
    """On a torch that cannot reconfigure groups in place (before 2.15) torchft imports, a
    Manager's torchft group is used as before, and only a native reconfigure says why not."""
    import subprocess
    import sys

    code = (
        "import torch._C._distributed_c10d as c\n"
        "del c.ReconfigureOptions\n"
        "from datetime import timedelta\n"
        "import torchft\n"
        "from torchft.process_group import ProcessGroupGloo\n"
        "from torchft.process_group import native\n"
        "pg = ProcessGroupGloo()\n"
        "assert native.manager_group(pg, timedelta(seconds=1)) is pg\n"
        "try:\n"
        "    native._reconfigure(object(), 1, ['h'], timedelta(seconds=1))\n"
        "except RuntimeError as e:\n"
        "    assert 'cannot reconfigure a process group in place' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
