#!/bin/bash
# After the rule took sc_prefetch: the GEMV's GPU tests (the fused SiLU-and-mul with the
# prefetch among them) and whole steps of the new rule against it without the prefetch.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_gemv.py \
  -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 | tee $OUT/check_tests.log
timeout 200 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 16 --reps 5 \
  --gemv-variants rule sc_prefetch=0 > $OUT/check_step.log 2>&1
tail -6 $OUT/check_step.log
