"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU: triton's bundled ptxas
catches the type and layout errors that the interpreter lets through (loop-carried types,
tl.dot shapes, fp8 casts). Checks that the cache write uses IEEE division and saturating
fp8 conversion. Slow (~1 s a variant): `pytest tests/kernels -m slow`."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import importlib.util  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Triton's own jit helpers (tl.cdiv, tl.sigmoid, ...) are decided once, when triton.language is
# first imported: after an interpreter test imported it with TRITON_INTERPRET=1, they stay
# interpreter functions, which a real compilation cannot call. Then these builds run in a fresh
# process instead (test_sm90_compile_fresh.py).
INTERPRETED_LANG = type(triton.language.cdiv).__name__ == "InterpretedFunction"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(INTERPRETED_LANG, reason="built in a fresh process instead"),
]


def _fresh_module(name: str, **deps):
    """A private copy of a kernel module decorated for real compilation: other test modules
    may have set TRITON_INTERPRET=1 before importing the shared one. `deps` maps module names
    to fresh copies its `from ... import` lines must see (jit helpers it calls)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    shared = {dep: sys.modules.get(dep) for dep in deps}
    try:
        sys.modules.update(deps)
        spec = importlib.util.find_spec(name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for dep, module_before in shared.items():
            if module_before is None:
                sys.modules.pop(dep, None)
            else:
                sys.modules[dep] = module_before
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


rotary = _fresh_module("pagoda.kernels.rotary")
rc = _fresh_module("pagoda.attention.triton.reshape_and_cache", **{"pagoda.kernels.rotary": rotary})
ua = _fresh_module("pagoda.attention.triton.unified_attention")
norm_act = _fresh_module("pagoda.kernels.norm_act")
argmax = _fresh_module("pagoda.kernels.argmax")
gemv = _fresh_module("pagoda.kernels.gemv")

SM90 = GPUTarget("cuda", 90, 32)
I64 = "i64"


def _compile(fn, signature: dict[str, str], constexprs: dict, **options) -> str:
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    kernel = triton.compile(ASTSource(fn, sig, consts), target=SM90, options=options)
    return kernel.asm["ptx"]


def _strides(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, I64)


@pytest.mark.parametrize(
    "q_dtype,cache_dtype,split,block_m,num_heads,group,head_size,options",
    [
        ("bf16", "bf16", False, 16, 32, 4, 128, {}),
        ("bf16", "bf16", True, 16, 32, 4, 128, {"TILE_SIZE": 64}),
        ("fp16", "fp16", False, 64, 9, 3, 64, {}),
        ("bf16", "fp8e4nv", True, 16, 12, 4, 96, {}),
        ("bf16", "i8", False, 64, 32, 4, 128, {}),
        ("fp32", "fp32", False, 16, 8, 2, 80, {}),
    ],
)
def test_unified_attention_compiles_for_sm90(
    q_dtype, cache_dtype, split, block_m, num_heads, group, head_size, options
) -> None:
    sig = {
        "out_ptr": f"*{q_dtype}",
        "q_ptr": f"*{q_dtype}",
        "kv_cache_ptr": f"*{cache_dtype}",
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        "segm_out_ptr": "*fp32",
        "segm_max_ptr": "*fp32",
        "segm_sum_ptr": "*fp32",
        "qk_scale": "fp32",
        "num_reqs": "i32",
        **_strides(
            "stride_q_tok",
            "stride_q_head",
            "stride_o_tok",
            "stride_o_head",
            "stride_c_kv",
            "stride_c_blk",
            "stride_c_slot",
            "stride_c_head",
            "stride_bt",
        ),
    }
    consts = dict(
        NUM_HEADS=num_heads,
        NUM_QUERIES_PER_KV=group,
        BLOCK_SIZE=16,
        TILE_SIZE=32 if block_m == 64 else 16,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_Q=block_m // group,
        BLOCK_M=block_m,
        NUM_SEGMENTS=16 if split else 1,
        IS_SPLIT=split,
        KV_QUANT=cache_dtype in ("fp8e4nv", "i8"),
        DOT_PRECISION="ieee" if q_dtype == "fp32" else "tf32",
        FP16_DOTS=cache_dtype in ("fp8e4nv", "i8") and q_dtype == "bf16",
        HEADS_FASTEST=False,
    )
    consts.update(options)
    ptx = _compile(ua._unified_attention_kernel, sig, consts)
    if q_dtype != "fp32":  # fp32 runs IEEE dots on the FMA units, the rest on tensor cores
        assert "mma" in ptx
    if split:
        reduce_sig = {
            "out_ptr": f"*{q_dtype}",
            "segm_out_ptr": "*fp32",
            "segm_max_ptr": "*fp32",
            "segm_sum_ptr": "*fp32",
            **_strides("stride_o_tok", "stride_o_head"),
        }
        reduce_consts = dict(
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=consts["HEAD_SIZE_PADDED"],
            NUM_SEGMENTS=16,
        )
        _compile(ua._reduce_segments_kernel, reduce_sig, reduce_consts)


@pytest.mark.parametrize(
    "cache_dtype,quant,lo,hi",
    [("bf16", 0, 0.0, 0.0), ("fp8e4nv", 1, -448.0, 448.0), ("i8", 2, -128.0, 127.0)],
)
def test_cache_write_compiles_with_exact_division(cache_dtype, quant, lo, hi) -> None:
    sig = {
        "key_ptr": "*bf16",
        "value_ptr": "*bf16",
        "kv_cache_ptr": f"*{cache_dtype}",
        "slot_mapping_ptr": "*i64",
        "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32",
        **_strides(
            "stride_k_tok",
            "stride_k_head",
            "stride_v_tok",
            "stride_v_head",
            "stride_c_kv",
            "stride_c_blk",
            "stride_c_slot",
            "stride_c_head",
        ),
    }
    consts = dict(
        NUM_KV_HEADS=8,
        HEAD_SIZE=128,
        BLOCK_SIZE=16,
        KV_HEADS_PADDED=8,
        HEAD_SIZE_PADDED=128,
        QUANT=quant,
        Q_MIN=lo,
        Q_MAX=hi,
    )
    for ptx in (
        _compile(rc._reshape_and_cache_kernel, sig, consts),
        # RoPE fused with the same write (Llama-3-8B heads, full rotary).
        _compile(
            rc._rotary_and_cache_kernel,
            {
                "positions_ptr": "*i64",
                "q_ptr": "*bf16",
                **sig,
                "cos_sin_ptr": "*fp32",
                "num_actual_tokens": "i32",
                "num_q_heads": "i32",
                **_strides("stride_q_tok", "stride_q_head", "stride_cs"),
            },
            {
                **consts,
                "HALF": 64,
                "HALF_PADDED": 64,
                "TAIL": 0,
                "TAIL_PADDED": 1,
                "Q_HEADS_PADDED": 32,
            },
        ),
    ):
        if quant:
            assert "div.rn.f32" in ptx and "div.full" not in ptx
        if cache_dtype == "fp8e4nv":
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


# What RMSNorm and SiLU-and-mul write: (type, QMAX, IS_INT), QMAX 0 the model dtype, else the
# 8-bit rows for a W8A8 / FP8 layer (each with the kernels of the rest of a layer once).
QUANT_OUTPUTS = [("*bf16", 0.0, False), ("*i8", 127.0, True), ("*fp8e4nv", 448.0, False)]


@pytest.mark.parametrize("out,qmax,is_int", QUANT_OUTPUTS)
def test_fused_ops_compile_for_sm90(out: str, qmax: float, is_int: bool) -> None:
    _compile(
        norm_act._rms_norm_kernel,
        {
            **dict.fromkeys(["x_ptr", "res_ptr", "w_ptr", "res_out_ptr"], "*bf16"),
            "out_ptr": out,
            **_strides("stride_x", "stride_r", "stride_o", "stride_ro"),
            "scale_ptr": "*fp32",
            "n_cols": "i32",
            "eps": "fp32",
        },
        dict(BLOCK_N=4096, HAS_RESIDUAL=True, PDL=True, QMAX=qmax, IS_INT=is_int),
        num_warps=8,
    )
    if qmax == 0.0:
        _compile(
            norm_act._silu_and_mul_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16", **_strides("stride_x", "stride_o"), "d": "i32"},
            dict(BLOCK=1024, PDL=True),
        )
    else:
        for block, one_pass, warps in ((16384, True, 16), (2048, False, 2)):
            _compile(
                norm_act._silu_and_mul_quant_kernel,
                {
                    "x_ptr": "*bf16",
                    "q_ptr": out,
                    "scale_ptr": "*fp32",
                    **_strides("stride_x", "stride_q"),
                    "d": "i32",
                },
                dict(QMAX=qmax, IS_INT=is_int, BLOCK=block, ONE_PASS=one_pass, PDL=True),
                num_warps=warps,
            )
        return
    _compile(
        rotary._rotary_kernel,
        {
            "positions_ptr": "*i64",
            "q_ptr": "*bf16",
            "k_ptr": "*bf16",
            "cos_sin_ptr": "*fp32",
            **_strides(
                "stride_q_tok", "stride_q_head", "stride_k_tok", "stride_k_head", "stride_cs"
            ),
            "num_q_heads": "i32",
            "num_k_heads": "i32",
        },
        dict(HALF=64, HALF_PADDED=64, Q_HEADS_PADDED=32, K_HEADS_PADDED=8, HAS_K=True),
    )
    _compile(
        argmax._argmax_chunks_kernel,
        {
            "logits_ptr": "*fp32",
            "chunk_max_ptr": "*fp32",
            "chunk_idx_ptr": "*i32",
            "stride_row": I64,
            "vocab": "i32",
            "num_chunks": "i32",
        },
        dict(CHUNK=1024),
    )
    _compile(
        argmax._argmax_rows_kernel,
        {"chunk_max_ptr": "*fp32", "chunk_idx_ptr": "*i32", "out_ptr": "*i64", "num_chunks": "i32"},
        dict(CHUNKS_PADDED=128),
    )
    _compile(
        gemv._gemv_kernel,
        {
            "x_ptr": "*bf16",
            "w_ptr": "*bf16",
            "bias_ptr": "*bf16",
            "y_ptr": "*fp32",
            "N": "i32",
            "K": "i32",
            "stride_w": I64,
        },
        dict(SILU_AND_MUL=True, HAS_BIAS=False, BLOCK_N=16, BLOCK_K=512, NUM_STAGES=3),
    )
