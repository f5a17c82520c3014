"""Goodput and the end-of-run report, end to end: real replica-group processes train against a
real lighthouse with an event log; one group is SIGKILLed and restarted. The lighthouse's
accounts must add up, name the killed group's lost time, reach /status, /metrics and
/history, and the report it writes when every group finished must match the one
``python -m torchft.eventlog --html`` builds from its event log, and draw in a browser.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _browser import chromium_available, headless_chromium
from test_run_summary import assert_no_alert_and_no_errors, open_report
from test_telemetry import LONG, Job, http, status

ACCOUNTS = ("productive_s", "quorum_s", "discarded_s", "heal_s", "recovery_s", "regressed_s")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()


def _adds_up(f: dict[str, Any]) -> None:
    parts = sum(f[k] for k in ACCOUNTS)
    assert abs(parts - f["wall_s"]) < 0.01 + 1e-3 * f["wall_s"], f
    assert all(f[k] >= 0 for k in ACCOUNTS), f
    assert 0 < f["ratio"] < 1, f
    assert abs(f["ratio"] - f["productive_s"] / f["wall_s"]) < 1e-3, f


@pytest.mark.timeout(240)
def test_goodput_accounts_a_kill_and_the_report_is_written_when_the_job_ends(
    job: Job, tmp_path: Path
) -> None:
    for i, name in enumerate(["g0", "g1"]):
        job.cluster.start(name, seed=i, extra=LONG + ["--step-sleep", "0.02"])
    job.wait_states({"g0": "healthy", "g1": "healthy"}, 90, "two healthy groups")
    victim = job.cluster.groups[1]
    job.cluster.wait_until(lambda: min(victim.steps()) >= 10, 60, "g1 at step 10")
    live = status(job.addr)["goodput"]
    assert live is not None and live["ratio"] is not None, live
    job.cluster.kill(victim)
    job.wait_states({"g1": "lost"}, 10, "g1 lost")
    job.cluster.start("g1", seed=1, extra=LONG + ["--step-sleep", "0.02"])
    job.wait_states({"g1": "healthy", "g0": "healthy"}, 90, "g1 healthy again")
    target = max(max(g.steps()) for g in job.cluster.live()) + 20
    job.cluster.stop_at(target)
    results = job.cluster.finish(60)
    assert len({r["param_hash"] for r in results}) == 1

    def final() -> dict[str, Any] | None:
        return next((e for e in job.events() if e["kind"] == "goodput" and e.get("final")), None)

    job.cluster.wait_until(lambda: final() is not None, 30, "the final goodput event")
    event = final()
    assert event is not None
    _adds_up(event)
    groups = {g["replica_id"]: g for g in event["groups"]}
    assert set(groups) == {"g0", "g1"}
    for g in groups.values():
        _adds_up(g)
        assert g["state"] == "finished"
        assert g["phases"]["forward_s"] > 0 and g["phases"]["backward_s"] > 0, g
    # The killed group lost time (dead, restarting, joining, healing): g0 did not.
    assert groups["g1"]["recovery_s"] + groups["g1"]["heal_s"] > groups["g0"]["recovery_s"] + 1
    assert groups["g1"]["ratio"] < groups["g0"]["ratio"]
    assert event["steps_committed"] >= 2 * 20
    periodic = [e for e in job.events() if e["kind"] == "goodput" and not e["final"]]
    assert periodic, "goodput is logged while the job trains"
    assert all(e["wall_s"] <= event["wall_s"] + 1e-6 for e in periodic)

    # /status, /metrics and /history say the same.
    body = status(job.addr)
    assert body["goodput"]["ratio"] == pytest.approx(event["ratio"], abs=1e-6)
    by_id = {r["replica_id"]: r for r in body["replicas"]}
    assert by_id["g1"]["goodput_ratio"] == pytest.approx(groups["g1"]["ratio"], abs=1e-6)
    # The system side of the reports reached it too (sampled once a second by each rank).
    t = by_id["g0"]["timings"]
    assert t["host_mem_total_bytes"] > 0, t
    assert 0 < t["host_mem_available_bytes"] <= t["host_mem_total_bytes"], t
    assert t["net_rx_bytes_per_s"] >= 0 and 0 <= t["host_steal"] <= 1, t
    assert t["gpu_util_pct"] is None and t["gpu_mem_used_bytes"] is None, "no GPU here"
    code, metrics = http(job.addr, "/metrics")
    assert code == 200
    text = metrics.decode()
    assert 'torchft_replica_host_memory_available_bytes{replica_id="g0"}' in text
    assert 'torchft_replica_gpu_utilization_ratio{replica_id="g0"}' not in text, "no GPU here"
    assert f"torchft_goodput_ratio {event['ratio']}" in text or "torchft_goodput_ratio 0." in text
    assert 'torchft_goodput_seconds_total{account="recovery"}' in text
    assert 'torchft_replica_goodput_ratio{replica_id="g1"}' in text
    code, hist = http(job.addr, "/history")
    points = json.loads(hist)["points"]
    assert code == 200 and len(points) >= 5, points
    assert any(p["ratio"] is not None for p in points)
    steps = [p["step"] for p in points if p["step"] is not None]
    assert steps[-1] >= target - 1 and steps[0] < steps[-1]

    # The report the lighthouse wrote next to its event log when every group finished ...
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["finished"] is True and written["source"] == "lighthouse"
    assert written["goodput"]["ratio"] == pytest.approx(event["ratio"], abs=1e-6)
    assert (tmp_path / "summary.html").stat().st_size > 0
    # ... and the one built from the event log afterwards agree.
    out_dir = tmp_path / "offline"
    out_dir.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "torchft.eventlog", str(job.event_log), "--html", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    offline = json.loads((out_dir / "summary.json").read_text())
    assert offline["finished"] is True and offline["source"] == "event_log"
    for key in ("ratio", "wall_s", "productive_s", "steps_committed", "window_start_unix_s"):
        assert offline["goodput"][key] == pytest.approx(written["goodput"][key], abs=1e-6), key
    assert [g["replica_id"] for g in offline["groups"]] == ["g0", "g1"]
    for a, b in zip(offline["groups"], written["groups"], strict=True):
        assert a["ratio"] == pytest.approx(b["ratio"], abs=1e-6)
    kinds = {t["kind"] for t in written["timeline"]}
    assert {"state_changed", "replica_lost", "quorum_changed"} <= kinds
    assert kinds <= {t["kind"] for t in offline["timeline"]} | {"lighthouse_started"}
    assert len(written["series"]) == len(offline["series"])

    # The lighthouse's own page draws in a real browser.
    reason = chromium_available()
    if reason:
        pytest.skip(f"browser check: {reason}")
    with headless_chromium() as driver:
        got = open_report(driver, tmp_path / "summary.html")
        assert_no_alert_and_no_errors(driver)
        for chart, drawn in got["charts"].items():
            assert drawn["paths"] + drawn["rects"] > 0, chart
        assert got["header"]["goodput"] == f"{event['ratio'] * 100:.1f}%"
        assert got["header"]["finished"] == "yes"


@pytest.mark.timeout(60)
def test_summary_on_request_and_without_an_event_log(job: Job, tmp_path: Path) -> None:
    """POST /summary writes the report now; GET serves it; a lighthouse without an event
    log answers 409 and writes nothing."""
    code, body = http(job.addr, "/summary", method="POST", body=b"")
    assert code == 200, body
    paths = json.loads(body)
    assert Path(paths["json"]) == tmp_path / "summary.json"
    assert json.loads(Path(paths["json"]).read_text())["finished"] is False
    code, page = http(job.addr, "/summary.html")
    assert code == 200 and b"summary-data" in page
    code, body = http(job.addr, "/summary?job=nope")
    assert code == 404

    from torchft._torchft import LighthouseServer

    bare = LighthouseServer("127.0.0.1:0", min_replicas=1)
    try:
        code, body = http(bare.address(), "/summary", method="POST", body=b"")
        assert code == 409 and b"--event_log" in body, body
        code, body = http(bare.address(), "/summary")
        assert code == 200 and json.loads(body)["goodput"] is None
    finally:
        bare.shutdown()
