"""One lighthouse daemon, two jobs (rooms), real replica-group processes.

Job ``a`` and job ``b`` each run two replica groups with the same names (``rg0``, ``rg1``)
against one ``torchft_lighthouse`` process, told apart only by ``TORCHFT_JOB``. Job ``a``
suffers bad requests, a SIGKILLed group (restarted) and a SIGSTOPped group (hung past the
heartbeat timeout, then resumed); job ``b`` must not notice: one quorum id for its whole run,
every step committed. Both end with their own single state (same step ⇒ identical parameters
and optimizer state within each job).
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster, Group
from conftest import start_lighthouse_process
from test_fault_tolerance import assert_identical

from torchft._torchft import LighthouseClient


def _status(addr: str, job: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{addr}/status?job={job}", timeout=5) as r:
        result: dict[str, Any] = json.loads(r.read())
    return result


def _min_step(groups: list[Group]) -> int:
    return min(s for g in groups for s in g.steps())


@pytest.mark.timeout(240)
def test_faults_in_one_job_leave_the_other_job_untouched(tmp_path: Path) -> None:
    lh = start_lighthouse_process(
        "--min_replicas",
        "1",
        "--room_min_replicas",
        "b=2",
        "--quorum_tick_ms",
        "20",
        "--join_timeout_ms",
        "500",
        "--heartbeat_timeout_ms",
        "3000",
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    job_a = Cluster(tmp_path / "a", lh.address)
    job_b = Cluster(tmp_path / "b", lh.address)
    stop_polling = threading.Event()
    b_quorums: set[int] = set()
    try:
        extra = ["--step-sleep", "0.05"]
        a = [job_a.start(f"rg{i}", seed=i, extra=extra, env={"TORCHFT_JOB": "a"}) for i in (0, 1)]
        b = [job_b.start(f"rg{i}", seed=i, extra=extra, env={"TORCHFT_JOB": "b"}) for i in (0, 1)]
        job_b.wait_until(lambda: _min_step(b) >= 10, 120, "job b at step 10")
        job_a.wait_until(lambda: _min_step(a) >= 10, 120, "job a at step 10")
        status_b = _status(lh.address, "b")
        assert status_b["job"] == "b"
        assert status_b["min_replicas"] == 2
        assert len(status_b["members"]) == 2
        assert [r["job"] for r in status_b["rooms"]] == ["", "a", "b"]
        b_quorums.add(status_b["quorum_id"])

        def poll_b() -> None:
            while not stop_polling.wait(0.2):
                try:
                    b_quorums.add(_status(lh.address, "b")["quorum_id"])
                except (OSError, urllib.error.URLError, ValueError):
                    pass  # a slow page under load: the next poll reads it

        poller = threading.Thread(target=poll_b, name="poll-b", daemon=True)
        poller.start()
        a_quorum = _status(lh.address, "a")["quorum_id"]

        # Bad input in job a's room, and a job name the lighthouse refuses.
        client = LighthouseClient(lh.address, timedelta(seconds=10), job="a")
        with pytest.raises(ValueError, match="replica_id"):
            client.quorum(replica_id="", timeout=timedelta(seconds=5))
        with pytest.raises(ValueError, match="invalid job name"):
            LighthouseClient(lh.address, timedelta(seconds=10), job="../b")

        # SIGKILL in job a; its survivor goes on (min_replicas 1), the group comes back.
        job_a.kill(a[1])
        at_kill = max(a[1].steps())
        job_a.wait_until(lambda: min(a[0].steps()) >= at_kill + 5, 60, "a/rg0 alone")
        reborn = job_a.start("rg1", seed=7, extra=extra, env={"TORCHFT_JOB": "a"})
        job_a.wait_until(lambda: min(reborn.steps()) > at_kill + 5, 120, "a/rg1 to heal")

        # A hang in job a: rg0 frozen past the heartbeat timeout, then resumed.
        for p in a[0].procs:
            p.send_signal(signal.SIGSTOP)
        frozen_at = max(a[0].steps())
        job_a.wait_until(lambda: min(reborn.steps()) >= frozen_at + 5, 60, "a/rg1 alone")
        for p in a[0].procs:
            p.send_signal(signal.SIGCONT)
        job_a.wait_until(lambda: min(a[0].steps()) > frozen_at + 5, 120, "a/rg0 back")
        assert _status(lh.address, "a")["quorum_id"] != a_quorum, "job a's faults changed quorums"
        assert _status(lh.address, "a")["lost"], "job a's room recorded its losses"
        # (Checked before the end: a group that finishes and exits is a loss too.)
        assert not _status(lh.address, "b")["lost"], "job b's room recorded none"

        target_a = max(s for g in job_a.live() for s in g.steps()) + 10
        target_b = max(s for g in job_b.live() for s in g.steps()) + 10
        job_a.stop_at(target_a)
        job_b.stop_at(target_b)
        results_a = job_a.finish(120)
        results_b = job_b.finish(120)
        stop_polling.set()
        poller.join(timeout=5)

        assert_identical(results_a, target_a)
        assert_identical(results_b, target_b)
        assert len(results_a) == len(results_b) == 2
        assert len(b_quorums) == 1, f"job b's quorum changed: {sorted(b_quorums)}"
        for r in results_b:
            failed = [step for step, committed, _ in r["attempts"] if not committed]
            assert not failed, f"job b's {r['replica_id']} failed steps {failed}"
    finally:
        stop_polling.set()
        job_a.close()
        job_b.close()
        lh.stop()
