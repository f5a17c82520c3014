"""End-to-end failure detection: how long a survivor stops committing when a peer dies or hangs.

Real lighthouse (in this process), real replica-group processes (tests/_ft_worker.py: Manager,
DDP, AdamW on Gloo, CPU), real signals. A SIGKILLed group's session with the lighthouse ends
with its process, so the lighthouse declares it lost at once and tells the survivor, whose
Manager aborts the quorum's collectives: the survivor's gap between committed steps stays
under a second at the default 5 s heartbeat timeout. A SIGSTOPped group keeps its connections
open, so it is declared lost when its heartbeat expires (gap ≤ timeout + 1 s); after SIGCONT it
rejoins and heals. Replica groups at the same step hold identical state throughout.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster, Group
from test_fault_tolerance import assert_identical, assert_same_trajectory

from torchft._torchft import LighthouseServer

DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
HANG_HEARTBEAT_TIMEOUT_S = 2.0


def commit_gap(result: dict[str, Any], fault_time: float) -> float:
    """Longest gap between the group's committed steps around ``fault_time`` (seconds).

    Args:
        result: a worker's result file (``commit_times``: ``[step, wall time]`` per commit).
        fault_time: wall time at which the fault was injected.

    Returns:
        The time from the last commit before the fault to the first commit after it.
    """
    times = sorted(t for _, t in result["commit_times"])
    before = [t for t in times if t <= fault_time]
    after = [t for t in times if t > fault_time]
    assert after, "the survivor never committed after the fault"
    return after[0] - (before[-1] if before else fault_time)


def signal_group(group: Group, sig: signal.Signals) -> None:
    """Sends ``sig`` to every process of ``group``."""
    for p in group.procs:
        if p.poll() is None:
            p.send_signal(sig)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Any]:
    """Builds a lighthouse with the given heartbeat timeout plus a process launcher."""
    made: list[tuple[Cluster, Any]] = []

    def make(heartbeat_timeout_s: float) -> Cluster:
        lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=1,
            join_timeout_ms=1000,
            quorum_tick_ms=20,
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )
        c = Cluster(tmp_path, lighthouse.address())
        made.append((c, lighthouse))
        return c

    try:
        yield make
    finally:
        for c, lighthouse in made:
            c.close()
            lighthouse.shutdown()


def start_groups(cluster: Cluster, n: int) -> list[Group]:
    """Starts ``n`` one-rank groups and waits until all committed 15 steps together.

    Args:
        cluster: the launcher.
        n: number of replica groups (named rg0, rg1, ...).

    Returns:
        The groups, in name order.
    """
    extra = ["--step-sleep", "0.02", "--timeout", "10"]
    groups = [cluster.start(f"rg{i}", seed=i, extra=extra) for i in range(n)]
    cluster.wait_until(
        lambda: min(s for g in groups for s in g.steps()) >= 15, 90, "all groups at step 15"
    )
    # A random point of the step: quorum, allreduce, should_commit or between steps.
    time.sleep(random.uniform(0.0, 0.15))
    return groups


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n_groups", [2, 3])
def test_sigkill_survivor_resumes_within_a_second(make_cluster: Any, n_groups: int) -> None:
    """SIGKILL one of two/three groups at a random point: every survivor's gap is ≤ 1 s (5 s
    heartbeat timeout); the killed group restarts, heals and ends identical."""
    cluster = make_cluster(DEFAULT_HEARTBEAT_TIMEOUT_S)
    *survivors, victim = start_groups(cluster, n_groups)
    fault = time.time()
    cluster.kill(victim)
    killed_at = max(victim.steps())
    cluster.wait_until(
        lambda: min(s for g in survivors for s in g.steps()) >= killed_at + 10,
        60,
        "survivors to go on",
    )
    reborn = cluster.start(victim.name, seed=99, extra=["--step-sleep", "0.02"])
    cluster.wait_until(lambda: min(reborn.steps()) > killed_at + 10, 90, "restarted group to heal")
    target = max(s for g in cluster.live() for s in g.steps()) + 10
    cluster.stop_at(target)
    results = cluster.finish(90)
    assert len(results) == n_groups
    assert_identical(results, target)
    assert_same_trajectory(results)
    for r in results:
        if r["replica_id"] == victim.name:
            continue
        gap = commit_gap(r, fault)
        print(f"{r['replica_id']} gap after SIGKILL: {gap:.3f}s")
        assert gap <= 1.0, f"{r['replica_id']} stopped committing for {gap:.2f}s after SIGKILL"


@pytest.mark.timeout(180)
def test_sigstop_survivor_resumes_after_heartbeat_timeout_and_frozen_group_heals(
    make_cluster: Any,
) -> None:
    """SIGSTOP one of two groups: the survivor's gap is ≤ heartbeat timeout + 1 s; after
    SIGCONT the frozen group rejoins, heals and ends identical."""
    cluster = make_cluster(HANG_HEARTBEAT_TIMEOUT_S)
    survivor, frozen = start_groups(cluster, 2)
    fault = time.time()
    signal_group(frozen, signal.SIGSTOP)
    try:
        frozen_at = max(frozen.steps())
        cluster.wait_until(
            lambda: min(survivor.steps()) >= frozen_at + 20, 60, "survivor to go on alone"
        )
    finally:
        signal_group(frozen, signal.SIGCONT)
    resumed_at = max(survivor.steps())
    cluster.wait_until(lambda: min(frozen.steps()) > resumed_at, 90, "frozen group to heal")
    target = max(s for g in cluster.live() for s in g.steps()) + 10
    cluster.stop_at(target)
    results = cluster.finish(90)
    assert len(results) == 2
    assert_identical(results, target)
    assert_same_trajectory(results)
    gap = commit_gap(next(r for r in results if r["replica_id"] == "rg0"), fault)
    bound = HANG_HEARTBEAT_TIMEOUT_S + 1.0
    print(f"survivor gap after SIGSTOP: {gap:.3f}s")
    assert gap <= bound, f"survivor stopped committing for {gap:.2f}s after SIGSTOP (≤ {bound}s)"
    # The frozen group healed instead of replaying: it skipped the steps it missed.
    frozen_result = next(r for r in results if r["replica_id"] == "rg1")
    steps_done = [a[0] for a in frozen_result["attempts"] if a[1]]
    assert any(b - a > 1 for a, b in zip(steps_done, steps_done[1:], strict=False)), (
        "frozen group did not heal"
    )


def read_marker(path: Path) -> tuple[float, int]:
    """The wall time and pid a worker's fault hook wrote."""
    t, pid = path.read_text().split()
    return float(t), int(pid)


@pytest.mark.timeout(150)
def test_peer_killed_inside_configure_does_not_hold_the_survivor(
    make_cluster: Any, tmp_path: Path
) -> None:
    """A group SIGKILLs itself inside its first process-group configure, after the quorum with
    it was issued: the survivor's configure (its rendezvous waits for the dead member) is
    abandoned when the lighthouse reports the loss, and it commits within 3 s instead of
    waiting out the 20 s store/rendezvous timeout."""
    cluster = make_cluster(DEFAULT_HEARTBEAT_TIMEOUT_S)
    marker = tmp_path / "died"
    extra = ["--step-sleep", "0.02", "--timeout", "20", "--quorum-timeout", "60"]
    survivor = cluster.start("rg0", seed=0, extra=extra)
    victim = cluster.start("rg1", seed=1, extra=[*extra, "--kill-self-in-configure", str(marker)])

    def survivor_went_on() -> bool:
        victim.procs[0].poll()  # reap it: a self-inflicted SIGKILL is expected here
        return marker.exists() and min(survivor.steps()) >= 5

    cluster.wait_until(survivor_went_on, 90, "the survivor to train alone")
    died, _ = read_marker(marker)
    cluster.stop_at(max(survivor.steps()) + 5)
    (result,) = cluster.finish(60)
    gap = commit_gap(result, died)
    print(f"survivor gap after its peer died in configure: {gap:.3f}s")
    assert gap <= 3.0, f"survivor stalled {gap:.2f}s on a peer that died in configure"


@pytest.mark.timeout(240)
def test_heal_from_a_stopped_source_moves_on_to_another_source(
    make_cluster: Any, tmp_path: Path
) -> None:
    """A group joins late and heals; its source SIGSTOPs itself right after offering its
    state. Once the source is declared lost (2 s heartbeat timeout) the heal is abandoned
    and the next quorum heals it from the other up-to-date group: it commits within the
    heartbeat timeout + 3 s of the stop, not after the 30 s transfer timeout. After SIGCONT
    every group ends bit-identical."""
    cluster = make_cluster(HANG_HEARTBEAT_TIMEOUT_S)
    marker = tmp_path / "stopped"
    extra = ["--step-sleep", "0.02", "--timeout", "30", "--stop-self-when-serving", str(marker)]
    early = [cluster.start(f"rg{i}", seed=i, extra=extra) for i in (0, 2)]
    cluster.wait_until(
        lambda: min(s for g in early for s in g.steps()) >= 15, 90, "the first groups at 15"
    )
    late = cluster.start("rg1", seed=1, extra=extra)
    cluster.wait_until(marker.exists, 90, "a heal source to stop itself")
    stopped_at, pid = read_marker(marker)
    stopped = next(g for g in early if g.procs[0].pid == pid)
    try:
        cluster.wait_until(lambda: min(late.steps()) >= 16, 60, "the late group to heal")
    finally:
        signal_group(stopped, signal.SIGCONT)
    target = max(s for g in cluster.live() for s in g.steps()) + 10
    cluster.stop_at(target)
    results = cluster.finish(120)
    assert len(results) == 3
    assert_identical(results, target)
    late_result = next(r for r in results if r["replica_id"] == "rg1")
    first_commit = min(t for _, t in late_result["commit_times"])
    took = first_commit - stopped_at
    bound = HANG_HEARTBEAT_TIMEOUT_S + 3.0
    print(f"late group's first commit {took:.3f}s after its heal source stopped")
    assert took <= bound, f"heal from a stopped source took {took:.2f}s (> {bound}s)"


class _FakeWatchClient:
    """Serves scripted ``_watch_events`` answers, then idles like an empty long-poll."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.calls: list[int] = []

    def _watch_events(self, after_seq: int, timeout: Any) -> tuple[int, list[tuple[str, int]]]:
        self.calls.append(after_seq)
        if self.answers:
            a = self.answers.pop(0)
            if isinstance(a, BaseException):
                raise a
            return a
        time.sleep(0.01)
        return after_seq, []


@pytest.mark.timeout(30)
def test_watcher_delivers_events_in_order_and_survives_errors() -> None:
    """The watcher passes every event on, resumes after the last seen sequence number, keeps
    going after a failed poll and a failing handler, and stops promptly."""
    from torchft.loss_watch import LostWatcher

    client = _FakeWatchClient(
        [
            (2, [("b", 7), ("c", 7)]),
            RuntimeError("manager server unreachable"),
            (3, [("d", 8)]),
        ]
    )
    seen: list[tuple[str, int]] = []

    def on_lost(replica_id: str, quorum_id: int) -> None:
        seen.append((replica_id, quorum_id))
        if replica_id == "c":
            raise ValueError("handler failure must not stop the watcher")

    watcher = LostWatcher(client, on_lost)
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop(wait=5)
    assert seen == [("b", 7), ("c", 7), ("d", 8)]
    assert client.calls[:3] == [0, 2, 2], "resumes after the last sequence number"
    assert client.calls[3] == 3
    assert not watcher._thread.is_alive()
    assert watcher not in LostWatcher._live
