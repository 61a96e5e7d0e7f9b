"""The per-request statistics the output processor hands the metrics (`FinishedRequestStats`,
`IterationStats`), fed step outputs by hand and read back through `PrometheusStatLogger`: where
each request's time went, and how its prompt tokens are counted."""

from __future__ import annotations

import pytest

from pagoda.core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagoda.engine.output_processor import OutputProcessor
from pagoda.metrics.prometheus import PREFIX, PrometheusStatLogger
from pagoda.metrics.stats import IterationStats
from pagoda.sampling_params import SamplingParams

M = {"model_name": "m", "engine": "0"}  # vLLM's labels of an engine metric


def _add(
    op: OutputProcessor, rid: str, prompt: list[int], arrival: float, n: int = 1, max_tokens=8
) -> None:
    params = SamplingParams(max_tokens=max_tokens, n=n, detokenize=False)
    samples = [EngineCoreRequest(f"{i}_{rid}", prompt, params, arrival, None, max_tokens)
               for i in range(n)]  # fmt: skip
    op.add_request(rid, None, prompt, params, samples, arrival)


def _step(op: OutputProcessor, now: float, outputs: list[EngineCoreOutput], scheduled=None,
          preempted=()):  # fmt: skip
    stats = IterationStats(iteration_timestamp=now)
    op.process_core_outputs(
        EngineCoreOutputs(outputs, scheduled or {}, stats, list(preempted)), now
    )
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


def _record_all(*steps: IterationStats) -> PrometheusStatLogger:
    logger = PrometheusStatLogger("m", max_model_len=256)
    for stats in steps:
        logger.record_iteration_stats(stats)
    return logger


def _buckets(logger: PrometheusStatLogger, name: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts, by upper bound."""
    return {s.labels["le"]: s.value for m in logger.registry.collect() if m.name == PREFIX + name
            for s in m.samples if s.name.endswith("_bucket")}  # fmt: skip


def test_request_parameter_histograms_observe_n_once_per_request_and_max_tokens_per_sample():
    # vLLM's: request_params_n and request_max_num_generation_tokens once per user request, as
    # its last sample ends (the most tokens any sample generated); request_params_max_tokens
    # per sample (its max_tokens resolved against the context).
    op = OutputProcessor(None)
    _add(op, "a", [1, 2, 3], arrival=100.0, n=3, max_tokens=40)
    _add(op, "b", [1, 2, 3], arrival=100.0, max_tokens=7)
    s1 = _step(op, 101.0, [EngineCoreOutput("0_a", [5, 6]), EngineCoreOutput("1_a", [5]),
                           EngineCoreOutput("2_a", [5], finish_reason="stop"),
                           EngineCoreOutput("0_b", [5])])  # fmt: skip
    assert s1.n_params_iter == []  # a's samples are not all done
    s2 = _step(op, 102.0, [EngineCoreOutput("0_a", [7, 8], finish_reason="length"),
                           EngineCoreOutput("1_a", [9], finish_reason="stop")])  # fmt: skip
    assert (s2.n_params_iter, s2.max_num_generation_tokens_iter) == ([3], [4])
    op.abort_requests(["b"], now=103.0)  # an aborted request is observed too, at the next step
    s3 = _step(op, 103.0, [])
    assert (s3.n_params_iter, s3.max_num_generation_tokens_iter) == ([1], [1])
    logger = _record_all(s1, s2, s3)
    assert _value(logger, "request_params_n_count") == 2
    assert _value(logger, "request_params_n_sum") == 4
    assert _buckets(logger, "request_params_n") == {
        "1.0": 1, "2.0": 1, "5.0": 2, "10.0": 2, "20.0": 2, "+Inf": 2}  # fmt: skip
    assert _value(logger, "request_max_num_generation_tokens_sum") == 5
    assert _value(logger, "request_params_max_tokens_count") == 4
    assert _value(logger, "request_params_max_tokens_sum") == 3 * 40 + 7
    assert _buckets(logger, "request_params_max_tokens")["5.0"] == 0
    assert _buckets(logger, "request_params_max_tokens")["10.0"] == 1


def test_request_num_preemptions_counts_each_samples_preemptions():
    # The core reports the samples it preempted each step; a request never preempted is
    # observed as 0, as vLLM's (its first bucket holds 0 and 1).
    op = OutputProcessor(None)
    _add(op, "a", [1, 2, 3], arrival=100.0)
    _add(op, "b", [1, 2, 3], arrival=100.0)
    s1 = _step(op, 101.0, [EngineCoreOutput("0_a", [5]), EngineCoreOutput("0_b", [5])],
               preempted=["0_a"])  # fmt: skip
    s2 = _step(op, 102.0, [EngineCoreOutput("0_b", [6], finish_reason="length")],
               preempted=["0_a", "unknown"])  # fmt: skip
    s3 = _step(op, 103.0, [EngineCoreOutput("0_a", [6], finish_reason="length")])
    assert [f.num_preemptions for f in s2.finished_requests + s3.finished_requests] == [0, 2]
    logger = _record_all(s1, s2, s3)
    assert _value(logger, "request_num_preemptions_count") == 2
    assert _value(logger, "request_num_preemptions_sum") == 2
    assert _buckets(logger, "request_num_preemptions") == {
        "1.0": 1, "2.0": 2, "3.0": 2, "4.0": 2, "5.0": 2, "10.0": 2, "20.0": 2, "+Inf": 2}  # fmt: skip


def test_prefill_kv_computed_tokens_leave_out_each_samples_prefix_cache_hits():
    # Per sample, its prompt less what the prefix cache held for it; a request that never
    # prefilled (aborted in the queue) is not observed.
    op = OutputProcessor(None)
    prompt = list(range(10))
    _add(op, "a", prompt, arrival=100.0, n=2)
    _add(op, "w", prompt, arrival=100.0)
    s1 = _step(op, 101.0, [
        EngineCoreOutput("0_a", [7], num_cached_tokens=0),
        EngineCoreOutput("1_a", [7], finish_reason="length", num_cached_tokens=8)])  # fmt: skip
    s2 = _step(op, 102.0, [EngineCoreOutput("0_a", [8], finish_reason="length")])
    op.abort_requests(["w"], now=102.5)
    s3 = _step(op, 103.0, [])
    logger = _record_all(s1, s2, s3)
    assert _value(logger, "request_prefill_kv_computed_tokens_count") == 2
    assert _value(logger, "request_prefill_kv_computed_tokens_sum") == 10 + 2
    assert _value(logger, "prompt_tokens_cached_total") == 8  # local_cache_hit, as vLLM's
