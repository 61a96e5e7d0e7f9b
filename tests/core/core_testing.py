"""Helpers for the core tests: request/scheduler factories, a fake model runner that keeps its
requests from the steps' plain data as a real runner does (checked against the scheduler's
every step) and checks the KV cache contents it reads, and the bookkeeping invariants of the
block pool."""

from __future__ import annotations

import pickle
import random
from collections import Counter

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.block_pool import NULL_BLOCK_ID
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams
from pagoda.worker.request_state import RequestStates


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
        self.scheduler = scheduler
        # What a real runner keeps of the requests, from the steps' plain data alone; every
        # step checks it against the scheduler's own requests.
        self.states = RequestStates()
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
        kv = self.scheduler.kv_cache_manager
        states = self.states.update(pickle.loads(pickle.dumps(out)))  # as a TP worker gets it
        scheduled = self.scheduler.scheduled_requests(out)
        assert (
            [s.req_id for s in states]
            == [r.request_id for r in scheduled]
            == list(out.num_scheduled_tokens)
        )
        assert set(self.states.requests) == {r.request_id for r in self.scheduler.running}
        for req, state in zip(scheduled, states):
            rid = req.request_id
            assert state.all_token_ids == req.all_token_ids
            assert state.output_token_ids == req.output_token_ids
            assert state.prompt_token_ids == req.prompt_token_ids
            assert state.sampling_params == req.sampling_params
            # A sliding window nulls the scheduler's freed blocks; the runner keeps their ids.
            live = kv.get_block_ids(rid)
            assert len(state.block_ids) == len(live)
            assert all(a == b or b == NULL_BLOCK_ID for a, b in zip(state.block_ids, live))
            start, n = out.num_computed_tokens[rid], out.num_scheduled_tokens[rid]
            tokens = req.all_token_ids + self.in_flight.get(rid, []) + req.spec_token_ids
            assert len(self.in_flight.get(rid, [])) == req.num_output_placeholders - (
                start + n >= len(tokens)
            ), (req, self.in_flight.get(rid))
            assert req.spec_token_ids == out.scheduled_spec_decode_tokens.get(rid, [])
            assert start + n <= len(tokens), (req, start, n)
            keys = _prefix_keys(tokens[: start + n])
            assert NULL_BLOCK_ID not in live[self._first_read(start) // bs :]
            table = state.block_ids  # the runner's own table, as a real runner reads it
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
    ids = out.scheduled_req_ids
    assert len(ids) == len(set(ids)) == len(out.num_scheduled_tokens)
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert all(n >= 1 for n in out.num_scheduled_tokens.values())
    assert scheduler.num_running <= cfg.max_num_seqs
    assert not set(ids) & out.preempted_req_ids
