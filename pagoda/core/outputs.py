"""The narrow boundary between the scheduler and the model runner (vLLM v1's `SchedulerOutput`,
`NewRequestData`, `CachedRequestData`).

`SchedulerOutput` goes in, `ModelRunnerOutput` comes out; both hold plain values only (lists,
dicts, ints, `SamplingParams`, the structured-output bitmask as a numpy array), never a
scheduler object or a list the scheduler keeps changing, so every executor takes the same
object: the in-process runner as it is, tensor-parallel workers pickled. A request reaches the
runner whole once (`NewRequestData`: when it is first scheduled, or again after a preemption),
then only as a diff (`CachedRequestData`: the output tokens and blocks it gained since it was
last sent); the runner keeps its own copy of each request (`pagoda.worker.request_state`) and
forgets it when the request is reported finished or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the runner keeps of a request it does not know yet. It replaces whatever the
    runner held under the same id."""

    req_id: str
    # The request's own prompt list: nobody changes it.
    prompt_token_ids: list[int]
    # Tokens generated before this step (a request resumed after a preemption has some); a copy.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # The request's whole block table (physical block ids, in order); a copy. Block 0 is the
    # null block (never allocated), free to use as padding.
    block_ids: list[int]


@dataclass
class CachedRequestData:
    """What changed in the scheduled requests the runner already knows, one entry per request in
    each list (vLLM's layout: a few lists pickle much faster than many small objects)."""

    req_ids: list[str] = field(default_factory=list)
    # Output tokens appended to the request since it was last sent (tokens sampled by a step
    # still in flight come a step later: the runner reads them on the device meanwhile).
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Block ids appended to its block table since it was last sent. (A sliding window's freed
    # blocks stay in the runner's table: attention never reads outside the window.)
    new_block_ids: list[list[int]] = field(default_factory=list)

    def append(self, req_id: str, new_token_ids: list[int], new_block_ids: list[int]) -> None:
        self.req_ids.append(req_id)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)


@dataclass(eq=False)  # compared by identity: the scheduler keeps each step's requests by it
class SchedulerOutput:
    # The step's requests, in batch order: those the runner knows (running ones) first, then
    # those it does not (newly admitted or resumed ones).
    scheduled_cached_reqs: CachedRequestData
    scheduled_new_reqs: list[NewRequestData]
    # req_id -> tokens to compute this step: the request's tokens [start, start + n) with
    # start = num_computed_tokens[req_id] below
    # (plus its scheduled_spec_decode_tokens at the end when it carries drafts to verify).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> tokens in the KV cache before this step, for every scheduled request: where its
    # scheduled tokens start (the scheduler has already advanced its own request past them).
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> the draft tokens scheduled for verification (speculative decoding); a copy.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests that finished, were aborted or were preempted since the last step:
    # the runner drops any per-request state it keeps for them.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: one row per request in structured_output_request_ids, a numpy int32
    # array [rows, ceil(vocab / 32)] whose bit t of a row allows token t; None when no
    # structured request samples this step.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def scheduled_req_ids(self) -> list[str]:
        """The step's request ids, in batch order."""
        return self.scheduled_cached_reqs.req_ids + [r.req_id for r in self.scheduled_new_reqs]


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
    # req_id -> the rows of its prompt_logprob_token_ids scored this step, in order from row
    # max(prompt_logprob_start, the step's first position) - prompt_logprob_start: per row the
    # logprob of each id ([num_rows][num_ids]; -inf for the -1 padding).
    prompt_token_id_logprobs: dict[str, list[list[float]]] = field(default_factory=dict)
    # Seconds the model's forward pass took (--collect-detailed-traces model|all), else None.
    model_forward_time: float | None = None


@dataclass
class EngineCoreOutput:
    """What one step did for one request, as `Scheduler.update_from_output` reports it."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: {token_id: (logprob, rank)}; None unless the request asked for logprobs.
    new_logprobs: list[dict[int, tuple[float, int]]] | None = None
    # Prompt logprobs computed this step (a chunk of the prompt); None unless asked for.
    new_prompt_logprobs: list[dict[int, tuple[float, int]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    # finish_reason "error": why, for the client. The engine ends a request with an error
    # only for what the request itself asked (a constraint too slow to apply).
    error: str | None = None
    # Once finished, with --collect-detailed-traces: the seconds of the model forward passes
    # ("model") and of the executor calls ("worker") of the steps it was in, summed.
    model_forward_time: float | None = None
    model_execute_time: float | None = None
    # Rows of prompt_logprob_token_ids scored this step, not reported before (each row once);
    # None unless asked for. (Last: the fields before it are also given by position.)
    new_prompt_token_id_logprobs: list[list[float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreRequest:
    """One sequence for the engine core: token ids and the sampling parameters of ONE sample.
    The front end has tokenized and validated it, fanned out n > 1 into such requests and
    resolved max_tokens; the core never sees text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None
    # min(sampling_params.max_tokens, max_model_len - len(prompt_token_ids)).
    max_tokens: int
    priority: int = 0


@dataclass
class EngineCoreOutputs:
    """What one `EngineCore.step()` returns: the per-request outputs of the step it finished,
    and when requests were first scheduled (for queue-time metrics; with async scheduling these
    belong to the step just launched, whose outputs come with the next call)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    first_scheduled: dict[str, float] = field(default_factory=dict)
    # The step's `IterationStats` as far as the core knows them (scheduled and prompt tokens,
    # drafts); the output processor adds the token timings and the finished requests.
    iteration_stats: Any = None
    # Requests the scheduler preempted in this call's steps (each time it did), for the
    # per-request preemption counts.
    preempted: list[str] = field(default_factory=list)
