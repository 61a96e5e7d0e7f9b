"""The bf16 GEMM on packed weights (`pagoda.kernels.cpu.gemm`) against torch's F.linear computed
in float32 from the same bf16 inputs (at every ISA level this CPU has: the `cpu_isa` fixture),
the packed layout, and the linear layers' use of it.

The bound: fp32 accumulation in another order than the reference (K * 2^-23 of |x| @ |w|.T,
the dot-product error bound) plus, for bf16 outputs, one rounding (half an ulp, 2^-9 relative;
2^-8 is allowed so a reference sitting on a rounding boundary cannot flip the check).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu
from pagoda.kernels.cpu import gemm

pytestmark = pytest.mark.skipif(
    not cpu.cpu_ops_available(), reason="C CPU ops unavailable (no C compiler?)"
)

BF16 = torch.bfloat16


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _assert_close_to_fp32_linear(y, x, w, b) -> None:
    x32, w32 = x.float().reshape(-1, x.shape[-1]), w.float()
    b32 = None if b is None else b.float()
    ref = F.linear(x32, w32, b32)
    mag = F.linear(x32.abs(), w32.abs(), None if b is None else b32.abs())
    unit = 2.0**-8 if y.dtype is BF16 else 0.0
    bound = x.shape[-1] * 2.0**-23 * mag + unit * ref.abs() + 1e-30
    err = (y.float().reshape(ref.shape) - ref).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.2f}"


@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 100, 257])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 33), (40, 64), (100, 577), (960, 576), (70, 1537)])
def test_packed_linear_matches_float32_linear(m, n, k, cpu_isa):
    x, w = _randn(m, k, seed=m), _randn(n, k, seed=n + k)
    b = _randn(n, seed=k) if (m + n) % 2 else None
    packed = gemm.pack_weight(w)
    assert gemm.packed_linear_supported(x, packed)
    y = gemm.packed_linear(x, packed, b)
    assert y.dtype is BF16 and y.shape == (m, n)
    _assert_close_to_fp32_linear(y, x, w, b)
    logits = gemm.packed_linear(x, packed, b, out_dtype=torch.float32)
    assert logits.dtype is torch.float32
    _assert_close_to_fp32_linear(logits, x, w, b)
    assert torch.equal(logits.to(BF16), y)  # one rounding of the same fp32 sums


@pytest.fixture
def amx_from_one_row():
    """The AMX tiles for every row count (skipped where they do not run)."""
    if not gemm.amx_active():
        pytest.skip("no AMX tiles here (a CPU without AMX-BF16, or PAGODA_CPU_AMX=0)")
    old = gemm.set_amx_min_rows(1)
    try:
        yield
    finally:
        gemm.set_amx_min_rows(old)


def test_amx_tiles_run_where_the_cpu_has_them():
    """On a CPU with AMX-BF16 the packed GEMM's tiles must be built in and granted (a build or
    an OS refusal that silently kept the register tiles would lose ~2-9x from 16 rows up)."""
    from pagoda.utils import cpu_build as build

    assert gemm.amx_active() == (build.amx_built() and build.os_grants_amx())


@pytest.mark.parametrize("m", [1, 8, 15, 16, 31, 32, 33, 100])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 33), (40, 64), (100, 577), (960, 576), (70, 1537)])
def test_amx_tiles_match_float32_linear(m, n, k, amx_from_one_row):
    """Every tail: rows past a 16-row block, columns past a panel pair, K not a multiple of 32
    (x copied and zero padded, the weights' last pairs through a zeroed tile)."""
    x, w = _randn(m, k, seed=m + 1), _randn(n, k, seed=n + k + 1)
    b = _randn(n, seed=k + 1) if (m + n) % 2 else None
    packed = gemm.pack_weight(w)
    y = gemm.packed_linear(x, packed, b)
    _assert_close_to_fp32_linear(y, x, w, b)
    logits = gemm.packed_linear(x, packed, b, out_dtype=torch.float32)
    _assert_close_to_fp32_linear(logits, x, w, b)
    assert torch.equal(logits.to(BF16), y)


def test_amx_tiles_read_nothing_past_a_row(amx_from_one_row):
    """Strided rows with inf / NaN just past each (K = 64: read in place; K = 33: copied)."""
    for k in (64, 33):
        base = _randn(21, k + 1, seed=k)
        base[:, k] = float("inf")
        base[3, k] = float("nan")
        x, w = base[:, :k], _randn(40, k, seed=5)
        y = gemm.packed_linear(x, gemm.pack_weight(w))
        assert torch.isfinite(y).all()
        _assert_close_to_fp32_linear(y, x, w, None)


def _on_one_thread(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return gemm.packed_linear(x, packed)
    finally:
        torch.set_num_threads(threads)


def test_amx_tiles_sum_as_one_thread_does(amx_from_one_row):
    x, packed = _randn(70, 576, seed=6), gemm.pack_weight(_randn(960, 576, seed=5))
    assert torch.equal(gemm.packed_linear(x, packed), _on_one_thread(x, packed))


def test_pack_layout_and_round_trip():
    w = _randn(37, 9)
    packed = gemm.pack_weight(w)
    assert packed.shape == (3, 5, 16, 2) and packed.packed_shape == (37, 9)
    for n, k in [(0, 0), (36, 8), (17, 3), (20, 6)]:
        assert packed[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert (packed[2, :, 5:] == 0).all() and (packed[:, 4, :, 1] == 0).all()  # padding
    assert torch.equal(gemm.unpack_weight(packed), w)


def test_odd_k_ignores_the_value_past_the_row(cpu_isa):
    """The last pair of an odd K reads one x value; the next one (here inf / NaN) must not
    reach the sum through the zero padding (inf * 0 = NaN)."""
    base = _randn(5, 34, seed=3)
    base[:, 33] = float("inf")
    base[1, 33] = float("nan")
    x, w = base[:, :33], _randn(20, 33, seed=4)  # rows 34 apart: strided
    y = gemm.packed_linear(x, gemm.pack_weight(w))
    assert torch.isfinite(y).all()
    _assert_close_to_fp32_linear(y, x, w, None)


def test_packed_linear_shapes_and_threads(cpu_isa):
    w = _randn(50, 64)
    packed = gemm.pack_weight(w)
    x = _randn(2, 3, 80, seed=1)[..., 8:72]  # 3-D with strided rows
    y = gemm.packed_linear(x, packed)
    assert y.shape == (2, 3, 50)
    _assert_close_to_fp32_linear(y, x, w, None)
    assert gemm.packed_linear(x[:0], packed).shape == (0, 3, 50)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm.packed_linear(x, packed, out_dtype=torch.float16)
    assert not gemm.packed_linear_supported(_randn(2, 63), packed)
    assert not gemm.packed_linear_supported(x.float(), packed)
    # Each output is one thread's sum in a fixed order: the thread count changes nothing.
    big_x, big = _randn(40, 576, seed=6), gemm.pack_weight(_randn(960, 576, seed=5))
    assert torch.equal(gemm.packed_linear(big_x, big), _on_one_thread(big_x, big))


def test_layer_packs_after_loading_and_keeps_the_reference_path(monkeypatch):
    from pagoda.model.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(48, 40, bias=True, params_dtype=BF16)
    w, b = _randn(40, 48), _randn(40, seed=1)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.linear_method.process_weights_after_loading(layer)
    assert gemm.is_packed(layer.weight) and layer.weight.dim() == 4
    assert dict(layer.named_parameters()).keys() == {"weight", "bias"}  # one weight copy
    calls = []
    packed_linear = gemm.packed_linear
    monkeypatch.setattr(
        gemm, "packed_linear", lambda *a, **kw: calls.append(1) or packed_linear(*a, **kw)
    )
    for m in (1, 3, 300):  # decode and prefill rows alike
        x = _randn(m, 48, seed=m)
        _assert_close_to_fp32_linear(layer(x), x, w, b)
    assert len(calls) == 3
    layer.fused_ops = False  # the reference: F.linear on the unpacked weight
    x = _randn(5, 48, seed=2)
    assert torch.equal(layer(x), F.linear(x, w, b))
    assert len(calls) == 3


def test_float32_layers_stay_plain():
    from pagoda.model.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(48, 40, params_dtype=torch.float32)
    layer.linear_method.process_weights_after_loading(layer)
    assert not gemm.is_packed(layer.weight) and layer.weight.shape == (40, 48)


def test_tied_lm_head_keeps_the_plain_embedding(tmp_path):
    """The LM head's packed copy sits beside the weight it shares with the embedding."""
    from model_testing import make_tiny_checkpoint

    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    make_tiny_checkpoint(tmp_path, "llama_gqa_tied_llama3_rope")
    cfg = get_model_config_dict(str(tmp_path))
    mc = ModelConfig(model=str(tmp_path), hf_config=cfg, dtype="bfloat16", max_model_len=64)
    model = load_model(mc, "cpu")
    assert gemm.is_packed(model.model.layers[0].mlp.down_proj.weight)
    emb = model.model.embed_tokens.weight
    assert model.lm_head.weight is emb and emb.dim() == 2
    hidden = _randn(9, emb.shape[1], seed=7)
    logits = model.compute_logits(hidden)
    assert gemm.is_packed(model.lm_head.packed_weight)
    assert "lm_head.packed_weight" not in model.state_dict()
    _assert_close_to_fp32_linear(logits, hidden, emb, None)
    model.set_fused_ops(False)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, emb).float())
