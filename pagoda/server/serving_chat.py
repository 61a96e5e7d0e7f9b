"""POST /v1/chat/completions: the model's chat template (or --chat-template) turns the messages
into a prompt; n samples, SSE streaming (role chunk, content deltas, finish chunk, optional
usage chunk), logprobs in the chat format (`logprobs: true, top_logprobs: k`), tool calls
(forced by `tool_choice`: `pagoda.server.tool_choice`; read out of the text with
--tool-call-parser: `pagoda.server.tool_parsers`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pagoda.entrypoints.chat_utils import normalize_messages
from pagoda.outputs import Logprob
from pagoda.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatTopLogprob,
    DeltaMessage,
    random_uuid,
)
from pagoda.server.required_calls import RequiredCallsStream, calls_read_so_far
from pagoda.server.serving import (
    APIError,
    RequestState,
    ServingContext,
    build_sampling_params,
    check_logprob_token_ids,
    collect_outputs,
    first_output,
    merge_async_iterators,
    model_json,
    name_constraint_error,
    prompt_logprobs_json,
    ranked_logprobs,
    safe_logprob,
    sse_line,
    sse_stream,
    token_str,
    usage_info,
    validate_prompt,
)
from pagoda.server.tool_choice import (
    ToolChoice,
    resolve_tool_choice,
    tool_call_id,
    tool_calls_from_text,
)
from pagoda.server.tool_parsers import StreamingToolCalls


def _flatten_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`normalize_messages`, its errors 400s naming `messages`."""
    try:
        return normalize_messages(messages)
    except ValueError as e:
        raise APIError(str(e), 400, "messages") from None


async def render_chat_prompt(
    ctx: ServingContext,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text the chat template makes of `messages` (errors name `messages`). A
    template sent with the request is refused unless the server trusts them
    (--trust-request-chat-template); then it renders in a worker process, under limits."""
    if not messages:
        raise APIError("messages must not be empty", 400, "messages")
    if chat_template is not None and not ctx.trust_request_chat_template:
        raise APIError(
            "chat_template: this server does not run chat templates sent with a request "
            "(its operator can allow them with --trust-request-chat-template)",
            400,
            "chat_template",
        )
    kw = dict(chat_template_kwargs or {})
    # As vLLM: these arguments given in chat_template_kwargs win over the request's fields.
    add_generation_prompt = kw.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = kw.pop("continue_final_message", continue_final_message)
    tools = kw.pop("tools", tools)
    reserved = sorted(set(kw) & {"messages", "tokenize", "chat_template", "request_template"})
    if reserved:
        raise APIError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", 400, "chat_template_kwargs"
        )
    if continue_final_message:
        kw["continue_final_message"] = True
        add_generation_prompt = False
    try:
        return await ctx.preprocessor.apply_chat_template(
            _flatten_content(messages),
            request_template=chat_template is not None,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template or ctx.chat_template,
            tools=tools,
            **kw,
        )
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors (jinja) are the user's messages
        raise APIError(f"messages could not be rendered by the chat template: {e}", 400,
                       "messages") from None  # fmt: skip


def chat_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    step_logprobs: list[dict[int, Logprob]],
    top_k: int | None,
) -> ChatCompletionLogProbs:
    """`top_k` candidates a position, best first; None: every one the engine returned, in its
    order (the sampled token, then the request's logprob_token_ids, as vLLM)."""
    content = []
    for i, tid in enumerate(token_ids):
        step = step_logprobs[i] if i < len(step_logprobs) and step_logprobs[i] else {}
        lp = step.get(tid)
        tok = token_str(tokenizer, tid, lp)
        top = []
        candidates = list(step.items()) if top_k is None else ranked_logprobs(step)[:top_k]
        for t, p in candidates:
            s = token_str(tokenizer, t, p)
            top.append(
                ChatTopLogprob(token=s, logprob=safe_logprob(p.logprob), bytes=list(s.encode()))
            )
        content.append(
            ChatCompletionLogProb(
                token=tok,
                logprob=safe_logprob(lp.logprob) if lp is not None else -9999.0,
                bytes=list(tok.encode()),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogProbs(content=content)


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, trace_headers: Mapping[str, str] | None = None
) -> Any:
    """Returns a ChatCompletionResponse, or an async iterator of SSE lines when streaming;
    `trace_headers` put the request's span in the caller's trace."""
    ctx.check_model(req.model)
    top_k = req.top_logprobs or 0
    if not 0 <= top_k <= 20:
        raise APIError(f"top_logprobs must be in [0, 20], got {top_k}", 400, "top_logprobs")
    if top_k and not req.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
    check_logprob_token_ids(req, bool(req.logprobs), "set to true")
    # Each position's candidates: the top_logprobs best, or all the logprob_token_ids.
    shown = None if req.logprob_token_ids else top_k
    if req.max_completion_tokens is not None:
        max_tokens, mt_field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, mt_field = req.max_tokens, "max_tokens"
    tools = resolve_tool_choice(
        req.tools,
        req.tool_choice,
        req.response_format is not None or req.structured_outputs is not None,
    )
    if req.continue_final_message and req.add_generation_prompt:
        if "add_generation_prompt" in req.model_fields_set:  # its default gives way
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true",
                400,
                "continue_final_message",
            )
    params = build_sampling_params(
        req,
        max_tokens,
        top_k if req.logprobs and not req.logprob_token_ids else None,
        req.prompt_logprobs,
        tools.schema,
        mt_field,
        ctx.default_sampling_params,
    )
    if tools.mode == "auto" and getattr(ctx.tool_parser, "keeps_special_tokens", False):
        params.skip_special_tokens = False  # the calls' marker is a special token (mistral)
    ctx.require_tokenizer("messages")
    prompt = await render_chat_prompt(
        ctx,
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template,
        None if tools.mode == "none" else req.tools,
        req.chat_template_kwargs,
    )
    prompt_ids = await ctx.encode_prompt(prompt, req.add_special_tokens, "messages")
    validate_prompt(ctx, prompt_ids, params, "messages", mt_field)
    request_id = req.request_id or f"chatcmpl-{random_uuid()}"
    created = int(time.time())
    if req.use_beam_search:  # `n` beams as the choices (`pagoda.server.beam_search`)
        from pagoda.server.beam_search import beam_search_params, beam_search_state

        if tools.mode != "none":
            raise APIError("tools are not supported with beam search", 400, "tools")
        bs = beam_search_params(ctx, req, params, mt_field)
        state = await beam_search_state(
            ctx, prompt_ids, bs, request_id, req.priority, trace_headers
        )
    else:
        stream = merge_async_iterators(
            ctx.engine.generate(
                prompt_ids, params, request_id, req.priority, trace_headers=trace_headers
            )
        )
        if req.stream:
            try:
                first = await first_output(stream)
            except APIError as e:
                raise _named_for_tools(e, req, tools) from None
            return _stream(
                ctx, req, len(prompt_ids), stream, first, request_id, created, shown, tools
            )
        state = RequestState()
        try:
            await collect_outputs(stream, [state])
        except APIError as e:
            raise _named_for_tools(e, req, tools) from None
    echo = _echoed(req)
    choices, num_gen = [], 0
    for j in sorted(state.choices):
        c = state.choices[j]
        num_gen += len(c.token_ids)
        logprobs = (
            chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, shown) if req.logprobs else None
        )
        content: str | None = "".join(c.text)
        calls, finish_reason = None, c.finish_reason
        if tools.forced:
            calls = tool_calls_from_text(tools, content or "")
            if calls is None and tools.mode == "required":  # cut short: what its stream gives
                calls = calls_read_so_far(content or "")
            content = "" if calls else content
        elif tools.mode == "auto" and ctx.tool_parser is not None:
            content, calls = ctx.tool_parser.extract(content)
            finish_reason = "tool_calls" if calls else finish_reason
        if echo:
            content = echo + (content or "")
        choices.append(
            ChatCompletionResponseChoice(
                index=j,
                message=ChatMessage(role="assistant", content=content, tool_calls=calls or []),
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    usage = usage_info(len(prompt_ids), num_gen)
    plps = None
    if req.prompt_logprobs is not None:
        plps = prompt_logprobs_json(ctx.tokenizer, state.prompt_logprobs)
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=ctx.model_name,
        choices=choices,
        usage=usage,
        prompt_logprobs=plps,
    )


def _echoed(req: ChatCompletionRequest) -> str:
    """vLLM's `echo`: the text an answer starts with, the last message's content where that
    message is the assistant's own (the turn the output continues), else nothing."""
    last = req.messages[-1] if req.echo and req.messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    return _flatten_content([last])[0]["content"]


def _named_for_tools(e: APIError, req: ChatCompletionRequest, tools: ToolChoice) -> APIError:
    """A forced call's constraint is the tool's parameters: its errors name the tools; other
    constraints' name their field (`name_constraint_error`)."""
    if not tools.forced or "structured_outputs.json" not in e.message:
        return name_constraint_error(e, req)
    message = e.message.replace("structured_outputs.json", "tools (the function's parameters)")
    return APIError(message, e.status, "tools")


class _ToolDeltas:
    """The stream's delta of each output chunk, by the request's tools. Plain: the text.
    Forced calls: a named function's arguments as they come (the call's id and name with the
    first); "required" calls each with its id and name once the name is whole, then its
    arguments as they come (`RequiredCallsStream`; an output cut short before the first name
    comes whole as content at the end). Calls read out of free text (--tool-call-parser):
    content as it comes, the calls at the end with finish_reason "tool_calls"."""

    def __init__(self, tools: ToolChoice, parser: Any, logprobs: bool) -> None:
        self.tools, self.parser, self.logprobs = tools, parser, logprobs
        self.parsing = tools.mode == "auto" and parser is not None
        self.named_started: set[int] = set()  # choices whose call's id and name went out
        self.required: dict[int, tuple[RequiredCallsStream, list[str]]] = {}  # and the text
        self.splitters: dict[int, StreamingToolCalls] = {}
        self.called: set[int] = set()  # choices whose calls were read out of their text

    def delta(self, index: int, text: str, finished: bool) -> DeltaMessage | None:
        """The delta to send for this chunk of choice `index`, or None to send nothing yet."""
        tools = self.tools
        if self.parsing:
            split = self.splitters.setdefault(index, StreamingToolCalls(self.parser))
            content = split.feed(text)
            if not finished:
                return DeltaMessage(content=content) if content or self.logprobs else None
            rest, calls = split.finish()
            if calls:
                self.called.add(index)
            return DeltaMessage(
                content=content + rest, tool_calls=[dict(c, index=i) for i, c in enumerate(calls)]
            )
        if not tools.forced:
            return DeltaMessage(content=text)
        if tools.mode == "named":
            if not text:
                return DeltaMessage()
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if index not in self.named_started:
                self.named_started.add(index)
                call.update(id=tool_call_id(), type="function")
                call["function"]["name"] = tools.name
            return DeltaMessage(tool_calls=[call])
        calls, seen = self.required.setdefault(index, (RequiredCallsStream(), []))
        seen.append(text)
        pieces = calls.feed(text, final=finished)
        if finished and not calls.started:  # cut short before a call's name: the text as it is
            return DeltaMessage(content="".join(seen))
        if pieces:
            return DeltaMessage(tool_calls=pieces)
        return DeltaMessage() if finished or self.logprobs else None

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        return "tool_calls" if reason is not None and index in self.called else reason


def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    num_prompt: int,
    stream: AsyncIterator[tuple[int, Any]],
    first: tuple[int, Any] | None,
    request_id: str,
    created: int,
    top_k: int | None,
    tools: ToolChoice,
) -> AsyncIterator[str]:
    model = ctx.model_name
    num_gen = 0
    deltas = _ToolDeltas(tools, ctx.tool_parser, bool(req.logprobs))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # stream_options.continuous_usage_stats (vLLM): every chunk carries its choice's usage so far.
    continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
    choice_tokens = [0] * req.n

    def sse(choices: list[ChatCompletionResponseStreamChoice], usage: Any = None) -> str:
        chunk = ChatCompletionStreamResponse(
            id=request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse_line(model_json(chunk))

    def chunks(_: int, out: Any) -> list[str]:
        nonlocal num_gen
        lines = []
        for c in out.outputs:
            num_gen += len(c.token_ids)
            choice_tokens[c.index] += len(c.token_ids)
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(
                    ctx.tokenizer, list(c.token_ids), list(c.logprobs or []), top_k
                )
            d = deltas.delta(c.index, c.text, c.finish_reason is not None)
            if d is None:
                continue
            choice = ChatCompletionResponseStreamChoice(
                index=c.index,
                delta=d,
                logprobs=logprobs,
                finish_reason=deltas.finish_reason(c.index, c.finish_reason),
                stop_reason=c.stop_reason,
            )
            lines.append(sse([choice], _usage_so_far(c.index)))
        return lines

    def _usage_so_far(index: int) -> Any:
        return usage_info(num_prompt, choice_tokens[index]) if continuous else None

    def usage_chunk() -> str:
        return sse([], usage_info(num_prompt, num_gen))

    # The role goes first, once per choice, as OpenAI sends it.
    role = DeltaMessage(role="assistant", content="")
    heads = [ChatCompletionResponseStreamChoice(index=j, delta=role) for j in range(req.n)]
    head = [sse(heads, usage_info(num_prompt, 0) if continuous else None)]
    echo = _echoed(req)
    if echo:  # then the echoed text, as the first content of each choice
        echoed = [
            ChatCompletionResponseStreamChoice(index=j, delta=DeltaMessage(content=echo))
            for j in range(req.n)
        ]
        head.append(sse(echoed, usage_info(num_prompt, 0) if continuous else None))
    return sse_stream(stream, first, chunks, usage_chunk if include_usage else None, head)
