"""Helpers that several layers use and that belong to none of them: the C build of the CPU
kernels (`cpu_build`, used by `pagoda.kernels.cpu` and `pagoda.attention.cpu`), the
garbage collector's start-up freeze (`heap`, used by the engine and the tensor-parallel
workers) and a request's nested parameter objects as dataclasses (`fields`). Nothing here imports another part of Pagoda but `pagoda.envs`."""
