"""Data sharding across replica groups.

Each replica group is a torchrun job with its own ``RANK``/``WORLD_SIZE``; data must be split
across every rank of every replica group. ``DistributedSampler`` maps (replica group, group
rank) to one global rank so that no two ranks read the same samples.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils import data

from torchft.config import env_value

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["DistributedSampler"]


def _env_int(name: str) -> int:
    value = env_value(name)
    if value is None:
        raise ValueError(f"{name} is not set; pass the value explicitly")
    return int(value)


class DistributedSampler(data.distributed.DistributedSampler):
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
