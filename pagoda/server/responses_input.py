"""A Responses request as the chat request it amounts to: `input` as chat messages, the fields
that ask for what is not served refused, `text.format` as chat's `response_format`, and the chat
path's errors named for the Responses field that caused them."""

from __future__ import annotations

from typing import Any

from pagoda.server.protocol import ChatCompletionRequest
from pagoda.server.protocol_responses import ResponsesRequest
from pagoda.server.serving import APIError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# The chat fields a Responses request's own fields stand for, in the errors of the chat path.
_CHAT_PARAMS = {"messages": "input", "response_format": "text"}
_CHAT_WORDS = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("messages", "input"),
)
_SAMPLING_FIELDS = {
    "stream", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
    "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
    "structured_outputs", "priority",
}  # fmt: skip


def input_messages(value: str | list[Any]) -> list[dict[str, str]]:
    """`input` as chat messages: a string is one user message; a list holds message items
    (`{"role", "content"}`, `type` "message" or left out), content a string or a list of
    input_text / output_text parts (their text joined by newlines, as chat's text parts). A
    developer message is read as a system message. 400s name the item and part."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise APIError("input must be a string or a non-empty list of messages", 400, "input")
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be a message object ({{'role', 'content'}})", 400,
                           "input")  # fmt: skip
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(
                f"{where}.type: only message items are served (text, no tools), got {kind!r}",
                400,
                "input",
            )
        role = item.get("role")
        if role not in _ROLES:
            raise APIError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", 400,
                           "input")  # fmt: skip
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"{where}.content[{j}]: only input_text and output_text parts with a "
                        f"string text are served (text models), got type {kind!r}",
                        400,
                        "input",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise APIError(
                f"{where}.content must be a string or a list of input_text parts, "
                f"got {type(content).__name__}",
                400,
                "input",
            )
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return messages


def refuse_unserved(req: ResponsesRequest) -> None:
    """400s for the fields that ask for what is not served here."""
    if req.tools:
        raise APIError(
            "tools are not served by /v1/responses here (vLLM serves them for gpt-oss "
            "models only); use /v1/chat/completions with tools",
            400,
            "tools",
        )
    if req.tool_choice not in ("auto", "none"):
        raise APIError("tool_choice must be 'auto' or 'none': no tools are served", 400,
                       "tool_choice")  # fmt: skip
    if req.background:
        raise APIError("background responses are not served: send background false", 400,
                       "background")  # fmt: skip
    if req.truncation not in (None, "disabled"):
        raise APIError(
            "truncation must be 'disabled': a conversation longer than the context is refused "
            "rather than cut",
            400,
            "truncation",
        )
    if req.prompt is not None:
        raise APIError("prompt templates are not served", 400, "prompt")
    if req.conversation is not None:
        raise APIError("conversations are not served: continue one with previous_response_id",
                       400, "conversation")  # fmt: skip
    unserved = sorted(set(req.include or ()) - {LOGPROBS_INCLUDE})
    if unserved:
        raise APIError(f"include: only {LOGPROBS_INCLUDE!r} is served, got {unserved}", 400,
                       "include")  # fmt: skip
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", 400,
                       "top_logprobs")  # fmt: skip
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise APIError(
            "metadata holds at most 16 pairs, keys of at most 64 characters and values of at "
            "most 512",
            400,
            "metadata",
        )


def text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None for plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("text.format of type 'json_schema' needs schema, an object", 400,
                           "text")  # fmt: skip
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    raise APIError(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        400,
        "text",
    )


def named_for_responses(e: APIError) -> APIError:
    """An error of the chat path, named for the Responses request's field."""
    param = _CHAT_PARAMS.get(e.param or "")
    if param is None:
        return e
    message = e.message
    for chat_word, word in _CHAT_WORDS:
        message = message.replace(chat_word, word)
    return APIError(message, e.status, param, e.headers)


def chat_request(
    req: ResponsesRequest, conversation: list[dict[str, str]]
) -> ChatCompletionRequest:
    """The chat request `req` amounts to: `instructions` as a system message, then the
    `conversation` (an earlier one's messages and the new input), the sampling fields as they
    are and `text.format` as `response_format`."""
    response_format = text_format(req.text)
    if response_format is not None and req.structured_outputs is not None:
        raise APIError("give one of text.format and structured_outputs, not both", 400,
                       "structured_outputs")  # fmt: skip
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return ChatCompletionRequest(
        messages=[*system, *conversation],
        response_format=response_format,
        **req.model_dump(include=_SAMPLING_FIELDS),
    )
