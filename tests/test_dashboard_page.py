"""Browser tests of the lighthouse dashboard page (src/lighthouse/dashboard.html and its script,
dashboard.js).

The page is served by a small mock HTTP server in this module that follows docs/telemetry.md:
``/status`` (JSON the tests change between polls), ``/history`` (the job's series),
``/events`` (server-sent events) and
``POST /replicas/<id>/kill`` (recorded). Headless Chromium loads it (tests/_browser.py);
the tests skip when chromium or chromedriver is not installed.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _browser import chromium_available, console_errors, headless_chromium

PAGE = Path(__file__).resolve().parent.parent / "src" / "lighthouse" / "dashboard.html"
SCRIPT = PAGE.with_name("dashboard.js")
DASH = "\u2013"
EVIL_ID = "<img src=x onerror=alert(1)>"


def make_goodput(ratio: float, wall_s: float = 400.0) -> dict:
    """A goodput account (of ``/status`` or of a replica) with the given ratio."""
    g = dict(ratio=ratio, wall_s=wall_s, productive_s=ratio * wall_s, quorum_s=12.5, heal_s=7.25)
    g.update(discarded_s=3.0, recovery_s=20.0, regressed_s=1.5, regressed_steps=2, step=240)
    return {**g, "steps_committed": 240, "window_start_unix_s": time.time() - wall_s}


def make_replica(replica_id: str, state: str = "healthy", step: int = 0, **fields: Any) -> dict:
    """One ``replicas`` entry of ``/status`` as documented; ``fields`` override defaults."""
    timings = dict(step_s=0.25, busy_s=0.0123, quorum_wait_s=0.001, collective_s=0.05, heal_s=None)
    counters = dict(steps_committed=step, commit_failures=0, heals=1, heal_bytes=1024, lost=0)
    counters.update(incarnations=1, reports=10, reports_dropped=0)
    replica = {
        "replica_id": replica_id,
        "incarnation": f"{replica_id}:6f1c0a2b",
        "state": state,
        "state_since_s": 12.5,
        "step": step,
        "hostname": "node-3",
        "pids": [4242, 4243],
        "ranks_reporting": 2,
        "world_size": 2,
        "last_heartbeat_age_s": 0.04,
        "last_report_age_s": 0.2,
        "in_quorum": state in ("healthy", "straggler", "healing"),
        "participants": 3,
        "last_commit": True,
        "last_error": None,
        "straggler": state == "straggler",
        "skew_pct": 3.1,
        "steps_per_s": 4.2,
        "timings": {**timings, "should_commit_s": 0.002},
        "counters": counters,
    }
    replica.update(fields)
    return replica


class MockLighthouse:
    """A thread-served stand-in for the lighthouse's HTTP side, driven by the test."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.replicas: dict[str, dict] = {}
        self.allow_kill = False
        self.quorum_id: int | None = 1732170000123456
        self.members: list[str] | None = None  # None: the healthy and straggler replicas
        self.hung: list[dict] = []
        self.dropped: list[dict] = []
        self.parity: dict = dict(checks=0, diverged_total=0, last_checked_step=None)
        self.parity.update(healing=[], stopped=[])
        self.snapshot: dict | None = None
        self.snapshot_failures = 0
        self.goodput: dict | None = None  # of /status; None: before the first committed step
        #: ``points`` of ``/history``; ``history_reply`` (code, content type, body) replaces it.
        self.history: list[dict] = []
        self.history_reply: tuple[int, str, str] | None = None
        self.fail_status = False
        ended = json.dumps({"ok": True, "message": "manager process ended"})
        self.kill_reply: tuple[int, str, str] = (200, "application/json", ended)
        self.started_unix_s = time.time() - 90.0
        self.status_events: list[dict] = []
        self.sse_events: list[dict] = []
        self.kill_posts: list[str] = []
        # With a token, a kill without `Authorization: Bearer <token>` gets 401; every
        # kill's Authorization header is recorded.
        self.kill_token: str | None = None
        #: ``rooms`` of ``/status`` (the lighthouse's open rooms; empty: before rooms).
        self.rooms: list[dict[str, Any]] = []
        self.kill_auth: list[str | None] = []
        self.requests: list[str] = []
        self.stopping = False
        self._seq = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----- test-side API -----

    def set_replicas(self, *replicas: dict) -> None:
        with self.cond:
            self.replicas = {r["replica_id"]: r for r in replicas}

    def update(self, replica_id: str, **fields: Any) -> None:
        with self.cond:
            self.replicas[replica_id].update(fields)

    def remove(self, replica_id: str) -> None:
        with self.cond:
            del self.replicas[replica_id]

    def event(self, kind: str, ts: float | None = None, **fields: Any) -> dict:
        """A new event with the next ``seq`` (not yet published anywhere)."""
        with self.cond:
            self._seq += 1
            return {
                "seq": self._seq,
                "ts": time.time() if ts is None else ts,
                "kind": kind,
                **fields,
            }

    def push_sse(self, *events: dict) -> None:
        """Publishes events on ``/events`` only (not in ``/status``)."""
        with self.cond:
            self.sse_events.extend(events)
            self.cond.notify_all()

    def status(self) -> dict:
        with self.cond:
            replicas = [copy.deepcopy(self.replicas[k]) for k in sorted(self.replicas)]
            live = [r["replica_id"] for r in replicas if r["state"] in ("healthy", "straggler")]
            members = live if self.members is None else list(self.members)
            by_id = {r["replica_id"]: r for r in replicas}
            addr = {"address": "http://node-3:29510", "store_address": "node-3:29500"}
            counters = dict(quorum_changes=3, reports=100, reports_rejected=0, events=self._seq)
            counters.update(snapshots=int(self.snapshot is not None))
            return {
                "quorum_id": self.quorum_id,
                "min_replicas": 2,
                "heartbeat_timeout_s": 5.0,
                "allow_kill": self.allow_kill,
                "ready": False,
                "reason": "waiting for 1 more participant",
                "started_unix_s": self.started_unix_s,
                "members": [
                    {"replica_id": f"{m}:6f1c0a2b", "step": by_id.get(m, {}).get("step", 0)}
                    | {**addr, "world_size": 2}
                    for m in members
                ],
                "heartbeats": [
                    {"replica_id": r["incarnation"], "age_s": r["last_heartbeat_age_s"]}
                    | {"healthy": r["state"] not in ("lost", "failed", "finished")}
                    for r in replicas
                ],
                "participants": [],
                "lost": [],
                "hung": copy.deepcopy(self.hung),
                "dropped": copy.deepcopy(self.dropped),
                "parity": copy.deepcopy(self.parity),
                "replicas": replicas,
                "stragglers": [r["replica_id"] for r in replicas if r["straggler"]],
                "counters": {**counters, "snapshot_failures": self.snapshot_failures},
                "snapshot": copy.deepcopy(self.snapshot),
                "goodput": copy.deepcopy(self.goodput),
                "events": copy.deepcopy(self.status_events[-100:]),
                "rooms": copy.deepcopy(self.rooms),
            }

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    # ----- server -----

    def start(self) -> None:
        mock = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, code: int, ctype: str, body: str | bytes) -> None:
                data = body.encode() if isinstance(body, str) else body
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                with mock.cond:
                    mock.requests.append(f"GET {self.path}")
                path = self.path.split("?", 1)[0]
                if path == "/":
                    self._send(200, "text/html; charset=utf-8", PAGE.read_bytes())
                elif path == "/dashboard.js":
                    self._send(200, "text/javascript; charset=utf-8", SCRIPT.read_bytes())
                elif path == "/status":
                    if mock.fail_status:
                        self._send(500, "text/plain", "boom")
                    else:
                        self._send(200, "application/json", json.dumps(mock.status()))
                elif path == "/history":
                    with mock.cond:
                        reply = mock.history_reply
                        points = copy.deepcopy(mock.history)
                    if reply is None:
                        body = json.dumps({"interval_s": 1.0, "points": points})
                        reply = (200, "application/json", body)
                    self._send(*reply)
                elif path == "/events":
                    self._events()
                else:
                    self._send(404, "text/plain", "not found\n")

            def do_POST(self) -> None:
                with mock.cond:
                    mock.requests.append(f"POST {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if self.path.startswith("/replicas/") and self.path.split("?", 1)[0].endswith(
                    "/kill"
                ):
                    auth = self.headers.get("Authorization")
                    with mock.cond:
                        mock.kill_posts.append(self.path)
                        mock.kill_auth.append(auth)
                        code, ctype, body = mock.kill_reply
                        token = mock.kill_token
                    if token is not None and auth != f"Bearer {token}":
                        code, ctype, body = 401, "text/plain", "missing token\n"
                    self._send(code, ctype, body)
                else:
                    self._send(404, "text/plain", "not found\n")

            def _events(self) -> None:
                last = self.headers.get("Last-Event-ID", "")
                after = int(last) if last.isdigit() else 0
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                try:
                    self.wfile.write(b"retry: 500\n\n")
                    self.wfile.flush()
                    quiet_since = time.monotonic()
                    while True:
                        with mock.cond:
                            pending = [e for e in mock.sse_events if e["seq"] > after]
                            if not pending and not mock.stopping:
                                mock.cond.wait(0.2)
                                pending = [e for e in mock.sse_events if e["seq"] > after]
                            if mock.stopping:
                                return
                        for e in pending:
                            msg = f"id: {e['seq']}\ndata: {json.dumps(e)}\n\n"
                            self.wfile.write(msg.encode())
                            after = e["seq"]
                        if pending:
                            quiet_since = time.monotonic()
                        elif time.monotonic() - quiet_since > 5:
                            self.wfile.write(b": keep-alive\n\n")
                            quiet_since = time.monotonic()
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="mock-lighthouse", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)


# ----- fixtures and helpers -----


@pytest.fixture
def mock() -> Iterator[MockLighthouse]:
    server = MockLighthouse()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
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


ROWS_JS = """
return Array.from(document.querySelectorAll('#replicas tr.replica')).map((tr) => {
  const cell = (cls) => { const td = tr.querySelector('td.' + cls); return td ? td.textContent : null; };
  const kill = tr.querySelector('button.kill');
  return {
    id: tr.getAttribute('data-replica-id'),
    state: tr.getAttribute('data-state'),
    classes: tr.className.split(/\\s+/),
    cells: {
      id: cell('replica-id'), state: cell('state'), step: cell('step'), hb: cell('hb-age'),
      rate: cell('rate'), busy: cell('busy'), step_time: cell('step-time'), skew: cell('skew'),
      parts: cell('participants'), heals: cell('heals'), error: cell('last-error'),
      verdict: cell('verdict'), goodput: cell('goodput'),
    },
    verdict_title: tr.querySelector('td.verdict').getAttribute('title'),
    error_title: tr.querySelector('td.last-error').getAttribute('title'),
    kill: kill ? {hidden: kill.hidden || kill.offsetParent === null, disabled: kill.disabled,
                  title: kill.getAttribute('title')} : null,
  };
});
"""

EVENTS_JS = """
return Array.from(document.querySelectorAll('#events .event')).map((li) => ({
  seq: li.getAttribute('data-seq'),
  time: li.querySelector('.ev-time').textContent,
  kind: li.querySelector('.ev-kind').textContent,
  replica: li.querySelector('.ev-replica') ? li.querySelector('.ev-replica').textContent : null,
  text: li.textContent,
}));
"""


def rows(driver: Any) -> list[dict]:
    return driver.execute_script(ROWS_JS)


def row_map(driver: Any) -> dict[str, dict]:
    return {r["id"]: r for r in rows(driver)}


def events(driver: Any) -> list[dict]:
    return driver.execute_script(EVENTS_JS)


def text_of(driver: Any, element_id: str) -> str:
    return driver.execute_script(
        "return document.getElementById(arguments[0]).textContent;", element_id
    )


def open_page(driver: Any, mock: MockLighthouse, rows_expected: int | None = None) -> None:
    """Loads the dashboard and waits for its first successful poll."""
    driver.get(mock.url)
    wait_until(lambda: text_of(driver, "updated") == "live", what="the first /status poll")
    if rows_expected is not None:
        wait_until(lambda: len(rows(driver)) == rows_expected, what=f"{rows_expected} rows")


CHARTS = ("rate-chart", "parts-chart", "goodput-chart")
CHARTS_JS = """
return arguments[0].map((id) => {
  const c = document.getElementById(id);
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
  return [Number(c.getAttribute('data-points') || 0), n]; });
"""


def charts(driver: Any) -> dict[str, list[int]]:
    """Per chart: the points it drew (``data-points``) and its painted pixels."""
    return dict(zip(CHARTS, driver.execute_script(CHARTS_JS, list(CHARTS)), strict=True))


def drawn_points(driver: Any) -> dict[str, int]:
    return {k: v[0] for k, v in charts(driver).items()}


def assert_no_console_errors(driver: Any) -> None:
    errors = console_errors(driver)
    assert errors == [], f"console errors: {errors}"


# ----- tests -----


@pytest.mark.timeout(60)
def test_rows_show_states_and_steps(mock: MockLighthouse, driver: Any) -> None:
    """One row per replica, sorted by replica_id, with state badge, step and the other columns."""
    states = ["joining", "healing", "healthy", "straggler", "lost", "failed", "finished"]
    long_error = "RuntimeError: NCCL timeout " + "x" * 200
    replicas = [
        make_replica(f"train_{i}", state=s, step=100 + i) for i, s in enumerate(reversed(states))
    ]
    replicas[0].update(last_heartbeat_age_s=None, last_error=long_error, skew_pct=-2.25)
    mock.set_replicas(*replicas)
    mock.allow_kill = True  # widest table: with the Kill column
    open_page(driver, mock, rows_expected=len(states))

    got = rows(driver)
    assert [r["id"] for r in got] == sorted(r["replica_id"] for r in replicas)
    for want, r in zip(sorted(replicas, key=lambda r: r["replica_id"]), got, strict=True):
        assert r["state"] == want["state"]
        assert r["cells"]["id"] == want["replica_id"]
        assert r["cells"]["state"] == want["state"]
        assert r["cells"]["step"] == str(want["step"])
        assert "replica" in r["classes"]

    first = got[0]
    assert first["cells"]["hb"] == DASH
    assert first["cells"]["error"].endswith("\u2026") and len(first["cells"]["error"]) <= 60
    assert first["error_title"] == long_error
    assert first["cells"]["skew"] == "-2.3%" or first["cells"]["skew"] == "-2.2%"
    other = got[1]
    assert other["cells"]["hb"] == "0.0"
    assert other["cells"]["busy"] == "12.3"  # busy_s 0.0123 -> ms
    assert other["cells"]["step_time"] == "250"  # step_s 0.25 -> ms
    assert other["cells"]["skew"] == "+3.1%"
    assert other["cells"]["rate"] == "4.20"
    assert other["cells"]["parts"] == "3"
    assert other["cells"]["heals"] == "1 / 0"
    assert other["cells"]["error"] == "" and other["error_title"] is None

    assert text_of(driver, "replica-count") == "7"
    assert text_of(driver, "quorum-id") == str(mock.quorum_id)
    assert text_of(driver, "min-replicas") == "2"
    assert text_of(driver, "ready") == "not ready"
    assert "waiting for 1 more participant" in text_of(driver, "reason")
    assert driver.find_element("id", "conn").is_displayed() is False
    # fits a 1280x800 window without horizontal scrolling
    overflow = driver.execute_script(
        "const w = document.querySelector('.table-wrap');"
        "return [w.scrollWidth, w.clientWidth, document.documentElement.scrollWidth, window.innerWidth];"
    )
    assert overflow[0] <= overflow[1] and overflow[2] <= overflow[3], overflow
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_step_updates_in_place(mock: MockLighthouse, driver: Any) -> None:
    """A new step shows in the same row's step cell without reloading or rebuilding the row."""
    mock.set_replicas(make_replica("a", step=10), make_replica("b", step=7))
    open_page(driver, mock, rows_expected=2)
    driver.execute_script("window.__not_reloaded = true;")
    cell = driver.find_element("css selector", 'tr.replica[data-replica-id="a"] td.step')
    other = driver.find_element("css selector", 'tr.replica[data-replica-id="b"] td.step')
    assert cell.text == "10"

    mock.update("a", step=11)
    wait_until(lambda: cell.text == "11", what="step 11 in the same cell")  # stale if rebuilt
    mock.update("a", step=12, state="healing")
    wait_until(lambda: cell.text == "12", what="step 12 in the same cell")
    wait_until(lambda: row_map(driver)["a"]["state"] == "healing", what="state healing")
    assert other.text == "7"
    assert driver.execute_script("return window.__not_reloaded === true;")
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_row_removed_when_replica_leaves(mock: MockLighthouse, driver: Any) -> None:
    mock.set_replicas(
        make_replica("a", step=1), make_replica("b", step=1), make_replica("c", step=1)
    )
    open_page(driver, mock, rows_expected=3)
    mock.remove("b")
    wait_until(lambda: [r["id"] for r in rows(driver)] == ["a", "c"], what="row b to go")
    mock.set_replicas(
        make_replica("a", step=2), make_replica("c", step=2), make_replica("0", step=0)
    )
    wait_until(lambda: [r["id"] for r in rows(driver)] == ["0", "a", "c"], what="row 0 first")
    mock.set_replicas()
    wait_until(lambda: rows(driver) == [], what="no rows")
    assert driver.find_element("id", "no-replicas").is_displayed()
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_malicious_replica_id_is_text(mock: MockLighthouse, driver: Any) -> None:
    """Markup in server data (replica id, error, events) is shown as text, never parsed or run."""
    evil_error = "<script>window.__pwned = 1</script><b>bold</b>"
    mock.set_replicas(
        make_replica(
            EVIL_ID, step=5, last_error=evil_error, hostname="<img src=y onerror=alert(2)>"
        ),
        make_replica("ok", step=5),
    )
    mock.status_events.append(mock.event("replica_joined", replica_id=EVIL_ID, hostname=EVIL_ID))
    mock.push_sse(
        mock.event("replica_failed", replica_id=EVIL_ID, error="<svg onload=alert(3)>"),
        mock.event("<img src=z onerror=alert(4)>", replica_id="ok"),
    )
    open_page(driver, mock, rows_expected=2)
    wait_until(lambda: len(events(driver)) == 3, what="3 events")
    time.sleep(1.5)  # a few more polls to give any injected markup a chance to run

    by_id = row_map(driver)
    assert EVIL_ID in by_id
    evil = by_id[EVIL_ID]
    assert evil["cells"]["id"] == EVIL_ID
    assert evil["error_title"] == evil_error
    got = events(driver)
    assert [e["replica"] for e in got] == ["ok", EVIL_ID, EVIL_ID]
    assert got[0]["kind"] == "<img src=z onerror=alert(4)>"
    assert "<svg onload=alert(3)>" in got[1]["text"]

    injected = driver.execute_script(
        "return {img: document.querySelectorAll('img, svg, #replicas b, #events b').length,"
        " scripts: document.querySelectorAll('script').length, pwned: window.__pwned === 1};"
    )
    assert injected == {"img": 0, "scripts": 1, "pwned": False}
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018 - raises when no alert is open
    with mock.cond:
        fetched = [
            r
            for r in mock.requests
            if r.split(" ", 1)[1] not in ("/", "/dashboard.js", "/status", "/history", "/events")
        ]
    assert fetched == []  # the <img src=x> was never loaded
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_straggler_rows_highlighted(mock: MockLighthouse, driver: Any) -> None:
    mock.set_replicas(
        make_replica("a", step=3),
        make_replica("b", state="straggler", step=3, skew_pct=80.0),
        make_replica("c", state="healthy", step=3, straggler=True),
    )
    open_page(driver, mock, rows_expected=3)
    classes = {r["id"]: "straggler" in r["classes"] for r in rows(driver)}
    assert classes == {"a": False, "b": True, "c": True}

    mock.update("b", state="healthy", straggler=False)
    mock.update("a", state="straggler", straggler=True)
    wait_until(
        lambda: (
            {r["id"]: "straggler" in r["classes"] for r in rows(driver)}
            == {"a": True, "b": False, "c": True}
        ),
        what="straggler classes to follow the status",
    )
    # The named cause is the straggler's verdict, its phases in the tooltip.
    timings = {"input_s": 0.21, "forward_s": 0.003, "backward_s": 0.004, "host_load": 0.4}
    mock.update("a", straggler_cause="input-bound", timings=timings)
    wait_until(
        lambda: row_map(driver)["a"]["cells"]["verdict"] == "input-bound",
        what="the straggler's cause in the verdict column",
    )
    title = row_map(driver)["a"]["verdict_title"]
    assert "input 210 ms" in title and "host load 0.40" in title, title
    assert row_map(driver)["c"]["cells"]["verdict"] == ""
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_verdicts_name_hung_diverged_and_stopped_groups(mock: MockLighthouse, driver: Any) -> None:
    """The verdict column shows the lighthouse's verdict on each group's process (hung,
    diverged / stopped by the parity check, dropped as a lasting straggler), with the reason
    in its title, and clears."""
    mock.set_replicas(
        make_replica("a", step=3), make_replica("b", step=3), make_replica("c", step=3)
    )
    with mock.cond:
        mock.hung = [
            {"replica_id": "a:6f1c0a2b", "idle_s": 12.5, "hung_for_s": 1.0, "hang_timeout_s": 10}
        ]
        mock.parity["healing"] = ["b:6f1c0a2b"]
        mock.parity["stopped"] = ["c:0000"]  # an earlier process of c: not this row's
    open_page(driver, mock, rows_expected=3)
    wait_until(
        lambda: (
            {r["id"]: r["cells"]["verdict"] for r in rows(driver)}
            == {"a": "hung", "b": "diverged", "c": ""}
        ),
        what="verdicts of a and b",
    )
    got = row_map(driver)
    assert "12.5" in got["a"]["verdict_title"] and "10.0" in got["a"]["verdict_title"]
    assert "majority" in got["b"]["verdict_title"]
    with mock.cond:
        mock.hung = []
        mock.parity["healing"] = []
        mock.parity["stopped"] = ["c:6f1c0a2b"]
        mock.dropped = [
            {"replica_id": "b:6f1c0a2b", "reason": "a straggler for 30.0s", "remaining_s": 12.0}
        ]
    wait_until(
        lambda: (
            {r["id"]: r["cells"]["verdict"] for r in rows(driver)}
            == {"a": "", "b": "dropped", "c": "stopped"}
        ),
        what="verdicts to follow the status",
    )
    assert "straggler for 30.0s" in row_map(driver)["b"]["verdict_title"]
    assert row_map(driver)["a"]["verdict_title"] is None
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_latest_snapshot_and_failures_in_the_header(mock: MockLighthouse, driver: Any) -> None:
    """The header shows the latest complete snapshot (step, age, writer, size; path in the
    title) or none, and the failed attempts, with server text inserted as text."""
    mock.set_replicas(make_replica("a", step=3))
    open_page(driver, mock, rows_expected=1)
    assert text_of(driver, "snapshot-step") == "none"
    assert text_of(driver, "snapshot-failures") == ""
    with mock.cond:
        mock.snapshot = {
            "step": 1500,
            "replica_id": EVIL_ID,
            "incarnation": f"{EVIL_ID}:6f1c0a2b",
            "path": "/shared/snapshots/step_1500",
            "bytes": 3 * 1024**3,
            "stage_s": 0.21,
            "write_s": 14.5,
            "quorum_id": 7,
            "unix_s": time.time() - 125,
            "age_s": 125.0,
        }
        mock.snapshot_failures = 2
    wait_until(lambda: text_of(driver, "snapshot-step") == "1500", what="the snapshot step")
    detail = text_of(driver, "snapshot-detail")
    assert detail == f"2m 05s ago · {EVIL_ID} · 3.00 GiB", detail
    title = driver.execute_script(
        "return document.getElementById('snapshot-field').getAttribute('title');"
    )
    assert "/shared/snapshots/step_1500" in title and "14.5 s" in title, title
    assert text_of(driver, "snapshot-failures") == "· 2 failed"
    assert (
        driver.execute_script("return document.getElementById('snapshot-failures').className;")
        == "bad"
    )
    assert driver.execute_script("return document.querySelectorAll('header img').length;") == 0
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_room_picker_appears_with_a_second_room_and_switches_the_page(
    mock: MockLighthouse, driver: Any
) -> None:
    """One room: no picker. A second room open: the picker lists them; picking one reloads the
    page on ?job=NAME, whose polls, event stream and kill action name the room."""
    mock.set_replicas(make_replica("a", step=1))
    mock.allow_kill = True
    mock.rooms = [{"job": ""}]
    open_page(driver, mock, rows_expected=1)
    assert not driver.find_element("id", "room-field").is_displayed()
    mock.rooms = [{"job": ""}, {"job": "team-b"}]
    wait_until(lambda: driver.find_element("id", "room-field").is_displayed(), what="the picker")
    options = driver.execute_script(
        "return Array.from(document.getElementById('room').options).map(o => o.textContent);"
    )
    assert options == ["(default)", "team-b"]
    driver.execute_script(
        "const s = document.getElementById('room'); s.value = 'team-b';"
        "s.dispatchEvent(new Event('change'));"
    )
    wait_until(lambda: driver.current_url.endswith("/?job=team-b"), what="the room's page")
    wait_until(lambda: "GET /status?job=team-b" in mock.requests, what="the room's /status")
    wait_until(lambda: "GET /events?job=team-b" in mock.requests, what="the room's events")
    assert driver.execute_script("return document.getElementById('room').value;") == "team-b"
    wait_until(lambda: rows(driver) and not rows(driver)[0]["kill"]["hidden"], what="kill")
    driver.execute_script("window.confirm = () => true;")
    driver.find_element("css selector", 'tr.replica[data-replica-id="a"] button.kill').click()
    wait_until(lambda: mock.kill_posts, what="the kill POST")
    assert mock.kill_posts == ["/replicas/a/kill?job=team-b"]
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_kill_button_hidden_without_allow_kill(mock: MockLighthouse, driver: Any) -> None:
    mock.set_replicas(make_replica("a", step=1))
    open_page(driver, mock, rows_expected=1)
    kill = rows(driver)[0]["kill"]
    assert kill["hidden"] or kill["disabled"]
    if not kill["hidden"]:
        assert kill["title"] == "start the lighthouse with --allow_kill"
    assert driver.find_element("id", "kill-hint").is_displayed()
    assert mock.kill_posts == []
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_kill_button_posts(mock: MockLighthouse, driver: Any) -> None:
    """With allow_kill, Kill asks for confirmation and POSTs to replicas/<encoded id>/kill."""
    mock.set_replicas(make_replica("a", step=1), make_replica("group 1/b?", step=1))
    open_page(driver, mock, rows_expected=2)
    mock.allow_kill = True
    wait_until(lambda: not any(r["kill"]["hidden"] for r in rows(driver)), what="kill buttons")
    assert not driver.find_element("id", "kill-hint").is_displayed()

    # declined confirmation: nothing is sent
    driver.execute_script("window.confirm = () => false;")
    driver.find_element("css selector", 'tr.replica[data-replica-id="a"] button.kill').click()
    time.sleep(0.5)
    assert mock.kill_posts == []

    driver.execute_script("window.confirm = () => true;")
    button = driver.find_element(
        "css selector", 'tr.replica[data-replica-id="group 1/b?"] button.kill'
    )
    assert button.is_displayed() and button.is_enabled()
    button.click()
    wait_until(lambda: mock.kill_posts, what="the kill POST")
    assert mock.kill_posts == ["/replicas/group%201%2Fb%3F/kill"]
    wait_until(
        lambda: "manager process ended" in text_of(driver, "action-status"),
        what="the server's message in #action-status",
    )
    assert "group 1/b?" in text_of(driver, "action-status")
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_kill_asks_for_the_token_and_sends_it_as_bearer(mock: MockLighthouse, driver: Any) -> None:
    """A lighthouse with a token answers the kill with 401: the page asks for the token and
    resends the kill with ``Authorization: Bearer`` (never Basic, which the server accepts
    for reading only); the next kill reuses it without asking."""
    mock.allow_kill = True
    mock.kill_token = "s3cret"
    mock.set_replicas(make_replica("a", step=1), make_replica("b", step=1))
    open_page(driver, mock, rows_expected=2)
    driver.execute_script(
        "window.confirm = () => true; window.asked = 0;"
        "window.prompt = () => { window.asked += 1; return 's3cret'; };"
    )
    driver.find_element("css selector", 'tr.replica[data-replica-id="a"] button.kill').click()
    wait_until(lambda: "ok" in text_of(driver, "action-status"), what="the kill accepted")
    assert mock.kill_auth == [None, "Bearer s3cret"]
    driver.find_element("css selector", 'tr.replica[data-replica-id="b"] button.kill').click()
    wait_until(lambda: len(mock.kill_auth) == 3, what="the second kill")
    assert mock.kill_auth[2] == "Bearer s3cret"
    assert driver.execute_script("return window.asked") == 1
    # The browser logs the first answer (401) as a failed resource; nothing else.
    errors = [e for e in console_errors(driver) if "status of 401" not in e["message"]]
    assert errors == [], errors


@pytest.mark.timeout(60)
def test_kill_error_body_shown(mock: MockLighthouse, driver: Any) -> None:
    """A refused kill shows the status code and the server's body."""
    mock.allow_kill = True
    mock.kill_reply = (403, "text/plain", "kill is disabled: start with --allow_kill")
    mock.set_replicas(make_replica("a", step=1))
    open_page(driver, mock, rows_expected=1)
    driver.execute_script("window.confirm = () => true;")
    driver.find_element("css selector", "tr.replica button.kill").click()
    status = wait_until(
        lambda: (t := text_of(driver, "action-status")) and "403" in t and t,
        what="the error in #action-status",
    )
    assert "kill is disabled: start with --allow_kill" in status
    assert mock.kill_posts == ["/replicas/a/kill"]


@pytest.mark.timeout(60)
def test_events_from_status_and_sse(mock: MockLighthouse, driver: Any) -> None:
    """Buffered events show on load, streamed ones are prepended, duplicates (by seq) dropped."""
    ts = time.time() - 30
    e1 = mock.event("lighthouse_started", ts=ts, min_replicas=2, pid=99)
    e2 = mock.event("replica_joined", ts=ts + 1, replica_id="a", incarnation="a:1", hostname="h1")
    mock.status_events.extend([e1, e2])
    e3 = mock.event(
        "state_changed",
        replica_id="a",
        **{"from": "joining", "to": "healthy"},
        step=4,
        reason="committed",
    )
    mock.push_sse(e2, e3)  # e2 again: must not show twice
    mock.set_replicas(make_replica("a", step=4))
    open_page(driver, mock, rows_expected=1)
    wait_until(lambda: [e["seq"] for e in events(driver)] == ["3", "2", "1"], what="events 3, 2, 1")

    got = events(driver)
    assert got[2]["kind"] == "lighthouse_started" and got[2]["replica"] is None
    assert got[2]["time"] == time.strftime("%H:%M:%S", time.localtime(ts))
    assert got[1]["kind"] == "replica_joined" and got[1]["replica"] == "a"
    assert "hostname=h1" in got[1]["text"]
    assert got[0]["kind"] == "state_changed" and "joining \u2192 healthy" in got[0]["text"]
    assert "reason=committed" in got[0]["text"]

    # pushed later, over the open stream only
    e4 = mock.event(
        "straggler_flagged", replica_id="a", skew_pct=75.5, busy_s=0.3, median_busy_s=0.17
    )
    mock.push_sse(e4)
    wait_until(lambda: events(driver) and events(driver)[0]["seq"] == "4", what="event 4 first")
    assert events(driver)[0]["kind"] == "straggler_flagged"
    assert "skew_pct=75.5" in events(driver)[0]["text"]
    assert len(events(driver)) == 4
    assert_no_console_errors(driver)


@pytest.mark.timeout(90)
def test_events_capped_at_200(mock: MockLighthouse, driver: Any) -> None:
    mock.set_replicas(make_replica("a", step=1))
    open_page(driver, mock, rows_expected=1)
    mock.push_sse(
        *[mock.event("commit_failed", replica_id="a", step=i, error=None) for i in range(250)]
    )
    wait_until(lambda: events(driver) and events(driver)[0]["seq"] == "250", what="event 250")
    got = events(driver)
    assert len(got) == 200
    assert [int(e["seq"]) for e in got] == list(range(250, 50, -1))
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_connection_lost_indicator(mock: MockLighthouse, driver: Any) -> None:
    """A failing /status shows the indicator, keeps the last rows, and polling recovers."""
    mock.set_replicas(make_replica("a", step=1))
    open_page(driver, mock, rows_expected=1)
    conn = driver.find_element("id", "conn")
    assert not conn.is_displayed()
    mock.fail_status = True
    wait_until(conn.is_displayed, what="the connection-lost indicator")
    assert "connection lost" in conn.text
    assert [r["id"] for r in rows(driver)] == ["a"]
    mock.update("a", step=2)
    mock.fail_status = False
    wait_until(lambda: not conn.is_displayed(), what="the indicator to clear")
    wait_until(lambda: rows(driver)[0]["cells"]["step"] == "2", what="step 2 after recovery")


@pytest.mark.timeout(60)
def test_charts_show_rate_and_participants(mock: MockLighthouse, driver: Any) -> None:
    mock.set_replicas(*[make_replica(f"r{i}", step=0) for i in range(3)])
    open_page(driver, mock, rows_expected=3)
    wait_until(lambda: text_of(driver, "parts-now") == "3", what="3 participants")
    step = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        step += 2
        for i in range(3):
            mock.update(f"r{i}", step=step)
        time.sleep(0.2)

    def rate() -> float:
        text = text_of(driver, "rate-now")
        return float(text) if text != DASH else 0.0

    assert wait_until(lambda: rate() > 0, what="a positive step rate") > 0
    assert float(text_of(driver, "rate-max")) >= rate() - 1e-9
    mock.remove("r2")
    wait_until(lambda: text_of(driver, "parts-now") == "2", what="2 participants")
    assert text_of(driver, "parts-max") == "3"
    painted = [v[1] for v in charts(driver).values()]
    assert all(n > 100 for n in painted), painted
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
def test_no_console_errors(mock: MockLighthouse, driver: Any) -> None:
    """Loading, updating, streaming events and killing log nothing at SEVERE level."""
    mock.allow_kill = True
    mock.set_replicas(make_replica("a", step=1), make_replica("b", state="straggler", step=1))
    mock.status_events.append(mock.event("lighthouse_started", min_replicas=2, pid=1))
    open_page(driver, mock, rows_expected=2)
    mock.push_sse(
        mock.event("quorum_changed", quorum_id=2, previous_quorum_id=None, participants=["a", "b"])
    )
    mock.update("a", step=2, last_heartbeat_age_s=None)
    mock.remove("b")
    wait_until(lambda: len(rows(driver)) == 1 and len(events(driver)) == 2, what="updates")
    driver.execute_script("window.confirm = () => true;")
    driver.find_element("css selector", "tr.replica button.kill").click()
    wait_until(lambda: mock.kill_posts, what="the kill POST")
    driver.set_window_size(900, 700)  # redraw on resize
    time.sleep(1.5)
    assert_no_console_errors(driver)


def history_points(n: int, end: float) -> list[dict]:
    """``n`` points of ``/history``, a second apart up to ``end``: 2 steps/s, 3 members, the
    ratio 0.3 for the first 25 points, then 0.6."""
    keys = ("t", "step", "members", "ratio", "steps_committed", "productive_s", "wall_s")
    rows = [
        (end - n + 1 + i, 2 * i, 3, 0.3 if i < 25 else 0.6, 2 * i, None, None) for i in range(n)
    ]
    return [dict(zip(keys, row, strict=True)) for row in rows]


@pytest.mark.timeout(60)
def test_history_seeds_the_charts_and_goodput_shows(mock: MockLighthouse, driver: Any) -> None:
    """A page opened late draws the job's history at once (step rate, participants, goodput),
    then live points follow; the header and each row show goodput, the accounts in titles;
    a lighthouse restart loads the history again."""
    mock.set_replicas(
        make_replica("a", step=240, goodput_ratio=0.9, goodput=make_goodput(0.9)),
        make_replica("b", step=240, goodput_ratio=None, goodput=None),
    )
    mock.goodput = make_goodput(0.834)
    mock.history = history_points(150, time.time() - 1)
    started = time.monotonic()
    open_page(driver, mock, rows_expected=2)
    got = wait_until(
        lambda: (p := drawn_points(driver))["goodput-chart"] >= 119 and p,
        timeout=max(0.5, 2.5 - (time.monotonic() - started)),
        what="the history drawn",
    )
    assert got["rate-chart"] >= 118 and got["parts-chart"] >= 119, got
    assert max(got.values()) <= 120, got  # the cap keeps the latest points
    assert text_of(driver, "rate-max") == "2.00"
    assert text_of(driver, "parts-max") == "3"
    # the 30 oldest of 150 points (ratio 0.3 among them) are dropped; the live point is 83.4
    assert text_of(driver, "goodput-min") == "60.0"
    wait_until(lambda: text_of(driver, "goodput-now") == "83.4", what="the live goodput point")
    assert all(v[1] > 100 for v in charts(driver).values()), charts(driver)

    assert text_of(driver, "goodput") == "83.4%"
    title = driver.execute_script(
        "return document.getElementById('goodput-field').getAttribute('title');"
    )
    for want in ("wall: 400.0 s", "productive: 333.6 s", "heal: 7.3 s", "recovery: 20.0 s"):
        assert want in title, title
    assert [r["cells"]["goodput"] for r in rows(driver)] == ["90.0%", DASH]
    row_title = driver.execute_script("return document.querySelector('td.goodput').title;")
    assert "productive: 360.0 s" in row_title, row_title
    with mock.cond:
        assert mock.requests.count("GET /history") == 1

    mock.goodput = None
    wait_until(lambda: text_of(driver, "goodput") == DASH, what="no goodput")
    mock.history = history_points(5, time.time() - 1)
    mock.started_unix_s += 1000  # a restarted lighthouse: a new history
    wait_until(lambda: mock.requests.count("GET /history") == 2, what="the history loaded again")
    wait_until(
        lambda: drawn_points(driver)["parts-chart"] in range(5, 10),
        what="the new lighthouse's history only",
    )
    assert_no_console_errors(driver)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "reply",
    [
        (404, "text/plain", "not found\n"),
        (200, "application/json", "{not json"),
        (200, "application/json", '[{"t": 1}]'),
        (200, "application/json", '{"points": [null, 3, {"t": "x"}]}'),
    ],
)
def test_bad_history_keeps_live_charts(mock: MockLighthouse, driver: Any, reply: tuple) -> None:
    """A lighthouse without /history, or a malformed answer, leaves the page working: the
    charts fill from live points and the script logs nothing."""
    mock.history_reply = reply
    mock.goodput = make_goodput(0.75)
    mock.set_replicas(make_replica("a", step=1), make_replica("b", step=1))
    open_page(driver, mock, rows_expected=2)
    wait_until(lambda: "GET /history" in mock.requests, what="the history request")
    for step in range(2, 6):
        mock.update("a", step=step)
        time.sleep(0.5)
    wait_until(lambda: drawn_points(driver)["goodput-chart"] >= 3, what="live points in the charts")
    assert drawn_points(driver)["parts-chart"] >= 3
    assert text_of(driver, "goodput-now") == "75.0" and text_of(driver, "goodput") == "75.0%"
    assert text_of(driver, "parts-now") == "2"
    assert not driver.find_element("id", "conn").is_displayed()
    # The browser itself logs a 404 answer as a failed resource; the script logs nothing.
    errors = [e for e in console_errors(driver) if "status of 404" not in e["message"]]
    assert errors == [], errors
