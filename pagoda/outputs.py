"""What a request returns: `RequestOutput` with one `CompletionOutput` per sample (vLLM's fields),
and the logprobs containers (`Logprob` dicts per position, or `FlatLogprobs`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np


@dataclass
class Logprob:
    """Log probability of one token, its rank among all tokens (1 = most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]


@dataclass
class FlatLogprobs(MutableSequence[LogprobsOnePosition | None]):
    """vLLM's flat logprobs (`SamplingParams.flat_logprobs`): every position's entries in a few
    flat lists instead of a dict of `Logprob`s each, so a long output makes a constant number of
    objects for the garbage collector, not one per position and rank. Position i holds entries
    start_indices[i] up to end_indices[i]. It reads as a list of per-position dicts (indexing
    gives a fresh dict, {} for a position appended as None; a slice gives a `FlatLogprobs`) and
    grows by `append` / `extend`; it cannot be changed in place."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, logprobs_one_position: LogprobsOnePosition | None) -> None:
        """Add the next position's logprobs (None: a position without any)."""
        entries = logprobs_one_position or {}
        values = entries.values()
        self.append_fast(
            entries,
            [lp.logprob for lp in values],
            [lp.rank for lp in values],
            [lp.decoded_token for lp in values],
        )

    def append_fast(
        self,
        token_ids: Iterable[int],
        logprobs: Iterable[float],
        ranks: Iterable[int | None],
        decoded_tokens: Iterable[str | None],
    ) -> None:
        """`append` without building the position's dict first."""
        self.start_indices.append(len(self.logprobs))
        for token_id, lp, rank, text in zip(token_ids, logprobs, ranks, decoded_tokens):
            self.token_ids.append(token_id)
            self.logprobs.append(lp)
            self.ranks.append(rank)
            self.decoded_tokens.append(text)
        self.end_indices.append(len(self.logprobs))

    def extend(self, logprobs_multi_positions: Iterable[LogprobsOnePosition | None]) -> None:
        for logprobs_one_position in logprobs_multi_positions:
            self.append(logprobs_one_position)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> LogprobsOnePosition | FlatLogprobs:
        if isinstance(index, int):
            return {
                self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])
            }
        if isinstance(index, slice):
            starts, ends = self.start_indices[index], self.end_indices[index]
            if not starts:
                return FlatLogprobs()
            lo, hi = starts[0], ends[-1]  # a step other than 1 is vLLM's: not supported
            return FlatLogprobs(
                start_indices=[i - lo for i in starts],
                end_indices=[i - lo for i in ends],
                token_ids=self.token_ids[lo:hi],
                logprobs=self.logprobs[lo:hi],
                ranks=self.ranks[lo:hi],
                decoded_tokens=self.decoded_tokens[lo:hi],
            )
        raise TypeError(f"Invalid index type: {type(index)}")

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value: LogprobsOnePosition | None) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        for i in range(len(self.start_indices)):
            yield self[i]


# One entry per position: {token_id: Logprob} holding the top-k tokens plus the chosen one.
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]
# Same for the prompt; the first prompt token has no logprob (None; {} in a FlatLogprobs).
PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]


def create_prompt_logprobs(flat_logprobs: bool) -> PromptLogprobs:
    """An empty container of a request's prompt logprobs, holding the first position's None."""
    logprobs: PromptLogprobs = FlatLogprobs() if flat_logprobs else []
    logprobs.append(None)
    return logprobs


def create_sample_logprobs(flat_logprobs: bool) -> SampleLogprobs:
    """An empty container of a sample's logprobs."""
    return FlatLogprobs() if flat_logprobs else []


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
