"""`python -m pagoda.entrypoints.openai.api_server --model PATH ...`: vLLM's module path for
the server; the implementation is `pagoda.server.cli` (same flags as `pagoda serve`, and the same
one-line user errors as the `pagoda` command)."""

from __future__ import annotations

import sys

from pagoda.cli import add_log_level_flag, parse_args, run_command
from pagoda.server.cli import make_arg_parser, run_server


def main(argv: list[str] | None = None) -> int:
    parser = make_arg_parser()
    add_log_level_flag(parser)
    return run_command(run_server, parse_args(parser, argv))


if __name__ == "__main__":
    sys.exit(main())
