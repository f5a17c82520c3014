"""Coordination primitives: the lighthouse and the per replica group manager server.

Thin re-exports of the native module so user code does not import ``torchft._torchft``.
"""

from __future__ import annotations

from torchft._torchft import ManagerClient, ManagerServer, QuorumResult

__all__ = [
    "ManagerClient",
    "ManagerServer",
    "QuorumResult",
]
