"""Manager server and client through the Python bindings, against a real in-process lighthouse."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from torchft._torchft import QuorumRequest, TorchFTError
from torchft.coordination import (
    LighthouseServer,
    ManagerClient,
    ManagerServer,
    QuorumResult,
)

T = TypeVar("T")

LONG = timedelta(seconds=10)
CONNECT = timedelta(seconds=5)


def _dead_addr() -> str:
    """A local address nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    """A lighthouse that answers as soon as one replica group asks."""
    lh = LighthouseServer(
        "127.0.0.1:0", min_replicas=1, join_timeout_ms=5000, quorum_tick_ms=10, progress_wait_ms=0
    )
    try:
        yield lh
    finally:
        lh.shutdown()


@pytest.fixture
def lighthouse2() -> Iterator[LighthouseServer]:
    """A lighthouse that needs two replica groups for a quorum."""
    lh = LighthouseServer(
        "127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, quorum_tick_ms=10, progress_wait_ms=0
    )
    try:
        yield lh
    finally:
        lh.shutdown()


class Group:
    """A manager server plus one client per group rank; shut down on close."""

    def __init__(
        self, replica_id: str, lighthouse_addr: str, world_size: int, **extra: Any
    ) -> None:
        """Starts the server and connects the clients.

        Args:
            replica_id: the group's replica id.
            lighthouse_addr: where the lighthouse listens.
            world_size: number of ranks in the group.
            **extra: more ManagerServer arguments (a topology file, sparse_quorum).
        """
        self.server = ManagerServer(
            replica_id=replica_id,
            lighthouse_addr=lighthouse_addr,
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr=f"{replica_id}-store:29500",
            world_size=world_size,
            heartbeat_interval=timedelta(milliseconds=50),
            connect_timeout=CONNECT,
            quorum_retries=0,
            **extra,
        )
        self.clients = [ManagerClient(self.server.address(), CONNECT) for _ in range(world_size)]

    def close(self) -> None:
        """Stops the server."""
        self.server.shutdown()


@pytest.fixture
def groups() -> Iterator[Callable[[str, str, int], Group]]:
    """Factory for groups that are all shut down at the end of the test."""
    made: list[Group] = []

    def make(replica_id: str, lighthouse_addr: str, world_size: int, **extra: Any) -> Group:
        g = Group(replica_id, lighthouse_addr, world_size, **extra)
        made.append(g)
        return g

    try:
        yield make
    finally:
        for g in made:
            g.close()


def _parallel(*calls: Callable[[], T]) -> list[T | BaseException]:
    """Runs the calls on threads at once; returns results or raised exceptions in order."""

    def wrap(c: Callable[[], T]) -> T | BaseException:
        try:
            return c()
        except BaseException as e:  # noqa: BLE001 - returned to the test for inspection
            return e

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(wrap, calls))


def _req(rank: int, step: int, meta: str) -> QuorumRequest:
    return QuorumRequest(group_rank=rank, step=step, checkpoint_metadata=meta, shrink_only=False)


def _quorum(
    c: ManagerClient, rank: int, step: int, timeout: timedelta = LONG
) -> Callable[[], QuorumResult]:
    return lambda: c._quorum(_req(rank, step, f"meta-{rank}"), timeout)


def test_full_round_two_groups_two_ranks(
    lighthouse2: LighthouseServer, groups: Callable[[str, str, int], Group]
) -> None:
    """Two groups of two ranks: the behind group heals from the up-to-date one."""
    a = groups("a", lighthouse2.address(), 2)
    b = groups("b", lighthouse2.address(), 2)
    results = _parallel(
        _quorum(a.clients[0], 0, 3),
        _quorum(a.clients[1], 1, 3),
        _quorum(b.clients[0], 0, 1),
        _quorum(b.clients[1], 1, 1),
    )
    for r in results:
        assert isinstance(r, QuorumResult), r
    ra0, ra1, rb0, rb1 = results
    assert isinstance(ra0, QuorumResult) and isinstance(rb1, QuorumResult)
    assert len({r.quorum_id for r in results if isinstance(r, QuorumResult)}) == 1
    assert ra0.replica_ids == ["a", "b"]
    assert ra0.replica_rank == 0 and ra0.replica_world_size == 2
    assert not ra0.heal and ra0.recover_dst_replica_ranks == [1]
    assert ra0.max_replica_rank == 0 and ra0.max_world_size == 1 and ra0.max_step == 3
    assert rb1.heal and rb1.recover_src_replica_rank == 0
    assert rb1.recover_src_manager_address == a.server.address()
    assert rb1.max_replica_rank is None
    assert rb1.store_address == "a-store:29500"
    src = ManagerClient(rb1.recover_src_manager_address, CONNECT)
    assert src._checkpoint_metadata(1, LONG) == "meta-1"


def test_sparse_answers_name_only_the_members_a_group_deals_with(
    groups: Callable[..., Group], tmp_path: Path
) -> None:
    """Three groups at one step: a manager without a topology file gets the lighthouse's
    sparse answer, whose replica ids name itself and its store's group only (the others are
    empty strings), with the same ranks and store as from the full list; a manager with a
    topology file (the lighthouse does not have it), or with ``sparse_quorum=False``, still
    gets the whole list."""
    lh = LighthouseServer(
        "127.0.0.1:0", min_replicas=3, join_timeout_ms=5000, quorum_tick_ms=10, progress_wait_ms=0
    )
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps({"version": "0.1", "ranks": {"0": {"peers": {}}}}))
    try:
        a = groups("a", lh.address(), 1)
        b = groups("b", lh.address(), 1, sparse_quorum=False)
        c = groups("c", lh.address(), 1, topology_file=str(topology), topology_group=0)
        results = _parallel(*(_quorum(g.clients[0], 0, 4) for g in (a, b, c)))
    finally:
        lh.shutdown()
    ra, rb, rc = results
    assert isinstance(ra, QuorumResult) and isinstance(rb, QuorumResult), results
    assert isinstance(rc, QuorumResult), results
    assert ra.replica_ids == ["a", "", ""]
    assert rb.replica_ids == rc.replica_ids == ["a", "b", "c"]
    for rank, r in enumerate((ra, rb, rc)):
        assert (r.replica_rank, r.replica_world_size, r.max_world_size) == (rank, 3, 3)
        assert r.store_address == "a-store:29500" and not r.heal and r.max_step == 4


def test_should_commit_and_of_votes(
    lighthouse: LighthouseServer, groups: Callable[[str, str, int], Group]
) -> None:
    """should_commit is True only if every rank votes True (and the lighthouse accepts the
    write-ahead commit); a lone voter times out."""
    g = groups("a", lighthouse.address(), 2)
    c0, c1 = g.clients
    assert _parallel(
        lambda: c0.should_commit(0, 1, True, LONG), lambda: c1.should_commit(1, 1, True, LONG)
    ) == [True, True]
    assert _parallel(
        lambda: c0.should_commit(0, 2, True, LONG), lambda: c1.should_commit(1, 2, False, LONG)
    ) == [False, False]
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        c0.should_commit(0, 3, True, timedelta(milliseconds=300))
    assert time.monotonic() - start < 1.0


def test_no_commit_while_the_lighthouse_is_unreachable(
    groups: Callable[[str, str, int], Group],
) -> None:
    """A unanimous yes does not commit when the write-ahead commit cannot be announced."""
    g = groups("a", _dead_addr(), 2)
    c0, c1 = g.clients
    short = timedelta(milliseconds=800)
    assert _parallel(
        lambda: c0.should_commit(0, 1, True, short), lambda: c1.should_commit(1, 1, True, short)
    ) == [False, False]
    assert g.server.may_commit(1, short) is False


def test_quorum_timeout_when_a_rank_never_arrives(
    lighthouse: LighthouseServer, groups: Callable[[str, str, int], Group]
) -> None:
    """A rank waiting for a missing peer gets TimeoutError at its deadline, not later."""
    g = groups("a", lighthouse.address(), 2)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        g.clients[0]._quorum(_req(0, 0, "m"), timedelta(milliseconds=500))
    elapsed = time.monotonic() - start
    assert 0.4 <= elapsed < 1.0, elapsed
    # The timed-out rank left: a full round still works afterwards.
    results = _parallel(_quorum(g.clients[0], 0, 0), _quorum(g.clients[1], 1, 0))
    assert all(isinstance(r, QuorumResult) for r in results), results


def test_quorum_takes_the_record_keywords_or_upstreams_positional_form(
    lighthouse: LighthouseServer, groups: Callable[[str, str, int], Group]
) -> None:
    """The three call forms of ``_quorum`` ask the same thing; bad mixes fail clearly."""
    g = groups("a", lighthouse.address(), 1)
    (c,) = g.clients
    by_record = c._quorum(_req(0, 0, "m"), LONG)
    by_keywords = c._quorum(
        group_rank=0, step=0, checkpoint_metadata="m", shrink_only=False, timeout=LONG
    )
    positional = c._quorum(0, 0, "m", False, LONG, 0, True)
    assert by_record.quorum_id == by_keywords.quorum_id == positional.quorum_id
    with pytest.raises(TypeError, match='multiple values for argument "step"'):
        c._quorum(0, 0, "m", False, LONG, step=1)
    with pytest.raises(TypeError, match="at most 7 positional"):
        c._quorum(0, 0, "m", False, LONG, 0, True, "extra")
    with pytest.raises(TypeError, match="missing argument: timeout"):
        c._quorum(_req(0, 0, "m"))


def test_quorum_start_answers_like_quorum(
    lighthouse: LighthouseServer, groups: Callable[[str, str, int], Group]
) -> None:
    """A started request is answered once, with the same result and errors as ``_quorum``."""
    g = groups("a", lighthouse.address(), 2)
    c0, c1 = g.clients
    pending = c0._quorum_start(_req(0, 0, "meta-0"), LONG)
    # Rank 1 has not asked yet, so the group's round cannot be answered.
    time.sleep(0.1)
    assert not pending.done()
    blocking = c1._quorum(_req(1, 0, "meta-1"), LONG)
    started = pending.wait()
    assert isinstance(started, QuorumResult)
    assert pending.done()
    assert (started.quorum_id, started.replica_world_size) == (
        blocking.quorum_id,
        blocking.replica_world_size,
    )
    with pytest.raises(RuntimeError, match="already waited"):
        pending.wait()
    # The deadline is carried by the request: a lone rank gets TimeoutError from wait().
    start = time.monotonic()
    lone = c0._quorum_start(_req(0, 1, "meta-0"), timedelta(milliseconds=300))
    with pytest.raises(TimeoutError):
        lone.wait()
    assert time.monotonic() - start < 1.5
    with pytest.raises(ValueError):
        c0._quorum_start(_req(0, 0, "m"), timedelta(0))


def test_lighthouse_down_fails_promptly(groups: Callable[[str, str, int], Group]) -> None:
    """With no lighthouse, every rank gets a TorchFTError well before its deadline."""
    g = groups("a", _dead_addr(), 2)
    start = time.monotonic()
    results = _parallel(_quorum(g.clients[0], 0, 0), _quorum(g.clients[1], 1, 0))
    for r in results:
        assert isinstance(r, TorchFTError), r
        assert "lighthouse" in str(r)
    assert time.monotonic() - start < LONG.total_seconds() / 2


def test_step_mismatch_is_an_error(
    lighthouse: LighthouseServer, groups: Callable[[str, str, int], Group]
) -> None:
    """Ranks of one group reporting different steps all get an error."""
    g = groups("a", lighthouse.address(), 2)

    def late() -> QuorumResult:
        time.sleep(0.05)
        return g.clients[1]._quorum(_req(1, 5, "m"), LONG)

    results = _parallel(_quorum(g.clients[0], 0, 4), late)
    for r in results:
        assert isinstance(r, TorchFTError) and "step" in str(r), r


def test_bad_arguments_raise_value_error(
    lighthouse: LighthouseServer, groups: Callable[[str, str, int], Group]
) -> None:
    """Out-of-range ranks, negative steps, zero timeouts and bad options raise ValueError."""
    g = groups("a", lighthouse.address(), 2)
    c = g.clients[0]
    with pytest.raises(ValueError):
        c._quorum(_req(2, 0, "m"), LONG)
    with pytest.raises(ValueError):
        c._quorum(_req(0, -1, "m"), LONG)
    with pytest.raises(ValueError):
        c._quorum(_req(0, 0, "m"), timedelta(0))
    with pytest.raises(ValueError):
        c.should_commit(5, 0, True, LONG)
    with pytest.raises(ValueError, match="group rank 1"):
        c._checkpoint_metadata(1, LONG)
    # State digests (runtime parity): a step below 1, an empty or too long digest, or a
    # rank outside the group are refused before anything is recorded.
    for step, digest in ((0, b"12345678"), (3, b""), (3, b"x" * 65)):
        with pytest.raises(ValueError, match="digest"):
            c._should_commit_digest(0, 0, True, LONG, step, digest)
        with pytest.raises(ValueError, match="digest"):
            g.server._offer_digest(0, step, digest)
    with pytest.raises(ValueError, match="group rank 2"):
        g.server._offer_digest(2, 3, b"12345678")
    # The hosting rank's quorum wait, sent with the commit announcement (goodput).
    for step, seconds in ((-1, 0.5), (3, -0.5), (3, float("nan")), (3, float("inf"))):
        with pytest.raises(ValueError):
            g.server._note_quorum_wait(step, seconds)
    g.server._note_quorum_wait(3, 0.25)
    # Only a group of one rank starts its quorum on the server (the others use the client).
    with pytest.raises(ValueError, match="one rank"):
        g.server._quorum_start(_req(0, 0, "m"), LONG)
    with pytest.raises(ValueError):
        ManagerServer("b", lighthouse.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 0)
    with pytest.raises(ValueError):
        ManagerServer("", lighthouse.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1)


def test_quorum_result_is_constructible() -> None:
    """QuorumResult can be built and edited by hand (for tests of code built on top)."""
    q = QuorumResult(quorum_id=3, heal=True, recover_src_replica_rank=1)
    q.max_step = 7
    assert (q.quorum_id, q.heal, q.recover_src_replica_rank, q.max_step) == (3, True, 1, 7)
    assert q.max_replica_rank is None and q.recover_dst_replica_ranks == []
    assert "quorum_id=3" in repr(q) and "heal=True" in repr(q)


@pytest.mark.timeout(60)
def test_kill_ends_the_hosting_process() -> None:
    """Kill ends the process hosting the manager server, with exit code 1 and the reason."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from datetime import timedelta
        from torchft._torchft import ManagerServer
        s = ManagerServer("victim", "{_dead_addr()}", "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                          timedelta(milliseconds=100), timedelta(seconds=5), 0)
        print(s.address(), flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().strip()
        assert addr.startswith("http://127.0.0.1:"), addr
        ManagerClient(addr, CONNECT).kill("test says goodbye")
        rc = proc.wait(timeout=10)
        assert rc == 1
        assert proc.stderr is not None
        assert "test says goodbye" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_lighthouse_restart_on_same_port(groups: Callable[[str, str, int], Group]) -> None:
    """After the lighthouse restarts on its address, the next quorum forms with a higher id."""
    lh = LighthouseServer("127.0.0.1:0", min_replicas=1, quorum_tick_ms=10, progress_wait_ms=0)
    port = lh.address().rsplit(":", 1)[1]
    g = groups("a", f"http://127.0.0.1:{port}", 1)
    c = g.clients[0]
    try:
        first = c._quorum(_req(0, 0, "m"), LONG)
        lh.shutdown()
        with pytest.raises(TorchFTError):
            c._quorum(_req(0, 1, "m"), LONG)
        lh = LighthouseServer(f"127.0.0.1:{port}", min_replicas=1, quorum_tick_ms=10)
        time.sleep(0.3)  # a few heartbeat periods: the manager reconnects by itself
        second = c._quorum(_req(0, 1, "m"), LONG)
        assert second.quorum_id > first.quorum_id
        assert second.max_step == 1
    finally:
        lh.shutdown()


@pytest.mark.timeout(60)
def test_a_long_quorum_request_logs_why_the_lighthouse_waits() -> None:
    """A group whose quorum request waits at the lighthouse past a few seconds says so at
    WARN with the lighthouse's reason (here: a healthy group that does not ask), so a
    stalled job's own logs name whom it waits for."""
    script = textwrap.dedent(
        """
        import threading, time
        from datetime import timedelta
        from torchft._torchft import LighthouseClient, QuorumRequest, TorchFTError
        from torchft.coordination import LighthouseServer, ManagerClient, ManagerServer
        lh = LighthouseServer("127.0.0.1:0", min_replicas=1, join_timeout_ms=30000,
                              quorum_tick_ms=10, progress_wait_ms=0)
        stop = threading.Event()
        idle = LighthouseClient(lh.address(), timedelta(seconds=5))
        def beat():
            while not stop.is_set():
                idle.heartbeat("idle")
                time.sleep(0.05)
        idle.heartbeat("idle")
        threading.Thread(target=beat, daemon=True).start()
        s = ManagerServer("asker", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                          timedelta(milliseconds=50), timedelta(seconds=5), 0)
        c = ManagerClient(s.address(), timedelta(seconds=5))
        try:
            req = QuorumRequest(group_rank=0, step=0, checkpoint_metadata="meta", shrink_only=False)
            c._quorum(req, timedelta(seconds=4))
            print("quorum answered", flush=True)
        except (TimeoutError, TorchFTError) as e:
            print("quorum timed out", flush=True)
        stop.set()
        s.shutdown()
        lh.shutdown()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "TORCHFT_LOG": "warn"},
    )
    assert "quorum timed out" in proc.stdout, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "quorum request waiting" in line]
    assert lines, proc.stderr
    assert "WARN" in lines[0], lines[0]
    assert "healthy, not asking: idle" in lines[0], lines[0]
    # The lighthouse's verdict: with two healthy groups, one asking is no strict majority.
    assert "waiting for a strict majority: 1 asking of 2" in lines[0], lines[0]
