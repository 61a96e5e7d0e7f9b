"""Scheduler behaviours: prefix hits, chunked prefill, budget, preemption, policies, stops."""

from __future__ import annotations

import pytest
from core_testing import check_block_invariants, make_request, make_scheduler

from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.core.request import RequestStatus
from pagoda.core.scheduler import Scheduler


def step(sched: Scheduler, token: int = 7, tokens: dict[str, list[int]] | None = None):
    """schedule() then feed back `token` (or tokens[rid]) for every request that samples."""
    out = sched.schedule()
    sampled = {}
    for req in sched.scheduled_requests(out):
        rid = req.request_id
        if out.num_computed_tokens[rid] + out.num_scheduled_tokens[rid] >= req.num_tokens:
            sampled[rid] = (tokens or {}).get(rid, [token])
    results = sched.update_from_output(out, ModelRunnerOutput(list(sampled), sampled))
    check_block_invariants(sched)
    return out, {r.request_id: r for r in results}


def test_prefix_hit_skips_prefill():
    sched = make_scheduler()
    prompt = [i % 1000 for i in range(500)]
    sched.add_request(make_request("a", prompt))
    step(sched)
    b = make_request("b", prompt)
    sched.add_request(b)
    out, _ = step(sched)
    assert b.num_cached_tokens >= 496
    assert out.num_computed_tokens["b"] == 496 and out.num_scheduled_tokens["b"] == 4
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (1000, 496)
    assert sched.make_stats().prefix_cache_queries == 0  # deltas


def test_prefix_hit_within_one_step():
    # Blocks are cached when scheduled, so a request admitted right after in the same step
    # already hits them (the runner writes every K/V of a layer before attention reads).
    sched = make_scheduler()
    prompt = list(range(100))
    sched.add_request(make_request("a", prompt))
    sched.add_request(make_request("b", prompt))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 100, "b": 4}


def test_chunked_prefill_respects_budget():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("a", list(range(200))))
    chunks = []
    for _ in range(4):
        out, results = step(sched)
        chunks.append(out.num_scheduled_tokens["a"])
        assert out.total_num_scheduled_tokens <= 64
    assert chunks == [64, 64, 64, 8]
    assert results["a"].new_token_ids == [7]  # only the last chunk samples


def test_decodes_not_starved_by_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_request(f"d{i}", [i, i + 1], max_tokens=50))
    step(sched)
    sched.add_request(make_request("long", list(range(1000)), max_tokens=5))
    for _ in range(5):
        out, _ = step(sched)
        assert [out.num_scheduled_tokens[f"d{i}"] for i in range(3)] == [1, 1, 1]
        assert out.num_scheduled_tokens["long"] == 61
        assert out.scheduled_req_ids[:3] == ["d0", "d1", "d2"]


def test_long_prefill_token_threshold_caps_long_prompts_only():
    sched = make_scheduler(max_num_batched_tokens=256, long_prefill_token_threshold=48)
    sched.add_request(make_request("d", [1, 2], max_tokens=50))
    step(sched)
    sched.add_request(make_request("long", list(range(100)), max_tokens=5))
    sched.add_request(make_request("short", list(range(500, 540)), max_tokens=5))
    chunks, short = [], []
    for _ in range(3):
        out, results = step(sched)
        assert out.num_scheduled_tokens["d"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
        short.append(out.num_scheduled_tokens["short"])
    assert chunks == [48, 48, 4]
    assert short == [40, 1, 1]  # not longer than the threshold: computed whole
    assert results["long"].new_token_ids == [7]
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_scheduler(long_prefill_token_threshold=-1)


def test_no_chunked_prefill_admits_only_whole_prompts():
    sched = make_scheduler(
        max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False
    )
    sched.add_request(make_request("a", list(range(60))))
    sched.add_request(make_request("b", list(range(100, 160))))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 60}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 60}


def test_preemption_frees_blocks_and_requeues():
    # 6 usable blocks of 4 tokens; two 8-token prompts fill 4, decodes need the rest.
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=64)
    a, b = make_request("a", list(range(8)), 14), make_request("b", list(range(50, 58)), 14)
    sched.add_request(a)
    sched.add_request(b)
    preempted_out = None
    for _ in range(12):
        out, _ = step(sched)
        if out.preempted_req_ids:
            preempted_out = out
            break
    assert preempted_out is not None and preempted_out.preempted_req_ids == {"b"}
    assert "b" not in preempted_out.num_scheduled_tokens  # fcfs: the latest admitted goes
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and "b" not in sched.kv_cache_manager.req_to_blocks
    assert sched.waiting.peek() is b and sched.make_stats().num_preemptions == 1
    num_b_tokens = b.num_tokens
    while "b" not in (out := step(sched)[0]).num_scheduled_tokens:
        pass
    # Resumed: prompt and generated tokens are computed again (the prefix cache may help).
    assert out.num_computed_tokens["b"] + out.num_scheduled_tokens["b"] == num_b_tokens
    assert b.status == RequestStatus.RUNNING


def test_preempting_itself_stops_scheduling_it():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=12)  # 3 usable blocks
    sched.add_request(make_request("a", list(range(4)), 8))
    sched.add_request(make_request("b", list(range(10, 14)), 8))
    sched.add_request(make_request("c", list(range(20, 24)), 8))
    step(sched)  # three 1-block prompts fill the cache
    out, _ = step(sched)  # a's first decode needs a block: c, then b are preempted
    assert out.preempted_req_ids == {"c", "b"} and out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_priority_policy_order():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio, t in [("late_hi", 0, 3.0), ("lo", 5, 1.0), ("early_hi", 0, 2.0)]:
        sched.add_request(make_request(rid, [1, 2, 3], 1, priority=prio, arrival_time=t))
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        order += out.scheduled_req_ids
    assert order == ["early_hi", "late_hi", "lo"]


def test_priority_preempts_lowest_priority_running():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=12, policy="priority")
    for rid, prio in [("p1", 1), ("p0", 0), ("p2", 2)]:
        sched.add_request(make_request(rid, [prio] * 4, 8, priority=prio, arrival_time=prio))
    out, _ = step(sched)
    assert out.scheduled_req_ids == ["p0", "p1", "p2"]
    out, _ = step(sched)  # p0 needs a block: the lowest priority (p2), then p1, go
    assert out.preempted_req_ids == {"p2", "p1"} and out.num_scheduled_tokens == {"p0": 1}


def test_fcfs_order_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [i] * 3, 4, arrival_time=float(i)))
    seen = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert sched.num_running <= 2 and len(out.scheduled_req_ids) <= 2
        seen += [rid for rid in out.scheduled_req_ids if rid not in seen]
    assert seen == [f"r{i}" for i in range(5)]


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    run, wait = make_request("run", list(range(40))), make_request("wait", list(range(40)))
    sched.add_request(run)
    sched.add_request(wait)
    out = sched.schedule()  # "run" is scheduled; abort it while the step is "executing"
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("run", RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    assert sched.update_from_output(out, ModelRunnerOutput(["run"], {"run": [5]})) == []
    assert run.output_token_ids == [] and run.get_finish_reason() == "abort"
    assert wait.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.num_waiting == sched.num_running == 0
    check_block_invariants(sched)
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks
    assert sched.schedule().finished_req_ids == {"run", "wait"}
    assert sched.schedule().finished_req_ids == set()
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("x", RequestStatus.RUNNING)


def test_eos_and_stop_token_ids_and_min_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("eos", [1, 2], 10, eos_token_id=0))
    sched.add_request(make_request("min", [1, 2], 10, eos_token_id=0, min_tokens=2))
    sched.add_request(make_request("ign", [1, 2], 10, eos_token_id=0, ignore_eos=True))
    sched.add_request(make_request("stop", [1, 2], 10, eos_token_id=0, stop_token_ids=[9]))
    _, res = step(sched, tokens={"eos": [0], "min": [0], "ign": [0], "stop": [9]})
    assert res["eos"].finish_reason == "stop" and res["eos"].stop_reason is None
    assert res["stop"].finish_reason == "stop" and res["stop"].stop_reason == 9
    assert not res["min"].finished and not res["ign"].finished
    _, res = step(sched, tokens={"min": [0], "ign": [0]})
    assert res["min"].finish_reason == "stop" and res["min"].new_token_ids == [0]
    assert not res["ign"].finished
    assert sched.get_num_unfinished_requests() == 1


def test_length_cap():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("max_tokens", [1, 2], 3))
    sched.add_request(make_request("model_len", [1, 2, 3, 4, 5], 100))
    outputs = {"max_tokens": [], "model_len": []}
    while sched.has_unfinished_requests():
        _, res = step(sched)
        for rid, r in res.items():
            outputs[rid] += r.new_token_ids
            if r.finished:
                assert r.finish_reason == "length"
    assert len(outputs["max_tokens"]) == 3 and len(outputs["model_len"]) == 3


def test_spec_tokens_scheduled_and_rejected_drafts_rolled_back():
    sched = make_scheduler(block_size=4)
    req = make_request("r", [1, 2, 3], 20)
    sched.add_request(req)
    step(sched, token=4)  # prompt + first token: 4 known, 3 computed
    req.spec_token_ids = [5, 6, 7]
    out = sched.schedule()
    assert out.num_scheduled_tokens["r"] == 4 and out.scheduled_spec_decode_tokens == {
        "r": [5, 6, 7]
    }
    assert out.num_computed_tokens["r"] == 3
    # Drafts 5, 6 accepted, 7 rejected, 8 sampled in its place.
    res = sched.update_from_output(out, ModelRunnerOutput(["r"], {"r": [5, 6, 8]}))
    assert res[0].new_token_ids == [5, 6, 8]
    assert req.num_computed_tokens == req.num_tokens - 1 == 6 and req.spec_token_ids == []
    req.spec_token_ids = [1, 1, 1, 1, 1]
    sched.max_num_batched_tokens = 3  # drafts beyond the token budget are cut
    out = sched.schedule()
    assert out.num_scheduled_tokens["r"] == 3 and req.spec_token_ids == [1, 1]
    assert out.scheduled_spec_decode_tokens == {"r": [1, 1]}


def test_stop_token_among_accepted_drafts_drops_the_rest():
    sched = make_scheduler()
    req = make_request("r", [1, 2, 3], 20, eos_token_id=0)
    sched.add_request(req)
    step(sched, token=4)
    req.spec_token_ids = [5, 0, 6]
    out = sched.schedule()
    res = sched.update_from_output(
        out,
        ModelRunnerOutput(["r"], {"r": [5, 0, 6, 9]}, logprobs={"r": [{5: (-1.0, 1)}] * 4}),
    )
    assert res[0].new_token_ids == [5, 0] and res[0].finish_reason == "stop"
    assert res[0].new_logprobs is None  # not asked for


def test_logprobs_and_prompt_logprobs_pass_through():
    sched = make_scheduler()
    sched.add_request(make_request("r", [1, 2, 3], 2, logprobs=1, prompt_logprobs=1))
    out = sched.schedule()
    lp, plp = [{7: (-0.5, 1)}], [{2: (-1.0, 3)}, {3: (-2.0, 1)}]
    res = sched.update_from_output(out, ModelRunnerOutput(["r"], {"r": [7]}, {"r": lp}, {"r": plp}))
    assert res[0].new_logprobs == lp and res[0].new_prompt_logprobs == plp
    assert res[0].num_cached_tokens == 0


def test_add_request_validation():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    # Prompt rules are the front end's (validate_request); the scheduler only asserts them.
    with pytest.raises(AssertionError, match="validate_request"):
        sched.add_request(make_request("e", []))
    with pytest.raises(AssertionError, match="validate_request"):
        sched.add_request(make_request("long", [1] * 64))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("big", [1] * 10, max_tokens=10))
    sched.add_request(make_request("ok", [1] * 10, max_tokens=6))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", [1]))


def test_reset_prefix_cache():
    sched = make_scheduler()
    sched.add_request(make_request("a", list(range(40)), 2))
    step(sched)
    assert not sched.reset_prefix_cache()  # "a" still holds blocks
    step(sched)
    assert sched.reset_prefix_cache()
    sched.add_request(make_request("b", list(range(40)), 1))
    out: SchedulerOutput = sched.schedule()
    assert out.num_scheduled_tokens["b"] == 40
