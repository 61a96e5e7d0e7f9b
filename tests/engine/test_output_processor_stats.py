"""The per-request statistics the output processor hands the metrics (`FinishedRequestStats`,
`IterationStats`), fed step outputs by hand and read back through `PrometheusStatLogger`: where
each request's time went, and how its prompt tokens are counted."""

from __future__ import annotations

import pytest

from pagoda.core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagoda.engine.output_processor import OutputProcessor
from pagoda.metrics.prometheus import PrometheusStatLogger
from pagoda.metrics.stats import IterationStats
from pagoda.sampling_params import SamplingParams

M = {"model_name": "m"}


def _add(op: OutputProcessor, rid: str, prompt: list[int], arrival: float, n: int = 1) -> None:
    params = SamplingParams(max_tokens=8, n=n, detokenize=False)
    samples = [EngineCoreRequest(f"{i}_{rid}", prompt, params, arrival, None, 8) for i in range(n)]
    op.add_request(rid, None, prompt, params, samples, arrival)


def _step(op: OutputProcessor, now: float, outputs: list[EngineCoreOutput], scheduled=None):
    stats = IterationStats(iteration_timestamp=now)
    op.process_core_outputs(EngineCoreOutputs(outputs, scheduled or {}, stats), now)
    return stats


def _value(logger: PrometheusStatLogger, name: str, **labels: str) -> float:
    v = logger.registry.get_sample_value("pagoda:" + name, {**M, **labels})
    return 0.0 if v is None else v


def _record(stats: IterationStats) -> PrometheusStatLogger:
    logger = PrometheusStatLogger("m", max_model_len=256)
    logger.record_iteration_stats(stats)
    return logger


def test_a_request_aborted_while_waiting_has_queue_time_and_no_prefill_time():
    # The --max-queue-delay-s path (and a client leaving while its request waits): the core
    # never scheduled it, so its whole life is queue time; it never prefilled or decoded.
    op = OutputProcessor(None)
    _add(op, "r", [1, 2, 3], arrival=100.0)
    assert op.abort_requests(["r"], now=101.0) == ["0_r"]
    stats = _step(op, 101.5, [])
    (f,) = stats.finished_requests
    assert f.finish_reason == "abort"
    assert f.queued_time == pytest.approx(1.0)
    assert (f.prefill_time, f.decode_time, f.mean_time_per_output_token) == (None, None, None)

    logger = _record(stats)
    assert _value(logger, "request_success_total", finished_reason="abort") == 1
    assert _value(logger, "request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert _value(logger, "e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds"):  # fmt: skip
        assert _value(logger, name + "_count") == 0, name


def test_a_request_aborted_during_prefill_has_queue_time_only():
    op = OutputProcessor(None)
    _add(op, "r", [1, 2, 3], arrival=100.0)
    _step(op, 100.5, [], scheduled={"0_r": 100.25})  # scheduled, its prompt not yet through
    op.abort_requests(["r"], now=102.0)
    (f,) = _step(op, 102.0, []).finished_requests
    assert f.queued_time == pytest.approx(0.25)
    assert f.prefill_time is None and f.decode_time is None


def test_a_finished_request_splits_its_time_into_queue_prefill_and_decode():
    op = OutputProcessor(None)
    _add(op, "r", [1, 2, 3], arrival=100.0)
    _step(op, 101.0, [EngineCoreOutput("0_r", [7])], scheduled={"0_r": 100.5})
    _step(op, 101.5, [EngineCoreOutput("0_r", [8])])
    stats = _step(op, 102.0, [EngineCoreOutput("0_r", [9], finish_reason="length")])
    (f,) = stats.finished_requests
    assert (f.queued_time, f.prefill_time, f.decode_time) == pytest.approx((0.5, 0.5, 1.0))
    assert f.mean_time_per_output_token == pytest.approx(0.5)
    logger = _record(stats)
    assert _value(logger, "request_inference_time_seconds_sum") == pytest.approx(1.5)
    assert _value(logger, "request_time_per_output_token_seconds_count") == 1


def test_prompt_tokens_count_whole_prompts_with_prefix_cache_hits_by_source():
    # vLLM's prompt_tokens_total: each request's (each sample's) whole prompt at its first
    # token, whatever the prefix cache held; by source, what was computed and what was a hit.
    op = OutputProcessor(None)
    prompt = list(range(10))
    _add(op, "a", prompt, arrival=100.0)
    _add(op, "b", prompt, arrival=100.0, n=2)
    outs = [EngineCoreOutput("0_a", [7], num_cached_tokens=0),
            EngineCoreOutput("0_b", [7], num_cached_tokens=8),
            EngineCoreOutput("1_b", [7], num_cached_tokens=9)]  # fmt: skip
    stats = _step(op, 101.0, outs)
    stats.num_prompt_tokens = 12  # the core's count: what the model computed
    _step(op, 101.5, [EngineCoreOutput("0_a", [8])])  # a later token counts no prompt again
    logger = _record(stats)
    assert _value(logger, "prompt_tokens_total") == 30
    assert _value(logger, "prompt_tokens_by_source_total", source="local_compute") == 13
    assert _value(logger, "prompt_tokens_by_source_total", source="local_cache_hit") == 17
    assert _value(logger, "iteration_tokens_total_sum") == 12 + 3
