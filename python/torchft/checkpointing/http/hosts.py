"""The host name receivers reach the checkpoint server under, when none was configured."""

from __future__ import annotations

import socket

from torchft.checkpointing.http.wire import logger


def format_host(host: str) -> str:
    """``host`` as it stands in a URL or ``host:port`` (IPv6 addresses bracketed)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def primary_ip(family: socket.AddressFamily) -> str | None:
    """Address of the interface holding the default route (no packet is sent)."""
    probe = ("10.255.255.255", 1) if family == socket.AF_INET else ("fd00::1", 1, 0, 0)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)
            return str(s.getsockname()[0])
    except OSError:
        return None


def can_connect(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` opens within a second."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def reachable_host(port: int, family: socket.AddressFamily) -> str:
    """Picks the first name/address under which the server on ``port`` is reachable."""
    candidates: list[str | None] = [socket.gethostname(), socket.getfqdn()]
    candidates.append(primary_ip(socket.AF_INET))
    if family == socket.AF_INET6:
        candidates.append(primary_ip(socket.AF_INET6))
    candidates += ["127.0.0.1", "::1"] if family == socket.AF_INET6 else ["127.0.0.1"]
    seen = set()
    for host in candidates:
        if not host or host in seen:
            continue
        seen.add(host)
        if can_connect(host, port):
            return host
        logger.info("checkpoint server not reachable as %s:%d, trying next address", host, port)
    raise RuntimeError(f"checkpoint server on port {port} is not reachable under any local address")
