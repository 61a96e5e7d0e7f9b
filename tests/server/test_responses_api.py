"""OpenAI's Responses API (/v1/responses) on a real server of the embedded SmolLM2-135M, driven
by the official `openai` client: the same text and token counts as chat completions, OpenAI's
stream of typed events, stored responses and `previous_response_id`, `max_output_tokens`
cutting a response (status "incomplete"), and 400s / 404s naming the field. Greedy and a few
tokens each, on one server for the module."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from test_openai_server import KEY, MODEL, Server

from pagoda.server.protocol_responses import ResponsesResponse
from pagoda.server.serving_responses import ResponsesStore

STREAM_EVENTS_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_EVENTS_TAIL = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _count_tokens(server: Server, messages: list[dict[str, str]]) -> int:
    """The prompt tokens the chat template makes of `messages` (the server's /tokenize)."""
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages},
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_create_gives_chat_completions_text_and_usage(server, client):
    question = "What is 2+2? Answer with a number only."
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0
    )
    gen0 = server.metric("pagoda:generation_tokens_total")
    r = client.responses.create(model=MODEL, input=question, max_output_tokens=32, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].id.startswith("msg_") and r.output[0].status == "completed"
    part = r.output[0].content[0]
    assert part.type == "output_text" and part.annotations == []
    assert r.output_text == part.text == chat.choices[0].message.content
    u = r.usage
    assert u.input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert (
        u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    )
    assert r.temperature == 0 and r.max_output_tokens == 32 and r.text.format.type == "text"
    assert server.metric("pagoda:generation_tokens_total") == gen0 + u.output_tokens
    # A list of message items with text parts, and instructions, is the same chat.
    items = [{"role": "user", "content": [{"type": "input_text", "text": question}]}]
    r2 = client.responses.create(model=MODEL, input=items, max_output_tokens=32, temperature=0)
    assert r2.output_text == r.output_text
    r3 = client.responses.create(model=MODEL, input=question, instructions="Be brief.",
                                 max_output_tokens=4, temperature=0, metadata={"k": "v"},
                                 user="u1")  # fmt: skip
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    assert r3.usage.input_tokens == _count_tokens(server, system)
    assert (r3.instructions, r3.metadata, r3.user) == ("Be brief.", {"k": "v"}, "u1")


def test_stream_sends_openai_events_in_order(client):
    kw = dict(model=MODEL, input="Hi", max_output_tokens=32, temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == [*STREAM_EVENTS_HEAD, *["response.output_text.delta"] * len(deltas),
                     *STREAM_EVENTS_TAIL, "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert 1 < len(deltas) <= full.usage.output_tokens
    text = "".join(d.delta for d in deltas)
    assert text == full.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert {d.item_id for d in deltas} == {item_id}
    assert events[-4].text == text and events[-3].part.text == text
    assert events[-2].item.id == item_id and events[-2].item.content[0].text == text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.id == events[0].response.id


def test_retrieve_returns_the_stored_response(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    assert got.usage.model_dump() == r.usage.model_dump()
    streamed = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                            temperature=0, stream=True))  # fmt: skip
    final = streamed[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.retrieve(unstored.id)
    assert ei.value.body["param"] == "response_id" and unstored.id in ei.value.body["message"]


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model=MODEL, input="My name is Ann.", max_output_tokens=6,
                                    temperature=0, instructions="Be kind.")  # fmt: skip
    second = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4,
                                     temperature=0, previous_response_id=first.id)  # fmt: skip
    assert second.previous_response_id == first.id
    # The first exchange comes before the new input; its instructions do not (as OpenAI).
    history = [
        {"role": "user", "content": "My name is Ann."},
        {"role": "assistant", "content": first.output_text},
    ]
    alone = [{"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == _count_tokens(server, history + alone)
    assert second.usage.input_tokens > _count_tokens(server, alone) + first.usage.output_tokens
    # A chain: the third turn sees both exchanges, under its own instructions.
    third = client.responses.create(model=MODEL, input="Thanks.", max_output_tokens=2,
                                    temperature=0, previous_response_id=second.id,
                                    instructions="Be brief.")  # fmt: skip
    chain = [
        {"role": "system", "content": "Be brief."},
        *history,
        *alone,
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    assert third.usage.input_tokens == _count_tokens(server, chain)


def test_max_output_tokens_makes_the_response_incomplete(client):
    kw = dict(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_logprobs_are_included_when_asked_for(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 3 and "".join(lp.token for lp in lps) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)


def test_text_format_json_schema_constrains_the_output(client):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model=MODEL, input="What is 2+2? Answer in JSON.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "sum", "schema": schema}},
    )  # fmt: skip
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["answer"], int)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(input=[]), "input"),
        (dict(input=[{"role": "tool", "content": "x"}]), "input"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
         "input"),
        (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]), "input"),
        (dict(max_output_tokens=1000), "max_output_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(extra_body={"top_p": "high"}), "top_p"),
        (dict(top_logprobs=30), "top_logprobs"),
        (dict(tools=[{"type": "function", "name": "f", "parameters": {}}]), "tools"),
        (dict(background=True), "background"),
        (dict(truncation="auto"), "truncation"),
        (dict(include=["file_search_call.results"]), "include"),
        (dict(text={"format": {"type": "yaml"}}), "text"),
        (dict(metadata={str(i): "v" for i in range(17)}), "metadata"),
    ],
)  # fmt: skip
def test_bad_inputs_are_400s_naming_the_field(client, kwargs, param):
    kw = dict(model=MODEL, input="hi", max_output_tokens=2) | kwargs
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(**kw)
    assert ei.value.status_code == 400 and ei.value.body["param"] == param
    assert param in ei.value.body["message"]


def test_a_prompt_past_the_context_is_a_400_naming_input(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL, input="hello " * 300, max_output_tokens=2)
    assert ei.value.body["param"] == "input" and "context length" in ei.value.body["message"]


def test_unknown_ids_are_404s(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.retrieve("resp_unknown")
    assert ei.value.body["message"] == "Response with id 'resp_unknown' not found."
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown")
    assert ei.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    # A stored response has finished: only background responses (none run here) cancel.
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)


def test_stream_disconnect_aborts_the_request(server):
    aborted0 = server.metric("pagoda:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 200,
            "stream": True, "ignore_eos": True}  # fmt: skip
    deltas = 0
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 2:
                break  # leaving the block closes the connection mid-stream
    deadline = time.time() + 30
    while time.time() < deadline and (
        server.metric("pagoda:request_success_total", finished_reason="abort") < aborted0 + 1
    ):
        time.sleep(0.05)
    assert server.metric("pagoda:request_success_total", finished_reason="abort") == aborted0 + 1
    assert server.metric("pagoda:num_requests_running") == 0


def test_engine_failures_are_500s_or_failed_events_and_draining_503s():
    # On the fake engine (no model): a prompt holding FAIL_MARK fails after two tokens.
    from fake_engine import FAIL_MARK, FakeEngine
    from fastapi.testclient import TestClient

    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.server.app import build_app

    llm = AsyncLLM(FakeEngine())
    try:
        with TestClient(build_app(llm)) as c:
            body = {"input": "hi", "max_output_tokens": 3}
            assert c.post("/v1/responses", json=body).json()["status"] == "incomplete"
            failing = body | {"input": FAIL_MARK.decode(), "max_output_tokens": 8}
            r = c.post("/v1/responses", json=failing)
            assert r.status_code == 500 and "failed" in r.json()["error"]["message"]
            r = c.post("/v1/responses", json=failing | {"stream": True})
            types = [ln[len("event: ") :] for ln in r.text.splitlines() if ln.startswith("event: ")]
            assert types[:4] == STREAM_EVENTS_HEAD and types[-2:] == ["error", "response.failed"]
            failed = json.loads(r.text.strip().splitlines()[-1][len("data: ") :])["response"]
            assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
            llm.draining = True
            for stream in (False, True):
                r = c.post("/v1/responses", json=body | {"stream": stream})
                assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    finally:
        llm.shutdown()


def test_store_keeps_the_last_responses():
    store = ResponsesStore(2)
    made = [ResponsesResponse(status="completed", model="m") for _ in range(3)]
    for r in made:
        store.put(r, [])
    assert store.get(made[0].id) is None and len(store) == 2
    assert [store.get(r.id).response for r in made[1:]] == made[1:]
    none = ResponsesStore(0)
    none.put(made[0], [])
    assert none.get(made[0].id) is None
