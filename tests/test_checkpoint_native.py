"""Tests for the native checkpoint data path behind HTTPTransport (real sockets, real
processes and signals for the fault cases)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchft.checkpointing import HTTPTransport
from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._security import CheckpointAuthError, TransportSecurity
from torchft.checkpointing.http import fetch

TIMEOUT = timedelta(seconds=30)
REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoint servers listen on 127.0.0.1, whatever this host's name resolves to."""
    monkeypatch.setenv("TORCHFT_CHECKPOINT_BIND", "127.0.0.1")


@contextmanager
def transports(
    sender_kw: dict[str, Any] | None = None, receiver_kw: dict[str, Any] | None = None
) -> Iterator[tuple[HTTPTransport[Any], HTTPTransport[Any]]]:
    """A sender and a receiver transport, shut down afterwards."""
    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT, **(sender_kw or {}))
    try:
        receiver: HTTPTransport[Any] = HTTPTransport(TIMEOUT, **(receiver_kw or {}))
        try:
            yield sender, receiver
        finally:
            receiver.shutdown()
    finally:
        sender.shutdown()


def no_http_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes any tensor bytes fetched over HTTP fail the test: they must go natively."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tensor bytes were fetched over HTTP, not the native path")

    monkeypatch.setattr(fetch.Receive, "http_ranges", refuse)


def sample_state() -> dict[str, Any]:
    """Model-like state with every kind of value the format carries."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3 << 18, generator=g)  # 3 MiB: several pieces
    return {
        "model": OrderedDict(
            w=big,
            b=torch.randn(17, generator=g).to(torch.bfloat16),
            t=torch.randn(64, 32, generator=g).t(),  # non-contiguous: staged
            empty=torch.empty(0),
            i=torch.arange(10, dtype=torch.int64),
        ),
        "optim": {"state": {0: {"step": 3, "lr": 0.1}}, "groups": [(1, "a"), None]},
        "blob": b"\x00\x01bytes",
        "step": 5,
    }


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(ser.tensor_bytes(a), ser.tensor_bytes(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """The receiver's own state: same structure, contiguous zeroed tensors."""

    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, dict):
            return type(v)((k, z(x)) for k, x in v.items())
        return v

    return z(state)


# --------------------------------------------------------------------------- happy paths


def test_native_receive_writes_into_the_receivers_own_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every tensor lands in the receiver's existing tensor (same memory), bit-identical,
    with non-tensor state typed, and no byte goes over HTTP."""
    no_http_bytes(monkeypatch)
    state = sample_state()
    local = zeros_like_state(state)
    before = {k: v.data_ptr() for k, v in local["model"].items() if v.numel()}
    with transports(receiver_kw={"state_dict": lambda: local, "num_chunks": 3}) as (s, r):
        s.send_checkpoint([1], 5, state, TIMEOUT)
        got = r.recv_checkpoint(0, s.metadata(), 5, TIMEOUT)
        s.disallow_checkpoint()
    assert_same(got, state)
    for k, ptr in before.items():
        assert got["model"][k].data_ptr() == ptr, k
        assert torch.equal(local["model"][k], state["model"][k].contiguous()), k


def test_native_receive_without_local_state_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``state_dict`` the receiver allocates; tensors shared on the sender and tied
    (overlapping) tensors on the receiver never get written twice."""
    no_http_bytes(monkeypatch)
    state = sample_state()
    with transports() as (s, r):
        s.send_checkpoint([1], 5, state, TIMEOUT)
        assert_same(r.recv_checkpoint(0, s.metadata(), 5, TIMEOUT), state)

    shared = torch.arange(8, dtype=torch.float32)
    sent = {"a": shared.clone(), "b": shared.clone() + 1}
    tied = torch.zeros(8)
    local = {"a": tied, "b": tied.view(8)}  # two names, one memory
    with transports(receiver_kw={"state_dict": lambda: local}) as (s, r):
        s.send_checkpoint([1], 1, sent, TIMEOUT)
        got = r.recv_checkpoint(0, s.metadata(), 1, TIMEOUT)
    assert torch.equal(got["a"], sent["a"]) and torch.equal(got["b"], sent["b"])
    assert got["a"].data_ptr() != got["b"].data_ptr()


def test_the_transport_says_whether_a_receive_wrote_into_local_tensors() -> None:
    """``touched_local_state``: False for a receive that failed before its header (the
    source is gone; the local state is whole) and for one into new tensors (``state_dict``
    returned None), True once a receive wrote into the local state."""
    state = sample_state()
    local = zeros_like_state(state)
    into: list[Any] = [None]
    with transports(receiver_kw={"state_dict": lambda: into[0]}) as (s, r):
        gone = socket.socket()
        gone.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{gone.getsockname()[1]}/checkpoint"
        gone.close()
        into[0] = local
        with pytest.raises(ConnectionError):
            r.recv_checkpoint(0, dead, 5, timedelta(seconds=5))
        assert r.receives_in_place and not r.touched_local_state
        s.send_checkpoint([1], 5, state, TIMEOUT)
        into[0] = None
        r.recv_checkpoint(0, s.metadata(), 5, TIMEOUT)
        assert not r.touched_local_state
        into[0] = local
        r.recv_checkpoint(0, s.metadata(), 5, TIMEOUT)
        assert r.touched_local_state
        s.disallow_checkpoint()


def test_native_and_http_only_peers_interoperate() -> None:
    """A sender without the native path serves a native receiver over HTTP, and the reverse."""
    state = sample_state()
    for sender_kw, receiver_kw in (({"native": False}, {}), ({}, {"native": False})):
        with transports(sender_kw, receiver_kw) as (s, r):
            s.send_checkpoint([1], 5, state, TIMEOUT)
            assert_same(r.recv_checkpoint(0, s.metadata(), 5, TIMEOUT), state)


def _header(metadata: str, step: int, token: str) -> ser.Header:
    """The offer's header, fetched as a receiver does (over HTTP, with the token)."""
    req = urllib.request.Request(
        f"{metadata}/{step}/header?wait=5", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return ser.read_header(resp.readinto)


def test_token_guards_the_native_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The data server refuses a missing or wrong token before sending a byte, and serves
    the right one; a receiver with the wrong token gets CheckpointAuthError."""
    from torchft import _torchft

    state = {"w": torch.arange(1000, dtype=torch.float32)}
    secured = TransportSecurity(token="right")
    with transports({"security": secured}) as (s, r):
        s.send_checkpoint([1], 2, state, TIMEOUT)
        header = _header(s.metadata(), 2, "right")
        addr = f"127.0.0.1:{header.meta['data_port']}"
        out = torch.zeros(1000)
        for token, why in ((None, "missing token"), ("wrong", "wrong token")):
            fail = _torchft.CheckpointFetch().run(
                addr, token, 2, header.meta["gen"], [(0, 1)], [(out.data_ptr(), 4000)], TIMEOUT
            )
            assert fail is not None and fail[:2] == ("refused", 401), fail
            assert why in fail[2]
            assert not out.any()
        assert (
            _torchft.CheckpointFetch().run(
                addr, "right", 2, header.meta["gen"], [(0, 1)], [(out.data_ptr(), 4000)], TIMEOUT
            )
            is None
        )
        assert torch.equal(out, state["w"])
        with pytest.raises(CheckpointAuthError):
            r.recv_checkpoint(0, s.metadata(), 2, TIMEOUT)
    with transports({"security": secured}, {"security": secured}) as (s, r):
        no_http_bytes(monkeypatch)
        s.send_checkpoint([1], 2, state, TIMEOUT)
        assert torch.equal(r.recv_checkpoint(0, s.metadata(), 2, TIMEOUT)["w"], state["w"])


def test_tls_keeps_the_https_path() -> None:
    """A TLS server opens no native data port: its bytes stay encrypted (HTTPS)."""
    certs = REPO / "tests" / "certs"
    tls = TransportSecurity(
        tls_cert=str(certs / "server.pem"),
        tls_key=str(certs / "server.key"),
        tls_ca=str(certs / "ca.pem"),
    )
    state = {"w": torch.arange(100, dtype=torch.float32)}
    with transports({"security": tls, "hostname": "localhost"}, {"security": tls}) as (s, r):
        assert s._data is None
        s.send_checkpoint([1], 1, state, TIMEOUT)
        assert torch.equal(r.recv_checkpoint(0, s.metadata(), 1, TIMEOUT)["w"], state["w"])


def test_a_pickle_speaking_client_is_told_clearly() -> None:
    """A request in the pickle-based transport's form gets a 400 that says why."""
    with transports() as (s, _):
        s.send_checkpoint([1], 3, {"w": torch.ones(3)}, TIMEOUT)
        for path in ("/3", "/3/0"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(s.metadata() + path, timeout=10)
            assert e.value.code == 400
            assert "never pickle" in e.value.read().decode()


def test_a_pickle_serving_source_is_refused_without_unpickling() -> None:
    """A source answering with a pickle (not our header) fails clearly; nothing is loaded."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            body = pickle.dumps({"model": list(range(100))})
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with transports() as (_, r):
        with pytest.raises(ser.CheckpointFormatError, match="pickle-based"):
            r.recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint", 1, TIMEOUT)
    t.join(10)
    srv.close()


# --------------------------------------------------------------------------- faults

_SENDER = textwrap.dedent(
    """
    import json, sys, time
    from datetime import timedelta
    from contextlib import contextmanager
    import torch
    from torchft.checkpointing import HTTPTransport

    entered = []

    @contextmanager
    def lock():
        # The first stream goes at once, the others are held: the receive is mid-way
        # when this process is killed.
        entered.append(1)
        if len(entered) > 1:
            time.sleep(60)
        yield

    t = HTTPTransport(timedelta(seconds=60), state_dict_lock=lock)
    state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(16)}
    t.send_checkpoint([1], 4, state, timedelta(seconds=60))
    print(json.dumps({"addr": t.metadata()}), flush=True)
    time.sleep(120)
    """
)


def _spawn(code: str) -> subprocess.Popen[str]:
    env = dict(os.environ, TORCHFT_CHECKPOINT_BIND="127.0.0.1")
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        with_cont = p.returncode is None
        if with_cont:
            os.kill(p.pid, signal.SIGCONT)
        p.kill()
    p.wait(30)


def test_a_killed_sender_fails_the_receive_promptly() -> None:
    """SIGKILL of the source mid-transfer fails the receive within seconds, not at its
    timeout; what arrived is not returned."""
    sender = _spawn(_SENDER)
    try:
        assert sender.stdout is not None
        addr = json.loads(sender.stdout.readline())["addr"]
        local = {f"w{i}": torch.zeros(1 << 20) for i in range(16)}
        receiver: HTTPTransport[Any] = HTTPTransport(
            timedelta(seconds=60), num_chunks=4, state_dict=lambda: local
        )
        try:
            killer = threading.Timer(1.0, lambda: os.kill(sender.pid, signal.SIGKILL))
            killer.start()
            t0 = time.monotonic()
            with pytest.raises((ConnectionError, ser.CheckpointFormatError)):
                receiver.recv_checkpoint(0, addr, 4, timedelta(seconds=60))
            elapsed = time.monotonic() - t0
            killer.join()
        finally:
            receiver.shutdown()
        assert elapsed < 10, f"receive took {elapsed:.1f}s after the source died"
    finally:
        _stop(sender)


_RECEIVER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch
    from torchft.checkpointing import HTTPTransport

    local = {f"w{i}": torch.zeros(4 << 20) for i in range(16)}
    t = HTTPTransport(timedelta(seconds=120), num_chunks=2, state_dict=lambda: local)
    print("ready", flush=True)
    t.recv_checkpoint(0, sys.argv[1], 9, timedelta(seconds=120))
    print("done", flush=True)
    """
)


def test_a_stopped_receiver_never_holds_the_sender() -> None:
    """A receiver frozen (SIGSTOP) mid-transfer: the sender's disallow_checkpoint returns
    promptly, and a later offer is served to another receiver."""
    state = {f"w{i}": torch.full((4 << 20,), float(i)) for i in range(16)}  # 256 MiB
    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    env = dict(os.environ, TORCHFT_CHECKPOINT_BIND="127.0.0.1")
    try:
        sender.send_checkpoint([1], 9, state, TIMEOUT)
        rx = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, sender.metadata()],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
            time.sleep(0.3)
            os.kill(rx.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            sender.disallow_checkpoint()
            assert time.monotonic() - t0 < 5
        finally:
            _stop(rx)
        sender.send_checkpoint([1], 10, {"w": torch.ones(4)}, TIMEOUT)
        with transports() as (_, r):
            got = r.recv_checkpoint(0, sender.metadata(), 10, TIMEOUT)
        assert torch.equal(got["w"], torch.ones(4))
    finally:
        sender.shutdown()


def test_a_stalled_receiver_is_cut_at_the_senders_timeout() -> None:
    """A receiver that asks and then reads nothing holds a stream only until the offer's
    timeout: the sender closes it, and disallow_checkpoint finds nothing to wait for."""
    from torchft import _torchft

    state = {f"w{i}": torch.full((4 << 20,), float(i)) for i in range(8)}  # 128 MiB
    sender: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        sender.send_checkpoint([1], 3, state, timedelta(seconds=1))
        assert sender._data is not None
        port = sender._data.port
        gen = sender._server.served.gen  # type: ignore[union-attr]
        sock = socket.create_connection(("127.0.0.1", port))
        req = json.dumps({"token": None, "step": 3, "gen": gen, "start": 0, "end": 8}).encode()
        sock.sendall(b"TFTNDQ01" + len(req).to_bytes(4, "little") + req)
        time.sleep(2.5)  # past the offer's 1 s timeout, reading nothing
        sock.settimeout(10)
        drained = 0
        while chunk := sock.recv(1 << 20):
            drained += len(chunk)
        sock.close()
        assert drained < 128 << 20, "the stalled stream was not cut"
        t0 = time.monotonic()
        sender.disallow_checkpoint()
        assert time.monotonic() - t0 < 1
        del _torchft
    finally:
        sender.shutdown()


def test_abort_recv_breaks_a_native_receive_from_a_frozen_source() -> None:
    """abort_recv (source declared lost) ends a native receive stuck on a SIGSTOPped
    source at once."""
    sender = _spawn(_SENDER)
    try:
        assert sender.stdout is not None
        addr = json.loads(sender.stdout.readline())["addr"]
        receiver: HTTPTransport[Any] = HTTPTransport(timedelta(seconds=60), num_chunks=4)
        try:
            time.sleep(0.2)

            def freeze_then_abort() -> None:
                time.sleep(0.8)
                os.kill(sender.pid, signal.SIGSTOP)
                time.sleep(0.5)
                receiver.abort_recv()

            t = threading.Thread(target=freeze_then_abort)
            t.start()
            t0 = time.monotonic()
            with pytest.raises(ConnectionError, match="source was lost"):
                receiver.recv_checkpoint(0, addr, 4, timedelta(seconds=60))
            assert time.monotonic() - t0 < 10
            t.join()
        finally:
            receiver.shutdown()
    finally:
        _stop(sender)


@pytest.mark.parametrize("native", [True, False])
def test_a_state_changed_after_its_offer_fails_the_receive_instead_of_mixing(
    native: bool,
) -> None:
    """A write between the offer and a stream (DiLoCo's inner steps while a delayed sync's
    offer lives), or a tensor moved under the offer, fails the receive with a clear error:
    ranges of two different states are never handed out as one."""
    from torchft.state_lock import ReadWriteLock

    lock = ReadWriteLock()
    state = {"a": torch.zeros(1 << 18), "b": torch.zeros(1 << 18), "c": torch.zeros(3)}
    sender_kw = {"state_dict_lock": lock.read, "state_version": lock.version, "native": native}
    with transports(sender_kw=sender_kw, receiver_kw={"num_chunks": 2}) as (s, r):
        s.send_checkpoint([1], 3, state, TIMEOUT)
        assert_same(r.recv_checkpoint(0, s.metadata(), 3, TIMEOUT), state)
        assert lock.acquire_write()  # what disallow_state_dict_read does around a step
        state["a"].add_(1)
        lock.release_write()
        with pytest.raises(RuntimeError, match="changed since it was offered"):
            r.recv_checkpoint(0, s.metadata(), 3, TIMEOUT)
        # A new offer of the new state is served again.
        s.send_checkpoint([1], 4, state, TIMEOUT)
        assert_same(r.recv_checkpoint(0, s.metadata(), 4, TIMEOUT), state)
        if native:
            # A tensor read straight from memory moved: never read through the old address.
            state["b"].set_(torch.ones(1 << 18))
            with pytest.raises(RuntimeError, match="moved or resized"):
                r.recv_checkpoint(0, s.metadata(), 4, TIMEOUT)


def test_a_large_non_contiguous_tensor_is_copied_once_not_once_per_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-contiguous tensor is staged from one contiguous copy per stream, not a full
    copy for every 1 MiB piece (a 1 GiB tensor would otherwise cost ~1 TiB of memcpy)."""
    from torchft.checkpointing.http import native

    no_http_bytes(monkeypatch)
    copies: list[int] = []
    flat_bytes = native.flat_bytes

    def counted(t: torch.Tensor) -> torch.Tensor:
        copies.append(t.numel())
        return flat_bytes(t)

    monkeypatch.setattr(native, "flat_bytes", counted)
    state = {"t": torch.randn(1024, 2048).t(), "u": torch.randn(64, 32).t(), "w": torch.ones(5)}
    assert state["t"].nbytes >= 8 * (1 << 20)  # several pieces
    with transports(receiver_kw={"num_chunks": 2}) as (s, r):
        s.send_checkpoint([1], 1, state, TIMEOUT)
        got = r.recv_checkpoint(0, s.metadata(), 1, TIMEOUT)
    assert_same(got, state)
    assert sorted(copies) == sorted([state["t"].numel(), state["u"].numel()]), copies


def test_in_place_receive_leaves_the_parameters_autograd_versions_alone() -> None:
    """A heal may run on the quorum thread while a backward is paused in a communication
    hook: writing the received bytes must not bump a parameter's autograd version counter,
    or the resumed backward fails with "modified by an inplace operation"."""
    model = torch.nn.Linear(64, 32)
    x = torch.randn(4, 64)
    loss = model(x).square().sum()  # the graph saved the weight (its version now)
    params = dict(model.named_parameters())
    versions = {k: p._version for k, p in params.items()}
    sent = {k: torch.randn_like(p) for k, p in params.items()}
    with transports(receiver_kw={"state_dict": lambda: params}) as (s, r):
        s.send_checkpoint([1], 1, sent, TIMEOUT)
        got = r.recv_checkpoint(0, s.metadata(), 1, TIMEOUT)
    for k, p in params.items():
        assert got[k].data_ptr() == p.data_ptr(), k
        assert torch.equal(p.detach(), sent[k]), k
        assert p._version == versions[k], k
    # The device path copies into the targets with ``copy_``: those copies must not reach
    # the parameters' version counters either.
    enc = ser.encode(sent)
    header = ser.parse_header(enc.header)
    targets = ser.inplace_targets(header, params, lambda t: True)
    assert len(targets) == len(params)
    for i, t in targets.items():
        t.copy_(enc.tensors[i])
    assert {k: p._version for k, p in params.items()} == versions
    loss.backward()  # raised "modified by an inplace operation" before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_go_through_pinned_staging() -> None:
    """GPU state is sent through staging and received into the receiver's GPU tensors."""
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda")}
    local = {k: torch.zeros_like(v) for k, v in state.items()}
    with transports(receiver_kw={"state_dict": lambda: local}) as (s, r):
        s.send_checkpoint([1], 1, state, TIMEOUT)
        got = r.recv_checkpoint(0, s.metadata(), 1, TIMEOUT)
    for k in state:
        assert got[k].data_ptr() == local[k].data_ptr()
        assert torch.equal(got[k], state[k])


# --------------------------------------------------------------------------- benchmark


def test_two_process_benchmark_small_version() -> None:
    """The two-process benchmark, small: every row's receive is correct and the native rows
    (at the default stream count and at one stream) receive every tensor in place (no
    timing asserted)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "benches" / "checkpoint_wire.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=110,
        env=dict(os.environ, TORCHFT_CHECKPOINT_BIND="127.0.0.1"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check passed" in out.stdout
    rows = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert {"raw", "http", "native", "raw1", "native1"} <= rows
