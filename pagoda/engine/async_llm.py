"""`AsyncLLM`: the asyncio face of `LLMEngine`, with the engine loop on its own thread.

The engine is not thread-safe, so exactly one thread (the engine thread) ever calls it: the
event loop hands it `add`/`abort` commands through a thread-safe queue, and the engine thread
hands each `RequestOutput` back with `loop.call_soon_threadsafe` into a per-request
`asyncio.Queue`. Tokenization and HTTP on the event loop therefore never stall generation, and
a slow step never blocks the event loop. It also owns admission (a bound on queued requests,
`EngineOverloadedError`), cancellation (a consumer that stops iterating aborts its request and
frees its KV blocks) and graceful drain/shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called on the engine thread as hook(engine) after every step, when the engine's
# last_scheduler_stats / last_iteration_stats are fresh. The Prometheus logger is one.
StatsHook = Callable[[Any], None]


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_waiting_requests`): retry later (HTTP 503)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread died; no request can be served any more (HTTP 500)."""


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    arrival_time: float
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()


class AsyncLLM:
    """Runs `engine.step()` in a background thread and streams outputs to asyncio callers.

    `max_waiting_requests` bounds the requests admitted but not yet scheduled (those in the
    hand-over queue plus the engine's own waiting queue); past it `generate` raises
    `EngineOverloadedError`. None means unbounded.
    """

    def __init__(
        self,
        engine: Any,
        max_waiting_requests: int | None = None,
        stats_hooks: list[StatsHook] | None = None,
        idle_poll_s: float = 0.5,
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stats_hooks = list(stats_hooks or [])
        self._idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Owned by the engine thread: request id -> where its outputs go.
        self._streams: dict[str, _Add] = {}
        # Written by the engine thread, read (racily, which is fine for admission) by the loop.
        self._engine_waiting = 0
        self._num_pending_adds = 0  # handed over but not yet added by the engine thread
        self._num_in_flight = 0  # generate() calls that have not returned yet
        self._needs_flush = False  # aborts happened since the last step
        self._pending_lock = threading.Lock()
        self.draining = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncLLM:
        from pagoda.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(engine_args)
        # The HTTP event loop runs in this process: leave it a core at small batches.
        runner = getattr(getattr(engine, "executor", None), "model_runner", None)
        if runner is not None and hasattr(runner, "reserve_core_for_frontend"):
            runner.reserve_core_for_frontend()
        kwargs.setdefault(
            "max_waiting_requests", getattr(engine_args, "max_waiting_requests", None)
        )
        return cls(engine, **kwargs)

    # ---- read-only views (safe from any thread) ----
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    # ---- asyncio API ----
    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them (DELTA unless told otherwise).

        Raises ValueError for a request the engine rejects, EngineOverloadedError past the
        waiting bound, EngineDrainingError while draining. Closing or cancelling the iterator
        before the last output aborts the request.
        """
        self._check_admission()
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        with self._pending_lock:
            self._num_pending_adds += 1
        self._num_in_flight += 1
        self._inbox.put(_Add(request_id, prompt, params, priority, time.time(), out, loop))
        finished = False
        try:
            while True:
                item = await out.get()
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
                self._inbox.put(_Abort([request_id]))

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._inbox.put(_Abort(ids))

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting requests and wait until every in-flight one has finished."""
        self.draining = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._num_in_flight > 0 and self.is_running:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (unfinished requests are aborted and their callers told)."""
        self.draining = True
        self._inbox.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _check_admission(self) -> None:
        if self.dead_error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine thread has stopped: {self.dead_error!r}")
        if self.draining:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        bound = self.max_waiting_requests
        if bound is not None and self._num_pending_adds + self._engine_waiting >= bound:
            raise EngineOverloadedError(
                f"too many requests are waiting ({bound}, --max-waiting-requests): retry later"
            )

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                # Block only when idle; when busy, take whatever arrived and step again.
                if not self._process_inbox(block=not busy):
                    break
                # After aborts one step runs even when nothing is left: it tells the model
                # runner which requests are gone and refreshes the scheduler's statistics.
                if not (self.engine.has_unfinished_requests() or self._needs_flush):
                    continue
                self._needs_flush = False
                outputs = self.engine.step()
                self._engine_waiting = self.engine.num_waiting_requests
                self._dispatch(outputs)
                self._report_stats()
        except BaseException as e:  # noqa: BLE001 - any engine failure must reach the callers
            logger.exception("engine thread died")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"))
            return
        self._fail_all(EngineDrainingError("the engine shut down before this request finished"))

    def _process_inbox(self, block: bool) -> bool:
        """Apply queued commands; returns False when told to stop."""
        while True:
            try:
                cmd = (
                    self._inbox.get(timeout=self._idle_poll_s)
                    if block
                    else self._inbox.get_nowait()
                )
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                live = [self._streams.pop(r) for r in cmd.request_ids if r in self._streams]
                if live:
                    self.engine.abort_request([a.request_id for a in live])
                    self._needs_flush = True
                # A caller still iterating (abort() from elsewhere) gets a final "abort" output.
                for a in live:
                    self._send(a.loop, [(a.out, _aborted_output(a))])
            self._engine_waiting = self.engine.num_waiting_requests

    def _add(self, cmd: _Add) -> None:
        with self._pending_lock:
            self._num_pending_adds -= 1
        try:
            if cmd.request_id in self._streams:
                raise ValueError(f"request_id {cmd.request_id!r} is already running")
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                arrival_time=cmd.arrival_time,
                priority=cmd.priority,
            )
        except Exception as e:  # noqa: BLE001 - a rejected request must not kill the loop
            cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, e)
            return
        self._streams[cmd.request_id] = cmd

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One wake-up per event loop per step, not one per request: at a few hundred running
        # requests, per-output call_soon_threadsafe calls would cost a syscall each.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue  # aborted by its caller meanwhile
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(target.loop, []).append((target.out, out))
        for loop, items in batches.items():
            self._send(loop, items)

    def _send(
        self, loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]
    ) -> None:
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the callers' loop is closed: nobody is listening any more
            for _, out in items:
                self._streams.pop(getattr(out, "request_id", ""), None)

    def _report_stats(self) -> None:
        for hook in self.stats_hooks:
            try:
                hook(self.engine)
            except Exception:  # noqa: BLE001 - metrics must never stop generation
                logger.exception("stats hook failed")

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        if streams:
            try:
                self.engine.abort_request(list(streams))
            except Exception:  # noqa: BLE001
                pass
        for a in streams.values():
            self._send(a.loop, [(a.out, error)])
        # Adds still in the inbox never reach the engine: tell their callers too.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._send(cmd.loop, [(cmd.out, error)])


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _aborted_output(a: _Add) -> RequestOutput:
    samples = [
        CompletionOutput(i, "", [], None, None, finish_reason="abort") for i in range(a.params.n)
    ]
    return RequestOutput(a.request_id, None, [], None, samples, finished=True)
