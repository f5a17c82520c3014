"""OpenTelemetry export end to end: a real lighthouse, the bridge (``python -m torchft.otel``)
as a process, and an OTLP/HTTP collector in the test that decodes what it receives with the
OTLP protobuf classes.

Covers: every lighthouse event arrives once as a log record (kind, fields, timestamp,
severity) and the ``torchft_`` metrics with their labels; a dropped connection resumes with
``Last-Event-ID`` without losing or repeating an event; a restarted lighthouse is followed;
SIGTERM/SIGINT end the bridge with a last scrape; bad settings fail with a clear message and
exit code 2; and upstream's ``setup_logger`` with ``TORCHFT_USE_OTEL`` exports Python log
records.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import LighthouseProcess, start_lighthouse_process
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from torchft import otel
from torchft._torchft import LighthouseClient

REPO_PYTHON = str(Path(__file__).resolve().parent.parent / "python")
CERTS = Path(__file__).parent / "certs"
CONNECT = timedelta(seconds=10)
SEVERITY_INFO, SEVERITY_WARN, SEVERITY_ERROR = 9, 13, 17


# ----------------------------------------------------------------------------- collector


def _value(v: AnyValue) -> Any:
    """An OTLP AnyValue as plain Python."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attrs(v.kvlist_value.values)
    return getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        assert isinstance(kv, KeyValue)
        out[kv.key] = _value(kv.value)
    return out


class Collector:
    """An OTLP/HTTP receiver on 127.0.0.1:0: decodes ``POST /v1/logs`` and ``/v1/metrics``
    into plain records (``logs``, ``metrics``), answers 200."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path == "/v1/logs":
                    collector._logs(ExportLogsServiceRequest.FromString(body))
                    reply = ExportLogsServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    collector._metrics(ExportMetricsServiceRequest.FromString(body))
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _logs(self, req: ExportLogsServiceRequest) -> None:
        with self.lock:
            for rl in req.resource_logs:
                resource = _attrs(rl.resource.attributes)
                for sl in rl.scope_logs:
                    for r in sl.log_records:
                        self.logs.append(
                            {
                                "body": _value(r.body),
                                "severity_number": r.severity_number,
                                "severity_text": r.severity_text,
                                "time_unix_nano": r.time_unix_nano,
                                "event_name": r.event_name,
                                "attributes": _attrs(r.attributes),
                                "resource": resource,
                                "scope": sl.scope.name,
                            }
                        )

    def _metrics(self, req: ExportMetricsServiceRequest) -> None:
        with self.lock:
            for rm in req.resource_metrics:
                resource = _attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        data = getattr(m, kind)
                        for p in data.data_points:
                            self.metrics.append(
                                {
                                    "name": m.name,
                                    "kind": kind,
                                    "monotonic": kind == "sum" and data.is_monotonic,
                                    "attributes": _attrs(p.attributes),
                                    "value": getattr(p, p.WhichOneof("value")),
                                    "time_unix_nano": p.time_unix_nano,
                                    "start_time_unix_nano": p.start_time_unix_nano,
                                    "resource": resource,
                                }
                            )

    def events(self) -> list[dict[str, Any]]:
        """The log records the bridge sent (scope ``torchft.lighthouse``)."""
        with self.lock:
            return [r for r in self.logs if r["scope"] == "torchft.lighthouse"]

    def latest(self, name: str, **labels: str) -> dict[str, Any] | None:
        """The newest point of metric ``name`` with exactly these labels."""
        with self.lock:
            found = [m for m in self.metrics if m["name"] == name and m["attributes"] == labels]
        return found[-1] if found else None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    """A running collector; closed after the test."""
    c = Collector()
    try:
        yield c
    finally:
        c.close()


# ----------------------------------------------------------------------------- processes


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without OpenTelemetry or torchft export settings, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCHFT_", "RUST_LOG"))
    }
    env["PYTHONPATH"] = REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Procs:
    """Processes a test starts (bridges, lighthouses); every one is killed at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bridges: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.lighthouses: list[LighthouseProcess] = []

    def lighthouse(self, *flags: str) -> LighthouseProcess:
        """A lighthouse daemon (min_replicas 1, quick rounds, 500 ms heartbeat timeout)."""
        base = ["--min_replicas", "1", "--quorum_tick_ms", "10", "--join_timeout_ms", "100"]
        base += ["--heartbeat_timeout_ms", "500", "--progress_wait_ms", "0"]
        p = start_lighthouse_process(*base, *flags)
        self.lighthouses.append(p)
        return p

    def bridge(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``python -m torchft.otel ARGS``, its output in a log file."""
        log = self.tmp / f"bridge{len(self.bridges)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torchft.otel", *args],
                env=env if env is not None else clean_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.bridges.append((proc, log))
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return next(log for p, log in self.bridges if p is proc).read_text(errors="replace")

    def close(self) -> None:
        for proc, _ in self.bridges:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for lh in self.lighthouses:
            lh.stop()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def wait_until(cond: Callable[[], object], timeout: float, what: str, log: str = "") -> None:
    """Polls ``cond()`` until it is true; fails naming ``what`` (and showing ``log``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}\n{log}", pytrace=False)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a lighthouse event log."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line]


def join(address: str, replica_id: str, step: int = 0) -> None:
    """``replica_id`` asks for a quorum (and gets one: min_replicas is 1)."""
    client = LighthouseClient(address, connect_timeout=CONNECT)
    client.quorum(replica_id=replica_id, timeout=timedelta(seconds=30), step=step)


def assert_exported_once(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """Each event is exactly one record, in order: kind, fields, timestamp and severity."""
    assert [r["body"] for r in records] == [e["kind"] for e in events]
    for r, e in zip(records, events, strict=True):
        a = r["attributes"]
        assert a["seq"] == e["seq"], (r, e)
        assert a.get("replica_id") == e.get("replica_id"), (r, e)
        assert abs(r["time_unix_nano"] - e["ts"] * 1e9) < 1000, (r, e)
        assert r["time_unix_nano"] == round(e["ts"] * 1e6) * 1000
        warn = e["kind"] in otel.WARN_KINDS
        assert r["severity_number"] == (SEVERITY_WARN if warn else SEVERITY_INFO), (r, e)
        assert r["severity_text"] == ("WARN" if warn else "INFO")
        assert r["event_name"] == f"torchft.{e['kind']}"
        if e["kind"] == "quorum_changed":
            assert a["participants"] == e["participants"]
            assert a["quorum_id"] == e["quorum_id"]
            assert (
                "previous_quorum_id" not in a or a["previous_quorum_id"] == e["previous_quorum_id"]
            )


# ----------------------------------------------------------------------------- the bridge


@pytest.mark.timeout(120)
def test_events_become_log_records_and_metrics_keep_their_labels(
    procs: Procs, collector: Collector, tmp_path: Path
) -> None:
    """Every event of the lighthouse (those before the bridge started included) is one log
    record with its kind, fields, timestamp and severity; the gauges and counters arrive with
    their labels."""
    log = tmp_path / "events.jsonl"
    lh = procs.lighthouse("--event_log", str(log))
    join(lh.address, "g0", step=3)  # buffered before the bridge starts: exported too
    bridge = procs.bridge(
        "--lighthouse",
        lh.address,
        "--endpoint",
        collector.url,
        "--interval",
        "0.3",
        "--service-name",
        "torchft-test",
    )
    # g0 stops heartbeating: replica_lost (WARN) after the 500 ms heartbeat timeout.
    wait_until(
        lambda: any(r["body"] == "replica_lost" for r in collector.events()),
        60,
        "replica_lost exported",
        procs.log(bridge),
    )
    join(lh.address, "g1")
    wait_until(
        lambda: (
            len(collector.events()) == len(read_events(log))
            and any(r["attributes"].get("replica_id") == "g1" for r in collector.events())
        ),
        30,
        "g1's events exported",
        procs.log(bridge),
    )
    time.sleep(1.0)  # nothing more arrives: no duplicates come late
    events = read_events(log)
    records = collector.events()
    assert_exported_once(records, events)
    kinds = {(e["kind"], e.get("replica_id")) for e in events}
    assert {("lighthouse_started", None), ("replica_joined", "g0"), ("replica_lost", "g0")} <= kinds
    assert ("replica_joined", "g1") in kinds
    assert records[0]["resource"]["service.name"] == "torchft-test"
    assert records[0]["resource"]["torchft.lighthouse"] == lh.address

    def lost_state() -> dict[str, Any] | None:
        return collector.latest("torchft_replica_state", replica_id="g0", state="lost")

    wait_until(lambda: (m := lost_state()) and m["value"] == 1.0, 30, "g0 lost in the metrics")
    state = lost_state()
    assert state is not None and state["kind"] == "gauge"
    assert state["resource"]["service.name"] == "torchft-test"
    changes = collector.latest("torchft_quorum_changes_total")
    assert changes is not None and changes["kind"] == "sum" and changes["monotonic"]
    assert changes["value"] >= 2 and changes["start_time_unix_nano"] <= changes["time_unix_nano"]
    participants = collector.latest("torchft_quorum_participants")
    assert participants is not None and participants["value"] == 1.0
    with collector.lock:
        names = {m["name"] for m in collector.metrics}
    assert names and all(n.startswith("torchft_") for n in names), names
    assert bridge.poll() is None, procs.log(bridge)


class Proxy:
    """A TCP proxy on 127.0.0.1:0 in front of the lighthouse that can drop every connection
    (and refuse new ones) while ``down``; it records the request heads it forwards."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit("//", 1)[1].rsplit(":", 1)
        self.target = (host.strip("[]"), int(port))
        self.down = False
        self.heads: list[str] = []
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, request: bool) -> None:
        first = True
        try:
            while data := src.recv(65536):
                if request and first:
                    with self.lock:
                        self.heads.append(data.decode("latin-1"))
                    first = False
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Drops every open connection and refuses new ones until :meth:`resume`."""
        self.down = True
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def resume(self) -> None:
        self.down = False

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.mark.timeout(120)
def test_dropped_connection_resumes_after_the_last_event_without_loss_or_repeats(
    procs: Procs, collector: Collector, tmp_path: Path
) -> None:
    """The stream drops (a proxy cuts it), events happen meanwhile: on reconnect the bridge
    sends ``Last-Event-ID`` of the last event it exported and exports each missed event once."""
    log = tmp_path / "events.jsonl"
    lh = procs.lighthouse("--event_log", str(log))
    proxy = Proxy(lh.address)
    try:
        bridge = procs.bridge(
            "--lighthouse", proxy.url, "--endpoint", collector.url, "--interval", "0.2"
        )
        join(lh.address, "g0", step=1)
        wait_until(
            lambda: any(r["body"] == "replica_joined" for r in collector.events()),
            60,
            "g0's join exported",
            procs.log(bridge),
        )
        before = len(collector.events())
        last_seq = collector.events()[-1]["attributes"]["seq"]
        proxy.cut()
        join(lh.address, "g1")  # while the bridge is cut off
        wait_until(
            lambda: "unavailable" in procs.log(bridge), 30, "the retry line", procs.log(bridge)
        )
        proxy.resume()
        wait_until(
            lambda: (
                len(collector.events()) == len(read_events(log))
                and any(r["attributes"].get("replica_id") == "g1" for r in collector.events())
            ),
            60,
            "the missed events exported",
            procs.log(bridge),
        )
        time.sleep(1.0)
        assert_exported_once(collector.events(), read_events(log))
        assert len(collector.events()) > before
        with proxy.lock:
            resumed = [h for h in proxy.heads if h.startswith("GET /events")]
        assert len(resumed) >= 2, resumed
        assert f"Last-Event-ID: {last_seq}\r\n" in resumed[-1], resumed[-1]
        assert "retrying in" in procs.log(bridge)
    finally:
        proxy.close()


@pytest.mark.timeout(150)
def test_restarted_lighthouse_is_followed_from_its_first_event(
    procs: Procs, collector: Collector, tmp_path: Path
) -> None:
    """A lighthouse killed and restarted on the same address starts its event ids over: the
    bridge backs off while it is away (with a log line), then exports the new one's events
    from its first, and each event of both lives once."""
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    lh = procs.lighthouse("--event_log", str(first_log))
    bridge = procs.bridge(
        "--lighthouse", lh.address, "--endpoint", collector.url, "--interval", "0.2"
    )
    join(lh.address, "g0", step=5)
    join(lh.address, "g0", step=6)
    wait_until(
        lambda: len(collector.events()) == len(read_events(first_log)) >= 3,
        60,
        "the first lighthouse's events",
        procs.log(bridge),
    )
    lh.proc.send_signal(signal.SIGKILL)
    lh.proc.wait(timeout=10)
    wait_until(lambda: "unavailable" in procs.log(bridge), 30, "the retry line", procs.log(bridge))
    bind = lh.address.split("//", 1)[1]
    second = procs.lighthouse("--event_log", str(second_log), "--bind", bind)
    join(second.address, "g1")

    def everything() -> list[dict[str, Any]]:
        return read_events(first_log) + read_events(second_log)

    wait_until(
        lambda: (
            len(collector.events()) == len(everything())
            and any(r["attributes"].get("replica_id") == "g1" for r in collector.events())
        ),
        60,
        "the restarted lighthouse's events",
        procs.log(bridge),
    )
    time.sleep(1.0)
    assert_exported_once(collector.events(), everything())
    assert [e["kind"] for e in read_events(second_log)][0] == "lighthouse_started"
    assert "restarted" in procs.log(bridge)


@pytest.mark.timeout(90)
def test_a_room_is_followed_from_now_with_no_backlog(procs: Procs, collector: Collector) -> None:
    """``--job`` follows that room only (its events; its samples, labelled ``job``) and
    ``--no-backlog`` starts after the room's newest event."""
    lh = procs.lighthouse()
    join(lh.address, "d0")  # the default room: never exported here
    room = LighthouseClient(lh.address, connect_timeout=CONNECT, job="team-a")
    room.quorum(replica_id="a0", timeout=timedelta(seconds=30), step=0)
    with urllib.request.urlopen(lh.address + "/status?job=team-a", timeout=10) as r:
        before = max(e["seq"] for e in json.load(r)["events"])
    args = ["--lighthouse", lh.address, "--endpoint", collector.url, "--interval", "0.2"]
    bridge = procs.bridge(*args, "--job", "team-a", "--no-backlog")
    wait_until(lambda: "following events" in procs.log(bridge), 60, "the bridge", procs.log(bridge))
    room.quorum(replica_id="a1", timeout=timedelta(seconds=30), step=0)
    wait_until(
        lambda: any(r["attributes"].get("replica_id") == "a1" for r in collector.events()),
        30,
        "a1's events",
        procs.log(bridge),
    )
    records = collector.events()
    assert all(r["attributes"]["seq"] > before for r in records), records
    assert {r["attributes"].get("replica_id") for r in records} <= {None, "a1"}
    assert records[0]["resource"]["torchft.job"] == "team-a"
    wait_until(
        lambda: collector.latest("torchft_replica_step", job="team-a", replica_id="a1"),
        30,
        "the room's metrics",
    )
    with collector.lock:
        assert all(m["attributes"].get("job") == "team-a" for m in collector.metrics)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_bridge_after_a_last_scrape(
    procs: Procs, collector: Collector, sig: signal.Signals
) -> None:
    """SIGTERM/SIGINT end the bridge with exit code 0 after a last scrape and a flush: the
    metrics exported at exit show what happened since the first scrape, although the
    interval (an hour) never came round."""
    lh = procs.lighthouse()
    bridge = procs.bridge(
        "--lighthouse", lh.address, "--endpoint", collector.url, "--interval", "3600"
    )
    wait_until(
        lambda: collector.latest("torchft_replicas") is not None,
        60,
        "the first scrape",
        procs.log(bridge),
    )
    first = collector.latest("torchft_replicas")
    assert first is not None and first["value"] == 0.0
    join(lh.address, "g0")
    wait_until(lambda: len(collector.events()) >= 3, 30, "g0's events", procs.log(bridge))
    bridge.send_signal(sig)
    assert bridge.wait(timeout=30) == 0, procs.log(bridge)
    last = collector.latest("torchft_replicas")
    assert last is not None and last["value"] == 1.0, procs.log(bridge)
    assert f"stopping ({sig.name})" in procs.log(bridge)
    assert "stopped after exporting" in procs.log(bridge)


@pytest.mark.timeout(120)
def test_token_and_tls_of_the_job_are_used_and_a_refused_token_ends_the_bridge(
    procs: Procs, collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a TLS lighthouse whose pages need the job's token, the bridge verifies it
    with TORCHFT_TLS_CA and sends TORCHFT_TOKEN_FILE's token; without the token it exits 1
    naming the setting."""
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    ca = str(CERTS / "ca.pem")
    monkeypatch.setenv("TORCHFT_TOKEN_FILE", str(token))  # the in-test client's
    monkeypatch.setenv("TORCHFT_TLS_CA", ca)
    tls = ["--tls_cert", str(CERTS / "server.pem"), "--tls_key", str(CERTS / "server.key")]
    lh = procs.lighthouse("--token_file", str(token), "--private_status", *tls)
    assert lh.address.startswith("https://"), lh.address
    join(lh.address, "g0")
    args = ["--lighthouse", lh.address, "--endpoint", collector.url, "--interval", "0.2"]
    bridge = procs.bridge(*args, env=clean_env(TORCHFT_TOKEN_FILE=str(token), TORCHFT_TLS_CA=ca))
    wait_until(
        lambda: any(r["body"] == "replica_joined" for r in collector.events()),
        60,
        "events over TLS with the token",
        procs.log(bridge),
    )
    wait_until(lambda: collector.latest("torchft_replicas"), 30, "metrics over TLS")
    refused = procs.bridge(*args, env=clean_env(TORCHFT_TLS_CA=ca))
    assert refused.wait(timeout=60) == 1, procs.log(refused)
    assert "TORCHFT_TOKEN_FILE" in procs.log(refused) and "401" in procs.log(refused)


@pytest.mark.timeout(60)
def test_unreachable_lighthouse_is_retried_with_backoff(procs: Procs, collector: Collector) -> None:
    """A lighthouse nobody answers at is retried with a growing delay, each retry logged;
    a signal still ends the bridge at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    bridge = procs.bridge("--lighthouse", f"http://127.0.0.1:{port}", "--endpoint", collector.url)
    wait_until(
        lambda: "retrying in 2.0s" in procs.log(bridge), 30, "backoff lines", procs.log(bridge)
    )
    log = procs.log(bridge)
    assert f"lighthouse http://127.0.0.1:{port} unavailable" in log
    assert "retrying in 0.5s" in log and "retrying in 1.0s" in log
    bridge.send_signal(signal.SIGTERM)
    assert bridge.wait(timeout=20) == 0, procs.log(bridge)


@pytest.mark.timeout(60)
def test_missing_endpoint_exits_2_naming_both_settings(procs: Procs) -> None:
    """Without --endpoint or OTEL_EXPORTER_OTLP_ENDPOINT the bridge refuses to start."""
    bridge = procs.bridge("--lighthouse", "http://127.0.0.1:1")
    assert bridge.wait(timeout=30) == 2
    log = procs.log(bridge)
    assert "no OTLP endpoint" in log and "--endpoint" in log, log
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in log


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lighthouse", "ftp://h:1"], "--lighthouse 'ftp://h:1' must be an http:// or https://"),
        (["--lighthouse", "localhost:29510"], "must be an http:// or https:// URL"),
        (["--lighthouse", "http://:29510"], "has no host"),
        (["--lighthouse", "http://h:99999"], "is not a URL"),
        (["--lighthouse", "http://h:1/?job=a"], "no query"),
        (["--interval", "0"], "must be a positive number of seconds"),
        (["--interval", "-3"], "must be a positive number of seconds"),
        (["--interval", "nan"], "must be a positive number of seconds"),
        (["--interval", "soon"], "must be a number of seconds"),
        (["--endpoint", "grpc://c:4317"], "--endpoint 'grpc://c:4317' must be an http://"),
        (["--endpoint", "http://c:4318/v1/logs"], "names a signal path"),
        (["--job", "no spaces"], "--job must be 1 to 64"),
        (["--service-name", " "], "--service-name must not be empty"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each bad setting is refused before anything starts, with a message naming it."""
    base = {"--lighthouse": "http://127.0.0.1:1", "--endpoint": "http://127.0.0.1:2"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    with pytest.raises(SystemExit) as exc:
        otel.parse_args([x for kv in base.items() for x in kv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_endpoint_falls_back_to_the_standard_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT is the default endpoint (a trailing slash is dropped);
    --endpoint wins over it; a bad value names the variable."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert otel.parse_args(["--lighthouse", "http://lh:1"]).endpoint == "http://collector:4318"
    opts = otel.parse_args(["--lighthouse", "http://lh:1/", "--endpoint", "https://c:1"])
    assert opts.endpoint == "https://c:1" and opts.lighthouse_url == "http://lh:1"
    assert (opts.interval, opts.job, opts.backlog) == (15.0, "", True)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")
    with pytest.raises(SystemExit):
        otel.parse_args(["--lighthouse", "http://lh:1"])
    assert "OTEL_EXPORTER_OTLP_ENDPOINT 'collector:4318' must be" in capsys.readouterr().err


# ----------------------------------------------------------------------------- loggers

LOGGER_SCRIPT = """
import logging
from torchft.otel import setup_logger, shutdown

setup_logger("torchft_quorums")
setup_logger("torchft_quorums")  # a second call adds nothing
log = logging.getLogger("torchft_quorums")
log.setLevel(logging.INFO)
log.propagate = False
log.info("quorum %d ready", 7, extra={"quorum_id": 7, "replica_id": "g0", "ctx": {"step": 3}})
try:
    raise ValueError("boom")
except ValueError:
    log.exception("step failed")
logging.getLogger("my_trainer").warning("not set up: not exported")
shutdown()
"""

IMPORT_SCRIPT = """
import logging
import torchft  # attaches the Manager's loggers itself, as upstream's package does
from torchft.otel import shutdown

log = logging.getLogger("torchft_commits")
log.setLevel(logging.INFO)
log.propagate = False
log.info("commit at step %d", 5)
shutdown()
"""


@pytest.mark.timeout(60)
def test_setup_logger_exports_python_records_like_upstream(
    collector: Collector, tmp_path: Path
) -> None:
    """Upstream's ``setup_logger`` with ``TORCHFT_USE_OTEL`` sends a logger's records to
    OTEL_EXPORTER_OTLP_ENDPOINT: message, level, extras and exception as attributes, the
    resource attributes from TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON; once per record."""
    attributes = tmp_path / "resource.json"
    attributes.write_text(json.dumps({"torchft_quorums": {"service.name": "trainer", "rg": 2}}))
    env = clean_env(
        TORCHFT_USE_OTEL="true",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON=str(attributes),
    )
    done = subprocess.run(
        [sys.executable, "-c", LOGGER_SCRIPT], env=env, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    with collector.lock:
        records = list(collector.logs)
    assert [r["body"] for r in records] == ["quorum 7 ready", "step failed"], records
    info, error = records
    assert (info["severity_number"], info["severity_text"]) == (SEVERITY_INFO, "INFO")
    assert info["attributes"]["quorum_id"] == 7 and info["attributes"]["replica_id"] == "g0"
    assert info["attributes"]["ctx.step"] == 3
    assert info["attributes"]["code.function.name"] == "<module>"
    assert info["scope"] == "torchft_quorums"
    assert info["resource"]["service.name"] == "trainer" and info["resource"]["rg"] == 2
    assert abs(info["time_unix_nano"] / 1e9 - time.time()) < 60
    assert (error["severity_number"], error["severity_text"]) == (SEVERITY_ERROR, "ERROR")
    assert error["attributes"]["exception.type"] == "ValueError"
    assert error["attributes"]["exception.message"] == "boom"
    assert "Traceback" in error["attributes"]["exception.stacktrace"]


@pytest.mark.timeout(30)
def test_setup_logger_is_off_by_default_and_checks_its_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without TORCHFT_USE_OTEL nothing is attached; a bad switch or attributes file is a
    ValueError naming the variable."""
    import logging

    monkeypatch.delenv("TORCHFT_USE_OTEL", raising=False)
    target = logging.getLogger("torchft_otel_test")
    before = list(target.handlers)
    otel.setup_logger("torchft_otel_test")
    assert target.handlers == before
    monkeypatch.setenv("TORCHFT_USE_OTEL", "maybe")
    with pytest.raises(ValueError, match="TORCHFT_USE_OTEL"):
        otel.setup_logger("torchft_otel_test")
    monkeypatch.setenv("TORCHFT_USE_OTEL", "1")
    bad = tmp_path / "attributes.json"
    for text, why in [("[1]", "must be a JSON object"), ("{", "not JSON")]:
        bad.write_text(text)
        monkeypatch.setenv("TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON", str(bad))
        with pytest.raises(ValueError, match=f"TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON.*{why}"):
            otel.setup_logger("torchft_otel_test")
    monkeypatch.setenv("TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read it"):
        otel.setup_logger("torchft_otel_test")
    assert target.handlers == before


NO_SDK_SCRIPT = """
import os
import sys
sys.modules["opentelemetry"] = None  # as if not installed
import torchft.otel as otel

os.environ["TORCHFT_USE_OTEL"] = "1"  # on only now: with it on, importing torchft fails

try:
    otel.setup_logger("torchft_quorums")
except otel.OTelUnavailableError as e:
    print("setup_logger:", e)
sys.exit(otel.main(["--lighthouse", "http://127.0.0.1:1", "--endpoint", "http://127.0.0.1:2"]))
"""


@pytest.mark.timeout(60)
def test_without_the_sdk_the_package_imports_and_export_names_what_to_install() -> None:
    """Without OpenTelemetry the module imports; asking for an export fails naming the
    packages to install (the bridge with exit code 2)."""
    done = subprocess.run(
        [sys.executable, "-c", NO_SDK_SCRIPT],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2, done.stderr
    assert "setup_logger: OpenTelemetry export needs" in done.stdout
    assert otel.INSTALL_HINT in done.stdout and otel.INSTALL_HINT in done.stderr
    # With the switch on, the package's own import says what is missing.
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['opentelemetry'] = None; import torchft"],
        env=clean_env(TORCHFT_USE_OTEL="1"),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode != 0 and otel.INSTALL_HINT in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_importing_torchft_with_the_switch_on_exports_the_manager_loggers(
    collector: Collector,
) -> None:
    """As upstream's package: TORCHFT_USE_OTEL alone sends the Manager's loggers' records."""
    env = clean_env(TORCHFT_USE_OTEL="true", OTEL_EXPORTER_OTLP_ENDPOINT=collector.url)
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_SCRIPT], env=env, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    with collector.lock:
        records = list(collector.logs)
    assert [(r["body"], r["scope"]) for r in records] == [("commit at step 5", "torchft_commits")]


@pytest.mark.timeout(10)
def test_flatten_attributes_keeps_what_otlp_carries() -> None:
    """Nested objects become dotted keys, homogeneous lists stay lists, null is left out,
    mixed lists become JSON and integers beyond 64 bits their text."""
    flat = otel.flatten_attributes(
        {
            "a": None,
            "b": {"c": 1, "d": {"e": "x"}},
            "ids": ["g0", "g1"],
            "mixed": [1, "x", None],
            "empty": [],
            "big": 2**70,
            "ok": True,
            "f": 0.5,
        }
    )
    assert flat == {
        "b.c": 1,
        "b.d.e": "x",
        "ids": ["g0", "g1"],
        "mixed": '[1, "x", null]',
        "empty": [],
        "big": str(2**70),
        "ok": True,
        "f": 0.5,
    }
