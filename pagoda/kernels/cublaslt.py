"""cuBLASLt through ctypes: a bf16/fp16 `y = x @ W^T` with a chosen algorithm.

torch's bf16 matmul runs cuBLAS, whose kernel is the first answer of cuBLASLt's heuristic. For
the decode batches of a large model (M = 64..256 rows against 4k..28k-row weights) that first
answer is often not the fastest: the heuristic returns a ranked list, and its later entries
(other tile shapes, split-K, cluster shapes) can win by a wide margin on these wave-quantized
shapes. `LtMatmul` asks the heuristic for up to `max_algos` algorithms of one (M, N, K)
problem, and `LtMatmul.run(x, w, out, algo)` launches one of them on torch's current stream,
so it can be captured in a CUDA graph. Choosing between them by timing is `tune_linear`.

Row-major y[M, N] = x[M, K] @ W[N, K]^T is computed as the column-major D[N, M] = op(A) B with
A = W stored K x N (ld K) taken transposed, B = x stored K x M (ld K): torch's own "TN" call.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

# cublasComputeType_t, cudaDataType_t and attribute enums (cublasLt.h, cublas_api.h).
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_LAYOUT_COLS = 3
_OP_N, _OP_T = 0, 1
_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "stages": 6}
_CONFIG_ATTRS_U16 = {"cluster": 8}
WORKSPACE_BYTES = 32 << 20

logger = logging.getLogger(__name__)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


_LIB: ctypes.CDLL | None = None


def _find_library() -> str:
    names = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")
    roots = [os.path.dirname(os.path.dirname(torch.__file__))]
    for root in roots:
        for name in names:
            hits = glob.glob(os.path.join(root, "nvidia", "**", name), recursive=True)
            if hits:
                return hits[0]
    return names[0]  # let the loader search its own path


def _lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(_find_library())
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        signatures = {
            "cublasLtCreate": [vp],
            "cublasLtMatmulDescCreate": [vp, i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [
                vp,
                i32,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.c_int64,
            ],
            "cublasLtMatmulPreferenceCreate": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp] * 7 + [i32, vp, vp],
            "cublasLtMatmulAlgoConfigGetAttribute": [vp, i32, vp, sz, vp],
            "cublasLtMatrixLayoutSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoCheck": [vp] * 8,
            # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
            # workspace bytes, stream
            "cublasLtMatmul": [vp] * 14 + [sz, vp],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _LIB = lib
    return _LIB


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


_HANDLE: ctypes.c_void_p | None = None


def _handle() -> ctypes.c_void_p:
    global _HANDLE
    if _HANDLE is None:
        handle = ctypes.c_void_p()
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "create")
        _HANDLE = handle
    return _HANDLE


@dataclass
class Candidate:
    """One algorithm the heuristic offered, with its rank and what it is."""

    rank: int
    algo: _Algo
    workspace: int
    waves: float
    config: dict[str, int]


class LtMatmul:
    """Descriptors of y[M, N] = x[M, K] @ W[N, K]^T in one 16-bit dtype, and the algorithms the
    heuristic offers for `rows` rows (best first). `set_rows` points the descriptors at another
    row count, for which an algorithm must be checked (`supports`) before it runs."""

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, max_algos: int = 8):
        lib = _lib()
        dt = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}[dtype]
        self.n, self.k, self.dtype = n, k, dtype
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            val = ctypes.c_int32(op)
            _check(
                lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(val), 4), "trans"
            )
        self.a_layout, self.b_layout, self.d_layout = (ctypes.c_void_p() for _ in range(3))
        for layout, r, c in (
            (self.a_layout, k, n),
            (self.b_layout, k, rows),
            (self.d_layout, n, rows),
        ):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, r, c, r), "layout")
        self.rows = rows
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8
            ),
            "workspace preference",
        )
        results = (_HeuristicResult * max_algos)()
        count = ctypes.c_int(0)
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                _handle(),
                self.desc,
                self.a_layout,
                self.b_layout,
                self.d_layout,
                self.d_layout,
                pref,
                max_algos,
                results,
                ctypes.byref(count),
            ),
            "heuristic",
        )
        lib.cublasLtMatmulPreferenceDestroy(pref)
        self.candidates = [
            Candidate(i, r.algo, r.workspace_size, r.waves_count, _config(r.algo))
            for i, r in enumerate(results[: count.value])
            if r.state == 0 and r.workspace_size <= WORKSPACE_BYTES
        ]
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)

    def set_rows(self, rows: int) -> None:
        if rows != self.rows:
            val = ctypes.c_uint64(rows)
            for layout in (self.b_layout, self.d_layout):
                _check(
                    _lib().cublasLtMatrixLayoutSetAttribute(
                        layout, _LAYOUT_COLS, ctypes.byref(val), 8
                    ),
                    "rows",
                )
            self.rows = rows

    def supports(self, cand: Candidate) -> bool:
        """Whether `cand` runs the problem at the current row count (cublasLtMatmulAlgoCheck)."""
        result = _HeuristicResult()
        status = _lib().cublasLtMatmulAlgoCheck(
            _handle(),
            self.desc,
            self.a_layout,
            self.b_layout,
            self.d_layout,
            self.d_layout,
            ctypes.byref(cand.algo),
            ctypes.byref(result),
        )
        return status == 0 and result.workspace_size <= WORKSPACE_BYTES

    def run(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor,
        cand: Candidate,
        workspace: torch.Tensor,
    ) -> torch.Tensor:
        """out[M, N] = x[M, K] @ w[N, K]^T with `cand`'s algorithm on the current stream
        (M = `self.rows`; all three contiguous)."""
        _check(
            _lib().cublasLtMatmul(
                _handle(),
                self.desc,
                ctypes.byref(self._alpha),
                w.data_ptr(),
                self.a_layout,
                x.data_ptr(),
                self.b_layout,
                ctypes.byref(self._beta),
                out.data_ptr(),
                self.d_layout,
                out.data_ptr(),
                self.d_layout,
                ctypes.byref(cand.algo),
                workspace.data_ptr(),
                WORKSPACE_BYTES,
                torch.cuda.current_stream(x.device).cuda_stream,
            ),
            "matmul",
        )
        return out


def _config(algo: _Algo) -> dict[str, int]:
    lib = _lib()
    config = {}
    for name, attr in _CONFIG_ATTRS.items():
        val, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        if (
            lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(val), 4, ctypes.byref(written)
            )
            == 0
        ):
            config[name] = int(val.value)
    for name, attr in _CONFIG_ATTRS_U16.items():
        val16, written = ctypes.c_uint16(0), ctypes.c_size_t(0)
        if (
            lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(val16), 2, ctypes.byref(written)
            )
            == 0
        ):
            config[name] = int(val16.value)
    return config


# --- choosing an algorithm per problem, by timing ---------------------------------------------

MIN_ROWS = 33  # fewer rows: the GEMV and the skinny GEMM (`pagoda.kernels`)
# A candidate must beat torch's own call by this much to replace it.
MIN_GAIN = 0.02
# Scratch weights for timing: copies up to this many bytes, so a problem whose weight fits in
# L2 (60 MB on an H200) is timed streaming it from memory, as in a decode step.
TIMING_BYTES = 160e6
_UNTUNED = object()


@dataclass
class Choice:
    """The algorithm chosen for one (rows bucket, N, K, dtype, device), and the row counts it
    was checked for."""

    matmul: LtMatmul
    cand: Candidate
    checked: dict[int, bool]


_CHOICES: dict[tuple, Choice | None] = {}
# What tuning has cost so far in this process: problems timed, seconds, cuBLASLt chosen.
stats = {"problems": 0, "seconds": 0.0, "chosen": 0}
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


@functools.cache
def enabled() -> bool:
    """PAGODA_CUBLASLT=0 turns the tuned path off; so does a cuBLASLt that cannot be loaded."""
    if os.environ.get("PAGODA_CUBLASLT", "1") == "0":
        return False
    try:
        _handle()
    except (OSError, AttributeError, RuntimeError) as e:
        logger.warning("cuBLASLt algorithm choice off: %s", e)
        return False
    return True


def rows_bucket(m: int) -> int:
    """The row count an algorithm is chosen for: multiples of 8 up to 512 (the CUDA-graph
    batch sizes), then powers of two (prefill)."""
    return -(-m // 8) * 8 if m <= 512 else 1 << (m - 1).bit_length()


def tuned_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x[M, K] @ weight[N, K]^T with the fastest cuBLASLt algorithm measured for the problem,
    or None where torch's call is kept: CPU tensors, other dtypes or layouts, fewer than
    MIN_ROWS rows, no algorithm faster than torch's, or a problem first seen inside a CUDA-graph
    capture (timing cannot run there; the warm-up run before each capture tunes it)."""
    if not (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.shape[0] >= MIN_ROWS
        and x.is_contiguous()
        and weight.is_contiguous()
        and enabled()
    ):
        return None
    m, k = x.shape
    n = weight.shape[0]
    key = (rows_bucket(m), n, k, x.dtype, x.device)
    choice = _CHOICES.get(key, _UNTUNED)
    if choice is _UNTUNED:
        if torch.cuda.is_current_stream_capturing():
            return None
        choice = _CHOICES[key] = _tune(x, weight)
    if choice is None:
        return None
    lt = choice.matmul
    lt.set_rows(m)
    ok = choice.checked.get(m)
    if ok is None:
        ok = choice.checked[m] = lt.supports(choice.cand)
    if not ok:
        return None
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    return lt.run(x, weight, out, choice.cand, _workspace(x.device))


def _workspace(device: torch.device) -> torch.Tensor:
    ws = _WORKSPACES.get(device)
    if ws is None:
        ws = _WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def _time_us(fn, calls: int, graph: bool) -> float:
    """us per call of fn(i), i = 0..calls-1: replayed from a CUDA graph (short calls, where a
    launch from Python would take longer than the GEMM) or launched directly; best of 3."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        g = torch.cuda.CUDAGraph()
        # thread_local: work of other threads (output copies) is not an error during capture.
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for i in range(calls):
                fn(i)
        g.replay()

        def launch() -> None:
            g.replay()

    else:

        def launch() -> None:
            for i in range(calls):
                fn(i)

    best = float("inf")
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def _tune(x: torch.Tensor, weight: torch.Tensor) -> Choice | None:
    """Time torch's call and the heuristic's algorithms on this problem; the fastest one that
    beats torch by MIN_GAIN, or None. Decode-sized problems (up to 512 rows) cycle through
    scratch copies of the weight so that it streams from memory as in a step; larger ones are
    compute-bound and time the weight itself."""
    rows, k = x.shape
    n = weight.shape[0]
    start = time.perf_counter()
    try:
        choice = _time_candidates(x, weight)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        logger.warning("cuBLASLt tuning of %dx%dx%d failed, torch's GEMM kept: %s", rows, n, k, e)
        choice = None
    if rows <= 512:
        torch.cuda.empty_cache()  # the scratch weights, out of the CUDA-graph memory figure
    stats["problems"] += 1
    stats["seconds"] += time.perf_counter() - start
    stats["chosen"] += choice is not None
    return choice


def _time_candidates(x: torch.Tensor, weight: torch.Tensor) -> Choice | None:
    rows, k = x.shape
    n = weight.shape[0]
    lt = LtMatmul(rows, n, k, x.dtype)
    if not lt.candidates:
        return None
    weights = [weight]
    if rows <= 512:
        copies = min(4, math.ceil(TIMING_BYTES / (n * k * weight.element_size())))
        weights += [torch.randn_like(weight) for _ in range(copies - 1)]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    ws = _workspace(x.device)
    # ~0.3 ms of work per replay at 400 TFLOP/s, 2 to 16 calls.
    calls = max(2, min(16, math.ceil(0.3e-3 * 400e12 / (2 * rows * n * k))))
    nw = len(weights)
    graph = rows <= 512
    base = _time_us(lambda i: torch.mm(x, weights[i % nw].t(), out=out), calls, graph)
    best, best_us = None, base * (1 - MIN_GAIN)
    for cand in lt.candidates:
        us = _time_us(lambda i, c=cand: lt.run(x, weights[i % nw], out, c, ws), calls, graph)
        if us < best_us:
            best, best_us = cand, us
    logger.debug(
        "cuBLASLt %dx%dx%d: torch %.1f us, best %s",
        rows,
        n,
        k,
        base,
        f"#{best.rank} {best_us:.1f} us {best.config}" if best else "torch",
    )
    return Choice(lt, best, {rows: True}) if best is not None else None
