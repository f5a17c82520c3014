"""The Manager's side of durable snapshots (:mod:`torchft.snapshot`): which group writes
which step, when it takes the state, and the choice of a snapshot to resume from that every
rank of a group shares.

The Manager drives it from its step protocol and keeps only what touches its own state:
applying a loaded snapshot after the vote of the step that loaded it.
"""

from __future__ import annotations

import logging
import math
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
#: The choice published when no snapshot is restored ("" cannot be: the store's
#: compare-and-set takes an empty expected value to mean "absent").
_NO_CHOICE = "-"
#: A rank's record of whether it loaded its part of the chosen snapshot.
_LOADED, _NOT_LOADED = "1", "0"

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
        # Snapshot paths this process will not choose again (see refuse).
        self._refused: set[str] = set()

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

        The choice is the first value written under the quorum's key: group rank 0's, or
        "none" from a rank of a trained group that waited ``connect_timeout`` in vain (rank
        0 never got this answer: its request timed out). While rank 0 reads the snapshot's
        files to verify them it says so in the store, and the wait goes on as long as it
        does. Either way every rank acts on the same value. In a group of several ranks
        each rank then records whether it loaded its part, and the first rank to judge
        those records writes the group's verdict (:meth:`agreed`). A snapshot that failed
        to load or to be agreed on is not chosen again by this process.

        Raises:
            Exception: the choice or the load failed (a rank of a group of several ranks
                records the failure first, so no rank applies the snapshot).
        """
        key = self._choice_key(quorum_id)
        shared = self._world > 1
        if self._rank == 0:
            decided = self._store.get(key).decode() if shared and self._store.check([key]) else None
            if decided is None:
                try:
                    chosen = self._choose(
                        max_step, own_step, user_keys, startup, self._beat(key) if shared else None
                    )
                except BaseException:
                    if shared:
                        self._store.compare_set(key, "", _NO_CHOICE)
                    raise
                value = str(chosen.path) if chosen is not None else _NO_CHOICE
                decided = self._store.compare_set(key, "", value).decode() if shared else value
        else:
            decided = self._wait_for_choice(key, give_up=not startup)
        if decided == _NO_CHOICE:
            return None
        try:
            matches = [s for s in list_snapshots(self.writer.directory) if str(s.path) == decided]
            if not matches:
                raise SnapshotError(f"snapshot {decided} chosen by group rank 0 is gone")
            chosen = matches[0]
            t0 = time.perf_counter()
            state = load_rank(chosen, self._rank, template=template())
        except BaseException:
            self.refuse(decided)
            if shared:
                self._store.set(f"{key}/loaded/{self._rank}", _NOT_LOADED)
            raise
        if shared:
            self._store.set(f"{key}/loaded/{self._rank}", _LOADED)
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

    def agreed(self, quorum_id: int) -> bool:
        """Whether the group applies the snapshot chosen under ``quorum_id`` (always, for a
        group of one rank): the group's verdict, written once by the first rank to judge.

        Every rank records whether it loaded its part before the step's vote. A rank judges
        "apply" when every record says loaded, "refuse" as soon as one says not (the
        snapshot is then refused: :meth:`refuse`), and "abort" when a record is still
        missing after ``connect_timeout`` (logged meanwhile: a rank that never got this
        answer); the first verdict written is every rank's, so a slow rank whose part came
        in after another judged does not apply it alone."""
        if self._world == 1:
            return True
        key = self._choice_key(quorum_id)
        verdict, loaded = f"{key}/verdict", [f"{key}/loaded/{r}" for r in range(self._world)]
        deadline = time.monotonic() + self._connect_timeout.total_seconds()
        told = time.monotonic() + 2.0
        pause = 0.002
        while not self._store.check([verdict]):
            seen = [self._store.get(k) for k in loaded if self._store.check([k])]
            now = time.monotonic()
            if any(v != _LOADED.encode() for v in seen):
                self._store.compare_set(verdict, "", "refuse")
            elif now >= deadline:
                self._store.compare_set(verdict, "", "abort")
            elif len(seen) == len(loaded):
                self._store.compare_set(verdict, "", "apply")
            else:
                if now >= told:
                    self._log_info(
                        "waiting for every rank of the group to load its part of the snapshot "
                        "(%d of %d; gives up in %.0fs)",
                        len(seen),
                        len(loaded),
                        deadline - now,
                    )
                    told = now + _WAIT_LOG_S
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
        judged = self._store.get(verdict)
        if judged == b"refuse":
            self.refuse(self._store.get(key).decode())
        return bool(judged == b"apply")

    def refuse(self, path: str) -> None:
        """Never chooses the snapshot at ``path`` again in this process (it failed to load
        here, or on another rank of the group): choosing it at every later quorum would fail
        every step the same way."""
        self._refused.add(path)

    def _choice_key(self, quorum_id: int) -> str:
        return f"torchft/snapshot/{self._replica_id}/{quorum_id}"

    def _beat(self, key: str) -> Callable[[], None]:
        """Says in the store, at most every second while called, that group rank 0 is
        choosing under ``key`` (see :meth:`_wait_for_choice`)."""
        marker, last = f"{key}/choosing", [-math.inf]

        def beat() -> None:
            now = time.monotonic()
            if now - last[0] >= 1.0:
                last[0] = now
                self._store.add(marker, 1)

        return beat

    def _choose(
        self,
        max_step: int,
        own_step: int,
        user_keys: set[str],
        startup: bool,
        progress: Callable[[], None] | None,
    ) -> Snapshot | None:
        """Group rank 0's choice: the newest usable snapshot past every member (two steps
        past, for a trained group) that this process has not refused, checksums verified."""
        live = max(max_step, own_step)
        floor = live if startup else live + 1
        newest = [
            s for s in list_snapshots(self.writer.directory) if str(s.path) not in self._refused
        ]
        if not newest or newest[0].step <= floor:
            return None
        self._log_info(
            "no live replica group is past step %d; newest snapshot is step %d: checking it",
            live,
            newest[0].step,
        )
        if progress is not None:
            progress()  # the other ranks now wait as long as the check takes
        return choose_restore(newest, floor, self._world, user_keys, progress)

    def _wait_for_choice(self, key: str, give_up: bool) -> str:
        """Group rank 0's snapshot choice for this quorum. The wait is logged, and bounded
        by ``connect_timeout`` from the last sign of rank 0 choosing (it may be verifying a
        large snapshot: it says so every second). At the bound a trained group's rank
        (``give_up``) publishes "none" itself and takes whichever value is first; a rank in
        its start-up state raises (its restart loses nothing)."""
        marker = f"{key}/choosing"
        bound = self._connect_timeout.total_seconds()
        deadline = time.monotonic() + bound
        told = time.monotonic() + 2.0
        pause = 0.002  # rank 0 usually answers within milliseconds: poll fast, then back off
        beats = 0
        while not self._store.check([key]):
            now = time.monotonic()
            seen = self._store.add(marker, 0)  # reads the count (adds nothing)
            if seen != beats:
                beats, deadline = seen, now + bound
            if now >= deadline:
                break
            if now >= told:
                self._log_info(
                    "waiting for group rank 0 to choose a durable snapshot (%s; gives up in %.0fs)",
                    "it is checking one" if beats else "no sign of it yet",
                    deadline - now,
                )
                told = now + _WAIT_LOG_S
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        else:
            return self._store.get(key).decode()
        if give_up:
            decided = self._store.compare_set(key, "", _NO_CHOICE).decode()
            logger.warning(
                "group rank 0 published no snapshot choice within %s; this rank published "
                "none, and the group goes on with %s",
                self._connect_timeout,
                "none" if decided == _NO_CHOICE else decided,
            )
            return decided
        raise TimeoutError(f"group rank 0 did not choose a snapshot within {self._connect_timeout}")

    def shutdown(self, wait: bool) -> None:
        """Lets a write in flight finish (``wait``; a snapshot is worth the wait)."""
        self.writer.shutdown(wait=wait)
