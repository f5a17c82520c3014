"""Chaos testing of fault tolerance: random compound faults against real processes.

``python -m torchft.chaos`` (``make chaos``) runs replica groups under a real
``torchft_lighthouse`` daemon, injects faults (:mod:`torchft.chaos.harness`), records what
every group committed (:mod:`torchft.chaos.worker`) and checks the history offline against
the invariants (:mod:`torchft.chaos.history`). See ``docs/chaos.md``.
"""

from torchft.chaos.harness import FAULT_KINDS, Chaos, ChaosConfig
from torchft.chaos.history import check
from torchft.chaos.report import Report

__all__ = ["FAULT_KINDS", "Chaos", "ChaosConfig", "Report", "check"]
