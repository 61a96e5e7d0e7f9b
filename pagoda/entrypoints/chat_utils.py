"""OpenAI chat messages as chat templates read them, one rule for `LLM.chat` and the server."""

from __future__ import annotations

from typing import Any


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages of one conversation with each content a string: a list of parts (OpenAI's
    form; a text-only model reads their text joined by newlines) or null (an assistant turn of
    tool calls, read as "" as vLLM gives it). ValueError naming the message for anything
    else: no list of messages, a message without a role, parts that are not text."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            "messages must be a non-empty list of messages ({'role': ..., 'content': ...}), "
            f"got {type(messages).__name__}"
        )
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        content = m.get("content")
        if content is None:
            m = {**m, "content": ""}
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(
                        f"messages[{i}].content: only parts of type 'text' are supported"
                    )
                texts.append(str(part.get("text", "")))
            m = {**m, "content": "\n".join(texts)}
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        flat.append(m)
    return flat
