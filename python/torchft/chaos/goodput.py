"""Goodput of a chaos run computed from its own history, to check the lighthouse's figure.

The lighthouse accounts goodput from the step reports of every group's rank 0, its own
clock and its write-ahead commit announcements (docs/telemetry.md, "Goodput"). The harness
computes the same quantity independently from the history the workers wrote
(``*.history.jsonl``: a line per committed step, per step that did not commit, per restore
from a snapshot, and when a process was ready and finished, each with its wall time ``t``):

* the window is the lighthouse's (``window_start_unix_s`` of its final ``goodput`` event:
  the job's first committed step it knows of) up to each group's last ``finish`` line;
* a group's wall time runs from the window's start to its ``finish``;
* each step of a process spans the time since its previous line (commit, discard, restore
  or ready; a step's line carries the instant the step ended as the rank measured it for its
  report, not when it was written), and only its part inside the window counts (its quorum
  wait is its first part); its first step is start-up, a step that restored a
  snapshot or healed is recovery; a committed step is productive, less the quorum wait the
  worker recorded for it; a step that did not commit is discarded;
* a committed step is lost to a regression when the same group commits the same step again
  later: its productive time moves to regressed;
* a process killed in the commit vote or just after it (its phase file says ``c`` or ``d``)
  may have committed a step it never wrote a line for: the lighthouse accepted the
  write-ahead announcement, the history cannot tell. The harness's figure is then a range:
  up to the time from the process's last line to its kill is added to the high end, and the
  lighthouse's figure must fall within 1% of the range (the range is a point otherwise).

The rank's own measurements in both computations are the quorum wait inside a step and
the instants steps end (the lighthouse gets step times measured between them, the harness
the wall times of the same instants); which steps count, wall time, restarts and losses are
each side's own.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

__all__ = [
    "TOLERANCE",
    "compare",
    "harness_goodput",
    "lighthouse_goodput",
    "read_voted",
    "voted",
]

#: Relative difference allowed between the two figures.
TOLERANCE = 0.01


def voted(
    before: int, after: int, step_healed: bool, quorum_wait: float | None, t: float | None = None
) -> bytes:
    """The phase record once the vote returned: ``d``, then the committed step before and
    after the vote, whether the step healed, when the step ended (``t``, unix seconds, now
    by default; give the time its history line will carry, rounded to the microsecond, so
    the two compare equal) and its quorum wait, space separated and padded to a fixed width
    (a later ``q``/``c`` overwrites the first byte only). Read back by :func:`read_voted`."""
    t = time.time() if t is None else t
    text = f"d{before} {after} {int(step_healed)} {t:.6f} {quorum_wait or 0.0:.6f}"
    return text.ljust(64).encode()


def read_voted(data: bytes) -> dict[str, Any] | None:
    """The vote's outcome from a phase file's bytes, or None (not in phase ``d``, or an
    older or damaged record)."""
    if data[:1] != b"d":
        return None
    try:
        before, after, healed, t, wait = data[1:].decode().split()
        return {
            "before": int(before),
            "after": int(after),
            "step_healed": healed == "1",
            "t": float(t),
            "quorum_wait": float(wait),
        }
    except (UnicodeDecodeError, ValueError):
        return None


def lighthouse_goodput(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The lighthouse's final ``goodput`` event in an event log (the last one when the run
    has no final one), or None when there is none."""
    goodput = [e for e in events if e.get("kind") == "goodput" and not e.get("job")]
    finals = [e for e in goodput if e.get("final")]
    if finals:
        return finals[-1]
    return goodput[-1] if goodput else None


def harness_goodput(
    records: list[dict[str, Any]],
    window_start: float,
    unsure: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Goodput from the workers' history lines (every process's, any order) over the window
    that starts at ``window_start`` (see the module documentation). ``unsure`` maps the pid
    of a process killed in or just after the commit vote to when it was killed: its last
    step may have committed without a line (the ``ratio_high`` end of the range)."""
    unsure = unsure or {}
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] in ("ready", "commit", "discard", "restore", "finish"):
            by_pid[r["pid"]].append(r)
    groups: dict[str, dict[str, Any]] = {}
    # (group, step) -> committed entries, to find steps committed again later.
    committed: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)

    def group(name: str) -> dict[str, Any]:
        return groups.setdefault(
            name,
            {
                "end": None,
                "productive_s": 0.0,
                "quorum_s": 0.0,
                "discarded_s": 0.0,
                "recovery_steps_s": 0.0,
                "regressed_s": 0.0,
                "regressed_steps": 0,
                "steps_committed": 0,
                "unsure_s": 0.0,
            },
        )

    for pid, lines in by_pid.items():
        lines.sort(key=lambda r: r["t"])
        prev: dict[str, Any] | None = None
        first = True
        killed = unsure.get(pid)
        last = lines[-1] if lines else None
        if killed is not None and last is not None and last["kind"] != "ready":
            # A step after its last line may have committed unseen (not its first: start-up).
            since = max(last["t"], window_start)
            group(last["group"])["unsure_s"] += max(0.0, killed - since)
        for r in lines:
            g = group(r["group"])
            if r["kind"] == "ready":
                prev, first = r, True
                continue
            if r["kind"] == "finish":
                g["end"] = r["t"] if g["end"] is None else max(g["end"], r["t"])
                continue
            if prev is None:
                prev = r
                continue
            span = max(0.0, r["t"] - prev["t"])
            prev = r
            if r["t"] < window_start:
                first = False
                continue
            wait = min(span, max(0.0, float(r.get("quorum_wait") or 0.0)))
            if first or r["kind"] == "restore":
                first = False
                continue
            # Only the part inside the window counts (the step's quorum wait comes first).
            inside = min(span, r["t"] - window_start)
            work = min(span - wait, inside)
            wait, span = inside - work, inside
            if r["kind"] == "discard":
                g["quorum_s"] += wait
                g["discarded_s"] += span - wait
            elif r.get("step_healed", r.get("healed")):
                g["recovery_steps_s"] += span
                g["steps_committed"] += 1
            else:
                g["quorum_s"] += wait
                g["productive_s"] += span - wait
                g["steps_committed"] += 1
                committed[(r["group"], r["step"])].append({"t": r["t"], "p": span - wait})
    for (name, _step), entries in committed.items():
        entries.sort(key=lambda e: e["t"])
        for e in entries[:-1]:  # every commit of the step but the last was lost
            g = groups[name]
            g["productive_s"] -= e["p"]
            g["regressed_s"] += e["p"]
            g["regressed_steps"] += 1
    wall = productive = unsure_s = 0.0
    out_groups = {}
    for name, g in sorted(groups.items()):
        if g["end"] is None:
            continue
        g_wall = max(0.0, g["end"] - window_start)
        wall += g_wall
        productive += g["productive_s"]
        unsure_s += g["unsure_s"]
        out_groups[name] = {
            "wall_s": g_wall,
            "productive_s": g["productive_s"],
            "quorum_s": g["quorum_s"],
            "discarded_s": g["discarded_s"],
            "regressed_s": g["regressed_s"],
            "regressed_steps": g["regressed_steps"],
            "steps_committed": g["steps_committed"],
            "unsure_s": g["unsure_s"],
            "ratio": g["productive_s"] / g_wall if g_wall > 0 else None,
        }
    return {
        "wall_s": wall,
        "productive_s": productive,
        "unsure_s": unsure_s,
        "ratio": productive / wall if wall > 0 else None,
        "ratio_high": (productive + unsure_s) / wall if wall > 0 else None,
        "groups": out_groups,
    }


def compare(lighthouse: dict[str, Any], harness: dict[str, Any]) -> str | None:
    """Why the lighthouse's figure is more than :data:`TOLERANCE` (relative) outside the
    harness's range, or None."""
    lr, hr = lighthouse.get("ratio"), harness.get("ratio")
    if lr is None or hr is None:
        return f"no goodput ratio to compare (lighthouse {lr}, harness {hr})"
    high = harness.get("ratio_high")
    high = hr if high is None else max(hr, high)
    if lr < hr * (1 - TOLERANCE) or lr > high * (1 + TOLERANCE):
        computed = f"{hr:.4f}" if high == hr else f"{hr:.4f} to {high:.4f}"
        unsure = harness.get("unsure_s") or 0.0
        return (
            f"goodput: the lighthouse reports {lr:.4f}, the harness computes {computed} from "
            f"its history (more than {TOLERANCE:.0%} apart; lighthouse productive "
            f"{lighthouse.get('productive_s')}s of {lighthouse.get('wall_s')}s, harness "
            f"{harness['productive_s']:.3f}s (+ up to {unsure:.3f}s unseen) of "
            f"{harness['wall_s']:.3f}s)"
        )
    return None
