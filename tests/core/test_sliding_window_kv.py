"""The KV cache manager with a sliding window every layer uses (Mistral): blocks behind the
window are freed as a request advances, so its memory is bounded by the window, not by the
context; prefix hits stay verified block by block from the first one."""

from __future__ import annotations

import pytest
from core_testing import (
    FakeModelRunner,
    check_block_invariants,
    check_step_invariants,
    make_request,
    make_scheduler,
)

from pagoda.core.block_pool import NULL_BLOCK_ID
from pagoda.core.kv_cache_manager import KVCacheManager


def _admit(kv: KVCacheManager, req) -> int:
    blocks, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def _held(kv: KVCacheManager, rid: str) -> int:
    return sum(1 for b in kv.get_block_ids(rid) if b != NULL_BLOCK_ID)


def test_32k_context_holds_only_the_window_blocks():
    window, block_size, budget = 4096, 16, 2048
    # 400 blocks: a tenth of what a 32k context needs without the window.
    sched = make_scheduler(
        num_blocks=400,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_model_len=40000,
        sliding_window=window,
    )
    kv = sched.kv_cache_manager
    bound = kv.max_blocks_per_request(32768 + 64, budget)
    assert bound == (window - 1 + budget) // block_size + 1 + 1 <= kv.num_total_blocks
    req = make_request("long", [i % 50 for i in range(32768)], max_tokens=64, ignore_eos=True)
    sched.add_request(req)
    runner = FakeModelRunner(sched)
    most_held = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        check_step_invariants(sched, out)
        check_block_invariants(sched)
        if "long" in kv.req_to_blocks:
            most_held = max(most_held, _held(kv, "long"))
            assert kv.get_num_blocks("long") * block_size >= req.num_computed_tokens
        runner_out = runner.execute(out)
        sched.update_from_output(out, runner_out)
        runner.delivered(runner_out)
    assert req.num_output_tokens == 64
    assert window // block_size < most_held <= bound
    assert kv.num_free_blocks == kv.num_total_blocks


def test_without_the_window_a_32k_request_does_not_fit():
    sched = make_scheduler(num_blocks=400, block_size=16, max_model_len=40000)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("long", list(range(32768)), max_tokens=64))


def test_decode_frees_blocks_as_they_leave_the_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=6)
    a = make_request("a", list(range(10)))
    _admit(kv, a)
    # The next query (position 10) sees keys 5..10: block 0 (0-3) is out, block 1 (4-7) is in.
    a.append_output_token_ids(99)
    assert kv.allocate_slots(a, 1) is not None
    assert kv.get_block_ids("a")[0] == NULL_BLOCK_ID and _held(kv, "a") == 2
    for t in range(100, 120):
        a.num_computed_tokens += 1
        a.append_output_token_ids(t)
        assert kv.allocate_slots(a, 1) is not None
        # The window (6 keys) spans at most 3 blocks of 4 when computing the next one.
        assert _held(kv, "a") <= 3
    kv.free(a)
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.block_pool.null_block.ref_cnt == 0


def test_prefix_hit_holds_only_the_blocks_in_the_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=6)
    prompt = list(range(40))
    a = make_request("a", prompt)
    _admit(kv, a)
    b = make_request("b", prompt + [7, 8])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 40
    # Position 40 sees keys 35..40: blocks 0-7 are not held, block 8 (32-35) and 9 are.
    assert [blk.block_id for blk in blocks[:8]] == [NULL_BLOCK_ID] * 8
    assert blocks[8:] and all(blk.block_id != NULL_BLOCK_ID for blk in blocks[8:])
    before = kv.num_free_blocks
    assert kv.allocate_slots(b, 2, num_hit, blocks) is not None
    assert kv.num_free_blocks == before - 1  # one new block; the hits were held by a
    assert kv.get_block_ids("b")[8:10] == kv.get_block_ids("a")[8:10]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)


def test_freed_window_blocks_hit_only_while_the_whole_chain_is_cached():
    kv = KVCacheManager(num_blocks=40, block_size=4, sliding_window=6)
    prompt = list(range(60))
    a = make_request("a", prompt)
    _admit(kv, a)
    a.append_output_token_ids(1)
    assert kv.allocate_slots(a, 1) is not None  # frees a's blocks behind the window
    assert _held(kv, "a") < 5
    assert kv.get_computed_blocks(make_request("b", prompt + [5]))[1] == 60
    # Take every free block: the freed cached blocks are evicted, block 0 among them.
    taker = make_request("taker", [3] * (4 * kv.num_free_blocks))
    assert kv.allocate_slots(taker, taker.num_tokens) is not None
    kv.free(taker)
    assert kv.get_computed_blocks(make_request("c", prompt + [5]))[1] == 0


def test_window_of_one_keeps_the_last_hit_block():
    kv = KVCacheManager(num_blocks=32, block_size=4, sliding_window=1)
    a = make_request("a", list(range(12)))
    _admit(kv, a)
    b = make_request("b", list(range(12)) + [1])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12 and blocks[-1].block_id != NULL_BLOCK_ID
    assert kv.allocate_slots(b, 1, num_hit, blocks) is not None
    b.num_computed_tokens = 13
    b.append_output_token_ids(2)
    assert kv.allocate_slots(b, 1) is not None
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_total_blocks
