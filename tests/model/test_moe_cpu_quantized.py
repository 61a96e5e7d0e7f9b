"""Mixture-of-experts experts kept quantized on a CPU: a GGUF file's stacked experts (Q4_0, Q4_1,
Q8_0; the K-quants at the layer) and an AWQ / GPTQ checkpoint's (4 bits as Q4_1, or Q4_0 where symmetric; symmetric 8 bits
as Q8_0; act order through an input permutation) load as per-expert layers of GGUF blocks that
the quantized CPU GEMM runs. The experts hold the quantized bytes, not the dense model's; the
logits are those of the same model with its experts dequantized within the int8 rounding of the
activations per 32 inputs (1.5e-2 of their range, the bound of tests/model/test_cpu_blocks.py),
with the same greedy tokens; each tensor-parallel rank holds its slices of every expert's
blocks; `PAGODA_GGUF_QUANTIZED=0` / `PAGODA_CPU_QUANTIZED=0` dequantize the experts into the
stacked weights, as before. A quantized GGUF file's F16 / BF16 / F32 experts load as dense
per-expert layers beside the blocks. The GGUF cases include Qwen2-MoE (`qwen2moe`), whose
shared expert stays in its Q8_0 blocks like a dense MLP and its gate in float32.

Ranks are loaded in-process (set_tensor_parallel without a process group); the engine with two
worker processes is the slow tests' at the end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_testing import make_tiny_checkpoint
from moe_testing import (
    ENGINE_PROMPTS,
    experts_of,
    generate_tp,
    greedy,
    held_bytes,
    write_moe_gguf,
)
from quant_testing import quantized_moe_checkpoint

from pagoda.config import ModelConfig
from pagoda.kernels.cpu import quant
from pagoda.kernels.cpu.quant import QuantWeight
from pagoda.model.layers.fused_moe import FusedMoE, moe_experts_ref
from pagoda.model.layers.linear import UnquantizedLinearMethod
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.loader.gguf import GGML_BLOCK_SIZES, GGUFReader
from pagoda.model.loader.weights import process_weights_after_loading
from pagoda.model.parallel import set_tensor_parallel
from pagoda.model.quantization.gguf import GGUFLinearMethod, dequantize_weight

pytestmark = pytest.mark.skipif(
    not quant.quant_kernel_available(), reason="the quantized CPU kernel does not build here"
)

PROMPT = [(5 * j + 3) % 128 for j in range(11)]
INT8_ROUNDING = 1.5e-2  # of the logits' range
FAMILIES = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}  # -> the GGUF architecture
GGUF_FAMILIES = {**FAMILIES, "qwen2_moe": "qwen2moe"}
# Sizes whose rank shards are whole 32-input blocks at tp=2: Mixtral's experts of 128 (64 a
# rank), Qwen3-MoE's of 64 (32 a rank) and its dense MLP of 128, Qwen2-MoE's experts of 64
# and its shared expert of 64.
TP2_SIZES = {"mixtral": {"intermediate_size": 128},
             "qwen3_moe": {"intermediate_size": 128, "moe_intermediate_size": 64},
             "qwen2_moe": {"moe_intermediate_size": 64}}  # fmt: skip
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # of 32 weights


def _load(path, quantization: str, rank: int = 0, tp: int = 1):
    cfg = get_model_config_dict(str(path))
    set_tensor_parallel(rank, tp)
    try:
        mc = ModelConfig(model=str(path), hf_config=cfg, dtype="float32", max_model_len=64,
                         quantization=quantization)  # fmt: skip
        return load_model(mc)
    finally:
        set_tensor_parallel(0, 1)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / want.abs().max().item()


def _assert_stacked(model) -> None:
    """The experts dequantized into w13 / w2 (float32), their layers dropped."""
    for experts in experts_of(model):
        assert experts.w13_weight.dtype is torch.float32 and not list(experts.children())


# ---- GGUF ------------------------------------------------------------------------------------


def _gguf(tmp_path, family: str, expert_type: str, **overrides) -> str:
    """A tiny MoE GGUF, experts in `expert_type`, every layer sparse (llama.cpp's qwen2moe /
    qwen3moe)."""
    sparse = {"mlp_only_layers": []} if family != "mixtral" else {}
    hf = make_tiny_checkpoint(tmp_path, family, **sparse, **overrides)
    path = str(tmp_path / f"{family}-{expert_type}.gguf")
    write_moe_gguf(hf, path, GGUF_FAMILIES[family], expert_type)
    return path


def _file_expert_bytes(path: str) -> int:
    return sum(t.nbytes for n, t in GGUFReader(path).tensors.items() if "_exps." in n)


def _assert_shared_expert_blocks(model) -> None:
    """Qwen2-MoE's shared expert in the file's Q8_0 blocks, its one-output gate float32."""
    for layer in model.model.layers:
        if hasattr(layer.mlp, "shared_expert"):
            for proj in (layer.mlp.shared_expert.gate_up_proj, layer.mlp.shared_expert.down_proj):
                assert proj.gguf_weight.type_name == "Q8_0"
            assert layer.mlp.shared_expert_gate.weight.dtype is torch.float32


@pytest.mark.parametrize("expert_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_experts_stay_in_their_blocks_and_compute_the_dequantized_experts(
    tmp_path, monkeypatch, family, expert_type
):
    path = _gguf(tmp_path, family, expert_type)
    cfg = get_model_config_dict(path)
    model = _load(path, "gguf")
    experts = experts_of(model)
    assert experts and not any(hasattr(e, "w13_weight") for e in experts)
    for e in experts:
        for i in range(e.num_experts):
            layer = e.get_submodule(str(i))
            assert layer.gate_up_proj.gguf_weight.type_name == expert_type
            assert layer.down_proj.gguf_weight.type_name == expert_type
    assert sum(held_bytes(e) for e in experts) == _file_expert_bytes(path)
    _assert_shared_expert_blocks(model)

    # The reference: the experts' products on the dequantized blocks (F.linear, as the
    # stacked float experts run), every other layer as it is.
    logits, tokens = greedy(model, cfg, PROMPT)
    for e in experts:
        for m in e.modules():
            m.fused_ops = False
    want, want_tokens = greedy(model, cfg, PROMPT)
    assert _relative_error(logits, want) < INT8_ROUNDING
    assert tokens == want_tokens

    # The blocks are the file's weights: the reference path everywhere gives the logits of the
    # file dequantized at load, whose experts are stacked as before.
    model.set_fused_ops(False)
    monkeypatch.setenv("PAGODA_GGUF_QUANTIZED", "0")
    dense = _load(path, "gguf")
    _assert_stacked(dense)
    torch.testing.assert_close(greedy(model, cfg, PROMPT)[0], greedy(dense, cfg, PROMPT)[0])


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_ranks_hold_slices_of_each_experts_blocks(tmp_path, family):
    whole = _gguf(tmp_path / "whole", family, "Q4_1", **TP2_SIZES[family])
    # Qwen2/3-MoE's experts of 32: a rank's 16 inputs of down_proj are half a block.
    half = _gguf(tmp_path / "half", family, "Q8_0") if family != "mixtral" else None
    one = experts_of(_load(whole, "gguf"))
    ranks = [experts_of(_load(whole, "gguf", r, 2)) for r in range(2)]
    for r, rank in enumerate(ranks):
        for full, part in zip(one, rank, strict=True):
            inter = part.inter_per_rank
            assert 2 * held_bytes(part) == held_bytes(full)
            for i in range(full.num_experts):
                f, p = full.get_submodule(str(i)), part.get_submodule(str(i))
                gate, up = dequantize_weight(f.gate_up_proj.gguf_weight).chunk(2)
                rows = slice(r * inter, (r + 1) * inter)
                want = torch.cat([gate[rows], up[rows]])
                assert torch.equal(dequantize_weight(p.gate_up_proj.gguf_weight), want)
                down = dequantize_weight(f.down_proj.gguf_weight)
                assert torch.equal(dequantize_weight(p.down_proj.gguf_weight), down[:, rows])
    if half is not None:
        full = experts_of(_load(half, "gguf"))[0].get_submodule("0").down_proj
        part = experts_of(_load(half, "gguf", 1, 2))[0].get_submodule("0").down_proj
        assert isinstance(part.linear_method, UnquantizedLinearMethod)  # dequantized
        torch.testing.assert_close(part.weight, dequantize_weight(full.gguf_weight)[:, 16:])


# Expert sizes that are not whole 32-input blocks: float experts have no blocks to divide.
ODD_SIZES = {"mixtral": {"intermediate_size": 80}, "qwen3_moe": {"moe_intermediate_size": 48},
             "qwen2_moe": {"moe_intermediate_size": 48}}  # fmt: skip


@pytest.mark.parametrize("expert_type", ["F16", "BF16", "F32"])
@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_float_experts_run_dense_beside_the_blocks(tmp_path, monkeypatch, family, expert_type):
    """A quantized GGUF file whose stacked experts are F16 / BF16 / F32 (every other matrix
    Q8_0, kept in its blocks): each expert's layers hold the file's values in float32 and run
    dense, the logits are those of the file dequantized at load (its experts stacked) within
    the int8 rounding of the Q8_0 layers' activations, with the same greedy tokens, and the
    engine's greedy tokens are the model's own, step by step. (The engine's prompts are not
    compared with the dequantized file's: on one of them this tiny model's top two logits lie
    1e-3 apart, within the int8 rounding, with Q8_0 experts as with float ones.)"""
    path = _gguf(tmp_path, family, expert_type, **ODD_SIZES[family])
    cfg = get_model_config_dict(path)
    model = _load(path, "gguf")
    assert model.model.layers[0].self_attn.qkv_proj.gguf_weight.type_name == "Q8_0"
    with monkeypatch.context() as m:
        m.setenv("PAGODA_GGUF_QUANTIZED", "0")
        dense = _load(path, "gguf")
    _assert_stacked(dense)
    for kept, stacked in zip(experts_of(model), experts_of(dense), strict=True):
        assert not hasattr(kept, "w13_weight")
        for i in range(kept.num_experts):
            layer = kept.get_submodule(str(i))
            for proj in (layer.gate_up_proj, layer.down_proj):
                assert isinstance(proj.linear_method, UnquantizedLinearMethod)
            assert torch.equal(layer.gate_up_proj.weight, stacked.w13_weight[i])
            assert torch.equal(layer.down_proj.weight, stacked.w2_weight[i])
    logits, tokens = greedy(model, cfg, PROMPT)
    want, want_tokens = greedy(dense, cfg, PROMPT)
    assert _relative_error(logits, want) < INT8_ROUNDING
    assert tokens == want_tokens
    prompts = [p["prompt_token_ids"] for p in ENGINE_PROMPTS]
    assert generate_tp(path, 1) == [greedy(model, cfg, p, steps=12)[1] for p in prompts]
    model.set_fused_ops(False)  # the Q8_0 layers' blocks dequantized, F.linear
    torch.testing.assert_close(greedy(model, cfg, PROMPT)[0], want)


def _random_blocks(ggml_type: int, n: int, k: int, gen: np.random.Generator) -> QuantWeight:
    """Random [n, k] GGUF rows, their fp16 super-block scales (d, and dmin where the type has
    one) small enough for weights of order 0.1, Q6_K's int8 sub-block scales in 1..16."""
    elems, nbytes = GGML_BLOCK_SIZES[ggml_type]
    raw = gen.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    if ggml_type == 14:
        raw[:, :, 192:208] = gen.integers(1, 17, size=(n, k // elems, 16), dtype=np.uint8)
    for offset in {12: (0, 2), 13: (0, 2), 14: (208,)}[ggml_type]:  # Q4_K, Q5_K / Q6_K
        d = (gen.random((n, k // elems)) * 2e-3).astype(np.float16)
        raw[:, :, offset : offset + 2] = d.view(np.uint8).reshape(n, k // elems, 2)
    return QuantWeight(torch.from_numpy(raw.reshape(n, -1)), ggml_type, n, k)


@pytest.mark.parametrize("ggml_type", [12, 13, 14], ids=["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_experts_run_their_blocks(ggml_type):
    """The K-quant types a GGUF file's experts may hold (super-blocks of 256): each expert's
    layers keep them, each product within the int8 rounding of its input, and on the reference
    path the block computes the stacked dequantized experts' output."""
    num_experts, hidden, inter = 4, 256, 256
    moe = FusedMoE(num_experts, hidden, inter, torch.float32, GGUFLinearMethod())
    gen = np.random.default_rng(ggml_type)
    w13, w2 = [], []
    for e in range(num_experts):
        layer = moe.get_submodule(str(e))
        gate, up = (_random_blocks(ggml_type, inter, hidden, gen) for _ in range(2))
        down = _random_blocks(ggml_type, hidden, inter, gen)
        for shard, qw in enumerate((gate, up)):
            layer.gate_up_proj.weight.weight_loader(layer.gate_up_proj.weight, qw, shard)
        layer.down_proj.weight.weight_loader(layer.down_proj.weight, down)
        w13.append(torch.cat([dequantize_weight(gate), dequantize_weight(up)]))
        w2.append(dequantize_weight(down))
    process_weights_after_loading(moe)
    block_bytes = GGML_BLOCK_SIZES[ggml_type][1]
    assert held_bytes(moe) == num_experts * 3 * hidden * inter // 256 * block_bytes
    gen_t = torch.Generator().manual_seed(0)
    x = torch.randn(6, hidden, generator=gen_t)
    weights, ids = torch.softmax(torch.randn(6, num_experts, generator=gen_t), -1).topk(2)
    for e, (layer13, layer2) in enumerate(zip(w13, w2)):
        layer = moe.get_submodule(str(e))
        h = torch.randn(6, inter, generator=gen_t)
        for proj, w, inp in ((layer.gate_up_proj, layer13, x), (layer.down_proj, layer2, h)):
            assert _relative_error(proj.linear_method.apply(proj, inp), inp @ w.T) < INT8_ROUNDING
    for m in moe.modules():
        m.fused_ops = False  # the blocks dequantized, F.linear
    want = moe_experts_ref(x, torch.stack(w13), torch.stack(w2), weights, ids)
    torch.testing.assert_close(moe(x, weights, ids), want)


# ---- AWQ / GPTQ ------------------------------------------------------------------------------

CASES = {  # (method, bits, act order, symmetric) -> the block type
    "awq": (("awq", 4, False, False), "Q4_1"),
    "gptq4": (("gptq", 4, False, False), "Q4_1"),
    "gptq4-sym": (("gptq", 4, False, True), "Q4_0"),
    "gptq4-act-order": (("gptq", 4, True, False), "Q4_1"),
    "gptq8-sym": (("gptq", 8, False, True), "Q8_0"),
}


def _checkpoint(tmp_path, family: str, case: str, **overrides):
    (method, bits, act_order, sym), _ = CASES[case]
    # The default initializer range: weights whose routing int8 rounding does not flip.
    _, path = quantized_moe_checkpoint(tmp_path, family, method, bits, act_order, sym,
                                       group=32, initializer_range=0.02, **overrides)  # fmt: skip
    return path, method


def _expert_bytes(experts: FusedMoE, block_type: str, act_order: bool) -> int:
    """E experts' gate_up [2I, H] and down [H, I] in `block_type`, plus an int64 input
    permutation a layer where act order sorts its inputs (more than one group of 32)."""
    layer = experts.get_submodule("0")
    h, inter = layer.gate_up_proj.input_size_per_partition, layer.down_proj.input_size_per_partition
    blocks = 3 * h * inter // 32 * BLOCK_BYTES[block_type]
    perms = sum(8 * k for k in (h, inter) if act_order and k > 32)
    return experts.num_experts * (blocks + perms)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_awq_gptq_experts_stay_quantized_and_compute_the_dequantized_experts(
    tmp_path, monkeypatch, family, case
):
    path, method = _checkpoint(tmp_path, family, case)
    block_type, act_order = CASES[case][1], CASES[case][0][2]
    cfg = get_model_config_dict(str(path))
    model = _load(path, method)
    experts = experts_of(model)
    assert experts
    for e in experts:
        for i in range(e.num_experts):
            layer = e.get_submodule(str(i))
            for proj in (layer.gate_up_proj, layer.down_proj):
                assert proj.gguf_weight.type_name == block_type
                # act order sorts the inputs of layers of more than one group
                permuted = act_order and proj.input_size_per_partition > 32
                assert hasattr(proj, "gguf_perm") == permuted
        assert held_bytes(e) == _expert_bytes(e, block_type, act_order)

    # The reference: the experts dequantized into the stacked weights as they were before
    # (every other layer in blocks as here).
    monkeypatch.setattr(FusedMoE, "_keeps_expert_layers", lambda *args: False)
    reference = _load(path, method)
    _assert_stacked(reference)
    logits, tokens = greedy(model, cfg, PROMPT)
    want, want_tokens = greedy(reference, cfg, PROMPT)
    assert _relative_error(logits, want) < INT8_ROUNDING
    assert tokens == want_tokens

    monkeypatch.undo()
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # every layer dequantized, as before
    _assert_stacked(_load(path, method))


@pytest.mark.parametrize("family,case", [("mixtral", "awq"), ("qwen3_moe", "gptq8-sym")])
def test_awq_gptq_ranks_hold_slices_of_each_experts_blocks(tmp_path, family, case):
    path, method = _checkpoint(tmp_path, family, case, **TP2_SIZES[family])
    one = experts_of(_load(path, method))
    for r in range(2):
        rank = experts_of(_load(path, method, r, 2))
        for full, part in zip(one, rank, strict=True):
            inter = part.inter_per_rank
            rows = slice(r * inter, (r + 1) * inter)
            assert 2 * held_bytes(part) == held_bytes(full)
            for i in range(full.num_experts):
                f, p = full.get_submodule(str(i)), part.get_submodule(str(i))
                gate, up = dequantize_weight(f.gate_up_proj.gguf_weight).chunk(2)
                want = torch.cat([gate[rows], up[rows]])
                assert torch.equal(dequantize_weight(p.gate_up_proj.gguf_weight), want)
                down = dequantize_weight(f.down_proj.gguf_weight)
                assert torch.equal(dequantize_weight(p.down_proj.gguf_weight), down[:, rows])


# ---- the engine: two worker processes -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,case",
    [
        ("qwen3_moe", "gguf"),
        ("mixtral", "gguf"),
        ("qwen2_moe", "gguf"),
        ("mixtral", "awq"),
        ("qwen3_moe", "gptq4"),
    ],
)
def test_tp2_engine_with_quantized_experts_gives_one_ranks_greedy_tokens(tmp_path, family, case):
    """Each worker holds its slices of the expert blocks (sizes of whole blocks a rank). Not
    GPTQ act order: at tp=2 its row-parallel layers are dequantized on each rank (a rank's
    inputs are parts of many groups), so they skip the int8 rounding that one rank's blocks
    make, and greedy paths may part at a near tie."""
    if case == "gguf":
        path = _gguf(tmp_path, family, "Q4_0", **TP2_SIZES[family])
    else:
        path, _ = _checkpoint(tmp_path, family, case, **TP2_SIZES[family])
    assert generate_tp(path, 2) == generate_tp(path, 1)
