"""torchft.snapshot on its own: writing, reading back, retention, the checks that skip bad
snapshots, and the settings (the end-to-end runs with real groups are in test_snapshot.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from _ft_worker import hash_state
from test_config import resolve
from torch.distributed import TCPStore

from torchft.group_snapshots import GroupSnapshots
from torchft.snapshot import (
    CORRUPT,
    MANIFEST,
    SnapshotResult,
    SnapshotWriter,
    choose_restore,
    list_snapshots,
    load_rank,
    snapshot_path,
    unusable_reason,
    verify,
)

pytestmark = pytest.mark.timeout(120)


def state(step: int, seed: int = 0) -> dict[str, Any]:
    """A Manager-shaped state: a model, an optimizer (integer keys), a list, plain values."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return {
        "user": {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "data": {"position": step * 32, "history": [1.5, torch.arange(3)]},
        },
        "torchft": {"step": step, "batches_committed": 2 * step},
    }


def writer(
    directory: Path, results: list[SnapshotResult], rank: int = 0, world: int = 1, **kw: Any
) -> SnapshotWriter:
    args: dict[str, Any] = {
        "every": 5,
        "keep": 2,
        "replica_id": "g0",
        "incarnation": "g0:abc",
        "group_rank": rank,
        "group_world_size": world,
        "timeout": 10.0,
        "on_done": results.append,
    }
    args.update(kw)
    return SnapshotWriter(str(directory), **args)


def test_a_snapshot_reads_back_bit_identical_with_integer_keys(tmp_path: Path) -> None:
    """What is written is what loads: tensors, an optimizer's integer-keyed state, lists and
    plain values; the manifest names the step, the group and every file's checksum."""
    results: list[SnapshotResult] = []
    w = writer(tmp_path, results)
    original = state(5)
    assert w.save(5, 42, original) is None
    done = w.wait(30)
    assert done is not None and done.complete and done.error is None, done
    assert results == [done]
    (snap,) = list_snapshots(tmp_path)
    assert snap.step == 5 and snap.manifest["quorum_id"] == 42
    assert snap.manifest["replica_id"] == "g0" and snap.manifest["user_keys"] == [
        "data",
        "model",
        "optim",
    ]
    assert set(snap.manifest["ranks"]["0"]["files"]) >= {".metadata"}
    assert verify(snap) is None
    loaded = load_rank(snap, 0)
    assert sorted(loaded["user"]["optim"]["state"]) == [0, 1]  # integers again
    assert hash_state(loaded) == hash_state(original)
    w.shutdown()


def test_file_checksums_are_zlibs_crc32(tmp_path: Path) -> None:
    """A snapshot file's checksum is zlib's CRC-32 of its bytes (manifests written by every
    version verify alike): empty, short, and longer than one read piece."""
    import zlib

    from torchft import snapshot as snapshot_module

    piece = snapshot_module._CHUNK
    for size in (0, 1, 4099, piece, 2 * piece + 12345):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
        f = tmp_path / f"f{size}"
        f.write_bytes(data)
        assert snapshot_module._file_checksum(f) == zlib.crc32(data), size


def test_the_training_thread_keeps_training_after_settle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save() takes the non-tensor values at once and returns; the tensors are copied on
    the writer thread, and settle() (the Manager calls it before the optimizer writes)
    waits for that copy: writing the state after it does not change the snapshot. The wait
    is reported as the training thread's blocked time; the buffers are reused next time."""
    from torchft import snapshot as snapshot_module

    real_fill = snapshot_module._Staging.fill

    def slow_fill(self: Any) -> None:
        time.sleep(0.3)
        real_fill(self)

    monkeypatch.setattr(snapshot_module._Staging, "fill", slow_fill)
    results: list[SnapshotResult] = []
    w = writer(tmp_path, results, keep=5)
    live = state(5)
    expected = hash_state(live)
    t0 = time.perf_counter()
    w.save(5, 1, live)
    assert time.perf_counter() - t0 < 0.2, "save() waited for the copy"
    live["user"]["data"]["history"][0] = 99.0  # a plain value: taken at save() already
    waited = w.settle()
    assert waited > 0.1
    live["user"]["model"]["weight"].add_(1.0)  # the optimizer step, after the vote
    done = w.wait(30)
    assert done is not None and done.complete and done.stage_s >= waited > 0.1
    assert done.copy_s >= 0.3
    assert hash_state(load_rank(list_snapshots(tmp_path)[0], 0)) == expected
    assert w.settle() == 0.0  # nothing in flight: no wait
    buffers = dict(w._staging._buffers)
    w.save(10, 2, live)
    w.settle()
    w.wait(30)
    assert all(w._staging._buffers[k] is b for k, b in buffers.items())
    assert hash_state(load_rank(list_snapshots(tmp_path)[0], 0)) == hash_state(live)
    w.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_state_is_staged_through_pinned_host_buffers(tmp_path: Path) -> None:
    """GPU tensors are copied into pinned host buffers on the writer thread; once settle()
    returned, the training thread may change them without changing the snapshot, which
    loads back bit-identical (on the CPU)."""
    results: list[SnapshotResult] = []
    w = writer(tmp_path, results)
    live = state(5)
    live["user"]["model"] = {k: v.cuda() for k, v in live["user"]["model"].items()}
    big = torch.randn(1 << 22, device="cuda")  # 16 MB: the copy is not instant
    live["user"]["big"] = {"t": big}
    expected = hash_state(live)
    w.save(5, 1, live)
    w.settle()
    big.add_(1.0)  # the optimizer step, after the vote
    live["user"]["model"]["weight"].mul_(2.0)
    done = w.wait(60)
    assert done is not None and done.complete and done.error is None, done
    assert all(b.is_pinned() for b in w._staging._buffers.values() if b.numel() > 1000)
    loaded = load_rank(list_snapshots(tmp_path)[0], 0)
    assert loaded["user"]["big"]["t"].device.type == "cpu"
    assert hash_state(loaded) == expected
    w.shutdown()


def test_tied_tensors_are_copied_once(tmp_path: Path) -> None:
    """One tensor under two keys (tied weights) takes one staging buffer and reads back
    under both keys."""
    results: list[SnapshotResult] = []
    w = writer(tmp_path, results)
    shared = torch.randn(64, 8)
    w.save(5, 1, {"user": {"m": {"embed": shared, "head": shared}}, "torchft": {"step": 5}})
    done = w.wait(30)
    assert done is not None and done.complete
    assert done.tensor_bytes == shared.numel() * 4
    loaded = load_rank(list_snapshots(tmp_path)[0], 0)
    assert torch.equal(loaded["user"]["m"]["embed"], shared)
    assert torch.equal(loaded["user"]["m"]["head"], shared)
    w.shutdown()


def test_retention_keeps_the_newest_and_drops_old_incomplete_ones(tmp_path: Path) -> None:
    """keep=2: after four snapshots only the newest two are left; an incomplete directory
    older than the oldest kept is deleted, a newer one (maybe still being written) is not."""
    results: list[SnapshotResult] = []
    w = writer(tmp_path, results)
    stale = snapshot_path(tmp_path, 7, "other:1")
    fresh = snapshot_path(tmp_path, 100, "other:2")
    for d in (stale, fresh):
        (d / "rank_0").mkdir(parents=True)
    for step in (5, 10, 15, 20):
        w.save(step, step, state(step))
        w.wait(30)
    assert [s.step for s in list_snapshots(tmp_path)] == [20, 15]
    assert not stale.exists() and fresh.exists()
    w.shutdown()


def test_a_snapshot_still_being_written_makes_the_next_one_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training thread never waits for a slow target: the next snapshot is skipped and
    reported as failed, naming the one still in flight."""
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def slow_save(*a: Any, **kw: Any) -> Any:
        time.sleep(1.0)
        return real_save(*a, **kw)

    monkeypatch.setattr(dcp, "save", slow_save)
    results: list[SnapshotResult] = []
    w = writer(tmp_path, results)
    assert w.save(5, 1, state(5)) is None
    t0 = time.perf_counter()
    skipped = w.save(10, 2, state(10))
    assert time.perf_counter() - t0 < 0.5
    assert skipped is not None and skipped.error is not None
    assert "snapshot of step 5 is still being written" in skipped.error
    assert w.wait(30).complete  # type: ignore[union-attr]
    assert [r.step for r in results] == [10, 5]
    w.shutdown()


def test_an_unwritable_directory_is_reported_not_raised(tmp_path: Path) -> None:
    """A directory under a regular file: save() returns, the failure is reported with the
    OS error, and no manifest exists."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    results: list[SnapshotResult] = []
    w = writer(blocker / "snaps", results)
    w.save(5, 1, state(5))
    done = w.wait(30)
    assert done is not None and not done.complete
    assert done.error is not None and "Not a directory" in done.error
    assert list_snapshots(blocker / "snaps") == []
    w.shutdown()


def test_group_rank_0_waits_for_every_rank_and_names_the_missing_or_failed(
    tmp_path: Path,
) -> None:
    """Rank 0 of a two-rank group writes the manifest only when rank 1's part is in: it
    gives up naming rank 1 when the part never comes, and names a rank's own failure."""
    results: list[SnapshotResult] = []
    w0 = writer(tmp_path, results, world=2, timeout=0.5)
    w0.save(5, 1, state(5))
    done = w0.wait(30)
    assert done is not None and not done.complete
    assert done.error is not None and "ranks ['1'] did not write their parts" in done.error
    # Both ranks: rank 1's part, then rank 0's; the manifest lists both.
    w1 = writer(tmp_path, results, rank=1, world=2)
    w0b = writer(tmp_path, results, world=2, incarnation="g0:abc")
    w1.save(10, 2, state(10, seed=1))
    w0b.save(10, 2, state(10))
    assert w0b.wait(30).complete  # type: ignore[union-attr]
    (snap,) = [s for s in list_snapshots(tmp_path) if s.step == 10]
    assert sorted(snap.manifest["ranks"]) == ["0", "1"]
    assert hash_state(load_rank(snap, 1)) == hash_state(state(10, seed=1))
    # A rank that failed its part: rank 0 names it.
    path = snapshot_path(tmp_path, 15, "g0:abc")
    path.mkdir(parents=True)
    (path / "rank_1.failed").write_text(json.dumps({"error": "disk full"}))
    w0b.save(15, 3, state(15))
    failed = w0b.wait(30)
    assert failed is not None and failed.error is not None
    assert "rank 1 failed its part" in failed.error and "disk full" in failed.error
    for w in (w0, w1, w0b):
        w.shutdown()


def test_bad_snapshots_are_skipped_naming_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Newest first: one written by a group of another size, one lacking a registered key,
    a truncated one and a corrupt one (marked, so it is never tried again) are skipped; the
    oldest good one is chosen; nothing newer than the live step is ever chosen."""
    results: list[SnapshotResult] = []
    for step in (5, 10, 15, 20):
        w = writer(tmp_path, results, keep=10)
        w.save(step, step, state(step))
        assert w.wait(30).complete  # type: ignore[union-attr]
        w.shutdown()
    w = writer(tmp_path, results, keep=10, world=1)
    by_step = {s.step: s for s in list_snapshots(tmp_path)}
    # 20: another group size (manifest edited, digest still consistent).
    m = json.loads((by_step[20].path / MANIFEST).read_text())
    m["group_world_size"] = 2
    (by_step[20].path / MANIFEST).write_text(json.dumps(m))
    # 15: a data file truncated.
    data15 = next(p for p in by_step[15].rank_dir(0).iterdir() if p.suffix == ".distcp")
    data15.write_bytes(data15.read_bytes()[:-10])
    # 10: one flipped byte (same size).
    data10 = next(p for p in by_step[10].rank_dir(0).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data10.read_bytes())
    raw[len(raw) // 3] ^= 1
    data10.write_bytes(bytes(raw))
    fresh = list_snapshots(tmp_path)
    assert "of 2 ranks" in (unusable_reason(fresh[0], 1, {"model"}) or "")
    assert "holds no state for the registered keys ['ema']" in (
        unusable_reason(fresh[-1], 1, {"model", "ema"}) or ""
    )
    with caplog.at_level("WARNING", logger="torchft.snapshot"):
        chosen = choose_restore(list_snapshots(tmp_path), 0, 1, {"model", "optim"})
    assert chosen is not None and chosen.step == 5
    text = caplog.text
    assert str(by_step[20].path) in text and "of 2 ranks" in text
    assert str(data15) in text and "bytes, the manifest says" in text
    assert "fails its checksum" in text
    assert (by_step[10].path / CORRUPT).exists() and not (by_step[10].path / MANIFEST).exists()
    assert (
        choose_restore(list_snapshots(tmp_path), 5, 1, {"model"}) is None
    )  # none newer than step 5 is usable
    w.shutdown()


def test_sharded_dtensor_state_is_saved_per_rank_and_restored_as_dtensors(tmp_path: Path) -> None:
    """A DTensor's local shard is what a rank writes; restoring with the rank's current
    state as template gives DTensors on the same mesh and placements back."""
    script = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torchft.snapshot import SnapshotWriter, list_snapshots, load_rank
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
full = torch.arange(12.0).reshape(4, 3)
d = distribute_tensor(full, mesh, [Shard(0)])
w = SnapshotWriter({str(tmp_path)!r}, every=1, keep=1, replica_id="g", incarnation="g:1",
                   group_rank=0, group_world_size=1, timeout=10.0)
w.save(1, 1, {{"user": {{"model": {{"w": d}}}}, "torchft": {{"step": 1}}}})
assert w.wait(30).complete
template = {{"user": {{"model": {{"w": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])}}}},
            "torchft": {{"step": 0}}}}
out = load_rank(list_snapshots({str(tmp_path)!r})[0], 0, template=template)
got = out["user"]["model"]["w"]
assert isinstance(got, DTensor), type(got)
assert got.placements == d.placements and torch.equal(got.full_tensor(), full)
w.shutdown()
dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_snapshot_settings_resolve_and_bad_ones_are_refused() -> None:
    """The directory and interval come from the arguments or TORCHFT_SNAPSHOT_*; a URL, a
    zero interval or keep, and interval variables without a directory are handled clearly."""
    cfg = resolve({"TORCHFT_SNAPSHOT_DIR": "/data/snaps", "TORCHFT_SNAPSHOT_EVERY": "50"})
    assert (cfg.snapshot_dir, cfg.snapshot_every, cfg.snapshot_keep) == ("/data/snaps", 50, 3)
    assert resolve(snapshot_dir=Path("/x")).snapshot_dir == "/x"
    off = resolve({"TORCHFT_SNAPSHOT_EVERY": "not read without a directory"})
    assert off.snapshot_dir is None
    with pytest.raises(ValueError, match="is a URL; only a directory path"):
        resolve(snapshot_dir="s3://bucket/snaps")
    with pytest.raises(ValueError, match="TORCHFT_SNAPSHOT_EVERY"):
        resolve({"TORCHFT_SNAPSHOT_DIR": "/d", "TORCHFT_SNAPSHOT_EVERY": "0"})
    with pytest.raises(ValueError, match="snapshot_keep"):
        resolve(snapshot_dir="/d", snapshot_keep=0)
    with pytest.raises(TypeError):
        resolve(snapshot_dir=5)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"every": 0}, "every and keep"),
        ({"keep": 0}, "every and keep"),
        ({"timeout": 0.0}, "timeout must be"),
        ({"timeout": float("nan")}, "timeout must be"),
        ({"confirm_timeout": -1.0}, "confirm_timeout must be"),
        ({"confirm_timeout": float("inf")}, "confirm_timeout must be"),
        ({"group_rank": 2, "group_world_size": 2}, "outside a group of 2"),
    ],
)
def test_a_writer_refuses_bad_settings_before_touching_the_directory(
    tmp_path: Path, bad: dict[str, Any], match: str
) -> None:
    """Every setting is checked up front with a message naming it; nothing is created."""
    with pytest.raises(ValueError, match=match):
        writer(tmp_path / "snaps", [], **bad)
    assert not (tmp_path / "snaps").exists()


def test_rank_0_makes_a_snapshot_complete_only_once_parity_confirms_its_state(
    tmp_path: Path,
) -> None:
    """With a confirmation (runtime state parity), the manifest waits for it on a thread of
    its own: the next snapshot is written meanwhile; a state found diverged never becomes a
    snapshot; an unconfirmed one times out incomplete; one pending at shutdown is made
    complete and says so."""
    from torchft.group_snapshots import parity_confirmation

    verdicts = {"checked": True, "ok": 0, "diverged": 0}
    results: list[SnapshotResult] = []
    confirm = parity_confirmation(
        lambda: (verdicts["checked"], verdicts["ok"], verdicts["diverged"]), lambda: True
    )
    w = writer(tmp_path / "a", results, confirm=confirm, confirm_timeout=30.0)
    assert w.save(5, 1, state(5)) is None
    deadline = time.monotonic() + 30
    while w.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not w.busy(), "the writer is free while the confirmation waits"
    time.sleep(0.3)
    assert list_snapshots(tmp_path / "a") == [], "not complete before parity confirms step 5"
    assert results == []
    # The next snapshot is written meanwhile (not skipped as "still being written").
    assert w.save(10, 2, state(10)) is None
    verdicts["ok"] = 5
    deadline = time.monotonic() + 30
    while not results and time.monotonic() < deadline:
        time.sleep(0.01)
    snaps = {s.step: s for s in list_snapshots(tmp_path / "a")}
    assert 5 in snaps and snaps[5].manifest["parity"] == "confirmed by the parity check of step 5"
    # Step 10's state is found differing at step 10: its snapshot is never made complete.
    verdicts["diverged"] = 10
    deadline = time.monotonic() + 30
    while len(results) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.step for r in results] == [5, 10], results
    assert results[0].complete and results[0].error is None, results
    assert not results[1].complete and "different from the other groups' at step 10" in str(
        results[1].error
    )
    assert sorted(s.step for s in list_snapshots(tmp_path / "a")) == [5]
    w.shutdown()

    # Never confirmed: incomplete after the timeout, saying why.
    results.clear()
    verdicts.update(ok=0, diverged=0)
    w = writer(tmp_path / "b", results, confirm=confirm, confirm_timeout=0.5)
    assert w.save(5, 1, state(5)) is None
    timed_out = w.wait(30)
    assert timed_out is not None and not timed_out.complete
    assert "did not confirm the state of step 5 within 0.5s" in str(timed_out.error)
    assert list_snapshots(tmp_path / "b") == []
    w.shutdown()

    # Pending at a clean shutdown: complete, marked unconfirmed. A lighthouse that does not
    # check parity (upstream) confirms nothing and holds nothing.
    results.clear()
    w = writer(tmp_path / "c", results, confirm=confirm, confirm_timeout=60.0)
    assert w.save(5, 1, state(5)) is None
    time.sleep(0.5)
    w.shutdown()
    (snap,) = list_snapshots(tmp_path / "c")
    assert snap.manifest["parity"].startswith("unconfirmed: the group shut down"), snap.manifest
    verdicts["checked"] = False
    assert confirm(5) == "unchecked: the lighthouse does not check parity"
    assert parity_confirmation(lambda: (True, 0, 0), lambda: False)(5) == "off"


def _group_snapshots(directory: Path, store: TCPStore, rank: int) -> GroupSnapshots:
    """Rank ``rank`` of a two-rank group's snapshots (a one-second ``connect_timeout``)."""
    cfg = resolve(
        {"RANK": str(rank), "WORLD_SIZE": "2"},
        snapshot_dir=str(directory),
        connect_timeout=timedelta(seconds=1),
    )
    return GroupSnapshots(cfg, "g0", "g0:abc", store, None, lambda *a: None)


def test_a_two_rank_group_restores_together_or_not_at_all(tmp_path: Path) -> None:
    """Both ranks of a group act on group rank 0's choice, or on none:

    - trained ranks behind a two-rank snapshot load their parts of it, and agree;
    - a snapshot one step ahead is taken only in the start-up state;
    - when rank 0 never gets a quorum's answer (its request timed out), a trained rank
      gives up waiting, publishes "none", and rank 0 coming later takes none too; a rank in
      its start-up state raises instead (its restart loses nothing);
    - the first rank to judge whether every rank loaded its part writes the verdict:
      "abort" when a part is still missing at the bound (a slow rank done later goes with
      it), "refuse" at once when a rank's load failed (that snapshot is then not chosen
      again by the process)."""
    results: list[SnapshotResult] = []
    parts = [writer(tmp_path, results, rank=r, world=2) for r in (1, 0)]
    for w, seed in zip(parts, (1, 0), strict=True):
        w.save(10, 2, state(10, seed=seed))
    assert parts[1].wait(30).complete  # type: ignore[union-attr]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    g0, g1 = (_group_snapshots(tmp_path, store, r) for r in (0, 1))
    keys = {"model", "optim", "data"}

    def template(seed: int) -> Callable[[], dict[str, Any]]:
        return lambda: state(0, seed=seed)

    loaded = [g.restore(7, 3, 3, keys, template(r), startup=False) for r, g in enumerate((g0, g1))]
    assert [x[0].step for x in loaded if x is not None] == [10, 10]
    assert [hash_state(x[1]) for x in loaded if x is not None] == [
        hash_state(state(10, seed=r)) for r in (0, 1)
    ]
    assert g0.agreed(7) and g1.agreed(7)
    # One step ahead (members at 9): a trained group gains nothing; a fresh one takes it.
    assert [g.restore(8, 9, 9, keys, template(0), startup=False) for g in (g0, g1)] == [None] * 2
    fresh = g0.restore(9, 9, 0, keys, template(0))
    assert fresh is not None and fresh[0].step == 10
    # Rank 0 never saw quorum 11: rank 1 gives up (no wait forever, no error) and rank 0,
    # answered late, goes with that.
    t0 = time.monotonic()
    assert g1.restore(11, 3, 3, keys, template(1), startup=False) is None
    assert 1.0 <= time.monotonic() - t0 < 10
    assert g0.restore(11, 3, 3, keys, template(0), startup=False) is None
    with pytest.raises(TimeoutError, match="did not choose a snapshot"):
        g1.restore(12, 3, 0, keys, template(1), startup=True)
    # Rank 0 judges before slow rank 1 recorded its part: "abort" at the bound, and rank 1,
    # done later, goes with that verdict rather than applying alone.
    assert g0.restore(13, 3, 3, keys, template(0), startup=False) is not None
    t0 = time.monotonic()
    assert not g0.agreed(13)
    assert time.monotonic() - t0 >= 1.0
    assert g1.restore(13, 3, 3, keys, template(1), startup=False) is not None
    assert not g1.agreed(13)
    # Rank 1 cannot load its part: both ranks judge "refuse" at once, and the snapshot is
    # not chosen again by rank 0 (a missing record, above, did not refuse it).
    assert g0.restore(14, 3, 3, keys, template(0), startup=False) is not None

    def broken() -> dict[str, Any]:
        raise MemoryError("no room for the snapshot")

    with pytest.raises(MemoryError):
        g1.restore(14, 3, 3, keys, broken, startup=False)
    t0 = time.monotonic()
    assert not g0.agreed(14) and not g1.agreed(14)
    assert time.monotonic() - t0 < 1.0
    assert g0.restore(15, 3, 3, keys, template(0), startup=False) is None
    fresh_rank_0 = _group_snapshots(tmp_path, store, 0)
    assert fresh_rank_0.restore(16, 3, 3, keys, template(0), startup=False) is not None
    for w in parts:
        w.shutdown()
    for g in (g0, g1, fresh_rank_0):
        g.shutdown(wait=False)


def test_a_waiting_rank_waits_as_long_as_rank_0_is_checking(tmp_path: Path) -> None:
    """Rank 0 verifying a large snapshot says so every second: a waiting rank waits past
    ``connect_timeout`` (1 s here) while the signs come, and takes rank 0's choice."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    g1 = _group_snapshots(tmp_path, store, 1)
    key = "torchft/snapshot/g0:abc/3"

    def rank_0_checking() -> None:
        for _ in range(6):  # 3 s of checking, a sign every half second
            store.add(f"{key}/choosing", 1)
            time.sleep(0.5)
        store.compare_set(key, "", "-")

    t = threading.Thread(target=rank_0_checking)
    t.start()
    t0 = time.monotonic()
    assert g1.restore(3, 3, 3, {"model"}, lambda: {}, startup=False) is None
    t.join()
    # It waited for rank 0's own answer (none, here), 2 s past its bound.
    assert time.monotonic() - t0 >= 2.5
    g1.shutdown(wait=False)
