#!/bin/bash
# The wgmma W4A16 kernel's first run: its GPU tests, the structured probe (which index is wrong,
# if any), the sweep of its tiles against the rule and bf16 cuBLAS at 32-1024 rows, and whole
# decode steps. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
R=$B/results/h200/run37-w4a16-wgmma
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_wgmma.py -rf -x 2>&1 \
  | grep -E "FAILED|passed|failed|rror|assert" | cut -c1-400 > $OUT/tests.log; tail -3 $OUT/tests.log
if grep -qE "failed|rror" $OUT/tests.log; then
  timeout 60 python $R/probe.py > $OUT/probe.log 2>&1; cut -c1-300 $OUT/probe.log | head -30
fi
timeout 200 python $B/w4a16_skinny_bench.py --m 32 64 128 256 1024 --no-sweep --no-cuda-sweep \
  --reps 5 --out $OUT/sweep.json > $OUT/sweep.log 2>&1; tail -9 $OUT/sweep.log
timeout 120 python $B/w4a16_skinny_bench.py --step --m 1 16 32 64 128 256 --reps 5 \
  > $OUT/step.log 2>&1; tail -8 $OUT/step.log
