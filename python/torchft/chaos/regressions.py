"""What the chaos checker accepts as the cause of a regression of progress.

Progress regresses (a step is committed again with another state) only when every holder
of the newer state is gone. A holder is gone when it died (a process the injector killed:
when the SIGKILL was sent, see :func:`death_times`), and also when the lighthouse stopped
it as diverged with no majority behind its state: from then on no group heals from or
restores that state, however long the stopped process takes to exit (or whatever kills it
first).
"""

from __future__ import annotations

from typing import Any

from torchft.chaos.report import DIVERGED_EXIT, HUNG_EXIT, RESTART_EXIT

#: How long after a kill's record a killed process's own last history lines may come.
KILL_TRAIL_S = 1.0


def death_times(procs: list[dict[str, Any]]) -> dict[int, float]:
    """When each process that ended was dead, by pid: for one the injector SIGKILLed, when
    it sent the signal (``killed_at``, read just before it: the process ran no code after
    it, so it could neither commit nor serve what it held; the lighthouse sees it die as its
    connections close, while the supervisor reaps the exit up to a poll interval later),
    else when its exit was reaped. A record without ``killed_at`` (an older run) gives its
    reaped exit."""
    out: dict[int, float] = {}
    for r in procs:
        if r["kind"] != "exit":
            continue
        killed_at = r.get("killed_at")  # written only for a process the injector killed
        t = float(r["t"])
        out[r["pid"]] = t if killed_at is None else min(t, float(killed_at))
    return out


def diverged_stops(
    commits: list[dict[str, Any]],
    procs: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> dict[int, tuple[float, dict[str, Any]]]:
    """Processes stopped as diverged, by pid: from when their state is not progress, and
    their exit record.

    - A ``replica_diverged`` event with action ``stop`` in the lighthouse's event log names
      a group's incarnation: the process of that group alive at the verdict is stopped from
      the verdict on (or from its last commit, if a commit in flight landed after it),
      whether it then ended itself or was killed before it could.
    - A process that ended itself with DIVERGED_EXIT (not killed) and that no event names
      (a run without an event log): from its last commit on (it commits nothing after its
      verdict).
    """
    last: dict[int, float] = {}
    for c in commits:
        last[c["pid"]] = max(last.get(c["pid"], 0.0), c["t"])
    exits = {r["pid"]: r for r in procs if r["kind"] == "exit"}
    stopped: dict[int, tuple[float, dict[str, Any]]] = {}
    for ev in events:
        if ev.get("kind") != "replica_diverged" or ev.get("action") != "stop":
            continue
        group = str(ev.get("replica_id", "")).split(":")[0]
        ts = float(ev.get("ts", 0.0))
        for r in procs:
            end = exits.get(r["pid"])
            if (
                r["kind"] == "start"
                and r["group"] == group
                and r["t"] <= ts
                and end is not None
                and end["t"] >= ts
                and r["pid"] not in stopped
            ):
                stopped[r["pid"]] = (max(ts, last.get(r["pid"], ts)), end)
    for pid, r in exits.items():
        if pid not in stopped and r["rc"] == DIVERGED_EXIT and not r["killed"]:
            stopped[pid] = (last.get(pid, r["t"]), r)
    return stopped


def regression_cause(
    lo: float,
    hi: float,
    faults: list[dict[str, Any]],
    procs: list[dict[str, Any]],
    stopped: dict[int, tuple[float, dict[str, Any]]] | None = None,
) -> str | None:
    """What, between the last commit of the lost steps (``lo``) and their re-commit (``hi``),
    explains that every holder died: a total loss, a kill that took the last live holders of
    the best step (the injector keeps a running group that has committed, not one at the
    best step), or a process that ended itself (asked for a restart, held hung, stopped as
    diverged). A process stopped as diverged (``stopped``, from :func:`diverged_stops`) counts
    from the moment it was stopped, if it was still alive at ``lo``. None when nothing
    does."""
    for f in faults:
        # A killed process's last lines may trail the kill's record by the moment it takes
        # to die (harnesses before the record moved after the deaths).
        if not lo - KILL_TRAIL_S <= f["t"] <= hi:
            continue
        if f["fault"] == "kill_all":
            return "a total loss (kill_all)"
        if f.get("best_left", f.get("best", 0)) < f.get("best", 0):
            return (
                f"{f['fault']} of {f['groups']} took the last live holders of step "
                f"{f['best']} (the others were at {f['best_left']} at most)"
            )
    ended = {RESTART_EXIT: "asked for a restart", HUNG_EXIT: "held hung", DIVERGED_EXIT: "diverged"}
    for r in procs:
        if r["kind"] == "exit" and not r["killed"] and r["rc"] in ended and lo <= r["t"] <= hi:
            return f"process {r['pid']} ({r['group']}) ended itself: {ended[r['rc']]}"
    for pid, (at, exited) in (stopped or {}).items():
        if at <= hi and exited["t"] >= lo:
            return (
                f"process {pid} ({exited['group']}) stopped as diverged with no majority "
                "(its state is not progress; it exited later)"
            )
    return None
