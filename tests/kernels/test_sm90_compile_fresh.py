"""test_sm90_compile.py in a fresh process, where this one's triton.language was imported for
the interpreter (its jit helpers then cannot be compiled here; see that module)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.slow


def test_sm90_builds_in_a_fresh_process() -> None:
    if type(triton.language.cdiv).__name__ != "InterpretedFunction":
        pytest.skip("triton.language is compiled in this process: test_sm90_compile builds here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    target = os.path.join(os.path.dirname(__file__), "test_sm90_compile.py")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider", target],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
