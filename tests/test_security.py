"""Tests of the shared secret, TLS and binding of the checkpoint transport and of the Python
entry points (clients pick the token up from the environment; the daemon's flags)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._security import CheckpointAuthError, TransportSecurity

TIMEOUT = timedelta(seconds=10)
CERTS = Path(__file__).parent / "certs"

pytestmark = pytest.mark.timeout(120)


def cert(name: str) -> str:
    return str(CERTS / name)


def server_tls(mutual: bool = False, token: str | None = None) -> TransportSecurity:
    return TransportSecurity(
        token=token,
        tls_cert=cert("server.pem"),
        tls_key=cert("server.key"),
        tls_ca=cert("ca.pem"),
        tls_client_ca=cert("ca.pem") if mutual else None,
    )


def client_tls(ca: str = "ca.pem", client_cert: bool = False) -> TransportSecurity:
    return TransportSecurity(
        tls_ca=cert(ca),
        tls_cert=cert("client.pem") if client_cert else None,
        tls_key=cert("client.key") if client_cert else None,
    )


@contextmanager
def transports(
    sender_security: TransportSecurity, receiver_security: TransportSecurity
) -> Iterator[tuple[HTTPTransport[Any], HTTPTransport[Any]]]:
    """A sender serving a small state on localhost and a receiver, always shut down."""
    sender: HTTPTransport[Any] = HTTPTransport(
        TIMEOUT, hostname="localhost", security=sender_security
    )
    try:
        receiver: HTTPTransport[Any] = HTTPTransport(
            TIMEOUT, hostname="localhost", security=receiver_security
        )
        try:
            sender.send_checkpoint([1], 3, {"w": torch.arange(6.0)}, TIMEOUT)
            yield sender, receiver
        finally:
            receiver.shutdown()
    finally:
        sender.shutdown()


def fetch(sender: HTTPTransport[Any], receiver: HTTPTransport[Any]) -> dict[str, Any]:
    return receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=5))


def test_checkpoint_token_missing_wrong_right() -> None:
    """Without the token or with a wrong one the fetch is refused (401); the right one works."""
    secured = TransportSecurity(token="job-secret")
    for receiver_sec, why in [
        (TransportSecurity(), "missing token"),
        (TransportSecurity(token="other"), "wrong token"),
    ]:
        with transports(secured, receiver_sec) as (sender, receiver):
            with pytest.raises(CheckpointAuthError, match=why):
                fetch(sender, receiver)
            # A refused fetch leaves the offer intact for the right receiver.
            good: HTTPTransport[Any] = HTTPTransport(TIMEOUT, security=secured)
            try:
                out = fetch(sender, good)
            finally:
                good.shutdown()
            assert torch.equal(out["w"], torch.arange(6.0))
    # The ranged (chunked) path carries the token on every request too.
    with transports(secured, secured) as (sender, _):
        chunked: HTTPTransport[Any] = HTTPTransport(TIMEOUT, num_chunks=3, security=secured)
        try:
            assert torch.equal(fetch(sender, chunked)["w"], torch.arange(6.0))
        finally:
            chunked.shutdown()


def test_checkpoint_token_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """TORCHFT_TOKEN_FILE (else TORCHFT_TOKEN) is picked up by both ends automatically."""
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    monkeypatch.setenv("TORCHFT_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("TORCHFT_TOKEN", "ignored-when-a-file-is-given")
    assert TransportSecurity.from_env().token == "from-a-file"
    with transports(TransportSecurity.from_env(), TransportSecurity.from_env()) as (s, r):
        assert torch.equal(fetch(s, r)["w"], torch.arange(6.0))
    monkeypatch.delenv("TORCHFT_TOKEN_FILE")
    assert TransportSecurity.from_env().token == "ignored-when-a-file-is-given"
    monkeypatch.setenv("TORCHFT_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing"):
        TransportSecurity.from_env()


def test_checkpoint_tls_on_and_mismatches() -> None:
    """TLS works with the right CA; every mismatch fails promptly with a message saying so."""
    with transports(server_tls(), client_tls()) as (sender, receiver):
        assert sender.metadata().startswith("https://localhost:")
        assert torch.equal(fetch(sender, receiver)["w"], torch.arange(6.0))
        # A plain receiver on the TLS server: a clear refusal.
        plain: HTTPTransport[Any] = HTTPTransport(TIMEOUT, security=TransportSecurity())
        try:
            with pytest.raises(ValueError, match="TORCHFT_TLS_CA"):
                fetch(sender, plain)
            url = sender.metadata().replace("https://", "http://")
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="accepts TLS only"):
                plain.recv_checkpoint(0, url, 3, timedelta(seconds=5))
            assert time.monotonic() - started < 2.5
        finally:
            plain.shutdown()
        # A CA that did not sign the server's certificate.
        stranger: HTTPTransport[Any] = HTTPTransport(TIMEOUT, security=client_tls("other-ca.pem"))
        try:
            with pytest.raises(ConnectionError, match="TLS handshake"):
                fetch(sender, stranger)
        finally:
            stranger.shutdown()
    # A TLS receiver on a plain server.
    with transports(TransportSecurity(), client_tls()) as (sender, receiver):
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="TLS handshake"):
            fetch(sender, receiver)
        assert time.monotonic() - started < 2.5


def test_checkpoint_mutual_tls_and_token_together() -> None:
    """With a client CA the server requires a client certificate; token and TLS combine."""
    both = server_tls(mutual=True, token="t")
    with transports(both, client_tls()) as (sender, receiver):
        with pytest.raises((ConnectionError, RuntimeError)):
            fetch(sender, receiver)
    with transports(both, server_tls(mutual=True, token="t")) as (sender, receiver):
        assert torch.equal(fetch(sender, receiver)["w"], torch.arange(6.0))
    with transports(both, server_tls(mutual=True, token="wrong")) as (sender, receiver):
        with pytest.raises(CheckpointAuthError):
            fetch(sender, receiver)


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the listening TCP sockets on ``port`` (from /proc/net/tcp*)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            host, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(host)
    return found


def test_checkpoint_server_binds_the_advertised_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the server listens on the advertised host's address only; bind= or
    TORCHFT_CHECKPOINT_BIND widens it."""
    monkeypatch.delenv("TORCHFT_CHECKPOINT_BIND", raising=False)
    t: HTTPTransport[Any] = HTTPTransport(TIMEOUT, hostname="localhost")
    try:
        bound = t._server.address
        assert bound in ("127.0.0.1", "::1"), bound
        assert t.metadata().startswith("http://localhost:")
        # Only the loopback address listens: not 0.0.0.0, not ::.
        expected = "0100007F" if bound == "127.0.0.1" else "00000000000000000000000001000000"
        assert listening_addresses(t._port) == [expected]
    finally:
        t.shutdown()
    with pytest.raises(ValueError, match="cannot resolve"):
        HTTPTransport(TIMEOUT, hostname="no-such-host.invalid")
    everywhere: HTTPTransport[Any] = HTTPTransport(TIMEOUT, bind="::")
    try:
        assert everywhere._server.address == "::"
    finally:
        everywhere.shutdown()
    monkeypatch.setenv("TORCHFT_CHECKPOINT_BIND", "127.0.0.1")
    explicit: HTTPTransport[Any] = HTTPTransport(TIMEOUT)
    try:
        assert explicit.metadata().startswith("http://127.0.0.1:")
    finally:
        explicit.shutdown()


def test_clients_pick_the_token_up_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Native clients and servers read TORCHFT_TOKEN: a lighthouse started with a token
    refuses a client without it and serves one with it."""
    from torchft._torchft import LighthouseClient, LighthouseServer

    monkeypatch.delenv("TORCHFT_TOKEN", raising=False)
    monkeypatch.delenv("TORCHFT_TOKEN_FILE", raising=False)
    monkeypatch.setenv("TORCHFT_TOKEN", "py-token")
    server = LighthouseServer("127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        client = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=5))
        client.heartbeat("with-token")
        monkeypatch.setenv("TORCHFT_TOKEN", "not-it")
        stranger = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=5))
        with pytest.raises(RuntimeError, match="wrong token"):
            stranger.heartbeat("without")
        monkeypatch.delenv("TORCHFT_TOKEN")
        anonymous = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=5))
        with pytest.raises(RuntimeError, match="missing token"):
            anonymous.quorum("x", timeout=timedelta(seconds=2))
    finally:
        server.shutdown()


def test_daemon_refuses_incomplete_security_flags(tmp_path: Path) -> None:
    """Bad security flags fail at start with a clear message and leave nothing running."""
    from conftest import lighthouse_command

    empty = tmp_path / "empty"
    empty.write_text("\n")
    # Every combination is checked by the daemon's unit tests; here two, end to end.
    cases = [
        (["--tls_cert", cert("server.pem")], "private key"),
        (["--token_file", str(empty)], "empty"),
    ]
    for flags, message in cases:
        proc = subprocess.run(
            [*lighthouse_command(), "--min_replicas", "1", "--bind", "127.0.0.1:0", *flags],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "RUST_LOG": "error"},
        )
        assert proc.returncode != 0, flags
        assert message in proc.stderr + proc.stdout, (flags, proc.stderr)
