"""ISA levels of the C CPU kernels (`pagoda.utils.cpu_build`): which level a CPU gets,
`$PAGODA_CPU_ISA`, the per-level builds and their cache entries, and the fallbacks."""

from __future__ import annotations

import logging

import pytest

from pagoda.attention.cpu import library
from pagoda.utils import cpu_build as build
from pagoda.utils.cpu_build import CpuKernelUnavailable

AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c avx2 bmi1 bmi2"
ZEN4_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"


def test_levels_follow_the_cpu_flags():
    assert build.supported_isas(AVX2_FLAGS, "x86_64") == ("portable", "avx2")
    assert build.supported_isas(ZEN4_FLAGS, "x86_64") == build.ISA_LEVELS
    assert build.supported_isas("fpu sse2 avx", "x86_64") == ("portable",)  # AVX without FMA
    no_bw = ZEN4_FLAGS.replace("avx512bw", "")  # a level needs all its flags and the lower ones'
    assert build.supported_isas(no_bw, "x86_64") == ("portable", "avx2")
    assert build.supported_isas("fp asimd", "aarch64") == ("portable",)  # ARM: portable only
    assert build.supported_isas(ZEN4_FLAGS, "riscv64") == ("portable",)  # unknown: portable


def test_each_level_has_explicit_flags_and_no_march():
    assert build.isa_compile_flags("portable") == []
    avx2 = build.isa_compile_flags("avx2")
    assert avx2 == ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
    assert set(avx2) < set(build.isa_compile_flags("avx512"))
    assert "-mavx512bf16" in build.isa_compile_flags("avx512_bf16")
    assert not any("march" in f for isa in build.ISA_LEVELS for f in build.isa_compile_flags(isa))
    with pytest.raises(ValueError, match="unknown ISA level"):
        build.isa_compile_flags("sse9")


def test_amx_flags_follow_the_cpu_and_the_env_var(monkeypatch):
    """AMX tiles (the packed GEMM's gemm_amx.h) are built in at avx512_bf16 on a CPU with
    AMX-BF16, unless $PAGODA_CPU_AMX is 0; a compiler that does not know the flags builds
    without them rather than falling back a level."""
    spr = ZEN4_FLAGS + " amx_tile amx_bf16 amx_int8"
    monkeypatch.delenv("PAGODA_CPU_AMX", raising=False)
    monkeypatch.setattr(build, "cpu_flags", lambda: spr)
    assert set(build.AMX_CC_FLAGS) <= set(build.isa_compile_flags("avx512_bf16"))
    assert not set(build.AMX_CC_FLAGS) & set(build.isa_compile_flags("avx512"))
    monkeypatch.setenv("PAGODA_CPU_AMX", "0")
    assert not set(build.AMX_CC_FLAGS) & set(build.isa_compile_flags("avx512_bf16"))
    monkeypatch.setattr(build, "cpu_flags", lambda: ZEN4_FLAGS)
    monkeypatch.delenv("PAGODA_CPU_AMX")
    assert not set(build.AMX_CC_FLAGS) & set(build.isa_compile_flags("avx512_bf16"))
    cc = build._find_compiler()
    assert not build._compiler_takes(cc, ("-mno-such-flag",))
    assert build._compiler_takes(cc, ("-mavx2",))
    monkeypatch.setattr(build, "cpu_flags", lambda: spr)
    monkeypatch.setattr(build, "_compiler_takes", lambda cc, flags: False)
    assert not build.amx_built("avx512_bf16")  # an older compiler: built without the tiles


def test_env_var_forces_a_level_and_rejects_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(build, "cpu_flags", lambda: AVX2_FLAGS)
    monkeypatch.setattr(build, "cpu_arch", lambda: "x86_64")
    monkeypatch.delenv("PAGODA_CPU_ISA", raising=False)
    assert build.selected_isa() == build.best_isa() == "avx2"
    monkeypatch.setenv("PAGODA_CPU_ISA", "portable")
    assert build.selected_isa() == "portable"
    monkeypatch.setenv("PAGODA_CPU_ISA", "AVX2")
    assert build.selected_isa() == "avx2"
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match=r"PAGODA_CPU_ISA=avx512_bf16.*best level is avx2"):
        build.selected_isa()
    monkeypatch.setenv("PAGODA_CPU_ISA", "neon")
    with pytest.raises(ValueError, match="PAGODA_CPU_ISA must be one of"):
        build.selected_isa()


def test_every_level_of_this_cpu_builds_its_own_library(cpu_isa):
    """Each level is its own cache entry (the level is in the key and the name)."""
    from pagoda.kernels.cpu import ops

    assert ops.ops_isa() == cpu_isa  # the library reports the level its -m flags gave it
    attention = library.load_library()
    assert attention.pagoda_paged_attention_bf16dp() == (cpu_isa == "avx512_bf16")
    for source, headers in ((ops.SOURCE, ops.HEADERS), (library.SOURCE, library.HEADERS)):
        assert f"_{cpu_isa}_" in build.build_library(source, headers, cpu_isa).name


def test_a_level_that_does_not_build_falls_back_to_portable(monkeypatch, caplog):
    from pagoda.kernels.cpu import ops

    real = build.build_library
    built = []

    def old_compiler(source, headers=(), isa=None):
        built.append(isa)
        if isa != "portable":
            raise CpuKernelUnavailable("cc: error: unrecognized command-line option '-mavx2'")
        return real(source, headers, isa)

    monkeypatch.setattr(build, "build_library", old_compiler)
    monkeypatch.setattr(build, "selected_isa", lambda: "avx2")
    monkeypatch.delenv("PAGODA_CPU_ISA", raising=False)
    monkeypatch.setattr(logging.getLogger("pagoda"), "propagate", True)
    monkeypatch.setattr(build, "_said", set())
    with caplog.at_level(logging.INFO):
        path, level = build.build_with_fallback(ops.SOURCE, ops.HEADERS)
        build.build_with_fallback(library.SOURCE, library.HEADERS)  # the next kernel: no new line
        build.log_isa(level)
    assert level == "portable" and built[:2] == ["avx2", "portable"] and path.exists()
    assert caplog.text.count("the avx2 build failed") == 1
    assert "CPU kernels: portable" not in caplog.text  # the warning said which level runs
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")  # forced: no silent downgrade
    with pytest.raises(CpuKernelUnavailable, match="mavx2"):
        build.build_with_fallback(ops.SOURCE, ops.HEADERS)


def test_one_line_says_which_level_runs_and_one_why_none_does(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("pagoda"), "propagate", True)
    monkeypatch.setattr(build, "_said", set())
    with caplog.at_level(logging.INFO):
        build.log_isa("avx2")
        build.log_isa("avx2")  # the attention kernel, then the ops
        for _ in range(2):
            build.warn_unavailable(CpuKernelUnavailable("no C compiler found (set $CC)"))
    assert caplog.text.count("CPU kernels: avx2") == 1
    assert caplog.text.count("CPU kernels unavailable (no C compiler found") == 1


@pytest.mark.parametrize(
    "flags,compiler,fast_ops,gguf,expected",
    [
        (AVX2_FLAGS, True, "1", False, "bfloat16"),  # the C kernels: bf16 at every level
        (ZEN4_FLAGS, True, "1", False, "bfloat16"),
        (AVX2_FLAGS, False, "1", False, "float32"),  # torch's bf16 GEMM is slow below AVX512_BF16
        (AVX2_FLAGS, True, "0", False, "float32"),
        (ZEN4_FLAGS, False, "0", False, "bfloat16"),
        (AVX2_FLAGS, True, "1", True, "float32"),  # GGUF blocks stay quantized in float32
        (ZEN4_FLAGS, True, "1", True, "float32"),
        (ZEN4_FLAGS, False, "1", True, "bfloat16"),  # no compiler: dequantized, torch's rule
        (AVX2_FLAGS, False, "1", True, "float32"),
    ],
)
def test_auto_dtype_on_a_cpu(monkeypatch, flags, compiler, fast_ops, gguf, expected):
    from pagoda.engine.arg_utils import resolve_dtype

    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(build, "compiler_available", lambda: compiler)
    monkeypatch.setenv("PAGODA_CPU_FAST_OPS", fast_ops)
    hf_config = {"quantization_config": {"quant_method": "gguf"}} if gguf else {}
    assert resolve_dtype("auto", hf_config, "cpu") == expected
    assert resolve_dtype("auto", hf_config, "cpu", "gguf") == expected
    assert resolve_dtype("float32", hf_config, "cpu") == "float32"  # an explicit dtype stays
    # FP8 asked of a GGUF file: its blocks dequantized at load, so the rule of dense models
    dense = resolve_dtype("auto", {}, "cpu")
    assert resolve_dtype("auto", hf_config, "cpu", "fp8") == dense


@pytest.mark.parametrize(
    "flags,compiler,isa,dtype,device,backend,expected",
    [
        (AVX2_FLAGS, True, "", "float32", "cpu", None, "float16"),  # the C kernel widens halves
        (ZEN4_FLAGS, True, "", "float32", "cpu", "cpu", "float16"),
        (ZEN4_FLAGS, True, "portable", "float32", "cpu", None, "float32"),  # no F16C there
        (AVX2_FLAGS, False, "", "float32", "cpu", None, "float32"),  # torch attention
        (AVX2_FLAGS, True, "", "float32", "cpu", "torch", "float32"),
        (AVX2_FLAGS, True, "", "bfloat16", "cpu", None, "bfloat16"),  # the model dtype
        (AVX2_FLAGS, True, "", "float32", "cuda", None, "float32"),
    ],
)
def test_auto_kv_cache_dtype(monkeypatch, flags, compiler, isa, dtype, device, backend, expected):
    from pagoda.engine.arg_utils import resolve_kv_cache_dtype

    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(build, "cpu_arch", lambda: "x86_64")
    monkeypatch.setattr(build, "compiler_available", lambda: compiler)
    monkeypatch.setenv(build.ISA_ENV, isa)
    assert resolve_kv_cache_dtype("auto", dtype, device, backend) == expected
    assert resolve_kv_cache_dtype("float32", dtype, device, backend) == "float32"  # explicit
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("half", dtype, device, backend)
