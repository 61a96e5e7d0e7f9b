"""`CompileWorker`: a process that compiles structured-outputs constraints, so that one taking
xgrammar too long can be killed.

xgrammar cannot be interrupted: a constraint that takes it minutes to compile (a choice of
50,000 strings took 30 s, 2-core AMD EPYC) keeps its thread and a core busy until it returns,
whatever timeout the engine gave it. In a worker process it is killed at the timeout, and the
core is free at once. A worker builds the engine's `TokenizerInfo` once, from the same
arguments (xgrammar checks that it matches when the grammar is read back), then compiles one
constraint at a time and sends each back as xgrammar's JSON (`CompiledGrammar.serialize_json`),
which the engine reads over its own TokenizerInfo (`XgrammarBackend.deserialize`). Bringing a
grammar back costs about half its compile again, on the engine's side mostly off the GIL (a
JSON schema: 7 ms to compile, 3 + 5 ms to write and read; an e-mail regex: 173 ms, 70 + 33 ms;
SmolLM2's 49,152 tokens). Workers are spawned, never forked from a process with threads, and
end with their parent: killed by it, or on their own once it is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.utils.processes import born_ignoring_sigint, children_allowed

_PARENT_POLL_S = 0.5
# A worker imports xgrammar, and with it torch and transformers: 1.8 s on a quiet 2-core AMD
# EPYC, a few times that on a busy one.
STARTUP_TIMEOUT_S = 60.0


class CompileTimeout(Exception):
    """The deadline passed first. `started`: the worker is still compiling, and must be killed;
    else it was still starting (a busy machine), and the compile never began."""

    def __init__(self, started: bool) -> None:
        super().__init__("started" if started else "not started")
        self.started = started


class WorkerGone(Exception):
    """The worker process exited (killed for memory, crashed in xgrammar, ...)."""


class CompileWorker:
    """One spawned worker process. `compile` is called from one thread at a time."""

    def __init__(self, tokenizer_info_args: tuple[Any, ...]) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork after threads (and torch) is unsafe
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main,
            args=(child, tokenizer_info_args, os.getpid()),
            name="pagoda-grammar-compile",
            daemon=True,  # terminated at its parent's exit if nothing else stopped it
        )
        with children_allowed(), born_ignoring_sigint():
            self.process.start()
        child.close()  # the worker's end lives in the worker only: its death reads as EOF
        self.ready = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def compile(self, params: StructuredOutputsParams, deadline: float) -> str:
        """The compiled grammar as xgrammar's JSON. ValueError: the constraint is invalid (the
        worker lives on); CompileTimeout: `deadline` (time.monotonic(), pushed back by the time
        a new worker takes to start) passed first, or the worker did not start within
        STARTUP_TIMEOUT_S; WorkerGone: the worker died."""
        try:
            if not self.ready:
                start = time.monotonic()
                reply = self._recv(start + STARTUP_TIMEOUT_S, started=False)
                if reply != ("ready", None):
                    raise WorkerGone(f"the compile worker did not start: {reply!r}")
                self.ready = True
                deadline += time.monotonic() - start  # the worker's start is not the compile's
            self.conn.send(params)
            status, value = self._recv(deadline, started=True)
        except (OSError, EOFError) as e:
            self.process.join(1)
            raise WorkerGone(
                f"the compile worker exited (code {self.process.exitcode}): {e!r}"
            ) from None
        if status == "error":
            raise ValueError(value)
        return value

    def _recv(self, deadline: float, started: bool) -> Any:
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise CompileTimeout(started)
        return self.conn.recv()

    def kill(self) -> None:
        """Kill the worker, whatever it is doing, and reap it: its core is free on return."""
        self.process.kill()
        self.process.join(5)
        self.conn.close()

    def stop(self) -> None:
        """End an idle worker (its pipe's end of file), killing it if it is busy."""
        self.conn.close()
        self.process.join(0.5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


# ---- the worker process ----
def _worker_main(conn: Any, tokenizer_info_args: tuple[Any, ...], parent_pid: int) -> None:
    # The parent decides when a worker ends (it kills it); a signal sent to the whole process
    # group must not fail the compile of a request still being served during a drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A compile holds the main thread (not the GIL) for as long as it takes: this thread ends
    # the worker once its parent is gone, killed without a chance to kill it first.
    threading.Thread(
        target=_exit_with_parent, args=(parent_pid,), name="pagoda-parent-watch", daemon=True
    ).start()
    from pagoda.structured_output.backend_xgrammar import (
        compile_constraint,
        import_xgrammar,
        make_compiler,
        make_tokenizer_info,
    )

    xgr = import_xgrammar()
    compiler = make_compiler(xgr, make_tokenizer_info(xgr, *tokenizer_info_args))
    del tokenizer_info_args
    conn.send(("ready", None))
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe, or is gone
            return
        try:
            reply = ("ok", compile_constraint(compiler, params).serialize_json())
        except ValueError as e:
            reply = ("error", str(e))
        except Exception as e:  # noqa: BLE001 - reported as the constraint's failure
            reply = ("error", f"the structured_outputs constraint failed to compile: {e!r}")
        conn.send(reply)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)
