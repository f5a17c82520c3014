"""The history of a chaos run, and the offline checker of its invariants.

Three kinds of files in a run directory, written by three independent parties:

* ``*.history.jsonl`` (one per process, by the worker): a ``commit`` line per committed step
  (``step``, ``quorum_id``, ``participants``, ``state`` hash, wall time ``t``) and a ``finish``
  line at the target.
* ``processes.jsonl`` (by the supervisor): ``start`` and ``exit`` of every process it ran
  (``group``, ``pid``, ``t``, and on exit ``rc`` and whether it was ``killed``).
* ``faults.jsonl`` (by the fault injector): what was done when (``fault``, ``groups``, ``t``).

:func:`check` reads them and returns a :class:`Report`. The invariants use only the history
and the process lifetimes; the faults only serve the timing figures (recovery, stalls), so
new fault kinds need no change here.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def state_hash(*states: Any) -> str:
    """A hash of nested dicts/lists of tensors and scalars (sorted keys, raw bytes)."""
    h = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=repr):
                h.update(f"K{k!r}".encode())
                feed(obj[k])
        elif isinstance(obj, (list, tuple)):
            h.update(f"L{len(obj)}".encode())
            for v in obj:
                feed(v)
        else:
            h.update(f"V{obj!r}".encode())

    for s in states:
        feed(s)
    return h.hexdigest()[:16]


class HistoryWriter:
    """Appends one process's history lines (flushed per line: a SIGKILL loses nothing
    written)."""

    def __init__(self, path: str, group: str, pid: int) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - closed by the process exit
        self._group = group
        self._pid = pid

    def _write(self, rec: dict[str, Any]) -> None:
        rec.update(group=self._group, pid=self._pid, t=_now())
        self._f.write(json.dumps(rec) + "\n")

    def commit(self, step: int, quorum_id: int, participants: int, state: str) -> None:
        """Records that ``step`` committed in ``quorum_id`` with ``participants`` groups."""
        self._write(
            {
                "kind": "commit",
                "step": step,
                "quorum_id": quorum_id,
                "participants": participants,
                "state": state,
            }
        )

    def finish(self, step: int, state: str) -> None:
        """Records the final step and state."""
        self._write({"kind": "finish", "step": step, "state": state})


def _now() -> float:
    import time

    return time.time()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a torn last line (a SIGKILL mid-write) is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@dataclass
class Report:
    """What a run did and whether its history keeps the invariants."""

    faults: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    steps_lost: int = 0
    recoveries: list[float] = field(default_factory=list)
    stalls: dict[str, float] = field(default_factory=dict)
    stalls_overlapped: int = 0
    commits: int = 0
    final: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        """The human-readable report."""
        lines = [f"faults injected: {sum(self.faults.values())}"]
        for kind, n in sorted(self.faults.items()):
            lines.append(f"  {kind:<18} {n}")
        lines.append(f"commits recorded: {self.commits}")
        if self.recoveries:
            r = sorted(self.recoveries)
            lines.append(
                "recovery (kill -> first commit of the restarted group, "
                f"{len(r)} restarts): p50 {_pct(r, 50):.2f}s  p95 {_pct(r, 95):.2f}s  "
                f"max {r[-1]:.2f}s"
            )
        lines.append(
            "longest survivor stall per fault kind (faults with no other fault inside the "
            f"stall; {self.stalls_overlapped} overlapped stalls left out):"
        )
        for kind, s in sorted(self.stalls.items()):
            lines.append(f"  {kind:<18} {s:.2f}s")
        lines.append(
            f"unavoidable regressions: {len(self.regressions)} (steps lost {self.steps_lost})"
        )
        for r in self.regressions:
            lines.append(f"  {r}")
        lines.append(f"final: {self.final}")
        lines.append(f"violations: {len(self.violations)}")
        for v in self.violations[:50]:
            lines.append(f"  VIOLATION {v}")
        return "\n".join(lines)


def _pct(sorted_vals: list[float], p: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    return statistics.quantiles(sorted_vals, n=100, method="inclusive")[int(p) - 1]


def check(run_dir: Path, target: int, min_replicas: int, groups: list[str]) -> Report:
    """Checks the history of the run in ``run_dir`` against the invariants.

    Invariants:
      * members of one quorum commit identical states (same quorum id and step, same hash);
      * a step committed with two different states only if, when the second state was
        committed, every process that had committed the first one was already dead (an
        unavoidable regression, reported with the steps lost);
      * no commit with fewer than ``min_replicas`` participants;
      * quorum ids strictly increase over time, and per process never go back;
      * every group finishes at ``target`` with one state;
      * no process is left running.
    """
    rep = Report()
    commits: list[dict[str, Any]] = []
    finishes: list[dict[str, Any]] = []
    for p in sorted(run_dir.glob("*.history.jsonl")):
        for rec in read_jsonl(p):
            (commits if rec["kind"] == "commit" else finishes).append(rec)
    commits.sort(key=lambda r: r["t"])
    rep.commits = len(commits)
    procs = read_jsonl(run_dir / "processes.jsonl")
    death: dict[int, float] = {r["pid"]: r["t"] for r in procs if r["kind"] == "exit"}
    faults = read_jsonl(run_dir / "faults.jsonl") if (run_dir / "faults.jsonl").exists() else []

    # Same quorum, same step: same state.
    by_q: dict[tuple[int, int], set[str]] = defaultdict(set)
    for c in commits:
        by_q[(c["quorum_id"], c["step"])].add(c["state"])
    for (q, s), states in sorted(by_q.items()):
        if len(states) > 1:
            rep.violations.append(f"quorum {q} committed step {s} with {len(states)} states")

    # Forks: a step committed with a second state. Allowed only if every process holding
    # the later state (one that had committed this step or a later one) was dead by then;
    # a stopped process is not dead.
    first_state: dict[int, str] = {}
    last_step: dict[int, int] = {}  # pid -> its latest committed step so far
    covered: list[tuple[int, int]] = []  # step ranges of regressions already reported
    for c in commits:
        step, state = c["step"], c["state"]
        first = first_state.setdefault(step, state)
        if first != state and not any(lo <= step <= hi for lo, hi in covered):
            ahead = sorted(
                pid
                for pid, s in last_step.items()
                if s >= step and pid != c["pid"] and death.get(pid, float("inf")) > c["t"]
            )
            best = max(last_step.values(), default=step)
            covered.append((step, best))
            lost = max(best - step + 1, 0)
            if ahead:
                rep.violations.append(
                    f"progress regressed: {c['group']} (pid {c['pid']}, quorum "
                    f"{c['quorum_id']}) committed step {step} with a new state while pids "
                    f"{ahead} holding step >= {step} (best {best}) were alive"
                )
            else:
                rep.steps_lost += lost
                rep.regressions.append(
                    f"step {step} re-committed by {c['group']} after every holder of it died "
                    f"(best step then {best}: {lost} steps lost)"
                )
        last_step[c["pid"]] = max(last_step.get(c["pid"], 0), step)

    for c in commits:
        if c["participants"] < min_replicas:
            rep.violations.append(
                f"{c['group']} committed step {c['step']} with {c['participants']} < "
                f"{min_replicas} participants"
            )

    # Quorum ids: per process never back; globally, ids first seen later are larger.
    last_q: dict[int, int] = {}
    for c in commits:
        prev = last_q.get(c["pid"])
        if prev is not None and c["quorum_id"] < prev:
            rep.violations.append(
                f"pid {c['pid']} committed in quorum {c['quorum_id']} after {prev}"
            )
        last_q[c["pid"]] = c["quorum_id"]
    seen: dict[int, float] = {}
    for c in commits:
        seen.setdefault(c["quorum_id"], c["t"])
    order = [q for q, _ in sorted(seen.items(), key=lambda kv: kv[1])]
    for a, b in zip(order, order[1:], strict=False):
        if b <= a:
            rep.violations.append(f"quorum id {b} first used after {a}")

    # Every group finished at the target with one state.
    done = {f["group"]: f for f in finishes}
    for g in groups:
        if g not in done:
            rep.violations.append(f"group {g} did not finish")
        elif done[g]["step"] != target:
            rep.violations.append(f"group {g} finished at step {done[g]['step']} != {target}")
    states = {f["state"] for f in done.values()}
    if len(states) > 1:
        rep.violations.append(f"groups finished with {len(states)} different states")
    rep.final = {"groups": len(done), "states": len(states), "step": target}

    # No process left behind, none crashed on its own.
    for r in procs:
        if r["kind"] == "exit" and r["rc"] != 0 and not r["killed"]:
            rep.violations.append(f"process {r['pid']} ({r['group']}) exited with {r['rc']}")
        if r["kind"] == "start" and r["pid"] not in death:
            rep.violations.append(f"process {r['pid']} ({r['group']}) has no recorded exit")
        if r["kind"] == "start" and _alive(r["pid"]):
            rep.violations.append(f"process {r['pid']} ({r['group']}) is still running")

    _timings(rep, commits, procs, faults)
    return rep


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie of another parent still answers: look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _timings(
    rep: Report,
    commits: list[dict[str, Any]],
    procs: list[dict[str, Any]],
    faults: list[dict[str, Any]],
) -> None:
    """Fills faults by kind, recovery times and the longest isolated survivor stalls."""
    by_pid: dict[int, list[float]] = defaultdict(list)
    for c in commits:
        by_pid[c["pid"]].append(c["t"])
    starts = [r for r in procs if r["kind"] == "start"]
    fault_times = sorted(f["t"] for f in faults)
    for f in faults:
        rep.faults[f["fault"]] = rep.faults.get(f["fault"], 0) + 1
    for f in faults:
        t = f["t"]
        if f["fault"].startswith("kill") and f["fault"] != "kill_lighthouse":
            for g in f["groups"]:
                nxt = [s for s in starts if s["group"] == g and s["t"] > t]
                if not nxt:
                    continue
                first = [x for x in by_pid.get(nxt[0]["pid"], []) if x > t]
                if first:
                    rep.recoveries.append(min(first) - t)
        targets = set(f["groups"])
        for pid, times in by_pid.items():
            group = next((s["group"] for s in starts if s["pid"] == pid), None)
            if group in targets:
                continue
            before = [x for x in times if x <= t]
            after = [x for x in times if x > t]
            if not before or not after:
                continue
            lo, hi = before[-1], after[0]
            if any(lo < ft < hi and ft != t for ft in fault_times):
                rep.stalls_overlapped += 1
                continue
            rep.stalls[f["fault"]] = max(rep.stalls.get(f["fault"], 0.0), hi - t)
