"""Tool calls read out of a model's free text, for `tool_choice: "auto"` with
`--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags).

- `hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates: each call
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after any text, which is the
  message's content.
- `llama3_json`: Llama 3.1 / 3.2 / 3.3: the whole output is the calls, JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;` (after `<|python_tag|>` where the
  special tokens are kept).
- `mistral`: Mistral 7B v0.3, Nemo, Small: `[TOOL_CALLS]` and a JSON list of calls, or
  `name[ARGS]{...}` after each `[TOOL_CALLS]`, after any content (special tokens are kept).
- `pythonic`: Llama 3.2 / Llama 4: the whole output is a Python list of calls,
  `[get_weather(city="Paris"), get_time()]`.

Each call becomes a `tool_calls` entry. Output that looks like calls but holds no valid one
comes back as plain content, unchanged. Streamed (`StreamingToolCalls`), text is sent as it
comes except what may be calls (held until the next chunk shows what it is); the calls come
whole with the last chunk.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagoda.server.tool_choice import call_from_object, tool_call


class HermesToolParser:
    start = "<tool_call>"
    _calls = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def cut(self, held: str) -> tuple[int, str]:
        """Streaming: how much of the unsent `held` text is content that can go now, and what
        the rest of the output is: "calls" (held to the end), "content" (sent as it comes from
        now on) or "open" (not known yet)."""
        return _cut_at_tag(held, self.start)

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
        return _cut_at_opening(held, "{", self.tag)

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


class MistralToolParser:
    """`[TOOL_CALLS]` then the calls, after any content: a JSON list of `{"name", "arguments"}`
    (the v3 tokenizer's format: Mistral 7B v0.3, Nemo, Small) or `name[ARGS]{...}` for each
    call, each after its own `[TOOL_CALLS]` (v11 and later). `[TOOL_CALLS]` is a special token:
    with this parser the output keeps special tokens while tools may be called."""

    tag = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def cut(self, held: str) -> tuple[int, str]:
        """As `HermesToolParser.cut`, for the tag."""
        return _cut_at_tag(held, self.tag)

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output; (text, []) where it holds no calls."""
        at = text.find(self.tag)
        if at < 0:
            return text, []
        body = text[at + len(self.tag) :].strip()
        if body.startswith(("[", "{")):  # one JSON list (or object) of calls
            try:
                objs = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            objs = objs if isinstance(objs, list) else [objs]
        else:  # name[ARGS]{...}, each call after its own tag
            objs = []
            for part in body.split(self.tag):
                name, sep, args = part.partition("[ARGS]")
                try:
                    objs.append(
                        {"name": name.strip(), "arguments": json.loads(args)} if sep else None
                    )
                except json.JSONDecodeError:
                    return text, []
        calls = [call_from_object(o) for o in objs]
        if not calls or None in calls or any(not c["function"]["name"] for c in calls):
            return text, []
        return text[:at] or None, calls


class PythonicToolParser:
    """Llama 3.2 / Llama 4 pythonic calls: the whole output is a Python list of calls with
    keyword arguments of literal values, `[get_weather(city="Paris"), get_time()]` (inside
    `<|python_start|>` ... `<|python_end|>` where the special tokens are kept)."""

    start, end = "<|python_start|>", "<|python_end|>"

    def cut(self, held: str) -> tuple[int, str]:
        """As `Llama3JsonToolParser.cut`: calls when the output opens with `[` or the start
        tag."""
        return _cut_at_opening(held, "[", self.start)

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output; (text, []) where it holds no calls."""
        body = text.strip().removeprefix(self.start).removesuffix(self.end).strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [_pythonic_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, RecursionError):
            return text, []
        return None, calls


def _pythonic_call(node: ast.expr) -> dict[str, Any]:
    """The `tool_calls` entry of `name(key=literal, ...)`; ValueError for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call by name with keyword arguments")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = ast.literal_eval(kw.value)
    return tool_call(node.func.id, json.dumps(args, ensure_ascii=False))


def _cut_at_opening(held: str, opening: str, tag: str) -> tuple[int, str]:
    """For formats whose whole output is the calls: calls when it opens with `opening` or
    `tag`, open while it is blank or a part of the tag, content otherwise."""
    head = held.lstrip()
    if head.startswith((opening, tag)):
        return 0, "calls"
    if not head or tag.startswith(head):
        return 0, "open"
    return len(held), "content"


def _cut_at_tag(held: str, tag: str) -> tuple[int, str]:
    """Content up to `tag` can go, the rest is calls; without the tag, all but a tail that
    could be its start can go, and a call may still come."""
    at = held.find(tag)
    if at >= 0:
        return at, "calls"
    keep = next((n for n in range(len(tag) - 1, 0, -1) if held.endswith(tag[:n])), 0)
    return len(held) - keep, "open"


TOOL_PARSERS = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


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
