"""OpenAI's Responses API (`POST /v1/responses`) as pydantic models, with the field names of
OpenAI's API and of the `openai` package's `Response`.

The request takes OpenAI's fields plus the vLLM sampling extras its ResponsesRequest takes
(`top_k`, `repetition_penalty`, `seed`, `stop`, `ignore_eos`, ...); fields that ask for what a
text model served here cannot do (tools, background mode, prompt templates) are typed loosely
so that the handler can refuse them with a 400 naming the field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from pagoda.server.protocol import OpenAIBaseModel, RequestModel, random_uuid

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponsesRequest(RequestModel):
    # `input` items are checked by the handler (`serving_responses.input_messages`), which
    # names the item and part at fault.
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True  # as OpenAI (vLLM stores only with VLLM_ENABLE_RESPONSES_API_STORE)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    include: list[str] | None = None
    top_logprobs: int | None = None
    # Echoed back; refused by the handler where they ask for what is not served.
    tools: list[Any] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    background: bool | None = False
    truncation: str | None = "disabled"
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = "auto"
    prompt: Any = None
    conversation: Any = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)


class OutputTextLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ResponseOutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputTextLogprob] = Field(default_factory=list)


class ResponseOutputMessage(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText] = Field(default_factory=list)


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"] | None = None


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponsesResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"resp_{random_uuid()}")
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    completed_at: int | None = None
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[ResponseOutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = "auto"
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str | None = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every output_text part, joined (the `openai` package's property)."""
        return "".join(p.text for m in self.output for p in m.content)
