"""Shared helpers of the kernel tests: random paged batches and naive torch oracles.

The oracle is deliberately the plainest code that can be right: a Python loop over requests
that gathers each request's keys and values through its block table and applies a causal
softmax in float32. Kernels and backends are compared against it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.attention.metadata import AttentionMetadata


def enable_interpreter_without_cuda() -> None:
    """Run Triton kernels on CPU tensors through the interpreter when there is no GPU. Must
    run before any module that defines a `@triton.jit` kernel is imported."""
    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    _patch_interpreter_scalar_index()


def _patch_interpreter_scalar_index() -> None:
    # The interpreter holds scalars as 1-element arrays and turns them into loop bounds with
    # int(array), which NumPy >= 2.4 refuses for ndim > 0; `for j in range(lo, hi)` over
    # loaded values then fails. Index through .reshape(-1)[0] instead (interpreter only).
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_pagoda_index_patch", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._pagoda_index_patch = True


def assert_graph_replays_exactly(
    run: Callable[[], torch.Tensor], holds_after: Callable[[], bool] | None = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run()` once eagerly (which compiles its kernels and makes their split-K workspaces
    outside the capture), then captured in a CUDA graph and replayed twice into a zeroed
    output: the same bits as the eager call each time, and `holds_after()` true after each
    replay. Returns the graph and its output tensor, for replays on new inputs."""
    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert holds_after is None or holds_after()
    return graph, out


def build_for_sm90(script: str, *args: object) -> dict:
    """Run `script`, a real sm_90 Triton build (no GPU needed) that prints what it built as JSON
    on its last line, in a fresh interpreter without TRITON_INTERPRET; that JSON."""
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, slots of this step's tokens
    query_lens: list[int]
    context_lens: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(q + c for q, c in zip(self.query_lens, self.context_lens))

    def metadata(self, num_actual_tokens: int | None = None) -> AttentionMetadata:
        num_decodes = 0
        while num_decodes < len(self.query_lens) and self.query_lens[num_decodes] == 1:
            num_decodes += 1
        return AttentionMetadata(
            num_actual_tokens=sum(self.query_lens)
            if num_actual_tokens is None
            else num_actual_tokens,
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=self.query_start_loc.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
            num_decodes=num_decodes,
        )

    def reference(
        self,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """The oracle's output for this batch over its current cache, float32."""
        return ref_paged_attention(
            self.q,
            self.kv_cache,
            self.query_lens,
            self.seq_lens.tolist(),
            self.block_tables,
            scale,
            k_scale,
            v_scale,
            sliding_window,
            soft_cap,
        )


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """A batch whose requests own random, non-contiguous physical blocks; the cache holds
    random values everywhere (also in slots nobody owns, so stray reads show)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_req) + 1  # a padded column, like the model runner's
    block_tables = torch.zeros(len(query_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        block_tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    slots = []
    for b, (ql, ctx) in enumerate(zip(query_lens, context_lens)):
        for pos in range(ctx, ctx + ql):
            slots.append(int(block_tables[b, pos // block_size]) * block_size + pos % block_size)
    num_tokens = sum(query_lens)
    # Values drawn on the target device (GPU-sized caches are too slow to draw on a CPU).
    dgen = torch.Generator(device=device).manual_seed(seed)
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    cache = torch.randn(shape, generator=dgen, device=device, dtype=torch.float32)
    q = torch.randn(num_tokens, num_heads, head_size, generator=dgen, device=device)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    return PagedBatch(
        q=q.to(device=device, dtype=dtype),
        kv_cache=cache.to(device=device, dtype=dtype),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens=list(query_lens),
        context_lens=list(context_lens),
    )


def ref_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query rows over its paged keys, in float32; with
    `sliding_window` a query at position p sees keys (p - window, p] only, with `soft_cap`
    scores s become cap * tanh(s / cap)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for b, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(sl, device=q.device)
        blocks = block_tables[b, pos // block_size].long()
        k = kv_cache[0, blocks, pos % block_size].float() * k_scale  # [sl, kv_heads, d]
        v = kv_cache[1, blocks, pos % block_size].float() * v_scale
        k = k.repeat_interleave(group, dim=1)  # [sl, heads, d]
        v = v.repeat_interleave(group, dim=1)
        qb = q[start : start + ql].float()  # [ql, heads, d]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(sl - ql, sl, device=q.device)
        visible = pos[None, :] <= q_pos[:, None]  # [ql, sl]
        if sliding_window:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += ql
    return out


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter key/value rows to their slots; quantized caches store clamp(x / scale)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blk, off = slots // block_size, slots % block_size
    for i, (x, s) in enumerate(((key, k_scale), (value, v_scale))):
        x = x[keep].float()
        if kv_cache.dtype == torch.int8:
            x = torch.round(x / s).clamp(-128, 127)
        elif kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            info = torch.finfo(kv_cache.dtype)
            x = (x / s).clamp(info.min, info.max)
        kv_cache[i, blk, off] = x.to(kv_cache.dtype)
