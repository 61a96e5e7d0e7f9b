"""Tensor-parallel sharding of the Llama-family layers.

Weight shards are checked in-process (set_tensor_parallel without a process group); the forward
pass is checked with two gloo processes whose logits must equal the single-process model's.
"""

from __future__ import annotations

import pytest
import torch
from model_testing import assert_two_ranks_match_one, make_tiny_checkpoint
from model_testing import load_float32 as _load

from pagoda.model.layers.linear import RowParallelLinear
from pagoda.model.parallel import set_tensor_parallel


@pytest.mark.parametrize("case", ["qwen2", "llama_mqa_attention_bias"])
def test_rank_shards_are_slices_of_the_checkpoint(tmp_path, case):
    hf = make_tiny_checkpoint(tmp_path, case)
    ref = {k: v for k, v in hf.state_dict().items()}
    num_kv_heads = hf.config.num_key_value_heads
    try:
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            model = _load(tmp_path)
            attn = model.model.layers[1].self_attn
            q, k, v = (ref[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
            half_q = q.shape[0] // 2
            # With fewer KV heads than ranks the KV head is replicated.
            kv_rows = k.shape[0] // 2 if num_kv_heads >= 2 else k.shape[0]
            kv_rank = rank if num_kv_heads >= 2 else 0
            expected = torch.cat(
                [
                    q[rank * half_q : (rank + 1) * half_q],
                    k[kv_rank * kv_rows : (kv_rank + 1) * kv_rows],
                    v[kv_rank * kv_rows : (kv_rank + 1) * kv_rows],
                ]
            )
            assert torch.equal(attn.qkv_proj.weight, expected)
            o = ref["model.layers.1.self_attn.o_proj.weight"]
            half_in = o.shape[1] // 2
            assert torch.equal(attn.o_proj.weight, o[:, rank * half_in : (rank + 1) * half_in])
            emb = ref["model.embed_tokens.weight"]
            half_vocab = emb.shape[0] // 2
            assert torch.equal(
                model.model.embed_tokens.weight, emb[rank * half_vocab : (rank + 1) * half_vocab]
            )
    finally:
        set_tensor_parallel(0, 1)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_fused_checkpoint_tensors_are_split_per_rank(tmp_path, num_kv_heads):
    """Phi-3 stores qkv_proj and gate_up_proj fused: each rank takes its slice of each shard."""
    hf = make_tiny_checkpoint(tmp_path, "phi3", num_key_value_heads=num_kv_heads)
    ref = hf.state_dict()
    qkv = ref["model.layers.1.self_attn.qkv_proj.weight"]
    q_rows, kv_rows = 4 * 16, num_kv_heads * 16
    q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
    gate, up = ref["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    try:
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            layer = _load(tmp_path).model.layers[1]
            kv = (
                slice(rank * kv_rows // 2, (rank + 1) * kv_rows // 2)
                if num_kv_heads == 2
                else (
                    slice(0, kv_rows)  # one KV head: replicated on both ranks
                )
            )
            half_q = slice(rank * q_rows // 2, (rank + 1) * q_rows // 2)
            expected = torch.cat([q[half_q], k[kv], v[kv]])
            assert torch.equal(layer.self_attn.qkv_proj.weight, expected)
            half = slice(rank * 48, (rank + 1) * 48)
            assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate[half], up[half]]))
    finally:
        set_tensor_parallel(0, 1)


def test_two_rank_forward_matches_one_rank(tmp_path):
    make_tiny_checkpoint(tmp_path, "qwen3")
    assert_two_ranks_match_one(tmp_path)


def test_row_parallel_partial_sums_carry_the_bias_once(monkeypatch):
    """`reduce_results=False`: no all-reduce, each rank's partial product, the bias on rank 0
    only; the ranks' outputs sum to the whole layer's."""
    import torch.distributed as dist

    def no_all_reduce(*args, **kwargs):
        raise AssertionError("reduce_results=False all-reduced")

    monkeypatch.setattr(dist, "all_reduce", no_all_reduce)
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    parts = []
    for rank in range(2):
        set_tensor_parallel(rank, 2)
        try:
            layer = RowParallelLinear(8, 6, bias=True, reduce_results=False)
        finally:
            set_tensor_parallel(0, 1)
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        parts.append(layer(x[:, 4 * rank : 4 * (rank + 1)]))
    torch.testing.assert_close(parts[0] + parts[1], torch.nn.functional.linear(x, w, b))
