"""Triton kernels for paged attention on the GPU: the cache write (`reshape_and_cache`), the
mixed-batch `unified_attention` (with a split-KV decode path) and `TritonAttentionBackend`.
Import the submodules directly; this package imports no triton, so `pagoda` works without it.
"""
