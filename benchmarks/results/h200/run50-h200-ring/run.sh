#!/bin/bash
# Run on an H200 (README.md). One call for an H200 (or whatever comes): run 49 (the GEMV's GPU tests, steps
# at 1-16 rows with sc_ring 0/1 and 3 stages, single-stream AWQ decode with sc_ring 0/1) in
# $OUT/49; run 48 (Nsight Compute's warp stalls of the GEMV at 1 row, gate_up and qkv, with
# and without sc_ring) in $OUT/48; then, time left, the ring's sweep (2-4 stages of 1-2 K
# steps a warp, with and without sc_ring, the rule's four tile shapes) at 1 and 16 rows per
# layer in $OUT/ring. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-570}
mkdir -p $OUT/49 $OUT/48 $OUT/ring
OUT=$OUT/49 LIMIT=250 bash $B/results/h200/run49-gemv-sc-ring/run.sh
OUT=$OUT/48 timeout $((LIMIT - SECONDS - 20)) bash $B/results/h200/run48-gemv-stalls/run.sh
[ $((LIMIT - SECONDS)) -gt 60 ] && timeout $((LIMIT - SECONDS - 10)) python \
  $B/w4a16_skinny_bench.py --gemv-ring --no-sweep --no-wgmma-sweep --m 1 16 --reps 10 \
  --out $OUT/ring/ring.json > $OUT/ring/ring.log 2>&1
tail -3 $OUT/ring/ring.log
echo "done in $SECONDS s"
