"""AWQ / GPTQ (and 8-bit W8A8 / FP8, `int8_blocks` / `fp8_blocks`) layers on a CPU kept
quantized: their codes, zero points and scales rewritten at load as the GGUF blocks the
quantized CPU GEMM reads (`pagoda.kernels.cpu.quant`: int8 activations, AVX-512 VNNI / AVX2 /
portable C), so a 4-bit checkpoint runs as a GGUF Q4 file does, with a quarter of the bf16
weight bytes, instead of dequantized to dense weights.

A group of G inputs (a multiple of 32) with scale s and zero point z holds w = s * (q - z),
so each of its 32-input blocks is
- 4 bits, zero points 8 throughout the layer (GPTQ's symmetric checkpoints): Q4_0, d = s and
  the code q exactly, since Q4_0 is d * (q - 8);
- 4 bits otherwise: Q4_1, d = s, m = -s * z, w = d * q + m. d is the checkpoint's fp16 scale,
  exact; m is rounded to fp16 (by at most s * z * 2**-11 <= s / 128, where the weights' own
  rounding is up to half a step s);
- 8 bits where every q - z fits int8 (GPTQ's symmetric checkpoints, z = 128): Q8_0, d = s,
  the int8 q - z, exact.
A layer whose groups do not hold whole blocks (G or K not a multiple of 32), whose scales are
not finite in fp16, or whose 8-bit codes do not fit stays dense, as before.

GPTQ act order: the codes arrive with their inputs sorted by group (`w4_layout` /
`w8_layout`'s `perm`), so blocks are consecutive again, and the layer gathers its input
through that permutation before the product (`ActOrderGGUFLinearMethod`).

The blocks are installed as a GGUF layer's (`layer.gguf_weight`, x8 layout): the layer path,
the one-call C decoder stack and the reference path (blocks dequantized, F.linear; a layer's
`fused_ops` off) treat them as they treat a GGUF file's. `PAGODA_CPU_QUANTIZED=0` dequantizes
AWQ / GPTQ layers at load instead (the dense reference) and leaves int8 and FP8 layers to the
W8A8 float32 reference.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda import envs
from pagoda.kernels.cpu import quant
from pagoda.kernels.cpu.quant import QuantWeight
from pagoda.model.quantization.gguf import GGUFLinearMethod, to_kernel_layout
from pagoda.model.quantization.w4_layout import W4Weight, unpack_w4
from pagoda.model.quantization.w8_layout import ZERO_OFFSET, W8Weight

Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK = 32


def cpu_blocks_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether AWQ / GPTQ layers on `device` in `dtype` become GGUF blocks: a CPU, float32 or
    bf16 activations (what the kernel takes), the kernel built, `PAGODA_CPU_QUANTIZED` on."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and envs.PAGODA_CPU_QUANTIZED
        and quant.quant_kernel_available()
    )


def _block_params(scales: torch.Tensor, group_size: int, n: int, k: int) -> torch.Tensor:
    """[groups, N] per-group values -> [N, K/32] per-block values (float32)."""
    group_of_block = torch.arange(0, k, BLOCK) // group_size
    return scales.float()[group_of_block].t().contiguous()


def _fp16_exact(values: torch.Tensor) -> torch.Tensor | None:
    """`values` as fp16 if each is finite there and it changes none of them, else None."""
    half = values.to(torch.float16)
    if not bool(torch.isfinite(half).all()) or not torch.equal(half.float(), values):
        return None
    return half


def _as_blocks(ggml_type: int, n: int, k: int, *fields: torch.Tensor) -> QuantWeight:
    """GGUF rows of `ggml_type` whose blocks hold `fields` side by side, each [n, k / 32, ...]
    in any dtype (fp16 scales [n, k / 32], byte codes [n, k / 32, bytes]), taken as bytes."""
    # Flattened first: a [n, 1] field (one block a row) may be "contiguous" with a last
    # stride other than 1, which a view as bytes refuses.
    parts = [
        f.contiguous().reshape(-1).view(torch.uint8).reshape(n, k // BLOCK, -1) for f in fields
    ]
    return QuantWeight(torch.cat(parts, dim=-1).reshape(n, -1), ggml_type, n, k)


def _block_scales(w: W4Weight | W8Weight, k: int) -> torch.Tensor | None:
    """The fp16 scale of each 32-input block [N, K / 32]; None where the groups are not whole
    blocks or a scale is not an fp16 value."""
    if k % BLOCK or w.group_size % BLOCK:
        return None
    return _fp16_exact(_block_params(w.scales, w.group_size, w.qweight.shape[0], k))


def w4_blocks(w: W4Weight, k: int) -> QuantWeight | None:
    """A 4-bit layer in the W4A16 layout as Q4_0 (every zero point 8) or Q4_1 blocks in GGUF
    rows (packed input order), or None where it has no exact block form (see the module)."""
    n = w.qweight.shape[0]
    d = _block_scales(w, k)
    if d is None:
        return None
    q = unpack_w4(w.qweight, k).view(n, k // BLOCK, 2, BLOCK // 2)
    qs = q[:, :, 0] | (q[:, :, 1] << 4)  # GGUF: byte j holds weights j (low) and j + 16
    z = _block_params(w.zeros, w.group_size, n, k)
    if bool((z == 8).all()):
        return _as_blocks(Q4_0, n, k, d, qs)
    m = (-(d.float() * z)).to(torch.float16)
    if not bool(torch.isfinite(m).all()):
        return None
    return _as_blocks(Q4_1, n, k, d, m, qs)


def w8_blocks(w: W8Weight, k: int) -> QuantWeight | None:
    """An 8-bit layer in the W8A16 layout as Q8_0 blocks in GGUF rows (packed input order), or
    None where some q - z does not fit int8 or it has no exact block form (see the module)."""
    n = w.qweight.shape[0]
    d = _block_scales(w, k)
    if d is None:
        return None
    codes = w.qweight.to(torch.int16) - ZERO_OFFSET  # q - 128
    if w.zeros is not None:  # z - 128 per group
        g = torch.arange(k) // w.group_size
        codes -= w.zeros[g].t()
    if int(codes.min()) < -128 or int(codes.max()) > 127:
        return None
    return _as_blocks(Q8_0, n, k, d, codes.to(torch.int8))


def int8_blocks(w_q: torch.Tensor, w_scale: torch.Tensor) -> QuantWeight | None:
    """An int8 W8A8 weight [N, K] with per-channel scales [N] as Q8_0 blocks in GGUF rows: the
    codes as they are, d = fp16(scale) (a relative change of at most 2**-11: 0.02 of a step at
    a weight of 40 steps, whose own rounding is up to half a step); None where K is not whole
    blocks or a scale is outside fp16's normal range. The activations are then quantized per
    32 values rather than per token: finer."""
    n, k = w_q.shape
    d = w_scale.float().reshape(-1).to(torch.float16)
    if k % BLOCK or not bool(((d.float() >= 2**-14) & torch.isfinite(d)).all()):
        return None
    return _as_blocks(Q8_0, n, k, d[:, None].expand(n, k // BLOCK), w_q)


def fp8_blocks(w_q: torch.Tensor, w_scale: torch.Tensor) -> QuantWeight | None:
    """An FP8 (e4m3) weight [N, K] with per-channel scales [N] requantized as Q8_0 blocks:
    w = e4m3 * scale, each 32-input block's d = fp16(max |w| / 127) and codes round(w / d),
    so a weight moves by at most half a Q8_0 step, d / 2 <= max |w| / 254 (e4m3's own
    rounding is up to 1/16 of the weight). Not exact, unlike `int8_blocks`; None where K is
    not whole blocks or a nonzero block's d is outside fp16's normal range."""
    n, k = w_q.shape
    if k % BLOCK:
        return None
    w = (w_q.float() * w_scale.float().reshape(-1, 1)).view(n, k // BLOCK, BLOCK)
    amax = w.abs().amax(-1)
    d = (amax / 127).to(torch.float16)
    if not bool(((d.float() >= 2**-14) | (amax == 0)).all() and torch.isfinite(d).all()):
        return None
    step = torch.where(d == 0, torch.ones_like(d), d).float()[..., None]
    codes = torch.round(w / step).clamp(-127, 127).to(torch.int8)
    return _as_blocks(Q8_0, n, k, d, codes)


class ActOrderGGUFLinearMethod(GGUFLinearMethod):
    """GGUF blocks over inputs sorted by group (a GPTQ act-order layer): the input is gathered
    through `layer.gguf_perm` first."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return super().apply(layer, x.index_select(-1, layer.gguf_perm), bias)


_GGUF = GGUFLinearMethod()
_ACT_ORDER = ActOrderGGUFLinearMethod()


def install(layer: nn.Module, blocks: QuantWeight, perm: torch.Tensor | None) -> None:
    """Make `layer` (its checkpoint tensors already dropped) run `blocks` (GGUF rows), its
    inputs gathered through `perm` first where not None."""
    qw = to_kernel_layout(blocks)
    layer.weight = nn.Parameter(qw.data, requires_grad=False)
    layer.gguf_weight, layer.gguf_segments = qw, None
    if perm is None:
        layer.linear_method = _GGUF
        return
    layer.register_buffer("gguf_perm", perm.to(torch.int64), persistent=False)
    layer.linear_method = _ACT_ORDER


__all__ = [
    "ActOrderGGUFLinearMethod",
    "cpu_blocks_enabled",
    "install",
    "int8_blocks",
    "w4_blocks",
    "w8_blocks",
]
