"""cuBLASLt with a timed algorithm choice (`pagoda.kernels.cublaslt`) against `F.linear`: every
algorithm the heuristic offers, the chosen one at its own and at fewer rows, bf16 and fp16, and
inside a CUDA graph. On a CPU: the row buckets, the CPU fallback, and the descriptors and
launch arguments through a stand-in library."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cublaslt

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _fresh_choices():
    cublaslt._CHOICES.clear()
    yield
    cublaslt._CHOICES.clear()


def test_rows_buckets() -> None:
    buckets = [cublaslt.rows_bucket(m) for m in (33, 40, 41, 250, 256, 512, 513, 7775, 8192)]
    assert buckets == [40, 40, 48, 256, 256, 512, 1024, 8192, 8192]


def test_cpu_tensors_keep_torch(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "enabled", lambda: pytest.fail("no library on a CPU path"))
    x, w = torch.randn(64, 32), torch.randn(48, 32)
    assert cublaslt.tuned_linear(x, w) is None


class _StandIn:
    """Records the cuBLASLt calls; offers two algorithms."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.next_handle = 100

    def _new(self, ref) -> None:
        self.next_handle += 1
        ref._obj.value = self.next_handle

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name in ("cublasLtMatmulDescCreate", "cublasLtMatmulPreferenceCreate"):
                self._new(args[0])
            elif name == "cublasLtMatrixLayoutCreate":
                self._new(args[0])
            elif name == "cublasLtMatmulAlgoGetHeuristic":
                results, count = args[8], args[9]
                for i in range(2):
                    results[i].state, results[i].workspace_size = 0, 1024 * i
                count._obj.value = 2
            elif name == "cublasLtMatmulAlgoConfigGetAttribute":
                return 1  # no configuration to report
            return 0

        return call

    def named(self, name: str) -> list[tuple]:
        return [args for n, args in self.calls if n == name]


def test_descriptors_and_launch_through_a_stand_in(monkeypatch) -> None:
    lib = _StandIn()
    monkeypatch.setattr(cublaslt, "_lib", lambda: lib)
    monkeypatch.setattr(cublaslt, "_handle", lambda: ctypes.c_void_p(1))
    lt = cublaslt.LtMatmul(48, 96, 64, torch.bfloat16)
    assert len(lt.candidates) == 2
    # W [N, K] row-major is A = K x N column-major, taken transposed; x is B = K x M; D = N x M.
    layouts = [args[1:] for args in lib.named("cublasLtMatrixLayoutCreate")]
    assert layouts == [(14, 64, 96, 64), (14, 64, 48, 64), (14, 96, 48, 96)]
    trans = [(a[1], a[2]._obj.value) for a in lib.named("cublasLtMatmulDescSetAttribute")]
    assert trans == [(3, 1), (4, 0)]  # TRANSA = T, TRANSB = N

    lt.set_rows(40)
    cols = [
        (a[0].value, a[1], a[2]._obj.value) for a in lib.named("cublasLtMatrixLayoutSetAttribute")
    ]
    assert cols == [(lt.b_layout.value, 3, 40), (lt.d_layout.value, 3, 40)]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=7))
    x, w, out = torch.randn(40, 64), torch.randn(96, 64), torch.empty(40, 96)
    ws = torch.empty(16)
    lt.run(x, w, out, lt.candidates[1], ws)
    (args,) = lib.named("cublasLtMatmul")
    assert args[3] == w.data_ptr() and args[5] == x.data_ptr()
    assert args[8] == args[10] == out.data_ptr()
    assert (args[4], args[6], args[9], args[11]) == (
        lt.a_layout,
        lt.b_layout,
        lt.d_layout,
        lt.d_layout,
    )
    assert args[13:] == (ws.data_ptr(), cublaslt.WORKSPACE_BYTES, 7)


# --- on the GPU ---------------------------------------------------------------------------


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(40, 6144, 4096), (256, 4096, 14336), (1000, 3072, 1024)])
def test_every_offered_algorithm_matches_torch(dtype, rows, n, k) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    w = torch.randn(n, k, dtype=dtype, device="cuda") / k**0.5
    ref = F.linear(x, w)
    lt = cublaslt.LtMatmul(rows, n, k, dtype)
    assert lt.candidates
    ws = cublaslt._workspace(x.device)
    for cand in lt.candidates:
        out = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
        _close(lt.run(x, w, out, cand, ws), ref)


@gpu
@pytest.mark.gpu
def test_chosen_algorithm_at_fewer_rows_and_in_a_graph(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "MIN_GAIN", -10.0)  # take the fastest algorithm, never torch
    torch.manual_seed(1)
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") / 64
    x = torch.randn(256, 4096, dtype=torch.bfloat16, device="cuda")
    _close(cublaslt.tuned_linear(x, w), F.linear(x, w))
    (choice,) = cublaslt._CHOICES.values()
    assert choice is not None
    # 250 rows fall in the 256-row bucket: the same algorithm, checked for 250 rows.
    _close(cublaslt.tuned_linear(x[:250], w), F.linear(x[:250], w))
    assert set(choice.checked) == {256, 250}
    # Captured after the warm-up call above; replayed on new inputs.
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = cublaslt.tuned_linear(static_x, w)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    _close(static_y, F.linear(static_x, w))


@gpu
@pytest.mark.gpu
def test_problem_first_seen_in_a_capture_keeps_torch() -> None:
    w = torch.randn(1024, 512, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(96, 512, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cublaslt.tuned_linear(x, w)
    assert y is None and not cublaslt._CHOICES  # not tuned inside the capture
