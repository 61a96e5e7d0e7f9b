"""The 8-bit layout of the W8A16 kernel (`pagoda.kernels.w8a16`), and 8-bit GPTQ checkpoints
repacked into it (torch only, on the tensors' device, once at load).

- qweight [N, K] uint8: the codes q of row n, one byte per input (K-contiguous rows);
- scales [groups, N] (the checkpoint's dtype);
- zeros [groups, N] int16 holding z - 128 (the kernel works on q - 128, exact in fp16 and
  bf16), or None where every zero point is 128 (GPTQ's symmetric checkpoints): the kernel
  then skips the zero term. A GPTQ zero is stored minus one in 8 bits, so z reaches 256
  (a stored 255): z - 128 takes 9 bits;
- perm [K] int32 or None: for an act-order layer, input j of the packed weight is input
  perm[j] of the checkpoint (inputs sorted by group, so groups are j // G again), as in
  `w4_layout`; fused layers whose shards have different g_idx cannot share one permutation
  (`gptq_to_w8` returns None, the layer stays dense).

GPTQ packs 4 consecutive inputs per int32 word, byte s holding input 4i + s, so on a
little-endian device the transposed qweight viewed as bytes is already [N, K].
About K*N bytes, plus 4 bytes per group and output (2 without zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.model.quantization.w4_layout import act_order_perm

ZERO_OFFSET = 128  # the kernel's codes and zeros are both centered on it


@dataclass
class W8Weight:
    qweight: torch.Tensor  # [N, K] uint8
    scales: torch.Tensor  # [groups, N]
    zeros: torch.Tensor | None  # [groups, N] int16, z - 128; None: all z = 128
    group_size: int
    perm: torch.Tensor | None  # [K] int32: packed input j is checkpoint input perm[j]


def bytes_of_words(words: torch.Tensor) -> torch.Tensor:
    """[R, W] int32 -> [R, 4W] uint8, byte s of word j at 4j + s (little-endian)."""
    return words.contiguous().view(torch.uint8)


def dequantize_w8(w: W8Weight, k: int) -> torch.Tensor:
    """The dense [N, K] float32 weight in the checkpoint's input order (the reference)."""
    g = torch.arange(k, device=w.qweight.device) // w.group_size
    q = w.qweight.float() - ZERO_OFFSET  # [N, K], packed input order
    if w.zeros is not None:
        q = q - w.zeros.float()[g].t()
    dense = q * w.scales.float()[g].t()
    if w.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, w.perm.long()] = dense
    return out


def gptq_to_w8(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    group_size: int,
) -> W8Weight | None:
    """8-bit GPTQ qweight [K/4, N], qzeros [groups, N/4] (zero - 1), scales [groups, N] and
    g_idx [shards, K] -> the kernel layout; None where act order cannot be one permutation
    (see `w4_layout.act_order_perm`)."""
    try:
        perm = act_order_perm(g_idx, group_size)
    except ValueError:
        return None
    values = bytes_of_words(qweight.t())  # [N, K]
    if perm is not None:
        values = values[:, perm.long()]
    zeros = bytes_of_words(qzeros).to(torch.int16) + (1 - ZERO_OFFSET)  # stored zero - 1
    return W8Weight(
        qweight=values.contiguous(),
        scales=scales.contiguous(),
        zeros=None if not bool(zeros.any()) else zeros.contiguous(),
        group_size=group_size,
        perm=perm,
    )
