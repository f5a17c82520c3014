"""The wire between a child-process group and its parent.

The parent sends each operation as a pickled ``_BabyOp`` over a Unix socket, with tensors in
shared memory whose fds ride in-band (SCM_RIGHTS); the child (``_baby_worker``) runs it on a
real process group and answers over a pipe. ``_BabyChild`` is the parent's handle on one child:
its process, pipes, a sender and a reader thread, and the futures still pending.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C import _distributed_c10d as c10d
from torch._C._distributed_c10d import Store
from torch.distributed import ReduceOp
from torch.futures import Future

from torchft.process_group.base import ProcessGroup, create_store_client

logger: logging.Logger = logging.getLogger(__name__)

_REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def _reduce_op_name(op: Any) -> str:
    """Turns a ReduceOp (which cannot be pickled) into its name."""
    for name in _REDUCE_OPS:
        if op == getattr(ReduceOp, name):
            return name
    raise ValueError(f"unsupported reduce op for a child-process group: {op!r}")


def _detach(value: object) -> object:
    """Detaches tensors (sharing storage) so they can be sent to the child process."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, list):
        return [_detach(v) for v in value]
    return value


@dataclass(frozen=True)
class _WireOptions:
    """A collective's options in picklable form (torch's option objects cannot be pickled).

    Only what the child's group acts on travels: the reduce op and the broadcast root. The
    child applies its own timeout.
    """

    kind: str
    reduce_op: str | None = None
    root: int | None = None

    @classmethod
    def of(cls, opts: Any) -> _WireOptions:
        reduce_op = getattr(opts, "reduceOp", None)
        root = getattr(opts, "rootRank", None)
        return cls(
            kind=type(opts).__name__,
            reduce_op=_reduce_op_name(reduce_op) if reduce_op is not None else None,
            root=int(root) if root is not None else None,
        )

    def build(self) -> Any:
        cls = getattr(c10d, self.kind, None)
        if cls is None or not self.kind.endswith("Options"):
            raise ValueError(f"unknown collective options {self.kind!r}")
        opts = cls()
        if self.reduce_op is not None:
            opts.reduceOp = getattr(ReduceOp, self.reduce_op)
        if self.root is not None:
            opts.rootRank = self.root
        return opts


_OPTION_TYPES = (
    c10d.AllgatherOptions,
    c10d.AllreduceCoalescedOptions,
    c10d.AllreduceOptions,
    c10d.AllToAllOptions,
    c10d.BarrierOptions,
    c10d.BroadcastOptions,
    c10d.ReduceScatterOptions,
)


def _to_wire(args: tuple[Any, ...]) -> tuple[object, ...]:
    """A collective's arguments as the child receives them: tensors detached (their storage
    goes to shared memory when pickled) and options in picklable form.

    Raises:
        ValueError: the options name a reduce op a child-process group cannot run.
    """
    return tuple(_WireOptions.of(a) if isinstance(a, _OPTION_TYPES) else _detach(a) for a in args)


def _from_wire(args: tuple[object, ...]) -> tuple[object, ...]:
    """Rebuilds torch option objects from ``_to_wire``'s output (child side)."""
    return tuple(a.build() if isinstance(a, _WireOptions) else a for a in args)


# Tensors go to the child as shared memory. torch's default pickling passes each storage's
# fd through a helper thread that keeps a duplicate until the receiver fetches it, which
# leaks when the child is killed first (the usual case for a stuck collective). Here the
# fds travel in-band with the message over a Unix socket instead (SCM_RIGHTS): if the child
# dies before reading, the kernel closes them with the socket.

_HEADER = struct.Struct("!QI")  # payload length, number of fds
_MAX_FDS = 4096
_fd_context = threading.local()


def _reduce_storage_inband(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """Pickles a CPU storage as an index into the fds sent with the message."""
    fds: list[int] | None = getattr(_fd_context, "fds", None)
    if fds is None or storage.device.type != "cpu" or storage.size() == 0:
        from torch.multiprocessing.reductions import reduce_storage

        # torch leaves torch.multiprocessing.reductions unannotated.
        return reduce_storage(storage)  # type: ignore[no-untyped-call,no-any-return]
    fd, size = storage._share_fd_cpu_()
    fds.append(fd)
    return (_rebuild_storage_inband, (len(fds) - 1, size))


def _rebuild_storage_inband(index: int, size: int) -> torch.UntypedStorage:
    """Maps the ``index``-th fd received with the current message (child side)."""
    from torch.multiprocessing.reductions import StorageWeakRef, fd_id, shared_cache

    # torch leaves torch.multiprocessing.reductions unannotated, and UntypedStorage's stub
    # lacks the _new_shared_fd_cpu constructor that reductions.rebuild_storage_fd uses.
    fd = _fd_context.received[index]
    key = fd_id(fd)  # type: ignore[no-untyped-call]
    cached = shared_cache.get(key)  # type: ignore[no-untyped-call]
    if cached is not None:
        storage = torch.UntypedStorage._new_with_weak_ptr(cached.cdata)
        if storage is not None:
            return storage
    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]
    shared_cache[key] = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
    return storage  # type: ignore[no-any-return]


class _InbandPickler(ForkingPickler):
    """ForkingPickler whose CPU storages are sent as in-band fds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage_inband


def _dumps_inband(obj: object) -> tuple[bytes, list[int]]:
    """Pickles ``obj``; returns the bytes and the fds (owned by the storages) to send."""
    buf = io.BytesIO()
    fds: list[int] = []
    _fd_context.fds = fds
    try:
        _InbandPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        _fd_context.fds = None
    return buf.getvalue(), fds


def _send_inband(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """Sends one framed message; the fds ride with its header."""
    header = _HEADER.pack(len(payload), len(fds))
    if fds:
        sent = socket.send_fds(sock, [header], fds)
        if sent < len(header):
            sock.sendall(header[sent:])
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise EOFError("socket closed")
        chunks += chunk
    return bytes(chunks)


def _recv_inband(sock: socket.socket) -> object:
    """Receives one framed message and unpickles it (closing the received fds after)."""
    data, fds, flags, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    try:
        if not data:
            raise EOFError("socket closed")
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            raise RuntimeError("too many tensors in one operation")
        if len(data) < _HEADER.size:
            data += _recv_exact(sock, _HEADER.size - len(data))
        length, nfds = _HEADER.unpack(data)
        if nfds != len(fds):
            raise RuntimeError(f"expected {nfds} fds, received {len(fds)}")
        payload = _recv_exact(sock, length)
        _fd_context.received = fds
        try:
            return pickle.loads(payload)
        finally:
            _fd_context.received = None
    finally:
        for fd in fds:
            os.close(fd)


@dataclass
class _BabyOp:
    """One operation sent to the child: a ProcessGroup method name and picklable args."""

    op_id: int
    method: str
    args: tuple[object, ...]


def _child_run_op(pg: ProcessGroup, method: str, args: tuple[object, ...]) -> dist.Work:
    """Rebuilds torch options from the wire arguments and runs the op on ``pg``."""
    work: dist.Work = getattr(pg, method)(*_from_wire(args))
    return work


def _start_parent_watchdog(parent_pid: int, interval: float = 0.5) -> None:
    """Exits this (child) process soon after its parent dies.

    EOF on the request pipe covers the common case, but the child may be stuck elsewhere
    (e.g. in a rendezvous that never completes); polling the parent pid covers that. A
    kernel parent-death signal is not used because it fires when the *thread* that
    spawned us exits, which is legitimate here.
    """

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(interval)

    threading.Thread(target=watch, name="torchft_parent_watchdog", daemon=True).start()


@dataclass(frozen=True)
class _ChildGroup:
    """The group a child process builds: how (``create``), on which store, as which rank of
    how many, with which timeout, and on which CUDA device (None: CPU)."""

    create: Callable[[Store, int, int, timedelta], ProcessGroup]
    store_addr: str
    rank: int
    world_size: int
    timeout: timedelta
    cuda_device: int | None


def _baby_worker(group: _ChildGroup, req: Any, resp: Any, parent_pid: int) -> None:
    """Entry point of the child process: builds the group and serves operations.

    Replies are ("ready",), ("done", op_id), ("error", op_id, message) or ("fatal", message).
    The loop ends when the parent closes its pipe (or dies) or asks for shutdown.
    """
    _start_parent_watchdog(parent_pid)
    use_cuda = group.cuda_device is not None
    if group.cuda_device is not None:
        # Same device as the parent's tensors.
        torch.cuda.set_device(group.cuda_device)
    send_lock = threading.Lock()

    def reply(msg: tuple[object, ...]) -> None:
        with send_lock:
            try:
                resp.send(msg)
            except (OSError, EOFError):
                pass

    try:
        store = create_store_client(group.store_addr, group.timeout)
        pg = group.create(store, group.rank, group.world_size, group.timeout)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        reply(("fatal", f"{type(e).__name__}: {e}"))
        return
    reply(("ready",))

    while True:
        try:
            msg = _recv_inband(req)
        except (EOFError, OSError):
            # The parent is gone: exit at once, even if a collective is stuck in the backend.
            os._exit(0)
        if msg is None:
            break
        if not isinstance(msg, _BabyOp):
            reply(("fatal", f"unexpected message {type(msg).__name__}"))
            break
        op_id = msg.op_id
        try:
            work = _child_run_op(pg, msg.method, msg.args)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            reply(("error", op_id, f"{type(e).__name__}: {e}"))
            continue

        def done(fut: Future[Any], op_id: int = op_id) -> None:
            try:
                fut.value()
                if use_cuda:
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported to the parent
                reply(("error", op_id, f"{type(e).__name__}: {e}"))
                return
            reply(("done", op_id))

        work.get_future().add_done_callback(done)
    # Polite shutdown requested; the parent kills us if this takes too long.
    pg.shutdown()


class _BabyChild:
    """Parent-side handle of one child process: pipes, a reader thread and pending futures."""

    def __init__(self, group: _ChildGroup) -> None:
        ctx = mp.get_context("spawn")
        req_w, req_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        resp_r, resp_w = ctx.Pipe(duplex=False)
        self._req = req_w
        self._resp = resp_r
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future[Any], object]] = {}
        self._next_id = 0
        self._closed = False
        self._error: Exception | None = None
        self.ready: Future[None] = Future()
        self.process = ctx.Process(
            target=_baby_worker,
            args=(group, req_r, resp_w, os.getpid()),
            name=f"torchft_baby_{group.rank}",
            daemon=True,
        )
        try:
            self.process.start()
        finally:
            # The child owns these ends now; keeping them open would hide its death (no EOF).
            req_r.close()
            resp_w.close()
        self._outbox: queue.SimpleQueue[tuple[bytes, list[int], object] | None] = (
            queue.SimpleQueue()
        )
        self._reader = threading.Thread(
            target=self._read_loop, name="torchft_baby_reader", daemon=True
        )
        self._reader.start()
        self._sender = threading.Thread(
            target=self._send_loop, name="torchft_baby_sender", daemon=True
        )
        self._sender.start()

    def submit(self, method: str, args: tuple[object, ...], result: object) -> Future[Any]:
        """Sends one operation; the returned future resolves to ``result`` when it is done."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed or self._error is not None:
                err = self._error or RuntimeError("child process group is closed")
                fut.set_exception(err)
                return fut
            op_id = self._next_id
            self._next_id += 1
            self._pending[op_id] = (fut, result)
        try:
            # Pickled here, in the caller's thread: this is where tensors move to shared
            # memory, so it must not race with the caller's own use of them.
            payload, fds = _dumps_inband(_BabyOp(op_id, method, args))
        except Exception as e:  # noqa: BLE001 - e.g. a tensor that cannot be shared
            with self._lock:
                self._pending.pop(op_id, None)
            fut.set_exception(RuntimeError(f"cannot send {method} to the child process: {e}"))
            return fut
        # A separate thread writes to the pipe, so a stuck child (full pipe) never blocks us.
        # ``args`` rides along: its storages own the fds until they are sent.
        self._outbox.put((payload, fds, args))
        return fut

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            payload, fds, _keepalive = item
            try:
                _send_inband(self._req, payload, fds)
            except Exception as e:  # noqa: BLE001 - broken pipe means the child is gone
                self._fail_all(RuntimeError(f"sending to the child process failed: {e}"))
                return

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._resp.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - a garbled reply ends the child
                logger.warning("bad reply from the child process group: %s", e)
                break
            kind = msg[0]
            if kind == "ready":
                self.ready.set_result(None)
            elif kind == "fatal":
                self._fail_all(RuntimeError(f"child process group failed to start: {msg[1]}"))
            elif kind in ("done", "error"):
                with self._lock:
                    entry = self._pending.pop(msg[1], None)
                if entry is None:
                    continue
                fut, result = entry
                if kind == "done":
                    fut.set_result(result)
                else:
                    fut.set_exception(RuntimeError(f"collective failed in child: {msg[2]}"))
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        self._fail_all(RuntimeError(f"child process group exited (exit code {code})"))

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
            pending = [fut for fut, _ in self._pending.values()]
            self._pending.clear()
        if not self.ready.done():
            # torch types set_exception's argument as the result type, not an exception.
            self.ready.set_exception(err)  # type: ignore[arg-type]
        # Only futures are kept here (not their tensors): an error stored later may hold this
        # frame through its traceback.
        for fut in pending:
            if not fut.done():
                fut.set_exception(err)

    @property
    def error(self) -> Exception | None:
        """Why the child stopped serving, if it did."""
        with self._lock:
            return self._error

    def close(self, graceful: bool = False) -> None:
        """Stops the child (politely if ``graceful``), joins it and releases every fd."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if graceful and self.process.is_alive():
            self._outbox.put((pickle.dumps(None), [], None))
            self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10.0)
        self._outbox.put(None)
        self._sender.join(timeout=10.0)
        self._reader.join(timeout=10.0)
        self._fail_all(RuntimeError("child process group was shut down"))
        self._req.close()
        self._resp.close()
        try:
            self.process.close()
        except ValueError:
            logger.warning("child process %s did not exit", self.process.pid)
