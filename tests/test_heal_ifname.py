"""Tests of TORCHFT_HEAL_IFNAME: heals are served on, and advertised under, the address of
the named network interface (else gloo's or NCCL's interface), not the host name.

Interfaces are discovered at test time (through the module under test); each test that needs
a kind of interface it cannot find skips, saying which. That the server listens on the
interface's address only is checked independently: through /proc/net/tcp and by dialing
127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_security import listening_addresses

from torchft import Manager, ProcessGroupGloo
from torchft._torchft import LighthouseServer
from torchft.checkpointing import HTTPTransport, _interface
from torchft.checkpointing._security import endpoint
from torchft.config import ENV_VARS, HealIfname, heal_ifname
from torchft.healing import heal_address as _heal_address

TIMEOUT = timedelta(seconds=20)
_VARS = ("TORCHFT_HEAL_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the interface variables it means; none leak in from the machine."""
    for name in (*_VARS, "TORCHFT_CHECKPOINT_BIND", "TORCHFT_TIMEOUT_SEC"):
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- discovery


def _ipv4_interfaces() -> dict[str, str]:
    """Interface name -> IPv4 address, for every interface that has one."""
    found = {}
    for name in _interface.interface_names():
        try:
            addr = _interface.ipv4_address(name)
        except OSError:
            continue
        if addr is not None:
            found[name] = addr
    return found


def _loopback() -> str:
    """The interface holding 127.0.0.1 (``lo`` on Linux)."""
    for name, addr in _ipv4_interfaces().items():
        if addr == "127.0.0.1":
            return name
    pytest.skip("no interface holds 127.0.0.1 on this machine")


def _other_ipv4() -> tuple[str, str]:
    """An interface with an IPv4 address other than loopback, and that address."""
    for name, addr in _ipv4_interfaces().items():
        if not addr.startswith("127."):
            return name, addr
    pytest.skip("no network interface with a non-loopback IPv4 address on this machine")


def _global_ipv6() -> tuple[str, str]:
    """An interface with a global IPv6 address, and that address."""
    for name in _interface.interface_names():
        v6 = _interface.ipv6_global_addresses(name)
        if v6:
            return name, v6[0]
    pytest.skip("no network interface with a global IPv6 address on this machine")


def _proc_hex_v4(addr: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (little-endian hex)."""
    return socket.inet_aton(addr)[::-1].hex().upper()


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


@contextmanager
def _transport(**kwargs: Any) -> Iterator[HTTPTransport[Any]]:
    t: HTTPTransport[Any] = HTTPTransport(TIMEOUT, **kwargs)
    try:
        yield t
    finally:
        t.shutdown()


def _host(t: HTTPTransport[Any]) -> str:
    host = urllib.parse.urlsplit(t.metadata()).hostname
    assert host is not None
    return host


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.arange(7, dtype=torch.int64),
        "step": 3,
    }


def _heal(sender: HTTPTransport[Any], receiver: HTTPTransport[Any]) -> None:
    """One heal from ``sender`` to ``receiver``, checked bit for bit."""
    state = _state()
    sender.send_checkpoint([1], 3, state, TIMEOUT)
    try:
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    finally:
        sender.disallow_checkpoint()
    assert got["step"] == 3
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


# ----------------------------------------------------------------------------- the setting


@pytest.mark.timeout(30)
def test_setting_is_registered_and_parsed_with_its_fallbacks() -> None:
    """TORCHFT_HEAL_IFNAME is a registered setting; unset, the first plain name of
    GLOO_SOCKET_IFNAME, then NCCL_SOCKET_IFNAME (``=`` exact, plain a prefix, ``^`` none)
    stands in for it."""
    assert set(_VARS) <= set(ENV_VARS)
    assert heal_ifname({}) is None
    own = {"TORCHFT_HEAL_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1"}
    assert heal_ifname(own) == HealIfname("ib0", "TORCHFT_HEAL_IFNAME")
    gloo = {"GLOO_SOCKET_IFNAME": " eth1 , eth2", "NCCL_SOCKET_IFNAME": "ib"}
    assert heal_ifname(gloo) == HealIfname("eth1", "GLOO_SOCKET_IFNAME")
    assert heal_ifname({"NCCL_SOCKET_IFNAME": "=ib0,ib1"}) == HealIfname(
        "ib0", "NCCL_SOCKET_IFNAME"
    )
    assert heal_ifname({"NCCL_SOCKET_IFNAME": "ib"}) == HealIfname(
        "ib", "NCCL_SOCKET_IFNAME", prefix=True
    )
    assert heal_ifname({"NCCL_SOCKET_IFNAME": "^docker,lo"}) is None
    assert heal_ifname({"GLOO_SOCKET_IFNAME": ",", "NCCL_SOCKET_IFNAME": "^lo"}) is None
    for bad in ("eth0,eth1", "a b", "x" * 16):
        with pytest.raises(ValueError, match="TORCHFT_HEAL_IFNAME"):
            heal_ifname({"TORCHFT_HEAL_IFNAME": bad})


@pytest.mark.timeout(30)
def test_ipv6_table_gives_global_usable_addresses_only() -> None:
    """/proc/net/if_inet6 lines: only the interface's global addresses that are neither
    tentative, failed nor deprecated count."""
    table = "\n".join(
        [
            "fd000000000000000000000000000002 04 40 00 02     eth0",  # global (nodad)
            "fe8000000000000000fc00fffe000001 04 40 20 80     eth0",  # link-local
            "fd000000000000000000000000000003 04 40 00 40     eth0",  # tentative
            "fd000000000000000000000000000004 04 40 00 20     eth0",  # deprecated
            "fd000000000000000000000000000009 05 40 00 80     eth1",  # another interface
        ]
    )
    assert _interface.ipv6_global_addresses("eth0", table) == ["fd00::2"]
    assert _interface.ipv6_global_addresses("eth1", table) == ["fd00::9"]
    assert _interface.ipv6_global_addresses("eth2", table) == []


# ----------------------------------------------------------------------------- bind and advertise


@pytest.mark.timeout(60)
def test_naming_loopback_binds_and_advertises_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHFT_HEAL_IFNAME=lo: the server and its native data port listen on 127.0.0.1
    only, and receivers are told 127.0.0.1 (not the host name)."""
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", _loopback())
    with _transport() as t:
        assert _host(t) == "127.0.0.1"
        assert t.metadata() == f"http://127.0.0.1:{t._port}/checkpoint"
        assert listening_addresses(t._port) == [_proc_hex_v4("127.0.0.1")]
        assert t._data is not None
        assert listening_addresses(t._data.port) == [_proc_hex_v4("127.0.0.1")]


@pytest.mark.timeout(60)
def test_naming_another_interface_binds_only_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Naming a non-loopback interface listens on its address alone: 127.0.0.1 on the same
    ports is refused, for the HTTP server and the native data port alike."""
    name, addr = _other_ipv4()
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", name)
    with _transport() as t:
        assert _host(t) == addr
        assert listening_addresses(t._port) == [_proc_hex_v4(addr)]
        assert t._data is not None
        for port in (t._port, t._data.port):
            assert _refused("127.0.0.1", port), f"127.0.0.1:{port} accepted a connection"
            with socket.create_connection((addr, port), timeout=2):
                pass


@pytest.mark.timeout(60)
def test_gloo_socket_ifname_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TORCHFT_HEAL_IFNAME the first interface of GLOO_SOCKET_IFNAME is used (then
    NCCL_SOCKET_IFNAME's); TORCHFT_HEAL_IFNAME wins over both."""
    name, addr = _other_ipv4()
    lo = _loopback()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", f"{name},{lo}")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", f"={lo}")
    with _transport() as t:
        assert _host(t) == addr
        assert _refused("127.0.0.1", t._port)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with _transport() as t:
        assert _host(t) == "127.0.0.1"
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", name)
    with _transport() as t:
        assert _host(t) == addr


@pytest.mark.timeout(60)
def test_explicit_hostname_and_bind_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A given hostname wins over every interface variable (which are then not even read);
    a specific TORCHFT_CHECKPOINT_BIND wins over gloo's, must belong to TORCHFT_HEAL_IFNAME's
    interface, and '::' listens everywhere while advertising the interface's address."""
    name, addr = _other_ipv4()
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", "no-such-if0")
    with _transport(hostname="localhost") as t:
        assert _host(t) == "localhost"
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", name)
    with _transport(hostname="localhost") as t:
        assert _host(t) == "localhost"
    with _transport(bind="::") as t:
        assert _host(t) == addr
        assert t._server.address == "::"
    with pytest.raises(ValueError, match=rf"TORCHFT_HEAL_IFNAME={name}.*127\.0\.0\.1.*disagree"):
        endpoint(None, "127.0.0.1")
    assert endpoint(None, addr).advertise == addr
    monkeypatch.delenv("TORCHFT_HEAL_IFNAME")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    with _transport(bind="127.0.0.1") as t:
        assert _host(t) == "127.0.0.1"


@pytest.mark.timeout(60)
def test_ipv6_address_when_the_interface_has_no_ipv4(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interface without IPv4 is served on its global IPv6 address, bracketed in the
    URL, and a heal (native data path) goes over it."""
    name, addr = _global_ipv6()
    real = _interface.ipv4_address
    monkeypatch.setattr(_interface, "ipv4_address", lambda n: None if n == name else real(n))
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", name)
    with _transport() as sender, _transport() as receiver:
        assert sender.metadata() == f"http://[{addr}]:{sender._port}/checkpoint"
        assert sender._server.address == addr
        assert _heal_address(sender.metadata()) == f"[{addr}]:{sender._port}"
        _heal(sender, receiver)


# ----------------------------------------------------------------------------- errors


@pytest.mark.timeout(60)
def test_unknown_interface_is_a_clear_error_and_starts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name that is no interface fails construction, naming it and the variable and
    listing the interfaces there are; no server thread is left behind."""
    before = set(threading.enumerate())
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", "no-such-if0")
    with pytest.raises(ValueError) as err:
        HTTPTransport(TIMEOUT)
    message = str(err.value)
    assert "TORCHFT_HEAL_IFNAME=no-such-if0" in message
    for name in _interface.interface_names():
        assert name in message
    monkeypatch.delenv("TORCHFT_HEAL_IFNAME")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if1,lo")
    with pytest.raises(ValueError, match=r"GLOO_SOCKET_IFNAME=no-such-if1 \(TORCHFT_HEAL_IFNAME"):
        HTTPTransport(TIMEOUT)
    assert set(threading.enumerate()) == before


@pytest.mark.timeout(60)
def test_interface_without_an_address_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interface with neither IPv4 nor global IPv6 address fails construction, saying so."""
    bare = [
        n
        for n in _interface.interface_names()
        if _interface.ipv4_address(n) is None and not _interface.ipv6_global_addresses(n)
    ]
    if not bare:
        pytest.skip("every network interface on this machine has an address")
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", bare[0])
    with pytest.raises(ValueError, match=rf"'{bare[0]}' has no IPv4 or global IPv6 address"):
        HTTPTransport(TIMEOUT)


@pytest.mark.timeout(60)
def test_manager_refuses_an_unknown_interface_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Manager fails at construction, before connecting anywhere or starting a thread;
    a hostname it is given wins and the variable is not read."""
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", "no-such-if0")
    before = set(threading.enumerate())
    args: dict[str, Any] = dict(
        pg=ProcessGroupGloo(),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=1,  # never dialed: the interface is checked first
        lighthouse_addr="http://127.0.0.1:1",
        connect_timeout=timedelta(seconds=1),
    )
    with pytest.raises(ValueError, match="TORCHFT_HEAL_IFNAME=no-such-if0: no network interface"):
        Manager(**args)
    assert set(threading.enumerate()) == before
    # Given a hostname, the Manager gets as far as the (absent) store instead.
    with pytest.raises(Exception) as err:
        Manager(**args, hostname="localhost")
    assert "no-such-if0" not in str(err.value)
    # ... and the checkpoint server it had started is gone again with the failed store.
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in set(threading.enumerate()) - before]


# ----------------------------------------------------------------------------- heals


@pytest.mark.timeout(90)
@pytest.mark.parametrize("native", [True, False], ids=["native", "http"])
def test_heal_over_the_named_interface(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """send_checkpoint/recv_checkpoint between two transports on the named interface,
    over the native data path and over HTTP only."""
    name, addr = _other_ipv4()
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", name)
    with _transport(native=native) as sender, _transport(native=native) as receiver:
        assert _host(sender) == addr
        _heal(sender, receiver)


def _status(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(address + "/status", timeout=5) as r:
        body: dict[str, Any] = json.loads(r.read())
    return body


@pytest.mark.timeout(120)
def test_manager_heals_over_the_interface_and_reports_its_address(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two replica groups (init_sync heal at step 0): the default transport of a Manager
    without a hostname serves on TORCHFT_HEAL_IFNAME's address; the heal log line and the
    lighthouse's last_heal name the address the state came from."""
    name, addr = _other_ipv4()
    monkeypatch.setenv("TORCHFT_HEAL_IFNAME", name)
    caplog.set_level(logging.INFO, logger="torchft.manager")
    lighthouse = LighthouseServer(
        "127.0.0.1:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=10, progress_wait_ms=0
    )
    weights = [torch.full((8,), float(i)) for i in range(2)]
    with ExitStack() as stack:
        stack.callback(lighthouse.shutdown)
        managers = []
        stores = []  # each group's torchrun store, alive until its Manager is shut down
        for i, w in enumerate(weights):
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            stores.append(store)

            def load(sd: dict[str, Any], w: torch.Tensor = w) -> None:
                w.copy_(sd["w"])

            def save(w: torch.Tensor = w) -> dict[str, Any]:
                return {"w": w}

            m = Manager(
                pg=ProcessGroupGloo(),
                load_state_dict=load,
                state_dict=save,
                min_replica_size=2,
                use_async_quorum=False,
                rank=0,
                world_size=1,
                store_addr="127.0.0.1",
                store_port=store.port,
                lighthouse_addr=lighthouse.address(),
                replica_id=f"g{i}",
                timeout=TIMEOUT,
                heartbeat_interval=timedelta(milliseconds=50),
            )
            stack.callback(m.shutdown, wait=False)
            managers.append(m)
        urls = [urllib.parse.urlsplit(m._checkpoint_transport.metadata()) for m in managers]
        assert [u.hostname for u in urls] == [addr, addr]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda m: m.start_quorum(), managers))
            assert list(pool.map(lambda m: m.should_commit(), managers)) == [True, True]
        assert torch.equal(weights[0], weights[1])

        healed = [r.getMessage() for r in caplog.records if "healed to step" in r.getMessage()]
        assert len(healed) == 1, healed
        healer = 0 if "[g0:" in healed[0] else 1
        source_addr = urls[1 - healer].netloc
        assert f"from g{1 - healer} at {source_addr}:" in healed[0]
        assert source_addr.startswith(f"{addr}:")

        deadline = time.monotonic() + 30
        last_heal = None
        while last_heal is None and time.monotonic() < deadline:
            for rep in _status(lighthouse.address())["replicas"]:
                if rep["replica_id"] == f"g{healer}" and rep.get("last_heal"):
                    last_heal = rep["last_heal"]
            time.sleep(0.1)
        assert last_heal is not None, "the heal never reached the lighthouse"
        assert last_heal["source"] == f"g{1 - healer}"
        assert last_heal["addr"] == source_addr
