"""The CUDA int8 W8A8 wgmma kernel (`pagoda.kernels.w8a8_wgmma`) against the exact integer
product scaled (`plain_quantized_mm`'s semantics) and against the Triton GEMM: every tile
shape, ragged rows, weight rows and K steps, bias, bf16 and fp16 outputs, a CUDA-graph replay.
Marked `gpu` (sm_90); on a CPU the configs' and inputs' checks."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_graph_replays_exactly

from pagoda.kernels import w8a8_wgmma
from pagoda.kernels.w8a8_wgmma import WgmmaW8A8Config as W

sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU",
)

TILES = [W(128, 128, 4), W(128, 256, 4), W(64, 128, 6), W(64, 256, 4), W(64, 64, 8),
         W(128, 64, 6), W(64, 128, 3, 2), W(128, 128, 3, 2), W(128, 64, 4, 2),
         W(128, 128, 2)]  # fmt: skip
# Clusters sharing tiles by multicast copies; the grids round up to whole clusters, so the
# problems below also give clusters with CTAs wholly past M or N.
CLUSTERS = [W(128, 128, 4, cm=2), W(128, 256, 4, cm=2), W(64, 64, 6, 2, cm=2, cn=2),
            W(64, 128, 4, 2, cn=2), W(128, 64, 4, cm=4), W(64, 64, 6, cm=2, cn=4)]  # fmt: skip
# K split among a cluster: with K = 128 (one step) rank 1.. take none, with K = 288 (three)
# a split of four leaves rank 3 none.
SPLITS = [W(128, 128, 6, ck=2), W(128, 128, 4, ck=4), W(64, 64, 6, 2, ck=2),
          W(128, 256, 4, ck=2), W(64, 128, 4, 2, ck=4)]  # fmt: skip


def _problem(m: int, n: int, k: int, seed: int = 0, bias_dtype=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, device="cuda", dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)
    xs = torch.rand(m, 1, generator=g, device="cuda") / 1e3
    ws = torch.rand(n, generator=g, device="cuda") / 1e3
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(n, generator=g, device="cuda").to(bias_dtype)
    return a, xs, b, ws, bias


def _exact(a, xs, b, ws, bias, dtype):
    # |sums| <= 127^2 * 14336 < 2^28: exact in the kernel's int32 and in float64 here; then
    # (acc * xs) * ws (+ bias), each rounded to float32 as the kernel does.
    acc = (a.double() @ b.double().t()).to(torch.int32).float()
    y = acc * xs * ws
    return (y if bias is None else y + bias.float()).to(dtype)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("cfg", TILES + CLUSTERS + SPLITS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "m,n,k,dtype",
    [
        (1, 72, 128, torch.bfloat16),
        (100, 200, 288, torch.bfloat16),
        (256, 4096, 4096, None),
        (129, 6144, 4096, torch.float16),
        (300, 1000, 14336, torch.bfloat16),
    ],  # fmt: skip
)
def test_every_tile_gives_the_integer_product_scaled(cfg, m, n, k, dtype) -> None:
    out_dtype = dtype or torch.bfloat16
    a, xs, b, ws, bias = _problem(m, n, k, seed=m, bias_dtype=dtype)
    y = w8a8_wgmma.w8a8_wgmma(a, xs, b, ws, bias, out_dtype, cfg)
    assert y is not None and y.dtype == out_dtype
    torch.testing.assert_close(y, _exact(a, xs, b, ws, bias, out_dtype), rtol=0, atol=0)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize(
    "cfg",
    [
        W(128, 128, 4),
        W(128, 256, 4),
        W(64, 64, 6, 2),
        W(128, 128, 4, cm=2, cn=2),
        W(128, 128, 6, ck=2),
        W(64, 64, 6, 2, ck=4),
    ],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize("m,n,k", [(1, 72, 128), (300, 1000, 14336), (256, 4096, 4096)])
def test_fp8_tiles_match_the_fp8_product_scaled(cfg, m, n, k) -> None:
    # e4m3 operands, float32 accumulators added in the tensor cores' own precision (fast
    # accumulation, as cuBLASLt's and the Triton GEMM's by default).
    from pagoda.kernels.scaled_mm import plain_quantized_mm

    g = torch.Generator(device="cuda").manual_seed(m)
    a, b = (torch.randn(r, k, generator=g, device="cuda") * 64 for r in (m, n))
    a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    xs = torch.rand(m, 1, generator=g, device="cuda") / 1e3
    ws = torch.rand(n, generator=g, device="cuda") / 1e3
    y = w8a8_wgmma.w8a8_wgmma(a, xs, b, ws, None, torch.bfloat16, cfg)
    ref = plain_quantized_mm(a, xs, b, ws, None, torch.float32)
    assert y is not None
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m", [65, 256, 512])
def test_the_rule_agrees_with_the_triton_gemm_and_replays_in_a_graph(m) -> None:
    from pagoda.kernels.scaled_mm_triton import W8A8Config, scaled_mm_cuda

    n, k = 4096, 14336
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    w_q = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)
    w_scale = torch.rand(n, generator=g, device="cuda") / 1e3
    y_triton = scaled_mm_cuda(x, w_q, w_scale, None, config=W8A8Config(64, 128, 128))
    y = scaled_mm_cuda(x, w_q, w_scale, None, config=W(128, 128, 4))
    assert torch.equal(y, y_triton)  # no bias: two rounded products, the same bits
    _, out = assert_graph_replays_exactly(lambda: scaled_mm_cuda(x, w_q, w_scale, None, config=W()))
    assert torch.equal(out, y)
    split = W(128, 128, 6, ck=2)
    _, out = assert_graph_replays_exactly(
        lambda: scaled_mm_cuda(x, w_q, w_scale, None, config=split)
    )
    assert torch.equal(out, y)  # int32 partial sums: exact in any split


def test_configs_and_inputs_that_cannot_run_name_the_reason() -> None:
    assert w8a8_wgmma.config_reason(W()) is None
    assert "bm 96" in w8a8_wgmma.config_reason(W(96, 128, 4))
    assert "bn 32" in w8a8_wgmma.config_reason(W(128, 32, 4))
    assert "shared memory" in w8a8_wgmma.config_reason(W(128, 256, 5))
    assert "registers" in w8a8_wgmma.config_reason(W(128, 256, 2, 2))
    assert "shared memory" in w8a8_wgmma.config_reason(W(128, 128, 4, 2))
    assert "cluster 3 x 1" in w8a8_wgmma.config_reason(W(128, 128, 4, cm=3))
    assert "cluster 4 x 4" in w8a8_wgmma.config_reason(W(128, 128, 4, cm=4, cn=4))
    assert w8a8_wgmma.config_reason(W(64, 64, 6, cm=2, cn=4)) is None  # 16-row x slices
    assert W(64, 64, 6, 2, cm=2, cn=4).name == "wgmma64x64_s6_c2_m2_n4"
    assert "K split 3" in w8a8_wgmma.config_reason(W(128, 128, 4, ck=3))
    assert "multicast" in w8a8_wgmma.config_reason(W(128, 128, 4, cm=2, ck=2))
    assert "partial sums" in w8a8_wgmma.config_reason(W(128, 256, 2, ck=2))
    assert w8a8_wgmma.config_reason(W(128, 256, 3, ck=4)) is None
    assert W(128, 128, 6, ck=2).name == "wgmma128x128_s6_k2"
    x = torch.zeros(4, 64, dtype=torch.int8)
    assert w8a8_wgmma.unsupported_reason(x, x, torch.bfloat16, None) == "not a CUDA tensor"
    assert w8a8_wgmma.smem_bytes(W(128, 128, 4)) == 4 * 256 * 128 + 1024


def test_the_wgmma_instruction_is_written_for_the_tile() -> None:
    text = w8a8_wgmma._wgmma_function(128)
    assert "m64n128k32.s32.s8.s8" in text
    assert "int (&d)[64]" in text and '"+r"(d[63])' in text and "%64, %65" in text


def test_the_rule_takes_the_tiles_that_won_per_layer() -> None:
    # Runs 67 and 69 (H100, results/h200/run67-w8a8-wgmma/2-smem-epilogue/time.log,
    # run69-w8a8-split/split_check.log): the best tile per Llama-3-8B layer and row count, or
    # one within 4% of it.
    from pagoda.kernels.w8a8_wgmma import _tiles as choose_config  # before any K split

    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    won = {
        (qkv, 128): W(64, 64, 6, 2), (qkv, 256): W(128, 128, 4), (qkv, 384): W(128, 256, 4),
        (qkv, 512): W(128, 256, 4), (qkv, 1024): W(128, 128, 4),
        (o, 128): W(64, 64, 6, 2), (o, 192): W(64, 64, 6, 2), (o, 256): W(64, 64, 6, 2),
        (o, 512): W(128, 128, 4), (down, 256): W(128, 128, 6),
        (o, 1024): W(128, 256, 4),
        (gate_up, 128): W(128, 128, 6), (gate_up, 256): W(128, 256, 4),
        (gate_up, 1024): W(128, 256, 4),
        (down, 128): W(64, 64, 6, 2), (down, 512): W(128, 128, 6), (down, 1024): W(128, 256, 4),
        # Run 72: clusters at 129-192 rows.
        (qkv, 192): W(128, 128, 4, cm=2, cn=2), (gate_up, 192): W(128, 256, 4, cm=2),
        (down, 192): W(128, 128, 6), (o, 160): W(64, 64, 6, 2),
    }  # fmt: skip
    for ((n, k), m), cfg in won.items():
        assert choose_config(m, n, k) == cfg, (n, k, m)
        assert w8a8_wgmma.config_reason(cfg) is None


def test_the_rule_splits_k_where_the_tiles_fill_at_most_half_the_sms(monkeypatch) -> None:
    from pagoda.kernels.w8a8_wgmma import choose_config

    down, qkv, gate_up = (4096, 14336), (6144, 4096), (28672, 4096)
    assert choose_config(256, *down) == W(128, 128, 6, ck=2)  # 64 tiles for 132 SMs
    assert choose_config(192, *down) == W(128, 128, 6, ck=2)
    assert choose_config(128, *down) == W(64, 64, 6, 2)  # two CTAs an SM: slower split
    assert choose_config(256, *qkv) == W(128, 128, 4)  # 96 tiles: two of each overflow
    assert choose_config(256, *gate_up) == W(128, 256, 4)
    assert choose_config(192, *qkv) == W(128, 128, 4, cm=2, cn=2)  # no split in a multicast
    assert choose_config(256, 1024, 2048) == W(128, 128, 6, ck=2)  # 16 K steps
    assert choose_config(256, 512, 1024) == W(128, 128, 6)  # 8 K steps: too few to split
    monkeypatch.setenv("PAGODA_W8A8_SPLIT_K", "0")
    assert choose_config(256, *down) == W(128, 128, 6)


def test_the_w8a8_rule_takes_the_cuda_kernel_from_65_rows_fp8_to_128() -> None:
    from pagoda.kernels.scaled_mm import FP8_DTYPE
    from pagoda.kernels.scaled_mm_triton import (
        SCALED_MM,
        W8A8Config,
        choose_w8a8_config,
        w8a8_config_candidates,
    )

    assert isinstance(choose_w8a8_config(64, 4096, 4096, wgmma=True), W8A8Config)
    assert isinstance(choose_w8a8_config(65, 4096, 4096, wgmma=True), W)
    assert isinstance(choose_w8a8_config(256, 4096, 4096), W8A8Config)
    assert choose_w8a8_config(256, 6144, 4096, FP8_DTYPE, wgmma=True) == SCALED_MM
    # Past 128 rows fp8 keeps the kernel where its tiles are few: o's two CTAs an SM, down's
    # K split.
    assert choose_w8a8_config(256, 4096, 4096, FP8_DTYPE, wgmma=True) == W(64, 64, 6, 2)
    assert choose_w8a8_config(256, 4096, 14336, FP8_DTYPE, wgmma=True) == W(128, 128, 6, ck=2)
    assert choose_w8a8_config(192, 4096, 14336, FP8_DTYPE, wgmma=True) == SCALED_MM  # part empty
    assert choose_w8a8_config(192, 4096, 14336, wgmma=True) == W(128, 128, 6, ck=2)  # int8
    assert choose_w8a8_config(512, 4096, 14336, FP8_DTYPE, wgmma=True) == SCALED_MM
    assert isinstance(choose_w8a8_config(128, 4096, 4096, FP8_DTYPE, wgmma=True), W)
    assert choose_w8a8_config(128, 4096, 4096, FP8_DTYPE) == SCALED_MM
    cands = w8a8_config_candidates(256, 4096, 4096, wgmma=True)
    assert isinstance(cands[0], W) and choose_w8a8_config(256, 4096, 4096) in cands
    assert not any(isinstance(c, W) for c in w8a8_config_candidates(256, 4096, 4096))
