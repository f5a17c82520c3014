"""Tests of the lighthouse Python bindings and of the ``torchft_lighthouse`` daemon."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from conftest import LighthouseProcess, lighthouse_command, start_lighthouse_process

from torchft._torchft import (
    LighthouseClient,
    LighthouseServer,
    Quorum,
    QuorumMember,
    TorchFTError,
)

CONNECT = timedelta(seconds=10)


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_quorum_round_trip_with_data(lighthouse: LighthouseServer) -> None:
    """A quorum request returns the requester with every field and the data dict intact."""
    client = LighthouseClient(lighthouse.address(), connect_timeout=CONNECT)
    data: dict[str, Any] = {"host": "n1", "gpus": [0, 1], "nested": {"x": 1.5}}
    before = datetime.now(timezone.utc)
    q = client.quorum(
        replica_id="rg0",
        timeout=timedelta(seconds=10),
        address="http://n1:29512",
        store_address="n1:29500",
        step=7,
        world_size=4,
        shrink_only=False,
        data=data,
    )
    assert isinstance(q, Quorum)
    assert q.quorum_id >= 1
    assert len(q.participants) == 1
    m = q.participants[0]
    assert isinstance(m, QuorumMember)
    assert (m.replica_id, m.address, m.store_address) == ("rg0", "http://n1:29512", "n1:29500")
    assert (m.step, m.world_size, m.shrink_only, m.commit_failures) == (7, 4, False, 0)
    assert m.data == data
    assert q.created.tzinfo is not None
    assert before - timedelta(seconds=1) <= q.created <= datetime.now(timezone.utc)
    assert "rg0" in repr(q) and "QuorumMember(" in repr(m)


def test_two_clients_share_a_quorum(lighthouse: LighthouseServer) -> None:
    """Concurrent requests land in one quorum and the id is stable on the fast path."""
    client = LighthouseClient(lighthouse.address(), connect_timeout=CONNECT)
    client.heartbeat("a")
    client.heartbeat("b")

    def ask(rid: str) -> Quorum:
        return client.quorum(replica_id=rid, timeout=timedelta(seconds=10), step=1)

    with ThreadPoolExecutor(2) as pool:
        qa, qb = pool.map(ask, ["a", "b"])
    assert [m.replica_id for m in qa.participants] == ["a", "b"]
    assert qa.quorum_id == qb.quorum_id
    with ThreadPoolExecutor(2) as pool:
        qa2, _ = pool.map(ask, ["a", "b"])
    assert qa2.quorum_id == qa.quorum_id


def test_quorum_timeout_raises_timeout_error() -> None:
    """A round that cannot complete raises the built-in TimeoutError at the deadline."""
    server = LighthouseServer("127.0.0.1:0", min_replicas=2)
    try:
        client = LighthouseClient(server.address(), connect_timeout=CONNECT)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            client.quorum(replica_id="alone", timeout=timedelta(milliseconds=300))
        assert time.monotonic() - t0 < 5
    finally:
        server.shutdown()


def test_gil_released_during_quorum() -> None:
    """Another Python thread keeps running while a quorum call blocks."""
    server = LighthouseServer("127.0.0.1:0", min_replicas=2, progress_wait_ms=0)
    try:
        client = LighthouseClient(server.address(), connect_timeout=CONNECT)
        ticks = 0
        stop = threading.Event()

        def spin() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                time.sleep(0.001)

        t = threading.Thread(target=spin)
        t.start()
        with pytest.raises(TimeoutError):
            client.quorum(replica_id="x", timeout=timedelta(milliseconds=300))
        stop.set()
        t.join()
        assert ticks > 20
    finally:
        server.shutdown()


class _Heartbeater:
    """Heartbeats ``replica_id`` with ``step`` every 50 ms on a thread until stopped. The
    first heartbeat is sent before the constructor returns, so the lighthouse knows the
    group before the test goes on (a loaded machine may otherwise start the thread late)."""

    def __init__(self, address: str, replica_id: str, step: int) -> None:
        self.client = LighthouseClient(address, connect_timeout=CONNECT)
        self.replica_id = replica_id
        self.step = step
        self.client.heartbeat(replica_id, step=step)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.client.heartbeat(self.replica_id, step=self.step)
            self.stop.wait(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.mark.timeout(60)
def test_fresh_groups_wait_for_a_live_group_holding_newer_progress() -> None:
    """Two fresh groups (step 0) do not form a quorum without a group that heartbeats step
    50 while busy; once it asks, all three are in the quorum, and nothing regressed."""
    server = LighthouseServer(
        "127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=1000,
        progress_wait_ms=30_000,
    )
    holder = _Heartbeater(server.address(), "old", 50)
    try:
        client = LighthouseClient(server.address(), connect_timeout=CONNECT)

        def ask(rid: str, step: int) -> Quorum:
            return client.quorum(replica_id=rid, timeout=timedelta(seconds=30), step=step)

        with ThreadPoolExecutor(3) as pool:
            fresh = [pool.submit(ask, rid, 0) for rid in ("new1", "new2")]
            time.sleep(2.5)  # well past the join timeout
            assert not any(f.done() for f in fresh), "a quorum formed behind the live holder"
            _, status = _get(server.address() + "/status")
            assert "old (at step 50)" in json.loads(status)["reason"]
            old = pool.submit(ask, "old", 50).result(timeout=30)
            quorums = [f.result(timeout=30) for f in fresh]
        for q in [old, *quorums]:
            assert [m.replica_id for m in q.participants] == ["new1", "new2", "old"]
        _, metrics = _get(server.address() + "/metrics")
        assert "torchft_progress_regressions_total 0" in metrics
    finally:
        holder.close()
        server.shutdown()


@pytest.mark.timeout(60)
def test_regression_after_the_holder_died_is_announced() -> None:
    """When the only group holding step 50 goes silent (dead), fresh groups continue from
    step 0 after its heartbeat timeout, and the regression is an event and a metric."""
    server = LighthouseServer(
        "127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=1000,
    )
    holder = _Heartbeater(server.address(), "old", 50)
    try:
        time.sleep(0.3)
        holder.close()  # dies: its heartbeats stop
        client = LighthouseClient(server.address(), connect_timeout=CONNECT)
        t0 = time.monotonic()
        q = client.quorum(replica_id="new", timeout=timedelta(seconds=30), step=0)
        assert [m.replica_id for m in q.participants] == ["new"]
        assert time.monotonic() - t0 < 10
        _, metrics = _get(server.address() + "/metrics")
        assert "torchft_progress_regressions_total 1" in metrics
        _, status = _get(server.address() + "/status")
        events = [e for e in json.loads(status)["events"] if e["kind"] == "progress_regressed"]
        assert len(events) == 1
        e = events[0]
        assert (e["from_step"], e["to_step"], e["unavoidable"]) == (50, 0, True)
        assert e["quorum_id"] == q.quorum_id
    finally:
        holder.close()
        server.shutdown()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_replicas": 0},
        {"min_replicas": -1},
        {"min_replicas": 1, "join_timeout_ms": -1},
        {"min_replicas": 1, "quorum_tick_ms": 0},
        {"min_replicas": 1, "heartbeat_timeout_ms": -5},
        {"min_replicas": 1, "straggler_skew_pct": 0},
        {"min_replicas": 1, "straggler_skew_pct": float("nan")},
        {"min_replicas": 1, "straggler_min_ms": -1},
        {"min_replicas": 1, "progress_wait_ms": -1},
        {"min_replicas": 1, "event_log": "/nonexistent-dir/events.jsonl"},
    ],
)
def test_server_rejects_bad_args(kwargs: dict[str, Any]) -> None:
    """Bad server arguments raise ValueError before anything is bound."""
    with pytest.raises(ValueError):
        LighthouseServer("127.0.0.1:0", **kwargs)


def test_server_bad_bind_address() -> None:
    """An unparsable bind address is a ValueError, an unusable one a TorchFTError."""
    with pytest.raises(ValueError):
        LighthouseServer("not an address", min_replicas=1)
    with pytest.raises(TorchFTError):
        LighthouseServer("192.0.2.1:0", min_replicas=1)


def test_client_rejects_bad_args(lighthouse: LighthouseServer) -> None:
    """Bad quorum arguments raise ValueError and leave the lighthouse untouched."""
    client = LighthouseClient(lighthouse.address(), connect_timeout=CONNECT)
    t = timedelta(seconds=5)
    with pytest.raises(ValueError):
        client.quorum(replica_id="", timeout=t)
    with pytest.raises(ValueError):
        client.quorum(replica_id="a", timeout=t, step=-1)
    with pytest.raises(ValueError):
        client.quorum(replica_id="a", timeout=t, world_size=0)
    with pytest.raises(ValueError):
        client.quorum(replica_id="a", timeout=t, data=["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        client.quorum(replica_id="a", timeout=timedelta(0))
    with pytest.raises(ValueError):
        client.heartbeat("")
    # Nothing was recorded by the rejected calls: "ok" alone forms a quorum.
    q = client.quorum(replica_id="ok", timeout=t)
    assert [m.replica_id for m in q.participants] == ["ok"]


def test_connect_timeout() -> None:
    """Connecting to a port nobody listens on fails after the connect timeout."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with pytest.raises(TorchFTError):
        LighthouseClient(f"127.0.0.1:{port}", connect_timeout=timedelta(milliseconds=300))
    assert time.monotonic() - t0 < 5


def test_pyclass_constructors() -> None:
    """QuorumMember and Quorum can be built from Python with defaults."""
    m = QuorumMember("r1", step=3, data={"k": "v"})
    assert (m.replica_id, m.address, m.step, m.world_size) == ("r1", "", 3, 1)
    assert m.data == {"k": "v"}
    assert QuorumMember("r2").data == {}
    assert m == QuorumMember("r1", step=3, data={"k": "v"})
    created = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    q = Quorum(5, [m], created)
    assert q.quorum_id == 5
    assert q.participants == [m]
    assert q.created == created


def test_coordination_reexports() -> None:
    """torchft.coordination exposes the lighthouse types."""
    from torchft import coordination

    assert coordination.LighthouseServer is LighthouseServer
    assert coordination.LighthouseClient is LighthouseClient
    assert coordination.Quorum is Quorum
    assert coordination.QuorumMember is QuorumMember


@pytest.mark.timeout(60)
def test_daemon_http_and_sigterm(lighthouse_process: LighthouseProcess) -> None:
    """The daemon serves /healthz and /status and exits 0 on SIGTERM."""
    base = lighthouse_process.address
    assert _get(f"{base}/healthz") == (200, "ok")
    status, body = _get(f"{base}/status")
    assert status == 200
    s = json.loads(body)
    assert s["min_replicas"] == 1
    assert s["quorum_id"] is None
    client = LighthouseClient(base, connect_timeout=CONNECT)
    q = client.quorum(replica_id="d0", timeout=timedelta(seconds=10))
    s = json.loads(_get(f"{base}/status")[1])
    assert s["quorum_id"] == q.quorum_id
    assert [m["replica_id"] for m in s["members"]] == ["d0"]
    assert _get(f"{base}/nope")[0] == 404
    assert lighthouse_process.stop() == 0


@pytest.mark.timeout(60)
def test_daemon_sigint_exits_zero() -> None:
    """SIGINT stops the daemon cleanly too."""
    p = start_lighthouse_process("--min-replicas", "2")
    try:
        p.proc.send_signal(signal.SIGINT)
        assert p.proc.wait(15) == 0
    finally:
        p.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--min_replicas", "0"], "min_replicas"),
        (["--min_replicas", "abc"], "min_replicas"),
        (["--min_replicas", "1", "--bogus"], "--bogus"),
        ([], "--min_replicas"),
        (["--min_replicas", "1", "--bind", "192.0.2.1:1"], "cannot bind"),
        (["--min_replicas", "1", "--hang_timeout_ms", "soon"], "hang_timeout_ms"),
        (["--min_replicas", "1", "--hang_timeout_ms=-5"], "hang_timeout_ms"),
        (["--min_replicas", "1", "--straggler_drop_after_ms", "long"], "straggler_drop_after_ms"),
        (["--min_replicas", "1", "--straggler_drop_after_ms=-1"], "straggler_drop_after_ms"),
    ],
)
def test_daemon_bad_flags(flags: list[str], message: str) -> None:
    """Bad flags exit non-zero with a message naming the problem."""
    env = {"PATH": "/usr/bin:/bin", "RUST_LOG": "error"}
    r = subprocess.run(
        lighthouse_command() + flags,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_daemon_explains_a_round_that_waits() -> None:
    """A round waiting past two seconds says why at WARN (the verdict, who asks, the healthy
    groups that do not), and /status names them with the round's age."""
    p = start_lighthouse_process("--min_replicas", "2", "--quorum_tick_ms", "20")
    try:
        client = LighthouseClient(p.address, CONNECT)
        client.heartbeat("idle")
        with ThreadPoolExecutor(1) as pool:
            asking = pool.submit(client.quorum, replica_id="lonely", timeout=timedelta(seconds=20))
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if any("quorum round waiting" in line for line in p.log):
                    break
                client.heartbeat("idle")
                time.sleep(0.1)
            lines = [line for line in p.log if "quorum round waiting" in line]
            assert lines, "".join(p.log)
            assert "WARN" in lines[0] and "min_replicas=2" in lines[0], lines[0]
            assert "idle" in lines[0], lines[0]
            s = json.loads(_get(f"{p.address}/status")[1])
            assert s["participants"] == ["lonely"]
            assert s["healthy_not_asking"] == ["idle"]
            assert s["round_age_s"] >= 2.0
            assert "min_replicas=2" in s["reason"]
            # The second group asks: both get the quorum, and nothing more is explained.
            q = client.quorum(replica_id="idle", timeout=timedelta(seconds=10))
            assert sorted(m.replica_id for m in q.participants) == ["idle", "lonely"]
            assert asking.result(timeout=10).quorum_id == q.quorum_id
        assert json.loads(_get(f"{p.address}/status")[1])["round_age_s"] is None
    finally:
        p.stop()


@pytest.mark.timeout(60)
def test_daemon_restart_keeps_ids_increasing() -> None:
    """A daemon restarted on the same port issues larger quorum ids."""
    p = start_lighthouse_process("--min_replicas", "1")
    try:
        q1 = LighthouseClient(p.address, CONNECT).quorum("r", timeout=timedelta(seconds=10))
    finally:
        assert p.stop() == 0
    port = p.address.rsplit(":", 1)[1]
    p2 = start_lighthouse_process("--min_replicas", "1", "--bind", f"127.0.0.1:{port}")
    try:
        q2 = LighthouseClient(p2.address, CONNECT).quorum("r", timeout=timedelta(seconds=10))
        assert q2.quorum_id > q1.quorum_id
    finally:
        p2.stop()


@pytest.mark.timeout(60)
def test_lighthouse_main_parses_argv_like_the_binary() -> None:
    """lighthouse_main() called from Python uses the binary's flag parser."""
    code = (
        "import sys; sys.argv[0] = 'torchft_lighthouse'; "
        "from torchft._torchft import lighthouse_main; lighthouse_main()"
    )
    env = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=30, env=env
    )
    assert r.returncode == 0, r.stderr
    for flag in ("--min_replicas", "--bind", "--join_timeout_ms", "--heartbeat_timeout_ms"):
        assert flag in r.stdout
    r = subprocess.run(
        [sys.executable, "-c", code, "--min_replicas", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert r.returncode == 2
    assert "min_replicas" in r.stderr
