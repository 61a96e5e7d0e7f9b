"""The OpenAI wire protocol as pydantic models (field names as OpenAI's and vLLM's).

Requests accept OpenAI's fields plus vLLM's sampling extras (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, ...); unknown fields are accepted and
ignored, as vLLM does, so clients written for either server work. Range checks live in
`SamplingParams` (one place), type checks here; both end up as an `ErrorResponse`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in a decoded JSON value holding a lone UTF-16 surrogate
    (JSON's "\\ud800" escapes decode to one; no tokenizer or UTF-8 encoder can take it)."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "body"
        elif isinstance(v, dict):
            stack.extend((f"{where}.{k}" if where else str(k), x) for k, x in v.items())
            stack.extend((where or "body", k) for k in v if isinstance(k, str))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


# How deeply a request body's JSON may nest (objects and arrays). Deeper values would reach
# Python's recursion limit in code that walks them recursively (copying sampling parameters,
# pickling a request to the engine core, compiling a JSON schema), a RecursionError far from
# the request; a JSON schema of 30 nested object levels takes about 60.
MAX_JSON_DEPTH = 100


def find_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The path of the first value of a decoded JSON value nested more than `limit` objects
    and arrays deep, or None."""
    stack = [("", value, 0)]
    while stack:
        where, v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth >= limit:
                return where or "body"
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if not isinstance(x, dict | list):
                    continue  # a scalar is never too deep: no path built for it
                if isinstance(v, list):
                    sub = f"{where}[{k}]"
                else:
                    sub = f"{where}.{k}" if where else str(k)
                stack.append((sub, x, depth + 1))
    return None


class RequestModel(OpenAIBaseModel):
    """A request body: its strings must be valid Unicode text (no lone surrogates), its values
    nested at most MAX_JSON_DEPTH deep."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = find_too_deep(data)
        if where is not None:
            raise PydanticCustomError(
                "too_deep",
                "{where} is nested more than {limit} objects and arrays deep",
                {"where": where, "limit": MAX_JSON_DEPTH},
            )
        where = find_lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate",
                "{where} holds a lone UTF-16 surrogate (such as \\ud800), which is not valid "
                "Unicode text",
                {"where": where},
            )
        return data


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    # As OpenAI and vLLM: the usage chunk only when asked for.
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class _SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    stream_interval: int | None = None  # tokens per streamed chunk (first and last at once)
    # Logprobs of exactly these token ids at each generated position, besides the sampled
    # token's, in place of the top ones; they need `logprobs` set (as vLLM).
    logprob_token_ids: list[int] | None = None
    # {max_pattern_size, min_pattern_size, min_count}: stop an output that repeats an n-gram
    # (finish_reason "repetition"); `pagoda.repetition_detection`.
    repetition_detection: dict[str, Any] | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)  # vLLM's bound: a signed 64-bit int
    # Structured outputs: OpenAI's response_format ({"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}) and vLLM's
    # `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    request_id: str | None = None
    # vLLM's beam search: `n` beams, scored by cumulative log probability / length ** penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None
    # vLLM V1 dropped best_of; a value other than 1 would be ignored, so it is refused.
    best_of: int | None = Field(
        None, ge=1, le=1, description="not supported (vLLM V1 dropped it): only 1"
    )
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    prompt_logprobs: int | None = None  # vLLM's extra: returned at the response's top level
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes the special tokens itself
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False


# ---- /v1/completions responses ----
class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One candidate of a prompt position (vLLM's `prompt_logprobs` entries)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (None for the first, which nothing predicts): token id -> candidate, the
# prompt's own token and the `prompt_logprobs` most likely ones.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


# ---- /v1/chat/completions responses ----
class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProb] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # as vLLM sends


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer ----
class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
