#!/bin/bash
# Not yet run. The part of run.sh that fits a short call: the GEMV's GPU tests (the default
# path runs the rewritten bulk kernel), then whole steps at 1-16 rows with the rule as it is,
# with its scales and zero points through the ring (sc_ring), and that as a persistent grid
# of 2 CTAs an SM, alternated. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-200}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
variant() {  # persist, sc_ring
  sed -i -e "s/^GEMV_PERSIST = [0-9]*/GEMV_PERSIST = $1/" \
    -e "s/^GEMV_SC_RING = [0-9]*/GEMV_SC_RING = $2/" pagoda/kernels/w4a16.py
}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_cuda_launch.py -rf -x 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 > $OUT/tests.log
tail -4 $OUT/tests.log
i=0
for v in 0,0 0,1 2,1 0,0 0,1 2,1; do
  i=$((i + 1))
  left 35 "step persist,sc_ring=$v" || continue
  variant ${v%,*} ${v#*,}
  timeout 35 python $B/w4a16_skinny_bench.py --step --m 1 4 8 16 --reps 5 \
    > $OUT/step$i-$v.log 2>&1; echo "persist,sc_ring=$v"; tail -4 $OUT/step$i-$v.log | cut -c1-50
done
variant 0 0
echo "done in $SECONDS s"
