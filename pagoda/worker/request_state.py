"""The runner's own copy of the requests it runs (vLLM's `CachedRequestState`), kept by the
`SchedulerOutput`s it is handed, in order.

A request arrives whole once (`NewRequestData`), then as diffs (`CachedRequestData`): the output
tokens and blocks appended since it was last sent. The lists here belong to the runner: the
block table grows in place while the request runs (so the input builder's block-row cache,
keyed by the list, converts only the new ids) and is a new list when the request comes back
whole. Finished and preempted requests are dropped. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.outputs import NewRequestData, SchedulerOutput
from pagoda.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]
    # Prompt then output tokens: those the scheduler knew when it last sent the request (a
    # token still being sampled by the previous step is not among them).
    all_token_ids: list[int]
    block_ids: list[int]

    @classmethod
    def from_new(cls, new: NewRequestData) -> RequestState:
        outputs = list(new.output_token_ids)
        return cls(
            new.req_id,
            new.prompt_token_ids,
            new.sampling_params,
            outputs,
            new.prompt_token_ids + outputs,
            list(new.block_ids),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class RequestStates:
    """The runner's requests by id."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def update(self, so: SchedulerOutput) -> list[RequestState]:
        """Apply one step's data; returns the step's requests in batch order."""
        requests = self.requests
        for rid in so.finished_req_ids:
            requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            requests.pop(rid, None)
        batch: list[RequestState] = []
        cached = so.scheduled_cached_reqs
        for rid, new_tokens, new_blocks in zip(
            cached.req_ids, cached.new_token_ids, cached.new_block_ids
        ):
            state = requests.get(rid)
            if state is None:
                raise RuntimeError(
                    f"request {rid!r} was scheduled as known to the runner, which never got it "
                    "whole (steps must reach the runner in order, none skipped)"
                )
            if new_tokens:
                state.output_token_ids.extend(new_tokens)
                state.all_token_ids.extend(new_tokens)
            if new_blocks:
                state.block_ids.extend(new_blocks)
            batch.append(state)
        for new in so.scheduled_new_reqs:
            state = requests[new.req_id] = RequestState.from_new(new)
            batch.append(state)
        return batch
