"""The continuous-batching scheduler (vLLM v1's single rule, torch-free).

Every request has `num_tokens_with_spec` tokens to know and `num_computed_tokens` of them in
the KV cache. Each step hands out one token budget (`max_num_batched_tokens`): running
requests first, each getting what it still needs (a decode: 1 token plus any drafts; a long
prompt: a chunk — chunked prefill), then waiting requests in policy order ("fcfs" or
"priority"), at most `max_num_seqs` running at once. When the KV cache cannot hold a running
request's next tokens, the last running request (fcfs: latest admitted; priority: lowest
priority) is preempted: its blocks are freed and it is recomputed later. There are no
separate prefill and decode phases, and speculative drafts are just more tokens to verify.

Under "priority" the running list is kept in priority order, so higher-priority requests get
the budget first and the victim of a preemption is always one not yet scheduled this step.
Waiting requests never preempt running ones (vLLM's optional priority preemption is not done).

`schedule()` hands the executor plain data (`pagoda.core.outputs`): a request in full the step it
is admitted (again, after a preemption), afterwards only the output tokens and blocks it gained
since it was last sent. The scheduler keeps each step's `Request` objects to itself, for
`update_from_output` and for the engine (`scheduled_requests`).
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Iterable

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from pagoda.metrics.stats import SchedulerStats
from pagoda.repetition_detection import REPETITION_STOP_REASON, check_sequence_repetition

__all__ = ["FCFSRequestQueue", "PriorityRequestQueue", "Scheduler"]


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.policy = scheduler_config.policy
        self.long_prefill_token_threshold = (
            scheduler_config.long_prefill_token_threshold
            if scheduler_config.enable_chunked_prefill
            else 0
        )
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            max_model_len=scheduler_config.max_model_len,
            sliding_window=cache_config.sliding_window,
        )
        # Every unfinished request, by id.
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(self.policy)
        # fcfs: admission order; priority: sorted by (priority, arrival_time, request_id).
        self.running: list[Request] = []
        # Reported (and cleared) by the next schedule().
        self.finished_req_ids: set[str] = set()
        # req_id -> output tokens the executors know of the running request (sent to them).
        self._num_output_tokens_sent: dict[str, int] = {}
        # Each step's scheduled requests, in batch order, until its output is processed.
        self._step_requests: weakref.WeakKeyDictionary[SchedulerOutput, list[Request]] = (
            weakref.WeakKeyDictionary()
        )
        # Cumulative counters, and their values at the last make_stats() (for deltas).
        self.num_preemptions = 0
        self._last_stats = (0, 0, 0)

    # ---- requests in and out --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        # The front end's `validate_request` (pagoda.engine.input_processor) admits a request:
        # a non-empty prompt that leaves room for a generated token. Only an invariant here.
        assert 0 < request.num_prompt_tokens < self.max_model_len, (
            f"request {rid!r}: a prompt of {request.num_prompt_tokens} tokens did not pass "
            f"validate_request (max_model_len {self.max_model_len})"
        )
        # A request that cannot fit in the whole cache alone would be preempted forever.
        max_len = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        needed = self.kv_cache_manager.max_blocks_per_request(max_len, self.max_num_batched_tokens)
        if needed > self.kv_cache_manager.num_total_blocks:
            raise ValueError(
                f"request {rid!r} needs up to {needed} KV blocks of {self.block_size} tokens but "
                f"the cache has {self.kv_cache_manager.num_total_blocks}: lower max_tokens or "
                "max_model_len, or give the KV cache more memory"
            )
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (abort, stop string): free their blocks.

        Unknown and already finished ids are ignored; waiting and running requests both work.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a finished status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._num_output_tokens_sent.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def scheduled_requests(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The `Request` objects of a step this scheduler made, in batch order (until its
        output is processed by `update_from_output`)."""
        return self._step_requests[scheduler_output]

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks.

        On return every scheduled request's num_computed_tokens already includes this step;
        the start position is SchedulerOutput.num_computed_tokens[req_id]. Drafts in
        request.spec_token_ids are scheduled too (cut to what fits) and cleared by
        update_from_output, so a proposer sets them again before each schedule().
        """
        token_budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        # req_id -> blocks a running request gained this step (what the runner appends).
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted_req_ids: set[str] = set()

        # 1. Running requests, in order. Victims are taken from the end of the list, which is
        # never a request already scheduled in this step (those are all before req_index).
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if request.num_output_placeholders and self._reaches_cap(request):
                req_index += 1  # the token in flight is its last one
                continue
            num_new_tokens = min(
                self._chunk_cap(
                    request.num_tokens_with_spec
                    + request.num_output_placeholders
                    - request.num_computed_tokens
                ),
                token_budget,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    new_block_ids[request.request_id] = new_blocks
                    scheduled = True
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted_req_ids.add(victim.request_id)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            num_spec = (
                num_new_tokens
                + request.num_computed_tokens
                - request.num_tokens
                - request.num_output_placeholders
            )
            if num_spec > 0:
                # Drafts cut by the budget or max_model_len are dropped, so the runner sees
                # exactly the drafts it verifies.
                del request.spec_token_ids[num_spec:]
                scheduled_spec_decode_tokens[request.request_id] = list(request.spec_token_ids)
            elif request.spec_token_ids:
                request.spec_token_ids.clear()

        # 2. Waiting requests, unless the cache just ran out (then admitting more is pointless).
        if not preempted_req_ids:
            chunked = self.scheduler_config.enable_chunked_prefill
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting.peek()
                if request.num_output_placeholders:
                    # Preempted while its token was in flight: admit it once that token is
                    # known, so the recompute does not sample the same position again.
                    break
                # Waiting and preempted requests hold no blocks and have computed nothing.
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                num_new_tokens = min(
                    request.num_tokens - num_hit_tokens, self.max_model_len - num_hit_tokens
                )
                if not chunked and num_new_tokens > token_budget:
                    break
                num_new_tokens = min(self._chunk_cap(num_new_tokens), token_budget)
                if kv.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks) is None:
                    break
                self.waiting.pop()
                request.status = RequestStatus.RUNNING
                request.spec_token_ids.clear()
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                if self.policy == "priority":
                    bisect.insort(self.running, request)
                else:
                    self.running.append(request)
                scheduled_new.append(request)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens

        # 3. Record where each request starts, then advance it past what this step computes
        # (as vLLM does: the next schedule() may run before this step's output comes back).
        scheduled_requests = scheduled_running + scheduled_new
        num_computed_tokens: dict[str, int] = {}
        now = time.time()
        for request in scheduled_requests:
            rid = request.request_id
            num_computed_tokens[rid] = request.num_computed_tokens
            request.num_computed_tokens += num_scheduled_tokens[rid]
            known = request.num_tokens_with_spec + request.num_output_placeholders
            if request.num_computed_tokens >= known:
                # Reaches its end: the step samples a token that update_from_output appends.
                request.num_output_placeholders += 1
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now

        # 4. What the executors learn: running requests as diffs, admitted ones in full.
        sent = self._num_output_tokens_sent
        cached_reqs = CachedRequestData()
        for request in scheduled_running:
            rid = request.request_id
            outputs = request.output_token_ids
            num_sent = sent[rid]
            cached_reqs.append(rid, outputs[num_sent:], new_block_ids[rid])
            sent[rid] = len(outputs)
        new_reqs: list[NewRequestData] = []
        for request in scheduled_new:
            rid = request.request_id
            new_reqs.append(
                NewRequestData(
                    rid,
                    request.prompt_token_ids,
                    list(request.output_token_ids),
                    request.sampling_params,
                    list(kv.get_block_ids(rid)),
                )
            )
            sent[rid] = request.num_output_tokens

        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        out = SchedulerOutput(
            scheduled_cached_reqs=cached_reqs,
            scheduled_new_reqs=new_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            num_computed_tokens=num_computed_tokens,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids,
        )
        self._step_requests[out] = scheduled_requests
        return out

    def _chunk_cap(self, num_new_tokens: int) -> int:
        """A long prefill's share of one step (long_prefill_token_threshold, 0: no cap)."""
        threshold = self.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and send it back to the front of the queue; it
        recomputes its prompt and generated tokens when it is admitted again."""
        self.kv_cache_manager.free(request)
        self._num_output_tokens_sent.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, apply stop rules, free finished requests."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        all_logprobs = model_runner_output.logprobs
        all_prompt_logprobs = model_runner_output.prompt_logprobs
        all_prompt_token_id_logprobs = model_runner_output.prompt_token_id_logprobs
        outputs: list[EngineCoreOutput] = []
        now = time.time()
        scheduled = self._step_requests.pop(scheduler_output, None)
        if scheduled is None:  # not made by schedule(): its requests by id
            ids = scheduler_output.num_scheduled_tokens
            scheduled = [self.requests[rid] for rid in ids if rid in self.requests]
        for request in scheduled:
            rid = request.request_id
            # Aborted (or finished by a stop string) while the step ran.
            if request.is_finished() or self.requests.get(rid) is not request:
                continue
            sampled = sampled_token_ids.get(rid) or []
            if sampled and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            if num_spec:
                # Accepted drafts + 1 bonus/corrected token come back; the KV written for the
                # rejected drafts is stale, so those positions are computed again.
                num_rejected = num_spec - max(len(sampled) - 1, 0)
                request.num_computed_tokens -= num_rejected
                request.spec_token_ids.clear()

            new_token_ids: list[int] = []
            grammar = request.structured_output
            for token_id in sampled:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if grammar is not None and grammar.accept_token(token_id):
                    request.status = RequestStatus.FINISHED_STOPPED  # the grammar is matched
                    if grammar.error is not None:  # or it took too long to advance
                        request.status, request.error = RequestStatus.FINISHED_ERROR, grammar.error
                    break
                if self._check_stop(request, token_id):
                    break  # tokens after a stop (later accepted drafts) are dropped
            if new_token_ids and request.first_token_time is None:
                request.first_token_time = now

            new_logprobs = None
            if request.sampling_params.num_logprobs is not None and rid in all_logprobs:
                new_logprobs = all_logprobs[rid][: len(new_token_ids)]
            new_prompt_logprobs = _unreported_prompt_logprobs(
                request, scheduler_output.num_computed_tokens.get(rid), all_prompt_logprobs.get(rid)
            )
            new_prompt_token_id_logprobs = _unreported_prompt_token_id_rows(
                request,
                scheduler_output.num_computed_tokens.get(rid),
                all_prompt_token_id_logprobs.get(rid),
            )
            finished = request.is_finished()
            if finished:
                # Preempted while its last token was in flight: it waits (async scheduling).
                queue = self.running if request in self.running else self.waiting
                queue.remove(request)
                self._free_request(request)
            if new_token_ids or new_prompt_logprobs or new_prompt_token_id_logprobs or finished:
                outputs.append(
                    EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=new_prompt_logprobs,
                        new_prompt_token_id_logprobs=new_prompt_token_id_logprobs,
                        finish_reason=request.get_finish_reason(),
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        error=request.error,
                    )
                )
        return outputs

    def _reaches_cap(self, request: Request) -> bool:
        """With its in-flight tokens, the request reaches max_tokens or max_model_len."""
        n = request.num_output_placeholders
        return (
            request.num_output_tokens + n >= request.max_tokens
            or request.num_tokens + n >= self.max_model_len
        )

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set a finished status after `token_id` was appended; True if the request stops.

        A stop token wins over the length cap when both apply to the same token, and the length
        cap over a repetition (vLLM's order); none but the cap stops a request before min_tokens.
        """
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        repetition = params.repetition_detection
        if (
            repetition is not None
            and request.num_output_tokens >= params.min_tokens
            and check_sequence_repetition(request.output_token_ids, repetition)
        ):
            request.status = RequestStatus.FINISHED_REPETITION
            request.stop_reason = REPETITION_STOP_REASON
            return True
        return False

    # ---- stats and cache control ------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        """Current state; prefix-cache queries/hits and preemptions since the previous call."""
        kv = self.kv_cache_manager
        totals = (kv.prefix_cache_queries, kv.prefix_cache_hits, self.num_preemptions)
        queries, hits, preemptions = (a - b for a, b in zip(totals, self._last_stats))
        self._last_stats = totals
        pool = kv.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.get_usage(),
            num_used_blocks=pool.num_used_blocks,
            num_total_blocks=pool.num_total_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False (nothing done) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()


def _unreported_prompt_logprobs(
    request: Request, start: int | None, chunk: list | None
) -> list | None:
    """The part of a step's prompt logprobs (positions start, start + 1, ...) not reported yet.
    A request preempted and recomputed from the beginning computes its prompt's positions a
    second time; each position is reported once."""
    if not chunk or start is None:
        return chunk
    done = request.num_prompt_logprobs_reported
    request.num_prompt_logprobs_reported = max(done, start + len(chunk))
    return chunk[done - start :] if done > start else chunk


def _unreported_prompt_token_id_rows(
    request: Request, start: int | None, rows: list | None
) -> list | None:
    """`_unreported_prompt_logprobs` for the rows of prompt_logprob_token_ids: a step starting
    at prompt position `start` scored rows from max(start, prompt_logprob_start) on."""
    if not rows or start is None:
        return rows
    first = max(start - (request.sampling_params.prompt_logprob_start or 0), 0)
    done = request.num_prompt_token_id_rows_reported
    request.num_prompt_token_id_rows_reported = max(done, first + len(rows))
    return rows[done - first :] if done > first else rows
