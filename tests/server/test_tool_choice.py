"""`tool_choice` resolved to a constraint and read back into `tool_calls`
(`pagoda.server.tool_choice`); the real server runs it in tests/structured."""

from __future__ import annotations

import json

import pytest

from pagoda.server.serving import APIError
from pagoda.server.tool_choice import resolve_tool_choice, tool_calls_from_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]


def test_default_is_auto_with_tools_and_none_without() -> None:
    assert resolve_tool_choice(TOOLS, None, False).mode == "auto"
    assert not resolve_tool_choice(TOOLS, None, False).forced
    assert resolve_tool_choice(None, None, False).mode == "none"
    assert resolve_tool_choice(TOOLS, "none", False).mode == "none"


def test_named_function_is_constrained_by_its_parameters() -> None:
    choice = resolve_tool_choice(
        TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False
    )
    assert choice.mode == "named" and choice.name == "get_weather"
    assert choice.schema == WEATHER["function"]["parameters"]
    calls = tool_calls_from_text(choice, '{"city": "Paris"}')
    assert calls is not None and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    no_params = resolve_tool_choice(
        TOOLS, {"type": "function", "function": {"name": "get_time"}}, False
    )
    assert no_params.schema == {"type": "object", "properties": {}}


def test_required_is_a_list_of_calls_to_the_tools() -> None:
    choice = resolve_tool_choice(TOOLS, "required", False)
    assert choice.mode == "required"
    assert choice.schema["type"] == "array" and choice.schema["minItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in choice.schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    text = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": "Zürich"}},
            {"name": "get_time", "parameters": {}},
        ]
    )
    calls = tool_calls_from_text(choice, text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich"}
    assert "Zürich" in calls[0]["function"]["arguments"]  # not \\u-escaped
    assert len({c["id"] for c in calls}) == 2
    # An output cut short holds no whole list of calls.
    assert tool_calls_from_text(choice, text[:-5]) is None
    assert tool_calls_from_text(choice, "[]") is None


@pytest.mark.parametrize(
    "tools, tool_choice, constraint, match",
    [
        (None, "required", False, "needs tools"),
        (None, "auto", False, "needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, False, "not in tools"),
        (TOOLS, {"type": "function"}, False, "must be"),
        (TOOLS, "sometimes", False, "must be"),
        (TOOLS, "required", True, "cannot be combined"),
        ([{"type": "function"}], "auto", False, r"tools\[0\]"),
        ([{"type": "function", "function": {"name": ""}}], "auto", False, "name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "auto",
            False,
            "parameters",
        ),
        ({"not": "a list"}, "auto", False, "list"),
    ],
)
def test_bad_tools_or_choices_are_400s_naming_the_field(
    tools, tool_choice, constraint, match
) -> None:
    with pytest.raises(APIError, match=match) as e:
        resolve_tool_choice(tools, tool_choice, constraint)
    assert e.value.status == 400 and e.value.param in ("tools", "tool_choice")


def test_auto_with_structured_outputs_is_allowed() -> None:
    assert resolve_tool_choice(TOOLS, "auto", True).mode == "auto"
