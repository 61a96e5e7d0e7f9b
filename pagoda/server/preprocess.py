"""Tokenizing and chat templating without stalling the event loop, with limits.

A fast tokenizer's `encode` holds the GIL for its whole run, and grows faster than the text
(hundreds of KB take seconds); a chat template is Jinja code that can loop or allocate at
will. Neither may run on the server's event loop past a small size, so `Preprocessor` sends
big inputs, and every request-supplied chat template, to worker processes: a worker's memory
is capped (RLIMIT_AS, `memory_bytes` over what it holds after start-up) and a job that runs
past `timeout_s` gets its worker killed and replaced. Small inputs with the server's own
template (the common case, well under a millisecond) run inline. Failures are `ValueError`s
that the handlers turn into HTTP 400s.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from typing import Any

from pagoda.utils.processes import born_ignoring_sigint

logger = logging.getLogger("pagoda.server")

INLINE_CHARS = 16384  # inputs up to this many characters are handled on the event loop


class PreprocessTimeout(ValueError):
    pass


def _chars(value: Any) -> int:
    """The characters in a JSON-like value (what the work grows with)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 8


def _run_job(tokenizer: Any, job: tuple[str, dict[str, Any]]) -> Any:
    kind, kw = job
    if kind == "encode":
        return list(tokenizer.encode(kw["text"], add_special_tokens=kw["add_special_tokens"]))
    if kind == "decode":
        return tokenizer.decode(kw["ids"], skip_special_tokens=kw["skip_special_tokens"])
    if kind == "chat":
        return tokenizer.apply_chat_template(kw.pop("messages"), tokenize=False, **kw)
    raise ValueError(f"unknown job {kind!r}")


def _worker_main(conn: Any, tokenizer: Any, memory_bytes: int | None) -> None:
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if memory_bytes is not None:
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + memory_bytes, vm + memory_bytes))
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", _run_job(tokenizer, job))
        except MemoryError:
            reply = ("error", "it needs more memory than the server allows for it")
        except Exception as e:  # noqa: BLE001 - the job's error is the caller's answer
            reply = ("error", str(e) or type(e).__name__)
        del job
        conn.send(reply)


class _Worker:
    def __init__(self, ctx: Any, tokenizer: Any, memory_bytes: int | None) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main,
            args=(child, tokenizer, memory_bytes),
            name="pagoda-preprocess",
            daemon=True,
        )
        with born_ignoring_sigint():
            self.process.start()
        child.close()
        self.ready = False

    def call(self, job: Any, timeout: float) -> Any:
        """Run one job (on a thread: blocks until the reply or the timeout)."""
        if not self.ready:  # the first job waits for start-up too (imports, the tokenizer)
            if not self.conn.poll(timeout + 30) or self.conn.recv()[0] != "ready":
                raise RuntimeError("a preprocessing worker did not start")
            self.ready = True
        self.conn.send(job)
        if not self.conn.poll(timeout):
            raise PreprocessTimeout("")
        status, value = self.conn.recv()
        if status == "error":
            raise ValueError(value)
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class Preprocessor:
    """The tokenizer's encode / decode / apply_chat_template, inline for small inputs and in
    `num_workers` worker processes (started on first use) for the rest."""

    def __init__(
        self,
        tokenizer: Any,
        num_workers: int = 1,
        timeout_s: float = 30.0,
        memory_bytes: int | None = 2 << 30,
    ) -> None:
        self.tokenizer, self.timeout_s, self.memory_bytes = tokenizer, timeout_s, memory_bytes
        self.num_workers = max(1, num_workers)
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: asyncio.Queue | None = None
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._retiring: set[asyncio.Task] = set()  # replacements waiting on a cancelled job

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        job = ("encode", {"text": text, "add_special_tokens": add_special_tokens})
        return await self._offload(job, "tokenizing the prompt")

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if len(ids) <= INLINE_CHARS // 4:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        job = ("decode", {"ids": ids, "skip_special_tokens": skip_special_tokens})
        return await self._offload(job, "detokenizing")

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], request_template: bool, **kw: Any
    ) -> str:
        """The rendered prompt; `request_template` marks a template the client sent, which
        always runs in a worker, under its limits."""
        if not request_template and _chars(messages) <= INLINE_CHARS:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        job = ("chat", {"messages": messages, **kw})
        return await self._offload(job, "rendering the chat template")

    async def _offload(self, job: Any, what: str) -> Any:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.num_workers):
                self._idle.put_nowait(self._spawn())
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(None, worker.call, job, self.timeout_s)
        try:
            result = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The client is gone, but a thread still waits on this worker's reply: a worker
            # handed to the next job now would be read by two threads, which then swap (or
            # tear) their replies. Stop the job; a fresh worker joins the pool once that
            # thread has let go of this one's pipe.
            worker.process.kill()
            retiring = loop.create_task(self._replace_after(worker, call))
            self._retiring.add(retiring)
            retiring.add_done_callback(self._retiring.discard)
            raise
        except PreprocessTimeout:
            await self._replace(worker)
            raise PreprocessTimeout(
                f"{what} took longer than {self.timeout_s:g} s (the server's limit)"
            ) from None
        except ValueError as e:
            self._idle.put_nowait(worker)
            raise ValueError(f"{what} failed: {e}") from None
        except (OSError, EOFError, RuntimeError):  # the worker died (killed for memory, ...)
            await self._replace(worker)
            raise ValueError(f"{what} failed: it exceeded the server's limits") from None
        except Exception:  # anything else leaves the worker in a state no one knows
            await self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        return result

    async def _replace(self, worker: _Worker) -> None:
        """Put a fresh worker in the pool in place of `worker`, which no thread uses now, and
        stop `worker` (the pool is whole again before the first await)."""
        assert self._idle is not None
        self._idle.put_nowait(self._spawn())
        await asyncio.get_running_loop().run_in_executor(None, worker.kill)

    async def _replace_after(self, worker: _Worker, call: asyncio.Future) -> None:
        """Replace `worker` once `call`, the thread still using it, has ended."""
        try:
            await call
        except Exception:  # noqa: BLE001 - its caller is gone; the worker is replaced anyway
            pass
        await self._replace(worker)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._ctx, self.tokenizer, self.memory_bytes)
        with self._lock:
            self._workers = [w for w in self._workers if w.process.is_alive()] + [worker]
        return worker

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for w in workers:
            w.kill()
