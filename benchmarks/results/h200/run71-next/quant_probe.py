"""The per-token 8-bit row quantization (`scaled_mm_triton.quantize_rows_triton`: one program a
row, the row read twice, once for its absolute maximum and once to quantize it) against a
variant that holds a row of up to 4096 values in registers and reads it once, and against the
same with several rows a program; us a call in a CUDA graph of 32 calls (o_proj's input,
K = 4096), and whether the outputs are bit-identical."""

import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from w8a8_bench import time_step  # noqa: E402

from pagoda.kernels import pdl_enabled  # noqa: E402
from pagoda.kernels.scaled_mm_triton import (  # noqa: E402
    INT8_MAX,
    quantize_rows_triton,
    quantize_values,
    row_scale,
)
from pagoda.kernels.triton_pdl import dependent_start  # noqa: E402

QMAX = tl.constexpr(INT8_MAX)  # a jitted function reads only constexpr globals (on a GPU)


@triton.jit
def _one_pass_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    dependent_start(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (offs[None, :] < K)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), axis=1), QMAX)
    tl.store(s_ptr + rows, scale, mask=rows < M)
    v = quantize_values(x, scale[:, None], QMAX, True)
    tl.store(q_ptr + r64 * stride_q + offs[None, :], v.to(tl.int8), mask=mask)


def one_pass(x, rows_per_program):
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    pdl = pdl_enabled(x)
    _one_pass_kernel[(triton.cdiv(m, rows_per_program),)](
        x, q, s, m, k, x.stride(0), q.stride(0), ROWS=rows_per_program, BLOCK=block, PDL=pdl,
        launch_pdl=pdl, num_warps=8,
    )  # fmt: skip
    return q, s


g = torch.Generator(device="cuda").manual_seed(0)
for m in (1, 64, 128, 256, 512, 1024):
    xs = [torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(32)]
    ref = quantize_rows_triton(xs[0], torch.int8)
    t = {"two_pass": time_step(lambda xs=xs: [quantize_rows_triton(x, torch.int8) for x in xs],
                               "cuda", 20)}  # fmt: skip
    for rows in (1, 2, 4):
        got = one_pass(xs[0], rows)
        same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        ms = time_step(lambda r=rows, xs=xs: [one_pass(x, r) for x in xs], "cuda", 20)
        t[f"one_pass_r{rows}{'' if same else ' (DIFFERS)'}"] = ms
    print(f"M={m:>5}: " + "  ".join(f"{k} {v / 32 * 1e3:.2f} us" for k, v in t.items()), flush=True)
