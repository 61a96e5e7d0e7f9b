"""Paged attention for mixed batches (prefill chunks + decodes) in one Triton kernel.

The design follows vLLM's `triton_unified_attention` and FlashAttention-2 (Dao, 2023,
arXiv:2307.08691): a program owns one KV head and a block of `BLOCK_Q` query tokens of one
request together with the whole query group of that KV head (GQA: `BLOCK_M = BLOCK_Q * G`
rows), so each KV tile of the paged cache is read once per group, and runs an online softmax
over the request's keys in tiles of `TILE_SIZE` tokens gathered through the block table.
The split-KV path (flash-decoding, Dao et al. 2023) adds a third grid axis that cuts the key
range into `num_segments` pieces; each writes a partial (max, sum of exps, unnormalized
output) and `_reduce_segments_kernel` merges them. It pays off when few requests with long
contexts would otherwise leave most SMs idle. The cache layout and metadata are those of
`pagoda.attention.metadata`; FP8/INT8 caches are dequantized with per-layer scales on load.
Pure decode steps of the common shapes go to a CUDA kernel instead
(`pagoda.attention.cuda.paged_decode`, 1.1-1.9x faster on the H200); this kernel stays their
reference and the path for everything else.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagoda.attention.cuda import paged_decode as cuda_decode
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.triton.common import cache_quant_mode, scale_tensor
from pagoda.kernels import pdl_enabled
from pagoda.kernels.triton_pdl import dependent_start

# Programs that keep an H200 (132 SMs) busy: below this many (request, KV head) pairs in a
# pure-decode step, the split-KV path spreads each request's keys over several programs.
_MIN_PROGRAMS_FOR_NO_SPLIT = 256
DEFAULT_NUM_SEGMENTS = 16
# Decode tile (tokens) over a quantized cache: its bytes per token are half of bf16's, so it
# takes a longer tile than bf16's 64 for as many bytes in flight (`gpu_kernels.py --sweep`).
_QUANT_DECODE_TILE = 128
# ... in programs of two warps: 210 vs 226 µs at 256 x 1024 tokens (e4m3, H200 sweep).
_QUANT_DECODE_WARPS = 2
# The KV heads of a q block launched side by side: they read neighbouring bytes of the same
# cache blocks at about the same time (FP8 decode 229-233 vs 231-237 us at 256 x 1024 and
# ragged contexts on an H200; the 256-request offline workload with an FP8 KV cache: 10.5k vs
# 10.3k output tokens/s).
_HEADS_FASTEST = True


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q: tl.constexpr):
    # Request b owns q blocks [query_start_loc[b] // BLOCK_Q + b, ...): an upper bound of
    # sum(cdiv(query_len, BLOCK_Q)) that needs no host sync. Binary search for the last b
    # whose first q block is <= q_block_global.
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(
    kv_cache_ptr, bt_row, j, kv_start, kv_end, offs_t, offs_d, d_ok, kv_head_off,
    stride_c_kv, stride_c_blk, stride_c_slot, BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr,
):  # fmt: skip
    """K^T [HEAD_SIZE_PADDED, TILE_SIZE] and V [TILE_SIZE, HEAD_SIZE_PADDED] of key tile j, as
    stored (tokens before kv_start or at or past kv_end read as 0, their blocks not looked up:
    a sliding window's blocks before kv_start may be freed)."""
    k_pos = j * TILE_SIZE + offs_t
    k_ok = (k_pos >= kv_start) & (k_pos < kv_end)
    # A tile may span several cache blocks: look up each token's physical block.
    blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    slot_off = blk * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_slot + kv_head_off
    k = tl.load(
        kv_cache_ptr + slot_off[None, :] + offs_d[:, None],
        mask=k_ok[None, :] & d_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        kv_cache_ptr + stride_c_kv + slot_off[:, None] + offs_d[None, :],
        mask=k_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    return k, v


@triton.jit
def _unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    q_ptr,  # [num_tokens, num_heads, head_size]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_reqs, max_blocks_per_req]
    seq_lens_ptr,  # [num_reqs]
    query_start_loc_ptr,  # [num_reqs + 1]
    k_scale_ptr,  # [1] float32 (read only when KV_QUANT)
    v_scale_ptr,
    segm_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_SIZE_PADDED] float32
    segm_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] float32 (log2 domain)
    segm_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] float32
    qk_scale,  # softmax scale * log2(e): exp2 is the cheap exponential on the GPU
    num_reqs,
    sliding_window,  # USE_WINDOW: a query at position p sees keys (p - sliding_window, p]
    soft_cap,  # USE_SOFT_CAP: scores s become soft_cap * tanh(s / soft_cap) (Gemma 2)
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_c_kv: tl.int64,
    stride_c_blk: tl.int64,
    stride_c_slot: tl.int64,
    stride_c_head: tl.int64,
    stride_bt: tl.int64,
    NUM_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    KV_QUANT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    if HEADS_FASTEST:
        kv_head = tl.program_id(0)
        q_block_global = tl.program_id(1)
    else:
        q_block_global = tl.program_id(0)
        kv_head = tl.program_id(1)
    segm = tl.program_id(2)

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
    if q_block_local * BLOCK_Q >= q_len:
        return  # a spare program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    # Row m is query token m // G of the block, query head m % G of this KV head's group.
    q_row = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    # BLOCK_M may exceed BLOCK_Q * G when G is not a power of two; those rows belong to the
    # next q block's program.
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_row < q_len)
    d_ok = offs_d < HEAD_SIZE
    tok = (q_start + q_row).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP16_DOTS:
        q = q.to(tl.float16)
    q_pos = context_len + q_row  # absolute position: attends to keys 0 ..= q_pos

    # Keys any row of this block can see (exclusive end), in tiles.
    kv_end = context_len + tl.minimum(q_len, (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_SIZE)
    kv_start = 0
    if USE_WINDOW:
        # Keys before the block's first row's window are never read (the KV cache manager may
        # have freed their blocks), nor are the tiles wholly before it.
        kv_start = tl.maximum(context_len + q_block_local * BLOCK_Q - sliding_window + 1, 0)
    first_tile = kv_start // TILE_SIZE
    if IS_SPLIT:
        # Segments cut the request's key range from its first tile to its end.
        tiles_per_segm = tl.cdiv(tl.cdiv(seq_len, TILE_SIZE) - first_tile, NUM_SEGMENTS)
        tile_lo = first_tile + segm * tiles_per_segm
        tile_hi = tl.minimum(tile_lo + tiles_per_segm, num_tiles)
    else:
        tile_lo = first_tile
        tile_hi = num_tiles

    # A quantized cache's per-layer scales are applied outside the loop (the K scale with
    # the softmax scale, the V scale to the output), so a tile only converts its values.
    if KV_QUANT:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    bt_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_c_head

    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE_SIZE + offs_t
        k_ok = k_pos < kv_end
        k, v = _load_kv_tile(
            kv_cache_ptr, bt_row, j, kv_start, kv_end, offs_t, offs_d, d_ok, kv_head_off,
            stride_c_kv, stride_c_blk, stride_c_slot, BLOCK_SIZE, TILE_SIZE,
        )  # fmt: skip
        # Exact for int8, fp8 and the model dtype itself. fp8 -> fp16 is one instruction per
        # pair of values; fp8 -> bf16 goes through fp32 and made the fp8 cache slower than bf16.
        # (Converting by bit moves, fp8 tensor-core dots, K loaded row-wise and V converted as
        # byte pairs in registers were all measured no faster on the H200: benchmarks/README.)
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_SIZE]
        if USE_SOFT_CAP:
            # cap * tanh(s / cap) on the natural-log scores, tanh(x) = 2 sigmoid(2x) - 1.
            x = s * 0.6931471805599453 / soft_cap  # ln(2): back to natural log
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * x) - 1.0) * 1.4426950408889634
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_QUANT:
        acc = acc * tl.load(v_scale_ptr)
    if IS_SPLIT:
        # Partials (also for empty segments: max -inf, sum 0) for the reduce kernel.
        row_off = (tok * NUM_HEADS + head) * NUM_SEGMENTS + segm
        tl.store(segm_max_ptr + row_off, m_i, mask=row_ok)
        tl.store(segm_sum_ptr + row_off, l_i, mask=row_ok)
        tl.store(
            segm_out_ptr + row_off[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _reduce_segments_kernel(
    out_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    PDL: tl.constexpr,  # `pdl_enabled`: launched as a programmatic dependent (`triton_pdl`)
):
    dependent_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    row_off = (tok * NUM_HEADS + head) * NUM_SEGMENTS + offs_s
    m = tl.load(segm_max_ptr + row_off)
    m_all = tl.max(m, axis=0)  # finite: each row sees its own key, in some segment
    w = tl.exp2(m - m_all)  # empty segments (-inf) weigh 0
    denom = tl.sum(tl.load(segm_sum_ptr + row_off) * w, axis=0)
    acc = tl.load(segm_out_ptr + row_off[:, None] * HEAD_SIZE_PADDED + offs_d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


def _cuda_decode_kernel(
    choice: bool | None,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    md: AttentionMetadata,
):
    """The compiled CUDA decode kernel this step takes (see `unified_attention`), or None."""
    if choice is False:
        return None
    reason = cuda_decode.unsupported_reason(q, kv_cache, out, md)
    kernel = None
    if reason is None:
        group = q.shape[1] // kv_cache.shape[3]
        cache = cuda_decode.cache_kind(kv_cache.dtype)
        kernel = cuda_decode.get_kernel(group, kv_cache.shape[2], cache, q.dtype == torch.bfloat16)
        reason = "the kernel did not compile" if kernel is None else None
    if choice and kernel is None:
        raise ValueError(f"the CUDA decode kernel cannot take this step: {reason}")
    return kernel


@functools.cache
def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def use_split_kv(num_reqs: int, num_kv_heads: int, max_query_len: int) -> bool:
    """Whether a step should take the split-KV path: a pure-decode step with too few
    (request, KV head) programs to fill the GPU. Depends on host values only, so a captured
    CUDA graph keeps its choice (both paths are correct for any lengths)."""
    return max_query_len == 1 and num_reqs * num_kv_heads < _MIN_PROGRAMS_FOR_NO_SPLIT


def unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    split_kv: bool | None = None,
    num_segments: int = DEFAULT_NUM_SEGMENTS,
    block_m: int | None = None,
    tile_size: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_fastest: bool | None = None,
    cuda_decode_kernel: bool | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of q over the paged cache (which already holds this step's K/V).

    q, out: [num_tokens, num_heads, head_size] (last dim contiguous); kv_cache:
    [2, num_blocks, block_size, num_kv_heads, head_size]; `attn_metadata` gives the batch
    (`query_start_loc`, `seq_lens`, `block_tables`, `max_query_len`, `num_actual_tokens`).
    Rows past `num_actual_tokens` are left untouched. `split_kv=None` picks the path with
    `use_split_kv`; `block_m` / `tile_size` override the tile shapes (powers of two, >= 16),
    `num_warps` / `num_stages` Triton's launch settings; `heads_fastest` launches the KV heads
    of a q block side by side (the default) or q blocks fastest. `cuda_decode_kernel`: decode
    steps take `pagoda.attention.cuda.paged_decode` where it supports them (None, the default),
    always (True: an error where it cannot) or never (False; also whenever `sliding_window` or
    `soft_cap` is set, which it does not implement). `sliding_window`: a query at position p
    sees keys (p - window, p] only; `soft_cap`: scores s become cap * tanh(s / cap) before the
    softmax. Returns `out`.
    """
    query_start_loc = attn_metadata.query_start_loc
    seq_lens = attn_metadata.seq_lens
    block_tables = attn_metadata.block_tables
    max_query_len = attn_metadata.max_query_len
    num_actual = attn_metadata.num_actual_tokens
    num_tokens, num_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, cache_head_size = kv_cache.shape
    if cache_head_size != head_size or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q [*, {num_heads}, {head_size}] does not fit kv_cache heads "
            f"[{num_kv_heads}, {cache_head_size}]: num_heads must be a multiple of num_kv_heads"
        )
    if q.stride(-1) != 1 or out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q, out and kv_cache need a contiguous last (head_size) dimension")
    num_reqs = seq_lens.shape[0]
    if num_actual == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    if block_m is None:
        # Decode rows fill G rows of a block; long query chunks want taller blocks so the
        # tensor cores see more rows per KV tile read.
        block_m = 16 if max_query_len * group <= 16 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    quant = cache_quant_mode(kv_cache.dtype)
    if tile_size is None:
        # Decode reads are bandwidth-bound: 64-token tiles keep more loads in flight (measured
        # on the H200 at 256 x 512-1024 contexts: 2.4 -> 3.65-4.0 TB/s of KV read).
        tile_size = (
            _QUANT_DECODE_TILE
            if quant and max_query_len == 1
            else (64 if max_query_len == 1 else 32)
        )
    for name, value in (("block_m", block_m), ("tile_size", tile_size)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot tiles), got {value}")
    head_size_padded = max(16, triton.next_power_of_2(head_size))
    if split_kv is None:
        split_kv = use_split_kv(num_reqs, num_kv_heads, max_query_len)
    num_segments = max(2, triton.next_power_of_2(num_segments)) if split_kv else 1
    # Upper bound of sum(cdiv(query_len_b, BLOCK_Q)) over requests; spare programs exit.
    num_q_blocks = num_actual // block_q + num_reqs
    dev = q.device
    k_scale_t = scale_tensor(k_scale, dev)
    v_scale_t = scale_tensor(v_scale, dev)
    if quant and (k_scale_t is None or v_scale_t is None):
        raise ValueError(f"a {kv_cache.dtype} kv_cache needs k_scale and v_scale")
    if split_kv:
        segm_out = torch.empty(
            num_actual, num_heads, num_segments, head_size_padded, dtype=torch.float32, device=dev
        )
        segm_max = torch.empty(num_actual, num_heads, num_segments, dtype=torch.float32, device=dev)
        segm_sum = torch.empty_like(segm_max)
    else:
        segm_out = segm_max = segm_sum = out  # unused placeholders
    sliding_window, soft_cap = sliding_window or None, soft_cap or None
    if sliding_window is not None or soft_cap is not None:
        if cuda_decode_kernel:
            raise ValueError("the CUDA decode kernel has no sliding window or soft cap")
        cuda_decode_kernel = False
    kernel = _cuda_decode_kernel(cuda_decode_kernel, q, kv_cache, out, attn_metadata)
    if kernel is not None:
        ks, vs = (k_scale_t, v_scale_t) if quant else (_ones(dev), _ones(dev))
        cuda_decode.paged_decode(
            kernel, q, kv_cache, out, attn_metadata, scale * 1.4426950408889634, ks, vs,
            num_segments,
            (segm_out, segm_max, segm_sum) if split_kv else None,
        )  # fmt: skip
    else:
        dummy = k_scale_t if k_scale_t is not None else seq_lens
        if num_warps is None and quant and max_query_len == 1:
            num_warps = _QUANT_DECODE_WARPS
        if heads_fastest is None:
            heads_fastest = _HEADS_FASTEST
        heads_fastest = heads_fastest and num_q_blocks < 65536  # grid axis 1's limit
        grid = (
            (num_kv_heads, num_q_blocks, num_segments)
            if heads_fastest
            else (num_q_blocks, num_kv_heads, num_segments)
        )
        launch = {"num_warps": num_warps, "num_stages": num_stages}
        _unified_attention_kernel[grid](
            out,
            q,
            kv_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            k_scale_t if quant else dummy,
            v_scale_t if quant else dummy,
            segm_out,
            segm_max,
            segm_sum,
            scale * 1.4426950408889634,  # log2(e)
            num_reqs,
            sliding_window or 0,
            soft_cap or 0.0,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            block_tables.stride(0),
            NUM_HEADS=num_heads,
            NUM_QUERIES_PER_KV=group,
            BLOCK_SIZE=block_size,
            TILE_SIZE=tile_size,
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            NUM_SEGMENTS=num_segments,
            IS_SPLIT=split_kv,
            KV_QUANT=bool(quant),
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            # bf16 q over a quantized cache: the dots in fp16 (q's range fits; more mantissa).
            FP16_DOTS=bool(quant) and q.dtype == torch.bfloat16,
            HEADS_FASTEST=heads_fastest,
            USE_WINDOW=sliding_window is not None,
            USE_SOFT_CAP=soft_cap is not None,
            **{k: v for k, v in launch.items() if v is not None},
        )
    if split_kv:
        _reduce_segments_kernel[(num_actual, num_heads)](
            out,
            segm_out,
            segm_max,
            segm_sum,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded,
            NUM_SEGMENTS=num_segments,
            PDL=pdl_enabled(out),
            launch_pdl=pdl_enabled(out),
        )
    return out
