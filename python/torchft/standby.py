"""Warm standby processes: spares that have already paid torch's start-up and wait to be
given the identity of a replica group's process that died.

A restarted replica group spends most of its recovery starting Python and importing torch
(and the compiler stack ``torch.optim`` and DDP import on first use), not in torchft. A spare
does all of that ahead of time:

    python -m torchft.standby [--preload MODULE ...]

imports torch, ``torch.distributed``, ``torch._dynamo``, torchft and the ``--preload``
modules, runs one optimizer step on a CPU tensor (so lazily imported optimizer code is
loaded too), then writes ``ready`` on its standard output and waits. It never touches an
accelerator: a spare holds no GPU memory until it is promoted.

To promote it, its owner writes one JSON line on its standard input::

    {"argv": ["train.py", "--lr", "0.1"], "env": {...}, "cwd": "/job", "module": false,
     "output": null}

and closes it. The spare then becomes that process: it replaces its environment, working
directory and ``sys.argv``, sends its output to ``output`` (a file) when one is named, and
runs the script (or, with ``"module": true``, the module) as ``__main__``. Its exit status is
the script's. End of input before a promotion (the owner went away) ends the spare quietly.

:class:`StandbyPool` keeps a number of spares warm for an owner (``torchft.launch --standby``
and the chaos harness use it): spares are spawned fresh (never forked from a process holding
threads or a CUDA context), a spare that dies is replaced, and :meth:`StandbyPool.close`
leaves none behind.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchft.config import adopt_environment

logger = logging.getLogger(__name__)

#: The line a spare writes once it is warm.
READY = "ready"
#: Exit status of a spare whose ``--preload`` module failed to import.
PRELOAD_FAILED = 3
#: Exit status of a spare given a promotion it cannot run (bad JSON, missing script).
BAD_PROMOTION = 4

#: Spares dying before they are ready, in a row, after which the pool gives up.
MAX_EARLY_DEATHS = 5

#: Modules every spare imports (what a training process would import before its first
#: step: torch imports ``torch._dynamo`` on the first optimizer and DDP construction).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.optim",
    "torch._dynamo",
    "torchft",
)


class StandbyError(RuntimeError):
    """A spare could not be made ready (e.g. a ``--preload`` module failed to import)."""


def _check_modules(names: Sequence[str]) -> list[str]:
    out = []
    for name in names:
        name = name.strip()
        if not name or any(not part.isidentifier() for part in name.split(".")):
            raise ValueError(
                f"--preload needs module names (like 'numpy' or 'pkg.mod'), got {name!r}"
            )
        out.append(name)
    return out


# ---- the spare process ---------------------------------------------------------------------


def _warm(preload: Sequence[str]) -> None:
    """Imports what a training process imports before its first step."""
    for name in WARM_MODULES:
        importlib.import_module(name)
    import torch

    # The first optimizer step loads more of torch.optim lazily; a CPU tensor only, so no
    # accelerator context is created.
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    torch.optim.AdamW([p], lr=0.0).step()
    for name in preload:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - any failure of the user's module
            print(
                f"torchft.standby: --preload module {name!r} failed to import: "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(PRELOAD_FAILED)


def _read_promotion() -> dict[str, Any] | None:
    line = sys.stdin.readline()
    if not line:
        return None
    try:
        msg = json.loads(line)
    except json.JSONDecodeError as e:
        print(f"torchft.standby: promotion is not JSON: {e}", file=sys.stderr, flush=True)
        sys.exit(BAD_PROMOTION)
    argv = msg.get("argv") if isinstance(msg, dict) else None
    env = msg.get("env") if isinstance(msg, dict) else None
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) for a in argv)
        or not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        print(
            "torchft.standby: a promotion needs 'argv' (a non-empty list of strings) and "
            f"'env' (a mapping of strings); got {line.strip()[:200]!r}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(BAD_PROMOTION)
    checked: dict[str, Any] = msg
    return checked


def _become(msg: dict[str, Any]) -> None:
    """Takes on the promoted identity and runs its script (or module) as ``__main__``."""
    import torch

    env: dict[str, str] = msg["env"]
    own = dict(os.environ)
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads != own.get("OMP_NUM_THREADS") and threads.isdigit():
        # The warm-up sized torch's intra-op pool from the spare's own environment.
        torch.set_num_threads(max(1, int(threads)))
    adopt_environment(env)
    cwd = msg.get("cwd")
    if cwd:
        os.chdir(cwd)
    output = msg.get("output")
    if output:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    argv: list[str] = msg["argv"]
    # sys.path[0] is what ``python script.py`` (the script's folder) or ``python -m mod``
    # (the working directory) would have put there.
    if msg.get("module"):
        sys.argv = list(argv)
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.isfile(script):
            print(f"torchft.standby: script {script!r} does not exist", file=sys.stderr)
            sys.exit(BAD_PROMOTION)
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of a spare (``python -m torchft.standby``)."""
    p = argparse.ArgumentParser(prog="python -m torchft.standby")
    p.add_argument("--preload", action="append", default=[], help="module to import (repeat)")
    args = p.parse_args(argv)
    try:
        preload = _check_modules(args.preload)
    except ValueError as e:
        print(f"torchft.standby: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    # Until promoted, the owner's SIGINT (a terminal's ^C) is the owner's business.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm(preload)
    print(READY, flush=True)
    msg = _read_promotion()
    if msg is None:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _become(msg)


# ---- the pool ------------------------------------------------------------------------------

#: A promotion this long is written at once: a pipe holds at least one page (4 KiB on Linux)
#: even when the system limits pipe sizes, so the write never waits for the spare to read.
_PIPE_SAFE_BYTES = 4096


@dataclass
class Spare:
    """A spare process (ready once it wrote ``ready``)."""

    proc: subprocess.Popen[str]
    spawned: float
    ready: threading.Event = field(default_factory=threading.Event)
    #: Set once the pool stopped reading the spare's output (at ``ready``, or at its end if
    #: it died first): from then on ``proc.stdout`` carries only what the promoted run
    #: prints. An owner that promoted a spare still warming reads its output after this.
    released: threading.Event = field(default_factory=threading.Event)
    #: What it printed before ``ready`` (an import error, typically).
    output: list[str] = field(default_factory=list)
    ready_s: float | None = None
    #: Promoted with an output file while still warming: the pool's reader closes
    #: ``proc.stdout`` once it is released (closing it earlier would break the spare's
    #: ``ready`` line on a closed pipe).
    close_on_release: bool = False
    #: Handed an identity by :meth:`StandbyPool.promote`.
    promoted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class StandbyPool:
    """Keeps ``size`` warm spares (see the module documentation)."""

    def __init__(
        self,
        size: int,
        preload: Sequence[str] = (),
        env: dict[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        """Validates; nothing starts until :meth:`start`.

        Args:
            size: spares to keep (0 keeps none: :meth:`take` always returns None).
            preload: modules every spare imports besides torch and torchft.
            env: environment spares start with (default: this process's). Every spare
                carries it, so an owner can find its processes by a marker variable.
            python: interpreter for spares (default: this one).
        """
        if size < 0:
            raise ValueError(f"--standby must be >= 0, got {size}")
        self.size = size
        self.preload = _check_modules(preload)
        self.env = dict(os.environ) if env is None else dict(env)
        self.python = python or sys.executable
        self._lock = threading.Lock()
        self._spares: list[Spare] = []
        self._closed = False
        self._failed: str | None = None
        self._wake = threading.Event()
        self._monitor: threading.Thread | None = None
        self.promoted = 0
        self.replaced = 0
        # Spares that died before they were ready, in a row: past MAX_EARLY_DEATHS the pool
        # stops respawning (a machine that cannot start one would churn forever).
        self._early_deaths = 0

    # ---- lifecycle

    def start(self) -> None:
        """Spawns the spares and a monitor that replaces the ones that die."""
        if self.size == 0:
            return
        with self._lock:
            for _ in range(self.size):
                self._spares.append(self._spawn())
        self._monitor = threading.Thread(target=self._watch, name="standby-pool", daemon=True)
        self._monitor.start()

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Blocks until one spare is ready.

        Raises:
            StandbyError: a spare failed before it was ready (its output says why), or none
                was ready within ``timeout``.
        """
        if self.size == 0:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._failed is not None:
                    raise StandbyError(self._failed)
                if any(s.ready.is_set() for s in self._spares):
                    return
            time.sleep(0.05)
        raise StandbyError(f"no standby process was ready within {timeout:.0f}s")

    def close(self) -> None:
        """Kills every spare not promoted; none is left behind."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        self._wake.set()
        for s in spares:
            _kill(s.proc)
        if self._monitor is not None:
            self._monitor.join(timeout=5)

    # ---- use

    def ready_count(self) -> int:
        """Spares ready to be promoted now."""
        with self._lock:
            return sum(1 for s in self._spares if s.ready.is_set() and s.proc.poll() is None)

    def pids(self) -> list[int]:
        """PIDs of the spares not promoted (ready or warming)."""
        with self._lock:
            return [s.proc.pid for s in self._spares]

    def take(self, warming: bool = False) -> Spare | None:
        """Removes and returns a ready spare (a new one starts warming in its place); None
        when no spare is ready.

        Args:
            warming: when none is ready, take the spare that has warmed longest instead (it
                is ahead of a cold start by that long). Its promotion waits in its input
                until it is ready; read its output only after ``spare.released`` is set.
        """
        with self._lock:
            alive = [s for s in self._spares if s.proc.poll() is None]
            ready = [s for s in alive if s.ready.is_set()]
            if ready:
                chosen = ready[0]
            elif warming and alive:
                chosen = min(alive, key=lambda s: s.spawned)
            else:
                return None
            self._spares.remove(chosen)
            if not self._closed and self._failed is None:
                self._spares.append(self._spawn())
            return chosen

    def promote(
        self,
        spare: Spare,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: str | None = None,
        module: bool = False,
        output: str | None = None,
    ) -> subprocess.Popen[str]:
        """Gives ``spare`` an identity: it runs ``argv`` (a script path and its arguments, or
        a module name and its arguments with ``module``) with exactly ``env``.

        Returns at once, even for a spare still warming (it reads its identity once warm).

        Returns:
            The spare's process, now the promoted one. Its standard output (and error) go to
            ``output`` when given, else they stay on the pipe ``proc.stdout``.

        Raises:
            StandbyError: the spare died before it could be promoted.
        """
        msg = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
            "module": module,
            "output": output,
        }
        stdin = spare.proc.stdin
        assert stdin is not None
        spare.proc.stdin = None  # the promoted process reads nothing more from us
        line = json.dumps(msg) + "\n"
        if len(line.encode()) <= _PIPE_SAFE_BYTES or spare.proc.poll() is not None:
            # Fits in the pipe whether or not the spare reads yet (or the spare is gone,
            # which the write says at once).
            try:
                stdin.write(line)
                stdin.close()
            except (BrokenPipeError, OSError) as e:
                _kill(spare.proc)
                raise StandbyError(
                    f"standby process {spare.proc.pid} died before promotion: {e}"
                ) from e
        else:
            # A spare reads its identity only once warm: a write larger than the pipe would
            # hold the owner until then (for ever, if the spare hangs while warming).
            threading.Thread(
                target=_hand_over,
                args=(spare.proc, stdin, line),
                name=f"standby-promote-{spare.proc.pid}",
                daemon=True,
            ).start()
        if output is not None:
            # The promoted process writes to `output`; a spare still warming writes `ready`
            # first, so its pipe is closed once the pool's reader has read that.
            with spare.lock:
                if spare.released.is_set():
                    _close_stdout(spare.proc)
                else:
                    spare.close_on_release = True
        spare.promoted = True
        with self._lock:
            self.promoted += 1
        logger.info("promoted standby process %d (%s)", spare.proc.pid, " ".join(argv)[:200])
        return spare.proc

    # ---- internals

    def _spawn(self) -> Spare:
        cmd = [self.python, "-u", "-m", "torchft.standby"]
        for name in self.preload:
            cmd += ["--preload", name]
        proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        spare = Spare(proc, time.monotonic())
        threading.Thread(
            target=self._await_ready, args=(spare,), name=f"standby-{proc.pid}", daemon=True
        ).start()
        return spare

    def _await_ready(self, spare: Spare) -> None:
        """Reads the spare's output up to ``ready`` (the rest belongs to the promoted run)."""
        stdout = spare.proc.stdout
        assert stdout is not None
        try:
            for line in stdout:
                if line.strip() == READY:
                    spare.ready_s = time.monotonic() - spare.spawned
                    spare.ready.set()
                    logger.debug("standby %d ready in %.2fs", spare.proc.pid, spare.ready_s)
                    return
                spare.output.append(line)
                del spare.output[:-50]
        except (ValueError, OSError):
            pass  # closed by close(): the spare is being killed
        finally:
            with spare.lock:
                spare.released.set()
                if spare.close_on_release:
                    _close_stdout(spare.proc)
        if spare.promoted:
            # Promoted while warming and gone before ready: its owner sees the exit, and
            # what it printed is only here. Killed by a signal (its owner stopping it, a
            # fault) is no news; anything else is.
            try:
                code: int | None = spare.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                code = None
            text = "".join(spare.output).strip()
            logger.log(
                logging.INFO if code is not None and code < 0 else logging.WARNING,
                "standby process %d, promoted while warming, ended (exit %s) before it was ready%s",
                spare.proc.pid,
                code,
                f": {text[-300:]}" if text else "",
            )
        self._wake.set()  # ended before ready: the monitor looks at it

    def _watch(self) -> None:
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                for s in list(self._spares):
                    code = s.proc.poll()
                    if code is None:
                        continue
                    self._spares.remove(s)
                    text = "".join(s.output).strip()
                    early = not s.ready.is_set()
                    self._early_deaths = self._early_deaths + 1 if early else 0
                    if early and (
                        code in (PRELOAD_FAILED, 2) or self._early_deaths >= MAX_EARLY_DEATHS
                    ):
                        # Every new spare would fail the same way: stop and say why.
                        self._failed = text or f"standby process exited with {code}"
                        if code not in (PRELOAD_FAILED, 2):
                            self._failed = (
                                f"{self._early_deaths} standby processes in a row died before "
                                f"they were ready (the last exited with {code}): "
                                + self._failed[-500:]
                            )
                        logger.error("standby processes cannot start: %s", self._failed)
                        continue
                    if self._failed is None:
                        logger.warning(
                            "standby process %d died (exit %s) before promotion; replacing it%s",
                            s.proc.pid,
                            code,
                            f": {text[-300:]}" if text else "",
                        )
                        self.replaced += 1
                        self._spares.append(self._spawn())


def kill_session(proc: subprocess.Popen[str], wait_s: float = 10.0) -> None:
    """SIGKILLs a process started in its own session, with anything it started there, and
    reaps it (the launcher's ranks and the pool's spares end this way)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                proc.kill()
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        logger.error("process %d did not exit after SIGKILL", proc.pid)


def _hand_over(proc: subprocess.Popen[str], stdin: Any, line: str) -> None:
    """Writes a promotion larger than a pipe holds, as the spare reads it; a spare that ends
    first ends as the promoted process (its owner sees its exit), and is said to have."""
    try:
        stdin.write(line)
        stdin.close()
    except (BrokenPipeError, OSError, ValueError) as e:
        logger.warning(
            "standby process %d ended before it read its promotion (%d bytes): %s",
            proc.pid,
            len(line),
            e,
        )
        kill_session(proc, wait_s=5.0)


def _close_stdout(proc: subprocess.Popen[str]) -> None:
    """Closes and forgets the owner's end of a spare's output pipe."""
    if proc.stdout is not None:
        try:
            proc.stdout.close()
        except OSError:
            pass
        proc.stdout = None


def _kill(proc: subprocess.Popen[str]) -> None:
    """Ends a spare and closes the pipes the pool holds to it."""
    kill_session(proc, wait_s=5.0)
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


if __name__ == "__main__":
    main()
