"""With this folder on PYTHONPATH the per-token row quantization (`quantize_rows_triton`) is
launched without programmatic dependent launch, every other kernel as the default says."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../../..")))
from pagoda.kernels import scaled_mm_triton as smt  # noqa: E402

_quantize, _pdl = smt.quantize_rows_triton, smt.pdl_enabled


def _no_pdl(*args, **kwargs):
    smt.pdl_enabled = lambda x: False
    try:
        return _quantize(*args, **kwargs)
    finally:
        smt.pdl_enabled = _pdl


smt.quantize_rows_triton = _no_pdl
