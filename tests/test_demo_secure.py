"""The demo job, run as ``make demo DEMO_SECURE=1`` runs it, end to end: a lighthouse daemon
with a token and mutual TLS, replica groups as real processes under torchrun, one SIGKILLed
and healed from a live peer over the secured checkpoint transport, every group ending with
bit-identical state, and the lighthouse refusing plain, token-less and certificate-less
clients over HTTP and gRPC."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_secure_demo_job_heals_over_tls_and_refuses_strangers(tmp_path: Path) -> None:
    """examples/demo.py --secure: kill, heal over https with the token, identical state,
    and every refusal check of the demo refused."""
    logs = tmp_path / "logs"
    env = dict(os.environ)
    for var in [k for k in env if k.startswith("TORCHFT_")]:
        del env[var]  # the demo sets up its own token and certificates
    env.update(
        LOGLEVEL="INFO",  # the groups log where they heal from
        TMPDIR=str(tmp_path),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", ""),
    )
    # Two groups against --min_replicas 2: the survivor cannot finish without the
    # restarted group, so the heal is exercised however slowly the restart goes.
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "demo.py"),
        "--secure",
        "--replicas",
        "2",
        "--steps",
        "30",
        "--kill-at",
        "10",
        "--step-sleep",
        "0.02",
        "--timeout",
        "240",
        "--log-dir",
        str(logs),
    ]
    # The demo stops its own lighthouse and groups on SIGINT (and on its --timeout).
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        pytest.fail("the demo did not finish in time:\n" + out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "RESULT: OK" in out, out

    # The lighthouse refused every stranger, each for the reason it should.
    refusals = [line for line in out.splitlines() if line.startswith("security check: ")]
    assert len(refusals) == 7 and all(r.endswith("(refused)") for r in refusals), out
    assert "token + mutual TLS      : enforced" in out, out
    assert re.search(r"lighthouse at https://", out), out

    # Group 1 was SIGKILLed, restarted and committed again; all ended bit-identical.
    assert re.search(r"SIGKILL replica group 1 \(pid \[\d+", out), out
    assert re.search(r"replica group 1 healed from a live peer and committed step", out), out
    assert "identical final state   : yes (1 distinct hash(es) over 2 groups)" in out, out

    # The heal travelled over TLS, token included: the restarted incarnation fetched from
    # an https:// checkpoint server (which serves nothing else) and received the state.
    group1 = (logs / "group1.log").read_text(errors="replace")
    restarted = group1[group1.rindex("start step=0") :]
    assert re.search(r"healing from replica \d+ \(https://localhost:\d+", restarted), restarted
    assert re.search(r"received checkpoint step=\d+ from replica \d+", restarted), restarted
    assert "http://" not in "".join(
        line for line in restarted.splitlines() if "checkpoint" in line
    ), restarted
