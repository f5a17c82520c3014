"""Tests for the end-of-run report: ``torchft.run_summary`` (the summary, its escaping, the
files) and ``python -m torchft.eventlog LOG --html``, with the page drawn in headless Chromium
(skipped when chromium or chromedriver is missing; see tests/_browser.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from _browser import chromium_available, console_errors, headless_chromium

from torchft import eventlog, run_summary

T0 = 1732170000.0  # 2024-11-21 06:20:00 UTC
EVIL_ID = "</script><script>alert(1)</script>"
EVIL_IMG = "<img src=x onerror=alert(2)>"
_DROP = object()  # a field a test variant leaves out
SUMMARY_KEYS = {
    "schema",
    "source",
    "job",
    "generated_unix_s",
    "started_unix_s",
    "ended_unix_s",
    "finished",
    "goodput",
    "groups",
    "groups_omitted",
    "series",
    "timeline",
    "timeline_dropped",
}


# ----- a synthetic job -----


def _ev(dt: float, kind: str, **fields: Any) -> dict[str, Any]:
    """One event at ``T0 + dt`` (``seq`` is filled in by :func:`_numbered`)."""
    return {"seq": 0, "ts": T0 + dt, "kind": kind, **fields}


def _numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Numbers events from 1 in file order."""
    for seq, event in enumerate(events, start=1):
        event["seq"] = seq
    return events


def _state(dt: float, rid: str, frm: str | None, to: str, reason: str = "") -> dict[str, Any]:
    """A ``state_changed`` event."""
    return _ev(
        dt, "state_changed", replica_id=rid, to=to, step=None, reason=reason, **{"from": frm}
    )


def _accounts(productive: float, quorum: float, heal: float = 0.0, **more: float) -> dict:
    """Goodput accounts whose ``wall_s`` is their sum, and the ratio."""
    acc = {
        "productive_s": productive,
        "quorum_s": quorum,
        "discarded_s": more.get("discarded", 0.0),
        "heal_s": heal,
        "recovery_s": more.get("recovery", 0.0),
        "regressed_s": more.get("regressed", 0.0),
    }
    wall = sum(acc.values())
    return {"wall_s": wall, **acc, "ratio": productive / wall if wall else None}


def _group(rid: str, state: str, step: int, productive: float, quorum: float, **more: float):
    """One entry of a ``goodput`` event's ``groups``."""
    return {
        "replica_id": rid,
        "state": state,
        "step": step,
        **_accounts(productive, quorum, **more),
        "regressed_steps": 0,
        "steps_committed": step,
        "phases": {
            "input_s": 0.1 * step,
            "forward_s": 0.3 * step,
            "backward_s": 0.5 * step,
            "optimizer_s": 0.05 * step,
            "collective_s": 0.2 * step,
            "quorum_wait_s": 0.02 * step,
            "should_commit_s": 0.01 * step,
        },
    }


def _goodput(dt: float, groups: list[dict[str, Any]], final: bool = False, **extra: Any) -> dict:
    """A ``goodput`` event whose job fields are the sums over ``groups``."""
    keys = ("wall_s", "productive_s", "quorum_s", "discarded_s", "heal_s", "recovery_s")
    job = {k: round(sum(g[k] for g in groups), 6) for k in (*keys, "regressed_s")}
    fields = {
        "job": "",
        "final": final,
        "window_start_unix_s": T0 + 5.0,
        "step": max(g["step"] for g in groups),
        **job,
        "regressed_steps": sum(g["regressed_steps"] for g in groups),
        "steps_committed": sum(g["steps_committed"] for g in groups),
        "ratio": job["productive_s"] / job["wall_s"] if job["wall_s"] else None,
        "groups": groups,
        "groups_omitted": 0,
    }
    fields.update(extra)
    return _ev(dt, "goodput", **fields)


def scenario() -> list[dict[str, Any]]:
    """Two groups (one with a malicious id) train; the evil one is lost, the job regresses,
    it heals back, both finish; goodput reported every 10 s and once more at the end."""
    return _numbered(
        [
            _ev(0.0, "lighthouse_started", min_replicas=1, pid=42),
            _state(1.0, "g0", None, "joining", "seen"),
            _state(1.0, EVIL_ID, None, "joining", "seen"),
            _ev(
                5.0,
                "quorum_changed",
                quorum_id=7,
                previous_quorum_id=None,
                participants=["g0", EVIL_ID],
            ),
            _state(5.5, "g0", "joining", "healthy", "committed"),
            _state(5.5, EVIL_ID, "joining", "healthy", "committed"),
            _goodput(
                10.0,
                [_group("g0", "healthy", 10, 4.0, 1.0), _group(EVIL_ID, "healthy", 10, 4.0, 1.0)],
            ),
            _goodput(
                20.0,
                [_group("g0", "healthy", 30, 12.0, 2.0), _group(EVIL_ID, "healthy", 30, 12.0, 2.0)],
            ),
            _ev(21.0, "replica_lost", replica_id=EVIL_ID, incarnation="x", reason="session ended"),
            _state(21.0, EVIL_ID, "healthy", "lost", "session ended"),
            _ev(
                22.0,
                "progress_regressed",
                quorum_id=8,
                from_step=30,
                to_step=28,
                steps_lost=2,
                alive_holders=[],
                unavoidable=True,
                snapshot_step=None,
            ),
            _ev(
                23.0,
                "replica_hung",
                replica_id="g0",
                idle_s=12.5,
                hang_timeout_s=10,
                rule="configured",
            ),
            _ev(
                24.0,
                "replica_diverged",
                replica_id="g0",
                step=29,
                action="heal",
                majority=[],
                compared=2,
                ranks=[0],
            ),
            _ev(
                25.0,
                "snapshot_complete",
                replica_id="g0",
                incarnation="g0:1",
                step=28,
                path="/snap/28",
                bytes=1024,
                latest=True,
            ),
            _ev(
                26.0, "commit_failed", replica_id="g0", step=29, error="boom"
            ),  # not in the timeline
            _state(27.0, EVIL_ID, "lost", "healing", "healing from g0"),
            _goodput(
                30.0,
                [
                    _group("g0", "healthy", 45, 18.0, 3.0),
                    _group(EVIL_ID, "healing", 28, 13.0, 2.0, heal=3.0, recovery=4.0),
                ],
            ),
            _state(31.0, EVIL_ID, "healing", "healthy", "committed"),
            _ev(32.0, "straggler_flagged", replica_id=EVIL_IMG, skew_pct=80.0, cause="input-bound"),
            _goodput(
                40.0,
                [
                    _group("g0", "healthy", 60, 26.0, 4.0),
                    _group(EVIL_ID, "healthy", 60, 20.0, 3.0, heal=3.0, recovery=4.0),
                ],
            ),
            _state(44.0, "g0", "healthy", "finished", "shutdown"),
            _state(44.0, EVIL_ID, "healthy", "finished", "shutdown"),
            _goodput(
                45.0,
                [
                    _group("g0", "finished", 64, 28.0, 4.5),
                    _group(EVIL_ID, "finished", 64, 22.0, 3.5, heal=3.0, recovery=4.0),
                ],
                final=True,
            ),
        ]
    )


def _write_log(path: Path, events: list[dict[str, Any]], extra: str = "") -> Path:
    """Writes events as JSON lines, then ``extra`` verbatim."""
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + extra, encoding="utf-8")
    return path


@pytest.fixture
def scenario_log(tmp_path: Path) -> Path:
    return _write_log(tmp_path / "events.jsonl", scenario())


# ----- run_summary -----


def test_summary_schema_and_last_goodput() -> None:
    """The summary has exactly the documented keys, and its goodput and groups are the last
    goodput event's, groups sorted by replica_id with every phase."""
    events = scenario()
    s = run_summary.run_summary(events, generated_unix_s=T0 + 100)
    assert set(s) == SUMMARY_KEYS
    assert s["schema"] == run_summary.SCHEMA == 1
    assert (s["source"], s["job"], s["generated_unix_s"]) == ("event_log", "", T0 + 100)
    assert (s["started_unix_s"], s["ended_unix_s"]) == (T0, T0 + 45.0)
    last = events[-1]
    assert s["goodput"] == {
        k: last[k]
        for k in (
            "window_start_unix_s",
            "step",
            "wall_s",
            "productive_s",
            "quorum_s",
            "discarded_s",
            "heal_s",
            "recovery_s",
            "regressed_s",
            "regressed_steps",
            "steps_committed",
            "ratio",
        )
    }
    assert [g["replica_id"] for g in s["groups"]] == sorted(["g0", EVIL_ID])
    by_id = {g["replica_id"]: g for g in s["groups"]}
    assert by_id[EVIL_ID] == next(g for g in last["groups"] if g["replica_id"] == EVIL_ID)
    assert s["groups_omitted"] == 0
    # The job's wall time is the sum of its accounts, as the lighthouse writes it.
    accounts = ("productive_s", "quorum_s", "discarded_s", "heal_s", "recovery_s", "regressed_s")
    assert s["goodput"]["wall_s"] == pytest.approx(sum(s["goodput"][k] for k in accounts))
    json.dumps(s, allow_nan=False)  # serialisable as strict JSON


def test_series_and_steps_per_s() -> None:
    """One series point per goodput event; steps_per_s is the change of the job's step over
    the time since the previous event (None for the first and across no time)."""
    s = run_summary.run_summary(scenario())
    series = s["series"]
    assert [p["t"] for p in series] == [T0 + 10, T0 + 20, T0 + 30, T0 + 40, T0 + 45]
    assert [p["step"] for p in series] == [10, 30, 45, 60, 64]
    assert [p["steps_per_s"] for p in series] == [None, 2.0, 1.5, 1.5, 0.8]
    gp = [e for e in scenario() if e["kind"] == "goodput"]
    assert [p["ratio"] for p in series] == [e["ratio"] for e in gp]
    assert [p["productive_s"] for p in series] == [e["productive_s"] for e in gp]
    assert [p["wall_s"] for p in series] == [e["wall_s"] for e in gp]

    one = [_group("g", "healthy", 10, 1.0, 0.0)]
    back = [_group("g", "healthy", 6, 1.0, 0.0)]
    same_time = _numbered([_goodput(1.0, one), _goodput(1.0, one), _goodput(3.0, back)])
    assert [p["steps_per_s"] for p in run_summary.run_summary(same_time)["series"]] == [
        None,
        None,  # no time between them
        -2.0,  # a regression: the step went back by 4 in 2 s
    ]
    no_step = _numbered([_goodput(1.0, one, step=None), _goodput(2.0, one)])
    assert [p["steps_per_s"] for p in run_summary.run_summary(no_step)["series"]] == [None, None]


def test_finished_flag() -> None:
    """finished: the last goodput event is final, or every group's last state is finished."""
    events = scenario()
    assert run_summary.run_summary(events)["finished"] is True
    # Without the final goodput event, the groups' last states still say finished.
    assert run_summary.run_summary(events[:-1])["finished"] is True
    # Cut before the groups finished: still running.
    running = [e for e in events if e["ts"] <= T0 + 40]
    assert run_summary.run_summary(running)["finished"] is False
    # A final event followed by more training is not the end.
    g = [_group("g", "healthy", 1, 1.0, 0.0)]
    again = _numbered([_goodput(1.0, g, final=True), _goodput(2.0, g)])
    assert run_summary.run_summary(again)["finished"] is False
    # No groups, no goodput: not finished.
    assert run_summary.run_summary([])["finished"] is False


def test_timeline_entries() -> None:
    """The timeline holds the documented kinds in order, each with its group, new state and
    the detail text the lighthouse writes for it."""
    s = run_summary.run_summary(scenario())
    timeline = s["timeline"]
    assert s["timeline_dropped"] == 0
    kinds = [e["kind"] for e in timeline]
    assert "commit_failed" not in kinds and "goodput" not in kinds
    assert kinds[0] == "lighthouse_started"
    assert set(kinds) <= run_summary.TIMELINE_KINDS
    by_kind = {e["kind"]: e for e in timeline}
    assert by_kind["lighthouse_started"] == {
        "t": T0,
        "kind": "lighthouse_started",
        "replica_id": None,
        "state": None,
        "detail": "",
    }
    assert by_kind["quorum_changed"]["detail"] == "quorum 7: 2 participants"
    assert by_kind["progress_regressed"]["detail"] == "step 30 -> 28 (2 steps lost)"
    # A total loss resumed by fresh processes (asking at step 0) from a durable snapshot.
    resumed = {"kind": "progress_regressed", "from_step": 30, "to_step": 0}
    assert (
        run_summary._detail({**resumed, "resumes_from": 20, "steps_lost": 10})
        == "step 30 -> 0, resuming from the snapshot of step 20 (10 steps lost)"
    )
    assert (
        run_summary._detail({**resumed, "resumes_from": 0, "steps_lost": 30})
        == "step 30 -> 0 (30 steps lost)"
    )
    assert by_kind["replica_lost"]["detail"] == "session ended"
    assert by_kind["replica_hung"]["detail"] == "configured"
    assert by_kind["replica_diverged"]["detail"] == "step 29: heal"
    assert by_kind["snapshot_complete"]["detail"] == "step 28"
    assert by_kind["straggler_flagged"]["replica_id"] == EVIL_IMG
    assert by_kind["straggler_flagged"]["detail"] == "input-bound"
    states = [
        (e["replica_id"], e["state"], e["detail"]) for e in timeline if e["kind"] == "state_changed"
    ]
    assert states[0] == ("g0", "joining", " -> joining: seen")
    assert (EVIL_ID, "lost", "healthy -> lost: session ended") in states
    assert states[-1] == (EVIL_ID, "finished", "healthy -> finished: shutdown")


def test_timeline_keeps_the_last_entries() -> None:
    """Past MAX_TIMELINE entries the earliest are left out and counted; details are cut at
    200 characters."""
    n = run_summary.MAX_TIMELINE + 7
    events = _numbered(
        [
            _state(float(i), "g", "healthy", "straggler" if i % 2 else "healthy", f"#{i}")
            for i in range(n)
        ]
        + [_ev(float(n), "replica_failed", replica_id="g", error="x" * 500)]
    )
    s = run_summary.run_summary(events)
    assert len(s["timeline"]) == run_summary.MAX_TIMELINE
    assert s["timeline_dropped"] == 8
    assert s["timeline"][0]["detail"] == "healthy -> healthy: #8"
    assert s["timeline"][-1]["detail"] == "x" * 200
    assert s["started_unix_s"] == T0  # the span is the log's, not the kept timeline's


def test_jobs_are_reported_one_at_a_time() -> None:
    """A log of several rooms: the summary reports one job (the last goodput event's unless
    named); lighthouse_started belongs to every job."""
    g = [_group("a0", "healthy", 5, 1.0, 1.0)]
    events = _numbered(
        [
            _ev(0.0, "lighthouse_started", min_replicas=1, pid=1),
            _state(1.0, "d0", None, "joining"),
            _state(2.0, "a0", None, "joining") | {"job": "team-a"},
            _goodput(3.0, [_group("d0", "healthy", 9, 1.0, 1.0)]),
            _goodput(4.0, g, job="team-a"),
        ]
    )
    assert run_summary.jobs_in(events) == ["", "team-a"]
    s = run_summary.run_summary(events)
    assert s["job"] == "team-a"
    assert [e["replica_id"] for e in s["timeline"]] == [None, "a0"]
    assert [p["step"] for p in s["series"]] == [5]
    d = run_summary.run_summary(events, job="")
    assert [e["replica_id"] for e in d["timeline"]] == [None, "d0"]
    assert d["goodput"]["step"] == 9
    assert run_summary.report_names("") == ("summary.json", "summary.html")
    assert run_summary.report_names("team-a") == ("summary-team-a.json", "summary-team-a.html")
    for bad in ("../x", ".hidden", "a/b", "x" * 65):
        with pytest.raises(ValueError, match="invalid job name"):
            run_summary.report_names(bad)


def test_bad_goodput_lines_are_skipped_and_reported(tmp_path: Path) -> None:
    """goodput events are validated like the other kinds: a bad one is skipped with the reason,
    the others are kept (a null job step and ratio are allowed)."""
    good = scenario()[6]
    assert "goodput" in eventlog.KINDS and "goodput" not in eventlog.REPLICA_KINDS

    def variant(**changes: Any) -> dict[str, Any]:
        event = json.loads(json.dumps(good))
        for key, value in changes.items():
            if value is _DROP:
                del event[key]
            else:
                event[key] = value
        return event

    group = good["groups"][0]
    bad_phase = json.loads(json.dumps(group))
    bad_phase["phases"]["forward_s"] = "1"
    lines = [
        variant(),
        variant(ratio="0.5"),
        variant(wall_s=_DROP),
        variant(step=True),
        variant(groups={"g0": group}),
        variant(groups=[{**group, "replica_id": 3}]),
        variant(groups=[bad_phase]),
        variant(groups=[{**group, "productive_s": None}]),
        variant(final="yes"),
        variant(groups_omitted=-1),
        variant(window_start_unix_s="soon"),
        variant(step=None, ratio=None, window_start_unix_s=None, groups=_DROP),
    ]
    events, problems = eventlog.read_events(_write_log(tmp_path / "log", lines))
    assert problems == [
        "line 2: 'ratio' is not a number or null (goodput)",
        "line 3: missing 'wall_s' (goodput)",
        "line 4: 'step' is not a number (goodput)",
        "line 5: 'groups' is not a list (goodput)",
        "line 6: groups[0]: 'replica_id' is not a non-empty string (goodput)",
        "line 7: groups[0]: phase 'forward_s' is not a number (goodput)",
        "line 8: groups[0]: 'productive_s' is not a number (goodput)",
        "line 9: 'final' is not a boolean (goodput)",
        "line 10: 'groups_omitted' is not a non-negative integer (goodput)",
        "line 11: 'window_start_unix_s' is not a number or null (goodput)",
    ]
    assert len(events) == 2
    s = run_summary.run_summary(events)
    assert s["goodput"]["step"] is None and s["groups"] == []
    assert [p["steps_per_s"] for p in s["series"]] == [None, None]
    # The text summary counts the kind and is otherwise unchanged by it.
    assert eventlog.summarize(events)["kinds"] == {"goodput": 2}


# ----- escaping and the template -----


def test_script_json_cannot_end_the_script() -> None:
    """Markup and line separators in the data are written as \\u escapes that decode to the
    same text."""
    summary = run_summary.run_summary(scenario())
    summary["groups"][0]["state"] = "a\u2028b\u2029c & <!-- d -->"
    text = run_summary.script_json(summary)
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        assert raw not in text
    assert "\\u003c/script\\u003e\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in text
    assert json.loads(text) == summary


def test_render_html_fills_the_one_placeholder() -> None:
    """The page holds the summary in #summary-data, once, and nothing of the data as markup;
    the data's own text is never searched for the placeholder."""
    summary = run_summary.run_summary(scenario())
    summary["job"] = run_summary.PLACEHOLDER  # must not be replaced again
    page = run_summary.render_html(summary)
    assert EVIL_ID not in page and EVIL_IMG not in page
    assert page.count("<script") == 2 and page.count("</script>") == 2
    m = re.search(r'<script id="summary-data" type="application/json">(.*?)</script>', page, re.S)
    assert m is not None
    assert json.loads(m.group(1)) == summary


def _template() -> str:
    return resources.files("torchft").joinpath("summary.html").read_text(encoding="utf-8")


def test_template_ships_with_one_placeholder_and_no_external_assets() -> None:
    """The template is package data with exactly one placeholder, in the data element, and
    loads nothing from elsewhere."""
    page = _template()
    assert page.count(run_summary.PLACEHOLDER) == 1
    assert (
        f'<script id="summary-data" type="application/json">{run_summary.PLACEHOLDER}</script>'
        in page
    )
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page
    assert "document.write" not in page and "eval(" not in page
    for chart in ("step-rate", "goodput", "timeline", "accounts", "phases"):
        assert f'id="chart-{chart}"' in page


def test_template_policy_names_the_script_hash() -> None:
    """The page's Content-Security-Policy allows exactly its own inline script."""
    page = _template()
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 1
    want = base64.b64encode(hashlib.sha256(scripts[0].encode("utf-8")).digest()).decode()
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page)
    assert policy is not None
    assert f"script-src 'sha256-{want}'" in policy.group(1), (
        f"the script changed: set script-src 'sha256-{want}' in python/torchft/summary.html"
    )


# ----- the command line -----


def _run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchft.eventlog", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(120)
def test_cli_writes_both_files(scenario_log: Path, tmp_path: Path) -> None:
    """--html DIR writes summary.json and summary.html there and prints their paths; without
    DIR they go next to the log."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _run_cli([str(scenario_log), "--html", str(out)])
    assert proc.returncode == 0, proc.stderr
    paths = [out / "summary.json", out / "summary.html"]
    assert proc.stdout.splitlines() == [str(p) for p in paths]
    assert sorted(os.listdir(out)) == ["summary.html", "summary.json"]
    written = json.loads(paths[0].read_text(encoding="utf-8"))
    expected = run_summary.run_summary(scenario(), generated_unix_s=written["generated_unix_s"])
    assert written == expected
    page = paths[1].read_text(encoding="utf-8")
    assert run_summary.PLACEHOLDER not in page and EVIL_ID not in page
    assert page == run_summary.render_html(written)

    proc = _run_cli([str(scenario_log), "--html"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        str(tmp_path / "summary.json"),
        str(tmp_path / "summary.html"),
    ]
    assert sorted(os.listdir(tmp_path)) == ["events.jsonl", "out", "summary.html", "summary.json"]


@pytest.mark.timeout(120)
def test_cli_bad_log_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    """A missing or empty log is a clear error (exit 2) and leaves no file."""
    out = tmp_path / "out"
    out.mkdir()
    missing = tmp_path / "missing.jsonl"
    proc = _run_cli([str(missing), "--html", str(out)])
    assert (proc.returncode, proc.stdout) == (2, "")
    assert f"error: {missing}: no such file" in proc.stderr

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = _run_cli([str(empty), "--html", str(out)])
    assert (proc.returncode, proc.stdout) == (2, "")
    assert f"error: {empty}: empty log (no events), nothing to report" in proc.stderr
    assert os.listdir(out) == []


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = eventlog.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(60)
def test_cli_errors(scenario_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad output directories, bad logs and bad flag combinations get one clear message and
    exit 2, and leave nothing behind."""
    log = str(scenario_log)
    code, out, err = _main([log, "--html", str(tmp_path / "nope")], capsys)
    assert (code, out, err) == (2, "", f"error: {tmp_path / 'nope'}: no such directory\n")
    code, out, err = _main([log, "--html", log], capsys)
    assert (code, out, err) == (2, "", f"error: {log}: not a directory\n")

    garbage = _write_log(tmp_path / "garbage.jsonl", [], extra="nope\n{}\n")
    code, out, err = _main([str(garbage), "--html", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (
        f"error: {garbage}: no valid events (2 lines skipped), nothing to report"
    )
    code, out, err = _main([log, "--html", str(tmp_path), "--job", "team-x"], capsys)
    assert (code, out, err) == (2, "", "error: unknown job 'team-x'; jobs in the log: ''\n")
    for flags in (
        ["--html", "--json"],
        ["--html", str(tmp_path), "--replica", "g0"],
        ["--job", "a"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            eventlog.main([log, *flags])
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["events.jsonl", "garbage.jsonl"]

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, out, err = _main([log, "--html", str(locked)], capsys)
        assert (code, out) == (2, "")
        assert err == f"error: {locked}: permission denied, cannot write the report\n"
        assert os.listdir(locked) == []


@pytest.mark.timeout(60)
def test_cli_leaves_no_partial_file_on_a_failed_write(
    scenario_log: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write that fails midway (disk full on the page) leaves neither file nor a temporary
    one, and an old report stays whole."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("old json")
    real_fsync = os.fsync
    calls: list[int] = []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the page's
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(run_summary.os, "fsync", fsync)
    code, out_text, err = _main([str(scenario_log), "--html", str(out)], capsys)
    assert (code, out_text) == (2, "")
    assert err == f"error: {out}: cannot write the report: No space left on device\n"
    assert os.listdir(out) == ["summary.json"]
    assert (out / "summary.json").read_text() == "old json"


@pytest.mark.timeout(60)
def test_cli_named_job_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A named job's report is summary-JOB.*, as the lighthouse names it; --job picks one of
    several rooms, and without it the choice is announced."""
    g = [_group("a0", "healthy", 5, 1.0, 1.0)]
    events = _numbered(
        [_goodput(1.0, [_group("d0", "healthy", 9, 1.0, 1.0)]), _goodput(2.0, g, job="team-a")]
    )
    log = _write_log(tmp_path / "log.jsonl", events)
    code, out, err = _main([str(log), "--html"], capsys)
    assert code == 0, err
    assert out.splitlines() == [
        str(tmp_path / "summary-team-a.json"),
        str(tmp_path / "summary-team-a.html"),
    ]
    assert "reporting 'team-a' (pick one with --job)" in err
    code, out, err = _main([str(log), "--html", "--job", ""], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "summary.json").read_text())["goodput"]["step"] == 9


# ----- the page in a browser -----


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    reason = chromium_available()
    if reason:
        pytest.skip(reason)
    with headless_chromium() as d:
        yield d


def wait_until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Polls ``condition`` until it returns something truthy; fails the test on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last value: {last!r})")


PAGE_JS = """
const count = (sel) => document.querySelectorAll(sel).length;
const text = (id) => document.getElementById(id).textContent;
const charts = {};
for (const id of ['chart-step-rate', 'chart-goodput', 'chart-timeline', 'chart-accounts',
                  'chart-phases']) {
  const svg = document.getElementById(id);
  charts[id] = {
    paths: svg.querySelectorAll('path').length, rects: svg.querySelectorAll('rect').length,
    empty: svg.getAttribute('data-empty') === 'true',
    nodata: Array.from(svg.querySelectorAll('text.nodata')).map((t) => t.textContent),
  };
}
return {
  charts,
  series: count('#chart-step-rate path.series') + count('#chart-goodput path.series'),
  segs: count('#chart-timeline rect.seg'), marks: count('#chart-timeline path.mark'),
  bars: [count('#chart-accounts rect.bar'), count('#chart-phases rect.bar')],
  header: {goodput: text('hdr-goodput'), steps: text('hdr-steps'), step: text('hdr-step'),
           finished: text('hdr-finished'), start: text('hdr-start'), end: text('hdr-end'),
           duration: text('hdr-duration'), job: text('hdr-job')},
  loadError: text('load-error'),
  accountIds: Array.from(document.querySelectorAll('#table-accounts tbody tr td:first-child'))
    .map((td) => td.textContent),
  eventGroups: Array.from(document.querySelectorAll('#table-events tbody tr'))
    .map((tr) => tr.cells[2].textContent),
  laneTitles: Array.from(document.querySelectorAll('#chart-timeline text.lane-label title'))
    .map((t) => t.textContent),
  scripts: count('script'), injected: count('img') + count('main script') + count('table script'),
};
"""


def open_report(driver: Any, page: Path) -> dict[str, Any]:
    """Opens a report from disk and returns what it drew."""
    driver.get(page.as_uri())
    wait_until(
        lambda: driver.execute_script("return document.body.getAttribute('data-drawn');"),
        what="the page's script to finish",
    )
    return driver.execute_script(PAGE_JS)


def assert_no_alert_and_no_errors(driver: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018 - raises when no alert is open
    errors = console_errors(driver)
    assert errors == [], f"console errors: {errors}"


@pytest.mark.timeout(120)
def test_page_draws_every_chart(driver: Any, scenario_log: Path, tmp_path: Path) -> None:
    """The report written by the CLI, opened from file://, draws every chart, shows the final
    goodput in its header, and shows markup in ids as text without running it."""
    assert eventlog.main([str(scenario_log), "--html", str(tmp_path)]) == 0
    got = open_report(driver, tmp_path / "summary.html")
    assert_no_alert_and_no_errors(driver)
    for chart, drawn in got["charts"].items():
        assert drawn["paths"] + drawn["rects"] > 0, chart
        assert not drawn["empty"] and drawn["nodata"] == [], chart
    assert got["series"] == 2
    # Lanes: g0 joining/healthy/finished, EVIL_ID joining/healthy/lost/healing/healthy/finished.
    assert got["segs"] == 9
    assert got["marks"] >= 7  # quorum, regression, restart, lost, hang, divergence, snapshot...
    assert got["bars"][0] >= 3 and got["bars"][1] >= 7
    last = scenario()[-1]
    assert got["header"]["goodput"] == f"{last['ratio'] * 100:.1f}%"
    assert got["header"] == {
        "goodput": f"{last['ratio'] * 100:.1f}%",
        "steps": str(last["steps_committed"]),
        "step": "64",
        "finished": "yes",
        "start": "2024-11-21 06:20:00",
        "end": "2024-11-21 06:20:45",
        "duration": "45.0 s",
        "job": "default room",
    }
    assert got["loadError"] == ""
    assert got["accountIds"] == ["job (all groups)", EVIL_ID, "g0"]
    assert EVIL_IMG in got["eventGroups"] and EVIL_ID in got["eventGroups"]
    assert set(got["laneTitles"]) == {"job", "g0", EVIL_ID, EVIL_IMG}
    assert (got["scripts"], got["injected"]) == (2, 0)
    assert driver.execute_script("return typeof window.alert") == "function"


@pytest.mark.timeout(120)
def test_page_without_data_says_so(driver: Any, tmp_path: Path) -> None:
    """A summary with nothing in it shows "no data" in every chart, and the bare template a
    clear message; neither breaks the page."""
    page = tmp_path / "empty.html"
    page.write_text(run_summary.render_html(run_summary.run_summary([])), encoding="utf-8")
    got = open_report(driver, page)
    assert_no_alert_and_no_errors(driver)
    for chart, drawn in got["charts"].items():
        assert drawn["empty"], chart
        assert len(drawn["nodata"]) == 1 and drawn["nodata"][0].startswith("no data"), chart
        assert drawn["paths"] == drawn["rects"] == 0, chart
    assert got["header"]["goodput"] == "n/a" and got["header"]["finished"] == "no"
    assert got["loadError"] == ""

    bare = tmp_path / "template.html"
    bare.write_text(_template(), encoding="utf-8")
    got = open_report(driver, bare)
    assert_no_alert_and_no_errors(driver)
    assert "holds no readable summary" in got["loadError"]
    assert all(drawn["empty"] for drawn in got["charts"].values())

    # One goodput report: a point, not a line, and the step rate needs two.
    one = _numbered([_goodput(1.0, [_group("g", "healthy", 3, 1.0, 1.0)])])
    page.write_text(run_summary.render_html(run_summary.run_summary(one)), encoding="utf-8")
    got = open_report(driver, page)
    assert_no_alert_and_no_errors(driver)
    assert got["charts"]["chart-step-rate"]["nodata"] == [
        "no data: the rate needs two goodput reports"
    ]
    assert not got["charts"]["chart-goodput"]["empty"]
    assert got["header"]["goodput"] == "50.0%"
