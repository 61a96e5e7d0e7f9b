"""The warp-specialized CUDA W4A16 kernel (`pagoda.kernels.w4a16_ws`) against the checkpoints'
dequantization + F.linear: AWQ, GPTQ and act-order GPTQ weights, bf16 and fp16 x, fp16 and bf16
scales, 17-300 rows (ragged row and weight tiles), K split over CTAs, groups of 128, 256 and
one group per row, bias, every tile shape, and a CUDA-graph replay. Marked `gpu` (sm_90); on a
CPU the configs' checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_graph_replays_exactly, enable_interpreter_without_cuda

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels import w4a16_ws  # noqa: E402
from pagoda.kernels.w4a16 import w4a16_linear  # noqa: E402
from pagoda.kernels.w4a16_ws import WsConfig  # noqa: E402

sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU",
)

TILES = [
    WsConfig(),
    WsConfig(bn=256),
    WsConfig(bn=256, wm=1, wn=2),
    WsConfig(bn=64, wm=1, stages=6, ctas_per_sm=2),
    WsConfig(bn=128, wm=1, wn=2, depth=2),
    WsConfig(bn=192, wm=1, stages=3, depth=3),
    WsConfig(bn=256, wn=2, stages=3),
    WsConfig(bn=32, wm=2, stages=8, depth=1),
    WsConfig(bn=128, wm=1, split_k=3, ctas_per_sm=2),
    WsConfig(bn=128, wm=4, depth=2),
    WsConfig(bn=128, wm=1, stages=3, ctas_per_sm=2, ring=8),
    WsConfig(bn=256, stages=3, depth=3, ring=12),
    WsConfig(bn=128, wm=1, ctas_per_sm=2, a_regs=1),
    WsConfig(bn=256, wm=1, wn=2, stages=3, ring=12, a_regs=1),
    WsConfig(bn=96, wm=2, stages=5, a_regs=1),
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
    rounded, fp32 sums in another order); a wrong nibble, row, group or input is off by ~100%."""
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), (err, ref.abs().max().item())


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_act_order"])
@pytest.mark.parametrize("m", [17, 100, 129, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ws_matches_dequantized_linear(fmt: str, m: int, dtype: torch.dtype) -> None:
    n, k = 200, 640  # 200 rows: the last CTA's rows past N; K = 10 stages
    w4, dense = _weights(fmt, n, k, 128, seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if m % 2 else None
    ref = F.linear(x.float(), dense, None if bias is None else bias.float())
    _assert_close(_linear(x, w4, bias, WsConfig()), ref)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILES, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [24, 64, 200])
def test_every_tile_shape_matches(cfg: WsConfig, m: int) -> None:
    n, k = 320, 1920  # 30 stages: DEPTH batches and the ring cut short
    w4, dense = _weights("awq", n, k, 128, seed=m)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    _assert_close(_linear(x, w4, config=cfg), F.linear(x.float(), dense))


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize(
    "cfg",
    [WsConfig(), WsConfig(bn=256, wm=1, wn=2), WsConfig(ring=5), WsConfig(a_regs=1)],
    ids=lambda c: c.name,
)
def test_split_k_sums_every_split(split_k: int, cfg: WsConfig) -> None:
    n, k = 320, 4096  # the last CTA's rows past N
    w4, dense = _weights("gptq", n, k, 128)
    x = torch.randn(300, k, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    cfg = cfg._replace(split_k=split_k)
    out = _linear(x, w4, bias, cfg)
    _assert_close(out, F.linear(x.float(), dense, bias.float()))
    assert torch.equal(_linear(x, w4, bias, cfg), out)  # the counters were reset: same bits


@sm90
@pytest.mark.gpu
def test_bf16_scales_and_larger_groups() -> None:
    for group in (256, 1024):
        w4, dense = _weights("gptq", 192, 1024, group)
        x = torch.randn(40, 1024, device="cuda").to(torch.bfloat16)
        ref = F.linear(x.float(), dense)
        _assert_close(_linear(x, w4, config=WsConfig(split_k=3)), ref)
        w4 = dataclasses.replace(w4, scales=w4.scales.to(torch.bfloat16))
        _assert_close(_linear(x, w4, config=WsConfig()), ref)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("m", [128, 256])
def test_ws_at_llama8b_shapes(name: str, m: int) -> None:
    from test_w4a16 import LLAMA3_8B

    n, k = LLAMA3_8B[name]
    w4, dense = _weights("awq", n, k, 128)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = F.linear(x.float(), dense)
    _assert_close(_linear(x, w4, config=WsConfig(bn=256)), ref)
    _assert_close(_linear(x, w4, config=WsConfig(bn=256, wm=1, wn=2)), ref)
    _assert_close(_linear(x, w4, config=WsConfig(bn=256, wm=1, wn=2, a_regs=1)), ref)


@sm90
@pytest.mark.gpu
def test_ws_in_a_cuda_graph_replays_exactly() -> None:
    w4, _ = _weights("gptq_act_order", 512, 4096, 128)
    x = torch.randn(40, 4096, device="cuda").to(torch.bfloat16)
    assert_graph_replays_exactly(lambda: _linear(x, w4, config=WsConfig(split_k=4)))


def test_configs_that_cannot_run_name_the_reason() -> None:
    for cfg in TILES:
        assert w4a16_ws.config_reason(cfg) is None, cfg
    assert "wm" in w4a16_ws.config_reason(WsConfig(wm=3))
    assert "wm" in w4a16_ws.config_reason(WsConfig(wm=4, wn=2))
    assert "bn" in w4a16_ws.config_reason(WsConfig(bn=48))
    assert "bn" in w4a16_ws.config_reason(WsConfig(bn=512))
    assert "registers" in w4a16_ws.config_reason(WsConfig(bn=256, wn=2, ctas_per_sm=2))
    assert "shared memory" in w4a16_ws.config_reason(WsConfig(bn=256, stages=6))
    assert "stages" in w4a16_ws.config_reason(WsConfig(stages=1))
    assert "ring" in w4a16_ws.config_reason(WsConfig(ring=1))
    assert "registers" in w4a16_ws.config_reason(WsConfig(bn=256, a_regs=1))
    assert (
        w4a16_ws.smem_bytes(WsConfig(bn=128, wm=2, stages=4, ring=8))
        == 4 * 256 * 128 + 8 * 2 * 2048 + 1024
    )
    assert w4a16_ws.threads(WsConfig(wm=2, wn=2)) == 640
    assert w4a16_ws.smem_bytes(WsConfig(bn=128, wm=2, stages=4)) == 4 * 256 * 128 + 1024
    assert WsConfig(bn=256, wm=1, wn=2, split_k=2).name == "ws64x256_n2_s4_d4_k2"
    asm = w4a16_ws._wgmma_function(128, bf16=True)
    assert (
        "m64n128k16.f32.bf16.bf16" in asm and '"+f"(d[63])' in asm and "%65, 1, 1, 1, 0, 0" in asm
    )
    x = torch.randn(32, 256)
    qweight = torch.zeros(32, 32, dtype=torch.int32)
    scales = torch.ones(2, 32, dtype=torch.float16)
    zeros = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="wgmma kernel cannot run"):
        w4a16_linear(x, qweight, scales, zeros, 128, config=WsConfig())
