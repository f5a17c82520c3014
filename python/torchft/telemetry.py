"""Per-step telemetry of one rank: where the step's time went, reported fail-open.

Each rank measures, per step, the wall time since the previous step ended and the parts of it
spent blocked on the quorum (healing included), with a collective in flight, and in the commit
vote; the rest is its *busy* time, which the lighthouse compares across replica groups to find
stragglers. One report per step goes to the native client's bounded queue (a call that never
waits for the network); the manager server forwards the reports to the lighthouse in batches.
A full queue drops reports and counts them; nothing here raises into training.

Turn it off per process with ``TORCHFT_TELEMETRY=0`` or ``Manager(telemetry=False)``. The
lighthouse serves the result at ``/status``, ``/metrics``, ``/events`` and ``/`` (see
docs/telemetry.md).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from torchft.config import env_flag

if TYPE_CHECKING:
    from torchft.coordination import NativeManagerClient

logger: logging.Logger = logging.getLogger(__name__)

ENV_TELEMETRY = "TORCHFT_TELEMETRY"

#: Longest error text sent (characters); the lighthouse refuses longer ones.
MAX_ERROR_CHARS = 4000
#: Longest host name sent (bytes).
MAX_HOSTNAME_BYTES = 255
#: Longest heal source name sent (the core refuses longer replica ids).
MAX_SOURCE_BYTES = 256
#: Longest heal address sent (``host:port``; the core refuses longer ones).
MAX_ADDR_BYTES = MAX_HOSTNAME_BYTES + 17
#: Longest snapshot path sent (bytes; the core refuses longer ones).
MAX_PATH_BYTES = 4096
#: How long the last report waits to be delivered at shutdown.
FINAL_FLUSH_S = 1.0


def enabled_from_env(default: bool = True) -> bool:
    """Reads ``TORCHFT_TELEMETRY`` (1/true/yes/on or 0/false/no/off).

    Args:
        default: the value when the variable is unset or empty.

    Raises:
        ValueError: on any other value (naming the variable).
    """
    return env_flag(ENV_TELEMETRY, default)


def tensor_bytes(obj: object) -> int:
    """Bytes held by the tensors in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _truncate_utf8(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore")


_live: weakref.WeakSet[RankTelemetry] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hook_installed = False


def _install_excepthook() -> None:
    """Makes an uncaught exception report every live rank as failed before the process dies."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            for t in list(_live):
                try:
                    t.finish(value)
                except Exception:  # never mask the original error
                    pass
            previous(tp, value, tb)

        sys.excepthook = hook
        _hook_installed = True


class RankTelemetry:
    """Timings of the current step of one rank, and its reports.

    Thread-safe: collectives complete and heals run on other threads.
    """

    def __init__(
        self,
        client: NativeManagerClient,
        replica_id: str,
        incarnation: str,
        group_rank: int,
        group_world_size: int,
        hostname: str,
        enabled: bool = True,
    ) -> None:
        """Creates the telemetry of one rank.

        Args:
            client: the native manager client (``report``, ``_telemetry_flush``).
            replica_id: the replica group's stable name.
            incarnation: the lighthouse id of this start of the group.
            group_rank: rank inside the replica group.
            group_world_size: ranks in the replica group.
            hostname: reported host name.
            enabled: whether reports are sent (see :data:`ENV_TELEMETRY`).
        """
        self._client = client
        # Who sends: the same fields in every report.
        self._sender: dict[str, Any] = {
            "replica_id": replica_id,
            "incarnation": incarnation,
            "group_rank": group_rank,
            "group_world_size": group_world_size,
            "hostname": _truncate_utf8(hostname, MAX_HOSTNAME_BYTES),
            "pid": os.getpid(),
        }
        self.enabled = enabled
        self._lock = threading.Lock()
        self._last_end = time.perf_counter()
        self._quorum_wait = 0.0
        self._heal_s = 0.0
        self._heal_bytes = 0
        self._heal_source = ""
        self._heal_addr = ""
        self._outstanding = 0
        self._coll_since = 0.0
        self._coll_total = 0.0
        self._gen = 0
        self._finished = False
        self.failed_sends = 0
        if enabled:
            _live.add(self)
            _install_excepthook()

    # ------------------------------------------------------------------ timings

    @contextmanager
    def quorum_wait(self) -> Iterator[None]:
        """Counts the time inside the block as blocked on the quorum."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._quorum_wait += dt

    def collective_started(self) -> int | None:
        """Marks a collective in flight; pass the token to :meth:`collective_finished`."""
        if not self.enabled:
            return None
        now = time.perf_counter()
        with self._lock:
            if self._outstanding == 0:
                self._coll_since = now
            self._outstanding += 1
            return self._gen

    def collective_finished(self, token: int | None) -> None:
        """Marks a collective of the step ``token`` came from as done."""
        if token is None:
            return
        now = time.perf_counter()
        with self._lock:
            if token != self._gen or self._outstanding == 0:
                return
            self._outstanding -= 1
            if self._outstanding == 0:
                self._coll_total += now - self._coll_since

    def heal_started(self, step: int, quorum_id: int) -> None:
        """Reports that this rank starts fetching live state (the group shows ``healing``)."""
        self._send(phase="heal_started", step=step, quorum_id=quorum_id)

    def heal_done(self, seconds: float, received: object, source: str = "", addr: str = "") -> int:
        """Records a finished heal: its duration, the bytes of state received, the replica
        group (its name) it came from and the address (``host:port``) its state was fetched
        from, which shows the network the heal used.

        Returns:
            The bytes of tensor data received.
        """
        size = tensor_bytes(received)
        with self._lock:
            self._heal_s += seconds
            self._heal_bytes += size
            self._heal_source = _truncate_utf8(source, MAX_SOURCE_BYTES)
            self._heal_addr = _truncate_utf8(addr, MAX_ADDR_BYTES)
        return size

    def step_ended(
        self,
        *,
        step: int,
        quorum_id: int,
        participants: int,
        committed: bool,
        healed: bool,
        should_commit_s: float,
        error: str | None,
        rank: int,
    ) -> None:
        """Closes the step's timings and queues its report.

        Args:
            step: the committed step count before this step.
            quorum_id: the step's quorum.
            participants: replica groups contributing to the step.
            committed: whether the step committed.
            healed: whether this rank healed during the step.
            should_commit_s: time in the commit vote.
            error: the step's error, if any.
            rank: this rank's rank in the whole job (-1 if unknown).
        """
        now = time.perf_counter()
        with self._lock:
            if self._outstanding:
                self._coll_total += now - self._coll_since
                self._outstanding = 0
            self._gen += 1
            step_s = now - self._last_end
            quorum_wait, collective = self._quorum_wait, self._coll_total
            heal_s, heal_bytes = self._heal_s, self._heal_bytes
            heal_source, heal_addr = self._heal_source, self._heal_addr
            self._last_end = now
            self._quorum_wait = self._coll_total = self._heal_s = 0.0
            self._heal_bytes = 0
            self._heal_source = self._heal_addr = ""
        if not self.enabled:
            return
        busy = max(0.0, step_s - quorum_wait - collective - should_commit_s)
        self._send(
            phase="step",
            step=step,
            quorum_id=quorum_id,
            participants=participants,
            committed=committed,
            healed=healed,
            step_s=step_s,
            quorum_wait_s=quorum_wait,
            collective_s=collective,
            should_commit_s=should_commit_s,
            busy_s=busy,
            heal_s=heal_s,
            heal_bytes=heal_bytes,
            heal_source=heal_source,
            heal_addr=heal_addr,
            error=error[:MAX_ERROR_CHARS] if error else "",
            rank=rank,
        )

    # ------------------------------------------------------------------ snapshots

    def snapshot_done(
        self,
        step: int,
        path: str,
        *,
        stage_s: float,
        write_s: float,
        tensor_bytes: int,
        quorum_id: int,
    ) -> None:
        """Reports a complete durable snapshot of committed step ``step`` (its manifest is
        written); the lighthouse records the newest one."""
        self._send(
            phase="snapshot",
            step=step,
            quorum_id=quorum_id,
            snapshot_path=_truncate_utf8(path, MAX_PATH_BYTES),
            snapshot_stage_s=max(0.0, stage_s),
            snapshot_write_s=max(0.0, write_s),
            snapshot_bytes=max(0, tensor_bytes),
        )

    def flush(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the queued reports to reach the lighthouse
        (call off the training thread; never raises)."""
        if not self.enabled:
            return
        try:
            self._client._telemetry_flush(timeout=timedelta(seconds=timeout))
        except Exception as e:
            logger.debug("telemetry flush failed: %s", e)

    def snapshot_failed(self, step: int, path: str, error: str) -> None:
        """Reports a durable snapshot of step ``step`` that failed (``error`` says why)."""
        self._send(
            phase="snapshot_failed",
            step=step,
            snapshot_path=_truncate_utf8(path, MAX_PATH_BYTES),
            error=error[:MAX_ERROR_CHARS],
        )

    # ------------------------------------------------------------------ lifecycle

    def finish(self, error: BaseException | None, step: int = 0) -> None:
        """Reports the rank's end (``finished``, or ``failed`` with ``error``) and flushes.

        Idempotent; bounded by :data:`FINAL_FLUSH_S`.
        """
        if self._finished:
            return
        self._finished = True
        _live.discard(self)
        if not self.enabled:
            return
        if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
            self._send(phase="finished", step=step)
        else:
            text = f"{type(error).__name__}: {error}"
            self._send(phase="failed", step=step, error=text[:MAX_ERROR_CHARS])
        try:
            self._client._telemetry_flush(timeout=timedelta(seconds=FINAL_FLUSH_S))
        except Exception as e:
            logger.debug("telemetry flush failed: %s", e)

    def _send(self, **fields: Any) -> None:
        if not self.enabled:
            return
        try:
            self._client.report(**self._sender, unix_s=time.time(), **fields)
        except Exception as e:  # fail-open: telemetry never breaks training
            self.failed_sends += 1
            if self.failed_sends == 1:
                logger.warning("telemetry report not queued (further failures at debug): %s", e)
            else:
                logger.debug("telemetry report not queued: %s", e)
