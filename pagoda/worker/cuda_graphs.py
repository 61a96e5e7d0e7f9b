"""CUDA graphs for decode steps and small mixed/prefill steps: capture once per bucket, replay.

A step of a large model is ~1,000 kernel launches; launching them from Python costs more than
the GPU needs to run them unless the step has thousands of tokens. `CUDAGraphRunner` captures
the model's forward (not the logits or the sampler) over the `InputBuilder`'s persistent device
buffers, once per bucket, into one shared memory pool (largest first, so the smaller graphs
reuse the largest one's activations), and a step replays the smallest bucket that holds it:
- **decode graphs**, one per batch size in `cuda_graph_capture_sizes` (vLLM's buckets: 1, 2, 4,
  8, 16, 24, ... up to max_num_seqs, at most 512), for steps where every request has one token;
  padded rows are one-token requests on the null block 0 that write nothing;
- **mixed graphs**, one per (token bucket, request bucket) of `mixed_graph_shapes` (tokens 16 ..
  128 doubling, then every 64 up to 512; requests 4, 16, 64, 256 up to the token bucket), for
  any other step of at most 512 tokens: prefill chunks with or without a cached prefix, decodes, speculative rows. The
  builder pads the step with empty requests and one extra request that owns the padding tokens
  (`pagoda.worker.input_batch.pad_mixed_requests`); `max_query_len` is the token bucket, so
  the attention kernel's tiling is fixed at capture and valid for any query lengths within it.
What a graph bakes in must not change between replays: tensor addresses (the buffers are
allocated once; `InputBuilder.generation` tells when they were not), shapes, and host-side
choices made at launch (the attention metadata of a captured step therefore carries no CPU
copies). The Triton attention kernel fits that: its grid is an upper bound computed from the
bucket (num_tokens // BLOCK_Q + num_reqs), it finds each program's request in the device-side
`query_start_loc`, and programs of empty requests exit at once (see
`pagoda.attention.triton.unified_attention`). Graphs are on for CUDA with the Triton backend
unless `enforce_eager`; a failed mixed capture only turns the mixed graphs off.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.worker.graph_buckets import (  # noqa: F401 - re-exported
    MAX_CAPTURE_SIZE,
    MIXED_REQ_SIZES,
    MIXED_TOKEN_SIZES,
    PER_GRAPH_OVERHEAD_BYTES,
    _buckets,
    cuda_graph_capture_sizes,
    mixed_graph_reserve_bytes,
    mixed_graph_shapes,
)

if TYPE_CHECKING:  # input_batch imports the padding functions below
    from pagoda.worker.input_batch import InputBuilder

logger = logging.getLogger(__name__)

# forward(input_ids, positions, attn_metadata) -> hidden states [num_tokens, hidden_size]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# A decode graph's batch size, or a mixed graph's (num_tokens, num_reqs) bucket.
GraphKey = int | tuple[int, int]


class Graph(Protocol):
    def replay(self) -> None: ...


# capture(fn) -> (graph, output of fn as captured: the tensor a replay refills)
CaptureFn = Callable[[Callable[[], torch.Tensor]], tuple[Graph, torch.Tensor]]


def padded_batch_size(num_reqs: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= num_reqs (sizes ascending), or None if none is."""
    i = bisect.bisect_left(capture_sizes, num_reqs)
    return capture_sizes[i] if i < len(capture_sizes) and num_reqs > 0 else None


def mixed_graph_shape(
    num_tokens: int, num_reqs: int, shapes: Sequence[tuple[int, int]]
) -> tuple[int, int] | None:
    """The smallest bucket (fewest tokens, then fewest requests) of `shapes` (ascending) that
    holds a step of num_tokens tokens over num_reqs requests, or None."""
    if num_reqs < 1:
        return None
    for t, r in shapes:
        if t >= num_tokens and r >= num_reqs:
            return t, r
    return None


def describe_mixed_shapes(shapes: Sequence[tuple[int, int]]) -> str:
    """`16x{4,16} 32x{4,16,32}`: request buckets per token bucket, for the capture log."""
    by_tokens: dict[int, list[int]] = {}
    for t, r in shapes:
        by_tokens.setdefault(t, []).append(r)
    return " ".join(f"{t}x{{{','.join(map(str, rs))}}}" for t, rs in by_tokens.items())


def pad_tokens(
    input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, start: int, end: int
) -> None:
    """Token rows [start, end) become padding: token 0 at position 0, slot -1 (not written)."""
    input_ids[start:end] = 0
    positions[start:end] = 0
    slot_mapping[start:end] = -1


def pad_mixed_requests(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    num_tokens: int,
    num_reqs: int,
    graph_tokens: int,
    graph_reqs: int,
    block_size: int,
) -> None:
    """Pad a step's request arrays (rows [0, num_reqs) written, [0, num_tokens) tokens) to a
    mixed graph of `graph_reqs` request slots plus one: slots [num_reqs, graph_reqs) become
    empty requests (no query rows, no keys: their attention programs exit at once), and slot
    `graph_reqs` owns the padding tokens [num_tokens, graph_tokens) as a fresh prompt on the
    null block 0 (never written, zeros), so every token row belongs to a request and computes
    finite values. query_start_loc then has graph_reqs + 2 entries ending at graph_tokens."""
    num_pad = graph_tokens - num_tokens
    if not (0 <= num_reqs <= graph_reqs and num_pad >= 0) or (
        -(-num_pad // block_size) > block_table.shape[1] or graph_reqs >= len(seq_lens)
    ):
        raise ValueError(
            f"a step of {num_tokens} tokens / {num_reqs} requests does not fit the mixed graph "
            f"({graph_tokens} tokens, {graph_reqs} requests) or its buffers"
        )
    query_start_loc[0] = 0  # a step with no requests (graph capture)
    query_start_loc[num_reqs + 1 : graph_reqs + 1] = num_tokens
    query_start_loc[graph_reqs + 1] = graph_tokens
    seq_lens[num_reqs:graph_reqs] = 0
    seq_lens[graph_reqs] = num_pad
    block_table[graph_reqs, : -(-num_pad // block_size)] = 0


def torch_cuda_capture(pool: object) -> CaptureFn:
    """Capture into `pool` (a `torch.cuda.graph_pool_handle()`) with torch.cuda.CUDAGraph."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    return capture


class CUDAGraphRunner:
    """Decode and mixed graphs over an `InputBuilder`'s device buffers.

    `capture()` once the KV cache exists (its address is baked in); then each step asks
    `padded_size(num_reqs)` (pure decode) or `mixed_shape(num_tokens, num_reqs)` (any other
    step), the builder pads the step to it, and `replay(key)` returns the captured output
    tensor [padded tokens, hidden_size]: valid until the next replay of any graph (they share
    one pool).
    """

    def __init__(
        self,
        forward: ForwardFn,
        inputs: InputBuilder,
        capture_sizes: Sequence[int],
        max_seq_len: int,
        capture_fn: CaptureFn | None = None,
        num_warmups: int = 1,
        mixed_shapes: Sequence[tuple[int, int]] = (),
    ) -> None:
        if list(capture_sizes) != sorted(set(capture_sizes)) or not capture_sizes:
            raise ValueError(f"capture_sizes must be ascending and unique, got {capture_sizes}")
        if capture_sizes[-1] > min(inputs.max_num_reqs, inputs.max_num_tokens):
            raise ValueError(
                f"CUDA graph batch size {capture_sizes[-1]} exceeds the input buffers "
                f"({inputs.max_num_reqs} requests, {inputs.max_num_tokens} tokens)"
            )
        mixed = [(int(t), int(r)) for t, r in mixed_shapes]
        if mixed != sorted(set(mixed)):
            raise ValueError(f"mixed_shapes must be ascending and unique, got {mixed}")
        # The request owning the padding tokens attends to up to t keys through its block
        # table row: t must fit a row (max_blocks_per_req blocks).
        max_len = inputs.max_blocks_per_req * inputs.block_size
        for t, r in mixed:
            if not (1 <= r <= min(t, inputs.max_num_reqs) and t <= inputs.max_num_tokens):
                raise ValueError(
                    f"mixed CUDA graph ({t} tokens, {r} requests) does not fit the input "
                    f"buffers ({inputs.max_num_tokens} tokens, {inputs.max_num_reqs} requests)"
                )
            if t > max_len:
                raise ValueError(f"mixed CUDA graph of {t} tokens exceeds max_model_len {max_len}")
        self.forward = forward
        self.inputs = inputs
        self.capture_sizes = list(capture_sizes)
        self.mixed_shapes = mixed  # what is captured: emptied if the mixed capture failed
        self.max_seq_len = max_seq_len
        self.num_warmups = num_warmups
        self._capture_fn = capture_fn
        self.graphs: dict[GraphKey, tuple[Graph, torch.Tensor]] = {}
        # The captured functions, to run a graph's forward eagerly on the same buffers.
        self._runs: dict[GraphKey, Callable[[], torch.Tensor]] = {}
        self._generation: int | None = None
        self.memory_bytes = 0  # device memory the capture took (CUDA only)
        self.capture_seconds = 0.0
        self.mixed_capture_error: str | None = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs) and self._generation == self.inputs.generation

    def padded_size(self, num_reqs: int) -> int | None:
        """The graph batch size a pure-decode step of num_reqs requests runs at, or None
        (run eagerly: too large, or the input buffers were reallocated since capture)."""
        if not self.captured:
            return None
        return padded_batch_size(num_reqs, self.capture_sizes)

    def mixed_shape(self, num_tokens: int, num_reqs: int) -> tuple[int, int] | None:
        """The mixed graph bucket a step that is not pure decode runs at, or None (eager)."""
        if not self.mixed_shapes or not self.captured:
            return None
        return mixed_graph_shape(num_tokens, num_reqs, self.mixed_shapes)

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run the graph of `key` on the inputs the builder just wrote;
        -> hidden states [padded tokens, hidden_size] (a static tensor, overwritten next time)."""
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def run_eagerly(self, key: GraphKey) -> torch.Tensor:
        """The forward graph `key` captured, run eagerly on the same buffers (a new tensor):
        what a replay must reproduce bit for bit."""
        return self._runs[key]()

    def _capture_one(self, key: GraphKey, md: AttentionMetadata, capture_fn: CaptureFn) -> None:
        n = key if isinstance(key, int) else key[0]
        input_ids = self.inputs.input_ids.dev[:n]
        positions = self.inputs.positions.dev[:n]

        def run(md=md, input_ids=input_ids, positions=positions) -> torch.Tensor:
            return self.forward(input_ids, positions, md)

        # Triton compiles a kernel on its first launch, which a capture cannot contain.
        for _ in range(self.num_warmups):
            run()
        self.graphs[key] = capture_fn(run)
        self._runs[key] = run

    def _capture_mixed(self, capture_fn: CaptureFn) -> None:
        for t, r in reversed(self.mixed_shapes):
            self.inputs.prepare_mixed_padding_only(t, r)
            self._capture_one(
                (t, r), self.inputs.mixed_metadata(t, r, self.max_seq_len), capture_fn
            )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first: the mixed graphs, then the decode graphs.
        A failure in the mixed ones is logged and turns them off (steps run eagerly)."""
        capture_fn = self._capture_fn
        on_cuda = capture_fn is None
        if on_cuda:
            capture_fn = torch_cuda_capture(torch.cuda.graph_pool_handle())
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        self.graphs.clear()
        self._runs.clear()
        if self.mixed_shapes:
            try:
                self._capture_mixed(capture_fn)
            except Exception as e:  # noqa: BLE001 - decode graphs and eager steps still work
                self.mixed_capture_error = f"{type(e).__name__}: {e}"
                logger.warning(
                    "Mixed-step CUDA graphs off: capture failed (%s)", self.mixed_capture_error
                )
                for key in [k for k in self.graphs if not isinstance(k, int)]:
                    del self.graphs[key], self._runs[key]
                self.mixed_shapes = []
                if on_cuda:
                    torch.cuda.synchronize()
        for size in reversed(self.capture_sizes):
            self.inputs.prepare_padding_only(size)
            md = self.inputs.decode_metadata(size, self.max_seq_len)
            self._capture_one(size, md, capture_fn)
        self._generation = self.inputs.generation
        if on_cuda:
            torch.cuda.synchronize()
            self.memory_bytes = max(free_before - torch.cuda.mem_get_info()[0], 0)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "Captured %d decode CUDA graphs (batch sizes %d..%d) and %d mixed-step graphs "
            "(tokens x requests: %s) in %.1f s, %.2f GiB",
            len(self.capture_sizes),
            self.capture_sizes[0],
            self.capture_sizes[-1],
            len(self.mixed_shapes),
            describe_mixed_shapes(self.mixed_shapes) or "none",
            self.capture_seconds,
            self.memory_bytes / 2**30,
        )
