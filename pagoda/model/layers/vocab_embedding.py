"""Token embeddings and the LM head, split along the vocabulary across tensor-parallel ranks.

Rank r holds rows [r * V/tp, (r + 1) * V/tp); an embedding lookup zeroes the ids other ranks own
and sums over ranks; the LM head gathers each rank's slice of the logits. A GGUF model kept
quantized (`quantization="gguf"`) loads the table's blocks instead (its rows of them): the parameter
then holds them as uint8 with the `QuantWeight` as its `quant` attribute (shared by a tied LM
head, which is the same parameter), a lookup dequantizes the rows it reads and the LM head
runs the quantized GEMM (`pagoda.kernels.cpu.quant`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.layers.linear import copy_checked, set_weight_attrs
from pagoda.model.parallel import (
    divide,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "vocab_size")
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        from pagoda.kernels.cpu.quant import QuantWeight

        if isinstance(loaded_weight, QuantWeight):  # GGUF blocks, kept: this rank's rows
            from pagoda.model.quantization.gguf import narrow_rows, to_kernel_layout

            expected = (self.num_embeddings, param.shape[1])
            if (loaded_weight.n, loaded_weight.k) != expected:
                raise ValueError(
                    f"shape mismatch: the model expects {expected}, "
                    f"got {(loaded_weight.n, loaded_weight.k)}"
                )
            rows = narrow_rows(loaded_weight, self.vocab_start, self.num_embeddings_per_partition)
            param.quant = to_kernel_layout(rows)
            param.data = param.quant.data
            return
        if self.tp_size > 1:
            if loaded_weight.shape[0] != self.num_embeddings:
                copy_checked(param.data, loaded_weight)  # raises with the shapes
            loaded_weight = loaded_weight.narrow(
                0, self.vocab_start, self.num_embeddings_per_partition
            )
        copy_checked(param.data, loaded_weight)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        quant = getattr(self.weight, "quant", None)
        if quant is None:
            return F.embedding(ids, self.weight)
        from pagoda.kernels.cpu.quant import dequantize_rows

        return dequantize_rows(quant, ids).to(self.params_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = self._lookup(local.masked_fill(mask, 0))
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares `weight` with the embedding when the model ties them."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        quant = getattr(self.weight, "quant", None)
        if quant is not None:  # this rank's rows of the vocabulary, float32 logits
            from pagoda.kernels.cpu.quant import quant_linear

            logits = quant_linear(hidden_states, quant, out_dtype=torch.float32)
        else:
            logits = F.linear(hidden_states, self.weight)
        return tensor_model_parallel_all_gather(logits, dim=-1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits")
