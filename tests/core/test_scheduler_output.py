"""The scheduler-runner boundary: `SchedulerOutput` is plain data, a request is sent whole once
(again after a preemption) and afterwards as a diff, and a step's data never changes after
schedule() returns (async scheduling reads it while the scheduler moves on)."""

from __future__ import annotations

import pickle

from core_testing import make_request, make_scheduler

from pagoda.core.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.request_state import RequestStates


def _sample_all(sched, out: SchedulerOutput, token: int = 7) -> None:
    sampled = {}
    for req in sched.scheduled_requests(out):
        rid = req.request_id
        if out.num_computed_tokens[rid] + out.num_scheduled_tokens[rid] >= req.num_tokens:
            sampled[rid] = [token]
    sched.update_from_output(out, ModelRunnerOutput(list(sampled), sampled))


def _plain(value: object) -> bool:
    if value is None or isinstance(value, (str, int, float, bool, SamplingParams)):
        return True
    if isinstance(value, (list, tuple, set)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if hasattr(value, "__dataclass_fields__"):
        return all(_plain(getattr(value, f)) for f in value.__dataclass_fields__)
    return False


def test_output_is_plain_data_and_never_shares_a_list_with_the_scheduler():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", list(range(10)), 8))
    sched.add_request(make_request("b", list(range(5)), 8))
    out = sched.schedule()
    assert _plain(out)
    kv = sched.kv_cache_manager
    for new in out.scheduled_new_reqs:
        req = sched.requests[new.req_id]
        assert new.block_ids == kv.get_block_ids(new.req_id)
        assert new.block_ids is not kv.get_block_ids(new.req_id)
        assert new.output_token_ids is not req.output_token_ids
    frozen = pickle.dumps(out)
    for _ in range(6):  # the scheduler moves on: the first step's data stays as it was
        _sample_all(sched, sched.schedule())
    assert pickle.dumps(out) == frozen


def test_decode_steps_send_only_what_changed():
    sched = make_scheduler(block_size=4)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", list(range(100 + i)), 20))
    first = sched.schedule()
    assert [n.req_id for n in first.scheduled_new_reqs] == ["r0", "r1", "r2", "r3"]
    _sample_all(sched, first)
    out = sched.schedule()
    cached = out.scheduled_cached_reqs
    assert not out.scheduled_new_reqs and cached.req_ids == ["r0", "r1", "r2", "r3"]
    assert cached.new_token_ids == [[7]] * 4
    # r0's next position (100) starts a block; the others' fit in their last one.
    assert [len(b) for b in cached.new_block_ids] == [1, 0, 0, 0]
    assert len(pickle.dumps(out)) < len(pickle.dumps(first)) / 5


def test_a_preempted_request_is_sent_whole_when_it_resumes():
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=40)
    a, b = make_request("a", [1] * 8, 12), make_request("b", [2] * 8, 12)
    sched.add_request(a)
    sched.add_request(b)
    states = RequestStates()
    preempted_at = None
    for step in range(40):
        out = sched.schedule()
        states.update(out)
        if out.preempted_req_ids and preempted_at is None:
            preempted_at = step
            (victim,) = out.preempted_req_ids
            assert victim not in states.requests
        elif preempted_at is not None and victim in out.num_scheduled_tokens:
            (new,) = [n for n in out.scheduled_new_reqs if n.req_id == victim]
            req = sched.requests[victim]
            assert isinstance(new, NewRequestData) and new.output_token_ids
            assert new.output_token_ids == req.output_token_ids
            assert new.block_ids == sched.kv_cache_manager.get_block_ids(victim)
            assert states.requests[victim].all_token_ids == req.all_token_ids
            return
        _sample_all(sched, out)
    raise AssertionError("no preemption and resumption happened")


def test_a_new_request_under_a_finished_id_is_sent_whole():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("r", [1, 2, 3], 8))
    states = RequestStates()
    states.update(sched.schedule())
    sched.finish_requests("r", sched.requests["r"].status.FINISHED_ABORTED)
    sched.add_request(make_request("r", [4, 5], 8))
    out = sched.schedule()
    assert out.finished_req_ids == {"r"}
    assert [n.prompt_token_ids for n in out.scheduled_new_reqs] == [[4, 5]]
    (state,) = states.update(pickle.loads(pickle.dumps(out)))
    assert state.all_token_ids == [4, 5] and state.block_ids == out.scheduled_new_reqs[0].block_ids
