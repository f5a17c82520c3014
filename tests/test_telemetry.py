"""Replica health telemetry end to end: real replica-group processes report to a real
lighthouse, which derives states, serves /status, /metrics, /events and the dashboard, and
writes the event log.

Covers the acceptance of the telemetry stream: a straggler is flagged and cleared, a
SIGKILLed group walks lost -> joining/healing -> healthy (and the event log says so),
/metrics parses with the Prometheus parser, the dashboard in headless Chromium shows the
replicas and updates them, and garbage on the telemetry path or the HTTP endpoints is refused
without affecting training.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster

from torchft._torchft import LighthouseServer, ManagerClient, ManagerServer

# Workers run until told to stop (the default step limit is reached in seconds here).
LONG = ["--max-steps", "1000000"]


def http(addr: str, path: str, method: str = "GET", body: bytes | None = None) -> Any:
    """(status, body bytes) of one request to the lighthouse."""
    req = urllib.request.Request(addr + path, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def status(addr: str) -> dict[str, Any]:
    code, body = http(addr, "/status")
    assert code == 200, body
    return json.loads(body)


def replicas(addr: str) -> dict[str, dict[str, Any]]:
    return {r["replica_id"]: r for r in status(addr)["replicas"]}


class Job:
    """A lighthouse with an event log and a cluster of replica groups."""

    def __init__(self, tmp: Path, **lighthouse_kwargs: Any) -> None:
        self.event_log = tmp / "events.jsonl"
        self.lighthouse = LighthouseServer(
            "127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=3000,
            quorum_tick_ms=20,
            heartbeat_timeout_ms=2000,
            event_log=str(self.event_log),
            **lighthouse_kwargs,
        )
        self.addr = self.lighthouse.address()
        self.cluster = Cluster(tmp, self.addr)

    def wait_states(self, want: dict[str, str | set[str]], timeout: float, what: str) -> None:
        def ok() -> bool:
            reps = replicas(self.addr)
            for name, states in want.items():
                allowed = {states} if isinstance(states, str) else states
                if reps.get(name, {}).get("state") not in allowed:
                    return False
            return True

        try:
            self.cluster.wait_until(ok, timeout, what)
        except BaseException:
            print(json.dumps(replicas(self.addr), indent=1)[:4000])
            raise

    def events(self) -> list[dict[str, Any]]:
        """The complete lines of the event log (one being written may be cut short)."""
        text = self.event_log.read_text()
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line]

    def close(self) -> None:
        self.cluster.close()
        self.lighthouse.shutdown()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()


def transitions(events: list[dict[str, Any]], replica: str) -> list[tuple[str, str]]:
    return [
        (e["from"], e["to"])
        for e in events
        if e["kind"] == "state_changed" and e["replica_id"] == replica
    ]


@pytest.mark.timeout(180)
def test_straggler_is_flagged_named_by_its_cause_and_cleared(job: Job, tmp_path: Path) -> None:
    """g2's input slowed (a sleep before its forward): flagged a straggler named input-bound;
    cleared when it recovers; then its backward slowed three times: named compute-bound
    within 16 steps. The others are never flagged, and the state stays identical."""
    sleep_file = tmp_path / "g2.sleep"
    backward_file = tmp_path / "g2.backward"
    for i, name in enumerate(["g0", "g1", "g2"]):
        extra = (
            ["--sleep-file", str(sleep_file), "--backward-sleep-file", str(backward_file)]
            if name == "g2"
            else []
        )
        job.cluster.start(name, seed=i, extra=extra + LONG)
    healthy = {"g0": "healthy", "g1": "healthy", "g2": "healthy"}
    job.wait_states(healthy, 90, "three healthy groups")
    # Let every group fill its timing window at full speed.
    job.cluster.wait_until(
        lambda: (
            all(len(s) and min(s) >= 0 for s in [g.steps() for g in job.cluster.groups])
            and min(replicas(job.addr)[n]["counters"]["steps_committed"] for n in healthy) >= 10
        ),
        60,
        "ten steps everywhere",
    )
    # Steps are counted from the worker's own progress file: the lighthouse's view lags by
    # the report batching (a fraction of a second, many steps at full speed).
    slow = job.cluster.groups[2]
    # Before the slow-down a starved CPU may flag any group for a moment (a real verdict on a
    # loaded machine): the assertions about who is flagged cover the slow-down only.
    slow_from = job.events()[-1]["seq"]
    sleep_file.write_text("0.25")
    started = max(slow.steps())
    job.wait_states({"g2": "straggler", "g0": "healthy", "g1": "healthy"}, 60, "g2 straggler")
    flagged_at = max(slow.steps())
    print(f"straggler flagged after {flagged_at - started} steps")
    reps = replicas(job.addr)
    assert flagged_at - started <= 30, f"flagged after {flagged_at - started} steps"
    # Named by where its time went: before the forward (its input).
    assert reps["g2"]["straggler_cause"] == "input-bound", reps["g2"]
    assert reps["g2"]["timings"]["input_s"] > 3 * reps["g0"]["timings"]["input_s"], reps
    assert reps["g2"]["straggler"] and not reps["g0"]["straggler"]
    busy = {n: reps[n]["timings"]["busy_s"] for n in healthy}
    assert busy["g2"] > 2 * max(busy["g0"], busy["g1"]), busy
    assert busy["g0"] < 0.1, busy
    assert reps["g2"]["skew_pct"] > 50
    assert status(job.addr)["stragglers"] == ["g2"]

    sleep_file.unlink()
    job.wait_states(healthy, 60, "g2 healthy again")

    def since_slow() -> list[dict[str, Any]]:
        return [e for e in job.events() if e["seq"] > slow_from]

    # The event log is written by its own thread: /status can be a moment ahead of it.
    job.cluster.wait_until(
        lambda: any(
            e["kind"] == "straggler_cleared" and e.get("replica_id") == "g2" for e in since_slow()
        ),
        30,
        "g2's clearing logged",
    )
    events = since_slow()
    kinds = [(e["kind"], e.get("replica_id")) for e in events]
    assert ("straggler_flagged", "g2") in kinds
    assert ("straggler_cleared", "g2") in kinds
    cleared = kinds.index(("straggler_cleared", "g2"))
    assert ("straggler_flagged", "g0") not in kinds[:cleared], kinds
    assert ("straggler_flagged", "g1") not in kinds[:cleared], kinds
    flags = [e for e in events[:cleared] if e["kind"] == "straggler_flagged"]
    assert flags[0]["cause"] == "input-bound", flags
    evidence = flags[0]["evidence"]
    assert evidence["input_s"] > 3 * evidence["job_input_s"], evidence

    # A slow backward (three times the step's busy time, inside the backward pass): named
    # compute-bound within 16 steps, in /status, the event and /metrics.
    busy_before = replicas(job.addr)["g2"]["timings"]["busy_s"]
    slow_from = job.events()[-1]["seq"]
    backward_file.write_text(str(max(3 * busy_before, 0.1)))
    started = max(slow.steps())
    job.cluster.wait_until(
        lambda: replicas(job.addr)["g2"].get("straggler_cause") == "compute-bound",
        60,
        "g2 named compute-bound",
    )
    named_at = max(slow.steps())
    print(f"compute-bound named after {named_at - started} steps")
    assert named_at - started <= 16, f"named after {named_at - started} steps"
    reps = replicas(job.addr)
    assert not reps["g0"]["straggler"] and not reps["g1"]["straggler"], reps
    assert reps["g2"]["timings"]["backward_s"] > 2 * reps["g0"]["timings"]["backward_s"], reps
    code, body = http(job.addr, "/metrics")
    assert code == 200
    assert 'torchft_straggler{replica_id="g2",cause="compute-bound"} 1' in body.decode(), body
    backward_file.unlink()
    job.wait_states(healthy, 60, "g2 healthy again after its slow backward")
    job.cluster.wait_until(
        lambda: any(
            e["kind"] == "straggler_flagged" and e.get("cause") == "compute-bound"
            for e in job.events()
            if e["seq"] > slow_from
        ),
        30,
        "the compute-bound verdict logged",
    )

    # Telemetry did not disturb training: same step => identical state.
    target = max(max(g.steps()) for g in job.cluster.groups) + 5
    job.cluster.stop_at(target)
    results = job.cluster.finish(60)
    assert {r["step"] for r in results} == {target}
    assert len({r["param_hash"] for r in results}) == 1
    assert len({r["optim_hash"] for r in results}) == 1
    # A clean exit is reported as finished.
    job.wait_states({n: "finished" for n in healthy}, 20, "finished")


@pytest.mark.timeout(180)
def test_sigkill_walks_lost_joining_healing_healthy_and_is_logged(job: Job) -> None:
    for i, name in enumerate(["g0", "g1"]):
        job.cluster.start(name, seed=i, extra=LONG)
    job.wait_states({"g0": "healthy", "g1": "healthy"}, 90, "two healthy groups")
    victim = job.cluster.groups[1]
    job.cluster.wait_until(lambda: min(victim.steps()) >= 5, 60, "g1 at step 5")
    job.cluster.kill(victim)
    job.wait_states({"g1": "lost"}, 10, "g1 lost")
    assert replicas(job.addr)["g1"]["counters"]["lost"] == 1
    job.cluster.start("g1", seed=1, extra=LONG)
    job.wait_states({"g1": "healthy", "g0": "healthy"}, 90, "g1 healthy again")
    reps = replicas(job.addr)
    assert reps["g1"]["counters"]["incarnations"] == 2
    assert reps["g1"]["counters"]["heals"] >= 1
    assert reps["g1"]["counters"]["heal_bytes"] > 0

    def healed_in_log() -> bool:
        walk = transitions(job.events(), "g1")
        if ("healthy", "lost") not in walk:
            return False
        return "healthy" in [to for _, to in walk[walk.index(("healthy", "lost")) + 1 :]]

    # The event log is written by its own thread: /status can be a moment ahead of it.
    job.cluster.wait_until(healed_in_log, 30, "g1's return logged")
    events = job.events()
    assert events[0]["kind"] == "lighthouse_started"
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    walk = transitions(events, "g1")
    lost_at = walk.index(("healthy", "lost"))
    after = [to for _, to in walk[lost_at + 1 :]]
    assert after[0] in {"joining", "healing"}, walk
    assert "healthy" in after, walk
    assert any(e["kind"] == "replica_lost" and e["replica_id"] == "g1" for e in events)
    assert any(e["kind"] == "replica_healed" and e["replica_id"] == "g1" for e in events)
    assert sum(e["kind"] == "replica_joined" and e["replica_id"] == "g1" for e in events) == 2
    assert any(e["kind"] == "quorum_changed" for e in events)

    # The post-mortem command reads the same log.
    out = subprocess.run(
        [sys.executable, "-m", "torchft.eventlog", str(job.event_log), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert json.dumps(summary).count("g1") > 0

    target = max(max(g.steps()) for g in job.cluster.live()) + 5
    job.cluster.stop_at(target)
    results = job.cluster.finish(60)
    assert len({r["param_hash"] for r in results}) == 1
    assert len({r["optim_hash"] for r in results}) == 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    return _varint(num << 3 | wire) + payload


def _report(replica_id: str, busy_s: float) -> bytes:
    """A TelemetryReport in protobuf wire format (replica_id, world size 1, busy_s)."""
    rid = replica_id.encode()
    return (
        _field(1, 2, _varint(len(rid)) + rid)
        + _field(4, 0, _varint(1))
        + _field(17, 1, struct.pack("<d", busy_s))
    )


def _grpc_post(addr: str, path: str, message: bytes) -> str:
    """One gRPC call over HTTP/1.1 (the lighthouse serves both); returns the raw response."""
    host, port = addr.removeprefix("http://").rsplit(":", 1)
    frame = b"\x00" + struct.pack(">I", len(message)) + message
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/grpc\r\n"
        f"te: trailers\r\nContent-Length: {len(frame)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return _raw(host.strip("[]"), int(port), head + frame)


def _raw(host: str, port: int, data: bytes) -> str:
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(180)
def test_metrics_dashboard_and_garbage(job: Job) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    for i, name in enumerate(["g0", "g1"]):
        job.cluster.start(name, seed=i, extra=LONG)
    job.wait_states({"g0": "healthy", "g1": "healthy"}, 90, "two healthy groups")

    # --- /metrics parses, names and labels follow the conventions.
    code, body = http(job.addr, "/metrics")
    assert code == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name, fam in families.items():
        assert name.startswith("torchft_"), name
        for sample in fam.samples:
            assert set(sample.labels) <= {"replica_id", "state", "account"}, sample
    # The parser strips _total from counter family names.
    assert families["torchft_replica_steps_committed"].type == "counter"
    state = {
        (s.labels["replica_id"], s.labels["state"]): s.value
        for s in families["torchft_replica_state"].samples
    }
    assert state[("g0", "healthy")] == 1 and state[("g0", "lost")] == 0
    steps = {s.labels["replica_id"]: s.value for s in families["torchft_replica_step"].samples}
    assert steps["g0"] > 0 and steps["g1"] > 0
    assert families["torchft_quorum_participants"].samples[0].value == 2

    # --- the dashboard in headless Chromium shows both rows and updates them.
    from _browser import chromium_available, console_errors, headless_chromium
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    reason = chromium_available()
    if reason is None:
        with headless_chromium() as driver:
            driver.get(job.addr + "/")
            wait = WebDriverWait(driver, 30)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.replica")) == 2)
            row = driver.find_element(By.CSS_SELECTOR, 'tr.replica[data-replica-id="g0"]')
            assert row.get_attribute("data-state") == "healthy"
            first = int(row.find_element(By.CSS_SELECTOR, ".step").text)
            wait.until(
                lambda d: (
                    int(
                        d.find_element(
                            By.CSS_SELECTOR, 'tr.replica[data-replica-id="g0"] .step'
                        ).text
                    )
                    > first + 3
                )
            )
            # Events arrive (from /status at load, then live over SSE).
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#events .event")) > 0)
            assert not console_errors(driver)

    # --- garbage on the telemetry path and the HTTP endpoints.
    before = replicas(job.addr)
    host, port = job.addr.removeprefix("http://").rsplit(":", 1)
    path = "/torchft.LighthouseService/Report"
    bad_reports = [
        _report("g0", math.nan),  # NaN timing
        _report("", 0.1),  # no replica id
        _report("g0", -1.0),  # negative time
        _report("x" * 1000, 0.1),  # oversized id
    ]
    for rep in bad_reports:
        resp = _grpc_post(job.addr, path, _field(1, 2, _varint(len(rep)) + rep))
        assert "grpc-status: 3" in resp, resp[:500]
    resp = _grpc_post(job.addr, path, b"\xff\xfe garbage \x00\x01")
    assert "grpc-status: 0" not in resp and "grpc-status" in resp, resp[:500]
    for junk in [b"\xff" * 100, b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n", b"\r\n\r\n"]:
        resp = _raw(host, int(port), junk)
        assert resp == "" or resp.startswith("HTTP/1.1 4"), resp[:200]
    assert http(job.addr, "/status", method="POST")[0] == 405
    assert http(job.addr, "/metrics", method="DELETE")[0] == 405
    assert http(job.addr, "/replicas/g0/kill")[0] == 405
    code, body = http(job.addr, "/replicas/g0/kill", method="POST")
    assert code == 403 and b"--allow_kill" in body
    assert http(job.addr, "/nope/../../etc/passwd")[0] == 404

    rejected = status(job.addr)["counters"]["reports_rejected"]
    assert rejected >= len(bad_reports)
    # Training went on, untouched.
    job.cluster.wait_until(
        lambda: all(replicas(job.addr)[n]["step"] > before[n]["step"] + 5 for n in ("g0", "g1")),
        60,
        "training continues",
    )
    after = replicas(job.addr)
    for n in ("g0", "g1"):
        assert after[n]["state"] == "healthy"
        assert after[n]["counters"]["commit_failures"] == before[n]["counters"]["commit_failures"]
        assert after[n]["counters"]["incarnations"] == 1
    job.cluster.stop_at(max(max(g.steps()) for g in job.cluster.groups) + 3)
    results = job.cluster.finish(60)
    assert len({r["param_hash"] for r in results}) == 1
    if reason is not None:
        pytest.skip(f"dashboard not checked: {reason}")


@pytest.mark.timeout(120)
def test_kill_action_requires_allow_kill_and_kills(tmp_path: Path) -> None:
    j = Job(tmp_path, allow_kill=True)
    try:
        for i, name in enumerate(["g0", "g1"]):
            j.cluster.start(name, seed=i, extra=LONG)
        j.wait_states({"g0": "healthy", "g1": "healthy"}, 90, "two healthy groups")
        assert status(j.addr)["allow_kill"] is True
        assert http(j.addr, "/replicas/nobody/kill", method="POST")[0] == 404
        code, body = http(j.addr, "/replicas/g1/kill", method="POST")
        assert code == 200, body
        assert json.loads(body)["ok"] is True
        victim = j.cluster.groups[1]
        assert victim.procs[0].wait(timeout=20) != 0
        j.cluster.groups.remove(victim)  # its non-zero exit is the point here
        j.wait_states({"g1": {"failed", "lost"}, "g0": "healthy"}, 20, "g1 killed")
        reps = replicas(j.addr)
        assert reps["g1"]["state"] == "failed", reps["g1"]
        assert "killed" in (reps["g1"]["last_error"] or "")
        kinds = [(e["kind"], e.get("replica_id")) for e in j.events()]
        assert ("kill_requested", "g1") in kinds and ("replica_failed", "g1") in kinds
    finally:
        j.close()


@pytest.mark.timeout(60)
def test_snapshot_reports_reach_status_and_bad_ones_are_refused(tmp_path: Path) -> None:
    """A ``phase="snapshot"`` report travels rank -> manager server -> lighthouse into
    ``/status`` (and the state file: a restarted lighthouse still shows it); a failed one is
    counted; negative or non-finite seconds and an overlong path raise ValueError."""
    state = tmp_path / "lighthouse.state"
    lighthouse = LighthouseServer(
        "127.0.0.1:0", min_replicas=1, progress_wait_ms=0, state_file=str(state)
    )
    server = ManagerServer(
        replica_id="g0",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=1,
    )
    try:
        assert status(lighthouse.address())["snapshot"] is None
        client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=10))
        base = dict(replica_id="g0", group_rank=0, group_world_size=1, hostname="h")
        snapshot = dict(
            base,
            step=1500,
            phase="snapshot",
            quorum_id=7,
            snapshot_path="/shared/snapshots/step_1500",
            snapshot_stage_s=0.25,
            snapshot_write_s=14.5,
            snapshot_bytes=3 * 1024**3,
            unix_s=time.time(),
        )
        assert client.report(**snapshot) is True
        assert (
            client.report(
                **base,
                step=2000,
                phase="snapshot_failed",
                snapshot_path="/shared/snapshots/step_2000",
                error="OSError: [Errno 28] No space left on device",
            )
            is True
        )
        for bad in [
            dict(snapshot_stage_s=-1.0),
            dict(snapshot_write_s=float("nan")),
            dict(snapshot_write_s=float("inf")),
            dict(snapshot_path="p" * 4097),
            dict(snapshot_path="\u00e9" * 2049),  # 4098 bytes in UTF-8
            dict(phase="snapshotted"),
        ]:
            with pytest.raises(ValueError, match="snapshot"):
                client.report(**{**snapshot, **bad})
        with pytest.raises(OverflowError):  # an unsigned count, like heal_bytes
            client.report(**{**snapshot, "snapshot_bytes": -1})
        assert client.report(**{**snapshot, "snapshot_path": "p" * 4096}), "at the limit"
        client._telemetry_flush(timeout=timedelta(seconds=5))

        deadline = time.monotonic() + 20
        while True:
            s = status(lighthouse.address())
            if s["counters"]["snapshot_failures"] == 1 and s["counters"]["snapshots"] == 2:
                break
            assert time.monotonic() < deadline, s["counters"]
            time.sleep(0.05)
        snap = s["snapshot"]
        assert snap["step"] == 1500 and snap["replica_id"] == "g0", snap
        assert snap["path"] == "/shared/snapshots/step_1500", "not replaced by the same step"
        assert (snap["bytes"], snap["stage_s"], snap["write_s"]) == (3 * 1024**3, 0.25, 14.5)
        assert snap["quorum_id"] == 7 and 0 <= snap["age_s"] < 60
        code, body = http(lighthouse.address(), "/metrics")
        assert code == 200 and b"\ntorchft_snapshot_latest_step 1500\n" in body
        assert b"\ntorchft_snapshot_failures_total 1\n" in body
        g0 = {r["replica_id"]: r for r in s["replicas"]}["g0"]
        assert g0["counters"]["steps_committed"] == 0, "a snapshot is not a step"

        # Written to the state file within a tick; a restarted lighthouse still shows it.
        deadline = time.monotonic() + 20
        while '"snapshot"' not in (state.read_text() if state.exists() else ""):
            assert time.monotonic() < deadline, "snapshot never written to the state file"
            time.sleep(0.05)
    finally:
        server.shutdown()
        lighthouse.shutdown()
    again = LighthouseServer(
        "127.0.0.1:0", min_replicas=1, progress_wait_ms=0, state_file=str(state)
    )
    try:
        snap = status(again.address())["snapshot"]
        assert snap is not None and snap["step"] == 1500, snap
    finally:
        again.shutdown()
