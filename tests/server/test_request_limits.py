"""Over HTTP, the sampling fields get the same limits as `SamplingParams` offline: each bad value
is a 400 naming the field, never a request that reaches the engine and fails in its step."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from pagoda.engine.async_llm import AsyncLLM
from pagoda.sampling_params import MAX_N
from pagoda.server.app import build_app


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=64))
    with TestClient(build_app(llm)) as c:
        yield c
    llm.shutdown()


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("n", MAX_N + 1),
        ("temperature", 1e308),
        ("temperature", float("inf")),
        ("temperature", 2.5),
        ("top_p", float("nan")),
        ("presence_penalty", float("-inf")),
        ("logit_bias", {"5": float("inf")}),
        ("top_k", -2),
        ("best_of", 2),
        ("priority", 2**63),
    ],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_field_is_a_400_naming_it(client, route, field, value) -> None:
    if field == "best_of" and "chat" in route:
        pytest.skip("best_of is a completions field")
    body = {"max_tokens": 2, field: value}
    if "chat" in route:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    # json.dumps writes inf and nan as Infinity and NaN, which the server's parser accepts.
    r = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_limits_themselves_are_served(client) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2, "temperature": 2.0,
            "best_of": 1}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_priority_needs_the_priority_policy(client, route) -> None:
    """As vLLM: under FCFS a non-zero priority is a 400 naming it (it would be ignored), zero
    is served; under the priority policy any priority is served."""
    body = {"max_tokens": 2, "priority": -3}
    if "chat" in route:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = client.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert client.post(route, json={**body, "priority": 0}).status_code == 200
    engine = FakeEngine(max_model_len=64)
    engine.config.scheduler_config.policy = "priority"
    llm = AsyncLLM(engine)
    try:
        with TestClient(build_app(llm)) as c:
            assert c.post(route, json=body).status_code == 200
    finally:
        llm.shutdown()
