"""Post-mortem summary of a lighthouse event log.

The lighthouse, started with ``--event_log PATH``, appends one JSON object per line to
``PATH``: every event has ``seq``, ``ts`` (unix seconds) and ``kind`` plus kind-specific
fields (see ``docs/telemetry.md``). This module reads such a log and condenses it into what a
post-mortem needs: when things happened, how often the quorum changed, and for every replica
group its state transitions, how long it was down, what it healed and the first error it saw.

Run it as::

    python -m torchft.eventlog PATH [--json] [--replica ID]
    python -m torchft.eventlog PATH --html [OUT_DIR] [--job NAME]

The second form writes the end-of-run report, ``summary.json`` and ``summary.html``, as the
lighthouse does when the job ends (built by :mod:`torchft.run_summary`).

The module itself only needs the standard library (the ``torchft`` package it lives in
imports torch, so ``python -m`` does too; the file can also be loaded on its own).

Rules the summary follows, so that its numbers are reproducible:

* Events are taken in file order; ``seq`` and ``ts`` are validated but never used to reorder.
* A replica's state durations are measured between its consecutive ``state_changed``
  events. The interval after its last one runs to the ``ts`` of the last event in the log.
  Negative intervals (a clock that went backwards) count as zero.
* A ``lighthouse_started`` event after the first event of the log means the lighthouse
  restarted: every replica's open interval is closed at the ``ts`` of the event just before
  the restart and its state is unknown until its next ``state_changed``.
* Downtime is time spent in ``lost``, ``joining`` or ``healing`` that ends with a return to
  ``healthy`` (or ``straggler``, which is healthy but slow). Time in those states before a
  replica was first healthy is start-up (``startup_s``), and time in them at the end of the
  log without a return is ``down_at_end_s``; neither counts as downtime.
* The latest snapshot is the ``snapshot_complete`` event with the highest ``step`` (the first
  one seen on a tie), as the lighthouse records it. A snapshot's ``step`` is the step it
  holds, reported when its write ends, so it never moves a replica's ``last_step``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, TypeGuard

__all__ = ["read_events", "summarize", "format_summary", "main"]

#: Kinds whose events concern one replica group and must name it with ``replica_id``.
REPLICA_KINDS: frozenset[str] = frozenset(
    {
        "replica_joined",
        "state_changed",
        "replica_lost",
        "replica_healed",
        "commit_failed",
        "straggler_flagged",
        "straggler_cleared",
        "replica_failed",
        "replica_finished",
        "kill_requested",
        "replica_hung",
        "replica_resumed",
        "replica_diverged",
        "straggler_dropped",
        "snapshot_complete",
        "snapshot_failed",
    }
)

#: Kinds whose ``step`` is not the replica's progress (a snapshot holds an earlier step).
_NOT_PROGRESS: frozenset[str] = frozenset({"snapshot_complete", "snapshot_failed"})

#: Every kind the lighthouse writes (checked against the native list in the tests).
KINDS: frozenset[str] = REPLICA_KINDS | {
    "lighthouse_started",
    "quorum_changed",
    "progress_regressed",
    "goodput",
}

#: A ``goodput`` event's time accounts (seconds, cumulative since the job's first committed
#: step), at the job level and per group; ``wall_s`` is the sum of the others.
GOODPUT_ACCOUNTS: tuple[str, ...] = (
    "wall_s",
    "productive_s",
    "quorum_s",
    "discarded_s",
    "heal_s",
    "recovery_s",
    "regressed_s",
)

#: A ``goodput`` event's counters, at the job level and per group.
GOODPUT_COUNTS: tuple[str, ...] = ("step", "regressed_steps", "steps_committed")

#: Of those, the ones that may be null (the job's best step, before any group reported one).
_NULLABLE: frozenset[str] = frozenset({"step"})

#: The step phases a ``goodput`` event sums per group (``phases``), in step order.
GOODPUT_PHASES: tuple[str, ...] = (
    "input_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "collective_s",
    "quorum_wait_s",
    "should_commit_s",
)

#: States in which a replica group is not contributing to training.
DOWN_STATES: frozenset[str] = frozenset({"lost", "joining", "healing"})

#: States in which a replica group is in the quorum and committing.
UP_STATES: frozenset[str] = frozenset({"healthy", "straggler"})

_MAX_WARNINGS = 10


def _reject_constant(name: str) -> Any:
    """Refuses the non-standard JSON constants ``NaN``, ``Infinity`` and ``-Infinity``.

    Args:
        name: The constant the decoder met.

    Raises:
        ValueError: Always.
    """
    raise ValueError(f"non-standard JSON constant {name}")


def _is_number(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite JSON number (booleans are not numbers here).

    Args:
        value: Any decoded JSON value.

    Returns:
        True for finite ints and floats.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value)


def _check_goodput_fields(obj: dict[str, Any]) -> str | None:
    """Validates the accounts, counters and ratio a ``goodput`` event and each of its groups
    carry.

    Args:
        obj: The event, or one entry of its ``groups``.

    Returns:
        ``None`` when they are usable, else why not.
    """
    for name in (*GOODPUT_ACCOUNTS, *GOODPUT_COUNTS):
        if name not in obj:
            return f"missing '{name}'"
        if not _is_number(obj[name]) and not (name in _NULLABLE and obj[name] is None):
            return f"'{name}' is not a number"
    for name in ("ratio", "window_start_unix_s"):
        if obj.get(name) is not None and not _is_number(obj[name]):
            return f"'{name}' is not a number or null"
    return None


def _check_goodput(obj: dict[str, Any]) -> str | None:
    """Validates a ``goodput`` event beyond the fields every event has.

    Args:
        obj: The decoded event.

    Returns:
        ``None`` when the event is usable, else why it is skipped.
    """
    reason = _check_goodput_fields(obj)
    if reason is not None:
        return reason
    if not isinstance(obj.get("final", False), bool):
        return "'final' is not a boolean"
    if not isinstance(obj.get("job", ""), str):
        return "'job' is not a string"
    omitted = obj.get("groups_omitted", 0)
    if isinstance(omitted, bool) or not isinstance(omitted, int) or omitted < 0:
        return "'groups_omitted' is not a non-negative integer"
    groups = obj.get("groups")
    if groups is None:
        return None
    if not isinstance(groups, list):
        return "'groups' is not a list"
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            return f"groups[{i}] is not an object"
        replica_id = group.get("replica_id")
        if not isinstance(replica_id, str) or not replica_id:
            return f"groups[{i}]: 'replica_id' is not a non-empty string"
        if group.get("state") is not None and not isinstance(group["state"], str):
            return f"groups[{i}]: 'state' is not a string"
        reason = _check_goodput_fields(group)
        if reason is not None:
            return f"groups[{i}]: {reason}"
        phases = group.get("phases", {})
        if not isinstance(phases, dict):
            return f"groups[{i}]: 'phases' is not an object"
        for name in GOODPUT_PHASES:
            if name in phases and not _is_number(phases[name]):
                return f"groups[{i}]: phase '{name}' is not a number"
    return None


def _check_event(obj: Any) -> str | None:
    """Validates one decoded line.

    Args:
        obj: The decoded JSON value of the line.

    Returns:
        ``None`` when the line is a usable event, else why it is skipped.
    """
    if not isinstance(obj, dict):
        return "not a JSON object"
    if "kind" not in obj:
        return "missing 'kind'"
    if not isinstance(obj["kind"], str) or not obj["kind"]:
        return "'kind' is not a non-empty string"
    if "seq" not in obj:
        return "missing 'seq'"
    if isinstance(obj["seq"], bool) or not isinstance(obj["seq"], int):
        return "'seq' is not an integer"
    if "ts" not in obj:
        return "missing 'ts'"
    if not _is_number(obj["ts"]):
        return "'ts' is not a number"
    if obj["kind"] in REPLICA_KINDS:
        if "replica_id" not in obj:
            return f"missing 'replica_id' ({obj['kind']})"
        if not isinstance(obj["replica_id"], str) or not obj["replica_id"]:
            return f"'replica_id' is not a non-empty string ({obj['kind']})"
    if obj["kind"] == "goodput":
        reason = _check_goodput(obj)
        if reason is not None:
            return f"{reason} (goodput)"
    return None


def read_events(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Reads a lighthouse event log.

    Every non-blank line must be a JSON object with an integer ``seq``, a numeric ``ts`` and a
    string ``kind``; events about a replica group must also carry a string ``replica_id``, and
    a ``goodput`` event numbers for its accounts and counters (also in each of its ``groups``).
    Lines that do not are skipped and reported. A last line that has no trailing newline and
    does not parse is reported as truncated (the lighthouse died while writing it).

    Args:
        path: The log file.

    Returns:
        The events in file order, and one message per skipped line, such as
        ``"line 7: not JSON"``.

    Raises:
        OSError: The file cannot be opened or read (missing, a directory, no permission).
    """
    events: list[dict[str, Any]] = []
    problems: list[str] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            truncated = not raw.endswith(b"\n")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                problems.append(
                    f"line {lineno}: truncated (no newline at end of file)"
                    if truncated
                    else f"line {lineno}: not UTF-8"
                )
                continue
            try:
                obj = json.loads(text, parse_constant=_reject_constant)
            except ValueError:
                problems.append(
                    f"line {lineno}: truncated (no newline at end of file)"
                    if truncated
                    else f"line {lineno}: not JSON"
                )
                continue
            reason = _check_event(obj)
            if reason is not None:
                problems.append(f"line {lineno}: {reason}")
                continue
            events.append(obj)
    return events, problems


def _seconds(value: float) -> float:
    """Rounds a duration to microseconds so float noise does not show in the summary.

    Args:
        value: Seconds.

    Returns:
        ``value`` rounded to 6 decimals, never negative zero.
    """
    return round(value, 6) + 0.0


def _new_replica(replica_id: str) -> dict[str, Any]:
    """The initial per-replica record of :func:`summarize`.

    Args:
        replica_id: The replica group's id.

    Returns:
        A record with every counter at zero.
    """
    return {
        "replica_id": replica_id,
        "incarnations": 0,
        "last_incarnation": None,
        "hostname": None,
        "lost": 0,
        "heals": 0,
        "heal_bytes": 0,
        "heal_s": 0.0,
        "heal_sources": {},
        "commit_failures": 0,
        "straggler_flags": 0,
        "straggler_clears": 0,
        "failures": 0,
        "finished": False,
        "final_state": None,
        "last_step": None,
        "transitions": [],
        "time_in_state_s": {},
        "downtime_s": 0.0,
        "recoveries": 0,
        "startup_s": 0.0,
        "down_at_end_s": 0.0,
        "first_error": None,
        "snapshots": 0,
        "snapshot_failures": 0,
    }


class _StateClock:
    """Accumulates one replica's time per state and its down episodes.

    Attributes:
        state: The current state, ``None`` while unknown.
        since: When the current state was entered.
        time_in_state: Seconds per state over closed intervals.
        ever_up: Whether the replica has been ``healthy``/``straggler`` at least once.
        went_down: Whether it entered a down state since it was last up.
        pending_down: Seconds in down states since it was last up.
        downtime: Seconds in down states of episodes that ended with a return to up.
        recoveries: Number of such episodes.
        startup: Seconds in down states before it was first up.
    """

    def __init__(self) -> None:
        """Starts with an unknown state and nothing measured."""
        self.state: str | None = None
        self.since = 0.0
        self.time_in_state: dict[str, float] = {}
        self.ever_up = False
        self.went_down = False
        self.pending_down = 0.0
        self.downtime = 0.0
        self.recoveries = 0
        self.startup = 0.0

    def close(self, ts: float) -> None:
        """Ends the current interval at ``ts`` and leaves the state unknown.

        Args:
            ts: When the interval ends; an earlier time than its start counts as zero.
        """
        if self.state is not None:
            spent = max(0.0, ts - self.since)
            self.time_in_state[self.state] = self.time_in_state.get(self.state, 0.0) + spent
            if self.state in DOWN_STATES:
                self.pending_down += spent
        self.state = None

    def enter(self, state: str, ts: float) -> None:
        """Records a transition into ``state`` at ``ts``.

        Args:
            state: The new state.
            ts: When the replica entered it.
        """
        self.close(ts)
        if state in UP_STATES:
            if not self.ever_up:
                self.startup = self.pending_down
                self.ever_up = True
            elif self.went_down:
                self.downtime += self.pending_down
                self.recoveries += 1
            self.pending_down = 0.0
            self.went_down = False
        elif state in DOWN_STATES:
            self.went_down = True
        self.state = state
        self.since = ts

    def finish(self, last_ts: float) -> None:
        """Closes the open interval at the end of the log.

        Down time not followed by a return to up stays in ``pending_down``; for a replica
        that was never up it is start-up time.

        Args:
            last_ts: The ``ts`` of the last event in the log.
        """
        self.close(last_ts)
        if not self.ever_up:
            self.startup = self.pending_down
            self.pending_down = 0.0


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Condenses events (as returned by :func:`read_events`) into a post-mortem summary.

    Args:
        events: Events in file order; any that :func:`read_events` would skip are ignored.

    Returns:
        A JSON-serialisable dict with ``first_ts``, ``last_ts``, ``duration_s``, ``events``
        (count), ``kinds`` (count per kind, sorted), ``lighthouse_starts``,
        ``quorum_changes``, ``first_quorum_id``, ``last_quorum_id``, ``min_participants``,
        ``max_participants``, ``snapshots`` (``snapshot_complete`` events),
        ``snapshot_failures`` (``snapshot_failed`` events), ``latest_snapshot`` (``ts``,
        ``step``, ``replica_id``, ``path``, ``bytes`` of the complete snapshot with the
        highest step, or ``None``) and ``replicas``: one record per ``replica_id``, sorted by id,
        with ``incarnations``, ``last_incarnation``, ``hostname``, ``lost``, ``heals``,
        ``heal_bytes``, ``heal_s``, ``heal_sources`` (heals per source group),
        ``commit_failures``, ``straggler_flags``,
        ``straggler_clears``, ``failures``, ``finished``, ``final_state``, ``last_step``,
        ``transitions`` (``ts``, ``from``, ``to``, ``reason``, ``step``), ``time_in_state_s``,
        ``downtime_s``, ``recoveries``, ``startup_s``, ``down_at_end_s``, ``first_error``
        (``ts``, ``kind``, ``step``, ``error``, or ``None``), ``snapshots`` and
        ``snapshot_failures`` (those it wrote and failed). Times without events are
        ``None``.
    """
    events = [event for event in events if _check_event(event) is None]
    kinds: dict[str, int] = {}
    replicas: dict[str, dict[str, Any]] = {}
    clocks: dict[str, _StateClock] = {}
    lighthouse_starts = 0
    quorum_changes = 0
    first_quorum_id: Any = None
    last_quorum_id: Any = None
    participant_counts: list[int] = []
    snapshots = 0
    snapshot_failures = 0
    latest_snapshot: dict[str, Any] | None = None
    prev_ts: float | None = None

    for event in events:
        kind: str = event["kind"]
        ts = float(event["ts"])
        kinds[kind] = kinds.get(kind, 0) + 1

        if kind == "lighthouse_started":
            lighthouse_starts += 1
            if prev_ts is not None:
                for clock in clocks.values():
                    clock.close(prev_ts)
        elif kind == "quorum_changed":
            quorum_changes += 1
            if quorum_changes == 1:
                first_quorum_id = event.get("quorum_id")
            last_quorum_id = event.get("quorum_id")
            participants = event.get("participants")
            if isinstance(participants, list):
                participant_counts.append(len(participants))

        replica_id = event.get("replica_id")
        if kind in REPLICA_KINDS and isinstance(replica_id, str):
            rec = replicas.get(replica_id)
            if rec is None:
                rec = replicas[replica_id] = _new_replica(replica_id)
                clocks[replica_id] = _StateClock()
            step = event.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                if kind not in _NOT_PROGRESS:
                    rec["last_step"] = step
            else:
                step = None

            if kind == "replica_joined":
                rec["incarnations"] += 1
                rec["last_incarnation"] = event.get("incarnation", rec["last_incarnation"])
                rec["hostname"] = event.get("hostname", rec["hostname"])
            elif kind == "state_changed":
                to = event.get("to")
                rec["transitions"].append(
                    {
                        "ts": ts,
                        "from": event.get("from"),
                        "to": to,
                        "reason": event.get("reason"),
                        "step": step,
                    }
                )
                if isinstance(to, str):
                    rec["final_state"] = to
                    clocks[replica_id].enter(to, ts)
                else:
                    clocks[replica_id].close(ts)
                    rec["final_state"] = None
            elif kind == "replica_lost":
                rec["lost"] += 1
            elif kind == "replica_healed":
                rec["heals"] += 1
                heal_bytes = event.get("heal_bytes")
                if _is_number(heal_bytes):
                    rec["heal_bytes"] += int(heal_bytes)
                heal_s = event.get("heal_s")
                if _is_number(heal_s):
                    rec["heal_s"] += float(heal_s)
                source = event.get("source")
                if isinstance(source, str) and source:
                    rec["heal_sources"][source] = rec["heal_sources"].get(source, 0) + 1
            elif kind == "commit_failed":
                rec["commit_failures"] += 1
            elif kind == "straggler_flagged":
                rec["straggler_flags"] += 1
            elif kind == "straggler_cleared":
                rec["straggler_clears"] += 1
            elif kind == "replica_failed":
                rec["failures"] += 1
            elif kind == "replica_finished":
                rec["finished"] = True
            elif kind == "snapshot_complete":
                snapshots += 1
                rec["snapshots"] += 1
                if step is not None and (latest_snapshot is None or step > latest_snapshot["step"]):
                    latest_snapshot = {
                        "ts": ts,
                        "step": step,
                        "replica_id": replica_id,
                        "path": event.get("path"),
                        "bytes": event.get("bytes"),
                    }
            elif kind == "snapshot_failed":
                snapshot_failures += 1
                rec["snapshot_failures"] += 1

            error = event.get("error")
            if kind in ("commit_failed", "replica_failed") and error not in (None, ""):
                if rec["first_error"] is None:
                    rec["first_error"] = {
                        "ts": ts,
                        "kind": kind,
                        "step": step,
                        "error": str(error),
                    }
        prev_ts = ts

    last_ts = prev_ts
    for replica_id, rec in replicas.items():
        clock = clocks[replica_id]
        if last_ts is not None:
            clock.finish(last_ts)
        rec["time_in_state_s"] = {
            state: _seconds(seconds) for state, seconds in sorted(clock.time_in_state.items())
        }
        rec["downtime_s"] = _seconds(clock.downtime)
        rec["recoveries"] = clock.recoveries
        rec["startup_s"] = _seconds(clock.startup)
        rec["down_at_end_s"] = _seconds(clock.pending_down)
        rec["heal_s"] = _seconds(rec["heal_s"])

    first_ts = float(events[0]["ts"]) if events else None
    return {
        "first_ts": first_ts,
        "last_ts": last_ts,
        "duration_s": (
            _seconds(max(0.0, last_ts - first_ts))
            if first_ts is not None and last_ts is not None
            else None
        ),
        "events": len(events),
        "kinds": dict(sorted(kinds.items())),
        "lighthouse_starts": lighthouse_starts,
        "quorum_changes": quorum_changes,
        "first_quorum_id": first_quorum_id,
        "last_quorum_id": last_quorum_id,
        "min_participants": min(participant_counts) if participant_counts else None,
        "max_participants": max(participant_counts) if participant_counts else None,
        "snapshots": snapshots,
        "snapshot_failures": snapshot_failures,
        "latest_snapshot": latest_snapshot,
        "replicas": {rid: replicas[rid] for rid in sorted(replicas)},
    }


#: Formats of :func:`_utc_ms`: a time of day, and a date and time.
_CLOCK = "%H:%M:%S"
_STAMP = "%Y-%m-%d %H:%M:%S"


def _utc_ms(ts: float, fmt: str) -> str:
    """Formats a unix time in UTC with milliseconds, e.g. ``HH:MM:SS.mmm``.

    Rounds to the nearest millisecond first so ``.123`` never shows as ``.122``.

    Args:
        ts: Unix seconds.
        fmt: ``strftime`` format of the whole seconds (:data:`_CLOCK`, :data:`_STAMP`).

    Returns:
        The formatted time, then ``.`` and the milliseconds.
    """
    whole, ms = divmod(math.floor(ts * 1000.0 + 0.5), 1000)
    return f"{datetime.fromtimestamp(whole, tz=timezone.utc):{fmt}}.{ms:03d}"


def _bytes(n: int) -> str:
    """Formats a byte count exactly and in binary units.

    Args:
        n: Bytes.

    Returns:
        For example ``"1048576 bytes (1.0 MiB)"``.
    """
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "PiB":
            return f"{n} bytes ({value:.1f} {unit})"
    raise AssertionError("unreachable")


def _one_line(text: str, limit: int = 200) -> str:
    """Shortens a possibly multi-line message (a traceback) to its first line.

    Args:
        text: The message.
        limit: The most characters to keep.

    Returns:
        The first non-blank line, cut at ``limit`` characters; ``...`` marks a cut.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    cut = len(lines) > 1 or len(first) > limit
    return first[:limit] + (" ..." if cut else "")


def _plural(n: int, word: str, plural: str | None = None) -> str:
    """``"1 word"`` or ``"n words"``.

    Args:
        n: The count.
        word: The singular noun.
        plural: The plural noun when it is not ``word + "s"``.

    Returns:
        The count with the noun.
    """
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"


def format_summary(summary: dict[str, Any]) -> str:
    """Renders a :func:`summarize` result as a plain-text report.

    The report has one header block for the whole log and one block per replica group.
    Times are UTC; transitions are listed as ``HH:MM:SS.mmm  from -> to (reason)``;
    durations are in seconds with one decimal.

    Args:
        summary: The result of :func:`summarize` (possibly with fewer replicas).

    Returns:
        The report, ending with a newline.
    """
    lines: list[str] = ["torchft event log summary"]
    if summary["first_ts"] is None:
        lines.append("  no events")
        return "\n".join(lines) + "\n"
    first, last = _utc_ms(summary["first_ts"], _STAMP), _utc_ms(summary["last_ts"], _STAMP)
    lines.append(f"  span         {first} -> {last} UTC ({summary['duration_s']:.1f}s)")
    lines.append(f"  events       {summary['events']}")
    lines.append(f"  lighthouse   {_plural(summary['lighthouse_starts'], 'start')}")
    if summary["quorum_changes"]:
        lo, hi = summary["min_participants"], summary["max_participants"]
        if lo is None:
            span = "participants unknown"
        elif lo == hi:
            span = f"{lo} participants"
        else:
            span = f"{lo}-{hi} participants"
        lines.append(
            f"  quorums      {_plural(summary['quorum_changes'], 'change')},"
            f" id {summary['first_quorum_id']} -> {summary['last_quorum_id']}, {span}"
        )
    else:
        lines.append("  quorums      0 changes")
    latest = summary.get("latest_snapshot")
    failed = summary.get("snapshot_failures", 0)
    if latest is not None or summary.get("snapshots", 0) or failed:
        newest = ""
        if latest is not None:
            path = latest.get("path")
            where = f"{latest['replica_id']}, {path}" if path else latest["replica_id"]
            newest = f", latest step {latest['step']} ({where})"
        lines.append(
            f"  snapshots    {summary.get('snapshots', 0)} complete{newest}, {failed} failed"
        )
    replicas: dict[str, dict[str, Any]] = summary["replicas"]
    names = ", ".join(replicas) if replicas else "none"
    lines.append(f"  replicas     {len(replicas)}: {names}")

    for rid, rec in replicas.items():
        lines.append("")
        lines.append(f"replica {rid}")
        lines.append(f"  final state      {rec['final_state'] or 'unknown'}")
        incarnation = f" (last {rec['last_incarnation']})" if rec["last_incarnation"] else ""
        lines.append(f"  incarnations     {rec['incarnations']}{incarnation}")
        if rec["hostname"]:
            lines.append(f"  hostname         {rec['hostname']}")
        lines.append(f"  times lost       {rec['lost']}")
        if rec["heals"]:
            lines.append(
                f"  heals            {rec['heals']}, {_bytes(rec['heal_bytes'])},"
                f" {rec['heal_s']:.1f}s"
            )
            if rec["heal_sources"]:
                sources = ", ".join(f"{k} x{v}" for k, v in sorted(rec["heal_sources"].items()))
                lines.append(f"  healed from      {sources}")
        else:
            lines.append("  heals            0")
        lines.append(f"  commit failures  {rec['commit_failures']}")
        lines.append(
            f"  straggler        flagged {rec['straggler_flags']},"
            f" cleared {rec['straggler_clears']}"
        )
        lines.append(
            f"  downtime         {rec['downtime_s']:.1f}s"
            f" over {_plural(rec['recoveries'], 'recovery', 'recoveries')}"
        )
        if rec["startup_s"]:
            lines.append(f"  start-up         {rec['startup_s']:.1f}s")
        if rec["down_at_end_s"]:
            lines.append(f"  down at end      {rec['down_at_end_s']:.1f}s (not recovered)")
        if rec["failures"]:
            lines.append(f"  failures         {rec['failures']}")
        if rec["finished"]:
            lines.append("  finished         yes")
        if rec["last_step"] is not None:
            lines.append(f"  last step        {rec['last_step']}")
        if rec.get("snapshots") or rec.get("snapshot_failures"):
            lines.append(
                f"  snapshots        {rec.get('snapshots', 0)} written,"
                f" {rec.get('snapshot_failures', 0)} failed"
            )
        err = rec["first_error"]
        if err is not None:
            step = f" step {err['step']}" if err["step"] is not None else ""
            lines.append(
                f"  first error      {_utc_ms(err['ts'], _CLOCK)} {err['kind']}{step}:"
                f" {_one_line(err['error'])}"
            )
        if rec["time_in_state_s"]:
            spent = ", ".join(f"{s} {sec:.1f}s" for s, sec in rec["time_in_state_s"].items())
            lines.append(f"  time in state    {spent}")
        if rec["transitions"]:
            lines.append("  transitions")
            for t in rec["transitions"]:
                reason = f" ({t['reason']})" if t["reason"] else ""
                lines.append(
                    f"    {_utc_ms(t['ts'], _CLOCK)}  {t['from'] or '-'} -> {t['to'] or '-'}{reason}"
                )
    return "\n".join(lines) + "\n"


def _main_html(
    path: str, events: list[dict[str, Any]], problems: list[str], out_dir: str, job: str | None
) -> int:
    """Writes the end-of-run report of ``--html``: ``summary.json`` and ``summary.html``
    (``summary-JOB.*`` for a named job's room, as the lighthouse names them).

    Args:
        path: The event log (for messages, and the default output directory).
        events: Its events.
        problems: The lines :func:`read_events` skipped.
        out_dir: The directory to write to; empty for the log's own directory.
        job: The room to report (``--job``), or ``None`` to let the log decide.

    Returns:
        0 when both files were written, 2 when there is nothing to report or the report cannot
        be written (nothing is left behind then).
    """
    # Imported here: the report needs the torchft package (its template ships in it), while
    # the rest of this module also runs on its own.
    from torchft.run_summary import jobs_in, render_html, run_summary, write_report

    if not events:
        what = (
            f"no valid events ({_plural(len(problems), 'line')} skipped)"
            if problems
            else "empty log (no events)"
        )
        print(f"error: {path}: {what}, nothing to report", file=sys.stderr)
        return 2
    jobs = jobs_in(events)
    if job is not None and job not in jobs:
        known = ", ".join(repr(j) for j in jobs) or "none"
        print(f"error: unknown job {job!r}; jobs in the log: {known}", file=sys.stderr)
        return 2
    directory = out_dir or os.path.dirname(path) or "."
    summary = run_summary(events, job=job)
    if job is None and len(jobs) > 1:
        others = ", ".join(repr(j) for j in jobs)
        print(
            f"note: {path} holds the jobs {others}; reporting {summary['job']!r} (pick one"
            " with --job)",
            file=sys.stderr,
        )
    try:
        written = write_report(summary, render_html(summary), directory)
    except ValueError as e:  # a job name no file can carry
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError:
        print(f"error: {directory}: no such directory", file=sys.stderr)
        return 2
    except NotADirectoryError:
        print(f"error: {directory}: not a directory", file=sys.stderr)
        return 2
    except PermissionError:
        print(f"error: {directory}: permission denied, cannot write the report", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {directory}: cannot write the report: {e.strerror or e}", file=sys.stderr)
        return 2
    for written_path in written:
        print(written_path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point::

        python -m torchft.eventlog PATH [--json] [--replica ID]
        python -m torchft.eventlog PATH --html [OUT_DIR] [--job NAME]

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 on success (also for an empty log, except with ``--html``), 2 when the log cannot be
        read, ``--replica`` names an unknown replica group, or ``--html`` has nothing to
        report or cannot write it.
    """
    parser = argparse.ArgumentParser(
        prog="python -m torchft.eventlog",
        description="Summarise a torchft lighthouse event log (--event_log) for a post-mortem.",
    )
    parser.add_argument("path", metavar="PATH", help="event log written by the lighthouse")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--replica", metavar="ID", help="only report this replica group")
    parser.add_argument(
        "--html",
        metavar="OUT_DIR",
        nargs="?",
        const="",
        help="write the end-of-run report (summary.json and summary.html; summary-JOB.* for"
        " a named job) to OUT_DIR (default: the event log's directory) and print the two paths",
    )
    parser.add_argument(
        "--job",
        metavar="NAME",
        help="with --html: the job (room) to report, for a log of several rooms"
        " (default: the job of the last goodput event)",
    )
    args = parser.parse_args(argv)
    if args.html is not None and (args.json or args.replica is not None):
        parser.error("--html cannot be combined with --json or --replica")
    if args.job is not None and args.html is None:
        parser.error("--job only applies to --html")

    path: str = args.path
    try:
        events, problems = read_events(path)
    except FileNotFoundError:
        print(f"error: {path}: no such file", file=sys.stderr)
        return 2
    except IsADirectoryError:
        print(f"error: {path}: is a directory, not an event log", file=sys.stderr)
        return 2
    except PermissionError:
        print(f"error: {path}: permission denied", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {path}: cannot read: {e.strerror or e}", file=sys.stderr)
        return 2

    for problem in problems[:_MAX_WARNINGS]:
        print(f"warning: {path}: {problem}", file=sys.stderr)
    if len(problems) > _MAX_WARNINGS:
        more = len(problems) - _MAX_WARNINGS
        print(f"warning: {path}: ... and {_plural(more, 'more problem')}", file=sys.stderr)

    if args.html is not None:
        return _main_html(path, events, problems, args.html, args.job)

    summary = summarize(events)
    if args.replica is not None:
        if args.replica not in summary["replicas"]:
            known = ", ".join(summary["replicas"]) or "none"
            print(
                f"error: unknown replica {args.replica!r}; known replicas: {known}",
                file=sys.stderr,
            )
            return 2
        summary["replicas"] = {args.replica: summary["replicas"][args.replica]}

    if not events:
        what = "no valid events" if problems else "empty log (no events)"
        if args.json:
            print(f"{path}: {what}", file=sys.stderr)
            print(json.dumps(summary, indent=2))
        else:
            print(f"{path}: {what}")
        return 0

    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"event log {path}"
            + (f" ({_plural(len(problems), 'line')} skipped)" if problems else "")
        )
        print(format_summary(summary), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
