"""`DrainingServer`: the uvicorn server of `pagoda serve`, whose first SIGTERM drains the engine
(new requests get 503, in-flight ones finish; after --drain-timeout seconds the rest get an
error, in-band in a stream) before it closes connections; a second SIGTERM or SIGINT exits at
once. An engine that fails for good (no restart left) stops it with `exit_code` 1."""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger("pagoda.server")


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server whose first SIGTERM drains the engine before closing connections."""

    def __init__(self, config: uvicorn.Config, engine: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.exit_code = 0
        engine.fatal_hooks.append(self._engine_failed)

    def _engine_failed(self, error: BaseException) -> None:
        # On the engine's callback thread: exit non-zero, so that a supervisor restarts us.
        logger.error("the engine cannot serve any more (%r): exiting with code 1", error)
        self.exit_code = 1
        self.should_exit = True

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flip flags and schedule work on the loop.
        if sig == signal.SIGTERM and not self.engine.draining and self._loop is not None:
            self.engine.draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        self.engine.draining = True
        if self.should_exit:
            self.force_exit = True  # second signal: stop waiting for connections
        self.should_exit = True

    def _start_drain(self) -> None:
        logger.info("SIGTERM: draining up to %.0f s; new requests get 503", self.drain_timeout)
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        if not await self.engine.drain(self.drain_timeout):
            logger.warning("drain timed out: the requests still running were ended with an error")
        self.should_exit = True
