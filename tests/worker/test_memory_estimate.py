"""`memory_estimate`'s activations of mixtures of experts, against the bytes the engine allocates
in a sparse layer on CUDA, counted here by hand from the code: `fused_experts` holds per token
top_k rows of gate_up [2 * moe_intermediate], of the activation [moe_intermediate] and of the
down GEMM's output [hidden] until it sums them into [T, hidden]; the routing adds float32
weights, int32 ids and int32 sorted pair ids [T * top_k]; Qwen2-MoE's shared expert then runs
as a dense MLP beside the routed sum. A dense MLP holds gate_up [2 * intermediate], the
activation [intermediate] and its output [hidden] a token. (The dense terms are checked against
the engine's logged plans in tests/test_plan.py; no MoE plan was logged on a GPU.)"""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.worker.memory_estimate import activation_bytes, cuda_graph_bytes, mlp_block_bytes

PRESETS = Path(__file__).resolve().parents[2] / "benchmarks/presets"
MIXTRAL = json.loads((PRESETS / "mixtral-8x7b/config.json").read_text())
QWEN3_MOE = json.loads((PRESETS / "qwen3-30b-a3b/config.json").read_text())
BF16 = 2
ROUTING = 4 + 4 + 4  # a pair's float32 weight, int32 expert id and int32 sorted pair id
# Qwen1.5-MoE-A2.7B's sizes: 60 experts of 1408, top 4, a shared expert of 5632.
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
}  # fmt: skip


def _dense_twin(cfg: dict) -> dict:
    """A Llama of the same sizes with a dense MLP of intermediate_size on every layer."""
    drop = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    return {**{k: v for k, v in cfg.items() if k not in drop},
            "architectures": ["LlamaForCausalLM"]}  # fmt: skip


def test_a_sparse_layer_holds_top_k_rows_of_each_expert_intermediate():
    # Mixtral-8x7B: top 2 of 8 experts of 14336, hidden 4096.
    pair = 2 * 14336 * BF16 + 14336 * BF16 + 4096 * BF16 + ROUTING
    assert mlp_block_bytes(MIXTRAL, BF16) == 2 * pair + 4096 * BF16 == 196632
    dense = 2 * 14336 * BF16 + 14336 * BF16 + 4096 * BF16
    assert mlp_block_bytes(_dense_twin(MIXTRAL), BF16) == dense == 94208
    # A rank of two holds half of every expert's intermediate rows.
    pair = 3 * 7168 * BF16 + 4096 * BF16 + ROUTING
    assert mlp_block_bytes(MIXTRAL, BF16, tp=2) == 2 * pair + 4096 * BF16
    # Qwen3-30B-A3B: top 8 of 128 experts of 768; its dense intermediate_size (6144) is no
    # layer's: every layer is sparse.
    pair = 3 * 768 * BF16 + 2048 * BF16 + ROUTING
    assert mlp_block_bytes(QWEN3_MOE, BF16) == 8 * pair + 2048 * BF16 == 73824
    assert mlp_block_bytes({**QWEN3_MOE, "intermediate_size": 10**6}, BF16) == 73824


def test_the_worst_layer_sizes_the_block_dense_or_shared_expert():
    # A dense layer (mlp_only_layers) larger than the sparse ones is the worst.
    cfg = {**QWEN3_MOE, "intermediate_size": 16384, "mlp_only_layers": [0]}
    assert mlp_block_bytes(cfg, BF16) == 3 * 16384 * BF16 + 2048 * BF16 == 102400
    # Qwen2-MoE: the routed experts' rows (4 pairs) outweigh the shared expert run beside their
    # sum, until the shared expert is large.
    pair = 3 * 1408 * BF16 + 2048 * BF16 + ROUTING
    assert mlp_block_bytes(QWEN2_MOE, BF16) == 4 * pair + 2048 * BF16 == 54320
    cfg = {**QWEN2_MOE, "shared_expert_intermediate_size": 16384}
    assert mlp_block_bytes(cfg, BF16) == 2048 * BF16 + 3 * 16384 * BF16 + 2048 * BF16 == 106496


def test_mixtral_activations_cover_its_experts_rows_not_the_dense_mlp():
    """At the default 2048-token step the forward's worst layer holds 2048 x 196632 bytes of
    expert rows (384 MiB): more than the whole estimate was with a dense MLP (166 MiB)."""
    tokens, seqs = 2048, 256
    moe = activation_bytes(MIXTRAL, BF16, tokens, seqs)
    dense = activation_bytes(_dense_twin(MIXTRAL), BF16, tokens, seqs)
    assert moe > tokens * 196632 > 166 * 2**20
    assert moe - dense == tokens * (196632 - 94208)  # the forward is the larger phase of both
    # The graphs' reserve follows the largest decode (256) and mixed (512 tokens) bucket's.
    extra = cuda_graph_bytes(MIXTRAL, BF16, tokens, seqs, 32768, 16) - cuda_graph_bytes(
        _dense_twin(MIXTRAL), BF16, tokens, seqs, 32768, 16
    )
    assert abs(extra - 1.1 * (196632 - 94208) * (256 + 512)) <= 2


def test_qwen3_moe_activations_are_the_samplers_at_2048_and_the_experts_at_8192():
    logits = 3 * 4 * 256 * 151936  # three float32 [256, vocab] copies
    small = activation_bytes(QWEN3_MOE, BF16, 2048, 256)
    big = activation_bytes(QWEN3_MOE, BF16, 8192, 256)
    assert small - activation_bytes({**QWEN3_MOE, "num_experts_per_tok": 1}, BF16, 2048, 256) == 0
    assert small > logits
    # At 8192 tokens each token's 8 expert pairs (69 KiB) outweigh the logits.
    one_fewer = activation_bytes({**QWEN3_MOE, "num_experts_per_tok": 7}, BF16, 8192, 256)
    assert big - one_fewer == 8192 * (3 * 768 * BF16 + 2048 * BF16 + ROUTING)
