#!/bin/bash
# Run 93 found the GEMV's consumers waiting on the ring (38-49% of the stall samples) and on
# their scale loads (~10%, a step ahead from DRAM). The producer's L2 prefetch of the CTA's
# scale and zero-point rows (`GemvConfig.sc_prefetch`) and a third ring stage, in whole steps
# at 1-16 rows (`--step --gemv-variants`, in turn twice), and the GEMV's GPU tests of them.
# Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_gemv.py \
  -k "prefetch or ring" -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-300 \
  | tee $OUT/tests.log
timeout 300 python benchmarks/w4a16_skinny_bench.py --step --m 1 4 8 16 --reps 5 \
  --gemv-variants rule sc_prefetch=1 stages=3 sc_prefetch=1,stages=3 > $OUT/step.log 2>&1
tail -14 $OUT/step.log
echo "done in $SECONDS s"
