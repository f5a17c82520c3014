"""Coordination primitives: the lighthouse and the per replica group manager server.

These are the native (Rust) implementations re-exported under a stable public module, so user
code does not import the private ``torchft._torchft`` directly.
"""

from __future__ import annotations

import logging

from torchft._torchft import (
    LighthouseClient,
    LighthouseServer,
    ManagerClient,
    ManagerServer,
    Quorum,
    QuorumMember,
    QuorumResult,
)

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
]
