"""With this folder on PYTHONPATH every Triton kernel launched as a programmatic dependent
waits for the kernel before it to end first and only then lets the next one launch (the
default lets the next one launch first, then waits)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../../..")))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from pagoda.attention.triton import reshape_and_cache, unified_attention  # noqa: E402
from pagoda.kernels import norm_act, scaled_mm_triton, triton_pdl, w4a16_wgmma  # noqa: E402


@triton.jit
def dependent_start(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


MODULES = [
    reshape_and_cache,
    unified_attention,
    norm_act,
    scaled_mm_triton,
    triton_pdl,
    w4a16_wgmma,
]
for m in MODULES:
    if os.environ.get("ONLY_MODULE", m.__name__) == m.__name__ and hasattr(m, "dependent_start"):
        m.dependent_start = dependent_start
