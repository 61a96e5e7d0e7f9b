"""The split between the front end and the engine core: the core takes token ids and one
sample's sampling parameters and returns token ids; input processing (validation, n > 1
fan-out) and output processing (detokenizing, stop strings, fan-in) are the front end's."""

from __future__ import annotations

import json

import pytest
from model_testing import TINY_CONFIG

from pagoda import LLM, SamplingParams
from pagoda.core.outputs import EngineCoreOutput, EngineCoreRequest
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.core import EngineCore


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(path)


TINY_ARGS = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=64, seed=0)


def test_an_engine_core_without_a_tokenizer_serves_token_ids_end_to_end(tiny_dir) -> None:
    config = EngineArgs(model=tiny_dir, **TINY_ARGS).create_engine_config()
    core = EngineCore(config)
    assert core.tokenizer is None
    params = SamplingParams(temperature=0.0, max_tokens=5)
    core.add_requests([EngineCoreRequest("a", [1, 2, 3, 4], params, 0.0, None, 5)])
    outs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        result = core.step()
        outs += result.outputs
    assert all(type(o) is EngineCoreOutput for o in outs)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 5 and outs[-1].finish_reason == "length"
    # The same request through the front end (LLM) gives the same tokens.
    llm = LLM(tiny_dir, **TINY_ARGS)
    got = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, use_tqdm=False)[0]
    assert list(got.outputs[0].token_ids) == tokens
    assert core.scheduler.kv_cache_manager.block_pool.num_used_blocks == 0


def test_n_samples_fan_out_into_one_sample_requests_and_back_in(tiny_dir) -> None:
    llm = LLM(tiny_dir, **TINY_ARGS)
    seen: list[EngineCoreRequest] = []
    add = llm.llm_engine.engine_core.add_requests
    llm.llm_engine.engine_core.add_requests = lambda reqs: (seen.extend(reqs), add(reqs))[1]
    prompt = {"prompt_token_ids": [5, 6, 7]}
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [r.request_id for r in seen] == ["0_0", "1_0", "2_0"]
    assert [(r.sampling_params.n, r.sampling_params.seed) for r in seen] == [
        (1, 11),
        (1, 12),
        (1, 13),
    ]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # Each sample is what a one-sample request with its seed generates.
    for i, c in enumerate(out.outputs):
        one = SamplingParams(n=1, temperature=1.0, seed=11 + i, max_tokens=6)
        alone = llm.generate(prompt, one, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids


def test_a_stop_string_aborts_the_request_in_the_core_and_frees_its_blocks() -> None:
    llm = LLM(dtype="float32", max_model_len=256, seed=0)
    engine = llm.llm_engine
    prompt = "def fibonacci(n):"
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    full = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    stop = full.strip()[3:6]
    assert stop
    aborted: list[list[str]] = []
    abort = engine.engine_core.abort_requests
    engine.engine_core.abort_requests = lambda ids: (aborted.append(list(ids)), abort(ids))[1]
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=200, stop=[stop]))
    steps = 0
    final = None
    while final is None:
        steps += 1
        final = next((o for o in engine.step() if o.finished), None)
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert steps < 20  # not run to max_tokens
    assert aborted == [["s"]]  # the core was told at once...
    scheduler = engine.engine_core.scheduler
    assert "s" not in scheduler.requests  # ...and let go of it, blocks and all
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_load_shedding_drops_a_request_only_when_none_of_its_samples_ran(tiny_dir) -> None:
    import time

    engine = LLM(tiny_dir, max_num_seqs=1, **TINY_ARGS).llm_engine
    prompt = {"prompt_token_ids": [1, 2, 3]}
    engine.add_request("g", prompt, SamplingParams(n=2, max_tokens=4))
    engine.add_request("w", prompt, SamplingParams(max_tokens=4))
    engine.step()  # one running place: "0_g" runs, "1_g" and "w" wait
    assert engine.abort_expired_waiting(0.0, time.time() + 10) == ["w"]
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["g"] and len(outs[0].outputs) == 2


def test_offline_priorities_need_the_priority_policy(tiny_dir) -> None:
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        LLM(tiny_dir, **TINY_ARGS).generate(prompts, params, priority=[1, 0], use_tqdm=False)
    llm = LLM(tiny_dir, scheduling_policy="priority", **TINY_ARGS)
    outs = llm.generate(prompts, params, priority=[1, 0], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
