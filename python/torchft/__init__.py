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
from torchft.otel import LOGGERS as _OTEL_LOGGERS
from torchft.otel import setup_logger as _setup_otel_logger
from torchft.process_group import (
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

# As upstream's package does: with TORCHFT_USE_OTEL on, the quorum, commit and error logs go
# to the OpenTelemetry collector (OTEL_EXPORTER_OTLP_*) from import on. Off, nothing happens.
for _name in _OTEL_LOGGERS:
    _setup_otel_logger(_name)

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
