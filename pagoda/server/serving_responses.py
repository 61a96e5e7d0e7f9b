"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it for text models), GET
/v1/responses/{id} and POST /v1/responses/{id}/cancel.

A Responses request is served as the chat request it amounts to: `instructions` as a system
message, the conversation of `previous_response_id` (its input and output), then `input` as
messages, through the chat path's template, sampling parameters, validation and engine call.
`text.format` becomes chat's `response_format`. The output is one assistant message of one
`output_text` part; a stream is OpenAI's typed SSE events, each numbered by `sequence_number`.
Finished responses with `store` (the default) are kept in memory, the last
PAGODA_RESPONSES_STORE_SIZE of them. Not served (a 400 naming the field): tools, background
mode, `truncation: "auto"`, prompt templates, conversations, and inputs other than text.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.server.protocol import ChatCompletionRequest, random_uuid
from pagoda.server.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTextLogprob,
    ResponseError,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from pagoda.server.responses_input import (
    LOGPROBS_INCLUDE,
    chat_request,
    input_messages,
    named_for_responses,
    refuse_unserved,
)
from pagoda.server.serving import (
    APIError,
    RequestState,
    ServingContext,
    build_sampling_params,
    check_request_error,
    collect_outputs,
    escape_surrogates,
    exception_to_api_error,
    first_output,
    merge_async_iterators,
    name_constraint_error,
    validate_prompt,
)
from pagoda.server.serving_chat import chat_logprobs, render_chat_prompt


@dataclass
class StoredResponse:
    response: ResponsesResponse
    # The conversation so far, without instructions (OpenAI does not carry them over): the
    # messages the response answered, then its output as the assistant's turn.
    conversation: list[dict[str, str]]


class ResponsesStore:
    """The last `max_size` stored responses, by id; the oldest is dropped first. Used from the
    event loop only."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: ResponsesResponse, conversation: list[dict[str, str]]) -> None:
        if self.max_size == 0:
            return
        self._items[response.id] = StoredResponse(response, conversation)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def __len__(self) -> int:
        return len(self._items)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", 404, param)


@dataclass
class _Run:
    """One request under way: what its response echoes and how it is finished and stored."""

    ctx: ServingContext
    store: ResponsesStore
    req: ResponsesRequest
    chat_req: ChatCompletionRequest
    params: SamplingParams
    response_id: str
    created_at: int
    conversation: list[dict[str, str]]
    num_prompt_tokens: int
    top_logprobs: int | None  # None: no logprobs asked for

    def response(
        self, status: str, output: list[ResponseOutputMessage], **kw: Any
    ) -> ResponsesResponse:
        req, params = self.req, self.params
        return ResponsesResponse(
            id=self.response_id,
            created_at=self.created_at,
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            instructions=req.instructions,
            max_output_tokens=params.max_tokens,
            max_tool_calls=req.max_tool_calls,
            metadata=req.metadata,
            model=self.ctx.model_name,
            output=output,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning,
            service_tier=req.service_tier,
            temperature=params.temperature,
            text=req.text or {"format": {"type": "text"}},
            tool_choice=req.tool_choice,
            tools=req.tools,
            top_logprobs=req.top_logprobs or 0,
            top_p=params.top_p,
            truncation=req.truncation,
            user=req.user,
            **kw,
        )

    def logprobs(self, token_ids: list[int], steps: list[Any]) -> list[OutputTextLogprob]:
        if self.top_logprobs is None:
            return []
        lps = chat_logprobs(self.ctx.tokenizer, token_ids, steps, self.top_logprobs).content
        return [OutputTextLogprob(**lp.model_dump()) for lp in lps or []]

    def finish(self, state: RequestState, message_id: str) -> ResponsesResponse:
        """The finished response (stored if asked for)."""
        c = state.choices.get(0)
        text = "".join(c.text) if c else ""
        token_ids = c.token_ids if c else []
        status = "incomplete" if c is not None and c.finish_reason == "length" else "completed"
        logprobs = self.logprobs(token_ids, c.logprobs if c else [])
        part = ResponseOutputText(text=text, logprobs=logprobs)
        message = ResponseOutputMessage(id=message_id, status=status, content=[part])
        usage = ResponseUsage(
            input_tokens=self.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=state.num_cached_tokens),
            output_tokens=len(token_ids),
            total_tokens=self.num_prompt_tokens + len(token_ids),
        )
        response = self.response(status, [message], usage=usage)
        if self.req.store:
            turn = {"role": "assistant", "content": text}
            self.store.put(response, [*self.conversation, turn])
        return response

    def failed(self, err: APIError) -> ResponsesResponse:
        code = "server_error" if err.status >= 500 else "invalid_prompt"
        return self.response("failed", [], error=ResponseError(code=code, message=err.message))


async def create_response(
    ctx: ServingContext,
    store: ResponsesStore,
    req: ResponsesRequest,
    trace_headers: Mapping[str, str] | None = None,
) -> Any:
    """Returns a ResponsesResponse, or an async iterator of SSE events when streaming."""
    ctx.check_model(req.model)
    refuse_unserved(req)
    history: list[dict[str, str]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = previous.conversation
    conversation = [*history, *input_messages(req.input)]
    chat_req = chat_request(req, conversation)
    top_logprobs = (req.top_logprobs or 0) if LOGPROBS_INCLUDE in (req.include or ()) else None
    try:
        params = build_sampling_params(
            chat_req, req.max_output_tokens, top_logprobs, None, None, "max_output_tokens",
            ctx.default_sampling_params,
        )  # fmt: skip
        ctx.require_tokenizer("input")
        prompt = await render_chat_prompt(ctx, chat_req.messages)
        prompt_ids = await ctx.encode_prompt(prompt, False, "input")
        validate_prompt(ctx, prompt_ids, params, "input", "max_output_tokens")
    except APIError as e:
        raise named_for_responses(e) from None
    response_id = f"resp_{random_uuid()}"
    run = _Run(ctx, store, req, chat_req, params, response_id, int(time.time()), conversation,
               len(prompt_ids), top_logprobs)  # fmt: skip
    generator = ctx.engine.generate(
        prompt_ids, params, response_id, req.priority, trace_headers=trace_headers
    )
    stream = merge_async_iterators(generator)
    message_id = f"msg_{random_uuid()}"
    if req.stream:
        try:
            first = await first_output(stream)
        except APIError as e:
            raise named_for_responses(name_constraint_error(e, chat_req)) from None
        return _events(run, stream, first, message_id)
    state = RequestState()
    try:
        await collect_outputs(stream, [state])
    except APIError as e:
        raise named_for_responses(name_constraint_error(e, chat_req)) from None
    return run.finish(state, message_id)


class _EventWriter:
    """OpenAI's SSE framing of Responses events: an `event:` line naming the type, then the
    event as JSON in a `data:` line; `sequence_number` counts from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {escape_surrogates(data)}\n\n"


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json")


async def _events(
    run: _Run,
    stream: AsyncIterator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput] | None,
    item_id: str,
) -> AsyncIterator[str]:
    """created, in_progress, the message's output_item.added and content_part.added, one
    output_text.delta per engine output with text, then output_text.done, content_part.done,
    output_item.done and response.completed (response.incomplete when cut by
    max_output_tokens). A failure after the status line went out is an `error` event, then
    response.failed."""
    ev = _EventWriter()
    at = {"item_id": item_id, "output_index": 0, "content_index": 0}
    state = RequestState()

    def deltas(out: RequestOutput) -> list[str]:
        state.add(out)
        check_request_error(out)
        events = []
        for c in out.outputs:
            if c.text or (run.top_logprobs is not None and c.token_ids):
                lps = [_dump(lp) for lp in run.logprobs(list(c.token_ids), list(c.logprobs or []))]
                events.append(ev("response.output_text.delta", **at, delta=c.text, logprobs=lps))
        return events

    try:
        head = _dump(run.response("in_progress", []))
        yield ev("response.created", response=head)
        yield ev("response.in_progress", response=head)
        item = ResponseOutputMessage(id=item_id, status="in_progress")
        yield ev("response.output_item.added", output_index=0, item=_dump(item))
        yield ev("response.content_part.added", **at, part=_dump(ResponseOutputText(text="")))
        try:
            for line in deltas(first[1]) if first is not None else ():
                yield line
            async for _, out in stream:
                for line in deltas(out):
                    yield line
            response = run.finish(state, item_id)
        except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
            err = exception_to_api_error(e)
            err = named_for_responses(name_constraint_error(err, run.chat_req))
            failed = run.failed(err)
            yield ev("error", code=failed.error.code, message=err.message, param=err.param)
            yield ev("response.failed", response=_dump(failed))
            return
        message = response.output[0]
        part = message.content[0]
        yield ev("response.output_text.done", **at, text=part.text,
                 logprobs=[_dump(lp) for lp in part.logprobs])  # fmt: skip
        yield ev("response.content_part.done", **at, part=_dump(part))
        yield ev("response.output_item.done", output_index=0, item=_dump(message))
        done = "response.completed" if response.status == "completed" else "response.incomplete"
        yield ev(done, response=_dump(response))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def retrieve_response(store: ResponsesStore, response_id: str) -> ResponsesResponse:
    stored = store.get(response_id)
    if stored is None:
        raise not_found(response_id, "response_id")
    return stored.response


def cancel_response(store: ResponsesStore, response_id: str) -> ResponsesResponse:
    """vLLM's rule: only a background response can be cancelled, and none is served here, so a
    stored response (finished) is a 400 and an unknown one a 404."""
    retrieve_response(store, response_id)
    raise APIError(
        "Cannot cancel a synchronous response: only background responses can be cancelled, "
        "and this server runs none",
        400,
        "response_id",
    )
