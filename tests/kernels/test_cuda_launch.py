"""NVRTC kernels built off the main thread (`cuda_launch.build`): a thread that has made no
CUDA runtime call has no current context, and loading a module there used to fail."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from pagoda.kernels import cuda_launch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_ADD_ONE = """
extern "C" __global__ void add_one(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.f;
}
"""


class _Driver:
    """The four driver calls of `bind_context`, with `current` as the thread's context."""

    def __init__(self, current: int | None) -> None:
        self.current, self.calls = current, []

    def cuCtxGetCurrent(self, out):  # noqa: N802 (the driver's names)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self.current
        return 0

    def cuDeviceGet(self, out, ordinal):  # noqa: N802
        self.calls.append(("device", ordinal))
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = 7
        return 0

    def cuDevicePrimaryCtxRetain(self, out, dev):  # noqa: N802
        self.calls.append(("retain", dev.value))
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1234
        return 0

    def cuCtxSetCurrent(self, ctx):  # noqa: N802
        self.calls.append(("set", ctx.value))
        return 0


def test_bind_context_sets_the_primary_context_only_where_none_is_current(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bound = _Driver(current=0xABC)
    monkeypatch.setattr(cuda_launch, "libcuda", lambda: bound)
    cuda_launch.bind_context()
    assert bound.calls == []
    fresh = _Driver(current=None)
    monkeypatch.setattr(cuda_launch, "libcuda", lambda: fresh)
    cuda_launch.bind_context()
    assert fresh.calls == [("device", 0), ("retain", 7), ("set", 0x1234)]


@gpu
@pytest.mark.gpu
def test_a_kernel_built_on_a_fresh_thread_runs() -> None:
    x = torch.zeros(1000, device="cuda")
    del x  # its block stays in the caching allocator: the thread's tensor needs no cudaMalloc
    built = []

    def worker() -> None:
        torch.empty(1000, device="cuda")
        built.append(cuda_launch.build(_ADD_ONE, "add_one", {}, "test kernel"))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    (kernel,) = built
    assert kernel is not None
    y = torch.zeros(1000, device="cuda")
    cuda_launch.launch(kernel.func, (4, 1, 1), 256, 0, [y, 1000], y.device)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.ones_like(y))
