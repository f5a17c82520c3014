"""The system side of the step reports: parsing the host's /proc files, sampling at most once
a second, and the GPU through NVML where there is one (skipped without CUDA)."""

from __future__ import annotations

import time

import pytest
import torch

from torchft import system_metrics
from torchft.system_metrics import HostSampler, cpu_steal, meminfo, net_bytes

MEMINFO = """MemTotal:       24576000 kB
MemFree:          512000 kB
MemAvailable:   12288000 kB
Buffers:          100000 kB
"""

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 9999999     100    0    0    0     0          0         0  9999999     100    0    0    0     0       0          0
  eth0: 1000        10    0    0    0     0          0         0     2000      20    0    0    0     0       0          0
  eth1:  500         5    0    0    0     0          0         0      700       7    0    0    0     0       0          0
"""

STAT = """cpu  100 0 50 800 10 0 5 35 0 0
cpu0 50 0 25 400 5 0 2 18 0 0
"""


@pytest.mark.timeout(10)
def test_proc_files_are_parsed_and_loopback_left_out() -> None:
    assert meminfo(MEMINFO) == (24576000 * 1024, 12288000 * 1024)
    assert meminfo("garbage\n") == (0, 0)
    assert meminfo("MemTotal: 10 kB\nMemAvailable: 20 kB\n") == (10240, 10240)
    assert net_bytes(NET_DEV) == (1500, 2700)
    assert net_bytes("") == (0, 0)
    assert cpu_steal(STAT) == (35, 1000)
    assert cpu_steal("cpu  x y\n") == (0, 0)


@pytest.mark.timeout(20)
def test_sampler_reads_this_host_once_a_second() -> None:
    s = HostSampler()
    first = s.sample()
    assert first["host_mem_total_bytes"] > 0
    assert 0 < first["host_mem_available_bytes"] <= first["host_mem_total_bytes"]
    assert s.sample() is first, "reused within a second"
    time.sleep(system_metrics.SAMPLE_EVERY_S + 0.05)
    second = s.sample()
    assert second is not first
    assert second["net_rx_bytes_per_s"] >= 0 and second["net_tx_bytes_per_s"] >= 0
    assert 0.0 <= second["host_steal"] <= 1.0
    if not torch.cuda.is_initialized():
        assert second["gpu"] is False and second["gpu_mem_total_bytes"] == 0


@pytest.mark.timeout(20)
def test_unreadable_sources_report_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system_metrics, "_read", lambda path: None)
    got = HostSampler().sample()
    assert got["host_mem_total_bytes"] == 0 and got["net_rx_bytes_per_s"] == 0.0
    assert got["host_steal"] == 0.0


@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_utilisation_and_memory_through_nvml() -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    x = torch.ones(1 << 20, device="cuda")
    s = HostSampler()
    got = s.sample()
    assert got["gpu"] is True, got
    assert 0 <= got["gpu_util_pct"] <= 100
    assert 0 < got["gpu_mem_used_bytes"] <= got["gpu_mem_total_bytes"]
    del x
