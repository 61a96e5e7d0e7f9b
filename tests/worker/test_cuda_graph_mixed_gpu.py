"""Mixed/prefill-step CUDA graphs on the GPU, in bf16, on the 4-layer Llama-3.2-1B shape of
test_gpu_model_runner.py (dummy weights, 16-token blocks, max_num_seqs 8, 512 tokens).

Random mixed steps (prefill chunks after cached prefixes, decodes, the TTFT shape of a 12-token
chunk after 496 cached tokens) run teacher-forced through a runner with graphs and one without:
every replay of a mixed graph must equal, bit for bit, the forward it captured run eagerly on
the same inputs (same kernels, same shapes), and the logits must agree with the eager runner's
(unpadded shapes: other GEMM tilings) as tightly as decode graphs do. The same with an FP8 KV
cache (looser against eager: see the test). Marked `gpu`: `pytest tests/worker -m gpu`.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_gpu_model_runner import assert_close_logits, make_runner, release
from test_model_runner import Driver, req

from pagoda.worker.cuda_graphs import mixed_graph_shapes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BLOCK = 16


def check_replays_bit_identical(runner) -> list:
    """From now on, every mixed-graph replay is compared with its forward run eagerly.
    -> the replayed keys."""
    graphs, keys = runner.cuda_graphs, []
    replay = graphs.replay

    def checked(key):
        out = replay(key)
        keys.append(key)
        if not isinstance(key, int):
            got = out.clone()
            want = graphs.run_eagerly(key)
            diff = (got.float() - want.float()).abs().max().item()
            assert torch.equal(got, want), f"graph {key} replay differs from eager by {diff:.3g}"
        return out

    graphs.replay = checked
    return keys


def random_mixed_steps(runner, seed: int, num_steps: int = 10):
    """Teacher-forced random steps; -> (logits [rows, vocab] of every sampled row, steps)."""
    rng = random.Random(seed)
    vocab = runner.model_config.vocab_size
    rows: list[torch.Tensor] = []
    compute = runner.model.compute_logits

    def record(hidden):
        out = compute(hidden)
        rows.append(out.float().clone())
        return out

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    runner.model.compute_logits = record
    d = Driver(runner, seed=seed)
    # The TTFT shape first: a 500-token prompt, then 496 of it cached + 12 new tokens.
    p0 = req("p0", fresh(500))
    steps = [[(p0, 500)]]
    ttft = req("ttft", p0.prompt_token_ids[:496] + fresh(12))
    steps.append([(ttft, 12)])
    running: list = []
    try:
        for i, plan in enumerate(steps):
            if i == 1:
                d.tables["ttft"] = list(d.tables["p0"][:31])
                ttft.num_computed_tokens = 496
            d.step(plan)
        for step in range(num_steps):
            plan = [(r, 1) for r in rng.sample(running, min(len(running), rng.randint(0, 6)))]
            donors = [r for r in running if r.num_computed_tokens >= BLOCK]
            new = req(f"n{step}", fresh(rng.randint(2, 150)))
            if donors and rng.random() < 0.6:  # a cached prefix of a running request
                donor = rng.choice(donors)
                k = rng.randint(1, donor.num_computed_tokens // BLOCK)
                new = req(f"n{step}", donor.all_token_ids[: k * BLOCK] + fresh(rng.randint(2, 90)))
                d.tables[new.request_id] = list(d.tables[donor.request_id][:k])
                new.num_computed_tokens = k * BLOCK
            plan.append((new, new.num_tokens - new.num_computed_tokens))
            d.step(plan)
            for r, _ in plan:  # the sampled token is replaced by a forced one
                r.output_token_ids[-1] = r.all_token_ids[-1] = (
                    1000 * step + len(r.request_id)
                ) % vocab
            running = [*running, new][-7:]  # max_num_seqs 8: one slot for the next new request
    finally:
        del runner.model.compute_logits
    return torch.cat(rows), 2 + num_steps


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_mixed_graphs_replay_bit_identical_and_match_eager_runner(cache_dtype):
    graphs = make_runner("bfloat16", cache_dtype=cache_dtype)
    eager = make_runner("bfloat16", enforce_eager=True, cache_dtype=cache_dtype)
    cg = graphs.cuda_graphs
    assert cg.mixed_shapes == mixed_graph_shapes(8, 512) and cg.mixed_capture_error is None
    print(f"captured {len(cg.graphs)} graphs in {cg.capture_seconds:.2f} s")
    keys = check_replays_bit_identical(graphs)
    got, num_steps = random_mixed_steps(graphs, seed=1)
    want, _ = random_mixed_steps(eager, seed=1)
    mixed = [k for k in keys if not isinstance(k, int)]
    assert mixed[:2] == [(512, 4), (16, 4)]  # the 500-token prompt; the TTFT step
    assert len(mixed) == num_steps  # every step replayed a mixed graph
    assert got.shape == want.shape and got.shape[0] > num_steps
    diff = (got - want).abs().max().item()
    print(f"{cache_dtype} KV: mixed graphs vs eager max |logit diff| {diff:.3g}")
    if cache_dtype == "fp8":
        # A K/V value that the padded GEMM rounds one bf16 ulp differently can land on the next
        # FP8 value (3 mantissa bits): the bf16-vs-reference tolerance, not the decode one.
        assert_close_logits(got, want, rel_rms=0.03, rel_max=0.15)
    else:
        assert_close_logits(got, want, rel_rms=0.01, rel_max=0.05)
    release(graphs, eager)
