"""The native core's log lines reach a training process's stderr, in the Python layout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(90)

# A training process whose lighthouse goes away: its manager server warns about it.
_SCRIPT = textwrap.dedent(
    """
    import time
    from datetime import timedelta
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse.address(),
        replica_id="rg_log",
        hostname="127.0.0.1",
        connect_timeout=timedelta(seconds=10),
    )
    time.sleep(0.5)
    lighthouse.shutdown()
    time.sleep(1.5)
    manager.shutdown(wait=False)
    print("script done", flush=True)
    """
)

_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING torchft\.manager\.server(\.\w+)?: "
    r"\[rg_log:[0-9a-f-]{36}/0\] lighthouse (session ended|heartbeat)",
    re.MULTILINE,
)


def _run(extra_env: dict[str, str], code: str = _SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHFT_LOG", "RUST_LOG")}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=80
    )


def test_manager_server_warning_reaches_stderr() -> None:
    """A manager-server warning appears on the training process's stderr (default level
    warn), naming the replica group and group rank like the Python loggers' records."""
    proc = _run({})
    assert proc.returncode == 0, proc.stderr
    assert "script done" in proc.stdout
    assert _LINE.search(proc.stderr), proc.stderr
    assert " INFO " not in proc.stderr  # warn by default


def test_torchft_log_sets_the_level_over_rust_log() -> None:
    """TORCHFT_LOG wins over RUST_LOG: at error level the warning is not printed, at info
    the server's start-up line is."""
    quiet = _run({"TORCHFT_LOG": "error", "RUST_LOG": "info"})
    assert quiet.returncode == 0, quiet.stderr
    assert not _LINE.search(quiet.stderr), quiet.stderr
    chatty = _run({"RUST_LOG": "info"})
    assert chatty.returncode == 0, chatty.stderr
    assert "INFO torchft.manager.server: [" in chatty.stderr or (
        "INFO torchft.manager.server: manager server listening" in chatty.stderr
    ), chatty.stderr


@pytest.mark.parametrize(
    ("name", "raw"), [("TORCHFT_LOG", "torchft=loud"), ("TORCHFT_RUNTIME_THREADS", "many")]
)
def test_bad_native_variable_is_a_clear_error(name: str, raw: str) -> None:
    """A bad value of a variable the native core reads fails the import, naming it."""
    proc = _run({name: raw}, code="import torchft")
    assert proc.returncode != 0
    assert name in proc.stderr
