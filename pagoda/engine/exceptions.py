"""What the asyncio front end (`AsyncLLM`) raises to a caller: the engine refusing a request
for load or for its state, or failing under it. The server maps each to its HTTP status
(`pagoda.server.serving.exception_to_api_error`).
"""

from pagoda.structured_output.compile_pool import (  # raised by AsyncLLM.generate()
    StructuredOutputsBusyError as StructuredOutputsBusyError,
)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_waiting_requests`): retry later (HTTP 503)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class EngineRestartingError(RuntimeError):
    """The engine core failed and is being restarted: retry shortly (HTTP 503)."""


class RequestQueueTimeoutError(RuntimeError):
    """The request waited longer than `max_queue_delay_s` without being scheduled (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine core died; this request (or every request, once no restart is left) cannot
    be served (HTTP 500)."""
