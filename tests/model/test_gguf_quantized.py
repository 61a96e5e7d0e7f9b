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
