"""Which bytes of a layer's weights `l2_prefetch` asks for (on CPU tensors: only addresses are
computed), and on a GPU (marked `gpu`) that the prefetch kernel runs eagerly and inside a
captured CUDA graph joined back into the capturing stream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.kernels import l2_prefetch
from pagoda.kernels.l2_prefetch import module_ranges, tensor_ranges


def _spans(t: torch.Tensor, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges as element offsets [start, end) into t's storage."""
    e = t.element_size()
    return [((a - t.data_ptr()) // e, (a - t.data_ptr() + n) // e) for a, n in ranges]


def test_output_rows_of_each_shard() -> None:
    w = torch.zeros(6 + 10, 8, dtype=torch.bfloat16)  # a merged layer of shards 6 and 10
    assert _spans(w, tensor_ranges(w, [6, 10], 0.5)) == [(0, 3 * 8), (6 * 8, 11 * 8)]
    assert _spans(w, tensor_ranges(w, [6, 10], 1.0)) == [(0, 6 * 8), (6 * 8, 16 * 8)]
    assert tensor_ranges(w, [6, 10], 0.0) == []


def test_a_transposed_view_is_read_by_its_storage_rows() -> None:
    w = torch.zeros(16, 8, dtype=torch.float16)  # [N, K] storage, used as a [K, N] view
    assert _spans(w, tensor_ranges(w.t(), [16], 0.25)) == [(0, 4 * 8)]


def test_group_rows_give_the_same_columns_of_each_row() -> None:
    scales = torch.zeros(3, 16, dtype=torch.bfloat16)  # [K / G, N]
    spans = _spans(scales, tensor_ranges(scales, [8, 8], 0.5))
    assert spans == [(r * 16 + a, r * 16 + a + 4) for r in range(3) for a in (0, 8)]


def test_tensors_not_along_the_outputs_give_a_prefix() -> None:
    perm = torch.zeros(40, dtype=torch.int32)  # act-order permutation over K
    assert _spans(perm, tensor_ranges(perm, [16], 0.5)) == [(0, 20)]


class _Linear(nn.Module):
    def __init__(self, n: int, k: int, shards: list[int] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, k, dtype=torch.bfloat16), requires_grad=False)
        self.register_parameter("bias", None)
        self.output_partition_sizes = shards or [n]
        self.output_size_per_partition = n


def test_modules_whole_while_the_budget_lasts_then_the_first_rows() -> None:
    o, gate_up = _Linear(64, 64), _Linear(256, 64, [128, 128])
    budget = 64 * 64 * 2 + 64 * 64 * 2  # o whole, then a quarter of gate_up
    ranges = module_ranges([o, gate_up], budget)
    assert ranges[0] == (o.weight.data_ptr(), 64 * 64 * 2)
    assert _spans(gate_up.weight, ranges[1:]) == [(0, 32 * 64), (128 * 64, 160 * 64)]
    assert sum(n for _, n in ranges) == budget
    assert module_ranges([o, gate_up], 0) == []
    assert all(a % 16 == 0 and n % 16 == 0 for a, n in module_ranges([o, gate_up], 1000))


def test_off_the_gpu_nothing_is_issued(monkeypatch) -> None:
    issued = []
    monkeypatch.setattr(l2_prefetch, "prefetch", lambda *a: issued.append(a))
    l2_prefetch.WeightPrefetch(lambda: [_Linear(8, 8)])(torch.zeros(1, 8))
    assert issued == []
    l2_prefetch.join(torch.zeros(1))  # a no-op on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_runs_eagerly_and_in_a_joined_cuda_graph() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cp.async.bulk.prefetch.L2 needs sm_90")
    layer = _Linear(4096, 4096, [2048, 2048]).cuda()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    prefetch = l2_prefetch.WeightPrefetch(lambda: [layer])

    def step() -> torch.Tensor:
        prefetch(x)
        y = x @ layer.weight.t()
        l2_prefetch.join(y)
        return y

    expected = step()  # eager: builds the kernel and the ranges
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected)
