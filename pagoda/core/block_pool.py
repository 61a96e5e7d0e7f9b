"""The pool of physical KV-cache blocks: reference counts, the free queue and the prefix cache.

A block holds `block_size` tokens of K/V for every layer. `BlockPool` owns every block's
bookkeeping: its reference count (how many requests hold it), an O(1) doubly-linked free queue
in eviction order, and the map from chained block hash to cached blocks (automatic prefix
caching, as in vLLM v1). A freed block that holds a cached full block stays in the map until it
is handed out again, so a later request with the same prefix reuses it (`touch`).

Hashes are Python's built-in `hash` of a tuple `(parent_hash, token_ids, extra_keys)`: fast,
and deterministic across processes for tuples of ints (the cache salt is folded into an int
with sha256 first). A hash is only a lookup key: a hit is verified against the block's token
ids, its extra keys and the identity of its parent (`cache_seq`, a number given to each block
when it is cached), so even a forced collision cannot return a block with other contents.

Block 0 is the null block: never handed out, never freed. Block tables are padded with 0 and
padded slots are written to slot -1, so whatever a kernel reads through padding is a block no
request owns. `num_total_blocks` therefore counts `num_blocks - 1` usable blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0
# Parent hash of a request's first block (any fixed int works; this one is not a small number).
ROOT_BLOCK_HASH = 0x2545F4914F6CDD1D
# Parent identity of a request's first block; real cache_seq values start at 1.
ROOT_CACHE_SEQ = 0


def hash_block_tokens(
    parent_block_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple | None = None
) -> int:
    """Chained hash of one full block: hash((parent_hash, token_ids, extra_keys))."""
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    return hash((parent, token_ids, extra_keys))


class KVCacheBlock:
    """One physical block. `block_hash` is set while the block is in the prefix cache."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "token_ids",
        "extra_keys",
        "parent_seq",
        "cache_seq",
        "prev_free_block",
        "next_free_block",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Prefix-cache identity, all None while the block is not cached.
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # the tokens it holds, checked on a hit
        self.extra_keys: tuple | None = None
        self.parent_seq: int | None = None  # cache_seq of the block before it in the prefix
        self.cache_seq: int | None = None  # unique per caching; children point at it
        # Links of the free queue (None while held).
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    @property
    def is_cached(self) -> bool:
        return self.cache_seq is not None

    def _reset_hash(self) -> None:
        self.block_hash = self.token_ids = self.extra_keys = None
        self.parent_seq = self.cache_seq = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.is_cached})"


class FreeKVCacheBlockQueue:
    """Doubly-linked list of free blocks: the head is handed out (evicted) first.

    Two sentinels make every operation O(1) and branch-free; `remove` lets a cache hit take a
    free cached block out of the middle of the queue.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left in the queue")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free_block, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None and prev.next_free_block is not None
        nxt = prev.next_free_block
        block.prev_free_block, block.next_free_block = prev, nxt
        prev.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order (for tests and debugging)."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks of one cache, their reference counts and the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}: "
                "raise kv_cache_memory_bytes / num_gpu_blocks_override"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # block_hash -> {block_id: block}. Several blocks may share a hash: the same contents
        # computed twice, or a collision; get_cached_block tells them apart.
        self.cached_block_hash_to_block: dict[int, dict[int, KVCacheBlock]] = {}
        self._next_cache_seq = ROOT_CACHE_SEQ + 1

    @property
    def num_total_blocks(self) -> int:
        """Blocks requests can hold (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including evictable cached ones."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return self.num_used_blocks / self.num_total_blocks

    def get_cached_block(
        self,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent_seq: int = ROOT_CACHE_SEQ,
        extra_keys: tuple | None = None,
    ) -> KVCacheBlock | None:
        """The cached block holding exactly `token_ids` after the prefix ending in `parent_seq`.

        `parent_seq` is the `cache_seq` of the verified block before this one (ROOT_CACHE_SEQ
        for a first block). The hash only finds candidates; contents decide.
        """
        candidates = self.cached_block_hash_to_block.get(block_hash)
        if not candidates:
            return None
        for block in candidates.values():
            if (
                block.parent_seq == parent_seq
                and block.token_ids == token_ids
                and block.extra_keys == extra_keys
            ):
                return block
        return None

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent_seq: int,
        extra_keys: tuple | None = None,
    ) -> int:
        """Enter a full, held block into the prefix cache; return the `cache_seq` that the
        next block of the same prefix must name as its parent.

        If a verified block with the same contents is already cached (the prefix was computed
        twice), this one stays out of the cache and the existing block's seq is returned, so
        the chain continues through it.
        """
        existing = self.get_cached_block(block_hash, token_ids, parent_seq, extra_keys)
        if existing is not None:
            assert existing.cache_seq is not None
            return existing.cache_seq
        if block.is_cached:
            raise RuntimeError(f"block {block.block_id} is already cached")
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.extra_keys = extra_keys
        block.parent_seq = parent_seq
        block.cache_seq = seq = self._next_cache_seq
        self._next_cache_seq += 1
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
        return seq

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        all_token_ids: Sequence[int],
        block_size: int,
        parent_seq: int,
        first_block_extra_keys: tuple | None = None,
    ) -> int:
        """Cache blocks[num_cached_blocks:num_full_blocks] of one request, in order.

        `parent_seq` is the seq of block num_cached_blocks - 1 of that request's prefix
        (ROOT_CACHE_SEQ when starting at 0). Returns the seq of the last block cached.
        """
        for i in range(num_cached_blocks, num_full_blocks):
            token_ids = tuple(all_token_ids[i * block_size : (i + 1) * block_size])
            extra_keys = first_block_extra_keys if i == 0 else None
            parent_seq = self.cache_block(
                blocks[i], block_hashes[i], token_ids, parent_seq, extra_keys
            )
        return parent_seq

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, evicting their cached contents."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.num_free_blocks} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block.cache_seq is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        candidates = self.cached_block_hash_to_block[block.block_hash]
        del candidates[block.block_id]
        if not candidates:
            del self.cached_block_hash_to_block[block.block_hash]
        block._reset_hash()

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A cache hit: hold each block once more, taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 become free.

        Order matters: pass the blocks to evict first first (a request frees its blocks in
        reverse, so its last blocks go before its prefix). Cached blocks join the tail of the
        free queue (least recently used are evicted first); uncached ones join the head, since
        reusing them costs no cached contents.
        """
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.cache_seq is not None:
                    self.free_block_queue.append(block)
                else:
                    self.free_block_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights, or between benchmark runs).

        Only possible while no request holds a block; returns False otherwise (as vLLM does).
        """
        if self.num_used_blocks > 0:
            return False
        for candidates in self.cached_block_hash_to_block.values():
            for block in candidates.values():
                block._reset_hash()
        self.cached_block_hash_to_block.clear()
        return True
