"""BlockPool: free queue order (against a plain list), LRU eviction, verified cache hits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.block_pool import (
    NULL_BLOCK_ID,
    ROOT_CACHE_SEQ,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["pop", "append", "appendleft", "remove"]), st.integers(0, 1 << 30)
        )
    )
)
def test_free_queue_matches_list_reference(ops):
    blocks = [KVCacheBlock(i) for i in range(8)]
    queue = FreeKVCacheBlockQueue(blocks)
    ref = list(blocks)  # the plain reference: a Python list in eviction order
    for op, arg in ops:
        held = [b for b in blocks if b not in ref]
        if op == "pop" and ref:
            assert queue.popleft() is ref.pop(0)
        elif op in ("append", "appendleft") and held:
            block = held[arg % len(held)]
            getattr(queue, op)(block)
            ref.append(block) if op == "append" else ref.insert(0, block)
        elif op == "remove" and ref:
            block = ref.pop(arg % len(ref))
            queue.remove(block)
        assert queue.get_all_free_blocks() == ref
        assert queue.num_free_blocks == len(ref)


def _cache(pool: BlockPool, block, tokens, parent_seq=ROOT_CACHE_SEQ, parent_hash=None):
    h = hash_block_tokens(parent_hash, tuple(tokens))
    return h, pool.cache_block(block, h, tuple(tokens), parent_seq)


def test_null_block_is_reserved():
    pool = BlockPool(4)
    assert pool.num_total_blocks == pool.num_free_blocks == 3
    blocks = pool.get_new_blocks(3)
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_lru_eviction_order():
    pool = BlockPool(7)
    a = pool.get_new_blocks(3)  # one request's three full blocks, cached as a chain
    seq, parent_hash = ROOT_CACHE_SEQ, None
    for i, block in enumerate(a):
        parent_hash, seq = _cache(pool, block, [i] * 4, seq, parent_hash)
    b = pool.get_new_blocks(2)  # a second request's blocks, never cached
    pool.free_blocks(reversed(a))  # a request frees its last block first
    pool.free_blocks(reversed(b))
    order = [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]
    # Uncached blocks are reused first, then the cached ones from the sequence end: a2, a1, a0.
    assert order[-3:] == [a[2].block_id, a[1].block_id, a[0].block_id]
    assert set(order[:-3]) == {blk.block_id for blk in b} | {6}
    # A hit on a0 takes it out of the queue; evicting the rest follows the queue.
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 5
    taken = pool.get_new_blocks(5)
    assert [blk.block_id for blk in taken][-2:] == [a[2].block_id, a[1].block_id]
    assert not a[1].is_cached and not a[2].is_cached and a[0].is_cached
    assert len(pool.cached_block_hash_to_block) == 1


def test_hit_verifies_tokens():
    pool = BlockPool(8)
    block, child = pool.get_new_blocks(2)
    h, seq = _cache(pool, block, [1, 2, 3, 4])
    assert pool.get_cached_block(h, (1, 2, 3, 4)) is block
    # Same hash, other contents / parent / extra keys: a collision must not hit.
    assert pool.get_cached_block(h, (1, 2, 3, 5)) is None
    assert pool.get_cached_block(h, (1, 2, 3, 4), parent_seq=seq + 100) is None
    assert pool.get_cached_block(h, (1, 2, 3, 4), extra_keys=(7,)) is None
    # A colliding block with other contents is cached beside it; each is found by contents.
    other = pool.get_new_blocks(1)[0]
    pool.cache_block(other, h, (9, 9, 9, 9), ROOT_CACHE_SEQ)
    assert pool.get_cached_block(h, (9, 9, 9, 9)) is other
    assert pool.get_cached_block(h, (1, 2, 3, 4)) is block
    # The child is found only through the parent it was cached under.
    ch = hash_block_tokens(h, (5, 6, 7, 8))
    pool.cache_block(child, ch, (5, 6, 7, 8), seq)
    assert pool.get_cached_block(ch, (5, 6, 7, 8), seq) is child
    assert pool.get_cached_block(ch, (5, 6, 7, 8), other.cache_seq) is None


def test_evicted_parent_orphans_its_children():
    pool = BlockPool(4)
    parent, child = pool.get_new_blocks(2)
    h, seq = _cache(pool, parent, [1, 1])
    ch, _ = _cache(pool, child, [2, 2], seq, h)
    pool.free_blocks([parent, child])  # parent evicted first
    reused = pool.get_new_blocks(2)  # the free block 3, then the parent
    assert reused[1] is parent and not parent.is_cached
    h2, seq2 = _cache(pool, parent, [1, 1])  # same contents cached again: a new identity
    assert seq2 != seq
    assert pool.get_cached_block(ch, (2, 2), seq2) is None


def test_duplicate_contents_keep_one_cached_block():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    h, seq = _cache(pool, first, [3, 3])
    assert pool.cache_block(second, h, (3, 3), ROOT_CACHE_SEQ) == seq
    assert not second.is_cached and len(pool.cached_block_hash_to_block[h]) == 1


def test_double_free_raises():
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    h, _ = _cache(pool, block, [1])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.get_cached_block(h, (1,)) is block
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h, (1,)) is None and not pool.cached_block_hash_to_block
