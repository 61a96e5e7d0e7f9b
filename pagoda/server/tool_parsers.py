"""Tool calls read out of a model's free text, for `tool_choice: "auto"` with
`--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags).

- `hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates: each call
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after any text, which is the
  message's content.
- `llama3_json`: Llama 3.1 / 3.2 / 3.3: the whole output is the calls, JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;` (after `<|python_tag|>` where the
  special tokens are kept).

Each call becomes a `tool_calls` entry. Output that looks like calls but holds no valid one
comes back as plain content, unchanged. Streamed (`StreamingToolCalls`), text is sent as it
comes except what may be calls (held until the next chunk shows what it is); the calls come
whole with the last chunk.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.server.tool_choice import call_from_object


class HermesToolParser:
    start = "<tool_call>"
    _calls = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def cut(self, held: str) -> tuple[int, str]:
        """Streaming: how much of the unsent `held` text is content that can go now, and what
        the rest of the output is: "calls" (held to the end), "content" (sent as it comes from
        now on) or "open" (not known yet)."""
        at = held.find(self.start)
        if at >= 0:
            return at, "calls"
        # Hold back a tail that could be the start of "<tool_call>"; a call may come later.
        keep = next(
            (n for n in range(len(self.start) - 1, 0, -1) if held.endswith(self.start[:n])), 0
        )
        return len(held) - keep, "open"

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output; (text, []) where it holds no calls."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._calls.findall(text, at):
            try:
                call = call_from_object(json.loads(body.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:at] or None, calls


class Llama3JsonToolParser:
    tag = "<|python_tag|>"

    def cut(self, held: str) -> tuple[int, str]:
        """As `HermesToolParser.cut`: calls when the output opens with `{` or the tag, content
        when it opens with anything else, open while it is blank or a part of the tag."""
        head = held.lstrip()
        if head.startswith(("{", self.tag)):
            return 0, "calls"
        if not head or self.tag.startswith(head):
            return 0, "open"
        return len(held), "content"

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output; (text, []) where it holds no calls."""
        body = text.strip()
        body = body[len(self.tag) :].lstrip() if body.startswith(self.tag) else body
        if not body.startswith("{"):
            return text, []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = call_from_object(obj)
            if call is None:
                return text, []
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return None, calls


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


class StreamingToolCalls:
    """One streamed choice's text split into content to send now and calls held to the end."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.held = ""  # text not sent yet: what may be calls, or the calls
        self.state = "open"  # of the rest of the output: "open", "calls" or "content"

    def feed(self, text: str) -> str:
        """The content of `text` that can be sent now."""
        self.held += text
        if self.state == "open":
            n, self.state = self.parser.cut(self.held)
        else:
            n = 0 if self.state == "calls" else len(self.held)
        out, self.held = self.held[:n], self.held[n:]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, the calls) at the end of the output."""
        held, self.held = self.held, ""
        content, calls = self.parser.extract(held) if self.state == "calls" else (held, [])
        return ("" if calls else held), calls
