"""With this folder on PYTHONPATH the 8-bit CUDA GEMM (`w8a8_wgmma`) is launched without
programmatic dependent launch, every other kernel as the default says."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../../..")))
from pagoda.kernels import w8a8_wgmma  # noqa: E402

w8a8_wgmma.pdl_enabled = lambda x: False
