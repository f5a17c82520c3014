"""Where the time of a restarted replica group goes, next to two baselines (same run).

A long-running group trains under an in-process lighthouse. A fresh group process is then
started R times (each one like a restart after a kill) and timestamps its phases: interpreter
start + ``import torch``/``torchft``, ``Manager`` construction, model + DDP + optimizer
setup, first quorum (including the heal from the running group), first commit. Every
timestamp is taken inside the process, so interpreter exit is never counted.

Baselines, measured in the same run and the same way (spawn -> timestamp in the child):

- import floor: a process that only runs ``import torch``;
- torch floor: a process that runs ``import torch`` and ``import torch._dynamo``. torch
  imports dynamo (with inductor and sympy; about three quarters of an ``import torch`` again)
  on the first construction of any ``torch.optim`` optimizer (``add_param_group`` is wrapped
  by ``torch._disable_dynamo``) and of torch's DDP, so every training process pays it before
  its first step, with or without torchft;
- plain torch DDP: a process that imports torch, builds the same model with torch's own
  ``DistributedDataParallel`` on a one-rank Gloo group and AdamW, and completes one step.

Prints medians with min and max over ``--runs`` and the overheads (target: process start -> first commit <= floor + 0.5 s;
against the bare import floor the torch._dynamo import alone exceeds that, so the torch floor
is the one the target can be met against).

Then kill -> first commit of the replacement, the way the launcher recovers a group (the
running group's process is SIGKILLed; its death is noticed by polling every 0.1 s, as
``torchft.launch`` does; the replacement heals from the steady group and commits), in
alternating rounds:

- cold: a fresh process, as a restart without standbys;
- standby: a warm spare of :class:`torchft.standby.StandbyPool` promoted to the dead
  process's identity (the pool starts warming the next spare at once, on the same cores);
- plain torch DDP restart, for reference: spawn -> first step of the plain DDP script above.

Target: standby median <= 1.0 s + the heal transfer (the ``healed`` log line's duration,
measured in the same runs). Exits non-zero when it is missed.

Usage: ``python benches/restart_phases.py [--runs R]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = "TORCHFT_BENCH_RESTART_CHILD"

IMPORT_FLOOR = "import time, torch; print(time.time())"
TORCH_FLOOR = "import time, torch, torch._dynamo; print(time.time())"

PLAIN_DDP = """
import time
import torch
from torch import nn
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
ddp = nn.parallel.DistributedDataParallel(model)
optim = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
optim.zero_grad()
ddp(torch.randn(8, 16)).sum().backward()
optim.step()
print(time.time())
dist.destroy_process_group()
"""


def child() -> None:
    """One restarted group: reports the wall time of each phase as JSON on stdout."""
    t = {"exec": float(os.environ["TORCHFT_BENCH_T0"])}
    from datetime import timedelta

    import torch
    from torch import nn

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    t["imported"] = time.time()
    torch.set_num_threads(1)
    if os.environ.get("BENCH_LOG_HEAL"):
        import logging

        class HealTime(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "healed to step" in str(record.msg) and len(record.args or ()) >= 4:
                    t["heal_s"] = float(record.args[3])  # type: ignore[index]

        log = logging.getLogger("torchft.manager")
        log.setLevel(logging.INFO)
        log.addHandler(HealTime())
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        timeout=timedelta(seconds=10),
        replica_id=os.environ["BENCH_GROUP"],
    )
    t["manager"] = time.time()
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    t["ddp"] = time.time()
    stop = os.environ.get("BENCH_STOP_AFTER_COMMIT") == "1"
    while True:
        optim.zero_grad()
        manager.wait_quorum() if "quorum" in t else None
        loss = ddp(torch.randn(8, 16)).sum()
        loss.backward()
        t.setdefault("quorum", time.time())
        if optim.step() is not False and manager.current_step() > 0 and "commit" not in t:
            if manager.errored() is None:
                t["commit"] = time.time()
                t["dynamo_imported"] = "torch._dynamo" in sys.modules
                print(json.dumps(t), flush=True)
                if stop:
                    break
        time.sleep(0.02)
    manager.shutdown(wait=False)


def child_env(
    group: str, store_port: int, lighthouse: str, stop: bool, t0: float
) -> dict[str, str]:
    return dict(
        os.environ,
        **{CHILD: "1"},
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        TORCHFT_LIGHTHOUSE=lighthouse,
        OMP_NUM_THREADS="1",
        BENCH_GROUP=group,
        BENCH_STOP_AFTER_COMMIT="1" if stop else "0",
        TORCHFT_BENCH_T0=repr(t0),
    )


def spawn(group: str, store_port: int, lighthouse: str, stop: bool) -> subprocess.Popen[str]:
    env = child_env(group, store_port, lighthouse, stop, time.time())
    return subprocess.Popen([sys.executable, __file__], env=env, stdout=subprocess.PIPE, text=True)


def time_script(code: str) -> float:
    """Spawn -> the wall time the script prints, in seconds."""
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    ).stdout
    return float(out.strip().splitlines()[-1]) - t0


def _first_json(proc: subprocess.Popen[str], timeout: float) -> dict[str, float]:
    """The phase record a child prints at its first commit (its other output is skipped)."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child {proc.pid} exited with {proc.wait()} before committing")
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"child {proc.pid} did not commit within {timeout}s")


def kill_to_commit(lighthouse: str, runs: int) -> tuple[list[float], list[float], list[float]]:
    """Alternating cold and standby recoveries of one group; returns the kill -> first commit
    times of each arm and the heal durations seen."""
    from torch.distributed import TCPStore

    from torchft.standby import StandbyPool

    pool = StandbyPool(1, env=dict(os.environ, OMP_NUM_THREADS="1"))
    pool.start()
    cold: list[float] = []
    warm: list[float] = []
    heals: list[float] = []
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    victim = subprocess.Popen(
        [sys.executable, __file__],
        env=child_env("recovering", store.port, lighthouse, False, time.time()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _first_json(victim, 120)
        for i in range(2 * runs):
            standby = i % 2 == 1
            pool.wait_ready(180)  # neither arm competes with a spare still warming
            time.sleep(0.5)
            t0 = time.time()
            os.killpg(victim.pid, 9)
            while victim.poll() is None:  # the launcher's monitor interval
                time.sleep(0.1)
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            env = child_env("recovering", store.port, lighthouse, False, t0)
            env["BENCH_LOG_HEAL"] = "1"
            spare = pool.take() if standby else None
            if spare is not None:
                victim = pool.promote(spare, [__file__], env)
            else:
                assert not standby, "no spare was ready"
                victim = subprocess.Popen(
                    [sys.executable, __file__],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            ph = _first_json(victim, 120)
            (warm if standby else cold).append(ph["commit"] - t0)
            if ph.get("heal_s") is not None:
                heals.append(ph["heal_s"])
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, 9)
            victim.wait()
        pool.close()
    return cold, warm, heals


def _spread(xs: list[float]) -> str:
    return (
        f"median {statistics.median(xs):.3f}s (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"
    )


def main() -> int:
    """Runs the measurement and prints the table; exit 1 when the standby target is missed."""
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5, help="restarts and rounds per arm (>= 5)")
    args = p.parse_args()
    if args.runs < 5:
        p.error("--runs must be >= 5 (a median and a spread)")
    from torch.distributed import TCPStore

    from torchft._torchft import LighthouseServer

    lh = LighthouseServer("127.0.0.1:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    runner = spawn("steady", stores[0].port, lh.address(), stop=False)
    try:
        assert runner.stdout is not None
        runner.stdout.readline()  # it committed: the job is running
        floors, torch_floors, plain, phases = [], [], [], []
        for _ in range(args.runs):
            floors.append(time_script(IMPORT_FLOOR))
            torch_floors.append(time_script(TORCH_FLOOR))
            plain.append(time_script(PLAIN_DDP))
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            c = spawn("restarted", store.port, lh.address(), stop=True)
            out, _ = c.communicate(timeout=120)
            phases.append(json.loads(out.strip().splitlines()[-1]))
        med = statistics.median
        floor, torch_floor, base = med(floors), med(torch_floors), med(plain)
        rows = {
            "interpreter + imports": [ph["imported"] - ph["exec"] for ph in phases],
            "Manager": [ph["manager"] - ph["imported"] for ph in phases],
            "model + DDP + optimizer": [ph["ddp"] - ph["manager"] for ph in phases],
            "first quorum + heal": [ph["quorum"] - ph["ddp"] for ph in phases],
            "first commit": [ph["commit"] - ph["quorum"] for ph in phases],
        }
        totals = [ph["commit"] - ph["exec"] for ph in phases]
        total = med(totals)
        ours = [(ph["manager"] - ph["imported"]) + (ph["commit"] - ph["ddp"]) for ph in phases]
        print(f"restart phases over {args.runs} restarts (load {os.getloadavg()[0]:.1f})")
        print(f"  import floor (spawn -> import torch done): {_spread(floors)}")
        print(
            f"  torch floor (+ import torch._dynamo, as torch.optim does): {_spread(torch_floors)}"
            f" = floor + {torch_floor - floor:.3f}s"
        )
        print(
            f"  plain torch DDP (spawn -> first step done): {_spread(plain)}"
            f" = floor + {base - floor:.3f}s"
        )
        for k, v in rows.items():
            print(f"  {k:<24} {_spread(v)}")
        print(f"  process start -> first commit: {_spread(totals)} = floor + {total - floor:.3f}s")
        print(f"    = torch floor + {total - torch_floor:.3f}s")
        print(f"    = plain torch DDP + {total - base:.3f}s")
        print(
            f"  torchft's own phases (Manager, first quorum + heal, first commit): {_spread(ours)}"
        )
        dynamo = sum(bool(ph.get("dynamo_imported")) for ph in phases)
        print(f"  restarts that imported torch._dynamo before their first commit: {dynamo}")

        cold, warm, heals = kill_to_commit(lh.address(), args.runs)
        heal = statistics.median(heals) if heals else 0.0
        target = 1.0 + heal
        print(f"kill -> first commit of the replacement ({args.runs} rounds per arm, alternating)")
        print(f"  cold restart:             {_spread(cold)}")
        print(f"  warm standby:             {_spread(warm)}")
        print(f"  plain torch DDP restart:  {_spread(plain)} (spawn -> first step)")
        print(f"  heal transfer:            {_spread(heals) if heals else 'none logged'}")
        ok = statistics.median(warm) <= target
        print(
            f"  target standby <= 1.0 s + heal = {target:.3f}s: "
            f"{'met' if ok else 'MISSED'} ({statistics.median(cold) / statistics.median(warm):.1f}x "
            "faster than cold)"
        )
    finally:
        runner.kill()
        runner.wait()
        lh.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    if os.environ.get(CHILD):
        child()
    else:
        sys.exit(main())
