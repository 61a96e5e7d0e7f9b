"""KVCacheManager: allocation, prefix hits and their limits, verification under collisions."""

from __future__ import annotations

from core_testing import make_request

import pagoda.core.kv_cache_manager as kvm
from pagoda.core.kv_cache_manager import KVCacheManager


def _admit(kv: KVCacheManager, req) -> int:
    """Admit a request the way the scheduler does and compute its whole prompt."""
    blocks, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_hit_is_longest_cached_prefix_but_never_whole_prompt():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    assert _admit(kv, a) == 0
    same = make_request("same", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 8 and len(blocks) == 2  # the last token must be computed: 2 blocks
    longer = make_request("longer", list(range(12)) + [99])
    assert kv.get_computed_blocks(longer)[1] == 12
    diverging = make_request("div", list(range(6)) + [77] * 6)
    assert kv.get_computed_blocks(diverging)[1] == 4


def test_hit_blocks_are_shared_and_counted():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = make_request("a", list(range(10)))
    _admit(kv, a)
    b = make_request("b", list(range(10)))
    assert _admit(kv, b) == 8
    assert kv.get_block_ids("a")[:2] == kv.get_block_ids("b")[:2]
    assert kv.get_block_ids("a")[2] != kv.get_block_ids("b")[2]
    shared = kv.req_to_blocks["a"][0]
    assert shared.ref_cnt == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_total_blocks
    kv.free(b)  # freeing twice is a no-op at this level


def test_generated_tokens_are_cached_as_blocks_fill():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = make_request("a", [1, 2, 3])
    _admit(kv, a)
    for t in (4, 5, 6, 7, 8):  # decode: append the sampled token, then compute it
        a.append_output_token_ids(t)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    follow_up = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(follow_up)[1] == 8


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    _admit(kv, make_request("a", list(range(9)), cache_salt="alice"))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), cache_salt="alice"))[1] == 8


def test_prompt_logprobs_requests_do_not_hit():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    _admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1))[1] == 0


def test_forced_hash_collision_does_not_hit(monkeypatch):
    # Every block hashes alike: only the verified contents and parents tell them apart.
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens, extra=None: 42)
    kv = KVCacheManager(num_blocks=32, block_size=4)
    _admit(kv, make_request("a", [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    # Other first block, same second block: the second block must not hit through a collision.
    assert kv.get_computed_blocks(make_request("b", [3, 3, 3, 3, 2, 2, 2, 2, 0]))[1] == 0
    assert kv.get_computed_blocks(make_request("c", [2, 2, 2, 2, 2, 2, 2, 2, 0]))[1] == 0
    assert kv.get_computed_blocks(make_request("d", [1, 1, 1, 1, 2, 2, 2, 2, 5]))[1] == 8


def test_allocate_fails_without_side_effects_and_counts_evictable_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = make_request("a", list(range(8)))
    _admit(kv, a)
    b = make_request("b", [50] * 12)
    assert kv.allocate_slots(b, 12) is None  # needs 3, 2 free
    assert "b" not in kv.req_to_blocks and kv.num_free_blocks == 2
    kv.free(a)  # a's two cached blocks stay reusable, and count as free
    c = make_request("c", list(range(8)) + [9])
    blocks, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8
    # 3 blocks needed: 2 hits (free right now) + 1 new; the 2 other free blocks suffice.
    assert kv.allocate_slots(c, 1, num_hit, blocks) is not None
    assert kv.num_free_blocks == 1
    d = make_request("d", [60] * 8)
    assert kv.allocate_slots(d, 8) is None


def test_lookahead_and_max_model_len_bound_allocation():
    kv = KVCacheManager(num_blocks=32, block_size=4, max_model_len=10)
    a = make_request("a", [1, 2, 3])
    assert len(kv.allocate_slots(a, 3, num_lookahead_tokens=2)) == 2
    a.num_computed_tokens = 3
    assert len(kv.allocate_slots(a, 1, num_lookahead_tokens=20)) == 1  # capped at 10 tokens


def test_request_freed_blocks_evict_sequence_end_first():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    _admit(kv, a)
    ids = kv.get_block_ids("a")
    kv.free(a)
    order = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    # The partial last block is uncached (reused first); cached blocks go last-to-first.
    assert order[0] == ids[3]
    assert order[-3:] == [ids[2], ids[1], ids[0]]
