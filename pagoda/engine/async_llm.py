"""`AsyncLLM`: the asyncio front end of the engine core, which runs off the event loop.

The front end does input processing (`InputProcessor`: tokenize, validate once, fan out n > 1
into one-sample `EngineCoreRequest`s) and output processing (`OutputProcessor`: detokenize,
stop strings, logprobs, n > 1 fan-in into `RequestOutput`s); the engine core
(`pagoda.engine.core.EngineCore`) only schedules and executes, taking token ids and returning
token ids. The core is not thread-safe, so exactly one thread ever calls it: the engine core
loop (`pagoda.engine.engine_core`). `AsyncLLM(core)` runs that loop on a thread of this
process; `AsyncLLM.from_engine_args` (what `pagoda serve` uses) runs it in a child process, as
vLLM's EngineCore does, so the event loop's Python and the core's never wait for each other's
GIL (`pagoda.engine.core_client`; the server's core: `pagoda.engine.serving_engine`). Either
way the event loop hands `add`/`abort` commands over without blocking; each step's core
outputs are turned into `RequestOutput`s on the thread that receives them, and come back with
one `loop.call_soon_threadsafe` per event loop into per-request `asyncio.Queue`s (that thread's
side, and the core's failure and restart: `pagoda.engine.output_handler`). When the output
processor finds a stop string it aborts the request in the core, which frees its KV blocks.
`reset_prefix_cache` is a command too, which the core answers in a later report. This class
also owns admission (a bound on queued requests, `EngineOverloadedError`; the errors a caller
gets: `pagoda.engine.exceptions`), cancellation (a consumer that stops iterating aborts its
request and frees its KV blocks) and graceful drain/shutdown. With --otlp-traces-endpoint the
front end exports one OpenTelemetry span per finished request (`pagoda.tracing`), in the trace
of the `trace_headers` given to `generate`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from pagoda.engine.core_client import ProcessCore, ThreadCore
from pagoda.engine.engine_core import AbortRequests, AddRequest, ResetPrefixCache
from pagoda.engine.exceptions import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineRestartingError,
)
from pagoda.engine.input_processor import InputProcessor, PromptValidationError
from pagoda.engine.output_handler import OutputHandler, RequestStream, deliver_all
from pagoda.engine.serving_engine import build_serving_engine, multiprocessing_enabled
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tracing import RequestTracer, make_request_tracer

# Called as hook(engine) after every step, when the engine's last_scheduler_stats /
# last_iteration_stats are fresh (on the thread that receives the step's outputs, after the
# output processor added its timings; in process mode `engine` is the front end's
# `RemoteEngine` view of the core). The Prometheus logger is one.
StatsHook = Callable[[Any], None]


class AsyncLLM(OutputHandler):
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
        self._streams: dict[str, RequestStream] = {}
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
            self.output_processor = self._new_output_processor()

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
        stream = RequestStream(asyncio.Queue(), loop, params.n)
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
        deliver_all(streams.values(), error)

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
