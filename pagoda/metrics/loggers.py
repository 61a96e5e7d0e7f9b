"""A log line every few seconds: throughput, queue, KV-cache usage and prefix-cache hit rate."""

from __future__ import annotations

import time

from pagoda.logger import init_logger
from pagoda.metrics.stats import IterationStats, SchedulerStats

logger = init_logger(__name__)


class LoggingStatLogger:
    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.last_log = now
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        self.prompt_tokens += it.prompt_token_stats.total  # whole prompts, as vLLM's line
        self.generation_tokens += it.num_generation_tokens
        self.prefix_queries += sched.prefix_cache_queries
        self.prefix_hits += sched.prefix_cache_hits
        self.draft_tokens += it.num_draft_tokens
        self.accepted_tokens += it.num_accepted_tokens
        now = time.monotonic()
        elapsed = now - self.last_log
        if elapsed < self.interval_s:
            return
        if self.prompt_tokens or self.generation_tokens or sched.num_running_reqs:
            hit_rate = (
                100.0 * self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
            )
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                self.prompt_tokens / elapsed,
                self.generation_tokens / elapsed,
                sched.num_running_reqs,
                sched.num_waiting_reqs,
                100.0 * sched.kv_cache_usage,
                hit_rate,
            )
            if self.draft_tokens:
                logger.info(
                    "Speculative decoding: %d draft tokens, %d accepted (%.1f%%)",
                    self.draft_tokens,
                    self.accepted_tokens,
                    100.0 * self.accepted_tokens / self.draft_tokens,
                )
        self._reset(now)
