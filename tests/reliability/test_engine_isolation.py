"""One request's failure is that request's alone: in the engine (a fault injected into one
request's output processing; a structured-outputs constraint too slow to apply; on the embedded
model) and over HTTP (the fake engine's "error" finish: a 500 for that request, finish_reason
"error" and an in-band error in its stream)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from fake_engine import FakeEngine  # noqa: E402

from pagoda import LLM, RequestOutput, SamplingParams, StructuredOutputsParams  # noqa: E402
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


# xgrammar takes 0.66 s to compute this regex's first mask over the embedded model's vocabulary,
# 18 s a token a few tokens later (2-core AMD EPYC); ordinary constraints take microseconds.
SLOW_REGEX = "([^a]{1,50}[^b]{1,50}){1,50}"


def _run_beside_plain(llm: LLM, bad: SamplingParams) -> tuple[dict, list[int], list[float]]:
    """Run "plain" (12 greedy tokens) beside "bad"; returns the final outputs and plain's
    tokens when run alone. Every engine step must take less than 0.5 s."""
    engine = llm.llm_engine
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0]
    engine.add_request("plain", "The capital of France is", plain)
    engine.add_request("bad", "Write anything:", bad)  # compiled here (offline)
    final = {}
    try:
        while engine.has_unfinished_requests():
            t0 = time.monotonic()
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            took = time.monotonic() - t0
            assert took < 0.5, f"a step took {took:.2f} s"
    finally:
        engine.abort_request(["plain", "bad"])
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.num_used_blocks == 0 and engine.scheduler.get_num_unfinished_requests() == 0
    return final, alone.outputs[0].token_ids


def test_a_constraint_too_slow_to_apply_ends_its_request_alone(llm):
    """Each step waited for that regex's masks (0.66 s, then 11 s and more a step), so the
    request beside it crawled. Now the step waits no longer than the budget (100 ms by
    default) for a request's mask: past it that request ends with an error (here both of its
    samples: one step waits 2 x 100 ms) and the other goes on, its tokens as when it runs
    alone."""
    pytest.importorskip("xgrammar")
    so = StructuredOutputsParams(regex=SLOW_REGEX)
    bad = SamplingParams(temperature=0.0, max_tokens=12, n=2, structured_outputs=so)
    final, alone = _run_beside_plain(llm, bad)
    assert [c.finish_reason for c in final["bad"].outputs] == ["error", "error"]
    error = final["bad"].error
    assert "structured_outputs constraint took longer than 100 ms" in error, error
    assert "PAGODA_GRAMMAR_MASK_BUDGET_MS" in error and final["bad"].client_error
    assert final["plain"].error is None and final["plain"].outputs[0].token_ids == alone


def test_a_matcher_too_slow_to_advance_ends_its_request_alone(llm, monkeypatch):
    """The same budget holds for advancing the matcher past a sampled token (it runs on the
    step loop, timed after the fact): here the third token of a request takes 0.3 s."""
    pytest.importorskip("xgrammar")
    backend = llm.llm_engine.structured_output.backend
    new_state = backend.new_state

    class SlowThirdAccept:
        def __init__(self, matcher) -> None:
            self.matcher, self.accepted = matcher, 0

        def accept_token(self, token_id: int) -> bool:
            self.accepted += 1
            if self.accepted == 3:
                time.sleep(0.3)
            return self.matcher.accept_token(token_id)

        def __getattr__(self, name: str):
            return getattr(self.matcher, name)

    def slow_state(*args):
        state = new_state(*args)
        state.matcher = SlowThirdAccept(state.matcher)
        return state

    monkeypatch.setattr(backend, "new_state", slow_state)
    so = StructuredOutputsParams(regex="[ab]+")
    bad = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so)
    final, alone = _run_beside_plain(llm, bad)
    out = final["bad"].outputs[0]
    assert out.finish_reason == "error" and len(out.token_ids) == 3
    assert set(out.text) <= {"a", "b"}
    assert "longer than 100 ms to advance past one token" in final["bad"].error
    assert final["plain"].error is None and final["plain"].outputs[0].token_ids == alone


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


class AbandonedFills:
    """The structured-outputs manager as admission control sees it: `running` mask fills given
    up on still run; constraints are compiled already."""

    def __init__(self) -> None:
        self.num_abandoned_running = 0

    def compiled(self, params) -> bool:
        return True


def test_structured_requests_get_503_while_abandoned_fills_run(monkeypatch):
    """Each mask fill given up on keeps a core until xgrammar returns (seconds, for a
    pathological regex), and nothing bounded how many: a flood of such requests could take
    every core. While PAGODA_GRAMMAR_MAX_ABANDONED of them run, a new structured request gets
    503 with Retry-After; plain requests are served; once they end, structured ones are
    served again."""
    monkeypatch.setenv("PAGODA_GRAMMAR_MAX_ABANDONED", "2")
    fake = FakeEngine(max_model_len=64)
    fake.structured_output = fills = AbandonedFills()
    engine = AsyncLLM(fake)
    structured = {"prompt": "x", "max_tokens": 3, "structured_outputs": {"regex": "[ab]+"}}
    plain = {"prompt": "x", "max_tokens": 3}
    try:
        with TestClient(build_app(engine)) as c:
            fills.num_abandoned_running = 2
            r = c.post("/v1/completions", json=structured)
            assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
            assert "PAGODA_GRAMMAR_MAX_ABANDONED" in r.json()["error"]["message"]
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "response_format": {"type": "json_object"}, "stream": True}  # fmt: skip
            assert c.post("/v1/chat/completions", json=chat).status_code == 503
            assert c.post("/v1/completions", json=plain).status_code == 200
            fills.num_abandoned_running = 1
            assert c.post("/v1/completions", json=structured).status_code == 200
    finally:
        engine.shutdown()


def _wait_for_abandoned_fills(llm: LLM, timeout_s: float) -> None:
    """Until no mask fill given up on as too slow still runs on `llm`'s engine: the slow regex
    of the tests before leaves its masks running for seconds, longer on a slower machine."""
    manager = llm.llm_engine.structured_output
    deadline = time.monotonic() + timeout_s
    while manager.num_abandoned_running and time.monotonic() < deadline:
        time.sleep(0.05)
    running = manager.num_abandoned_running
    assert running == 0, f"{running} abandoned fills still run after {timeout_s} s"


def test_a_structured_request_waits_out_an_abandoned_fill_then_is_served(llm, monkeypatch):
    """On the embedded model, with one abandoned fill allowed: a request whose mask takes 1.5 s
    (injected) ends with an error after the budget; while that fill runs on, a structured
    request is refused as busy and a plain one is served; after it, structured requests are
    served again."""
    pytest.importorskip("xgrammar")
    from pagoda.engine.exceptions import StructuredOutputsBusyError

    monkeypatch.setenv("PAGODA_GRAMMAR_MAX_ABANDONED", "1")
    manager = llm.llm_engine.structured_output
    backend = manager.backend
    new_state = backend.new_state

    def slow_state(params, *args):
        state = new_state(params, *args)
        if params.regex == "[ab]+":
            fill = state.fill_bitmask
            state.fill_bitmask = lambda *a: (time.sleep(1.5), fill(*a))[-1]
        return state

    monkeypatch.setattr(backend, "new_state", slow_state)

    def params(regex: str | None = None) -> SamplingParams:
        so = StructuredOutputsParams(regex=regex) if regex else None
        return SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so)

    async def run(rid: str, p: SamplingParams) -> RequestOutput:
        return [o async for o in engine.generate("Write:", p, rid)][-1]

    _wait_for_abandoned_fills(llm, 300)  # this test counts its own from zero
    engine = AsyncLLM(llm.llm_engine)
    try:
        bad = asyncio.run(run("bad", params("[ab]+")))
        assert bad.outputs[0].finish_reason == "error" and manager.num_abandoned_running == 1
        with pytest.raises(StructuredOutputsBusyError, match="retry later"):
            asyncio.run(run("refused", params("[cd]+")))
        assert asyncio.run(run("plain", params())).outputs[0].finish_reason == "length"
        _wait_for_abandoned_fills(llm, 30)  # the 1.5 s fill given up on
        good = asyncio.run(run("good", params("[cd]+"))).outputs[0]
        assert good.finish_reason == "length" and set(good.text) <= {"c", "d"}, good
    finally:
        engine.shutdown()
