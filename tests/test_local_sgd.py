"""Tests of torchft.local_sgd: argument checks, and numerics of LocalSGD and (streaming)
DiLoCo run by two real replica groups (threads with their own Manager, store and Gloo group
on an in-process lighthouse) against a plain single-process reference written here."""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from torchft import Manager, ProcessGroupGloo
from torchft._torchft import LighthouseServer
from torchft.local_sgd import DiLoCo, LocalSGD, _buckets
from torchft.process_group import FakeProcessGroupWrapper

REPLICAS = 2


def _build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


# Built once here: replicas run in threads, and seeding torch's global generator from two
# threads at once would race.
_TEMPLATE = _build_model()


def _model() -> nn.Sequential:
    return copy.deepcopy(_TEMPLATE)


def _batches(replica: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + replica)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(steps)]


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    x, y = batch
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class _FakeManager:
    """Just enough of a Manager for argument checks."""

    def __init__(self, use_async_quorum: bool = False) -> None:
        self._use_async_quorum = use_async_quorum
        self.registered: list[str] = []

    def start_quorum(self) -> None: ...
    def allreduce(self, t: torch.Tensor, **kw: Any) -> Any: ...
    def should_commit(self) -> bool:
        return True

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.registered.append(key)

    def allow_state_dict_read(self) -> None: ...
    def disallow_state_dict_read(self) -> None: ...


def _diloco(manager: Any = None, **kw: Any) -> DiLoCo:
    model = _model()
    args: dict[str, Any] = {
        "manager": manager or _FakeManager(),
        "model_fragments": [model[0], model[2]],
        "inner_optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "outer_optimizer": _outer(model.parameters()),
        "sync_every": 4,
    }
    args.update(kw)
    return DiLoCo(**args)


# ----------------------------------------------------------------------- argument checks


def test_diloco_refuses_async_quorum() -> None:
    """DiLoCo needs use_async_quorum=False and says so."""
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        _diloco(_FakeManager(use_async_quorum=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: quantization may run")
def test_diloco_refuses_quantization_without_cuda() -> None:
    """should_quantize=True without CUDA is refused with a clear error."""
    with pytest.raises(ValueError, match="should_quantize=True needs CUDA"):
        _diloco(should_quantize=True)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"sync_every": 3}, "multiple of the number of model fragments"),
        ({"sync_every": 0}, "sync_every must be an int >= 1"),
        ({"fragment_sync_delay": 2}, r"fragment_sync_delay must be an int in \[0, 2\)"),
        ({"fragment_sync_delay": -1}, "fragment_sync_delay"),
        ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha must be in \[0, 1\]"),
        (
            {"use_bucketization": True, "bucket_cap_mb": 0},
            "bucket_cap_mb must be a positive number",
        ),
        ({"model_fragments": []}, "non-empty list of nn.Module"),
    ],
)
def test_diloco_rejects_bad_arguments(kw: dict[str, Any], match: str) -> None:
    """Every out-of-range argument fails at construction with a message naming it."""
    with pytest.raises((ValueError, TypeError), match=match):
        _diloco(**kw)


def test_diloco_rejects_mismatched_outer_optimizers_and_shared_parameters() -> None:
    """A list of outer optimizers must have one per fragment; fragments must not overlap."""
    model = _model()
    with pytest.raises(ValueError, match="lists 3 optimizers for 2 model fragments"):
        _diloco(outer_optimizer=[_outer(model.parameters()) for _ in range(3)])
    with pytest.raises(ValueError, match="shares parameters"):
        _diloco(model_fragments=[model, model[0]])


def test_diloco_registers_its_state_for_healing() -> None:
    """DiLoCo registers each fragment's state under upstream torchft's key and layout."""
    fake = _FakeManager()
    d = _diloco(fake)
    keys = ["StreamingDiLoCoFragment_0", "StreamingDiLoCoFragment_1"]
    assert fake.registered == keys
    state = d.state_dict()
    assert sorted(state) == keys
    for i, key in enumerate(keys):
        assert sorted(state[key]) == ["original_parameters", "outer_optimizer"]
        frag = d._fragments[i]
        assert sorted(state[key]["original_parameters"]) == sorted(
            name for name, _ in frag.module.named_parameters()
        )
        assert state[key]["outer_optimizer"]["param_groups"][0]["lr"] == 0.7
    # A state of the same layout loads (as from upstream or a checkpoint) ...
    other = copy.deepcopy(state)
    for t in other[keys[1]]["original_parameters"].values():
        t.fill_(3.0)
    d.load_state_dict(other)
    assert all((t == 3.0).all() for t in d._fragments[1].global_params.values())
    # ... and one from another split of the model is refused with a clear error.
    del other[keys[1]]["original_parameters"]["weight"]
    with pytest.raises(ValueError, match="same model into the same fragments"):
        d.load_state_dict(other)
    with pytest.raises(ValueError, match="lacks"):
        d.load_state_dict({keys[0]: state[keys[0]]})


def test_localsgd_rejects_bad_arguments() -> None:
    """LocalSGD validates sync_every and the types of its arguments."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sync_every"):
        LocalSGD(_FakeManager(), model, opt, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        LocalSGD(_FakeManager(), "model", opt, 2)  # type: ignore[arg-type]


def test_entering_hooks_the_inner_optimizer_once_and_leaving_unhooks_it() -> None:
    """LocalSGD and DiLoCo hook the inner optimizer's step only while entered, refuse to be
    entered twice, and can be entered again once left."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def hooked(inner: torch.optim.Optimizer) -> int:
        return len(inner._optimizer_step_pre_hooks) + len(inner._optimizer_step_post_hooks)

    local_sgd = LocalSGD(_FakeManager(), model, opt, 2)  # type: ignore[arg-type]
    for loop, hooks in ((local_sgd, 1), (_diloco(), 2)):
        before = hooked(loop._local_optimizer)
        with loop:
            assert hooked(loop._local_optimizer) == before + hooks
            with pytest.raises(RuntimeError, match=f"^{type(loop).__name__} is already entered$"):
                loop.__enter__()
        assert hooked(loop._local_optimizer) == before
        with loop:
            pass


def test_buckets_respect_the_cap_and_cover_every_tensor() -> None:
    """Pseudo-gradients pack into buckets of at most the cap (one dtype each), in order."""
    ts = [torch.arange(n, dtype=torch.float32) for n in (3, 5, 2, 9)] + [torch.ones(2).double()]
    packed = list(_buckets(ts, cap_bytes=8 * 4))
    sizes = [flat.numel() for flat, _ in packed]
    assert sizes == [8, 2, 9, 2]  # 3+5 | 2 | 9 (alone, above the cap) | the double tensor
    seen = [t for _, members in packed for t, _, _ in members]
    assert [id(t) for t in seen] == [id(t) for t in ts]
    for flat, members in packed:
        for t, off, n in members:
            assert torch.equal(flat[off : off + n], t.reshape(-1))


# ----------------------------------------------------------------------- numerics


def _run_replicas(
    body: Callable[[Manager, int], Any], use_async_quorum: bool, **manager_kwargs: Any
) -> list[Any]:
    """Runs ``body(manager, replica)`` for two replica groups, each in its own thread with
    its own store, Gloo group and Manager (``manager_kwargs``: more of its arguments) on one
    in-process lighthouse."""
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=REPLICAS, join_timeout_ms=1000, quorum_tick_ms=10
    )
    stores = [
        TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(REPLICAS)
    ]

    def run(replica: int) -> Any:
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=REPLICAS,
            use_async_quorum=use_async_quorum,
            init_sync=False,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=stores[replica].port,
            lighthouse_addr=lighthouse.address(),
            replica_id=f"local_sgd_{replica}",
            timeout=timedelta(seconds=20),
            quorum_timeout=timedelta(seconds=20),
            connect_timeout=timedelta(seconds=10),
            **manager_kwargs,
        )
        try:
            return body(manager, replica)
        finally:
            manager.shutdown(wait=False)

    try:
        with ThreadPoolExecutor(max_workers=REPLICAS) as pool:
            futures = [pool.submit(run, r) for r in range(REPLICAS)]
            return [f.result(timeout=120) for f in futures]
    finally:
        lighthouse.shutdown()


def _reference_localsgd(steps: int, sync_every: int) -> list[nn.Module]:
    """LocalSGD by hand: every ``sync_every`` steps each parameter becomes the mean."""
    models = [_model() for _ in range(REPLICAS)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    data = [_batches(r, steps) for r in range(REPLICAS)]
    for t in range(steps):
        for r in range(REPLICAS):
            _inner_step(models[r], opts[r], data[r][t])
        if (t + 1) % sync_every == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = sum(p.detach().clone() for p in ps) / REPLICAS
                    for p in ps:
                        p.copy_(mean)
    return models


@pytest.mark.timeout(120)
def test_localsgd_matches_reference() -> None:
    """Two replica groups running LocalSGD end where the by-hand reference ends, identical."""
    steps, sync_every = 9, 3

    def body(manager: Manager, replica: int) -> Any:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with LocalSGD(manager, model, opt, sync_every=sync_every):
            for batch in _batches(replica, steps):
                _inner_step(model, opt, batch)
        return model, manager.current_step()

    results = _run_replicas(body, use_async_quorum=True)
    reference = _reference_localsgd(steps, sync_every)
    for (model, step), ref in zip(results, reference, strict=True):
        assert step == steps // sync_every
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for p, q in zip(results[0][0].parameters(), results[1][0].parameters(), strict=True):
        assert torch.equal(p, q), "replicas hold bit-identical parameters after the last sync"


def _reference_diloco(
    steps: int, sync_every: int, delay: int, alpha: float, per_fragment_outer: bool
) -> tuple[list[nn.Module], list[list[list[torch.Tensor]]]]:
    """Streaming DiLoCo by hand, for two replicas: returns the models and, per replica and
    fragment, the global parameters."""
    models = [_model() for _ in range(REPLICAS)]
    frags = [[m[0], m[2]] for m in models]
    n = 2
    interval = sync_every // n
    inner = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    if per_fragment_outer:
        outer = [[_outer(f.parameters()) for f in fs] for fs in frags]
    else:
        outer = [[_outer(m.parameters())] * n for m in models]
    glob = [[[p.detach().clone() for p in f.parameters()] for f in fs] for fs in frags]
    data = [_batches(r, steps) for r in range(REPLICAS)]
    step = 0  # committed syncs (the manager's step)
    local = 0
    pseudo: list[list[torch.Tensor]] = []
    current = -1
    for t in range(steps):
        for r in range(REPLICAS):
            _inner_step(models[r], inner[r], data[r][t])
        local += 1
        if local == interval - delay:
            current = step % n
            pseudo = [
                [
                    g - p.detach()
                    for g, p in zip(glob[r][current], frags[r][current].parameters(), strict=True)
                ]
                for r in range(REPLICAS)
            ]
        if local == interval:
            avg = [(a + b) / 2 for a, b in zip(pseudo[0], pseudo[1], strict=True)]
            for r in range(REPLICAS):
                params = list(frags[r][current].parameters())
                with torch.no_grad():
                    now = [p.detach().clone() for p in params]
                    for p, g in zip(params, glob[r][current], strict=True):
                        p.copy_(g)
                opt = outer[r][current]
                opt.zero_grad(set_to_none=True)
                for p, a in zip(params, avg, strict=True):
                    p.grad = a.clone()
                opt.step()
                opt.zero_grad(set_to_none=True)
                glob[r][current] = [p.detach().clone() for p in params]
                with torch.no_grad():
                    for p, x in zip(params, now, strict=True):
                        p.lerp_(x, alpha)
            step += 1
            local = 0
    return models, glob


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("delay", "alpha", "bucketize", "per_fragment_outer"),
    [(0, 0.0, False, True), (1, 0.5, True, False)],
    ids=["plain", "delay-alpha-buckets-shared-outer"],
)
def test_streaming_diloco_matches_reference(
    delay: int, alpha: float, bucketize: bool, per_fragment_outer: bool
) -> None:
    """Two replica groups running streaming DiLoCo (2 fragments) match the reference: the
    same global parameters (bit-identical across replicas), outer momentum and local models."""
    steps, sync_every = 12, 4

    def body(manager: Manager, replica: int) -> Any:
        model = _model()
        fragments = [model[0], model[2]]
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer: Any = (
            [_outer(f.parameters()) for f in fragments]
            if per_fragment_outer
            else _outer(model.parameters())
        )
        diloco = DiLoCo(
            manager,
            fragments,
            inner,
            outer,
            sync_every=sync_every,
            use_bucketization=bucketize,
            bucket_cap_mb=0.0001 if bucketize else None,  # ~100 bytes: several buckets
            fragment_sync_delay=delay,
            fragment_update_alpha=alpha,
        )
        with diloco:
            for batch in _batches(replica, steps):
                _inner_step(model, inner, batch)
        glob = [[t.clone() for t in f.global_params.values()] for f in diloco._fragments]
        return model, glob, manager.current_step()

    results = _run_replicas(body, use_async_quorum=False)
    ref_models, ref_glob = _reference_diloco(steps, sync_every, delay, alpha, per_fragment_outer)
    for r, (model, glob, step) in enumerate(results):
        assert step == steps // (sync_every // 2), "one committed step per fragment sync"
        for f in range(2):
            for got, want in zip(glob[f], ref_glob[r][f], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref_models[r].parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for f in range(2):
        for a, b in zip(results[0][1][f], results[1][1][f], strict=True):
            assert torch.equal(a, b), "global parameters are bit-identical across replicas"


def _run_diloco_scenario(
    replicas: int,
    events: list[dict[int, str]],
    n_fragments: int,
    delay: int,
    alpha: float,
    steps: int = 4,
) -> list[tuple[dict[int, Any], dict[str, Any], int]]:
    """Runs streaming DiLoCo in ``replicas`` threads (each its own store, Gloo group and
    Manager; lighthouse min_replicas=2) until each committed ``steps`` syncs.

    ``events[r]`` maps a committed step to what replica ``r`` does at the top of the first
    inner step it runs at that step: ``"barrier"`` (wait for every replica to reach its
    barrier) or ``"fail"`` (its next allreduce fails).

    Returns:
        Per replica: its DiLoCo state at the first inner step of every step it ran, its
        final DiLoCo state, and its final step.
    """
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=500, quorum_tick_ms=10
    )
    barrier = threading.Barrier(sum(1 for e in events if "barrier" in e.values()))
    stores = [
        TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(replicas)
    ]
    torch.manual_seed(42)
    template = nn.Sequential(
        *[nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)) for _ in range(n_fragments)]
    )

    def run(replica: int) -> tuple[dict[int, Any], dict[str, Any], int]:
        model = copy.deepcopy(template)
        inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
        outer = [_outer(f.parameters()) for f in model]
        pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=10)))

        def load(sd: dict[str, Any]) -> None:
            model.load_state_dict(sd["model"])
            inner.load_state_dict(sd["inner_optim"])

        manager = Manager(
            pg=pg,
            min_replica_size=2,
            use_async_quorum=False,
            load_state_dict=load,
            state_dict=lambda: {"model": model.state_dict(), "inner_optim": inner.state_dict()},
            replica_id=str(replica),
            store_addr="127.0.0.1",
            store_port=stores[replica].port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse.address(),
            timeout=timedelta(seconds=10),
            quorum_timeout=timedelta(seconds=10),
            connect_timeout=timedelta(seconds=10),
        )
        todo = dict(events[replica])
        g = torch.Generator().manual_seed(replica)
        seen: dict[int, Any] = {}
        try:
            diloco = DiLoCo(
                manager,
                list(model),
                inner,
                outer,
                sync_every=4,
                fragment_sync_delay=delay,
                fragment_update_alpha=alpha,
            )
            with diloco:
                while manager.current_step() < steps:
                    step = manager.current_step()
                    event = todo.pop(step, None)
                    if event == "barrier":
                        barrier.wait(timeout=60)
                    elif event == "fail":
                        pg.report_future_error(RuntimeError("injected allreduce failure"))
                    seen.setdefault(step, copy.deepcopy(diloco.state_dict()))
                    x = torch.rand(1, 2, generator=g)
                    y = torch.randint(2, (1,), generator=g)
                    inner.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    inner.step()
            assert not todo, f"events never reached: {todo}"
            return seen, copy.deepcopy(diloco.state_dict()), manager.current_step()
        finally:
            manager.shutdown(wait=False)

    try:
        with ThreadPoolExecutor(max_workers=replicas) as pool:
            futures = [pool.submit(run, r) for r in range(replicas)]
            return [f.result(timeout=50) for f in futures]
    finally:
        lighthouse.shutdown()


def _assert_one_global_state(results: list[tuple[dict[int, Any], dict[str, Any], int]]) -> None:
    """Every replica ends at the same step, and replicas at the same step hold bit-identical
    global parameters and outer optimizer state (keys StreamingDiLoCoFragment_i)."""
    seen0, final0, step0 = results[0]
    for seen, final, step in results[1:]:
        assert step == step0
        torch.testing.assert_close(final, final0, rtol=0, atol=0)
        for s in seen.keys() & seen0.keys():
            torch.testing.assert_close(seen[s], seen0[s], rtol=0, atol=0, msg=f"step {s}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("n_fragments", "delay", "alpha"), [(1, 0, 0.0), (2, 1, 0.5)], ids=["diloco", "streaming"]
)
def test_streaming_diloco_upscale(n_fragments: int, delay: int, alpha: float) -> None:
    """A replica group that joins after the others committed two steps heals from them and
    all three end with one global state."""
    results = _run_diloco_scenario(
        3, [{0: "barrier"}, {2: "barrier"}, {2: "barrier"}], n_fragments, delay, alpha
    )
    _assert_one_global_state(results)
    assert 1 not in results[0][0], "the late group jumped from step 0 by healing"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("n_fragments", "delay", "alpha"),
    [(1, 0, 0.0), (2, 0, 1.0), (2, 1, 0.5)],
    ids=["diloco", "streaming", "streaming-delay"],
)
def test_streaming_diloco_commit_failure(n_fragments: int, delay: int, alpha: float) -> None:
    """An allreduce that fails on every group at a sync discards that sync everywhere; the
    retried sync commits and the groups end with one global state, promptly."""
    results = _run_diloco_scenario(2, [{1: "fail"}, {1: "fail"}], n_fragments, delay, alpha)
    _assert_one_global_state(results)


def _solo_manager(lighthouse: Any, replica_id: str, **kw: Any) -> tuple[Manager, TCPStore]:
    """A real one-rank Manager on its own store (keep the store referenced while it runs)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse.address(),
        replica_id=replica_id,
        **kw,
    )
    return manager, store


def test_diloco_refuses_a_real_managers_async_quorum(lighthouse: Any) -> None:
    """The refusal reads the real Manager's setting, not only a test double's."""
    manager, _store = _solo_manager(lighthouse, "async", use_async_quorum=True)
    try:
        with pytest.raises(ValueError, match="use_async_quorum=False"):
            _diloco(manager)
    finally:
        manager.shutdown(wait=False)


def test_set_state_dict_fns_warns_and_still_works(lighthouse: Any) -> None:
    """The legacy Manager.set_state_dict_fns registers the default state and warns."""
    manager, _store = _solo_manager(lighthouse, "legacy")
    try:
        loaded: list[Any] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.set_state_dict_fns(loaded.append, lambda: {"w": torch.ones(2)})
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
        assert "register_state_dict_fn" in str(caught[0].message)
        state = manager._manager_state_dict()
        assert torch.equal(state["user"]["default"]["w"], torch.ones(2))
        manager._healer._pending = {"default": {"w": torch.zeros(2)}}
        manager._healer.apply_pending()
        assert len(loaded) == 1 and torch.equal(loaded[0]["w"], torch.zeros(2))
    finally:
        manager.shutdown(wait=False)


def test_signatures_match_upstream() -> None:
    """Argument names, order and defaults are upstream torchft's, so keyword and positional
    calls written against it (torchtitan's included) run unchanged."""
    import inspect

    def params(f: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.default) for p in inspect.signature(f).parameters.values()][1:]

    empty = inspect.Parameter.empty
    assert params(LocalSGD.__init__) == [
        ("manager", empty),
        ("model", empty),
        ("optimizer", empty),
        ("sync_every", empty),
    ]
    assert params(DiLoCo.__init__) == [
        ("manager", empty),
        ("model_fragments", empty),
        ("inner_optimizer", empty),
        ("outer_optimizer", empty),
        ("sync_every", empty),
        ("backup_device", None),
        ("pin_memory", True),
        ("use_bucketization", False),
        ("bucket_cap_mb", None),
        ("should_quantize", False),
        ("fragment_sync_delay", 0),
        ("fragment_update_alpha", 0.0),
    ]
    # torchtitan's call, keywords only, with a list of Nesterov outer optimizers.
    model = _model()
    fragments = [model[0], model[2]]
    diloco = DiLoCo(
        manager=_FakeManager(),
        model_fragments=fragments,
        inner_optimizer=torch.optim.AdamW(model.parameters()),
        outer_optimizer=[
            torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments
        ],
        sync_every=4,
        should_quantize=False,
        fragment_sync_delay=1,
        fragment_update_alpha=0.0,
    )
    with diloco as entered:
        assert entered is diloco
    with LocalSGD(
        manager=_FakeManager(),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        sync_every=2,
    ):
        pass


class _SoloManager(_FakeManager):
    """One replica group alone: allreduce is the identity, every sync commits."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def allreduce(self, t: torch.Tensor, **kw: Any) -> Any:
        from torchft.work import _DummyWork

        return _DummyWork(t)

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step


@pytest.mark.timeout(60)
def test_diloco_on_fsdp2_dtensor_parameters_matches_plain_tensors() -> None:
    """DiLoCo over FSDP2-sharded parameters (DTensors, CPU/Gloo, one rank) computes exactly
    what it computes over the same model with plain parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def run(sharded: bool) -> list[torch.Tensor]:
        model = _model()
        if sharded:
            mesh = init_device_mesh("cpu", (1,))
            fully_shard(model[0], mesh=mesh)
            fully_shard(model[2], mesh=mesh)
            fully_shard(model, mesh=mesh)
            assert isinstance(model[0].weight, DTensor)
        fragments = [model[0], model[2]]
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = [_outer(f.parameters()) for f in fragments]
        d = DiLoCo(_SoloManager(), fragments, inner, outer, sync_every=4, fragment_update_alpha=0.5)
        with d:
            for batch in _batches(0, 8):
                _inner_step(model, inner, batch)
        return [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for p in model.parameters()
        ] + [t.clone() for f in d._fragments for t in f.global_params.values()]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = run(True)
    finally:
        dist.destroy_process_group()
    plain = run(False)
    for a, b in zip(sharded, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay", [0, 1])
def test_diloco_window_stays_aligned_when_a_sync_quorum_times_out(delay: int) -> None:
    """A synchronous quorum that raises (past its deadline) ends that window where the
    schedule says: the next window is a full one and syncs at its last inner step, as the
    peers' do."""

    class _TimesOutOnce(_SoloManager):
        def __init__(self) -> None:
            super().__init__()
            self.quorums = 0

        def start_quorum(self) -> None:
            self.quorums += 1
            if self.quorums == 1:
                raise TimeoutError("quorum not reached (status: Cancelled, Timeout expired)")

    manager = _TimesOutOnce()
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(
        manager,
        [model[0], model[2]],
        inner,
        [_outer(model[0].parameters()), _outer(model[2].parameters())],
        sync_every=4,
        fragment_sync_delay=delay,
    )
    x = torch.randn(8, 4)
    raised_at: list[int] = []
    with d:
        for i in range(1, 9):
            inner.zero_grad()
            model(x).sum().backward()
            try:
                inner.step()
            except TimeoutError:
                raised_at.append(i)
    # The first window's quorum raised at its prepare step; every later window asked at the
    # same position of its window and synced at its end (two fragments: a window is half of
    # sync_every).
    window = d._interval
    assert window == 2
    assert raised_at == [window - delay]
    assert manager.quorums == 8 // window
    assert manager.step == 8 // window - 1
    assert d._local_step == 0
