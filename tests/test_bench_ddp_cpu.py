"""The DDP overhead benchmark's CPU accounting: per-thread CPU over a window, by thread kind,
and the line comparing one side's with another's. (The benchmark itself runs in `make
bench`; these check what it prints is computed right.)"""

from __future__ import annotations

import threading
import time
from types import ModuleType

import pytest
from _bench_kit import burn, load_bench


def _bench() -> ModuleType:
    return load_bench("ddp_overhead")


@pytest.mark.timeout(60)
def test_cpu_per_step_splits_the_window_by_thread() -> None:
    bench = _bench()
    stop = threading.Event()

    def helper_that_stays() -> None:
        burn(0.1)
        stop.wait()

    stays = threading.Thread(target=helper_that_stays)
    before = bench._thread_cpu()
    stays.start()
    exits = threading.Thread(target=burn, args=(0.1,))
    exits.start()
    exits.join()
    burn(0.1)
    time.sleep(0.3)  # the staying helper has burnt its share by now
    try:
        per_step = bench._cpu_per_step(before, 10)  # milliseconds per step, over 10 steps
    finally:
        stop.set()
        stays.join()
    assert 9.0 <= per_step["main"] < 20.0, per_step
    helpers = {k: v for k, v in per_step.items() if k not in ("main", "all")}
    # The helper still alive shows under its thread name; the one that exited only in "all".
    assert 9.0 <= sum(helpers.values()) < 20.0, per_step
    assert per_step["all"] >= per_step["main"] + sum(helpers.values()) + 9.0, per_step
    assert bench._cpu_per_step(None, 10) == {} and bench._cpu_per_step(before, 0) == {}


@pytest.mark.timeout(60)
def test_cpu_line_compares_each_thread_kind_largest_increase_first() -> None:
    bench = _bench()
    bench._CPU["plain"] = [{"main": 8.0, "gloo": 2.0, "all": 10.0}] * 2 + [
        {"main": 50.0, "gloo": 2.0, "all": 52.0}
    ]
    bench._CPU["ft"] = [{"main": 9.0, "gloo": 1.5, "torchft-rt": 0.4, "all": 10.9}] * 3
    assert bench._cpu_line("plain") == "10.00 ms: main 8.00, gloo 2.00"
    assert bench._cpu_line("ft", "plain") == (
        "10.90 ms (+0.90) against plain: main 9.00 (+1.00), torchft-rt 0.40 (+0.40), "
        "gloo 1.50 (-0.50)"
    )
    assert bench._cpu_line("upstream", "plain") == ""
