"""Mixed/prefill-step CUDA graphs on a CPU: bucket choice, padding arithmetic, and replay through
the persistent buffers with the real Triton attention kernel (under TRITON_INTERPRET=1).

A stand-in "graph" re-runs the captured function on replay (as in test_cuda_graphs.py): the
runner still writes each step into the static buffers (separate host and "device" buffers, so
a missing copy shows), pads it to a (tokens, requests) bucket with empty requests and one
request owning the padding tokens, and the kernel reads what a captured graph would. Tokens and
logits must match the eager runner's. The real capture in bf16 (replay bit-identical to the
same forward run eagerly) is tests/worker/test_cuda_graph_mixed_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("hypothesis")  # CPU tests only: a GPU machine may lack it
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_model_runner import PROMPTS, Driver, make_runner, one_cpu_thread, req  # noqa: E402, F401

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from kernel_testing import enable_interpreter_without_cuda  # noqa: E402

enable_interpreter_without_cuda()

from model_testing import make_tiny_checkpoint  # noqa: E402
from step_testing import one_step  # noqa: E402

from pagoda.core.outputs import SchedulerOutput  # noqa: E402
from pagoda.worker.cuda_graphs import (  # noqa: E402
    describe_mixed_shapes,
    mixed_graph_reserve_bytes,
    mixed_graph_shape,
    mixed_graph_shapes,
    pad_mixed_requests,
    pad_tokens,
)
from pagoda.worker.input_batch import InputBuilder  # noqa: E402
from pagoda.worker.request_state import RequestState, RequestStates  # noqa: E402

BIG = mixed_graph_shapes(256, 8192)  # the H200 benchmark's settings


def test_mixed_shapes_are_token_buckets_times_request_buckets():
    assert BIG == [
        *[(16, 4), (16, 16)],
        *[(32, 4), (32, 16), (32, 32)],
        *[(64, 4), (64, 16), (64, 64)],
        *[(128, r) for r in (4, 16, 64, 128)],
        *[(192, r) for r in (4, 16, 64, 192)],
        *[(t, r) for t in (256, 320, 384, 448, 512) for r in (4, 16, 64, 256)],
    ]
    assert describe_mixed_shapes(BIG[:5]) == "16x{4,16} 32x{4,16,32}"
    assert mixed_graph_shapes(8, 512) == [
        (t, r) for t in (16, 32, 64, 128, 192, 256, 320, 384, 448, 512) for r in (4, 8)
    ]
    assert mixed_graph_shapes(256, 100)[-4:] == [(100, 4), (100, 16), (100, 64), (100, 100)]
    assert mixed_graph_shapes(2, 8) == [(8, 2)]  # caps are buckets too
    assert mixed_graph_shapes(8, 1) == []  # no step but pure decode fits


def test_every_small_step_gets_the_smallest_bucket_that_holds_it():
    assert mixed_graph_shape(12, 1, BIG) == (16, 4)  # TTFT after a 500-token prefix hit
    assert mixed_graph_shape(16, 5, BIG) == (16, 16)
    assert mixed_graph_shape(17, 1, BIG) == (32, 4)
    assert mixed_graph_shape(300, 200, BIG) == (320, 256)
    assert mixed_graph_shape(130, 5, BIG) == (192, 16)
    assert mixed_graph_shape(513, 1, BIG) is None  # too many tokens: eager
    assert mixed_graph_shape(5, 0, BIG) is None
    token_buckets = sorted({t for t, _ in BIG})
    for num_tokens in range(2, 513):
        for num_reqs in {1, 2, 5, 17, 100, 256, num_tokens} & set(
            range(1, min(num_tokens, 256) + 1)
        ):
            t, r = mixed_graph_shape(num_tokens, num_reqs, BIG)
            assert t == min(b for b in token_buckets if b >= num_tokens)
            assert r == min(b for tb, b in BIG if tb == t and b >= num_reqs)


def _kernel_rows(qsl: np.ndarray, num_tokens: int, num_reqs: int, block_q: int) -> list[int]:
    """The token rows the unified attention kernel's programs cover, emulating its indexing:
    an upper-bound grid of num_tokens // BLOCK_Q + num_reqs programs; program p belongs to the
    last request b with qsl[b] // BLOCK_Q + b <= p, and exits past that request's rows."""
    rows = []
    for p in range(num_tokens // block_q + num_reqs):
        b = max(i for i in range(num_reqs) if qsl[i] // block_q + i <= p)
        local = p - (qsl[b] // block_q + b)
        lo, hi = qsl[b] + local * block_q, qsl[b + 1]
        rows += range(lo, min(hi, lo + block_q)) if lo < hi else []
    return rows


@settings(max_examples=150, deadline=None)
@given(
    query_lens=st.lists(st.integers(1, 70), min_size=1, max_size=20),
    context=st.integers(0, 40),
    block_q=st.sampled_from([1, 4, 16, 32]),
)
def test_padding_gives_every_token_row_to_exactly_one_request(query_lens, context, block_q):
    shapes = mixed_graph_shapes(32, 512)
    num_tokens, num_reqs = sum(query_lens), len(query_lens)
    shape = mixed_graph_shape(num_tokens, num_reqs, shapes)
    if shape is None:
        assert num_tokens > 512
        return
    t, r = shape
    qsl, seq_lens = np.full(40, 999, np.int32), np.full(39, 999, np.int32)
    table = np.full((39, 40), 7, np.int32)
    qsl[0] = 0
    qsl[1 : num_reqs + 1] = np.cumsum(query_lens)
    seq_lens[:num_reqs] = np.array(query_lens) + context
    ids, pos, slots = (np.full(600, 5, np.int64) for _ in range(3))
    pad_tokens(ids, pos, slots, num_tokens, t)
    pad_mixed_requests(qsl, seq_lens, table, num_tokens, num_reqs, t, r, block_size=16)

    assert (ids[num_tokens:t] == 0).all() and (slots[num_tokens:t] == -1).all()
    assert (ids[:num_tokens] == 5).all() and (ids[t:] == 5).all()  # nothing else touched
    q = np.diff(qsl[: r + 2])
    assert qsl[r + 1] == t and (q >= 0).all() and list(q[:num_reqs]) == query_lens
    assert (q[num_reqs:r] == 0).all() and (seq_lens[num_reqs:r] == 0).all()  # empty slots
    assert q[r] == seq_lens[r] == t - num_tokens  # the padding owner: a fresh prompt
    assert (table[r, : -(-(t - num_tokens) // 16)] == 0).all()  # on the null block
    assert (seq_lens[: r + 1] >= q).all()
    assert sorted(_kernel_rows(qsl, t, r + 1, block_q)) == list(range(t))


def test_padding_that_does_not_fit_is_refused():
    qsl, seq_lens, table = np.zeros(6, np.int32), np.zeros(5, np.int32), np.zeros((5, 2), np.int32)
    with pytest.raises(ValueError, match="does not fit"):
        pad_mixed_requests(qsl, seq_lens, table, 20, 1, 16, 4, 4)  # more tokens than the graph
    with pytest.raises(ValueError, match="does not fit"):
        pad_mixed_requests(qsl, seq_lens, table, 0, 0, 16, 4, 4)  # 16 pad keys > 2 blocks of 4


def _mixed_step(block_size: int = 4) -> tuple[SchedulerOutput, list[RequestState]]:
    """Two decodes and a 7-token chunk after an 8-token cached prefix (9 tokens, 3 requests)."""
    d0, d1 = req("d0", list(range(10, 15))), req("d1", list(range(20, 26)))
    c = req("c", list(range(30, 45)))
    starts = {"d0": 4, "d1": 5, "c": 8}
    counts = {"d0": 1, "d1": 1, "c": 7}
    tables = {"d0": [11, 12], "d1": [13, 14], "c": [21, 22, 23, 24]}
    for r in (d0, d1, c):
        r.num_computed_tokens = starts[r.request_id] + counts[r.request_id]
    so = one_step([c, d0, d1], counts, tables, starts)
    return so, RequestStates().update(so)


def test_builder_pads_a_mixed_step_into_the_device_buffers():
    builder = InputBuilder(64, 8, 16, 4, torch.device("cpu"), copy_to_device=True)
    so, reqs = _mixed_step()
    plain = builder.prepare(so, reqs)
    want = [plain.input_ids.clone(), plain.positions.clone(), plain.attn_metadata.slot_mapping]
    want[2] = want[2].clone()
    want_md = plain.attn_metadata
    shapes = mixed_graph_shapes(8, 64)
    builder.block_table.dev.fill_(99)  # stale device rows: the step must copy all it needs
    step = builder.prepare(so, reqs, lambda n: 4, lambda n, r: mixed_graph_shape(n, r, shapes))
    md = step.attn_metadata
    assert step.graph_key == step.mixed_graph_shape == (16, 4) and step.cuda_graph_size is None
    assert step.num_tokens == 9 and md.num_actual_tokens == 16 and md.max_query_len == 16
    assert md.query_start_loc_cpu is None and md.num_reqs == 5
    for got, plain_t in zip((step.input_ids, step.positions, md.slot_mapping), want):
        assert got.shape == (16,) and got[:9].tolist() == plain_t.tolist()
    assert step.input_ids[9:].eq(0).all() and step.positions[9:].eq(0).all()
    assert md.slot_mapping[9:].eq(-1).all()
    assert md.query_start_loc.tolist() == [0, 1, 2, 9, 9, 16]
    assert md.seq_lens.tolist() == want_md.seq_lens.tolist() + [0, 7]
    assert md.block_tables.shape == (5, 16)  # full width: a graph bakes the row stride in
    assert md.block_tables[:3, :4].tolist() == want_md.block_tables.tolist()
    assert md.block_tables[4, :2].tolist() == [0, 0]  # the padding owner reads block 0
    assert step.sample_rows == plain.sample_rows == [0, 1, 8]
    assert step.logits_indices.tolist() == [0, 1, 8]
    # A pure-decode step takes the decode graph; a step past every bucket runs eagerly.
    so.num_scheduled_tokens["c"] = 1
    so.num_computed_tokens["c"] = 14
    assert builder.prepare(so, reqs, lambda n: 4, lambda n, r: (16, 4)).graph_key == 4
    assert builder.prepare(*_mixed_step(), None, lambda n, r: None).graph_key is None


# -- the runner, with the Triton kernel under the interpreter ----------------------------------
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter test; on a GPU the gpu-marked tests run"
)


class _ReplayByRerun:
    """A CPU stand-in for a CUDA graph: replay re-runs the captured function into its output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def _capture_by_rerun(fn):
    out = fn()
    return _ReplayByRerun(fn, out), out


def _use_triton(runner):
    from pagoda.attention.triton.backend import TritonAttentionBackend
    from pagoda.model.layers.attention import Attention

    backend = TritonAttentionBackend()
    runner.attn_backend = backend
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.backend = backend
    runner.model.set_fused_ops(False)  # plain torch around the kernel under test
    return runner


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint(path, "llama_gqa_tied_llama3_rope", num_hidden_layers=2)
    return path


def _graph_runner(path, capture_fn=_capture_by_rerun):
    runner = _use_triton(make_runner(path))
    assert runner._mixed_graph_shapes() == mixed_graph_shapes(8, 64)  # what a GPU would capture
    old = runner.inputs  # separate host and "device" buffers, as on a GPU
    runner.inputs = InputBuilder(
        old.max_num_tokens,
        old.max_num_reqs,
        old.max_blocks_per_req,
        old.block_size,
        old.device,
        True,
    )
    # Few graphs: the interpreter is slow (a split-KV decode forward most of all).
    runner.use_cuda_graphs, runner.cuda_graph_sizes = True, [1]
    runner.mixed_graph_shapes = [(16, 4), (32, 4)]
    runner.capture_cuda_graphs(capture_fn=capture_fn)
    return runner


@pytest.fixture(scope="module")
def graph_runner(checkpoint_path):
    return _graph_runner(checkpoint_path)


@pytest.fixture(scope="module")
def eager_runner(checkpoint_path):
    return _use_triton(make_runner(checkpoint_path))


@pytest.fixture(scope="module")
def eager_scenario(eager_runner):
    return _run_scenario(eager_runner)


def _run_scenario(runner):
    """Prefill chunks, a chunk after a cached prefix next to decodes, speculative rows (no
    pure-decode step: test_cuda_graphs.py covers those). -> (sampled tokens, logits) per step."""
    logits = []
    compute = runner.model.compute_logits

    def record(hidden):
        out = compute(hidden)
        logits.append(out.clone())
        return out

    runner.model.compute_logits = record
    try:
        d = Driver(runner, seed=11)
        a, b = req("a", PROMPTS[0]), req("b", PROMPTS[2])
        c = req("c", PROMPTS[2][:24] + [3, 1, 4, 1, 5])
        outs = [d.step([(a, 11), (b, 20)]), d.step([(a, 1), (b, 17)])]
        d.tables["c"] = list(d.tables["b"][:6])  # c's first 24 tokens hit b's cached blocks
        c.num_computed_tokens = 24
        outs.append(d.step([(a, 1), (b, 1), (c, 5)]))
        a.spec_token_ids = [a.all_token_ids[-1], 7]
        outs.append(d.step([(b, 1), (a, 3)], spec={"a": 2}))
    finally:
        del runner.model.compute_logits
    return [o.sampled_token_ids for o in outs], logits


@needs_interpreter
def test_mixed_graph_replay_matches_the_eager_runner(graph_runner, eager_scenario):
    graphs = graph_runner.cuda_graphs
    assert graphs.mixed_shapes == [(16, 4), (32, 4)] and graphs.mixed_capture_error is None
    assert sorted(graphs.graphs, key=str) == [(16, 4), (32, 4), 1]
    keys, replay = [], graphs.replay

    def checked(key):
        out = replay(key)
        keys.append(key)
        # The forward the graph captured, run eagerly on the same buffers, gives the same bits.
        assert torch.equal(out, graphs.run_eagerly(key))
        return out

    graphs.replay = checked
    try:
        got_tokens, got_logits = _run_scenario(graph_runner)
    finally:
        del graphs.replay
    want_tokens, want_logits = eager_scenario
    assert keys == [(32, 4), (32, 4), (16, 4), (16, 4)]  # every step replayed a mixed graph
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits) == 4
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_interpreter
def test_a_failed_mixed_capture_leaves_decode_graphs_and_eager_steps(
    checkpoint_path, eager_scenario
):
    def refuse_mixed(fn):
        out = fn()
        if out.shape[0] > 1:  # the decode graph here has 1 row, mixed ones >= 16
            raise RuntimeError("operation not permitted when stream is capturing")
        return _ReplayByRerun(fn, out), out

    runner = _graph_runner(checkpoint_path, refuse_mixed)
    graphs = runner.cuda_graphs
    assert graphs.mixed_shapes == [] and "not permitted" in graphs.mixed_capture_error
    assert list(graphs.graphs) == [1] and graphs.mixed_shape(9, 3) is None
    assert _run_scenario(runner)[0] == eager_scenario[0]


@needs_interpreter
def test_mixed_graph_memory_estimate_runs_the_largest_bucket(monkeypatch, eager_runner):
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 1000 + (5 << 20))
    seen = []
    forward = eager_runner.model.forward

    def spy(input_ids, positions, kv_caches, md):
        seen.append((input_ids.shape[0], md.num_reqs, md.max_query_len, kv_caches[0].shape[1]))
        return forward(input_ids, positions, kv_caches, md)

    monkeypatch.setattr(eager_runner.model, "forward", spy)
    monkeypatch.setattr(eager_runner, "mixed_graph_shapes", [(16, 4), (64, 8)])
    reserve = eager_runner._estimate_mixed_graph_memory()
    assert seen == [(64, 9, 64, 2)]  # 64 tokens, 8 slots + the padding owner, a 2-block cache
    hidden_row_bytes = 64 * 4  # hidden size 64, float32
    assert reserve == mixed_graph_reserve_bytes(5 << 20, [(16, 4), (64, 8)], hidden_row_bytes)
    assert reserve == (5 << 20) + 80 * hidden_row_bytes + 2 * (2 << 20)
