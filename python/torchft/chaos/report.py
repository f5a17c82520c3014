"""The report of a chaos run: what its faults did, the invariants it broke, and how long
recovery took (built by :func:`torchft.chaos.history.check`, printed by the harness)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

#: Exit code of a worker whose Manager asked for a restart (``TornStateError``): the harness
#: restarts it as a supervisor would, and the check does not count it as a crash.
RESTART_EXIT = 75

#: Exit code of a process that ended itself because the lighthouse held its group hung
#: (torchft.hang): expected after an injected ``hang`` fault, a false verdict otherwise.
HUNG_EXIT = 76

#: Exit code of a worker whose Manager raised ``StateDivergedError`` (runtime parity found
#: its committed state disagreeing with no strict majority to heal from): expected within
#: the detection window after an injected ``bitflip``, a false divergence stop otherwise.
DIVERGED_EXIT = 77


@dataclass
class Recovery:
    """One killed group's way back: fault -> restart -> set up -> first commit (seconds)."""

    fault: str
    group: str
    #: Fault -> the restarted process's start (the supervisor's restart delay plus reaping).
    delay: float
    #: Start -> imports done (None when the process recorded no ``ready`` line).
    imports: float | None
    #: Imports done -> Manager, model, DDP and optimizer built.
    setup: float | None
    #: Set up -> first commit (first quorum, heal, the step, the commit vote).
    join: float | None
    total: float
    #: No other fault was in effect at any time during this recovery.
    isolated: bool
    #: The first restart was killed before it committed: ``total`` runs to the first commit
    #: of a later restart (phases are None).
    again: bool = False

    def excess(self, floor: float) -> float:
        """The time beyond this recovery's own restart delay and ``floor``."""
        return self.total - self.delay - floor


@dataclass
class Report:
    """What a run did and whether its history keeps the invariants."""

    faults: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    steps_lost: int = 0
    recoveries: list[Recovery] = field(default_factory=list)
    #: The floors measured in the run (seconds; ``import``, ``torch``), if they were.
    floors: dict[str, float] = field(default_factory=dict)
    #: Longest survivor stall per fault kind, over isolated faults / over all faults.
    stalls: dict[str, float] = field(default_factory=dict)
    stalls_all: dict[str, float] = field(default_factory=dict)
    stalls_overlapped: int = 0
    commits: int = 0
    #: Processes that ended asking to be restarted (a heal torn with no source left).
    restarts_asked: int = 0
    #: Processes that ended themselves while their injected hang outlasted the hang timeout.
    hang_exits: int = 0
    #: Bit flips applied (``bitflip`` history lines), and those after which the flipped
    #: group's state agreed with the others' again within the detection window.
    bitflips: int = 0
    bitflips_healed: int = 0
    #: (quorum, step) pairs committed with several states that a bit flip's window excused.
    divergences_excused: int = 0
    #: Processes that stopped as diverged (exit 77) within a bit flip's detection window.
    divergence_stops: int = 0
    #: The lighthouse's verdicts in its event log (``events.jsonl``), each explained by an
    #: injected fault: ``replica_hung`` during an injected hang of that group, and
    #: ``replica_diverged`` within a bit flip's detection window.
    hung_verdicts: int = 0
    diverged_verdicts: int = 0
    #: Per ``kill_all``: the best step at the kill, the snapshot step resumed from, the steps
    #: lost, and seconds from the kill to the first commit after it.
    total_losses: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    #: The goodput ratio the lighthouse reported and the one the harness computed.
    goodput: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        """The human-readable report."""
        lines = [f"faults injected: {sum(self.faults.values())}"]
        for kind, n in sorted(self.faults.items()):
            lines.append(f"  {kind:<18} {n}")
        lines.append(f"commits recorded: {self.commits}")
        if self.floors:
            lines.append(
                "floors in this run: import (spawn -> import torch done) "
                f"{self.floors['import']:.2f}s, torch (+ import torch._dynamo, which "
                f"torch.optim does) {self.floors['torch']:.2f}s"
            )
        lines += self._recovery_lines()
        lines.append(
            "longest survivor stall per fault kind (fault -> a survivor's next commit), "
            f"isolated faults / all ({self.stalls_overlapped} overlapped stalls):"
        )
        for kind in sorted(set(self.stalls) | set(self.stalls_all)):
            iso = f"{self.stalls[kind]:.2f}s" if kind in self.stalls else "-"
            lines.append(f"  {kind:<18} {iso:>7} / {self.stalls_all[kind]:.2f}s")
        lines.append(
            f"unavoidable regressions: {len(self.regressions)} (steps lost {self.steps_lost})"
        )
        for r in self.regressions:
            lines.append(f"  {r}")
        lines.append(
            f"restarts asked for (a heal into own tensors torn, no source left): "
            f"{self.restarts_asked}"
        )
        lines.append(
            f"hung processes that ended themselves (held hung, restarted): {self.hang_exits}"
        )
        lines.append(
            f"lighthouse verdicts, each explained by an injected fault: hung "
            f"{self.hung_verdicts}, diverged {self.diverged_verdicts}"
        )
        lines.append(
            f"bit flips applied: {self.bitflips} (healed within the detection window: "
            f"{self.bitflips_healed}); (quorum, step) pairs with several states excused "
            f"within a window: {self.divergences_excused}"
        )
        lines.append(
            f"divergence stops (exit {DIVERGED_EXIT} within a bit flip's window, restarted): "
            f"{self.divergence_stops}"
        )
        if self.total_losses:
            lost = [t["lost"] for t in self.total_losses]
            resumed = sorted(t["resumed_s"] for t in self.total_losses if t["resumed_s"])
            lines.append(
                f"total losses (every group killed): {len(self.total_losses)}; resumed from "
                f"the newest complete snapshot, steps lost max {max(lost)} (interval "
                f"{self.total_losses[0]['every']}), kill -> first commit p50 "
                + (f"{resumed[len(resumed) // 2]:.2f}s" if resumed else "-")
            )
            for t in self.total_losses:
                unfinished = t.get("unfinished") or []
                diverged = t.get("diverged") or []
                reported = t.get("reported")
                lines.append(
                    f"  best step {t['best']} -> snapshot {t['snapshot']}: {t['lost']} lost"
                    + (
                        f"; writers of {unfinished} did not reach the next snapshot step"
                        if unfinished
                        else ""
                    )
                    + (f"; snapshots of {diverged} refused as diverged" if diverged else "")
                    + (f"; newest reported complete {reported[0]}" if reported else "")
                    + (" (with the lighthouse" if t["lighthouse"] else "")
                    + (", state file deleted)" if t["wiped"] else ")" if t["lighthouse"] else "")
                )
        if self.goodput:
            lh, hs = self.goodput.get("lighthouse"), self.goodput.get("harness")
            high = self.goodput.get("harness_high")
            lines.append(
                "goodput (productive / wall time): lighthouse "
                + (f"{lh:.4f}" if lh is not None else "-")
                + ", harness (from the history) "
                + (f"{hs:.4f}" if hs is not None else "-")
                + (
                    f" to {high:.4f} (a kill inside a vote: its step may have committed)"
                    if hs is not None and high is not None and high > hs
                    else ""
                )
            )
        lines.append(f"final: {self.final}")
        lines.append(f"violations: {len(self.violations)}")
        for v in self.violations[:50]:
            lines.append(f"  VIOLATION {v}")
        return "\n".join(lines)

    def _recovery_lines(self) -> list[str]:
        once = [r for r in self.recoveries if not r.again]
        again = sorted(r.total for r in self.recoveries if r.again)
        if not self.recoveries:
            return []
        lines = [
            "recovery (kill -> first commit of the restarted group); per kill: delay = kill "
            "-> restart of that group, excess = recovery - delay - floor:"
        ]
        for label, rs in (
            ("all", once),
            ("isolated", [r for r in once if r.isolated]),
            ("overlapped", [r for r in once if not r.isolated]),
        ):
            if not rs:
                lines.append(f"  {label:<10} none")
                continue
            total = sorted(r.total for r in rs)
            line = (
                f"  {label:<10} {len(rs):>3}: p50 {_pct(total, 50):.2f}s  "
                f"p95 {_pct(total, 95):.2f}s  max {total[-1]:.2f}s  "
                f"delay p50 {_pct(sorted(r.delay for r in rs), 50):.2f}s"
            )
            if self.floors:
                line += "  excess p50 " + " / ".join(
                    f"{_pct(sorted(r.excess(f) for r in rs), 50):+.2f}s ({name} floor)"
                    for name, f in self.floors.items()
                )
            lines.append(line)
            phased = [r for r in rs if r.join is not None]
            if phased:
                med = {
                    k: _pct(sorted(getattr(r, k) for r in phased), 50)
                    for k in ("imports", "setup", "join")
                }
                lines.append(
                    f"  {'':<10}      phases p50: imports {med['imports']:.2f}s  setup "
                    f"(Manager, model, DDP) {med['setup']:.2f}s  join (quorum, heal, "
                    f"first commit) {med['join']:.2f}s"
                )
        if again:
            lines.append(
                f"  restarts killed again before their first commit: {len(again)} (kill -> "
                f"the group's first commit p50 {_pct(again, 50):.2f}s, max {again[-1]:.2f}s)"
            )
        return lines


def _pct(sorted_vals: list[float], p: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    return statistics.quantiles(sorted_vals, n=100, method="inclusive")[int(p) - 1]
