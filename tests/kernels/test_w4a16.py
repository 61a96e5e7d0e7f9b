"""The Triton W4A16 kernel (4-bit weights kept packed) against the checkpoints' dequantization +
F.linear: under the Triton interpreter in float32 (and float16, the 16-bit unpacking) when there
is no GPU, for AWQ and GPTQ (act-order included) weights, a ragged last group, every code path
(split K, per-element or per-tile scales, tile sums of x in the kernel or before it); a GPTQ
QKV layer kept packed; bf16 at Llama-3-8B shapes, the memory of a packed layer and CUDA-graph
replays on the GPU; its sm_90 build without a GPU (slow)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import (
    assert_graph_replays_exactly,
    build_for_sm90,
    enable_interpreter_without_cuda,
    kernel_device,
)

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels import skinny_gemm  # noqa: E402
from pagoda.kernels.w4a16 import (  # noqa: E402
    default_config,
    w4a16_linear,
)
from pagoda.model.quantization.formats import (  # noqa: E402
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq_weight,
)
from pagoda.model.quantization.w4_layout import (  # noqa: E402
    W4Weight,
    awq_to_w4,
    gptq_to_w4,
)

DEV = kernel_device()
LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
N, K, G = 48, 200, 64  # K = 3 groups of 64 and a ragged one of 8


def packed_weights(
    fmt: str, n: int = N, k: int = K, group: int = G, seed: int = 0, device=DEV
) -> tuple[W4Weight, torch.Tensor]:
    """Random 4-bit weights in `fmt` ("awq", "gptq", "gptq_act_order") repacked for the kernel,
    and the reference: the checkpoint format's own dequantization [N, K] float32."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    values = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    if fmt == "awq":
        qw, qz = pack_awq(values), pack_awq(zeros)
        qw, qz, scales = qw.to(device), qz.to(device), scales.to(device)
        return awq_to_w4(qw, qz, scales, group), dequantize_awq(qw, qz, scales, group)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if fmt == "gptq_act_order":
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qw = pack_gptq_weight(values, 4).to(device)
    qz = pack_gptq_weight(zeros.t().contiguous(), 4).t().contiguous().to(device)
    scales, g_idx = scales.to(device), g_idx.to(device)
    w4 = gptq_to_w4(qw, qz, scales, g_idx[None], group)
    return w4, dequantize_gptq(qw, qz, scales, g_idx, 4)


def _randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def _run(x, w4: W4Weight, bias=None, **config):
    m, k = x.shape
    cfg = default_config(m, w4.qweight.shape[0], k, w4.group_size, elem_bytes=x.element_size())
    cfg = cfg._replace(**config)
    return w4a16_linear(
        x, w4.qweight, w4.scales, w4.zeros, w4.group_size, bias, w4.perm, config=cfg
    )


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_act_order"])
@pytest.mark.parametrize("m", [1, 3, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4a16_matches_dequantized_linear(fmt: str, m: int, with_bias: bool) -> None:
    w4, dense = packed_weights(fmt, seed=m)
    assert (w4.perm is not None) == (fmt == "gptq_act_order")
    x = _randn(m, K, seed=m)
    bias = _randn(N, seed=3) if with_bias else None
    out = _run(x, w4, bias)
    assert out.shape == (m, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, F.linear(x, dense, bias), atol=1e-4, rtol=1e-4)


# (block_m, block_n, block_k, split_k, scale_after_dot, pre_sums): N never a multiple of
# block_n; K never of block_k (ragged tiles), split in 1 or 3 (the last split ragged);
# block_k = 128 > G takes per-element scales.
CONFIGS = [
    (16, 32, 64, 1, True, False),
    (16, 16, 32, 3, True, False),
    (64, 32, 32, 3, True, True),
    (16, 32, 64, 3, False, False),
    (32, 16, 128, 1, False, False),
    (128, 32, 64, 1, False, False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
def test_every_code_path_matches(config: tuple, fmt: str) -> None:
    block_m, block_n, block_k, split_k, after_dot, pre_sums = config
    w4, dense = packed_weights(fmt, seed=5)
    x = _randn(70, K, seed=6)
    bias = _randn(N, seed=7)
    out = _run(
        x,
        w4,
        bias,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        split_k=split_k,
        scale_after_dot=after_dot,
        pre_sums=pre_sums,
    )
    torch.testing.assert_close(out, F.linear(x, dense, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("after_dot", [True, False])
def test_float16_unpacks_pairs_of_nibbles(after_dot: bool) -> None:
    """The 16-bit path (two inputs per register, 16 + q in the mantissas): fp16 under the
    interpreter, the same code as bf16 but for the exponent bits."""
    w4, dense = packed_weights("awq", seed=9)
    x = _randn(5, K, seed=10, dtype=torch.float16)
    out = _run(x, w4, scale_after_dot=after_dot)
    assert out.dtype == torch.float16
    ref = F.linear(x.float(), dense)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_one_group_per_row_and_no_rows() -> None:
    w4, dense = packed_weights("awq", k=96, group=96, seed=11)  # group_size -1: one group
    x = _randn(4, 96, seed=12)
    torch.testing.assert_close(_run(x, w4), x @ dense.T, atol=1e-4, rtol=1e-4)
    empty = w4a16_linear(x[:0], w4.qweight, w4.scales, w4.zeros, 96)
    assert empty.shape == (0, N)


def test_split_k_is_deterministic_and_resets_its_counters() -> None:
    w4, _ = packed_weights("gptq", seed=13)
    x = _randn(3, K, seed=14)
    first = _run(x, w4, block_n=16, block_k=32, split_k=3)
    assert not skinny_gemm.prepare(DEV).any()  # shared with the skinny GEMM: back to 0
    assert torch.equal(_run(x, w4, block_n=16, block_k=32, split_k=3), first)


def test_invalid_inputs_raise() -> None:
    w4, _ = packed_weights("awq", seed=15)
    x = _randn(2, K, seed=16)
    with pytest.raises(ValueError, match="unsupported"):
        w4a16_linear(x.double(), w4.qweight, w4.scales, w4.zeros, G)
    with pytest.raises(ValueError, match="unsupported"):
        w4a16_linear(x[:, :192], w4.qweight, w4.scales, w4.zeros, G)  # K does not match
    with pytest.raises(ValueError, match="scales"):
        w4a16_linear(x, w4.qweight, w4.scales[:2], w4.zeros, G)
    with pytest.raises(ValueError, match="perm"):
        w4a16_linear(x, w4.qweight, w4.scales, w4.zeros, G, perm=torch.arange(K, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        _run(x, w4, block_n=48)
    with pytest.raises(ValueError, match="whole K blocks"):
        _run(x, w4, block_k=128, scale_after_dot=True)


@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_default_config_at_llama8b_shapes(name: str) -> None:
    n, k = LLAMA3_8B[name]
    for m in (1, 2, 8, 16, 32, 64, 128, 256, 1024, 8192):
        cfg = default_config(m, n, k, 128)
        stage = cfg.block_n * cfg.block_k // 2 + cfg.block_m * cfg.block_k * 2
        assert 2 * stage * cfg.num_stages <= skinny_gemm.SMEM_BUDGET
        assert skinny_gemm.split_k_plan(k, cfg.block_k, cfg.split_k)[1] == cfg.split_k
        assert 128 % cfg.block_k == 0  # one scale per row and tile
        assert cfg.scale_after_dot == (m <= 64)


def test_gptq_qkv_layer_kept_packed_runs_the_kernel() -> None:
    """A fused QKV layer of an act-order GPTQ checkpoint (shards sharing g_idx) repacked on
    this device: its parameters are the packed layout only, and it computes the dequantized
    layer's product."""
    from pagoda.model.layers.linear import QKVParallelLinear
    from pagoda.model.quantization import GPTQLinearMethod, W4A16LinearMethod

    method = GPTQLinearMethod({"quant_method": "gptq", "bits": 4, "group_size": 32})
    with torch.device(DEV):
        layer = QKVParallelLinear(64, 16, 4, 2, bias=True, linear_method=method)
    gen = torch.Generator().manual_seed(0)
    g_idx = (torch.arange(64, dtype=torch.int32) // 32)[torch.randperm(64, generator=gen)]
    shards = {"q": 64, "k": 32, "v": 32}
    dense = []
    for sid, n in shards.items():
        values = torch.randint(0, 16, (64, n), generator=gen, dtype=torch.int32)
        zeros = torch.randint(0, 15, (2, n), generator=gen, dtype=torch.int32)
        tensors = {
            "qweight": pack_gptq_weight(values, 4),
            "qzeros": pack_gptq_weight(zeros.t().contiguous(), 4).t().contiguous(),
            "scales": (torch.rand(2, n, generator=gen) * 0.05).half(),
            "g_idx": g_idx,
        }
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t.to(DEV), sid)
        dense.append(dequantize_gptq(*tensors.values(), 4))
    layer.bias.data.copy_(_randn(128, seed=1))
    assert method.repack_to_w4a16(layer)
    assert isinstance(layer.linear_method, W4A16LinearMethod)
    assert {name for name, _ in layer.named_parameters()} == {
        "w4_qweight",
        "w4_scales",
        "w4_zeros",
        "w4_perm",
        "bias",
    }
    assert layer.weight is None
    ref_w = torch.cat(dense).to(DEV)
    for m in (1, 9):
        x = _randn(m, 64, seed=m)
        torch.testing.assert_close(layer(x), F.linear(x, ref_w, layer.bias), atol=1e-4, rtol=1e-4)
    layer.fused_ops = False  # the reference path: dequantized per call
    x = _randn(3, 64, seed=3)
    torch.testing.assert_close(layer(x), F.linear(x, ref_w, layer.bias), atol=1e-5, rtol=1e-5)


def _checkpoint_builder():
    """tests/model's tiny AWQ / GPTQ checkpoints (built with `transformers`)."""
    path = os.path.join(os.path.dirname(__file__), "../model/quant_testing.py")
    spec = importlib.util.spec_from_file_location("quant_testing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.quantized_checkpoint


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests load on CUDA instead")
@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_tiny_model_with_packed_layers_gives_transformers_logits(
    tmp_path, monkeypatch, method: str, act_order: bool
) -> None:
    """The whole model with its 4-bit layers kept packed (as on CUDA; here the interpreter):
    prefill and a decode step give the logits of `transformers` on the dequantized weights.
    GPTQ act-order: the shards of one input share their permutation (as AutoGPTQ's, from the
    same Hessian), so every layer stays packed and reads x through it."""
    from model_testing import TINY_CONFIG, PagedRunner

    from pagoda.config import ModelConfig
    from pagoda.model import quantization
    from pagoda.model.loader import get_model_config_dict, load_model
    from pagoda.model.quantization import W4A16LinearMethod

    hf, path = _checkpoint_builder()(tmp_path, method, 4, act_order)
    monkeypatch.setattr(quantization, "w4a16_enabled", lambda device: True)
    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(
        model=str(path), hf_config=hf_config, dtype="float32", max_model_len=64, quantization=method
    )
    model = load_model(mc, "cpu")
    packed = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(getattr(m, "linear_method", None), W4A16LinearMethod)
    }
    all_linears = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert packed == all_linears
    runner = PagedRunner(model, {**TINY_CONFIG, **hf_config})
    tokens = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = torch.cat([runner.step(tokens[:8], 0), runner.step(tokens[8:], 8)])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


@functools.cache
def _llama_weights(name: str, fmt: str = "awq", seed: int = 0):
    """Random 4-bit weights of a Llama-3-8B shape on the GPU (group 128), packed, and their
    dequantized float32 reference."""
    n, k = LLAMA3_8B[name]
    return packed_weights(fmt, n=n, k=k, group=128, seed=seed, device="cuda")


def _assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1% of the output's range: bf16 rounding of x, of the weights on the per-element
    path and of y, fp32 sums in another order; a wrong nibble or group is off by ~100%."""
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,fmt", [("qkv", "awq"), ("down", "gptq_act_order")])
@pytest.mark.parametrize("m", [1, 16, 128, 512])
def test_w4a16_at_llama8b_shapes(name: str, fmt: str, m: int) -> None:
    w4, dense = _llama_weights(name, fmt)
    x = _randn(m, dense.shape[1], seed=m, dtype=torch.bfloat16)
    bias = _randn(dense.shape[0], seed=3, dtype=torch.bfloat16) if m == 16 else None
    ref = F.linear(x.float(), dense, None if bias is None else bias.float())
    out = _run(x, w4, bias)
    assert out.dtype == torch.bfloat16
    _assert_bf16_close(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_layer_takes_a_quarter_of_the_dense_memory() -> None:
    from pagoda.model.layers.linear import MergedColumnParallelLinear
    from pagoda.model.quantization import AWQLinearMethod, W4A16LinearMethod

    n, k = LLAMA3_8B["gate_up"]
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        layer = MergedColumnParallelLinear(k, [n // 2, n // 2], False, AWQLinearMethod(qc))
    for p in layer.parameters():
        p.data.copy_(torch.randint_like(p, 0, 1 << 16) if p.dtype == torch.int32 else 0.01)
    layer.linear_method.process_weights_after_loading(layer)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert isinstance(layer.linear_method, W4A16LinearMethod)
    dense_bytes = n * k * 2
    assert held <= 0.27 * dense_bytes, held / dense_bytes  # K*N/2 + 3 bytes a group and row
    x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    assert layer(x).shape == (4, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,m", [("qkv", 1), ("down", 16), ("gate_up", 128)])
def test_w4a16_in_a_cuda_graph_replays_exactly(name: str, m: int) -> None:
    w4, dense = _llama_weights(name, "gptq_act_order" if name == "down" else "awq")
    x = _randn(m, dense.shape[1], seed=1, dtype=torch.bfloat16)
    graph, out = assert_graph_replays_exactly(
        lambda: _run(x, w4),
        lambda: not skinny_gemm.prepare(x.device).any(),  # counters reset
    )
    x.copy_(_randn(m, dense.shape[1], seed=5, dtype=torch.bfloat16))
    graph.replay()
    _assert_bf16_close(out, F.linear(x.float(), dense))


# A fresh interpreter: a process that imported triton under TRITON_INTERPRET=1 cannot compile
# for real any more (see test_skinny_gemm.py).
_SM90_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda.kernels.w4a16 import _w4a16_kernel as fn, _group_arg, default_config

m, n, k, split = (int(a) for a in sys.argv[1:5])
cfg = default_config(m, n, k, 128)
sig = {p.name: "i32" for p in fn.params if not p.is_constexpr}
sig.update(dict.fromkeys(("x_ptr", "bias_ptr", "y_ptr"), "*bf16"))
sig.update(qw_ptr="*i32", scales_ptr="*fp16", zeros_ptr="*u8", perm_ptr="*i32",
           x_sums_ptr="*fp32", partial_ptr="*fp32", counter_ptr="*i32",
           stride_x="i64", stride_qw="i64", stride_y="i64")
consts = dict(GROUP_SIZE=_group_arg(k, 128, cfg.block_k), HAS_BIAS=True, HAS_PERM=False,
              SCALE_AFTER_DOT=cfg.scale_after_dot, PRE_SUMS=cfg.pre_sums, EVEN_K=True,
              SPLIT=split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
              NUM_STAGES=cfg.num_stages, DOT_PRECISION="tf32")
sig.update(dict.fromkeys(consts, "constexpr"))
aligned = ("x_ptr", "qw_ptr", "y_ptr", "scales_ptr", "zeros_ptr", "partial_ptr", "N", "K",
           "k_per_split", "stride_x", "stride_qw", "magic")
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
src = ASTSource(fn, sig, {(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
print(json.dumps({"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "m,name,split", [(1, "qkv", 4), (16, "down", 1), (64, "o", 2), (512, "gate_up", 1)]
)
def test_default_configs_compile_for_sm90(m: int, name: str, split: int) -> None:
    """A real sm_90 build (no GPU needed): shared memory within the SM's 227 KB, wgmma on the
    unpacked weights, weights copied asynchronously, no int-to-float conversion of the
    weights in the loop, and the split variant's barrier before the counter's release."""
    n, k = LLAMA3_8B[name]
    built = build_for_sm90(_SM90_BUILD, m, n, k, split)
    assert built["shared"] <= 227 * 1024
    ptx = built["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert "cvt.rn.f32.s32" not in ptx and "cvt.rn.f32.u32" not in ptx
    if split > 1:
        body = [
            line.strip() for line in ptx.splitlines() if not line.strip().startswith((".loc", "//"))
        ]
        atom = next(i for i, line in enumerate(body) if "atom.global.gpu.acq_rel.add" in line)
        last_store = max(i for i, line in enumerate(body[:atom]) if "st.global" in line)
        assert any(re.match(r"bar\.sync\s+0", line) for line in body[last_store:atom])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark instead")
def test_w4a16_bench_dry_run_covers_its_code_paths(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location(
        "w4a16_bench", os.path.join(os.path.dirname(__file__), "../../benchmarks/w4a16_bench.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "w4a16.json"
    argv = ["--dry-run", "--shapes", "qkv", "down", "--m", "1", "40", "--out", str(out)]
    result = bench.main(argv)
    assert json.loads(out.read_text())["rows"] == result["rows"]
    rows = result["rows"]
    assert [(r["shape"], r["m"]) for r in rows] == [
        ("qkv", 1),
        ("qkv", 40),
        ("down", 1),
        ("down", 40),
    ]
    assert [s["m"] for s in result["summary"]] == [1, 40]
    assert all(r["max_abs_err"] < 1e-3 for r in rows)
    swept = [r for r in rows if r.get("configs")]
    assert swept and all(r["best_us"] is not None for r in swept)
    # (split > 1, scale after the dot, sums made before): every kernel variant was timed.
    timed = {(c[3] > 1, c[6], c[7]) for r in swept for c in (t["config"] for t in r["configs"])}
    assert timed >= {
        (True, True, False),
        (False, True, False),
        (False, False, False),
        (True, True, True),
    }
    assert any(f["config"] == list(bench.BAD_CONFIG) for r in swept for f in r["failures"])


def test_row_count_is_never_a_compile_time_constant() -> None:
    # Triton turns an integer argument equal to 1 into a constant unless told not to; the
    # kernel's split-K offsets call M.to(...), which a constant lacks: M = 1 (single-stream
    # decode) failed to compile on the H200 before this (run 16). The interpreter does not
    # specialize, so only the flag can be checked here.
    from pagoda.kernels.w4a16 import _w4a16_kernel

    if hasattr(_w4a16_kernel, "params"):  # compiled
        assert [p.do_not_specialize for p in _w4a16_kernel.params if p.name == "M"] == [True]
    else:  # the interpreter's wrapper keeps the decorator's arguments
        assert "M" in _w4a16_kernel.kwargs["do_not_specialize"]


# The few-row kernel (w4a16_skinny.py) and dequantize-then-cuBLAS, and the dispatch between them.


def _linear(x, w4: W4Weight, bias=None, config=None):
    return w4a16_linear(
        x, w4.qweight, w4.scales, w4.zeros, w4.group_size, bias, w4.perm, config=config
    )


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_act_order"])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 130])
@pytest.mark.parametrize("group", [64, 128])
def test_few_row_kernel_matches_dequantized_linear(fmt: str, m: int, group: int) -> None:
    """N = 40 against 32-row tiles, K = 200 against 64- and 128-input tiles (ragged last tile
    and group), split K in 3 (the last split shorter), 16- and 64-row x tiles."""
    from pagoda.kernels.w4a16_skinny import SkinnyConfig

    w4, dense = packed_weights(fmt, n=40, k=K, group=group, seed=m + group)
    x = _randn(m, K, seed=m)
    bias = _randn(40, seed=4)
    block_m = 16 if m <= 16 else 64
    for split in (1, 3):
        cfg = SkinnyConfig(block_m, 32, group, split, 4, 2)
        out = _linear(x, w4, bias, cfg)
        assert out.shape == (m, 40)
        torch.testing.assert_close(out, F.linear(x, dense, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
@pytest.mark.parametrize("planar,scale_w", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_few_row_kernel_many_row_modes_match(fmt: str, planar: bool, scale_w: bool, dtype) -> None:
    """The many-row modes: x reordered into the planes' order (K = 256, two 128-input tiles;
    act order gathered by the same pass) and zero and scale per weight with one accumulator,
    each alone and together, with bias and a split K, against the dequantized linear. With
    K = 200 (no whole tiles) `planar` falls back to the strided loads."""
    from pagoda.kernels.w4a16_skinny import SkinnyConfig, planar_x

    tol = 1e-4 if dtype == torch.float32 else 3e-3
    for k, group, split in ((256, 128, 1), (256, 64, 2), (200, 64, 1)):
        block_k = 128 if group == 128 else 64
        w4, dense = packed_weights(fmt, n=48, k=k, group=group, seed=k + group)
        x = _randn(37, k, seed=31, dtype=dtype)
        bias = _randn(48, seed=32, dtype=dtype)
        cfg = SkinnyConfig(16, 32, block_k, split, 4, 2, planar, scale_w)
        out = _linear(x, w4, bias, cfg)
        want = F.linear(x.float(), dense, bias.float())
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    # The reorder itself: tile t's plane p holds inputs 8 (c // 2) + 2 p + c % 2, c < 32.
    x = torch.arange(256, dtype=torch.float32, device=DEV)[None, :].repeat(3, 1)
    got = planar_x(x, None, 128)[0].long().tolist()
    assert got[:4] == [0, 1, 8, 9] and got[32:34] == [2, 3] and got[128:130] == [128, 129]
    assert sorted(got) == list(range(256))


def test_few_row_kernel_float16_and_one_group() -> None:
    """The 16-bit unpacking (1024 + q in fp16's mantissa) under the interpreter, and a layer
    with one group per row (group_size >= K)."""
    from pagoda.kernels.w4a16_skinny import SkinnyConfig

    w4, dense = packed_weights("gptq_act_order", n=48, k=256, group=128, seed=21)
    x = _randn(5, 256, seed=22, dtype=torch.float16)
    out = _linear(x, w4, config=SkinnyConfig(16, 16, 128, 2, 4, 2))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), F.linear(x.float(), dense), atol=2e-3, rtol=2e-3)
    w4, dense = packed_weights("awq", k=96, group=96, seed=23)
    x = _randn(2, 96, seed=24)
    torch.testing.assert_close(_linear(x, w4), x @ dense.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
@pytest.mark.parametrize("m", [1, 130])
def test_dequantize_then_matmul_matches(fmt: str, m: int) -> None:
    from pagoda.kernels.w4a16 import DEQUANT

    w4, dense = packed_weights(fmt, seed=25)
    x = _randn(m, K, seed=26)
    bias = _randn(N, seed=27)
    out = _linear(x, w4, bias, DEQUANT)
    torch.testing.assert_close(out, F.linear(x, dense, bias), atol=1e-4, rtol=1e-4)


def test_choose_config_by_rows_and_groups() -> None:
    """Without the CUDA decode kernel (`fallback_config`; `test_w4a16_gemv.py` checks when
    that kernel is chosen): few rows take the few-row kernel where the groups hold whole 64- or
    128-input tiles (else this module's kernel), up to 64 rows for wide layers; many 16-bit
    rows the dequantized weight and cuBLAS; this module's kernel in between."""
    from pagoda.kernels.w4a16 import DEQUANT, W4A16Config, choose_config, fallback_config
    from pagoda.kernels.w4a16_skinny import SkinnyConfig

    n, k = LLAMA3_8B["down"]
    for m in (1, 4, 16, 32):
        cfg = fallback_config(m, n, k, 128)
        assert isinstance(cfg, SkinnyConfig) and cfg.block_m >= min(m, 16)
        assert skinny_gemm.split_k_plan(k, cfg.block_k, cfg.split_k)[1] == cfg.split_k
    assert fallback_config(1, n, k, 128).split_k == 16  # deep: twice the splits
    assert fallback_config(32, n, k, 128).split_k == 8  # not twice with 32-row x tiles
    assert fallback_config(32, *LLAMA3_8B["gate_up"], 128).split_k == 1  # about a wave
    assert choose_config(1, n, k, 64).block_k == 64
    assert isinstance(choose_config(1, n, k, 32), W4A16Config)
    # From 33 rows the many-row modes, to 128 rows (256 for wide layers), groups permitting
    for m, block_m in ((33, 64), (64, 64), (65, 128), (128, 128)):
        cfg = fallback_config(m, n, k, 128)
        assert isinstance(cfg, SkinnyConfig) and cfg.planar and cfg.scale_w
        assert cfg.block_m == block_m and cfg.block_m * cfg.block_n == 8192
    gate_up = LLAMA3_8B["gate_up"]
    assert fallback_config(256, *gate_up, 128).planar
    assert fallback_config(257, *gate_up, 128) == DEQUANT
    assert isinstance(fallback_config(64, n, k, 64), W4A16Config)  # no 128-input tiles
    assert isinstance(fallback_config(64, *gate_up, 64), SkinnyConfig)
    assert not fallback_config(64, *gate_up, 64).planar
    assert fallback_config(129, n, k, 128) == DEQUANT  # choose_config: the wgmma kernel (sm_90)
    assert choose_config(1025, n, k, 128) == DEQUANT  # past the wgmma kernel
    assert isinstance(choose_config(1024, n, k, 128, elem_bytes=4), W4A16Config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,fmt", [("qkv", "awq"), ("down", "gptq_act_order")])
@pytest.mark.parametrize("m", [1, 4, 16, 48, 64, 128, 256])
def test_default_dispatch_at_llama8b_shapes(dtype, name: str, fmt: str, m: int) -> None:
    """What `w4a16_linear` runs by default (the few-row kernel with its inline-PTX unpacking,
    in its many-row modes from 33 rows, dequantize-then-cuBLAS) in bf16 and fp16 on the GPU."""
    w4, dense = _llama_weights(name, fmt)
    x = _randn(m, dense.shape[1], seed=m, dtype=dtype)
    bias = _randn(dense.shape[0], seed=3, dtype=dtype) if m == 4 else None
    ref = F.linear(x.float(), dense, None if bias is None else bias.float())
    out = _linear(x, w4, bias)
    assert out.dtype == dtype
    _assert_bf16_close(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_few_row_kernel_in_a_cuda_graph_replays_exactly() -> None:
    """Split K (o at 2 rows: 8 splits), reduced by the last split in split order."""
    from pagoda.kernels.w4a16 import skinny_config

    w4, dense = _llama_weights("o", "awq")
    x = _randn(2, dense.shape[1], seed=1, dtype=torch.bfloat16)
    cfg = skinny_config(2, *dense.shape, 128)
    assert_graph_replays_exactly(
        lambda: _linear(x, w4, config=cfg), lambda: not skinny_gemm.prepare(x.device).any()
    )


_SKINNY_SM90_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda.kernels.w4a16_skinny import _pairs_kernel as fn

block_m, block_n, warps, split, planar, scale_w = (int(a) for a in sys.argv[1:7])
sig = {p.name: "i32" for p in fn.params if not p.is_constexpr}
sig.update(dict.fromkeys(("x_ptr", "bias_ptr", "y_ptr"), "*bf16"))
sig.update(qh_ptr="*i16", scales_ptr="*fp16", zeros_ptr="*u8", perm_ptr="*i32",
           partial_ptr="*fp32", counter_ptr="*i32", offset="fp32",
           stride_x="i64", stride_qh="i64", stride_y="i64")
consts = dict(GROUP_SIZE=128, HAS_BIAS=False, HAS_PERM=False, EVEN_K=True, SPLIT=split > 1,
              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, NUM_STAGES=4,
              DOT_PRECISION="tf32", USE_ASM=True, PLANAR_X=bool(planar), SCALE_W=bool(scale_w))
sig.update(dict.fromkeys(consts, "constexpr"))
aligned = ("x_ptr", "qh_ptr", "y_ptr", "scales_ptr", "zeros_ptr", "partial_ptr", "N", "K",
           "k_per_split", "stride_x", "stride_qh")
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
src = ASTSource(fn, sig, {(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=warps, num_stages=4))
print(json.dumps({"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"],
                  "ttgir": kernel.asm["ttgir"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_m,block_n,warps,split,many_rows",
    [(16, 128, 4, 4, 0), (64, 256, 8, 1, 0), (64, 128, 4, 2, 1)],
)
def test_few_row_kernel_keeps_the_unpacked_tile_in_registers(
    block_m, block_n, warps, split, many_rows
):
    """A real sm_90 build (no GPU needed): the packed halves go from the pipeline's shared
    memory straight into the wgmma operand's registers, unpacked there by the inline PTX; no
    unpacked tile is written to shared memory (no local_alloc of a register tensor). The
    many-row modes scale the weights there too, by packed bf16 PTX."""
    built = build_for_sm90(_SKINNY_SM90_BUILD, block_m, block_n, warps, split, many_rows, many_rows)
    assert built["shared"] <= 227 * 1024
    assert "wgmma.mma_async" in built["ptx"] and "lop3.b32" in built["ptx"]
    assert ("mul.rn.bf16x2" in built["ptx"]) == bool(many_rows)
    ttgir = built["ttgir"]
    assert "dot_op<{opIdx = 0" in ttgir and "elementwise_inline_asm" in ttgir
    allocs = [line for line in ttgir.splitlines() if "ttg.local_alloc %" in line]
    assert allocs == [], allocs
