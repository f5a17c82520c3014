"""The main job: replica groups training on CPU while one of them is killed and heals.

Starts ``torchft_lighthouse --min_replicas 2``, launches three replica groups of
``examples/train_ddp.py`` (each under its own torchrun, via :mod:`torchft.launch`), SIGKILLs one
group's trainer mid-run, lets the launcher restart it so it heals from a live peer, and prints a
summary: steps committed, failures injected, heal time, final loss and whether every group ended
with bit-identical model and optimizer state. Exits non-zero if any of that did not happen.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from torchft.eventlog import read_events, summarize
from torchft.launch import Launcher, LighthouseProcess

HERE = Path(__file__).resolve().parent
STEP_RE = re.compile(r"step=(\d+) loss=([\d.naninf]+) participants=(\d+) committed=(True|False)")


@dataclass
class GroupView:
    """What the demo has seen of one replica group's output."""

    step: int = 0
    loss: float = float("nan")
    participants: int = 0
    commits: int = 0
    failed_steps: int = 0
    first_commit_after_restart: float | None = None


def _replica_health(address: str) -> list[dict[str, object]] | None:
    """The lighthouse's per-replica view from /status (None if it did not answer)."""
    try:
        with urllib.request.urlopen(address + "/status", timeout=0.5) as r:
            return list(json.loads(r.read())["replicas"])
    except (OSError, ValueError, KeyError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0 when a group was killed, healed, and all ended identical."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument(
        "--kill-at", type=int, default=None, help="step at which to kill (default: steps/4)"
    )
    p.add_argument("--kill-group", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=270.0, help="give up after this many seconds")
    args = p.parse_args(argv)
    if args.replicas < 2:
        p.error("--replicas must be at least 2 (one is killed)")
    if not 0 <= args.kill_group < args.replicas:
        p.error("--kill-group must name one of the replica groups")
    kill_at = args.kill_at if args.kill_at is not None else args.steps // 4

    views = [GroupView() for _ in range(args.replicas)]
    lock = threading.Lock()
    restart_time: dict[int, float] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="torchft-demo-"))
    logs = {i: open(log_dir / f"group{i}.log", "a") for i in range(args.replicas)}

    def on_line(group: int, line: str) -> None:
        logs[group].write(line)
        logs[group].flush()
        m = STEP_RE.search(line)
        if not m:
            if "Traceback" in line or "Error" in line:
                sys.stdout.write(f"  [group {group}] {line}")
            return
        with lock:
            v = views[group]
            v.step = int(m.group(1))
            v.loss = float(m.group(2))
            v.participants = int(m.group(3))
            if m.group(4) == "True":
                v.commits += 1
                if group in restart_time and v.first_commit_after_restart is None:
                    v.first_commit_after_restart = time.monotonic() - restart_time[group]
                    print(
                        f"-> replica group {group} healed from a live peer and committed step "
                        f"{v.step}, {v.first_commit_after_restart:.1f}s after the kill"
                    )
            else:
                v.failed_steps += 1

    print(f"torchft demo: {args.replicas} replica groups, {args.steps} steps, CPU/Gloo")
    t0 = time.monotonic()
    event_log = log_dir / "events.jsonl"
    lighthouse = LighthouseProcess(min_replicas=2, join_timeout_ms=3000, event_log=str(event_log))
    print(
        f"lighthouse at {lighthouse.address} "
        f"(dashboard: {lighthouse.address}/ , JSON: /status, metrics: /metrics)"
    )
    health: list[dict[str, object]] = []
    result_file = str(log_dir / "result_{replica_group}_{rank}.json")
    launcher = Launcher(
        str(HERE / "train_ddp.py"),
        [
            "--steps",
            str(args.steps),
            "--step-sleep",
            str(args.step_sleep),
            "--result-file",
            result_file,
        ],
        replicas=args.replicas,
        nproc_per_node=1,
        max_restarts=2,
        lighthouse=lighthouse.address,
        on_line=on_line,
        env={"TORCHFT_RESULT_FILE": result_file},
    )
    killed: list[int] = []
    kill_step = None
    code = 1
    try:
        launcher.start()
        last_print = 0.0
        deadline = time.monotonic() + args.timeout
        while True:
            done = launcher.poll()
            now = time.monotonic()
            with lock:
                steps = [v.step for v in views]
            if not killed and min(steps) >= kill_at:
                pids = launcher.kill_group(args.kill_group, signal.SIGKILL)
                if pids:
                    killed = pids
                    kill_step = steps[args.kill_group]
                    restart_time[args.kill_group] = time.monotonic()
                    print(
                        f"-> SIGKILL replica group {args.kill_group} (pid {pids}) at step {kill_step}"
                    )
            if now - last_print >= 2.0 or done:
                last_print = now
                health = _replica_health(lighthouse.address) or health
                state = "  ".join(f"g{i}:{s}" for i, s in enumerate(steps))
                print(
                    f"[{now - t0:5.1f}s] steps {state}  restarts={launcher.groups[args.kill_group].restarts}"
                )
            if done:
                break
            if now > deadline:
                print(f"demo did not finish within {args.timeout}s; stopping")
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("interrupted")
    finally:
        launcher.shutdown()
        lighthouse.stop()
        for f in logs.values():
            f.close()

    results = []
    for i in range(args.replicas):
        path = Path(result_file.format(replica_group=i, rank=0))
        if path.exists():
            results.append(json.loads(path.read_text()))
    hashes = {r["state_hash"] for r in results}
    final_steps = {r["step"] for r in results}
    identical = len(results) == args.replicas and len(hashes) == 1 and len(final_steps) == 1
    healed = views[args.kill_group].first_commit_after_restart
    restarts = launcher.groups[args.kill_group].restarts

    print()
    print("==== torchft demo summary ====")
    print(f"replica groups          : {args.replicas}")
    print(
        f"steps committed         : {sorted(final_steps) if final_steps else 'none'} (target {args.steps})"
    )
    for i, v in enumerate(views):
        print(
            f"  group {i}: commits seen {v.commits}, discarded steps {v.failed_steps}, last loss {v.loss:.4f}"
        )
    print(
        f"failures injected       : {len(killed) and 1} SIGKILL of group {args.kill_group} at step {kill_step}"
    )
    print(f"group restarts          : {restarts}")
    print(
        "heal time               : "
        + (f"{healed:.1f}s from kill to first committed step" if healed else "not healed")
    )
    losses = [r["loss"] for r in results]
    print(
        f"final loss              : {min(losses):.4f}"
        if losses
        else "final loss              : n/a"
    )
    print(
        f"identical final state   : {'yes' if identical else 'NO'} ({len(hashes)} distinct hash(es) over {len(results)} groups)"
    )
    print("lighthouse's view (last /status before the end):")
    for r in health:
        c = r.get("counters", {})
        assert isinstance(c, dict)
        print(
            f"  {r['replica_id']}: {r['state']} at step {r['step']}, "
            f"incarnations {c.get('incarnations')}, lost {c.get('lost')}, heals {c.get('heals')}"
        )
    if event_log.exists():
        events, _ = read_events(event_log)
        summary = summarize(events)
        victim = summary["replicas"].get(f"train_ddp_{args.kill_group}") or {}
        walk = " -> ".join(t["to"] for t in victim.get("transitions", []))
        print(f"event log               : {len(events)} events; group {args.kill_group}: {walk}")
    ok = bool(killed) and restarts >= 1 and healed is not None and identical
    if ok:
        shutil.rmtree(log_dir, ignore_errors=True)
        print(f"wall time               : {time.monotonic() - t0:.1f}s")
    else:
        print(f"wall time               : {time.monotonic() - t0:.1f}s; logs kept in {log_dir}")
    code = 0 if ok else 1
    print("RESULT: " + ("OK" if ok else "FAILED"))
    return code


if __name__ == "__main__":
    sys.exit(main())
