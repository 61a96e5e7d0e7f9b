"""Step deltas (`step_delta`): what a tensor-parallel worker rebuilds from them must read like
the scheduler's own `SchedulerOutput`, the reference that is otherwise pickled whole.

Every step of the scheduler's property workloads (chunked prefill, preemption on small block
pools, prefix caching, aborts, drafts, async scheduling) goes through encode -> pickle ->
decode and is compared field by field with the original, as the model runner reads it."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.outputs import SchedulerOutput
from pagoda.core.request import Request
from pagoda.executor.step_delta import RequestMirror, StepDeltaEncoder
from pagoda.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
from core_testing import FakeModelRunner  # noqa: E402
from test_scheduler_properties import HEAVY, run_workload, workloads  # noqa: E402


def assert_reads_like(got: SchedulerOutput, ref: SchedulerOutput) -> None:
    assert [r.request_id for r in got.scheduled_requests] == [
        r.request_id for r in ref.scheduled_requests
    ]
    for a, b in zip(got.scheduled_requests, ref.scheduled_requests):
        assert a is not b
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.output_token_ids == b.output_token_ids
        assert a.all_token_ids == b.all_token_ids
        assert a.spec_token_ids == b.spec_token_ids
        assert a.sampling_params == b.sampling_params
        assert a.num_computed_tokens == b.num_computed_tokens
    for name in (
        "num_scheduled_tokens",
        "total_num_scheduled_tokens",
        "block_ids",
        "scheduled_spec_tokens",
        "finished_req_ids",
        "preempted_req_ids",
        "num_computed_tokens",
    ):
        assert getattr(got, name) == getattr(ref, name), name


def _run_through_deltas(workload: dict, max_tracked: int) -> int:
    """Runs the workload with every step also sent as a delta; returns the steps checked."""
    encoder, mirror = StepDeltaEncoder(max_tracked), RequestMirror()
    execute = FakeModelRunner.execute
    steps = [0]

    def checked(runner: FakeModelRunner, so: SchedulerOutput):
        wire = pickle.dumps(encoder.encode(so))  # at launch, as the executor does
        assert_reads_like(mirror.decode(pickle.loads(wire)), so)
        steps[0] += 1
        return execute(runner, so)

    with mock.patch.object(FakeModelRunner, "execute", checked):
        run_workload(workload)
    return steps[0]


@settings(max_examples=150, deadline=None)
@given(workloads(), st.sampled_from([1, 1000]))
def test_deltas_rebuild_every_step_of_random_workloads(w, max_tracked):
    assert _run_through_deltas(w, max_tracked) > 0


def test_deltas_rebuild_a_heavy_preemption_workload_with_async_scheduling():
    requests = [(8 + i % 20, 1 + i % 9, i % 4, i % 3, i % 5) for i in range(24)]
    workload = {**HEAVY, "requests": requests, "abort_p": 0.2, "spec_p": 0.0, "seed": 2}
    assert _run_through_deltas({**workload, "async_scheduling": True}, 1000) > 20
    assert _run_through_deltas(HEAVY, 1000) > 20


def _step(reqs: list[Request], blocks: dict[str, list[int]], **kw) -> SchedulerOutput:
    n = {r.request_id: 1 for r in reqs}
    start = {r.request_id: r.num_tokens - 1 for r in reqs}
    for r in reqs:  # as the scheduler leaves them: past this step
        r.num_computed_tokens = r.num_tokens
    return SchedulerOutput(reqs, n, len(reqs), blocks, num_computed_tokens=start, **kw)


def test_decode_steps_send_only_what_changed():
    reqs = [Request(f"r{i}", list(range(500)), SamplingParams(), None) for i in range(4)]
    blocks = {r.request_id: list(range(1, 33)) for r in reqs}
    encoder, mirror = StepDeltaEncoder(100), RequestMirror()
    first = pickle.dumps(encoder.encode(_step(reqs, blocks)))
    mirror.decode(pickle.loads(first))
    for r in reqs:
        r.append_output_token_ids(7)
    blocks["r0"].append(40)
    delta = encoder.encode(_step(reqs, blocks))
    assert not delta.new_requests
    assert [d.new_output_token_ids for d in delta.scheduled] == [[7]] * 4
    assert [d.block_ids for d in delta.scheduled] == [[40], [], [], []]
    wire = pickle.dumps(delta)
    assert len(wire) < len(first) / 10
    table = mirror.block_ids["r0"]
    assert_reads_like(mirror.decode(pickle.loads(wire)), _step(reqs, blocks))
    assert mirror.block_ids["r0"] is table  # grown in place: the runner's row cache holds


def test_a_new_request_under_a_finished_id_is_sent_whole():
    old = Request("r", [1, 2, 3], SamplingParams(temperature=0.5), None)
    blocks = {"r": [1]}
    encoder, mirror = StepDeltaEncoder(100), RequestMirror()
    mirror.decode(pickle.loads(pickle.dumps(encoder.encode(_step([old], blocks)))))
    new = Request("r", [4, 5], SamplingParams(temperature=0.0), None)
    so = _step([new], {"r": [2]}, finished_req_ids={"r"})
    delta = encoder.encode(so)
    assert [n.prompt_token_ids for n in delta.new_requests] == [[4, 5]]
    assert_reads_like(mirror.decode(pickle.loads(pickle.dumps(delta))), so)
