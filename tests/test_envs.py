"""`pagoda.envs`: each variable parsed by one rule, read when used, refused with its name when
it does not parse; the README's table is the module's; no other module touches the
environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagoda import envs

REPO = Path(__file__).resolve().parents[1]


def test_flags_take_the_usual_spellings(monkeypatch) -> None:
    monkeypatch.delenv("PAGODA_CUDA_DECODE", raising=False)
    assert envs.PAGODA_CUDA_DECODE is True
    for value, want in (("0", False), ("off", False), ("FALSE", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("PAGODA_CUDA_DECODE", value)
        assert envs.PAGODA_CUDA_DECODE is want, value
    monkeypatch.setenv("PAGODA_CUDA_DECODE", "maybe")
    with pytest.raises(ValueError, match="PAGODA_CUDA_DECODE must be 0 or 1"):
        _ = envs.PAGODA_CUDA_DECODE


def test_unset_tri_state_flag_is_none(monkeypatch) -> None:
    monkeypatch.delenv("PAGODA_PROGRESS", raising=False)
    assert envs.PAGODA_PROGRESS is None
    monkeypatch.setenv("PAGODA_PROGRESS", "0")
    assert envs.PAGODA_PROGRESS is False


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_cpu_threads_must_be_a_positive_integer(monkeypatch, value: str) -> None:
    monkeypatch.setenv("PAGODA_CPU_THREADS", value)
    with pytest.raises(ValueError, match="PAGODA_CPU_THREADS must be a positive integer"):
        _ = envs.PAGODA_CPU_THREADS


def test_values_are_read_at_each_use(monkeypatch) -> None:
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    assert envs.PAGODA_CPU_THREADS is None
    monkeypatch.setenv("PAGODA_CPU_THREADS", " 3 ")
    assert envs.PAGODA_CPU_THREADS == 3
    monkeypatch.setenv("PAGODA_EXECUTE_MODEL_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="PAGODA_EXECUTE_MODEL_TIMEOUT_S must be a positive"):
        _ = envs.PAGODA_EXECUTE_MODEL_TIMEOUT_S
    monkeypatch.setenv("PAGODA_LOGGING_LEVEL", "debug")
    assert envs.PAGODA_LOGGING_LEVEL == "DEBUG"
    with pytest.raises(AttributeError):
        _ = envs.PAGODA_NO_SUCH_VARIABLE


def test_readme_lists_every_variable() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert envs.markdown_table() in readme


def test_no_other_module_reads_the_environment() -> None:
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "pagoda").rglob("*.py"))
        if path.name != "envs.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"os\.environ|getenv", line)
    ]
    assert not found, found
