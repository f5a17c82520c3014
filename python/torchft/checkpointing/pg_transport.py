"""Process-group checkpoint transport: pushes the live state over torch send/recv.

The source sends, to each destination rank, a small metadata tensor (header length and
CRC), the JSON header (as a uint8 tensor) and then every tensor's raw bytes, in header
order. The receiver rebuilds the structure with the same safe decoder as the HTTP path
(no pickle). Given a ``state_dict`` callable, tensors are received in place into the
matching local tensors (same path, dtype, shape and device), so no extra memory is used.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from torchft.checkpointing import _serialization as ser
from torchft.checkpointing.transport import CheckpointTransport, _timeout_from_env

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

_TAG = 0


def _wire_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Flat contiguous uint8 view of ``t`` on ``device`` (copies only when needed)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device != device:
        t = t.to(device)
    return t.contiguous().reshape(-1).view(torch.uint8)


class PGTransport(CheckpointTransport[T]):
    """Sends checkpoints with point-to-point ops on a torch ``ProcessGroup``.

    Args:
        pg: the process group; ranks passed to send/recv are ranks in this group.
        timeout: default bound on a transfer (overridden by ``TORCHFT_TIMEOUT_SEC``).
        device: device the wire tensors live on (``cpu`` for Gloo, a CUDA device for NCCL);
            received tensors are placed here.
        state_dict: optional callable returning the local state dict; matching tensors are
            overwritten in place instead of allocating new ones.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        timeout: timedelta,
        device: torch.device,
        state_dict: Callable[[], T] | None = None,
    ) -> None:
        self._pg = pg
        self._timeout = _timeout_from_env(timeout)
        self._device = torch.device(device)
        self._state_dict = state_dict

    def metadata(self) -> str:
        """Returns a constant: peers are addressed by rank in the process group."""
        return "<n/a>"

    def _wait(self, works: list[Any], deadline: float, what: str) -> None:
        for work in works:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"checkpoint {what} timed out")
            try:
                ok = work.wait(timedelta(seconds=remaining))
            except RuntimeError as e:
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    raise TimeoutError(f"checkpoint {what} timed out: {e}") from e
                raise
            if ok is False:
                raise TimeoutError(f"checkpoint {what} timed out")

    @property
    def receives_in_place(self) -> bool:
        """True when given ``state_dict``: receives write into the local tensors."""
        return self._state_dict is not None

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Sends ``state_dict`` for ``step`` to every rank in ``dst_ranks`` (blocking).

        Args:
            dst_ranks: destination ranks in the process group.
            step: the step the state belongs to.
            state_dict: the state to send.
            timeout: bound on the whole send.

        Raises:
            TypeError: the state contains an unsupported value.
            TimeoutError: a destination did not receive in time.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        enc = ser.encode(state_dict, meta={"step": step})
        header = torch.frombuffer(bytearray(enc.header), dtype=torch.uint8).to(self._device)
        info = torch.tensor(
            [len(enc.header), zlib.crc32(enc.header)], dtype=torch.int64, device=self._device
        )
        payload = [
            _wire_view(t, self._device)
            for t, s in zip(enc.tensors, enc.specs, strict=True)
            if s.nbytes
        ]
        works = []
        for dst in dst_ranks:
            works.append(self._pg.send([info], dst, _TAG))
            works.append(self._pg.send([header], dst, _TAG))
            for buf in payload:
                works.append(self._pg.send([buf], dst, _TAG))
        self._wait(works, deadline, f"send of step {step} to {dst_ranks}")
        logger.info(
            "sent checkpoint step=%d to %s (%d bytes)", step, dst_ranks, enc.total_tensor_bytes
        )

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Receives the state of ``step`` from ``src_rank``.

        Args:
            src_rank: source rank in the process group.
            metadata: unused.
            step: the expected step.
            timeout: bound on the whole transfer.

        Returns:
            The state dict; tensors that matched the local state dict are the local
            tensors, updated in place.

        Raises:
            TimeoutError: the source did not send in time.
            RuntimeError: wrong step or malformed header.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        info = torch.zeros(2, dtype=torch.int64, device=self._device)
        self._wait([self._pg.recv([info], src_rank, _TAG)], deadline, "header size receive")
        length, crc = (int(x) for x in info.cpu().tolist())
        if not 0 <= length <= ser.MAX_HEADER_BYTES:
            raise ser.CheckpointFormatError(f"invalid checkpoint header length {length}")
        header_t = torch.empty(length, dtype=torch.uint8, device=self._device)
        self._wait([self._pg.recv([header_t], src_rank, _TAG)], deadline, "header receive")
        raw = header_t.cpu().numpy().tobytes()
        if zlib.crc32(raw) != crc:
            raise ser.CheckpointFormatError("checkpoint header checksum mismatch")
        header = ser.parse_header(raw)
        got = header.meta.get("step")
        if got != step:
            raise RuntimeError(f"rank {src_rank} sent the state of step {got!r}, expected {step}")

        targets = self._inplace_targets(header)
        out: list[torch.Tensor | None] = []
        works = []
        for i, spec in enumerate(header.specs):
            dst = targets.get(i)
            if dst is None:
                dst = torch.empty(spec.shape, dtype=spec.torch_dtype, device=self._device)
            out.append(dst)
            if spec.nbytes:
                works.append(self._pg.recv([dst.reshape(-1).view(torch.uint8)], src_rank, _TAG))
        self._wait(works, deadline, f"receive of step {step} from rank {src_rank}")
        logger.info(
            "received checkpoint step=%d from rank %d (%d tensors, %d in place)",
            step,
            src_rank,
            len(out),
            len(targets),
        )
        return cast(T, ser.build(header, out))

    def _inplace_targets(self, header: ser.Header) -> dict[int, torch.Tensor]:
        if self._state_dict is None:
            return {}
        return ser.inplace_targets(header, self._state_dict(), lambda t: t.device == self._device)
