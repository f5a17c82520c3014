"""Tests of torchft.config: one resolution of Manager arguments and TORCHFT_* variables."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchft.checkpointing import HTTPTransport, PGTransport
from torchft.config import ENV_VARS, ManagerConfig, WorldSizeMode, timeout_override
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
    "RANK": ["first"],
    "WORLD_SIZE": ["0"],
    "MASTER_PORT": ["0", "port"],
}


@pytest.mark.parametrize(
    ("name", "raw"), [(name, raw) for name, raws in BAD_VALUES.items() for raw in raws]
)
def test_bad_variable_is_a_clear_error_naming_it(name: str, raw: str) -> None:
    """Every variable has one behaviour on a bad value: ValueError naming the variable."""
    with pytest.raises(ValueError, match=name):
        resolve({name: raw})


def test_every_manager_variable_is_registered() -> None:
    """ENV_VARS lists every variable ManagerConfig reads, plus the native ones."""
    assert set(BAD_VALUES) <= set(ENV_VARS)
    assert {"TORCHFT_LOG", "TORCHFT_RUNTIME_THREADS", "JOB_ID"} <= set(ENV_VARS)


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
    """``python -m torchft.config`` prints every variable with its current value."""
    out = subprocess.run(
        [sys.executable, "-m", "torchft.config"],
        env={"TORCHFT_TIMEOUT_SEC": "12", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for name in ENV_VARS:
        assert name in out
    assert "'12'" in out
