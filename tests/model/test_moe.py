"""Mixture-of-experts models (Mixtral, Qwen3-MoE): routing against transformers' routers, expert
tensors loaded from per-expert and fused checkpoints, each tensor-parallel rank's slice of every
expert, and two gloo ranks against one. End to end against transformers through `LLM`:
tests/model/test_model_families.py (cases mixtral and qwen3_moe)."""

from __future__ import annotations

import os

import pytest
import torch
from model_testing import assert_two_ranks_match_one, make_tiny_checkpoint
from model_testing import load_float32 as _load

from pagoda.model.layers.fused_moe import softmax_topk, topk_softmax
from pagoda.model.parallel import set_tensor_parallel


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalized"])
def test_moe_routing_matches_transformers(family):
    import transformers

    norm = family != "qwen3_moe_unnormalized"
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=32, num_local_experts=8,
                                            num_experts_per_tok=2)  # fmt: skip
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=16,
                                             num_experts_per_tok=4, norm_topk_prob=norm)  # fmt: skip
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(50, 32)
    _, want_weights, want_ids = router(x)
    logits = x @ router.weight.T
    k = config.num_experts_per_tok
    weights, ids = topk_softmax(logits, k) if family == "mixtral" else softmax_topk(logits, k, norm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == norm


def _experts(hf, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    experts = hf.model.layers[layer].mlp.experts
    return experts.gate_up_proj.detach(), experts.down_proj.detach()


def _save_fused(hf, path) -> None:
    """The checkpoint as transformers 5 holds it in memory: every layer's experts in one
    gate_up_proj [E, 2I, H] and one down_proj [E, H, I] (save_pretrained writes them back per
    expert, as the Hub's files are)."""
    from safetensors.torch import save_file

    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_moe_experts_load_from_both_layouts(tmp_path, case, layout):
    hf = make_tiny_checkpoint(tmp_path, case)
    if layout == "fused":
        _save_fused(hf, tmp_path)
    model = _load(tmp_path)
    gate_up, down = _experts(hf, 0)
    moe = model.model.layers[0].mlp
    assert torch.equal(moe.experts.w13_weight, gate_up)
    assert torch.equal(moe.experts.w2_weight, down)
    assert torch.equal(moe.gate.weight, hf.model.layers[0].mlp.gate.weight)
    if case == "qwen3_moe":  # layer 1 is dense (mlp_only_layers)
        assert hasattr(model.model.layers[1].mlp, "gate_up_proj")


def test_moe_checkpoint_missing_expert_names_it(tmp_path):
    import re

    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(tmp_path, "mixtral")
    (file,) = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    state = load_file(tmp_path / file)
    (name,) = [n for n in state if re.search(r"layers\.1\..*experts\.3\.w3\.weight$", n)]
    del state[name]
    save_file(state, tmp_path / file)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.w13_weight \(expert 3, w3\)"):
        _load(tmp_path)


def test_moe_rank_holds_a_slice_of_every_expert(tmp_path):
    hf = make_tiny_checkpoint(tmp_path, "qwen3_moe")
    gate_up, down = _experts(hf, 0)
    inter = down.shape[-1]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    half = inter // 2
    try:
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            experts = _load(tmp_path).model.layers[0].mlp.experts
            cols = slice(rank * half, (rank + 1) * half)
            assert experts.w13_weight.shape == (8, 2 * half, 64)
            assert torch.equal(experts.w13_weight, torch.cat([gate[:, cols], up[:, cols]], 1))
            assert torch.equal(experts.w2_weight, down[:, :, cols])
    finally:
        set_tensor_parallel(0, 1)


def test_moe_two_rank_forward_matches_one_rank(tmp_path):
    make_tiny_checkpoint(tmp_path, "qwen3_moe")
    assert_two_ranks_match_one(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_gpu_engine_matches_transformers_eager_and_in_cuda_graphs(tmp_path, case):
    """The fused Triton MoE (with Qwen2-MoE's shared expert) through the engine in float32,
    eager and in CUDA graphs: the same greedy tokens as transformers' forward on the CPU."""
    from pagoda import LLM, SamplingParams

    hf = make_tiny_checkpoint(tmp_path, case)
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(5)]
    want = []
    with torch.no_grad():
        for p in prompts:
            tokens = list(p)
            for _ in range(8):
                tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
            want.append(tokens[len(p) :])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for eager in (True, False):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, enforce_eager=eager,
                  max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256,
                  gpu_memory_utilization=0.3)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, eager
        del llm
        torch.cuda.empty_cache()
