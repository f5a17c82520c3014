"""Runtime state parity: every N committed steps, a digest of this rank's committed state.

Replica groups that committed the same step hold bit-identical state (the invariant the whole
protocol keeps). A bit flipped in memory, a bad kernel or a wrong heal breaks it without a
crash, and the group would train on unseen. So every ``parity_every`` committed steps
(``Manager(parity_every=)`` or ``TORCHFT_PARITY_EVERY``; 0 turns it off) each rank:

1. at the top of the next step (:meth:`StateParity.at_step_start`, from
   ``Manager.start_quorum``: the optimizer has applied the commit) starts hashing the tensors
   of its registered user state on a background thread (CRC-32 and Adler-32 of the bytes,
   8 bytes in all: checksums that find corruption, not tampering; zlib's sums, computed
   natively at several GB/s without the GIL; CUDA tensors are copied to the host on that
   thread). No copy is
   made: between the top of a step and its commit vote the step protocol leaves the state
   alone (the forward and backward passes read the parameters; the optimizer writes them
   after ``should_commit``), so the hash overlaps the step's compute;
2. before anything writes the state (the commit vote, after which the optimizer steps, and a
   heal loading into the tensors) the Manager waits for the hash (:meth:`StateParity.settle`):
   the training thread waits only when hashing takes longer than the step's compute;
3. the digest rides on a commit vote; the manager server gathers the group's ranks and sends
   them to the lighthouse, which compares groups (a group that disagrees with a strict
   majority heals from it; with no majority the groups stop with
   :class:`torchft.StateDivergedError`).

What is digested: every floating-point tensor (dtype, shape and raw bytes) of the state
dicts registered with the Manager, walked in sorted-key order, except batch-norm running
statistics (:data:`EXCLUDED_NAMES`: each group computes them from its own batches, and a
forward pass updates them in place). Other values (integer and byte tensors such as an RNG
state, plain numbers in an optimizer's ``param_groups``, a data loader's position) are left
out, since groups may legitimately hold different ones. A model with other floating-point
buffers that differ between groups by design must set ``parity_every=0``.
Local SGD and DiLoCo turn parity off: their groups differ between synchronisations by design.
With durable snapshots on, every snapshot step is digested as well: a snapshot is made
complete only once its own step's check agreed (see :mod:`torchft.snapshot`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from torchft._torchft import _digest_update

logger: logging.Logger = logging.getLogger(__name__)

#: Committed steps between two digests when nothing says otherwise.
DEFAULT_EVERY = 100

#: Bytes of one rank's digest (CRC-32, then Adler-32).
DIGEST_BYTES = 8

#: State dict entries left out of the digest (by the last part of their key): per-group
#: statistics that a forward pass updates in place.
EXCLUDED_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def _tensors(obj: Any, out: list[tuple[str, torch.Tensor]], path: str = "") -> None:
    """Collects the tensors of nested dicts / lists / tuples, keyed by their path."""
    if isinstance(obj, torch.Tensor):
        # Parameters and optimizer moments; not integer or byte tensors (an RNG state, a
        # counter), which groups may legitimately hold apart.
        if obj.is_floating_point() or obj.is_complex():
            out.append((path, obj))
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            if isinstance(k, str) and k.rsplit(".", 1)[-1] in EXCLUDED_NAMES:
                continue
            _tensors(obj[k], out, f"{path}/{k!r}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, out, f"{path}/{i}")


def digest_tensors(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """The digest of host (or device) tensors: their paths, dtypes, shapes and bytes.

    CRC-32 finds every flipped bit and every burst of up to 32; Adler-32 beside it makes a
    chance match of two different states far less likely still. Both are checksums against
    corruption, not hashes against tampering. The sums are zlib's (``zlib.crc32`` and
    ``zlib.adler32`` chained over the same bytes give the same digest); a tensor's bytes are
    summed natively, both sums over each piece while it is in cache, without the GIL.
    """
    crc, adler = 0, 1
    for path, t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        # The values, not their storage: a conjugate or negative view digests as the tensor
        # it reads as (the same values held materialised compare equal).
        t = t.resolve_conj().resolve_neg().contiguous()
        meta = f"{path}:{t.dtype}:{tuple(t.shape)};".encode()
        crc, adler = zlib.crc32(meta, crc), zlib.adler32(meta, adler)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            # ``t`` holds the memory for the call; the step protocol leaves it unchanged.
            crc, adler = _digest_update(crc, adler, t.data_ptr(), nbytes)
    return crc.to_bytes(4, "big") + adler.to_bytes(4, "big")


class StateParity:
    """One rank's parity digests (see the module docs).

    Args:
        every: committed steps between digests; 0 = off.
        state: returns the rank's registered user state (``{key: state_dict}``).
    """

    def __init__(self, every: int, state: Callable[[], dict[str, Any]]) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"parity_every must be an integer >= 0, got {every!r}")
        self._every = every
        self._state = state
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[bytes] | None = None
        self._running_step = 0
        self._ready: tuple[int, bytes] | None = None
        self._last_step = 0
        self._off_reason: str | None = None if every else "parity_every=0"
        # Further steps to digest (durable snapshot steps: a snapshot waits for its check).
        self._also: Callable[[int], bool] | None = None

    @property
    def every(self) -> int:
        """Committed steps between digests (0 when off)."""
        return 0 if self._off_reason is not None else self._every

    def disable(self, why: str) -> None:
        """Turns parity off for good (e.g. Local SGD: groups differ between syncs)."""
        if self._off_reason is None:
            logger.info("state parity off: %s", why)
        self._off_reason = why

    def also_digest(self, due: Callable[[int], bool]) -> None:
        """Digests the steps ``due`` names as well (every group must name the same ones):
        durable snapshot steps, so a snapshot's own state is checked before it is complete."""
        self._also = due

    def at_step_start(self, step: int) -> None:
        """Called at the top of every step with the committed step count: starts hashing the
        state when ``step`` is a parity step (or one :meth:`also_digest` names) not yet
        digested."""
        if self._off_reason is not None or step <= 0:
            return
        if step % self._every and not (self._also is not None and self._also(step)):
            return
        if step <= self._last_step:
            return
        self.settle()
        self._last_step = step
        tensors: list[tuple[str, torch.Tensor]] = []
        _tensors(self._state(), tensors)
        tensors = [(p, t.detach()) for p, t in tensors]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchft_parity")
        self._running = self._pool.submit(digest_tensors, tensors)
        self._running_step = step

    def settle(self) -> None:
        """Waits for the hash in progress (call before anything writes the state)."""
        fut = self._running
        if fut is None:
            return
        try:
            fut.result()
        except Exception:
            pass  # reported by _collect
        self._collect()

    def _collect(self) -> None:
        fut = self._running
        if fut is None or not fut.done():
            return
        self._running = None
        try:
            self._ready = (self._running_step, fut.result())
        except Exception:
            logger.exception("state digest of step %d failed", self._running_step)

    def take(self) -> tuple[int, bytes] | None:
        """The finished digest not yet handed over, as ``(step, digest)``."""
        self._collect()
        ready, self._ready = self._ready, None
        return ready

    def shutdown(self) -> None:
        """Stops the background thread (a digest in flight is dropped)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
