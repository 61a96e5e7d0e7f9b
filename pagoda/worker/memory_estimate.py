"""The engine's start-up memory plan predicted from a model's config alone, without torch.

At start-up on a GPU the engine measures four things (`pagoda.worker.profiling`) and splits
memory with `memory_plan.plan_kv_cache_memory`; on a CPU the KV cache takes a fixed budget.
`pagoda plan` runs the same split with estimates of what the engine would measure:

- weights: the parameter count (`weight_params`) in the model's dtype; a 4-bit AWQ/GPTQ
  checkpoint on CUDA keeps its linear layers at K*N/2 bytes plus a float16 scale and a uint8
  zero per group (`W4Weight`); an 8-bit one (W8A8, FP8) a byte per weight and a float32 scale
  per output; a GGUF file kept quantized on a CPU, its blocks, and AWQ / GPTQ / W8A8 / FP8
  layers on a CPU the GGUF blocks they become at load (`cpu_blocks_weight_bytes`). The
  embeddings, biases, norms, MoE routers and Qwen2-MoE's shared_expert_gate stay in the
  model's dtype in every form;
- activations of the profiling forward: the larger of its two phases, plus what it allocates
  besides them (the cuBLAS workspace, the step's inputs). The sampler's: three float32
  [rows, vocab] copies of the logits (the logits, the softmax and their sum stand in for it;
  rows = min(max_num_seqs, max_num_batched_tokens)) beside the final hidden states. The
  forward's: per token the MLP block of the worst decoder layer (`mlp_block_bytes`: a dense
  MLP's gate_up, activation and output rows; a sparse layer's top_k experts' rows of each, as
  the fused-MoE kernel allocates them, and Qwen2-MoE's shared expert) beside 4 hidden rows;
- CUDA graphs: the reserve the engine computes from its buckets (`graph_buckets`), with the
  forward peak of the largest decode and mixed bucket estimated per token from the MLP block
  and 3 hidden rows (x 1.1);
- the CUDA context, a constant.

Fitted to the plans the engine logged on an H200 for Llama-3-8B (bf16, FP8 KV, AWQ, batches of
2048 and 8192 tokens), Llama-3.2-1B and Qwen2.5-7B (benchmarks/results/h200/plan): the
activations within 2 MiB of the measurement (the sampler's phase the larger at 2048 tokens, the
forward's at 8192), the other terms within 45 MiB, the KV cache within 0.2%. Mixtures of experts
were not measured: their MLP block is counted from the allocations of `fused_experts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.model.loader.hf_config import (
    expert_intermediate_size,
    num_experts,
    shared_expert_size,
    sparse_layers,
    weight_params,
)
from pagoda.worker.graph_buckets import (
    TP_PER_GRAPH_BYTES,
    cuda_graph_capture_sizes,
    decode_graph_reserve_bytes,
    mixed_graph_reserve_bytes,
    mixed_graph_shapes,
)

MiB = 2**20
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# Device memory outside torch's allocator after start-up (CUDA context, cuBLAS, NCCL absent):
# 0.67 GiB on an H200 with torch 2.11 and CUDA 13; other GPUs and drivers differ by ~0.1 GiB.
CUDA_CONTEXT_BYTES = 685 * MiB
# The profiling forward keeps this many float32 copies of the sampled rows' logits.
_LOGITS_COPIES = 3
# Allocated by the profiling forward beside its activations: cuBLAS's workspace (32 MiB on an
# H200) and the step's inputs; 33-34 MiB measured with every model.
_FORWARD_FIXED_BYTES = 34 * MiB
# Hidden rows live per token beside the MLP block at the forward's peak (the residual, the
# MLP's normed input and, fitted to Llama-3-8B's 8192-token forward, 2 more), and in a graph
# bucket's forward, whose peak per token is (MLP block + 3 hidden rows) x 1.1.
_FORWARD_HIDDEN_ROWS = 4
_GRAPH_HIDDEN_ROWS = 3
_GRAPH_PEAK_PER_TOKEN = 1.1


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family config that memory depends on."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        )

    def kv_heads_per_rank(self, tp: int) -> int:
        """As the QKV layer splits them: divided among ranks, or replicated (1 a rank)."""
        return 1 if tp >= self.num_kv_heads else self.num_kv_heads // tp


def weight_bytes(
    cfg: Mapping[str, Any], itemsize: int, tp: int = 1, quant: Mapping[str, Any] | None = None
) -> int:
    """One rank's weights: dense in `itemsize` bytes, or with `quant` ({"bits": 4 or 8,
    "group_size": g}: AWQ/GPTQ kept 4-bit, GPTQ kept 8-bit on CUDA) the linear layers packed."""
    params = weight_params(cfg)
    total = params.total * itemsize
    bits = None if quant is None else int(quant.get("bits", 4))
    if bits in (4, 8):
        linear = params.linear
        group = int(quant.get("group_size") or 128)
        if group <= 0:  # -1: one group per input row
            group = int(cfg["hidden_size"])
        if bits == 4:  # nibbles, float16 scale + uint8 zero
            packed = linear // 2 + linear * 3 // group
        else:  # bytes, float16 scale + int16 zero (none for symmetric weights: an upper bound)
            packed = linear + linear * 4 // group
        total = packed + (params.total - linear) * itemsize
    return total // tp


# Bytes of 32 weights in the GGUF blocks AWQ / GPTQ / W8A8 / FP8 layers become on a CPU
# (`pagoda.model.quantization.cpu_blocks`): the codes, an fp16 scale and Q4_1's fp16 min.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_BLOCK = 32


@dataclass(frozen=True)
class LinearLayers:
    """`count` linear layers of one shape in the model, one rank's shard [n, k] of each."""

    name: str  # the layer's (experts' "experts.gate_up_proj", "experts.down_proj")
    count: int
    n: int
    k: int
    row_parallel: bool  # inputs split across ranks (o_proj, down_proj)
    dense: bool = False  # replicated and dense in every checkpoint (a router, shared_expert_gate)


def linear_layers(cfg: Mapping[str, Any], tp: int = 1) -> list[LinearLayers]:
    """The linear layers of all decoder layers as a rank holds them: q/k/v and gate/up fused;
    in a mixture of experts' sparse layers (`sparse_layers`) the router (replicated, dense) and
    every expert's gate_up / down instead of the dense MLP, and Qwen2-MoE's shared expert (a
    dense MLP of the checkpoint's format) with its gate (replicated, dense)."""
    shape = ModelShape.from_hf_config(cfg)
    layers, hidden, head_dim = shape.num_layers, shape.hidden_size, shape.head_dim
    q = shape.num_attention_heads * head_dim
    qkv = q // tp + 2 * shape.kv_heads_per_rank(tp) * head_dim
    experts = num_experts(cfg)
    sparse = sum(sparse_layers(cfg))
    inter = shape.intermediate_size // tp
    moe_inter = expert_intermediate_size(cfg) // tp
    shared = shared_expert_size(cfg) // tp
    shared_layers = sparse if shared else 0
    out = [
        LinearLayers("qkv_proj", layers, qkv, hidden, False),
        LinearLayers("o_proj", layers, hidden, q // tp, True),
        LinearLayers("gate_up_proj", layers - sparse, 2 * inter, hidden, False),
        LinearLayers("down_proj", layers - sparse, hidden, inter, True),
        LinearLayers("router", sparse, experts, hidden, False, dense=True),
        LinearLayers("experts.gate_up_proj", sparse * experts, 2 * moe_inter, hidden, False),
        LinearLayers("experts.down_proj", sparse * experts, hidden, moe_inter, True),
        LinearLayers("shared_expert.gate_up_proj", shared_layers, 2 * shared, hidden, False),
        LinearLayers("shared_expert.down_proj", shared_layers, hidden, shared, True),
        LinearLayers("shared_expert_gate", shared_layers, 1, hidden, False, dense=True),
    ]
    return [layer for layer in out if layer.count]


def cpu_blocks_weight_bytes(
    cfg: Mapping[str, Any], itemsize: int, tp: int, block: str, group_size: int | None = None,
    act_order: bool = False, w8a8: bool = False,
) -> tuple[int, list[str]]:  # fmt: skip
    """One rank's weights on a CPU where the quantized linear layers become GGUF `block`s at
    load (`cpu_blocks`): each layer's blocks; the embeddings, biases, norms and the dense
    layers (routers, shared_expert_gate) in `itemsize` bytes; and the names of the layers
    without a block form: inputs (or AWQ / GPTQ groups of `group_size`, -1 or 0 a row) not
    whole 32-input blocks, or a GPTQ act-order row-parallel shard with tp > 1 (`tp_shards`).
    Those stay dense in `itemsize` bytes, or with `w8a8` 8-bit as `int8_weight_bytes` counts
    them. Act order adds the int64 input permutation of each layer of more than one group."""
    params = weight_params(cfg)
    total = (params.embeddings + params.vectors) * itemsize // tp
    dense: list[str] = []
    for layer in linear_layers(cfg, tp):
        group = layer.k if group_size is None or group_size <= 0 else group_size
        if layer.dense:  # checkpoints keep it dense
            nbytes = layer.n * layer.k * itemsize
        elif layer.k % _BLOCK or group % _BLOCK or act_order and layer.row_parallel and tp > 1:
            nbytes = layer.n * layer.k + 4 * layer.n if w8a8 else layer.n * layer.k * itemsize
            dense.append(layer.name)
        else:
            nbytes = layer.n * layer.k // _BLOCK * GGUF_BLOCK_BYTES[block]
            nbytes += 8 * layer.k if act_order and layer.k > group else 0  # one group: none
        total += layer.count * nbytes
    return total, dense


def int8_weight_bytes(cfg: Mapping[str, Any], itemsize: int, tp: int = 1) -> int:
    """One rank's weights with its linear layers 8-bit (int8 W8A8 or FP8 `W8A8LinearMethod`:
    weight [N, K] a byte each, weight_scale [N] float32); the embeddings, the LM head, biases,
    norms and the dense layers (routers, shared_expert_gate) in `itemsize` bytes."""
    params = weight_params(cfg)
    total = (params.embeddings + params.vectors) * itemsize // tp
    for layer in linear_layers(cfg, tp):
        dense = layer.n * layer.k * itemsize
        nbytes = dense if layer.dense else layer.n * layer.k + 4 * layer.n
        total += layer.count * nbytes
    return total


def gguf_weight_bytes(path: str, keep_quantized: bool) -> int:
    """The weights of a GGUF file as the CPU engine holds them: the blocks of the types its
    kernels run where `keep_quantized`, every other tensor dequantized to float32."""
    from pagoda.model.loader.gguf import QUANT_KERNEL_TYPES, GGUFReader

    total = 0
    for t in GGUFReader(path).tensors.values():
        if keep_quantized and t.ggml_type in QUANT_KERNEL_TYPES:
            total += t.nbytes
        else:
            n = 1
            for d in t.shape:
                n *= d
            total += 4 * n
    return total


def mlp_block_bytes(cfg: Mapping[str, Any], itemsize: int, tp: int = 1) -> int:
    """Per token, the most that one decoder layer's MLP block holds at once on CUDA (its output
    included), over the layers the model has: a forward's peak is its worst layer's.

    - A dense MLP (`LlamaMLP`): gate_up [T, 2 * intermediate], the activation [T, intermediate]
      and down_proj's output [T, hidden].
    - A sparse layer (`SparseMoeBlock`, `fused_experts`): per (token, expert) pair, top_k a
      token, a gate_up row [2 * moe_intermediate], the activation's [moe_intermediate] and the
      down GEMM's [hidden], all live until their sum [T, hidden] is made; the routing weights
      (float32) and expert ids (int32) [T, top_k] and the sorted pair ids (int32, a pair each;
      their padding, experts x (BLOCK_M - 1) a layer, left out). The router's logits [T, E] are
      freed before the experts run.
    - Qwen2-MoE's shared expert, after the routed experts: their sum [T, hidden] beside a dense
      MLP of shared_expert_intermediate_size.
    The experts of quantized checkpoints run dequantized on CUDA, as above.
    """
    shape = ModelShape.from_hf_config(cfg)
    hidden = shape.hidden_size * itemsize
    sparse = sparse_layers(cfg)

    def dense_mlp(inter: int) -> int:
        return 3 * inter // tp * itemsize + hidden

    blocks = [dense_mlp(shape.intermediate_size)] if not all(sparse) else []
    if any(sparse):
        top_k = int(cfg["num_experts_per_tok"])
        moe_inter = expert_intermediate_size(cfg) // tp
        pairs = top_k * (3 * moe_inter * itemsize + hidden + 4 + 4 + 4)
        blocks.append(pairs + hidden)
        if shared_expert_size(cfg):
            blocks.append(hidden + dense_mlp(shared_expert_size(cfg)))
    return max(blocks)


def activation_bytes(
    cfg: Mapping[str, Any], itemsize: int, max_num_batched_tokens: int, max_num_seqs: int,
    tp: int = 1,
) -> int:  # fmt: skip
    """Peak of the engine's profiling forward beyond the weights (`profile_peak_memory`): the
    forward's worst layer or the sampler's logits, whichever is larger."""
    shape = ModelShape.from_hf_config(cfg)
    tokens = max_num_batched_tokens
    rows = min(max_num_seqs, tokens)
    hidden = shape.hidden_size * itemsize
    sampler = _LOGITS_COPIES * 4 * rows * shape.vocab_size + tokens * hidden
    forward = tokens * (mlp_block_bytes(cfg, itemsize, tp) + _FORWARD_HIDDEN_ROWS * hidden)
    return _FORWARD_FIXED_BYTES + max(sampler, forward)


def cuda_graph_bytes(
    cfg: Mapping[str, Any], itemsize: int, max_num_batched_tokens: int, max_num_seqs: int,
    max_model_len: int, block_size: int, tp: int = 1,
) -> int:  # fmt: skip
    """The reserve for the decode and mixed-step graphs, as the engine sizes it from the
    measured peak of its largest buckets (`ModelRunner._plan_cuda_memory`)."""
    shape = ModelShape.from_hf_config(cfg)
    sizes = cuda_graph_capture_sizes(max_num_seqs, max_num_batched_tokens)
    max_len = -(-max_model_len // block_size) * block_size
    shapes = mixed_graph_shapes(max_num_seqs, min(max_num_batched_tokens, max_len))
    row_bytes = shape.hidden_size * itemsize
    per_token = _GRAPH_PEAK_PER_TOKEN * (mlp_block_bytes(cfg, itemsize, tp)
                                         + _GRAPH_HIDDEN_ROWS * row_bytes)  # fmt: skip
    peak = int(per_token * max(sizes, default=0))
    total = decode_graph_reserve_bytes(peak, sizes, row_bytes)
    if shapes:
        total += mixed_graph_reserve_bytes(int(per_token * shapes[-1][0]), shapes, row_bytes)
    if total and tp > 1:
        total += (len(sizes) + len(shapes)) * TP_PER_GRAPH_BYTES
    return total
