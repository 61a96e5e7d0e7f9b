"""`pagoda serve [MODEL]`: command-line flags, start-up and graceful shutdown of the server.

Flags are `EngineArgs.add_cli_args` (vLLM's names) plus the server's own (`add_server_flags`):
where it listens, the API key, chat templates, admission (the waiting-queue bound and the
queue-delay limit), request limits, engine-core restarts and the drain. SIGTERM drains: the
engine refuses new requests (503, /health turns 503), in-flight requests run to completion for
at most --drain-timeout seconds, after which each gets an error (in-band in a stream) and the
server exits within 2 s more. A second SIGTERM or SIGINT exits at once. An engine core that
dies is restarted up to --max-engine-restarts times; after that the server exits with code 1,
for its supervisor (systemd, Kubernetes) to restart it. uvicorn is imported only to serve (`pagoda.server.draining`), so the other
subcommands (`pagoda bench throughput`, `generate`) run where it is not installed.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from pagoda import envs

logger = logging.getLogger("pagoda.server")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the Jinja template itself."""
    if not value:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template: {value!r} is neither a file nor a Jinja template; "
        "pass the path of a .jinja file or the template text"
    )


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key: --api-key, or the contents of --api-key-file, or $PAGODA_API_KEY."""
    key, path = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if key is not None and path is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {path}: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file: {path} is empty")
    return key if key is not None else envs.PAGODA_API_KEY


def _has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions  # noqa: SLF001 - argparse has no public lookup


def add_server_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine's flags and the HTTP server's to `parser`."""
    from pagoda.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route except /health and /metrics. "
        "A key given here shows in the process list (ps) to every user of the machine: prefer "
        "--api-key-file or $PAGODA_API_KEY (default: --api-key-file, else $PAGODA_API_KEY)",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        help="read the API key from this file (surrounding whitespace stripped)",
    )
    g.add_argument(
        "--chat-template", default=None, help="chat template: a .jinja file or the template text"
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run chat templates sent in requests (`chat_template`); they are refused otherwise."
        " They render in a worker process, sandboxed, within --preprocess-timeout seconds",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="with tool_choice 'auto' (the default when a request has tools), read tool calls "
        "out of the output with --tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>: "
        'Hermes 2 Pro, Qwen2.5, Qwen3), llama3_json ({"name": ..., "parameters": ...}: '
        "Llama 3.1-3.3), mistral ([TOOL_CALLS][{...}]: Mistral 7B v0.3, Nemo, Small), "
        'pythonic ([get_weather(city="Paris")]: Llama 3.2, Llama 4)',
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="request bodies larger than this get HTTP 413 (default: 4 MiB)",
    )
    g.add_argument(
        "--preprocess-timeout",
        type=float,
        default=30.0,
        help="seconds one request's tokenizing or chat templating may take (HTTP 400 past it)",
    )
    if not _has_flag(parser, "--served-model-name"):
        g.add_argument(
            "--served-model-name",
            nargs="+",
            default=None,
            help="name(s) the API answers to (default: the model path)",
        )
    if not _has_flag(parser, "--max-waiting-requests"):
        g.add_argument(
            "--max-waiting-requests",
            type=int,
            default=None,
            help="requests waiting to be scheduled, beyond the running batch's free places, "
            "past which new ones get HTTP 503 with Retry-After (0: no queue beyond what runs; "
            "-1: unbounded; default: as many as the KV cache holds at --max-model-len, at "
            "most --max-num-seqs)",
        )
    g.add_argument(
        "--max-queue-delay-s",
        type=float,
        default=None,
        help="a request not scheduled after this many seconds gets HTTP 503 (default: none)",
    )
    g.add_argument(
        "--max-engine-restarts",
        type=int,
        default=3,
        help="times the engine core is restarted after it fails; then the server exits with "
        "code 1 (default: 3)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM, seconds to let in-flight requests finish before they are cut off",
    )
    g.add_argument(
        "--enable-server-load-tracking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="count the requests to /v1/completions and /v1/chat/completions in progress, "
        "which GET /load reports as server_load (without it, 0)",
    )
    g.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    return parser


def add_serve_args(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve [MODEL]` on the CLI's subparsers; the lead wires it to `run_server`."""
    parser = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (completions, chat, /metrics).",
    )
    parser.add_argument(
        "model_tag", nargs="?", default=None, help="model path (default: the embedded model)"
    )
    add_server_flags(parser)
    parser.set_defaults(func=run_server)
    return parser


def make_arg_parser() -> argparse.ArgumentParser:
    """The parser of `python -m pagoda.entrypoints.openai.api_server --model ...`."""
    parser = argparse.ArgumentParser(description="Pagoda OpenAI-compatible server")
    add_server_flags(parser)
    if not _has_flag(parser, "--model"):
        parser.add_argument("--model", default=None, help="model path (default: embedded)")
    return parser


def run_server(args: argparse.Namespace) -> None:
    """Build the engine from `args` (see add_server_flags), then serve until SIGTERM/SIGINT."""
    from pagoda.cli import check_engine_start, check_listen_address
    from pagoda.config import embedded_model_path
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.generation_config import get_diff_sampling_param

    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None and not model_tag.strip():
        from pagoda.cli import BLANK_ARGUMENT_HINT

        raise ValueError(f"the model argument is {model_tag!r}, {BLANK_ARGUMENT_HINT}")
    if model_tag:
        args.model = model_tag
    if not getattr(args, "model", None):
        args.model = embedded_model_path()
    chat_template = load_chat_template(args.chat_template)
    args.api_key = resolve_api_key(args)
    check_server_flags(args)
    engine_args = EngineArgs.from_cli_args(args)
    # User errors found here are one line, before the engine core starts (the checks that need
    # torch run there, with the same one-line error).
    check_listen_address(args.host, args.port)
    # The model's generation_config.json is the server's to read (`build_app`): a bad one is
    # refused here, before the model loads, not after.
    get_diff_sampling_param(engine_args.model, engine_args.generation_config, log=False)
    check_engine_start(engine_args)
    engine = AsyncLLM.from_engine_args(
        engine_args,
        max_waiting_requests=None,  # set below, once the KV cache's size is known
        max_queue_delay_s=args.max_queue_delay_s,
        max_engine_restarts=args.max_engine_restarts,
    )
    serve(engine, args, chat_template)


def serve(engine: Any, args: argparse.Namespace, chat_template: str | None = None) -> None:
    """Serve `engine` (an `AsyncLLM`) with the server flags in `args` until SIGTERM/SIGINT, or
    until the engine is gone for good (then exit with code 1)."""
    from pagoda.utils.heap import freeze_startup_heap

    logging.basicConfig(  # a no-op where run_server configured it already
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    try:
        server = _build_server(engine, args, chat_template)
    except BaseException:
        # The engine (its core process and output thread) would keep this process alive
        # after the error: the command printed it and never exited.
        engine.shutdown()
        raise
    freeze_startup_heap()  # a full collection mid-burst would stall the event loop
    try:
        server.run()
    finally:
        engine.shutdown()
    if server.exit_code:
        raise SystemExit(server.exit_code)


def _build_server(engine: Any, args: argparse.Namespace, chat_template: str | None) -> Any:
    """The uvicorn server of the app serving `engine` (`serve`'s flags in `args`)."""
    from pagoda.server.app import build_app
    from pagoda.server.draining import DrainingServer, uvicorn
    from pagoda.server.preprocess import Preprocessor

    engine.max_waiting_requests = resolve_max_waiting_requests(args.max_waiting_requests, engine)
    logger.info(
        "admission: at most %s requests wait beyond the running batch (--max-waiting-requests)",
        "unbounded" if engine.max_waiting_requests is None else engine.max_waiting_requests,
    )
    names = args.served_model_name
    if isinstance(names, str):
        names = [names]
    app = build_app(
        engine,
        served_model_names=names,
        api_key=args.api_key,
        chat_template=chat_template,
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        preprocessor=Preprocessor(engine.tokenizer, timeout_s=args.preprocess_timeout),
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        generation_config=getattr(args, "generation_config", "auto"),
        enable_server_load_tracking=args.enable_server_load_tracking,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        # The drain already waited: open connections get this much more to close.
        timeout_graceful_shutdown=2,
        timeout_keep_alive=5,
    )
    return DrainingServer(config, engine, args.drain_timeout)


def check_server_flags(args: argparse.Namespace) -> None:
    """ValueErrors naming the flag, for server flags out of range."""
    if args.max_request_body_bytes <= 0:
        raise ValueError("--max-request-body-bytes must be positive")
    if not args.preprocess_timeout > 0:
        raise ValueError("--preprocess-timeout must be positive")
    if args.max_queue_delay_s is not None and not args.max_queue_delay_s > 0:
        raise ValueError("--max-queue-delay-s must be positive")
    if args.max_engine_restarts < 0:
        raise ValueError("--max-engine-restarts must be >= 0")
    if args.max_waiting_requests is not None and args.max_waiting_requests < -1:
        raise ValueError("--max-waiting-requests must be >= -1 (-1: unbounded)")
    if not args.drain_timeout >= 0:
        raise ValueError("--drain-timeout must be >= 0")
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def resolve_max_waiting_requests(flag: int | None, engine: Any) -> int | None:
    """--max-waiting-requests as AsyncLLM takes it: None (unbounded) for -1, the flag's value,
    or by default the bound `default_max_waiting_requests` derives from the KV cache."""
    from pagoda.engine.serving_engine import default_max_waiting_requests

    if flag == -1:
        return None
    if flag is not None:
        return flag
    config = engine.engine.config
    num_kv_tokens = (engine.engine.num_blocks or 0) * config.cache_config.block_size
    return default_max_waiting_requests(
        config.scheduler_config.max_num_seqs, num_kv_tokens, engine.model_config.max_model_len
    )


def main(argv: list[str] | None = None) -> None:
    args = make_arg_parser().parse_args(argv)
    run_server(args)
