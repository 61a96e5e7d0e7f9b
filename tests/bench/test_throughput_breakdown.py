"""`pagoda bench throughput --host-breakdown`: the engine's host stages are timed per step,
and their times fit inside the run."""

from __future__ import annotations

import json

from pagoda.cli import main


def test_host_breakdown_times_every_stage(tmp_path, capsys) -> None:
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", "--num-prompts", "4", "--input-len", "24", "--output-len", "6"]
    assert main([*argv, "--host-breakdown", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    b = result["host_breakdown"]
    assert b["steps"] >= 6  # at least one step per generated token
    stages = ("schedule", "launch", "wait", "update", "outputs")
    assert all(b[s]["ms_per_step"] >= 0 for s in stages)
    assert b["launch"]["ms_per_step"] > 0 and b["schedule"]["ms_per_step"] > 0
    assert sum(b[s]["share"] for s in stages) <= 1.0
    assert "Host per step" in capsys.readouterr().out
