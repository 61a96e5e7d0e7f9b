"""Tool calls read out of free text (`pagoda.server.tool_parsers`, --tool-call-parser): the
hermes, llama3_json, mistral and pythonic formats whole and streamed in every chunking, and
through the server against the fake engine (which answers a prompt's `SAY:<text>|` with that
text)."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from pagoda.engine.async_llm import AsyncLLM
from pagoda.server import serving_chat
from pagoda.server.app import build_app
from pagoda.server.cli import make_arg_parser
from pagoda.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    StreamingToolCalls,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Hello there.", "Hello there.", []),
        (CALL, None, [("get_weather", {"city": "Zürich"})]),
        (
            "Let me look. " + TWO,
            "Let me look. ",
            [("get_weather", {"city": "Zürich"}), ("get_time", {})],
        ),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # no end tag
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
    ],
)
def test_hermes_whole_output(text, content, calls):
    got_content, got_calls = HermesToolParser().extract(text)
    assert got_content == content and _names_args(got_calls) == calls
    assert all(c["id"].startswith("chatcmpl-tool-") for c in got_calls)
    if calls:
        assert "Zürich" in got_calls[0]["function"]["arguments"] or calls[0][1] != {
            "city": "Zürich"
        }


LLAMA = '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
LLAMA_TWO = LLAMA + '; {"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Hello there.", "Hello there.", []),
        (LLAMA, None, [("get_weather", {"city": "Zürich"})]),
        (
            "<|python_tag|>" + LLAMA_TWO,
            None,
            [("get_weather", {"city": "Zürich"}), ("get_time", {})],
        ),
        ("  " + LLAMA + "\n", None, [("get_weather", {"city": "Zürich"})]),
        ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),  # cut
        ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
        ("Sure: " + LLAMA, "Sure: " + LLAMA, []),  # calls only as the whole output
    ],
)
def test_llama3_json_whole_output(text, content, calls):
    got_content, got_calls = Llama3JsonToolParser().extract(text)
    assert got_content == content and _names_args(got_calls) == calls


MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
MISTRAL += '{"name": "get_time", "arguments": {}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[ARGS]{}'
BOTH = [("get_weather", {"city": "Zürich"}), ("get_time", {})]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Hello there.", "Hello there.", []),
        (MISTRAL, None, BOTH),
        ("Let me look. " + MISTRAL_V11, "Let me look. ", BOTH),
        ('[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": ', None, []),  # cut short
        ("[TOOL_CALLS]f[ARGS]{bad", None, []),
        ('[TOOL_CALLS][{"arguments": {}}]', None, []),  # no name
        ("[TOOL_CALLS][]", None, []),
    ],
)
def test_mistral_whole_output(text, content, calls):
    got_content, got_calls = MistralToolParser().extract(text)
    assert _names_args(got_calls) == calls
    assert got_content == (content if calls else text)


@pytest.mark.parametrize(
    "text, calls",
    [
        ("Hello there.", []),
        ('[get_weather(city="Zürich"), get_time()]', BOTH),
        ('<|python_start|>[get_weather(city="Zürich"), get_time()]<|python_end|>', BOTH),
        (
            "[f(a=1, b=[1, 2], c={'k': None}, d=True)]",
            [("f", {"a": 1, "b": [1, 2], "c": {"k": None}, "d": True})],
        ),
        ("[f(1)]", []),  # positional arguments
        ("[f(a=g())]", []),  # not a literal
        ("[1, 2]", []),
        ("[]", []),
        ('[f(a="x"', []),  # cut short
        ("Sure: [f()]", []),  # calls only as the whole output
    ],
)
def test_pythonic_whole_output(text, calls):
    content, got_calls = PythonicToolParser().extract(text)
    assert _names_args(got_calls) == calls
    assert content == (None if calls else text)


@pytest.mark.parametrize(
    "parser, text",
    [
        (HermesToolParser(), "Hello <tool but not a call"),
        (HermesToolParser(), "Let me look. " + TWO),
        (HermesToolParser(), "<tool_call>bad"),
        (Llama3JsonToolParser(), " <|python_tag|>" + LLAMA_TWO),
        (Llama3JsonToolParser(), "<|python is a language"),
        (Llama3JsonToolParser(), "Sure: " + LLAMA),
        (Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": '),
        (MistralToolParser(), "Let me look. " + MISTRAL_V11),
        (MistralToolParser(), MISTRAL),
        (MistralToolParser(), "A [TOOL but not a call"),
        (MistralToolParser(), "[TOOL_CALLS]f[ARGS]{bad"),
        (PythonicToolParser(), '[get_weather(city="Zürich"), get_time()]'),
        (PythonicToolParser(), "<|python_start|>[f()]<|python_end|>"),
        (PythonicToolParser(), "[1] Smith et al."),
        (PythonicToolParser(), "<|python is a language"),
    ],
)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_streamed_in_any_chunks_gives_the_whole_outputs_answer(parser, text, size):
    split = StreamingToolCalls(parser)
    sent = "".join(split.feed(text[i : i + size]) for i in range(0, len(text), size))
    rest, calls = split.finish()
    content, whole_calls = parser.extract(text)
    assert sent + rest == (content or "" if whole_calls else text)
    assert _names_args(calls) == _names_args(whole_calls)
    if whole_calls:  # nothing of the calls went out as content
        assert not any(m in sent for m in ("<tool_c", '"name"', "[TOOL", "[", "get_"))


def test_cli_flags_take_the_parsers():
    args = make_arg_parser().parse_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    )
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    choices = next(a.choices for a in make_arg_parser()._actions if a.dest == "tool_call_parser")
    assert sorted(choices) == sorted(TOOL_PARSERS)


@pytest.fixture
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=1024))
    with TestClient(build_app(llm, tool_call_parser="hermes")) as c:
        yield c
    llm.shutdown()


def _chat(client, text: str, stream: bool, **kw):
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": f"SAY:{text}|"}],
        "temperature": 0,
        "max_tokens": 200,
        "stream": stream,
    } | kw
    return client.post("/v1/chat/completions", json=body)


def test_auto_tool_calls_through_the_server(client):
    text = "Let me look. " + TWO
    r = _chat(client, text, False, tools=TOOLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look. "
    assert _names_args(choice["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Zürich"}),
        ("get_time", {}),
    ]
    # Streamed: the same content, then the calls with the finish.
    r = _chat(client, text, True, tools=TOOLS)
    events = [json.loads(e[6:]) for e in r.text.splitlines() if e.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me look. "
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert _names_args(calls) == _names_args(choice["message"]["tool_calls"])
    assert [t["index"] for t in calls] == [0, 1]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    # No tools in the request, or tool_choice "none": the text as it is.
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = _chat(client, text, False, **kw)
        assert r.json()["choices"][0]["message"]["content"] == text
        assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_escape_in_the_arguments_stays_an_escape(client, stream):
    # json.loads makes the model's "\ud800" a lone surrogate, which UTF-8 cannot hold: the
    # response carries the same escape, not a 500 (or an in-band error when streamed).
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800 Z"}}</tool_call>'
    r = _chat(client, text, stream, tools=TOOLS)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(e[6:]) for e in r.text.splitlines() if e.startswith("data: {")]
        assert all("error" not in e for e in events), r.text
        calls = [t for e in events if e["choices"] for t in e["choices"][0]["delta"].get("tool_calls") or []]  # fmt: skip
    else:
        calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert _names_args(calls) == [("get_weather", {"city": "\ud800 Z"})]


@pytest.mark.parametrize(
    "parser, text, content",
    [
        ("llama3_json", LLAMA_TWO, ""),
        ("mistral", "Let me look. " + MISTRAL, "Let me look. "),
        ("pythonic", '[get_weather(city="Zürich"), get_time()]', ""),
    ],
)
def test_each_parser_through_the_server(parser, text, content, monkeypatch):
    built = []
    real = serving_chat.build_sampling_params
    monkeypatch.setattr(
        serving_chat, "build_sampling_params", lambda *a: built.append(real(*a)) or built[-1]
    )
    llm = AsyncLLM(FakeEngine(max_model_len=1024))
    try:
        with TestClient(build_app(llm, tool_call_parser=parser)) as client:
            for stream in (False, True):
                r = _chat(client, text, stream, tools=TOOLS)
                assert r.status_code == 200, r.text
                if stream:
                    events = [
                        json.loads(e[6:]) for e in r.text.splitlines() if e.startswith("data: {")
                    ]
                    deltas = [e["choices"][0] for e in events if e["choices"]]
                    sent = "".join(d["delta"].get("content") or "" for d in deltas)
                    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
                    finish = deltas[-1]["finish_reason"]
                else:
                    message = r.json()["choices"][0]["message"]
                    sent, calls = message["content"] or "", message["tool_calls"]
                    finish = r.json()["choices"][0]["finish_reason"]
                assert finish == "tool_calls" and _names_args(calls) == BOTH
                assert sent == content
            # [TOOL_CALLS] is a special token: kept in the output while tools may be called.
            assert [p.skip_special_tokens for p in built] == [parser != "mistral"] * 2
            r = _chat(client, text, False, tools=TOOLS, tool_choice="none")
            assert r.json()["choices"][0]["message"]["content"] == text
            assert built[-1].skip_special_tokens
    finally:
        llm.shutdown()
