"""The half of `AsyncLLM` that runs on the thread hearing from the engine core.

Each `CoreReport` (after an engine step, or with a command's answer) comes to `_on_report`: the
output processor turns its core outputs into `RequestOutput`s there, and they go to the
requests' asyncio queues (`RequestStream`) with one `loop.call_soon_threadsafe` per event loop,
along with the errors of requests the core refused or that waited too long, the final "abort"
output of requests `abort` ended, and the answers of commands (`reset_prefix_cache`). When the
core stops (`_on_stopped`) every in-flight request and command fails, with EngineDeadError (or
EngineDrainingError at shutdown); a failed core is started again while restarts are left, else
the front end is dead and its `fatal_hooks` are called.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

from pagoda.core.outputs import EngineCoreOutputs
from pagoda.engine.core_client import RemoteEngine
from pagoda.engine.engine_core import AbortRequests, CoreReport
from pagoda.engine.exceptions import (
    EngineDeadError,
    EngineDrainingError,
    RequestQueueTimeoutError,
    StructuredOutputsBusyError,
)
from pagoda.engine.output_processor import OutputProcessor
from pagoda.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class RequestStream:
    """Where one request's outputs go."""

    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    n: int


class OutputHandler:
    """`AsyncLLM`'s side on the engine core's callback thread: `_on_report` and `_on_stopped`,
    which the core client calls, and what they share with the event loop's side. A base class
    of `AsyncLLM` only: the state it works on (streams, locks, counters, hooks) is set up by
    `AsyncLLM.__init__`, and a restart starts the core with `AsyncLLM._start_process_core`."""

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
            self.output_processor = self._new_output_processor()
            self._aborting.clear()
        deliver_all(streams.values(), self._stopped)
        for loop, future in calls.values():
            _answer(loop, future, self._stopped)
        if restart:
            threading.Thread(target=self._restart, name="pagoda-core-restart", daemon=True).start()
        elif error is not None and not self._shutting_down:
            self._fatal(error)

    def _new_output_processor(self) -> OutputProcessor:
        sc = getattr(getattr(self.engine, "config", None), "scheduler_config", None)
        interval = getattr(sc, "stream_interval", 1)
        return OutputProcessor(self.engine.tokenizer, self.tracer, interval)

    def _stopped_error(self, error: BaseException | None) -> BaseException:
        if error is None:
            return EngineDrainingError("the engine shut down before this request finished")
        return EngineDeadError(f"the engine core failed while this request was running: {error!r}")

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


def deliver_all(streams: Any, item: Any) -> None:
    """Give each of `streams` (`RequestStream`s) `item`, one wake-up per event loop."""
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
