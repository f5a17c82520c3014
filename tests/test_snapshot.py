"""Durable snapshots end to end: real lighthouse, real replica-group processes, SIGKILL of
every group at once, restart, resume from the newest complete snapshot.

Checked: exactly the newest usable snapshot is restored (no more steps lost than the
interval), the restored state is bit-identical to the state the job had committed at that
step, the groups end identical, broken snapshots are skipped with a warning naming them, an
unwritable directory never stops training, and a snapshot loads with plain
``torch.distributed.checkpoint`` outside torchft.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cluster import Cluster, Group
from _ft_worker import hash_state
from test_fault_tolerance import assert_identical
from torch import nn

from torchft.snapshot import MANIFEST, list_snapshots, load_rank

EVERY = 5


def commits(log: Path) -> list[list[Any]]:
    """[step, param hash, optim hash] of every commit a rank logged."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def start(cluster: Cluster, name: str, ranks: int, snap_dir: Path, seed: int) -> Group:
    incarnation = sum(1 for g in cluster.groups if g.name == name)
    # One commit log per rank and incarnation (the worker appends).
    extra = ["--step-sleep", "0.03", "--commit-log", str(cluster.tmp / f"{name}_{incarnation}")]
    group = cluster.start(
        name,
        ranks=ranks,
        seed=seed,
        extra=extra,
        env={"TORCHFT_SNAPSHOT_DIR": str(snap_dir), "TORCHFT_SNAPSHOT_EVERY": str(EVERY)},
    )
    return group


def lighthouse_status(cluster: Cluster) -> dict[str, Any]:
    with urllib.request.urlopen(cluster.lighthouse_addr + "/status", timeout=5) as r:
        status: dict[str, Any] = json.loads(r.read())
    return status


def wait_status(cluster: Cluster, cond: Any, what: str, timeout: float = 20.0) -> dict[str, Any]:
    """Polls the lighthouse's /status until ``cond(status)`` (telemetry arrives batched)."""
    deadline = time.monotonic() + timeout
    status = lighthouse_status(cluster)
    while not cond(status):
        if time.monotonic() > deadline:
            pytest.fail(f"lighthouse /status never showed {what}: {status.get('snapshot')}")
        time.sleep(0.1)
        status = lighthouse_status(cluster)
    return status


def rank_logs(cluster: Cluster, name: str, incarnation: int, rank: int = 0) -> Path:
    return cluster.tmp / f"{name}_{incarnation}.r{rank}"


def model_template(hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
    model.append(nn.Linear(hidden, 4))
    return model


def run_total_loss(
    cluster: Cluster, tmp_path: Path, ranks: int, tamper: Any = None
) -> tuple[int, int, list[dict[str, Any]]]:
    """Trains two groups past a few snapshots, SIGKILLs both, optionally tampers with the
    snapshot directory, restarts both and trains on.

    Returns:
        (newest committed step before the kill, step of the snapshot the groups resumed
        from, the final results).
    """
    snap_dir = tmp_path / "snapshots"
    groups = [start(cluster, f"rg{i}", ranks, snap_dir, seed=i) for i in range(2)]
    # Past three snapshot steps, so retention and the choice among several are exercised,
    # and until snapshots of both groups are on disk: one writer per snapshot step, rotating
    # over the step's participants, so consecutive snapshots taken while both groups train
    # together come from both. (Under load one group may drop out of a few quorums; the
    # snapshots of those steps are all the other's.)
    cluster.wait_until(
        lambda: (
            min(s for g in groups for s in g.steps()) >= 3 * EVERY + 2
            and len(list_snapshots(snap_dir)) >= 3
            and {s.manifest["replica_id"] for s in list_snapshots(snap_dir)} == {"rg0", "rg1"}
        ),
        120,
        "three complete snapshots, from both groups",
    )
    # The lighthouse heard of them: its record is at least the newest on disk now (reports
    # are fail-open telemetry: an early one may be dropped, the newest is what counts).
    newest = list_snapshots(snap_dir)[0].step
    status = wait_status(
        cluster,
        lambda st: (st.get("snapshot") or {}).get("step", -1) >= newest,
        f"the snapshot of step {newest}",
    )
    assert status["counters"]["snapshots"] >= 1
    for g in groups:
        cluster.kill(g)
    killed_at = max(s for g in groups for s in g.steps())
    before = list_snapshots(snap_dir)
    assert before, "no complete snapshot before the kill"
    if tamper is not None:
        tamper(before)
    reborn = [start(cluster, f"rg{i}", ranks, snap_dir, seed=10 + i) for i in range(2)]
    cluster.wait_until(
        lambda: all(
            commits(rank_logs(cluster, g.name, 1, r)) for g in reborn for r in range(ranks)
        ),
        120,
        "restarted groups to commit",
    )
    first = [c[0] for i in range(2) for c in commits_of(cluster, f"rg{i}", 1, ranks)[:1]]
    resumed_from = min(first) - 1
    target = resumed_from + 2 * EVERY + 3
    cluster.stop_at(target)
    results = cluster.finish(120)
    assert_identical(results, target)
    return killed_at, resumed_from, results


def commits_of(cluster: Cluster, name: str, incarnation: int, ranks: int) -> list[list[Any]]:
    """Commits logged by rank 0 of one incarnation of a group (in order)."""
    del ranks
    return commits(rank_logs(cluster, name, incarnation))


def first_incarnation_hashes(cluster: Cluster, ranks: int) -> dict[int, tuple[str, str]]:
    """Step → (param hash, optim hash) of the first incarnations' commits (group rank 0);
    groups that committed a step hold identical state, which is checked too."""
    by_step: dict[int, tuple[str, str]] = {}
    for i in range(2):
        for step, p, o in commits_of(cluster, f"rg{i}", 0, ranks):
            assert by_step.setdefault(step, (p, o)) == (p, o), f"groups differ at step {step}"
    return by_step


@pytest.mark.timeout(240)
def test_total_loss_resumes_from_newest_snapshot(cluster: Cluster, tmp_path: Path) -> None:
    """Every group SIGKILLed at once: both restart from the newest complete snapshot, no
    more than the interval is lost, and the restored state is the one committed then."""
    killed_at, resumed_from, _ = run_total_loss(cluster, tmp_path, ranks=1)
    snaps = list_snapshots(tmp_path / "snapshots")
    assert resumed_from % EVERY == 0 and resumed_from > 0, resumed_from
    # Nothing newer was complete when the groups died: at most the interval is lost, plus
    # the steps a snapshot still being written covered.
    assert killed_at - resumed_from <= 2 * EVERY, (killed_at, resumed_from)
    history = first_incarnation_hashes(cluster, 1)
    # The snapshot holds exactly what the job had committed at that step.
    used = [s for s in snaps if s.step == resumed_from]
    assert used, f"snapshot of step {resumed_from} not kept"
    state = load_rank(used[0], 0)
    assert state["torchft"]["step"] == resumed_from
    assert hash_state(state["user"]["model"]) == history[resumed_from][0]
    assert hash_state(state["user"]["optim"]) == history[resumed_from][1]
    # Both restarted groups loaded it (neither trained from scratch or healed from step 0).
    for g in cluster.groups[2:]:
        text = g.logs[0].read_text()
        assert f"loaded snapshot of step {resumed_from}" in text, g.logs[0].name
    # Retention: never more than the newest three complete snapshots.
    assert len(snaps) <= 3, [s.path.name for s in snaps]


@pytest.mark.timeout(300)
def test_total_loss_two_rank_groups(cluster: Cluster, tmp_path: Path) -> None:
    """Two-rank groups (each rank holds its own part of the state): every rank writes its
    part, the manifest lists both, and both ranks resume from the same snapshot."""
    killed_at, resumed_from, results = run_total_loss(cluster, tmp_path, ranks=2)
    assert 0 < resumed_from and killed_at - resumed_from <= 2 * EVERY
    snap = [s for s in list_snapshots(tmp_path / "snapshots") if s.step == resumed_from][0]
    assert sorted(snap.manifest["ranks"]) == ["0", "1"]
    # The two ranks hold different state (their own data): two different parts.
    parts = [hash_state(load_rank(snap, r)["user"]["model"]) for r in range(2)]
    assert parts[0] != parts[1]
    for rank in range(2):
        logs = [g.logs[rank].read_text() for g in cluster.groups[2:]]
        assert all(f"loaded snapshot of step {resumed_from}" in t for t in logs)
    assert {r["group_rank"] for r in results} == {0, 1}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [1, 2])
def test_live_laggard_resumes_from_a_newer_snapshot(
    cluster: Cluster, tmp_path: Path, ranks: int
) -> None:
    """A live group behind a complete snapshot when the groups ahead of it die restores
    that snapshot instead of redoing the steps since its own.

    rg1 is stopped (SIGSTOP, every rank) while rg0 trains on alone past two more snapshots;
    rg0 is then SIGKILLed and rg1 continued (SIGCONT). rg1 never left its processes (it had
    trained), yet its first commit is the step after the newest snapshot, every rank loaded
    its part of that snapshot, its state then is the one rg0 committed at the snapshot's
    step, and the lighthouse counts the steps lost from it."""
    snap_dir = tmp_path / "snapshots"
    lead, lag = (start(cluster, f"rg{i}", ranks, snap_dir, seed=i) for i in range(2))
    cluster.wait_until(lambda: min(lag.steps()) >= EVERY + 2, 90, "both groups training")
    for p in lag.procs:
        p.send_signal(signal.SIGSTOP)
    try:
        stopped_at = max(lag.steps())
        # Two snapshots past the laggard's step: the newest is at least two steps ahead.
        cluster.wait_until(
            lambda: (
                bool(list_snapshots(snap_dir))
                and list_snapshots(snap_dir)[0].step >= stopped_at + 2 * EVERY
            ),
            120,
            "the leading group's snapshots past the stopped group's step",
        )
        newest = list_snapshots(snap_dir)[0].step
        wait_status(
            cluster,
            lambda st: (st.get("snapshot") or {}).get("step", -1) >= newest,
            f"the snapshot of step {newest}",
        )
        cluster.kill(lead)
        killed_at = max(lead.steps())
        newest = list_snapshots(snap_dir)[0].step
    finally:
        for p in lag.procs:
            p.send_signal(signal.SIGCONT)
    assert max(lag.steps()) == stopped_at
    cluster.wait_until(lambda: min(lag.steps()) > newest, 90, "the laggard to commit again")
    for rank in range(ranks):
        after = [c for c in commits(rank_logs(cluster, "rg1", 0, rank)) if c[0] > stopped_at]
        # Nothing between its own step and the snapshot's was redone.
        assert after and after[0][0] == newest + 1, (stopped_at, newest, [c[0] for c in after])
        text = lag.logs[rank].read_text()
        assert f"loaded snapshot of step {newest}" in text
        assert f"resumed from the snapshot of step {newest}" in text
    # The state it resumed from is the one the job committed at that step.
    held = {c[0]: (c[1], c[2]) for c in commits(rank_logs(cluster, "rg0", 0))}
    state = load_rank([s for s in list_snapshots(snap_dir) if s.step == newest][0], 0)
    assert (hash_state(state["user"]["model"]), hash_state(state["user"]["optim"])) == held[newest]
    events = wait_status(
        cluster,
        lambda st: any(e["kind"] == "progress_regressed" for e in st.get("events", [])),
        "the regression",
    )["events"]
    regressed = [e for e in events if e["kind"] == "progress_regressed"][-1]
    # The lighthouse counts from the newest snapshot it was told of: the one on disk, or,
    # when the leader wrote one more and was killed before reporting it, the one before.
    told = regressed["snapshot_step"]
    assert told in (newest, newest - EVERY) and told > stopped_at + 1, (newest, regressed)
    assert regressed["resumes_from"] == told, regressed
    assert regressed["steps_lost"] == killed_at - told, (killed_at, regressed)
    target = newest + EVERY + 2
    cluster.stop_at(target)
    assert_identical(cluster.finish(120), target)


@pytest.mark.timeout(240)
def test_corrupt_and_partial_snapshots_are_skipped(cluster: Cluster, tmp_path: Path) -> None:
    """The newest snapshot corrupt (a flipped byte) and the next partial (no manifest): both
    are skipped with a warning naming them, the third newest is used."""
    names: dict[str, Path] = {}

    def tamper(snaps: list[Any]) -> None:
        newest, second = snaps[0], snaps[1]
        data = next(p for p in newest.rank_dir(0).iterdir() if p.suffix == ".distcp")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
        (second.path / MANIFEST).unlink()
        names["corrupt"], names["partial"] = newest.path, second.path
        names["expected"] = snaps[2].path

    _, resumed_from, _ = run_total_loss(cluster, tmp_path, ranks=1, tamper=tamper)
    expected_step = int(names["expected"].name.split("_")[1])
    assert resumed_from == expected_step
    logs = "".join(g.logs[0].read_text() for g in cluster.groups[2:])
    assert f"{names['corrupt']}" in logs and "fails its checksum" in logs
    # The corrupt one is marked, so it is never tried again.
    assert not (names["corrupt"] / MANIFEST).exists()
    assert all(s.path != names["partial"] for s in list_snapshots(tmp_path / "snapshots"))


@pytest.mark.timeout(150)
def test_unwritable_snapshot_directory_never_stops_training(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A snapshot directory that cannot be created: each snapshot fails with a clear error
    in the log, and training goes on to the end."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    snap_dir = blocker / "snapshots"
    groups = [start(cluster, f"rg{i}", 1, snap_dir, seed=i) for i in range(2)]
    target = 3 * EVERY + 2
    cluster.wait_until(lambda: min(s for g in groups for s in g.steps()) >= 2, 60, "training")
    cluster.stop_at(target)
    results = cluster.finish(120)
    assert_identical(results, target)
    logs = "".join(g.logs[0].read_text() for g in groups)
    assert "snapshot of step 5 to" in logs and "failed" in logs
    assert "Not a directory" in logs or "NotADirectoryError" in logs
    # And in the event stream: the lighthouse counts the failures and records no snapshot.
    status = wait_status(
        cluster, lambda st: st["counters"]["snapshot_failures"] >= 1, "a snapshot failure"
    )
    assert status["snapshot"] is None


@pytest.mark.timeout(240)
def test_snapshot_loads_with_plain_dcp_outside_torchft(cluster: Cluster, tmp_path: Path) -> None:
    """A fresh process with only torch loads a snapshot's model and optimizer state through
    ``torch.distributed.checkpoint.load`` into its own model: the same tensors."""
    snap_dir = tmp_path / "snapshots"
    groups = [start(cluster, f"rg{i}", 1, snap_dir, seed=i) for i in range(2)]
    cluster.wait_until(lambda: bool(list_snapshots(snap_dir)), 90, "a snapshot")
    cluster.stop_at(max(s for g in groups for s in g.steps()) + 2)
    cluster.finish(60)
    snap = list_snapshots(snap_dir)[0]
    history = first_incarnation_hashes(cluster, 1)
    script = f"""
import hashlib, json, sys
import torch, torch.distributed.checkpoint as dcp
from torch import nn
sys.path.insert(0, {str(Path(__file__).parent)!r})
from _ft_worker import hash_state
torch.manual_seed(123)
m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
sd = {{"user": {{"model": m.state_dict()}}}}
dcp.load(sd, checkpoint_id={str(snap.rank_dir(0))!r}, no_dist=True)
m.load_state_dict(sd["user"]["model"])
print(json.dumps(hash_state(m.state_dict())))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "torchft" not in out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == history[snap.step][0]
    # And in this process: the same through dcp.load into a template.
    template = model_template()
    sd = {"user": {"model": template.state_dict()}}
    dcp.load(sd, checkpoint_id=str(snap.rank_dir(0)), no_dist=True)
    assert hash_state(sd["user"]["model"]) == history[snap.step][0]


@pytest.mark.timeout(180)
def test_diloco_total_loss_resumes_the_outer_state(tmp_path: Path) -> None:
    """Streaming DiLoCo (two fragments) writes the outer state it registers (global
    parameters, outer optimizers) at outer snapshot steps; after a total loss, new groups
    with other initial weights resume with exactly that outer state and train on together."""
    from test_local_sgd import _batches, _inner_step, _model, _outer, _run_replicas

    from torchft.local_sgd import DiLoCo

    snap_dir = tmp_path / "snapshots"
    settings = {"snapshot_dir": str(snap_dir), "snapshot_every": 2}

    def body(manager: Any, replica: int, shift: float, until: int) -> Any:
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(shift)  # the groups after the loss start from other weights
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = [_outer(model[0].parameters()), _outer(model[2].parameters())]
        diloco = DiLoCo(manager, [model[0], model[2]], inner, outer, sync_every=4)
        resumed: Any = None
        with diloco:
            for batch in _batches(replica, 400):
                # A snapshot still being written makes the next one due be skipped (training
                # never waits for a write); on a loaded machine that would drop step 6. The
                # test waits for the writer instead, so every snapshot step is written.
                writer_idle(manager)
                _inner_step(model, inner, batch)
                if resumed is None and manager.current_step() >= 2 and shift:
                    # Right after the resume the global parameters are the snapshot's.
                    resumed = (manager.current_step(), diloco_state(diloco))
                if manager.current_step() >= until:
                    break
        return resumed, diloco_state(diloco), manager.current_step()

    def writer_idle(manager: Any) -> None:
        snapshots = manager._snapshots
        deadline = time.monotonic() + 60
        while snapshots.writer.busy():
            assert time.monotonic() < deadline, "a snapshot write did not end within 60 s"
            time.sleep(0.01)

    def diloco_state(diloco: Any) -> str:
        return hash_state([f.state_dict() for f in diloco._fragments])

    _run_replicas(lambda m, r: body(m, r, 0.0, 7), use_async_quorum=False, **settings)
    newest = list_snapshots(snap_dir)[0]
    assert newest.step == 6, [s.step for s in list_snapshots(snap_dir)]
    saved = load_rank(newest, 0)["user"]
    expected = hash_state([saved[k] for k in sorted(saved)])
    after = _run_replicas(lambda m, r: body(m, r, 0.5 + r, 10), use_async_quorum=False, **settings)
    for resumed, _, step in after:
        assert resumed is not None and resumed[0] == 6, resumed
        assert resumed[1] == expected, "the outer state resumed is not the snapshot's"
        assert step == 10
    assert after[0][1] == after[1][1], "groups differ after training on from the snapshot"
