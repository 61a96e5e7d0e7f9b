"""`w4a16_skinny_bench.py --top`: a sweep JSON's fastest configs per (shape, M), read on a
CPU (no timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from w4a16_skinny_bench import top_configs  # noqa: E402

ROWS = [
    {"shape": "o", "m": 64, "variant": "cublas_bf16", "us": 16.1},
    {"shape": "o", "m": 64, "variant": "default", "us": 25.2},
    {"shape": "o", "m": 64, "variant": "wgmma", "us": 23.0, "config": [64, 1, 4, 2, 0, 1, 2]},
    {"shape": "o", "m": 64, "variant": "wgmma", "us": 22.3, "config": [64, 1, 4, 4, 1, 2, 1]},
    {"shape": "o", "m": 64, "variant": "wgmma", "us": 30.0, "config": [64, 4, 4, 2, 0, 1, 1]},
    {"shape": "o", "m": 64, "variant": "cuda", "us": 40.0, "config": [1, 8]},
    {"shape": "qkv", "m": 32, "variant": "wgmma", "us": 17.9, "config": [32, 2, 4, 2, 4, 1, 2]},
]


def test_the_fastest_configs_of_a_family_by_row_count_then_shape() -> None:
    lines = top_configs(ROWS, "wgmma", 2)
    assert len(lines) == 2
    assert lines[0].startswith("qkv") and " 32 " in lines[0] and "nan" in lines[0]
    assert "cublas   16.1 default   25.2" in lines[1]
    assert lines[1].endswith("22.3 [64, 1, 4, 4, 1, 2, 1]; 23.0 [64, 1, 4, 2, 0, 1, 2]")
    assert top_configs(ROWS, "cuda", 3)[1].endswith("40.0 [1, 8]")


def test_the_command_reads_the_json_of_out(tmp_path) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": ROWS}))
    script = os.path.join(REPO, "benchmarks", "w4a16_skinny_bench.py")
    out = subprocess.run(
        [sys.executable, script, "--top", "1", "--out", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.splitlines()[1].endswith("22.3 [64, 1, 4, 4, 1, 2, 1]")
