"""The narrow boundary between the scheduler and the model runner.

`SchedulerOutput` goes in, `ModelRunnerOutput` comes out; both hold plain Python values only
(lists, dicts, ints), so they cross process boundaries unchanged. The runner treats the
`Request` objects it is handed as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.core.request import Request


@dataclass
class SchedulerOutput:
    # Requests to run this step, in batch order: running ones first, then newly admitted ones.
    scheduled_requests: list[Request]
    # req_id -> tokens to compute this step: all_token_ids[start : start + n] with
    # start = num_computed_tokens[req_id] below
    # (plus spec_token_ids at the end when the request carries drafts to verify).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> the request's whole block table (physical block ids, in order). The KV cache
    # manager's live list: read it during the step, copy what you keep. Block 0 is the null
    # block (never allocated), free to use as padding.
    block_ids: dict[str, list[int]]
    # req_id -> number of draft tokens scheduled for verification (speculative decoding).
    scheduled_spec_tokens: dict[str, int] = field(default_factory=dict)
    # Requests that finished, were aborted or were preempted since the last step:
    # the runner drops any per-request state it keeps for them.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> request.num_computed_tokens BEFORE this step: where its scheduled tokens start.
    # The scheduler has already advanced request.num_computed_tokens past this step when
    # schedule() returns, so the runner must read the start here, not from the request.
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # Structured outputs: one row per request in structured_output_request_ids, a numpy int32
    # array [rows, ceil(vocab / 32)] whose bit t of a row allows token t; None when no
    # structured request samples this step.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # req_id -> tokens sampled this step. Empty for a prefill chunk that does not reach the
    # end of the prompt; one token for a decode; up to 1 + num drafts with speculation.
    sampled_token_ids: dict[str, list[int]]
    # req_id -> per sampled token: {token_id: (logprob, rank)} for the top-k and the sampled one.
    logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)
    # req_id -> per prompt position computed this step whose next token is a prompt token:
    # {token_id: (logprob, rank)}. The output processor prepends None for the first token.
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step did for one request, as `Scheduler.update_from_output` reports it."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: {token_id: (logprob, rank)}; None unless the request asked for logprobs.
    new_logprobs: list[dict[int, tuple[float, int]]] | None = None
    # Prompt logprobs computed this step (a chunk of the prompt); None unless asked for.
    new_prompt_logprobs: list[dict[int, tuple[float, int]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
