"""Weights asked into the GPU's L2 cache while the memory would otherwise idle.

A decode step of few rows reads every weight once, and its kernels between the GEMMs (RoPE and
the cache write, the decode attention, its segment reduce, RMSNorm) read almost nothing: for
those microseconds a layer, the memory that bounds the step does no work. Once a layer's
qkv_proj has run, `WeightPrefetch` asks the copy engine for the weights that come next
(o_proj, then the start of gate_up) into L2 (cp.async.bulk.prefetch.L2, sm_90), from a second
stream, so nothing on the step's own chain waits for it: the attention kernels run meanwhile,
and those GEMMs then find their first bytes in L2. `join` ends the second stream's work into
the current stream (a CUDA graph captured with it must be joined before the capture ends).

Only where it can pay: CUDA tensors on sm_90, at most MAX_TOKENS rows (past that the GEMMs are
no longer bound by their weights' bytes), `PAGODA_L2_PREFETCH_MB` above 0 (0, off, by default:
it slows 4-bit decode, whose GEMVs are not bound by DRAM, and gains bf16 1-2%;
`benchmarks/README.md`). Which bytes come first:
a layer's weights are read by output rows, so a weight only partly asked for gives the first
rows of each of its shards (gate and up of a merged gate_up, whose kernels read them in
step) and, for tensors laid out [groups, N] (4-bit scales), the same columns of every row.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pagoda import envs
from pagoda.kernels import _sm90, cuda_launch

MAX_TOKENS = 16  # rows of a step up to which its weights are prefetched
PIECE = 4096  # bytes a prefetch instruction asks for
THREADS = 256
MAX_CTAS = 32

_SOURCE = r"""
// ranges: n (address, bytes) pairs, 16-byte aligned; the grid's threads take PIECE-byte pieces
// of each in turn. The prefetches are hints: nothing waits for them.
extern "C" __global__ void pagoda_l2_prefetch(const long long* __restrict__ ranges, int n) {
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x * PIECE;
  for (int r = 0; r < n; ++r) {
    const char* base = reinterpret_cast<const char*>(ranges[2 * r]);
    const long long bytes = ranges[2 * r + 1];
    for (long long off = tid * PIECE; off < bytes; off += stride) {
      const unsigned size = (unsigned)min((long long)PIECE, bytes - off);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(size)
                   : "memory");
    }
  }
}
"""


def budget_bytes() -> int:
    return envs.PAGODA_L2_PREFETCH_MB * (1 << 20)


def _outputs_along(t: torch.Tensor, n: int) -> str | None:
    """How tensor t lies along a layer's n outputs: "rows" where its outermost dimension (in
    memory) is the outputs, "columns" where its innermost is ([groups, N] scales), else None."""
    if t.dim() == 1:
        return "rows" if t.shape[0] == n else None
    if t.dim() != 2:
        return None
    outer, inner = (0, 1) if t.stride(0) >= t.stride(1) else (1, 0)
    if t.stride(inner) != 1 or t.stride(outer) != t.shape[inner]:
        return None  # not one dense block
    if t.shape[outer] == n:
        return "rows"
    if t.shape[inner] == n:
        return "columns"
    return None


def tensor_ranges(t: torch.Tensor, shards: Sequence[int], fraction: float) -> list[tuple[int, int]]:
    """(address, bytes) of the part of weight tensor t asked for: the first `fraction` of the
    outputs of each shard (`shards`: the layer's output sizes, in order), in every row where the
    outputs are t's columns; the first `fraction` of its bytes where t does not lie along the
    outputs."""
    if fraction <= 0 or t.numel() == 0:
        return []
    elem = t.element_size()
    n = sum(shards)
    along = _outputs_along(t, n)
    if along is None:
        return [(t.data_ptr(), int(t.numel() * elem * min(1.0, fraction)))]
    starts = [sum(shards[:i]) for i in range(len(shards))]
    take = [min(s, math.ceil(s * fraction)) for s in shards]  # outputs of each shard
    if along == "rows":
        row = t.numel() // n * elem  # bytes an output row
        return [(t.data_ptr() + a * row, c * row) for a, c in zip(starts, take, strict=True) if c]
    rows = t.numel() // n
    return [
        (t.data_ptr() + (r * n + a) * elem, c * elem)
        for r in range(rows)
        for a, c in zip(starts, take, strict=True)
        if c
    ]


def module_ranges(modules: Sequence[nn.Module], budget: int) -> list[tuple[int, int]]:
    """The pieces of `modules`' weights (their own parameters and buffers: a linear layer's
    weight, 4-bit planes, scales, zero points, bias), the modules in order, whole while the
    budget lasts, then the first outputs of the one it ends in; 16-byte aligned."""
    out: list[tuple[int, int]] = []
    for m in modules:
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        tensors = [t for t in own if t is not None and t.numel()]
        size = sum(t.numel() * t.element_size() for t in tensors)
        if budget <= 0 or not size:
            break
        fraction = min(1.0, budget / size)
        shards = list(getattr(m, "output_partition_sizes", None) or [])
        if not shards:
            shards = [int(getattr(m, "output_size_per_partition", 0))]
        for t in tensors:
            for addr, nbytes in tensor_ranges(t, shards, fraction):
                lo, hi = addr // 16 * 16, -(-(addr + nbytes) // 16) * 16
                out.append((lo, hi - lo))
        budget -= int(size * fraction)
    return out


def _compile() -> Any | None:
    what = "L2 weight prefetch (weights are then read from memory as they are needed)"
    return cuda_launch.build(_SOURCE, "pagoda_l2_prefetch", {"PIECE": PIECE}, what)


_KERNELS = cuda_launch.KernelCache(_compile)


@functools.cache
def _side_stream(device: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


_forked: set[int] = set()  # devices whose side stream has work not yet joined


def prefetch(ranges: torch.Tensor, pieces: int) -> bool:
    """Issue the prefetches of `ranges` (an int64 [n, 2] CUDA tensor of addresses and bytes;
    `pieces` of PIECE bytes in all) on the device's side stream, after what the current stream
    has issued so far; False where the kernel is not available (not built yet during a
    capture, or NVRTC cannot build it)."""
    kernel = _KERNELS.get(())
    if kernel is None:
        return False
    device = ranges.device.index or 0
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    ctas = max(1, min(MAX_CTAS, -(-pieces // THREADS)))
    with torch.cuda.stream(side):
        cuda_launch.launch(kernel.func, (ctas, 1, 1), THREADS, 0, [ranges, ranges.shape[0]], device)
    _forked.add(device)
    return True


def join(x: torch.Tensor) -> None:
    """Make x's device's current stream wait for the prefetches issued since the last join (a
    no-op where there were none)."""
    device = x.device.index or 0
    if x.is_cuda and device in _forked:
        torch.cuda.current_stream(device).wait_stream(_side_stream(device))
        _forked.discard(device)


class WeightPrefetch:
    """Prefetches the weights of `modules()` into L2, up to `PAGODA_L2_PREFETCH_MB`, when called
    on a step's activations x of at most MAX_TOKENS rows on an sm_90 GPU; a no-op elsewhere.
    The addresses are taken at the first such call (the weights are loaded and repacked by
    then, and a loaded weight never moves)."""

    def __init__(self, modules: Callable[[], Sequence[nn.Module]]) -> None:
        self._modules = modules
        self._ranges: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}

    def __call__(self, x: torch.Tensor) -> None:
        if not x.is_cuda or x.shape[0] > MAX_TOKENS:
            return
        budget = budget_bytes()
        if not budget or not _sm90(x.device.index or 0):
            return
        key = (x.device.index or 0, budget)
        if key not in self._ranges:
            if torch.cuda.is_current_stream_capturing():
                return  # built by the eager run before each capture
            pieces = module_ranges(self._modules(), budget)
            table = torch.tensor(pieces, dtype=torch.int64, device=x.device).view(-1, 2)
            self._ranges[key] = (table, sum(-(-b // PIECE) for _, b in pieces))
        table, count = self._ranges[key]
        if table.shape[0]:
            prefetch(table, count)
