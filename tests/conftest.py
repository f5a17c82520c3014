"""Shared pytest fixtures: an in-process lighthouse and helpers to run the daemon."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import Cluster

logger: logging.Logger = logging.getLogger(__name__)

_ADDR_RE = re.compile(r"lighthouse listening on (https?://\S+)")


@pytest.fixture
def lighthouse() -> Iterator[object]:
    """Yields a started ``LighthouseServer`` (min_replicas=1, fast ticks) on 127.0.0.1:0.

    Returns:
        The server; it is shut down after the test, also on failure.
    """
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        "127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=10,
        progress_wait_ms=0,  # quorums at once: never waits for a holder ahead
    )
    try:
        yield server
    finally:
        server.shutdown()


def lighthouse_command() -> list[str]:
    """The command that runs the ``torchft_lighthouse`` daemon in this environment.

    Prefers the console script next to the running interpreter (installed by
    ``maturin develop``), then one on PATH, and falls back to calling ``lighthouse_main``
    through the interpreter.

    Returns:
        argv prefix to which daemon flags are appended.
    """
    local = Path(sys.executable).parent / "torchft_lighthouse"
    if local.exists():
        return [str(local)]
    found = shutil.which("torchft_lighthouse")
    if found:
        return [found]
    return [
        sys.executable,
        "-c",
        "import sys; sys.argv[0] = 'torchft_lighthouse'; "
        "from torchft._torchft import lighthouse_main; lighthouse_main()",
    ]


class LighthouseProcess:
    """A ``torchft_lighthouse`` daemon subprocess and the address it logged."""

    def __init__(self, proc: subprocess.Popen[str], address: str, log: list[str]) -> None:
        self.proc = proc
        self.address = address
        self.log = log

    def stop(self, timeout: float = 10.0) -> int:
        """Sends SIGTERM and waits for exit, killing on timeout.

        Args:
            timeout: seconds to wait after SIGTERM.

        Returns:
            The exit code.
        """
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _drain(proc: subprocess.Popen[str], log: list[str]) -> None:
    """Keeps reading the daemon's stderr so a full pipe never blocks it."""

    def run() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)

    threading.Thread(target=run, name="lighthouse-log", daemon=True).start()


def start_lighthouse_process(*flags: str, timeout: float = 30.0) -> LighthouseProcess:
    """Starts the daemon with ``flags`` and waits until it logs its address.

    Args:
        flags: extra daemon flags (``--bind 127.0.0.1:0`` is added unless given).
        timeout: seconds to wait for the address line.

    Returns:
        The running process; call ``stop()`` when done.
    """
    args = list(flags)
    if "--bind" not in args:
        args += ["--bind", "127.0.0.1:0"]
    env = dict(os.environ, RUST_LOG="info", NO_COLOR="1")
    proc = subprocess.Popen(
        lighthouse_command() + args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    log: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            log.append(line)
            m = _ADDR_RE.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
            if m:
                _drain(proc, log)
                return LighthouseProcess(proc, m.group(1), log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.kill()
    proc.wait()
    raise RuntimeError("lighthouse did not report its address:\n" + "".join(log))


@pytest.fixture
def lighthouse_process() -> Iterator[LighthouseProcess]:
    """Yields a ``torchft_lighthouse`` daemon subprocess (min_replicas=1) on 127.0.0.1:0.

    Returns:
        The process handle; it is stopped after the test, also on failure.
    """
    p = start_lighthouse_process("--min_replicas", "1", "--quorum_tick_ms", "10")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A lighthouse (min_replicas=1, short join timeout) plus a replica-group process launcher.

    Returns:
        The launcher; its processes and the lighthouse are stopped after
        the test, also on failure.
    """
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=300,
        quorum_tick_ms=20,
        # The daemon's default. A group whose heartbeats lapse for half of it (its lease)
        # during a step votes no; at 1.5 s a 0.75 s scheduling gap on a loaded machine was
        # enough at the run's last step: the peer committed and exited, and the group's
        # retry, alone, could not heal from it. These tests kill with SIGKILL (seen at once
        # by the lighthouse's session), never by heartbeat expiry.
        heartbeat_timeout_ms=5000,
    )
    c = Cluster(tmp_path, lighthouse.address())
    try:
        yield c
    finally:
        c.close()
        lighthouse.shutdown()
