"""`tool_choice` of a chat request, as vLLM serves it without a tool-call parser.

A named function (`{"type": "function", "function": {"name": ...}}`) or `"required"` forces
the call: the output is constrained by a JSON schema (the function's parameters; for
"required", a non-empty list of `{"name", "parameters"}` objects, one of the tools each) and
comes back as the message's `tool_calls`, with empty content. `"none"` leaves the tools out of
the prompt. `"auto"`, the default when tools are given, renders them into the prompt and
returns the model's text, with the calls read out of it where the server has a
`--tool-call-parser` (`tool_parsers`). Bad tools or choices are 400s naming the field. An
output cut short (`finish_reason` "length") keeps what it has: a named call's arguments as far
as they got (as vLLM), a "required" output that is no whole list of calls as plain content
(streamed, the calls whose names went out as far as they got: `required_calls`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagoda.server.protocol import random_uuid
from pagoda.server.serving import APIError, escape_surrogates

# A function without parameters takes an empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "named" | "required"
    name: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # the output's constraint (named / required)

    @property
    def forced(self) -> bool:
        return self.schema is not None


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool; malformed tools are 400s."""
    if not isinstance(tools, list):
        raise APIError("tools must be a list", 400, "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                400,
                "tools",
            )
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not name:
            raise APIError(f"tools[{i}].function.name must be a non-empty string", 400, "tools")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be an object", 400, "tools")
        functions[name] = params or _NO_PARAMETERS
    return functions


def resolve_tool_choice(tools: Any, tool_choice: Any, has_constraint: bool) -> ToolChoice:
    """The request's ToolChoice. `has_constraint`: the request also asks for structured
    outputs (response_format / structured_outputs), which a forced call cannot share."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice != "none":
            raise APIError("tool_choice needs tools", 400, "tool_choice")
        return ToolChoice("none")
    functions = _functions(tools)
    if tool_choice in ("none", "auto"):
        return ToolChoice(tool_choice)
    if tool_choice == "required":
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [name]},
                            "parameters": params,
                        },
                        "required": ["name", "parameters"],
                    }
                    for name, params in functions.items()
                ],
            },
        }
        choice = ToolChoice("required", schema=schema)
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}",
                400,
                "tool_choice",
            )
        if name not in functions:
            raise APIError(f"tool_choice names {name!r}, which is not in tools", 400, "tool_choice")
        choice = ToolChoice("named", name=name, schema=functions[name])
    else:
        raise APIError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
            f"{tool_choice!r}",
            400,
            "tool_choice",
        )
    if has_constraint:
        raise APIError(
            "a forced tool call (tool_choice 'required' or a named function) cannot be combined "
            "with response_format or structured_outputs",
            400,
            "tool_choice",
        )
    return choice


def tool_call_id() -> str:
    return f"chatcmpl-tool-{random_uuid()}"


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """A `tool_calls` entry. Arguments decoded from the model's JSON and written again can
    hold lone surrogates (its `\\ud800` escapes), which no UTF-8 response can carry: they
    stay escapes."""
    return {
        "id": tool_call_id(),
        "type": "function",
        "function": {"name": escape_surrogates(name), "arguments": escape_surrogates(arguments)},
    }


def call_from_object(obj: Any) -> dict[str, Any] | None:
    """The `tool_calls` entry of a call the model wrote as `{"name": ..., "arguments" or
    "parameters": {...}}`, or None where `obj` is no such call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return tool_call(obj["name"], args)


def tool_calls_from_text(choice: ToolChoice, text: str) -> list[dict[str, Any]] | None:
    """The calls a forced output holds, or None where it holds no whole list of them (an
    output cut short)."""
    if choice.mode == "named":
        return [tool_call(choice.name or "", text)]
    try:
        objs = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(objs, list) or not objs:
        return None
    calls = [c for c in map(call_from_object, objs) if c is not None]
    return calls if len(calls) == len(objs) else None
