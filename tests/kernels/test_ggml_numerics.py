"""llama.cpp's CPU arithmetic (`pagoda.kernels.cpu.ggml_numerics`): each op against an
independent numpy statement of the same order of operations (exact), and against the plain
float math it approximates (close); then the embedded model against tokens and logits that
llama.cpp itself produced (`$PAGODA_CPU_NUMERICS=ggml`, tests/model/test_ggml_numerics_model.py).

The numpy references state ggml's order: an fp32 fused multiply-add is computed as float64
product plus float64 addend rounded once to float32, exact whenever the float64 sum is (the
products here have at most 35 significant bits), which holds for these inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagoda.kernels.cpu import ggml_numerics as gn
from pagoda.utils.cpu_build import supported_isas

try:
    gn.load_library()
except Exception as e:  # no compiler: every test here is skipped with the reason
    pytest.skip(f"ggml numerics library unavailable: {e}", allow_module_level=True)

f32 = np.float32


def fma(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def halving(v: list) -> np.float32:
    v = [f32(x) for x in v]
    n = len(v)
    while n > 1:
        n //= 2
        v = [f32(v[i + n] + v[i]) for i in range(n)]
    return v[0]


def random_rows(ggml_type: int, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF rows [n, row bytes] of random Q4_1 / Q8_0 blocks with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    nb, bb = k // 32, 20 if ggml_type == gn.GGML_Q4_1 else 34
    rows = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    d = (rng.uniform(0.002, 0.02, size=(n, nb))).astype(np.float16)
    rows[:, :, 0:2] = d.view(np.uint8).reshape(n, nb, 2)
    if ggml_type == gn.GGML_Q4_1:
        m = (rng.uniform(-0.1, 0.1, size=(n, nb))).astype(np.float16)
        rows[:, :, 2:4] = m.view(np.uint8).reshape(n, nb, 2)
    else:  # ggml's Q8_0 weights lie in [-127, 127]
        q = rows[:, :, 2:].view(np.int8)
        q[q == -128] = -127
    return rows.reshape(n, nb * bb)


def quantize_acts(x: np.ndarray) -> list[tuple[np.float16, np.float16, np.ndarray]]:
    """quantize_row_q8_1 of one row: per 32 values (d, s, q)."""
    out = []
    for b in range(len(x) // 32):
        v = x[b * 32 : (b + 1) * 32].astype(f32)
        amax = f32(np.abs(v).max())
        d = f32(amax / f32(127))
        inv = f32(f32(127) / amax) if amax != 0 else f32(0)
        q = np.rint((v * inv).astype(f32)).astype(np.int32)
        out.append((np.float16(d), np.float16(f32(d * f32(q.sum()))), q))
    return out


def vec_dot_reference(ggml_type: int, row: np.ndarray, x: np.ndarray) -> np.float32:
    """ggml_vec_dot_q4_1_q8_1 / _q8_0_q8_0 (AVX2 code) of one weight row and one x row."""
    acc, summs = [f32(0)] * 8, f32(0)
    bb = 20 if ggml_type == gn.GGML_Q4_1 else 34
    for b, (dx, sx, qx) in enumerate(quantize_acts(x)):
        blk = row[b * bb : (b + 1) * bb]
        dw = f32(blk[0:2].view(np.float16)[0])
        if ggml_type == gn.GGML_Q4_1:
            mw = f32(blk[2:4].view(np.float16)[0])
            summs = f32(summs + f32(mw * f32(sx)))
            qs = blk[4:]
            qw = np.concatenate([qs & 15, qs >> 4]).astype(np.int32)
        else:
            qw = blk[2:].view(np.int8).astype(np.int32)
        lanes = (qw * qx).reshape(8, 4).sum(axis=1)
        dd = f32(dw * f32(dx))
        acc = [fma(dd, f32(lanes[k]), acc[k]) for k in range(8)]
    return f32(halving(acc) + summs)


@pytest.mark.parametrize("isa", supported_isas())  # AVX2 vectors, or the loop over lanes
@pytest.mark.parametrize("ggml_type", [gn.GGML_Q4_1, gn.GGML_Q8_0])
def test_linear_is_ggml_vec_dot_lane_by_lane(ggml_type: int, isa: str) -> None:
    n, k, m = 24, 128, 3
    rows = random_rows(ggml_type, n, k, seed=ggml_type)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, k)).astype(f32)
    x[1, 40:72] = 0.0  # an all-zero block: d = 0, q = 0
    y = gn.linear(torch.from_numpy(x), torch.from_numpy(rows), ggml_type, n, False, isa=isa)
    y = y.numpy()
    ref = np.array(
        [[vec_dot_reference(ggml_type, rows[j], x[i]) for j in range(n)] for i in range(m)]
    )
    np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("ggml_type", [gn.GGML_Q4_1, gn.GGML_Q8_0])
def test_linear_reads_the_x8_layout_as_the_rows(ggml_type: int) -> None:
    from pagoda.kernels.cpu.quant import pack_x8

    n, k = 21, 96  # a ragged last group of 8 rows
    rows = torch.from_numpy(random_rows(ggml_type, n, k, seed=5))
    x = torch.randn(5, k)
    y_rows = gn.linear(x, rows, ggml_type, n, False)
    y_x8 = gn.linear(x, pack_x8(rows, ggml_type, k), ggml_type, n, True)
    assert torch.equal(y_rows, y_x8)


@pytest.mark.parametrize("ggml_type", [gn.GGML_Q4_1, gn.GGML_Q8_0])
def test_unpack_x8_gives_back_the_rows(ggml_type: int) -> None:
    from pagoda.kernels.cpu.quant import pack_x8, unpack_x8

    for n in (8, 21, 3):
        rows = torch.from_numpy(random_rows(ggml_type, n, 96, seed=n))
        assert torch.equal(unpack_x8(pack_x8(rows, ggml_type, 96), ggml_type, n, 96), rows)


def test_linear_is_close_to_the_float_product() -> None:
    from pagoda.model.loader.gguf_quants import dequantize

    n, k = 64, 256
    rows = random_rows(gn.GGML_Q4_1, n, k, seed=2)
    w = torch.from_numpy(dequantize(rows, gn.GGML_Q4_1, (n, k))).float()
    x = torch.randn(4, k)
    y = gn.linear(x, torch.from_numpy(rows), gn.GGML_Q4_1, n, False)
    ref = x.double() @ w.double().T
    # int8 activations: |error| <= sum_b (d_b / 2) sum |w| per output, d_b = max|x_b| / 127
    bound = (x.abs().view(4, -1, 32).amax(-1) / 254).repeat_interleave(32, 1).double()
    bound = bound @ w.abs().double().T + 1e-5
    assert ((y.double() - ref).abs() <= bound).all()


def test_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="Q4_1 and Q8_0"):
        gn.linear(torch.randn(1, 32), torch.zeros(1, 18, dtype=torch.uint8), 2, 1, False)


def test_rms_norm_sums_squares_in_double() -> None:
    x = torch.randn(3, 576) * 3
    w = torch.rand(576) + 0.5
    y = gn.rms_norm(x, w, 1e-5).numpy()
    xn, wn = x.numpy(), w.numpy()
    for i in range(3):
        ssum = sum(float(f32(v * v)) for v in xn[i])
        mean = f32(ssum / 576)
        scale = f32(f32(1) / f32(math.sqrt(f32(mean + f32(1e-5)))))
        np.testing.assert_array_equal(y[i], (xn[i] * scale).astype(f32) * wn)


def test_rope_matches_the_rotation_in_float() -> None:
    t, heads, d, base = 5, 3, 64, 100000.0
    x = torch.randn(t, heads * d)
    pos = torch.tensor([0, 1, 7, 300, 1000])
    y = x.clone()
    gn.rope_(y, pos, heads, d, base)
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    c, s = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
    xh = x.view(t, heads, d).double()
    rot = torch.cat([-xh[..., d // 2 :], xh[..., : d // 2]], dim=-1)
    ref = xh * c + rot * s
    # theta *= theta_scale in float32 drifts from the exact angle by ~position * 1e-7 rad
    assert torch.allclose(y.view(t, heads, d).double(), ref, atol=3e-4 * xh.abs().max())
    assert torch.equal(y[0], x[0])  # position 0: cos 1, sin 0


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
def test_swiglu_is_close_to_silu_times_up(variant: str) -> None:
    gu = torch.cat([torch.linspace(-90, 90, 1600), torch.randn(1600)]).view(2, 1600)
    y = gn.swiglu(gu, variant)
    g, u = gu[:, :800].double(), gu[:, 800:].double()
    ref = g * torch.sigmoid(g) * u
    # ggml's vector exp: within 1.5 ulp plus rounding; x / (1 + e) and * up add 1 ulp each
    assert torch.allclose(y.double(), ref, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
def test_attention_is_close_to_softmax_attention(variant: str) -> None:
    heads, kvh, d, bs = 6, 2, 64, 16
    lens, qlens = [37, 5], [37, 1]  # a prompt in one batch, and a decode step
    cache = torch.zeros(2, 8, bs, kvh, d, dtype=torch.float16)
    bt = torch.tensor([[3, 1, 6], [2, 0, 0]], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(n, kvh, d, generator=g).half() for n in lens]
    vals = [torch.randn(n, kvh, d, generator=g).half() for n in lens]
    for r, n in enumerate(lens):
        for j in range(n):
            cache[0, bt[r, j // bs], j % bs] = keys[r][j]
            cache[1, bt[r, j // bs], j % bs] = vals[r][j]
    q = torch.randn(sum(qlens), heads * d, generator=g)
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    out = gn.attention(
        q, cache, heads, d, 0.125, qsl, torch.tensor(lens, dtype=torch.int32), bt, variant
    )
    row = 0
    for r, (n, ql) in enumerate(zip(lens, qlens)):
        for i in range(ql):
            pos = n - ql + i
            for h in range(heads):
                qh = q[row, h * d : (h + 1) * d].half().double()
                k = keys[r][: pos + 1, h // (heads // kvh)].double()
                v = vals[r][: pos + 1, h // (heads // kvh)].double()
                w = torch.softmax(k @ qh * 0.125, dim=0)
                ref = w @ v
                got = out[row, h * d : (h + 1) * d].double()
                assert torch.allclose(got, ref, atol=2e-3), (r, i, h)
            row += 1


def test_default_variant_follows_the_cpu_flags() -> None:
    assert gn.default_variant("fpu sse2 avx2 fma avx512f avx512dq") == "avx512"
    assert gn.default_variant("fpu sse2 avx2 fma f16c") == "avx2"
    assert gn.default_variant("fpu sse2") is None
