"""One request's failure is that request's alone: in the engine (a fault injected into one
request's output processing, on the embedded model) and over HTTP (the fake engine's "error"
finish: a 500 for that request, finish_reason "error" and an in-band error in its stream)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from fake_engine import FakeEngine  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.engine.async_llm import AsyncLLM  # noqa: E402
from pagoda.server.app import build_app  # noqa: E402


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, dtype="float32")


def test_a_failure_in_one_requests_output_processing_fails_it_alone(llm, monkeypatch):
    engine = llm.llm_engine
    processor = engine.output_processor
    append = processor._append_tokens

    def faulty(state, out):
        if state.parent.request_id == "bad" and len(state.token_ids) >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return append(state, out)

    monkeypatch.setattr(processor, "_append_tokens", faulty)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for rid in ("good-1", "bad", "good-2"):
        engine.add_request(rid, "The capital of France is", params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].outputs[0].finish_reason == "error"
    assert "UnicodeDecodeError" in final["bad"].error
    for rid in ("good-1", "good-2"):
        assert final[rid].error is None and len(final[rid].outputs[0].token_ids) == 12
    assert engine.num_used_blocks == 0 and engine.scheduler.get_num_unfinished_requests() == 0
    stats = engine.last_iteration_stats.finished_requests
    assert stats is not None
    monkeypatch.undo()
    out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12  # the engine goes on serving


@pytest.fixture
def client():
    engine = AsyncLLM(FakeEngine(max_model_len=64, step_delay=0.005))
    with TestClient(build_app(engine)) as c:
        yield c
    engine.shutdown()


def test_an_engine_error_is_a_500_for_that_request_only(client):
    async def both() -> list:
        import httpx

        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await asyncio.gather(
                c.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 8}),
                c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 8}),
            )

    bad, good = asyncio.run(both())
    assert bad.status_code == 500 and "failed in the engine" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8


def test_an_engine_error_in_a_stream_is_finish_reason_error_then_an_error_event(client):
    r = client.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 8, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "error"
    assert chunks[-1]["error"]["code"] == 500
