"""`pagoda bench throughput`: offline throughput on random-token prompts (vLLM's workload).

Prompt and output lengths are drawn uniformly from ranges (`--input-len 64:256`), or from the
ShareGPT-like log-normal mix (`--dataset-name lognormal`: the very requests `pagoda bench serve
--dataset-name lognormal --prompt-token-ids` sends with the same seed and flags); every request
runs to its output length (ignore_eos). Prints requests/s and input/output/total tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        a, b = 0, 0
    if a <= 0 or b < a:
        raise ValueError(f"a length range must be N or LO:HI with 0 < LO <= HI, got {text!r}")
    return a, b


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    from pagoda.bench.datasets import add_lognormal_args

    p.add_argument("--dataset-name", default="random", choices=["random", "lognormal"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=str, default="64:256", help="N or LO:HI (uniform)")
    p.add_argument("--output-len", type=str, default="64:256", help="N or LO:HI (uniform)")
    add_lognormal_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--output-json", type=str, default=None)
    p.add_argument(
        "--host-breakdown",
        action="store_true",
        help="time the engine's host stages per step (schedule, launch, wait, update, outputs)",
    )
    p.set_defaults(func=run_throughput)


def make_requests(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        reqs.append(([rng.randrange(vocab) for _ in range(n_in)], n_out))
    return reqs


def make_requests_from_args(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """`make_requests` from the --num-prompts / --input-len / --output-len / --seed flags, or
    the log-normal mix's token-id requests (`--dataset-name lognormal`)."""
    if getattr(args, "dataset_name", "random") == "lognormal":
        from pagoda.bench.datasets import TokenIdVocab, lognormal_dataset, lognormal_mix_from_args

        reqs = lognormal_dataset(
            TokenIdVocab(vocab), args.num_prompts, lognormal_mix_from_args(args), args.seed
        )
        return [(list(r.prompt), r.expected_output_len) for r in reqs]
    return make_requests(
        args.num_prompts,
        parse_range(args.input_len),
        parse_range(args.output_len),
        vocab,
        args.seed,
    )


def throughput_stats(outs: list[Any], elapsed: float, engine_start_s: float) -> dict[str, Any]:
    """Rates of a finished `generate` call (RequestOutputs of Pagoda or vLLM alike)."""
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "elapsed_s": round(elapsed, 3),
        "engine_start_s": round(engine_start_s, 2),
        "requests_per_s": round(len(outs) / elapsed, 3),
        "input_tokens_per_s": round(n_in / elapsed, 2),
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
        "input_tokens": n_in,
        "output_tokens": n_out,
    }


_STAGES = ("schedule", "launch", "wait", "update", "outputs")


def instrument_engine(engine: Any) -> dict[str, float]:
    """Wrap the engine's host stages of a step with wall-clock timers, on this instance only:
    schedule (the scheduler), launch (handing the step to the executor: input preparation in
    one process, sending it to the workers with tensor parallelism), wait (for the step's
    sampled tokens), update (the scheduler's bookkeeping of them) and outputs (the output
    processor). Returns the totals in seconds, filled in as the engine runs."""
    totals = dict.fromkeys(_STAGES, 0.0)
    totals["steps"] = 0.0  # calls of schedule()

    def timed(obj: Any, name: str, stage: str, wrap_result: bool = False) -> None:
        fn = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                totals[stage] += time.perf_counter() - start
                totals["steps"] += stage == "schedule"
            if wrap_result and result is not None:
                timed(result, "get", "wait")
            return result

        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.executor, "execute_model_async", "launch", wrap_result=True)
    timed(engine.scheduler, "update_from_output", "update")
    timed(engine.output_processor, "process_outputs", "outputs")
    return totals


def breakdown_summary(totals: dict[str, float], elapsed: float) -> dict[str, Any]:
    """ms per step and share of the elapsed time of each host stage."""
    steps = max(int(totals["steps"]), 1)
    return {
        "steps": int(totals["steps"]),
        **{
            stage: {
                "ms_per_step": round(totals[stage] * 1e3 / steps, 3),
                "share": round(totals[stage] / elapsed, 4),
            }
            for stage in _STAGES
        },
    }


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def check_throughput_args(args: argparse.Namespace) -> None:
    """Refuse a bad workload flag, or an --output-json that cannot be written, before the
    engine starts: they failed after it (0 prompts ran as an empty benchmark)."""
    from pagoda.bench.datasets import lognormal_mix_from_args
    from pagoda.bench.load import check_output_path
    from pagoda.sampling_params import SamplingParams

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "lognormal":
        lognormal_mix_from_args(args)
    else:
        parse_range(args.input_len), parse_range(args.output_len)
    SamplingParams(temperature=args.temperature, max_tokens=1)  # its own checks
    check_output_path("--output-json", args.output_json)


def run_throughput(args: argparse.Namespace) -> int:
    t_process = time.perf_counter()
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    check_throughput_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    llm = LLM(engine_args.model, **kwargs)
    load_s = time.perf_counter() - t_process
    vocab = llm.llm_engine.model_config.vocab_size
    reqs = make_requests_from_args(args, vocab)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, (_, n) in enumerate(reqs)
    ]
    totals = instrument_engine(llm.llm_engine) if args.host_breakdown else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    result = {
        "model": llm.llm_engine.model_config.model,
        "dtype": llm.llm_engine.model_config.dtype,
        "num_prompts": len(outs),
        **throughput_stats(outs, elapsed, load_s),
    }
    if totals is not None:
        result["host_breakdown"] = breakdown_summary(totals, elapsed)
        b = result["host_breakdown"]
        print(
            f"Host per step ({b['steps']} steps): "
            + ", ".join(f"{s} {b[s]['ms_per_step']:.2f} ms" for s in _STAGES)
        )
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.2f} total tokens/s, "
        f"{result['output_tokens_per_s']:.2f} output tokens/s "
        f"(input {result['input_tokens_per_s']:.2f} tokens/s; {result['input_tokens']} in / "
        f"{result['output_tokens']} out in {elapsed:.2f} s)"
    )
    write_json(args.output_json, result)
    return 0
