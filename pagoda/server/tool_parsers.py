"""Tool calls read out of a model's free text, for `tool_choice: "auto"` with
`--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags).

`hermes`: the format of Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates, each call
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after any text. The text before the
first call is the message's content; each call becomes a `tool_calls` entry. Output that
opens a call but holds no valid one comes back as plain content, unchanged. Streamed
(`StreamingToolCalls`), text is sent as it comes except from the first `<tool_call>` on (and a
partial `<tool_call` at a chunk's end, held until the next chunk shows what it is); the calls
come whole with the last chunk.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.server.tool_choice import tool_call


class HermesToolParser:
    start = "<tool_call>"
    _calls = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output; (text, []) where it holds no calls."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._calls.findall(text, at):
            try:
                call = json.loads(body.strip())
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            args = call.get("arguments", call.get("parameters", {}))
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            calls.append(tool_call(call["name"], args))
        return text[:at] or None, calls


TOOL_PARSERS = {"hermes": HermesToolParser}


class StreamingToolCalls:
    """One streamed choice's text split into content to send now and calls held to the end."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.held = ""  # text not sent yet: a possible start of a call, or the calls
        self.in_calls = False

    def feed(self, text: str) -> str:
        """The content of `text` that can be sent now."""
        self.held += text
        if self.in_calls:
            return ""
        at = self.held.find(self.parser.start)
        if at >= 0:
            self.in_calls = True
            out, self.held = self.held[:at], self.held[at:]
            return out
        # Hold back a tail that could be the start of "<tool_call>".
        keep = next(
            (n for n in range(len(self.parser.start) - 1, 0, -1)
             if self.held.endswith(self.parser.start[:n])),
            0,
        )  # fmt: skip
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out) :]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, the calls) at the end of the output."""
        held, self.held = self.held, ""
        if not self.in_calls:
            return held, []
        content, calls = self.parser.extract(held)
        return ("" if calls else held), calls
