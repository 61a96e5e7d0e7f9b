"""With this folder on PYTHONPATH the Triton kernels of `scaled_mm_triton` (the per-token row
quantization, the Triton 8-bit GEMM) wait for the kernel before them first and only then let
the next one launch; every other kernel as the default says."""

import importlib.util
import os

os.environ["ONLY_MODULE"] = "pagoda.kernels.scaled_mm_triton"
_path = os.path.join(os.path.dirname(__file__), "../all_wait_first/sitecustomize.py")
_spec = importlib.util.spec_from_file_location("_wait_first", _path)
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
