"""`pagoda bench serve`: load-test any OpenAI-compatible server the way `vllm bench serve` does.

Requests go to the streaming completions endpoint (aiohttp), sent all at once
(`--request-rate inf`) or at a rate (gamma-distributed gaps, `--burstiness` 1: Poisson;
several rates: a sweep, `--plot`), at most `--max-concurrency` in flight. Prompts
are text, or lists of token ids (`--prompt-token-ids`, and by itself when the server has no
tokenizer: `pagoda serve CONFIG --load-format dummy --skip-tokenizer-init`). Per
request it records TTFT, the gaps between streamed chunks (ITL; our server sends one token per
chunk), E2E latency and the output token count (the server's `usage` when it reports one, else
the number of chunks). The report has vLLM's layout and names, so results compare line by line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda import envs
from pagoda.bench.datasets import (
    LocalTokenizer,
    SampleRequest,
    ServerTokenizer,
    TokenIdVocab,
    add_lognormal_args,
    lognormal_dataset,
    lognormal_mix_from_args,
    prefix_repetition_dataset,
    random_dataset,
    sharegpt_dataset,
)
from pagoda.bench.load import run_load

BENCH_SERVE_EXAMPLES = """examples:
  pagoda bench serve                                     # the server on 127.0.0.1:8000
  pagoda bench serve --request-rate 1 2 4 inf --plot sweep.png --goodput ttft:500 tpot:50
  pagoda bench serve --request-rate 8 --burstiness 0.5 --num-prompts 500 --save-result
  pagoda bench serve --base-url http://gpu-host:8000 --dataset-name sharegpt --dataset-path sg.json
"""


@dataclass
class RequestFuncOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


async def request_completion(
    session: Any, url: str, model: str, req: SampleRequest, ignore_eos: bool,
    headers: dict[str, str],
) -> RequestFuncOutput:  # fmt: skip
    """One streaming /v1/completions request, timed chunk by chunk."""
    payload = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.expected_output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    out = RequestFuncOutput(prompt_len=req.prompt_len)
    chunks: list[str] = []
    st = time.perf_counter()
    out.start_time, last = st, st
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue
                msg = json.loads(data)
                if "error" in msg:
                    out.error = str(msg["error"])
                    return out
                if choices := msg.get("choices"):
                    now = time.perf_counter()
                    if not chunks:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks.append(choices[0].get("text") or "")
                if usage := msg.get("usage"):
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.generated_text = "".join(chunks)
        out.output_tokens = out.output_tokens or len(chunks)
        out.latency = last - st
        out.success = bool(chunks)
        if not out.success:
            out.error = "the stream had no completion chunks"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        out.error = f"{type(e).__name__}: {e}"
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            slos[name] = float("nan")
        if not slos[name] > 0:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a positive number of ms")
    return slos


def calculate_metrics(
    outputs: list[RequestFuncOutput], duration: float, percentiles: list[float],
    goodput: dict[str, float],
) -> dict[str, Any]:  # fmt: skip
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    itls = [x for o in ok for x in o.itl]
    all_tpots = [
        (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0 for o in ok
    ]
    tpots = [t for o, t in zip(ok, all_tpots) if o.output_tokens > 1]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    good = 0
    for o, tpot in zip(ok, all_tpots):
        vals = {"ttft": o.ttft, "tpot": tpot, "e2el": o.latency}
        good += all(vals[k] * 1000 <= slo for k, slo in goodput.items())
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for key, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(vals or [0.0]) * 1000
        m[f"mean_{key}_ms"] = float(arr.mean())
        m[f"median_{key}_ms"] = float(np.median(arr))
        m[f"std_{key}_ms"] = float(arr.std())
        for p in percentiles:
            m[f"p{_pword(p)}_{key}_ms"] = float(np.percentile(arr, p))
    return m


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def print_report(m: dict[str, Any], args: argparse.Namespace, percentiles: list[float]) -> None:
    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        print(f"{label:<40} " + fmt.format(value))

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency, "{:<10}")
    if args.request_rate != float("inf"):
        row("Request rate configured (RPS):", args.request_rate)
        if args.burstiness != 1.0:
            row("Burstiness (gamma shape):", args.burstiness)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for key, name, header in (
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2el", "E2EL", "End-to-end Latency"),
    ):
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", m[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{_pword(p)} {name} (ms):", m[f"p{_pword(p)}_{key}_ms"])
    print("=" * 50)


async def benchmark(
    args: argparse.Namespace, requests: list[SampleRequest], url: str, headers: dict[str, str]
) -> tuple[list[RequestFuncOutput], float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # One request first: a misconfigured run fails here, before the clock starts.
        probe = await request_completion(
            session, url, args.model, requests[0], args.ignore_eos, headers
        )
        if not probe.success:
            raise ValueError(f"the initial test request failed: {probe.error}")
        print("Initial test run completed. Starting main benchmark run...")
        return await run_load(session, url, args.model, requests, args.request_rate,
                              args.burstiness, args.max_concurrency, args.ignore_eos, headers,
                              args.seed)  # fmt: skip


def add_bench_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `pagoda bench serve` (vLLM's names); the lead wires it to `run_bench_serve`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = BENCH_SERVE_EXAMPLES
    a = parser.add_argument
    a("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (else host/port)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--endpoint", default="/v1/completions")
    a("--model", default=None, help="model name to send (default: the server's first model)")
    a("--tokenizer", default=None, help="local tokenizer path (default: the server's /tokenize)")
    a("--api-key", default=envs.OPENAI_API_KEY)
    a(
        "--dataset-name",
        default="random",
        choices=["random", "prefix_repetition", "sharegpt", "lognormal"],
    )
    a("--dataset-path", default=None, help="ShareGPT JSON file for --dataset-name sharegpt")
    a(
        "--num-prompts",
        type=int,
        default=None,
        help="default by the server's device: 1000 on a GPU, 100 on a CPU",
    )
    a("--random-input-len", type=int, default=None, help="default: 1024 on a GPU, 256 on a CPU")
    a("--random-output-len", type=int, default=None, help="default: 128 on a GPU, 64 on a CPU")
    a("--random-range-ratio", type=float, default=0.0)
    a("--prefix-repetition-prefix-len", type=int, default=256)
    a("--prefix-repetition-suffix-len", type=int, default=256)
    a("--prefix-repetition-num-prefixes", type=int, default=10)
    a("--prefix-repetition-output-len", type=int, default=128)
    a("--sharegpt-output-len", type=int, default=None)
    add_lognormal_args(parser)
    a(
        "--prompt-token-ids",
        action="store_true",
        help="send prompts as lists of random token ids (no tokenizer needed; taken by itself "
        "when the server has none)",
    )
    a("--vocab-size", type=int, default=None, help="token ids below this (default: probed)")
    a(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="requests/s, or several for a sweep (e.g. 1 2 4 inf); inf: all at once",
    )
    a(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed arrival gaps: 1 Poisson, < 1 burstier, > 1 steadier",
    )
    a("--max-concurrency", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--ignore-eos", action="store_true")
    a("--goodput", nargs="+", default=None, help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    a("--metric-percentiles", default="50,90,99", help="comma-separated percentiles to report")
    a(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="latency against throughput over the rates (matplotlib: pip install 'pagoda[plot]')",
    )
    a("--save-result", action="store_true")
    a("--result-dir", default=None)
    a("--result-filename", default=None)
    parser.set_defaults(func=run_bench_serve)
    return parser


def probe_vocab_size(base_url: str, model: str | None, headers: dict[str, str]) -> int:
    """The first token id the server refuses in a prompt, by binary search with one-token
    completions (no OpenAI route reports the vocabulary size)."""
    from pagoda.bench.load import post_json

    def valid(token_id: int) -> bool:
        body = {"model": model, "prompt": [token_id], "max_tokens": 1}
        return post_json(base_url + "/v1/completions", body, headers)[0] == 200

    lo, hi = 0, 1 << 20  # lo valid, hi invalid
    if not valid(lo) or valid(hi):
        raise ValueError("cannot find the vocabulary size over HTTP: pass --vocab-size N")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if valid(mid) else (lo, mid)
    return hi


def _bench_tokenizer(
    args: argparse.Namespace, base_url: str, headers: dict[str, str]
) -> LocalTokenizer | ServerTokenizer | TokenIdVocab:
    if args.tokenizer:
        return LocalTokenizer(args.tokenizer)
    if not args.prompt_token_ids:
        try:
            return ServerTokenizer(base_url, args.model, headers)
        except ValueError:
            if args.dataset_name == "sharegpt":
                raise
            print("The server has no tokenizer: sending token-id prompts.", file=sys.stderr)
    if args.dataset_name == "sharegpt":
        raise ValueError("--dataset-name sharegpt needs a tokenizer, not --prompt-token-ids")
    return TokenIdVocab(args.vocab_size or probe_vocab_size(base_url, args.model, headers))


def _build_requests(args: argparse.Namespace, base_url: str, headers: dict[str, str]) -> list:
    tok = _bench_tokenizer(args, base_url, headers)
    if args.dataset_name == "random":
        return random_dataset(tok, args.num_prompts, args.random_input_len,
                              args.random_output_len, args.random_range_ratio, args.seed)  # fmt: skip
    if args.dataset_name == "lognormal":
        return lognormal_dataset(tok, args.num_prompts, lognormal_mix_from_args(args), args.seed)
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_dataset(
            tok, args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, args.seed,
        )  # fmt: skip
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    return sharegpt_dataset(tok, args.dataset_path, args.num_prompts, args.sharegpt_output_len,
                            args.seed)  # fmt: skip


def check_bench_serve_args(args: argparse.Namespace) -> list[float]:
    """Refuse a bad flag value before the prompts are built and the server is asked anything;
    returns the --metric-percentiles. vLLM's rules: a request rate is positive or inf (all at
    once), the burstiness (the gamma shape) positive."""
    from pagoda.bench.load import check_output_path

    for rate in args.request_rate:
        if not rate > 0:
            raise ValueError(f"--request-rate must be positive, or inf for all at once, got {rate}")
    if not 0 < args.burstiness < float("inf"):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        percentiles = [float("nan")]
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(
            "--metric-percentiles takes comma-separated numbers in [0, 100], got "
            f"{args.metric_percentiles!r}"
        )
    for name in ("num_prompts", "random_input_len", "random_output_len", "max_concurrency",
                 "prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
                 "prefix_repetition_num_prefixes", "prefix_repetition_output_len",
                 "sharegpt_output_len", "vocab_size"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value < 1:  # an output of 0 tokens ran as 1
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.dataset_name == "lognormal":
        lognormal_mix_from_args(args)  # its own checks
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    check_output_path("--plot", args.plot)
    if args.result_filename and not args.result_dir:
        check_output_path("--result-filename", args.result_filename)
    return percentiles


def served_model(base_url: str, model: str | None, headers: dict[str, str]) -> str:
    """`model` if the server serves it (its /v1/models), else its first model."""
    from pagoda.bench.load import get_json

    try:
        served = [m["id"] for m in get_json(f"{base_url}/v1/models", headers)["data"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot reach {base_url}/v1/models ({e}); is the server up?") from None
    if not served:
        raise ValueError(f"{base_url}/v1/models lists no model")
    if model is None:
        return served[0]
    if model not in served:
        raise ValueError(
            f"--model {model!r} is not served by {base_url}: it serves "
            + ", ".join(repr(m) for m in served)
        )
    return model


def run_bench_serve(args: argparse.Namespace) -> int:
    from pagoda.bench.load import (
        apply_device_defaults,
        plot_latency_vs_throughput,
        print_sweep,
        save_result,
    )

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    goodput = parse_goodput(args.goodput)
    percentiles = check_bench_serve_args(args)
    args.model = served_model(base_url, args.model, headers)
    device = apply_device_defaults(args, base_url, headers)
    print(f"Building {args.num_prompts} '{args.dataset_name}' prompts (server on {device}) ...",
          file=sys.stderr)  # fmt: skip
    requests = _build_requests(args, base_url, headers)
    results = []
    for rate in args.request_rate:
        run = argparse.Namespace(**{**vars(args), "request_rate": rate})
        print(f"Traffic request rate: {rate}  burstiness: {args.burstiness}  max concurrency: "
              f"{args.max_concurrency}")  # fmt: skip
        outputs, duration = asyncio.run(benchmark(run, requests, base_url + args.endpoint,
                                                  headers))  # fmt: skip
        failed = [o for o in outputs if not o.success]
        if failed:
            print(f"Failed requests: {len(failed)}; first error: {failed[0].error}")
        m = calculate_metrics(outputs, duration, percentiles, goodput)
        print_report(m, run, percentiles)
        if args.save_result or args.result_filename:
            save_result(run, base_url, goodput, m, outputs, len(args.request_rate) > 1)
        results.append({**m, "rate": rate})
    if len(results) > 1:
        print_sweep(results)
    if args.plot:
        if plot_latency_vs_throughput({args.model: results}, args.plot) is None:
            raise ValueError("--plot needs matplotlib: pip install 'pagoda[plot]'")
        print(f"Saved the plot to {args.plot}")
    return 0 if all(m["completed"] for m in results) else 1
