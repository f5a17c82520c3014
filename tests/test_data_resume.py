"""The data stream resumes exactly across a kill and heal: real processes, real SIGKILL.

Three replica groups read their shards through ``torchft.data.StepAlignedLoader``; every step
attempt's sample ids are logged as it happens (so the killed incarnation's log survives it).
One group is SIGKILLed and restarted; it heals and continues. Checked from the logs: in every
committed step a group contributed to, it trained batch ``step`` of its own shard (computed
here independently), never a batch twice; each incarnation trained every step from the one
it joined or healed to up to the last step, except steps it did not train in (an attempt that
did not commit, or a step sat out healing); the restarted group resumed past the kill, not at
the start of its shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster
from _ft_worker import DATA_BATCH, DATA_SAMPLES
from test_fault_tolerance import assert_identical

from torchft.chaos.history import read_jsonl
from torchft.data import DistributedSampler

pytestmark = pytest.mark.timeout(240)

GROUPS = 3


def expected_batch(group: int, position: int) -> list[int]:
    """Batch ``position`` of ``group``'s shard, from a sampler built here."""
    import torch
    from torch.utils.data import TensorDataset

    sampler = DistributedSampler(
        TensorDataset(torch.arange(DATA_SAMPLES)),
        replica_rank=group,
        num_replica_groups=GROUPS,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=11,
        drop_last=True,
    )
    per_epoch = sampler.num_samples // DATA_BATCH
    epoch, offset = divmod(position, per_epoch)
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return ids[offset * DATA_BATCH : (offset + 1) * DATA_BATCH]


def trained(records: list[Any], group: int) -> list[int]:
    """Positions of the committed steps this incarnation contributed to, checked one by one:
    the batch was the one of the step voted on, and the right one of the shard."""
    positions = []
    for position, step, committed, participating, ids in records:
        if not (committed and participating):
            continue
        assert position == step, f"group {group} trained batch {position} in step {step}"
        assert ids == expected_batch(group, position), f"group {group} step {step}: {ids}"
        positions.append(position)
    return positions


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_every_committed_step_trains_its_own_batch_exactly_once(
    cluster: Cluster, tmp_path: Path, sync: bool
) -> None:
    """Across a SIGKILL and heal, each group trains batch s of its shard in committed step s:
    none repeated, none skipped while it trains, and the reborn group resumes at its heal."""
    logs: dict[str, list[Path]] = {}

    def start(i: int, seed: int) -> Any:
        name = f"rg{i}"
        log = tmp_path / f"{name}_{len(logs.get(name, []))}.data.jsonl"
        logs.setdefault(name, []).append(log)
        extra = ["--data-groups", str(GROUPS), "--data-log", str(log)]
        return cluster.start(
            name, seed=seed, sync=sync, extra=extra, env={"REPLICA_GROUP_ID": str(i)}
        )

    groups = [start(i, i) for i in range(GROUPS)]
    victim = groups[1]

    def victim_trained() -> int:
        # Committed steps it trained in (a group that joins late heals first and trains
        # from there): the kill must come after several, so its resume point means something.
        path = logs["rg1"][0]
        if not path.exists():
            return 0
        return sum(1 for _, _, committed, part, _ in read_jsonl(path) if committed and part)

    cluster.wait_until(
        lambda: min(victim.steps()) >= 12 and victim_trained() >= 5, 120, "victim trained 5"
    )
    cluster.kill(victim)
    killed_at = max(s for g in cluster.live() for s in g.steps())
    cluster.wait_until(
        lambda: min(min(g.steps()) for g in cluster.live()) >= killed_at + 3,
        60,
        "survivors to go on",
    )
    reborn = start(1, 99)
    heal_floor = max(s for g in cluster.live() if g is not reborn for s in g.steps())
    cluster.wait_until(lambda: min(reborn.steps()) >= heal_floor + 5, 120, "reborn to train")
    target = max(s for g in cluster.live() for s in g.steps()) + 3
    cluster.stop_at(target)
    assert_identical(cluster.finish(120), target)

    # Every incarnation trained its shard's batches in step order, starting at the
    # step it joined or healed to (async: or the one after, as it sits the healing step out),
    # ending at the last step for the groups still running.
    runs: dict[str, list[list[int]]] = {}
    for name, paths in logs.items():
        group = int(name[2:])
        for path in paths:
            records = read_jsonl(path)
            positions = trained(records, group)
            assert positions, f"{path.name} trained nothing"
            # A survivor can miss a step too: its attempt failed (a peer was lost mid-step)
            # while another group committed that step, and it healed to the step after. A
            # step missing from the run must be one the group did not train in: an attempt
            # that did not commit, or a step it sat out healing.
            sat_out = {step for _, step, committed, part, _ in records if not (committed and part)}
            missing = set(range(positions[0], positions[-1] + 1)) - set(positions)
            assert missing <= sat_out, (path.name, sorted(missing - sat_out))
            joined = next(step for _, step, committed, _, _ in records if committed)
            if sync or joined == 0:
                # Sync: the heal finished before the batch was drawn; at step 0 nobody heals
                # in the background.
                assert positions[0] == joined, (path.name, joined, positions[0])
            else:
                assert positions[0] in (joined, joined + 1), (path.name, joined, positions[0])
            runs.setdefault(name, []).append(positions)
    for name, incarnations in runs.items():
        assert incarnations[-1][-1] == target - 1, name
        # No batch of a shard trained twice across incarnations.
        flat = [p for run in incarnations for p in run]
        assert len(flat) == len(set(flat)), name
    # The victim resumed past the kill, not from the start of its shard.
    before, after = runs["rg1"]
    assert len(before) >= 5 and after[0] > before[-1] + 1, (before[-1], after[0])
    # Somebody trained from the very first batch (the job's first group).
    assert any(run[0] == 0 for incarnations in runs.values() for run in incarnations)
