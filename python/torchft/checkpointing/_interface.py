"""The address of a network interface, so heals run over the network the job chose.

A host often has several networks: a fast fabric the job trains over and a slow management
network its host name resolves to. Heals served under the host name then crawl over the slow
one. :func:`resolve` turns the interface named by ``TORCHFT_HEAL_IFNAME`` (else gloo's or
NCCL's interface variable, see :func:`torchft.config.heal_ifname`) into the one address the
checkpoint server listens on and advertises to receivers: the interface's IPv4 address, else
its global IPv6 address.

Only the standard library is used, and only Linux interfaces are read: names from
``socket.if_nameindex``, the IPv4 address from the ``SIOCGIFADDR`` ioctl, IPv6 addresses
from ``/proc/net/if_inet6``.
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from torchft.config import HealIfname

# ioctl request that reads an interface's IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915
_IF_INET6 = Path("/proc/net/if_inet6")
# /proc/net/if_inet6 scope of a global address, and address flags that make one unusable
# to listen on (linux/if_addr.h: IFA_F_DADFAILED, IFA_F_DEPRECATED, IFA_F_TENTATIVE).
_SCOPE_GLOBAL = 0x00
_UNUSABLE = 0x08 | 0x20 | 0x40


@dataclass(frozen=True)
class InterfaceAddress:
    """The address heals are served on, and the interface setting it came from."""

    #: The interface's name (e.g. ``eth0``).
    interface: str
    #: Its address, without brackets (``192.0.2.2`` or ``fd00::2``).
    address: str
    family: socket.AddressFamily
    #: The setting that named the interface.
    setting: HealIfname
    #: Every usable address of the interface (``address`` first).
    addresses: tuple[str, ...] = ()


def interface_names() -> list[str]:
    """This host's network interfaces, in index order."""
    return [name for _, name in sorted(socket.if_nameindex())]


def ipv4_address(name: str) -> str | None:
    """The interface's IPv4 address (None: it has none).

    Raises:
        OSError: the address could not be read for another reason.
    """
    import fcntl  # Unix only, like the ioctl itself

    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError as e:
            if e.errno in (errno.EADDRNOTAVAIL, errno.ENODEV):
                return None
            raise
    # struct ifreq: 16 bytes of name, then a sockaddr_in (family, port, address).
    return socket.inet_ntoa(answer[20:24])


def ipv6_global_addresses(name: str, table: str | None = None) -> list[str]:
    """The interface's global IPv6 addresses that can be listened on, in table order.

    Args:
        name: the interface.
        table: the text of ``/proc/net/if_inet6`` (default: read it; empty where absent).
    """
    if table is None:
        try:
            table = _IF_INET6.read_text()
        except OSError:
            return []
    out = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) != 6 or fields[5] != name:
            continue
        hex_addr, scope, flags = fields[0], int(fields[3], 16), int(fields[4], 16)
        if scope != _SCOPE_GLOBAL or flags & _UNUSABLE or len(hex_addr) != 32:
            continue
        out.append(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(hex_addr)))
    return out


def _pick(setting: HealIfname, names: list[str]) -> str | None:
    """The interface ``setting`` names among ``names`` (a prefix picks the first match)."""
    if setting.name in names:
        return setting.name
    if setting.prefix:
        return next((n for n in names if n.startswith(setting.name)), None)
    return None


def resolve(setting: HealIfname) -> InterfaceAddress:
    """The address heals are served on for the interface ``setting`` names.

    Returns:
        The interface's IPv4 address, else its first global IPv6 address.

    Raises:
        ValueError: naming the setting, when the interface does not exist (listing those
            that do), has no usable address, or this is not Linux.
    """
    if not sys.platform.startswith("linux"):
        raise ValueError(
            f"{setting.describe()}: network interfaces are looked up on Linux only; unset "
            "it, or pass the Manager a hostname= on the network heals should use"
        )
    names = interface_names()
    name = _pick(setting, names)
    if name is None:
        kind = "no network interface starts with" if setting.prefix else "no network interface"
        raise ValueError(
            f"{setting.describe()}: {kind} {setting.name!r} on this host (its interfaces: "
            f"{', '.join(names) or 'none'}); name the interface heals should use"
        )
    v4 = ipv4_address(name)
    v6 = ipv6_global_addresses(name)
    every = ([v4] if v4 is not None else []) + v6
    if every:
        family = socket.AF_INET if v4 is not None else socket.AF_INET6
        return InterfaceAddress(name, every[0], family, setting, tuple(every))
    raise ValueError(
        f"{setting.describe()}: network interface {name!r} has no IPv4 or global IPv6 address "
        "to serve heals on (is it up and configured?)"
    )
