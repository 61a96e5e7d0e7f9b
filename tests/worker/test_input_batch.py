"""InputBuilder's per-request block-id cache: a step copies only the ids added since the last
one, and a request whose block list was replaced (preemption, re-admission) starts over."""

from __future__ import annotations

import torch
from step_testing import StepFeed

from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.worker.input_batch import InputBuilder
from pagoda.worker.request_state import RequestStates


class _Runner:
    """An input builder fed as the runner feeds it: the step's data applied to its requests."""

    def __init__(self) -> None:
        self.builder = InputBuilder(32, 4, 8, 4, torch.device("cpu"))
        self.states = RequestStates()
        self.feed = StepFeed()

    def decode_step(self, req: Request, blocks: list[int], preempted: tuple = ()) -> tuple:
        rid = req.request_id
        start = {rid: req.num_tokens - 1}
        so = self.feed.step([req], {rid: 1}, {rid: blocks}, start, preempted=preempted)
        step = self.builder.prepare(so, self.states.update(so))
        md = step.attn_metadata
        return md.block_tables[0].tolist(), md.slot_mapping.tolist()


def test_block_table_follows_a_growing_then_replaced_block_list():
    runner = _Runner()
    req = Request("a", [1, 2, 3], SamplingParams(temperature=0.0), None)
    blocks = [5]
    req.append_output_token_ids(9)  # 4 tokens: block 5 full
    assert runner.decode_step(req, blocks) == ([5], [5 * 4 + 3])
    req.append_output_token_ids(9)  # position 4: a second block, appended in place
    blocks.append(7)
    assert runner.decode_step(req, blocks) == ([5, 7], [7 * 4 + 0])
    for _ in range(4):  # grow past the cached row's capacity
        req.append_output_token_ids(9)
    blocks.append(11)
    assert runner.decode_step(req, blocks) == ([5, 7, 11], [11 * 4 + 0])
    # Preempted and re-admitted with other blocks: a new list of the same length.
    assert runner.decode_step(req, [2, 3, 4], preempted=("a",)) == ([2, 3, 4], [16])
    # Even unreported, a different list object is read afresh.
    assert runner.decode_step(req, [6, 3, 8]) == ([6, 3, 8], [32])
