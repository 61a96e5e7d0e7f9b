"""`pagoda serve [MODEL]`: command-line flags, start-up and graceful shutdown of the server.

Flags are `EngineArgs.add_cli_args` (vLLM's names) plus the server's own: --host, --port,
--api-key, --chat-template, --served-model-name, --max-waiting-requests, --drain-timeout.
SIGTERM drains: the engine refuses new requests (503, /health turns 503), in-flight requests
run to completion (at most --drain-timeout seconds), then uvicorn stops. A second SIGTERM or
SIGINT exits at once. uvicorn is imported only to serve (`pagoda.server.draining`), so the other
subcommands (`pagoda bench throughput`, `generate`) run where it is not installed.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

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
        default=os.environ.get("PAGODA_API_KEY"),
        help="require `Authorization: Bearer KEY` on every route except /health and /metrics "
        "(default: $PAGODA_API_KEY)",
    )
    g.add_argument(
        "--chat-template", default=None, help="chat template: a .jinja file or the template text"
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
            help="requests queued but not yet scheduled past which new ones get HTTP 503 "
            "(default: unbounded)",
        )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM, seconds to let in-flight requests finish before exiting",
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
    from pagoda.config import embedded_model_path
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.heap import freeze_startup_heap
    from pagoda.server.app import build_app
    from pagoda.server.draining import DrainingServer, uvicorn

    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    model_tag = getattr(args, "model_tag", None)
    if model_tag:
        args.model = model_tag
    if not getattr(args, "model", None):
        args.model = embedded_model_path()
    chat_template = load_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncLLM.from_engine_args(
        engine_args, max_waiting_requests=getattr(args, "max_waiting_requests", None)
    )
    names = args.served_model_name
    if isinstance(names, str):
        names = [names]
    app = build_app(engine, served_model_names=names, api_key=args.api_key,
                    chat_template=chat_template)  # fmt: skip
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=max(1, int(args.drain_timeout)),
        timeout_keep_alive=5,
    )
    server = DrainingServer(config, engine, args.drain_timeout)
    freeze_startup_heap()  # a full collection mid-burst would stall the event loop
    try:
        server.run()
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = make_arg_parser().parse_args(argv)
    run_server(args)
