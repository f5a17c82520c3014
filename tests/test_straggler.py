"""Lasting stragglers acted on, with real processes: with ``--straggler_drop_after_ms`` a
group that stays a straggler that long is dropped from the quorum for as long again and told
why; the others go on at their own pace, and the slow group rejoins, heals and ends with the
same state."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import start_lighthouse_process
from test_hang import Job, _commits, _history, _status

WINDOW_MS = 4000


def _dropped_events(addr: str, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in _status(addr)["events"]
        if e["kind"] == "straggler_dropped" and e["replica_id"] == name
    ]


def _interval(commits: list[dict[str, Any]]) -> float:
    """Median seconds between consecutive commits."""
    ts = [c["t"] for c in commits]
    return statistics.median(b - a for a, b in zip(ts, ts[1:], strict=False))


@pytest.mark.timeout(240)
def test_a_lasting_straggler_is_dropped_told_why_and_rejoins(tmp_path: Path) -> None:
    lh = start_lighthouse_process(
        "--min_replicas",
        "1",
        "--quorum_tick_ms",
        "50",
        "--straggler_drop_after_ms",
        str(WINDOW_MS),
    )
    job = Job(tmp_path, lh.address, env={"TORCHFT_PARITY_EVERY": "0"})
    names = ["g0", "g1", "g2"]
    slow = "g2"
    slow_file = tmp_path / f"{slow}.slow"
    try:
        for n in names:
            job.start(n, "exit")
        job.wait_for(
            "every group committing together",
            lambda: all(
                len([c for c in _commits(job.history(n)) if c["participants"] == 3]) >= 20
                for n in names
            ),
            120,
        )
        slow_at = time.time()
        slow_file.write_text("0.25")
        event = job.wait_for(
            "a straggler_dropped event naming the slow group",
            lambda: next(iter(_dropped_events(lh.address, slow)), None),
            90,
        )
        assert event["incarnation"].startswith(slow + ":"), event
        assert event["for_s"] == WINDOW_MS / 1000, event
        assert "straggler for" in event["reason"], event
        dropped_at = time.time()
        assert not _dropped_events(lh.address, "g0"), "a fast group is never dropped"
        # The others go on without it, at their own pace, while it is out.
        paced = [c for c in _commits(job.history("g0")) if slow_at + 2 < c["t"] < dropped_at]
        job.wait_for(
            "the others committing without it",
            lambda: (
                len(
                    [
                        c
                        for c in _commits(job.history("g0"))
                        if c["t"] > dropped_at and c["participants"] == 2
                    ]
                )
                >= 10
            ),
            30,
        )
        status = _status(lh.address)
        assert any(d["replica_id"].startswith(slow + ":") for d in status["dropped"]), status
        fast = [
            c for c in _commits(job.history("g0")) if c["t"] > dropped_at and c["participants"] == 2
        ]
        # While it was slow it set everyone's pace; without it the others step far faster.
        assert len(paced) >= 3, paced
        assert _interval(fast) < _interval(paced) / 2, (_interval(fast), _interval(paced))
        slow_file.unlink()
        # Told why: its manager logs the lighthouse's reason while its request waits.
        job.wait_for(
            "the slow group's log saying why it waits",
            lambda: "dropped from the quorum" in job.log(slow, 0),
            30,
        )
        # The drop ends: it rejoins, heals and trains with the others again.
        job.wait_for(
            "the slow group committing with all the others again",
            lambda: any(
                c["t"] > dropped_at and c["participants"] == 3 for c in _commits(job.history(slow))
            ),
            60,
        )
        top = max(c["step"] for n in names for c in _commits(job.history(n)))
        job.set_target(top + 10)
        for n in names:
            assert job.procs[n].wait(timeout=120) == 0, job.log(n, 0)[-4000:]
        finals = {n: [e for e in _history(job.history(n)) if "finished" in e][-1] for n in names}
        assert len({f["finished"] for f in finals.values()}) == 1, finals
        assert len({f["state"] for f in finals.values()}) == 1, finals
    finally:
        job.close()
        lh.stop()
        (tmp_path / "lighthouse.log").write_text("".join(lh.log))
