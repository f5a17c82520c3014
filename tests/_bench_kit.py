"""Helpers for the tests of the benchmarks' own accounting: loading a benchmark script as a
module, and using a known amount of a thread's CPU."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def load_bench(name: str) -> ModuleType:
    """The benchmark ``benches/{name}.py`` as a module (registered as ``{name}_bench``); a
    benchmark that imports its sibling helpers needs ``BENCHES`` on the path first."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def burn(seconds: float) -> None:
    """Uses about ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
