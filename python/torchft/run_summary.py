"""The end-of-run report of a job: ``summary.json`` and the page ``summary.html`` that draws it.

The lighthouse writes both next to its event log when the job ends (or on request);
``python -m torchft.eventlog PATH --html [OUT_DIR]`` builds the same two files afterwards from
the event log alone. Both fill one template, ``summary.html`` in this package (the lighthouse
embeds the same file), whose single placeholder :data:`PLACEHOLDER` receives the summary as
JSON; the page's own script draws it, offline (no external assets, works from ``file://``).

The summary (:func:`run_summary`, schema :data:`SCHEMA`) holds the job's last ``goodput``
event (accounts and ratio, per group with its step phases), the series of all of them (step
rate and goodput over time) and a timeline of the events a post-mortem looks for (state
changes, quorum changes, regressions, losses, hangs, divergences, snapshots). See
docs/telemetry.md, "End-of-run report".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterable
from importlib import resources
from typing import Any

from torchft.eventlog import (
    GOODPUT_ACCOUNTS,
    GOODPUT_COUNTS,
    GOODPUT_PHASES,
    _check_event,
)

__all__ = [
    "SCHEMA",
    "PLACEHOLDER",
    "jobs_in",
    "run_summary",
    "render_html",
    "report_names",
    "script_json",
    "write_report",
]

#: Version of the summary's layout; a change that renames or removes a field bumps it.
SCHEMA = 1

#: The one spot of the template that receives the summary's JSON.
PLACEHOLDER = "__TORCHFT_SUMMARY_JSON__"

#: The template, a file of this package.
TEMPLATE = "summary.html"

#: The names of the two files the report writes (for the default room; see
#: :func:`report_names`).
SUMMARY_JSON = "summary.json"
SUMMARY_HTML = "summary.html"

#: A job name the lighthouse accepts (``validate_job`` in ``src/ids.rs``).
_JOB_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")

#: Kinds the report's timeline shows.
TIMELINE_KINDS: frozenset[str] = frozenset(
    {
        "state_changed",
        "quorum_changed",
        "progress_regressed",
        "replica_lost",
        "replica_failed",
        "replica_hung",
        "replica_diverged",
        "straggler_flagged",
        "straggler_dropped",
        "snapshot_complete",
        "snapshot_failed",
        "lighthouse_started",
    }
)

#: The most timeline entries a summary keeps (the last ones).
MAX_TIMELINE = 5000

#: Kinds that belong to the whole lighthouse, not to one job's room (they carry no ``job``).
_GLOBAL_KINDS: frozenset[str] = frozenset({"lighthouse_started"})

#: Longest ``detail`` of a timeline entry.
_DETAIL_CHARS = 200

#: What JSON may hold but a ``<script>`` element's text must not (``</script>``, ``<!--``,
#: and the line separators old JavaScript parsers choke on), with their JSON escapes.
_SCRIPT_ESCAPES: tuple[tuple[str, str], ...] = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)


def _job_of(event: dict[str, Any]) -> str:
    """The job (room) an event belongs to: its ``job``, ``""`` for the default room.

    Args:
        event: A valid event.

    Returns:
        The job's name.
    """
    job = event.get("job", "")
    return job if isinstance(job, str) else ""


def jobs_in(events: Iterable[dict[str, Any]]) -> list[str]:
    """The jobs (rooms) whose events a log holds.

    Args:
        events: Events as :func:`torchft.eventlog.read_events` returns them.

    Returns:
        Their names, sorted; ``""`` is the default room.
    """
    return sorted(
        {_job_of(e) for e in events if _check_event(e) is None and e["kind"] not in _GLOBAL_KINDS}
    )


def _choose_job(events: list[dict[str, Any]]) -> str:
    """The job a summary reports when none is named: the one of the last ``goodput`` event,
    else the default room when it has events, else the first job by name.

    Args:
        events: Valid events in file order.

    Returns:
        The job's name.
    """
    for event in reversed(events):
        if event["kind"] == "goodput":
            return _job_of(event)
    jobs = jobs_in(events)
    return "" if not jobs or "" in jobs else jobs[0]


def _text(value: Any) -> str:
    """A field's value as text for a timeline entry.

    Args:
        value: Any decoded JSON value.

    Returns:
        Strings as they are, ``""`` for null or a missing field, anything else as compact JSON.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _detail(event: dict[str, Any]) -> str:
    """The short text a timeline entry shows about its event.

    The lighthouse's report follows the same rule (``timeline_detail`` in
    ``src/lighthouse/health/telemetry/report.rs``), so both reports read alike.

    Args:
        event: A valid event of one of :data:`TIMELINE_KINDS`.

    Returns:
        At most :data:`_DETAIL_CHARS` characters.
    """
    kind = event["kind"]

    def field(name: str) -> str:
        return _text(event.get(name))

    if kind == "state_changed":
        reason = field("reason")
        text = f"{field('from')} -> {field('to')}" + (f": {reason}" if reason else "")
    elif kind == "quorum_changed":
        participants = event.get("participants")
        count = len(participants) if isinstance(participants, list) else 0
        text = f"quorum {field('quorum_id')}: {count} participants"
    elif kind == "progress_regressed":
        to, resumed = field("to_step"), field("resumes_from")
        via = f", resuming from the snapshot of step {resumed}" if resumed not in ("", to) else ""
        text = f"step {field('from_step')} -> {to}{via} ({field('steps_lost')} steps lost)"
    elif kind in ("snapshot_complete", "snapshot_failed"):
        error = field("error")
        text = f"step {field('step')}" + (f": {error}" if error else "")
    elif kind == "straggler_flagged":
        text = field("cause")
    elif kind == "replica_diverged":
        text = f"step {field('step')}: {field('action')}"
    else:
        text = next((v for v in (field("reason"), field("error"), field("rule")) if v), "")
    return text[:_DETAIL_CHARS]


def _group(group: dict[str, Any]) -> dict[str, Any]:
    """One group of the last ``goodput`` event in the summary's fixed shape.

    Args:
        group: A validated entry of the event's ``groups``.

    Returns:
        ``replica_id``, ``state``, the counters, the accounts, ``ratio`` and ``phases`` (every
        phase, 0 when the event left it out).
    """
    phases = group.get("phases") or {}
    state = group.get("state")
    return {
        "replica_id": group["replica_id"],
        "state": state if isinstance(state, str) else None,
        **{name: group[name] for name in (*GOODPUT_COUNTS, *GOODPUT_ACCOUNTS)},
        "ratio": group.get("ratio"),
        "phases": {name: phases.get(name, 0.0) for name in GOODPUT_PHASES},
    }


def run_summary(
    events: Iterable[dict[str, Any]],
    *,
    job: str | None = None,
    source: str = "event_log",
    generated_unix_s: float | None = None,
) -> dict[str, Any]:
    """Builds the end-of-run summary of one job from its events.

    Args:
        events: Events in file order (as :func:`torchft.eventlog.read_events` returns them);
            any it would skip are ignored.
        job: The job (room) to report; ``None`` picks the job of the last ``goodput`` event
            (else the default room). ``lighthouse_started`` events belong to every job.
        source: Who built it: ``"event_log"`` (this module) or ``"lighthouse"``.
        generated_unix_s: When it was built; now when ``None``.

    Returns:
        A JSON-serialisable dict: ``schema``, ``source``, ``job``, ``generated_unix_s``,
        ``started_unix_s`` and ``ended_unix_s`` (the job's first and last event, ``None``
        without events), ``finished`` (the last ``goodput`` event is ``final``, or every group
        that changed state ended ``finished``), ``goodput`` (the job-level fields of the last
        ``goodput`` event: ``window_start_unix_s``, ``step``, the accounts,
        ``regressed_steps``, ``steps_committed``, ``ratio``; ``None`` without one),
        ``groups`` (that event's groups by ``replica_id``, every phase present),
        ``groups_omitted`` (its groups not listed), ``series`` (per ``goodput`` event: ``t``,
        ``step``, ``ratio``, ``steps_per_s`` — the change of ``step`` since the previous one
        over the time between them, negative across a regression, ``None`` for the first —,
        ``productive_s``, ``wall_s``), ``timeline`` (per event of :data:`TIMELINE_KINDS`:
        ``t``, ``kind``, ``replica_id``, ``state`` (the new state of a ``state_changed``),
        ``detail``; the last :data:`MAX_TIMELINE`) and ``timeline_dropped`` (how many
        earlier entries were left out).
    """
    valid = [e for e in events if _check_event(e) is None]
    chosen = _choose_job(valid) if job is None else job
    mine = [e for e in valid if e["kind"] in _GLOBAL_KINDS or _job_of(e) == chosen]
    goodputs = [e for e in mine if e["kind"] == "goodput"]

    series: list[dict[str, Any]] = []
    prev: dict[str, Any] | None = None
    for event in goodputs:
        rate: float | None = None
        if prev is not None and event["step"] is not None and prev["step"] is not None:
            dt = float(event["ts"]) - float(prev["ts"])
            if dt > 0:
                rate = round((float(event["step"]) - float(prev["step"])) / dt, 6)
        series.append(
            {
                "t": event["ts"],
                "step": event["step"],
                "ratio": event.get("ratio"),
                "steps_per_s": rate,
                "productive_s": event["productive_s"],
                "wall_s": event["wall_s"],
            }
        )
        prev = event

    last = goodputs[-1] if goodputs else None
    goodput: dict[str, Any] | None = None
    groups: list[dict[str, Any]] = []
    if last is not None:
        goodput = {
            "window_start_unix_s": last.get("window_start_unix_s"),
            "step": last["step"],
            **{name: last[name] for name in GOODPUT_ACCOUNTS},
            "regressed_steps": last["regressed_steps"],
            "steps_committed": last["steps_committed"],
            "ratio": last.get("ratio"),
        }
        groups = sorted(
            (_group(g) for g in last.get("groups") or []), key=lambda g: str(g["replica_id"])
        )

    timeline: list[dict[str, Any]] = []
    last_state: dict[str, Any] = {}
    for event in mine:
        kind = event["kind"]
        if kind not in TIMELINE_KINDS:
            continue
        replica_id = event.get("replica_id")
        state = event.get("to") if kind == "state_changed" else None
        if kind == "state_changed":
            last_state[str(replica_id)] = state  # validated: a non-empty string
        timeline.append(
            {
                "t": event["ts"],
                "kind": kind,
                "replica_id": replica_id if isinstance(replica_id, str) else None,
                "state": state if isinstance(state, str) else None,
                "detail": _detail(event),
            }
        )
    dropped = max(0, len(timeline) - MAX_TIMELINE)

    finished = (last is not None and last.get("final") is True) or (
        bool(last_state) and all(s == "finished" for s in last_state.values())
    )
    return {
        "schema": SCHEMA,
        "source": source,
        "job": chosen,
        "generated_unix_s": round(time.time() if generated_unix_s is None else generated_unix_s, 3),
        "started_unix_s": mine[0]["ts"] if mine else None,
        "ended_unix_s": mine[-1]["ts"] if mine else None,
        "finished": finished,
        "goodput": goodput,
        "groups": groups,
        "groups_omitted": last.get("groups_omitted", 0) if last is not None else 0,
        "series": series,
        "timeline": timeline[dropped:],
        "timeline_dropped": dropped,
    }


def script_json(summary: dict[str, Any]) -> str:
    """The summary as JSON that is safe inside a ``<script>`` element.

    ``<``, ``>``, ``&``, U+2028 and U+2029 only occur inside JSON strings; written as
    ``\\u`` escapes they decode to the same text, but can never end the element
    (``</script>``), open a comment or break an old parser.

    Args:
        summary: A summary from :func:`run_summary`.

    Returns:
        Compact JSON without those characters.

    Raises:
        ValueError: The summary holds a NaN or an infinity (not JSON).
    """
    text = json.dumps(summary, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char, escape in _SCRIPT_ESCAPES:
        text = text.replace(char, escape)
    return text


def render_html(summary: dict[str, Any]) -> str:
    """The report page: the package's template with the summary in its placeholder.

    Args:
        summary: A summary from :func:`run_summary`.

    Returns:
        A self-contained HTML page.

    Raises:
        RuntimeError: The template does not hold the placeholder exactly once.
        ValueError: The summary is not JSON (see :func:`script_json`).
    """
    template = resources.files("torchft").joinpath(TEMPLATE).read_text(encoding="utf-8")
    head, found, tail = template.partition(PLACEHOLDER)
    if not found or PLACEHOLDER in tail:
        raise RuntimeError(f"the report template must hold {PLACEHOLDER} exactly once")
    # Joined, not str.replace: the summary's own text is never searched for the placeholder.
    return head + script_json(summary) + tail


def _write_temp(directory: str, name: str, text: str) -> str:
    """Writes ``text`` to a new hidden file in ``directory`` and syncs it.

    Args:
        directory: Where the final file goes (the temporary one must be on its file system).
        name: The final file's name.
        text: The content.

    Returns:
        The temporary file's path; on error nothing is left behind.

    Raises:
        OSError: The file cannot be created or written.
    """
    path = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    # Created like any new file (0666 less the umask), not 0600 as mkstemp would.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


def report_names(job: str) -> tuple[str, str]:
    """The file names of a job's report, as the lighthouse names them.

    Args:
        job: The job (room); ``""`` for the default room.

    Returns:
        ``summary.json`` and ``summary.html``, or ``summary-JOB.json`` and
        ``summary-JOB.html`` for a named room.

    Raises:
        ValueError: ``job`` is not a job name the lighthouse accepts (1 to 64 ASCII letters,
            digits, ``-``, ``_`` and ``.``, not starting with ``.``), so not a safe file name.
    """
    if not job:
        return SUMMARY_JSON, SUMMARY_HTML
    if not _JOB_NAME.fullmatch(job):
        raise ValueError(f"invalid job name {job!r}: not usable in a file name")
    return f"summary-{job}.json", f"summary-{job}.html"


def write_report(summary: dict[str, Any], html: str, out_dir: str) -> tuple[str, str]:
    """Writes a summary and its page to ``out_dir`` (see :func:`report_names`), each
    atomically.

    Each file is written whole to a temporary file in ``out_dir`` and then renamed over the
    final name, so a reader never sees half a file and a failure leaves nothing behind.

    Args:
        summary: A summary from :func:`run_summary`.
        html: Its page, from :func:`render_html`.
        out_dir: An existing, writable directory.

    Returns:
        The paths of the JSON file and the page.

    Raises:
        ValueError: The summary's job is not a valid job name.
        OSError: ``out_dir`` is missing, not a directory, or not writable.
    """
    json_name, html_name = report_names(str(summary.get("job") or ""))
    texts = (
        (json_name, json.dumps(summary, indent=2, ensure_ascii=False, allow_nan=False) + "\n"),
        (html_name, html),
    )
    temps: list[tuple[str, str]] = []
    try:
        for name, text in texts:
            temps.append((_write_temp(out_dir, name, text), os.path.join(out_dir, name)))
        for temp, final in temps:
            os.replace(temp, final)
    except BaseException:
        for temp, _ in temps:
            with contextlib.suppress(OSError):
                os.unlink(temp)  # gone already once renamed
        raise
    return temps[0][1], temps[1][1]
