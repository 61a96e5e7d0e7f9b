"""`LLMEngine`: the in-process composition of the front end and the engine core.

`add_request` runs input processing (`InputProcessor`: tokenize, validate once, fan out
n > 1), hands the core `EngineCoreRequest`s (token ids and one sample's sampling parameters),
and `step` runs one `EngineCore.step()` (schedule -> execute -> update, with async scheduling
on CUDA) and feeds its token ids to the `OutputProcessor` (detokenizing, stop strings,
logprobs, n > 1 fan-in, `RequestOutput`s). A stop string the output processor finds aborts
the request in the core, which frees its KV blocks. With --otlp-traces-endpoint each finished
request becomes an OpenTelemetry span (`pagoda.tracing`). `LLM` drives it offline; `AsyncLLM`
composes the same pieces with the core on a thread or in its own process.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.input_processor import InputProcessor, PromptType
from pagoda.engine.output_processor import OutputProcessor
from pagoda.logger import init_logger
from pagoda.metrics.loggers import LoggingStatLogger
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tracing import make_request_tracer

logger = init_logger(__name__)

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.config = config
        self.model_config = config.model_config
        self.engine_core = EngineCore(config)
        self.tokenizer = self.engine_core.tokenizer
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config, config.scheduler_config.policy
        )
        self.tracer = make_request_tracer(config.observability_config, self.model_config.name)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.tracer, config.scheduler_config.stream_interval
        )
        self.last_iteration_stats = self.engine_core.last_iteration_stats
        self.stat_logger = LoggingStatLogger() if log_stats else None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_stats: bool | None = None) -> LLMEngine:
        if log_stats is None:
            log_stats = not args.disable_log_stats
        return cls(args.create_engine_config(), log_stats=log_stats)

    # What the core owns, for the tools and tests that read it.
    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def executor(self) -> Any:
        return self.engine_core.executor

    @property
    def proposer(self) -> Any:
        return self.engine_core.proposer

    @property
    def structured_output(self) -> Any:
        return self.engine_core.structured_output

    @property
    def num_blocks(self) -> int:
        return self.engine_core.num_blocks

    @property
    def async_scheduling(self) -> bool:
        return self.engine_core.async_scheduling

    @property
    def last_scheduler_stats(self) -> Any:
        return self.engine_core.last_scheduler_stats

    @property
    def num_preemptions_total(self) -> int:
        return self.engine_core.num_preemptions_total

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Add a request; `trace_headers` (traceparent, tracestate) put its span, with
        --otlp-traces-endpoint, in that trace."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_time = time.time() if arrival_time is None else arrival_time
        prompt_text, prompt_ids, requests = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority
        )
        clash = self.output_processor.id_in_use(request_id, [r.request_id for r in requests])
        if clash is not None:  # before the core takes any of them
            raise ValueError(clash)
        # Tracked before the core takes it: a request the output processor refused would
        # otherwise run in the core, unseen and never freed.
        self.output_processor.add_request(
            request_id,
            prompt_text,
            prompt_ids,
            params,
            requests,
            arrival_time,
            trace_headers,
        )
        try:
            self.engine_core.add_requests(requests)
        except BaseException:
            self.output_processor.discard(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        children = self.output_processor.abort_requests(list(request_ids))
        if children:
            self.engine_core.abort_requests(children)

    def abort_expired_waiting(self, max_queue_delay_s: float, now: float) -> list[str]:
        """Abort the user requests that arrived more than `max_queue_delay_s` before `now` and
        none of whose samples has been scheduled yet; returns their ids (load shedding: a
        client that waited that long is better told to retry)."""
        expired = self.engine_core.abort_expired_waiting(max_queue_delay_s, now)
        parents = self.output_processor.parents_of(expired)
        if parents:
            self.output_processor.abort_requests(parents, now)
        return parents

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's `llm.llm_engine.get_tokenizer()`)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix; False while a request still holds KV blocks."""
        return self.engine_core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished, or a launched step not yet processed."""
        core = self.engine_core
        return self.output_processor.has_unfinished_requests() or core._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    @property
    def num_waiting_requests(self) -> int:
        return self.engine_core.num_waiting_requests

    @property
    def kv_cache_usage(self) -> float:
        return self.engine_core.kv_cache_usage

    @property
    def num_used_blocks(self) -> int:
        return self.engine_core.num_used_blocks

    @property
    def _in_flight(self) -> Any:
        return self.engine_core._in_flight

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one core step (see `EngineCore.step`) and turn its token ids into the outputs
        of the requests that made progress. Requests the output processor ends early (a stop
        string, an error in their processing) are aborted in the core: their KV blocks are
        freed and any token it computed for them meanwhile is dropped."""
        core_out = self.engine_core.step()
        outputs, stopped = self.output_processor.process_core_outputs(core_out)
        if stopped:
            self.engine_core.abort_requests(stopped)
        self.last_iteration_stats = core_out.iteration_stats
        if self.stat_logger is not None:
            self.stat_logger.record(self.engine_core.last_scheduler_stats, core_out.iteration_stats)
        return outputs
