#!/bin/bash
# Run on an H200: results in ../run50-h200-ring/49/. The ring GEMV back to one CTA a tile (run 46: the persistent rewrite was
# 18-35% slower a step at 1-16 rows on an H100), now with sc_ring (each K step's scales and
# zero points through the ring with its weights). Its GPU tests; whole steps at 1-16 rows
# without and with sc_ring, and with 3 stages (`--gemv-variants`, in one process, in turn
# twice), and without the producer warp (the consumers refill the ring); then, time left,
# single-stream AWQ decode with the rule as it is and with sc_ring.
# Parts that would not finish within LIMIT seconds (240 by default) are skipped. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-240}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -q -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_cuda_launch.py -rf --maxfail=10 2>&1 | grep -E "FAILED|passed|failed|rror" \
  | cut -c1-300 > $OUT/tests.log
tail -4 $OUT/tests.log
# sc_ring[,stages[,producer]]; without sc_ring or without the producer-less ring where their
# tests failed (a fault ends the process)
V="0 1 1,3 1,2,0 0,2,0"
grep -q "FAILED.*scales_through" $OUT/tests.log && V="0 0,3 0,2,0"
grep -q "FAILED.*without_producer" $OUT/tests.log && V=$(echo $V | sed 's/ [01],2,0//g')
left 40 "steps at 1-16 rows" && timeout 60 python $B/w4a16_skinny_bench.py --step \
  --m 1 4 8 16 --gemv-variants $V --reps 5 --out $OUT/variants.json > $OUT/variants.log 2>&1
tail -6 $OUT/variants.log
for sc in 0 1; do
  left 80 "e2e b sc_ring=$sc" || continue
  sed -i "s/^GEMV_SC_RING = [0-9]*/GEMV_SC_RING = $sc/" pagoda/kernels/w4a16.py
  OUT=/tmp/b$sc timeout 75 python $B/h200_bench.py --only b --quantization awq > $OUT/b$sc.log 2>&1
  echo "b sc_ring=$sc: $(grep -E '^b Pagoda decode tok/s' $OUT/b$sc.log)"
done
sed -i "s/^GEMV_SC_RING = [0-9]*/GEMV_SC_RING = 0/" pagoda/kernels/w4a16.py
echo "done in $SECONDS s"
