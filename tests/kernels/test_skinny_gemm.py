"""The Triton skinny GEMM (2..256 rows, one row tile or several, split-K reduced in the kernel)
against F.linear: under the Triton interpreter in float32 when there is no GPU; bf16 at
Llama-3-8B shapes, in CUDA graphs, on the GPU; its sm_90 build (shared memory, wgmma, the
barrier before the counter's release) without a GPU (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from kernel_testing import enable_interpreter_without_cuda, kernel_device

enable_interpreter_without_cuda()
pytest.importorskip("triton")

from pagoda.kernels import skinny_gemm  # noqa: E402
from pagoda.kernels.skinny_gemm import (  # noqa: E402
    default_config,
    prepare,
    skinny_linear,
    split_k_plan,
)

DEV = kernel_device()
LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


# (N, K, BLOCK_N, BLOCK_K, SPLIT_K): N never a multiple of BLOCK_N; K in 1, 2 (64 + 32) and
# 3 ragged splits (48 + 48 + 8, K not a multiple of BLOCK_K either).
CONFIGS = [(40, 96, 16, 32, 1), (40, 96, 16, 32, 2), (50, 104, 32, 16, 3)]


@pytest.mark.parametrize("n,k,block_n,block_k,split_k", CONFIGS, ids=str)
@pytest.mark.parametrize("m", [2, 5, 16, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_linear(m, n, k, block_n, block_k, split_k, with_bias) -> None:
    x, w = _randn(m, k, seed=m), _randn(n, k, seed=k)
    bias = _randn(n, seed=3) if with_bias else None
    out = skinny_linear(x, w, bias, block_n=block_n, block_k=block_k, split_k=split_k)
    assert out is not None and out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [33, 100, 200])
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_m_tiles_match_linear(m: int, block_m: int, split_k: int, with_bias: bool) -> None:
    # 2..13 row tiles, the last one ragged (but 64 | 200 - 8); 2 N tiles, the last ragged;
    # split_k 3: K = 48 + 48 + 8, ragged at the end.
    x, w = _randn(m, 104, seed=m), _randn(50, 104, seed=block_m)
    bias = _randn(50, seed=3) if with_bias else None
    cfg = dict(block_n=32, block_k=16, split_k=split_k, block_m=block_m)
    out = skinny_linear(x, w, bias, **cfg)
    assert out is not None and out.shape == (m, 50)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), atol=1e-4, rtol=1e-4)
    assert not prepare(DEV).any()


def test_m_tiles_split_k_is_deterministic_and_resets_every_tile_counter() -> None:
    # 4 N tiles x 4 M tiles (the last of 4 rows): 16 counters, each counted to 3 and reset.
    x, w, bias = _randn(100, 104, seed=1), _randn(50, 104, seed=2), _randn(50, seed=3)
    cfg = dict(block_n=16, block_k=16, split_k=3, block_m=32)
    first = skinny_linear(x, w, bias, **cfg)
    assert not prepare(DEV).any()
    assert torch.equal(skinny_linear(x, w, bias, **cfg), first)
    assert not prepare(DEV).any()
    one_tile = skinny_linear(x, w, bias, block_n=16, block_k=16, split_k=3)
    torch.testing.assert_close(first, one_tile, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first, torch.nn.functional.linear(x, w, bias), atol=1e-4, rtol=1e-4)


def test_m_tiles_count_splits_at_their_own_counter_m_tile_fastest() -> None:
    # The interpreter runs a tile's splits back to back, so a counter shared by M tiles would
    # still sum right here (on the GPU they interleave). Owe tile (n 1, m 2) of 4 x 4 one
    # arrival at its counter 1 * 4 + 2: no split of it is the last (its counter ends at
    # -1 + 3, its rows unreduced), every other tile is stored and resets its own counter.
    x, w = _randn(100, 104, seed=1), _randn(50, 104, seed=2)
    counters = prepare(DEV)
    counters[6] = -1
    try:
        out = skinny_linear(x, w, block_n=16, block_k=16, split_k=3, block_m=32)
        assert counters[6].item() == 2 and counters.count_nonzero().item() == 1
    finally:
        counters.zero_()
    done = torch.ones_like(out, dtype=torch.bool)
    done[64:96, 16:32] = False
    ref = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(out[done], ref[done], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_m", [8, 48, 96])
def test_block_m_must_be_a_power_of_two_of_at_least_16(block_m: int) -> None:
    x, w = _randn(40, 64, seed=1), _randn(24, 64, seed=2)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        skinny_linear(x, w, block_m=block_m)


def test_split_k_plan_takes_whole_blocks_and_no_empty_splits() -> None:
    assert split_k_plan(96, 32, 2) == (64, 2)
    assert split_k_plan(104, 16, 3) == (48, 3)
    assert split_k_plan(64, 32, 8) == (32, 2)  # 2 blocks: 2 splits, not 8
    assert split_k_plan(4096, 256, 3) == (1536, 3)


def test_split_k_is_deterministic_and_resets_its_counters() -> None:
    x, w, bias = _randn(33, 104, seed=1), _randn(50, 104, seed=2), _randn(50, seed=3)
    cfg = dict(block_n=16, block_k=16, split_k=3)
    first = skinny_linear(x, w, bias, **cfg)
    assert not prepare(DEV).any()  # back to 0: the next call (or graph replay) starts clean
    # A counter left at 1 would make every split of that tile miss the last-arrival test.
    assert torch.equal(skinny_linear(x, w, bias, **cfg), first)
    assert not prepare(DEV).any()
    unsplit = skinny_linear(x, w, bias, block_n=16, block_k=16, split_k=1)
    torch.testing.assert_close(first, unsplit, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [5, 200])
def test_default_config_runs_and_matches_linear(m: int) -> None:
    x, w = _randn(m, 96, seed=4), _randn(40, 96, seed=5)
    torch.testing.assert_close(skinny_linear(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(LLAMA3_8B))
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_default_config_fits_shared_memory_and_splits_k_evenly(name: str, elem_bytes) -> None:
    n, k = LLAMA3_8B[name]
    for m in (2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256):
        block_n, block_k, split_k, num_warps, num_stages = default_config(
            m, n, k, elem_bytes=elem_bytes
        )
        block_m = skinny_gemm.block_m_for(m)
        stage_bytes = (block_n + block_m) * block_k * elem_bytes
        # fp32 at 65..128 rows: the sweep's 16-bit rule, not refit (fp32 decodes take <= 64)
        if elem_bytes == 2 or m <= 64 or m > 128:
            assert stage_bytes * num_stages <= skinny_gemm.SMEM_BUDGET
        assert split_k_plan(k, block_k, split_k)[1] == split_k
        assert num_warps in (4, 8) and num_stages >= 2
        # At most 128 fp32 accumulators a thread.
        assert block_n * block_m <= 128 * 32 * num_warps


# The H200 sweep's choices (run13-sweeps) up to 128 rows: the M-tile option leaves them be.
SWEPT_DEFAULTS = {  # at M = 2, 32, 64, 128
    "qkv": [(64, 256, 1, 4, 4), (64, 256, 1, 4, 4), (64, 128, 1, 4, 4), (64, 128, 1, 4, 4)],
    "o": [(64, 256, 1, 4, 4), (64, 256, 1, 4, 4), (64, 128, 1, 4, 4), (64, 128, 1, 4, 4)],
    "gate_up": [(128, 128, 1, 4, 4), (128, 128, 1, 4, 4), (128, 128, 1, 4, 4), (128, 128, 1, 4, 3)],
    "down": [(64, 128, 4, 4, 3), (64, 256, 2, 4, 4), (64, 128, 2, 4, 4), (64, 128, 2, 4, 4)],
    "lm_head": [(128, 128, 1, 4, 4), (128, 128, 1, 4, 4), (128, 128, 1, 4, 4), (128, 128, 1, 4, 3)],
}


@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_default_config_up_to_128_rows_is_the_swept_one(name: str) -> None:
    n, k = LLAMA3_8B[name]
    assert [default_config(m, n, k) for m in (2, 32, 64, 128)] == SWEPT_DEFAULTS[name]


def test_preferred_where_the_sweep_beat_cublas() -> None:
    qkv, gate_up = LLAMA3_8B["qkv"], LLAMA3_8B["gate_up"]
    assert skinny_gemm.preferred(2, *qkv) and skinny_gemm.preferred(32, *qkv)
    assert not skinny_gemm.preferred(48, *qkv) and skinny_gemm.preferred(64, *gate_up)
    assert not skinny_gemm.preferred(1, *qkv)  # one row: the GEMV
    assert not skinny_gemm.preferred(96, *gate_up)


def test_unsupported_inputs_return_none() -> None:
    w = _randn(24, 64, seed=6)
    x = _randn(4, 64, seed=7)
    assert skinny_linear(x[:1], w) is None  # one row: the GEMV's job
    assert skinny_linear(_randn(257, 64, seed=8), w) is None
    assert skinny_linear(x.to(torch.int32), w.to(torch.int32)) is None
    assert skinny_linear(x.double(), w.double()) is None
    assert skinny_linear(x, w.double()) is None
    assert skinny_linear(x[:, :60], w[:, :60].contiguous()) is None  # K not a multiple of 8
    assert skinny_linear(x, _randn(64, 24, seed=9).T) is None  # column-major weight
    assert skinny_linear(_randn(64, 4, seed=10).T, w) is None  # x columns strided
    assert skinny_linear(x[None], w) is None  # 3-D
    assert skinny_linear(x, w, _randn(23, seed=11)) is None
    if torch.cuda.is_available():
        assert skinny_linear(x.cpu(), w.cpu()) is None
    with pytest.raises(ValueError, match="power of two"):
        skinny_linear(x, w, block_n=48)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qkv", "down"])
@pytest.mark.parametrize("m", [2, 16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_skinny_linear_at_llama8b_shapes(name: str, m: int, dtype: torch.dtype) -> None:
    n, k = LLAMA3_8B[name]
    x = _randn(m, k, seed=m, dtype=dtype)
    w = _randn(n, k, seed=2, dtype=dtype) * 0.02
    bias = _randn(n, seed=3, dtype=dtype) if m == 16 else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    out = skinny_linear(x, w, bias)
    # fp32 accumulation in another order, one rounding to 16 bits: within 2 ulps.
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,m", [("qkv", 16), ("down", 64), ("gate_up", 128)])
def test_skinny_linear_in_a_cuda_graph_replays_exactly(name: str, m: int) -> None:
    n, k = LLAMA3_8B[name]
    x = _randn(m, k, seed=1, dtype=torch.bfloat16)
    w = _randn(n, k, seed=2, dtype=torch.bfloat16) * 0.02
    eager = skinny_linear(x, w)  # compiles, and makes the counters, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)  # split order fixed: the same bits every replay
        assert not prepare(x.device).any()
    x.copy_(_randn(m, k, seed=5, dtype=torch.bfloat16))
    graph.replay()
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "name,m,cfg",
    [
        ("o", 192, dict(block_n=128, block_k=64, split_k=2, num_warps=8, num_stages=4, block_m=64)),
        (
            "down",
            100,
            dict(block_n=64, block_k=64, split_k=4, num_warps=8, num_stages=4, block_m=64),
        ),
        ("gate_up", 256, dict(block_n=128, block_k=64, num_warps=8, num_stages=4, block_m=128)),
        ("qkv", 200, {}),  # the placeholder default: one 256-row tile
    ],
)
def test_m_tiles_at_llama8b_shapes_replay_exactly(name: str, m: int, cfg: dict) -> None:
    n, k = LLAMA3_8B[name]
    x = _randn(m, k, seed=1, dtype=torch.bfloat16)
    w = _randn(n, k, seed=2, dtype=torch.bfloat16) * 0.02
    eager = skinny_linear(x, w, **cfg)
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(eager.float(), ref, atol=2e-2, rtol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, **cfg)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)  # M tiles' splits interleave; the sums stay in order
        assert not prepare(x.device).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_first_split_call_inside_a_capture_names_prepare() -> None:
    x = _randn(16, 4096, seed=1, dtype=torch.bfloat16)
    w = _randn(4096, 4096, seed=2, dtype=torch.bfloat16)
    skinny_linear(x, w, split_k=1)  # compiled outside; no counters needed
    saved = skinny_gemm._COUNTERS.pop(x.device, None)
    try:
        with pytest.raises(RuntimeError, match="prepare"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                skinny_linear(x, w, split_k=4)
    finally:
        skinny_gemm._COUNTERS.pop(x.device, None)
        if saved is not None:
            skinny_gemm._COUNTERS[x.device] = saved


# Run in a fresh interpreter: a process that imported triton under TRITON_INTERPRET=1 (this
# module does, without a GPU) builds triton.language's own helpers for the interpreter and
# cannot compile for real any more.
_SM90_BUILD = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda.kernels.skinny_gemm import _skinny_gemm_kernel as fn, block_m_for, default_config

dtype, m, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = json.loads(sys.argv[5]) or [*default_config(m, n, k), block_m_for(m)]
block_n, block_k, split_k, num_warps, num_stages, block_m = cfg
sig = {p.name: "i32" for p in fn.params if not p.is_constexpr}
sig.update(dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "y_ptr"), "*" + dtype))
sig.update(partial_ptr="*fp32", counter_ptr="*i32", stride_x="i64", stride_w="i64", stride_y="i64")
consts = dict(HAS_BIAS=True, EVEN_K=True, SPLIT=True, BLOCK_M=block_m, BLOCK_N=block_n,
              BLOCK_K=block_k, NUM_STAGES=num_stages, DOT_PRECISION="tf32",
              W_EVICTION="evict_first" if block_m >= m else "")
sig.update(dict.fromkeys(consts, "constexpr"))
# The runtime specializes 16-aligned pointers and 16-divisible sizes: say so, as a launch would.
aligned = ("x_ptr", "w_ptr", "y_ptr", "partial_ptr", "N", "K", "k_per_split", "stride_x")
aligned += ("M",) * (m % 16 == 0)
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
src = ASTSource(fn, sig, {(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=num_warps, num_stages=num_stages))
# Registers and the local-memory stack (where spills go), from the cubin: Triton ships cuobjdump.
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(kernel.asm["cubin"])
    f.flush()
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                           text=True, check=True).stdout
regs, stack = map(int, re.search(r"REG:(\\d+) STACK:(\\d+)", usage).groups())
print(json.dumps({"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"], "regs": regs,
                  "stack": stack}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,m,name,cfg",
    [
        ("bf16", 2, "qkv", None),
        ("bf16", 128, "down", None),
        ("fp16", 64, "lm_head", None),
        ("bf16", 256, "down", None),  # the placeholder past 128 rows: one 256-row tile
        ("bf16", 192, "o", [128, 64, 2, 8, 4, 64]),  # 3 M tiles, split K
        ("bf16", 100, "qkv", [64, 64, 2, 8, 3, 128]),  # M not a multiple of 16
    ],
)
def test_configs_compile_for_sm90(dtype: str, m: int, name: str, cfg: list | None) -> None:
    """A real sm_90 build (no GPU needed) of the split variant: shared memory within the SM's
    227 KB, wgmma, and a CTA barrier between the partial stores and the one thread's release
    of the counter (else other threads' partials need not be visible to the last split); past
    128 rows no spills to local memory either."""
    n, k = LLAMA3_8B[name]
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _SM90_BUILD, dtype, str(m), str(n), str(k), json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.splitlines()[-1])
    assert built["shared"] <= 227 * 1024
    if m > 128 or cfg is not None:
        assert built["stack"] == 0, built["regs"]
    ptx = built["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx
    body = [
        line.strip() for line in ptx.splitlines() if not line.strip().startswith((".loc", "//"))
    ]
    atom = next(i for i, line in enumerate(body) if "atom.global.gpu.acq_rel.add" in line)
    last_store = max(i for i, line in enumerate(body[:atom]) if "st.global" in line)
    assert any(re.match(r"bar\.sync\s+0", line) for line in body[last_store:atom])


def _load_sweep():
    spec = importlib.util.spec_from_file_location(
        "gemm_sweep", os.path.join(os.path.dirname(__file__), "../../benchmarks/gemm_sweep.py")
    )
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep instead")
def test_gemm_sweep_dry_run_reports_timings_skips_and_a_summary(tmp_path) -> None:
    sweep = _load_sweep()
    out = tmp_path / "sweep.json"
    argv = ["--dry-run", "--jobs", "0", "--shapes", "down", "--m", "5", "160", "--out", str(out)]
    result = sweep.main(argv)
    assert json.loads(out.read_text())["summary"] == result["summary"]
    few, many = result["rows"]
    assert result["config_names"][-1] == "block_m"
    assert few["m"] == 5 and few["max_abs_err"] < 1e-4 and few["default_us"] is not None
    assert any(c["config"][2] > 1 for c in few["configs"])  # split-K configs were timed
    assert [f["config"] for f in few["failures"]] == [list(sweep.BAD_CONFIG)]
    assert many["m"] == 160 and many["max_abs_err"] < 1e-4 and many["default_us"] is not None
    assert many["default_config"][-1] == 256  # the default: one row tile
    timed = [c["config"] for c in many["configs"]]
    assert any(c[-1] < 160 and c[2] > 1 for c in timed)  # M tiles, split K
    assert any(c[-1] < 160 and c[2] == 1 for c in timed)
    assert [s["m"] for s in result["summary"]] == [5, 160]


def test_gemm_sweep_grid_past_64_rows_tiles_m_and_stays_small() -> None:
    sweep = _load_sweep()
    assert sweep.block_m_choices(64) == [64]
    assert sweep.block_m_choices(96) == [64, 128] and sweep.block_m_choices(256) == [64, 128, 256]
    for n, k in LLAMA3_8B.values():
        for m in (96, 128, 160, 192, 256):
            configs = sweep.config_grid(m, n, k, sweep.FULL_GRID, 132)
            assert configs[0] == sweep.default_of(m, n, k, 132)
            assert len(configs) <= 64 and len(set(configs)) == len(configs)
            for block_n, block_k, split, warps, stages, block_m in configs[1:]:
                assert stages * (block_n + block_m) * block_k * 2 <= skinny_gemm.SMEM_BUDGET
                assert block_n * block_m <= 128 * 32 * warps  # no accumulator spills
                assert split_k_plan(k, block_k, split)[1] == split
            assert {c[-1] for c in configs} == set(sweep.block_m_choices(m))
            assert any(c[0] == 256 for c in configs) and any(c[3] == 8 for c in configs)
    # Left out: the tiles whose sm_90 K loop spills (test_configs_compile_for_sm90 builds some).
    assert sweep.tall_tile(128, 64, 8, 128) and sweep.tall_tile(64, 64, 4, 128)
    assert not sweep.tall_tile(128, 128, 4, 64) and not sweep.tall_tile(256, 64, 8, 128)
    # Splits only where they fill the 132 SMs' waves better: 64 programs x 2 (not x 4, a tie),
    # 32 x 4, none for 128.
    assert sweep.tall_splits(64, 4096, 64, 132) == [1, 2]
    assert sweep.tall_splits(32, 4096, 64, 132) == [1, 4]
    assert sweep.tall_splits(128, 4096, 64, 132) == [1]
    # Distinct builds: the tile, several M tiles or one, split or not.
    assert sweep._compile_key(96, (64, 128, 1, 4, 4, 64)) != sweep._compile_key(
        96, (64, 128, 1, 4, 4, 128)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_layers_take_the_skinny_gemm_for_few_rows_only() -> None:
    from pagoda.kernels import few_rows_linear
    from pagoda.model.layers.linear import UnquantizedLinearMethod

    n, k = LLAMA3_8B["qkv"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    layer = torch.nn.Module()
    layer.weight, layer.fused_ops = torch.nn.Parameter(w, requires_grad=False), True
    for m, expect_skinny in ((1, False), (16, True), (48, False), (256, False)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert (few_rows_linear(x, w) is not None) == expect_skinny, m
        y = UnquantizedLinearMethod().apply(layer, x)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w), atol=2e-2, rtol=2e-2)
