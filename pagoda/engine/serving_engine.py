"""The engine core a server runs: where it runs, and the server's defaults.

`build_serving_engine` builds the `EngineCore` of `pagoda serve`, in the engine core process
unless $PAGODA_ENABLE_MULTIPROCESSING=0 (`multiprocessing_enabled`). On a CPU a server picks
its own prefill chunk and running batch (`serving_engine_args`), and bounds its waiting queue
by the KV cache (`default_max_waiting_requests`), unless the flags say otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pagoda import envs

logger = logging.getLogger(__name__)


def multiprocessing_enabled() -> bool:
    """$PAGODA_ENABLE_MULTIPROCESSING=0 keeps the served engine on a thread (like vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING)."""
    return envs.PAGODA_ENABLE_MULTIPROCESSING


# A server on a CPU prefills in chunks of this many tokens unless --max-num-batched-tokens says
# otherwise (vLLM too picks its default by usage context, smaller for its server). On a small
# CPU a 2048-token chunk is a step of ~0.6 s (SmolLM2-135M, 2 cores) in which no running request
# gets a token, and a burst's requests see their first token 16 at a time; 512-token chunks
# bound the step and hand first tokens out 4 at a time (32 requests of 128 tokens: median TTFT
# 815-909 ms against 1081-1126 with 2048, the same throughput).
SERVING_CPU_MAX_NUM_BATCHED_TOKENS = 512
# And runs this many requests per core at once unless --max-num-seqs says otherwise. A CPU's
# decode step grows with the batch almost as fast as the batch (2 cores, SmolLM2-135M: ~50
# output tok/s at 8 sequences, ~100 at 64), so 256 running requests each get a token every few
# seconds: under overload every stream crawls and none meets a latency target, where a small
# batch keeps streams at a readable pace and load shedding (the waiting bound, 503 with
# Retry-After) refuses the excess at once. --max-num-seqs 256 trades that for throughput.
SERVING_CPU_SEQS_PER_CORE = 4


def serving_engine_args(engine_args: Any) -> Any:
    """`engine_args` with the server's CPU defaults filled in: the prefill chunk and the
    running batch."""
    from pagoda.engine.arg_utils import resolve_device

    if resolve_device(engine_args.device) != "cpu":
        return engine_args
    changes: dict[str, Any] = {}
    if engine_args.max_num_batched_tokens is None and engine_args.enable_chunked_prefill:
        changes["max_num_batched_tokens"] = SERVING_CPU_MAX_NUM_BATCHED_TOKENS
    if engine_args.max_num_seqs is None:
        from pagoda.worker.model_runner import num_cpu_threads

        changes["max_num_seqs"] = SERVING_CPU_SEQS_PER_CORE * num_cpu_threads()
    return dataclasses.replace(engine_args, **changes) if changes else engine_args


def build_serving_engine(engine_args: Any, same_process_as_frontend: bool = False) -> Any:
    """The `EngineCore` a server runs (in the engine core process, by default)."""
    from pagoda.cli import check_engine_start
    from pagoda.engine.core import EngineCore

    served_args = serving_engine_args(engine_args)
    # What a server's front end (without torch) could not check: refused here in one line
    # (architecture, weight files, memory) before anything is allocated.
    config = check_engine_start(served_args)
    engine = EngineCore(config if config is not None else served_args.create_engine_config())
    if served_args is not engine_args:  # said once the engine started (a refusal is one line)
        logger.info(
            "serving on a CPU: prefill chunks of %s tokens (--max-num-batched-tokens), %s "
            "requests at once (--max-num-seqs)",
            served_args.max_num_batched_tokens or "the default",
            served_args.max_num_seqs or "the default",
        )
    if same_process_as_frontend:
        # The HTTP event loop shares this process's GIL: leave it a core at small batches. In
        # its own process the core does better with every thread (c1 on 2 cores: TPOT 11.5 ms
        # with 2 threads, 15.3 with 1).
        runner = getattr(getattr(engine, "executor", None), "model_runner", None)
        if runner is not None and hasattr(runner, "reserve_core_for_frontend"):
            runner.reserve_core_for_frontend()
    return engine


def default_max_waiting_requests(max_num_seqs: int, num_kv_tokens: int, max_model_len: int) -> int:
    """The waiting-queue bound a server uses unless told otherwise: a quarter of max_num_seqs,
    at most as many requests as the KV cache can run at once at full length (its tokens over
    max_model_len), at least 1. Places in the batch free up about max_num_seqs per running
    request's lifetime, so the last admitted request starts within about a quarter of one; a
    longer queue only makes every request in it late (on 2 cores with 8 running, 5 waiting
    kept 0.40 of the saturation goodput under 3x overload, 2 waiting 0.86:
    docs/reliability.md), and the rest are better answered 503 at once."""
    return max(1, min(max_num_seqs // 4, num_kv_tokens // max(1, max_model_len)))
