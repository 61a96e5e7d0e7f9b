"""GPU memory for `/metrics`, read when Prometheus scrapes: `pagoda:gpu_memory_used_bytes` and
`pagoda:gpu_memory_total_bytes`, one series per GPU (label `gpu`, its index).

The engine runs in another process, so this reads the device as a whole, the way
`nvidia-smi` does: through NVML (`pynvml`, from the nvidia-ml-py package) where it imports,
else `nvidia-smi`'s CSV. The front end never creates a CUDA context for it. On a machine without
an NVIDIA GPU neither answers and no series is exported.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

# (index, used bytes, total bytes) per GPU.
GPUMemory = list[tuple[int, int, int]]


def _read_nvml() -> GPUMemory | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            out.append((i, int(info.used), int(info.total)))
        return out
    except Exception:  # noqa: BLE001 - NVML errors (no driver, no device) mean "no GPU"
        return None


def _read_nvidia_smi() -> GPUMemory | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout  # fmt: skip
        rows = [line.split(",") for line in text.strip().splitlines() if line.strip()]
        return [(int(i), int(float(u)) << 20, int(float(t)) << 20) for i, u, t in rows]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def read_gpu_memory() -> GPUMemory:
    """Every GPU's memory in use and in all; [] without a GPU."""
    return _read_nvml() or _read_nvidia_smi() or []


class GPUMemoryCollector:
    """Exports `read` (`read_gpu_memory` by default) at each scrape, at most once a second
    (nvidia-smi takes tens of milliseconds)."""

    def __init__(self, model_name: str, read: Callable[[], GPUMemory] | None = None) -> None:
        self.model_name = model_name
        self.read = read or read_gpu_memory
        self._cached: tuple[float, GPUMemory] = (0.0, [])

    def _memory(self) -> GPUMemory:
        now = time.monotonic()
        if now - self._cached[0] >= 1.0:
            self._cached = (now, self.read())
        return self._cached[1]

    def collect(self) -> Iterator[Any]:
        labels = ["model_name", "gpu"]
        used = GaugeMetricFamily("pagoda:gpu_memory_used_bytes",
                                 "GPU memory in use on the device (all processes).", labels=labels)  # fmt: skip
        total = GaugeMetricFamily("pagoda:gpu_memory_total_bytes", "GPU memory in all.",
                                  labels=labels)  # fmt: skip
        for index, u, t in self._memory():
            used.add_metric([self.model_name, str(index)], u)
            total.add_metric([self.model_name, str(index)], t)
        yield used
        yield total
