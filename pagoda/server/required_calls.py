"""The calls of a `tool_choice: "required"` output, read as it streams.

The output is a JSON list of `{"name": ..., "parameters": {...}}` objects (the grammar of
`tool_choice.resolve_tool_choice` holds it to that). `RequiredCallsStream` reads it a chunk
at a time and gives, per call, its id and name once the name's string is whole, then its
arguments as they come, as vLLM streams them. The arguments are written the way
`json.dumps(parameters, ensure_ascii=False)` writes them for the whole output
(`tool_choice.call_from_object`), so that the streamed pieces add up to the unstreamed
arguments: whitespace between tokens dropped, `, ` and `: ` between items, a string's escapes
decoded and written again as json.dumps does, a number or literal once whole, as Python reads
and writes it back. (An object with a key twice is the one case where they differ: json.loads
keeps the last value, the stream has sent both.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagoda.server.serving import escape_surrogates
from pagoda.server.tool_choice import tool_call_id

_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")


def _dumped(ch: str) -> str:
    """One character as it stands inside a string that json.dumps(ensure_ascii=False) writes,
    but a lone surrogate as its escape (as `tool_choice.tool_call` keeps it: UTF-8 has none)."""
    if ch in '"\\' or ord(ch) < 0x20 or 0xD800 <= ord(ch) <= 0xDFFF:
        return json.dumps(ch)[1:-1]
    return ch


@dataclass
class _Call:
    name: str | None = None
    pending: list[str] = field(default_factory=list)  # argument pieces not yet sent
    started: bool = False  # its id and name went out


class RequiredCallsStream:
    """`feed` the output's text as it comes; each call returns the `tool_calls` deltas to send
    for that text, in OpenAI's stream form: `{"index", "id", "type", "function": {"name",
    "arguments"}}` for a call's first, `{"index", "function": {"arguments"}}` after."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._stack: list[str] = []  # "[" / "{" of the containers open
        self._expect_key = False  # inside an object, where a key comes next
        self._key: str | None = None  # the call object's key whose value comes next
        self._string: list[str] | None = None  # the open string's characters, decoded
        self._is_key = False  # the open string is an object's key
        self._escape = ""  # an escape sequence read so far, from its backslash
        self._high = ""  # a high surrogate waiting for its low half
        self._scalar = ""  # a number or literal read so far
        self._args_depth = 0  # stack depth where the open call's parameters began, or 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas for `text`, at most one a call; `final`: the output ends with it (a
        number it ends on goes out too)."""
        for ch in text:
            self._read(ch)
        if final and self._scalar:
            self._end_scalar()
        return self._deltas()

    @property
    def started(self) -> bool:
        """Whether a call's id and name went out."""
        return any(c.started for c in self.calls)

    # -- reading the text ------------------------------------------------------------------
    def _read(self, ch: str) -> None:
        if self._string is not None:
            self._read_in_string(ch)
            return
        if self._scalar:
            if ch in _SCALAR_CHARS:
                self._scalar += ch
                return
            self._end_scalar()
        if ch == '"':
            self._string, self._is_key = [], self._expect_key
            if not self._is_key:
                self._begin_value()
            self._emit('"')
        elif ch in "[{":
            self._begin_value()
            if self._stack == ["["] and ch == "{":  # a call
                self.calls.append(_Call())
                self._key = None
            self._emit(ch)
            self._stack.append(ch)
            self._expect_key = ch == "{"
        elif ch in "]}":
            self._emit(ch)
            if self._stack:
                self._stack.pop()
            self._expect_key = False
            self._end_value()
        elif ch == ",":
            self._emit(", ")
            self._expect_key = self._stack[-1:] == ["{"]
        elif ch == ":":
            self._emit(": ")
        elif ch in _SCALAR_CHARS:
            self._begin_value()
            self._scalar = ch

    def _read_in_string(self, ch: str) -> None:
        if self._escape:
            self._escape += ch
            if self._escape[1] == "u":
                if len(self._escape) < 6:
                    return
                try:
                    decoded = chr(int(self._escape[2:], 16))
                except ValueError:
                    decoded = ""
            else:
                decoded = _ESCAPES.get(ch, ch)
            self._escape = ""
            self._add_char(decoded)
        elif ch == "\\":
            self._escape = ch
        elif ch == '"':
            self._end_string()
        else:
            self._add_char(ch)

    def _add_char(self, ch: str) -> None:
        if not ch:
            return
        if self._high:
            high, self._high = self._high, ""
            if 0xDC00 <= ord(ch) <= 0xDFFF:  # the pair's second half: one character
                ch = (high + ch).encode("utf-16", "surrogatepass").decode("utf-16")
            else:
                self._append(high)
        if 0xD800 <= ord(ch) <= 0xDBFF:
            self._high = ch
            return
        self._append(ch)

    def _append(self, ch: str) -> None:
        assert self._string is not None
        self._string.append(ch)
        self._emit(_dumped(ch))

    def _end_string(self) -> None:
        if self._high:
            high, self._high = self._high, ""
            self._append(high)
        assert self._string is not None
        text, self._string = "".join(self._string), None
        self._emit('"')
        if self._is_key:
            if self._at_call_level():
                self._key = text
            self._expect_key = False
            return
        if self._at_call_level() and self._key == "name" and self.calls:
            self.calls[-1].name = text
        self._end_value()

    def _end_scalar(self) -> None:
        raw, self._scalar = self._scalar, ""
        try:
            text = json.dumps(json.loads(raw), ensure_ascii=False)
        except ValueError:
            text = raw
        self._emit(text)
        self._end_value()

    # -- the open call's parameters --------------------------------------------------------
    def _at_call_level(self) -> bool:
        return self._stack == ["[", "{"]

    def _begin_value(self) -> None:
        if self._at_call_level() and self._key == "parameters" and not self._args_depth:
            self._args_depth = len(self._stack)

    def _end_value(self) -> None:
        if self._args_depth and len(self._stack) <= self._args_depth:
            self._args_depth = 0
            self._key = None

    def _emit(self, text: str) -> None:
        if self._args_depth and self.calls and len(self._stack) >= self._args_depth:
            self.calls[-1].pending.append(text)

    # -- the deltas ------------------------------------------------------------------------
    def _deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            arguments = "".join(call.pending)
            call.pending.clear()
            if not call.started:
                call.started = True
                out.append(
                    {
                        "index": index,
                        "id": tool_call_id(),
                        "type": "function",
                        "function": {"name": escape_surrogates(call.name), "arguments": arguments},
                    }
                )
            elif arguments:
                out.append({"index": index, "function": {"arguments": arguments}})
        return out


def calls_read_so_far(text: str) -> list[dict[str, Any]]:
    """The `tool_calls` of a "required" output that holds no whole list of calls (cut short by
    max_tokens, say), as its stream gives them in all: each call whose name is whole, with the
    arguments written so far; none where it was cut before the first name."""
    return [
        {"id": d["id"], "type": "function", "function": d["function"]}
        for d in RequiredCallsStream().feed(text, final=True)
    ]
