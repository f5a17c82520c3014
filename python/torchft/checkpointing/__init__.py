"""Checkpoint transports that heal a replica from a live peer's state.

:class:`HTTPTransport` serves each rank's state over HTTP (pulled by receivers, streamed,
optionally in parallel chunks); :class:`PGTransport` pushes it over a torch process group.
Both use a safe wire format (JSON header + raw tensor bytes, no pickle).
"""

from __future__ import annotations

from torchft.checkpointing.http_transport import HTTPTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport"]
