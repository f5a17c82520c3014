"""The chaos checker's rules on total losses: every group killed at once (``kill_all``) and
the run resumed from a durable snapshot.

Which snapshot a total loss must resume from, at the oldest, is told two ways. The workers'
commits name each snapshot step's writer, and a writer that went on to the next snapshot
step had an interval of steps to finish its snapshot (:func:`must_be_complete`). The
lighthouse's event log says which snapshots their writers reported complete
(``snapshot_complete``), which also covers a writer that finished and then died before
the next snapshot step (:func:`reported_complete`).
"""

from __future__ import annotations

from typing import Any, Protocol

from torchft.chaos.regressions import death_times
from torchft.chaos.report import Report
from torchft.group_snapshots import DIVERGED_SNAPSHOT


class Records(Protocol):
    """What these rules read of a run (:class:`torchft.chaos.history` reads it once)."""

    #: Every process's commits, by time.
    commits: list[dict[str, Any]]
    #: Every process's ``restore`` lines.
    restores: list[dict[str, Any]]
    #: Every process's ``finish`` line (it trained to the target).
    finishes: list[dict[str, Any]]
    #: The supervisor's ``start`` and ``exit`` records.
    procs: list[dict[str, Any]]
    #: The fault injector's records.
    faults: list[dict[str, Any]]
    #: The lighthouse's event log.
    events: list[dict[str, Any]]


def left_finished(finishes: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[int, float]:
    """When each process that trained to the target left the job, by pid: the lighthouse's
    record of its group's clean shutdown (``replica_finished``) after its ``finish`` line.
    It has left its training loop for good (the manager says so before it stops its
    servers): it never asks for a quorum again, so no quorum can name it as a heal source,
    though its exit may still take a while. A finish the lighthouse did not record leaves
    the process a holder until its exit."""
    out: dict[int, float] = {}
    for f in finishes:
        seen = [
            float(e["ts"])
            for e in events
            if e.get("kind") == "replica_finished"
            and e.get("replica_id") == f["group"]
            and float(e.get("ts", 0.0)) >= float(f["t"])
        ]
        if seen:
            out[f["pid"]] = min(seen)
    return out


def judge_total_losses(
    rep: Report, run: Records, stopped: dict[int, tuple[float, dict[str, Any]]]
) -> None:
    """Every group killed at once (``kill_all``): the run resumes from the newest snapshot
    that was complete at the kill, holding exactly the state committed at that step, and
    that snapshot is no older than the newest that must have been complete
    (:func:`must_be_complete`: one whose writer went on to the next snapshot step; the
    kill may cut the newest one short): with every writer going on, at most two intervals
    are lost. Any restore, after a total loss or after the last holders of newer steps died
    otherwise, holds a state committed at its step and never bypasses a live holder of that
    step or a later one (a holder stopped as diverged holds nothing from its stop on, one
    that finished nothing from its clean shutdown on: :func:`left_finished`)."""
    commits, procs = run.commits, run.procs
    kills = [f for f in run.faults if f["fault"] == "kill_all"]
    started = {r["pid"]: r["t"] for r in procs if r["kind"] == "start"}
    gone = death_times(procs)
    for pid, (at, _) in stopped.items():
        gone[pid] = min(gone.get(pid, at), at)
    for pid, at in left_finished(run.finishes, run.events).items():
        gone[pid] = min(gone.get(pid, at), at)
    for r in run.restores:
        # Never past a live holder: no process that had committed the step or a later one
        # before the restoring process looked (after it started, after its last commit,
        # after the quorum it restored under was issued) lived on through its restore. (Groups that restored in the same round may commit before this one
        # writes its line, which comes after the vote of the step that loaded the
        # snapshot.)
        born = max(
            [started.get(r["pid"], r["t"]), formed_at(run.events, r.get("quorum_id"))]
            + [c["t"] for c in commits if c["pid"] == r["pid"] and c["t"] < r["t"]]
        )
        holders = sorted(
            {
                c["pid"]
                for c in commits
                if c["t"] < born
                and c["step"] >= r["step"]
                and gone.get(c["pid"], float("inf")) > r["t"]
            }
        )
        if holders:
            rep.violations.append(
                f"{r['group']} (pid {r['pid']}) resumed from the snapshot of step "
                f"{r['step']} while pids {holders} holding that step or a later one were "
                "alive: a live group's progress was bypassed"
            )
        held = {c["state"] for c in commits if c["step"] == r["step"] and c["t"] < r["t"]}
        if not held:
            rep.violations.append(
                f"{r['group']} (pid {r['pid']}) resumed from step {r['step']}, which no group "
                "had committed before"
            )
        elif r["state"] not in held:
            rep.violations.append(
                f"{r['group']} (pid {r['pid']}) resumed from the snapshot of step {r['step']} "
                "with a state no group had committed at that step"
            )
        # After a total loss (nothing committed since the kill by the new processes), the
        # snapshot is exactly the newest that was complete at the kill.
        before = [f for f in kills if f["t"] < r["t"]]
        if before:
            kill = before[-1]
            fresh = [
                c
                for c in commits
                if kill["t"] < c["t"] < r["t"] and started.get(c["pid"], 0.0) > kill["t"]
            ]
            if not fresh and r["step"] != kill["snapshot_step"]:
                rep.violations.append(
                    f"{r['group']} (pid {r['pid']}) resumed from step {r['step']}, but the "
                    f"newest complete snapshot at the total loss was step "
                    f"{kill['snapshot_step']}"
                )
    for i, kill in enumerate(kills):
        t, every = kill["t"], kill["snapshot_every"]
        snap, best = kill["snapshot_step"], kill["best_step"]
        lost = best - snap
        nxt = kills[i + 1]["t"] if i + 1 < len(kills) else float("inf")
        # Commits of processes started after the kill (a killed process may still write a
        # commit line in the instant between the kill's record and its death).
        born = {r["pid"] for r in procs if r["kind"] == "start" and t < r["t"] < nxt}
        after = [c for c in commits if t < c["t"] < nxt and c["pid"] in born]
        first = min(after, key=lambda c: c["t"]) if after else None
        rep.total_losses.append(
            {
                "best": best,
                "snapshot": snap,
                "lost": lost,
                "every": every,
                "resumed_s": first["t"] - t if first is not None else None,
                "lighthouse": kill.get("lighthouse", False),
                "wiped": kill.get("state_file_deleted", False),
            }
        )
        # The newest snapshot may be cut short by the kill (its write or parity check in
        # flight); see must_be_complete for the older ones.
        since = kills[i - 1]["t"] if i > 0 else float("-inf")
        refused = refused_as_diverged(run.events, run.faults, (since, t))
        bound, unfinished, diverged = must_be_complete(commits, (since, t), best, every, refused)
        reported = reported_complete(run.events, (since, t), best)
        rep.total_losses[-1]["bound"] = bound
        rep.total_losses[-1]["unfinished"] = unfinished
        rep.total_losses[-1]["diverged"] = diverged
        rep.total_losses[-1]["reported"] = reported
        if reported is not None and snap < reported[0]:
            rep.violations.append(
                f"total loss at best step {best} resumed from snapshot {snap}, but the "
                f"lighthouse had been told snapshot {reported[0]} was complete "
                f"{t - reported[1]:.2f}s before the kill: a complete snapshot was lost"
            )
        elif snap < bound:
            excused = []
            if unfinished:
                excused.append(f"the writers of {unfinished} did not reach the next snapshot step")
            if diverged:
                excused.append(f"the snapshots of {diverged} were refused as diverged")
            why = (
                f"more than two snapshot intervals ({every})"
                if not excused
                else f"older than snapshot {bound}, the newest that must have been complete "
                f"({'; '.join(excused)})"
            )
            rep.violations.append(
                f"total loss at best step {best} resumed from snapshot {snap}: {lost} steps "
                f"lost, {why}"
            )
        if first is not None and first["step"] != snap + 1:
            rep.violations.append(
                f"after the total loss at best step {best} (newest snapshot {snap}) the first "
                f"commit was step {first['step']}, not {snap + 1}: the run did not resume "
                "from the snapshot"
            )


def refused_as_diverged(
    events: list[dict[str, Any]], faults: list[dict[str, Any]], window: tuple[float, float]
) -> dict[int, set[str]]:
    """The snapshot steps the product refused between the total losses at ``window[0]``
    and ``window[1]`` because the parity check had found the writer's state diverged (a
    diverged state never becomes a snapshot), with the groups that reported it: only a
    group a bit flip was injected into before its report counts."""
    since, t = window
    flipped: dict[str, float] = {}
    for f in faults:
        if f.get("fault") == "bitflip" and since < f["t"] < t:
            for g in f.get("groups") or []:
                flipped.setdefault(g, f["t"])
    refused: dict[int, set[str]] = {}
    for e in events:
        step, ts, group = e.get("step"), e.get("ts"), e.get("replica_id")
        if (
            e.get("kind") == "snapshot_failed"
            and isinstance(step, int)
            and isinstance(ts, (int, float))
            and since < ts < t
            and str(e.get("error", "")).endswith(DIVERGED_SNAPSHOT)
            and isinstance(group, str)
            and flipped.get(group, float("inf")) <= ts
        ):
            refused.setdefault(step, set()).add(group)
    return refused


def must_be_complete(
    commits: list[dict[str, Any]],
    window: tuple[float, float],
    best: int,
    every: int,
    refused: dict[int, set[str]] | None = None,
) -> tuple[int, list[int], list[int]]:
    """The newest snapshot step at or below ``best`` that must have been complete at a total
    loss at ``window[1]``, judged from the commits after the previous total loss at
    ``window[0]`` (the processes of this life), the snapshot steps between it and the one
    before ``best``'s whose writers did not reach the next one, and those the product
    refused as diverged (``refused``: step -> the groups that reported it refused; only
    the step's writer's report counts, and such a snapshot never becomes complete,
    whoever went on).

    Exactly one group writes a snapshot step: the one whose participating rank at that
    step's commit was ``(step // every) % participants``. A writer that went on to commit
    the next snapshot step has had an interval of steps to finish (the premise of the
    two-interval bound): its snapshot must be complete. A writer that did not (killed,
    stopped or hung before it, or behind the others) may not have finished. A step this
    life never committed lies at or below the snapshot it resumed from. A history that
    does not name the participating rank names no writer: every snapshot step but the
    newest must then have been complete."""
    since, t = window
    life = [c for c in commits if since < c["t"] < t]
    newest = best // every * every
    refused = refused or {}
    diverged: list[int] = []
    if not any(c.get("participating_rank") is not None for c in life):
        step = newest - every
        while step > 0 and step in refused:
            diverged.append(step)
            step -= every
        return max(step, 0), [], diverged
    reached: dict[int, int] = {}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for c in life:
        reached[c["pid"]] = max(reached.get(c["pid"], 0), c["step"])
        by_step.setdefault(c["step"], []).append(c)
    unfinished: list[int] = []
    step = newest - every
    while step > 0:
        at = by_step.get(step, [])
        writers = [
            c
            for c in at
            if c.get("participating_rank") is not None
            and c["participating_rank"] == (step // every) % max(c["participants"], 1)
        ]
        if any(w.get("group") in refused.get(step, ()) for w in writers):
            diverged.append(step)
            step -= every
            continue
        if not at or any(reached[w["pid"]] >= step + every for w in writers):
            return step, unfinished, diverged
        unfinished.append(step)
        step -= every
    return 0, unfinished, diverged


def reported_complete(
    events: list[dict[str, Any]], window: tuple[float, float], best: int
) -> tuple[int, float] | None:
    """The newest snapshot step at or below ``best`` whose writer told the lighthouse it was
    complete after the previous total loss at ``window[0]`` and before the kill at
    ``window[1]``, and when the lighthouse logged it (None: no such report).

    A writer reports a snapshot once its manifest is written, so a snapshot reported before
    the kill was complete then; only older ones are ever deleted (the newest are kept), so
    the newest complete snapshot at the kill is at least this one. A report lost with its
    killed writer leaves this bound lower, never wrong."""
    since, t = window
    found: tuple[int, float] | None = None
    for e in events:
        if e.get("kind") != "snapshot_complete":
            continue
        step, ts = e.get("step"), e.get("ts")
        if not isinstance(step, int) or not isinstance(ts, (int, float)):
            continue
        if since < ts < t and step <= best and (found is None or step > found[0]):
            found = (step, float(ts))
    return found


def bypassed_snapshot(
    commit: dict[str, Any],
    previous: dict[str, Any] | None,
    events: list[dict[str, Any]],
    faults: list[dict[str, Any]],
) -> str | None:
    """Why ``commit`` should have come from a newer durable snapshot; None when it could
    not have.

    A group looks for a snapshot at the first answer of each new quorum (every answer while
    it holds its start-up state) and restores one at least two steps ahead of every member.
    When the commit's quorum is not the one of the process's previous commit, the process
    looked at it after the quorum was issued (:func:`formed_at`). A snapshot of a step at least two past the
    one it went on from that the lighthouse had been told was complete before then (its
    writer reports it once the manifest is written; since the last total loss) was on disk
    when it looked, and no member was past it (the process would have healed to it):
    going on from the older step redid steps a restore would have kept. Judged whether or
    not the commit forked: a step redone under the same data may give the same state."""
    if previous is not None and previous["quorum_id"] == commit["quorum_id"]:
        return None
    at = formed_at(events, commit["quorum_id"])
    if at == float("-inf"):
        return None
    kills = [float(f["t"]) for f in faults if f["fault"] == "kill_all" and f["t"] < at]
    found = reported_complete(events, (max(kills, default=float("-inf")), at), 2**62)
    if found is None or found[0] < commit["step"] + 1:
        return None
    return (
        f"{commit['group']} (pid {commit['pid']}) went on from step {commit['step'] - 1} in "
        f"quorum {commit['quorum_id']} although the lighthouse had been told {at - found[1]:.2f}s "
        f"before that quorum formed that the snapshot of step {found[0]} was complete: "
        f"{found[0] - commit['step'] + 1} steps redone that a restore would have kept"
    )


def formed_at(events: list[dict[str, Any]], quorum_id: int | None) -> float:
    """When quorum ``quorum_id`` (or, without an event of its own, the newest before it)
    was issued: the lighthouse's ``quorum_changed`` event of the newest quorum id at or
    below it, written before the quorum's members are answered. -inf when unknown (no such
    event, no id)."""
    if quorum_id is None:
        return float("-inf")
    formed = [
        (e["quorum_id"], float(e["ts"]))
        for e in events
        if e.get("kind") == "quorum_changed"
        and isinstance(e.get("quorum_id"), int)
        and e["quorum_id"] <= quorum_id
        and isinstance(e.get("ts"), (int, float))
    ]
    return max(formed)[1] if formed else float("-inf")
