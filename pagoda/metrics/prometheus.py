"""Prometheus exposition of the engine's statistics, under vLLM's metric names with `pagoda:`.

`PrometheusStatLogger` owns one `CollectorRegistry` (one per server app, so tests can build
several) and is fed on the engine thread after every step from `engine.last_scheduler_stats`
and `engine.last_iteration_stats` (`pagoda.metrics.stats`). Gauges describe the state after
the step, counters add the step's deltas, histograms observe per-token and per-finished-request
timings. prometheus_client is thread-safe, so `/metrics` can render while the engine writes.
On a machine with an NVIDIA GPU the registry also reads GPU memory at each scrape (`gpu`).

Labels as vLLM's: every engine metric has `model_name` and `engine="0"` (Pagoda runs one
engine core), so a query written for vLLM, `{engine="0"}` included, works after the rename;
`admission_rejections_total`, counted by the front end before a request reaches an engine, has
`model_name` and `reason` only, as vLLM's.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagoda.metrics import gpu
from pagoda.metrics.stats import IterationStats, PromptTokenStats, SchedulerStats

PREFIX = "pagoda:"

# Bucket boundaries as vLLM's (vllm/v1/metrics/buckets.py), so dashboards carry over.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
ENGINE = "0"  # the `engine` label: Pagoda serves a model with one engine core
# Why a request was refused for load (`admission_rejections_total{reason}`): vLLM's name for
# its queue bound (here --max-waiting-requests), and Pagoda's structured-outputs limits (no
# grammar compiler free within PAGODA_GRAMMAR_COMPILE_TIMEOUT_S; PAGODA_GRAMMAR_MAX_ABANDONED
# constraints given up on as too slow still running).
ADMISSION_REASONS = ("max_num_queued_reqs", "grammar_compile_backlog", "grammar_max_abandoned")
WAITING_REASONS = ("capacity", "deferred")

# The histograms: (attribute of PrometheusStatLogger, metric name, help, buckets); None buckets
# are 1-2-5 token counts up to max_model_len. Names and help texts are vLLM's.
_HISTOGRAMS: tuple[tuple[str, str, str, tuple[float, ...] | None], ...] = (
    ("request_prompt_tokens", "request_prompt_tokens",
     "Number of prefill tokens processed.", None),
    ("request_generation_tokens", "request_generation_tokens",
     "Number of generation tokens processed.", None),
    ("iteration_tokens", "iteration_tokens_total",
     "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS),
    ("time_to_first_token", "time_to_first_token_seconds",
     "Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS),
    ("inter_token_latency", "inter_token_latency_seconds",
     "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS),
    ("request_time_per_output_token", "request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS),
    ("e2e_request_latency", "e2e_request_latency_seconds",
     "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    ("request_queue_time", "request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("request_inference_time", "request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("request_prefill_time", "request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
    ("request_decode_time", "request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
    ("request_max_num_generation_tokens", "request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", None),
    ("request_params_n", "request_params_n",
     "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
    ("request_params_max_tokens", "request_params_max_tokens",
     "Histogram of the max_tokens request parameter.", None),
    ("request_num_preemptions", "request_num_preemptions",
     "Histogram of the number of times a request was preempted.",
     REQUEST_NUM_PREEMPTIONS_BUCKETS),
    ("request_prefill_kv_computed_tokens", "request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", None),
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's request-token buckets)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    """Engine metrics for one served model; call `record(engine)` on the engine thread."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_config: Any = None,
        registry: CollectorRegistry | None = None,
        num_gpu_blocks: int | None = None,
    ) -> None:
        # No `*_created` series beside every counter and histogram, as vLLM.
        prometheus_client.disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels, values = self.registry, ["model_name", "engine"], (model_name, ENGINE)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(
                *values
            )

        def by(name: str, doc: str, label: str, keys: tuple[str, ...], kind: Any) -> dict:
            family = kind(PREFIX + name, doc, [*labels, label], registry=r)
            return {k: family.labels(*values, k) for k in keys}

        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be processed."
        )
        # capacity: in the scheduler's queue; deferred: a structured-outputs constraint being
        # compiled (vLLM's requests waiting for their FSM are deferred too).
        self.num_requests_waiting_by_reason = by(
            "num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (a "
            "structured-outputs constraint compiling). Sum of all reasons equals "
            "pagoda:num_requests_waiting.",
            "reason",
            WAITING_REASONS,
            Gauge,
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        # Every request's whole prompt, prefix-cache hits included, as vLLM counts it; what the
        # model computed and what the cache held are the two sources below.
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = by(
            "prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            PromptTokenStats.SOURCES,
            Counter,
        )
        # The prompt tokens the prefix cache held, counted as prompt_tokens (at each request's
        # first token); vLLM adds KV transferred from elsewhere, which Pagoda has not.
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        # By cache tier, counted at admission as prefix_cache_hits: Pagoda's prefix cache is
        # the device's KV blocks alone (no host, disk or peer tiers), so "device" is the one
        # source, equal to prefix_cache_hits.
        self.prompt_tokens_cached_by_source = by(
            "prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (the KV "
            "cache in device memory, Pagoda's only tier). Counted at admission; sums to "
            "pagoda:prefix_cache_hits.",
            "source",
            ("device",),
            Counter,
        )
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens.")
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Number of spec decoding drafts (requests verified)."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.engine_restarts = counter(
            "engine_restarts",
            "Times the engine core was restarted after a failure (--max-engine-restarts).",
        )
        success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.request_success = {f: success.labels(*values, f) for f in FINISH_REASONS}
        self._request_success_family = success
        self._label_values = values
        # Requests refused at the door for load (HTTP 503), by the limit they hit: counted by
        # the front end (`AsyncLLM.rejection_hooks`), before any engine, so no engine label.
        rejections = Counter(
            PREFIX + "admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.admission_rejections = {
            reason: rejections.labels(model_name, reason) for reason in ADMISSION_REASONS
        }
        self._admission_rejections_family = rejections
        self._model_name = model_name

        token_buckets = build_1_2_5_buckets(max_model_len)
        for attr, name, doc, buckets in _HISTOGRAMS:
            setattr(self, attr, histogram(name, doc, token_buckets if buckets is None else buckets))
        # An "info" metric as vLLM emits it: a gauge fixed at 1 whose labels carry the values.
        info = {k: str(v) for k, v in _config_items(cache_config)}
        if info and num_gpu_blocks is not None:
            info["num_gpu_blocks"] = str(num_gpu_blocks)
        if info:
            info["engine"] = ENGINE
            g = Gauge(
                PREFIX + "cache_config_info",
                "Information of the LLMEngine CacheConfig",
                sorted(info),
                registry=r,
            )
            g.labels(**info).set(1)
        # GPU memory where there is a GPU (`pagoda.metrics.gpu`), read at each scrape.
        read_gpu = gpu.read_gpu_memory
        if read_gpu():
            r.register(gpu.GPUMemoryCollector(model_name, read_gpu))

    def record(self, engine: Any) -> None:
        """Publish the statistics of the engine's last step (its state after it, its deltas)."""
        self.record_scheduler_stats(engine.last_scheduler_stats)
        self.record_iteration_stats(engine.last_iteration_stats)

    def record_scheduler_stats(self, s: SchedulerStats | None) -> None:
        if s is None:
            return
        self.num_requests_running.set(s.num_running_reqs)
        self.num_requests_waiting.set(s.num_waiting_reqs + s.num_deferred_waiting_reqs)
        self.num_requests_waiting_by_reason["capacity"].set(s.num_waiting_reqs)
        self.num_requests_waiting_by_reason["deferred"].set(s.num_deferred_waiting_reqs)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        self.prefix_cache_queries.inc(s.prefix_cache_queries)
        self.prefix_cache_hits.inc(s.prefix_cache_hits)
        self.prompt_tokens_cached_by_source["device"].inc(s.prefix_cache_hits)
        self.num_preemptions.inc(s.num_preemptions)

    def record_iteration_stats(self, it: IterationStats | None) -> None:
        if it is None:
            return
        prompts = it.prompt_token_stats
        self.prompt_tokens.inc(prompts.total)
        self.prompt_tokens_by_source["local_compute"].inc(prompts.local_compute)
        self.prompt_tokens_by_source["local_cache_hit"].inc(prompts.local_cache_hit)
        self.prompt_tokens_cached.inc(prompts.local_cache_hit)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_drafts:
            self.spec_decode_num_drafts.inc(it.num_drafts)
            self.spec_decode_num_draft_tokens.inc(it.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(it.num_accepted_tokens)
        # Tokens the model ran on: the prompt tokens it computed, not those the cache held.
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for t in it.time_to_first_tokens_iter:
            self.time_to_first_token.observe(t)
        for t in it.inter_token_latencies_iter:
            self.inter_token_latency.observe(t)
        for n in it.n_params_iter:
            self.request_params_n.observe(n)
        for max_gen in it.max_num_generation_tokens_iter:
            self.request_max_num_generation_tokens.observe(max_gen)
        for f in it.finished_requests:
            success = self.request_success.get(f.finish_reason)
            if success is None:
                success = self._request_success_family.labels(*self._label_values, f.finish_reason)
            success.inc()
            self.request_num_preemptions.observe(f.num_preemptions)
            if f.max_tokens_param:
                self.request_params_max_tokens.observe(f.max_tokens_param)
            self.e2e_request_latency.observe(f.e2e_latency)
            self.request_queue_time.observe(f.queued_time)
            # Only a request that reached its first token has prefill, decode and inference
            # times (vLLM's CompletedTiming); one aborted before it has its queue time alone.
            if f.prefill_time is not None and f.decode_time is not None:
                self.request_prefill_time.observe(f.prefill_time)
                self.request_decode_time.observe(f.decode_time)
                self.request_inference_time.observe(f.prefill_time + f.decode_time)
                # The prompt tokens it computed (not those the cache held); likewise only for
                # a request that prefilled (vLLM counts a never-scheduled one's whole prompt).
                self.request_prefill_kv_computed_tokens.observe(
                    f.num_prompt_tokens - min(max(f.num_cached_tokens, 0), f.num_prompt_tokens)
                )
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            if f.mean_time_per_output_token is not None:
                self.request_time_per_output_token.observe(f.mean_time_per_output_token)

    def record_admission_rejection(self, reason: str) -> None:
        """A request refused at the door for load (`AsyncLLM.rejection_hooks`)."""
        counter = self.admission_rejections.get(reason)
        if counter is None:
            counter = self._admission_rejections_family.labels(self._model_name, reason)
        counter.inc()

    def render(self) -> bytes:
        """The text exposition format of everything in this registry."""
        return generate_latest(self.registry)


def _config_items(cfg: Any) -> list[tuple[str, Any]]:
    if cfg is None:
        return []
    import dataclasses

    if dataclasses.is_dataclass(cfg):
        return [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)]
    return sorted(vars(cfg).items())
