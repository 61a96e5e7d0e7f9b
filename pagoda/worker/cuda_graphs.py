"""CUDA graphs for pure-decode steps: capture once per batch-size bucket, replay every step.

A decode step of a large model is ~1,000 kernel launches; launching them from Python costs
more than the GPU needs to run them at small batches. `CUDAGraphRunner` captures the model's
forward (not the logits or the sampler) once for each batch size in `cuda_graph_capture_sizes`
(vLLM's buckets: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs, at most 512), over the
`InputBuilder`'s persistent device buffers, and a step replays the graph of the smallest bucket
that holds its batch: the builder pads the batch to that size (padded rows write no KV and
attend to one token of the null block 0). The graphs are captured from the largest bucket down
into one shared memory pool, so the smaller ones reuse the largest one's activations. What a
graph bakes in must not change between replays: tensor addresses (the buffers are allocated
once; `InputBuilder.generation` tells when they were not), shapes, and host-side choices made
at launch (the attention metadata of a captured step therefore carries no CPU copies, and its
`max_seq_len` is max_model_len). The Triton attention kernel fits that: its grid is an upper
bound computed from host values fixed per bucket, and it finds each program's request in the
device-side `query_start_loc` (see `pagoda.attention.triton.unified_attention`).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.worker.input_batch import InputBuilder

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512

# forward(input_ids, positions, attn_metadata) -> hidden states [batch_size, hidden_size]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Graph(Protocol):
    def replay(self) -> None: ...


# capture(fn) -> (graph, output of fn as captured: the tensor a replay refills)
CaptureFn = Callable[[Callable[[], torch.Tensor]], tuple[Graph, torch.Tensor]]


def cuda_graph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then multiples of 8, up to
    min(max_num_seqs, max_num_batched_tokens, 512), which is always included."""
    cap = min(max_num_seqs, max_num_batched_tokens, MAX_CAPTURE_SIZE)
    if cap < 1:
        return []
    sizes = [s for s in (1, 2, 4, *range(8, cap + 1, 8)) if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_batch_size(num_reqs: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= num_reqs (sizes ascending), or None if none is."""
    i = bisect.bisect_left(capture_sizes, num_reqs)
    return capture_sizes[i] if i < len(capture_sizes) and num_reqs > 0 else None


def torch_cuda_capture(pool: object) -> CaptureFn:
    """Capture into `pool` (a `torch.cuda.graph_pool_handle()`) with torch.cuda.CUDAGraph."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    return capture


class CUDAGraphRunner:
    """Decode graphs over an `InputBuilder`'s device buffers.

    `capture()` once the KV cache exists (its address is baked in); then each step asks
    `padded_size(num_reqs)` (the builder pads the step to it) and calls `replay(size)`, which
    returns the captured output tensor: valid until the next replay.
    """

    def __init__(
        self,
        forward: ForwardFn,
        inputs: InputBuilder,
        capture_sizes: Sequence[int],
        max_seq_len: int,
        capture_fn: CaptureFn | None = None,
        num_warmups: int = 1,
    ) -> None:
        if list(capture_sizes) != sorted(set(capture_sizes)) or not capture_sizes:
            raise ValueError(f"capture_sizes must be ascending and unique, got {capture_sizes}")
        if capture_sizes[-1] > min(inputs.max_num_reqs, inputs.max_num_tokens):
            raise ValueError(
                f"CUDA graph batch size {capture_sizes[-1]} exceeds the input buffers "
                f"({inputs.max_num_reqs} requests, {inputs.max_num_tokens} tokens)"
            )
        self.forward = forward
        self.inputs = inputs
        self.capture_sizes = list(capture_sizes)
        self.max_seq_len = max_seq_len
        self.num_warmups = num_warmups
        self._capture_fn = capture_fn
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self._generation: int | None = None
        self.memory_bytes = 0  # device memory the capture took (CUDA only)

    @property
    def captured(self) -> bool:
        return bool(self.graphs) and self._generation == self.inputs.generation

    def padded_size(self, num_reqs: int) -> int | None:
        """The graph batch size a pure-decode step of num_reqs requests runs at, or None
        (run eagerly: too large, or the input buffers were reallocated since capture)."""
        if not self.captured:
            return None
        return padded_batch_size(num_reqs, self.capture_sizes)

    def replay(self, batch_size: int) -> torch.Tensor:
        """Run the graph of `batch_size` on the inputs the builder just wrote;
        -> hidden states [batch_size, hidden_size] (a static tensor, overwritten next time)."""
        graph, out = self.graphs[batch_size]
        graph.replay()
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first. Each size runs `num_warmups` eager forwards
        first: Triton compiles a kernel on its first launch, which a capture cannot contain."""
        capture_fn = self._capture_fn
        on_cuda = capture_fn is None
        if on_cuda:
            capture_fn = torch_cuda_capture(torch.cuda.graph_pool_handle())
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        self.graphs.clear()
        for size in reversed(self.capture_sizes):
            self.inputs.prepare_padding_only(size)
            md = self.inputs.decode_metadata(size, self.max_seq_len)
            input_ids = self.inputs.input_ids.dev[:size]
            positions = self.inputs.positions.dev[:size]

            def run(md=md, input_ids=input_ids, positions=positions) -> torch.Tensor:
                return self.forward(input_ids, positions, md)

            for _ in range(self.num_warmups):
                run()
            self.graphs[size] = capture_fn(run)
        self._generation = self.inputs.generation
        if on_cuda:
            torch.cuda.synchronize()
            self.memory_bytes = max(free_before - torch.cuda.mem_get_info()[0], 0)
        logger.info(
            "Captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, %.2f GiB",
            len(self.graphs),
            self.capture_sizes[0],
            self.capture_sizes[-1],
            time.perf_counter() - start,
            self.memory_bytes / 2**30,
        )
