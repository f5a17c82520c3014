"""One replica group running LocalSGD or streaming DiLoCo, for tests that mix torchft builds.

Uses only upstream torchft's public API, so the same script runs against this package or
against upstream torchft 0.2.0 (chosen by ``PYTHONPATH``). Heals go through
:class:`FileTransport`, a transport written here that both builds accept: their default
transports speak different wire formats (this package never unpickles peer data), and the
point of these tests is the state each build registers, not the bytes on the wire.

A group started with ``--wait-for FILE`` trains to ``--pause-at`` committed steps, says so
in ``--paused``, and then waits for FILE (written by a late group once it runs) before going
on, so that the late group heals from it; the late group, started with ``--start-after``
that file, imports torch meanwhile and joins once it appears. Every group stops once it has committed ``--steps`` steps and saves
its final state (``torch.save``) to ``--result``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing import CheckpointTransport
from torchft.local_sgd import DiLoCo, LocalSGD

FRAGMENT_PREFIX = "StreamingDiLoCoFragment_"


class FileTransport(CheckpointTransport):
    """Serves the state as a file in this group's folder; receivers load it from there."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def metadata(self) -> str:
        return str(self._folder)

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        tmp = self._folder / f"step_{step}.tmp"
        torch.save(state_dict, tmp)
        os.replace(tmp, self._folder / f"step_{step}.pt")

    def disallow_checkpoint(self) -> None:
        pass

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        path = Path(metadata) / f"step_{step}.pt"
        deadline = time.monotonic() + timeout.total_seconds()
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {timeout}")
            time.sleep(0.01)
        return torch.load(path, weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        pass


def _say(what: str) -> None:
    print(f"{time.time():.2f} {what}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["localsgd", "diloco"], required=True)
    ap.add_argument("--replica-id", required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pause-at", type=int, default=2)
    ap.add_argument("--wait-for", type=Path)
    ap.add_argument("--paused", type=Path)
    ap.add_argument("--start-after", type=Path)
    ap.add_argument("--ready", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    _say("started")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    if args.start_after is not None:
        deadline = time.monotonic() + 60
        while not args.start_after.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    timeout = timedelta(seconds=20)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=False,
        replica_id=args.replica_id,
        store_addr="127.0.0.1",
        store_port=args.store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        checkpoint_transport=FileTransport(args.folder),
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    if args.mode == "localsgd":
        algo: Any = LocalSGD(manager, model, inner, sync_every=2)
    else:
        fragments = [model[0], model[2]]
        outer = [
            torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments
        ]
        algo = DiLoCo(manager, fragments, inner, outer, sync_every=4, fragment_sync_delay=1)
    if args.ready is not None:
        args.ready.write_text("ready")

    _say("training")
    g = torch.Generator().manual_seed(args.seed)
    steps_seen: list[int] = []
    try:
        with algo:
            while manager.current_step() < args.steps:
                step = manager.current_step()
                if not steps_seen or steps_seen[-1] != step:
                    steps_seen.append(step)
                if args.wait_for is not None and step >= args.pause_at:
                    if args.paused is not None:
                        args.paused.write_text(str(step))
                    deadline = time.monotonic() + 60
                    while not args.wait_for.exists() and time.monotonic() < deadline:
                        time.sleep(0.02)
                    args.wait_for = None
                x = torch.randn(4, 3, generator=g)
                y = torch.randn(4, 2, generator=g)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                inner.step()
        user = manager._manager_state_dict()["user"]
        torch.save(
            {
                "step": manager.current_step(),
                "steps_seen": steps_seen,
                "params": [p.detach().clone() for p in model.parameters()],
                "fragments": {k: v for k, v in user.items() if k.startswith(FRAGMENT_PREFIX)},
            },
            args.result,
        )
    finally:
        _say("shutting down")
        manager.shutdown(wait=False)
        _say("shut down")


if __name__ == "__main__":
    main()
