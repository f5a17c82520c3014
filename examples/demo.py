"""The main job: replica groups training on CPU while one of them is killed and heals, then
every group is killed at once and the job resumes from its durable snapshot.

Starts ``torchft_lighthouse --min_replicas 2``, launches three replica groups of
``examples/train_ddp.py`` (via :mod:`torchft.launch`, which keeps one warm standby process:
torch and torchft already imported), SIGKILLs one group's trainer mid-run, lets the launcher
replace it with the standby so it heals from a live peer. Later it SIGKILLs every group at
once (a total loss: nobody is left to heal from); the groups restart and resume from the
newest complete durable snapshot (``TORCHFT_SNAPSHOT_DIR``, written by one group every
``--snapshot-every`` steps). It prints a summary: steps committed, failures injected, heal
time, the snapshot resumed from and the steps lost, final loss and whether every group ended
with bit-identical model and optimizer state. Exits non-zero if any of that did not happen.
``--standby 0`` restarts the groups cold under torchrun instead, for comparison;
``--total-loss-at 0`` skips the total loss.

With ``--secure`` (``make demo DEMO_SECURE=1``) the whole job runs with a shared-secret
token and mutual TLS: the lighthouse, every manager server and every healing transfer
(see docs/security.md). It uses the test certificates in ``tests/certs``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchft.eventlog import read_events, summarize
from torchft.launch import Launcher, LighthouseProcess
from torchft.snapshot import list_snapshots

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


def _status(address: str, tls: ssl.SSLContext | None = None) -> dict[str, object] | None:
    """The lighthouse's /status (None if it did not answer)."""
    try:
        with urllib.request.urlopen(address + "/status", timeout=0.5, context=tls) as r:
            status = json.loads(r.read())
            return status if isinstance(status, dict) else None
    except (OSError, ValueError):
        return None


def _secure_job(log_dir: Path) -> ssl.SSLContext:
    """Makes this process and everything it starts use a fresh token and mutual TLS.

    Returns:
        The TLS context for reading the lighthouse's status page.
    """
    certs = HERE.parent / "tests" / "certs"
    token = log_dir / "token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    os.environ.update(
        TORCHFT_TOKEN_FILE=str(token),
        TORCHFT_TLS_CERT=str(certs / "server.pem"),
        TORCHFT_TLS_KEY=str(certs / "server.key"),
        TORCHFT_TLS_CA=str(certs / "ca.pem"),
        TORCHFT_TLS_CLIENT_CA=str(certs / "ca.pem"),
    )
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    return ctx


_SECURITY_VARS = (
    "TORCHFT_TOKEN_FILE",
    "TORCHFT_TOKEN",
    "TORCHFT_TLS_CERT",
    "TORCHFT_TLS_KEY",
    "TORCHFT_TLS_CA",
    "TORCHFT_TLS_CLIENT_CA",
)


@contextlib.contextmanager
def _only_security(**settings: str) -> Iterator[None]:
    """Runs the body with exactly these token/TLS variables set (restored after)."""
    saved = {k: os.environ.pop(k, None) for k in _SECURITY_VARS}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k in _SECURITY_VARS:
            os.environ.pop(k, None)
            if saved[k] is not None:
                os.environ[k] = saved[k]  # type: ignore[assignment]


def _grpc_answer(address: str, **settings: str) -> str:
    """What a native lighthouse client with only ``settings`` gets from a heartbeat: the
    error's first line, or "accepted"."""
    from datetime import timedelta

    from torchft._torchft import LighthouseClient

    try:
        with _only_security(**settings):
            client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        client.heartbeat("demo-security-probe", timeout=timedelta(seconds=5))
    except Exception as e:  # the refusal and its reason are the answer
        return (str(e).splitlines() or [type(e).__name__])[0][:100]
    return "accepted"


def _check_refusals(address: str, tls: ssl.SSLContext | None) -> list[str]:
    """Asks the secured lighthouse things it must refuse, over HTTP and gRPC; one line each.

    Each line ends in "(refused)" or "(NOT refused)".
    """
    import urllib.error

    def status_of(url: str, method: str, ctx: ssl.SSLContext | None) -> str:
        req = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
                return f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}"
        except (OSError, ssl.SSLError) as e:
            return f"connection failed ({e.__class__.__name__})"

    env = os.environ
    plain = address.replace("https://", "http://")
    no_cert = ssl.create_default_context(cafile=env["TORCHFT_TLS_CA"])
    client_tls = {
        "TORCHFT_TLS_CA": env["TORCHFT_TLS_CA"],
        "TORCHFT_TLS_CERT": env["TORCHFT_TLS_CERT"],
        "TORCHFT_TLS_KEY": env["TORCHFT_TLS_KEY"],
    }
    token = {"TORCHFT_TOKEN_FILE": env["TORCHFT_TOKEN_FILE"]}
    checks = [
        ("plain HTTP", status_of(plain + "/status", "GET", None), "HTTP 400"),
        (
            "kill without the token",
            status_of(address + "/replicas/x/kill", "POST", tls),
            "HTTP 401",
        ),
        (
            "TLS without a client certificate",
            status_of(address + "/status", "GET", no_cert),
            "connection failed",
        ),
        (
            "gRPC over plain TCP",
            _grpc_answer(plain, **token),
            "unavailable: this server accepts TLS only",
        ),
        (
            "gRPC without the token",
            _grpc_answer(address, **client_tls),
            "unauthenticated: missing token",
        ),
        (
            "gRPC with a wrong token",
            _grpc_answer(address, TORCHFT_TOKEN="not-the-job-token", **client_tls),
            "unauthenticated: wrong token",
        ),
        (
            "gRPC without a client certificate",
            _grpc_answer(address, TORCHFT_TLS_CA=env["TORCHFT_TLS_CA"], **token),
            "",  # the handshake is refused; the client's error text varies by timing
        ),
    ]
    lines = []
    for what, got, expect in checks:
        refused = got != "accepted" and got.startswith(expect)
        lines.append(f"{what}: {got} ({'refused' if refused else 'NOT refused'})")
    return lines


def _drain(pumps: list[threading.Thread], timeout: float = 15.0) -> None:
    """Waits until the output threads of killed processes have handed on every line."""
    deadline = time.monotonic() + timeout
    for t in pumps:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = sum(t.is_alive() for t in pumps)
    if alive:
        print(f"   ({alive} output stream(s) of the killed processes still open after {timeout}s)")


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0 when a group was killed, healed, and all ended identical."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument(
        "--kill-at", type=int, default=None, help="step at which to kill (default: steps/4)"
    )
    p.add_argument("--kill-group", type=int, default=1)
    p.add_argument(
        "--total-loss-at",
        type=int,
        default=None,
        help="step at which every group is killed at once (default: 3*steps/5; 0: never)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=25,
        help="committed steps between durable snapshots (TORCHFT_SNAPSHOT_EVERY)",
    )
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument(
        "--standby",
        type=int,
        default=1,
        help="warm standby processes the launcher keeps (0: restart the killed group cold)",
    )
    p.add_argument("--timeout", type=float, default=270.0, help="give up after this many seconds")
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the groups' logs, results and event log here (default: a temporary "
        "directory, removed when the demo succeeds)",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        default=os.environ.get("DEMO_SECURE", "") not in ("", "0"),
        help="run with a token and mutual TLS everywhere (default: env DEMO_SECURE)",
    )
    args = p.parse_args(argv)
    if args.replicas < 2:
        p.error("--replicas must be at least 2 (one is killed)")
    if not 0 <= args.kill_group < args.replicas:
        p.error("--kill-group must name one of the replica groups")
    kill_at = args.kill_at if args.kill_at is not None else args.steps // 4
    total_at = args.total_loss_at if args.total_loss_at is not None else 3 * args.steps // 5
    if args.snapshot_every < 1:
        p.error("--snapshot-every must be at least 1")
    if total_at and not kill_at < total_at < args.steps:
        p.error("--total-loss-at must come after --kill-at and before --steps (or be 0)")

    views = [GroupView() for _ in range(args.replicas)]
    lock = threading.Lock()
    restart_time: dict[int, float] = {}
    # The total loss: when it happened, the newest complete snapshot then, the best step then,
    # and the first committed step printed after it.
    total: dict[str, float | int | None] = {"t": None, "snapshot": None, "best": None}
    resumed: list[int] = []
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log_dir = args.log_dir
    else:
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
                if total["t"] is not None and not resumed:
                    resumed.append(v.step)
                    print(
                        f"-> the job resumed: step {v.step} committed "
                        f"{time.monotonic() - float(total['t']):.1f}s after the total loss "
                        f"(from the snapshot of step {v.step - 1})"
                    )
                if group in restart_time and v.first_commit_after_restart is None:
                    v.first_commit_after_restart = time.monotonic() - restart_time[group]
                    print(
                        f"-> replica group {group} healed from a live peer and committed step "
                        f"{v.step}, {v.first_commit_after_restart:.1f}s after the kill"
                    )
            else:
                v.failed_steps += 1

    extra_args: list[str] = []
    status_tls: ssl.SSLContext | None = None
    if args.secure:
        status_tls = _secure_job(log_dir)
        # The test certificate names localhost: every group advertises that name.
        extra_args = ["--hostname", "localhost"]
    mode = "token + mutual TLS" if args.secure else "plain"
    spares = f", {args.standby} warm standby" if args.standby else ""
    print(
        f"torchft demo: {args.replicas} replica groups, {args.steps} steps, CPU/Gloo, {mode}{spares}"
    )
    t0 = time.monotonic()
    event_log = log_dir / "events.jsonl"
    lighthouse = LighthouseProcess(min_replicas=2, join_timeout_ms=3000, event_log=str(event_log))
    refusals = _check_refusals(lighthouse.address, status_tls) if args.secure else []
    for line in refusals:
        print(f"security check: {line}")
    print(
        f"lighthouse at {lighthouse.address} "
        f"(dashboard: {lighthouse.address}/ , JSON: /status, metrics: /metrics)"
    )
    health: list[dict[str, object]] = []
    snapshot_seen: object = None
    snap_dir = log_dir / "snapshots"
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
            *extra_args,
        ],
        replicas=args.replicas,
        nproc_per_node=1,
        max_restarts=3,
        lighthouse=lighthouse.address,
        on_line=on_line,
        env={
            "TORCHFT_RESULT_FILE": result_file,
            "TORCHFT_SNAPSHOT_DIR": str(snap_dir),
            "TORCHFT_SNAPSHOT_EVERY": str(args.snapshot_every),
        },
        standby=args.standby,
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
                pumps = launcher.output_pumps(args.kill_group)
                killed_at = time.monotonic()
                pids = launcher.kill_group(args.kill_group, signal.SIGKILL)
                if pids:
                    killed = pids
                    kill_step = steps[args.kill_group]
                    # A commit line the dead incarnation wrote must not pass for the heal.
                    _drain(pumps)
                    with lock:
                        restart_time[args.kill_group] = killed_at
                    print(
                        f"-> SIGKILL replica group {args.kill_group} (pid {pids}) at step {kill_step}"
                    )
            healed_once = views[args.kill_group].first_commit_after_restart is not None
            if total_at and healed_once and total["t"] is None and min(steps) >= total_at:
                pumps = [t for i in range(args.replicas) for t in launcher.output_pumps(i)]
                killed_at = time.monotonic()
                for i in range(args.replicas):
                    launcher.kill_group(i, signal.SIGKILL)
                # Every line written before the kill is handled first: a late commit line of a
                # dead group must not pass for the resumed job.
                _drain(pumps)
                # The writers died with the groups: what is complete now is what they use.
                time.sleep(0.2)
                snaps = list_snapshots(snap_dir)
                total.update(
                    t=killed_at,
                    snapshot=snaps[0].step if snaps else 0,
                    best=max(steps),
                )
                print(
                    f"-> SIGKILL every replica group at once at step {max(steps)} (a total "
                    f"loss: nobody left to heal from); newest complete snapshot: step "
                    f"{total['snapshot']}"
                )
            if now - last_print >= 2.0 or done:
                last_print = now
                status = _status(lighthouse.address, status_tls)
                if status is not None:
                    replicas = status.get("replicas")
                    if isinstance(replicas, list) and replicas:
                        health = replicas
                    snapshot_seen = status.get("snapshot") or snapshot_seen
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
    victim_state = launcher.groups[args.kill_group]
    # The launcher's one spare goes to whichever group dies first: after the total loss the
    # killed group may have restarted cold while another took the spare.
    how = (
        f"the last one {'on a warm standby' if victim_state.warm else 'cold (the spare went to another group)'}"
        if args.standby and restarts
        else "cold (torchrun)"
    )
    print(f"group restarts          : {restarts}, {how}")
    lost = None
    if total["t"] is not None:
        resumed_from = resumed[0] - 1 if resumed else None
        lost = int(total["best"] or 0) - int(total["snapshot"] or 0)
        print(
            f"total loss              : every group SIGKILLed at step {total['best']}; resumed "
            f"from the snapshot of step {resumed_from} ({lost} steps lost, interval "
            f"{args.snapshot_every})"
        )
    if isinstance(snapshot_seen, dict):
        print(
            f"lighthouse's snapshot   : step {snapshot_seen.get('step')} written by "
            f"{snapshot_seen.get('replica_id')} ({snapshot_seen.get('bytes')} bytes, staged in "
            f"{snapshot_seen.get('stage_s')}s, written in {snapshot_seen.get('write_s')}s)"
        )
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
        heal = r.get("last_heal")
        if isinstance(heal, dict):
            print(
                f"    last heal: from {heal.get('source') or '?'} to step {heal.get('step')}, "
                f"{heal.get('bytes')} bytes in {heal.get('seconds')}s ({heal.get('gbps')} GB/s)"
            )
    if event_log.exists():
        events, _ = read_events(event_log)
        summary = summarize(events)
        victim = summary["replicas"].get(f"train_ddp_{args.kill_group}") or {}
        walk = " -> ".join(t["to"] for t in victim.get("transitions", []))
        print(f"event log               : {len(events)} events; group {args.kill_group}: {walk}")
        goodput = [e for e in events if e["kind"] == "goodput"]
        if goodput and goodput[-1].get("ratio") is not None:
            g = goodput[-1]
            print(
                f"goodput                 : {g['ratio'] * 100:.1f}% of the groups' wall time "
                f"trained ({g['productive_s']:.1f}s of {g['wall_s']:.1f}s; recovery "
                f"{g['recovery_s']:.1f}s, quorum {g['quorum_s']:.1f}s, heal {g['heal_s']:.1f}s, "
                f"{g['regressed_steps']} committed steps redone)"
                + ("" if g.get("final") else " so far")
            )
    ok = bool(killed) and restarts >= 1 and healed is not None and identical
    if total_at:
        # The job resumed from the newest complete snapshot, losing at most the interval.
        ok = (
            ok
            and bool(resumed)
            and resumed[0] - 1 == total["snapshot"]
            and lost is not None
            and 0 <= lost <= args.snapshot_every
        )
    if args.secure:
        secured = bool(refusals) and all(r.endswith("(refused)") for r in refusals)
        print(f"token + mutual TLS      : {'enforced' if secured else 'NOT ENFORCED'}")
        ok = ok and secured
    if ok and args.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
        print(f"wall time               : {time.monotonic() - t0:.1f}s")
    else:
        print(f"wall time               : {time.monotonic() - t0:.1f}s; logs kept in {log_dir}")
    code = 0 if ok else 1
    print("RESULT: " + ("OK" if ok else "FAILED"))
    return code


if __name__ == "__main__":
    sys.exit(main())
