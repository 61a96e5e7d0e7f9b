"""`pagoda serve`'s stack (flags, app, admission, engine-core process, restarts, drain) on the
fake engine of tests/server, which needs no model: for the fault suite's HTTP tests.

    python fake_server.py --port P [server flags] [--step-delay S] [--die-on-prompt TEXT]

`--die-on-prompt` makes the engine core process exit without a word (as the OOM killer would
end it) when a request's prompt contains TEXT.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))

from fake_engine import FakeEngine  # noqa: E402

from pagoda.server.cli import add_server_flags, serve  # noqa: E402


def dying_engine(die_on: str, **kw) -> FakeEngine:
    engine = FakeEngine(**kw)
    add = engine.add_requests

    def add_requests(requests) -> None:  # noqa: ANN001
        text = bytes(t for t in requests[0].prompt_token_ids if t < 256).decode()
        if die_on in text:
            os._exit(3)
        add(requests)

    engine.add_requests = add_requests
    return engine


def main() -> None:
    from pagoda.engine.async_llm import AsyncLLM

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    parser.add_argument("--step-delay", type=float, default=0.002)
    parser.add_argument("--die-on-prompt", default=None)
    args = parser.parse_args()
    kw = dict(
        max_model_len=args.max_model_len or 256,
        max_num_seqs=args.max_num_seqs,
        step_delay=args.step_delay,
    )
    if args.die_on_prompt:
        factory = functools.partial(dying_engine, args.die_on_prompt, **kw)
    else:
        factory = functools.partial(FakeEngine, **kw)
    engine = AsyncLLM(
        engine_factory=factory,
        max_queue_delay_s=args.max_queue_delay_s,
        max_engine_restarts=args.max_engine_restarts,
    )
    serve(engine, args)


if __name__ == "__main__":
    main()
