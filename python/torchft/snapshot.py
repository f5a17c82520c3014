"""Durable snapshots of the committed state, coordinated by the quorum.

Live healing needs one live replica group. When every group dies at once (a rack lost, the
whole job preempted), the job resumes from the newest durable snapshot instead of step 0.

Writing (``Manager(snapshot_dir=, snapshot_every=)`` or ``TORCHFT_SNAPSHOT_DIR`` /
``TORCHFT_SNAPSHOT_EVERY``): when a step ``s`` with ``s % every == 0`` commits, exactly one
participating replica group writes it, the one whose participating rank is
``(s // every) % participants`` (the same answer in every group, since they committed under
the same quorum, and a different group at each snapshot step). At the top of its next step,
when the optimizer has applied the commit and the state is exactly what a heal would send
(the user state dicts and the Manager's counters), every rank of that group takes the
state's structure and non-tensor values, and a writer thread copies its tensors into host
staging buffers while the step's forward and backward passes run (they read the state; the
step protocol writes it only after the commit vote, where the Manager waits for the copy:
the only time the training thread may wait). The writer thread then writes the copy with
:func:`torch.distributed.checkpoint.save` into
``<dir>/step_<step>_<tag>/rank_<r>`` (a standard DCP checkpoint of that rank's state),
checksums the files and writes ``rank_<r>.json``. Group rank 0 then waits for every rank's
file and writes ``manifest.json`` last, atomically: a snapshot without a manifest is
incomplete and never loaded. With runtime state parity on (:mod:`torchft.parity`) and a
lighthouse that checks it, rank 0 first waits (on a thread of its own, so the next snapshot
is not held up) until the lighthouse has compared this group's state at the snapshot's step
or a later one and found it agreeing, and none since differing: a state that parity finds
diverged (a flipped bit, a bad kernel) never becomes a snapshot every group would later
resume from. A snapshot parity did not confirm within :data:`PARITY_CONFIRM_TIMEOUT_S` stays
incomplete; one still waiting when the group shuts down cleanly is made complete and its
manifest says ``"parity": "unconfirmed ..."``. Rank 0 then deletes snapshots beyond the
newest ``keep`` and tells the lighthouse (telemetry), which records the newest complete snapshot in ``/status``,
``/metrics`` and its state file. A failure (full disk, unwritable directory) is logged and
reported as a ``snapshot_failed`` event; training goes on.

Restoring: a group whose process holds its start-up state (no step committed, no heal
applied) checks, at each quorum answer, whether a complete snapshot is newer than the
quorum's ``max_step``; a group that has trained checks at the first answer of each new
quorum, for one at least two steps newer (a laggard whose leaders died). A live group that
is ahead, or level, always wins and the group heals from it as usual. Otherwise group rank 0
picks the newest snapshot that is complete, compatible (same ranks per group, the registered
state keys) and whose checksums verify, skipping others with a warning that names them;
every rank loads its own part. The step of that quorum does not commit (its gradients were
taken on the old state); the state is applied after its vote, and the next quorum trains on
from the snapshot's step.

Non-tensor values (an optimizer's ``param_groups``, a data loader's position) are stored by
DCP as pickled bytes: load snapshots only from a directory the job alone writes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchft._torchft import _crc32_update

logger: logging.Logger = logging.getLogger(__name__)

#: How long group rank 0 waits for the parity check to confirm a written snapshot's state
#: before leaving it incomplete: past the lighthouse's own bound on deciding a step (30 s).
PARITY_CONFIRM_TIMEOUT_S = 90.0

#: Version of the manifest layout this module writes and reads.
FORMAT = 1
#: Written last: a snapshot directory without it is incomplete.
MANIFEST = "manifest.json"
#: A manifest whose files failed their checksums is renamed to this and never used again.
CORRUPT = "manifest.json.corrupt"
#: Committed steps between snapshots when only the directory is set.
DEFAULT_EVERY = 500
#: Complete snapshots kept when nothing says otherwise.
DEFAULT_KEEP = 3
_PREFIX = "step_"
_CHUNK = 8 << 20

# Every rank writes and reads its own part alone (no collectives): DCP warns that it
# assumes a single process, which is what is meant.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")


class SnapshotError(RuntimeError):
    """A snapshot could not be written or used."""


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Snapshot:
    """A complete snapshot on disk (its manifest parsed)."""

    path: Path
    step: int
    manifest: dict[str, Any]

    def rank_dir(self, rank: int) -> Path:
        """The DCP checkpoint of group rank ``rank``."""
        return self.path / f"rank_{rank}"


def _file_checksum(path: Path, progress: Callable[[], None] | None = None) -> int:
    """zlib's CRC-32 of a file, read in pieces into one buffer and summed natively (at the
    speed the file is read, where zlib's sum made about 2 GB/s); ``progress`` is called
    after each piece."""
    crc = 0
    buf = torch.empty(min(_CHUNK, max(path.stat().st_size, 1)), dtype=torch.uint8)
    view = buf.numpy().data
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return crc
            crc = _crc32_update(crc, buf.data_ptr(), n)
            if progress is not None:
                progress()


def _files_of(rank_dir: Path) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of every file of one rank's checkpoint."""
    out: dict[str, dict[str, int]] = {}
    for f in sorted(rank_dir.iterdir()):
        if f.is_file():
            out[f.name] = {"bytes": f.stat().st_size, "crc32": _file_checksum(f)}
    return out


def _state_digest(ranks: dict[str, Any]) -> str:
    """One digest over every rank's files (their names, sizes and checksums)."""
    h = hashlib.sha256()
    for rank in sorted(ranks, key=int):
        for name, f in sorted(ranks[rank]["files"].items()):
            h.update(f"{rank}/{name}:{f['bytes']}:{f['crc32']};".encode())
    return h.hexdigest()


def _read_manifest(path: Path) -> dict[str, Any]:
    with open(path / MANIFEST, encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict):
        raise ValueError("the manifest is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"manifest format {manifest.get('format')!r}, expected {FORMAT}")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"bad step {step!r}")
    ranks = manifest.get("ranks")
    if not isinstance(ranks, dict) or not ranks:
        raise ValueError("the manifest lists no ranks")
    return manifest


def list_snapshots(directory: str | os.PathLike[str]) -> list[Snapshot]:
    """The complete snapshots in ``directory``, newest first (by step, then write time).

    Directories without a manifest (incomplete) are left out silently; a manifest that cannot
    be read is left out with a warning naming it; a directory that cannot be listed is an
    error in the log and no snapshots.
    """
    root = Path(directory)
    found: list[tuple[int, float, str, Snapshot]] = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    except OSError as e:
        # Never a reason to stop training: the job goes on without snapshots to restore.
        logger.error("snapshot directory %s cannot be read (%s): no snapshot is used", root, e)
        return []
    for entry in entries:
        if not entry.name.startswith(_PREFIX) or not (entry / MANIFEST).is_file():
            continue
        try:
            manifest = _read_manifest(entry)
        except (OSError, ValueError) as e:
            logger.warning("snapshot %s skipped: unreadable manifest (%s)", entry, e)
            continue
        written = manifest.get("written_unix")
        when = float(written) if isinstance(written, (int, float)) else 0.0
        found.append(
            (manifest["step"], when, entry.name, Snapshot(entry, manifest["step"], manifest))
        )
    found.sort(key=lambda t: (t[0], t[1], t[2]), reverse=True)
    return [t[3] for t in found]


def unusable_reason(snap: Snapshot, group_world_size: int, user_keys: set[str]) -> str | None:
    """Why ``snap`` cannot restore this group, checked without reading the data (None: it
    may). Incompatible layouts and missing or truncated files are caught here."""
    m = snap.manifest
    if m.get("group_world_size") != group_world_size:
        return (
            f"written by a replica group of {m.get('group_world_size')} ranks, this group has "
            f"{group_world_size}"
        )
    ranks = m["ranks"]
    missing_keys = user_keys - set(m.get("user_keys", []))
    if missing_keys:
        return f"holds no state for the registered keys {sorted(missing_keys)}"
    for rank in range(group_world_size):
        entry = ranks.get(str(rank))
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            return f"lists no files of rank {rank}"
        for name, f in entry["files"].items():
            p = snap.rank_dir(rank) / name
            try:
                size = p.stat().st_size
            except OSError:
                return f"file {p} is missing"
            if size != f.get("bytes"):
                return f"file {p} has {size} bytes, the manifest says {f.get('bytes')}"
    return None


def verify(snap: Snapshot, progress: Callable[[], None] | None = None) -> str | None:
    """Checks every rank's files against the manifest's checksums (reads them all, calling
    ``progress`` after each piece read).

    Returns:
        None when they match, else what differs.
    """
    for rank, entry in sorted(snap.manifest["ranks"].items(), key=lambda kv: int(kv[0])):
        for name, f in entry["files"].items():
            p = snap.rank_dir(int(rank)) / name
            try:
                crc = _file_checksum(p, progress)
            except OSError as e:
                return f"file {p} unreadable: {e}"
            if crc != f.get("crc32"):
                return (
                    f"file {p} fails its checksum (CRC-32 {crc:#010x}, manifest {f.get('crc32')})"
                )
    if snap.manifest.get("digest") != _state_digest(snap.manifest["ranks"]):
        return "the manifest's digest does not match its file list"
    return None


def mark_corrupt(snap: Snapshot) -> None:
    """Renames the manifest so no process picks the snapshot again."""
    try:
        os.replace(snap.path / MANIFEST, snap.path / CORRUPT)
    except OSError as e:
        logger.warning("could not mark snapshot %s corrupt: %s", snap.path, e)


def _load_all(rank_dir: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, without a template (nested as it was saved)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state: dict[str, Any] = _load_state_dict_from_keys(checkpoint_id=str(rank_dir))
    return state


def _restore_int_keys(state: Any, int_keys: list[dict[str, Any]]) -> None:
    """DCP stores dict keys as text: gives back the integer keys (an optimizer's ``state``)
    recorded when the snapshot was written."""
    for entry in int_keys:
        node = state
        for part in entry["path"]:
            node = node[part] if isinstance(node, list) else node[str(part)]
        if not isinstance(node, dict):
            raise SnapshotError(f"snapshot layout changed at {entry['path']}")
        for key in entry["keys"]:
            if str(key) in node:
                node[key] = node.pop(str(key))


def _like(loaded: Any, template: Any) -> Any:
    """Places loaded host tensors like the tensors the rank holds now: on their device, and
    a DTensor's local shard back into a DTensor of the same mesh and placements."""
    if isinstance(loaded, torch.Tensor) and isinstance(template, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(template, DTensor):
            local = loaded.to(template.to_local().device)
            return DTensor.from_local(
                local,
                template.device_mesh,
                template.placements,
                run_check=False,
                shape=template.shape,
                stride=template.stride(),
            )
        return loaded.to(template.device) if template.device != loaded.device else loaded
    if isinstance(loaded, dict) and isinstance(template, dict):
        return {k: _like(v, template.get(k)) for k, v in loaded.items()}
    if isinstance(loaded, list) and isinstance(template, list) and len(loaded) == len(template):
        return [_like(v, t) for v, t in zip(loaded, template, strict=True)]
    return loaded


def load_rank(snap: Snapshot, rank: int, template: Any = None) -> dict[str, Any]:
    """Loads group rank ``rank``'s state of ``snap`` (``{"user": ..., "torchft": ...}``).

    Args:
        template: the state the rank holds now: loaded tensors go to its tensors' devices,
            and DTensors are rebuilt on its meshes.
    """
    state = _load_all(snap.rank_dir(rank))
    entry = snap.manifest["ranks"][str(rank)]
    _restore_int_keys(state, entry.get("int_keys", []))
    if "user" not in state or "torchft" not in state:
        raise SnapshotError(f"snapshot {snap.path} rank {rank} lacks 'user'/'torchft'")
    return _like(state, template) if template is not None else state


# ----------------------------------------------------------------------------- staging


class _Staging:
    """Host copies of one rank's state, reused from one snapshot to the next (a fresh
    allocation per snapshot pays first-touch page faults on every byte).

    :meth:`prepare` runs on the training thread and is cheap: it walks the state, copies
    the non-tensor values (the training thread may change them once it returns) and notes
    the tensors. :meth:`fill` copies the tensors on the writer thread, overlapping the
    step's forward and backward passes, which read the state but do not write it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._jobs: list[tuple[Any, Any, torch.Tensor, str]] = []
        self.int_keys: list[dict[str, Any]] = []
        self.tensor_bytes = 0

    def prepare(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state's structure with its non-tensor values copied; tensors are filled in
        by :meth:`fill`."""
        self.int_keys = []
        self._jobs = []
        out: dict[str, Any] = self._walk(state, [])
        return out

    def fill(self) -> None:
        """Copies the noted tensors into the staging buffers (a tensor reachable under
        several keys, such as tied weights, is copied once)."""
        done: dict[int, torch.Tensor] = {}
        keys: set[str] = set()
        self.tensor_bytes = 0
        devices: set[torch.device] = set()
        for parent, key, t, buf_key in self._jobs:
            buf = done.get(id(t))
            if buf is None:
                buf = self._copy(t, buf_key)
                done[id(t)] = buf
                keys.add(buf_key)
                self.tensor_bytes += buf.numel() * buf.element_size()
                if t.device.type == "cuda":
                    devices.add(t.device)
            parent[key] = buf
        self._jobs = []
        # The copies out of device memory are asynchronous: wait for them on every device
        # they came from (this thread's current device may be another one, or none).
        for device in devices:
            torch.cuda.synchronize(device)
        for key in set(self._buffers) - keys:
            del self._buffers[key]

    def _copy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and isinstance(t, dtensor.DTensor):
            t = t.to_local()
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        return buf

    def _walk(self, obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, dict):
            ints = [k for k in obj if isinstance(k, int) and not isinstance(k, bool)]
            bad = [k for k in obj if not isinstance(k, str) and k not in ints]
            if bad:
                raise SnapshotError(
                    f"state keys must be str or int for a snapshot; {path} has {bad[:3]!r}"
                )
            if ints:
                self.int_keys.append({"path": list(path), "keys": ints})
            out: dict[Any, Any] = {}
            for k, v in obj.items():
                out[k] = self._leaf(out, k, v, [*path, k])
            return out
        if isinstance(obj, list):
            items: list[Any] = [None] * len(obj)
            for i, v in enumerate(obj):
                items[i] = self._leaf(items, i, v, [*path, i])
            return items
        # Anything else (numbers, strings, tuples of them, a sampler's state object) is
        # copied as it is now: the training thread changes it after this returns.
        return copy.deepcopy(obj)

    def _leaf(self, parent: Any, key: Any, value: Any, path: list[Any]) -> Any:
        if isinstance(value, torch.Tensor):
            self._jobs.append((parent, key, value, "/".join(map(repr, path))))
            return None
        return self._walk(value, path)


# ----------------------------------------------------------------------------- writing


def _atomic_json(path: Path, value: Any) -> None:
    """Writes JSON durably: a temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def snapshot_tag(incarnation: str) -> str:
    """Short name of the writing group's incarnation in a snapshot's directory name."""
    return hashlib.sha1(incarnation.encode()).hexdigest()[:10]


def snapshot_path(directory: str | os.PathLike[str], step: int, incarnation: str) -> Path:
    """Where the snapshot of ``step`` written by ``incarnation`` lives."""
    return Path(directory) / f"{_PREFIX}{step:012d}_{snapshot_tag(incarnation)}"


@dataclass
class SnapshotResult:
    """What one rank's write did (for telemetry and tests)."""

    step: int
    path: Path
    #: Seconds the training thread waited for the copy (settle) by the time of the result.
    stage_s: float
    write_s: float
    tensor_bytes: int
    complete: bool
    error: str | None = None
    #: Seconds the copy into the staging buffers took on the writer thread.
    copy_s: float = 0.0


class SnapshotWriter:
    """Writes this rank's snapshots (see the module docs).

    Args:
        directory: the snapshot directory (shared by every group).
        every: committed steps between snapshots.
        keep: complete snapshots kept.
        replica_id: the group's stable name (recorded in the manifest).
        incarnation: the group's id for this start (names the directory).
        group_rank: this rank in its group.
        group_world_size: ranks in the group.
        timeout: how long rank 0 waits for the other ranks' parts.
        on_done: called with each write's :class:`SnapshotResult` (on the writer thread).
        confirm: rank 0 calls it with the step before making a written snapshot complete:
            a note for the manifest once the state is confirmed (or needs no confirmation),
            None while the check is pending; it raises when the state must not become a
            snapshot. None: complete at once.
        confirm_timeout: how long rank 0 waits for ``confirm``.

    Raises:
        ValueError: ``every`` or ``keep`` below 1, a timeout that is not a positive finite
            number of seconds, or ``group_rank`` outside ``[0, group_world_size)``.
    """

    def __init__(
        self,
        directory: str,
        every: int,
        keep: int,
        replica_id: str,
        incarnation: str,
        group_rank: int,
        group_world_size: int,
        timeout: float,
        on_done: Callable[[SnapshotResult], None] | None = None,
        confirm: Callable[[int], str | None] | None = None,
        confirm_timeout: float = PARITY_CONFIRM_TIMEOUT_S,
    ) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"every and keep must be at least 1, got every={every} keep={keep}")
        for what, seconds in (("timeout", timeout), ("confirm_timeout", confirm_timeout)):
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{what} must be a positive number of seconds, got {seconds}")
        if not 0 <= group_rank < group_world_size:
            raise ValueError(
                f"group_rank {group_rank} is outside a group of {group_world_size} ranks"
            )
        self.directory = Path(directory)
        self._confirm = confirm
        self._confirm_timeout = confirm_timeout
        # Snapshots written and waiting for ``confirm``, on a thread of their own.
        self._confirmer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="torchft_snapshot_confirm"
        )
        self._confirming: Future[SnapshotResult] | None = None
        # Set at shutdown: a snapshot still waiting is made complete, marked unconfirmed.
        self._closing = threading.Event()
        self.every = every
        self.keep = keep
        self._replica_id = replica_id
        self._incarnation = incarnation
        self._rank = group_rank
        self._world = group_world_size
        self._timeout = timeout
        self._on_done = on_done
        self._staging = _Staging()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchft_snapshot")
        self._running: Future[SnapshotResult | None] | None = None
        self._running_step = -1
        # Set once the tensors of the snapshot in flight are copied (see settle).
        self._staged = threading.Event()
        self._staged.set()
        # Seconds the training thread waited in settle() for the snapshot in flight.
        self._blocked_s = 0.0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # Training goes on; every snapshot then reports the error.
            logger.error("snapshot directory %s cannot be created: %s", self.directory, e)

    def due(self, step: int) -> bool:
        """Whether committed step ``step`` is a snapshot step."""
        return step > 0 and step % self.every == 0

    def writer_rank(self, step: int, participants: int) -> int:
        """The participating rank of the group that writes the snapshot of ``step``."""
        return (step // self.every) % max(participants, 1)

    def busy(self) -> bool:
        """Whether a write is still in flight."""
        running = self._running
        return running is not None and not running.done()

    def save(self, step: int, quorum_id: int, state: dict[str, Any]) -> SnapshotResult | None:
        """Takes ``state`` (the committed state of ``step``) for a snapshot: its structure
        and non-tensor values now, its tensors on the writer thread, which then writes it.

        Call at the top of a step; call :meth:`settle` before anything writes the state
        (the commit vote, after which the optimizer steps; a heal loading into it).

        Returns:
            None when the snapshot was taken; a failed result (already reported) when the
            previous snapshot is still being written or the state cannot be snapshotted.
        """
        path = snapshot_path(self.directory, step, self._incarnation)
        if self.busy():
            msg = (
                f"snapshot of step {step} skipped: the snapshot of step {self._running_step} "
                "is still being written (raise the interval or speed up the target)"
            )
            return self._fail(step, path, 0.0, msg)
        try:
            skeleton = self._staging.prepare(state)
        except Exception as e:
            return self._fail(step, path, 0.0, f"staging failed: {e}")
        user_keys = sorted(state.get("user", {}))
        self._staged = threading.Event()
        self._blocked_s = 0.0
        self._running_step = step
        self._running = self._pool.submit(
            self._stage_and_write, step, quorum_id, path, skeleton, user_keys, self._staged
        )
        return None

    def settle(self) -> float:
        """Waits until the tensors of the snapshot in flight are copied (at once when they
        are, or none is); returns the seconds waited."""
        staged = self._staged
        if staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        staged.wait()
        waited = time.perf_counter() - t0
        self._blocked_s += waited
        return waited

    def _stage_and_write(
        self,
        step: int,
        quorum_id: int,
        path: Path,
        skeleton: dict[str, Any],
        user_keys: list[str],
        staged: threading.Event,
    ) -> SnapshotResult | None:
        t0 = time.perf_counter()
        try:
            self._staging.fill()
        except Exception as e:
            return self._fail(step, path, 0.0, f"staging failed: {e}")
        finally:
            staged.set()
        copy_s = time.perf_counter() - t0
        return self._write(
            step,
            quorum_id,
            path,
            skeleton,
            list(self._staging.int_keys),
            user_keys,
            self._staging.tensor_bytes,
            copy_s,
        )

    def _fail(self, step: int, path: Path, stage_s: float, msg: str) -> SnapshotResult:
        logger.error("snapshot of step %d to %s failed: %s", step, path, msg)
        return self._report(SnapshotResult(step, path, stage_s, 0.0, 0, False, msg))

    def _report(self, result: SnapshotResult) -> SnapshotResult:
        """Hands a result to ``on_done`` (which must not break the writer) and returns it."""
        if self._on_done is not None:
            try:
                self._on_done(result)
            except Exception:
                logger.exception("snapshot callback failed")
        return result

    def _write(
        self,
        step: int,
        quorum_id: int,
        path: Path,
        staged: dict[str, Any],
        int_keys: list[dict[str, Any]],
        user_keys: list[str],
        tensor_bytes: int,
        copy_s: float,
    ) -> SnapshotResult | None:
        """Writes this rank's part; rank 0 then gathers the parts and makes the snapshot
        complete, or hands it to the confirmer (and returns None)."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        rank_file = path / f"rank_{self._rank}.json"
        try:
            rank_dir = path / f"rank_{self._rank}"
            rank_dir.mkdir(parents=True, exist_ok=True)
            # torch re-exports save here without listing it as exported (no __all__).
            dcp.save(staged, checkpoint_id=str(rank_dir), no_dist=True)  # type: ignore[attr-defined]
            part = {
                "rank": self._rank,
                "files": _files_of(rank_dir),
                "int_keys": int_keys,
                "tensor_bytes": tensor_bytes,
                "copy_s": copy_s,
            }
            _atomic_json(rank_file, part)
            if self._rank == 0:
                ranks = self._gather_parts(path)
                total = sum(int(p.get("tensor_bytes", 0)) for p in ranks.values())
                manifest = {
                    "format": FORMAT,
                    "step": step,
                    "quorum_id": quorum_id,
                    "replica_id": self._replica_id,
                    "incarnation": self._incarnation,
                    "group_world_size": self._world,
                    "user_keys": user_keys,
                    "tensor_bytes": total,
                    "written_unix": time.time(),
                    "ranks": ranks,
                    "digest": _state_digest(ranks),
                    "torch": torch.__version__,
                }
                if self._confirm is not None:
                    args = (step, path, manifest, time.perf_counter() - t0, copy_s)
                    if not self._must_wait(step) or self._closing.is_set():
                        return self._confirm_and_complete(*args)
                    try:
                        self._confirming = self._confirmer.submit(self._confirm_and_complete, *args)
                    except RuntimeError:  # shut down meanwhile: complete it here
                        return self._confirm_and_complete(*args)
                    return None
                return self._complete(step, path, manifest, time.perf_counter() - t0, copy_s)
        except BaseException as e:  # noqa: BLE001 - reported, never raised into training
            try:
                path.mkdir(parents=True, exist_ok=True)
                _atomic_json(path / f"rank_{self._rank}.failed", {"error": str(e)})
            except Exception:
                pass
            return self._fail(step, path, self._blocked_s, f"{type(e).__name__}: {e}")
        write_s = time.perf_counter() - t0
        return self._report(
            SnapshotResult(step, path, self._blocked_s, write_s, tensor_bytes, False, copy_s=copy_s)
        )

    def _complete(
        self,
        step: int,
        path: Path,
        manifest: dict[str, Any],
        write_s: float,
        copy_s: float,
        parity: tuple[str, float] | None = None,
    ) -> SnapshotResult:
        """Makes the snapshot of ``step`` complete: writes its manifest (with the parity
        check's note, when ``parity`` gives it and how long the wait for it took), prunes
        the old ones, logs and reports it. Raises what writing the manifest raises."""
        if parity is not None:
            manifest["parity"] = parity[0]
        _atomic_json(path / MANIFEST, manifest)
        self._retain()
        tensor_bytes = int(manifest["tensor_bytes"])
        logger.info(
            "snapshot of step %d complete at %s: %d bytes, copied in %.3fs (the training "
            "thread waited %.3fs of it), written in %.3fs%s",
            step,
            path,
            tensor_bytes,
            copy_s,
            self._blocked_s,
            write_s,
            "" if parity is None else f", then {parity[1]:.3f}s for the parity check ({parity[0]})",
        )
        return self._report(
            SnapshotResult(step, path, self._blocked_s, write_s, tensor_bytes, True, copy_s=copy_s)
        )

    def _must_wait(self, step: int) -> bool:
        """Whether the confirmation of ``step`` is still pending (an answer, or an error to
        report, is taken at once on the writer thread)."""
        assert self._confirm is not None
        try:
            return self._confirm(step) is None
        except Exception:
            return False

    def _confirm_and_complete(
        self, step: int, path: Path, manifest: dict[str, Any], write_s: float, copy_s: float
    ) -> SnapshotResult:
        """Waits for ``confirm`` to pass the state of ``step``, then writes the manifest."""
        assert self._confirm is not None
        t0 = time.monotonic()
        deadline = t0 + self._confirm_timeout
        next_log = t0 + 5.0
        while True:
            try:
                note = self._confirm(step)
            except Exception as e:  # noqa: BLE001 - reported, never raised into training
                return self._fail(step, path, self._blocked_s, f"not made complete: {e}")
            now = time.monotonic()
            if note is None and self._closing.is_set():
                note = "unconfirmed: the group shut down before the parity check of this step"
                logger.warning(
                    "snapshot of step %d made complete unconfirmed: the group shut down "
                    "before the parity check of its step",
                    step,
                )
            if note is not None:
                break
            if now >= deadline:
                return self._fail(
                    step,
                    path,
                    self._blocked_s,
                    f"the parity check did not confirm the state of step {step} within "
                    f"{self._confirm_timeout:g}s; the snapshot stays incomplete",
                )
            if now >= next_log:
                logger.info(
                    "snapshot of step %d written; waiting for the parity check of step %d or "
                    "later to confirm the state before making it complete (gives up in %.0fs)",
                    step,
                    step,
                    deadline - now,
                )
                next_log = now + 5.0
            self._closing.wait(0.02)
        try:
            return self._complete(
                step, path, manifest, write_s, copy_s, (note, time.monotonic() - t0)
            )
        except Exception as e:  # noqa: BLE001 - reported, never raised into training
            return self._fail(step, path, self._blocked_s, f"{type(e).__name__}: {e}")

    def _gather_parts(self, path: Path) -> dict[str, Any]:
        """Rank 0 waits for every rank's part of the snapshot (or a rank's failure)."""
        deadline = time.monotonic() + self._timeout
        parts: dict[str, Any] = {}
        next_log = time.monotonic() + 5.0
        while True:
            for rank in range(self._world):
                if str(rank) in parts:
                    continue
                failed = path / f"rank_{rank}.failed"
                if failed.exists():
                    raise SnapshotError(f"rank {rank} failed its part: {failed.read_text()[:500]}")
                f = path / f"rank_{rank}.json"
                if f.exists():
                    with open(f, encoding="utf-8") as fh:
                        parts[str(rank)] = json.load(fh)
            if len(parts) == self._world:
                return parts
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(map(str, range(self._world))) - set(parts), key=int)
                raise SnapshotError(
                    f"ranks {missing} did not write their parts within {self._timeout:.0f}s"
                )
            if now >= next_log:
                logger.info(
                    "snapshot %s: waiting for the parts of ranks %s (gives up in %.0fs)",
                    path.name,
                    sorted(set(map(str, range(self._world))) - set(parts), key=int),
                    deadline - now,
                )
                next_log = now + 5.0
            time.sleep(0.02)

    def _retain(self) -> None:
        """Deletes complete snapshots beyond the newest ``keep``, and incomplete ones older
        than the oldest kept (a newer incomplete one may still be being written)."""
        complete = list_snapshots(self.directory)
        kept, dropped = complete[: self.keep], complete[self.keep :]
        oldest_kept = min((s.step for s in kept), default=0)
        doomed = [s.path for s in dropped]
        kept_paths = {s.path for s in kept}
        for entry in self.directory.iterdir():
            if not entry.name.startswith(_PREFIX) or entry in kept_paths or entry in doomed:
                continue
            if (entry / MANIFEST).exists():
                continue
            try:
                step = int(entry.name[len(_PREFIX) :].split("_", 1)[0])
            except ValueError:
                continue
            if step < oldest_kept:
                doomed.append(entry)
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
            logger.info("snapshot %s deleted (keeping the newest %d)", p.name, self.keep)

    def wait(self, timeout: float | None = None) -> SnapshotResult | None:
        """Waits for the write in flight, and its confirmation on rank 0 (tests, shutdown)."""
        running = self._running
        if running is None:
            return None
        result = running.result(timeout=timeout)
        confirming = self._confirming
        if result is None and confirming is not None:
            return confirming.result(timeout=timeout)
        return result

    def shutdown(self, wait: bool = True) -> None:
        """Lets a write in flight finish (``wait``), then stops the writer thread; a snapshot
        waiting for its confirmation is made complete, marked unconfirmed."""
        self._pool.shutdown(wait=wait)
        self._closing.set()
        self._confirmer.shutdown(wait=wait)


# ----------------------------------------------------------------------------- choosing


def choose_restore(
    snapshots: list[Snapshot],
    above_step: int,
    group_world_size: int,
    user_keys: set[str],
    progress: Callable[[], None] | None = None,
) -> Snapshot | None:
    """The newest usable snapshot newer than ``above_step`` among ``snapshots`` (as
    :func:`list_snapshots` gives them, newest first), checksums verified (``progress``:
    called as they are read).

    Snapshots that are incompatible, incomplete or corrupt are skipped with a warning naming
    them (a corrupt one is also marked, so no process tries it again).
    """
    for snap in snapshots:
        if snap.step <= above_step:
            return None
        reason = unusable_reason(snap, group_world_size, user_keys)
        if reason is None:
            reason = verify(snap, progress)
            if reason is not None:
                mark_corrupt(snap)
                reason = f"corrupt: {reason}"
        if reason is None:
            return snap
        logger.warning(
            "snapshot %s (step %d) skipped: %s; trying the previous one",
            snap.path,
            snap.step,
            reason,
        )
    return None
