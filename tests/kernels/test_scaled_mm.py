"""The W8A8 GEMMs (int8 and fp8, per-token activations, per-channel weights) against their
dequantize-then-matmul reference: the plain path (CPU), the Triton row-quantization, int8
epilogue and fused int8 GEMM kernels (under the Triton interpreter without a GPU; the fused
GEMM must give the exact integer product scaled in float32), the fused GEMM's configs built for
sm_90 (slow), and on a GPU the whole tensor-core path (gpu-marked) at Llama-like shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import build_for_sm90, enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()

from pagoda.kernels.scaled_mm import (  # noqa: E402
    FP8_DTYPE,
    QuantizedRows,
    fp8_supported,
    quantize_rows_ref,
    quantize_weight,
    scaled_mm,
    scaled_mm_ref,
)

DTYPES = [torch.int8, FP8_DTYPE]


def _randn(*shape: int, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _problem(m: int, k: int, n: int, dtype: torch.dtype, device="cpu", x_dtype=torch.float32):
    x = _randn(m, k, seed=1, device=device)
    x[:, 3] *= 20.0  # an outlier channel, as LLM activations have
    w_q, w_scale = quantize_weight(_randn(n, k, seed=2, device=device) * 0.05, dtype)
    bias = _randn(n, seed=3, device=device)
    return x.to(x_dtype), w_q, w_scale.reshape(-1), bias.to(x_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_rows_dequantize_within_half_a_step(dtype) -> None:
    x = _randn(5, 300) * 3
    x[2] = 0.0  # an all-zero row stays zero (no division by zero)
    q, scale = quantize_rows_ref(x, dtype)
    assert q.dtype == dtype and scale.shape == (5, 1)
    err = (q.float() * scale - x).abs()
    if dtype == torch.int8:
        assert (err <= scale / 2 + 1e-6).all() and q.abs().max() == 127
    else:  # e4m3: 3 mantissa bits, a relative step of 1/16 at most
        assert (err <= x.abs() / 16 + scale * 2**-9).all()
    assert (q[2].float() == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_plain_path_matches_dequantize_then_matmul(dtype, m) -> None:
    x, w_q, w_scale, bias = _problem(m, 96, 40, dtype)
    y = scaled_mm(x, w_q, w_scale, bias)  # CPU tensors: the plain path
    torch.testing.assert_close(y, scaled_mm_ref(x, w_q, w_scale, bias), atol=1e-4, rtol=1e-4)
    # and W8A8 stays close to the unquantized product
    dense = x @ (w_q.float() * w_scale[:, None]).t() + bias
    assert float((y - dense).norm() / dense.norm()) < (0.03 if dtype == torch.int8 else 0.05)


def test_batched_inputs_keep_their_leading_dims() -> None:
    x, w_q, w_scale, _ = _problem(6, 64, 24, torch.int8)
    y = scaled_mm(x.reshape(2, 3, 64), w_q, w_scale)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y.reshape(6, 24), scaled_mm(x, w_q, w_scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [64, 300, 4096, 5000])  # one pass up to 4096 values, then two
def test_triton_row_quantization_matches_reference(dtype, k) -> None:
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import quantize_rows_triton

    dev = kernel_device()
    x = _randn(4, k, seed=k, device=dev) * 2
    x[1] = 0.0
    q, scale = quantize_rows_triton(x, dtype)
    q_ref, scale_ref = quantize_rows_ref(x, dtype)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    diff = (q.float() - q_ref.float()).abs()
    if dtype == torch.int8:
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # a tie rounded otherwise
    elif dev.type == "cuda":  # within one e4m3 step (a cast through fp16 may round twice)
        assert (diff <= torch.clamp(q_ref.float().abs() / 8, min=2.0**-9)).all()
        assert (diff > 0).float().mean() < 0.01
    else:
        # The interpreter's fp32 -> e4m3 cast drops the carry when rounding up crosses a power
        # of two (125.5 -> 64, not 128) and rounds e4m3's subnormals (below 2^-6) otherwise: a
        # mismatch is allowed only there.
        bad = diff > 0
        ref = q_ref.float()[bad].abs()
        assert ((ref.log2() % 1 == 0) | (ref < 2.0**-6)).all() and bad.float().mean() < 0.05


@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_int8_epilogue_matches_reference(with_bias) -> None:
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import int8_epilogue

    dev = kernel_device()
    g = torch.Generator().manual_seed(0)
    acc = torch.randint(-(2**20), 2**20, (40, 200), generator=g, dtype=torch.int32).to(dev)
    xs = torch.rand(40, 1, generator=g).to(dev) / 100
    ws = torch.rand(200, generator=g).to(dev) / 100
    bias = torch.randn(200, generator=g).to(dev) if with_bias else None
    out = int8_epilogue(acc, xs, ws, bias, torch.float32, rows=33)  # the rows past 33 are padding
    ref = acc[:33].float() * xs[:33] * ws
    if bias is not None:
        ref = ref + bias
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", [None, "int_mm"])
@pytest.mark.parametrize("m", [1, 16, 20])
def test_int8_tensor_core_path_matches_reference(m, config) -> None:
    # The CUDA int8 path end to end (row quantization, then the fused GEMM, or padding to 32
    # rows, torch._int_mm and the epilogue); without a GPU, the kernels under the interpreter
    # and torch._int_mm on the CPU.
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import scaled_mm_cuda

    x, w_q, w_scale, bias = _problem(m, 64, 48, torch.int8, device=kernel_device())
    y = scaled_mm_cuda(x, w_q, w_scale, bias, config=config)
    assert y.shape == (m, 48)
    torch.testing.assert_close(y, scaled_mm_ref(x, w_q, w_scale, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prequantized_rows_give_the_same_product(dtype) -> None:
    # What RMSNorm / SiLU-and-mul hand an 8-bit layer (`QuantizedRows`): the product of the
    # rows the layer would have quantized itself, bit for bit (the plain path, CPU).
    x, w_q, w_scale, bias = _problem(6, 96, 40, dtype)
    q, scale = quantize_rows_ref(x.reshape(2, 3, 96), dtype)
    y = scaled_mm(QuantizedRows(q, scale, x.dtype), w_q, w_scale, bias)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.reshape(6, 40), scaled_mm(x, w_q, w_scale, bias))
    other = torch.int8 if dtype != torch.int8 else FP8_DTYPE
    with pytest.raises(ValueError, match="quantized to"):
        scaled_mm(QuantizedRows(q.to(other), scale, x.dtype), w_q, w_scale, bias)


@pytest.mark.parametrize("config", [None, "int_mm"])
@pytest.mark.parametrize("m", [1, 20])
def test_prequantized_rows_on_the_tensor_core_path(m, config) -> None:
    # quantized_mm_cuda: scaled_mm_cuda's kernels without its quantization (under the
    # interpreter without a GPU); int_mm pads 16 rows or fewer to 32 itself.
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import (
        quantize_rows_triton,
        quantized_mm_cuda,
        scaled_mm_cuda,
    )

    x, w_q, w_scale, bias = _problem(m, 64, 48, torch.int8, device=kernel_device())
    q, scale = quantize_rows_triton(x, torch.int8)
    y = quantized_mm_cuda(q, scale, w_q, w_scale, bias, x.dtype, config=config)
    assert torch.equal(y, scaled_mm_cuda(x, w_q, w_scale, bias, config=config))


def _int8_operands(m: int, n: int, k: int, device, with_bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xs = torch.rand(m, 1, generator=g) / 50 + 1e-4
    ws = torch.rand(n, generator=g) / 50 + 1e-4
    bias = torch.randn(n, generator=g) if with_bias else None
    # The exact integer product (int64 on the CPU), then the kernel's float32 epilogue.
    ref = (a.long() @ b.long().t()).to(torch.int32).float() * xs * ws
    if bias is not None:
        ref = ref + bias
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(a), to(xs), to(b), to(ws), to(bias), ref


def _interp_config(swap_ab: bool, split_k: int, block_k: int = 32):
    from pagoda.kernels.scaled_mm_triton import W8A8Config

    if swap_ab:
        return W8A8Config(16, 32, block_k, 1, 2, 4, True, split_k)
    return W8A8Config(32, 32, block_k, 2, 2, 4, False, split_k)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "m,n,k,swap_ab,split_k",
    [
        (1, 40, 96, True, 1),  # one row; N not a multiple of BLOCK_N
        (13, 64, 100, True, 1),  # K ragged against BLOCK_K
        (5, 48, 200, True, 3),  # split-K, the last split shorter and ragged
        (5, 48, 200, True, 7),  # 7 splits: the sum's groups of four, the second part full
        (70, 72, 160, False, 1),  # M, N past whole tiles; GROUP_M swizzle over 3 row tiles
        (37, 40, 136, False, 2),  # tiles + split-K + ragged K
    ],
)
def test_fused_int8_gemm_is_the_integer_product_scaled(m, n, k, swap_ab, split_k, with_bias):
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import w8a8_gemm

    dev = kernel_device()
    a, xs, b, ws, bias, ref = _int8_operands(m, n, k, dev, with_bias)
    y = w8a8_gemm(a, xs, b, ws, bias, torch.float32, _interp_config(swap_ab, split_k))
    assert y.shape == (m, n) and y.dtype == torch.float32
    if dev.type == "cpu":  # the interpreter: the same float32 operations, bit for bit
        assert torch.equal(y, ref)
    else:  # a GPU may fuse the bias into an FMA: one float32 rounding apart at most
        torch.testing.assert_close(y.cpu(), ref, rtol=2e-7, atol=1e-6)


def test_a_cuda_kernel_config_it_cannot_run_falls_back_to_the_triton_gemm() -> None:
    # The CUDA wgmma kernel's config on operands it does not take (here: not on an sm_90 GPU;
    # there: unaligned rows, or not built during a capture): the Triton GEMM's rule instead,
    # for fp8 past 64 rows the Triton GEMM where cuBLASLt's shapes do not fit (N = 40).
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm import plain_quantized_mm
    from pagoda.kernels.scaled_mm_triton import _product
    from pagoda.kernels.w8a8_wgmma import WgmmaW8A8Config

    dev = kernel_device()
    if dev.type != "cpu":
        pytest.skip("the interpreter's fallback; a GPU runs the kernel (test_w8a8_wgmma.py)")
    m, n, k = 70, 40, 64
    a, xs, b, ws, _, ref = _int8_operands(m, n, k, dev, with_bias=False)
    y = _product(a, xs, b, ws, None, torch.float32, m, WgmmaW8A8Config())
    assert torch.equal(y, ref)
    a8, b8 = (t.float().div(2).to(FP8_DTYPE) for t in (a, b))
    y8 = _product(a8, xs, b8, ws, None, torch.float32, m, WgmmaW8A8Config())
    ref8 = plain_quantized_mm(a8, xs, b8, ws, None, torch.float32)
    torch.testing.assert_close(y8, ref8, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "m,n,k,swap_ab,split_k",
    [
        (1, 40, 96, True, 1),
        (13, 64, 100, True, 1),
        (5, 48, 200, True, 3),
        (70, 72, 160, False, 1),
        (37, 40, 136, False, 2),
    ],
)
def test_fused_fp8_gemm_is_the_float_product_scaled(m, n, k, swap_ab, split_k) -> None:
    # e4m3 x e4m3 products are exact in float32; only the order of the float32 sums differs
    # from the reference's. Ragged K included: masked lanes are read as zero bytes.
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import w8a8_gemm

    dev = kernel_device()
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 40).to(FP8_DTYPE)
    b = (torch.randn(n, k, generator=g) * 40).to(FP8_DTYPE)
    xs = torch.rand(m, 1, generator=g) / 50 + 1e-4
    ws = torch.rand(n, generator=g) / 50 + 1e-4
    bias = torch.randn(n, generator=g)
    ref = (a.double() @ b.double().t()).float() * xs * ws + bias
    to = lambda t: t.to(dev)  # noqa: E731
    y = w8a8_gemm(to(a), to(xs), to(b), to(ws), to(bias), torch.float32,
                  _interp_config(swap_ab, split_k))  # fmt: skip
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(70, 72, 160), (37, 100, 208)])  # ragged M, N and K
def test_tma_tiles_give_the_same_product(m, n, k, dtype, persistent) -> None:
    # The copy engine's tiles (zeros past M, N and K) and the persistent tile loop: the same
    # product as the per-thread loads (under the interpreter: bit for bit).
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import W8A8Config, w8a8_gemm

    dev = kernel_device()
    g = torch.Generator().manual_seed(m)
    if dtype == torch.int8:
        a, xs, b, ws, bias, _ = _int8_operands(m, n, k, dev, seed=m)
    else:
        a = (torch.randn(m, k, generator=g) * 40).to(dtype).to(dev)
        b = (torch.randn(n, k, generator=g) * 40).to(dtype).to(dev)
        xs, ws = (
            (torch.rand(m, 1, generator=g) / 50).to(dev),
            (torch.rand(n, generator=g) / 50).to(dev),
        )
        bias = torch.randn(n, generator=g).to(dev)
    plain = W8A8Config(32, 32, 64, 2, 2, 4)
    tma = plain._replace(tma=True, persistent=persistent)
    assert tma.name.endswith("_tma_persistent" if persistent else "_tma")
    y = w8a8_gemm(a, xs, b, ws, bias, torch.float32, tma)
    ref = w8a8_gemm(a, xs, b, ws, bias, torch.float32, plain)
    if dev.type == "cpu":
        assert torch.equal(y, ref)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="neither swapped nor split"):
        w8a8_gemm(a, xs, b, ws, bias, torch.float32, tma._replace(split_k=2))
    odd = torch.zeros(m, 100, dtype=dtype, device=dev)  # rows 100 bytes apart
    with pytest.raises(ValueError, match="16-byte aligned"):
        w8a8_gemm(
            odd, xs, torch.zeros(n, 100, dtype=dtype, device=dev), ws, None, torch.float32, tma
        )


def _assert_within_one_ulp(
    y: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor | float = 0.0
) -> None:
    """y (bf16 / fp16) is ref (float32) rounded to y's dtype, or its neighbour: the kernel's
    float32 epilogue may contract a multiply-add into an FMA (one float32 rounding of the
    `terms` magnitude apart) and then round to the other side."""
    mant = torch.finfo(y.dtype).eps  # 2^-7 bf16, 2^-10 fp16: one ulp relative to [1, 2)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30)))) * mant
    diff = (y.float() - ref).abs()
    bound = ulp + terms * 2.0**-23
    assert bool((diff <= bound).all()), float((diff / bound).max())


def test_fused_int8_gemm_default_config_and_bf16_output() -> None:
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import w8a8_gemm

    a, xs, b, ws, bias, ref = _int8_operands(3, 64, 256, kernel_device())
    y = w8a8_gemm(a, xs, b, ws, bias, torch.bfloat16)  # choose_w8a8_config: swap-AB
    assert y.dtype == torch.bfloat16
    # One bf16 rounding of the exact float32 result (the interpreter's fp32 -> bf16 cast
    # truncates rather than rounding to nearest: one ulp, not half).
    _assert_within_one_ulp(y.cpu(), ref)


def test_fused_int8_gemm_rejects_what_it_cannot_run() -> None:
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import W8A8Config, w8a8_gemm

    a, xs, b, ws, _, _ = _int8_operands(4, 32, 64, "cpu")
    with pytest.raises(ValueError, match="two int8 or two float8"):
        w8a8_gemm(a.float(), xs, b, ws, None, torch.float32)
    with pytest.raises(ValueError, match="K-contiguous"):
        w8a8_gemm(a, xs, b.t().contiguous().t(), ws, None, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        w8a8_gemm(a, xs, b, ws, None, torch.float32, W8A8Config(16, 48, 64))
    with pytest.raises(ValueError, match="block_k"):
        w8a8_gemm(a, xs, b, ws, None, torch.float32, W8A8Config(16, 32, 16))
    with pytest.raises(ValueError, match="int_mm is scaled_mm_cuda's choice"):
        w8a8_gemm(a, xs, b, ws, None, torch.float32, "int_mm")
    with pytest.raises(ValueError, match="two int8 or two float8"):
        w8a8_gemm(a, xs, b.view(FP8_DTYPE), ws, None, torch.float32)


LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
BENCH_M = (1, 16, 64, 128, 256, 512, 1024, 4096)


def test_int8_config_table_covers_the_buckets_within_shared_memory() -> None:
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import (
        INT_MM,
        SCALED_MM,
        W8A8Config,
        choose_w8a8_config,
        w8a8_config_candidates,
    )
    from pagoda.kernels.skinny_gemm import SMEM_BUDGET, split_k_plan

    for n, k in LLAMA3_8B.values():
        for m in BENCH_M:
            cfg = choose_w8a8_config(m, n, k)
            assert cfg == choose_w8a8_config(m, n, k)  # a table, not a measurement
            assert isinstance(cfg, W8A8Config) and cfg.swap_ab == (m <= 64)
            if cfg.swap_ab:
                assert cfg.block_m >= m
            cands = w8a8_config_candidates(m, n, k)
            assert cands[0] == cfg and INT_MM in cands and len(set(cands)) == len(cands)
            for c in cands[2:]:
                assert c.num_stages * (c.block_m + c.block_n) * c.block_k <= SMEM_BUDGET
                assert split_k_plan(k, c.block_k, c.split_k)[1] == c.split_k
            assert 8 <= len(cands) <= 120
            # fp8: the same fused kernel for decode, cuBLASLt's fp8 GEMM above.
            fp8 = choose_w8a8_config(m, n, k, FP8_DTYPE)
            assert fp8 == (cfg if m <= 64 else SCALED_MM)
            fp8_cands = w8a8_config_candidates(m, n, k, FP8_DTYPE)
            assert fp8_cands[0] == fp8 and SCALED_MM in fp8_cands and INT_MM not in fp8_cands


def test_fp8_accumulation_follows_the_variable(monkeypatch) -> None:
    # PAGODA_FP8_FAST_ACCUM: the fp8 MMA's additions between float32 promotions, none (the
    # tensor cores' precision across K, the default) or each K tile's; int8 sums are exact.
    pytest.importorskip("triton")
    from pagoda.kernels.scaled_mm_triton import _launch_args, choose_w8a8_config

    cfg = choose_w8a8_config(16, 4096, 14336, FP8_DTYPE)
    x8, w8 = torch.zeros(16, 64, dtype=torch.int8), torch.zeros(64, 64, dtype=torch.int8)
    xf, wf = x8.view(FP8_DTYPE), w8.view(FP8_DTYPE)
    monkeypatch.delenv("PAGODA_FP8_FAST_ACCUM", raising=False)
    assert _launch_args(cfg, xf, wf, None)["IMPRECISE"] is None
    monkeypatch.setenv("PAGODA_FP8_FAST_ACCUM", "0")
    assert _launch_args(cfg, xf, wf, None)["IMPRECISE"] == cfg.block_k
    assert _launch_args(cfg, x8, w8, None)["IMPRECISE"] is None


# A fresh interpreter: a process that imported triton under TRITON_INTERPRET=1 (this module
# does, without a GPU) cannot compile for real any more.
_SM90_BUILD = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda.kernels.scaled_mm_triton import _w8a8_gemm_kernel as fn, choose_w8a8_config

m, n, k = (int(v) for v in sys.argv[1:4])
is_int = sys.argv[4] == "int8"
cfg = choose_w8a8_config(m, n, k)
op, acc = ("*i8", "*i32") if is_int else ("*fp8e4nv", "*fp32")
sig = {p.name: "i32" for p in fn.params if not p.is_constexpr}
sig.update(a_ptr=op, b_ptr=op, xs_ptr="*fp32", ws_ptr="*fp32", bias_ptr="*bf16",
           c_ptr="*bf16", partial_ptr=acc, counter_ptr="*i32", stride_a="i64",
           stride_b="i64", stride_c="i64")
consts = dict(HAS_BIAS=True, EVEN_K=True, SWAP_AB=cfg.swap_ab, SPLIT=cfg.split_k > 1,
              ACC_INT=is_int, IMPRECISE=None if is_int else cfg.block_k,
              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
              GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages, PDL=True)
sig.update(dict.fromkeys(consts, "constexpr"))
# The runtime specializes 16-aligned pointers and 16-divisible sizes: say so, as a launch would.
aligned = ("a_ptr", "b_ptr", "c_ptr", "partial_ptr", "N", "K", "k_per_split", "stride_a",
           "stride_b", "stride_c")
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
src = ASTSource(fn, sig, {(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
ptx = kernel.asm["ptx"]
print(json.dumps({"shared": kernel.metadata.shared, "ptx": ptx}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("m,name,dtype", [(1, "qkv", "int8"), (16, "down", "int8"),
                                          (64, "gate_up", "int8"), (128, "o", "int8"),
                                          (256, "qkv", "int8"), (4096, "gate_up", "int8"),
                                          (1, "down", "fp8"), (64, "gate_up", "fp8")])  # fmt: skip
def test_chosen_w8a8_configs_compile_for_sm90(m: int, name: str, dtype: str) -> None:
    """A real sm_90 build (no GPU needed) of the chosen configs: int8 wgmma into int32 or
    e4m3 wgmma into float32, and shared memory within the SM's 227 KB."""
    pytest.importorskip("triton")
    n, k = LLAMA3_8B[name]
    built = build_for_sm90(_SM90_BUILD, m, n, k, dtype)
    assert built["shared"] <= 227 * 1024
    kind = ".s32.s8.s8" if dtype == "int8" else ".f32.e4m3.e4m3"
    assert "wgmma.mma_async.sync.aligned" in built["ptx"] and kind in built["ptx"]
    assert "griddepcontrol.wait" in built["ptx"]  # launched as a programmatic dependent


_SM90_TMA_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda.kernels.scaled_mm_triton import _w8a8_tma_kernel as fn, w8a8_config_candidates

is_int = sys.argv[1] == "int8"
m, n, k = 256, 6144, 4096
cfg = next(c for c in w8a8_config_candidates(m, n, k) if not isinstance(c, str) and c.tma)
op = "i8" if is_int else "fp8e4nv"
sig = {p.name: "i32" for p in fn.params if not p.is_constexpr}
sig.update(a_desc=f"tensordesc<{op}[{cfg.block_m}, {cfg.block_k}]>",
           b_desc=f"tensordesc<{op}[{cfg.block_n}, {cfg.block_k}]>",
           xs_ptr="*fp32", ws_ptr="*fp32", bias_ptr="*bf16", c_ptr="*bf16", stride_c="i64")
consts = dict(HAS_BIAS=True, ACC_INT=is_int, IMPRECISE=None if is_int else cfg.block_k,
              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
              GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages, PDL=True)
sig.update(dict.fromkeys(consts, "constexpr"))
src = ASTSource(fn, sig, {(fn.arg_names.index(c),): v for c, v in consts.items()})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
print(json.dumps({"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_tma_config_compiles_for_sm90(dtype: str) -> None:
    """A real sm_90 build of a TMA config: its tiles by the copy engine (bulk tensor copies)
    into the 8-bit wgmma, within the shared memory of two CTAs an SM."""
    pytest.importorskip("triton")
    built = build_for_sm90(_SM90_TMA_BUILD, dtype)
    assert built["shared"] <= 227 * 1024 // 2
    assert "cp.async.bulk.tensor" in built["ptx"] and "wgmma.mma_async" in built["ptx"]


# ---- GPU: the tensor-core paths --------------------------------------------------------------

LLAMA3_8B_GEMMS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 17, 64, 300])
@pytest.mark.parametrize("k_n", [(4096, 6144), (14336, 4096), (576, 960)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_scaled_mm_matches_dequantize_then_matmul(dtype, k_n, m) -> None:
    if dtype == FP8_DTYPE and not fp8_supported():
        pytest.skip("no FP8 tensor cores on this GPU (sm_89+)")
    k, n = k_n
    x, w_q, w_scale, bias = _problem(m, k, n, dtype, device="cuda", x_dtype=torch.bfloat16)
    y = scaled_mm(x, w_q, w_scale, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = scaled_mm_ref(x, w_q, w_scale, bias).float()
    # The same quantized operands up to a tie rounded otherwise; bf16 output.
    err = float((y.float() - ref).norm() / ref.norm())
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [16, 300])  # the Triton GEMM, cuBLASLt's
def test_gpu_fp8_fast_and_exact_accumulation(monkeypatch, m) -> None:
    # Both accumulations give the product within the 8-bit operands' error (the tolerance of
    # every path here); promoting each K tile's sum to float32 is no less accurate, on the
    # deepest layer (K 14336), where the tensor cores' own additions lose the most.
    if not fp8_supported():
        pytest.skip("no FP8 tensor cores on this GPU (sm_89+)")
    x, w_q, w_scale, bias = _problem(
        m, 14336, 4096, FP8_DTYPE, device="cuda", x_dtype=torch.bfloat16
    )
    ref = scaled_mm_ref(x, w_q, w_scale, bias).float()
    errors = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("PAGODA_FP8_FAST_ACCUM", fast)
        y = scaled_mm(x, w_q, w_scale, bias).float()
        errors[fast] = float((y - ref).norm() / ref.norm())
    assert max(errors.values()) < 1e-2 and errors["0"] <= errors["1"] + 1e-4, f"{errors}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_scaled_mm_without_bias_and_in_float16(dtype) -> None:
    if dtype == FP8_DTYPE and not fp8_supported():
        pytest.skip("no FP8 tensor cores on this GPU (sm_89+)")
    x, w_q, w_scale, _ = _problem(64, 1024, 512, dtype, device="cuda", x_dtype=torch.float16)
    y = scaled_mm(x, w_q, w_scale)
    assert y.dtype == torch.float16
    ref = scaled_mm_ref(x, w_q, w_scale).float()
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 17, 64, 100, 300, 1024])
@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_gpu_fused_int8_gemm_is_the_integer_product_scaled(name, m) -> None:
    from pagoda.kernels.scaled_mm_triton import w8a8_gemm

    n, k = LLAMA3_8B[name]
    g = torch.Generator(device="cuda").manual_seed(m)
    a = torch.randint(-127, 128, (m, k), generator=g, device="cuda", dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)
    xs = torch.rand(m, 1, generator=g, device="cuda") / 1e3
    ws = torch.rand(n, generator=g, device="cuda") / 1e3
    bias = torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16)
    y = w8a8_gemm(a, xs, b, ws, bias, torch.bfloat16)
    # |sums| <= 127^2 * 14336 < 2^28: exact in the kernel's int32 and in float64 here
    acc = (a.double() @ b.double().t()).to(torch.int32)
    prod = acc.float() * xs * ws
    ref = prod + bias.float()
    _assert_within_one_ulp(y, ref, terms=prod.abs() + bias.float().abs())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_gpu_int8_configs_agree_and_replay_in_a_cuda_graph(m) -> None:
    # Every candidate config (split-K ones included) gives the same bits as the chosen one;
    # the split-K counters reset themselves across CUDA-graph replays.
    from pagoda.kernels.scaled_mm_triton import (
        INT_MM,
        scaled_mm_cuda,
        w8a8_config_candidates,
    )

    n, k = LLAMA3_8B["down"]
    x, w_q, w_scale, _ = _problem(m, k, n, torch.int8, device="cuda", x_dtype=torch.bfloat16)
    y0 = scaled_mm_cuda(x, w_q, w_scale, None)
    cands = w8a8_config_candidates(m, n, k)
    for cfg in cands[2:][::7]:
        y = scaled_mm_cuda(x, w_q, w_scale, None, config=cfg)
        assert torch.equal(y, y0), cfg
    y_int_mm = scaled_mm_cuda(x, w_q, w_scale, None, config=INT_MM)
    _assert_within_one_ulp(y_int_mm, y0.float())
    split = next((c for c in cands[1:] if c != INT_MM and c.split_k > 1), cands[0])
    scaled_mm_cuda(x, w_q, w_scale, None, config=split)  # eager: the counters exist
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scaled_mm_cuda(x, w_q, w_scale, None, config=split)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y0)
