"""Per-step telemetry of one rank: where the step's time went, reported fail-open.

Each rank measures, per step, the wall time since the previous step ended and the parts of it
spent blocked on the quorum (healing included), with a collective in flight, and in the commit
vote; the rest is its *busy* time, which the lighthouse compares across replica groups to find
stragglers. One report per step goes to the native client's bounded queue (a call that never
waits for the network); the manager server forwards the reports to the lighthouse in batches.
A full queue drops reports and counts them; nothing here raises into training.

Where the busy time went is measured from the hooks torchft owns, on the training thread
(:func:`forward_done` in the DDP wrapper, :func:`backward_ended` and
:func:`optimizer_done` in the optimizer wrapper): the input time before the first forward
(data loading and user code outside torchft), the forward passes, the backward (from the
last forward to the optimizer step) and the optimizer's own step, beside the process's CPU
seconds and resident memory (and, sampled once a second by :mod:`torchft.system_metrics`,
the host's load, memory, network throughput and CPU steal and the GPU's utilisation and
memory). The lighthouse names a straggler's cause from
them (docs/telemetry.md). A script that uses neither wrapper reports the phases as 0.

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
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from torchft.config import env_flag
from torchft.system_metrics import HostSampler

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


class _StepClock(threading.local):
    """The training thread's phase marks of the current step (one per thread: groups that
    train in threads of one process keep theirs apart)."""

    def __init__(self) -> None:
        self.first_forward: float | None = None
        self.last_forward_end = 0.0
        self.forward_s = 0.0
        self.backward_end: float | None = None
        # The optimizer's step runs after the vote, so after the step's report: the next
        # report carries it.
        self.optimizer_s = 0.0

    def take(self) -> tuple[float | None, float, float, float | None, float]:
        out = (
            self.first_forward,
            self.last_forward_end,
            self.forward_s,
            self.backward_end,
            self.optimizer_s,
        )
        self.first_forward, self.backward_end = None, None
        self.last_forward_end = self.forward_s = self.optimizer_s = 0.0
        return out


_clock = _StepClock()


def forward_done(t0: float) -> None:
    """Counts the time since ``t0`` (``time.perf_counter()``) as a forward pass of the current
    step (the DDP wrapper's forward)."""
    t1 = time.perf_counter()
    c = _clock
    if c.first_forward is None:
        c.first_forward = t0
    c.last_forward_end = t1
    c.forward_s += t1 - t0


def backward_ended() -> None:
    """Marks the end of the step's backward: the optimizer wrapper's step was entered."""
    c = _clock
    if c.backward_end is None:
        c.backward_end = time.perf_counter()


def optimizer_done(t0: float) -> None:
    """Counts the time since ``t0`` as the wrapped optimizer's own step."""
    _clock.optimizer_s += time.perf_counter() - t0


def _overlap(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``spans`` inside ``[lo, hi]``."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


class _Process:
    """This process's CPU seconds and resident memory, read per step (the lighthouse names a
    memory-growing straggler from 8 reports)."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._statm: int | None = None
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            pass  # not Linux: resident memory is reported as 0
        self._cpu = time.process_time()

    def sample(self) -> tuple[float, int]:
        """CPU seconds since the previous sample, resident bytes."""
        cpu = time.process_time()
        cpu_s, self._cpu = max(0.0, cpu - self._cpu), cpu
        rss = 0
        if self._statm is not None:
            try:
                rss = int(os.pread(self._statm, 128, 0).split()[1]) * self._page
            except (OSError, ValueError, IndexError):
                rss = 0
        return cpu_s, rss

    def close(self) -> None:
        fd, self._statm = self._statm, None
        if fd is not None:
            os.close(fd)


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


class StepRecord(NamedTuple):
    """What a rank measured of its last step (:attr:`RankTelemetry.last_step`)."""

    #: The committed step count before the step.
    step: int
    committed: bool
    #: Seconds since the previous step ended.
    step_s: float
    #: Seconds of it blocked on the quorum.
    quorum_wait_s: float
    #: When it ended, as wall-clock unix seconds: the boundary its ``step_s`` and the next
    #: step's are measured from.
    ended_unix_s: float


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
        # The building thread (the training thread) may hold marks of an earlier Manager:
        # its last optimizer step runs after that Manager's last report, and has no time
        # stamp to tell it from this Manager's.
        _clock.take()
        self._quorum_wait = 0.0
        # The step's quorum waits as (start, end), to take them out of the phases they fall in.
        self._quorum_spans: list[tuple[float, float]] = []
        # ... and its spans with a collective in flight (a backward waiting on them is
        # communication, not compute).
        self._coll_spans: list[tuple[float, float]] = []
        self._process = _Process()
        self._host = HostSampler()
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
        #: The last step's record, None before one.
        self.last_step: StepRecord | None = None
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
            t1 = time.perf_counter()
            with self._lock:
                self._quorum_wait += t1 - t0
                if len(self._quorum_spans) < 64:
                    self._quorum_spans.append((t0, t1))

    def step_quorum_wait(self) -> float | None:
        """The time blocked on the quorum in the step so far (None when disabled)."""
        if not self.enabled:
            return None
        with self._lock:
            return self._quorum_wait

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
                if len(self._coll_spans) < 64:
                    self._coll_spans.append((self._coll_since, now))

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
        now, ended_unix = time.perf_counter(), time.time()
        first_fwd, last_fwd_end, forward_s, backward_end, optimizer_s = _clock.take()
        with self._lock:
            if self._outstanding:
                self._coll_total += now - self._coll_since
                self._coll_spans.append((self._coll_since, now))
                self._outstanding = 0
            self._gen += 1
            started = self._last_end
            step_s = now - started
            quorum_wait, collective = self._quorum_wait, self._coll_total
            spans, self._quorum_spans = self._quorum_spans, []
            coll_spans, self._coll_spans = self._coll_spans, []
            heal_s, heal_bytes = self._heal_s, self._heal_bytes
            heal_source, heal_addr = self._heal_source, self._heal_addr
            self._last_end = now
            self._quorum_wait = self._coll_total = self._heal_s = 0.0
            self._heal_bytes = 0
            self._heal_source = self._heal_addr = ""
        self.last_step = StepRecord(step, committed, step_s, quorum_wait, ended_unix)
        if not self.enabled:
            return
        busy = max(0.0, step_s - quorum_wait - collective - should_commit_s)
        if first_fwd is not None and first_fwd < started:
            # The thread's first forward mark predates this step: it holds marks of something
            # that never reported them (a Manager of another thread's making, a forward
            # outside any step), mixed with this step's own. Which are which is lost, so the
            # step reports no phases rather than wrong ones (its busy time stands).
            first_fwd = None
        input_s = backward_s = 0.0
        if first_fwd is not None:
            # Before the first forward: the previous step's optimizer step, the quorum wait
            # (zero_grad starts the quorum) and the rest (input, user code).
            input_s = max(
                0.0, first_fwd - started - _overlap(spans, started, first_fwd) - optimizer_s
            )
            if backward_end is not None and backward_end >= last_fwd_end:
                # Less the quorum wait (async quorum) and the time with a collective in
                # flight: DDP's backward ends waiting for the gradients' allreduce, which
                # waits for the slowest group.
                waits = _overlap(spans + coll_spans, last_fwd_end, backward_end)
                backward_s = max(0.0, backward_end - last_fwd_end - waits)
        cpu_s, rss = self._process.sample()
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
            input_s=input_s,
            forward_s=forward_s if first_fwd is not None else 0.0,
            backward_s=backward_s,
            optimizer_s=optimizer_s if first_fwd is not None else 0.0,
            cpu_s=cpu_s,
            rss_bytes=rss,
            **self._host.sample(),
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
        self._process.close()
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
