"""Plain statistics the engine produces each step; loggers (log lines, Prometheus) consume them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """State of the scheduler after a step. Counters are deltas since the previous step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # in the scheduler's queue: waiting for room in the batch
    # Waiting off the scheduler for something other than room (vLLM's skipped waiting
    # requests): samples whose structured-outputs constraint is being compiled. Set by the
    # engine core loop, which holds them.
    num_deferred_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (delta)
    prefix_cache_hits: int = 0  # of which found (delta)
    num_preemptions: int = 0  # (delta)


@dataclass
class FinishedRequestStats:
    """A request (one sample) that ended, and where its time went. A phase it never reached
    has no time, as in vLLM: one that left the queue unscheduled (aborted by its client, or
    dropped after --max-queue-delay-s) spent its whole life in the queue; one that ended before
    its first token has no prefill, decode or inference time."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float  # arrival -> first scheduled (or -> the end, if never scheduled)
    prefill_time: float | None  # first scheduled -> first token
    decode_time: float | None  # first token -> last token
    mean_time_per_output_token: float | None  # None below 2 tokens
    num_cached_tokens: int = 0  # its prompt tokens the prefix cache held
    num_preemptions: int = 0  # times the scheduler preempted it
    max_tokens_param: int | None = None  # its max_tokens, resolved against the context


@dataclass
class PromptTokenStats:
    """Prompt tokens by where their KV came from, as vLLM's `PromptTokenStats` (Pagoda has no
    KV transfer): each request's (each sample's, with n > 1) whole prompt once, when its first
    token comes."""

    SOURCES = ("local_compute", "local_cache_hit")

    local_compute: int = 0  # computed by the model
    local_cache_hit: int = 0  # whose KV the prefix cache held

    @property
    def total(self) -> int:
        return self.local_compute + self.local_cache_hit

    def update(self, prompt_len: int, num_cached_tokens: int) -> None:
        cached = min(max(num_cached_tokens, 0), prompt_len)
        self.local_cache_hit += cached
        self.local_compute += prompt_len - cached


@dataclass
class IterationStats:
    """What happened in one engine step."""

    iteration_timestamp: float = 0.0
    # Prompt tokens the model computed this step (the engine core's count: prefix-cache hits
    # left out, a preempted request's recomputation in). Not vLLM's num_prompt_tokens: that is
    # `prompt_token_stats.total`.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # tokens sampled this step
    num_scheduled_tokens: int = 0  # tokens the model ran on this step
    # Speculative decoding: requests with drafts verified, their drafts, the drafts accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Per user request that ended this step (all its samples): its n, and the most tokens one
    # of its samples generated (vLLM's ParentRequest observations).
    n_params_iter: list[int] = field(default_factory=list)
    max_num_generation_tokens_iter: list[int] = field(default_factory=list)
    # The prompts whose first token came this step (the output processor's count).
    prompt_token_stats: PromptTokenStats = field(default_factory=PromptTokenStats)
