"""The peer for benchmarks/h200_bench.py: Hugging Face transformers' continuous batching.

Builds `LlamaForCausalLM` (or whatever `architectures` names) from a preset config.json with
random weights, in the benchmark's dtype and device, and runs the same workloads as Pagoda
through transformers' continuous-batching manager (the engine behind `generate_batch`):
offline throughput on the very requests Pagoda gets (per-request output lengths, EOS off), and
single-stream decode with per-token timestamps. The API moved between transformers releases
(written against 5.17, checked on 5.24), so every call that may differ is guarded and a failure
becomes a message in the result, never a crash of the whole benchmark.

Standalone: `python benchmarks/hf_peer_bench.py --model benchmarks/presets/llama-3-8b`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

# Newer releases strip the "paged|" prefix (deprecated in 5.2x); 5.17 needs it for paged SDPA.
ATTN_IMPLEMENTATIONS = ("paged|sdpa", "sdpa")


def build_hf_model(config_dir: str, device: str, dtype: str) -> Any:
    """Random-weight model of the preset's shape, built directly on `device` (never on the CPU
    first: an 8B model in float32 would take minutes there)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    errors = []
    for attn in ATTN_IMPLEMENTATIONS:
        try:
            config = AutoConfig.from_pretrained(config_dir)
            torch.manual_seed(0)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(
                    config, dtype=torch_dtype, attn_implementation=attn
                )
            return model.to(device=device, dtype=torch_dtype).eval()
        except Exception as e:  # noqa: BLE001 - try the next spelling, report all at the end
            errors.append(f"{attn}: {type(e).__name__}: {e}")
    raise RuntimeError("could not build the transformers model: " + " | ".join(errors))


def _generation_config(max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    # eos_token_id=-1: no token ends a request (ignore_eos), as for Pagoda.
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0
    )


def _manager(model: Any, max_prompt: int, max_new: int, num_requests: int) -> Any:
    """The continuous-batching context manager, sized by workload hints where supported."""
    kwargs: dict[str, Any] = {"generation_config": _generation_config(max_new), "block": True}
    kwargs["timeout"] = 10
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max_prompt, max_generated_length=max_new, num_requests=num_requests
        )
    except ImportError:  # older releases size the cache from memory alone
        pass
    if model.device.type == "cpu":
        # Dry runs only: left alone, the manager sizes its cache from host memory (tens of GB).
        try:
            from transformers import ContinuousBatchingConfig

            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                num_blocks=64, max_batch_tokens=max(512, max_prompt)
            )
        except (ImportError, TypeError):
            pass
    try:
        return model.continuous_batching_context_manager(**kwargs)
    except TypeError:
        kwargs.pop("workload_hints", None)
        return model.continuous_batching_context_manager(**kwargs)


def _cb_settings(manager: Any) -> dict[str, Any]:
    """The manager's resolved sizing (known once its cache exists): explains the peer's rate."""
    config = getattr(manager, "continuous_batching_config", None)
    names = ("num_blocks", "block_size", "max_batch_tokens", "max_requests_per_batch")
    names += ("use_cuda_graph", "use_async_batching")
    return {n: str(getattr(config, n)) for n in names if hasattr(config, n)}


def _free_device_memory_gib(device: str) -> float | None:
    """Free memory after dropping the previous manager's cache (None on a CPU)."""
    import gc

    import torch

    gc.collect()
    if device != "cuda" or not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    return round(torch.cuda.mem_get_info()[0] / 2**30, 1)


def _collect(manager: Any, expected: set[str], deadline: float) -> tuple[dict[str, Any], bool]:
    """Wait for `expected` request ids to finish; returns (results, timed_out)."""
    if None in expected:  # add_request returns None when the manager refuses a request
        raise RuntimeError("the transformers manager refused a request (see its log above)")
    done: dict[str, Any] = {}
    while len(done) < len(expected):
        if time.perf_counter() > deadline:
            return done, True
        result = manager.get_result(timeout=0.5)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the transformers generation thread stopped (see its log above)")
            continue
        if result.is_finished() and result.request_id in expected:
            if getattr(result, "error", None):
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            done[result.request_id] = result
    return done, False


def hf_offline_throughput(
    model: Any, requests: list[tuple[list[int], int]], time_limit_s: float
) -> dict[str, Any]:
    """Workload a: every request added at once, each with its own output length."""
    max_prompt = max(len(p) for p, _ in requests)
    max_new = max(n for _, n in requests)
    with _manager(model, max_prompt, max_new, len(requests)) as manager:
        # One small request first, outside the clock: the loop thread, cache and graphs get ready.
        rid = manager.add_request(requests[0][0][:32], request_id="warmup", max_new_tokens=4)
        _collect(manager, {rid}, time.perf_counter() + time_limit_s / 2)
        start = time.perf_counter()
        ids = {
            manager.add_request(prompt, request_id=f"a{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (prompt, n) in enumerate(requests)
        }
        done, timed_out = _collect(manager, ids, start + time_limit_s)
        elapsed = time.perf_counter() - start
        if timed_out:
            for rid in ids - set(done):
                manager.cancel_request(rid)
        settings = _cb_settings(manager)
    n_in = sum(len(r.prompt_ids) for r in done.values())
    n_out = sum(len(r.generated_tokens) for r in done.values())
    return {
        "num_requests": len(requests),
        "num_finished": len(done),
        "timed_out": timed_out,
        "elapsed_s": round(elapsed, 3),
        "input_tokens": n_in,
        "output_tokens": n_out,
        # A timed-out run counts finished requests only: a lower bound on the rate.
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1),
        "manager": settings,
    }


def hf_single_stream(
    model: Any, prompt_len: int, output_len: int, repeats: int, vocab: int, time_limit_s: float
) -> dict[str, Any]:
    """Workload b: one request at a time; decode rate from per-token timestamps (TTFT excluded)."""
    rng = random.Random(1)
    runs = []
    with _manager(model, prompt_len, output_len, 1) as manager:
        deadline = time.perf_counter() + time_limit_s  # the manager's start-up is not counted
        for i in range(repeats + 1):  # run 0 warms up and is dropped
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            t0 = time.perf_counter()
            rid = manager.add_request(
                prompt,
                request_id=f"b{i}",
                max_new_tokens=output_len,
                eos_token_id=-1,
                record_timestamps=True,
            )
            done, timed_out = _collect(manager, {rid}, deadline)
            t_end = time.perf_counter()
            if timed_out:
                break
            out = done[rid]
            stamps = out.timestamps or []
            n = len(out.generated_tokens)
            run = {"tokens": n, "overall_tokens_per_s": n / (t_end - t0)}
            if len(stamps) >= 2:
                run["ttft_ms"] = (stamps[0] - t0) * 1e3
                run["decode_tokens_per_s"] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
            if i > 0:
                runs.append(run)
        settings = _cb_settings(manager)
    if not runs:
        raise RuntimeError(f"no single-stream run finished within {time_limit_s:.0f} s")
    result: dict[str, Any] = {"repeats": len(runs), "tokens": runs[0]["tokens"]}
    result["manager"] = settings
    for key in ("decode_tokens_per_s", "overall_tokens_per_s", "ttft_ms"):
        values = [r[key] for r in runs if key in r]
        if values:
            result[key] = round(statistics.median(values), 2)
    return result


def run_peer(
    config_dir: str,
    device: str,
    dtype: str,
    requests: list[tuple[list[int], int]] | None,
    single_stream: tuple[int, int, int] | None,
    time_limit_s: float,
    record: Any = None,
) -> dict[str, Any]:
    """Both peer workloads; `record(result)` is called after each so a kill keeps what ran."""
    import transformers

    start = time.perf_counter()
    result: dict[str, Any] = {"transformers": transformers.__version__}
    model = build_hf_model(config_dir, device, dtype)
    result["attn_implementation"] = model.config._attn_implementation
    result["model_build_s"] = round(time.perf_counter() - start, 2)
    if not hasattr(model, "continuous_batching_context_manager"):
        raise RuntimeError(
            f"transformers {transformers.__version__} has no continuous batching "
            "(continuous_batching_context_manager / generate_batch): upgrade to >= 5.0"
        )
    vocab = int(model.config.vocab_size)
    # Single stream first: it is short, so a slow throughput run cannot starve it.
    if single_stream is not None:
        prompt_len, output_len, repeats = single_stream
        left = time_limit_s - (time.perf_counter() - start)
        result["free_gib_before_single_stream"] = _free_device_memory_gib(device)
        try:
            result["single_stream"] = hf_single_stream(
                model, prompt_len, output_len, repeats, vocab, min(left / 3, 120)
            )
        except Exception as e:  # noqa: BLE001 - keep going to the throughput run
            result["single_stream"] = {"error": f"{type(e).__name__}: {e}"}
        if record:
            record(result)
    if requests is not None:
        left = time_limit_s - (time.perf_counter() - start)
        result["free_gib_before_offline_throughput"] = _free_device_memory_gib(device)
        try:
            result["offline_throughput"] = hf_offline_throughput(model, requests, left)
        except Exception as e:  # noqa: BLE001
            result["offline_throughput"] = {"error": f"{type(e).__name__}: {e}"}
        if record:
            record(result)
    return result


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pagoda.bench.throughput import make_requests

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="benchmarks/presets/llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--time-limit", type=float, default=300.0)
    args = ap.parse_args()
    with open(f"{args.model}/config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    reqs = make_requests(args.num_prompts, (100, 1024), (100, 1024), vocab, 0)
    res = run_peer(args.model, args.device, args.dtype, reqs, (128, 256, 3), args.time_limit)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
