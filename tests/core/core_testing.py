"""Helpers for the core tests: request/scheduler factories, a fake model runner that checks the
KV cache contents it reads, and the bookkeeping invariants of the block pool."""

from __future__ import annotations

import random
from collections import Counter

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.block_pool import NULL_BLOCK_ID
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 16,
    *,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    cache_salt: str | None = None,
    **sampling_kwargs,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sampling_kwargs)
    return Request(
        rid,
        prompt,
        params,
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        max_tokens=max_tokens,
        cache_salt=cache_salt,
    )


def make_scheduler(
    num_blocks: int = 256,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 2048,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    sliding_window: int | None = None,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    cache_cfg = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        sliding_window=sliding_window,
    )
    return Scheduler(sched_cfg, cache_cfg, num_blocks)


def _prefix_keys(tokens: list[int]) -> list[int]:
    # What the K/V at position p depends on: the whole prefix tokens[: p + 1].
    keys, h = [], 0
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


class FakeModelRunner:
    """Writes a key of each computed position's prefix into a fake paged KV cache, checks that
    every position a request attends to holds the right key, and samples random tokens.

    Like a real backend it writes all of a step's K/V before reading any (the contract the
    prefix cache relies on when a block cached this step is hit in the same step). With a
    sliding window it reads, as the backends do, only the positions (p - window, p] of each
    query p: the blocks wholly before them may be the null block.
    """

    def __init__(self, scheduler: Scheduler, vocab: int = 50, seed: int = 0, accept_p: float = 0.7):
        self.block_size = scheduler.block_size
        self.window = scheduler.kv_cache_manager.sliding_window
        self.kv: dict[int, dict[int, int]] = {}
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.accept_p = accept_p
        # Async scheduling: tokens sampled by a step whose output the scheduler has not seen
        # yet (what a real runner reads from the device for the next step's placeholders).
        self.in_flight: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        steps = []
        for req in out.scheduled_requests:
            rid = req.request_id
            start, n = out.num_computed_tokens[rid], out.num_scheduled_tokens[rid]
            tokens = req.all_token_ids + self.in_flight.get(rid, []) + req.spec_token_ids
            assert len(self.in_flight.get(rid, [])) == req.num_output_placeholders - (
                start + n >= len(tokens)
            ), (req, self.in_flight.get(rid))
            assert len(req.spec_token_ids) == out.scheduled_spec_tokens.get(rid, 0)
            assert start + n <= len(tokens), (req, start, n)
            keys = _prefix_keys(tokens[: start + n])
            table = out.block_ids[rid]
            assert NULL_BLOCK_ID not in table[self._first_read(start) // bs :]
            for pos in range(start, start + n):
                self.kv.setdefault(table[pos // bs], {})[pos % bs] = keys[pos]
            steps.append((req, start, n, keys, table))
        sampled: dict[str, list[int]] = {}
        for req, start, n, keys, table in steps:
            # Causal attention reads the prefix (its window) and this chunk.
            for pos in range(self._first_read(start), start + n):
                assert self.kv[table[pos // bs]][pos % bs] == keys[pos], (req, pos)
            if start + n >= req.num_tokens + len(self.in_flight.get(req.request_id, [])):
                accepted = []
                for t in req.spec_token_ids:
                    if self.rng.random() > self.accept_p:
                        break
                    accepted.append(t)
                sampled[req.request_id] = accepted + [self.rng.randrange(self.vocab)]
        for rid, tokens in sampled.items():
            self.in_flight.setdefault(rid, []).extend(tokens)
        return ModelRunnerOutput(req_ids=list(sampled), sampled_token_ids=sampled)

    def _first_read(self, first_position: int) -> int:
        return max(0, first_position - self.window + 1) if self.window else 0

    def delivered(self, output: ModelRunnerOutput) -> None:
        """The scheduler has processed `output`: its tokens are no longer in flight."""
        for rid, tokens in output.sampled_token_ids.items():
            del self.in_flight[rid][: len(tokens)]


def check_block_invariants(scheduler: Scheduler) -> None:
    """No block leaked or double-freed; the free queue, ref counts and tables agree."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.num_free_blocks
    assert len({b.block_id for b in free}) == len(free)
    assert all(b.ref_cnt == 0 and b.block_id != NULL_BLOCK_ID for b in free)
    # A sliding window leaves the null block where a request's blocks were freed.
    held = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    held.pop(NULL_BLOCK_ID, None)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == held.get(block.block_id, 0), block
    num_used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert num_used + pool.num_free_blocks == pool.num_total_blocks
    assert sum(b.ref_cnt for b in pool.blocks[1:]) == sum(held.values())
    # Only running requests hold blocks, and each holds enough for what it computed.
    running = {r.request_id: r for r in scheduler.running}
    assert set(kv.req_to_blocks) <= set(running)
    for rid, blocks in kv.req_to_blocks.items():
        assert kv.get_block_ids(rid) == [b.block_id for b in blocks]
        assert len(blocks) * kv.block_size >= running[rid].num_computed_tokens
    for h, candidates in pool.cached_block_hash_to_block.items():
        for block in candidates.values():
            assert block.block_hash == h and block.cache_seq is not None
    for req in scheduler.running:
        assert req.status == RequestStatus.RUNNING
    for req in scheduler.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.num_computed_tokens == 0 and req.request_id not in kv.req_to_blocks


def check_step_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    cfg = scheduler.scheduler_config
    ids = [r.request_id for r in out.scheduled_requests]
    assert len(ids) == len(set(ids)) == len(out.num_scheduled_tokens)
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert all(n >= 1 for n in out.num_scheduled_tokens.values())
    assert scheduler.num_running <= cfg.max_num_seqs
    assert not set(ids) & out.preempted_req_ids
