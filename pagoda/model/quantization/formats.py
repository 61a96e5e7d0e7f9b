"""The tensor layouts of AWQ and GPTQ checkpoints, and round-to-nearest group quantization.

AWQ (AutoAWQ "GEMM" version, what `quant_method: awq` checkpoints hold), 4-bit, for a linear
layer with K inputs and N outputs, groups of G inputs:
- qweight [K, N/8] int32: word j of row k holds outputs 8j + AWQ_ORDER[s] in nibble s
  (bits 4s..4s+3), i.e. the interleaved order 0, 2, 4, 6, 1, 3, 5, 7;
- qzeros [K/G, N/8] int32, packed the same way; scales [K/G, N];
- w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n].

GPTQ (AutoGPTQ layout, `quant_method: gptq`, checkpoint format "gptq"), 4 or 8 bits, P = 32 /
bits values per word:
- qweight [K/P, N] int32: word i of column n holds inputs P*i + s in bits s*bits..;
- qzeros [groups, N/P] int32 packed along outputs, each stored as zero - 1;
- scales [groups, N]; g_idx [K] the group of every input (not k // G after act-order);
- w[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) * s[g_idx[k], n].

`pack_*` are the exact inverses of `unpack_*` (tests build checkpoints with them, and
`quantize_groups` + these make a round-to-nearest quantizer).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble s of a word holds output 8j + AWQ_ORDER[s]


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def _unpack_last(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., W] int32 -> [..., W * 32/bits] values, word-minor (value s of word j at j*P + s)."""
    mask = (1 << bits) - 1
    vals = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & mask
    return vals.reshape(*packed.shape[:-1], -1)


def _pack_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_unpack_last`: [..., W * 32/bits] values in [0, 2**bits) -> [..., W] int32."""
    per_word = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    words = (v << _shifts(bits, values.device).to(torch.int64)).sum(-1)
    return (words - ((words >= 1 << 31).to(torch.int64) << 32)).to(torch.int32)  # as int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ qweight/qzeros [R, N/8] int32 -> [R, N] values in output order."""
    vals = _unpack_last(packed, 4).reshape(packed.shape[0], -1, 8)
    out = torch.empty_like(vals)
    out[..., list(AWQ_ORDER)] = vals
    return out.reshape(packed.shape[0], -1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit values -> AWQ [R, N/8] int32."""
    grouped = values.reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return _pack_last(grouped.reshape(values.shape[0], -1), 4)


def unpack_gptq_weight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight [K/P, N] int32 -> [K, N] values."""
    return _unpack_last(qweight.t().contiguous(), bits).t()


def pack_gptq_weight(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] values -> GPTQ qweight [K/P, N] int32."""
    return _pack_last(values.t().contiguous(), bits).t().contiguous()


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The dense [N, K] float32 weight of an AWQ layer."""
    q = unpack_awq(qweight).float()  # [K, N]
    z = unpack_awq(qzeros).float().repeat_interleave(group_size, dim=0)[: q.shape[0]]
    s = scales.float().repeat_interleave(group_size, dim=0)[: q.shape[0]]
    return ((q - z) * s).t()


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    """The dense [N, K] float32 weight of a GPTQ layer (zeros stored minus one)."""
    q = unpack_gptq_weight(qweight, bits).float()  # [K, N]
    z = _unpack_last(qzeros, bits).float() + 1.0  # [groups, N]
    g = g_idx.long()
    return ((q - z[g]) * scales.float()[g]).t()


def quantize_groups(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool = False,
    min_zero: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization of a [N, K] weight in groups of `group_size` inputs:
    (values [K, N] in [0, 2**bits), zeros [ceil(K/G), N], scales [ceil(K/G), N]) with
    w ~= (values - zeros) * scales. `min_zero=1` for GPTQ's format, which stores zero - 1."""
    n, k = weight.shape
    qmax = (1 << bits) - 1
    w = weight.float().t()  # [K, N]
    values = torch.empty(k, n, dtype=torch.int32)
    groups = -(-k // group_size)  # the last group may be shorter (K not a multiple of G)
    zeros, scales = torch.empty(groups, n, dtype=torch.int32), torch.empty(groups, n)
    for g in range(groups):
        rows = w[g * group_size : (g + 1) * group_size]
        if symmetric:
            scale = rows.abs().amax(dim=0) / (qmax / 2)
            zero = torch.full_like(scale, float((qmax + 1) // 2))
        else:
            lo, hi = rows.amin(dim=0), rows.amax(dim=0)
            scale = (hi - lo) / qmax
            zero = torch.round(-lo / scale.clamp_min(1e-12)).clamp(min_zero, qmax)
        scale = scale.clamp_min(1e-8)
        q = torch.clamp(torch.round(rows / scale) + zero, 0, qmax)
        values[g * group_size : (g + 1) * group_size] = q.to(torch.int32)
        zeros[g], scales[g] = zero.to(torch.int32), scale
    return values, zeros, scales
