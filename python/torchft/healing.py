"""Healing and the torn-state policy of one rank: fetching a live peer's state, receiving it
into this group's own tensors only while that loses nothing, and refusing to train on a
state that a failed heal left partly overwritten.

The :class:`Healer` owns what the rank knows about its local state as one explicit
:class:`LocalState` (and the fatal error that ends the process when nothing can make a torn
state whole again). The Manager hands it the checkpoint transport, the state's read/write
lock and callables for what it needs of the step (the served state, the counters' loader,
the registered loaders, the readers to settle, telemetry); the Healer never reaches back
into the Manager. See docs/healing.md.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from torchft.errors import TornStateError

if TYPE_CHECKING:
    from torchft.checkpointing import CheckpointTransport
    from torchft.config import ManagerConfig
    from torchft.coordination import NativeBackend, NativeQuorumResult
    from torchft.group_snapshots import GroupSnapshots
    from torchft.snapshot import Snapshot
    from torchft.state_lock import ReadWriteLock
    from torchft.telemetry import RankTelemetry

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

#: A call to a heal source is retried in slices this long, checking whether it was lost.
SOURCE_POLL_S = 1.0


def heal_address(metadata: str) -> str:
    """``host:port`` of a checkpoint URL, the address a heal fetched from ("" when the
    transport's metadata is no URL, e.g. ``PGTransport``'s)."""
    with contextlib.suppress(ValueError):
        url = urllib.parse.urlsplit(metadata)
        if url.scheme in ("http", "https") and url.hostname:
            return url.netloc.rpartition("@")[2]
    return ""


def group_name(incarnation: str) -> str:
    """The user-given name of a replica group incarnation (``{name}:{uuid}`` → ``name``)."""
    base, sep, tail = incarnation.rpartition(":")
    if sep:
        try:
            uuid.UUID(tail)
            return base
        except ValueError:
            pass
    return incarnation


class LocalState(enum.Enum):
    """What this rank's local state is, as far as healing is concerned.

    ``STARTUP``: what the process's start-up produced (initialised, or loaded from a durable
    checkpoint): a restart gives it back, so a heal may write into it. ``TRAINED``: a step
    committed, or a heal or a snapshot was applied, since: it may be the best state left.
    The torn forms: a heal that wrote into the tensors (or applying a healed state) failed
    midway; the group does not train until a heal makes it whole.
    """

    STARTUP = "startup"
    TRAINED = "trained"
    TORN_STARTUP = "torn_startup"
    TORN = "torn"

    @property
    def startup(self) -> bool:
        """Whether a restart would reproduce this state (the tensors may be torn)."""
        return self in (LocalState.STARTUP, LocalState.TORN_STARTUP)

    @property
    def torn(self) -> bool:
        """Whether part of the tensors holds bytes of a heal that did not finish."""
        return self in (LocalState.TORN_STARTUP, LocalState.TORN)

    def tear(self) -> LocalState:
        """The state after a failed write into the tensors."""
        return LocalState.TORN_STARTUP if self.startup else LocalState.TORN

    def left_startup(self) -> LocalState:
        """The state once a step committed or a snapshot was applied."""
        return LocalState.TORN if self.torn else LocalState.TRAINED


class Healer:
    """Heals one rank from a live peer and keeps the torn-state policy (see module doc)."""

    def __init__(
        self,
        *,
        native: NativeBackend,
        state_lock: ReadWriteLock,
        served_state: Callable[[], dict[str, Any]],
        load_counters: Callable[[dict[str, int]], None],
        loaders: dict[str, Callable[[Any], None]],
        settle_readers: Callable[[], None],
        in_torchft: Callable[[], AbstractContextManager[None]],
        telemetry: Callable[[], RankTelemetry | None],
        step: Callable[[], int],
        log_info: Callable[..., None],
        group_rank: int,
        timeout: timedelta,
        connect_timeout: timedelta,
        apply_at_once: bool,
    ) -> None:
        """Creates the healer; :meth:`attach` gives it the transport before the first heal.

        Args:
            native: makes the client of a heal source's manager server.
            state_lock: the state's read/write lock (held for writing while a heal writes
                into this group's own tensors).
            served_state: the full state (``{"user": ..., "torchft": ...}``) as served.
            load_counters: loads the ``"torchft"`` section (the step counters).
            loaders: the registered user-state loaders, by key (read at each apply).
            settle_readers: waits for background readers of the state (parity, snapshots).
            in_torchft: context marking the loop as inside torchft (hang watch).
            telemetry: the rank's telemetry, if any.
            step: the current step.
            log_info: the Manager's prefixed info logger.
            group_rank: this rank in its replica group.
            timeout: deadline of a heal's metadata request and transfer.
            connect_timeout: deadline for connecting to the source's manager server.
            apply_at_once: load a healed state at once (synchronous quorum) instead of at
                the step's vote.
        """
        self._native = native
        self._state_lock = state_lock
        self._served_state = served_state
        self._load_counters = load_counters
        self._loaders = loaders
        self._settle_readers = settle_readers
        self._in_torchft = in_torchft
        self._telemetry = telemetry
        self._step = step
        self._log_info = log_info
        self._group_rank = group_rank
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._apply_at_once = apply_at_once
        self._transport: CheckpointTransport[dict[str, Any]] | None = None
        self._own_transport = False
        self._lock = threading.Lock()
        self._state = LocalState.STARTUP
        self._fatal: TornStateError | None = None
        #: Whether this step healed (reported in the step's telemetry).
        self.healed = False
        # A healed (or restored) user state not loaded yet, and a loaded snapshot that
        # applies after the vote of the step that loaded it.
        self._pending: dict[str, Any] | None = None
        self._pending_restore: tuple[Snapshot, dict[str, Any], Callable[[], bool]] | None = None
        # The quorum whose answer last looked for a durable snapshot (see restore).
        self._restore_quorum: int | None = None
        # The replica group being healed from, and the flag that ends the heal when the
        # lighthouse declares it lost.
        self._source: str | None = None
        self._source_lost = threading.Event()

    def attach(
        self, transport: CheckpointTransport[dict[str, Any]], own: bool = False
    ) -> CheckpointTransport[dict[str, Any]]:
        """Sets the checkpoint transport and returns it; ``own``: it is the default one,
        whose in-place rule is :meth:`heal_into`'s (see :meth:`receives_in_place`)."""
        self._transport = transport
        self._own_transport = own
        return transport

    def attach_default(
        self, cfg: ManagerConfig, hostname_given: bool
    ) -> CheckpointTransport[dict[str, Any]]:
        """Builds the default transport (:func:`default_transport`), attaches it as its own
        and returns it."""
        return self.attach(default_transport(cfg, self, self._state_lock, hostname_given), True)

    def _tx(self) -> CheckpointTransport[dict[str, Any]]:
        assert self._transport is not None, "Healer.attach() was not called"
        return self._transport

    # ------------------------------------------------------------------ the state

    @property
    def state(self) -> LocalState:
        """The local state's condition."""
        return self._state

    @property
    def restore_quorum(self) -> int | None:
        """The quorum whose answer last looked for a durable snapshot (see :meth:`restore`)."""
        return self._restore_quorum

    @property
    def fatal(self) -> TornStateError | None:
        """The error that ends the process: a torn state nothing can heal again."""
        return self._fatal

    @property
    def has_pending(self) -> bool:
        """Whether a healed user state waits to be loaded."""
        return self._pending is not None

    def _set(self, state: LocalState) -> None:
        with self._lock:
            self._state = state

    def _tear(self) -> None:
        with self._lock:
            self._state = self._state.tear()

    def new_step(self) -> None:
        """A step begins. A heal whose step did not commit (an error after it) left its user
        state unloaded while the counters already name its step: it is loaded now, before
        the step's forward pass, so the gradients this group contributes are taken on it.
        So is a loaded snapshot whose step's vote raised before it could be applied."""
        self.healed = False
        # The other ranks applied theirs after their vote; a step is never committed past a
        # loaded snapshot.
        self.apply_restore()
        self.apply_pending()

    def committed(self) -> None:
        """A step committed: the state is no longer the one start-up produced."""
        with self._lock:
            self._state = self._state.left_startup()

    def check_trainable(self, heal: bool, allow_heal: bool, quorum_heal: bool) -> None:
        """Refuses a step on a torn state unless this quorum heals it.

        Raises:
            TornStateError: no up-to-date group is left to heal it (kept as :attr:`fatal`).
            RuntimeError: the state is torn and this step does not heal.
        """
        if not self._state.torn or heal:
            return
        if allow_heal and not quorum_heal:
            # No group ahead of this one is left (the lighthouse no longer waits for one):
            # nothing can make the state whole again, and a restart reproduces what the heal
            # began from. End the process instead of failing every step.
            self._fatal = TornStateError(
                "this replica group's state was partly overwritten by a heal that "
                "failed, and no up-to-date replica group is left to heal it again: "
                "restart the group (it then starts as it did before the heal, or loads "
                "a durable checkpoint)"
            )
            raise self._fatal
        raise RuntimeError(
            "this replica group's state was partly overwritten by a heal that failed; "
            "it does not train until a heal makes it whole"
        )

    # ------------------------------------------------------------------ a heal

    def heal_into(self) -> dict[str, Any] | None:
        """The state the default transport receives a heal into (None: new tensors).

        The group's own tensors while this process has neither committed a step nor applied
        a heal: its state is then the one its start-up produced (initialised, or loaded from
        a durable checkpoint), which a restart reproduces, so a heal that fails midway and
        leaves the tensors torn loses nothing a restart would not give back. This is the
        common heal (a restarted group catching up) and it needs no memory beyond the
        group's own tensors. After that, the state may be the best one left if the source
        is lost midway: the heal then receives into new tensors and leaves it whole.
        """
        if not self._state.startup:
            return None
        return self._served_state()

    def receives_in_place(self) -> bool:
        """Whether the next heal writes into this group's own tensors."""
        if self._own_transport:
            return self._state.startup
        return bool(getattr(self._transport, "receives_in_place", False))

    def source_lost(self, replica_id: str) -> None:
        """The lighthouse declared ``replica_id`` lost: a heal from it ends now (its state
        will never arrive; the next quorum picks another source)."""
        with self._lock:
            if replica_id != self._source:
                return
            self._source_lost.set()
        try:
            self._tx().abort_recv()
        except Exception:
            logger.exception("aborting the checkpoint transfer failed")

    def serve(self, quorum: NativeQuorumResult, max_step: int) -> None:
        """Offers this group's state of step ``max_step`` to the groups the quorum names to
        heal from it (nothing when it names none)."""
        dst_ranks = list(quorum.recover_dst_replica_ranks)
        if not dst_ranks:
            return
        self._log_info("serving checkpoint of step %d to replicas %s", max_step, dst_ranks)
        self._tx().send_checkpoint(
            dst_ranks=dst_ranks,
            step=max_step,
            state_dict=self._served_state(),
            timeout=self._timeout,
        )

    def heal(
        self, quorum: NativeQuorumResult, max_step: int, was_lost: Callable[[str], bool]
    ) -> None:
        """Fetches the live state of step ``max_step`` from the quorum's recovery source.

        The counters apply at once (the vote is for the healed step); the user state applies
        now with a synchronous quorum, else at the vote (:meth:`apply_pending`).

        Args:
            quorum: the quorum answer naming the source.
            max_step: the step healed to.
            was_lost: whether a replica group was already declared lost from this quorum.
        """
        # However long the heal takes (also on the quorum thread), the loop is not away.
        with self._in_torchft():
            self._heal(quorum, max_step, was_lost)

    def _heal(
        self, quorum: NativeQuorumResult, max_step: int, was_lost: Callable[[str], bool]
    ) -> None:
        self.healed = True
        src_rank = quorum.recover_src_replica_rank
        src_addr = quorum.recover_src_manager_address
        if src_rank is None or not src_addr:
            raise RuntimeError(f"told to heal without a recovery source: {quorum}")
        self._log_info("healing from replica %d (%s) at step %d", src_rank, src_addr, max_step)
        tel = self._telemetry()
        if tel is not None:
            tel.heal_started(self._step(), quorum.quorum_id)
        heal_t0 = time.perf_counter()
        replica_ids = list(quorum.replica_ids)
        src_id = replica_ids[src_rank] if 0 <= src_rank < len(replica_ids) else None
        with self._lock:
            self._source_lost.clear()
            self._source = src_id
        # After naming the source: a loss recorded before is seen here, one after sets the
        # flag (the loss is recorded before the source is compared).
        try:
            if src_id is not None and was_lost(src_id):
                raise ConnectionError(f"heal source {src_id} was lost before the heal began")
            received, addr, in_place = self._fetch(src_rank, src_addr, max_step)
        finally:
            with self._lock:
                self._source = None
        heal_s = time.perf_counter() - heal_t0
        source = group_name(src_id) if src_id is not None else src_addr
        heal_bytes = tel.heal_done(heal_s, received, source, addr) if tel is not None else 0
        self._log_info(
            "healed to step %d from %s: %d bytes in %.3fs (%.3f GB/s) into %s tensors",
            max_step,
            f"{source} at {addr}" if addr else source,
            heal_bytes,
            heal_s,
            heal_bytes / heal_s / 1e9 if heal_s > 0 else 0.0,
            "its own" if in_place else "new",
        )
        # The counters apply at once so the commit vote is for the healed step.
        self._load_counters(received["torchft"])
        with self._lock:
            # The healed state is no start-up state: if its source dies, it may be the best
            # left.
            self._state = LocalState.TRAINED
            self._fatal = None
        self._pending = received["user"]
        if self._apply_at_once:
            self.apply_pending()

    def _fetch(self, src_rank: int, src_addr: str, max_step: int) -> tuple[Any, str, bool]:
        """Receives the source's state: (the state, the address it came from, in place)."""
        src_client = self._native.ManagerClient(src_addr, connect_timeout=self._connect_timeout)
        metadata = self._until_source_lost(
            lambda t: src_client._checkpoint_metadata(self._group_rank, timeout=t),
            f"checkpoint metadata from {src_addr}",
        )
        addr = heal_address(metadata)
        self._log_info(
            "fetching the checkpoint of step %d from replica %d at %s",
            max_step,
            src_rank,
            addr or metadata,
        )
        in_place = self.receives_in_place()
        transport = self._tx()
        try:
            with self._writing_state(in_place):
                received = transport.recv_checkpoint(
                    src_rank=src_rank, metadata=metadata, step=max_step, timeout=self._timeout
                )
            if (
                not isinstance(received, dict)
                or "torchft" not in received
                or "user" not in received
            ):
                raise RuntimeError("received a checkpoint without 'torchft'/'user' sections")
        except BaseException:
            # A transport that says the receive failed before writing into this group's
            # tensors (e.g. the source died before sending its header) left them whole.
            if in_place and getattr(transport, "touched_local_state", True):
                # Part of this group's tensors may hold the source's bytes now: only a later
                # heal makes the state whole again (see check_trainable).
                self._tear()
            raise
        return received, addr, in_place

    @contextmanager
    def _writing_state(self, in_place: bool) -> Iterator[None]:
        """Holds the state's write lock while a receive writes into this group's own tensors,
        so an optimizer step on the training thread (a DiLoCo inner step during an async
        quorum) waits instead of racing it, and no reader serves the half-written state."""
        if not in_place or self._state_lock.held_by_me():
            if in_place:
                self._settle_readers()
            yield
            return
        self._settle_readers()
        if not self._state_lock.acquire_write(self._timeout.total_seconds()):
            raise TimeoutError(
                f"the state stayed locked by a writer for {self._timeout}; cannot heal into it"
            )
        try:
            yield
        finally:
            self._state_lock.release_write()

    def _until_source_lost(self, call: Callable[[timedelta], T], what: str) -> T:
        """Runs ``call(timeout)`` within ``timeout`` in slices of at most a second, so a
        source that is stopped (alive to TCP, silent) is abandoned within a second of being
        declared lost instead of at the timeout.

        Raises:
            ConnectionError: the heal source was declared lost.
            TimeoutError: ``timeout`` passed.
        """
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            if self._source_lost.is_set():
                raise ConnectionError(f"{what}: the heal source was declared lost")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} did not answer within {self._timeout}")
            try:
                return call(timedelta(seconds=min(remaining, SOURCE_POLL_S)))
            except TimeoutError:
                continue

    def apply_pending(self) -> None:
        """Loads a healed user state into the registered loaders (if one waits)."""
        pending = self._pending
        if pending is None:
            return
        self._settle_readers()
        self._pending = None
        try:
            missing = set(self._loaders) - set(pending)
            if missing:
                raise RuntimeError(f"healed checkpoint lacks state for keys {sorted(missing)}")
            for key, load_fn in self._loaders.items():
                load_fn(pending[key])
        except BaseException:
            # The counters name the healed step but the state is not (all) of it: the group
            # does not train on it until a heal makes it whole (see check_trainable).
            self._tear()
            raise
        self._log_info("applied healed state (%d keys)", len(pending))

    # ------------------------------------------------------------------ durable snapshots

    def restore(
        self, snapshots: GroupSnapshots, quorum_id: int, max_step: int, step: int
    ) -> Snapshot | None:
        """Loads the newest usable snapshot newer than every live group's state, if any
        (see :meth:`GroupSnapshots.restore`); it applies after this step's vote.

        Looks at every quorum answer while the process holds its start-up state, and at
        the first answer of each new quorum after that: a trained group falls behind a
        snapshot only when the groups that held newer steps left, which changes the quorum
        (a laggard whose leaders died resumes from their snapshot instead of redoing the
        steps since its own; a failed step also gives the next quorum a new id, so a
        trained group looks again after one). Every rank of the group gets the same
        answers, so every rank looks at the same ones (group rank 0's choice is shared
        through the store).

        A trained group whose choice or load failed keeps its state (nothing was applied,
        and no rank applies a snapshot that not every rank loaded): the failure is logged
        and the group trains on from its own step.

        Raises:
            TornStateError: the choice or the load failed on a rank in its start-up state
                (a restart of the group loses nothing and chooses again).
        """
        startup = self._state.startup
        if not startup and quorum_id == self._restore_quorum:
            return None
        self._restore_quorum = quorum_id
        try:
            loaded = snapshots.restore(
                quorum_id, max_step, step, set(self._loaders), self._served_state, startup
            )
        except Exception as e:
            if not startup:
                logger.warning(
                    "restoring a durable snapshot under quorum %d failed on group rank %d "
                    "(%s: %s); this group keeps its state and trains on from step %d",
                    quorum_id,
                    self._group_rank,
                    type(e).__name__,
                    e,
                    step,
                )
                return None
            self._fatal = TornStateError(
                f"restoring a durable snapshot failed on group rank {self._group_rank}: "
                f"{type(e).__name__}: {e}; restart the group"
            )
            raise self._fatal from e
        if loaded is None:
            return None
        self._pending_restore = (*loaded, lambda: snapshots.agreed(quorum_id))
        return loaded[0]

    def apply_restore(self) -> None:
        """Applies a loaded snapshot (after the vote of the step that loaded it)."""
        pending = self._pending_restore
        self._pending_restore = None
        if pending is None:
            return
        snap, state, agreed = pending
        if not agreed():
            logger.warning(
                "not every rank of this group loaded its part of the snapshot of step %d "
                "(%s): none applies it, and the group trains on from its own step",
                snap.step,
                snap.path,
            )
            return
        self._settle_readers()
        self._load_counters(state["torchft"])
        self._pending = state["user"]
        try:
            self.apply_pending()
        except Exception as e:
            # Part of the snapshot may be loaded, and no live group holds a state to heal
            # from (that is why it was loaded): only a restart makes the state whole.
            self._fatal = TornStateError(
                f"applying the snapshot of step {snap.step} from {snap.path} failed: "
                f"{type(e).__name__}: {e}; restart the group"
            )
            raise self._fatal from e
        # The failed step still counts in commit_failures: the next quorum gets a new id,
        # so the process group aborted after this step is rebuilt on a fresh store prefix.
        # A whole state was applied: a torn one (a failed heal before) is whole again.
        self._set(LocalState.TRAINED)
        self._log_info("resumed from the snapshot of step %d (%s)", snap.step, snap.path)


def default_transport(
    cfg: ManagerConfig, healer: Healer, state_lock: ReadWriteLock, hostname_given: bool
) -> CheckpointTransport[dict[str, Any]]:
    """The Manager's default transport: ``HTTPTransport``, receiving a heal into this group's
    own tensors while that loses nothing (see :meth:`Healer.heal_into`)."""
    from torchft.checkpointing import HTTPTransport
    from torchft.config import heal_ifname

    return HTTPTransport(
        timeout=cfg.timeout,
        num_chunks=0,
        state_dict=healer.heal_into,
        state_dict_lock=state_lock.read,
        state_version=state_lock.version,
        # A given host name wins over the heal interface; without one, the transport serves
        # on the interface's address (docs/healing.md).
        hostname=cfg.hostname if hostname_given or heal_ifname() is None else None,
    )
