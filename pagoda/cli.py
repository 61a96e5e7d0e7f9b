"""The `pagoda` command: serve | generate | chat | bench (throughput, serve)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator


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
    return LLMEngine.from_engine_args(engine_args)


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
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        prompt = {
            "prompt": text,
            "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False),
        }
    for piece in _stream(engine, "generate-0", prompt, _sampling_params(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    tok = engine.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Pagoda chat. Type /reset to clear the history, /exit (or Ctrl-D) to quit.")
    turn = 0
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if user.strip() in ("/exit", "/quit"):
            return 0
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        reply = []
        try:
            for piece in _stream(engine, f"chat-{turn}", prompt, _sampling_params(args)):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from pagoda.server.cli import add_serve_args

    add_serve_args(sub)

    p = _engine_parser(sub, "generate", "generate a completion for one prompt")
    p.add_argument("prompt", type=str)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = _engine_parser(sub, "chat", "interactive chat with the model")
    p.add_argument("--system", type=str, default=None, help="system prompt")
    _add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagoda.bench.throughput import add_throughput_args

    add_throughput_args(_engine_parser(bench, "throughput", "offline throughput"))
    from pagoda.bench.serve import add_bench_serve_args

    add_bench_serve_args(bench.add_parser("serve", help="load-test an OpenAI-compatible server"))

    from pagoda.model.quantization.gptq import add_quantize_args

    add_quantize_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
