"""No source file outgrows what a reader can hold: at most 1,000 lines each.

Counted over the files git tracks: Python (package, tests, benchmarks, examples), Rust (a
file's lines above its ``#[cfg(test)]`` module, which is where its tests start) and the
dashboard's page and script. A file past the limit is a room holding two subsystems: split
it by role (docs/architecture.md) rather than raise the limit.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1000
SUFFIXES = (".py", ".pyi", ".rs", ".js", ".html")


def counted_lines(path: Path) -> int:
    """Lines of ``path`` that count: for Rust, those above its test module."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".rs":
        for i, line in enumerate(lines):
            if line.strip() == "#[cfg(test)]":
                return i
    return len(lines)


def tracked_sources() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout: {e}")
    names = [n for n in out.decode().split("\0") if n.endswith(SUFFIXES)]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


@pytest.mark.timeout(60)
def test_no_source_file_is_over_the_limit() -> None:
    files = tracked_sources()
    assert len(files) > 50, "the source listing found too few files to be the tree"
    over = sorted((n, str(p.relative_to(ROOT))) for p in files if (n := counted_lines(p)) > LIMIT)
    assert not over, f"files over {LIMIT} lines (split them by role): {over}"


def test_rust_files_are_counted_above_their_tests(tmp_path: Path) -> None:
    src = tmp_path / "m.rs"
    src.write_text("fn a() {}\n\n#[cfg(test)]\nmod tests {\n}\n")
    assert counted_lines(src) == 2
    py = tmp_path / "m.py"
    py.write_text("x = 1\n" * 1001)
    assert counted_lines(py) == 1001 > LIMIT
