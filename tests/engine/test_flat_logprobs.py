"""`SamplingParams.flat_logprobs`: `FlatLogprobs` in place of lists of dicts (vLLM's), the same
values either way."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.logprobs import FlatLogprobs, Logprob
from pagoda.sampling_params import RequestOutputKind

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=1024, seed=0)


def test_flat_container_reads_as_a_list_of_dicts() -> None:
    flat = FlatLogprobs()
    flat.append(None)
    flat.extend([{5: Logprob(-0.5, 1, "a"), 7: Logprob(-1.5, 2, "b")}, {9: Logprob(-2.0, 3)}])
    assert len(flat) == 3 and flat[0] == {} and flat[2] == {9: Logprob(-2.0, 3)}
    assert list(flat)[1] == {5: Logprob(-0.5, 1, "a"), 7: Logprob(-1.5, 2, "b")}
    tail = flat[1:]
    assert isinstance(tail, FlatLogprobs) and list(tail) == list(flat)[1:]
    assert tail.start_indices == [0, 2] and tail.token_ids == [5, 7, 9]
    assert flat[3:] == FlatLogprobs()
    with pytest.raises(TypeError):
        del flat[0]
    with pytest.raises(TypeError):
        flat[0] = {}


def _as_lists(logprobs) -> list:
    return [None if p is None or p == {} else p for p in logprobs]


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_flat_and_list_logprobs_hold_the_same_values(llm: LLM, kind) -> None:
    def run(flat: bool) -> list:
        params = SamplingParams(
            temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, n=2, seed=0,
            flat_logprobs=flat, output_kind=kind,
        )  # fmt: skip
        engine = llm.llm_engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"flat-{flat}-{kind.name}-{i}", p, params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs

    lists, flats = run(False), run(True)
    assert len(lists) == len(flats)
    for a, b in zip(lists, flats):
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        if b.prompt_logprobs is not None:
            assert isinstance(b.prompt_logprobs, FlatLogprobs)
            assert b.prompt_logprobs[0] == {} and a.prompt_logprobs[0] is None  # as vLLM
            assert _as_lists(b.prompt_logprobs) == _as_lists(a.prompt_logprobs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert isinstance(cb.logprobs, FlatLogprobs) and len(cb.logprobs) == len(cb.token_ids)
            assert list(cb.logprobs) == ca.logprobs and cb.token_ids == ca.token_ids
            assert cb.cumulative_logprob == ca.cumulative_logprob


def test_a_stop_string_trims_flat_logprobs(llm: LLM) -> None:
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    stop = full[0].outputs[0].text.strip()[3:6]
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop], logprobs=1)
    a = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    params.flat_logprobs = True
    b = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert a.finish_reason == b.finish_reason == "stop"
    assert len(b.logprobs) == len(b.token_ids) and list(b.logprobs) == a.logprobs
