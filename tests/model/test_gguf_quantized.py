"""GGUF weights kept quantized on the CPU (`quantization="gguf"`): when the blocks stay, the
linear method on fused layers, and the embedded model against its dequantized self.

The quantized path differs from the dequantized one only by the int8 rounding of activations
(tests/kernels/test_quant_gemm.py bounds it per product); through 30 layers that moves the
logits by about 1 (of a spread of ~30), so greedy tokens agree unless two candidates are that
close, which the prompts below do not hit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_testing import PagedRunner

from pagoda.config import ModelConfig, embedded_model_path
from pagoda.kernels.cpu import quant
from pagoda.kernels.cpu.quant import QuantWeight
from pagoda.model.layers.linear import MergedColumnParallelLinear
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.loader.gguf_quants import GGML_BLOCK_SIZES, dequantize
from pagoda.model.quantization.gguf import GGUFLinearMethod, gguf_weights_stay_quantized

if not quant.quant_kernel_available():
    pytest.skip("quantized CPU GEMM unavailable (no C compiler)", allow_module_level=True)

CPU = torch.device("cpu")


def test_blocks_stay_on_a_cpu_in_float32_only(monkeypatch):
    path = embedded_model_path()
    keep, why = gguf_weights_stay_quantized(path, CPU, torch.float32)
    assert keep and "kept quantized" in why
    keep, why = gguf_weights_stay_quantized(path, CPU, torch.bfloat16)
    assert not keep and "--dtype float32" in why
    assert not gguf_weights_stay_quantized(path, torch.device("cuda"), torch.float16)[0]
    with pytest.raises(ValueError, match="needs a .gguf"):
        gguf_weights_stay_quantized("/tmp", CPU, torch.float32)
    monkeypatch.setenv("PAGODA_GGUF_QUANTIZED", "0")
    assert not gguf_weights_stay_quantized(path, CPU, torch.float32)[0]


def test_a_quantized_gguf_selects_quantization_gguf():
    from pagoda.engine.arg_utils import EngineArgs

    assert get_model_config_dict(embedded_model_path())["quantization_config"] == {
        "quant_method": "gguf"
    }
    config = EngineArgs(device="cpu", dtype="float32").create_engine_config()
    assert config.model_config.quantization == "gguf"


def _blocks(ggml_type: int, n: int, k: int, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    rng = np.random.default_rng(seed)
    elems, nbytes = GGML_BLOCK_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    offsets = {3: (0, 2), 8: (0,), 14: (208,)}[ggml_type]
    for off in offsets:
        scale = (rng.standard_normal((n, k // elems)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n, k // elems, 2)
    raw = raw.reshape(n, -1)
    w = torch.from_numpy(dequantize(raw, ggml_type, (n, k)))
    return QuantWeight(torch.from_numpy(raw.copy()), ggml_type, n, k), w


@pytest.mark.parametrize("types", [(3, 3), (3, 14)], ids=["same type", "Q4_1 and Q6_K"])
def test_fused_layer_concatenates_its_shards(types):
    k, sizes = 256, [24, 13]
    layer = MergedColumnParallelLinear(k, sizes, bias=True, linear_method=GGUFLinearMethod())
    parts = [_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(zip(types, sizes))]
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, parts[0][0], 1)
    for i, (qw, _) in enumerate(parts):
        layer.weight.weight_loader(layer.weight, qw, i)
    layer.bias.data.normal_()
    layer.linear_method.process_weights_after_loading(layer)
    w = torch.cat([p[1] for p in parts])
    x = torch.randn(3, k)
    y = layer(x)
    ref = torch.nn.functional.linear(x.double(), w.double(), layer.bias.double())
    # the int8 bound: half an activation step per block times the block's |w|
    d = x.reshape(3, -1, 32).abs().amax(-1).double() / 127
    bound = d / 2 @ w.double().abs().reshape(len(w), -1, 32).sum(-1).T + 1e-4
    assert ((y.double() - ref).abs() <= bound).all()
    layer.fused_ops = False  # the reference path: dequantized weight, F.linear
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_ranks_hold_slices_of_the_blocks():
    from pagoda.model.layers.linear import QKVParallelLinear, RowParallelLinear
    from pagoda.model.layers.vocab_embedding import VocabParallelEmbedding
    from pagoda.model.parallel import set_tensor_parallel
    from pagoda.model.quantization.gguf import dequantize_weight

    hidden, head, tp = 96, 32, 3  # 3 query heads, 1 KV head: replicated on the 3 ranks
    q, wq = _blocks(3, 96, hidden, seed=1)
    k, wk = _blocks(8, 32, hidden, seed=2)
    o, wo = _blocks(3, hidden, 96, seed=3)
    e, we = _blocks(8, 30, hidden, seed=4)
    try:
        for rank in range(tp):
            set_tensor_parallel(rank, tp)
            qkv = QKVParallelLinear(hidden, head, 3, 1, linear_method=GGUFLinearMethod())
            for shard, qw in (("q", q), ("k", k), ("v", k)):
                qkv.weight.weight_loader(qkv.weight, qw, shard)
            qkv.linear_method.process_weights_after_loading(qkv)
            segments = qkv.gguf_segments  # Q4_1 and Q8_0 shards: kept apart
            got = torch.cat([dequantize_weight(s) for s in segments])
            assert torch.equal(got, torch.cat([wq[32 * rank : 32 * rank + 32], wk, wk]))
            row = RowParallelLinear(96, hidden, linear_method=GGUFLinearMethod())
            row.weight.weight_loader(row.weight, o)
            row.linear_method.process_weights_after_loading(row)
            assert torch.equal(
                dequantize_weight(row.gguf_weight), wo[:, 32 * rank : 32 * rank + 32]
            )
            emb = VocabParallelEmbedding(30, hidden)
            emb.weight.weight_loader(emb.weight, e)
            assert torch.equal(dequantize_weight(emb.weight.quant), we[10 * rank : 10 * rank + 10])
    finally:
        set_tensor_parallel(0, 1)


PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 2], list(range(1000, 1040))]


def _greedy(model, cfg, prompt, steps=8):
    runner = PagedRunner(model, cfg, num_blocks=64)
    tokens = list(prompt)
    logits = runner.step(tokens, 0)[-1]
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = runner.step(tokens[-1:], len(tokens) - 1)[-1]
    return tokens[len(prompt) :]


def test_embedded_model_greedy_tokens_match_the_dequantized_model():
    path = embedded_model_path()
    cfg = get_model_config_dict(path)
    mc = dict(model=path, hf_config=cfg, dtype="float32", max_model_len=256)
    quantized = load_model(ModelConfig(**mc, quantization="gguf"))
    dense = load_model(ModelConfig(**mc))
    qkv = quantized.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype is torch.uint8 and qkv.gguf_weight.type_name == "Q4_1"
    assert quantized.lm_head.weight.quant.type_name == "Q8_0"  # the tied embedding's blocks
    for prompt in PROMPTS:
        assert _greedy(quantized, cfg, prompt) == _greedy(dense, cfg, prompt)


def _write_llama_gguf(hf, path: str, types: dict[str, str]) -> None:
    """The tiny Llama's GGUF file: each matrix in `types`' ggml type (by GGUF name, else
    `types["default"]`), norms in F32; Q/K rows in llama.cpp's order."""
    import gguf
    from moe_testing import _permute, add_hparams, finish_gguf

    c, arch, qt = hf.config, "llama", gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(path, arch)
    add_hparams(w, c, arch, c.hidden_size // c.num_attention_heads, {})
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}  # fmt: skip
    for name, t in hf.state_dict().items():
        t = t.float().numpy()
        parts = name.split(".")
        module = ".".join(parts[3:-1]) if parts[1] == "layers" else parts[-2]
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _permute(t, c.num_attention_heads if "q_" in module else c.num_key_value_heads)
        blk = f"blk.{parts[2]}." if parts[1] == "layers" else ""
        key = f"{blk}{names[module]}.weight"
        ty = types.get(key, types["default"]) if t.ndim == 2 else "F32"
        t = np.ascontiguousarray(t)
        if ty == "F32":
            w.add_tensor(key, t)
        elif ty == "F16":
            w.add_tensor(key, t.astype(np.float16))
        else:
            w.add_tensor(key, gguf.quants.quantize(t, qt[ty]), raw_dtype=qt[ty])
    finish_gguf(w)


def test_float_tensors_in_a_quantized_file_keep_their_layers_dense(tmp_path, monkeypatch):
    """llama.cpp leaves some matrices F16 / F32 / BF16 in a quantized file: those layers (a
    fused one with one float shard included) run dense, the others stay Q8_0 blocks."""
    pytest.importorskip("gguf")
    from model_testing import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama_untied_linear_rope")
    path = str(tmp_path / "mixed.gguf")
    _write_llama_gguf(
        hf,
        path,
        {
            "default": "Q8_0",
            "blk.0.attn_k.weight": "F16",  # one shard of the fused qkv
            "blk.0.attn_output.weight": "F16",
            "blk.1.ffn_down.weight": "F32",
            "blk.1.attn_q.weight": "BF16",
        },
    )
    cfg = get_model_config_dict(path)
    assert cfg["quantization_config"] == {"quant_method": "gguf"}
    mc = dict(model=path, hf_config=cfg, dtype="float32", max_model_len=64, quantization="gguf")
    model = load_model(ModelConfig(**mc))
    layers = model.model.layers
    for dense in (
        layers[0].self_attn.qkv_proj,
        layers[0].self_attn.o_proj,
        layers[1].mlp.down_proj,
    ):
        assert dense.weight.dtype is torch.float32 and dense.weight.shape[1] > 0
    assert layers[0].mlp.gate_up_proj.gguf_weight.type_name == "Q8_0"
    monkeypatch.setenv("PAGODA_GGUF_QUANTIZED", "0")
    reference = load_model(ModelConfig(**mc))
    tokens = list(range(5, 30))
    got = PagedRunner(model, cfg, num_blocks=16).step(tokens, 0)
    want = PagedRunner(reference, cfg, num_blocks=16).step(tokens, 0)
    # the int8 rounding of activations in the Q8_0 layers (tests/model/test_moe_cpu_quantized.py)
    assert (got - want).abs().max().item() / want.abs().max().item() < 1.5e-2
