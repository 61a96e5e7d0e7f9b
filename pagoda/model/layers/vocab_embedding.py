"""Token embeddings and the LM head, split along the vocabulary across tensor-parallel ranks.

Rank r holds rows [r * V/tp, (r + 1) * V/tp); an embedding lookup zeroes the ids other ranks own
and sums over ranks; the LM head gathers each rank's slice of the logits.
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
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_size > 1:
            if loaded_weight.shape[0] != self.num_embeddings:
                copy_checked(param.data, loaded_weight)  # raises with the shapes
            loaded_weight = loaded_weight.narrow(
                0, self.vocab_start, self.num_embeddings_per_partition
            )
        copy_checked(param.data, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares `weight` with the embedding when the model ties them."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        return tensor_model_parallel_all_gather(logits, dim=-1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits")
