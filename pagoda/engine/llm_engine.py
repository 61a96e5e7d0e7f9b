"""`LLMEngine`: the engine loop, `schedule()` -> `execute_model()` -> `update()` (on CUDA with the
next step launched before the last one's tokens are processed: async scheduling, see `step`).

It owns the tokenizer (input processing and validation), the scheduler (torch-free core), the
executor (model runner on a device) and the output processor (detokenizing, stop strings,
n > 1 fan-in). `LLM` drives it offline; `AsyncLLM` drives it for serving, from the engine core
process (`engine_core.py`) or a thread.
"""

from __future__ import annotations

import time
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.output_processor import OutputProcessor
from pagoda.logger import init_logger
from pagoda.metrics.loggers import LoggingStatLogger
from pagoda.metrics.stats import IterationStats, SchedulerStats
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode import DraftModelProposer, NgramProposer
from pagoda.structured_output import StructuredOutputManager
from pagoda.tokenizer import Tokenizer, get_tokenizer
from pagoda.utils.heap import freeze_startup_heap

logger = init_logger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        from pagoda.executor import make_executor

        start = time.perf_counter()
        self.config = config
        self.model_config = config.model_config
        mc = config.model_config
        self.tokenizer: Tokenizer | None = (
            None if mc.skip_tokenizer_init else get_tokenizer(mc.tokenizer or mc.model)
        )
        self.executor = make_executor(config)  # in-process, or tensor-parallel workers
        num_blocks = (
            config.cache_config.num_gpu_blocks_override or self.executor.determine_num_blocks()
        )
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Structured outputs: grammars compiled (xgrammar imported) on the first request.
        self.structured_output = StructuredOutputManager(
            self.tokenizer, mc.vocab_size, self._eos_token_id()
        )
        self.last_scheduler_stats = SchedulerStats(num_total_blocks=num_blocks)
        self.last_iteration_stats = IterationStats()
        self.num_preemptions_total = 0
        self.stat_logger = LoggingStatLogger() if log_stats else None
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
        self._in_flight: tuple[SchedulerOutput, Any, IterationStats] | None = None
        self._log_cache_plan(num_blocks, time.perf_counter() - start)
        freeze_startup_heap()  # a full collection mid-run would stall the steps

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_stats: bool | None = None) -> LLMEngine:
        if log_stats is None:
            log_stats = not args.disable_log_stats
        return cls(args.create_engine_config(), log_stats=log_stats)

    def _log_cache_plan(self, num_blocks: int, seconds: float) -> None:
        block_size = self.config.cache_config.block_size
        tokens = num_blocks * block_size
        max_len = self.model_config.max_model_len
        logger.info(
            "Model %s (%s, %s) ready in %.1f s. KV cache: %d blocks of %d tokens = %d tokens "
            "(%.2f GiB); maximum concurrency for %d-token requests: %.1fx",
            self.model_config.model,
            self.model_config.architecture,
            self.model_config.dtype,
            seconds,
            num_blocks,
            block_size,
            tokens,
            num_blocks * self.executor.bytes_per_block() / 2**30,
            max_len,
            tokens / max_len,
        )

    # -- requests ----------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("the engine runs with skip_tokenizer_init: give prompt token ids")
        return self.tokenizer.encode(text)

    def _process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' string or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_time = time.time() if arrival_time is None else arrival_time
        prompt_text, prompt_ids = self._process_prompt(prompt)
        max_len = self.model_config.max_model_len
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) is longer than the maximum model length "
                f"({max_len}) minus one generated token; shorten it or raise max_model_len"
            )
        params.validate_token_ids(vocab)
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        eos = self._eos_token_id()
        params.all_stop_token_ids = set(params.stop_token_ids or [])
        if eos is not None:
            params.all_stop_token_ids.add(eos)
        max_tokens = max_len - len(prompt_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)

        child_ids, child_params = self._fan_out(request_id, params)
        added: list[str] = []
        try:
            for cid, cparams in zip(child_ids, child_params):
                request = Request(
                    cid,
                    prompt_ids,
                    cparams,
                    eos_token_id=eos,
                    arrival_time=arrival_time,
                    priority=priority,
                    max_tokens=max_tokens,
                )
                self.structured_output.init_request(request)  # its own matcher, if any
                self.scheduler.add_request(request)
                added.append(cid)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(
            request_id, prompt_text, prompt_ids, params, child_ids, child_params, arrival_time
        )

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """Refuse what structured outputs cannot run with; compile the constraint (cached), so
        a bad schema / regex / grammar is a ValueError here."""
        if self.config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                "structured_outputs is not supported with tensor_parallel_size > 1 yet"
            )
        self.structured_output.validate(params)

    def _eos_token_id(self) -> int | None:
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_id
        eos = self.model_config.hf_config.get("eos_token_id")
        return eos[0] if isinstance(eos, list) else eos

    @staticmethod
    def _fan_out(request_id: str, params: SamplingParams) -> tuple[list[str], list[SamplingParams]]:
        if params.n == 1:
            return [request_id], [params]
        ids, plist = [], []
        for i in range(params.n):
            p = params.clone()
            p.n = 1
            if params.seed is not None:
                p.seed = params.seed + i  # distinct but reproducible samples
            ids.append(f"{i}_{request_id}")
            plist.append(p)
        return ids, plist

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        children = self.output_processor.abort_requests(list(request_ids))
        if children:
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)

    def abort_expired_waiting(self, max_queue_delay_s: float, now: float) -> list[str]:
        """Abort the user requests that arrived more than `max_queue_delay_s` before `now` and
        none of whose samples has been scheduled yet; returns their ids (load shedding: a
        client that waited that long is better told to retry)."""
        expired = []
        for rid, parent in self.output_processor.parents.items():
            if now - parent.arrival_time <= max_queue_delay_s:
                break  # requests are kept in arrival order: the rest came later
            if all(s.first_scheduled_time is None for s in parent.samples):
                expired.append(rid)
        if expired:
            self.abort_request(expired)
        return expired

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished, or a launched step not yet processed."""
        return self.output_processor.has_unfinished_requests() or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

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
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that made progress.

        With async scheduling (`SchedulerConfig.async_scheduling`) a step schedules and
        launches the next model step first and only then waits for the one launched before it
        and processes its tokens, so scheduling, input preparation and detokenizing overlap the
        device's work: the outputs returned are those of the previous launch. The scheduler
        counts each token still in flight as a placeholder. A request that stops (EOS, stop
        string) has one more step computed for it, whose token is dropped. Steps where a
        request's sampling reads its own history (penalties, min_tokens) or its drafts run
        synchronously."""
        if self._in_flight is not None and not self._can_run_ahead():
            outputs = self._finish_step(*self._in_flight)
            self._in_flight = None
            if self.has_unfinished_requests():
                outputs += self._step_sync()
            return outputs
        if not self.async_scheduling:
            return self._step_sync()
        launched = self._launch_step()
        previous, self._in_flight = self._in_flight, None
        outputs = self._finish_step(*previous) if previous is not None else []
        if launched[0].num_scheduled_tokens:
            self._in_flight = launched
        else:  # nothing to run ahead of: finish it now (finished ids, stats)
            outputs += self._finish_step(*launched)
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        return self._finish_step(*self._launch_step())

    def _launch_step(self) -> tuple[SchedulerOutput, Any, IterationStats]:
        if self.proposer is not None:
            self._propose_drafts()
        sched_out = self.scheduler.schedule()
        scheduled = self.scheduler.scheduled_requests(sched_out)
        if self.structured_output.backend_ready:
            self.structured_output.grammar_bitmask(sched_out, scheduled)
        now = time.time()
        stats = IterationStats(iteration_timestamp=now)
        for req in scheduled:
            self.output_processor.mark_scheduled(req.request_id, now)
            start = sched_out.num_computed_tokens[req.request_id]
            n = sched_out.num_scheduled_tokens[req.request_id]
            stats.num_prompt_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
        stats.num_scheduled_tokens = sched_out.total_num_scheduled_tokens
        # Every step that tells the runner something goes to it: it keeps its requests by them.
        if (
            sched_out.total_num_scheduled_tokens > 0
            or sched_out.finished_req_ids
            or sched_out.preempted_req_ids
        ):
            future = self.executor.execute_model_async(sched_out)
        else:
            future = None
        return sched_out, future, stats

    def _finish_step(
        self, sched_out: SchedulerOutput, future: Any, stats: IterationStats
    ) -> list[RequestOutput]:
        if future is not None:
            runner_out = future.get()
        else:
            runner_out = ModelRunnerOutput(req_ids=[], sampled_token_ids={})
        for rid, drafts in sched_out.scheduled_spec_decode_tokens.items():
            sampled = runner_out.sampled_token_ids.get(rid)
            if sampled:  # verified: the accepted drafts, then the target's own token
                num_spec = len(drafts)
                stats.num_drafts += 1
                stats.num_draft_tokens += num_spec
                stats.num_accepted_tokens += min(len(sampled) - 1, num_spec)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        outputs, stopped = self.output_processor.process_outputs(core_outputs, time.time(), stats)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.last_scheduler_stats = self.scheduler.make_stats()
        self.num_preemptions_total += self.last_scheduler_stats.num_preemptions
        self.last_iteration_stats = stats
        if self.stat_logger is not None:
            self.stat_logger.record(self.last_scheduler_stats, stats)
        return outputs

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
    """Sampling parameters that read the request's generated tokens (penalties) or their count
    (min_tokens, until reached)."""
    sp = req.sampling_params
    return (
        sp.presence_penalty != 0.0
        or sp.frequency_penalty != 0.0
        or sp.repetition_penalty != 1.0
        or (sp.min_tokens > 0 and req.num_output_tokens < sp.min_tokens)
    )
