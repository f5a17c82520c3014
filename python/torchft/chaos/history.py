"""The history of a chaos run, and the offline checker of its invariants.

Three kinds of files in a run directory, written by three independent parties:

* ``*.history.jsonl`` (one per process, by the worker): a ``ready`` line once the process
  is set up (``imported``: wall time after the imports, ``t``: after the Manager, model, DDP
  and optimizer are built), a ``commit`` line per committed step (``step``, ``quorum_id``,
  ``participants``, ``state`` hash, ``healed``: the process took a heal since its previous
  commit, wall time ``t``; for goodput ``step_healed`` and ``quorum_wait``), a ``discard``
  line per step that did not commit, and a ``finish`` line at the target. Injected faults that act
  inside the process add their own lines: ``hang`` (``seconds``, ``step``), ``slow``
  (``seconds``, ``step``) and ``bitflip`` (``step``: the step the flipped state trains from,
  ``param``, ``index``, ``bit``, and the ``parity_every`` the process's Manager runs with).
* ``processes.jsonl`` (by the supervisor): ``start`` and ``exit`` of every process it ran
  (``group``, ``pid``, ``t``, and on exit ``rc`` and whether it was ``killed``).
* ``floor.json`` (by the supervisor, optional): the floors measured during the run, under
  its load (median of a few spawns each): ``import_s``, spawn -> ``import torch`` done, and
  ``torch_s``, spawn -> ``import torch, torch._dynamo`` done (torch imports dynamo when the
  first optimizer is built, so every training process pays it before its first step).
* ``faults.jsonl`` (by the fault injector): what was done when (``fault``, ``groups``, ``t``).

:func:`check` reads them and returns a :class:`~torchft.chaos.report.Report`. The invariants use only the history
and the process lifetimes; ``faults.jsonl`` only serves the timing figures (recovery,
stalls). A fault kind that changes what a correct run may record (a ``hang`` may end in exit
76, a ``bitflip`` makes one group's state differ until runtime parity heals it) records
itself in the history, and the rule that allows its effect names it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchft.chaos.goodput import compare, harness_goodput, lighthouse_goodput, read_voted
from torchft.chaos.regressions import death_times, diverged_stops, regression_cause
from torchft.chaos.report import DIVERGED_EXIT, HUNG_EXIT, RESTART_EXIT, Recovery, Report
from torchft.chaos.total_loss import bypassed_snapshot, judge_total_losses

__all__ = [
    "DIVERGED_EXIT",
    "HUNG_EXIT",
    "RESTART_EXIT",
    "HistoryWriter",
    "Recovery",
    "Report",
    "check",
    "detection_window",
    "read_jsonl",
    "state_hash",
]


def detection_window(parity_every: int) -> int:
    """Steps after a bit flip within which runtime parity must have healed it.

    One parity interval for the next digested step, one for the slowest group to digest
    it, one for the heal at the flipped group's next quorum, and 20 steps of slack for the
    off-thread digest and the lighthouse round trip.
    """
    return 3 * parity_every + 20


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

    def _write(self, rec: dict[str, Any], t: float | None = None) -> None:
        rec.update(group=self._group, pid=self._pid, t=_now() if t is None else t)
        self._f.write(json.dumps(rec) + "\n")

    def ready(self, imported: float) -> None:
        """Records that the process is set up; ``imported`` is when its imports were done."""
        self._write({"kind": "ready", "imported": imported})

    def commit(
        self,
        step: int,
        quorum_id: int,
        participants: int,
        state: str,
        healed: bool = False,
        quorum_wait: float | None = None,
        step_healed: bool = False,
        t: float | None = None,
        participating_rank: int | None = None,
    ) -> None:
        """Records that ``step`` committed in ``quorum_id`` with ``participants`` groups;
        ``healed``: the process took a heal since its previous commit (its state came from
        another group); ``step_healed``: it healed in this step; ``quorum_wait``: the
        seconds the step waited for its quorum, as the rank measured them (goodput); ``t``:
        when the step ended (now by default); ``participating_rank``: the group's rank among
        the step's participants (it names the writer of a snapshot step)."""
        self._write(
            {
                "kind": "commit",
                "step": step,
                "quorum_id": quorum_id,
                "participants": participants,
                "participating_rank": participating_rank,
                "state": state,
                "healed": healed,
                "step_healed": step_healed,
                "quorum_wait": quorum_wait,
            },
            t,
        )

    def discard(
        self, step: int, quorum_wait: float | None, step_healed: bool, t: float | None = None
    ) -> None:
        """Records that the step from committed step ``step`` did not commit (goodput); ``t``:
        when it ended (now by default)."""
        self._write(
            {
                "kind": "discard",
                "step": step,
                "quorum_wait": quorum_wait,
                "step_healed": step_healed,
            },
            t,
        )

    def restore(
        self, step: int, state: str, t: float | None = None, quorum_id: int | None = None
    ) -> None:
        """Records that the process resumed from the durable snapshot of ``step`` (no group
        in its quorum held a step as new), holding the state ``state`` before training on;
        ``t``: when the step that restored it ended (now by default); ``quorum_id``: the
        quorum whose answer chose it."""
        rec: dict[str, Any] = {"kind": "restore", "step": step, "state": state}
        if quorum_id is not None:
            rec["quorum_id"] = quorum_id
        self._write(rec, t)

    def hang(self, seconds: float, step: int) -> None:
        """Records that the training loop blocks for ``seconds`` (an injected hang)."""
        self._write({"kind": "hang", "seconds": seconds, "step": step})

    def slow(self, seconds: float, step: int) -> None:
        """Records that the training loop runs three times slower for ``seconds``."""
        self._write({"kind": "slow", "seconds": seconds, "step": step})

    def bitflip(self, step: int, param: str, index: int, bit: int, parity_every: int) -> None:
        """Records that one bit of the in-memory state was flipped before ``step`` trained
        on: bit ``bit`` of element ``index`` (flattened) of parameter ``param``, in a process
        whose Manager digests every ``parity_every`` steps (0: never)."""
        self._write(
            {
                "kind": "bitflip",
                "step": step,
                "param": param,
                "index": index,
                "bit": bit,
                "parity_every": parity_every,
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


@dataclass(frozen=True)
class _Flip:
    """One applied bit flip and its detection window (steps ``step + 1`` .. ``end``)."""

    group: str
    pid: int
    step: int
    end: int
    t: float


class _Carriers:
    """Which commits may carry a bit flip's state.

    The flipped process carries it in the commits of its window; so may any process that
    took a heal (or started) within the window, since its source may have carried it (a
    restart that healed from the flipped group before parity caught it spreads the flip).
    """

    def __init__(self, flips: list[_Flip], commits: list[dict[str, Any]]) -> None:
        self.flips = flips
        #: Per process, the steps of its commits that followed a heal or its start.
        self.joined: dict[int, list[int]] = defaultdict(list)
        seen: set[int] = set()
        for c in commits:
            if c["pid"] not in seen or c.get("healed", False):
                self.joined[c["pid"]].append(c["step"])
            seen.add(c["pid"])

    def carries(self, f: _Flip, pid: int, step: int) -> bool:
        """Whether ``pid``'s commit of ``step`` may hold ``f``'s flipped state."""
        if not f.step < step <= f.end:
            return False
        return pid == f.pid or any(f.step < h <= step for h in self.joined.get(pid, []))

    def covering(self, commits: list[dict[str, Any]], step: int) -> list[_Flip]:
        """The flips whose window holds ``step`` and that one of ``commits`` may carry."""
        return [f for f in self.flips if any(self.carries(f, c["pid"], step) for c in commits)]

    def excuse(self, commits: list[dict[str, Any]], step: int) -> bool:
        """Whether bit flips explain the several states of one quorum's ``commits`` of
        ``step``: each flip adds at most one state, and every state but one is held only by
        commits that may carry a flip (the unflipped state may be held by anyone)."""
        covering = self.covering(commits, step)
        states = {c["state"] for c in commits}
        if not covering or len(states) > 1 + len(covering):
            return False
        unexplained = {
            c["state"]
            for c in commits
            if not any(self.carries(f, c["pid"], step) for f in covering)
        }
        return len(unexplained) <= 1


@dataclass
class _Run:
    """The records of one run, read once: every process's history lines by kind, the
    processes started and ended, and the faults injected."""

    #: Every process's commits, by time.
    commits: list[dict[str, Any]]
    finishes: list[dict[str, Any]]
    #: The ``ready`` line of each process, by pid.
    ready: dict[int, dict[str, Any]]
    hangs: list[dict[str, Any]]
    restores: list[dict[str, Any]]
    #: The bit flips, by time.
    flips: list[_Flip]
    procs: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    #: The lighthouse's event log (empty when the run has none).
    events: list[dict[str, Any]]

    @classmethod
    def read(cls, run_dir: Path) -> _Run:
        """Reads the files of the run in ``run_dir``."""
        run = cls([], [], {}, [], [], [], [], [], [])
        for p in sorted(run_dir.glob("*.history.jsonl")):
            for rec in read_jsonl(p):
                if rec["kind"] == "commit":
                    run.commits.append(rec)
                elif rec["kind"] == "finish":
                    run.finishes.append(rec)
                elif rec["kind"] == "ready":
                    run.ready[rec["pid"]] = rec
                elif rec["kind"] == "hang":
                    run.hangs.append(rec)
                elif rec["kind"] == "restore":
                    run.restores.append(rec)
                elif rec["kind"] == "bitflip":
                    end = rec["step"] + detection_window(rec["parity_every"])
                    run.flips.append(_Flip(rec["group"], rec["pid"], rec["step"], end, rec["t"]))
        run.commits.sort(key=lambda r: r["t"])
        run.flips.sort(key=lambda f: f.t)
        run.procs = read_jsonl(run_dir / "processes.jsonl")
        if (run_dir / "faults.jsonl").exists():
            run.faults = read_jsonl(run_dir / "faults.jsonl")
        if (run_dir / "events.jsonl").exists():
            run.events = read_jsonl(run_dir / "events.jsonl")
        return run


def check(run_dir: Path, target: int, min_replicas: int, groups: list[str]) -> Report:
    """Checks the history of the run in ``run_dir`` against the invariants.

    Invariants:
      * members of one quorum commit identical states (same quorum id and step, same hash);
        a bit flip excuses other states only within its detection window
        (:func:`detection_window`), in commits that may carry it, and one state per flip;
        past the window it is an undetected divergence;
      * a step committed with two different states only if, when the second state was
        committed, every process that had committed the first one was already dead (an
        unavoidable regression, reported with the steps lost), or a bit flip's window
        excuses it as above; and an unavoidable regression needs a recorded cause between
        the last commit of the lost steps and their re-commit: a total loss (``kill_all``),
        or a process ending itself (exit 75, 76 or 77); else it is a violation;
      * participants, per quorum and step: every member's commit reports the same count, at
        least ``min_replicas`` and at least the groups that committed it without a heal
        since their previous commit (those were at the quorum's max step: participants),
        and at most the run's groups;
      * quorum ids strictly increase over time, and per process never go back;
      * per process, committed steps strictly increase (a process never re-commits a step
        it committed, nor one below it);
      * every fork (a step committed with another state than before) is judged on its own:
        one inside the step range of a regression already reported still needs every
        holder of the newer state dead;
      * every group finishes at ``target`` with one state;
      * no process is left running, none exited on its own with an unexpected code: exit
        75 only from a process that had committed nothing (a heal or restore into its own
        tensors torn), exit 76 only after an injected hang, exit 77 only within a bit
        flip's window.
    """
    rep = Report()
    run = _Run.read(run_dir)
    commits, flips, procs = run.commits, run.flips, run.procs
    if (run_dir / "floor.json").exists():
        floors = json.loads((run_dir / "floor.json").read_text())
        rep.floors = {"import": floors["import_s"], "torch": floors["torch_s"]}
    rep.commits = len(commits)
    rep.bitflips = len(flips)
    carriers = _Carriers(flips, commits)
    death = death_times(procs)
    # A process stopped as diverged holds no progress from its stop on: the lighthouse
    # stopped it because no majority vouched for its state, and no group heals from or
    # restores a state so judged. Progress it alone held is not progress a holder may come
    # back with (invariant 7), however long its exit takes or whatever kills it first.
    stopped = diverged_stops(commits, procs, run.events)
    gone = {pid: min(t, stopped[pid][0]) if pid in stopped else t for pid, t in death.items()}

    # Same quorum, same step: same state; a bit flip adds at most one state, within its
    # window, held only by commits that may carry it.
    by_q: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for c in commits:
        by_q[(c["quorum_id"], c["step"])].append(c)
    for (q, s), cs in sorted(by_q.items()):
        states = {c["state"] for c in cs}
        if len(states) == 1:
            continue
        if carriers.excuse(cs, s):
            rep.divergences_excused += 1
            continue
        what = f"quorum {q} committed step {s} with {len(states)} states"
        expired = [f for f in flips if f.end < s]
        if expired:
            f = expired[-1]
            what = (
                f"undetected divergence: {what}, {s - f.step} steps after the bit flip in "
                f"{f.group} (pid {f.pid}) at step {f.step} (detection window "
                f"{f.end - f.step} steps)"
            )
        rep.violations.append(what)
    for f in flips:
        rep.bitflips_healed += _healed(f, by_q)

    # Forks: a step committed with a second state. Allowed only if every process holding
    # the later state (one that had committed this step or a later one) was dead by then;
    # a stopped process is not dead. After a fork the new state is the step's reference:
    # the groups that go on from a regression commit it together.
    first_state: dict[int, str] = {}
    first_q: dict[int, int] = {}  # step -> the quorum of its reference commit
    last_step: dict[int, int] = {}  # pid -> its latest committed step so far
    previous: dict[int, dict[str, Any]] = {}  # pid -> its latest commit so far
    covered: list[tuple[int, int]] = []  # step ranges of regressions already reported
    for i, c in enumerate(commits):
        step, state = c["step"], c["state"]
        first = first_state.setdefault(step, state)
        holder_q = first_q.setdefault(step, c["quorum_id"])
        own = last_step.get(c["pid"])
        if own is not None and step <= own:
            rep.violations.append(
                f"{c['group']} (pid {c['pid']}) committed step {step} after its own commit of "
                f"step {own}: a process's progress went back"
            )
        if first != state:
            ahead = sorted(
                pid
                for pid, s in last_step.items()
                if s >= step and pid != c["pid"] and gone.get(pid, float("inf")) > c["t"]
            )
            # A second state in the same quorum that bit flips explain (the quorum rule
            # above) is not a regression of progress.
            flipped = c["quorum_id"] == holder_q and carriers.excuse(by_q[(holder_q, step)], step)
            best = max(last_step.values(), default=step)
            if not flipped:
                first_state[step], first_q[step] = state, c["quorum_id"]
            if ahead and not flipped:
                rep.violations.append(
                    f"progress regressed: {c['group']} (pid {c['pid']}, quorum "
                    f"{c['quorum_id']}) committed step {step} with a new state while pids "
                    f"{ahead} holding step >= {step} (best {best}) were alive"
                )
            elif not ahead and not any(lo <= step <= hi for lo, hi in covered):
                # One regression re-commits a range of steps: reported (and its steps lost
                # counted) once, at its first step.
                covered.append((step, best))
                lost = max(best - step + 1, 0)
                rep.steps_lost += lost
                # Every holder died; the injector never kills the last one but in a total
                # loss, so something the run recorded must explain it.
                held_until = max((x["t"] for x in commits[:i] if x["step"] >= step), default=0.0)
                why = regression_cause(held_until, c["t"], run.faults, procs, stopped)
                if why is None:
                    rep.violations.append(
                        f"progress regressed with nothing to explain it: step {step} "
                        f"re-committed by {c['group']} (pid {c['pid']}) after every holder of "
                        f"it died (best step then {best}), with no total loss and no process "
                        "ending itself in between"
                    )
                rep.regressions.append(
                    f"step {step} re-committed by {c['group']} after every holder of it "
                    f"died (best step then {best}: {lost} steps lost; {why or 'UNEXPLAINED'})"
                )
        # Whether or not it forked (a redone step may have the same state as before).
        before = previous.get(c["pid"])
        if before is None or before["quorum_id"] != c["quorum_id"]:
            skipped = bypassed_snapshot(c, before, run.events, run.faults)
            if skipped is not None:
                rep.violations.append(f"a newer durable snapshot was not restored: {skipped}")
        last_step[c["pid"]] = max(last_step.get(c["pid"], 0), step)
        previous[c["pid"]] = c

    _judge_participants(rep, by_q, min_replicas, groups)

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
    done = {f["group"]: f for f in run.finishes}
    for g in groups:
        if g not in done:
            rep.violations.append(f"group {g} did not finish")
        elif done[g]["step"] != target:
            rep.violations.append(f"group {g} finished at step {done[g]['step']} != {target}")
    states = {f["state"] for f in done.values()}
    if len(states) > 1:
        what = f"groups finished with {len(states)} different states"
        rep.violations.append(f"undetected divergence: {what}" if flips else what)
    rep.final = {"groups": len(done), "states": len(states), "step": target}

    # No process left behind, none crashed on its own.
    progressed = {c["pid"] for c in commits} | {r["pid"] for r in run.restores}
    hung_pids = {h["pid"] for h in run.hangs}
    for r in procs:
        if r["kind"] == "exit" and r["rc"] == RESTART_EXIT and not r["killed"]:
            if r["pid"] in progressed:
                # Only a process that has committed nothing (its state the one a restart
                # reproduces) heals or restores into its own tensors; after a commit a heal
                # receives into new tensors and a failed one leaves the state whole.
                rep.violations.append(
                    f"process {r['pid']} ({r['group']}) asked for a restart (exit "
                    f"{RESTART_EXIT}) after it had committed: no torn heal explains it"
                )
            else:
                rep.restarts_asked += 1
        elif r["kind"] == "exit" and r["rc"] == HUNG_EXIT and not r["killed"]:
            if r["pid"] in hung_pids:
                rep.hang_exits += 1
            else:
                rep.violations.append(
                    f"process {r['pid']} ({r['group']}) ended as held hung, but its training "
                    "loop never hung: a false hang verdict"
                )
        elif r["kind"] == "exit" and r["rc"] == DIVERGED_EXIT and not r["killed"]:
            # The verdict comes from digests of steps after a flip, within its window.
            ref = last_step.get(r["pid"])
            if ref is None:  # never committed: judge by the run's progress then
                ref = max((c["step"] for c in commits if c["t"] < r["t"]), default=0)
            # A flip at the top of the loop with s steps committed precedes the digest of
            # step s (taken as the next step starts): a stop may come at step s itself.
            if any(f.t < r["t"] and f.step <= ref <= f.end for f in flips):
                rep.divergence_stops += 1
            else:
                rep.violations.append(
                    f"process {r['pid']} ({r['group']}) stopped as diverged (exit "
                    f"{DIVERGED_EXIT}) at step {ref} with no bit flip within the detection "
                    "window before it: a false divergence stop"
                )
        elif r["kind"] == "exit" and r["rc"] != 0 and not r["killed"]:
            rep.violations.append(f"process {r['pid']} ({r['group']}) exited with {r['rc']}")
        if r["kind"] == "start" and r["pid"] not in death:
            rep.violations.append(f"process {r['pid']} ({r['group']}) has no recorded exit")
        if r["kind"] == "start" and _alive(r["pid"]):
            rep.violations.append(f"process {r['pid']} ({r['group']}) is still running")

    judge_total_losses(rep, run, stopped)
    _judge_verdicts(rep, run)
    _judge_goodput(rep, run_dir, run.procs, run.faults)
    _timings(rep, run)
    return rep


def _judge_goodput(
    rep: Report, run_dir: Path, procs: list[dict[str, Any]], faults: list[dict[str, Any]]
) -> None:
    """The lighthouse's goodput (its final ``goodput`` event) against the figure the
    harness computes from the history over the same window (:mod:`torchft.chaos.goodput`):
    more than 1% outside its figure (or range) is a violation. A run without an event log
    has nothing to judge."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return
    events = read_jsonl(path)
    reported = lighthouse_goodput(events)
    if reported is None:
        # A lighthouse's log starts with lighthouse_started and ends, once every group
        # finished, with a final goodput event (a hand-written log in a test may hold neither).
        if any(e.get("kind") == "lighthouse_started" for e in events):
            rep.violations.append("goodput: the lighthouse's event log has no goodput event")
        return
    if not reported.get("final"):
        rep.violations.append(
            "goodput: the lighthouse wrote no final goodput event though every group finished"
        )
    histories = {p.name: read_jsonl(p) for p in sorted(run_dir.glob("*.history.jsonl"))}
    records = [r for lines in histories.values() for r in lines]
    unseen, in_vote = _unseen_steps(run_dir, histories, procs, faults)
    computed = harness_goodput(records + unseen, float(reported["window_start_unix_s"]), in_vote)
    rep.goodput = {
        "lighthouse": reported.get("ratio"),
        "harness": computed["ratio"],
        "harness_high": computed["ratio_high"],
    }
    why = compare(reported, computed)
    if why is not None:
        # Per group, both sides' accounts: where the two figures part (the run directory of
        # a test may be gone by the time anyone looks).
        per_group = []
        for g in reported.get("groups") or []:
            mine = computed["groups"].get(g.get("replica_id"), {})
            per_group.append(
                f"{g.get('replica_id')}: productive {g.get('productive_s')} / "
                f"{mine.get('productive_s', 0.0):.3f}s, heal {g.get('heal_s')}s, quorum "
                f"{g.get('quorum_s')} / {mine.get('quorum_s', 0.0):.3f}s, discarded "
                f"{g.get('discarded_s')} / {mine.get('discarded_s', 0.0):.3f}s, steps "
                f"{g.get('steps_committed')} / {mine.get('steps_committed')}, regressed "
                f"{g.get('regressed_steps')} / {mine.get('regressed_steps')}"
            )
        rep.violations.append(why + "; per group, lighthouse / harness: " + "; ".join(per_group))


def _unseen_steps(
    run_dir: Path,
    histories: dict[str, list[dict[str, Any]]],
    procs: list[dict[str, Any]],
    faults: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """What the history lines miss of processes that died before writing their last step's
    line, from their phase files: the step's record when the vote had returned (phase ``d``
    tells its outcome, see :func:`torchft.chaos.goodput.voted`), and when a process was
    killed inside the vote (phase ``c``: the step may or may not have committed), by pid,
    the time it was killed (the last kill fault naming its group before its exit was seen,
    else that exit). ``histories``: each history file's lines, by file name; ``procs`` and
    ``faults``: the supervisor's and the injector's records."""
    exits = {r["pid"]: r for r in procs if r.get("kind") == "exit" and r.get("killed")}
    records: list[dict[str, Any]] = []
    in_vote: dict[int, float] = {}
    for phase in run_dir.glob("*.phase"):
        try:
            data = phase.read_bytes()
        except OSError:
            continue
        lines = histories.get(phase.name[: -len(".phase")] + ".history.jsonl", [])
        ident = next((r for r in lines if "pid" in r and "group" in r), None)
        if ident is None or data[:1] not in (b"c", b"d"):
            continue
        pid, group, last_t = ident["pid"], ident["group"], max(r["t"] for r in lines)
        outcome = read_voted(data)
        if outcome is not None:
            if outcome["t"] > last_t:  # its line was never written
                before, after = outcome["before"], outcome["after"]
                kind = (
                    "discard" if after == before else "commit" if after == before + 1 else "restore"
                )
                records.append(
                    {
                        "kind": kind,
                        "step": after if kind != "discard" else before,
                        "t": outcome["t"],
                        "quorum_wait": outcome["quorum_wait"],
                        "step_healed": outcome["step_healed"],
                        "group": group,
                        "pid": pid,
                    }
                )
            continue
        end = exits.get(pid)
        if data[:1] != b"c" or end is None:
            continue
        kills = [
            f["t"]
            for f in faults
            if str(f.get("fault", "")).startswith("kill")
            and group in f.get("groups", [])
            and f["t"] <= end["t"]
        ]
        in_vote[pid] = max(kills, default=end["t"])
    return records, in_vote


def _judge_participants(
    rep: Report,
    by_q: dict[tuple[int, int], list[dict[str, Any]]],
    min_replicas: int,
    groups: list[str],
) -> None:
    """The participant count of each (quorum, step) against what the history shows of it.

    At the default ``min_replicas`` of 1 the bound alone never fails, so the count is also
    held against the groups seen committing that step in that quorum: one quorum gives its
    members one count; a member that committed without a heal since its previous commit was
    at the quorum's max step, so it is a participant (with the async quorum a healing member
    sits the step out and only max-step members count); and no quorum has more participants
    than the run has groups (each group runs one process at a time).
    """
    for (q, s), cs in sorted(by_q.items()):
        counts = sorted({c["participants"] for c in cs})
        if len(counts) > 1:
            rep.violations.append(
                f"quorum {q} step {s}: its members reported {counts} participants (one quorum "
                "has one count)"
            )
        steady = sorted({c["group"] for c in cs if not c.get("healed", False)})
        for c in cs:
            n = c["participants"]
            if n < min_replicas:
                rep.violations.append(
                    f"{c['group']} committed step {s} with {n} < {min_replicas} participants"
                )
            if n < len(steady):
                rep.violations.append(
                    f"{c['group']} committed step {s} in quorum {q} with {n} participants, "
                    f"but {len(steady)} groups at its max step committed it there: {steady}"
                )
            if groups and n > len(groups):
                rep.violations.append(
                    f"{c['group']} committed step {s} in quorum {q} with {n} participants, "
                    f"more than the run's {len(groups)} groups"
                )


#: Seconds after an injected hang ends within which a hung verdict on it may still be told
#: (heartbeat and tick delays of the lighthouse).
VERDICT_SLACK_S = 5.0


def _judge_verdicts(rep: Report, run: _Run) -> None:
    """No false verdicts: every ``replica_hung`` in the lighthouse's event log falls within
    an injected hang of that group, and every ``replica_diverged`` within a bit flip's
    detection window (the flipped state may have spread to a group that healed from it, so
    any group may be named). A run without an event log has nothing to judge."""
    for ev in run.events:
        kind = ev.get("kind")
        if kind == "replica_hung":
            group = str(ev.get("replica_id", "")).split(":")[0]
            ts = float(ev.get("ts", 0.0))
            if any(
                h["group"] == group and h["t"] <= ts <= h["t"] + h["seconds"] + VERDICT_SLACK_S
                for h in run.hangs
            ):
                rep.hung_verdicts += 1
            else:
                rep.violations.append(
                    f"the lighthouse held {ev.get('replica_id')} hung (event {ev.get('seq')}) "
                    "while no hang was injected into it: a false hang verdict"
                )
        elif kind == "replica_diverged":
            step = int(ev.get("step", -1))
            ts = float(ev.get("ts", 0.0))
            # A flip at the top of the loop with s steps committed precedes the digest of
            # step s (taken as the next step starts): a verdict may name step s itself.
            if any(f.t <= ts and f.step <= step <= f.end for f in run.flips):
                rep.diverged_verdicts += 1
            else:
                rep.violations.append(
                    f"the lighthouse found {ev.get('replica_id')} diverged at step {step} "
                    f"(event {ev.get('seq')}, action {ev.get('action')}) with no bit flip "
                    "within the detection window before it: a false divergence verdict"
                )


def _healed(f: _Flip, by_q: dict[tuple[int, int], list[dict[str, Any]]]) -> bool:
    """Whether the flipped group's last commit in ``f``'s window that another group also
    committed (same quorum and step) agreed with it."""
    last: tuple[int, float, bool] | None = None
    for (_, s), cs in by_q.items():
        if not f.step < s <= f.end:
            continue
        mine = [c for c in cs if c["group"] == f.group]
        if not mine or not any(c["group"] != f.group for c in cs):
            continue
        key = (s, max(c["t"] for c in mine), len({c["state"] for c in cs}) == 1)
        if last is None or key[:2] > last[:2]:
            last = key
    return last is not None and last[2]


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


def _timings(rep: Report, run: _Run) -> None:
    """Fills faults by kind, the recoveries and the longest survivor stalls.

    Each fault is in effect over a window: a kill until the first commit of every group it
    restarted, a stop until the stopped process's next commit, a hang until the hung group's
    next commit, a slow period for its length, a lighthouse restart until the first commit
    of any group after the daemon is back (a bit flip: the moment it was injected). A fault
    is isolated when no other fault's window overlaps its own.
    """
    commits, procs, faults = run.commits, run.procs, run.faults
    by_pid: dict[int, list[float]] = defaultdict(list)
    by_group: dict[str, list[float]] = defaultdict(list)
    for c in commits:
        by_pid[c["pid"]].append(c["t"])
        by_group[c["group"]].append(c["t"])
    starts = [r for r in procs if r["kind"] == "start"]
    group_of = {s["pid"]: s["group"] for s in starts}
    all_commits = sorted(c["t"] for c in commits)
    for f in faults:
        rep.faults[f["fault"]] = rep.faults.get(f["fault"], 0) + 1

    def first_after(times: list[float], t: float) -> float | None:
        return next((x for x in times if x > t), None)

    # Per fault: its window, and per killed group (restart start, restarted pid, first commit).
    windows: list[tuple[float, float]] = []
    restarts: list[list[tuple[str, dict[str, Any], dict[str, Any], float]]] = []
    for f in faults:
        t, end, back = f["t"], f["t"], []
        if f["fault"] == "kill_lighthouse":
            end = first_after(all_commits, t + f.get("down_s", 0.0)) or t
        elif f["fault"] == "stop":
            pid = next(
                (s["pid"] for s in reversed(starts) if s["group"] == f["groups"][0] and s["t"] < t),
                None,
            )
            stopped = by_pid.get(pid, []) if pid is not None else []
            end = first_after(stopped, t) or t + f.get("seconds", 0.0)
        elif f["fault"] == "hang":
            # Until the hung group commits again (resumed, or restarted after ending itself;
            # commits are sorted by time).
            resumed = first_after(by_group[f["groups"][0]], t)
            end = resumed if resumed is not None else t + f.get("seconds", 0.0)
        elif f["fault"] == "slow":
            # Every group's steps wait for the slow one while it lasts.
            end = t + f.get("seconds", 0.0)
        elif f["fault"] == "kill_all":
            # Reported as total losses (kill -> first commit after it), not as recoveries.
            end = first_after(all_commits, t) or t
        elif f["fault"].startswith("kill"):
            for g in f["groups"]:
                # The group is back at the first commit of any later process of it (the
                # first restart may itself be killed before it commits).
                later = [s for s in starts if s["group"] == g and s["t"] > t]
                firsts = [(x, s) for s in later if (x := first_after(by_pid.get(s["pid"], []), t))]
                if later and firsts:
                    first, back_proc = min(firsts, key=lambda xs: xs[0])
                    back.append((g, later[0], back_proc, first))
                    end = max(end, first)
        windows.append((t, end))
        restarts.append(back)

    def isolated(i: int, lo: float, hi: float) -> bool:
        return not any(j != i and a <= hi and b >= lo for j, (a, b) in enumerate(windows))

    for i, f in enumerate(faults):
        t = f["t"]
        alone = isolated(i, *windows[i])
        for g, start, back_proc, first in restarts[i]:
            again = back_proc is not start
            r = None if again else run.ready.get(start["pid"])
            rep.recoveries.append(
                Recovery(
                    fault=f["fault"],
                    group=g,
                    delay=start["t"] - t,
                    imports=r["imported"] - start["t"] if r else None,
                    setup=r["t"] - r["imported"] if r else None,
                    join=first - r["t"] if r else None,
                    total=first - t,
                    isolated=alone,
                    again=again,
                )
            )
        targets = set(f["groups"])
        for pid, times in by_pid.items():
            if group_of.get(pid) in targets:
                continue
            lo = max((x for x in times if x <= t), default=None)
            hi = first_after(times, t)
            if lo is None or hi is None:
                continue
            stall = hi - t
            rep.stalls_all[f["fault"]] = max(rep.stalls_all.get(f["fault"], 0.0), stall)
            if not isolated(i, lo, hi):
                rep.stalls_overlapped += 1
                continue
            rep.stalls[f["fault"]] = max(rep.stalls.get(f["fault"], 0.0), stall)
