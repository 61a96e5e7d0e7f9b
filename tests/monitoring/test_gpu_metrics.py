"""GPU memory in /metrics: exported per GPU where one is found, absent where none is."""

from __future__ import annotations

from pagoda.metrics import gpu
from pagoda.metrics.prometheus import PrometheusStatLogger


def test_gpu_memory_is_exported_per_gpu_where_there_is_one(monkeypatch):
    monkeypatch.setattr(gpu, "read_gpu_memory", lambda: [(0, 3 << 30, 80 << 30), (1, 1, 2)])
    text = PrometheusStatLogger("m", 128).render().decode()
    assert 'pagoda:gpu_memory_used_bytes{gpu="0",model_name="m"} 3.221225472e+09' in text
    assert 'pagoda:gpu_memory_total_bytes{gpu="1",model_name="m"} 2.0' in text


def test_no_gpu_no_series(monkeypatch):
    monkeypatch.setattr(gpu, "read_gpu_memory", lambda: [])
    assert "gpu_memory" not in PrometheusStatLogger("m", 128).render().decode()


def test_nvidia_smi_csv_is_read_in_bytes(monkeypatch):
    class Done:
        stdout = "0, 1024, 81559\n1, 0, 81559\n"

    monkeypatch.setattr(gpu, "_read_nvml", lambda: None)
    monkeypatch.setattr(gpu.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpu.subprocess, "run", lambda *a, **k: Done())
    assert gpu.read_gpu_memory() == [(0, 1024 << 20, 81559 << 20), (1, 0, 81559 << 20)]
