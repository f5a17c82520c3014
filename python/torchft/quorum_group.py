"""The cross-replica process group as the quorums drive it, and the answer of an async quorum.

:class:`QuorumGroup` knows which quorum the group is configured for, whether it was aborted,
which members were declared lost in recent quorums and how many of the step's collectives are
in flight. It aborts the group when the lighthouse declares a member lost (failure detection,
docs/process_groups.md) and rebuilds it for a new quorum. :class:`PendingQuorum` is the
quorum of an async step whose request is in flight in the native client.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ReduceOp
from torch.futures import Future

from torchft.config import WorldSizeMode
from torchft.errors import QuorumTimeoutError

if TYPE_CHECKING:
    from torchft.config import ManagerConfig
    from torchft.coordination import (
        NativeManagerClient,
        NativeManagerServer,
        NativePendingQuorum,
        NativeQuorumResult,
    )
    from torchft.telemetry import RankTelemetry

logger: logging.Logger = logging.getLogger(__name__)

#: How many recent quorums' lost members are remembered.
_LOST_QUORUMS_KEPT = 8


class QuorumGroup:
    """The cross-replica process group under the quorums (see module doc).

    ``lock`` orders aborting the group for a lost member with switching to a new quorum and
    with shutting down. The abort completes futures (and runs their callbacks) under it, so
    the count of collectives in flight has a lock of its own.
    """

    def __init__(
        self,
        pg: Any,
        report_error: Callable[[Exception], None],
        on_source_lost: Callable[[str], None],
        describe: Callable[[], str],
    ) -> None:
        """Wraps the group.

        Args:
            pg: the cross-replica process group (``configure``, ``abort``, ``errored``).
            report_error: records an error of the current step.
            on_source_lost: told of every lost member (a heal from it ends).
            describe: ``replica_id/rank step N``, prefixed to log lines.
        """
        self.pg = pg
        self._report_error = report_error
        self._on_source_lost = on_source_lost
        self._describe = describe
        self.lock = threading.Lock()
        #: The quorum the group is configured for (-1: none, or its configure failed).
        self.quorum_id = -1
        #: The group was aborted (a member lost, or this rank skipped a collective).
        self.aborted = False
        #: A quorum request is in flight: the step has not used the group yet.
        self.quorum_in_progress = False
        #: The error an abort for a loss recorded when the step's collectives had all
        #: completed (that abort alone does not fail the step).
        self.loss_abort_error: Exception | None = None
        self.closed = False
        self._lost_in: dict[int, set[str]] = {}
        self._inflight_lock = threading.Lock()
        # The step's collectives not finished yet, each by its backend future (None while it
        # is being issued). A collective whose backend future is done has every member's
        # data even while its callback still waits (for the GIL, say).
        self._in_flight: dict[int, Future[Any] | None] = {}
        self._next_token = 0

    def close(self) -> bool:
        """Stops acting on losses; False when it was closed already."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def error(self) -> Exception | None:
        """The error the group recorded since its configure, if any."""
        pg_errored = getattr(self.pg, "errored", None)
        return pg_errored() if pg_errored is not None else None

    # ------------------------------------------------------------------ collectives

    def _collective_started(self) -> int:
        with self._inflight_lock:
            self._next_token += 1
            self._in_flight[self._next_token] = None
            return self._next_token

    def _collective_issued(self, token: int, backend: Future[Any]) -> None:
        with self._inflight_lock:
            if token in self._in_flight:
                self._in_flight[token] = backend

    def _collective_finished(self, token: int) -> None:
        with self._inflight_lock:
            self._in_flight.pop(token, None)

    def _collectives_done(self) -> bool:
        """Whether every collective of the step has completed in its backend (its data is
        all there), whether or not its callback has run."""
        with self._inflight_lock:
            return all(f is not None and f.done() for f in self._in_flight.values())

    def allreduce(
        self,
        tensor: torch.Tensor,
        reduce_op: ReduceOp.RedOpType,
        participants: int,
        telemetry: RankTelemetry | None,
        server: NativeManagerServer | None,
    ) -> Future[torch.Tensor]:
        """Allreduces ``tensor`` in place on the group; ``ReduceOp.AVG`` is a sum divided by
        ``participants``.

        The returned future never fails: an error of the collective is reported and the
        future resolves to ``tensor`` as it is.

        Raises:
            Exception: the collective could not be issued (nothing is left in flight).
        """
        token = telemetry.collective_started() if telemetry is not None else None
        flight = self._collective_started()
        # A collective in flight is the loop inside torchft (the reducer waits for it inside
        # backward, outside any other torchft call): never "away" for the hang watch. The
        # collective's own timeout (an error, or the group's abort) bounds it.
        if server is not None:
            server.set_loop_busy(True)
        avg = reduce_op == ReduceOp.AVG
        divisor = participants if avg and participants > 0 else 0
        floating = tensor.is_floating_point() or tensor.is_complex()

        # The averaging, the error swallowing and the bookkeeping run in the collective's
        # own completion callback when the group's work allows it (see _FutureWork._fuse),
        # else in one callback chained on it: each GIL hand-off on the backend's thread is a
        # thread wake-up on the step's critical path.
        def settle(value: object, error: BaseException | None) -> tuple[torch.Tensor, None]:
            if telemetry is not None:
                telemetry.collective_finished(token)
            if server is not None:
                server.set_loop_busy(False)
            self._collective_finished(flight)
            if error is not None:
                if isinstance(error, Exception):
                    self._report_error(error)
                    return tensor, None
                raise error
            if divisor:
                if floating:
                    tensor.div_(divisor)
                else:
                    tensor.floor_divide_(divisor)
            return tensor, None

        def finish(f: Future[Any]) -> torch.Tensor:
            try:
                value, error = f.value(), None
            except Exception as e:
                value, error = None, e
            return settle(value, error)[0]

        try:
            work = self.pg.allreduce([tensor], ReduceOp.SUM if avg else reduce_op)
            fuse = getattr(work, "_fuse", None)
            fused = fuse(settle) if fuse is not None else None
            if fused is not None:
                fut: Future[torch.Tensor] = fused[0]
                self._collective_issued(flight, fused[1])
                return fut
            backend = work.get_future()
            self._collective_issued(flight, backend)
            chained: Future[torch.Tensor] = backend.then(finish)
            return chained
        except BaseException:
            if telemetry is not None:
                telemetry.collective_finished(token)  # never started: not in flight
            self._collective_finished(flight)
            if server is not None:
                server.set_loop_busy(False)
            raise

    # ------------------------------------------------------------------ losses

    def was_lost(self, quorum_id: int, replica_id: str) -> bool:
        """Whether ``replica_id`` was declared lost from quorum ``quorum_id``."""
        with self.lock:
            return replica_id in self._lost_in.get(quorum_id, set())

    def on_lost(self, replica_id: str, quorum_id: int, own_id: str) -> None:
        """Aborts the current quorum's process group when one of its members is lost.

        The collectives in flight fail at once instead of at their timeout, and so does any
        the step issues later: the step then does not commit, and the next quorum (without
        the lost group) reconfigures the group. A step whose collectives had all completed
        before the loss (in their backend, even while their callbacks wait) still commits: they hold every member's data, and the lost group may
        itself have committed the step (it finished, or died after its vote), so abandoning
        the step here would leave two states under one step number.

        Args:
            replica_id: the lost replica group.
            quorum_id: the quorum it was lost from (events of older quorums are ignored).
            own_id: this replica group (its own loss is not acted on).
        """
        with self.lock:
            if self.closed or replica_id == own_id:
                return
            self._lost_in.setdefault(quorum_id, set()).add(replica_id)
            while len(self._lost_in) > _LOST_QUORUMS_KEPT:
                del self._lost_in[min(self._lost_in)]
            if quorum_id != self.quorum_id:
                return
            self.aborted = True
            logger.warning(
                "[%s] replica group %s of quorum %d lost; aborting its collectives",
                self._describe(),
                replica_id,
                quorum_id,
            )
            settled = not self.quorum_in_progress and self._collectives_done()
            before = self.error()
            if not self.quorum_in_progress and not settled:
                # The step runs on this quorum with collectives in flight: it must not commit.
                # (While a quorum request is in flight the step has not used the group yet;
                # it is rebuilt instead.)
                self._report_error(
                    RuntimeError(f"replica group {replica_id} of quorum {quorum_id} was lost")
                )
            elif settled and before is not None:
                self._report_error(before)  # the group had failed before the loss
            # Ends a configure in progress too: its rendezvous waits for the lost member. A
            # collective the step issues from now on fails at once (and the step with it).
            self._abort()
            if settled:
                # The abort's own error is no reason to abandon a step whose collectives
                # had all completed (see Manager.should_commit).
                self.loss_abort_error = self.error()
            self._on_source_lost(replica_id)

    def _abort(self) -> None:
        try:
            self.pg.abort()
        except Exception:
            logger.exception("aborting the process group failed")

    def abort_after_skip(self) -> None:
        """This rank skipped collectives of the step (no-ops once errored): peers still
        waiting on them would wait until their timeout, which may outlast this group's next
        quorum. Once its own collectives are done (so none a peer finishes with it is cut
        short), aborting the quorum's group ends their wait now; the next quorum rebuilds it
        (a commit failure changes the quorum id anyway). Socket backends (Gloo) fail the
        peers' collectives at once; an NCCL peer still waits for its own timeout."""
        with self.lock:
            if self.quorum_id >= 0 and not self.aborted:
                self.aborted = True
                self._abort()

    # ------------------------------------------------------------------ a new quorum

    def needs_configure(self, quorum: NativeQuorumResult) -> bool:
        """Adopts ``quorum``'s id; True when the group must be (re)configured for it.

        Raises:
            RuntimeError: a member of the quorum was lost before it was adopted.
        """
        quorum_id = quorum.quorum_id
        with self.lock:
            lost = set(self._lost_in.get(quorum_id, ()))
            known = set(quorum.replica_ids)
            if "" not in known:
                # A full list: only its members' losses count. (From a sparse answer, which
                # names a few members, a loss recorded under this quorum id is a member's.)
                lost = lost & known
            if lost:
                # The answer was issued before a member died: its group can never form (the
                # rendezvous would wait for the dead member until the timeout). The step
                # fails now; the next quorum, without that member, rebuilds the group.
                self.aborted = True
                raise RuntimeError(
                    f"replica group(s) {sorted(lost)} of quorum {quorum_id} were lost "
                    "before this rank adopted it"
                )
            # An aborted group (a member was lost) is rebuilt even if the id did not change.
            if quorum_id == self.quorum_id and not self.aborted:
                return False
            # Mark the new id before configuring: if configure fails the step is errored,
            # and the next quorum must not reuse a half-built group silently.
            self.quorum_id = quorum_id
            self.aborted = False
            self.loss_abort_error = None
            return True

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Configures the group on a fresh store prefix (after :meth:`needs_configure`)."""
        try:
            self.pg.configure(store_addr, replica_id, rank, world_size)
        except Exception:
            self.quorum_id = -1
            raise


@dataclass(frozen=True)
class QuorumCall:
    """The Manager's side of one quorum request: the group the step runs on, what adopts the
    answer (errors recorded, not raised), what records an error of the step, and the
    request's deadline."""

    group: QuorumGroup
    adopt: Callable[[NativeQuorumResult], None]
    report_error: Callable[[Exception], None]
    quorum_timeout: timedelta

    def timed_out(self, e: TimeoutError) -> QuorumTimeoutError:
        """The error of a request that passed its deadline."""
        return QuorumTimeoutError(f"quorum not reached within {self.quorum_timeout}: {e}")


class PendingQuorum:
    """The quorum of an async step whose request is in flight in the native client.

    Quacks like the ``concurrent.futures.Future`` of the worker-thread path (``done``,
    ``result``). The first ``result`` waits for the answer (the request carries the quorum
    deadline) and adopts it: inline when only the step's roles change, on the worker thread
    (bounded by ``result``'s timeout) when the process group must be rebuilt or live state
    moves. Errors follow the synchronous path: the quorum deadline is recorded and raised,
    anything else only recorded.
    """

    def __init__(
        self,
        pending: NativePendingQuorum,
        call: QuorumCall,
        executor: ThreadPoolExecutor,
        allow_heal: bool,
    ) -> None:
        """Wraps a request in flight.

        Args:
            pending: the native request.
            call: the group, what adopts the answer and records errors, the deadline.
            executor: the quorum worker thread.
            allow_heal: whether the step may heal or serve.
        """
        self._pending = pending
        self._call = call
        self._executor = executor
        self._allow_heal = allow_heal
        self._lock = threading.Lock()
        self._outcome: ConcurrentFuture[None] | _Settled | None = None

    def done(self) -> bool:
        """Whether ``result`` would return without waiting for the network."""
        outcome = self._outcome
        if outcome is not None:
            return outcome.done()
        return bool(self._pending.done())

    def settled(self) -> bool:
        """Whether the answer has been adopted (``result`` returns or raises at once)."""
        outcome = self._outcome
        return outcome is not None and outcome.done()

    def result(self, timeout: float | None = None) -> None:
        """Waits for the quorum to be adopted.

        Args:
            timeout: bound (seconds) on the wait for the worker thread, if one is used.

        Raises:
            TimeoutError: the quorum deadline passed.
            concurrent.futures.TimeoutError: the worker thread did not finish in ``timeout``.
        """
        with self._lock:
            if self._outcome is None:
                self._outcome = self._adopt()
            outcome = self._outcome
        outcome.result(timeout=timeout)

    def _adopt(self) -> ConcurrentFuture[None] | _Settled:
        try:
            quorum = self._pending.wait()
        except TimeoutError as e:
            self._call.group.quorum_in_progress = False
            err = self._call.timed_out(e)
            err.__cause__ = e
            self._call.report_error(err)
            return _Settled(err)
        except Exception as e:
            self._call.group.quorum_in_progress = False
            self._call.report_error(e)
            return _SETTLED
        heavy = quorum.quorum_id != self._call.group.quorum_id or (
            self._allow_heal and (bool(quorum.heal) or bool(quorum.recover_dst_replica_ranks))
        )
        if heavy:
            return self._executor.submit(self._adopt_and_settle, quorum)
        self._adopt_and_settle(quorum)
        return _SETTLED

    def _adopt_and_settle(self, quorum: NativeQuorumResult) -> None:
        """Adopts the answer; from then on the step runs on its quorum (see ``on_lost``)."""
        try:
            self._call.adopt(quorum)
        finally:
            self._call.group.quorum_in_progress = False


class _Settled:
    """The outcome of an adoption that ran on the caller's thread: done, and ``result``
    returns (or raises the quorum's deadline) at once. Every steady step's adoption is one,
    so it is lighter than a ``concurrent.futures.Future``."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error


_SETTLED = _Settled()


def run_quorum(call: QuorumCall, send: Callable[[], NativeQuorumResult]) -> None:
    """Runs one quorum inline: sends the request, adopts the answer.

    Errors are recorded (the step does not commit); only the quorum deadline itself is also
    raised (timeouts while reconfiguring or healing are ordinary step errors, retried).

    Raises:
        QuorumTimeoutError: the quorum was not reached within ``call.quorum_timeout``.
    """
    call.group.quorum_in_progress = True
    try:
        try:
            quorum = send()
        except TimeoutError as e:
            raise call.timed_out(e) from e
        call.adopt(quorum)
    except QuorumTimeoutError as e:
        call.report_error(e)
        raise
    except Exception as e:
        call.report_error(e)
    finally:
        call.group.quorum_in_progress = False


def start_pending(
    call: QuorumCall,
    send: Callable[[], NativePendingQuorum],
    executor: ThreadPoolExecutor,
    allow_heal: bool,
) -> ConcurrentFuture[None] | PendingQuorum:
    """Sends the quorum request of an async step without waiting (see :class:`PendingQuorum`).

    A request that cannot be sent is recorded like any quorum error: the returned future is
    done, and the step does not commit.
    """
    # Until the answer is adopted the step has not used any process group: a loss reported
    # meanwhile rebuilds the group instead of failing the step (QuorumGroup.on_lost).
    call.group.quorum_in_progress = True
    try:
        pending = send()
    except Exception as e:
        call.group.quorum_in_progress = False
        call.report_error(e)
        done: ConcurrentFuture[None] = ConcurrentFuture()
        done.set_result(None)
        return done
    return PendingQuorum(pending, call, executor, allow_heal)


def quorum_sender(
    server: NativeManagerServer | None,
    group_world_size: int,
    client: Callable[[], NativeManagerClient],
) -> NativeManagerClient | NativeManagerServer:
    """Where a rank starts its async quorum request: the manager server itself when the rank
    hosts it and the group has no other rank (the request then goes on a lighthouse
    connection the calling thread drives: in a short step no other thread is woken), else
    its manager client (``client()``, which raises once the Manager is shut down)."""
    if server is not None and group_world_size == 1:
        return server
    return client()


def participation(
    quorum: NativeQuorumResult, cfg: ManagerConfig, allow_heal: bool
) -> tuple[int | None, int]:
    """Who contributes gradients this step: this group's rank among the participants (None:
    it sits out and sends zeros) and their number.

    A group that heals in the background (async quorum), or that is behind and may not heal,
    has stale weights: it sits out. In sync mode a healing group is up to date before the
    forward pass. With ``FIXED_WITH_SPARES`` only the first ``min_replica_size`` take part.
    """
    rank: int | None
    if cfg.use_async_quorum or not allow_heal:
        rank, world = quorum.max_replica_rank, quorum.max_world_size
    else:
        rank, world = quorum.replica_rank, quorum.replica_world_size
    if cfg.world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
        world = min(world, cfg.min_replica_size)
        if rank is not None and rank >= cfg.min_replica_size:
            rank = None
    return rank, world
