"""Compile, at start-up, the kernels that steps outside the CUDA graphs launch.

Triton compiles a kernel the first time it meets a new specialization: its constexpr choices
(attention's row and KV tile sizes, split-KV or not) and integer arguments equal to 1 or
divisible by 16. Capturing the decode and mixed-step graphs compiles what they launch, but
steps with longer prompt chunks run eagerly, and so do the logits and greedy picks of batch
sizes no graph holds: without this, a server's first burst of requests paid those
compilations inside its first steps (on an H200, about half of the engine core's time in the
first seconds of a saturated run went to the Triton compiler). A few dummy eager steps of the
shapes such traffic brings - one long chunk alone, long chunks beside decodes, many requests
with short chunks - each followed by the logits and the greedy pick of every request, move
those compilations to start-up (and into Triton's on-disk cache for the next start).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.sample.sampler import greedy_argmax

if TYPE_CHECKING:
    from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DECODE_CONTEXT = 48  # tokens already in the cache of a dummy decode


def warm_up_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int):
    """Dummy steps as lists of (context_len, query_len), decodes first as the runner orders
    them: one long chunk; 1, 15 and 16 decodes beside a chunk (request counts 2, 16 and 17:
    the counts Triton specializes on); many short chunks."""
    budget = min(max_num_batched_tokens, max_model_len)
    steps = [[(0, budget)]]
    for decodes in (1, 15, 16):
        if decodes + 1 <= max_num_seqs and budget > decodes + 1:
            steps.append([(DECODE_CONTEXT, 1)] * decodes + [(0, budget - decodes)])
    many = min(max_num_seqs, 64, max(budget // 8, 1))
    if many > 1:
        steps.append([(0, budget // many)] * many)
    return steps


def warm_up_eager_kernels(runner: ModelRunner) -> float:
    """Run the `warm_up_shapes` steps through the model over the runner's KV cache (writing
    nothing: every slot is -1) and sample greedily from their logits; returns the seconds it
    took."""
    t0 = time.perf_counter()
    device, block_size = runner.device, runner.cache_config.block_size
    sc = runner.scheduler_config
    shapes = warm_up_shapes(
        sc.max_num_batched_tokens, sc.max_num_seqs, runner.model_config.max_model_len
    )
    with torch.inference_mode():
        for specs in shapes:
            seq_lens = [c + q for c, q in specs]
            width = -(-max(seq_lens) // block_size)
            md = AttentionMetadata.from_lists(
                specs, [-1] * sum(q for _, q in specs), [[0] * width for _ in specs]
            )
            md.num_decodes = sum(q == 1 for _, q in specs)
            md = _to_device(md, device)
            runner.attn_backend.prepare(md)
            n = md.num_actual_tokens
            input_ids = torch.zeros(n, dtype=torch.int64, device=device)
            positions = torch.cat([torch.arange(c, c + q, device=device) for c, q in specs])
            hidden = runner.model(input_ids, positions, runner.kv_caches, md)
            last = md.query_start_loc[1:].long() - 1
            logits = runner.model.compute_logits(hidden[last])
            greedy_argmax(logits)  # plain greedy steps pick from the logits as they come
            greedy_argmax(logits.float())  # the general sampler's float32 copy
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _to_device(md: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(md, name, getattr(md, name).to(device))
    return md
