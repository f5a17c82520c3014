"""Fault-tolerant LocalSGD and DiLoCo (including streaming DiLoCo) on top of a ``Manager``.

Both are context managers around an ordinary inner training loop: they hook the inner
optimizer's ``step`` and, every ``sync_every`` inner steps, synchronise the replica groups
through the manager. Only a synchronisation is a fault-tolerant step: it starts a quorum,
allreduces, and keeps its result only if ``manager.should_commit()`` says the step committed.
Inner steps never talk to other replica groups.

* :class:`LocalSGD` averages the parameters themselves.
* :class:`DiLoCo` averages *pseudo-gradients* (the last global parameters minus the local
  ones) and applies them with an outer optimizer. With several model fragments it is
  streaming DiLoCo: one fragment syncs at a time, in turn, and each fragment's allreduce may
  overlap the next ``fragment_sync_delay`` inner steps.

Healing: DiLoCo registers each fragment's state with the manager under upstream torchft's
keys and layout (``StreamingDiLoCoFragment_{i}``: ``{"original_parameters": {name: tensor},
"outer_optimizer": optimizer state dict}``), so a replica group that restarts mid-run receives
it together with the user's model and inner optimizer and then matches its peers bit for bit,
and heals and checkpoints cross between this package and upstream's. LocalSGD registers no
state of its own (as upstream): its state is the user's model and optimizer. Which fragment
syncs next follows the manager's committed step, which heals with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch
from torch import nn, optim
from torch.distributed import Work
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from torchft.manager import Manager

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["DiLoCo", "LocalSGD"]

# Upstream torchft's key for fragment ``i``'s state in the manager's user state dict.
_FRAGMENT_KEY = "StreamingDiLoCoFragment_{}"
_MiB = 1024 * 1024
# Default size of one pseudo-gradient bucket when ``use_bucketization`` is on.
_DEFAULT_BUCKET_CAP_MB = 32


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard (sharing storage), else ``t``."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


def _check_sync_every(sync_every: object) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    return sync_every


def _check_manager(manager: object) -> Manager:
    for name in ("start_quorum", "allreduce", "should_commit", "register_state_dict_fn"):
        if not callable(getattr(manager, name, None)):
            raise TypeError(f"manager must be a torchft Manager, got {type(manager).__name__}")
    # Between synchronisations the groups hold different inner states by design: comparing
    # their committed states (runtime state parity) would call every group diverged.
    parity = getattr(manager, "_parity", None)
    if parity is not None:
        parity.disable("Local SGD / DiLoCo: replica groups differ between synchronisations")
    return manager  # type: ignore[return-value]


class _InnerLoop:
    """The context manager of :class:`LocalSGD` and :class:`DiLoCo`: while it is entered,
    hooks on the inner optimizer's ``step`` drive the synchronisations."""

    def __init__(self) -> None:
        self._hooks: list[RemovableHandle] = []

    def _hook(self) -> list[RemovableHandle]:
        """Registers the hooks on the inner optimizer (on entering)."""
        raise NotImplementedError

    def _left(self) -> None:
        """Called on leaving, once the hooks are removed."""

    def __enter__(self: _Loop) -> _Loop:
        if self._hooks:
            raise RuntimeError(f"{type(self).__name__} is already entered")
        self._hooks = self._hook()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._left()
        return False


_Loop = TypeVar("_Loop", bound=_InnerLoop)


class LocalSGD(_InnerLoop):
    """Averages the model's parameters across replica groups every ``sync_every`` steps.

    Use it as a context manager around the inner loop. After every ``sync_every``-th call of
    ``optimizer.step()`` it starts a quorum, averages the parameters across the participating
    replica groups, and writes the average into the model only if the step commits; if it does
    not (a peer failed, the quorum changed), the local parameters are kept and the next sync
    tries again.

    With ``use_async_quorum=True`` (the manager's default) a replica group that joins heals in
    the background and its first sync is discarded; with ``use_async_quorum=False`` it heals
    before it takes part.
    """

    def __init__(
        self,
        manager: Manager,
        model: nn.Module,
        optimizer: optim.Optimizer,
        sync_every: int,
    ) -> None:
        """Wraps a model and its optimizer.

        Args:
            manager: the Manager of this replica group.
            model: the model whose parameters are averaged.
            optimizer: the optimizer whose ``step`` counts inner steps.
            sync_every: number of inner steps between syncs (>= 1).

        Raises:
            ValueError: ``sync_every`` is not a positive int.
            TypeError: ``manager``, ``model`` or ``optimizer`` has the wrong type.
        """
        self._manager = _check_manager(manager)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, optim.Optimizer):
            raise TypeError(f"optimizer must be a torch Optimizer, got {type(optimizer).__name__}")
        self._model = model
        self._local_optimizer = optimizer
        self._sync_every = _check_sync_every(sync_every)
        self._local_step = 0
        super().__init__()

    def _hook(self) -> list[RemovableHandle]:
        return [self._local_optimizer.register_step_post_hook(self._step_post_hook)]

    def _step_post_hook(
        self, _optim: optim.Optimizer, _args: tuple[Any, ...], _kwargs: dict[str, Any]
    ) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Starts a quorum and averages the parameters now (keeping them only on commit)."""
        self._manager.start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        averaged = self._average()
        if self._manager.should_commit():
            with torch.no_grad():
                for p, avg in zip(self._model.parameters(), averaged, strict=True):
                    _local(p.data).copy_(avg)

    def _average(self) -> list[torch.Tensor]:
        """Allreduces a copy of every parameter (the model itself is untouched)."""
        copies: list[torch.Tensor] = []
        works: list[Work] = []
        with torch.no_grad():
            for p in self._model.parameters():
                copy = _local(p.data).detach().clone()
                works.append(self._manager.allreduce(copy))
                copies.append(copy)
        for work in works:
            work.wait()
        return copies


class _Fragment:
    """One model fragment of DiLoCo: its global parameters, outer optimizer and allreduce."""

    def __init__(
        self,
        manager: Manager,
        index: int,
        module: nn.Module,
        outer_optimizer: optim.Optimizer,
        backup_device: torch.device | None,
        pin_memory: bool,
        bucket_bytes: int | None,
        should_quantize: bool,
        alpha: float,
    ) -> None:
        self.index = index
        self._manager = manager
        self.module = module
        self.outer_optimizer = outer_optimizer
        self._bucket_bytes = bucket_bytes
        self._should_quantize = should_quantize
        self._alpha = alpha
        self.params: list[tuple[str, nn.Parameter]] = list(module.named_parameters())
        if not self.params:
            raise ValueError(f"model fragment {index} has no parameters")
        # The global parameters as of the last committed sync of this fragment (the point
        # the pseudo-gradient is measured from, and what a failed sync falls back to).
        self.global_params: dict[str, torch.Tensor] = {}
        device = backup_device or torch.device("cpu")
        for name, p in self.params:
            local = _local(p.data)
            t = torch.empty(local.shape, dtype=local.dtype, device=device)
            if pin_memory and t.device.type == "cpu" and torch.cuda.is_available():
                t = t.pin_memory()
            self.global_params[name] = t
        self._pseudo_grads: dict[str, torch.Tensor] = {}
        self._works: list[Work] = []
        self._unpack: list[tuple[torch.Tensor, list[tuple[torch.Tensor, int, int]]]] = []

    # ---- global parameters -------------------------------------------------------------

    def save_global(self) -> None:
        with torch.no_grad():
            for name, p in self.params:
                self.global_params[name].copy_(_local(p.data))

    def _restore_global(self) -> None:
        with torch.no_grad():
            for name, p in self.params:
                _local(p.data).copy_(self.global_params[name])

    # ---- state (upstream torchft's layout) ---------------------------------------------

    @property
    def key(self) -> str:
        """The key of this fragment's state in the manager's user state dict."""
        return _FRAGMENT_KEY.format(self.index)

    def state_dict(self) -> dict[str, Any]:
        """``{"original_parameters": {name: global tensor}, "outer_optimizer": state dict}``
        (tensors by reference: the manager serialises them under its read lock)."""
        return {
            "original_parameters": dict(self.global_params),
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a state in the layout of :meth:`state_dict` (from a peer or a checkpoint).

        Raises:
            ValueError: the state's parameter names are not this fragment's.
        """
        params = state["original_parameters"]
        if set(params) != set(self.global_params):
            missing = sorted(set(self.global_params) - set(params))
            extra = sorted(set(params) - set(self.global_params))
            raise ValueError(
                f"{self.key} holds other parameters than model fragment {self.index} "
                f"(missing {missing}, unexpected {extra}): every replica group must split "
                "the same model into the same fragments"
            )
        with torch.no_grad():
            for name, t in params.items():
                self.global_params[name].copy_(t)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])

    # ---- one sync ----------------------------------------------------------------------

    def prepare(self) -> None:
        """Computes the pseudo-gradients and starts their allreduce (without waiting)."""
        if self._works:
            raise RuntimeError(f"fragment {self.index} already has an allreduce in flight")
        with torch.no_grad():
            for name, p in self.params:
                local = _local(p.data)
                self._pseudo_grads[name] = self.global_params[name].to(local.device) - local
        grads = list(self._pseudo_grads.values())
        if self._bucket_bytes is None:
            for g in grads:
                self._works.append(
                    self._manager.allreduce(g, should_quantize=self._should_quantize)
                )
            return
        for flat, members in _buckets(grads, self._bucket_bytes):
            self._works.append(self._manager.allreduce(flat, should_quantize=self._should_quantize))
            self._unpack.append((flat, members))

    def wait_allreduce(self) -> None:
        """Waits for the allreduce in flight (it stays pending for :meth:`finish`)."""
        for work in self._works:
            work.wait()

    def finish(self) -> bool:
        """Waits for the allreduce, votes, and on commit applies the outer step.

        Every outcome leaves the fragment at its global parameters: the new ones on commit
        (mixed with the local ones by ``fragment_update_alpha``), the previous ones otherwise.

        Returns:
            Whether the sync committed.
        """
        if not self._works:
            raise RuntimeError(f"fragment {self.index} has no allreduce in flight")
        works, self._works = self._works, []
        for work in works:
            work.wait()
        with torch.no_grad():
            for flat, members in self._unpack:
                for t, offset, numel in members:
                    t.copy_(flat[offset : offset + numel].view_as(t))
        self._unpack.clear()
        committed = self._manager.should_commit()
        # A peer reading our state for healing must not see it half-updated.
        self._manager.disallow_state_dict_read()
        try:
            local_now = (
                {name: _local(p.data).detach().clone() for name, p in self.params}
                if committed and self._alpha > 0
                else {}
            )
            self._restore_global()
            if committed:
                # Only this fragment's pseudo-gradients: an outer optimizer shared by all
                # fragments must not apply the inner gradients left on the other fragments.
                self.outer_optimizer.zero_grad(set_to_none=True)
                for name, p in self.params:
                    p.grad = _as_param_grad(p, self._pseudo_grads[name])
                self.outer_optimizer.step()
                self.save_global()
                if local_now:
                    with torch.no_grad():
                        for name, p in self.params:
                            _local(p.data).lerp_(local_now[name], self._alpha)
            self.outer_optimizer.zero_grad(set_to_none=True)
        finally:
            self._pseudo_grads.clear()
            self._manager.allow_state_dict_read()
        return committed


def _as_param_grad(p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """Turns a local pseudo-gradient into a ``.grad`` for ``p`` (a DTensor for DTensors)."""
    if not isinstance(p, DTensor):
        return grad
    return DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _buckets(
    tensors: Sequence[torch.Tensor], cap_bytes: int
) -> Iterator[tuple[torch.Tensor, list[tuple[torch.Tensor, int, int]]]]:
    """Packs ``tensors`` into flat buffers of at most ``cap_bytes`` (one dtype and device per
    buffer; a tensor larger than the cap gets a buffer of its own).

    Yields:
        ``(flat buffer, [(tensor, offset, numel), ...])``; each tensor is copied in.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    t: torch.Tensor | None
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), ts in groups.items():
        itemsize = ts[0].element_size()
        cap = max(1, cap_bytes // itemsize)
        batch: list[torch.Tensor] = []
        size = 0
        for t in [*ts, None]:
            if t is not None and (not batch or size + t.numel() <= cap):
                batch.append(t)
                size += t.numel()
                continue
            flat = torch.empty(size, dtype=dtype, device=device)
            members = []
            offset = 0
            for b in batch:
                flat[offset : offset + b.numel()].copy_(b.reshape(-1))
                members.append((b, offset, b.numel()))
                offset += b.numel()
            yield flat, members
            if t is not None:
                batch, size = [t], t.numel()


class DiLoCo(_InnerLoop):
    """DiLoCo and streaming DiLoCo: pseudo-gradients averaged and applied by outer optimizers.

    The model is split into ``model_fragments`` (one fragment is plain DiLoCo). Fragment
    ``k`` of ``n`` syncs once every ``sync_every`` inner steps, the fragments in turn, one
    every ``sync_every / n`` steps. A sync of a fragment:

    1. ``fragment_sync_delay`` inner steps before its turn: start a quorum, compute the
       pseudo-gradient (the fragment's global parameters minus its local ones) and start its
       allreduce across replica groups;
    2. at its turn: wait for the allreduce; if the step commits, reset the fragment to its
       global parameters, apply the averaged pseudo-gradient with the fragment's outer
       optimizer, remember the result as the new global parameters, and mix the local
       parameters back in by ``fragment_update_alpha``. If it does not commit, the fragment
       falls back to its previous global parameters and the same fragment is tried again at
       the next turn.

    The manager must use a synchronous quorum (``use_async_quorum=False``): a replica group
    that heals must hold its peers' state before it computes a pseudo-gradient.
    """

    def __init__(
        self,
        manager: Manager,
        model_fragments: list[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | list[optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: int | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        """Wraps the model fragments and their optimizers.

        Args:
            manager: the Manager of this replica group; must use ``use_async_quorum=False``.
            model_fragments: the fragments of the model (modules with disjoint parameters);
                a single module is accepted as one fragment.
            inner_optimizer: the optimizer of the inner steps (its ``step`` is counted).
            outer_optimizer: the optimizer applying the averaged pseudo-gradients: one for
                every fragment, or a list with one per fragment.
            sync_every: inner steps between two syncs of the same fragment; a multiple of the
                number of fragments.
            backup_device: where the global parameters are kept (default CPU).
            pin_memory: pin the CPU copy of the global parameters (when CUDA is present).
            use_bucketization: allreduce the pseudo-gradients packed into flat buckets
                instead of one allreduce per parameter.
            bucket_cap_mb: bucket size in MiB (default 32) when ``use_bucketization``.
            should_quantize: allreduce quantized pseudo-gradients (needs CUDA).
            fragment_sync_delay: inner steps a fragment's allreduce may overlap before the
                sync waits for it (the "tau" of streaming DiLoCo); less than
                ``sync_every / len(model_fragments)``.
            fragment_update_alpha: after a sync, parameters = (1 - alpha) * global +
                alpha * local; in [0, 1], 0 keeps the global parameters.

        Raises:
            ValueError: an argument is out of range, the manager uses async quorum, or
                ``should_quantize`` is asked for without CUDA.
            TypeError: an argument has the wrong type.
        """
        self._manager = _check_manager(manager)
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                "DiLoCo needs a synchronous quorum: create the Manager with "
                "use_async_quorum=False (a healing replica group must hold its peers' state "
                "before it computes a pseudo-gradient)"
            )
        if isinstance(model_fragments, nn.Module):
            model_fragments = [model_fragments]
        fragments = list(model_fragments)
        if not fragments or not all(isinstance(m, nn.Module) for m in fragments):
            raise TypeError("model_fragments must be a non-empty list of nn.Module")
        n = len(fragments)
        if not isinstance(inner_optimizer, optim.Optimizer):
            raise TypeError(
                f"inner_optimizer must be a torch Optimizer, got {type(inner_optimizer).__name__}"
            )
        outers = list(outer_optimizer) if isinstance(outer_optimizer, list) else [outer_optimizer]
        if not all(isinstance(o, optim.Optimizer) for o in outers):
            raise TypeError("outer_optimizer must be a torch Optimizer or a list of them")
        if len(outers) not in (1, n):
            raise ValueError(
                f"outer_optimizer lists {len(outers)} optimizers for {n} model fragments"
            )
        sync_every = _check_sync_every(sync_every)
        if sync_every % n != 0:
            raise ValueError(
                f"sync_every ({sync_every}) must be a multiple of the number of model "
                f"fragments ({n}): one fragment syncs every sync_every / {n} steps"
            )
        interval = sync_every // n
        if (
            isinstance(fragment_sync_delay, bool)
            or not isinstance(fragment_sync_delay, int)
            or not 0 <= fragment_sync_delay < interval
        ):
            raise ValueError(
                f"fragment_sync_delay must be an int in [0, {interval}) "
                f"(sync_every / number of fragments), got {fragment_sync_delay!r}"
            )
        alpha = float(fragment_update_alpha)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha must be in [0, 1], got {fragment_update_alpha}"
            )
        bucket_bytes: int | None = None
        if use_bucketization:
            cap = _DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
            if not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0:
                raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
            bucket_bytes = max(1, int(cap * _MiB))
        if should_quantize and not torch.cuda.is_available():
            raise ValueError(
                "should_quantize=True needs CUDA: the quantized allreduce kernels run on GPUs "
                "only. Use should_quantize=False on CPU."
            )
        seen: set[int] = set()
        for i, m in enumerate(fragments):
            for p in m.parameters():
                if id(p) in seen:
                    raise ValueError(f"model fragment {i} shares parameters with another fragment")
                seen.add(id(p))

        self._local_optimizer = inner_optimizer
        self._sync_every = sync_every
        self._interval = interval
        self._delay = fragment_sync_delay
        self._outer_optimizers = outers
        self._fragments = [
            _Fragment(
                manager,
                i,
                m,
                outers[i] if len(outers) == n else outers[0],
                backup_device,
                pin_memory,
                bucket_bytes,
                should_quantize,
                alpha,
            )
            for i, m in enumerate(fragments)
        ]
        # Inner steps since the last sync point; every replica group asks for its quorum at
        # the same position, so a healed group is in step with its peers by construction.
        self._local_step = 0
        self._pending: _Fragment | None = None
        # The quorum of the last sync: a sync in a new quorum does not overlap (see _prepare).
        self._quorum_id: int | None = None
        super().__init__()
        for f in self._fragments:
            f.save_global()
            manager.register_state_dict_fn(f.key, f.load_state_dict, f.state_dict)

    # ---- healing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's own state, as the manager sends it to a healing peer.

        One entry per fragment, under upstream torchft's keys and layout, so checkpoints and
        heals cross between the two: ``{"StreamingDiLoCoFragment_{i}": {"original_parameters":
        {name: tensor}, "outer_optimizer": outer optimizer state dict}}``. The global
        parameters are the local shards for DTensor parameters; a single outer optimizer
        shared by all fragments appears in every entry. The position in the schedule needs
        no transfer: every replica group asks for its quorum at the same inner step of a
        window, and which fragment syncs follows the manager's step.

        Each entry is registered with the manager at construction; save this next to the
        model and the inner optimizer in a regular checkpoint.

        Returns:
            The state (tensors by reference).
        """
        return {f.key: f.state_dict() for f in self._fragments}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a state produced by :meth:`state_dict` (here or by upstream torchft).

        Args:
            state: the state to load.

        Raises:
            ValueError: a fragment's entry is missing or holds other parameters.
        """
        missing = [f.key for f in self._fragments if f.key not in state]
        if missing:
            raise ValueError(
                f"the DiLoCo state lacks {missing}: it comes from a model split into "
                f"other fragments than these {len(self._fragments)}"
            )
        for f in self._fragments:
            f.load_state_dict(state[f.key])

    # ---- context manager --------------------------------------------------------------

    def _hook(self) -> list[RemovableHandle]:
        return [
            self._local_optimizer.register_step_pre_hook(self._step_pre_hook),
            self._local_optimizer.register_step_post_hook(self._step_post_hook),
        ]

    def _left(self) -> None:
        self._manager.allow_state_dict_read()

    def _step_pre_hook(
        self, _optim: optim.Optimizer, _args: tuple[Any, ...], _kwargs: dict[str, Any]
    ) -> None:
        # The inner step changes the parameters a healing peer may be reading.
        self._manager.disallow_state_dict_read()

    def _step_post_hook(
        self, _optim: optim.Optimizer, _args: tuple[Any, ...], _kwargs: dict[str, Any]
    ) -> None:
        self._manager.allow_state_dict_read()
        self._local_step += 1
        if self._local_step == self._interval - self._delay:
            try:
                self._prepare()
            except BaseException:
                # The quorum raised (a synchronous quorum past its deadline). Where the
                # window ends at this step, end it here too, so this group's next window
                # starts in step with its peers'; otherwise its sync finds nothing to finish.
                if self._local_step >= self._interval:
                    self._pending = None
                    self._local_step = 0
                raise
        if self._local_step >= self._interval:
            self._sync()

    def _prepare(self) -> None:
        # The quorum may heal this group: the step, and with it the fragment, come after it.
        self._manager.start_quorum()
        fragment = self._fragments[self._manager.current_step() % len(self._fragments)]
        logger.debug(
            "preparing fragment %d at step %d", fragment.index, self._manager.current_step()
        )
        fragment.prepare()
        self._pending = fragment
        quorum_id = getattr(self._manager, "_quorum_id", None)
        reconfigured = quorum_id != self._quorum_id
        self._quorum_id = quorum_id
        if self._delay and reconfigured:
            # A new quorum may have peers healing from this group's state, which the next
            # inner steps would change under them (the transport then refuses the changed
            # state and the heal fails). They join this allreduce only once healed, so
            # waiting for it here, before the next inner step, keeps the state they read
            # whole. Only the first sync of a quorum gives up its overlap.
            fragment.wait_allreduce()

    def _sync(self) -> None:
        fragment = self._pending
        self._pending = None
        self._local_step = 0
        if fragment is None:
            # The quorum of this window raised (e.g. it timed out) and the caller went on:
            # nothing was sent, so there is nothing to finish; the next window tries again.
            logger.warning("no fragment was prepared in this window; skipping its sync")
            return
        committed = fragment.finish()
        logger.debug("fragment %d sync committed=%s", fragment.index, committed)
