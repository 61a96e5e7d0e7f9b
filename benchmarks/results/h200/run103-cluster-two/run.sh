#!/bin/bash
# The W4A16 wgmma kernel's K splits summed in a cluster up to two-way splits only (the new
# default, PAGODA_W4A16_CLUSTER_SPLIT=2) against none (=0), whole steps at 128-256 rows, in
# turn twice; the GEMV with x's rows in shared memory (x_smem=1) against the rule at 1-8 rows
# (the step bench's variants, in turn twice), which run 102 timed only end to end; then
# single-stream AWQ decode with the defaults. Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-400}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_wgmma.py \
  -k "cluster or split" -rf 2>&1 | grep -E "FAILED|passed|failed|rror" | cut -c1-400 \
  | tee $OUT/tests.log
n=0
for s in 2 0 2 0; do
  n=$((n + 1))
  left 50 "steps cluster=$s ($n)" || continue
  PAGODA_W4A16_CLUSTER_SPLIT=$s timeout 45 python $B/w4a16_skinny_bench.py --step \
    --m 128 192 256 --reps 10 --out $OUT/step_cluster$s.$n.json > $OUT/step_cluster$s.$n.log 2>&1
  echo "cluster=$s ($n):"; tail -3 $OUT/step_cluster$s.$n.log
done
left 70 "x_smem steps" && timeout 70 python $B/w4a16_skinny_bench.py --step --m 1 4 8 \
  --reps 5 --gemv-variants rule x_smem=1 --out $OUT/step_x_smem.json > $OUT/step_x_smem.log 2>&1
tail -4 $OUT/step_x_smem.log
left 60 "b awq" && OUT=/tmp/b timeout 75 python $B/h200_bench.py --only b --quantization awq \
  > $OUT/b_awq.log 2>&1
echo "b awq: $(grep -E '^b Pagoda decode tok/s' $OUT/b_awq.log | tr -s ' ')"
echo "done in $SECONDS s"
