"""The scheduler's side of the runner boundary, for tests that drive a runner by hand."""

from __future__ import annotations

from pagoda.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.core.request import Request


def new_request_data(req: Request, block_ids: list[int]) -> NewRequestData:
    return NewRequestData(
        req.request_id,
        req.prompt_token_ids,
        list(req.output_token_ids),
        req.sampling_params,
        list(block_ids),
    )


class StepFeed:
    """Turns a hand-made step over `Request` objects and block tables into a `SchedulerOutput`
    of plain data, as the scheduler does: a request whole the first step it appears (again when
    its object or its block list is a new one), afterwards only the output tokens and blocks it
    gained. Requests named finished or preempted are forgotten."""

    def __init__(self) -> None:
        # req_id -> (request, its block list, output tokens sent, blocks sent)
        self._sent: dict[str, tuple[Request, list[int], int, int]] = {}

    def step(
        self,
        reqs: list[Request],
        num_scheduled_tokens: dict[str, int],
        block_ids: dict[str, list[int]],
        num_computed_tokens: dict[str, int],
        spec: dict[str, list[int]] | None = None,
        finished: set[str] | tuple = (),
        preempted: set[str] | tuple = (),
    ) -> SchedulerOutput:
        for rid in (*finished, *preempted):
            self._sent.pop(rid, None)
        cached, new = CachedRequestData(), []
        for req in reqs:
            rid, blocks = req.request_id, block_ids[req.request_id]
            sent = self._sent.get(rid)
            if sent is not None and sent[0] is req and sent[1] is blocks and len(blocks) >= sent[3]:
                cached.append(rid, req.output_token_ids[sent[2] :], blocks[sent[3] :])
            else:
                new.append(new_request_data(req, blocks))
            self._sent[rid] = (req, blocks, req.num_output_tokens, len(blocks))
        return SchedulerOutput(
            scheduled_cached_reqs=cached,
            scheduled_new_reqs=new,
            num_scheduled_tokens=dict(num_scheduled_tokens),
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            num_computed_tokens=dict(num_computed_tokens),
            scheduled_spec_decode_tokens={r: list(d) for r, d in (spec or {}).items()},
            finished_req_ids=set(finished),
            preempted_req_ids=set(preempted),
        )


def one_step(
    reqs: list[Request],
    num_scheduled_tokens: dict[str, int],
    block_ids: dict[str, list[int]],
    num_computed_tokens: dict[str, int],
) -> SchedulerOutput:
    """A step whose requests are all new to the runner, in the order given."""
    return StepFeed().step(reqs, num_scheduled_tokens, block_ids, num_computed_tokens)
