"""The engine core loop that `AsyncLLM` runs, on a thread or in a child process.

`EngineCoreLoop` owns an engine (`LLMEngine` or anything with its methods): it takes commands
(`AddRequest`, `AbortRequests`, `Stop`), steps the engine while it has work and hands one
`CoreReport` per iteration to whoever listens: the outputs of the step, the requests it
refused, the ones it aborted or expired (waited longer than `max_queue_delay_s` without being
scheduled), and the scheduler's state. Where it runs is the caller's choice:
on a thread it reads a queue and calls back directly; in a child process
(`run_engine_core_process`, vLLM's EngineCoreProc) it reads and writes a pipe, so the HTTP
front end's Python never holds the GIL the engine's step needs. Nothing here imports torch:
the child builds the engine with the factory it is given.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ---- commands (front end -> core) ----
@dataclass
class AddRequest:
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Stop:
    pass


Command = AddRequest | AbortRequests | Stop


# ---- reports (core -> front end) ----
@dataclass
class CoreReport:
    """What one loop iteration did. Sent after every step, and after commands that need an
    answer (a refused request, an abort) when no step follows."""

    outputs: list[RequestOutput] = field(default_factory=list)
    add_errors: list[tuple[str, BaseException]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # ids the core was told to abort
    expired: list[str] = field(default_factory=list)  # ids dropped for waiting too long
    num_adds: int = 0  # samples (n of each) of the AddRequest commands consumed
    num_waiting: int = 0  # the engine's waiting queue afterwards
    stepped: bool = False
    scheduler_stats: Any = None  # engine.last_scheduler_stats after the step
    iteration_stats: Any = None  # engine.last_iteration_stats after the step
    num_preemptions_total: int = 0

    @property
    def has_news(self) -> bool:
        return self.stepped or bool(
            self.add_errors or self.aborted or self.expired or self.num_adds
        )


@dataclass
class CoreReady:
    """The child's first message: what the front end needs to know about the engine."""

    model_config: Any
    config: Any
    num_blocks: int | None
    tokenizer: Any  # the engine's (None with skip_tokenizer_init)


@dataclass
class CoreDead:
    error: BaseException


@dataclass
class CoreStopped:
    pass


class EngineCoreLoop:
    """Steps `engine` while it has work; blocks in `get_commands(block=True)` when idle.

    `get_commands(block)` returns the commands that arrived (waiting up to the idle poll when
    `block`); `put_report` receives every `CoreReport`. `run` returns on `Stop` and raises
    whatever the engine raised. With `max_queue_delay_s`, requests not yet scheduled that
    arrived longer ago than that are aborted and reported as `expired`."""

    def __init__(
        self,
        engine: Any,
        get_commands: Callable[[bool], list[Command]],
        put_report: Callable[[CoreReport], None],
        max_queue_delay_s: float | None = None,
    ) -> None:
        self.engine = engine
        self._get_commands = get_commands
        self._put_report = put_report
        self.max_queue_delay_s = max_queue_delay_s

    def run(self) -> None:
        engine = self.engine
        needs_flush = False
        while True:
            report = CoreReport()
            stop = False
            for cmd in self._get_commands(not engine.has_unfinished_requests()):
                if isinstance(cmd, Stop):
                    stop = True
                    break
                if isinstance(cmd, AddRequest):
                    report.num_adds += cmd.params.n
                    try:
                        engine.add_request(
                            cmd.request_id,
                            cmd.prompt,
                            cmd.params,
                            arrival_time=cmd.arrival_time,
                            priority=cmd.priority,
                        )
                    except Exception as e:  # noqa: BLE001 - a refused request must not stop the loop
                        report.add_errors.append((cmd.request_id, e))
                elif isinstance(cmd, AbortRequests):
                    engine.abort_request(list(cmd.request_ids))
                    report.aborted.extend(cmd.request_ids)
                    needs_flush = True
            if self.max_queue_delay_s is not None and engine.num_waiting_requests:
                expired = engine.abort_expired_waiting(self.max_queue_delay_s, time.time())
                if expired:
                    report.expired.extend(expired)
                    needs_flush = True
            # After aborts one step runs even when nothing is left: it tells the model runner
            # which requests are gone and refreshes the scheduler's statistics.
            if not stop and (engine.has_unfinished_requests() or needs_flush):
                needs_flush = False
                report.outputs = engine.step()
                report.stepped = True
                report.scheduler_stats = engine.last_scheduler_stats
                report.iteration_stats = engine.last_iteration_stats
                report.num_preemptions_total = getattr(engine, "num_preemptions_total", 0)
            report.num_waiting = engine.num_waiting_requests
            if report.has_news:
                self._put_report(report)
            if stop:
                return


# ---- the pipe between the processes ----
class PromptElider:
    """Sending side: a request's prompt (text and token ids) travels with its first output
    only. Streaming outputs (DELTA) are one per request and step, and re-sending every prompt
    each step made the prompts most of a step's report: at 256 running requests of ~230 prompt
    tokens, 5.6x the bytes and ~3x the pickling time of the rest, on the engine core's thread."""

    def __init__(self) -> None:
        self._sent: set[str] = set()

    def __call__(self, report: CoreReport) -> CoreReport:
        sent = self._sent
        for out in report.outputs:
            rid = out.request_id
            if rid in sent:
                out.prompt, out.prompt_token_ids = None, None
            if out.finished:
                sent.discard(rid)
            else:
                sent.add(rid)
        for rid in (*report.aborted, *report.expired):
            sent.discard(rid)
        return report


class PromptRestorer:
    """Receiving side of `PromptElider`: puts each request's prompt back on its later outputs."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[Any, list[int]]] = {}

    def __call__(self, report: CoreReport) -> CoreReport:
        prompts = self._prompts
        for out in report.outputs:
            rid = out.request_id
            if out.prompt_token_ids is None and rid in prompts:
                out.prompt, out.prompt_token_ids = prompts[rid]
            elif not out.finished:
                prompts[rid] = (out.prompt, out.prompt_token_ids)
            if out.finished:
                prompts.pop(rid, None)
        for rid in (*report.aborted, *report.expired):
            prompts.pop(rid, None)
        return report


# ---- the child process ----
def run_engine_core_process(
    conn: Any,
    engine_factory: Callable[[], Any],
    idle_poll_s: float,
    max_queue_delay_s: float | None = None,
) -> None:
    """Entry point of the engine core process: build the engine, say `CoreReady`, then run the
    loop on `conn` until `Stop` or until the parent is gone (the pipe's end of file)."""
    # The parent decides when the engine stops (after draining on SIGTERM); a signal sent to
    # the whole process group must not kill the engine under in-flight requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = engine_factory()
        conn.send(
            CoreReady(
                engine.model_config,
                getattr(engine, "config", None),
                getattr(engine, "num_blocks", None),
                getattr(engine, "tokenizer", None),
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
        elide = PromptElider()
        EngineCoreLoop(engine, get_commands, lambda r: conn.send(elide(r)), max_queue_delay_s).run()
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
