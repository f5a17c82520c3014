"""Optimizer wrapper that ties each step to the fault-tolerance protocol.

``zero_grad()`` starts the quorum for the step (overlapping it with the forward pass) and
``step()`` applies the update only when the Manager decides the step commits, so replicas
that saw an error never diverge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from torchft.telemetry import backward_ended, optimizer_done

if TYPE_CHECKING:
    from torchft.manager import Manager

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(Optimizer):
    """Wraps a torch optimizer so it only steps on committed steps.

    It is an ``Optimizer`` (LR schedulers accept it) but keeps no state of its own:
    ``param_groups``, ``state``, ``defaults`` and (de)serialisation are the wrapped optimizer's.
    """

    def __init__(self, manager: Manager, optim: Optimizer) -> None:
        """Wraps ``optim``.

        Args:
            manager: the Manager deciding quorum and commit.
            optim: the optimizer that does the actual update.
        """
        # Optimizer.__init__ is deliberately not called: it would create a second set of
        # param_groups/state; everything is delegated to ``optim`` instead.
        self.optim = optim
        self.manager = manager

    # ---- delegated state --------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (LR schedulers edit these)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optim.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optim.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optim.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optim.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads into the wrapped optimizer."""
        self.optim.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Registers on the wrapped optimizer: runs only for committed steps."""
        return self.optim.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Registers on the wrapped optimizer: runs only for committed steps."""
        return self.optim.register_step_post_hook(hook)

    # ---- the protocol -----------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the quorum for the next step, then clears the gradients.

        Args:
            set_to_none: set gradients to None instead of zeroing them.
        """
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Applies the update if the Manager commits this step.

        Args:
            closure: not supported (re-evaluating the loss would run extra collectives
                outside the step protocol).

        Raises:
            ValueError: a closure was given.
        """
        if closure is not None:
            raise ValueError("OptimizerWrapper.step does not support closures")
        backward_ended()
        if self.manager.should_commit():
            self.manager.disallow_state_dict_read()
            try:
                t0 = time.perf_counter()
                self.optim.step()
                optimizer_done(t0)
            finally:
                self.manager.allow_state_dict_read()
        else:
            logger.info("step not committed; the optimizer update is skipped")

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
