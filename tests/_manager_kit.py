"""Fakes and fixtures for the unit tests of torchft.manager.Manager (no lighthouse, no real
collectives).

The native manager server/client are replaced by an in-memory fake that returns crafted
quorum results; the process group is a fake that records calls and can fail on demand; the
checkpoint transport keeps state dicts in memory. A real TCPStore (port 0) carries the manager
address, as in production.

A test module takes the fixtures by importing them (pytest finds them by name there)::

    from _manager_kit import (  # noqa: F401 - fixtures
        harness_fixture,
        master_store_fixture,
        native_fixture,
        store_fixture,
    )

``master_store`` is module-scoped: each importing module gets its own store.
"""

from __future__ import annotations

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

from torchft.manager import Manager


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
    quorum_waits: list[tuple[int, float]] = field(default_factory=list)
    commit_result: bool | None = None  # None: echo the local vote
    metadata_by_addr: dict[str, str] = field(default_factory=dict)
    servers: list[Any] = field(default_factory=list)
    quorum_delay: float = 0.0
    lease: bool = True
    log_context: tuple[str, int] | None = None
    busy_calls: list[bool] = field(default_factory=list)
    server_quorum_starts: int = 0

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

            def _quorum_start(
                self, request: Any = None, timeout: timedelta | None = None, **fields: Any
            ) -> FakePending:
                # A group of one rank starts its quorum here (quorum_group.quorum_sender).
                native.server_quorum_starts += 1
                return ManagerClient(self.address(), timedelta(0))._quorum_start(
                    request, timeout, **fields
                )

            def _offer_digest(self, group_rank: int, step: int, digest: bytes) -> None:
                native.digests.append((group_rank, step, digest))

            def _note_quorum_wait(self, step: int, seconds: float) -> None:
                native.quorum_waits.append((step, seconds))

            def describe(self) -> str:
                return "fake manager server"

            def hung(self) -> str | None:
                return None

            def parity_verdicts(self) -> tuple[bool, int, int]:
                return (False, 0, 0)  # as from an upstream lighthouse: nothing checked

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


@pytest.fixture(scope="module", name="master_store")
def master_store_fixture() -> Iterator[TCPStore]:
    """One real TCPStore on port 0 for the module (each test publishes its own address)."""
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s
    del s


@pytest.fixture(name="store")
def store_fixture(master_store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
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


@pytest.fixture(name="native")
def native_fixture() -> FakeNative:
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


@pytest.fixture(name="harness")
def harness_fixture(store: TCPStore, native: FakeNative) -> Iterator[Any]:
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
