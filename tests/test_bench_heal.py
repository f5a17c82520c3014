"""The end-to-end heal benchmark, small: it still runs against the library as it is (it
times the Manager's heal from inside the healing process, so it breaks when the heal path
moves) and its healing groups receive their parameters in place. No timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_heal_benchmark_small_version() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benches" / "heal_e2e.py"), "--mb", "8", "--check"],
        capture_output=True,
        text=True,
        timeout=220,
        env=dict(os.environ, TORCHFT_CHECKPOINT_BIND="127.0.0.1"),
    )
    text = out.stdout + out.stderr
    # --check does not judge the timing target: anything but exit 0 (a crash, a group that
    # never started) fails here.
    assert out.returncode == 0, text
    assert re.search(r"target heal .*: not judged \(--check\)$", out.stdout, re.M), text
    heal = re.search(r"heal \(fetch \+ load\)\s+([0-9.]+)s", out.stdout)
    assert heal is not None and float(heal.group(1)) > 0, text
    assert "parameters received in place: yes" in out.stdout, text
