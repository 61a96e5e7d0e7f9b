"""The Triton skinny GEMM (2..128 rows, split-K reduced in the kernel) against F.linear: under
the Triton interpreter in float32 when there is no GPU; bf16 at Llama-3-8B shapes, in CUDA
graphs, on the GPU; its sm_90 build (shared memory, wgmma, the barrier before the counter's
release) without a GPU (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch
from kernel_testing import (
    assert_graph_replays_exactly,
    build_for_sm90,
    enable_interpreter_without_cuda,
    kernel_device,
)

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels import skinny_gemm  # noqa: E402
from pagoda.kernels.skinny_gemm import (  # noqa: E402
    default_config,
    prepare,
    skinny_linear,
    split_k_plan,
)

DEV = kernel_device()
LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


# (N, K, BLOCK_N, BLOCK_K, SPLIT_K): N never a multiple of BLOCK_N; K in 1, 2 (64 + 32) and
# 3 ragged splits (48 + 48 + 8, K not a multiple of BLOCK_K either); 5 and 6 splits (the sum
# loads four splits at a time: one full group and a part one).
CONFIGS = [
    (40, 96, 16, 32, 1),
    (40, 96, 16, 32, 2),
    (50, 104, 32, 16, 3),
    (40, 160, 16, 32, 5),
    (50, 192, 16, 32, 6),
]


@pytest.mark.parametrize("n,k,block_n,block_k,split_k", CONFIGS, ids=str)
@pytest.mark.parametrize("m", [2, 5, 16, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_linear(m, n, k, block_n, block_k, split_k, with_bias) -> None:
    x, w = _randn(m, k, seed=m), _randn(n, k, seed=k)
    bias = _randn(n, seed=3) if with_bias else None
    out = skinny_linear(x, w, bias, block_n=block_n, block_k=block_k, split_k=split_k)
    assert out is not None and out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), atol=1e-4, rtol=1e-4)


def test_split_k_plan_takes_whole_blocks_and_no_empty_splits() -> None:
    assert split_k_plan(96, 32, 2) == (64, 2)
    assert split_k_plan(104, 16, 3) == (48, 3)
    assert split_k_plan(64, 32, 8) == (32, 2)  # 2 blocks: 2 splits, not 8
    assert split_k_plan(4096, 256, 3) == (1536, 3)


def test_split_k_is_deterministic_and_resets_its_counters() -> None:
    x, w, bias = _randn(33, 104, seed=1), _randn(50, 104, seed=2), _randn(50, seed=3)
    cfg = dict(block_n=16, block_k=16, split_k=3)
    first = skinny_linear(x, w, bias, **cfg)
    assert not prepare(DEV).any()  # back to 0: the next call (or graph replay) starts clean
    # A counter left at 1 would make every split of that tile miss the last-arrival test.
    assert torch.equal(skinny_linear(x, w, bias, **cfg), first)
    assert not prepare(DEV).any()
    unsplit = skinny_linear(x, w, bias, block_n=16, block_k=16, split_k=1)
    torch.testing.assert_close(first, unsplit, atol=1e-4, rtol=1e-4)


def test_default_config_runs_and_matches_linear() -> None:
    x, w = _randn(5, 96, seed=4), _randn(40, 96, seed=5)
    torch.testing.assert_close(skinny_linear(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_default_config_fits_shared_memory_and_splits_k_evenly(name: str) -> None:
    n, k = LLAMA3_8B[name]
    for m in (2, 4, 8, 16, 32, 48, 64, 96, 128):
        block_n, block_k, split_k, num_warps, num_stages = default_config(m, n, k)
        block_m = skinny_gemm.block_m_for(m)
        assert (block_n + block_m) * block_k * 2 * num_stages <= skinny_gemm.SMEM_BUDGET
        assert split_k_plan(k, block_k, split_k)[1] == split_k
        assert num_warps in (4, 8) and num_stages >= 2


def test_preferred_where_the_sweep_beat_cublas() -> None:
    qkv, gate_up = LLAMA3_8B["qkv"], LLAMA3_8B["gate_up"]
    assert skinny_gemm.preferred(2, *qkv) and skinny_gemm.preferred(32, *qkv)
    assert not skinny_gemm.preferred(48, *qkv) and skinny_gemm.preferred(64, *gate_up)
    assert not skinny_gemm.preferred(1, *qkv)  # one row: the GEMV
    assert not skinny_gemm.preferred(96, *gate_up)


def test_unsupported_inputs_return_none() -> None:
    w = _randn(24, 64, seed=6)
    x = _randn(4, 64, seed=7)
    assert skinny_linear(x[:1], w) is None  # one row: the GEMV's job
    assert skinny_linear(_randn(129, 64, seed=8), w) is None
    assert skinny_linear(x.to(torch.int32), w.to(torch.int32)) is None
    assert skinny_linear(x.double(), w.double()) is None
    assert skinny_linear(x, w.double()) is None
    assert skinny_linear(x[:, :60], w[:, :60].contiguous()) is None  # K not a multiple of 8
    assert skinny_linear(x, _randn(64, 24, seed=9).T) is None  # column-major weight
    assert skinny_linear(_randn(64, 4, seed=10).T, w) is None  # x columns strided
    assert skinny_linear(x[None], w) is None  # 3-D
    assert skinny_linear(x, w, _randn(23, seed=11)) is None
    if torch.cuda.is_available():
        assert skinny_linear(x, w.cpu()) is None  # two devices
    with pytest.raises(ValueError, match="power of two"):
        skinny_linear(x, w, block_n=48)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qkv", "down"])
@pytest.mark.parametrize("m", [2, 16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_skinny_linear_at_llama8b_shapes(name: str, m: int, dtype: torch.dtype) -> None:
    n, k = LLAMA3_8B[name]
    x = _randn(m, k, seed=m, dtype=dtype)
    w = _randn(n, k, seed=2, dtype=dtype) * 0.02
    bias = _randn(n, seed=3, dtype=dtype) if m == 16 else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    out = skinny_linear(x, w, bias)
    # fp32 accumulation in another order, one rounding to 16 bits: within 2 ulps.
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,m", [("qkv", 16), ("down", 64), ("gate_up", 128)])
def test_skinny_linear_in_a_cuda_graph_replays_exactly(name: str, m: int) -> None:
    n, k = LLAMA3_8B[name]
    x = _randn(m, k, seed=1, dtype=torch.bfloat16)
    w = _randn(n, k, seed=2, dtype=torch.bfloat16) * 0.02
    # split order fixed: the same bits every replay, the counters reset
    graph, out = assert_graph_replays_exactly(
        lambda: skinny_linear(x, w), lambda: not prepare(x.device).any()
    )
    x.copy_(_randn(m, k, seed=5, dtype=torch.bfloat16))
    graph.replay()
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_first_split_call_inside_a_capture_names_prepare() -> None:
    x = _randn(16, 4096, seed=1, dtype=torch.bfloat16)
    w = _randn(4096, 4096, seed=2, dtype=torch.bfloat16)
    skinny_linear(x, w, split_k=1)  # compiled outside; no counters needed
    saved = skinny_gemm._COUNTERS.pop(x.device, None)
    try:
        with pytest.raises(RuntimeError, match="prepare"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                skinny_linear(x, w, split_k=4)
    finally:
        skinny_gemm._COUNTERS.pop(x.device, None)
        if saved is not None:
            skinny_gemm._COUNTERS[x.device] = saved


# Run in a fresh interpreter: a process that imported triton under TRITON_INTERPRET=1 (this
# module does, without a GPU) builds triton.language's own helpers for the interpreter and
# cannot compile for real any more.
_SM90_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda.kernels.skinny_gemm import _skinny_gemm_kernel as fn, block_m_for, default_config

dtype, m, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
block_n, block_k, split_k, num_warps, num_stages = default_config(m, n, k)
sig = {p.name: "i32" for p in fn.params if not p.is_constexpr}
sig.update(dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "y_ptr"), "*" + dtype))
sig.update(partial_ptr="*fp32", counter_ptr="*i32", stride_x="i64", stride_w="i64", stride_y="i64")
consts = dict(HAS_BIAS=True, EVEN_K=True, SPLIT=True, BLOCK_M=block_m_for(m), BLOCK_N=block_n,
              BLOCK_K=block_k, NUM_STAGES=num_stages, DOT_PRECISION="tf32")
sig.update(dict.fromkeys(consts, "constexpr"))
# The runtime specializes 16-aligned pointers and 16-divisible sizes: say so, as a launch would.
aligned = ("x_ptr", "w_ptr", "y_ptr", "partial_ptr", "N", "K", "k_per_split", "stride_x")
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
src = ASTSource(fn, sig, {(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=num_warps, num_stages=num_stages))
print(json.dumps({"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,m,name", [("bf16", 2, "qkv"), ("bf16", 128, "down"), ("fp16", 64, "lm_head")]
)
def test_default_configs_compile_for_sm90(dtype: str, m: int, name: str) -> None:
    """A real sm_90 build (no GPU needed) of the split variant: shared memory within the SM's
    227 KB, wgmma, a CTA barrier between the partial stores and the one thread's release of
    the counter (else other threads' partials need not be visible to the last split), and the
    sum's loads of four splits before it adds (`sum_splits`)."""
    n, k = LLAMA3_8B[name]
    built = build_for_sm90(_SM90_BUILD, dtype, m, n, k)
    assert built["shared"] <= 227 * 1024
    ptx = built["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx
    body = [
        line.strip() for line in ptx.splitlines() if not line.strip().startswith((".loc", "//"))
    ]
    atom = next(i for i, line in enumerate(body) if "atom.global.gpu.acq_rel.add" in line)
    last_store = max(i for i, line in enumerate(body[:atom]) if "st.global" in line)
    assert any(re.match(r"bar\.sync\s+0", line) for line in body[last_store:atom])
    # The last split's sum loads four splits' partial tiles (each as many loads as a partial's
    # stores) with no add between them.
    partial_stores = sum("st.global" in line for line in body[:atom])
    runs, loads = [], 0
    for line in body[atom:]:
        if "ld.global.cg" in line:
            loads += 1
        elif re.match(r"add(\.rn)?\.f32", line):
            runs, loads = runs + [loads], 0
    assert max(runs) == 4 * partial_stores


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep instead")
def test_gemm_sweep_dry_run_reports_timings_skips_and_a_summary(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location(
        "gemm_sweep", os.path.join(os.path.dirname(__file__), "../../benchmarks/gemm_sweep.py")
    )
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.json"
    argv = ["--dry-run", "--jobs", "0", "--shapes", "down", "--m", "5", "160", "--out", str(out)]
    result = sweep.main(argv)
    assert json.loads(out.read_text())["summary"] == result["summary"]
    few, many = result["rows"]
    assert few["m"] == 5 and few["max_abs_err"] < 1e-4 and few["default_us"] is not None
    assert any(c["config"][2] > 1 for c in few["configs"])  # split-K configs were timed
    assert [f["config"] for f in few["failures"]] == [list(sweep.BAD_CONFIG)]
    assert many["m"] == 160 and "triton_us" not in many  # past MAX_ROWS: the BLAS libraries only
    assert [s["m"] for s in result["summary"]] == [5, 160]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_layers_take_the_skinny_gemm_for_few_rows_only() -> None:
    from pagoda.kernels import few_rows_linear
    from pagoda.model.layers.linear import UnquantizedLinearMethod

    n, k = LLAMA3_8B["qkv"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    layer = torch.nn.Module()
    layer.weight, layer.fused_ops = torch.nn.Parameter(w, requires_grad=False), True
    for m, expect_skinny in ((1, False), (16, True), (48, False), (256, False)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert (few_rows_linear(x, w) is not None) == expect_skinny, m
        assert few_rows_linear(x.cpu(), w.cpu()) is None  # CPU tensors: torch's GEMM
        y = UnquantizedLinearMethod().apply(layer, x)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w), atol=2e-2, rtol=2e-2)
