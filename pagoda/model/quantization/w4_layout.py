"""The packed 4-bit layout of the W4A16 kernel (`pagoda.kernels.w4a16`), and AWQ / GPTQ
checkpoints repacked into it (torch only, on the tensors' device, once at load).

- qweight [N, ceil(K/8)] int32: word j of row n holds q[n, 8j + i] in bits 4i..4i+3;
- scales [groups, N] (the checkpoint's dtype), zeros [groups, N] uint8 (the zero points);
- perm [K] int32 or None: for a GPTQ act-order layer, input j of the packed weight is input
  perm[j] of the checkpoint (inputs sorted by group, so groups are j // G again).

AWQ moves from packing outputs (interleaved nibbles) to packing inputs; GPTQ already packs 8
consecutive inputs per word, low nibble first, so its qweight is just transposed unless it is
act-ordered. An act-order layer is repacked only if sorting its inputs by g_idx gives groups
of G consecutive inputs (what GPTQ writes) and, for fused layers (qkv, gate_up), all shards
share one g_idx: they share their input x, so one permutation must serve them all
(`gptq_to_w4` returns None otherwise, and the layer stays dense).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.model.quantization.formats import AWQ_ORDER

# Nibble s of an AWQ word holds output AWQ_ORDER[s]: output i sits in nibble _AWQ_NIBBLE[i].
_AWQ_NIBBLE = [AWQ_ORDER.index(i) for i in range(8)]


@dataclass
class W4Weight:
    qweight: torch.Tensor  # [N, ceil(K/8)] int32
    scales: torch.Tensor  # [groups, N]
    zeros: torch.Tensor  # [groups, N] uint8
    group_size: int
    perm: torch.Tensor | None  # [K] int32: packed input j is checkpoint input perm[j]


def nibbles_of_words(words: torch.Tensor) -> torch.Tensor:
    """[R, W] int32 -> [R, 8W] uint8, nibble i of word j at 8j + i (little-endian bytes)."""
    b = words.contiguous().view(torch.uint8)  # [R, 4W]: byte 0 holds nibbles 0 (low) and 1
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(words.shape[0], -1)


def pack_w4(values: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 16) -> qweight [N, ceil(K/8)] int32 (K padded with zeros), the 8
    inputs of a word in AWQ's nibble order."""
    n, k = values.shape
    v = torch.zeros(n, -(-k // 8) * 8, dtype=torch.uint8, device=values.device)
    v[:, :k] = values
    nib = v.view(n, -1, 8)[..., list(AWQ_ORDER)].reshape(n, -1)  # nibble s: input AWQ_ORDER[s]
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous().view(torch.int32)


def unpack_w4(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """qweight [N, ceil(K/8)] -> [N, K] uint8 values."""
    nib = nibbles_of_words(qweight)
    return nib.view(nib.shape[0], -1, 8)[..., _AWQ_NIBBLE].reshape(nib.shape[0], -1)[:, :k]


def dequantize_w4(w: W4Weight, k: int) -> torch.Tensor:
    """The dense [N, K] float32 weight in the checkpoint's input order (the reference)."""
    q = unpack_w4(w.qweight, k).float()  # [N, K], packed input order
    g = torch.arange(k, device=q.device) // w.group_size
    dense = (q - w.zeros.float()[g].t()) * w.scales.float()[g].t()
    if w.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, w.perm.long()] = dense
    return out


def awq_to_w4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> W4Weight:
    """AWQ qweight [K, N/8], qzeros [groups, N/8], scales [groups, N] -> the kernel layout."""
    k = qweight.shape[0]
    values = nibbles_of_words(qweight).reshape(k, -1, 8)[..., _AWQ_NIBBLE].reshape(k, -1)
    zeros = nibbles_of_words(qzeros).reshape(qzeros.shape[0], -1, 8)[..., _AWQ_NIBBLE]
    return W4Weight(
        qweight=pack_w4(values.t()),
        scales=scales.contiguous(),
        zeros=zeros.reshape(qzeros.shape[0], -1).contiguous(),
        group_size=group_size,
        perm=None,
    )


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input permutation of a GPTQ layer whose shards all have g_idx [shards, K]: None
    for g_idx = k // G (no act order); the inputs sorted by group (int32 [K]); raises
    ValueError when the shards differ or sorting does not give groups of G consecutive inputs."""
    k = g_idx.shape[-1]
    plain = torch.arange(k, device=g_idx.device, dtype=g_idx.dtype) // group_size
    if not bool((g_idx == g_idx[0]).all()):
        raise ValueError("the fused shards have different g_idx (act orders)")
    if torch.equal(g_idx[0], plain):
        return None
    perm = torch.argsort(g_idx[0], stable=True)
    if not torch.equal(g_idx[0][perm], plain):
        raise ValueError("g_idx sorted is not groups of group_size consecutive inputs")
    return perm.to(torch.int32)


def gptq_to_w4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    group_size: int,
) -> W4Weight | None:
    """4-bit GPTQ qweight [K/8, N], qzeros [groups, N/8] (zero - 1), scales [groups, N] and
    g_idx [shards, K] -> the kernel layout; None where act order cannot be one permutation
    (see `act_order_perm`)."""
    try:
        perm = act_order_perm(g_idx, group_size)
    except ValueError:
        return None
    values = nibbles_of_words(qweight.t())  # [N, K]: GPTQ packs 8 inputs a word, low first
    if perm is not None:
        values = values[:, perm.long()]
    return W4Weight(
        qweight=pack_w4(values),
        scales=scales.contiguous(),
        zeros=(nibbles_of_words(qzeros) + 1).contiguous(),  # stored zero - 1: up to 16
        group_size=group_size,
        perm=perm,
    )
