"""Property-based tests: random workloads on small block pools (forcing preemption), random
aborts and speculative drafts, a fake runner that checks the KV contents every request reads.
After every step: no block leaked or double-freed, budget and max_num_seqs respected; at the
end every request has finished or was aborted and every block is free."""

from __future__ import annotations

import random
import subprocess
import sys

from core_testing import (
    FakeModelRunner,
    check_block_invariants,
    check_step_invariants,
    make_request,
    make_scheduler,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.kv_cache_manager import cdiv
from pagoda.core.request import RequestStatus

VOCAB = 6  # a tiny vocabulary makes shared prefixes (cache hits) and eos/stop tokens common


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 64)) if chunked else draw(st.integers(max_model_len, 96))
    # The cache holds at least one max_model_len request; often not much more.
    min_blocks = cdiv(max_model_len, block_size) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks * 2))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(1, max_model_len - 1),  # prompt length (room for a token)
                st.integers(1, 32),  # max_tokens
                st.integers(0, 3),  # priority
                st.integers(0, 2),  # shared-prefix family
                st.integers(0, 3),  # arrival step
            ),
            min_size=2,
            max_size=12,
        )
    )
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        chunked=chunked,
        budget=budget,
        num_blocks=num_blocks,
        requests=requests,
        max_num_seqs=draw(st.integers(1, 8)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        caching=draw(st.booleans()),
        abort_p=draw(st.sampled_from([0.0, 0.3])),
        spec_p=draw(st.sampled_from([0.0, 0.5])),
        seed=draw(st.integers(0, 2**16)),
        async_scheduling=draw(st.booleans()),
        sliding_window=draw(st.sampled_from([None, None, 1, 3, 8])),
    )


def run_workload(w: dict) -> None:
    rng = random.Random(w["seed"])
    sched = make_scheduler(
        num_blocks=w["num_blocks"],
        block_size=w["block_size"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["budget"],
        max_model_len=w["max_model_len"],
        policy=w["policy"],
        enable_chunked_prefill=w["chunked"],
        enable_prefix_caching=w["caching"],
        sliding_window=w.get("sliding_window"),
    )
    runner = FakeModelRunner(sched, vocab=VOCAB, seed=w["seed"])
    families = [[rng.randrange(VOCAB) for _ in range(w["max_model_len"])] for _ in range(3)]
    pending = []
    for i, (plen, max_tokens, prio, fam, arrival) in enumerate(w["requests"]):
        prompt = families[fam][: plen // 2] + [
            rng.randrange(VOCAB) for _ in range(plen - plen // 2)
        ]
        req = make_request(
            f"r{i}",
            prompt,
            max_tokens,
            priority=prio,
            arrival_time=float(i),
            eos_token_id=0 if i % 3 == 1 else None,
            stop_token_ids=[1] if i % 3 == 0 else None,
            min_tokens=min(2, max_tokens) if i % 2 else 0,
        )
        pending.append((arrival, req))
    all_reqs = [r for _, r in pending]
    finished: dict[str, str] = {}
    # Async scheduling (as LLMEngine does it): step N + 1 is scheduled and run before step N's
    # tokens reach the scheduler; no drafts then.
    run_ahead = w.get("async_scheduling", False)
    in_flight = None

    def deliver(out, runner_out):
        results = sched.update_from_output(out, runner_out)
        runner.delivered(runner_out)
        for r in results:
            if r.finished:
                finished[r.request_id] = r.finish_reason

    for step_no in range(2000):
        for arrival, req in [p for p in pending if p[0] <= step_no]:
            sched.add_request(req)
            pending.remove((arrival, req))
        if not pending and not sched.has_unfinished_requests() and in_flight is None:
            break
        for req in sched.running:  # drafts for requests past their prompt
            if run_ahead:
                break
            if req.num_computed_tokens == req.num_tokens - 1 and rng.random() < w["spec_p"]:
                req.spec_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
        out = sched.schedule()
        check_step_invariants(sched, out)
        check_block_invariants(sched)
        for rid in out.finished_req_ids:
            assert rid in finished
        launched = (out, runner.execute(out))
        if run_ahead:
            previous, in_flight = in_flight, launched if out.num_scheduled_tokens else None
            if previous is not None:
                deliver(*previous)
            if in_flight is None:
                deliver(*launched)
        else:
            deliver(*launched)
        if rng.random() < w["abort_p"]:
            victim = rng.choice(all_reqs).request_id
            if victim in sched.requests:
                finished[victim] = "abort"
            sched.finish_requests([victim, "no-such-id"], RequestStatus.FINISHED_ABORTED)
        check_block_invariants(sched)
    else:
        raise AssertionError(f"requests never finished: {sched.requests}")

    assert set(finished) == {r.request_id for r in all_reqs}
    for req in all_reqs:
        assert req.is_finished() and req.get_finish_reason() == finished[req.request_id]
        if finished[req.request_id] == "length":
            assert req.num_output_tokens == req.max_tokens or req.num_tokens >= w["max_model_len"]
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.kv_cache_manager.req_to_blocks and sched.num_waiting == sched.num_running == 0


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_random_workloads_keep_invariants_and_finish(w):
    run_workload(w)


# A fixed tight case: many requests, a cache barely larger than one request.
HEAVY = dict(
    block_size=2,
    max_model_len=32,
    chunked=True,
    budget=16,
    num_blocks=18,
    requests=[(8 + i % 20, 20, i % 4, i % 3, i % 5) for i in range(24)],
    max_num_seqs=8,
    policy="fcfs",
    caching=True,
    abort_p=0.0,
    spec_p=0.5,
    seed=1,
)


def test_heavy_preemption_workload():
    run_workload(HEAVY)


def test_heavy_preemption_workload_with_async_scheduling():
    # Preemptions while a victim's token is in flight; requests capped by max_tokens while
    # running ahead; aborts.
    requests = [(8 + i % 20, 1 + i % 9, i % 4, i % 3, i % 5) for i in range(24)]
    run_workload(
        {
            **HEAVY,
            "requests": requests,
            "policy": "priority",
            "abort_p": 0.2,
            "spec_p": 0.0,
            "seed": 2,
            "async_scheduling": True,
        }
    )


def test_core_does_not_import_torch():
    code = (
        "import sys; import pagoda.core.scheduler, pagoda.core.kv_cache_manager, "
        "pagoda.core.block_pool, pagoda.core.outputs; "
        "assert 'torch' not in sys.modules, 'pagoda.core imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
