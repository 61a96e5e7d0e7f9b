"""The `pagoda` command line: generate and chat on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


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


def test_a_chat_turn_that_fails_is_its_own_and_bad_sampling_flags_end_it_at_once() -> None:
    # A line of invalid UTF-8 (stdin decodes it to lone surrogates) is one turn's error; the
    # next turn is answered.
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "chat", "--max-tokens", "4", "--temperature", "0"],
        input=b"\xff\xfe bad\nHello!\n",
        capture_output=True,
        timeout=180,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:surrogateescape"},
    )
    out = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 0, proc.stderr.decode()
    assert "[error]" in out and out.count("> ") >= 2
    proc = _pagoda("chat", "--temperature", "5", stdin="Hello!\n")
    assert proc.returncode == 2 and "temperature" in proc.stderr
    assert "Pagoda chat" not in proc.stdout


def test_an_unknown_chat_command_is_reported_not_sent_to_the_model() -> None:
    # "/foo" is reported with the commands there are, and the session goes on: "/ hello" is
    # text (a "/" before a space), answered; /help lists the commands; /exit ends it.
    proc = _pagoda(
        "chat", "--max-tokens", "2", "--temperature", "0", stdin="/foo\n/ hello\n/help\n/exit\n"
    )
    assert proc.returncode == 0, proc.stderr
    turns = proc.stdout.split("> ")[1:]
    assert len(turns) == 4, proc.stdout  # three lines answered, then /exit
    assert turns[0].startswith("[error] unknown command /foo: the commands are /help, /reset, ")
    assert turns[1].strip() and "[error]" not in turns[1]  # the model's two tokens
    assert turns[2].startswith("Commands (a line whose first word is /name):")
    assert "/reset" in _pagoda("chat", "--help").stdout


def test_chat_lines_starting_with_a_slash_are_commands_only_when_they_name_one() -> None:
    from pagoda.chat_commands import ChatLine, parse_chat_line

    assert parse_chat_line(" /reset ") == ChatLine(command="/reset")
    assert parse_chat_line("/quit") == ChatLine(command="/quit")
    assert "unknown command /rest" in parse_chat_line("/rest").error
    assert "unknown command /etc" in parse_chat_line("/etc holds config").error
    assert "takes no arguments" in parse_chat_line("/reset the counter").error
    for text in ("/ hello", "/usr/bin is a directory", "/2 of them", "hello /reset", "/é"):
        assert parse_chat_line(text) == ChatLine(text=text)
    assert parse_chat_line("//etc holds config") == ChatLine(text="/etc holds config")
    assert parse_chat_line("   ") == ChatLine()


def test_bad_flag_value_is_a_clear_error() -> None:
    proc = _pagoda("generate", "hi", "--max-model-len", "999999")
    assert proc.returncode == 2
    assert "max_model_len" in proc.stderr


def test_cli_and_engine_import_without_the_server_packages() -> None:
    # The GPU image has no fastapi, uvicorn or pydantic: the CLI's parser, the engine and the
    # offline benchmark must import without them (only `serve` needs them).
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("fastapi", "uvicorn", "pydantic", "starlette"):
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, Block())
        from pagoda.cli import build_parser
        import pagoda.bench.throughput, pagoda.engine.llm_engine
        args = build_parser().parse_args(["bench", "throughput", "--num-prompts", "2"])
        print("ok", args.func.__name__)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok run_throughput" in out.stdout
