"""What both ends of the HTTP checkpoint transport agree on.

Endpoints (``{base}`` is :meth:`HTTPTransport.metadata`, whose path is :data:`BASE_PATH`)::

    GET {base}/{step}/full?wait=S          header frame + every tensor
    GET {base}/{step}/header?wait=S        header frame only
    GET {base}/{step}/range/{a}/{b}?gen=G  tensors [a, b) of the state identified by G

A request for a step that is not served yet waits up to ``wait`` seconds (the receiver may
ask before the source reached ``send_checkpoint``); a request for an older step than the
one served fails at once with 409. The header frame names the state's generation ``gen``
and, when the source runs the native data server, its ``data_port``.
"""

from __future__ import annotations

import logging
import time

# One logger for the whole transport, under the name it has always had: log
# configurations name it.
logger: logging.Logger = logging.getLogger("torchft.checkpointing.http_transport")

BASE_PATH = "/checkpoint"


class Aborted(Exception):
    """The transfer was cancelled (checkpoint disallowed or transport shut down)."""


def wait_param(deadline: float) -> str:
    """The ``wait`` a request sends: slightly before the receiver's own ``deadline``, so the
    server's answer (e.g. "not served in time") arrives before the receiver gives up."""
    return f"{max(deadline - time.monotonic() - 0.05, 0.0):.3f}"


def full_path(prefix: str, step: int, deadline: float) -> str:
    """The request for the header and every tensor of ``step``."""
    return f"{prefix}/{step}/full?wait={wait_param(deadline)}"


def header_path(prefix: str, step: int, deadline: float) -> str:
    """The request for the header of ``step`` only."""
    return f"{prefix}/{step}/header?wait={wait_param(deadline)}"


def range_path(prefix: str, step: object, start: int, end: int, gen: str) -> str:
    """The request for tensors ``[start, end)`` of the state generation ``gen``."""
    return f"{prefix}/{step}/range/{start}/{end}?gen={gen}"
