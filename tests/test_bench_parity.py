"""The parity benchmark, small: two groups train with parity on and off, and the native
digest of 8 MiB of float32 state equals the previous version's (zlib's): the benchmark exits
non-zero when they differ. No timing is asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_parity_benchmark_small_version() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benches" / "parity_overhead.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "one digest of this state, alone" in out.stdout, text
    assert "same digest" in out.stdout, text
