"""The C CPU ops (`pagoda.kernels.cpu`) against their torch references, the layers' dispatch to
them, the fallbacks, and the embedded SmolLM2 with the ops on vs off. The reference comparisons
run once per ISA level this CPU has (the `cpu_isa` fixture); the model tests at the selected one.

The skinny GEMM is checked against a float64 product with the dot-product error bound
(fp32 accumulation, then one rounding to the output dtype), the same bound torch's own
`F.linear` meets; the element-wise ops against `pagoda.kernels.reference` with torch's default
tolerances for the dtype (they round at the same points, so bf16 results differ by at most an
ulp where the fp32 statistics differ in the last bit).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu
from pagoda.kernels.cpu import gemm, ops
from pagoda.kernels.reference import rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref
from pagoda.utils.cpu_build import CpuKernelUnavailable

pytestmark = pytest.mark.skipif(
    not cpu.cpu_ops_available(), reason="C CPU ops unavailable (no C compiler?)"
)

DTYPES = [torch.bfloat16, torch.float32]


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _assert_within_dot_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b) -> None:
    """|y - x @ w.T| <= K * 2^-23 * (|x| @ |w|.T) (fp32 accumulation) + half an ulp of y."""
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    ref = F.linear(x64, w64, None if b is None else b.double())
    mag = F.linear(x64.abs(), w64.abs(), None if b is None else b.double().abs())
    unit = 2.0**-8 if y.dtype is torch.bfloat16 else 2.0**-24
    bound = x.shape[-1] * 2.0**-23 * mag + unit * ref.abs() + 1e-30
    err = (y.double().reshape(ref.shape) - ref).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.2f}"


# ---- skinny GEMM -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (17, 33), (63, 100), (960, 576), (5, 1537)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 16])
def test_linear_matches_float64_product(dtype, n, k, m, cpu_isa):
    x, w = _randn(m, k, dtype=dtype, seed=m), _randn(n, k, dtype=dtype, seed=n)
    b = _randn(n, dtype=dtype, seed=k) if (m + n) % 2 else None
    assert cpu.linear_supported(x, w)
    y = cpu.linear(x, w, b)
    assert y.dtype is dtype and y.shape == (m, n)
    _assert_within_dot_bound(y, x, w, b)
    _assert_within_dot_bound(F.linear(x, w, b), x, w, b)  # the bound is fair: torch meets it


def test_linear_float32_logits_and_layouts(cpu_isa):
    w = _randn(49, 70, dtype=torch.bfloat16)
    x = _randn(2, 3, 80, dtype=torch.bfloat16)[..., 5:75]  # 3-D, strided rows
    y = cpu.linear(x, w, out_dtype=torch.float32)
    assert y.dtype is torch.float32 and y.shape == (2, 3, 49)
    _assert_within_dot_bound(y, x, w, None)
    assert cpu.linear(x[:0], w).shape == (0, 3, 49)
    with pytest.raises(ValueError, match="out_dtype"):
        cpu.linear(x, w, out_dtype=torch.float16)


def test_linear_supported_only_for_few_rows_and_matching_dtypes():
    w = _randn(8, 32, dtype=torch.bfloat16)
    limit = ops.MAX_GEMV_ROWS[torch.bfloat16]
    assert cpu.linear_supported(_randn(limit, 32, dtype=torch.bfloat16), w)
    assert not cpu.linear_supported(_randn(limit + 1, 32, dtype=torch.bfloat16), w)
    assert not cpu.linear_supported(_randn(1, 32, dtype=torch.float32), w)
    assert not cpu.linear_supported(_randn(1, 32, dtype=torch.float16), w.half())
    assert not cpu.linear_supported(_randn(1, 8, dtype=torch.bfloat16), w.t())
    assert not cpu.linear_supported(_randn(2, 16, dtype=torch.bfloat16), w)  # K mismatch


# ---- element-wise ops --------------------------------------------------------------------


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1.6e-2, "atol": 1e-5} if dtype is torch.bfloat16 else {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (5, 576), (40, 4097)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, rows, cols, with_residual, cpu_isa):
    x, w = _randn(rows, cols, dtype=dtype, seed=1), _randn(cols, dtype=dtype, seed=2)
    res = _randn(rows, cols, dtype=dtype, seed=3) if with_residual else None
    ref_out, ref_h = rms_norm_ref(x, w, 1e-6, res)
    x_in, res_in = x.clone(), None if res is None else res.clone()
    assert cpu.rms_norm_supported(x_in, w, res_in)
    out, h = cpu.rms_norm(x_in, w, 1e-6, res_in)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)  # the sum rounds once either way
    if with_residual:  # in place, like vLLM's fused_add_rms_norm
        assert out.data_ptr() == x_in.data_ptr() and h.data_ptr() == res_in.data_ptr()
    else:
        torch.testing.assert_close(x_in, x, rtol=0, atol=0)


def test_rms_norm_without_residual_reads_strided_heads(cpu_isa):
    qkv = _randn(3, 8 * 32, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 32].view(3, 4, 32)  # per-head q_norm input (Qwen3), not one stride
    w = _randn(32, dtype=torch.bfloat16, seed=4)
    out, _ = cpu.rms_norm(q, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(q, w, 1e-6)[0], **_tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 1), (2, 15), (5, 1536), (64, 2049)])
def test_silu_and_mul_matches_reference(dtype, rows, d, cpu_isa):
    x = _randn(rows, 2 * d, dtype=dtype, scale=6.0)
    x[0, 0] = -200.0  # exp overflow side: silu -> -0
    x[0, d - 1] = 120.0  # silu(x) = x
    torch.testing.assert_close(cpu.silu_and_mul(x), silu_and_mul_ref(x), **_tol(dtype))


def _cos_sin_cache(max_position: int, rot: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,rot", [(64, 64), (128, 128), (80, 80), (64, 32)])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rotary_embedding_in_place_on_qkv_views(dtype, head_size, rot, tokens, cpu_isa):
    heads, kv_heads, max_position = 3, 1, 4096
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size]  # 2-D [T, kv * head]
    positions = torch.randint(0, max_position, (tokens,), generator=torch.Generator())
    positions[0] = max_position - 1
    cache = _cos_sin_cache(max_position, rot)
    ref = qkv.clone()
    ref_q = ref[:, : heads * head_size].view(tokens, heads, head_size)
    ref_k = ref[:, heads * head_size : (heads + kv_heads) * head_size]
    rotary_embedding_ref(positions, ref_q, ref_k, cache, head_size)
    assert cpu.rotary_embedding_supported(q, k, cache, head_size)
    out_q, out_k = cpu.rotary_embedding(positions, q, k, cache, head_size)
    assert out_q is q and out_k is k
    torch.testing.assert_close(qkv, ref, **_tol(dtype))
    v = slice((heads + kv_heads) * head_size, None)
    assert torch.equal(qkv[:, v], ref[:, v])  # v untouched


def test_rotary_embedding_rejects_positions_past_the_table(cpu_isa):
    q = _randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        cpu.rotary_embedding(torch.tensor([0, 16]), q, None, _cos_sin_cache(16, 64), 64)


# ---- dispatch and fallback -----------------------------------------------------------------


def test_linear_layer_takes_the_c_gemm_for_decode_rows_only(monkeypatch):
    from pagoda.model.layers.linear import ReplicatedLinear

    calls = []
    monkeypatch.setattr(cpu, "linear", lambda *a, **kw: calls.append(1) or ops.linear(*a, **kw))
    layer = ReplicatedLinear(48, 40, bias=True, params_dtype=torch.bfloat16)
    layer.weight.data.copy_(_randn(40, 48, dtype=torch.bfloat16))
    layer.bias.data.copy_(_randn(40, dtype=torch.bfloat16, seed=1))
    x = _randn(3, 48, dtype=torch.bfloat16, seed=2)
    _assert_within_dot_bound(layer(x), x, layer.weight, layer.bias)
    assert len(calls) == 1
    layer(_randn(17, 48, dtype=torch.bfloat16))  # prefill-sized: torch's GEMM
    layer.fused_ops = False  # the reference path
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    assert len(calls) == 1


@pytest.fixture()
def ops_off(monkeypatch):
    """Yields a function that turns the C ops off through the environment; restores after."""

    def turn_off(value: str = "0") -> None:
        monkeypatch.setenv("PAGODA_CPU_FAST_OPS", value)
        ops.cpu_ops_available.cache_clear()

    yield turn_off
    monkeypatch.delenv("PAGODA_CPU_FAST_OPS", raising=False)
    ops.cpu_ops_available.cache_clear()


def test_env_var_turns_the_c_ops_off(ops_off):
    from pagoda.model.layers.layernorm import RMSNorm

    ops_off("0")
    assert not cpu.cpu_ops_available()
    x = _randn(2, 64, dtype=torch.bfloat16)
    assert not cpu.linear_supported(x, _randn(8, 64, dtype=torch.bfloat16))
    norm = RMSNorm(64).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), norm._norm(x), rtol=0, atol=0)
    ops_off("maybe")
    with pytest.raises(ValueError, match="PAGODA_CPU_FAST_OPS"):
        cpu.cpu_ops_available()


def test_build_failure_falls_back_to_torch(monkeypatch, caplog):
    from pagoda.utils import cpu_build as build

    monkeypatch.setattr(build, "_said", set())  # nothing logged yet in this process

    def unavailable():
        raise CpuKernelUnavailable("no C compiler found (set $CC or install gcc)")

    monkeypatch.setattr(ops, "load_cpu_ops", unavailable)
    # The "pagoda" logger stops propagation once set up; let caplog (on the root) see it.
    monkeypatch.setattr(logging.getLogger("pagoda"), "propagate", True)
    ops.cpu_ops_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not cpu.cpu_ops_available()
        assert "CPU kernels unavailable (no C compiler found" in caplog.text
        assert not cpu.elementwise_supported(_randn(1, 8, dtype=torch.float32))
    finally:
        ops.cpu_ops_available.cache_clear()


# ---- whole models ------------------------------------------------------------------------


def _teacher_forced_logits(model, cfg, fused: bool, tokens: list[int], prompt_len: int):
    """Logits of a prefill of tokens[:prompt_len] then one decode step per further token."""
    from model_testing import PagedRunner

    model.set_fused_ops(fused)
    runner = PagedRunner(model, cfg, num_blocks=128)
    out = [runner.step(tokens[:prompt_len], 0)]
    out += [runner.step(tokens[i : i + 1], i) for i in range(prompt_len, len(tokens))]
    return torch.cat(out)


@pytest.mark.parametrize(
    "case", ["llama_gqa_tied_llama3_rope", "llama_mqa_attention_bias", "qwen3"]
)
def test_tiny_models_with_c_ops_stay_as_close_to_float32(tmp_path, case):
    """fp32: the C path equals torch to rounding. bf16: the C path is no further from the fp32
    logits than torch's bf16 path (both prefill, 11 rows, and decode take the skinny GEMM)."""
    from model_testing import TINY_CASES, TINY_CONFIG, make_tiny_checkpoint

    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    make_tiny_checkpoint(tmp_path, case)
    hf_config = get_model_config_dict(str(tmp_path))
    cfg = {**TINY_CONFIG, **TINY_CASES[case][2], **hf_config}

    def load(dtype: str):
        mc = ModelConfig(model=str(tmp_path), hf_config=hf_config, dtype=dtype, max_model_len=256)
        return load_model(mc, "cpu")

    tokens = torch.randint(0, 128, (15,), generator=torch.Generator().manual_seed(1)).tolist()
    fp32 = load("float32")
    ref = _teacher_forced_logits(fp32, cfg, False, tokens, 11)
    fast32 = _teacher_forced_logits(fp32, cfg, True, tokens, 11)
    torch.testing.assert_close(fast32, ref, rtol=1e-5, atol=1e-5)
    bf16 = load("bfloat16")
    torch_err = (_teacher_forced_logits(bf16, cfg, False, tokens, 11) - ref).abs().max()
    fast_err = (_teacher_forced_logits(bf16, cfg, True, tokens, 11) - ref).abs().max()
    assert fast_err <= 1.25 * torch_err, (fast_err, torch_err)


# bf16 logits of SmolLM2 (|logit| up to ~40) are quantised in steps of up to 0.25: two tokens
# closer than this are a tie at the reference's own resolution.
_NEAR_TIE = 0.5


def test_embedded_model_greedy_tokens_unchanged_by_c_ops(ops_off, monkeypatch):
    """LLM(dtype="bfloat16") with the C ops on (the packed GEMM for every linear layer and the
    logits) vs $PAGODA_CPU_FAST_OPS=0: the same greedy tokens, up to the first step where the
    reference's own choice is a near-tie."""
    from pagoda import LLM, SamplingParams

    calls = []
    packed_linear = gemm.packed_linear
    monkeypatch.setattr(cpu, "linear", lambda *a, **kw: calls.append(1) or ops.linear(*a, **kw))
    monkeypatch.setattr(
        gemm, "packed_linear", lambda *a, **kw: calls.append(2) or packed_linear(*a, **kw)
    )
    llm = LLM(dtype="bfloat16")
    prompts = [
        "The capital of France is",
        "def fib(n):",
        "1, 2, 3, 4,",
        "Once upon a time",
        "A list of prime numbers: 2, 3, 5,",
        "The quick brown fox",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)
    fast = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert 2 in calls, "the fast run did not take the packed C GEMM"
    ops_off("0")  # the packed layers now multiply their unpacked weights with F.linear
    calls.clear()
    ref = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not calls, "the reference run took a C GEMM"
    identical = 0
    for prompt, a, b in zip(prompts, fast, ref):
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is None:
            identical += 1
            continue
        top = max(lp.logprob for lp in b.logprobs[i].values())
        chosen = b.logprobs[i].get(a.token_ids[i])
        assert chosen is not None and top - chosen.logprob <= _NEAR_TIE, (prompt, i)
    assert identical >= len(prompts) // 2


@pytest.mark.slow
def test_embedded_model_bf16_c_ops_as_close_to_float32_as_torch():
    """Teacher-forced on float32 greedy tokens: the bf16 C path's logits are no further from
    the float32 model's than torch's bf16 path, and where either picks another argmax than
    float32, float32's own top two are a near-tie: within 0.25, two rounding steps of a bf16
    logit between 16 and 32, where this model's top logits lie. (The paths' mean logit error
    is ~0.1; on an Intel Xeon with AMX torch's bf16 path flipped a 0.119 gap and the C path's
    AMX tiles a 0.175 one, the register tiles 0.007, on the same prompt.)"""
    from model_testing import PagedRunner

    from pagoda.config import ModelConfig, embedded_model_path
    from pagoda.model.loader import get_model_config_dict, load_model

    path = embedded_model_path()
    cfg = get_model_config_dict(path)
    fp32 = load_model(ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=512))
    bf16 = load_model(ModelConfig(model=path, hf_config=cfg, dtype="bfloat16", max_model_len=512))
    errors, flips = {False: [], True: []}, {False: [], True: []}
    for prompt in ([504, 3458, 282, 4649, 314], list(range(1000, 1012)), [2683, 359, 253]):
        fp32.set_fused_ops(False)
        runner, tokens = PagedRunner(fp32, cfg, num_blocks=128), list(prompt)
        logits = runner.step(tokens, 0)
        for _ in range(24):
            tokens.append(int(logits[-1].argmax()))
            logits = runner.step(tokens[-1:], len(tokens) - 1)
        ref = _teacher_forced_logits(fp32, cfg, False, tokens, len(prompt))
        for fused in (False, True):
            out = _teacher_forced_logits(bf16, cfg, fused, tokens, len(prompt))
            errors[fused].append((out - ref).abs().mean())
            picked, best = out.argmax(-1), ref.argmax(-1)
            for i in (picked != best).nonzero().flatten().tolist():
                flips[fused].append(float(ref[i, best[i]] - ref[i, picked[i]]))
    assert sum(errors[True]) <= 1.2 * sum(errors[False]), errors
    assert all(gap < 0.25 for gap in flips[False] + flips[True]), flips
    assert len(flips[True]) <= len(flips[False]) + 3, flips
