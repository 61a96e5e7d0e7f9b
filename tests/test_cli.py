"""The `pagoda` command line: generate and chat on the embedded model."""

from __future__ import annotations

import subprocess
import sys


def _pagoda(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_generate_prints_a_greedy_completion() -> None:
    proc = _pagoda(
        "generate", "The capital of France is", "--max-tokens", "5", "--temperature", "0"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # five tokens of text


def test_chat_answers_and_exits_on_eof() -> None:
    proc = _pagoda("chat", "--max-tokens", "8", "--temperature", "0", stdin="Hello!\n/reset\n")
    assert proc.returncode == 0, proc.stderr
    assert "Pagoda chat" in proc.stdout
    reply = proc.stdout.split("> ", 1)[1]
    assert reply.strip()


def test_bad_flag_value_is_a_clear_error() -> None:
    proc = _pagoda("generate", "hi", "--max-model-len", "999999")
    assert proc.returncode == 2
    assert "max_model_len" in proc.stderr
