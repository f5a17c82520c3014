"""Runs every Python benchmark under benches/ (each prints its own comparison table).

A benchmark is any ``benches/*.py`` other than this file and private ``_*.py`` helpers. Each
runs in its own process; the exit status is non-zero if any of them failed or missed a
target.

Usage: ``python benches/run_all.py [-k SUBSTRING]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    """Runs the selected benchmarks one after another and summarises their status."""
    parser = argparse.ArgumentParser(description="Run every Python benchmark.")
    parser.add_argument("-k", default="", help="only benchmarks whose file name contains this")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    benches = sorted(
        p
        for p in here.glob("*.py")
        if p.name != Path(__file__).name and not p.name.startswith("_") and args.k in p.name
    )
    failed = []
    for bench in benches:
        print(f"=== {bench.name}", flush=True)
        start = time.monotonic()
        rc = subprocess.call([sys.executable, str(bench)])
        print(f"=== {bench.name}: exit {rc} in {time.monotonic() - start:.1f}s", flush=True)
        if rc != 0:
            failed.append(bench.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    print(f"all {len(benches)} Python benchmarks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
