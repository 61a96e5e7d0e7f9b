"""`Request`: the scheduler's view of one sequence (one sample of a user request).

One rule drives scheduling: a request has `num_tokens` known tokens (prompt + generated) and
`num_computed_tokens` of them already in the KV cache; each step computes some of the rest.
No torch here.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything past here is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the engine ended it (`Request.error` says why)
    FINISHED_REPETITION = 7  # its output repeats (SamplingParams.repetition_detection)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "repetition",  # vLLM's FinishReason.REPETITION
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # Resolved by the front end (validate_request): min(sampling_params.max_tokens,
        # max_model_len - prompt_len).
        self.max_tokens = (
            max_tokens if max_tokens is not None else (sampling_params.max_tokens or 16)
        )

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = (
            -1
        )  # prompt tokens found in the prefix cache; set when first scheduled
        self.num_preemptions = 0
        # Prompt positions whose prompt logprobs went out (a recompute does not repeat them).
        self.num_prompt_logprobs_reported = 0
        # The same for the rows of prompt_logprob_token_ids.
        self.num_prompt_token_id_rows_reported = 0
        # Speculative decoding: draft tokens to verify this step (appended after all_token_ids).
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens being sampled by a step still in flight (scheduled, not yet
        # appended). The next step may already compute on them; the runner takes their ids from
        # the device.
        self.num_output_placeholders = 0
        # Structured outputs: the request's grammar matcher (set by the engine), fed every
        # appended token; `accept_token(id)` is True when the grammar ends the request, with
        # its `error` set when that is a failure (the matcher took too long to advance).
        self.structured_output: Any = None
        # Why the engine ended the request with FINISHED_ERROR: a message for the client.
        self.error: str | None = None
        # Chained hashes of this request's full blocks (kept by the KV cache manager).
        self.block_hashes: list[int] = []
        # Timestamps for metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Priority order: lower priority value first, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens})"
        )
