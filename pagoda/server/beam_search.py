"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` beams of one
prompt searched as `LLM.beam_search` does (`pagoda.beam_search.BeamSearch`), each step every
live beam one request of one token to the engine, all of them at once. The result is the
request's choices (best first), each a beam's generated tokens; the EOS that ended a beam is
left out of its text and tokens unless `include_stop_str_in_output`, as vLLM returns it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from pagoda.beam_search import BeamSearch
from pagoda.sampling_params import BeamSearchParams, SamplingParams
from pagoda.server.serving import (
    APIError,
    ChoiceState,
    RequestState,
    ServingContext,
    check_request_error,
    exception_to_api_error,
)


def beam_search_params(
    ctx: ServingContext, req: Any, params: SamplingParams, max_tokens_field: str
) -> BeamSearchParams:
    """The request's beam search: `n` beams, the max_tokens `validate_prompt` resolved, the
    request's temperature (else the generation config's, else 1.0, as vLLM). 400s name the
    field."""
    if req.stream:
        raise APIError("streaming is not supported with beam search", 400, "stream")
    if not params.max_tokens:
        raise APIError(f"beam search needs {max_tokens_field} >= 1", 400, max_tokens_field)
    temperature = req.temperature
    if temperature is None:
        temperature = ctx.default_sampling_params.get("temperature", 1.0)
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=params.max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=temperature,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as e:
        field = "n" if "beam_width" in str(e) else "length_penalty"
        raise APIError(str(e).replace("beam_width", "n (the beam width)"), 400, field) from None


async def _one_token(ctx: ServingContext, ids: list[int], params: SamplingParams, rid: str,
                     priority: int, trace_headers: Mapping[str, str] | None) -> Any:  # fmt: skip
    """The candidates of the next token after `ids` (the engine's first position)."""
    step = None
    async for out in ctx.engine.generate(ids, params.clone(), rid, priority,
                                         trace_headers=trace_headers):  # fmt: skip
        check_request_error(out)
        if out.outputs and out.outputs[0].logprobs:
            step = out.outputs[0].logprobs[0]
    if step is None:
        raise APIError("beam search: the engine returned no candidates", 500)
    return step


async def beam_search_state(
    ctx: ServingContext,
    prompt_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    priority: int,
    trace_headers: Mapping[str, str] | None = None,
) -> RequestState:
    """The request's choices, best beam first."""
    eos = ctx.tokenizer.eos_token_id if ctx.tokenizer is not None else None
    try:
        search = BeamSearch([prompt_ids], params, eos, ctx.max_model_len)
        step = 0
        while batch := search.step_prompts():
            steps = await asyncio.gather(*(
                _one_token(ctx, ids, search.step_params, f"{request_id}-beam{step}-{k}",
                           priority, trace_headers)
                for k, ids in enumerate(batch)
            ))  # fmt: skip
            search.advance(list(steps))
            step += 1
    except (asyncio.CancelledError, APIError):
        raise
    except BaseException as e:
        raise exception_to_api_error(e) from None
    state = RequestState(prompt_token_ids=list(prompt_ids))
    for j, seq in enumerate(search.results()[0].sequences):
        ids = seq.tokens[len(prompt_ids) :]
        lps = seq.logprobs
        if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            ids, lps = ids[:-1], lps[:-1]
        text = ""
        if ctx.tokenizer is not None:
            text = await ctx.preprocessor.decode(
                ids, skip_special_tokens=params.skip_special_tokens
            )
        state.choices[j] = ChoiceState(
            text=[text],
            token_ids=ids,
            logprobs=lps,
            finish_reason=seq.finish_reason,
            stop_reason=eos if seq.finish_reason == "stop" else None,
        )
    return state
