"""Async scheduling (`SchedulerConfig.async_scheduling`) changes when the host works, never what
is generated: on the embedded model (fp32, CPU, where it can be turned on to test the logic),
outputs with it on equal outputs with it off, through stops, preemption, seeds, logprobs,
penalties and bad_words (which run synchronously) and aborts."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "你是一个AI助手。请回答：什么是机器学习？",
    "def fibonacci(n):",
    "Say hello.",
    "Explain paged attention in one sentence.",
]


def _llm(async_scheduling: bool, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    return LLM(dtype="float32", seed=0, async_scheduling=async_scheduling, **kwargs)


def _outputs(llm: LLM, params) -> list[tuple]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
        for o in outs
        for c in o.outputs
    ]


def _count_run_ahead(llm: LLM) -> list[int]:
    """Counts the steps whose inputs took tokens still in flight (placeholder rows)."""
    runner = llm.llm_engine.executor.model_runner
    calls = [0]
    fill = runner._fill_placeholders

    def counted(step):
        calls[0] += 1
        return fill(step)

    runner._fill_placeholders = counted
    return calls


PARAMS = {
    "greedy, stops and caps": [
        SamplingParams(temperature=0.0, max_tokens=5 + 9 * i, stop=[" the"] if i == 2 else None)
        for i in range(len(PROMPTS))
    ],
    "seeded samples, n=2, logprobs": SamplingParams(
        n=2, temperature=0.9, top_p=0.9, seed=7, max_tokens=16, logprobs=2
    ),
    "penalties and min_tokens (synchronous steps)": [
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3)
        if i % 2
        else SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4)
        for i in range(len(PROMPTS))
    ],
    # A word of several tokens reads the last tokens, so none may be in flight.
    "bad_words (synchronous steps)": SamplingParams(
        temperature=0.0, max_tokens=16, bad_words=["n == 0", "Paris"]
    ),
}


@pytest.fixture(scope="module")
def sync_llm() -> LLM:
    return _llm(False, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def async_llm() -> LLM:
    return _llm(True, max_num_batched_tokens=32)


@pytest.mark.parametrize("name", list(PARAMS))
def test_async_scheduling_does_not_change_outputs(name: str, sync_llm, async_llm) -> None:
    params = PARAMS[name]
    run_ahead = _count_run_ahead(async_llm)
    assert _outputs(async_llm, params) == _outputs(sync_llm, params)
    if "synchronous" not in name:
        assert run_ahead[0] > 0  # steps did take their input tokens from the device
    assert async_llm.llm_engine.num_used_blocks == 0


def test_async_scheduling_with_preemption(sync_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tiny = _llm(True, max_model_len=96, num_gpu_blocks_override=9)
    assert _outputs(tiny, params) == _outputs(sync_llm, params)
    assert tiny.llm_engine.num_preemptions_total > 0


def test_abort_while_a_step_is_in_flight(async_llm) -> None:
    engine = async_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(["1", "3"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {"0": 30, "2": 30, "4": 30}
    assert engine.num_used_blocks == 0 and engine._in_flight is None


def test_async_scheduling_defaults_off_on_cpu() -> None:
    from pagoda.engine.arg_utils import EngineArgs

    assert not EngineArgs(device="cpu").create_engine_config().scheduler_config.async_scheduling
    on = EngineArgs(device="cpu", async_scheduling=True).create_engine_config()
    assert on.scheduler_config.async_scheduling
