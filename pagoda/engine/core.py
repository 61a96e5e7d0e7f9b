"""`EngineCore`: scheduling and execution only (vLLM v1's EngineCore).

It takes `EngineCoreRequest`s (token ids, the sampling parameters of one sample, max_tokens
resolved, the EOS id) and each `step()` returns `EngineCoreOutputs`: per request the new token
ids, the finish reason (EOS, a stop token, the length cap, a grammar's end, or an error: a
constraint too slow to apply), raw logprob entries and cached-token counts. No text, no
detokenizer, no n > 1 fan-out, no `RequestOutput`: all of that is the front end's
(`input_processor.py`, `output_processor.py`). It owns the scheduler (torch-free), the
executor, the structured-output manager (which needs the tokenizer's vocabulary to compile
grammars: the only use of the tokenizer here), the speculative-decoding proposer, and async
scheduling (see `step`).
"""

from __future__ import annotations

import time
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.engine.input_processor import eos_token_id
from pagoda.logger import init_logger
from pagoda.metrics.stats import IterationStats, SchedulerStats
from pagoda.spec_decode import DraftModelProposer, NgramProposer
from pagoda.structured_output import StructuredOutputManager
from pagoda.tokenizer import Tokenizer, get_tokenizer
from pagoda.utils.heap import freeze_startup_heap

logger = init_logger(__name__)

_NO_TOKENIZER: Any = object()


class EngineCore:
    """`tokenizer`: the tokenizer to share with the front end (in-process); by default it is
    loaded here unless the model config says skip_tokenizer_init, and None then."""

    def __init__(self, config: EngineConfig, tokenizer: Any = _NO_TOKENIZER) -> None:
        from pagoda.executor import make_executor

        start = time.perf_counter()
        self.config = config
        self.model_config = mc = config.model_config
        if tokenizer is _NO_TOKENIZER:
            tokenizer = None if mc.skip_tokenizer_init else get_tokenizer(mc.tokenizer or mc.model)
        self.tokenizer: Tokenizer | None = tokenizer
        self.executor = make_executor(config)  # in-process, or tensor-parallel workers
        num_blocks = (
            config.cache_config.num_gpu_blocks_override or self.executor.determine_num_blocks()
        )
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks)
        # Structured outputs: grammars compiled (xgrammar imported) on the first request.
        self.structured_output = StructuredOutputManager(
            tokenizer, mc.vocab_size, eos_token_id(tokenizer, mc)
        )
        self.last_scheduler_stats = SchedulerStats(num_total_blocks=num_blocks)
        self.last_iteration_stats = IterationStats()
        self.num_preemptions_total = 0
        # Requests added together (the samples of one user request) and not finished yet: load
        # shedding drops such a group only when none of it has been scheduled.
        self._groups: dict[str, tuple[str, ...]] = {}
        # Speculative decoding: drafts proposed before each step, verified in it.
        spec = config.speculative_config
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        elif spec is not None:
            from pagoda.engine.draft import make_draft_executor

            self.proposer = DraftModelProposer(config, *make_draft_executor(config, num_blocks))
        # Async scheduling: the launched step whose tokens are not processed yet. Off with
        # speculation: how many drafts a step accepts decides where the next one starts.
        self.async_scheduling = config.scheduler_config.async_scheduling and self.proposer is None
        self._in_flight: tuple[SchedulerOutput, Any, IterationStats, float] | None = None
        # --collect-detailed-traces: per unfinished request, [seconds in the executor, seconds
        # of model forward] of the steps it was in, reported with its last output.
        obs = config.observability_config
        self._collect_forward = obs.collect_model_forward_time
        self._collect_execute = obs.collect_model_execute_time
        self._step_times: dict[str, list[float]] | None = (
            {} if self._collect_forward or self._collect_execute else None
        )
        self._log_cache_plan(num_blocks, time.perf_counter() - start)
        freeze_startup_heap()  # a full collection mid-run would stall the steps

    def _log_cache_plan(self, num_blocks: int, seconds: float) -> None:
        block_size = self.config.cache_config.block_size
        tokens = num_blocks * block_size
        max_len = self.model_config.max_model_len
        logger.info(
            "Model %s (%s, %s) ready in %.1f s. KV cache (%s): %d blocks of %d tokens = %d "
            "tokens (%.2f GiB); maximum concurrency for %d-token requests: %.1fx",
            self.model_config.model,
            self.model_config.architecture,
            self.model_config.dtype,
            seconds,
            self.config.cache_config.cache_dtype,
            num_blocks,
            block_size,
            tokens,
            num_blocks * self.executor.bytes_per_block() / 2**30,
            max_len,
            tokens / max_len,
        )

    # -- requests ----------------------------------------------------------------------------
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Add the requests of one group (the samples of one user request): all or none. What
        only the core can check (a grammar that does not compile, a request the KV cache cannot
        hold) is a ValueError."""
        if requests[0].sampling_params.structured_outputs is not None:
            self._check_structured_outputs(requests[0].sampling_params)
        added: list[str] = []
        try:
            for r in requests:
                request = Request(
                    r.request_id,
                    r.prompt_token_ids,
                    r.sampling_params,
                    eos_token_id=r.eos_token_id,
                    arrival_time=r.arrival_time,
                    priority=r.priority,
                    max_tokens=r.max_tokens,
                )
                self.structured_output.init_request(request)  # its own matcher, if any
                self.scheduler.add_request(request)
                added.append(r.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        if len(added) > 1:
            group = tuple(added)
            for rid in added:
                self._groups[rid] = group

    def _check_structured_outputs(self, params: Any) -> None:
        """Refuse what structured outputs cannot run with; compile the constraint (cached), so
        a bad schema / regex / grammar is a ValueError here."""
        if self.config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                "structured_outputs is not supported with tensor_parallel_size > 1 yet"
            )
        self.structured_output.validate(params)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests (unknown and finished ids are ignored) and free their KV blocks."""
        for rid in request_ids:
            self._groups.pop(rid, None)
            if self._step_times is not None:
                self._step_times.pop(rid, None)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix; False (nothing done) while a request still holds
        KV blocks."""
        return self.scheduler.reset_prefix_cache()

    def abort_expired_waiting(self, max_queue_delay_s: float, now: float) -> list[str]:
        """Abort the requests that arrived more than `max_queue_delay_s` before `now` and have
        never been scheduled, a group only when none of its members has; returns their ids."""
        candidates = {
            req.request_id
            for req in self.scheduler.waiting  # (a preempted request has been scheduled)
            if req.first_scheduled_time is None and now - req.arrival_time > max_queue_delay_s
        }
        expired = [
            rid for rid in candidates if all(m in candidates for m in self._groups.get(rid, (rid,)))
        ]
        if expired:
            expired.sort(key=lambda rid: self.scheduler.requests[rid].arrival_time)
            self.abort_requests(expired)
        return expired

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished, or a launched step not yet processed."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    @property
    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.last_scheduler_stats.kv_cache_usage

    @property
    def num_used_blocks(self) -> int:
        return self.last_scheduler_stats.num_used_blocks

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Run one step; returns the outputs of the requests that made progress.

        With async scheduling (`SchedulerConfig.async_scheduling`) a step schedules and
        launches the next model step first and only then waits for the one launched before it
        and processes its tokens, so scheduling, input preparation and the front end's output
        processing overlap the device's work: the outputs returned are those of the previous
        launch. The scheduler counts each token still in flight as a placeholder. A request
        that stops (EOS, or a stop string the front end found, which aborts it here) has one
        more step computed for it, whose token is dropped. Steps where a request's sampling
        reads its own history (penalties, min_tokens) or its drafts run synchronously."""
        result = EngineCoreOutputs()
        if self._in_flight is not None and not self._can_run_ahead():
            self._finish_step(*self._in_flight, result)
            self._in_flight = None
            if self.has_unfinished_requests():
                self._finish_step(*self._launch_step(result), result)
        elif not self.async_scheduling:
            self._finish_step(*self._launch_step(result), result)
        else:
            launched = self._launch_step(result)
            previous, self._in_flight = self._in_flight, None
            if previous is not None:
                self._finish_step(*previous, result)
            if launched[0].num_scheduled_tokens:
                self._in_flight = launched
            else:  # nothing to run ahead of: finish it now (finished ids, stats)
                self._finish_step(*launched, result)
        if result.iteration_stats is None:
            result.iteration_stats = IterationStats(iteration_timestamp=time.time())
        self.last_scheduler_stats = self.scheduler.make_stats()
        self.num_preemptions_total += self.last_scheduler_stats.num_preemptions
        self.last_iteration_stats = result.iteration_stats
        return result

    def _launch_step(
        self, result: EngineCoreOutputs
    ) -> tuple[SchedulerOutput, Any, IterationStats, float]:
        """Schedule a step and hand it to the executor; returns it, its future, its statistics
        and the seconds the executor's launch took."""
        if self.proposer is not None:
            self._propose_drafts()
        sched_out = self.scheduler.schedule()
        scheduled = self.scheduler.scheduled_requests(sched_out)
        result.preempted.extend(sched_out.preempted_req_ids)
        too_slow: dict[str, str] = {}
        if self.structured_output.backend_ready:
            too_slow = self.structured_output.grammar_bitmask(sched_out, scheduled)
        now = time.time()
        stats = IterationStats(iteration_timestamp=now)
        for new in sched_out.scheduled_new_reqs:  # admitted: first time, or after a preemption
            req = self.scheduler.requests[new.req_id]
            if not req.num_preemptions:
                result.first_scheduled[new.req_id] = req.first_scheduled_time or now
        for req in scheduled:
            start = sched_out.num_computed_tokens[req.request_id]
            n = sched_out.num_scheduled_tokens[req.request_id]
            stats.num_prompt_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
        stats.num_scheduled_tokens = sched_out.total_num_scheduled_tokens
        if too_slow:  # their tokens are computed all the same (the step is scheduled), then dropped
            self._end_with_errors(too_slow, result)
        # Every step that tells the runner something goes to it: it keeps its requests by them.
        if (
            sched_out.total_num_scheduled_tokens > 0
            or sched_out.finished_req_ids
            or sched_out.preempted_req_ids
        ):
            launched = time.perf_counter()
            future = self.executor.execute_model_async(sched_out)
            launch_s = time.perf_counter() - launched
        else:
            future, launch_s = None, 0.0
        return sched_out, future, stats, launch_s

    def _end_with_errors(self, errors: dict[str, str], result: EngineCoreOutputs) -> None:
        """End these requests (id -> why) with finish_reason "error". Those in the step being
        launched are still computed; `update_from_output` drops their tokens."""
        for rid, error in errors.items():
            request = self.scheduler.requests.get(rid)
            if request is None or request.is_finished():
                continue
            request.error = error
            self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ERROR)
            self._groups.pop(rid, None)
            out = EngineCoreOutput(
                request_id=rid,
                new_token_ids=[],
                finish_reason=request.get_finish_reason(),
                num_cached_tokens=max(request.num_cached_tokens, 0),
                error=error,
            )
            self._report_step_times(out)
            result.outputs.append(out)

    def _finish_step(
        self,
        sched_out: SchedulerOutput,
        future: Any,
        stats: IterationStats,
        launch_s: float,
        result: EngineCoreOutputs,
    ) -> None:
        if future is not None:
            waited = time.perf_counter()
            runner_out = future.get()
            if self._step_times is not None:
                execute_s = launch_s + time.perf_counter() - waited
                self._add_step_times(sched_out, execute_s, runner_out.model_forward_time)
        else:
            runner_out = ModelRunnerOutput(req_ids=[], sampled_token_ids={})
        for rid, drafts in sched_out.scheduled_spec_decode_tokens.items():
            sampled = runner_out.sampled_token_ids.get(rid)
            if sampled:  # verified: the accepted drafts, then the target's own token
                num_spec = len(drafts)
                stats.num_drafts += 1
                stats.num_draft_tokens += num_spec
                stats.num_accepted_tokens += min(len(sampled) - 1, num_spec)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        for out in outputs:
            if out.finish_reason is not None:
                self._groups.pop(out.request_id, None)
                self._report_step_times(out)
        result.outputs.extend(outputs)
        if result.iteration_stats is not None:  # two steps finished in one call: added up
            _add_counts(stats, result.iteration_stats)
        result.iteration_stats = stats

    def _add_step_times(
        self, sched_out: SchedulerOutput, execute_s: float, forward_s: float | None
    ) -> None:
        """Count one step's executor and forward seconds to each of its requests."""
        assert self._step_times is not None
        for rid in sched_out.num_scheduled_tokens:
            times = self._step_times.setdefault(rid, [0.0, 0.0])
            times[0] += execute_s
            times[1] += forward_s or 0.0

    def _report_step_times(self, out: EngineCoreOutput) -> None:
        """Put a finished request's summed step times on its last output (detailed traces)."""
        if self._step_times is None:
            return
        execute_s, forward_s = self._step_times.pop(out.request_id, (0.0, 0.0))
        if self._collect_execute:
            out.model_execute_time = execute_s
        if self._collect_forward:
            out.model_forward_time = forward_s

    def _propose_drafts(self) -> None:
        """Drafts for every running request past its prefill, from its known tokens; the
        scheduler trims them to the step's budget and max_model_len and clears them after."""
        assert self.proposer is not None
        running = self.scheduler.running
        self.proposer.release({req.request_id for req in running})
        # Decoding: everything but the newest token is computed, nothing is in flight.
        ready = [
            req
            for req in running
            if not req.num_output_placeholders
            and req.num_computed_tokens == req.num_tokens - 1
            and req.structured_output is None  # its bitmask covers one row: no drafts
        ]
        # Drafts past max_tokens would be computed and dropped: the last token is the target's.
        room = {req.request_id: req.max_tokens - req.num_output_tokens - 1 for req in ready}
        drafts = self.proposer.propose_requests(ready, room)
        for req in ready:
            req.spec_token_ids = drafts.get(req.request_id, [])

    def _can_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is finished: only
        when no running request's sampling depends on the tokens still in flight."""
        if not self.async_scheduling:
            return False
        for req in self.scheduler.running:
            # A structured request's bitmask needs its matcher to have seen every token.
            if req.spec_token_ids or req.structured_output is not None or _reads_history(req):
                return False
        return True


def _reads_history(req: Request) -> bool:
    """Sampling parameters that read the request's generated tokens (penalties, bad words of
    several tokens) or their count (min_tokens, until reached)."""
    sp = req.sampling_params
    return (
        sp.presence_penalty != 0.0
        or sp.frequency_penalty != 0.0
        or sp.repetition_penalty != 1.0
        or (sp.min_tokens > 0 and req.num_output_tokens < sp.min_tokens)
        or (sp._bad_words_token_ids is not None and _has_long_word(sp._bad_words_token_ids))
    )


def _has_long_word(words: list[list[int]]) -> bool:
    return any(len(w) > 1 for w in words)


def _add_counts(into: IterationStats, other: IterationStats) -> None:
    """Add `other`'s step counters (what the core counts) to `into`."""
    for name in (
        "num_prompt_tokens",
        "num_scheduled_tokens",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
    ):
        setattr(into, name, getattr(into, name) + getattr(other, name))
