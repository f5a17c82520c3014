"""Unit tests of QuorumGroup's collectives against a scripted process group."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp
from torch.futures import Future

from torchft.quorum_group import QuorumGroup
from torchft.work import _FutureWork, _InFlight


class _ScriptedGroup:
    """A process group whose one allreduce is the future ``source``, tracked (and aborted)
    as torchft's own groups track theirs."""

    def __init__(self, source: Future[Any]) -> None:
        self.source = source
        self.inflight = _InFlight()
        self.aborted = False

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> _FutureWork:
        return self.inflight.work(self.source, 60.0)

    def abort(self) -> None:
        self.aborted = True
        self.inflight.fail_all(RuntimeError("the group was aborted"))

    def errored(self) -> Exception | None:
        return None


@pytest.mark.timeout(30)
def test_a_loss_after_the_backend_finished_keeps_the_step() -> None:
    """A member is lost after the step's allreduce finished in its backend but while its
    completion callback still waits (here: behind an earlier callback; in a job, for the
    GIL). The collective had every member's data, so the step is not failed, and the
    abort that follows completes it with the backend's result, averaged."""
    source: Future[Any] = Future()
    gate = threading.Event()
    source.add_done_callback(lambda _: gate.wait(10))  # runs before the group's callback
    pg = _ScriptedGroup(source)
    errors: list[Exception] = []
    group = QuorumGroup(pg, errors.append, lambda _: None, lambda: "g0/0 step 7")
    group.quorum_id = 5
    tensor = torch.full((2,), 6.0)
    fut = group.allreduce(tensor, ReduceOp.AVG, 3, None, None)

    setter = threading.Thread(target=source.set_result, args=([tensor],), daemon=True)
    setter.start()
    deadline = time.monotonic() + 10
    while not source.done():
        assert time.monotonic() < deadline
        time.sleep(0.001)

    group.on_lost("g1", 5, "g0")
    assert pg.aborted
    assert errors == []
    assert fut.wait() is tensor
    assert tensor.tolist() == [2.0, 2.0]
    gate.set()
    setter.join(10)
    assert tensor.tolist() == [2.0, 2.0]  # the late callback does not divide again
