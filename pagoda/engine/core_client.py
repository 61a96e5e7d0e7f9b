"""How `AsyncLLM` reaches its engine core: on a thread of this process, or in a child process.

Both clients take commands with `send` (from any thread, never blocking) and call back on one
thread of theirs: `on_report(CoreReport)` for each iteration of the core loop, then
`on_stopped(error)` once, last (`error` is None after a requested stop).

`ThreadCore` runs `EngineCoreLoop` on a thread: cheap, and the core object stays reachable
(tests, in-process tools). `ProcessCore` runs it in a spawned child (`run_engine_core_process`)
and talks over a pipe: a sender thread pickles commands (a full pipe never blocks the event
loop), a receiver thread unpickles reports. The HTTP front end then never holds the GIL that
the core's step needs between its kernels, which on a small CPU is most of the serving
overhead. Shutdown stops the child, and a child whose parent died sees the pipe's end of file
and exits: no orphan engine keeps the memory.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.reduction
import queue
import threading
from collections.abc import Callable
from typing import Any

from pagoda.engine.engine_core import (
    AddRequest,
    Command,
    CoreDead,
    CoreReady,
    CoreReport,
    CoreStopped,
    EngineCoreLoop,
    RefuseRequest,
    Stop,
    run_engine_core_process,
)

logger = logging.getLogger(__name__)

OnReport = Callable[[CoreReport], None]
OnStopped = Callable[[BaseException | None], None]


class ThreadCore:
    """The engine core loop on a daemon thread of this process; `engine` is the core."""

    def __init__(
        self,
        engine: Any,
        on_report: OnReport,
        on_stopped: OnStopped,
        idle_poll_s: float,
        max_queue_delay_s: float | None = None,
    ) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._idle_poll_s = idle_poll_s
        self._max_queue_delay_s = max_queue_delay_s
        self._on_report, self._on_stopped = on_report, on_stopped
        self.thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self.thread.start()

    def send(self, cmd: Command) -> None:
        self._inbox.put(cmd)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        self._inbox.put(Stop())
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _get_commands(self, block: bool) -> list[Command]:
        try:
            cmds = [self._inbox.get(timeout=self._idle_poll_s)] if block else []
        except queue.Empty:
            return []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            EngineCoreLoop(
                self.engine, self._get_commands, self._on_report, self._max_queue_delay_s
            ).run()
        except BaseException as e:  # noqa: BLE001 - any engine failure must reach the callers
            logger.exception("engine thread died")
            error = e
        self._on_stopped(error)


def _pickled(obj: Any) -> memoryview:
    """`obj` as `Connection.send` pickles it (the child's `recv` reads it back)."""
    return multiprocessing.reduction.ForkingPickler.dumps(obj)


def _sendable(cmd: Command) -> Command:
    """`cmd`, or for an AddRequest that does not pickle (a value nested past the recursion
    limit, say) the RefuseRequest that makes the core report it refused."""
    try:
        _pickled(cmd)
        return cmd
    except Exception as e:  # noqa: BLE001 - any reason: that request fails, not the sender
        if not isinstance(cmd, AddRequest):
            raise
        logger.warning(
            "request %s could not be sent to the engine core: %r", cmd.requests[0].request_id, e
        )
        return RefuseRequest(
            cmd.requests[0].request_id,
            len(cmd.requests),
            ValueError(f"the request could not be passed to the engine core ({type(e).__name__})"),
        )


class RemoteEngine:
    """What the front end sees of an engine core that lives in its own process: its tokenizer
    and configuration, and the statistics of its last step (what stats hooks read)."""

    def __init__(self, ready: CoreReady) -> None:
        self.tokenizer = ready.tokenizer
        self.model_config = ready.model_config
        self.config = ready.config
        self.num_blocks = ready.num_blocks
        self.last_scheduler_stats: Any = None
        self.last_iteration_stats: Any = None
        self.num_preemptions_total = 0
        self.num_waiting_requests = 0

    def update(self, report: CoreReport) -> None:
        self.num_waiting_requests = report.num_waiting
        if report.stepped:
            self.last_scheduler_stats = report.scheduler_stats
            self.last_iteration_stats = report.iteration_stats
            self.num_preemptions_total = report.num_preemptions_total

    @property
    def kv_cache_usage(self) -> float:
        s = self.last_scheduler_stats
        return s.kv_cache_usage if s is not None else 0.0

    @property
    def num_used_blocks(self) -> int:
        s = self.last_scheduler_stats
        return s.num_used_blocks if s is not None else 0


class EngineCoreStartError(RuntimeError):
    """The engine core process exited before it was ready (its log says why)."""


class ProcessCore:
    """The engine core loop in a spawned child process, the core built there by
    `engine_factory`.

    `engine_factory` must be picklable (a module-level function or a partial of one). The
    constructor returns once the core is ready, with its tokenizer and configs (pickled by the
    child: the front end never imports torch or parses the model file), and re-raises the
    error the core's construction raised."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        on_report: OnReport,
        on_stopped: OnStopped,
        idle_poll_s: float,
        max_queue_delay_s: float | None = None,
    ) -> None:
        self._on_report, self._on_stopped = on_report, on_stopped
        ctx = multiprocessing.get_context("spawn")  # fork after torch and threads is unsafe
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=run_engine_core_process,
            args=(child_conn, engine_factory, idle_poll_s, max_queue_delay_s),
            name="pagoda-engine-core",
            daemon=True,  # terminated at interpreter exit if shutdown() was never called
        )
        self.process.start()
        child_conn.close()  # the child's end lives in the child only: its death reads as EOF
        self._stop_requested = False
        try:
            ready = self._wait_ready()
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt):
                self.process.join(5)  # a child that refused to start exits right after saying so
            self._kill()
            raise
        self.engine = RemoteEngine(ready)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=self._send_loop, name="pagoda-core-send", daemon=True
        )
        self.thread = threading.Thread(target=self._recv_loop, name="pagoda-core-recv", daemon=True)
        self._sender.start()
        self.thread.start()

    def _wait_ready(self) -> CoreReady:
        try:
            msg = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise EngineCoreStartError(
                f"the engine core process exited (code {self.process.exitcode}) before it was "
                "ready; its log above says why"
            ) from None
        if isinstance(msg, CoreDead):
            raise msg.error
        if not isinstance(msg, CoreReady):
            raise EngineCoreStartError(f"unexpected first message from the engine core: {msg!r}")
        return msg

    def send(self, cmd: Command) -> None:
        self._outbox.put(cmd)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        """Stop the child (it finishes the step under way), then reap it; kill if it hangs."""
        self._stop_requested = True
        self._outbox.put(Stop())
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        self.process.join(timeout)
        self._kill()

    def _kill(self) -> None:
        if self.process.is_alive():
            logger.warning("the engine core process did not stop: terminating it")
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def _send_loop(self) -> None:
        # One pickle and one write for all commands queued meanwhile (a burst of requests).
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                data = _pickled(batch)
            except Exception:  # noqa: BLE001 - one bad request must not stop the others
                data = _pickled([_sendable(c) for c in batch])
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):  # the child is gone: the receiver reports it
                return
            if any(isinstance(c, Stop) for c in batch):
                return

    def _recv_loop(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                msg = self._conn.recv()
                if isinstance(msg, CoreReport):
                    self._on_report(msg)
                elif isinstance(msg, CoreDead):
                    error = msg.error
                    break
                elif isinstance(msg, CoreStopped):
                    break
        except (EOFError, OSError) as e:
            if not self._stop_requested:
                self.process.join(1)
                error = RuntimeError(
                    f"the engine core process exited (code {self.process.exitcode}): {e!r}"
                )
        except BaseException as e:  # noqa: BLE001 - a failing callback must still end the streams
            logger.exception("engine core receiver failed")
            error = e
        self._on_stopped(error)
