"""The `pagoda` command: serve | generate | chat | bench (throughput, serve) | plan | tune |
quantize.

A user error (a wrong path, flag value or config file, a model larger than the machine's memory,
a port in use) ends the command with one `error: ...` line on stderr and exit code 2; with
`--log-level debug` its traceback is printed first. Every other exception is a bug and keeps
Python's traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from pagoda.chat_commands import help_text, parse_chat_line

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Exceptions a user causes and can fix. ValueError is what every config, flag and input check
# in Pagoda raises; the OSErrors are paths; MemoryError is a model larger than the machine.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    MemoryError,
)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def _sampling_params(args: argparse.Namespace):  # noqa: ANN202
    from pagoda.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        output_kind=RequestOutputKind.DELTA,
    )


def _make_engine(args: argparse.Namespace):  # noqa: ANN202
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.disable_log_stats = True
    config = engine_args.create_engine_config()
    check_model_fits_in_memory(config)
    return LLMEngine(config, log_stats=False)


def _total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def check_model_fits_in_memory(config: Any) -> None:
    """On a CPU, refuse a model whose dense weights exceed the machine's memory: loading it
    would end in the kernel's OOM killer (SIGKILL, no message) rather than an error. On CUDA
    the memory plan reports it; quantized layers may stay packed, so their size is not known
    here."""
    from pagoda.model.loader.hf_config import estimated_weight_bytes

    mc = config.model_config
    if config.device_config.device != "cpu" or mc.quantization is not None:
        return
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(mc.dtype, 4)
    need, total = estimated_weight_bytes(mc.hf_config, itemsize), _total_memory_bytes()
    if total is not None and need > total:
        raise ValueError(
            f"the model's weights take {need / 2**30:.1f} GiB in {mc.dtype}, more than this "
            f"machine's {total / 2**30:.1f} GiB of memory: use a smaller or quantized model"
            + (" (or --dtype bfloat16)" if itemsize == 4 else "")
        )


def check_listen_address(host: str, port: int) -> None:
    """Refuse a port outside [0, 65535], a host that does not resolve, or an address already
    in use, before the engine is built (uvicorn would find out only after the model loads)."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve: {e.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def check_engine_start(engine_args: Any) -> Any:
    """What an engine built from `engine_args` would refuse at start-up, checked in this
    process: `pagoda serve` builds its engine in a child process, whose failure would come
    with that process's traceback in its log.

    Without torch (the arguments, the model's path and config, max_model_len) always; the rest
    (quantization, architecture, weight files, memory) only where torch is already imported
    (`pagoda serve`): a front end that has not imported it (`python -m
    pagoda.entrypoints.openai.api_server`) is not made to, for a check the engine core repeats.
    Returns the `EngineConfig` it made for that (None without torch), for the caller to build
    the engine from instead of making it again (and logging its warnings twice).
    """
    engine_args.check_model_config()
    if "torch" not in sys.modules:
        return None
    from pagoda.model.registry import supported_architectures

    config = engine_args.create_engine_config()
    mc = config.model_config
    if mc.architecture not in supported_architectures():
        raise ValueError(
            f"{mc.model}: model architecture {mc.architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    if mc.load_format != "dummy" and os.path.isdir(mc.model):
        from pagoda.model.loader.weights import find_weight_files

        find_weight_files(mc.model)
    check_model_fits_in_memory(config)
    return config


def _stream(engine, request_id: str, prompt, params) -> Iterator[str]:  # noqa: ANN001
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for comp in out.outputs:
                if comp.text:
                    yield comp.text


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    prompt = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = engine.input_processor.encode(text, add_special_tokens=False)
        prompt = {"prompt": text, "prompt_token_ids": ids}
    for piece in _stream(engine, "generate-0", prompt, _sampling_params(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # bad sampling flags end the command before it starts
    engine = _make_engine(args)
    tok = engine.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Pagoda chat. Type /help for the commands, /reset to clear the history, /exit (or "
          "Ctrl-D) to quit.")  # fmt: skip
    turn = 0
    while True:
        try:
            line = parse_chat_line(input("> "))
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except UnicodeDecodeError:  # a terminal's strict UTF-8 stdin
            print("[error] that line is not valid UTF-8")
            continue
        if line.error is not None:  # an unknown command is not sent to the model
            print(f"[error] {line.error}")
            continue
        if line.command in ("/exit", "/quit"):
            return 0
        if line.command == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if line.command == "/help":
            print(help_text())
            continue
        if line.text is None:  # a blank line
            continue
        messages.append({"role": "user", "content": line.text})
        reply = []
        try:  # a turn that fails (text that is not valid Unicode, too long a history) is its own
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = engine.input_processor.encode(text, add_special_tokens=False)
            prompt = {"prompt": text, "prompt_token_ids": ids}
            for piece in _stream(engine, f"chat-{turn}", prompt, params.clone()):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            print(f"\n[error] {e}")
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        turn += 1


def _engine_parser(sub, name: str, help: str) -> argparse.ArgumentParser:  # noqa: ANN001
    from pagoda.engine.arg_utils import EngineArgs

    p = sub.add_parser(name, help=help)
    EngineArgs.add_cli_args(p)
    return p


# Subcommands that run without torch in this process (`pagoda plan ...`, `pagoda tune ...`,
# `pagoda serve ...`, whose engine runs in its own process) build only their own parser (the
# quantize command's module imports torch, seconds of start). A server's front end without
# torch starts ~3 s sooner and holds ~190 MB less; what it cannot check without torch, its
# engine core refuses at start with the same one-line error.
_LIGHT_COMMANDS = ("plan", "serve", "tune")


def _light_command(argv: list[str]) -> str | None:
    """The subcommand named in `argv` when it is one of `_LIGHT_COMMANDS`."""
    words = [a for a in argv if not a.startswith("-")]
    skip_value = "--log-level" in argv and argv.index("--log-level") + 1 < len(argv)
    if skip_value and words and words[0] == argv[argv.index("--log-level") + 1]:
        words = words[1:]
    return words[0] if words and words[0] in _LIGHT_COMMANDS else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if only is not None:
        from pagoda.plan import add_plan_args
        from pagoda.server.cli import add_serve_args
        from pagoda.tune import add_tune_args

        {"plan": add_plan_args, "serve": add_serve_args, "tune": add_tune_args}[only](sub)
        return parser

    from pagoda.server.cli import add_serve_args

    add_serve_args(sub)

    p = _engine_parser(sub, "generate", "generate a completion for one prompt")
    p.add_argument("prompt", type=str)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = _engine_parser(sub, "chat", "interactive chat with the model")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = help_text()
    p.add_argument("--system", type=str, default=None, help="system prompt")
    _add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagoda.bench.throughput import add_throughput_args

    add_throughput_args(_engine_parser(bench, "throughput", "offline throughput"))
    from pagoda.bench.serve import add_bench_serve_args

    add_bench_serve_args(bench.add_parser("serve", help="load-test an OpenAI-compatible server"))

    from pagoda.plan import add_plan_args

    add_plan_args(sub)
    from pagoda.tune import add_tune_args

    add_tune_args(sub)

    from pagoda.quantize import add_quantize_args

    add_quantize_args(sub)
    return parser


def add_log_level_flag(parser: argparse.ArgumentParser, top: bool = True) -> None:
    """--log-level on `parser` and each of its subcommands, so it goes before or after the
    subcommand's name."""
    if "--log-level" not in parser._option_string_actions:  # noqa: SLF001
        parser.add_argument(
            "--log-level",
            type=str.lower,
            choices=LOG_LEVELS,
            default=None if top else argparse.SUPPRESS,
            help="Pagoda's log level (default: $PAGODA_LOGGING_LEVEL, else info); debug also "
            "prints the traceback of a user error",
        )
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                add_log_level_flag(sub, top=False)


def set_log_level(level: str | None) -> None:
    """Pagoda's loggers at `level` (None: $PAGODA_LOGGING_LEVEL, else info), in this process
    and, through the environment, in the processes it spawns (engine core, workers)."""
    from pagoda import envs
    from pagoda.logger import init_logger

    level = (level or envs.PAGODA_LOGGING_LEVEL).upper()
    envs.set_logging_level(level)
    init_logger("pagoda").setLevel(level)


def user_error_message(e: BaseException) -> str | None:
    """One line for an exception the user can fix (`USER_ERRORS`, running out of memory, an
    engine core that exited at start-up after logging why); None for a bug."""
    torch = sys.modules.get("torch")
    core_client = sys.modules.get("pagoda.engine.core_client")
    if isinstance(e, USER_ERRORS):
        message = str(e) or "out of memory"
    elif torch is not None and isinstance(e, torch.OutOfMemoryError):
        message = f"out of memory: {e}"
    elif isinstance(e, RuntimeError) and "can't allocate memory" in str(e):  # torch on CPU
        message = f"out of memory: {e}"
    elif core_client is not None and isinstance(e, core_client.EngineCoreStartError):
        message = str(e)
    else:
        return None
    return " ".join(message.split())


def run_command(func: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> int:
    """`func(args)` as a command: its return value as the exit code, a user error as one
    `error:` line and code 2, Ctrl-C as code 130; a bug raises with its traceback."""
    set_log_level(getattr(args, "log_level", None))
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:
        message = user_error_message(e)
        if message is None:
            raise
        return report_user_error(message)


def report_user_error(message: str) -> int:
    """A user error as a command reports it, inside its `except`: one `error:` line on
    stderr (the traceback first at --log-level debug); returns exit code 2."""
    if logging.getLogger("pagoda").isEnabledFor(logging.DEBUG):
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    return 2


# Said of a command-line argument that is only whitespace, which no flag takes and no path is.
BLANK_ARGUMENT_HINT = (
    "an argument that is only whitespace: in a command continued over several lines, a "
    "backslash followed by a space (as before a '# comment') passes a space and ends the "
    "command there; end each continued line with the backslash"
)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, with a usage error for unrecognized arguments that shows
    an argument of only whitespace quoted and says where such an argument comes from
    (`BLANK_ARGUMENT_HINT`): argparse's message leaves it invisible."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        shown = " ".join(a if a.strip() else repr(a) for a in extra)
        blank = any(not a.strip() for a in extra)
        parser.error(
            f"unrecognized arguments: {shown}" + (f" ({BLANK_ARGUMENT_HINT})" if blank else "")
        )
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = _light_command(argv)
    parser = build_parser(only=only)
    add_log_level_flag(parser)
    args = parse_args(parser, argv)  # --help and usage errors exit here, before torch loads
    if only is None:
        # The other engine commands run torch in this process.
        import torch  # noqa: F401
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
