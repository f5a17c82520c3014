"""HTTPTransport: round trips (chunked or not, across processes), deadlines, stalled and
dead peers, tampered streams, the state lock, address choice and shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoint_kit import (  # noqa: F401 - the autouse fixture, found by pytest by name
    ALL_DTYPES,
    TIMEOUT,
    assert_identical,
    checkpoint_servers_on_loopback,
    http_pair,
    random_tensor,
    realistic_state,
)

from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._serialization import CheckpointFormatError


class TamperProxy:
    """TCP proxy that can flip one body byte or cut the body of every HTTP response."""

    def __init__(self, target_port: int, flip_at: int | None = None, cut_at: int | None = None):
        self.target_port = target_port
        self.flip_at = flip_at
        self.cut_at = cut_at
        self.tampered = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/checkpoint"

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._socks += [client, upstream]
            for t in (
                threading.Thread(target=self._pipe, args=(client, upstream), daemon=True),
                threading.Thread(target=self._respond, args=(upstream, client), daemon=True),
            ):
                self._threads.append(t)
                t.start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _respond(self, upstream: socket.socket, client: socket.socket) -> None:
        head = b""
        body_off = None
        try:
            while data := upstream.recv(65536):
                buf = bytearray(data)
                if body_off is None:
                    head += bytes(buf)
                    idx = head.find(b"\r\n\r\n")
                    if idx < 0:
                        client.sendall(buf)
                        continue
                    # bytes of this chunk before the body start
                    body_start_in_buf = len(buf) - (len(head) - (idx + 4))
                    client.sendall(buf[:body_start_in_buf])
                    buf = buf[body_start_in_buf:]
                    body_off = 0
                if self.flip_at is not None and body_off <= self.flip_at < body_off + len(buf):
                    buf[self.flip_at - body_off] ^= 0x01
                    with self._lock:
                        self.tampered += 1
                if self.cut_at is not None and body_off + len(buf) > self.cut_at:
                    client.sendall(buf[: max(self.cut_at - body_off, 0)])
                    with self._lock:
                        self.tampered += 1
                    break
                client.sendall(buf)
                body_off += len(buf)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        self._accept.join(2)
        for t in self._threads:
            t.join(2)


@pytest.mark.parametrize("num_chunks", [0, 4])
def test_http_round_trip_realistic_state(num_chunks: int) -> None:
    """Model + AdamW + scheduler + user state arrive bit-identical over HTTP."""
    state, *_ = realistic_state()
    with http_pair(num_chunks=num_chunks) as (sender, receiver):
        assert sender.metadata().startswith("http://")
        sender.send_checkpoint([1], 3, state, TIMEOUT)
        out = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
        assert_identical(state, out)
        # Several receivers may fetch concurrently.
        with ThreadPoolExecutor(3) as pool:
            outs = list(
                pool.map(
                    lambda _: receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT), range(3)
                )
            )
        for o in outs:
            assert_identical(state, o)
        sender.disallow_checkpoint()


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_http_many_tensors_and_empty_state(num_chunks: int) -> None:
    """Many small tensors, an empty dict, and a state without tensors round-trip."""
    gen = torch.Generator().manual_seed(0)
    many = {
        f"t{i}": random_tensor(ALL_DTYPES[i % len(ALL_DTYPES)], (i % 5, 3), gen) for i in range(200)
    }
    with http_pair(num_chunks=num_chunks) as (sender, receiver):
        for step, state in enumerate([many, {}, {"only": [1, 2.0, "x"]}]):
            sender.send_checkpoint([1], step, state, TIMEOUT)
            out = receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT)
            assert_identical(state, out)


def test_http_wrong_step_is_an_error() -> None:
    """Asking for an older step fails at once; a newer one never served times out."""
    with http_pair() as (sender, receiver):
        sender.send_checkpoint([1], 5, {"x": torch.ones(3)}, TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="step 4"):
            receiver.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)
        assert time.monotonic() - t0 < 2
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(0, sender.metadata(), 6, timedelta(seconds=0.5))
        # After disallow, even the current step is no longer served.
        sender.disallow_checkpoint()
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=0.5))
        # An older step than the last served one stays an error after disallow.
        with pytest.raises(RuntimeError, match="step 2"):
            receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)


def test_http_receiver_times_out_when_nothing_served() -> None:
    """A receiver gives up with TimeoutError near its deadline if nothing is offered."""
    with http_pair() as (sender, receiver):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=0.5))
        elapsed = time.monotonic() - t0
        assert 0.3 < elapsed < 3, elapsed


def test_http_receiver_times_out_on_unreachable_or_silent_peer() -> None:
    """A peer that accepts but never answers cannot hang the receiver."""
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts/answers
    receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            receiver.recv_checkpoint(
                0, f"http://127.0.0.1:{port}/checkpoint", 1, timedelta(seconds=0.5)
            )
        assert time.monotonic() - t0 < 3
    finally:
        receiver.shutdown()
        silent.close()


def test_http_receiver_may_ask_before_sender_serves() -> None:
    """A receiver that asks early is answered once the step is offered."""
    state = {"w": torch.randn(10, 10)}
    with http_pair(num_chunks=2) as (sender, receiver):
        timer = threading.Timer(0.3, sender.send_checkpoint, args=([1], 7, state, TIMEOUT))
        timer.start()
        try:
            out = receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
        finally:
            timer.cancel()
            timer.join()
        assert_identical(state, out)


@pytest.mark.timeout(60)
def test_http_stalled_receiver_does_not_block_sender() -> None:
    """Receivers that connect and stall never hold up disallow/shutdown or the state lock."""
    held = 0
    held_lock = threading.Lock()

    @contextmanager
    def read_lock() -> Iterator[None]:
        nonlocal held
        with held_lock:
            held += 1
        try:
            yield
        finally:
            with held_lock:
                held -= 1

    big = {"w": torch.randn(16 << 20)}  # 64 MiB: far more than socket buffers hold
    sender: HTTPTransport[Any] = HTTPTransport(timedelta(seconds=30), state_dict_lock=read_lock)
    port = int(sender.metadata().split(":")[2].split("/")[0])
    sockets = []
    try:
        sender.send_checkpoint([1], 1, big, TIMEOUT)
        # One receiver requests the body and never reads it, one never sends a request.
        reader = socket.create_connection(("127.0.0.1", port))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.sendall(b"GET /checkpoint/1/full?wait=1 HTTP/1.0\r\n\r\n")
        idle = socket.create_connection(("127.0.0.1", port))
        sockets += [reader, idle]
        deadline = time.monotonic() + 10
        while held == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held == 1, "transfer did not start"
        time.sleep(0.3)  # let the server block on the full socket buffer

        t0 = time.monotonic()
        sender.disallow_checkpoint()
        assert time.monotonic() - t0 < 2
        assert held == 0, "state lock still held after disallow_checkpoint"

        # The server keeps working for others after the aborted transfer.
        sender.send_checkpoint([1], 2, {"x": torch.ones(2)}, TIMEOUT)
        receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
        try:
            out = receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)
            assert torch.equal(out["x"], torch.ones(2))
        finally:
            receiver.shutdown()

        # A stalled transfer again, then shutdown must return promptly.
        sender.send_checkpoint([1], 3, big, TIMEOUT)
        reader2 = socket.create_connection(("127.0.0.1", port))
        reader2.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader2.sendall(b"GET /checkpoint/3/full?wait=1 HTTP/1.0\r\n\r\n")
        sockets.append(reader2)
        deadline = time.monotonic() + 10
        while held == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        t0 = time.monotonic()
        sender.shutdown()
        assert time.monotonic() - t0 < 3
        assert held == 0
    finally:
        sender.shutdown()
        for s in sockets:
            s.close()


@pytest.mark.timeout(30)
def test_http_server_deadline_bounds_a_slow_receiver() -> None:
    """Without disallow, a stalled transfer is cut (lock released) at the offer's timeout."""
    held = threading.Semaphore(0)
    released = threading.Event()

    @contextmanager
    def read_lock() -> Iterator[None]:
        held.release()
        try:
            yield
        finally:
            released.set()

    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT, state_dict_lock=read_lock)
    port = int(sender.metadata().split(":")[2].split("/")[0])
    reader = socket.create_connection(("127.0.0.1", port))
    try:
        sender.send_checkpoint([1], 1, {"w": torch.randn(16 << 20)}, timedelta(seconds=1))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.sendall(b"GET /checkpoint/1/full HTTP/1.0\r\n\r\n")
        assert held.acquire(timeout=5), "transfer did not start"
        t0 = time.monotonic()
        assert released.wait(timeout=5), "stalled transfer still holds the state lock"
        assert 0.5 < time.monotonic() - t0 < 3
        # The connection is dropped, not left streaming.
        deadline = time.monotonic() + 3
        while sender._server.connections() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sender._server.connections()
    finally:
        reader.close()
        sender.shutdown()


@pytest.mark.parametrize("num_chunks", [0, 4])
@pytest.mark.parametrize("where", ["header", "tensor"])
def test_http_corrupted_stream_is_detected(num_chunks: int, where: str) -> None:
    """A byte flipped in transit (tampering proxy) raises, nothing is returned (the HTTP
    path; the native one has its own tampering tests)."""
    state = {"a": torch.randn(64, 64), "b": torch.randn(1000), "c": [torch.arange(100)], "n": 1}
    with http_pair(num_chunks=num_chunks, native=False) as (sender, receiver):
        sender.send_checkpoint([1], 1, state, TIMEOUT)
        flip_at = 30 if where == "header" else 3000
        if where == "header" and num_chunks:
            flip_at = 20  # within the separately fetched header frame
        port = int(sender.metadata().split(":")[2].split("/")[0])
        proxy = TamperProxy(port, flip_at=flip_at)
        try:
            with pytest.raises(CheckpointFormatError):
                receiver.recv_checkpoint(0, proxy.url(), 1, TIMEOUT)
            assert proxy.tampered >= 1
        finally:
            proxy.close()
        # The untampered path still works.
        assert_identical(state, receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT))


@pytest.mark.parametrize("num_chunks", [0, 4])
@pytest.mark.parametrize("cut_at", [0, 10, 5000, 16_000])
def test_http_truncated_stream_is_detected(num_chunks: int, cut_at: int) -> None:
    """A body cut short by the network raises instead of returning partial state (the HTTP
    path)."""
    state = {"a": torch.randn(64, 64), "b": torch.randn(1000), "c": [torch.arange(100)]}
    with http_pair(num_chunks=num_chunks, native=False) as (sender, receiver):
        sender.send_checkpoint([1], 1, state, TIMEOUT)
        port = int(sender.metadata().split(":")[2].split("/")[0])
        proxy = TamperProxy(port, cut_at=cut_at)
        try:
            with pytest.raises(CheckpointFormatError):
                receiver.recv_checkpoint(0, proxy.url(), 1, TIMEOUT)
        finally:
            proxy.close()


def test_http_uses_state_dict_lock_while_serving() -> None:
    """The read lock is taken for every data request and released afterwards."""
    entered = []

    @contextmanager
    def lock() -> Iterator[None]:
        entered.append(threading.current_thread().name)
        yield

    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT, state_dict_lock=lock)
    receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT, num_chunks=2)
    try:
        sender.send_checkpoint([1], 1, {"a": torch.ones(10), "b": torch.zeros(10)}, TIMEOUT)
        receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert len(entered) == 2  # two range requests (the header needs no lock)
        assert all(name != threading.current_thread().name for name in entered)
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_http_rejects_garbage_requests() -> None:
    """Malformed URLs get a 4xx answer and do not disturb serving."""
    import http.client

    with http_pair() as (sender, receiver):
        sender.send_checkpoint([1], 1, {"a": torch.ones(2)}, TIMEOUT)
        port = int(sender.metadata().split(":")[2].split("/")[0])
        for path in [
            "/",
            "/checkpoint/abc/full",
            "/checkpoint/1/range/0/99?gen=x",
            "/checkpoint/1/unknown",
            "/checkpoint/1/full?wait=nan",
            "/checkpoint/1/range/a/b?gen=x",
        ]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                assert 400 <= resp.status < 500, (path, resp.status)
                resp.read()
            finally:
                conn.close()
        out = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert torch.equal(out["a"], torch.ones(2))


def test_http_metadata_is_reachable_and_env_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """metadata() names a reachable address; TORCHFT_TIMEOUT_SEC overrides the timeout."""
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "3.5")
    transport: HTTPTransport[Any] = HTTPTransport(timedelta(seconds=100))
    try:
        assert transport._timeout == timedelta(seconds=3.5)
        from urllib.parse import urlsplit

        url = urlsplit(transport.metadata())
        assert url.hostname and url.port
        with socket.create_connection((url.hostname, url.port), timeout=2):
            pass
    finally:
        transport.shutdown()
    with pytest.raises(ValueError):
        HTTPTransport(TIMEOUT, num_chunks=-1)


def test_http_metadata_falls_back_when_hostname_is_unusable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unresolvable hostname is skipped for an address that reaches the server."""
    from urllib.parse import urlsplit

    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "no-such-host.invalid")
    with http_pair() as (sender, receiver):
        url = urlsplit(sender.metadata())
        assert url.hostname and "invalid" not in url.hostname
        sender.send_checkpoint([1], 1, {"a": torch.arange(3)}, TIMEOUT)
        out = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert torch.equal(out["a"], torch.arange(3))


def test_http_shutdown_leaves_no_threads() -> None:
    """After shutdown(wait=True) no server, connection or fetch thread is left running."""
    before = set(threading.enumerate())
    with http_pair(num_chunks=3) as (sender, receiver):
        sender.send_checkpoint([1], 1, {"x": [torch.randn(1000) for _ in range(10)]}, TIMEOUT)
        receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        assert set(threading.enumerate()) - before, "the transports run server threads"
    deadline = time.monotonic() + 3
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in set(threading.enumerate()) - before]


def test_http_shutdown_is_idempotent_and_refuses_new_sends() -> None:
    """After shutdown the transport refuses to serve and a second shutdown is a no-op."""
    transport: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    transport.shutdown()
    transport.shutdown()
    with pytest.raises(RuntimeError):
        transport.send_checkpoint([1], 1, {}, TIMEOUT)


_SENDER_PROCESS = """
import sys, time
from contextlib import contextmanager
from datetime import timedelta

from _checkpoint_kit import realistic_state
from torchft.checkpointing import HTTPTransport

mode = sys.argv[1]


@contextmanager
def slow_lock():
    print("LOCKED", flush=True)
    time.sleep(float(sys.argv[2]))
    yield


lock = slow_lock if mode == "slow_lock" else None
state, *_ = realistic_state(seed=5)
transport = HTTPTransport(timedelta(seconds=30), state_dict_lock=lock)
transport.send_checkpoint([1], 9, state, timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.read()
transport.shutdown()
"""


@contextmanager
def sender_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Runs an HTTPTransport sender in its own process; yields it and its metadata URL."""
    import torchft

    paths = [str(Path(torchft.__file__).parent.parent), str(Path(__file__).parent)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER_PROCESS, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), f"sender process failed to start: {url!r}"
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


@pytest.mark.timeout(90)
def test_http_round_trip_across_processes() -> None:
    """A state served by another process arrives bit-identical to a local rebuild of it."""
    expected, *_ = realistic_state(seed=5)
    with sender_process("plain") as (_, url):
        for num_chunks in (0, 4):
            receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT, num_chunks=num_chunks)
            try:
                out = receiver.recv_checkpoint(0, url, 9, TIMEOUT)
            finally:
                receiver.shutdown()
            assert_identical(expected, out)


@pytest.mark.timeout(90)
def test_http_hung_or_killed_sender_fails_receiver_promptly() -> None:
    """SIGSTOP on the sender ends in TimeoutError at the deadline; SIGKILL in a prompt error."""
    receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        with sender_process("plain") as (proc, url):
            proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError):
                    receiver.recv_checkpoint(0, url, 9, timedelta(seconds=1))
                assert time.monotonic() - t0 < 4
            finally:
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10)
            t0 = time.monotonic()
            with pytest.raises(ConnectionError):
                receiver.recv_checkpoint(0, url, 9, TIMEOUT)
            assert time.monotonic() - t0 < 3

        # Killed while it holds the request (before the body): the receiver fails at once.
        with sender_process("slow_lock", "30") as (proc, url):
            result: list[BaseException | None] = []

            def fetch() -> None:
                try:
                    receiver.recv_checkpoint(0, url, 9, TIMEOUT)
                    result.append(None)
                except BaseException as e:  # noqa: BLE001
                    result.append(e)

            thread = threading.Thread(target=fetch)
            thread.start()
            assert proc.stdout is not None
            # Each parallel stream takes the lock: one or more LOCKED on the line.
            assert proc.stdout.readline().startswith("LOCKED")
            t0 = time.monotonic()
            proc.kill()
            thread.join(timeout=8)
            assert not thread.is_alive()
            assert time.monotonic() - t0 < 3
            assert isinstance(result[0], ConnectionError), result
    finally:
        receiver.shutdown()
