"""Native CPU paged attention: a C kernel built at first use and called through ctypes.

`build.py` compiles and caches `paged_attention.c`; `backend.py` is the `"cpu"` attention
backend that plans a step's work items and calls the kernel (the registry in
`pagoda.attention.backend` picks it by default on CPU and falls back to `"torch"` without it).
"""
