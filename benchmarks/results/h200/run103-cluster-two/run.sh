#!/bin/bash
# The W4A16 wgmma kernel's K splits summed in a cluster up to two-way splits only (the new
# default, PAGODA_W4A16_CLUSTER_SPLIT=2) against none (=0), whole steps at 128-256 rows, in
# turn twice. The GEMV with x's rows in shared memory, copied by its producer's bulk copies
# (x_smem=1, 8% slower end to end in run 102) or by its consumers' cp.async copies (x_smem=2):
# GPU tests, then whole steps at 1-8 rows against the rule (the step bench's variants, in turn
# twice), then single-stream AWQ decode with the defaults and with PAGODA_W4A16_X_SMEM=2.
# Writes to $OUT.
cd "$(dirname "$0")/../../../.." || exit 1
export PYTHONUNBUFFERED=1
B=benchmarks
LIMIT=${LIMIT:-430}
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { echo "skipped (time): $2"; false; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 110 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_w4a16_wgmma.py -k "x_in_shared or pdl_chain or cluster or split" -rf 2>&1 \
  | grep -E "FAILED|passed|failed|rror" | cut -c1-400 | tee $OUT/tests.log
left 80 "x_smem steps" && timeout 80 python $B/w4a16_skinny_bench.py --step --m 1 4 8 \
  --reps 5 --gemv-variants rule x_smem=1 x_smem=2 --out $OUT/step_x_smem.json \
  > $OUT/step_x_smem.log 2>&1
tail -4 $OUT/step_x_smem.log
n=0
for s in 2 0 2 0; do
  n=$((n + 1))
  left 45 "steps cluster=$s ($n)" || continue
  PAGODA_W4A16_CLUSTER_SPLIT=$s timeout 40 python $B/w4a16_skinny_bench.py --step \
    --m 128 192 256 --reps 10 --out $OUT/step_cluster$s.$n.json > $OUT/step_cluster$s.$n.log 2>&1
  echo "cluster=$s ($n):"; tail -3 $OUT/step_cluster$s.$n.log
done
for s in 0 2; do
  left 50 "b awq x_smem=$s" || continue
  PAGODA_W4A16_X_SMEM=$s OUT=/tmp/b timeout 70 python $B/h200_bench.py --only b \
    --quantization awq > $OUT/b_awq_x_smem$s.log 2>&1
  echo "b awq x_smem=$s: $(grep -E '^b Pagoda decode tok/s' $OUT/b_awq_x_smem$s.log | tr -s ' ')"
done
echo "done in $SECONDS s"
