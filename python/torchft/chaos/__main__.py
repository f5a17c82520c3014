"""``python -m torchft.chaos``: one chaos run; prints the report, exits 1 on violations."""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchft.chaos.harness import FAULT_KINDS, Chaos, ChaosConfig

#: The ChaosConfig fields set by a flag of the same name (``restart_delay``:
#: ``--restart-delay``), with the flag's argparse options; its type and default are the field's.
_CONFIG_FLAGS: dict[str, dict[str, Any]] = {
    "groups": {},
    "faults": {},
    "mtbf": {"help": "mean seconds between faults"},
    "restart_delay": {},
    "heartbeat_timeout_ms": {},
    "progress_wait_ms": {},
    "parity_every": {
        "help": "runtime parity interval of the groups (TORCHFT_PARITY_EVERY; bit flips must "
        "be healed within 3x this + 20 steps)"
    },
    "jitter": {
        "metavar": "F",
        "help": "each worker step's sleep is multiplied by a uniform random factor in [1-F, 1+F]",
    },
    "floor_runs": {
        "help": "spawns per floor (import torch, and with torch._dynamo) timed for the report; "
        "0 skips"
    },
    "worker_log_level": {
        "choices": ["DEBUG", "INFO", "WARNING", "ERROR"],
        "help": "level of the workers' log lines kept in the run directory (INFO: every heal)",
    },
    "standby": {
        "help": "warm standby processes kept for restarts (torchft.standby); 0 restarts cold"
    },
    "snapshot_every": {
        "help": "durable snapshot interval of the groups (kill_all resumes from them; 0: off, "
        "which needs --weight kill_all=0)"
    },
}


def main(argv: list[str] | None = None) -> int:
    """Parses the flags, runs, prints the report; 0 when no invariant was violated."""
    p = argparse.ArgumentParser(prog="python -m torchft.chaos", description=__doc__)
    p.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    defaults = {f.name: f.default for f in dataclasses.fields(ChaosConfig)}
    for name, extra in _CONFIG_FLAGS.items():
        flag, default = "--" + name.replace("_", "-"), defaults[name]
        p.add_argument(flag, type=type(default), default=default, **extra)
    p.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="KIND=W",
        help=f"fault kind weight (kinds: {', '.join(FAULT_KINDS)})",
    )
    p.add_argument(
        "--lighthouse-bin",
        default=None,
        help="the torchft_lighthouse binary to run (default: found on PATH)",
    )
    p.add_argument(
        "--no-restart-while-stopped",
        dest="restart_while_stopped",
        action="store_false",
        help="do not restart the lighthouse while a group is stopped",
    )
    p.add_argument(
        "--check",
        default=None,
        metavar="RUN_DIR",
        help="only re-check the history of an earlier run (no processes are started)",
    )
    p.add_argument("--out", default=None, help="run directory (default: a new temp dir)")
    args = p.parse_args(argv)
    if args.check:
        return _recheck(Path(args.check))
    weights = dict(FAULT_KINDS)
    for w in args.weight:
        kind, _, value = w.partition("=")
        try:
            weights[kind] = float(value)
        except ValueError:
            p.error(f"--weight wants KIND=NUMBER, got {w!r}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"torchft-chaos-{seed}-"))
    try:
        cfg = ChaosConfig(
            seed=seed,
            weights=weights,
            lighthouse_cmd=[args.lighthouse_bin] if args.lighthouse_bin else None,
            restart_while_stopped=args.restart_while_stopped,
            **{name: getattr(args, name) for name in _CONFIG_FLAGS},
        )
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    report = Chaos(cfg, out).run()
    print(f"==== chaos report (seed {seed}; rerun: python -m torchft.chaos --seed {seed}) ====")
    print(report.text())
    print(f"run dir: {out}")
    print("RESULT: " + ("OK" if not report.violations else "VIOLATIONS"))
    return 0 if not report.violations else 1


def _recheck(run: Path) -> int:
    """Runs the offline checker on the files of an earlier run."""
    from torchft.chaos.history import check, read_jsonl

    if not (run / "processes.jsonl").exists():
        print(f"{run} is not a chaos run directory (no processes.jsonl)", file=sys.stderr)
        return 2
    groups = sorted({r["group"] for r in read_jsonl(run / "processes.jsonl")})
    bound = run / "min_replicas"  # absent in runs of older harnesses, which ran with 1
    min_replicas = int(bound.read_text()) if bound.exists() else 1
    report = check(run, int((run / "target").read_text()), min_replicas, groups)
    print(report.text())
    print("RESULT: " + ("OK" if not report.violations else "VIOLATIONS"))
    return 0 if not report.violations else 1


if __name__ == "__main__":
    sys.exit(main())
