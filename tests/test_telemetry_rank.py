"""The rank side of telemetry: timing arithmetic, fail-open reporting, exit reports, and the
native report queue's validation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchft import telemetry
from torchft._torchft import LighthouseServer, ManagerClient, ManagerServer
from torchft.telemetry import RankTelemetry, enabled_from_env, tensor_bytes


class Recorder:
    """A stand-in for the native client that records reports (or raises)."""

    def __init__(self, fail: bool = False) -> None:
        self.reports: list[dict[str, Any]] = []
        self.flushes = 0
        self.fail = fail

    def report(self, **kwargs: Any) -> bool:
        if self.fail:
            raise RuntimeError("queue exploded")
        self.reports.append(kwargs)
        return True

    def _telemetry_flush(self, timeout: timedelta) -> None:
        self.flushes += 1


def _tel(client: Any, enabled: bool = True) -> RankTelemetry:
    return RankTelemetry(client, "g", "g:x", 1, 2, "host", enabled=enabled)


def _end(t: RankTelemetry, **kw: Any) -> None:
    args = dict(
        step=3,
        quorum_id=7,
        participants=2,
        committed=True,
        healed=False,
        should_commit_s=0.0,
        error=None,
        rank=3,
    )
    args.update(kw)
    t.step_ended(**args)


@pytest.mark.timeout(30)
def test_busy_time_is_step_time_minus_the_waits() -> None:
    rec = Recorder()
    t = _tel(rec)
    # Upper bounds are the windows measured around each part (a loaded machine stretches
    # sleeps), not fixed times.
    q0 = time.perf_counter()
    with t.quorum_wait():
        time.sleep(0.05)
    quorum_window = time.perf_counter() - q0
    c0 = time.perf_counter()
    tok_a = t.collective_started()
    tok_b = t.collective_started()  # overlapping collectives count once
    time.sleep(0.05)
    t.collective_finished(tok_a)
    t.collective_finished(tok_b)
    collective_window = time.perf_counter() - c0
    time.sleep(0.05)  # compute
    _end(t, should_commit_s=0.01)
    r = rec.reports[-1]
    assert r["phase"] == "step" and r["committed"] and r["step"] == 3 and r["rank"] == 3
    assert r["replica_id"] == "g" and r["incarnation"] == "g:x" and r["group_rank"] == 1
    assert 0.05 <= r["quorum_wait_s"] <= quorum_window
    # Counted twice, the overlap would exceed the window it happened in.
    assert 0.05 <= r["collective_s"] <= collective_window
    assert r["should_commit_s"] == 0.01
    assert r["step_s"] >= 0.15
    expected = r["step_s"] - r["quorum_wait_s"] - r["collective_s"] - 0.01
    assert abs(r["busy_s"] - expected) < 1e-9
    assert r["busy_s"] >= 0.04
    # The next step starts from zero; a late completion of the old step is ignored.
    t.collective_finished(tok_a)
    _end(t)
    assert rec.reports[-1]["collective_s"] == 0.0 and rec.reports[-1]["quorum_wait_s"] == 0.0


@pytest.mark.timeout(30)
def test_phases_split_the_busy_time_and_leave_out_the_waits() -> None:
    """input (before the first forward, less the quorum wait and the previous optimizer
    step), forward, backward (less a collective in flight), optimizer (carried to the next
    report), and the process's CPU, memory and load."""
    # Marks an earlier job left in this thread without a report are not the first step's.
    telemetry.forward_done(time.perf_counter())
    telemetry.backward_ended()
    telemetry.optimizer_done(time.perf_counter())
    rec = Recorder()
    t = _tel(rec)
    _end(t)  # a first step without phases: all 0
    first = rec.reports[-1]
    assert first["input_s"] == first["forward_s"] == first["backward_s"] == 0.0
    assert first["rss_bytes"] > 0 and first["host_load"] >= 0.0 and first["cpu_s"] >= 0.0
    # The previous step's optimizer step runs after its report.
    o0 = time.perf_counter()
    time.sleep(0.02)
    telemetry.optimizer_done(o0)
    with t.quorum_wait():
        time.sleep(0.05)
    time.sleep(0.03)  # input
    f0 = time.perf_counter()
    time.sleep(0.02)  # forward
    telemetry.forward_done(f0)
    time.sleep(0.04)  # backward compute
    tok = t.collective_started()
    time.sleep(0.05)  # backward waiting on the allreduce
    t.collective_finished(tok)
    telemetry.backward_ended()
    telemetry.backward_ended()  # only the first mark counts
    _end(t)
    r = rec.reports[-1]
    assert 0.02 <= r["optimizer_s"] < 0.05, r
    assert 0.03 <= r["input_s"] < 0.06, r  # not the 0.05 quorum wait, not the optimizer
    assert 0.02 <= r["forward_s"] < 0.05, r
    assert 0.04 <= r["backward_s"] < 0.08, r  # not the 0.05 with a collective in flight
    assert r["cpu_s"] < r["step_s"], r  # sleeping is not CPU time
    # The marks are per thread and per step: the next report starts from zero.
    _end(t)
    assert rec.reports[-1]["forward_s"] == 0.0 and rec.reports[-1]["optimizer_s"] == 0.0


@pytest.mark.timeout(30)
def test_an_earlier_managers_last_optimizer_step_is_not_the_next_ones() -> None:
    """The optimizer step after a Manager's last report leaves its time in the thread; the
    next Manager built in that thread does not report it as its first step's."""
    o0 = time.perf_counter()
    time.sleep(0.02)
    telemetry.optimizer_done(o0)  # the earlier Manager's last step, after its report
    rec = Recorder()
    t = _tel(rec)
    f0 = time.perf_counter()
    time.sleep(0.01)
    telemetry.forward_done(f0)  # this Manager's first step
    _end(t)
    r = rec.reports[-1]
    assert r["optimizer_s"] == 0.0, r
    assert 0.01 <= r["forward_s"] < 0.04, r


@pytest.mark.timeout(30)
def test_resident_memory_is_read_at_every_step() -> None:
    """Memory grown between two steps shows in the second report at once (a memory-growing
    straggler is named from a window of reports)."""
    rec = Recorder()
    t = _tel(rec)
    _end(t)
    before = rec.reports[-1]["rss_bytes"]
    grown = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, written: resident
    _end(t)
    after = rec.reports[-1]["rss_bytes"]
    assert after - before >= 60 << 20, (before, after)
    del grown


@pytest.mark.timeout(30)
def test_unfinished_collective_is_closed_at_step_end() -> None:
    rec = Recorder()
    t = _tel(rec)
    t.collective_started()  # never completes (aborted group)
    time.sleep(0.03)
    _end(t, committed=False, error="peer lost")
    r = rec.reports[-1]
    assert r["collective_s"] >= 0.03 and r["error"] == "peer lost" and not r["committed"]


@pytest.mark.timeout(30)
def test_reporting_is_fail_open_and_off_means_silent() -> None:
    t = _tel(Recorder(fail=True))
    _end(t)
    _end(t)
    assert t.failed_sends == 2  # counted, never raised
    off = Recorder()
    t = _tel(off, enabled=False)
    _end(t)
    t.heal_started(1, 1)
    t.finish(None)
    assert off.reports == []


@pytest.mark.timeout(30)
def test_finish_reports_once_finished_or_failed() -> None:
    rec = Recorder()
    t = _tel(rec)
    t.finish(None, step=9)
    t.finish(RuntimeError("late"))
    assert [r["phase"] for r in rec.reports] == ["finished"] and rec.flushes == 1
    rec = Recorder()
    t = _tel(rec)
    t.finish(ValueError("bad batch"), step=4)
    assert rec.reports[-1]["phase"] == "failed"
    assert rec.reports[-1]["error"] == "ValueError: bad batch"
    rec = Recorder()
    _tel(rec).finish(SystemExit(0))
    assert rec.reports[-1]["phase"] == "finished"


@pytest.mark.timeout(30)
def test_heal_is_reported_with_bytes() -> None:
    rec = Recorder()
    t = _tel(rec)
    t.heal_started(5, 7)
    assert rec.reports[-1]["phase"] == "heal_started"
    t.heal_done(0.2, {"user": {"w": torch.zeros(10, dtype=torch.float32)}, "n": 3})
    _end(t, healed=True)
    assert rec.reports[-1]["heal_bytes"] == 40 and rec.reports[-1]["heal_s"] == 0.2
    assert tensor_bytes([torch.zeros(2, dtype=torch.int64), {"a": torch.zeros(3)}]) == 28


@pytest.mark.timeout(30)
def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in [("0", False), ("off", False), ("1", True), ("YES", True), ("", True)]:
        monkeypatch.setenv(telemetry.ENV_TELEMETRY, raw)
        assert enabled_from_env() is want
    monkeypatch.setenv(telemetry.ENV_TELEMETRY, "maybe")
    with pytest.raises(ValueError, match="TORCHFT_TELEMETRY"):
        enabled_from_env()


@pytest.mark.timeout(60)
def test_uncaught_exception_reports_failed_before_exit() -> None:
    script = textwrap.dedent(
        """
        import json, sys
        from torchft.telemetry import RankTelemetry
        class C:
            def report(self, **kw):
                print(json.dumps({"phase": kw["phase"], "error": kw.get("error", "")}), flush=True)
                return True
            def _telemetry_flush(self, timeout):
                print("flushed", flush=True)
        t = RankTelemetry(C(), "g", "g", 0, 1, "h")
        raise KeyError("missing shard")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0] == '{"phase": "failed", "error": "KeyError: \'missing shard\'"}', lines
    assert lines[1] == "flushed"
    assert "KeyError" in out.stderr  # the original traceback is still printed


@pytest.mark.timeout(60)
def test_native_report_validates_and_never_blocks() -> None:
    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1, progress_wait_ms=0)
    server = ManagerServer(
        replica_id="g",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=1,
    )
    try:
        client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=10))
        base = dict(replica_id="g", group_rank=0, group_world_size=1, step=0)
        assert client.report(**base, committed=True, busy_s=0.01) is True
        for bad in [
            dict(busy_s=float("nan")),
            dict(step_s=-1.0),
            dict(phase="exploded"),
            dict(group_rank=1),
            dict(incarnation="other:x"),
            dict(replica_id=""),
        ]:
            with pytest.raises(ValueError):
                client.report(**{**base, **bad})
        # A flood never blocks (the test's timeout bounds it): excess reports are dropped
        # and counted.
        accepted = sum(client.report(**base) for _ in range(20000))
        assert accepted + client._telemetry_dropped() >= 20000
        client._telemetry_flush(timeout=timedelta(seconds=2))
    finally:
        server.shutdown()
        lighthouse.shutdown()
