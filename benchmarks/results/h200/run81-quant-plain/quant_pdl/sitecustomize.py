"""With this folder on PYTHONPATH the per-token row quantization is launched as a programmatic
dependent of the kernel before it (launch_pdl where `pdl_enabled`), as before run 81."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../../..")))
import torch  # noqa: E402
import triton  # noqa: E402

from pagoda.kernels import scaled_mm_triton as smt  # noqa: E402


def quantize_rows_pdl(x, dtype, min_rows=0):
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((max(m, min_rows), k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(k), 4096)
    pdl = smt.pdl_enabled(x)
    smt._quant_rows_kernel[(m,)](
        x, q, scale, x.stride(0), q.stride(0), k,
        QMAX=smt.INT8_MAX if dtype == torch.int8 else smt.FP8_MAX,
        IS_INT=dtype == torch.int8, BLOCK=block, ONE_PASS=k <= block, PDL=pdl,
        launch_pdl=pdl, num_warps=min(max(block // 256, 1), 8),
    )  # fmt: skip
    return q, scale


smt.quantize_rows_triton = quantize_rows_pdl
