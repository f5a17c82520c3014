"""Synthetic chaos runs for the offline checker: the records the worker, the supervisor and
the fault injector write, built by hand."""

from __future__ import annotations

import json
from pathlib import Path


def _write(path: Path, recs: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _read(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(
    path: Path,
    histories: dict[str, list[dict[str, object]]],
    processes: list[dict[str, object]],
    faults: list[dict[str, object]] | None = None,
) -> None:
    """Writes a synthetic run for the offline checker into ``path``: the history file of
    each name in ``histories`` (``a`` → ``a.history.jsonl``), the supervisor's process
    records and, if given, the fault injector's records."""
    for name, recs in histories.items():
        _write(path / f"{name}.history.jsonl", recs)
    _write(path / "processes.jsonl", processes)
    if faults is not None:
        _write(path / "faults.jsonl", faults)


# Records of a synthetic run, as the worker, the supervisor and the fault injector write them.


def _commit(
    group: str,
    pid: int,
    step: int,
    q: int,
    state: str,
    t: float,
    healed: bool = False,
    participants: int = 1,
    rank: int | None = None,
) -> dict[str, object]:
    return {
        "kind": "commit",
        "group": group,
        "pid": pid,
        "step": step,
        "quorum_id": q,
        "participants": participants,
        "participating_rank": rank,
        "state": state,
        "healed": healed,
        "t": t,
    }


def _finish(group: str, pid: int, step: int, state: str, t: float) -> dict[str, object]:
    return {"kind": "finish", "group": group, "pid": pid, "step": step, "state": state, "t": t}


def _hang(group: str, pid: int, step: int, t: float) -> dict[str, object]:
    """A hang injected into ``pid`` (20 s) after it committed ``step``."""
    return {"kind": "hang", "group": group, "pid": pid, "seconds": 20.0, "step": step, "t": t}


def _start(group: str, pid: int, t: float) -> dict[str, object]:
    return {"kind": "start", "group": group, "pid": pid, "t": t}


def _exit(group: str, pid: int, t: float, rc: int = 0) -> dict[str, object]:
    """An exit nobody caused (the process ended on its own with ``rc``)."""
    return {"kind": "exit", "group": group, "pid": pid, "rc": rc, "killed": False, "t": t}


def _killed(group: str, pid: int, t: float) -> dict[str, object]:
    """The exit of a process the fault injector SIGKILLed."""
    return {"kind": "exit", "group": group, "pid": pid, "rc": -9, "killed": True, "t": t}


def _life(group: str, pid: int, start: float, end: float, rc: int = 0) -> list[dict[str, object]]:
    """A process started at ``start`` that ended on its own with ``rc`` at ``end``."""
    return [_start(group, pid, start), _exit(group, pid, end, rc)]


def _fault(fault: str, groups: list[str], t: float, **more: object) -> dict[str, object]:
    return {"kind": "fault", "fault": fault, "groups": groups, "t": t, **more}
