"""Tiny mixtures of experts for the MoE tests: `write_moe_gguf` writes a transformers Mixtral /
Qwen2-MoE / Qwen3-MoE as llama.cpp lays it out (the router `ffn_gate_inp`, each projection's
experts stacked in one `ffn_*_exps` tensor, Qwen2-MoE's shared expert `ffn_*_shexp` and its
gate `ffn_gate_inp_shexp`), float32 or quantized with the gguf package; `experts_of`,
`held_bytes` and `greedy` read a loaded Pagoda model; `generate_tp` runs a checkpoint through
the engine at a tensor-parallel size."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from model_testing import PagedRunner


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for the llama architecture (LlamaModel.permute)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_hparams(w: Any, c: Any, arch: str, head_dim: int, extra: dict[str, int]) -> None:
    """The transformers config `c`'s hyperparameters as `arch`'s GGUF keys (and `extra`'s)."""
    for key, value in {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": head_dim,
        **extra,
        "vocab_size": c.vocab_size,
    }.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))


def finish_gguf(w: Any) -> None:
    """Write the GGUF writer's header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_moe_gguf(
    hf, path: str, arch: str, expert_type: str | None = None, shared_gate_1d: bool = False
) -> None:
    """The model's GGUF file; with `expert_type` (a ggml type name: Q4_0, Q4_1, Q8_0) its stacked
    experts in that type and every other matrix but the router and the shared expert's gate in
    Q8_0, as llama.cpp's quantized files hold them (else float32 throughout). Qwen2-MoE's
    shared expert gate is [1, hidden] as today's converter writes it, or with `shared_gate_1d`
    [hidden], as older ones (which squeezed every tensor) wrote it."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    shared = getattr(c, "shared_expert_intermediate_size", None)
    add_hparams(w, c, arch, head_dim, {
        "expert_count": experts,
        "expert_used_count": c.num_experts_per_tok,
        "expert_feed_forward_length": getattr(c, "moe_intermediate_size", c.intermediate_size),
        **({"expert_shared_feed_forward_length": shared} if shared else {}),
    })  # fmt: skip
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp"}  # fmt: skip
    qt = gguf.GGMLQuantizationType

    def add(name: str, t: np.ndarray, ggml_type: str | None) -> None:
        # llama-quantize leaves the router and the one-row shared expert gate (1-D to ggml)
        if ggml_type is None or t.ndim < 2 or ".ffn_gate_inp" in name:
            w.add_tensor(name, np.ascontiguousarray(t))
        else:
            blocks = gguf.quants.quantize(np.ascontiguousarray(t), qt[ggml_type])
            w.add_tensor(name, blocks, raw_dtype=qt[ggml_type])

    dense = "Q8_0" if expert_type else None
    for name, t in hf.state_dict().items():
        t = t.float().numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", t, dense)
        elif name == "model.norm.weight":
            add("output_norm.weight", t, None)
        elif name == "lm_head.weight":
            add("output.weight", t, dense)
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            module, suffix = rest.rsplit(".", 1)  # weight, or bias (Qwen2-MoE's q/k/v)
            if rest.endswith("experts.gate_up_proj"):
                gate, up = np.split(t, 2, axis=1)
                add(f"blk.{layer}.ffn_gate_exps.weight", gate, expert_type)
                add(f"blk.{layer}.ffn_up_exps.weight", up, expert_type)
                continue
            if rest.endswith("experts.down_proj"):
                add(f"blk.{layer}.ffn_down_exps.weight", t, expert_type)
                continue
            if module == "mlp.shared_expert_gate" and shared_gate_1d:
                t = t.reshape(-1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
                t = _permute(t, heads)
            add(f"blk.{layer}.{names[module]}.{suffix}", t, dense)
    finish_gguf(w)


def experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `FusedMoE` of each sparse layer."""
    return [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def held_bytes(module: torch.nn.Module) -> int:
    """The bytes of the module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def greedy(
    model: torch.nn.Module, cfg: dict[str, Any], prompt: list[int], steps: int = 8
) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits [len(prompt), V] and the `steps` greedy tokens after it."""
    runner = PagedRunner(model, cfg, num_blocks=32)
    tokens = list(prompt)
    prompt_logits = logits = runner.step(tokens, 0)
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.step(tokens[-1:], len(tokens) - 1)
    return prompt_logits, tokens[len(prompt) :]


ENGINE_PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 128 for j in range(5 + 4 * i)]} for i in range(4)
]


def generate_tp(path, tp: int) -> list[list[int]]:
    """ENGINE_PROMPTS' 12 greedy tokens each from the checkpoint at `path` served by `LLM` with
    `tp` tensor-parallel ranks (worker processes past 1)."""
    from pagoda import LLM, SamplingParams

    llm = LLM(str(path), tensor_parallel_size=tp, dtype="float32", kv_cache_dtype="float32",
              skip_tokenizer_init=True, max_model_len=128, max_num_batched_tokens=16,
              num_gpu_blocks_override=32)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outputs = llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.executor.shutdown()
