"""`KVCacheManager`: each request's block table, allocation, and automatic prefix caching.

The scheduler asks two things of it: which prefix of a new request is already in the cache
(`get_computed_blocks`), and room for the tokens it is about to schedule (`allocate_slots`,
which returns None when the pool cannot supply the blocks — the caller then preempts). Every
full block of a request (prompt or generated tokens) is entered into the prefix cache as soon
as the step that fills it is scheduled, so a request admitted later in the same step can
already hit it. That relies on one contract with the attention backends, the one vLLM has:
within a layer, the K/V of every scheduled token is written to the cache before any request
of the step reads the cache.

With a sliding window that every layer uses (`sliding_window`, Mistral), a request only ever
reads its last `sliding_window` positions, so blocks wholly before the window of its next query
are freed as it advances (as vLLM v1's SlidingWindowManager does) and its table holds the null
block there: its KV memory is bounded by the window, not the context. Freed blocks stay in the
prefix cache until evicted. A prefix hit is still found from the first block on, every block
verified against its parent, so a hit needs the whole chain still cached (vLLM also accepts a
hit whose early blocks were evicted; that would trust the hash of the evicted part); the hit
blocks before the new request's window are not held. Torch-free.
"""

from __future__ import annotations

import hashlib

from pagoda.core.block_pool import ROOT_CACHE_SEQ, BlockPool, KVCacheBlock, hash_block_tokens
from pagoda.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.block_size = block_size
        # Every layer attends only to keys (p - sliding_window, p]: blocks before it are freed.
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # req_id -> the request's blocks, and the same as ids (the block table handed out).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        # req_id -> number of its leading blocks already entered into the prefix cache, and the
        # cache_seq the next one must name as parent.
        self.num_cached_blocks: dict[str, int] = {}
        self._chain_seq: dict[str, int] = {}
        # Cumulative prefix-cache counters, in prompt tokens (the scheduler reports deltas).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- prefix cache -------------------------------------------------------------------

    def _use_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs (top-k or of fixed ids) need their prompt positions computed, so such
        # requests never hit; nor do those that ask not to (skip_reading_prefix_cache). All
        # still write their blocks.
        params = request.sampling_params
        return (
            self.enable_caching
            and not params.skip_reading_prefix_cache
            and params.prompt_logprobs is None
            and params.prompt_logprob_token_ids is None
        )

    @staticmethod
    def _first_block_extra_keys(request: Request) -> tuple | None:
        # The salt only enters the first block's hash: the chain carries it to the rest.
        if request.cache_salt is None:
            return None
        digest = hashlib.sha256(request.cache_salt.encode()).digest()
        return (int.from_bytes(digest[:8], "little"),)

    def update_block_hashes(self, request: Request) -> list[int]:
        """Extend `request.block_hashes` to cover every full block of its known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full_blocks = request.num_tokens // bs
        if len(hashes) < num_full_blocks:
            tokens = request.all_token_ids
            for i in range(len(hashes), num_full_blocks):
                extra = self._first_block_extra_keys(request) if i == 0 else None
                parent = hashes[i - 1] if i > 0 else None
                hashes.append(
                    hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs]), extra)
                )
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        Never the whole request: the last token must be computed to sample the next one, so at
        most (num_tokens - 1) // block_size blocks. The blocks are not held until they are
        passed to `allocate_slots` (in the same scheduling step).
        """
        if not self._use_prefix_cache(request):
            return [], 0
        hashes = self.update_block_hashes(request)
        bs = self.block_size
        tokens = request.all_token_ids
        max_hit_blocks = (request.num_tokens - 1) // bs
        blocks: list[KVCacheBlock] = []
        parent_seq = ROOT_CACHE_SEQ
        first_extra = self._first_block_extra_keys(request)
        for i in range(max_hit_blocks):
            block = self.block_pool.get_cached_block(
                hashes[i],
                tuple(tokens[i * bs : (i + 1) * bs]),
                parent_seq,
                first_extra if i == 0 else None,
            )
            if block is None:
                break
            blocks.append(block)
            assert block.cache_seq is not None
            parent_seq = block.cache_seq
        num_hit_tokens = len(blocks) * bs
        # Blocks the request's first computed token cannot see are not held; the last one is
        # (the chain of blocks cached after it continues from its cache_seq).
        for i in range(min(self._num_skipped_blocks(num_hit_tokens), len(blocks) - 1)):
            blocks[i] = self.block_pool.null_block
        return blocks, num_hit_tokens

    # ---- sliding window -----------------------------------------------------------------

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at position >= num_computed_tokens can see."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the request's blocks that left the window of its next query (at position
        num_computed_tokens), leaving the null block in their place in its table."""
        num_skipped = self._num_skipped_blocks(num_computed_tokens)
        blocks = self.req_to_blocks.get(request.request_id)
        if not num_skipped or not blocks:
            return
        if self.enable_caching:
            # Not before they are cached (accepted draft tokens fill blocks the step after).
            num_skipped = min(num_skipped, self.num_cached_blocks[request.request_id])
        block_ids = self.req_to_block_ids[request.request_id]
        null = self.block_pool.null_block
        removed = []
        # Walk back from the last skipped block: the ones before it were freed earlier.
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
            block_ids[i] = null.block_id
        # The oldest first: they are evicted before the newer ones.
        self.block_pool.free_blocks(reversed(removed))

    def max_blocks_per_request(self, max_tokens: int, max_tokens_per_step: int) -> int:
        """Blocks one request holds at most, for up to `max_tokens` tokens scheduled at most
        `max_tokens_per_step` at a time: bounded by the window when there is one."""
        needed = cdiv(max_tokens, self.block_size)
        if self.sliding_window is None:
            return needed
        # The window's blocks before the step's first token, the step's, one partial each end.
        span = self.sliding_window - 1 + max_tokens_per_step
        return min(needed, cdiv(span, self.block_size) + 1)

    # ---- allocation ---------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Hold blocks for request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        (+ lookahead) tokens; return the ids of the newly allocated blocks, or None (nothing
        changed) when not enough blocks are free, evictable cached ones included.

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix-cache hit from
        `get_computed_blocks`, only for a request that holds no blocks yet.
        """
        rid = request.request_id
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(rid)
        if new_computed_blocks and req_blocks:
            raise ValueError(
                f"request {rid} already holds blocks; a prefix hit is only for new ones"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if req_blocks:
            self.remove_skipped_blocks(request, num_computed)
        num_tokens_need_slot = min(
            num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_held = (len(req_blocks) if req_blocks is not None else 0) + len(new_computed_blocks)
        num_new_blocks = max(0, cdiv(num_tokens_need_slot, self.block_size) - num_held)
        pool = self.block_pool
        # Hit blocks that are free right now stop counting as free once they are held.
        num_evictable_hits = sum(
            1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not pool.null_block
        )
        if num_new_blocks > pool.num_free_blocks - num_evictable_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
            self.num_cached_blocks[rid] = 0
            self._chain_seq[rid] = ROOT_CACHE_SEQ
            if self._use_prefix_cache(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        block_ids = self.req_to_block_ids[rid]
        if new_computed_blocks:
            # Touch before taking new blocks, so the hits cannot be evicted by that take.
            pool.touch(b for b in new_computed_blocks if b is not pool.null_block)
            req_blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self.num_cached_blocks[rid] = len(new_computed_blocks)
            last_seq = new_computed_blocks[-1].cache_seq
            assert last_seq is not None
            self._chain_seq[rid] = last_seq
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        new_block_ids = [b.block_id for b in new_blocks]
        block_ids.extend(new_block_ids)

        if self.enable_caching:
            # Draft tokens are not known tokens: only blocks of real tokens are cached.
            num_full_blocks = (
                min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            )
            if num_full_blocks > self.num_cached_blocks[rid]:
                self._cache_blocks(request, num_full_blocks)
        return new_block_ids

    def _cache_blocks(self, request: Request, num_full_blocks: int) -> None:
        # A block is cached by the step that fills it, before it can leave any window.
        rid = request.request_id
        self.update_block_hashes(request)
        self._chain_seq[rid] = self.block_pool.cache_full_blocks(
            self.req_to_blocks[rid],
            request.block_hashes,
            self.num_cached_blocks[rid],
            num_full_blocks,
            request.all_token_ids,
            self.block_size,
            self._chain_seq[rid],
            self._first_block_extra_keys(request),
        )
        self.num_cached_blocks[rid] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release every block the request holds (no-op if it holds none).

        Its last blocks are freed first so that, among its cached blocks, the end of the
        sequence is evicted before the shared prefix.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks is None:
            return
        del self.req_to_block_ids[rid]
        del self.num_cached_blocks[rid]
        del self._chain_seq[rid]
        self.block_pool.free_blocks(reversed(blocks))

    # ---- queries ------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: the live list, extended in place as blocks are added
        (read it, do not keep or modify it)."""
        return self.req_to_block_ids[request_id]

    def get_num_blocks(self, request_id: str) -> int:
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks) if blocks is not None else 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_total_blocks

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
