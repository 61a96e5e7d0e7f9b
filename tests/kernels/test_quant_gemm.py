"""The quantized-weight GEMM (`pagoda.kernels.cpu.quant`) against dequantize-then-matmul, at
every ISA level this CPU runs (portable C everywhere, AVX2 / AVX-512 VNNI where present).

The kernel quantizes each activation row per block of 32 to int8: d_b = max|x| / 127 and
q_i = round(x_i / d_b), so |x_i - d_b q_i| <= d_b / 2, and then computes sum_i w_i d_b q_i with
the integer products exact and fp32 sums. Against y = x . w that gives

    |y_kernel - y| <= sum_b (d_b / 2) * sum_{i in b} |w_i|  +  fp32 rounding,

and the rounding, for nb blocks summed one after another in fp32, is at most
(nb + 8) * 2^-24 * sum_i |w_i| |d_b q_i| (a few ulps per block term, plus the block's own
products). Two checks follow: against the activations quantized the same way in torch (only
the fp32 term may differ: this catches any misplaced block, nibble or scale), and against the
float64 product of the unquantized x (the int8 bound above). Weights are random GGUF blocks
(random bytes, sane fp16 scales) dequantized by `gguf_quants`, the loader's reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.kernels.cpu import quant
from pagoda.kernels.cpu.quant import QuantWeight, pack_x8
from pagoda.model.loader.gguf_quants import GGML_BLOCK_SIZES, dequantize

try:
    ISAS = quant.supported_isas()
    quant.load_quant_library()
except Exception as e:  # no compiler: every test here is skipped with the reason
    pytest.skip(f"quantized CPU GEMM unavailable: {e}", allow_module_level=True)


@pytest.fixture(autouse=True)
def integer_tiles():
    """The vector tiles at every row count, so that they stay covered on CPUs with AMX too
    (where the AMX path takes batches: the same bits, tested at the end)."""
    old = {isa: quant.set_amx_min_rows(1 << 30, isa=isa) for isa in ISAS}
    yield
    for isa, rows in old.items():
        if rows > 0:
            quant.set_amx_min_rows(rows, isa=isa)


TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
F16_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}  # byte offsets


def random_blocks(ggml_type: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF rows [n, row_bytes] uint8, their float32 dequantization [n, k])."""
    rng = np.random.default_rng(seed)
    elems, nbytes = GGML_BLOCK_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[ggml_type]:
        scale = (rng.standard_normal((n, k // elems)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n, k // elems, 2)
    raw = raw.reshape(n, -1)
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, ggml_type, (n, k)))


def quantized_acts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernel sees it: (d_b * q_i [M, K] float64, d_b [M, K/32])."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(xb * torch.where(d != 0, 1.0 / d, torch.zeros_like(d)))  # half to even
    return (q.double() * d.double()).reshape(m, k), d.squeeze(-1).double()


def weights(ggml_type: int, n: int, k: int, seed: int) -> tuple[list[QuantWeight], torch.Tensor]:
    raw, w = random_blocks(ggml_type, n, k, seed)
    layouts = [QuantWeight(raw, ggml_type, n, k)]
    if ggml_type in quant.X8_TYPES:
        layouts.append(QuantWeight(pack_x8(raw, ggml_type, k), ggml_type, n, k, x8=True))
    return layouts, w


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    xq, d = quantized_acts(x)
    wd, nb = w.double(), x.shape[1] // 32
    fp32 = (nb + 8) * 2.0**-24 * (xq.abs() @ wd.abs().T) + 1e-30
    err_emulated = (y.double() - xq @ wd.T).abs()
    assert (err_emulated <= fp32).all(), f"max {(err_emulated / fp32).max():.2f} x the fp32 bound"
    # sum_b d_b / 2 * ||w_b||_1: [M, nb] @ [nb, N]
    w_l1 = wd.abs().reshape(w.shape[0], nb, 32).sum(-1)
    bound = d / 2 @ w_l1.T + fp32
    err = (y.double() - x.double() @ wd.T).abs()
    assert (err <= bound).all(), f"max {(err / bound).max():.2f} x the int8 bound"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", TYPES)
def test_matches_dequantized_matmul_within_int8_bound(isa, name):
    ggml_type = TYPES[name]
    ks = (256, 512) if ggml_type in (12, 13, 14) else (96, 320)  # nb odd / past one vector
    for k in ks:
        for n in (1, 13, 37):  # fewer than 8, and not a multiple of 8 or of the 16-row chunk
            layouts, w = weights(ggml_type, n, k, seed=n * k)
            for m in (1, 3, 13, 70):  # tile remainders, more rows than a 64-row panel
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 2
                for qw in layouts:
                    check(quant.quant_linear(x, qw, isa=isa), x, w)


def on_1_and_2_threads(*args, **kwargs) -> list[torch.Tensor]:
    """quant_linear(*args, **kwargs) on one thread, then on two."""
    old = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(quant.quant_linear(*args, **kwargs))
    finally:
        torch.set_num_threads(old)
    return results


@pytest.mark.parametrize("isa", ISAS)
def test_threads_bias_bf16_and_strided_rows(isa):
    layouts, w = weights(3, 77, 320, seed=1)
    x = torch.randn(40, 400)[:, 50:370]  # rows with a stride
    bias = torch.randn(77)
    results = on_1_and_2_threads(x, layouts[1], bias, isa=isa)
    assert torch.equal(results[0], results[1])  # the split over threads changes no sum
    y0 = quant.quant_linear(x, layouts[1], isa=isa)
    check(y0, x, w)
    assert torch.equal(results[0], y0 + bias)  # the bias added once, in fp32
    y16 = quant.quant_linear(x, layouts[1], bias, out_dtype=torch.bfloat16, isa=isa)
    assert torch.equal(y16, results[0].to(torch.bfloat16))  # one rounding at the store
    xb = x.to(torch.bfloat16)
    check(quant.quant_linear(xb, layouts[1], out_dtype=torch.float32, isa=isa), xb.float(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_level_agrees(dtype):
    layouts, w = weights(3, 37, 320, seed=2)
    x = torch.randn(5, 320).to(dtype)
    ys = [quant.quant_linear(x, layouts[1], isa=isa).double() for isa in ISAS]
    xq, _ = quantized_acts(x.float())
    tol = 18 * 2.0**-24 * (xq.abs() @ w.double().abs().T) * 2
    for y in ys[1:]:
        assert ((y - ys[0]).abs() <= tol).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_x8_tiles_give_the_same_bits_at_every_simd_level(name):
    """The x8 layout's SIMD tiles (AVX2 256-bit, AVX-512 VNNI 512-bit: 16 weight rows x 8
    activation rows) make the same integers and apply the scales in the same fp32 order, so
    every level from AVX2 up gives the same bits, for every tile width and a last odd group."""
    simd = [isa for isa in ISAS if isa != "portable"]
    if len(simd) < 2:
        pytest.skip(f"one SIMD level on this CPU ({ISAS})")
    layouts, _ = weights(TYPES[name], 37, 320, seed=4)  # 5 groups: two pairs and one alone
    for m in (1, 2, 5, 8, 13, 70):
        x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m))
        ys = [quant.quant_linear(x, layouts[1], isa=isa) for isa in simd]
        for isa, y in zip(simd[1:], ys[1:]):
            assert torch.equal(y, ys[0]), (isa, m)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_rows_is_the_loaders_dequantization(name):
    layouts, w = weights(TYPES[name], 21, 256, seed=3)
    ids = torch.tensor([[20, 0], [7, 8]])
    for qw in layouts:
        assert torch.equal(quant.dequantize_rows(qw, ids), w[ids])
    with pytest.raises(ValueError, match="outside"):
        quant.dequantize_rows(layouts[0], torch.tensor([21]))


def test_fused_output_slices_and_shape_errors():
    (q41, *_), w1 = weights(3, 8, 64, seed=4)
    (q6k, *_), w2 = weights(14, 5, 256, seed=5)
    out = torch.zeros(2, 20)
    x = torch.randn(2, 64)
    quant.quant_linear(x, q41, out=out[:, 3:11])
    check(out[:, 3:11], x, w1)
    assert (out[:, :3] == 0).all() and (out[:, 11:] == 0).all()
    with pytest.raises(ValueError, match="features"):
        quant.quant_linear(torch.randn(2, 256), q41)
    with pytest.raises(ValueError, match="uint8 CPU tensor"):
        QuantWeight(q6k.data[:, 1:], 14, 5, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantWeight(q6k.data, 14, 5, 200)


# ---- the AMX path (quant_amx.h): the integer dots on AMX-INT8 tiles, the same bits ----


@pytest.fixture
def amx_from_one_row():
    if not quant.amx_active():
        pytest.skip("no AMX tiles here (a CPU without AMX, or PAGODA_CPU_AMX=0)")
    old = quant.set_amx_min_rows(1)
    yield
    quant.set_amx_min_rows(1 << 30)  # integer_tiles (autouse) restores the default after
    assert old > 0


def test_amx_path_runs_where_the_cpu_has_it():
    from pagoda.utils import cpu_build as build

    flags = set(build.cpu_flags().split())
    built = build.amx_built() and "avx512_vnni" in flags  # the x8 tiles' level (QUANT_VNNI512)
    assert quant.amx_active() == (built and build.os_grants_amx())


def _vector_tiles(x, qw, **kw):
    old = quant.set_amx_min_rows(1 << 30)
    try:
        return quant.quant_linear(x, qw, **kw)
    finally:
        quant.set_amx_min_rows(old)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_amx_path_gives_the_vector_tiles_bits(name, amx_from_one_row):
    """The same integers and the same fp32 steps in the same order: equal bits, so a request's
    output does not depend on how many rows its step carried. Every tail: 16-row blocks and
    rows past them, a last odd group, a last group of fewer than 8 rows."""
    for k in (96, 320):
        for n in (1, 13, 37, 77):
            layouts, w = weights(TYPES[name], n, k, seed=n * k)
            for m in (1, 16, 17, 40, 70):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 2
                y = quant.quant_linear(x, layouts[1])
                assert torch.equal(y, _vector_tiles(x, layouts[1])), (n, k, m)
                check(y, x, w)


def test_amx_path_threads_bias_bf16_and_strided_rows(amx_from_one_row):
    layouts, w = weights(3, 77, 320, seed=1)
    x = torch.randn(50, 400)[:, 50:370]
    bias = torch.randn(77)
    results = on_1_and_2_threads(x, layouts[1], bias)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], _vector_tiles(x, layouts[1], bias=bias))
    y16 = quant.quant_linear(x, layouts[1], bias, out_dtype=torch.bfloat16)
    assert torch.equal(y16, results[0].to(torch.bfloat16))
    xb = x.to(torch.bfloat16)
    assert torch.equal(
        quant.quant_linear(xb, layouts[1], out_dtype=torch.float32),
        _vector_tiles(xb, layouts[1], out_dtype=torch.float32),
    )
