"""`GrammarCompilePool`: the serving loop's structured-outputs constraints, compiled off its step
loop, each by its deadline, at most PAGODA_GRAMMAR_COMPILE_PROCESSES (2) at once.

Each compile runs in a worker process (`compile_worker.py`) watched by a thread of this pool:
past its deadline the worker is killed, which frees its core at once, and a new one is started
for the next compile. A worker is started for the first compile, another only when a compile
arrives while those started are busy; all are kept. The deadline counts from the request's
arrival, but not the engine's own start-up (xgrammar imported here, a new worker starting).
Where the grammar cannot come back from another process (an xgrammar without
`CompiledGrammar.deserialize_json`), or with PAGODA_GRAMMAR_COMPILE_PROCESSES=0, the compile
runs on the pool's thread instead: xgrammar cannot be interrupted, so a compile past its
deadline is refused but runs on to its end, a core busy meanwhile (`num_runaway` counts those).
A compile that has not started by its deadline (both workers busy all along) is refused as busy,
not as too slow.

Identical constraints submitted while one compiles share its compile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from pagoda import envs
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.compile_worker import CompileTimeout, CompileWorker, WorkerGone

logger = logging.getLogger(__name__)

NUM_COMPILE_SLOTS = 2  # compiles at once (worker processes, or threads without them)


class StructuredOutputsBusyError(RuntimeError):
    """A structured request refused for now: too much constraint work given up on is still
    running, or no compile worker was free until its deadline. Retry later (HTTP 503).
    `reason` is the load limit it hit, for `pagoda:admission_rejections_total` (None: not a
    refusal for load, as when the server shuts down). It survives pickling (the instance's
    attributes travel with it)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


def timeout_message(limit_s: float) -> str:
    return (
        f"the structured_outputs constraint took longer than {limit_s:g} s to compile "
        "(PAGODA_GRAMMAR_COMPILE_TIMEOUT_S): simplify it"
    )


@dataclass
class _Job:
    params: SamplingParams
    key: str
    deadline: float  # time.monotonic()
    limit_s: float  # the timeout it was given
    future: Future = field(default_factory=Future)
    on_thread: bool = False  # compiling on a thread of this process (not a worker)
    thread_done: bool = False  # that compile has returned


class _Slot:
    """A thread that runs one job at a time, in its worker process when it can."""

    def __init__(self, pool: GrammarCompilePool, index: int) -> None:
        self.pool, self.index = pool, index
        self.worker: CompileWorker | None = None
        self.job: _Job | None = None  # set by the pool, under its lock
        self.wake = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"pagoda-grammar-compile-{index}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            job = self.job
            if job is None:  # closed
                return
            if not job.future.set_running_or_notify_cancel():
                result: Any = None
                error: BaseException | None = None
            else:
                result, error = self._run_job(job)
            # Idle before the caller hears: the next compile it sends finds this slot free.
            more = self.pool._finished(self)
            _settle(job.future, result, error)
            if not more:
                return

    def _run_job(self, job: _Job) -> tuple[Any, BaseException | None]:
        """(the compiled grammar, None) or (None, the error)."""
        if time.monotonic() >= job.deadline:
            return None, _busy(job.limit_s)
        args = None
        try:
            args = self.pool._worker_args()
            result = self._compile_on_thread(job) if args is None else self._compile(job, args)
        except BaseException as e:  # noqa: BLE001 - the request's error
            return None, e
        finally:
            if self.worker is None and args is not None and not self.pool.closed:
                self._start_worker(args)  # after a kill: ready for the next compile
        return result, None

    def _compile(self, job: _Job, args: tuple[Any, ...]) -> Any:
        start = time.monotonic()
        if self.worker is None and not self._start_worker(args):
            return self._compile_on_thread(job)
        backend = self.pool.manager.backend  # built here (xgrammar imported) as the worker starts
        if not backend.can_deserialize:
            self._kill_worker()
            self.pool._no_processes()
            return self._compile_on_thread(job)
        assert self.worker is not None
        # The engine's own start-up (importing xgrammar, a worker starting) is not the compile's.
        deadline = job.deadline + time.monotonic() - start
        try:
            data = self.worker.compile(job.params.structured_outputs, deadline)
        except CompileTimeout as e:
            if not e.started:
                logger.warning("a grammar compile worker did not start: it is killed")
                self._kill_worker()
                raise _busy(job.limit_s) from None
            logger.warning(
                "a structured_outputs constraint took longer than %g s to compile: its compile "
                "worker (pid %s) is killed",
                job.limit_s,
                self.worker.pid,
            )
            self._kill_worker()
            raise ValueError(timeout_message(job.limit_s)) from None
        except WorkerGone as e:
            logger.warning("a grammar compile worker died: %s", e)
            self._kill_worker()
            raise ValueError(
                "the structured_outputs constraint could not be compiled (its compile worker "
                "died: out of memory?): simplify it"
            ) from None
        return backend.deserialize(data)

    def _start_worker(self, args: tuple[Any, ...]) -> bool:
        try:
            self.worker = CompileWorker(args)
        except OSError as e:  # no process to be had (memory, process limit): this thread
            logger.warning(
                "could not start a grammar compile worker (%r): compiling on a thread", e
            )
            return False
        return True

    def _kill_worker(self) -> None:
        """Kill the worker, whatever it does: its core is free on return."""
        assert self.worker is not None
        self.worker.kill()
        self.worker = None

    def _compile_on_thread(self, job: _Job) -> None:
        job.on_thread = True
        try:
            self.pool.manager.validate(job.params)  # cached there
        finally:
            job.thread_done = True

    def close(self) -> None:
        """Kill the worker (from any thread); the slot's thread ends after its job."""
        self.wake.set()
        worker = self.worker
        if worker is not None:
            worker.process.kill()
            worker.process.join(5)


class GrammarCompilePool:
    """Compiles constraints for `manager` (a `StructuredOutputManager`). `submit` returns a
    Future of the compiled grammar (None where the manager cached it itself: compiled on a
    thread); its error is a ValueError for a constraint that is invalid or too slow to compile,
    a StructuredOutputsBusyError for one no compile slot was free to start in time. The caller
    calls `expire` now and then (the serving loop: each iteration)."""

    def __init__(self, manager: Any, num_processes: int | None = None) -> None:
        self.manager = manager
        if num_processes is None:
            num_processes = envs.PAGODA_GRAMMAR_COMPILE_PROCESSES
        self.use_processes = num_processes > 0
        self.num_slots = num_processes or NUM_COMPILE_SLOTS
        self.closed = False
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._idle: list[_Slot] = []
        self._pending: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._by_key: dict[str, _Job] = {}
        self._runaway: list[_Job] = []  # on-thread compiles refused at their deadline

    def submit(self, params: SamplingParams, timeout_s: float) -> Future:
        """Compile the constraint of `params` within `timeout_s` seconds from now (waiting for
        a free slot included)."""
        assert params.structured_outputs is not None
        key = params.structured_outputs.cache_key()
        with self._lock:
            job = self._by_key.get(key)
            if job is not None and not job.future.done():
                return job.future
            job = _Job(params, key, time.monotonic() + timeout_s, timeout_s)
            self._by_key[key] = job
            job.future.add_done_callback(lambda _, job=job: self._forget(job))
            self._pending.append(job)
            self._dispatch()
        return job.future

    def expire(self) -> None:
        """Refuse the compiles past their deadline that no worker will end: those not started
        (busy), and those on a thread (too slow; they run on: `num_runaway`)."""
        now = time.monotonic()
        with self._lock:
            overdue = [j for j in self._pending if now >= j.deadline]
            for job in overdue:
                self._pending.remove(job)
            on_thread = [j for j in self._running if j.on_thread and now >= j.deadline]
        for job in overdue:
            _settle(job.future, error=_busy(job.limit_s))
        for job in on_thread:
            if _settle(job.future, error=ValueError(timeout_message(job.limit_s))):
                with self._lock:
                    self._runaway.append(job)

    @property
    def num_runaway(self) -> int:
        """Compiles refused at their deadline that still run (on a thread: no process to kill)."""
        with self._lock:
            self._runaway = [j for j in self._runaway if not j.thread_done]
            return len(self._runaway)

    def worker_pids(self) -> list[int]:
        """The compile workers' process ids (alive or not yet reaped)."""
        with self._lock:
            return [s.worker.pid for s in self._slots if s.worker is not None and s.worker.pid]

    def close(self) -> None:
        """Kill the workers and end the threads; a compile on a thread runs on to its end."""
        with self._lock:
            self.closed = True
            slots, self._slots, self._idle = self._slots, [], []
            pending, self._pending = list(self._pending), deque()
            for slot in slots:
                slot.job = None
        for job in pending:
            job.future.cancel()
        for slot in slots:
            slot.close()
        for slot in slots if self.use_processes else []:  # and one started meanwhile
            slot.thread.join(2)
            slot.close()

    # ---- internals (slot threads) ----
    def _worker_args(self) -> tuple[Any, ...] | None:
        """What a compile worker needs, or None: compile on the thread."""
        return self.manager.compile_worker_args() if self.use_processes else None

    def _no_processes(self) -> None:
        if self.use_processes:
            self.use_processes = False
            logger.warning(
                "this xgrammar cannot read back a grammar compiled in another process: "
                "structured-outputs constraints compile on threads, and one past "
                "PAGODA_GRAMMAR_COMPILE_TIMEOUT_S keeps its core until it ends"
            )

    def _dispatch(self) -> None:
        """Give pending jobs to idle slots (under the lock): a slot with a warm worker first; a
        new slot (a new worker) only when none is idle."""
        while self._pending and not self.closed:
            if not self._idle and len(self._slots) < self.num_slots:
                slot = _Slot(self, len(self._slots))
                self._slots.append(slot)
                self._idle.append(slot)
            if not self._idle:
                return
            self._idle.sort(key=lambda s: s.worker is None)
            slot = self._idle.pop(0)
            slot.job = job = self._pending.popleft()
            self._running.append(job)
            slot.wake.set()

    def _finished(self, slot: _Slot) -> bool:
        """`slot` is done with its job; False: the pool is closed (the slot ends)."""
        with self._lock:
            if slot.job in self._running:
                self._running.remove(slot.job)
            if self.closed:
                return False
            slot.job = None
            self._idle.append(slot)
            self._dispatch()
            return True

    def _forget(self, job: _Job) -> None:
        with self._lock:
            if self._by_key.get(job.key) is job:
                del self._by_key[job.key]


def _busy(limit_s: float) -> StructuredOutputsBusyError:
    return StructuredOutputsBusyError(
        f"the server's grammar compilers were busy for {limit_s:g} s "
        "(PAGODA_GRAMMAR_COMPILE_TIMEOUT_S) with other structured_outputs constraints: "
        "retry later",
        "grammar_compile_backlog",
    )


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Set the future's outcome unless it has one already; whether it was set here."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True
