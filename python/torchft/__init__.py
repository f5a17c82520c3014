"""torchft: per-step fault tolerance for PyTorch training.

The names exported here are the public entry points scripts use: the :class:`Manager`, the
optimizer wrapper (``torchft.Optimizer``), fault-tolerant DDP, the replica-aware sampler and
the reconfigurable process groups.
"""

from __future__ import annotations

from torchft.data import DistributedSampler
from torchft.ddp import DistributedDataParallel
from torchft.manager import Manager, StateDivergedError
from torchft.optim import OptimizerWrapper as Optimizer
from torchft.process_group import (
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "StateDivergedError",
]
