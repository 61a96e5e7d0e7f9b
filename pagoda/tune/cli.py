"""`pagoda tune MODEL --goal latency|throughput`: the tuning path, walked on this machine.

Starts the server with the defaults and records a baseline with the serving benchmark at
increasing request rates (Poisson arrivals), then changes one knob at a time along the goal's
path, keeps what helps, and ends with a table of every trial, the recommended `pagoda serve`
command line, goodput before and after, and a PNG of latency against throughput
(`pagoda.tune.runner` says how trials are scored). Ctrl-C stops it and every server it started.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

EXAMPLES = """examples:
  pagoda tune --goal throughput --budget-minutes 10          # the embedded model on this machine
  pagoda tune /models/Llama-3-8B --goal latency --slo-ttft-ms 200 --slo-tpot-ms 30
  pagoda tune /models/Llama-3-8B --goal throughput --quantized-model /models/Llama-3-8B-AWQ
  pagoda tune MODEL --goal latency --server-cmd "vllm serve MODEL" --tokenizer MODEL
  pagoda tune benchmarks/presets/llama-3-8b/config.json --goal throughput --prompt-token-ids \
      --serve-args "--load-format dummy --skip-tokenizer-init"       # a model shape on a GPU

Reports go to --output-dir (report.md, results.json, latency_vs_throughput.png, server logs).
"""
# Requests per rate and their lengths, by device: a trial must take well under a minute on a
# 2-core CPU with the embedded model, and a GPU needs enough requests to fill its batch.
WORKLOADS = {"cpu": (24, 128, 32), "cuda": (200, 1024, 128)}


def add_tune_args(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="find serving flags for a latency or throughput goal on this machine",
        description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    a = p.add_argument
    a("model", nargs="?", default=None, help="model path (default: the embedded model)")
    a("--goal", required=True, choices=["latency", "throughput"])
    a(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="time-to-first-token SLO for goodput (default: 2x the baseline's median at 50%% load)",
    )
    a(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="time-per-output-token SLO (default: 2x the baseline's median at 50%% load)",
    )
    a("--budget-minutes", type=float, default=20.0, help="time for the whole run (default 20)")
    a("--dataset", default="random", choices=["random", "prefix_repetition", "sharegpt"])
    a("--dataset-path", default=None, help="ShareGPT JSON for --dataset sharegpt")
    a("--num-prompts", type=int, default=None, help="requests per rate (default: by device)")
    a("--input-len", type=int, default=None, help="prompt tokens (default: by device)")
    a("--output-len", type=int, default=None, help="output tokens (default: by device)")
    a("--quantized-model", default=None, help="also try this quantized checkpoint of MODEL")
    a("--tokenizer", default=None, help="builds the prompts (default: MODEL)")
    a(
        "--prompt-token-ids",
        action="store_true",
        help="prompts of random token ids, for a server without a tokenizer (e.g. a config.json "
        "served with --serve-args '--load-format dummy --skip-tokenizer-init')",
    )
    a(
        "--server-cmd",
        default=None,
        help="command that starts the server, flags appended (default: pagoda serve MODEL)",
    )
    a(
        "--serve-args",
        default="",
        help="flags every trial's server gets, e.g. '--max-model-len 2048'",
    )
    a("--output-dir", default=None, help="default: ./tune-GOAL-DATE")
    a("--seed", type=int, default=0)  # fmt: skip
    p.set_defaults(func=run_tune)
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("slo_ttft_ms", "slo_tpot_ms", "budget_minutes"):
        value = getattr(args, name)
        if value is not None and not 0 < value < math.inf:  # inf overflowed the progress bar
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    for name in ("num_prompts", "input_len", "output_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
    # `pagoda serve` takes a local path; another --server-cmd (vllm serve) may take a hub name.
    for flag, path in (("model", args.model), ("--quantized-model", args.quantized_model)):
        if path and not os.path.exists(path) and args.server_cmd is None:
            raise ValueError(f"{flag} {path!r} not found: pass a local directory or .gguf file")


def _requests(args: argparse.Namespace, tokenizer: str, device: str) -> list[Any]:
    from pagoda.bench.datasets import (
        LocalTokenizer,
        prefix_repetition_dataset,
        random_dataset,
        sharegpt_dataset,
    )

    n, n_in, n_out = WORKLOADS[device]
    n, n_in, n_out = args.num_prompts or n, args.input_len or n_in, args.output_len or n_out
    if args.prompt_token_ids:
        from pagoda.bench.datasets import TokenIdVocab
        from pagoda.model.loader import get_model_config_dict

        if args.dataset == "sharegpt":
            raise ValueError("--dataset sharegpt needs a tokenizer, not --prompt-token-ids")
        load_format = "dummy" if tokenizer.endswith(".json") else "auto"
        tok = TokenIdVocab(int(get_model_config_dict(tokenizer, load_format)["vocab_size"]))
    else:
        tok = LocalTokenizer(tokenizer)
    if args.dataset == "random":
        return random_dataset(tok, n, n_in, n_out, 0.0, args.seed)
    if args.dataset == "prefix_repetition":
        return prefix_repetition_dataset(tok, n, n_in // 2, n_in - n_in // 2, 4, n_out, args.seed)
    return sharegpt_dataset(tok, args.dataset_path, n, n_out, args.seed)


def run_tune(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagoda.config import embedded_model_path
    from pagoda.plan import detect_gpu_memory_bytes
    from pagoda.tune.report import write_report
    from pagoda.tune.runner import Tuner, TuneSettings
    from pagoda.tune.server import default_server_cmd

    _check(args)
    model = args.model
    device = "cuda" if detect_gpu_memory_bytes() else "cpu"
    out_dir = args.output_dir or f"tune-{args.goal}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(out_dir, exist_ok=True)
    if args.server_cmd:
        base_cmd = shlex.split(args.server_cmd)
    else:
        base_cmd = default_server_cmd(model)
    base_cmd += shlex.split(args.serve_args)
    tokenizer = args.tokenizer or model or embedded_model_path()
    print(f"Building {args.dataset} prompts ...", file=sys.stderr)
    slo = {}
    if args.slo_ttft_ms:
        slo["ttft"] = args.slo_ttft_ms
    if args.slo_tpot_ms:
        slo["tpot"] = args.slo_tpot_ms
    settings = TuneSettings(
        goal=args.goal, base_cmd=base_cmd, model_name="tune-model",
        requests=_requests(args, tokenizer, device),
        defaults={"max_num_seqs": 256, "max_num_batched_tokens": 2048,
                  "enable_prefix_caching": True},
        budget_s=args.budget_minutes * 60, out_dir=out_dir, slo=slo,
        quantized_model=args.quantized_model, device=device,
    )  # fmt: skip
    bar = tqdm(total=int(settings.budget_s), unit="s", desc=f"tune {args.goal}", leave=False,
               disable=not sys.stderr.isatty())  # fmt: skip

    def progress(line: str) -> None:
        bar.n = min(int(tuner.elapsed()), bar.total)
        bar.refresh()
        tqdm.write(line, file=sys.stderr)

    load_before = os.getloadavg()[0]
    tuner = Tuner(settings, progress)
    try:
        with interrupts_raise():
            base, best, base_again, best_again = tuner.run()
    finally:
        tuner.stop()  # whatever happened, no server is left running
        bar.close()
    n, n_in, n_out = (len(settings.requests), settings.requests[0].prompt_len,
                      settings.requests[0].expected_output_len)  # fmt: skip
    rates = ", ".join("inf" if r == float("inf") else f"{r:.2f}" for r in tuner.rates)
    info = {
        "model": model or "embedded SmolLM2-135M-Instruct", "device": device,
        "workload": f"{n} {args.dataset} requests of ~{n_in} tokens in, {n_out} out per rate",
        "rates (req/s)": rates, "SLO": f"TTFT {settings.slo['ttft']:.0f} ms, TPOT "
        f"{settings.slo['tpot']:.1f} ms", "budget": f"{args.budget_minutes:g} min, used "
        f"{tuner.elapsed() / 60:.1f}", "queue": "unbounded during trials",
        "machine": f"{_cpu_name()}, {os.cpu_count()} cores, load average {load_before:.1f} at "
        f"the start and {os.getloadavg()[0]:.1f} at the end",
    }  # fmt: skip
    report = write_report(out_dir, args.goal, model, info, tuner.trials, base, best, base_again,
                          best_again)  # fmt: skip
    print(report)
    print(f"Report: {os.path.join(out_dir, 'report.md')}", file=sys.stderr)
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt wherever the main thread is (Python's own
    Ctrl-C behaviour). Without this, `asyncio.run` (a trial's load) takes SIGINT for itself and
    cancels the load's task instead, and an interrupt that lands as the load completes is lost.
    A SIGINT the process was started ignoring (a background job's) stays ignored."""
    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signals.append(signal.SIGINT)
    previous = {s: signal.signal(s, _interrupt) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
