"""Tests of the replica-group-aware DistributedSampler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchft.data import DistributedSampler, StepAlignedLoader


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


# ----------------------------------------------------------------------------- StepAlignedLoader


class _Steps:
    """A stand-in for the Manager: only the committed step matters to the data stream."""

    def __init__(self) -> None:
        self.step = 0

    def current_step(self) -> int:
        return self.step


def _shard_batches(
    n: int, groups: int, replica_rank: int, batch: int, epoch: int
) -> list[list[int]]:
    """The batches of one group's shard in one epoch, computed independently of the loader."""
    sampler = DistributedSampler(
        _dataset(n), replica_rank, groups, 0, 1, shuffle=True, seed=3, drop_last=True
    )
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [ids[i : i + batch] for i in range(0, len(ids) - batch + 1, batch)]


def _expected(step: int, n: int = 40, groups: int = 2, rank: int = 1, batch: int = 4) -> list[int]:
    per_epoch = (n // groups) // batch
    epoch, offset = divmod(step, per_epoch)
    return _shard_batches(n, groups, rank, batch, epoch)[offset]


def _loader(kind: str, num_workers: int = 0) -> Any:
    sampler = DistributedSampler(_dataset(40), 1, 2, 0, 1, shuffle=True, seed=3, drop_last=True)
    if kind == "stateful":
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        return stateful.StatefulDataLoader(
            _dataset(40), batch_size=4, sampler=sampler, drop_last=True, num_workers=num_workers
        )
    return DataLoader(
        _dataset(40), batch_size=4, sampler=sampler, drop_last=True, num_workers=num_workers
    )


@pytest.mark.parametrize(
    ("kind", "workers"), [("torch", 0), ("torch", 2), ("stateful", 0), ("stateful", 2)]
)
def test_step_aligned_loader_follows_the_committed_step(kind: str, workers: int) -> None:
    """Batch s of the shard for step s: retries repeat it, heals and restarts jump to it,
    epochs wrap; with prefetching workers too."""
    steps = _Steps()
    stream = StepAlignedLoader(_loader(kind, workers), steps)
    assert stream.batches_per_epoch == 5
    # Commits 0..6 (across the epoch boundary at 5), a failed attempt of step 7 retried,
    # a heal to step 23, then a jump back (a stream that cannot continue is rebuilt).
    sequence = [0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 23, 24, 25, 3]
    for step in sequence:
        steps.step = step
        (ids,) = next(stream)
        assert ids.tolist() == _expected(step), f"step {step}"
        assert stream.position == step


def test_restarted_stream_resumes_at_the_healed_step() -> None:
    """A fresh process (new loader, new stream) whose Manager healed to step 12 reads batch
    12 first, never batch 0."""
    steps = _Steps()
    steps.step = 12
    stream = StepAlignedLoader(_loader("torch"), steps)
    (ids,) = next(stream)
    assert ids.tolist() == _expected(12)
    steps.step = 13
    (ids,) = next(stream)
    assert ids.tolist() == _expected(13)


class _Votes:
    """A one-group Manager: the step advances on a commit, failed votes count in a row."""

    def __init__(self, failing_votes: frozenset[int] = frozenset()) -> None:
        self.step = 0
        self.failures = 0
        self.votes = 0
        self.failing_votes = failing_votes

    def current_step(self) -> int:
        return self.step

    def commit_failures(self) -> int:
        return self.failures

    def should_commit(self) -> bool:
        self.votes += 1
        if self.votes in self.failing_votes:
            self.failures += 1
            return False
        self.step += 1
        self.failures = 0
        return True

    # What LocalSGD needs besides: one group alone, so allreduce is the identity.
    def start_quorum(self) -> None: ...

    def allreduce(self, t: torch.Tensor, **kw: Any) -> Any:
        from torchft.work import _DummyWork

        return _DummyWork(t)

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None: ...
    def allow_state_dict_read(self) -> None: ...
    def disallow_state_dict_read(self) -> None: ...


def test_a_retried_step_repeats_its_batch_but_a_second_draw_is_an_error() -> None:
    """With the Manager's vote count, a batch drawn again after a failed commit is the same
    batch, while a second batch drawn in one attempt (no vote in between) is refused rather
    than silently repeated."""
    manager = _Votes(failing_votes=frozenset({2}))
    stream = StepAlignedLoader(_loader("torch"), manager)
    seen = []
    for _ in range(4):
        (ids,) = next(stream)
        seen.append(ids.tolist())
        manager.should_commit()
    # Votes: commit (step 1), fail, commit (step 2), commit (step 3).
    assert seen == [_expected(0), _expected(1), _expected(1), _expected(2)]
    (ids,) = next(stream)
    assert ids.tolist() == _expected(3)
    with pytest.raises(RuntimeError, match="batches_per_commit=sync_every"):
        next(stream)


@pytest.mark.parametrize("failing_vote", [None, 2])
def test_local_sgd_reads_sync_every_batches_per_commit(failing_vote: int | None) -> None:
    """LocalSGD commits once every sync_every inner steps: with batches_per_commit=sync_every
    every inner step gets its own batch, in order, and a sync that does not commit is
    retried with the same batches."""
    from torchft.local_sgd import LocalSGD

    sync_every = 3
    manager = _Votes(frozenset() if failing_vote is None else frozenset({failing_vote}))
    stream = StepAlignedLoader(_loader("torch"), manager, batches_per_commit=sync_every)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 2)
    seen = []
    with LocalSGD(manager, model, optimizer, sync_every=sync_every):  # type: ignore[arg-type]
        for _ in range(4 * sync_every):
            (ids,) = next(stream)
            seen.append(ids.tolist())
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
    assert manager.votes == 4
    if failing_vote is None:
        positions = list(range(12))
    else:
        # The second sync (after batches 3..5 of step 1) fails: step 1 is retried.
        positions = [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    assert seen == [_expected(p) for p in positions]
    assert stream.position == positions[-1]


def test_local_sgd_with_one_batch_per_commit_is_refused() -> None:
    """The mistake this guards against: under LocalSGD the step only advances every
    sync_every inner steps, so one batch per commit would hand the same batch to every inner
    step. The second inner step's draw raises, naming the fix."""
    from torchft.local_sgd import LocalSGD

    manager = _Votes()
    stream = StepAlignedLoader(_loader("torch"), manager)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(manager, model, optimizer, sync_every=3):  # type: ignore[arg-type]
        next(stream)
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        with pytest.raises(RuntimeError, match="LocalSGD or DiLoCo"):
            next(stream)


class _Flaky(torch.utils.data.Dataset[tuple[torch.Tensor]]):
    """The ids 0..n-1, whose read of ``bad`` fails once (a transient storage error)."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad: int | None = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        if i == self.bad:
            self.bad = None
            raise OSError(f"transient read error at {i}")
        return (torch.tensor(i),)


def test_a_failed_read_does_not_skip_the_batch() -> None:
    """The loader raised mid-batch (its iterator has consumed the batch): the next draw of
    the same step gets that step's batch, not the one after it."""
    steps = _Steps()
    bad = _expected(2)[1]
    dataset = _Flaky(40, bad)
    sampler = DistributedSampler(dataset, 1, 2, 0, 1, shuffle=True, seed=3, drop_last=True)
    stream = StepAlignedLoader(
        DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True), steps
    )
    for step in (0, 1):
        steps.step = step
        (ids,) = next(stream)
        assert ids.tolist() == _expected(step)
    steps.step = 2
    with pytest.raises(OSError, match="transient"):
        next(stream)
    (ids,) = next(stream)
    assert ids.tolist() == _expected(2)
    steps.step = 3
    (ids,) = next(stream)
    assert ids.tolist() == _expected(3)


def test_batches_per_commit_is_checked() -> None:
    """batches_per_commit must be a positive int."""
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batches_per_commit"):
            StepAlignedLoader(_loader("torch"), _Steps(), batches_per_commit=bad)  # type: ignore[arg-type]


def test_step_aligned_loader_rejects_what_it_cannot_position() -> None:
    """A loader without a torchft DistributedSampler or batch size, or too small a shard,
    is refused with a clear message."""
    steps = _Steps()
    with pytest.raises(ValueError, match="DistributedSampler"):
        StepAlignedLoader(DataLoader(_dataset(8), batch_size=2), steps)
    sampler = DistributedSampler(_dataset(8), 0, 1, 0, 1)
    with pytest.raises(ValueError, match="batch_size"):
        StepAlignedLoader(DataLoader(_dataset(8), batch_size=None, sampler=sampler), steps)
    with pytest.raises(ValueError, match="no complete batch"):
        StepAlignedLoader(
            DataLoader(_dataset(8), batch_size=16, sampler=sampler, drop_last=True), steps
        )
    with pytest.raises(ValueError, match="start index"):
        sampler.set_start(9)
