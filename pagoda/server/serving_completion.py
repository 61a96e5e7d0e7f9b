"""POST /v1/completions: batch prompts (strings or token id lists), n samples each, SSE
streaming, logprobs in the legacy format, and `echo` with prompt logprobs (what lm-eval's
loglikelihood requests use: echo=True, max_tokens=0 or 1, logprobs=k).

Choice `index` is `prompt_index * n + sample_index`, as OpenAI and vLLM number them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pagoda.outputs import Logprob
from pagoda.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    random_uuid,
)
from pagoda.server.serving import (
    APIError,
    RequestState,
    ServingContext,
    build_sampling_params,
    check_logprob_token_ids,
    collect_outputs,
    exception_to_api_error,
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


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    step_logprobs: list[dict[int, Logprob] | None],
    initial_text_offset: int,
) -> CompletionLogProbs:
    """The legacy logprobs object: one entry per token; a position without logprobs (the
    first prompt token) gets None."""
    out = CompletionLogProbs()
    offset = initial_text_offset
    for i, tid in enumerate(token_ids):
        step = step_logprobs[i] if i < len(step_logprobs) else None
        lp = step.get(tid) if step else None
        tok = token_str(tokenizer, tid, lp)
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
        out.token_logprobs.append(safe_logprob(lp.logprob) if lp is not None else None)
        if step is None:
            out.top_logprobs.append(None)
        else:
            out.top_logprobs.append(
                {
                    token_str(tokenizer, t, p): safe_logprob(p.logprob)
                    for t, p in ranked_logprobs(step)
                }
            )
    return out


class _Prompt:
    def __init__(self, text: str | None, token_ids: list[int]) -> None:
        self.text, self.token_ids = text, token_ids


async def _normalize_prompts(ctx: ServingContext, req: CompletionRequest) -> list[_Prompt]:
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError("prompt must not be empty", 400, "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = await ctx.encode_prompt(item, req.add_special_tokens, "prompt")
            prompts.append(_Prompt(item, ids))
        else:
            prompts.append(_Prompt(None, list(item)))
    return prompts


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, trace_headers: Mapping[str, str] | None = None
) -> Any:
    """Returns a CompletionResponse, or an async iterator of SSE lines when streaming;
    `trace_headers` put each prompt's request span in the caller's trace."""
    ctx.check_model(req.model)
    if req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    echo_only = bool(req.echo) and req.max_tokens == 0
    if req.logprob_token_ids and echo_only:
        raise APIError(
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
            "no output tokens are generated.",
            400,
            "logprob_token_ids",
        )
    check_logprob_token_ids(req, req.logprobs is not None, "set")
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    base = build_sampling_params(
        req,
        1 if echo_only else req.max_tokens,
        None if req.logprob_token_ids else req.logprobs,
        prompt_logprobs,
        defaults=ctx.default_sampling_params,
    )
    prompts = await _normalize_prompts(ctx, req)
    if len(prompts) > 1:  # refused whole, before any of its prompts is added
        try:
            ctx.engine.check_admission(len(prompts) * base.n, "prompt")
        except Exception as e:  # noqa: BLE001 - mapped to its HTTP status
            raise exception_to_api_error(e) from None
    request_id = req.request_id or f"cmpl-{random_uuid()}"
    if req.use_beam_search:
        return await _beam_search(ctx, req, base, prompts, request_id, trace_headers)
    generators = []
    for i, pr in enumerate(prompts):
        params = base.clone()
        validate_prompt(ctx, pr.token_ids, params, "prompt")
        sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        generators.append(
            ctx.engine.generate(
                pr.token_ids, params, sub_id, req.priority, trace_headers=trace_headers
            )
        )
    await _decode_echoed(ctx, req, prompts)

    stream = merge_async_iterators(*generators)
    created = int(time.time())
    model = ctx.model_name
    states = [RequestState() for _ in prompts]
    try:
        if req.stream:
            first = await first_output(stream)
            return _stream(ctx, req, prompts, stream, first, request_id, created, echo_only)
        await collect_outputs(stream, states)
    except APIError as e:
        raise name_constraint_error(e, req) from None
    return _final_response(ctx, req, prompts, states, request_id, created, model, echo_only)


async def _beam_search(
    ctx: ServingContext,
    req: CompletionRequest,
    base: Any,
    prompts: list[_Prompt],
    request_id: str,
    trace_headers: Mapping[str, str] | None,
) -> CompletionResponse:
    """`use_beam_search`: each prompt's `n` beams as its choices (`pagoda.server.beam_search`),
    the prompts searched at once."""
    from pagoda.server.beam_search import beam_search_params, beam_search_state

    if req.max_tokens == 0:
        raise APIError("beam search needs max_tokens >= 1", 400, "max_tokens")
    searches = []  # every prompt checked before any search starts
    for pr in prompts:
        params = base.clone()
        validate_prompt(ctx, pr.token_ids, params, "prompt")
        searches.append(beam_search_params(ctx, req, params, "max_tokens"))
    await _decode_echoed(ctx, req, prompts)
    states = list(await asyncio.gather(*(
        beam_search_state(ctx, pr.token_ids, bs, request_id if len(prompts) == 1
                          else f"{request_id}-{i}", req.priority, trace_headers)
        for i, (pr, bs) in enumerate(zip(prompts, searches))
    )))  # fmt: skip
    return _final_response(
        ctx, req, prompts, states, request_id, int(time.time()), ctx.model_name, False
    )


async def _decode_echoed(
    ctx: ServingContext, req: CompletionRequest, prompts: list[_Prompt]
) -> None:
    """With `echo`, the text of the prompts given as token ids."""
    for pr in prompts:
        if pr.text is None and req.echo and ctx.tokenizer is not None:
            pr.text = await ctx.preprocessor.decode(pr.token_ids, skip_special_tokens=False)


def _final_response(
    ctx: ServingContext,
    req: CompletionRequest,
    prompts: list[_Prompt],
    states: list[RequestState],
    request_id: str,
    created: int,
    model: str,
    echo_only: bool,
) -> CompletionResponse:
    tok = ctx.tokenizer
    choices: list[CompletionResponseChoice] = []
    num_prompt = num_gen = 0
    for i, (pr, st) in enumerate(zip(prompts, states)):
        num_prompt += len(pr.token_ids)
        prompt_lps: list[Any] = list(st.prompt_logprobs)
        for j in sorted(st.choices):
            c = st.choices[j]
            text, ids, lps = "".join(c.text), c.token_ids, c.logprobs
            if echo_only:
                text, ids, lps = "", [], []
            num_gen += len(ids)
            logprobs = None
            if req.echo:
                text = (pr.text or "") + text
                if req.logprobs is not None:
                    plps = prompt_lps or [None] * len(pr.token_ids)
                    logprobs = completion_logprobs(tok, pr.token_ids + ids, plps + lps, 0)
            elif req.logprobs is not None:
                logprobs = completion_logprobs(tok, ids, lps, len(pr.text or ""))
            choices.append(
                CompletionResponseChoice(
                    index=i * req.n + j,
                    text=text,
                    logprobs=logprobs,
                    finish_reason="length" if echo_only else c.finish_reason,
                    stop_reason=None if echo_only else c.stop_reason,
                    prompt_logprobs=None
                    if req.prompt_logprobs is None
                    else prompt_logprobs_json(tok, prompt_lps),
                )
            )
    return CompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage_info(num_prompt, num_gen),
    )


def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    prompts: list[_Prompt],
    stream: AsyncIterator[tuple[int, Any]],
    first: tuple[int, Any] | None,
    request_id: str,
    created: int,
    echo_only: bool,
) -> AsyncIterator[str]:
    tok, model = ctx.tokenizer, ctx.model_name
    started: set[int] = set()  # choice indices whose first chunk went out (echo goes there)
    offsets: dict[int, int] = {}
    num_gen = 0
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # stream_options.continuous_usage_stats (vLLM): every chunk carries its choice's usage so far.
    continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
    choice_tokens: dict[int, int] = {}

    def chunks(i: int, out: Any) -> list[str]:
        nonlocal num_gen
        pr, lines = prompts[i], []
        for c in out.outputs:
            index = i * req.n + c.index
            text, ids, lps = c.text, list(c.token_ids), list(c.logprobs or [])
            if echo_only:
                text, ids, lps = "", [], []
            num_gen += len(ids)
            choice_tokens[index] = choice_tokens.get(index, 0) + len(ids)
            if index not in started:
                started.add(index)
                offsets[index] = 0 if req.echo else len(pr.text or "")
                if req.echo:
                    text = (pr.text or "") + text
                    plps = list(out.prompt_logprobs or []) or [None] * len(pr.token_ids)
                    ids, lps = pr.token_ids + ids, plps + lps
            finish = c.finish_reason
            if echo_only and out.finished:
                finish = "length"
            if not text and not ids and finish is None:
                continue  # a prefill chunk or a token that decodes to nothing yet
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(tok, ids, lps, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.tokens)
            choice = CompletionResponseChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=None if echo_only else c.stop_reason,
            )
            usage = usage_info(len(pr.token_ids), choice_tokens[index]) if continuous else None
            resp = CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice], usage=usage
            )
            lines.append(sse_line(model_json(resp)))
        return lines

    def usage_chunk() -> str:
        usage = usage_info(sum(len(p.token_ids) for p in prompts), num_gen)
        final = CompletionStreamResponse(
            id=request_id, created=created, model=model, choices=[], usage=usage
        )
        return sse_line(model_json(final))

    return sse_stream(stream, first, chunks, usage_chunk if include_usage else None)
