"""The FastAPI application of the OpenAI-compatible server.

`build_app(engine, ...)` wires the routes (/v1/completions, /v1/chat/completions, /v1/responses
with its GET and cancel, /v1/models, /health, /ping, /load, /version, /tokenize, /detokenize,
/metrics, and with PAGODA_SERVER_DEV_MODE=1 /reset_prefix_cache) to an `AsyncLLM`, maps every
error to OpenAI's error JSON with a 4xx/5xx status (documented as such in /openapi.json), bounds
the request body, enforces `--api-key` (all routes but /health, /ping and /metrics) and owns a
per-app Prometheus registry fed by the engine thread; /dashboard draws /metrics in a browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda import envs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.generation_config import get_diff_sampling_param
from pagoda.metrics.prometheus import PrometheusStatLogger
from pagoda.server.dashboard import BasicAuthForDashboard, dashboard_html
from pagoda.server.middleware import (
    APIKeyAuth,
    BodySizeLimit,
    ErrorBoundary,
    LoadCounter,
    ServerLoad,
)
from pagoda.server.preprocess import Preprocessor
from pagoda.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagoda.server.protocol_responses import ResponsesRequest, ResponsesResponse
from pagoda.server.serving import APIError, ServingContext, exception_to_api_error, model_json
from pagoda.server.serving_chat import create_chat_completion, render_chat_prompt
from pagoda.server.serving_completion import create_completion
from pagoda.server.serving_responses import (
    ResponsesStore,
    cancel_response,
    create_response,
    retrieve_response,
)
from pagoda.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("pagoda.server")

# Responses of up to this many tokens are built on the event loop; larger ones off it.
LOOP_TOKENS = 4096

UNAUTHENTICATED_PATHS = ("/health", "/ping", "/load", "/metrics")  # as vLLM: for balancers
# The requests /load counts (--enable-server-load-tracking): those that run on the engine.
LOAD_TRACKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
# Every status a route may answer besides 200, for the OpenAPI document (clients and fuzzers
# check responses against it).
_ERROR_STATUSES = {
    400: "The request is malformed or a field is out of range (`param` names it)",
    401: "Missing or wrong API key",
    404: "The model named in the request is not served here, or the response id is unknown",
    413: "The request body is larger than --max-request-body-bytes",
    500: "The engine failed while serving the request",
    503: (
        "Overloaded, draining, restarting, or busy with structured-outputs constraints too slow "
        "to compile or apply: retry after the Retry-After header's seconds"
    ),
}
# A 200 of /v1/responses with `stream`: OpenAI's typed server-sent events.
_EVENT_STREAM: dict[int | str, dict[str, Any]] = {
    200: {"description": "The response (JSON), or with stream its events (server-sent events)",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
}  # fmt: skip
# What GET /v1/responses/{id} and its cancel answer besides 200, 500 and 503.
_RESPONSE_ID_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "The response cannot be streamed again or cancelled (no background "
          "responses run here)", "model": ErrorResponse},
    404: {"description": "No stored response has this id", "model": ErrorResponse},
}  # fmt: skip
# /reset_prefix_cache's one status besides those (PAGODA_SERVER_DEV_MODE=1).
_RESET_REFUSED = "Requests still hold KV-cache blocks: the prefix cache was left as it was"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagoda")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0.1.0"


def _error_json(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status,
                        headers=err.headers)  # fmt: skip


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
        # `model_json`: a lone surrogate in a string goes out escaped, not as a 500.
        return Response(model_json(result), media_type="application/json")
    if isinstance(result, Response):
        return result
    return StreamingResponse(result, media_type="text/event-stream")


def default_served_model_name(model: str) -> str:
    """The name a model is served under unless --served-model-name says otherwise: what the
    user typed, but for an absolute path its last part (a .gguf file's stem), so that the
    unauthenticated /metrics and the API do not show the server's file system."""
    if not os.path.isabs(model):
        return model
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    *,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    trust_request_chat_template: bool = False,
    preprocessor: Preprocessor | None = None,
    tool_call_parser: str | None = None,
    generation_config: str = "auto",
    enable_server_load_tracking: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine`; `generation_config` is --generation-config
    (the defaults of the sampling fields a request leaves unset); with
    `enable_server_load_tracking` /load counts the requests in progress (else it answers 0)."""
    mc = engine.model_config
    model_path = getattr(mc, "model", None)
    default_sampling_params = (
        get_diff_sampling_param(model_path, generation_config) if model_path else {}
    )
    names = list(served_model_names or []) or [default_served_model_name(mc.name)]
    ctx = ServingContext(
        engine=engine,
        served_model_names=names,
        max_model_len=mc.max_model_len,
        preprocessor=preprocessor or Preprocessor(engine.tokenizer),
        chat_template=chat_template,
        model_path=model_path,
        model_aliases=(mc.name,),
        trust_request_chat_template=trust_request_chat_template,
        tool_parser=TOOL_PARSERS[tool_call_parser]() if tool_call_parser else None,
        default_sampling_params=default_sampling_params,
    )
    cache_config = getattr(getattr(engine.engine, "config", None), "cache_config", None)
    stat_logger = PrometheusStatLogger(
        names[0],
        mc.max_model_len,
        cache_config,
        num_gpu_blocks=getattr(engine.engine, "num_blocks", None),
    )
    tracer = getattr(engine, "tracer", None)
    if tracer is not None:  # its spans name the model as the API does
        tracer.model_name = names[0]
    engine.stats_hooks.append(stat_logger.record)
    engine.restart_hooks.append(stat_logger.engine_restarts.inc)
    engine.rejection_hooks.append(stat_logger.record_admission_rejection)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        yield
        ctx.preprocessor.close()

    app = FastAPI(title="Pagoda OpenAI-compatible server", version=_version(), lifespan=lifespan)
    app.state.ctx, app.state.engine, app.state.stat_logger = ctx, engine, stat_logger
    app.state.server_load = server_load = LoadCounter()
    app.state.responses_store = responses_store = ResponsesStore(envs.PAGODA_RESPONSES_STORE_SIZE)
    # Innermost first: the load count (of requests that passed the others), the body limit,
    # then the key (no body is read for a wrong key), then the boundary that turns any escaped
    # exception into a 500.
    if enable_server_load_tracking:
        app.add_middleware(ServerLoad, paths=LOAD_TRACKED_PATHS, counter=server_load)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyAuth, api_key=api_key, open_paths=UNAUTHENTICATED_PATHS)
        app.add_middleware(BasicAuthForDashboard)  # a browser's way to send the key
    app.add_middleware(ErrorBoundary)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_json(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_json(validation_to_api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # 405 carries its Allow header; 404 for unknown paths.
        return _error_json(APIError(str(e.detail), e.status_code, headers=e.headers))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 while serving; 503 while draining or restarting the engine core; 500 once the
        engine has stopped for good (the server then exits)."""
        if engine.state == "restarting":
            body, status = {"status": "restarting", "restarts": engine.num_restarts}, 503
        elif not engine.is_running:
            body, status = {"status": "dead", "restarts": engine.num_restarts}, 500
        elif engine.draining:
            body, status = {"status": "draining"}, 503
        else:
            body, status = {"status": "ok", "restarts": engine.num_restarts}, 200
        headers = {"Retry-After": "5"} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/ping")
    @app.post("/ping")  # (two routes: one operation id each in /openapi.json)
    async def ping() -> Response:
        """SageMaker's health check (vLLM's /ping): /health's answer."""
        return await health()

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the requests to /v1/completions, /v1/chat/completions and /v1/responses
        being handled now, counted with --enable-server-load-tracking (without it, 0)."""
        return {"server_load": server_load.value}

    if envs.PAGODA_SERVER_DEV_MODE:
        logger.warning(
            "PAGODA_SERVER_DEV_MODE=1: serving POST /reset_prefix_cache (not for production)"
        )

        @app.post(
            "/reset_prefix_cache",
            response_class=Response,
            responses={409: {"description": _RESET_REFUSED, "model": ErrorResponse}},
        )
        async def reset_prefix_cache() -> Response:
            """vLLM's development route (PAGODA_SERVER_DEV_MODE=1): forget every cached prompt
            prefix of the engine (as `LLM.reset_prefix_cache`); 200 once done."""
            try:
                done = await engine.reset_prefix_cache()
            except Exception as e:  # noqa: BLE001 - the engine's state errors: 503, 500
                raise exception_to_api_error(e) from None
            if not done:
                raise APIError(
                    "the prefix cache was not reset: running requests hold KV-cache blocks; "
                    "retry once they have finished",
                    409,
                )
            return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        """The /metrics panels drawn live in the browser (`pagoda.server.dashboard`)."""
        return Response(dashboard_html(), media_type="text/html; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=n, root=n, max_model_len=ctx.max_model_len) for n in names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        work = create_completion(ctx, req, ctx.trace_headers(raw.headers))
        return _respond(await _with_cancellation(raw, work))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        work = create_chat_completion(ctx, req, ctx.trace_headers(raw.headers))
        return _respond(await _with_cancellation(raw, work))

    @app.post("/v1/responses", responses=_EVENT_STREAM)
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API for text (`pagoda.server.serving_responses`)."""
        work = create_response(ctx, responses_store, req, ctx.trace_headers(raw.headers))
        return _respond(await _with_cancellation(raw, work))

    @app.get("/v1/responses/{response_id}", responses=_RESPONSE_ID_ERRORS)
    async def get_response(response_id: str, stream: bool = False) -> ResponsesResponse:
        """A stored response (`store` true, among the last PAGODA_RESPONSES_STORE_SIZE)."""
        if stream:
            raise APIError("stream: only background responses stream again; none run here",
                           400, "stream")  # fmt: skip
        return retrieve_response(responses_store, response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=_RESPONSE_ID_ERRORS)
    async def cancel(response_id: str) -> ResponsesResponse:
        """vLLM's: only background responses can be cancelled, and none run here: 404 for an
        unknown id, else 400."""
        return cancel_response(responses_store, response_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        ctx.check_model(req.model)
        ctx.require_tokenizer("prompt" if req.prompt is not None else "messages")
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", 400, "prompt")
        if req.messages is not None:
            text = await render_chat_prompt(
                ctx, req.messages, req.add_generation_prompt, req.continue_final_message,
                req.chat_template,
            )  # fmt: skip
            add_special, field_name = bool(req.add_special_tokens), "messages"
        else:
            text, field_name = req.prompt, "prompt"
            add_special = req.add_special_tokens is None or req.add_special_tokens
        ids = await ctx.encode(text, add_special, field_name)

        def respond() -> JSONResponse:
            strs = list(ctx.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
            resp = TokenizeResponse(
                count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
            )
            return JSONResponse(resp.model_dump(exclude_none=True))

        # A prompt of up to the body limit (~1M tokens) takes over a second to turn into token
        # strings and JSON: a worker thread does it, so the event loop keeps serving streams.
        return respond() if len(ids) <= LOOP_TOKENS else await asyncio.to_thread(respond)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(req.model)
        ctx.require_tokenizer("tokens")
        bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise APIError(f"tokens has ids outside the vocabulary: {bad[:5]}", 400, "tokens")
        text = await ctx.preprocessor.decode(req.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the statuses this server sends: its validation errors are 400
    with OpenAI's error object (FastAPI documents 422), and every error status listed."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ErrorResponse.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    for name, sub in components["ErrorResponse"].pop("$defs", {}).items():
        components.setdefault(name, sub)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            statuses = _ERROR_STATUSES if op.get("requestBody") else {500: "", 503: ""}
            if path in UNAUTHENTICATED_PATHS:
                statuses = {k: v for k, v in _ERROR_STATUSES.items() if k in (500, 503)}
            for status in statuses:
                responses[str(status)] = {
                    "description": _ERROR_STATUSES[status],
                    "content": error,
                }
    app.openapi_schema = schema
    return schema


def validation_to_api_error(e: RequestValidationError) -> APIError:
    """The first pydantic error, with the field path in the message and as `param`."""
    errors = e.errors()
    if not errors:
        return APIError("invalid request", 400)
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") in ("lone_surrogate", "too_deep"):
        where = str((first.get("ctx") or {}).get("where", ""))
        return APIError(first["msg"], 400, where.split(".")[0].split("[")[0] or None)
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
