"""`import pagoda` makes OpenMP threads sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE)
before torch loads libgomp, and keeps a policy the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = "import os, pagoda, torch; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, "PASSIVE"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
        ({"GOMP_SPINCOUNT": "1000"}, "None"),
    ],
)
def test_wait_policy(env, expected):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
