#!/bin/bash
# Not yet run. The part of run.sh that fits a short call: the GEMV's GPU tests (the default
# path runs the rewritten bulk kernel), then whole steps at 1-16 rows with the rule as it is,
# with its scales and zero points through the ring (sc_ring), deeper rings and persistent
# grids of 2-3 CTAs an SM, in one process, the variants in turn twice. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-330}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_cuda_launch.py -rf --maxfail=10 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 > $OUT/tests.log
tail -4 $OUT/tests.log
# persist,sc_ring[,stages]: without sc_ring where its tests failed (a fault ends the process)
V="0,0 0,1 0,1,3 0,1,4 2,1 3,1"
grep -q "FAILED.*scales_through" $OUT/tests.log && V="0,0 0,0,3 0,0,4 2,0 3,0"
left 60 "steps at 1-16 rows" && timeout $((LIMIT - SECONDS - 10)) python $B/w4a16_skinny_bench.py --step \
  --m 1 4 8 16 --gemv-variants $V --reps 5 --out $OUT/variants.json \
  > $OUT/variants.log 2>&1; tail -6 $OUT/variants.log
echo "done in $SECONDS s"
