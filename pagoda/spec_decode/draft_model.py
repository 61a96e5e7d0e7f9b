"""Draft-model speculation: a smaller model with the target's vocabulary proposes k tokens by
greedy decoding; the target verifies them in one step.

The draft runs in its own `ModelRunner` with its own paged KV cache and block allocator
(`KVCacheManager`, no prefix caching). Per target request it keeps a shadow `Request` whose
computed positions are those of the draft's cache. Before each target step, `propose` brings
every shadow up to its request's tokens (positions whose tokens changed since, i.e. rejected
drafts, are recomputed), then decodes k tokens greedily. The draft runner gets the same plain
data as the target's: a shadow whole the first time (and again when a rejected draft changed
tokens it had been sent), then the tokens and blocks it gained since. Greedy drafting is a
deterministic function of the request's known tokens, so the runner's verification (accept a
draft iff the target samples it) is exact: the output distribution is the target's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.core.request import Request
from pagoda.logger import init_logger
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

logger = init_logger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


class DraftModelProposer:
    """Proposes up to `num_speculative_tokens` drafts per request from a draft model."""

    def __init__(self, target: EngineConfig, executor: Any, num_blocks: int) -> None:
        """`executor`: the draft model's, its KV cache of `num_blocks` blocks initialised
        (`pagoda.engine.draft.make_draft_executor` builds it; this layer builds no engine)."""
        spec = target.speculative_config
        assert spec is not None and spec.model is not None
        mc, cc, sc = target.model_config, target.cache_config, target.scheduler_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = mc.max_model_len
        self.budget = sc.max_num_batched_tokens
        self.executor = executor
        self.kv = KVCacheManager(num_blocks, cc.block_size, False, mc.max_model_len)
        self.shadows: dict[str, Request] = {}
        self._released: set[str] = set()
        # req_id -> (tokens, blocks) of the shadow the draft runner holds (has been sent).
        self._sent: dict[str, tuple[int, int]] = {}
        logger.info(
            "Draft model %s for speculative decoding (%d tokens a step): KV cache of %d blocks",
            spec.model,
            self.k,
            num_blocks,
        )

    def release(self, keep: set[str]) -> None:
        """Free the draft cache of every request not in `keep` (finished, aborted, preempted)."""
        for rid in [r for r in self.shadows if r not in keep]:
            self.kv.free(self.shadows.pop(rid))
            self._sent.pop(rid, None)
            self._released.add(rid)

    def propose_requests(
        self, requests: list[Request], max_drafts: dict[str, int]
    ) -> dict[str, list[int]]:
        """Drafts per request id (requests past their prefill, nothing in flight)."""
        active: list[tuple[Request, Request, int]] = []  # (request, shadow, drafts wanted)
        for req in requests:
            k = min(
                self.k, max_drafts.get(req.request_id, self.k), self.max_model_len - req.num_tokens
            )
            if k <= 0:
                continue
            shadow = self._sync_shadow(req)
            uncomputed = shadow.num_tokens - shadow.num_computed_tokens
            if self.kv.allocate_slots(shadow, uncomputed, num_lookahead_tokens=k) is None:
                continue  # the draft cache is full: no drafts for it this step
            active.append((req, shadow, k))
        if not active:
            return {}
        # Catch up on the known tokens (in budget-sized chunks); each request's last chunk
        # samples its first draft.
        pending = [(shadow, k) for _, shadow, k in active]
        drafting: list[tuple[Request, int]] = []
        while pending:
            counts, carry = {}, []
            budget = self.budget
            for shadow, k in pending:
                left = shadow.num_tokens - shadow.num_computed_tokens
                n = min(left, budget)
                if n <= 0:
                    carry.append((shadow, k))
                    continue
                counts[shadow.request_id] = n
                budget -= n
                (drafting if n == left else carry).append((shadow, k))
            sampled = self._run([s for s, _ in pending if s.request_id in counts], counts)
            for shadow, _ in pending:
                tokens = sampled.get(shadow.request_id)
                if tokens:
                    shadow.append_output_token_ids(tokens[0])
            pending = carry
        # Greedy decoding of the rest: the newest draft is the input.
        for step in range(1, max(k for _, k in drafting)):
            live = [s for s, k in drafting if k > step]
            sampled = self._run(live, {s.request_id: 1 for s in live})
            for shadow in live:
                shadow.append_output_token_ids(sampled[shadow.request_id][0])
        return {
            req.request_id: shadow.all_token_ids[req.num_tokens : req.num_tokens + k]
            for req, shadow, k in active
        }

    def _sync_shadow(self, req: Request) -> Request:
        """The shadow with the request's tokens; computed positions past the first token that
        differs (a rejected draft) are dropped."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, req.prompt_token_ids, _GREEDY, None)
            self.shadows[req.request_id] = shadow
            self._released.discard(req.request_id)
        have, want = shadow.all_token_ids, req.all_token_ids
        same = 0
        limit = min(len(have), len(want), shadow.num_computed_tokens)
        while same < limit and have[same] == want[same]:
            same += 1
        shadow.num_computed_tokens = same
        sent = self._sent.get(req.request_id)
        if sent is not None and sent[0] > same and want[: sent[0]] != have[: sent[0]]:
            del self._sent[req.request_id]  # the runner's tokens are stale: send it whole
        shadow.all_token_ids = list(want)
        shadow.output_token_ids = list(req.output_token_ids)
        return shadow

    def _run(self, shadows: list[Request], counts: dict[str, int]) -> dict[str, list[int]]:
        """One draft-model step over `counts[id]` tokens of each shadow, from its computed
        position; returns the greedy samples of the shadows whose tokens ran out."""
        cached, new = CachedRequestData(), []
        for shadow in shadows:
            rid = shadow.request_id
            tokens, blocks = shadow.all_token_ids, self.kv.get_block_ids(rid)
            sent = self._sent.get(rid)
            if sent is None:
                outputs = list(shadow.output_token_ids)
                new.append(
                    NewRequestData(rid, shadow.prompt_token_ids, outputs, _GREEDY, list(blocks))
                )
            else:
                cached.append(rid, tokens[sent[0] :], blocks[sent[1] :])
            self._sent[rid] = (len(tokens), len(blocks))
        so = SchedulerOutput(
            scheduled_cached_reqs=cached,
            scheduled_new_reqs=new,
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=sum(counts.values()),
            num_computed_tokens={s.request_id: s.num_computed_tokens for s in shadows},
            finished_req_ids=self._released,
        )
        self._released = set()
        out = self.executor.execute_model(so)
        for shadow in shadows:
            shadow.num_computed_tokens += counts[shadow.request_id]
        return out.sampled_token_ids


__all__ = ["DraftModelProposer"]
