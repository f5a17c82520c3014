"""Runs replica groups under a lighthouse daemon and injects random compound faults.

The supervisor starts the ``torchft_lighthouse`` daemon and N one-rank replica groups
(:mod:`torchft.chaos.worker`, each with its own TCPStore hosted here, as torchrun's agent
would), restarts every group that is killed after ``restart_delay``, and records each
process's start and exit. The injector draws faults with an exponential time between them
(``mtbf``) and weighted kinds (:data:`FAULT_KINDS`), records each one, then applies it. After
the last fault every group is resumed and trains to a common target; the offline checker
(:mod:`torchft.chaos.history`) then judges the recorded history.

A run is reproducible from its seed: the seed fixes the fault kinds, targets and times
(the processes' own timing still varies with the machine's load).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torch._C._distributed_c10d import TCPStore

from torchft.chaos.history import (
    DIVERGED_EXIT,
    HUNG_EXIT,
    RESTART_EXIT,
    Report,
    check,
    detection_window,
    read_jsonl,
)
from torchft.launch import _ADDRESS_RE, _find_lighthouse_cmd
from torchft.snapshot import list_snapshots
from torchft.standby import StandbyError, StandbyPool

#: Fault kinds and their default weights. Each kind is a method ``_fault_<kind>`` of
#: :class:`Chaos` returning the groups it hit, or None when it does not apply right now
#: (another kind is drawn). New kinds only need a method and a weight.
FAULT_KINDS: dict[str, float] = {
    "kill_one": 3.0,
    "kill_two": 1.0,
    "stop": 2.0,
    "kill_healing": 1.0,
    "kill_heal_source": 1.0,
    "kill_in_commit": 1.5,
    "kill_lighthouse": 0.5,
    "kill_all": 0.4,
    "hang": 1.0,
    "bitflip": 0.5,
    "slow": 0.5,
}


@dataclass
class ChaosConfig:
    """What a chaos run does."""

    seed: int
    groups: int = 3
    faults: int = 200
    mtbf: float = 1.5
    restart_delay: float = 0.5
    heartbeat_timeout_ms: int = 2000
    progress_wait_ms: int = 30000
    join_timeout_ms: int = 1000
    min_replicas: int = 1
    stop_range: tuple[float, float] = (1.0, 8.0)
    #: How long an injected hang blocks a group's training loop (its process lives on);
    #: sometimes longer than the hang timeout (10 s at the chaos pace), so it is cut out.
    hang_range: tuple[float, float] = (2.0, 25.0)
    #: How long an injected slow period makes a group's loop three times slower.
    slow_range: tuple[float, float] = (3.0, 15.0)
    #: Runtime parity interval of the groups' Managers (``TORCHFT_PARITY_EVERY``): small, so
    #: an injected bit flip is found within a few seconds.
    parity_every: int = 10
    #: Each step's sleep in the workers is multiplied by a random factor in [1-j, 1+j]
    #: (uneven group paces; no verdict may come of them).
    jitter: float = 0.0
    weights: dict[str, float] = field(default_factory=lambda: dict(FAULT_KINDS))
    finish_steps: int = 20
    timeout: float = 1800.0
    #: The daemon command (default: the ``torchft_lighthouse`` found like the launcher does;
    #: the Rust binary restarts in milliseconds, the Python console script in seconds).
    lighthouse_cmd: list[str] | None = None
    #: Also restart the lighthouse while a group is stopped (the lighthouse keeps its
    #: state file in the run directory, so the restarted one knows the progress of a group
    #: that is silent through its whole startup hold). Off: such restarts are skipped.
    restart_while_stopped: bool = True
    #: Spawns per floor measured for the report (import torch, and with torch._dynamo);
    #: 0 skips the measurement.
    floor_runs: int = 3
    #: Level of the workers' own log lines (their logs are kept in the run directory):
    #: INFO adds every reconfigure, heal and applied state, for reading a finding.
    worker_log_level: str = "WARNING"
    #: Warm standby processes (``torchft.standby``) kept for restarts; 0 restarts cold.
    standby: int = 0
    #: Durable snapshot interval of the groups (``TORCHFT_SNAPSHOT_EVERY``, into
    #: ``<run dir>/snapshots``); a ``kill_all`` resumes from them. 0: off.
    snapshot_every: int = 20

    def validate(self) -> None:
        """Raises ValueError on settings that cannot make a meaningful run."""
        if self.worker_log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(
                f"worker_log_level must be DEBUG, INFO, WARNING or ERROR, got {self.worker_log_level!r}"
            )
        if self.groups < 2:
            raise ValueError(f"groups must be at least 2, got {self.groups}")
        if self.faults < 0 or self.mtbf <= 0 or self.restart_delay < 0 or self.floor_runs < 0:
            raise ValueError("faults must be >= 0, mtbf > 0, restart_delay >= 0, floor_runs >= 0")
        unknown = set(self.weights) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {list(FAULT_KINDS)}")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError("at least one fault kind needs a positive weight")
        if self.parity_every < 0:
            raise ValueError(f"parity_every must be >= 0, got {self.parity_every}")
        if self.standby < 0:
            raise ValueError(f"standby must be >= 0, got {self.standby}")
        if self.snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0, got {self.snapshot_every}")
        if self.snapshot_every == 0 and self.weights.get("kill_all", 0) > 0:
            raise ValueError("kill_all faults need durable snapshots: snapshot_every > 0")
        if self.parity_every == 0 and self.weights.get("bitflip", 0) > 0:
            raise ValueError("bitflip faults need runtime parity: parity_every > 0")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")


# How much of a history file `_committed` reads, and what marks a commit record there.
_COMMIT_RECORD = b'"kind": "commit"'


@dataclass
class _Proc:
    group: str
    proc: subprocess.Popen[Any]
    store: TCPStore
    phase: Path
    started: float
    #: When the SIGKILL was sent (wall time): from then on the process runs no more code, so
    #: it can neither commit nor serve what it held, whenever its exit is reaped.
    killed_at: float | None = None

    @property
    def killed(self) -> bool:
        """Whether the supervisor has sent this process its SIGKILL."""
        return self.killed_at is not None


class Chaos:
    """One chaos run in ``run_dir`` (see the module documentation)."""

    def __init__(self, cfg: ChaosConfig, run_dir: Path, log: Callable[[str], None] = print):
        cfg.validate()
        self.cfg = cfg
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(cfg.seed)
        self.log = log
        self.names = [f"g{i}" for i in range(cfg.groups)]
        self.procs: dict[str, _Proc] = {}
        self.stopped: set[str] = set()
        self.lock = threading.RLock()
        self.closing = False
        self.target_file = self.dir / "target"
        # For `--check RUN_DIR`: the participant bound the run's groups committed under.
        (self.dir / "min_replicas").write_text(str(cfg.min_replicas))
        self.snapshots = self.dir / "snapshots"
        self._records: IO[str] = open(self.dir / "processes.jsonl", "a", buffering=1)  # noqa: SIM115
        self._faults: IO[str] = open(self.dir / "faults.jsonl", "a", buffering=1)  # noqa: SIM115
        self.lighthouse: subprocess.Popen[str] | None = None
        self.address = ""
        self._restarts: list[threading.Timer] = []
        # Per history file: whether it holds a commit record, and how far it was scanned.
        self._scanned: dict[Path, tuple[bool, int]] = {}
        #: Groups whose process ended and whose restart is scheduled but not started yet.
        self._restarting: set[str] = set()
        #: Per group, until when (wall time) an injected hang may still block its loop.
        self._hung_until: dict[str, float] = {}
        #: The run's best step when the last bit flip was injected (one flip at a time).
        self._flip_step: int | None = None
        spare_env = dict(os.environ)
        spare_env["OMP_NUM_THREADS"] = "1"  # as the workers' own (see _start_group)
        self.pool = StandbyPool(cfg.standby, env=spare_env)

    # ---- processes ---------------------------------------------------------------------

    def _record(self, f: IO[str], rec: dict[str, Any]) -> None:
        rec.setdefault("t", time.time())
        f.write(json.dumps(rec) + "\n")

    def _start_lighthouse(self, bind: str) -> None:
        cmd = (self.cfg.lighthouse_cmd or _find_lighthouse_cmd()) + [
            "--min_replicas",
            str(self.cfg.min_replicas),
            "--bind",
            bind,
            "--join_timeout_ms",
            str(self.cfg.join_timeout_ms),
            "--heartbeat_timeout_ms",
            str(self.cfg.heartbeat_timeout_ms),
            "--progress_wait_ms",
            str(self.cfg.progress_wait_ms),
            "--quorum_tick_ms",
            "50",
            "--event_log",
            str(self.dir / "events.jsonl"),
            "--state_file",
            str(self.dir / "lighthouse.state"),
        ]
        log = open(self.dir / "lighthouse.log", "a")  # noqa: SIM115 - owned by the thread
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            log.write(line)
            m = _ADDRESS_RE.search(line)
            if m:
                self.address = m.group(1)
                break
            if time.monotonic() > deadline:
                break
        if not self.address or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"lighthouse did not start; see {self.dir / 'lighthouse.log'}")

        def drain() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                log.write(line)
            log.close()

        threading.Thread(target=drain, name="chaos-lighthouse-log", daemon=True).start()
        self.lighthouse = proc

    def _start_group(self, group: str) -> None:
        with self.lock:
            self._restarting.discard(group)
            running = self.procs.get(group)
            if self.closing or (running is not None and running.proc.poll() is None):
                return  # closing, or already restarted (a timer and the final phase race)
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            n = sum(1 for p in self.dir.glob(f"{group}.*.history.jsonl"))
            tag = f"{group}.{n}"
            phase = self.dir / f"{tag}.phase"
            inherited = dict(os.environ)
            env = dict(
                inherited,
                RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                TORCHFT_LIGHTHOUSE=self.address,
                OMP_NUM_THREADS="1",
            )
            if self.cfg.snapshot_every:
                env["TORCHFT_SNAPSHOT_DIR"] = str(self.snapshots)
                env["TORCHFT_SNAPSHOT_EVERY"] = str(self.cfg.snapshot_every)
            cmd = [
                sys.executable,
                "-m",
                "torchft.chaos.worker",
                "--group",
                group,
                "--history",
                str(self.dir / f"{tag}.history.jsonl"),
                "--phase",
                str(phase),
                "--target-file",
                str(self.target_file),
                "--min-replicas",
                str(self.cfg.min_replicas),
                "--log-level",
                self.cfg.worker_log_level,
                "--hang-file",
                str(self.dir / f"{group}.hang"),
                "--slow-file",
                str(self.dir / f"{group}.slow"),
                "--bitflip-file",
                str(self.dir / f"{group}.bitflip"),
                "--parity-every",
                str(self.cfg.parity_every),
                "--jitter",
                str(self.cfg.jitter),
            ]
            (self.dir / f"{tag}.history.jsonl").touch()
            # Spares are kept for restarts: a group's first start is cold, so the spares are
            # still there when the faults begin. A restart takes a spare still warming when
            # none is ready (it is ahead of a cold start), as the launcher does.
            spare = self.pool.take(warming=True) if n > 0 else None
            proc: subprocess.Popen[Any] | None = None
            if spare is not None:
                try:
                    proc = self.pool.promote(
                        spare, cmd[2:], env, module=True, output=str(self.dir / f"{tag}.log")
                    )
                except StandbyError as e:
                    self.log(f"{group}: {e}; starting it cold")
            if proc is None:
                with open(self.dir / f"{tag}.log", "wb") as out:
                    proc = subprocess.Popen(
                        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
            self.procs[group] = _Proc(group, proc, store, phase, time.time())
            self._record(
                self._records,
                {"kind": "start", "group": group, "pid": proc.pid, "warm": spare is not None},
            )

    def _reap(self) -> None:
        """Records exits; schedules the restart of killed groups."""
        with self.lock:
            for group, p in list(self.procs.items()):
                rc = p.proc.poll()
                if rc is None:
                    continue
                del self.procs[group]
                self.stopped.discard(group)
                self._record(
                    self._records,
                    {
                        "kind": "exit",
                        "group": group,
                        "pid": p.proc.pid,
                        "rc": rc,
                        "killed": p.killed,
                        **({"killed_at": p.killed_at} if p.killed_at is not None else {}),
                    },
                )
                asked = rc in (RESTART_EXIT, HUNG_EXIT, DIVERGED_EXIT) and not p.killed
                if asked and not self.closing:
                    self.log(f"{group} (pid {p.proc.pid}) asked to be restarted; see its log")
                if (p.killed or asked) and not self.closing:
                    timer = threading.Timer(self.cfg.restart_delay, self._start_group, [group])
                    timer.daemon = True
                    self._restarting.add(group)
                    timer.start()
                    self._restarts.append(timer)
                elif rc != 0:
                    self.log(f"{group} (pid {p.proc.pid}) exited with {rc}; see its log")

    def _kill(self, group: str) -> None:
        p = self.procs.get(group)
        if p is None:
            return
        if p.killed_at is None:
            # Read before the signal goes out: nobody can see the process die before it.
            p.killed_at = time.time()
        try:
            os.killpg(p.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # ---- faults ------------------------------------------------------------------------

    def _running(self) -> list[str]:
        # A group killed a moment ago may not be reaped yet: it is not running.
        return sorted(g for g, p in self.procs.items() if g not in self.stopped and not p.killed)

    def _committed(self, group: str) -> bool:
        """Whether the group's current process is alive and has committed a step (its history
        holds a commit record, not only the ``ready`` record written at start-up). A process
        killed but not reaped yet does not count: the final phase would otherwise set the
        target while the group's replacement has not joined, and the others could finish and
        leave before it heals."""
        p = self.procs.get(group)
        if p is None or p.killed or p.proc.poll() is not None:
            return False
        n = self.dir / f"{group}.{self._incarnation(group)}.history.jsonl"
        # Records are appended in order: the file is scanned once, from where the last look
        # ended (steps that did not commit may come before the first commit).
        seen, offset = self._scanned.get(n, (False, 0))
        if seen:
            return True
        try:
            with open(n, "rb") as f:
                f.seek(max(0, offset - len(_COMMIT_RECORD)))
                tail = f.read()
        except FileNotFoundError:
            return False
        seen = _COMMIT_RECORD in tail
        self._scanned[n] = (seen, offset + len(tail) - min(offset, len(_COMMIT_RECORD)))
        return seen

    def _last_step(self, group: str) -> int:
        """The last step the group's current process recorded as committed (0: none)."""
        path = self.dir / f"{group}.{self._incarnation(group)}.history.jsonl"
        if not path.exists():
            return 0
        steps = [r["step"] for r in read_jsonl(path) if r["kind"] == "commit"]
        return max(steps, default=0)

    def _incarnation(self, group: str) -> int:
        return sum(1 for _ in self.dir.glob(f"{group}.*.history.jsonl")) - 1

    def _fault(self, kind: str, groups: list[str], **detail: Any) -> None:
        if kind.startswith("kill_") and kind not in ("kill_lighthouse", "kill_all"):
            # Whether the kill takes the last live holders of the best step: the injector
            # keeps a running group that has committed, not one at the best step, so such
            # a kill makes a regression unavoidable (the checker asks for the reason).
            steps = {g: self._last_step(g) for g in self.procs if not self.procs[g].killed}
            detail["best"] = max(steps.values(), default=0)
            detail["best_left"] = max((st for g, st in steps.items() if g not in groups), default=0)
        self._record(self._faults, {"kind": "fault", "fault": kind, "groups": groups, **detail})

    def _spares(self, victims: list[str]) -> bool:
        """True if, without ``victims``, a running group that committed in its current
        incarnation remains (the injector never kills the last holder of the progress:
        that regression would be unavoidable, not a finding)."""
        return any(self._committed(g) for g in self._running() if g not in victims)

    def _kill_spared(self, kind: str, victims: list[str]) -> list[str] | None:
        """Kills ``victims`` as a fault of ``kind`` unless that leaves no running group that
        committed (:meth:`_spares`); returns them, or None when nothing was killed."""
        if not self._spares(victims):
            return None
        self._fault(kind, victims)
        for g in victims:
            self._kill(g)
        return victims

    def _fault_kill_one(self) -> list[str] | None:
        running = self._running()
        if len(running) < 2:
            return None
        return self._kill_spared("kill_one", [self.rng.choice(running)])

    def _fault_kill_two(self) -> list[str] | None:
        running = self._running()
        if len(running) < 3:
            return None
        return self._kill_spared("kill_two", self.rng.sample(running, 2))

    def _fault_stop(self) -> list[str] | None:
        running = self._running()
        if len(running) < 2:
            return None
        g = self.rng.choice(running)
        secs = self.rng.uniform(*self.cfg.stop_range)
        p = self.procs[g]
        self._fault("stop", [g], seconds=round(secs, 2))
        self.stopped.add(g)
        os.killpg(p.proc.pid, signal.SIGSTOP)

        def resume() -> None:
            with self.lock:
                self.stopped.discard(g)
                if self.procs.get(g) is p:
                    try:
                        os.killpg(p.proc.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass

        timer = threading.Timer(secs, resume)
        timer.daemon = True
        timer.start()
        self._restarts.append(timer)
        return [g]

    def _loop_fault(self, kind: str, seconds: tuple[float, float]) -> tuple[str, float] | None:
        """Tells one running group's loop, through its ``{group}.{kind}`` file, to act for a
        random time in ``seconds`` (a hang or a slow period: the process lives on); None when
        fewer than two groups run or that group's last file was not taken yet."""
        running = [g for g in self._running() if g not in self.stopped]
        if len(running) < 2:
            return None
        g = self.rng.choice(running)
        path = self.dir / f"{g}.{kind}"
        if path.exists():
            return None  # the last one was not taken yet
        secs = self.rng.uniform(*seconds)
        self._fault(kind, [g], seconds=round(secs, 2))
        self._write_fault_file(path, f"{secs:.2f}")
        return g, secs

    def _fault_hang(self) -> list[str] | None:
        """Blocks a group's training loop while its process (and heartbeats) lives on."""
        hit = self._loop_fault("hang", self.cfg.hang_range)
        if hit is None:
            return None
        g, secs = hit
        # Taken at the group's next step (a step may wait for a quorum): a margin.
        self._hung_until[g] = time.time() + secs + 5.0
        return [g]

    def _write_fault_file(self, path: Path, text: str) -> None:
        """Writes a fault file whole (the worker reads it at the top of a step)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def _fault_slow(self) -> list[str] | None:
        """Makes a group's loop three times slower for a while (its process is healthy)."""
        hit = self._loop_fault("slow", self.cfg.slow_range)
        return None if hit is None else [hit[0]]

    def _fault_bitflip(self) -> list[str] | None:
        """Flips one bit of one group's model in memory; runtime parity must find and heal
        it. Only while every group is alive and training (the flipped group is then a
        minority of one), and one flip at a time (the last one's detection window over)."""
        now = time.time()
        if any(
            g not in self.procs
            or g in self.stopped
            or not self._committed(g)
            or self._hung_until.get(g, 0.0) > now
            or (self.dir / f"{g}.hang").exists()
            or (self.dir / f"{g}.bitflip").exists()
            for g in self.names
        ):
            return None
        best = max(self._steps())
        if self._flip_step is not None and best <= self._flip_step + detection_window(
            self.cfg.parity_every
        ):
            return None
        g = self.rng.choice(self.names)
        self._flip_step = best
        self._fault("bitflip", [g], best_step=best)
        self._write_fault_file(self.dir / f"{g}.bitflip", str(self.rng.randrange(1 << 31)))
        return [g]

    def _healing(self) -> list[str]:
        """Running groups that started recently and have not committed yet (joining/healing)."""
        now = time.time()
        return [
            g
            for g in self._running()
            if not self._committed(g) and now - self.procs[g].started < 10
        ]

    def _fault_kill_healing(self) -> list[str] | None:
        healing = self._healing()
        if not healing or len(self._running()) < 2:
            return None
        return self._kill_spared("kill_healing", [self.rng.choice(healing)])

    def _fault_kill_heal_source(self) -> list[str] | None:
        if not self._healing():
            return None
        sources = [g for g in self._running() if self._committed(g)]
        if len(sources) < 1 or len(self._running()) < 2:
            return None
        return self._kill_spared("kill_heal_source", [self.rng.choice(sources)])

    def _fault_kill_in_commit(self) -> list[str] | None:
        running = [g for g in self._running() if self._committed(g)]
        if len(running) < 1 or len(self._running()) < 2:
            return None
        g = self.rng.choice(running)
        if not self._spares([g]):
            return None
        p = self.procs[g]
        deadline = time.monotonic() + 1.0
        in_commit = False
        while time.monotonic() < deadline and not in_commit:
            if self._phase(p) == b"c":
                # Seen in the vote; whether it still is when the kill lands is known only
                # with the process held still: stopped, its phase can no longer change.
                in_commit = self._pause(p) and self._phase(p) == b"c"
                if not in_commit:
                    self._resume(p)
            if not in_commit:
                time.sleep(0.001)
        # Recorded as what it was: a kill in the commit phase only if the worker was held
        # stopped inside it (a slow or stopped worker may not reach it within the second, and
        # one seen there a moment ago may have left it), else a plain kill.
        self._fault("kill_in_commit" if in_commit else "kill_one", [g])
        self._kill(g)
        return [g]

    @staticmethod
    def _phase(p: _Proc) -> bytes:
        """The worker's current phase byte (``q``, ``c`` or ``d``; empty if unreadable)."""
        try:
            return p.phase.read_bytes()[:1]
        except OSError:
            return b""

    @staticmethod
    def _state(p: _Proc) -> str | None:
        """The worker's main thread's state letter in /proc (None if unreadable)."""
        try:
            stat = Path(f"/proc/{p.proc.pid}/stat").read_text()
            # The state field follows the parenthesised command name.
            return stat.rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None

    @classmethod
    def _is_stopped(cls, p: _Proc) -> bool:
        """Whether the worker is stopped (job control)."""
        return cls._state(p) in ("T", "t")

    @classmethod
    def _pause(cls, p: _Proc) -> bool:
        """SIGSTOPs the worker and waits until its main thread is stopped (the signal is
        delivered asynchronously); False if it could not be confirmed within 0.5 s."""
        try:
            os.killpg(p.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return False
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            state = cls._state(p)
            if state is None:
                return False
            if state in ("T", "t"):
                return True
            time.sleep(0.0002)
        return False

    @staticmethod
    def _resume(p: _Proc) -> None:
        try:
            os.killpg(p.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _fault_kill_all(self) -> list[str] | None:
        """Every group SIGKILLed at once (a rack lost, the job preempted); sometimes the
        lighthouse with them, and sometimes its state file deleted too. The groups restart
        as usual and resume from the newest complete durable snapshot."""
        # Groups still restarting from an earlier kill are dead already; the others die now.
        groups = sorted(self.procs)
        if not any(self._committed(g) for g in groups):
            return None
        if not list_snapshots(self.snapshots):
            return None  # nothing to resume from yet: a regression to 0 is no finding
        with_lighthouse = self.rng.random() < 0.4
        wipe = with_lighthouse and self.rng.random() < 0.5
        down = self.rng.uniform(0.2, 1.5)
        # The best step of the processes that die now (not of earlier lives: a total loss
        # may follow another one).
        best = max(self._last_step(g) for g in groups)
        for g in groups:
            self._kill(g)
            self.stopped.discard(g)  # a stopped group dies too (SIGKILL needs no SIGCONT)
        for g in groups:
            self.procs[g].proc.wait(timeout=30)
        # Recorded once they are dead: every commit line after this is a new process's.
        t_kill = time.time()
        best = max([best] + [self._last_step(g) for g in groups])
        if with_lighthouse:
            assert self.lighthouse is not None
            self.lighthouse.kill()
            self.lighthouse.wait()
            if wipe:
                (self.dir / "lighthouse.state").unlink(missing_ok=True)
        # The writers are dead: what is complete now is what the restarted groups can use.
        snaps = list_snapshots(self.snapshots)
        self._record(
            self._faults,
            {
                "kind": "fault",
                "fault": "kill_all",
                "groups": groups,
                "t": t_kill,
                "best_step": best,
                "snapshot_step": snaps[0].step if snaps else 0,
                "snapshot_every": self.cfg.snapshot_every,
                "lighthouse": with_lighthouse,
                "state_file_deleted": wipe,
            },
        )
        if with_lighthouse:
            port = self.address.rsplit(":", 1)[1]
            time.sleep(down)
            self.address = ""
            self._start_lighthouse(f"127.0.0.1:{port}")
        return groups

    def _fault_kill_lighthouse(self) -> list[str] | None:
        assert self.lighthouse is not None
        if self.stopped and not self.cfg.restart_while_stopped:
            return None
        port = self.address.rsplit(":", 1)[1]
        down = self.rng.uniform(0.2, 1.5)
        self._fault("kill_lighthouse", [], down_s=round(down, 2))
        self.lighthouse.kill()
        self.lighthouse.wait()
        time.sleep(down)
        self.address = ""
        self._start_lighthouse(f"127.0.0.1:{port}")
        return []

    # ---- the run -----------------------------------------------------------------------

    def run(self) -> Report:
        """Runs the whole chaos run and returns the checker's report."""
        cfg = self.cfg
        t0 = time.monotonic()
        self.log(
            f"chaos seed {cfg.seed}: {cfg.groups} groups, {cfg.faults} faults, mtbf "
            f"{cfg.mtbf}s, parity every {cfg.parity_every} steps, jitter {cfg.jitter}, "
            f"run dir {self.dir}"
        )
        kinds = [k for k, w in cfg.weights.items() if w > 0]
        weights = [cfg.weights[k] for k in kinds]
        try:
            if cfg.standby:
                self.pool.start()
                self.pool.wait_ready()
            self._start_lighthouse("127.0.0.1:0")
            for g in self.names:
                self._start_group(g)
            self._wait(lambda: all(self._committed(g) for g in self.names), 120, "first commits")
            if cfg.floor_runs:
                self._measure_floor(cfg.floor_runs)
            done = 0
            # A bit flip drawn while not every group trains waits for the first moment all
            # do (with faults every MTBF that moment is rare; skipping would starve the kind).
            flip_wanted = False
            while done < cfg.faults:
                pause = self.rng.expovariate(1.0 / cfg.mtbf)
                self._sleep_reaping(pause)
                if flip_wanted:
                    with self.lock:
                        hit = self._fault_bitflip()
                    if hit is not None:
                        flip_wanted = False
                        done += 1
                        continue
                for _ in range(10):
                    kind = self.rng.choices(kinds, weights)[0]
                    with self.lock:
                        hit = getattr(self, f"_fault_{kind}")()
                    if hit is not None:
                        done += 1
                        break
                    if kind == "bitflip":
                        flip_wanted = True
                if time.monotonic() - t0 > cfg.timeout:
                    raise TimeoutError(f"chaos run exceeded {cfg.timeout}s")
                if done and done % 25 == 0:
                    self.log(f"[{time.monotonic() - t0:6.1f}s] {done} faults")
            # Resume and let every group catch up, then train to a common target.
            with self.lock:
                for timer in self._restarts:
                    timer.cancel()
                for g, p in self.procs.items():
                    # Every group, not only those a stop fault holds: a process found stopped
                    # without one would hold the run's end until its timeout. Said, since it
                    # means the harness lost track of a stop.
                    if g not in self.stopped and self._is_stopped(p):
                        self.log(f"{g} (pid {p.proc.pid}) found stopped with no stop in force")
                    try:
                        os.killpg(p.proc.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass  # killed meanwhile: reaped and restarted below
                self.stopped.clear()
                for g in self.names:  # a flip not taken yet is not applied at all
                    (self.dir / f"{g}.bitflip").unlink(missing_ok=True)
            self._sleep_reaping(0.1)
            for g in self.names:
                if g not in self.procs:
                    self._start_group(g)
            self._wait(lambda: all(self._committed(g) for g in self.names), 180, "recovery")
            best = max(self._steps())
            target = best + cfg.finish_steps
            flips = [r["step"] for r in self._records_of("bitflip")]
            if flips:
                # Past the last flip's detection window: the groups must agree by then.
                target = max(target, max(flips) + detection_window(cfg.parity_every) + 1)
            self.target_file.write_text(str(target))
            # A process that asked to be restarted in this phase (e.g. a divergence stop)
            # has not finished: its group's restart still has to.
            self._wait(
                lambda: not self.procs and not self._restarting, 300, "every group to finish"
            )
            self.log(f"[{time.monotonic() - t0:6.1f}s] all groups finished at step {target}")
            # The checker judges the lighthouse's goodput: give it time to log its final
            # figure (a missing one is a violation, not an aborted run).
            end = time.monotonic() + 30
            while not self._final_goodput() and time.monotonic() < end:
                self._sleep_reaping(0.2)
        finally:
            self.close()
        return check(self.dir, target, cfg.min_replicas, self.names)

    def _measure_floor(self, runs: int) -> None:
        """The floors under the run's own load (groups training), for the report: median
        over a few spawns of spawn -> ``import torch`` done, and of spawn -> ``import torch,
        torch._dynamo`` done (what torch imports before any training step: building an
        optimizer imports dynamo). Written to ``floor.json``."""
        floors = {}
        env = dict(os.environ)  # inherited like the groups' environment
        env["OMP_NUM_THREADS"] = "1"
        for name, modules in (("import_s", "torch"), ("torch_s", "torch, torch._dynamo")):
            took = []
            for _ in range(runs):
                t0 = time.time()
                out = subprocess.run(
                    [sys.executable, "-c", f"import time, {modules}; print(time.time())"],
                    check=True,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                ).stdout
                took.append(float(out.strip().splitlines()[-1]) - t0)
                self._reap()
            floors[name] = sorted(took)[len(took) // 2]
        (self.dir / "floor.json").write_text(json.dumps(floors))
        self.log(
            f"floors under load: import torch {floors['import_s']:.2f}s, with torch._dynamo "
            f"{floors['torch_s']:.2f}s"
        )

    def _final_goodput(self) -> bool:
        """Whether the lighthouse logged its final goodput event (every group finished)."""
        path = self.dir / "events.jsonl"
        if not path.exists():
            return False
        with open(path) as f:
            return any('"kind":"goodput"' in line and '"final":true' in line for line in f)

    def _records_of(self, kind: str) -> list[dict[str, Any]]:
        """Every process's history records of ``kind``."""
        recs = []
        for p in self.dir.glob("*.history.jsonl"):
            recs += [r for r in read_jsonl(p) if r["kind"] == kind]
        return recs

    def _steps(self) -> list[int]:
        return [0] + [r["step"] for r in self._records_of("commit")]

    def _sleep_reaping(self, secs: float) -> None:
        end = time.monotonic() + secs
        while True:
            self._reap()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise TimeoutError(f"chaos run: timed out waiting for {what}")
            self._sleep_reaping(0.1)

    def close(self) -> None:
        """Ends every process this run started (and records the exits)."""
        self.pool.close()
        with self.lock:
            self.closing = True
            for timer in self._restarts:
                timer.cancel()
            for p in self.procs.values():
                if p.proc.poll() is None:
                    self._kill(p.group)
        for p in list(self.procs.values()):
            p.proc.wait(timeout=30)
        self._reap()
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            self.lighthouse.terminate()
            try:
                self.lighthouse.wait(10)
            except subprocess.TimeoutExpired:
                self.lighthouse.kill()
                self.lighthouse.wait()
        self._records.close()
        self._faults.close()
