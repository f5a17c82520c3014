"""Tests of OptimizerWrapper: steps only on commit, delegation, LR schedulers."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, StepLR

from torchft.optim import OptimizerWrapper


class _FakeManager:
    """Records the protocol calls; ``commit`` decides should_commit's answer."""

    def __init__(self, commit: bool = True) -> None:
        self.commit = commit
        self.calls: list[str] = []
        self.reads_allowed = True

    def start_quorum(self) -> None:
        self.calls.append("start_quorum")

    def should_commit(self) -> bool:
        self.calls.append("should_commit")
        return self.commit

    def disallow_state_dict_read(self) -> None:
        self.calls.append("disallow")
        self.reads_allowed = False

    def allow_state_dict_read(self) -> None:
        self.calls.append("allow")
        self.reads_allowed = True


def _setup(
    commit: bool = True,
) -> tuple[nn.Linear, torch.optim.SGD, OptimizerWrapper, _FakeManager]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = _FakeManager(commit)
    return model, inner, OptimizerWrapper(manager, inner), manager  # type: ignore[arg-type]


def _backward(model: nn.Linear) -> None:
    model(torch.ones(2, 3)).sum().backward()


def test_steps_only_when_committed() -> None:
    """The update is applied on commit, skipped otherwise; zero_grad starts the quorum."""
    model, _, opt, manager = _setup(commit=True)
    before = model.weight.detach().clone()
    opt.zero_grad()
    assert model.weight.grad is None
    _backward(model)
    opt.step()
    assert not torch.equal(model.weight, before)
    assert manager.calls == ["start_quorum", "should_commit", "disallow", "allow"]

    manager.calls.clear()
    manager.commit = False
    after_commit = model.weight.detach().clone()
    opt.zero_grad()
    _backward(model)
    opt.step()
    assert torch.equal(model.weight, after_commit)
    assert manager.calls == ["start_quorum", "should_commit"]


def test_zero_grad_set_to_none_false_zeroes() -> None:
    """zero_grad(set_to_none=False) zeroes the gradients instead of dropping them."""
    model, _, opt, _ = _setup()
    _backward(model)
    opt.zero_grad(set_to_none=False)
    assert model.weight.grad is not None and torch.count_nonzero(model.weight.grad) == 0


def test_state_dict_read_is_reallowed_when_step_raises() -> None:
    """A failing inner step still re-allows state dict reads."""
    model, inner, opt, manager = _setup()

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("inner step failed")

    inner.step = boom  # type: ignore[method-assign]
    _backward(model)
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    assert manager.reads_allowed
    assert manager.calls[-2:] == ["disallow", "allow"]


def test_closure_is_rejected() -> None:
    """Closures are refused before any protocol call."""
    _, _, opt, manager = _setup()
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    assert manager.calls == []


def test_delegates_state_and_param_groups() -> None:
    """param_groups, state, defaults, state_dict, load_state_dict, add_param_group delegate."""
    model, inner, opt, _ = _setup()
    assert opt.param_groups is inner.param_groups
    assert opt.defaults is inner.defaults
    opt.param_groups[0]["lr"] = 0.5
    assert inner.param_groups[0]["lr"] == 0.5
    inner2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt2 = OptimizerWrapper(_FakeManager(), inner2)  # type: ignore[arg-type]
    _backward(model)
    opt2.step()
    assert opt2.state is inner2.state and len(opt2.state) == 2
    sd = opt2.state_dict()
    assert sd == inner2.state_dict()
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    OptimizerWrapper(_FakeManager(), fresh).load_state_dict(sd)  # type: ignore[arg-type]
    assert torch.equal(
        fresh.state[model.weight]["momentum_buffer"], inner2.state[model.weight]["momentum_buffer"]
    )
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "lr": 1.0})
    assert len(inner.param_groups) == 2
    assert isinstance(opt, torch.optim.Optimizer)


def test_lr_scheduler_works() -> None:
    """LR schedulers accept the wrapper, change the inner lr and see the steps."""
    model, inner, opt, _ = _setup()
    sched = StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        _backward(model)
        opt.step()
        sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert sched.get_last_lr() == [pytest.approx(0.0125)]

    model, inner, opt, _ = _setup()
    lam = LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1))
    opt.step()
    lam.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    state = lam.state_dict()
    assert state["last_epoch"] == 1


def test_step_hooks_run_only_on_commit() -> None:
    """Step hooks are registered on the inner optimizer and fire only for committed steps."""
    model, _, opt, manager = _setup(commit=False)
    fired: list[str] = []
    opt.register_step_post_hook(lambda *_: fired.append("post"))
    _backward(model)
    opt.step()
    assert fired == []
    manager.commit = True
    opt.step()
    assert fired == ["post"]


def test_wrapper_pickles() -> None:
    """The wrapper can be pickled along with its optimizer (e.g. by checkpoint code)."""
    model, _, opt, _ = _setup()
    restored = pickle.loads(pickle.dumps(opt))
    assert restored.param_groups[0]["lr"] == 0.1
