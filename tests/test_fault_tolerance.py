"""End-to-end fault tolerance: real lighthouse, real replica-group processes, real SIGKILL.

Each replica group is one or two worker processes (tests/_ft_worker.py) with their own
TCPStore (created here, as torchrun would), a Manager, torchft DDP and AdamW on Gloo. The
lighthouse runs in the test process. The invariant checked everywhere: replica groups that
reach the same committed step hold bit-identical parameters and optimizer state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cluster import Cluster
from torch.distributed import TCPStore

from torchft._torchft import LighthouseServer


def assert_identical(results: list[dict[str, Any]], target: int) -> None:
    """Invariant 1: same step ⇒ identical parameters and optimizer state (per group rank)."""
    assert results, "no results"
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        assert r["step"] == target, f"{r['replica_id']} stopped at {r['step']} != {target}"
        by_rank.setdefault(r["group_rank"], []).append(r)
    for rank, rs in by_rank.items():
        assert len({r["param_hash"] for r in rs}) == 1, f"params differ on group rank {rank}"
        assert len({r["optim_hash"] for r in rs}) == 1, f"optimizer differs on rank {rank}"


def assert_same_trajectory(results: list[dict[str, Any]]) -> None:
    """Every step committed by several groups left identical parameters in all of them."""
    by_step: dict[tuple[int, int], set[str]] = {}
    for r in results:
        for step, committed, param_hash in r["attempts"]:
            if committed:
                by_step.setdefault((r["group_rank"], step), set()).add(param_hash)
    diverged = sorted(k for k, v in by_step.items() if len(v) > 1)
    assert not diverged, f"parameters diverged after (group rank, step) {diverged[:5]}"


def run_kill_restart(
    cluster: Cluster,
    n_groups: int,
    ranks: int,
    sync: bool,
    kill_at: int = 25,
    extra_for: Callable[[int], list[str]] = lambda i: [],
) -> None:
    """Trains n_groups, SIGKILLs the last one mid-run, restarts it, checks it heals
    (``extra_for(i)``: more worker arguments of group i, its restart included)."""
    extra = ["--step-sleep", "0.04"]
    groups = [
        cluster.start(f"rg{i}", ranks=ranks, sync=sync, seed=i, extra=extra + extra_for(i))
        for i in range(n_groups)
    ]
    victim = groups[-1]
    cluster.wait_until(lambda: min(victim.steps()) >= kill_at, 90, f"{victim.name} at {kill_at}")
    cluster.kill(victim)
    killed_at = max(victim.steps())
    survivors = groups[:-1]
    # The survivors keep committing without the dead group.
    cluster.wait_until(
        lambda: min(s for g in survivors for s in g.steps()) >= killed_at + 5,
        60,
        "survivors to progress without the killed group",
    )
    reborn = cluster.start(
        victim.name, ranks=ranks, sync=sync, seed=99, extra=extra + extra_for(n_groups - 1)
    )
    cluster.wait_until(lambda: min(reborn.steps()) > killed_at + 5, 90, "restarted group to heal")
    current = max(s for g in cluster.live() for s in g.steps())
    target = max(100, current + 15)
    cluster.stop_at(target)
    results = cluster.finish(90)
    assert len(results) == n_groups * ranks
    assert_identical(results, target)
    assert_same_trajectory(results)
    # The restarted group had committed nothing when it healed: it received into its own
    # tensors (a torn heal would lose nothing a restart does not give back).
    for log in reborn.logs:
        healed = [ln for ln in log.read_text().splitlines() if "healed to step" in ln]
        assert healed, f"{log.name}: no heal logged"
        assert healed[0].endswith("into its own tensors"), healed[0]
    for r in results:
        if r["replica_id"] == victim.name:
            # It never trained from scratch: its first vote was already past the kill.
            first_step = r["attempts"][0][0]
            assert first_step > killed_at, f"restarted group started at step {first_step}"
            assert r["attempts"][-1][1], "restarted group's last step did not commit"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_two_groups_kill_and_heal(cluster: Cluster, sync: bool) -> None:
    """Two groups; one is SIGKILLed, restarted, heals from the live one and ends identical."""
    run_kill_restart(cluster, n_groups=2, ranks=1, sync=sync)


@pytest.mark.timeout(150)
@pytest.mark.skipif(
    not hasattr(dist.ProcessGroup, "reconfigure"), reason="torch without native reconfigure"
)
def test_two_groups_kill_and_heal_with_native_gloo_groups(cluster: Cluster) -> None:
    """Native enable_reconfigure Gloo groups as Manager pg: SIGKILL, restart, heal, identical."""
    # Native Gloo rendezvous on the store its group was created with: one job-wide store,
    # one creation rank per replica group (the restarted group takes its predecessor's).
    shared = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def native(i: int) -> list[str]:
        return [
            "--native-store",
            f"127.0.0.1:{shared.port}",
            "--native-rank",
            str(i),
            "--native-world",
            "2",
        ]

    run_kill_restart(cluster, n_groups=2, ranks=1, sync=False, extra_for=native)
    for g in cluster.groups:
        for log in g.logs:
            assert "native" in log.read_text() and "reconfigured" in log.read_text(), log.name


@pytest.mark.timeout(150)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_groups_kill_and_heal_on_the_gpu(cluster: Cluster) -> None:
    """The kill-and-heal run with the model on the GPU: the restarted group heals into its
    own device tensors through pinned host staging, and both end bit-identical."""
    run_kill_restart(
        cluster, n_groups=2, ranks=1, sync=False, extra_for=lambda i: ["--device", "cuda"]
    )


@pytest.mark.timeout(150)
def test_three_groups_kill_and_heal(cluster: Cluster) -> None:
    """Three groups; one SIGKILLed and restarted; all end at the same step, identical."""
    run_kill_restart(cluster, n_groups=3, ranks=1, sync=False)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_hsdp_two_ranks_kill_and_heal(cluster: Cluster, sync: bool) -> None:
    """Two groups of two ranks (one replica PG per group rank); kill, restart, heal."""
    run_kill_restart(cluster, n_groups=2, ranks=2, sync=sync)


@pytest.mark.timeout(120)
def test_injected_allreduce_failure_commits_nowhere(cluster: Cluster) -> None:
    """A failed allreduce at step 10 commits in no group; the retry commits everywhere."""
    for i in range(2):
        cluster.start(f"rg{i}", seed=i, extra=["--fail-steps", "10"])
    cluster.stop_at(30)
    results = cluster.finish(100)
    assert_identical(results, 30)
    for r in results:
        votes = [(a[0], a[1]) for a in r["attempts"]]
        assert (10, False) in votes, f"{r['replica_id']}: injected failure did commit"
        assert votes.count((10, False)) == 1
        assert (10, True) in votes, f"{r['replica_id']}: step 10 was never retried"
        assert [v for v in votes if not v[1]] == [(10, False)], "unexpected failed commits"
    assert len({r["batches_committed"] for r in results}) == 1
    assert_same_trajectory(results)


@pytest.mark.timeout(120)
def test_one_sided_failure_heals_the_failed_group(cluster: Cluster) -> None:
    """Only one group's allreduce fails: it does not commit, then heals back in step."""
    cluster.start("rg0", seed=0, extra=["--fail-steps", "10"])
    cluster.start("rg1", seed=1)
    cluster.stop_at(30)
    results = cluster.finish(100)
    assert_identical(results, 30)
    failed = next(r for r in results if r["replica_id"] == "rg0")
    votes = [(a[0], a[1]) for a in failed["attempts"]]
    assert (10, False) in votes
    # It did not redo step 10 alone: it healed to the peer's step 11 and carried on.
    assert (10, True) not in votes
    assert (11, True) in votes
    assert_same_trajectory(results)


# --------------------------------------------------------------------------- in-process


def _manager(store: TCPStore, lighthouse: str, replica_id: str = "solo", **kwargs: Any) -> Any:
    from torchft import Manager, ProcessGroupGloo

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=None,
        state_dict=None,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        **kwargs,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_async_quorum", [True, False], ids=["async", "sync"])
def test_quorum_timeout_raises_within_twice_the_timeout(use_async_quorum: bool) -> None:
    """No quorum can form (min_replicas=2, one group): TimeoutError within ~2x the timeout,
    raised by start_quorum itself with the synchronous quorum (as upstream's) and by
    should_commit in both modes."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = _manager(
        store,
        lighthouse.address(),
        min_replica_size=1,
        use_async_quorum=use_async_quorum,
        quorum_timeout=timedelta(seconds=1.5),
        timeout=timedelta(seconds=1.5),
    )
    try:
        start = time.monotonic()
        if use_async_quorum:
            manager.start_quorum()
        else:
            with pytest.raises(TimeoutError, match="Timeout expired"):
                manager.start_quorum()
        with pytest.raises(TimeoutError):
            manager.should_commit()
        elapsed = time.monotonic() - start
        assert elapsed < 3.0, f"TimeoutError after {elapsed:.2f}s"
        assert manager.current_step() == 0
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


@pytest.mark.timeout(60)
def test_max_retries_exceeded_raises_runtime_error() -> None:
    """min_replica_size=2 with one group never commits: RuntimeError after max_retries."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = _manager(
        store,
        lighthouse.address(),
        min_replica_size=2,
        max_retries=2,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=10),
    )
    try:
        for _ in range(2):
            manager.start_quorum()
            assert manager.num_participants() == 1
            assert not manager.should_commit()
        manager.start_quorum()
        with pytest.raises(RuntimeError, match="max_retries"):
            manager.should_commit()
        assert manager.current_step() == 0
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def _mlp() -> torch.nn.Module:
    """The small MLP of the DDP tests, with the same initial weights every time."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(step: int) -> torch.Tensor:
    """The batch of ``step`` (the same in every group and every try of the step)."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _ddp_group(lighthouse: str, replica_id: str, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """A replica group of one rank training :func:`_mlp` with torchft DDP and AdamW (state
    registered for healing); returns ``(manager, ddp, optimizer, store)``."""
    from torchft import DistributedDataParallel, Optimizer

    model = _mlp()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = _manager(store, lighthouse, replica_id, **kwargs)
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-2))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    return manager, ddp, optim, store


def _ddp_step(ddp: Any, optim: Any, step: int) -> None:
    """One training step on :func:`_batch` of ``step``."""
    optim.zero_grad()
    ddp(_batch(step)).pow(2).sum().backward()
    optim.step()


@pytest.mark.timeout(90)
def test_quorum_timeout_inside_ddp_backward_leaves_the_state_and_the_next_steps_work() -> None:
    """DDP's reducer asks the step's participant count at its first gradient, which waits
    for the quorum: a quorum that times out there (one group, min_replicas=2) does not raise
    out of backward, the step does not apply (TimeoutError from the optimizer step, the
    parameters and the step count unchanged), a second backward works (the reducer was left
    ready for it), and once a second group joins both commit with one state."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
    timeouts = {"quorum_timeout": timedelta(seconds=1.5), "timeout": timedelta(seconds=5)}
    groups = [_ddp_group(lighthouse.address(), "rg0", min_replica_size=1, **timeouts)]
    try:
        manager, ddp, optim, _ = groups[0]
        before = [p.detach().clone() for p in ddp.parameters()]
        for _ in range(2):
            optim.zero_grad()
            started = time.monotonic()
            loss = ddp(torch.randn(4, 8)).pow(2).sum()
            loss.backward()  # the quorum times out inside: recorded, not raised
            assert time.monotonic() - started < 5.0
            with pytest.raises(TimeoutError):
                optim.step()
            assert manager.current_step() == 0
            for p, b in zip(ddp.parameters(), before, strict=True):
                assert torch.equal(p.detach(), b)
        # A second group joins: both train together from step 0 (its start) on.
        groups.append(_ddp_group(lighthouse.address(), "rg1", min_replica_size=1, **timeouts))

        # The groups step in rounds: each tries a step, then both read the steps between two
        # barriers, so both decide alike when to stop (one that stopped alone would leave the
        # other without a quorum). They stop once both reached step 3 at the same step (a
        # commit one group's lease refused is made up by a heal at the next round).
        rounds = threading.Barrier(2, timeout=30)

        def train(group: tuple[Any, Any, Any, Any]) -> list[torch.Tensor]:
            m, d, o, _ = group
            for _ in range(30):
                try:
                    _ddp_step(d, o, m.current_step())
                except TimeoutError:
                    pass  # a quorum round that began before the other group asked
                rounds.wait()
                steps = {g[0].current_step() for g in groups}
                rounds.wait()
                if len(steps) == 1 and min(steps) >= 3:
                    break
            moments = [v for st in o.state_dict()["state"].values() for v in st.values()]
            return [t.detach().clone() for t in [*d.state_dict().values(), *moments]]

        with ThreadPoolExecutor(2) as pool:
            states = list(pool.map(train, groups))
        final = manager.current_step()
        assert final >= 3 and [g[0].current_step() for g in groups] == [final, final]
        assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
        # The commits are plain AdamW steps on the average of the two groups' gradients (the
        # same batch in both, so the gradient itself): a participant count left wrong by the
        # timed-out steps would scale the sum alike in both groups, and only this shows it.
        ref = _mlp()
        ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(final):
            _ddp_step(ref, ref_optim, step)
        for p, r in zip(ddp.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.detach(), r.detach())
    finally:
        for g in groups:
            g[0].shutdown(wait=False)
        lighthouse.shutdown()
