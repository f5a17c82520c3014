"""Unit tests of torchft.manager.Manager with fakes (no lighthouse, no real collectives).

The native manager server/client are replaced by an in-memory fake that returns crafted
quorum results; the process group is a fake that records calls and can fail on demand; the
checkpoint transport keeps state dicts in memory. A real TCPStore (port 0) carries the manager
address, as in production.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp, TCPStore
from torch.futures import Future

import torchft.manager as manager_mod
from torchft import coordination
from torchft.manager import ExceptionWithTraceback, Manager, WorldSizeMode

# ----------------------------------------------------------------------------- fakes


def make_quorum(**overrides: Any) -> SimpleNamespace:
    """A QuorumResult-shaped object: one replica group, up to date, no healing."""
    fields: dict[str, Any] = {
        "quorum_id": 1,
        "replica_rank": 0,
        "replica_world_size": 1,
        "recover_src_manager_address": "",
        "recover_src_replica_rank": None,
        "recover_dst_replica_ranks": [],
        "store_address": "storehost:1234",
        "max_step": 0,
        "max_replica_rank": 0,
        "max_world_size": 1,
        "heal": False,
        "commit_failures": 0,
        "replica_ids": ["rg0"],
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


class FakePending:
    """Stands in for the native PendingQuorum: the request runs on a thread meanwhile."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._outcome: Future[Any] = Future()
        self._waited = False

        def run() -> None:
            try:
                self._outcome.set_result(call())
            except BaseException as e:
                self._outcome.set_exception(e)

        threading.Thread(target=run, daemon=True).start()

    def done(self) -> bool:
        return self._outcome.done()

    def wait(self) -> Any:
        if self._waited:
            raise RuntimeError("pending quorum was already waited for")
        self._waited = True
        return self._outcome.wait()


@dataclass
class FakeNative:
    """Stands in for torchft._torchft: one ManagerServer/ManagerClient per address.

    Its server and client implement the ``Native*`` protocols of ``torchft.coordination``
    (checked by ``test_fakes_implement_the_native_protocols``).
    """

    quorums: list[Any] = field(default_factory=list)
    quorum_calls: list[dict[str, Any]] = field(default_factory=list)
    commit_calls: list[tuple[int, int, bool]] = field(default_factory=list)
    digests: list[tuple[int, int, bytes]] = field(default_factory=list)
    commit_result: bool | None = None  # None: echo the local vote
    metadata_by_addr: dict[str, str] = field(default_factory=dict)
    servers: list[Any] = field(default_factory=list)
    quorum_delay: float = 0.0
    lease: bool = True
    log_context: tuple[str, int] | None = None
    busy_calls: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        native = self

        class ManagerServer:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs = kwargs
                self.closed = False
                self.committed_steps: list[int] = []
                native.servers.append(self)

            def note_committed_step(self, step: int) -> None:
                self.committed_steps.append(step)

            def address(self) -> str:
                return "http://fake-manager:1"

            def lease_held(self) -> bool:
                return native.lease

            def may_commit(self, step: int, timeout: timedelta) -> bool:
                return native.lease

            def _offer_digest(self, group_rank: int, step: int, digest: bytes) -> None:
                native.digests.append((group_rank, step, digest))

            def describe(self) -> str:
                return "fake manager server"

            def hung(self) -> str | None:
                return None

            def set_loop_busy(self, busy: bool) -> None:
                native.busy_calls.append(busy)

            def shutdown(self) -> None:
                self.closed = True

        class ManagerClient:
            def __init__(self, addr: str, connect_timeout: timedelta) -> None:
                self.addr = addr
                self.reports: list[dict[str, Any]] = []

            def _quorum(
                self, request: Any = None, timeout: timedelta | None = None, **fields: Any
            ) -> Any:
                native.quorum_calls.append({**fields, "timeout": timeout})
                if native.quorum_delay:
                    time.sleep(native.quorum_delay)
                q = native.quorums.pop(0) if native.quorums else make_quorum()
                if isinstance(q, BaseException):
                    raise q
                return q

            def _quorum_start(
                self, request: Any = None, timeout: timedelta | None = None, **fields: Any
            ) -> FakePending:
                return FakePending(lambda: self._quorum(request, timeout, **fields))

            def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
                return native.metadata_by_addr[self.addr]

            def should_commit(
                self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
            ) -> bool:
                native.commit_calls.append((group_rank, step, should_commit))
                if native.commit_result is None:
                    return should_commit
                return native.commit_result and should_commit

            def _should_commit_digest(
                self,
                group_rank: int,
                step: int,
                should_commit: bool,
                timeout: timedelta,
                digest_step: int,
                digest: bytes,
            ) -> bool:
                native.digests.append((group_rank, digest_step, digest))
                return self.should_commit(group_rank, step, should_commit, timeout)

            def _watch_events(
                self, after_seq: int, timeout: timedelta
            ) -> tuple[int, list[tuple[str, int]]]:
                time.sleep(min(timeout.total_seconds(), 0.05))
                return after_seq, []

            def report(self, report: Any = None, /, **fields: Any) -> bool:
                phase, committed = fields.get("phase", "step"), fields.get("committed", False)
                self.reports.append(
                    {"step": fields["step"], "phase": phase, "committed": committed}
                )
                return True

            def _telemetry_flush(self, timeout: timedelta = timedelta(seconds=1)) -> None:
                pass

        def set_log_context(replica_id: str, group_rank: int) -> None:
            native.log_context = (replica_id, group_rank)

        self.ManagerServer = ManagerServer
        self.ManagerClient = ManagerClient
        self.set_log_context = set_log_context


class FakeWork(torch.distributed.Work):
    """A completed (or failed) Work returning a torch future."""

    def __init__(self, fut: Future[Any]) -> None:
        super().__init__()
        self.fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.fut.wait()
        return True

    def get_future(self) -> Future[Any]:
        return self.fut


class FakePG:
    """Records configure/allreduce; SUM multiplies by `sum_factor` to emulate peers."""

    def __init__(self) -> None:
        self.configures: list[tuple[str, str, int, int]] = []
        self.allreduces: list[Any] = []
        self.sum_factor = 1.0
        self.raise_on_allreduce: Exception | None = None
        self.future_error: Exception | None = None
        self.pg_error: Exception | None = None
        self.timeout: timedelta | None = None
        self.shut = False
        self.aborts = 0
        # Opt-in behaviour of torchft's own groups: `hold` leaves allreduce futures pending
        # (in flight) until an abort fails them; `strict_abort` makes an abort record its
        # error (errored()) and refuse collectives until the next configure.
        self.hold = False
        self.held: list[Future[Any]] = []
        self.strict_abort = False
        self.aborted = False

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self.configures.append((store_addr, replica_id, rank, world_size))
        if self.strict_abort:
            self.aborted = False
            self.pg_error = None

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        self.allreduces.append(opts)
        if self.raise_on_allreduce is not None:
            raise self.raise_on_allreduce
        if self.aborted:
            raise RuntimeError("FakePG is not configured (it was aborted)")
        fut: Future[Any] = Future()
        if self.hold:
            self.held.append(fut)
            return FakeWork(fut)
        if self.future_error is not None:
            fut.set_exception(self.future_error)
        else:
            if opts == ReduceOp.SUM:
                for t in tensors:
                    t.mul_(self.sum_factor)
            fut.set_result(tensors)
        return FakeWork(fut)

    def errored(self) -> Exception | None:
        return self.pg_error

    def abort(self) -> None:
        self.aborts += 1
        if self.strict_abort:
            self.aborted = True
            if self.pg_error is None:
                self.pg_error = RuntimeError("FakePG was aborted")
        held, self.held = self.held, []
        for fut in held:
            fut.set_exception(RuntimeError("FakePG was aborted"))

    def shutdown(self) -> None:
        self.shut = True


class MemoryTransport:
    """In-memory checkpoint transport; `shared` plays the network between replica groups."""

    def __init__(self, shared: dict[str, Any], name: str) -> None:
        self.shared = shared
        self.name = name
        self.sent: list[tuple[list[int], int]] = []
        self.disallowed = 0
        self.closed = False

    def metadata(self) -> str:
        return self.name

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        self.sent.append((dst_ranks, step))
        self.shared[self.name] = (step, state_dict)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        got_step, sd = self.shared[metadata]
        if got_step != step:
            raise RuntimeError(f"wrong step {got_step} != {step}")
        return sd

    def disallow_checkpoint(self) -> None:
        self.disallowed += 1

    def shutdown(self, wait: bool = True) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def master_store() -> Iterator[TCPStore]:
    """One real TCPStore on port 0 for the module (each test publishes its own address)."""
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s
    del s


@pytest.fixture
def store(master_store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
    """The module's store advertised through MASTER_ADDR/MASTER_PORT, plus a clean env."""
    s = master_store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(s.port))
    monkeypatch.setenv("RANK", "0")
    # Two group ranks so the commit vote goes through the (fake) manager server.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://fake-lighthouse:1")
    for name in (
        "TORCHFT_TIMEOUT_SEC",
        "TORCHFT_QUORUM_TIMEOUT_SEC",
        "TORCHFT_CONNECT_TIMEOUT_SEC",
        "TORCHFT_QUORUM_RETRIES",
        "TORCHFT_MANAGER_PORT",
    ):
        monkeypatch.delenv(name, raising=False)
    yield s


@pytest.fixture
def native() -> FakeNative:
    """The native backend the managers under test join their groups through."""
    return FakeNative()


class Harness:
    """A manager under test plus its fakes and a tiny user state."""

    def __init__(self, native: FakeNative, shared: dict[str, Any], **kwargs: Any) -> None:
        self.native = native
        self.pg = FakePG()
        self.transport = MemoryTransport(shared, kwargs.pop("name", "rg0"))
        self.user_state = {"w": torch.zeros(3)}
        self.loaded: list[Any] = []
        args: dict[str, Any] = {
            "min_replica_size": 1,
            "replica_id": "rg0",
            "timeout": timedelta(seconds=5),
            "quorum_timeout": timedelta(seconds=5),
            # Connecting to the module's store only: generous, so a loaded machine (a chaos
            # run beside the tests) does not fail the connect; a test that waits on something
            # else still fails at its own timeout.
            "connect_timeout": timedelta(seconds=30),
        }
        args.update(kwargs)
        self.manager = Manager(
            pg=self.pg,  # type: ignore[arg-type]
            load_state_dict=self._load,
            state_dict=lambda: {"w": self.user_state["w"].clone()},
            checkpoint_transport=self.transport,  # type: ignore[arg-type]
            native_backend=native,  # type: ignore[arg-type]
            **args,
        )

    def _load(self, sd: Any) -> None:
        self.loaded.append(sd)
        self.user_state["w"] = sd["w"].clone()


@pytest.fixture
def harness(store: TCPStore, native: FakeNative) -> Iterator[Any]:
    """Factory of Harness objects, all shut down at the end of the test."""
    made: list[Harness] = []
    shared: dict[str, Any] = {}

    def make(**kwargs: Any) -> Harness:
        h = Harness(native, shared, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.manager.shutdown(wait=False)


# ----------------------------------------------------------------------------- commit logic


def test_happy_path_commits_and_advances(harness: Any) -> None:
    """A clean step commits, advances the step and counts the participants' batches."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=3, max_world_size=3)]
    m = h.manager
    m.start_quorum()
    assert m.num_participants() == 3
    assert m.is_participating()
    assert m.participating_rank() == 0
    assert m.should_commit()
    assert m.current_step() == 1
    assert m.batches_committed() == 3
    assert h.native.commit_calls == [(0, 0, True)]
    assert h.transport.disallowed == 1
    # the quorum request carries the step, the transport metadata and init_sync
    call = h.native.quorum_calls[0]
    assert call["step"] == 0 and call["checkpoint_metadata"] == "rg0" and call["init_sync"]
    assert call["group_rank"] == 0 and call["commit_failures"] == 0


def test_configure_only_on_new_quorum_id(harness: Any) -> None:
    """The process group is rebuilt on a fresh store prefix only when quorum_id changes."""
    h = harness()
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_rank=1, replica_world_size=2, max_replica_rank=1),
        make_quorum(quorum_id=7, replica_rank=1, replica_world_size=2, max_replica_rank=1),
        make_quorum(quorum_id=9, replica_rank=0, replica_world_size=1),
    ]
    m = h.manager
    for _ in range(3):
        m.start_quorum()
        assert m.should_commit()
    assert [c[0] for c in h.pg.configures] == [
        "storehost:1234/torchft/7/0",
        "storehost:1234/torchft/9/0",
    ]
    assert [(c[2], c[3]) for c in h.pg.configures] == [(1, 2), (0, 1)]
    assert h.pg.configures[0][1].startswith("rg0:")  # fresh replica id with uuid suffix


def test_vote_aborts_the_group_only_after_skipping_a_collective(harness: Any) -> None:
    """A rank that turned a collective into a no-op (its step had errored) aborts the
    quorum's group at its vote, after its own collectives finished, so peers waiting on the
    skipped one fail at once; the same quorum id is then rebuilt. An error recorded after
    every collective ran aborts nothing (the peers' step is not cut short), nor does a clean
    step."""
    h = harness()
    h.native.quorums = [make_quorum(quorum_id=7, replica_world_size=2)] * 4
    m = h.manager
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert h.pg.aborts == 0

    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    m.report_error(RuntimeError("late local failure"))
    assert not m.should_commit()
    assert h.pg.aborts == 0

    h.pg.future_error = RuntimeError("peer reset")
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    h.pg.future_error = None
    calls = len(h.pg.allreduces)
    m.allreduce(torch.ones(2)).wait()  # a no-op: the step errored
    assert len(h.pg.allreduces) == calls
    assert not m.should_commit()
    assert h.pg.aborts == 1
    assert len(h.pg.configures) == 1

    # Same quorum id: the aborted group is rebuilt all the same, and the step commits.
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert h.pg.aborts == 1
    assert len(h.pg.configures) == 2


def test_quorum_answered_before_a_members_loss_is_not_rebuilt(harness: Any) -> None:
    """A quorum answer that still lists a member already declared lost (issued just before it
    died) fails the step at once instead of rendezvousing with the dead member."""
    h = harness()
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_ids=["rg0", "dead"], **two),
        make_quorum(quorum_id=7, replica_ids=["rg0", "dead"], **two),
        make_quorum(quorum_id=9, replica_ids=["rg0"]),
    ]
    m = h.manager
    m.start_quorum()
    assert m.should_commit()
    m._on_lost("dead", 7)  # the lighthouse's event, between two steps
    m.start_quorum()
    assert not m.should_commit()
    assert "dead" in str(m.errored())
    m.start_quorum()
    assert m.should_commit()
    assert [c[0] for c in h.pg.configures] == [
        "storehost:1234/torchft/7/0",
        "storehost:1234/torchft/9/0",
    ]


def test_loss_after_the_steps_collectives_completed_still_commits(harness: Any) -> None:
    """A member lost once the step's collectives have completed (it finished, or died after
    its own vote) does not cost this group the step: the collectives hold every member's
    data and the lost group may have committed it, so abandoning the step would leave two
    states under one step number. The group is still aborted and rebuilt."""
    h = harness()
    h.pg.strict_abort = True
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_ids=["rg0", "gone"], **two),
        make_quorum(quorum_id=9, replica_ids=["rg0"]),
    ]
    m = h.manager
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    m._on_lost("gone", 7)
    assert h.pg.aborts == 1
    assert m.should_commit()
    assert m.current_step() == 1
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert [c[0] for c in h.pg.configures] == [
        "storehost:1234/torchft/7/0",
        "storehost:1234/torchft/9/0",
    ]


def test_loss_with_a_collective_in_flight_fails_the_step(harness: Any) -> None:
    """A member lost while a collective of the step is in flight (or one the step issues
    after the loss) fails the step at once; the next quorum rebuilds the group."""
    h = harness()
    h.pg.strict_abort = True
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_ids=["rg0", "gone"], **two),
        make_quorum(quorum_id=9, replica_ids=["rg0", "late"], **two),
        make_quorum(quorum_id=11, replica_ids=["rg0"]),
    ]
    m = h.manager
    m.start_quorum()
    h.pg.hold = True
    work = m.allreduce(torch.ones(2))
    m._on_lost("gone", 7)
    work.wait()
    assert not m.should_commit()
    assert "gone" in str(m.errored())
    assert m.current_step() == 0

    # A loss between two collectives of a step: the later one fails on the aborted group.
    h.pg.hold = False
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    m._on_lost("late", 9)
    m.allreduce(torch.ones(2)).wait()
    assert not m.should_commit()
    assert "aborted" in str(m.errored())
    m.start_quorum()
    m._on_lost("late", 9)  # an event for a quorum this rank no longer runs: ignored
    m.allreduce(torch.ones(2)).wait()
    assert m.should_commit()
    assert len(h.pg.configures) == 3


def test_min_replica_size_guard(harness: Any) -> None:
    """Fewer participants than min_replica_size → local vote is no, step does not advance."""
    h = harness(min_replica_size=2)
    h.native.quorums = [make_quorum(replica_world_size=1, max_world_size=1)]
    m = h.manager
    m.start_quorum()
    assert not m.should_commit()
    assert m.current_step() == 0
    assert h.native.commit_calls == [(0, 0, False)]


def test_max_retries_raises_runtime_error(harness: Any) -> None:
    """More than max_retries consecutive failed commits raise RuntimeError."""
    h = harness(min_replica_size=2, max_retries=2)
    m = h.manager
    for _ in range(2):
        m.start_quorum()
        assert not m.should_commit()
    m.start_quorum()
    with pytest.raises(RuntimeError, match="max_retries"):
        m.should_commit()
    # the commit failure count reaches the next quorum request
    assert [c["commit_failures"] for c in h.native.quorum_calls] == [0, 1, 2]


def test_failed_commits_reset_after_success(harness: Any) -> None:
    """A successful commit resets the consecutive failure count."""
    h = harness(max_retries=1)
    m = h.manager
    h.native.commit_result = False
    m.start_quorum()
    assert not m.should_commit()
    assert (m.current_step(), m.commit_failures()) == (0, 1)
    h.native.commit_result = None
    m.start_quorum()
    assert m.should_commit()
    assert (m.current_step(), m.commit_failures()) == (1, 0)
    h.native.commit_result = False
    m.start_quorum()
    assert not m.should_commit()  # 1 failure again, not 2: no RuntimeError
    assert (m.current_step(), m.commit_failures()) == (1, 1)


def test_committed_steps_are_noted_for_the_heartbeats(harness: Any) -> None:
    """Each commit (and only a commit) hands the new step to the manager server, whose
    heartbeats tell the lighthouse this group's progress."""
    h = harness()
    m = h.manager
    server = h.native.servers[-1]
    m.start_quorum()
    assert m.should_commit()
    h.native.commit_result = False
    m.start_quorum()
    assert not m.should_commit()
    h.native.commit_result = None
    m.start_quorum()
    assert m.should_commit()
    assert server.committed_steps == [1, 2]


# ----------------------------------------------------------------------------- allreduce


def test_allreduce_avg_divides_by_participants(harness: Any) -> None:
    """AVG = SUM over the PG then divide by the number of participants."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=4, max_world_size=4)]
    h.pg.sum_factor = 4.0  # four identical contributions
    m = h.manager
    m.start_quorum()
    t = torch.tensor([1.0, 2.0, 3.0])
    work = m.allreduce(t)
    out = work.get_future().wait()
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))
    assert out is t
    assert h.pg.allreduces == [ReduceOp.SUM]
    assert m.should_commit()


def test_allreduce_sum_passes_through(harness: Any) -> None:
    """A SUM allreduce is not divided."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2)]
    h.pg.sum_factor = 2.0
    m = h.manager
    m.start_quorum()
    t = torch.ones(2)
    m.allreduce(t, reduce_op=ReduceOp.SUM).wait()
    assert torch.equal(t, torch.full((2,), 2.0))


def test_allreduce_quantize_falls_back(harness: Any) -> None:
    """should_quantize=True still returns a correctly averaged tensor."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2)]
    h.pg.sum_factor = 2.0
    m = h.manager
    m.start_quorum()
    t = torch.full((4,), 3.0)
    assert torch.equal(m.allreduce(t, should_quantize=True).get_future().wait(), t)
    assert torch.equal(t, torch.full((4,), 3.0))


def test_allreduce_error_is_swallowed_and_later_collectives_noop(harness: Any) -> None:
    """A raising allreduce is recorded; the work resolves to the tensor; later ones are no-ops."""
    h = harness()
    m = h.manager
    m.start_quorum()
    h.pg.raise_on_allreduce = RuntimeError("peer died")
    t = torch.ones(2)
    assert m.allreduce(t).get_future().wait() is t
    err = m.errored()
    assert isinstance(err, ExceptionWithTraceback)
    assert "peer died" in str(err.original_exception)
    assert "peer died" in err.stack_trace
    h.pg.raise_on_allreduce = None
    t2 = torch.ones(2)
    assert m.allreduce(t2).get_future().wait() is t2
    assert len(h.pg.allreduces) == 1  # the second call never reached the PG
    assert not m.should_commit()
    assert h.native.commit_calls == [(0, 0, False)]
    # the next step starts clean
    m.start_quorum()
    assert m.errored() is None
    assert m.should_commit()


def test_allreduce_future_error_is_recorded(harness: Any) -> None:
    """An error delivered through the collective's future is recorded, not raised."""
    h = harness()
    m = h.manager
    m.start_quorum()
    h.pg.future_error = RuntimeError("connection reset")
    t = torch.ones(2)
    fut = m.allreduce(t).get_future()
    assert fut.wait() is t
    assert m.errored() is not None
    assert not m.should_commit()


def test_pg_errored_blocks_commit(harness: Any) -> None:
    """An error reported by the process group itself makes the vote no."""
    h = harness()
    m = h.manager
    m.start_quorum()
    h.pg.pg_error = RuntimeError("aborted")
    assert not m.should_commit()


def test_non_participant_sends_zeros_async(harness: Any) -> None:
    """With async quorum a healing (behind) replica group sits out and contributes zeros."""
    h = harness()
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.transport.shared["src"] = (5, {"user": {"default": {"w": torch.ones(3)}}, "torchft": {}})
    h.transport.shared["src"][1]["torchft"] = {"step": 5, "batches_committed": 9}
    h.native.quorums = [
        make_quorum(
            replica_rank=1,
            replica_world_size=2,
            max_step=5,
            max_replica_rank=None,
            max_world_size=1,
            heal=True,
            recover_src_manager_address="http://src:1",
            recover_src_replica_rank=0,
        )
    ]
    m = h.manager
    m.start_quorum()
    assert not m.is_participating()
    assert m.num_participants() == 1
    t = torch.full((3,), 7.0)
    m.allreduce(t).wait()
    assert torch.equal(t, torch.zeros(3))


def test_fixed_with_spares_caps_participants(harness: Any) -> None:
    """FIXED_WITH_SPARES: ranks >= min_replica_size are spares sending zeros."""
    h = harness(min_replica_size=2, world_size_mode=WorldSizeMode.FIXED_WITH_SPARES)
    h.native.quorums = [
        make_quorum(replica_rank=2, replica_world_size=3, max_replica_rank=2, max_world_size=3)
    ]
    m = h.manager
    m.start_quorum()
    assert m.num_participants() == 2
    assert not m.is_participating()
    t = torch.ones(2)
    m.allreduce(t).wait()
    assert torch.equal(t, torch.zeros(2))
    assert m.should_commit()
    assert m.batches_committed() == 2


def test_fixed_with_spares_member_participates(harness: Any) -> None:
    """FIXED_WITH_SPARES: a rank below min_replica_size contributes normally."""
    h = harness(min_replica_size=2, world_size_mode=WorldSizeMode.FIXED_WITH_SPARES)
    h.native.quorums = [
        make_quorum(replica_rank=1, replica_world_size=3, max_replica_rank=1, max_world_size=3)
    ]
    h.pg.sum_factor = 2.0
    m = h.manager
    m.start_quorum()
    assert m.participating_rank() == 1
    t = torch.ones(2)
    m.allreduce(t).wait()
    assert torch.equal(t, torch.ones(2))


def test_dynamic_mode_uses_all_at_max_step(harness: Any) -> None:
    """DYNAMIC: every replica group at the max step participates."""
    h = harness(min_replica_size=2)
    h.native.quorums = [
        make_quorum(replica_rank=2, replica_world_size=3, max_replica_rank=2, max_world_size=3)
    ]
    m = h.manager
    m.start_quorum()
    assert m.num_participants() == 3
    assert m.participating_rank() == 2


# ----------------------------------------------------------------------------- healing


def _heal_quorum(max_step: int = 5) -> SimpleNamespace:
    return make_quorum(
        replica_rank=1,
        replica_world_size=2,
        max_step=max_step,
        max_replica_rank=None,
        max_world_size=1,
        heal=True,
        recover_src_manager_address="http://src:1",
        recover_src_replica_rank=0,
    )


def _serve(h: Harness, step: int, w: torch.Tensor) -> None:
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.transport.shared["src"] = (
        step,
        {"user": {"default": {"w": w}}, "torchft": {"step": step, "batches_committed": 11}},
    )


def test_heal_sync_applies_before_forward(harness: Any) -> None:
    """Sync quorum: healed user state is loaded before start_quorum returns."""
    h = harness(use_async_quorum=False)
    _serve(h, 5, torch.full((3,), 2.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum()
    assert torch.equal(h.user_state["w"], torch.full((3,), 2.0))
    assert m.current_step() == 5
    assert m.batches_committed() == 11
    # sync mode: the healed replica participates with its replica rank
    assert m.participating_rank() == 1
    assert m.num_participants() == 2
    assert m.should_commit()
    assert m.current_step() == 6
    assert h.native.commit_calls == [(0, 5, True)]


def test_heal_async_applies_in_should_commit(harness: Any) -> None:
    """Async quorum: counters apply at once, user state only in should_commit."""
    h = harness()
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert m.current_step() == 5
    assert h.loaded == []  # not yet: the forward pass may still be using the old weights
    assert torch.equal(h.user_state["w"], torch.zeros(3))
    assert m.should_commit()
    assert torch.equal(h.user_state["w"], torch.full((3,), 3.0))
    assert m.current_step() == 6
    assert m.batches_committed() == 11 + 1


def test_heal_of_a_failed_step_is_loaded_before_the_next_forward(harness: Any) -> None:
    """Async quorum: a heal whose step then failed leaves the counters at the healed step; the
    next step loads the healed state in start_quorum, before its forward pass (its gradients
    count: the group is up to date now), and serves that state, not the replaced one."""
    h = harness()
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [
        _heal_quorum(),
        make_quorum(
            replica_rank=1,
            replica_world_size=2,
            max_step=5,
            max_replica_rank=1,
            max_world_size=2,
            recover_dst_replica_ranks=[0],
        ),
    ]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    m.report_error(RuntimeError("a peer died mid-step"))
    assert not m.should_commit()
    assert m.current_step() == 5
    assert torch.equal(h.user_state["w"], torch.zeros(3))  # not loaded: the step failed

    m.start_quorum()
    # Loaded before the quorum answers, so before the forward pass of this step.
    assert torch.equal(h.user_state["w"], torch.full((3,), 3.0))
    m.wait_quorum()
    assert m.participating_rank() == 1
    step, sd = h.transport.shared["rg0"]
    assert step == 5
    assert torch.equal(sd["user"]["default"]["w"], torch.full((3,), 3.0))
    assert m.should_commit()
    assert m.current_step() == 6


def test_the_loop_is_marked_inside_torchft_through_quorum_heal_and_vote(harness: Any) -> None:
    """The hang watch never counts the loop as away while it waits in torchft: the quorum
    (and a heal), and the commit vote are each marked busy, and every mark is undone."""
    h = harness()
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    after_quorum = list(h.native.busy_calls)
    assert after_quorum.count(True) >= 2  # waiting for the quorum, and the heal inside it
    assert m.should_commit()
    calls = h.native.busy_calls
    assert len(calls) > len(after_quorum)  # the vote too
    depth = 0
    for busy in calls:
        depth += 1 if busy else -1
        assert depth >= 0
    assert depth == 0, calls


def test_a_collective_in_flight_is_the_loop_inside_torchft(harness: Any) -> None:
    """An allreduce in flight (the reducer waits for it inside backward, outside any other
    torchft call) marks the loop busy until it completes, with or without an error, so a
    group blocked on a collective is never held hung; the marks balance."""
    h = harness()
    h.native.quorums = [make_quorum(replica_world_size=2, max_world_size=2)]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    before = len(h.native.busy_calls)
    h.pg.future_error = RuntimeError("connection reset")
    assert m.allreduce(torch.ones(2)).get_future().wait() is not None
    # The quorum wait the allreduce does first (its own mark), then the collective's.
    calls = h.native.busy_calls[before:]
    assert calls == [True, False, True, False], calls
    h.pg.future_error = None
    m.start_quorum()
    m.wait_quorum()
    before = len(h.native.busy_calls)
    h.pg.raise_on_allreduce = RuntimeError("peer died")
    m.allreduce(torch.ones(2)).get_future().wait()
    assert h.native.busy_calls[before:] == [True, False, True, False]


def test_heal_disallowed_skips_recv(harness: Any) -> None:
    """allow_heal=False: a behind replica does not heal and does not participate."""
    h = harness(use_async_quorum=False)
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    m.start_quorum(allow_heal=False)
    assert h.loaded == []
    assert m.current_step() == 0
    assert not m.is_participating()


def test_heal_failure_blocks_commit(harness: Any) -> None:
    """A heal that fails (wrong step) is recorded and the step does not commit."""
    h = harness()
    _serve(h, 4, torch.full((3,), 3.0))  # source has the wrong step
    h.native.quorums = [_heal_quorum(max_step=5)]
    m = h.manager
    m.start_quorum()
    t = torch.ones(1)
    assert m.allreduce(t).get_future().wait() is t
    assert "wrong step" in str(m.errored())
    assert not m.should_commit()
    assert h.loaded == []


def _failed_in_place_heal(harness: Any, **transport: bool) -> Harness:
    """A sync-quorum group whose heal into its own tensors just failed (the source serves
    the wrong step); ``transport`` sets attributes of the test transport."""
    h = harness(use_async_quorum=False)
    h.transport.receives_in_place = True
    for name, value in transport.items():
        setattr(h.transport, name, value)
    _serve(h, 4, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum(max_step=5)]
    h.manager.start_quorum()
    return h


def test_failed_in_place_heal_is_never_trained_on(harness: Any) -> None:
    """A heal that wrote into the group's own tensors and failed leaves a state no step had:
    the group does not commit on it unless a later heal makes it whole again."""
    h = _failed_in_place_heal(harness)
    m = h.manager
    assert "wrong step" in str(m.errored())
    assert not m.should_commit()
    # A quorum that may not heal (allow_heal=False) does not train on it either.
    h.native.quorums = [make_quorum(max_step=0)]
    m.start_quorum(allow_heal=False)
    assert "partly overwritten" in str(m.errored())
    assert not m.should_commit()
    # A heal that succeeds makes the state whole: the group commits again.
    _serve(h, 5, torch.full((3,), 2.0))
    h.native.quorums = [_heal_quorum(max_step=5)]
    m.start_quorum()
    assert m.errored() is None
    assert m.should_commit()
    assert torch.equal(h.user_state["w"], torch.full((3,), 2.0))


def test_an_in_place_heal_that_wrote_nothing_leaves_the_state_whole(harness: Any) -> None:
    """The transport says the failed receive never reached the local tensors (the source
    died before its header): the state is not torn, so with no source left the group
    trains on from it instead of asking for a restart."""
    h = _failed_in_place_heal(harness, touched_local_state=False)
    m = h.manager
    assert not m.should_commit()
    h.native.quorums = [make_quorum(max_step=0)]
    m.start_quorum()
    assert m.errored() is None
    assert m.should_commit()


def test_torn_state_with_no_source_left_ends_the_process(harness: Any) -> None:
    """Torn by a failed in-place heal, and the next quorum has no group ahead to heal from:
    nothing can make the state whole, so should_commit raises (the supervisor restarts the
    process) instead of failing every step forever."""
    h = _failed_in_place_heal(harness)
    m = h.manager
    assert not m.should_commit()
    h.native.quorums = [make_quorum(max_step=0)]
    m.start_quorum()
    with pytest.raises(manager_mod.TornStateError, match="restart the group"):
        m.should_commit()
    assert m.current_step() == 0


def test_default_transport_heals_in_place_until_the_first_commit(
    store: TCPStore, native: FakeNative
) -> None:
    """The default HTTPTransport receives into the group's own tensors while the process has
    committed nothing (a restart reproduces that state), into new ones after (the state may
    be the best left if the source dies midway)."""
    from torchft import Manager

    w = torch.zeros(3)
    native.quorums = [make_quorum(max_step=0)]
    m = Manager(
        pg=FakePG(),
        load_state_dict=lambda sd: None,
        state_dict=lambda: {"w": w},
        min_replica_size=1,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr="http://lighthouse:1",
        replica_id="rg0",
        native_backend=native,  # type: ignore[arg-type]
    )
    try:
        transport = m._checkpoint_transport
        assert transport.receives_in_place  # type: ignore[attr-defined]
        assert m._healer.receives_in_place()
        into = m._healer.heal_into()
        assert into is not None and into["user"]["default"]["w"] is w
        m.start_quorum()
        assert m.should_commit()
        assert not m._healer.receives_in_place()
        assert m._healer.heal_into() is None
    finally:
        m.shutdown(wait=False)


def test_default_in_place_rule_ends_with_the_first_applied_heal(harness: Any) -> None:
    """A heal applied makes the state one a restart does not reproduce: if its first step
    then fails and the group heals again, that heal must not tear it."""
    h = harness(use_async_quorum=False)
    m = h.manager
    # The rule of the default transport, with the test's transport.
    m._healer.attach(m._checkpoint_transport, own=True)
    assert m._healer.receives_in_place()
    _serve(h, 5, torch.full((3,), 2.0))
    h.native.quorums = [_heal_quorum(max_step=5)]
    m.start_quorum()
    assert m.errored() is None and m.current_step() == 5
    assert not m._healer.receives_in_place()
    assert m._healer.heal_into() is None


def test_in_place_heal_holds_the_state_write_lock(harness: Any) -> None:
    """An async in-place heal writes into the group's tensors on the quorum thread: it holds
    the state's write lock meanwhile, so an optimizer step (disallow_state_dict_read) on
    the training thread waits for it instead of racing it."""
    h = harness()
    h.transport.receives_in_place = True  # type: ignore[attr-defined]
    _serve(h, 5, torch.full((3,), 3.0))
    h.native.quorums = [_heal_quorum()]
    m = h.manager
    lock = m._user.lock
    receiving, release = threading.Event(), threading.Event()
    held: list[bool] = []
    recv = h.transport.recv_checkpoint

    def slow_recv(*args: Any, **kwargs: Any) -> Any:
        held.append(lock.held_by_me())
        receiving.set()
        assert release.wait(10)
        return recv(*args, **kwargs)

    h.transport.recv_checkpoint = slow_recv  # type: ignore[method-assign]
    version = lock.version()
    m.start_quorum()
    # The answer is adopted (and the heal run on the worker thread) by the first wait.
    waiter = threading.Thread(target=m.wait_quorum)
    waiter.start()
    assert receiving.wait(10)
    stepped = threading.Event()

    def optimizer_step() -> None:
        m.disallow_state_dict_read()
        stepped.set()
        m.allow_state_dict_read()

    t = threading.Thread(target=optimizer_step)
    t.start()
    assert not stepped.wait(0.3)  # blocked by the heal
    release.set()
    assert stepped.wait(10)
    t.join(10)
    waiter.join(10)
    assert held == [True]
    assert lock.version() == version + 2  # the heal and the step each count as a write
    assert m.should_commit()


def test_sends_checkpoint_to_recovering_peers(harness: Any) -> None:
    """An up-to-date replica serves its user state and counters for the max step."""
    h = harness()
    h.user_state["w"] = torch.full((3,), 4.0)
    h.native.quorums = [
        make_quorum(replica_world_size=2, max_step=0, recover_dst_replica_ranks=[1])
    ]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert h.transport.sent == [([1], 0)]
    step, sd = h.transport.shared["rg0"]
    assert step == 0
    assert torch.equal(sd["user"]["default"]["w"], torch.full((3,), 4.0))
    assert sd["torchft"] == {"step": 0, "batches_committed": 0}
    assert m.should_commit()
    assert h.transport.disallowed == 1


def test_register_state_dict_fn_multiple_keys(harness: Any) -> None:
    """Several registered keys are served together and each loader gets its own state."""
    h = harness(use_async_quorum=False)
    extra: dict[str, Any] = {}
    h.manager.register_state_dict_fn("sched", lambda sd: extra.update(sd), lambda: {"lr": 0.1})
    with pytest.raises(ValueError, match="already registered"):
        h.manager.register_state_dict_fn("sched", lambda sd: None, lambda: {})
    full = h.manager._manager_state_dict()
    assert set(full["user"]) == {"default", "sched"}
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.transport.shared["src"] = (
        5,
        {
            "user": {"default": {"w": torch.ones(3)}, "sched": {"lr": 0.5}},
            "torchft": {"step": 5, "batches_committed": 5},
        },
    )
    h.native.quorums = [_heal_quorum()]
    h.manager.start_quorum()
    assert extra == {"lr": 0.5}
    assert torch.equal(h.user_state["w"], torch.ones(3))


# ----------------------------------------------------------------------------- timeouts


def test_quorum_timeout_surfaces_as_timeout_error(harness: Any) -> None:
    """A quorum TimeoutError reaches wait_quorum/should_commit; allreduce swallows it."""
    h = harness()
    h.native.quorums = [TimeoutError("quorum deadline exceeded")]
    m = h.manager
    m.start_quorum()
    with pytest.raises(TimeoutError):
        m.wait_quorum()
    t = torch.ones(2)
    assert m.allreduce(t).get_future().wait() is t
    with pytest.raises(TimeoutError):
        m.should_commit()
    assert m.current_step() == 0
    # a later step works again
    m.start_quorum()
    assert m.should_commit()


def test_quorum_timeout_sync_mode(harness: Any) -> None:
    """Sync mode: the quorum timeout is raised by start_quorum (as upstream's) and again by
    should_commit; the step does not commit and the next one works."""
    h = harness(use_async_quorum=False)
    h.native.quorums = [TimeoutError("deadline")]
    m = h.manager
    with pytest.raises(TimeoutError, match="deadline"):
        m.start_quorum()
    with pytest.raises(TimeoutError, match="deadline"):
        m.should_commit()
    assert m.current_step() == 0
    m.start_quorum()
    assert m.should_commit()
    assert m.current_step() == 1


def test_quorum_other_error_is_recorded(harness: Any) -> None:
    """A non-timeout quorum failure is recorded and the step votes no."""
    h = harness()
    h.native.quorums = [RuntimeError("lighthouse unreachable")]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert "lighthouse unreachable" in str(m.errored())
    assert not m.should_commit()


def test_wrap_future_timeout_returns_default(harness: Any) -> None:
    """wrap_future resolves to the default and records a TimeoutError on expiry (its own
    timeout, not the manager's, which is far longer here)."""
    m = harness(timeout=timedelta(seconds=120)).manager
    m.start_quorum()
    never: Future[int] = Future()
    start = time.monotonic()
    out = m.wrap_future(never, 42, timeout=timedelta(milliseconds=200))
    assert out.wait() == 42
    assert time.monotonic() - start < 60
    err = m.errored()
    assert err is not None and isinstance(err.original_exception, TimeoutError)


def test_wrap_future_passes_value_and_errors(harness: Any) -> None:
    """wrap_future passes a value through and turns an error into the default."""
    m = harness().manager
    m.start_quorum()
    ok: Future[int] = Future()
    out = m.wrap_future(ok, -1)
    ok.set_result(5)
    assert out.wait() == 5
    assert m.errored() is None
    bad: Future[int] = Future()
    out2 = m.wrap_future(bad, -1)
    bad.set_exception(ValueError("boom"))
    assert out2.wait() == -1
    assert "boom" in str(m.errored())


def test_async_quorum_overlaps_caller(harness: Any) -> None:
    """start_quorum returns before a slow quorum finishes (async mode)."""
    h = harness()
    h.native.quorum_delay = 0.5
    m = h.manager
    start = time.monotonic()
    m.start_quorum()
    assert time.monotonic() - start < 0.4
    assert m.should_commit()


# ----------------------------------------------------------------------------- state dict lock


def test_disallow_state_dict_read_excludes_readers(harness: Any) -> None:
    """While reads are disallowed a transport's read lock blocks until allowed again."""
    m = harness().manager
    m.disallow_state_dict_read()
    m.disallow_state_dict_read()  # idempotent
    got = threading.Event()

    def reader() -> None:
        with m._user.lock.read():
            got.set()

    t = threading.Thread(target=reader)
    t.start()
    assert not got.wait(0.2)
    m.allow_state_dict_read()
    assert got.wait(2)
    t.join()
    m.allow_state_dict_read()  # idempotent


def test_state_dict_roundtrip(harness: Any) -> None:
    """state_dict/load_state_dict round-trip the manager counters."""
    m = harness().manager
    m.load_state_dict({"step": 12, "batches_committed": 30})
    assert m.state_dict() == {"step": 12, "batches_committed": 30}
    assert m.current_step() == 12


def test_set_state_dict_fns_replaces_default(harness: Any) -> None:
    """set_state_dict_fns (deprecated, and says so) replaces the legacy default key's
    functions."""
    m = harness().manager
    with pytest.warns(DeprecationWarning, match="register_state_dict_fn"):
        m.set_state_dict_fns(lambda sd: None, lambda: {"x": 1})
    assert m._manager_state_dict()["user"] == {"default": {"x": 1}}


# ----------------------------------------------------------------------------- protocols


def _protocol_methods(proto: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(proto).items()
        if callable(fn) and not name.startswith("__")
    }


@pytest.mark.parametrize(
    ("proto", "fake_name"),
    [
        (coordination.NativeManagerClient, "ManagerClient"),
        (coordination.NativeManagerServer, "ManagerServer"),
    ],
)
def test_fakes_implement_the_native_protocols(proto: type, fake_name: str) -> None:
    """The fakes offer every method of the protocol the Manager uses, with its parameters."""
    fake = getattr(FakeNative(), fake_name)
    for name, want in _protocol_methods(proto).items():
        got = inspect.signature(getattr(fake, name))
        assert list(got.parameters) == list(want.parameters), name
        for p in want.parameters.values():
            assert got.parameters[p.name].kind == p.kind, (name, p.name)


def test_fake_pending_implements_the_protocol() -> None:
    """The fake pending quorum has the protocol's methods."""
    for name, want in _protocol_methods(coordination.NativePendingQuorum).items():
        got = inspect.signature(getattr(FakePending, name))
        assert list(got.parameters) == list(want.parameters), name


# ----------------------------------------------------------------------------- construction


def test_constructor_wires_server_and_env(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 starts the server with the store address, port and a fresh replica id."""
    monkeypatch.setenv("TORCHFT_MANAGER_PORT", "0")
    h1 = harness()
    harness()
    s1, s2 = h1.native.servers
    assert s1.kwargs["bind"] == "[::]:0"
    assert s1.kwargs["store_addr"].startswith("127.0.0.1:")
    assert s1.kwargs["lighthouse_addr"] == "http://fake-lighthouse:1"
    assert s1.kwargs["replica_id"].startswith("rg0:")
    assert s1.kwargs["replica_id"] != s2.kwargs["replica_id"]
    assert h1.pg.timeout == timedelta(seconds=5)
    h1.manager.shutdown()
    assert s1.closed and h1.transport.closed and h1.pg.shut


def test_env_overrides(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHFT_*_SEC and TORCHFT_QUORUM_RETRIES override constructor arguments."""
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "7")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "3.5")
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "9")
    monkeypatch.setenv("TORCHFT_QUORUM_RETRIES", "4")
    h = harness(quorum_retries=1)
    kwargs = h.native.servers[0].kwargs
    assert kwargs["quorum_retries"] == 4
    assert kwargs["connect_timeout"] == timedelta(seconds=9)
    assert h.pg.timeout == timedelta(seconds=7)
    h.manager.start_quorum()
    assert h.manager.should_commit()
    assert h.native.quorum_calls[0]["timeout"] == timedelta(seconds=3.5)


def test_non_zero_rank_reads_published_address(
    harness: Any, store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-zero group rank starts no server and uses rank 0's published address and id."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    h0 = harness(rank=0)
    h1 = harness(rank=1)
    assert len(h0.native.servers) == 1
    assert h1.manager._replica_id == h0.manager._replica_id
    assert h1.manager._client.addr == "http://fake-manager:1"


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"min_replica_size": 0}, ValueError, "min_replica_size"),
        ({"min_replica_size": "2"}, TypeError, "min_replica_size"),
        ({"timeout": timedelta(0)}, ValueError, "timeout"),
        ({"quorum_timeout": 5}, TypeError, "quorum_timeout"),
        ({"connect_timeout": timedelta(seconds=-1)}, ValueError, "connect_timeout"),
        ({"max_retries": -1}, ValueError, "max_retries"),
        ({"quorum_retries": -1}, ValueError, "quorum_retries"),
        ({"rank": 3, "world_size": 2}, ValueError, "rank"),
        ({"world_size": 0}, ValueError, "world_size"),
        ({"port": 70000}, ValueError, "port"),
        ({"world_size_mode": "dynamic"}, TypeError, "world_size_mode"),
        ({"hang_action": "restart"}, ValueError, "hang_action"),
        ({"hang_action": 1}, TypeError, "hang_action"),
        ({"parity_every": -1}, ValueError, "parity_every"),
        ({"parity_every": 2.5}, TypeError, "parity_every"),
        ({"telemetry": "yes"}, TypeError, "telemetry"),
        ({"snapshot_dir": "gs://bucket/snaps"}, ValueError, "is a URL"),
        ({"snapshot_dir": ""}, ValueError, "snapshot_dir"),
        ({"snapshot_dir": "/d", "snapshot_every": 0}, ValueError, "snapshot_every"),
        ({"snapshot_dir": "/d", "snapshot_keep": 0}, ValueError, "snapshot_keep"),
        ({"snapshot_dir": "/d", "snapshot_every": "5"}, TypeError, "snapshot_every"),
    ],
)
def test_bad_arguments(harness: Any, kwargs: dict[str, Any], exc: type, match: str) -> None:
    """Invalid constructor arguments raise at once with a clear message."""
    with pytest.raises(exc, match=match):
        harness(**kwargs)


@pytest.mark.parametrize(
    ("backend", "missing"),
    [
        (object(), "object lacks ManagerServer, ManagerClient, set_log_context"),
        (
            SimpleNamespace(ManagerServer=FakeNative, ManagerClient=FakeNative, set_log_context=1),
            "SimpleNamespace lacks set_log_context",
        ),
    ],
)
def test_native_backend_is_checked_at_construction(
    store: TCPStore, backend: Any, missing: str
) -> None:
    """A native_backend that is no coordination.NativeBackend fails the constructor with a
    TypeError naming what it lacks, not the join on a later call."""
    with pytest.raises(TypeError, match=f"NativeBackend .*; {re.escape(missing)}$"):
        Harness(backend, {})


def test_missing_lighthouse(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No lighthouse address anywhere → ValueError naming TORCHFT_LIGHTHOUSE."""
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        harness()


def test_missing_rank_env(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No rank argument and no RANK env → ValueError."""
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="RANK"):
        harness()


def test_bad_env_override(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-numeric timeout override is rejected clearly."""
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "soon")
    with pytest.raises(ValueError, match="TORCHFT_TIMEOUT_SEC"):
        harness()
    monkeypatch.delenv("TORCHFT_TIMEOUT_SEC")
    monkeypatch.setenv("TORCHFT_TELEMETRY", "perhaps")
    with pytest.raises(ValueError, match="TORCHFT_TELEMETRY"):
        harness()


def test_structured_log_records(harness: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Quorum, commit and error records carry the structured fields."""
    caplog.set_level(logging.INFO)
    h = harness()
    m = h.manager
    m.start_quorum()
    assert m.should_commit()
    m.start_quorum()
    m.report_error(RuntimeError("injected"))
    assert not m.should_commit()
    by_name: dict[str, list[logging.LogRecord]] = {}
    for r in caplog.records:
        by_name.setdefault(r.name, []).append(r)
    q = by_name["torchft_quorums"][0]
    assert q.replica_id.startswith("rg0:") and q.rank == 0 and q.quorum_id == 1  # type: ignore[attr-defined]
    commits = by_name["torchft_commits"]
    assert [r.commit for r in commits] == [True, False]  # type: ignore[attr-defined]
    assert [r.step for r in commits] == [0, 1]  # type: ignore[attr-defined]
    assert "injected" in by_name["torchft_errors"][0].error  # type: ignore[attr-defined]
    assert all(hasattr(r, "job_id") for r in commits)


def test_heal_timeout_is_recorded_not_raised(harness: Any) -> None:
    """A TimeoutError while healing (not the quorum itself) is a step error, not raised."""
    h = harness()
    h.native.metadata_by_addr["http://src:1"] = "src"
    h.native.quorums = [_heal_quorum()]

    def slow_recv(*args: Any, **kwargs: Any) -> Any:
        raise TimeoutError("checkpoint fetch deadline")

    h.transport.recv_checkpoint = slow_recv  # type: ignore[method-assign]
    m = h.manager
    m.start_quorum()
    m.wait_quorum()
    assert "checkpoint fetch deadline" in str(m.errored())
    assert not m.should_commit()


def test_single_rank_group_votes_locally(harness: Any) -> None:
    """With one group rank the commit decision is the local vote (no server round trip)."""
    h = harness(world_size=1)
    m = h.manager
    m.start_quorum()
    assert m.should_commit()
    m.start_quorum()
    m.report_error(RuntimeError("boom"))
    assert not m.should_commit()
    assert h.native.commit_calls == []
    assert m.current_step() == 1
