"""Triton "skinny GEMM" for decode batches of 2..128 rows on CUDA:
y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation.

At M <= ~128 rows a linear layer is still weight streaming (Llama-3-8B's decode GEMMs need
~2.3 ms of tensor-core time at M = 128 against ~3.1 ms to read their 15 GB once at 4.8 TB/s),
so the kernel is laid out for bandwidth, not for reuse. Swap-AB: each program computes
acc[BLOCK_N, BLOCK_M] = W_tile[BLOCK_N, BLOCK_K] @ x_tile[BLOCK_M, BLOCK_K]^T, so the weight
rows fill the MMA's 64-row M side and the few activation rows its N side (wgmma takes N = 16,
32, ...), both operands K-contiguous. Weight loads are pipelined over K and marked
evict_first (read once, as in gemv.py). Shapes with few N tiles (qkv, o, down: 32..96 tiles
for 132 SMs) also split K: each split writes its fp32 partial tile to a workspace
[SPLIT_K, M, N] and bumps a per-N-tile counter; the split that arrives last sums the partials
in split order (the same bits on every call), adds the bias, stores y and puts the counter
back to 0 for the next call or CUDA-graph replay. One kernel launch, no reduce kernel.

The counters are a persistent zero-filled int32 buffer per device, made outside CUDA-graph
capture (`prepare(device)`, or the first call). Launches that share it must not run
concurrently (two streams at once): they would mix their counts.
`F.linear` stays the reference (tests compare them).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MIN_ROWS, MAX_ROWS = 2, 128
# Counters per device: one per N tile of a split launch (lm_head 128256 / 32 = 4008 tiles).
MAX_SPLIT_TILES = 8192
# Shared memory of an sm_90 SM that one program may take.
SMEM_BUDGET = 227 * 1024

_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_x: tl.int64,
    stride_w: tl.int64,
    stride_y: tl.int64,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    # k_per_split is a multiple of BLOCK_K: only the last split's last block can be ragged.
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok[:, None]
        else:
            w_mask = n_ok[:, None] & (kk < K)[None, :]
            x_mask = m_ok[:, None] & (kk < K)[None, :]
        # Weights are read once: do not let them evict what the next kernels reuse.
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_rows + kk[None, :], mask=x_mask, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]

    store_tile(
        acc, y_ptr, bias_ptr, partial_ptr, counter_ptr + pid_n, offs_m, offs_n, m_ok, n_ok,
        M, N, stride_y, pid_k, split_k, HAS_BIAS, SPLIT,
    )  # fmt: skip


@triton.jit
def sum_splits(partial_ptr, tile, mask, split_size, split_k, total):
    """`total` plus the partial tiles partial[s, tile] of splits s = 0 .. split_k - 1 in split
    order (the same bits every call), the loads of four splits in flight at once: one split at
    a time, the last program to arrive waited a load latency per split (8-16 splits for the
    few-row kernels)."""
    for s0 in range(0, split_k, 4):
        at = partial_ptr + s0 * split_size + tile
        p0 = tl.load(at, mask=mask, other=0, cache_modifier=".cg")
        p1 = tl.load(at + split_size, mask=mask & (s0 + 1 < split_k), other=0, cache_modifier=".cg")
        p2 = tl.load(
            at + 2 * split_size, mask=mask & (s0 + 2 < split_k), other=0, cache_modifier=".cg"
        )
        p3 = tl.load(
            at + 3 * split_size, mask=mask & (s0 + 3 < split_k), other=0, cache_modifier=".cg"
        )
        total += p0
        if s0 + 1 < split_k:
            total += p1
        if s0 + 2 < split_k:
            total += p2
        if s0 + 3 < split_k:
            total += p3
    return total


@triton.jit
def store_tile(
    acc, y_ptr, bias_ptr, partial_ptr, counter, offs_m, offs_n, m_ok, n_ok,
    M, N, stride_y, pid_k, split_k, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Store a program's fp32 tile acc [BLOCK_N, BLOCK_M] (weight rows x activation rows) as
    y[m, n] (+ bias). Split over K: write the partial to partial[split, m, n], count the
    arrival at this tile's `counter`; the last split to arrive sums all partials in split order
    (the same bits every call), stores y and puts the counter back to 0 (next launch, graph
    replay). Shared by the skinny GEMM and the W4A16 kernel."""
    out_mask = n_ok[:, None] & m_ok[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_y + offs_n[:, None]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        split_size = M.to(tl.int64) * N
        tl.store(partial_ptr + pid_k * split_size + tile, acc, mask=out_mask)
        # Every thread's partial store is ordered before the one thread's release below.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = sum_splits(partial_ptr, tile, out_mask, split_size, split_k, tl.zeros_like(acc))
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(counter, 0)


def block_m_for(m: int) -> int:
    """The activation-row tile: the next power of two >= m, at least 16 (the MMA's minimum)."""
    return max(16, triton.next_power_of_2(m))


def default_config(
    m: int, n: int, k: int, num_sms: int = 132, *, elem_bytes: int = 2
) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, split_k, num_warps, num_stages) for an [m, k] x [n, k]^T product:
    the fastest settings of an H200 sweep (`python benchmarks/gemm_sweep.py --quick`) for the
    Llama-3-8B shapes, as a rule by shape class. Few N tiles did not need split-K (qkv's 96 and o's 64 programs ran
    fastest unsplit, 256-wide K blocks); only the deep down projection (K = 3.5 N) gains
    from it. `num_sms` is kept for other GPUs' rules."""
    del num_sms
    block_m = block_m_for(m)
    wide_k = 512 // elem_bytes  # 256 for 16-bit inputs
    if k >= 2 * n:  # down: 64 N tiles over a long K
        if m <= 16:
            cfg = (64, 128, 4, 4, 3)
        else:
            cfg = (64, wide_k, 2, 4, 4) if block_m <= 32 else (64, 128, 2, 4, 4)
    elif n >= 16384:  # gate_up, lm_head: enough N tiles, 128-row weight tiles
        cfg = (128, 128, 1, 4, 4)
    else:
        cfg = (64, wide_k, 1, 4, 4) if block_m <= 32 else (64, 128, 1, 4, 4)
    block_n, block_k, split_k, num_warps, num_stages = cfg
    # Taller row tiles (past the measured rows): fewer stages, within shared memory.
    stage_bytes = (block_n + block_m) * block_k * elem_bytes
    num_stages = max(2, min(num_stages, SMEM_BUDGET // stage_bytes))
    return block_n, block_k, split_k_plan(k, block_k, split_k)[1], num_warps, num_stages


def preferred(m: int, n: int, k: int) -> bool:
    """Whether `skinny_linear` beat cuBLAS and cuBLASLt in the H200 sweep for this product
    (cold weights, CUDA graphs): up to 32 rows for every Llama-3-8B shape (e.g. 16 rows:
    qkv 15.7 vs 16.5 us, o 11.5 vs 13.5, gate_up 58.4 vs 63.4, down 32.3 vs 34.5), and up to
    64 rows for the wide ones (gate_up 62.0 vs 62.9; lm_head 257 vs 286). Past that cuBLAS
    wins or ties."""
    return MIN_ROWS <= m <= 32 or (m <= 64 and n >= 16384)


def check_tiles(split_k: int, **blocks: int) -> None:
    """The tile sizes a Triton GEMM here is given: each block a power of two >= 16 (what
    tl.dot takes), split_k >= 1."""
    for name, value in blocks.items():
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")


def split_k_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(k_per_split, splits): K cut into `split_k` ranges of whole BLOCK_K blocks, the last
    one shorter when they do not divide; fewer splits when some would be empty."""
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: shape the tiles as on an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def prepare(device: torch.device | str) -> torch.Tensor:
    """The split-K tile counters of `device` (zero-filled int32 [MAX_SPLIT_TILES]), made on
    first use. Call it before capturing a CUDA graph that runs `skinny_linear`: the buffer
    cannot be allocated inside a capture."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "skinny_linear's split-K counters must exist before CUDA graph capture: "
                f"call pagoda.kernels.skinny_gemm.prepare({str(device)!r}) (or run one "
                "eager step) before capturing"
            )
        counters = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def split_k_buffers(y: torch.Tensor, tiles: int, split_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counters, partials) of a launch of `tiles` output tiles whose K is split `split_k`
    ways into the output y [M, N]: the device's tile counters (`prepare`) and fp32 partial sums
    [split_k, M, N]; without a split, y twice (placeholders the kernel does not touch). Raises
    ValueError when the tiles outnumber the counters."""
    if split_k == 1:
        return y, y
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(
            f"split_k > 1 takes one counter per output tile: {tiles} tiles exceed "
            f"{MAX_SPLIT_TILES}; use larger blocks or split_k=1"
        )
    m, n = y.shape
    return prepare(y.device), torch.empty((split_k, m, n), dtype=torch.float32, device=y.device)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """2..128 rows of K-contiguous x [M, K] times a row-major weight [N, K] of x's dtype
    (fp16, bf16, fp32), K a multiple of 8, on one device. Which device runs Triton is the
    caller's choice (`pagoda.kernels.few_rows_linear` calls this for CUDA tensors only)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and weight.device == x.device
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % 8 == 0
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (
            bias is None
            or (
                bias.shape == (weight.shape[0],)
                and bias.dtype == x.dtype
                and bias.device == x.device
                and bias.is_contiguous()
            )
        )
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] in x's dtype, for 2 <= M <= 128; None
    where `skinny_supported` says no (the caller then runs F.linear). Config values left None
    come from `default_config`; split_k is rounded so every split has whole BLOCK_K blocks."""
    if not skinny_supported(x, weight, bias):
        return None
    m, k = x.shape
    n = weight.shape[0]
    cfg = default_config(m, n, k, _num_sms(x.device), elem_bytes=x.element_size())
    block_n = block_n or cfg[0]
    block_k = block_k or cfg[1]
    split_k = split_k or cfg[2]
    check_tiles(split_k, block_n=block_n, block_k=block_k)
    k_per_split, split_k = split_k_plan(k, block_k, split_k)
    tiles = triton.cdiv(n, block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    counters, partials = split_k_buffers(y, tiles, split_k)
    _skinny_gemm_kernel[(tiles, split_k)](
        x,
        weight,
        bias if bias is not None else x,
        y,
        partials,
        counters,
        m,
        n,
        k,
        k_per_split,
        split_k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        SPLIT=split_k > 1,
        BLOCK_M=block_m_for(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=num_stages or cfg[4],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg[3],
    )
    return y
