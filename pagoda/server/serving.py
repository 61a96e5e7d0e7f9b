"""What the completions and chat handlers share: errors, the model check, building
`SamplingParams` from a request, the prompt's validation (the engine's own `validate_request`:
one rule for the server, `LLM` and `AsyncLLM`), logprob conversion, merging the
output streams of several prompts, collecting them, usage, and the SSE stream's framing.

Every user error becomes an `APIError` (status, message naming the field, param), rendered by
the app as OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.input_processor import (
    PromptValidationError,
    check_prompt_text,
    validate_request,
)
from pagoda.logger import init_logger
from pagoda.outputs import Logprob, RequestOutput
from pagoda.sampling_params import (
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from pagoda.server.preprocess import Preprocessor
from pagoda.server.protocol import ErrorInfo, ErrorResponse, PromptLogprob, UsageInfo
from pagoda.structured_output.backend_xgrammar import check_constraint
from pagoda.tracing import (
    contains_trace_headers,
    extract_trace_headers,
    log_tracing_disabled_warning,
)


class APIError(Exception):
    """A request the server refuses; `param` names the offending field; `headers` go with the
    response (`Retry-After` on a 503)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        return error_response(self.message, self.status, self.param)


def error_response(message: str, status: int, param: str | None = None) -> ErrorResponse:
    # "BadRequestError", "NotFoundError", ... as vLLM names them.
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    err_type = phrase if phrase.endswith("Error") else phrase + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))


def value_error_to_api_error(e: ValueError, fields: set[str]) -> APIError:
    """SamplingParams' messages start with the field name: report it as `param`."""
    msg = str(e)
    first = msg.split(" ", 1)[0].strip(":,")
    return APIError(msg, 400, first if first in fields else None)


@dataclass
class ServingContext:
    """What every handler needs: the engine, the names it answers to (and `model_aliases`,
    accepted but not listed), the context size, and the preprocessor that tokenizes and
    renders chat templates off the event loop."""

    engine: AsyncLLM
    served_model_names: list[str]
    max_model_len: int
    preprocessor: Preprocessor
    chat_template: str | None = None
    model_path: str | None = None
    model_aliases: tuple[str, ...] = ()
    trust_request_chat_template: bool = False
    tool_parser: Any = None  # `tool_parsers.TOOL_PARSERS` entry (--tool-call-parser), or None
    # What a request leaves unset samples with (--generation-config: the model's
    # generation_config.json), under SamplingParams' names; {}: SamplingParams' defaults.
    default_sampling_params: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        tok = self.engine.tokenizer
        return tok.vocab_size if tok is not None else self.engine.model_config.vocab_size

    def require_tokenizer(self, field_name: str) -> None:
        """A server started with --skip-tokenizer-init takes token ids only: text is a 400."""
        if self.tokenizer is None:
            raise APIError(
                f"{field_name}: the server runs without a tokenizer (--skip-tokenizer-init): "
                "send the prompt as a list of token ids to /v1/completions",
                400,
                field_name,
            )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def trace_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        """An HTTP request's trace context (traceparent, tracestate) when the engine traces
        requests (vLLM's `_get_trace_headers`); None otherwise, with a warning once if it
        came with one."""
        if getattr(self.engine, "is_tracing_enabled", False):
            return extract_trace_headers(headers)
        if contains_trace_headers(headers):
            log_tracing_disabled_warning()
        return None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            if model not in self.model_aliases:
                raise APIError(f"The model `{model}` does not exist.", 404, "model")

    async def encode(self, text: str, add_special_tokens: bool, field_name: str) -> list[int]:
        """`text`'s token ids; a failure (too slow, too big) is a 400 naming `field_name`."""
        self.require_tokenizer(field_name)
        try:
            return await self.preprocessor.encode(text, add_special_tokens)
        except ValueError as e:
            raise APIError(f"{field_name}: {e}", 400, field_name) from None

    async def encode_prompt(
        self, text: str, add_special_tokens: bool, field_name: str
    ) -> list[int]:
        """`encode` for a prompt to generate from: one too long for the context by its length
        alone is a 400 at once, not tokenized (`check_prompt_text`, the engine's rule)."""
        self.require_tokenizer(field_name)
        try:
            check_prompt_text(self.tokenizer, text, self.max_model_len)
        except PromptValidationError as e:
            raise APIError(str(e), 400, field_name) from None
        return await self.encode(text, add_special_tokens, field_name)


def build_sampling_params(
    req: Any,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    json_schema: dict[str, Any] | None = None,
    max_tokens_field: str = "max_tokens",
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """SamplingParams for a completion or chat request; range errors name the field (the
    request's `max_tokens_field` for max_tokens). `json_schema` constrains the output instead
    of the request's own structured outputs (a forced tool call, which the request cannot
    combine with them). `defaults` (`ServingContext.default_sampling_params`) fill the
    temperature, top_p, top_k, min_p and repetition_penalty the request leaves unset, as
    vLLM's `to_sampling_params(..., default_sampling_params)`; a max_tokens left unset is
    `validate_prompt`'s."""
    defaults = defaults or {}
    if req.stream and req.prompt_logprobs is not None and req.prompt_logprobs != 0:
        # As vLLM: a stream has no place for them (rather than dropping them unsaid).
        raise APIError(
            "prompt_logprobs are not available when stream is true", 400, "prompt_logprobs"
        )
    if not req.stream and req.stream_options is not None:
        if req.stream_options.model_dump(exclude_unset=True):
            # As vLLM and OpenAI: options of a stream that is not asked for are an error.
            raise APIError(
                "stream_options can only be given when stream is true", 400, "stream_options"
            )
    repetition = req.repetition_detection
    if repetition is not None:
        try:
            repetition = RepetitionDetectionParams.from_dict(repetition)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), 400, "repetition_detection") from None
    kw: dict[str, Any] = dict(
        n=req.n,
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
        temperature=_or(req.temperature, defaults.get("temperature", 1.0)),
        top_p=_or(req.top_p, defaults.get("top_p", 1.0)),
        top_k=_or(req.top_k, defaults.get("top_k", 0)),
        min_p=_or(req.min_p, defaults.get("min_p", 0.0)),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        stream_interval=req.stream_interval,
        logprob_token_ids=req.logprob_token_ids or None,
        repetition_detection=repetition,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=(
            StructuredOutputsParams(json=json_schema)
            if json_schema is not None
            else structured_outputs_from_request(req)
        ),
    )
    fields = set(type(req).model_fields)
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        err = value_error_to_api_error(e, fields | {"max_tokens", "logprobs"})
        if err.param == "max_tokens" != max_tokens_field:
            msg = err.message.replace("max_tokens", max_tokens_field, 1)
            err = APIError(msg, 400, max_tokens_field)
        raise err from None
    except TypeError as e:  # a comparison between wrong types slipped past pydantic
        raise APIError(f"invalid sampling parameter: {e}", 400) from None
    return params


logger = init_logger(__name__)
_REMOVED_GUIDED_FIELDS = frozenset(
    ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")
)


def name_constraint_error(e: APIError, req: Any) -> APIError:
    """An error of the output's constraint, as the grammar compiler words it
    (`structured_outputs.<kind>`), named for the request field that set it."""
    if e.param is not None or "structured_outputs." not in e.message:
        return e
    rf = getattr(req, "response_format", None) or {}
    if rf.get("type") == "json_schema":
        message = e.message.replace("structured_outputs.json", "response_format.json_schema.schema")
        return APIError(message, e.status, "response_format")
    if rf.get("type") == "json_object":
        return APIError(e.message, e.status, "response_format")
    return APIError(e.message, e.status, "structured_outputs")


def structured_outputs_from_request(req: Any) -> StructuredOutputsParams | None:
    """vLLM's rule: `structured_outputs`, with `response_format` (json_object / json_schema)
    overriding its constraint. Malformed ones are 400s naming the field."""
    so = req.structured_outputs
    rf = req.response_format
    removed = sorted(set(req.model_extra or ()) & _REMOVED_GUIDED_FIELDS)
    if removed:
        # vLLM 0.32 ignores them too (with this warning): they were replaced by
        # `structured_outputs`, which is what a client should send.
        logger.warning("ignored %s: use 'structured_outputs' instead", ", ".join(removed))
    override: dict[str, Any] = {}
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            override = {"json_object": True}
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    "response_format of type 'json_schema' needs json_schema.schema, an object",
                    400,
                    "response_format",
                )
            override = {"json": schema}
        elif kind != "text":
            raise APIError(
                f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                400,
                "response_format",
            )
    if so is None and not override:
        return None
    kw = dict(so or {})
    if override:
        for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag"):
            kw.pop(k, None)
        kw.update(override)
    param = "response_format" if override else "structured_outputs"
    try:
        so = StructuredOutputsParams.from_dict(kw)
    except (TypeError, ValueError) as e:
        raise APIError(f"invalid {param}: {e}", 400, param) from None
    # Input processing checks it too, but a request of several prompts is admitted whole
    # before any of them is processed.
    try:
        check_constraint(so)
    except ValueError as e:
        raise name_constraint_error(APIError(str(e), 400), req) from None
    return so


def check_logprob_token_ids(req: Any, logprobs_set: bool, logprobs_hint: str) -> None:
    """vLLM's refusals of `logprob_token_ids` a request cannot use: without `logprobs` set
    (`logprobs_hint`: how the request sets it) and with beam search."""
    if not req.logprob_token_ids:
        return
    if req.use_beam_search:
        raise APIError(
            "`logprob_token_ids` is not supported with beam search.", 400, "logprob_token_ids"
        )
    if not logprobs_set:
        raise APIError(
            f"when using `logprob_token_ids`, `logprobs` must be {logprobs_hint}.",
            400,
            "logprob_token_ids",
        )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def validate_prompt(
    ctx: ServingContext,
    prompt_token_ids: list[int],
    params: SamplingParams,
    prompt_field: str,
    max_tokens_field: str = "max_tokens",
) -> None:
    """The engine's one validation (`validate_request`), with OpenAI's rule that a max_tokens
    past the context is refused rather than cut; resolves `params.max_tokens` (None: the
    generation config's max_new_tokens if any, cut to the rest of the context as vLLM's
    `get_max_tokens`, else the rest of the context). Errors are 400s naming the request's
    field."""
    mc = ctx.engine.model_config
    default_max_tokens = None
    if params.max_tokens is None:
        default_max_tokens = ctx.default_sampling_params.get("max_tokens")
    try:
        params.max_tokens = validate_request(
            prompt_token_ids,
            params,
            ctx.max_model_len,
            mc.vocab_size,
            strict_max_tokens_field=max_tokens_field,
        )
    except PromptValidationError as e:
        param = prompt_field if e.param == "prompt" else e.param
        raise APIError(str(e), 400, param) from None
    if default_max_tokens is not None:
        params.max_tokens = min(params.max_tokens, default_max_tokens)


def prompt_logprobs_json(
    tokenizer: Any, steps: list[dict[int, Logprob] | None]
) -> list[dict[int, PromptLogprob] | None]:
    """A request's `prompt_logprobs` as vLLM returns them: per prompt position, token id ->
    logprob, rank and text, best rank first."""
    return [
        None
        if not step
        else {
            t: PromptLogprob(
                logprob=safe_logprob(p.logprob),
                rank=p.rank,
                decoded_token=token_str(tokenizer, t, p),
            )
            for t, p in ranked_logprobs(step)
        }
        for step in steps
    ]


def token_str(tokenizer: Any, token_id: int, lp: Logprob | None = None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if tokenizer is None:  # --skip-tokenizer-init: vLLM's return_tokens_as_token_ids form
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class ChoiceState:
    """One choice accumulated from DELTA outputs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestState:
    """All DELTA outputs of one request (one prompt), merged."""

    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        if out.prompt_token_ids and not self.prompt_token_ids:
            self.prompt_token_ids = list(out.prompt_token_ids)
        if out.prompt_logprobs:
            self.prompt_logprobs.extend(out.prompt_logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens or 0)
        for c in out.outputs:
            st = self.choices.setdefault(c.index, ChoiceState())
            st.text.append(c.text)
            st.token_ids.extend(c.token_ids)
            if c.logprobs:
                st.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason


async def merge_async_iterators(
    *iterators: AsyncIterator[Any],
) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (index, item); closing this closes them all."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()  # type: ignore[attr-defined]
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await q.put((i, item))
            await q.put((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_output(
    stream: AsyncIterator[tuple[int, Any]],
) -> tuple[int, Any] | None:
    """Wait for a stream's first output before answering, so that refusals (503, 400) still
    get their status code; None when the stream ends at once."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None
    except asyncio.CancelledError:  # the client went away: not an error of ours
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    except BaseException as e:
        await stream.aclose()  # type: ignore[attr-defined]
        raise exception_to_api_error(e) from None


async def collect_outputs(
    stream: AsyncIterator[tuple[int, RequestOutput]], states: list[RequestState]
) -> None:
    """Merge every output of a (non-streaming) request into `states[prompt_index]`."""
    try:
        async for i, out in stream:
            states[i].add(out)
            check_request_error(out)
    except asyncio.CancelledError:  # the client went away: not an error of ours
        raise
    except BaseException as e:
        raise exception_to_api_error(e) from None
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def usage_info(num_prompt_tokens: int, num_generated_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_generated_tokens,
        total_tokens=num_prompt_tokens + num_generated_tokens,
    )


def sse_line(payload: str) -> str:
    return f"data: {payload}\n\n"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(text: str) -> str:
    """`text` with each lone surrogate (what a JSON `\\ud800` escape decodes to, which UTF-8
    cannot hold) written back as that escape: inside a JSON string, the same value."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def model_json(model: Any) -> str:
    """A response model as compact JSON; where a string holds a lone surrogate (a tool call's
    arguments decoded from the model's own escapes, say) UTF-8 cannot hold it, and that
    string goes out escaped instead of failing the response."""
    try:
        return model.model_dump_json()
    except ValueError:  # pydantic's serialization error
        return json.dumps(model.model_dump(mode="json"), separators=(",", ":"))


async def sse_stream(
    stream: AsyncIterator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput] | None,
    chunks: Callable[[int, RequestOutput], Iterable[str]],
    usage_chunk: Callable[[], str] | None = None,
    head: Iterable[str] = (),
) -> AsyncIterator[str]:
    """The SSE lines of a streaming response: `head`, the `chunks` of every (prompt index,
    output), the usage chunk if asked for, then `[DONE]`. An error after the status line went
    out is reported in-band, as an error object in a data line."""
    for line in head:
        yield line
    try:
        if first is not None:
            for line in chunks(*first):
                yield line
            check_request_error(first[1])
        async for i, out in stream:
            for line in chunks(i, out):
                yield line
            check_request_error(out)
        if usage_chunk is not None:
            yield usage_chunk()
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
        yield sse_line(json.dumps(exception_to_api_error(e).to_response().model_dump()))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    yield sse_line("[DONE]")


class RequestFailedError(RuntimeError):
    """The engine finished the request with finish_reason "error" (HTTP 500 for it alone)."""


def check_request_error(out: RequestOutput) -> None:
    """Raise for an output that ended with an error: a 400 when the request caused it (its
    constraint too slow to apply), else a 500."""
    if out.error is not None and out.client_error:
        raise APIError(out.error, 400)
    if out.error is not None:
        raise RequestFailedError(f"the request failed in the engine: {out.error}")


def ranked_logprobs(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """A position's candidate tokens, best rank first."""
    return sorted(step.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))


def exception_to_api_error(e: BaseException) -> APIError:
    """Map what the engine raises to the HTTP status a client should see. A 5xx names what
    failed, never the exception's internals (the server log has them)."""
    from pagoda.engine import exceptions as errors

    if isinstance(e, APIError):
        return e
    if isinstance(e, errors.EngineOverloadedError | errors.RequestQueueTimeoutError):
        return APIError(str(e), 503, headers={"Retry-After": "1"})
    if isinstance(e, errors.EngineRestartingError | errors.StructuredOutputsBusyError):
        return APIError(str(e), 503, headers={"Retry-After": "5"})
    if isinstance(e, errors.EngineDrainingError):
        return APIError(str(e), 503, headers={"Retry-After": "5", "Connection": "close"})
    if isinstance(e, errors.EngineDeadError):
        return APIError(
            "the engine failed while serving this request (the server log has details)", 500
        )
    if isinstance(e, RequestFailedError):
        return APIError(str(e), 500)
    if isinstance(e, ValueError):
        return APIError(str(e), 400, getattr(e, "param", None))
    if isinstance(e, asyncio.CancelledError):  # nobody reads it: the client is gone
        return APIError("the request was cancelled", 499)
    logger.error("internal error", exc_info=e)
    return APIError("internal server error (the server log has details)", 500)


def safe_logprob(x: float) -> float:
    """JSON has no -inf/NaN: clamp as vLLM does."""
    return max(x, -9999.0) if x == x else -9999.0
