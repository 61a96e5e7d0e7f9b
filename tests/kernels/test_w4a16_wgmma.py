"""The CUDA W4A16 wgmma kernel (`pagoda.kernels.w4a16_wgmma`) against the checkpoints'
dequantization + F.linear and against the Triton kernels: AWQ, GPTQ and act-order GPTQ
weights, bf16 and fp16 x, fp16 and bf16 scales, 17-300 rows (ragged row and weight tiles), K
split over CTAs, groups of 128 and 256 and one group per row, bias, every tile shape, and a
CUDA-graph replay. Marked `gpu` (sm_90); on a CPU the k order and the configs' checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_graph_replays_exactly, enable_interpreter_without_cuda

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels import w4a16_wgmma  # noqa: E402
from pagoda.kernels.w4a16 import skinny_config, w4a16_linear  # noqa: E402
from pagoda.kernels.w4a16_wgmma import WgmmaConfig  # noqa: E402

sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU",
)

TILES = [
    WgmmaConfig(),
    WgmmaConfig(bn=128),
    WgmmaConfig(bn=32, warpgroups=1),
    WgmmaConfig(bn=64, warpgroups=1, stages=3, depth=4),
    WgmmaConfig(bn=128, stages=5, depth=4),
    WgmmaConfig(bn=64, a_buffers=1, ctas_per_sm=2),
    WgmmaConfig(bn=128, a_buffers=1),
    WgmmaConfig(bn=256, stages=3, a_buffers=1),
    WgmmaConfig(bn=256, warpgroups=1, stages=3, depth=4, split_k=3, a_buffers=1),
    WgmmaConfig(bn=256, stages=3),
    WgmmaConfig(bn=256, warpgroups=1, stages=3, split_k=2),
    WgmmaConfig(bn=64, warpgroups=4, a_buffers=1),
    WgmmaConfig(bn=32, warpgroups=4, split_k=2),
    WgmmaConfig(bn=64, warpgroups=1, depth=4, split_k=2, a_buffers=1),
    WgmmaConfig(bn=128, warpgroups=4, stages=5, a_buffers=1),
    WgmmaConfig(bn=96, warpgroups=1, depth=4),
    WgmmaConfig(bn=160, split_k=2),
    WgmmaConfig(bn=192, a_buffers=1),
    WgmmaConfig(bn=224, warpgroups=1, split_k=3),
]


def _weights(fmt: str, n: int, k: int, group: int, seed: int = 0):
    from test_w4a16 import packed_weights

    return packed_weights(fmt, n=n, k=k, group=group, seed=seed, device="cuda")


def _linear(x, w4, bias=None, config=None):
    return w4a16_linear(
        x, w4.qweight, w4.scales, w4.zeros, w4.group_size, bias, w4.perm, config=config
    )


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1% of the output's range (the weights rounded to 16 bits once scaled, x and y
    rounded, fp32 sums in another order); a wrong nibble, row, group or k-slot is off by ~100%."""
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), (err, ref.abs().max().item())


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_act_order"])
@pytest.mark.parametrize("m", [17, 64, 100, 129, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgmma_matches_dequantized_linear(fmt: str, m: int, dtype: torch.dtype) -> None:
    n, k = 200, 640  # 200 rows: the last CTA's rows past N; K = 5 steps
    w4, dense = _weights(fmt, n, k, 128, seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if m % 2 else None
    ref = F.linear(x.float(), dense, None if bias is None else bias.float())
    _assert_close(_linear(x, w4, bias, WgmmaConfig()), ref)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILES, ids=str)
@pytest.mark.parametrize("m", [24, 64, 200])
def test_every_tile_shape_matches(cfg: WgmmaConfig, m: int) -> None:
    n, k = 320, 1920  # 15 K steps: DEPTH batches and stages cut short
    w4, dense = _weights("awq", n, k, 128, seed=m)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    _assert_close(_linear(x, w4, config=cfg), F.linear(x.float(), dense))


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize(
    "cfg",
    [
        WgmmaConfig(),
        WgmmaConfig(bn=256, stages=3, a_buffers=1),
        WgmmaConfig(warpgroups=4, a_buffers=1),
        WgmmaConfig(warpgroups=1),
    ],
    ids=str,
)
def test_split_k_sums_every_split(split_k: int, cfg: WgmmaConfig) -> None:
    n, k = 320, 4096  # the last CTA's rows past N
    w4, dense = _weights("gptq", n, k, 128)
    x = torch.randn(300 if cfg.bn == 256 else 48, k, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    cfg = cfg._replace(split_k=split_k, a_buffers=1)
    out = _linear(x, w4, bias, cfg)
    _assert_close(out, F.linear(x.float(), dense, bias.float()))
    assert torch.equal(_linear(x, w4, bias, cfg), out)  # the counters were reset: same bits


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize(
    "cfg",
    [WgmmaConfig(ctas_per_sm=2, a_buffers=1), WgmmaConfig(bn=192), WgmmaConfig(warpgroups=4)],
    ids=str,
)
def test_a_split_summed_in_a_cluster_gives_the_global_sums_bits(
    split_k: int, cfg: WgmmaConfig, monkeypatch
) -> None:
    # The same partial sums added in the same order, through distributed shared memory or
    # through global memory.
    n, k = 320, 4096
    w4, dense = _weights("awq", n, k, 128)
    x = torch.randn(150, k, device="cuda").to(torch.bfloat16)
    cfg = cfg._replace(split_k=split_k)
    monkeypatch.setenv("PAGODA_W4A16_CLUSTER_SPLIT", "8")
    assert w4a16_wgmma.split_mode(cfg, split_k) == w4a16_wgmma.SPLIT_CLUSTER
    cluster = _linear(x, w4, config=cfg)
    _assert_close(cluster, F.linear(x.float(), dense))
    monkeypatch.setenv("PAGODA_W4A16_CLUSTER_SPLIT", "0")
    assert w4a16_wgmma.split_mode(cfg, split_k) == w4a16_wgmma.SPLIT_GLOBAL
    assert torch.equal(_linear(x, w4, config=cfg), cluster)


@sm90
@pytest.mark.gpu
def test_bf16_scales_and_larger_groups() -> None:
    for group in (256, 1024):
        w4, dense = _weights("gptq", 192, 1024, group)
        x = torch.randn(40, 1024, device="cuda").to(torch.bfloat16)
        ref = F.linear(x.float(), dense)
        _assert_close(_linear(x, w4, config=WgmmaConfig()), ref)
        w4 = dataclasses.replace(w4, scales=w4.scales.to(torch.bfloat16))
        _assert_close(_linear(x, w4, config=WgmmaConfig()), ref)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("m", [32, 64, 256])
def test_wgmma_at_llama8b_shapes_matches_the_triton_kernel(name: str, m: int) -> None:
    from test_w4a16 import LLAMA3_8B

    n, k = LLAMA3_8B[name]
    w4, dense = _weights("awq", n, k, 128)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = F.linear(x.float(), dense)
    _assert_close(_linear(x, w4, config=WgmmaConfig()), ref)
    _assert_close(_linear(x, w4, config=WgmmaConfig(bn=128)), ref)
    if m <= 64:
        _assert_close(_linear(x, w4, config=skinny_config(m, n, k, 128)), ref)


@sm90
@pytest.mark.gpu
def test_wgmma_in_a_cuda_graph_replays_exactly() -> None:
    w4, _ = _weights("gptq_act_order", 512, 4096, 128)
    x = torch.randn(40, 4096, device="cuda").to(torch.bfloat16)
    assert_graph_replays_exactly(lambda: _linear(x, w4, config=WgmmaConfig(split_k=4)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_W4A16_CLUSTER_SPLIT", "8")
        assert_graph_replays_exactly(lambda: _linear(x, w4, config=WgmmaConfig(split_k=4)))


def test_k_order_is_a_permutation_of_each_step() -> None:
    order = w4a16_wgmma.k_order(384, torch.device("cpu")).long()
    assert sorted(order.tolist()) == list(range(384))
    assert torch.equal(order.view(3, 128) // 128, torch.arange(3)[:, None].expand(3, 128))
    # k-chunk c's slots 2t, 2t + 1 / 2t + 8, 2t + 9 hold inputs 32t + 4c + {0, 1} / {2, 3}.
    step = order[:128].view(8, 2, 4, 2)  # [c, hi, t, e]
    for c in range(8):
        for t in range(4):
            assert step[c, 0, t].tolist() == [32 * t + 4 * c, 32 * t + 4 * c + 1]
            assert step[c, 1, t].tolist() == [32 * t + 4 * c + 2, 32 * t + 4 * c + 3]
    x = torch.randn(3, 384)
    perm = torch.randperm(384).to(torch.int32)
    assert torch.equal(w4a16_wgmma.reorder_x(x, perm), x[:, perm.long()][:, order])


@pytest.mark.parametrize(
    ("m", "k", "bn", "act_order"),
    [(3, 256, 32, False), (70, 384, 64, True), (100, 256, 96, True), (200, 256, 192, False)],
)
def test_tile_x_writes_the_swizzled_b_tiles(m: int, k: int, bn: int, act_order: bool) -> None:
    x = torch.randn(m, k)
    perm = torch.randperm(k).to(torch.int32) if act_order else None
    ref = w4a16_wgmma.tile_x_reference(x, perm, bn)
    assert ref.shape == (-(-m // bn), k // 128, bn * 128)
    order = w4a16_wgmma.k_order(k, x.device).long()
    if perm is not None:
        order = perm.long()[order]
    for mt, s, h, r, c in [(0, 0, 0, 0, 0), (0, k // 128 - 1, 1, 2, 5), (m // bn, 1, 0, 9, 3)]:
        row = mt * bn + r
        want = x[row, order[s * 128 + h * 64 + 8 * c :][:8]] if row < m else torch.zeros(8)
        at = h * bn * 64 + r * 64 + 8 * (c ^ (r % 8))  # 16-byte chunk c of row r, swizzled
        assert torch.equal(ref[mt, s, at : at + 8], want), (mt, s, h, r, c)
    assert torch.equal(w4a16_wgmma.tile_x(x, perm, bn), ref)  # the kernel (interpreted on CPU)
    if torch.cuda.is_available():
        xc = x.cuda().to(torch.bfloat16)
        pc = None if perm is None else perm.cuda()
        assert torch.equal(w4a16_wgmma.tile_x(xc, pc, bn), w4a16_wgmma.tile_x_reference(xc, pc, bn))


def test_configs_and_inputs_that_cannot_run_name_the_reason() -> None:
    assert w4a16_wgmma.config_reason(WgmmaConfig()) is None
    assert "bn" in w4a16_wgmma.config_reason(WgmmaConfig(bn=48))
    assert "stages" in w4a16_wgmma.config_reason(WgmmaConfig(stages=2))
    assert "shared memory" in w4a16_wgmma.config_reason(WgmmaConfig(bn=128, stages=8))
    assert "2 CTAs" in w4a16_wgmma.config_reason(WgmmaConfig(bn=128, ctas_per_sm=2))
    assert "a_buffers" in w4a16_wgmma.config_reason(WgmmaConfig(a_buffers=3))
    assert w4a16_wgmma.config_reason(WgmmaConfig(bn=256, stages=3)) is None  # 255 registers
    assert "warpgroups" in w4a16_wgmma.config_reason(WgmmaConfig(warpgroups=3))
    assert "registers" in w4a16_wgmma.config_reason(WgmmaConfig(warpgroups=4, ctas_per_sm=2))
    assert w4a16_wgmma.rows_per_cta(WgmmaConfig(warpgroups=4)) == 256
    assert w4a16_wgmma.config_reason(WgmmaConfig(bn=256, stages=3, a_buffers=1)) is None
    asm = w4a16_wgmma._wgmma_function(64, bf16=True)
    assert "m64n64k16.f32.bf16.bf16" in asm and '"+f"(d[31])' in asm and "%36" in asm
    x = torch.randn(32, 256)
    qweight = torch.zeros(32, 32, dtype=torch.int32)
    scales = torch.ones(2, 32, dtype=torch.float16)
    zeros = torch.zeros(2, 32, dtype=torch.uint8)
    reason = w4a16_wgmma.unsupported_reason(x, qweight, scales, None, 128)
    assert reason is not None
    with pytest.raises(ValueError, match="wgmma kernel cannot run"):
        w4a16_linear(x, qweight, scales, zeros, 128, config=WgmmaConfig())


def test_split_mode_takes_a_cluster_where_one_holds_the_split(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_W4A16_CLUSTER_SPLIT", "8")
    mode = w4a16_wgmma.split_mode
    assert mode(WgmmaConfig(), 1) == w4a16_wgmma.SPLIT_NONE
    assert mode(WgmmaConfig(), 8) == w4a16_wgmma.SPLIT_CLUSTER
    assert mode(WgmmaConfig(), 9) == w4a16_wgmma.SPLIT_GLOBAL  # past the portable 8 CTAs
    # 4 warpgroups' accumulators need 4 stages' shared memory
    assert mode(WgmmaConfig(warpgroups=4, stages=3), 2) == w4a16_wgmma.SPLIT_GLOBAL
    assert mode(WgmmaConfig(warpgroups=4, stages=4), 2) == w4a16_wgmma.SPLIT_CLUSTER
    monkeypatch.setenv("PAGODA_W4A16_CLUSTER_SPLIT", "0")
    assert mode(WgmmaConfig(), 2) == w4a16_wgmma.SPLIT_GLOBAL
    monkeypatch.setenv("PAGODA_W4A16_CLUSTER_SPLIT", "1")
    assert mode(WgmmaConfig(), 2) == w4a16_wgmma.SPLIT_GLOBAL
    monkeypatch.delenv("PAGODA_W4A16_CLUSTER_SPLIT")  # the default: two-way splits only
    assert mode(WgmmaConfig(), 2) == w4a16_wgmma.SPLIT_CLUSTER
    assert mode(WgmmaConfig(), 4) == w4a16_wgmma.SPLIT_GLOBAL


def test_the_rule_takes_the_wgmma_kernel_where_it_won() -> None:
    from pagoda.kernels.w4a16 import choose_config

    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    rows = (17, 32, 33, 64, 65, 96, 97, 128, 129, 160, 161, 192, 193, 256)
    assert [choose_config(m, *gate_up, 128).bn for m in rows] == [
        32, 32, 64, 64, 96, 96, 128, 128, 160, 160, 192, 192, 256, 256
    ]  # fmt: skip
    assert choose_config(96, *gate_up, 128).warpgroups == 4
    assert choose_config(256, *gate_up, 128).a_buffers == 1
    assert choose_config(64, *down, 128) == WgmmaConfig(bn=64, a_buffers=1, ctas_per_sm=2)
    for m in (65, 128):
        assert choose_config(m, *down, 128) == WgmmaConfig(bn=64, warpgroups=4, a_buffers=1)
    assert choose_config(129, *down, 128) == WgmmaConfig(bn=160, a_buffers=1)
    assert choose_config(161, *down, 128) == WgmmaConfig(bn=192, a_buffers=1)
    for m in (193, 256, 512):
        assert choose_config(m, *down, 128) == WgmmaConfig(bn=128)
    assert choose_config(512, *gate_up, 128).bn == 256
    for m in (33, 64):
        assert choose_config(m, *qkv, 128) == WgmmaConfig(bn=64, a_buffers=1, ctas_per_sm=2)
        assert choose_config(m, *o, 128) == WgmmaConfig(bn=64, warpgroups=1, depth=4, ctas_per_sm=2)
    for m, shape in ((65, o), (160, o), (256, o), (65, qkv), (128, qkv), (256, qkv)):
        cfg = choose_config(m, *shape, 128)
        assert (cfg.bn, cfg.warpgroups, cfg.depth) == (64, 1, 4), (m, shape)
    assert [choose_config(m, *qkv, 128).bn for m in (129, 160, 161, 192)] == [160, 160, 192, 192]
    assert choose_config(256, *qkv, 128).a_buffers == 1
    assert choose_config(256, *o, 128).a_buffers == 2
    assert choose_config(512, *qkv, 128).bn == 256
    assert choose_config(512, *o, 128) == WgmmaConfig(bn=128)
    for shape in (qkv, o, gate_up, down):
        assert choose_config(1024, *shape, 128) == WgmmaConfig(bn=256, stages=3, a_buffers=1)
    not_taken = [(16, gate_up), (1025, gate_up), (32, qkv), (32, o), (32, down), (1025, o)]
    for m, shape in not_taken:
        assert not isinstance(choose_config(m, *shape, 128), WgmmaConfig), (m, shape)
    assert not isinstance(choose_config(128, *gate_up, 64), WgmmaConfig)  # groups within a step
    assert not isinstance(choose_config(128, 28672, 4000, 128), WgmmaConfig)  # K not whole steps
    assert not isinstance(choose_config(128, 2048, 2048, 128), WgmmaConfig)  # narrow: not measured
