"""Who may fetch a checkpoint, over what, and where the checkpoint server listens.

Everything the checkpoint transport needs for authentication, TLS and binding lives here,
so any implementation of the transport (this HTTP one, or a native one behind the same
``HTTPTransport`` API) applies the same rules:

- **Token**: when the job has a shared secret (``TORCHFT_TOKEN_FILE`` / ``TORCHFT_TOKEN``),
  every request carries ``Authorization: Bearer <token>`` and the server compares it in
  constant time (:meth:`TransportSecurity.check`); a missing or wrong token gets 401.
- **TLS**: a process with ``TORCHFT_TLS_CERT``/``TORCHFT_TLS_KEY`` serves TLS; one with
  ``TORCHFT_TLS_CA`` fetches over TLS, verifying the server against that CA and presenting
  its own certificate (mutual TLS, required by servers with ``TORCHFT_TLS_CLIENT_CA``).
  A plain request to a TLS server is answered with a clear 400; a TLS request to a plain
  server fails at the handshake with a message saying so.
- **Bind**: the server listens on the address of the host name the manager advertises, not
  on every interface, unless told to (``bind=`` or ``TORCHFT_CHECKPOINT_BIND``).

The variables are parsed once, by the native core (``_torchft.security_settings``), the same
code the lighthouse and manager servers use.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import ssl
from dataclasses import dataclass

logger: logging.Logger = logging.getLogger(__name__)

BIND_ENV = "TORCHFT_CHECKPOINT_BIND"

# First byte of a TLS handshake record (a ClientHello).
_TLS_HANDSHAKE = 0x16

_PLAIN_ON_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\n\r\n"
    b"this checkpoint server accepts TLS only: fetch over https:// with TORCHFT_TLS_CA set\n"
)


class CheckpointAuthError(RuntimeError):
    """A checkpoint server refused the request's token (HTTP 401)."""


@dataclass(frozen=True)
class TransportSecurity:
    """The token and TLS files of one checkpoint transport.

    Attributes:
        token: the shared secret, or None for no authentication.
        tls_cert: PEM certificate chain served (and presented as a client certificate).
        tls_key: PEM private key of ``tls_cert``.
        tls_ca: PEM CA bundle servers are verified against; set: fetch over TLS.
        tls_client_ca: PEM CA bundle client certificates must be signed by (mutual TLS).
    """

    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_ca: str | None = None

    @classmethod
    def from_env(cls) -> TransportSecurity:
        """Reads ``TORCHFT_TOKEN_FILE``/``TORCHFT_TOKEN``/``TORCHFT_TLS_*``.

        Raises:
            ValueError: unreadable token file, malformed token, incomplete TLS settings.
        """
        from torchft import _torchft

        return cls(**_torchft.security_settings())

    @property
    def serves_tls(self) -> bool:
        """True if the checkpoint server speaks TLS."""
        return self.tls_cert is not None

    @property
    def dials_tls(self) -> bool:
        """True if fetches use TLS."""
        return self.tls_ca is not None

    @property
    def scheme(self) -> str:
        """URL scheme of this process's checkpoint server."""
        return "https" if self.serves_tls else "http"

    # ---------------------------------------------------------------- token

    def headers(self) -> dict[str, str]:
        """Headers a fetch sends (the token, when there is one)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def check(self, authorization: str | None) -> str | None:
        """None if a request with this ``Authorization`` header may be served, else why not."""
        if self.token is None:
            return None
        if not authorization:
            return (
                "missing token: this checkpoint server requires the job's shared secret; "
                "set TORCHFT_TOKEN_FILE (or TORCHFT_TOKEN)"
            )
        scheme, _, presented = authorization.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode(), self.token.encode()
        )
        if ok:
            return None
        return (
            "wrong token: the shared secret sent does not match this checkpoint server's; "
            "check TORCHFT_TOKEN_FILE / TORCHFT_TOKEN on both sides"
        )

    # ---------------------------------------------------------------- TLS

    def server_context(self) -> ssl.SSLContext | None:
        """The server's TLS context (None when it serves plain TCP)."""
        if self.tls_cert is None:
            return None
        if self.tls_key is None:
            raise ValueError("a TLS certificate needs its private key (TORCHFT_TLS_KEY)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=self.tls_client_ca)
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        """The fetching side's TLS context (None when it fetches over plain TCP)."""
        if self.tls_ca is None:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_cert is not None and self.tls_key is not None:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def fetch_scheme(self, url_scheme: str, url: str) -> str:
        """The scheme a fetch of ``url`` uses: TLS whenever a CA is configured (never a
        silent fallback to plain TCP).

        Raises:
            ValueError: an https URL without a CA to verify it, or an unknown scheme.
        """
        if url_scheme not in ("http", "https"):
            raise ValueError(f"invalid checkpoint address {url!r}")
        if self.dials_tls:
            return "https"
        if url_scheme == "https":
            raise ValueError(
                f"checkpoint address {url!r} is TLS (https) but no CA is configured to verify "
                "it: set TORCHFT_TLS_CA"
            )
        return "http"


def accept_connection(
    sock: socket.socket, ctx: ssl.SSLContext | None, timeout: float
) -> socket.socket | None:
    """Prepares an accepted connection for serving; call it off the accept thread.

    With ``ctx`` (a TLS server) it does the handshake; a plain client gets a clear 400 and
    None is returned. Without ``ctx``, a TLS client's handshake is logged and None returned
    (its TLS library then reports the failure). None means: close the connection.
    """
    sock.settimeout(timeout)
    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except OSError as e:
        logger.debug("checkpoint connection closed before its first byte: %s", e)
        return None
    is_tls = bool(first) and first[0] == _TLS_HANDSHAKE
    if ctx is None:
        if is_tls:
            logger.warning(
                "a TLS client reached this plain checkpoint server; set TORCHFT_TLS_CERT / "
                "TORCHFT_TLS_KEY here, or unset TORCHFT_TLS_CA on the receiver"
            )
            return None
        return sock
    if not is_tls:
        with contextlib.suppress(OSError):
            sock.sendall(_PLAIN_ON_TLS)
        return None
    try:
        return ctx.wrap_socket(sock, server_side=True)
    except (ssl.SSLError, OSError) as e:
        logger.warning("checkpoint TLS handshake failed: %s", e)
        return None


def describe_tls_failure(e: BaseException, url: str) -> str:
    """A message for a failed TLS fetch that says the likely cause."""
    return (
        f"TLS handshake with checkpoint server {url} failed: {e} (is it serving without TLS, "
        "or with a certificate not signed by TORCHFT_TLS_CA?)"
    )


def bind_addresses(
    hostname: str | None, bind: str | None
) -> tuple[list[tuple[socket.AddressFamily, str]], bool]:
    """Where a checkpoint server listens, most preferred first, and whether that was set
    explicitly (``bind`` or the variable) rather than derived from the host name.

    Args:
        hostname: the host name peers are told to fetch from (default: this machine's).
        bind: an explicit address (``"::"`` or ``"0.0.0.0"`` for every interface); default
            env ``TORCHFT_CHECKPOINT_BIND``, else the addresses ``hostname`` resolves to.

    Raises:
        ValueError: ``hostname`` does not resolve.
    """
    bind = bind if bind is not None else (os.environ.get(BIND_ENV) or None)
    if bind is not None:
        host = bind.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return [(family, host)], True
    name = hostname or socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(
            f"cannot resolve the advertised host name {name!r} to listen on: {e}; pass "
            f"bind= or set {BIND_ENV} (e.g. '::' for every interface)"
        ) from e
    out: list[tuple[socket.AddressFamily, str]] = []
    for family, _, _, _, addr in infos:
        entry = (socket.AddressFamily(family), str(addr[0]))
        if entry not in out:
            out.append(entry)
    return out, False
