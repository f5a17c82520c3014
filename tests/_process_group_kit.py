"""Shared fixture and helpers of the process group tests: a TCPStore server, store
addresses on it, and ranks run in threads.

A test module takes the ``store`` fixture by importing ``store_fixture`` (pytest finds it by
name there)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from torch.distributed import TCPStore


@pytest.fixture(name="store")
def store_fixture() -> Iterator[TCPStore]:
    """A TCPStore server on an ephemeral port, shut down after the test."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


def _addr(store: TCPStore, prefix: str) -> str:
    return f"127.0.0.1:{store.port}/{prefix}"


def _run_ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """Runs ``fn(rank)`` for every rank in its own thread and returns the results in order."""
    with ThreadPoolExecutor(max_workers=world) as pool:
        futures = [pool.submit(fn, rank) for rank in range(world)]
        return [f.result(timeout=90) for f in futures]
