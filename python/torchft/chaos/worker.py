"""One replica group of a chaos run (one rank): trains a small MLP and records its history.

Run by :mod:`torchft.chaos.harness` as ``python -m torchft.chaos.worker``; the store, the
lighthouse and the group name come from the environment as under torchrun (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHFT_LIGHTHOUSE``).

The history (see :mod:`torchft.chaos.history`) gets one JSON line per committed step: step,
quorum id, participants and the group's participating rank, a hash of the parameters and
optimizer state, whether a heal came before it, and the wall time; a ``restore`` line when
the Manager resumed from a durable snapshot (``TORCHFT_SNAPSHOT_DIR``, set by the harness)
with the step and state hash it resumed from; a ``finish`` line at the target step (written
to ``--target-file`` by the harness). ``--phase`` is a file whose first byte the worker
overwrites with its phase (``q`` quorum/compute, ``c`` commit vote, ``d`` the vote returned:
recording the step and the pause until the next one) so faults can aim at a phase. ``d`` is
followed by the vote's outcome (see :func:`voted`): a process killed before it wrote the
step's line still tells the goodput check what the step was
(:func:`torchft.chaos.goodput.voted`).

Faults that act inside the process arrive as files the harness writes, looked at on the top
of every step and removed when taken: ``--hang-file`` (block the loop), ``--slow-file`` (run
three times slower for a while) and ``--bitflip-file`` (flip one bit of the model in memory).
The Manager digests its committed state every ``--parity-every`` steps (runtime parity); a
Manager that finds its state diverged with no majority to heal from raises
``StateDivergedError``, and the worker exits with :data:`~torchft.chaos.history.DIVERGED_EXIT`.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from collections import deque
from datetime import timedelta

import torch
from torch import nn

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.chaos.goodput import voted
from torchft.chaos.history import DIVERGED_EXIT, RESTART_EXIT, HistoryWriter, state_hash
from torchft.manager import StateDivergedError, TornStateError

_IMPORTED = time.time()


def _read_target(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _take(path: str) -> str | None:
    """The content of a fault file, which is removed (None: absent, or taken already)."""
    try:
        with open(path) as f:
            text = f.read()
        os.remove(path)
    except OSError:
        return None
    return text


def _bitflip(path: str, model: nn.Module, history: HistoryWriter, step: int, every: int) -> None:
    """Flips one of the low 16 mantissa bits of one float32 element of one parameter, in
    place, as a memory error would: the step trains on from the flipped state. The file
    holds a seed for the choice, so a run's seed fixes it."""
    text = _take(path)
    if text is None:
        return
    try:
        rng = random.Random(int(text))
    except ValueError:
        rng = random.Random()
    params = [(n, p) for n, p in model.named_parameters() if p.dtype == torch.float32]
    name, param = rng.choice(params)
    index = rng.randrange(param.numel())
    bit = rng.randrange(16)
    with torch.no_grad():
        param.view(-1).view(torch.int32)[index] ^= 1 << bit
    history.bitflip(step, param=name, index=index, bit=bit, parity_every=every)


def _hang(path: str, history: HistoryWriter, step: int) -> None:
    """Blocks the training loop as a stuck input pipeline would (the process lives on)."""
    try:
        with open(path) as f:
            seconds = float(f.read())
        os.remove(path)
    except (OSError, ValueError):
        return  # being written, or taken already: the next step looks again
    history.hang(seconds, step)
    time.sleep(seconds)


def _slow(path: str, pace: _Pace, history: HistoryWriter, step: int) -> None:
    """Starts a slow period, as a throttled or shared machine would cause."""
    try:
        seconds = float(_take(path) or "")
    except ValueError:
        return  # taken already (the harness writes it whole)
    history.slow(seconds, step)
    pace.slow(seconds)


class _Pace:
    """The sleep after each step: ``--step-sleep`` times a jitter factor, plus, while an
    injected slow period lasts, twice the loop's normal step time (so it runs three times
    slower)."""

    #: The extra sleep of a slow step at most (a normal step that waited long for a quorum
    #: must not turn the slow loop into a hung one).
    MAX_EXTRA = 1.0

    def __init__(self, step_sleep: float, jitter: float) -> None:
        self.step_sleep = step_sleep
        self.jitter = jitter
        self.rng = random.Random()
        self.slow_until = 0.0
        self.normal: deque[float] = deque(maxlen=16)  # recent step times outside slow periods

    def slow(self, seconds: float) -> None:
        """Runs the loop three times slower for ``seconds`` from now."""
        self.slow_until = time.monotonic() + seconds

    def sleep(self, took: float) -> None:
        """Sleeps after a step whose work (without this sleep) took ``took`` seconds."""
        secs = self.step_sleep * self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        if time.monotonic() < self.slow_until:
            normal = statistics.median(self.normal) if self.normal else took + secs
            secs += min(2 * normal, self.MAX_EXTRA)
        else:
            self.normal.append(took + secs)
        if secs > 0:
            time.sleep(secs)


def _jitter(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's flags (see the module documentation)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", required=True)
    p.add_argument("--history", required=True)
    p.add_argument("--phase", required=True)
    p.add_argument("--target-file", required=True, help="holds the step to stop at, once set")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument(
        "--jitter",
        type=_jitter,
        default=0.0,
        help="each step's sleep is multiplied by a uniform random factor in [1-F, 1+F]",
    )
    p.add_argument(
        "--parity-every",
        type=int,
        default=100,
        help="runtime parity: the Manager digests its committed state every N steps "
        "(TORCHFT_PARITY_EVERY; 0: off)",
    )
    p.add_argument(
        "--hang-file",
        default=None,
        help="when this file exists at the top of a step, the loop blocks for the seconds it "
        "holds (removed first), while the process and its heartbeats live on",
    )
    p.add_argument(
        "--slow-file",
        default=None,
        help="when this file exists at the top of a step, the loop runs three times slower "
        "for the seconds it holds (removed first)",
    )
    p.add_argument(
        "--bitflip-file",
        default=None,
        help="when this file exists at the top of a step, one low mantissa bit of one model "
        "parameter is flipped in memory (the file, removed first, holds a seed for the choice)",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="level of the worker's own log lines (stderr, kept in the run directory)",
    )
    args = p.parse_args(argv)
    if args.parity_every < 0:
        p.error(f"--parity-every must be >= 0, got {args.parity_every}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Trains until the step in ``--target-file``; returns 0 when it got there."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s {args.group} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=args.min_replicas,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30),
        replica_id=args.group,
        parity_every=args.parity_every,
    )
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    history = HistoryWriter(args.history, args.group, os.getpid())
    history.ready(imported=_IMPORTED)
    phase = os.open(args.phase, os.O_WRONLY | os.O_CREAT, 0o644)
    pace = _Pace(args.step_sleep, args.jitter)
    healed = False  # a heal since the last commit (a heal's step may not commit)
    try:
        while True:
            target = _read_target(args.target_file)
            if target is not None and manager.current_step() >= target:
                break
            if args.hang_file and os.path.exists(args.hang_file):
                _hang(args.hang_file, history, manager.current_step())
            if args.slow_file and os.path.exists(args.slow_file):
                _slow(args.slow_file, pace, history, manager.current_step())
            if args.bitflip_file and os.path.exists(args.bitflip_file):
                step = manager.current_step()
                _bitflip(args.bitflip_file, model, history, step, args.parity_every)
            t0 = time.monotonic()
            os.pwrite(phase, b"q", 0)
            optim.zero_grad()
            # The data of a step depends only on the step: any group may take any step.
            gen = torch.Generator().manual_seed(manager.current_step())
            x = torch.randn(32, 16, generator=gen)
            y = torch.randint(0, 4, (32,), generator=gen)
            # torch leaves Tensor.backward unannotated.
            nn.functional.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
            os.pwrite(phase, b"c", 0)
            before = manager.current_step()
            optim.step()
            step_healed = manager._healer.healed
            tel = manager._telemetry
            last = tel.last_step if tel is not None else None
            # The rank's own measure of the step's quorum wait, and the instant its step
            # ended (for goodput: the history's step boundaries are the ones the reports'
            # step times are measured between, so a SIGSTOP between the vote and the line
            # below falls in the same step on both sides).
            ours = last if last is not None and last.step == before else None
            quorum_wait = ours.quorum_wait_s if ours is not None else None
            ended = round(ours.ended_unix_s if ours is not None else time.time(), 6)
            # Out of the vote: a kill from here on is no kill in the commit phase.
            os.pwrite(
                phase, voted(before, manager.current_step(), step_healed, quorum_wait, ended), 0
            )
            healed = healed or step_healed
            if manager.current_step() > before + 1:
                # A durable snapshot was restored (no group in the quorum held a step as
                # new): the state the group trains on from here, for the checker to compare
                # with the history, and the quorum whose answer chose it (the failed step
                # tore down the process group, so the healer remembers it, not the group).
                history.restore(
                    manager.current_step(),
                    state_hash(model.state_dict(), optim.state_dict()),
                    t=ended,
                    quorum_id=manager._healer.restore_quorum,
                )
            elif manager.current_step() == before + 1:
                history.commit(
                    step=before + 1,
                    quorum_id=manager._quorum_id,
                    participants=manager.num_participants(),
                    participating_rank=manager.participating_rank(),
                    state=state_hash(model.state_dict(), optim.state_dict()),
                    healed=healed,
                    quorum_wait=quorum_wait,
                    step_healed=step_healed,
                    t=ended,
                )
                healed = False
            else:
                history.discard(before, quorum_wait, step_healed, t=ended)
            pace.sleep(time.monotonic() - t0)
        history.finish(manager.current_step(), state_hash(model.state_dict(), optim.state_dict()))
    except TornStateError as e:
        # What a supervisor is for: the harness restarts a process that exits with this.
        logging.getLogger(__name__).error("%s", e)
        return RESTART_EXIT
    except StateDivergedError as e:
        # Runtime parity found this group's state diverged with no majority to heal from:
        # the process stops, and a supervisor restarts it (it heals from whoever is left).
        logging.getLogger(__name__).error("%s", e)
        return DIVERGED_EXIT
    finally:
        os.close(phase)
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
