"""The engine core loop that `AsyncLLM` runs, on a thread or in a child process.

`EngineCoreLoop` owns an `EngineCore` (`pagoda.engine.core`, or anything with its methods): it
takes commands (`AddRequest` with the `EngineCoreRequest`s of one user request, `AbortRequests`,
`ResetPrefixCache`, `Stop`), steps the core while it has work and hands one `CoreReport` per
iteration to whoever listens: the core's plain outputs of the step (token ids, finish reasons,
raw logprobs: no text and no `RequestOutput`, which the front end's output processor makes), the
requests it refused, the ones it aborted or expired (waited longer than `max_queue_delay_s`
without being scheduled), the answers to `ResetPrefixCache`, and the scheduler's state. A
request whose structured-outputs constraint is not compiled yet waits off the core while a worker
process compiles it (`GrammarCompilePool`, at most PAGODA_GRAMMAR_COMPILE_TIMEOUT_S), so one slow
constraint never stalls the others' steps; structured requests are refused for now (503) while
too many constraints given up on as too slow to apply still run (PAGODA_GRAMMAR_MAX_ABANDONED).
Where it runs is the caller's choice: on a thread it reads a queue and calls back directly; in a
child process (`run_engine_core_process`, vLLM's EngineCoreProc) it reads and writes a pipe, so
the HTTP front end's Python (tokenizing, detokenizing) never holds the GIL the core's step needs.
Nothing here imports torch: the child builds the core with the factory it is given.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from pagoda import envs
from pagoda.core.outputs import EngineCoreOutput, EngineCoreRequest
from pagoda.structured_output.compile_pool import GrammarCompilePool, StructuredOutputsBusyError

logger = logging.getLogger(__name__)


# ---- commands (front end -> core) ----
@dataclass
class AddRequest:
    """The one-sample requests of one user request: added, refused or shed together."""

    requests: list[EngineCoreRequest]


@dataclass
class AbortRequests:
    request_ids: list[str]  # the core's (one-sample) request ids


@dataclass
class RefuseRequest:
    """An AddRequest that could not reach the core (a child process: its request did not
    pickle). The core reports it refused, in order with the other commands, as it reports a
    request it refuses itself."""

    request_id: str  # the first sample's id
    num_samples: int
    error: ValueError


@dataclass
class ResetPrefixCache:
    """Forget the core's cached prompt prefixes (`EngineCore.reset_prefix_cache`). The report
    answers it in `prefix_cache_resets` with `call_id` and the result: whether it was done (not
    while a request holds KV blocks), or the exception the core raised."""

    call_id: int


@dataclass
class Stop:
    pass


Command = AddRequest | AbortRequests | RefuseRequest | ResetPrefixCache | Stop


# ---- reports (core -> front end) ----
@dataclass
class CoreReport:
    """What one loop iteration did. Sent after every step, and after commands that need an
    answer (a refused request, an abort) when no step follows. Request ids are the core's."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    first_scheduled: dict[str, float] = field(default_factory=dict)  # id -> first scheduled
    # (the first request id of the refused AddRequest, the error)
    add_errors: list[tuple[str, BaseException]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # ids the core was told to abort
    expired: list[str] = field(default_factory=list)  # ids dropped for waiting too long
    num_adds: int = 0  # requests (samples) of the AddRequest commands consumed
    num_waiting: int = 0  # the core's waiting queue afterwards
    stepped: bool = False
    scheduler_stats: Any = None  # core.last_scheduler_stats after the step
    iteration_stats: Any = None  # the step's IterationStats, as far as the core counts them
    preempted: list[str] = field(default_factory=list)  # ids preempted in the step
    num_preemptions_total: int = 0
    # (a ResetPrefixCache's call_id, True if the cache was reset / False / the error raised)
    prefix_cache_resets: list[tuple[int, bool | BaseException]] = field(default_factory=list)

    @property
    def has_news(self) -> bool:
        return self.stepped or bool(
            self.add_errors
            or self.aborted
            or self.expired
            or self.num_adds
            or self.prefix_cache_resets
        )


@dataclass
class CoreReady:
    """The child's first message: what the front end needs to know about the engine."""

    model_config: Any
    config: Any
    num_blocks: int | None
    tokenizer: Any  # the core's (None with skip_tokenizer_init)


@dataclass
class CoreDead:
    error: BaseException


@dataclass
class CoreStopped:
    pass


class EngineCoreLoop:
    """Steps `core` while it has work; blocks in `get_commands(block=True)` when idle.

    `get_commands(block)` returns the commands that arrived (waiting up to the idle poll when
    `block`); `put_report` receives every `CoreReport`. `run` returns on `Stop` and raises
    whatever the core raised. With `max_queue_delay_s`, requests not yet scheduled that
    arrived longer ago than that are aborted and reported as `expired`."""

    def __init__(
        self,
        core: Any,
        get_commands: Callable[[bool], list[Command]],
        put_report: Callable[[CoreReport], None],
        max_queue_delay_s: float | None = None,
    ) -> None:
        self.core = core
        self._get_commands = get_commands
        self._put_report = put_report
        self.max_queue_delay_s = max_queue_delay_s
        # AddRequests whose structured-outputs constraint is being compiled, off the step loop
        # (`GrammarCompilePool`: a constraint can take minutes to compile, and the steps of
        # every other request go on meanwhile). They count as waiting.
        self._compiling: list[tuple[Future, AddRequest]] = []
        self._compile_pool: GrammarCompilePool | None = None
        # The samples compiling as of the last statistics sent (num_deferred_waiting_reqs).
        self._deferred_reported = 0

    def run(self) -> None:
        try:
            self._run()
        finally:
            if self._compile_pool is not None:  # its worker processes are killed
                self._compile_pool.close()

    def _add(self, cmd: AddRequest, report: CoreReport) -> None:
        report.num_adds += len(cmd.requests)
        manager = getattr(self.core, "structured_output", None)
        params = cmd.requests[0].sampling_params
        if manager is not None and params.structured_outputs is not None:
            busy = self._runaway_error(manager)
            if busy is not None:
                report.add_errors.append((cmd.requests[0].request_id, busy))
                return
        if manager is not None and not manager.compiled(params):
            if self._compile_pool is None:
                self._compile_pool = GrammarCompilePool(manager)
            timeout_s = envs.PAGODA_GRAMMAR_COMPILE_TIMEOUT_S
            self._compiling.append((self._compile_pool.submit(params, timeout_s), cmd))
            return
        try:
            self.core.add_requests(cmd.requests)
        except Exception as e:  # noqa: BLE001 - a refused request must not stop the loop
            report.add_errors.append((cmd.requests[0].request_id, e))

    def _runaway_error(self, manager: Any) -> StructuredOutputsBusyError | None:
        """The error of a structured request arriving while PAGODA_GRAMMAR_MAX_ABANDONED
        computations of constraints given up on as too slow still run (each on a core: they
        cannot be interrupted), or None."""
        running = getattr(manager, "num_abandoned_running", 0)
        if self._compile_pool is not None:
            running += self._compile_pool.num_runaway
        limit = envs.PAGODA_GRAMMAR_MAX_ABANDONED
        if running < limit:
            return None
        return StructuredOutputsBusyError(
            f"the server is busy with {running} structured_outputs constraints given up on as "
            f"too slow (at most {limit}, PAGODA_GRAMMAR_MAX_ABANDONED): retry later",
            "grammar_max_abandoned",
        )

    def _admit_compiled(self, report: CoreReport) -> None:
        """Add the requests whose constraint compiled; refuse those whose failed, ran past
        PAGODA_GRAMMAR_COMPILE_TIMEOUT_S, or found no compile worker free by then."""
        assert self._compile_pool is not None
        self._compile_pool.expire()
        manager, still = self.core.structured_output, []
        for future, cmd in self._compiling:
            if not future.done():
                still.append((future, cmd))
                continue
            first = cmd.requests[0].request_id
            if future.cancelled():  # (only as the pool closes)
                error: BaseException | None = StructuredOutputsBusyError("shutting down")
            else:
                error = future.exception()
            if error is None:
                try:
                    compiled = future.result()
                    if compiled is not None:  # a worker's: cached here as the request is added
                        manager.put_compiled(cmd.requests[0].sampling_params, compiled)
                    self.core.add_requests(cmd.requests)
                except Exception as e:  # noqa: BLE001 - as in _add
                    report.add_errors.append((first, e))
            else:
                report.add_errors.append((first, error))
        self._compiling = still

    def _drop_compiling(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        self._compiling = [
            c for c in self._compiling if not ids.intersection(r.request_id for r in c[1].requests)
        ]

    def _reset_prefix_cache(self) -> bool | BaseException:
        try:
            return bool(self.core.reset_prefix_cache())
        except Exception as e:  # noqa: BLE001 - the caller gets it; the core steps on
            logger.exception("resetting the prefix cache failed")
            return _picklable(e)

    def _run(self) -> None:
        core = self.core
        needs_flush = False
        while True:
            report = CoreReport()
            stop = False
            idle = not core.has_unfinished_requests()
            if idle and self._compiling:  # nothing to step: wait for a compile, not a command
                wait([c[0] for c in self._compiling], timeout=0.02, return_when=FIRST_COMPLETED)
                idle = False
            for cmd in self._get_commands(idle):
                if isinstance(cmd, Stop):
                    stop = True
                    break
                if isinstance(cmd, AddRequest):
                    self._add(cmd, report)
                elif isinstance(cmd, RefuseRequest):
                    report.num_adds += cmd.num_samples
                    report.add_errors.append((cmd.request_id, cmd.error))
                elif isinstance(cmd, AbortRequests):
                    self._drop_compiling(cmd.request_ids)
                    core.abort_requests(list(cmd.request_ids))
                    report.aborted.extend(cmd.request_ids)
                    needs_flush = True
                elif isinstance(cmd, ResetPrefixCache):
                    # After the commands before it: blocks a preceding abort freed count free.
                    report.prefix_cache_resets.append((cmd.call_id, self._reset_prefix_cache()))
            if self._compiling:
                self._admit_compiled(report)
            if self.max_queue_delay_s is not None and core.num_waiting_requests:
                expired = core.abort_expired_waiting(self.max_queue_delay_s, time.time())
                if expired:
                    report.expired.extend(expired)
                    needs_flush = True
            deferred = sum(len(c[1].requests) for c in self._compiling)
            if deferred != self._deferred_reported:
                needs_flush = True  # statistics with the new count, even with nothing to run
            # After aborts one step runs even when nothing is left: it tells the model runner
            # which requests are gone and refreshes the scheduler's statistics.
            if not stop and (core.has_unfinished_requests() or needs_flush):
                needs_flush = False
                result = core.step()
                report.outputs = result.outputs
                report.first_scheduled = result.first_scheduled
                report.iteration_stats = result.iteration_stats
                report.preempted = result.preempted
                report.stepped = True
                report.scheduler_stats = core.last_scheduler_stats
                if report.scheduler_stats is not None:  # they wait too, off the scheduler
                    report.scheduler_stats.num_deferred_waiting_reqs = deferred
                self._deferred_reported = deferred
                report.num_preemptions_total = getattr(core, "num_preemptions_total", 0)
            report.num_waiting = core.num_waiting_requests + deferred
            if report.has_news:
                self._put_report(report)
            if stop:
                return


# ---- the child process ----
def run_engine_core_process(
    conn: Any,
    core_factory: Callable[[], Any],
    idle_poll_s: float,
    max_queue_delay_s: float | None = None,
) -> None:
    """Entry point of the engine core process: build the core, say `CoreReady`, then run the
    loop on `conn` until `Stop` or until the parent is gone (the pipe's end of file)."""
    # The parent decides when the engine stops (after draining on SIGTERM); a signal sent to
    # the whole process group must not kill the engine under in-flight requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        core = core_factory()
        conn.send(
            CoreReady(
                core.model_config,
                getattr(core, "config", None),
                getattr(core, "num_blocks", None),
                getattr(core, "tokenizer", None),
            )
        )
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        from pagoda.cli import user_error_message

        message = user_error_message(e) if isinstance(e, Exception) else None
        if message is None or logger.isEnabledFor(logging.DEBUG):
            logger.exception("the engine core failed to start")
        else:  # the parent prints the one line a user needs
            logger.debug("the engine core failed to start: %s", message)
        _send_quietly(conn, CoreDead(_picklable(e)))
        raise SystemExit(1) from None

    def get_commands(block: bool) -> list[Command]:
        if block and not conn.poll(idle_poll_s):
            return []
        cmds: list[Command] = []
        while conn.poll(0):
            try:
                cmds.extend(conn.recv())
            except EOFError:  # the parent is gone: nobody is listening any more
                cmds.append(Stop())
                break
        return cmds

    try:
        EngineCoreLoop(core, get_commands, conn.send, max_queue_delay_s).run()
    except (BrokenPipeError, ConnectionResetError):
        raise SystemExit(0) from None  # the parent is gone
    except BaseException as e:  # noqa: BLE001 - any engine failure must reach the callers
        logger.exception("the engine core died")
        _send_quietly(conn, CoreDead(_picklable(e)))
        raise SystemExit(1) from None
    _send_quietly(conn, CoreStopped())


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(repr(e))


def _send_quietly(conn: Any, msg: Any) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError):
        pass
