"""Data sharding across replica groups, and a data stream that follows the committed step.

Each replica group is a torchrun job with its own ``RANK``/``WORLD_SIZE``; data must be split
across every rank of every replica group. ``DistributedSampler`` maps (replica group, group
rank) to one global rank so that no two ranks read the same samples.

:class:`StepAlignedLoader` makes each rank read, for committed step ``s``, batch ``s`` of its
own shard (epoch ``s // batches_per_epoch``): a step that did not commit is retried with the
same batch, and a group that healed or restarted continues its shard at the step it healed
to — no batch of its shard is used twice and none is skipped while it trains.

Why the position is derived from the step rather than carried in the healed state: a healing
group receives another group's state, and that group's loader position describes *its* shard,
not the healer's; a restarted group has no saved position for the steps committed while it
was away. The committed step is the one number every group agrees on after a heal (it is part
of the healed state), so ``position = step`` needs no extra bytes on the wire and works with
any loader that re-reads its sampler when iterated again — ``torch.utils.data.DataLoader`` and
torchdata's ``StatefulDataLoader`` alike (the latter's own ``state_dict`` is not needed).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from torch.utils import data

from torchft.config import env_value

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["DistributedSampler", "StepAlignedLoader"]


def _env_int(name: str) -> int:
    value = env_value(name)
    if value is None:
        raise ValueError(f"{name} is not set; pass the value explicitly")
    return int(value)


class DistributedSampler(data.distributed.DistributedSampler[int]):
    """A ``torch.utils.data.DistributedSampler`` sharded over replica groups and group ranks.

    The global rank is ``group_rank + num_replicas * replica_rank`` and the global world size
    is ``num_replicas * num_replica_groups``. Replica group membership is expected to stay
    fixed for the sampler's lifetime (a restarted group reuses its ``replica_rank``), so
    samples are not reshuffled when a group is briefly missing.
    """

    def __init__(
        self,
        dataset: data.Dataset[Any],
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Creates the sampler.

        Args:
            dataset: the dataset to sample from.
            replica_rank: index of this replica group, in ``[0, num_replica_groups)``.
            num_replica_groups: number of replica groups.
            group_rank: rank inside the replica group (default: env ``RANK``).
            num_replicas: ranks per replica group (default: env ``WORLD_SIZE``).
            **kwargs: passed to ``torch.utils.data.DistributedSampler`` (shuffle, seed,
                drop_last).

        Raises:
            ValueError: an argument is out of range or an env default is missing/invalid.
        """
        if group_rank is None:
            group_rank = _env_int("RANK")
        if num_replicas is None:
            num_replicas = _env_int("WORLD_SIZE")
        for name, value in (
            ("replica_rank", replica_rank),
            ("num_replica_groups", num_replica_groups),
            ("group_rank", group_rank),
            ("num_replicas", num_replicas),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if num_replica_groups < 1:
            raise ValueError(f"num_replica_groups must be >= 1, got {num_replica_groups}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(
                f"replica_rank must be in [0, {num_replica_groups}), got {replica_rank}"
            )
        if not 0 <= group_rank < num_replicas:
            raise ValueError(f"group_rank must be in [0, {num_replicas}), got {group_rank}")
        for reserved in ("rank", "num_replicas"):
            if reserved in kwargs:
                raise ValueError(f"{reserved!r} is computed from the replica arguments")

        self.replica_rank = replica_rank
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.num_replicas_per_group = num_replicas
        global_rank = group_rank + num_replicas * replica_rank
        global_world = num_replicas * num_replica_groups
        super().__init__(dataset, num_replicas=global_world, rank=global_rank, **kwargs)
        self.global_rank = global_rank
        self.global_world_size = global_world
        self._start = 0

    def set_start(self, index: int) -> None:
        """Makes the next iterations begin at sample ``index`` of this epoch's shard.

        Args:
            index: samples of the shard to skip, in ``[0, num_samples]``.

        Raises:
            ValueError: ``index`` is out of range.
        """
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"start index must be an int, got {index!r}")
        if not 0 <= index <= self.num_samples:
            raise ValueError(f"start index must be in [0, {self.num_samples}], got {index}")
        self._start = index

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(super().__iter__(), self._start, None)

    def __len__(self) -> int:
        return self.num_samples - self._start


class _Stepper(Protocol):
    def current_step(self) -> int: ...


class StepAlignedLoader:
    """Yields, for committed step ``s``, batch ``s`` of this rank's shard (see module docs).

    Wraps a loader (``torch.utils.data.DataLoader`` or torchdata's ``StatefulDataLoader``)
    whose sampler is a :class:`DistributedSampler`. Each ``next()`` reads the Manager's
    committed step; when it is the one after the previous batch's, the loader's iterator
    simply continues (prefetching stays useful); otherwise — a step that did not commit is
    retried, or the group healed or restarted at another step — the sampler is positioned at
    that step's epoch and offset and the loader is iterated afresh. The stream is endless:
    epochs follow from the step (``set_epoch(step // batches_per_epoch)``), so stop on the
    step, not on the data.

    Draw the batch after ``optimizer.zero_grad()`` (which starts the quorum): in synchronous
    quorum mode a healing group has then already healed and trains this step with the batch
    of the step it healed to. In asynchronous mode a healing group sits the healing step out
    either way (its batch of that step is not trained, as for any group that is down).

    One batch per commit by default: with gradient accumulation, make the batch larger
    instead. With :class:`~torchft.local_sgd.LocalSGD` or
    :class:`~torchft.local_sgd.DiLoCo`, which commit once every ``sync_every`` inner steps,
    pass ``batches_per_commit=sync_every`` (streaming DiLoCo with ``n`` fragments commits
    every ``sync_every // n`` inner steps): the ``k``-th batch drawn at step ``s`` is then
    batch ``s * batches_per_commit + k``, and a sync that does not commit is retried with the
    same batches. Drawing more batches than that in one attempt at a step (without a commit
    vote in between) is an error rather than a silently repeated batch.
    """

    def __init__(
        self, loader: Iterable[Any], manager: _Stepper, batches_per_commit: int = 1
    ) -> None:
        """Wraps ``loader``.

        Args:
            loader: a loader with ``batch_size``, ``drop_last`` and a ``sampler`` that is a
                :class:`DistributedSampler` (``DataLoader(ds, batch_size=B, sampler=s)``).
            manager: the :class:`~torchft.Manager` (anything with ``current_step()``; with
                ``commit_failures()`` too, as the Manager has, a batch drawn too often in one
                attempt is detected).
            batches_per_commit: batches drawn per committed step (>= 1): 1 for a commit
                every step, ``sync_every`` for LocalSGD and DiLoCo.

        Raises:
            ValueError: the loader has no batch size or its sampler is not a
                :class:`DistributedSampler`, the shard holds no complete batch, or
                ``batches_per_commit`` is not a positive int.
        """
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, DistributedSampler):
            raise ValueError(
                "StepAlignedLoader needs a loader whose sampler is torchft.data."
                f"DistributedSampler, got {type(sampler).__name__}"
            )
        batch_size = getattr(loader, "batch_size", None)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"the loader needs a batch_size >= 1, got {batch_size!r}")
        if (
            isinstance(batches_per_commit, bool)
            or not isinstance(batches_per_commit, int)
            or batches_per_commit < 1
        ):
            raise ValueError(f"batches_per_commit must be an int >= 1, got {batches_per_commit!r}")
        drop_last = bool(getattr(loader, "drop_last", False))
        samples = sampler.num_samples
        per_epoch = samples // batch_size if drop_last else math.ceil(samples / batch_size)
        if per_epoch < 1:
            raise ValueError(
                f"the shard of {samples} samples holds no complete batch of {batch_size}"
            )
        self._loader = loader
        self._sampler = sampler
        self._manager = manager
        failures = getattr(manager, "commit_failures", None)
        self._failures: Callable[[], int] | None = failures if callable(failures) else None
        self.batch_size = batch_size
        self.batches_per_commit = batches_per_commit
        #: Batches of this rank's shard per epoch.
        self.batches_per_epoch = per_epoch
        self._it: Iterator[Any] | None = None
        self._next_position = -1
        # The attempt of the last batch returned — (step, consecutive failed commits), which
        # changes with every commit vote — and how many batches were drawn in it.
        self._attempt: tuple[int, int | None] | None = None
        self._drawn = 0
        #: The stream position of the last batch returned (-1 before the first):
        #: ``step * batches_per_commit + k`` for the ``k``-th batch of a step.
        self.position = -1

    def __iter__(self) -> StepAlignedLoader:
        return self

    def _restart_at(self, position: int) -> None:
        epoch, offset = divmod(position, self.batches_per_epoch)
        self._sampler.set_epoch(epoch)
        self._sampler.set_start(offset * self.batch_size)
        self._it = iter(self._loader)
        self._next_position = position

    def _draw(self, position: int) -> Any:
        if self._it is None or position != self._next_position:
            if self._it is not None:
                logger.info(
                    "data stream repositioned to batch %d (expected %d)",
                    position,
                    self._next_position,
                )
            self._restart_at(position)
        assert self._it is not None
        try:
            try:
                return next(self._it)
            except StopIteration:
                # The epoch ended exactly here: the next epoch begins at this position.
                self._restart_at(position)
                return next(self._it)
        except BaseException:
            # The iterator may have consumed the batch: the next call repositions afresh, so
            # a retry gets this position's batch rather than the one after it.
            self._it = None
            raise

    def __next__(self) -> Any:
        """The next batch of the Manager's current committed step."""
        step = self._manager.current_step()
        if step < 0:
            raise ValueError(f"the manager's step must not be negative, got {step}")
        failures = self._failures() if self._failures is not None else None
        attempt = (step, failures)
        drawn = self._drawn if attempt == self._attempt else 0
        if drawn >= self.batches_per_commit:
            if failures is not None:
                raise RuntimeError(
                    f"StepAlignedLoader: batch {drawn + 1} drawn at step {step} with no commit "
                    f"vote since the first, but batches_per_commit={self.batches_per_commit}. "
                    "The manager's step advances once per commit: with LocalSGD or DiLoCo "
                    "(one commit every sync_every inner steps) pass "
                    "batches_per_commit=sync_every (streaming DiLoCo: sync_every // number of "
                    "fragments); otherwise draw one batch per optimizer step (for gradient "
                    "accumulation make the batch larger)"
                )
            # Without the manager's vote count a repeat at the same step is a retry.
            drawn = 0
        position = step * self.batches_per_commit + drawn
        batch = self._draw(position)
        self._next_position = position + 1
        self._attempt = attempt
        self._drawn = drawn + 1
        self.position = position
        return batch
