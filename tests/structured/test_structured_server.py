"""Structured outputs over HTTP: a real server (the engine core in its own process, so the
params cross the process boundary) driven by the `openai` client."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_structured_engine import PHONE, SCHEMA, check_schema

pytest.importorskip("xgrammar")

MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    port = _free_port()
    cmd = [
        sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--port", str(port),
        "--max-model-len", "512", "--served-model-name", MODEL, "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", str(64 << 20), "--uvicorn-log-level", "warning",
        "--disable-log-stats",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read().decode()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 120:
                raise RuntimeError("server did not answer /health within 120 s")
            time.sleep(0.05)
        yield base
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_chat_json_schema(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=150,
        temperature=0,
        response_format=RESPONSE_FORMAT,
    )
    assert resp.choices[0].finish_reason == "stop"
    check_schema(resp.choices[0].message.content)


def test_chat_json_schema_stream(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=150,
        temperature=0.8,
        seed=4,
        stream=True,
        response_format=RESPONSE_FORMAT,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check_schema(text)


def test_json_object_and_vllm_extra_body(client):
    resp = client.completions.create(
        model=MODEL,
        prompt="A JSON object:",
        max_tokens=100,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].text), dict)
    resp = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=20,
        n=2,
        seed=1,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": PHONE}},
    )
    assert all(re.fullmatch(PHONE, c.text) for c in resp.choices)
    resp = client.completions.create(
        model=MODEL,
        prompt="The best pet is a",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["cat", "dog"]}},
    )
    assert resp.choices[0].text in ("cat", "dog")


INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
        "invalid response_format.json_schema.schema",
    ),
    ({"structured_outputs": {"regex": "(abc"}}, "invalid structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "invalid structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"jsn": {}}}, "no field 'jsn' \\(its fields: json, regex"),
    ({"structured_outputs": {"json": {}, "foo": 1}}, "no field 'foo'"),
    ({"response_format": {"type": "xml"}}, "response_format"),
]


def _each_is_400(url: str, cases: list, messages: list, named: bool = False) -> None:
    """Each (body, pattern) of `cases`, streamed and not, is a 400 whose message matches;
    `named`: its param is the body's field that set the constraint."""
    for body, match in cases:
        for stream in (False, True):
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 5, "stream": stream}
                | body,
                timeout=30,
            )
            assert r.status_code == 400, r.text
            assert re.search(match, r.json()["error"]["message"]), r.text
            assert not named or r.json()["error"]["param"] == next(iter(body)), r.text


def test_invalid_constraint_is_400_and_server_keeps_serving(url, client):
    _each_is_400(url, INVALID, MESSAGES, named=True)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        timeout=60,
        extra_body={"structured_outputs": {"choice": ["ok"]}},
    )
    assert resp.choices[0].message.content == "ok"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A greedy request that must call one of the two tools.
REQUIRED_CALLS = dict(
    model=MODEL,
    messages=TOOL_MESSAGES,
    tools=[WEATHER, TIME],
    tool_choice="required",
    max_tokens=120,
    temperature=0,
)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_returns_a_call_to_it(client):
    kw = dict(
        model=MODEL,
        messages=TOOL_MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice=NAMED,
        max_tokens=60,
        temperature=0,
    )
    resp = client.chat.completions.create(**kw)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop" and not msg.content
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    # Streamed: the id and name first, then the arguments in pieces, the same call in all.
    stream = client.chat.completions.create(**kw, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 for p in pieces) and not any(d.content for d in deltas)
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_required_tool_choice_returns_calls_to_the_tools(client):
    resp = client.chat.completions.create(**REQUIRED_CALLS)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop" and not msg.content
    assert msg.tool_calls
    for call in msg.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert set(args) == ({"city"} if call.function.name == "get_weather" else set())
    # Streamed: each call its id and name first, then its arguments in pieces that add up to
    # the unstreamed ones.
    chunks = [c for c in client.chat.completions.create(**REQUIRED_CALLS, stream=True) if c.choices]
    pieces = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.content for c in chunks)
    streamed: dict[int, list[str]] = {}
    for t in pieces:
        if t.id:
            assert t.index not in streamed and t.type == "function"
            streamed[t.index] = [t.function.name, ""]
        streamed[t.index][1] += t.function.arguments or ""
    assert sorted(streamed) == list(range(len(streamed)))
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [
        (t.function.name, t.function.arguments) for t in msg.tool_calls
    ]
    assert len(pieces) > len(streamed)  # arguments after the name, as they came


def test_required_tool_choice_streams_each_choice_with_its_logprobs(client):
    stream = client.chat.completions.create(**REQUIRED_CALLS, n=2, logprobs=True, stream=True)
    calls: dict[int, dict[int, list[str]]] = {0: {}, 1: {}}
    tokens = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                tokens[choice.index] += len(choice.logprobs.content)
            for t in choice.delta.tool_calls or []:
                if t.id:
                    calls[choice.index][t.index] = [t.function.name, ""]
                calls[choice.index][t.index][1] += t.function.arguments or ""
    for index in (0, 1):
        assert calls[index] and tokens[index] > 0  # logprobs come with the chunks, not held
        for name, arguments in calls[index].values():
            assert name in ("get_weather", "get_time")
            assert set(json.loads(arguments)) == ({"city"} if name == "get_weather" else set())


def test_tool_choice_none_and_a_cut_short_call(client):
    def ask(tool_choice: str, max_tokens: int):
        return client.chat.completions.create(
            model=MODEL,
            messages=TOOL_MESSAGES,
            tools=[WEATHER],
            tool_choice=tool_choice,
            max_tokens=max_tokens,
            temperature=0,
        )

    resp = ask("none", 8)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls
    # "required" cut by max_tokens: no whole list of calls, so the text comes as content.
    resp = ask("required", 4)
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content.startswith("[")
    assert not resp.choices[0].message.tool_calls


def test_a_required_call_cut_short_reads_the_same_streamed_or_not(client):
    # Cut by max_tokens after the first call's name: its arguments so far, as the stream
    # sends them, and no content, streamed or not.
    kw = dict(REQUIRED_CALLS, max_tokens=20)
    resp = client.chat.completions.create(**kw)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "length" and not msg.content
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    pieces = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert not any(c.choices[0].delta.content for c in chunks)
    assert pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


BAD_TOOLS = [
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "not in tools",
    ),
    ({"tool_choice": "required"}, "needs tools"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "cannot be combined",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
            "tool_choice": "required",
        },
        r"invalid tools \(the function's parameters\)",
    ),
]


def test_bad_tools_are_400_and_server_keeps_serving(url, client):
    _each_is_400(url, BAD_TOOLS, TOOL_MESSAGES)
    resp = client.chat.completions.create(
        model=MODEL, messages=TOOL_MESSAGES, tools=[WEATHER], tool_choice=NAMED, max_tokens=40
    )
    assert resp.choices[0].message.tool_calls[0].function.name == "get_weather"
