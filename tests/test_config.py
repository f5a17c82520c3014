"""Tests of torchft.config: one resolution of Manager arguments and TORCHFT_* variables."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchft.checkpointing import HTTPTransport, PGTransport
from torchft.checkpointing._security import TransportSecurity
from torchft.config import (
    ENV_VARS,
    ManagerConfig,
    WorldSizeMode,
    checkpoint_bind,
    env_value,
    security_settings,
    timeout_override,
)
from torchft.process_group import ProcessGroupGloo

pytestmark = pytest.mark.timeout(60)

BASE: dict[str, str] = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "storehost",
    "MASTER_PORT": "29500",
    "TORCHFT_LIGHTHOUSE": "http://lh:29510",
}


def resolve(env: dict[str, str] | None = None, **args: Any) -> ManagerConfig:
    return ManagerConfig.resolve(env={**BASE, **(env or {})}, **{"min_replica_size": 1, **args})


def test_environment_fills_what_the_arguments_leave_open() -> None:
    """torchrun's variables and TORCHFT_LIGHTHOUSE fill unset arguments; defaults apply."""
    cfg = resolve()
    assert (cfg.rank, cfg.world_size) == (1, 4)
    assert (cfg.store_addr, cfg.store_port) == ("storehost", 29500)
    assert cfg.lighthouse_addr == "http://lh:29510"
    assert cfg.timeout == timedelta(seconds=60) and cfg.port == 0 and cfg.telemetry is True
    assert cfg.world_size_mode is WorldSizeMode.DYNAMIC
    assert cfg.hostname  # the machine's name by default
    explicit = resolve(rank=0, world_size=2, lighthouse_addr="http://other:1", port=5)
    assert (explicit.rank, explicit.world_size, explicit.port) == (0, 2, 5)
    assert explicit.lighthouse_addr == "http://other:1"


def test_overrides_win_over_arguments() -> None:
    """The TORCHFT_*_SEC and TORCHFT_QUORUM_RETRIES variables replace the arguments."""
    env = {
        "TORCHFT_TIMEOUT_SEC": "7",
        "TORCHFT_QUORUM_TIMEOUT_SEC": "2.5",
        "TORCHFT_CONNECT_TIMEOUT_SEC": "9",
        "TORCHFT_QUORUM_RETRIES": "3",
    }
    cfg = resolve(env, timeout=timedelta(seconds=1), quorum_retries=1)
    assert cfg.timeout == timedelta(seconds=7)
    assert cfg.quorum_timeout == timedelta(seconds=2.5)
    assert cfg.connect_timeout == timedelta(seconds=9)
    assert cfg.quorum_retries == 3


def test_config_is_frozen() -> None:
    """The resolved config cannot change under a running Manager."""
    cfg = resolve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.timeout = timedelta(seconds=1)  # type: ignore[misc]


BAD_VALUES = {
    "TORCHFT_TIMEOUT_SEC": ["soon", "0", "-3", "inf"],
    "TORCHFT_QUORUM_TIMEOUT_SEC": ["x"],
    "TORCHFT_CONNECT_TIMEOUT_SEC": ["1s"],
    "TORCHFT_QUORUM_RETRIES": ["-1", "two"],
    "TORCHFT_MANAGER_PORT": ["70000", "http"],
    "TORCHFT_TELEMETRY": ["perhaps"],
    "TORCHFT_SPARSE_QUORUM": ["sometimes", "2"],
    "TORCHFT_HANG_ACTION": ["restart", "Exit!"],
    "TORCHFT_PARITY_EVERY": ["-1", "often", "1.5"],
    "RANK": ["first"],
    "WORLD_SIZE": ["0"],
    "MASTER_PORT": ["0", "port"],
    "REPLICA_GROUP_ID": ["-1", "first"],
}


@pytest.mark.parametrize(
    ("name", "raw"), [(name, raw) for name, raws in BAD_VALUES.items() for raw in raws]
)
def test_bad_variable_is_a_clear_error_naming_it(name: str, raw: str) -> None:
    """Every variable has one behaviour on a bad value: ValueError naming the variable."""
    with pytest.raises(ValueError, match=name):
        resolve({name: raw, **NEEDS.get(name, {})})


#: Variables read only next to another one.
NEEDS = {"REPLICA_GROUP_ID": {"WORLD_TOPOLOGY_FILE": "/etc/topology.json"}}


@pytest.mark.parametrize("raw", ["train_a", "-1", "0"])
def test_replica_group_id_is_ignored_without_a_topology_file(raw: str) -> None:
    """REPLICA_GROUP_ID only places the group in WORLD_TOPOLOGY_FILE: without the file a job
    may use the name for anything (e.g. a group name) and the Manager neither reads nor
    refuses it."""
    assert resolve({"REPLICA_GROUP_ID": raw}).replica_group_index is None


def test_topology_file_needs_the_replica_group_index() -> None:
    """WORLD_TOPOLOGY_FILE places the group by REPLICA_GROUP_ID: one without the other is
    refused at once, naming both; together they resolve."""
    with pytest.raises(ValueError, match="WORLD_TOPOLOGY_FILE.*REPLICA_GROUP_ID"):
        resolve({"WORLD_TOPOLOGY_FILE": "/etc/topology.json"})
    cfg = resolve({"WORLD_TOPOLOGY_FILE": "/etc/topology.json", "REPLICA_GROUP_ID": "2"})
    assert (cfg.topology_file, cfg.replica_group_index) == ("/etc/topology.json", 2)
    assert resolve().topology_file is None


def test_every_manager_variable_is_registered() -> None:
    """ENV_VARS lists every variable ManagerConfig reads, plus the native ones."""
    assert set(BAD_VALUES) <= set(ENV_VARS)
    assert {"TORCHFT_LOG", "TORCHFT_RUNTIME_THREADS", "JOB_ID"} <= set(ENV_VARS)
    assert {"WORLD_TOPOLOGY_FILE", "REPLICA_GROUP_ID"} <= set(ENV_VARS)
    assert set(SECURITY_VARS) | {"TORCHFT_CHECKPOINT_BIND"} <= set(ENV_VARS)


SECURITY_VARS = (
    "TORCHFT_TOKEN_FILE",
    "TORCHFT_TOKEN",
    "TORCHFT_TLS_CERT",
    "TORCHFT_TLS_KEY",
    "TORCHFT_TLS_CA",
    "TORCHFT_TLS_CLIENT_CA",
)
CERTS = Path(__file__).resolve().parent / "certs"


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("TORCHFT_TOKEN_FILE", "/nonexistent/token"),
        ("TORCHFT_TOKEN", "has space"),
        ("TORCHFT_TLS_CERT", "/nonexistent/cert.pem"),
        ("TORCHFT_TLS_KEY", "/nonexistent/key.pem"),
        ("TORCHFT_TLS_CA", "/nonexistent/ca.pem"),
        ("TORCHFT_TLS_CLIENT_CA", "/nonexistent/client-ca.pem"),
    ],
)
def test_bad_security_variable_is_a_clear_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: str
) -> None:
    """The token and TLS variables (parsed by the native core, like its servers do) fail the
    same way as every other setting: ValueError naming the variable, wherever they are read."""
    for var in SECURITY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        security_settings()
    with pytest.raises(ValueError, match=name):
        TransportSecurity.from_env()
    if name == "TORCHFT_TOKEN":
        with pytest.raises(ValueError) as info:
            security_settings()
        assert raw not in str(info.value)  # the secret is never echoed


def test_security_settings_come_through_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid token and TLS variables reach the checkpoint transport through torchft.config."""
    for var in SECURITY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHFT_TOKEN", "s3cret")
    monkeypatch.setenv("TORCHFT_TLS_CA", str(CERTS / "ca.pem"))
    got = security_settings()
    assert got["token"] == "s3cret" and got["tls_ca"] == str(CERTS / "ca.pem")
    assert got["tls_cert"] is None
    assert TransportSecurity.from_env() == TransportSecurity(**got)


def test_checkpoint_bind_and_lighthouse_fallbacks_use_the_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TORCHFT_CHECKPOINT_BIND and the launcher's TORCHFT_LIGHTHOUSE are read through the
    registry (blank counts as unset, the same as for the Manager)."""
    monkeypatch.setenv("TORCHFT_CHECKPOINT_BIND", " ")
    assert checkpoint_bind() is None
    monkeypatch.setenv("TORCHFT_CHECKPOINT_BIND", "::")
    assert checkpoint_bind() == "::"
    assert env_value("TORCHFT_LIGHTHOUSE", {"TORCHFT_LIGHTHOUSE": ""}) is None
    with pytest.raises(KeyError):
        env_value("TORCHFT_NOT_A_SETTING")


def test_no_module_reads_the_environment_directly() -> None:
    """Only torchft.config reads os.environ for a setting (the launcher only copies it into
    its children's environment)."""
    pkg = Path(__file__).resolve().parents[1] / "python" / "torchft"
    readers = re.compile(r"os\.environ(?!\))|os\.getenv|getenv\(")
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        if path.name == "config.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if readers.search(line) and "dict(os.environ)" not in line:
                offenders.append(f"{path.relative_to(pkg)}:{lineno}: {line.strip()}")
    assert not offenders, "read settings through torchft.config:\n" + "\n".join(offenders)


def test_missing_required_setting_names_argument_and_variable() -> None:
    """A setting neither given nor in the environment names both places to set it."""
    env = {k: v for k, v in BASE.items() if k != "TORCHFT_LIGHTHOUSE"}
    with pytest.raises(ValueError, match="lighthouse_addr.*TORCHFT_LIGHTHOUSE"):
        ManagerConfig.resolve(env=env, min_replica_size=1)


def test_timeout_variable_means_the_same_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Process groups and both transports apply TORCHFT_TIMEOUT_SEC the same way; a bad
    value is an error in each (a transport used to ignore it silently)."""
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "4")
    assert timeout_override(timedelta(seconds=1)) == timedelta(seconds=4)
    assert ProcessGroupGloo(timeout=timedelta(seconds=1))._timeout == timedelta(seconds=4)
    pg = ProcessGroupGloo()
    assert PGTransport(pg, timedelta(seconds=1), torch.device("cpu"))._timeout == timedelta(
        seconds=4
    )
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "soon")
    for make in (
        lambda: ProcessGroupGloo(),
        lambda: PGTransport(pg, timedelta(seconds=1), torch.device("cpu")),
        lambda: HTTPTransport(timedelta(seconds=1)),
    ):
        with pytest.raises(ValueError, match="TORCHFT_TIMEOUT_SEC"):
            make()


def test_cli_lists_the_variables() -> None:
    """``python -m torchft.config`` prints every variable with its current value, secrets
    masked."""
    out = subprocess.run(
        [sys.executable, "-m", "torchft.config"],
        env={"TORCHFT_TIMEOUT_SEC": "12", "TORCHFT_TOKEN": "hunter2", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for name in ENV_VARS:
        assert name in out
    assert "'12'" in out
    assert "hunter2" not in out and "(set)" in out
