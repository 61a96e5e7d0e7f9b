"""The Triton W8A16 kernel (8-bit GPTQ weights kept 8-bit) against the checkpoint's
dequantization + F.linear: under the Triton interpreter in float32 (and float16, the exact
centering of the codes) when there is no GPU, for groups of 32, 64, 128 inputs or one per row,
with and without zero points, act order, a ragged last group, every code path (split K, scale
on the tile's product or per element, the dequantized weight and cuBLAS); a fused GPTQ layer
and a whole tiny checkpoint kept 8-bit giving the dequantized model's outputs; 8-bit dummy
weights; bf16 at Llama-3-8B shapes and CUDA-graph replays on the GPU."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels.w8a16 import (  # noqa: E402
    DEQUANT,
    DEQUANT_MIN_M,
    W8A16Config,
    choose_config,
    default_config,
    w8a16_linear,
)
from pagoda.model.quantization.formats import dequantize_gptq, pack_gptq_weight  # noqa: E402
from pagoda.model.quantization.w8_layout import W8Weight, dequantize_w8, gptq_to_w8  # noqa: E402

DEV = kernel_device()
N, K = 48, 256


def gptq8_weights(
    n: int = N,
    k: int = K,
    group: int = 64,
    zeros: bool = True,
    act_order: bool = False,
    seed: int = 0,
    device: torch.device | str = DEV,
) -> tuple[W8Weight, torch.Tensor]:
    """Random 8-bit GPTQ tensors repacked for the kernel, and the reference: the checkpoint's
    own dequantization [N, K] float32. `zeros=False`: symmetric (every zero 128); otherwise
    zeros over GPTQ's whole stored range, 256 (a stored 255) included. group -1: per channel."""
    gen = torch.Generator().manual_seed(seed)
    g = k if group == -1 else group
    groups = -(-k // g)
    values = torch.randint(0, 256, (k, n), generator=gen, dtype=torch.int32)
    if zeros:
        z = torch.randint(1, 257, (groups, n), generator=gen, dtype=torch.int32)
        z[0, 0] = 256
    else:
        z = torch.full((groups, n), 128, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = torch.arange(k, dtype=torch.int32) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qw = pack_gptq_weight(values, 8)
    qz = pack_gptq_weight((z - 1).t().contiguous(), 8).t().contiguous()
    ref = dequantize_gptq(qw, qz, scales, g_idx, 8)
    w8 = gptq_to_w8(qw.to(device), qz.to(device), scales.to(device), g_idx[None].to(device), g)
    return w8, ref.to(device)


def _randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def _run(x: torch.Tensor, w: W8Weight, bias=None, config=None) -> torch.Tensor:
    return w8a16_linear(x, w.qweight, w.scales, w.zeros, w.group_size, bias, w.perm, config=config)


@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_repacked_weights_dequantize_to_the_checkpoint(zeros, act_order, group) -> None:
    w8, ref = gptq8_weights(group=group, zeros=zeros, act_order=act_order)
    assert w8.qweight.shape == (N, K) and w8.qweight.dtype == torch.uint8
    assert (w8.zeros is None) == (not zeros)  # symmetric: no zero term at all
    assert (w8.perm is None) == (not act_order or group == -1)  # one group: any order
    assert torch.equal(dequantize_w8(w8, K), ref)


@pytest.mark.parametrize("m", [1, 3, 16, 100])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("zeros,act_order", [(True, False), (False, False), (True, True)])
def test_w8a16_matches_dequantized_linear(m: int, group: int, zeros: bool, act_order: bool):
    w8, ref_w = gptq8_weights(group=group, zeros=zeros, act_order=act_order, seed=m)
    x = _randn(m, K, seed=m)
    torch.testing.assert_close(_run(x, w8), F.linear(x, ref_w), atol=1e-4, rtol=1e-4)


# (block_m, block_n, block_k, split_k, warps, stages, scale_after_dot): split or not, scale on
# the product or per element, K tiles that do not divide K.
CONFIGS = [
    (16, 32, 64, 1, 4, 2, True),
    (16, 32, 64, 3, 4, 2, True),
    (16, 64, 32, 2, 4, 2, False),
    (32, 16, 128, 2, 4, 2, False),
    (64, 32, 64, 1, 4, 2, False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("zeros,act_order", [(True, True), (False, False)])
def test_every_code_path_matches(config: tuple, zeros: bool, act_order: bool) -> None:
    k = 200  # 3 groups of 64 and a ragged one of 8; tiles of 128 straddle groups
    if config[6] and 64 % config[2]:
        pytest.skip("scale on the product needs K tiles within groups")
    w8, ref_w = gptq8_weights(k=k, group=64, zeros=zeros, act_order=act_order)
    bias = _randn(N, seed=5)
    for m in (1, 19):
        x = _randn(m, k, seed=m)
        out = _run(x, w8, bias, W8A16Config(*config))
        torch.testing.assert_close(out, F.linear(x, ref_w, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("zeros,act_order", [(True, True), (False, False)])
def test_dequantize_then_matmul_matches(zeros: bool, act_order: bool) -> None:
    w8, ref_w = gptq8_weights(k=200, group=64, zeros=zeros, act_order=act_order)
    x = _randn(DEQUANT_MIN_M, 200, seed=1)
    bias = _randn(N, seed=2)
    out = _run(x, w8, bias, DEQUANT)
    torch.testing.assert_close(out, F.linear(x, ref_w, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("after_dot", [True, False])
def test_float16_centers_codes_exactly(after_dot: bool) -> None:
    """1024 + q read from the bits, minus 1152: q - 128 with no rounding (fp16 has 10 mantissa
    bits); the only error left is fp16's rounding of x and of the output."""
    w8, ref_w = gptq8_weights(group=64)
    x = _randn(5, K, seed=3, dtype=torch.float16)
    cfg = W8A16Config(16, 32, 64, 2, 4, 2, after_dot)
    out = _run(x, w8, config=cfg)
    assert out.dtype == torch.float16
    ref = F.linear(x.float(), ref_w)
    assert (out.float() - ref).abs().max().item() <= 2e-3 * ref.abs().max().item()


def test_no_rows_and_invalid_inputs() -> None:
    w8, _ = gptq8_weights()
    assert _run(torch.empty(0, K, device=DEV), w8).shape == (0, N)
    x = _randn(2, K, seed=0)
    with pytest.raises(ValueError, match="unsupported inputs"):
        w8a16_linear(x[:, :-4], w8.qweight, w8.scales, w8.zeros, 64)
    with pytest.raises(ValueError, match="int16 zeros"):
        w8a16_linear(x, w8.qweight, w8.scales, w8.zeros.to(torch.int32), 64)
    with pytest.raises(ValueError, match="power of two"):
        _run(x, w8, config=W8A16Config(16, 48, 64, 1, 4, 2, True))
    with pytest.raises(ValueError, match="whole K blocks"):
        _run(x, w8, config=W8A16Config(16, 32, 128, 1, 4, 2, True))


def test_choose_config_by_rows_and_groups() -> None:
    """The kernel up to 128 rows (scale on the product up to 64), cuBLAS on the dequantized
    weight above for 16-bit x; K split so that the Llama-3-8B decode grids cover the SMs."""
    n, k = 4096, 4096
    for m in (1, 16, 64):
        cfg = choose_config(m, n, k, 128)
        assert isinstance(cfg, W8A16Config) and cfg.scale_after_dot
        assert cfg.split_k * (n // cfg.block_n) >= 132
    assert not choose_config(128, n, k, 128).scale_after_dot
    assert choose_config(DEQUANT_MIN_M, n, k, 128) == DEQUANT
    assert isinstance(choose_config(DEQUANT_MIN_M, n, k, 128, elem_bytes=4), W8A16Config)
    assert default_config(1, n, k, 32).block_k == 32  # one scale per row and K tile
    assert default_config(1, n, k, k).scale_after_dot  # one group per row


def test_gptq_qkv_layer_kept_8bit_runs_the_kernel() -> None:
    """A fused QKV layer of an act-order 8-bit GPTQ checkpoint (shards sharing g_idx) repacked
    on this device: its parameters are the 8-bit layout only, and it computes the dequantized
    layer's product, through the kernel and through the per-call reference."""
    from pagoda.model.layers.linear import QKVParallelLinear
    from pagoda.model.quantization import GPTQLinearMethod, W8A16LinearMethod

    method = GPTQLinearMethod({"quant_method": "gptq", "bits": 8, "group_size": 32})
    with torch.device(DEV):
        layer = QKVParallelLinear(64, 16, 4, 2, bias=True, linear_method=method)
    gen = torch.Generator().manual_seed(0)
    g_idx = (torch.arange(64, dtype=torch.int32) // 32)[torch.randperm(64, generator=gen)]
    dense = []
    for sid, n in {"q": 64, "k": 32, "v": 32}.items():
        values = torch.randint(0, 256, (64, n), generator=gen, dtype=torch.int32)
        zeros = torch.randint(0, 255, (2, n), generator=gen, dtype=torch.int32)
        tensors = {
            "qweight": pack_gptq_weight(values, 8),
            "qzeros": pack_gptq_weight(zeros.t().contiguous(), 8).t().contiguous(),
            "scales": (torch.rand(2, n, generator=gen) * 0.01).half(),
            "g_idx": g_idx,
        }
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t.to(DEV), sid)
        dense.append(dequantize_gptq(*tensors.values(), 8))
    layer.bias.data.copy_(_randn(128, seed=1))
    assert method.repack_to_w8a16(layer)
    assert isinstance(layer.linear_method, W8A16LinearMethod) and layer.weight is None
    held = {name: p.dtype for name, p in layer.named_parameters()}
    assert held == {
        "w8_qweight": torch.uint8,
        "w8_scales": torch.float16,
        "w8_zeros": torch.int16,
        "w8_perm": torch.int32,
        "bias": torch.float32,
    }
    ref_w = torch.cat(dense).to(DEV)
    for m in (1, 9):
        x = _randn(m, 64, seed=m)
        torch.testing.assert_close(layer(x), F.linear(x, ref_w, layer.bias), atol=1e-4, rtol=1e-4)
    layer.fused_ops = False  # the reference path: dequantized per call
    x = _randn(3, 64, seed=3)
    torch.testing.assert_close(layer(x), F.linear(x, ref_w, layer.bias), atol=1e-5, rtol=1e-5)


def _checkpoint_builder():
    """tests/model's tiny GPTQ checkpoints (built with `transformers`)."""
    path = os.path.join(os.path.dirname(__file__), "../model/quant_testing.py")
    spec = importlib.util.spec_from_file_location("quant_testing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.quantized_checkpoint


def _load(path, device: str, dtype: str = "float32"):
    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(
        model=str(path), hf_config=hf_config, dtype=dtype, max_model_len=64, quantization="gptq"
    )
    return load_model(mc, device), hf_config


def _kept_8bit(model) -> set[str]:
    from pagoda.model.quantization import W8A16LinearMethod

    return {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(getattr(m, "linear_method", None), W8A16LinearMethod)
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test loads on CUDA instead")
@pytest.mark.parametrize("act_order", [False, True])
def test_tiny_8bit_checkpoint_kept_8bit_gives_the_dequantized_logits(
    tmp_path, monkeypatch, act_order: bool
) -> None:
    """The same 8-bit GPTQ checkpoint loaded twice: dequantized at load (what a CPU does) and
    kept 8-bit (as on CUDA; here the interpreter). Prefill and a decode step give the same
    logits, and the reference model (`transformers` on the dequantized weights) agrees."""
    from model_testing import TINY_CONFIG, PagedRunner

    from pagoda.model import quantization

    hf, path = _checkpoint_builder()(tmp_path, "gptq", 8, act_order)
    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # dequantized, not Q8_0 blocks
    dense, hf_config = _load(path, "cpu")
    assert not _kept_8bit(dense)
    monkeypatch.setattr(quantization, "w8a16_enabled", lambda device: True)
    kept, _ = _load(path, "cpu")
    assert _kept_8bit(kept) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    tokens = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = []
    for model in (dense, kept):
        runner = PagedRunner(model, {**TINY_CONFIG, **hf_config})
        logits.append(torch.cat([runner.step(tokens[:8], 0), runner.step(tokens[8:], 8)]))
    assert (logits[1] - logits[0]).abs().max().item() < 1e-4
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float()
    assert (logits[1] - ref).abs().max().item() < 1e-4


def test_dummy_8bit_gptq_preset_builds_symmetric_8bit_layers(monkeypatch) -> None:
    """`--load-format dummy --quantization gptq` on a config whose quantization_config says 8
    bits, sym (as benchmarks/presets/llama-3-8b-gptq-int8): layers kept 8-bit with no zero
    term, weights of about the dense dummy's size, finite outputs."""
    from model_testing import TINY_CONFIG

    from pagoda.config import ModelConfig
    from pagoda.model import quantization
    from pagoda.model.loader import load_model

    preset = os.path.join(
        os.path.dirname(__file__), "../../benchmarks/presets/llama-3-8b-gptq-int8/config.json"
    )
    with open(preset) as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["sym"]) == ("gptq", 8, True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **TINY_CONFIG,
        "quantization_config": {**qc, "group_size": 32},
    }
    monkeypatch.setattr(quantization, "w8a16_enabled", lambda device: True)
    mc = ModelConfig(
        model="dummy/config.json", hf_config=hf_config, dtype="float32", max_model_len=64,
        quantization="gptq", load_format="dummy",
    )  # fmt: skip
    model = load_model(mc, DEV)
    assert _kept_8bit(model) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    layer = model.model.layers[0].mlp.down_proj
    assert layer.w8_zeros is None and layer.w8_qweight.dtype == torch.uint8
    std = dequantize_w8(layer.linear_method.packed(layer), 96).std().item()
    assert 0.002 < std < 0.05
    y = layer(_randn(3, 96, seed=0))
    assert torch.isfinite(y).all() and y.std() > 0


LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,zeros,act_order", [("qkv", False, False), ("down", True, True)])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 128, 256])
def test_default_dispatch_at_llama8b_shapes(dtype, name, zeros, act_order, m) -> None:
    """Within 1% of the output's range: 16-bit rounding of x, of the weights on the
    per-element and dequantized paths and of y; a wrong byte or group is off by ~100%."""
    n, k = LLAMA3_8B[name]
    w8, ref_w = gptq8_weights(n, k, 128, zeros, act_order, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ref = F.linear(x.float(), ref_w)
    out = _run(x, w8)
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,m", [("qkv", 1), ("down", 16), ("gate_up", 100)])
def test_w8a16_in_a_cuda_graph_replays_exactly(name: str, m: int) -> None:
    from pagoda.kernels.skinny_gemm import prepare

    n, k = LLAMA3_8B[name]
    w8, _ = gptq8_weights(n, k, 128, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    prepare("cuda")
    eager = _run(x, w8)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _run(x, w8)  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(x, w8)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_8bit_checkpoint_kept_8bit_gives_the_dequantized_outputs(
    tmp_path, monkeypatch, act_order, dtype
):
    from pagoda.model.layers.linear import LinearBase

    monkeypatch.setenv("PAGODA_CPU_QUANTIZED", "0")  # the CPU reference: dequantized layers

    _, path = _checkpoint_builder()(tmp_path, "gptq", 8, act_order)
    cpu, _ = _load(path, "cpu")
    gpu, _ = _load(path, "cuda", dtype)
    assert _kept_8bit(gpu) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for name, layer in gpu.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        dense = cpu.get_submodule(name)
        x = torch.randn(5, dense.input_size_per_partition)
        out = layer(x.to("cuda", getattr(torch, dtype))).float().cpu()
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(out, dense(x), **tol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark instead")
def test_w8a16_bench_tiny_run_covers_its_code_paths(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location(
        "w8a16_bench", os.path.join(os.path.dirname(__file__), "../../benchmarks/w8a16_bench.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--tiny", "--sweep", "--zeros", "--shapes", "down", "--m", "1", "3"]
    result = bench.main([*argv, "--out-dir", str(tmp_path / "out")])
    saved = json.loads((tmp_path / "out" / "w8a16_bench.json").read_text())
    assert saved["rows"] == result["rows"]
    assert [(r["shape"], r["m"]) for r in result["rows"]] == [("down", 1), ("down", 3)]
    assert [s["m"] for s in result["summary"]["steps"]] == [1, 3]
    for r in result["rows"]:
        assert r["max_abs_err"] < 1e-4 * r["max_abs_ref"]
        assert r["best_us"] is not None and not r["failures"]
        assert all(r[c + "_us"] > 0 for c in ("w8a16", "kernel", "dequant", "cublas"))
