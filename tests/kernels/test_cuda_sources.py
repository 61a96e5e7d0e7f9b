"""The CUDA kernels' sources, assembled as their Python sides hand them to NVRTC (shared
headers, -D defines, the generated wgmma wrappers), compile with nvcc for sm_90a without
spilling: no GPU needed, so a broken source or header fails here rather than on the next GPU
run. Marked `slow`; skipped where there is no nvcc."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pagoda.kernels import cuda_launch, w4a16_gemv, w4a16_wgmma, w8a8_wgmma

NVCC = shutil.which("nvcc")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)"),
]


def _captured(monkeypatch, build) -> tuple[str, dict]:
    """The source and defines `build()` hands to `cuda_launch.build`."""
    got = []

    def fake(source, name, defines, what, smem=0, compute_capability=None):
        got.append((source, dict(defines)))
        return None

    monkeypatch.setattr(cuda_launch, "build", fake)
    build()
    assert len(got) == 1
    return got[0]


def _nvcc(tmp_path, source: str, defines: dict) -> str:
    path = tmp_path / "kernel.cu"
    path.write_text("".join(f"#define {k} {v}\n" for k, v in defines.items()) + source)
    out = subprocess.run(
        [NVCC, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin"), str(path)]
        + ["-Xptxas", "-v", "--use_fast_math"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


W8A8 = [
    (int8, cfg)
    for int8 in (True, False)
    for cfg in (
        w8a8_wgmma.WgmmaW8A8Config(64, 64, 6, 2),
        w8a8_wgmma.WgmmaW8A8Config(128, 128, 4),
        w8a8_wgmma.WgmmaW8A8Config(128, 256, 4),
        w8a8_wgmma.WgmmaW8A8Config(128, 128, 4, cm=2),
        w8a8_wgmma.WgmmaW8A8Config(64, 64, 6, 2, cm=2, cn=2),
        w8a8_wgmma.WgmmaW8A8Config(128, 128, 6, ck=2),
        w8a8_wgmma.WgmmaW8A8Config(128, 256, 4, ck=4),
        w8a8_wgmma.WgmmaW8A8Config(64, 64, 6, 2, ck=2),
    )
]


@pytest.mark.parametrize("int8,cfg", W8A8, ids=lambda v: getattr(v, "name", str(v)))
def test_w8a8_wgmma_compiles_without_spills(monkeypatch, tmp_path, int8, cfg) -> None:
    source, defines = _captured(monkeypatch, lambda: w8a8_wgmma._compile(int8, True, cfg, True))
    log = _nvcc(tmp_path, source, defines)
    assert "0 bytes spill stores" in log, log


@pytest.mark.parametrize(
    "cfg,split",
    [
        (w4a16_wgmma.WgmmaConfig(), w4a16_wgmma.SPLIT_GLOBAL),
        (w4a16_wgmma.WgmmaConfig(bn=256, stages=3, a_buffers=1), w4a16_wgmma.SPLIT_GLOBAL),
        (w4a16_wgmma.WgmmaConfig(ctas_per_sm=2, a_buffers=1), w4a16_wgmma.SPLIT_CLUSTER),
        (w4a16_wgmma.WgmmaConfig(bn=192), w4a16_wgmma.SPLIT_CLUSTER),
        (w4a16_wgmma.WgmmaConfig(warpgroups=4, a_buffers=1), w4a16_wgmma.SPLIT_CLUSTER),
    ],
    ids=str,
)
def test_w4a16_wgmma_compiles_without_spills(monkeypatch, tmp_path, cfg, split) -> None:
    source, defines = _captured(
        monkeypatch, lambda: w4a16_wgmma._compile(True, True, cfg, False, split)
    )
    log = _nvcc(tmp_path, source, defines)
    assert "0 bytes spill stores" in log, log


def test_w4a16_gemv_compiles(tmp_path) -> None:
    cfg = w4a16_gemv.GemvConfig()
    defines = w4a16_gemv.defines(True, True, 1, cfg, False, False, 1, False)
    _nvcc(tmp_path, w4a16_gemv.source(), defines)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("sc_early", ["0", "1"])
def test_w4a16_gemv_rule_configs_compile_without_spills(
    tmp_path, monkeypatch, m, silu_mul, sc_early
) -> None:
    """The rule's config of a 4-bit gate_up layer (sm_90: the ring, the scale rows asked into
    L2), as a GEMV and with silu(gate) * up in its epilogue, with and without the first scales
    loaded early (PAGODA_W4A16_SC_EARLY)."""
    from pagoda.kernels.w4a16 import gemv_config

    monkeypatch.setenv("PAGODA_W4A16_SC_EARLY", sc_early)
    cfg = gemv_config(m, 28672, 4096, 128)
    assert cfg.sc_early == int(sc_early)
    m_tiles = -(-m // 8)
    defines = w4a16_gemv.defines(True, True, m_tiles, cfg, False, False, 1, silu_mul)
    log = _nvcc(tmp_path, w4a16_gemv.source(), defines)
    assert "0 bytes spill stores" in log, log


@pytest.mark.parametrize("cache", ["e4m3", "e5m2", "16bit"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode_compiles_without_spills(tmp_path, cache, group) -> None:
    """The decode attention kernel at the launch shapes `_LAUNCH` gives each cache kind, bf16
    and fp16 q."""
    from pagoda.attention.cuda import paged_decode

    warps, stages = paged_decode._LAUNCH[cache]
    source = paged_decode._source(group, 16, cache, group != 8, warps, stages)
    log = _nvcc(tmp_path, source, {})
    assert "0 bytes spill stores" in log, log
