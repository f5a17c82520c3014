"""The Manager's side of durable snapshots (:mod:`torchft.snapshot`): which group writes
which step, when it takes the state, and the choice of a snapshot to resume from that every
rank of a group shares.

The Manager drives it from its step protocol and keeps only what touches its own state:
applying a loaded snapshot after the vote of the step that loaded it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchft.snapshot import (
    Snapshot,
    SnapshotError,
    SnapshotResult,
    SnapshotWriter,
    choose_restore,
    list_snapshots,
    load_rank,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from torchft.config import ManagerConfig
    from torchft.telemetry import RankTelemetry

logger: logging.Logger = logging.getLogger(__name__)

#: How long the snapshot writer waits for the lighthouse to receive a snapshot's report.
SNAPSHOT_FLUSH_S = 1.0

#: How often a rank waiting for group rank 0's choice says so.
_WAIT_LOG_S = 10.0

#: Ends the error of a snapshot refused because the parity check found its group's state
#: diverged (in its ``snapshot_failed`` event too).
DIVERGED_SNAPSHOT = "a diverged state never becomes a snapshot"


def parity_confirmation(
    verdicts: Callable[[], tuple[bool, int, int]], parity_on: Callable[[], bool]
) -> Callable[[int], str | None]:
    """What group rank 0 asks before making the snapshot of a step complete: the state of
    that step must have been compared by the runtime state parity check (at that step or a
    later one) and found agreeing, and not found differing since.

    Args:
        verdicts: the manager server's ``parity_verdicts()``: whether the lighthouse checks
            parity, the newest step it found this group agreeing at, and the newest it found
            it differing at.
        parity_on: whether this rank digests its state (parity may be turned off later, as
            Local SGD does).

    The returned callable gives a note for the manifest, None while the check is pending,
    and raises :class:`SnapshotError` when the state was found diverged.
    """

    def confirm(step: int) -> str | None:
        if not parity_on():
            return "off"
        checked, ok, diverged = verdicts()
        if not checked:
            return "unchecked: the lighthouse does not check parity"
        if diverged >= step:
            raise SnapshotError(
                f"the parity check found this group's state different from the other groups' "
                f"at step {diverged}, at or after the snapshot's step {step}: "
                f"{DIVERGED_SNAPSHOT}"
            )
        if ok >= step:
            return f"confirmed by the parity check of step {ok}"
        return None

    return confirm


class GroupSnapshots:
    """One rank's durable snapshots within its replica group.

    Args:
        cfg: the Manager's settings: the snapshot directory (shared by every group of the
            job), the interval and the number kept, this rank and the group's size, how long
            group rank 0 waits for the other ranks' parts of a snapshot (``timeout``) and the
            bound on waiting for group rank 0's choice (``connect_timeout``).
        name: the group's stable name (recorded in manifests).
        replica_id: the group's id for this start (the same on every rank of the group).
        store: the group's store, through which group rank 0 shares its choice.
        telemetry: reports complete and failed snapshots (None: not reported).
        log_info: the Manager's log (its records carry the group and step).
        confirm: on group rank 0, what the writer asks before making a written snapshot
            complete (see :func:`parity_confirmation`); None: complete at once.

    Raises:
        ValueError: ``cfg`` has no snapshot directory.
    """

    def __init__(
        self,
        cfg: ManagerConfig,
        name: str,
        replica_id: str,
        store: TCPStore,
        telemetry: RankTelemetry | None,
        log_info: Callable[..., None],
        confirm: Callable[[int], str | None] | None = None,
    ) -> None:
        if cfg.snapshot_dir is None:
            raise ValueError("durable snapshots need a snapshot directory")
        self.writer = SnapshotWriter(
            cfg.snapshot_dir,
            every=cfg.snapshot_every,
            keep=cfg.snapshot_keep,
            replica_id=name,
            incarnation=replica_id,
            group_rank=cfg.rank,
            group_world_size=cfg.world_size,
            timeout=cfg.timeout.total_seconds(),
            on_done=self._written,
            confirm=confirm,
        )
        self._store = store
        self._replica_id = replica_id
        self._rank = cfg.rank
        self._world = cfg.world_size
        self._connect_timeout = cfg.connect_timeout
        self._telemetry = telemetry
        self._log_info = log_info
        # The (step, quorum id) this group writes at the top of its next step.
        self._due: tuple[int, int] | None = None
        self._quorum_id = 0

    # ------------------------------------------------------------------ writing

    def committed(
        self, step: int, quorum_id: int, participating_rank: int | None, participants: int
    ) -> None:
        """After a commit of ``step``: this group writes it when it is a snapshot step and
        this group's turn. Every group committed the step under the same quorum, so exactly
        one of them is chosen, a different one at each snapshot step."""
        w = self.writer
        if (
            w.due(step)
            and participating_rank is not None
            and participating_rank == w.writer_rank(step, participants)
        ):
            self._due = (step, quorum_id)

    def at_step_start(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """At the top of a step (the optimizer has applied the commit: the state is the
        step's committed state, the one a heal would send): takes the snapshot this group
        owes, if any. Only the state's structure is taken on this thread."""
        due, self._due = self._due, None
        if due is None or due[0] != step:
            return
        self._quorum_id = due[1]
        try:
            self.writer.save(due[0], due[1], state())
        except Exception:
            logger.exception("snapshot of step %d not taken", due[0])

    def settle(self) -> None:
        """Waits for the copy of the state in flight (before anything writes the state)."""
        self.writer.settle()

    def _written(self, result: SnapshotResult) -> None:
        """Reports a snapshot write (on the writer thread; never raises)."""
        tel = self._telemetry
        if tel is None:
            return
        if result.error is not None:
            tel.snapshot_failed(result.step, str(result.path), result.error)
        elif result.complete:
            tel.snapshot_done(
                result.step,
                str(result.path),
                stage_s=result.stage_s,
                write_s=result.write_s,
                tensor_bytes=result.tensor_bytes,
                quorum_id=self._quorum_id,
            )
        # On the writer thread: the lighthouse learns of the snapshot now, not with the
        # next batch (a total loss may come first).
        tel.flush(SNAPSHOT_FLUSH_S)

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        quorum_id: int,
        max_step: int,
        own_step: int,
        user_keys: set[str],
        template: Callable[[], dict[str, Any]],
        startup: bool = True,
    ) -> tuple[Snapshot, dict[str, Any]] | None:
        """The newest usable snapshot newer than every live group's state and this rank's
        own, loaded (this rank's part), or None.

        Call at a quorum answer before anything of it is acted on, at the same answers on
        every rank of the group (see :meth:`torchft.healing.Healer.restore`). Group rank 0
        chooses (and verifies) the snapshot and publishes the choice in the group's store
        under the quorum's id, so every rank loads its part of the same one. A group that
        no longer holds its start-up state (``startup`` False) takes only a snapshot at
        least two steps ahead: the step that loads it does not commit, so one step ahead
        would gain nothing.

        Raises:
            Exception: the choice or the load failed; the group's ranks may now disagree.
        """
        directory = self.writer.directory
        key = f"torchft/snapshot/{self._replica_id}/{quorum_id}"
        shared = self._world > 1
        chosen: Snapshot | None = None
        if self._rank == 0 and not (shared and self._store.check([key])):
            live = max(max_step, own_step)
            floor = live if startup else live + 1
            newest = list_snapshots(directory)
            if newest and newest[0].step > floor:
                self._log_info(
                    "no live replica group is past step %d; newest snapshot is step %d: "
                    "checking it",
                    live,
                    newest[0].step,
                )
                chosen = choose_restore(newest, floor, self._world, user_keys)
            if shared:
                self._store.set(key, str(chosen.path) if chosen is not None else "")
        else:
            choice = self._wait_for_choice(key)
            if choice:
                matches = [s for s in list_snapshots(directory) if str(s.path) == choice]
                if not matches:
                    raise SnapshotError(f"snapshot {choice} chosen by group rank 0 is gone")
                chosen = matches[0]
        if chosen is None:
            return None
        t0 = time.perf_counter()
        state = load_rank(chosen, self._rank, template=template())
        self._log_info(
            "loaded snapshot of step %d from %s in %.3fs (live replica groups are at step "
            "%d); this step does not commit, the next one trains from step %d",
            chosen.step,
            chosen.path,
            time.perf_counter() - t0,
            max_step,
            chosen.step,
        )
        return chosen, state

    def _wait_for_choice(self, key: str) -> str:
        """Group rank 0's snapshot choice for this quorum (it may be verifying a large
        snapshot: the wait is logged, and bounded by ``connect_timeout``)."""
        deadline = time.monotonic() + self._connect_timeout.total_seconds()
        told = time.monotonic() + 2.0
        pause = 0.002  # rank 0 usually answers within milliseconds: poll fast, then back off
        while not self._store.check([key]):
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"group rank 0 did not choose a snapshot within {self._connect_timeout}"
                )
            if now >= told:
                self._log_info(
                    "waiting for group rank 0 to choose a durable snapshot (gives up in %.0fs)",
                    deadline - now,
                )
                told = now + _WAIT_LOG_S
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        choice: bytes = self._store.get(key)
        return choice.decode()

    def shutdown(self, wait: bool) -> None:
        """Lets a write in flight finish (``wait``; a snapshot is worth the wait)."""
        self.writer.shutdown(wait=wait)
