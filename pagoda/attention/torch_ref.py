"""Paged attention in plain PyTorch: the CPU production path and the oracle for the GPU kernels.

One step's batch is split the way the work differs (layout in `pagoda.attention.metadata`):
- the leading run of decode requests (one query row each) is served by one padded
  `scaled_dot_product_attention` call: their blocks are gathered into [num_decodes, max_len]
  with a key-padding mask, and the query heads that share a KV head are laid along the query
  axis ([num_decodes, num_kv_heads, group, head_size]) so GQA needs no repeated keys;
- every other request (a prefill chunk, or speculative rows) runs alone: fresh prompts attend
  causally over this step's own k/v; chunks with a cached prefix gather their blocks and use an
  explicit causal mask offset by the prefix length.
With a sliding window (the layer's `sliding_window`) a request reads only the blocks its
window reaches, and the masks drop the keys before it; a soft cap (`logits_soft_cap`, Gemma 2)
forms the scores explicitly (`attend`). The gather indices and masks depend only on the step
(and the window), so they are built once (by the first layer of each window) and kept in
`attn_metadata.extra`, shared by every layer. A quantized cache (int8 / fp8) stores
round(x / scale) and is read back as stored * scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    sliding_window_of,
    soft_cap_of,
)
from pagoda.attention.metadata import AttentionMetadata

_PLAN_KEY = "torch_ref_plan"
# Decode rows are attended in groups whose gathered K/V take about this many bytes: the gather
# and the attention that reads it back then meet in the CPU cache (measured ~25% faster on a
# Zen 4 for 64 x 300-token contexts than one group of everything).
_DECODE_GROUP_BYTES = 4 << 20


@dataclass
class _Chunk:
    start: int  # query rows [start, end)
    end: int
    seq_len: int
    key_start: int  # position of the first key read (a block boundary; 0 without a window)
    blocks: torch.Tensor | None  # blocks holding keys key_start .. seq_len - 1; None: no prefix
    mask: torch.Tensor | None  # [query_len, seq_len - key_start] bool, True = may attend;
    # None: plain causal over the chunk's own rows


@dataclass
class _DecodeGroup:
    start: int  # decode requests (= query rows) [start, end)
    end: int
    blocks: torch.Tensor  # [(end - start) * max_blocks] int64
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] bool, True = may attend


@dataclass
class _Plan:
    block_size: int
    write_slots: torch.Tensor | None  # [n] int64 slots of the rows written; None: no cache
    write_rows: torch.Tensor | None  # rows to write when some slots are -1; None: all rows
    decode_groups: list[_DecodeGroup]
    chunks: list[_Chunk]
    workspace: dict = field(default_factory=dict)  # gather buffers shared by all layers


def window_mask(
    query_len: int, context_len: int, key_start: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """[query_len, context_len + query_len - key_start] bool: whether query row i (at position
    context_len + i) may see key key_start + j, causally and, with a sliding window, only keys
    (position - window, position]. None where that is the plain causal mask of a fresh prompt."""
    if window is None and context_len == 0 and key_start == 0:
        return None
    key_pos = torch.arange(key_start, context_len + query_len, device=device)
    row_pos = torch.arange(context_len, context_len + query_len, device=device)[:, None]
    mask = key_pos[None, :] <= row_pos
    if window is not None:
        mask &= key_pos[None, :] > row_pos - window
    return mask


def first_window_block(first_position: int, window: int | None, block_size: int) -> int:
    """The first block a query at `first_position` (or later) can see through its window."""
    return max(0, first_position - window + 1) // block_size if window else 0


def _build_plan(md: AttentionMetadata, kv_cache: torch.Tensor | None, window: int | None) -> _Plan:
    has_cache = kv_cache is not None
    block_size = int(kv_cache.shape[2]) if has_cache else 0
    # K and V bytes of one token in one layer.
    token_bytes = 2 * kv_cache[0, 0, 0].numel() * kv_cache.element_size() if has_cache else 0
    qsl = md.query_start_loc_cpu or md.query_start_loc.tolist()
    seq_lens = md.seq_lens_cpu or md.seq_lens.tolist()
    num_reqs = len(seq_lens)
    n = md.num_actual_tokens
    device = md.slot_mapping.device
    write_slots = write_rows = None
    if has_cache:
        slots = md.slot_mapping[:n].long()
        valid = slots >= 0
        if bool(valid.all()):
            write_slots = slots
        else:
            write_rows = valid.nonzero().squeeze(1)
            write_slots = slots.index_select(0, write_rows)

    num_decodes = 0
    if has_cache:
        while num_decodes < num_reqs and qsl[num_decodes + 1] - qsl[num_decodes] == 1:
            num_decodes += 1
    # A decode reads blocks first_block[b] .. its last: all of them, or its window's.
    first_block = [
        first_window_block(seq_lens[b] - 1, window, block_size) for b in range(num_decodes)
    ]
    num_read = [-(-seq_lens[b] // block_size) - first_block[b] for b in range(num_decodes)]
    decode_groups = []
    group_start = 0
    while group_start < num_decodes:
        # Groups small enough that the gathered K/V are still in cache when attention reads them.
        group_end, most = group_start + 1, num_read[group_start]
        while group_end < num_decodes:
            most_next = max(most, num_read[group_end])
            if (group_end + 1 - group_start) * most_next * block_size * token_bytes > (
                _DECODE_GROUP_BYTES
            ):
                break
            group_end, most = group_end + 1, most_next
        first = torch.tensor(first_block[group_start:group_end], device=device)[:, None]
        table = md.block_tables[group_start:group_end]
        cols = (first + torch.arange(most, device=device)[None, :]).clamp_(max=table.shape[1] - 1)
        blocks = table.gather(1, cols).reshape(-1).long()
        key_pos = first * block_size + torch.arange(most * block_size, device=device)[None, :]
        lens = md.seq_lens[group_start:group_end].to(device)[:, None]
        mask = key_pos < lens
        if window is not None:
            mask &= key_pos >= lens - window
        decode_groups.append(_DecodeGroup(group_start, group_end, blocks, mask[:, None, None, :]))
        group_start = group_end

    chunks = []
    for b in range(num_decodes, num_reqs):
        start, end, seq_len = qsl[b], qsl[b + 1], seq_lens[b]
        query_len = end - start
        context_len = seq_len - query_len
        if context_len == 0:
            mask = window_mask(query_len, 0, 0, window, device)
            chunks.append(_Chunk(start, end, seq_len, 0, None, mask))
            continue
        if not has_cache:
            raise RuntimeError("a request with a cached prefix needs a KV cache")
        first = first_window_block(context_len, window, block_size)
        num_blocks = -(-seq_len // block_size)
        blocks = md.block_tables[b, first:num_blocks].long()
        key_start = first * block_size
        mask = window_mask(query_len, context_len, key_start, window, device)
        chunks.append(_Chunk(start, end, seq_len, key_start, blocks, mask))
    return _Plan(block_size, write_slots, write_rows, decode_groups, chunks)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped] + mask) v for q: [B, H, Lq, hs], k, v:
    [B, KVH, Lk, hs] (H a multiple of KVH; head h reads KV head h // (H / KVH)). `mask`: bool
    (True = may attend) or additive, broadcastable to [B, H, Lq, Lk]; None: causal.

    SDPA where it can (no soft cap); with a soft cap the scores are formed explicitly, in
    float32, since SDPA has no hook between the product and the softmax."""
    group = q.shape[1] // k.shape[1]
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril_(lk - lq)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    if dtype == torch.int8:
        return (x.float() / scale).round_().clamp_(-128, 127).to(dtype)
    if dtype.itemsize == 1:  # fp8: saturate, as the kernels do, instead of overflowing to NaN
        bound = torch.finfo(dtype).max
        return (x.float() / scale).clamp_(-bound, bound).to(dtype)
    return x.to(dtype)


def _from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    if x.dtype.itemsize == 1:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def write_kv_cache(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store rows k[i], v[i] at flat slot slots[i] of the cache (slot = block * block_size + off).
    Any strides: a cache laid out head-major within blocks is a view of the same shape."""
    block_size = kv_cache.shape[2]
    k, v = _to_cache(k, kv_cache.dtype, k_scale), _to_cache(v, kv_cache.dtype, v_scale)
    if _is_fp8(kv_cache.dtype):  # CPU index ops lack fp8 kernels; move the bytes instead
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    if kv_cache.is_contiguous():
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)
    else:
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[0].index_put_((blocks, offsets), k)
        kv_cache[1].index_put_((blocks, offsets), v)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _gather_kv(
    kv_cache: torch.Tensor, blocks: torch.Tensor, workspace: dict, key: object
) -> torch.Tensor:
    """kv_cache[:, blocks] -> [2, len(blocks), block_size, num_kv_heads, head_size].

    The result lands in a buffer kept in the step's plan and reused by every layer (the layers
    run one after another), so a step allocates it once instead of once per layer."""
    raw = kv_cache.view(torch.uint8) if _is_fp8(kv_cache.dtype) else kv_cache
    shape = (2, blocks.shape[0], *raw.shape[2:])
    numel = math.prod(shape)
    flat = workspace.get(key)
    if flat is None or flat.dtype != raw.dtype or flat.numel() < numel:
        flat = workspace[key] = raw.new_empty(numel)
    buf = flat[:numel].view(shape)
    torch.index_select(raw, 1, blocks, out=buf)
    return buf.view(kv_cache.dtype) if raw is not kv_cache else buf


def _additive_mask(
    mask: torch.Tensor, dtype: torch.dtype, workspace: dict, key: object
) -> torch.Tensor:
    """A boolean mask as 0 / -inf in the query dtype, built once per step: SDPA would otherwise
    convert the boolean mask again in every layer."""
    additive = workspace.get(key)
    if additive is None or additive.dtype != dtype:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive.masked_fill_(~mask, float("-inf"))
        workspace[key] = additive
    return additive


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, attn_metadata: AttentionMetadata) -> None:
        return None  # the plan needs the cache's block size: built by the first layer

    def _plan(
        self, md: AttentionMetadata, kv_cache: torch.Tensor | None, window: int | None
    ) -> _Plan:
        block_size = int(kv_cache.shape[2]) if kv_cache is not None else 0
        if md.extra is None:
            md.extra = {}
        key = (_PLAN_KEY, window)  # layers with and without a window read different blocks
        plan = md.extra.get(key)
        if plan is None or plan.block_size != block_size:
            plan = _build_plan(md, kv_cache, window)
            md.extra[key] = plan
        return plan

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if kv_cache is not None and kv_cache.numel() == 0:
            kv_cache = None
        window, soft_cap = sliding_window_of(layer), soft_cap_of(layer)
        plan = self._plan(attn_metadata, kv_cache, window)
        n = attn_metadata.num_actual_tokens
        num_tokens, num_heads, head_size = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        k_scale, v_scale = getattr(layer, "k_scale", 1.0), getattr(layer, "v_scale", 1.0)

        if kv_cache is not None:
            k_new, v_new = k[:n], v[:n]
            if plan.write_rows is not None:
                k_new, v_new = k_new[plan.write_rows], v_new[plan.write_rows]
            write_kv_cache(kv_cache, k_new, v_new, plan.write_slots, k_scale, v_scale)

        out = q.new_empty(num_tokens, num_heads, head_size)
        if n < num_tokens:
            out[n:].zero_()
        for gi, g in enumerate(plan.decode_groups):
            nd = g.end - g.start
            kv = _gather_kv(kv_cache, g.blocks, plan.workspace, "decode")
            keys = _from_cache(kv[0], q.dtype, k_scale).view(nd, -1, num_kv_heads, head_size)
            values = _from_cache(kv[1], q.dtype, v_scale).view(nd, -1, num_kv_heads, head_size)
            # The `group` query heads of one KV head become `group` query rows over its keys.
            o = attend(
                q[g.start : g.end].view(nd, num_kv_heads, group, head_size),
                keys.transpose(1, 2),  # [nd, num_kv_heads, max_len, head_size]
                values.transpose(1, 2),
                _additive_mask(g.mask, q.dtype, plan.workspace, ("decode_mask", gi)),
                scale,
                soft_cap,
            )
            out[g.start : g.end] = o.reshape(nd, num_heads, head_size)
        for i, c in enumerate(plan.chunks):
            qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, hs]
            if c.blocks is None:
                kc, vc = k[c.start : c.end], v[c.start : c.end]
            else:
                kv = _gather_kv(kv_cache, c.blocks, plan.workspace, i)
                num_keys = c.seq_len - c.key_start
                kc, vc = kv[0].flatten(0, 1)[:num_keys], kv[1].flatten(0, 1)[:num_keys]
                kc, vc = _from_cache(kc, q.dtype, k_scale), _from_cache(vc, q.dtype, v_scale)
            o = attend(
                qc,
                kc.transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, num_keys, hs]
                vc.transpose(0, 1).unsqueeze(0),
                None
                if c.mask is None
                else _additive_mask(c.mask, q.dtype, plan.workspace, ("mask", i)),
                scale,
                soft_cap,
            )
            out[c.start : c.end] = o[0].transpose(0, 1)
        return out
