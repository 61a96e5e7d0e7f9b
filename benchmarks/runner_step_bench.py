"""Step-time benchmark of the model runner: decode at batch B with C-token contexts, and prefill.

    python benchmarks/runner_step_bench.py [--model PATH] [--dtype bfloat16] [--batch 1 64]
        [--context 300] [--prefill 512] [--cached-prefix 500] [--iters 10]
        [--graphs on|off|both] [--profile 1 256] [--profile-prefill 8192] [--engine-batch 1 256]

Runs `ModelRunner.execute_model` on hand-made SchedulerOutputs (no scheduler, no tokenizer; a
request whole the first step, then diffs, as the scheduler sends them), so the time is inputs +
model + logits + sampling. Prints ms per step (median of --iters), on
CUDA with decode CUDA graphs on and/or off, and with --profile the host-side operators of a
step. --engine-batch N runs N requests through the whole `LLMEngine` and splits one decode
step into its host parts (schedule, prepare inputs, launch, output handling) and the wait for
the GPU (`engine_step_host.py`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagoda

from pagoda.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pagoda.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from pagoda.core.request import Request  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402
from pagoda.worker.model_runner import ModelRunner  # noqa: E402


def build_runner(
    model: str,
    dtype: str,
    device: str,
    max_tokens: int,
    max_seqs: int,
    attention_backend: str | None = None,
    enforce_eager: bool = False,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> ModelRunner:
    from pagoda.engine.arg_utils import resolve_kv_cache_dtype
    from pagoda.model.loader import get_model_config_dict

    load_format = "dummy" if model.endswith(".json") else "auto"
    hf_config = get_model_config_dict(model, load_format)
    max_len = min(int(hf_config.get("max_position_embeddings") or 2048), 4096)
    config = EngineConfig(
        model_config=ModelConfig(
            model=model,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_len,
            load_format=load_format,
            quantization=quantization,
        ),
        # CPU: 1 GiB of KV; CUDA: sized by the profiling run, as the engine does.
        cache_config=CacheConfig(
            block_size=16,
            cache_dtype=resolve_kv_cache_dtype(kv_cache_dtype, dtype, device, attention_backend),
            kv_cache_memory_bytes=(1 << 30) if device == "cpu" else None,
            gpu_memory_utilization=0.8,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_len
        ),
        device_config=DeviceConfig(
            device=device, attention_backend=attention_backend, enforce_eager=enforce_eager
        ),
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


# id(runner) -> req_id -> (request, output tokens sent): what each runner was told.
_SENT: dict[int, dict[str, tuple[Request, int]]] = {}


def _step(runner: ModelRunner, reqs: list[Request], counts: list[int], tables) -> float:
    """One step; each table is the request's whole block list, fixed for its life."""
    sent = _SENT.setdefault(id(runner), {})
    cached, new = CachedRequestData(), []
    for r, table in zip(reqs, tables):
        known = sent.get(r.request_id)
        if known is not None and known[0] is r:
            cached.append(r.request_id, r.output_token_ids[known[1] :], [])
        else:
            outputs = list(r.output_token_ids)
            new.append(
                NewRequestData(r.request_id, r.prompt_token_ids, outputs, r.sampling_params, table)
            )
        sent[r.request_id] = (r, r.num_output_tokens)
    order = cached.req_ids + [n.req_id for n in new]  # the batch order the runner sees
    count_of = {r.request_id: n for r, n in zip(reqs, counts)}
    so = SchedulerOutput(
        scheduled_cached_reqs=cached,
        scheduled_new_reqs=new,
        num_scheduled_tokens={rid: count_of[rid] for rid in order},
        total_num_scheduled_tokens=sum(counts),
        num_computed_tokens={r.request_id: r.num_computed_tokens for r in reqs},
    )
    start = time.perf_counter()
    runner.execute_model(so)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_decode(runner: ModelRunner, batch: int, context: int, iters: int) -> float:
    """Median ms of a decode step of `batch` requests whose caches hold `context` tokens."""
    bs = runner.block_size
    blocks_per_req = -(-(context + iters + 2) // bs)
    if batch * blocks_per_req + 1 > runner.num_blocks:
        raise ValueError("KV cache too small for this batch/context: lower --batch or --context")
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    reqs, tables = [], []
    for b in range(batch):
        prompt = torch.randint(0, vocab, (context + 1,), generator=g).tolist()
        r = Request(f"d{b}", prompt, SamplingParams(temperature=0.0, max_tokens=10**6), None)
        r.num_computed_tokens = context  # cache content is irrelevant to the timing
        reqs.append(r)
        tables.append(list(range(1 + b * blocks_per_req, 1 + (b + 1) * blocks_per_req)))
    times = []
    for _ in range(iters + 2):
        times.append(_step(runner, reqs, [1] * batch, tables))
        for r in reqs:
            r.num_computed_tokens += 1
            r.append_output_token_ids(0)
    return statistics.median(times[2:]) * 1e3


def bench_prefill(runner: ModelRunner, num_tokens: int, iters: int, cached: int = 0) -> float:
    """Median ms of a step that prefills `num_tokens` prompt tokens (the last `num_tokens -
    cached` of them when a `cached`-token prefix is already in the cache) and samples one."""
    bs = runner.block_size
    vocab = runner.model_config.vocab_size
    prompt = torch.randint(0, vocab, (num_tokens,)).tolist()
    table = list(range(1, 2 + num_tokens // bs))
    times = []
    for i in range(iters + 1):
        r = Request(f"p{i}", prompt, SamplingParams(temperature=0.0), None)
        r.num_computed_tokens = cached  # the prefix's cache content is irrelevant to the timing
        times.append(_step(runner, [r], [num_tokens - cached], [table]))
    return statistics.median(times[1:]) * 1e3


def bench_mixed(
    runner: ModelRunner, prefill_tokens: int, num_decodes: int, iters: int, seed: int = 0
) -> float:
    """Median ms of a step shaped like the prefill steps of the 256-request offline workload (prompts and outputs uniform in [100, 1024]): `num_decodes` decodes whose
    contexts are uniform in [100, 1024], then fresh prompts of lengths uniform in [100, 1024]
    (the last one cut as a chunk) filling `prefill_tokens`."""
    bs = runner.block_size
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    specs = []  # (context, query tokens)
    for _ in range(num_decodes):
        specs.append((int(torch.randint(100, 1025, (1,), generator=g)), 1))
    left = prefill_tokens
    while left > 0:
        n = min(left, int(torch.randint(100, 1025, (1,), generator=g)))
        specs.append((0, n))
        left -= n
    need = sum(-(-(c + n + iters + 2) // bs) for c, n in specs)
    if need + 1 > runner.num_blocks:
        raise ValueError("KV cache too small for this mixed step")
    reqs, counts, tables, next_block = [], [], [], 1
    for i, (c, n) in enumerate(specs):
        prompt = torch.randint(0, vocab, (c + n,), generator=g).tolist()
        r = Request(f"m{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10**6), None)
        r.num_computed_tokens = c
        nb = -(-(c + n + iters + 2) // bs)
        reqs.append(r)
        counts.append(n)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
    times = [_step(runner, reqs, counts, tables) for _ in range(iters + 1)]
    return statistics.median(times[1:]) * 1e3


def _profile(runner: ModelRunner, title: str, run) -> None:  # noqa: ANN001 - run(iters)
    """Print the operators of `run(2)` (after a warm-up `run(1)`): host time, and on CUDA the
    kernels' device time."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    run(1)
    with profile(activities=activities) as prof:
        run(2)
    sort = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    print(f"profile of {title}:")
    print(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))


def profile_mixed(runner: ModelRunner, prefill_tokens: int, num_decodes: int) -> None:
    """The kernels of 3 steps shaped like `bench_mixed`'s."""
    _profile(
        runner,
        f"3 steps of {num_decodes} decodes + {prefill_tokens} prompt tokens",
        lambda iters: bench_mixed(runner, prefill_tokens, num_decodes, iters),
    )


def profile_decode(runner: ModelRunner, batch: int, context: int) -> None:
    """The operators of 4 decode steps at `batch` (`bench_decode`)."""
    _profile(
        runner,
        f"4 decode steps at batch {batch}",
        lambda iters: bench_decode(runner, batch, context, iters),
    )


def profile_prefill(runner: ModelRunner, num_tokens: int) -> None:
    """The operators of 3 steps that each prefill one `num_tokens`-token prompt."""
    _profile(
        runner,
        f"3 prefill steps of {num_tokens} tokens",
        lambda iters: bench_prefill(runner, num_tokens, iters),
    )


def _mixed_tokens(spec: str) -> int:
    p_tokens, decodes = (int(x) for x in spec.split(":"))
    return p_tokens + decodes


def _release(runner: ModelRunner) -> None:
    # The graphs reference the runner (a cycle): collect it before the next one sizes its cache.
    del runner.model, runner.kv_caches, runner.cuda_graphs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    from pagoda.config import embedded_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir, .gguf, or config.json (dummy weights)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--prefill", type=int, nargs="*", default=[512])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--attention-backend", default=None, help="cpu | torch | triton (default: by device)"
    )
    p.add_argument("--graphs", choices=["on", "off", "both"], default="both", help="CUDA only")
    p.add_argument("--cached-prefix", type=int, default=0, help="also prefill after N cached")
    p.add_argument("--profile", type=int, nargs="*", default=None, help="profile these batches")
    p.add_argument(
        "--profile-prefill", type=int, nargs="*", default=[], help="profile prefills of N tokens"
    )
    p.add_argument("--engine-batch", type=int, nargs="*", default=[], help="engine breakdown")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e5m2 | int8 ...")
    p.add_argument(
        "--quantization", default=None, help="gguf: a GGUF model's blocks kept (float32 only)"
    )
    p.add_argument(
        "--mixed",
        nargs="*",
        default=[],
        help="P:D steps of D decodes + P prompt tokens (the offline workload's prefill steps)",
    )
    p.add_argument("--profile-mixed", nargs="*", default=[], help="profile these P:D steps")
    args = p.parse_args(argv)
    model = args.model or embedded_model_path()
    mixed = args.mixed + args.profile_mixed
    modes = (
        [False]
        if args.device == "cpu"
        else {"on": [False], "off": [True]}.get(args.graphs, [True, False])
    )
    for dtype in args.dtype:
        for eager in modes:
            runner = build_runner(
                model,
                dtype,
                args.device,
                max(args.prefill + [max(args.batch)] + [_mixed_tokens(m) for m in mixed]),
                max(args.batch + [int(m.split(":")[1]) + 64 for m in mixed]),
                args.attention_backend,
                enforce_eager=eager,
                kv_cache_dtype=args.kv_cache_dtype,
                quantization=args.quantization,
            )
            graphs = "CUDA graphs" if runner.cuda_graphs is not None else "eager"
            print(
                f"{dtype}, {runner.attn_backend.name} attention, {graphs}, "
                f"{torch.get_num_threads()} threads:",
                flush=True,
            )
            for batch in args.batch:
                ms = bench_decode(runner, batch, args.context, args.iters)
                print(
                    f"  decode batch {batch:4d} ctx {args.context}: {ms:8.2f} ms/step "
                    f"({batch / ms * 1e3:8.1f} tok/s)",
                    flush=True,
                )
            for n in args.prefill:
                ms = bench_prefill(runner, n, args.iters)
                print(f"  prefill {n:5d} tokens:          {ms:8.2f} ms ({n / ms * 1e3:8.1f} tok/s)")
                if 0 < args.cached_prefix < n:
                    ms = bench_prefill(runner, n, args.iters, args.cached_prefix)
                    print(f"  prefill {n:5d} tokens, {args.cached_prefix} cached: {ms:8.2f} ms")
            for spec in args.mixed:
                p_tokens, decodes = (int(x) for x in spec.split(":"))
                ms = bench_mixed(runner, p_tokens, decodes, args.iters)
                print(f"  {decodes} decodes + {p_tokens} prompt tokens: {ms:8.2f} ms", flush=True)
            for spec in args.profile_mixed:
                profile_mixed(runner, *(int(x) for x in spec.split(":")))
            for batch in args.profile or []:
                profile_decode(runner, batch, args.context)
            for n in args.profile_prefill:
                profile_prefill(runner, n)
            _release(runner)
    for batch in args.engine_batch:
        from engine_step_host import bench_engine_step

        for run_ahead in (False, True):
            bench_engine_step(
                model, args.dtype[-1], args.device, batch, args.context, args.iters, run_ahead
            )
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
