"""The chaos harness: a short soak against real processes, and the offline checker alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _chaos_runs import (
    _commit,
    _exit,
    _fault,
    _finish,
    _hang,
    _killed,
    _life,
    _read,
    _run,
    _start,
    _write,
)

from torchft.chaos import Chaos, ChaosConfig, check
from torchft.group_snapshots import DIVERGED_SNAPSHOT

ROOT = Path(__file__).resolve().parent.parent


def _lighthouse_bin() -> list[str] | None:
    """The Rust daemon built by ``cargo test``/``cargo build`` if present (restarts fast);
    the newest build of the two profiles (a stale release build lacks newer features)."""
    built = [ROOT / "target" / profile / "torchft_lighthouse" for profile in ("release", "debug")]
    built = [b for b in built if b.exists()]
    if not built:
        return None
    return [str(max(built, key=lambda b: b.stat().st_mtime))]


@pytest.mark.timeout(180)
def test_short_soak_keeps_every_invariant(tmp_path: Path) -> None:
    """30 random compound faults (kills, stops, kills while healing or voting, lighthouse
    restarts) against three groups: the offline checker finds no violation and every group
    ends at the target with one state."""
    cfg = ChaosConfig(seed=7, faults=30, mtbf=1.0, lighthouse_cmd=_lighthouse_bin(), floor_runs=0)
    report = Chaos(cfg, tmp_path / "run").run()
    print(report.text())
    assert sum(report.faults.values()) == 30
    assert report.violations == []
    assert report.final["states"] == 1 and report.final["groups"] == 3


@pytest.mark.timeout(240)
def test_short_soak_on_warm_standbys(tmp_path: Path) -> None:
    """Killed groups come back on warm standby processes (their start records say so) and
    every invariant holds; no spare outlives the run.

    A restart while every spare is still warming starts cold, and under load (torch imports
    of 6 s and more) kills 1.5 s apart outpace a spare's refill: two spares, faults 3 s apart
    (on two busy cores: 5 of 13 restarts warm)."""
    cfg = ChaosConfig(
        seed=8,
        faults=12,
        mtbf=3.0,
        lighthouse_cmd=_lighthouse_bin(),
        floor_runs=0,
        standby=2,
        weights={"kill_one": 2.0, "kill_two": 1.0, "kill_healing": 1.0},
    )
    chaos = Chaos(cfg, tmp_path / "run")
    report = chaos.run()
    print(report.text())
    assert report.violations == []
    assert report.final["states"] == 1 and report.final["groups"] == 3
    starts = [
        json.loads(line)
        for line in (tmp_path / "run" / "processes.jsonl").read_text().splitlines()
        if '"start"' in line
    ]
    seen: set[str] = set()
    firsts, restarts = [], []
    for r in starts:
        (restarts if r["group"] in seen else firsts).append(r)
        seen.add(r["group"])
    assert len(firsts) == 3 and not any(r["warm"] for r in firsts), firsts
    assert sum(1 for r in restarts if r["warm"]) >= 3, restarts
    assert chaos.pool.pids() == []


@pytest.mark.timeout(240)
def test_short_soak_with_total_losses(tmp_path: Path) -> None:
    """Every group SIGKILLed at once, sometimes with the lighthouse and its state file, among
    other faults: each time the run resumes from the newest complete durable snapshot with
    the state committed at that step, losing at most the interval (the checker's rules)."""
    cfg = ChaosConfig(
        seed=9,
        faults=8,
        mtbf=2.0,
        lighthouse_cmd=_lighthouse_bin(),
        floor_runs=0,
        snapshot_every=10,
        weights={"kill_all": 3.0, "kill_one": 1.0, "stop": 1.0},
    )
    report = Chaos(cfg, tmp_path / "run").run()
    print(report.text())
    assert report.violations == []
    assert report.total_losses, "no total loss was injected"
    restores = [
        line
        for p in (tmp_path / "run").glob("*.history.jsonl")
        for line in p.read_text().splitlines()
        if '"restore"' in line
    ]
    assert restores, "no group resumed from a snapshot"
    assert report.final["states"] == 1 and report.final["groups"] == 3


def test_report_splits_recoveries_into_phases_and_isolated_or_overlapped(tmp_path: Path) -> None:
    """Each kill's recovery carries its own restart delay, the worker's phases and the excess
    over the floors; a kill whose window meets another fault's is overlapped, a restart
    killed again before it commits is counted apart, and stalls follow the same split."""
    big = 10**6  # pids that are surely not running here
    a0, b0, b1, c0, c1, c2 = (big + i for i in range(6))
    _run(
        tmp_path,
        {
            # a survives throughout; b is killed at 10 (isolated); c at 30, its restart again
            # at 31.
            "a": [
                _commit("a", a0, s, 1, f"s{s}", t)
                for s, t in ((1, 1.0), (2, 10.2), (3, 16.0), (4, 32.0), (5, 45.0))
            ],
            "b0": [_commit("b", b0, 1, 1, "s1", 1.0)],
            "b1": [
                {"kind": "ready", "group": "b", "pid": b1, "imported": 13.0, "t": 14.5},
                _commit("b", b1, 3, 1, "s3", 14.8),
            ],
            "c0": [_commit("c", c0, 1, 1, "s1", 1.0)],
            "c2": [_commit("c", c2, 3, 1, "s3", 40.0)],
        },
        [
            _start("a", a0, 0.0),
            _start("b", b0, 0.0),
            _start("c", c0, 0.0),
            _killed("b", b0, 10.0),
            _start("b", b1, 10.5),
            _killed("c", c0, 30.0),
            _start("c", c1, 30.5),
            _killed("c", c1, 31.0),
            _start("c", c2, 31.5),
        ],
        [
            _fault("kill_one", ["b"], 10.0),
            _fault("kill_one", ["c"], 30.0),
            _fault("kill_healing", ["c"], 31.0),
        ],
    )
    (tmp_path / "floor.json").write_text(json.dumps({"import_s": 2.0, "torch_s": 3.5}))
    rep = check(tmp_path, target=3, min_replicas=1, groups=[])
    assert rep.floors == {"import": 2.0, "torch": 3.5}
    by_t = {(r.fault, r.group, r.again): r for r in rep.recoveries}
    b = by_t[("kill_one", "b", False)]
    assert b.isolated and b.delay == pytest.approx(0.5) and b.total == pytest.approx(4.8)
    assert (b.imports, b.setup, b.join) == pytest.approx((2.5, 1.5, 0.3))
    assert b.excess(3.5) == pytest.approx(0.8)
    c = by_t[("kill_one", "c", True)]  # its restart was killed while healing
    assert not c.isolated and c.total == pytest.approx(10.0) and c.join is None
    assert not by_t[("kill_healing", "c", False)].isolated
    # a's stall after b's kill: 10 -> 10.2, isolated; after c's kills (30, 31 -> 32): overlapped.
    assert rep.stalls == {"kill_one": pytest.approx(0.2)}
    assert rep.stalls_all == {"kill_one": pytest.approx(2.0), "kill_healing": pytest.approx(1.0)}
    text = rep.text()
    assert "isolated     1: p50 4.80s" in text and "+0.80s (torch floor)" in text
    assert "restarts killed again before their first commit: 1" in text


def test_a_group_counts_as_a_holder_only_once_it_committed(tmp_path: Path) -> None:
    """The injector spares the last group that committed in its current life: a process that
    only wrote its start-up record has not committed, so it does not make another group
    killable (else a kill_two could take the last holder of the progress); nor does one that
    died before the harness reaped it (the final phase would set the target without it)."""
    from types import SimpleNamespace

    from torchft.chaos.history import HistoryWriter

    chaos = Chaos(ChaosConfig(seed=1, faults=1, floor_runs=0), tmp_path / "run")
    rc: list[int | None] = [None]
    try:
        proc = SimpleNamespace(poll=lambda: rc[0])
        chaos.procs["g0"] = SimpleNamespace(killed=False, proc=proc)  # type: ignore[assignment]
        path = tmp_path / "run" / "g0.0.history.jsonl"
        writer = HistoryWriter(str(path), "g0", 123)
        writer.ready(imported=0.0)
        writer._f.close()
        assert not chaos._committed("g0")
        assert not chaos._spares(["g1"])
        writer = HistoryWriter(str(path), "g0", 123)
        writer.commit(step=1, quorum_id=5, participants=1, state="abc")
        writer._f.close()
        assert chaos._committed("g0")
        assert chaos._spares(["g1"])
        # Killed (or exited) and not reaped yet: its commits no longer make it a holder.
        rc[0] = -9
        assert not chaos._committed("g0")
        assert not chaos._spares(["g1"])
    finally:
        chaos._records.close()
        chaos._faults.close()


def test_kill_in_commit_is_recorded_only_when_the_commit_phase_was_seen(tmp_path: Path) -> None:
    """A worker not seen in its commit phase within the injector's second is killed all the
    same, but recorded as the plain kill it was (the report counted it as a kill in commit)."""
    from types import SimpleNamespace

    chaos = Chaos(ChaosConfig(seed=1, faults=1, floor_runs=0), tmp_path / "run")
    killed: list[str] = []
    try:
        chaos._running = lambda: ["g0", "g1"]  # type: ignore[method-assign]
        chaos._committed = lambda g: True  # type: ignore[method-assign]
        chaos._kill = killed.append  # type: ignore[method-assign]
        for g in ("g0", "g1"):
            phase = tmp_path / f"{g}.phase"
            phase.write_bytes(b"f")  # in its forward pass, never reaching the vote
            chaos.procs[g] = SimpleNamespace(phase=phase, killed=False)  # type: ignore[assignment]
        assert chaos._fault_kill_in_commit() is not None
        for g in ("g0", "g1"):
            (tmp_path / f"{g}.phase").write_bytes(b"c")
        chaos._pause = lambda p: True  # type: ignore[method-assign]
        assert chaos._fault_kill_in_commit() is not None
    finally:
        chaos._records.close()
        chaos._faults.close()
    faults = [
        json.loads(line)["fault"]
        for line in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()
    ]
    assert faults == ["kill_one", "kill_in_commit"]
    assert len(killed) == 2


def test_kill_in_commit_needs_the_worker_held_inside_its_vote(tmp_path: Path) -> None:
    """A worker seen in its vote that has left it (``d``: the vote returned) by the time it
    is held stopped is killed as a plain kill: a phase read a moment before the kill is no
    evidence of where the kill landed; one still in the vote once stopped is a kill in
    commit."""
    from types import SimpleNamespace

    chaos = Chaos(ChaosConfig(seed=1, faults=1, floor_runs=0), tmp_path / "run")
    killed: list[str] = []
    resumed: list[object] = []
    try:
        chaos._running = lambda: ["g0", "g1"]  # type: ignore[method-assign]
        chaos._committed = lambda g: True  # type: ignore[method-assign]
        chaos._kill = killed.append  # type: ignore[method-assign]
        chaos._resume = resumed.append  # type: ignore[method-assign]
        for g in ("g0", "g1"):
            phase = tmp_path / f"{g}.phase"
            phase.write_bytes(b"c")
            chaos.procs[g] = SimpleNamespace(phase=phase, killed=False)  # type: ignore[assignment]

        def moved_on(p: SimpleNamespace) -> bool:
            p.phase.write_bytes(b"d")  # the vote returned before the stop landed
            return True

        chaos._pause = moved_on  # type: ignore[method-assign]
        assert chaos._fault_kill_in_commit() is not None
        assert resumed, "a worker held outside its vote is let go again"
    finally:
        chaos._records.close()
        chaos._faults.close()
    faults = [
        json.loads(line)["fault"]
        for line in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()
    ]
    assert faults == ["kill_one"]
    assert len(killed) == 1


def test_the_injector_holds_a_worker_stopped_before_reading_its_phase(tmp_path: Path) -> None:
    """``_pause`` returns only once the process is really stopped (SIGSTOP is delivered
    asynchronously), and ``_resume`` lets it run again."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        p = SimpleNamespace(proc=child)
        assert Chaos._pause(p)  # type: ignore[arg-type]
        stat = Path(f"/proc/{child.pid}/stat")
        assert stat.read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
        Chaos._resume(p)  # type: ignore[arg-type]
        end = time.monotonic() + 5
        while stat.read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"):
            assert time.monotonic() < end, "the worker was not resumed"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()


def test_an_asked_restart_is_counted_and_a_crash_is_a_violation(tmp_path: Path) -> None:
    """A worker whose Manager raised TornStateError exits with RESTART_EXIT: the harness
    restarts it as a supervisor would and the check counts it apart; any other non-zero exit
    of a process nobody killed is a crash, a violation."""
    from torchft.chaos.history import RESTART_EXIT

    big = 10**6 + 100  # pids that are surely not running here
    exits = [*_life("a", big, 0.0, 0.5, rc=RESTART_EXIT), *_life("a", big + 1, 0.6, 4.0)]
    history = [_commit("a", big + 1, 1, 1, "s1", 1.0), _finish("a", big + 1, 1, "s1", 3.0)]
    _run(tmp_path, {"a": history}, exits)
    rep = check(tmp_path, target=1, min_replicas=1, groups=["a"])
    assert rep.violations == [] and rep.restarts_asked == 1
    assert "restarts asked for" in rep.text()
    exits[1]["rc"] = 1
    _write(tmp_path / "processes.jsonl", exits)
    rep = check(tmp_path, target=1, min_replicas=1, groups=["a"])
    assert rep.restarts_asked == 0
    assert rep.violations == [f"process {big} (a) exited with 1"]


def test_a_hung_exit_counts_only_after_an_injected_hang(tmp_path: Path) -> None:
    """A process that ends with HUNG_EXIT after its history shows an injected hang is a hung
    process that ended itself (restarted, counted apart); the same exit without a hang in
    its history is a false hang verdict, a violation."""
    from torchft.chaos.history import HUNG_EXIT

    big = 10**6 + 200
    hung_history = [_commit("a", big, 1, 1, "s1", 0.2), _hang("a", big, 1, 0.3)]
    restarted = [_commit("a", big + 1, 2, 2, "s2", 12.0), _finish("a", big + 1, 2, "s2", 13.0)]
    exits = [*_life("a", big, 0.0, 10.5, rc=HUNG_EXIT), *_life("a", big + 1, 11.0, 14.0)]
    _run(tmp_path, {"a": hung_history + restarted}, exits)
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert rep.violations == [] and rep.hang_exits == 1
    assert "ended themselves (held hung, restarted): 1" in rep.text()
    # Without the injected hang, the same exit is a false verdict.
    _write(tmp_path / "a.history.jsonl", hung_history[:1] + restarted)
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert rep.hang_exits == 0
    assert rep.violations == [
        f"process {big} (a) ended as held hung, but its training loop never hung: "
        "a false hang verdict"
    ]


_FLIP_PIDS = {"a": 10**6 + 301, "b": 10**6 + 302, "c": 10**6 + 303}  # surely not running


def _flip_run(
    path: Path,
    last: int,
    flipped: dict[str, range],
    flip_step: int = 2,
    exits: dict[str, int] | None = None,
) -> None:
    """Three groups commit steps 1..``last`` in one quorum, one step per second; group
    ``g`` holds another state at the steps in ``flipped[g]``; ``a`` flipped a bit at the top
    of ``flip_step`` (parity every 10 steps: window 50), and healed where its flipped range
    ends. Each group finishes at ``last`` with the state it holds then."""
    exits = exits or {}
    for g, pid in _FLIP_PIDS.items():
        recs: list[dict[str, object]] = []
        if g == "a":
            flip = {"kind": "bitflip", "group": "a", "pid": pid, "step": flip_step}
            recs.append({**flip, "param": "0.weight", "index": 5, "bit": 3, "parity_every": 10})
            recs[-1]["t"] = flip_step + 0.5
        mine = flipped.get(g, range(0))
        for s in range(1, last + 1):
            state = f"{g}{s}" if s in mine else f"s{s}"
            healed = g == "a" and bool(mine) and s == mine.stop
            # a commits first at even steps, last at odd ones (the fork rule's first holder).
            t = s + 1 + ({"a": 0.1, "b": 0.2, "c": 0.3}[g] if s % 2 else {"a": 0.3}.get(g, 0.1))
            recs.append(_commit(g, pid, s, 7, state, t, healed=healed, participants=3))
        final = f"{g}{last}" if last in mine else f"s{last}"
        recs.append(_finish(g, pid, last, final, last + 2.0))
        recs.sort(key=lambda r: float(r["t"]))  # type: ignore[arg-type]
        _write(path / f"{g}.history.jsonl", recs)
    procs = [_start(g, pid, 0.0) for g, pid in _FLIP_PIDS.items()]
    procs += [_exit(g, pid, last + 3.0, exits.get(g, 0)) for g, pid in _FLIP_PIDS.items()]
    _write(path / "processes.jsonl", procs)


def test_a_bit_flip_healed_within_its_window_is_excused(tmp_path: Path) -> None:
    """A flipped group whose commits differ from the others' for a few steps and then agree
    again (healed by runtime parity) keeps every invariant; the report counts the flip as
    healed and the excused disagreements."""
    _flip_run(tmp_path, last=30, flipped={"a": range(3, 9)})
    rep = check(tmp_path, target=30, min_replicas=1, groups=["a", "b", "c"])
    assert rep.violations == []
    assert (rep.bitflips, rep.bitflips_healed, rep.divergences_excused) == (1, 1, 6)
    assert rep.regressions == []
    assert "bit flips applied: 1 (healed within the detection window: 1)" in rep.text()


def test_a_bit_flip_not_healed_within_its_window_is_an_undetected_divergence(
    tmp_path: Path,
) -> None:
    """The same flip whose state still differs past the detection window (3 x 10 + 20 steps
    after it) and at the finish is an undetected divergence; its window's disagreements
    stay excused, no later one is."""
    _flip_run(tmp_path, last=60, flipped={"a": range(3, 61)})
    rep = check(tmp_path, target=60, min_replicas=1, groups=["a", "b", "c"])
    assert rep.bitflips == 1 and rep.bitflips_healed == 0
    assert rep.divergences_excused == 50  # steps 3..52
    undetected = [v for v in rep.violations if v.startswith("undetected divergence")]
    assert len(undetected) == 8 + 1  # steps 53..60, and the finish
    assert undetected[0] == (
        "undetected divergence: quorum 7 committed step 53 with 2 states, 51 steps after the "
        "bit flip in a (pid 1000301) at step 2 (detection window 50 steps)"
    )
    assert "undetected divergence: groups finished with 2 different states" in rep.violations


def test_a_bit_flip_excuses_only_its_own_group_and_one_state(tmp_path: Path) -> None:
    """Within a flip's window, a disagreement between two groups that cannot carry the flip
    (neither flipped nor healed since) is a violation, and so is a disagreement before the
    flip; one flip excuses one extra state, not two."""
    _flip_run(tmp_path, last=10, flipped={"b": range(5, 6), "c": range(1, 2)})
    rep = check(tmp_path, target=10, min_replicas=1, groups=["a", "b", "c"])
    assert rep.divergences_excused == 0
    assert "quorum 7 committed step 5 with 2 states" in rep.violations
    assert "quorum 7 committed step 1 with 2 states" in rep.violations
    _flip_run(tmp_path, last=10, flipped={"a": range(3, 5), "b": range(4, 5)})
    rep = check(tmp_path, target=10, min_replicas=1, groups=["a", "b", "c"])
    assert rep.divergences_excused == 1  # step 3: a's flipped state
    assert "quorum 7 committed step 4 with 3 states" in rep.violations
    assert not any("step 3" in v for v in rep.violations), rep.violations


def test_a_divergence_stop_counts_only_within_a_bit_flips_window(tmp_path: Path) -> None:
    """A process that exits with DIVERGED_EXIT within a bit flip's detection window stopped
    as runtime parity asked (counted, restarted); the same exit with no flip in the run, or
    past the window, is a false divergence stop."""
    from torchft.chaos.history import DIVERGED_EXIT

    _flip_run(tmp_path, last=30, flipped={"a": range(3, 9)}, exits={"b": DIVERGED_EXIT})
    rep = check(tmp_path, target=30, min_replicas=1, groups=["a", "b", "c"])
    assert rep.violations == [] and rep.divergence_stops == 1
    assert "divergence stops (exit 77 within a bit flip's window, restarted): 1" in rep.text()
    pid = _FLIP_PIDS["b"]
    false_stop = (
        f"process {pid} (b) stopped as diverged (exit 77) at step 60 with no bit flip within "
        "the detection window before it: a false divergence stop"
    )
    _flip_run(tmp_path, last=60, flipped={}, exits={"b": DIVERGED_EXIT})
    rep = check(tmp_path, target=60, min_replicas=1, groups=["a", "b", "c"])
    assert rep.violations == [false_stop] and rep.divergence_stops == 0
    _flip_run(tmp_path, last=60, flipped={"a": range(3, 9)}, exits={"b": DIVERGED_EXIT})
    rep = check(tmp_path, target=60, min_replicas=1, groups=["a", "b", "c"])
    assert rep.violations == [false_stop] and rep.divergence_stops == 0


def test_the_worker_flips_one_low_mantissa_bit_and_records_it(tmp_path: Path) -> None:
    """The bitflip fault changes exactly one of the low 16 bits of one float32 element of
    one parameter, in place, takes its file, and records what it flipped."""
    import torch
    from torch import nn

    from torchft.chaos.history import HistoryWriter, read_jsonl
    from torchft.chaos.worker import _bitflip

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flip_file = tmp_path / "g0.bitflip"
    flip_file.write_text("12345")
    writer = HistoryWriter(str(tmp_path / "h.jsonl"), "g0", 1)
    _bitflip(str(flip_file), model, writer, step=7, every=10)
    writer._f.close()
    assert not flip_file.exists()
    (rec,) = read_jsonl(tmp_path / "h.jsonl")
    assert rec["kind"] == "bitflip" and rec["step"] == 7 and rec["parity_every"] == 10
    changed = []
    for n, p in model.named_parameters():
        old = before[n].view(-1).view(torch.int32)
        new = p.detach().view(-1).view(torch.int32)
        for i in (old != new).nonzero().flatten().tolist():
            changed.append((n, i, int(old[i]) ^ int(new[i])))
    assert changed == [(rec["param"], rec["index"], 1 << rec["bit"])]
    assert 0 <= rec["bit"] < 16


def test_the_jitter_and_parity_flags_parse_and_bad_values_are_refused(tmp_path: Path) -> None:
    """--jitter and --parity-every reach the worker's flags and the run's config; a jitter
    outside [0, 1), a negative parity interval, or bit flips with parity off are refused."""
    from torchft.chaos.__main__ import main as chaos_main
    from torchft.chaos.worker import parse_args

    base = ["--group", "g0", "--history", "h", "--phase", "p", "--target-file", "t"]
    args = parse_args(base + ["--jitter", "0.5", "--parity-every", "10"])
    assert (args.jitter, args.parity_every) == (0.5, 10)
    assert parse_args(base).jitter == 0.0
    for bad in (["--jitter", "1.5"], ["--jitter", "-0.1"], ["--parity-every", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)
    ChaosConfig(seed=1, jitter=0.5, parity_every=10).validate()
    for cfg in (
        ChaosConfig(seed=1, jitter=1.0),
        ChaosConfig(seed=1, parity_every=-1),
        ChaosConfig(seed=1, parity_every=0),  # bitflip has a weight by default
    ):
        with pytest.raises(ValueError):
            cfg.validate()
    ChaosConfig(seed=1, parity_every=0, weights={"kill_one": 1.0}).validate()
    with pytest.raises(SystemExit):
        chaos_main(["--jitter", "2", "--out", str(tmp_path / "run")])


def test_lighthouse_verdicts_must_each_follow_an_injected_fault(tmp_path: Path) -> None:
    """The lighthouse's ``replica_hung`` and ``replica_diverged`` events (its event log in
    the run directory) are each explained by an injected fault: a hung verdict during an
    injected hang of that group, a divergence within a bit flip's window. Any other is a
    false verdict, a violation, even when the process acted on nothing."""
    _flip_run(tmp_path, last=30, flipped={"a": range(3, 9)})
    hang = _hang("b", _FLIP_PIDS["b"], 4, 5.0)
    _write(tmp_path / "b.history.jsonl", [*_read(tmp_path / "b.history.jsonl"), hang])
    events = [
        {"seq": 1, "ts": 16.0, "kind": "replica_hung", "replica_id": "b:1"},
        {"seq": 2, "ts": 13.0, "kind": "replica_diverged", "replica_id": "a:1", "step": 12},
    ]
    _write(tmp_path / "events.jsonl", events)
    rep = check(tmp_path, target=30, min_replicas=1, groups=["a", "b", "c"])
    assert rep.violations == []
    assert (rep.hung_verdicts, rep.diverged_verdicts) == (1, 1)
    assert "lighthouse verdicts, each explained by an injected fault: hung 1, diverged 1" in (
        rep.text()
    )
    false = [
        {"seq": 3, "ts": 16.0, "kind": "replica_hung", "replica_id": "c:1"},  # c never hung
        {"seq": 4, "ts": 31.0, "kind": "replica_hung", "replica_id": "b:1"},  # b's hang over
        {"seq": 5, "ts": 29.0, "kind": "replica_diverged", "replica_id": "b:1", "step": 60},
        {"seq": 6, "ts": 1.0, "kind": "replica_diverged", "replica_id": "b:1", "step": 2},
    ]
    _write(tmp_path / "events.jsonl", events + false)
    rep = check(tmp_path, target=30, min_replicas=1, groups=["a", "b", "c"])
    assert len(rep.violations) == 4, rep.violations
    assert sum("false hang verdict" in v for v in rep.violations) == 2
    assert sum("false divergence verdict" in v for v in rep.violations) == 2


def test_a_verdict_at_the_flips_own_step_is_explained(tmp_path: Path) -> None:
    """The flip happens at the top of the loop with s steps committed, before the digest of
    step s is taken: a divergence found at step s itself follows the flip."""
    _flip_run(tmp_path, last=30, flipped={"a": range(3, 9)})
    at_flip = {"seq": 1, "ts": 3.0, "kind": "replica_diverged", "replica_id": "a:1", "step": 2}
    _write(tmp_path / "events.jsonl", [at_flip])
    rep = check(tmp_path, target=30, min_replicas=1, groups=["a", "b", "c"])
    assert rep.violations == [] and rep.diverged_verdicts == 1
    # Before the flip in time, the same step is no explanation.
    _write(tmp_path / "events.jsonl", [{**at_flip, "ts": 2.0}])
    rep = check(tmp_path, target=30, min_replicas=1, groups=["a", "b", "c"])
    assert len(rep.violations) == 1 and "false divergence verdict" in rep.violations[0]


#: Fake pids of the checker's synthetic histories: never a live process here.
P1, P2, P3, P4, P5 = 10**6 + 1, 10**6 + 2, 10**6 + 3, 10**6 + 4, 10**6 + 5


def _total_loss_run(
    tmp_path: Path,
    restored_step: int = 4,
    restored_state: str = "s4",
    kill_t: float = 10.0,
    snapshot_step: int = 4,
    best: int = 6,
    holder_dies: float = 10.1,
    last: int = 6,
) -> list[str]:
    """Two groups commit steps 1..``last`` (pids 1, 2), a kill_all at ``kill_t`` kills both,
    two new processes (3, 4) restore a snapshot and re-commit the steps after it with new
    states together. Returns the checker's violations."""
    first = [
        _commit(g, pid, s, 10, f"s{s}", s * 10.0 / (last + 1), participants=2)
        for s in range(1, last + 1)
        for g, pid in (("a", P1),)
    ]
    first_b = [
        _commit("b", P2, s, 10, f"s{s}", s * 10.0 / (last + 1) + 0.01, participants=2)
        for s in range(1, last + 1)
    ]
    finish = [_finish(g, pid, last, f"n{last}", 30.0) for g, pid in (("a", P3), ("b", P4))]
    again = []
    for g, pid in (("a", P3), ("b", P4)):
        again.append(
            {
                "kind": "restore",
                "group": g,
                "pid": pid,
                "step": restored_step,
                "state": restored_state,
                "t": 20.0,
            }
        )
        again += [
            _commit(g, pid, s, 20, f"n{s}", 21.0 + s * 0.5 + (pid - P3) * 0.1, participants=2)
            for s in range(restored_step + 1, last + 1)
        ]
    _run(
        tmp_path,
        {
            "a.0": first,
            "b.0": first_b,
            "a.1": [again[i] for i in range(len(again) // 2)] + finish[:1],
            "b.1": again[len(again) // 2 :] + finish[1:],
        },
        [
            _start("a", P1, 0.0),
            _start("b", P2, 0.0),
            _killed("a", P1, 10.1),
            _killed("b", P2, holder_dies),
            _start("a", P3, 11.0),
            _start("b", P4, 11.0),
            _exit("a", P3, 31.0),
            _exit("b", P4, 31.0),
        ],
        [
            _fault(
                "kill_all",
                ["a", "b"],
                kill_t,
                best_step=best,
                snapshot_step=snapshot_step,
                snapshot_every=2,
                lighthouse=True,
                state_file_deleted=True,
            )
        ],
    )
    return check(tmp_path, target=last, min_replicas=1, groups=["a", "b"]).violations


def test_a_total_loss_resumed_from_the_newest_snapshot_is_no_violation(tmp_path: Path) -> None:
    """Both restarted groups restore step 4 with the state committed then and re-commit 5
    and 6 together with new states: one unavoidable regression, no violation (the second
    group's re-commit of a step matches the new reference, not the dead one's state)."""
    assert _total_loss_run(tmp_path) == []
    rep = check(tmp_path, target=6, min_replicas=1, groups=["a", "b"])
    assert len(rep.regressions) == 1
    assert rep.total_losses[0]["lost"] == 2 and rep.total_losses[0]["snapshot"] == 4
    assert "total losses (every group killed): 1" in rep.text()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"snapshot_step": 2, "best": 6}, "newest complete snapshot at the total loss was step 2"),
        ({"restored_state": "zz"}, "with a state no group had committed at that step"),
        ({"holder_dies": 22.0}, "a live group's progress was bypassed"),
        ({"snapshot_step": 4, "best": 9, "last": 9}, "more than two snapshot intervals"),
    ],
    ids=["older-snapshot", "other-state", "live-holder", "too-many-lost"],
)
def test_a_total_loss_check_can_fail(
    tmp_path: Path, kwargs: dict[str, object], expected: str
) -> None:
    """Resuming from a snapshot older than the newest complete one, holding a state never
    committed, restoring while a holder of a later step still lives, or losing more than two
    intervals: each is a violation that names what went wrong."""
    violations = _total_loss_run(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert any(expected in v for v in violations), violations


@pytest.mark.parametrize("recorded", [True, False], ids=["finish-recorded", "not-recorded"])
def test_a_restore_after_the_holders_finished_bypasses_no_one(
    tmp_path: Path, recorded: bool
) -> None:
    """Groups a and b train to the target (step 6) and shut down cleanly while c's killed
    process is away; their processes take a while to exit. c's new process, finding no one
    left to heal from, restores the snapshot of step 4 and trains on to the target: the
    finished processes held nothing then (the lighthouse recorded their clean shutdown),
    so no live holder was bypassed. Without that record they count as holders until their
    exit, and the same restore is a violation."""
    hist = {
        g: [_commit(g, pid, s, 10, f"s{s}", s + 0.01 * i, participants=3) for s in range(1, 7)]
        + [_finish(g, pid, 6, "s6", 7.0 + 0.01 * i)]
        for i, (g, pid) in enumerate((("a", P1), ("b", P2)))
    }
    hist["c.0"] = [_commit("c", P3, s, 10, f"s{s}", s + 0.02, participants=3) for s in (1, 2, 3, 4)]
    hist["c.1"] = [
        {"kind": "restore", "group": "c", "pid": P4, "step": 4, "state": "s4", "t": 8.2},
        _commit("c", P4, 5, 11, "s5", 8.3),
        _commit("c", P4, 6, 11, "s6", 8.4),
        _finish("c", P4, 6, "s6", 8.5),
    ]
    _run(
        tmp_path,
        {"a.0": hist["a"], "b.0": hist["b"], "c.0": hist["c.0"], "c.1": hist["c.1"]},
        [
            *_life("a", P1, 0.0, 9.0),
            *_life("b", P2, 0.0, 9.0),
            _start("c", P3, 0.0),
            _killed("c", P3, 4.5),
            *_life("c", P4, 8.0, 9.5),
        ],
        [_fault("kill_one", ["c"], 4.5, best=4, best_left=4)],
    )
    events = [
        {"seq": i + 1, "ts": 7.05 + 0.01 * i, "kind": "replica_finished", "replica_id": g}
        for i, g in enumerate(("a", "b"))
    ]
    _write(tmp_path / "events.jsonl", events if recorded else [])
    violations = check(tmp_path, target=6, min_replicas=1, groups=["a", "b", "c"]).violations
    bypassed = [v for v in violations if "bypassed" in v]
    if recorded:
        assert bypassed == [], violations
    else:
        assert len(bypassed) == 1 and f"pid {P4}" in bypassed[0], violations


def _writer_gone_run(
    tmp_path: Path,
    a_out_after: int | None,
    how: str = "kill",
    reported: tuple[tuple[int, float], ...] = (),
    failed: tuple[tuple[int, float, str, str], ...] = (),
    flips: tuple[tuple[str, float], ...] = (),
) -> list[str]:
    """Groups a (participating rank 0) and b (rank 1) commit together with snapshots every 2
    steps (b writes 2 and 6, a writes 4); after committing ``a_out_after`` (None: never), a
    is killed (and restarts, still healing at the total loss) or stopped (``how``), and b
    commits on alone to step 7; ``how="pause"`` stops a for a moment only (it commits on
    with b). A kill_all at t=10 finds snapshot 2 the newest complete
    one; two new processes restore it and re-commit 3..7. ``reported``: the lighthouse's
    ``snapshot_complete`` events, as (step, time); ``failed``: ``snapshot_failed``
    events, as (step, time, error, group); ``flips``: bit flips injected, as (group, time).
    Returns the checker's violations."""
    together = a_out_after if a_out_after is not None and how != "pause" else 7
    hist_a = [_commit("a", P1, s, 10, f"s{s}", s, participants=2, rank=0) for s in range(1, 8)]
    hist_b = [
        _commit("b", P2, s, 10, f"s{s}", s + 0.1, participants=2, rank=1)
        if s <= together
        else _commit("b", P2, s, 11, f"s{s}", s + 0.1, participants=1, rank=0)
        for s in range(1, 8)
    ]
    procs = [_start("a", P1, 0.0), _start("b", P2, 0.0)]
    faults = []
    if a_out_after is None:
        procs.append(_killed("a", P1, 10.1))
    elif how == "kill":
        hist_a = hist_a[:a_out_after]
        procs += [_killed("a", P1, a_out_after + 0.5), _start("a", P5, a_out_after + 0.6)]
        procs += [_killed("a", P5, 10.1)]
        faults.append(_fault("kill_one", ["a"], a_out_after + 0.4))
    elif how == "stop":
        hist_a = hist_a[:a_out_after]
        procs.append(_killed("a", P1, 10.1))
        faults.append(_fault("stop", ["a"], a_out_after + 0.4, seconds=20.0))
    else:  # stopped for a moment: a commits on with b
        procs.append(_killed("a", P1, 10.1))
        faults.append(_fault("stop", ["a"], a_out_after + 0.4, seconds=0.3))
    procs += [_killed("b", P2, 10.1), *_life("a", P3, 11.0, 31.0), *_life("b", P4, 11.0, 31.0)]
    faults.append(
        _fault("kill_all", ["a", "b"], 10.0, best_step=7, snapshot_step=2, snapshot_every=2)
    )
    faults += [_fault("bitflip", [g], ft, best_step=int(ft)) for g, ft in flips]
    faults.sort(key=lambda f: float(str(f["t"])))
    again: dict[str, list[dict[str, object]]] = {}
    for g, pid in (("a", P3), ("b", P4)):
        again[g] = [{"kind": "restore", "group": g, "pid": pid, "step": 2, "state": "s2", "t": 20}]
        again[g] += [
            _commit(g, pid, s, 20, f"n{s}", 20.0 + s + (pid - P3) * 0.1, participants=2)
            for s in range(3, 8)
        ]
        again[g].append(_finish(g, pid, 7, "n7", 30.0))
    histories = {"a.0": hist_a, "b.0": hist_b, "a.1": again["a"], "b.1": again["b"]}
    _run(tmp_path, histories, procs, faults)
    events = [
        {"ts": ts, "kind": "snapshot_complete", "replica_id": "a", "step": step}
        for step, ts in reported
    ] + [
        {"ts": ts, "kind": "snapshot_failed", "replica_id": g, "step": step, "error": error}
        for step, ts, error, g in failed
    ]
    events = [
        {"seq": i + 1, **e} for i, e in enumerate(sorted(events, key=lambda e: float(str(e["ts"]))))
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return check(tmp_path, target=7, min_replicas=1, groups=["a", "b"]).violations


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_snapshot_whose_writer_never_reached_the_next_excuses_an_interval(
    tmp_path: Path, how: str
) -> None:
    """Two faults, two snapshots lost: the writer of step 4 (a) was killed (or stopped for
    good) right after it, then the kill_all came while b's snapshot 6 was in flight.
    Resuming from snapshot 2 loses 5 steps, more than two intervals, and is no violation:
    a never reached step 6, so snapshot 4 may not have been complete; b, the writer of 2,
    went on past 4."""
    assert _writer_gone_run(tmp_path, a_out_after=4, how=how) == []
    rep = check(tmp_path, target=7, min_replicas=1, groups=["a", "b"])
    loss = rep.total_losses[0]
    assert (loss["bound"], loss["unfinished"], loss["lost"]) == (2, [4], 5)
    expected = "best step 7 -> snapshot 2: 5 lost; writers of [4] did not reach the next snapshot"
    assert expected in rep.text()


@pytest.mark.parametrize(
    ("a_out_after", "how"), [(None, "kill"), (4, "pause")], ids=["writers-alive", "paused"]
)
def test_the_snapshot_excuse_needs_a_writer_that_stopped_short(
    tmp_path: Path, a_out_after: int | None, how: str
) -> None:
    """With both groups alive to the total loss, or the writer of step 4 stopped for a
    moment after it and then committing past step 6 before the loss, snapshot 4 must have
    been complete: resuming from 2 is a violation naming more than two intervals."""
    violations = _writer_gone_run(tmp_path, a_out_after=a_out_after, how=how)
    assert any("more than two snapshot intervals" in v for v in violations), violations
    rep = check(tmp_path, target=7, min_replicas=1, groups=["a", "b"])
    assert rep.total_losses[0]["bound"] == 4 and rep.total_losses[0]["unfinished"] == []


_DIVERGED_4 = (
    "not made complete: the parity check found this group's state different from the other "
    "groups' at step 4, at or after the snapshot's step 4: " + DIVERGED_SNAPSHOT
)


@pytest.mark.parametrize(
    ("error", "group", "flipped", "excused"),
    [
        (_DIVERGED_4, "a", True, True),
        (_DIVERGED_4, "a", False, False),
        (_DIVERGED_4, "b", True, False),
        ("not made complete: parity did not confirm it within 90 s", "a", True, False),
    ],
    ids=["diverged", "no-bit-flip", "not-the-writer", "timed-out"],
)
def test_a_snapshot_refused_as_diverged_excuses_an_interval(
    tmp_path: Path, error: str, group: str, flipped: bool, excused: bool
) -> None:
    """Both groups alive to the total loss, but the snapshot of step 4 (written by a) was
    refused: the parity check had found a's state diverged after a bit flip, and a
    diverged state never becomes a snapshot. Resuming from 2 then loses no more than the
    product allows. A refusal with no bit flip injected into its group, one reported by a
    group that does not write that step, or a snapshot that failed for another reason
    (its parity check never came) excuses nothing."""
    flips = ((group, 4.2),) if flipped else ()
    violations = _writer_gone_run(
        tmp_path, a_out_after=None, failed=((4, 4.5, error, group),), flips=flips
    )
    rep = check(tmp_path, target=7, min_replicas=1, groups=["a", "b"])
    loss = rep.total_losses[0]
    if excused:
        assert violations == []
        assert (loss["bound"], loss["diverged"], loss["unfinished"]) == (2, [4], [])
        assert "snapshots of [4] refused as diverged" in rep.text()
    else:
        assert any("more than two snapshot intervals" in v for v in violations), violations
        assert (loss["bound"], loss["diverged"]) == (4, [])


@pytest.mark.parametrize(
    ("reported", "lost"),
    [(((2, 2.6), (4, 4.3)), True), (((2, 2.6), (4, 10.4)), False), (((2, 2.6),), False)],
    ids=["reported-before-the-kill", "reported-after-the-kill", "not-reported"],
)
def test_a_snapshot_reported_complete_before_the_kill_must_be_resumed_from(
    tmp_path: Path, reported: tuple[tuple[int, float], ...], lost: bool
) -> None:
    """The writer of step 4 (a) told the lighthouse its snapshot was complete, then died
    before step 6: the excuse for a writer that stopped short does not cover it, and
    resuming from 2 is a lost complete snapshot. A report logged after the kill, or none
    (lost with its writer), proves nothing, and the excuse stands."""
    violations = _writer_gone_run(tmp_path, a_out_after=4, how="kill", reported=reported)
    named = [v for v in violations if "a complete snapshot was lost" in v]
    if lost:
        assert len(named) == 1 and "told snapshot 4 was complete" in named[0], violations
    else:
        assert violations == []
    rep = check(tmp_path, target=7, min_replicas=1, groups=["a", "b"])
    assert rep.total_losses[0]["reported"] == ((4, 4.3) if lost else (2, 2.6))


def test_after_a_total_loss_the_first_commit_must_follow_the_snapshot(tmp_path: Path) -> None:
    """Groups that trained from scratch after a total loss (first commit step 1, no restore)
    are a violation when a snapshot existed."""
    _run(
        tmp_path,
        {
            "a.0": [_commit("a", P1, s, 10, f"s{s}", float(s)) for s in (1, 2, 3)],
            "a.1": [_commit("a", P2, s, 20, f"s{s}", 20.0 + s) for s in (1, 2, 3)]
            + [_finish("a", P2, 3, "s3", 30.0)],
        },
        [_start("a", P1, 0.0), _killed("a", P1, 10.1), *_life("a", P2, 11.0, 31.0)],
        [_fault("kill_all", ["a"], 10.0, best_step=3, snapshot_step=2, snapshot_every=2)],
    )
    violations = check(tmp_path, target=3, min_replicas=1, groups=["a"]).violations
    assert any("did not resume from the snapshot" in v for v in violations), violations


def test_a_killed_process_s_last_commit_after_the_kill_record_is_not_the_resume(
    tmp_path: Path,
) -> None:
    """A killed process may write a commit line in the instant between the kill's record
    and its death: only processes started after the kill show where the run resumed, and
    that trailing commit's death is explained by the total loss."""
    _total_loss_run(tmp_path)
    trailing = _commit("a", P1, 7, 10, "s7", 10.05)
    with open(tmp_path / "a.0.history.jsonl", "a") as f:
        f.write(json.dumps(trailing) + "\n")
    assert check(tmp_path, target=6, min_replicas=1, groups=["a", "b"]).violations == []


def test_participant_counts_are_held_against_the_groups_that_committed(tmp_path: Path) -> None:
    """At min_replicas 1 the participant bound alone cannot fail, so each (quorum, step) is
    also held against its committers: three groups committing one step together without a
    heal, each saying it had 1 participant, is a violation; so are members of one quorum
    reporting different counts and more participants than the run has groups. A member that
    healed into the step may sit it out (async quorum): 2 participants of 3 committers is
    fine when the third healed."""
    pids = {"a": 10**6 + 401, "b": 10**6 + 402, "c": 10**6 + 403}  # surely not running

    def run(counts: dict[str, int], healed: str = "") -> list[str]:
        _run(
            tmp_path,
            {
                g: [
                    _commit(g, pid, 1, 5, "s1", 1.0, healed=g == healed, participants=counts[g]),
                    _finish(g, pid, 1, "s1", 2),
                ]
                for g, pid in pids.items()
            },
            [rec for g, pid in pids.items() for rec in _life(g, pid, 0.0, 3.0)],
        )
        return check(tmp_path, target=1, min_replicas=1, groups=sorted(pids)).violations

    assert run({"a": 3, "b": 3, "c": 3}) == []
    assert run({"a": 2, "b": 2, "c": 2}, healed="c") == []
    low = run({"a": 1, "b": 1, "c": 1})
    assert len(low) == 3 and all("but 3 groups at its max step" in v for v in low), low
    mixed = run({"a": 3, "b": 3, "c": 2}, healed="c")
    assert mixed == [
        "quorum 5 step 1: its members reported [2, 3] participants (one quorum has one count)"
    ]
    high = run({"a": 4, "b": 4, "c": 4})
    assert len(high) == 3 and all("more than the run's 3 groups" in v for v in high), high


def test_a_restart_asked_for_after_a_commit_is_a_violation(tmp_path: Path) -> None:
    """Exit 75 (TornStateError) is a restart the product asks for only when a heal or
    snapshot restore into the process's own tensors was torn, which happens only before its
    first commit: the same exit from a process that had committed is unexplained, and the
    run's result fails on it."""
    from torchft.chaos.history import RESTART_EXIT

    big = 10**6 + 500  # pids that are surely not running here
    history = [
        _commit("a", big, 1, 1, "s1", 0.4),
        _commit("a", big + 1, 2, 2, "s2", 1.0),
        _finish("a", big + 1, 2, "s2", 3.0),
    ]
    exits = [*_life("a", big, 0.0, 0.5, rc=RESTART_EXIT), *_life("a", big + 1, 0.6, 4.0)]
    _run(tmp_path, {"a": history}, exits)
    rep = check(tmp_path, target=2, min_replicas=1, groups=["a"])
    assert rep.restarts_asked == 0
    assert rep.violations == [
        f"process {big} (a) asked for a restart (exit {RESTART_EXIT}) after it had "
        "committed: no torn heal explains it"
    ]
    # The run's result (as `python -m torchft.chaos --check` gives it) fails on it.
    from torchft.chaos.__main__ import _recheck

    (tmp_path / "target").write_text("2")
    assert _recheck(tmp_path) == 1
    # Before its first commit the same exit is a restart asked for, and the result is OK.
    _write(tmp_path / "a.history.jsonl", _read(tmp_path / "a.history.jsonl")[1:])
    assert _recheck(tmp_path) == 0
