"""The FastAPI application of the OpenAI-compatible server.

`build_app(engine, ...)` wires the routes (/v1/completions, /v1/chat/completions, /v1/models,
/health, /version, /tokenize, /detokenize, /metrics) to an `AsyncLLM`, maps every error to
OpenAI's error JSON with a 4xx/5xx status, enforces `--api-key` (all routes but /health and
/metrics) and owns a per-app Prometheus registry fed by the engine thread.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.async_llm import AsyncLLM
from pagoda.metrics.prometheus import PrometheusStatLogger
from pagoda.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagoda.server.serving import APIError, ServingContext, exception_to_api_error
from pagoda.server.serving_chat import create_chat_completion, render_chat_prompt
from pagoda.server.serving_completion import create_completion

UNAUTHENTICATED_PATHS = ("/health", "/metrics")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagoda")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0.1.0"


def _error_json(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status)


class APIKeyMiddleware:
    """Pure ASGI (BaseHTTPMiddleware would hide client disconnects from streaming responses)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"] not in UNAUTHENTICATED_PATHS
        ):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(auth, self.expected):
                err = APIError("Unauthorized: pass `Authorization: Bearer <api key>`", 401)
                await _error_json(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _with_cancellation(raw: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it (and so aborting its requests) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nobody reads it: the client is gone
    return task.result()


def _respond(result: Any) -> Response:
    if hasattr(result, "model_dump"):
        return JSONResponse(result.model_dump())
    if isinstance(result, Response):
        return result
    return StreamingResponse(result, media_type="text/event-stream")


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
) -> FastAPI:
    mc = engine.model_config
    names = list(served_model_names or []) or [mc.name]
    ctx = ServingContext(
        engine=engine,
        served_model_names=names,
        max_model_len=mc.max_model_len,
        chat_template=chat_template,
        model_path=getattr(mc, "model", None),
    )
    cache_config = getattr(getattr(engine.engine, "config", None), "cache_config", None)
    stat_logger = PrometheusStatLogger(
        names[0],
        mc.max_model_len,
        cache_config,
        num_gpu_blocks=getattr(engine.engine, "num_blocks", None),
    )
    engine.stats_hooks.append(stat_logger.record)

    app = FastAPI(title="Pagoda OpenAI-compatible server", version=_version())
    app.state.ctx, app.state.engine, app.state.stat_logger = ctx, engine, stat_logger
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_json(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_json(validation_to_api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_json(APIError(str(e.detail), e.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return _error_json(exception_to_api_error(e))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error_json(APIError("the engine has stopped", 500))
        if engine.draining:
            return _error_json(APIError("the server is shutting down", 503))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [
            ModelCard(id=n, root=ctx.model_path, max_model_len=ctx.max_model_len) for n in names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return _respond(await _with_cancellation(raw, create_completion(ctx, req)))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return _respond(await _with_cancellation(raw, create_chat_completion(ctx, req)))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", 400, "prompt")
        if req.messages is not None:
            text = render_chat_prompt(
                ctx, req.messages, req.add_generation_prompt, req.continue_final_message,
                req.chat_template,
            )  # fmt: skip
            add_special = bool(req.add_special_tokens)
        else:
            text = req.prompt
            add_special = req.add_special_tokens is None or req.add_special_tokens
        ids = list(ctx.tokenizer.encode(text, add_special_tokens=add_special))
        strs = list(ctx.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        resp = TokenizeResponse(
            count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
        )
        return JSONResponse(resp.model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < ctx.tokenizer.vocab_size]
        if bad:
            raise APIError(f"tokens has ids outside the vocabulary: {bad[:5]}", 400, "tokens")
        text = ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app


def validation_to_api_error(e: RequestValidationError) -> APIError:
    """The first pydantic error, with the field path in the message and as `param`."""
    errors = e.errors()
    if not errors:
        return APIError("invalid request", 400)
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(f"Malformed JSON body: {ctx.get('error', first.get('msg'))}", 400)
    if not loc:
        return APIError(f"The request body must be a JSON object: {first.get('msg')}", 400)
    path = ".".join(loc)
    msg = f"{path}: {first.get('msg')}"
    if "input" in first and first.get("type") != "missing":
        msg += f" (got {first['input']!r:.100})"
    return APIError(msg, 400, loc[0])
