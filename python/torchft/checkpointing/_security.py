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
- **Bind**: the server listens on one address, not on every interface unless told to
  (``bind=`` or ``TORCHFT_CHECKPOINT_BIND``): that of the heal interface when one is set
  (``TORCHFT_HEAL_IFNAME``, else gloo's or NCCL's interface variable), else that of the host
  name the manager advertises (see :func:`endpoint` for the precedence).

The variables are parsed once, by the native core, the same code the lighthouse and manager
servers use, and reach this module through :mod:`torchft.config` like every other setting.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass

from torchft import config
from torchft.checkpointing import _interface
from torchft.checkpointing._interface import InterfaceAddress

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
        return cls(**config.security_settings())

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


#: Bind addresses that listen on every interface.
WILDCARDS = ("::", "0.0.0.0")


@dataclass(frozen=True)
class Endpoint:
    """Where a checkpoint server listens and the host receivers are told to fetch from.

    Attributes:
        listen: (family, address) to listen on, most preferred first.
        advertise: the host receivers dial; None when the server listens everywhere and no
            host was chosen (the transport then finds one it is reachable under).
        interface: the heal interface in force (``TORCHFT_HEAL_IFNAME`` and its defaults),
            None when none is.
    """

    listen: list[tuple[socket.AddressFamily, str]]
    advertise: str | None
    interface: InterfaceAddress | None = None


def endpoint(hostname: str | None, bind: str | None) -> Endpoint:
    """Where a checkpoint server listens and what it advertises. First match wins:

    1. ``hostname`` given: advertised; listen on ``bind`` (else ``TORCHFT_CHECKPOINT_BIND``),
       else on its addresses. The interface variables are not read.
    2. A specific bind address (``bind``/``TORCHFT_CHECKPOINT_BIND``, not ``::``/``0.0.0.0``):
       listened on and advertised. An explicit ``TORCHFT_HEAL_IFNAME`` must own it;
       ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` are not read.
    3. The heal interface (``TORCHFT_HEAL_IFNAME``, else the first of ``GLOO_SOCKET_IFNAME``,
       else of ``NCCL_SOCKET_IFNAME``): its address (IPv4, else global IPv6) is advertised
       and listened on, or every interface when the bind address is ``::``/``0.0.0.0``.
    4. A wildcard bind address: listen everywhere, advertise a name found reachable.
    5. Otherwise this machine's host name: advertised, listened on at its addresses.

    Args:
        hostname: the host name peers are told to fetch from (None: not given).
        bind: an explicit listen address; default env ``TORCHFT_CHECKPOINT_BIND``.

    Raises:
        ValueError: the host name does not resolve; the interface does not exist or has no
            address; ``TORCHFT_HEAL_IFNAME`` does not own the specific bind address.
    """
    bind = bind if bind is not None else config.checkpoint_bind()
    explicit: list[tuple[socket.AddressFamily, str]] | None = None
    if bind is not None:
        host = bind.strip("[]")
        explicit = [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]
    if hostname:
        return Endpoint(explicit or _resolve_listen(hostname), hostname)
    specific = explicit is not None and explicit[0][1] not in WILDCARDS
    setting = config.heal_ifname()
    if setting is not None and (not specific or setting.variable == "TORCHFT_HEAL_IFNAME"):
        iface = _interface.resolve(setting)
        if explicit is not None and specific:
            if not any(_same_ip(explicit[0][1], a) for a in iface.addresses):
                raise ValueError(
                    f"{setting.describe()} and checkpoint bind address {bind!r} (bind= or "
                    f"{BIND_ENV}) disagree: it is not an address of {iface.interface} "
                    f"({', '.join(iface.addresses)}); set one of them, or bind '::'"
                )
            return Endpoint(explicit, explicit[0][1], iface)
        return Endpoint(explicit or [(iface.family, iface.address)], iface.address, iface)
    if explicit is not None:
        return Endpoint(explicit, explicit[0][1] if specific else None)
    name = socket.gethostname()
    return Endpoint(_resolve_listen(name), name)


def _same_ip(a: str, b: str) -> bool:
    """Whether two addresses are the same (``fd00:0::2`` is ``fd00::2``)."""
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def _resolve_listen(name: str) -> list[tuple[socket.AddressFamily, str]]:
    """The addresses host ``name`` resolves to, to listen on (first preferred).

    Raises:
        ValueError: ``name`` does not resolve.
    """
    try:
        infos = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(
            f"cannot resolve the advertised host name {name!r} to listen on: {e}; pass "
            f"bind= or set {BIND_ENV} (e.g. '::' for every interface), or name the network "
            "interface heals use with TORCHFT_HEAL_IFNAME"
        ) from e
    out: list[tuple[socket.AddressFamily, str]] = []
    for family, _, _, _, addr in infos:
        entry = (socket.AddressFamily(family), str(addr[0]))
        if entry not in out:
            out.append(entry)
    return out
