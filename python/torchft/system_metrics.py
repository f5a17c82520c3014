"""The host's and the GPU's side of a rank's step reports, sampled at most once a second.

Each step report carries the host's load average (1 minute, per CPU), its memory (total and
available), its network throughput over the interfaces other than loopback, the share of its
CPU time the hypervisor stole, and the rank's GPU utilisation and memory through NVML.
Reading ``/proc`` costs tens of microseconds, so a sample is taken at most every
:data:`SAMPLE_EVERY_S` and reused by the steps in between. Fail-open: a source that cannot
be read reports 0 (the GPU: ``gpu`` false) and is not tried again.

The GPU is looked at only once CUDA is initialised in this process (a rank that trains on the
CPU has none), through the ``pynvml`` module of NVIDIA's ``nvidia-ml-py`` package; without it,
or without a driver, the GPU fields stay off.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

logger: logging.Logger = logging.getLogger(__name__)

#: Seconds between two samples at most as often.
SAMPLE_EVERY_S = 1.0


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("ascii", "replace")
    except OSError:
        return None


def meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from ``/proc/meminfo``'s text; (0, 0) when absent."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[name] = int(parts[0]) * 1024
    total = found.get("MemTotal", 0)
    return total, min(found.get("MemAvailable", 0), total)


def net_bytes(text: str) -> tuple[int, int]:
    """(received, sent) bytes summed over the interfaces of ``/proc/net/dev`` but ``lo``."""
    rx = tx = 0
    for line in text.splitlines()[2:]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name.strip() == "lo" or len(fields) < 9:
            continue
        try:
            rx += int(fields[0])
            tx += int(fields[8])
        except ValueError:
            continue
    return rx, tx


def cpu_steal(text: str) -> tuple[int, int]:
    """(steal, total) jiffies from the ``cpu`` line of ``/proc/stat``; (0, 0) when absent."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            try:
                values = [int(v) for v in line.split()[1:]]
            except ValueError:
                return 0, 0
            # user nice system idle iowait irq softirq steal [guest guest_nice]: the guest
            # times are already counted in user and nice.
            busy = values[:8]
            return (busy[7] if len(busy) > 7 else 0), sum(busy)
    return 0, 0


class _Gpu:
    """The rank's CUDA device through NVML, once CUDA is up; off for good after a failure."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._nvml: Any = None
        self._off = False

    def _open(self) -> bool:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return False  # not yet (or never): asked again at the next sample
        try:
            import pynvml  # type: ignore[import-not-found, import-untyped, unused-ignore]

            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            bus = getattr(props, "pci_bus_id", None)
            if bus is not None:
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(
                    f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:"
                    f"{getattr(props, 'pci_device_id', 0):02x}.0"
                )
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as e:  # noqa: BLE001 - fail-open: no GPU metrics, said once
            logger.debug("GPU metrics off (NVML unavailable: %s)", e)
            self._off = True
            return False
        self._nvml, self._handle = pynvml, handle
        return True

    def sample(self) -> tuple[float, int, int] | None:
        """(utilisation percent, memory used, memory total), or None without a GPU."""
        if self._off or (self._handle is None and not self._open()):
            return None
        try:
            util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            total = int(mem.total)
            return min(max(util, 0.0), 100.0), min(int(mem.used), total), total
        except Exception as e:  # noqa: BLE001 - fail-open
            logger.debug("GPU metrics off (NVML query failed: %s)", e)
            self._off = True
            return None


class HostSampler:
    """The system fields of a step report (the names of ``TelemetryReport``'s fields)."""

    def __init__(self) -> None:
        self._at = -math.inf
        self._net: tuple[int, int, float] | None = None
        self._cpu: tuple[int, int] | None = None
        self._gpu = _Gpu()
        self._cpus = os.cpu_count() or 1
        self._last: dict[str, Any] = {
            "host_load": 0.0,
            "host_mem_total_bytes": 0,
            "host_mem_available_bytes": 0,
            "net_rx_bytes_per_s": 0.0,
            "net_tx_bytes_per_s": 0.0,
            "host_steal": 0.0,
            "gpu": False,
            "gpu_util_pct": 0.0,
            "gpu_mem_used_bytes": 0,
            "gpu_mem_total_bytes": 0,
        }

    def sample(self) -> dict[str, Any]:
        """The fields now: a fresh sample when the last one is over a second old."""
        now = time.monotonic()
        if now - self._at < SAMPLE_EVERY_S:
            return self._last
        self._at = now
        out = dict(self._last)
        try:
            # The kernel updates it only every few seconds.
            out["host_load"] = os.getloadavg()[0] / self._cpus
        except OSError:
            out["host_load"] = 0.0
        text = _read("/proc/meminfo")
        if text is not None:
            total, available = meminfo(text)
            out["host_mem_total_bytes"], out["host_mem_available_bytes"] = total, available
        text = _read("/proc/net/dev")
        if text is not None:
            rx, tx = net_bytes(text)
            if self._net is not None and now > self._net[2]:
                dt = now - self._net[2]
                out["net_rx_bytes_per_s"] = max(0.0, (rx - self._net[0]) / dt)
                out["net_tx_bytes_per_s"] = max(0.0, (tx - self._net[1]) / dt)
            self._net = (rx, tx, now)
        text = _read("/proc/stat")
        if text is not None:
            steal, total_j = cpu_steal(text)
            if self._cpu is not None and total_j > self._cpu[1]:
                share = (steal - self._cpu[0]) / (total_j - self._cpu[1])
                out["host_steal"] = min(max(share, 0.0), 1.0)
            self._cpu = (steal, total_j)
        gpu = self._gpu.sample()
        if gpu is not None:
            out["gpu"] = True
            out["gpu_util_pct"], out["gpu_mem_used_bytes"], out["gpu_mem_total_bytes"] = gpu
        self._last = out
        return out
