"""Launch several replica groups of a training script, each under its own torchrun.

    python -m torchft.launch --replicas 3 --nproc-per-node 1 [--max-restarts N] \
        [--standby N [--preload MODULE ...]] script.py -- --script-args

Each replica group runs as ``torchrun --standalone`` (so it gets its own rendezvous store on a
free port: nobody hand-assigns ports) with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and
``TORCHFT_LIGHTHOUSE`` set. Without ``--lighthouse`` (or ``TORCHFT_LIGHTHOUSE``) a local
``torchft_lighthouse`` is started for the job. A group that dies is restarted (up to
``--max-restarts`` times) while the others keep training; SIGINT/SIGTERM are forwarded, and
every process started here — including the training workers torchrun starts in their own
sessions — is gone when the launcher exits.

With ``--standby N`` the launcher keeps N warm spare processes (see :mod:`torchft.standby`:
Python started, torch, its compiler stack, torchft and the ``--preload`` modules imported)
and runs each group's ranks itself, as torchrun's agent would: it hosts the group's store and
gives every rank torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` with ``TORCHELASTIC_USE_AGENT_STORE``,
``TORCHELASTIC_RESTART_COUNT``, ...). When a rank dies, the group's other ranks are stopped
and every rank is replaced by a spare handed that identity, which runs the script from the
top in a process that has already paid torch's start-up; new spares warm up in the
background. Without a ready spare a rank takes the spare that has warmed longest (it runs
the script once warm); with none at all it starts cold.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchft.config import env_value
from torchft.standby import StandbyError, StandbyPool, kill_session

logger = logging.getLogger(__name__)

#: Environment marker carried by every process of a launch, so all of them can be found.
MARKER_ENV = "TORCHFT_LAUNCH_ID"
_ADDRESS_RE = re.compile(r"listening on (https?://\S+)")

LineHandler = Callable[[int, str], None]


@dataclass
class GroupState:
    """What the launcher knows about one replica group."""

    index: int
    proc: subprocess.Popen[str] | None = None
    restarts: int = 0
    exit_code: int | None = None
    finished: bool = False
    failed: bool = False
    started_at: float = 0.0
    start_times: list[float] = field(default_factory=list)
    #: With standbys: the group's rank processes (rank order) and its store.
    ranks: list[subprocess.Popen[str]] = field(default_factory=list)
    store: Any = None
    #: With standbys: how many of the current incarnation's ranks were warm spares.
    warm: int = 0
    #: The threads handing the current incarnation's output lines to ``on_line``.
    pumps: list[threading.Thread] = field(default_factory=list)


def _find_lighthouse_cmd() -> list[str]:
    """The command that runs the lighthouse daemon from this Python environment."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if os.access(exe, os.X_OK):
        return [exe]
    found = shutil.which("torchft_lighthouse")
    if found:
        return [found]
    return [sys.executable, "-c", "from torchft._torchft import lighthouse_main; lighthouse_main()"]


def _pids_with_marker(marker: str) -> list[int]:
    """Every live process whose environment carries ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(entry))
    return pids


class LighthouseProcess:
    """A ``torchft_lighthouse`` daemon started for one launch."""

    def __init__(
        self,
        min_replicas: int,
        join_timeout_ms: int = 5000,
        heartbeat_timeout_ms: int | None = None,
        bind: str = "127.0.0.1:0",
        start_timeout: float = 60.0,
        event_log: str | None = None,
    ) -> None:
        """Starts the daemon and waits until it reports its address.

        Args:
            min_replicas: the lighthouse's ``--min_replicas``.
            join_timeout_ms: how long a forming quorum waits for stragglers.
            heartbeat_timeout_ms: the lighthouse's heartbeat timeout (its default when None).
            bind: listen address; port 0 picks a free port.
            start_timeout: seconds to wait for the daemon to come up.
            event_log: file the daemon appends replica health events to (``--event_log``).
        """
        cmd = _find_lighthouse_cmd() + [
            "--min_replicas",
            str(min_replicas),
            "--bind",
            bind,
            "--join_timeout_ms",
            str(join_timeout_ms),
        ]
        if heartbeat_timeout_ms is not None:
            cmd += ["--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
        if event_log is not None:
            cmd += ["--event_log", event_log]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.address = self._wait_address(start_timeout)
        self._drain = threading.Thread(target=self._forward, name="lighthouse-log", daemon=True)
        self._drain.start()

    def _wait_address(self, timeout: float) -> str:
        assert self.proc.stderr is not None
        lines: list[str] = []
        result: list[str] = []

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                lines.append(line)
                m = _ADDRESS_RE.search(line)
                if m:
                    result.append(m.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not result:
            self.stop()
            raise RuntimeError(
                f"torchft_lighthouse did not report its address within {timeout}s; "
                f"output:\n{''.join(lines)}"
            )
        return result[0]

    def _forward(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            logger.debug("[lighthouse] %s", line.rstrip())

    def stop(self, grace: float = 5.0) -> None:
        """Stops the daemon (SIGTERM, then SIGKILL after ``grace`` seconds)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Launcher:
    """Runs and supervises the replica groups of one job."""

    def __init__(
        self,
        script: str,
        script_args: Sequence[str] = (),
        replicas: int = 2,
        nproc_per_node: int = 1,
        max_restarts: int = 3,
        lighthouse: str | None = None,
        min_replicas: int | None = None,
        join_timeout_ms: int = 5000,
        env: dict[str, str] | None = None,
        on_line: LineHandler | None = None,
        standby: int = 0,
        preload: Sequence[str] = (),
    ) -> None:
        """Validates the job description; nothing is started until :meth:`start`.

        Args:
            script: the training script each group runs.
            script_args: arguments passed to the script.
            replicas: number of replica groups.
            nproc_per_node: ranks per replica group (torchrun's ``--nproc-per-node``).
            max_restarts: restarts allowed per group before it is given up.
            lighthouse: address of an existing lighthouse; None starts a local one
                (unless ``TORCHFT_LIGHTHOUSE`` is set).
            min_replicas: ``--min_replicas`` of a locally started lighthouse
                (default: ``replicas`` // 2 + 1, at least 1).
            join_timeout_ms: join timeout of a locally started lighthouse.
            env: extra environment for every group.
            on_line: called with (group index, line) for every output line of a group;
                by default lines are printed with a ``[group i]`` prefix.
            standby: warm spare processes to keep (0: every group runs under torchrun and
                restarts cold).
            preload: modules each spare imports besides torch and torchft.
        """
        if replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {replicas}")
        if nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        if not os.path.isfile(script):
            raise ValueError(f"training script {script!r} does not exist")
        if min_replicas is not None and not 1 <= min_replicas <= replicas:
            raise ValueError(f"--min-replicas must be in [1, {replicas}], got {min_replicas}")
        if standby < 0:
            raise ValueError(f"--standby must be >= 0, got {standby}")
        if preload and standby == 0:
            raise ValueError("--preload needs --standby N (it names what the spares import)")
        self.script = script
        self.script_args = list(script_args)
        self.replicas = replicas
        self.nproc_per_node = nproc_per_node
        self.max_restarts = max_restarts
        self.lighthouse_addr = lighthouse or env_value("TORCHFT_LIGHTHOUSE")
        self.min_replicas = min_replicas or max(1, replicas // 2 + 1)
        self.join_timeout_ms = join_timeout_ms
        self.extra_env = dict(env or {})
        self.on_line = on_line or self._print_line
        self.marker = uuid.uuid4().hex
        self.groups = [GroupState(i) for i in range(replicas)]
        self.lighthouse: LighthouseProcess | None = None
        #: Where every torchrun of this launch keeps its agent's files (the workers' error
        #: files); made at the first torchrun, removed by shutdown. Without it each torchrun
        #: makes a directory of its own in the system temp directory and leaves it there.
        self.log_dir: str | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self.standby = standby
        # Spares carry the launch marker, so shutdown finds them like any other process.
        spare_env = dict(os.environ)
        spare_env.update(self.extra_env)
        spare_env[MARKER_ENV] = self.marker
        self.pool = StandbyPool(standby, preload, env=spare_env)

    @staticmethod
    def _print_line(group: int, line: str) -> None:
        sys.stdout.write(f"[group {group}] {line}")
        sys.stdout.flush()

    def start(self) -> None:
        """Starts the lighthouse (if needed), the spares and every replica group.

        Raises:
            StandbyError: spares cannot start (a ``--preload`` module fails to import).
        """
        if self.standby:
            # Spares warm up while the lighthouse starts; a bad --preload fails here.
            self.pool.start()
            self.pool.wait_ready()
            logger.info("%d standby process(es) warm", self.pool.ready_count())
        if self.lighthouse_addr is None:
            self.lighthouse = LighthouseProcess(self.min_replicas, self.join_timeout_ms)
            self.lighthouse_addr = self.lighthouse.address
            logger.info("started lighthouse at %s", self.lighthouse_addr)
        for g in self.groups:
            self._spawn(g)

    def _group_env(self, g: GroupState) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(
            {
                "REPLICA_GROUP_ID": str(g.index),
                "NUM_REPLICA_GROUPS": str(self.replicas),
                "TORCHFT_LIGHTHOUSE": str(self.lighthouse_addr),
                MARKER_ENV: self.marker,
                "TORCHFT_LAUNCH_GROUP": str(g.index),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def _spawn(self, g: GroupState) -> None:
        if self.standby:
            self._spawn_ranks(g)
            return
        env = self._group_env(g)
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="torchft_launch_")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--log-dir",
            self.log_dir,
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(self.nproc_per_node),
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.1",
            self.script,
            *self.script_args,
        ]
        g.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        g.started_at = time.monotonic()
        g.start_times.append(g.started_at)
        g.exit_code = None
        pump = threading.Thread(
            target=self._pump, args=(g.index, g.proc), name=f"group-{g.index}-out", daemon=True
        )
        g.pumps = [pump]
        pump.start()

    def _spawn_ranks(self, g: GroupState) -> None:
        """Starts the group's ranks as torchrun's agent would, on warm spares when ready."""
        from torch._C._distributed_c10d import TCPStore

        # A fresh store per incarnation: nothing a dead incarnation wrote can be read.
        g.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        base = self._group_env(g)
        n = self.nproc_per_node
        base.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(g.store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "ROLE_NAME": "default",
                "ROLE_WORLD_SIZE": str(n),
                "TORCHELASTIC_RESTART_COUNT": str(g.restarts),
                "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                "TORCHELASTIC_RUN_ID": f"{self.marker}-{g.index}",
            }
        )
        g.ranks = []
        g.pumps = []
        g.warm = 0
        g.started_at = time.monotonic()
        g.start_times.append(g.started_at)
        g.exit_code = None
        for rank in range(n):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            # A spare still warming is ahead of a cold start by as long as it has warmed.
            spare = self.pool.take(warming=True)
            proc: subprocess.Popen[str] | None = None
            released: threading.Event | None = None
            if spare is not None:
                try:
                    proc = self.pool.promote(spare, [self.script, *self.script_args], env)
                    released = spare.released
                    g.warm += 1
                except StandbyError as e:
                    logger.warning("group %d rank %d: %s; starting it cold", g.index, rank, e)
            if proc is None:
                proc = subprocess.Popen(
                    [sys.executable, "-u", self.script, *self.script_args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            g.ranks.append(proc)
            pump = threading.Thread(
                target=self._pump,
                args=(g.index, proc, released),
                name=f"group-{g.index}-r{rank}",
                daemon=True,
            )
            g.pumps.append(pump)
            pump.start()
        g.proc = g.ranks[0]
        logger.info("group %d started: %d of %d rank(s) on warm standbys", g.index, g.warm, n)

    def _poll_ranks(self, g: GroupState) -> int | None:
        """With standbys: the group's exit code once it ended (None while it runs). A rank
        that fails ends the group (its other ranks are stopped), as under torchrun."""
        codes = [p.poll() for p in g.ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for p in g.ranks:
                if p.poll() is None:
                    kill_session(p)
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        return None

    def _pump(
        self, index: int, proc: subprocess.Popen[str], after: threading.Event | None = None
    ) -> None:
        """Hands a process's output lines to ``on_line``; with ``after`` (a spare promoted
        while warming), only once the pool has stopped reading the spare's warm-up output."""
        if after is not None:
            after.wait()
        stdout = proc.stdout
        if stdout is None:
            return
        for line in stdout:
            try:
                self.on_line(index, line)
            except Exception:  # a broken handler must not stop the output pump
                logger.exception("output handler failed")

    def group_pids(self, index: int) -> list[int]:
        """PIDs of the training workers of group ``index`` (not the torchrun agent)."""
        g = self.groups[index]
        if self.standby:
            return [p.pid for p in g.ranks if p.poll() is None]
        agent = g.proc.pid if g.proc else -1
        pids = []
        for pid in _pids_with_marker(self.marker):
            if pid == agent:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"TORCHFT_LAUNCH_GROUP={index}".encode() in env:
                pids.append(pid)
        return pids

    def output_pumps(self, index: int) -> list[threading.Thread]:
        """The threads handing the running incarnation's output lines of group ``index`` to
        ``on_line``. Each ends once its process's output is closed and every line it wrote
        has been handled: joining them after a fatal signal is how a caller knows no line
        from before the kill is still to come."""
        with self._lock:
            return list(self.groups[index].pumps)

    def kill_group(self, index: int, sig: int = signal.SIGKILL) -> list[int]:
        """Sends ``sig`` to the training workers of one group (fault injection)."""
        pids = self.group_pids(index)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def poll(self) -> bool:
        """Reaps exited groups and restarts failed ones; True once every group is done."""
        with self._lock:
            for g in self.groups:
                if g.finished or g.failed or g.proc is None:
                    continue
                code = self._poll_ranks(g) if self.standby else g.proc.poll()
                if code is None:
                    continue
                g.exit_code = code
                self._kill_leftovers(g.index)
                if code == 0:
                    g.finished = True
                    logger.info("group %d finished", g.index)
                elif self._stopping:
                    g.failed = True
                elif g.restarts < self.max_restarts:
                    g.restarts += 1
                    logger.warning(
                        "group %d exited with %d; restarting (%d/%d)",
                        g.index,
                        code,
                        g.restarts,
                        self.max_restarts,
                    )
                    self._spawn(g)
                else:
                    g.failed = True
                    logger.error("group %d exited with %d; no restarts left", g.index, code)
            return all(g.finished or g.failed for g in self.groups)

    def _kill_leftovers(self, index: int) -> None:
        g = self.groups[index]
        if self.standby:
            for p in g.ranks:
                kill_session(p)
            g.store = None
            return
        for pid in self.group_pids(index):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def run(self, timeout: float | None = None) -> int:
        """Supervises until every group is done (or ``timeout``); returns the exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self.poll():
                if deadline is not None and time.monotonic() > deadline:
                    logger.error("job did not finish within %ss", timeout)
                    return 124
                time.sleep(0.1)
        finally:
            self.shutdown()
        return 0 if all(g.finished for g in self.groups) else 1

    def shutdown(self, grace: float = 10.0) -> None:
        """Stops every group and the lighthouse; no process of this launch survives."""
        self._stopping = True
        self.pool.close()
        procs = [p for g in self.groups for p in (g.ranks if self.standby else [g.proc]) if p]
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_session(p)
        for pid in _pids_with_marker(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.lighthouse is not None:
            self.lighthouse.stop()
        if self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m torchft.launch",
        description="Run replica groups of a training script under torchrun, restarting "
        "groups that die.",
    )
    p.add_argument("--replicas", type=int, required=True, help="number of replica groups")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=3)
    p.add_argument("--lighthouse", default=None, help="existing lighthouse address")
    p.add_argument("--min-replicas", "--min_replicas", type=int, default=None)
    p.add_argument("--join-timeout-ms", "--join_timeout_ms", type=int, default=5000)
    p.add_argument(
        "--standby",
        type=int,
        default=0,
        help="warm spare processes to keep; a dead group's ranks are replaced by spares "
        "that have already imported torch and torchft (default 0: restart cold under torchrun)",
    )
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        help="module the spares import besides torch and torchft (repeatable)",
    )
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments after --")
    args = p.parse_args(argv)
    if args.script_args and args.script_args[0] == "--":
        args.script_args = args.script_args[1:]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torchft.launch``."""
    logging.basicConfig(level=logging.INFO, format="[torchft.launch] %(message)s")
    args = _parse(argv)
    try:
        launcher = Launcher(
            args.script,
            args.script_args,
            replicas=args.replicas,
            nproc_per_node=args.nproc_per_node,
            max_restarts=args.max_restarts,
            lighthouse=args.lighthouse,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            standby=args.standby,
            preload=args.preload,
        )
    except ValueError as e:
        print(f"torchft.launch: {e}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    try:
        launcher.start()
        return launcher.run()
    except KeyboardInterrupt:
        logger.info("interrupted; stopping every replica group")
        launcher.shutdown()
        return 130
    except StandbyError as e:
        launcher.shutdown()
        print(f"torchft.launch: standby processes cannot start: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        launcher.shutdown()
        print(f"torchft.launch: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
