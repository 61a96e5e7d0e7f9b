"""Mixture-of-experts decoders: Mixtral (Jiang et al. 2024, arXiv:2401.04088), Qwen2-MoE
(Qwen1.5-MoE, Qwen2 technical report, arXiv:2407.10671) and Qwen3-MoE (Qwen3 technical report,
arXiv:2505.09388).

All are Llama blocks (`llama.py`: attention, norms, residual order) whose MLP is a sparse MoE
block (`pagoda.model.layers.fused_moe`), as Hugging Face reads their configs:
- Mixtral: `num_local_experts` experts of `intermediate_size`, top `num_experts_per_tok`,
  weights a softmax over the chosen logits; the config's sliding window on every layer;
- Qwen3-MoE: `num_experts` experts of `moe_intermediate_size`, top `num_experts_per_tok` of a
  softmax over all experts, renormalized when `norm_topk_prob`; q/k RMSNorm; a dense MLP of
  `intermediate_size` on the layers in `mlp_only_layers` and those off `decoder_sparse_step`;
- Qwen2-MoE: Qwen3-MoE's routing and dense layers, with Qwen2's attention (q/k/v biases unless
  `qkv_bias` is false, no q/k norm) and a shared expert on every sparse layer: a dense SwiGLU
  MLP of `shared_expert_intermediate_size` (`mlp.shared_expert`) that every token goes
  through, scaled by sigmoid(`mlp.shared_expert_gate`(x)) and added to the routed experts' sum
  (`SharedExpertMoeBlock`). The shared expert is a dense layer of the checkpoint's linear
  method (quantized in AWQ / GPTQ checkpoints), its gate a replicated one that stays dense.
Checkpoint expert tensors come per expert (`block_sparse_moe.experts.{e}.w1/w3/w2`, `mlp.experts.
{e}.gate_proj/up_proj/down_proj`; a GGUF file's stacked `ffn_*_exps` are yielded so) or fused
over experts (transformers 5's `mlp.experts.gate_up_proj` / `down_proj`);
`map_checkpoint_name` sends each to its stacked parameter. Quantized experts (an AWQ / GPTQ
checkpoint's packed tensors, `...experts.{e}.w1.qweight` in vLLM's names; a GGUF file's blocks
where they stay quantized) go to that expert's own linear layers instead
(`mlp.experts.{e}.gate_up_proj` / `down_proj`), which either run as they are or are dequantized
into the stacked parameters once loaded (`pagoda.model.layers.fused_moe` says where).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagoda.model.layers.fused_moe import FusedMoE, SparseMoeBlock
from pagoda.model.layers.linear import LinearMethodBase, ReplicatedLinear, UnquantizedLinearMethod
from pagoda.model.loader.hf_config import expert_intermediate_size, num_experts
from pagoda.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagoda.model.parallel import tensor_model_parallel_all_reduce

_PER_EXPERT = re.compile(
    r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|qweight|qzeros|scales|g_idx)$"
)
_FUSED_EXPERTS = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_SHARDS = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2",
           "down_proj": "w2"}  # fmt: skip
_LAYER_SHARDS = {"w1": 0, "w3": 1, "w2": None}  # gate_up_proj's shards; down_proj has none


def is_moe_layer(cfg: dict[str, Any], layer_idx: int) -> bool:
    """Qwen2-MoE's and Qwen3-MoE's rule (Mixtral's configs have neither field: every layer is
    sparse)."""
    if layer_idx in (cfg.get("mlp_only_layers") or []):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    return num_experts(cfg) > 0 and (layer_idx + 1) % step == 0


class MoeDecoderLayer(LlamaDecoderLayer):
    routing = "softmax_topk"

    def make_mlp(
        self, cfg: dict[str, Any], layer_idx: int, linear_method: LinearMethodBase | None
    ) -> nn.Module:
        if not is_moe_layer(cfg, layer_idx):
            return LlamaMLP(cfg, linear_method)
        from pagoda.model.quantization import AWQLinearMethod, GPTQLinearMethod
        from pagoda.model.quantization.gguf import GGUFLinearMethod

        experts_method = None  # stacked dense experts: unquantized, or a dequantized GGUF's
        if isinstance(linear_method, (AWQLinearMethod, GPTQLinearMethod, GGUFLinearMethod)):
            experts_method = linear_method  # per-expert layers (`FusedMoE`)
        elif linear_method is not None and not isinstance(linear_method, UnquantizedLinearMethod):
            raise ValueError(
                f"model.layers.{layer_idx}.mlp.experts: {type(linear_method).__name__} does not "
                "cover mixture-of-experts experts (AWQ, GPTQ and GGUF checkpoints do): serve "
                "this model from one of those, or unquantized"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
        return self.sparse_block(cfg, linear_method, experts_method)

    def sparse_block(
        self,
        cfg: dict[str, Any],
        linear_method: LinearMethodBase | None,
        experts_method: LinearMethodBase | None,
    ) -> SparseMoeBlock:
        """A sparse layer's block; `experts_method` is the experts' (None: stacked dense)."""
        return SparseMoeBlock(**self.block_args(cfg), linear_method=experts_method)

    def block_args(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """`SparseMoeBlock`'s sizes and routing from the config."""
        return dict(
            num_experts=num_experts(cfg),
            top_k=int(cfg["num_experts_per_tok"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=expert_intermediate_size(cfg),
            routing=self.routing,
            renormalize=bool(cfg.get("norm_topk_prob", False)),  # as transformers reads it
        )


class MixtralDecoderLayer(MoeDecoderLayer):
    routing = "topk_softmax"


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Whether the experts load into per-expert layers (quantized) or the stacked weights.
        self.expert_layers = any(
            isinstance(m, FusedMoE) and m.quant_method is not None for m in self.modules()
        )

    @classmethod
    def flags(cls, cfg: dict[str, Any]) -> dict[str, bool]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id) for an expert or router tensor, None for the others."""
        m = _PER_EXPERT.match(name)
        if m:
            prefix, expert, proj, tensor = m.groups()
            shard = _SHARDS[proj]
            if tensor != "weight" or self.expert_layers:
                # that expert's own layer's tensor, gate / up as shard 0 / 1 of gate_up_proj
                layer = "down_proj" if shard == "w2" else "gate_up_proj"
                return f"{prefix}.mlp.experts.{expert}.{layer}.{tensor}", _LAYER_SHARDS[shard]
            param = "w2_weight" if shard == "w2" else "w13_weight"
            return f"{prefix}.mlp.experts.{param}", (int(expert), shard)
        m = _FUSED_EXPERTS.match(name)
        if m:
            prefix, proj = m.groups()
            param = "w13_weight" if proj == "gate_up_proj" else "w2_weight"
            return f"{prefix}.mlp.experts.{param}", None
        if ".block_sparse_moe." in name:  # Mixtral's router
            return name.replace(".block_sparse_moe.", ".mlp."), None
        return None


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    decoder_layer_cls = MoeDecoderLayer

    @classmethod
    def flags(cls, cfg: dict[str, Any]) -> dict[str, bool]:
        bias = bool(cfg.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE's sparse block: the routed experts plus `shared_expert`, a dense MLP that every
    token goes through, scaled per token by sigmoid(`shared_expert_gate`(x)).

    Under tensor parallelism one all-reduce a layer covers both halves, as in vLLM: the routed
    experts and the shared expert's row-parallel down_proj leave their partial sums unreduced
    (`reduce_results=False`) and the block reduces routed + scale * shared once. The scale
    comes from the replicated input, the same on every rank, so scale * allreduce(shared) =
    allreduce(scale * shared)."""

    def __init__(self, shared_expert: LlamaMLP, **block_args: Any) -> None:
        super().__init__(**block_args, reduce_results=False)
        if shared_expert.down_proj.reduce_results:
            # reduced twice it would count the shared expert tp times
            raise ValueError("the shared expert's down_proj must leave its sum unreduced")
        self.shared_expert = shared_expert
        # One output: replicated and dense, as quantized checkpoints keep it (like the router).
        self.shared_expert_gate = ReplicatedLinear(int(block_args["hidden_size"]), 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Both this rank's partial sums under tensor parallelism, unreduced.
        routed = super().forward(hidden_states)
        shared = self.shared_expert(hidden_states)
        scale = torch.sigmoid(self.shared_expert_gate(hidden_states))
        return tensor_model_parallel_all_reduce(routed + scale * shared)


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    def sparse_block(
        self,
        cfg: dict[str, Any],
        linear_method: LinearMethodBase | None,
        experts_method: LinearMethodBase | None,
    ) -> SparseMoeBlock:
        size = cfg.get("shared_expert_intermediate_size")
        if not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
            raise ValueError(
                f"shared_expert_intermediate_size must be a positive integer, got {size!r:.100}"
            )
        # transformers' Qwen2MoeMLP: gate / up / down without bias, of the shared expert's size
        shared_cfg = {**cfg, "intermediate_size": size, "mlp_bias": False}
        shared = LlamaMLP(shared_cfg, linear_method, reduce_results=False)
        return SharedExpertMoeBlock(shared, **self.block_args(cfg), linear_method=experts_method)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    decoder_layer_cls = Qwen2MoeDecoderLayer

    def __init__(self, hf_config: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        layer_types = hf_config.get("layer_types")
        listed = isinstance(layer_types, list) and len(layer_types) == int(
            hf_config["num_hidden_layers"]
        )
        if hf_config.get("use_sliding_window") and hf_config.get("sliding_window") and not listed:
            # transformers 5 slides the even layers below max_window_layers (and writes them out
            # as layer_types); the shared reading of a config without the list
            # (`layer_sliding_windows`) is Qwen2's, the layers from max_window_layers on.
            raise ValueError(
                "Qwen2-MoE config with use_sliding_window but no layer_types: which layers "
                "slide depends on the transformers version; list them in layer_types "
                '("sliding_attention" / "full_attention" per layer) or set use_sliding_window '
                "false"
            )
        super().__init__(hf_config, *args, **kwargs)

    @classmethod
    def flags(cls, cfg: dict[str, Any]) -> dict[str, bool]:
        # `qkv_bias` is transformers 5's field; the released configs lack it (biases on).
        return {"qkv_bias": bool(cfg.get("qkv_bias", True)), "o_bias": False, "qk_norm": False}
