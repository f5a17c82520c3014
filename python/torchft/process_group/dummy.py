"""A process group that completes every collective at once (unit tests, world-size-1 DDP)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchft.process_group.base import (
    _COLLECTIVES,
    ProcessGroup,
    _check_rank,
    _check_timeout,
    _default_result,
)
from torchft.work import _DummyWork


class ProcessGroupDummy(ProcessGroup):
    """A group whose collectives complete at once and leave the tensors as they are.

    With ``world == 1`` this is exactly right (every collective is the identity); for larger
    worlds it behaves as if every rank held the same data. Counts ``configure`` calls for tests.
    """

    def __init__(self, rank: int, world: int) -> None:
        """Creates the group.

        Args:
            rank: the rank reported by ``rank()``.
            world: the size reported by ``size()``.
        """
        _check_rank(rank, world)
        super().__init__()
        self._rank = rank
        self._world = world
        self.configure_count = 0

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Records the new rank/size; no store is contacted."""
        _check_rank(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.configure_count += 1

    def set_timeout(self, timeout: timedelta) -> None:
        """Accepted and ignored: nothing ever waits."""
        _check_timeout(timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``torchft-dummy``."""
        return "torchft-dummy"

    def size(self) -> int:
        """The configured world size."""
        return self._world

    def rank(self) -> int:
        """The configured rank."""
        return self._rank

    def _dispatch(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        """Completes ``op`` at once, as if every rank held this rank's data.

        Reductions, broadcasts and point-to-point operations leave the tensors as they
        are; gathers copy the input into every slot; scatters keep this rank's piece.
        """
        if op == "allgather":
            outputs, inputs, _ = args
            for outs, inp in zip(outputs, inputs, strict=True):
                for out in outs:
                    out.copy_(inp)
        elif op == "allgather_into_tensor_coalesced":
            outputs, inputs, _ = args
            for out, inp in zip(outputs, inputs, strict=True):
                for chunk in out.view(-1).chunk(self._world):
                    chunk.copy_(inp.view(-1))
        elif op == "reduce_scatter":
            outputs, inputs, _ = args
            for out, ins in zip(outputs, inputs, strict=True):
                out.copy_(ins[self._rank])
        elif op == "reduce_scatter_tensor_coalesced":
            outputs, inputs, _ = args
            for out, inp in zip(outputs, inputs, strict=True):
                out.view(-1).copy_(inp.view(-1).chunk(self._world)[self._rank])
        elif op == "alltoall_base":
            args[0].copy_(args[1])
        elif op not in _COLLECTIVES:
            raise self._unsupported(op)
        return _DummyWork(_default_result(op, args))
