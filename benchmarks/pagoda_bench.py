"""The Pagoda side of benchmarks/h200_bench.py: workloads a, b, c and a profile of one step.

Every part drives `LLM.llm_engine` directly (`add_request` then `step()` until done, exactly
what `LLM.generate` does) so that each one can stop at a deadline and abort what is left, and
so that tokens can be timed as they arrive. Prompts are random token ids (dummy weights, no
tokenizer), every request runs to its length (ignore_eos), sampling is greedy. Importing this
module imports no torch: the parent process of the benchmark must leave the GPU alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from pagoda.bench.throughput import make_requests


@dataclass(frozen=True)
class Workloads:
    num_requests: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    stream_prompt_len: int = 128
    stream_output_len: int = 256
    stream_repeats: int = 3
    ttft_prompt_len: int = 512
    ttft_prefix_len: int = 500
    ttft_repeats: int = 8
    profile_batch: int = 256
    profile_context_len: int = 768  # about the mean context of workload a
    copy_bytes: int = 2 << 30  # per buffer: each copy moves 4 GiB
    matmul_n: int = 8192
    ceiling_repeats: int = 20

    @property
    def max_model_len(self) -> int:
        return max(self.input_len[1] + self.output_len[1], self.ttft_prompt_len + 1, 256)


FULL = Workloads()
QUICK = Workloads(16, (16, 64), (16, 64), 32, 16, 2, 64, 50, 3, 16, 64, 64 << 20, 512, 5)


def make_llm(args: argparse.Namespace, w: Workloads) -> Any:
    from pagoda import LLM

    extra = {}
    if args.kv_cache_memory_bytes:
        extra["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        device=args.device,
        seed=0,
        max_model_len=w.max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=0.9,
        enforce_eager=args.enforce_eager,
        async_scheduling=getattr(args, "async_scheduling", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        quantization=getattr(args, "quantization", None),
        **extra,
    )


def _params(max_tokens: int, kind: str = "FINAL_ONLY") -> Any:
    from pagoda import RequestOutputKind, SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind[kind]
    )


def _abort_all(engine: Any) -> None:
    """Abort every request the engine still holds (the ones a deadline cut short)."""
    engine.abort_request(list(getattr(engine.output_processor, "parents", {})))


def _drain(engine: Any, deadline: float, on_output: Any = None) -> tuple[dict[str, Any], bool]:
    """Step until every request finished or `deadline` (perf_counter) passed, in which case
    the rest is aborted. Returns (finished outputs by request id, timed_out)."""
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            _abort_all(engine)
            return finished, True
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            if out.finished:
                finished[out.request_id] = out
    return finished, False


def _submit(engine: Any, tag: str, reqs: list[tuple[list[int], int]]) -> None:
    for i, (ids, n) in enumerate(reqs):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, _params(n))


class StepTimer:
    """Splits engine time into launching steps (input preparation, graph replay, sampler),
    waiting for their sampled ids (the host idle, the GPU busy) and the rest (scheduling,
    output processing). With async scheduling the host's work overlaps the GPU's, so the
    GPU waits on the host only where `wait_s` is near zero."""

    def __init__(self, engine: Any, trace: bool = False) -> None:
        self.executor, self.steps = engine.executor, 0
        self.launch_s = self.wait_s = 0.0
        # With `trace` on a CUDA device: per step, CUDA events around its enqueued work and
        # its batch shape, so `trace_summary` can say how long the GPU ran each kind of step
        # and how long it sat idle between steps (waiting on the host).
        self._cuda = None
        if trace and engine.config.device_config.device == "cuda":
            import torch

            self._cuda = torch.cuda
        self.trace: list[tuple[Any, Any, int, int, int]] = []  # (start, end, tokens, reqs, ctx)

    def __enter__(self) -> StepTimer:
        inner = self.executor.execute_model_async

        def timed_get(get: Any) -> Any:
            def wrapped() -> Any:
                t0 = time.perf_counter()
                try:
                    return get()
                finally:
                    self.wait_s += time.perf_counter() - t0

            return wrapped

        def timed(scheduler_output: Any) -> Any:
            t0 = time.perf_counter()
            start = self._event()
            try:
                future = inner(scheduler_output)
            finally:
                self.launch_s += time.perf_counter() - t0
                self.steps += 1
            if start is not None:
                so = scheduler_output
                ctx = sum(
                    so.num_computed_tokens.get(r, 0) + n for r, n in so.num_scheduled_tokens.items()
                )
                n_reqs = len(so.num_scheduled_tokens)
                self.trace.append(
                    (start, self._event(), so.total_num_scheduled_tokens, n_reqs, ctx)
                )
            future.get = timed_get(future.get)
            return future

        self.executor.execute_model_async = timed
        return self

    def __exit__(self, *exc: object) -> None:
        del self.executor.execute_model_async  # back to the class's method

    def _event(self) -> Any:
        if self._cuda is None:
            return None
        ev = self._cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def trace_summary(self) -> dict[str, Any]:
        """GPU time per kind of step (prefill-carrying, decode by batch size) and the idle
        time between steps, from the CUDA events (synchronizes once, after the run)."""
        if not self.trace:
            return {}
        self._cuda.synchronize()
        kinds: dict[str, dict[str, float]] = {}
        idle_ms, prev_end, prev_kind = 0.0, None, None
        gaps: list[tuple[float, int, str, str | None]] = []  # (ms, step, kind, previous kind)
        for i, (start, end, tokens, reqs, ctx) in enumerate(self.trace):
            gap = max(prev_end.elapsed_time(start), 0.0) if prev_end is not None else 0.0
            idle_ms += gap
            prev_end = end
            if tokens > reqs:
                kind = "prefill"
            else:
                lo = next(b for b in (256, 192, 128, 64, 32, 8, 1) if reqs >= b or b == 1)
                kind = f"decode>={lo}"
            gaps.append((gap, i, kind, prev_kind))
            prev_kind = kind
            k = kinds.setdefault(
                kind, {"steps": 0, "gpu_ms": 0.0, "tokens": 0, "ctx": 0, "idle_before_ms": 0.0}
            )
            k["idle_before_ms"] += gap
            k["steps"] += 1
            k["gpu_ms"] += start.elapsed_time(end)
            k["tokens"] += tokens
            k["ctx"] += ctx
        for k in kinds.values():
            k["gpu_ms_per_step"] = round(k["gpu_ms"] / k["steps"], 3)
            k["tokens_per_step"] = round(k["tokens"] / k["steps"], 1)
            k["ctx_per_step"] = round(k["ctx"] / k["steps"])
            k["gpu_ms"] = round(k["gpu_ms"], 1)
            k["idle_before_ms"] = round(k["idle_before_ms"], 1)
        span = self.trace[0][0].elapsed_time(self.trace[-1][1])
        longest = sorted(gaps, reverse=True)[:8]
        return {
            "gpu_span_ms": round(span, 1),
            "gpu_idle_between_steps_ms": round(idle_ms, 1),
            # The GPU's longest waits for the host: before which step, after which kind.
            "longest_idle_gaps": [
                {"ms": round(ms, 2), "step": i, "kind": kind, "after": prev}
                for ms, i, kind, prev in longest
            ],
            "by_kind": kinds,
        }

    @property
    def execute_s(self) -> float:
        return self.launch_s + self.wait_s


def bench_offline_throughput(llm: Any, w: Workloads, deadline: float) -> dict[str, Any]:
    """Workload a. Output and total tokens/s over the requests that finished."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    reqs = make_requests(w.num_requests, w.input_len, w.output_len, vocab, 0)
    # Warm-up outside the clock: same prompt shapes, other tokens (no prefix-cache hits).
    _submit(engine, "warm", make_requests(min(32, w.num_requests), w.input_len, (8, 16), vocab, 1))
    _drain(engine, deadline)
    _submit(engine, "a", reqs)
    with StepTimer(engine, trace=True) as timer:
        start = time.perf_counter()
        done, timed_out = _drain(engine, deadline)
        elapsed = time.perf_counter() - start
    n_in = sum(len(o.prompt_token_ids) for o in done.values())
    n_out = sum(len(o.outputs[0].token_ids) for o in done.values())
    wrong = [k for k, o in done.items() if len(o.outputs[0].token_ids) != reqs[int(k[1:])][1]]
    return {
        "num_requests": len(reqs),
        "num_finished": len(done),
        "timed_out": timed_out,  # then the rates are lower bounds (finished requests only)
        "elapsed_s": round(elapsed, 3),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1),
        "requests_with_wrong_length": wrong[:10],
        "num_steps": timer.steps,
        "execute_model_s": round(timer.execute_s, 3),
        "engine_outside_execute_s": round(elapsed - timer.execute_s, 3),
        "host_waiting_for_gpu_s": round(timer.wait_s, 3),
        "host_busy_s": round(elapsed - timer.wait_s, 3),
        "async_scheduling": engine.config.scheduler_config.async_scheduling,
        "step_trace": timer.trace_summary(),
    }


def bench_single_stream(llm: Any, w: Workloads, deadline: float) -> dict[str, Any]:
    """Workload b. Decode rate from the first token to the last (TTFT excluded), and overall."""
    engine, rng = llm.llm_engine, random.Random(2)
    vocab, runs = engine.model_config.vocab_size, []
    for i in range(w.stream_repeats + 1):  # run 0 warms up and is dropped
        stamps: list[tuple[float, int]] = []  # (arrival time, new tokens) per output

        def on_output(out: Any, stamps: list[tuple[float, int]] = stamps) -> None:
            stamps.append((time.perf_counter(), len(out.outputs[0].token_ids)))

        prompt = [rng.randrange(vocab) for _ in range(w.stream_prompt_len)]
        t0 = time.perf_counter()
        engine.add_request(
            f"b{i}", {"prompt_token_ids": prompt}, _params(w.stream_output_len, "DELTA")
        )
        _, timed_out = _drain(engine, deadline, on_output)
        t_end = time.perf_counter()
        if timed_out:
            raise TimeoutError(f"single-stream run {i} did not finish in its time box")
        stamps = [s for s in stamps if s[1] > 0]
        n = sum(k for _, k in stamps)
        if i > 0 and len(stamps) >= 2:
            runs.append(
                {
                    "tokens": n,
                    "ttft_ms": (stamps[0][0] - t0) * 1e3,
                    "decode_tokens_per_s": (n - stamps[0][1]) / (stamps[-1][0] - stamps[0][0]),
                    "overall_tokens_per_s": n / (t_end - t0),
                }
            )
    if not runs:
        raise RuntimeError("no single-stream run produced two or more outputs")
    out: dict[str, Any] = {"repeats": len(runs), "tokens": runs[0]["tokens"]}
    for key in ("decode_tokens_per_s", "overall_tokens_per_s", "ttft_ms"):
        out[key] = round(statistics.median(r[key] for r in runs), 2)
    return out


def _time_one(engine: Any, rid: str, prompt: list[int], deadline: float) -> tuple[float, Any]:
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, _params(1))
    done, timed_out = _drain(engine, deadline)
    if timed_out:
        raise TimeoutError(f"TTFT request {rid} did not finish in its time box")
    return time.perf_counter() - t0, done[rid]


def bench_ttft(llm: Any, w: Workloads, deadline: float) -> dict[str, Any]:
    """Workload c. TTFT = add_request to the step that returns the first (only) token."""
    engine, rng = llm.llm_engine, random.Random(3)
    vocab, block = engine.model_config.vocab_size, engine.config.cache_config.block_size

    def fresh(n: int) -> list[int]:  # random ids: no prefix-cache hit by accident
        return [rng.randrange(vocab) for _ in range(n)]

    idle, cached, hits, idle_hits, metric_ms = [], [], [], [], []
    tail = w.ttft_prompt_len - w.ttft_prefix_len
    for i in range(w.ttft_repeats + 1):  # i == 0 warms up and is dropped
        seconds, out = _time_one(engine, f"c_idle{i}", fresh(w.ttft_prompt_len), deadline)
        if i > 0:
            idle.append(seconds * 1e3)
            idle_hits.append(out.num_cached_tokens)
            m = out.metrics
            if m is not None and m.first_token_time is not None:
                metric_ms.append((m.first_token_time - m.arrival_time) * 1e3)
    for i in range(w.ttft_repeats + 1):
        prefix = fresh(w.ttft_prefix_len)
        _time_one(engine, f"c_fill{i}", prefix + fresh(tail), deadline)
        seconds, out = _time_one(engine, f"c_hit{i}", prefix + fresh(tail), deadline)
        if i > 0:
            cached.append(seconds * 1e3)
            hits.append(out.num_cached_tokens)
    return {
        "prompt_len": w.ttft_prompt_len,
        "prefix_len": w.ttft_prefix_len,
        "idle_ms": round(statistics.median(idle), 3),
        "idle_ms_all": [round(x, 3) for x in idle],
        "idle_ms_from_request_metrics": round(statistics.median(metric_ms), 3)
        if metric_ms
        else None,
        "idle_max_num_cached_tokens": max(idle_hits),
        "cached_ms": round(statistics.median(cached), 3),
        "cached_ms_all": [round(x, 3) for x in cached],
        "min_num_cached_tokens": min(hits),
        "expected_num_cached_tokens": w.ttft_prefix_len // block * block,
    }


def profile_decode_step(llm: Any, w: Workloads, deadline: float) -> dict[str, Any]:
    """Where the time of one all-decode step at high batch goes: the wall time of five steps,
    then the top ops/kernels of three steps under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    reqs = make_requests(w.profile_batch, (w.profile_context_len,) * 2, (64, 64), vocab, 4)
    _submit(engine, "p", reqs)
    all_decode = False
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        engine.step()  # until the whole batch is past its prefill
        st = getattr(engine, "last_iteration_stats", None)
        if st is None:
            break  # an engine without step stats: profile whatever batch it runs
        all_decode = st.num_prompt_tokens == 0 and st.num_scheduled_tokens == w.profile_batch
        if all_decode:
            break
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.step()
        walls.append(round((time.perf_counter() - t0) * 1e3, 2))
    acts = [ProfilerActivity.CPU]
    if engine.config.device_config.device == "cuda" and torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof, StepTimer(engine) as timer:
        for _ in range(3):
            engine.step()
    _abort_all(engine)
    keys = ["self_device_time_total", "self_cuda_time_total"] if len(acts) > 1 else []
    table = ""
    for key in [*keys, "self_cpu_time_total"]:
        try:  # the sort keys were renamed across torch releases
            table = prof.key_averages().table(sort_by=key, row_limit=20)
            break
        except Exception:  # noqa: BLE001
            continue
    return {
        "batch": w.profile_batch,
        "context_len": w.profile_context_len,
        "all_decode_batch_reached": all_decode,
        "step_wall_ms": walls,
        "profiled_execute_model_ms_per_step": round(timer.execute_s / 3 * 1e3, 2),
        "top_ops": table,
    }
