"""Tests of the replica-group-aware DistributedSampler."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from torchft.data import DistributedSampler


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("shuffle", [False, True])
def test_partitions_dataset_without_overlap(shuffle: bool) -> None:
    """Every (replica group, group rank) gets a disjoint shard and together they cover all."""
    n, groups, per_group = 48, 3, 4
    seen: dict[int, tuple[int, int]] = {}
    for replica_rank in range(groups):
        for group_rank in range(per_group):
            sampler = DistributedSampler(
                _dataset(n),
                replica_rank=replica_rank,
                num_replica_groups=groups,
                group_rank=group_rank,
                num_replicas=per_group,
                shuffle=shuffle,
                seed=7,
            )
            assert sampler.global_rank == group_rank + per_group * replica_rank
            assert sampler.global_world_size == groups * per_group
            indices = list(sampler)
            assert len(indices) == len(sampler) == n // (groups * per_group)
            for i in indices:
                assert i not in seen, (
                    f"index {i} given to {seen[i]} and {(replica_rank, group_rank)}"
                )
                seen[i] = (replica_rank, group_rank)
    assert sorted(seen) == list(range(n))


def test_uneven_dataset_with_drop_last_has_no_overlap() -> None:
    """With drop_last, an uneven dataset still gives disjoint, equal shards."""
    n, groups, per_group = 50, 2, 3
    all_indices: list[int] = []
    for replica_rank in range(groups):
        for group_rank in range(per_group):
            sampler = DistributedSampler(
                _dataset(n), replica_rank, groups, group_rank, per_group, drop_last=True
            )
            all_indices.extend(sampler)
    assert len(all_indices) == len(set(all_indices)) == (n // 6) * 6


def test_shuffle_follows_epoch() -> None:
    """set_epoch changes the order the same way on every rank (shared seed)."""
    a = DistributedSampler(_dataset(32), 0, 2, 0, 2, shuffle=True, seed=1)
    b = DistributedSampler(_dataset(32), 0, 2, 0, 2, shuffle=True, seed=1)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(a) != first


def test_defaults_come_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """group_rank/num_replicas default to RANK/WORLD_SIZE."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = DistributedSampler(_dataset(12), replica_rank=2, num_replica_groups=3)
    assert (sampler.global_rank, sampler.global_world_size) == (1 + 2 * 2, 6)
    assert (sampler.rank, sampler.num_replicas) == (5, 6)


def test_missing_or_bad_env_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing or non-integer env defaults raise ValueError naming the variable."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        DistributedSampler(_dataset(4), 0, 1)
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK"):
        DistributedSampler(_dataset(4), 0, 1)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0, 0, 1), "num_replica_groups"),
        ((2, 2, 0, 1), "replica_rank"),
        ((-1, 2, 0, 1), "replica_rank"),
        ((0, 2, 3, 3), "group_rank"),
        ((0, 2, 0, 0), "num_replicas"),
        ((0.5, 2, 0, 1), "replica_rank"),
    ],
)
def test_bad_arguments_raise(args: tuple[object, ...], match: str) -> None:
    """Out-of-range or non-integer arguments are rejected with a clear message."""
    with pytest.raises(ValueError, match=match):
        DistributedSampler(_dataset(4), *args)  # type: ignore[arg-type]


def test_rank_kwargs_are_rejected() -> None:
    """rank/num_replicas are derived, so passing torch's own kwargs is an error."""
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(_dataset(4), 0, 1, 0, 1, rank=0)
