"""Tests for ``torchft.eventlog``: reading, summarising and reporting lighthouse event logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchft import eventlog

T0 = 1732170000.0  # 2024-11-21 06:20:00 UTC
Q0 = 1732170002000000


def _write_log(path: Path, events: list[dict[str, Any]], extra: str = "") -> Path:
    """Writes events as JSON lines (with trailing newlines) followed by ``extra`` verbatim.

    Args:
        path: The file to write.
        events: The events, in order.
        extra: Raw text appended after the events.

    Returns:
        ``path``.
    """
    text = "".join(json.dumps(e) + "\n" for e in events) + extra
    path.write_text(text, encoding="utf-8")
    return path


def _ev(dt: float, kind: str, **fields: Any) -> dict[str, Any]:
    """One event at ``T0 + dt`` (``seq`` is filled in by :func:`_numbered`)."""
    return {"seq": 0, "ts": T0 + dt, "kind": kind, **fields}


def _state(
    dt: float, rid: str, frm: str | None, to: str, reason: str, step: int | None
) -> dict[str, Any]:
    """A ``state_changed`` event at ``T0 + dt``."""
    return _ev(
        dt, "state_changed", replica_id=rid, to=to, step=step, reason=reason, **{"from": frm}
    )


def _numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Numbers events from 1, restarting at every ``lighthouse_started`` like the lighthouse."""
    seq = 0
    for event in events:
        seq = 1 if event["kind"] == "lighthouse_started" else seq + 1
        event["seq"] = seq
    return events


def _joined(dt: float, rid: str, incarnation: str, hostname: str) -> dict[str, Any]:
    return _ev(dt, "replica_joined", replica_id=rid, incarnation=incarnation, hostname=hostname)


def _quorum(dt: float, qid: int, prev: int | None, participants: list[str]) -> dict[str, Any]:
    return _ev(
        dt,
        "quorum_changed",
        quorum_id=qid,
        previous_quorum_id=prev,
        participants=participants,
    )


def _scenario() -> list[dict[str, Any]]:
    """A lighthouse run with three replica groups, shaped like the lighthouse writes it.

    A group starts in ``joining`` without an event, so its first ``state_changed`` is
    ``joining -> healthy``. ``train_0`` is killed at +20 s and comes back
    (healthy -> lost -> joining -> healing -> healthy), ``train_1`` is flagged and cleared as
    a straggler, ``train_2`` has a commit failure and finishes at the end (+40 s).
    """
    return _numbered(
        [
            _ev(0.0, "lighthouse_started", min_replicas=2, pid=4242),
            _joined(0.5, "train_0", "train_0:aaaa", "node-0"),
            _joined(0.6, "train_1", "train_1:bbbb", "node-1"),
            _joined(0.7, "train_2", "train_2:cccc", "node-2"),
            _quorum(2.0, Q0, None, ["train_0", "train_1", "train_2"]),
            _state(3.0, "train_0", "joining", "healthy", "committed", 1),
            _state(3.0, "train_1", "joining", "healthy", "committed", 1),
            _state(3.5, "train_2", "joining", "healthy", "committed", 1),
            _ev(
                10.0,
                "commit_failed",
                replica_id="train_2",
                step=20,
                error="allreduce timed out after 5s\nTraceback (most recent call last): ...",
            ),
            _state(12.0, "train_1", "healthy", "straggler", "busy time well above the median", 24),
            _ev(
                12.0,
                "straggler_flagged",
                replica_id="train_1",
                skew_pct=80.0,
                busy_s=0.9,
                median_busy_s=0.5,
            ),
            _state(20.0, "train_0", "healthy", "lost", "session ended", 40),
            _ev(
                20.0,
                "replica_lost",
                replica_id="train_0",
                incarnation="train_0:aaaa",
                reason="session ended",
            ),
            _quorum(21.0, Q0 + 1, Q0, ["train_1", "train_2"]),
            _state(24.0, "train_1", "straggler", "healthy", "in the quorum and committing", 48),
            _ev(
                24.0,
                "straggler_cleared",
                replica_id="train_1",
                skew_pct=10.0,
                busy_s=0.55,
                median_busy_s=0.5,
            ),
            _joined(25.0, "train_0", "train_0:dddd", "node-0"),
            _state(25.0, "train_0", "lost", "joining", "no committed step yet", 40),
            _quorum(26.0, Q0 + 2, Q0 + 1, ["train_0", "train_1", "train_2"]),
            _state(26.5, "train_0", "joining", "healing", "healing from a peer", 41),
            _ev(
                29.0,
                "replica_healed",
                replica_id="train_0",
                step=41,
                heal_s=2.5,
                heal_bytes=1048576,
                source="train_2",
                gbps=0.000419,
            ),
            _state(30.0, "train_0", "healing", "healthy", "committed", 42),
            _ev(40.0, "replica_finished", replica_id="train_2", step=90),
            _state(40.0, "train_2", "healthy", "finished", "shut down", 90),
        ]
    )


@pytest.fixture
def scenario_log(tmp_path: Path) -> Path:
    """The scenario with a garbage line in the middle and a truncated last line."""
    events = _scenario()
    # Line 21 is garbage; the rest follow, then a line cut off mid-write.
    text = "".join(json.dumps(e) + "\n" for e in events[:20])
    text += "this is not json\n"
    text += "".join(json.dumps(e) + "\n" for e in events[20:])
    text += '{"seq": 25, "ts": 1732170041.0, "kind": "state_ch'
    path = tmp_path / "events.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.timeout(60)
def test_read_events_skips_garbage_and_truncated_line(scenario_log: Path) -> None:
    events, problems = eventlog.read_events(scenario_log)
    assert [e["seq"] for e in events] == list(range(1, 25))
    assert problems == ["line 21: not JSON", "line 26: truncated (no newline at end of file)"]


@pytest.mark.timeout(60)
def test_read_events_validation(tmp_path: Path) -> None:
    good = {"seq": 1, "ts": T0, "kind": "lighthouse_started", "min_replicas": 1, "pid": 1}
    lines = [
        json.dumps(good),  # 1
        "",  # 2: blank, ignored
        "   ",  # 3: blank, ignored
        "[1, 2]",  # 4
        json.dumps({"seq": 2, "ts": T0}),  # 5
        json.dumps({"seq": 3, "ts": T0, "kind": 7}),  # 6
        json.dumps({"ts": T0, "kind": "lighthouse_started"}),  # 7
        json.dumps({"seq": 4, "kind": "lighthouse_started"}),  # 8
        json.dumps({"seq": 5, "ts": "soon", "kind": "lighthouse_started"}),  # 9
        json.dumps({"seq": 6, "ts": T0, "kind": "state_changed", "to": "healthy"}),  # 10
        '{"seq": 7, "ts": NaN, "kind": "lighthouse_started"}',  # 11
        json.dumps({"seq": 8, "ts": T0 + 1, "kind": "some_future_kind", "x": 1}),  # 12
    ]
    path = tmp_path / "log"
    path.write_bytes(
        ("\n".join(lines) + "\n").encode() + b'\xff\xfe{"seq"\n' + json.dumps(good).encode()
    )
    events, problems = eventlog.read_events(path)
    assert [e["seq"] for e in events] == [1, 8, 1]  # a complete last line without "\n" is kept
    assert problems == [
        "line 4: not a JSON object",
        "line 5: missing 'kind'",
        "line 6: 'kind' is not a non-empty string",
        "line 7: missing 'seq'",
        "line 8: missing 'ts'",
        "line 9: 'ts' is not a number",
        "line 10: missing 'replica_id' (state_changed)",
        "line 11: not JSON",
        "line 13: not UTF-8",
    ]


@pytest.mark.timeout(60)
def test_summary_numbers(scenario_log: Path) -> None:
    events, _ = eventlog.read_events(scenario_log)
    s = eventlog.summarize(events)

    assert s["first_ts"] == T0
    assert s["last_ts"] == T0 + 40.0
    assert s["duration_s"] == 40.0
    assert s["events"] == 24
    assert s["lighthouse_starts"] == 1
    assert s["quorum_changes"] == 3
    assert s["first_quorum_id"] == Q0
    assert s["last_quorum_id"] == Q0 + 2
    assert (s["min_participants"], s["max_participants"]) == (2, 3)
    assert s["kinds"]["state_changed"] == 10
    assert s["kinds"]["replica_joined"] == 4
    assert list(s["replicas"]) == ["train_0", "train_1", "train_2"]

    r0 = s["replicas"]["train_0"]
    assert r0["incarnations"] == 2
    assert r0["last_incarnation"] == "train_0:dddd"
    assert r0["hostname"] == "node-0"
    assert r0["lost"] == 1
    assert r0["heals"] == 1
    assert r0["heal_bytes"] == 1048576
    assert r0["heal_s"] == 2.5
    assert r0["heal_sources"] == {"train_2": 1}
    assert r0["commit_failures"] == 0
    assert r0["straggler_flags"] == 0
    assert r0["final_state"] == "healthy"
    assert r0["last_step"] == 42
    assert [(t["from"], t["to"]) for t in r0["transitions"]] == [
        ("joining", "healthy"),
        ("healthy", "lost"),
        ("lost", "joining"),
        ("joining", "healing"),
        ("healing", "healthy"),
    ]
    assert [t["ts"] - T0 for t in r0["transitions"]] == [3.0, 20.0, 25.0, 26.5, 30.0]
    assert r0["transitions"][1] == {
        "ts": T0 + 20.0,
        "from": "healthy",
        "to": "lost",
        "reason": "session ended",
        "step": 40,
    }
    # healthy 3..20 and 30..40 (open, runs to the last event); lost 20..25; joining
    # 25..26.5; healing 26.5..30.
    assert r0["time_in_state_s"] == {"healing": 3.5, "healthy": 27.0, "joining": 1.5, "lost": 5.0}
    assert r0["downtime_s"] == 10.0
    assert r0["recoveries"] == 1
    assert r0["startup_s"] == 0.0  # the initial joining has no state_changed to start it
    assert r0["down_at_end_s"] == 0.0
    assert r0["first_error"] is None

    r1 = s["replicas"]["train_1"]
    assert r1["incarnations"] == 1
    assert r1["lost"] == 0
    assert r1["heals"] == 0
    assert r1["heal_bytes"] == 0
    assert r1["straggler_flags"] == 1
    assert r1["straggler_clears"] == 1
    assert r1["final_state"] == "healthy"
    assert [t["to"] for t in r1["transitions"]] == ["healthy", "straggler", "healthy"]
    assert r1["time_in_state_s"] == {"healthy": 25.0, "straggler": 12.0}
    assert r1["downtime_s"] == 0.0
    assert r1["recoveries"] == 0

    r2 = s["replicas"]["train_2"]
    assert r2["commit_failures"] == 1
    assert r2["first_error"] == {
        "ts": T0 + 10.0,
        "kind": "commit_failed",
        "step": 20,
        "error": "allreduce timed out after 5s\nTraceback (most recent call last): ...",
    }
    assert r2["finished"] is True
    assert r2["final_state"] == "finished"
    assert r2["time_in_state_s"] == {"finished": 0.0, "healthy": 36.5}
    assert r2["downtime_s"] == 0.0
    assert r2["last_step"] == 90

    # The summary is plain JSON and deterministic.
    assert json.loads(json.dumps(s)) == s
    assert eventlog.summarize(events) == s


@pytest.mark.timeout(60)
def test_open_interval_and_lighthouse_restart(tmp_path: Path) -> None:
    events = _numbered(
        [
            _ev(0.0, "lighthouse_started", min_replicas=1, pid=1),
            _state(2.0, "a", "joining", "healthy", "committed", 1),
            # "b" starts with an explicit transition, so its start-up is measured.
            _state(2.0, "b", None, "joining", "first seen", None),
            _state(3.0, "b", "joining", "healthy", "committed", 1),
            _state(5.0, "b", "healthy", "lost", "heartbeat timeout", 3),
            _ev(6.0, "replica_failed", replica_id="b", error="CUDA out of memory"),
            _ev(6.5, "commit_failed", replica_id="a", step=7, error=None),
            # The lighthouse dies after +6.5 s and restarts at +60 s (seq starts over).
            _ev(60.0, "lighthouse_started", min_replicas=1, pid=2),
            _joined(61.0, "a", "a:2", "h"),
            _state(62.0, "a", "joining", "healthy", "committed", 5),
            _state(63.0, "a", "healthy", "lost", "session ended", 6),
            _state(65.0, "a", "lost", "joining", "no committed step yet", 6),
            _quorum(70.0, 9, None, []),
        ]
    )
    s = eventlog.summarize(eventlog.read_events(_write_log(tmp_path / "log", events))[0])
    assert s["lighthouse_starts"] == 2
    assert s["duration_s"] == 70.0
    assert (s["min_participants"], s["max_participants"]) == (0, 0)

    a = s["replicas"]["a"]
    # healthy 2..6.5 (closed at the last event before the restart) and 62..63; lost 63..65;
    # joining 65..70 (open at the end).
    assert a["time_in_state_s"] == {"healthy": 5.5, "joining": 5.0, "lost": 2.0}
    assert a["downtime_s"] == 0.0
    assert a["recoveries"] == 0
    assert a["down_at_end_s"] == 7.0
    assert a["final_state"] == "joining"
    assert a["commit_failures"] == 1
    assert a["first_error"] is None  # the commit failure carried no error

    b = s["replicas"]["b"]
    assert b["time_in_state_s"] == {"healthy": 2.0, "joining": 1.0, "lost": 1.5}
    assert b["startup_s"] == 1.0
    assert b["failures"] == 1
    assert b["first_error"] == {
        "ts": T0 + 6.0,
        "kind": "replica_failed",
        "step": None,
        "error": "CUDA out of memory",
    }
    assert b["down_at_end_s"] == 1.5
    assert b["final_state"] == "lost"

    text = eventlog.format_summary(s)
    assert "    00:00:00.000" not in text
    assert "    06:20:02.000  - -> joining (first seen)" in text.splitlines()
    assert "  down at end      7.0s (not recovered)" in text.splitlines()


@pytest.mark.timeout(60)
def test_snapshots_are_counted_and_the_latest_is_the_highest_step(tmp_path: Path) -> None:
    """``snapshot_complete`` / ``snapshot_failed`` are counted per log and per replica; the
    latest snapshot is the highest step (a late report of an older one does not replace it,
    nor move the writer's last step)."""

    def complete(dt: float, rid: str, step: int, latest: bool) -> dict[str, Any]:
        return _ev(
            dt,
            "snapshot_complete",
            replica_id=rid,
            incarnation=f"{rid}:1",
            step=step,
            path=f"/snap/step_{step}",
            bytes=4096,
            stage_s=0.1,
            write_s=3.0,
            quorum_id=Q0,
            unix_s=T0 + dt,
            latest=latest,
        )

    events = _numbered(
        [
            _ev(0.0, "lighthouse_started", min_replicas=1, pid=1),
            _state(1.0, "a", "joining", "healthy", "committed", 1),
            _state(1.0, "b", "joining", "healthy", "committed", 1),
            complete(10.0, "a", 500, True),
            _ev(
                11.0,
                "snapshot_failed",
                replica_id="b",
                step=1000,
                error="OSError: [Errno 28] No space left on device",
                path="/snap/step_1000",
            ),
            complete(20.0, "a", 1500, True),
            _ev(21.0, "commit_failed", replica_id="b", step=1510, error=None),
            complete(22.0, "b", 1000, False),  # a slow write of an older step, reported late
        ]
    )
    s = eventlog.summarize(eventlog.read_events(_write_log(tmp_path / "log", events))[0])
    assert (s["snapshots"], s["snapshot_failures"]) == (3, 1)
    assert s["latest_snapshot"] == {
        "ts": T0 + 20.0,
        "step": 1500,
        "replica_id": "a",
        "path": "/snap/step_1500",
        "bytes": 4096,
    }
    assert s["kinds"]["snapshot_complete"] == 3
    a, b = s["replicas"]["a"], s["replicas"]["b"]
    assert (a["snapshots"], a["snapshot_failures"]) == (2, 0)
    assert (b["snapshots"], b["snapshot_failures"]) == (1, 1)
    assert a["last_step"] == 1 and b["last_step"] == 1510, "a snapshot's step is not progress"
    assert a["first_error"] is None and b["first_error"] is None, "not a training error"

    lines = eventlog.format_summary(s).splitlines()
    assert "  snapshots    3 complete, latest step 1500 (a, /snap/step_1500), 1 failed" in lines
    assert "  snapshots        1 written, 1 failed" in lines
    # A log without snapshots has no snapshot lines.
    plain = eventlog.summarize(events[:3])
    assert plain["latest_snapshot"] is None and plain["snapshots"] == 0
    assert "snapshots" not in eventlog.format_summary(plain)


@pytest.mark.timeout(60)
def test_summarize_empty() -> None:
    s = eventlog.summarize([])
    assert s["events"] == 0
    assert s["first_ts"] is None and s["last_ts"] is None and s["duration_s"] is None
    assert s["replicas"] == {}
    assert "no events" in eventlog.format_summary(s)


@pytest.mark.timeout(60)
def test_format_summary(scenario_log: Path) -> None:
    events, _ = eventlog.read_events(scenario_log)
    text = eventlog.format_summary(eventlog.summarize(events))
    lines = text.splitlines()
    assert lines[0] == "torchft event log summary"
    assert "  span         2024-11-21 06:20:00.000 -> 2024-11-21 06:20:40.000 UTC (40.0s)" in lines
    assert "  lighthouse   1 start" in lines
    assert f"  quorums      3 changes, id {Q0} -> {Q0 + 2}, 2-3 participants" in lines
    assert "  replicas     3: train_0, train_1, train_2" in lines

    block = lines[lines.index("replica train_0") : lines.index("replica train_1") - 1]
    assert block == [
        "replica train_0",
        "  final state      healthy",
        "  incarnations     2 (last train_0:dddd)",
        "  hostname         node-0",
        "  times lost       1",
        "  heals            1, 1048576 bytes (1.0 MiB), 2.5s",
        "  healed from      train_2 x1",
        "  commit failures  0",
        "  straggler        flagged 0, cleared 0",
        "  downtime         10.0s over 1 recovery",
        "  last step        42",
        "  time in state    healing 3.5s, healthy 27.0s, joining 1.5s, lost 5.0s",
        "  transitions",
        "    06:20:03.000  joining -> healthy (committed)",
        "    06:20:20.000  healthy -> lost (session ended)",
        "    06:20:25.000  lost -> joining (no committed step yet)",
        "    06:20:26.500  joining -> healing (healing from a peer)",
        "    06:20:30.000  healing -> healthy (committed)",
    ]
    assert "  straggler        flagged 1, cleared 1" in lines
    assert "    06:20:12.000  healthy -> straggler (busy time well above the median)" in lines
    assert "  downtime         0.0s over 0 recoveries" in lines
    assert (
        "  first error      06:20:10.000 commit_failed step 20: allreduce timed out after 5s ..."
        in lines
    )
    assert "  final state      finished" in lines
    assert text.endswith("    06:20:40.000  healthy -> finished (shut down)\n")


@pytest.mark.timeout(60)
def test_clock_rounds_to_milliseconds() -> None:
    s = eventlog.summarize(
        [
            {"seq": 1, "ts": 1732170000.1239, "kind": "lighthouse_started"},
            {**_state(0.123, "x", None, "joining", "", 0), "seq": 2},
            {**_state(86400.9996, "x", "joining", "healthy", "", 1), "seq": 3},
        ]
    )
    text = eventlog.format_summary(s)
    assert "    06:20:00.123  - -> joining" in text.splitlines()
    assert "    06:20:01.000  joining -> healthy" in text.splitlines()
    assert "2024-11-22 06:20:01.000 UTC (86400.9s)" in text


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = eventlog.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(60)
def test_main_text(scenario_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run_main([str(scenario_log)], capsys)
    assert code == 0
    assert out.startswith(
        f"event log {scenario_log} (2 lines skipped)\ntorchft event log summary\n"
    )
    assert "replica train_2" in out
    assert err.splitlines() == [
        f"warning: {scenario_log}: line 21: not JSON",
        f"warning: {scenario_log}: line 26: truncated (no newline at end of file)",
    ]


@pytest.mark.timeout(60)
def test_main_json_and_replica_filter(
    scenario_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run_main([str(scenario_log), "--json", "--replica", "train_0"], capsys)
    assert code == 0
    data = json.loads(out)
    assert list(data["replicas"]) == ["train_0"]
    assert data["replicas"]["train_0"]["downtime_s"] == 10.0
    assert data["quorum_changes"] == 3

    code, out, _ = _run_main([str(scenario_log), "--replica", "train_1"], capsys)
    assert code == 0
    assert "replica train_1" in out
    assert "replica train_0" not in out and "replica train_2" not in out


@pytest.mark.timeout(60)
def test_main_unknown_replica(scenario_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run_main([str(scenario_log), "--replica", "train_9"], capsys)
    assert code == 2
    assert out == ""
    assert "error: unknown replica 'train_9'; known replicas: train_0, train_1, train_2" in err


@pytest.mark.timeout(60)
def test_main_missing_directory_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nope.jsonl"
    code, out, err = _run_main([str(missing)], capsys)
    assert (code, out) == (2, "")
    assert err == f"error: {missing}: no such file\n"

    code, out, err = _run_main([str(tmp_path)], capsys)
    assert (code, out) == (2, "")
    assert err == f"error: {tmp_path}: is a directory, not an event log\n"

    # chmod does not stop root, so simulate the failure of open().
    def refuse(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(eventlog, "read_events", refuse)
    code, out, err = _run_main([str(tmp_path / "x")], capsys)
    assert (code, out) == (2, "")
    assert err == f"error: {tmp_path / 'x'}: permission denied\n"


@pytest.mark.timeout(60)
def test_main_empty_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    code, out, err = _run_main([str(path)], capsys)
    assert (code, err) == (0, "")
    assert out == f"{path}: empty log (no events)\n"

    code, out, err = _run_main([str(path), "--json"], capsys)
    assert code == 0
    assert json.loads(out)["events"] == 0
    assert "empty log" in err


@pytest.mark.timeout(60)
def test_main_caps_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [{"seq": 1, "ts": T0, "kind": "lighthouse_started", "min_replicas": 1, "pid": 1}]
    path = _write_log(tmp_path / "log", events, extra="garbage\n" * 12)
    code, out, err = _run_main([str(path)], capsys)
    assert code == 0
    assert "torchft event log summary" in out
    warnings = err.splitlines()
    assert len(warnings) == 11
    assert warnings[0] == f"warning: {path}: line 2: not JSON"
    assert warnings[9] == f"warning: {path}: line 11: not JSON"
    assert warnings[10] == f"warning: {path}: ... and 2 more problems"

    path.write_text("garbage\n", encoding="utf-8")
    code, out, err = _run_main([str(path)], capsys)
    assert code == 0
    assert out == f"{path}: no valid events\n"
    assert err == f"warning: {path}: line 1: not JSON\n"


@pytest.mark.timeout(60)
def test_cli_subprocess(scenario_log: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torchft.eventlog"]
    proc = subprocess.run(
        [*cmd, str(scenario_log), "--json"], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["replicas"]["train_0"]["final_state"] == "healthy"
    assert data["replicas"]["train_0"]["heal_bytes"] == 1048576
    assert "line 21: not JSON" in proc.stderr

    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run([*cmd, str(missing)], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"error: {missing}: no such file" in proc.stderr


@pytest.mark.timeout(60)
def test_module_needs_no_torch() -> None:
    """The module loads on its own without torch or the native extension."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('eventlog', {eventlog.__file__!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert not any(m.startswith('torchft') for m in sys.modules), 'torchft imported'\n"
        "print(mod.summarize([])['events'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0\n"


def test_kinds_match_the_lighthouse() -> None:
    """The tool's kinds are exactly the lighthouse's typed event kinds (and which of them
    name a replica group), and docs/telemetry.md documents each one."""
    from torchft._torchft import EVENT_KINDS

    native = dict(EVENT_KINDS)
    assert set(eventlog.KINDS) == set(native)
    assert set(eventlog.REPLICA_KINDS) == {
        k for k, names_replica in native.items() if names_replica
    }
    doc = (Path(__file__).resolve().parent.parent / "docs" / "telemetry.md").read_text()
    for kind in native:
        assert f"`{kind}`" in doc, kind
