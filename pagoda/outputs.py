"""What a request returns: `RequestOutput` with one `CompletionOutput` per sample (vLLM's fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Logprob:
    """Log probability of one token, its rank among all tokens (1 = most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: {token_id: Logprob} holding the top-k tokens plus the chosen one.
SampleLogprobs = list[dict[int, Logprob]]
# Same for the prompt; the first prompt token has no logprob (None).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    # "stop" | "length" | "abort" | "error" | "repetition" (repetition_detection) | None while
    # running
    finish_reason: str | None = None
    # The stop string or stop token id that ended it ("repetition_detected" for a repetition).
    stop_reason: int | str | None = None
    # vLLM's field, always None here (Pagoda has no LoRA): code that reads it keeps working.
    lora_request: None = field(default=None, repr=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    encoder_prompt: str | None = field(default=None, repr=False)
    # Set when the request finished with finish_reason "error": what failed, without the
    # internals (the engine's log has the traceback).
    error: str | None = None
    # The error is the request's own doing, not the server's: its structured-outputs
    # constraint took too long to apply (a server answers 400, not 500).
    client_error: bool = False
    # The logprobs of SamplingParams.prompt_logprob_token_ids (vLLM's), float32
    # [prompt_len - 1 - prompt_logprob_start, num_ids]: row i scores its ids as predictions of
    # prompt token prompt_logprob_start + i + 1, -inf at the -1 padding. None until every row
    # is scored (the whole prompt computed), and unless asked for.
    prompt_token_id_logprobs: np.ndarray | None = field(default=None, repr=False)
    # vLLM's fields that never apply to Pagoda (no LoRA, decoder-only models, no KV transfer),
    # always None, so that code reading them keeps working.
    lora_request: None = field(default=None, repr=False)
    encoder_prompt_token_ids: None = field(default=None, repr=False)
    kv_transfer_params: None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs={self.outputs!r}, finished={self.finished}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )
