"""Layer-wise calibration passes for sequential quantization (GPTQ, AWQ): the activations that
enter each decoder layer, computed once per layer instead of once per layer from the embeddings.

`LayerwiseCalibration` embeds the calibration sequences and keeps, per sequence, the residual
stream entering the current decoder layer. The quantizer runs that layer on it with its hooks
(`forward`), quantizes it in place, and `advance` runs the quantized layer once more to get the
next layer's inputs: O(layers) layer forwards where a pass through the whole model per layer
costs O(layers^2). The embedding and each layer call are the model's own: its decoder
(`model.model`) embeds (`embed`: Gemma's scaled embeddings, Granite's multiplied ones) and calls
a layer (`run_layer`: Llama's layers take and return (hidden_states, residual), Gemma's the
hidden states alone) as its forward does, on a one-sequence prefill from position 0
(positions 0..n-1, a paged KV cache of 16-token blocks in a fixed shuffled order, the matching
attention metadata), so every layer sees bit for bit the activations of a full-model pass over
the same paged cache (the tests compare it, and the checkpoints written on it, with such
passes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pagoda.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagoda.model.models.llama import ResidualStream

BLOCK_SIZE = 16  # tokens per KV cache block of each calibration sequence's cache


@dataclass
class _Sequence:
    positions: torch.Tensor  # [n]
    attn_metadata: AttentionMetadata
    kv_cache: torch.Tensor  # [2, blocks, BLOCK_SIZE, kv heads, head dim], reused by each layer
    stream: ResidualStream  # entering the current layer, as the decoder's `run_layer` takes it


def _paged_sequence(n: int, kv_shape: tuple[int, int], dtype: torch.dtype) -> _Sequence:
    """Positions, metadata and cache of a prefill of n tokens from position 0: ceil(n / 16) + 1
    blocks, the block table a seed-0 permutation of blocks 1.. (the stream filled in by the
    caller)."""
    num_blocks = -(-n // BLOCK_SIZE) + 1
    g = torch.Generator().manual_seed(0)
    bt = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    pos = torch.arange(n)
    slots = bt[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    md = AttentionMetadata(
        num_actual_tokens=n,
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=bt[None],
        max_query_len=n,
        max_seq_len=n,
    )
    cache = torch.zeros((2, num_blocks, BLOCK_SIZE, *kv_shape), dtype=dtype)
    return _Sequence(pos, md, cache, ())


class Calibration(Protocol):
    """What a quantizer drives: `layers[index]` is the layer whose inputs are held, `forward`
    runs it on them (the caller's hooks see its activations), `advance` moves to the next."""

    layers: nn.ModuleList
    index: int

    def forward(self) -> None: ...

    def advance(self) -> None: ...


class LayerwiseCalibration:
    """The inputs of one decoder layer at a time of a Pagoda decoder model (`model.model` with
    `layers`, `embed` and `run_layer`, as `LlamaModel` and `GemmaModel` have them) over
    calibration token sequences, one prefill per sequence from position 0.

        calib = LayerwiseCalibration(model, sequences)
        for i, layer in enumerate(calib.layers):
            calib.forward()  # layer i on its inputs: the caller's hooks see its activations
            ...  # quantize layer i in place
            calib.advance()  # the quantized layer i's outputs become layer i+1's inputs
    """

    def __init__(self, model: nn.Module, sequences: Iterable[list[int]]) -> None:
        inner = getattr(model, "model", None)
        if not all(hasattr(inner, a) for a in ("layers", "embed", "run_layer")):
            raise ValueError(
                "layer-wise calibration needs a decoder with `layers`, `embed` and `run_layer` "
                f"(as LlamaModel's), not {type(model).__name__}"
            )
        self._decoder = inner
        self.layers: nn.ModuleList = inner.layers
        self.index = 0  # the layer whose inputs are held
        attn = self.layers[0].self_attn
        kv_shape = (attn.num_kv_heads, attn.head_dim)
        dtype = next(model.parameters()).dtype
        self._sequences: list[_Sequence] = []
        with torch.inference_mode():
            for seq in sequences:
                s = _paged_sequence(len(seq), kv_shape, dtype)
                s.stream = inner.embed(torch.tensor(seq))
                self._sequences.append(s)

    def _run(self, keep: bool) -> None:
        layer = self.layers[self.index]
        with torch.inference_mode():
            for s in self._sequences:
                # Copies: the fused CPU RMSNorm writes into its input and the residual.
                stream = tuple(None if t is None else t.clone() for t in s.stream)
                s.kv_cache.zero_()  # as a fresh cache's (the layer fills its slots first)
                out = self._decoder.run_layer(
                    layer, s.positions, stream, s.kv_cache, s.attn_metadata
                )
                if keep:
                    s.stream = out

    def forward(self) -> None:
        """Run the current layer on its inputs, keeping them (for the caller's hooks)."""
        self._run(keep=False)

    def advance(self) -> None:
        """Replace the held inputs by the current layer's outputs: the next layer's inputs. The
        last layer's outputs are not computed (nothing reads them)."""
        if self.index + 1 < len(self.layers):
            self._run(keep=True)
        else:
            self._sequences.clear()
        self.index += 1
