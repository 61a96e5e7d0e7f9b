"""The start-up warm-up steps (`pagoda.worker.warmup`): shapes within the scheduler's limits,
run through a real model over its KV cache without writing it, and greedy tokens unchanged
afterwards (CPU; on CUDA the runner runs them after capturing its graphs)."""

from __future__ import annotations

import pytest
import torch
from model_testing import make_tiny_checkpoint
from test_model_runner import make_runner

from pagoda.worker.warmup import warm_up_eager_kernels, warm_up_shapes


@pytest.mark.parametrize("budget,seqs,max_len", [(2048, 256, 8192), (64, 8, 96), (16, 2, 2048)])
def test_shapes_fit_the_scheduler_limits(budget, seqs, max_len):
    steps = warm_up_shapes(budget, seqs, max_len)
    assert steps[0] == [(0, min(budget, max_len))]
    for specs in steps:
        assert 1 <= len(specs) <= seqs
        assert sum(q for _, q in specs) <= budget
        assert all(c + q <= max_len and q >= 1 for c, q in specs)
        queries = [q for _, q in specs]
        assert queries == sorted(queries, key=lambda q: q != 1)  # decodes first
    counts = {len(s) for s in steps}
    if seqs >= 17 and budget > 17:
        assert {1, 2, 16, 17} <= counts


def test_warm_up_runs_the_model_and_writes_no_cache(tmp_path):
    make_tiny_checkpoint(tmp_path, "llama_untied_linear_rope", num_hidden_layers=2)
    runner = make_runner(tmp_path)
    for cache in runner.kv_caches:
        cache.fill_(0.5)
    before = [c.clone() for c in runner.kv_caches]
    assert warm_up_eager_kernels(runner) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
