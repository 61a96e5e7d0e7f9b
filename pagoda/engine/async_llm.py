"""`AsyncLLM`: the asyncio front end of the engine core, which runs off the event loop.

The front end does input processing (`InputProcessor`: tokenize, validate once, fan out n > 1
into one-sample `EngineCoreRequest`s) and output processing (`OutputProcessor`: detokenize,
stop strings, logprobs, n > 1 fan-in into `RequestOutput`s); the engine core
(`pagoda.engine.core.EngineCore`) only schedules and executes, taking token ids and returning
token ids. The core is not thread-safe, so exactly one thread ever calls it: the engine core
loop (`pagoda.engine.engine_core`). `AsyncLLM(core)` runs that loop on a thread of this
process; `AsyncLLM.from_engine_args` (what `pagoda serve` uses) runs it in a child process, as
vLLM's EngineCore does, so the event loop's Python and the core's never wait for each other's
GIL (`pagoda.engine.core_client`). Either way the event loop hands `add`/`abort` commands over
without blocking; each step's core outputs are turned into `RequestOutput`s on the thread that
receives them, and come back with one `loop.call_soon_threadsafe` per event loop into
per-request `asyncio.Queue`s. When the output processor finds a stop string it aborts the
request in the core, which frees its KV blocks. `reset_prefix_cache` is a command too, which the
core answers in a later report. This class also owns admission (a bound on queued requests,
`EngineOverloadedError`), cancellation (a consumer that stops iterating aborts its request and
frees its KV blocks) and graceful drain/shutdown. With --otlp-traces-endpoint the front end
exports one OpenTelemetry span per finished request (`pagoda.tracing`), in the trace of the
`trace_headers` given to `generate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagoda import envs
from pagoda.core.outputs import EngineCoreOutputs
from pagoda.engine.core_client import ProcessCore, RemoteEngine, ThreadCore
from pagoda.engine.engine_core import AbortRequests, AddRequest, CoreReport, ResetPrefixCache
from pagoda.engine.input_processor import InputProcessor, PromptValidationError
from pagoda.engine.output_processor import OutputProcessor
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.compile_pool import (  # raised by generate()
    StructuredOutputsBusyError as StructuredOutputsBusyError,
)
from pagoda.tracing import RequestTracer, make_request_tracer

logger = logging.getLogger(__name__)

# Called as hook(engine) after every step, when the engine's last_scheduler_stats /
# last_iteration_stats are fresh (on the thread that receives the step's outputs, after the
# output processor added its timings; in process mode `engine` is the front end's
# `RemoteEngine` view of the core). The Prometheus logger is one.
StatsHook = Callable[[Any], None]


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_waiting_requests`): retry later (HTTP 503)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class EngineRestartingError(RuntimeError):
    """The engine core failed and is being restarted: retry shortly (HTTP 503)."""


class RequestQueueTimeoutError(RuntimeError):
    """The request waited longer than `max_queue_delay_s` without being scheduled (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine core died; this request (or every request, once no restart is left) cannot
    be served (HTTP 500)."""


@dataclass
class _Stream:
    """Where one request's outputs go."""

    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    n: int


def multiprocessing_enabled() -> bool:
    """$PAGODA_ENABLE_MULTIPROCESSING=0 keeps the served engine on a thread (like vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING)."""
    return envs.PAGODA_ENABLE_MULTIPROCESSING


# A server on a CPU prefills in chunks of this many tokens unless --max-num-batched-tokens says
# otherwise (vLLM too picks its default by usage context, smaller for its server). On a small
# CPU a 2048-token chunk is a step of ~0.6 s (SmolLM2-135M, 2 cores) in which no running request
# gets a token, and a burst's requests see their first token 16 at a time; 512-token chunks
# bound the step and hand first tokens out 4 at a time (32 requests of 128 tokens: median TTFT
# 815-909 ms against 1081-1126 with 2048, the same throughput).
SERVING_CPU_MAX_NUM_BATCHED_TOKENS = 512
# And runs this many requests per core at once unless --max-num-seqs says otherwise. A CPU's
# decode step grows with the batch almost as fast as the batch (2 cores, SmolLM2-135M: ~50
# output tok/s at 8 sequences, ~100 at 64), so 256 running requests each get a token every few
# seconds: under overload every stream crawls and none meets a latency target, where a small
# batch keeps streams at a readable pace and load shedding (the waiting bound, 503 with
# Retry-After) refuses the excess at once. --max-num-seqs 256 trades that for throughput.
SERVING_CPU_SEQS_PER_CORE = 4


def serving_engine_args(engine_args: Any) -> Any:
    """`engine_args` with the server's CPU defaults filled in: the prefill chunk and the
    running batch."""
    from pagoda.engine.arg_utils import resolve_device

    if resolve_device(engine_args.device) != "cpu":
        return engine_args
    changes: dict[str, Any] = {}
    if engine_args.max_num_batched_tokens is None and engine_args.enable_chunked_prefill:
        changes["max_num_batched_tokens"] = SERVING_CPU_MAX_NUM_BATCHED_TOKENS
    if engine_args.max_num_seqs is None:
        from pagoda.worker.model_runner import num_cpu_threads

        changes["max_num_seqs"] = SERVING_CPU_SEQS_PER_CORE * num_cpu_threads()
    return dataclasses.replace(engine_args, **changes) if changes else engine_args


def build_serving_engine(engine_args: Any, same_process_as_frontend: bool = False) -> Any:
    """The `EngineCore` a server runs (in the engine core process, by default)."""
    from pagoda.cli import check_engine_start
    from pagoda.engine.core import EngineCore

    served_args = serving_engine_args(engine_args)
    # What a server's front end (without torch) could not check: refused here in one line
    # (architecture, weight files, memory) before anything is allocated.
    config = check_engine_start(served_args)
    engine = EngineCore(config if config is not None else served_args.create_engine_config())
    if served_args is not engine_args:  # said once the engine started (a refusal is one line)
        logger.info(
            "serving on a CPU: prefill chunks of %s tokens (--max-num-batched-tokens), %s "
            "requests at once (--max-num-seqs)",
            served_args.max_num_batched_tokens or "the default",
            served_args.max_num_seqs or "the default",
        )
    if same_process_as_frontend:
        # The HTTP event loop shares this process's GIL: leave it a core at small batches. In
        # its own process the core does better with every thread (c1 on 2 cores: TPOT 11.5 ms
        # with 2 threads, 15.3 with 1).
        runner = getattr(getattr(engine, "executor", None), "model_runner", None)
        if runner is not None and hasattr(runner, "reserve_core_for_frontend"):
            runner.reserve_core_for_frontend()
    return engine


def default_max_waiting_requests(max_num_seqs: int, num_kv_tokens: int, max_model_len: int) -> int:
    """The waiting-queue bound a server uses unless told otherwise: a quarter of max_num_seqs,
    at most as many requests as the KV cache can run at once at full length (its tokens over
    max_model_len), at least 1. Places in the batch free up about max_num_seqs per running
    request's lifetime, so the last admitted request starts within about a quarter of one; a
    longer queue only makes every request in it late (on 2 cores with 8 running, 5 waiting
    kept 0.40 of the saturation goodput under 3x overload, 2 waiting 0.86:
    docs/reliability.md), and the rest are better answered 503 at once."""
    return max(1, min(max_num_seqs // 4, num_kv_tokens // max(1, max_model_len)))


class AsyncLLM:
    """Streams an engine core's outputs to asyncio callers; the core runs off the loop.

    Give either `engine`, an `EngineCore` (or an `LLMEngine`, whose core is used; the core
    loop runs on a thread of this process and `self.engine` is the core), or
    `engine_factory`, a picklable callable that builds the core in a child process
    (`self.engine` is then a `RemoteEngine` view: tokenizer, configs, last stats).

    Admission: `max_waiting_requests` bounds the requests admitted but not yet scheduled, past
    the free places of the running batch (`max_num_seqs` minus the running requests); past it
    `generate` raises `EngineOverloadedError`, so 0 means "no queue beyond what runs" and None
    unbounded. `max_queue_delay_s` drops a request not yet scheduled after that long
    (`RequestQueueTimeoutError`).

    Failures: an engine core that dies fails its in-flight requests (`EngineDeadError`). With
    an `engine_factory`, it is then started again, at most `max_engine_restarts` times
    (`num_restarts`; `state` is "restarting" meanwhile and new requests get
    `EngineRestartingError`); once none is left, or without a factory, `state` becomes "dead"
    and every `fatal_hooks` callable is called with the error (the server exits non-zero so
    that its supervisor restarts it).
    """

    def __init__(
        self,
        engine: Any | None = None,
        max_waiting_requests: int | None = None,
        stats_hooks: list[StatsHook] | None = None,
        idle_poll_s: float = 0.5,
        *,
        engine_factory: Callable[[], Any] | None = None,
        max_queue_delay_s: float | None = None,
        max_engine_restarts: int = 0,
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        if max_queue_delay_s is not None and not max_queue_delay_s > 0:
            raise ValueError(f"max_queue_delay_s must be positive, got {max_queue_delay_s}")
        if max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {max_engine_restarts}")
        if (engine is None) == (engine_factory is None):
            raise ValueError("give exactly one of engine and engine_factory")
        engine = getattr(engine, "engine_core", engine)  # an LLMEngine: its core
        self.max_waiting_requests = max_waiting_requests
        self.max_queue_delay_s = max_queue_delay_s
        self.max_engine_restarts = max_engine_restarts
        self.num_restarts = 0
        self.stats_hooks = list(stats_hooks or [])
        self.restart_hooks: list[Callable[[], None]] = []  # called after each restart
        # Called with the reason of each request refused for load (vLLM's admission
        # rejections): "max_num_queued_reqs" (the waiting bound), or a structured request's
        # StructuredOutputsBusyError reason. Not for 503s that are no load: draining, restarting.
        self.rejection_hooks: list[Callable[[str], None]] = []
        self.fatal_hooks: list[Callable[[BaseException], None]] = []  # called once, if dead
        self._engine_factory = engine_factory
        self._idle_poll_s = idle_poll_s
        # Request id -> its stream. Added by generate() on the event loop, removed by whoever
        # ends the stream (the core's callback thread, or the consumer leaving early).
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams against _on_stopped, and the counters
        # Guards the output processor: the event loop adds and aborts requests, the thread
        # that receives the core's reports processes their outputs. Never held with _lock.
        self._op_lock = threading.Lock()
        self._aborting: dict[str, str] = {}  # sample id -> its request, aborted by abort()
        # Commands awaiting the core's answer (`reset_prefix_cache`): call id -> the caller's
        # loop and future. Guarded by _lock; failed with the core's error when it stops.
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stopped: BaseException | None = None  # set once the core has stopped
        # Read (racily, which is fine for admission) on the loop.
        self._engine_waiting = 0
        self._engine_running = 0
        self._num_pending_adds = 0  # samples handed over but not yet taken by the core
        self._num_in_flight = 0  # generate() calls that have not returned yet
        self.draining = False
        self._shutting_down = False
        self.state = "running"  # running | restarting | dead | stopped
        self.dead_error: BaseException | None = None
        self._core: ThreadCore | ProcessCore
        if engine is not None:
            self._core = ThreadCore(
                engine, self._on_report, self._on_stopped, idle_poll_s, max_queue_delay_s
            )
        else:
            self._core = self._start_process_core()
        self.engine = self._core.engine
        self._thread = self._core.thread  # the thread that calls back with each step's outputs
        # --otlp-traces-endpoint: one tracer for the engine's life (restarts included).
        config = getattr(self.engine, "config", None)
        self.tracer: RequestTracer | None = None
        try:
            self.tracer = make_request_tracer(
                getattr(config, "observability_config", None),
                getattr(self.engine.model_config, "name", ""),
            )
        except BaseException:
            self._core.shutdown(10.0)
            raise
        self._make_processors()
        sc = getattr(getattr(self.engine, "config", None), "scheduler_config", None)
        self.max_num_seqs: int = getattr(sc, "max_num_seqs", None) or 1

    def _start_process_core(self) -> ProcessCore:
        assert self._engine_factory is not None
        return ProcessCore(
            self._engine_factory,
            self._on_report,
            self._on_stopped,
            self._idle_poll_s,
            self.max_queue_delay_s,
        )

    def _make_processors(self) -> None:
        """The front end's input and output processors, for the core now running."""
        sc = getattr(getattr(self.engine, "config", None), "scheduler_config", None)
        self.input_processor = InputProcessor(
            self.engine.tokenizer, self.engine.model_config, getattr(sc, "policy", "fcfs")
        )
        with self._op_lock:
            self.output_processor = OutputProcessor(self.engine.tokenizer, self.tracer)

    @classmethod
    def from_engine_args(
        cls, engine_args: Any, multiprocess: bool | None = None, **kwargs: Any
    ) -> AsyncLLM:
        """The serving engine: in an engine core process unless `multiprocess` is False (None:
        $PAGODA_ENABLE_MULTIPROCESSING, default on)."""
        kwargs.setdefault(
            "max_waiting_requests", getattr(engine_args, "max_waiting_requests", None)
        )
        if multiprocess is None:
            multiprocess = multiprocessing_enabled()
        if not multiprocess:
            return cls(build_serving_engine(engine_args, same_process_as_frontend=True), **kwargs)
        return cls(engine_factory=functools.partial(build_serving_engine, engine_args), **kwargs)

    # ---- read-only views (safe from any thread) ----
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self.state == "running" and self._core.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def is_tracing_enabled(self) -> bool:
        return self.tracer is not None

    # ---- asyncio API ----
    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them (DELTA unless told otherwise).
        `trace_headers` (traceparent, tracestate) put its span in the caller's trace.

        Raises ValueError for a request the engine rejects; EngineOverloadedError past the
        waiting bound, EngineDrainingError while draining, EngineRestartingError while the
        core restarts, RequestQueueTimeoutError after waiting too long, EngineDeadError when
        the core died under it; StructuredOutputsBusyError for a structured request the core
        cannot take for now (constraints given up on as too slow still running, or no grammar
        compiler free in time). Closing or cancelling the iterator before the last output
        aborts the request.
        """
        arrival_time = time.time()
        # A bad request is a 400 whatever the load: validated before the admission check.
        prompt_text, prompt_ids, requests = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority
        )
        self.check_admission(params.n)
        loop = asyncio.get_running_loop()
        stream = _Stream(asyncio.Queue(), loop, params.n)
        with self._lock:
            if self._stopped is not None:
                raise self._stopped
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = stream
            self._num_pending_adds += len(requests)
            core = self._core
        try:
            with self._op_lock:
                self.output_processor.add_request(
                    request_id,
                    prompt_text,
                    prompt_ids,
                    params,
                    requests,
                    arrival_time,
                    trace_headers,
                )
        except BaseException:
            with self._lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
                self._num_pending_adds -= len(requests)
            raise
        self._num_in_flight += 1
        core.send(AddRequest(requests))
        finished = False
        try:
            while True:
                item = await stream.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._num_in_flight -= 1
            if not finished:
                # Consumer went away (client disconnect, cancellation): free the KV blocks now.
                with self._lock:
                    live = self._streams.get(request_id) is stream
                    if live:
                        del self._streams[request_id]
                if live:
                    self._abort_in_core([request_id], core)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; a caller still iterating gets a final output with reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._op_lock:
            op = self.output_processor
            children = {rid: op.abort_requests([rid]) for rid in ids}
            # The stream ends once the core has aborted the samples (its KV blocks are free).
            for rid, cids in children.items():
                for cid in cids:
                    self._aborting[cid] = rid
        if any(children.values()):
            self._core.send(AbortRequests([c for cids in children.values() for c in cids]))
        self._end_aborted([rid for rid, cids in children.items() if not cids])

    def _end_aborted(self, request_ids: list[str]) -> None:
        """Give each still-open stream of these requests its final "abort" output."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for rid in request_ids:
                st = self._streams.pop(rid, None)
                if st is not None:
                    batches.setdefault(st.loop, []).append((st.out, _aborted_output(rid, st.n)))
        for loop, items in batches.items():
            _send(loop, items)

    def _abort_in_core(self, request_ids: list[str], core: Any = None) -> None:
        """Forget user requests in the output processor and abort their samples in the core."""
        with self._op_lock:
            children = self.output_processor.abort_requests(request_ids)
        if children:
            (core or self._core).send(AbortRequests(children))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix in the engine core (as `LLM.reset_prefix_cache`);
        False (nothing done) while a request still holds KV blocks. Raises
        EngineRestartingError while the core restarts, and what `generate` raises where it has
        stopped (or stops before answering): EngineDeadError, or EngineDrainingError after
        `shutdown`."""
        if self.state == "restarting":
            raise EngineRestartingError("the engine core is restarting after a failure: retry")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            if self._stopped is not None:
                raise self._stopped
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
            core = self._core
        try:
            core.send(ResetPrefixCache(call_id))
            return await future
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting requests and wait until every in-flight one has finished. After
        `timeout` seconds the rest are aborted: each caller gets EngineDrainingError (an
        in-band error and the end of its stream); returns whether all finished in time."""
        self.draining = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._num_in_flight > 0 and self.state == "running":
            if deadline is not None and time.monotonic() >= deadline:
                self.fail_in_flight(
                    EngineDrainingError(
                        "the server shut down before this request finished (--drain-timeout)"
                    )
                )
                return False
            await asyncio.sleep(0.05)
        return True

    def fail_in_flight(self, error: BaseException) -> None:
        """End every in-flight request with `error` and abort it in the engine."""
        with self._lock:
            streams, self._streams = self._streams, {}
        if streams:
            self._abort_in_core(list(streams))
        _deliver_all(streams.values(), error)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (unfinished requests are aborted and their callers told)."""
        self.draining = True
        self._shutting_down = True
        self._core.shutdown(timeout)
        if self.tracer is not None:
            self.tracer.shutdown()  # sends the spans not sent yet

    def check_admission(self, n: int, what: str = "n") -> None:
        """Raise what `generate` would for `n` more samples now: a PromptValidationError
        (param `what`) where even an idle server never admits that many at once, else
        EngineOverloadedError past the waiting bound, or the engine's state error. A request
        of several prompts asks for all of their samples here first, so that it is refused
        whole (and with a 400 where it can never run) rather than part-way."""
        if self.state == "restarting":
            raise EngineRestartingError("the engine core is restarting after a failure: retry")
        if self.state != "running" or not self._core.is_alive():
            raise EngineDeadError(f"the engine core has stopped: {self.dead_error!r}")
        if self.draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        bound = self.max_waiting_requests
        if bound is None:
            return
        if n > self.max_num_seqs + bound:  # not even an idle server admits it: not a 503
            samples = f"n={n} samples" if what == "n" else f"{n} samples ({what} x n)"
            raise PromptValidationError(
                f"{samples} are more than this server ever admits at once ({self.max_num_seqs}"
                f" running, --max-num-seqs, plus {bound} waiting, --max-waiting-requests)",
                what,
            )
        free = max(0, self.max_num_seqs - self._engine_running)
        if self._num_pending_adds + self._engine_waiting + n - free > bound:
            self._rejected("max_num_queued_reqs")
            raise EngineOverloadedError(
                f"the server is at capacity ({bound} requests waiting, --max-waiting-requests):"
                " retry later"
            )

    def _stopped_error(self, error: BaseException | None) -> BaseException:
        if error is None:
            return EngineDrainingError("the engine shut down before this request finished")
        return EngineDeadError(f"the engine core failed while this request was running: {error!r}")

    # ---- the core's callback thread ----
    def _on_report(self, report: CoreReport) -> None:
        with self._lock:
            self._num_pending_adds -= report.num_adds
        self._engine_waiting = report.num_waiting
        # The core's ids are the samples': the output processor knows their user requests.
        with self._op_lock:
            op = self.output_processor
            refused = []
            for cid, error in report.add_errors:
                for rid in op.parents_of([cid]):
                    op.discard(rid)
                    refused.append((rid, error))
                    if isinstance(error, StructuredOutputsBusyError) and error.reason:
                        self._rejected(error.reason)
            expired = op.parents_of(report.expired)
            if expired:
                op.abort_requests(expired)
            aborted: dict[str, None] = {}  # requests abort() ended, now gone from the core
            for cid in report.aborted:
                rid = self._aborting.pop(cid, None)
                if rid is not None:
                    aborted[rid] = None
            outputs: list[RequestOutput] = []
            stopped: list[str] = []
            if report.stepped:
                outputs, stopped = op.process_core_outputs(
                    EngineCoreOutputs(
                        report.outputs,
                        report.first_scheduled,
                        report.iteration_stats,
                        report.preempted,
                    )
                )
        if stopped:  # a stop string (or an error) ended them here: free their KV blocks
            self._core.send(AbortRequests(stopped))
        if report.stepped:  # before the outputs: a caller who saw its last token sees metrics
            if report.scheduler_stats is not None:
                self._engine_running = report.scheduler_stats.num_running_reqs
            if isinstance(self.engine, RemoteEngine):
                self.engine.update(report)
            self._report_stats()
        if aborted:
            self._end_aborted(list(aborted))
        if report.prefix_cache_resets:
            with self._lock:
                calls = [(self._calls.pop(cid, None), r) for cid, r in report.prefix_cache_resets]
            for call, result in calls:
                if call is not None:
                    _answer(*call, result)
        # One wake-up per event loop per step, not one per request: at a few hundred running
        # requests, per-output call_soon_threadsafe calls would cost a syscall each.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            streams = self._streams
            for rid, error in refused:
                st = streams.pop(rid, None)
                if st is not None:
                    batches.setdefault(st.loop, []).append((st.out, error))
            for rid in expired:
                st = streams.pop(rid, None)
                if st is not None:
                    error = RequestQueueTimeoutError(
                        f"the request waited more than {self.max_queue_delay_s:g} s without "
                        "being scheduled (--max-queue-delay-s): retry later"
                    )
                    batches.setdefault(st.loop, []).append((st.out, error))
            for out in outputs:
                st = streams.get(out.request_id)
                if st is None:
                    continue  # aborted by its caller meanwhile
                if out.finished:
                    del streams[out.request_id]
                batches.setdefault(st.loop, []).append((st.out, out))
        for loop, items in batches.items():
            _send(loop, items)

    def _rejected(self, reason: str) -> None:
        for hook in self.rejection_hooks:
            try:
                hook(reason)
            except Exception:  # noqa: BLE001 - metrics must never stop admission
                logger.exception("rejection hook failed")

    def _report_stats(self) -> None:
        for hook in self.stats_hooks:
            try:
                hook(self.engine)
            except Exception:  # noqa: BLE001 - metrics must never stop generation
                logger.exception("stats hook failed")

    def _on_stopped(self, error: BaseException | None) -> None:
        restart = (
            error is not None
            and not self._shutting_down
            and self._engine_factory is not None
            and self.num_restarts < self.max_engine_restarts
        )
        with self._lock:
            if error is not None:
                self.dead_error = error
            self._stopped = self._stopped_error(error)
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
            self.state = "restarting" if restart else ("dead" if error is not None else "stopped")
        with self._op_lock:
            self.output_processor = OutputProcessor(self.engine.tokenizer, self.tracer)
            self._aborting.clear()
        _deliver_all(streams.values(), self._stopped)
        for loop, future in calls.values():
            _answer(loop, future, self._stopped)
        if restart:
            threading.Thread(target=self._restart, name="pagoda-core-restart", daemon=True).start()
        elif error is not None and not self._shutting_down:
            self._fatal(error)

    def _restart(self) -> None:
        logger.error(
            "the engine core failed (%r): restarting it (restart %d of at most %d)",
            self.dead_error, self.num_restarts + 1, self.max_engine_restarts,
        )  # fmt: skip
        try:
            core = self._start_process_core()
        except BaseException as e:  # noqa: BLE001 - a core that cannot start is fatal
            logger.exception("the engine core could not be restarted")
            self.state = "dead"
            self._fatal(e)
            return
        with self._lock:
            self._core, self.engine, self._thread = core, core.engine, core.thread
            self._make_processors()
            self._num_pending_adds = self._engine_waiting = self._engine_running = 0
            self._stopped = None
            self.num_restarts += 1
            self.state = "running"
        if self._shutting_down:
            core.shutdown(10.0)
            return
        logger.info("the engine core is running again (%d restarts)", self.num_restarts)
        for hook in self.restart_hooks:
            hook()

    def _fatal(self, error: BaseException) -> None:
        logger.error("the engine core has failed for good: %r", error)
        for hook in self.fatal_hooks:
            try:
                hook(error)
            except Exception:  # noqa: BLE001
                logger.exception("fatal hook failed")


def _deliver_all(streams: Any, item: Any) -> None:
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for st in streams:
        batches.setdefault(st.loop, []).append((st.out, item))
    for loop, items in batches.items():
        _send(loop, items)


def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the callers' loop is closed: nobody is listening any more
        pass


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _answer(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any) -> None:
    """Resolve a command's `future` on its `loop` with `result` (raised if an exception)."""

    def resolve() -> None:
        if future.done():  # its caller was cancelled meanwhile
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


def _aborted_output(request_id: str, n: int) -> RequestOutput:
    samples = [CompletionOutput(i, "", [], None, None, finish_reason="abort") for i in range(n)]
    return RequestOutput(request_id, None, [], None, samples, finished=True)
