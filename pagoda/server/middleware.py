"""The server's ASGI middleware, outermost first: errors that escape a route, the API key, the
request-size limit, and the count of requests in progress (/load).

Each is pure ASGI (Starlette's BaseHTTPMiddleware would hide client disconnects from streaming
responses). `ErrorBoundary` answers any exception a route lets through with an OpenAI-style
500 that names no internals (the log gets the traceback, once), so Starlette's own error
middleware, which logs the exception as unhandled and drops the keep-alive connection, never
sees one. `BodySizeLimit` refuses a body over `--max-request-body-bytes` with 413 before the
route reads it: by its Content-Length, or, sent in chunks, as soon as the bytes pass the limit.
`ServerLoad` (--enable-server-load-tracking) counts the generation requests being handled.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

logger = logging.getLogger("pagoda.server")

Scope = dict[str, Any]


async def send_error(
    send: Any, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    """An OpenAI-style error response (see `pagoda.server.serving.error_response`)."""
    from pagoda.server.serving import error_response

    body = json.dumps(error_response(message, status).model_dump()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class ErrorBoundary:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - the boundary: nothing escapes to the client's socket
            logger.exception("internal error on %s %s", scope["method"], scope["path"])
            if not started:
                await send_error(send, 500, "internal server error (the server log has details)")


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _refusal(self) -> str:
        return (
            f"the request body is larger than {self.max_bytes} bytes "
            "(the server's --max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_large = int(length) > self.max_bytes
            except ValueError:
                await send_error(send, 400, "the Content-Length header is not a number")
                return
            if too_large:
                await send_error(send, 413, self._refusal(), {"Connection": "close"})
                return
        # Read the body here, up to the limit, then hand it to the route in one message.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await send_error(send, 413, self._refusal(), {"Connection": "close"})
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    """`receive` that first returns `messages`, then what the client sends next (a
    disconnect, which the streaming routes watch for)."""
    pending = list(messages)

    async def replaying() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replaying


class APIKeyAuth:
    """`Authorization: Bearer <key>` on every route but `open_paths` (the scheme's name is
    case-insensitive, as RFC 9110 says); a refusal is 401 with `WWW-Authenticate: Bearer`."""

    def __init__(self, app: Any, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app, self.expected, self.open_paths = app, api_key.encode(), open_paths

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"] not in self.open_paths
            and not self._authorized(dict(scope["headers"]).get(b"authorization", b""))
        ):
            await send_error(
                send,
                401,
                "Unauthorized: pass `Authorization: Bearer <api key>`",
                {"WWW-Authenticate": 'Bearer realm="pagoda"'},
            )
            return
        await self.app(scope, receive, send)


class LoadCounter:
    """The requests `ServerLoad` counts as in progress: /load's `server_load`."""

    def __init__(self) -> None:
        self.value = 0


class ServerLoad:
    """vLLM's --enable-server-load-tracking: a request to one of `paths` counts in `counter`
    from when it reaches the route (past the API key and the body limit) until its response
    has been sent, a stream's last chunk included, or it failed, or its client left."""

    def __init__(self, app: Any, paths: tuple[str, ...], counter: LoadCounter) -> None:
        self.app, self.paths, self.counter = app, paths, counter

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        self.counter.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.value -= 1
