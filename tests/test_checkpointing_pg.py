"""PGTransport: a checkpoint sent over a Gloo process group, in place when the shapes
match, between threads and between processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _checkpoint_kit import (  # noqa: F401 - the autouse fixture, found by pytest by name
    assert_identical,
    checkpoint_servers_on_loopback,
    realistic_state,
)

from torchft.checkpointing import PGTransport


def _gloo_pair(timeout: timedelta) -> list[Any]:
    """Two Gloo process groups (ranks 0 and 1) over loopback, built concurrently."""
    store = dist.HashStore()
    pgs: list[Any] = [None, None]

    def make(rank: int) -> None:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, opts)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(make, [0, 1]))
    return pgs


def _run_pair(fn0: Callable[[], Any], fn1: Callable[[], Any]) -> tuple[Any, Any]:
    with ThreadPoolExecutor(2) as pool:
        f0 = pool.submit(fn0)
        f1 = pool.submit(fn1)
        return f0.result(timeout=60), f1.result(timeout=60)


@pytest.mark.timeout(60)
def test_pg_transport_round_trip_and_in_place() -> None:
    """Gloo send/recv delivers the state bit-identical, in place when shapes match."""
    pgs = _gloo_pair(timedelta(seconds=20))
    state, *_ = realistic_state(seed=1)
    local, local_model, *_ = realistic_state(seed=2)
    local["user"]["model"]["extra_local_only"] = torch.zeros(3)
    local_w = local["user"]["model"]["lin.weight"]
    local_ptrs = {k: v.data_ptr() for k, v in local["user"]["model"].items()}

    sender: PGTransport[Any] = PGTransport(pgs[0], timedelta(seconds=20), torch.device("cpu"))
    receiver: PGTransport[Any] = PGTransport(
        pgs[1], timedelta(seconds=20), torch.device("cpu"), state_dict=lambda: local
    )
    assert isinstance(sender.metadata(), str)
    _, out = _run_pair(
        lambda: sender.send_checkpoint([1], 3, state, timedelta(seconds=20)),
        lambda: receiver.recv_checkpoint(0, "<n/a>", 3, timedelta(seconds=20)),
    )
    assert_identical(state, out)
    # Received in place: same storage as the local tensors, now holding the source's values.
    for k, v in out["user"]["model"].items():
        assert v.data_ptr() == local_ptrs[k], k
    assert torch.equal(local_w, state["user"]["model"]["lin.weight"])
    assert torch.equal(local_model.lin.weight, state["user"]["model"]["lin.weight"])

    # Without a local state dict, fresh tensors are allocated.
    plain: PGTransport[Any] = PGTransport(pgs[1], timedelta(seconds=20), torch.device("cpu"))
    _, out2 = _run_pair(
        lambda: sender.send_checkpoint([1], 4, state, timedelta(seconds=20)),
        lambda: plain.recv_checkpoint(0, "<n/a>", 4, timedelta(seconds=20)),
    )
    assert_identical(state, out2)
    assert out2["user"]["model"]["lin.weight"].data_ptr() != local_w.data_ptr()


@pytest.mark.timeout(60)
def test_pg_transport_wrong_step_and_timeout() -> None:
    """A step mismatch is an error; a receive with no sender times out."""
    pgs = _gloo_pair(timedelta(seconds=20))
    sender: PGTransport[Any] = PGTransport(pgs[0], timedelta(seconds=20), torch.device("cpu"))
    receiver: PGTransport[Any] = PGTransport(pgs[1], timedelta(seconds=20), torch.device("cpu"))
    state = {"a": torch.ones(4)}
    with ThreadPoolExecutor(2) as pool:
        fs = pool.submit(sender.send_checkpoint, [1], 5, state, timedelta(seconds=20))
        fr = pool.submit(receiver.recv_checkpoint, 0, "<n/a>", 6, timedelta(seconds=20))
        with pytest.raises(RuntimeError, match="step 5"):
            fr.result(timeout=30)
        # Drain the payload so the sender completes.
        buf = torch.empty(16, dtype=torch.uint8)
        pgs[1].recv([buf], 0, 0).wait()
        fs.result(timeout=30)
    assert torch.equal(buf.view(torch.float32), state["a"])

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        receiver.recv_checkpoint(0, "<n/a>", 1, timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 10


_PG_RECEIVER_PROCESS = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from _checkpoint_kit import assert_identical, realistic_state
from torchft.checkpointing import PGTransport

port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
opts = dist.ProcessGroupGloo._Options()
opts._timeout = timedelta(seconds=30)
opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = dist.ProcessGroupGloo(store, 1, 2, opts)
local, *_ = realistic_state(seed=8)
transport = PGTransport(pg, timedelta(seconds=30), torch.device("cpu"), state_dict=lambda: local)
out = transport.recv_checkpoint(0, "<n/a>", 11, timedelta(seconds=30))
expected, *_ = realistic_state(seed=3)
assert_identical(expected, out)
assert out["user"]["model"]["lin.weight"].data_ptr() == local["user"]["model"]["lin.weight"].data_ptr()
print("OK", flush=True)
"""


@pytest.mark.timeout(120)
def test_pg_transport_between_processes() -> None:
    """PGTransport over Gloo between two processes (TCPStore on port 0), in place."""
    import torchft

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    paths = [str(Path(torchft.__file__).parent.parent), str(Path(__file__).parent)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _PG_RECEIVER_PROCESS, str(store.port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=60)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, 0, 2, opts)
        state, *_ = realistic_state(seed=3)
        sender: PGTransport[Any] = PGTransport(pg, timedelta(seconds=60), torch.device("cpu"))  # type: ignore[arg-type]
        sender.send_checkpoint([1], 11, state, timedelta(seconds=60))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == "OK"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
