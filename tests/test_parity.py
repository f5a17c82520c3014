"""Runtime state parity, with real processes: a bit flipped in one group's parameters is found
by comparing the groups' digests of the same committed step, and the group heals from the
majority (three groups) or every group stops (two groups: no majority can say which is right).
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from _hang_worker import DIVERGED_EXIT
from conftest import start_lighthouse_process
from test_hang import Job, _commits, _history, _status

from torchft._torchft import _digest_update
from torchft.chaos.history import state_hash
from torchft.parity import StateParity, digest_tensors
from torchft.snapshot import list_snapshots, load_rank

EVERY = 10


def _diverged(addr: str, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in _status(addr)["events"]
        if e["kind"] == "replica_diverged" and e["replica_id"].startswith(name + ":")
    ]


def _together(job: Job, names: list[str], n: int) -> bool:
    return all(
        len([c for c in _commits(job.history(g)) if c["participants"] == len(names)]) >= n
        for g in names
    )


@pytest.mark.timeout(240)
def test_a_flipped_bit_in_one_of_three_groups_is_found_and_healed(tmp_path: Path) -> None:
    """Three groups; one bit of one group's parameters is flipped in memory. The lighthouse
    names it diverged at the first parity step after the flip (within N steps), it heals from
    the two that agree, and every group ends at the same step with one state."""
    lh = start_lighthouse_process("--min_replicas", "1", "--quorum_tick_ms", "50")
    job = Job(tmp_path, lh.address, env={"TORCHFT_PARITY_EVERY": str(EVERY)})
    names = ["g0", "g1", "g2"]
    bad = "g2"
    try:
        for n in names:
            job.start(n, "exit")
        job.wait_for("every group committing together", lambda: _together(job, names, 25), 120)
        assert _status(lh.address)["parity"]["checks"] >= 1, "steps are compared"
        assert not _diverged(lh.address, bad), "no divergence before the flip"
        job.flip_file(bad).write_text("1")
        flip = job.wait_for(
            "the flip",
            lambda: next((e for e in _history(job.history(bad)) if "flip" in e), None),
            30,
        )
        event = job.wait_for("a replica_diverged event", lambda: _diverged(lh.address, bad), 60)[0]
        assert event["action"] == "heal", event
        assert len(event["majority"]) == 2 and event["compared"] == 3, event
        # The flip is made at the top of a step, before that step's digest is taken: the
        # first parity step at or after it holds the flipped state, and is where it is found.
        assert flip["step"] <= event["step"] < flip["step"] + EVERY, (flip, event)
        for other in ("g0", "g1"):
            assert not _diverged(lh.address, other)

        # It heals: its state agrees with the others' again at a later step.
        def agrees_again() -> bool:
            mine = {c["step"]: c["state"] for c in _commits(job.history(bad))}
            theirs = {c["step"]: c["state"] for c in _commits(job.history("g0"))}
            return any(
                s > event["step"] and mine[s] == theirs[s] for s in mine.keys() & theirs.keys()
            )

        job.wait_for("the flipped group agreeing with the others again", agrees_again, 60)
        status = _status(lh.address)
        assert status["parity"]["diverged_total"] == 1, status["parity"]
        top = max(c["step"] for n in names for c in _commits(job.history(n)))
        job.set_target(top + 2 * EVERY)
        for n in names:
            assert job.procs[n].wait(timeout=120) == 0, job.log(n, 0)[-4000:]
        finals = {n: [e for e in _history(job.history(n)) if "finished" in e][-1] for n in names}
        assert len({f["finished"] for f in finals.values()}) == 1, finals
        assert len({f["state"] for f in finals.values()}) == 1, finals
        # One divergence, the injected one: later comparisons all agreed.
        assert _status(lh.address)["parity"]["diverged_total"] == 1
        assert "differs from the majority" in "".join(lh.log)
    finally:
        job.close()
        lh.stop()
        (tmp_path / "lighthouse.log").write_text("".join(lh.log))


@pytest.mark.timeout(300)
def test_a_state_found_diverged_never_becomes_a_durable_snapshot(tmp_path: Path) -> None:
    """Three groups with parity and snapshots every 10 steps: one bit of g2's state is
    flipped just before a snapshot step that g2 writes (snapshot writers rotate by step). The
    lighthouse finds g2 diverged at that step and g2 heals, but its snapshot of the step is
    never made complete; every snapshot that is complete holds the state the agreeing groups
    committed at its step, and says parity confirmed it."""
    lh = start_lighthouse_process("--min_replicas", "1", "--quorum_tick_ms", "50")
    snap_dir = tmp_path / "snapshots"
    job = Job(
        tmp_path,
        lh.address,
        env={
            "TORCHFT_PARITY_EVERY": str(EVERY),
            "TORCHFT_SNAPSHOT_DIR": str(snap_dir),
            "TORCHFT_SNAPSHOT_EVERY": str(EVERY),
            "TORCHFT_SNAPSHOT_KEEP": "100",
        },
    )
    names = ["g0", "g1", "g2"]
    bad = "g2"
    # The writer of snapshot step s is participating rank (s // EVERY) % 3; g2 is rank 2.
    written_by_bad = 2
    try:
        for n in names:
            job.start(n, "exit")
        job.wait_for("every group committing together", lambda: _together(job, names, 25), 120)
        event = None
        for attempt in range(3):
            # Flip so that the state g2 commits next lands before a step g2 snapshots.
            def aimed() -> bool:
                done = [c["step"] for c in _commits(job.history(bad))]
                return bool(done) and 11 <= done[-1] % (3 * EVERY) <= 15

            job.wait_for("a step before one that g2 snapshots", aimed, 60)
            job.flip_file(bad).write_text("1")
            found = len(_diverged(lh.address, bad))
            event = job.wait_for(
                "a replica_diverged event",
                lambda n=found: _diverged(lh.address, bad)[n:],  # type: ignore[misc]
                60,
            )[0]
            assert event["action"] == "heal", event
            if (event["step"] // EVERY) % 3 == written_by_bad:
                break
            print(f"attempt {attempt}: found at step {event['step']}, not a g2 snapshot step")
        assert event is not None and (event["step"] // EVERY) % 3 == written_by_bad, event
        step = event["step"]
        top = max(c["step"] for n in names for c in _commits(job.history(n)))
        job.set_target(max(top, step) + 3 * EVERY)
        for n in names:
            assert job.procs[n].wait(timeout=120) == 0, job.log(n, 0)[-4000:]

        # The state the agreeing groups committed at each step: g0's and g1's commits (a group
        # that healed past a step did not commit it; where both did, they are one state).
        agreed: dict[int, str] = {}
        for n in names:
            if n == bad:
                continue
            for c in _commits(job.history(n)):
                held = agreed.setdefault(c["step"], c["state"])
                assert held == c["state"], f"{n} committed another state at step {c['step']}"
        snaps = list_snapshots(snap_dir)
        assert step not in {s.step for s in snaps}, "the diverged state became a snapshot"
        log = job.log(bad, 0)
        assert "a diverged state never becomes a snapshot" in log, log[-4000:]
        assert len(snaps) >= 3, [s.step for s in snaps]
        for s in snaps:
            state = load_rank(s, 0)["user"]
            assert state_hash(state["model"], state["optim"]) == agreed[s.step], s.path
            assert s.manifest["parity"].startswith(("confirmed", "unconfirmed")), s.manifest
        assert any(s.manifest["parity"].startswith("confirmed") for s in snaps)
    finally:
        job.close()
        lh.stop()
        (tmp_path / "lighthouse.log").write_text("".join(lh.log))


@pytest.mark.timeout(240)
def test_two_groups_that_differ_both_stop_and_say_why(tmp_path: Path) -> None:
    """Two groups; a bit flipped in one. No majority can say which state is right: both get
    a ``replica_diverged`` event with action ``stop``, both processes end with
    StateDivergedError, and neither commits a step after the one found diverged."""
    lh = start_lighthouse_process("--min_replicas", "1", "--quorum_tick_ms", "50")
    job = Job(tmp_path, lh.address, env={"TORCHFT_PARITY_EVERY": str(EVERY)})
    names = ["g0", "g1"]
    try:
        for n in names:
            job.start(n, "exit")
        job.wait_for("both groups committing together", lambda: _together(job, names, 25), 120)
        job.flip_file("g1").write_text("1")
        for n in names:
            rc = job.procs[n].wait(timeout=90)
            assert rc == DIVERGED_EXIT, (n, rc, job.log(n, 0)[-4000:])
            stopped = [e for e in _history(job.history(n)) if "stopped" in e]
            assert stopped and "no majority" in stopped[-1]["stopped"], stopped
        status = _status(lh.address)
        events = [e for n in names for e in _diverged(lh.address, n)]
        assert {e["action"] for e in events} == {"stop"}, events
        assert len(events) == 2, events
        step = events[0]["step"]
        # Nothing past the step after the one found diverged was committed (the commit in
        # flight when the verdict came may land; no later one does).
        for n in names:
            assert max(c["step"] for c in _commits(job.history(n))) <= step + EVERY, n
        assert status["parity"]["diverged_total"] == 2, status["parity"]
    finally:
        job.close()
        lh.stop()
        (tmp_path / "lighthouse.log").write_text("".join(lh.log))


def _zlib_digest(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """The digest as zlib computes it: what every version's digests must equal."""
    crc, adler = 0, 1
    for path, t in tensors:
        t = t.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        for part in (f"{path}:{t.dtype}:{tuple(t.shape)};".encode(), raw):
            crc, adler = zlib.crc32(part, crc), zlib.adler32(part, adler)
    return crc.to_bytes(4, "big") + adler.to_bytes(4, "big")


def test_the_digest_is_zlibs_for_every_layout() -> None:
    """Native sums give the zlib digest: dtypes (complex too), empty, 0-dim and odd-sized
    tensors, views that are not contiguous, conjugate and negated views (as the values they
    read as), and a state large enough to cross many of the native pieces."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300_001, generator=g)
    tensors = [
        ("big", big),
        ("half", torch.randn(7, 13, generator=g).half()),
        ("bf16", torch.randn(5, generator=g).bfloat16()),
        ("f64", torch.randn(3, 3, generator=g).double()),
        ("empty", torch.empty(0, 4)),
        ("view", torch.randn(64, 64, generator=g).t()[3:40:3]),
        ("odd", big[1:12346]),
        ("scalar", torch.tensor(1.5)),
        ("complex", torch.randn(6, generator=g, dtype=torch.complex64)),
    ]
    assert digest_tensors(tensors) == _zlib_digest(tensors)
    for name, t in tensors:
        assert digest_tensors([(name, t)]) == _zlib_digest([(name, t)]), name
    # A conjugate or negated view digests as the values it reads as.
    c = torch.randn(6, generator=g, dtype=torch.complex64)
    for view in (c.conj(), torch.randn(6, generator=g, dtype=torch.complex64)._neg_view()):
        held = view.clone().resolve_conj().resolve_neg()
        assert digest_tensors([("v", view)]) == digest_tensors([("v", held)])
        assert digest_tensors([("v", view)]) == _zlib_digest([("v", held)])
    with pytest.raises(ValueError, match="null address"):
        _digest_update(0, 1, 0, 16)
    with pytest.raises(ValueError, match="past the end of memory"):
        _digest_update(0, 1, 2**64 - 8, 16)
    assert _digest_update(5, 6, 0, 0) == (5, 6)


def test_digests_follow_the_bits_and_bad_settings_are_refused() -> None:
    """The digest changes with one flipped bit and with the layout; parity_every is checked;
    digests run off the training thread and are handed over once."""
    a = torch.arange(64, dtype=torch.float32)
    b = a.clone()
    b.view(torch.int32)[5] ^= 1
    assert digest_tensors([("w", a)]) == digest_tensors([("w", a.clone())])
    assert digest_tensors([("w", a)]) != digest_tensors([("w", b)])
    assert digest_tensors([("w", a)]) != digest_tensors([("w", a.reshape(8, 8))])
    assert len(digest_tensors([("w", a)])) == 8
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="parity_every"):
            StateParity(bad, dict)  # type: ignore[arg-type]
    bn = torch.ones(3)
    rng = torch.get_rng_state()
    state = {
        "model": {"w": a, "bn.running_mean": bn, "steps": torch.tensor([3])},
        "data": {"position": 7, "rng": rng},
    }
    p = StateParity(10, lambda: state)
    p.at_step_start(5)
    assert p.take() is None, "not a parity step"
    p.at_step_start(10)
    p.settle()  # what the Manager does before anything writes the state
    a.add_(1.0)
    bn.add_(1.0)
    got = p.take()
    # Only floating-point tensors count: batch-norm statistics, integer and byte tensors
    # (a counter, an RNG state) and plain numbers are left out.
    assert got == (10, digest_tensors([("/'model'/'w'", a - 1.0)]))
    assert p.take() is None, "handed over once"
    p.at_step_start(10)
    time.sleep(0.1)
    assert p.take() is None, "a step is digested once"
    p.disable("test")
    p.at_step_start(20)
    assert p.every == 0 and p.take() is None
    p.shutdown()


def test_snapshot_steps_are_digested_besides_the_parity_steps() -> None:
    """With snapshots on, every group digests every snapshot step too, so a snapshot's own
    step is checked (not only the next parity step, up to an interval later)."""
    state = {"model": {"w": torch.arange(4.0)}}
    p = StateParity(10, lambda: state)
    p.at_step_start(4)
    assert p.take() is None, "step 4 is no parity step"
    p.also_digest(lambda s: s % 4 == 0)
    for step, digested in [(4, True), (5, False), (8, True), (10, True), (12, True), (13, False)]:
        p.at_step_start(step)
        p.settle()
        got = p.take()
        assert (got is not None) == digested, (step, got)
        if got is not None:
            assert got[0] == step
    p.disable("Local SGD")
    p.at_step_start(16)
    p.settle()
    assert p.take() is None, "off is off, snapshot steps included"
    p.shutdown()
