"""CUDA-graph bookkeeping on a CPU: bucket sizes, padding of decode batches, and replay through
the persistent input buffers.

A real capture needs a GPU (tests/worker/test_gpu_model_runner.py). Here a stand-in "graph"
re-runs the captured function on replay: the runner still writes each step into the static
buffers, pads it to a bucket and reads the static output, so greedy tokens must equal the eager
runner's, for batch sizes that need padding and while prefills run eagerly beside.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_testing import make_tiny_checkpoint
from step_testing import one_step
from test_gpu_model_runner import teacher_forced_logits
from test_model_runner import PROMPTS, Driver, make_runner, one_cpu_thread, req  # noqa: F401

from pagoda.worker.cuda_graphs import cuda_graph_capture_sizes, padded_batch_size
from pagoda.worker.input_batch import InputBuilder
from pagoda.worker.request_state import RequestStates


def test_capture_sizes_follow_vllm_buckets():
    assert cuda_graph_capture_sizes(256, 8192) == [1, 2, 4, *range(8, 257, 8)]
    assert cuda_graph_capture_sizes(20, 8192) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_capture_sizes(3, 8192) == [1, 2, 3]
    assert cuda_graph_capture_sizes(1024, 8192)[-1] == 512  # capped like vLLM
    assert cuda_graph_capture_sizes(256, 100)[-1] == 100  # never more rows than tokens


def test_padded_batch_size_is_the_next_bucket():
    sizes = cuda_graph_capture_sizes(64, 2048)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        64,
    ]
    assert padded_batch_size(65, sizes) is None
    assert padded_batch_size(0, sizes) is None


def _decode_output(num_reqs: int, block_size: int = 4):
    reqs, tables, starts = [], {}, {}
    for i in range(num_reqs):
        r = req(f"r{i}", list(range(10 + i, 20 + 2 * i)))
        r.append_output_token_ids(7 + i)
        start = r.num_tokens - 1
        r.num_computed_tokens = start + 1
        reqs.append(r)
        tables[r.request_id] = [100 + 10 * i + j for j in range(-(-(start + 1) // block_size))]
        starts[r.request_id] = start
    so = one_step(reqs, {r.request_id: 1 for r in reqs}, tables, starts)
    return so, RequestStates().update(so)


def test_padded_decode_rows_write_nothing_and_attend_the_null_block():
    builder = InputBuilder(64, 8, 16, 4, torch.device("cpu"))
    so, reqs = _decode_output(3)
    plain = builder.prepare(so, reqs)
    plain_vals = [
        t.clone()
        for t in (
            plain.input_ids,
            plain.positions,
            plain.attn_metadata.slot_mapping,
            plain.attn_metadata.seq_lens,
        )
    ]
    padded = builder.prepare(so, reqs, lambda n: padded_batch_size(n, [1, 2, 4, 8]))
    md = padded.attn_metadata
    assert padded.cuda_graph_size == 4 and padded.num_tokens == 3
    assert md.num_actual_tokens == 4 and md.max_query_len == 1 and md.query_start_loc_cpu is None
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    for got, want in zip(
        (padded.input_ids, padded.positions, md.slot_mapping, md.seq_lens), plain_vals
    ):
        assert got[:3].tolist() == want.tolist()
    assert padded.input_ids[3] == 0 and padded.positions[3] == 0
    assert md.slot_mapping[3] == -1 and md.seq_lens[3] == 1 and md.block_tables[3, 0] == 0
    assert md.block_tables.shape == (4, 16)  # full width: a graph bakes the row stride in
    assert padded.logits_indices is None and padded.sample_rows == [0, 1, 2]
    # Mixed steps are never padded.
    so.num_scheduled_tokens["r0"] = 2
    so.num_computed_tokens["r0"] -= 1
    mixed = builder.prepare(so, reqs, lambda n: 4)
    assert mixed.cuda_graph_size is None and mixed.attn_metadata.num_actual_tokens == 4
    assert mixed.logits_indices is not None
    assert mixed.logits_indices.tolist() == mixed.sample_rows == [0, 1, 3]


class _ReplayByRerun:
    """A CPU stand-in for a CUDA graph: replay re-runs the captured function into its output."""

    replays = 0

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        _ReplayByRerun.replays += 1
        self.out.copy_(self.fn())


def _capture_by_rerun(fn):
    out = fn()
    return _ReplayByRerun(fn, out), out


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint(path, "llama_gqa_tied_llama3_rope", num_hidden_layers=2)
    return path


@pytest.fixture(scope="module")
def eager_runner(checkpoint_path):
    return make_runner(checkpoint_path)


def _graph_runner(path, copies: bool):
    runner = make_runner(path)
    if copies:  # separate host and "device" buffers, as on a GPU: the copies must be complete
        old = runner.inputs
        runner.inputs = InputBuilder(
            old.max_num_tokens,
            old.max_num_reqs,
            old.max_blocks_per_req,
            old.block_size,
            old.device,
            copy_to_device=True,
        )
    runner.capture_cuda_graphs(capture_fn=_capture_by_rerun)
    return runner


@pytest.fixture(scope="module")
def graph_runner(checkpoint_path):
    return _graph_runner(checkpoint_path, copies=False)


@pytest.fixture(scope="module")
def copying_graph_runner(checkpoint_path):
    return _graph_runner(checkpoint_path, copies=True)


@pytest.mark.parametrize("copies", [False, True])
def test_graph_replay_matches_eager_runner(
    eager_runner, graph_runner, copying_graph_runner, copies
):
    graph_runner = copying_graph_runner if copies else graph_runner
    assert graph_runner.cuda_graphs.capture_sizes == [1, 2, 4, 8]
    before = _ReplayByRerun.replays
    # 1, 3 and 5 requests: buckets 1, 4 and 8; prefill steps run eagerly in between.
    for n in (1, 3, 5):
        prompts = (PROMPTS * 2)[:n]
        want = Driver(eager_runner).generate([req(f"e{i}", p) for i, p in enumerate(prompts)], 5)
        got = Driver(graph_runner, seed=3).generate(
            [req(f"g{i}", p) for i, p in enumerate(prompts)], 5
        )
        assert got == want
        # Logits too: a tiny random model's greedy tokens hardly depend on its context.
        prompts = [[t % 128 for t in p] for p in prompts]
        torch.testing.assert_close(
            teacher_forced_logits(graph_runner, prompts, steps=4),
            teacher_forced_logits(eager_runner, prompts, steps=4),
            rtol=1e-4,
            atol=1e-4,
        )
    assert _ReplayByRerun.replays - before >= 3 * 8  # every decode step replayed a graph


def test_reallocated_buffers_disable_stale_graphs(graph_runner):
    graphs = graph_runner.cuda_graphs
    assert graphs.padded_size(3) == 4
    inputs = graph_runner.inputs
    inputs._grow(inputs.max_num_tokens + 1, inputs.max_num_reqs, inputs.max_blocks_per_req)
    assert graphs.padded_size(3) is None  # run eagerly rather than replay over freed buffers
    graphs.capture()
    assert graphs.padded_size(3) == 4
    assert np.all(inputs.slot_mapping.host[:8] == -1)  # capture ran on padding only
