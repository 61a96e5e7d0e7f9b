"""Where one engine step's time goes at a large decode batch: host work vs waiting for the GPU.

`bench_engine_step` runs `batch` greedy requests with `context`-token random prompts (dummy
weights, no tokenizer) through a whole `LLMEngine` until every one is decoding, then times
decode steps with each host stage wrapped: scheduling, input preparation (numpy + pinned
copies), the rest of `execute_model` up to the sampler's launch (graph replay or eager
launches, logits, sampling metadata), the one wait for the sampled ids (the GPU's share),
and the scheduler update and output processing. Host time = step time - that wait: it must
stay well below the GPU's time for the GPU never to wait on Python.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

STAGES = ("schedule", "prepare_inputs", "launch", "wait_gpu", "update", "outputs")


class _TimedSampler:
    """Splits the sampler into its launch and the wait for the sampled ids."""

    def __init__(self, sampler: Any, times: dict[str, float]) -> None:
        self.sampler, self.times = sampler, times

    def __call__(self, logits: torch.Tensor, md: Any) -> Any:
        t0 = time.perf_counter()
        tensors = self.sampler.sample_on_device(logits, md)
        t1 = time.perf_counter()
        out = tensors.tolist(md)
        self.times["wait_gpu"] += time.perf_counter() - t1
        self.times["sampler_launch"] += t1 - t0
        return out


def _timed(fn: Callable, name: str, times: dict[str, float]) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name] += time.perf_counter() - t0
        return out

    return wrapped


def bench_engine_step(
    model: str, dtype: str, device: str, batch: int, context: int, iters: int
) -> dict[str, float]:
    """Median ms per stage of a decode step at `batch` (printed and returned)."""
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams

    # Early requests decode while later ones prefill: none may finish before the timed steps.
    max_tokens = batch * context // 8192 + iters + 16
    args = EngineArgs(
        model=model,
        load_format="dummy" if model.endswith(".json") else "auto",
        skip_tokenizer_init=True,
        dtype=dtype,
        device=device,
        max_model_len=context + max_tokens + 16,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.8,
        kv_cache_memory_bytes=(1 << 30) if device == "cpu" else None,
        disable_log_stats=True,
    )
    engine = LLMEngine.from_engine_args(args)
    runner = engine.executor.model_runner
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        engine.add_request(str(i), prompt, params)

    times: dict[str, float] = defaultdict(float)
    sched, scheduler = engine.scheduler.schedule, engine.scheduler
    pure_decode = [False]  # did the last step decode every request (one token each)?

    def schedule():
        out = sched()
        n = len(out.scheduled_requests)
        pure_decode[0] = n == batch == out.total_num_scheduled_tokens
        return out

    scheduler.schedule = _timed(schedule, "schedule", times)
    runner.inputs.prepare = _timed(runner.inputs.prepare, "prepare_inputs", times)
    runner.sampler = _TimedSampler(runner.sampler, times)
    engine.executor.execute_model = _timed(engine.executor.execute_model, "execute", times)
    scheduler.update_from_output = _timed(scheduler.update_from_output, "update", times)
    op = engine.output_processor
    op.process_outputs = _timed(op.process_outputs, "outputs", times)

    for _ in range(10_000):  # prefill in chunks until every request decodes
        engine.step()
        if pure_decode[0]:
            break
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(iters):
        times.clear()
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        if not pure_decode[0]:
            raise RuntimeError(f"expected a pure decode step of {batch} requests")
        launch = times["execute"] - times["prepare_inputs"] - times["wait_gpu"]
        row = {**times, "launch": launch, "total": total, "host": total - times["wait_gpu"]}
        for k, v in row.items():
            samples[k].append(v * 1e3)
    result = {k: statistics.median(v) for k, v in samples.items()}
    graphs = "CUDA graphs" if runner.cuda_graphs is not None else "eager"
    print(
        f"engine decode step, batch {batch}, context ~{context}, {dtype} on {device} ({graphs}): "
        f"{result['total']:.2f} ms = host {result['host']:.2f} ms + waiting for the GPU "
        f"{result['wait_gpu']:.2f} ms"
    )
    for stage in STAGES:
        print(f"  {stage:15s} {result[stage]:8.3f} ms")
    print(f"  (sampler launch {result['sampler_launch']:.3f} ms is inside 'launch')", flush=True)
    return result
