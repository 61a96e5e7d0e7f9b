"""A user error ends a `pagoda` command with one `error: ...` line on stderr and exit code 2, no
traceback (unless --log-level debug); a bug keeps its traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest
from model_testing import TINY_CONFIG


def _pagoda(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", *args], capture_output=True, text=True, timeout=180
    )


def _assert_one_error_line(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and needle in line, line


def _config_dir(path, **overrides) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, **overrides}))
    return str(path)


@pytest.mark.parametrize(
    "case, needle",
    [
        ("no_such_model", "'/no/such/model' not found"),
        ("bad_config_file", "config.json: hidden_size must be a positive integer"),
        # One embedding of 2**40 x 64 floats: refused from the config, before any allocation.
        ("model_too_big", "more than this machine's"),
        ("port_in_use", "Address already in use"),
        # Before the model loads (it came after, and the process then never exited).
        ("bad_generation_config", "generation_config.json: top_p must be a number in (0, 1]"),
    ],
)
def test_serve_user_error_is_one_line(tmp_path, case, needle) -> None:
    if case == "no_such_model":
        proc = _pagoda("serve", "/no/such/model")
    elif case == "bad_config_file":
        proc = _pagoda("serve", _config_dir(tmp_path / "m", hidden_size="sixty-four"))
    elif case == "model_too_big":
        model = _config_dir(tmp_path / "m", vocab_size=2**40)
        # (no tokenizer.json either: that refusal would come first)
        proc = _pagoda(
            "serve", model, "--load-format", "dummy", "--device", "cpu", "--skip-tokenizer-init"
        )
    elif case == "bad_generation_config":
        model = _config_dir(tmp_path / "m")
        (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"top_p": 5}))
        proc = _pagoda("serve", model)
    else:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            proc = _pagoda("serve", "--port", str(busy.getsockname()[1]))
    _assert_one_error_line(proc, needle)


def test_a_server_that_fails_to_start_shuts_its_engine_down() -> None:
    """An error building the app after the engine started (its core process, its output
    thread) shuts the engine down: the error was printed and the process never exited."""
    import argparse

    from pagoda.server.cli import add_server_flags, serve

    class Engine:
        shut_down, tokenizer = False, None

        @property
        def model_config(self):
            raise ValueError("bad model folder")

        def shutdown(self) -> None:
            self.shut_down = True

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    engine = Engine()
    with pytest.raises(ValueError, match="bad model folder"):
        serve(engine, parser.parse_args(["--max-waiting-requests", "-1"]))
    assert engine.shut_down


def test_api_server_user_error_is_one_line() -> None:
    # vLLM's module path: its front end checks what it can without importing torch.
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--max-model-len", "99999"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    _assert_one_error_line(proc, "max_model_len (99999) is larger than the model's")


def test_front_end_checks_without_importing_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        from pagoda.cli import check_engine_start, check_listen_address
        from pagoda.engine.arg_utils import EngineArgs
        check_listen_address("127.0.0.1", 0)
        check_engine_start(EngineArgs(max_model_len=512))
        print("torch" in sys.modules)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_log_level_debug_adds_the_traceback() -> None:
    proc = _pagoda("generate", "hi", "--model", "/no/such/model", "--log-level", "debug")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model '/no/such/model'")


def test_a_bug_keeps_its_traceback() -> None:
    code = textwrap.dedent(
        """
        import sys
        from pagoda import cli
        from pagoda.engine import arg_utils
        def broken(self):
            raise KeyError("a bug, not a user error")
        arg_utils.EngineArgs.create_engine_config = broken
        sys.exit(cli.main(["generate", "hi"]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "KeyError: 'a bug, not a user error'" in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["bench", "throughput", "--help"], ["nosuch"]])
def test_help_and_usage_errors_do_not_import_torch(argv) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from pagoda.cli import main
        try:
            main({argv!r})
        except SystemExit:
            pass
        print("torch" in sys.modules, file=sys.stderr)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr


def test_python_dash_m_pagoda_is_the_pagoda_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: pagoda ")
    for command in ("serve", "generate", "chat", "bench", "plan", "tune", "quantize"):
        assert command in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda", "generate", "--max-tokens", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "usage: pagoda generate" in proc.stderr


def test_a_blank_argument_is_shown_and_explained(capsys) -> None:
    """A server command pasted with a backslash before a '# comment' on a continued line (as
    printed in a vLLM tutorial) passes ' ' as an argument and ends there: the error says so
    instead of showing an invisible argument or a model path of ' '."""
    from pagoda.cli import main
    from pagoda.entrypoints.openai import api_server

    pasted = ["--model", "/m", "--max-num-seqs", "128", " "]
    with pytest.raises(SystemExit) as exit_info:
        api_server.main(pasted)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: unrecognized arguments: ' ' (an argument that is only whitespace" in last
    assert "a backslash followed by a space" in last
    # `pagoda serve` takes the blank as its positional model: one error line, the same hint.
    assert main(["serve", *pasted]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: the model argument is ' ', an argument that is only whitespace")
    # Other unrecognized arguments keep argparse's message.
    with pytest.raises(SystemExit):
        main(["serve", "/m", "--no-such-flag"])
    assert capsys.readouterr().err.strip().endswith("error: unrecognized arguments: --no-such-flag")
