"""Heal sources chosen by locality, end to end: real lighthouse, real replica-group processes.

Four replica groups with a topology file (``WORLD_TOPOLOGY_FILE``) in which each of the two
groups that will heal is well connected to a different up-to-date group — the opposite of the
round-robin choice. Both are SIGKILLed (while every group pauses between steps, so both
survivors are up to date) and restarted; the lighthouse's min_replicas of 4 makes them heal in
the same quorum. The lighthouse's ``/status`` must show each heal's
source (the one the file prefers), bytes, seconds and GB/s, the event log the same, and the
groups must end bit-identical.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster
from test_fault_tolerance import assert_identical

from torchft._torchft import LighthouseServer

pytestmark = pytest.mark.timeout(240)


def _conn(gbps: float, latency_us: float) -> dict[str, Any]:
    return {
        "connection": {
            "latency": {"value": str(latency_us), "measurement": "us"},
            "bandwidth": {"value": str(gbps), "measurement": "GB/s"},
            "channels": {"value": "4"},
        }
    }


def write_topology(path: Path, fast: set[frozenset[int]], ranks: int) -> None:
    """A version 0.1 file over ``ranks`` job-wide ranks: pairs in ``fast`` get 100 GB/s,
    every other pair 1 GB/s."""
    doc: dict[str, Any] = {"version": "0.1", "ranks": {}}
    for a in range(ranks):
        peers = {
            str(b): _conn(100.0, 5.0) if frozenset((a, b)) in fast else _conn(1.0, 500.0)
            for b in range(ranks)
            if b != a
        }
        doc["ranks"][str(a)] = {"peers": peers}
    path.write_text(json.dumps(doc, indent=1))


def status(addr: str) -> dict[str, Any]:
    with urllib.request.urlopen(addr.rstrip("/") + "/status", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture
def four_groups(tmp_path: Path) -> Iterator[tuple[Cluster, LighthouseServer, Path]]:
    """A lighthouse that forms quorums only with all four groups, and a launcher."""
    events = tmp_path / "events.jsonl"
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=4,
        join_timeout_ms=300,
        quorum_tick_ms=20,
        # The daemon's default, as the shared cluster fixture's (see conftest.py): groups
        # are only SIGKILLed here, and a shorter lease makes a loaded machine's scheduling
        # gap a "no" vote.
        heartbeat_timeout_ms=5000,
        event_log=str(events),
    )
    c = Cluster(tmp_path, lighthouse.address())
    try:
        yield c, lighthouse, events
    finally:
        c.close()
        lighthouse.shutdown()


def test_two_groups_heal_at_once_from_the_sources_the_topology_prefers(
    four_groups: tuple[Cluster, LighthouseServer, Path], tmp_path: Path
) -> None:
    """rg2 is close to rg1 and rg3 to rg0 (round-robin would pair rg2-rg0, rg3-rg1): both heal
    in one quorum, each from its close source, reported with bytes, seconds and GB/s."""
    cluster, lighthouse, events = four_groups
    topo = tmp_path / "topology.json"
    write_topology(topo, {frozenset((2, 1)), frozenset((3, 0))}, ranks=4)
    hold = tmp_path / "hold"
    extra = ["--quorum-timeout", "90", "--timeout", "15", "--hold-file", str(hold)]

    def start(i: int, seed: int) -> Any:
        env = {"WORLD_TOPOLOGY_FILE": str(topo), "REPLICA_GROUP_ID": str(i)}
        return cluster.start(f"rg{i}", seed=seed, extra=extra, env=env)

    def steps() -> set[int]:
        return {s for g in groups for s in g.steps()}

    groups = [start(i, i) for i in range(4)]
    cluster.wait_until(lambda: min(min(g.steps()) for g in groups) >= 6, 120, "4 groups at 6")
    # Every group holds once it has committed a step well past the newest seen (none has
    # started it yet, so all of them train up to it): killed while held, the victims leave
    # both survivors at that step, so both are sources of the next quorum (a kill in the
    # middle of a step could let one survivor commit it and not the other).
    held_at = max(steps()) + 3
    hold.write_text(str(held_at))
    cluster.wait_until(lambda: steps() == {held_at}, 60, f"all groups held at step {held_at}")
    for victim in groups[2:]:
        cluster.kill(victim)
    hold.unlink()
    reborn = [start(i, 50 + i) for i in (2, 3)]
    addr = lighthouse.address()

    def healed_again() -> bool:
        reps = {r["replica_id"]: r for r in status(addr)["replicas"]}
        return all(
            (reps.get(f"rg{i}", {}).get("last_heal") or {}).get("step", 0) > 0 for i in (2, 3)
        )

    cluster.wait_until(lambda: min(min(g.steps()) for g in reborn) >= 12, 120, "reborn at 12")
    cluster.wait_until(healed_again, 30, "both heals reported in /status")
    target = max(s for g in cluster.live() for s in g.steps()) + 3
    cluster.stop_at(target)
    assert_identical(cluster.finish(120), target)

    reps = {r["replica_id"]: r for r in status(addr)["replicas"]}
    heal2, heal3 = reps["rg2"]["last_heal"], reps["rg3"]["last_heal"]
    # On a failure, every heal and state change of the run says which quorum chose what.
    history = [
        line
        for line in events.read_text().splitlines()
        if '"replica_healed"' in line or '"state_changed"' in line or '"quorum' in line
    ]
    # A string message is printed whole (a tuple's repr would be cut short).
    told = "\n".join([json.dumps(heal2), json.dumps(heal3), *history])
    assert heal2["source"] == "rg1", told
    assert heal3["source"] == "rg0", told
    # One quorum: both healed to the same step, at once.
    assert heal2["step"] == heal3["step"] > 0, (heal2, heal3)
    for heal in (heal2, heal3):
        assert heal["bytes"] > 0 and heal["seconds"] > 0 and heal["gbps"] > 0, heal
        assert (
            abs(heal["gbps"] - heal["bytes"] / heal["seconds"] / 1e9) < 1e-3 + 1e-2 * heal["gbps"]
        ), heal

    lines = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    healed = [e for e in lines if e["kind"] == "replica_healed" and e["step"] == heal2["step"]]
    assert {(e["replica_id"], e["source"]) for e in healed} == {("rg2", "rg1"), ("rg3", "rg0")}
    assert all(e["heal_bytes"] > 0 and e["gbps"] > 0 for e in healed), healed


def test_bad_topology_file_fails_the_manager_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A malformed topology file, or one without this group's ranks, stops the Manager at
    construction with the field named; a file without REPLICA_GROUP_ID is refused too."""
    from torch.distributed import TCPStore

    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    topo = tmp_path / "topology.json"
    monkeypatch.setenv("WORLD_TOPOLOGY_FILE", str(topo))
    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    bad_bandwidth = (
        '{"version": "0.1", "ranks": {"3": {"peers": {"1": {"connection": '
        '{"bandwidth": {"value": "fast"}}}}}}}'
    )
    cases = [
        (bad_bandwidth, 'field ranks."3".peers."1".connection.bandwidth.value'),
        ('{"version": "1.0", "ranks": {"3": {}}}', "field version"),
        ('{"version": "0.1", "ranks": {"0": {}}}', 'field ranks."3": missing'),
        ("{", "not valid JSON"),
    ]

    def manager() -> Manager:
        return Manager(
            pg=ProcessGroupGloo(),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store.port,
            lighthouse_addr=lighthouse.address(),
            replica_id="bad_topology",
            connect_timeout=timedelta(seconds=5),
        )

    try:
        for text, message in cases:
            topo.write_text(text)
            with pytest.raises(ValueError, match=re.escape(message)):
                manager()
        topo.write_text('{"version": "0.1", "ranks": {"3": {}}}')
        monkeypatch.delenv("REPLICA_GROUP_ID")
        with pytest.raises(ValueError, match="REPLICA_GROUP_ID"):
            manager()
        monkeypatch.setenv("REPLICA_GROUP_ID", "3")
        manager().shutdown()
    finally:
        lighthouse.shutdown()
