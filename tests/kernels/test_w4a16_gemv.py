"""The CUDA W4A16 decode kernel (`pagoda.kernels.w4a16_gemv`) against the checkpoints'
dequantization + F.linear and against the Triton few-row kernel: AWQ, GPTQ and act-order GPTQ
weights, bf16 and fp16, 1-64 rows (each B-tile count and its ragged edges), N not a multiple
of the CTA's rows, groups of 128 and 256 and one group per row, bias, every launch shape, and a
CUDA-graph replay. Marked `gpu`; on a CPU only the dispatch rules are checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_graph_replays_exactly, enable_interpreter_without_cuda

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels import w4a16_gemv  # noqa: E402
from pagoda.kernels.w4a16 import (  # noqa: E402
    DEQUANT,
    choose_config,
    fallback_config,
    gemv_config,
    skinny_config,
    w4a16_linear,
    w4a16_silu_and_mul,
)
from pagoda.kernels.w4a16_gemv import GemvConfig  # noqa: E402
from pagoda.kernels.w4a16_skinny import SkinnyConfig  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Launch shapes and code paths: row tiles, warps, depth, L2 prefetch, sums by mma, early x;
# weights through the shared-memory ring (bulk), its stages and chunk, registers held to 20-36
# resident warps an SM, the scale rows prefetched into L2, x at each word's turn (x_early=0);
# programmatic dependent launch (pdl), the first scales loaded before its wait (sc_early).
LAUNCHES = [
    GemvConfig(),
    GemvConfig(2, 4, 2, 0, 0, 0),
    GemvConfig(1, 4, 8, 1, 0, 1),
    GemvConfig(2, 4, 1, 1, 1, 0),
    GemvConfig(1, 8, bulk=1, stages=4, chunk=8),
    GemvConfig(2, 4, sum_mma=1, bulk=1, stages=2, chunk=8),
    GemvConfig(1, 4, bulk=1, stages=3, chunk=4),
    GemvConfig(2, 4, sum_mma=1, bulk=1, stages=2, chunk=8, min_warps=20),
    GemvConfig(2, 8, bulk=1, stages=2, chunk=16, sc_prefetch=1),
    GemvConfig(2, 8, x_early=0, bulk=1, stages=2, chunk=16, min_warps=27),
    GemvConfig(1, 8, x_early=0, bulk=1, stages=3, chunk=16, min_warps=36, sc_prefetch=1),
    GemvConfig(pdl=1),
    GemvConfig(2, 4, 2, 1, 1, 1, pdl=1),
    GemvConfig(1, 8, bulk=1, stages=4, chunk=8, pdl=1),
    GemvConfig(2, 4, sum_mma=1, bulk=1, stages=2, chunk=8, pdl=1, sc_prefetch=1, sc_early=1),
    GemvConfig(1, 8, bulk=1, stages=2, chunk=16, pdl=1, sc_early=1),
]
BULK = LAUNCHES[4]
# The scales and zero points through the ring (sc_ring): sums by mma or not, one or two row
# tiles, 4 or 8 warps, chunks of 1-2 steps a warp, more chunks than stages.
SC_RING = [
    GemvConfig(2, 4, sum_mma=1, bulk=1, stages=2, chunk=8, pdl=1, sc_ring=1),
    GemvConfig(2, 8, bulk=1, stages=2, chunk=16, pdl=1, sc_ring=1),
    GemvConfig(1, 8, bulk=1, stages=3, chunk=8, sc_ring=1),
    GemvConfig(2, 4, bulk=1, stages=3, chunk=4, pdl=1, sc_ring=1),
]
# K split among a cluster of 2-4 CTAs (splits): one and two row tiles, 4 or 8 warps, x a step
# ahead or at its turn, with the scale rows prefetched.
SPLITS = [
    GemvConfig(2, 8, bulk=1, stages=2, chunk=16, pdl=1, splits=2),
    GemvConfig(1, 4, x_early=0, bulk=1, stages=2, chunk=4, splits=4, sc_prefetch=1),
    GemvConfig(2, 4, sum_mma=1, bulk=1, stages=3, chunk=8, pdl=1, splits=3, min_warps=20),
]
# No producer warp (the consumer that releases a stage last refills it): with and without
# sc_ring, chunks of 1-2 steps a warp, 2-3 stages, 4 or 8 warps.
NO_PRODUCER = [
    GemvConfig(2, 4, sum_mma=1, bulk=1, stages=2, chunk=8, pdl=1, sc_ring=1, producer=0),
    GemvConfig(2, 8, bulk=1, stages=2, chunk=16, pdl=1, sc_ring=1, producer=0),
    GemvConfig(1, 8, bulk=1, stages=3, chunk=8, producer=0),
    GemvConfig(2, 4, bulk=1, stages=3, chunk=4, pdl=1, producer=0),
]


def _weights(fmt: str, n: int, k: int, group: int, seed: int = 0):
    from test_w4a16 import packed_weights

    return packed_weights(fmt, n=n, k=k, group=group, seed=seed, device="cuda")


def _linear(x, w4, bias=None, config=None):
    if getattr(config, "bulk", 0) and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk ring needs sm_90")
    return w4a16_linear(
        x, w4.qweight, w4.scales, w4.zeros, w4.group_size, bias, w4.perm, config=config
    )


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1% of the output's range (bf16 rounding of x and y, fp32 sums in another
    order); a wrong nibble, row or group is off by ~100%."""
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), (err, ref.abs().max().item())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_act_order"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [GemvConfig(), BULK], ids=["registers", "bulk"])
def test_gemv_matches_dequantized_linear(
    fmt: str, m: int, dtype: torch.dtype, cfg: GemvConfig
) -> None:
    n, k = 200, 640  # 200 rows: the last CTA's rows past N; K = 5 steps over 8 warps
    w4, dense = _weights(fmt, n, k, 128, seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if m % 2 else None
    ref = F.linear(x.float(), dense, None if bias is None else bias.float())
    _assert_close(_linear(x, w4, bias, cfg), ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", LAUNCHES[1:], ids=str)
@pytest.mark.parametrize("m", [3, 17, 64])
def test_every_launch_shape_matches(cfg: GemvConfig, m: int) -> None:
    n, k = 200, 1920  # 15 K steps: batches of DEPTH steps and the last chunk cut short
    w4, dense = _weights("awq", n, k, 128, seed=m)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    if w4a16_gemv.shape_reason(m, n, cfg):  # 64 rows of 2 row tiles x 8 warps: 64 KiB of tiles
        with pytest.raises(ValueError, match="static shared memory"):
            _linear(x, w4, config=cfg)
        return
    _assert_close(_linear(x, w4, config=cfg), F.linear(x.float(), dense))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
@pytest.mark.parametrize("m", [1, 9, 16])
@pytest.mark.parametrize("half", [100, 208])  # the last CTA's 16 rows overlap the one before
def test_silu_and_mul_in_the_gemv_matches(fmt: str, m: int, half: int) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk ring needs sm_90")
    n, k = 2 * half, 1920
    w4, dense = _weights(fmt, n, k, 128, seed=m + half)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if m % 2 else None
    ref = F.linear(x.float(), dense, None if bias is None else bias.float())
    ref = F.silu(ref[:, :half]) * ref[:, half:]
    args = (x, w4.qweight, w4.scales, w4.zeros, w4.group_size, bias, w4.perm)
    out = w4a16_silu_and_mul(*args)  # the rule's config
    assert out is not None and out.shape == (m, half)
    _assert_close(out, ref)
    for cfg in (  # 4 warps with sums by mma, 3 stages, K split among a cluster
        GemvConfig(2, 4, sum_mma=1, bulk=1, stages=2, chunk=8, pdl=1),
        GemvConfig(2, 8, bulk=1, stages=3, chunk=16, splits=2),
        GemvConfig(2, 4, bulk=1, stages=2, chunk=8, sc_prefetch=1),  # gate and up rows
    ):
        _assert_close(w4a16_silu_and_mul(*args, config=cfg), ref)
    with pytest.raises(ValueError, match="2 row tiles"):
        w4a16_silu_and_mul(*args, config=GemvConfig(1, 8, bulk=1, stages=2, chunk=16))


@gpu
@pytest.mark.gpu
def test_silu_and_mul_of_a_packed_layer_or_none_where_the_kernel_does_not_take_it(
    monkeypatch,
) -> None:
    from torch import nn

    from pagoda.model.quantization import W4A16LinearMethod

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk ring needs sm_90")
    n, k = 192, 1024
    w4, dense = _weights("awq", n, k, 128, seed=3)
    layer = nn.Module()
    layer.w4_qweight, layer.w4_scales, layer.w4_zeros = w4.qweight, w4.scales, w4.zeros
    layer.w4_group_size, layer.w4_perm, layer.input_size_per_partition = 128, None, k
    method = W4A16LinearMethod()
    x = torch.randn(2, 3, k, device="cuda").to(torch.bfloat16)  # [batch, tokens, hidden]
    ref = F.linear(x.float(), dense)
    _assert_close(method.apply_silu_and_mul(layer, x), F.silu(ref[..., :96]) * ref[..., 96:])
    monkeypatch.setenv("PAGODA_W4A16_SILU", "0")
    assert method.apply_silu_and_mul(layer, x) is None  # the separate kernel asked for
    monkeypatch.setenv("PAGODA_W4A16_SILU", "1")
    assert method.apply_silu_and_mul(layer, x.float()) is None  # fp32 x: not this kernel
    assert method.apply_silu_and_mul(layer, torch.randn(2, 9, k).to(x)) is None  # 18 rows
    layer.fused_ops = False  # the reference path: the activation after the product
    assert method.apply_silu_and_mul(layer, x) is None


@gpu
@pytest.mark.gpu
def test_fewer_weight_rows_than_a_ctas_take_another_kernel() -> None:
    n, k = 24, 1920  # fewer than the 32 rows of a CTA of two row tiles
    w4, dense = _weights("awq", n, k, 128, seed=5)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    _assert_close(_linear(x, w4), F.linear(x.float(), dense))  # the rule's config falls back
    cfg = GemvConfig(2, 4, bulk=1, stages=2, chunk=8)
    with pytest.raises(ValueError, match="rows of a CTA"):
        _linear(x, w4, config=cfg)
    _assert_close(_linear(x, w4, config=cfg._replace(row_tiles=1)), F.linear(x.float(), dense))


def _ring_cases(test):
    """The ring variants' cases: N = 208 (whole 16-row units, the last 32-row tile half past N,
    so its scale copies are shorter than the tile); K of 5 and 15 steps (warps with no step of
    a chunk, the last chunk cut short; split 3-4 ways, a split of one step or none); groups of
    one and two steps and one group per row (every step's scale copy the same row)."""
    test = pytest.mark.parametrize(
        ("k", "group"), [(640, 128), (1920, 128), (1920, 256), (1920, 1920)]
    )(test)
    test = pytest.mark.parametrize("m", [1, 9])(test)
    return pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])(test)


def _check_ring_case(cfg: GemvConfig, fmt: str, m: int, k: int, group: int) -> None:
    n = 208
    w4, dense = _weights(fmt, n, k, group, seed=m + k)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    _assert_close(_linear(x, w4, bias, cfg), F.linear(x.float(), dense, bias.float()))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SC_RING, ids=str)
@_ring_cases
def test_scales_through_the_ring_match(
    cfg: GemvConfig, fmt: str, m: int, k: int, group: int
) -> None:
    _check_ring_case(cfg, fmt, m, k, group)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", NO_PRODUCER, ids=str)
@_ring_cases
def test_ring_without_producer_warp_matches(
    cfg: GemvConfig, fmt: str, m: int, k: int, group: int
) -> None:
    # Chunks refilled by whichever consumer releases them last.
    _check_ring_case(cfg, fmt, m, k, group)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SPLITS, ids=str)
@_ring_cases
def test_k_split_among_a_cluster_matches(
    cfg: GemvConfig, fmt: str, m: int, k: int, group: int
) -> None:
    # The bias added once, by the CTA that sums the splits.
    _check_ring_case(cfg, fmt, m, k, group)


@gpu
@pytest.mark.gpu
def test_ring_without_producer_fits_four_ctas_an_sm() -> None:
    """Without the producer warp a 4-warp CTA keeps to 128 registers and asks for the shared
    memory of as many CTAs as those allow (`cuda_launch.fit_shared_carveout`): 4 an SM, where
    the producer's 5 warps allow 3."""
    import ctypes

    from pagoda.kernels import cuda_launch

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk ring needs sm_90")
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    scales = torch.ones(32, 4096, device="cuda", dtype=torch.bfloat16)

    def ctas(cfg: GemvConfig) -> int:
        kernel = w4a16_gemv.get_kernel(x, scales, cfg, False, False, 128)
        n = ctypes.c_int()
        err = cuda_launch.libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), kernel.func, w4a16_gemv.threads(cfg), w4a16_gemv.ring_bytes(cfg)
        )
        assert err == 0
        return n.value

    cfg = GemvConfig(2, 4, sum_mma=1, bulk=1, stages=2, chunk=8, pdl=1, producer=0)
    assert ctas(cfg) >= 4
    assert ctas(cfg) > ctas(cfg._replace(producer=1))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group", [256, 4096])
def test_gemv_larger_groups_and_one_group_per_row(group: int) -> None:
    n, k = 96, 1024
    w4, dense = _weights("gptq", n, k, group)
    x = torch.randn(5, k, device="cuda").to(torch.bfloat16)
    _assert_close(_linear(x, w4, config=GemvConfig()), F.linear(x.float(), dense))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("m", [1, 16, 32])
def test_gemv_at_llama8b_shapes_matches_the_triton_kernel(name: str, m: int) -> None:
    from test_w4a16 import LLAMA3_8B

    n, k = LLAMA3_8B[name]
    w4, dense = _weights("awq", n, k, 128)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = F.linear(x.float(), dense)
    _assert_close(_linear(x, w4), ref)  # the default
    _assert_close(_linear(x, w4, config=GemvConfig(2, 8, 2, 0, 0, 1)), ref)  # M > 8 too
    _assert_close(_linear(x, w4, config=BULK._replace(row_tiles=2)), ref)
    _assert_close(_linear(x, w4, config=skinny_config(m, n, k, 128)), ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [None, BULK, SC_RING[1], NO_PRODUCER[0], SPLITS[1]],
    ids=["default", "bulk", "sc_ring", "no_producer", "splits"],
)
def test_gemv_in_a_cuda_graph_replays_exactly(cfg: GemvConfig | None) -> None:
    w4, _ = _weights("gptq_act_order", 512, 1024, 128)
    x = torch.randn(4, 1024, device="cuda").to(torch.bfloat16)
    assert_graph_replays_exactly(lambda: _linear(x, w4, config=cfg))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [GemvConfig(pdl=1), *LAUNCHES[-4:], SC_RING[0], NO_PRODUCER[3], SPLITS[0]],
    ids=str,
)
def test_pdl_chain_in_a_cuda_graph_waits_for_each_kernel_before(
    cfg: GemvConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six layers, each an RMSNorm (which lets the next kernel launch at its start) then the
    GEMV (a programmatic dependent) of the one before's output, back to back in a graph: every
    output equals the plain launches' (PAGODA_PDL=0) bit for bit, after the outputs are
    poisoned with NaN and x changed between replays (a kernel that read its x before the one
    before had written it would see NaN or the last replay's values)."""
    from pagoda.kernels.norm_act import rms_norm_triton

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    layers = [_weights("awq", 1024, 1024, 128, seed=i)[0] for i in range(6)]
    norm_w = torch.rand(1024, device="cuda").to(torch.bfloat16) + 0.5

    def chain(x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for w4 in layers:
            x = _linear(rms_norm_triton(x, norm_w, 1e-6)[0], w4, config=cfg)
            outs.append(x)
        return outs

    x = torch.randn(3, 1024, device="cuda").to(torch.bfloat16)
    chain(x)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(x)
    for seed in range(3):
        gen = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(3, 1024, device="cuda", generator=gen))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("PAGODA_PDL", "0")
        for got, want in zip(outs, chain(x)):
            assert torch.equal(got, want)
        monkeypatch.delenv("PAGODA_PDL")


def test_default_config_takes_the_cuda_kernel_where_its_shapes_allow() -> None:
    n, k = 4096, 14336
    for m in (1, 4, 8, 16):
        assert isinstance(choose_config(m, n, k, 128), GemvConfig)
        assert isinstance(choose_config(m, n, k, k), GemvConfig)  # one group per row
        assert choose_config(m, n, k, 128).bulk and choose_config(m, n, k, 128).pdl
    assert choose_config(1, n, k, 128).row_tiles == 1 and choose_config(8, n, k, 128).row_tiles == 2
    assert choose_config(1, 28672, 4096, 128).warps == 4

    # Past 8 rows 9-warp CTAs fit one an SM: more 32-row tiles than SMs take 4 warps instead.
    def warps_and_stages(m: int, n: int, num_sms: int = 132) -> tuple[int, int]:
        cfg = choose_config(m, n, 4096, 128, num_sms)
        return cfg.warps, cfg.stages

    assert warps_and_stages(16, 6144) == (4, 3)  # qkv: 192 tiles
    assert warps_and_stages(16, 4096) == (8, 2)  # o: 128 tiles
    assert warps_and_stages(8, 6144) == (8, 2)
    assert warps_and_stages(16, 6144, num_sms=200) == (8, 2)
    assert (
        choose_config(1, 28672, 4096, 128).sum_mma
        and not choose_config(16, 28672, 4096, 128).sum_mma
    )
    assert isinstance(choose_config(1, n, k, 64), SkinnyConfig)  # groups within a K step
    assert isinstance(choose_config(1, n, 4000, 128), SkinnyConfig)  # K not a multiple of 128
    assert not isinstance(choose_config(1, n, k, 128, elem_bytes=4), GemvConfig)
    assert isinstance(choose_config(17, n, k, 128), SkinnyConfig)  # the Triton kernel won there
    assert choose_config(1025, n, k, 128) == DEQUANT
    assert fallback_config(1, n, k, 128) == skinny_config(1, n, k, 128)
    # Before sm_90 (no bulk copies): the register kernel up to 8 rows.
    for m in (1, 8):
        cfg = gemv_config(m, n, k, 128, bulk=False)
        assert isinstance(cfg, GemvConfig) and not cfg.bulk and cfg.pdl
    assert gemv_config(1, n, k, 128, bulk=False).sum_mma
    assert gemv_config(9, n, k, 128, bulk=False) is None


def test_unsupported_inputs_name_the_reason_and_fall_back() -> None:
    x = torch.randn(2, 256)
    qweight = torch.zeros(32, 32, dtype=torch.int32)
    scales = torch.ones(2, 32, dtype=torch.float16)
    reason = w4a16_gemv.unsupported_reason(x, qweight, scales, None, 128)
    assert reason is not None
    if not torch.cuda.is_available():
        assert "CUDA" in reason
    assert "bulk ring" in w4a16_gemv.config_reason(GemvConfig(sc_ring=1), torch.device("cpu"))
    assert "bulk ring" in w4a16_gemv.config_reason(GemvConfig(producer=0), torch.device("cpu"))
    reason = w4a16_gemv.config_reason(GemvConfig(sc_prefetch=1), torch.device("cpu"))
    assert "sc_prefetch needs the bulk ring" in reason
    reason = w4a16_gemv.config_reason(GemvConfig(sc_early=1), torch.device("cpu"))
    assert "sc_early needs the bulk ring" in reason
    assert "2-8 with the bulk ring" in w4a16_gemv.config_reason(
        GemvConfig(splits=2), torch.device("cpu")
    )
    # Shapes a config cannot take: 64 rows of 2 row tiles x 8 warps (64 KiB of partial tiles),
    # and with the ring fewer weight rows than a CTA's.
    wide = GemvConfig(2, 8, bulk=1, stages=2, chunk=16)
    assert "static shared memory" in w4a16_gemv.shape_reason(64, 4096, wide)
    assert w4a16_gemv.shape_reason(32, 4096, wide) is None
    assert "N=24 < the 32 rows" in w4a16_gemv.shape_reason(1, 24, wide)
    assert w4a16_gemv.shape_reason(1, 24, wide._replace(row_tiles=1)) is None
    assert w4a16_gemv.shape_reason(1, 24, GemvConfig(2, 4)) is None  # registers: rows clamped
    # silu(gate) * up in the kernel: a CTA's two row tiles are gate and up rows of the ring.
    assert w4a16_gemv.shape_reason(1, 4096, wide, silu_mul=True) is None
    assert "2 row tiles" in w4a16_gemv.shape_reason(1, 4096, wide._replace(row_tiles=1), True)
    assert "2 row tiles" in w4a16_gemv.shape_reason(1, 4096, wide._replace(sc_ring=1), True)
    assert w4a16_gemv.shape_reason(1, 4096, wide._replace(sc_prefetch=1), True) is None
    assert "halves of >= 16 rows" in w4a16_gemv.shape_reason(1, 33, wide, silu_mul=True)
    x_cpu = torch.randn(1, 256).to(torch.bfloat16)  # not on a GPU: no kernel, the caller's path
    qw = torch.zeros(64, 32, dtype=torch.int32)
    sc, zp = torch.ones(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.uint8)
    assert w4a16_silu_and_mul(x_cpu, qw, sc, zp, 128) is None
    with pytest.raises(ValueError, match="expected \\(2, 64\\)"):
        w4a16_silu_and_mul(x_cpu, qw, sc[:, :32], zp, 128)
    # A group's K steps are compiled in: none for one group a row.
    assert [w4a16_gemv.group_steps(g, 4096) for g in (128, 512, 4096, 8192)] == [1, 4, 0, 0]
    # Without a producer warp a CTA is its consumers only.
    assert w4a16_gemv.threads(NO_PRODUCER[0]) == 128
    assert w4a16_gemv.threads(NO_PRODUCER[0]._replace(producer=1)) == 160
    # An explicit GemvConfig that cannot run is an error, the default falls back.
    zeros = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="CUDA kernel cannot run"):
        w4a16_linear(x, qweight, scales, zeros, 128, config=GemvConfig())


def test_scales_through_the_ring_need_whole_16_byte_rows(monkeypatch) -> None:
    cfg = SC_RING[0]
    scales = torch.ones(2, 208, dtype=torch.bfloat16)
    zeros = torch.zeros(2, 208, dtype=torch.uint8)
    assert w4a16_gemv.layout_reason(cfg, scales, zeros) is None
    assert w4a16_gemv.layout_reason(cfg._replace(sc_ring=0), scales[:, :200], zeros) is None
    assert "multiple of 16" in w4a16_gemv.layout_reason(cfg, scales[:, :200], zeros[:, :200])
    assert "zeros contiguous" in w4a16_gemv.layout_reason(cfg, scales, zeros.t().contiguous().t())
    assert "scales contiguous" in w4a16_gemv.layout_reason(cfg, scales[:, 16:], zeros)
    # A stage holds the chunk's weights and its scales (2 bytes) and zero points (1) a row
    # and step.
    rows, chunk = 32, cfg.chunk
    ring = w4a16_gemv.ring_bytes(cfg._replace(sc_ring=0))
    assert w4a16_gemv.ring_bytes(cfg) == ring + cfg.stages * rows * chunk * 3
    monkeypatch.setattr(w4a16_gemv, "bulk_capable", lambda device: True)
    assert "chunk 48 > 32" in w4a16_gemv.config_reason(
        GemvConfig(1, 8, bulk=1, chunk=48, sc_ring=1), torch.device("cpu")
    )
    # The rule takes it (where switched on) only where N is whole 16-row units.
    from pagoda.kernels import w4a16

    assert gemv_config(1, 4096, 4096, 128).sc_prefetch  # the scale rows asked into L2
    monkeypatch.setattr(w4a16, "GEMV_SC_RING", 1)
    assert gemv_config(1, 4096, 4096, 128).sc_ring
    assert not gemv_config(1, 4096, 4096, 128).sc_prefetch  # they come through the ring
    assert not gemv_config(1, 4104, 4096, 128).sc_ring


def test_gemv_rule_loads_the_first_scales_early_where_switched_on(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_W4A16_SC_EARLY", "0")
    assert not gemv_config(1, 28672, 4096, 128).sc_early
    monkeypatch.setenv("PAGODA_W4A16_SC_EARLY", "1")
    assert gemv_config(1, 28672, 4096, 128).sc_early and gemv_config(16, 4096, 4096, 128).sc_early
    assert not gemv_config(1, 4096, 4096, 128, bulk=False).sc_early  # the register kernel


def test_gemv_rule_holds_registers_for_more_warps_up_to_8_rows_where_switched_on(
    monkeypatch,
) -> None:
    from pagoda.kernels import w4a16

    assert gemv_config(8, 28672, 4096, 128).min_warps == w4a16.GEMV_MIN_WARPS == 0
    monkeypatch.setattr(w4a16, "GEMV_MIN_WARPS", 20)
    assert gemv_config(8, 28672, 4096, 128).min_warps == 20
    assert gemv_config(9, 28672, 4096, 128).min_warps == 0  # two B tiles: it would spill
