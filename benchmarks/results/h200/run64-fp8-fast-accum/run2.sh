#!/bin/bash
# After run.sh: the fast and exact FP8 products' errors on the deepest layer (the test that
# failed there, its bounds since corrected), then the GPU tests of the FP8 accumulation and
# of the 8-bit model path (test_w8a8: greedy tokens eager, in CUDA graphs, fused and unfused).
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
O=$OUT/run64b && mkdir -p $O
python - <<'PY' 2>&1 | grep -v Warn | tee $O/errors.log
import os, sys, torch
sys.path.insert(0, "tests/kernels")
from test_scaled_mm import _problem
from pagoda.kernels.scaled_mm import FP8_DTYPE, scaled_mm, scaled_mm_ref
for m in (16, 300):
    x, w_q, w_scale, bias = _problem(m, 14336, 4096, FP8_DTYPE, device="cuda", x_dtype=torch.bfloat16)
    ref = scaled_mm_ref(x, w_q, w_scale, bias).float()
    for fast in ("1", "0"):
        os.environ["PAGODA_FP8_FAST_ACCUM"] = fast
        y = scaled_mm(x, w_q, w_scale, bias).float()
        print(f"m={m} fast={fast}: relative error {float((y - ref).norm() / ref.norm()):.2e}")
PY
timeout 240 python -m pytest -q -p no:cacheprovider tests/kernels/test_scaled_mm.py \
  tests/model/test_w8a8.py -m gpu -k "accum or w8a8" -rf 2>&1 | grep -E "FAILED|passed|failed" \
  | cut -c1-400 | tee $O/tests.log
echo "done in $SECONDS s"
