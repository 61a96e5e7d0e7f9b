"""InputBuilder's per-request block-id cache: a step copies only the ids added since the last
one, and a request whose block list was replaced (preemption, re-admission) starts over."""

from __future__ import annotations

import torch

from pagoda.core.outputs import SchedulerOutput
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.worker.input_batch import InputBuilder


def _decode_step(builder: InputBuilder, req: Request, blocks: list[int], **sets) -> tuple:
    start = req.num_tokens - 1
    so = SchedulerOutput(
        scheduled_requests=[req],
        num_scheduled_tokens={req.request_id: 1},
        total_num_scheduled_tokens=1,
        block_ids={req.request_id: blocks},
        num_computed_tokens={req.request_id: start},
        **sets,
    )
    step = builder.prepare(so)
    return step.attn_metadata.block_tables[0].tolist(), step.attn_metadata.slot_mapping.tolist()


def test_block_table_follows_a_growing_then_replaced_block_list():
    builder = InputBuilder(32, 4, 8, 4, torch.device("cpu"))
    req = Request("a", [1, 2, 3], SamplingParams(temperature=0.0), None)
    blocks = [5]
    req.append_output_token_ids(9)  # 4 tokens: block 5 full
    assert _decode_step(builder, req, blocks) == ([5], [5 * 4 + 3])
    req.append_output_token_ids(9)  # position 4: a second block, appended in place
    blocks.append(7)
    assert _decode_step(builder, req, blocks) == ([5, 7], [7 * 4 + 0])
    for _ in range(4):  # grow past the cached row's capacity
        req.append_output_token_ids(9)
    blocks.append(11)
    assert _decode_step(builder, req, blocks) == ([5, 7, 11], [11 * 4 + 0])
    # Preempted and re-admitted with other blocks: a new list of the same length.
    assert _decode_step(builder, req, [2, 3, 4], preempted_req_ids={"a"}) == ([2, 3, 4], [16])
    # Even unreported, a different list object is read afresh.
    assert _decode_step(builder, req, [6, 3, 8]) == ([6, 3, 8], [32])
