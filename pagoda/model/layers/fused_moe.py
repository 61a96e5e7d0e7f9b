"""A sparse mixture-of-experts MLP block (Shazeer et al. 2017; Mixtral, Jiang et al. 2024): a
router picks top_k of E SwiGLU experts per token and sums their outputs weighted by the
router's probabilities.

Routing follows each family's rule (`topk_softmax`: Mixtral, a softmax over the top-k logits;
`softmax_topk`: Qwen3-MoE, top-k of the softmax over all experts, renormalized to sum 1 when
`norm_topk_prob`). Every expert's gate and up projections are stored stacked as w13
[E, 2 * I, H] (gate rows, then up rows) and its down projection as w2 [E, H, I], the layout of
vLLM and of transformers 5's fused checkpoints; the loader fills them from per-expert tensors
(Mixtral's w1/w3/w2, Qwen3-MoE's gate_proj/up_proj/down_proj) or from the fused ones.

Under tensor parallelism each rank holds a slice of every expert's intermediate dimension
(rows of gate and up, columns of down), as vLLM does: its partial outputs are summed by an
all-reduce, like a row-parallel linear layer's. On CUDA with Triton the experts run as two
grouped GEMMs (`pagoda.kernels.fused_moe`), CUDA-graph safe; elsewhere, or with `fused_ops`
off, `moe_experts_ref`'s loop over the experts in use is the reference.

Quantized experts load as per-expert linear layers (`_QuantizedExpert`: gate_up_proj, a
column-parallel layer, and down_proj, a row-parallel one, with the checkpoint's linear method):
AWQ / GPTQ checkpoints' packed tensors (`experts.{e}.gate_proj.qweight` etc.) and a GGUF file's
stacked experts kept in their blocks (`ffn_*_exps`, yielded one expert at a time). Each rank
reads only its shards, as for the dense layers: a split that would cut a packed word or an AWQ /
GPTQ group is refused by name (`quantization/tp_shards.py`), a GGUF down_proj whose rank inputs
are not whole blocks is dequantized. Once loaded (`FusedMoE.process_weights_after_loading`):
- on a CPU where the dense layers stay quantized (a GGUF file's blocks kept; AWQ / GPTQ with
  `cpu_blocks_enabled`), the per-expert layers stay: each becomes what its dense counterpart
  would (GGUF blocks, or a dense layer where it has no exact block form) and the experts run
  as the loop above, each expert's tokens through its gate_up and down layers in the quantized
  CPU GEMM (`_experts_by_layer`): the experts keep the quantized size;
- elsewhere (CUDA, `PAGODA_CPU_QUANTIZED=0`, float16) AWQ / GPTQ experts are dequantized into
  w13 / w2 in the model dtype and their layers dropped: the dense model's memory, run as above.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import triton_available
from pagoda.model.layers.activation import swiglu
from pagoda.model.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_checked,
    set_weight_attrs,
)
from pagoda.model.parallel import (
    divide,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)

logger = logging.getLogger(__name__)


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral: the top_k logits, softmaxed among themselves (float32). -> (weights, ids)."""
    logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(logits, dim=-1), ids


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE: the top_k probabilities of a softmax over all experts (float32), divided by
    their sum when `renormalize` (norm_topk_prob), then rounded to the logits' dtype as
    transformers does. -> (weights, ids)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype).float(), ids


def moe_experts_ref(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The per-expert loop (transformers' eager experts): each expert in use takes its tokens,
    runs its SwiGLU MLP, scales by the routing weights and adds into the output. Reads which
    experts are in use on the host (not CUDA-graph safe)."""
    out = torch.zeros_like(hidden_states)
    inter = w2.shape[-1]
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        x = hidden_states[token_idx]
        gate, up = F.linear(x, w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        # A token picks an expert once: its rows here are distinct, so a plain indexed add is
        # exact (no scatter with accumulation needed).
        out[token_idx] += (y * topk_weights[token_idx, slot, None]).to(out.dtype)
    return out


class _QuantizedExpert(nn.Module):
    """One expert's projections as a quantized checkpoint holds them: gate and up fused (shards
    0 and 1, the model's `packed_modules_mapping`) and down."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, linear_method: LinearMethodBase
    ) -> None:
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [inter, inter], linear_method=linear_method
        )
        # Run through its method by `FusedMoE._experts_by_layer`: the block reduces the sum.
        self.down_proj = RowParallelLinear(
            inter, hidden_size, linear_method=linear_method, reduce_results=False
        )


class FusedMoE(nn.Module):
    """The experts of one layer: w13 [E, 2 * I/tp, H] and w2 [E, H, I/tp] on each rank.

    With a quantized `linear_method` (AWQ, GPTQ, GGUF) the experts are submodules "0".."E-1"
    (`_QuantizedExpert`) instead, each holding this rank's shards; `process_weights_after_
    loading` keeps them (`expert_layers`, run by `_experts_by_layer`) or turns them into
    w13 / w2 (see the module)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype | None = None,
        linear_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.inter_per_rank = divide(intermediate_size, self.tp_size, "moe intermediate size")
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.fused_ops = True  # the Triton grouped GEMMs on CUDA, the C SiLU-and-mul on a CPU
        self.quant_method = linear_method
        self.expert_layers = linear_method is not None
        if linear_method is not None:
            for e in range(num_experts):
                self.add_module(
                    str(e), _QuantizedExpert(hidden_size, intermediate_size, linear_method)
                )
            return
        dtype, inter = self.params_dtype, self.inter_per_rank
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter, dtype=dtype), requires_grad=False
        )
        # Every (expert, shard) the checkpoint must supply (WeightLoadingState reads this).
        w13_shards = [(e, s) for e in range(num_experts) for s in ("w1", "w3")]
        set_weight_attrs(
            self.w13_weight, {"weight_loader": self.weight_loader, "shard_ids": w13_shards}
        )
        w2_shards = [(e, "w2") for e in range(num_experts)]
        set_weight_attrs(
            self.w2_weight, {"weight_loader": self.weight_loader, "shard_ids": w2_shards}
        )

    def _keeps_expert_layers(self, method: LinearMethodBase, device: torch.device) -> bool:
        """Whether loaded expert layers stay (each then processed by its own method, as a dense
        layer of the checkpoint is) rather than being dequantized into w13 / w2."""
        from pagoda.model.quantization.cpu_blocks import cpu_blocks_enabled
        from pagoda.model.quantization.gguf import GGUFLinearMethod

        if isinstance(method, GGUFLinearMethod):
            return True  # a GGUF file's blocks are kept only where they run (`load_model`)
        return cpu_blocks_enabled(device, self.params_dtype)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Quantized experts, once loaded: kept as their layers where the quantized CPU GEMM
        runs them (their linear methods then process them), else each expert's layers
        dequantized (their rank's shards, `dequantized_weight`) into w13 [E, 2 * I/tp, H] and
        w2 [E, H, I/tp] in the model dtype and dropped, one expert at a time."""
        method = self.quant_method
        if method is None:
            return
        self.quant_method = None
        first = self.get_submodule("0").gate_up_proj
        device = next(first.parameters()).device
        if self._keeps_expert_layers(method, device):
            return
        inter, hidden = self.inter_per_rank, first.input_size_per_partition
        shape13, shape2 = (self.num_experts, 2 * inter, hidden), (self.num_experts, hidden, inter)
        w13 = torch.empty(shape13, dtype=self.params_dtype, device=device)
        w2 = torch.empty(shape2, dtype=self.params_dtype, device=device)
        for e in range(self.num_experts):
            expert = self.get_submodule(str(e))
            w13[e].copy_(method.dequantized_weight(expert.gate_up_proj))
            w2[e].copy_(method.dequantized_weight(expert.down_proj))
            delattr(self, str(e))
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        self.expert_layers = False
        if not getattr(method, "_told_moe_dequantized", False):
            method._told_moe_dequantized = True  # once per model, not per layer
            logger.info(
                "%s MoE experts are dequantized to %s at load (they stay quantized only in "
                "the quantized CPU GEMM): they take the dense model's memory",
                type(method).__name__.removesuffix("LinearMethod"),
                str(self.params_dtype).removeprefix("torch."),
            )

    def _rank_slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        full = self.intermediate_size
        if t.shape[dim] != full:
            raise ValueError(f"expected {full} along dim {dim}, got shape {tuple(t.shape)}")
        return t.narrow(dim, self.tp_rank * self.inter_per_rank, self.inter_per_rank)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        """shard_id (expert, "w1" | "w3" | "w2"): one expert's gate [I, H], up [I, H] or down
        [H, I] projection; None: every expert's at once (transformers 5's gate_up_proj
        [E, 2I, H] or down_proj [E, H, I])."""
        inter = self.inter_per_rank
        if shard_id is None:
            if param is self.w2_weight:
                return copy_checked(param.data, self._rank_slice(loaded_weight, 2))
            if loaded_weight.dim() != 3 or loaded_weight.shape[1] != 2 * self.intermediate_size:
                raise ValueError(
                    f"expected gate_up_proj [{self.num_experts}, {2 * self.intermediate_size}"
                    f", H], got {tuple(loaded_weight.shape)}"
                )
            gate, up = loaded_weight.chunk(2, dim=1)
            copy_checked(param.data[:, :inter], self._rank_slice(gate, 1))
            return copy_checked(param.data[:, inter:], self._rank_slice(up, 1))
        expert, shard = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside the config's {self.num_experts}")
        if shard == "w2":
            return copy_checked(param.data[expert], self._rank_slice(loaded_weight, 1))
        rows = slice(0, inter) if shard == "w1" else slice(inter, 2 * inter)
        copy_checked(param.data[expert, rows], self._rank_slice(loaded_weight, 0))

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """[T, H] and the routing [T, top_k] -> this rank's partial sum [T, H]."""
        if self.expert_layers:
            return self._experts_by_layer(hidden_states, topk_weights, topk_ids)
        w13, w2 = self.w13_weight, self.w2_weight
        if self.fused_ops and hidden_states.is_cuda and triton_available():
            from pagoda.kernels.fused_moe import fused_experts

            return fused_experts(hidden_states, w13, w2, topk_weights, topk_ids)
        return moe_experts_ref(hidden_states, w13, w2, topk_weights, topk_ids)

    def _experts_by_layer(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """`moe_experts_ref`'s loop over the per-expert layers: the (token, slot) pairs sorted
        by expert once, each expert in use runs its tokens' rows through its layers' methods
        (the quantized CPU GEMM for GGUF blocks), and the weighted outputs are summed per
        token at the end, in float32. down_proj's partial sums are not reduced here: the
        block all-reduces the sum of the experts once."""
        num_tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // top_k  # [T * top_k] the token of each pair, in expert order
        f32 = dict(dtype=torch.float32, device=hidden_states.device)
        ys = torch.empty(flat.shape[0], hidden_states.shape[1], **f32)  # in expert order
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            x = hidden_states
            if num_tokens > 1:
                x = hidden_states.index_select(0, tokens[start:end])
            expert = self.get_submodule(str(e))
            gate_up, down = expert.gate_up_proj, expert.down_proj
            h = swiglu(gate_up.linear_method.apply(gate_up, x), self.fused_ops)
            ys[start:end] = down.linear_method.apply(down, h)
            start = end
        ys.mul_(topk_weights.reshape(-1)[order, None])
        if num_tokens == 1:  # one token: every pair is its own
            return ys.sum(0, keepdim=True).to(hidden_states.dtype)
        # A token picks an expert once; index_add_ sums its top_k rows.
        out = torch.zeros(hidden_states.shape, **f32)
        return out.index_add_(0, tokens, ys).to(hidden_states.dtype)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) + experts, with the family's routing rule; the output is
    all-reduced across tensor-parallel ranks, or left this rank's partial sum with
    `reduce_results=False` (vLLM's flag) for a subclass that adds its own partial sums first."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        routing: str,
        renormalize: bool = True,
        linear_method: LinearMethodBase | None = None,
        reduce_results: bool = True,
    ) -> None:
        """`linear_method`: the experts' AWQ / GPTQ / GGUF method (None: dense experts); the
        router stays dense, as quantized checkpoints keep it."""
        super().__init__()
        if routing not in ("topk_softmax", "softmax_topk"):
            raise ValueError(f"unknown MoE routing {routing!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..{num_experts}")
        self.top_k, self.routing, self.renormalize = top_k, routing, renormalize
        self.reduce_results = reduce_results
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts, hidden_size, intermediate_size, linear_method=linear_method
        )

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, E] logits -> (weights [T, top_k] float32, expert ids [T, top_k])."""
        if self.experts.fused_ops and router_logits.is_cuda and triton_available():
            from pagoda.kernels.moe_routing import softmax_topk_triton

            # Mixtral's softmax over the top-k logits is the renormalized top-k of the softmax.
            mixtral = self.routing == "topk_softmax"
            return softmax_topk_triton(
                router_logits, self.top_k, mixtral or self.renormalize, not mixtral
            )
        if self.routing == "topk_softmax":
            return topk_softmax(router_logits, self.top_k)
        return softmax_topk(router_logits, self.top_k, self.renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.select_experts(self.gate(hidden_states))
        out = self.experts(hidden_states, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out
