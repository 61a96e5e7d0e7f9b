#!/bin/bash
# Not yet run. The part of run.sh that fits a short call: the GEMV's GPU tests (the default
# path runs the rewritten bulk kernel), then whole steps at 1-16 rows with the ring's grid as
# it was and persistent (2 CTAs an SM), alternated. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-200}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
persist() { sed -i "s/^GEMV_PERSIST = [0-9]*/GEMV_PERSIST = $1/" pagoda/kernels/w4a16.py; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_cuda_launch.py -rf -x 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 > $OUT/tests.log
tail -4 $OUT/tests.log
for p in 0 2 0 2; do
  left 35 "step persist=$p" || continue
  persist $p
  timeout 35 python $B/w4a16_skinny_bench.py --step --m 1 4 8 16 --reps 5 \
    > $OUT/step_persist$p.log 2>&1; echo "persist=$p"; tail -4 $OUT/step_persist$p.log | cut -c1-50
done
persist 0
echo "done in $SECONDS s"
