"""Where one engine step's time goes at a large decode batch: host work vs waiting for the GPU.

`bench_engine_step` runs `batch` greedy requests with `context`-token random prompts (dummy
weights, no tokenizer) through a whole `LLMEngine` until every one is decoding, then times
decode steps with each host stage wrapped: scheduling, input preparation (numpy + pinned
copies), the rest of the launch (graph replay or eager launches, logits, sampling metadata,
the sampler), the wait for the sampled ids, the scheduler update and output processing.
Host time = step time - the wait. Synchronously the host's time adds to the GPU's; with async
scheduling (the next step is launched before the previous one's tokens are processed) it
overlaps it, and the step time should equal the device's own time per step, which is measured
too (`device_step_ms`: the same decode step replayed back to back with no host work between).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

STAGES = ("schedule", "prepare_inputs", "launch", "wait_gpu", "update", "outputs")


def _timed(fn: Callable, name: str, times: dict[str, float]) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name] += time.perf_counter() - t0
        return out

    return wrapped


def device_step_ms(runner: Any, so: Any, iters: int) -> float:
    """The device's time for the decode step `so` alone: inputs prepared once, then the forward
    (graph replay), logits and greedy sampling queued `iters` times back to back."""
    from pagoda.sample.sampler import SamplingMetadata

    graphs = runner.cuda_graphs
    if graphs is None:
        step = runner.inputs.prepare(so)
    else:
        step = runner.inputs.prepare(so, graphs.padded_size, graphs.mixed_shape)
    reqs = step.requests
    md = SamplingMetadata.from_requests(
        [r.sampling_params for r in reqs],
        [r.prompt_token_ids for r in reqs],
        [r.output_token_ids for r in reqs],
        [None] * len(reqs),
        runner.model_config.vocab_size,
        runner.device,
    )

    def once() -> None:
        if step.graph_key is not None:
            hidden = graphs.replay(step.graph_key)
        else:
            runner.attn_backend.prepare(step.attn_metadata)
            hidden = runner.model(
                step.input_ids, step.positions, runner.kv_caches, step.attn_metadata
            )
        logits = runner.model.compute_logits(hidden[: len(reqs)])
        runner.sampler.sample_on_device(logits, md)

    with torch.inference_mode():
        once()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def bench_engine_step(
    model: str,
    dtype: str,
    device: str,
    batch: int,
    context: int,
    iters: int,
    async_scheduling: bool = False,
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
        async_scheduling=async_scheduling,
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
        n = len(out.num_scheduled_tokens)
        pure_decode[0] = n == batch == out.total_num_scheduled_tokens
        return out

    scheduler.schedule = _timed(schedule, "schedule", times)
    runner.inputs.prepare = _timed(runner.inputs.prepare, "prepare_inputs", times)
    executor = engine.executor
    launch = executor.execute_model_async

    def launch_timed(so: Any) -> Any:
        t0 = time.perf_counter()
        future = launch(so)
        times["execute"] += time.perf_counter() - t0
        future.get = _timed(future.get, "wait_gpu", times)
        return future

    executor.execute_model_async = launch_timed
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
        launched = times["execute"] - times["prepare_inputs"]
        row = {**times, "launch": launched, "total": total, "host": total - times["wait_gpu"]}
        for k, v in row.items():
            samples[k].append(v * 1e3)
    result = {k: statistics.median(v) for k, v in samples.items()}
    if device == "cuda":
        so = scheduler.schedule()  # one more decode step, timed on the device alone
        result["device_step"] = device_step_ms(runner, so, iters)
    graphs = "CUDA graphs" if runner.cuda_graphs is not None else "eager"
    mode = "async scheduling" if async_scheduling else "synchronous"
    print(
        f"engine decode step, batch {batch}, context ~{context}, {dtype} on {device} ({graphs}, "
        f"{mode}): {result['total']:.2f} ms = host {result['host']:.2f} ms + waiting for the "
        f"GPU {result['wait_gpu']:.2f} ms"
        + (f"; the device alone: {result['device_step']:.2f} ms" if "device_step" in result else "")
    )
    for stage in STAGES:
        print(f"  {stage:15s} {result.get(stage, 0.0):8.3f} ms")
    return result
